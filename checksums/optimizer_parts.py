"""The optimizers one `optimizer.step()` runs, and where a parameter's state lives.

torchtitan's `OptimizersContainer` (one torch optimizer per model part, and per parameter-group recipe: a
pipeline's virtual stages, Muon for the matrices and AdamW for the rest) is itself an `Optimizer`: its
`step()` steps each optimizer it holds, its `param_groups` hold every parameter, and its hooks run around
the whole step. But its `state` is empty: the moments live in the optimizers it holds, and each fused one
reads its own `found_inf`. Everything here that reads optimizer state (the replica vote's fingerprints,
replica repair) or masks the update on the device goes through `parts` and `param_states`, so a container
is checked, repaired and masked as one optimizer is.

A container is any `Optimizer` whose `optimizers` attribute is a non-empty list or tuple of `Optimizer`s
(torchtitan's; the same shape of one's own); anything else is its own single part. Training-side module:
imports torch only.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch


def parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that hold state and run the update: a container's own (nested containers flattened),
    else `[optimizer]`."""
    inner = getattr(optimizer, "optimizers", None)
    if not (isinstance(inner, (list, tuple)) and inner
            and all(isinstance(o, torch.optim.Optimizer) for o in inner)):
        return [optimizer]
    return [p for o in inner for p in parts(o)]


def param_states(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    """(parameter, its optimizer state) for every parameter of `optimizer.param_groups`, in their order (the
    same on every replica), the state read from the part that holds it ({} before its first step)."""
    held = parts(optimizer)
    if held == [optimizer]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                yield p, optimizer.state.get(p, {})
        return
    states = [o.state for o in held]
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p, next((s[p] for s in states if p in s), {})


__all__ = ["param_states", "parts"]
