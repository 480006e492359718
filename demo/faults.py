"""The demo's fault injector: what it does to the training, never a special path in any detector.

A `FaultPlan` lists faults by step (or data index); the training loop calls the injector at fixed points
and the detectors see only the consequences, as they would in production:

- `bitflip`: after the optimizer step of `step`, flip bit `bit` of element `index` of parameter `param`
  on rank `rank` (a silent corruption of one replica's weights, as a faulty GPU would leave them);
- `bad_data`: batches with data index in [start, start + length) have their targets replaced by
  random tokens (a corrupted data shard: the loss jumps and stays up while it lasts);
- `compute`: in the backward of `step` on rank `rank`, one element of the gradient arriving at the first
  block's MLP output is set to `value` (a wrong result of the GPU's arithmetic: the replicas stay identical,
  the all-reduce would average it into all of them; the compute checks see it before the reduction);
- `xid`: an XID event on one GPU at a scenario time (only with the scenario NVML backend; the agent's
  scenario file carries it, see `daemon.demo.scenario`, written by the `sdcwatch demo` command).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class BitFlip:
    step: int
    rank: int
    param: str = ""          # default: the first parameter with at least `index + 1` elements
    index: int = 7
    bit: int = 21            # a high mantissa bit of fp32: the value changes, the loss does not notice


@dataclasses.dataclass(frozen=True)
class BadData:
    start: int               # data index
    length: int


@dataclasses.dataclass(frozen=True)
class ComputeFault:
    step: int
    rank: int
    value: float = 1e4       # the wrong gradient element (the true ones are about 1e-3)


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    bitflips: tuple[BitFlip, ...] = ()
    bad_data: tuple[BadData, ...] = ()
    compute: tuple[ComputeFault, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {"bitflips": [dataclasses.asdict(b) for b in self.bitflips],
                "bad_data": [dataclasses.asdict(b) for b in self.bad_data],
                "compute": [dataclasses.asdict(c) for c in self.compute]}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> "FaultPlan":
        return cls(bitflips=tuple(BitFlip(**b) for b in data.get("bitflips", [])),  # type: ignore[arg-type]
                   bad_data=tuple(BadData(**b) for b in data.get("bad_data", [])),  # type: ignore[arg-type]
                   compute=tuple(ComputeFault(**c) for c in data.get("compute", [])))  # type: ignore[arg-type]


class BackwardFault(torch.autograd.Function):
    """A fault in the backward: identity forward; the gradient arriving at the tensor it is applied to (a
    layer's output: what that layer's dW and dX matmuls consume) is copied and `corrupt` changes the copy
    in place. Applied in a forward hook, it hits every backward through that forward (a replay's too, if
    the hook applies it there: a persistent fault)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor,  # type: ignore[override]
                corrupt: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.corrupt = corrupt
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.clone()
        ctx.corrupt(grad)
        return grad, None


def flip_bit(t: torch.Tensor, index: int, bit: int) -> tuple[int, int]:
    """Flip one bit of element `index` (flat, row-major) of `t` in place; returns (old, new) raw words."""
    if t.element_size() not in (1, 2, 4, 8):
        raise ValueError(f"cannot flip bits of {t.dtype}")
    if not 0 <= bit < 8 * t.element_size():
        raise ValueError(f"bit {bit} out of range for {t.dtype}")
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    with torch.no_grad():
        flat = t.detach().view(-1).view(ints)
        old = int(flat[index].item())
        mask = 1 << bit
        if t.element_size() == 8 and bit == 63:
            mask = -(1 << 63)
        elif t.element_size() < 8 and bit == 8 * t.element_size() - 1:
            mask = -(1 << bit)
        flat[index] = old ^ mask
        return old, int(flat[index].item())


class Injector:
    def __init__(self, plan: FaultPlan, rank: int, seed: int = 99) -> None:
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.done: set[BitFlip] = set()
        self.armed: ComputeFault | None = None
        self.computed: set[ComputeFault] = set()

    def attach(self, model: torch.nn.Module) -> None:
        """The compute faults' place: the output of the first block's MLP (`blocks.0.fc`)."""
        model.get_submodule("blocks.0.fc").register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
        if self.armed is None or not torch.is_grad_enabled():
            return None
        value = self.armed.value
        return BackwardFault.apply(out, lambda grad: grad.view(-1).__setitem__(3, value))

    def before_forward(self, step: int) -> list[dict[str, object]]:
        """Arm this rank's compute fault scheduled for `step` (once each) for the forward and backward that
        follow; `after_backward` disarms it (a transient fault: the checks' replays compute right)."""
        for fault in self.plan.compute:
            if fault.step == step and fault.rank == self.rank and fault not in self.computed:
                self.computed.add(fault)
                self.armed = fault
                return [{"kind": "compute", "step": step, "rank": self.rank, "value": fault.value}]
        return []

    def after_backward(self) -> None:
        self.armed = None

    def after_optimizer_step(self, step: int, model: torch.nn.Module) -> list[dict[str, object]]:
        """Apply this rank's bit flips scheduled for `step` (once each, even if the step is re-run)."""
        applied = []
        for flip in self.plan.bitflips:
            if flip.step != step or flip.rank != self.rank or flip in self.done:
                continue
            name, param = self._param(model, flip)
            old, new = flip_bit(param.data, flip.index, flip.bit)
            self.done.add(flip)
            applied.append({"kind": "bitflip", "step": step, "rank": self.rank, "param": name,
                            "index": flip.index, "bit": flip.bit, "old": old, "new": new})
        return applied

    @staticmethod
    def _param(model: torch.nn.Module, flip: BitFlip) -> tuple[str, torch.Tensor]:
        for name, p in model.named_parameters():
            if (not flip.param or name == flip.param or name.endswith("." + flip.param)) and p.numel() > flip.index:
                return name, p
        raise ValueError(f"no parameter {flip.param!r} with more than {flip.index} elements")

    def batch(self, data_index: int, x: torch.Tensor, y: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The batch as the data pipeline delivers it: corrupted inside a bad-data range."""
        for bad in self.plan.bad_data:
            if bad.start <= data_index < bad.start + bad.length:
                g = torch.Generator().manual_seed(self.seed + data_index * 7919 + self.rank)
                return x, torch.randint(0, vocab, y.shape, generator=g), True
        return x, y, False
