"""Peer replicas: each shard is also copied into the memory tier of other nodes, so losing one node loses
no in-memory checkpoint.

Placement (like nvidia-resiliency-ext's clique replication): with nodes 0..N-1 in a fixed order, a jump J
and a replication factor F, node n's shards are copied to nodes (n + i*J) mod N for i = 1..F-1. With J
equal to the nodes per failure domain (rack, switch), the copies land outside the domain.

`Replicator.replicate(job, step, rank)` reads the shard chunk by chunk from this node's tier, verifies
each chunk checksum (a corrupt copy is never propagated), streams it into each peer's store, verifies
the written copy's chunk checksums again (a network peer computes them from the bytes it stored:
`ChecksumBlob`, so the copy is not read back over the network; an older peer's copy is read back), and
only then records the copy in the coordination Redis (data first, record last). A peer whose copy fails is
journaled and the others still get theirs.

Transport (`Peer.open`, by the location's form): a directory (the same host, several "nodes" per host in
tests, or a filesystem both nodes mount; it must already exist: the peer agent creates it, and a lost
node's directory is never re-created by its peers), or the peer agent's URL (`grpcs://HOST:PORT`,
`unix:///PATH`, `grpc://HOST:PORT`: checkpoint/grpc_store.py over its PeerStore service, which writes into
its memory tier atomically and refuses to re-create a missing one). The guarantees are the same for both.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from checkpoint.blobstore import BlobStore
from checkpoint.chunks import ALGORITHM, verify
from checkpoint.coordinator import Coordinator
from checkpoint.errors import CorruptCheckpointError, InvalidInputError, NotInMemoryError
from checkpoint.grpc_store import grpc_store_for, is_peer_url
from checkpoint.manifest import ShardManifest
from checkpoint.shm_store import DirStore
from sdcwatch import event_kinds as ek
from sdcwatch.errors import is_transient

log = logging.getLogger(__name__)


def placement(node_index: int, num_nodes: int, jump: int = 1, factor: int = 2) -> list[int]:
    """Indices of the nodes that hold copies of node `node_index`'s shards (excluding itself)."""
    if num_nodes < 1 or not 0 <= node_index < num_nodes:
        raise InvalidInputError(f"node index {node_index} not in [0, {num_nodes})")
    if factor < 1 or jump < 1:
        raise InvalidInputError(f"replication factor and jump must be >= 1, got F={factor} J={jump}")
    if factor > num_nodes:
        raise InvalidInputError(f"replication factor {factor} exceeds the {num_nodes} nodes")
    out = []
    for i in range(1, factor):
        peer = (node_index + i * jump) % num_nodes
        if peer == node_index or peer in out:
            raise InvalidInputError(
                f"jump {jump} with factor {factor} over {num_nodes} nodes puts two copies on node {peer}")
        out.append(peer)
    return out


def peers_of(node: str, nodes: Sequence[str], jump: int = 1, factor: int = 2) -> list[str]:
    """The names of the nodes that hold copies of `node`'s shards; `nodes` is the job's fixed order."""
    if node not in nodes:
        raise InvalidInputError(f"node {node!r} is not among the job's nodes {list(nodes)}")
    return [nodes[i] for i in placement(list(nodes).index(node), len(nodes), jump, factor)]


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    """A node that receives copies. `store` None: the peer's memory tier is at `location` (a directory, or
    the peer agent's URL), opened for each replication (so a peer that comes up later, or goes away, is
    handled)."""

    node: str
    store: BlobStore | None
    location: str

    def open(self) -> BlobStore:
        if self.store is not None:
            return self.store
        if is_peer_url(self.location):
            return grpc_store_for(self.location)   # reachability shows on the first call (an OSError)
        root = Path(self.location)
        if not root.is_dir():
            raise NotInMemoryError(f"peer {self.node}'s memory tier {self.location} is not reachable from here "
                                   "(no such directory: the node is down, or not mounted here)")
        return DirStore(root, create=False)


class Replicator:
    def __init__(self, coordinator: Coordinator, peers: Mapping[str, Peer] | list[Peer]) -> None:
        self.coordinator = coordinator
        self.peers = list(peers.values()) if isinstance(peers, Mapping) else list(peers)
        for p in self.peers:
            if p.node == coordinator.node:
                raise InvalidInputError(f"node {p.node} cannot be its own peer")
        for key in ("replicas", "replica_bytes", "replication_failures"):
            coordinator.stats.setdefault(key, 0)

    def replicate(self, job_id: str, step: int, rank: int) -> list[str]:
        """Copy one committed shard to every peer; return the nodes that now hold it."""
        manifest = self.coordinator.shard_manifest(job_id, step, rank)
        have = {c.node for c in self.coordinator.info(job_id, step).copies if c.rank == rank}
        done = []
        for peer in self.peers:
            if peer.node in have:   # a repeated CommitShard: the copy is already recorded
                done.append(peer.node)
                continue
            try:
                store = peer.open()
                store.put(manifest.blob, self._verified_chunks(manifest))
                self._check_copy(store, manifest, peer)
                self.coordinator.add_copy(job_id, step, rank, peer.node, peer.location)
            except Exception as e:  # noqa: BLE001 - one peer's failure must not stop the others
                self.coordinator.stats["replication_failures"] += 1
                log.warning("replicating job %s step %d rank %d to %s failed: %s", job_id, step, rank, peer.node, e)
                self.coordinator.emit(ek.CHECKPOINT_REPLICATION_FAILED, job_id,
                                      f"step {step} rank {rank}: no copy on peer {peer.node}: {e}",
                                      {"step": step, "rank": rank, "peer": peer.node, "transient": is_transient(e)})
                continue
            self.coordinator.stats["replicas"] += 1
            self.coordinator.stats["replica_bytes"] += manifest.nbytes
            done.append(peer.node)
        return done

    def _verified_chunks(self, m: ShardManifest) -> Iterator[memoryview]:
        buf = memoryview(bytearray(max((c.length for c in m.chunks), default=0)))
        for c in m.chunks:
            n = self.coordinator.store.readinto(m.blob, c.offset, buf[: c.length])
            if not verify(buf[:n], c):
                self.coordinator.stats["checksum_failures"] += 1
                raise CorruptCheckpointError(f"{m.blob} chunk at {c.offset} fails its checksum here; not replicated")
            yield buf[:n]

    @staticmethod
    def _check_on_peer(store: BlobStore, m: ShardManifest, peer: Peer) -> bool:
        """True when the peer computed the copy's chunk checksums and they match; False when it cannot
        (a directory store, an older agent): read the copy back. CorruptCheckpointError on a mismatch."""
        remote = getattr(store, "checksums", None)
        if remote is None or m.algorithm != ALGORITHM:   # the peer computes xxh3-128 only: read back
            return False
        try:
            size, sums = remote(m.blob, [(c.offset, c.length) for c in m.chunks])
        except NotImplementedError:
            return False
        if size != m.nbytes:
            raise CorruptCheckpointError(f"copy on {peer.node} has {size} bytes, the shard {m.nbytes}")
        bad = [c.offset for c, s in zip(m.chunks, sums) if s != c.checksum]
        if len(sums) != len(m.chunks) or bad:
            raise CorruptCheckpointError(f"copy on {peer.node}: chunk(s) at {bad[:5]} fail their checksum "
                                         "on the peer")
        return True

    def _check_copy(self, store: BlobStore, m: ShardManifest, peer: Peer) -> None:
        """Check the written copy's chunks (on the peer when it can, else read back); a bad one is deleted
        (never recorded)."""
        try:
            if self._check_on_peer(store, m, peer):
                return
        except BaseException:
            store.delete(m.blob)
            raise
        buf = memoryview(bytearray(max((c.length for c in m.chunks), default=0)))
        try:
            size = store.size(m.blob)
            if size != m.nbytes:
                raise CorruptCheckpointError(f"copy on {peer.node} has {size} bytes, the shard {m.nbytes}")
            for c in m.chunks:
                n = store.readinto(m.blob, c.offset, buf[: c.length])
                if not verify(buf[:n], c):
                    raise CorruptCheckpointError(f"copy on {peer.node}: chunk at {c.offset} fails its checksum "
                                                 "when read back")
        except BaseException:
            store.delete(m.blob)
            raise
