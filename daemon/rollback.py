"""Rollback planning: a critical loss event (sustained, divergence, non-finite mean, loss-scale collapse)
becomes a directive to roll back to the newest VERIFIED checkpoint older than the anomaly's start and skip
the batches after it (`probes.loss_detector.RollbackPolicy`, pure). A replica-mismatch incident
(`daemon.jobs.MismatchIncident`) becomes a directive to the newest VERIFIED checkpoint older than its first
mismatching step, replaying the batches since (skip 0: the fault was the hardware's, not the data's). Ranks
that repair in place (checksums.replica_recovery, 3+ replicas with a majority) go back past the incident's
step without it: the tracker drops a directive the job no longer needs (`JobTracker._restored`), and a rank
ignores a directive older than its own recovery.

The job tracker asks for a plan (`ReportOutcome.rollbacks`, daemon/jobs.py); planning reads the job's
checkpoints (Redis, off the event loop), so it runs as a background task; the directive goes back to the
tracker (`JobTracker.set_directive`), which hands it to each rank once, in its next ReportStep reply. It
plans once the checkpoint coordinator has taken every event reported before the anomaly (`ready`: the
checkpoint feed's `handed`), so the VERIFIED steps it reads are those of the job as of the anomaly (a loaded
agent's feed runs seconds behind: the votes that verify the checkpoint before it, or the bad events that
block one, would otherwise be missed).

A GPU that keeps computing wrong (`daemon.jobs.ComputeIncident`: a persistent compute fault, or faults on
two steps) becomes a STOP directive instead: a rollback on the same GPU would compute wrong again, and a job
whose every update the compute gate drops makes no progress. Its `target_step` is the checkpoint to restart
from without that GPU: the newest VERIFIED one older than the incident's first suspect step (0, and the
reason says so, when there is none). The `job.stop_directive` event carries it.

Every directive's `event_seq` is its announcing event's own (`job.rollback_directive`, `job.stop_directive`;
the cause's is in the event's `cause_seq`): the ranks act on each seq once, in order.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Protocol

from daemon.background import Background
from daemon.events import Publisher
from daemon.jobs import ComputeIncident, JobTracker, MismatchIncident
from daemon.pools import WorkPool
from probes.loss_detector import LossEvent, RollbackPolicy
from sdcwatch import event_kinds as ek
from proto.sdcwatch.v1 import agent_pb2 as pb


class VerifiedSteps(Protocol):
    def verified_steps(self, job_id: str) -> list[int]:
        """Blocking: the job's VERIFIED checkpoint steps, oldest first."""
        ...


class RollbackPlanner:
    def __init__(self, policy: RollbackPolicy, *, checkpoints: VerifiedSteps, jobs: JobTracker,
                 publisher: Publisher, background: Background, pool: WorkPool | None = None,
                 timeout_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self.policy = policy
        # the Redis reads of planning: their own pool, each bounded (never asyncio's shared default executor)
        self.pool = pool or WorkPool("rollback-planning", workers=2)
        self.timeout_s = timeout_s
        self.checkpoints = checkpoints
        self.jobs = jobs
        self.publisher = publisher
        self.background = background
        self.clock = clock   # the reports' clock (the tracker's `now`)

    def request(self, job: str, ev: LossEvent | MismatchIncident | ComputeIncident, event_seq: int,
                ready: Awaitable[None] | None = None) -> None:
        """Plan a rollback for the anomaly journaled as `event_seq` (in the background), once `ready` (the
        checkpoint coordinator has taken the job's events up to the anomaly) is done."""
        self.background.start(self.plan(job, ev, event_seq, ready, self.jobs.restores(job)),
                              name=f"rollback-plan-{job}")

    async def plan(self, job: str, ev: LossEvent | MismatchIncident | ComputeIncident, seq: int,
                   ready: Awaitable[None] | None = None, restores_at: int | None = None) -> None:
        if ready is not None:
            try:
                await asyncio.wait_for(ready, self.timeout_s)
            except asyncio.TimeoutError:
                self._unread(job, ev, seq, restores_at, f"the checkpoint coordinator did not take the events "
                             f"before the anomaly in {self.timeout_s:.0f}s")
                return
        try:
            verified = await asyncio.wait_for(self.pool.run(self.checkpoints.verified_steps, job), self.timeout_s)
        except asyncio.TimeoutError:
            self._unread(job, ev, seq, restores_at, f"the checkpoint index did not answer in "
                         f"{self.timeout_s:.0f}s ({self.pool.describe()})")
            return
        if isinstance(ev, MismatchIncident):
            self._plan_mismatch(job, ev, seq, verified, restores_at)
            return
        if isinstance(ev, ComputeIncident):
            self._plan_stop(job, ev, seq, verified, restores_at)
            return
        decision = self.policy.decide(ev, verified)
        if decision is None:
            self._impossible(job, ev, f"no VERIFIED checkpoint older than step {ev.start_step} to roll back to",
                             verified)
            return
        skip = max(0, decision.skip_to_step - (decision.target_step + 1))
        self._direct(job, pb.Directive(kind=pb.Directive.KIND_ROLLBACK, target_step=decision.target_step,
                                       skip_batches=skip, reason=decision.reason, event_seq=seq),
                     ev.start_step, restores_at, ek.JOB_ROLLBACK_DIRECTIVE,
                     f"rollback directive: restore step {decision.target_step}, skip {skip} batches "
                     f"({decision.reason})",
                     {"job_id": job, "target_step": decision.target_step, "skip_batches": skip, "cause_seq": seq})

    def _direct(self, job: str, directive: pb.Directive, anomaly_start: int, restores_at: int | None,
                kind: ek.EventKind, message: str, details: dict[str, Any]) -> None:
        """Hand `directive` to the tracker (nothing more when the plan is stale: the job went back before
        the anomaly meanwhile) and announce it. Its `event_seq` becomes the announcing event's own: fresh and
        increasing for every directive. The ranks agree on a directive by its seq and act on each seq once,
        in order (`Monitor.agreed_directive`), so a cause's seq will not do: a cause folded into a repeat
        count has none (0), and a directive with 0 after one the job already took would never be agreed,
        holding every later directive behind it. Set before any await: no report is handed it in between."""
        if not self.jobs.set_directive(job, directive, anomaly_start, self.clock(), restores_at):
            return
        event = self.publisher.publish(kind, f"job/{job}", message, details)
        if event is not None:
            directive.event_seq = event.seq

    def _unread(self, job: str, ev: LossEvent | MismatchIncident | ComputeIncident, seq: int,
                restores_at: int | None, why: str) -> None:
        """The VERIFIED steps could not be read (`why`): no rollback is planned; a stop needs no checkpoint,
        so it goes out all the same, the restart point left to the user."""
        if isinstance(ev, ComputeIncident):
            self._plan_stop(job, ev, seq, None, restores_at, why)
        else:
            self._impossible(job, ev, f"{why}: no rollback planned")

    def _plan_stop(self, job: str, inc: ComputeIncident, seq: int, verified: list[int] | None,
                   restores_at: int | None = None, unread: str = "") -> None:
        """`verified` None: the checkpoints could not be read (`unread` says why): the job stops all the
        same, the restart point left to `sdcwatch ckpt ls`."""
        if not self.jobs.stop_open(job, inc.first_step):
            return   # the job went back before the incident meanwhile (restarted): nothing to stop
        older = [s for s in verified or () if s < inc.first_step]
        target = max(older) if older else 0
        if verified is None:
            restart = (f"{unread}: restart it without that GPU from the newest VERIFIED checkpoint older "
                       f"than step {inc.first_step} (sdcwatch ckpt ls --job {job})")
        elif older:
            restart = f"restart it without that GPU from VERIFIED step {target}"
        else:
            restart = (f"no VERIFIED checkpoint is older than step {inc.first_step}: restart it without that "
                       "GPU from its start, or from a checkpoint you have checked")
        reason = (f"{inc.cause} compute fault at step {inc.step} on {inc.who} (its updates are suspect from "
                  f"step {inc.first_step}): the job stops; {restart}")
        self._direct(job, pb.Directive(kind=pb.Directive.KIND_STOP, target_step=target, skip_batches=0,
                                       reason=reason, event_seq=seq),
                     inc.first_step, restores_at, ek.JOB_STOP_DIRECTIVE, f"stop directive: {reason}",
                     {"job_id": job, "target_step": target, "verified": bool(older), "first_step": inc.first_step,
                      "step": inc.step, "cause": inc.cause, "gpu_uuids": list(inc.gpus), "cause_seq": seq})

    def _impossible(self, job: str, ev: LossEvent | MismatchIncident, why: str,
                    verified: list[int] | None = None) -> None:
        """No rollback planned for `ev`: a `job.rollback_impossible` event saying why (with the newest
        VERIFIED steps). For a replica-mismatch incident the tracker plans again while its replicas still
        disagree (a VERIFIED checkpoint may come, or the checkpoints answer, later): the event says when."""
        retry = (self.jobs.mismatch_unplanned(job, ev.first_step, self.clock())
                 if isinstance(ev, MismatchIncident) else None)
        if retry is not None:
            why += f"; planned again in {retry:.0f}s if the replicas still disagree"
        self.publisher.publish(ek.JOB_ROLLBACK_IMPOSSIBLE, f"job/{job}", why,
                               {"job_id": job, "anomaly_start": _start(ev), "verified": (verified or [])[-8:],
                                "replan_in_s": retry if retry is not None else 0.0})

    def _plan_mismatch(self, job: str, inc: MismatchIncident, seq: int, verified: list[int],
                       restores_at: int | None = None) -> None:
        if not self.jobs.mismatch_open(job, inc.first_step):
            return   # the ranks already went back before it (their own rollback or repair): nothing to do
        older = [s for s in verified if s < inc.first_step]
        if not older:
            self._impossible(job, inc, f"replicas disagree from step {inc.first_step} and no VERIFIED "
                             "checkpoint is older to roll back to", verified)
            return
        target = max(older)
        reason = (f"replica mismatch from step {inc.first_step} ({inc.method}, {inc.replicas} replicas): roll "
                  f"back to verified step {target} and replay the batches since")
        self._direct(job, pb.Directive(kind=pb.Directive.KIND_ROLLBACK, target_step=target, skip_batches=0,
                                       reason=reason, event_seq=seq),
                     inc.first_step, restores_at, ek.JOB_ROLLBACK_DIRECTIVE,
                     f"rollback directive: restore step {target}, skip 0 batches ({reason})",
                     {"job_id": job, "target_step": target, "skip_batches": 0, "cause_seq": seq})


def _start(ev: LossEvent | MismatchIncident) -> int:
    return ev.first_step if isinstance(ev, MismatchIncident) else ev.start_step
