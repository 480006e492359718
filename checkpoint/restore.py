"""Restore a shard's state dict with every chunk checksum and every tensor fingerprint verified.

The bytes come through checkpoint.shard_reader (chunk by chunk from the first intact copy, checksums
verified). For the CPU each tensor's fingerprint is then checked on the host bytes; for a GPU device it is
checked on the GPU after the upload (which also covers the host bytes).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from checkpoint.blobstore import BlobStore
from checkpoint.errors import CorruptCheckpointError, NotInMemoryError
from checkpoint.manifest import ShardManifest
from checkpoint.records import RestorePlan
from checkpoint.shard_reader import RestoreReport, copies_for, read_checked, read_verified
from checkpoint.state_tree import DTYPES, unflatten
from checksums.fingerprint import MASK64, fingerprint_tensors_async


def restore_shard(manifest: ShardManifest, copies: Sequence[tuple[str, BlobStore]],
                  device: str | torch.device = "cpu", report: RestoreReport | None = None) -> dict[str, Any]:
    """The shard's state dict on `device`, verified (see module docstring). For a GPU device the
    fingerprints are checked on the GPU after the upload (which also covers the host bytes)."""
    device = torch.device(device)
    pin = device.type == "cuda"
    buf = torch.empty(manifest.nbytes, dtype=torch.uint8, pin_memory=pin)
    view = memoryview(buf.numpy()).cast("B")
    if device.type == "cpu":   # chunks and fingerprints from one pass over the bytes ("source" checksums)
        read_checked(manifest, copies, view, report)
    else:
        read_verified(manifest, copies, view, report)
    host = [buf[e.offset:e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.shape) for e in manifest.tensors]
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
    return unflatten(manifest.tree, tensors, host)


def restore_from_plan(plan: RestorePlan, rank: int, store_for: Callable[[str], BlobStore],
                      device: str | torch.device = "cpu", report: RestoreReport | None = None) -> dict[str, Any]:
    for shard in plan.shards:
        if shard.rank == rank:
            return restore_shard(shard.manifest, copies_for(shard, store_for), device, report)
    raise NotInMemoryError(f"restore plan for step {plan.checkpoint.step} has no shard for rank {rank}")
