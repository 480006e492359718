"""Runs a blocking probe on schedule, off the event loop, with a timeout and HUNG detection.

Each probe has one dedicated daemon worker thread. The loop awaits the call with `wait_for`; if it does
not return in time the probe is HUNG: an event is raised and the probe is not called again until the hung
call returns (then it is marked recovered). One failure never kills the loop: errors are recorded and the
probe runs again next interval. Daemon threads mean a driver call stuck forever cannot block exit.

Heartbeat: `last_beat` (monotonic seconds) is set at each round and every `interval_s` (at most a second)
while the loop waits on a hung call, so the agent's watchdog (daemon/watchdog.py) tells a loop that stopped
(a bug: the agent is not watching) from one that waits on a driver that does not answer (reported as HUNG).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Any, Awaitable, Callable

from daemon.pools import settle_future
from daemon.watchdog import LoopBeat
from sdcwatch import event_kinds as ek
from sdcwatch.errors import SdcwatchError
from sdcwatch.event_kinds import Publish

log = logging.getLogger(__name__)


class Worker:
    """One daemon thread that runs submitted callables one at a time."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any], asyncio.AbstractEventLoop] | None]
        self._q = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"sdcwatch-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut, loop = item
            try:
                result: Any = fn()
                err: BaseException | None = None
            except BaseException as exc:  # delivered to the awaiting coroutine
                result, err = None, exc
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle_future, fut, result, err)

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._q.put((fn, fut, loop))
        return fut

    def stop(self) -> None:
        self._q.put(None)




@dataclasses.dataclass(slots=True)
class ProbeStatus:
    name: str
    state: str = "PENDING"          # PENDING OK FAILING HUNG DISABLED
    last_run: float = 0.0
    last_duration_s: float = 0.0
    last_error: str = ""
    runs: int = 0
    failures: int = 0




MAX_BACKOFF_S = 300.0


def next_run_delay(interval_s: float, fatal_streak: int) -> float:
    """Seconds from one run's start to the next: the interval, doubled for each run in a row that failed
    with a non-transient error (retrying at full rate cannot help), up to MAX_BACKOFF_S (or the interval
    when that is longer). Transient errors and successes keep the interval."""
    if fatal_streak <= 0:
        return interval_s
    return max(interval_s, min(MAX_BACKOFF_S, interval_s * 2.0 ** min(fatal_streak, 16)))


class ProbeRunner:
    """Calls `fn(now)` every `interval_s` in its worker; hands results to `on_result(result, now)`."""

    def __init__(self, name: str, fn: Callable[[float], Any], *, interval_s: float, timeout_s: float,
                 on_result: Callable[[Any, float], Awaitable[None] | None], publish: Publish,
                 observe: Callable[[str, float, bool], None] | None = None,
                 on_hung: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.name = name
        self.fn = fn
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_result = on_result
        self.publish = publish
        self.observe = observe
        self.clock = clock
        self.on_hung = on_hung  # called with True when a call hangs, False when it returns
        self.status = ProbeStatus(name)
        self.worker = Worker(name)
        self.fatal_streak = 0   # runs in a row that failed with a non-transient sdcwatch error
        self.last_beat = time.monotonic()   # the heartbeat (module docstring)

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def heartbeat(self) -> LoopBeat:
        """The watchdog's view: the period the loop is expected to beat within (its interval, or its backoff
        after fatal errors) and its last beat."""
        return LoopBeat(self.name, next_run_delay(self.interval_s, self.fatal_streak), self.last_beat)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run one blocking call in this probe's worker with the timeout and HUNG handling."""
        fut = self.worker.submit(fn)
        deadline = time.monotonic() + self.timeout_s
        while not fut.done():   # beating while the call runs: a slow call is not a stopped loop
            self.beat()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait({fut}, timeout=min(left, 1.0, self.interval_s))
        if fut.done():
            return fut.result()
        # the call is hung
        self.status.state = "HUNG"
        self.status.last_error = f"call did not return within {self.timeout_s}s"
        self.publish(ek.PROBE_HUNG, f"probe/{self.name}",
                     f"probe {self.name} hung: no answer within {self.timeout_s}s; not re-entered until it returns",
                     {"probe": self.name, "timeout_s": self.timeout_s})
        if self.on_hung is not None:
            self.on_hung(True)
        started = time.monotonic()
        try:
            result = await self._await_beating(fut)  # nothing else is submitted meanwhile
        finally:
            self.publish(ek.PROBE_RECOVERED, f"probe/{self.name}",
                         f"probe {self.name} returned after {time.monotonic() - started + self.timeout_s:.1f}s",
                         {"probe": self.name})
            if self.on_hung is not None:
                self.on_hung(False)
        return result

    async def _await_beating(self, fut: asyncio.Future[Any]) -> Any:
        """Wait for a hung call, beating meanwhile: waiting on the driver is not a stopped loop."""
        while True:
            self.beat()
            done, _ = await asyncio.wait({fut}, timeout=min(1.0, self.interval_s))
            if done:
                return fut.result()

    async def run_forever(self) -> None:
        while True:
            self.beat()
            started = time.monotonic()
            now = self.clock()
            ok = True
            try:
                result = await self.call(lambda: self.fn(now))
                outcome = self.on_result(result, now)
                if asyncio.iscoroutine(outcome):
                    await outcome
                self.status.state = "OK"
                self.status.last_error = ""
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                ok = False
                self.status.failures += 1
                self.status.state = "FAILING"
                self.status.last_error = f"{type(exc).__name__}: {exc}"
                fatal = isinstance(exc, SdcwatchError) and not exc.transient
                self.fatal_streak = self.fatal_streak + 1 if fatal else 0
                log.warning("probe %s failed%s: %s", self.name, " (not transient: backing off)" if fatal else "",
                            self.status.last_error)
                log.debug("%s", traceback.format_exc())
            else:
                self.fatal_streak = 0
            duration = time.monotonic() - started
            self.status.runs += 1
            self.status.last_run = now
            self.status.last_duration_s = duration
            if self.observe is not None:
                self.observe(self.name, duration, ok)
            await asyncio.sleep(max(0.0, next_run_delay(self.interval_s, self.fatal_streak) - duration))

    def stop(self) -> None:
        self.worker.stop()
