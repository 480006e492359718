"""torch's composable `replicate()` (`torch.distributed._composable.replicate`; torchtitan's DDP, `dp_shard=1`):
the DistributedDataParallel it keeps inside, for the compute checks.

`replicate(model)` leaves `model` its own class and module (no `.module` wrapper) and adds two forward hooks
that drive a DistributedDataParallel over the model's parameters (an `nn.ParameterList`), made at the first
forward (`lazy_init`). The checks need that DDP before any forward (its communication hook summarises each
bucket before the all-reduce), and replays need the model without the hooks (as DDP's `.module`: a replay is
one rank's own forward and backward, never a reduction):

- `inner_ddp(model)`: the DDP, made now where the first forward has not made it yet (its init is what the
  first forward would run, so the job's own forward finds it made), or None where `model` is not replicated;
- `qualified_names(model, params)`: each parameter's name in `model` (the DDP's own names are list indices;
  the checks name MoE experts by them);
- `hooks_off(model)`: a context in which `model`'s forward runs without `replicate`'s hooks (a replay).

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _state(model: nn.Module) -> Any:
    try:
        from torch.distributed._composable.replicate import replicate
    except ImportError:              # pragma: no cover - torch without it
        return None
    try:
        return replicate.state(model)
    except (AttributeError, KeyError, TypeError):
        return None


def inner_ddp(model: nn.Module) -> Any:
    """The DistributedDataParallel `replicate()` keeps for `model` (made now if the first forward has not
    made it), or None where `model` is not replicated so."""
    state = _state(model)
    if state is None:
        return None
    if getattr(state, "_ddp", None) is None:
        state.lazy_init()
    return state._ddp


def qualified_names(model: nn.Module, params: list[torch.Tensor]) -> list[str]:
    """The name of each of `params` in `model` (its first name, for a tied weight)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return [names.get(id(p), str(i)) for i, p in enumerate(params)]


@contextlib.contextmanager
def hooks_off(model: nn.Module) -> Iterator[None]:
    """Inside, `model`'s forward runs without `replicate()`'s hooks (DDP's pre- and post-forward): a replay
    neither prepares DDP's reduction nor syncs its buffers. The hooks go back in place after."""
    state = _state(model)
    if state is None:
        yield
        return
    saved = [(hooks, list(hooks.items())) for hooks in (model._forward_pre_hooks, model._forward_hooks)]
    for hooks, items in saved:
        for key, hook in items:
            if getattr(hook, "__self__", None) is state:
                del hooks[key]
    try:
        yield
    finally:
        for hooks, items in saved:      # in their order (hooks run in it)
            hooks.clear()
            hooks.update(items)
