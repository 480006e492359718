"""Child processes that die with their parent (Linux `PR_SET_PDEATHSIG`): the agent's redis-server, the
demo's agent and ranks. Stopped from outside, even by SIGKILL (a CI timeout), a parent leaves nothing running.

    subprocess.Popen(cmd, preexec_fn=die_with_parent(os.getpid()))
"""
from __future__ import annotations

import ctypes
import os
import signal
from typing import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM, *, own_group: bool = False) -> Callable[[], None]:
    """A `preexec_fn` (it runs in the child between fork and exec): the kernel sends `sig` to the child when
    the thread that started it exits. `parent_pid` is the starter's pid (`os.getpid()` before the Popen):
    a parent already gone before the prctl took effect is caught by comparing it with getppid.
    `own_group`: the child leads a process group of its own (a terminal's ^C reaches only the parent, which
    stops the child in order). Where prctl is missing (not Linux) this only sets the group."""
    def preexec() -> None:
        if own_group:
            os.setpgrp()
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent_pid:   # the parent died before the prctl: nobody would signal us
            os.kill(os.getpid(), sig)

    return preexec
