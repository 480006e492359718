"""The agent's watchdog on itself: a loop that stops beating makes the agent loud, not green.

Every probe loop (`daemon.probe_runner.ProbeRunner`) publishes a heartbeat, `last_beat` (monotonic seconds),
at each round and every second while it waits on a call that is known to hang (a hung NVML call is the
driver's fault, reported as `probe.hung` and `nvml.unresponsive`, and DESIGN.md keeps it out of liveness).
A loop whose heartbeat is older than `STALE_INTERVALS` of its interval (and `STALE_FLOOR_S`) is stale: its
task died, deadlocked or is stuck in our own code. Then `sdcwatch.v1.Agent` answers NOT_SERVING
(Kubernetes liveness restarts the agent; `sdcwatch status` shows the reason on the probe), an
`agent.loop_stale` event is journaled and `SDCWatchAgentLoopStale` fires; a beat after that journals
`agent.loop_recovered` and resolves it.

`stale_loops(loops, now)` is the pure rule; `Watchdog` applies it every `check_s` on the event loop (an
event loop that is blocked answers no health check at all, which liveness sees as a failure too).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Callable, Iterable, Iterator, Protocol

from sdcwatch import event_kinds as ek
from sdcwatch.event_kinds import Publish

log = logging.getLogger(__name__)

STALE_INTERVALS = 3.0
# no loop is stale before this long without a beat, whatever its interval: on a node whose cores the
# training takes (ranks, data loaders, compile workers) a healthy loop's wake-up can wait a second or two
# for the CPU, and a short poll interval (0.5 s) made that a false agent.loop_stale and NOT_SERVING (the
# suite's demo with every core busy, 2026-12-06); a loop that has stopped stays stopped, so this only
# delays the alarm by a few seconds
STALE_FLOOR_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class LoopBeat:
    """One loop's heartbeat: its name, its interval and when it last beat (monotonic seconds)."""

    name: str
    interval_s: float
    last_beat: float


class ThreadBeat:
    """The heartbeat of a loop that runs on a thread of its own (the NVML event listener), for `Watchdog`.

    The thread calls `beat()` every round and wraps each call that waits in the driver in `waiting()`: time
    spent there counts as beating (a driver that does not answer is the poll loop's HUNG and
    `nvml.unresponsive`, never a stopped loop: DESIGN.md keeps it out of liveness). A thread that died on an
    exception, or is stuck in our own code, stops beating and goes stale like any probe loop."""

    def __init__(self, name: str, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.interval_s = interval_s
        self._clock = clock
        self.last_beat = clock()
        self._waiting = False

    def beat(self) -> None:
        self.last_beat = self._clock()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False
            self.last_beat = self._clock()

    def heartbeat(self) -> LoopBeat:
        return LoopBeat(self.name, self.interval_s, self._clock() if self._waiting else self.last_beat)


def stale_loops(loops: Iterable[LoopBeat], now: float, intervals: float = STALE_INTERVALS,
                floor_s: float = STALE_FLOOR_S) -> dict[str, str]:
    """Pure: name -> reason for every loop whose last beat is more than `intervals` intervals, and more than
    `floor_s` seconds, before `now`."""
    out = {}
    for lp in loops:
        age = now - lp.last_beat
        if age > max(intervals * lp.interval_s, floor_s):
            out[lp.name] = (f"loop {lp.name} published no heartbeat for {age:.0f}s ({intervals:g} intervals of "
                            f"{lp.interval_s:g}s, at least {floor_s:g}s): it is not running")
    return out


class LivenessSink(Protocol):
    """What the watchdog tells: `daemon.health.NodeHealth.set_stale_loops`."""

    def set_stale_loops(self, stale: dict[str, str]) -> None: ...


class Watchdog:
    """Checks `loops()` every `check_s`; publishes the transitions and tells `health` which loops are stale."""

    def __init__(self, loops: Callable[[], Iterable[LoopBeat]], *, publish: Publish, health: LivenessSink,
                 on_change: Callable[[str, str | None], None] | None = None,
                 check_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        """`on_change(loop, reason or None)`: told when a loop goes stale and when it beats again (the GPU
        probes mark what the loop judged UNKNOWN: its verdicts are no longer fresh)."""
        self.loops = loops
        self.publish = publish
        self.health = health
        self.on_change = on_change
        self.check_s = check_s
        self.clock = clock
        self.stale: dict[str, str] = {}

    def check(self, now: float) -> dict[str, str]:
        """One check at `now`: the stale loops (name -> reason), transitions published."""
        stale = stale_loops(self.loops(), now)
        for name in sorted(stale.keys() - self.stale.keys()):
            log.error("%s", stale[name])
            self.publish(ek.AGENT_LOOP_STALE, f"probe/{name}", stale[name], {"probe": name})
            if self.on_change is not None:
                self.on_change(name, stale[name])
        for name in sorted(self.stale.keys() - stale.keys()):
            self.publish(ek.AGENT_LOOP_RECOVERED, f"probe/{name}", f"loop {name} beats again", {"probe": name})
            if self.on_change is not None:
                self.on_change(name, None)
        if stale.keys() != self.stale.keys():
            self.health.set_stale_loops(dict(stale))
        self.stale = stale
        return stale

    async def run_forever(self) -> None:
        while True:
            try:
                self.check(self.clock())
            except Exception:  # one failure never kills the loop
                log.exception("watchdog check failed")
            await asyncio.sleep(self.check_s)
