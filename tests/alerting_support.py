"""Real Prometheus and Alertmanager for the alert tests, on free ports with temp storage, torn down.

Both come from Debian (`prometheus`, `prometheus-alertmanager`; `bash scripts/setup.sh --test` installs
them). `shorten_rules` makes the rules' windows and `for:` durations seconds long, so an alert that fires
for 30 minutes after an event plays out in a test.
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
from typing import Any

from conftest import free_port
from deadlines import scaled

WINDOW = "12s"
HOLD = "2s"


def shorten_rules(text: str, window: str = WINDOW, hold: str = HOLD) -> str:
    """The rules with every range `[..]`, every `offset ..` set to `window` and every `for:` to `hold`."""
    text = re.sub(r"\[\d+[smhdwy]\]", f"[{window}]", text)
    text = re.sub(r"\boffset \d+[smhdwy]", f"offset {window}", text)
    return re.sub(r"^(\s+for: )\S+$", rf"\g<1>{hold}", text, flags=re.M)


def alertmanager_binary() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


class Alertmanager:
    """Alertmanager with clustering off and one black-hole receiver; `alerts()` reads its v2 API."""

    def __init__(self, workdir: Path) -> None:
        binary = alertmanager_binary()
        assert binary
        self.port = free_port()
        cfg = workdir / "alertmanager.yml"
        cfg.write_text("route:\n  receiver: blackhole\n  group_wait: 1s\nreceivers:\n  - name: blackhole\n")
        (workdir / "am-data").mkdir()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.path={workdir / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdout=subprocess.DEVNULL, stderr=open(workdir / "am.log", "wb"))
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + scaled(20)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"alertmanager exited: {(workdir / 'am.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("alertmanager did not become ready")

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Prometheus:
    """Prometheus scraping one target with `rules`, sending what fires to `alertmanager` (host:port) if given."""

    def __init__(self, workdir: Path, target: str, rules: Path, alertmanager: str | None = None) -> None:
        binary = shutil.which("prometheus")
        assert binary
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {rules}\n"
            + (f"alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['{alertmanager}']\n"
               if alertmanager else "")
            + f"scrape_configs:\n  - job_name: sdcwatch\n    static_configs:\n      - targets: ['{target}']\n")
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + scaled(30)
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
