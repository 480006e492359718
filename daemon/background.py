"""`Background`: the agent's background work, owned in one place.

A component that runs something in the background is handed the agent's `Background` and starts it there:
`start(coro, name)` for a task (a finished task is dropped at once, so short-lived ones do not pile up),
`on_close(fn)` for what must be closed after the tasks are gone (a listener thread's stop flag, a probe's
backend). The agent closes it once at stop: `cancel()` cancels every task and waits for them, then
`run_closers()` calls the closers, newest first; a closer that raises is logged and the others still run.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

log = logging.getLogger(__name__)


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closers: list[Callable[[], object]] = []

    def start(self, coro: Coroutine[Any, Any, Any], name: str) -> "asyncio.Task[Any]":
        """Run `coro` as a task of the running loop until it returns or `cancel()`; an error it ends with is
        logged."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def on_close(self, fn: Callable[[], object]) -> None:
        self._closers.append(fn)

    def __len__(self) -> int:
        return len(self._tasks)

    def _done(self, task: "asyncio.Task[Any]") -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed: %s", task.get_name(), task.exception())

    async def cancel(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def run_closers(self) -> None:
        while self._closers:
            fn = self._closers.pop()
            try:
                fn()
            except Exception:  # noqa: BLE001 - every closer gets its turn
                log.exception("closing %r failed", fn)
