"""Issue 18: 500 clean steps on two gloo replicas with a save every 50 -> every checkpoint VERIFIED, each
vouched for by the bytes both replicas saved (compared by the coordinator), the vote fed as the agent does."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import rank_spawn
from torch import nn

from ckpt_support import job_id, node
from support import RecordingReporter

WORLD, STEPS, EVERY = 2, 500, 50


def _worker(rank: int, store: str, outdir: str, redis_port: int, job: str) -> None:
    from checkpoint.client import CheckpointClient
    from checkpoint.snapshot import SnapshotConfig
    from checksums.monitor import Monitor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        reporter = RecordingReporter()
        monitor = Monitor.attach(ddp, opt, job_id=job, reporter=reporter)
        co = node(redis_port, Path(outdir), f"n{rank}", keep_committed=STEPS // EVERY + 1)
        ckpt = CheckpointClient(co, job, rank, WORLD, config=SnapshotConfig(chunk_bytes=4096), guard=monitor.guard)
        gen = torch.Generator().manual_seed(7 + rank)
        for _ in range(STEPS):
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
            loss = ((ddp(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            monitor.step(loss.detach())
            step = monitor.step_count
            if step % EVERY == 0:
                res = ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}).result(60)
                assert res.error == "", res.error
        monitor.close()
        dist.barrier()                       # every shard is in
        if rank == 0:                        # the agent's part: each vote to the coordinator, in order
            for r in reporter.requests:
                if r.vote.checked:
                    co.on_job_event(job, r.vote.step, "vote_agreed" if r.vote.agreed else "vote_mismatch",
                                    time.time())
            out = {"checkpoints": [(i.step, i.state, i.vouched_by) for i in co.list(job)]}
        ckpt.close()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def test_500_clean_steps_every_checkpoint_verified_by_its_bytes(redis_server, tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    job = job_id("clean500")
    rank_spawn.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path), redis_server.port, job),
                     nprocs=WORLD)
    got = json.loads((tmp_path / "rank0.json").read_text())["checkpoints"]
    assert [c[0] for c in got] == list(range(EVERY, STEPS + 1, EVERY))
    assert all(c[1] == "VERIFIED" for c in got), got
    assert all(c[2].startswith("bytes agreed: replica set 'world' (ranks 0,1)") for c in got), got
