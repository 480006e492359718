"""Compute-fault findings on ReportStep (issue 19): the job tracker turns them into compute.fault events naming
rank, host and GPU, evidence that makes the GPU SUSPECT and FAILED on a repeat, and bad events that keep the
job's checkpoints from VERIFIED; the rank's reporter puts them on the wire; bad ones are refused."""
from __future__ import annotations

from checksums.reporter import ComputeFinding, StepReport, to_request
from daemon.jobs import JobTracker, ReportOutcome
from daemon.validation import check_report_step
from proto.sdcwatch.v1 import agent_pb2 as pb
from sdcwatch import event_kinds as ek
from sdcwatch.types import State

GPU = "GPU-11111111-2222-3333-4444-555555555555"


def finding(step: int, *, detector: str = "stats", cause: str = "transient", dropped: bool = True,
            since: int = 0) -> pb.ComputeFinding:
    return pb.ComputeFinding(step=step, detector=detector, suspect=1, cause=cause, dropped=dropped,
                             detail="why", score=9.5, bucket=0, stat="norm", since_step=since or step,
                             faulty=[pb.SuspectRank(rank=1, host="node2", gpu_uuid=GPU)]
                             if cause not in ("data", "diverged") else [])


def report(tracker: JobTracker, step: int, rank: int, *found: pb.ComputeFinding):
    req = pb.ReportStepRequest(job_id="j", rank=rank, world_size=3, step=step, compute=list(found))
    assert check_report_step(req) is None
    return tracker.report(req, 1.0)


def test_a_dropped_transient_fault_is_an_event_and_suspect_evidence_but_not_a_bad_checkpoint_event():
    tracker = JobTracker()
    report(tracker, 1, 0)
    out = report(tracker, 40, 0, finding(40))
    faults = [f for f in out.findings if f.kind is ek.COMPUTE_FAULT]
    assert len(faults) == 1
    f = faults[0]
    assert f.subject == "job/j/rank/1" and f.details["faulty"] == [{"rank": 1, "host": "node2", "gpu_uuid": GPU}]
    assert f.details["cause"] == "transient" and f.details["dropped"] is True
    assert [(u, ev.implies) for u, _, ev in out.evidence] == [(GPU, State.SUSPECT)]
    assert out.job_events == []          # the update was masked: the weights never saw it
    assert tracker.jobs["j"].state is State.SUSPECT
    # every rank reports the same finding: one event, evidence again (the agent keeps its own GPUs)
    again = report(tracker, 40, 2, finding(40))
    assert not [f for f in again.findings if f.kind is ek.COMPUTE_FAULT]
    assert [ev.implies for _, _, ev in again.evidence] == [State.SUSPECT]


def test_a_repeat_on_the_same_gpu_makes_it_failed():
    tracker = JobTracker()
    report(tracker, 1, 0)
    report(tracker, 40, 0, finding(40))
    out = report(tracker, 45, 0, finding(45, detector="audit", cause="persistent", since=36))
    assert [ev.implies for _, _, ev in out.evidence] == [State.FAILED]
    assert "repeated" in out.evidence[0][2].reason


def test_an_audit_finding_withholds_verified_from_its_since_step():
    tracker = JobTracker()
    report(tracker, 1, 0)
    out = report(tracker, 50, 0, finding(50, detector="audit", cause="persistent", since=36))
    assert out.job_events == [(36, "sdc", out.job_events[0][2])]
    assert "rank 1" in out.job_events[0][2]
    out = report(tracker, 60, 0, finding(60, cause="unresolved"))
    assert out.job_events and out.job_events[0][:2] == (60, "sdc")


def test_a_cleared_suspicion_is_an_info_event_only():
    tracker = JobTracker()
    report(tracker, 1, 0)
    out = report(tracker, 30, 0, finding(30, cause="data", dropped=False))
    assert [f.kind for f in out.findings] == [ek.COMPUTE_CLEARED]
    assert out.evidence == [] and out.job_events == []
    assert tracker.jobs["j"].state is State.HEALTHY


def test_replicas_that_diverged_name_no_gpu_but_keep_the_checkpoints_from_verified():
    """`diverged` (HSDP: one replica's ranks replay alike and unlike the rest, its weights changed by a bit
    flip): a warning on the job, no GPU evidence however often it repeats, no stop asked, and the job's
    checkpoints from that step not VERIFIED (they would hold replicas that differ)."""
    tracker = JobTracker()
    report(tracker, 1, 0)
    for step in (41, 42, 43):
        out = report(tracker, step, 0, finding(step, detector="nonfinite", cause="diverged"))
        assert [f.kind for f in out.findings] == [ek.COMPUTE_DIVERGED]
        assert out.findings[0].subject == "job/j" and out.findings[0].details["faulty"] == []
        assert out.evidence == [] and out.rollbacks == []
        assert out.job_events == [(step, "diverged", "compute check: the replicas' weights differ")]
    assert tracker.jobs["j"].state is State.SUSPECT and "replicas' weights differ" in tracker.jobs["j"].reason


def test_a_diverged_step_that_a_repair_in_place_covered_blocks_no_checkpoint():
    """The vote of step 40 disagrees (3 replicas), the odd replica is repaired in place and the vote of 41
    agrees ("repaired" at 41); a rank's compute finding `diverged` at 41 heard after that is the same incident,
    its update dropped: the warning stays, but no job event blocks the checkpoints from 41. One at 44, or one
    at 41 after a restore to 30 (the weights the repair left are gone), still does."""
    def vote(step: int, agreed: bool, rank: int = 0) -> ReportOutcome:
        req = pb.ReportStepRequest(job_id="j", rank=rank, world_size=3, step=step + 1, replica_group="world")
        req.vote.checked, req.vote.agreed, req.vote.step, req.vote.replicas = True, agreed, step, 3
        req.vote.method = "majority"
        if not agreed:
            req.vote.suspects.add(rank=2, host="h", gpu_uuid=GPU)
        out = tracker.report(req, 1.0)
        assert out is not None
        return out

    tracker = JobTracker()
    vote(39, True)
    vote(40, False)
    assert (41, "repaired") in [(s, k) for s, k, _ in vote(41, True).job_events]
    job = tracker.jobs["j"]
    assert job.state is State.SUSPECT and job.reason == ("replicas differed from step 40, repaired in place: "
                                                         "they agree again from step 41"), job.reason
    out = report(tracker, 42, 0, finding(41, detector="nonfinite", cause="diverged"))
    assert [f.kind for f in out.findings] == [ek.COMPUTE_DIVERGED] and out.job_events == [], out.job_events
    assert "repaired in place" in job.reason, "the covered finding leaves the repair's reason"
    out = report(tracker, 45, 0, finding(44, detector="nonfinite", cause="diverged"))
    assert [k for _, k, _ in out.job_events] == ["diverged"]
    report(tracker, 31, 0)                              # rank 0 restored step 30 (a rollback)
    out = report(tracker, 42, 0, finding(41, detector="nonfinite", cause="diverged"))
    assert [k for _, k, _ in out.job_events] == ["diverged"], "after a restore the repair covers nothing"


def test_the_reporter_puts_findings_on_the_wire():
    f = ComputeFinding(step=7, detector="audit", suspect=2, cause="persistent", faulty=(2,), dropped=True,
                       detail="d", score=0.0, bucket=-1, stat="", where=((2, "node3", GPU),), since_step=3)
    req = to_request(StepReport(job_id="j", rank=0, world_size=3, step=7, compute=(f,)))
    assert check_report_step(req) is None
    (pf,) = req.compute
    assert (pf.step, pf.detector, pf.suspect, pf.cause, pf.since_step) == (7, "audit", 2, "persistent", 3)
    assert [(s.rank, s.host, s.gpu_uuid) for s in pf.faulty] == [(2, "node3", GPU)]


def test_every_statistic_a_verdict_can_name_passes_the_agents_check():
    """The statistic a verdict names (`StatsVerdict.stat`, one of `deviations`' columns) travels in the finding;
    the agent refuses a `stat` longer than 16 characters, so each name must fit."""
    from checksums.grad_checks import STAT_NAMES

    assert len(STAT_NAMES) == 4
    for name in STAT_NAMES:
        f = ComputeFinding(step=7, detector="stats", suspect=2, cause="transient", faulty=(2,), dropped=True,
                           detail="d", score=4.2, bucket=3, stat=name, where=((2, "node3", GPU),), since_step=7)
        req = to_request(StepReport(job_id="j", rank=0, world_size=3, step=7, compute=(f,)))
        assert check_report_step(req) is None, name
        assert req.compute[0].stat == name


def test_bad_findings_are_refused_with_the_reason():
    def bad(**kw: object) -> str | None:
        base: dict[str, object] = {"step": 1, "detector": "stats", "suspect": 0, "cause": "transient"}
        base.update(kw)
        return check_report_step(pb.ReportStepRequest(job_id="j", rank=0, world_size=2, step=1,
                                                      compute=[pb.ComputeFinding(**base)]))
    assert "compute.detector" in bad(detector="guess")
    assert "compute.cause" in bad(cause="gremlins")
    assert "suspect" in bad(suspect=5)
    assert "faulty rank 7" in bad(faulty=[pb.SuspectRank(rank=7)])
    assert "gpu_uuid" in bad(faulty=[pb.SuspectRank(rank=1, gpu_uuid="nope")])


def test_the_replay_mode_reaches_the_job_status():
    tracker = JobTracker()
    req = pb.ReportStepRequest(job_id="j", rank=0, world_size=3, step=1, compute_checks="bounded: why")
    assert check_report_step(req) is None
    tracker.report(req, 1.0)
    report(tracker, 2, 0)                       # a report without it keeps what was said
    assert tracker.jobs["j"].compute_checks == "bounded: why"
    assert "compute_checks" in (check_report_step(pb.ReportStepRequest(
        job_id="j", rank=0, world_size=3, step=3, compute_checks="x" * 500)) or "")
    wire = to_request(StepReport(job_id="j", rank=0, world_size=3, step=1, compute_checks="exact"))
    assert wire.compute_checks == "exact"


def test_unreproducible_replays_are_a_warning_once_per_job():
    """The ranks' replays do not reproduce their steps (a GradScaler not passed, ...): no GPU is named on a
    replay, so the job's owner must hear it: one compute.unreproducible warning with the reason, not one a
    report or a rank."""
    tracker = JobTracker()
    why = ("unreproducible: the step's gradient is 65536x its replay's: a loss scale (pass scaler=) or a "
           "division")
    said = []
    for step, rank in ((1, 0), (1, 1), (2, 0), (3, 2)):
        req = pb.ReportStepRequest(job_id="j", rank=rank, world_size=3, step=step, compute_checks=why)
        assert check_report_step(req) is None
        out = tracker.report(req, 1.0)
        said += [f for f in (out.findings if out else []) if f.kind is ek.COMPUTE_UNREPRODUCIBLE]
    assert len(said) == 1 and said[0].severity.name == "WARNING" and said[0].subject == "job/j", said
    assert "65536x" in said[0].message and said[0].details["reason"] == why
    assert tracker.jobs["j"].compute_checks == why


def test_an_unresolved_finding_naming_two_ranks_makes_both_suspect_never_failed():
    """Two ranks, a persistent fault without a third witness: the gate names both; the agent suspects both
    GPUs on every repeat but fails neither (one of them is fine)."""
    tracker = JobTracker()
    report(tracker, 1, 0)
    other = "GPU-99999999-2222-3333-4444-555555555555"
    for step in (40, 41, 42):
        f = pb.ComputeFinding(step=step, detector="stats", suspect=1, cause="unresolved", dropped=True,
                              detail="why", since_step=step,
                              faulty=[pb.SuspectRank(rank=0, host="node1", gpu_uuid=other),
                                      pb.SuspectRank(rank=1, host="node2", gpu_uuid=GPU)])
        out = report(tracker, step, 0, f)
        assert sorted((u, ev.implies) for u, _, ev in out.evidence) == sorted(
            [(GPU, State.SUSPECT), (other, State.SUSPECT)])


def test_an_unresolved_finding_naming_one_rank_never_makes_its_gpu_failed():
    """Replays with no majority (3+ ranks that each recompute differently, in the rounding-aware bound) name
    the suspect `unresolved`: SUSPECT on every repeat, never FAILED; a resolved repeat on the same GPU still
    fails it. (HSDP replicas that differ split by replica: `diverged`, nobody named, above.)"""
    tracker = JobTracker()
    report(tracker, 1, 0)
    for step in (40, 41, 42):
        out = report(tracker, step, 0, finding(step, cause="unresolved"))
        assert [(u, ev.implies) for u, _, ev in out.evidence] == [(GPU, State.SUSPECT)], step
    out = report(tracker, 43, 0, finding(43, cause="transient"))
    assert [ev.implies for _, _, ev in out.evidence] == [State.SUSPECT]
    out = report(tracker, 44, 0, finding(44, cause="persistent"))
    assert [ev.implies for _, _, ev in out.evidence] == [State.FAILED]


def test_a_tensor_parallel_groups_finding_makes_its_gpus_suspect_never_failed_and_a_persistent_one_stops():
    """FSDP2 with tensor parallelism: the replays name a tp group, not which of its GPUs (`one_of`). Every GPU
    of the group is SUSPECT on each repeat, none FAILED (one of them is fine); the event says "one of"; a
    persistent fault still asks the job to stop (a GPU of the group keeps computing wrong), and the finding
    crosses the wire from the rank's reporter with its flag."""
    tracker = JobTracker()
    report(tracker, 1, 0)
    other = "GPU-99999999-2222-3333-4444-555555555555"
    group = [pb.SuspectRank(rank=1, host="node2", gpu_uuid=other),
             pb.SuspectRank(rank=2, host="node2", gpu_uuid=GPU)]
    for step in (40, 41):
        out = report(tracker, step, 0, pb.ComputeFinding(step=step, detector="stats", suspect=1,
                                                          cause="transient", dropped=True, detail="why",
                                                          since_step=step, faulty=group, one_of=True))
        assert sorted((u, ev.implies) for u, _, ev in out.evidence) == sorted(
            [(GPU, State.SUSPECT), (other, State.SUSPECT)]), step
        [ev] = [f for f in out.findings if f.kind is ek.COMPUTE_FAULT]
        assert "one of rank 1 on node2" in ev.message and ev.details["one_of"] is True, ev
        assert not _stops(out)                       # a transient, again: no GPU known to repeat
    out = report(tracker, 50, 0, pb.ComputeFinding(step=50, detector="audit", suspect=1, cause="persistent",
                                                   dropped=True, detail="why", since_step=45, faulty=group,
                                                   one_of=True))
    assert sorted(ev.implies for _, _, ev in out.evidence) == [State.SUSPECT, State.SUSPECT]
    [inc] = _stops(out)
    assert inc.cause == "persistent" and inc.first_step == 45 and set(inc.gpus) == {GPU, other}
    f = ComputeFinding(step=7, detector="stats", suspect=2, cause="transient", faulty=(2, 3), dropped=True,
                       detail="tensor-parallel group [2, 3]", where=((2, "node2", other), (3, "node2", GPU)),
                       one_of=True)
    req = to_request(StepReport(job_id="j", rank=0, world_size=4, step=7, compute=(f,)))
    assert check_report_step(req) is None
    assert req.compute[0].one_of and [s.rank for s in req.compute[0].faulty] == [2, 3]


def _stops(out) -> list:
    from daemon.jobs import ComputeIncident
    return [ev for _, ev in (out.rollbacks if out is not None else []) if isinstance(ev, ComputeIncident)]


def test_a_gpu_that_keeps_computing_wrong_asks_the_job_to_stop_once():
    """A persistent fault (the GPU's replay repeats it) asks for a STOP plan at once, from the finding's
    since_step; every rank reports it, the plan is asked once per incident; after the job went back before it
    (its restart), a new persistent fault is a new incident."""
    tracker = JobTracker()
    report(tracker, 1, 0)
    out = report(tracker, 50, 0, finding(50, detector="audit", cause="persistent", since=36))
    [inc] = _stops(out)
    assert (inc.first_step, inc.step, inc.cause, inc.gpus) == (36, 50, "persistent", (GPU,))
    assert "rank 1 on node2" in inc.who and GPU in inc.who
    assert out.rollbacks[0][0] == next(i for i, f in enumerate(out.findings) if f.kind is ek.COMPUTE_FAULT)
    assert not _stops(report(tracker, 50, 2, finding(50, detector="audit", cause="persistent", since=36)))
    assert not _stops(report(tracker, 51, 0, finding(51, cause="persistent")))      # the same incident
    assert tracker.stop_open("j", 36)
    report(tracker, 52, 0)
    report(tracker, 31, 0)                                                         # restarted from step 30
    assert not tracker.stop_open("j", 36)
    [again] = _stops(report(tracker, 40, 0, finding(40, cause="persistent")))
    assert again.first_step == 40


def test_a_second_faulty_step_on_one_gpu_stops_the_job_a_single_transient_or_unresolved_does_not():
    tracker = JobTracker()
    report(tracker, 1, 0)
    assert not _stops(report(tracker, 40, 0, finding(40)))                           # one transient: dropped
    for step in (41, 42):                                                          # unresolved: never
        assert not _stops(report(tracker, step, 0, finding(step, cause="unresolved")))
    [inc] = _stops(report(tracker, 45, 0, finding(45)))                              # the same GPU again
    assert inc.cause == "repeated transient" and inc.first_step == 45
    off = JobTracker(compute_stop=False)
    report(off, 1, 0)
    assert not _stops(report(off, 50, 0, finding(50, cause="persistent")))


def test_status_shows_each_jobs_compute_mode():
    """`sdcwatch status` shows the mode the ranks reported, so on-call sees a job whose replays fell to the
    rounding bound, and why, without --json."""
    from daemon.cli import format_status
    st = pb.GetStatusResponse(hostname="n1")
    st.jobs.add(job_id="j1", ranks=[0, 1], compute_checks="bounded: replays differ under "
                "use_deterministic_algorithms(warn_only=True): set warn_only=False; norms within 1e-3")
    st.jobs.add(job_id="j2", ranks=[0, 1], compute_checks="exact")
    st.jobs.add(job_id="j3", ranks=[0])
    out = format_status(st)
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("j")}
    assert "COMPUTE" in out and lines["j1"].rstrip().endswith("bounded"), out
    assert lines["j2"].rstrip().endswith("exact") and lines["j3"].rstrip().endswith("-"), lines
    # the reason on its own line, whole: the table as narrow as without it
    assert "  j1 compute checks bounded: replays differ under use_deterministic_algorithms(warn_only=True): " \
           "set warn_only=False; norms within 1e-3" in out.splitlines(), out
    assert max(len(line) for line in out.splitlines() if line.startswith(("JOB", "j"))) <= 100, out
