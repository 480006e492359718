"""Every request's work is bounded by what exists (issue 20, Critical 3): world-size limits, VerifyCopies
proportional to the committed shards, per-service pools, idle PutBlob streams, the agent's health when a pool
is wedged, and SIGTERM through all of it. The real agent, its embedded Redis (stopped with SIGSTOP to hang
every Checkpoints call for real)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_harness import ROOT, AgentProcess
from deadlines import scaled, wait_until
from proto.sdcwatch.v1 import agent_pb2 as apb
from proto.sdcwatch.v1 import agent_pb2_grpc as apb_grpc
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
    deadline = time.monotonic() + scaled(timeout)
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
        addr = agent.runtime_info()["metrics"]
        with grpc.insecure_channel(agent.target) as ch:
            for pid in redis_pids:
                os.kill(pid, signal.SIGSTOP)
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as exc:
                    cpb_grpc.CheckpointsStub(ch).List(cpb.ListCheckpointsRequest(), timeout=0.5)
                assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        def counted() -> str:
            with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
                return resp.read().decode()

        def list_counts() -> list[str]:
            return [line for line in counted().splitlines() if line.startswith("sdcwatch_rpc_requests_total{")
                    and 'method="List"' in line]

        # The server counts a call when its handler is cancelled, soon after the client gave up; Redis stays
        # stopped until then, so no handler can finish first (on a loaded machine one whose Redis came back
        # before the server saw the cancel returned OK to a client that had left)
        try:
            wait_until(lambda: any('code="DEADLINE_EXCEEDED"' in line and line.endswith(" 3.0")
                                   for line in list_counts()), 30, "3 List calls counted DEADLINE_EXCEEDED")
        except AssertionError as e:
            raise AssertionError(f"{e}: {list_counts()}") from None
        for pid in redis_pids:
            os.kill(pid, signal.SIGCONT)
        redis_pids = []
        assert 'method="List"' in counted() and not re.search(r'List.*UNKNOWN|UNKNOWN.*List', counted())
    finally:
        for pid in redis_pids:
            os.kill(pid, signal.SIGCONT)
        agent.stop(timeout=30)


# A launcher for the real agent in which one class of blocking call hangs for good: every watcher's read of
# the journal files (the fake blocks forever, as a dead disk would).
_WEDGED_JOURNAL = ("import sys, threading; import daemon.journal as j; "
                   "j.Journal.read_since = lambda *a, **k: threading.Event().wait(); "
                   "from daemon.cli import main; sys.exit(main(sys.argv[1:]))")


def test_a_hung_class_of_blocking_calls_wedges_only_its_pool_and_health_says_so(short_tmp):
    """Issue 20: blocking calls ran on asyncio's shared default executor (cores + 4 threads): one class that
    hangs (here: journal reads for watchers) took it over, and health still said SERVING. Now each class has
    its own bounded pool: health says NOT_SERVING, and every other RPC still answers within a deadline."""
    state = short_tmp / "s"
    first = AgentProcess(state).start()          # events only the journal files will hold after a restart
    with grpc.insecure_channel(first.target) as ch:
        for i in range(3):
            apb_grpc.AgentStub(ch).ReportStep(apb.ReportStepRequest(job_id=f"w{i}", step=1), timeout=10)
    assert first.stop(timeout=30) == 0, first.log()
    agent = AgentProcess(state)
    agent._log = open(agent.log_path, "ab")     # the harness's process, started by the launcher instead
    cmd = [sys.executable, "-c", _WEDGED_JOURNAL, "run", "--state-dir", str(state), "--metrics-listen", "off",
           "--shutdown-grace-s", "1", "--pool-wedged-s", "1"]
    agent.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=agent._log, stderr=subprocess.STDOUT)
    agent.wait_serving(30)
    watchers = []
    try:
        with grpc.insecure_channel(agent.target) as ch:
            stub = apb_grpc.AgentStub(ch)
            # more watchers than the pool has threads, each resuming from seq 1: a journal read, hung
            watchers = [stub.WatchEvents(apb.WatchEventsRequest(since_seq=1, follow=True), timeout=600)
                        for _ in range(6)]
            for w in watchers:
                assert not w.done()
            wait_until(lambda: health(ch) == NOT_SERVING, 30, "the agent's health says NOT_SERVING")
            deadline = scaled(10)
            # everything else answers, within a deadline
            assert health(ch, "") in (SERVING, NOT_SERVING)
            stub.GetStatus(apb.GetStatusRequest(), timeout=deadline)
            assert stub.ReportStep(apb.ReportStepRequest(job_id="live", step=1), timeout=deadline).accepted
            cpb_grpc.CheckpointsStub(ch).List(cpb.ListCheckpointsRequest(job_id="live"), timeout=deadline)
            recent = list(stub.WatchEvents(apb.WatchEventsRequest(since_seq=stub.GetStatus(
                apb.GetStatusRequest(), timeout=deadline).last_event_seq - 1), timeout=deadline))
            assert recent, "a watcher the memory ring serves needs no journal read"
    finally:
        for w in watchers:
            w.cancel()
        rc = agent.stop(timeout=30)
    assert rc == 0, agent.log()


def test_hung_maintenance_rounds_hold_two_threads_not_the_default_executor(tmp_path):
    """A maintenance round that hangs (Redis, the memory dir) left a thread of asyncio's default executor
    behind at each timeout; the next rounds took the rest, and every other `to_thread` in the agent waited.
    Now the rounds have their own pool of 2: later rounds are skipped while it is full, and it says wedged."""
    import asyncio
    import types

    from checkpoint.shm_store import DirStore
    from daemon.checkpoint_service import CheckpointService
    from daemon.pools import WorkPool

    release = threading.Event()
    coordinator = types.SimpleNamespace(store=DirStore(tmp_path / "m"), maintain=lambda now, hold: release.wait())

    async def main() -> None:
        try:
            service = CheckpointService(coordinator, maintenance_timeout_s=0.05,   # type: ignore[arg-type]
                                        pool=WorkPool("checkpoints", wedged_after_s=0.2))
            for _ in range((os.cpu_count() or 1) + 8):
                try:
                    await service.maintain_once()
                except asyncio.TimeoutError:
                    pass
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), scaled(5)) == "free", \
                "asyncio's default executor is free"
            assert service.maintenance_pool.running == 2 and service.maintenance_pool.full()
            await asyncio.sleep(0.3)
            assert service.maintenance_pool.wedged()
            assert service.maintenance_pool in service.local_pools()
            for p in service.pools():
                p.shutdown()
        finally:
            release.set()   # before asyncio.run waits for its default executor's threads

    asyncio.run(main())


class _Ctx:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


def test_a_cancel_at_the_deadline_is_the_deadline() -> None:
    """Issue 26: under load the client's cancel (its deadline passed) reached the server 1.9 ms before the
    server's own deadline, and was counted CANCELLED. A cancel within the slack of the deadline is the
    deadline's; one well before it, or of a call without a deadline, is a cancel."""
    from daemon.interceptors import _ended_by_client

    assert _ended_by_client(_Ctx(0.0), 0.5) == "DEADLINE_EXCEEDED"
    assert _ended_by_client(_Ctx(0.0019), 0.498) == "DEADLINE_EXCEEDED"
    assert _ended_by_client(_Ctx(0.04), None) == "DEADLINE_EXCEEDED"       # a stream: the floor
    assert _ended_by_client(_Ctx(0.3), 0.2) == "CANCELLED"
    assert _ended_by_client(_Ctx(5.0), 55.0) == "CANCELLED"
    assert _ended_by_client(_Ctx(1.5), 58.5) == "CANCELLED"                # the slack is capped at 1 s
    assert _ended_by_client(_Ctx(None), 3.0) == "CANCELLED"
