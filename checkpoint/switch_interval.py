"""The interpreter's thread switch interval while checkpoint threads run beside the training thread.

A save's background work (the copy thread's enqueue, the commit worker's Python) takes the GIL whenever
the training thread releases it inside a torch call; the training thread, back from the call, waits until
the background lets go, up to `sys.getswitchinterval()` (5 ms by default) when the background is running
Python. On the H200 that wait cost every-step checkpointing about 1 ms of each step (GPT-2 small, batch 16
and 32: +2.00% / +1.16% with 5 ms, +0.81% / +0.21% with 0.2 ms; docs/BENCHMARKS.md, issue 21).

`SnapshotConfig.gil_switch_interval` asks for a shorter interval for as long as the snapshotter lives.
The interval is the process's, so this module holds the requests of every snapshotter in one place:
- the shortest request wins while any is held; the last release puts back what was there before;
- an interval the user set (anything but Python's default when the first request came) is left alone;
- a release never overwrites an interval someone else set after ours (it is only put back when it is
  still the one this module set).
"""
from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger(__name__)

PYTHON_DEFAULT = 0.005   # CPython's sys.getswitchinterval() when nobody set it


class SwitchInterval:
    """Requests for a shorter switch interval, held by token (one per snapshotter). `get`/`set` are the
    interpreter's by default; passed in by tests."""

    def __init__(self, get=sys.getswitchinterval, set=sys.setswitchinterval) -> None:  # noqa: A002
        self._get, self._set = get, set
        self._lock = threading.Lock()
        self._held: dict[int, float] = {}
        self._next = 0
        self._before: float | None = None   # what was there when the first request came
        self._ours: float | None = None     # what this module set (None: it set nothing)

    def hold(self, seconds: float) -> int:
        """Ask for `seconds` (> 0) until `release(token)`; returns the token."""
        if not (seconds > 0.0):
            raise ValueError(f"a switch interval must be > 0 seconds, got {seconds!r}")
        with self._lock:
            if not self._held:
                self._before = self._get()
            self._next += 1
            self._held[self._next] = float(seconds)
            self._apply()
            return self._next

    def release(self, token: int) -> None:
        with self._lock:
            if self._held.pop(token, None) is None:
                return
            if self._held:
                self._apply()
                return
            if self._ours is not None and self._get() == self._ours and self._before is not None:
                self._set(self._before)
            self._ours = self._before = None

    def _apply(self) -> None:
        now = self._get()
        if self._ours is None and self._before != PYTHON_DEFAULT:
            if len(self._held) == 1:
                log.info("checkpoint: the switch interval %g s was set by the process; kept (asked: %g s)",
                         now, min(self._held.values()))
            return
        if self._ours is not None and now != self._ours:   # someone set theirs after ours: theirs stays
            return
        want = min(self._held.values())
        if want != now:
            self._set(want)
            if self._ours is None:
                log.info("checkpoint: thread switch interval %g s -> %g s while checkpoints run in the "
                         "background (SnapshotConfig.gil_switch_interval)", now, want)
            self._ours = self._get()   # as the interpreter keeps it (whole microseconds)


INTERVAL = SwitchInterval()   # the process's: every Snapshotter's requests
