"""`[peers]`: copies of each shard in other nodes' memory tiers (checkpoint/peers.py, daemon/peers_wiring.py).

    [peers]
    nodes = "node-a=/dev/shm/sdcwatch-1000/a/memory,node-b=/dev/shm/sdcwatch-1000/b/memory"
    replication_factor = 2     # copies in all, this node's included; 1 = no peer copies (the default)
    stride = 1                 # J: node n's copies go to nodes n+J, n+2J, ... (mod N)

Every key is also a flag: `--peers-nodes`, `--peers-replication-factor`, `--peers-stride`,
`--peers-timeout-s`. `nodes` is the job's whole node list in one fixed order, the same
on every node (so every node computes the same placement), each entry `NAME=LOCATION`, comma-separated.
LOCATION is where this agent can write that node's memory tier: today a directory (the same host, or a
filesystem the nodes share). Network addresses (`grpc://host:port`) are refused until a network transport
exists (see docs/checkpoints.md, "Peers"). A node's name is its agent's `[agent] hostname` (`--hostname`),
the name its commit records and copies carry, so there is no separate node id to disagree with it; its
own entry names its memory directory, which the agent checks against its real one at start.
"""
from __future__ import annotations

import dataclasses
import re

from daemon.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,253}$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


@dataclasses.dataclass(frozen=True, slots=True)
class PeerNode:
    name: str
    location: str    # a directory (absolute path)


def parse_nodes(text: str, key: str = "peers.nodes") -> list[PeerNode]:
    """'a=/dir/a, b=/dir/b' -> [PeerNode('a', '/dir/a'), PeerNode('b', '/dir/b')] (order kept). ConfigError
    for an entry without '=', a bad name, a duplicate, a relative path or a network address."""
    out: list[PeerNode] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, location = (s.strip() for s in entry.partition("="))
        if not sep or not location:
            raise ConfigError(key, f"entry {entry!r}: expected NAME=LOCATION (a directory)")
        if not _NAME.match(name):
            raise ConfigError(key, f"entry {entry!r}: node name {name!r} may hold only letters, digits, '_', '.', '-'")
        if any(n.name == name for n in out):
            raise ConfigError(key, f"node {name!r} is listed twice")
        if _URL.match(location):
            raise ConfigError(key, f"entry {entry!r}: only directory locations are supported; a network transport "
                              "to a peer's memory tier is not built yet")
        if not location.startswith("/"):
            raise ConfigError(key, f"entry {entry!r}: the location must be an absolute directory path")
        out.append(PeerNode(name, location.rstrip("/") or "/"))
    return out


@dataclasses.dataclass(kw_only=True, slots=True)
class PeersConfig:
    nodes: str = ""                  # NAME=DIR,NAME=DIR,... every node of the job, in one fixed order
    replication_factor: int = 1      # F: copies in all, this node's included; 1 = no peer copies
    stride: int = 1                  # J: placement jump (nodes per failure domain)
    timeout_s: float = 120.0         # one shard's replication to all peers; longer is abandoned (logged)

    def validate(self) -> None:
        if self.replication_factor < 1:
            raise ConfigError("peers.replication_factor", f"must be >= 1, got {self.replication_factor}")
        if self.stride < 1:
            raise ConfigError("peers.stride", f"must be >= 1, got {self.stride}")
        if not self.timeout_s > 0:
            raise ConfigError("peers.timeout_s", f"must be > 0, got {self.timeout_s!r}")
        nodes = parse_nodes(self.nodes)
        if self.replication_factor == 1:
            return
        n = len(nodes)
        if self.replication_factor > n:
            raise ConfigError("peers.replication_factor", f"{self.replication_factor} copies need at least that "
                              f"many nodes in peers.nodes; it lists {n}")
        from checkpoint.errors import InvalidInputError
        from checkpoint.peers import placement

        try:   # placement is shift-invariant: node 0's is collision-free iff every node's is
            placement(0, n, self.stride, self.replication_factor)
        except InvalidInputError as e:
            raise ConfigError("peers.stride", str(e)) from None

    def node_list(self) -> list[PeerNode]:
        return parse_nodes(self.nodes)
