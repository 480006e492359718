"""The journal and the event bus under write failures, damaged files and many watchers (issue 20: Critical 1,
High 4, High 10, the torn-tail seq).

Failures are injected at the OS: the journal's file descriptor is pointed at /dev/full (every write fails
with ENOSPC) and back, so the journal's real write path fails as it does on a full disk."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import pytest

from daemon.events import EventBus
from daemon.journal import Journal, JournalWriteError
from daemon.step_log import StepLog
from proto.sdcwatch.v1 import agent_pb2 as pb
from sdcwatch import event_kinds as ek


@contextlib.contextmanager
def disk_full(journal: Journal) -> Iterator[None]:
    """Every write of `journal` fails with ENOSPC until the block ends (its fd is /dev/full meanwhile)."""
    fd = journal._fd  # noqa: SLF001 - the injection point: the real descriptor the journal writes to
    assert fd is not None
    saved = os.dup(fd)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, fd)
    os.close(full)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_failed_write_spends_its_seq_and_the_journal_recovers(tmp_path):
    j = Journal(tmp_path).open()
    j.append({"kind": "a"})
    j.append({"kind": "b"})
    with disk_full(j):
        with pytest.raises(JournalWriteError) as err:
            j.append({"kind": "lost"})
        assert err.value.lost == 1
    assert j.append({"kind": "c"}) == 4, "the failed record's seq is spent, never reused"
    j.close()
    assert [(r["seq"], r["kind"]) for r in lines(j.files()[-1])] == [(1, "a"), (2, "b"), (4, "c")]
    assert Journal(tmp_path).open().last_seq == 4


def test_a_buffered_journal_counts_every_line_a_failed_flush_drops(tmp_path):
    j = Journal(tmp_path, flush_each=False).open()
    for i in range(10):
        j.append_body(f'"i":{i}')
    j.flush()
    for i in range(7):
        j.append_body(f'"i":{10 + i}')
    with disk_full(j):
        with pytest.raises(JournalWriteError) as err:
            j.flush()
    assert err.value.lost == 7 and j.lost == 7
    j.append_body('"i":99')
    j.close()
    assert [r["i"] for r in lines(j.files()[-1])] == [*range(10), 99], "nothing half-written, nothing twice"


def test_the_step_log_counts_its_losses_exactly(tmp_path):
    steps = Journal(tmp_path, prefix="steps", flush_each=False).open()
    counted: list[int] = []
    log = StepLog(steps, on_lost=counted.append)
    req = pb.ReportStepRequest(job_id="j", rank=0, step=1, loss=1.0)
    with disk_full(steps):
        for _ in range(100):
            log.add(req, 1.0)
        log.drain()
    assert log.lost_total == 100 and sum(counted) == 100
    for _ in range(10):
        log.add(req, 2.0)
    log.close()
    assert len(lines(steps.files()[-1])) == 10 and log.lost_total == 100


def test_journal_lines_with_an_invalid_seq_are_skipped_and_reported(tmp_path):
    path = tmp_path / "events-000000000001.jsonl"
    path.write_text('{"seq":1,"kind":"a"}\n{"seq":2,"kind":"b"}\n{"seq":1e999}\n'
                    '{"seq":"3"}\n{"seq":123456789012345678901234567890}\n[1,2]\n')
    j = Journal(tmp_path).open()
    assert j.last_seq == 2
    assert j.repairs and "skipped 4 line(s)" in j.repairs[0]
    assert [r["seq"] for r in j.read_since(0)] == [1, 2]
    assert j.append({"kind": "c"}) == 3
    j.close()


def test_a_torn_tail_never_gives_its_seq_again(tmp_path):
    j = Journal(tmp_path).open()
    j.append({"kind": "a"})
    j.close()
    with open(j.files()[-1], "ab") as fh:
        fh.write(b'{"seq":7,"kind":"torn mid-wri')   # seq 2..7 spent by failed writes, then the torn one
    j2 = Journal(tmp_path).open()
    assert j2.last_seq == 7 and j2.append({"kind": "b"}) == 8
    j2.close()
    with open(j2.files()[-1], "ab") as fh:
        fh.write(b'{"seq":')   # torn inside the seq itself: the next one is spent
    assert Journal(tmp_path).open().last_seq == 9


async def _drain(events) -> list:
    return [e async for e in events]


async def _collect(bus: EventBus, since: int, n: int) -> list:
    out = []
    async for ev in bus.watch(since, follow=True):
        out.append(ev)
        if len(out) >= n:
            break
    return out


def test_the_bus_goes_on_through_a_failing_journal_and_tells_watchers_what_they_miss(tmp_path):
    async def main() -> None:
        journal = Journal(tmp_path).open()
        bus = EventBus(journal, ring_size=5)
        bus.bind_loop(asyncio.get_running_loop())
        bus.publish(ek.AGENT_READY, "node", "one")                       # seq 1
        follower = asyncio.ensure_future(_collect(bus, 1, 5))
        await asyncio.sleep(0)
        with disk_full(journal):
            for i in range(3):                                            # seq 2..4: not journaled, no raise
                assert bus.publish(ek.PROBE_HUNG, "probe/nvml", f"lost {i}") is not None
        bus.publish(ek.AGENT_READY, "node", "after")                     # seq 5, then the loss report (6)
        got = await asyncio.wait_for(follower, 10)
        assert [e.seq for e in got] == [2, 3, 4, 5, 6], "a follower misses nothing: memory had them"
        assert got[-1].kind == "journal.write_failed" and got[-1].details["count"] == 3
        assert bus.journal_lost == 3
        for i in range(5):   # 7..11: the ring (5) no longer holds 2..4
            bus.publish(ek.AGENT_READY, "node", f"more {i}")
        # a watcher that comes later reads the journal: it is told of the gap
        late = [e async for e in bus.watch(1, follow=False)]
        kinds = [(e.seq, e.kind) for e in late]
        assert kinds[0] == (4, "events.skipped") and late[0].details == {
            "from_seq": 2, "to_seq": 4, "count": 3, "reason": late[0].details["reason"]}
        assert [s for s, _ in kinds[1:]] == list(range(5, 12))
        await bus.close()
        journal.close()

    asyncio.run(main())


def test_a_watcher_behind_the_kept_files_is_told_what_was_rotated_away(tmp_path):
    async def main() -> None:
        journal = Journal(tmp_path, max_bytes=2048, keep_files=2).open()
        bus = EventBus(journal, ring_size=5)
        bus.bind_loop(asyncio.get_running_loop())
        for i in range(100):
            bus.publish(ek.AGENT_READY, "node", f"event {i} " + "x" * 40)
        got = [e async for e in bus.watch(3, follow=False)]
        assert got[0].kind == "events.skipped" and got[0].details["from_seq"] == 4
        assert [e.seq for e in got[1:]] == list(range(got[0].seq + 1, 101))
        from_oldest = [e async for e in bus.watch(0, follow=False)]
        assert from_oldest[0].kind == "agent.ready", "since_seq 0 means from the oldest kept: no gap"
        await bus.close()
        journal.close()

    asyncio.run(main())


def test_many_idle_watchers_are_woken_together_not_once_per_event(tmp_path):
    async def main() -> None:
        journal = Journal(tmp_path).open()
        bus = EventBus(journal)
        bus.bind_loop(asyncio.get_running_loop())
        watchers = [asyncio.ensure_future(_collect(bus, 0, 200)) for _ in range(400)]
        await asyncio.sleep(0.05)
        before = len(asyncio.all_tasks())
        for i in range(200):   # one burst of events from an RPC: no task per event per watcher
            bus.publish(ek.AGENT_READY, "node", f"e{i}")
        assert len(asyncio.all_tasks()) - before <= 1
        results = await asyncio.wait_for(asyncio.gather(*watchers), 60)
        assert all([e.seq for e in r] == list(range(1, 201)) for r in results)
        await bus.close()
        journal.close()

    asyncio.run(main())


def test_a_watcher_ahead_of_the_journal_is_answered_at_once_not_left_waiting(tmp_path):
    """Issue 20: after a restart whose journal lost its tail, a watcher resuming from a seq it saw before
    asked for seqs that do not exist yet (and would be given to other events): it waited forever, silently."""
    from daemon.events import WatchAhead

    async def main() -> None:
        journal = Journal(tmp_path).open()
        bus = EventBus(journal)
        bus.bind_loop(asyncio.get_running_loop())
        for i in range(5):
            bus.publish(ek.AGENT_READY, "node", f"event {i}")
        for follow in (True, False):
            with pytest.raises(WatchAhead) as err:
                await asyncio.wait_for(_drain(bus.watch(50, follow)), 5)
            assert err.value.last_seq == 5 and "since_seq 50 is ahead" in str(err.value)
        assert bus.watchers == 0
        assert await asyncio.wait_for(_drain(bus.watch(5, False)), 5) == [], "at the newest: nothing, no error"
        late = asyncio.ensure_future(_collect(bus, 5, 1))   # exactly the newest: waits for the next one
        await asyncio.sleep(0)
        bus.publish(ek.AGENT_READY, "node", "next")
        assert [e.seq for e in await asyncio.wait_for(late, 10)] == [6]
        await bus.close()
        journal.close()

    asyncio.run(main())
