"""ReportStep validation: the fast path for the usual report never accepts what the full check rejects."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon import validation
from proto.sdcwatch.v1 import agent_pb2 as pb

GOOD = dict(job_id="job-1", rank=3, world_size=8, step=10, host="node-a.example", replica_group="grp/0",
            gpu_uuid="GPU-00000000-0000-0000-0000-000000000000", time=1.7e9, micro_batch=0, loss=2.5,
            grad_norm=1.0)
BAD_NUMBERS = [-1, -0.0, math.nan, math.inf, -math.inf, 1 << 20, (1 << 20) + 1, 0, 8, 9]
BAD_NAMES = ["", "a:b", "bad name", "-x", "x" * 300, "MIG-GPU-1/2/3", "node-a.example", "job-1"]


@st.composite
def reports(draw: st.DrawFn) -> pb.ReportStepRequest:
    """A usual report with a few fields (often none) set to edge values, and sometimes a rare part."""
    fields = dict(GOOD)
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from([*GOOD, "loss_scale", "step_s", "check_s", "data_s"]))
        if isinstance(GOOD.get(name), str):
            fields[name] = draw(st.sampled_from(BAD_NAMES))
        else:
            value = draw(st.sampled_from(BAD_NUMBERS))
            if name in ("rank", "world_size", "step", "micro_batch") and not isinstance(value, int):
                value = -1
            fields[name] = value
    timings = {k: fields.pop(k) for k in ("step_s", "check_s", "data_s") if k in fields}
    req = pb.ReportStepRequest(**fields, fingerprint=[1, 2, 3, 4] * draw(st.sampled_from([1, 4, 5])))
    if timings or draw(st.booleans()):
        req.timings.CopyFrom(pb.StepTimings(**{"step_s": 0.03, **timings}))
    rare = draw(st.sampled_from(["", "", "", "", "labels", "canary", "vote", "frozen"]))
    if rare == "labels":
        req.labels[draw(st.sampled_from(["k", "1bad"]))] = "v" * draw(st.sampled_from([1, 300]))
    elif rare == "canary":
        req.canary.status = draw(st.sampled_from(["PASS", "FAIL", "maybe"]))
    elif rare == "vote":
        req.vote.step = 1
        req.vote.suspects.add(rank=draw(st.sampled_from([0, 9])), host=draw(st.sampled_from(BAD_NAMES)))
    elif rare == "frozen":
        req.frozen_changed.append("w" * draw(st.sampled_from([3, 600])))
    return req


@settings(max_examples=600, deadline=None)
@given(reports())
def test_the_fast_path_agrees_with_the_full_check(req: pb.ReportStepRequest) -> None:
    full = validation._report_step_error(req)   # noqa: SLF001 (also fills the name caches, as a first report does)
    if validation._plain_and_valid(req):        # noqa: SLF001
        assert full is None, f"fast path accepted a report the full check rejects: {full}"
    assert validation.check_report_step(req) == full
    if full is None and req == pb.ReportStepRequest(**GOOD, fingerprint=[1, 2, 3, 4],
                                                            timings=req.timings):
        assert validation._plain_and_valid(req), "the usual report must take the fast path"   # noqa: SLF001


def test_a_name_accepted_as_one_kind_is_not_taken_for_another() -> None:
    """Job ids may hold ':' and hosts may not: accepting job id 'h:1' must not make host 'h:1' valid."""
    ok = pb.ReportStepRequest(job_id="h:1", rank=0, step=1)
    assert validation.check_report_step(ok) is None
    bad = pb.ReportStepRequest(job_id="h:1", rank=0, step=2, host="h:1")
    assert "not a hostname" in (validation.check_report_step(bad) or "")


def test_the_usual_report_takes_the_fast_path() -> None:
    req = pb.ReportStepRequest(job_id="fast-1", rank=3, world_size=8, step=10, loss=2.5, grad_norm=1.0,
                               fingerprint=[1, 2, 3, 4], time=1.7e9, host="node-1",
                               gpu_uuid="GPU-00000000-0000-0000-0000-000000000001",
                               timings=pb.StepTimings(step_s=0.03, check_s=0.0001))
    assert validation.check_report_step(req) is None      # the first: names checked and remembered
    assert validation._plain_and_valid(req)                # noqa: SLF001
    req.rank = 8                                           # not below world_size
    assert not validation._plain_and_valid(req)            # noqa: SLF001
    assert "not below world_size" in (validation.check_report_step(req) or "")


def test_a_checked_vote_names_how_many_replicas_it_compared() -> None:
    """The agent sums the agreeing groups' sizes to know when a step is checked on every rank: a checked
    vote of fewer than 2 replicas, or of more than the job's ranks, is refused with the reason."""
    def vote(replicas: int, checked: bool = True) -> str | None:
        req = pb.ReportStepRequest(job_id="v-1", rank=0, world_size=4, step=3, replica_group="world")
        req.vote.checked, req.vote.agreed, req.vote.step, req.vote.replicas = checked, True, 2, replicas
        return validation.check_report_step(req)

    assert vote(2) is None and vote(4) is None
    for bad in (0, 1, 5):
        assert "a checked vote compares 2 or more replicas" in (vote(bad) or ""), bad
    assert vote(0, checked=False) is None, "an unchecked vote (none this step) carries no count"
