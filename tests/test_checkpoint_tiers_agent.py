"""kill -9 of the real agent in the middle of a drain to NVMe, then restart: the drain resumes, no tier ever
lists a partial checkpoint, leftovers are cleaned, and the copy restores bit for bit."""
from __future__ import annotations

import signal
import time
from pathlib import Path


from agent_harness import AgentProcess
from checkpoint.client import CheckpointClient
from checkpoint.shm_store import DirStore
from checkpoint.tier_manifest import scan
from ckpt_support import assert_same, job_id, state_dict
from deadlines import scaled

def _wait(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)


def test_kill_9_mid_drain_then_restart_resumes(redis_server, short_tmp: Path) -> None:
    nvme = short_tmp / "nvme"
    common = ["--redis-url", redis_server.url, "--tiers-nvme-dir", str(nvme), "--tiers-orphan-ttl-s", "0.5",
              "--tiers-interval-s", "0.2"]
    slow = AgentProcess(short_tmp / "state", *common, "--tiers-nvme-bandwidth-mib-s", "2").start()
    job = job_id("kill")
    try:
        client = CheckpointClient.connect(job, 0, 1, target=slow.target)
        sd = state_dict(0, 5, size=1_500_000)                    # ~9 MiB: ~4.5 s at 2 MiB/s
        h = client.save(5, sd)
        assert not h.result(60).error
        client.wait(60)
        client.close()
        # mid-drain: a temp file (or a finished first blob) under the NVMe dir, no manifest yet
        _wait(lambda: nvme.exists() and any(".tmp-" in p.name for p in nvme.rglob("*")))
        assert scan(DirStore(nvme)) == {}                        # nothing listed: no tier commit yet
    finally:
        slow.stop(signal.SIGKILL)
    assert any(".tmp-" in p.name for p in nvme.rglob("*"))        # the killed copy's leftovers
    fast = AgentProcess(short_tmp / "state", *common).start()
    try:
        _wait(lambda: scan(DirStore(nvme), job) != {})
        cat = scan(DirStore(nvme), job)
        assert list(cat) == [(job, 5)] and cat[(job, 5)].complete
        _wait(lambda: not any(".tmp-" in p.name for p in nvme.rglob("*")))
        # restore from NVMe alone: the memory copy removed
        client = CheckpointClient.connect(job, 0, 1, target=fast.target)
        plan = client.link.restore_plan(job, 5, 0)
        mem = [c for c in plan.shards[0].copies if c.tier == "memory"]
        assert mem and [c.tier for c in plan.shards[0].copies][-1] == "nvme"
        (Path(mem[0].location) / plan.shards[0].manifest.blob).unlink()
        from checkpoint.shard_reader import RestoreReport

        rep = RestoreReport()
        assert_same(client.restore(5, report=rep), sd)
        assert rep.source.startswith("nvme@")
        client.close()
    finally:
        fast.stop()
