"""Replay: recompute a rank's forward and backward from its retained batch and compare exact fingerprints.

The rank keeps each step's batch and RNG state (`Replayer.retain`, before the forward). With gradient
accumulation (`ddp.no_sync()` on all but the last micro-batch) `retain` is called before each micro-batch's
forward and keeps them all: the DDP hook fires on the last micro-batch only and summarises the accumulated
gradient, so a replay recomputes every micro-batch of the step and sums their gradients in the order
autograd accumulated them into `.grad` ((g1 + g2) + g3 ...), which reproduces the accumulated gradient bit
for bit. `loss_fn` must return what the loop back-propagates (divided by the number of micro-batches when
the loop divides). A replay runs the
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
- `classify_pair` (two ranks: the median names no one, there is no majority): both batches are replayed
  on both ranks, and `classify_pair_replays` (pure) decides. A transient fault does not repeat: the GPUs'
  replays of a batch agree with each other but not with its original, whose rank is named. A persistent
  fault repeats on its GPU: each GPU reproduces its own originals and the two disagree on both batches;
  fingerprints alone are symmetric then, so a third witness decides: each rank's own history (the jump of
  its bucket statistics from its last clean step, in units of the clean step-to-step spread,
  `SpreadTracker.jumps`): the rank that jumped `PAIR_WITNESS` times more than the other is named; else the
  host CPU (`Replayer.witness`: a batch they disagree on recomputed in float64 on the CPU, projected on the line from
  GPU 0's gradient to GPU 1's); where that names nobody, the first op that computes differently on the
  two GPUs from equal inputs, recomputed alone (checksums.op_witness); else both are named (UNRESOLVED), never one wrong rank.
- `audit_all`: every `every` steps each rank replays its neighbour's batch (rank r rank (r + 1) % W's, the
  batches passed point to point, all in one round), so every rank is audited at once for the wall time of
  one replay; a mismatch becomes a `classify` of that rank (with 3+ ranks a third result decides; with 2,
  `classify_pair`).

One replay per step at most, never retried: the gate never loops.

A model `torch.autograd.grad` cannot differentiate (reentrant activation checkpointing) is replayed by
`.backward()` into stand-in leaves swapped in for its parameters (`_replay_grads`, `by_backward`): the same
gradients bit for bit, DDP's hooks untouched. A replay round that raises on any rank raises `ReplayFailed`
on every rank at the same point (`agreed`: one tiny all-reduce a round), so no rank is left in a collective.

Determinism: `check_determinism` replays one batch twice at start. When the two fingerprints differ the
comparisons fall back to a rounding-aware bound on the norm and max-abs (`exact=False`), said in status;
where only a minority of 3+ ranks differ and the rest repeat and agree, a second round decides first
(`classify_start_rechecked`: a one-off stays exact; the same ranks again are named).
It also compares the replay with the step's own rows: a replay that does not reproduce the step it replays
(a `loss_fn` that is not what the loop back-propagates: a GradScaler not given as `scaler=`, a division by
the micro-batches missing, a term the loop adds) would blame a GPU for every audit, so replays are then
not trusted (`reproduces` False, `why_not` says why): no GPU is named on their evidence. A model whose
forward mixes every rank's batch (SyncBatchNorm normalises by the batch statistics of all ranks) is known
unreproducible at attach (`cross_rank_layers`): a replay of one batch, or of all of them in another order,
is not its step's arithmetic, so nothing is replayed (no collective is spent finding it out at step 1).

Loss scaling (`scaler=`, a `torch.amp.GradScaler`): the loop back-propagates `scaler.scale(loss)`, so a
replay multiplies `loss_fn`'s loss by the scale that step ran under (`note_loss_scale`, a copy on the device
taken as the step's first batch is retained, before `scaler.update()` moves it), the same multiplication as
`scaler.scale`: its gradient is the step's bit for bit. A rank whose scaled gradient overflowed reproduces the overflow on
every rank (DATA), so the scaler's own skip is not blamed on a GPU.

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import pickle
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from checksums.collectives import all_gather_single
from checksums.grad_checks import GradSummaries, fingerprints_of, stats_of
from checksums.op_witness import op_witness, witness_projection
from checksums.rank_transit import map_tensors, portable, restored
from checksums.replay_modes import full_precision
from checksums.tp_lanes import Lanes
from sdcwatch.errors import SdcwatchError

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], torch.Tensor]
T = TypeVar("T")


class Cause(str, enum.Enum):
    DATA = "data"                 # the original reproduces on every rank: a real gradient, apply it
    TRANSIENT = "transient"       # the suspect's own replay agrees with the others; its original did not
    PERSISTENT = "persistent"     # the suspect's replay disagrees with the others: its GPU computes wrong
    UNRESOLVED = "unresolved"     # no majority (two ranks, or every replay differs)
    DIVERGED = "diverged"         # ranks agreeing bit for bit among themselves, not with the rest: their
    #                               weights or optimizer state differ (an HSDP replica), not their arithmetic


@dataclasses.dataclass(frozen=True, slots=True)
class Classification:
    cause: Cause
    faulty: tuple[int, ...]         # ranks whose arithmetic was wrong (empty for DATA)
    drop: bool                      # the step's update must not be applied
    detail: str
    lane: int | None = None         # a tp (cp) group's faulty GPU, by its lane (checksums.lane_witness)


MAX_CLASSIFIED = 2      # mismatches of one audit classified (each a replay round): bounded


def _equal(a: torch.Tensor, b: torch.Tensor, exact: bool, rtol: float) -> bool:
    """Two summary rows [buckets, 4] agree: fingerprints bit for bit, or norm and max-abs within rtol."""
    if exact:
        return bool(torch.equal(fingerprints_of(a), fingerprints_of(b)))
    sa, sb = stats_of(a), stats_of(b)
    return bool(torch.allclose(sa, sb, rtol=rtol, atol=0.0, equal_nan=False))


def classify_replays(suspect: int, original: torch.Tensor, replays: torch.Tensor, *, exact: bool = True,
                     rtol: float = 1e-3) -> Classification:
    """Decide a suspicion from the suspect's original rows [B, 4] and every rank's replay of its batch
    [world, B, 4] (host tensors). The reference is the replays a strict majority of ranks agree on; with
    exact fingerprints also a group of 2+ ranks larger than every other group (two faulty GPUs in four
    ranks, each wrong its own way: independent GPUs do not agree bit for bit on a wrong result). For the
    same reason a group of 2+ ranks that agree among themselves and not with the reference did not compute
    wrong: they computed from other inputs, other weights or optimizer state (an HSDP replica whose shard a
    bit flip changed: every rank of that replica gathers the same changed parameters), and naming them would
    accuse the replica's good GPUs with the one holding the flip; such ranks are never named, and a
    suspicion nothing else explains is `diverged` (the update dropped, no GPU named: the replica vote names
    the shard). An even split into such groups (two HSDP replicas that differ) is `diverged` too. Pure."""
    world = replays.shape[0]
    groups = _agreeing(world, lambda a, b: _equal(replays[a], replays[b], exact, rtol))
    ref = _reference(groups, world, exact)
    blocks = _blocks(groups, ref)
    if ref is None:
        if len(blocks) == len(groups):
            return _diverged(suspect, blocks)
        return Classification(Cause.UNRESOLVED, (suspect,), True,
                              f"no majority among the {world} replays of rank {suspect}'s batch")
    in_block = {r for g in blocks for r in g}
    dissent = tuple(r for r in range(world) if r not in ref)
    lone = tuple(r for r in dissent if r not in in_block)          # each wrong its own way: its arithmetic
    if _equal(original, replays[ref[0]], exact, rtol):
        if lone:
            return Classification(Cause.PERSISTENT, lone, True,
                                  f"ranks {list(lone)} recompute rank {suspect}'s batch wrong; ranks {ref} "
                                  "and its original agree")
        if blocks:
            return _diverged(suspect, [ref, *blocks])
        return Classification(Cause.DATA, (), False, f"rank {suspect}'s gradient reproduces on every rank")
    if suspect in ref or (suspect in in_block and not _equal(original, replays[suspect], exact, rtol)):
        mates = ref if suspect in ref else _group_of(suspect, blocks)
        return Classification(Cause.TRANSIENT, (suspect,) + tuple(r for r in lone if r != suspect), True,
                              f"rank {suspect}'s replay agrees with ranks {mates}, its original did not")
    if suspect in lone:
        return Classification(Cause.PERSISTENT, lone, True, f"rank {suspect} recomputes its wrong result "
                              f"again; ranks {ref} agree on another")
    if lone:                        # the suspect's replica differs; other ranks recompute wrong on their own
        return Classification(Cause.PERSISTENT, lone, True,
                              f"ranks {list(lone)} recompute rank {suspect}'s batch wrong, each its own way")
    return _diverged(suspect, [ref, *blocks])


def _blocks(groups: list[list[int]], ref: list[int] | None) -> list[list[int]]:
    """The groups of 2+ ranks that agree among themselves but are not the reference: other weights, not
    wrong arithmetic (independent GPUs do not agree bit for bit on a wrong result); never named."""
    return [g for g in groups if g is not ref and len(g) >= 2]


def _group_of(rank: int, groups: list[list[int]]) -> list[int]:
    return next(g for g in groups if rank in g)


def _diverged(suspect: int, groups: list[list[int]]) -> Classification:
    """Ranks agree bit for bit within each of `groups` and not across them: they hold different weights or
    optimizer state (replicas that diverged), not different arithmetic. Nobody named; the update dropped."""
    return Classification(Cause.DIVERGED, (), True,
                          f"the replays of rank {suspect}'s batch agree within ranks "
                          f"{' | '.join(str(g) for g in groups)} and not across: those ranks compute from "
                          "different weights or optimizer state (replicas that diverged; the replica vote "
                          "names the shard), not with wrong arithmetic")


PAIR_WITNESS = 3.0      # two ranks, a persistent fault: the named rank's jump is this many times the other's
WITNESS_NEAR = 0.25     # the CPU witness names a GPU when its projection is this close to that GPU's result
WITNESS_REUSE = 100     # symmetric suspicions after a CPU witness naming its GPU without asking the CPU


def _agreeing(world: int, eq: Callable[[int, int], bool]) -> list[list[int]]:
    """The ranks 0..world-1 grouped by the result they agree on (`eq(a, b)`: ranks a and b agree)."""
    groups: list[list[int]] = []
    for r in range(world):
        for g in groups:
            if eq(g[0], r):
                g.append(r)
                break
        else:
            groups.append([r])
    return groups


def _reference(groups: list[list[int]], world: int, exact: bool) -> list[int] | None:
    """The group whose result is taken as right: a strict majority of the ranks; with exact fingerprints also
    a group of 2+ larger than every other (independent GPUs do not agree bit for bit on a wrong result; an
    even split stays undecided). None: no reference."""
    ref = max(groups, key=len)
    plurality = exact and len(ref) >= 2 and all(len(g) < len(ref) for g in groups if g is not ref)
    return ref if len(ref) * 2 > world or plurality else None


def witness_names(t: float) -> int | None:
    """The GPU the CPU witness's projection t names as computing wrong (1 when t is near 0: GPU 0's gradient
    is the float64 one's; 0 when near 1), or None (t between, or NaN: no witness)."""
    if t < WITNESS_NEAR:
        return 1
    if t > 1 - WITNESS_NEAR:
        return 0
    return None


def classify_start(got: torch.Tensor, same_hardware: bool = True) -> tuple[bool, Classification | None]:
    """The first step's determinism check from every rank's two replays of rank 0's batch [world, 2, B, 4]
    (host): whether replays compare exact fingerprints, and the GPUs found computing wrong (or None).

    Every replay agrees bit for bit: exact. Each rank repeats its own result (no run-to-run variation: the
    kernels are deterministic) and a majority of ranks (as `classify_replays` counts it) agree while the
    others each get another result:
    exact, and the others' GPUs compute wrong from the job's start (named `persistent`). Taking that for a
    non-deterministic model would move every later comparison to the rounding bound, where such a GPU's
    small fault hides for good. Anything else (a rank whose two replays differ, two ranks that disagree, no
    majority, or ranks on different GPU models or CUDA or torch builds: `same_hardware` False, where rounding
    differs by design): the rounding-aware bound. Pure."""
    world = got.shape[0]
    fps = [fingerprints_of(got[r, 0]) for r in range(world)]
    if not repeats_own(got):
        return False, None
    groups = _agreeing(world, lambda a, b: torch.equal(fps[a], fps[b]))   # ranks by the result they repeat
    if len(groups) == 1:
        return True, None
    ref = _reference(groups, world, exact=True)
    if world < 3 or ref is None or not same_hardware:
        return False, None
    # an HSDP replica initialised apart is other weights, not a GPU wrong from the start (the vote's to tell)
    blocked = {r for g in _blocks(groups, ref) for r in g}
    dissent = tuple(sorted(r for r in range(world) if r not in ref and r not in blocked))
    if not dissent:
        return True, None
    return True, Classification(Cause.PERSISTENT, dissent, True,
                                f"ranks {list(dissent)} each repeat their own gradient of rank 0's batch at "
                                f"the first step, ranks {ref} agree on another: their GPUs compute wrong from "
                                "the start (or run another GPU model or library)")


def flaky_start(got: torch.Tensor, same_hardware: bool = True) -> tuple[int, ...]:
    """The ranks whose two replays of rank 0's batch differ [world, 2, B, 4] (host) while every other rank
    repeats its own and a strict majority of all the ranks agree on one result: then the kernels are
    deterministic (those ranks show it) and those few GPUs did not reproduce. 3+ ranks on the same hardware;
    () otherwise (no rank differs, too many do, or no majority: `classify_start` decides alone). Pure."""
    world = got.shape[0]
    if world < 3 or not same_hardware:
        return ()
    fps = [(fingerprints_of(got[r, 0]), fingerprints_of(got[r, 1])) for r in range(world)]
    flaky = tuple(r for r in range(world) if not torch.equal(*fps[r]))
    if not flaky or len(flaky) * 2 >= world:
        return ()
    steady = [r for r in range(world) if r not in flaky]
    groups = _agreeing(len(steady), lambda a, b: torch.equal(fps[steady[a]][0], fps[steady[b]][0]))
    return flaky if max(len(g) for g in groups) * 2 > world else ()


def classify_start_rechecked(first: torch.Tensor, second: torch.Tensor,
                             same_hardware: bool = True) -> tuple[bool, Classification | None]:
    """The first step's check when `first` had ranks that did not repeat their own result (`flaky_start`)
    and every rank replayed rank 0's batch twice more (`second`): one odd replay must not move the whole run
    to the rounding bound, where a small fault hides for good, and must not name a GPU on its own. The
    second round deterministic (`classify_start` exact): exact, with the GPUs it finds (a one-off on the
    first: logged by the caller, no GPU named for it). The same ranks again not repeating while the others
    do and agree: exact, and those GPUs named (`persistent`: they do not reproduce a computation the others
    repeat bit for bit). Anything else: the rounding bound, as `classify_start(first)` says. Pure."""
    flaky = flaky_start(first, same_hardware)
    exact, fault = classify_start(second, same_hardware)
    if exact:
        return exact, fault
    again = flaky_start(second, same_hardware)
    if flaky and again == flaky:
        steady = [r for r in range(first.shape[0]) if r not in flaky]
        return True, Classification(Cause.PERSISTENT, flaky, True,
                                    f"ranks {list(flaky)} gave two different gradients of rank 0's batch in "
                                    f"each of two checks at the first step while ranks {steady} repeated "
                                    "theirs: their GPUs do not reproduce a deterministic computation")
    return classify_start(first, same_hardware)


def bounded_reason(got: torch.Tensor, same_hardware: bool, device_type: str, deterministic: bool,
                   warn_only: bool, cublas_workspace: str | None) -> str:
    """Why the first step's check chose the rounding bound (`classify_start` said not exact), in words a user
    can act on (under 100 characters: it goes in GetStatus's compute mode). `got`: every rank's two replays
    of rank 0's batch [world, 2, B, 4] (host); the rest: this process's torch settings
    (`torch.are_deterministic_algorithms_enabled()`, `...warn_only_enabled()`, $CUBLAS_WORKSPACE_CONFIG).
    Pure."""
    if not same_hardware:
        return "ranks on different GPU models or CUDA/torch builds round differently"
    if repeats_own(got):
        return "ranks each repeat a result of their own and no majority or witness decides"
    if device_type != "cuda":
        return "replays of one batch differ (a non-deterministic kernel)"
    if not deterministic:
        return "replays of one batch differ: set torch.use_deterministic_algorithms(True)"
    if warn_only:
        return ("replays differ under use_deterministic_algorithms(warn_only=True): set "
                "warn_only=False")
    if not cublas_workspace:
        return "replays of one batch differ: set CUBLAS_WORKSPACE_CONFIG=:4096:8"
    return "replays differ under deterministic algorithms (a kernel with no deterministic variant)"


def repeats_own(got: torch.Tensor) -> bool:
    """Each rank's two replays of one batch [world, 2, B, 4] agree bit for bit (no run-to-run variation)."""
    return all(torch.equal(fingerprints_of(got[r, 0]), fingerprints_of(got[r, 1]))
               for r in range(got.shape[0]))


MODEL_WITNESS = "the CPU's float64 gradient"      # what `Replayer.witness`'s t rests on (not the op witness)


def pair_agreement(replays: torch.Tensor, exact: bool = True, rtol: float = 1e-3) -> list[bool]:
    """Two ranks: whether both GPUs' replays of batch j agree, for j = 0, 1 (`replays` [2 (GPU), 2 (batch),
    B, 4]). Pure."""
    return [_equal(replays[0, j], replays[1, j], exact, rtol) for j in (0, 1)]


def classify_pair_replays(originals: torch.Tensor, replays: torch.Tensor,
                          jumps: tuple[float, float] = (0.0, 0.0), *, exact: bool = True, rtol: float = 1e-3,
                          witness: float | None = None,
                          witness_by: str = MODEL_WITNESS) -> Classification:
    """Two ranks: decide from both originals [2 (batch), B, 4] and every replay [2 (GPU), 2 (batch), B, 4]
    (`replays[g, j]`: GPU g's replay of rank j's batch), with `jumps[r]`, rank r's own-history jump (the
    tie-break of a persistent fault), and `witness`, the CPU witness's projection (`Replayer.witness`: near 0
    when GPU 0 computed right, near 1 when GPU 1 did; `witness_by` what it rests on). Pure; see the module
    docstring."""
    def eq(a: torch.Tensor, b: torch.Tensor) -> bool:
        return _equal(a, b, exact, rtol)

    cross = pair_agreement(replays, exact, rtol)
    own = [eq(originals[j], replays[j, j]) for j in (0, 1)]           # batch j's original repeats on its GPU
    if all(cross):
        bad = tuple(j for j in (0, 1) if not eq(originals[j], replays[0, j]))
        if not bad:
            return Classification(Cause.DATA, (), False, "both ranks' gradients reproduce on both GPUs")
        return Classification(Cause.TRANSIENT, bad, True,
                              f"rank {list(bad)}'s original gradient does not repeat; both GPUs' replays "
                              "agree")
    if all(own) and not all(cross):
        # a persistent fault: each GPU repeats its own result. On both batches, or on one only (a fault that
        # shows on some data: x1.05 on one activation the other batch's gradient rounds away; that was
        # "no consistent story", unresolved, until an audit met two batches that both show it)
        where = ("they disagree on both batches" if not any(cross) else
                 f"they disagree on rank {cross.index(False)}'s batch (the other agrees: a fault some data "
                 "shows)")
        hi, lo = (0, 1) if jumps[0] >= jumps[1] else (1, 0)
        if jumps[hi] > PAIR_WITNESS * max(jumps[lo], 1e-12) and jumps[hi] > 1.0:
            return Classification(Cause.PERSISTENT, (hi,), True,
                                  f"each GPU repeats its own result and {where}; rank "
                                  f"{hi}'s statistics jumped {jumps[hi]:.1f} clean spreads from its own "
                                  "history, rank "
                                  f"{lo}'s {jumps[lo]:.1f}")
        bad = witness_names(witness) if witness is not None else None
        if bad is not None:
            return Classification(Cause.PERSISTENT, (bad,), True,
                                  f"each GPU repeats its own result and {where}; "
                                  f"{witness_by} sits at t={witness:.3f} between GPU 0's (0) and GPU 1's "
                                  f"(1): rank {bad}'s GPU computes wrong")
        return Classification(Cause.UNRESOLVED, (0, 1), True,
                              f"each GPU repeats its own result and {where}; no third "
                              f"witness tells which (history jumps {jumps[0]:.1f} and {jumps[1]:.1f})")
    return Classification(Cause.UNRESOLVED, (0, 1), True,
                          f"the GPUs' replays agree on {sum(cross)} of 2 batches, originals repeat on "
                          f"{sum(own)} of 2: no consistent story")


@dataclasses.dataclass(slots=True)
class Retained:
    """One step's micro-batches, each with the RNG state before its forward: (batch, cpu_rng, dev_rng)."""

    micro: list[tuple[Any, torch.Tensor | None, torch.Tensor | None]] = dataclasses.field(
        default_factory=list)
    loss_scale: torch.Tensor | None = None    # the GradScaler's scale the step ran under (0-d, device)

    @property
    def batch(self) -> Any:
        return self.micro[-1][0] if self.micro else None

    def outgoing(self) -> Any:
        """The micro-batches as they cross to other ranks in an object collective: on the host, unsigned
        tensors in their signed twins (`rank_transit.portable`). `arriving` is the other end."""
        return portable([(map_tensors(b, lambda t: t.detach().cpu()), c, None if d is None else d.cpu())
                         for b, c, d in self.micro])

    @classmethod
    def arriving(cls, payload: Any, device: torch.device, loss_scale: torch.Tensor | None) -> "Retained":
        """`outgoing`'s payload back as a `Retained` on `device`; the loss scale is the receiver's own (the
        same on every rank: the scaler's state follows the reduced gradient)."""
        return cls([(map_tensors(b, lambda t: t.to(device)), c, d) for b, c, d in restored(payload)],
                   loss_scale=loss_scale)


class ReplayFailed(SdcwatchError, RuntimeError):
    """A replay raised on some rank (`loss_fn` on the bare module, an out-of-memory): raised on every rank
    at the same point (`Replayer.agreed`), so no rank waits in a collective the others left. The message
    says why in under 105 characters. `after_mismatch`: an audit's replay had already differed from the
    step's own when the classifying round failed (the step is then held back, not applied)."""

    after_mismatch = False


@contextlib.contextmanager
def _after_mismatch() -> Any:
    """Marks a `ReplayFailed` raised inside as `after_mismatch`."""
    try:
        yield
    except ReplayFailed as exc:
        exc.after_mismatch = True
        raise


# torch's words for autograd.grad through reentrant checkpointing (older and newer releases)
_REENTRANT = re.compile(r"[Cc]heckpoint\w*.* (?:not compatible|incompatible) with \.grad")


def replay_failure(exc: BaseException | None) -> str:
    """Why a replay raised, in under 105 characters a user can act on (GetStatus's compute mode)."""
    if exc is None:
        return "a replay raised on another rank (its log says why)"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"a replay raised {type(exc).__name__}: {text}"[:104]


class _Discard:
    """A pickler's file that keeps nothing (`sendable` only asks whether the payload pickles)."""

    def write(self, data: Any) -> int:
        return len(data)


def sendable(retained: Retained) -> Any:
    """`retained`'s payload for another rank (`Retained.outgoing`), pickled once here first: a batch holding
    an object pickle refuses (a lock, an open file, a generator) raises on its own rank, inside a round every
    rank agrees on (`Replayer.agreed`), never in the transfer, where the receivers would wait for ever (the
    receiver takes it in, to its device, in such a round too: an out-of-memory there stops every rank)."""
    payload = retained.outgoing()
    pickle.Pickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return payload


def uncrossed(exc: BaseException | None) -> str:
    """Why a retained batch could not go to another rank (sent or taken in), for GetStatus's compute mode."""
    if exc is None:
        return "a batch could not cross ranks for a replay (another rank's log says why)"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"a batch could not cross ranks for a replay: {type(exc).__name__}: {text}"[:104]


class _Swapped(nn.Module):
    """A stand-in replay's wrapper: `torch.func.functional_call` swaps the stand-in leaves into `module` (its
    child) for the call of this forward, which runs the whole replay (`run`), backward included."""

    def __init__(self, module: nn.Module, run: Callable[[], None]) -> None:
        super().__init__()
        self.module = module
        self.run = run

    def forward(self) -> None:
        self.run()


class Replayer:
    """Retains each step's batch and RNG state and recomputes gradients from them (see the module doc)."""

    def __init__(self, module: nn.Module, summaries: GradSummaries | None, loss_fn: LossFn | None, *,
                 device: torch.device, group: Any = None, scaler: Any = None,
                 lanes: Lanes | None = None, context: Callable[[], Any] | None = None) -> None:
        self.module = module
        self.summaries = summaries
        self.loss_fn = loss_fn
        # entered around each replay's forward and backward: what the loop wraps its own in besides loss_fn
        # (torch's context_parallel(), an sdpa_kernel choice)
        self.context: Callable[[], Any] = context if context is not None else contextlib.nullcontext
        self.device = device
        self.group = group          # the data-parallel ranks: batches travel here
        # tensor parallelism (checksums.tp_lanes): a tp group is one rank here; the replays' rows and every
        # agreement span the whole mesh (`wide`), so every rank replays alike
        self.lanes = lanes
        self.wide = None if lanes is not None else group
        self.scaler = scaler
        self.retained = Retained()
        self._step_open = False
        self._scale_bufs: list[torch.Tensor | None] = [None, None]   # two steps' scales, used in turn
        self._scale_i = 0
        self._cuda_gen: Any = None    # the device's default generator (`retain` reads its state each step)
        self.exact = True
        self.why_bounded = ""         # why check_determinism chose the rounding bound (bounded_reason)
        self.reproduces = True        # a replay of a step gives that step's gradient (check_determinism)
        self.by_backward = False      # replays by .backward() into stand-ins (reentrant checkpointing)
        self.start_fault: Classification | None = None  # GPUs the first step's check found computing wrong
        self.same_hardware = True     # every rank's GPU model, CUDA and torch alike (the gate says)
        self.why_not = ""
        self.cross_rank = cross_rank_layers(module)
        if self.cross_rank:               # known at attach: not found out by replays that cannot match
            self.reproduces, self.why_not = False, CROSS_RANK
        self.replays = 0
        # two ranks, a symmetric persistent fault: ask the CPU (witness()); not per lane of a tp group (each
        # lane's witness could answer otherwise, and the ranks must decide alike)
        self.cpu_witness = lanes is None
        self._witnessed: tuple[int, int] | None = None     # (the rank it named, reuses left)

    def retain(self, batch: Any) -> None:
        """Keep this micro-batch and the RNG state before its forward; call before each forward. Every
        micro-batch retained since the last `end_step` belongs to this step."""
        if not self._step_open:
            self.retained = Retained()            # a new object: a step kept for later keeps its own list
            self._step_open = True
            self.note_loss_scale()
        dev_rng = None
        if self.device.type == "cuda":        # torch.cuda.get_rng_state's state, without its per-call lookups
            gen = self._cuda_gen
            if gen is None:
                torch.cuda.init()
                idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
                gen = self._cuda_gen = torch.cuda.default_generators[idx]
            dev_rng = gen.get_state()
        self.retained.micro.append((batch, torch.get_rng_state(), dev_rng))

    def end_step(self) -> None:
        """The optimizer step is over: the next `retain` starts the next step's micro-batches (a step kept
        for later keeps its own object; a step with no `retain` finds none, never the last step's batch)."""
        self._step_open = False
        self.retained = Retained()

    def note_loss_scale(self) -> None:
        """Keep the loss scale this step runs under with its retained batch (`scaler=`): taken as the step's
        first micro-batch is retained, before its forward (`scaler.update()` moves the scale only after the
        step, and a step the scaler skips is judged after that). A copy on the device, no synchronisation,
        into one of two buffers used in turn (a retained step is replayed at the latest at the next step)."""
        scale = loss_scale_of(self.scaler, self.device)
        if scale is None:
            return
        i = self._scale_i = self._scale_i ^ 1
        buf = self._scale_bufs[i]
        if buf is None or buf.device != scale.device or buf.dtype != scale.dtype:
            buf = self._scale_bufs[i] = torch.empty_like(scale)
        buf.copy_(scale)
        self.retained.loss_scale = buf

    def replay(self, retained: Retained) -> torch.Tensor:
        """Summary rows [buckets, 4] of the gradient of `retained`'s micro-batches on this rank (each with
        its RNG state), accumulated in the order autograd accumulates `.grad`."""
        assert self.summaries is not None, "a gradient replay needs the bucket summaries"
        grads = self._grads(retained, self.module, self.summaries.params)
        self.replays += 1
        return self.summaries.bucket_grads(grads)

    def _grads(self, retained: Retained, module: nn.Module, params: list[torch.Tensor],
               cast: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        """The gradient of `retained`'s micro-batches with respect to `params` of `module`, each micro-batch
        under its RNG state, the module's buffers put back after. By `torch.autograd.grad`; a model it cannot
        differentiate (reentrant activation checkpointing) by `.backward()` into stand-ins (`by_backward`)."""
        if not retained.micro:
            raise RuntimeError("no batch retained: call retain(batch) before each step's forward")
        if not self.by_backward:
            try:
                return self._replay_grads(retained, module, params, cast, by_backward=False)
            except RuntimeError as exc:
                if not _REENTRANT.search(str(exc)):
                    raise
                self.by_backward = True       # every rank meets it at the same replay (step 1's check)
        return self._replay_grads(retained, module, params, cast, by_backward=True)

    def _replay_grads(self, retained: Retained, module: nn.Module, params: list[torch.Tensor],
                      cast: Callable[[torch.Tensor], torch.Tensor] | None, *,
                      by_backward: bool) -> list[torch.Tensor | None]:
        """`_grads`' work. `by_backward`: each parameter is replaced in the module, for the whole replay (a
        reentrant checkpoint recomputes its forward inside the backward), by a leaf sharing its storage
        (`torch.func.functional_call` of `_Swapped`, a wrapper whose forward is the whole replay), and
        each micro-batch's loss is back-propagated with `.backward()`: the gradients land in the leaves'
        `.grad`, accumulated as autograd accumulates the step's own `.grad`; DDP's hooks (on the real
        parameters' accumulators) do not fire, the step's `.grad` is not touched."""
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        grads: list[torch.Tensor | None] | None = None
        leaves = [p.detach().requires_grad_(True) for p in params] if by_backward else []

        def micro_batches() -> None:
            nonlocal grads
            for batch, cpu_rng, dev_rng in retained.micro:
                if cpu_rng is not None:
                    torch.set_rng_state(cpu_rng)
                if dev_rng is not None and cast is None:
                    torch.cuda.set_rng_state(dev_rng, self.device)
                if cast is not None:
                    batch = map_tensors(batch, cast)
                with torch.enable_grad(), self.context():
                    loss = scaled(self.loss_fn(module, batch), retained.loss_scale, cast)
                    if by_backward:
                        loss.backward()
                        continue
                    got = torch.autograd.grad(loss, params, allow_unused=True)
                grads = list(got) if grads is None else [
                    g if a is None else (a if g is None else a + g) for a, g in zip(grads, got)]

        try:
            with torch.random.fork_rng(devices=devices):
                if by_backward:
                    of = {id(p): leaf for p, leaf in zip(params, leaves)}
                    named = module.named_parameters(remove_duplicate=False)    # a tied weight: every name
                    swapped = {"module." + name: of[id(p)] for name, p in named if id(p) in of}
                    torch.func.functional_call(_Swapped(module, micro_batches), swapped)
                else:
                    micro_batches()
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
        if by_backward:
            return [leaf.grad for leaf in leaves]
        assert grads is not None
        return grads

    def witness(self, retained: Retained, ops: bool = False) -> tuple[float, str]:
        """Two ranks, a persistent fault, each GPU self-consistent: the host CPU is the third witness. Both
        ranks replay `retained` (a batch the GPUs disagree on); D = GPU 1's gradient - GPU 0's; rank 0 recomputes the
        gradient on the CPU in float64 (a copy of the module) and projects: t = <ref - g0, D> / <D, D>, 0
        when GPU 0 computed it right, 1 when GPU 1 did; rounding moves t off those. A collective, run only on
        such a suspicion (two full gradients travel once). `ops` (bit-for-bit deterministic GPUs of one
        model): when that t names nobody, the op witness decides (`_op_witness`). Returns t and what it rests
        on."""
        assert self.summaries is not None
        params = self.summaries.params

        def flat(gs: list[torch.Tensor | None], like: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64)
                              for g, p in zip(gs, like)])

        # in float32 when the parameters are (autocast's bf16/fp16 arithmetic off: see `full_precision`); a
        # model kept in a low precision is compared as it computes
        mine = self.agreed_wide(lambda: flat(self._grads(retained, self.module, params), params)
                                .to(torch.float32), all(p.dtype == torch.float32 for p in params))
        self.replays += 1
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=self.group)
        out: list[Any] = [None]
        if dist.get_rank(self.group) == 0:
            try:
                out = [self._cpu_projection(retained, both[0].cpu().double(), both[1].cpu().double())]
            except Exception as exc:  # noqa: BLE001 (a model the CPU cannot replay: no witness, said)
                logger.warning("sdcwatch: the CPU witness failed (%s); no witness", replay_failure(exc))
                out = [float("nan")]
        dist.broadcast_object_list(out, group=self.group, group_src=0,
                                   device=self.device if self.device.type == "cuda" else None)
        t = float(out[0])
        if ops and witness_names(t) is None:
            return self._op_witness(lambda: self._grads(retained, self.module, params)) or (t, MODEL_WITNESS)
        return t, MODEL_WITNESS

    def _op_witness(self, replay: Callable[[], Any]) -> tuple[float, str] | None:
        """`witness`'s second opinion when the model-level one named nobody: the op witness
        (checksums.op_witness), `replay` (this rank's replay of the witness's batch as the step computes) run
        on both ranks; its t and which op when it names a GPU, else None (a collective)."""
        t0 = time.perf_counter()
        try:
            t_op, by = op_witness(lambda: self.agreed(replay), self.group, self.device)
        except ReplayFailed as exc:
            t_op, by = float("nan"), f"its replay failed ({exc})"
        self.replays += 2
        named = witness_names(t_op)
        logger.warning("sdcwatch: the op witness (%.2f s) %s at t=%.3f: %s", time.perf_counter() - t0,
                       "names no GPU" if named is None else f"names rank {named}", t_op, by)
        return None if named is None else (t_op, by)

    def _cpu_projection(self, retained: Retained, g0: torch.Tensor, g1: torch.Tensor) -> float:
        """`witness`'s t from rank 0's float64 CPU replay of `retained` (a copy of the module)."""
        import copy
        ref_mod = copy.deepcopy(self.module).to(device="cpu", dtype=torch.float64)
        ref_params = [p for p in ref_mod.parameters() if p.requires_grad]

        def cast(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().cpu()
            return t.to(torch.float64) if t.is_floating_point() else t
        got = self._grads(retained, ref_mod, ref_params, cast)
        ref = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64)
                         for g, p in zip(got, ref_params)])
        return witness_projection(ref, g0, g1)

    def replay_loss(self, retained: Retained) -> float:
        """The loss of `retained`'s micro-batches (summed) recomputed on this rank with their RNG states,
        forward only (no gradient), buffers left as they were; a host float (one sync: a suspicion only)."""
        if not retained.micro:
            raise RuntimeError("no batch retained: call retain(batch) before each step's forward")
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        total = 0.0
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for batch, cpu_rng, dev_rng in retained.micro:
                if cpu_rng is not None:
                    torch.set_rng_state(cpu_rng)
                if dev_rng is not None:
                    torch.cuda.set_rng_state(dev_rng, self.device)
                with self.context():
                    total += float(self.loss_fn(self.module, batch).detach().float().sum())
            for b, saved in buffers:
                b.copy_(saved)
        self.replays += 1
        return total

    def fetch(self, src: int, mine: Retained | None = None) -> Retained:
        """Rank `src`'s retained batch and RNG state (`mine`, default this step's) on every rank (a
        collective: all ranks call)."""
        mine = mine if mine is not None else self.retained
        sends = dist.get_rank(self.group) == src
        payload: list[Any] = [self.agreed(lambda: sendable(mine) if sends else None, why=uncrossed)]
        dist.broadcast_object_list(payload, group=self.group, group_src=src,
                                   device=self.device if self.device.type == "cuda" else None)
        return self.agreed(lambda: Retained.arriving(payload[0], self.device, mine.loss_scale), why=uncrossed)

    def fetch_audited(self, mine: Retained | None = None) -> Retained:
        """Rank (r + 1) % W's retained batch and RNG state (`mine`, default this step's) on rank r, the batch
        r audits (a collective: all ranks call). Each rank sends its own to the rank before it, point to
        point, so a rank holds two batches whatever the world (an all-gather would hold W); even ranks send
        first and odd ranks receive first, so no two ranks wait on each other."""
        mine = mine if mine is not None else self.retained
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        if world == 1:
            return mine
        # point to point, only NCCL carries CUDA tensors (gloo's collectives do, its send does not): the
        # bytes go by the device there, by the host elsewhere (the backend test the Monitor's vote makes)
        nccl = "nccl" in str(dist.get_backend(self.group)).lower()
        device = self.device if self.device.type == "cuda" and nccl else None
        payload = self.agreed(lambda: sendable(mine), why=uncrossed)
        got: list[Any] = [None]
        for sending in ((True, False) if rank % 2 == 0 else (False, True)):
            if sending:
                dist.send_object_list([payload], group=self.group, group_dst=(rank - 1) % world,
                                      device=device)
            else:
                dist.recv_object_list(got, group=self.group, group_src=(rank + 1) % world, device=device)
        return self.agreed(lambda: Retained.arriving(got[0], self.device, mine.loss_scale), why=uncrossed)

    def agreed(self, replay: Callable[[], T],
               why: Callable[[BaseException | None], str] = replay_failure) -> T:
        """`replay()` (this rank's part of a replay round), or `ReplayFailed` on every rank when it raised on
        any: the ranks first agree with one tiny all-reduce (a replay round only, never a plain step), so a
        rank whose replay raised never leaves the others waiting in the round's gather. `why` words it."""
        err: Exception | None = None
        try:
            got = replay()
        except Exception as exc:  # noqa: BLE001 (any failure of the user's model or loss_fn: said)
            err = exc
        bad = torch.tensor([0 if err is None else 1], dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size(self.wide) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.wide)
        if int(bad.item()):
            raise ReplayFailed(why(err)) from err
        return got

    def agreed_wide(self, replay: Callable[[], T], wide: bool) -> T:
        """The witness's replay (`agreed`) in float32 when `wide` (`full_precision`), else as the step
        computes; when the float32 replay fails on any rank (out of memory for float32 activations), every
        rank replays as the step computes instead: the two gradients projected always have one precision."""
        if wide:
            try:
                with full_precision(self.device.type):
                    return self.agreed(replay)
            except ReplayFailed as exc:
                logger.warning("sdcwatch: the witness's float32 replay failed (%s); replaying as the step "
                               "computes", exc)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        return self.agreed(replay)

    def replay_round(self, replay: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Every rank's `replay()` rows, gathered [world, ...], once every rank's replay ran (`agreed`)."""
        return self.gather(self.agreed(replay))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's `rows` [..., B, 4], stacked [world, ...] on the host (a collective); a tp group's
        lanes side by side as one rank's (`Lanes.merge`)."""
        world = dist.get_world_size(self.wide)
        rows = rows.contiguous() if self.lanes is None else self.lanes.pad(rows).contiguous()
        out = rows.new_empty((world * rows.shape[0], *rows.shape[1:]))
        all_gather_single(out, rows, group=self.wide)
        got = out.view(world, *rows.shape).cpu()
        return got if self.lanes is None else self.lanes.merge(got)

    def classify(self, suspect: int, original: torch.Tensor, mine: Retained | None = None) -> Classification:
        """Every rank replays `suspect`'s batch (of this step, or `mine`: an earlier step's); the replays
        decide (a collective: all ranks call)."""
        retained = self.fetch(suspect, mine)
        return classify_replays(suspect, original, self.replay_round(lambda: self.replay(retained)),
                                exact=self.exact)

    def classify_pair(self, originals: torch.Tensor, mine: Retained | None = None,
                      jumps: tuple[float, float] = (0.0, 0.0)) -> Classification:
        """Two ranks: both replay both batches (of this step, or `mine`: an earlier step's); originals
        [2, B, 4] are both ranks' rows; `jumps` the own-history tie-break (a collective: all ranks call)."""
        mine = mine if mine is not None else self.retained
        batches = [self.fetch(j, mine) for j in (0, 1)]
        rows = self.replay_round(lambda: torch.stack([self.replay(b) for b in batches]))
        c = classify_pair_replays(originals, rows, jumps, exact=self.exact)
        cross = pair_agreement(rows, self.exact)
        seen = cross.index(False) if False in cross else 0      # the witness's batch: one they disagree on
        if c.cause is Cause.UNRESOLVED and c.faulty == (0, 1) and self.cpu_witness and \
                c.detail.startswith("each GPU repeats"):       # symmetric: ask the host CPU (every rank)
            if self._witnessed is not None and self._witnessed[1] > 0:
                # a persistent fault the CPU named recently: not again every step (a CPU float64 replay of a
                # large model takes long); the same GPU, for the next WITNESS_REUSE symmetric suspicions
                bad, left = self._witnessed
                self._witnessed = (bad, left - 1)
                return Classification(Cause.PERSISTENT, (bad,), True,
                                      "each GPU repeats its own result and they disagree; "
                                      f"the CPU witness named rank {bad} earlier")
            t, by = self.witness(batches[seen], ops=self.exact and self.same_hardware)
            c = classify_pair_replays(originals, rows, jumps, exact=self.exact, witness=t, witness_by=by)
            if c.cause is Cause.PERSISTENT:
                self._witnessed = (c.faulty[0], WITNESS_REUSE)
        return c

    def audit_all(self, originals: torch.Tensor,
                  jumps: tuple[float, float] = (0.0, 0.0)) -> list[tuple[int, Classification]]:
        """Every rank audited at once: rank r replays rank (r + 1) % W's batch of this step (one replay a
        rank, all in one round: the wall time of one replay, W times the coverage of auditing one rank);
        `originals` [W, B, 4] are every rank's rows. [] when every replay matches its original; else
        (audited rank, classification) per mismatch classified (two ranks: the pair replays; 3+: every
        rank replays the mismatched batch and `classify_replays` decides, at most MAX_CLASSIFIED, a mismatch
        an earlier classification explains skipped). A mismatch whose replays all agree with the original
        was the auditor's replay, once: `transient` on the auditor, applied (a collective: all ranks call)."""
        world = dist.get_world_size(self.group)
        audited = self.fetch_audited()
        got = self.replay_round(lambda: self.replay(audited))          # r's replay of r + 1's batch
        mismatched = [j for j in range(world)
                      if not _equal(originals[j], got[(j - 1) % world], self.exact, 1e-3)]
        if not mismatched:
            return []
        with _after_mismatch():
            return self._classify_audits(originals, mismatched, world, jumps)

    def _classify_audits(self, originals: torch.Tensor, mismatched: list[int], world: int,
                         jumps: tuple[float, float]) -> list[tuple[int, Classification]]:
        if world == 2:
            c = self.classify_pair(originals, jumps=jumps)
            if c.cause is Cause.DATA:
                auditors = tuple(sorted((j - 1) % world for j in mismatched))
                c = Classification(Cause.TRANSIENT, auditors, False,
                                   f"auditor rank(s) {list(auditors)}'s replay differed once; every replay "
                                   "after it agrees with the originals")
            # the finding's rank: the one named when both batches mismatched (a faulty rank's own batch and
            # the one it audits differ alike)
            return [(c.faulty[0] if len(c.faulty) == 1 and c.faulty[0] in mismatched else mismatched[0], c)]
        out: list[tuple[int, Classification]] = []
        named: set[int] = set()
        for j in mismatched:
            if len(out) == MAX_CLASSIFIED or j in named or (j - 1) % world in named:
                continue                  # explained already (a faulty auditor makes its neighbour differ)
            retained = self.fetch(j)
            got_j = self.replay_round(lambda: self.replay(retained))    # every rank replays j's batch
            c = classify_replays(j, originals[j], got_j, exact=self.exact)
            if c.cause is Cause.DATA:     # every replay agrees with the original: the auditor's was odd, once
                auditor = (j - 1) % world
                c = Classification(Cause.TRANSIENT, (auditor,), False,
                                   f"auditor rank {auditor}'s replay of rank {j}'s batch differed once; "
                                   "every replay after it agrees with the original")
            named.update(c.faulty)
            out.append((j, c))
        return out

    def _start_witness(self, retained: Retained) -> None:
        """Two ranks at the first step, each GPU repeating its own gradient of rank 0's batch, the two
        different: a GPU that computes wrong from the start, or GPUs whose arithmetic differs by rounding
        (another model or library). The CPU witness tells them apart (a collective): a fault leaves the good
        GPU's gradient far closer to the float64 one than the two are to each other (t near 0 or 1);
        rounding leaves both about as close (t near 0.5). Named: exact stays on, the GPU is `start_fault`
        (and the witness's answer is reused as in `classify_pair`); else the rounding-aware bound."""
        t, by = self.witness(retained, ops=self.same_hardware)      # each GPU repeats its own: deterministic
        bad = witness_names(t)
        if bad is None:
            return
        self.exact = True
        self._witnessed = (bad, WITNESS_REUSE)
        self.start_fault = Classification(
            Cause.PERSISTENT, (bad,), True,
            f"each GPU repeats its own gradient of rank 0's batch at the first step and they differ; "
            f"{by} sits at t={t:.3f} between GPU 0's (0) and GPU 1's (1): rank {bad}'s GPU "
            "computes wrong from the start")

    def check_determinism(self, originals: torch.Tensor | None = None) -> bool:
        """Every rank replays rank 0's retained batch twice (a collective, after a first backward built the
        bucket layout); exact comparisons stay on if all the results agree bit for bit, or if only GPUs that
        each repeat a wrong result of their own disagree with a majority (`classify_start`: those are kept in
        `start_fault`), else the rounding-aware bound is used (`exact` False). When only a few ranks did not
        repeat their own result and the others did and agree (`flaky_start`), every rank replays it twice
        more and `classify_start_rechecked` decides (a one-off: exact; the same ranks again: exact, and
        their GPUs named). `originals`: every rank's own
        rows of this step [world, B, 4] (host): when rank 0's replay of its batch does not give its original,
        and (with two ranks or more) rank 1's replay of its own batch neither (one fault at this step does
        not turn the check off), replays do not reproduce this job's steps (`reproduces` False, `why_not` the
        likely reason)."""
        retained = self.fetch(0)
        got = self.replay_round(lambda: torch.stack([self.replay(retained), self.replay(retained)]))
        self.replays -= 2
        flaky = flaky_start(got, self.same_hardware)    # the same on every rank: the gathered `got`
        if flaky:      # a few ranks did not repeat, the others did and agree: check once more, not the bound
            again = self.replay_round(lambda: torch.stack([self.replay(retained), self.replay(retained)]))
            self.replays -= 2
            self.exact, self.start_fault = classify_start_rechecked(got, again, self.same_hardware)
            named = self.start_fault is not None and set(flaky) <= set(self.start_fault.faulty)
            logger.warning("sdcwatch: compute checks: at the first step rank(s) %s gave two different "
                           "gradients of one batch while the others repeated theirs; a second check: %s",
                           list(flaky),
                           "they did again, their GPUs are named" if self.exact and named else
                           "every rank repeated (a one-off; exact comparisons stay on)" if self.exact else
                           "no majority repeats (the rounding bound)")
        else:
            self.exact, self.start_fault = classify_start(got, self.same_hardware)
        if (not self.exact and got.shape[0] == 2 and self.cpu_witness and self.same_hardware
                and repeats_own(got)):
            self._start_witness(retained)    # two GPUs, each repeating its own result: the CPU decides
        self.why_bounded = "" if self.exact else bounded_reason(
            got, self.same_hardware, self.device.type, torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        if originals is not None:
            why = [replay_mismatch(originals[0], got[0, 0], self.exact)]
            if why[0] and originals.shape[0] > 1:     # the same on every rank: the replays are collective
                theirs = self.fetch(1)
                own = self.replay_round(lambda: self.replay(theirs))   # own[1]: rank 1's of its own
                self.replays -= 1
                why.append(replay_mismatch(originals[1], own[1], self.exact))
            self.reproduces = not all(why)
            self.why_not = why[0] if not self.reproduces else ""
        return self.exact


CROSS_RANK = "SyncBatchNorm mixes every rank's batch statistics into each step: no replay reproduces one"


def cross_rank_layers(module: nn.Module) -> list[str]:
    """The qualified names of `module`'s layers whose forward in training combines every rank's batch
    (SyncBatchNorm: the batch mean and variance over all ranks), [] for none: torch's, and the other
    libraries' by their class names (apex's `SyncBatchNorm`, detectron2's `NaiveSyncBatchNorm`, mmcv's
    `SyncBN`...). A replay runs one rank's batch (or each rank a neighbour's, so the ranks' statistics combine
    in another order): such a layer's output is then not the step's."""
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.SyncBatchNorm) or _SYNC_NORM.search(type(m).__name__)]


_SYNC_NORM = re.compile(r"Sync(?:hronized)?_?(?:Batch_?Norm|BN)", re.IGNORECASE)


def replay_mismatch(original: torch.Tensor, replayed: torch.Tensor, exact: bool, rtol: float = 1e-3) -> str:
    """"" when a replay's rows [B, 4] reproduce the step's own, else why not (under 105 characters: it goes in
    GetStatus's compute mode), in words a user can act on: a constant ratio between the two gradients' norms
    is a loss scale or a division the replay misses. Pure (host tensors)."""
    if _equal(original, replayed, exact, rtol):
        return ""
    so, sr = stats_of(original)[:, 0], stats_of(replayed)[:, 0]
    if not bool(torch.isfinite(so).all()) and bool(torch.isfinite(sr).all()):
        return "the step's gradient overflowed and its replay's did not: a loss scale (pass scaler=)"
    live = (sr > 0) & (so > 0) & torch.isfinite(so) & torch.isfinite(sr)
    ratios = so[live] / sr[live]
    if live.any() and not torch.isclose(ratios.mean(), torch.ones((), dtype=ratios.dtype), rtol=rtol) \
            and bool(torch.allclose(ratios, ratios.mean().expand_as(ratios), rtol=rtol)):
        return (f"the step's gradient is {float(ratios.mean()):.6g}x its replay's: a loss scale (pass "
                "scaler=) or a division loss_fn lacks")
    return "a replay does not give its step's gradient: loss_fn must be the loss the loop back-propagates"


def loss_scale_of(scaler: Any, device: torch.device) -> torch.Tensor | None:
    """A GradScaler's current scale as a 0-d tensor without a host synchronisation (None: no scaler or a
    disabled one). Before its first `scale()` a torch GradScaler has no scale tensor yet: its `init_scale`
    then, on `device` (what its first `scale()` will use)."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
        return None
    scale = getattr(scaler, "_scale", None)    # torch.amp.GradScaler's own tensor (made at its first scale())
    if isinstance(scale, torch.Tensor):
        return scale
    init = getattr(scaler, "_init_scale", None)
    if scale is None and init is not None:
        return torch.full((), float(init), dtype=torch.float32, device=device)
    return torch.tensor(float(scaler.get_scale()))  # another scaler: its public float (a sync)


def scaled(loss: torch.Tensor, scale: torch.Tensor | None,
           cast: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """`loss` as the loop back-propagated it: times the step's loss scale, the multiplication
    `GradScaler.scale` does (the witness's float64 CPU replay: the scale cast alike)."""
    if scale is None:
        return loss
    return loss * (scale.to(loss.device) if cast is None else cast(scale))


def audit_every(budget: float, replay_s: float, step_s: float, *, least: int = 10) -> int:
    """Steps between audits so an audit (one replay) costs at most `budget` of training time."""
    if not 0 < budget < 1:
        raise ValueError(f"the audit budget is a fraction of step time in (0, 1), got {budget!r}")
    if step_s <= 0:
        return least
    return max(least, int(-(-replay_s // (budget * step_s))))
