"""The fused multi-tensor fingerprint kernel (Triton), computing the spec in ``fingerprint.py``.

Layout. All tensors of a list are addressed by byte offsets (possibly negative) from one plan-owned,
16-byte-aligned anchor buffer. The anchor goes to the kernel twice, as a uint8 and an int32 pointer, so
Triton knows the alignment and emits 128-bit loads for tensors that start 16-byte aligned; the same kernel
source runs compiled on GPUs and under ``TRITON_INTERPRET=1`` on CPU tensors (raw host addresses there).

Work items. Each tensor is cut into tiles of ``BLOCK`` words and runs of tiles into work items; one program
per item (small tensors are one item each; big ones many, sized so the grid fills the GPU). An item whose
tensor starts 16-byte aligned (relative to the base) reads 128-bit vectors and accumulates per lane
``acc0 += w`` and ``acct += w * tile`` (one 32x32->64 multiply-add per word); its ``S1`` part is
``BLOCK * sum(acct) + sum(lane * acc0)``. The last up-to-15 bytes of an aligned tensor, and every byte of a
tensor that is not 16-byte aligned, go through a byte path that adds ``b << 8*(p%4)`` to S0 and
``(b << 8*(p%4)) * (p//4)`` to S1 (the sums are linear in the bytes). Each item atomically adds its
(S0, S1) into its tensor's accumulators (integer adds commute, so the result is exact); one finalising
program applies spec steps 5 and 6, writes per-tensor and list words, and zeroes the accumulators.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from checksums.fingerprint_host import (
    MASK64,
    canonical_dtype_name,
    count_words,
    header_words,
    position_words,
    to_signed64,
)

logger = logging.getLogger(__name__)

ITEM_FIELDS = 9  # off_bytes, nbytes, tile0, ntiles_full, has_partial, mode, nvec4, tail, tensor
TENSOR_FIELDS = 8  # h0, h1, p0, p1, item_start, item_count, 0, 0 ; last row: n0, n1, 0...
DEFAULT_BLOCK = int(os.environ.get("SDCWATCH_FP_BLOCK", "1024"))
DEFAULT_WARPS = int(os.environ.get("SDCWATCH_FP_WARPS", "4"))
MAX_TILES_PER_ITEM = 256
DEFAULT_ITEMS_PER_SM = int(os.environ.get("SDCWATCH_FP_ITEMS_PER_SM", "32"))
FINAL_TB = 128


@triton.jit
def _fmix64(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)

@triton.jit
def _fold_words(w, t, acc0, acct):
    """Per lane: ``acc0 += w``, ``acct += w * t`` for one tile ``t`` of 32-bit words ``w`` (the spec's sums)."""
    w = w.to(tl.uint32, bitcast=True).to(tl.uint64)
    return acc0 + w, acct + w * t.to(tl.uint32).to(tl.uint64)

@triton.jit
def _byte_sums(bbase, start, nbytes, niter, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    a0 = tl.zeros([BLOCK], dtype=tl.uint64)
    a1 = tl.zeros([BLOCK], dtype=tl.uint64)
    for k in range(0, niter):
        p = start + k * BLOCK + lanes
        b = tl.load(bbase + p, mask=p < nbytes, other=0)
        v = b.to(tl.uint64) << ((p & 3) * 8).to(tl.uint64)
        a0 += v
        a1 += v * (p >> 2).to(tl.uint64)
    return tl.sum(a0, axis=0), tl.sum(a1, axis=0)

@triton.jit
def fp_partials_kernel(base_u8, base_i32, items, acc, BLOCK: tl.constexpr, TAIL: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rec = items + pid * 9
    off = tl.load(rec + 0)
    nbytes = tl.load(rec + 1)
    tile0 = tl.load(rec + 2)
    nfull = tl.load(rec + 3)
    has_partial = tl.load(rec + 4)
    mode = tl.load(rec + 5)
    nvec4 = tl.load(rec + 6)
    tail = tl.load(rec + 7)
    tidx = tl.load(rec + 8)
    s0 = tl.sum(tl.zeros([TAIL], dtype=tl.uint64), axis=0)
    s1 = s0
    if mode == 0:
        lanes = tl.arange(0, BLOCK)
        wbase = base_i32 + (off >> 4) * 4  # 16-byte aligned: lets Triton emit 128-bit loads
        acc0 = tl.zeros([BLOCK], dtype=tl.uint64)
        acct = tl.zeros([BLOCK], dtype=tl.uint64)
        for k in range(0, nfull):
            t = tile0 + k
            w = tl.load(wbase + t * BLOCK + lanes)
            acc0, acct = _fold_words(w, t, acc0, acct)
        if has_partial != 0:
            t = tile0 + nfull
            idx = t * BLOCK + lanes
            w = tl.load(wbase + idx, mask=idx < nvec4 * 4, other=0)
            acc0, acct = _fold_words(w, t, acc0, acct)
        s0 = tl.sum(acc0, axis=0)
        s1 = tl.sum(acct, axis=0) * BLOCK + tl.sum(acc0 * lanes.to(tl.uint64), axis=0)
    else:
        a0, a1 = _byte_sums(base_u8 + off, tile0 * (4 * BLOCK), nbytes, nfull * 4, BLOCK)
        s0 += a0
        s1 += a1
    if tail != 0:
        a0, a1 = _byte_sums(base_u8 + off, nvec4 * 16, nbytes, 1, TAIL)
        s0 += a0
        s1 += a1
    # integer adds mod 2**64 commute: the order in which items land does not matter
    tl.atomic_add(acc + tidx * 2, s0.to(tl.int64, bitcast=True))
    tl.atomic_add(acc + tidx * 2 + 1, s1.to(tl.int64, bitcast=True))

@triton.jit
def fp_finalize_kernel(acc, table, n_tensors, per_tensor, out, TB: tl.constexpr):
    l0 = tl.zeros([TB], dtype=tl.uint64)
    l1 = tl.zeros([TB], dtype=tl.uint64)
    for start in range(0, n_tensors, TB):
        k = start + tl.arange(0, TB).to(tl.int64)
        m = k < n_tensors
        row = table + k * 8
        h0 = tl.load(row + 0, mask=m, other=0).to(tl.uint64, bitcast=True)
        h1 = tl.load(row + 1, mask=m, other=0).to(tl.uint64, bitcast=True)
        p0 = tl.load(row + 2, mask=m, other=0).to(tl.uint64, bitcast=True)
        p1 = tl.load(row + 3, mask=m, other=0).to(tl.uint64, bitcast=True)
        s0 = tl.load(acc + k * 2, mask=m, other=0)
        s1 = tl.load(acc + k * 2 + 1, mask=m, other=0)
        tl.store(acc + k * 2, tl.zeros_like(s0), mask=m)  # ready for the next run, stream-ordered
        tl.store(acc + k * 2 + 1, tl.zeros_like(s1), mask=m)
        f0 = _fmix64(s0.to(tl.uint64, bitcast=True) ^ h0)
        f1 = _fmix64((s1.to(tl.uint64, bitcast=True) ^ h1) + f0)
        tl.store(per_tensor + k * 2, f0.to(tl.int64, bitcast=True), mask=m)
        tl.store(per_tensor + k * 2 + 1, f1.to(tl.int64, bitcast=True), mask=m)
        g0 = _fmix64(f0 ^ p0)
        g1 = _fmix64(f1 ^ p1)
        l0 += tl.where(m, g0, tl.zeros_like(g0))
        l1 += tl.where(m, g1, tl.zeros_like(g1))
    last = table + n_tensors * 8
    n0 = tl.load(last + 0).to(tl.uint64, bitcast=True)
    n1 = tl.load(last + 1).to(tl.uint64, bitcast=True)
    big0 = _fmix64(tl.sum(l0, axis=0) ^ n0)
    big1 = _fmix64((tl.sum(l1, axis=0) ^ n1) + big0)
    tl.store(out + 0, big0.to(tl.int64, bitcast=True))
    tl.store(out + 1, big1.to(tl.int64, bitcast=True))


def _kernels():
    return fp_partials_kernel, fp_finalize_kernel


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class TritonFingerprintPlan:
    """Metadata for one list of tensors on one device, built once; ``run_async`` launches the kernels.

    Non-contiguous tensors are copied into plan-owned contiguous buffers on each run (stream-ordered).
    Runs of one plan must be issued on one stream (they share the per-tensor accumulators, which the
    finaliser zeroes for the next run).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], block: int = DEFAULT_BLOCK,
                 num_warps: int = DEFAULT_WARPS, items_per_sm: int = DEFAULT_ITEMS_PER_SM) -> None:
        if block < 64 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 64, got {block}")
        self.block, self.num_warps, self.items_per_sm = block, num_warps, items_per_sm
        if any(type(t).__name__ == "DTensor" for t in tensors):
            raise ValueError("pass a DTensor's local shard (checksums.fingerprint.local_tensor)")
        srcs = [t.detach() for t in tensors]
        self.n = len(srcs)
        self.device = srcs[0].device if srcs else torch.device("cpu")
        if any(t.device != self.device for t in srcs):
            raise ValueError("all tensors of one fingerprint must be on the same device")
        self._staging: list[tuple[torch.Tensor, torch.Tensor]] = []
        flat: list[torch.Tensor] = []
        for t in srcs:
            canonical_dtype_name(t.dtype)  # clear error for unsupported dtypes
            if not t.is_contiguous():
                dst = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                self._staging.append((dst, t))
                t = dst
            flat.append(t)
        self._tensors = flat  # keep storages alive
        # A plan-owned 16-byte-aligned anchor; tensors are addressed by (possibly negative) byte offsets
        # from it, so Triton sees a 16-byte-aligned base pointer.
        self.base_u8 = torch.zeros(64, dtype=torch.uint8, device=self.device)
        self.base_i32 = self.base_u8.view(torch.int32)
        base_addr = self.base_u8.data_ptr()
        if base_addr % 16:
            raise ValueError(f"internal: anchor buffer at {base_addr:#x} is not 16-byte aligned")
        items, table = self._build_tables(flat, base_addr)
        self.n_items = len(items)
        self.items = torch.tensor(items or [[0] * ITEM_FIELDS], dtype=torch.int64).to(self.device)
        self.table = torch.tensor(table, dtype=torch.int64).to(self.device)
        self.acc = torch.zeros(max(self.n, 1), 2, dtype=torch.int64, device=self.device)
        self.per_tensor = torch.zeros(max(self.n, 1), 2, dtype=torch.int64, device=self.device)

    def _build_tables(self, flat: list[torch.Tensor], base_addr: int) -> tuple[list[list[int]], list[list[int]]]:
        block = self.block
        total_tiles = sum(-(-t.numel() * t.element_size() // (4 * block)) for t in flat)
        chunk = max(1, min(MAX_TILES_PER_ITEM, total_tiles // (_sm_count(self.device) * self.items_per_sm)))
        items: list[list[int]] = []
        table: list[list[int]] = []
        for k, t in enumerate(flat):
            nbytes = t.numel() * t.element_size()
            first = len(items)
            if nbytes:
                off = t.data_ptr() - base_addr
                if off % 16 == 0:
                    nvec4 = nbytes // 16
                    nwords = nvec4 * 4
                    ntiles = -(-nwords // block)
                    if ntiles >= 1 << 32:
                        raise ValueError(f"tensor {k} is too large ({nbytes} bytes) for the kernel")
                    tailflag = 1 if nbytes % 16 else 0
                    for t0 in range(0, max(ntiles, 1), chunk):
                        n_here = min(chunk, ntiles - t0)
                        last_partial = (t0 + n_here == ntiles) and (nwords % block != 0)
                        nfull = max(n_here - (1 if last_partial else 0), 0)
                        is_last = t0 + chunk >= ntiles
                        items.append([off, nbytes, t0, nfull, int(last_partial), 0, nvec4,
                                      tailflag if is_last else 0, k])
                else:
                    ntiles = -(-nbytes // (4 * block))
                    for t0 in range(0, ntiles, chunk):
                        n_here = min(chunk, ntiles - t0)
                        items.append([off, nbytes, t0, n_here, 0, 1, 0, 0, k])
            h0, h1 = header_words(canonical_dtype_name(t.dtype), tuple(t.shape))
            p0, p1 = position_words(k)
            table.append([to_signed64(v) for v in (h0, h1, p0, p1)] + [first, len(items) - first, 0, 0])
        n0, n1 = count_words(len(flat))
        table.append([to_signed64(n0), to_signed64(n1)] + [0] * (TENSOR_FIELDS - 2))
        return items, table

    def run_async(self, out: torch.Tensor | None = None,
                  per_tensor_out: torch.Tensor | None = None) -> torch.Tensor:
        """Launch; returns the int64 [2] list words (fresh tensor unless ``out``). No host sync."""
        partials_kernel, finalize_kernel = _kernels()
        if out is None:
            out = torch.empty(2, dtype=torch.int64, device=self.device)
        per = self.per_tensor if per_tensor_out is None else per_tensor_out
        if per_tensor_out is not None and (per_tensor_out.shape != (self.n, 2)
                                           or per_tensor_out.dtype != torch.int64):
            raise ValueError(f"per_tensor_out must be int64 of shape ({self.n}, 2)")
        # Launch on the tensors' device (and so on that device's current stream), whatever device is current
        # for the calling thread: Triton launches on the current device, and memory of another GPU is not
        # accessible from it (and its stream would not be ordered after the producer's).
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for dst, src in self._staging:
                dst.copy_(src)
            if self.n_items:
                partials_kernel[(self.n_items,)](self.base_u8, self.base_i32, self.items, self.acc,
                                                 BLOCK=self.block, TAIL=16, num_warps=self.num_warps)
            finalize_kernel[(1,)](self.acc, self.table, self.n, per, out, TB=FINAL_TB, num_warps=4)
        return out


def fingerprint_tensors_triton(tensors: Sequence[torch.Tensor], block: int = DEFAULT_BLOCK,
                               num_warps: int = DEFAULT_WARPS) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """Uncached convenience for tests: (list words, per-tensor words) as host ints (syncs)."""
    plan = TritonFingerprintPlan(tensors, block=block, num_warps=num_warps)
    words = plan.run_async()
    lw = tuple(int(v) & MASK64 for v in words.cpu().tolist())
    per = [tuple(int(v) & MASK64 for v in row) for row in plan.per_tensor[: plan.n].cpu().tolist()]
    return lw, per  # type: ignore[return-value]
