"""The compute gate: pre-reduction checks every step, replay audits every K steps, a veto before the update.

    checks = ComputeChecks.attach(ddp_model, optimizer, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    for batch in loader:
        checks.retain(batch)                  # the replayable step: the batch and the RNG state
        loss_fn(ddp_model, batch).backward()  # the DDP hook summarises each bucket before its all-reduce
        optimizer.step()                      # GATE: the ranks compare; a suspect step is replayed, classified,
        optimizer.zero_grad()                 #       and applied or dropped (a Veto keeps the step's number)

The stage (`name="compute"`, `Phase.GATE`) runs on every rank in the same order, so its collectives pair
up: one all-gather of the bucket summaries every step (checksums.grad_checks), the robust comparison, and,
only when a rank is an outlier, has a non-finite value or is due for an audit, the replays of
checksums.replay. Every rank reaches the same verdict from the same gathered rows, so all drop or all
apply. A step is replayed at most once per suspect and never retried: the gate never loops.

How the update is masked. On gloo/CPU the gather is synchronous and the verdict is on the host before
`optimizer.step()`: a suspect step's update is vetoed through the step guard (`Veto`), its number kept.
On CUDA (the design; not built yet: today the CUDA path reads the gathered rows on the host, one
synchronisation per step) the gather and the comparison are device ops and the verdict is a float flag on
the device that the optimizer's own skip respects, as a fused optimizer skips on GradScaler's `found_inf`
(`optimizer.found_inf`, combined with the scaler's when there is one): no host synchronisation in the step.
The host reads the flag a step later (a non-blocking copy) and then replays the masked step from its
retained batch; a step classified DATA there is lost rather than applied late (the weights never see a
suspect update either way). Cost on the device path: the all-gather of 32 bytes per bucket per rank and a
handful of tiny kernels (median, log, max) per step.

Findings (`ComputeFinding`) name the faulty rank with its host and GPU UUID and the evidence; with
`monitor=` the Monitor's next step report carries them to the agent (ReportStepRequest.compute). Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checksums.grad_checks import GradSummaries, SpreadTracker, StatsVerdict, stats_of
from checksums.replay import Cause, Classification, LossFn, Replayer
from checksums.reporter import ComputeFinding
from checksums.step_guard import Phase, StepContext, StepGuard, Veto

logger = logging.getLogger(__name__)

DEFAULT_AUDIT_EVERY = 334      # one replay per 334 steps: <= 0.3% when a replay costs about one step


@dataclasses.dataclass(frozen=True, slots=True)
class ComputeStatus:
    exact: bool                # replays compare exact fingerprints (False: the rounding-aware bound)
    steps: int
    suspicions: int
    dropped: int
    audits: int
    replays: int
    audit_every: int
    spread_max: float          # the largest learned clean spread (log units) over buckets and statistics
    max_score_clean: float     # the largest score of a clean step after warm-up (units of the spread)
    margin: float


class ComputeChecks:
    """The GATE stage of the compute checks (see the module docstring). Build with `ComputeChecks.attach`."""

    name = "compute"
    phase = Phase.GATE

    def __init__(self, ddp: nn.Module, optimizer: torch.optim.Optimizer, *, loss_fn: LossFn,
                 margin: float = 3.0, warmup: int = 20, audit_every: int = DEFAULT_AUDIT_EVERY,
                 group: Any = None, host: str | None = None, gpu_uuid: str = "",
                 monitor: Any = None, inject_bucket: Callable[[int, torch.Tensor], None] | None = None,
                 max_findings: int = 1000) -> None:
        if audit_every < 0:
            raise ValueError(f"audit_every is a number of steps >= 0 (0: no audits), got {audit_every!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.summaries = GradSummaries(ddp, group=group, inject=inject_bucket)
        device = self.summaries.params[0].device if self.summaries.params else torch.device("cpu")
        self.device = device
        self.replayer = Replayer(ddp.module, self.summaries, loss_fn, device=device, group=group)
        self.tracker = SpreadTracker(margin=margin, warmup=warmup)
        self.audit_every = audit_every
        where = [None] * self.world
        dist.all_gather_object(where, (host if host is not None else socket.gethostname(), gpu_uuid),
                               group=group)
        self.where: list[tuple[str, str]] = [tuple(w) for w in where]  # type: ignore[misc]
        self.findings: collections.deque[ComputeFinding] = collections.deque(maxlen=max_findings)
        self._unreported: collections.deque[ComputeFinding] = collections.deque(maxlen=64)
        self._last_audit: dict[int, int] = {}      # rank -> the step of its last audit that passed
        self.last_verdict: StatsVerdict | None = None
        self._steps = 0
        self._suspicions = 0
        self._dropped = 0
        self._audits = 0
        self._determinism_checked = False
        self.guard = StepGuard.attach(optimizer)
        self.guard.add(self)
        if monitor is not None:
            monitor.report_compute(self.take_findings)

    @classmethod
    def attach(cls, ddp: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> ComputeChecks:
        return cls(ddp, optimizer, **kwargs)

    def retain(self, batch: Any) -> None:
        """The step's batch and RNG state, kept so the step can be replayed; call before the forward."""
        self.replayer.retain(batch)

    # ---- the stage ----------------------------------------------------------------------------------

    def run(self, ctx: StepContext) -> Veto | None:
        rows = self.summaries.gather().cpu()
        self.summaries.clear()
        self._steps += 1
        if not self._determinism_checked:
            self._determinism_checked = True
            if not self.replayer.check_determinism():
                logger.warning("sdcwatch: replays of one batch differ bit for bit on this model; compute "
                               "replays compare norms within a rounding bound instead of fingerprints")
        stats = stats_of(rows)
        verdict = self.tracker.judge(stats)
        self.last_verdict = verdict
        outcomes: list[tuple[str, int, Classification]] = []
        for r in verdict.suspects[:2]:                   # at most two replays per step: bounded
            detector = "nonfinite" if r in verdict.nonfinite else "stats"
            outcomes.append((detector, r, self.replayer.classify(r, rows[r])))
        if not outcomes and self.audit_every and ctx.step % self.audit_every == 0:
            audited = (ctx.step // self.audit_every) % self.world
            self._audits += 1
            got = self.replayer.audit(audited, rows[audited])
            if got is not None:
                outcomes.append(("audit", audited, got))
            else:
                self._last_audit[audited] = ctx.step
        if not outcomes:
            return None
        self._suspicions += 1
        drop = any(c.drop or d == "nonfinite" for d, _, c in outcomes)
        if not drop:
            self.tracker.learn(stats)                    # the data's own spread: widen it
        for detector, r, c in outcomes:
            self._record(ctx.step, detector, r, c, drop, verdict)
        if drop:
            self._dropped += 1
            why = "; ".join(f"{d} rank {r}: {c.cause.value} ({c.detail})" for d, r, c in outcomes)
            return Veto(self.name, why)
        return None

    def _record(self, step: int, detector: str, suspect: int, c: Classification, drop: bool,
                verdict: StatsVerdict) -> None:
        score = verdict.scores[suspect] if suspect < len(verdict.scores) else 0.0
        where = tuple((r, *self.where[r]) for r in c.faulty)
        # an audit finds what may have slipped through since the rank's last clean audit
        since = self._last_audit.get(suspect, 0) + 1 if detector == "audit" else step
        finding = ComputeFinding(step=step, detector=detector, suspect=suspect, cause=c.cause.value,
                                 faulty=c.faulty, dropped=drop, detail=c.detail, score=score,
                                 bucket=verdict.bucket, stat=verdict.stat, where=where, since_step=since)
        self.findings.append(finding)
        self._unreported.append(finding)
        if self.rank == 0 or self.rank in c.faulty:
            logger.warning("sdcwatch: compute check at step %d: %s on rank %d -> %s, faulty %s, %s",
                           step, detector, suspect, c.cause.value, list(where),
                           "dropped" if drop else "applied")

    # ---- what it says -------------------------------------------------------------------------------

    def take_findings(self) -> tuple[ComputeFinding, ...]:
        """The findings not handed out yet, oldest first (the Monitor puts them on its next step report)."""
        out = tuple(self._unreported)
        self._unreported.clear()
        return out

    def status(self) -> ComputeStatus:
        spread = self.tracker.spread
        return ComputeStatus(exact=self.replayer.exact, steps=self._steps, suspicions=self._suspicions,
                             dropped=self._dropped, audits=self._audits, replays=self.replayer.replays,
                             audit_every=self.audit_every,
                             spread_max=float(spread.max()) if spread is not None else 0.0,
                             max_score_clean=self.tracker.max_score_clean, margin=self.tracker.margin)

    def close(self) -> None:
        self.guard.remove(self.name)


__all__ = ["Cause", "ComputeChecks", "ComputeFinding", "ComputeStatus"]
