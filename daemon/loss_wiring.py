"""ReportStep -> per-job loss detector -> events, checkpoint verification, rollback directives.

A critical loss event (sustained, divergence, non-finite mean, loss-scale collapse) is journaled, tells
the checkpoint coordinator (checkpoints from its start on are not VERIFIED), and, with rollback enabled,
becomes a directive: roll back to the newest VERIFIED checkpoint older than the anomaly's start and
skip the batches after it. The directive is handed to each rank once, in its next ReportStep reply.
A step that goes backwards (the job restored a checkpoint) is reported to the coordinator as a rollback.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import TYPE_CHECKING

from daemon.job_loss import JobLoss
from probes.loss_detector import LossDetectorConfig, LossEvent, RollbackPolicy
from sdcwatch import event_kinds as ek
from sdcwatch.types import Severity
from proto.sdcwatch.v1 import agent_pb2 as pb

if TYPE_CHECKING:
    from daemon.agent import Agent

log = logging.getLogger(__name__)

DIRECTIVE_TTL_S = 600.0


class LossWiring:
    def __init__(self, agent: "Agent", config: LossDetectorConfig | None = None,
                 policy: RollbackPolicy | None = None) -> None:
        self.agent = agent
        self.config = config or LossDetectorConfig()
        self.policy = policy or RollbackPolicy()
        self.jobs: dict[str, JobLoss] = {}
        self.rank_steps: dict[str, dict[int, int]] = {}
        self.rollbacks_seen: dict[str, collections.deque[int]] = {}
        self.directives: dict[str, tuple[pb.Directive, set[int], float, int]] = {}  # + anomaly start

    def forget(self, job: str) -> None:
        for d in (self.jobs, self.rank_steps, self.rollbacks_seen, self.directives):
            d.pop(job, None)  # type: ignore[attr-defined]

    def on_report(self, req: pb.ReportStepRequest, now: float) -> list[pb.Directive]:
        job, rank, step = req.job_id, req.rank, req.step
        self._notice_rollback(job, rank, step)
        jl = self.jobs.get(job)
        if jl is None:
            jl = self.jobs[job] = JobLoss(self.config)
        has = req.HasField
        events = jl.add(step, rank, req.world_size, req.loss if has("loss") else None,
                        req.grad_norm if has("grad_norm") else None,
                        req.loss_scale if has("loss_scale") else None, now)
        for ev in events:
            self._publish(job, ev)
        return self._deliver(job, rank, now) if self.directives else []

    # -- pieces ------------------------------------------------------------------------------------
    def _notice_rollback(self, job: str, rank: int, step: int) -> None:
        steps = self.rank_steps.get(job)
        if steps is None:
            steps = self.rank_steps[job] = {}
        prev = steps.get(rank)
        if len(steps) < 4096 or prev is not None:
            steps[rank] = step
        if prev is None or step >= prev or step == 0:  # step 0 again: a fresh start, not a restore
            return
        restored = step - 1
        seen = self.rollbacks_seen.setdefault(job, collections.deque(maxlen=64))
        if restored in seen:
            return
        seen.append(restored)
        pending = self.directives.get(job)
        if pending is not None and pending[0].target_step <= restored < pending[3]:
            # the job already went back to before that anomaly (e.g. for a replica mismatch): the directive
            # would roll back again and skip good batches
            del self.directives[job]
        self.agent.bus.publish(ek.JOB_ROLLBACK, f"job/{job}",
                               f"job {job} went back from step {prev} to {step}: restored step {restored}",
                               {"job_id": job, "from_step": prev, "restored_step": restored, "rank": rank})
        self.agent.job_event(job, restored, "rollback", f"the job restored step {restored}")

    def _publish(self, job: str, ev: LossEvent) -> None:
        details = {"job_id": job, "step": ev.step, "signal": ev.signal, "kind": ev.kind,
                   "value": _num(ev.value), "baseline": _num(ev.baseline), "magnitude": _num(ev.magnitude),
                   "start_step": ev.start_step}
        event = self.agent.bus.publish(ev.event_kind, f"job/{job}", ev.message, details, severity=ev.severity)
        if ev.severity != Severity.CRITICAL:
            return
        self.agent.job_event(job, ev.start_step, "nan" if ev.kind == "nonfinite" else "loss_anomaly",
                             f"{ev.signal} {ev.kind} from step {ev.start_step}")
        if self.agent.config.jobs.rollback and ev.kind in self.policy.kinds:
            seq = event.seq if event is not None else 0   # 0: folded into a repeat count
            task = asyncio.get_running_loop().create_task(self._plan_rollback(job, ev, seq))
            task.add_done_callback(lambda t: t.exception() and log.error("rollback planning failed: %s",
                                                                         t.exception()))

    async def _plan_rollback(self, job: str, ev: LossEvent, seq: int) -> None:
        svc = self.agent.checkpoints
        verified: list[int] = []
        if svc is not None:
            infos = await asyncio.to_thread(svc.coordinator.list, job)
            verified = [i.step for i in infos if i.state == "VERIFIED"]
        decision = self.policy.decide(ev, verified)
        if decision is None:
            self.agent.bus.publish(ek.JOB_ROLLBACK_IMPOSSIBLE, f"job/{job}",
                                   f"no VERIFIED checkpoint older than step {ev.start_step} to roll back to",
                                   {"job_id": job, "anomaly_start": ev.start_step, "verified": verified[-8:]})
            return
        skip = max(0, decision.skip_to_step - (decision.target_step + 1))
        directive = pb.Directive(kind=pb.Directive.KIND_ROLLBACK, target_step=decision.target_step,
                                 skip_batches=skip, reason=decision.reason, event_seq=seq)
        self.directives[job] = (directive, set(), time.time(), ev.start_step)
        self.agent.bus.publish(ek.JOB_ROLLBACK_DIRECTIVE, f"job/{job}",
                               f"rollback directive: restore step {decision.target_step}, skip {skip} batches "
                               f"({decision.reason})",
                               {"job_id": job, "target_step": decision.target_step, "skip_batches": skip,
                                "cause_seq": seq})

    def _deliver(self, job: str, rank: int, now: float) -> list[pb.Directive]:
        entry = self.directives.get(job)
        if entry is None:
            return []
        directive, delivered, created, _start = entry
        if now - created > DIRECTIVE_TTL_S:
            del self.directives[job]
            return []
        if rank in delivered:
            return []
        delivered.add(rank)
        return [directive]


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)
