"""daemon/background.py: the agent's stop always ends, even when a task loses its cancellation (issue 24:
redis-py reconnecting through Sentinel returned from a command as if the task had not been cancelled, and
the agent's stop then waited on the stream task until it was killed)."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from daemon.background import Background


async def _swallows_one_cancel(started: asyncio.Event, swallowed: list[int]) -> None:
    """What the Redis stream task did: the first cancel is lost inside a library call, then the task waits
    on its queue again."""
    started.set()
    try:
        await asyncio.sleep(3600)   # "a command through a failover"
    except asyncio.CancelledError:
        swallowed.append(1)        # the library returned as if nothing happened
    await asyncio.Event().wait()   # back to waiting for the next event


def test_a_task_that_loses_its_cancel_is_cancelled_again() -> None:
    async def main() -> tuple[list[str], float, list[int], asyncio.Task]:
        bg, started, swallowed = Background(), asyncio.Event(), []
        task = bg.start(_swallows_one_cancel(started, swallowed), name="redis-stream")
        bg.start(asyncio.sleep(3600), name="plain")
        await started.wait()
        t = time.monotonic()
        left = await bg.cancel(timeout_s=30)
        return left, time.monotonic() - t, swallowed, task

    left, took, swallowed, task = asyncio.run(main())
    assert left == [] and swallowed == [1] and task.cancelled()
    assert took < 30, "the second cancel ended it, long before the deadline"


def test_a_task_that_never_ends_is_left_behind_at_the_deadline(caplog: pytest.LogCaptureFixture) -> None:
    release = []

    async def stubborn() -> None:
        while not release:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    async def main() -> list[str]:
        bg = Background()
        task = bg.start(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        left = await bg.cancel(timeout_s=0.3)
        release.append(1)          # let the loop end cleanly
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return left

    with caplog.at_level(logging.ERROR, logger="daemon.background"):
        assert asyncio.run(main()) == ["stubborn"]
    assert "stubborn did not end within 0.3s" in caplog.text and "stubborn" in caplog.text
