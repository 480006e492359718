"""A check around the optimizer step that raises is loud, not silent: the step guard keeps training going
(a stage must never break it), counts the failure and keeps the newest error; the Monitor's step reports
carry both; the agent journals one WARNING `rank.stage_failed` naming the rank, the stage and the error,
folding repeats, counts them (`sdcwatch_job_stage_errors_total`, GetStatus' JobStatus.stage_errors), and
refuses an over-long error with INVALID_ARGUMENT.

Found when a draft of the compute gate's one-call gather raised on every step under gloo: training went on,
every step went unchecked, and nothing outside the rank's log said so."""
from __future__ import annotations

import urllib.request

import grpc
import pytest
import torch
from torch import nn

from agent_harness import cli
from checksums.monitor import Monitor
from checksums.step_guard import Phase, StepContext
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
from support import RecordingReporter


class Broken:
    """A GATE stage that raises from its `fail_from`-th step on."""

    name = "broken.gate"
    phase = Phase.GATE

    def __init__(self, fail_from: int) -> None:
        self.fail_from = fail_from

    def run(self, ctx: StepContext) -> None:
        if ctx.step >= self.fail_from:
            raise RuntimeError(f"shape mismatch at {ctx.step}")


def test_the_monitor_reports_the_guards_stage_failures() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reporter = RecordingReporter()
    monitor = Monitor.attach(model, opt, job_id="j", reporter=reporter)
    monitor.guard.add(Broken(fail_from=3))
    for _ in range(5):
        loss = model(torch.randn(4, 3)).pow(2).sum()
        loss.backward()
        before = model.weight.detach().clone()
        opt.step()
        assert not torch.equal(before, model.weight)         # the update ran: training was not broken
        monitor.step(loss)
        opt.zero_grad()
    monitor.close()
    errors = [r.stage_errors for r in reporter.reports]
    assert errors == [0, 0, 1, 2, 3], errors
    assert reporter.reports[-1].stage_error == "broken.gate at step 5: RuntimeError: shape mismatch at 5"
    assert reporter.requests[-1].stage_errors == 3
    assert reporter.requests[-1].stage_error.startswith("broken.gate at step 5: RuntimeError")
    assert monitor.guard.stats.errors == 3


def _report(stub, step: int, errors: int, error: str = "", rank: int = 1) -> None:  # type: ignore[no-untyped-def]
    stub.ReportStep(pb.ReportStepRequest(job_id="gate-job", rank=rank, world_size=2, step=step, loss=1.0,
                                         stage_errors=errors, stage_error=error), timeout=5)


def test_the_agent_journals_one_warning_per_rank_and_refuses_an_overlong_error(agent) -> None:
    why = "compute at step 3: RuntimeError: ProcessGroupGloo::allgather: invalid tensor size"
    with grpc.insecure_channel(agent.target) as ch:
        stub = pb_grpc.AgentStub(ch)
        for step in (1, 2):
            _report(stub, step, 0)
            _report(stub, step, 0, rank=0)
        for step in (3, 4, 5, 6):        # rank 1's count goes up on every step: one event, repeats folded
            _report(stub, step, step - 2, why)
            _report(stub, step, 0, rank=0)
        with pytest.raises(grpc.RpcError) as err:
            _report(stub, 7, 5, "x" * 201)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stage_error is 201 characters; the limit is 200" in (err.value.details() or "")
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
    assert {j.job_id: j.stage_errors for j in status.jobs}["gate-job"] == 4
    text = urllib.request.urlopen(f"http://{agent.runtime_info()['metrics']}/metrics", timeout=5).read().decode()
    assert 'sdcwatch_job_stage_errors_total{job_id="gate-job"} 4.0' in text
    lines = cli("events", "--socket", str(agent.socket)).stdout.splitlines()
    said = [line for line in lines if "rank.stage_failed" in line]
    assert len(said) == 1, said
    assert " warning " in said[0] and "job/gate-job/rank/1" in said[0] and "compute at step 3" in said[0], said
