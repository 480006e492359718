"""`[peers]`: copies of each shard in other nodes' memory tiers (checkpoint/peers.py, daemon/peers_wiring.py).

    [peers]
    nodes = "node-a=/dev/shm/sdcwatch-1000/a/memory,node-b=/dev/shm/sdcwatch-1000/b/memory"
    replication_factor = 2     # copies in all, this node's included; 1 = no peer copies (the default)
    stride = 1                 # J: node n's copies go to nodes n+J, n+2J, ... (mod N)

    # network transport (checkpoint/grpc_store.py), when entries are URLs:
    tls_ca = "/etc/sdcwatch/ca.pem"      # CA that signed the peers' agent certificates (grpcs://)
    token_file = "/etc/sdcwatch/token"   # bearer token the peers' agents require on TCP
    insecure = false                     # true allows plain-TCP grpc:// entries (warns)
    streams = 4                          # connections per network peer (parallel streams)
    max_mb_per_s = 0                     # cap per network peer, MB/s (0: none)

Every key is also a flag: `--peers-nodes`, `--peers-replication-factor`, `--peers-stride`,
`--peers-timeout-s`, `--peers-tls-ca`, `--peers-token-file`, `--peers-insecure`, `--peers-streams`,
`--peers-max-mb-per-s`. `nodes` is the job's whole
node list in one fixed order, the same on every node (so every node computes the same placement), each
entry `NAME=LOCATION`, comma-separated. LOCATION is how this agent reaches that node's memory tier:

- `/abs/dir`: a directory this agent can write (the same host, or a filesystem the nodes share);
- `grpcs://HOST:PORT`: the node's agent TCP listener (`[agent] listen` with TLS), through its
  `sdcwatch.v1.PeerStore` service; `tls_ca` verifies its certificate, `token_file` is sent as the bearer;
- `unix:///abs/agent.sock`: the node's agent on a unix socket of this host;
- `grpc://HOST:PORT`: the same over plain TCP, refused unless `insecure = true`.

A node's name is its agent's `[agent] hostname` (`--hostname`), the name its commit records and copies
carry, so there is no separate node id to disagree with it. Its own entry is its memory directory (checked
against the real one at start) or its own URL (then the host must be an address of this machine, or the
socket a path on it: see daemon/peers_wiring.py).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from checkpoint.errors import InvalidInputError
from checkpoint.grpc_store import parse_location
from daemon.errors import ConfigError
from sdcwatch.settings import setting

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,253}$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


@dataclasses.dataclass(frozen=True, slots=True)
class PeerNode:
    name: str
    location: str    # a directory (absolute path) or a peer URL (grpcs://, grpc://, unix://)

    @property
    def is_url(self) -> bool:
        return bool(_URL.match(self.location))


def parse_nodes(text: str, key: str = "peers.nodes", insecure: bool = False) -> list[PeerNode]:
    """'a=/dir/a, b=grpcs://b:7000' -> [PeerNode('a', '/dir/a'), PeerNode('b', 'grpcs://b:7000')] (order
    kept). ConfigError for an entry without '=', a bad name, a duplicate, a relative path, an unknown
    scheme, a malformed URL, or a plain-TCP `grpc://` entry without `insecure`."""
    out: list[PeerNode] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, location = (s.strip() for s in entry.partition("="))
        if not sep or not location:
            raise ConfigError(key, f"entry {entry!r}: expected NAME=LOCATION (a directory, grpcs://HOST:PORT, "
                              "unix:///PATH or grpc://HOST:PORT)")
        if not _NAME.match(name):
            raise ConfigError(key, f"entry {entry!r}: node name {name!r} may hold only letters, digits, '_', '.', '-'")
        if any(n.name == name for n in out):
            raise ConfigError(key, f"node {name!r} is listed twice")
        if _URL.match(location):
            out.append(PeerNode(name, _check_url(key, entry, location, insecure)))
            continue
        if not location.startswith("/"):
            raise ConfigError(key, f"entry {entry!r}: the location must be an absolute directory path")
        out.append(PeerNode(name, location.rstrip("/") or "/"))
    return out


def _check_url(key: str, entry: str, location: str, insecure: bool) -> str:
    try:
        scheme, _target = parse_location(location)
    except InvalidInputError as e:
        raise ConfigError(key, f"entry {entry!r}: {e}") from None
    if scheme == "grpc" and not insecure:
        raise ConfigError(key, f"entry {entry!r}: grpc:// is a plain-TCP network transport (no encryption, the "
                          "token readable on the wire); use grpcs://, or set peers.insecure = true")
    return location


@dataclasses.dataclass(kw_only=True, slots=True)
class PeersConfig:
    nodes: str = setting("", "NAME=LOCATION,... every node of the job in one fixed order (a directory, "
                         "grpcs://HOST:PORT, unix:///PATH or grpc://HOST:PORT)")
    replication_factor: int = setting(1, "copies of each shard in all, this node's included (1: no peer copies)")
    stride: int = setting(1, "placement jump: node n's copies go to nodes n+J, n+2J, ... (nodes per failure domain)")
    timeout_s: float = setting(120.0, "seconds one shard's replication to all peers may take (then abandoned)")
    tls_ca: str = setting("", "PEM CA file verifying the peers' agent certificates (grpcs://)")
    token_file: str = setting("", "file holding the bearer token the peers' agents require on TCP")
    insecure: bool = setting(False, "allow grpc:// (plain TCP) entries (warns)")
    streams: int = setting(4, "connections to each network peer: puts take them in turn, a large read is "
                           "split over them (1..64)")
    max_mb_per_s: float = setting(0.0, "cap on the MB/s (1e6 bytes) sent to and read from each network peer, "
                                  "all streams together (0: no cap)")

    def validate(self) -> None:
        if self.replication_factor < 1:
            raise ConfigError("peers.replication_factor", f"must be >= 1, got {self.replication_factor}")
        if self.stride < 1:
            raise ConfigError("peers.stride", f"must be >= 1, got {self.stride}")
        if not self.timeout_s > 0:
            raise ConfigError("peers.timeout_s", f"must be > 0, got {self.timeout_s!r}")
        if not 1 <= self.streams <= 64:
            raise ConfigError("peers.streams", f"must be in 1..64, got {self.streams}")
        if not self.max_mb_per_s >= 0:
            raise ConfigError("peers.max_mb_per_s", f"must be >= 0 (0: no cap), got {self.max_mb_per_s!r}")
        for key, value in (("tls_ca", self.tls_ca), ("token_file", self.token_file)):
            if value and not Path(value).is_file():
                raise ConfigError(f"peers.{key}", f"file not found: {value}")
        if self.token_file and not Path(self.token_file).read_text().strip():
            raise ConfigError("peers.token_file", f"{self.token_file} is empty")
        nodes = parse_nodes(self.nodes, insecure=self.insecure)
        if self.replication_factor == 1:
            return
        n = len(nodes)
        if self.replication_factor > n:
            raise ConfigError("peers.replication_factor", f"{self.replication_factor} copies need at least that "
                              f"many nodes in peers.nodes; it lists {n}")
        from checkpoint.peers import placement   # here: the coordinator and redis-py stay out of CLI start-up

        try:   # placement is shift-invariant: node 0's is collision-free iff every node's is
            placement(0, n, self.stride, self.replication_factor)
        except InvalidInputError as e:
            raise ConfigError("peers.stride", str(e)) from None

    def node_list(self) -> list[PeerNode]:
        return parse_nodes(self.nodes, insecure=self.insecure)
