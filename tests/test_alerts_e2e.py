"""End to end: agent (fake NVML scenario: XID 79 on one GPU, then a GPU reset) -> real Prometheus scraping
it with sdcwatch's rules loaded -> the right alerts fire with the right labels and resolve.

The rules are loaded from a copy with short durations (`shorten_rules`): every range and offset becomes
WINDOW and every `for:` becomes HOLD, so "fires for 30 minutes after the newest XID" plays out in
seconds. Nothing else in the rules changes. Prometheus is Debian's `prometheus`, started on a free port
with a temp TSDB; the test skips with the reason when it is not installed.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from agent_harness import AgentProcess
from conftest import free_port
from deploy_support import RULES

pytestmark = pytest.mark.slow

WINDOW = "12s"
HOLD = "2s"
XID_AT = 4.0        # scenario seconds (from the agent's start)
RESET_AT = 20.0
GPU0 = {"uuid": "GPU-e2e00000-0000-4000-8000-000000000000", "pci_bus_id": "00000000:19:00.0"}
GPU1 = {"uuid": "GPU-e2e00000-0000-4000-8000-000000000001", "pci_bus_id": "00000000:39:00.0"}


def shorten_rules(text: str, window: str = WINDOW, hold: str = HOLD) -> str:
    """The rules with every range `[..]`, every `offset ..` set to `window` and every `for:` to `hold`."""
    text = re.sub(r"\[\d+[smhdwy]\]", f"[{window}]", text)
    text = re.sub(r"\boffset \d+[smhdwy]", f"offset {window}", text)
    return re.sub(r"^(\s+for: )\S+$", rf"\g<1>{hold}", text, flags=re.M)


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


class Prometheus:
    def __init__(self, workdir: Path, target: str, rules: Path) -> None:
        binary = shutil.which("prometheus")
        assert binary
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {rules}\n"
            f"scrape_configs:\n  - job_name: sdcwatch\n    static_configs:\n      - targets: ['{target}']\n")
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("prometheus not ready in 30s")

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def alerts(self) -> list[dict[str, Any]]:
        return self.get("/api/v1/alerts")["alerts"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture()
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        pytest.skip("prometheus not installed (Debian package 'prometheus'; bash scripts/setup.sh --test)")
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
    deadline = time.monotonic() + timeout
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
