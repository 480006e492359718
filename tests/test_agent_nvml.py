"""The agent with the scenario NVML backend: GPU states, health per GPU, XID events, hangs, clear."""
from __future__ import annotations

import json
import time
from pathlib import Path
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_harness import AgentProcess, cli
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
from deadlines import scaled

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GPU0 = "GPU-5dc0a7e1-0000-4000-8000-000000000000"
GPU1 = "GPU-5dc0a7e1-0000-4000-8000-000000000001"


def scenario(tmp, timeline, **extra):
    data = {"gpus": [{"uuid": GPU0, "pci_bus_id": "00000000:19:00.0", "name": "NVIDIA H200"},
                     {"uuid": GPU1, "pci_bus_id": "00000000:39:00.0", "name": "NVIDIA H200"}],
            "timeline": timeline, **extra}
    path = tmp / "scenario.json"
    path.write_text(json.dumps(data))
    return str(path)


def health(target, service, timeout=2.0):
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=timeout).status


def wait_for(pred, timeout=20.0, every=0.05):
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not met in time")


def status(target):
    with grpc.insecure_channel(target) as ch:
        return pb_grpc.AgentStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)


def all_events(target):
    with grpc.insecure_channel(target) as ch:
        return list(pb_grpc.AgentStub(ch).WatchEvents(pb.WatchEventsRequest(), timeout=10))


def test_xid79_fails_one_gpu_and_clear_is_journaled(short_tmp):
    path = scenario(short_tmp, [{"at": 1.5, "gpu": 1, "xid": 79}])
    agent = AgentProcess(short_tmp / "s", "--nvml-scenario", path, "--nvml-poll-interval-s", "0.2").start()
    try:
        assert health(agent.target, f"gpu/{GPU0}") == SERVING
        wait_for(lambda: health(agent.target, f"gpu/{GPU1}") == NOT_SERVING)
        assert health(agent.target, f"gpu/{GPU0}") == SERVING
        assert health(agent.target, "") == NOT_SERVING, "a FAILED GPU makes the node NOT_SERVING"
        assert health(agent.target, "sdcwatch.v1.Agent") == SERVING, "the agent itself still serves"
        st = status(agent.target)
        gpus = {g.uuid: g for g in st.gpus}
        assert gpus[GPU1].state == pb.STATE_FAILED and gpus[GPU0].state == pb.STATE_HEALTHY
        assert gpus[GPU1].pci_bus_id == "00000000:39:00.0"
        assert any("79" in e.value or "79" in e.signal for e in gpus[GPU1].evidence)
        assert st.node_state == pb.STATE_FAILED
        out = cli("status", "--socket", str(agent.socket))
        assert out.returncode == 1 and "FAILED" in out.stdout
        xids = [e for e in all_events(agent.target) if e.kind == "gpu.xid"]
        assert xids and xids[0].subject == f"gpu/{GPU1}" and xids[0].details["action"]
        metrics = urllib.request.urlopen(f"http://{agent.runtime_info()['metrics']}/metrics", timeout=5).read()
        assert b'sdcwatch_gpu_xid_events_total{' in metrics and b'xid="79"' in metrics
        out = cli("gpu", "clear", GPU1, "--reason", "reseated and rebooted", "--who", "oncall-alice",
                  "--socket", str(agent.socket))
        assert out.returncode == 0, out.stderr
        cleared = [e for e in all_events(agent.target) if e.kind == "gpu.cleared"]
        assert cleared and cleared[0].details["who"] == "oncall-alice"
        assert cleared[0].details["reason"] == "reseated and rebooted"
        wait_for(lambda: health(agent.target, f"gpu/{GPU1}") == SERVING)
    finally:
        agent.stop()


def test_hung_nvml_call_keeps_the_agent_responsive(short_tmp):
    path = scenario(short_tmp, [{"at": 1.0, "hang": {"call": "nvmlDeviceGetRemappedRows", "gpu": 0,
                                                     "seconds": 4, "times": 1}}])
    agent = AgentProcess(short_tmp / "s", "--nvml-scenario", path, "--nvml-poll-interval-s", "0.2",
                         "--nvml-timeout-s", "0.5").start()
    try:
        def hung():
            return any(p.name == "nvml" and p.state == pb.PROBE_STATE_HUNG for p in status(agent.target).probes)

        wait_for(hung, timeout=10)
        # While the NVML call hangs (4 s), every health check answers within a deadline well under the hang:
        # the loop is not blocked by it. How fast it answers is measured by bench/bench_storm.py, not here.
        for _ in range(20):
            assert health(agent.target, "", timeout=2.0) == SERVING
        st = status(agent.target)
        assert all(g.state == pb.STATE_UNKNOWN for g in st.gpus), "no fresh readings: UNKNOWN, not HEALTHY"
        kinds = [e.kind for e in all_events(agent.target)]
        assert "probe.hung" in kinds and "nvml.unresponsive" in kinds
        assert health(agent.target, "sdcwatch.v1.Agent") == SERVING, "a hung driver never fails liveness"
        assert "agent.loop_stale" not in kinds, "a loop waiting on a hung call still beats"
        wait_for(lambda: "probe.recovered" in [e.kind for e in all_events(agent.target)], timeout=10)
        assert "nvml.responsive" in [e.kind for e in all_events(agent.target)]
        wait_for(lambda: all(g.state == pb.STATE_HEALTHY for g in status(agent.target).gpus), timeout=10)
    finally:
        agent.stop()


def test_frozen_loop_makes_the_agent_not_serving_and_loud(short_tmp):
    """tests/scenarios/frozen_loop.json stops the nvml loop at t=2: within 3 intervals the watchdog says so."""
    path = str(Path(__file__).resolve().parent / "scenarios" / "frozen_loop.json")
    agent = AgentProcess(short_tmp / "s", "--nvml-scenario", path, "--nvml-poll-interval-s", "0.5").start()
    try:
        assert health(agent.target, "sdcwatch.v1.Agent") == SERVING
        wait_for(lambda: health(agent.target, "sdcwatch.v1.Agent") == NOT_SERVING, timeout=30)
        stale = [e for e in all_events(agent.target) if e.kind == "agent.loop_stale"]
        assert len(stale) == 1 and stale[0].subject == "probe/nvml" and stale[0].severity == pb.SEVERITY_CRITICAL
        assert "published no heartbeat" in stale[0].message
        nvml = next(p for p in status(agent.target).probes if p.name == "nvml")
        assert nvml.state == pb.PROBE_STATE_FAILING and "no heartbeat" in nvml.last_error
        wait_for(lambda: all(g.state == pb.STATE_UNKNOWN for g in status(agent.target).gpus), timeout=10)
        out = cli("status", "--socket", str(agent.socket))
        assert "no heartbeat" in out.stdout
        assert out.returncode == 3, "a frozen agent is not green: its GPUs have no fresh verdict"
    finally:
        agent.stop()


def test_frozen_xid_listener_makes_the_agent_not_serving(short_tmp):
    """tests/scenarios/frozen_xid_listener.json stops the XID listener thread at t=2: the watchdog sees its
    heartbeat go stale (it was not watched before), though the poll loop still beats."""
    path = str(Path(__file__).resolve().parent / "scenarios" / "frozen_xid_listener.json")
    agent = AgentProcess(short_tmp / "s", "--nvml-scenario", path, "--nvml-poll-interval-s", "0.5").start()
    try:
        wait_for(lambda: health(agent.target, "sdcwatch.v1.Agent") == NOT_SERVING, timeout=30)
        stale = [e for e in all_events(agent.target) if e.kind == "agent.loop_stale"]
        assert [e.subject for e in stale] == ["probe/xid"], stale
        assert "published no heartbeat" in stale[0].message
    finally:
        agent.stop()


def test_no_nvml_library_in_scenario(short_tmp):
    path = scenario(short_tmp, [], unavailable="libnvidia-ml.so.1: cannot open shared object file")
    agent = AgentProcess(short_tmp / "s", "--nvml-scenario", path).start()
    try:
        st = status(agent.target)
        assert not st.nvml_available and "libnvidia-ml" in st.nvml_reason
        assert st.node_state == pb.STATE_UNKNOWN
        assert any(p.name == "nvml" and p.state == pb.PROBE_STATE_DISABLED for p in st.probes)
    finally:
        agent.stop()


def test_replica_vote_makes_the_local_gpu_suspect(short_tmp):
    path = scenario(short_tmp, [])
    agent = AgentProcess(short_tmp / "s", "--nvml-scenario", path, "--hostname", "node-a").start()
    try:
        vote = pb.ReplicaVote(checked=True, agreed=False, replicas=3, method="majority", step=12,
                              suspects=[pb.SuspectRank(rank=1, host="node-a", gpu_uuid=GPU1),
                                        ])
        with grpc.insecure_channel(agent.target) as ch:
            stub = pb_grpc.AgentStub(ch)
            for rank in range(3):
                stub.ReportStep(pb.ReportStepRequest(job_id="j", rank=rank, world_size=3, step=13, vote=vote,
                                                     host="node-a"), timeout=5)
        st = status(agent.target)
        gpus = {g.uuid: g for g in st.gpus}
        assert gpus[GPU1].state == pb.STATE_SUSPECT and gpus[GPU0].state == pb.STATE_HEALTHY
        mism = [e for e in all_events(agent.target) if e.kind == "replica.mismatch"]
        assert len(mism) == 1, "three ranks report the same vote: one event"
        assert health(agent.target, f"gpu/{GPU1}") == SERVING, "SUSPECT is not FAILED"
        job = st.jobs[0]
        assert job.state == pb.STATE_SUSPECT and "step 12" in job.reason
    finally:
        agent.stop()


def test_in_job_canary_failure_makes_the_rank_gpu_suspect(short_tmp):
    path = scenario(short_tmp, [])
    agent = AgentProcess(short_tmp / "s", "--nvml-scenario", path, "--hostname", "node-c").start()
    try:
        with grpc.insecure_channel(agent.target) as ch:
            stub = pb_grpc.AgentStub(ch)
            ok = pb.CanaryResult(status="PASS", check="gemm/bf16/injob/2048x2048x2048", step=4)
            bad = pb.CanaryResult(status="FAIL", check="gemm/bf16/injob/2048x2048x2048", step=9,
                                  why="1 of 4194304 elements wrong: row 7, col 3")
            stub.ReportStep(pb.ReportStepRequest(job_id="jc", rank=0, world_size=2, step=5, host="node-c",
                                                 gpu_uuid=GPU0, canary=ok), timeout=5)
            stub.ReportStep(pb.ReportStepRequest(job_id="jc", rank=1, world_size=2, step=10, host="node-c",
                                                 gpu_uuid=GPU1, canary=bad), timeout=5)
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportStep(pb.ReportStepRequest(job_id="jc", rank=1, world_size=2, step=11,
                                                     canary=pb.CanaryResult(status="MAYBE")), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        gpus = {g.uuid: g for g in status(agent.target).gpus}
        assert gpus[GPU1].state == pb.STATE_SUSPECT and "row 7" in gpus[GPU1].reason
        assert gpus[GPU0].state == pb.STATE_HEALTHY
        fails = [e for e in all_events(agent.target) if e.kind == "canary.fail"]
        assert len(fails) == 1 and fails[0].details["gpu_uuid"] == GPU1
    finally:
        agent.stop()
