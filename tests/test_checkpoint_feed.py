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
