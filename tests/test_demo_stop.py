"""`sdcwatch demo` stopped from outside (a CI timeout's SIGTERM or SIGKILL, a SIGINT) leaves nothing running:
not its agent, not the agent's redis-server, not its ranks."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent_harness import ROOT
from deadlines import wait_until


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running (a zombie left for a parent that does not reap counts as gone)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_demo_stopped_from_outside_leaves_nothing_running(short_tmp: Path, sig: signal.Signals) -> None:
    log = short_tmp / "demo.log"
    with open(log, "wb") as sink:   # a file: a pipe nobody reads could fill and stall the demo
        demo = subprocess.Popen([sys.executable, "-m", "daemon.cli", "demo", "--device", "cpu", "--steps", "2000",
                                 "--ranks", "2", "--quiet", "--out", str(short_tmp / "out")], cwd=ROOT,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def started() -> tuple[int, int, list[int]] | None:
            assert demo.poll() is None, log.read_text(errors="replace")[-3000:]
            kids = _children(demo.pid)
            agents = [p for p in kids if "daemon.cli run" in _cmdline(p)]
            ranks = [p for p in kids if "demo.worker" in _cmdline(p)]
            redis = [p for a in agents for p in _children(a) if "redis-server" in _cmdline(p)]
            return (agents[0], redis[0], ranks) if agents and redis and len(ranks) == 2 else None

        agent, redis, ranks = wait_until(started, 120, "the demo's agent, redis-server and 2 ranks running")
        os.kill(demo.pid, sig)
        code = demo.wait(timeout=120)
        if sig != signal.SIGKILL:
            assert code in (128 + sig, 130, -sig), code   # an orderly stop, its exit says which signal
        for pid, what in [(agent, "agent"), (redis, "redis-server")] + [(r, "rank") for r in ranks]:
            wait_until(lambda: not _alive(pid), 60, f"the demo's {what} (pid {pid}) gone after {sig.name}")
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
