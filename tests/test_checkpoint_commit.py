"""The commit protocol, verification, retention, peers and restore, in one process with simulated ranks
(Coordinator used directly as the rank's link), plus the gRPC service end to end."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from checkpoint.agent_link import GrpcAgentLink
from checkpoint.client import CheckpointClient
from checkpoint.coordinator import MAX_VOTES, VOTE_PRUNE_SLACK, Coordinator
from checkpoint.errors import (AgentUnavailableError, CommitError, CorruptCheckpointError, InvalidInputError,
                               NotInMemoryError, UnknownCheckpointError)
from checkpoint.locations import dir_store_for
from checkpoint.peers import Peer, Replicator, placement
from checkpoint.records import Restored
from checkpoint.restore import restore_from_plan
from checkpoint.shard_reader import RestoreReport
from checkpoint.snapshot import Snapshotter, SnapshotConfig
from ckpt_support import AgentServer, assert_same, flip_bit, job_id, node, state_dict
from daemon.checkpoint_service import CheckpointService


def save_all(co: Coordinator | list[Coordinator], job: str, step: int, world: int = 2,
             ranks: list[int] | None = None, **cfg: object) -> list:
    out = []
    for r in ranks if ranks is not None else range(world):
        link = co[r] if isinstance(co, list) else co
        snap = Snapshotter(link, job, r, world, SnapshotConfig(chunk_bytes=4096, **cfg))  # type: ignore[arg-type]
        out.append(snap.save(step, state_dict(r, step)).result(30))
        snap.close()
    return out


def restore(co: Coordinator, job: str, target: int | str, rank: int, report: RestoreReport | None = None):
    return restore_from_plan(co.restore_plan(job, target, rank), rank, dir_store_for, "cpu", report)


def test_commit_is_atomic_idempotent_and_restores_bit_for_bit(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    (r0,) = save_all(co, job, 5, ranks=[0])
    assert r0.state == "PENDING" and not r0.error
    assert [i.state for i in co.list(job)] == ["PENDING"]
    assert co.latest(job) is None
    with pytest.raises(UnknownCheckpointError, match="not committed"):
        co.restore_plan(job, 5, 0)
    (r1,) = save_all(co, job, 5, ranks=[1])
    assert r1.state == "COMMITTED" and r1.committed_now
    # the same shard again changes nothing: the rank that completed the record hears the same answer (its
    # first reply may have been lost in a failover), the record is counted once, another rank's retry is
    # not told it completed it
    m1 = co.shard_manifest(job, 5, 1)
    again = co.commit_shard(job, 5, 1, 2, m1.to_json())
    assert again.state == "COMMITTED" and again.committed_now
    assert co.stats["checkpoints_committed"] == 1
    m0 = co.shard_manifest(job, 5, 0)
    assert not co.commit_shard(job, 5, 0, 2, m0.to_json()).committed_now
    # a different manifest for a committed shard is refused
    other = co.shard_manifest(job, 5, 0).to_json().replace('"rank":0', '"rank":1').replace("rank-00000", "rank-00001")
    with pytest.raises((CommitError, InvalidInputError)):
        co.commit_shard(job, 5, 1, 2, other)
    for r in range(2):
        assert_same(restore(co, job, "latest", r), state_dict(r, 5))


def test_commit_checks_the_stored_blob(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    save_all(co, job, 1)
    m = co.shard_manifest(job, 1, 0)
    co.begin(job, 2, 0, 2)
    with pytest.raises(CommitError, match="not in this node's memory tier"):
        co.commit_shard(job, 2, 0, 2, m.to_json().replace('"step":1', '"step":2').replace("000000000001", "000000000002"))
    # a blob corrupted between write and commit is refused on commit
    co.store.put(m.blob.replace("000000000001", "000000000002"), co.store.get(m.blob))
    flip_bit(Path(co.location) / m.blob.replace("000000000001", "000000000002"), 10)
    with pytest.raises(CommitError, match="checksum"):
        co.commit_shard(job, 2, 0, 2, m.to_json().replace('"step":1', '"step":2').replace("000000000001", "000000000002"))


def test_missing_rank_means_no_commit_and_gc_removes_partial_blobs(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", pending_timeout_s=60), job_id()
    save_all(co, job, 1)
    save_all(co, job, 2, ranks=[0])  # rank 1 "died"
    assert co.latest(job).step == 1
    assert_same(restore(co, job, "latest", 0), state_dict(0, 1))
    assert co.store.list(f"{job}/000000000002/")
    now = time.time()
    assert co.maintain_job(job, now) == []          # not stale yet
    assert co.maintain_job(job, now + 120) == [2]   # timed out: aborted
    assert co.store.list(f"{job}/000000000002/") == []
    assert [i.step for i in co.list(job)] == [1]
    # the step can be saved again after an abort
    assert [r.state for r in save_all(co, job, 2)] == ["PENDING", "COMMITTED"]


def test_vote_mismatch_and_late_events(redis_server, tmp_path: Path) -> None:
    events: list[tuple] = []
    co, job = node(redis_server.port, tmp_path, "n0", publish=lambda *a: events.append(a), keep_committed=5), job_id()
    for step in (1, 2, 3):
        save_all(co, job, step)
    now = time.time()
    assert co.latest_verified(job) is None  # committed, but no vote yet
    co.on_job_event(job, 1, "vote_agreed", now)
    co.on_job_event(job, 2, "vote_agreed", now)
    co.on_job_event(job, 3, "vote_mismatch", now)
    assert co.latest_verified(job).step == 2
    assert co.latest(job).step == 3 and co.latest(job).state == "COMMITTED"
    # an SDC reported late, about step 2, revokes 2
    co.on_job_event(job, 2, "sdc", now)
    assert co.latest_verified(job).step == 1
    kinds = [e[0].name for e in events]
    assert kinds.count("checkpoint.verified") == 2 and "checkpoint.revoked" in kinds
    assert_same(restore(co, job, "latest_verified", 1), state_dict(1, 1))
    # rollback to 1 drops 2 and 3 and forgets their events; a new step 2 can verify
    co.on_job_event(job, 1, "rollback", now)
    assert [i.step for i in co.list(job)] == [1]
    save_all(co, job, 2)
    co.on_job_event(job, 2, "vote_agreed", now)
    assert co.latest_verified(job).step == 2
    with pytest.raises(InvalidInputError, match="unknown job event"):
        co.on_job_event(job, 2, "bogus", now)





def test_a_cut_lets_the_redone_saves_begin_afresh_and_the_late_rollback_event_keeps_them(
        redis_server, tmp_path: Path) -> None:
    """Issue 18: the agent saw in a rank's step report that the job went back to step 1 and cut the history at
    once; the ranks then saved steps 2 and 3 again before the `rollback` event (through the agent's feed,
    seconds late when it is loaded) reached the coordinator. The redone saves begin afresh (before: "already
    COMMITTED", the left history's bytes kept) and the late event, which drops only records begun before the
    agent saw the restore, keeps them. A restore alone (a reader) cuts nothing."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=10), job_id()
    for step in (1, 2, 3):
        save_all(co, job, step)
    co.on_job_event(job, 1, "vote_agreed", time.time())
    co.on_job_event(job, 2, "vote_mismatch", time.time())
    restore(co, job, 1, 0)
    assert [i.step for i in co.list(job)] == [1, 2, 3], "a restore alone (a reader) leaves the history"
    seen = time.time()                                      # the agent sees the ranks went back
    co.cut_history(job, 1, seen)
    assert [i.step for i in co.list(job)] == [1]
    time.sleep(0.01)
    assert [r.state for r in save_all(co, job, 2)] == ["PENDING", "COMMITTED"], "redone: a fresh record"
    assert [r.state for r in save_all(co, job, 3)] == ["PENDING", "COMMITTED"]
    co.on_job_event(job, 1, "rollback", seen)              # late, from the feed
    assert [i.step for i in co.list(job)] == [1, 2, 3], "the redone saves stay"
    co.on_job_event(job, 2, "vote_agreed", time.time())
    assert co.latest_verified(job).step == 2, "the old mismatch was forgotten; the redone step verifies"
    assert set(co.cuts(job)) == {1}
    time.sleep(0.01)
    co.on_job_event(job, 1, "rollback", time.time())       # a later restore of step 1: all after it go
    assert [i.step for i in co.list(job)] == [1]

def _trainers(link_for, job: str, world: int = 2) -> list[CheckpointClient]:
    return [CheckpointClient(link_for(r), job, r, world, config=SnapshotConfig(chunk_bytes=4096))
            for r in range(world)]


def _save(clients: list[CheckpointClient], step: int, content: int | None = None) -> list:
    """Each rank saves `step` (its bytes: state_dict(rank, content or step)); their results, in rank order."""
    return [c.save(step, state_dict(c.rank, step if content is None else content)).result(30) for c in clients]


def test_a_resume_that_saves_before_it_reports_a_step_cuts_the_history_at_its_restore(
        redis_server, tmp_path: Path) -> None:
    """Issue 18 follow-up: a job restores step 1 and saves step 2 before any step report showed the agent it went
    back. The begin of that save carries the rank's restore, and the agent cuts the history there first: the
    save lands afresh (before: "already COMMITTED", the left history's bytes kept and the save lost). The ranks
    restore at different moments; the step report's cut and the feed's late `rollback` event that follow keep
    the redone save (the restore the begins told is when the job went back); it verifies on the replicas'
    vote. A retried begin (its reply lost), another agent (a restart) and a look (`resume=False`) or a reader
    cut nothing; a later restore of the same step cuts again; a client without the field behaves as before."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=10), job_id()
    old = _trainers(lambda r: co, job)
    for step in (1, 2, 3):
        assert [r.state for r in _save(old, step, 100 + step)] == ["PENDING", "COMMITTED"]
    co.on_job_event(job, 1, "vote_agreed", time.time())
    co.on_job_event(job, 2, "vote_mismatch", time.time())
    assert_same(old[0].restore(1, resume=False), state_dict(0, 101))   # a look inside the running job
    assert _save(old, 4, 104)[1].state == "COMMITTED"
    for c in old:
        c.close()
    reader = CheckpointClient(co, job, 0, 2)   # an evaluation beside the job: restores, never saves
    assert_same(reader.restore(1), state_dict(0, 101))
    reader.close()
    assert [i.step for i in co.list(job)] == [1, 2, 3, 4], "a look and a reader's restore cut nothing"

    new = _trainers(lambda r: co, job)       # the job resumes from step 1: the ranks restore one after the other
    for c in new:
        assert_same(c.restore(1), state_dict(c.rank, 101))
        time.sleep(0.01)
    res = _save(new, 2)                       # before any step report
    assert [(r.state, r.error) for r in res] == [("PENDING", ""), ("COMMITTED", "")], res
    assert res[1].committed_now
    assert [i.step for i in co.list(job)] == [1, 2]
    assert set(co.cuts(job)) == {1}
    restored_at = new[1].snapshotter.restored.at
    # the step report that shows the job went back, and the feed's rollback event, come after the save
    co.cut_history(job, 1, time.time())
    co.on_job_event(job, 1, "rollback", time.time())
    assert [i.step for i in co.list(job)] == [1, 2], "the redone save stays"
    assert co.cuts(job)[1] == restored_at, "the tiers keep the copies made after the restore"
    co.on_job_event(job, 2, "vote_agreed", time.time())
    assert co.latest_verified(job).step == 2
    for c in new:
        assert_same(c.restore(2, resume=False), state_dict(c.rank, 2))
    # a begin retried after its reply was lost (a failover), on this agent or on a restarted one: nothing goes
    assert _save(new, 3)[1].state == "COMMITTED"
    again = node(redis_server.port, tmp_path, "n0", keep_committed=10)
    for co_ in (co, again):
        b = co_.begin(job, 3, 0, 2, restored=new[0].snapshotter.restored)
        assert (b.state, b.cut) == ("COMMITTED", False)
    assert [(i.step, i.shards) for i in co.list(job)] == [(1, 2), (2, 2), (3, 2)]
    # a restore time in the future is taken as now; a bad one is refused
    with pytest.raises(InvalidInputError, match="restored_at"):
        co.begin(job, 5, 0, 2, restored=Restored(1, float("nan")))
    # a later restore of the same step cuts again
    for c in new:
        c.restore(1)
    assert [r.state for r in _save(new, 2, 202)] == ["PENDING", "COMMITTED"]
    assert [i.step for i in co.list(job)] == [1, 2]
    assert_same(new[0].restore(2, resume=False), state_dict(0, 202))
    for c in new:
        c.close()

    class OlderLink:   # a sink without `restored` (a client from before): its begins go as before
        def begin(self, job_id: str, step: int, rank: int, world_size: int):
            return co.begin(job_id, step, rank, world_size)

        def commit_shard(self, *a, **kw):
            return co.commit_shard(*a, **kw)

        def restore_plan(self, *a):
            return co.restore_plan(*a)

    older = _trainers(lambda r: OlderLink(), job)
    older[0].restore(1)
    assert older[0].save(2, state_dict(0, 302)).result(30).state == "COMMITTED", "no cut: already COMMITTED"
    assert [i.step for i in co.list(job)] == [1, 2]
    for c in older:
        c.close()


def test_a_resume_over_grpc_cuts_at_its_restore_and_an_older_client_does_not(
        redis_server, tmp_path: Path, short_tmp: Path) -> None:
    """The same through the agent's gRPC service: the Begin request carries restored_step/restored_at; the
    agent's step-report cut and the rollback event afterwards keep the redone save; bad fields are
    INVALID_ARGUMENT; a Begin without them (an older client) cuts nothing."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=10), job_id()
    server = AgentServer(CheckpointService(co), short_tmp / "a.sock").start()
    links: list[GrpcAgentLink] = []

    def link(_rank: int) -> GrpcAgentLink:
        links.append(GrpcAgentLink.connect(server.target, 10))
        return links[-1]

    try:
        old = _trainers(link, job)
        for step in (1, 2, 3):
            _save(old, step, 100 + step)
        server.call(server.service.job_event(job, 1, "vote_agreed", time.time()))
        bare = links[0].begin(job, 2, 0, 2)            # an older client: no restore fields
        assert (bare.state, [i.step for i in co.list(job)]) == ("COMMITTED", [1, 2, 3])
        new = _trainers(link, job)
        for c in new:
            assert_same(c.restore("latest_verified"), state_dict(c.rank, 101))
        res = _save(new, 2)
        assert [r.state for r in res] == ["PENDING", "COMMITTED"] and res[1].committed_now, res
        server.call(server.service._cut_history(job, 1, time.time()))   # the step report's cut
        server.call(server.service.job_event(job, 1, "rollback", time.time()))
        server.call(server.service.job_event(job, 2, "vote_agreed", time.time()))
        assert new[0].latest_verified().step == 2
        assert [i.step for i in co.list(job)] == [1, 2]
        assert_same(new[1].restore(2, resume=False), state_dict(1, 2))
        for bad in (Restored(1, float("inf")), Restored(-1, time.time()), Restored(1, -5.0)):
            with pytest.raises(InvalidInputError, match="restored"):
                links[0].begin(job, 4, 0, 2, restored=bad)
        for c in old + new:
            c.close()
    finally:
        server.stop()


def test_retention_keeps_newest_k_and_verified(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=2), job_id()
    save_all(co, job, 1)
    co.on_job_event(job, 1, "vote_agreed", time.time())
    for step in (2, 3, 4):
        save_all(co, job, step)
    # 2 stays: the next to become VERIFIED when the votes reach it (policy.next_to_verify); 3 does not
    assert [(i.step, i.state) for i in co.list(job)] == [(1, "VERIFIED"), (2, "COMMITTED"), (3, "COMMITTED"),
                                                         (4, "COMMITTED")]
    co.on_job_event(job, 2, "vote_agreed", time.time())
    save_all(co, job, 5)   # 1: the oldest VERIFIED inside the rollback span (160 steps); 3: next to verify
    assert [(i.step, i.state) for i in co.list(job)] == [(1, "VERIFIED"), (2, "VERIFIED"), (3, "COMMITTED"),
                                                         (4, "COMMITTED"), (5, "COMMITTED")]
    co.on_job_event(job, 5, "vote_agreed", time.time())
    save_all(co, job, 6)
    assert [(i.step, i.state) for i in co.list(job)] == [(1, "VERIFIED"), (5, "VERIFIED"), (6, "COMMITTED")]
    assert co.store.list(f"{job}/000000000002/") == [] and co.store.list(f"{job}/000000000004/") == []
    # a memory cap below one checkpoint: unverified go first, the only verified copy stays
    capped = node(redis_server.port, tmp_path, "n0", keep_committed=2, memory_cap_bytes=1)
    capped.maintain_job(job, time.time())
    assert [(i.step, i.state) for i in co.list(job)] == [(5, "VERIFIED")]


def test_flipped_bit_uses_peer_copy_and_both_bad_is_a_clear_error(redis_server, tmp_path: Path) -> None:
    a, b = node(redis_server.port, tmp_path, "a"), node(redis_server.port, tmp_path, "b")
    job = job_id()
    Replicator(a, [Peer("b", b.store, b.location)])
    Replicator(b, [Peer("a", a.store, a.location)])
    save_all([a, b], job, 7)
    for r, (src, peer) in enumerate([(a, b), (b, a)]):
        Replicator(src, [Peer(peer.node, peer.store, peer.location)]).replicate(job, 7, r)
    m0 = a.shard_manifest(job, 7, 0)
    assert {c.node for c in a.info(job, 7).copies if c.rank == 0} == {"a", "b"}
    flip_bit(Path(a.location) / m0.blob, m0.tensors[0].offset + 3)
    rep = RestoreReport()
    assert_same(restore(a, job, 7, 0, rep), state_dict(0, 7))
    assert rep.fallbacks == 1 and "checksum mismatch" in rep.failures[0]
    flip_bit(Path(b.location) / m0.blob, m0.tensors[0].offset + 3)
    with pytest.raises(CorruptCheckpointError) as e:
        restore(a, job, 7, 0)
    assert "state_dict/model/w" in str(e.value) and "a:" in str(e.value) and "b:" in str(e.value)
    # a lost node: rank 1's copy on b gone, restored from a
    (Path(b.location) / b.shard_manifest(job, 7, 1).blob).unlink()
    assert_same(restore(a, job, 7, 1), state_dict(1, 7))


def test_placement() -> None:
    assert placement(0, 4, jump=1, factor=2) == [1]
    assert placement(3, 4, jump=2, factor=2) == [1]
    assert placement(0, 8, jump=2, factor=3) == [2, 4]
    with pytest.raises(InvalidInputError):
        placement(0, 2, jump=2, factor=2)
    with pytest.raises(InvalidInputError):
        placement(0, 2, factor=3)


def test_redis_restarted_empty_says_not_in_memory(fresh_redis, tmp_path: Path) -> None:
    co, job = node(fresh_redis.port, tmp_path, "n0"), job_id()
    save_all(co, job, 1)
    fresh_redis.restart_empty()
    with pytest.raises(NotInMemoryError, match="not in memory"):
        co.restore_plan(job, "latest", 0)
    assert co.list(job) == []
    # a save in flight when Redis lost its records fails cleanly (a result with the reason), no crash

    class RestartBetween:
        def begin(self, *a):
            r = co.begin(*a)
            fresh_redis.restart_empty()
            return r

        def commit_shard(self, *a, **kw):
            return co.commit_shard(*a, **kw)

    snap = Snapshotter(RestartBetween(), job, 0, 2)
    res = snap.save(2, state_dict(0, 2)).result(20)
    assert res.state == "FAILED" and "NotInMemoryError" in res.error and "begin first" in res.error
    snap.close()


def test_bad_inputs(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    save_all(co, job, 1)
    with pytest.raises(UnknownCheckpointError, match="no checkpoint at step 99"):
        co.restore_plan(job, 99, 0)
    with pytest.raises(InvalidInputError):
        co.restore_plan(job, "newest", 0)
    with pytest.raises(InvalidInputError, match="job id"):
        Snapshotter(co, "../evil", 0, 1)
    with pytest.raises(InvalidInputError, match="job id"):
        co.begin("a/b", 1, 0, 1)
    snap = Snapshotter(co, job, 0, 2)
    with pytest.raises(InvalidInputError, match=r"state_dict/opt/fn: builtins.builtin_function_or_method is not supported"):
        snap.save(2, {"w": torch.zeros(2), "opt": {"fn": print}})
    with pytest.raises(CommitError, match="world size"):
        co.begin(job, 1, 0, 3)
    snap.close()


def test_second_save_waits_or_skips_never_corrupts(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    gate = threading.Event()

    class SlowLink:
        def begin(self, *a):
            gate.wait(10)
            return co.begin(*a)

        def commit_shard(self, *a, **kw):
            return co.commit_shard(*a, **kw)

    skipper = Snapshotter(SlowLink(), job, 0, 1, SnapshotConfig(policy="skip"))
    first = skipper.save(1, state_dict(0, 1))
    assert skipper.save(2, state_dict(0, 2)) is None  # skipped: step 1 still writing
    gate.set()
    assert first.result(10).state == "COMMITTED"
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(policy="wait"))
    h2, h3 = snap.save(2, state_dict(0, 2)), snap.save(3, state_dict(0, 3))
    assert h2.result(10).state == h3.result(10).state == "COMMITTED"
    for s in (2, 3):
        assert_same(restore(co, job, s, 0), state_dict(0, s))
    snap.close()
    assert co.stats["saves_skipped"] == 0
    assert skipper.save(4, state_dict(0, 4)).result(10).state == "COMMITTED"
    assert co.stats["saves_skipped"] == 1  # reported with the skipping rank's next commit
    assert {"save_blocking", "save_safe", "save_commit"} <= {name for name, _ in co.observations}
    skipper.close()


def test_grpc_service_end_to_end(redis_server, tmp_path: Path, short_tmp: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    server = AgentServer(CheckpointService(co), short_tmp / "a.sock").start()
    try:
        clients = [CheckpointClient(GrpcAgentLink.connect(server.target, 5), job, r, 2) for r in range(2)]
        for c in clients:
            assert c.save(3, state_dict(c.rank, 3)).result(20).error == ""
        assert [(i.step, i.state) for i in clients[0].list()] == [(3, "COMMITTED")]
        assert clients[0].latest_verified() is None
        server.call(server.service.job_event(job, 3, "vote_agreed", time.time()))
        assert clients[1].latest_verified().step == 3
        for c in clients:
            assert_same(c.restore("latest_verified"), state_dict(c.rank, 3))
        with pytest.raises(UnknownCheckpointError, match="step 4"):
            clients[0].restore(4)
        bad = CheckpointClient(GrpcAgentLink.connect(server.target, 5), job, 0, 2)
        bad.job_id = "x/../y"
        with pytest.raises(InvalidInputError, match="job id"):
            bad.list()
        assert server.call(server.service.maintain_once())[job] == []
        for c in clients + [bad]:
            c.close()
    finally:
        server.stop()


def test_agent_down_never_blocks_training_past_the_deadline(short_tmp: Path) -> None:
    client = CheckpointClient(GrpcAgentLink.connect(f"unix:{short_tmp}/nobody.sock", 0.5), job_id(), 0, 1)
    t0 = time.monotonic()
    h = client.save(1, state_dict(0, 1))
    res = h.result(10)
    assert res.state == "FAILED" and "unavailable" in res.error
    with pytest.raises(AgentUnavailableError):
        client.restore("latest")
    assert time.monotonic() - t0 < 5
    client.close()


def test_the_votes_hash_is_bounded_and_an_old_verified_checkpoint_keeps_its_vote(redis_server, tmp_path: Path) -> None:
    """Issue 20 High 5: the Redis `votes` hash grew one field per step forever and was read whole (HGETALL) on
    every job event. Now it is pruned past MAX_VOTES (keeping the votes of live records) and read per record."""
    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    save_all(co, job, 5)
    co.on_job_event(job, 5, "vote_agreed", time.time())
    assert [i.state for i in co.list(job)] == ["VERIFIED"]
    votes_key = co._jk(job, "votes")
    calls: list[str] = []
    real = co.redis.execute_command

    def recording(*args, **kw):   # the commands the coordinator sends (a wrapper; the real Redis answers)
        calls.append(str(args[0]).upper())
        return real(*args, **kw)

    co.redis.execute_command = recording
    for step in range(6, 6 + 3 * MAX_VOTES):
        co.on_job_event(job, step, "vote_agreed", time.time())
    assert co.redis.hlen(votes_key) <= MAX_VOTES + VOTE_PRUNE_SLACK
    assert "HGETALL" not in calls, "the votes hash is never read whole"
    assert co.redis.hget(votes_key, "5") is not None, "a live record's vote is kept"
    assert [i.state for i in co.list(job)] == ["VERIFIED"], "pruning never revokes a verified checkpoint"


def test_tombstones_leave_the_index_so_a_commit_never_walks_every_evicted_step(redis_server, tmp_path: Path) -> None:
    """Saving every step evicts a record per commit; their tombstones (kept tombstone_ttl_s for late ranks)
    must not make listing, and so every commit, walk every step evicted in the last hour."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=2), job_id("tomb")
    for step in range(1, 13):
        assert save_all(co, job, step, world=1)[0].state == "COMMITTED"
    idx = co._jk(job, "idx")
    assert sorted(int(x) for x in co.redis.zrange(idx, 0, -1)) == [11, 12]
    assert co.info(job, 3).state == "EVICTED"            # the tombstone itself is still there
    late = save_all(co, job, 3, world=1)[0]             # ... and a late rank re-saving it starts it anew
    assert late.state in ("COMMITTED", "VERIFIED", "EVICTED")
    assert [i.step for i in co.list(job) if i.state in ("COMMITTED", "VERIFIED")][-2:] == [11, 12]
    # index entries of a tombstone or an expired record (indexed by an older agent) are pruned when listed
    co.redis.zadd(idx, {"5": 5, "7777": 7777})
    co.list(job)
    assert co.redis.zscore(idx, "5") is None and co.redis.zscore(idx, "7777") is None
    # every record gone: still a known job, not "Redis restarted empty"
    for i in co.list(job):
        co._drop(job, i.step, "EVICTED", "test", time.time())
    with pytest.raises(UnknownCheckpointError):
        co.resolve(job, "latest")
