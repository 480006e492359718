"""The compute checks under FSDP2 with context parallelism (issue 19; checksums/tp_lanes.py `context_table`):
each cp group (the ranks that split one batch's sequences, whose attention is a collective of the group) is
checked as one data-parallel rank, its findings naming the group's GPUs (`one_of`); a cp dim the checks are
not told of turns replays off rather than blaming a GPU. Real gloo ranks running bench/cp_attention's
context parallelism (torch's own shards SDPA through GPU kernels only)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from rank_spawn import compute_faults as _faults
from rank_spawn import rank_results, spawn

BASE = ["--fsdp", "--model", "tiny-gpt", "--cp", "2", "--fault-step", "22", "--after", "6",
        "--audit-every", "5"]


def test_the_context_table_joins_cp_and_tp_groups_into_replicas_and_refuses_what_does_not_tile():
    """`context_table`: torchtitan's (dp 2, cp 2) mesh without tp (each rank its own row: the cp groups
    are the replicas), and (dp 2, cp 2, tp 2) (tp groups {0,1} {2,3} ... joined by the cp groups {0,2}
    {1,3} ...: lane l = (cp place, tp lane)); a cp group that leaves out its own rank, and groups of two
    shapes, refused."""
    from checksums.tp_lanes import context_table, lane_table
    assert context_table([[0], [1], [2], [3]], [(0, 1), (0, 1), (2, 3), (2, 3)]) == [[0, 1], [2, 3]]
    tp = lane_table(torch.arange(8).reshape(2, 2, 2), [0, 1], 8)          # (dp, cp) x tp
    cp_of = [(0, 2), (1, 3), (0, 2), (1, 3), (4, 6), (5, 7), (4, 6), (5, 7)]
    assert context_table(tp, cp_of) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # cp outermost: cp groups {0, 2}, {1, 3} over ranks laid out (cp, dp)
    assert context_table([[0], [1], [2], [3]], [(0, 2), (1, 3), (0, 2), (1, 3)]) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="does not hold it"):
        context_table([[0], [1], [2], [3]], [(1, 2), (0, 1), (2, 3), (2, 3)])
    with pytest.raises(ValueError, match="one shape"):
        context_table([[0], [1], [2], [3]], [(0, 1, 2), (0, 1, 2), (0, 1, 2), (3,)])


def test_context_parallelism_found_by_its_mesh_dim_names_the_faulty_cp_group():
    """dp 3 x cp 2 on 6 gloo ranks, the tiny GPT's sequences split over each cp group, FSDP2 over (dp, cp)
    flattened (torchtitan's dp_shard_cp); the checks find the cp dim by its name "cp". Faults on rank 3 (cp
    place 1 of group 1, ranks 2 and 3): a gradient element set to 100 caught on its step, the cp group named
    (both GPUs, `one_of`: a fault on one cp rank reaches the other's gradient through the attention's
    all-gather), the update dropped; a persistent x1.01 on one matmul output element, below the statistics'
    margin, by the audit at 25 (a replay of a group's batch is its chunks, each replayed by the rank of the
    same cp place), persistent. 30 clean steps, audits every 5: exact, no suspicion."""
    results = _faults([*BASE, "--world", "6", "--fault-rank", "3", "--clean", "30",
                       "--cases", "grad elem =100,mm one elem x1.01 persistent"])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["detector"] == "stats" and hit["named"] == [2, 3], hit
    assert hit["dropped"] and "cp group [2, 3]" in hit["detail"], hit
    hit = results["mm one elem x1.01 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["detector"] == "audit" and hit["named"] == [2, 3], hit
    assert hit["cause"] == "persistent" and hit["dropped"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["dropped"], st["audits"]) == (30, 0, 0, 6) and st["exact"], st


@pytest.mark.parametrize("how", [["--cp-pass", "arg"], ["--cp-api", "context", "--cp-replay-context"]])
def test_context_parallelism_passed_or_run_in_a_context_is_replayed_exactly(how: list[str]) -> None:
    """The cp dim under another name ("seq"), passed as `context_parallel=`; and the cp attention on only
    inside the loop's context (as torch's context_parallel() patches SDPA), passed as `replay_context=`:
    4 ranks (dp 2 x cp 2), a gradient element set to 100 on rank 3 caught on its step with cp group [2, 3]
    named and dropped; 30 clean steps with 6 exact audits, no suspicion."""
    results = _faults([*BASE, "--world", "4", "--fault-rank", "3", "--clean", "30",
                       "--cases", "grad elem =100", *how])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["named"] == [2, 3] and hit["dropped"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["audits"]) == (30, 0, 6) and st["exact"], st
    assert results["clean"]["mode"] == "exact", results["clean"]["mode"]


@pytest.mark.parametrize("how", [["--cp-pass", "none"], ["--cp-api", "context"]])
def test_context_parallelism_the_checks_cannot_replay_turns_replays_off_naming_no_gpu(how: list[str]) -> None:
    """The cp dim neither named "cp" nor passed (each rank's replay of another's chunk then attends over the
    wrong chunks), and the cp attention on only in the loop's context with no `replay_context=` (a replay
    runs each chunk alone): the first step's check finds replays do not reproduce the step, so replays and
    audits are off (mode "unreproducible"), 30 clean steps give no suspicion, and the faulty step (a gradient
    element set to 100 on rank 3) is still caught by the statistics and dropped, with no GPU named."""
    results = _faults([*BASE, "--world", "4", "--fault-rank", "3", "--clean", "30",
                       "--cases", "grad elem =100", *how])
    r = results["grad elem =100"]
    assert r["caught"].get("compute") is None and r["held"] == 22, r["caught"]
    assert r["status"]["dropped"] == 1 and r["mode"].startswith("unreproducible"), (r["status"], r["mode"])
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["dropped"], st["audits"]) == (30, 0, 0, 0), st
    assert results["clean"]["mode"].startswith("unreproducible"), results["clean"]["mode"]


def _refusals(rank: int, world: int, init: str, out: str) -> None:
    """`context_parallel=` that the checks refuse at attach, on 4 ranks of a (dp 2, cp 2) mesh; see the
    test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    res: dict[str, Any] = {}

    def loss_fn(mod: nn.Module, b: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(mod(b[0]), b[1])

    def attempt(name: str, model: nn.Module, **kw: Any) -> None:
        try:
            ComputeChecks.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn, **kw)
            res[name] = ""
        except ValueError as exc:
            res[name] = str(exc)
    attempt("ddp", DDP(nn.Linear(4, 4)), context_parallel=mesh["cp"])
    attempt("two_dims", fully_shard(nn.Linear(4, 4)), context_parallel=mesh)
    attempt("not_a_mesh", fully_shard(nn.Linear(4, 4)), context_parallel=[0, 1])
    attempt("not_a_function", fully_shard(nn.Linear(4, 4)), replay_context=3)
    # FSDP over the dp ranks alone: its reduce-scatter would not sum the cp ranks' gradients
    attempt("fsdp_without_cp", fully_shard(nn.Linear(4, 4), mesh=mesh["dp"]), context_parallel=mesh["cp"])
    # expert_parallel= alike (the ep ranks compute together as the cp ranks do), on a (dp, ep) mesh
    ep_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    attempt("ep_ddp", DDP(nn.Linear(4, 4)), expert_parallel=ep_mesh["ep"])
    attempt("ep_two_dims", fully_shard(nn.Linear(4, 4)), expert_parallel=ep_mesh)
    attempt("fsdp_without_ep", fully_shard(nn.Linear(4, 4), mesh=ep_mesh["dp"]),
            expert_parallel=ep_mesh["ep"])
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_context_parallel_arguments_the_checks_cannot_use_are_refused_at_attach(tmp_path) -> None:
    """`context_parallel=` under DDP (its replays are per rank), a 2-D mesh, something neither a mesh nor a
    group, and a cp mesh FSDP does not shard over (so its reduce-scatter would not sum the cp ranks'
    gradients): each a ValueError at attach that says what to pass; `replay_context=` that is no function
    too; `expert_parallel=` under DDP, a 2-D mesh, and ep ranks FSDP does not shard over, alike."""
    for res in rank_results(_refusals, 4, tmp_path):
        assert "context_parallel= under DDP" in res["ddp"] and "Supported with FSDP2" in res["ddp"], res
        assert "takes the cp dim's 1-D DeviceMesh" in res["two_dims"], res
        assert "got list" in res["not_a_mesh"], res
        assert res["not_a_function"].startswith("replay_context is a function"), res
        assert "does not hold this rank's context-parallel ranks" in res["fsdp_without_cp"], res
        assert "expert_parallel= under DDP" in res["ep_ddp"], res
        assert "expert_parallel= takes the ep dim's 1-D DeviceMesh" in res["ep_two_dims"], res
        assert "does not hold this rank's expert-parallel ranks" in res["fsdp_without_ep"], res


def _ddp_replay_context(rank: int, world: int, init: str, out: str) -> None:
    """DDP on 3 ranks whose loop runs each forward and backward inside a context that changes the model's
    arithmetic (a flag its forward reads); see the test."""
    import contextlib
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    flag = {"on": False}

    @contextlib.contextmanager
    def inside() -> Any:
        flag["on"] = True
        try:
            yield
        finally:
            flag["on"] = False

    def loss_fn(mod: nn.Module, b: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(mod(b[0]), b[1])
    res: dict[str, Any] = {}
    for name, kw in (("without", {}), ("with", {"replay_context": inside})):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        net.register_forward_hook(lambda m, i, o: o * 1.5 + 0.25 if flag["on"] else None)
        ddp = DDP(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        checks = ComputeChecks.attach(ddp, opt, loss_fn=loss_fn, audit_every=2, warmup=2, **kw)
        g = torch.Generator().manual_seed(rank)
        for _ in range(6):
            batch = (torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
            checks.retain(batch)
            with inside():
                loss_fn(ddp, batch).backward()
            opt.step()
            opt.zero_grad()
        st = checks.status()
        res[name] = [st.steps, st.audits, st.suspicions, st.dropped, checks.mode()]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_replay_context_runs_every_replay_inside_the_loops_own_context(tmp_path) -> None:
    """DDP on 3 gloo ranks, the loop's forward and backward inside a context that changes the model's output
    (as torch's context_parallel() or an sdpa_kernel choice changes the computation): without
    `replay_context=` the first step's check finds that replays do not give the step's gradient and turns
    them off (mode "unreproducible", no audit, no suspicion); with it, every replay runs inside the context
    and reproduces the step: 3 audits in 6 steps, exact, no suspicion."""
    import json
    out = str(tmp_path / "res")
    spawn(_ddp_replay_context, (3, str(tmp_path / "init"), out), nprocs=3)
    for r in range(3):
        with open(f"{out}.{r}") as f:
            res = json.load(f)
        steps, audits, suspicions, dropped, mode = res["without"]
        assert (steps, audits, suspicions, dropped) == (6, 0, 0, 0) and mode.startswith("unreproducible"), res
        assert res["with"] == [6, 3, 0, 0, "exact"], res


def test_hsdp_with_context_parallelism_names_the_faulty_cp_group_and_keeps_clean_steps_clean():
    """HSDP (2 replicas) x 2 shards x cp 2 on 8 gloo ranks, FSDP2 on (replicate, shard x cp) as torchtitan
    lays it out (`--hsdp 2 --cp 2`): the lanes' data-parallel groups made across both FSDP dims. Faults on
    rank 5 (cp group [4, 5]): a gradient element set to 100 caught on its step (22), the group named and the
    update dropped; a persistent x1.01 on one matmul output element by the audit at 25, persistent. 30 clean
    steps with audits every 5: exact, no suspicion."""
    results = _faults([*BASE, "--world", "8", "--hsdp", "2", "--fault-rank", "5", "--clean", "30",
                       "--cases", "grad elem =100,mm one elem x1.01 persistent"])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["detector"] == "stats" and hit["named"] == [4, 5], hit
    assert hit["dropped"] and "cp group [4, 5]" in hit["detail"], hit
    hit = results["mm one elem x1.01 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["detector"] == "audit" and hit["named"] == [4, 5], hit
    assert hit["cause"] == "persistent" and hit["dropped"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["dropped"], st["audits"]) == (30, 0, 0, 6) and st["exact"], st


def test_context_and_tensor_parallelism_together_check_each_cp_x_tp_group_as_one_replica():
    """dp 2 x cp 2 x tp 2 on 8 gloo ranks (the tiny GPT's MLPs split over tp, its sequences over cp, FSDP2
    over (dp, cp)): each cp group's tp groups join into one replica of 4 ranks (lane = cp place x tp lane).
    A gradient element set to 100 on rank 5 is caught on its step with the whole group [4, 5, 6, 7] named
    (`one_of`) and dropped; 20 clean steps with audits every 5: 4 exact audits, no suspicion."""
    results = _faults([*BASE, "--world", "8", "--tp", "2", "--fault-rank", "5", "--clean", "20",
                       "--cases", "grad elem =100"])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["named"] == [4, 5, 6, 7] and hit["dropped"], hit
    assert "cp x tp group [4, 5, 6, 7]" in hit["detail"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["dropped"], st["audits"]) == (20, 0, 0, 4) and st["exact"], st


def test_cp_groups_are_found_in_meshes_unflattened_from_one_world_mesh():
    """Newer torchtitan's layout (`--cp-mesh unflatten`): a data-loading mesh (batch, cp) and a dense mesh
    (dp_replicate, fsdp = dp_shard x cp), each unflattened from one 1-D world mesh; FSDP2's mesh has no "cp"
    dim beside it. The checks find the cp groups among the process groups the world mesh made for a dim
    named "cp" (before: replays off as `unreproducible`, the x1.01 unseen, no GPU named). dp 3 x cp 2: a
    gradient element set to 100 on rank 3 caught on its step, the x1.01 by the audit at 25, [2, 3] named;
    10 clean steps, 2 exact audits."""
    results = _faults([*BASE, "--world", "6", "--cp-mesh", "unflatten", "--fault-rank", "3", "--clean", "10",
                       "--cases", "grad elem =100,mm one elem x1.01 persistent"])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["named"] == [2, 3] and hit["dropped"], hit
    hit = results["mm one elem x1.01 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["cause"] == "persistent" and hit["named"] == [2, 3], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["audits"]) == (10, 0, 2) and st["exact"], st


def test_the_lane_witness_names_the_gpu_of_a_cp_group_that_computed_wrong():
    """dp 3 x cp 2 on 6 gloo ranks under bf16 autocast: a persistent x1.05 on one element inside block 0's
    MLP matmul on rank 3 (as a tensor core computing wrong: the op itself returns it) is found by the audit at
    25 in cp group [2, 3]; then the lane witness (checksums/lane_witness.py: every rank replays the group's
    batch under the op trace, lane against lane with a good group) finds the first op computing differently
    from equal inputs in lane 1, the CPU's float64 result is the good GPU's, and rank 3 alone is named (not
    `one_of`). A fault the hook adds after the op (other ops on that rank only: the traces part) leaves the
    finding naming the group, `one_of`."""
    results = _faults([*BASE, "--world", "6", "--fault-rank", "3", "--cpu-autocast",
                       "--cases", "tc one elem x1.05 persistent,mm one elem x1.01 persistent"])
    hit = results["tc one elem x1.05 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["detector"] == "audit" and hit["cause"] == "persistent", hit
    assert hit["named"] == [3] and not hit["one_of"] and hit["dropped"], hit
    assert "rank 3 computed wrong, named by the lane witness" in hit["detail"], hit
    assert "aten.addmm" in hit["detail"] or "aten.mm" in hit["detail"], hit
    hit = results["mm one elem x1.01 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["named"] == [2, 3] and hit["one_of"], hit


def test_the_lane_witness_names_one_lane_only_when_no_other_lane_disagrees():
    """`judged` (pure): one lane whose decision is near 0 (the good GPU's output is the CPU's) names that
    lane; none names nobody; two lanes naming, or a lane pointing at the good group's GPU, name nobody."""
    from checksums.lane_witness import judged
    nan = float("nan")
    assert judged([(nan, "no op"), (0.02, "op 97")]) == (1, "lane 1: op 97")
    lane, why = judged([(nan, "no op"), (nan, "sequences part")])
    assert lane is None and "lane 1: sequences part" in why
    assert judged([(0.0, "a"), (0.01, "b")])[0] is None
    assert judged([(0.0, "a"), (0.99, "b")])[0] is None
    assert judged([(0.5, "rounding"), (nan, "")])[0] is None
