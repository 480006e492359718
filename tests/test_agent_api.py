"""The agent as a real subprocess: health, reflection, events, ReportStep validation, status CLI."""
from __future__ import annotations

import math
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agent_harness import cli
from deadlines import wait_until
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """One agent for this module's tests (they only add events and jobs; none depends on a clean slate)."""
    import tempfile
    from pathlib import Path

    from agent_harness import AgentProcess, remove_test_dir

    d = Path(tempfile.mkdtemp(prefix="sdcw-", dir="/tmp"))
    proc = AgentProcess(d / "state").start()
    try:
        yield proc
    finally:
        proc.stop()
        remove_test_dir(d)


def good_report(**kw):
    base = dict(job_id="job-1", rank=0, world_size=2, step=1, loss=2.5, grad_norm=1.0, time=time.time())
    base.update(kw)
    return pb.ReportStepRequest(**base)


def test_health_check_and_watch(agent):
    with grpc.insecure_channel(agent.target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "sdcwatch.v1.Agent"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="gpu/GPU-nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        watch.cancel()
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == SERVING
        watch.cancel()


def test_reflection_lists_services(agent):
    with grpc.insecure_channel(agent.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"sdcwatch.v1.Agent", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
            "sdcwatch.v1.Checkpoints", "sdcwatch.v1.PeerStore"} <= names


def test_socket_mode_is_0660(agent):
    assert agent.socket.stat().st_mode & 0o777 == 0o660


@pytest.mark.parametrize("bad,needle", [
    (dict(job_id=""), "job_id is empty"),
    (dict(job_id="../etc/passwd"), "job_id"),
    (dict(job_id="x" * 200), "job_id"),
    (dict(rank=-1), "rank is -1"),
    (dict(rank=5, world_size=2), "not below world_size"),
    (dict(step=-3), "step is -3"),
    (dict(grad_norm=-1.0), "grad_norm"),
    (dict(loss_scale=float("nan")), "loss_scale"),
    (dict(time=float("nan")), "time is nan"),
    (dict(timings=pb.StepTimings(step_s=float("inf"))), "timings.step_s"),
    (dict(timings=pb.StepTimings(check_s=-1)), "timings.check_s"),
    (dict(timings=pb.StepTimings(step_s=0.1, data_s=float("nan"))), "timings.data_s is nan"),
    (dict(time=-1.0), "time is -1.0"),
    (dict(time=float("inf")), "time is inf"),
    (dict(fingerprint=list(range(100))), "fingerprint has 100 words"),
    (dict(gpu_uuid="not-a-uuid"), "gpu_uuid"),
    (dict(host="bad host!"), "host"),
    (dict(labels={"k": "v" * 300}), "label"),
    (dict(labels={"k": "v" * 3000 for _ in range(1)} | {f"l{i}": "x" * 250 for i in range(30)}), "label"),
    (dict(frozen_changed=["p" * 1000] * 70), "bytes; the limit is"),
    (dict(frozen_step=3), "frozen_step is set without frozen_changed"),
    (dict(frozen_changed=["emb"], frozen_step=-1), "frozen_step is -1"),
    (dict(vote=pb.ReplicaVote(checked=True, replicas=2, method="coinflip")), "vote.method"),
    (dict(vote=pb.ReplicaVote(checked=True, replicas=2, suspect_count=1,
                              suspects=[pb.SuspectRank(rank=0)] * 2)), "vote.suspect_count is 1"),
    (dict(vote=pb.ReplicaVote(checked=True, replicas=2, suspects=[pb.SuspectRank(rank=9)])),
     "suspect rank 9"),
    (dict(vote=pb.ReplicaVote(checked=True, replicas=1)), "a checked vote compares 2 or more replicas"),
    (dict(vote=pb.ReplicaVote(checked=True, replicas=3)), "at most world_size (2)"),
])
def test_report_step_rejects_bad_input(agent, bad, needle):
    with grpc.insecure_channel(agent.target) as ch:
        stub = pb_grpc.AgentStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportStep(good_report(**bad), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()
        # the agent is still fine and accepts a good report afterwards
        assert stub.ReportStep(good_report(), timeout=5).accepted


def test_nan_loss_is_accepted_and_journaled(agent):
    with grpc.insecure_channel(agent.target) as ch:
        stub = pb_grpc.AgentStub(ch)
        assert stub.ReportStep(good_report(step=7, loss=math.nan), timeout=5).accepted
        events = list(stub.WatchEvents(pb.WatchEventsRequest(since_seq=0), timeout=10))
    nonfinite = [e for e in events if e.kind == "loss.nonfinite"]
    assert nonfinite and nonfinite[0].severity == pb.SEVERITY_CRITICAL
    assert nonfinite[0].details["step"] == 7


def test_a_sub_world_replica_groups_disagreeing_vote_is_taken_and_told(agent):
    """An HSDP rank's report names its replica group as the Monitor does ("ranks:0,2,4,6"): the agent took
    none of them before (INVALID_ARGUMENT on every report); now its vote reaches replica.mismatch."""
    from checksums.monitor import _group_name

    group = _group_name([0, 2, 4, 6], world=False)
    vote = pb.ReplicaVote(checked=True, agreed=False, replicas=4, method="majority", step=7,
                          replica_group=group, suspects=[pb.SuspectRank(rank=2, host="node1", gpu_uuid="GPU-2")])
    with grpc.insecure_channel(agent.target) as ch:
        stub = pb_grpc.AgentStub(ch)
        assert stub.ReportStep(good_report(world_size=8, step=8, replica_group=group, fingerprint=[1, 2],
                                           vote=vote), timeout=5).accepted
        events = list(stub.WatchEvents(pb.WatchEventsRequest(since_seq=0), timeout=10))
    [mismatch] = [e for e in events if e.kind == "replica.mismatch"]
    assert mismatch.details["replica_group"] == group and mismatch.details["step"] == 7


def test_oversize_message_rejected(agent):
    with grpc.insecure_channel(agent.target) as ch:
        stub = pb_grpc.AgentStub(ch)
        with pytest.raises(grpc.RpcError) as err:  # over the transport limit: the right status
            stub.ReportStep(good_report(labels={"big": "x" * 200}, frozen_changed=["y" * 500] * 10000), timeout=5)
        assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_watch_events_resumes_without_gaps(agent):
    with grpc.insecure_channel(agent.target) as ch:
        stub = pb_grpc.AgentStub(ch)
        first = list(stub.WatchEvents(pb.WatchEventsRequest(since_seq=0), timeout=10))
        assert [e.seq for e in first] == list(range(1, len(first) + 1))
        last = first[-1].seq
        got: list[int] = []
        follow = stub.WatchEvents(pb.WatchEventsRequest(since_seq=last, follow=True), timeout=30)

        def reader():
            for e in follow:
                got.append(e.seq)
                if len(got) >= 3:
                    break

        t = threading.Thread(target=reader)
        t.start()
        for i in range(3):  # each new job makes a job.started event
            stub.ReportStep(good_report(job_id=f"resume-{i}"), timeout=5)
        t.join(10)
        follow.cancel()
        assert got == [last + 1, last + 2, last + 3]
        # "reconnect" from the middle: exactly the rest, no gaps, no repeats
        again = [e.seq for e in stub.WatchEvents(pb.WatchEventsRequest(since_seq=last + 1), timeout=10)]
        assert again[:2] == [last + 2, last + 3]


def test_watch_events_filters(agent):
    with grpc.insecure_channel(agent.target) as ch:
        stub = pb_grpc.AgentStub(ch)
        stub.ReportStep(good_report(step=3, loss=math.inf), timeout=5)
        crit = list(stub.WatchEvents(pb.WatchEventsRequest(min_severity=pb.SEVERITY_CRITICAL), timeout=10))
        assert crit and all(e.severity == pb.SEVERITY_CRITICAL for e in crit)
        kinds = list(stub.WatchEvents(pb.WatchEventsRequest(kinds=["agent."]), timeout=10))
        assert kinds and all(e.kind.startswith("agent.") for e in kinds)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.WatchEvents(pb.WatchEventsRequest(min_severity=42), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_status_cli_and_json(agent):
    out = cli("status", "--socket", str(agent.socket))
    # no NVML, no GPUs: UNKNOWN (3), never "healthy"; 1 when an earlier test left a SUSPECT job on this agent
    assert out.returncode in (1, 3), out.stderr
    assert (out.returncode == 1) == ("SUSPECT" in out.stdout), out.stdout
    assert "NVML" in out.stdout and "node" in out.stdout
    import json

    out = cli("status", "--socket", str(agent.socket), "--json")
    data = json.loads(out.stdout)
    assert data["ready"] is True and data["versions"]["sdcwatch"]
    import importlib.util

    want = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"  # event_loop = auto
    assert data["versions"]["event_loop"].startswith(want)
    assert data["nvml_available"] is False and data["nvml_reason"]


@pytest.mark.parametrize("node,gpus,jobs,code", [
    (1, [1, 1], [], 0),
    (1, [1, 1], [2], 1),          # a SUSPECT job
    (2, [1, 2], [], 1), (3, [3], [], 1), (4, [4, 1], [1], 1),
    (5, [], [], 3),               # no GPUs, no evidence
    (1, [], [], 3),
    (1, [1, 5], [], 3),           # one GPU without evidence
    (5, [5, 4], [], 1),           # a FAILED GPU outranks UNKNOWN
])
def test_status_exit_codes(node, gpus, jobs, code):
    from daemon.cli import status_exit_code

    assert status_exit_code(node, gpus, jobs) == code


def test_status_cli_cannot_reach(short_tmp):
    out = cli("status", "--socket", str(short_tmp / "nobody.sock"), "--timeout", "1")
    assert out.returncode == 2
    assert "cannot reach the agent" in out.stderr


def test_events_cli(agent):
    out = cli("events", "--socket", str(agent.socket))
    assert out.returncode == 0
    assert "agent.ready" in out.stdout
    out = cli("events", "--socket", str(agent.socket), "--since", "-4")
    assert out.returncode == 2


def test_gpu_clear_unknown_gpu(agent):
    out = cli("gpu", "clear", "GPU-00000000-0000-0000-0000-000000000000", "--reason", "test",
              "--socket", str(agent.socket))
    assert out.returncode == 2 and "NOT_FOUND" in out.stderr
    out = cli("gpu", "clear", "GPU-0000", "--reason", " ", "--socket", str(agent.socket))
    assert out.returncode == 2 and "reason is empty" in out.stderr


def test_metrics_endpoint(agent):
    import urllib.request

    with grpc.insecure_channel(agent.target) as ch:
        pb_grpc.AgentStub(ch).ReportStep(good_report(job_id="metrics-job", checks_run=5), timeout=5)
        pb_grpc.AgentStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
        with pytest.raises(grpc.RpcError):   # aborted: counted by its code
            pb_grpc.AgentStub(ch).ReportStep(good_report(job_id=""), timeout=5)
        with pytest.raises(grpc.RpcError):   # the health servicer aborts NOT_FOUND
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="no-such"), timeout=5)
    addr = agent.runtime_info()["metrics"]
    series = [f"sdcwatch_rpc_requests_total{labels} " for labels in (
        '{code="OK",method="ReportStep"}', '{code="INVALID_ARGUMENT",method="ReportStep"}',
        '{code="NOT_FOUND",method="Check"}')]   # the agent is shared by this module's tests: >= 1

    def scraped() -> str | None:
        # the server counts a call once its status is sent: the client may see the status first
        text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
        return text if all(s in text for s in series) else None

    text = wait_until(scraped, 10, "every call counted by its code")
    assert 'sdcwatch_build_info{' in text
    assert 'sdcwatch_job_steps_total{job_id="metrics-job"} 1.0' in text
    assert 'sdcwatch_job_fingerprint_checks_total{job_id="metrics-job"} 5.0' in text
    assert 'sdcwatch_events_total{kind="agent.ready",severity="info"} 1.0' in text
    assert "sdcwatch_agent_uptime_seconds" in text


def test_rpc_stats_exposition_matches_prometheus_semantics() -> None:
    """The RPC counts kept without prometheus_client's locks expose as a standard counter and histogram."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from daemon.jobs import JobTracker
    from daemon.metrics import AgentMetrics

    tracker = JobTracker(max_jobs=1)
    m = AgentMetrics(jobs=tracker)
    check = m.rpc.method("Check")
    for seconds in (0.00005, 0.0001, 0.0002, 0.003, 7.0):   # 0.0001 sits on a bound: le includes it
        check.observe(seconds)
    for code in ("OK", "OK", "NOT_FOUND"):
        check.count(code)
    tracker.report(pb.ReportStepRequest(job_id="j1", rank=0, step=5, checks_run=3), 1.0)
    tracker.report(pb.ReportStepRequest(job_id="j1", rank=1, step=4, checks_run=2), 1.0)
    tracker.report(pb.ReportStepRequest(job_id="j1", rank=0, step=6, checks_run=4), 1.0)   # rank 0's count: 4
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    calls = {(s.labels["method"], s.labels["code"]): s.value for s in fams["sdcwatch_rpc_requests"].samples}
    assert calls == {("Check", "OK"): 2, ("Check", "NOT_FOUND"): 1}
    hist = {(s.name, s.labels.get("le")): s.value for s in fams["sdcwatch_rpc_duration_seconds"].samples}
    assert hist[("sdcwatch_rpc_duration_seconds_bucket", "0.0001")] == 2
    assert hist[("sdcwatch_rpc_duration_seconds_bucket", "0.00025")] == 3
    assert hist[("sdcwatch_rpc_duration_seconds_bucket", "5.0")] == 4
    assert hist[("sdcwatch_rpc_duration_seconds_bucket", "+Inf")] == 5
    assert hist[("sdcwatch_rpc_duration_seconds_count", None)] == 5
    assert abs(hist[("sdcwatch_rpc_duration_seconds_sum", None)] - 7.00335) < 1e-9
    steps = {s.labels["job_id"]: s.value for s in fams["sdcwatch_job_steps"].samples if s.name.endswith("_total")}
    assert steps == {"j1": 3}
    assert [s.value for s in fams["sdcwatch_job_last_step"].samples] == [6]
    checks = fams["sdcwatch_job_fingerprint_checks"].samples
    assert [(s.name, s.value) for s in checks] == [("sdcwatch_job_fingerprint_checks_total", 6)]
    tracker.report(pb.ReportStepRequest(job_id="j2", rank=0, step=1), 2.0)   # evicts j1 (max_jobs=1)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    assert {s.labels["job_id"] for s in fams["sdcwatch_job_steps"].samples} == {"j2"}


def test_the_rpc_meter_counts_a_code_set_without_an_abort(tmp_path) -> None:
    """A handler may set a status code and return instead of aborting: the call is counted by that code."""
    import asyncio

    from daemon.interceptors import MeteredServer
    from daemon.metrics import AgentMetrics

    class Servicer(pb_grpc.AgentServicer):
        async def ReportStep(self, request, context):  # type: ignore[no-untyped-def]
            if request.job_id == "refuse":
                context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
            return pb.ReportStepResponse(accepted=request.job_id != "refuse")

    async def run() -> AgentMetrics:
        metrics = AgentMetrics()
        server = grpc.aio.server()
        pb_grpc.add_AgentServicer_to_server(Servicer(), MeteredServer(server, metrics))
        server.add_insecure_port(f"unix:{tmp_path}/m.sock")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix:{tmp_path}/m.sock") as ch:
                stub = pb_grpc.AgentStub(ch)
                assert (await stub.ReportStep(pb.ReportStepRequest(job_id="j"), timeout=5)).accepted
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ReportStep(pb.ReportStepRequest(job_id="refuse"), timeout=5)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            await server.stop(0)
        return metrics

    stats = asyncio.run(run()).rpc.methods["ReportStep"]
    assert stats.codes == {"OK": 1, "FAILED_PRECONDITION": 1}
    assert sum(stats.buckets) == 2


def test_watch_events_ahead_of_the_journal_is_out_of_range_at_once(agent):
    """Issue 20: a since_seq past the newest event (a journal that lost its tail in a restart) waited forever."""
    with grpc.insecure_channel(agent.target) as ch:
        stub = pb_grpc.AgentStub(ch)
        last = list(stub.WatchEvents(pb.WatchEventsRequest(since_seq=0), timeout=10))[-1].seq
        for follow in (True, False):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.WatchEvents(pb.WatchEventsRequest(since_seq=last + 1000, follow=follow), timeout=30))
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE, err.value
            assert f"since_seq {last + 1000} is ahead" in err.value.details()
    out = cli("events", "--since", str(last + 1000), "--follow", "--socket", str(agent.socket))
    assert out.returncode == 2 and "OUT_OF_RANGE" in out.stderr and "is ahead" in out.stderr, out
