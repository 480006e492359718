"""Mixed versions on one node, both ways: a DaemonSet upgrade meets running jobs with the old library, and a
job started with a new library may meet an agent not yet upgraded.

- released client -> new agent: the real agent (tests/agent_harness.py) is called with the released
  messages and stubs (tests/wire_released.py, built from proto/released/*.binpb): health, GetStatus,
  WatchEvents, ReportStep, and the checkpoint calls of the rank's link (Begin, CommitShard, List, Latest,
  LatestVerified, RestorePlan, ReportRestore) driven by a real CheckpointClient: save, verify by the replica
  vote, a NaN that earns a rollback directive, a bit-exact restore. Every reply is read with the released
  classes and may hold no enum value the release does not name. A shard the 0.1.0 library wrote
  (tests/wire_0_1_0/: manifest_json + blob) commits on the new agent and restores with the new library.
- new client -> released agent: the Monitor with its StepReporter, the CheckpointClient's gRPC link and the
  `sdcwatch status / events / ckpt ls` commands against `PreviousAgent`, a server that speaks only the
  released wire and fills every released field of its replies.
- peer agents (upgraded one node at a time): the released PeerStore stubs against the new agent, and the new
  GrpcBlobStore (which builds its bulk messages by hand) against the stand-in's PeerStore.
"""
from __future__ import annotations

import json
import math
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from agent_harness import AgentProcess, cli, remove_test_dir
from checkpoint.client import CheckpointClient
from checkpoint.grpc_store import GrpcBlobStore
from checkpoint.locations import dir_store_for
from checkpoint.snapshot import SnapshotConfig
from checksums.monitor import Monitor
from checksums.reporter import StepReporter
from ckpt_support import assert_same, state_dict
from daemon.client import AgentClient
from proto.sdcwatch.v1 import agent_pb2
from sdcwatch.channels import agent_channel
from wire_released import PreviousAgent, ReleasedCheckpointLink, released_wire, unknown_enum_values, unset_fields
from deadlines import scaled


def _until(what: str, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def _name(enum: str, number: int) -> str:
    return released_wire().pool.FindEnumTypeByName(f"sdcwatch.v1.{enum}").values_by_number[number].name


# ---- released client -> new agent ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def new_agent() -> Iterator[AgentProcess]:
    tmp = Path(tempfile.mkdtemp(prefix="sdcw-wire-", dir="/tmp"))
    agent = AgentProcess(tmp / "state")
    try:
        yield agent.start()
    finally:
        agent.stop()
        remove_test_dir(tmp)


def _released_report(job: str, step: int, loss: float, vote_about: int | None = None) -> Any:
    """A ReportStep as the 0.1.0 Monitor filled it, on the released messages."""
    w = released_wire()
    req = w.ReportStepRequest(job_id=job, rank=0, world_size=2, step=step, loss=loss, grad_norm=1.5,
                              fingerprint=[step * 7919 % 2**64, 0x9E3779B97F4A7C15], replica_group="dp0",
                              host="node-a", gpu_uuid="GPU-0a", time=time.time(), checks_run=step,
                              frozen_changed=[])
    req.timings.step_s, req.timings.check_s = 0.25, 0.001
    if vote_about is not None:
        req.vote.checked, req.vote.agreed, req.vote.replicas = True, True, 2
        req.vote.method, req.vote.step, req.vote.replica_group = "majority", vote_about, "dp0"
    return req


def test_released_client_reads_health_status_and_events_of_the_new_agent(new_agent: AgentProcess) -> None:
    w = released_wire()
    with grpc.insecure_channel(new_agent.target) as ch:
        for service in ("", "sdcwatch.v1.Agent"):
            got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, service
        agent = w.stub(ch, "Agent")
        st = agent.GetStatus(w.GetStatusRequest(), timeout=10)
        assert type(st) is w.GetStatusResponse and st.ready and st.hostname and st.started_at > 0
        assert st.versions["sdcwatch"] and unknown_enum_values(st) == []
        assert _name("State", st.node_state).startswith("STATE_")
        events = list(agent.WatchEvents(w.WatchEventsRequest(since_seq=0, follow=False), timeout=30))
        assert events and events[0].kind.startswith("agent."), [e.kind for e in events]
        assert all(e.seq > 0 and e.time > 0 and unknown_enum_values(e) == [] for e in events)
        with pytest.raises(grpc.RpcError) as err:
            agent.ClearGpu(w.ClearGpuRequest(uuid="GPU-not-here", who="wire-test", reason="compat"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "GPU-not-here" in err.value.details()


def test_released_rank_library_saves_verifies_rolls_back_and_restores_on_the_new_agent(
        new_agent: AgentProcess) -> None:
    w = released_wire()
    job = f"wire-old-{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(new_agent.target) as ch:
        link = ReleasedCheckpointLink(ch)
        client = CheckpointClient(link, job, 0, 1, config=SnapshotConfig(chunk_bytes=4096))
        agent = w.stub(ch, "Agent")
        report = lambda req: agent.ReportStep(req, timeout=10)  # noqa: E731
        try:
            saved = client.save(1, state_dict(0, 1)).result(30)
            assert saved.error == "" and saved.state == "COMMITTED", saved
            replies = [report(_released_report(job, 1, 2.0)), report(_released_report(job, 2, 1.9, vote_about=1)),
                       report(_released_report(job, 3, 1.8))]
            assert all(r.accepted and not r.directives for r in replies)
            verified = _until("step 1 VERIFIED by the vote", lambda: client.latest_verified())
            assert (verified.step, verified.state) == (1, "VERIFIED")
            assert report(_released_report(job, 4, math.nan)).accepted

            step = [4]

            def directive() -> Any:
                step[0] += 1
                reply = report(_released_report(job, step[0], 1.7))
                return reply.directives
            (d,) = _until("a rollback directive after the NaN", directive)
            assert _name("Directive.Kind", d.kind) == "KIND_ROLLBACK" and d.target_step == 1 and d.event_seq > 0
            assert_same(client.restore("latest_verified"), state_dict(0, 1))
            assert_same(client.restore(1), state_dict(0, 1))
            assert [(i.step, i.state) for i in client.list()] == [(1, "VERIFIED")]
            assert client.latest().step == 1
        finally:
            client.close()
        assert {type(r).__name__ for r in link.replies} >= {
            "BeginResponse", "CommitShardResponse", "LatestResponse", "RestorePlanResponse",
            "ReportRestoreResponse", "ListCheckpointsResponse"}
        assert [bad for r in link.replies for bad in unknown_enum_values(r)] == []
        st = agent.GetStatus(w.GetStatusRequest(), timeout=10)
        assert unknown_enum_values(st) == []
        (job_status,) = [j for j in st.jobs if j.job_id == job]
        assert job_status.last_step >= 5 and list(job_status.ranks) == [0]
        # the per-job summaries are refreshed by the agent's checkpoint maintenance round (every 10 s)
        summary = _until("the job's checkpoint summary in GetStatus", lambda: [
            c for c in agent.GetStatus(w.GetStatusRequest(), timeout=10).checkpoints if c.job_id == job], 60)
        assert summary[0].latest_verified_step == 1 and summary[0].count == 1
        kinds = [e.kind for e in agent.WatchEvents(w.WatchEventsRequest(kinds=["loss.", "job."]), timeout=30)
                 if e.subject == f"job/{job}"]
        # names as of 0.1.0 (loss.nonfinite, job.rollback_directive); the catalogue may rename them
        assert any("nonfinite" in k for k in kinds) and any("rollback" in k for k in kinds), kinds


def test_released_peer_agent_reads_and_writes_the_new_agents_memory_tier(new_agent: AgentProcess) -> None:
    """Peer replicas during a rollout: a not-yet-upgraded node's agent uses the new node's PeerStore."""
    w = released_wire()
    key = f"wire-{uuid.uuid4().hex[:8]}/000000000001/rank-00000.bin"
    blob = bytes(range(256)) * 64 + b"tail"
    with grpc.insecure_channel(new_agent.target) as ch:
        peer = w.stub(ch, "PeerStore")
        parts = [w.PutBlobRequest(key=key, total_bytes=len(blob), data=blob[:5000]),
                 w.PutBlobRequest(data=blob[5000:12000]), w.PutBlobRequest(data=blob[12000:], finish=True)]
        assert peer.PutBlob(iter(parts), timeout=30).bytes == len(blob)
        stat = peer.StatBlob(w.StatBlobRequest(key=key), timeout=10)
        assert stat.exists and stat.size == len(blob)
        assert list(peer.ListBlobs(w.ListBlobsRequest(prefix=key.split("/")[0]), timeout=10).keys) == [key]
        chunks = list(peer.GetBlob(w.GetBlobRequest(key=key, to_end=True, chunk_bytes=4096), timeout=30))
        assert b"".join(c.data for c in chunks) == blob and chunks[0].blob_bytes == len(blob)
        step = len(chunks[0].data)
        assert [c.offset for c in chunks] == list(range(0, len(blob), step))
        ranged = list(peer.GetBlob(w.GetBlobRequest(key=key, offset=10, length=300), timeout=30))
        assert b"".join(c.data for c in ranged) == blob[10:310] and ranged[0].offset == 10
        assert peer.DeleteBlob(w.DeleteBlobRequest(key=key), timeout=10).deleted
        assert not peer.StatBlob(w.StatBlobRequest(key=key), timeout=10).exists
        with pytest.raises(grpc.RpcError) as err:
            list(peer.GetBlob(w.GetBlobRequest(key=key, to_end=True), timeout=10))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


RELEASED_SHARD = Path(__file__).resolve().parent / "wire_0_1_0"


def released_state_dict() -> dict[str, Any]:
    """The state dict saved in tests/wire_0_1_0/ (see its README)."""
    return {"model": {"w": torch.arange(48, dtype=torch.float32) / 7,
                      "h": (torch.arange(24) / 3).to(torch.bfloat16), "i": torch.arange(15).reshape(3, 5)},
            "step": 1, "rng": (1, [0, 1], None), "loader": {"epoch": 0, "pos": 10}, "by_rank": {0: "a"}}


def test_a_shard_the_released_library_wrote_commits_on_the_new_agent_and_restores(
        new_agent: AgentProcess) -> None:
    """manifest_json and the blob layout are a contract inside the wire: frozen 0.1.0 bytes must still work."""
    w = released_wire()
    manifest = json.loads((RELEASED_SHARD / "shard-manifest.json").read_text())
    blob = (RELEASED_SHARD / "shard.bin").read_bytes()
    job, step = manifest["job_id"], manifest["step"]
    with grpc.insecure_channel(new_agent.target) as ch:
        released = w.stub(ch, "Checkpoints")
        begun = released.Begin(w.BeginRequest(job_id=job, step=step, rank=0, world_size=1), timeout=10)
        assert _name("CheckpointState", begun.state) == "CHECKPOINT_STATE_PENDING"
        dir_store_for(begun.location).put(begun.blob_key, blob)  # what the released Snapshotter did
        manifest["blob"] = begun.blob_key   # the released rank wrote the key Begin gave it
        committed = released.CommitShard(w.CommitShardRequest(
            job_id=job, step=step, rank=0, world_size=1, manifest_json=json.dumps(manifest), staging="private"),
            timeout=10)
        assert committed.committed and _name("CheckpointState", committed.state) == "CHECKPOINT_STATE_COMMITTED"
    client = CheckpointClient.connect(job, 0, 1, target=new_agent.target, deadline_s=10)
    try:
        assert_same(client.restore(step), released_state_dict())
    finally:
        client.close()


# ---- new client -> released agent ------------------------------------------------------------------------------


@pytest.fixture()
def previous_agent(short_tmp: Path) -> Iterator[PreviousAgent]:
    with PreviousAgent(f"unix:{short_tmp / 'old.sock'}", short_tmp / "memory") as agent:
        yield agent


def test_new_monitor_and_reporter_on_the_previous_agent(previous_agent: PreviousAgent) -> None:
    previous_agent.directive_from_step = 3
    seen: list[Any] = []
    reporter = StepReporter(previous_agent.target, deadline_s=5.0)
    monitor = Monitor.attach(nn.Linear(4, 2), job_id="wire-new", reporter=reporter, on_directive=seen.append)
    try:
        for _ in range(4):
            monitor.step(torch.tensor(0.5))
            assert reporter.flush(15)
        monitor.step(torch.tensor(0.5))
        assert reporter.flush(15) and reporter.sent == 5 and reporter.failed == 0
        assert len(seen) == 1 and seen[0].kind == agent_pb2.Directive.KIND_ROLLBACK
        got = monitor.pending_directive()
        assert (got.target_step, got.skip_batches, got.reason, got.event_seq) == (
            4, 3, "loss nonfinite from step 6", 77)
    finally:
        monitor.close()
        reporter.close()
    reqs = previous_agent.requests["ReportStep"]
    assert [r.step for r in reqs] == [1, 2, 3, 4, 5]
    assert all(r.job_id == "wire-new" and r.HasField("loss") and r.loss == 0.5 and len(r.fingerprint) >= 2
               and r.timings.step_s >= 0 for r in reqs)
    assert [bad for r in reqs for bad in unknown_enum_values(r)] == []


@pytest.mark.parametrize("checksums", ["auto", "source"])
def test_new_checkpoint_client_on_the_previous_agent(previous_agent: PreviousAgent, checksums: str) -> None:
    """`source`: the new client commits a shard as its layout and words (checkpoint.shard_layout); the
    released agent refuses a commit without manifest_json, and the client sends the manifest from then on."""
    job = "wire-new-ckpt"
    client = CheckpointClient.connect(job, 0, 1, target=previous_agent.target, deadline_s=10,
                                      config=SnapshotConfig(chunk_bytes=4096, checksums=checksums))
    try:
        for step in (1, 2):
            saved = client.save(step, state_dict(0, step)).result(30)
            assert saved.error == "" and saved.state == "COMMITTED", saved
        assert [(i.step, i.state, i.shards) for i in client.list()] == [(1, "VERIFIED", 1), (2, "VERIFIED", 1)]
        assert client.latest().step == 2 and client.latest_verified().step == 2
        info = client.list()[0]
        assert info.copies[0].location == str(previous_agent.memory_dir) and info.nbytes > 0
        assert_same(client.restore(1), state_dict(0, 1))
        assert_same(client.restore("latest_verified"), state_dict(0, 2))
    finally:
        client.close()
    commits = previous_agent.requests["CommitShard"]
    if checksums == "source":   # the first try as words (a field the released wire lacks): refused, then JSON
        assert not commits[0].manifest_json and len(commits) == 3
        commits = commits[1:]
    assert [(c.job_id, c.step, c.rank, c.world_size) for c in commits] == [(job, 1, 0, 1), (job, 2, 0, 1)]
    assert all(json.loads(c.manifest_json) and c.staging for c in commits)
    restores = previous_agent.requests["ReportRestore"]
    assert [(r.step, r.ok, r.bytes > 0) for r in restores] == [(1, True, True), (2, True, True)]
    plan = previous_agent.restore_plan(released_wire().RestorePlanRequest(job_id=job, step=1, rank=-1), None)
    sock = previous_agent.target.removeprefix("unix:")
    out = cli("ckpt", "ls", "--job", job, "--socket", sock)
    assert out.returncode == 0, out
    assert [ln.split()[1:3] for ln in out.stdout.splitlines() if ln.startswith(job)] == [
        ["1", "VERIFIED"], ["2", "VERIFIED"]]
    js = json.loads(cli("ckpt", "ls", "--job", job, "--json", "--socket", sock).stdout)
    assert [c["tier"] for i in js["checkpoints"] for c in i["copies"]] == ["memory", "memory"]
    # every released field is exercised, but for rank 0 (a one-rank job), the default value
    assert unset_fields(plan) == ["checkpoint.copies[0].rank", "shards[0].rank", "shards[0].copies[0].rank"]


def test_new_cli_and_agent_client_on_the_previous_agent(previous_agent: PreviousAgent) -> None:
    w = released_wire()
    assert unset_fields(previous_agent.get_status(w.GetStatusRequest(), None)) == []
    sock = previous_agent.target.removeprefix("unix:")
    client = AgentClient(agent_channel(sock))
    try:
        st = client.status()
        assert (st.hostname, st.gpus[0].evidence[0].count, st.probes[0].state) == (
            PreviousAgent.NODE, 2, agent_pb2.PROBE_STATE_HUNG)
        assert st.checkpoints[0].latest_verified_step == 4 and st.versions["driver"] == "550.54"
        assert [e.kind for e in client.events()] == ["agent.started", "gpu.state", "loss.nonfinite"]
    finally:
        client.close()
    out = cli("status", "--socket", sock)
    assert out.returncode == 1, out   # exit 1: the node is SUSPECT
    assert f"node {PreviousAgent.NODE}: SUSPECT" in out.stdout and "GPU-0a" in out.stdout and "HUNG" in out.stdout
    js = cli("status", "--json", "--socket", sock)
    status = json.loads(js.stdout)
    assert status["gpus"][0]["evidence"][0]["signal"] == "replica.mismatch"
    assert status["jobs"][0]["job_id"] == "job-old"
    events = cli("events", "--json", "--since", "1", "--socket", sock)
    assert events.returncode == 0, events
    lines = [json.loads(ln) for ln in events.stdout.splitlines()]
    assert [e["kind"] for e in lines] == ["gpu.state", "loss.nonfinite"]
    assert lines[1]["details"]["nested"] == {"ok": True}
    for out in (js, events):
        assert "Traceback" not in out.stderr


def test_new_peer_store_client_on_the_previous_agent(previous_agent: PreviousAgent) -> None:
    """The hand-built bulk messages of checkpoint/grpc_store.py, read by the released classes, and back."""
    store = GrpcBlobStore(f"unix://{previous_agent.target.removeprefix('unix:')}", chunk_bytes=4096)
    key = "job-new/000000000002/rank-00001.bin"
    blob = bytes(range(251)) * 100
    try:
        assert store.put(key, blob) == len(blob)
        assert previous_agent.blobs[key] == blob
        puts = previous_agent.requests["PutBlob"]
        assert puts[0].key == key and puts[0].total_bytes == len(blob) and puts[-1].finish
        assert store.exists(key) and store.size(key) == len(blob) and store.list("job-new") == [key]
        assert store.get(key) == blob and store.get(key, 100, 5000) == blob[100:5100]
        buf = bytearray(3000)
        assert store.readinto(key, 7, memoryview(buf)) == 3000 and bytes(buf) == blob[7:3007]
        with pytest.raises(NotImplementedError):   # ChecksumBlob came later: the replicator reads back
            store.checksums(key, [(0, 100)])
        assert store.delete(key) and not store.exists(key)
        with pytest.raises(KeyError):
            store.get(key)
    finally:
        store.close()
