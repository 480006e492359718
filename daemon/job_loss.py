"""Loss and gradient-norm anomaly detection per job, fed by the ranks' ReportStep calls. Pure.

Each rank reports its own (per micro-batch, per rank) loss. The job's detector is fed the mean over the
ranks that reported a step, once the step is complete (every rank of `world_size` reported, or two newer
steps have arrived: a dropped report must not stall the detector). Each step is fed once, in step order.
A straggler's report of a step already judged (at or before `horizon`) is late: counted, not fed; it never
resets the detector. Only a restore does (`restarted`, called by `daemon.jobs` when a rank's own step goes
back). That mean is the global-batch loss the
user plots; per-rank noise averages out. A rank whose own loss is NaN/Inf is flagged on its own by
`daemon.jobs` (it points at that rank's GPU); a NaN in the mean is the whole job's.

`JobLoss.add(...)` returns the detector's events for the steps it completed; `RollbackPolicy` (in
`probes.loss_detector`) turns a critical one into a rollback target given the VERIFIED checkpoints.
"""
from __future__ import annotations

import collections
import dataclasses
import math

from probes.loss_detector import LossDetector, LossDetectorConfig, LossEvent


@dataclasses.dataclass(slots=True)
class _Pending:
    world: int
    ranks: set[int] = dataclasses.field(default_factory=set)
    loss: list[float] = dataclasses.field(default_factory=list)
    grad: list[float] = dataclasses.field(default_factory=list)
    scale: float | None = None


class JobLoss:
    MAX_PENDING = 8

    def __init__(self, config: LossDetectorConfig | None = None) -> None:
        self.detector = LossDetector(config)
        self.pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()
        self.last_fed: int | None = None
        self.max_step: int | None = None
        self.late = 0   # reports of steps already judged (at or before `horizon`): not fed

    @property
    def horizon(self) -> int:
        """The newest step the detector has judged (-1: none); a report at or before it is late."""
        return -1 if self.last_fed is None else self.last_fed

    def restarted(self, step: int) -> None:
        """The job restored a checkpoint and goes on from `step` (a rank's own step went back: the job
        tracker's call, never inferred from one rank's late report). Steps before it are forgotten."""
        if self.last_fed is None or step > self.last_fed:
            return   # already restarted by another rank of the job (or nothing was judged past it)
        self.pending.clear()
        self.last_fed = step - 1
        self.max_step = step

    def add(self, step: int, rank: int, world_size: int, loss: float | None, grad_norm: float | None,
            loss_scale: float | None, now: float) -> list[LossEvent]:
        """Add one rank's values for `step`; the detector's events for the steps this completed. A report at
        or before `horizon` (a step already judged: a straggler's) returns [] and is counted in `late`; it
        never resets the detector (only `restarted` does)."""
        self.max_step = step if self.max_step is None else max(self.max_step, step)
        if self.last_fed is not None and step <= self.last_fed:
            if loss is not None or grad_norm is not None:
                self.late += 1
            return []
        pending = self.pending
        p = pending.get(step)
        created = p is None
        if created:
            out_of_order = bool(pending) and step < next(reversed(pending))
            p = pending[step] = _Pending(world=world_size)
            if out_of_order:  # rare (a straggler's report): keep the pending steps in step order
                self.pending = collections.OrderedDict(sorted(pending.items()))
        ranks = p.ranks
        if rank in ranks:
            return []
        ranks.add(rank)
        if loss is not None:
            p.loss.append(loss)
        if grad_norm is not None:
            p.grad.append(grad_norm)
        if loss_scale is not None:
            p.scale = loss_scale if p.scale is None else min(p.scale, loss_scale)
        # A step is fed when complete, or stale (two newer steps, or too many pending): completion changes
        # only with this rank, staleness only with a new step, so other reports have nothing to drain.
        if created or (p.world > 0 and len(ranks) >= p.world):
            return self._drain(now)
        return []

    def _drain(self, now: float) -> list[LossEvent]:
        events: list[LossEvent] = []
        newest = next(reversed(self.pending))
        while self.pending:
            step, p = next(iter(self.pending.items()))
            complete = p.world > 0 and len(p.ranks) >= p.world
            stale = newest - step >= 2 or len(self.pending) > self.MAX_PENDING
            if not (complete or stale):
                break
            del self.pending[step]
            self.last_fed = step
            events += self.detector.update(step, _mean(p.loss), _mean(p.grad), now, loss_scale=p.scale)
        return events


def _mean(xs: list[float]) -> float | None:
    if not xs:
        return None
    total = sum(xs)
    if math.isfinite(total):
        return total / len(xs)
    # a NaN or an infinity among the ranks (or finite values that overflow the sum: then inf, as before)
    return math.nan if any(math.isnan(x) for x in xs) else math.inf
