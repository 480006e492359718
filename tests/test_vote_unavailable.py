"""Issue 25: a job whose ranks cannot vote (plain FSDP: no replica of a shard) is visible at the agent: its
ranks' reports carry `vote_unavailable`, GetStatus' JobStatus shows it, the gauge
`sdcwatch_job_replica_vote_unavailable` is 1, and one WARNING event `job.vote_unavailable` is journaled
per job (not one per report). The Monitor side (it sets the reason on plain FSDP) is in
tests/test_integration_sharded.py."""
from __future__ import annotations

import urllib.request

import grpc

from agent_harness import cli
from checksums.reporter import StepReport, to_request
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc

WHY = "sharded parameters without exactly one replicate mesh dim (placements ('Shard(dim=0)',)): no vote"


def test_the_step_report_carries_the_reason() -> None:
    req = to_request(StepReport(job_id="j", rank=0, world_size=4, step=1, vote_unavailable=WHY))
    assert req.vote_unavailable == WHY
    assert to_request(StepReport(job_id="j", rank=0, world_size=4, step=1)).vote_unavailable == ""


def test_a_job_that_cannot_vote_shows_in_status_metrics_and_one_warning(agent) -> None:
    with grpc.insecure_channel(agent.target) as ch:
        stub = pb_grpc.AgentStub(ch)
        for step in (1, 2, 3):
            for rank in (0, 1):
                stub.ReportStep(pb.ReportStepRequest(job_id="fsdp-job", rank=rank, world_size=2, step=step,
                                                     fingerprint=[1, 2], checks_run=step, loss=1.0,
                                                     vote_unavailable=WHY), timeout=5)
        stub.ReportStep(pb.ReportStepRequest(job_id="ddp-job", rank=0, world_size=1, step=1), timeout=5)
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
    jobs = {j.job_id: j for j in status.jobs}
    assert jobs["fsdp-job"].vote_unavailable == WHY
    assert jobs["ddp-job"].vote_unavailable == ""
    text = urllib.request.urlopen(f"http://{agent.runtime_info()['metrics']}/metrics", timeout=5).read().decode()
    assert 'sdcwatch_job_replica_vote_unavailable{job_id="fsdp-job"} 1.0' in text
    assert 'sdcwatch_job_replica_vote_unavailable{job_id="ddp-job"} 0.0' in text
    lines = cli("events", "--socket", str(agent.socket)).stdout.splitlines()
    said = [line for line in lines if "job.vote_unavailable" in line]
    assert len(said) == 1 and " warning " in said[0] and "fsdp-job" in said[0], said
