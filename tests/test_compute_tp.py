"""The compute checks under FSDP2/HSDP with tensor parallelism (issue 19; checksums/tp_lanes.py): a tp group
checked as one data-parallel rank, its findings naming the group's GPUs (`one_of`), every decision the whole
mesh's; DDP with tensor parallelism refused at attach. Real gloo ranks (bench/compute_faults `--tp`)."""
from __future__ import annotations

from typing import Any

import torch
from rank_spawn import compute_faults as _faults
from rank_spawn import spawn


def _tensor_parallel(rank: int, world: int, init: str, out: str) -> None:
    """FSDP2 over a (dp 2, tp 2) mesh with the MLP's layers split tensor-parallel over tp; see the test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from checksums.compute_gate import ComputeChecks
    from checksums.grad_checks import model_parallel_dims
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    res: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    fully_shard(plain, mesh=mesh["dp"])                        # FSDP2 alone: nothing else split
    res["fsdp_alone"] = model_parallel_dims(plain, True)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)

    def loss_fn(mod: nn.Module, b: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(mod(b[0]), b[1])
    try:                               # the tp group's ranks as the data-parallel group: refused, no hook
        ComputeChecks.attach(m, opt, loss_fn=loss_fn, group=mesh["tp"].get_group())
        res["wrong_group"] = ""
    except ValueError as exc:
        res["wrong_group"] = str(exc)
    checks = ComputeChecks.attach(m, opt, loss_fn=loss_fn, group=mesh["dp"].get_group(), audit_every=2)
    lanes = checks.lanes
    res["lanes"] = None if lanes is None else [lanes.dp, lanes.lanes, lanes.dp_rank, lanes.lane,
                                               list(lanes.dims)]
    res["rank"] = [checks.rank, checks.world]
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    for _ in range(4):                 # a tp group's ranks run one batch
        batch = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
        checks.retain(batch)
        loss_fn(m, batch).backward()
        opt.step()
        opt.zero_grad()
    st = checks.status()
    res["status"] = [st.steps, st.audits, st.suspicions, st.exact, checks.mode()]
    res["finite"] = all(bool(torch.isfinite(p.full_tensor()).all()) for p in m.parameters())
    # DDP over the dp group of a tensor-parallel module whose DTensors torch made local for DDP (its
    # `_pre_dp_module_transform`): no DTensor parameter left, the tp mesh held by the layers' hooks
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from torch.nn.parallel import DistributedDataParallel as DDP
    tp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    parallelize_module(tp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    _pre_dp_module_transform(tp)
    ddp = DDP(tp, process_group=mesh["dp"].get_group())
    try:
        ComputeChecks.attach(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), loss_fn=loss_fn,
                             group=mesh["dp"].get_group())
        res["ddp_refused"] = ""
    except ValueError as exc:
        res["ddp_refused"] = str(exc)
    ddp_alone = DDP(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)))
    res["ddp_alone"] = model_parallel_dims(ddp_alone, False)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_tensor_parallelism_under_fsdp2_is_checked_by_tp_group_and_refused_under_ddp(tmp_path) -> None:
    """FSDP2 with tensor parallelism (a (dp 2, tp 2) mesh): a tp group's ranks compute one step together, so
    the checks see each tp group as one data-parallel rank (checksums.tp_lanes: dp 2, 2 lanes, every rank's
    place found from the parameters' mesh) and every decision is the whole mesh's: 4 steps with audits
    every 2 run their replays as collectives of all ranks, exact, no suspicion. A data-parallel group that
    is not the rank's lane (the tp group passed as `group=`) is refused at attach. Under DDP over the dp group
    (torch's DDP + TP path, whose parameters are plain tensors by then) the checks still refuse, naming the
    tp dim; FSDP2 alone and DDP alone are not split."""
    import json
    out = str(tmp_path / "res")
    spawn(_tensor_parallel, (4, str(tmp_path / "init"), out), nprocs=4)
    for r in range(4):
        with open(f"{out}.{r}") as f:
            res = json.load(f)
        assert res["fsdp_alone"] == [], res
        assert "group= holds ranks" in res["wrong_group"] and "not this rank's data-parallel ranks" in \
            res["wrong_group"], res
        assert res["lanes"] == [2, 2, r // 2, r % 2, ["tp"]], res
        assert res["rank"] == [r // 2, 2], res
        assert res["status"] == [4, 2, 0, True, "exact"], res
        assert res["finite"], res
        assert res["ddp_refused"].startswith("ComputeChecks: the model is also split across ranks over ['tp']"), res
        assert res["ddp_alone"] == [], res


def test_lanes_lay_a_tp_groups_rows_side_by_side_as_one_data_parallel_ranks():
    """`Lanes.merge`: rows gathered over the mesh in rank order ([world, *pre, B, 4]) become each tp group's
    lanes side by side ([dp, *pre, lanes * B, 4]), whatever the mesh's rank order (here a (dp 3, tp 2) mesh
    whose tp groups are ranks {0, 3}, {1, 4}, {2, 5})."""
    from checksums.tp_lanes import Lanes
    ranks = (0, 3, 1, 4, 2, 5)                       # (dp index, lane) order
    lanes = Lanes(dp=3, lanes=2, dp_rank=0, lane=0, ranks=ranks, dp_group=None, dims=("tp",))
    b = 2
    gathered = torch.stack([torch.full((3, b, 4), r, dtype=torch.int64) for r in range(6)])
    gathered[:, 1] += 100                              # a leading dim (two replays a rank)
    gathered[..., 1, :] += 10                          # the bucket index
    merged = lanes.merge(gathered)
    assert merged.shape == (3, 3, 2 * b, 4)
    for d in range(3):
        for lane in range(2):
            g = ranks[d * 2 + lane]
            assert torch.equal(merged[d, :, lane * b:(lane + 1) * b], gathered[g]), (d, lane)
    assert lanes.members(1) == (1, 4) and lanes.size == 6
    assert torch.equal(lanes.merge(gathered[:, 0])[2, 2:], gathered[5, 0])


def test_the_lane_table_reads_tp_groups_from_any_mesh_layout_and_refuses_what_it_cannot_number():
    """`lane_table`: torchtitan's (dp, tp) mesh (tp innermost: groups of consecutive ranks), HSDP's (replicate,
    shard, tp), and a mesh with tp outermost; a mesh that leaves out ranks of the job, and one whose lanes
    number their ranks against the global order (a lane's group rank would not be its dp index), refused."""
    import pytest

    from checksums.tp_lanes import lane_table
    assert lane_table(torch.arange(4).reshape(2, 2), [0], 4) == [[0, 1], [2, 3]]
    assert lane_table(torch.arange(8).reshape(2, 2, 2), [0, 1], 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lane_table(torch.arange(6).reshape(2, 3), [1], 6) == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="not every rank of the job"):
        lane_table(torch.arange(4).reshape(2, 2), [0], 8)
    with pytest.raises(ValueError, match="not every rank of the job"):
        lane_table(torch.tensor([[0, 1], [1, 3]]), [0], 4)
    with pytest.raises(ValueError, match="a custom mesh"):
        lane_table(torch.tensor([[2, 1], [0, 3]]), [0], 4)


def test_hsdp_with_tensor_parallelism_names_the_faulty_tp_group_and_keeps_clean_steps_clean():
    """torchtitan's 3-D layout: HSDP (2 replicas x 2 shards) with the MLP split tensor-parallel over 2 ranks,
    8 gloo ranks (`--tp 2 --hsdp 2`). A tp group is one data-parallel rank to the checks (4 of them), its
    lanes' rows side by side; every decision is the whole mesh's, so every rank replays alike. Faults on rank
    5 (lane 1 of tp group 2, ranks 4 and 5): a gradient element set to 100 is caught on its step (22), the
    group named (both GPUs, `one_of`), its update dropped; a persistent x1.01 on one matmul output element
    from step 22, below the statistics' margin, by the audit at 25, persistent. 30 clean steps with audits
    every 5: exact, no suspicion."""
    results = _faults(["--world", "8", "--fsdp", "--hsdp", "2", "--tp", "2", "--fault-rank", "5",
                       "--fault-step", "22", "--after", "6", "--audit-every", "5", "--clean", "30",
                       "--cases", "grad elem =100,mm one elem x1.01 persistent"])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["detector"] == "stats" and hit["named"] == [4, 5], hit
    assert hit["dropped"] and "tp group [4, 5]" in hit["detail"], hit
    hit = results["mm one elem x1.01 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["detector"] == "audit" and hit["named"] == [4, 5], hit
    assert hit["cause"] == "persistent" and hit["dropped"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["dropped"], st["audits"]) == (30, 0, 0, 6) and st["exact"], st


def test_the_lane_witness_names_the_gpu_of_a_tp_group_whose_split_matmul_computed_wrong():
    """dp 3 x tp 2 on 6 gloo ranks under bf16 autocast, the MLP's second Linear row-parallel: a persistent
    x1.05 on one element inside rank 3's local matmul (the op a DTensor runs on its shard, as a tensor core
    computing wrong) is found by the audit at 25 in tp group [2, 3]; the lane witness traces the ops DTensor
    runs on each rank's local shards (checksums.op_witness `OpTrace` hands a DTensor's op back to DTensor's
    own dispatch with the trace on), finds in lane 1 the local matmul computing differently from equal inputs,
    and names rank 3 alone (it named no GPU while the trace saw only the DTensor op). A fault the hook adds
    after the layer (extra ops on rank 3: the traces part) leaves the group named, `one_of`."""
    results = _faults(["--world", "6", "--fsdp", "--tp", "2", "--fault-rank", "3", "--cpu-autocast",
                       "--fault-step", "22", "--after", "6", "--audit-every", "5",
                       "--cases", "tc one elem x1.05 persistent,mm one elem x1.01 persistent"])
    hit = results["tc one elem x1.05 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["detector"] == "audit" and hit["cause"] == "persistent", hit
    assert hit["named"] == [3] and not hit["one_of"] and hit["dropped"], hit
    assert "rank 3 computed wrong, named by the lane witness" in hit["detail"], hit
    assert "aten.addmm" in hit["detail"] or "aten.mm" in hit["detail"], hit
    hit = results["mm one elem x1.01 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["named"] == [2, 3] and hit["one_of"], hit


def test_fsdp2_with_tensor_parallelism_masks_on_the_device_as_the_host_veto_does():
    """FSDP2 (dp 2) x tensor parallelism (tp 2) on 4 gloo ranks with fused Adam: the device mask (the
    verdict a 0-d `found_inf`, from the rows gathered over the whole mesh and laid out by tp group on the
    device) drops the faulty step (25, tp group [0, 1] named) and every rank's shards end bit-identical to
    the host veto's run."""
    def run(mask: str) -> tuple[dict, list[str]]:
        name = "mm one elem =1e4"
        r = _faults(["--world", "4", "--fsdp", "--tp", "2", "--mask", mask, "--fused-adam",
                     "--fault-step", "25", "--after", "4", "--audit-every", "0", "--cases", name])[name]
        return r["caught"].get("compute"), r["weights"]
    host_hit, host_w = run("host")
    dev_hit, dev_w = run("device")
    for hit in (host_hit, dev_hit):
        assert hit and hit["step"] == 25 and hit["named"] == [0, 1] and hit["dropped"], hit
    assert dev_w == host_w
