"""The agent's canary through real child processes (probes.canary_process -> probes.canary_child): snapshots, a
tiny round on the CPU, a child that errs, hangs or crashes, and the JSON that crosses the pipe. One GPU test at the end."""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

import pytest

from probes import canary_suite as cs
from probes.canary_agent import AgentCanaryProbe
from probes.canary_child import TEST_HOOK_ENV, nvml_snapshots
from probes.canary_faults import FaultyDevice, FaultyMatmul, SimCopier, cpu_all_reduce, simulated_devices
from probes.canary_process import child_snapshots
from probes.canary_schedule import GpuSnapshot
from sdcwatch import canary as sc
from sdcwatch.canary import Status
from sdcwatch.types import Severity, State
from sdcwatch import event_kinds as ek
from deadlines import scaled

IDLE_CPU = [GpuSnapshot("cpu", 0, 0.0, 8 << 30)]


def _statuses(rep: sc.SuiteReport) -> dict[str, Status]:
    return {r.name: r.status for r in rep.results}


def _processes_with(marker: str) -> list[int]:
    """Live processes other than this one whose environment holds `marker` (a zombie's reads empty)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if marker.encode() in (p / "environ").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def test_snapshots_child_matches_nvml_in_process() -> None:
    assert [s.uuid for s in child_snapshots(30.0)] == [s.uuid for s in nvml_snapshots()]  # [] without NVML


def test_a_fake_scenario_gpus_are_listed_but_never_picked() -> None:
    """With a fake NVML scenario the agent's canary scheduler runs its rounds, and never picks a GPU that the
    scenario only pretends to have (their utilization is unknown): no suite, no finding."""
    scenario = str(Path(__file__).parent / "scenarios" / "clean.json")
    snaps = child_snapshots(30.0, scenario)
    assert [s.uuid for s in snaps] == [f"GPU-5dc0a7e1-0000-4000-8000-00000000000{i}" for i in (0, 1)]
    assert all(s.utilization_pct is None for s in snaps)
    rep = AgentCanaryProbe(level="tiny", nvml_scenario=scenario, timeout_s=120.0).run_once(0.0)
    assert rep.suite is None and rep.findings == [] and len(rep.decisions) == 2
    assert all(not d.run and "utilization unknown" in d.why for d in rep.decisions)


def test_tiny_round_in_a_child_matches_the_suite_in_process(tmp_path: Path) -> None:
    probe = AgentCanaryProbe(level="tiny", evidence_dir=tmp_path, snapshots=lambda: IDLE_CPU, timeout_s=120.0)
    rep = probe.run_once(0.0)
    assert rep.suite is not None and rep.findings == []
    local = cs.run_suite(cs.discover_devices()[0], sc.SuiteConfig(level="tiny", copies=True))
    assert rep.suite.status is Status.PASS and _statuses(rep.suite) == _statuses(local)
    assert rep.suite.device_status("cpu") == local.device_status("cpu")
    assert sc.evidence_by_device(rep.suite, 5.0, {}) == sc.evidence_by_device(local, 5.0, {})
    assert rep.evidence["cpu"][0].implies is State.HEALTHY and probe.last_run == {"cpu": 0.0}


def test_a_gpu_the_child_cannot_see_is_unknown() -> None:
    probe = AgentCanaryProbe(level="tiny", snapshots=lambda: [GpuSnapshot("GPU-absent", 0, 0.0, 8 << 30)],
                             timeout_s=120.0)
    [f] = probe.run_once(0.0).findings
    assert (f.kind, f.severity) == (ek.CANARY_UNKNOWN, Severity.WARNING)
    assert "not visible to torch" in f.message and f.details["chosen"] == ["GPU-absent"]


def test_a_hung_child_is_killed_with_its_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    marker = f"SDCWATCH_TEST_MARKER={uuid.uuid4().hex}"
    monkeypatch.setenv(TEST_HOOK_ENV, "hang")      # the child starts a grandchild, then sleeps
    monkeypatch.setenv(*marker.split("="))
    probe = AgentCanaryProbe(level="tiny", snapshots=lambda: IDLE_CPU, timeout_s=4.0)   # the suite's child: 3 s
    t0 = time.monotonic()
    rep = probe.run_once(0.0)
    assert time.monotonic() - t0 < 10
    [f] = rep.findings
    assert (f.kind, f.severity) == (ek.CANARY_UNKNOWN, Severity.WARNING) and "did not finish within 3s" in f.message
    assert rep.suite is None and probe.last_run == {"cpu": 0.0}
    deadline = time.monotonic() + scaled(5)
    while _processes_with(marker) and time.monotonic() < deadline:  # SIGKILL lands asynchronously
        time.sleep(0.05)
    assert _processes_with(marker) == []


def test_a_crashed_child_is_unknown_with_its_signal(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(TEST_HOOK_ENV, "abort")
    probe = AgentCanaryProbe(level="tiny", snapshots=lambda: IDLE_CPU, timeout_s=60.0)
    with caplog.at_level(logging.WARNING, logger="probes.canary_process"):
        rep = probe.run_once(0.0)
    [f] = rep.findings
    assert (f.kind, f.severity) == (ek.CANARY_UNKNOWN, Severity.WARNING) and "killed by SIGABRT" in f.message
    assert rep.suite is None and rep.evidence == {} and probe.consecutive_failures == {}
    assert "SIGABRT" in caplog.text
    [f] = AgentCanaryProbe(level="tiny", timeout_s=60.0).run_once(0.0).findings   # the snapshot's child too
    assert f.kind is ek.CANARY_UNKNOWN and f.message.startswith("no GPU snapshot") and "SIGABRT" in f.message


def test_json_round_trip_keeps_a_failing_check(tmp_path: Path) -> None:
    fault = FaultyDevice("sim-1", FaultyMatmul("output", (3, 5), 7))
    rep = cs.run_suite(simulated_devices(3), sc.SuiteConfig(level="tiny", evidence_dir=tmp_path), matmul_for=fault,
                       copier=SimCopier(), allreduce=cpu_all_reduce)
    back = sc.SuiteReport.from_json(json.loads(json.dumps(rep.to_json(), default=str)))
    fails = [r for r in back.results if r.status is Status.FAIL]
    assert fails and all(Path(r.evidence_path).is_file() for r in fails if r.check in sc.SDC_CHECKS)
    assert back == rep
    assert back.device_status("sim-1") == rep.device_status("sim-1") and back.status is Status.FAIL
    assert sc.evidence_by_device(back, 1.0, {"sim-1": 1}) == sc.evidence_by_device(rep, 1.0, {"sim-1": 1})


@pytest.mark.gpu
def test_quick_round_on_a_gpu_leaves_cuda_out_of_the_agent(tmp_path: Path) -> None:
    import torch

    cuda_before = torch.cuda.is_initialized()      # False unless another test of this session used CUDA
    snaps = child_snapshots(30.0)
    assert snaps and all(s.memory_total_bytes for s in snaps)
    idle = [GpuSnapshot(snaps[0].uuid, snaps[0].index, 0.0, snaps[0].memory_total_bytes)]   # idle or not
    rep = AgentCanaryProbe(level="quick", evidence_dir=tmp_path, snapshots=lambda: idle).run_once(0.0)
    assert rep.suite is not None and [d.label for d in rep.suite.devices] == [snaps[0].uuid]
    assert rep.suite.status is Status.PASS, [(r.name, r.why) for r in rep.suite.results
                                                   if r.status is not Status.PASS]
    assert rep.evidence[snaps[0].uuid][0].implies is State.HEALTHY
    assert torch.cuda.is_initialized() == cuda_before


@pytest.mark.parametrize("when", ["mid_round", "while_it_starts"])
def test_the_child_dies_with_an_agent_killed_mid_round(tmp_path: Path, when: str) -> None:
    """The child runs in its own session (so its group can be killed), yet must not outlive a parent that is
    SIGKILLed mid-round: PR_SET_PDEATHSIG. Killed while the child is still starting (before it armed the
    signal), the child must find out from the starter's pid it was given. (The test hook's grandchild is this
    test's own to clean up.)"""
    import signal
    import subprocess
    import sys

    marker = f"SDCWATCH_TEST_MARKER={uuid.uuid4().hex}"
    env = dict(os.environ, **{TEST_HOOK_ENV: "hang"}, **dict([marker.split("=")]))
    root = Path(__file__).resolve().parent.parent
    agent = subprocess.Popen([sys.executable, "-c", "from probes.canary_process import call_child; "
                              "call_child({'op': 'snapshots'}, 120)"], cwd=root, env=env)
    try:
        deadline = time.monotonic() + scaled(30)
        child = None
        while child is None and time.monotonic() < deadline:
            for pid in _processes_with(marker):
                try:
                    if f"PPid:\t{agent.pid}\n" in Path(f"/proc/{pid}/status").read_text():
                        child = pid
                except OSError:
                    pass
            time.sleep(0.05)
        assert child is not None, "the canary child did not start"
        if when == "mid_round":
            time.sleep(0.5)  # past its start-up, into the hook's sleep
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + scaled(5)
        while Path(f"/proc/{child}").exists() and "State:\tZ" not in _status(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{child}").exists() or "State:\tZ" in _status(child), "the child outlived its parent"
    finally:
        for pid in _processes_with(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
