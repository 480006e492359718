"""The device-side update mask: a GATE stage's verdict skips this step's update on the device, with no host
synchronisation, the way a fused optimizer skips a step when GradScaler finds inf/NaN gradients.

    mask = DeviceMask.of(guard)        # one per step guard (checksums/step_guard.py); adds its AFTER stage
    mask.add(ctx, flag)                # in a GATE stage: flag is a 0-d float tensor on the device; 1: skip

A fused torch optimizer (`torch.optim.Adam(fused=True)`, AdamW, SGD: those with `_step_supports_amp_scaling`)
reads `optimizer.found_inf` and, when it is non-zero, leaves parameters, moments and step counts unchanged,
on the device. `add` sets that attribute to the flag (the element-wise maximum with the flags already set this
step: GradScaler's, another stage's); the AFTER stage (`device_mask`) puts back what was there before
(GradScaler removes its own after the step). Nothing here reads a tensor on the host.

Used by the compute gate (checksums/compute_gate.py: the spread verdict of this step's gradients) and the
replica vote's gate (checksums/replica_recovery.py: whether the newest vote's gathered fingerprints agree).
`device_disagree` is the vote's rule on the device. Training-side module: never imports the agent.
"""
from __future__ import annotations

from typing import Any

import torch

from checksums.optimizer_parts import parts
from checksums.step_guard import Phase, StepContext, StepGuard


# torch's optimizers whose fused kernels read `found_inf`, however the fused flag was set: in the constructor
# (which also sets `_step_supports_amp_scaling`) or in each parameter group (torchtitan's, which does not)
_FOUND_INF_READERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def supports_device_mask(optimizer: torch.optim.Optimizer) -> bool:
    """Does `optimizer` skip its update on the device when `found_inf` is set? A torch optimizer whose every
    parameter group runs fused (a group that does not would ignore the flag: torch's other kernels refuse
    it); a container (torchtitan's `OptimizersContainer`) when every optimizer it holds does."""
    return not _unmasked(optimizer)


def _unmasked(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers `optimizer.step()` runs (a container's) that would not honour found_inf."""
    def masks(o: torch.optim.Optimizer) -> bool:
        return bool(o.param_groups) and all(g.get("fused") for g in o.param_groups) and (
            bool(getattr(o, "_step_supports_amp_scaling", False)) or isinstance(o, _FOUND_INF_READERS))
    return [o for o in parts(optimizer) if not masks(o)]


def choose_mask(mask: str, optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """"host": the verdict is read before the update (gloo/CPU; one sync a step on CUDA); "device": a
    found_inf flag masks the update (a fused optimizer that supports it); "auto": device on CUDA when the
    optimizer can, else host."""
    if mask not in ("host", "device", "auto"):
        raise ValueError(f"mask is 'auto', 'host' or 'device', got {mask!r}")
    fused = supports_device_mask(optimizer)
    if mask == "auto":
        return "device" if device.type == "cuda" and fused else "host"
    if mask == "device" and not fused:
        odd = _unmasked(optimizer)
        which = (f"{type(optimizer).__name__} is not one" if odd == [optimizer] else
                 f"{type(optimizer).__name__} holds optimizers that are not "
                 f"({', '.join(sorted({type(o).__name__ for o in odd}))})")
        raise ValueError(f"mask='device' needs a fused optimizer that honours found_inf (e.g. "
                         f"torch.optim.Adam(fused=True), every parameter group fused); {which}: "
                         "use mask='host'")
    return mask


def device_disagree(words: torch.Tensor) -> torch.Tensor:
    """0-d float32 on `words`' device: 1.0 when the rows of `words` ([replicas, V] int64, every replica's
    fingerprint words) are not all equal. No host synchronisation."""
    rows = words.reshape(words.shape[0], -1)
    return (rows != rows[:1]).any().float()


class DeviceMask:
    """See the module docstring. Build with `DeviceMask.of(guard)`: one per guard, shared by its stages."""

    name = "device_mask"
    phase = Phase.AFTER

    def __init__(self) -> None:
        self._armed_step: int | None = None   # the step whose found_inf this mask set
        # each optimizer's found_inf before (GradScaler's, or None) and whether it had one
        self._prev: list[tuple[Any, bool]] = []
        self._held: list[torch.optim.Optimizer] | None = None    # the guard's optimizer's parts, read once

    @classmethod
    def of(cls, guard: StepGuard) -> "DeviceMask":
        """The guard's mask, added to it (as its AFTER stage) on first use."""
        stage = guard.stage(cls.name)
        if stage is None:
            stage = cls()
            guard.add(stage)
        if not isinstance(stage, DeviceMask):
            raise TypeError(f"the stage named {cls.name!r} on this guard is a {type(stage).__name__}")
        return stage

    def add(self, ctx: StepContext, flag: torch.Tensor) -> None:
        """Skip this step's update on the device when `flag` (0-d float, on the parameters' device) is 1: set
        on the optimizer, or on each optimizer a container holds (each fused one reads its own)."""
        held = self._parts(ctx.optimizer)
        if self._armed_step is not None and self._armed_step != ctx.step:
            self._restore(held)       # the previous step raised inside optimizer.step(): its AFTER never ran
        if self._armed_step is None:
            self._armed_step = ctx.step
            self._prev = [(getattr(o, "found_inf", None), hasattr(o, "found_inf")) for o in held]
        for o in held:
            prev = getattr(o, "found_inf", None)
            o.found_inf = flag if prev is None else torch.maximum(prev.reshape(()).to(flag.dtype), flag)

    def run(self, ctx: StepContext) -> None:
        """AFTER the update: put `found_inf` back as it was before this step's flags."""
        if self._armed_step is not None:
            self._restore(self._parts(ctx.optimizer))

    def _parts(self, optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
        """The optimizers to flag (one guard, one optimizer: read at the first step, not every step)."""
        if self._held is None:
            self._held = parts(optimizer)
        return self._held

    def _restore(self, held: list[torch.optim.Optimizer]) -> None:
        for o, (prev, had) in zip(held, self._prev):
            if had:
                o.found_inf = prev
            elif hasattr(o, "found_inf"):
                del o.found_inf
        self._armed_step, self._prev = None, []


__all__ = ["DeviceMask", "choose_mask", "device_disagree", "supports_device_mask"]
