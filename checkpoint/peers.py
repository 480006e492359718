"""Peer replicas: each shard is also copied into the memory tier of other nodes, so losing one node loses
no in-memory checkpoint.

Placement (like nvidia-resiliency-ext's clique replication): with nodes 0..N-1 in a fixed order, a jump J
and a replication factor F, node n's shards are copied to nodes (n + i*J) mod N for i = 1..F-1. With J
equal to the nodes per failure domain (rack, switch), the copies land outside the domain.

`Replicator.replicate(job, step, rank)` reads the shard chunk by chunk from this node's tier, verifies
each chunk checksum (a corrupt copy is never propagated), streams it into each peer's store, and records
the copy in the coordination Redis. On one machine (tests) a peer's store is its memory directory.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, Mapping

from checkpoint.blobstore import BlobStore
from checkpoint.chunks import verify
from checkpoint.coordinator import Coordinator
from checkpoint.errors import CorruptCheckpointError, InvalidInputError
from checkpoint.manifest import ShardManifest

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


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    node: str
    store: BlobStore
    location: str


class Replicator:
    def __init__(self, coordinator: Coordinator, peers: Mapping[str, Peer] | list[Peer]) -> None:
        self.coordinator = coordinator
        self.peers = list(peers.values()) if isinstance(peers, Mapping) else list(peers)

    def replicate(self, job_id: str, step: int, rank: int) -> list[str]:
        """Copy one committed shard to every peer; return the nodes that now hold it."""
        manifest = self.coordinator.shard_manifest(job_id, step, rank)
        done = []
        for peer in self.peers:
            try:
                peer.store.put(manifest.blob, self._verified_chunks(manifest))
                self.coordinator.add_copy(job_id, step, rank, peer.node, peer.location)
                done.append(peer.node)
            except Exception as e:  # noqa: BLE001 - one peer's failure must not stop the others
                log.warning("replicating job %s step %d rank %d to %s failed: %s", job_id, step, rank, peer.node, e)
        return done

    def _verified_chunks(self, m: ShardManifest) -> Iterator[memoryview]:
        buf = memoryview(bytearray(max((c.length for c in m.chunks), default=0)))
        for c in m.chunks:
            n = self.coordinator.store.readinto(m.blob, c.offset, buf[: c.length])
            if not verify(buf[:n], c):
                raise CorruptCheckpointError(f"{m.blob} chunk at {c.offset} fails its checksum here; not replicated")
            yield buf[:n]
