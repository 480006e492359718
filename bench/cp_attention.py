"""Context parallelism for the benchmarks' GPT, written out (`bench.compute_faults --cp N`).

Each rank of a cp group holds one contiguous chunk of every sequence; a block's attention gathers the
group's keys and values (an all-gather whose backward sums each chunk's gradient back onto its rank, as
torch's context parallelism with its all-gather rotation does) and attends causally over global
positions; the position embedding starts at the chunk's offset. Two ways it is switched on, as torch offers
them: `api="module"` (always on: torchtitan's `_ContextParallel` style through `parallelize_module`, the
collectives inside the model) and `api="context"` (only inside `ContextParallel.context()`, as torch's
`context_parallel()` context manager patches SDPA for the block it wraps: outside, a chunk attends to itself
alone from position 0, as an unpatched model runs it). `api="torch"`: torch's own context parallelism
instead of the written-out attention, as torchtitan applies it (`_ContextParallel` on a module that calls
SDPA, the CP dispatcher on; contiguous chunks, no load balancing): on CUDA only, as torch shards SDPA
through its flash, efficient and cuDNN kernels, which have no sharding rule on the CPU (so the suite runs the
written-out form, and bench/gpu_run.sh `ONLY=cptorch` torch's).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Gather(torch.autograd.Function):
    """All-gather along `dim` (here 2, the sequence of [b, heads, t, d]; bench.ep_moe: 0, the tokens); the
    backward sums each rank's share of the gradient back onto it (a reduce-scatter, written as an
    all-reduce: torch.distributed.nn's all-gather falls back on gloo to a scatter that fails on a subgroup,
    torch 2.13)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size, me = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[me].contiguous(), None, None


class _Sdpa(nn.Module):
    """Causal SDPA as a module of its own, for torch's `_ContextParallel` to wrap (torchtitan's
    `inner_attention`)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ContextParallel:
    """This rank's place in its cp group (`group`) and whether the cp attention is on."""

    def __init__(self, mesh: Any, api: str = "module", rotate: str = "allgather") -> None:
        if api not in ("module", "context", "torch"):
            raise ValueError(f"api is 'module', 'context' or 'torch', got {api!r}")
        if rotate not in ("allgather", "alltoall"):
            raise ValueError(f"rotate is 'allgather' or 'alltoall', got {rotate!r}")
        self.mesh, self.group, self.api, self.rotate = mesh, mesh.get_group(), api, rotate
        group = self.group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._inside = False

    @property
    def on(self) -> bool:
        return self.api != "context" or self._inside

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The step's forward and backward (api "context"; a no-op for the others)."""
        held, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = held

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunk of `t` along the sequence dim."""
        return t.chunk(self.size, dim=dim)[self.rank].contiguous()

    def attach(self, gpt: nn.Module) -> nn.Module:
        """`gpt` (demo.model.GPT) with its blocks' attention and its positions split over the cp group."""
        gpt.pos.register_forward_pre_hook(self._positions)
        if self.api != "torch":
            for block in gpt.blocks:
                block.attend = functools.partial(self._attend, block)
            return gpt
        from torch.distributed.tensor.experimental._attention import (
            _ContextParallel,
            _cp_options,
            _enable_context_parallel_dispatcher,
            _RotateMethod,
        )
        from torch.distributed.tensor.parallel import parallelize_module
        _cp_options.enable_load_balance = False        # contiguous chunks, as `shard` cuts them
        # torch's keys and values: one all-gather (its default), or passed round the ring by all-to-all
        _cp_options.rotate_method = (_RotateMethod.ALL_TO_ALL if self.rotate == "alltoall"
                                     else _RotateMethod.ALL_GATHER)
        _enable_context_parallel_dispatcher()
        for block in gpt.blocks:
            block.sdpa = parallelize_module(_Sdpa(), self.mesh, _ContextParallel(
                seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
            block.attend = functools.partial(self._attend_torch, block)
        return gpt

    def _positions(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self.on:
            return None
        return (args[0] + self.rank * args[0].numel(),)

    @staticmethod
    def _attend_torch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = block.qkv(block.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, block.heads, c // block.heads).transpose(1, 2) for z in (q, k, v))
        return block.proj(block.sdpa(q, k, v).transpose(1, 2).reshape(b, t, c))

    def _attend(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = block.qkv(block.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, block.heads, c // block.heads).transpose(1, 2) for z in (q, k, v))
        if self.on:
            keys = Gather.apply(k, self.group, 2)
            values = Gather.apply(v, self.group, 2)
            rows = torch.arange(t, device=x.device) + self.rank * t
            mask = rows[:, None] >= torch.arange(keys.shape[2], device=x.device)[None, :]
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return block.proj(y.transpose(1, 2).reshape(b, t, c))
