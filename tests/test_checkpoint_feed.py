"""Issue 20 High 5: events VERIFIED depends on were dropped before the checkpoint coordinator when its queue
was full (3,726 replica-vote events in the soak). Now a lost bad event withholds VERIFIED from its step (an
`events_lost` bad event queued as soon as there is room, in order) and every loss is said in an event."""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from checkpoint import policy
from daemon.background import Background
from daemon.checkpoint_feed import CheckpointFeed
from sdcwatch import event_kinds as ek


class Sink:
    def __init__(self) -> None:
        self.got: list[tuple[str, int | None, str]] = []

    async def job_event(self, job_id: str, step: int | None, kind: str, now: float, reason: str = "") -> None:
        self.got.append((job_id, step, kind))


def test_a_full_queue_withholds_verified_and_says_so() -> None:
    async def scenario() -> tuple[list, list, float]:
        sink, said = Sink(), []
        dropped = Counter("dropped", "d", ["sink"], registry=CollectorRegistry())
        feed = CheckpointFeed(sink, dropped=dropped, maxsize=2,
                              publish=lambda kind, subject, message, details=None: said.append((kind, details)))
        feed.put("j", 1, "vote_agreed")
        feed.put("j", 2, "vote_agreed")
        feed.put("j", 5, "nan")              # full: lost, remembered as the job's lowest lost step
        feed.put("j", 3, "vote_mismatch")    # full: lost, step 3 is lower
        feed.put("j", 6, "vote_agreed")      # behind the job's lost events: dropped, its step never VERIFIED
        background = Background()
        feed.start(background)
        for _ in range(200):
            await asyncio.sleep(0)
            if len(sink.got) >= 3:
                break
        feed.put("j", 7, "vote_agreed")      # room again: queued after the lost marker
        for _ in range(200):
            await asyncio.sleep(0)
            if len(sink.got) >= 4:
                break
        await background.cancel()
        return sink.got, said, dropped.labels("checkpoint-job-events")._value.get()

    got, said, dropped = asyncio.run(scenario())
    assert got == [("j", 1, "vote_agreed"), ("j", 2, "vote_agreed"), ("j", 3, policy.EVENTS_LOST),
                   ("j", 7, "vote_agreed")]
    assert dropped == 3
    assert [k for k, _ in said] == [ek.CHECKPOINT_VERIFICATION_WITHHELD] * 3
    assert [d["from_step"] for _, d in said] == [5, 3, 6]


def test_events_lost_blocks_verified_from_its_step() -> None:
    assert policy.EVENTS_LOST in policy.BAD_KINDS
    assert policy.verified_steps([1, 4], {1: "agreed", 4: "agreed"}, 4, [3]) == {1}


def test_handed_waits_for_the_events_queued_before_the_mark() -> None:
    """Issue 26: the rollback planner read the VERIFIED checkpoints while a loaded agent's feed still held the
    votes that verify the one before the anomaly (job.rollback_impossible). It now waits on `handed(mark)`."""
    async def scenario() -> list[tuple[str, int | None, str]]:
        gate = asyncio.Event()

        class Slow(Sink):
            async def job_event(self, job_id: str, step: int | None, kind: str, now: float,
                                reason: str = "") -> None:
                await gate.wait()
                await super().job_event(job_id, step, kind, now, reason)

        sink = Slow()
        feed = CheckpointFeed(sink, dropped=Counter("dropped", "d", ["sink"], registry=CollectorRegistry()))
        background = Background()
        feed.start(background)
        feed.put("j", 50, "vote_agreed")
        feed.put("j", 100, "vote_agreed")
        mark = feed.mark()
        feed.put("j", 150, "vote_agreed")   # after the mark: not waited for
        waiter = asyncio.ensure_future(feed.handed(mark))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not waiter.done() and sink.got == []
        seen_at_wake: list[list] = []
        waiter.add_done_callback(lambda _: seen_at_wake.append(list(sink.got)))
        gate.set()
        await asyncio.wait_for(waiter, 5)
        await feed.handed(0)                 # nothing to wait for
        await background.cancel()
        return seen_at_wake[0]

    got = asyncio.run(scenario())
    assert got[:2] == [("j", 50, "vote_agreed"), ("j", 100, "vote_agreed")]
