"""Connects peer replication (checkpoint/peers.py) to the agent, from `[peers]` (daemon/peers_config.py).

    checkpoints = build_checkpoint_service(           # daemon/compose.py
        ..., replicator_factory=peers_wiring.replicator_factory(config.peers, host, shared_redis=not embedded),
        replicate_timeout_s=config.peers.timeout_s)

`replicator_factory` first sets this process's peer-transport credentials (`tls_ca`, `token_file`,
`insecure`: checkpoint.grpc_store.set_credentials), used for replication and for reading peers' copies
(VerifyCopies), even with F=1. It returns None when `replication_factor` is 1 (no peers). Otherwise the
factory, called with the node's Coordinator, checks that this node is in `nodes` and that its own entry is
its real memory directory or, for a URL, refers to this machine (a unix:// socket whose directory exists
here; a grpc(s):// host that resolves to an address of this machine: one it can bind), and that no peer's
entry is this node's own location (else `ConfigError`: the agent stops at start rather than copying into
the wrong place); then builds a `Replicator` to the placement's peers. Each CommitShard the agent accepts is
then copied to them in the background (`CheckpointService._replicate`, bounded by `timeout_s`).
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Callable

from checkpoint.coordinator import Coordinator
from checkpoint.grpc_store import (PeerCredentials, PeerTransport, parse_location, set_credentials,
                                   set_transport)
from checkpoint.peers import Peer, Replicator, peers_of
from daemon.errors import ConfigError
from daemon.peers_config import PeerNode, PeersConfig

log = logging.getLogger(__name__)


def plan_peers(cfg: PeersConfig, node: str) -> list[PeerNode]:
    """The nodes that receive copies of `node`'s shards, in placement order (pure; no I/O)."""
    if cfg.replication_factor <= 1:
        return []
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


def _is_local_host(host: str) -> bool:
    """True when `host` resolves to an address of this machine (one a socket can bind to)."""
    host = host[1:-1] if host.startswith("[") else host
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _type, _proto, _name, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def check_own_url(location: str) -> None:
    """ConfigError unless the URL `location` (this node's own entry) can be this machine's agent."""
    scheme, target = parse_location(location)
    if scheme == "unix":
        sock_dir = os.path.dirname(target[len("unix://"):])
        if not os.path.isdir(sock_dir):
            raise ConfigError("peers.nodes", f"lists this node at {location}, but {sock_dir} does not exist here")
        return
    host = target.rsplit(":", 1)[0]
    if not _is_local_host(host):
        raise ConfigError("peers.nodes", f"lists this node at {location}, but {host} is not an address of this "
                          "machine")


def configure_transport(cfg: PeersConfig | None) -> None:
    """Set this process's credentials (tls_ca, token_file, insecure), streams and cap for peer URLs from
    `[peers]`."""
    if cfg is None:
        return
    set_credentials(PeerCredentials(cfg.tls_ca, cfg.token_file, cfg.insecure))
    set_transport(PeerTransport(cfg.streams, cfg.max_mb_per_s * 1e6))
    if cfg.insecure:
        log.warning("peers.insecure: grpc:// peers are reached over PLAIN TCP (bytes and token unencrypted)")


def replicator_factory(cfg: PeersConfig | None, node: str, *,
                       shared_redis: bool = True) -> Callable[[Coordinator], Replicator] | None:
    """For `build_checkpoint_service(replicator_factory=...)`; None without peers. `shared_redis` False (the
    agent's private embedded Redis) is refused: other nodes could never see the commit records or copies.
    Sets the peer-transport credentials (`configure_transport`) in every case."""
    configure_transport(cfg)
    if cfg is None or cfg.replication_factor <= 1:
        return None
    if not shared_redis:
        raise ConfigError("peers.replication_factor", "peer replicas need the job's shared coordination Redis "
                          "(--redis-url); this agent runs a private embedded one")
    peers = plan_peers(cfg, node)   # fails now, before any service is built, on a misplaced node

    def build(coordinator: Coordinator) -> Replicator:
        me = next(n for n in cfg.node_list() if n.name == node)
        if me.is_url:
            check_own_url(me.location)
        elif not _same_dir(me.location, coordinator.location):
            raise ConfigError("peers.nodes", f"lists this node ({node}) at {me.location}, but its memory tier is "
                              f"{coordinator.location}")
        for p in peers:
            if p.location == me.location or (not p.is_url and _same_dir(p.location, coordinator.location)):
                raise ConfigError("peers.nodes", f"peer {p.name}'s location {p.location} is this node's own "
                                  "memory tier")
        log.info("peer replicas: %s's shards are copied to %s (F=%d, J=%d)", node,
                 ", ".join(f"{p.name}={p.location}" for p in peers), cfg.replication_factor, cfg.stride)
        return Replicator(coordinator, [Peer(p.name, None, p.location) for p in peers])

    return build


def replicate_timeout_s(cfg: PeersConfig | None) -> float:
    return cfg.timeout_s if cfg is not None else 120.0
