"""`WorkPool`: one service's bounded thread pool for its blocking work, with its own liveness.

Each gRPC service whose handlers block (Checkpoints: Redis and file I/O; PeerStore: the memory tier's files)
runs that work in its own pool rather than asyncio's shared default executor, so one service's slow or
hung calls never take the threads another service (or the agent's own housekeeping) needs. So does each
other class of blocking work: checkpoint maintenance and peer replication (daemon/checkpoint_service.py),
journal reads for watchers (daemon/events.py), rollback planning's Redis reads (daemon/rollback.py), alert
deliveries (daemon/alerts.py) and node-condition pushes (daemon/k8s_nodes.py); nothing of the agent's runs
on asyncio's default executor (`asyncio.to_thread`), which is shared and small (cores + 4 threads), so a
class of calls that hangs there wedged every other. A pool is
*wedged* when every worker has been busy for `wedged_after_s` without any call finishing: the agent's own
health (`sdcwatch.v1.Agent`, DESIGN.md's health table) then says NOT_SERVING (daemon/health.py), and says
SERVING again once calls finish.

    pool = WorkPool("checkpoints", workers=8, wedged_after_s=60.0)
    result = await pool.run(blocking_fn, arg)      # on the event loop
    pool.wedged(time.monotonic())                   # the health check's question
    pool.shutdown()                                 # at stop: no more calls; a hung one never holds the exit
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class WorkPool:
    """Workers are daemon threads of this pool's own (not a `ThreadPoolExecutor`, whose threads the
    interpreter joins at exit): a call hung for good never holds the agent's exit."""

    def __init__(self, name: str, *, workers: int = 8, wedged_after_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if workers < 1:
            raise ValueError(f"pool {name}: workers must be >= 1, got {workers}")
        self.name = name
        self.workers = workers
        self.wedged_after_s = wedged_after_s
        self.clock = clock
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self.running = 0             # calls in a worker now
        self.queued = 0              # calls waiting for a worker
        self.done = 0                # calls finished, since start
        self._progress_at = clock()  # when a call last finished, or the pool last filled up

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in one of the pool's workers (with the caller's context variables). A call cancelled
        before a worker took it never runs."""
        if self._closed:
            raise RuntimeError(f"pool {self.name} is shut down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self.queued += 1
            if len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=f"sdcwatch-{self.name}-{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()
        self._queue.put((fn, args, loop, fut, contextvars.copy_context()))
        return await fut

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, loop, fut, ctx = item
            with self._lock:
                self.queued -= 1
                if fut.cancelled():
                    continue
                self.running += 1
                if self.running >= self.workers:
                    self._progress_at = self.clock()   # full from now on: the wedge clock starts
            result: Any = None
            error: BaseException | None = None
            try:
                result = ctx.run(fn, *args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                error = exc
            finally:
                with self._lock:
                    self.running -= 1
                    self.done += 1
                    self._progress_at = self.clock()
            try:
                loop.call_soon_threadsafe(settle_future, fut, result, error)
            except RuntimeError:   # the loop is closed: nobody waits any more
                pass

    def full(self) -> bool:
        """Every worker busy or spoken for: periodic work skips its round rather than queue behind them."""
        with self._lock:
            return self.running + self.queued >= self.workers

    def wedged(self, now: float | None = None) -> bool:
        """Every worker busy and no call finished for `wedged_after_s`."""
        now = self.clock() if now is None else now
        with self._lock:
            return self.running >= self.workers and now - self._progress_at > self.wedged_after_s

    def describe(self) -> str:
        with self._lock:
            return f"pool {self.name}: {self.running}/{self.workers} workers busy, {self.queued} queued"

    def shutdown(self) -> None:
        """Take no more calls; idle workers exit; a worker stuck in a call is left to it (a daemon thread)."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)


def settle_future(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Settle a loop's future from a worker's outcome (call on the loop); a cancelled future is left alone."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def run_in_thread(loop: asyncio.AbstractEventLoop, name: str, fn: Callable[..., Any],
                  *args: Any) -> "asyncio.Future[Any]":
    """`fn(*args)` on a daemon thread of its own; a future of the loop settles with its result. Unlike
    `asyncio.to_thread`, the loop's end never waits for it (a drain to a slow tier outliving a stop)."""
    fut: asyncio.Future[Any] = loop.create_future()

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        with contextlib.suppress(RuntimeError):   # the loop closed meanwhile
            loop.call_soon_threadsafe(settle_future, fut, result, error)

    threading.Thread(target=work, name=f"sdcw-{name}", daemon=True).start()
    return fut
