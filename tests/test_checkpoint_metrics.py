"""Checkpoint metrics, GetStatus summaries and the memory-dir lifecycle of the agent's service."""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from prometheus_client import CollectorRegistry

from checkpoint.coordinator_config import CoordinatorConfig
from checkpoint.snapshot import Snapshotter, SnapshotConfig
from ckpt_support import job_id, node, state_dict
from daemon.checkpoint_metrics import CheckpointMetrics
from daemon.checkpoint_service import CheckpointService, build_checkpoint_service


def test_metrics_and_summaries_follow_the_coordinator(redis_server, tmp_path: Path) -> None:
    # a key prefix of its own: maintenance walks every job in the (session-wide) Redis
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=1, key_prefix=f"{job_id('p')}:"), job_id("m")
    reg = CollectorRegistry()
    svc = CheckpointService(co, clock=lambda: 1000.0, metrics=CheckpointMetrics(reg))
    assert svc.summaries() == []
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096))
    for step in (1, 2, 3):
        assert snap.save(step, state_dict(0, step)).result(30).state == "COMMITTED"
        if step == 2:
            co.on_job_event(job, 2, "vote_agreed", 1234.5)
    asyncio.run(svc.maintain_once())
    val = reg.get_sample_value
    assert val("sdcwatch_checkpoint_committed_total") == 3
    assert val("sdcwatch_checkpoint_evictions_total") == 1          # keep 1 + the newest verified
    assert val("sdcwatch_checkpoint_verified_total") == 1
    assert val("sdcwatch_checkpoint_save_blocking_seconds_count") == 3
    assert val("sdcwatch_checkpoint_save_commit_seconds_count") == 3
    assert val("sdcwatch_checkpoint_last_verified_timestamp_seconds", {"job_id": job}) == 1234.5
    assert val("sdcwatch_checkpoint_latest_verified_step", {"job_id": job}) == 2
    assert val("sdcwatch_checkpoint_latest_step", {"job_id": job}) == 3
    assert val("sdcwatch_checkpoint_memory_bytes") > 0
    (summary,) = [s for s in svc.summaries() if s.job_id == job]
    assert (summary.count, summary.latest_step, summary.latest_verified_step) == (2, 3, 2)
    # counters never go backwards, and a second update with no news changes nothing
    asyncio.run(svc.maintain_once())
    assert val("sdcwatch_checkpoint_committed_total") == 3
    assert val("sdcwatch_checkpoint_save_blocking_seconds_count") == 3
    # a restore reported by a rank (with a bad chunk read from another copy) is counted
    from checkpoint.client import CheckpointClient

    client = CheckpointClient(co, job, 0, 1)
    client.restore(3)
    client.close()
    snap.close()
    asyncio.run(svc.maintain_once())
    assert val("sdcwatch_checkpoint_restores_total") == 1
    assert val("sdcwatch_checkpoint_restore_seconds_count") == 1


def test_own_index_removes_only_unindexed_job_dirs_and_close_keeps_the_memory_dir(redis_server,
                                                                                   tmp_path: Path) -> None:
    """With the agent's own (embedded, persistent) index, `open()` removes job dirs the index never heard
    of (bytes nothing can restore) and keeps the indexed ones; `close()` keeps everything (issue 21: the
    memory tier survives the agent)."""
    mem = tmp_path / "memory"
    (mem / "old-job" / "000000000001").mkdir(parents=True)
    (mem / "old-job" / "000000000001" / "rank-00000.bin").write_bytes(b"orphan")  # indexed by nothing
    svc = build_checkpoint_service(redis_server.url, tmp_path / "state", memory_dir=mem, own_index=True,
                                   config=CoordinatorConfig(key_prefix=f"own-{uuid.uuid4().hex[:6]}:"))
    svc.coordinator.redis.sadd(svc.coordinator.config.key_prefix + "jobs", "kept-job")
    (mem / "kept-job").mkdir()
    (mem / "kept-job" / "blob").write_bytes(b"indexed")
    assert (mem / "old-job").is_dir(), "nothing removed before open(): the agent may not hold the state dir yet"
    asyncio.run(svc.open())
    assert not (mem / "old-job").exists() and (mem / "kept-job" / "blob").read_bytes() == b"indexed"
    asyncio.run(svc.close())
    assert (mem / "kept-job" / "blob").read_bytes() == b"indexed"


def test_external_redis_keeps_the_bytes(redis_server, tmp_path: Path) -> None:
    mem = tmp_path / "memory"
    (mem / "job").mkdir(parents=True)
    (mem / "job" / "blob").write_bytes(b"indexed")
    svc = build_checkpoint_service(redis_server.url, tmp_path / "state", memory_dir=mem)
    asyncio.run(svc.close())
    assert (mem / "job" / "blob").read_bytes() == b"indexed"


def test_a_memory_dir_on_a_disk_filesystem_is_named_at_start(redis_server, tmp_path: Path, monkeypatch,
                                                              caplog) -> None:
    """The agent says at start when its memory dir is not on tmpfs (a `memory_base` set to a disk, or /dev/shm
    missing): the memory tier then writes to that disk and the GPU cannot pin the ranks' staging slots there.
    Said once per start, naming the dir, its filesystem and the setting; nothing on tmpfs."""
    import checkpoint.shm_store as shm_store_mod
    kinds = {"disk": "xfs", "shm": "tmpfs"}
    monkeypatch.setattr(shm_store_mod, "filesystem_type", lambda p: kinds[Path(p).parent.name])
    for where in ("disk", "shm"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="daemon.checkpoint_service"):
            svc = build_checkpoint_service(redis_server.url, tmp_path / where / "state",
                                           memory_dir=tmp_path / where / "memory")
            asyncio.run(svc.close())
        said = [r.getMessage() for r in caplog.records if "memory dir" in r.getMessage()]
        if where == "disk":
            assert len(said) == 1 and str(tmp_path / "disk" / "memory") in said[0], said
            assert "on xfs, not tmpfs" in said[0] and "memory_base" in said[0]
        else:
            assert said == []


def test_exposition_passes_promtool_in_every_state_without_created_series(redis_server, tmp_path: Path) -> None:
    """The agent's registry as it is exported: empty, with a GPU, an event, an alert and checkpoints
    (sdcwatch_checkpoints, not `_count`: promtool reserves that suffix), each checked by
    `promtool check metrics`; no `_created` series; the GPU info carries the node's hostname (the recording
    rules turn it and the GPU's labels into dcgm-exporter's, tests in deploy/prometheus)."""
    import shutil
    import subprocess

    from prometheus_client import generate_latest

    from daemon.alerts import AlertMetrics
    from daemon.gpu_metrics import GpuMetrics
    from daemon.jobs import JobTracker
    from daemon.metrics import AgentMetrics
    from probes.nvml_backend import GpuIdentity
    from probes.nvml_rules import RuleConfig, make_readings
    from sdcwatch.types import State

    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed (Debian package 'prometheus'; bash scripts/setup.sh --test)"
    agent = AgentMetrics(jobs=JobTracker())
    reg = agent.registry

    def check(state: str) -> str:
        text = generate_latest(reg).decode()
        out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{state}: {out.stdout}{out.stderr}"
        assert "_created" not in text, state
        return text

    check("empty")
    gpus = GpuMetrics(reg, hostname="node-7")
    AlertMetrics(reg)
    ident = GpuIdentity("GPU-a", "00000000:19:00.0", "NVIDIA H200", 3, "123", "550.90.07")
    gpus.update(ident, make_readings("GPU-a", None, {"temp.gpu": 71, "ecc.corrected.volatile.total": 2},
                                     frozenset(), {}, 0, RuleConfig()), State.FAILED)
    gpus.observe_xid(ident, 79)
    assert reg.get_sample_value("sdcwatch_gpu_info", {
        "uuid": "GPU-a", "pci_bus_id": "00000000:19:00.0", "model": "NVIDIA H200", "index": "3", "serial": "123",
        "driver_version": "550.90.07", "hostname": "node-7"}) == 1
    check("a GPU")
    co, job = node(redis_server.port, tmp_path, "n0", key_prefix=f"{job_id('p')}:"), job_id("m")
    svc = CheckpointService(co, clock=lambda: 1000.0, metrics=CheckpointMetrics(reg))
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096))
    assert snap.save(1, state_dict(0, 1)).result(30).state == "COMMITTED"
    snap.close()
    asyncio.run(svc.maintain_once())
    text = check("a checkpoint")
    assert f'sdcwatch_checkpoints{{job_id="{job}"}} 1.0' in text
