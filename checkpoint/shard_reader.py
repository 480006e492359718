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
from checkpoint.chunks import FP_ALGORITHM, Chunk, chunks_covering, fp_hex, verify
from checkpoint.errors import CorruptCheckpointError, NotInMemoryError
from checkpoint.manifest import ShardManifest
from checkpoint.records import ShardPlan
from checksums.fingerprint_host import MASK64, fingerprint_bytes, tensor_words_from_sums, word_sums_numpy

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


def read_checked(manifest: ShardManifest, copies: Sequence[tuple[str, BlobStore]], out: memoryview,
                 report: RestoreReport | None = None,
                 on_chunk: Callable[[int], None] | None = None) -> RestoreReport:
    """`read_verified` and then every tensor fingerprint checked (`verify_fingerprints`), reading each byte
    once when the chunk checksums are FP_ALGORITHM ("source" checksums): the fingerprint sums are linear, so
    the chunk check sums each chunk in segments cut at the tensors' (word-rounded) ends and the tensor
    fingerprints are added up from the same segments' sums. xxh3 chunks: hashed, then fingerprinted."""
    segs = _segments(manifest) if manifest.algorithm == FP_ALGORITHM else None
    if segs is None:
        report = read_verified(manifest, copies, out, report, on_chunk)
        verify_fingerprints(manifest, out)
        return report
    sums: dict[int, list[tuple[int, int, int]]] = {}
    report = read_verified(manifest, copies, out, report, on_chunk, _SegmentCheck(segs, sums))
    t0 = [0] * len(manifest.tensors)
    t1 = [0] * len(manifest.tensors)
    for parts in sums.values():
        for i, s0, s1 in parts:
            t0[i] += s0
            t1[i] += s1
    view = memoryview(out).cast("B")
    for i, e in enumerate(manifest.tensors):
        end = e.offset + e.nbytes
        pad = view[end:min(-(-end // 4) * 4, manifest.nbytes)]
        if any(pad):   # bytes after the tensor in its last word are not zero: its own sums, apart
            fp = fingerprint_bytes(view[e.offset:end], e.dtype, e.shape)
        else:
            fp = tensor_words_from_sums(t0[i] & MASK64, t1[i] & MASK64, e.dtype, e.shape)
        if fp != e.fingerprint:
            raise CorruptCheckpointError(
                f"job {manifest.job_id} step {manifest.step} rank {manifest.rank}: tensor {e.path} has fingerprint "
                f"{fp}, manifest says {e.fingerprint} (chunks verified: the bytes were wrong when saved)")
    return report


# a chunk's segments: (start, end) byte offsets in the blob, the tensor index (-1: between tensors) and the
# segment's word offset in that tensor
Segment = tuple[int, int, int, int]


def _segments(manifest: ShardManifest) -> list[list[Segment]] | None:
    """Per chunk, its bytes cut into word-aligned segments at the tensors' starts and word-rounded ends; None
    when the layout does not allow it (a chunk or tensor not starting on a word, tensors out of order or
    overlapping): then the bytes are summed twice, as before."""
    tensors = sorted(((e.offset, e.offset + e.nbytes, i) for i, e in enumerate(manifest.tensors) if e.nbytes),
                     key=lambda x: x[0])
    bounds = []
    prev = 0
    for start, end, i in tensors:
        if start % 4 or start < prev:
            return None
        prev = -(-end // 4) * 4
        bounds.append((start, min(prev, manifest.nbytes), i))
    out: list[list[Segment]] = []
    k = 0
    for c in manifest.chunks:
        if c.offset % 4:
            return None
        lo, hi = c.offset, c.offset + c.length
        segs: list[Segment] = []
        pos = lo
        while k < len(bounds) and bounds[k][1] <= lo:
            k += 1
        j = k
        while j < len(bounds) and bounds[j][0] < hi:
            start, end, i = bounds[j]
            a, b = max(start, lo), min(end, hi)
            if a > pos:
                segs.append((pos, a, -1, 0))
            segs.append((a, b, i, (a - start) // 4))
            pos = b
            if end > hi:
                break
            j += 1
        if pos < hi:
            segs.append((pos, hi, -1, 0))
        out.append(segs)
    return out


class _SegmentCheck:
    """An FP_ALGORITHM chunk check that keeps the tensors' shifted sums of the chunk it accepted."""

    def __init__(self, segs: list[list[Segment]], sums: dict[int, list[tuple[int, int, int]]]) -> None:
        self.segs, self.sums = segs, sums

    def __call__(self, k: int, buf: memoryview, chunk: Chunk) -> bool:
        if len(buf) != chunk.length:
            return False
        c0 = c1 = 0
        parts = []
        for a, b, i, word in self.segs[k]:
            s0, s1 = word_sums_numpy(buf[a - chunk.offset:b - chunk.offset])
            c0 += s0
            c1 += s1 + ((a - chunk.offset) >> 2) * s0
            if i >= 0:
                parts.append((i, s0, s1 + word * s0))
        if fp_hex(tensor_words_from_sums(c0 & MASK64, c1 & MASK64, "uint8", (chunk.length,))) != chunk.checksum:
            return False
        self.sums[k] = parts   # the copy that passed: its sums are the tensors' (a later pass replaces them)
        return True


def read_verified(manifest: ShardManifest, copies: Sequence[tuple[str, BlobStore]], out: memoryview,
                  report: RestoreReport | None = None,
                  on_chunk: Callable[[int], None] | None = None,
                  check: Callable[[int, memoryview, Chunk], bool] | None = None) -> RestoreReport:
    """Fill `out` (manifest.nbytes) with the shard's bytes, each chunk checksum-verified, falling back
    across `copies` ([(name, store)]) chunk by chunk. Chunks are read and verified on `_io_pool`'s threads
    (reads and xxh3 release the GIL): a restore runs at the node's memory bandwidth, not one core's.
    `on_chunk(nbytes)` is called (from those threads) after each chunk is verified (a progress bar).
    `check(chunk index, bytes, chunk)`: the chunk check instead of `chunks.verify` (read_checked's)."""
    report = report if report is not None else RestoreReport()
    view = memoryview(out).cast("B")
    if len(view) < manifest.nbytes:
        raise ValueError(f"restore buffer holds {len(view)} bytes, shard needs {manifest.nbytes}")
    if not copies and manifest.nbytes:
        raise NotInMemoryError(f"job {manifest.job_id} step {manifest.step} rank {manifest.rank}: no copy of the "
                               "shard is reachable from this node")
    lock = threading.Lock()

    def one(k: int, c: Chunk) -> None:
        dst = view[c.offset:c.offset + c.length]
        tried = []
        for i, (name, store) in enumerate(copies):
            try:
                n = store.readinto(manifest.blob, c.offset, dst)
                ok = verify(dst[:n], c) if check is None else check(k, dst[:n], c)
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
        for k, c in enumerate(manifest.chunks):
            one(k, c)
        return report
    futures = [_io_pool.submit(one, k, c) for k, c in enumerate(manifest.chunks)]
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
