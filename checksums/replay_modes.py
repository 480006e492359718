"""The modes a replay runs under when it must not compute as the training step does.

`full_precision`: the two-rank witness's float32 replay (autocast off per op, TF32 off); `eager`: a
`torch.compile`d model replayed eagerly, so those modes (and the op witness's trace) see every op.

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class _NoAutocast(TorchFunctionMode):
    """Every op under it runs with autocast off for `device_type`, even inside a `loss_fn`'s own
    `torch.autocast` (the innermost context wins: this one is entered around each op)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch.autocast(self.device_type, enabled=False):
            return func(*args, **(kwargs or {}))


def eager() -> contextlib.AbstractContextManager[Any]:
    """A `torch.compile`d model runs eagerly inside (`torch.compiler.set_stance("force_eager")`: no
    recompilation, every op dispatched, so the replay's modes see and steer each one); a no-op on a torch
    without stances."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _autocast_contexts_off() -> Any:
    """Every `torch.autocast` context entered inside (the loss_fn's own, an activation checkpoint's
    recomputation restoring its forward's state) enters disabled. Process-wide while it lasts: the witness's
    replay is the only work of its rank then (the training loop waits in the collective around it)."""
    cls = torch.amp.autocast_mode.autocast
    enter = cls.__enter__

    def disabled(self: Any) -> Any:
        self._enabled = False
        return enter(self)
    cls.__enter__ = disabled
    try:
        yield
    finally:
        cls.__enter__ = enter


@contextlib.contextmanager
def full_precision(device_type: str):
    """A replay in float32 throughout: autocast off (`_NoAutocast`) and TF32 off for matmuls and cuDNN, the
    flags put back after. The CPU witness's GPU side: in bf16 or fp16 a small fault changes the rounding of
    everything downstream, so the two GPUs' gradients differ by a rounding pattern as large as their
    distance from float64, and a float64 witness sits halfway (t near 0.5 for x1.01 on one element of
    GPT-2's MLP output in bf16, measured); in float32 the fault's own effect dominates. A `torch.compile`d
    model runs eagerly here (`eager`): compiled, the mode was half honoured (its gradient 3e-3 away from
    both the bf16 and the float32 one, and a recompilation first, measured). An activation checkpoint's
    recomputation in the backward runs without the mode (autograd does not carry function modes there) but
    under the autocast state its forward saw: `_autocast_contexts_off` makes that state float32 too."""
    saved: list[tuple[Any, bool]] = []
    for flags in (torch.backends.cuda.matmul, torch.backends.cudnn):
        # a torch that refuses the legacy flag (the job set its fp32_precision API): left as the job set it
        with contextlib.suppress(AttributeError, RuntimeError):
            old = flags.allow_tf32
            flags.allow_tf32 = False
            saved.append((flags, old))
    try:
        with eager(), _autocast_contexts_off(), _NoAutocast(device_type):
            yield
    finally:
        for flags, old in saved:
            with contextlib.suppress(AttributeError, RuntimeError):
                flags.allow_tf32 = old
