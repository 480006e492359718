"""Expert parallelism for the harness's MoE blocks (bench.compute_faults `--model tiny-moe --ep N`).

The experts of each MoE block are split over the N ranks of an ep group, each rank keeping its own slice;
every rank routes its own batch's tokens (the router is dense, as every other layer), and the tokens go to
the experts' ranks and back as Megatron's all-gather token dispatcher moves them: the group's tokens, their
expert choices and gates are all-gathered, each rank runs its own experts on the tokens routed to them and
weighs them by their gates, and the partial outputs are summed back onto the ranks whose tokens they are (a
reduce-scatter). So an ep group computes its ranks' steps together, each rank on its own batch, as a cp
group does with one batch's chunks: its ranks are one replica to the compute checks, found from the ep
mesh dim (`ComputeChecks.attach(..., context_parallel=world_mesh["ep"])`).

An expert's parameters live on one rank of each ep group (the same slice at the same ep place), so FSDP2
shards each block's experts over the ranks holding the same slice (torchtitan's `efsdp`), the rest over all
ranks. Two ways the slice is held: `style="local"`, each rank keeping its experts' own modules (plain
parameters, as Megatron's local experts); `style="dtensor"`, torchtitan's: the experts' weights stacked
([experts, in, out], `GroupedExperts`) and distributed over the ep mesh as DTensors (Shard(0)), so FSDP2
makes them 2-D (efsdp, ep) and the checks find the ep dim in the parameters' mesh. Gloo supports all of
it; no all-to-all (its gloo subgroup path fails with uneven splits).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.cp_attention import Gather


class _SumRows(torch.autograd.Function):
    """The sum over `group` of every rank's partial rows, this rank's chunk along dim 0 kept (a
    reduce-scatter, as an all-reduce); the backward gathers the chunks' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=0), None


class GroupedExperts(nn.Module):
    """A block's experts with their weights stacked (torchtitan's GroupedExperts): w1 [experts, width,
    2 width], w2 [experts, 2 width, width], GELU between; copied from `experts` (MoEBlock's Sequentials)."""

    def __init__(self, experts: nn.ModuleList) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.stack([e[0].weight.detach().t() for e in experts]))
        self.b1 = nn.Parameter(torch.stack([e[0].bias.detach() for e in experts]))
        self.w2 = nn.Parameter(torch.stack([e[2].weight.detach().t() for e in experts]))
        self.b2 = nn.Parameter(torch.stack([e[2].bias.detach() for e in experts]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every local expert on every row of `x` [n, width] -> [local experts, n, width]."""
        w1, b1, w2, b2 = (p.to_local() if hasattr(p, "to_local") else p
                          for p in (self.w1, self.b1, self.w2, self.b2))
        h = torch.nn.functional.gelu(torch.baddbmm(b1.unsqueeze(1), x.expand(w1.shape[0], *x.shape), w1))
        return torch.baddbmm(b2.unsqueeze(1), h, w2)


class ExpertParallel:
    """This rank's place in its ep group (`mesh`, a 1-D DeviceMesh) and the MoE blocks it splits
    (`style`: "local" or "dtensor", see the module docstring)."""

    def __init__(self, mesh: Any, style: str = "local") -> None:
        if style not in ("local", "dtensor"):
            raise ValueError(f"style is 'local' or 'dtensor', got {style!r}")
        self.mesh, self.group, self.style = mesh, mesh.get_group(), style
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)

    def attach(self, gpt: nn.Module) -> nn.Module:
        """Each MoE block of `gpt` (blocks with `experts` and `router`, bench.compute_faults.MoEBlock) keeps
        this rank's slice of its experts and routes through the ep group."""
        for block in gpt.blocks:
            n = len(block.experts)
            if n % self.size:
                raise ValueError(f"{n} experts do not split over {self.size} ep ranks")
            per = n // self.size
            first = self.rank * per
            block.expert_first = first
            if self.style == "local":
                block.experts = nn.ModuleList(block.experts[first:first + per])
            else:
                from torch.distributed.tensor import Shard, distribute_tensor
                grouped = GroupedExperts(block.experts)
                for name, p in list(grouped.named_parameters()):
                    setattr(grouped, name, nn.Parameter(distribute_tensor(p.detach(), self.mesh, [Shard(0)])))
                block.experts = grouped
            block.mlp = self._mlp_of(block)
        return gpt

    def _mlp_of(self, block: nn.Module) -> Any:
        def mlp(h: torch.Tensor) -> torch.Tensor:
            b, t, c = h.shape
            top, idx = block.router(h).topk(block.TOP, dim=-1)
            gate = top.float().softmax(-1)
            everyone = Gather.apply(h, self.group, 0)                           # [ep * b, t, c]
            gates = Gather.apply(gate, self.group, 0)                           # [ep * b, t, TOP]
            choices = [torch.empty_like(idx) for _ in range(self.size)]
            dist.all_gather(choices, idx.contiguous(), group=self.group)
            choice = torch.cat(choices, dim=0)                                  # [ep * b, t, TOP]
            partial = torch.zeros(everyone.shape, dtype=torch.float32, device=h.device)
            if self.style == "local":
                outs = [expert(everyone) for expert in block.experts]
            else:
                outs = list(block.experts(everyone.reshape(-1, c)).view(-1, *everyone.shape).unbind(0))
            for j, out in enumerate(outs):
                weight = (gates * (choice == block.expert_first + j)).sum(-1, keepdim=True)   # [ep * b, t, 1]
                partial = partial + weight * out.float()
            return _SumRows.apply(partial, self.group).to(h.dtype)
        return mlp
