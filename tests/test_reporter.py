"""StepReporter against a real grpc.aio server on a temp unix socket (and TCP with TLS + bearer token).

The servicer here is a tiny stand-in for the agent's ReportStep (the agent was written at the same time);
the end-to-end test with the real agent belongs in tests/test_agent_*.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
import torch
from torch import nn

from checksums.monitor import Monitor
from checksums.replica_vote import vote
from checksums.reporter import CanaryReport, Directive, StepReport, StepReporter, StepSink, to_request
from proto.sdcwatch.v1 import agent_pb2, agent_pb2_grpc
from sdcwatch.channels import agent_target
from sdcwatch.paths import default_socket, default_state_dir
from deadlines import scaled

REPORTER_LOGGER = "checksums.reporter"


class RecordingAgent(agent_pb2_grpc.AgentServicer):
    def __init__(self) -> None:
        self.requests: list[agent_pb2.ReportStepRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.directives_for: Callable[[agent_pb2.ReportStepRequest], list[agent_pb2.Directive]] = lambda r: []
        self.delay_s = 0.0

    async def ReportStep(self, request: agent_pb2.ReportStepRequest, context: Any) -> agent_pb2.ReportStepResponse:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata()})
        return agent_pb2.ReportStepResponse(accepted=True, directives=self.directives_for(request))


class ServerThread:
    """A grpc.aio server on its own event loop thread; `stop()` kills it (no grace)."""

    def __init__(self, address: str, servicer: RecordingAgent, creds: Any = None) -> None:
        self.address = address
        self.servicer = servicer
        self.creds = creds
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: Any = None

    def start(self) -> "ServerThread":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServicer_to_server(self.servicer, self._server)
        if self.creds is None:
            self.port = self._server.add_insecure_port(self.address)
        else:
            self.port = self._server.add_secure_port(self.address, self.creds)
        await self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture()
def sock(short_tmp: Path) -> Path:
    return short_tmp / "agent.sock"


@pytest.fixture()
def agent(sock: Path) -> Iterator[tuple[RecordingAgent, ServerThread]]:
    servicer = RecordingAgent()
    server = ServerThread(f"unix:{sock}", servicer).start()
    try:
        yield servicer, server
    finally:
        server.stop()


def _req(step: int) -> StepReport:
    return StepReport(job_id="j", rank=0, world_size=1, step=step, loss=1.0)


def _wait(predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_reports_arrive_in_order(agent, sock) -> None:
    servicer, _ = agent
    with StepReporter(sock, deadline_s=2.0) as reporter:
        for step in range(1, 21):
            assert reporter.submit(_req(step))
        assert reporter.flush(10)
        assert reporter.sent == 20 and reporter.dropped == 0
    assert [r.step for r in servicer.requests] == list(range(1, 21))
    assert all(r.dropped_reports == 0 for r in servicer.requests)


def test_agent_killed_mid_run_never_blocks_counts_drops_and_warns_once(sock, caplog) -> None:
    caplog.set_level(logging.INFO, logger=REPORTER_LOGGER)
    servicer = RecordingAgent()
    server = ServerThread(f"unix:{sock}", servicer).start()
    reporter = StepReporter(sock, queue_size=8, deadline_s=scaled(1.0))   # the 6 live reports meet it when busy
    try:
        for step in range(1, 7):
            assert reporter.submit(_req(step))
        assert reporter.flush(10) and reporter.sent == 6
        server.stop()                                     # the agent dies
        accepted = sum(reporter.submit(_req(step)) for step in range(7, 1007))
        assert accepted < 1000                            # a full queue refuses instead of blocking
        assert reporter.flush(30)
        lost = reporter.dropped
        assert lost == 1000 and reporter.sent == 6 and reporter.agent_down
        assert reporter.failed == accepted and reporter.dropped_full == 1000 - accepted
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == REPORTER_LOGGER]
        assert len(warnings) == 1 and "slow or down" in warnings[0].getMessage()

        # The agent comes back on the same socket: the next accepted report carries the count.
        servicer2 = RecordingAgent()
        if sock.exists():
            sock.unlink()
        server = ServerThread(f"unix:{sock}", servicer2).start()
        step = 2000
        def delivered() -> bool:
            nonlocal step
            step += 1
            reporter.submit(_req(step))
            reporter.flush(2)
            return bool(servicer2.requests)
        assert _wait(delivered, 20)
        first = servicer2.requests[0]
        assert first.dropped_reports == reporter.dropped  # every report lost since the last accepted one
        assert not reporter.agent_down
        summaries = [r for r in caplog.records if r.levelno == logging.INFO and "answers again" in r.getMessage()]
        assert len(summaries) == 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == REPORTER_LOGGER]
        assert len(warnings) == 1
    finally:
        reporter.close(1)
        server.stop()


def test_slow_agent_hits_the_deadline_and_submit_still_returns(agent, sock) -> None:
    servicer, _ = agent
    servicer.delay_s = 2.0
    reporter = StepReporter(sock, queue_size=2, deadline_s=0.5)
    try:
        results = [reporter.submit(_req(s)) for s in range(200)]
        assert results.count(False) >= 200 - 2 - 1        # at most queue + one in flight accepted
        assert reporter.flush(20)
        assert reporter.failed >= 1 and reporter.sent == 0 and reporter.agent_down
        assert "DEADLINE_EXCEEDED" in reporter.last_error
    finally:
        reporter.close(0.5)


def test_close_is_idempotent_and_submit_after_close_drops(agent, sock) -> None:
    reporter = StepReporter(sock)
    reporter.close()
    reporter.close()
    assert reporter.submit(_req(1)) is False and reporter.dropped == 1


def test_directives_reach_the_monitor(agent, sock) -> None:
    servicer, _ = agent
    rollback = agent_pb2.Directive(kind=agent_pb2.Directive.KIND_ROLLBACK, target_step=2, skip_batches=3,
                                   reason="loss spike", event_seq=77)
    servicer.directives_for = lambda r: [rollback] if r.step >= 4 else []   # repeated: handed over once
    seen: list[Any] = []
    reporter = StepReporter(sock, deadline_s=2.0)
    model = nn.Linear(4, 2)
    monitor = Monitor.attach(model, job_id="j", reporter=reporter, on_directive=seen.append)
    try:
        for _ in range(6):
            monitor.step(torch.tensor(0.25))
            reporter.flush(5)
        monitor.step(torch.tensor(0.25))
        assert len(seen) == 1 and seen[0].kind == Directive.KIND_ROLLBACK
        got = monitor.pending_directive()
        assert got is not None and got.target_step == 2 and got.skip_batches == 3 and got.event_seq == 77
        assert monitor.pending_directive() is None
        assert [e.kind for e in monitor.events] == ["directive"]
        assert reporter.last_directives[0].reason == "loss spike"
        reporter.flush(5)
        assert [r.step for r in servicer.requests] == list(range(1, 8))
        assert servicer.requests[0].loss == 0.25 and len(servicer.requests[0].fingerprint) >= 2
    finally:
        monitor.close()
        reporter.close()


def test_monitor_keeps_training_when_the_agent_dies(sock, caplog) -> None:
    caplog.set_level(logging.WARNING)
    servicer = RecordingAgent()
    server = ServerThread(f"unix:{sock}", servicer).start()
    # a deadline a busy machine's live agent meets (0.2 s timed out one of the 20 live reports with the suite
    # and a busy loop on 2 cores); once the server is gone a call fails at once (no wait_for_ready)
    reporter = StepReporter(sock, queue_size=64, deadline_s=scaled(1.0))
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor.attach(model, opt, job_id="j", reporter=reporter)
    try:
        for step in range(1, 61):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            monitor.step(loss.detach())
            if step == 20:
                reporter.flush(5)
                server.stop()
        monitor.flush()
        reporter.flush(10)
        stats = monitor.stats
        assert stats.steps == 60 and stats.checks_run == 60
        assert stats.reports_sent == 20 and stats.reports_dropped == 40 and stats.agent_down
        assert [e.kind for e in monitor.events] == ["agent.unreachable"]
        ours = [r for r in caplog.records if r.name.startswith(("daemon.", "checksums."))]
        assert len(ours) == 1 and "slow or down" in ours[0].getMessage()
    finally:
        monitor.close(0.5)
        reporter.close(0.5)


def _self_signed(tmp: Path) -> tuple[bytes, bytes]:
    from support import self_signed_cert

    return self_signed_cert()


def test_tcp_with_tls_and_bearer_token(short_tmp: Path) -> None:
    cert, key = _self_signed(short_tmp)
    (short_tmp / "ca.pem").write_bytes(cert)
    servicer = RecordingAgent()
    creds = grpc.ssl_server_credentials([(key, cert)])
    server = ServerThread("localhost:0", servicer, creds).start()
    reporter = StepReporter(f"localhost:{server.port}", root_cert=short_tmp / "ca.pem", token="s3cret",
                            deadline_s=5.0)
    try:
        reporter.submit(_req(1))
        assert reporter.flush(15) and reporter.sent == 1, reporter.last_error
        assert servicer.metadata[0]["authorization"] == "Bearer s3cret"
    finally:
        reporter.close()
        server.stop()


_CHURN = """
import sys
from pathlib import Path
import grpc
sys.path.insert(0, "tests")
from test_reporter import RecordingAgent, ServerThread, _req
from checksums.reporter import StepReporter

ca, key, rounds = Path(sys.argv[1]), Path(sys.argv[2]).read_bytes(), int(sys.argv[3])
for i in range(rounds):
    servicer = RecordingAgent()
    server = ServerThread("localhost:0", servicer, grpc.ssl_server_credentials([(key, ca.read_bytes())])).start()
    reporter = StepReporter(f"localhost:{server.port}", root_cert=ca, token="s3cret", deadline_s=30.0)
    errors = []
    for _ in range(3):   # a report whose call failed is dropped by design (the step never waits): send another
        reporter.submit(_req(1))
        if reporter.flush(60) and servicer.metadata:
            break
        errors.append(reporter.last_error)
    assert servicer.metadata and servicer.metadata[0]["authorization"] == "Bearer s3cret", (i, errors)
    if errors:
        print(f"round {i}: resent after {errors}", file=sys.stderr)
    reporter.close()
    server.stop()
print("ok", rounds)
"""


def test_token_reporters_never_freeze_the_process(short_tmp: Path) -> None:
    """A TLS reporter with a token, closed before an aio server in the same process stops, 150 times. grpc's
    `access_token_call_credentials` (a Python metadata plugin that core destroys on its own threads with the
    GIL) froze the whole process, signals included, within 50 rounds here (and the suite once, in CI); the
    token is a client interceptor now (sdcwatch/channels.py)."""
    cert, key = _self_signed(short_tmp)
    (short_tmp / "ca.pem").write_bytes(cert)
    (short_tmp / "key.pem").write_bytes(key)
    try:
        done = subprocess.run([sys.executable, "-c", _CHURN, str(short_tmp / "ca.pem"), str(short_tmp / "key.pem"),
                               "150"], capture_output=True, text=True, timeout=scaled(120),
                              cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        pytest.fail("the process froze: a TLS token channel closed beside an aio server stop deadlocked")
    assert done.returncode == 0 and "ok 150" in done.stdout, done.stderr[-3000:]

def test_tcp_is_tls_unless_asked_and_never_plain_with_a_token() -> None:
    with pytest.raises(ValueError, match="never sent over plain TCP"):
        StepReporter("127.0.0.1:1", token="t", allow_insecure_tcp=True)
    with pytest.raises(ValueError, match="unix socket"):
        StepReporter("/tmp/x.sock", root_cert=b"pem")
    StepReporter("127.0.0.1:1", allow_insecure_tcp=True).close(0.1)
    with pytest.raises(ValueError, match="queue_size"):
        StepReporter("/tmp/x.sock", queue_size=0)


def test_targets_and_default_paths() -> None:
    assert agent_target("/tmp/a.sock") == "unix:/tmp/a.sock"
    assert agent_target("unix:/x/y") == "unix:/x/y"
    assert agent_target("host:7000") == "host:7000"
    assert agent_target("[::1]:7000") == "[::1]:7000"
    assert agent_target("rel.sock") == "unix:" + os.path.abspath("rel.sock")
    env = {"XDG_RUNTIME_DIR": "/run/user/7"}
    assert default_state_dir(env, uid=7) == Path("/run/user/7/sdcwatch")
    assert default_socket({**env, "SDCWATCH_SOCKET": "/s/a.sock"}, uid=7) == Path("/s/a.sock")
    assert default_state_dir({}, uid=7) == Path("/tmp/sdcwatch-7")
    assert default_state_dir(env, uid=0) == Path("/run/sdcwatch"), "root: the fixed system path"
    assert default_socket({}, uid=0) == Path("/run/sdcwatch/agent.sock")


# ---- the Monitor's protocol and the wire form ---------------------------------------------------------------


def test_the_plain_directive_kinds_are_the_wire_kinds() -> None:
    wire = agent_pb2.Directive.Kind
    assert {name: getattr(Directive, name) for name in wire.keys()} == dict(wire.items())


def test_a_step_report_becomes_the_request_the_agent_reads() -> None:
    result = vote({0: (1, 2), 1: (1, 2), 2: (1, 3)}, {2: ("h2", "GPU-2")})
    report = StepReport(job_id="j", rank=2, world_size=3, step=9, time=5.5, host="h2", gpu_uuid="GPU-2",
                        replica_group="world", fingerprint=(1, 3), frozen_changed=("emb",), checks_run=4,
                        loss=0.5, grad_norm=None, loss_scale=1024.0, step_s=0.2, check_s=0.001, vote=result,
                        canary=CanaryReport(step=8, check="injob/gemm", status="FAIL", why="x" * 5000))
    req = to_request(report)
    assert (req.job_id, req.rank, req.world_size, req.step, req.time) == ("j", 2, 3, 9, 5.5)
    assert (req.host, req.gpu_uuid, req.replica_group) == ("h2", "GPU-2", "world")
    assert list(req.fingerprint) == [1, 3] and list(req.frozen_changed) == ["emb"] and req.checks_run == 4
    assert req.HasField("loss") and not req.HasField("grad_norm") and req.loss_scale == 1024.0
    assert (req.timings.step_s, req.timings.check_s) == (0.2, 0.001)
    assert (req.canary.step, req.canary.check, req.canary.status) == (8, "injob/gemm", "FAIL")
    assert len(req.canary.why) == 1000                     # bounded on the wire
    v = req.vote
    assert v.checked and not v.agreed and v.method == "majority" and v.replicas == 3
    assert (v.step, v.replica_group) == (9, "world")
    assert [(s.rank, s.host, s.gpu_uuid, list(s.fingerprint)) for s in v.suspects] == [(2, "h2", "GPU-2", [1, 3])]
    assert not req.HasField("frozen_step"), "a change seen at the report's own step needs no frozen_step"
    bare = to_request(StepReport(job_id="j", rank=0, world_size=1, step=1))
    assert not bare.HasField("vote") and not bare.HasField("canary") and not bare.HasField("loss")


def test_every_step_sink_conforms_and_the_monitor_refuses_anything_else(sock) -> None:
    from support import RecordingReporter

    reporter = StepReporter(sock)
    try:
        for sink in (reporter, RecordingReporter()):
            assert isinstance(sink, StepSink)
            assert sink.take_directives() == [] and sink.stats().agent_down is False
    finally:
        reporter.close(0.1)
    with pytest.raises(ValueError, match="StepSink"):
        Monitor.attach(nn.Linear(2, 2), job_id="j", reporter=object())


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the agent is restarting"


class _Invalid(_Unavailable):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INVALID_ARGUMENT


class _FlakyStub:
    """An agent stub whose calls fail while `down` is set and block while `hold` is clear; the requests it
    took are kept."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.hold = threading.Event()
        self.hold.set()
        self.requests: list[agent_pb2.ReportStepRequest] = []
        self.refuse: set[int] = set()        # steps the agent refuses as invalid

    def ReportStep(self, request: agent_pb2.ReportStepRequest,
                   timeout: float) -> agent_pb2.ReportStepResponse:
        self.hold.wait(scaled(30))
        if self.down.is_set():
            raise _Unavailable()
        if request.step in self.refuse:
            raise _Invalid()
        self.requests.append(request)
        return agent_pb2.ReportStepResponse()


def _finding(step: int) -> Any:
    from checksums.reporter import ComputeFinding
    return ComputeFinding(step=step, detector="stats", suspect=1, cause="transient", faulty=(1,),
                          dropped=True, detail="an outlier", where=((1, "h1", "GPU-1"),))


def test_a_lost_reports_compute_findings_and_canary_ride_on_the_next_report_sent(sock) -> None:
    """A compute fault found while the agent was down (the call failed) or while the queue was full is not
    lost with its report: the next report the agent takes carries it (and a lost in-job canary result),
    oldest first; more than one request's worth goes over the following reports. Before, the agent never
    heard of it: no compute.fault event, the GPU never SUSPECT (seen in the HF integration test on a
    loaded machine)."""
    stub = _FlakyStub()
    reporter = StepReporter(sock, queue_size=1, deadline_s=1.0, stub_factory=lambda channel: stub)
    try:
        stub.down.set()                                   # the agent is down: these calls fail
        fail = CanaryReport(step=2, check="injob/gemm/fp32", status="FAIL", why="off by 1 ulp")
        for report in (dataclasses.replace(_req(1), compute=(_finding(1),)),
                       dataclasses.replace(_req(2), canary=fail), _req(3)):
            assert reporter.submit(report) and reporter.flush(scaled(10))
        assert reporter.failed == 3 and stub.requests == []
        stub.down.clear()
        stub.hold.clear()                                 # the agent is back but slow: the queue fills
        assert reporter.submit(_req(4))                   # being sent (held)
        assert _wait(lambda: reporter.pending() == 0)    # taken by the sending thread
        assert reporter.submit(_req(5))                   # queued
        assert not reporter.submit(dataclasses.replace(_req(6), compute=(_finding(6),)))   # full: dropped
        stub.hold.set()
        assert reporter.flush(scaled(10))
        assert [r.step for r in stub.requests] == [4, 5]
        first, second = stub.requests
        assert [f.step for f in first.compute] == [1] and first.canary.status == "FAIL", first
        assert first.canary.check == "injob/gemm/fp32" and first.dropped_reports == 3
        # the finding of the report the full queue refused went on the next one sent (5, queued before it);
        # each is carried once
        assert [f.step for f in second.compute] == [6] and not second.canary.check, second
        assert reporter.submit(_req(7)) and reporter.flush(scaled(10))
        assert not stub.requests[-1].compute, stub.requests[-1]
        # an outage with more findings than one request takes: they go over the following reports in order
        stub.down.set()
        for step in range(10, 30):
            assert reporter.submit(dataclasses.replace(_req(step), compute=(_finding(step),)))
            assert reporter.flush(scaled(10))
        stub.down.clear()
        for step in (30, 31):
            assert reporter.submit(_req(step)) and reporter.flush(scaled(10))
        got = [f.step for r in stub.requests[-2:] for f in r.compute]
        assert got == list(range(10, 30)) and len(stub.requests[-2].compute) == 16, got
        # a request the agent refuses as invalid is not sent again inside the next one (it would be refused
        # again, and every report after it)
        stub.refuse.add(40)
        assert reporter.submit(dataclasses.replace(_req(40), compute=(_finding(40),)))
        assert reporter.flush(scaled(10)) and reporter.submit(_req(41)) and reporter.flush(scaled(10))
        assert stub.requests[-1].step == 41 and not stub.requests[-1].compute, stub.requests[-1]
    finally:
        reporter.close(1)


def test_a_lost_reports_frozen_change_rides_on_the_next_report_sent_with_its_step(sock) -> None:
    """The Monitor takes a frozen parameter's baseline again once it has told a change, so a report lost
    with a change in it would lose the change for good: the next report sent carries the names (of every
    lost change, each once) and the earliest step they were seen at, and only that one carries them."""
    stub = _FlakyStub()
    reporter = StepReporter(sock, queue_size=4, deadline_s=1.0, stub_factory=lambda channel: stub)
    try:
        stub.down.set()
        for report in (dataclasses.replace(_req(5), frozen_changed=("emb",)),
                       dataclasses.replace(_req(6), frozen_changed=("head", "emb")), _req(7)):
            assert reporter.submit(report) and reporter.flush(scaled(10))
        stub.down.clear()
        for report in (dataclasses.replace(_req(8), frozen_changed=("norm",)), _req(9)):
            assert reporter.submit(report) and reporter.flush(scaled(10))
        first, second = stub.requests
        assert (first.step, first.frozen_step, list(first.frozen_changed)) == (8, 5, ["emb", "head", "norm"])
        assert not second.frozen_changed and not second.HasField("frozen_step"), second
    finally:
        reporter.close(1)


def test_thousands_of_changed_frozen_parameters_still_make_a_report_the_agent_takes() -> None:
    """A job whose "frozen" set is trained after all changes every tensor of it each step: the names are
    bounded on the wire (the last saying how many more), so the agent's size check passes and the report
    (its loss, its vote, the change) is not refused whole, as a 5,000-name report was."""
    from daemon.validation import check_report_step

    names = tuple(f"backbone.layers.{i}.attention.qkv.weight" + "x" * (i % 400) for i in range(5000))
    req = to_request(StepReport(job_id="j", rank=0, world_size=2, step=7, frozen_changed=names, loss=1.0,
                                fingerprint=(1, 2)))
    assert check_report_step(req) is None, check_report_step(req)
    got = list(req.frozen_changed)
    assert got[:3] == [n[:256] for n in names[:3]] and got[-1] == "... and 4937 more", got[-1]
    assert len(got) == 64 and max(map(len, got)) <= 256
    whole = agent_pb2.ReportStepRequest(job_id="j", rank=0, world_size=2, step=7, frozen_changed=names)
    assert check_report_step(whole) is not None, "the agent's limit this guards against"


def test_a_vote_with_hundreds_of_suspects_is_bounded_its_own_nodes_first() -> None:
    """A group of 300 replicas that all disagree (a nondeterministic update): the request lists 64 suspects,
    this rank's own node's among them (its agent keeps evidence on its own GPUs only), with the whole count;
    before, each rank's report passed the agent's size limit and was refused whole."""
    from daemon.validation import check_report_step

    where = {r: (f"node{r // 8}", f"GPU-{r:04d}") for r in range(300)}
    result = vote({r: (r, r + 1) for r in range(300)}, where)
    assert not result.agreed and len(result.suspects) == 300, result
    req = to_request(StepReport(job_id="j", rank=250, world_size=300, step=9, host="node31",
                                gpu_uuid="GPU-0250", replica_group="world", fingerprint=(250, 251),
                                vote=result))
    assert check_report_step(req) is None, check_report_step(req)
    got = [s.rank for s in req.vote.suspects]
    assert len(got) == 64 and req.vote.suspect_count == 300 and got == sorted(got), got
    assert set(range(248, 256)) <= set(got), "every GPU of this rank's node is listed"
    few = to_request(StepReport(job_id="j", rank=0, world_size=3, step=9,
                                vote=vote({0: (1,), 1: (1,), 2: (2,)})))
    assert [s.rank for s in few.vote.suspects] == [2] and few.vote.suspect_count == 0


def test_the_replica_group_names_the_monitor_makes_are_ones_the_agent_takes() -> None:
    """HSDP and other sub-world replica groups are named "ranks:0,2,4,6" (or a digest form past 16 ranks):
    the agent's rule for a group's name had no ',' or '#', so every report of such a rank was refused
    (INVALID_ARGUMENT) while its local view looked right (the multi-rank test read only that)."""
    from checksums.monitor import _group_name
    from daemon.validation import check_report_step

    groups = ([0, 2, 4, 6], [1, 3], list(range(0, 64, 2)), [1_000_000 + r for r in range(16)])
    for ranks in groups:
        name = _group_name(ranks, world=False)
        req = to_request(StepReport(job_id="j", rank=ranks[0], world_size=1 << 20, step=3, replica_group=name,
                                    fingerprint=(1, 2), vote=vote({r: (1, 2) for r in ranks}, {})))
        assert check_report_step(req) is None, (name, check_report_step(req))
    assert check_report_step(agent_pb2.ReportStepRequest(job_id="j", step=1, replica_group="a b")) is not None
