"""Data-parallel wrappers the compute checks cannot read a gradient from (issue 19), refused at attach with
what to do instead, on every rank alike, before any hook: torch's composable `replicate()` (torchtitan's
DDP: its DistributedDataParallel is made at the first forward; before, an AttributeError), FSDP2's own
`replicate()` and HSDP with shard groups of one rank (FSDP2 runs no reduce-scatter over one rank, and the
checks read each group's gradient in its custom reduce-scatter; before, attach succeeded and every step's
check failed, said once in the log, while GetStatus said `exact` with 0 suspicions). Real gloo ranks."""
from __future__ import annotations

from typing import Any

import torch

from rank_spawn import rank_results


def _attach_each(rank: int, world: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed._composable.replicate import replicate
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
    attempt("composable", replicate(nn.Linear(4, 4)))
    attempt("fsdp_replicate", fsdp_replicate(nn.Linear(4, 4)))
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    attempt("hsdp_shards_of_one", fully_shard(nn.Linear(4, 4), mesh=mesh))
    attempt("fsdp", fully_shard(nn.Linear(4, 4)))            # sharded over every rank: attaches
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_wrappers_whose_gradient_the_checks_cannot_read_are_refused_at_attach(tmp_path) -> None:
    for res in rank_results(_attach_each, 3, tmp_path):
        assert res["composable"].startswith("TypeError: GradSummaries needs a DistributedDataParallel"), res
        assert "composable.replicate: wrap the model in DistributedDataParallel" in res["composable"], res
        for name in ("fsdp_replicate", "hsdp_shards_of_one"):
            assert res[name].startswith("ValueError: ComputeChecks: FSDP2 shards over one rank here"), res
        assert res["fsdp"] == "", res
