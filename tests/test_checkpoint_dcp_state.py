"""The whole training state through DCP over the in-memory store (issue 21 item 2): model + AdamW through
`get_state_dict`, an LR scheduler, a loader's plain values (big ints, NaN payloads, -0.0, tuples), BytesIO and
bytes items; saved on 2 gloo ranks, loaded on 1 and on 3 (resharded), bit-exact; nothing unpickled on load;
anything else refused naming the key."""
from __future__ import annotations

import io
import multiprocessing as mp
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.dcp import SdcwStorageReader, SdcwStorageWriter
from ckpt_support import AgentServer, job_id, node
from train_state import W_ROWS, full_state, same, trained, w_full


def _skeleton(seed: int) -> dict:
    """What a restarting job passes to dcp.load: its fresh objects' state dicts (other values, same keys)."""
    return full_state(seed)


def test_whole_train_state_round_trip_in_one_process(redis_server, tmp_path: Path, monkeypatch) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("dcps")
    writer = SdcwStorageWriter(co, job)
    dcp.save(full_state(0), storage_writer=writer, checkpoint_id=5)
    dcp.async_save(full_state(0), storage_writer=writer, checkpoint_id=6).result(60)   # staged copy: the same
    writer.close()
    assert [(i.step, i.state) for i in co.list(job)] == [(5, "COMMITTED"), (6, "COMMITTED")]
    m = co.shard_manifest(job, 5, 0)
    paths = {t.path for t in m.tensors}
    assert len(paths) > 20   # every non-tensor item is a uint8 entry in the blob: checksummed, fingerprinted

    def no_unpickling(*a, **k):
        raise AssertionError("restore unpickled something")

    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: no_unpickling() if not k.get("weights_only") else
                        real_load(*a, **k))
    sd = _skeleton(1)
    dcp.load(sd, storage_reader=SdcwStorageReader(co, job), checkpoint_id=5)
    want = full_state(0)
    same(sd, want)
    assert isinstance(sd["train"]["global_avg_losses"], io.BytesIO)
    sd6 = _skeleton(2)
    dcp.load(sd6, storage_reader=SdcwStorageReader(co, job), checkpoint_id=6)
    same(sd6, want)
    assert type(sd["loader"]["order"]) is tuple and type(sd["loader"]["pos"]) is int
    # and the loaded state drives the objects: a model, AdamW and scheduler set from it continue identically
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, sched = trained(seed=7, steps=1)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    sched.load_state_dict(sd["sched"])
    m0, o0, s0 = trained(seed=0)
    assert sched.get_last_lr() == s0.get_last_lr() and opt.param_groups[0]["lr"] == o0.param_groups[0]["lr"]


def test_refuses_other_objects_naming_the_key(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id("dcpr")
    writer = SdcwStorageWriter(co, job)
    with pytest.raises(CheckpointException, match="not supported") as err:
        dcp.save({"w": torch.ones(2), "cfg": {"lr": 0.1, "hook": object()}}, storage_writer=writer,
                 checkpoint_id=1)
    assert "cfg.hook" in str(err.value) and "state_dict()" in str(err.value)
    with pytest.raises(CheckpointException, match="set"):
        dcp.save({"w": torch.ones(2), "ids": {1, 2}}, storage_writer=writer, checkpoint_id=2)
    assert co.latest(job) is None
    writer.close()


SAVE_WORLD = 2


def _init(rank: int, world: int, init_file: str) -> object:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _save_rank(rank: int, init_file: str, target: str, job: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from checkpoint.agent_link import GrpcAgentLink

    mesh = _init(rank, SAVE_WORLD, init_file)
    sd = full_state(0)   # every rank holds the same (replicated) state: DCP writes each item once
    sd["w"] = distribute_tensor(w_full(), mesh, [Shard(0)])   # and one row-sharded tensor
    writer = SdcwStorageWriter(GrpcAgentLink.connect(target, 20), job)
    dcp.save(sd, storage_writer=writer, checkpoint_id=9)
    writer.close()
    dist.destroy_process_group()


def _load_rank(rank: int, world: int, init_file: str, target: str, job: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from checkpoint.agent_link import GrpcAgentLink

    mesh = _init(rank, world, init_file)
    sd = _skeleton(rank + 1)
    sd["w"] = distribute_tensor(torch.zeros(W_ROWS, 5), mesh, [Shard(0)])
    dcp.load(sd, storage_reader=SdcwStorageReader(GrpcAgentLink.connect(target, 20), job), checkpoint_id=9)
    w = sd.pop("w")
    same(sd, full_state(0))
    rows = W_ROWS // world
    same(w.to_local(), w_full()[rank * rows:(rank + 1) * rows].contiguous())
    dist.destroy_process_group()


def _run(ctx, target, world: int, args) -> None:
    procs = [ctx.Process(target=target, args=(r, *args) if target is _save_rank else (r, world, *args))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        assert [p.exitcode for p in procs] == [0] * world, f"{target.__name__} on {world} ranks failed"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def test_saved_on_two_ranks_loads_on_one_and_on_three(redis_server, tmp_path: Path, short_tmp: Path) -> None:
    from daemon.checkpoint_service import CheckpointService

    co, job = node(redis_server.port, tmp_path, "n0"), job_id("dcpw")
    server = AgentServer(CheckpointService(co), short_tmp / "agent.sock").start()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "grpc", "checkpoint.dcp", "train_state"])
    try:
        _run(ctx, _save_rank, SAVE_WORLD, (str(short_tmp / "init2"), server.target, job))
        info = co.info(job, 9)
        assert (info.state, info.shards, info.world_size) == ("COMMITTED", 2, 2)
        # the plain values were written once, by one rank (DCP's dedup), yet every loader gets them
        sd = _skeleton(5)
        sd["w"] = torch.zeros(W_ROWS, 5)
        dcp.load(sd, storage_reader=SdcwStorageReader(co, job), checkpoint_id=9)
        same(sd.pop("w"), w_full())
        same(sd, full_state(0))
        _run(ctx, _load_rank, 3, (str(short_tmp / "init3"), server.target, job))
        # exported from both shards into one stock DCP directory, read back by DCP's own FileSystemReader
        from checkpoint.dcp_export import export_dcp

        assert export_dcp(co, job, 9, tmp_path / "stock")["step"] == 9
        sd = _skeleton(6)
        sd["w"] = torch.zeros(W_ROWS, 5)
        dcp.load(sd, checkpoint_id=str(tmp_path / "stock"), no_dist=True)
        same(sd.pop("w"), w_full())
        same(sd, full_state(0))
    finally:
        server.stop()


def test_whole_train_state_through_checkpoint_client(redis_server, tmp_path: Path, monkeypatch) -> None:
    """The same state through CheckpointClient.save / restore, plus torch's optimizer state_dict."""
    from checkpoint.client import CheckpointClient
    from checkpoint.snapshot import SnapshotConfig

    co, job = node(redis_server.port, tmp_path, "n0"), job_id("clis")
    model, opt, _ = trained(0)
    sd = full_state(0)
    sd["torch_optim"] = opt.state_dict()
    client = CheckpointClient(co, job, 0, 1, config=SnapshotConfig(chunk_bytes=4096))
    assert client.save(4, sd).result(30).error == ""
    with pytest.raises(Exception, match="state_dict/loader/hook: builtins.function is not supported"):
        client.save(5, {**sd, "loader": {"hook": lambda: 0}})
    m = co.shard_manifest(job, 4, 0)
    assert {"state_dict/loader", "state_dict/train/global_avg_losses", "state_dict/optim/param_groups"} <= \
        {t.path for t in m.tensors}   # values are fingerprinted bytes of the blob, not manifest text
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    back = client.restore(4)
    same(back, sd)
    assert set(back["torch_optim"]["state"]) == {0, 1, 2, 3}
    client.close()


def test_bench_train_state_smoke() -> None:
    import os
    import subprocess
    import sys

    from deadlines import scaled

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "bench/bench_train_state.py", "--smoke"], cwd=root,
                         capture_output=True, text=True, timeout=scaled(120),
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr
    assert "x baseline" in run.stdout and "DCP items" in run.stdout
