"""Four real ranks (gloo on CPU) against the agent's gRPC service: save, commit, restore bit for bit; a rank
killed mid-save leaves no commit, the previous checkpoint restores, and GC removes the partial blobs."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import torch

from ckpt_support import AgentServer, assert_same, job_id, node, state_dict

WORLD = 4
DIED = 17


def _worker(rank: int, init_file: str, target: str, job: str) -> None:
    import torch.distributed as dist

    from checkpoint.client import CheckpointClient
    from checkpoint.shm_store import DirStore
    from checkpoint.snapshot import SnapshotConfig

    class DyingStore(DirStore):
        """Failure injection: the process dies with its shard copied into its staging slot (node memory)
        but not yet published as the shard's blob, or after the first chunk of a streamed write."""

        def link_in(self, key, src):
            os._exit(DIED)

        def put(self, key, data):
            def first_then_die():
                for piece in data:
                    yield piece
                    os._exit(DIED)
            return super().put(key, first_then_die())

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    client = CheckpointClient.connect(job, rank, WORLD, target=target, deadline_s=20,
                                      config=SnapshotConfig(chunk_bytes=4096))
    for step in (1, 2):
        res = client.save(step, state_dict(rank, step)).result(60)
        assert res.error == "", res.error
    dist.barrier()
    same = 1
    try:
        assert_same(client.restore("latest"), state_dict(rank, 2))
    except AssertionError:
        same = 0
    flag = torch.tensor([same])
    dist.all_reduce(flag)
    assert flag.item() == WORLD, "a rank restored different bytes"
    dist.barrier()
    if rank == WORLD - 1:
        client.snapshotter._store_for = lambda loc: DyingStore(loc, create=False)
    res = client.save(3, state_dict(rank, 3)).result(60)
    assert res.state == "PENDING", res
    client.close()


def test_four_ranks_save_commit_restore_and_a_rank_killed_mid_save(redis_server, tmp_path: Path, short_tmp: Path) -> None:
    from daemon.checkpoint_service import CheckpointService

    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=3, pending_timeout_s=60), job_id("gloo")
    server = AgentServer(CheckpointService(co), short_tmp / "agent.sock").start()
    # forkserver: torch is imported once in the server, then each rank forks from it (spawn would import
    # torch four times over; plain fork is unsafe with this process's gRPC threads).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "grpc", "checkpoint.client", "ckpt_support"])
    procs = [ctx.Process(target=_worker, args=(r, str(short_tmp / "init"), server.target, job)) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(150)
        assert [p.exitcode for p in procs] == [0] * (WORLD - 1) + [DIED]
        assert [(i.step, i.state) for i in co.list(job)] == [(1, "COMMITTED"), (2, "COMMITTED"), (3, "PENDING")]
        assert co.info(job, 3).shards == WORLD - 1
        assert co.latest(job).step == 2
        from checkpoint.restore import restore_from_plan
        from checkpoint.locations import dir_store_for

        plan = co.restore_plan(job, "latest")
        for r in range(WORLD):
            assert_same(restore_from_plan(plan, r, dir_store_for), state_dict(r, 2))
        step3 = Path(co.location) / job / f"{3:012d}"
        assert len(list(step3.iterdir())) == WORLD - 1            # the dead rank never published its shard
        slots = Path(co.location) / ".slots" / job
        dead = list(slots.glob(f"rank-{WORLD - 1:05d}-*.slot"))
        assert dead                                                # ... its bytes sat in its staging slot
        assert co.maintain(time.time() + 120)[job] == [3]
        assert not step3.exists()
        assert not any(p.exists() for p in dead)                  # the dead rank's slots are swept
        assert co.stats["slots_swept"] >= len(dead)
        assert co.latest(job).step == 2
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        server.stop()
