"""Known-answer GEMM canaries that name the SM: which SM computed each output tile, so a FAIL says GPU, SM
and tile, and a coverage check proves every SM of the GPU ran at least one tile.

The GEMM is a Triton kernel (`_sm_gemm_kernel`): one program per BM x BN output tile, fp32 accumulation of
exact integers (the known-answer construction of `checksums.canary_gemm`, fp32 / fp16 / bf16 inputs), and
each program stores the SM it ran on into `tile_sm[pid_m, pid_n]`, read from the PTX special register
`%smid` with inline assembly (`READ_SMID`). `%smid` is the SM a block runs on while it runs (NVIDIA does not
promise it is contiguous or stable across runs; a block is never migrated while it runs, which is all the
attribution needs). Where it cannot be read (the CPU under TRITON_INTERPRET=1, which has no PTX) the SM ids
are fed in (`sm_ids`), so the same kernel and the same attribution and coverage code run on the CPU.

Fault injection for tests and the H200 demonstration: `fault_sm` >= 0 makes the program(s) that run on that
SM flip the lowest bit of their tile's first element, as a faulty SM would. The check then reports the
mismatching tile(s) and the SM that computed them (`attribute`).

Coverage (`coverage`): the SMs that ran at least one tile, against the GPU's SM count
(`multi_processor_count`); a quick run with more tiles than SMs normally covers them all, and the check
says which SMs it missed when it does not (`run_sm_canary` retries up to `coverage_tries` times).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from checksums import canary_gemm
from checksums.canary_gemm import KnownAnswerSpec, localise
from sdcwatch.canary import CheckResult, DeviceInfo, Status

BM, BN, BK = 64, 64, 32


@triton.jit
def _sm_gemm_kernel(a_ptr, b_ptr, c_ptr, tile_sm_ptr, fed_ptr, M, N, K,
                    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, fault_sm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    READ_SMID: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    tile = pid_m * tl.num_programs(1) + pid_n
    if READ_SMID:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        sm = tl.load(fed_ptr + tile)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    first = (rm[:, None] == pid_m * BLOCK_M) & (rn[None, :] == pid_n * BLOCK_N)
    flip = first & (sm == fault_sm)
    acc_bits = acc.to(tl.int32, bitcast=True)
    acc = tl.where(flip, acc_bits ^ 1, acc_bits).to(tl.float32, bitcast=True)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))
    tl.store(tile_sm_ptr + tile, sm)


def interpreted() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU): %smid cannot be read, SM ids must be fed in."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def tile_grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BM), triton.cdiv(n, BN)


def sm_gemm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype, fault_sm: int = -1,
            sm_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(C = A @ B with fp32 accumulation in `out_dtype`, tile_sm[tiles_m, tiles_n] int32). `sm_ids` (int32,
    one per tile, on the inputs' device) replaces %smid: required on the CPU, optional on a GPU (tests)."""
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"sm_gemm: inner dimensions differ ({k} and {k2})")
    grid = tile_grid(m, n)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    tile_sm = torch.full(grid, -1, dtype=torch.int32, device=a.device)
    read = sm_ids is None
    if read and (a.device.type != "cuda" or interpreted()):
        raise ValueError("%smid can be read only in a compiled kernel on a GPU: pass sm_ids (the CPU, "
                         "TRITON_INTERPRET=1)")
    fed = tile_sm if read else sm_ids.to(device=a.device, dtype=torch.int32).reshape(grid).contiguous()
    _sm_gemm_kernel[grid](a, b, c, tile_sm, fed, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                          c.stride(0), c.stride(1), int(fault_sm), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                          READ_SMID=read)
    return c, tile_sm


# ----------------------------------------------------------------------------- attribution, coverage (pure)


@dataclasses.dataclass(frozen=True, slots=True)
class Coverage:
    num_sms: int
    covered: tuple[int, ...]      # SM ids that ran at least one tile
    missing: tuple[int, ...]      # SM ids in range(num_sms) that ran none

    @property
    def complete(self) -> bool:
        return not self.missing

    def to_json(self) -> dict[str, Any]:
        return {"num_sms": self.num_sms, "covered": len(self.covered), "missing": list(self.missing)}


def coverage(tile_sm: torch.Tensor, num_sms: int) -> Coverage:
    """Which of the GPU's `num_sms` SMs ran at least one tile (tile_sm: the SM id of each tile)."""
    seen = {int(s) for s in tile_sm.flatten().tolist() if s >= 0}
    return Coverage(num_sms, tuple(sorted(seen)), tuple(s for s in range(num_sms) if s not in seen))


def attribute(tiles: Sequence[Sequence[int]], tile_sm: torch.Tensor) -> list[dict[str, int]]:
    """[{"tile_row", "tile_col", "sm"}] for each wrong tile ([row, col] in BM x BN tiles)."""
    return [{"tile_row": int(r), "tile_col": int(c), "sm": int(tile_sm[int(r), int(c)])} for r, c in tiles]


def suspect_sms(located: Sequence[dict[str, int]]) -> dict[int, int]:
    """SM id -> how many wrong tiles it computed (the SM to blame computed them all, or most)."""
    out: dict[int, int] = {}
    for t in located:
        out[t["sm"]] = out.get(t["sm"], 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ----------------------------------------------------------------------------- the check


def sm_spec(dtype: str = "bf16", m: int = 4096, n: int = 4096, k: int = 512,
            seed: int = 0) -> KnownAnswerSpec:
    """The known-answer spec of the SM canary (fp32 / fp16 / bf16 inputs, fp32 output so a flipped low bit
    is never rounded away; no split-K: one program per tile)."""
    if dtype not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"the SM canary runs fp32, fp16 or bf16 inputs, not {dtype}")
    return KnownAnswerSpec(dtype=dtype, m=m, n=n, k=k, seed=seed, shape_name="sm", out="fp32")


def run_sm_canary(spec: KnownAnswerSpec, dev: DeviceInfo, *, num_sms: int | None = None, fault_sm: int = -1,
                  sm_ids: torch.Tensor | None = None, coverage_tries: int = 3) -> CheckResult:
    """One SM-attributed known-answer GEMM on `dev`. PASS: bit-exact and every SM covered; FAIL: wrong tiles,
    named with the SM that computed each; UNKNOWN: the kernel could not run, or an SM ran no tile in
    `coverage_tries` runs (coverage not proven, nothing wrong seen)."""
    t0 = time.perf_counter()
    device = torch.device(dev.device)
    try:
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        a, b = canary_gemm.build_inputs(spec, device)
        expected = canary_gemm.expected_output(spec, device)
        cov = None
        for _ in range(max(1, coverage_tries)):
            out, tile_sm = sm_gemm(a, b, out_dtype=spec.out_dtype, fault_sm=fault_sm, sm_ids=sm_ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            mismatch = localise(expected, out, (BM, BN))
            cov = coverage(tile_sm.cpu(), num_sms)
            if mismatch is not None or cov.complete:
                break
    except Exception as exc:   # no Triton backend, out of memory, ...: the check could not run
        return CheckResult("gemm_sm", f"sm-{spec.name}", Status.UNKNOWN, (dev.label,),
                           time.perf_counter() - t0, why=f"{type(exc).__name__}: {exc}".strip()[:500],
                           details={"spec": spec.to_json()})
    assert cov is not None
    details: dict[str, Any] = {"spec": spec.to_json(), "tile": [BM, BN], "coverage": cov.to_json(),
                               "tiles": int(tile_sm.numel())}
    name = f"sm-{spec.name}"
    if mismatch is not None:
        located = attribute(mismatch.tiles, tile_sm.cpu())
        sms = suspect_sms(located)
        details.update(mismatch=mismatch.to_json(), located=located, suspect_sms=sms)
        first = located[0]
        why = (f"{dev.label}: SM {next(iter(sms))} computed {len(located)} wrong tile(s), first tile "
               f"({first['tile_row']}, {first['tile_col']}) of {BM}x{BN}: {mismatch.summary()}")
        return CheckResult("gemm_sm", name, Status.FAIL, (dev.label,), time.perf_counter() - t0, why=why,
                           details=details)
    if not cov.complete:
        return CheckResult("gemm_sm", name, Status.UNKNOWN, (dev.label,), time.perf_counter() - t0,
                           why=f"{len(cov.missing)} of {num_sms} SMs ran no tile in {coverage_tries} runs: "
                               f"{list(cov.missing)[:16]}", details=details)
    return CheckResult("gemm_sm", name, Status.PASS, (dev.label,), time.perf_counter() - t0, details=details)
