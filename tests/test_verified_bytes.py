"""Issue 18 item 1: VERIFIED means the bytes saved agree across replicas, not that a vote at that step number
agreed. A flip in the bytes of one rank's saved shard after the copy (before its fingerprint and commit)
leaves the checkpoint COMMITTED and never VERIFIED, names the odd rank, and is journaled; a job without
replicas is vouched for by its own fingerprints and clean in-step checks, and `ckpt show` says which."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint import replica_bytes
from checkpoint.coordinator import Coordinator
from checkpoint.manifest import ShardManifest, TensorEntry
from checkpoint.snapshot import Snapshotter, SnapshotConfig
from ckpt_support import job_id, node
from daemon.cli_ckpt import format_show


def replicated_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)   # the same on every replica
    return {"model": {"w": torch.randn(3000, generator=g), "b": torch.randn(50, generator=g)}, "step": step}


class FlipAfterCopy:
    """Failure injection around the rank's link: once the shard is copied into its (private) staging buffer
    and the save's Begin is answered, one bit of the staged bytes flips: what a host-memory fault between the
    copy and the commit does. The fingerprint and checksums are then taken of the flipped bytes."""

    def __init__(self, link: Coordinator, byte: int) -> None:
        self.link, self.byte, self.snapshotter = link, byte, None

    def begin(self, *a: Any) -> Any:
        out = self.link.begin(*a)
        self.snapshotter._arena.buf[self.byte] ^= 0x10
        return out

    def commit_shard(self, *a: Any, **kw: Any) -> Any:
        return self.link.commit_shard(*a, **kw)


def save_replicas(co: Coordinator | list[Coordinator], job: str, step: int, world: int,
                  flip_rank: int | None = None, replica_set: str = "world") -> list:
    out = []
    for r in range(world):
        mine = co[r % len(co)] if isinstance(co, list) else co   # a list: rank r commits through node r
        link: Any = FlipAfterCopy(mine, 100) if r == flip_rank else mine
        snap = Snapshotter(link, job, r, world, SnapshotConfig(chunk_bytes=4096, staging="private"),
                           replica_set=replica_set)
        if r == flip_rank:
            link.snapshotter = snap
        out.append(snap.save(step, replicated_state(step)).result(30))
        snap.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_flip_in_the_saved_bytes_is_never_verified(redis_server, tmp_path: Path, world: int) -> None:
    events: list[tuple] = []
    co, job = node(redis_server.port, tmp_path, "n0", publish=lambda *a: events.append(a), keep_committed=5), job_id()
    save_replicas(co, job, 50, world)
    res = save_replicas(co, job, 100, world, flip_rank=1)
    assert all(r.error == "" for r in res), res
    assert co.info(job, 100).state == "COMMITTED", "the flipped shard passed its own checksums: it commits"
    save_replicas(co, job, 150, world)
    co.on_job_event(job, 150, "vote_agreed", time.time())   # the live weights agree: the copy was hit
    states = {i.step: i.state for i in co.list(job)}
    assert states == {50: "VERIFIED", 100: "COMMITTED", 150: "VERIFIED"}
    bad = co.info(job, 100)
    odd = [1] if world == 3 else [0, 1]
    assert "bytes mismatch" in bad.vouched_by and "model/w" in bad.vouched_by
    assert f"odd ranks {','.join(map(str, odd))}" in bad.vouched_by
    assert "never VERIFIED" in bad.reason
    differ = [e for e in events if e[0].name == "checkpoint.replicas_differ"]
    assert len(differ) == 1 and differ[0][3]["odd_ranks"] == odd and differ[0][3]["step"] == 100
    good = co.info(job, 150)
    assert good.vouched_by.startswith("bytes agreed: replica set 'world' (ranks "
                                      + ",".join(map(str, range(world))) + "): 3 tensor fingerprints identical")   # w, b, step
    shown = format_show(_pb(good), time.time())
    assert "vouched by: bytes agreed" in shown
    # a later vote never verifies the flipped checkpoint: bytes, not step numbers
    co.on_job_event(job, 200, "vote_agreed", time.time())
    assert co.info(job, 100).state == "COMMITTED"


def test_no_replicas_are_vouched_for_by_clean_checks(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    save_replicas(co, job, 10, 1, replica_set="")
    assert co.info(job, 10).state == "COMMITTED", "no check has reported through step 10 yet"
    co.on_job_event(job, 9, "checks_clean", time.time())
    assert co.info(job, 10).state == "COMMITTED"
    co.on_job_event(job, 10, "checks_clean", time.time())
    info = co.info(job, 10)
    assert info.state == "VERIFIED"
    assert info.vouched_by.startswith("bytes unreplicated: ranks 0 unreplicated: own fingerprints")
    # a rollback lowers what the checks vouch for: a checkpoint saved after it waits for new checks
    co.on_job_event(job, 10, "rollback", time.time())
    save_replicas(co, job, 11, 1, replica_set="")
    assert co.info(job, 11).state == "COMMITTED"


def _m(rank: int, fp: int, replica_set: str = "g") -> ShardManifest:
    return ShardManifest("j", 1, rank, 4, f"j/000000000001/rank-{rank:05d}.bin", 8, 8, (),
                         (TensorEntry("w", "float32", (2,), 0, 8, (fp, 1)),), {"__sdcw_tensor__": 0}, 0.0,
                         replica_set=replica_set)


def test_compare_rules() -> None:
    assert replica_bytes.compare([_m(0, 5), _m(1, 5), _m(2, 5)]).verdict == replica_bytes.AGREED
    three = replica_bytes.compare([_m(0, 5), _m(1, 6), _m(2, 5)])
    assert (three.verdict, three.odd_ranks) == (replica_bytes.MISMATCH, (1,))
    two = replica_bytes.compare([_m(0, 5), _m(1, 6)])
    assert (two.verdict, two.odd_ranks) == (replica_bytes.MISMATCH, (0, 1))
    # HSDP: two replica sets, each compared within itself
    hsdp = replica_bytes.compare([_m(0, 5, "a"), _m(1, 7, "b"), _m(2, 5, "a"), _m(3, 7, "b")])
    assert hsdp.verdict == replica_bytes.AGREED and [s.ranks for s in hsdp.sets] == [(0, 2), (1, 3)]
    alone = replica_bytes.compare([_m(0, 5, ""), _m(1, 6, "x")])
    assert (alone.verdict, alone.unreplicated) == (replica_bytes.UNREPLICATED, (0, 1))
    assert '"replica_set":"g"' in _m(0, 5).to_json()


def _pb(info: Any) -> Any:
    from daemon.checkpoint_service import info_to_pb
    return info_to_pb(info)


def test_two_agents_sharing_one_redis_compare_the_replicas_of_both_nodes(redis_server, tmp_path: Path) -> None:
    """Replicas on two nodes: each rank commits through its own node's agent; whichever commits last compares
    every rank's manifest (they are in the shared Redis), and either node sees the verdict."""
    n0, n1 = node(redis_server.port, tmp_path, "n0"), node(redis_server.port, tmp_path, "n1")
    job = job_id()
    save_replicas([n0, n1], job, 10, 2)
    save_replicas([n0, n1], job, 20, 2, flip_rank=1)
    n1.on_job_event(job, 20, "vote_agreed", time.time())   # the votes may come through either agent
    for co in (n0, n1):
        assert [(i.step, i.state) for i in co.list(job)] == [(10, "VERIFIED"), (20, "COMMITTED")]
    assert "odd ranks 0,1" in n0.info(job, 20).vouched_by
    assert n0.stats["replicas_differ"] + n1.stats["replicas_differ"] == 1, "compared once, by the last commit"


def test_a_flip_in_one_replicas_optimizer_state_is_never_verified(redis_server, tmp_path: Path) -> None:
    """The vote fingerprints the weights; the bytes saved include the optimizer's state, so a flip there (which
    the next updates would spread into the weights) keeps the checkpoint from VERIFIED and names the tensor."""
    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    for r in range(3):
        state = replicated_state(30)
        state["optim"] = {"exp_avg": torch.linspace(-1, 1, 64)}
        if r == 2:
            state["optim"]["exp_avg"].view(torch.int32)[7] ^= 1 << 3
        snap = Snapshotter(co, job, r, 3, SnapshotConfig(chunk_bytes=4096), replica_set="world")
        assert snap.save(30, state).result(30).error == ""
        snap.close()
    co.on_job_event(job, 30, "vote_agreed", time.time())
    info = co.info(job, 30)
    assert info.state == "COMMITTED"
    assert "DIFFERS in state_dict/optim/exp_avg; odd ranks 2" in info.vouched_by


def test_replicas_that_saved_different_plain_values_are_never_verified(redis_server, tmp_path: Path) -> None:
    """Non-tensor state (a loader position, bytes) is bytes of the shard too: replicas must agree on it."""
    import io

    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    for r in range(3):
        state = replicated_state(40)
        state["loader"] = {"epoch": 1, "pos": 640 + (r == 1)}
        state["extra"] = io.BytesIO(b"same")
        snap = Snapshotter(co, job, r, 3, SnapshotConfig(chunk_bytes=4096), replica_set="world")
        assert snap.save(40, state).result(30).error == ""
        snap.close()
    co.on_job_event(job, 40, "vote_agreed", time.time())
    info = co.info(job, 40)
    assert info.state == "COMMITTED"
    assert "DIFFERS in state_dict/loader; odd ranks 1" in info.vouched_by


def test_saves_faster_than_the_votes_keep_the_checkpoint_a_rollback_needs(redis_server, tmp_path: Path
                                                                           ) -> None:
    """Saved faster than a loaded agent's votes arrive (keep_committed 2): the checkpoint before a flip must
    survive the saves after it (their bytes differ) until its vote comes, then be VERIFIED, the rollback's
    target. Before: retention kept only the newest two and evicted it while it waited: nothing to roll back
    to (the README loop on a loaded CI machine)."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=2), job_id()
    co.on_job_event(job, 1, "vote_agreed", time.time())   # the job's checks run, behind its saves
    save_replicas(co, job, 50, 2)
    for step in (100, 150, 200):
        save_replicas(co, job, step, 2, flip_rank=1)        # the replicas' bytes differ from 100 on
    assert {i.step: i.state for i in co.list(job)} == {50: "COMMITTED", 150: "COMMITTED", 200: "COMMITTED"}
    co.on_job_event(job, 50, "vote_agreed", time.time())   # the late vote that vouches for 50
    co.on_job_event(job, 100, "vote_mismatch", time.time())
    assert co.latest_verified(job).step == 50
    # all saves in time, none verified yet: the oldest waits for its vote, at most one copy more
    lag = job_id()
    co.on_job_event(lag, 1, "vote_agreed", time.time())
    for step in range(10, 70, 10):
        save_replicas(co, lag, step, 2)
    assert [i.step for i in co.list(lag)] == [10, 50, 60]
    co.on_job_event(lag, 60, "vote_agreed", time.time())
    assert [i.state for i in co.list(lag)] == ["VERIFIED"] * 3
    # a job whose checks never reported keeps only the newest two (nothing would ever verify the held one)
    unchecked = job_id()
    for step in (10, 20, 30):
        save_replicas(co, unchecked, step, 2)
    assert [i.step for i in co.list(unchecked)] == [20, 30]
