"""Every request's work is bounded by what exists (issue 20, Critical 3): world-size limits, VerifyCopies
proportional to the committed shards, per-service pools, idle PutBlob streams, the agent's health when a pool
is wedged, and SIGTERM through all of it. The real agent, its embedded Redis (stopped with SIGSTOP to hang
every Checkpoints call for real)."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_harness import AgentProcess
from proto.sdcwatch.v1 import checkpoint_pb2 as cpb
from proto.sdcwatch.v1 import checkpoint_pb2_grpc as cpb_grpc
from proto.sdcwatch.v1 import peer_pb2 as ppb
from proto.sdcwatch.v1 import peer_pb2_grpc as ppb_grpc

AGENT = "sdcwatch.v1.Agent"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(ch: grpc.Channel, service: str = AGENT) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_world_size_is_bounded_and_verify_copies_reads_only_what_exists(short_tmp):
    agent = AgentProcess(short_tmp / "s").start()
    try:
        with grpc.insecure_channel(agent.target) as ch:
            ckpt = cpb_grpc.CheckpointsStub(ch)
            try:
                ckpt.Begin(cpb.BeginRequest(job_id="w", step=1, rank=0, world_size=2147483647), timeout=10)
                raise AssertionError("a world of 2^31-1 ranks was accepted")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_world_size" in exc.details()
            ckpt.Begin(cpb.BeginRequest(job_id="w", step=1, rank=0, world_size=65536), timeout=10)
            with ThreadPoolExecutor(8) as ex:
                calls = [ex.submit(ckpt.VerifyCopies.future(cpb.VerifyCopiesRequest(job_id="w", step=1),
                                                            timeout=30).exception) for _ in range(8)]
                for c in calls:
                    exc = c.result()
                    assert exc is None or exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OK), exc
            ckpt.List(cpb.ListCheckpointsRequest(), timeout=10)
            assert health(ch) == SERVING
    finally:
        rc = agent.stop(timeout=30)
    assert rc == 0, agent.log()


def test_idle_put_streams_never_stall_the_other_calls(short_tmp):
    agent = AgentProcess(short_tmp / "s").start()
    streams = []
    try:
        with grpc.insecure_channel(agent.target) as ch:
            peer = ppb_grpc.PeerStoreStub(ch)
            gates = []
            for i in range(8):   # the first message, then nothing
                gate = threading.Event()
                gates.append(gate)

                def messages(i=i, gate=gate):
                    yield ppb.PutBlobRequest(key=f"idle/{i}", total_bytes=10, data=b"x")
                    gate.wait(120)

                streams.append(peer.PutBlob.future(messages(), timeout=120))
            time.sleep(1.0)   # let them all arrive and take what they take
            started = time.monotonic()
            assert not peer.StatBlob(ppb.StatBlobRequest(key="idle/none"), timeout=10).exists
            cpb_grpc.CheckpointsStub(ch).List(cpb.ListCheckpointsRequest(), timeout=10)
            assert health(ch) == SERVING
            assert time.monotonic() - started < 10
            for gate in gates:
                gate.set()
    finally:
        for s in streams:
            s.cancel()
        rc = agent.stop(timeout=30)
    assert rc == 0, agent.log()


def test_a_wedged_pool_makes_the_agent_not_serving_until_it_moves_again(short_tmp):
    agent = AgentProcess(short_tmp / "s", "--service-workers", "2", "--pool-wedged-s", "1").start()
    redis_pids = []
    try:
        assert agent.proc is not None
        redis_pids = [p for p in children(agent.proc.pid)
                      if "redis" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert redis_pids, "the embedded redis-server is the agent's child"
        with grpc.insecure_channel(agent.target) as ch:
            ckpt = cpb_grpc.CheckpointsStub(ch)
            for pid in redis_pids:
                os.kill(pid, signal.SIGSTOP)
            calls = [ckpt.List.future(cpb.ListCheckpointsRequest(job_id=f"j{i}"), timeout=60) for i in range(4)]
            wait_for(lambda: health(ch) == NOT_SERVING, timeout=30)
            assert health(ch, "") in (SERVING, NOT_SERVING)   # the node's verdict is the GPUs', not this
            for pid in redis_pids:
                os.kill(pid, signal.SIGCONT)
            redis_pids = []
            for c in calls:
                c.exception()
            wait_for(lambda: health(ch) == SERVING, timeout=30)
    finally:
        for pid in redis_pids:
            os.kill(pid, signal.SIGCONT)
        rc = agent.stop(timeout=30)
    assert rc == 0, agent.log()


def test_client_deadlines_are_counted_as_deadline_exceeded(short_tmp):
    agent = AgentProcess(short_tmp / "s").start()
    redis_pids = []
    try:
        assert agent.proc is not None
        redis_pids = [p for p in children(agent.proc.pid)
                      if "redis" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        with grpc.insecure_channel(agent.target) as ch:
            for pid in redis_pids:
                os.kill(pid, signal.SIGSTOP)
            for _ in range(3):
                try:
                    cpb_grpc.CheckpointsStub(ch).List(cpb.ListCheckpointsRequest(), timeout=0.5)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for pid in redis_pids:
                os.kill(pid, signal.SIGCONT)
            redis_pids = []
        addr = agent.runtime_info()["metrics"]

        def counted() -> str:
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
                return resp.read().decode()

        wait_for(lambda: 'sdcwatch_rpc_requests_total{code="DEADLINE_EXCEEDED",method="List"} 3.0' in counted()
                 or 'sdcwatch_rpc_requests_total{method="List",code="DEADLINE_EXCEEDED"} 3.0' in counted())
        assert 'method="List"' in counted() and not re.search(r'List.*UNKNOWN|UNKNOWN.*List', counted())
    finally:
        for pid in redis_pids:
            os.kill(pid, signal.SIGCONT)
        agent.stop(timeout=30)
