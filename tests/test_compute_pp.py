"""The compute checks under FSDP2 with pipeline parallelism (issue 19; checksums/tp_lanes.py): each rank holds
one stage of the model (torch's PipelineStage, FSDP2 over that stage's data-parallel ranks), a step is the
schedule's (ScheduleGPipe: micro-batches, activations and their gradients passed between the stages), so a
pp group (one rank of each stage) computes one replica's step and is checked as one data-parallel rank,
its stages' rows side by side (a stage's FSDP groups counted apart: the stages hold different layers), and
replays run the loop's schedule again (`step_fn=`). Real gloo ranks running bench/pp_stages' pipelines.

Before: attaching the checks to a stage of torchtitan's (pp, dp) layout aborted every rank at the first step
(gloo: "Received data size doesn't match expected size": the stages' rows differ in count)."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from rank_spawn import compute_faults as _faults
from rank_spawn import rank_results

BASE = ["--fsdp", "--pp", "2", "--world", "6", "--fault-step", "22", "--after", "6", "--audit-every", "5",
        "--clean", "10"]


def test_a_pipelines_stages_are_checked_as_one_replica_and_the_faulty_gpu_named():
    """dp 3 x pp 2 on 6 gloo ranks (the MLP's Linear units: two FSDP groups on the first stage, one on the
    last), the pp dim found by its name, bf16 autocast. On rank 4 (the last stage of the second replica): a
    gradient element set to 100 is caught on its step, its pp group [1, 4] named (`one_of`: the last stage's
    backward feeds the first's), the update dropped on every stage; a persistent x2 on one output channel
    inside rank 4's matmul is found by the audit at 25 and the lane witness names rank 4 alone (the op that
    computes differently from equal inputs is on that stage; the first stage's ops read gradients that already
    differ). 10 clean steps: 2 exact audits, no suspicion."""
    results = _faults([*BASE, "--fault-rank", "4", "--cpu-autocast",
                       "--cases", "grad elem =100,tc channel x2 persistent"])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["detector"] == "stats" and hit["named"] == [1, 4], hit
    assert hit["one_of"] and hit["dropped"] and "pp group [1, 4]" in hit["detail"], hit
    assert results["grad elem =100"]["skipped"] == [[22, "compute"]], results["grad elem =100"]
    hit = results["tc channel x2 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["detector"] == "audit" and hit["cause"] == "persistent", hit
    assert hit["named"] == [4] and not hit["one_of"] and hit["dropped"], hit
    assert "rank 4 computed wrong, named by the lane witness" in hit["detail"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["dropped"], st["audits"]) == (10, 0, 0, 2) and st["exact"], st


def test_gpt_stages_under_hsdp_with_the_pp_group_passed():
    """The tiny GPT split as torchtitan splits it (embeddings and the first block; the last block, the final
    norm and an untied head), HSDP (2 replicas x 2 shards) inside each stage on 8 ranks, the pp dim named
    otherwise and passed as `pipeline_parallel=`: a persistent x1.01 on one output element of rank 1's
    first block (the hook's, after the op: the traces part, so the group is named) is found by the audit at
    25 with its pp group [1, 5]; 10 clean steps, 2 exact audits. Not passed (`--cp-pass none`): the attach
    refuses (a step_fn whose FSDP mesh holds half the job's ranks: an untold pipeline would replay on some
    stages only and wait for ever), saying to pass pipeline_parallel=."""
    args = [*BASE, "--model", "tiny-gpt", "--hsdp", "2", "--world", "8", "--fault-rank", "1",
            "--cases", "mm one elem x1.01 persistent"]
    results = _faults([*args, "--cp-pass", "arg"])
    hit = results["mm one elem x1.01 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["cause"] == "persistent" and hit["named"] == [1, 5], hit
    assert hit["one_of"] and hit["dropped"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["audits"]) == (10, 0, 2) and st["exact"], st
    try:
        _faults([*args, "--cp-pass", "none", "--cases", "none", "--clean", "2"])
    except Exception as exc:    # the rank's ValueError, raised here by the spawner
        assert "pass pipeline_parallel=" in str(exc), exc
    else:
        raise AssertionError("an untold pipeline was attached")


def test_stages_split_over_tensor_parallelism_too():
    """pp 2 x dp 2 x tp 2 on 8 gloo ranks (torchtitan's (pp, dp, tp) mesh: the MLP's Linears column- and
    row-parallel inside each stage, FSDP2 over the stage's dp ranks): each stage's tp mesh spans that stage
    only, so the checks gather the stages' tp groups from every rank and join them through the pp groups, a
    replica being its two stages' four GPUs. A gradient element set to 100 on rank 5 (second stage, first
    replica, tp lane 1) is caught on its step, [0, 1, 4, 5] named (`one_of`), the update dropped; 6 clean
    steps with an exact audit and no suspicion."""
    results = _faults(["--fsdp", "--pp", "2", "--tp", "2", "--world", "8", "--fault-rank", "5",
                       "--fault-step", "22", "--after", "3", "--audit-every", "5", "--clean", "6",
                       "--cases", "grad elem =100"])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["detector"] == "stats" and hit["named"] == [0, 1, 4, 5], hit
    assert hit["one_of"] and hit["dropped"] and "pp x tp group [0, 1, 4, 5]" in hit["detail"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["dropped"], st["audits"]) == (6, 0, 0, 1) and st["exact"], st


def _refusals(rank: int, world: int, init: str, out: str) -> None:
    """What the checks refuse at attach on a stage of a (pp 2, dp 2) mesh; see the test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    res: dict[str, Any] = {}

    def loss_fn(mod: nn.Module, b: tuple) -> torch.Tensor:
        return nn.functional.mse_loss(mod(b[0]), b[1])

    def step_fn(mod: nn.Module, b: tuple) -> None:
        loss_fn(mod, b).backward()

    def attempt(name: str, model: nn.Module, **kw: Any) -> None:
        try:
            ComputeChecks.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
            res[name] = ""
        except ValueError as exc:
            res[name] = str(exc)
    stage = fully_shard(nn.Linear(4, 4), mesh=mesh["dp"])
    attempt("loss_fn", stage, loss_fn=loss_fn)            # the pp dim found by its name
    attempt("both", stage, loss_fn=loss_fn, step_fn=step_fn)
    attempt("neither", stage)
    attempt("witness", stage, step_fn=step_fn, witness_model=lambda: nn.Linear(4, 4))
    attempt("ddp", DDP(nn.Linear(4, 4)), loss_fn=loss_fn, pipeline_parallel=mesh["pp"])
    attempt("ddp_step", DDP(nn.Linear(4, 4)), step_fn=step_fn)
    # FSDP over the pp ranks too: a stage's parameters are not the other stages'
    attempt("fsdp_over_pp", fully_shard(nn.Linear(4, 4)), step_fn=step_fn, pipeline_parallel=mesh["pp"])
    # a pipeline without data parallelism (4 stages of one rank): FSDP2 over one rank reduces nothing
    alone = init_device_mesh("cpu", (4, 1), mesh_dim_names=("pp", "dp"))
    attempt("one_rank", fully_shard(nn.Linear(4, 4), mesh=alone["dp"]), step_fn=step_fn)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_what_a_pipeline_stage_cannot_be_checked_with_is_refused_at_attach(tmp_path) -> None:
    """On a stage of a (pp, dp) mesh: `loss_fn=` (a stage cannot compute the loss: the replay must rerun
    the schedule) refused, saying step_fn=; both or neither of loss_fn= and step_fn=; `witness_model=` (the
    whole model on one CPU); `pipeline_parallel=` or `step_fn=` under DDP (its replays are per rank); FSDP
    sharding over the pp ranks; a stage sharded over one rank (no data parallelism: FSDP2 makes no
    reduce-scatter there; before, every step's check failed, said once in the log): each a ValueError at
    attach with what to do."""
    for res in rank_results(_refusals, 4, tmp_path):
        assert "holds one stage of a pipeline" in res["loss_fn"] and "pass step_fn=" in res["loss_fn"], res
        assert "not both" in res["both"], res
        assert res["neither"].startswith("loss_fn is a function"), res
        assert "witness_model= rebuilds the whole model" in res["witness"], res
        assert "pipeline_parallel= under DDP" in res["ddp"], res
        assert "step_fn= replays a step through the model's own backward" in res["ddp_step"], res
        assert "holds more than this rank of its pipeline-parallel ranks" in res["fsdp_over_pp"], res
        assert "FSDP2 shards over one rank here" in res["one_rank"], res


def test_each_lanes_rows_are_padded_for_the_gather_and_merged_without_the_padding():
    """`Lanes.pad` / `merge` with lanes of different row counts (a pipeline's stages): 2 groups x 2 stages,
    the first stage 3 rows, the second 1; each rank pads to 3, the merge keeps each group's 3 + 1 real rows
    in lane order and drops the padding; equal counts leave both unchanged. Pure (no collective)."""
    from checksums.tp_lanes import Lanes
    lanes = Lanes(dp=2, lanes=2, dp_rank=0, lane=0, ranks=(0, 2, 1, 3), dp_group=None, dims=("pp",),
                  counts=(3, 1))
    rows = {0: torch.arange(12).reshape(3, 4), 2: 100 + torch.arange(4).reshape(1, 4),
            1: 200 + torch.arange(12).reshape(3, 4), 3: 300 + torch.arange(4).reshape(1, 4)}
    padded = [lanes.pad(rows[r]) for r in range(4)]
    assert all(p.shape == (3, 4) for p in padded)
    assert torch.equal(padded[2][1:], torch.zeros(2, 4, dtype=torch.int64))
    merged = lanes.merge(torch.stack(padded))
    assert merged.shape == (2, 4, 4) and lanes.merged_rows(1) == 4
    assert torch.equal(merged[0], torch.cat([rows[0], rows[2]]))
    assert torch.equal(merged[1], torch.cat([rows[1], rows[3]]))
    same = Lanes(dp=2, lanes=2, dp_rank=0, lane=0, ranks=(0, 1, 2, 3), dp_group=None, dims=("tp",))
    x = torch.arange(32).reshape(4, 2, 4)
    first = x[0]
    assert same.pad(first) is first and same.merge(x).shape == (2, 4, 4) and same.merged_rows(2) == 4


def _pp_ranks(rank: int, world: int, init: str) -> tuple[Any, int, int]:
    """This rank joined to the job (gloo, one thread) and its (pp 2, dp world/2) mesh: (mesh, pp, dp)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    return mesh, mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()


def _interleaved(rank: int, world: int, init: str, out: str) -> None:
    """An interleaved schedule on a (pp 2, dp 3) mesh, each rank two virtual stages; see the test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from checksums.compute_gate import ComputeChecks
    mesh, pp, dp = _pp_ranks(rank, world, init)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4)]
    parts, stages = [], []
    for v in range(2):                    # rank pp holds stages pp and pp + 2 (the looped layout)
        index = pp + 2 * v
        part = fully_shard(layers[index], mesh=mesh["dp"])
        parts.append(part)
        stages.append(PipelineStage(part, index, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=2,
                                       loss_fn=lambda o, t: nn.functional.mse_loss(o, t))
    model = nn.ModuleList(parts)          # the rank's model parts; torchtitan's optimizers: one per part
    from torchtitan.components.optimizer import OptimizersContainer, default_adamw
    opt = OptimizersContainer(default_adamw(lr=1e-3), model_parts=parts)
    flip = {"on": False}
    # rank 4 (stage 1 and 3 of the second replica): its last part's first Linear x2 on one output channel,
    # from step 14 on (a persistent fault of that GPU's matmul: the replays hit it too)
    if rank == 4:
        def channel(mod: nn.Module, inp: Any, o: torch.Tensor) -> torch.Tensor | None:
            if not flip["on"]:
                return None
            o = o.clone()
            o[..., 3] *= 2
            return o
        parts[1][0].register_forward_hook(channel)

    def step_fn(mod: nn.Module, batch: tuple) -> None:
        x, y = batch
        if pp == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)

    def inject(idx: int, flat: torch.Tensor) -> None:
        if step_no["n"] == 12 and idx == 0:
            flat.view(-1)[5] = 100.0
    step_no = {"n": 0}
    checks = ComputeChecks.attach(model, opt, step_fn=step_fn, audit_every=5, warmup=8,
                                  inject_bucket=inject if rank == 4 else None)
    for s in range(1, 19):
        step_no["n"] = s
        flip["on"] = s >= 14
        g = torch.Generator().manual_seed(1000 * dp + s)
        batch = (torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))
        checks.retain(batch)
        step_fn(model, batch)
        opt.step()
        opt.zero_grad()
    found = [[f.step, f.detector, f.cause, list(f.faulty), f.one_of, f.dropped] for f in checks.findings]
    res = {"findings": found, "skipped": sorted({k.step for k in checks.guard.skipped}),
           "audits": checks.status().audits, "exact": checks.status().exact}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_an_interleaved_schedules_model_parts_are_checked_together(tmp_path) -> None:
    """torch's ScheduleInterleaved1F1B on 6 gloo ranks (pp 2 x dp 3), each rank two virtual stages (its model
    parts, each FSDP2-sharded over the stage's dp ranks, held in an `nn.ModuleList` the checks attach to;
    torchtitan's `OptimizersContainer` over them, one fused AdamW per part, as its trainer builds them). A
    gradient element set to 100 on rank 4 at step 12 is caught on its step, the pp group [1, 4] named and the
    update dropped on every rank; a persistent x2 on one output channel of rank
    4's last part from step 14 is found by the audit at 15, the group named, persistent, dropped."""
    for res in rank_results(_interleaved, 6, tmp_path):
        assert res["exact"] and res["audits"] >= 2, res
        by_step = {f[0]: f for f in res["findings"]}
        assert by_step[12][1:] == ["stats", "transient", [1, 4], True, True], res
        assert by_step[15][1:] == ["audit", "persistent", [1, 4], True, True], res
        assert 12 in res["skipped"] and 15 in res["skipped"], res


DOC_STEPS, DOC_FAULT = 40, 30


def _doc_pipeline(rank: int, world: int, init: str, out: str) -> None:
    """docs/compute-checks.md's pipeline loop as written, on a stage of a (pp 2, dp 3) mesh; see the test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from test_compute_checks_doc import doc_loop
    mesh, stage, dp = _pp_ranks(rank, world, init)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 32), nn.GELU()),
              nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))]
    model_part = fully_shard(layers[stage], mesh=mesh["dp"])
    schedule = ScheduleGPipe(PipelineStage(model_part, stage, 2, torch.device("cpu"),
                                           group=mesh["pp"].get_group()),
                             n_microbatches=2, loss_fn=nn.functional.cross_entropy)
    gen = torch.Generator().manual_seed(dp)
    data = [(torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen))
            for _ in range(DOC_STEPS)]
    now = {"step": 0}
    fired: list[int] = []

    def loader() -> Any:
        for i, batch in enumerate(data, 1):
            now["step"] = i
            yield batch

    def one_bad_element(mod: nn.Module, inp: Any, o: torch.Tensor) -> torch.Tensor | None:
        # rank 4 (the last stage of the second replica): one output element of its first Linear set to 1e4
        # in the first micro-batch of step DOC_FAULT (once: the replays compute it right)
        if rank != 4 or now["step"] != DOC_FAULT or fired:
            return None
        fired.append(DOC_FAULT)
        o = o.clone()
        o.view(-1)[3] = 1e4
        return o
    model_part[0].register_forward_hook(one_bad_element)
    g: dict[str, Any] = {"model_part": model_part, "schedule": schedule, "loader": loader(),
                         "optimizer": torch.optim.SGD(model_part.parameters(), lr=0.05),
                         "has_first_stage": stage == 0, "has_last_stage": stage == 1}
    exec(doc_loop("pipeline"), g)
    checks = g["checks"]
    st = checks.status()
    res = {"findings": [[f.step, f.detector, f.cause, list(f.faulty), f.one_of, f.dropped]
                        for f in checks.findings],
           "skipped": sorted({k.step for k in checks.guard.skipped}), "fired": fired, "mode": checks.mode(),
           "status": [st.steps, st.suspicions, st.dropped]}
    checks.close()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def test_the_docs_pipeline_loop_drops_a_faulty_step_on_every_stage(tmp_path) -> None:
    """docs/compute-checks.md's pipeline loop, extracted and run as written on 6 gloo ranks (pp 2 x dp 3:
    torch's PipelineStage and ScheduleGPipe, FSDP2 over each stage's dp ranks, the pp dim found in the
    mesh): one output element set to 1e4 on rank 4 at step 30 is caught on its step, the pp group [1, 4]
    named (transient: the replay computes it right), the update dropped on all six ranks; nothing else."""
    res = rank_results(_doc_pipeline, 6, tmp_path)
    assert res[4]["fired"] == [DOC_FAULT], res[4]
    for r in res:
        assert r["findings"] == [[DOC_FAULT, "stats", "transient", [1, 4], True, True]], r
        assert r["skipped"] == [DOC_FAULT] and r["mode"] == "exact", r
        assert r["status"] == [DOC_STEPS, 1, 1], r


def _clean_under(schedule_name: str, rank: int, world: int, init: str, out: str) -> None:
    """Clean steps under torch's schedule `schedule_name` on a (pp 2, dp 2) mesh, two stages a rank where the
    schedule takes several; see the test."""
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard

    from checksums.compute_gate import ComputeChecks
    mesh, pp, dp = _pp_ranks(rank, world, init)
    cls = getattr(pipelining, schedule_name)
    looped = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
    stages = 4 if looped else 2
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(stages)]
    mine = [pp + 2 * v for v in range(stages // 2)]
    parts = [fully_shard(layers[i], mesh=mesh["dp"]) for i in mine]
    built = [pipelining.PipelineStage(part, i, stages, torch.device("cpu"), group=mesh["pp"].get_group())
             for part, i in zip(parts, mine)]
    schedule = cls(built if looped else built[0], n_microbatches=4, loss_fn=nn.functional.mse_loss)
    model = nn.ModuleList(parts) if looped else parts[0]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step_fn(mod: nn.Module, batch: tuple) -> None:
        if pp == 0:
            schedule.step(batch[0])
        else:
            schedule.step(target=batch[1])
    checks = ComputeChecks.attach(model, opt, step_fn=step_fn, audit_every=3, warmup=4)
    gen = torch.Generator().manual_seed(dp)
    for _ in range(10):
        batch = (torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen))
        checks.retain(batch)
        step_fn(model, batch)
        opt.step()
        opt.zero_grad()
    st = checks.status()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"mode": checks.mode(), "audits": st.audits, "dropped": st.dropped, "steps": st.steps}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["Schedule1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS"])
def test_torchs_other_schedules_replay_exactly(schedule: str, tmp_path) -> None:
    """torch's 1F1B (torchtitan's default), the interleaved zero-bubble schedule (the weight gradients
    computed apart from the input gradients) and the looped BFS one, on 4 gloo ranks (two virtual stages a
    rank for the multi-stage ones), 4 micro-batches: 10 clean steps, every replay bit for bit the step's
    (`exact`), 3 audits, nothing dropped."""
    for res in rank_results(functools.partial(_clean_under, schedule), 4, tmp_path):
        assert res == {"mode": "exact", "audits": 3, "dropped": 0, "steps": 10}, res
