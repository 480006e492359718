"""Per-job state built from the ranks' ReportStep calls. Pure: no I/O, `now` passed in.

`JobTracker.report(req, now)` returns what the agent must do: findings to journal, evidence to attach to
local GPUs, events for the checkpoint coordinator; or None, the usual case, when a report only moves the
job along. Memory is bounded: at most `max_jobs` jobs (least recently seen evicted), a bounded set of ranks
per job, and bounded dedup state.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from math import isfinite
from typing import Callable

from sdcwatch import event_kinds as ek
from sdcwatch.types import Evidence, Finding, Severity, State
from proto.sdcwatch.v1 import agent_pb2 as pb


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
    mismatch_steps: collections.deque[int] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64))
    frozen_steps: collections.deque[int] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64))
    nonfinite_steps: collections.deque[tuple[int, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=256))
    gpus: set[str] = dataclasses.field(default_factory=set)          # GPU UUIDs its ranks reported
    voted_steps: collections.deque[int] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=256))


@dataclasses.dataclass(slots=True)
class ReportOutcome:
    findings: list[Finding] = dataclasses.field(default_factory=list)
    evidence: list[tuple[str, str, Evidence]] = dataclasses.field(default_factory=list)  # (uuid, host, ev)
    dropped_delta: int = 0
    mismatch: bool = False
    job_events: list[tuple[int | None, str, str]] = dataclasses.field(default_factory=list)  # for checkpoints


class JobTracker:
    MAX_RANKS_TRACKED = 4096

    def __init__(self, *, max_jobs: int = 64, idle_s: float = 3600.0,
                 on_evict: Callable[[str], None] | None = None) -> None:
        self.jobs: collections.OrderedDict[str, JobState] = collections.OrderedDict()
        self.max_jobs = max_jobs
        self.idle_s = idle_s
        self.on_evict = on_evict

    def _new_job(self, job_id: str, now: float) -> JobState:
        while len(self.jobs) >= self.max_jobs:
            old, _ = self.jobs.popitem(last=False)
            if self.on_evict:
                self.on_evict(old)
        job = JobState(job_id=job_id, first_seen=now)
        self.jobs[job_id] = job
        return job

    def jobs_on_gpu(self, uuid: str) -> list[JobState]:
        return [j for j in self.jobs.values() if uuid in j.gpus]

    def expire(self, now: float) -> list[str]:
        gone = [j for j, s in self.jobs.items() if now - s.last_report > self.idle_s]
        for j in gone:
            del self.jobs[j]
            if self.on_evict:
                self.on_evict(j)
        return gone

    def report(self, req: pb.ReportStepRequest, now: float) -> ReportOutcome | None:
        """Account one accepted report. Returns None when it needs nothing more than that (nearly every
        report); the rules, and the outcome they fill, run only for a report that carries their signal.
        Each field is read once."""
        job_id, rank, step = req.job_id, req.rank, req.step
        job = self.jobs.get(job_id)
        new = job is None
        if new:
            job = self._new_job(job_id, now)
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
        dropped = req.dropped_reports
        finite = isfinite(req.loss) and isfinite(req.grad_norm)   # unset reads 0.0: finite
        if not (new or dropped or not finite or req.HasField("canary") or req.HasField("vote")
                or req.frozen_changed):
            return None
        out = ReportOutcome()
        if new:
            out.findings.append(Finding(ek.JOB_STARTED, Severity.INFO, f"job/{job_id}",
                                        f"job {job_id} first reported (rank {rank}, step {step})",
                                        {"job_id": job_id, "rank": rank, "step": step,
                                         "world_size": req.world_size}))
        if dropped:
            out.dropped_delta = dropped
            job.dropped_reports += dropped
            out.findings.append(Finding(
                ek.JOB_REPORTS_DROPPED, Severity.WARNING, f"job/{job_id}/rank/{rank}",
                f"rank {rank} dropped {dropped} report(s): the agent was slow or down",
                {"job_id": job_id, "rank": rank, "dropped": dropped}))
        if not finite:
            self._nonfinite(req, job, out, now)
        if req.HasField("canary"):
            self._canary(req, job, out, now)
        if req.HasField("vote"):
            self._vote(req, job, out, now)
        if req.frozen_changed:
            self._frozen(req, job, out, now)
        return out

    # -- rules -------------------------------------------------------------------------------------
    def _nonfinite(self, req: pb.ReportStepRequest, job: JobState, out: ReportOutcome, now: float) -> None:
        bad = [name for name in ("loss", "grad_norm")
               if req.HasField(name) and not math.isfinite(getattr(req, name))]
        if not bad or (req.step, req.rank) in job.nonfinite_steps:
            return
        job.nonfinite_steps.append((req.step, req.rank))
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
        if vote.step not in job.voted_steps:  # every rank reports the same vote: tell checkpoints once
            job.voted_steps.append(vote.step)
            out.job_events.append((vote.step, "vote_agreed" if vote.agreed else "vote_mismatch",
                                   "" if vote.agreed else f"replica vote disagreed ({vote.method})"))
        if vote.agreed:
            return
        out.mismatch = vote.step not in job.mismatch_steps
        suspects = [{"rank": s.rank, "host": s.host, "gpu_uuid": s.gpu_uuid} for s in vote.suspects]
        for s in vote.suspects:  # every reporter attaches evidence; the agent keeps only its own GPUs
            ev = Evidence(source="replica_vote", signal="mismatch", value=str(vote.step),
                          implies=State.SUSPECT,
                          reason=(f"replica vote at step {vote.step} of job {req.job_id}: rank {s.rank} "
                                  f"disagreed ({vote.method}, {vote.replicas} replicas)"),
                          time=now)
            out.evidence.append((s.gpu_uuid, s.host, ev))
        if not out.mismatch:
            return
        job.mismatch_steps.append(vote.step)
        job.state = State.SUSPECT
        job.reason = f"replica mismatch at step {vote.step}"
        names = ", ".join(f"rank {s['rank']} on {s['host'] or '?'} GPU {s['gpu_uuid'] or '?'}" for s in suspects)
        out.findings.append(Finding(
            ek.REPLICA_MISMATCH, Severity.CRITICAL, f"job/{req.job_id}",
            f"replica vote at step {vote.step}: suspect {names}",
            {"job_id": req.job_id, "step": vote.step, "method": vote.method, "replicas": vote.replicas,
             "replica_group": vote.replica_group or req.replica_group, "suspects": suspects,
             "reported_by_rank": req.rank}))

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

    def _frozen(self, req: pb.ReportStepRequest, job: JobState, out: ReportOutcome, now: float) -> None:
        if not req.frozen_changed or req.step in job.frozen_steps:
            return
        job.frozen_steps.append(req.step)
        names = list(req.frozen_changed)
        job.state, job.reason = State.SUSPECT, f"frozen parameters changed at step {req.step}"
        out.job_events.append((req.step, "sdc", f"frozen parameters changed on rank {req.rank}"))
        out.findings.append(Finding(
            ek.SDC_FROZEN_CHANGED, Severity.CRITICAL, f"job/{req.job_id}/rank/{req.rank}",
            f"{len(names)} frozen parameter(s) changed at step {req.step} on rank {req.rank}: "
            + ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""),
            {"job_id": req.job_id, "rank": req.rank, "step": req.step, "gpu_uuid": req.gpu_uuid,
             "host": req.host, "names": names[:100]}))
        if req.gpu_uuid:
            out.evidence.append((req.gpu_uuid, req.host, Evidence(
                source="frozen_params", signal="changed", value=str(req.step), implies=State.SUSPECT,
                reason=f"frozen parameters changed at step {req.step} of job {req.job_id} (rank {req.rank})",
                time=now)))
