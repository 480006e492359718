"""Issue 20 High 7: the embedded redis-server is supervised. kill -9 it: `redis.down`, the health name
`sdcwatch.v1.Checkpoints` NOT_SERVING and GetStatus's probe `redis` FAILING while it is down; then it is
restarted by itself, `redis.restarted`, SERVING, and checkpoints work again; the checkpoint saved before
the kill is still listed and restores (the index persists in the state dir, issue 21)."""
from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_harness import AgentProcess
from checkpoint.client import CheckpointClient
from checkpoint.shm_store import default_shm_root
from checkpoint.snapshot import SnapshotConfig
from ckpt_support import assert_same, job_id, state_dict
from daemon.redis_supervisor import backoff
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
from sdcwatch.safe_fs import remove_tree


def _wait_for(what: str, pred, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not in {timeout}s: {what}")


def _events(stub: pb_grpc.AgentStub) -> list[pb.Event]:
    return list(stub.WatchEvents(pb.WatchEventsRequest(since_seq=0, follow=False), timeout=10))


def test_backoff_doubles_and_is_bounded() -> None:
    assert [backoff(n, 0.5, 4.0) for n in (1, 2, 3, 4, 5, 50)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_killed_embedded_redis_is_restarted_and_checkpoints_work_again(short_tmp: Path) -> None:
    state = short_tmp / f"sup-{uuid.uuid4().hex[:8]}"
    job = job_id("sup")
    try:
        with AgentProcess(state) as agent, grpc.insecure_channel(agent.target) as ch:
            stub, health = pb_grpc.AgentStub(ch), health_pb2_grpc.HealthStub(ch)

            def checkpoints_health() -> int:
                return health.Check(health_pb2.HealthCheckRequest(service="sdcwatch.v1.Checkpoints"),
                                    timeout=5).status

            def redis_probe() -> pb.ProbeStatus:
                return next(p for p in stub.GetStatus(pb.GetStatusRequest(), timeout=5).probes if p.name == "redis")

            assert checkpoints_health() == health_pb2.HealthCheckResponse.SERVING
            client = CheckpointClient.connect(job, 0, 1, target=agent.target, deadline_s=10,
                                              config=SnapshotConfig(chunk_bytes=4096))
            try:
                assert client.save(1, state_dict(0, 1)).result(30).error == ""
                pid = int((state / "redis.pid").read_text())
                os.kill(pid, signal.SIGKILL)
                down = _wait_for("redis.down", lambda: [e for e in _events(stub) if e.kind == "redis.down"])
                assert "exited with code -9" in down[0].message
                _wait_for("redis.restarted", lambda: [e for e in _events(stub) if e.kind == "redis.restarted"])
                assert checkpoints_health() == health_pb2.HealthCheckResponse.SERVING
                probe = redis_probe()
                assert probe.failures == 1 and probe.runs == 2 and probe.state == pb.PROBE_STATE_OK
                assert int((state / "redis.pid").read_text()) != pid
                assert health.Check(health_pb2.HealthCheckRequest(service="sdcwatch.v1.Agent"),
                                    timeout=5).status == health_pb2.HealthCheckResponse.SERVING

                def saved() -> bool:   # the client's first call after the restart may still see the old socket
                    res = client.save(2, state_dict(0, 2)).result(30)
                    return res.error == "" and res.state == "COMMITTED"

                _wait_for("a checkpoint saved after the restart", saved, timeout=60)
                listed = {i.step: i.state for i in client.list()}
                assert listed.get(2) == "COMMITTED" and listed.get(1) == "COMMITTED", \
                    f"the index is reloaded from the state dir (issue 21): {listed}"
                assert_same(client.restore(1), state_dict(0, 1))
            finally:
                client.close()
    finally:
        remove_tree(default_shm_root(state).parent)
