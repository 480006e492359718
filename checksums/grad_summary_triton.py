"""The fused gradient-bucket summary (Triton): norm, max-abs and exact fingerprint in one read of the bucket.

`checksums.grad_checks.bucket_summary` describes the row: int64 [4] = the L2 norm and the max-abs as float64
bit patterns, then the two list words of the fingerprint (checksums.fingerprint) of the one-tensor list
[flat]. The torch path makes about five passes over the bucket (norm, abs copy, amax, fingerprint) and a
dozen launches; this kernel reads each 32-bit word once and computes everything from it, in one launch (the
last work item to finish reduces the partials) or, with ``one_launch=False``, two:

* ``gs_partials_kernel``, one program per work item (a run of tiles of ``BLOCK`` words, cut as
  checksums.fingerprint_triton cuts them): 128-bit loads of the words, per lane ``acc0 += w`` and
  ``acct += w * tile`` (the fingerprint's S0/S1 parts), and the words decoded to fp32 (fp32: a bitcast;
  bf16: each half shifted into the high bits of an fp32; fp16: a conversion) for a per-lane sum of squares
  and max of |x|. The last item also takes the tail (the bytes past the last whole 16-byte vector): bytes
  for the fingerprint, elements for the statistics. Each item writes its four partials to its own slot
  (no atomics).
* ``gs_finalize_kernel``, one program (or, with ``one_launch``, the last work item to finish, found by an
  acq_rel counter): sums the partials in a fixed order (so the row is the same bit for
  bit on every run), applies the fingerprint spec's mixing (steps 5 and 6, a list of one tensor), takes
  the square root in float64 and writes the row. A non-finite sum of squares (a NaN or an Inf anywhere,
  or an fp32 overflow) makes both statistics NaN, as the torch path does.

The plan depends only on the buffer's size, dtype and device, not on its address: the buffer is reached by
a byte offset from a plan-owned 16-byte-aligned anchor (as in fingerprint_triton), passed per run, so a
bucket that moves (DDP's rebuild, FSDP's fresh reduce-scatter input) reuses its plan. Everything the
kernels touch is allocated when the plan is built; a run does no host synchronisation. Runs of one plan
must be stream-ordered (they share the partials buffer).

Eligible buffers: contiguous fp32, bf16 or fp16 starting 16-byte aligned (`supports`); the caller
falls back to the torch path otherwise.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from checksums.fingerprint_host import (
    canonical_dtype_name,
    count_words,
    header_words,
    position_words,
    to_signed64,
)
from checksums.fingerprint_triton import MAX_TILES_PER_ITEM, _byte_sums, _fmix64, _fold_words, _sm_count

# the launch configuration from the H200 sweep (`python -m bench.bench_grad_summary --sweep`, docs/BENCHMARKS.md,
# ninth session): 512-word tiles, 4 warps, 4 work items per SM read GPT-2 small's 13 fp32 buckets in 0.214 ms
# of device time a step (2.33 TB/s: what a plain `sum` of the same buckets reads, 0.216 ms) against 0.331 ms
# with the previous 1024 / 4 / 16; every configuration's rows equal the default's
DEFAULT_BLOCK = int(os.environ.get("SDCWATCH_GS_BLOCK", "512"))
DEFAULT_WARPS = int(os.environ.get("SDCWATCH_GS_WARPS", "4"))
DEFAULT_ITEMS_PER_SM = int(os.environ.get("SDCWATCH_GS_ITEMS_PER_SM", "4"))
# one launch a bucket: the last item to finish reduces the partials (an acq_rel counter) instead of a second,
# one-program kernel. Measured on the H200 (docs/BENCHMARKS.md, sixth session): a 25 MB bucket 27.7 / 26.4 us
# a call (bf16 / fp32) against 37.0 / 37.2 us with two launches, the same rows
# (tests/test_grad_summary_gpu.py);
# the call is host-bound at that size, and the checks' cost on a host-bound step is their host time.
# SDCWATCH_GS_ONE_LAUNCH=0 keeps two launches (bench/bench_grad_summary.py times and checks both)
DEFAULT_ONE_LAUNCH = os.environ.get("SDCWATCH_GS_ONE_LAUNCH", "1") != "0"
FINAL_TB, FINAL_WARPS = 4096, 8      # the finaliser: 132 SMs x 16 items in one pass of its loop
ONE_LAUNCH_TB = 1024                 # the one-launch form's tail (inside the partials kernel: its registers)
ROW_WORDS = 4
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NAN_BITS = 0x7FF8000000000000


@triton.jit
def _stats_of_words(w, DT: tl.constexpr):
    """Per lane (sum of squares, max |x|) in fp32 of the elements packed in 32-bit words `w`."""
    wu = w.to(tl.uint32, bitcast=True)
    if DT == 0:
        x = wu.to(tl.float32, bitcast=True)
        sq = x * x
        mx = tl.abs(x)
    else:
        if DT == 1:
            lo = (wu << 16).to(tl.float32, bitcast=True)
            hi = ((wu >> 16) << 16).to(tl.float32, bitcast=True)
        else:
            lo = (wu & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (wu >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        sq = lo * lo + hi * hi
        mx = tl.maximum(tl.abs(lo), tl.abs(hi))
    return sq, mx


@triton.jit
def _bf16_bits(y):
    """fp32 -> bf16 bits (in a uint32), rounded to nearest even as torch rounds (c10's
    round_to_nearest_even; NaN -> 0x7FC0), in integer ops: the same on the GPU and the interpreter (whose
    float cast to bf16 truncates)."""
    u = y.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(y != y, 0x7FC0, r)


@triton.jit
def _scaled_words(w, scale, DT: tl.constexpr):
    """The 32-bit words `w` with each element multiplied by `scale` in fp32 and rounded to nearest-even
    into its own dtype (what torch's `mul_` by a Python float does: fp32 math for fp32, bf16 and fp16)."""
    wu = w.to(tl.uint32, bitcast=True)
    if DT == 0:
        y = (wu.to(tl.float32, bitcast=True) * scale).to(tl.uint32, bitcast=True)
    else:
        if DT == 1:
            lo_b = _bf16_bits((wu << 16).to(tl.float32, bitcast=True) * scale)
            hi_b = _bf16_bits(((wu >> 16) << 16).to(tl.float32, bitcast=True) * scale)
        else:
            lo = (wu & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale
            hi = (wu >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale
            lo_b = lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
            hi_b = hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        y = (hi_b << 16) | lo_b
    return y.to(tl.int32, bitcast=True)


@triton.jit
def _scaled_elements(x, scale, DT: tl.constexpr):
    """fp32 values `x` (elements of the buffer) times `scale`, in the buffer's dtype, rounded as above."""
    y = x * scale
    if DT == 0:
        return y
    elif DT == 1:
        return _bf16_bits(y).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(tl.float16)


@triton.jit
def _fold_tile(w, t, acc0, acct, sq, mx, DT: tl.constexpr):
    """One tile of words into the fingerprint's per-lane sums and the stats' (sum of squares, max |x|)."""
    a, b = _stats_of_words(w, DT)
    acc0, acct = _fold_words(w, t, acc0, acct)
    return acc0, acct, sq + a, tl.maximum(mx, b)


# Scalars that may be 1 are not specialised: Triton turns an int argument equal to 1 into a constant, which
# has no `.to` (the H200 compile of a 7-element fp32 bucket, nvec4 == 1, failed so)
@triton.jit(do_not_specialize=["off", "nbytes", "nvec4", "n_items", "scale"])
def gs_partials_kernel(base_u8, base_i32, base_el, off, nbytes, nvec4, items, fpart, spart,
                       counter, n_items, hdr, out, scale,
                       BLOCK: tl.constexpr, TAIL: tl.constexpr, DT: tl.constexpr, ES: tl.constexpr,
                       ONE_LAUNCH: tl.constexpr, TB: tl.constexpr, SCALE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    off = off.to(tl.int64)
    nbytes = nbytes.to(tl.int64)
    nvec4 = nvec4.to(tl.int64)
    rec = items + pid * 4
    tile0 = tl.load(rec + 0)
    nfull = tl.load(rec + 1)
    has_partial = tl.load(rec + 2)
    tail = tl.load(rec + 3)
    lanes = tl.arange(0, BLOCK)
    wbase = base_i32 + (off >> 4) * 4  # 16-byte aligned: lets Triton emit 128-bit loads
    acc0 = tl.zeros([BLOCK], dtype=tl.uint64)
    acct = tl.zeros([BLOCK], dtype=tl.uint64)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    mx = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(nfull):
        t = tile0 + k
        w = tl.load(wbase + t * BLOCK + lanes)
        acc0, acct, sq, mx = _fold_tile(w, t, acc0, acct, sq, mx, DT)
        if SCALE:       # the summary is of the words as read; the buffer gets them scaled
            tl.store(wbase + t * BLOCK + lanes, _scaled_words(w, scale, DT))
    if has_partial != 0:
        t = tile0 + nfull
        idx = t * BLOCK + lanes
        w = tl.load(wbase + idx, mask=idx < nvec4 * 4, other=0)
        acc0, acct, sq, mx = _fold_tile(w, t, acc0, acct, sq, mx, DT)
        if SCALE:
            tl.store(wbase + idx, _scaled_words(w, scale, DT), mask=idx < nvec4 * 4)
    s0 = tl.sum(acc0, axis=0)
    s1 = tl.sum(acct, axis=0) * BLOCK + tl.sum(acc0 * lanes.to(tl.uint64), axis=0)
    ssq = tl.sum(sq, axis=0)
    smx = tl.max(mx, axis=0)
    if tail != 0:
        a0, a1 = _byte_sums(base_u8 + off, nvec4 * 16, nbytes, 1, TAIL)
        s0 += a0
        s1 += a1
        tl_lanes = tl.arange(0, TAIL)
        first = (off + nvec4 * 16) // ES                 # exact: off and 16 are multiples of ES
        n_el = (nbytes - nvec4 * 16) // ES
        x = tl.load(base_el + first + tl_lanes, mask=tl_lanes < n_el, other=0).to(tl.float32)
        ssq += tl.sum(x * x, axis=0)
        smx = tl.maximum(smx, tl.max(tl.abs(x), axis=0))
        if SCALE:       # after _byte_sums read these bytes (same program, program order)
            tl.store(base_el + first + tl_lanes, _scaled_elements(x, scale, DT), mask=tl_lanes < n_el)
    tl.store(fpart + pid * 2, s0.to(tl.int64, bitcast=True))
    tl.store(fpart + pid * 2 + 1, s1.to(tl.int64, bitcast=True))
    tl.store(spart + pid * 2, ssq)
    tl.store(spart + pid * 2 + 1, smx)
    if ONE_LAUNCH:
        # the last item to finish writes the row: its acquire sees every item's partials (each released
        # them with its increment); it re-arms the counter for the next run (stream-ordered)
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == n_items - 1:
            _final_row(fpart, spart, n_items, hdr, out, TB)
            tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit(do_not_specialize=["n_items"])
def gs_finalize_kernel(fpart, spart, n_items, hdr, out, TB: tl.constexpr):
    _final_row(fpart, spart, n_items, hdr, out, TB)


@triton.jit
def _final_row(fpart, spart, n_items, hdr, out, TB: tl.constexpr):
    a0 = tl.zeros([TB], dtype=tl.uint64)
    a1 = tl.zeros([TB], dtype=tl.uint64)
    sq = tl.zeros([TB], dtype=tl.float64)
    mx = tl.zeros([TB], dtype=tl.float32)
    for start in range(0, n_items, TB):              # a fixed order: the row is deterministic
        k = start + tl.arange(0, TB).to(tl.int64)
        m = k < n_items
        # .cg: from L2, never a stale L1 line of an earlier run (the one-launch form reads other programs'
        # partials)
        a0 += tl.load(fpart + k * 2, mask=m, other=0, cache_modifier=".cg").to(tl.uint64, bitcast=True)
        a1 += tl.load(fpart + k * 2 + 1, mask=m, other=0, cache_modifier=".cg").to(tl.uint64, bitcast=True)
        sq += tl.load(spart + k * 2, mask=m, other=0.0, cache_modifier=".cg").to(tl.float64)
        mx = tl.maximum(mx, tl.load(spart + k * 2 + 1, mask=m, other=0.0, cache_modifier=".cg"))
    s0 = tl.sum(a0, axis=0)
    s1 = tl.sum(a1, axis=0)
    h0 = tl.load(hdr + 0).to(tl.uint64, bitcast=True)
    h1 = tl.load(hdr + 1).to(tl.uint64, bitcast=True)
    p0 = tl.load(hdr + 2).to(tl.uint64, bitcast=True)
    p1 = tl.load(hdr + 3).to(tl.uint64, bitcast=True)
    n0 = tl.load(hdr + 4).to(tl.uint64, bitcast=True)
    n1 = tl.load(hdr + 5).to(tl.uint64, bitcast=True)
    f0 = _fmix64(s0 ^ h0)                            # the tensor's words (spec step 5)
    f1 = _fmix64((s1 ^ h1) + f0)
    l0 = _fmix64(f0 ^ p0)                            # the list of one tensor (spec step 6)
    l1 = _fmix64(f1 ^ p1)
    big0 = _fmix64(l0 ^ n0)
    big1 = _fmix64((l1 ^ n1) + big0)
    total = tl.sum(sq, axis=0)
    tbits = total.to(tl.int64, bitcast=True)
    nonfinite = ((tbits >> 52) & 0x7FF) == 0x7FF     # NaN or Inf anywhere (or an fp32 overflow)
    norm_bits = tl.sqrt(total).to(tl.int64, bitcast=True)
    amax_bits = tl.max(mx, axis=0).to(tl.float64).to(tl.int64, bitcast=True)
    nan_bits = tbits | 0x7FF8000000000000             # a NaN whatever total is when it is non-finite
    tl.store(out + 0, tl.where(nonfinite, nan_bits, norm_bits))
    tl.store(out + 1, tl.where(nonfinite, nan_bits, amax_bits))
    tl.store(out + 2, big0.to(tl.int64, bitcast=True))
    tl.store(out + 3, big1.to(tl.int64, bitcast=True))


def supports(t: torch.Tensor) -> bool:
    """Whether the fused kernel takes this buffer: a plain contiguous fp32/bf16/fp16 tensor, 16-byte
    aligned."""
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.dtype in _DTYPES \
        and t.is_contiguous() and t.data_ptr() % 16 == 0


class GradSummaryPlan:
    """The tables and buffers of the fused summary for buffers of one size, dtype and shape on one device.

    ``run_async(t)`` launches the kernels (one, or two with ``one_launch=False``) on ``t`` (any eligible
    tensor that `matches`) and returns the
    int64 [4] row on the device. No host synchronisation; ``out`` (int64 [4]) receives the row if given.
    """

    summarises = True   # checksums.grad_checks.bucket_summary: a fused plan, not a fingerprint plan

    def __init__(self, like: torch.Tensor, block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_WARPS,
                 items_per_sm: int = DEFAULT_ITEMS_PER_SM, one_launch: bool = DEFAULT_ONE_LAUNCH) -> None:
        if block < 64 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 64, got {block}")
        if not supports(like):
            raise ValueError("the fused summary takes contiguous 16-byte-aligned fp32/bf16/fp16 tensors, "
                             f"got {like.dtype} contiguous={like.is_contiguous()} at {like.data_ptr():#x}")
        self.block, self.num_warps, self.one_launch = block, num_warps, one_launch
        self.device, self.dtype, self.shape = like.device, like.dtype, tuple(like.shape)
        self.numel = like.numel()
        self.nbytes = self.numel * like.element_size()
        self._dt, self._es = _DTYPES[like.dtype], like.element_size()
        self.anchor = torch.zeros(64, dtype=torch.uint8, device=self.device)
        if self.anchor.data_ptr() % 16:
            raise ValueError(f"internal: anchor buffer at {self.anchor.data_ptr():#x} is not 16-byte aligned")
        self._anchor_ptr = self.anchor.data_ptr()
        self._base_i32 = self.anchor.view(torch.int32)
        self._base_el = self.anchor.view(like.dtype)
        self.nvec4 = self.nbytes // 16
        items = self._items(_sm_count(self.device), items_per_sm)
        self.n_items = len(items)
        h0, h1 = header_words(canonical_dtype_name(like.dtype), self.shape)
        p0, p1 = position_words(0)
        n0, n1 = count_words(1)
        self.hdr = torch.tensor([to_signed64(v) for v in (h0, h1, p0, p1, n0, n1)] + [0, 0],
                                dtype=torch.int64).to(self.device)
        self.items = torch.tensor(items or [[0] * 4], dtype=torch.int64).to(self.device)
        self.fpart = torch.zeros(max(self.n_items, 1), 2, dtype=torch.int64, device=self.device)
        self.spart = torch.zeros(max(self.n_items, 1), 2, dtype=torch.float32, device=self.device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)   # the one-launch form's
        self._direct: dict[tuple[bool, bool, bool], _DirectLaunch] = {}
        # the partials kernel's constexprs in its signature's order (BLOCK, TAIL, DT, ES, ONE_LAUNCH, TB, SCALE),
        # unscaled and scaled: the direct launch passes them positionally, made once here, not a call
        self._one = self.one_launch and self.n_items > 0
        self._constexprs = {s: (self.block, 16, self._dt, self._es, self._one, ONE_LAUNCH_TB, s)
                            for s in (False, True)}

    def _items(self, sms: int, items_per_sm: int) -> list[list[int]]:
        """Work items [tile0, full tiles, has a partial tile, takes the tail], as fingerprint_triton cuts."""
        if self.nbytes == 0:
            return []
        block = self.block
        nwords = self.nvec4 * 4
        ntiles = -(-nwords // block)
        if ntiles >= 1 << 32:
            raise ValueError(f"buffer too large ({self.nbytes} bytes) for the kernel")
        chunk = max(1, min(MAX_TILES_PER_ITEM, ntiles // (sms * items_per_sm)))
        tail = 1 if self.nbytes % 16 else 0
        items = []
        for t0 in range(0, max(ntiles, 1), chunk):
            n_here = min(chunk, ntiles - t0)
            last_partial = (t0 + n_here == ntiles) and (nwords % block != 0)
            nfull = max(n_here - (1 if last_partial else 0), 0)
            items.append([t0, nfull, int(last_partial), tail if t0 + chunk >= ntiles else 0])
        return items

    def matches(self, t: torch.Tensor) -> bool:
        return t.device == self.device and t.dtype == self.dtype and tuple(t.shape) == self.shape \
            and supports(t)

    def run_async(self, t: torch.Tensor, out: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        if not self.matches(t):
            raise ValueError(f"plan for {self.dtype} {self.shape} on {self.device} given {t.dtype} "
                             f"{tuple(t.shape)} on {t.device} (or not contiguous and 16-byte aligned)")
        return self.launch(t, out, scale)

    def launch(self, t: torch.Tensor, out: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        """`run_async` for a tensor the caller has checked with `matches` (the hooks' hot path).

        `scale` != 1: the same pass also multiplies `t` in place by `scale` (fp32 math, rounded to nearest
        even into t's dtype: torch's `t.mul_(scale)`, bit for bit), after reading it for the row: the
        pre-reduction scaling DDP does, without a second pass over the bucket.

        The first launch of each variant goes through Triton's JIT entry (it compiles and caches); later
        ones call the compiled kernel directly (`_DirectLaunch`): the JIT entry binds the arguments and
        builds a specialisation key on every call, ~60-90 us of host time a bucket on the H200's host, in
        the step of a host-bound job."""
        if out is None:
            out = torch.empty(ROW_WORDS, dtype=torch.int64, device=self.device)
        off = t.data_ptr() - self._anchor_ptr
        scaled = scale != 1.0
        with _on_device(self.device):
            one = self._one
            if self.n_items:
                args = self._args(off, out, scale)
                key = _variant(off, out, scaled)
                direct = self._direct.get(key)
                if direct is None or not direct(args, self._constexprs[scaled]):
                    compiled = gs_partials_kernel[(self.n_items,)](
                        *args, BLOCK=self.block, TAIL=16, DT=self._dt, ES=self._es, ONE_LAUNCH=one,
                        TB=ONE_LAUNCH_TB, SCALE=scaled, num_warps=self.num_warps)
                    if direct is None:
                        self._direct[key] = _DirectLaunch.of(compiled, (self.n_items, 1, 1))
            if not one:
                gs_finalize_kernel[(1,)](self.fpart, self.spart, self.n_items, self.hdr, out, TB=FINAL_TB,
                                         num_warps=FINAL_WARPS)
        return out

    def _args(self, off: int, out: torch.Tensor, scale: float) -> tuple:
        """The partials kernel's arguments but its constexprs, for the buffer at `off` from the anchor."""
        return (self.anchor, self._base_i32, self._base_el, off, self.nbytes, self.nvec4, self.items, self.fpart,
                self.spart, self.counter, self.n_items, self.hdr, out, float(scale))

    def bound(self, t: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> "BoundLaunch | None":
        """`launch(t, out, scale)` with every argument fixed but the stream: a `BoundLaunch` for a caller that
        launches on the same buffer into the same row every step (the DDP hook's bucket). Its arguments are
        plain integer device addresses (Triton's launcher takes an int as the address; given a tensor it
        calls `data_ptr()` and asks the driver about the pointer, for each of nine tensors), so a call is the
        compiled kernel's launcher and nothing else: ~5 us less host time a bucket than `launch` on the
        H200's host (bench/hook_host.py). None until `launch` has run this variant directly (it compiles
        it), or when direct launches are off or failed. The caller keeps `t` and `out` alive and at their
        addresses (it checks `t.data_ptr()` before each call) and calls on `t`'s device."""
        fixed = self._fixed_args(t, out, scale)
        return None if fixed is None else BoundLaunch(*fixed)

    def native_launch(self, t: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> "NativeLaunch | None":
        """`bound`'s launch described for a launcher outside Python (the C++ comm hook,
        checksums/native_hook.cpp): the compiled kernel's function handle, grid, block, shared memory and
        its parameters' values with their kinds, in the kernel's parameter order (constexprs left out, as
        Triton's launcher leaves them). None where `bound` is None, or for a kernel that needs more than a
        plain launch (scratch memory, clusters, cooperative or PDL launches, instrumentation)."""
        fixed = self._fixed_args(t, out, scale)
        if fixed is None or fixed[0].compiled is None:
            return None
        return native_launch_of(fixed[0].compiled, fixed[0].grid, fixed[1])

    def _fixed_args(self, t: torch.Tensor, out: torch.Tensor,
                    scale: float) -> "tuple[_DirectLaunch, tuple] | None":
        """The direct launch of the variant `t`, `out` and `scale` take, with every argument (integer
        addresses, constexprs last) in the signature's order; None when not one launch (the finaliser too,
        or an empty buffer) or that variant has no working direct launch."""
        if not self._one:
            return None
        off = t.data_ptr() - self._anchor_ptr
        scaled = scale != 1.0
        direct = self._direct.get(_variant(off, out, scaled))
        if direct is None or not direct.ok:
            return None
        ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self._args(off, out, scale))
        return direct, (*ints, *self._constexprs[scaled])


class NativeLaunch(NamedTuple):
    """A compiled kernel's launch for cuLaunchKernel: `params` as (kind, value), kind 0 a 64-bit integer or
    device address, 1 a 32-bit integer, 2 a float32 (checksums/native_hook.cpp packs them)."""
    function: int
    grid: tuple[int, int, int]
    block: int
    shared: int
    params: tuple[tuple[int, int | float], ...]


_KINDS = {"i64": 0, "u64": 0, "i32": 1, "u32": 1, "fp32": 2}
# what each integer parameter holds, as the C++ hook packs it (an int64 for 64-bit ones)
_RANGES = {"i32": (-(1 << 31), 1 << 31), "u32": (0, 1 << 32), "i64": (-(1 << 63), 1 << 63),
           "u64": (0, 1 << 63)}


def native_launch_of(compiled: object, grid: tuple[int, int, int], args: tuple) -> NativeLaunch | None:
    """A Triton `CompiledKernel`'s launch with `args` (every argument, in the signature's order), or None
    for one this cannot describe: arguments whose type is not an address, i32/u32/i64/u64 or fp32, or a
    launch that needs Triton's launcher (scratch memory, several CTAs, cooperative or PDL launches)."""
    function = getattr(compiled, "function", None)
    md = getattr(compiled, "metadata", None)
    src = getattr(compiled, "src", None)
    signature = getattr(src, "signature", None)
    if not function or md is None or not isinstance(signature, dict) or len(signature) != len(args):
        return None
    if (getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0)
            or getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False) or getattr(md, "instrumentation_mode", "")):
        return None
    params: list[tuple[int, int | float]] = []
    for ty, value in zip(signature.values(), args):
        if ty == "constexpr":
            continue
        kind = 0 if isinstance(ty, str) and ty.startswith("*") else _KINDS.get(ty)
        if kind is None or (kind == 2) != isinstance(value, float) or isinstance(value, bool):
            return None
        low, high = _RANGES.get(ty, (0, 1 << 63))           # (an address: a non-negative int64)
        if kind != 2 and not low <= value < high:
            return None                 # a value the compiled parameter cannot hold (another variant's)
        params.append((kind, value))
    return NativeLaunch(int(function), tuple(grid), 32 * int(md.num_warps), int(md.shared), tuple(params))


_I32 = 1 << 31


def _variant(off: int, out: torch.Tensor, scaled: bool) -> tuple[bool, bool, bool]:
    """Which compiled variant a launch takes: what Triton specialises among the arguments that change
    between calls (`off`'s integer type, i32 or i64 by its value, and `out`'s 16-byte alignment), and
    whether the pass scales the buffer."""
    return scaled, -_I32 <= off < _I32, out.data_ptr() % 16 == 0
# SDCWATCH_GS_DIRECT=0: every launch through Triton's JIT entry (bench/bench_grad_summary.py compares)
DIRECT_LAUNCH = os.environ.get("SDCWATCH_GS_DIRECT", "1") != "0"


class _DirectLaunch:
    """A compiled Triton kernel launched without the JIT entry: `CompiledKernel[grid](*args, stream=)`
    (the compiled kernel's own launcher, public in Triton 3.x), the arguments in the kernel's signature
    order (constexprs included: the launcher skips them). Calls return False (and the caller launches
    through the JIT entry) when direct launches are off, unavailable (the interpreter returns no compiled
    kernel), or failed once (then never again in this plan)."""

    __slots__ = ("_run", "ok", "compiled", "grid")

    def __init__(self, run: object, compiled: object = None, grid: tuple[int, int, int] = (1, 1, 1)) -> None:
        self._run = run
        self.ok = run is not None
        self.compiled, self.grid = compiled, grid     # for a launch made elsewhere (`native_args`)

    @classmethod
    def of(cls, compiled: object, grid: tuple[int, int, int]) -> "_DirectLaunch":
        if not DIRECT_LAUNCH or compiled is None:
            return cls(None)
        if hasattr(compiled, "result"):          # an asynchronous compile's future
            compiled = compiled.result()
        try:
            run = compiled[grid]                # type: ignore[index]
        except Exception:  # noqa: BLE001 (a Triton without this launcher: the JIT entry every time)
            run = None
        return cls(run, compiled if run is not None else None, grid)

    def __call__(self, args: tuple, constexprs: tuple) -> bool:
        if not self.ok:
            return False
        try:
            self._run(*args, *constexprs)       # type: ignore[misc]
        except Exception:  # noqa: BLE001 (an argument the launcher refuses: nothing was launched)
            self.ok = False
            return False
        return True


class BoundLaunch:
    """`GradSummaryPlan.bound`'s launch: `call(stream)` launches on that raw CUDA stream handle and returns
    True, or False (nothing launched; the caller takes `launch`) once this launch or the plan's direct
    launch was refused. A refusal here (say a Triton whose launcher takes no `stream=`) leaves the plan's
    direct launch on."""

    __slots__ = ("_direct", "_ints", "ok")

    def __init__(self, direct: _DirectLaunch, ints: tuple) -> None:
        self._direct, self._ints = direct, ints
        self.ok = True

    def __call__(self, stream: int) -> bool:
        d = self._direct
        if not (self.ok and d.ok):
            return False
        try:
            d._run(*self._ints, stream=stream)      # type: ignore[misc]
        except Exception:  # noqa: BLE001 (an argument the launcher refuses: nothing was launched)
            self.ok = False
            return False
        return True


def _on_device(device: torch.device):  # type: ignore[no-untyped-def]
    """Triton launches on the current device: make it the buffer's (a no-op when it already is)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
