"""The SM-naming canary (checksums/canary_sm.py) on the CPU: the Triton kernel under TRITON_INTERPRET=1 with
the SM ids fed in (%smid cannot be read there), an injected fault on one SM reported with GPU, SM and tile,
and the per-SM coverage check. The interpreter must be chosen before triton is first imported, so the
kernel runs in a child process (this file, run as a script). On the H200 the same kernel reads %smid:
bench/bench_canary_sm.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NUM_SMS = 8


def _child() -> None:
    from checksums import canary_sm
    from sdcwatch.canary import DeviceInfo

    dev = DeviceInfo(label="GPU-cpu-sim", device="cpu", name="interpreter")
    spec = canary_sm.sm_spec("fp32", m=256, n=320, k=64)        # 4 x 5 tiles of 64 x 64
    tiles = canary_sm.tile_grid(spec.m, spec.n)
    n_tiles = tiles[0] * tiles[1]
    fed = torch.arange(n_tiles, dtype=torch.int32) % NUM_SMS     # tile t "ran on" SM t % 8
    report = {}
    for name, kwargs in {
        "clean": {"sm_ids": fed},
        "fault_sm3": {"sm_ids": fed, "fault_sm": 3},
        "missing_sms": {"sm_ids": fed % 6},                        # SMs 6 and 7 never get a tile
        "no_smid_on_cpu": {},
    }.items():
        r = canary_sm.run_sm_canary(spec, dev, num_sms=NUM_SMS, **kwargs)
        report[name] = {"status": r.status.value, "why": r.why, "details": r.details}
    # fp16, not bf16: the interpreter's numpy has no bfloat16 (it reads the raw bits); the GPU runs bf16
    bf = canary_sm.run_sm_canary(canary_sm.sm_spec("fp16", m=128, n=128, k=256), dev, num_sms=4,
                                 sm_ids=torch.tensor([0, 1, 2, 3], dtype=torch.int32), fault_sm=2)
    report["fp16_fault_sm2"] = {"status": bf.status.value, "why": bf.why, "details": bf.details}
    print(json.dumps(report, default=str))


def _run_child() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sm_canary_on_the_cpu_with_sm_ids_fed_in() -> None:
    rep = _run_child()
    clean = rep["clean"]
    assert clean["status"] == "PASS", clean["why"]
    assert clean["details"]["coverage"] == {"num_sms": NUM_SMS, "covered": NUM_SMS, "missing": []}

    fault = rep["fault_sm3"]
    assert fault["status"] == "FAIL"
    located = fault["details"]["located"]
    # tiles 3, 11 and 19 (row-major over 4 x 5) ran on SM 3: exactly those are wrong, one element each
    assert [(t["tile_row"], t["tile_col"]) for t in located] == [(0, 3), (2, 1), (3, 4)]
    assert {t["sm"] for t in located} == {3} and fault["details"]["suspect_sms"] == {"3": 3}
    assert fault["why"].startswith("GPU-cpu-sim: SM 3 computed 3 wrong tile(s), first tile (0, 3) of 64x64")
    assert fault["details"]["mismatch"]["count"] == 3

    missing = rep["missing_sms"]
    assert missing["status"] == "UNKNOWN" and "2 of 8 SMs ran no tile" in missing["why"]
    assert missing["details"]["coverage"]["missing"] == [6, 7]

    assert rep["no_smid_on_cpu"]["status"] == "UNKNOWN" and "%smid" in rep["no_smid_on_cpu"]["why"]

    bf = rep["fp16_fault_sm2"]   # fp16 inputs, fp32 output: the flipped low bit is not rounded away
    assert bf["status"] == "FAIL" and [t["sm"] for t in bf["details"]["located"]] == [2]


def test_coverage_and_attribution_are_pure() -> None:
    from checksums.canary_sm import attribute, coverage, suspect_sms

    tile_sm = torch.tensor([[0, 1, 2], [2, 5, 0]], dtype=torch.int32)
    cov = coverage(tile_sm, 6)
    assert cov.covered == (0, 1, 2, 5) and cov.missing == (3, 4) and not cov.complete
    assert coverage(tile_sm, 3).complete   # an SM id past the count (5) is covered, not a hole
    assert coverage(tile_sm % 3, 4).missing == (3,)
    located = attribute([[1, 0], [0, 2]], tile_sm)
    assert located == [{"tile_row": 1, "tile_col": 0, "sm": 2}, {"tile_row": 0, "tile_col": 2, "sm": 2}]
    assert suspect_sms(located) == {2: 2}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_kernel_compiles_for_the_h200_reading_smid(dtype: str) -> None:
    """No GPU here, but Triton compiles for one: the kernel that reads %smid builds for sm_90 (ptxas included
    with Triton), with the SM register read in its PTX and tensor-core MMAs for the 16-bit inputs."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("run without TRITON_INTERPRET=1: this test compiles the kernel for the GPU")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from checksums.canary_sm import BK, BM, BN, _sm_gemm_kernel

    ptr = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}[dtype]
    sig = {"a_ptr": ptr, "b_ptr": ptr, "c_ptr": "*fp32", "tile_sm_ptr": "*i32", "fed_ptr": "*i32",
           **{n: "i32" for n in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm",
                                 "stride_cn", "fault_sm")},
           **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "READ_SMID")}}
    src = ASTSource(fn=_sm_gemm_kernel, signature=sig,
                    constexprs={"BLOCK_M": BM, "BLOCK_N": BN, "BLOCK_K": BK, "READ_SMID": True})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    ptx = kernel.asm["ptx"]
    assert "%smid" in ptx and kernel.asm["cubin"]
    assert ("mma" in ptx) == (dtype != "fp32")   # fp32 "ieee" is not a tensor-core dot: FMAs


if __name__ == "__main__":
    _child()
