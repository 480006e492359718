"""Issue 18 item 3: a rollback goes to a checkpoint older than the anomaly's START, and nothing saved at or
after it is VERIFIED. Run through the agent's own parts: the ranks' reports into `JobTracker` (the rules),
its job events into the checkpoint coordinator in order (what `CheckpointFeed` does), and a rollback plan by
`RollbackPlanner` over `CheckpointService.verified_steps`; checkpoints saved by `Snapshotter` with real
bytes (replica bytes compared). Three cases: a loss anomaly detected steps after it began, a replica
mismatch that persists past the in-place repair's grace, and an unresolved compute fault."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from checkpoint.snapshot import SnapshotConfig, Snapshotter
from ckpt_support import job_id, node
from daemon.checkpoint_service import CheckpointService
from daemon.jobs import MAJORITY_REPAIR_STEPS, JobTracker
from daemon.rollback import RollbackPlanner
from probes.loss_detector import RollbackPolicy
from proto.sdcwatch.v1 import agent_pb2 as pb


class _Checkpoints:
    """The agent's checkpoint service, for what the planner reads: its own `verified_steps`."""

    verified_steps = CheckpointService.verified_steps

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator


class _Publisher:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def publish(self, kind: Any, subject: str, message: str, details: dict | None = None) -> None:
        self.events.append((kind.name, dict(details or {})))


class Agent:
    """The report path of daemon/agent.py with its real rules, coordinator and planner."""

    def __init__(self, co: Any, job: str) -> None:
        self.co, self.job = co, job
        self.policy = RollbackPolicy(skip_batches=0)
        self.tracker = JobTracker(rollback=self.policy)
        self.publisher = _Publisher()
        self.planner = RollbackPlanner(self.policy, checkpoints=_Checkpoints(co), jobs=self.tracker,
                                       publisher=self.publisher, background=None)  # type: ignore[arg-type]
        self.anomalies: list[tuple[int, Any]] = []    # (the step reported when planned, the anomaly)

    def report(self, req: pb.ReportStepRequest) -> None:
        now = time.time()
        out = self.tracker.report(req, now)
        if out is None:
            return
        for _, ev in out.rollbacks:
            self.anomalies.append((req.step, ev))
            asyncio.run(self.planner.plan(self.job, ev, len(self.anomalies)))
        for step, kind, reason in out.job_events:
            self.co.on_job_event(self.job, step, kind, now, reason)

    @property
    def target(self) -> int | None:
        pending = self.tracker.jobs[self.job].directive
        return None if pending is None else int(pending.directive.target_step)


def _save(co: Any, job: str, step: int, world: int, replica_set: str) -> None:
    for r in range(world):
        g = torch.Generator().manual_seed(step * 10 + (0 if replica_set else r))   # replicas: the same bytes
        state = {"model": {"w": torch.randn(256, generator=g)}, "step": step}
        snap = Snapshotter(co, job, r, world, SnapshotConfig(chunk_bytes=4096), replica_set=replica_set)
        assert snap.save(step, state).result(30).error == ""
        snap.close()


def _vote_req(job: str, rank: int, world: int, step: int, agreed: bool) -> pb.ReportStepRequest:
    req = pb.ReportStepRequest(job_id=job, rank=rank, world_size=world, step=step + 1, replica_group="world",
                               fingerprint=[1])
    req.vote.checked, req.vote.agreed, req.vote.step, req.vote.replicas = True, agreed, step, world
    req.vote.method = "majority"
    if not agreed:
        req.vote.suspects.add(rank=world - 1, host="h", gpu_uuid=f"GPU-{world - 1}")
    return req


def _ever_verified(co: Any) -> set[int]:
    return {d["step"] for kind, _, _, d in co._h18_events if kind == "checkpoint.verified"}


def _node(redis_server: Any, tmp_path: Path) -> Any:
    events: list[tuple] = []
    co = node(redis_server.port, tmp_path, "n0", publish=lambda kind, job, msg, d: events.append(
        (kind.name, job, msg, dict(d))), keep_committed=100)
    co._h18_events = events
    return co


def test_a_loss_anomaly_rolls_back_to_before_its_start_not_its_detection(redis_server, tmp_path: Path) -> None:
    """Two replicas, loss ~1.0 for 200 steps then 10x: the detector (patience) sees it steps after it began.
    Checkpoints between the start and the detection were VERIFIED meanwhile (their votes agreed): they are
    revoked, and the target is the newest VERIFIED one strictly older than the START step."""
    co, job = _node(redis_server, tmp_path), job_id("loss")
    agent = Agent(co, job)
    verified_before: set[int] = set()
    for step in range(240):
        if step >= 150 and step % 5 == 0:
            _save(co, job, step, 2, "world")
        for rank in range(2):
            loss = (1.0 + 0.01 * ((step * 7 + rank) % 5)) * (10.0 if step >= 200 else 1.0)
            req = _vote_req(job, rank, 2, step, agreed=True)
            req.step, req.loss = step, loss
            agent.report(req)
        if agent.anomalies:
            break
        verified_before = {i.step for i in co.list(job) if i.state == "VERIFIED"}
    assert agent.anomalies, "the 10x excursion is a critical loss event"
    detected_at, ev = agent.anomalies[0]
    assert ev.start_step == 200 and detected_at > ev.start_step, (detected_at, ev)
    assert any(s >= ev.start_step for s in verified_before), \
        f"a checkpoint after the start was VERIFIED before the detection (the case under test): {verified_before}"
    assert agent.target == 195, "the newest VERIFIED checkpoint strictly older than the anomaly's start"
    states = {i.step: i.state for i in co.list(job)}
    assert all(state != "VERIFIED" for s, state in states.items() if s >= ev.start_step), states
    assert states[195] == "VERIFIED"


def test_a_replica_mismatch_rolls_back_to_before_its_first_step(redis_server, tmp_path: Path) -> None:
    """Three replicas; the votes disagree from step M = 115 for longer than the in-place repair may take
    (the device gate's lag): the rollback goes to the newest VERIFIED checkpoint older than M, and nothing
    saved from M on is VERIFIED while they differ (bytes identical here: the events decide). When the
    replicas agree again at R = 123 (a late repair in place), the checkpoints saved from M to R - 1 are
    dropped, never having been VERIFIED, and those from R on verify again."""
    co, job = _node(redis_server, tmp_path), job_id("mismatch")
    agent = Agent(co, job)
    m, persists = 115, MAJORITY_REPAIR_STEPS + 3
    repaired = m + persists
    for step in range(100, 140):
        if step % 5 == 0:
            _save(co, job, step, 3, "world")
        for rank in range(3):
            agent.report(_vote_req(job, rank, 3, step, agreed=not m <= step < repaired))
        if step == repaired - 1:
            assert _ever_verified(co) == {100, 105, 110}, "nothing saved from the mismatch on was VERIFIED"
    assert len(agent.anomalies) == 1, "one incident, one plan"
    planned_at, inc = agent.anomalies[0]
    assert inc.first_step == m and planned_at > m + MAJORITY_REPAIR_STEPS
    assert agent.target == 110
    assert agent.tracker.jobs[job].directive.anomaly_start == m
    ever = _ever_verified(co)
    assert not [s for s in ever if m <= s < repaired], f"saved while the replicas differed, VERIFIED: {ever}"
    states = {i.step: i.state for i in co.list(job)}
    assert 115 not in states and 120 not in states, f"dropped once the replicas were repaired: {states}"
    assert [s for s, st in sorted(states.items()) if st == "VERIFIED"] == [100, 105, 110, 125, 130, 135]


def test_an_unresolved_compute_fault_keeps_later_checkpoints_from_verified(redis_server, tmp_path: Path) -> None:
    """A job without replicas (its checks vouch instead of a vote): a compute fault the gate did not resolve at
    step 130 keeps every checkpoint from 130 on from VERIFIED while the checks go on clean; an audit that finds
    a fault at 145 which may date back to 125 (its last clean audit) revokes the one at 125 too."""
    co, job = _node(redis_server, tmp_path), job_id("compute")
    agent = Agent(co, job)
    for step in range(100, 160):
        if step % 5 == 0:
            _save(co, job, step, 2, "")
        for rank in range(2):
            req = pb.ReportStepRequest(job_id=job, rank=rank, world_size=2, step=step, fingerprint=[1])
            if step in (130, 145):
                audit = step == 145
                f = req.compute.add(step=step, detector="audit" if audit else "stats", suspect=1,
                                    cause="transient" if audit else "unresolved", dropped=not audit,
                                    since_step=125 if audit else step, detail="injected")
                f.faulty.add(rank=1, host="h", gpu_uuid="GPU-1")
            agent.report(req)
        if step == 140:
            assert {i.step for i in co.list(job) if i.state == "VERIFIED"} == {100, 105, 110, 115, 120, 125}
    ever = _ever_verified(co)
    assert ever and max(ever) == 125 and all(s < 130 for s in ever)
    states = {i.step: i.state for i in co.list(job)}
    assert [s for s, st in sorted(states.items()) if st == "VERIFIED"] == [100, 105, 110, 115, 120], states
    assert not agent.anomalies, "a compute fault asks for no rollback: its update was dropped or it is flagged"


def test_a_repair_in_place_drops_what_was_saved_while_the_replicas_differed(redis_server, tmp_path: Path):
    """The coordinator's "repaired" event: records from the first vote mismatch before it are dropped, those
    mismatches stop blocking later checkpoints, any other bad event still blocks from its step."""
    co, job = _node(redis_server, tmp_path), job_id("repaired")
    now = time.time()
    _save(co, job, 10, 3, "world")
    co.on_job_event(job, 10, "vote_agreed", now)
    co.on_job_event(job, 15, "vote_mismatch", now)
    _save(co, job, 20, 3, "world")
    co.on_job_event(job, 40, "sdc", now)
    _save(co, job, 30, 3, "world")
    co.on_job_event(job, 30, "vote_agreed", now)
    assert {i.step: i.state for i in co.list(job)} == {10: "VERIFIED", 20: "COMMITTED", 30: "COMMITTED"}
    co.on_job_event(job, 30, "repaired", now)
    assert {i.step: i.state for i in co.list(job)} == {10: "VERIFIED", 30: "VERIFIED"}
    _save(co, job, 40, 3, "world")
    co.on_job_event(job, 40, "vote_agreed", now)
    assert co.info(job, 40).state == "COMMITTED", "the SDC event at 40 still blocks"
    assert 20 not in _ever_verified(co)


def test_a_repair_in_place_clears_the_compute_checks_diverged_steps_in_either_order(redis_server, tmp_path):
    """HSDP-like: a weight flip on one of three replicas is seen by the vote (its groups disagree at 40) and by
    the compute checks (`diverged` at 41: the replicas compute from different weights, no GPU named, update
    dropped); the replica is repaired in place and the votes agree from 41. Through the agent's report path,
    the checkpoints from 41 on are VERIFIED again whichever the agent heard first, the finding or the
    agreeing votes; a `diverged` at a later step still blocks from there. Before, the finding was an `sdc`
    checkpoint event only a rollback cleared: after the repair no checkpoint of the job was VERIFIED again."""
    from checksums.reporter import ComputeFinding, StepReport, to_request

    def diverged(step: int) -> pb.ReportStepRequest:
        f = ComputeFinding(step=step, detector="nonfinite", suspect=2, cause="diverged", faulty=(), dropped=True,
                           detail="replicas differ", score=0.0, bucket=-1, stat="", where=(), since_step=step)
        return to_request(StepReport(job_id=job, rank=0, world_size=3, step=step + 1, compute=(f,)))

    for order in ("finding first", "votes first"):
        co, job = _node(redis_server, tmp_path), job_id(f"div-{order.split()[0]}")
        agent = Agent(co, job)
        for step in range(35, 52):
            if step % 5 == 0 or step == 41:
                _save(co, job, step, 3, "world")
            if step == 41 and order == "finding first":
                agent.report(diverged(41))
            for rank in range(3):
                agent.report(_vote_req(job, rank, 3, step, agreed=step != 40))
            if step == 41 and order == "votes first":
                agent.report(diverged(41))
            if step == 48:
                agent.report(diverged(48))           # another incident: blocks from its step
        states = {i.step: i.state for i in co.list(job)}
        assert [s for s, st in sorted(states.items()) if st == "VERIFIED"] == [35, 41, 45], (order, states)
        assert states.get(40) != "VERIFIED", "saved while the replicas differed"
        assert states[50] == "COMMITTED", (order, states)
        assert not agent.anomalies, "a majority repaired in place: no rollback planned"


def test_a_persistent_compute_fault_stops_the_job_naming_the_checkpoint_to_restart_from(
        redis_server, tmp_path: Path) -> None:
    """An audit at step 145 finds rank 1's GPU computing wrong (persistent), its updates suspect from 126 (the
    rank's last clean audit): the agent asks every rank to STOP, naming VERIFIED step 125, the newest older
    than 126, to restart from without the GPU (a rollback on it would compute wrong again); nothing from 126
    on is VERIFIED; a loss rollback planned after it does not replace the STOP; the job's restart from 125
    closes the incident."""
    co, job = _node(redis_server, tmp_path), job_id("stop")
    agent = Agent(co, job)
    got: dict[int, list[pb.Directive]] = {0: [], 1: []}
    for step in range(100, 152):
        if step % 5 == 0:
            _save(co, job, step, 2, "")
        for rank in range(2):
            req = pb.ReportStepRequest(job_id=job, rank=rank, world_size=2, step=step, fingerprint=[1])
            if step == 145:
                f = req.compute.add(step=step, detector="audit", suspect=1, cause="persistent", dropped=True,
                                    since_step=126, detail="injected")
                f.faulty.add(rank=1, host="h", gpu_uuid="GPU-1")
            out = agent.tracker.report(req, time.time())
            if out is not None:
                got[rank] += out.directives
                for _, ev in out.rollbacks:
                    agent.anomalies.append((req.step, ev))
                    asyncio.run(agent.planner.plan(job, ev, 7))
                for s, kind, reason in out.job_events:
                    co.on_job_event(job, s, kind, time.time(), reason)
    assert [type(ev).__name__ for _, ev in agent.anomalies] == ["ComputeIncident"]
    for rank in (0, 1):                                      # each rank handed it once, in a later reply
        assert [(d.kind, d.target_step) for d in got[rank]] == [(pb.Directive.KIND_STOP, 125)], got[rank]
    reason = got[0][0].reason
    assert "persistent compute fault at step 145" in reason and "GPU-1" in reason and "step 125" in reason
    [(kind, details)] = [e for e in agent.publisher.events if e[0] == "job.stop_directive"]
    assert details["target_step"] == 125 and details["verified"] and details["gpu_uuids"] == ["GPU-1"]
    assert details["first_step"] == 126 and details["cause_seq"] == 7
    states = {i.step: i.state for i in co.list(job)}
    assert max(s for s, st in states.items() if st == "VERIFIED") == 125, states
    rollback = pb.Directive(kind=pb.Directive.KIND_ROLLBACK, target_step=120, reason="a loss spike")
    assert not agent.tracker.set_directive(job, rollback, 140, time.time())
    assert agent.tracker.jobs[job].directive.directive.kind == pb.Directive.KIND_STOP
    for rank in range(2):                                    # the job restarts from 125 (without the GPU)
        agent.report(pb.ReportStepRequest(job_id=job, rank=rank, world_size=2, step=126, fingerprint=[1]))
    assert agent.tracker.jobs[job].directive is None and not agent.tracker.stop_open(job, 126)
