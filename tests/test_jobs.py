"""The job tracker, the one owner of per-job state: `report(req, now)` returns what the agent must do, or
None."""
from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path

from daemon.background import Background
from daemon.events import EventBus
from daemon.jobs import DIRECTIVE_TTL_S, MAJORITY_REPAIR_STEPS, JobTracker, ReportOutcome
from daemon.journal import Journal
from daemon.rollback import RollbackPlanner
from probes.loss_detector import RollbackPolicy
from sdcwatch import event_kinds as ek
from proto.sdcwatch.v1 import agent_pb2 as pb


def report(tracker: JobTracker, step: int, rank: int = 0, now: float = 1.0, job: str = "j", **kw: object):
    return tracker.report(pb.ReportStepRequest(job_id=job, rank=rank, world_size=1, step=step, **kw), now)


def directive(target: int) -> pb.Directive:
    return pb.Directive(kind=pb.Directive.KIND_ROLLBACK, target_step=target, skip_batches=5, event_seq=7)


def test_the_usual_report_needs_nothing() -> None:
    tracker = JobTracker()
    assert report(tracker, 1, loss=1.0) is not None, "a new job is announced"
    for step in range(2, 20):
        assert report(tracker, step, loss=1.0, grad_norm=0.5) is None
    assert tracker.jobs["j"].last_step == 19


def test_a_restore_is_announced_once_and_tells_the_checkpoints() -> None:
    tracker = JobTracker()
    for step in range(1, 11):
        report(tracker, step)
    out = report(tracker, 6)   # went back from 10 to 6: the job restored step 5
    assert out is not None
    assert [(f.kind, f.details["from_step"], f.details["restored_step"]) for f in out.findings] == [
        (ek.JOB_ROLLBACK, 10, 5)]
    assert out.job_events == [(5, "rollback", "the job restored step 5")]
    report(tracker, 7)
    out = report(tracker, 6, rank=0)   # the same restore seen again: said once
    assert out is None or (not out.findings and not out.job_events)
    assert report(tracker, 0) is None, "step 0 again is a fresh start, not a restore"


def test_a_critical_loss_event_asks_for_a_rollback_plan_only_when_rollback_is_on() -> None:
    for policy in (RollbackPolicy(), None):
        tracker = JobTracker(rollback=policy)
        report(tracker, 1, loss=1.0)
        out = report(tracker, 2, loss=math.nan)
        assert out is not None
        kinds = [f.kind for f in out.findings]
        assert ek.LOSS_NONFINITE in kinds
        assert (2, "nan") in [(s, k) for s, k, _ in out.job_events]
        if policy is None:
            assert out.rollbacks == []
        else:
            ((index, ev),) = out.rollbacks
            assert (out.findings[index].kind, out.findings[index].subject) == (ek.LOSS_NONFINITE, "job/j")
            assert ev.kind == "nonfinite" and ev.start_step == 2


def test_a_directive_goes_to_each_rank_once_until_it_expires() -> None:
    tracker = JobTracker()
    report(tracker, 20, rank=0)
    report(tracker, 20, rank=1)
    tracker.set_directive("j", directive(10), anomaly_start=18, now=100.0)
    assert report(tracker, 21, rank=0, now=101.0).directives == [directive(10)]
    out = report(tracker, 22, rank=0, now=102.0)
    assert out is None or out.directives == [], "rank 0 has it"
    assert report(tracker, 21, rank=1, now=103.0).directives == [directive(10)]
    tracker.set_directive("j", directive(12), anomaly_start=18, now=200.0)
    out = report(tracker, 23, rank=1, now=200.0 + DIRECTIVE_TTL_S + 1)
    assert out is None or out.directives == [], "too old: dropped"
    assert tracker.jobs["j"].directive is None
    tracker.set_directive("gone", directive(1), anomaly_start=2, now=1.0)   # an unknown job: nobody to tell
    assert "gone" not in tracker.jobs


def test_a_restore_to_before_the_anomaly_drops_the_directive() -> None:
    tracker = JobTracker()
    for step in range(1, 31):
        report(tracker, step)
    tracker.set_directive("j", directive(10), anomaly_start=25, now=1.0)
    out = report(tracker, 16)   # the job restored step 15 on its own (e.g. for a replica mismatch)
    assert out is not None and out.directives == []
    assert tracker.jobs["j"].directive is None


def test_eviction_forgets_all_of_a_jobs_state_in_one_place() -> None:
    tracker = JobTracker(max_jobs=2, idle_s=10.0)
    report(tracker, 1, job="a", now=1.0)
    report(tracker, 1, job="b", now=2.0)
    tracker.set_directive("a", directive(0), anomaly_start=1, now=2.0)
    out = report(tracker, 1, job="c", now=3.0)
    assert out is not None and out.evicted == ["a"]
    assert list(tracker.jobs) == ["b", "c"]
    out = report(tracker, 5, job="a", now=4.0)   # back: a new job, nothing of the old one left
    assert out is not None and out.evicted == ["b"]
    assert out.directives == [] and tracker.jobs["a"].rank_steps == {0: 5}
    assert tracker.expire(now=13.5) == ["c"] and list(tracker.jobs) == ["a"]   # idle for over 10 s


class Verified:
    """The checkpoint service's `verified_steps`, for a job whose VERIFIED steps are known."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def verified_steps(self, job_id: str) -> list[int]:
        return list(self.steps)


def _planning(tmp_path: Path) -> tuple[Journal, EventBus, Background, JobTracker]:
    """In a running loop: a journal, the bus on it, a Background for the planner, and a tracker whose job
    "j" reported a clean first step."""
    journal = Journal(tmp_path / "journal").open()
    bus = EventBus(journal, host="n0")
    bus.bind_loop(asyncio.get_running_loop())
    tracker = JobTracker(rollback=RollbackPolicy())
    report(tracker, 1, loss=1.0)
    return journal, bus, Background(), tracker


def test_the_rollback_planner_hands_the_directive_to_the_tracker(tmp_path: Path) -> None:
    async def run() -> tuple[list[tuple[str, dict]], JobTracker]:
        journal, bus, background, tracker = _planning(tmp_path)
        out = report(tracker, 2, loss=math.nan)
        assert out is not None
        (index, ev), = out.rollbacks
        event = bus.publish_finding(out.findings[index])
        assert event is not None
        for verified in ([], [1]):   # nothing to roll back to; then a VERIFIED step before the anomaly
            planner = RollbackPlanner(RollbackPolicy(), checkpoints=Verified(verified), jobs=tracker,
                                      publisher=bus, background=background)
            planner.request("j", ev, event.seq)
            while len(background):
                await asyncio.sleep(0.01)
        await background.cancel()
        journal.close()
        return [(e.kind, dict(e.details)) for e in bus.recent(0) or []], tracker

    events, tracker = asyncio.run(run())
    kinds = [k for k, _ in events]
    assert kinds == ["loss.nonfinite", "job.rollback_impossible", "job.rollback_directive"]
    assert events[-1][1]["target_step"] == 1 and events[-1][1]["cause_seq"] == 1
    pending = tracker.jobs["j"].directive
    # the directive's seq is its own announcing event's (job.rollback_directive, the third): fresh for each
    assert pending is not None and pending.directive.target_step == 1 and pending.directive.event_seq == 3
    assert pending.anomaly_start == 2


def test_every_directive_gets_a_fresh_seq_even_when_its_cause_was_folded(tmp_path: Path) -> None:
    """The ranks act on each directive seq once, in order (Monitor.agreed_directive): a directive planned for a
    cause that the bus folded into a repeat count (seq 0) used to go out with seq 0, which ranks that had
    taken any directive before never agree on (and which holds every later directive behind it). Each
    directive's seq is now its own announcing event's, increasing."""
    async def run() -> list[int]:
        journal, bus, background, tracker = _planning(tmp_path)
        seqs = []
        for step, cause_seq in ((2, 1), (10, 0)):         # the second cause folded: no seq of its own
            out = report(tracker, step, loss=math.nan)
            (_, ev), = out.rollbacks
            planner = RollbackPlanner(RollbackPolicy(), checkpoints=Verified([1, 5]), jobs=tracker,
                                      publisher=bus, background=background)
            planner.request("j", ev, cause_seq)
            while len(background):
                await asyncio.sleep(0.01)
            seqs.append(tracker.jobs["j"].directive.directive.event_seq)
            report(tracker, step + 1, loss=1.0)
        await background.cancel()
        journal.close()
        return seqs

    first, second = asyncio.run(run())
    assert 0 < first < second, (first, second)


def _excursion_run(tracker: JobTracker, straggler_lag: int) -> tuple[list, list]:
    """8 ranks, rank 7 `straggler_lag` steps behind the others: 200 steps of loss ~1.0, then a 40-step 10x
    excursion. Returns (the loss findings, the rollback requests)."""
    world, findings, rollbacks = 8, [], []
    for tick in range(240 + straggler_lag):
        for rank in range(world):
            step = tick - (straggler_lag if rank == world - 1 else 0)
            if step < 0 or step >= 240:
                continue
            loss = (1.0 + 0.01 * ((step * 7 + rank) % 5)) * (10.0 if step >= 200 else 1.0)
            out = tracker.report(pb.ReportStepRequest(job_id="j", rank=rank, world_size=world, step=step,
                                                      loss=loss), 1000.0 + tick)
            if out is not None:
                findings += [f for f in out.findings if f.kind.name.startswith("loss.")]
                rollbacks += out.rollbacks
    return findings, rollbacks


def test_a_straggler_does_not_reset_the_loss_detector() -> None:
    """Issue 20 High 6: one rank three steps behind turned a 40-step 10x excursion from CRITICAL + rollback
    into WARNING spikes (its late reports reset the detector)."""
    clean_findings, clean_rollbacks = _excursion_run(JobTracker(rollback=RollbackPolicy()), 0)
    assert clean_rollbacks, "without a straggler the excursion is CRITICAL and asks for a rollback"
    findings, rollbacks = _excursion_run(JobTracker(rollback=RollbackPolicy()), 3)
    assert any(f.severity.name == "CRITICAL" for f in findings), [f.message for f in findings]
    assert rollbacks, "the straggler must not turn the rollback into warnings"
    assert rollbacks[0][1].start_step == clean_rollbacks[0][1].start_step


def test_late_reports_count_as_dropped_in_one_folded_event_per_job() -> None:
    """Issue 20 High 5: every late report became its own per-rank `job.reports_dropped` warning. Now a late
    report (a step the detector already judged) counts as dropped; the event's subject is the job, so the
    bus folds a window's worth into one, and the details carry the running total."""
    tracker = JobTracker()
    subjects, totals = set(), []
    for step in range(20):
        for rank in range(4):
            s = step - 3 if rank == 3 else step   # rank 3 three steps behind: its reports are late
            if s < 0:
                continue
            out = tracker.report(pb.ReportStepRequest(job_id="j", rank=rank, world_size=4, step=s, loss=1.0,
                                                      dropped_reports=1 if (rank, step) == (1, 10) else 0), 1.0)
            for f in (out.findings if out is not None else []):
                if f.kind is ek.JOB_REPORTS_DROPPED:
                    subjects.add(f.subject)
                    totals.append(f.details["dropped_total"])
    assert subjects == {"job/j"}
    assert totals == sorted(totals) and totals[-1] == tracker.jobs["j"].dropped_reports
    assert tracker.jobs["j"].dropped_reports >= 15, "rank 3's late reports count as dropped"


def test_a_report_its_rank_gave_up_on_moves_nothing_but_keeps_its_vote() -> None:
    """Issue 20 High 5: reports the rank had given up on (deadline passed) were processed anyway."""
    tracker = JobTracker()
    report(tracker, 1, loss=1.0)
    late = pb.ReportStepRequest(job_id="j", rank=0, world_size=1, step=9, loss=1.0)
    assert tracker.report_late(late, 2.0) is None
    job = tracker.jobs["j"]
    assert (job.last_step, job.steps_seen) == (1, 1), "a late report moves nothing along"
    vote = pb.ReplicaVote(checked=True, agreed=False, replicas=2, step=8, method="all_disagreeing")
    vote.suspects.add(rank=0)
    out = tracker.report_late(pb.ReportStepRequest(job_id="j", rank=0, world_size=1, step=9, vote=vote), 2.0)
    assert out is not None and (8, "vote_mismatch") in [(s, k) for s, k, _ in out.job_events]
    assert [f.kind for f in out.findings] == [ek.REPLICA_MISMATCH]
    assert job.last_step == 1


def test_ranks_without_replicas_tell_the_checkpoints_their_checks_ran_clean() -> None:
    """Issue 18: with no replica vote, what vouches for VERIFIED is every rank's in-step checks at k or later."""
    tracker = JobTracker()

    def clean(step: int, rank: int) -> list:
        out = tracker.report(pb.ReportStepRequest(job_id="f", rank=rank, world_size=2, step=step,
                                                  fingerprint=[1, 2]), 1.0)
        return [e for e in (out.job_events if out else []) if e[1] == "checks_clean"]

    assert clean(1, 0) == [], "rank 1 has not checked step 1 yet"
    assert clean(1, 1) == [(1, "checks_clean", "")]
    assert clean(2, 1) == [] and clean(2, 0) == [(2, "checks_clean", "")]
    assert clean(3, 0) == [] and clean(1, 0) == [] and clean(3, 1) == [], "rank 0 went back: min is 1"
    assert clean(3, 0) == [(3, "checks_clean", "")]
    # a rank with a replica group is vouched for by its vote, never by checks_clean
    out = tracker.report(pb.ReportStepRequest(job_id="g", rank=0, world_size=1, step=1, fingerprint=[1],
                                              replica_group="world"), 1.0)
    assert not [e for e in out.job_events if e[1] == "checks_clean"]


def _vote(step: int, rank: int, agreed: bool) -> pb.ReportStepRequest:
    req = pb.ReportStepRequest(job_id="m", rank=rank, world_size=2, step=step + 1, replica_group="world")
    req.vote.checked, req.vote.agreed, req.vote.step, req.vote.replicas = True, agreed, step, 2
    req.vote.method = "majority" if agreed else "all_disagreeing"
    if not agreed:
        req.vote.suspects.add(rank=0, host="h", gpu_uuid="GPU-0")
        req.vote.suspects.add(rank=1, host="h", gpu_uuid="GPU-1")
    return req


def test_a_replica_mismatch_incident_asks_for_one_rollback_to_before_its_first_step(tmp_path: Path) -> None:
    """Issue 18 item 2: a mismatch yields a rollback directive (it never did), once per incident, to the newest
    VERIFIED checkpoint older than the first mismatching step, replaying the batches (skip 0)."""
    async def run() -> tuple[list, JobTracker, int]:
        journal = Journal(tmp_path / "journal").open()
        bus = EventBus(journal, host="n0")
        bus.bind_loop(asyncio.get_running_loop())
        background = Background()
        tracker = JobTracker(rollback=RollbackPolicy())
        planner = RollbackPlanner(RollbackPolicy(), checkpoints=Verified([50, 100]), jobs=tracker,
                                  publisher=bus, background=background)
        requests = 0
        for step in range(95, 130):
            for rank in (0, 1):
                out = tracker.report(_vote(step, rank, agreed=step < 100), float(step))
                published = [bus.publish_finding(f) for f in (out.findings if out else [])]
                for index, ev in (out.rollbacks if out else []):
                    requests += 1
                    event = published[index]
                    planner.request("m", ev, event.seq if event else 0)
        while len(background):
            await asyncio.sleep(0.01)
        await background.cancel()
        journal.close()
        return [(e.kind, dict(e.details)) for e in bus.recent(0) or []], tracker, requests

    events, tracker, requests = asyncio.run(run())
    assert requests == 1, "one incident, one plan"
    directives = [d for k, d in events if k == "job.rollback_directive"]
    assert len(directives) == 1 and directives[0]["target_step"] == 50 and directives[0]["skip_batches"] == 0
    mismatch = [d for k, d in events if k == "replica.mismatch"]
    assert len(mismatch) == 1, "repeats folded into the first event (the catalogue's fold_s)"
    # each rank is handed the directive once
    job = tracker.jobs["m"]
    assert job.directive is not None and job.directive.anomaly_start == 100
    got = [tracker.report(_vote(130, r, agreed=False), 200.0) for r in (0, 1, 0)]
    assert [len(o.directives) if o else 0 for o in got] == [1, 1, 0]
    # the job restores 50: the incident is closed; a new mismatch later is a new incident
    tracker.report(pb.ReportStepRequest(job_id="m", rank=0, world_size=2, step=51), 201.0)
    assert job.mismatch_from is None
    out = tracker.report(_vote(140, 0, agreed=False), 202.0)
    assert out is not None and len(out.rollbacks) == 1 and out.rollbacks[0][1].first_step == 140


def test_a_mismatch_whose_plan_found_no_rollback_is_planned_again_while_the_replicas_disagree(tmp_path: Path) -> None:
    """A plan that found no VERIFIED checkpoint before the mismatch (on a loaded agent the byte comparison
    that verifies it can come later) or no answer in time was never made again: the job ran on with every
    update vetoed and no directive (test_readme_loop, loaded). Now, while the replicas still disagree, a
    later vote plans again after 10 s, then 20 s, ...; the event says when; closing the incident resets it."""
    clock = [1000.0]

    async def run() -> tuple[list, JobTracker, list[float]]:
        journal = Journal(tmp_path / "journal").open()
        bus = EventBus(journal, host="n0")
        bus.bind_loop(asyncio.get_running_loop())
        background = Background()
        tracker = JobTracker(rollback=RollbackPolicy())
        verified = Verified([])
        planner = RollbackPlanner(RollbackPolicy(), checkpoints=verified, jobs=tracker, publisher=bus,
                                  background=background, clock=lambda: clock[0])
        asked: list[float] = []

        async def votes(steps: range, at: float) -> None:
            clock[0] = at
            for step in steps:
                for rank in (0, 1):
                    out = tracker.report(_vote(step, rank, agreed=step < 100), at)
                    published = [bus.publish_finding(f) for f in (out.findings if out else [])]
                    for index, ev in (out.rollbacks if out else []):
                        asked.append(at)
                        planner.request("m", ev, published[index].seq if published[index] else 0)
                while len(background):
                    await asyncio.sleep(0.01)

        await votes(range(95, 105), 1000.0)     # the plan at step 100: nothing VERIFIED before it
        await votes(range(105, 110), 1009.0)    # within 10 s: not again
        await votes(range(110, 112), 1011.0)    # planned again: still nothing
        await votes(range(112, 114), 1030.0)    # within the next 20 s: not again
        verified.steps = [50]                   # the comparison of step 50 is done
        await votes(range(114, 116), 1032.0)    # planned again: the directive
        await votes(range(116, 120), 2000.0)    # planned once, handed out: no more plans
        await background.cancel()
        journal.close()
        return [(e.kind, dict(e.details), e.message) for e in bus.recent(0) or []], tracker, asked

    events, tracker, asked = asyncio.run(run())
    assert asked == [1000.0, 1011.0, 1032.0], asked
    impossible = [(d, m) for k, d, m in events if k == "job.rollback_impossible"]
    assert [d["replan_in_s"] for d, _ in impossible] == [10.0, 20.0], impossible
    assert "planned again in 10s if the replicas still disagree" in impossible[0][1]
    directives = [d for k, d, _ in events if k == "job.rollback_directive"]
    assert len(directives) == 1 and directives[0]["target_step"] == 50 and directives[0]["skip_batches"] == 0
    job = tracker.jobs["m"]
    tracker.report(pb.ReportStepRequest(job_id="m", rank=0, world_size=2, step=51), 2001.0)   # restored
    assert job.mismatch_from is None and job.mismatch_plans == 0 and job.mismatch_retry_at == 0.0
    out = tracker.report(_vote(140, 0, agreed=False), 2002.0)
    assert out is not None and len(out.rollbacks) == 1, "a new incident plans at once"


def test_with_a_majority_the_ranks_get_one_update_to_repair_before_a_rollback_is_planned() -> None:
    def vote(tracker: JobTracker, step: int, agreed: bool) -> ReportOutcome | None:
        req = pb.ReportStepRequest(job_id="h", rank=0, world_size=3, step=step + 1, replica_group="world")
        req.vote.checked, req.vote.agreed, req.vote.step, req.vote.replicas = True, agreed, step, 3
        req.vote.method = "majority"
        if not agreed:
            req.vote.suspects.add(rank=2, host="h", gpu_uuid="GPU-2")
        return tracker.report(req, 1.0)

    repaired = JobTracker(rollback=RollbackPolicy())
    assert not vote(repaired, 5, False).rollbacks, "the next update may repair it in place"
    vote(repaired, 6, True)
    assert repaired.jobs["h"].mismatch_from is None, "agreeing again closes the incident"
    stuck = JobTracker(rollback=RollbackPolicy())
    for step in range(5, 5 + MAJORITY_REPAIR_STEPS + 1):   # the device gate repairs at update 5 + 5
        assert not vote(stuck, step, False).rollbacks, f"step {step}: the repair may still come"
    (_, inc), = vote(stuck, 5 + MAJORITY_REPAIR_STEPS + 1, False).rollbacks
    assert inc.first_step == 5 and inc.method == "majority"
    assert not vote(stuck, 5 + MAJORITY_REPAIR_STEPS + 2, False).rollbacks, "one plan per incident"


def test_the_agents_repair_grace_covers_the_device_gates_lag() -> None:
    """The device gate repairs the vote of step M at update M + vote_lag + 1 (checksums/replica_recovery.py);
    the agent must not plan a rollback for a vote before that (it does not import torch: its own constant)."""
    from checksums import monitor

    assert MAJORITY_REPAIR_STEPS == monitor._CUDA_SLOTS + 1


def test_a_new_mismatch_after_a_restore_is_a_new_incident_with_its_own_event_and_plan() -> None:
    """Issue 18: the rules' dedup state (votes, mismatches) must not swallow a second incident after a
    rollback, even at the same step numbers (the job runs them again). One incident: one critical event
    (its repeats folded into a count) and one plan; a new one after the restore: a new event at once (the
    bus folds replica.mismatch per incident) and a new plan; a straggler still reporting from before the
    restore is a repeat, not a new incident."""
    from daemon.event_fold import Occurrence, RepeatFolder

    tracker, folder = JobTracker(rollback=RollbackPolicy()), RepeatFolder()
    published: list[Occurrence] = []
    plans: list[int] = []
    checkpoint_events: list[tuple] = []

    def feed(req: pb.ReportStepRequest, now: float) -> None:
        out = tracker.report(req, now)
        if out is None:
            return
        for f in out.findings:
            published.extend(folder.offer(Occurrence(f.kind, f.severity, f.subject, f.message, f.details), now))
        plans.extend(inc.first_step for _, inc in out.rollbacks)
        checkpoint_events.extend((s, k) for s, k, _ in out.job_events)

    def mismatches() -> list[Occurrence]:
        return [o for o in published if o.kind == ek.REPLICA_MISMATCH]

    for step in range(110, 121):                       # incident 1: disagreeing from 115
        for rank in (0, 1):
            feed(_vote(step, rank, agreed=step < 115), 10.0 + step / 100)
    assert len(mismatches()) == 1 and plans == [115], "one incident: one event, one plan"
    assert (115, "vote_mismatch") in checkpoint_events
    feed(pb.ReportStepRequest(job_id="m", rank=0, world_size=2, step=111), 12.0)   # rank 0 restored 110
    feed(_vote(121, 1, agreed=False), 12.1)            # rank 1, still before its restore: a straggler
    assert len(mismatches()) == 1 and plans == [115], "a straggler's vote is a repeat"
    feed(pb.ReportStepRequest(job_id="m", rank=1, world_size=2, step=111), 12.2)
    checkpoint_events.clear()
    for step in range(111, 118):                       # the replay: a new fault, again from step 115
        for rank in (0, 1):
            feed(_vote(step, rank, agreed=step < 115), 13.0 + step / 100)
    assert len(mismatches()) == 2, "the new incident is its own event, within the fold window"
    assert mismatches()[1].details["incident"] == 2 and mismatches()[1].details["incident_from_step"] == 115
    assert plans == [115, 115], "and its own rollback plan"
    assert (114, "vote_agreed") in checkpoint_events and (115, "vote_mismatch") in checkpoint_events, \
        "the checkpoints hear the replayed steps' votes"
    summaries = folder.flush()
    folded = [o for o in summaries if o.kind == ek.REPLICA_MISMATCH]
    assert sorted(o.details["repeats"] for o in folded) == [2, 5], "the repeats after each first, per incident"


def test_a_plan_for_an_anomaly_the_job_has_rolled_back_over_is_dropped() -> None:
    """Issue 26: on a loaded agent a second loss anomaly (the recovery after a bad range, from step 225) was
    planned after the ranks had already restored step 100 for the first: its directive (restore 100 again,
    skip 184 good batches) is stale. One planned before the restore is kept (and dropped by the restore)."""
    tracker = JobTracker(rollback=RollbackPolicy())
    for step in (1, 2, 250):
        tracker.report(pb.ReportStepRequest(job_id="j", rank=0, world_size=1, step=step), float(step))
    directive = pb.Directive(kind=pb.Directive.KIND_ROLLBACK, target_step=100, skip_batches=184)
    at = tracker.restores("j")
    tracker.report(pb.ReportStepRequest(job_id="j", rank=0, world_size=1, step=101), 300.0)   # restored 100
    assert tracker.restores("j") == at + 1
    assert not tracker.set_directive("j", directive, 225, 301.0, restores_at=at)
    assert tracker.jobs["j"].directive is None
    # a new anomaly after the restore (seen with the restore counted), or one before the target: kept
    assert tracker.set_directive("j", directive, 225, 302.0, restores_at=tracker.restores("j"))
    tracker.jobs["j"].directive = None
    assert tracker.set_directive("j", pb.Directive(kind=pb.Directive.KIND_ROLLBACK, target_step=50), 225, 303.0,
                                 restores_at=at) is False   # 50 <= 100 < 225: the job went back before it too
    older = pb.Directive(kind=pb.Directive.KIND_ROLLBACK, target_step=120)
    assert tracker.set_directive("j", older, 225, 304.0, restores_at=at), "the job went back to before the target"
    assert tracker.set_directive("k", older, 225, 305.0) is False, "an unknown job: nobody to tell"


def _mismatch_then_plateau(loss_at: Callable[[int], float], mismatch_from: int, steps: int) -> tuple[list, list]:
    """Two replicas voting every step, agreeing until `mismatch_from`, then differing on (every update
    vetoed); each rank reports `loss_at(step)`. Returns (the loss findings, the rollback requests)."""
    tracker = JobTracker(rollback=RollbackPolicy())
    findings, rollbacks = [], []
    for step in range(steps):
        for rank in (0, 1):
            req = _vote(step, rank, agreed=step < mismatch_from)
            req.loss = loss_at(step + 1)
            out = tracker.report(req, float(step))
            if out is not None:
                findings += [f for f in out.findings if f.kind.name.startswith("loss.")]
                rollbacks += [ev for _, ev in out.rollbacks]
    return findings, rollbacks


def test_a_loss_plateau_under_an_open_replica_mismatch_plans_no_data_skipping_rollback() -> None:
    """Replicas differ from step 100 and every update is vetoed until the mismatch's rollback comes (late,
    on a loaded agent): the loss stops falling, which the detector calls a sustained rise. Its rollback would
    skip 200 batches of good data for a hardware fault (and could replace the mismatch's own directive, which
    replays them). One plan, the mismatch's; the loss event says why none for it."""
    def loss_at(step: int) -> float:
        return 2.0 * (min(step, 100) + 10) ** -0.8 * (1.0 + 0.01 * (step * 7 % 5))

    findings, rollbacks = _mismatch_then_plateau(loss_at, 100, 260)
    critical = [f for f in findings if f.severity.name == "CRITICAL"]
    assert critical, "the plateau is a sustained loss anomaly (the test needs one)"
    assert [type(ev).__name__ for ev in rollbacks] == ["MismatchIncident"], rollbacks
    assert all(f.details.get("rollback_deferred_to_mismatch_from") == 100 for f in critical)
    assert all("replica mismatch from step 100 is open" in f.message for f in critical)


def test_a_loss_anomaly_well_before_the_mismatch_is_the_datas_and_plans_its_rollback() -> None:
    """The loss went 10x from step 40 (bad data); replicas differ from step 150: the loss rollback (to
    before step 40, skipping the batches) is still planned, besides the mismatch's."""
    def loss_at(step: int) -> float:
        return (10.0 if step >= 40 else 1.0) * (1.0 + 0.01 * (step * 7 % 5))

    _, rollbacks = _mismatch_then_plateau(loss_at, 150, 200)
    kinds = [type(ev).__name__ for ev in rollbacks]
    assert "LossEvent" in kinds and "MismatchIncident" in kinds, kinds


def test_a_stop_goes_out_when_the_checkpoints_do_not_answer(tmp_path: Path) -> None:
    """A GPU that keeps computing wrong stops the job even when the checkpoint index does not answer in time
    (a rollback would be impossible then): target 0, the reason says the restart point is the user's to find."""
    import time

    from daemon.jobs import ComputeIncident

    class Slow:
        def verified_steps(self, job_id: str) -> list[int]:
            time.sleep(1.0)
            return [10]

    async def run() -> tuple[object, list[tuple[str, dict]]]:
        journal, bus, background, tracker = _planning(tmp_path)
        tracker.jobs["j"].stop_from = 20
        planner = RollbackPlanner(RollbackPolicy(), checkpoints=Slow(), jobs=tracker, publisher=bus,
                                  background=background, timeout_s=0.2)
        planner.request("j", ComputeIncident(20, 25, "persistent", "rank 1 on h GPU-1", ("GPU-1",)), 5)
        while len(background):
            await asyncio.sleep(0.01)
        await background.cancel()
        journal.close()
        return tracker.jobs["j"].directive, [(e.kind, dict(e.details)) for e in bus.recent(0) or []]

    pending, events = asyncio.run(run())
    assert pending is not None and pending.directive.kind == pb.Directive.KIND_STOP, pending
    assert pending.directive.target_step == 0 and "did not answer" in pending.directive.reason
    assert "sdcwatch ckpt ls --job j" in pending.directive.reason
    assert [k for k, _ in events if k.startswith("job.")] == ["job.stop_directive"], events


def test_a_carried_frozen_change_is_told_at_the_step_it_was_seen_and_once() -> None:
    """A frozen-parameter change from a lost report rides on a later one with `frozen_step`: the event, the
    GPU's evidence and the checkpoints' mark name that step (the checkpoints after it are not VERIFIED), and
    the same change sent again (a failed call the agent took) is not a second event."""
    tracker = JobTracker()
    for step in range(1, 8):
        report(tracker, step, gpu_uuid="GPU-1")
    out = report(tracker, 8, gpu_uuid="GPU-1", frozen_changed=["emb"], frozen_step=5)
    assert out is not None
    assert [(f.kind, f.details["step"]) for f in out.findings] == [(ek.SDC_FROZEN_CHANGED, 5)]
    assert out.job_events == [(5, "sdc", "frozen parameters changed on rank 0")]
    assert [(uuid, e.value) for uuid, _, e in out.evidence] == [("GPU-1", "5")]
    again = report(tracker, 9, gpu_uuid="GPU-1", frozen_changed=["emb"], frozen_step=5)
    assert again is None or not again.findings
    out = report(tracker, 10, gpu_uuid="GPU-1", frozen_changed=["emb"])   # a new change, at its own step
    assert out is not None and [f.details["step"] for f in out.findings] == [10]


def test_a_vote_whose_suspects_the_rank_bounded_says_how_many_there_were() -> None:
    tracker = JobTracker()
    report(tracker, 1)
    suspects = [pb.SuspectRank(rank=r, host="n1", gpu_uuid=f"GPU-{r}") for r in range(2)]
    vote = pb.ReplicaVote(checked=True, agreed=False, replicas=300, method="all_disagreeing", step=2,
                          suspects=suspects, suspect_count=300)
    out = report(tracker, 2, vote=vote)
    assert out is not None
    [f] = [f for f in out.findings if f.kind == ek.REPLICA_MISMATCH]
    assert f.details["suspect_count"] == 300 and f.message.endswith("and 298 more"), f.message


def test_each_replica_group_votes_for_itself_and_the_checkpoints_hear_the_jobs_verdict() -> None:
    """HSDP 2x2: groups "ranks:0,2" and "ranks:1,3" vote apart. One group's agreeing votes neither end the
    other's incident (it reopened every step: an event, a rollback plan and a false "repaired" each time) nor
    tell the checkpoints a step is checked while the other group has not agreed at it; "repaired" comes
    when the disagreeing group agrees again; a job's own uneven groups need every one of them too."""
    def vote(tracker: JobTracker, group: str, rank: int, step: int, agreed: bool,
             world: int = 4, replicas: int = 2) -> ReportOutcome:
        req = pb.ReportStepRequest(job_id="h", rank=rank, world_size=world, step=step + 1, replica_group=group)
        req.vote.checked, req.vote.agreed, req.vote.step, req.vote.replicas = True, agreed, step, replicas
        req.vote.method, req.vote.replica_group = "all_disagreeing", group
        if not agreed:
            req.vote.suspects.add(rank=rank, host="h", gpu_uuid=f"GPU-{rank}")
        return tracker.report(req, 1.0) or ReportOutcome()

    tracker = JobTracker(rollback=RollbackPolicy())
    assert vote(tracker, "ranks:0,2", 0, 1, True).job_events == [], "group ranks:1,3 has not voted on step 1"
    assert vote(tracker, "ranks:0,2", 2, 1, True).job_events == [], "the same group again"
    assert vote(tracker, "ranks:1,3", 1, 1, True).job_events == [(1, "vote_agreed", "")]
    out = vote(tracker, "ranks:1,3", 1, 2, False)
    assert [k for _, k, _ in out.job_events] == ["vote_mismatch"] and len(out.rollbacks) == 1
    assert [f.kind for f in out.findings] == [ek.REPLICA_MISMATCH]
    assert vote(tracker, "ranks:0,2", 0, 2, True).job_events == [], "step 2 is not checked: a group disagreed"
    for step in (3, 4):
        agreeing = vote(tracker, "ranks:0,2", 0, step, True)
        assert not agreeing.job_events and not agreeing.findings, step
        later = vote(tracker, "ranks:1,3", 1, step, False)
        assert [f.details["incident"] for f in later.findings] == [1], "one incident"
        assert not later.rollbacks, "one plan per incident"
    assert tracker.jobs["h"].mismatch_from == 2
    assert tracker.jobs["h"].reason == "replica mismatch at step 4 in replica group ranks:1,3"
    out = vote(tracker, "ranks:1,3", 3, 5, True)
    assert (5, "repaired") in [(s, k) for s, k, _ in out.job_events]
    assert tracker.jobs["h"].mismatch_from is None
    assert (5, "vote_agreed") not in [(s, k) for s, k, _ in out.job_events], "ranks:0,2 has not voted on 5"
    assert (5, "vote_agreed", "") in vote(tracker, "ranks:0,2", 0, 5, True).job_events
    # a job's own uneven groups (5 ranks: 3 + 2): the step is checked once both have agreed, whichever first
    uneven = JobTracker()
    assert vote(uneven, "ranks:3,4", 3, 1, True, world=5).job_events == [], "ranks 0-2 have not voted on 1"
    assert vote(uneven, "ranks:3,4", 4, 1, True, world=5).job_events == [], "the same group again"
    assert vote(uneven, "ranks:0,1,2", 0, 1, True, world=5, replicas=3).job_events == [(1, "vote_agreed", "")]
    assert vote(uneven, "ranks:0,1,2", 1, 2, True, world=5, replicas=3).job_events == []
    assert vote(uneven, "ranks:3,4", 3, 2, True, world=5).job_events == [(2, "vote_agreed", "")]
    # ranks outside every group (rank 4 has no replica): nothing vouches for it, so the vote never does
    lone = JobTracker()
    for group, rank in (("ranks:0,1", 0), ("ranks:2,3", 2)):
        assert vote(lone, group, rank, 1, True, world=5).job_events == [], group
    # both groups disagree, ranks:1,3 from step 2, ranks:0,2 from step 6; a rank of ranks:0,2 behind the
    # others then reports step 5's agreeing vote: no repair (its group disagreed after step 5)
    both = JobTracker()
    vote(both, "ranks:1,3", 1, 2, False)
    vote(both, "ranks:0,2", 0, 6, False)
    assert not [k for _, k, _ in vote(both, "ranks:0,2", 2, 5, True).job_events if k == "repaired"]
    assert both.jobs["h"].mismatch_groups == {"ranks:1,3": 2, "ranks:0,2": 6}
    assert not [k for _, k, _ in vote(both, "ranks:0,2", 0, 7, True).job_events if k == "repaired"], \
        "ranks:1,3 still disagrees"
    assert (8, "repaired") in [(s, k) for s, k, _ in vote(both, "ranks:1,3", 1, 8, True).job_events]
