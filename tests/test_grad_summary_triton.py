"""The fused gradient-bucket summary kernel (checksums/grad_summary_triton.py) under TRITON_INTERPRET=1 on CPU
tensors, against the fingerprint spec (numpy, checksums.fingerprint_host) and the torch path
(checksums.grad_checks.bucket_summary_torch).

The interpreter must be chosen before triton is first imported, so the kernel runs in a child process
(this file, run as a script); the tests check what it reports. Small tensors: the interpreter is slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util
import math

import pytest
import torch
from deadlines import scaled

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# element counts: empty, under one 16-byte vector, exact vectors, tails of every length, several tiles
SIZES = (0, 1, 3, 7, 8, 9, 15, 64, 65, 257, 1000, 1029, 4099)


def _aligned(n: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """A 16-byte-aligned tensor of n random values (a slice of a larger buffer, like a DDP bucket)."""
    x = (torch.randn(n + 64, generator=gen) * scale).to(dtype)
    es = x.element_size()
    skip = (-x.data_ptr() % 16) // es
    return x[skip: skip + n]


def _child() -> None:

    from checksums.fingerprint import fingerprint_bytes, fingerprint_list_from_parts, to_signed64
    from checksums.grad_checks import bucket_summary, bucket_summary_torch, stats_of

    allowed: list[tuple[int, int]] = []
    stray: list[int] = []
    from interpreter_support import patch_language_once_per_launch
    from test_fingerprint_triton import guard_interpreted_loads
    guard_interpreted_loads(allowed, stray)   # every read inside the buffer or the plan's tables
    patch_language_once_per_launch()          # the interpreter's set-up once a launch, not once a nested call
    from checksums.grad_summary_triton import GradSummaryPlan

    def span(x: torch.Tensor) -> tuple[int, int]:
        return x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()

    def spec_words(x: torch.Tensor) -> list[int]:
        raw = x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[x.dtype]
        words = fingerprint_list_from_parts([fingerprint_bytes(raw, name, tuple(x.shape))])
        return [to_signed64(v) for v in words]

    def run(plan: GradSummaryPlan, x: torch.Tensor) -> list[int]:
        allowed[:] = [span(x), span(plan.items), span(plan.hdr), span(plan.fpart), span(plan.spart),
                      span(plan.counter)]
        return plan.run_async(x).tolist()

    def ref_stats(x: torch.Tensor) -> list[float]:
        d = x.double()
        return [float(d.norm()), float(d.abs().max()) if d.numel() else 0.0]

    gen = torch.Generator().manual_seed(19)
    report: dict = {"cases": {}}
    for dname, dt in DTYPES.items():
        for n in SIZES:
            for block, ips in ((64, 1), (1024, 8)):
                x = _aligned(n, dt, gen)
                plan = GradSummaryPlan(x, block=block, items_per_sm=ips, one_launch=False)
                stray.clear()
                row = run(plan, x)
                again = run(plan, x)
                torch_row = bucket_summary_torch([x]).tolist()
                via = bucket_summary([x], plan).tolist()       # the dispatch takes the fused plan
                one = GradSummaryPlan(x, block=block, items_per_sm=ips, one_launch=True)
                one_rows = [run(one, x) for _ in range(2)]      # the counter re-arms
                report["cases"][f"{dname}/{n}/{block}"] = {
                    "items": plan.n_items, "row": row, "again": again, "via": via, "torch_row": torch_row,
                    "one_launch": one_rows, "counter": int(one.counter),
                    "spec": spec_words(x), "ref": ref_stats(x), "stray": len(stray),
                    "stats": stats_of(torch.tensor(row)).tolist(),
                    "torch_stats": stats_of(torch.tensor(torch_row)).tolist(),
                }
    # non-finite values: in the body (a whole tile) and in the tail, each kind, each dtype
    nonfinite = {}
    for dname, dt in DTYPES.items():
        for where in ("body", "tail"):
            for bad in (math.nan, math.inf, -math.inf):
                x = _aligned(1029, dt, gen)
                x[5 if where == "body" else 1028] = bad
                plan = GradSummaryPlan(x, block=64, items_per_sm=1)
                stray.clear()
                row = run(plan, x)
                nonfinite[f"{dname}/{where}/{bad}"] = {
                    "stats": stats_of(torch.tensor(row)).tolist(),
                    "torch_stats": stats_of(bucket_summary_torch([x])).tolist(),
                    "fp_equal": row[2:] == spec_words(x), "stray": len(stray)}
    # fp32 overflow of a square: the torch path's norm is non-finite, so is the fused one
    x = _aligned(100, torch.float32, gen)
    x[7] = 1e30
    stray.clear()
    row = run(GradSummaryPlan(x, block=64), x)
    nonfinite["fp32/overflow"] = {"stats": stats_of(torch.tensor(row)).tolist(),
                                  "torch_stats": stats_of(bucket_summary_torch([x])).tolist(),
                                  "fp_equal": row[2:] == spec_words(x), "stray": len(stray)}
    report["nonfinite"] = nonfinite
    # one plan, another buffer of the same size (a bucket that moved): the plan holds no address
    a, b = _aligned(1000, torch.bfloat16, gen), _aligned(1000, torch.bfloat16, gen)
    plan = GradSummaryPlan(a, block=64, items_per_sm=1)
    stray.clear()
    report["moved"] = {"b_row_fp": run(plan, b)[2:], "b_spec": spec_words(b), "stray": len(stray)}
    # the in-place scaling (DDP's 1/world before the all-reduce): the buffer becomes torch's x.mul_(scale)
    # bit for bit, the row stays the unscaled buffer's; sizes with tails, subnormals, ties, each dtype
    scaled = {}
    for dname, dt in DTYPES.items():
        for n in (7, 9, 65, 1029):
            for scale in (1 / 3, 0.125, 1 / 7):
                x = _aligned(n, dt, gen)
                if dt == torch.float32 and n > 9:
                    x[3], x[4] = 1e-39, -3e-42                  # subnormals stay (no flush to zero)
                if n > 9:
                    x[6] = 0.0
                y = x.clone()
                plan = GradSummaryPlan(x, block=64, items_per_sm=1)
                want_row = run(plan, x)
                stray.clear()
                allowed[:] = [span(y), span(plan.items), span(plan.hdr), span(plan.fpart), span(plan.spart),
                              span(plan.counter)]
                got_row = plan.launch(y, scale=scale).tolist()
                ref = x.clone().mul_(scale)
                scaled[f"{dname}/{n}/{scale:.4f}"] = {
                    "equal": torch.equal(y.view(torch.uint8), ref.view(torch.uint8)), "row": got_row == want_row,
                    "x_kept": torch.equal(x, y) is False or scale == 1.0, "stray": len(stray)}
    report["scaled"] = scaled
    # fallbacks: a misaligned view, a dtype the kernel does not take
    big = _aligned(1001, torch.float32, gen)
    mis = big[1:]
    plan = GradSummaryPlan(big[:1000], block=64)
    fallback = {"misaligned_matches": plan.matches(mis),
                "misaligned_row": bucket_summary([mis], plan).tolist(),
                "misaligned_torch": bucket_summary_torch([mis]).tolist()}
    d64 = torch.randn(48, dtype=torch.float64, generator=gen)
    try:
        GradSummaryPlan(d64)
        fallback["fp64_refused"] = False
    except ValueError:
        fallback["fp64_refused"] = True
    fallback["fp64_row"] = bucket_summary([d64]).tolist()
    fallback["fp64_torch"] = bucket_summary_torch([d64]).tolist()
    report["fallback"] = fallback
    report["ddp"] = _ddp_hook_case()
    print("REPORT " + json.dumps(report))


def _ddp_hook_case() -> dict:
    """GradSummaries' DDP hook on gloo CPU (world 1) with the fused path admitted on the CPU (the kernel
    interpreted): each step's rows against the torch path's rows of the same gradients."""
    import tempfile

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checksums.grad_checks as gc

    gc._FUSED_DEVICES = ("cuda", "cpu")
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="h19fused-ddp-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 7)).to(dt)
                ddp = DDP(model, bucket_cap_mb=0.002)
                summaries = gc.GradSummaries(ddp)
                steps = []
                for step in range(3):
                    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(step)).to(dt)
                    ddp(x).float().square().mean().backward()
                    rows = summaries.rows()
                    gc.set_fused(False)
                    ref = summaries.bucket_grads([p.grad for p in summaries.params])
                    gc.set_fused(True)
                    steps.append({"fp_equal": torch.equal(rows[:, 2:], ref[:, 2:]),
                                  "stats": gc.stats_of(rows).tolist(), "ref": gc.stats_of(ref).tolist()})
                    summaries.clear()
                    model.zero_grad(set_to_none=False)
                out[name] = {"steps": steps, "paths": gc.summary_paths(summaries),
                             "buckets": len(summaries.layout)}
        finally:
            dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def report() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is not installed (scripts/setup.sh --test installs it)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__], check=False, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def _close(a: float, b: float, rel: float) -> bool:
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fingerprint_words_equal_the_spec(report: dict, dtype: str) -> None:
    for key, r in report["cases"].items():
        if key.startswith(dtype + "/"):
            assert r["row"][2:] == r["spec"], key
            assert r["torch_row"][2:] == r["spec"], key       # the torch path: the same words
            assert r["stray"] == 0, key                        # no read outside the buffer and the tables


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_norm_and_maxabs_match_torch_within_rounding(report: dict, dtype: str) -> None:
    for key, r in report["cases"].items():
        if key.startswith(dtype + "/"):
            (norm, amax), (tnorm, tamax), (rnorm, ramax) = r["stats"], r["torch_stats"], r["ref"]
            assert amax == ramax == tamax, key                 # max-abs is exact (every dtype fits fp32)
            assert _close(norm, rnorm, 1e-5), (key, norm, rnorm)   # fp32 squares, fp64 sum
            assert _close(norm, tnorm, 1e-5), (key, norm, tnorm)


def test_tails_and_multi_item_plans_are_covered(report: dict) -> None:
    keys = report["cases"]
    assert keys["bf16/4099/64"]["items"] > 1 and keys["fp32/1029/64"]["items"] > 1
    assert keys["bf16/7/64"]["items"] == 1 and keys["bf16/0/64"]["items"] == 0
    assert keys["bf16/0/64"]["stats"] == [0.0, 0.0]
    # the last element, in the tail, counts: the max-abs and norm include it (a tail-only buffer)
    r = keys["fp16/7/1024"]
    assert r["stats"][1] == r["ref"][1] and _close(r["stats"][0], r["ref"][0], 1e-5)


def test_rows_are_deterministic_and_the_dispatch_uses_the_plan(report: dict) -> None:
    for key, r in report["cases"].items():
        assert r["again"] == r["row"], key
        assert r["via"] == r["row"], key


def test_the_in_place_scaling_is_torchs_mul_bit_for_bit(report: dict) -> None:
    """The fused pass that also scales the bucket (GradSummaries at world size > 1) leaves exactly what
    `mul_` would, and summarises the values as they were."""
    assert len(report["scaled"]) == 36
    for key, r in report["scaled"].items():
        assert r["equal"] and r["row"] and r["x_kept"] and r["stray"] == 0, (key, r)


def test_the_one_launch_form_gives_the_same_row(report: dict) -> None:
    for key, r in report["cases"].items():
        assert r["one_launch"] == [r["row"], r["row"]], key
        assert r["counter"] == 0, key                          # re-armed for the next run


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_and_inf_make_the_statistics_nan(report: dict, dtype: str) -> None:
    cases = {k: v for k, v in report["nonfinite"].items() if k.startswith(dtype + "/")}
    assert len(cases) >= 6
    for key, r in cases.items():
        assert all(math.isnan(v) for v in r["stats"]), (key, r)
        assert all(math.isnan(v) for v in r["torch_stats"]), (key, r)   # the paths agree
        assert r["fp_equal"] and r["stray"] == 0, key


def test_an_fp32_square_overflow_is_non_finite_on_both_paths(report: dict) -> None:
    r = report["nonfinite"]["fp32/overflow"]
    assert all(math.isnan(v) for v in r["stats"]) and all(math.isnan(v) for v in r["torch_stats"])
    assert r["fp_equal"] and r["stray"] == 0


def test_a_plan_serves_a_moved_buffer(report: dict) -> None:
    r = report["moved"]
    assert r["b_row_fp"] == r["b_spec"] and r["stray"] == 0


def test_fallbacks_take_the_torch_path(report: dict) -> None:
    f = report["fallback"]
    assert f["misaligned_matches"] is False
    assert f["misaligned_row"] == f["misaligned_torch"]
    assert f["fp64_refused"] is True
    assert f["fp64_row"] == f["fp64_torch"]


def test_bucket_summary_on_cpu_keeps_the_torch_path() -> None:
    from checksums.grad_checks import bucket_summary, bucket_summary_torch, fusable, summary_plan

    x = torch.randn(1000).to(torch.bfloat16)
    assert not fusable(x) and summary_plan([x]) is None
    assert torch.equal(bucket_summary([x]), bucket_summary_torch([x]))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_ddp_hook_takes_the_fused_path_and_agrees_with_torch(report: dict, dtype: str) -> None:
    r = report["ddp"][dtype]
    assert r["buckets"] >= 1 and r["paths"] == {"fused": r["buckets"]}, r
    for s in r["steps"]:
        assert s["fp_equal"]
        for (n, a), (rn, ra) in zip(s["stats"], s["ref"]):
            assert a == ra and _close(n, rn, 1e-5), s


@pytest.mark.parametrize("one_launch,scale", [(False, False), (True, False), (True, True)])
def test_the_kernels_compile_for_the_h200(one_launch: bool, scale: bool) -> None:
    """No GPU here, but Triton compiles for one (sm_90, the H200) down to a cubin with its bundled ptxas: the
    kernels lower for every dtype (fp64 sqrt, fp16 bitcasts, the counter's atomics) and the word loads are
    128-bit; with the in-place scaling, so are the stores, the fp32 multiply keeps subnormals (no .ftz, as
    torch's mul_) and fp16 rounds to nearest even."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("run without TRITON_INTERPRET=1: this test compiles for the GPU")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from checksums.grad_summary_triton import (
        FINAL_TB,
        FINAL_WARPS,
        ONE_LAUNCH_TB,
        gs_finalize_kernel,
        gs_partials_kernel,
    )

    target = GPUTarget("cuda", 90, 32)
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}     # the anchor views and the offset
    for dt, el, es in ((0, "*fp32", 4), (1, "*bf16", 2), (2, "*fp16", 2)):
        sig = {"base_u8": "*u8", "base_i32": "*i32", "base_el": el, "off": "i64", "nbytes": "i64",
               "nvec4": "i64", "items": "*i64", "fpart": "*i64", "spart": "*fp32", "counter": "*i32",
               "n_items": "i32", "hdr": "*i64", "out": "*i64", "scale": "fp32", "BLOCK": "constexpr",
               "TAIL": "constexpr", "DT": "constexpr", "ES": "constexpr", "ONE_LAUNCH": "constexpr",
               "TB": "constexpr", "SCALE": "constexpr"}
        consts = {"BLOCK": 1024, "TAIL": 16, "DT": dt, "ES": es, "ONE_LAUNCH": one_launch,
                  "TB": ONE_LAUNCH_TB, "SCALE": scale}
        src = ASTSource(gs_partials_kernel, sig, constexprs=consts, attrs=aligned)
        k = triton.compile(src, target=target, options={"num_warps": 4})
        ptx = k.asm["ptx"]
        assert "ld.global.v4" in ptx and k.asm["cubin"], (dt, one_launch)
        if scale:
            assert "st.global.v4" in ptx, dt
            assert "mul.ftz" not in ptx and ".ftz.f32" not in ptx, dt
            if dt == 2:                     # (bf16 rounds in integer ops, as c10 does)
                assert "cvt.rn.f16.f32" in ptx, dt
        else:
            assert "st.global.v4" not in ptx, dt
    sig = {"fpart": "*i64", "spart": "*fp32", "n_items": "i32", "hdr": "*i64", "out": "*i64",
           "TB": "constexpr"}
    k = triton.compile(ASTSource(gs_finalize_kernel, sig, constexprs={"TB": FINAL_TB}), target=target,
                       options={"num_warps": FINAL_WARPS})
    assert "sqrt.rn.f64" in k.asm["ptx"] and k.asm["cubin"]


def test_scalars_that_may_be_one_are_not_specialised() -> None:
    """Triton turns an int argument equal to 1 into a constant (no `.to`): on the H200 a 7-element fp32
    bucket (nvec4 == 1) failed to compile. The interpreter does not specialise, so this is checked here."""
    from checksums.grad_summary_triton import gs_finalize_kernel, gs_partials_kernel

    assert {p.name for p in gs_partials_kernel.params if p.do_not_specialize} >= {"off", "nbytes", "nvec4",
                                                                                "n_items"}
    assert {p.name for p in gs_finalize_kernel.params if p.do_not_specialize} >= {"n_items"}


def test_a_fused_plan_that_fails_falls_back_to_torch_once(monkeypatch, caplog) -> None:
    import checksums.grad_checks as gc

    class Broken:
        summarises = True
        calls = 0

        def matches(self, t: torch.Tensor) -> bool:
            return True

        def launch(self, t: torch.Tensor, out: torch.Tensor | None = None,
                   scale: float = 1.0) -> torch.Tensor:  # the checked path (GradSummaryPlan's signature)
            Broken.calls += 1
            raise RuntimeError("no compiler for this GPU")

        run_async = launch

    monkeypatch.setattr(gc, "_FUSED", True)
    monkeypatch.setattr(gc, "_BROKEN", False)
    x = torch.randn(100)
    with caplog.at_level("WARNING", logger="checksums.grad_checks"):
        assert torch.equal(gc.bucket_summary([x], Broken()), gc.bucket_summary_torch([x]))
        assert torch.equal(gc.bucket_summary([x], Broken()), gc.bucket_summary_torch([x]))
    assert Broken.calls == 1 and gc._BROKEN is True
    assert "fused gradient summary failed" in caplog.text


def _sweep(tmp_path: Path, *args: str) -> tuple[str, dict]:
    """`python -m bench.bench_grad_summary --device cpu --sweep ARGS` (the interpreter: its module sets
    TRITON_INTERPRET from its argv), run as __main__ by tests/interpreter_support.py (the interpreter's
    set-up once a launch): stdout and the JSON it wrote."""
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "interpreter_support.py"), "-m",
                           "bench.bench_grad_summary", "--device", "cpu", "--sweep", "--json", str(out), *args],
                          check=False, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=scaled(240))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def test_the_launch_config_sweep_runs_on_cpu(tmp_path: Path) -> None:
    """bench_grad_summary --sweep end to end, interpreted (the H200 runs it to set the plan's defaults): every
    grid combination measured with the default's row, the GPT-2 step over DDP's 13 buckets for the default
    and the best three, and the table with the settings that select the fastest printed last."""
    stdout, res = _sweep(tmp_path)
    assert res["skipped"] == 0 and res["combinations"] == len(res["grid"]) == 2 * 4, res["grid"]
    assert [r["status"] for r in res["grid"] + res["scaled"]] == ["ok"] * (8 + len(res["scaled"]))
    for dtype in ("fp32", "bf16"):
        rows = [r["row"] for r in res["grid"] + res["scaled"] if r["dtype"] == dtype]
        assert len(rows) >= 5 and all(r[1:] == rows[0][1:] for r in rows), rows   # fingerprint, max-abs
        assert all(r["s"] > 0 for r in res["grid"] if r["dtype"] == dtype)
    step = res["gpt2_step"]
    assert len(step["bucket_numels"]) == 13 and len(step["configs"]) == 4
    assert all(r["status"] == "ok" and r["s"] > 0 and r["scaled_s"] > 0 for r in step["configs"]), step
    tail = stdout.splitlines()[-20:]
    assert any(x.startswith("best per case") for x in tail) and any(x.startswith("fp32 0.02 MB") for x in tail)
    assert "8 grid combinations" in stdout and "0 MISMATCH" in stdout, stdout[-3000:]
    assert tail[-1].startswith("set: SDCWATCH_GS_BLOCK=") and "SDCWATCH_GS_WARPS=4" in tail[-1], tail


def test_the_sweep_stops_at_its_budget(tmp_path: Path) -> None:
    stdout, res = _sweep(tmp_path, "--sweep-budget", "0", "--dtypes", "fp32")
    # the default measured (the reference); the grid's 4 and the scaled default skipped and counted
    assert res["grid"] == [] and res["skipped"] == 5 and res["cases"][0]["default_s"], res
    assert [r["status"] for r in res["gpt2_step"]["configs"]] == ["ok"]
    assert "5 skipped past the 0 s budget" in stdout
    assert stdout.splitlines()[-1] == "set: nothing measured in every case (see the lines above)"


def test_the_sweeps_gpt2_step_is_ddps_cut() -> None:
    """The sweep's GPT-2 buckets: the project's GPT-2 small in gradient-ready order cut as torch's DDP cuts it
    (1 MiB, then 25 MiB): 13 buckets, the 154 MB tied embedding in the last."""
    import torch.distributed as dist

    from bench.bench_grad_summary import GPT2_PARAMS
    from bench.grad_summary_sweep import ddp_bucket_numels, gpt2_bucket_numels
    from bench.tiny_gpt import GPTConfig, TinyGPT

    numels = gpt2_bucket_numels()
    assert len(numels) == 13 and sum(numels) == GPT2_PARAMS and numels[-1] > 50257 * 768, numels
    assert ddp_bucket_numels([3, 300_000, 5, 7], 4, (1 << 20, 2 << 20)) == [300_003, 12]
    with torch.device("meta"):
        params = [p for p in TinyGPT(GPTConfig()).parameters() if p.requires_grad][::-1]
    if not dist.is_available():
        pytest.skip("torch without torch.distributed: its bucket assignment cannot be compared")
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [1 << 20, 25 << 20], [False] * len(params))
    assert numels == [sum(params[i].numel() for i in b) for b in buckets]


def test_the_sweep_reports_a_row_that_differs() -> None:
    from bench.grad_summary_sweep import row_difference

    def row(norm: float, amax: float, f0: int, f1: int) -> torch.Tensor:
        return torch.cat([torch.tensor([norm, amax], dtype=torch.float64).view(torch.int64),
                          torch.tensor([f0, f1], dtype=torch.int64)])

    ref = row(3.0, 0.5, -7, 11)
    assert row_difference(row(3.0 * (1 + 1e-7), 0.5, -7, 11), ref) == ""    # another order of the squares
    assert "fingerprint words" in row_difference(row(3.0, 0.5, -7, 12), ref)
    assert "max-abs" in row_difference(row(3.0, 0.5000001, -7, 11), ref)
    assert "norm" in row_difference(row(3.001, 0.5, -7, 11), ref)
    assert "norm" in row_difference(row(float("nan"), 0.5, -7, 11), ref)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _child()


def test_a_refused_bound_launch_leaves_the_plans_direct_launch_on() -> None:
    """`BoundLaunch` (the DDP hook's launch once a bucket settled) passes its integer arguments and the stream
    to the direct launch's runner; a runner that refuses them (say a Triton without `stream=`) turns the
    bound launch off, not the plan's direct launch; a direct launch turned off turns the bound one off."""
    from checksums.grad_summary_triton import BoundLaunch, _DirectLaunch

    calls: list[tuple] = []

    def runner(*args: object, stream: int | None = None) -> None:
        calls.append((args, stream))

    d = _DirectLaunch(runner)
    b = BoundLaunch(d, (1, 2, 3))
    assert b(77) and calls == [((1, 2, 3), 77)]

    def refusing(*args: object, **kw: object) -> None:
        raise TypeError("runner() got an unexpected keyword argument 'stream'")

    d2 = _DirectLaunch(refusing)
    b2 = BoundLaunch(d2, (1,))
    assert b2(5) is False and not b2.ok and d2.ok          # the bound one off; the direct launch stays on
    assert b2(5) is False                                   # and stays off
    d.ok = False
    assert b(77) is False and len(calls) == 1               # the direct launch off: the bound one launches nothing
