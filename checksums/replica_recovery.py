"""Recovery from a replica mismatch, in the step guard: the vote's verdict gates the next update, and with a
majority (3+ replicas) the odd replicas are repaired in place from a majority replica's state.

    recovery = ReplicaRecovery.attach(monitor)     # after Monitor.attach(model, optimizer, ...)

Two stages on the optimizer's `StepGuard` (checksums/step_guard.py), apart from any other GATE stage:

- `replica.vote_gate` (Phase.GATE): reads the votes of the steps taken so far (`monitor.flush()`: on CPU they
  are already read; on CUDA this waits for the previous step's fingerprint gather, launched a whole forward
  and backward earlier, so usually done: the cost is one host wait per step on an event that has normally
  completed, and it stops the host from running more than one step ahead of the GPU). A vote that disagreed,
  and that this stage has not acted on, vetoes this update: the suspect update is not applied. Every replica
  reads the same vote (it is an all_gather), so all of them veto the same step and stay in lock step.
  Gated on the host: a device-side mask (the update multiplied by the verdict, as fused optimizers skip on
  `found_inf`) would avoid the wait; not built.
- `replica.repair` (Phase.REPAIR): after a veto for a mismatch with a strict majority (3+ replicas), every
  parameter and optimizer-state tensor is broadcast from the lowest-ranked majority replica over the replica
  group, then fingerprinted and compared across the group (an all_gather of two int64): the repair counts
  only if every replica now holds the majority's exact bytes. The weights are then those after the last
  agreed update; the vetoed step's batch is skipped: bit-identical to a clean run that skipped that batch.
  With two replicas (no majority), or when the comparison after the copy fails, nothing is repaired: the
  gate keeps vetoing updates while the replicas differ, and the agent's rollback directive (the newest
  VERIFIED checkpoint older than the mismatch) brings every replica back; after the restore, call
  `monitor.guard.renumber(target)`.

Training-side module: torch and torch.distributed only; never imports the agent.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

from checksums.fingerprint import fingerprint_tensors_async
from checksums.step_guard import Phase, StepContext, Veto

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Repair:
    """One repair attempt: the vote's step, the replica copied from, whether every replica matched after."""

    vote_step: int
    at_step: int
    source_rank: int
    ok: bool
    reason: str


class ReplicaRecovery:
    """See the module docstring. `monitor`: the rank's `checksums.monitor.Monitor` (its guard, replica group
    and votes)."""

    def __init__(self, monitor: Any) -> None:
        if monitor.guard is None:
            raise ValueError("ReplicaRecovery needs a Monitor attached with an optimizer (its step guard)")
        self.monitor = monitor
        self.guard = monitor.guard
        self._acted: Any = None           # the last vote acted on
        self._pending: Any = None         # a disagreeing vote the gate vetoed for, for the repair stage
        self.repairs: list[Repair] = []
        self.vetoed = 0
        self.gate = _Gate(self)
        self.repair = _Repair(self)

    @classmethod
    def attach(cls, monitor: Any) -> "ReplicaRecovery":
        rec = cls(monitor)
        rec.guard.add(rec.gate)
        rec.guard.add(rec.repair)
        return rec

    def detach(self) -> None:
        self.guard.remove(self.gate.name)
        self.guard.remove(self.repair.name)

    # ---- the gate ------------------------------------------------------------------------------------
    def _gate(self, ctx: StepContext) -> Veto | None:
        if self.monitor.replica_group is None:
            return None
        self.monitor.flush()
        vote = self.monitor.last_vote
        if vote is None or vote is self._acted or vote.result.agreed:
            return None
        self._acted = vote
        self._pending = vote
        self.vetoed += 1
        return Veto(self.gate.name, f"replica vote at step {vote.step} disagreed ({vote.result.method}): "
                                    "the update is not applied")

    # ---- the repair ----------------------------------------------------------------------------------
    def _repair(self, ctx: StepContext) -> Veto | None:
        vote, self._pending = self._pending, None
        if vote is None:
            return None
        result = vote.result
        if result.majority is None:   # two replicas, or no strict majority: the rollback directive recovers
            self.repairs.append(Repair(vote.step, ctx.step, -1, False, f"no majority ({result.method})"))
            return None
        odd = {s.rank for s in result.suspects}
        source = min(r for r in vote.ranks if r not in odd)
        group = self.monitor.replica_group
        tensors = self._state_tensors(ctx.optimizer)
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, src=source, group=group)
        mine = fingerprint_tensors_async(tensors).to(torch.int64).reshape(-1)
        gathered = [torch.empty_like(mine) for _ in vote.ranks]
        dist.all_gather(gathered, mine, group=group)
        ok = all(torch.equal(g, gathered[0]) for g in gathered)
        why = (f"every replica matches rank {source} after the copy" if ok else
               "replicas still differ after the copy (fingerprints compared): rollback needed")
        self.repairs.append(Repair(vote.step, ctx.step, source, ok, why))
        (logger.warning if ok else logger.error)(
            "sdcwatch: replica repair at step %d (vote at step %d, odd ranks %s): %s", ctx.step, vote.step,
            sorted(odd), why)
        return None

    @staticmethod
    def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Every parameter and every optimizer-state tensor, in an order all replicas share."""
        out: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                out.append(p.data)
                state = optimizer.state.get(p, {})
                for key in sorted(state):
                    v = state[key]
                    if isinstance(v, torch.Tensor):
                        out.append(v)
        return out


class _Gate:
    phase = Phase.GATE
    name = "replica.vote_gate"

    def __init__(self, owner: ReplicaRecovery) -> None:
        self._owner = owner

    def run(self, ctx: StepContext) -> Veto | None:
        return self._owner._gate(ctx)


class _Repair:
    phase = Phase.REPAIR
    name = "replica.repair"

    def __init__(self, owner: ReplicaRecovery) -> None:
        self._owner = owner

    def run(self, ctx: StepContext) -> Veto | None:
        return self._owner._repair(ctx)
