"""End to end: the real agent -> real Prometheus scraping it with sdcwatch's rules loaded -> the right alerts
fire with the right labels and resolve; for the loss detector's alerts, on to a real Alertmanager, which must
hold each alert twice: from Prometheus' rule and from the agent's own push.

- A fake NVML scenario: XID 79 on one GPU, then a GPU reset.
- ReportStep calls that make a gradient-norm spike, a loss-scale collapse and a NaN gradient norm: each
  raises its own alert (SDCWatchGradNormSpike, SDCWatchLossScaleCollapse, SDCWatchGradNormNonFinite), not
  the loss-spike alert or the catch-all.

The rules are loaded from a copy with short durations (`shorten_rules`): every range and offset becomes
WINDOW and every `for:` becomes HOLD, so "fires for 30 minutes after the newest XID" plays out in
seconds. Nothing else in the rules changes. Prometheus is Debian's `prometheus`, started on a free port
with a temp TSDB; the test skips with the reason when it is not installed.
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest

from agent_harness import AgentProcess, remove_test_dir
from alerting_support import HOLD, WINDOW, Alertmanager, Prometheus, alertmanager_binary, shorten_rules
from deploy_support import RULES
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
from deadlines import scaled

pytestmark = pytest.mark.slow

XID_AT = 4.0        # scenario seconds (from the agent's start)
RESET_AT = 20.0
GPU0 = {"uuid": "GPU-e2e00000-0000-4000-8000-000000000000", "pci_bus_id": "00000000:19:00.0"}
GPU1 = {"uuid": "GPU-e2e00000-0000-4000-8000-000000000001", "pci_bus_id": "00000000:39:00.0"}


def test_shorten_rules() -> None:
    short = shorten_rules(RULES.read_text())
    assert "[30m]" not in short and "offset 30m" not in short and "for: 10m" not in short
    assert f"[{WINDOW}]" in short and f"offset {WINDOW}" in short and f"for: {HOLD}" in short
    assert short.count("alert:") == RULES.read_text().count("alert:")


def _scenario(path: Path) -> Path:
    path.write_text(json.dumps({
        "description": "e2e: GPU 1 falls off the bus (XID 79), is reset later; GPU 0 stays healthy",
        "gpus": [dict(GPU0, name="NVIDIA H200", serial="1"), dict(GPU1, name="NVIDIA H200", serial="2")],
        # two corrected ECC errors (below the storm threshold) make the reset visible: it zeroes them
        "timeline": [{"at": 1, "gpu": 1, "add": {"ecc.corrected.volatile.dram": 2}},
                     {"at": XID_AT, "gpu": 1, "xid": 79}, {"at": XID_AT, "gpu": 1, "lost": True},
                     {"at": RESET_AT, "gpu": 1, "reset": True}],
    }))
    return path


@pytest.fixture()
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        pytest.fail("prometheus not installed (Debian package 'prometheus'): bash scripts/setup.sh --test")
    return found


@pytest.fixture()
def agent_with_scenario(short_tmp: Path) -> Iterator[AgentProcess]:
    scenario = _scenario(short_tmp / "scenario.json")
    agent = AgentProcess(short_tmp / "state", "--nvml-scenario", str(scenario),
                         "--nvml-poll-interval-s", "0.5")
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()


def _wait(what: str, pred: Callable[[], Any], timeout: float, prom: Prometheus, agent: AgentProcess) -> Any:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.25)
    alerts = json.dumps(prom.alerts(), indent=1)[:4000]
    raise AssertionError(f"{what} not seen in {timeout}s\nalerts: {alerts}\nagent log:\n"
                         f"{agent.log()[-2000:]}")


def _firing(prom: Prometheus, name: str) -> list[dict[str, Any]]:
    return [a for a in prom.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_xid79_fires_the_right_alerts_and_they_resolve(
        prometheus_binary: str, agent_with_scenario: AgentProcess, short_tmp: Path) -> None:
    agent = agent_with_scenario
    target = agent.runtime_info()["metrics"]
    rules = short_tmp / "rules-short.yml"
    rules.write_text(shorten_rules(RULES.read_text()))
    prom = Prometheus(short_tmp, target, rules)
    try:
        # 1. XID 79 on GPU 1: the reboot-class XID alert fires with the GPU's labels ...
        xid = _wait("SDCWatchGPUXidReboot firing", lambda: _firing(prom, "SDCWatchGPUXidReboot"), 40, prom,
                    agent)
        assert len(xid) == 1
        assert xid[0]["labels"] == {"alertname": "SDCWatchGPUXidReboot", "severity": "critical",
                                    "action": "REBOOT", "instance": target, "uuid": GPU1["uuid"],
                                    "pci_bus_id": GPU1["pci_bus_id"], "model": "NVIDIA H200", "xid": "79"}
        assert xid[0]["annotations"]["runbook_url"].endswith("/docs/runbooks/SDCWatchGPUXidReboot.md")
        assert GPU1["pci_bus_id"] in xid[0]["annotations"]["summary"]
        # ... and so does the GPU state alert (FAILED), for GPU 1 only
        failed = _wait("SDCWatchGPUFailed firing", lambda: _firing(prom, "SDCWatchGPUFailed"), 20, prom,
                       agent)
        assert [a["labels"]["uuid"] for a in failed] == [GPU1["uuid"]]
        assert failed[0]["labels"]["severity"] == "critical"
        # 2. The XID alert resolves one window after the XID (not latched forever) ...
        _wait("SDCWatchGPUXidReboot resolved",
              lambda: not [a for a in prom.alerts() if a["labels"]["alertname"] == "SDCWatchGPUXidReboot"],
              40, prom, agent)
        # 3. ... and the reset in the scenario clears FAILED (the GPU then waits for a canary: SUSPECT).
        _wait("SDCWatchGPUFailed resolved",
              lambda: not [a for a in prom.alerts() if a["labels"]["alertname"] == "SDCWatchGPUFailed"],
              40, prom, agent)
        query = f'sdcwatch_gpu_state{{uuid="{GPU1["uuid"]}"}} == 1'
        state = prom.get("/api/v1/query", query=query)["result"]
        assert [s["metric"]["state"] for s in state] in (["SUSPECT"], ["HEALTHY"])
        # GPU 0 never alerted
        assert not [a for a in prom.alerts() if a["labels"].get("uuid") == GPU0["uuid"]]
        up = prom.get("/api/v1/query", query="up")["result"]
        assert [u["value"][1] for u in up] == ["1"]
    finally:
        prom.stop()


# ---- the loss detector's alerts: agent -> Prometheus rule -> Alertmanager (and the agent's own push) -------------

@pytest.fixture(scope="module")
def loss_stack() -> Iterator[tuple[AgentProcess, Prometheus, Alertmanager]]:
    if not shutil.which("prometheus") or not alertmanager_binary():
        pytest.fail("prometheus or prometheus-alertmanager not installed: bash scripts/setup.sh --test")
    workdir = Path(tempfile.mkdtemp(prefix="sdcw-", dir="/tmp"))   # short: unix socket paths
    am = Alertmanager(workdir)
    agent = AgentProcess(workdir / "state", "--alerts-alertmanager-url", am.url, "--hostname", "e2e-node")
    prom: Prometheus | None = None
    try:
        agent.start()
        rules = workdir / "rules-short.yml"
        rules.write_text(shorten_rules(RULES.read_text()))
        prom = Prometheus(workdir, agent.runtime_info()["metrics"], rules, alertmanager=f"127.0.0.1:{am.port}")
        yield agent, prom, am
    finally:
        if prom is not None:
            prom.stop()
        agent.stop()
        am.stop()
        remove_test_dir(workdir)


def _report(stub: pb_grpc.AgentStub, job: str, step: int, loss: float, grad_norm: float,
            loss_scale: float | None = None) -> None:
    req = pb.ReportStepRequest(job_id=job, rank=0, world_size=1, step=step, loss=loss, grad_norm=grad_norm,
                               time=time.time(), host="e2e-node")
    if loss_scale is not None:
        req.loss_scale = loss_scale
    assert stub.ReportStep(req, timeout=10).accepted


def _grad_norm_spike(stub: pb_grpc.AgentStub, job: str) -> None:
    for step in range(160):
        _report(stub, job, step, 2.0 + 0.01 * (step % 5), 50.0 if step in (150, 151) else 1.0 + 0.01 * (step % 3))


def _loss_scale_collapse(stub: pb_grpc.AgentStub, job: str) -> None:
    for step in range(160):
        _report(stub, job, step, 2.0 + 0.01 * (step % 5), 1.0 + 0.01 * (step % 3),
                loss_scale=65536.0 if step < 150 else 1.0)


def _nan_grad_norm(stub: pb_grpc.AgentStub, job: str) -> None:
    for step in range(60):
        _report(stub, job, step, 2.0 + 0.01 * (step % 5), math.nan if step == 50 else 1.0 + 0.01 * (step % 3))


def _loss_sustained(stub: pb_grpc.AgentStub, job: str) -> None:
    for step in range(260):
        _report(stub, job, step, (2.0 if step < 200 else 4.0) + 0.01 * (step % 5), 1.0 + 0.01 * (step % 3))


def _loss_spike(stub: pb_grpc.AgentStub, job: str) -> None:
    for step in range(170):
        _report(stub, job, step, (10.0 if step in (150, 151) else 2.0) + 0.01 * (step % 5), 1.0 + 0.01 * (step % 3))


@pytest.mark.parametrize("feed, kind, alert, severity", [
    (_loss_sustained, "loss.sustained", "SDCWatchLossSustained", "critical"),
    (_loss_spike, "loss.spike", "SDCWatchLossSpike", "warning"),
    (_grad_norm_spike, "grad_norm.spike", "SDCWatchGradNormSpike", "warning"),
    (_loss_scale_collapse, "loss_scale.collapse", "SDCWatchLossScaleCollapse", "critical"),
    (_nan_grad_norm, "grad_norm.nonfinite", "SDCWatchGradNormNonFinite", "critical"),
], ids=["loss-sustained", "loss-spike", "grad-norm-spike", "loss-scale-collapse", "nan-grad-norm"])
def test_loss_detector_alert_reaches_alertmanager(loss_stack: tuple[AgentProcess, Prometheus, Alertmanager],
                                                  feed: Callable[[pb_grpc.AgentStub, str], None], kind: str,
                                                  alert: str, severity: str) -> None:
    agent, prom, am = loss_stack
    job = f"e2e-{kind.replace('.', '-').replace('_', '-')}"
    with grpc.insecure_channel(agent.target) as ch:
        feed(pb_grpc.AgentStub(ch), job)

    def named(source: str | None) -> list[dict[str, Any]]:
        return [a for a in am.alerts() if a["labels"]["alertname"] == alert
                and a["labels"].get("source") == source and a["status"]["state"] == "active"]

    # Prometheus' rule over sdcwatch_events_total{kind=...} fires and reaches Alertmanager ...
    from_rule = _wait(f"{alert} from Prometheus in Alertmanager", lambda: named(None), 60, prom, agent)
    labels = from_rule[0]["labels"]
    assert labels["severity"] == severity and labels["instance"] == agent.runtime_info()["metrics"]
    assert labels.get("kind", kind) == kind
    assert from_rule[0]["annotations"]["runbook_url"].endswith(f"/docs/runbooks/{alert}.md")
    # ... and the agent pushed its own, naming the job
    pushed = _wait(f"{alert} pushed by the agent", lambda: [a for a in named("sdcwatch-agent")
                                                            if a["labels"].get("job_id") == job], 30, prom, agent)
    assert pushed[0]["labels"]["node"] == "e2e-node"
    # no other loss rule (a warning's rule for a critical kind, or the reverse) nor the catch-all swallowed it
    others = {"SDCWatchLossSpike", "SDCWatchLossSustained", "SDCWatchCriticalEvent"} - {alert}
    rules_firing = {(a["labels"]["alertname"], a["labels"].get("kind")) for a in prom.alerts()}
    assert not {(name, kind) for name in others} & rules_firing
    assert not [a for a in am.alerts() if a["labels"]["alertname"] in others and a["labels"].get("kind") == kind]
