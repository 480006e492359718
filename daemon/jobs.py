"""Per-job state built from the ranks' ReportStep calls. Pure: no I/O, `now` passed in.

`JobTracker` is the one owner of what the agent knows about a job (`JobState`): its ranks and steps, the
rules' dedup state (votes, non-finite values, frozen parameters), its loss detector (`daemon.job_loss`), the
steps each rank reported (a step that goes backwards is a restore) and a pending rollback directive.

`JobTracker.report(req, now)` returns what the agent must do (`ReportOutcome`): findings to journal, events
for the checkpoint coordinator, evidence to attach to local GPUs, loss anomalies to plan a rollback for, the
directives for the reporting rank, a job it evicted; or None, the usual case, when a report only moves the
job along. A critical loss event becomes a directive in two steps: the outcome asks for a rollback plan
(that needs the VERIFIED checkpoints: I/O, daemon/rollback.py), whose directive comes back through
`set_directive`; each rank is then handed it once, in a later report's outcome.

Memory is bounded: at most `max_jobs` jobs (least recently seen evicted, or idle for `idle_s`: `expire`),
a bounded set of ranks per job, and bounded dedup state.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable
from math import isfinite

from daemon.job_loss import JobLoss
from probes.loss_detector import LossDetectorConfig, LossEvent, RollbackPolicy
from sdcwatch import event_kinds as ek
from sdcwatch.types import Evidence, Finding, Severity, State
from proto.sdcwatch.v1 import agent_pb2 as pb

DIRECTIVE_TTL_S = 600.0   # a rollback directive not handed to a rank within this long is dropped
# With a majority (3+ replicas) the ranks repair a mismatch in place (checksums/replica_recovery.py): the
# device gate acts on the vote of step M once every replica has read it, at the update of step M + 5 (the
# Monitor's ring of 4 in-flight steps, checksums.monitor._CUDA_SLOTS, + 1), so votes up to step M + 4 may
# still disagree. A vote after that disagreeing means the repair failed: the agent plans a rollback.
MAJORITY_REPAIR_STEPS = 5
# steps whose agreeing groups are counted at once (HSDP: the groups report apart, a few steps at most); each
# group kept as its name's hash (a job of 8,192 two-replica groups: ~30 MB at worst, not its names)
AGREED_STEPS_KEPT = 128
# A mismatch incident whose plan found no rollback is planned again while its replicas still disagree: first
# this long after, doubling up to the maximum (JobTracker.mismatch_unplanned)
MISMATCH_REPLAN_S = 10.0
MISMATCH_REPLAN_MAX_S = 300.0


@dataclasses.dataclass(slots=True)
class PendingDirective:
    """A rollback directive for a job: handed to each rank once, in its next report's reply."""
    directive: pb.Directive
    created: float
    anomaly_start: int                       # the step the anomaly began at
    delivered: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True, slots=True)
class MismatchIncident:
    """Replicas disagreed from `first_step` on (one incident: open until the job restores a step before it).
    The rollback planner turns it into a directive to the newest VERIFIED checkpoint older than `first_step`,
    replaying the batches since (a hardware fault, not bad data: nothing to skip)."""
    first_step: int
    method: str       # the vote's: "all_disagreeing" (two replicas, or no majority), or "majority"
    replicas: int


@dataclasses.dataclass(frozen=True, slots=True)
class ComputeIncident:
    """A GPU of the job keeps computing wrong: a `persistent` compute fault (its replay repeats its wrong
    gradient while the other ranks agree on another), or compute faults on two steps. Neither dropping the
    job's updates (a persistent fault the statistics see gets every step dropped: no progress) nor a
    rollback (the same GPU would compute wrong again) helps, so the rollback planner turns it into a STOP
    directive naming the newest VERIFIED checkpoint older than `first_step` to restart from, without the
    GPU (daemon/rollback.py). One per job until the job goes back before `first_step` (its restart)."""
    first_step: int       # the first step whose update may carry the fault (the finding's since_step)
    step: int             # the finding's step
    cause: str            # persistent, or the repeat's cause
    who: str              # the faulty rank(s): rank, host and GPU
    gpus: tuple[str, ...]


@dataclasses.dataclass(slots=True)
class JobState:
    job_id: str
    first_seen: float
    last_report: float = 0.0
    last_step: int = -1
    steps_seen: int = 0
    dropped_reports: int = 0
    checks_run: dict[int, int] = dataclasses.field(default_factory=dict)   # rank -> checks
    ranks: set[int] = dataclasses.field(default_factory=set)
    world_size: int = 0
    state: State = State.HEALTHY
    reason: str = "no anomaly reported"
    # The rules' dedup state is keyed by the restore the reporting rank is in (`rank_restores`): after a
    # restore the job runs its steps again, and a signal at a step seen before the restore is a new one; a
    # straggler still reporting from before the restore is in the old one, so its repeats stay repeats.
    # (restore, replica group, step): a job may have several replica groups (HSDP: one per shard), each
    # voting on its own replicas; every rank of a group reports the same vote
    mismatch_steps: collections.deque[tuple[int, str, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64))
    frozen_steps: collections.deque[tuple[int, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64))
    nonfinite_steps: collections.deque[tuple[int, int, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=256))
    gpus: set[str] = dataclasses.field(default_factory=set)          # GPU UUIDs its ranks reported
    # the votes told to the checkpoints, (restore, step, kind), and the groups that agreed at (restore, step)
    # with their sizes, until they cover every rank of the job (then "vote_agreed" is told: checked through
    # that step)
    voted_steps: collections.deque[tuple[int, int, str]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=256))
    agreed_groups: collections.OrderedDict[tuple[int, int], dict[str, int]] = dataclasses.field(
        default_factory=collections.OrderedDict)
    loss: JobLoss = dataclasses.field(default_factory=JobLoss)      # the job's loss detector
    rank_steps: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> its newest report's step
    restores_seen: collections.deque[int] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64))         # restored steps already announced
    restores: int = 0                                                 # restores announced
    rank_restores: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> the restore it is in
    directive: PendingDirective | None = None
    # ranks without replicas (no vote): the newest step each rank's in-step checks ran at, and the lowest of
    # them over every rank last told to the checkpoints ("checks_clean": what vouches in place of a vote)
    clean_through: dict[int, int] = dataclasses.field(default_factory=dict)
    clean_sent: int = -1
    compute_checks: str = ""                                          # the ranks' replay mode, as reported
    vote_unavailable: str = ""                                        # why the ranks cannot vote, as reported
    stage_errors: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> its stage failures so far
    compute_seen: collections.deque[tuple[int, int, str, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=256))  # (restores, step, detector, suspect) announced
    compute_faults: dict[str, set[int]] = dataclasses.field(default_factory=dict)  # GPU -> steps it was faulty
    mismatch_from: int | None = None   # the first step of the open replica-mismatch incident
    # its groups not agreeing again yet -> the first step each disagreed at (a straggler's agreeing vote of
    # an earlier step, from a rank behind the others of its group, is no repair)
    mismatch_groups: dict[str, int] = dataclasses.field(default_factory=dict)
    incidents: int = 0                 # replica-mismatch incidents opened (the events fold per incident)
    mismatch_planned: bool = False     # its rollback plan was asked for
    mismatch_plans: int = 0            # plans of this incident that found no rollback (`mismatch_unplanned`)
    mismatch_retry_at: float = 0.0     # not planned again before this time
    repaired_at: tuple[int, int] | None = None   # (restore, step R) of the newest repair in place
    stop_from: int | None = None       # the first step of the compute incident a STOP was asked for


@dataclasses.dataclass(slots=True)
class ReportOutcome:
    findings: list[Finding] = dataclasses.field(default_factory=list)
    evidence: list[tuple[str, str, Evidence]] = dataclasses.field(default_factory=list)  # (uuid, host, ev)
    dropped_delta: int = 0
    mismatch: bool = False
    job_events: list[tuple[int | None, str, str]] = dataclasses.field(default_factory=list)  # for checkpoints
    # (index in `findings` of the event that asks for a rollback or stop plan, the anomaly)
    rollbacks: list[tuple[int, LossEvent | MismatchIncident | ComputeIncident]] = dataclasses.field(
        default_factory=list)
    directives: list[pb.Directive] = dataclasses.field(default_factory=list)   # for the reporting rank
    evicted: list[str] = dataclasses.field(default_factory=list)   # jobs forgotten to make room for this one


class JobTracker:
    """`loss_config`: each job's loss detector; `rollback`: the policy that turns a critical loss event into a
    rollback request (None: rollback directives off); `compute_stop`: a GPU that keeps computing wrong asks
    for a STOP directive (`ComputeIncident`)."""

    MAX_RANKS_TRACKED = 4096

    def __init__(self, *, max_jobs: int = 64, idle_s: float = 3600.0,
                 loss_config: LossDetectorConfig | None = None,
                 rollback: RollbackPolicy | None = None, compute_stop: bool = True) -> None:
        self.jobs: collections.OrderedDict[str, JobState] = collections.OrderedDict()
        self.max_jobs = max_jobs
        self.idle_s = idle_s
        self.loss_config = loss_config or LossDetectorConfig()
        self.rollback = rollback
        self.compute_stop = compute_stop

    def _make_room(self) -> list[str]:
        """Evict the least recently seen jobs until a new one fits; returns their ids."""
        evicted = []
        while len(self.jobs) >= self.max_jobs:
            old, _ = self.jobs.popitem(last=False)
            evicted.append(old)
        return evicted

    def jobs_on_gpu(self, uuid: str) -> list[JobState]:
        return [j for j in self.jobs.values() if uuid in j.gpus]

    def expire(self, now: float) -> list[str]:
        """Forget the jobs idle for `idle_s`; returns their ids."""
        gone = [j for j, s in self.jobs.items() if now - s.last_report > self.idle_s]
        for j in gone:
            del self.jobs[j]
        return gone

    def restores(self, job_id: str) -> int:
        """The restores the job has announced so far (`set_directive`'s `restores_at`)."""
        job = self.jobs.get(job_id)
        return 0 if job is None else job.restores

    def set_directive(self, job_id: str, directive: pb.Directive, anomaly_start: int, now: float,
                      restores_at: int | None = None) -> bool:
        """A planned rollback (daemon/rollback.py): each rank gets `directive` with its next report. Planned
        for an anomaly seen when the job had announced `restores_at` restores: if the job has since gone back
        to before the anomaly (and not before the target), the plan is stale and dropped, as a pending one is
        (`_restored`): the anomaly is in the history the job left (a plan made late, e.g. for the loss after
        a bad range the job was already rolled back over). Returns whether it was set."""
        job = self.jobs.get(job_id)
        if job is None:   # forgotten meanwhile: nobody left to tell
            return False
        if restores_at is not None and job.restores > restores_at:
            since = list(job.restores_seen)[-(job.restores - restores_at):]
            if any(directive.target_step <= r < anomaly_start for r in since):
                return False
        pending = job.directive
        if (pending is not None and pending.directive.kind == pb.Directive.KIND_STOP
                and directive.kind != pb.Directive.KIND_STOP):
            return False      # a STOP the ranks have not all taken wins: a rollback would run on the bad GPU
        job.directive = PendingDirective(directive, now, anomaly_start)
        return True

    def stop_open(self, job_id: str, first_step: int) -> bool:
        """Is the compute incident from `first_step` a STOP was asked for still open (the job has not gone
        back before it since: restarted from an older checkpoint)?"""
        job = self.jobs.get(job_id)
        return job is not None and job.stop_from == first_step

    def mismatch_unplanned(self, job_id: str, first_step: int, now: float) -> float | None:
        """The plan for the mismatch incident that began at `first_step` found no rollback (no VERIFIED
        checkpoint before it yet, or the checkpoints did not answer in time): while the incident stays open
        (the replicas still disagree), a later disagreeing vote asks again, after a delay that doubles from
        MISMATCH_REPLAN_S up to MISMATCH_REPLAN_MAX_S. The job never waits on its vetoed updates for good
        because one plan came too early on a loaded agent. Returns the delay (None: the incident is over)."""
        job = self.jobs.get(job_id)
        if job is None or job.mismatch_from != first_step:
            return None
        job.mismatch_plans += 1
        delay = min(MISMATCH_REPLAN_MAX_S, MISMATCH_REPLAN_S * 2 ** (job.mismatch_plans - 1))
        job.mismatch_planned, job.mismatch_retry_at = False, now + delay
        return delay

    def mismatch_open(self, job_id: str, first_step: int) -> bool:
        """Is the replica-mismatch incident that began at `first_step` still open (the job has not gone back
        before it since, by a repair or a rollback of its own)?"""
        job = self.jobs.get(job_id)
        return job is not None and job.mismatch_from == first_step

    def _stage_failures(self, job: JobState, rank: int, total: int) -> int:
        """How many step-guard stage failures this report adds for `rank` (its running count went up, or a
        restarted process counts afresh); remembered per rank, for at most MAX_RANKS_TRACKED ranks."""
        if not total:
            return 0
        before = job.stage_errors.get(rank)
        if before is None and len(job.stage_errors) >= self.MAX_RANKS_TRACKED:
            return 0
        job.stage_errors[rank] = total
        if before is None or total < before:
            return total
        return total - before

    def report(self, req: pb.ReportStepRequest, now: float) -> ReportOutcome | None:
        """Account one accepted report. Returns None when it needs nothing more than that (nearly every
        report); the rules, and the outcome they fill, run only for a report that carries their signal.
        Each field is read once."""
        job_id, rank, step = req.job_id, req.rank, req.step
        job = self.jobs.get(job_id)
        new = job is None
        if new:
            evicted = self._make_room()
            job = self.jobs[job_id] = JobState(job_id=job_id, first_seen=now, loss=JobLoss(self.loss_config))
        else:
            self.jobs.move_to_end(job_id)
        job.last_report = now
        job.steps_seen += 1
        if step > job.last_step:
            job.last_step = step
        world = req.world_size
        if world > job.world_size:
            job.world_size = world
        ranks = job.ranks
        if len(ranks) < self.MAX_RANKS_TRACKED:
            ranks.add(rank)
            gpu = req.gpu_uuid
            if gpu:
                job.gpus.add(gpu)
        checks = req.checks_run
        if checks and (rank in job.checks_run or len(job.checks_run) < self.MAX_RANKS_TRACKED):
            job.checks_run[rank] = checks   # the rank's own running count
        # said once per job: the ranks' replays do not reproduce their steps, so no GPU is named on them
        unreproducible = (req.compute_checks.startswith("unreproducible")
                          and not job.compute_checks.startswith("unreproducible"))
        if req.compute_checks:
            job.compute_checks = req.compute_checks   # the same on every rank (the check is collective)
        no_vote = req.vote_unavailable and not job.vote_unavailable   # said once per job
        stage_new = self._stage_failures(job, rank, req.stage_errors)
        dropped = req.dropped_reports
        loss, grad_norm = req.loss, req.grad_norm
        finite = isfinite(loss) and isfinite(grad_norm)   # unset reads 0.0: finite
        prev_step = job.rank_steps.get(rank)
        went_back_from = _went_back(job, rank, step)
        if went_back_from is not None:   # this rank is now in the restore of step - 1 (a new one, or its peers')
            if step - 1 not in job.restores_seen:
                job.restores += 1
            if rank in job.rank_restores or len(job.rank_restores) < self.MAX_RANKS_TRACKED:
                job.rank_restores[rank] = job.restores
        elif rank not in job.rank_restores and len(job.rank_restores) < self.MAX_RANKS_TRACKED:
            job.rank_restores[rank] = job.restores          # a rank first seen is in the job's current restore
        if prev_step is not None and step < prev_step:   # a restore, or a fresh start at step 0
            job.loss.restarted(step)
        has = req.HasField
        late_before = job.loss.late
        loss_events = job.loss.add(step, rank, world, loss if has("loss") else None,
                                   grad_norm if has("grad_norm") else None,
                                   req.loss_scale if has("loss_scale") else None, now)
        late = job.loss.late - late_before   # a straggler's report of a step already judged: dropped
        unvoted_check = bool(req.fingerprint) and not has("vote") and not req.replica_group
        if not (new or dropped or late or not finite or has("canary") or has("vote") or req.frozen_changed
                or req.compute or went_back_from is not None or loss_events or job.directive is not None
                or unvoted_check or no_vote or stage_new or unreproducible):
            return None
        out = ReportOutcome()
        if stage_new:
            out.findings.append(Finding(
                ek.RANK_STAGE_FAILED, Severity.WARNING, f"job/{job_id}/rank/{rank}",
                f"job {job_id} rank {rank}: a check around the optimizer step raised ({stage_new} more, "
                f"{req.stage_errors} so far); the steps it failed on went unchecked by it: "
                f"{req.stage_error or '(no message)'}",
                {"job_id": job_id, "rank": rank, "step": step, "errors": req.stage_errors, "new": stage_new,
                 "error": req.stage_error}))
        if no_vote:
            job.vote_unavailable = req.vote_unavailable
            out.findings.append(Finding(ek.JOB_VOTE_UNAVAILABLE, Severity.WARNING, f"job/{job_id}",
                                        f"job {job_id} cannot vote across replicas (rank {rank}): "
                                        f"{req.vote_unavailable}",
                                        {"job_id": job_id, "rank": rank, "reason": req.vote_unavailable}))
        if unreproducible:
            why = req.compute_checks.removeprefix("unreproducible: ")
            out.findings.append(Finding(ek.COMPUTE_UNREPRODUCIBLE, Severity.WARNING, f"job/{job_id}",
                                        f"job {job_id}'s compute replays do not reproduce its steps (rank "
                                        f"{rank}): {why}; audits are off and no GPU is named on a replay",
                                        {"job_id": job_id, "rank": rank, "reason": req.compute_checks}))
        if new:
            out.evicted = evicted
            out.findings.append(Finding(ek.JOB_STARTED, Severity.INFO, f"job/{job_id}",
                                        f"job {job_id} first reported (rank {rank}, step {step})",
                                        {"job_id": job_id, "rank": rank, "step": step,
                                         "world_size": req.world_size}))
        if dropped or late:
            self._dropped(job, rank, dropped, late, out)
        if not finite:
            self._nonfinite(req, job, out, now)
        if req.HasField("canary"):
            self._canary(req, job, out, now)
        if req.HasField("vote"):
            self._vote(req, job, out, now)
        if req.frozen_changed:
            self._frozen(req, job, out, now)
        if req.compute:
            self._compute(req, job, out, now)
        if went_back_from is not None:
            self._restored(job, rank, went_back_from, step, out)
        if unvoted_check:
            self._checks_clean(job, rank, step, world, out)
        for ev in loss_events:
            self._loss_event(job, ev, out)
        if job.directive is not None:
            self._deliver(job, rank, now, out)
        return out

    def report_late(self, req: pb.ReportStepRequest, now: float) -> ReportOutcome | None:
        """A report its rank gave up on (the deadline passed before the agent got to it; the rank counts it
        in its next `dropped_reports`): it moves nothing along (no step, no loss, no directive), but the
        signals VERIFIED depends on (a replica vote, non-finite values, frozen parameters, a canary result)
        are still used: they are facts about the GPUs whenever they arrive. A job's first report is never
        late (nothing to judge it against): it goes through `report`."""
        job = self.jobs.get(req.job_id)
        if job is None:
            return self.report(req, now)
        has = req.HasField
        finite = isfinite(req.loss) and isfinite(req.grad_norm)
        if finite and not (has("vote") or has("canary") or req.frozen_changed or req.compute):
            return None
        out = ReportOutcome()
        if not finite:
            self._nonfinite(req, job, out, now)
        if has("canary"):
            self._canary(req, job, out, now)
        if has("vote"):
            self._vote(req, job, out, now)
        if req.frozen_changed:
            self._frozen(req, job, out, now)
        if req.compute:
            self._compute(req, job, out, now)
        return out

    # -- rules -------------------------------------------------------------------------------------
    def _dropped(self, job: JobState, rank: int, dropped: int, late: int, out: ReportOutcome) -> None:
        """Reports lost on the way (`dropped`: counted by the rank) or too late to judge (`late`: a step the
        loss detector had already judged; its loss is not used, its votes and non-finite values still are).
        One event per job, folded by the bus per window (the catalogue's fold_s): its details carry the
        job's running total, so the window's last event has the whole count."""
        n = dropped + late
        out.dropped_delta = n
        job.dropped_reports += n
        why = (f"rank {rank} dropped {dropped} report(s): the agent was slow or down" if dropped else
               f"rank {rank} reported a step already judged (a straggler): too late to use")
        out.findings.append(Finding(
            ek.JOB_REPORTS_DROPPED, Severity.WARNING, f"job/{job.job_id}",
            f"job {job.job_id}: {why}; {job.dropped_reports} report(s) lost so far",
            {"job_id": job.job_id, "rank": rank, "dropped": dropped, "late": late,
             "dropped_total": job.dropped_reports}))

    def _restored(self, job: JobState, rank: int, prev: int, step: int, out: ReportOutcome) -> None:
        """A rank went back from `prev` to `step`: the job restored step - 1. Announced once; a pending
        directive that would roll back to before the same anomaly again (and skip good batches) is dropped."""
        restored = step - 1
        if restored in job.restores_seen:
            return
        job.restores_seen.append(restored)
        if job.mismatch_from is not None and restored < job.mismatch_from:
            _close_mismatch(job)   # back before it: a later one is new
        if job.stop_from is not None and restored < job.stop_from:
            job.stop_from = None   # restarted before the compute incident: a fault after this is a new one
        pending = job.directive
        if pending is not None and pending.directive.target_step <= restored < pending.anomaly_start:
            # the job already went back to before that anomaly (e.g. for a replica mismatch)
            job.directive = None
        out.findings.append(Finding(
            ek.JOB_ROLLBACK, Severity.INFO, f"job/{job.job_id}",
            f"job {job.job_id} went back from step {prev} to {step}: restored step {restored}",
            {"job_id": job.job_id, "from_step": prev, "restored_step": restored, "rank": rank}))
        out.job_events.append((restored, "rollback", f"the job restored step {restored}"))

    def _loss_event(self, job: JobState, ev: LossEvent, out: ReportOutcome) -> None:
        """A loss detector event: journaled; a critical one tells the checkpoints, may ask for a rollback.
        Not while the job's replica-mismatch incident that began at or before the anomaly is open: the
        mismatch explains the loss (updates vetoed, or weights that differ), and its own rollback replays
        the batches, where the detector judges them again. A loss rollback skips batches: planned here it
        would skip good data for a hardware fault, or replace the mismatch's directive before the ranks took
        it. (A loss anomaly that began well before the mismatch, by more than the detector's patience, is
        the data's: planned as usual.)"""
        finding = loss_finding(job.job_id, ev)
        critical = ev.severity == Severity.CRITICAL
        wants = critical and self.rollback is not None and ev.kind in self.rollback.kinds
        deferred = wants and job.mismatch_from is not None and (
            ev.start_step >= job.mismatch_from - self.loss_config.patience_steps)
        if deferred:
            finding = dataclasses.replace(
                finding, message=f"{finding.message}; no loss rollback: the replica mismatch from step "
                f"{job.mismatch_from} is open (its rollback replays these batches and judges them again)",
                details={**finding.details, "rollback_deferred_to_mismatch_from": job.mismatch_from})
        out.findings.append(finding)
        if critical:
            out.job_events.append((ev.start_step, "nan" if ev.kind == "nonfinite" else "loss_anomaly",
                                   f"{ev.signal} {ev.kind} from step {ev.start_step}"))
        if wants and not deferred:
            out.rollbacks.append((len(out.findings) - 1, ev))

    def _deliver(self, job: JobState, rank: int, now: float, out: ReportOutcome) -> None:
        pending = job.directive
        assert pending is not None
        if now - pending.created > DIRECTIVE_TTL_S:
            job.directive = None
        elif rank not in pending.delivered:
            pending.delivered.add(rank)
            out.directives.append(pending.directive)

    def _nonfinite(self, req: pb.ReportStepRequest, job: JobState, out: ReportOutcome, now: float) -> None:
        bad = [name for name in ("loss", "grad_norm")
               if req.HasField(name) and not math.isfinite(getattr(req, name))]
        key = (_era(job, req.rank), req.step, req.rank)
        if not bad or key in job.nonfinite_steps:
            return
        job.nonfinite_steps.append(key)
        values = {n: str(getattr(req, n)) for n in bad}
        kind = ek.LOSS_NONFINITE if "loss" in bad else ek.GRAD_NORM_NONFINITE
        out.findings.append(Finding(
            kind, Severity.CRITICAL, f"job/{req.job_id}/rank/{req.rank}",
            f"{' and '.join(bad)} not finite at step {req.step} on rank {req.rank}"
            + (f" (GPU {req.gpu_uuid})" if req.gpu_uuid else ""),
            {"job_id": req.job_id, "rank": req.rank, "step": req.step, "gpu_uuid": req.gpu_uuid,
             "host": req.host, **values}))
        job.state, job.reason = State.SUSPECT, f"non-finite {'/'.join(bad)} at step {req.step}"
        out.job_events.append((req.step, "nan", f"non-finite {'/'.join(bad)} on rank {req.rank}"))

    def _vote(self, req: pb.ReportStepRequest, job: JobState, out: ReportOutcome, now: float) -> None:
        if not req.HasField("vote") or not req.vote.checked:
            return
        vote = req.vote
        gen = _era(job, req.rank)
        if gen < job.restores:   # a straggler's vote of weights the job has since restored over
            self._mismatch_evidence(req, now, out)
            return
        group = vote.replica_group or req.replica_group
        self._tell_vote(job, gen, vote, group, req.world_size, out)
        if vote.agreed:
            since = job.mismatch_groups.get(group)
            if since is not None and vote.step > since:    # a group of the open incident agrees again
                del job.mismatch_groups[group]
                if not job.mismatch_groups:
                    # every group that disagreed agrees again (repaired in place): the incident is over; the
                    # checkpoints saved during it are dropped and its mismatches stop blocking VERIFIED from
                    # this step on
                    out.job_events.append((vote.step, "repaired", f"replicas agree again from step {vote.step} "
                                           f"(they differed from step {job.mismatch_from})"))
                    job.repaired_at = (gen, vote.step)
                    # the state stays SUSPECT (the job had an incident); its reason says how it ended
                    job.reason = (f"replicas differed from step {job.mismatch_from}, repaired in place: they agree "
                                  f"again from step {vote.step}")
                    _close_mismatch(job)
            return
        out.mismatch = (gen, group, vote.step) not in job.mismatch_steps
        suspects = [{"rank": s.rank, "host": s.host, "gpu_uuid": s.gpu_uuid} for s in vote.suspects]
        self._mismatch_evidence(req, now, out)
        if not out.mismatch:
            return
        job.mismatch_steps.append((gen, group, vote.step))
        job.mismatch_groups[group] = min(vote.step, job.mismatch_groups.get(group, vote.step))
        job.state = State.SUSPECT
        job.reason = f"replica mismatch at step {vote.step}" + (
            f" in replica group {group}" if group and group != "world" else "")
        if job.mismatch_from is None:
            job.incidents += 1                 # a new incident: its own event (the bus folds per incident)
        if job.mismatch_from is None or vote.step < job.mismatch_from:
            job.mismatch_from, job.mismatch_planned = vote.step, False
        # one plan per incident: at once without a majority (two replicas); with a majority the ranks may
        # repair in place (checksums.replica_recovery): at the next update (host gate) or, with the device
        # gate, MAJORITY_REPAIR_STEPS later; so only if a vote still disagrees after that
        plan = not job.mismatch_planned and now >= job.mismatch_retry_at and (
            vote.method != "majority" or vote.step > job.mismatch_from + MAJORITY_REPAIR_STEPS)
        names = ", ".join(f"rank {s['rank']} on {s['host'] or '?'} GPU {s['gpu_uuid'] or '?'}" for s in suspects)
        count = max(vote.suspect_count, len(suspects))       # the rank bounds the list it sends
        if count > len(suspects):
            names += f" and {count - len(suspects)} more"
        out.findings.append(Finding(
            ek.REPLICA_MISMATCH, Severity.CRITICAL, f"job/{req.job_id}",
            f"replica vote at step {vote.step}: suspect {names}",
            {"job_id": req.job_id, "step": vote.step, "method": vote.method, "replicas": vote.replicas,
             "replica_group": vote.replica_group or req.replica_group, "suspects": suspects,
             "suspect_count": count,
             "reported_by_rank": req.rank, "incident_from_step": job.mismatch_from,
             "incident": job.incidents}))
        if plan and self.rollback is not None:
            job.mismatch_planned = True
            out.rollbacks.append((len(out.findings) - 1,
                                  MismatchIncident(job.mismatch_from, vote.method, vote.replicas)))

    @staticmethod
    def _tell_vote(job: JobState, gen: int, vote: pb.ReplicaVote, group: str, world: int,
                   out: ReportOutcome) -> None:
        """Tell the checkpoints a vote once per step: a disagreeing one at once (any group's); an agreeing one
        when the groups that agreed at the step cover every rank of the job (`votes_cover`; the job is checked
        through it only then): groups of one size (DDP, HSDP, TP/PP x DP grids) or a job's own uneven ones."""
        key = (gen, vote.step)
        if not vote.agreed:
            if (gen, vote.step, "vote_mismatch") not in job.voted_steps:
                job.voted_steps.append((gen, vote.step, "vote_mismatch"))
                out.job_events.append((vote.step, "vote_mismatch", f"replica vote disagreed ({vote.method})"))
            return
        if (gen, vote.step, "vote_agreed") in job.voted_steps:
            return
        agreed = job.agreed_groups.setdefault(key, {})
        agreed[group] = vote.replicas
        while len(job.agreed_groups) > AGREED_STEPS_KEPT:
            job.agreed_groups.popitem(last=False)
        if votes_cover(world, agreed.values()):
            del job.agreed_groups[key]
            job.voted_steps.append((gen, vote.step, "vote_agreed"))
            out.job_events.append((vote.step, "vote_agreed", ""))

    @staticmethod
    def _mismatch_evidence(req: pb.ReportStepRequest, now: float, out: ReportOutcome) -> None:
        """Evidence on each suspect's GPU from a disagreeing vote (every reporter attaches it; the agent keeps
        only its own GPUs): a fact about the GPUs whenever it arrives."""
        vote = req.vote
        if vote.agreed:
            return
        for s in vote.suspects:
            ev = Evidence(source="replica_vote", signal="mismatch", value=str(vote.step),
                          implies=State.SUSPECT,
                          reason=(f"replica vote at step {vote.step} of job {req.job_id}: rank {s.rank} "
                                  f"disagreed ({vote.method}, {vote.replicas} replicas)"),
                          time=now)
            out.evidence.append((s.gpu_uuid, s.host, ev))

    def _checks_clean(self, job: JobState, rank: int, step: int, world: int, out: ReportOutcome) -> None:
        """A rank without replicas ran its in-step checks at `step` (a bad finding, if any, was added first).
        Once every rank of the job has, the lowest such step is what the checkpoints may trust through."""
        if rank not in job.clean_through and len(job.clean_through) >= self.MAX_RANKS_TRACKED:
            return
        if step < job.clean_through.get(rank, -1):   # a restore: its checks start again from there
            job.clean_sent = min(job.clean_sent, step)
        job.clean_through[rank] = step
        if len(job.clean_through) < max(world, 1):
            return
        through = min(job.clean_through.values())
        if through > job.clean_sent:
            job.clean_sent = through
            out.job_events.append((through, "checks_clean", ""))

    def _canary(self, req: pb.ReportStepRequest, job: JobState, out: ReportOutcome, now: float) -> None:
        """An in-job canary result: evidence on the rank's GPU (FAIL: SUSPECT; PASS: healthy evidence)."""
        if not req.HasField("canary") or req.canary.status == "UNKNOWN":
            return
        c = req.canary
        failed = c.status == "FAIL"
        if failed:
            out.findings.append(Finding(
                ek.CANARY_FAIL, Severity.CRITICAL, f"job/{req.job_id}/rank/{req.rank}",
                f"in-job canary {c.check} FAILED on rank {req.rank} ({req.host or '?'} GPU {req.gpu_uuid or '?'}) "
                f"after step {c.step}: {c.why}",
                {"job_id": req.job_id, "rank": req.rank, "step": c.step, "check": c.check, "why": c.why,
                 "gpu_uuid": req.gpu_uuid, "host": req.host}))
            out.job_events.append((c.step, "sdc", f"in-job canary failed on rank {req.rank}"))
        if req.gpu_uuid:
            out.evidence.append((req.gpu_uuid, req.host, Evidence(
                source="canary", signal="fail" if failed else "pass", value=c.check,
                implies=State.SUSPECT if failed else State.HEALTHY,
                reason=(f"in-job canary {c.check} failed: {c.why}" if failed
                        else f"in-job canary {c.check} passed (job {req.job_id})"), time=now)))

    def _compute(self, req: pb.ReportStepRequest, job: JobState, out: ReportOutcome, now: float) -> None:
        """Compute-fault findings of the ranks' pre-reduction checks and replay audits. Every rank reports the
        same finding: announced once per (step, detector, suspect); evidence on each faulty rank's GPU from
        every report (the agent keeps its own GPUs): SUSPECT, FAILED when that GPU was faulty on two steps.
        A fault the gate did not resolve, or one an audit found (it may have slipped into updates since the
        rank's last clean audit), keeps the job's checkpoints from `since_step` on from VERIFIED. An
        unresolved finding (the replays had no majority: two ranks without a witness, where one of the two
        named is faulty, or replays that split evenly, as those of HSDP replicas whose weights differ do)
        makes the GPUs it names SUSPECT, never FAILED: a repeat of it does not say which one is faulty. So
        does a `one_of` finding (a tensor-parallel group's GPUs: the replays name the group, not its GPU),
        whose cause still stops the job when it is persistent."""
        for f in req.compute:
            named = [{"rank": s.rank, "host": s.host, "gpu_uuid": s.gpu_uuid} for s in f.faulty]
            either = f.cause == "unresolved" or f.one_of      # one of the named GPUs, not told apart
            repeated = False
            for s in f.faulty:
                steps = job.compute_faults.setdefault(s.gpu_uuid or f"rank/{s.rank}", set())
                if len(steps) < 64 and not either:
                    steps.add(f.step)
                repeat = len(steps) > 1 and not either
                repeated = repeated or repeat
                if s.gpu_uuid:
                    out.evidence.append((s.gpu_uuid, s.host, Evidence(
                        source="compute_check", signal="fault", value=f"{f.cause}@{f.step}",
                        implies=State.FAILED if repeat else State.SUSPECT,
                        reason=(f"{'repeated ' if repeat else ''}compute fault ({f.detector}, {f.cause}) at step "
                                f"{f.step} of job {req.job_id} on rank {s.rank}: {f.detail}"), time=now)))
            key = (_era(job, req.rank), f.step, f.detector, f.suspect)
            if key in job.compute_seen:
                continue
            job.compute_seen.append(key)
            details = {"job_id": req.job_id, "step": f.step, "detector": f.detector, "suspect": f.suspect,
                       "cause": f.cause, "dropped": f.dropped, "faulty": named, "detail": f.detail,
                       "score": round(f.score, 3), "bucket": f.bucket, "stat": f.stat,
                       "since_step": f.since_step, "one_of": f.one_of, "reported_by_rank": req.rank}
            if f.cause == "diverged":       # the replicas' weights differ: no GPU's arithmetic to blame
                out.findings.append(Finding(
                    ek.COMPUTE_DIVERGED, Severity.WARNING, f"job/{req.job_id}",
                    f"compute suspicion on rank {f.suspect} at step {f.step}: the replicas compute from "
                    "different weights or optimizer state, no GPU named; update "
                    f"{'dropped' if f.dropped else 'applied'} ({f.detail})", details))
                job.state = State.SUSPECT
                # the vote's incident: a repair in place at R (replicas agree again) covers it when f.step <= R,
                # whichever the agent hears first (the checkpoints' "repaired" clears it the other way round)
                rep = job.repaired_at
                if not (rep is not None and rep[0] == _era(job, req.rank) and f.step <= rep[1]):
                    job.reason = f"replicas' weights differ at step {f.step} (compute check)"
                    out.job_events.append((f.step, "diverged", "compute check: the replicas' weights differ"))
                continue
            if not named:
                out.findings.append(Finding(
                    ek.COMPUTE_CLEARED, Severity.INFO, f"job/{req.job_id}",
                    f"compute suspicion on rank {f.suspect} at step {f.step} cleared by replay ({f.detail})",
                    details))
                continue
            first = named[0]
            who = ("one of " if f.one_of else "") + ", ".join(
                f"rank {n['rank']} on {n['host'] or '?'} GPU {n['gpu_uuid'] or '?'}" for n in named)
            out.findings.append(Finding(
                ek.COMPUTE_FAULT, Severity.CRITICAL, f"job/{req.job_id}/rank/{first['rank']}",
                f"compute fault at step {f.step} ({f.detector}, {f.cause}): {who}; update "
                f"{'dropped' if f.dropped else 'applied'}", details))
            job.state, job.reason = State.SUSPECT, f"compute fault at step {f.step} on {who}"
            first_step = min(f.since_step or f.step, f.step)
            if f.cause == "unresolved" or f.detector == "audit" or not f.dropped:
                out.job_events.append((first_step, "sdc",
                                       f"compute fault ({f.detector}, {f.cause}) on {who}"))
            if self.compute_stop and job.stop_from is None and stops_job(f.cause, repeated):
                job.stop_from = first_step
                out.rollbacks.append((len(out.findings) - 1, ComputeIncident(
                    first_step, f.step, f.cause if f.cause == "persistent" else f"repeated {f.cause}", who,
                    tuple(n["gpu_uuid"] for n in named if n["gpu_uuid"]))))

    def _frozen(self, req: pb.ReportStepRequest, job: JobState, out: ReportOutcome, now: float) -> None:
        # the step the change was seen at: a lost report's change rides on a later report (`frozen_step`)
        step = req.frozen_step if req.HasField("frozen_step") else req.step
        key = (_era(job, req.rank), step)
        if not req.frozen_changed or key in job.frozen_steps:
            return
        job.frozen_steps.append(key)
        names = list(req.frozen_changed)
        job.state, job.reason = State.SUSPECT, f"frozen parameters changed at step {step}"
        out.job_events.append((step, "sdc", f"frozen parameters changed on rank {req.rank}"))
        out.findings.append(Finding(
            ek.SDC_FROZEN_CHANGED, Severity.CRITICAL, f"job/{req.job_id}/rank/{req.rank}",
            f"{len(names)} frozen parameter(s) changed at step {step} on rank {req.rank}: "
            + ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""),
            {"job_id": req.job_id, "rank": req.rank, "step": step, "gpu_uuid": req.gpu_uuid,
             "host": req.host, "names": names[:100]}))
        if req.gpu_uuid:
            out.evidence.append((req.gpu_uuid, req.host, Evidence(
                source="frozen_params", signal="changed", value=str(step), implies=State.SUSPECT,
                reason=f"frozen parameters changed at step {step} of job {req.job_id} (rank {req.rank})",
                time=now)))


def votes_cover(world_size: int, group_sizes: Iterable[int]) -> bool:
    """Whether the replica groups that agreed at a step, of these sizes (each distinct group once), cover a
    job of `world_size` ranks: every rank belongs to one group (the groups partition the ranks that vote), so
    their sizes sum to the world once all have agreed. Uneven groups (a job's own) need every one; a job
    with ranks outside every group (no replica: nothing vouches for them) is never covered by its vote. An
    unknown world (0, an old client) takes one group alone. Pure."""
    return sum(group_sizes) >= world_size if world_size >= 2 else True


def _close_mismatch(job: JobState) -> None:
    """The job's replica-mismatch incident is over (repaired in place, or the job went back before it)."""
    job.mismatch_from, job.mismatch_planned = None, False
    job.mismatch_groups.clear()
    job.mismatch_plans, job.mismatch_retry_at = 0, 0.0


def _era(job: JobState, rank: int) -> int:
    """The restore `rank` is in (0: none yet): its reports are about the weights since that restore."""
    return job.rank_restores.get(rank, job.restores)


def stops_job(cause: str, repeated: bool) -> bool:
    """Does a compute finding ask the job to stop? When the GPU it names keeps computing wrong: its replay
    repeats the fault (`persistent`), or the GPU was faulty on another step of the job before (`repeated`).
    Never on `unresolved` (the replays did not say which GPU) nor on `data` (no GPU named). Pure."""
    return cause == "persistent" or (repeated and cause == "transient")


def _went_back(job: JobState, rank: int, step: int) -> int | None:
    """Record the rank's step; its previous step when this one is lower (the job restored a checkpoint).
    Step 0 again is a fresh start, not a restore."""
    steps = job.rank_steps
    prev = steps.get(rank)
    if prev is not None or len(steps) < JobTracker.MAX_RANKS_TRACKED:
        steps[rank] = step
    if prev is None or step >= prev or step == 0:
        return None
    return prev


def loss_finding(job_id: str, ev: LossEvent) -> Finding:
    """The journal's event for a loss detector event (of the job: the mean over its ranks)."""
    details = {"job_id": job_id, "step": ev.step, "signal": ev.signal, "kind": ev.kind,
               "value": _num(ev.value), "baseline": _num(ev.baseline), "magnitude": _num(ev.magnitude),
               "start_step": ev.start_step}
    return Finding(ev.event_kind, ev.severity, f"job/{job_id}", ev.message, details)


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)
