"""Issue 18 item 2 on three gloo ranks: a bit flipped in one replica's weights after an update is caught by
the vote, the next update is vetoed on every replica (the vote's GATE stage), the odd replica is repaired in
place from a majority replica (REPAIR stage: broadcast, then every replica's fingerprint compared), and
training goes on. At the end every replica is bit-identical to a clean run that skipped the same batch."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import rank_spawn
from torch import nn

from support import RecordingReporter, count_host_syncs, recovery_outcome

WORLD, STEPS, FLIP_STEP = 3, 12, 5


def _batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + index)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _run(rank: int, batches: list[int], flip: bool, recover: bool, world: int = WORLD) -> dict[str, Any]:
    from checksums.monitor import Monitor
    from checksums.replica_recovery import ReplicaRecovery

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    monitor = Monitor.attach(ddp, opt, job_id="repair", reporter=RecordingReporter(), host=f"host{rank}")
    recovery = ReplicaRecovery.attach(monitor) if recover else None
    for index in batches:
        x, y = _batch(rank, index)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if flip and index == FLIP_STEP and rank == world - 1:
            with torch.no_grad():
                model[0].weight.view(torch.int32).view(-1)[3] ^= 1 << 20
        monitor.step(loss.detach())
    state = [p.detach().clone() for p in model.parameters()]
    state += [v.clone() for p in model.parameters() for _, v in sorted(opt.state[p].items())]
    return recovery_outcome(monitor, recovery, [t.view(-1).view(torch.uint8).tolist() if t.dtype != torch.float32
                                                else t.view(torch.int32).view(-1).tolist() for t in state])


def _worker(rank: int, store: str, outdir: str, world: int = WORLD) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        if world == 2:
            out = _run(rank, list(range(1, STEPS + 1)), flip=True, recover=True, world=2)
            Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
            return
        faulty = _run(rank, list(range(1, STEPS + 1)), flip=True, recover=True)
        skipped = set(faulty["skipped"])
        clean = _run(rank, [i for i in range(1, STEPS + 1) if i not in skipped], flip=False, recover=False)
        Path(outdir, f"rank{rank}.json").write_text(json.dumps({"faulty": faulty, "clean": clean}))
    finally:
        dist.destroy_process_group()


def test_three_replicas_repair_in_place_and_match_a_clean_run_that_skipped_the_batch(tmp_path: Path) -> None:
    rank_spawn.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in res:
        f = r["faulty"]
        assert f["skipped"] == [FLIP_STEP + 1], "the update after the flip is vetoed on every replica"
        assert f["repairs"] == [[FLIP_STEP, FLIP_STEP + 1, 0, True]], "repaired from rank 0, checked after"
        assert f["mismatches"] == 1, "one disagreeing vote: after the repair the replicas agree again"
        assert f["step"] == STEPS, "training went on; the vetoed step kept its number"
        assert f["state"] == r["clean"]["state"], "bit-identical to a clean run that skipped that batch"
    assert res[0]["faulty"]["state"] == res[WORLD - 1]["faulty"]["state"]


def test_two_replicas_hold_every_update_until_the_rollback(tmp_path: Path) -> None:
    """No majority: nothing is repaired; the gate vetoes every update while the replicas differ (the agent's
    rollback directive, tested in test_jobs.py, brings them back), so no update mixes the odd replica in."""
    rank_spawn.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path), 2), nprocs=2)
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["skipped"] == list(range(FLIP_STEP + 1, STEPS + 1))
        assert res["repairs"] and not any(ok for *_, ok in res["repairs"])
        assert res["repairs"][0][:3] == [FLIP_STEP, FLIP_STEP + 1, -1]


# -- HSDP: 3 replicas x 2 shards (6 ranks); the vote runs per shard's replica group -------------------------
HSDP_WORLD, HSDP_SHARDS, LAG = 6, 2, 4


def _run_hsdp(rank: int, batches: list[int], flip: bool, recover: bool, mask: str,
              tp: bool = False) -> dict[str, Any]:
    """The same MLP under HSDP (replicate over mesh dim 0, shard over dim 1: replica groups 0,2,4 and 1,3,5),
    Adam; with `flip` a bit of rank 5's shard (replica 2, shard 1) is flipped after update FLIP_STEP. `mask`
    "device": fused Adam, the vote's verdict masks the update through found_inf, the host settles LAG calls
    later (as on CUDA). `tp`: HSDP with tensor parallelism (torchtitan's layout: a (replicate 3, shard 1,
    tp 2) mesh, the first layer split by columns and the second by rows over tp, FSDP2 over the first two
    dims): the replica groups are the same ranks (the tp lanes), rank 5 holds replica 2's tp shard 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from checksums.monitor import Monitor
    from checksums.replica_recovery import ReplicaRecovery

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if tp:
        full = init_device_mesh("cpu", (HSDP_WORLD // HSDP_SHARDS, 1, HSDP_SHARDS),
                                mesh_dim_names=("replicate", "shard", "tp"))
        parallelize_module(model, full["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = full["replicate", "shard"]
    else:
        mesh = init_device_mesh("cpu", (HSDP_WORLD // HSDP_SHARDS, HSDP_SHARDS),
                                mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=mask == "device")
    monitor = Monitor.attach(model, opt, job_id="repair-hsdp", reporter=RecordingReporter(), host=f"host{rank}")
    recovery = (ReplicaRecovery.attach(monitor, mask=mask, settle_lag=LAG if mask == "device" else None)
                if recover else None)
    syncs: list[str] = []
    if recovery is not None and mask == "device":     # the device gate, all_reduce included, never waits
        gate_run = recovery.gate.run

        def counted(ctx: Any) -> Any:
            with count_host_syncs(monitor, syncs):
                return gate_run(ctx)
        recovery.gate.run = counted  # type: ignore[method-assign]
    for index in batches:
        x, y = _batch(rank, index)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if flip and index == FLIP_STEP and rank == HSDP_WORLD - 1:
            with torch.no_grad():
                model[0].weight.to_local().view(torch.int32).view(-1)[3] ^= 1 << 20
        monitor.step(loss.detach())
    local = [p.detach().to_local().clone() for p in model.parameters()]
    local += [(v.to_local() if hasattr(v, "to_local") else v).clone()
              for p in model.parameters() for _, v in sorted(opt.state[p].items())]
    return recovery_outcome(monitor, recovery, [t.reshape(-1).view(torch.uint8).tolist() for t in local],
                            group=monitor.replica_group_name, syncs=sorted(set(syncs)))


def _hsdp_worker(rank: int, store: str, outdir: str, mask: str, tp: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=HSDP_WORLD)
    torch.set_num_threads(1)
    try:
        faulty = _run_hsdp(rank, list(range(1, STEPS + 1)), flip=True, recover=True, mask=mask, tp=tp)
        skipped = set(faulty["skipped"])
        clean = _run_hsdp(rank, [i for i in range(1, STEPS + 1) if i not in skipped], flip=False, recover=False,
                          mask=mask, tp=tp)
        Path(outdir, f"rank{rank}.json").write_text(json.dumps({"faulty": faulty, "clean": clean}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mask,tp", [("host", False), ("device", False), ("host", True), ("device", True)])
def test_hsdp_repairs_the_odd_shard_in_place_and_every_shard_skips_the_same_update(tmp_path: Path, mask: str,
                                                                                   tp: bool):
    """Under HSDP a parameter is a DTensor (this rank's shard): the repair copies the shards over the replica
    group (c10d has no DTensor collectives: the copy raised NotImplementedError, so nothing was repaired and
    the replicas stayed apart). The update after the flip is skipped on every rank, the shards whose replicas
    agreed too (a model whose shards applied different steps is no clean run's), and the result is
    bit-identical, shard for shard, to a clean run that skipped that batch. On the device (found_inf, no host
    wait) the flag of every group is combined (an all_reduce MAX over the shard group) before it masks, and
    each rank records the updates it masked once the host reads them; the repair waits until every replica
    has read the vote (LAG calls), so updates FLIP_STEP+1 .. FLIP_STEP+LAG+1 are masked everywhere. With
    tensor parallelism (`tp`: torchtitan's HSDP + TP layout) the tp lanes vote apart and step together alike
    (their flags combined over the tp group), first run 2026-12-07."""
    rank_spawn.spawn(_hsdp_worker, args=(str(tmp_path / "store"), str(tmp_path), mask, tp), nprocs=HSDP_WORLD)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(HSDP_WORLD)]
    assert [r["faulty"]["group"] for r in res] == ["ranks:0,2,4", "ranks:1,3,5"] * 3
    lag = LAG if mask == "device" else 0
    for rank, r in enumerate(res):
        f = r["faulty"]
        assert f["errors"] == 0, rank
        assert f["syncs"] == [], f"rank {rank}: the device gate synchronised with the host: {f['syncs']}"
        assert f["skipped"] == list(range(FLIP_STEP + 1, FLIP_STEP + lag + 2)), (rank, f["skipped"])
        if rank % HSDP_SHARDS == 1:     # the flipped shard's replica group: repaired from rank 1
            assert f["repairs"] == [[FLIP_STEP, FLIP_STEP + lag + 1, 1, True]], (rank, f["repairs"])
            assert f["mismatches"] == lag + 1
        else:
            assert f["repairs"] == [] and f["mismatches"] == 0, (rank, f)
        assert f["step"] == STEPS
        assert f["state"] == r["clean"]["state"], f"rank {rank}: not the clean run that skipped the batch"
    # every rank noted the repair at the same step (a compute check in flight is then replayed nowhere: its
    # replays are collective), the ranks of the shard whose replicas agreed too
    assert len({r["faulty"]["rewrites"] for r in res}) == 1 and res[0]["faulty"]["rewrites"] >= 1, \
        [r["faulty"]["rewrites"] for r in res]
    for shard in range(HSDP_SHARDS):
        states = [res[r]["faulty"]["state"] for r in range(shard, HSDP_WORLD, HSDP_SHARDS)]
        assert all(s == states[0] for s in states), f"shard {shard}: the replicas differ at the end"


def _partial_worker(rank: int, store: str, outdir: str, layout: str) -> None:
    """ReplicaRecovery attached on every rank but one (rank 4 of an HSDP 3x2 mesh, or rank 2 of 3 DDP
    replicas), a flip on one replica after update FLIP_STEP; see the test."""
    from checksums.monitor import Monitor
    from checksums.replica_recovery import ReplicaRecovery

    world = HSDP_WORLD if layout == "hsdp" else WORLD
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        if layout == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (HSDP_WORLD // HSDP_SHARDS, HSDP_SHARDS),
                                    mesh_dim_names=("replicate", "shard"))
            wrapped = fully_shard(model, mesh=mesh)
            without, flipped = 4, HSDP_WORLD - 1
        else:
            wrapped = nn.parallel.DistributedDataParallel(model)
            without, flipped = WORLD - 1, 1
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        monitor = Monitor.attach(wrapped, opt, job_id="partial", reporter=RecordingReporter(), host=f"host{rank}")
        late = layout == "late" and rank == without      # attaches after the others gave up waiting for it
        recovery = None if rank == without else ReplicaRecovery.attach(monitor, attach_wait_s=1.0)
        for index in range(1, STEPS + 1):
            if late and index == 2:
                time.sleep(3.0)
                recovery = ReplicaRecovery.attach(monitor, attach_wait_s=1.0)
            x, y = _batch(rank, index)
            loss = ((wrapped(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if index == FLIP_STEP and rank == flipped:
                with torch.no_grad():
                    w = model[0].weight
                    (w.to_local() if hasattr(w, "to_local") else w).view(torch.int32).view(-1)[3] ^= 1 << 20
            monitor.step(loss.detach())
        out = {"steps": monitor.guard.step, "recovery": recovery is not None}
        if recovery is not None:
            out.update(attached=recovery._all_attached, repairs=[(r.ok, r.reason) for r in recovery.repairs],
                       vetoed=recovery.vetoed)
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["hsdp", "ddp", "late"])
def test_a_rank_without_replica_recovery_makes_the_others_drop_its_collectives_not_wait(tmp_path: Path,
                                                                                        layout: str):
    """ReplicaRecovery's combined flag (HSDP) and its repair are collectives of the mesh or the replica
    group, so every rank attaches it. A job that attached it on all ranks but one waited for ever: under HSDP
    in the first step's combined flag, under DDP in the repair's copy after a flip. Now the ranks count
    themselves in the store at attach and the first gate waits for all of them (1 s here): one missing, each
    rank that has it says so and drops those collectives (its group's own gate still holds back the
    flipped replica's updates), and the job runs to its end. `late`: the third DDP rank attaches it only
    after the others stopped waiting; it finds every rank counted, but takes the first decision, kept in
    the store, so it too leaves the repair's copy out (deciding alone, it would wait in it for ever)."""
    rank_spawn.spawn(_partial_worker, args=(str(tmp_path / "store"), str(tmp_path), layout),
                     nprocs=HSDP_WORLD if layout == "hsdp" else WORLD)
    world = HSDP_WORLD if layout == "hsdp" else WORLD
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["steps"] == STEPS for r in res), res
    with_it = [r for r in res if r["recovery"]]
    assert len(with_it) == (world if layout == "late" else world - 1)
    assert all(r["attached"] is False for r in with_it), res
    # the flipped replica's group vetoed and did not repair (a repair's copy would wait on the missing rank)
    tried = [r for r in with_it if r["repairs"]]
    assert tried and all(r["vetoed"] >= 1 for r in tried), res
    assert all(ok is False and f"of the {world} ranks" in why for r in tried for ok, why in r["repairs"]), tried
