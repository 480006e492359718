"""sdcwatch/proc.py's `bound_command`: a foreign binary started without a `preexec_fn` still dies with the
thread that started it (PR_SET_PDEATHSIG armed after fork, before exec), by setpriv or by the Python
fallback; and a child whose parent is already gone when the fallback runs kills itself."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deadlines import scaled, wait_until
from sdcwatch import proc


def _start_from_a_thread(cmd: list[str]) -> tuple[subprocess.Popen, threading.Event, threading.Thread]:
    box: dict[str, subprocess.Popen] = {}
    started, leave = threading.Event(), threading.Event()

    def run() -> None:
        box["p"] = subprocess.Popen(cmd, env=proc.parent_env(), stdin=subprocess.DEVNULL, start_new_session=True)
        started.set()
        leave.wait()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(scaled(30))
    return box["p"], leave, t


FALLBACK = [sys.executable, "-m", "sdcwatch.proc", "--"]


@pytest.mark.parametrize("how", ["bound_command", "python-fallback"])
def test_the_child_dies_when_the_thread_that_started_it_exits(how: str) -> None:
    argv = ["sleep", "600"]
    cmd = proc.bound_command(argv) if how == "bound_command" else FALLBACK + argv
    child, leave, t = _start_from_a_thread(cmd)
    try:
        # armed once it execs sleep in place (same pid); a starter thread that exits before that is not seen
        # by the fallback's check (getppid still names our process), which is why the agent starts its
        # redis-server from a thread that outlives it (its executor's)
        wait_until(lambda: Path(f"/proc/{child.pid}/cmdline").read_bytes().startswith(b"sleep\0"), 60,
                   "the child exec'd sleep")
        leave.set()
        t.join(scaled(10))
        assert child.wait(scaled(30)) == -15, "SIGTERM from the kernel when its starter thread exited"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_bound_command_prefers_a_working_setpriv() -> None:
    cmd = proc.bound_command(["redis-server", "--port", "0"])
    assert cmd[-3:] == ["redis-server", "--port", "0"]
    if proc._setpriv():
        assert cmd[:4] == [proc._setpriv(), "--pdeathsig", "TERM", "--"]
    else:
        assert cmd[:4] == FALLBACK


def test_the_fallback_kills_itself_when_its_parent_is_already_gone() -> None:
    """The starter's pid in the environment is not the child's parent: it was gone before the signal was
    armed, nobody would send it, so the child ends itself."""
    env = dict(proc.parent_env(), **{proc.PARENT_ENV: "1"})   # pid 1 is not our pid: "the parent died"
    child = subprocess.run(FALLBACK + ["sleep", "600"], env=env, timeout=scaled(60))
    assert child.returncode == -15
