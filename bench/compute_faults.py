"""Fault-injection harness for the compute checks (issue 19): fault x detector -> caught, steps, rank named.

Runs a tiny MLP under DDP on W ranks (gloo on CPU by default; NCCL on CUDA with --device cuda), with the
compute gate (checksums.compute_gate: pre-reduction statistics every step, replay audits every
--audit-every steps) and the Monitor's replica vote, and injects one fault per case on rank --fault-rank
at step --fault-step: matmul outputs (one element, a tile, a warp-periodic chunk, zeroed values; from one
ulp to an exponent flip), gradients before the reduction, Adam's exp_avg, a weight; transient (one step)
or persistent (every step from there). Prints the table and, with --clean N, N clean steps: suspicions
and the measured clean cross-rank spread.

    PYTHONPATH=$PWD python bench/compute_faults.py --world 3                 # the CPU matrix (gloo)
    PYTHONPATH=$PWD python bench/compute_faults.py --world 3 --clean 10000 --cases none
    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=$PWD torchrun --nproc-per-node 2 bench/compute_faults.py \
        --device cuda --model gpt2 --cases h200 --clean 2000 --overhead 400
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import functools
import hashlib
import json
import math
import os
import pstats
import statistics
import threading
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from bench.cpu_gemm import float32_gemms
from bench.paired import paired_interval
from bench.pp_stages import Pipeline, split
from bench.rank_start import start_ranks
from bench.tiny_gpt import GPTConfig, TinyGPT
from demo.faults import BackwardFault
from demo.model import Block
from checksums import native_hook
from checksums.compute_gate import DEFAULT_WARMUP, ComputeChecks
from checksums.device_mask import DeviceMask
from checksums.device_verdict import DeviceVerdict
from checksums.fingerprint import triton_available
from checksums.grad_checks import BucketAllreduce, GradSummaries, SpreadTracker, set_fused, summary_paths
from checksums.monitor import Monitor
from checksums.op_witness import redispatched
from checksums.optimizer_parts import param_states
from checksums.replica_recovery import ReplicaRecovery
from checksums.replay import Replayer
from checksums.reporter import ReporterStats, StepReport
from checksums.step_guard import StepGuard


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    where: str            # mm | tc | tcb | tca | bwd | grad | opt | weight (tc, tcb: its bf16/fp16 matmuls
    #                       only, forward or backward: a tensor core's; tca: block 0's fused attention op)
    how: str              # elem | tile | warp | zero | ulp | expflip | scale | channel | set
    value: float = 0.0
    persistent: bool = False


CASES = [
    Case("mm one elem =1e4", "mm", "set", 1e4),
    Case("mm one elem =10", "mm", "set", 10.0),
    Case("mm one elem exp-flip", "mm", "expflip"),
    Case("mm one elem ulp", "mm", "ulp"),
    Case("mm one elem x1.01 persistent", "mm", "scale", 1.01, True),
    Case("mm channel x2 persistent", "mm", "channel", 2.0, True),
    Case("mm tile 4x8 x2", "mm", "tile", 2.0),
    Case("mm warp-periodic chunk x4", "mm", "warp", 4.0),
    Case("mm zeroed column", "mm", "zero"),
    Case("mm x1.05 persistent", "mm", "scale", 1.05, True),
    Case("mm one elem =1e4 persistent", "mm", "set", 1e4, True),
    Case("bwd one elem =1e4", "bwd", "set", 1e4),
    Case("bwd one elem x2", "bwd", "scale", 2.0),
    Case("bwd one elem x1.01 persistent", "bwd", "scale", 1.01, True),
    Case("bwd channel x2 persistent", "bwd", "channel", 2.0, True),
    Case("bwd zeroed column", "bwd", "zero"),
    Case("grad elem =100", "grad", "set", 100.0),
    Case("grad elem =0.01", "grad", "set", 0.01),
    Case("grad elem ulp persistent", "grad", "ulp", 0.0, True),
    Case("grad elem NaN", "grad", "set", float("nan")),
    Case("adam exp_avg exp-flip", "opt", "expflip"),
    Case("weight exp-flip", "weight", "expflip"),
]
# a tensor core's fault: the target's matmul output wrong only where it is computed in bf16 or fp16 (its
# float32 matmuls, on other units, stay right); for a run under autocast (--cpu-autocast, or the GPU)
TC_CASES = [
    Case("tc one elem x1.05 persistent", "tc", "scale", 1.05, True),
    Case("tc channel x2 persistent", "tc", "channel", 2.0, True),
    Case("tc one elem =10 persistent", "tc", "set", 10.0, True),
    Case("tc backward channel x2 persistent", "tcb", "channel", 2.0, True),     # its first bf16 matmul in backward
    Case("tc attn one elem x1.05 persistent", "tca", "scale", 1.05, True),  # block 0's attention (GPT)
]
# an MoE router's fault (--model tiny-moe): block 0's top-k over the experts' bf16 scores returns one wrong
# index (its values right): a token goes to another expert; an integer output, decided exactly by the op witness
MOE_CASES = [Case("moe router top-k index persistent", "tcr", "index", 0.0, True)]
TC_WHERE = ("tc", "tcb", "tca", "tcr")     # injected inside the op (MatmulFault), in bf16/fp16 only
H200 = ["mm one elem =1e4", "mm one elem =10", "mm one elem x1.01 persistent", "mm channel x2 persistent",
        "grad elem =100", "grad elem =0.01", "mm one elem ulp", "mm zeroed column", "adam exp_avg exp-flip",
        "weight exp-flip", "mm tile 4x8 x2", "grad elem NaN"]
# --cases by group (else names, comma-separated)
GROUPS: dict[str, Callable[[], list[str]]] = {"all": lambda: [c.name for c in CASES], "h200": lambda: H200,
                                              "tc": lambda: [c.name for c in TC_CASES],
                                              "moe": lambda: [c.name for c in MOE_CASES], "none": lambda: []}


def selected(spec: str) -> list[Case]:
    """The cases `--cases spec` names (a group, or names comma-separated), in the table's order."""
    names = GROUPS[spec]() if spec in GROUPS else spec.split(",")
    return [c for c in CASES + TC_CASES + MOE_CASES if c.name in names]


def flip_bit(t: torch.Tensor, index: int, which: str) -> None:
    """Flip one bit of element `index` in place: its lowest mantissa bit ("ulp"), or its top exponent bit
    ("exp": for |x| < 1 the one that makes it huge, else the next one down). float32 or bfloat16/float16."""
    flat = t.detach().view(-1)
    size = flat.element_size()
    ints = flat.view(torch.int32 if size == 4 else torch.int16)
    nbits = 8 * size
    bit = 0 if which == "ulp" else (nbits - 2 if abs(float(flat[index])) < 1.0 else nbits - 3)
    ints[index:index + 1].bitwise_xor_(1 << bit)


def corrupt(t: torch.Tensor, case: Case) -> None:
    """Apply `case` to tensor t in place (activations [..., features] seen as 2-D, or a flat tensor)."""
    with torch.no_grad():
        if hasattr(t, "to_local"):          # FSDP2: a DTensor's shard (a weight or Adam's state): this rank's
            t = t.to_local()
        flat = t.view(-1)
        t2 = t.view(-1, t.shape[-1]) if t.dim() >= 2 else t.view(1, -1)
        if case.how == "set":
            flat[3] = case.value
        elif case.how == "scale":
            flat[3] *= case.value
        elif case.how == "ulp":
            flip_bit(t, 3, "ulp")
        elif case.how == "expflip":
            flip_bit(t, 3, "exp")
        elif case.how == "channel":            # column 5, or the last of a narrower output (a router's)
            t2[:, min(5, t2.shape[1] - 1)] *= case.value
        elif case.how == "tile":
            t2[:4, :8] *= case.value
        elif case.how == "warp":
            flat[::32] *= case.value
        elif case.how == "zero":
            t2[:, min(3, t2.shape[1] - 1)] = 0.0


def fault_output(out: torch.Tensor, case: Case) -> torch.Tensor | None:
    """`case` on the target layer's output `out`, in its forward hook (what the hook returns): a matmul fault
    corrupts it in place; a backward fault wraps it so the gradient reaching it (what the layer's dW and dX
    matmuls consume) is corrupted, in every backward through this forward (a replay's too, when the hook
    applies it there: a persistent one); other cases leave it."""
    if case.where == "mm":
        corrupt(out, case)
    elif case.where == "bwd":
        return BackwardFault.apply(out, lambda grad: corrupt(grad, case))
    return None


class _Sink:
    """A StepSink that keeps the compute findings the Monitor's reports carry (no agent in the bench)."""

    def __init__(self) -> None:
        self.compute: list[Any] = []

    def submit(self, report: StepReport) -> bool:
        self.compute.extend(report.compute)
        return True

    def take_directives(self) -> list[Any]:
        return []

    def stats(self) -> ReporterStats:
        return ReporterStats()


# set by --model per worker (--sdcguard: bf16, --hsdp: replicas, --amp)
MODEL: dict[str, Any] = {"name": "mlp", "bf16": False, "hsdp": 0, "factory": True, "batch": 8, "amp": "bf16",
                         "ac": "none", "wide_fails": -1, "sync_bn": False, "titan_optimizers": False,
                         "params_bf16": False, "tp": 1, "cp": 1, "cp_api": "module", "cp_pass": "name",
                         "cp_replay_context": False, "cp_rotate": "allgather", "cp_mesh": "dims", "ep": 1,
                         "ep_style": "local"}


class Checkpointed(nn.Module):
    """`--ac`: activation checkpointing of one module (`torch.utils.checkpoint`, reentrant or not), as
    torchtitan's and Megatron's activation checkpointing wrap a block: its activations are recomputed in
    the backward, under the RNG state the forward saw."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


class MoEBlock(Block):
    """A GPT block whose MLP is routed, as an MoE layer's (Mixtral's: the top 2 of the experts' scores per
    token, their outputs combined by the softmax of those scores); the tiny model's 4 experts computed densely
    and the chosen ones gathered by the top-k's indices (`--model tiny-moe`)."""

    EXPERTS, TOP = 4, 2

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        del self.fc, self.out                        # the dense MLP: replaced by the experts
        w = cfg.width
        self.router = nn.Linear(w, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(w, 2 * w), nn.GELU(), nn.Linear(2 * w, w))
                                     for _ in range(self.EXPERTS))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        top, idx = self.router(h).topk(self.TOP, dim=-1)
        gate = top.float().softmax(-1)
        ys = torch.stack([e(h) for e in self.experts], dim=-2)                     # [b, t, experts, c]
        chosen = ys.gather(-2, idx.unsqueeze(-1).expand(b, t, self.TOP, c))
        return (gate.unsqueeze(-1) * chosen.float()).sum(-2).to(h.dtype)


def make_model(seed: int) -> tuple[nn.Module, nn.Module]:
    """The model and the Linear whose output the matmul faults hit (`--ac`: the MLP's middle layer, or every
    GPT block, activation-checkpointed; tiny-moe: block 0's router)."""
    torch.manual_seed(seed)
    ac = MODEL["ac"] != "none"
    if MODEL["name"] == "mlp":
        m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
        target = m[2]
        if ac:
            m[2] = Checkpointed(target, MODEL["ac"] == "reentrant")
        return m, target
    if MODEL["name"] == "cnn":
        return small_cnn()
    cfg = GPTConfig() if MODEL["name"] == "gpt2" else GPTConfig(layers=2, width=64, heads=2, vocab=256, seq=32)
    g = TinyGPT(cfg)
    if MODEL["name"] == "tiny-moe":
        g.blocks = nn.ModuleList(MoEBlock(g.cfg) for _ in g.blocks)
    target = g.blocks[0].router if MODEL["name"] == "tiny-moe" else g.blocks[0].fc
    if ac:
        for i, block in enumerate(g.blocks):
            g.blocks[i] = Checkpointed(block, MODEL["ac"] == "reentrant")
    return g, target


def small_cnn() -> tuple[nn.Module, nn.Module]:
    """`--model cnn`: a small image classifier with the parts vision jobs have and the GPTs do not: 2-D
    convolutions, BatchNorm (running statistics: buffers a replay must put back; `--sync-bn`: SyncBatchNorm,
    whose forward is itself a collective), dropout (a replay needs the step's RNG state). The faults hit the
    second convolution's output."""
    def unit(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    m = nn.Sequential(*unit(3, 16), *unit(16, 32), nn.MaxPool2d(2), *unit(32, 32), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Dropout(0.1), nn.Linear(32, 10))
    if MODEL["sync_bn"]:
        m = nn.SyncBatchNorm.convert_sync_batchnorm(m)
    return m, m[3]


def batch_for(rank: int, step: int, device: torch.device, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * rank + step + 7919 * micro)
    if MODEL["name"] == "cnn":      # 16 images 3x16x16 and their classes (a learnable rule: the mean colour)
        x = torch.randn(16, 3, 16, 16, generator=g)
        y = (x.mean(dim=(2, 3)).argmax(dim=1) * 3 + torch.randint(0, 3, (16,), generator=g)) % 10
        return x.to(device, dtype=torch.bfloat16 if MODEL["params_bf16"] else None), y.to(device)
    if MODEL["name"] != "mlp":
        seq, vocab, n = (1024, 50257, MODEL["batch"]) if MODEL["name"] == "gpt2" else (32, 256, 8)
        idx = torch.randint(0, vocab, (n, seq + 1), generator=g)
        return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)
    x = torch.randn(32, 16, generator=g)
    y = torch.sin(x[:, :4] * 1.3) + 0.1 * torch.randn(32, 4, generator=g)
    dtype = torch.bfloat16 if MODEL["params_bf16"] else None     # --params-bf16: the inputs too
    return x.to(device, dtype=dtype), y.to(device, dtype=dtype)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    if MODEL["wide_fails"] >= 0 and MODEL["wide_fails"] == dist.get_rank() and any(
            type(m).__name__ == "_NoAutocast" for m in torch.overrides._get_current_function_mode_stack()):
        # --witness-fp32-fails: this rank has no memory for the CPU witness's float32 replay
        raise torch.OutOfMemoryError("injected: no memory for the witness's float32 replay")
    fp16 = MODEL["amp"] == "fp16"      # --amp fp16: fp16 autocast, the loop under a GradScaler (run_case)
    dtype = torch.float16 if fp16 else torch.bfloat16
    bf16 = x.device.type == "cuda" or MODEL["bf16"] or fp16   # sdcguard checks bf16/fp16 matmuls only
    if MODEL["name"] == "cnn":
        with torch.autocast(x.device.type, dtype=dtype, enabled=bf16):
            return nn.functional.cross_entropy(model(x).float(), y)
    if MODEL["name"] != "mlp":
        with torch.autocast(x.device.type, dtype=dtype, enabled=bf16):
            return model(x, y)
    with torch.autocast(x.device.type, dtype=dtype, enabled=MODEL["bf16"] or fp16):
        return nn.functional.mse_loss(model(x).float(), y.float())


class MatmulFault(TorchDispatchMode):
    """The faulty GPU, inside the matmul: corrupts the output of the target layer's matmul op (aten::mm,
    addmm, bmm, linear) where it is computed, so a check of the matmul itself (sdcguard's ABFT checksums,
    a dispatch mode entered inside this one) sees the wrong output, and so does everything downstream (our
    gradient statistics). Used with --sdcguard, and for the tensor-core cases (`TC_CASES`: only its bf16/fp16
    matmuls; an op witness, entered inside this one, sees the op compute wrong from right inputs); without
    them a forward hook corrupts the layer's output, the same values."""

    OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear")

    def __init__(self, target: nn.Module, case: Case | None, active: dict[str, bool],
                 block: nn.Module | None = None) -> None:
        super().__init__()
        self.case, self.active, self.inside = case, active, False
        if self.where(case) in ("tca", "tcr"):   # block 0's fused attention op, or its router's top-k
            assert block is not None, "an attention or router fault needs a GPT (--model tiny-gpt, tiny-moe, gpt2)"
            target = block
        target.register_forward_pre_hook(lambda m, i: setattr(self, "inside", self.where(case) != "tcb"))
        target.register_forward_hook(lambda m, i, o: setattr(self, "inside", False))
        if self.where(case) == "tcb":    # the layer's backward: its first matmul (dX or dW) is wrong
            target.register_full_backward_pre_hook(lambda m, g: setattr(self, "inside", True))

    @staticmethod
    def where(case: Case | None) -> str:
        return case.where if case is not None else ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if redispatched(types):
            return NotImplemented     # a DTensor's op (a tp-split layer): the fault is in the local op
        out = func(*args, **(kwargs or {}))
        # (no grad-mode test: sdcguard's checked linear runs its matmul inside an autograd.Function's forward)
        low = (torch.bfloat16, torch.float16) if self.where(self.case) in TC_WHERE else None
        if self.where(self.case) == "tcb" and torch._C._current_autograd_node() is None:
            return out                # (tcb: a matmul the backward runs, not a forward's)
        if self.where(self.case) == "tcr":
            if (self.inside and self.active["on"] and str(func) == "aten.topk.default"
                    and args[0].dtype in low):
                self.inside = False
                idx = out[1]                       # [batch, tokens, top]: token 3's first choice, the next expert
                with torch.no_grad():
                    idx[0, 3, 0] = (idx[0, 3, 0] + 1) % args[0].shape[-1]
            return out
        if self.where(self.case) == "tca":
            name = str(func)
            if (self.inside and self.active["on"] and "scaled_dot_product" in name and "backward" not in name
                    and out[0].dtype in low):
                self.inside = False
                o = out[0]                         # [batch, heads, length, dim], strided: one element
                assert self.case.how == "scale", "an attention fault scales one element"
                with torch.no_grad():
                    o[(0,) * (o.dim() - 2) + (3, 1)] *= self.case.value
            return out
        if (self.inside and self.active["on"] and self.case is not None and self.case.where in ("mm", "tc", "tcb")
                and isinstance(out, torch.Tensor) and out.dtype != torch.float64
                and (low is None or out.dtype in low)
                and getattr(func, "_schema", None) is not None
                and func._schema.name in self.OPS):
            self.inside = False       # the layer's own matmul only, not the checksum matmuls a check runs after it
            corrupt(out, self.case)
        return out


def _sdcguard(every: int, model: nn.Module | None = None) -> Any:
    """sdcguard's guard checking every `every`-th step. With `model` (SDCGUARD["mode"] "protect", its
    documented training mode, `SDCGuard(every=20).protect(model)`): every nn.Linear's matmuls, forward, dX and
    dW; without ("dispatch", its default mode): every matmul PyTorch runs. Both check bf16/fp16 matmuls only."""
    try:
        from sdcguard import SDCGuard
    except ImportError as e:          # the [bench] extra has it
        raise SystemExit(f"--sdcguard needs the sdcguard package (pip install 'sdcwatch[bench]'): {e}") from e
    guard = SDCGuard(every=every)
    if model is not None and SDCGUARD["mode"] == "protect":
        guard.protect(model)
    return guard


SDCGUARD = {"mode": "protect"}       # set by --sdcguard-mode in each worker


def titan_optimizers(model: nn.Module | list[nn.Module], fused: bool = True,
                     lr: float = 1e-3) -> torch.optim.Optimizer:
    """--titan-optimizers (and the tests' containers): torchtitan's `OptimizersContainer` over the model (or
    its model parts), as its trainer builds it from parameter-group recipes: Adam for the weights, AdamW (no
    decay: the same update) for the rest, so two optimizers a part, fused (torchtitan sets `fused` in each
    group) or not."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    return OptimizersContainer(OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r"weight$", optimizer_name="Adam",
                                       optimizer_kwargs={"lr": lr}),
                      ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": lr, "weight_decay": 0.0})],
        implementation="fused" if fused else "for-loop"),
        model_parts=model if isinstance(model, list) else [model])


def ddp_buckets(params: Sequence[torch.Tensor], cap_mb: float) -> list[list[torch.Tensor]]:
    """DDP's bucket layout of `params` as this harness builds it (`bucket_cap_mb`; no rebuild): parameters in
    reverse order, a bucket closed once it holds `cap_mb` MiB. For what replays the harness's buckets in one
    process (tests/test_compute_clean_steps.py, bench/mixed_sources.py)."""
    cap = int(cap_mb * 1024 * 1024)
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in reversed(list(params)):
        out[-1].append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            out.append([])
            size = 0
    return [b for b in out if b]


def _wrap(model: nn.Module, device: torch.device, world: int, fsdp: bool, mesh: Any = None,
          **ddp_kwargs: Any) -> nn.Module:
    """DDP, or FSDP2 (each Linear of the MLP or each GPT block its own group, then the root; no replica
    vote), on a (replicate, shard) mesh with --hsdp; on `mesh` where given (--cp)."""
    if not fsdp:
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    from torch.distributed.fsdp import fully_shard
    shard: dict[str, Any] = {}
    if mesh is not None:
        shard["mesh"] = mesh
    elif MODEL["tp"] > 1:   # --tp: the MLP's Linears split over a tp dim (innermost), FSDP2 over the others
        shard["mesh"] = _tensor_parallel(model, device, world)
    elif MODEL["hsdp"]:   # HSDP: a (replicate, shard) mesh; the reduce-scatter within a shard group
        from torch.distributed.device_mesh import init_device_mesh
        shard["mesh"] = init_device_mesh(device.type, (MODEL["hsdp"], world // MODEL["hsdp"]),
                                         mesh_dim_names=("replicate", "shard"))
    for sub in model.modules():
        if sub is not model and (isinstance(sub, nn.Linear) and MODEL["name"] == "mlp"
                                 or isinstance(sub, Block)):
            fully_shard(sub, **shard)
    return fully_shard(model, **shard)


def _tensor_parallel(model: nn.Module, device: torch.device, world: int) -> Any:
    """`--tp N`: the MLP's first Linear column-parallel, the second (the faults' target) row-parallel (its
    output all-reduced over tp), the last column-parallel gathered, as Megatron and torchtitan split an MLP;
    the mesh (dp, tp), or (replicate, shard, tp) with --hsdp. FSDP2's mesh: the data-parallel dims."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    tp = MODEL["tp"]
    if MODEL["hsdp"]:
        mesh = init_device_mesh(device.type, (MODEL["hsdp"], world // (MODEL["hsdp"] * tp), tp),
                                mesh_dim_names=("replicate", "shard", "tp"))
        dp = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                           "4": ColwiseParallel(output_layouts=Replicate())})
    return dp


def _context_parallel(model: nn.Module, device: torch.device, world: int) -> tuple[Any, Any, Any]:
    """`--cp N`: the GPT's sequences split over N ranks (bench.cp_attention), on a (dp, cp) mesh whose dims
    FSDP2 shards over together (flattened, as torchtitan's dp_shard_cp; with --hsdp a (replicate, shard, cp)
    mesh, FSDP2 on (replicate, shard x cp); with --tp T a (dp, cp, tp) mesh, each block's MLP split
    column- then row-parallel over tp, the attention whole on every tp rank); the cp dim is named "cp" (found
    by the checks) or, with --cp-pass arg|none, "seq" (passed as context_parallel=, or not at all).
    -> (FSDP's mesh, the ContextParallel, what context_parallel= gets)."""
    from torch.distributed.device_mesh import init_device_mesh

    from bench.cp_attention import ContextParallel
    name, cp_size, hsdp = "cp" if MODEL["cp_pass"] == "name" else "seq", MODEL["cp"], MODEL["hsdp"]
    tp = MODEL["tp"]
    if MODEL["cp_mesh"] == "unflatten":
        return _context_parallel_unflattened(model, device, world, name)
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh(device.type, (world // (cp_size * tp), cp_size, tp),
                                mesh_dim_names=("dp", name, "tp"))
        fsdp_mesh = mesh["dp", name]._flatten(f"dp_{name}")
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()})
    elif hsdp:
        mesh = init_device_mesh(device.type, (hsdp, world // (hsdp * cp_size), cp_size),
                                mesh_dim_names=("replicate", "shard", name))
        mesh["shard", name]._flatten(f"shard_{name}")
        fsdp_mesh = mesh["replicate", f"shard_{name}"]
    else:
        mesh = init_device_mesh(device.type, (world // cp_size, cp_size), mesh_dim_names=("dp", name))
        fsdp_mesh = mesh["dp", name]._flatten(f"dp_{name}")
    cp = ContextParallel(mesh[name], MODEL["cp_api"], MODEL["cp_rotate"])
    cp.attach(model)
    return fsdp_mesh, cp, mesh[name] if MODEL["cp_pass"] == "arg" else None


def _pipeline_mesh(device: torch.device, world: int, stage: nn.Module,
                   plan: dict[int, Any]) -> tuple[Any, Any]:
    """`--pp N`: torchtitan's (pp, dp) mesh (pp outermost; with --hsdp (pp, replicate, shard); with --tp T
    (pp, dp, tp), the stage's Linears split over tp by `plan`, their styles by the Linear (id) of the whole
    MLP: column-, row-, column-parallel as `_tensor_parallel`'s); the pp dim named "pp" (found by the checks)
    or, with --cp-pass arg|none, "stage". -> (the pp dim, FSDP's mesh: the stage's data-parallel dims)."""
    from torch.distributed.device_mesh import init_device_mesh
    name, pp, hsdp = "pp" if MODEL["cp_pass"] == "name" else "stage", MODEL["pp"], MODEL["hsdp"]
    if MODEL["tp"] > 1:
        from torch.distributed.tensor.parallel import parallelize_module
        tp = MODEL["tp"]
        mesh = init_device_mesh(device.type, (pp, world // (pp * tp), tp), mesh_dim_names=(name, "dp", "tp"))
        parallelize_module(stage, mesh["tp"], {n: plan[id(m)] for n, m in stage.named_children()
                                               if id(m) in plan})
        return mesh[name], mesh["dp"]
    if hsdp:
        mesh = init_device_mesh(device.type, (pp, hsdp, world // (pp * hsdp)),
                                mesh_dim_names=(name, "replicate", "shard"))
        return mesh[name], mesh["replicate", "shard"]
    mesh = init_device_mesh(device.type, (pp, world // pp), mesh_dim_names=(name, "dp"))
    return mesh[name], mesh["dp"]


def _stage_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """--pp: the last stage's loss of one micro-batch (the schedule's `loss_fn`), as `loss_fn` scores the
    whole model's output."""
    if MODEL["name"] == "mlp":
        return nn.functional.mse_loss(out.float(), y.float())
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def _split_experts(model: nn.Module, device: torch.device, world: int) -> Any:
    """`--ep N` (--model tiny-moe): each MoE block's experts split over the N ranks of an ep group
    (bench.ep_moe), on an (efsdp, ep) mesh (efsdp: the ranks holding the same experts, torchtitan's name);
    -> the mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from bench.ep_moe import ExpertParallel
    ep, name, hsdp = MODEL["ep"], "ep" if MODEL["cp_pass"] == "name" else "xp", MODEL["hsdp"]
    if hsdp:         # --hsdp R: (replicate, efsdp, ep), torchtitan's dp_replicate outermost
        mesh = init_device_mesh(device.type, (hsdp, world // (hsdp * ep), ep),
                                mesh_dim_names=("replicate", "efsdp", name))
    else:
        mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", name))
    ExpertParallel(mesh[name], MODEL["ep_style"]).attach(model)
    return mesh


def _shard_experts(model: nn.Module, mesh: Any) -> tuple[Any, Any]:
    """--ep: each expert sharded by FSDP2 over the ranks holding it (efsdp), before the blocks and the root
    over all ranks. -> (FSDP's mesh for the rest, what expert_parallel= gets: with --cp-pass arg, the ep
    dim (named "xp"); else nothing: the checks find the dim named "ep", or, --cp-pass none, not)."""
    from torch.distributed.fsdp import fully_shard
    name = mesh.mesh_dim_names[-1]
    hsdp = "replicate" in mesh.mesh_dim_names    # --hsdp: HSDP over (replicate, efsdp), (replicate, fsdp)
    for block in model.blocks:
        for expert in (block.experts if MODEL["ep_style"] == "local" else [block.experts]):
            fully_shard(expert, mesh=mesh["replicate", "efsdp"] if hsdp else mesh["efsdp"])
    dense = mesh["efsdp", name]._flatten("fsdp")
    return (mesh["replicate", "fsdp"] if hsdp else dense), (mesh[name] if MODEL["cp_pass"] == "arg" else None)


def _context_parallel_unflattened(model: nn.Module, device: torch.device, world: int,
                                  name: str) -> tuple[Any, Any, Any]:
    """`--cp-mesh unflatten`: the meshes as newer torchtitan builds them, each unflattened from one 1-D world
    mesh: the data-loading mesh (batch, cp, tp), whose cp dim the ContextParallel uses, and the dense mesh
    (dp_replicate, fsdp, tp) with fsdp = dp_shard x cp, FSDP2's (no mesh holds both a "cp" and FSDP's
    dims: the checks find the cp groups among the process groups the world mesh made, by their dim's name)."""
    from torch.distributed.device_mesh import init_device_mesh

    from bench.cp_attention import ContextParallel
    cp_size, tp, replicate = MODEL["cp"], MODEL["tp"], MODEL["hsdp"] or 1
    world_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("world",))
    loading = world_mesh._unflatten(0, (world // (cp_size * tp), cp_size, tp), ("batch", name, "tp"))
    dense = world_mesh._unflatten(0, (replicate, world // (replicate * tp), tp),
                                  ("dp_replicate", "fsdp", "tp"))
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        for block in model.blocks:
            parallelize_module(block, dense["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()})
    fsdp_mesh = dense["dp_replicate", "fsdp"] if MODEL["hsdp"] else dense["fsdp"]
    cp = ContextParallel(loading[name], MODEL["cp_api"], MODEL["cp_rotate"])
    cp.attach(model)
    return fsdp_mesh, cp, loading[name] if MODEL["cp_pass"] == "arg" else None


def run_case(case: Case | None, *, rank: int, world: int, device: torch.device, steps: int, fault_step: int,
             fault_rank: int, audit_every: int, warmup: int, margin: float, mask: str = "auto",
             accum: int = 1, fault_micro: int = 0, fsdp: bool = False, sdcguard: int = 0,
             fused_adam: bool = False, experts_hint: bool = True, recover: bool = False) -> dict[str, Any]:
    model, target = make_model(0)
    ep_mesh = None
    if MODEL["ep"] > 1:        # --ep: the faults hit this rank's experts (block 0's), not the router
        ep_mesh = _split_experts(model, device, world)
        target = model.blocks[0].experts[0][0] if MODEL["ep_style"] == "local" else model.blocks[0].experts
    pp = MODEL.get("pp", 1)
    plan: dict[int, Any] = {}
    if pp > 1:          # --pp: this rank's stage (pp outermost: ranks [s * dp, (s + 1) * dp) hold stage s)
        if MODEL["tp"] > 1:     # --tp too: each Linear's style, as `_tensor_parallel` splits the whole MLP
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
            plan = {id(model[0]): ColwiseParallel(), id(model[2]): RowwiseParallel(),
                    id(model[4]): ColwiseParallel(output_layouts=Replicate())}
        model, target = split(model, target, pp, rank // (world // pp))
    model = model.to(device, dtype=torch.bfloat16 if MODEL["params_bf16"] else None)
    active = {"on": False}
    tp = MODEL["tp"]

    def mm_hook(mod: nn.Module, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
        # (float64: the CPU witness of two-rank replays, checksums.replay.Replayer.witness: the CPU is not the
        # faulty GPU)
        if not (active["on"] and case is not None and torch.is_grad_enabled() and out.dtype != torch.float64):
            return None
        if case.where == "mm" and sdcguard:      # injected inside the matmul instead (MatmulFault)
            return None
        if tp > 1 and case.where == "mm":      # the local tensor of tensor parallelism's output: a view
            out = out.clone()
            fault_output(out, case)
            return out
        return fault_output(out, case)         # a backward fault with --sdcguard too: outside its matmuls

    def grad_inject(idx: int, buf: torch.Tensor) -> None:
        if active["on"] and case is not None and case.where == "grad" and idx == 0:
            corrupt(buf, case)

    if tp == 1:
        target.register_forward_hook(mm_hook)
    cp_mesh = cp = cp_arg = ep_arg = pp_arg = None
    if MODEL["cp"] > 1:
        cp_mesh, cp, cp_arg = _context_parallel(model, device, world)
    elif ep_mesh is not None:
        cp_mesh, ep_arg = _shard_experts(model, ep_mesh)
    elif pp > 1:
        pp_mesh, cp_mesh = _pipeline_mesh(device, world, model, plan)
        pp_arg = pp_mesh if MODEL["cp_pass"] == "arg" else None
    ddp = _wrap(model, device, world, fsdp, cp_mesh, bucket_cap_mb=0.01)
    group = tp * MODEL["cp"]           # the ranks that run one batch together (a tp or cp group)
    pipe = None
    if pp > 1:                          # the schedule over the FSDP2-wrapped stage; the loss on the last
        low = device.type == "cuda" or MODEL["bf16"] or MODEL["amp"] == "fp16"     # as loss_fn's autocast
        pipe = Pipeline(ddp, pp_mesh.get_group(), rank // (world // pp), pp, device, _stage_loss,
                        autocast=(torch.float16 if MODEL["amp"] == "fp16" else torch.bfloat16)
                        if low else None)
    in_step = cp.context if cp is not None else contextlib.nullcontext
    if tp > 1:     # after tensor parallelism's own hooks: the output as this rank holds it (a plain tensor)
        target.register_forward_hook(mm_hook)
    # fused Adam where the device mask needs it, and for DDP on CUDA; --fused-adam: always (FSDP2's host veto
    # against its device mask on the same optimizer)
    fused = fused_adam or mask == "device" or (not fsdp and device.type == "cuda")
    opt = (titan_optimizers(ddp, fused) if MODEL["titan_optimizers"]
           else torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=fused))
    sink = _Sink()
    monitor = (None if fsdp and (not MODEL["hsdp"] or group > 1) else     # HSDP: the vote across replicas
               Monitor.attach(ddp, opt, job_id="compute-faults", reporter=sink, gpu_uuid=f"GPU-fake-{rank}"))
    # --recover: the vote gates the update and, with 3+ replicas, repairs the odd one in place
    recovery = ReplicaRecovery.attach(monitor) if recover and monitor is not None else None
    step_loss = loss_fn if accum == 1 else (lambda m, b: loss_fn(m, b) / accum)
    replay_by = {"loss_fn": step_loss} if pipe is None else {"step_fn": pipe.step}
    scaler = torch.amp.GradScaler(device.type) if MODEL["amp"] == "fp16" else None   # its default scale

    def backward(loss: torch.Tensor) -> None:
        (scaler.scale(loss) if scaler is not None else loss).backward()
    checks = ComputeChecks.attach(ddp, opt, **replay_by, audit_every=audit_every, warmup=warmup,
                                  margin=margin, gpu_uuid=f"GPU-fake-{rank}", monitor=monitor, mask=mask,
                                  scaler=scaler,
                                  inject_bucket=grad_inject if rank == fault_rank else None,
                                  # FSDP2 with 2 ranks: the model-level CPU witness needs the bare model (a
                                  # factory; --no-witness-model: the op witness alone)
                                  witness_model=((lambda: make_model(0)[0]) if fsdp and MODEL["factory"]
                                                 and group == 1 and pp == 1 else None),
                                  **({} if experts_hint else {"experts": None}),
                                  **({"context_parallel": cp_arg} if cp_arg is not None else {}),
                                  **({"expert_parallel": ep_arg} if ep_arg is not None else {}),
                                  **({"pipeline_parallel": pp_arg} if pp_arg is not None else {}),
                                  **({"replay_context": cp.context} if cp is not None
                                     and MODEL["cp_replay_context"] else {}))
    caught: dict[str, dict[str, Any]] = {}
    mine: dict[str, int] = {}          # this rank's own first sdcguard alert (sdcguard runs per rank)
    guard = _sdcguard(sdcguard, model) if sdcguard else None
    fault_mode = (MatmulFault(target, case, active, getattr(model, "blocks", [None])[0])
                  if sdcguard or MatmulFault.where(case) in TC_WHERE else None)
    # entered a step before the fault's (it injects only while `active`), so the clean steps before it run
    # without a Python call per op (the tensor-core cases: half their time), and stays on to the run's end,
    # replays included (a persistent fault is the GPU's)
    mode_from = max(1, fault_step - 1)
    t0 = time.perf_counter()
    unchanged = None
    effective = None          # the fault changed the faulty rank's gradient (mm/grad faults; None: not measured)
    for step in range(1, steps + 1):
        if fault_mode is not None and step == mode_from:
            fault_mode.__enter__()
        on = case is not None and rank == fault_rank and (
            step == fault_step or (case.persistent and step >= fault_step))
        # the forward and gradient faults hit this step's backward; a persistent one also hits the replays
        # this rank runs in the gate (the same GPU computes wrong again), a transient one does not
        # with --accum N: N micro-batches, all but the last under no_sync(); a transient matmul fault hits
        # micro-batch --fault-micro only
        for micro in range(accum):
            active["on"] = on and case is not None and (
                case.where == "grad"
                or (case.where in ("mm", *TC_WHERE, "bwd") and (case.persistent or micro == fault_micro)))
            # a tp or cp group's ranks: one batch; a pp group's (one rank of each stage): one batch
            batch = batch_for(rank // group if pp == 1 else rank // tp % (world // (pp * tp)), step, device,
                              micro)
            if cp is not None:                                         # each cp rank its chunk of it
                batch = tuple(cp.shard(t) for t in batch)
            checks.retain(batch)
            if guard is not None:
                with guard.on_step(step):
                    if micro < accum - 1:
                        with ddp.no_sync():
                            backward(step_loss(ddp, batch))
                    else:
                        backward(step_loss(ddp, batch))
            elif pipe is not None:
                pipe.step(ddp, batch)
            elif fsdp:
                ddp.set_requires_gradient_sync(micro == accum - 1)
                with in_step():
                    backward(step_loss(ddp, batch))
            elif micro < accum - 1:
                with ddp.no_sync():
                    backward(step_loss(ddp, batch))
            else:
                backward(step_loss(ddp, batch))
        if case is None or not case.persistent:
            active["on"] = False
        if (step == fault_step and case is not None and case.where in ("mm", *TC_WHERE, "bwd", "grad")
                and (on or fsdp and 0 <= fault_rank < world) and checks.replayer.reproduces):
            # did the fault change any bit of the gradient this rank hands to the all-reduce? (a one-ulp flip
            # of an activation often rounds away): the original rows against a clean recompute (FSDP2: a
            # collective replay, every rank its own batch)
            held, active["on"] = active["on"], False
            same = torch.equal(checks.summaries.rows()[:, 2:].cpu(),
                               checks.replayer.replay(checks.replayer.retained)[:, 2:].cpu())
            effective = not same if on else effective
            checks.replayer.replays -= 1
            active["on"] = held
        before = [p.detach().clone() for p in model.parameters()] if step == fault_step and not fsdp else None
        if scaler is not None:
            scaler.step(opt)        # fused Adam: always steps (with the scaler's found_inf)
            scaler.update()
        else:
            opt.step()
        if before is not None:      # did the fault's step change the weights? (masked: no)
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt.zero_grad(set_to_none=True)
        weight = target.weight if hasattr(target, "weight") else next(target.parameters())   # --ep dtensor
        if on and case is not None and case.where == "opt":     # (a container's: in the optimizer holding it)
            st = next(state for p, state in param_states(opt) if p is weight)
            corrupt(st["exp_avg"], case)
        if on and case is not None and case.where == "weight":
            corrupt(weight.data, case)
        if monitor is not None:
            monitor.step()
        for f in checks.findings:
            first = caught.get("compute")
            # the finding that names a rank wins over a cleared one of the same step (two ranks: both are
            # suspects, the replays clear one and name the other)
            if f.step >= fault_step and (first is None or (not first["named"] and f.faulty
                                                            and first["step"] == f.step)):
                caught["compute:" + f.detector] = {"step": f.step, "named": list(f.faulty), "cause": f.cause,
                                                   "dropped": f.dropped, "detector": f.detector,
                                                   "detail": f.detail, "one_of": f.one_of}
                caught["compute"] = caught["compute:" + f.detector]
        checks.findings.clear()
        for ev in (monitor.events if monitor is not None else ()):
            if ev.kind == "replica.mismatch" and ev.step >= fault_step and "vote" not in caught:
                caught["vote"] = {"step": ev.step, "named": [s["rank"] for s in ev.details["suspects"]]}
        if fsdp and monitor is not None:       # HSDP: a shard's vote is its replica group's ranks' only, and
            votes: list[Any] = [None] * world  # every rank must leave the loop at the same step
            dist.all_gather_object(votes, caught.get("vote"))
            seen = [v for v in votes if v is not None]
            if seen:
                caught["vote"] = min(seen, key=lambda v: v["step"])
        if guard is not None and "sdcguard" not in mine:
            for ev in guard.log.events:
                if ev.step is not None and ev.step >= fault_step:
                    mine["sdcguard"] = ev.step
                    break
        persisting = case is not None and case.persistent and step <= fault_step + 10
        if caught and not recover and step > fault_step + 2 and not persisting and (
                guard is None or step >= fault_step + sdcguard):
            break
    elapsed = time.perf_counter() - t0
    if fault_mode is not None and step >= mode_from:
        fault_mode.__exit__(None, None, None)
    if guard is not None:                      # which ranks' sdcguard alerted, and when
        alerts: list[Any] = [None] * world
        dist.all_gather_object(alerts, mine.get("sdcguard"))
        hits = [(s_, r) for r, s_ in enumerate(alerts) if s_ is not None]
        if hits:
            first = min(s_ for s_, _ in hits)
            caught["sdcguard"] = {"step": first, "named": [r for s_, r in hits if s_ == first]}
        caught["sdcguard_stats"] = {"checked": guard.stats.get("checked", 0),
                                    "skipped_dtype": guard.stats.get("skipped_dtype", 0),
                                    "alerts": guard.stats.get("alerts", 0)}
    if 0 <= fault_rank < world:                # rank 0 writes the results: it needs the faulty rank's measure
        box = [effective]
        dist.broadcast_object_list(box, src=fault_rank)
        effective = box[0]
    st = checks.status()
    weights = _weights_digest(model, world)
    repairs = None
    if recovery is not None:                   # every rank's repairs (under HSDP only the odd shard's group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, [dict(dataclasses.asdict(r), rank=rank) for r in recovery.repairs])
        repairs = [r for ranks in gathered for r in ranks]
    if monitor is not None:
        monitor.close()
    checks.close()
    reported = [(f.step, f.detector, f.cause, [list(w) for w in f.where]) for f in sink.compute]
    # an update the gate held back without naming a GPU (its replays off: `mode` says why)
    held = next((k.step for k in checks.guard.skipped if k.step >= fault_step and k.stage == checks.name), None)
    return {"caught": caught, "held": held, "steps": step, "elapsed_s": elapsed, "status": dataclasses.asdict(st),
            "mode": checks.mode(), "scale": float(scaler.get_scale()) if scaler is not None else None,
            "expert_buckets": list(checks.expert_buckets or ()), "zeroable": list(checks.tracker.zeroable),
            "reported": reported, "fault_step_unchanged": unchanged, "effective": effective,
            "spread": checks.tracker.spread.tolist() if checks.tracker.spread is not None else [],
            "weights": weights,
            # --recover: the replica repairs, and every update skipped from the fault on (by which stage)
            "repairs": repairs,
            "shards": world // MODEL["hsdp"] if fsdp and MODEL["hsdp"] else 1 if not fsdp else world,
            "skipped": sorted({(k.step, k.stage) for k in checks.guard.skipped if k.step >= fault_step})}


def _weights_digest(model: nn.Module, world: int) -> list[str]:
    """Every rank's sha256 of its weights (its shards under FSDP2) after the run: runs that must apply the
    same updates (with and without audits) compare them (a collective)."""
    h = hashlib.sha256()
    for p in model.parameters():
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        h.update(local.contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    out: list[Any] = [None] * world
    dist.all_gather_object(out, h.hexdigest())
    return out


ARMS = ("hook", "checks", "checks-python", "checks-torch", "checks-inline", "checks+audits", "all",
        "sdcguard")


def overhead(*, rank: int, device: torch.device, steps: int, block: int, audit_every: int,
             mask: str, sdcguard: int = 0, together: bool = False, profile: int = 0,
             gpu_profile: int = 0, sync_debug: bool = False, fsdp: bool = False,
             accum: int = 1, hook_arm: bool = False, host_parts: int = 0,
             busy_thread: float = 0.0, host_ops: int = 0, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Step time of the same DDP model under each arm, in alternating blocks of `block` steps (interleaved,
    so drift in the machine's speed hits every arm alike): "base" (no checks), "checks" (the compute gate's
    pre-reduction checks every step, no audits), "checks+audits" (audits every `audit_every`), and with
    `sdcguard` "sdcguard" (its ABFT checks every `sdcguard`-th step, no gate). Each block's time is measured
    over the whole block with one synchronisation at its end. Each arm's step time is its mean over all its
    blocks (an audit every 334 steps lands in one block in several: a median would leave it out); the
    median block is kept too, and the median over rounds of each round's ratio to the base block of the
    same round (`paired`: drift between rounds cancels). `accum`: micro-batches per optimizer step (all but
    the last under `no_sync()`, as jobs that accumulate run): the checks run once a step. `only`: these
    arms and base, no others (`--arms`: more rounds of the arms in question in the same time)."""
    fused = (mask == "device" or device.type == "cuda") and not fsdp   # FSDP2: the host veto (as run_case)
    # with --profile: cProfile sees the training thread only, and DDP's comm hook runs on autograd's device
    # thread, so the hook, the gate, retain() and Monitor.step are timed by wrappers too (host seconds per
    # step on any thread); wrapped before the arms are made, as DDP keeps the hook it was given at attach
    spent: dict[str, float] = {}
    spent_on = bool(profile or host_parts)
    if spent_on:
        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)   # DDP reads the hook's signature (state, bucket)
            def wrapper(*a: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return wrapper
        wrapped = [(GradSummaries, "_hook"), (ComputeChecks, "run"), (ComputeChecks, "retain"), (Monitor, "step")]
        if host_parts:   # the parts inside them (each time includes what it calls)
            if triton_available():
                from checksums.grad_summary_triton import GradSummaryPlan
                wrapped.append((GradSummaryPlan, "launch"))
            import checksums.grad_checks as grad_checks
            from checksums.host_ring import HostSlot
            wrapped += [(grad_checks, "all_gather_single"), (HostSlot, "wait"), (HostSlot, "flagged")]
            wrapped += [(BucketAllreduce, "__call__"), (GradSummaries, "gather"), (GradSummaries, "rows"),
                        (GradSummaries, "_hook_gathered"),
                        (ComputeChecks, "_mask_on_device"), (ComputeChecks, "_settle_previous"),
                        (DeviceVerdict, "flag"), (DeviceMask, "add"), (DeviceMask, "run"),
                        (SpreadTracker, "assess"), (SpreadTracker, "learn_clean"),
                        (ComputeChecks, "_learn_deferred"), (StepGuard, "_pre_hook"),
                        (StepGuard, "_post_hook"),
                        (Replayer, "end_step")]
        for cls, attr in wrapped:
            setattr(cls, attr, timed(f"{cls.__name__}.{attr}", cls.__dict__[attr]))
    arms: list[tuple[str, Any, Any, Any, Any, Any]] = []
    # on CUDA also the checks through torch ops (the pre-fused path), for the fused kernel's gain in this run
    names = (["base"] + (["hook"] if hook_arm else []) + ["checks"] + (["checks-python"] if hook_arm else [])
             + (["checks-torch", "checks-inline"] if device.type == "cuda" else []) + ["checks+audits"]
             + (["all"] if together and not fsdp else []) + (["sdcguard"] if sdcguard else []))
    if only:
        names = [n for n in names if n == "base" or n in only]
    world = dist.get_world_size()
    for name in names:
        model = make_model(0)[0].to(device)
        ddp = _wrap(model, device, world, fsdp)     # FSDP2 (--fsdp): audits are collective replays
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=fused)
        checks = monitor = None
        if name == "all":
            monitor = Monitor.attach(ddp, opt, job_id=f"overhead-all-{rank}", reporter=False, canary=True,
                                     gpu_uuid=f"GPU-fake-{rank}")
            ReplicaRecovery.attach(monitor)
        if name.startswith("checks") or name == "all":
            checks = ComputeChecks.attach(ddp, opt, loss_fn=loss_fn, mask=mask, gpu_uuid=f"GPU-fake-{rank}",
                                          monitor=monitor,
                                          audit_every=audit_every if name in ("checks+audits", "all") else 0,
                                          side_stream=False if name == "checks-inline" else None,
                                          native=False if name == "checks-python" else None)
        if name == "hook":      # DDP through a Python comm hook that only reduces (BucketAllreduce): the
            reduce = BucketAllreduce(getattr(ddp, "process_group", None))   # floor of a per-bucket hook
            def only_reduce(state, bucket, reduce=reduce):  # type: ignore[no-untyped-def]
                return reduce(bucket.buffer())
            ddp.register_comm_hook(None, timed("hook-arm", only_reduce) if spent_on else only_reduce)
        guard = _sdcguard(sdcguard, model) if name == "sdcguard" else None
        arms.append((name, ddp, opt, checks, guard, monitor))
    times: dict[str, list[float]] = {name: [] for name in names}
    paths: dict[str, dict[str, int]] = {}
    hooks: dict[str, str] = {}         # the comm hook each arm's checks ran through

    # every batch made on the device before timing, as a loader with pinned memory and non-blocking copies
    # delivers them: a pageable copy per step waits for the stream, so the GPU idled ~20 ms a step while the
    # host launched the next one and every arm's host work was timed as if it were device work
    batches = [batch_for(rank, s, device, micro) for s in range(steps + 2 * block + host_parts)
               for micro in range(accum)]
    step_loss = loss_fn if accum == 1 else (lambda m, b: loss_fn(m, b) / accum)
    # --busy-thread F: a Python thread computing beside the training for a share F of the time, in bursts of
    # 1 ms (as a loader's collate, a tokenizer or a metrics thread does), so a Python call on autograd's
    # thread (a Python comm hook's, a bucket at a time) may wait for the GIL; the C++ hook's bound buckets
    # take none
    busy = threading.Event()
    if busy_thread > 0:
        def spin() -> None:
            while not busy.is_set():
                end = time.perf_counter() + 1e-3
                while time.perf_counter() < end:
                    sum(i * i for i in range(200))
                if busy_thread < 1:
                    busy.wait(1e-3 * (1 - busy_thread) / busy_thread)
        threading.Thread(target=spin, name="busy-python", daemon=True).start()

    def run_block(arm: tuple[Any, ...], steps_: range) -> None:
        _, ddp, opt, checks, guard, monitor = arm
        for s in steps_:
            for micro in range(accum):
                batch = batches[s * accum + micro]
                if checks is not None:
                    checks.retain(batch)
                sync = micro == accum - 1
                if fsdp:
                    ddp.set_requires_gradient_sync(sync)
                with (contextlib.nullcontext() if sync or fsdp else ddp.no_sync(),
                      guard.on_step(s + 1) if guard is not None else contextlib.nullcontext()):
                    loss = step_loss(ddp, batch)
                    if spent_on:     # the backward's host time: autograd's launches and every bucket's hook
                        t = time.perf_counter()
                        loss.backward()
                        spent["(backward)"] = spent.get("(backward)", 0.0) + time.perf_counter() - t
                    else:
                        loss.backward()
            opt.step()
            if monitor is not None:
                monitor.step(loss)
            opt.zero_grad(set_to_none=True)

    # untimed rounds of blocks first: kernel compilation (Triton, cuBLAS/cuDNN plans, sdcguard's set-up)
    # lands in each arm's first block, and in a mean over 10 blocks a 1.6 s compile is +8 ms a step; and the
    # checks' warm-up (their first judged step sets up the device verdict once: one block of 80 on an H100
    # took 8 ms a step more, the whole of the checks' mean) ends inside them
    warm_blocks = max(1, math.ceil((DEFAULT_WARMUP + 2) / block))
    step, rnd = -block * warm_blocks, 0
    while step < steps:
        # the arms' order turns each round, so no arm always runs right after the same other arm
        for arm in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:
            name = arm[0]
            set_fused(name != "checks-torch")
            dist.barrier()
            t0 = time.perf_counter()
            # warm-up: batches after the timed ones (the same ones each warm-up round)
            run_block(arm, range(step, step + block) if step >= 0 else range(steps, steps + block))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= 0:
                times[name].append((time.perf_counter() - t0) / block)
            if arm[3] is not None:
                paths[name] = summary_paths(arm[3].summaries)
                hooks[name] = ("C++" if getattr(arm[3].summaries, "native", False) else
                               f"Python ({native_hook.why() or 'asked'})")
        step += block
        rnd += 1
    host: dict[str, Any] = {}
    if profile:   # where each arm's host time goes (cProfile of one more block; the GPU runs ahead)
        for arm in arms:
            set_fused(arm[0] != "checks-torch")
            prof = cProfile.Profile()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            spent.clear()
            prof.enable()
            run_block(arm, range(steps + block, steps + 2 * block))
            prof.disable()
            st = pstats.Stats(prof)
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:profile]   # by own (tottime) time
            host[arm[0]] = {"wrapped": {k: v / block for k, v in spent.items()},
                            "host_s_per_step": st.total_tt / block,
                            "top": [(f"{Path(f).name}:{ln}:{fn}", tt / block, ct / block, nc // block)
                                    for (f, ln, fn), (cc, nc, tt, ct, _) in rows]}
    if host_parts:   # host time a step in each part, by the wrappers alone (no cProfile): rounds of blocks
        parts: dict[str, dict[str, list[float]]] = {a[0]: {} for a in arms}
        for rnd in range(3):
            for arm in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:
                set_fused(arm[0] != "checks-torch")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                spent.clear()
                t0 = time.perf_counter()
                run_block(arm, range(steps + block, steps + block + host_parts))
                enqueued = time.perf_counter() - t0     # the host's own time: it ran ahead of the GPU
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                got = parts[arm[0]]
                for k, v in [("(enqueue)", enqueued), ("(step)", time.perf_counter() - t0), *spent.items()]:
                    got.setdefault(k, []).append(v / host_parts)
        for name, got in parts.items():
            host.setdefault(name, {"host_s_per_step": float("nan"), "top": []})
            host[name]["parts"] = {k: statistics.median(v) for k, v in got.items()}
    if sync_debug and device.type == "cuda":   # what makes the host wait for the GPU inside a step
        import traceback
        import warnings
        seen: dict[str, int] = {}

        def note(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                 line: Any = None) -> None:
            where = "".join(traceback.format_stack(limit=12)[:-2])
            key = f"{message}\n{where}"
            seen[key] = seen.get(key, 0) + 1
        for arm in arms:
            if arm[0] not in ("base", "checks", "all"):
                continue
            seen.clear()
            old = warnings.showwarning
            warnings.showwarning = note
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run_block(arm, range(steps + block, steps + 2 * block))
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                    warnings.showwarning = old
            host.setdefault(arm[0], {"host_s_per_step": float("nan"), "top": []})
            host[arm[0]]["syncs"] = [(n / block, k) for k, n in sorted(seen.items(), key=lambda kv: -kv[1])]
    kernels = bool(gpu_profile) and device.type == "cuda"
    if kernels or host_ops:     # what each arm adds: device kernels, host operations (torch.profiler)
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile
        acts = (([ProfilerActivity.CPU] if host_ops else [])
                + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))
        for arm in arms:
            set_fused(arm[0] != "checks-torch")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            with tprofile(activities=acts) as prof:
                run_block(arm, range(steps + block, steps + 2 * block))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            evs = prof.key_averages()
            h = host.setdefault(arm[0], {"host_s_per_step": float("nan"), "top": []})
            if host_ops:
                h["all_ops"] = profile_times(evs, block, "self_cpu_time_total")
            if kernels:
                own = sorted((e for e in evs if e.self_device_time_total > 0),
                             key=lambda e: -e.self_device_time_total)
                h["device_s_per_step"] = sum(e.self_device_time_total for e in own) / 1e6 / block
                h["kernels"] = [(e.key[:90], e.self_device_time_total / 1e3 / block, e.count // block)
                                for e in own[:gpu_profile]]
                h["all_kernels"] = profile_times(own, block, "self_device_time_total")
        for name in names:              # each arm over base, kernel by kernel and operation by operation
            mine, base_h = host.get(name, {}), host.get("base", {})
            if name == "base":
                continue
            if "all_ops" in mine and "all_ops" in base_h:
                mine["op_diff"] = profile_diff(base_h["all_ops"], mine["all_ops"], top=host_ops)
            if "all_kernels" in mine and "all_kernels" in base_h:
                mine["kernel_diff"] = profile_diff(base_h["all_kernels"], mine["all_kernels"])
    set_fused(True)
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    busy.set()                              # the busy thread, if any, stops
    mean = {name: sum(t) / len(t) for name, t in times.items()}
    # block k of every arm ran in round k (the order turned within the round): pair each with base's
    ratios = {name: [a / b for a, b in zip(t, times["base"])] for name, t in times.items()}
    out: dict[str, Any] = {"arms": {name: {"step_s": mean[name], "median_s": med[name],
                                           "paired": statistics.median(ratios[name]) - 1.0,
                                           "paired_mean": statistics.fmean(ratios[name]) - 1.0,
                                           "paired_ci": paired_interval(ratios[name]),
                                           "overhead": mean[name] / mean["base"] - 1.0,
                                           "blocks": times[name]} for name in names},
                           "blocks": len(times["base"]), "block": block, "warm_rounds": warm_blocks,
                           "audit_every": audit_every,
                           "accum": accum, "busy_thread": busy_thread,
                           "sdcguard_every": sdcguard, "sdcguard_mode": SDCGUARD["mode"],
                           "summary_paths": paths, "hooks": hooks, "host": host,
                           "status": {a[0]: dataclasses.asdict(a[3].status()) for a in arms if a[3] is not None}}
    # the previous keys (one gated arm: checks with audits)
    if "checks+audits" in mean:
        out.update(base_step_s=mean["base"], gated_step_s=mean["checks+audits"],
                   overhead=mean["checks+audits"] / mean["base"] - 1.0)
    return out


def _flaky_replays(calls: set[int]) -> None:
    """This rank's replays numbered in `calls` (1-based, this process) come back with a fingerprint word
    changed: a GPU that does not reproduce one computation (`--flaky-replay`; the first step's determinism
    check makes calls 1-2, its second round, if any, 3-4)."""
    from checksums.replay import Replayer

    real = Replayer.replay
    count = [0]

    def replay(self: Any, *a: Any, **k: Any) -> torch.Tensor:
        rows = real(self, *a, **k)
        count[0] += 1
        if count[0] in calls:
            rows = rows.clone()
            rows[0, 2] ^= 1                              # one bit of the first bucket's fingerprint
        return rows
    Replayer.replay = replay  # type: ignore[method-assign]


def _flaky_spec(text: str) -> tuple[int, list[int]]:
    rank, _, calls = text.partition(":")
    try:
        out = int(rank), [int(c) for c in calls.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--flaky-replay is RANK:CALL[,CALL...], got {text!r}") from None
    if out[0] < 0 or not out[1] or min(out[1]) < 1:
        raise argparse.ArgumentTypeError(f"--flaky-replay is RANK:CALL[,CALL...] (calls from 1), "
                                         f"got {text!r}")
    return out


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True, warn_only=args.determinism == "warn")
    backend = args.backend if args.backend != "auto" else "gloo" if device.type == "cpu" else "nccl"
    if init:
        dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    else:
        dist.init_process_group(backend)
    torch.set_num_threads(1)
    MODEL["name"] = args.model
    MODEL["bf16"] = bool(args.sdcguard) or args.cpu_autocast
    MODEL["wide_fails"] = args.witness_fp32_fails
    MODEL["hsdp"] = args.hsdp
    MODEL["tp"] = args.tp
    MODEL["cp"] = args.cp
    MODEL["ep"] = args.ep
    MODEL["ep_style"] = args.ep_style
    MODEL["pp"] = args.pp
    MODEL["cp_api"] = args.cp_api
    MODEL["cp_pass"] = args.cp_pass
    MODEL["cp_replay_context"] = args.cp_replay_context
    MODEL["cp_rotate"] = args.cp_rotate
    MODEL["cp_mesh"] = args.cp_mesh
    MODEL["factory"] = not args.no_witness_model
    MODEL["batch"] = args.batch
    MODEL["amp"] = args.amp
    MODEL["ac"] = args.ac
    MODEL["sync_bn"] = args.sync_bn
    MODEL["params_bf16"] = args.params_bf16
    MODEL["titan_optimizers"] = args.titan_optimizers
    SDCGUARD["mode"] = args.sdcguard_mode
    if device.type == "cpu" and (MODEL["bf16"] or MODEL["params_bf16"] or args.amp == "fp16"):
        float32_gemms()         # bf16/fp16 GEMMs as a GPU's tensor cores compute them (bench/cpu_gemm.py)
    if args.flaky_replay and rank == args.flaky_replay[0]:
        _flaky_replays(set(args.flaky_replay[1]))
    results = {}
    for case in selected(args.cases):
        if case.where == "tca" and args.model in ("mlp", "cnn"):
            if rank == 0:
                print(f"{case.name}: skipped, the MLP has no attention (--model tiny-gpt or gpt2)", flush=True)
            continue
        if case.where == "tcr" and args.model != "tiny-moe":
            if rank == 0:
                print(f"{case.name}: skipped, no router (--model tiny-moe)", flush=True)
            continue
        results[case.name] = run_case(case, rank=rank, world=world, device=device,
                                      steps=args.fault_step + args.after, fault_step=args.fault_step,
                                      fault_rank=args.fault_rank,
                                      audit_every=args.audit_every, warmup=args.warmup, margin=args.margin,
                                      mask=args.mask, accum=args.accum, fault_micro=args.fault_micro,
                                      fsdp=args.fsdp, sdcguard=args.sdcguard, fused_adam=args.fused_adam,
                                      experts_hint=not args.no_experts_hint, recover=args.recover)
    if args.clean:
        results["clean"] = run_case(None, rank=rank, world=world, device=device, steps=args.clean,
                                    fault_step=args.clean + 1, fault_rank=-1, audit_every=args.audit_every,
                                    warmup=args.warmup, margin=args.margin, mask=args.mask, accum=args.accum,
                                    fsdp=args.fsdp, sdcguard=args.sdcguard, fused_adam=args.fused_adam,
                                    experts_hint=not args.no_experts_hint)
    if args.overhead:
        results["overhead"] = overhead(rank=rank, device=device, steps=args.overhead, block=args.block,
                                       audit_every=args.overhead_audit_every, mask=args.mask,
                                       sdcguard=args.sdcguard, together=args.together,
                                       profile=args.profile, gpu_profile=args.gpu_profile,
                                       sync_debug=args.sync_debug, fsdp=args.fsdp, accum=args.accum,
                                       hook_arm=args.hook_arm, host_parts=args.host_parts,
                                       busy_thread=args.busy_thread, host_ops=args.host_ops,
                                       only=tuple(args.arms.split(",")) if args.arms else ())
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def profile_times(events: list[Any], steps: int, attr: str) -> dict[str, tuple[float, float]]:
    """torch.profiler's averaged events -> name -> (ms, calls) a step, the time being each event's `attr`
    (us: `self_device_time_total` for kernels, `self_cpu_time_total` for host operations); events with none
    left out. By the whole name: kernels whose names share a prefix (a copy kernel's template arguments) are
    different kernels (keyed by 90 characters, base seemed to run 7.7 ms of copies a step that no arm ran:
    the last kernel of a prefix overwrote the others)."""
    out: dict[str, tuple[float, float]] = {}
    for e in events:
        us = getattr(e, attr)
        if us <= 0:
            continue
        ms, n = out.get(e.key, (0.0, 0.0))
        out[e.key] = (ms + us / 1e3 / steps, n + e.count / steps)
    return out


def profile_diff(base: dict[str, tuple[float, float]], arm: dict[str, tuple[float, float]],
                top: int = 12) -> list[tuple[str, float, float]]:
    """What an arm adds over base, name by name (`profile_times`' kernels or host operations: name -> (ms,
    calls) a step, whole names): the `top` largest changes by time, each named by its first 90 characters."""
    diff = [(k, arm.get(k, (0.0, 0))[0] - base.get(k, (0.0, 0))[0],
             arm.get(k, (0.0, 0))[1] - base.get(k, (0.0, 0))[1]) for k in set(arm) | set(base)]
    diff.sort(key=lambda d: -abs(d[1]))
    return [(k[:90], ms, n) for k, ms, n in diff[:top] if abs(ms) >= 0.002 or n]


def _own_host_time(parts: dict[str, float], hook_parts: dict[str, float] | None) -> tuple[float, float] | None:
    """(before, after) the update, seconds a step: an arm's host time over the hook-only arm's, from
    --host-parts: its hook minus the hook-only arm's hook (the floor of any Python comm hook), plus the step
    guard's pre-hook and retain() (before), and the step guard's post-hook (after: it overlaps the update's
    kernels). None without the hook-only arm or for an arm without the checks' hook."""
    if not hook_parts or "GradSummaries._hook" not in parts or "hook-arm" not in hook_parts:
        return None
    before = (parts["GradSummaries._hook"] - hook_parts["hook-arm"] + parts.get("StepGuard._pre_hook", 0.0)
              + parts.get("ComputeChecks.retain", 0.0))
    return before, parts.get("StepGuard._post_hook", 0.0)


def _recovery_line(r: dict[str, Any]) -> str:
    """--recover: the updates skipped from the fault on, the repairs, and whether every shard's replicas hold
    the same bytes at the end."""
    skipped = sorted({step for step, _ in r["skipped"]})
    span = (f"{len(skipped)} update{'s' if len(skipped) != 1 else ''} skipped "
            f"({skipped[0]}..{skipped[-1]})" if skipped else "no update skipped")
    done = sorted({(x["at_step"], x["source_rank"]) for x in r["repairs"] if x["ok"]})
    failed = sorted({x["at_step"] for x in r["repairs"] if not x["ok"]})
    rep = "; ".join([f"repaired at {at} from rank {src}" for at, src in done]
                    + ([f"not repaired ({failed[0]}..{failed[-1]}, {len(failed)} tries: "
                        f"{next(x['reason'] for x in r['repairs'] if not x['ok'])})"] if failed else [])) \
        or "no repair"
    digests = r["weights"]
    shards = r["shards"]      # ranks s, s + shards, ...: the replicas of shard s (1: DDP, every rank)
    agree = all(len({digests[i] for i in range(s, len(digests), shards)}) == 1 for s in range(shards))
    return f"{span}; {rep}; replicas {'agree' if agree else 'DIFFER'} at the end (step {r['steps']})"


def table(results: dict[str, Any], fault_step: int, fault_rank: int, tp: int = 1,
          right: list[int] | None = None) -> str:
    """The fault table; `tp`: a finding names the faulty rank's whole tensor- (or context-) parallel group
    (one of them), or the faulty rank alone (the lane witness); `right`: that group where it is not `tp`
    consecutive ranks (a pipeline's)."""
    head = f"fault (rank {fault_rank}, step {fault_step})"
    if right is None:
        right = list(range(fault_rank - fault_rank % tp, fault_rank - fault_rank % tp + tp))
    lines = [f"{head:34} {'detector':17} {'caught':6} {'steps':5} {'rank named':10} {'cause':11} update"]
    for name, r in results.items():
        if name in ("clean", "overhead"):
            continue
        c = r["caught"]
        sg = ""
        if "sdcguard_stats" in c:
            hit_sg = c.get("sdcguard")
            sg = ("   | sdcguard: " + (f"caught +{hit_sg['step'] - fault_step}, rank "
                                     f"{('yes ' if hit_sg['named'] == [fault_rank] else 'NO ') + str(hit_sg['named'])}"
                                     if hit_sg else "not caught")
                  + f" ({c['sdcguard_stats']['checked']} matmuls checked)")
        det = ("compute:" + c["compute"]["detector"]) if "compute" in c else ("vote" if "vote" in c else None)
        if det is None and r.get("held") is not None:
            lines.append(f"{name:34} {'compute:held':17} {'no':6} {r['held'] - fault_step:<5} {'none':10} "
                         f"{'-':11} dropped (not replayed: {r['mode']})" + sg)
            continue
        if det is None:
            lines.append(f"{name:34} {'-':17} {'no':6}" + ("      (no effect: the faulty rank's gradient was bit "
                                                           "for bit the clean one)" if r.get("effective") is False else "")
                         + sg)
            continue
        hit = c["compute"] if det != "vote" else c["vote"]
        named = hit["named"]
        ok = named in (right, [fault_rank]) if det != "vote" else named == [fault_rank]
        lines.append(f"{name:34} {det:17} {'yes':6} {hit['step'] - fault_step:<5} "
                     f"{('yes ' if ok else 'NO ' if named else 'none ') + str(named):10} "
                     f"{hit.get('cause', '-'):11} {('dropped' if hit.get('dropped') else 'applied') if 'cause' in hit else '-'}"
                     + (f"   (vote also, +{c['vote']['step'] - fault_step}, named {c['vote']['named']})"
                        if det != "vote" and "vote" in c else "")
                     + sg)
        if r.get("repairs") is not None:
            lines.append(f"{'':34} recovery: {_recovery_line(r)}")
    cases = [r for name, r in results.items() if name not in ("clean", "overhead")]
    if cases:   # whether the C++ hook's gather and verdict were in play (0 on gloo CPU ranks, by design)
        lines.append(f"over the fault cases, rank 0's C++ hook gathered the rows on "
                     f"{sum(r['status'].get('hook_gathers', 0) for r in cases)} steps and judged "
                     f"{sum(r['status'].get('hook_verdicts', 0) for r in cases)} of "
                     f"{sum(r['status'].get('steps', 0) for r in cases)}")
    if "clean" in results:
        r = results["clean"]
        st = r["status"]
        sp = torch.tensor(r["spread"], dtype=torch.float64)
        if sp.numel():
            for k, stat in enumerate(("norm", "maxabs")):
                col = sp[:, k]
                lines.append(f"clean spread of {stat:6} over {col.numel()} buckets: median {col.median():.3f}, "
                             f"max {col.max():.3f} (log units: x{col.median().exp():.2f} / x{col.max().exp():.2f}); "
                             f"caught on its step beyond x{(col.median() * st['margin']).exp():.1f} (median "
                             f"bucket) at margin {st['margin']}")
        lines.append(f"clean: {r['steps']} steps, {st['suspicions']} suspicions, {st['dropped']} dropped, "
                     f"{st['audits']} audits, exact={st['exact']}, rank 0's C++ hook gathered "
                     f"{st.get('hook_gathers', 0)} and judged {st.get('hook_verdicts', 0)}, "
                     f"largest clean spread "
                     f"{st['spread_max']:.3f} (log units, x{2.718281828 ** st['spread_max']:.3f}), largest "
                     f"clean score {st['max_score_clean']:.2f} of margin {st['margin']}, {r['elapsed_s']:.1f}s")
        named = sum(1 for f in r.get("reported", []) if f[3])       # a GPU named on a clean run: false
        found = len(r.get("reported", []))
        causes = ", ".join(f"step {f[0]} {f[2]}" for f in r.get("reported", [])[:8])
        scale = f"; loss scale at the end {r['scale']:g}" if r.get("scale") is not None else ""
        lines.append(f"clean: replays {r.get('mode') or '-'}; findings reported {found}"
                     + (f" ({causes})" if causes else "") + f", naming a GPU {named}{scale}")
    if "overhead" in results:
        o = results["overhead"]
        lines.append(f"overhead, interleaved blocks of {o['block']} steps x {o['blocks']} per arm after "
                     f"{o.get('warm_rounds', 1)} untimed round(s), {o.get('accum', 1)} micro-batch(es) a step "
                     "(mean over blocks; median block; median of each round's ratio to its base block)"
                     + (f", a Python thread computing {o['busy_thread']:.0%} of the time beside the training:"
                        if o.get("busy_thread") else ":"))
        lines.append(f"  {'arm':42} {'ms/step':>9} {'ratio':>7} {'overhead':>9} {'median':>9} {'paired':>9} "
                     f"{'paired mean, 95% interval':>27} {'device busy':>11}")
        base = o["arms"]["base"]["step_s"]
        base_med = o["arms"]["base"]["median_s"]
        for name, a in o["arms"].items():
            what = {"base": "base (no checks)", "checks": "pre-reduction checks every step",
                    "hook": "a Python comm hook that only reduces",
                    "checks-torch": "the same checks in torch ops (pre-fused)",
                    "checks-inline": "the same on the backward's stream",
                    "checks-python": "the same through the Python comm hook",
                    "checks+audits": f"checks + audits every {o['audit_every']}",
                    "all": f"all: vote+gate, canary, checks, audits/{o['audit_every']}",
                    "sdcguard": f"sdcguard ABFT ({o.get('sdcguard_mode', '')}) every {o['sdcguard_every']}th step"}[name]
            lines.append(f"  {what:42} {a['step_s'] * 1e3:9.3f} {a['step_s'] / base:7.4f} {a['overhead'] * 100:+8.2f}%"
                         f" {(a['median_s'] / base_med - 1) * 100:+8.2f}% {a.get('paired', float('nan')) * 100:+8.2f}%"
                         + _interval_cell(a, o.get("host", {}).get(name, {})))
        for name, st in o.get("status", {}).items():
            lines.append(f"  checks of arm {name}: steps {st['steps']}, suspicions {st['suspicions']}, replays "
                         f"{st['replays']}, audits {st['audits']}, dropped {st['dropped']}, "
                         f"exact {st['exact']}, hook gathers {st.get('hook_gathers', 0)}, "
                         f"hook verdicts {st.get('hook_verdicts', 0)}")
        for name, a in o["arms"].items():
            lines.append(f"  blocks of arm {name} (ms/step): " + " ".join(f"{b * 1e3:.1f}" for b in a["blocks"]))
        for name, h in o.get("host", {}).items():
            if h["top"]:   # the Python profile ran (not with --host-ops or --gpu-profile alone)
                lines.append(f"  host time of arm {name}: {h['host_s_per_step'] * 1e3:.3f} ms/step; largest own "
                             "times (ms/step own, cumulative, calls/step):")
            if h.get("parts"):
                lines.append(f"  host time by part, arm {name} (us/step, median of 3 blocks; each includes "
                             "what it calls): " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in h["parts"].items()))
                own = _own_host_time(h["parts"], o.get("host", {}).get("hook", {}).get("parts"))
                step = o["arms"]["base"]["median_s"]
                if own is not None:
                    before, after = own
                    lines.append(f"    arm {name}'s own host time a step over the hook-only arm: before the update "
                                 f"{before * 1e6:.0f} us ({before / step * 100:.2f}% of base's median step), "
                                 f"after it {after * 1e6:.0f} us")
                base_parts = o.get("host", {}).get("base", {}).get("parts", {})
                if name != "base" and "(enqueue)" in base_parts:   # what no wrapper sees: the C++ hook
                    extra = h["parts"]["(enqueue)"] - base_parts["(enqueue)"]
                    lines.append(f"    arm {name}'s step enqueued in {extra * 1e6:+.0f} us over base's "
                                 f"({extra / step * 100:+.2f}% of base's median step)")
                if name != "base" and "(backward)" in base_parts and "(backward)" in h["parts"]:
                    extra = h["parts"]["(backward)"] - base_parts["(backward)"]
                    lines.append(f"    arm {name}'s backward (autograd's launches and the hooks) took "
                                 f"{extra * 1e6:+.0f} us over base's")
            if h.get("wrapped"):
                lines.append("    host ms/step in (any thread): " + ", ".join(
                    f"{k} {v * 1e3:.3f}" for k, v in sorted(h["wrapped"].items())))
            for fn, tt, ct, nc in h["top"]:
                lines.append(f"    {fn[:70]:70} {tt * 1e3:7.3f} {ct * 1e3:7.3f} {nc:5d}")
            for n, k in h.get("syncs", []):
                lines.append(f"  a synchronisation in arm {name}, {n:.2f} a step:\n" + k)
            if "kernels" in h:
                lines.append(f"  device time of arm {name}: {h['device_s_per_step'] * 1e3:.3f} ms/step; largest kernels "
                             "(ms/step, launches/step):")
                for k, ms, n in h["kernels"]:
                    lines.append(f"    {k[:90]:90} {ms:7.3f} {n:5d}")
            if h.get("op_diff"):
                lines.append(f"  host operations arm {name} adds over base (self CPU ms/step under the profiler, "
                             "calls/step):")
                for k, ms, n in h["op_diff"]:
                    lines.append(f"    {k[:90]:90} {ms:+7.3f} {n:+6.1f}")
            if h.get("kernel_diff"):
                lines.append(f"  device time arm {name} adds over base (ms/step, launches/step):")
                for k, ms, n in h["kernel_diff"]:
                    lines.append(f"    {k[:90]:90} {ms:+7.3f} {n:+6.1f}")
        for name, counts in o.get("summary_paths", {}).items():
            lines.append(f"  bucket summaries of arm {name}: "
                         + ", ".join(f"{n} {p}" for p, n in counts.items())
                         + (f"; comm hook {o['hooks'][name]}" if name in o.get("hooks", {}) else ""))
    return "\n".join(lines)


def _interval_cell(arm: dict[str, Any], host: dict[str, Any]) -> str:
    """The paired mean's 95% interval (bootstrap over rounds) and, with --gpu-profile, the share of the step
    the device computes (near 100%: device-bound, the host's work hidden behind the device's)."""
    lo, hi = arm.get("paired_ci", (float("nan"), float("nan")))
    cell = f" {arm.get('paired_mean', float('nan')) * 100:+8.2f}% [{lo * 100:+6.2f}%, {hi * 100:+6.2f}%]"
    busy = host.get("device_s_per_step")
    return cell + (f" {100 * busy / arm['median_s']:10.1f}%" if busy else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The harness's options (exit 2 with a message on a bad one)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cases", default="all", help="all | h200 | tc (the tensor-core cases, under "
                   "autocast) | moe (the router's top-k, --model tiny-moe) | none | comma-separated case names")
    p.add_argument("--fault-step", type=int, default=40)
    p.add_argument("--after", type=int, default=30, help="steps each case runs after its fault step (a "
                   "persistent fault is named by the first audit at the latest: --audit-every)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--audit-every", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--margin", type=float, default=3.0)
    p.add_argument("--hook-arm", action="store_true", help="with --overhead: an arm \"hook\" (DDP through a "
                   "Python comm hook that only all-reduces: what any per-bucket hook costs) and an arm "
                   "\"checks-python\" (the checks through their Python hook instead of the C++ one)")
    p.add_argument("--busy-thread", type=float, default=0.0, metavar="F", help="with --overhead: a Python "
                   "thread computing beside the training a share F (0-1] of the time, in 1 ms bursts (a "
                   "loader's, a tokenizer's, a logger's): Python hooks wait for the GIL")
    p.add_argument("--batch", type=int, default=8, help="--model gpt2: sequences of 1024 tokens a micro-batch "
                   "(8: 8k tokens, a host-bound step on the H200's host; 32: a device-bound one)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient "
                   "accumulation: all but the last under ddp.no_sync())")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP: the checks run "
                   "before each reduce-scatter; replays and audits are collective (every rank replays at "
                   "once, an audit checks every rank); no replica vote")
    p.add_argument("--hsdp", type=int, default=0, metavar="REPLICAS", help="with --fsdp: HSDP on a "
                   "(REPLICAS, world / REPLICAS) mesh (the checks summarise each shard group's reduce-scatter; "
                   "every rank replays at once, so FSDP's all-reduce across replicas pairs up)")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="with --fsdp and --model mlp: tensor "
                   "parallelism over N ranks (the innermost mesh dim; FSDP2 over the rest, --hsdp too): a tp "
                   "group is one data-parallel rank to the checks; a finding names its GPUs (one of them)")
    p.add_argument("--cp", type=int, default=1, metavar="N", help="with --fsdp and --model tiny-gpt or gpt2: "
                   "context parallelism over N ranks (bench.cp_attention: each rank one chunk of every "
                   "sequence, attention over the group's keys and values); FSDP2 over the (dp, cp) ranks")
    p.add_argument("--ep", type=int, default=1, metavar="N", help="with --fsdp and --model tiny-moe: "
                   "expert parallelism over N ranks (bench.ep_moe: each rank its own batch, the experts "
                   "split over the ep group, tokens dispatched by all-gather); the checks find the mesh dim "
                   "named 'ep' (--cp-pass arg: named 'xp', passed as expert_parallel=; none: named 'xp', not "
                   "passed); with --hsdp R: HSDP on a (replicate, efsdp, ep) mesh")
    p.add_argument("--pp", type=int, default=1, metavar="N", help="with --fsdp and --model mlp, tiny-gpt or "
                   "gpt2: pipeline parallelism over N stages (bench.pp_stages: torchtitan's (pp, dp) mesh, "
                   "torch's PipelineStage and ScheduleGPipe, FSDP2 over each stage's dp ranks, the checks "
                   "replay through the schedule: step_fn=); the checks find the mesh dim named 'pp' "
                   "(--cp-pass arg: named 'stage', passed as pipeline_parallel=; none: named 'stage', not "
                   "passed). The matmul faults hit the faulty rank's stage (the MLP's middle Linear where "
                   "the stage holds it, else its first Linear; a GPT stage's first block's fc)")
    p.add_argument("--ep-style", choices=["local", "dtensor"], default="local", help="--ep: each rank's "
                   "experts as modules of their own (local, Megatron's) or stacked weights distributed over "
                   "the ep dim as DTensors (dtensor, torchtitan's GroupedExperts)")
    p.add_argument("--cp-api", choices=["module", "context", "torch"], default="module", help="--cp: the cp "
                   "attention always on (module: torchtitan's style) or only inside the loop's context "
                   "(context: torch's context_parallel(); replays outside it do not reproduce the step); torch: "
                   "torch's own context parallelism (_ContextParallel; --device cuda only)")
    p.add_argument("--cp-pass", choices=["name", "arg", "none"], default="name", help="--cp: how the checks "
                   "learn of it: the mesh dim named 'cp' (name), context_parallel= (arg; the dim named "
                   "'seq'), or not at all (none; the dim named 'seq')")
    p.add_argument("--cp-rotate", choices=["allgather", "alltoall"], default="allgather", help="--cp-api "
                   "torch: how torch's ring attention passes keys and values (its default one all-gather, or "
                   "all-to-all round the ring)")
    p.add_argument("--cp-mesh", choices=["dims", "unflatten"], default="dims", help="--cp: one mesh with "
                   "the cp dim beside FSDP's (dims: torchtitan's world_mesh['dp_shard_cp']), or newer "
                   "torchtitan's meshes unflattened from one world mesh, the cp dim only in the data-loading "
                   "one (unflatten)")
    p.add_argument("--cp-replay-context", action="store_true", help="--cp: pass the loop's cp context as "
                   "replay_context= (with --cp-api context, replays then run the cp attention)")
    p.add_argument("--no-witness-model", action="store_true", help="with --fsdp: the checks get no "
                   "witness_model (the bare model's factory the model-level CPU witness needs): two ranks' "
                   "symmetric faults are left to the op witness")
    p.add_argument("--fault-micro", type=int, default=0, help="the micro-batch a transient matmul fault hits")
    p.add_argument("--clean", type=int, default=0, help="also run this many clean steps")
    p.add_argument("--mask", choices=["auto", "host", "device"], default="auto",
                   help="how a suspect update is masked: host veto, or the device found_inf flag (fused Adam)")
    p.add_argument("--flaky-replay", type=_flaky_spec, default=None, metavar="RANK:CALL[,CALL...]",
                   help="that rank's replays with these numbers (from 1: the first step's check makes 1-2, "
                        "its second round 3-4) come back with one fingerprint bit changed")
    p.add_argument("--no-experts-hint", action="store_true",
                   help="ComputeChecks(experts=None): MoE expert buckets only learnt as zeroable, not "
                        "declared")
    p.add_argument("--recover", action="store_true",
                   help="fault cases: ReplicaRecovery on the Monitor (the vote gates the update and, with 3+ "
                        "replicas, repairs the odd one in place); every case runs its --after steps and the "
                        "table says which updates were skipped and whether the replicas agree at the end")
    p.add_argument("--titan-optimizers", action="store_true",
                   help="torchtitan's OptimizersContainer (two optimizers: Adam on the weights, AdamW on the "
                        "rest) instead of one Adam (needs torchtitan)")
    p.add_argument("--fused-adam", action="store_true",
                   help="fault cases: fused Adam whatever the mask and device (a host-veto run to compare "
                        "with a device-mask one on the same optimizer)")
    p.add_argument("--overhead", type=int, default=0, help="also measure step time with and without the gate "
                   "over this many steps each, interleaved")
    p.add_argument("--overhead-audit-every", type=int, default=334, help="the audit cadence of --overhead's "
                   "checks+audits arm (default: the gate's default, 334)")
    p.add_argument("--sdcguard", type=int, default=0, metavar="EVERY", help="also run sdcguard's ABFT checks "
                   "(the sdcguard package, [bench] extra) every EVERY-th step in the same run, on the same "
                   "injected faults (the matmul faults then hit inside the matmul), and as an --overhead arm; "
                   "forces bf16 autocast (sdcguard checks bf16/fp16 matmuls only)")
    p.add_argument("--sdcguard-mode", choices=["protect", "dispatch"], default="protect",
                   help="protect: SDCGuard(every).protect(model), its training mode (every nn.Linear); "
                   "dispatch: its default mode (every matmul, slower)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="after --overhead, profile one more "
                   "block of each arm (cProfile: host time per step and its N largest functions)")
    p.add_argument("--host-parts", type=int, default=0, metavar="N", help="after --overhead, time the host's "
                   "parts of each arm (the hook, the kernel launch, the reduction, the gate's stages) with plain "
                   "wrappers, no profiler: 3 rounds of N steps an arm, the median a step of each part")
    p.add_argument("--sync-debug", action="store_true", help="after --overhead, run one more block of the "
                   "base, checks and all arms in CUDA's sync debug mode and print where the host waited")
    p.add_argument("--gpu-profile", type=int, default=0, metavar="N", help="after --overhead, trace one more "
                   "block of each arm on the GPU (torch.profiler): device time per step and its N largest kernels")
    p.add_argument("--host-ops", type=int, default=0, metavar="N", help="after --overhead, trace one more "
                   "block of each arm on the host (torch.profiler, CPU): the N host operations and CUDA runtime "
                   "calls whose self time changes most over base's")
    p.add_argument("--together", action="store_true", help="also an --overhead arm \"all\": the Monitor's "
                   "vote with ReplicaRecovery's gate, the in-job canary, the checks and the audits at once")
    p.add_argument("--arms", default="", metavar="A,B", help="with --overhead: only these arms beside base "
                   f"(of {', '.join(ARMS)}; those the other flags turn on)")
    p.add_argument("--block", type=int, default=50, help="steps per interleaved block of --overhead")
    p.add_argument("--model", choices=["mlp", "tiny-gpt", "tiny-moe", "gpt2", "cnn"], default="mlp",
                   help="mlp: a 3-layer MLP; tiny-gpt: the demo GPT at 2x64 (CPU); tiny-moe: it with routed MLPs "
                   "(top 2 of 4 experts; the matmul faults hit block 0's router); gpt2: GPT-2 small, bf16 autocast "
                   "on CUDA (the matmul faults hit block 0's MLP fc output); cnn: a small convolutional classifier with "
                   "BatchNorm and dropout (the faults hit its second convolution's output)")
    p.add_argument("--params-bf16", action="store_true", help="the fault cases' and clean runs' model "
                   "with its parameters (so its gradients, DDP's buckets and Adam's state) in bfloat16, as a job that "
                   "casts the model does, not autocast (the --overhead arms keep float32)")
    p.add_argument("--sync-bn", action="store_true", help="--model cnn: SyncBatchNorm (a collective in the "
                   "forward) instead of BatchNorm")
    p.add_argument("--amp", choices=["bf16", "fp16"], default="bf16", help="fp16: fp16 autocast with a "
                   "GradScaler (the checks given scaler=); a gradient fault is then in the scale's units")
    p.add_argument("--ac", choices=["none", "nonreentrant", "reentrant"], default="none",
                   help="activation checkpointing (torch.utils.checkpoint) of the MLP's middle layer or of "
                   "every GPT block (a reentrant checkpoint runs its forward without grad: the MLP's matmul "
                   "faults then reach only the recomputation; use --model tiny-gpt)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: gloo on the CPU, "
                   "NCCL on GPUs; gloo with --device cuda puts every rank on the GPUs there are (ranks sharing "
                   "one GPU: the cross-rank checks on one device)")
    p.add_argument("--determinism", choices=["warn", "strict"], default="warn", help="--device cuda: "
                   "torch.use_deterministic_algorithms(True, warn_only=True) (warn) or warn_only=False "
                   "(strict: kernels with a deterministic variant use it, e.g. cuDNN attention's backward)")
    p.add_argument("--cpu-autocast", action="store_true", help="--device cpu: bf16 autocast on the CPU ranks too "
                   "(the GPU's arithmetic: a small fault then changes the rounding of all that follows); "
                   "its bf16 GEMMs summed in float32 as a tensor core's are (bench/cpu_gemm.py)")
    p.add_argument("--witness-fp32-fails", type=int, default=-1, metavar="RANK", help="the CPU witness's "
                   "float32 replay raises out of memory on RANK (it must fall back to the step's precision on "
                   "every rank, never name a GPU on mixed evidence)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.hsdp and (not args.fsdp or args.hsdp < 2 or args.world % args.hsdp or args.world // args.hsdp < 2):
        p.error("--hsdp REPLICAS needs --fsdp, REPLICAS >= 2 dividing --world, and >= 2 ranks per shard group")
    if args.tp != 1 and (not args.fsdp or args.model != "mlp" and args.cp == 1 or args.tp < 2
                         or args.overhead or args.world % (args.tp * max(args.hsdp, 1))
                         or args.world // (args.tp * args.pp) < 2):
        p.error("--tp N needs --fsdp, --model mlp (or a GPT with --cp), no --overhead, N >= 2 dividing "
                "--world (--hsdp R: R * N dividing it) and >= 2 tp groups")
    if args.cp != 1 and (not args.fsdp or args.model not in ("tiny-gpt", "gpt2") or args.cp < 2
                         or args.tp != 1 and args.hsdp or args.overhead or args.accum != 1 or args.ac != "none"
                         or args.world % (args.cp * args.tp * max(args.hsdp, 1))
                         or args.world // (args.cp * args.tp) < 2):
        p.error("--cp N needs --fsdp, --model tiny-gpt or gpt2, no --overhead, --accum or --ac, not both --tp "
                "and --hsdp, N (x --tp x --hsdp) dividing --world and >= 2 replicas")
    if args.ep != 1 and (not args.fsdp or args.model != "tiny-moe" or args.ep < 2
                         or MoEBlock.EXPERTS % args.ep or args.cp != 1 or args.tp != 1
                         or args.overhead or args.accum != 1 or args.ac != "none"
                         or args.world % (args.ep * max(args.hsdp, 1)) or args.world // args.ep < 2):
        p.error(f"--ep N needs --fsdp, --model tiny-moe, N dividing its {MoEBlock.EXPERTS} experts and "
                "--world (x --hsdp), >= 2 ep groups; not with --cp, --tp, --overhead, --accum or --ac")
    if args.pp != 1 and (not args.fsdp or args.model not in ("mlp", "tiny-gpt", "gpt2") or args.pp < 2
                         or args.cp != 1 or args.ep != 1 or args.overhead or args.accum != 1
                         or args.tp != 1 and (args.model != "mlp" or args.hsdp)
                         or args.ac != "none" or args.sdcguard
                         or args.world % (args.pp * args.tp * max(args.hsdp, 1))
                         or args.world // (args.pp * args.tp) < 2):
        p.error("--pp N needs --fsdp, --model mlp, tiny-gpt or gpt2, N (x --tp or --hsdp) dividing --world "
                "and >= 2 replicas; --tp with --model mlp only, not with --hsdp; not with --cp, --ep, "
                "--overhead, --accum, --ac or --sdcguard")
    if args.cp_api == "torch" and args.device != "cuda":
        p.error("--cp-api torch shards SDPA through CUDA kernels only (flash, efficient, cuDNN): --device cuda")
    if args.after < 1 or args.fault_step < 1:
        p.error(f"--after ({args.after}) and --fault-step ({args.fault_step}) must be at least 1")
    odd = [a for a in args.arms.split(",") if a not in ARMS] if args.arms else []
    if odd:
        p.error(f"--arms: no arm named {', '.join(map(repr, odd))} (arms: {', '.join(ARMS)})")
    for flag, n in (("--gpu-profile", args.gpu_profile), ("--host-ops", args.host_ops)):
        if n < 0:
            p.error(f"{flag} is a number of kernels or operations to print, 0 or more, got {n}")
    if not 0.0 <= args.busy_thread <= 1.0:
        p.error(f"--busy-thread is a share of the time, 0 to 1, got {args.busy_thread:g}")
    known = {c.name for c in CASES + TC_CASES + MOE_CASES}
    unknown = [n for n in args.cases.split(",") if n not in known] if args.cases not in GROUPS else []
    if unknown:
        p.error(f"--cases: no case named {', '.join(map(repr, unknown))} (a group: {', '.join(GROUPS)}; or "
                "names from the table's first column, comma-separated)")
    low = [c.name for c in selected(args.cases) if c.where in TC_WHERE]
    if low and args.device == "cpu" and not (args.cpu_autocast or args.sdcguard or args.amp == "fp16"):
        p.error(f"--cases: {', '.join(map(repr, low))} fire only where a matmul runs in bf16 or fp16 (a tensor "
                "core's fault): on --device cpu add --cpu-autocast, or they report 'no effect'")
    return args


def main(argv: list[str] | None = None, start: Callable[..., None] = start_ranks) -> dict[str, Any]:
    """`start(fn, args, nprocs)` runs the ranks (`fn(rank, *args)`, joined, a rank's exception raised):
    bench.rank_start's by default; the suite passes tests/rank_spawn.py's, forked with torch imported already."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        if "RANK" in os.environ:        # torchrun
            worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "", args, out)
            if int(os.environ["RANK"]) != 0:
                return {}
        else:
            start(worker, (args.world, os.path.join(tmp, "init"), args, out), args.world)
        with open(out) as f:
            results = json.load(f)
    # --pp: the faulty rank's pp group (with --tp, its tp groups), a rank of each stage (pp outermost)
    dp = args.world // (args.pp * args.tp)
    i = args.fault_rank // args.tp % dp
    right = (sorted(s * dp * args.tp + i * args.tp + t for s in range(args.pp) for t in range(args.tp))
             if args.pp > 1 else None)
    print(table(results, args.fault_step, args.fault_rank, args.tp * args.cp * args.ep, right))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
