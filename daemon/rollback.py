"""Rollback planning: a critical loss event (sustained, divergence, non-finite mean, loss-scale collapse)
becomes a directive to roll back to the newest VERIFIED checkpoint older than the anomaly's start and skip
the batches after it (`probes.loss_detector.RollbackPolicy`, pure).

The job tracker asks for a plan (`ReportOutcome.rollbacks`, daemon/jobs.py); planning reads the job's
checkpoints (Redis, off the event loop), so it runs as a background task; the directive goes back to the
tracker (`JobTracker.set_directive`), which hands it to each rank once, in its next ReportStep reply.
"""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

from daemon.background import Background
from daemon.events import Publisher
from daemon.jobs import JobTracker
from probes.loss_detector import LossEvent, RollbackPolicy
from sdcwatch import event_kinds as ek
from proto.sdcwatch.v1 import agent_pb2 as pb


class VerifiedSteps(Protocol):
    def verified_steps(self, job_id: str) -> list[int]:
        """Blocking: the job's VERIFIED checkpoint steps, oldest first."""
        ...


class RollbackPlanner:
    def __init__(self, policy: RollbackPolicy, *, checkpoints: VerifiedSteps, jobs: JobTracker,
                 publisher: Publisher, background: Background) -> None:
        self.policy = policy
        self.checkpoints = checkpoints
        self.jobs = jobs
        self.publisher = publisher
        self.background = background

    def request(self, job: str, ev: LossEvent, event_seq: int) -> None:
        """Plan a rollback for the loss event journaled as `event_seq` (in the background)."""
        self.background.start(self.plan(job, ev, event_seq), name=f"rollback-plan-{job}")

    async def plan(self, job: str, ev: LossEvent, seq: int) -> None:
        verified = await asyncio.to_thread(self.checkpoints.verified_steps, job)
        decision = self.policy.decide(ev, verified)
        if decision is None:
            self.publisher.publish(ek.JOB_ROLLBACK_IMPOSSIBLE, f"job/{job}",
                                   f"no VERIFIED checkpoint older than step {ev.start_step} to roll back to",
                                   {"job_id": job, "anomaly_start": ev.start_step, "verified": verified[-8:]})
            return
        skip = max(0, decision.skip_to_step - (decision.target_step + 1))
        directive = pb.Directive(kind=pb.Directive.KIND_ROLLBACK, target_step=decision.target_step,
                                 skip_batches=skip, reason=decision.reason, event_seq=seq)
        self.jobs.set_directive(job, directive, ev.start_step, time.time())
        self.publisher.publish(ek.JOB_ROLLBACK_DIRECTIVE, f"job/{job}",
                               f"rollback directive: restore step {decision.target_step}, skip {skip} "
                               f"batches ({decision.reason})",
                               {"job_id": job, "target_step": decision.target_step, "skip_batches": skip,
                                "cause_seq": seq})
