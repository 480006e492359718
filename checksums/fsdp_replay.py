"""Replays under FSDP2 (`fully_shard`): collective replays, every rank at once.

A DDP replay runs on one rank alone (the bare module holds every weight). Under FSDP2 a forward needs every
rank's all-gather, so a replay is a collective step: all ranks replay together, each rank the micro-batches
it is given (the same batch on every rank for `classify`, a neighbour's for an audit), with the same
unsharded weights (the step's own, gathered again) and each micro-batch's retained RNG state, through the
FSDP module itself (its hooks, its gradient accumulation: `set_requires_gradient_sync(False)` on all but
the last micro-batch, as the loop did). The gradient is read where the step's own was summarised: the
custom reduce-scatter of checksums.grad_checks.FsdpGradSummaries, which under `capturing()` summarises its
input (the rank's local unsharded gradient of the group, laid out and pre-divided as for the collective)
and does not reduce. The replay's sharded `.grad` (a zeroed output) is discarded: every sharded parameter's
`.grad` is set aside before the replay and put back after it (FSDP accumulates into an existing `.grad` in
place: it never sees ours), and so are its post-accumulate-grad hooks (an optimizer in backward must not
step on a replay) and the module's buffers.

`replay` is the one collective the base Replayer's `classify`, `classify_pair`, `check_determinism` and
`audit_all` call on every rank in the same order, so they work unchanged: every rank replays the same batch,
or in an audit each its neighbour's (one round: every rank audited at once).

HSDP (a 2-D mesh): the reduce-scatter of the shard group is the one summarised; a replay skips it, and
FSDP's all-reduce across replicas then runs on the zeroed output (every rank replays, so it pairs up;
tests/test_compute_checks.py's HSDP test on 4 gloo ranks).

Two ranks, a symmetric persistent fault (each GPU repeats its own result): the ranks' own-history jumps
name the GPU, else the CPU witness (`witness`): when the user passes `witness_model`, a factory of the bare
(unsharded) model, rank 0 loads the gathered full parameters into it and recomputes the gradient in
float64; where that names nobody (or there is no factory) and replays are bit for bit deterministic on one
GPU model, the op witness (checksums.op_witness: both ranks replay the batch under its trace, collectives
and all; the ops that copy each rank's own shard differ by design and are passed over, the first op that
computes differently from equal inputs is recomputed on the CPU). Else both ranks are named `unresolved`
(never one wrong rank).

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checksums.grad_checks import FsdpGradSummaries, fsdp_roots
from checksums.replay import (
    LossFn,
    Replayer,
    Retained,
    MODEL_WITNESS,
    scaled,
    witness_names,
)
from checksums.op_witness import witness_projection
from checksums.tp_lanes import Lanes

logger = logging.getLogger(__name__)


class FsdpReplayer(Replayer):
    """Collective replays of an FSDP2 model (see the module docstring)."""

    def __init__(self, root: nn.Module, summaries: FsdpGradSummaries, loss_fn: LossFn | None, *,
                 device: torch.device, group: Any = None,
                 witness_model: Callable[[], nn.Module] | None = None, scaler: Any = None,
                 lanes: Lanes | None = None, context: Callable[[], Any] | None = None,
                 step_fn: Callable[[nn.Module, Any], Any] | None = None) -> None:
        super().__init__(root, None, loss_fn, device=device, group=group, scaler=scaler, lanes=lanes,
                         context=context)
        self.fsdp = summaries
        self.roots = fsdp_roots(root)          # the FSDP2 module, or each model part of a container of them
        # the loop's own forward and backward of a batch (a pipeline schedule's step), run instead of
        # back-propagating loss_fn's loss: the loop's loss scaling is its own
        self.step_fn = step_fn
        self.witness_model = witness_model      # the bare module is on no rank: the CPU builds a copy

    def replay(self, retained: Retained, flats: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Summary rows [groups, 4] of `retained`'s gradient recomputed on this rank; a collective: every
        rank calls at once (each with the micro-batches it replays). Leaves `.grad`, the post-accumulate
        hooks and the buffers as they were. `flats`: also each group's whole reduce-scatter input."""
        rows = self._rows_of_replay(retained, flats)
        self.replays += 1
        return rows

    def _rows_of_replay(self, retained: Retained, flats: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """`replay`'s work (not counted)."""
        if not retained.micro:
            raise RuntimeError("no batch retained: call retain(batch) before each step's forward")
        module = self.module
        params = list(module.parameters())
        held = [(p, p.grad, getattr(p, "_post_accumulate_grad_hooks", None)) for p in params]
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        last = len(retained.micro) - 1
        try:
            for p, _, hooks in held:
                p.grad = None
                if hooks:
                    p._post_accumulate_grad_hooks = None  # type: ignore[attr-defined]
            with self.fsdp.capturing(flats) as captured, torch.random.fork_rng(devices=devices):
                for k, (batch, cpu_rng, dev_rng) in enumerate(retained.micro):
                    if cpu_rng is not None:
                        torch.set_rng_state(cpu_rng)
                    if dev_rng is not None:
                        torch.cuda.set_rng_state(dev_rng, self.device)
                    for part in self.roots:
                        part.set_requires_gradient_sync(k == last)  # type: ignore[operator]
                    with torch.enable_grad(), self.context():
                        if self.step_fn is not None:
                            self.step_fn(module, batch)
                        else:
                            scaled(self.loss_fn(module, batch), retained.loss_scale).backward()
            rows = self.fsdp.rows_of(captured)
        finally:
            for part in self.roots:
                part.set_requires_gradient_sync(True)  # type: ignore[operator]
            for p, grad, hooks in held:
                p.grad = grad
                if hooks:
                    p._post_accumulate_grad_hooks = hooks  # type: ignore[attr-defined]
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
        return rows

    def witness(self, retained: Retained, ops: bool = False) -> tuple[float, str]:
        """Two ranks, a persistent fault, each GPU self-consistent: the host CPU is the third witness, as
        `Replayer.witness` (t = <ref - g0, g1 - g0> / |g1 - g0|^2; 0: GPU 0 computed right, 1: GPU 1 did),
        with `witness_model` (a factory of the bare, unsharded model) for the float64 CPU copy. Both ranks
        replay `retained` keeping each group's whole reduce-scatter input (g0, g1; all-gathered once); the
        full parameters are gathered (`full_tensor`, every rank) and loaded into the copy on rank 0, whose
        float64 gradient is laid out as FSDP lays out a reduce-scatter input (`torch._chunk_cat` of each
        group's gradients, dim 0, W chunks). That t is NaN without a factory or when FSDP pre-divides the
        input (an fp16 reduce dtype). `ops` (bit-for-bit deterministic GPUs of one model): when t names
        nobody, the op witness on collective replays (`Replayer._op_witness`). A collective, every rank
        calls."""
        t = float("nan")
        if self.witness_model is not None:
            t = self._model_witness(retained)
        if ops and witness_names(t) is None:
            return self._op_witness(lambda: self._rows_of_replay(retained)) or (t, MODEL_WITNESS)
        return t, MODEL_WITNESS

    def _model_witness(self, retained: Retained) -> float:
        """`witness`'s model-level t (the factory's float64 copy on rank 0's CPU); a collective."""
        flats: dict[int, torch.Tensor] = {}
        # in float32 unless FSDP's own policy computes in a low precision (`Replayer.agreed_wide`)
        wide = all(getattr(fp, "param_dtype", None) in (None, torch.float32)
                   and fp.sharded_param.dtype == torch.float32 for group in self.fsdp.groups for fp in group)
        self.agreed_wide(lambda: self.replay(retained, flats), wide)
        params = dict(self.module.named_parameters())
        full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                for name, p in params.items()}                      # a collective (all-gather), every rank
        first = {id(p): name for name, p in params.items()}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            full.setdefault(name, full[first[id(p)]])    # a tied weight under each of its names (a GPT's head)
        if any(f.dtype == torch.float16 for f in flats.values()):
            return float("nan")
        mine = torch.cat([flats[i].reshape(-1) for i in range(len(flats))]).to(torch.float64)
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=self.group)
        out: list[Any] = [None]
        if dist.get_rank(self.group) == 0:
            try:
                out = [self._project(retained, full, both[0].cpu(), both[1].cpu())]
            except Exception as exc:  # noqa: BLE001 (a user's factory that does not fit: no witness, say so)
                logger.warning("sdcwatch: the FSDP2 CPU witness failed (%s: %s); no witness",
                               type(exc).__name__, str(exc)[:300])
                out = [float("nan")]
        dist.broadcast_object_list(out, group=self.group, group_src=0,
                                   device=self.device if self.device.type == "cuda" else None)
        return float(out[0])

    def _project(self, retained: Retained, full: dict[str, torch.Tensor], g0: torch.Tensor,
                 g1: torch.Tensor) -> float:
        assert self.witness_model is not None
        with torch.random.fork_rng(devices=[]):            # a factory that seeds leaves the step's RNG alone
            ref_mod = self.witness_model()
        state = dict(full)
        state.update({name: b.detach().cpu() for name, b in self.module.named_buffers()})
        ref_mod.load_state_dict({k: state[k] for k in ref_mod.state_dict() if k in state})
        ref_mod = ref_mod.to(device="cpu", dtype=torch.float64)
        names = [n for n, p in ref_mod.named_parameters() if p.requires_grad]
        ref_params = dict(ref_mod.named_parameters())

        def cast(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().cpu()
            return t.to(torch.float64) if t.is_floating_point() else t
        grads = dict(zip(names, self._grads(retained, ref_mod, [ref_params[n] for n in names], cast)))
        owner = {id(m): name for name, m in self.module.named_modules()}
        world = dist.get_world_size(self.group)
        parts = []
        for fsdp_params in self.fsdp.groups:
            gs = []
            for fp in fsdp_params:
                info = fp._module_info
                prefix = owner[id(info.module)]
                name = f"{prefix}.{info.param_name}" if prefix else info.param_name
                g = grads.get(name)
                g = torch.zeros(fp._orig_size, dtype=torch.float64) if g is None else g
                dim = fp.fsdp_placement.dim
                if dim != 0:                      # FSDP's own copy-in does this for Shard(dim > 0)
                    g = torch.cat(torch.chunk(g, world, dim=dim), dim=0)
                gs.append(g.contiguous())
            parts.append(torch._chunk_cat(gs, 0, world).reshape(-1))
        ref = torch.cat(parts)
        if ref.numel() != g0.numel():
            return float("nan")
        return witness_projection(ref, g0, g1)

