"""Exact tensor fingerprints on torch tensors (any device; the fused Triton kernel on CUDA).

The specification, its constants and the host path (numpy on raw bytes) are in checksums.fingerprint_host
(torch-free); this module implements the same integers with torch ops and exports both, so
`from checksums.fingerprint import fingerprint_bytes, fingerprint_tensor` keeps working.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from checksums.fingerprint_host import (  # noqa: F401 (re-exported: the one public fingerprint module)
    DTYPE_IDS, GOLDEN, ITEMSIZE, MASK64, NUM_WORDS, SEED_H0, SEED_H1, SEED_N0, SEED_N1, SEED_P0, SEED_P1,
    SPEC_VERSION, absorb, canonical_dtype_name, count_words, fingerprint_bytes, fingerprint_list_from_parts,
    fingerprint_numpy, fmix64, header_words, position_words, tensor_words_from_sums, to_signed64,
    word_sums_numpy,
)

logger = logging.getLogger(__name__)

_TORCH_CHUNK_WORDS = 1 << 24


# ---------------------------------------------------------------- torch path (any device)


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
        return DTensor
    except ImportError:  # a torch built without distributed
        return None


DTENSOR = _dtensor_type()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are fingerprinted and summarised: a DTensor's local shard (taken without an
    autograd op), detached; a plain tensor not needing grad is returned as it is."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
    if DTENSOR is not None and isinstance(t, DTENSOR):
        t = t._local_tensor  # type: ignore[attr-defined]
    return t.detach() if t.requires_grad else t


def _torch_word_sums(t: torch.Tensor) -> torch.Tensor:
    """int64 tensor [2] = (S0, S1) as signed bit patterns, on t's device, no host sync."""
    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else torch.zeros(0, dtype=torch.uint8, device=t.device)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    elif raw.storage_offset() % 4:
        raw = raw.clone()  # a view starting mid-word cannot be viewed as int32
    words = raw.view(torch.int32)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    n = words.numel()
    if n == 0:
        return out
    idx = torch.arange(min(n, _TORCH_CHUNK_WORDS), dtype=torch.int64, device=t.device)
    for start in range(0, n, _TORCH_CHUNK_WORDS):
        w = words[start:start + _TORCH_CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        out[0] += w.sum()
        # int64 products and sums wrap mod 2**64 (two's complement), which is the spec's arithmetic.
        out[1] += (w * (idx[: w.numel()] + start)).sum()
    return out


def _lshr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


_C1 = to_signed64(0xBF58476D1CE4E5B9)
_C2 = to_signed64(0x94D049BB133111EB)


def fmix64_torch(z: torch.Tensor) -> torch.Tensor:
    """fmix64 on int64 tensors holding uint64 bit patterns (int64 multiply wraps mod 2**64)."""
    z = (z ^ _lshr(z, 30)) * _C1
    z = (z ^ _lshr(z, 27)) * _C2
    return z ^ _lshr(z, 31)


def _mix_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 [m, 4]: h0, h1, p0, p1 per tensor (signed bit patterns)."""
    rows = []
    for k, t in enumerate(tensors):
        h0, h1 = header_words(canonical_dtype_name(t.dtype), tuple(t.shape))
        p0, p1 = position_words(k)
        rows.append([to_signed64(v) for v in (h0, h1, p0, p1)])
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).to(device)


def _torch_finish(sums: torch.Tensor, table: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec steps 5-6 on device: (list words [2], per-tensor words [m, 2])."""
    f0 = fmix64_torch(sums[:, 0] ^ table[:, 0])
    f1 = fmix64_torch((sums[:, 1] ^ table[:, 1]) + f0)
    l0 = fmix64_torch(f0 ^ table[:, 2]).sum()
    l1 = fmix64_torch(f1 ^ table[:, 3]).sum()
    n0, n1 = (to_signed64(v) for v in count_words(m))
    big0 = fmix64_torch(l0 ^ n0)
    big1 = fmix64_torch((l1 ^ n1) + big0)
    return torch.stack([big0, big1]), torch.stack([f0, f1], dim=1)


def fingerprint_tensors_torch(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path in plain torch ops: (list words [2], per-tensor words [m, 2]), no host sync."""
    locs = [local_tensor(t) for t in tensors]
    device = locs[0].device if locs else torch.device("cpu")
    if any(t.device != device for t in locs):
        raise ValueError("all tensors of one fingerprint must be on the same device")
    if not locs:
        n0, n1 = count_words(0)
        big0 = fmix64(n0)
        words = [big0, fmix64((n1 + big0) & MASK64)]
        return torch.tensor([to_signed64(v) for v in words], dtype=torch.int64), torch.zeros(0, 2,
                                                                                             dtype=torch.int64)
    sums = torch.stack([_torch_word_sums(t) for t in locs])
    return _torch_finish(sums, _mix_table(locs, device), len(locs))


def fingerprint_tensors_host(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`fingerprint_tensors_torch`'s words for CPU tensors, computed by the spec's host path on their bytes
    (numpy sums, Python-int mixing): the same integers in a few numpy calls a tensor instead of about a
    hundred tiny torch ops (a 4,400-element CPU bucket: about 1 ms -> tens of microseconds; CPU ranks
    fingerprint every step). (list words [2], per-tensor words [m, 2]), int64 on the CPU."""
    locs = [local_tensor(t) for t in tensors]
    if any(t.device.type != "cpu" for t in locs):
        raise ValueError("fingerprint_tensors_host takes CPU tensors")
    per = [tensor_words_from_sums(*word_sums_numpy(_host_bytes(t)), canonical_dtype_name(t.dtype), t.shape)
           for t in locs]
    words = [to_signed64(v) for v in fingerprint_list_from_parts(per)]
    parts = [[to_signed64(a), to_signed64(b)] for a, b in per]
    return torch.tensor(words, dtype=torch.int64), torch.tensor(parts, dtype=torch.int64).reshape(-1, 2)


def _host_bytes(t: torch.Tensor) -> Any:
    """A CPU tensor's bytes in C order, as a numpy uint8 array (a view when it is contiguous)."""
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()


def prepare_fingerprint_torch(tensors: Sequence[torch.Tensor]) -> Any:
    """The torch-ops path in two halves, for a caller that must not sync later: the per-tensor header table
    is uploaded now (a pageable upload syncs the current stream), and the returned call launches the sums
    and the mixing and returns the per-tensor words (int64 [len, 2], on the tensors' device), no host sync.
    Read the tensors when the call runs, not now."""
    locs = [local_tensor(t) for t in tensors]
    if not locs:
        raise ValueError("prepare_fingerprint_torch needs a non-empty list")
    table = _mix_table(locs, locs[0].device)

    def run() -> torch.Tensor:
        sums = torch.stack([_torch_word_sums(local_tensor(t)) for t in tensors])
        return _torch_finish(sums, table, len(tensors))[1]
    return run


# ---------------------------------------------------------------- public API and dispatch


def fingerprint_words_to_ints(t: torch.Tensor) -> tuple[int, ...]:
    """Host ints (uint64 interpretation) of an int64 words tensor; syncs if t is on a GPU."""
    return tuple(int(v) & MASK64 for v in t.detach().reshape(-1).cpu().tolist())


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" and triton_available()


_cache_lock = threading.Lock()
_plan_cache: OrderedDict[tuple, Any] = OrderedDict()
_PLAN_CACHE_SIZE = 16


def _plan_key(tensors: Sequence[torch.Tensor]) -> tuple | None:
    """What a plan depends on: addresses, dtypes, shapes (strides when not contiguous); None for DTensors."""
    key = []
    for t in tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return None
        key.append((t.data_ptr(), t.dtype, t.shape) if t.is_contiguous()
                   else (t.data_ptr(), t.dtype, t.shape, t.stride()))
    return tuple(key)


def _drop_plan(key: tuple) -> None:
    with _cache_lock:
        _plan_cache.pop(key, None)


def prepare_fingerprint(tensors: Sequence[torch.Tensor]) -> Any:
    """A reusable plan for a fixed list (the training hot path): ``plan.run_async()`` launches the fused
    kernel with no host work beyond the launches. The list's storages must stay where they are (in-place
    updates are fine). CUDA with Triton only; raises ValueError elsewhere."""
    locs = [local_tensor(t) for t in tensors]
    if not locs or not _use_triton(locs[0].device):
        raise ValueError("prepare_fingerprint needs a non-empty list of CUDA tensors and Triton")
    from checksums.fingerprint_triton import TritonFingerprintPlan  # triton is optional: loaded on first use

    return TritonFingerprintPlan(locs)


def _cached_plan(tensors: Sequence[torch.Tensor]) -> Any:
    key = _plan_key(tensors)
    if key is not None:
        with _cache_lock:
            plan = _plan_cache.get(key)
            if plan is not None:
                _plan_cache.move_to_end(key)
                return plan
    from checksums.fingerprint_triton import TritonFingerprintPlan  # triton is optional: loaded on first use

    plan = TritonFingerprintPlan([local_tensor(t) for t in tensors])
    if key is None:
        return plan
    with _cache_lock:
        _plan_cache[key] = plan
        while len(_plan_cache) > _PLAN_CACHE_SIZE:
            _plan_cache.popitem(last=False)
    for t in tensors:  # a cached plan must not keep freed tensors' memory alive
        weakref.finalize(t, _drop_plan, key)
    return plan


def clear_fingerprint_cache() -> None:
    with _cache_lock:
        _plan_cache.clear()


def fingerprint_tensors_async(tensors: Sequence[torch.Tensor], *, out: torch.Tensor | None = None,
                              per_tensor_out: torch.Tensor | None = None) -> torch.Tensor:
    """The list fingerprint as an int64 tensor [2] on the tensors' device, with no host synchronisation.

    On CUDA with Triton: the fused kernel (one launch over the whole list plus a one-program finaliser);
    the per-list metadata is cached by the tensors' addresses, dtypes and shapes. CPU tensors: the host
    path (`fingerprint_tensors_host`). Elsewhere: torch ops.
    ``per_tensor_out`` (int64 [len, 2], same device), when given, receives each tensor's fingerprint.
    """
    if not isinstance(tensors, (list, tuple)):
        tensors = list(tensors)
    if tensors and isinstance(tensors[0], torch.Tensor) and _use_triton(tensors[0].device):
        return _cached_plan(tensors).run_async(out=out, per_tensor_out=per_tensor_out)
    cpu = bool(tensors) and isinstance(tensors[0], torch.Tensor) and tensors[0].device.type == "cpu"
    words, per = fingerprint_tensors_host(tensors) if cpu else fingerprint_tensors_torch(tensors)
    if per_tensor_out is not None:
        per_tensor_out.copy_(per)
    if out is not None:
        out.copy_(words)
        return out
    return words


def fingerprint_tensor(t: torch.Tensor) -> tuple[int, int]:
    """The tensor fingerprint (f0, f1) as host ints; syncs."""
    loc = local_tensor(t)
    if _use_triton(loc.device):
        per = torch.empty(1, 2, dtype=torch.int64, device=loc.device)
        fingerprint_tensors_async([t], per_tensor_out=per)
        return fingerprint_words_to_ints(per[0])  # type: ignore[return-value]
    _, per = (fingerprint_tensors_host if loc.device.type == "cpu" else fingerprint_tensors_torch)([loc])
    return fingerprint_words_to_ints(per[0])  # type: ignore[return-value]


def fingerprint_tensors(tensors: Sequence[torch.Tensor]) -> tuple[int, int]:
    """The list fingerprint as host ints; syncs."""
    return fingerprint_words_to_ints(fingerprint_tensors_async(tensors))  # type: ignore[return-value]
