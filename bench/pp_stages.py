"""Pipeline parallelism for the fault harness (`bench.compute_faults --pp N`), as torchtitan lays it out: a
(pp, dp) mesh, pp outermost; each pp rank holds one stage of the model (`torch.distributed.pipelining`'s
PipelineStage), FSDP2 shards each stage over that stage's dp ranks, and every step is the schedule's
(`ScheduleGPipe`, two micro-batches): activations go forward and their gradients back between the stages of
one pp group, point to point. The checks see one stage per rank; a pp group computes one replica's step.

`split(model, pp, stage)`: this rank's stage of the harness's models (the MLP: its three Linear units over
2 or 3 stages; the GPTs: the embeddings and the first blocks, the middle blocks, the last blocks with the
final norm and an untied head, torchtitan's layout) and the Linear the harness's matmul faults hit there.
`Pipeline(module, mesh, device, loss)`: the schedule over the FSDP-wrapped stage, and `step(module, batch)`,
the loop's step and the replay's (`ComputeChecks(step_fn=)`): every rank holds the whole batch, the first
stage feeds the inputs, the last scores the targets.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from demo.model import GPT


class GPTStage(nn.Module):
    """Stage `stage` of `stages` of a GPT: the embeddings on the first, its share of the blocks, the final
    norm and the head (untied: the embeddings live on another rank) on the last. Input: token ids (first
    stage) or hidden states; output: hidden states or logits (last stage)."""

    def __init__(self, gpt: GPT, stage: int, stages: int) -> None:
        super().__init__()
        n = len(gpt.blocks)
        if stages > n:
            raise ValueError(f"--pp {stages}: the GPT has {n} blocks, fewer than the stages")
        cut = [n * s // stages for s in range(stages + 1)]
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.tok, self.pos = gpt.tok, gpt.pos
        self.blocks = nn.ModuleList(gpt.blocks[cut[stage]:cut[stage + 1]])
        if self.last:
            self.ln_f = gpt.ln_f
            self.head = nn.Linear(gpt.head.in_features, gpt.head.out_features, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(gpt.head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def split(model: nn.Module, target: nn.Module, pp: int, stage: int) -> tuple[nn.Module, nn.Module]:
    """This rank's stage of `model` and the module the matmul faults hit on it: `target` where the stage
    holds it, else the stage's first Linear (the GPTs': its first block's MLP input, `fc`)."""
    if isinstance(model, GPT):
        mod = GPTStage(model, stage, pp)
        held = any(m is target for m in mod.modules())
        return mod, target if held else mod.blocks[0].fc
    units: list[list[nn.Module]] = []
    for m in model:                   # the MLP: each Linear with the activation after it
        if isinstance(m, nn.Linear) or not units:
            units.append([m])
        else:
            units[-1].append(m)
    if pp > len(units):
        raise ValueError(f"--pp {pp}: the MLP has {len(units)} Linear units, fewer than the stages")
    cut = [len(units) * s // pp for s in range(pp + 1)]
    mod = nn.Sequential(*[m for unit in units[cut[stage]:cut[stage + 1]] for m in unit])
    held = any(m is target for m in mod.modules())
    return mod, target if held else next(m for m in mod if isinstance(m, nn.Linear))


class Pipeline:
    """The schedule of one stage (`module`: FSDP2-wrapped already) over `mesh`'s pp dim, and the step."""

    def __init__(self, module: nn.Module, pp_group: Any, stage: int, stages: int, device: torch.device,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], micro: int = 2,
                 autocast: torch.dtype | None = None) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        self.stage_index, self.first, self.last = stage, stage == 0, stage == stages - 1
        self.device_type, self.autocast = device.type, autocast   # the forward's (the harness's bf16)
        self.stage = PipelineStage(module, stage, stages, device, group=pp_group)
        self.schedule = ScheduleGPipe(self.stage, n_microbatches=micro, loss_fn=loss)

    def step(self, module: nn.Module, batch: Any) -> None:
        """One step's forward and backward of `batch` (inputs, targets) through the pipeline: the loop's and
        each replay's (`module` is the stage's: the schedule holds it)."""
        x, y = batch
        with torch.autocast(self.device_type, dtype=self.autocast or torch.bfloat16,
                            enabled=self.autocast is not None):
            self._step(x, y)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.first:
            self.schedule.step(x, target=y if self.last else None)
        elif self.last:
            self.schedule.step(target=y)
        else:
            self.schedule.step()
