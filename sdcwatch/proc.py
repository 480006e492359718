"""Child processes that die with their parent (Linux `PR_SET_PDEATHSIG`): the agent's redis-server, the
demo's agent and ranks. Stopped from outside, even by SIGKILL (a CI timeout), a parent leaves nothing running.

Two ways, one rule: no Python code runs between fork and exec where it can be avoided.
- Our own programs arm the signal themselves, first thing after exec (`bind_to_parent`), from the parent's
  pid that the starter passes in the environment (`parent_env`):

      subprocess.Popen([sys.executable, "-m", "demo.worker", ...], env=parent_env(env), start_new_session=True)

  A `preexec_fn` forces a plain fork() in a parent that has gRPC threads; gRPC's fork handlers then run in
  the child before exec, and a child that died there looked started to Popen: the demo's ranks waited for
  it at the rendezvous for good.
- A foreign binary (the agent's redis-server) is started through a small program that arms the signal and
  then execs the binary (the signal survives exec): `bound_command`, no `preexec_fn` either:

      subprocess.Popen(bound_command(["redis-server", ...]), env=parent_env(), start_new_session=True)

  That program is util-linux's `setpriv --pdeathsig TERM` where it works (no interpreter to start), else
  this module run as a program (`python -m sdcwatch.proc -- BINARY ...`, which also catches a starter
  process that died before the signal was armed; with setpriv such a child is left for the next agent's
  cleanup). Neither sees a starter *thread* that exited before exec: start from a thread that lives on.

  `die_with_parent` (a `preexec_fn`) is left for single-threaded starters only (tests' helpers).

The kernel sends the signal when the *thread* that forked the child exits, not the process: start such
children from a thread that lives as long as they should (the agent's event loop thread or its executor).
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import subprocess
import sys
from typing import Callable, Sequence

PR_SET_PDEATHSIG = 1
PARENT_ENV = "SDCWATCH_PARENT_PID"


def parent_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) plus this process's pid for the child's `bind_to_parent`."""
    return {**(dict(os.environ) if env is None else env), PARENT_ENV: str(os.getpid())}


def bind_to_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """Die with the parent: called by a child program first thing after exec. `parent_pid` is the starter's
    pid (default: `$SDCWATCH_PARENT_PID`, taken out of the environment so that this process's own children
    do not inherit it; nothing is done when neither is there). A parent already gone before the signal was
    armed is caught by comparing it with getppid."""
    if parent_pid is None:
        text = os.environ.pop(PARENT_ENV, "")
        if not text.isdigit():
            return
        parent_pid = int(text)
    _set_pdeathsig(sig)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def _set_pdeathsig(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):   # not Linux
        pass


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM, *, own_group: bool = False) -> Callable[[], None]:
    """A `preexec_fn` (it runs in the child between fork and exec): the kernel sends `sig` to the child when
    the thread that started it exits. `parent_pid` is the starter's pid (`os.getpid()` before the Popen):
    a parent already gone before the prctl took effect is caught by comparing it with getppid.
    `own_group`: the child leads a process group of its own (a terminal's ^C reaches only the parent, which
    stops the child in order). Where prctl is missing (not Linux) this only sets the group."""
    def preexec() -> None:
        if own_group:
            os.setpgrp()
        _set_pdeathsig(sig)
        if os.getppid() != parent_pid:   # the parent died before the prctl: nobody would signal us
            os.kill(os.getpid(), sig)

    return preexec


def bound_command(argv: Sequence[str], sig: str = "TERM") -> list[str]:
    """The command line that runs `argv` (a foreign binary and its arguments) bound to its starter, in place
    (same pid): `setpriv --pdeathsig SIG` where it works, else this module as a program, which arms
    PR_SET_PDEATHSIG from `$SDCWATCH_PARENT_PID` (so pass `env=parent_env()`) and execs `argv[0]` (a path or
    a name on PATH)."""
    setpriv = _setpriv()
    if setpriv:
        return [setpriv, "--pdeathsig", sig, "--", *argv]
    return [sys.executable, "-m", "sdcwatch.proc", "--", *argv]


@functools.lru_cache(maxsize=1)
def _setpriv() -> str:
    """util-linux's setpriv if it is on PATH and knows --pdeathsig (util-linux 2.33 and later), else ""."""
    found = shutil.which("setpriv")
    if not found:
        return ""
    try:
        ok = subprocess.run([found, "--pdeathsig", "TERM", "--", "true"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return found if ok else ""


def _exec_bound(argv: Sequence[str]) -> None:
    if not argv:
        sys.stderr.write("usage: python -m sdcwatch.proc -- BINARY [ARGS...]\n")
        raise SystemExit(2)
    bind_to_parent()
    os.execvp(argv[0], list(argv))


if __name__ == "__main__":
    _exec_bound(sys.argv[2:] if sys.argv[1:2] == ["--"] else sys.argv[1:])
