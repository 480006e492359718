"""Connects peer replication (checkpoint/peers.py) to the agent, from `[peers]` (daemon/peers_config.py).

    from daemon import peers_wiring
    self.checkpoints = build_checkpoint_service(
        ..., replicator_factory=peers_wiring.replicator_factory(self.config.peers, self.host,
                                                                 shared_redis=self.embedded_redis is None),
        replicate_timeout_s=self.config.peers.timeout_s)

`replicator_factory` returns None when `replication_factor` is 1 (no peers). Otherwise the factory,
called with the node's Coordinator, checks that this node is in `nodes` and that its own entry is its
real memory directory (else `ConfigError`: the agent stops at start rather than copying into the wrong
place), and builds a `Replicator` to the placement's peers. Each CommitShard the agent accepts is then
copied to them in the background (`CheckpointService._replicate`, bounded by `timeout_s`).
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable

from daemon.errors import ConfigError
from daemon.peers_config import PeerNode, PeersConfig

if TYPE_CHECKING:
    from checkpoint.coordinator import Coordinator
    from checkpoint.peers import Replicator

log = logging.getLogger(__name__)


def plan_peers(cfg: PeersConfig, node: str) -> list[PeerNode]:
    """The nodes that receive copies of `node`'s shards, in placement order (pure; no I/O)."""
    if cfg.replication_factor <= 1:
        return []
    from checkpoint.peers import peers_of

    nodes = cfg.node_list()
    by_name = {n.name: n for n in nodes}
    if node not in by_name:
        raise ConfigError("peers.nodes", f"this node ({node!r}, from --hostname) is not listed; listed: "
                          f"{', '.join(by_name) or 'none'}")
    return [by_name[p] for p in peers_of(node, [n.name for n in nodes], cfg.stride, cfg.replication_factor)]


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def replicator_factory(cfg: PeersConfig | None, node: str, *,
                       shared_redis: bool = True) -> "Callable[[Coordinator], Replicator] | None":
    """For `build_checkpoint_service(replicator_factory=...)`; None without peers. `shared_redis` False (the
    agent's private embedded Redis) is refused: other nodes could never see the commit records or copies."""
    if cfg is None or cfg.replication_factor <= 1:
        return None
    if not shared_redis:
        raise ConfigError("peers.replication_factor", "peer replicas need the job's shared coordination Redis "
                          "(--redis-url); this agent runs a private embedded one")
    peers = plan_peers(cfg, node)   # fails now, before any service is built, on a misplaced node

    def build(coordinator: "Coordinator") -> "Replicator":
        from checkpoint.peers import Peer, Replicator

        me = next(n for n in cfg.node_list() if n.name == node)
        if not _same_dir(me.location, coordinator.location):
            raise ConfigError("peers.nodes", f"lists this node ({node}) at {me.location}, but its memory tier is "
                              f"{coordinator.location}")
        for p in peers:
            if _same_dir(p.location, coordinator.location):
                raise ConfigError("peers.nodes", f"peer {p.name}'s location {p.location} is this node's own "
                                  "memory tier")
        log.info("peer replicas: %s's shards are copied to %s (F=%d, J=%d)", node,
                 ", ".join(f"{p.name}={p.location}" for p in peers), cfg.replication_factor, cfg.stride)
        return Replicator(coordinator, [Peer(p.name, None, p.location) for p in peers])

    return build


def replicate_timeout_s(cfg: PeersConfig | None) -> float:
    return cfg.timeout_s if cfg is not None else 120.0
