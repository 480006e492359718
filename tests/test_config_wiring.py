"""Each config section the operator can now set reaches the component that uses it: a value given in the
file, the environment or a flag changes what the real agent does ([checkpoints], [loss], [rollback],
[tiers.*])."""
from __future__ import annotations

import json
import math
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import grpc

from agent_harness import AgentProcess, cli
from checkpoint.client import CheckpointClient
from checkpoint.shm_store import default_shm_root
from checkpoint.snapshot import SnapshotConfig
from ckpt_support import job_id, state_dict
from daemon import config, drain_wiring
from probes.loss_detector import LossDetector
from proto.sdcwatch.v1 import agent_pb2 as apb
from proto.sdcwatch.v1 import agent_pb2_grpc as apb_grpc
from deadlines import scaled

WAIT_S = 60.0   # a generous bound on a loaded machine; every wait returns as soon as its condition holds


def _wait_for(pred: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + scaled(WAIT_S)
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {WAIT_S}s")


def _agent(short_tmp: Path, *extra: str, env: dict[str, str] | None = None) -> AgentProcess:
    return AgentProcess(short_tmp / f"s-{uuid.uuid4().hex[:6]}", *extra, env=env)


def _report(job: str, step: int, loss: float, world: int = 1, **kw: Any) -> apb.ReportStepRequest:
    return apb.ReportStepRequest(job_id=job, rank=0, world_size=world, step=step, loss=loss, time=time.time(), **kw)


def test_checkpoints_section_sets_retention(short_tmp: Path) -> None:
    """`[checkpoints] keep_committed = 1` in the file: only the newest checkpoint stays in memory (the
    default keeps two)."""
    path = short_tmp / "agent.toml"
    path.write_text("[checkpoints]\nkeep_committed = 1\nrollback_span_steps = 0\n[tiers]\nenabled = false\n")
    agent = _agent(short_tmp, "--config", str(path))
    memory = default_shm_root(agent.state_dir)
    job = job_id("keep1")
    try:
        with agent:
            client = CheckpointClient.connect(job, 0, 1, target=agent.target, deadline_s=10,
                                              config=SnapshotConfig(chunk_bytes=4096))
            try:
                for step in (1, 2, 3):
                    assert client.save(step, state_dict(0, step)).result(WAIT_S).error == ""
                _wait_for(lambda: [i.step for i in client.list()] == [3], "retention to one checkpoint")
            finally:
                client.close()
    finally:
        shutil.rmtree(memory.parent, ignore_errors=True)


def test_checkpoints_memory_base_holds_the_memory_tier(short_tmp: Path) -> None:
    """`--checkpoints-memory-base DIR` (a dedicated tmpfs, say): the agent's memory dir is
    DIR/<namespace>/memory, a saved checkpoint's bytes land there and nothing under the default base; the
    client stages and restores through it. A relative path is refused with exit 2 and a message."""
    base = short_tmp / "mem-base"
    agent = _agent(short_tmp, "--checkpoints-memory-base", str(base), "--no-tiers-enabled")
    memory = default_shm_root(agent.state_dir, base)
    job = job_id("membase")
    try:
        with agent:
            client = CheckpointClient.connect(job, 0, 1, target=agent.target, deadline_s=10,
                                              config=SnapshotConfig(chunk_bytes=4096))
            try:
                assert client.save(7, state_dict(0, 7)).result(WAIT_S).error == ""
                restored = client.restore(7)
                assert restored is not None
            finally:
                client.close()
            held = [p for p in memory.rglob("*") if p.is_file() and p.stat().st_size]
            assert held, f"the checkpoint's bytes are under {memory}"
            assert not default_shm_root(agent.state_dir).exists(), "nothing under the default memory base"
    finally:
        shutil.rmtree(base, ignore_errors=True)
    bad = cli("run", "--state-dir", str(short_tmp / "s-rel"), "--checkpoints-memory-base", "rel/mem")
    assert bad.returncode == 2 and "memory_base" in bad.stderr and "absolute" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def _tier_files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()] if d.exists() else []


def test_tiers_nested_tables_reach_the_drainer(short_tmp: Path) -> None:
    """`[tiers.nvme] dir` from a nested table: the agent's NVMe tier is that directory, and copies land in it."""
    nvme = short_tmp / "nvme-tier"
    path = short_tmp / "agent.toml"
    path.write_text(f"[tiers]\ninterval_s = 0.2\n[tiers.nvme]\ndir = '{nvme}'\nevery_n = 1\nkeep = 2\n")
    agent = _agent(short_tmp, "--config", str(path))
    memory = default_shm_root(agent.state_dir)
    job = job_id("nvme")
    try:
        with agent:
            out = cli("ckpt", "tiers", "--json", "--socket", str(agent.socket))
            assert out.returncode == 0, out.stderr
            tiers = json.loads(out.stdout)["tiers"]
            assert [(t["tier"], t["location"]) for t in tiers] == [("nvme", str(nvme))]
            client = CheckpointClient.connect(job, 0, 1, target=agent.target, deadline_s=10,
                                              config=SnapshotConfig(chunk_bytes=4096))
            try:
                assert client.save(1, state_dict(0, 1)).result(WAIT_S).error == ""
                _wait_for(lambda: _tier_files(nvme), "a copy on the configured NVMe tier")
            finally:
                client.close()
    finally:
        shutil.rmtree(memory.parent, ignore_errors=True)


def test_tier_tables_map_to_tiers_key_by_key(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"""
[tiers]
hop_timeout_s = 77.0
[tiers.nvme]
dir = "{tmp_path / 'n'}"
every_n = 3
every_s = 11.0
keep = 4
keep_every_steps = 100
keep_age_s = 60.0
concurrency = 5
bandwidth_mib_s = 2.5
max_backlog_mib = 7
fsync = false
[tiers.flash]
dir = "{tmp_path / 'f'}"
keep = 9
[tiers.s3]
url = "s3://bucket/pre?endpoint_url=http://127.0.0.1:9&region=us-east-1"
every_n = 2
concurrency = 6
part_mib = 8
max_attempts = 3
verify = "readback"
""")
    import argparse

    p = argparse.ArgumentParser()
    config.add_flags(p)
    cfg = config.build(p.parse_args(["--config", str(path), "--state-dir", str(tmp_path / "s")]), {})
    nvme, flash, s3 = drain_wiring.build_tiers(cfg.tiers, cfg.agent.state_dir)
    assert (nvme.name, nvme.location, nvme.concurrency, nvme.bandwidth_bytes_s, nvme.hop_timeout_s) == (
        "nvme", str(tmp_path / "n"), 5, 2.5 * (1 << 20), 77.0)
    assert nvme.store.fsync is False and flash.store.fsync is True
    r = nvme.rule
    assert (r.every_n, r.every_s, r.keep_newest, r.keep_every_steps, r.keep_age_s, r.max_backlog_bytes) == (
        3, 11.0, 4, 100, 60.0, 7 << 20)
    assert (flash.location, flash.rule.keep_newest, flash.rule.every_n, flash.shared) == (
        str(tmp_path / "f"), 9, 5, True)
    assert (s3.rule.every_n, s3.rule.every_s, s3.verify, s3.concurrency) == (2, 1800.0, "readback", 3)
    assert (s3.store.part_bytes, s3.store.concurrency, s3.store.retry_policy.max_attempts) == (8 << 20, 6, 3)


def _bumped_losses() -> list[float]:
    """40 quiet steps around 2.0, then two steps 10% up (a spike under 2x is reported when the next sample
    confirms it): a spike for spike_ratio 1.05, not for 1.2."""
    return [2.0 * (1 + 0.001 * math.sin(i)) for i in range(40)] + [2.2, 2.2]


def test_loss_section_from_the_environment_changes_detection(short_tmp: Path) -> None:
    losses = _bumped_losses()
    default = LossDetector()
    assert not [e for i, x in enumerate(losses) for e in default.update(i + 1, x, None, 0.0) if e.kind == "spike"]
    env = {"SDCWATCH_LOSS_SPIKE_RATIO": "1.05"}
    job = job_id("spike")
    with _agent(short_tmp, env=env) as agent, grpc.insecure_channel(agent.target) as ch:
        stub = apb_grpc.AgentStub(ch)
        for i, x in enumerate(losses):
            assert stub.ReportStep(_report(job, i + 1, x), timeout=10).accepted
        stub.ReportStep(_report(job, len(losses) + 1, 2.0), timeout=10)   # completes the spike's step

        def spikes() -> list[apb.Event]:
            evs = stub.WatchEvents(apb.WatchEventsRequest(since_seq=0, follow=False), timeout=10)
            return [e for e in evs if e.kind == "loss.spike" and e.subject == f"job/{job}"]

        assert len(_wait_for(spikes, "a loss.spike event")) == 1


def test_rollback_section_from_a_flag_shapes_the_directive(short_tmp: Path) -> None:
    """`--rollback-skip-batches 7 --rollback-skip-before-steps 3`: a NaN loss at step 10 after a VERIFIED
    step 1 asks to restore step 1 and skip 12 batches, through step 13 (the defaults: 199, through step 200)."""
    agent = _agent(short_tmp, "--rollback-skip-batches", "7", "--rollback-skip-before-steps", "3")
    memory = default_shm_root(agent.state_dir)
    job = job_id("rb")
    try:
        with agent, grpc.insecure_channel(agent.target) as ch:
            stub = apb_grpc.AgentStub(ch)
            client = CheckpointClient.connect(job, 0, 1, target=agent.target, deadline_s=10,
                                              config=SnapshotConfig(chunk_bytes=4096))
            try:
                assert client.save(1, state_dict(0, 1)).result(WAIT_S).error == ""
                vote = apb.ReplicaVote(checked=True, agreed=True, replicas=2, step=1, method="majority")
                stub.ReportStep(_report(job, 2, 2.0, world=2, vote=vote), timeout=10)
                _wait_for(lambda: [i.state for i in client.list()] == ["VERIFIED"], "step 1 VERIFIED")
            finally:
                client.close()
            for step in range(3, 10):
                stub.ReportStep(_report(job, step, 2.0), timeout=10)
            stub.ReportStep(_report(job, 10, math.nan), timeout=10)
            step = [10]

            def directive() -> list[apb.Directive]:
                step[0] += 1
                return list(stub.ReportStep(_report(job, step[0], 2.0), timeout=10).directives)

            (d,) = _wait_for(directive, "a rollback directive")
            assert (d.kind, d.target_step, d.skip_batches) == (apb.Directive.KIND_ROLLBACK, 1, 12)
    finally:
        shutil.rmtree(memory.parent, ignore_errors=True)
