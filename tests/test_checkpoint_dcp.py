"""torch.distributed.checkpoint over the in-memory store: save/load round trips, async_save, resharding
from 2 gloo ranks (row-sharded DTensors) into one process, plain values (the whole training state:
test_checkpoint_dcp_state.py)."""
from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint.dcp import SdcwStorageReader, SdcwStorageWriter
from checkpoint.errors import InvalidInputError
from ckpt_support import AgentServer, assert_same, job_id, node


def _model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g).to(torch.bfloat16),
            "n": torch.arange(10, dtype=torch.int64)}


def test_dcp_save_and_load_round_trip_single_process(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("dcp")
    writer = SdcwStorageWriter(co, job)
    src = _model_state()
    dcp.save(src, storage_writer=writer, checkpoint_id=3)
    assert [(i.step, i.state) for i in co.list(job)] == [(3, "COMMITTED")]
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    dcp.load(dst, storage_reader=SdcwStorageReader(co, job), checkpoint_id=3)
    assert_same(dst, src)
    # async_save through the same writer; load "latest"
    src2 = _model_state(1)
    dcp.async_save(src2, storage_writer=writer, checkpoint_id=4).result(60)
    dst2 = {k: torch.zeros_like(v) for k, v in src2.items()}
    dcp.load(dst2, storage_reader=SdcwStorageReader(co, job), checkpoint_id="latest")
    assert_same(dst2, src2)
    writer.close()


def test_dcp_plain_values_round_trip_and_bad_ids(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("dcpb")
    writer = SdcwStorageWriter(co, job)
    dcp.save({"w": torch.ones(2), "cfg": {"lr": 0.1, "betas": (0.9, 0.95)}}, storage_writer=writer, checkpoint_id=1)
    dst = {"w": torch.zeros(2), "cfg": {"lr": 0.0, "betas": (0.0, 0.0)}}
    dcp.load(dst, storage_reader=SdcwStorageReader(co, job), checkpoint_id=1)
    assert_same(dst, {"w": torch.ones(2), "cfg": {"lr": 0.1, "betas": (0.9, 0.95)}})
    with pytest.raises(InvalidInputError, match="step"):
        writer.reset("../etc")
    writer.close()


def test_dcp_resave_after_a_restore_is_taken_once_the_writer_is_told(redis_server, tmp_path: Path) -> None:
    """A rollback from step 20 to 10 redoes the steps and saves 20 again. Unless the agent knows of the restore
    it refuses the second 20 ("already COMMITTED": it holds the first, which may hold the fault); the rank's
    step reports tell it too, but asynchronously, and on a loaded machine the save came first (torchtitan's
    flip test, 2 suites beside 2 busy loops: the DCP save raised and the run died). With
    `writer.note_restore(10)` the save's begin carries the restore, the agent cuts the history after 10 first,
    and the new 20 is stored (its bytes, not the old ones)."""
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("dcpr")
    writer = SdcwStorageWriter(co, job)
    for step in (10, 20):
        dcp.save(_model_state(step), storage_writer=writer, checkpoint_id=step)
    with pytest.raises(BaseException) as refused:   # DCP's CheckpointException (a BaseException)
        dcp.save(_model_state(21), storage_writer=writer, checkpoint_id=20)
    assert "already COMMITTED" in str(getattr(refused.value, "failures", refused.value)), refused.value
    with pytest.raises(InvalidInputError, match="step"):
        writer.note_restore(-1)
    reader = SdcwStorageReader(co, job)
    assert reader.loaded_step is None
    dcp.load({k: torch.zeros_like(v) for k, v in _model_state().items()}, storage_reader=reader, checkpoint_id=10)
    writer.note_restore(reader.loaded_step)
    dcp.save(_model_state(21), storage_writer=writer, checkpoint_id=20)
    assert [i.step for i in co.list(job)] == [10, 20]
    dst = {k: torch.zeros_like(v) for k, v in _model_state().items()}
    dcp.load(dst, storage_reader=SdcwStorageReader(co, job), checkpoint_id=20)
    assert_same(dst, _model_state(21))
    writer.close()


WORLD = 2


def _rank(rank: int, init_file: str, target: str, job: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from checkpoint.agent_link import GrpcAgentLink

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    full = _model_state()
    sd = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "n": distribute_tensor(full["n"], mesh, [Shard(0)])}
    writer = SdcwStorageWriter(GrpcAgentLink.connect(target, 20), job)
    dcp.save(sd, storage_writer=writer, checkpoint_id=7)
    writer.close()
    dist.destroy_process_group()


def test_dcp_two_gloo_ranks_then_resharded_load_in_one_process(redis_server, tmp_path: Path, short_tmp: Path) -> None:
    from daemon.checkpoint_service import CheckpointService

    co, job = node(redis_server.port, tmp_path, "n0"), job_id("dcpg")
    server = AgentServer(CheckpointService(co), short_tmp / "agent.sock").start()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "grpc", "checkpoint.dcp", "ckpt_support"])
    procs = [ctx.Process(target=_rank, args=(r, str(short_tmp / "init"), server.target, job)) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * WORLD
        info = co.info(job, 7)
        assert (info.state, info.shards, info.world_size) == ("COMMITTED", WORLD, WORLD)
        # load into plain full tensors in one process: DCP stitches the two row shards together
        full = _model_state()
        dst = {"w": torch.zeros_like(full["w"]), "n": torch.zeros_like(full["n"])}
        dcp.load(dst, storage_reader=SdcwStorageReader(co, job), checkpoint_id=7)
        assert_same(dst, {"w": full["w"], "n": full["n"]})
        # and a different slicing: only rows 2..5 of w, as a narrower target, via a fresh full load
        assert torch.equal(dst["w"][2:6], full["w"][2:6])
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.stop()
