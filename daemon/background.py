"""`Background`: the agent's background work, owned in one place.

A component that runs something in the background is handed the agent's `Background` and starts it there:
`start(coro, name)` for a task (a finished task is dropped at once, so short-lived ones do not pile up),
`on_close(fn)` for what must be closed after the tasks are gone (a listener thread's stop flag, a probe's
backend). The agent closes it once at stop: `cancel(timeout_s)` cancels every task and waits for them, for
at most `timeout_s`, then `run_closers()` calls the closers, newest first; a closer that raises is logged and
the others still run.

A cancellation can be lost inside a library: redis-py's asyncio client, reconnecting through Sentinel after
a failover, returned from a command as if the task had not been cancelled, and the task then waited on its
queue for good (the agent's stop hung until it was killed; issue 24). So `cancel` repeats the cancel, every
`_RECANCEL_S`, to tasks that are still running, and gives up on (and logs, with their stacks) any still
running at the deadline: a stop always ends.
"""
from __future__ import annotations

import asyncio
import io
import logging
from typing import Any, Callable, Coroutine

log = logging.getLogger(__name__)
_RECANCEL_S = 0.25


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

    async def cancel(self, timeout_s: float = 5.0) -> list[str]:
        """Cancel every task and wait until they have ended, for at most `timeout_s` (`cancel_tasks`).
        Returns the names of the tasks that outlived the deadline."""
        return await cancel_tasks(self._tasks, timeout_s)

    def run_closers(self) -> None:
        while self._closers:
            fn = self._closers.pop()
            try:
                fn()
            except Exception:  # noqa: BLE001 - every closer gets its turn
                log.exception("closing %r failed", fn)


async def cancel_tasks(tasks: "set[asyncio.Task[Any]] | list[asyncio.Task[Any]]",
                       timeout_s: float) -> list[str]:
    """Cancel `tasks` and wait until they have ended, for at most `timeout_s`; a task still running is
    cancelled again every `_RECANCEL_S` (a library may have swallowed the first). Returns the names of the
    tasks that outlived the deadline (logged with their stacks; left to the loop's end)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(left, _RECANCEL_S))
    for task in pending:
        stack = io.StringIO()
        task.print_stack(file=stack)
        log.error("background task %s did not end within %.1fs of its cancel:\n%s", task.get_name(),
                  timeout_s, stack.getvalue())
    return sorted(t.get_name() for t in pending)
