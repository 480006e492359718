"""`CheckpointFeed`: the events that decide VERIFIED (replica votes, SDC, NaN, fatal hardware, restores),
from the detectors to the checkpoint coordinator, in order, without ever blocking the caller.

`put()` queues (bounded); one task (`start(background)`) hands them to the sink one at a time, so the
coordinator sees them in the order they happened. A failed event is logged; the feed goes on.

Overload never loses a bad event silently. An event that finds the queue full is counted in
`sdcwatch_events_dropped_total{sink="checkpoint-job-events"}` and said in a folded
`checkpoint.verification_withheld` event; then:
- an agreed vote: dropped; its step is simply never VERIFIED (no vote, no verification);
- anything else (a mismatch, SDC, NaN, fatal hardware, a rollback or a clear): the job's lowest such step is
  kept (one int per job: bounded) and, as soon as the queue has room, queued as `events_lost` at that step,
  a bad event for the coordinator: VERIFIED is withheld from that step on (a step of None, "now", counts as
  step 0: the whole job) until the job rolls back or is cleared. It is queued after everything queued
  before the overflow and before anything after, so the order the coordinator sees is kept.

`mark()` and `handed(mark)`: a reader of what the coordinator decided (the rollback planner reads the VERIFIED
checkpoints) first waits until every event queued before it asked has been handed over: a loaded agent's feed
runs seconds behind the ranks, and a plan made before the votes that verify the checkpoint before an anomaly
(or the bad events that block one) were taken would find no target, or a wrong one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from prometheus_client import Counter

from checkpoint import policy
from daemon.background import Background
from sdcwatch import event_kinds as ek
from sdcwatch.event_kinds import Publish

log = logging.getLogger(__name__)


class JobEventSink(Protocol):
    async def job_event(self, job_id: str, step: int | None, kind: str, now: float,
                        reason: str = "") -> None: ...


class CheckpointFeed:
    def __init__(self, sink: JobEventSink, *, dropped: Counter, publish: Publish | None = None,
                 maxsize: int = 10_000) -> None:
        self.sink = sink
        self.dropped = dropped    # sdcwatch_events_dropped_total (by sink)
        self.publish = publish
        self._queue: asyncio.Queue[tuple[str, int | None, str, float, str]] = asyncio.Queue(maxsize=maxsize)
        self._lost: dict[str, int] = {}   # job -> the lowest step of a bad/clear event the full queue refused
        self._queued = 0                   # events queued so far (lost markers included)
        self._handed = 0                   # events handed to the sink so far (failed ones included)
        self._progress = asyncio.Event()   # set (and replaced) after each event handed over

    def start(self, background: Background) -> None:
        background.start(self._feed(), name="checkpoint-job-events")

    def put(self, job_id: str, step: int | None, kind: str, reason: str = "") -> None:
        now = time.time()
        if self._lost:
            self._queue_lost(now)
        try:
            if self._lost.get(job_id) is not None:
                raise asyncio.QueueFull   # behind this job's own lost events: keep the order
            self._queue.put_nowait((job_id, step, kind, now, reason))
            self._queued += 1
        except asyncio.QueueFull:
            self._overflow(job_id, step, kind)

    def mark(self) -> int:
        """The events queued so far: `handed(mark)` returns once each of them has been handed to the sink."""
        return self._queued

    async def handed(self, mark: int) -> None:
        """Until the first `mark` events queued have been handed to the sink (needs the feed started)."""
        while self._handed < mark:
            await self._progress.wait()

    def _overflow(self, job_id: str, step: int | None, kind: str) -> None:
        self.dropped.labels("checkpoint-job-events").inc()
        if kind == policy.VOTE_AGREED:
            why = f"the agreed replica vote at step {step} was lost: that step is not VERIFIED"
            from_step = step
        else:
            s = 0 if step is None else step
            self._lost[job_id] = min(self._lost.get(job_id, s), s)
            from_step = self._lost[job_id]
            why = (f"a {kind} event at step {step if step is not None else 'now'} was lost: no checkpoint from "
                   f"step {from_step} on is VERIFIED until the job rolls back or is cleared")
        if self.publish is not None:
            self.publish(ek.CHECKPOINT_VERIFICATION_WITHHELD, f"job/{job_id}",
                         f"job {job_id}: the checkpoint coordinator's queue is full; {why}",
                         {"job_id": job_id, "kind": kind, "step": step, "from_step": from_step})

    def _queue_lost(self, now: float) -> None:
        for job_id in list(self._lost):
            try:
                self._queue.put_nowait((job_id, self._lost[job_id], policy.EVENTS_LOST, now,
                                        "job events lost under overload"))
            except asyncio.QueueFull:
                return
            self._queued += 1
            del self._lost[job_id]

    async def _feed(self) -> None:
        while True:
            job_id, step, kind, now, reason = await self._queue.get()
            try:
                await self.sink.job_event(job_id, step, kind, now, reason)
            except Exception as exc:  # one failure never stops the feed
                log.error("checkpoint job event %s for %s failed: %s", kind, job_id, exc)
            self._handed += 1
            self._progress.set()
            self._progress = asyncio.Event()
            if self._lost:
                self._queue_lost(time.time())
