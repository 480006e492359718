"""Canaries on a real GPU: every dtype exact, injected faults on real tensor cores, preflight, durations."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checksums import canary_gemm as cg
from sdcwatch import canary as sc
from sdcwatch.canary import DeviceInfo, Status
from probes import canary_suite as cs
from probes.canary_faults import FaultyDevice, FaultyMatmul

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


def _dev() -> DeviceInfo:
    return cs.discover_devices([0])[0][0]


def test_every_supported_dtype_and_shape_is_exact() -> None:
    dev = _dev()
    ok, why = cg.supported_dtypes(torch.device(dev.device))
    assert {"fp32", "tf32", "fp16", "bf16"} <= set(ok), why
    results = [cg.run_known_answer(s, dev, repeats=1) for s in cg.known_answer_specs("full", ok, "cuda")]
    bad = [(r.name, r.status.value, r.why) for r in results if r.status is not Status.PASS]
    for r in results:
        print(f"{r.status.value:7} {r.name:45} {r.duration_s * 1e3:8.1f} ms  {r.tflops or 0:7.1f} TFLOP/s")
    assert bad == []


@pytest.mark.parametrize("where,index", [("output", (1234, 777)), ("input_a", (99, 5)), ("input_b", (5, 3000))])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp8_e4m3"])
def test_injected_faults_on_real_tensor_cores(where: str, index: tuple[int, int], dtype: str) -> None:
    dev = _dev()
    if dtype not in cg.supported_dtypes(torch.device(dev.device))[0]:
        pytest.skip(f"{dtype} not supported here")
    spec = cg.KnownAnswerSpec(dtype, 2048, 4096, 1024, shape_name="fault")
    r = cg.run_known_answer(spec, dev, matmul=FaultyMatmul(where, index, 6))
    assert r.status is Status.FAIL, r.why
    mm = r.details["mismatch"]
    if where == "output":
        assert mm["pattern"] == "element" and mm["tiles"] == [[1234 // 128, 777 // 128]]
    elif where == "input_a":
        assert mm["rows"] == [99]
    else:
        assert mm["cols"] == [3000]


def test_cross_gpu_vote_with_one_faulty_gpu_on_real_gpus() -> None:
    devs, _ = cs.discover_devices()
    if len(devs) < 3:
        devs = [DeviceInfo(f"{devs[0].label}#{i}", devs[0].device, 0, devs[0].uuid, devs[0].name) for i in range(3)]
    from probes import canary_random as cr

    spec = cr.RandomSpec("bf16", 1024, 1024, 2048, seed=3)
    res = cr.run_random(spec, devs[:3], matmul_for=FaultyDevice(devs[1].label, FaultyMatmul("output", (7, 8), 0)))
    assert [r.status for r in res] == [Status.PASS, Status.FAIL, Status.PASS]


def test_quick_suite_passes_and_durations(tmp_path: Path) -> None:
    devs, _ = cs.discover_devices()
    t0 = time.perf_counter()
    rep = cs.run_suite(devs, sc.SuiteConfig(level="quick", evidence_dir=tmp_path))
    wall = time.perf_counter() - t0
    print(f"quick suite: {wall:.1f}s on {len(devs)} GPU(s), {wall / len(devs):.1f}s per GPU")
    assert rep.status is Status.PASS, [(r.name, r.why) for r in rep.results if r.status is not Status.PASS]


def test_preflight_exit_code() -> None:
    proc = subprocess.run([sys.executable, "-c", "import sys; from daemon import cli; "
                           "sys.exit(cli.main(['canary', '--level', 'quick', '--json']))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["status"] == "PASS" and not data["on_cpu"]


def test_injob_canary_on_the_training_stream_does_not_sync() -> None:
    from checksums.canary_budget import InJobBudget
    from checksums.canary_injob import InJobCanary

    c = InJobCanary(torch.device("cuda", 0), budget=InJobBudget(warmup_steps=0, min_steps_between=1,
                                                                  budget_fraction=0.5))
    got = []
    for s in range(50):
        r = c.maybe_run(s, 0.1)
        if r is not None:
            got.append(r)
    torch.cuda.synchronize()
    got += [r for r in [c.poll()] if r is not None]
    assert got and all(r.status is Status.PASS for r in got), [(r.name, r.why) for r in got]
