"""The event bus takes catalogue members only, and folds repeats by the catalogue's rule (daemon/event_fold.py:
pure, time passed in; daemon/events.py: the shell that journals what it returns)."""
from __future__ import annotations

import asyncio
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from agent_harness import AgentProcess
from daemon.event_fold import REPEATS, Occurrence, RepeatFolder
from daemon.events import EventBus
from daemon.journal import Journal
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
from sdcwatch import event_kinds as ek
from sdcwatch.event_kinds import EventKind, SubjectKind, UnknownEventKind
from sdcwatch.types import Finding, Severity
from deadlines import scaled

W = ek.REPLICA_MISMATCH.fold_s


def occ(kind: EventKind = ek.REPLICA_MISMATCH, subject: str = "job/j1", message: str = "m",
        severity: Severity = Severity.CRITICAL, **details: object) -> Occurrence:
    return Occurrence(kind, severity, subject, message, details)


# ---- the pure folder ---------------------------------------------------------------------------------------------

def test_first_occurrence_at_once_repeats_counted_and_published_when_the_window_closes() -> None:
    f = RepeatFolder()
    first = occ(step=1)
    assert f.offer(first, 100.0) == [first]
    for i in range(2, 6):
        assert f.offer(occ(step=i, message=f"step {i}"), 100.0 + i) == []
    assert f.due(100.0 + W - 1) == []
    [summary] = f.due(100.0 + W)
    assert summary.kind is ek.REPLICA_MISMATCH and summary.subject == "job/j1"
    assert summary.details == {"step": 5, REPEATS: 4}
    assert summary.message.startswith("step 5") and "x4" in summary.message


def test_a_steady_stream_gives_one_event_per_window() -> None:
    f = RepeatFolder()
    published = []
    t = 0.0
    while t < 10 * W:
        published += f.offer(occ(), t)
        published += f.due(t)
        t += 1.0
    published += f.flush()
    assert 10 <= len(published) <= 11
    assert sum(p.details.get(REPEATS, 1) for p in published) == int(10 * W)


def test_a_window_that_folded_nothing_ends_and_the_next_occurrence_is_published_at_once() -> None:
    f = RepeatFolder()
    assert len(f.offer(occ(), 0.0)) == 1
    assert f.due(W) == [] and len(f) == 0
    assert len(f.offer(occ(), W + 5)) == 1


def test_the_next_occurrence_after_a_closed_window_brings_its_count_first() -> None:
    f = RepeatFolder()
    f.offer(occ(message="a"), 0.0)
    f.offer(occ(message="b"), 1.0)
    out = f.offer(occ(message="c"), 3 * W)   # no due() in between: the count comes with the next event
    assert [o.message.split(" ")[0] for o in out] == ["b", "c"]
    assert out[0].details[REPEATS] == 1 and REPEATS not in out[1].details


def test_subjects_and_kinds_fold_apart_and_unfolded_kinds_pass() -> None:
    f = RepeatFolder()
    assert len(f.offer(occ(subject="job/j1"), 0.0)) == 1
    assert len(f.offer(occ(subject="job/j2"), 0.0)) == 1
    assert len(f.offer(occ(kind=ek.LOSS_NONFINITE), 0.0)) == 1
    spike = occ(kind=ek.LOSS_SPIKE, severity=Severity.WARNING)
    assert ek.LOSS_SPIKE.fold_s == 0
    assert f.offer(spike, 0.0) == [spike] and f.offer(spike, 0.0) == [spike]


def test_the_worst_severity_of_the_folded_ones_is_kept() -> None:
    f = RepeatFolder()
    f.offer(occ(kind=ek.JOB_REPORTS_DROPPED, subject="job/j/rank/0", severity=Severity.WARNING), 0.0)
    f.offer(occ(kind=ek.JOB_REPORTS_DROPPED, subject="job/j/rank/0", severity=Severity.WARNING), 1.0)
    [summary] = f.flush()
    assert summary.severity is Severity.WARNING and summary.details[REPEATS] == 1


def test_open_windows_are_bounded() -> None:
    f = RepeatFolder(max_keys=3)
    for j in range(3):
        f.offer(occ(subject=f"job/j{j}"), 0.0)
        f.offer(occ(subject=f"job/j{j}"), 1.0)
    out = f.offer(occ(subject="job/new"), 2.0)   # the soonest-closing window is flushed early, not lost
    assert len(f) == 3
    assert [o.subject for o in out] == ["job/j0", "job/new"] and out[0].details[REPEATS] == 1


# ---- the bus -------------------------------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def clock() -> Clock:
    return Clock()


@pytest.fixture()
def bus(tmp_path: Path, clock: Clock):
    journal = Journal(tmp_path / "journal").open()
    yield EventBus(journal, host="n", clock=clock)
    journal.close()


def test_the_bus_refuses_anything_but_a_member(bus: EventBus) -> None:
    with pytest.raises(UnknownEventKind, match="not a member"):
        bus.publish("replica.mismatch", "job/j1", "m")   # type: ignore[arg-type]
    look_alike = EventKind("replica.mismatch", Severity.CRITICAL, (SubjectKind.JOB,), "a copy")
    with pytest.raises(UnknownEventKind):
        bus.publish(look_alike, "job/j1", "m")
    with ThreadPoolExecutor(1) as pool, pytest.raises(UnknownEventKind):   # refused in the caller's thread
        pool.submit(bus.publish, "agent.ready", "node", "m").result()   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="severity INFO not allowed"):
        bus.publish(ek.REPLICA_MISMATCH, "job/j1", "m", severity=Severity.INFO)
    with pytest.raises(ValueError, match="not a node subject"):
        bus.publish(ek.AGENT_READY, "gpu/GPU-1", "m")
    assert bus.last_seq == 0   # nothing was journaled


def test_the_journal_keeps_the_wire_strings(bus: EventBus) -> None:
    e = bus.publish(ek.GPU_STATE, "gpu/GPU-1", "to FAILED", {"to": "FAILED"}, severity=Severity.CRITICAL)
    assert e is not None and e.kind == "gpu.state" and e.severity is Severity.CRITICAL
    f = bus.publish_finding(Finding(ek.GRAD_NORM_SPIKE, Severity.WARNING, "job/j1", "spike"))
    assert f is not None
    recs = list(bus.journal.read_since(0, limit=10))
    assert [(r["kind"], r["severity"]) for r in recs] == [("gpu.state", "critical"), ("grad_norm.spike", "warning")]


def test_the_bus_folds_repeats_and_publishes_the_count_on_tick(bus: EventBus, clock: Clock) -> None:
    first = bus.publish(ek.REPLICA_MISMATCH, "job/j1", "step 1", {"step": 1})
    assert first is not None and first.occurrences == 1
    for step in range(2, 12):
        clock.t += 1
        assert bus.publish(ek.REPLICA_MISMATCH, "job/j1", f"step {step}", {"step": step}) is None
    assert bus.tick() == []
    clock.t = 1000.0 + W
    [summary] = bus.tick()
    assert summary.kind == "replica.mismatch" and summary.details[REPEATS] == 10 and summary.occurrences == 10
    assert summary.details["step"] == 11
    recs = list(bus.journal.read_since(0, limit=10))
    assert [r["details"].get(REPEATS) for r in recs] == [None, 10]


def test_pending_counts_are_flushed_at_shutdown(bus: EventBus) -> None:
    bus.publish(ek.LOSS_NONFINITE, "job/j1/rank/0", "nan")
    bus.publish(ek.LOSS_NONFINITE, "job/j1/rank/0", "nan again")
    [e] = bus.flush_folds()
    assert e.details[REPEATS] == 1 and bus.flush_folds() == []


def test_publish_from_another_thread_runs_on_the_loop(tmp_path: Path) -> None:
    async def scenario() -> None:
        journal = Journal(tmp_path / "j").open()
        b = EventBus(journal)
        b.bind_loop(asyncio.get_running_loop())
        await asyncio.to_thread(b.publish, ek.PROBE_HUNG, "probe/nvml", "hung", {"probe": "nvml"})
        deadline = asyncio.get_running_loop().time() + scaled(10)
        while b.last_seq < 1 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert [r["kind"] for r in journal.read_since(0, limit=5)] == ["probe.hung"]
        await b.close()
        journal.close()

    asyncio.run(scenario())


def test_publish_from_other_threads_reaches_watchers_in_seq_order(tmp_path: Path) -> None:
    """The checkpoint service's pools and the drainer call `publish` from their own threads while the loop
    runs. Four threads publishing at once, a watcher following: every event reaches it once, in seq order,
    and no `events.skipped` stands in for one (before, two threads' events could reach the ring out of seq
    order, and the watcher said the earlier one was lost: seen in the suite as events 10..10 skipped)."""
    async def scenario() -> None:
        journal = Journal(tmp_path / "j").open()
        b = EventBus(journal, ring_size=10_000)
        loop = asyncio.get_running_loop()
        b.bind_loop(loop)
        n_threads, per = 4, 200
        seen: list = []

        async def follow() -> None:
            async for e in b.watch(0, follow=True):
                seen.append(e)
                if len(seen) == n_threads * per or e.kind == "events.skipped":
                    return

        watcher = asyncio.create_task(follow())

        def burst(k: int) -> None:
            for i in range(per):
                b.publish(ek.JOB_STARTED, f"job/t{k}", f"event {i}", {"i": i})

        await asyncio.gather(*(asyncio.to_thread(burst, k) for k in range(n_threads)))
        await asyncio.wait_for(watcher, scaled(30))
        assert [e.kind for e in seen if e.kind == "events.skipped"] == []
        assert [e.seq for e in seen] == list(range(1, n_threads * per + 1))
        assert sorted((e.subject, e.details["i"]) for e in seen) == sorted(
            (f"job/t{k}", i) for k in range(n_threads) for i in range(per))
        await b.close()
        journal.close()

    asyncio.run(scenario())


# ---- the real agent -----------------------------------------------------------------------------------------------

def test_the_agent_folds_a_mismatch_on_every_step_and_counts_every_one(short_tmp: Path) -> None:
    """A replica mismatch on each of 6 steps: one event at once, the 5 repeats folded; at shutdown the count is
    journaled (repeats: 5), and /metrics counted all 6 occurrences once it was published."""
    agent = AgentProcess(short_tmp / "state").start()
    try:
        with grpc.insecure_channel(agent.target) as ch:
            stub = pb_grpc.AgentStub(ch)
            for step in range(1, 7):
                vote = pb.ReplicaVote(checked=True, agreed=False, replicas=2, method="all_disagreeing", step=step,
                                      suspects=[pb.SuspectRank(rank=0, host="elsewhere")])
                assert stub.ReportStep(pb.ReportStepRequest(job_id="fold-1", rank=0, world_size=2, step=step,
                                                            loss=1.0, vote=vote), timeout=10).accepted
            events = [e for e in stub.WatchEvents(pb.WatchEventsRequest(since_seq=0), timeout=10)
                      if e.kind == "replica.mismatch"]
        assert len(events) == 1   # the first at once; the window (60 s) is still open
        metrics = agent.runtime_info()["metrics"]
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'sdcwatch_job_replica_mismatches_total{job_id="fold-1"} 6.0' in text   # per step, not folded
        assert 'sdcwatch_events_total{kind="replica.mismatch",severity="critical"} 1.0' in text
    finally:
        agent.stop()
    journal = Journal(short_tmp / "state" / "journal")
    folded = [r for r in journal.read_since(0, limit=1000) if r["kind"] == "replica.mismatch"]
    assert [r["details"].get(REPEATS) for r in folded] == [None, 5]
    assert folded[1]["details"]["step"] == 6
