"""The collectives the rank library calls, under the name the installed torch prefers.

torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` (the old name warns that it is
deprecated); the GPU hosts run torch 2.11, which has only the old name. One output tensor for every rank's
input: a single call whatever the world size (a list of per-rank tensors costs host work that grows with it).

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from checksums.fingerprint import fingerprint_tensors_async


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                      async_op: bool = False) -> Any:
    """Every rank's `input` into `output` ([world * n, ...]: gloo takes only this form), in rank order.
    Looked up on `torch.distributed` at each call, so a wrapper set there (the tests count collectives) sees
    it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def gathered_fingerprints(tensors: Sequence[torch.Tensor], group: Any = None) -> list[tuple[int, ...]]:
    """Every rank's fingerprint of its `tensors` (`fingerprint_tensors_async`), in rank order, on the host:
    one all-gather, then a host read (a collective for rare paths: a repair's check, a named GPU's)."""
    mine = fingerprint_tensors_async(tensors).to(torch.int64).reshape(-1)
    out = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=mine.dtype, device=mine.device)
    all_gather_single(out, mine, group=group)
    return [tuple(words) for words in out.view(-1, mine.numel()).cpu().tolist()]
