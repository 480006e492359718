"""Restore a shard with every chunk checksum and every tensor fingerprint verified.

Each chunk is read from the first copy that has it intact (this node's memory tier first, then peer
replicas); a bad or missing chunk is logged and read from the next copy. If no copy has a good chunk,
`CorruptCheckpointError` names the tensors in that chunk and every copy tried. After the bytes are
assembled, each tensor's fingerprint is checked on the host bytes and, for a GPU device, again on the
GPU after the upload.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Sequence

import torch

from checkpoint.blobstore import BlobStore
from checkpoint.chunks import Chunk, chunks_covering, verify
from checkpoint.errors import CorruptCheckpointError, NotInMemoryError
from checkpoint.manifest import DTYPES, ShardManifest, unflatten
from checkpoint.records import RestorePlan, ShardPlan
from checksums.fingerprint import MASK64, fingerprint_bytes, fingerprint_tensors_async

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
                  report: RestoreReport | None = None) -> RestoreReport:
    """Fill `out` (manifest.nbytes) with the shard's bytes, each chunk checksum-verified, falling back
    across `copies` ([(name, store)]) chunk by chunk. Chunks are read and verified on `_io_pool`'s threads
    (reads and xxh3 release the GIL): a restore runs at the node's memory bandwidth, not one core's."""
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


def restore_shard(manifest: ShardManifest, copies: Sequence[tuple[str, BlobStore]],
                  device: str | torch.device = "cpu", report: RestoreReport | None = None) -> dict[str, Any]:
    """The shard's state dict on `device`, verified (see module docstring). For a GPU device the
    fingerprints are checked on the GPU after the upload (which also covers the host bytes)."""
    device = torch.device(device)
    pin = device.type == "cuda"
    buf = torch.empty(manifest.nbytes, dtype=torch.uint8, pin_memory=pin)
    view = memoryview(buf.numpy()).cast("B")
    read_verified(manifest, copies, view, report)
    host = []
    if device.type == "cpu":
        fps = list(_fp_pool.map(lambda e: fingerprint_bytes(view[e.offset:e.offset + e.nbytes], e.dtype, e.shape),
                                manifest.tensors))
    else:
        fps = [e.fingerprint for e in manifest.tensors]
    for e, fp in zip(manifest.tensors, fps):
        if fp != e.fingerprint:
            raise CorruptCheckpointError(
                f"job {manifest.job_id} step {manifest.step} rank {manifest.rank}: tensor {e.path} has fingerprint "
                f"{fp}, manifest says {e.fingerprint} (chunks verified: the bytes were wrong when saved)")
        host.append(buf[e.offset:e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.shape))
    if device.type == "cpu":
        tensors = host
    else:
        tensors = [t.to(device, non_blocking=True) for t in host]
        if tensors:
            per = torch.empty(len(tensors), 2, dtype=torch.int64, device=device)
            fingerprint_tensors_async(tensors, per_tensor_out=per)
            got = [tuple(int(v) & MASK64 for v in row) for row in per.cpu().tolist()]
            for e, g in zip(manifest.tensors, got):
                if g != e.fingerprint:
                    raise CorruptCheckpointError(
                        f"job {manifest.job_id} step {manifest.step} rank {manifest.rank}: tensor {e.path} "
                        f"changed on upload to {device}: fingerprint {g}, expected {e.fingerprint}")
    return unflatten(manifest.tree, tensors)


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


def restore_from_plan(plan: RestorePlan, rank: int, store_for: Callable[[str], BlobStore],
                      device: str | torch.device = "cpu", report: RestoreReport | None = None) -> dict[str, Any]:
    for shard in plan.shards:
        if shard.rank == rank:
            return restore_shard(shard.manifest, copies_for(shard, store_for), device, report)
    raise NotInMemoryError(f"restore plan for step {plan.checkpoint.step} has no shard for rank {rank}")
