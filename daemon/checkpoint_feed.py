"""`CheckpointFeed`: the events that decide VERIFIED (replica votes, SDC, NaN, fatal hardware, restores),
from the detectors to the checkpoint coordinator, in order, without ever blocking the caller.

`put()` queues (bounded; an overflow is counted in `sdcwatch_events_dropped_total{sink=
"checkpoint-job-events"}`); one task (`start(background)`) hands them to the sink one at a time, so the
coordinator sees them in the order they happened. A failed event is logged; the feed goes on.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from prometheus_client import Counter

from daemon.background import Background

log = logging.getLogger(__name__)


class JobEventSink(Protocol):
    async def job_event(self, job_id: str, step: int | None, kind: str, now: float,
                        reason: str = "") -> None: ...


class CheckpointFeed:
    def __init__(self, sink: JobEventSink, *, dropped: Counter, maxsize: int = 10_000) -> None:
        self.sink = sink
        self.dropped = dropped    # sdcwatch_events_dropped_total (by sink)
        self._queue: asyncio.Queue[tuple[str, int | None, str, float, str]] = asyncio.Queue(maxsize=maxsize)

    def start(self, background: Background) -> None:
        background.start(self._feed(), name="checkpoint-job-events")

    def put(self, job_id: str, step: int | None, kind: str, reason: str = "") -> None:
        try:
            self._queue.put_nowait((job_id, step, kind, time.time(), reason))
        except asyncio.QueueFull:
            self.dropped.labels("checkpoint-job-events").inc()

    async def _feed(self) -> None:
        while True:
            job_id, step, kind, now, reason = await self._queue.get()
            try:
                await self.sink.job_event(job_id, step, kind, now, reason)
            except Exception as exc:  # one failure never stops the feed
                log.error("checkpoint job event %s for %s failed: %s", kind, job_id, exc)
