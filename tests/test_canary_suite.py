"""Suite, evidence files and replay, agent evidence, schedule and budget, in-job canary, the CLI (CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from checksums.canary_budget import InJobBudget, budget_allows
from checksums.canary_injob import InJobCanary
from daemon import cli_canary
from probes import canary_suite as cs
from probes.canary_agent import AgentCanaryProbe
from probes.canary_faults import FaultyDevice, FaultyMatmul, SimCopier, cpu_all_reduce, simulated_devices
from probes.canary_schedule import AgentCanaryPolicy, GpuSnapshot
from probes.gpu_state import GpuEvidenceStore
from sdcwatch import __version__ as sdcwatch_version
from sdcwatch import canary as sc
from sdcwatch.canary import CheckResult, DeviceInfo, Status
from sdcwatch.types import State
from sdcwatch import event_kinds as ek

CPU = DeviceInfo("cpu", "cpu", uuid="cpu")
TINY = sc.SuiteConfig(level="tiny")


def _faulty_suite(tmp_path: Path) -> sc.SuiteReport:
    devs = simulated_devices(3)
    cfg = sc.SuiteConfig(level="tiny", evidence_dir=tmp_path)
    fault = FaultyDevice("sim-1", FaultyMatmul("output", (3, 5), 7))
    return cs.run_suite(devs, cfg, matmul_for=fault, copier=SimCopier(), allreduce=cpu_all_reduce)


def test_clean_suite_on_simulated_devices_passes() -> None:
    rep = cs.run_suite(simulated_devices(3), TINY, copier=SimCopier(), allreduce=cpu_all_reduce)
    assert rep.status is Status.PASS, [(r.name, r.why) for r in rep.results if r.status is not Status.PASS]
    checks = {r.check for r in rep.results}
    assert checks >= {"gemm", "random", "determinism", "h2d", "p2p", "allreduce"}
    assert sc.exit_code(rep) == 0 and rep.on_cpu
    json.dumps(rep.to_json())


def test_faulty_device_fails_with_evidence_and_replay(tmp_path: Path) -> None:
    rep = _faulty_suite(tmp_path)
    assert rep.status is Status.FAIL and sc.exit_code(rep) == 1
    assert rep.device_status("sim-0")[0] is Status.PASS
    st, bad = rep.device_status("sim-1")
    assert st is Status.FAIL and all(r.evidence_path for r in bad)
    gemm = next(r for r in bad if r.check == "gemm")
    rec = cs.load_evidence(gemm.evidence_path)
    for key in ("versions", "devices", "details", "time"):
        assert key in rec
    assert rec["versions"]["sdcwatch"] == sdcwatch_version  # evidence names the release that found it
    assert rec["details"]["mismatch"]["rows"] == [3]
    assert rec["details"]["expected_fingerprint"] != rec["details"]["actual_fingerprint"]
    assert rec["details"]["spec"]["seed"] is not None
    clean = cs.replay(gemm.evidence_path, CPU)
    assert not clean.reproduces and "does not reproduce" in clean.summary()
    again = cs.replay(gemm.evidence_path, CPU, matmul=FaultyMatmul("output", (3, 5), 7))
    assert again.reproduces and again.same_output
    rnd = next(r for r in bad if r.check == "random")
    assert cs.replay(rnd.evidence_path, CPU).reproduces is False
    assert cs.replay(rnd.evidence_path, CPU, matmul=FaultyMatmul("output", (3, 5), 7)).reproduces


def test_evidence_file_is_json_not_pickle_and_bad_files_are_refused(tmp_path: Path) -> None:
    rep = _faulty_suite(tmp_path)
    files = sorted(tmp_path.glob("*.json"))
    assert files and not list(tmp_path.glob("*.tmp"))
    for f in files:
        json.loads(f.read_text())
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not an sdcwatch canary evidence"):
        cs.load_evidence(bad)
    assert rep.results


def test_evidence_for_the_agent_suspect_then_failed(tmp_path: Path) -> None:
    rep = _faulty_suite(tmp_path)
    ev = sc.evidence_by_device(rep, 100.0)
    assert [e.signal for e in ev["sim-0"]] == ["pass"] and ev["sim-0"][0].implies is State.HEALTHY
    assert ev["sim-1"][0].signal == "fail" and ev["sim-1"][0].implies is State.SUSPECT
    again = sc.evidence_by_device(rep, 200.0, {"sim-1": 1})
    assert again["sim-1"][0].implies is State.FAILED
    store = GpuEvidenceStore()
    store.put(ev["sim-1"][0])
    assert store.derive(150.0)[0] is State.SUSPECT


def test_slow_device_detection() -> None:
    assert cs.slow_devices({"a": 700.0, "b": 690.0, "c": 230.0}, 0.7) == {"c": pytest.approx(230 / 695)}
    assert cs.slow_devices({"a": 700.0}, 0.7) == {}
    results = [CheckResult("gemm", "gemm/bf16/large", Status.PASS, (x,), tflops=t)
               for x, t in (("a", 700.0), ("b", 690.0), ("c", 230.0))]
    slow = cs.slow_checks(results, 0.7)
    assert [r.devices for r in slow] == [("c",)] and slow[0].status is Status.FAIL


def test_agent_policy_idle_memory_interval_and_one_at_a_time() -> None:
    pol = AgentCanaryPolicy(interval_s=100, idle_util_pct=5, memory_cap_bytes=1 << 30, headroom_bytes=0,
                            max_gpus_per_round=1)
    gpus = [GpuSnapshot("a", 0, 0.0, 8 << 30), GpuSnapshot("b", 1, 90.0, 8 << 30),
            GpuSnapshot("c", 2, 1.0, 100 << 20), GpuSnapshot("d", 3, None, 8 << 30),
            GpuSnapshot("e", 4, 0.0, 8 << 30)]
    d = {x.uuid: x for x in pol.choose(gpus, now=1000, need_bytes=512 << 20, last_run={"e": 950}, running=())}
    assert d["a"].run and not d["b"].run and "busy" in d["b"].why
    assert not d["c"].run and "free" in d["c"].why and not d["d"].run and "unknown" in d["d"].why
    assert not d["e"].run and "ago" in d["e"].why
    d = {x.uuid: x for x in pol.choose(gpus, now=1000, need_bytes=512 << 20, last_run={}, running=("a",))}
    assert not d["a"].run and "already running" in d["a"].why and d["e"].run
    d = {x.uuid: x for x in pol.choose(gpus, now=1000, need_bytes=2 << 30, last_run={})}
    assert not any(x.run for x in d.values()) and "memory cap" in d["a"].why
    with pytest.raises(ValueError):
        AgentCanaryPolicy(interval_s=0)


def test_budget_policy() -> None:
    b = InJobBudget(budget_fraction=0.01, min_steps_between=5, warmup_steps=2)
    kw = dict(train_time_s=10.0, canary_time_s=0.0, est_cost_s=0.05)
    assert budget_allows(b, step=1, last_run_step=None, **kw)[0] is False
    assert budget_allows(b, step=2, last_run_step=None, **kw) == (True, "within budget")
    assert budget_allows(b, step=4, last_run_step=2, **kw)[0] is False
    assert budget_allows(b, step=9, last_run_step=2, train_time_s=10.0, canary_time_s=0.06, est_cost_s=0.05)[0] is False
    with pytest.raises(ValueError):
        InJobBudget(budget_fraction=0)


def test_injob_canary_on_cpu_stays_within_budget_and_catches_a_fault() -> None:
    c = InJobCanary("cpu", shape=(64, 64, 128), budget=InJobBudget(budget_fraction=0.01, warmup_steps=3))
    results = [r for s in range(200) if (r := c.maybe_run(s, 0.2)) is not None]
    assert results and all(r.status is Status.PASS for r in results)
    assert c.overhead_fraction <= 0.01 + 1e-9
    bad = InJobCanary("cpu", shape=(64, 64, 128), matmul=FaultyMatmul("output", (2, 9), 3),
                      budget=InJobBudget(warmup_steps=0, min_steps_between=1))
    res = [r for s in range(5) if (r := bad.maybe_run(s, 10.0)) is not None]
    assert res and res[0].status is Status.FAIL and res[0].details["mismatch"]["rows"] == [2]


def test_agent_probe_runs_idle_gpu_and_returns_evidence(tmp_path: Path) -> None:
    fault = FaultyDevice("cpu", FaultyMatmul("output", (1, 1), 9))
    probe = AgentCanaryProbe(level="tiny", evidence_dir=tmp_path, snapshots=lambda: [GpuSnapshot("cpu", 0, 0.0, 8 << 30)],
                             devices=lambda: [CPU], run_suite=lambda d, cfg: cs.run_suite(d, cfg, matmul_for=fault))
    r1 = probe.run_once(0.0)
    assert r1.evidence["cpu"][0].implies is State.SUSPECT and r1.findings[0].kind is ek.CANARY_FAIL
    assert probe.run_once(10.0).suite is None            # not due yet
    r2 = probe.run_once(7200.0)
    assert r2.evidence["cpu"][0].implies is State.FAILED   # a repeat


# ---------------------------------------------------------------- CLI


def _cli(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="sdcwatch")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_canary.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_exit_codes_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CUDA absent here, on a GPU host too
    assert _cli(["canary", "--level", "tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "ran on the CPU" in out and "PASS" in out
    assert _cli(["canary", "--level", "tiny", "--json", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["on_cpu"] and data["exit_code"] == 0
    assert _cli(["canary", "--dtypes", "int3"]) == 2
    missing = tmp_path / "nope.json"
    assert _cli(["canary", "--replay", str(missing)]) == 2
    rep = _faulty_suite(tmp_path)
    path = next(r.evidence_path for r in rep.results if r.evidence_path and r.check == "gemm")
    assert _cli(["canary", "--replay", path]) == 0          # clean CPU: does not reproduce
    assert "does not reproduce" in capsys.readouterr().out


def test_cli_module_registers_with_the_main_cli() -> None:
    from daemon import cli

    args = cli.build_parser().parse_args(["canary", "--level", "tiny", "--json"])
    assert args.func is cli_canary.cmd_canary
