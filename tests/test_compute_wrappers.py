"""Data-parallel wrappers besides DistributedDataParallel and fully_shard (issue 19), on real gloo ranks.

torch's composable `replicate()` (torchtitan's DDP, `dp_shard=1`) keeps a DistributedDataParallel inside,
made at the first forward: the checks make it at attach, summarise its buckets in its communication hook,
and replay the model without replicate's hooks (checksums/composable_ddp.py; before, an AttributeError at
attach). FSDP2's own `replicate()` and HSDP with shard groups of one rank run no reduce-scatter (FSDP2 skips
it over one rank), which the checks read each group's gradient from: refused at attach with what to do
(before, attach succeeded and every step's check failed, said once in the log, while GetStatus said `exact`
with 0 suspicions)."""
from __future__ import annotations

from typing import Any

import torch

from rank_spawn import rank_results


def _attach_each(rank: int, world: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    res: dict[str, Any] = {}

    def loss_fn(mod: nn.Module, b: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(mod(b[0]), b[1])

    def attempt(name: str, model: nn.Module) -> None:
        try:
            ComputeChecks.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn)
            res[name] = ""
        except (TypeError, ValueError) as exc:
            res[name] = f"{type(exc).__name__}: {exc}"
    attempt("fsdp_replicate", fsdp_replicate(nn.Linear(4, 4)))
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    attempt("hsdp_shards_of_one", fully_shard(nn.Linear(4, 4), mesh=mesh))
    attempt("fsdp", fully_shard(nn.Linear(4, 4)))            # sharded over every rank: attaches
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_wrappers_whose_gradient_the_checks_cannot_read_are_refused_at_attach(tmp_path) -> None:
    for res in rank_results(_attach_each, 3, tmp_path):
        for name in ("fsdp_replicate", "hsdp_shards_of_one"):
            assert res[name].startswith("ValueError: ComputeChecks: FSDP2 shards over one rank here"), res
        assert res["fsdp"] == "", res


def _composable(rank: int, world: int, init: str, out: str) -> None:
    """torch's composable replicate() on 3 ranks with the checks; see the test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed._composable.replicate import replicate

    from bench.rank_start import same_on_every_rank
    from checksums.compute_gate import ComputeChecks
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    replicate(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    now = {"step": 0}

    def loss_fn(mod: nn.Module, b: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(mod(b[0]), b[1])

    def inject(idx: int, flat: torch.Tensor) -> None:          # rank 1's gradient, before the all-reduce
        if now["step"] == 12 and idx == 0:
            flat.view(-1)[5] = 100.0

    def channel(mod: nn.Module, inp: Any, o: torch.Tensor) -> torch.Tensor | None:
        if now["step"] < 17:                                   # rank 1's matmul from step 17 on (replays too)
            return None
        o = o.clone()
        o[..., 3] *= 2
        return o
    if rank == 1:
        model[0].register_forward_hook(channel)
    checks = ComputeChecks.attach(model, opt, loss_fn=loss_fn, audit_every=5, warmup=8,
                                  inject_bucket=inject if rank == 1 else None)
    gen = torch.Generator().manual_seed(rank)
    for s in range(1, 21):
        now["step"] = s
        batch = (torch.randn(16, 16, generator=gen), torch.randn(16, 4, generator=gen))
        checks.retain(batch)
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    st = checks.status()
    res = {"findings": [[f.step, f.detector, f.cause, list(f.faulty), f.dropped] for f in checks.findings],
           "skipped": sorted({k.step for k in checks.guard.skipped}), "mode": checks.mode(),
           "audits": st.audits, "names": checks.summaries.names,
           "same": same_on_every_rank(model.parameters())}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_composable_replicate_is_checked_through_the_ddp_it_keeps(tmp_path) -> None:
    """3 gloo ranks, an MLP under `replicate()`: the checks attach before the first forward (its DDP made
    then), the buckets named by the model's own parameter names. A gradient element set to 100 on rank 1
    at step 12 is caught on its step, rank 1 named (transient), the update dropped; a persistent x2 on one
    output channel of rank 1's first Linear from step 17 is found by the audit at 20, rank 1 named
    (persistent). Replays run without replicate's hooks: DDP keeps reducing (the replicas end bit for bit
    alike), every replay exact."""
    for res in rank_results(_composable, 3, tmp_path):
        assert res["findings"] == [[12, "stats", "transient", [1], True],
                                   [20, "audit", "persistent", [1], True]], res
        assert res["skipped"] == [12, 20] and res["mode"] == "exact" and res["audits"] >= 3, res
        assert res["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"] and res["same"], res
