"""The real agent against issue 20's reproducers: a journal that fails and recovers, damaged journal lines,
an unwritable journal or an empty token file at start, counts past their type, phantom GPUs.

The disk failure is real: the agent's file-size limit (RLIMIT_FSIZE, set from outside with prlimit) makes
its next journal write fail with EFBIG, as a full disk would, and is lifted again."""
from __future__ import annotations

import json
import resource
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent_harness import AgentProcess, cli
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
from deadlines import scaled

SERVING = health_pb2.HealthCheckResponse.SERVING
NAN = float("nan")


def health(target: str, service: str = "sdcwatch.v1.Agent", timeout: float = 5.0) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=timeout).status


def status(target: str) -> pb.GetStatusResponse:
    with grpc.insecure_channel(target) as ch:
        return pb_grpc.AgentStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10)


def events(target: str, since: int = 0) -> list[pb.Event]:
    with grpc.insecure_channel(target) as ch:
        return list(pb_grpc.AgentStub(ch).WatchEvents(pb.WatchEventsRequest(since_seq=since), timeout=10))


class Follower:
    """`WatchEvents(follow)` in a thread, collecting events until `kinds` have all been seen."""

    def __init__(self, target: str, since: int) -> None:
        self.events: list[pb.Event] = []
        self.error: Exception | None = None
        self._ch = grpc.insecure_channel(target)
        self._call = pb_grpc.AgentStub(self._ch).WatchEvents(pb.WatchEventsRequest(since_seq=since, follow=True),
                                                             timeout=120)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for ev in self._call:
                self.events.append(ev)
        except grpc.RpcError as exc:
            self.error = exc

    def wait_for(self, pred, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            if pred(self.events):
                return
            time.sleep(0.05)
        raise AssertionError(f"follower saw {[(e.seq, e.kind) for e in self.events]} ({self.error})")

    def close(self) -> None:
        self._call.cancel()
        self._ch.close()


def test_a_journal_write_failure_never_wedges_the_agent(short_tmp):
    agent = AgentProcess(short_tmp / "s").start()
    follower = None
    try:
        assert agent.proc is not None
        pid = agent.proc.pid
        journal = max((short_tmp / "s" / "journal").glob("events-*.jsonl"))
        follower = Follower(agent.target, status(agent.target).last_event_seq)
        with grpc.insecure_channel(agent.target) as ch:
            stub = pb_grpc.AgentStub(ch)
            size = journal.stat().st_size
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))   # the next write fails
            try:
                resp = stub.ReportStep(pb.ReportStepRequest(job_id="lost", rank=0, step=1, loss=NAN), timeout=10)
                assert resp.accepted, "a journal failure is never the client's error"
            finally:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            stub.ReportStep(pb.ReportStepRequest(job_id="after", rank=0, step=2, loss=NAN), timeout=10)
        assert health(agent.target) == SERVING
        assert health(agent.target, "") in (SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
        # both jobs' starts and the failure's event: on a loaded machine the follower may get the failure's
        # event before the second job's start
        follower.wait_for(lambda evs: any(e.kind == "journal.write_failed" for e in evs)
                          and sum(e.kind == "job.started" for e in evs) >= 2)
        subjects = [e.subject for e in follower.events if e.kind == "job.started"]
        assert subjects == ["job/lost", "job/after"], "the follower got the unjournaled event from memory"
        failed = next(e for e in follower.events if e.kind == "journal.write_failed")
        assert failed.details["count"] >= 1
        journaled = [json.loads(x) for x in journal.read_text().splitlines()]
        assert [r["seq"] for r in journaled] == sorted({r["seq"] for r in journaled}), "no seq twice"
        assert any(r["kind"] == "journal.write_failed" for r in journaled)
        st = status(agent.target)
        assert {j.job_id for j in st.jobs} == {"lost", "after"}
    finally:
        if follower is not None:
            follower.close()
        rc = agent.stop(timeout=30)
    assert rc == 0, f"SIGTERM stops the agent cleanly:\n{agent.log()}"


def test_damaged_journal_lines_are_skipped_with_an_event(short_tmp):
    journal = short_tmp / "s" / "journal"
    journal.mkdir(parents=True)
    (journal / "events-000000000001.jsonl").write_text(
        '{"seq":1,"kind":"agent.ready","severity":"info","subject":"node","message":"m","details":{}}\n'
        '{"seq":1e999}\n{"seq":99999999999999999999999999999,"kind":"x"}\n{"seq":"7"}\n')
    with AgentProcess(short_tmp / "s") as agent:
        st = status(agent.target)
        assert 1 < st.last_event_seq < 100
        evs = events(agent.target)
        assert evs[0].seq == 1
        repaired = [e for e in evs if e.kind == "journal.repaired"]
        assert len(repaired) == 1 and "skipped 3 line(s)" in repaired[0].message
        assert health(agent.target) == SERVING


def test_an_unwritable_journal_at_start_exits_2_with_the_reason(short_tmp):
    state = short_tmp / "s"
    state.mkdir()
    (state / "journal").write_text("not a directory\n")
    r = cli("run", "--state-dir", str(state), "--metrics-listen", "off", timeout=60)
    assert r.returncode == 2, r.stderr
    assert "journal" in r.stderr and "Traceback" not in r.stderr


def test_an_empty_token_file_refuses_to_start(short_tmp):
    token = short_tmp / "token"
    token.write_text("  \n\t\n")
    r = cli("run", "--state-dir", str(short_tmp / "s"), "--metrics-listen", "off", "--listen", "127.0.0.1:0",
            "--insecure", "--token-file", str(token), timeout=60)
    assert r.returncode == 2, r.stderr
    assert "token_file" in r.stderr and "empty" in r.stderr and "Traceback" not in r.stderr


def test_counts_past_their_type_never_break_status_and_reports_never_make_gpus(short_tmp):
    with AgentProcess(short_tmp / "s", "--hostname", "node-a") as agent:
        with grpc.insecure_channel(agent.target) as ch:
            stub = pb_grpc.AgentStub(ch)
            for step in (1, 2):
                try:
                    stub.ReportStep(pb.ReportStepRequest(job_id="j", rank=0, step=step, dropped_reports=2**63 + 1),
                                    timeout=10)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            for i in range(70):   # a local client names GPUs that NVML never saw
                vote = pb.ReplicaVote(checked=True, agreed=False, replicas=2, method="all_disagreeing", step=i,
                                      suspects=[pb.SuspectRank(rank=0, host="node-a",
                                                               gpu_uuid=f"GPU-00000000-0000-0000-0000-{i:012d}")])
                stub.ReportStep(pb.ReportStepRequest(job_id="k", rank=0, world_size=2, step=i + 1, vote=vote,
                                                     host="node-a", gpu_uuid=f"GPU-00000000-0000-0000-0000-{i:012d}"),
                                timeout=10)
        st = status(agent.target)
        assert all(j.dropped_reports < 2**64 for j in st.jobs)
        assert list(st.gpus) == [], "a GPU exists because NVML says so"
        assert st.node_state == pb.STATE_UNKNOWN


def test_secrets_in_flags_are_refused_with_where_to_put_them(short_tmp):
    for flag, url in (("--redis-url", "redis://:hunter2@127.0.0.1:6379/0"),
                      ("--alerts-webhook-url", "https://hooks.example.com/x?token=hunter2")):
        r = cli("run", "--state-dir", str(short_tmp / "s"), "--metrics-listen", "off", flag, url, timeout=60)
        assert r.returncode == 2, r.stderr
        assert "SDCWATCH_" in r.stderr and "hunter2" not in r.stderr and "Traceback" not in r.stderr
