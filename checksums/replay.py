"""Replay: recompute a rank's forward and backward from its retained batch and compare exact fingerprints.

The rank keeps each step's batch and RNG state (`Replayer.retain`, before the forward). A replay runs the
user's `loss_fn(module, batch)` on the bare module (not the DDP wrapper: no hooks, no all-reduce) under
that RNG state and takes the gradient with `torch.autograd.grad`, so the step's own `.grad` and the
module's buffers (batch-norm statistics) are left as they were. The recomputed gradient is summarised
bucket by bucket in the DDP layout (checksums.grad_checks), so its fingerprints compare bit for bit with
the ones the communication hook took before the reduction.

Two uses, both collectives (every rank calls, in the same order):
- `classify`: a step under suspicion (an outlier rank, a non-finite value, a failed audit). The suspect's
  batch is sent to every rank, every rank replays it, and `classify_replays` (pure) decides: the original
  reproduces everywhere (DATA: apply), the suspect's own replay agrees with the others but its original
  did not (TRANSIENT on the suspect: drop), or the suspect's replay disagrees with the others' majority
  (PERSISTENT on the suspect's GPU: drop). A rank whose replay disagrees with the majority is named too.
  With two ranks a disagreement has no majority: UNRESOLVED, naming the suspect (the statistics chose it).
- `audit`: every `every` steps one rank's batch is replayed by its neighbour; a mismatch becomes a
  `classify` of that rank (with 3+ ranks a third result decides; with 2 each replays its own as well).

One replay per step at most, never retried: the gate never loops.

Determinism: `check_determinism` replays one batch twice at start. When the two fingerprints differ the
comparisons fall back to a rounding-aware bound on the norm and max-abs (`exact=False`), said in status.

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checksums.grad_checks import GradSummaries, fingerprints_of, stats_of

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class Cause(str, enum.Enum):
    DATA = "data"                 # the original reproduces on every rank: a real gradient, apply it
    TRANSIENT = "transient"       # the suspect's own replay agrees with the others; its original did not
    PERSISTENT = "persistent"     # the suspect's replay disagrees with the others: its GPU computes wrong
    UNRESOLVED = "unresolved"     # no majority (two ranks, or every replay differs)


@dataclasses.dataclass(frozen=True, slots=True)
class Classification:
    cause: Cause
    faulty: tuple[int, ...]         # ranks whose arithmetic was wrong (empty for DATA)
    drop: bool                      # the step's update must not be applied
    detail: str


def _equal(a: torch.Tensor, b: torch.Tensor, exact: bool, rtol: float) -> bool:
    """Two summary rows [buckets, 4] agree: fingerprints bit for bit, or norm and max-abs within rtol."""
    if exact:
        return bool(torch.equal(fingerprints_of(a), fingerprints_of(b)))
    sa, sb = stats_of(a), stats_of(b)
    return bool(torch.allclose(sa, sb, rtol=rtol, atol=0.0, equal_nan=False))


def classify_replays(suspect: int, original: torch.Tensor, replays: torch.Tensor, *, exact: bool = True,
                     rtol: float = 1e-3) -> Classification:
    """Decide a suspicion from the suspect's original rows [B, 4] and every rank's replay of its batch
    [world, B, 4] (host tensors). Pure."""
    world = replays.shape[0]
    groups: list[list[int]] = []
    for r in range(world):
        for g in groups:
            if _equal(replays[g[0]], replays[r], exact, rtol):
                g.append(r)
                break
        else:
            groups.append([r])
    ref = max(groups, key=len)
    if len(ref) * 2 <= world:
        return Classification(Cause.UNRESOLVED, (suspect,), True,
                              f"no majority among the {world} replays of rank {suspect}'s batch")
    dissent = tuple(r for r in range(world) if r not in ref)
    if _equal(original, replays[ref[0]], exact, rtol):
        if dissent:
            return Classification(Cause.PERSISTENT, dissent, True,
                                  f"ranks {list(dissent)} recompute rank {suspect}'s batch wrong; ranks {ref} "
                                  "and its original agree")
        return Classification(Cause.DATA, (), False, f"rank {suspect}'s gradient reproduces on every rank")
    if suspect in ref:
        return Classification(Cause.TRANSIENT, (suspect,) + dissent, True,
                              f"rank {suspect}'s replay agrees with ranks {ref}, its original did not")
    return Classification(Cause.PERSISTENT, dissent, True,
                          f"rank {suspect} recomputes its wrong result again; ranks {ref} agree on another")


@dataclasses.dataclass(slots=True)
class Retained:
    batch: Any = None
    cpu_rng: torch.Tensor | None = None
    dev_rng: torch.Tensor | None = None


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


class Replayer:
    """Retains each step's batch and RNG state and recomputes gradients from them (see the module doc)."""

    def __init__(self, module: nn.Module, summaries: GradSummaries, loss_fn: LossFn, *,
                 device: torch.device, group: Any = None) -> None:
        self.module = module
        self.summaries = summaries
        self.loss_fn = loss_fn
        self.device = device
        self.group = group
        self.retained = Retained()
        self.exact = True
        self.replays = 0

    def retain(self, batch: Any) -> None:
        """Keep this step's batch and RNG state; call before the forward."""
        r = self.retained
        r.batch = batch
        r.cpu_rng = torch.get_rng_state()
        r.dev_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def replay(self, retained: Retained) -> torch.Tensor:
        """Summary rows [buckets, 4] of the gradient of `retained`'s batch on this rank, with its RNG state."""
        if retained.batch is None:
            raise RuntimeError("no batch retained: call retain(batch) before each step's forward")
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if retained.cpu_rng is not None:
                torch.set_rng_state(retained.cpu_rng)
            if retained.dev_rng is not None:
                torch.cuda.set_rng_state(retained.dev_rng, self.device)
            with torch.enable_grad():
                loss = self.loss_fn(self.module, retained.batch)
                grads = torch.autograd.grad(loss, self.summaries.params, allow_unused=True)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        self.replays += 1
        return self.summaries.bucket_grads(grads)

    def fetch(self, src: int, mine: Retained | None = None) -> Retained:
        """Rank `src`'s retained batch and RNG state (`mine`, default this step's) on every rank (a
        collective: all ranks call)."""
        mine = mine if mine is not None else self.retained
        payload = [None]
        if dist.get_rank(self.group) == src:
            payload = [(_map_tensors(mine.batch, lambda t: t.detach().cpu()), mine.cpu_rng,
                        None if mine.dev_rng is None else mine.dev_rng.cpu())]
        dist.broadcast_object_list(payload, src=src, group=self.group,
                                   device=self.device if self.device.type == "cuda" else None)
        batch, cpu_rng, dev_rng = payload[0]
        return Retained(_map_tensors(batch, lambda t: t.to(self.device)), cpu_rng, dev_rng)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        out = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(out, rows.contiguous(), group=self.group)
        return torch.stack(out).cpu()

    def classify(self, suspect: int, original: torch.Tensor, mine: Retained | None = None) -> Classification:
        """Every rank replays `suspect`'s batch (of this step, or `mine`: an earlier step's); the replays
        decide (a collective: all ranks call)."""
        retained = self.fetch(suspect, mine)
        rows = self.replay(retained)
        return classify_replays(suspect, original, self.gather(rows), exact=self.exact)

    def audit(self, audited: int, original: torch.Tensor) -> Classification | None:
        """Rank `audited`'s neighbour replays its batch; None when it agrees, else the full `classify`."""
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        auditor = (audited + 1) % world
        retained = self.fetch(audited)
        rows = self.replay(retained) if rank == auditor else torch.zeros_like(original, device=self.device)
        got = self.gather(rows)
        if _equal(original, got[auditor], self.exact, 1e-3):
            return None
        got = self.gather(self.replay(retained))                     # every rank replays it now
        c = classify_replays(audited, original, got, exact=self.exact)
        if c.cause is Cause.DATA:      # the auditor's first replay was the odd one out, once
            return Classification(Cause.TRANSIENT, (auditor,), False,
                                  f"auditor rank {auditor}'s replay of rank {audited}'s batch differed once; "
                                  "every replay after it agrees with the original")
        return c

    def check_determinism(self) -> bool:
        """Every rank replays rank 0's retained batch twice (a collective, after a first backward built the
        bucket layout); exact comparisons stay on only if all the results agree bit for bit, else the
        rounding-aware bound is used (`exact` False)."""
        retained = self.fetch(0)
        a = self.replay(retained)
        b = self.replay(retained)
        got = self.gather(torch.stack([a, b]))
        first = fingerprints_of(got[0, 0])
        self.exact = all(bool(torch.equal(fingerprints_of(got[r, k]), first))
                         for r in range(got.shape[0]) for k in range(2))
        self.replays -= 2
        return self.exact


def audit_every(budget: float, replay_s: float, step_s: float, *, least: int = 10) -> int:
    """Steps between audits so an audit (one replay) costs at most `budget` of training time."""
    if not 0 < budget < 1:
        raise ValueError(f"the audit budget is a fraction of step time in (0, 1), got {budget!r}")
    if step_s <= 0:
        return least
    return max(least, int(-(-replay_s // (budget * step_s))))
