"""Read a shard's bytes with every chunk checksum and every tensor fingerprint verified: torch-free.

Each chunk is read from the first copy that has it intact (this node's memory tier first, then peer
replicas, then the tiers); a bad or missing chunk is logged and read from the next copy. If no copy has a
good chunk, `CorruptCheckpointError` names the tensors in that chunk and every copy tried. Then
`verify_fingerprints` checks each tensor's fingerprint on the host bytes (checksums.fingerprint_host: the
same integers as the GPU kernel). The rank's restore (checkpoint.restore) builds tensors on top of this;
`sdcwatch ckpt restore` writes the verified bytes to files without loading torch.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from typing import Callable, Sequence

from checkpoint.blobstore import BlobStore
from checkpoint.chunks import Chunk, chunks_covering, verify
from checkpoint.errors import CorruptCheckpointError, NotInMemoryError
from checkpoint.manifest import ShardManifest
from checkpoint.records import ShardPlan
from checksums.fingerprint_host import fingerprint_bytes

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class RestoreReport:
    chunks: int = 0
    fallbacks: int = 0                       # chunks read from a copy other than the first
    failures: list[str] = dataclasses.field(default_factory=list)  # "<copy>: chunk @off: why"
    sources: dict[str, int] = dataclasses.field(default_factory=dict)  # copy name -> bytes it served

    @property
    def source(self) -> str:
        """Where the bytes came from: the copy that served the most ('nvme@node-a'), '' before a restore."""
        return max(self.sources, key=self.sources.__getitem__) if self.sources else ""


def read_verified(manifest: ShardManifest, copies: Sequence[tuple[str, BlobStore]], out: memoryview,
                  report: RestoreReport | None = None,
                  on_chunk: Callable[[int], None] | None = None) -> RestoreReport:
    """Fill `out` (manifest.nbytes) with the shard's bytes, each chunk checksum-verified, falling back
    across `copies` ([(name, store)]) chunk by chunk. Chunks are read and verified on `_io_pool`'s threads
    (reads and xxh3 release the GIL): a restore runs at the node's memory bandwidth, not one core's.
    `on_chunk(nbytes)` is called (from those threads) after each chunk is verified (a progress bar)."""
    report = report if report is not None else RestoreReport()
    view = memoryview(out).cast("B")
    if len(view) < manifest.nbytes:
        raise ValueError(f"restore buffer holds {len(view)} bytes, shard needs {manifest.nbytes}")
    if not copies and manifest.nbytes:
        raise NotInMemoryError(f"job {manifest.job_id} step {manifest.step} rank {manifest.rank}: no copy of the "
                               "shard is reachable from this node")
    lock = threading.Lock()

    def one(c: Chunk) -> None:
        dst = view[c.offset:c.offset + c.length]
        tried = []
        for i, (name, store) in enumerate(copies):
            try:
                n = store.readinto(manifest.blob, c.offset, dst)
                ok = verify(dst[:n], c)
                why = "" if ok else ("short read" if n != c.length else "checksum mismatch")
            except KeyError:
                ok, why = False, "missing"
            except OSError as e:
                ok, why = False, f"read error {e}"
            if ok:
                with lock:
                    report.fallbacks += i > 0
                    report.sources[name] = report.sources.get(name, 0) + c.length
                    report.chunks += 1
                if on_chunk is not None:
                    on_chunk(c.length)
                return
            tried.append(f"{name} ({why})")
            with lock:
                report.failures.append(f"{name}: chunk @{c.offset}: {why}")
            log.warning("checkpoint job %s step %d rank %d: chunk at byte %d bad on %s: %s",
                        manifest.job_id, manifest.step, manifest.rank, c.offset, name, why)
        hit = [t.path for t in manifest.tensors if chunks_covering([c], t.offset, t.nbytes)] or ["(padding)"]
        raise CorruptCheckpointError(
            f"job {manifest.job_id} step {manifest.step} rank {manifest.rank}: tensor(s) {', '.join(hit)} "
            f"cannot be restored: bytes {c.offset}..{c.offset + c.length} are bad on every copy tried: "
            f"{'; '.join(tried)}")

    if len(manifest.chunks) <= 1:
        for c in manifest.chunks:
            one(c)
        return report
    futures = [_io_pool.submit(one, c) for c in manifest.chunks]
    concurrent.futures.wait(futures)
    for f in futures:  # the first bad chunk in byte order names the tensors
        f.result()
    return report


_io_pool = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="sdcw-restore-io")


_fp_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="sdcw-restore-fp")


def verify_fingerprints(manifest: ShardManifest, buf: memoryview) -> None:
    """Check every tensor's fingerprint on the shard's host bytes `buf` (numpy, on `_fp_pool`'s threads);
    `CorruptCheckpointError` names the first tensor whose bytes differ from what was saved."""
    view = memoryview(buf).cast("B")
    fps = list(_fp_pool.map(lambda e: fingerprint_bytes(view[e.offset:e.offset + e.nbytes], e.dtype, e.shape),
                            manifest.tensors))
    for e, fp in zip(manifest.tensors, fps):
        if fp != e.fingerprint:
            raise CorruptCheckpointError(
                f"job {manifest.job_id} step {manifest.step} rank {manifest.rank}: tensor {e.path} has fingerprint "
                f"{fp}, manifest says {e.fingerprint} (chunks verified: the bytes were wrong when saved)")


def copies_for(shard: ShardPlan, store_for: Callable[[str], BlobStore]) -> list[tuple[str, BlobStore]]:
    """[(name, store)] for the copies of `shard` whose location this process can open, in plan order
    (memory of this node, peers' memory, then the tiers fastest first). A name is "<tier>@<node>:<location>"."""
    out = []
    for c in shard.copies:
        try:
            out.append((f"{c.tier}@{c.node}:{c.location}", store_for(c.location)))
        except (OSError, ValueError) as e:
            log.info("copy on %s at %s not reachable: %s", c.node, c.location, e)
    return out
