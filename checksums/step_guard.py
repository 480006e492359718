"""The step guard: one owner of what happens around `optimizer.step()` on a training rank.

    guard = StepGuard.attach(optimizer)        # Monitor.attach(model, optimizer) does this for you
    guard.add(stage)                           # a Stage: name, phase, run(ctx) -> Veto | None
    ...
    optimizer.step()                           # the guard's stages run around it, in phase order

The guard hooks the optimizer through torch's own step hooks (`register_step_pre_hook` and
`register_step_post_hook`), so the training loop keeps calling `optimizer.step()` (or `scaler.step(opt)`)
as it always did. Each `optimizer.step()` call is one step; the stages run in the order of `Phase`:

  1. COPIES  wait for checkpoint copies of the weights still in flight (on the device: a stream wait);
  2. GATE    checks that may veto the update (the replica vote's verdict, compute-fault checks);
  3. REPAIR  bring this replica back to the agreed state;
  4. UPDATE  `optimizer.step()` itself, skipped when a stage vetoed it;
  5. AFTER   work on the weights the update produced.

The order is declared here, by the phase of each stage, never by the order in which stages were added;
stages of one phase run in the order of their names. Every stage runs every step (a stage after a veto
sees `ctx.veto` set), so checks that gather evidence always do.

Step numbers: `guard.step` is the number of optimizer steps taken so far, skipped ones included: 0 before
the first, N after the N-th (the state the weights are in; a checkpoint saved now holds step N). A vetoed
step keeps its number: the counter advances, the update does not happen, and the skip is recorded
(`guard.skipped`, a warning in the log). A step whose `optimizer.step()` was never called (GradScaler skips
the call when it finds inf/NaN gradients) is counted with `guard.skip(reason)`; the Monitor does this when
its `step()` finds no optimizer step since the previous one, so both keep counting the loop's iterations.
The Monitor and the checkpoint client read this one counter.

Restores: a checkpoint loaded into the weights starts a new restore epoch (`guard.restores`, counted; the
step it went back to is `guard.restored_step`). `renumber` to a lower step is one (a rollback names the step
it went back to), and `note_restore(step)` says so explicitly (`CheckpointClient.restore` does, for a
restore the rank resumes from, even to the step it is at). A verdict about the weights before the restore
(a replica vote, a compute check still in flight) is about a history the job left: stages compare the epoch
it was taken in with `guard.restores` and let it gate no update after the restore.

How a veto skips the update: the pre-hook hides this step's gradients from the optimizer (`p.grad = None`
for its parameters: every torch optimizer leaves a parameter without a gradient untouched, moments and step
counts included) and the post-hook puts them back, so a check may still recompute or inspect them. With
`step(closure)` (Lightning's forward+backward) the pre-hook wraps the closure: the stages run after its
first evaluation, when this step's gradients exist. An optimizer that evaluates the closure again within a
step (LBFGS) cannot be vetoed this way: a veto of such a step raises `StepGuardError` instead of letting the
update through.

One guard per optimizer: `StepGuard.attach` returns the guard an optimizer already has. Two optimizers
(say a generator and a discriminator) get two guards, each with its own stages and its own count.

Cost per step with no veto: two hook calls and one call per stage; no device work, no host allocation.
Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import weakref
from typing import Any, Protocol, runtime_checkable

import torch

from sdcwatch.errors import SdcwatchError

logger = logging.getLogger(__name__)

_MAX_SKIPPED = 1000


class StepGuardError(SdcwatchError, RuntimeError):
    """A misuse of the step guard (a stage in the UPDATE slot, two stages of one name, an unvetoable step)."""


class Phase(enum.IntEnum):
    """Where a stage runs around the update. The values are the order; leave gaps for later phases."""

    COPIES = 10   # before: checkpoint copies of the weights still in flight must land (issue 21 narrows it)
    GATE = 20     # before: checks that may veto the update (vote verdict: issue 18; compute checks: issue 19)
    REPAIR = 30   # before: bring this replica back to the agreed state (issue 18)
    UPDATE = 40   # optimizer.step() itself: the guard's own slot, no stage may take it
    AFTER = 50    # after: work on the weights the update produced


@dataclasses.dataclass(frozen=True, slots=True)
class Veto:
    """A stage's refusal of this step's update: `reason` says why, for the log and the skip record."""

    stage: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class SkippedStep:
    """A step that kept its number but changed no weight. `stage` is the vetoing stage, or "" when
    `optimizer.step()` was not called at all (`StepGuard.skip`)."""

    step: int
    stage: str
    reason: str


@dataclasses.dataclass(slots=True)
class StepContext:
    """What a stage sees. One object per guard, reused every step: read it inside `run`, do not keep it.

    step: the number this step gets (the guard's `step` before it + 1); optimizer: the guarded optimizer;
    veto: the first veto of this step, if any (set before later stages run); applied: after the update,
    whether `optimizer.step()` changed the weights (None before the update)."""

    optimizer: torch.optim.Optimizer
    step: int = 0
    veto: Veto | None = None
    applied: bool | None = None


@runtime_checkable
class Stage(Protocol):
    """One piece of work around the update. `name` is unique within a guard; `phase` is its slot in
    `Phase` (any but UPDATE). `run` is called once per step; a stage before UPDATE may return a `Veto` to
    skip this step's update; what a stage after UPDATE returns is ignored. A stage that raises is logged
    (once per stage) and counted in `GuardStats.errors` (the newest in `last_error`; the Monitor's step
    reports carry both to the agent: `rank.stage_failed`); the step goes on: the guard must not be the
    failure. Stages must not synchronise with the GPU on the usual path."""

    @property
    def name(self) -> str: ...

    @property
    def phase(self) -> Phase: ...

    def run(self, ctx: StepContext) -> Veto | None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class GuardStats:
    step: int          # the guard's step number (see the module docstring)
    applied: int       # updates that ran
    skipped: int       # steps that kept their number without an update (vetoed or not called)
    errors: int        # stage calls that raised


# The guard of each optimizer, by id; the optimizer's hooks keep its guard alive, this map never does.
_GUARDS: "weakref.WeakValueDictionary[int, StepGuard]" = weakref.WeakValueDictionary()


def _guard_of(optimizer: torch.optim.Optimizer) -> "StepGuard | None":
    guard = _GUARDS.get(id(optimizer))
    return guard if guard is not None and guard._optimizer_ref() is optimizer else None


class StepGuard:
    """See the module docstring. Build with `StepGuard.attach(optimizer)`."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, step: int = 0) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"StepGuard needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if _guard_of(optimizer) is not None:
            raise StepGuardError(f"{type(optimizer).__name__} already has a step guard: use "
                                 "StepGuard.attach(optimizer), which returns it")
        _check_step(step)
        self._optimizer_ref = weakref.ref(optimizer)
        self._step = step
        self._attempts = 0            # steps counted (applied, vetoed or skipped); only ever grows
        self._applied = 0
        self._errors = 0
        self._last_error = ""
        self._stages: dict[str, Stage] = {}
        self._before: tuple[Stage, ...] = ()
        self._after: tuple[Stage, ...] = ()
        self._failed_said: set[str] = set()
        self._skipped: collections.deque[SkippedStep] = collections.deque(maxlen=_MAX_SKIPPED)
        self._skipped_total = 0
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []   # (param, grad) of a vetoed step
        self._staged = False          # this step's stages before the update have run
        self._restores = 0            # restore epochs (note_restore, renumber to a lower step)
        self._rewrites = 0            # restores and replica repairs: the weights rewritten outside an update
        self._restored_step: int | None = None
        self._ctx = StepContext(optimizer)
        # The replicas of what this guard updates: ranks naming the same set hold bit-identical weights after
        # every update ("" when none: one rank, plain FSDP, or the vote is off). The Monitor sets it from its
        # replica group; a checkpoint client bound to the guard stamps it on each shard, so the agent compares
        # the bytes saved across the set (checkpoint.replica_bytes).
        self.replica_set = ""
        self._handles = (optimizer.register_step_pre_hook(self._pre_hook),
                         optimizer.register_step_post_hook(self._post_hook))
        _GUARDS[id(optimizer)] = self

    @classmethod
    def attach(cls, optimizer: torch.optim.Optimizer) -> "StepGuard":
        """The guard of `optimizer`, created (at step 0) if it has none."""
        guard = _guard_of(optimizer)
        return guard if guard is not None else cls(optimizer)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The guarded optimizer (None once it was garbage collected)."""
        return self._optimizer_ref()

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> "StepGuard | None":
        """The guard of `optimizer`, or None."""
        return _guard_of(optimizer)

    # ---- stages -------------------------------------------------------------------------------------

    def add(self, stage: Stage) -> None:
        """Add a stage; it runs from the next `optimizer.step()` on, in its phase's slot."""
        if not isinstance(stage, Stage):
            raise TypeError(f"{type(stage).__name__} is not a Stage (needs name, phase and run(ctx))")
        phase = Phase(stage.phase)
        if phase is Phase.UPDATE:
            raise StepGuardError(f"stage {stage.name!r}: Phase.UPDATE is optimizer.step() itself; "
                                 "use a phase before or after it")
        if stage.name in self._stages:
            raise StepGuardError(f"a stage named {stage.name!r} is already on this guard; names are unique")
        self._stages[stage.name] = stage
        self._order()

    def remove(self, name: str) -> None:
        """Remove the stage called `name` (nothing if there is none)."""
        if self._stages.pop(name, None) is not None:
            self._order()

    def _order(self) -> None:
        ordered = sorted(self._stages.values(), key=lambda s: (Phase(s.phase), s.name))
        self._before = tuple(s for s in ordered if s.phase < Phase.UPDATE)
        self._after = tuple(s for s in ordered if s.phase > Phase.UPDATE)

    def stage(self, name: str) -> Stage | None:
        """The stage called `name`, or None."""
        return self._stages.get(name)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every stage, in the order they run."""
        return self._before + self._after

    # ---- the step number ----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps taken so far, skipped ones included (see the module docstring)."""
        return self._step

    @property
    def attempts(self) -> int:
        """Steps counted since attach (applied, vetoed or skipped); never renumbered, only grows."""
        return self._attempts

    def skip(self, reason: str) -> int:
        """Count a step whose `optimizer.step()` was not called (e.g. GradScaler found inf); its number."""
        self._step += 1
        self._attempts += 1
        self._record_skip(SkippedStep(self._step, "", reason), log=False)
        return self._step

    def masked(self, step: int, stage: str, reason: str) -> None:
        """Record, afterwards, that step `step`'s update was skipped on the device (checksums.device_mask: the
        fused optimizer left the weights unchanged): it was counted applied then; the host learns it later."""
        if self._applied > 0:
            self._applied -= 1
        self._record_skip(SkippedStep(step, stage, reason), log=True)

    def renumber(self, step: int) -> None:
        """The weights are at `step` now (after a restore, or when the loop numbers its own steps). A lower
        step than the guard's is a restore (`note_restore`): verdicts taken before it gate no later update."""
        _check_step(step)
        if step < self._step:
            self.note_restore(step)
        self._step = step

    def note_restore(self, step: int) -> None:
        """The weights were (or are being) loaded from the checkpoint of `step`: a new restore epoch. Does not
        renumber (call `renumber(step)` once the state is loaded, as after any restore)."""
        _check_step(step)
        self._restores += 1
        self._rewrites += 1
        self._restored_step = step

    def note_rewrite(self) -> None:
        """The weights are being rewritten outside an update without a restore (a replica repair copies a
        majority replica's state), or may be on another shard of the same model: a check still in flight
        about the weights before (a compute check whose replay waits for the next step) must not replay on
        the new ones. Every rank that steps the same model calls it at the same step (see `rewrites`)."""
        self._rewrites += 1

    @property
    def rewrites(self) -> int:
        """Restores plus `note_rewrite`s so far: a step's weights are the ones a later step replays on only
        while this is unchanged (checksums/compute_gate.py compares it)."""
        return self._rewrites

    @property
    def restores(self) -> int:
        """Restore epochs so far (0: none since attach). A verdict taken in an older epoch is about weights
        the job left (see the module docstring)."""
        return self._restores

    @property
    def restored_step(self) -> int | None:
        """The step of the newest restore noted, or None."""
        return self._restored_step

    @property
    def skipped_count(self) -> int:
        """Skipped steps since attach (vetoed or not called)."""
        return self._skipped_total

    @property
    def skipped(self) -> list[SkippedStep]:
        """The most recent skipped steps (up to 1000), oldest first."""
        return list(self._skipped)

    @property
    def stats(self) -> GuardStats:
        return GuardStats(step=self._step, applied=self._applied, skipped=self._skipped_total,
                          errors=self._errors)

    @property
    def last_error(self) -> str:
        """The newest stage failure, "STAGE at step N: Type: message" (200 characters at most), or ""."""
        return self._last_error

    def close(self) -> None:
        """Remove the hooks; the optimizer steps unguarded afterwards. Idempotent."""
        for handle in self._handles:
            handle.remove()
        optimizer = self._optimizer_ref()
        if optimizer is not None and _guard_of(optimizer) is self:
            del _GUARDS[id(optimizer)]

    # ---- the hooks ----------------------------------------------------------------------------------

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        if self._hidden:                   # the previous step raised inside optimizer.step(): undo its veto
            self._restore_grads()
        ctx = self._ctx
        ctx.step = self._step + 1
        ctx.veto = None
        ctx.applied = None
        self._staged = False
        closure = _closure_of(args, kwargs)
        if closure is not None and not isinstance(optimizer, _MULTI_EVAL):
            # The closure computes this step's gradients (Lightning passes forward+backward as one): the
            # stages run once it has, before the update, and a veto hides the gradients it made.
            return _with_closure(args, kwargs, self._closure_then_stages(optimizer, closure))
        self._run_before(optimizer, ctx, closure is not None)
        return None

    def _run_before(self, optimizer: torch.optim.Optimizer, ctx: StepContext, multi_eval: bool) -> None:
        self._staged = True
        for stage in self._before:
            verdict = self._run(stage, ctx)
            if verdict is not None and ctx.veto is None:
                ctx.veto = verdict
        if ctx.veto is not None:
            if multi_eval:
                raise StepGuardError(
                    f"step {ctx.step}: {ctx.veto.stage} vetoed the update ({ctx.veto.reason}), but this "
                    "optimizer.step() has a closure that computes its own gradients, so it cannot be "
                    "skipped; the update was not applied (stop, or restore a checkpoint)")
            self._hide_grads(optimizer)

    def _closure_then_stages(self, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
        def guarded(*a: Any, **kw: Any) -> Any:
            if self._staged:
                if self._ctx.veto is not None:
                    raise StepGuardError(
                        f"step {self._ctx.step}: the update was vetoed ({self._ctx.veto.reason}) but the "
                        "optimizer evaluates its closure again, recomputing the gradients; it cannot be "
                        "skipped (stop, or restore a checkpoint)")
                return closure(*a, **kw)
            loss = closure(*a, **kw)
            self._run_before(optimizer, self._ctx, False)
            return loss
        return guarded

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        ctx = self._ctx
        if not self._staged:               # a closure the optimizer never called: the stages still run
            self._run_before(optimizer, ctx, False)
        vetoed = ctx.veto is not None
        if vetoed:
            self._restore_grads()
        ctx.applied = not vetoed
        self._step = ctx.step
        self._attempts += 1
        if vetoed:
            assert ctx.veto is not None
            self._record_skip(SkippedStep(ctx.step, ctx.veto.stage, ctx.veto.reason), log=True)
        else:
            self._applied += 1
        for stage in self._after:
            self._run(stage, ctx)

    def _run(self, stage: Stage, ctx: StepContext) -> Veto | None:
        try:
            return stage.run(ctx)
        except Exception as exc:  # a stage must never break training; said once per stage, then counted,
            self._errors += 1     # and the Monitor's step reports carry the count and the newest error
            self._last_error = f"{stage.name} at step {ctx.step}: {type(exc).__name__}: {exc}"[:200]
            if stage.name not in self._failed_said:
                self._failed_said.add(stage.name)
                logger.exception("sdcwatch: step guard stage %r failed at step %d (said once per stage)",
                                 stage.name, ctx.step)
            return None

    def _record_skip(self, skip: SkippedStep, log: bool) -> None:
        self._skipped.append(skip)
        self._skipped_total += 1
        if log:
            logger.warning("sdcwatch: step %d skipped (weights unchanged), vetoed by %s: %s",
                           skip.step, skip.stage, skip.reason)

    def _hide_grads(self, optimizer: torch.optim.Optimizer) -> None:
        hidden = self._hidden
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None

    def _restore_grads(self) -> None:
        for p, g in self._hidden:
            p.grad = g
        self._hidden.clear()


# Optimizers that evaluate their closure several times per step (the stages run before it, as without one).
_MULTI_EVAL: tuple[type, ...] = (torch.optim.LBFGS,)


def _closure_of(args: Any, kwargs: Any) -> Any:
    """The closure of an `optimizer.step(closure)` call (args[0] is the optimizer), or None."""
    if kwargs.get("closure") is not None:
        return kwargs["closure"]
    return args[1] if len(args) > 1 and args[1] is not None else None


def _with_closure(args: Any, kwargs: Any, closure: Any) -> tuple[Any, Any]:
    """(args, kwargs) of the step call with `closure` in place of the caller's."""
    if kwargs.get("closure") is not None:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


def _check_step(step: Any) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a step number is an int >= 0, got {step!r}")
