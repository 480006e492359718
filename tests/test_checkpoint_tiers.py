"""Tiering memory -> NVMe -> flash -> S3 with real services: redis-server, moto's S3 over HTTP, temp dirs (and a
real tmpfs for disk full / read-only). Every hop verified; restore from the fastest good copy."""
from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path
from typing import Any

import pytest

from checkpoint.coordinator import Coordinator
from checkpoint.drainer import Drainer, Tier
from checkpoint.errors import CorruptCheckpointError
from checkpoint.locations import dir_store_for
from checkpoint.restore import restore_from_plan
from checkpoint.shard_reader import RestoreReport
from checkpoint.shm_store import DirStore
from checkpoint.snapshot import Snapshotter, SnapshotConfig
from checkpoint.tier_manifest import manifest_key
from checkpoint.tier_policy import Candidate, Held, TierRule, plan_drains, plan_retention, restore_order
from ckpt_support import assert_same, flip_bit, job_id, state_dict
from ckpt_support import node as _node
from daemon.checkpoint_service import CheckpointService
from fault_store import Fault, FaultyStore
from sdcwatch.event_kinds import EventKind
from tier_support import MotoS3, moto_s3, tmpfs, umount  # noqa: F401 - fixture


def node(port: int, root: Path, name: str, **kw: Any) -> Coordinator:
    """A node with its own Redis key prefix: other tests' jobs in the shared redis-server stay invisible."""
    import uuid

    return _node(port, root, name, key_prefix=f"t{uuid.uuid4().hex[:8]}:", **kw)


class Events(list):
    def __call__(self, kind: EventKind, subject: str, message: str, details: dict | None = None, *,
                 severity: Any = None) -> None:
        self.append((kind.name, message, details))

    def kinds(self) -> list[str]:
        return [e[0] for e in self]


def save(co: Coordinator, job: str, step: int, world: int = 2, size: int = 2000, verified: bool = False) -> None:
    for r in range(world):
        snap = Snapshotter(co, job, r, world, SnapshotConfig(chunk_bytes=4096))
        assert not snap.save(step, state_dict(r, step, size)).result(30).error
        snap.close()
    if verified:
        co.on_job_event(job, step, "vote_agreed", time.time())


def dir_tier(name: str, root: Path, rule: TierRule | None = None, store: Any = None, **kw: Any) -> Tier:
    return Tier(name, store or DirStore(root, fsync=True), str(root), rule or TierRule(name), **kw)


def s3_tier(s3: MotoS3, rule: TierRule | None = None, store: Any = None) -> Tier:
    store = store or s3.store()
    return Tier("s3", store, store.location, rule or TierRule("s3"), shared=True, verify="store")


def restore(svc: CheckpointService, job: str, target: int | str, rank: int, report: RestoreReport) -> Any:
    return restore_from_plan(svc.restore_plan(job, target, rank), rank, dir_store_for, "cpu", report)


def forget_job(co: Coordinator, job: str) -> None:
    """What a Redis restarted empty looks like for this job."""
    keys = list(co.redis.scan_iter(f"{co.config.key_prefix}{{{job}}}*"))
    if keys:
        co.redis.delete(*keys)
    co.redis.srem(co.config.key_prefix + "jobs", job)


def test_policy_and_restore_falling_all_the_way_back_to_s3(redis_server, tmp_path: Path, moto_s3: MotoS3) -> None:
    ev = Events()
    # the vote at 4 vouches for 1..4 (checked through 4); no rollback span, so memory keeps only the newest
    # VERIFIED (4) of them and 3 is held by S3 alone
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev, rollback_span_steps=0), job_id()
    tiers = [dir_tier("nvme", tmp_path / "nvme", TierRule("nvme", keep_newest=2)),
             dir_tier("flash", tmp_path / "flash", TierRule("flash", every_n=2, keep_newest=2), shared=True),
             s3_tier(moto_s3, TierRule("s3", every_n=3, keep_newest=5))]
    dr = Drainer(co, tiers, orphan_ttl_s=0)
    dr.start()
    svc = CheckpointService(co, drainer=dr)
    for step in range(1, 8):
        save(co, job, step, verified=step == 4)
        dr.drain_now()
        dr.maintain()
    held = {rt.tier.name: sorted(s for (_, s) in rt.catalog) for rt in dr.tiers}
    assert held["nvme"] == [4, 6, 7]            # newest 2 + the newest VERIFIED
    assert held["flash"] == [4, 6]              # every 2nd seen (2, 4, 6), newest 2 kept, newest VERIFIED kept
    assert held["s3"] == [3, 4, 7]              # every 3rd since its newest copy (3; 4 -> 7) + the newest VERIFIED
    listed = {i.step: list(i.tiers) for i in svc._with_tiers(co.list(job), job)}
    assert listed[7] == ["memory", "nvme", "s3"] and listed[4] == ["memory", "nvme", "flash", "s3"]
    assert listed[3] == ["s3"]                  # evicted from memory: listed from the tiers alone
    assert "checkpoint.drained" in ev.kinds() and "checkpoint.tier_deleted" in ev.kinds()
    # memory wiped, the Redis forgot the job, NVMe and flash emptied: the plan still lists their copies
    # (stale catalog), the restore falls back tier by tier down to S3
    co.store.remove_all()
    forget_job(co, job)
    for d in ("nvme", "flash"):
        for k in DirStore(tmp_path / d).list():
            DirStore(tmp_path / d).delete(k)
    rep = RestoreReport()
    assert_same(restore(svc, job, "latest_verified", 1, rep), state_dict(1, 4, 2000))
    assert rep.source.startswith("s3@") and any(f.startswith("nvme@") for f in rep.failures)
    assert any(f.startswith("flash@") for f in rep.failures)
    rep = RestoreReport()
    assert_same(restore(svc, job, 3, 0, rep), state_dict(0, 3, 2000))
    with pytest.raises(Exception, match="durable tiers hold no match"):
        svc.restore_plan(job, 5, 0)


def test_flipped_bit_on_each_tier_found_by_verify_and_skipped_by_restore(redis_server, tmp_path: Path,
                                                                           moto_s3: MotoS3) -> None:
    ev = Events()
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev), job_id()
    s3 = s3_tier(moto_s3)
    dr = Drainer(co, [dir_tier("nvme", tmp_path / "nvme"), dir_tier("flash", tmp_path / "flash", shared=True), s3])
    dr.start()
    svc = CheckpointService(co, drainer=dr)
    save(co, job, 1, size=8000, verified=True)
    assert all(ok for *_, ok in dr.drain_now())
    m = co.shard_manifest(job, 1, 0)
    assert len(m.chunks) >= 4
    flip_bit(Path(co.location) / m.blob, m.chunks[0].offset + 5)           # memory: chunk 0
    flip_bit(tmp_path / "nvme" / m.blob, m.chunks[1].offset + 5)           # NVMe: chunk 1
    flip_bit(tmp_path / "flash" / m.blob, m.chunks[2].offset + 5)          # flash: chunk 2
    blob = bytearray(s3.store.get(m.blob))                                  # S3: chunk 3 (bit rot in the bucket)
    blob[m.chunks[3].offset + 5] ^= 1
    s3.store.client.put_object(Bucket=s3.store.bucket, Key=s3.store.object_key(m.blob), Body=bytes(blob))
    checks = svc.verify_copies(job, 1)
    bad = {(c["tier"], c["rank"]) for c in checks if not c["ok"]}
    assert bad == {("memory", 0), ("nvme", 0), ("flash", 0), ("s3", 0)}
    assert {(c["tier"], c["rank"]) for c in checks if c["ok"]} == {("memory", 1), ("nvme", 1), ("flash", 1), ("s3", 1)}
    assert ev.kinds().count("checkpoint.copy_corrupt") == 4
    rep = RestoreReport()
    assert_same(restore(svc, job, 1, 0, rep), state_dict(0, 1, 8000))      # chunk 0 from NVMe, rest memory
    assert rep.fallbacks == 1 and rep.failures[0].startswith("memory@") and "checksum mismatch" in rep.failures[0]
    (Path(co.location) / m.blob).unlink()
    (tmp_path / "nvme" / m.blob).unlink()
    rep = RestoreReport()
    assert_same(restore(svc, job, 1, 0, rep), state_dict(0, 1, 8000))      # flash, its bad chunk 2 from S3
    assert rep.source.startswith("flash@") and [k for k in rep.sources if k.startswith("s3@")]
    assert sum(f.startswith("flash@") for f in rep.failures) == 1
    assert dr.stats()["s3"].errors == 1


def _no_temp(root: Path) -> bool:
    return not [p for p in root.rglob("*") if ".tmp-" in p.name]


def test_disk_full_then_read_only_marks_the_tier_unhealthy_and_damages_nothing(redis_server, tmp_path: Path,
                                                                                 moto_s3: MotoS3) -> None:
    nvme = tmp_path / "nvme"
    real = tmpfs(nvme, "160k")
    ev = Events()
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev), job_id()
    store: Any = DirStore(nvme, fsync=True)
    if not real:  # no mount here: the same failure injected (ENOSPC from the 2nd blob on)
        store = FaultyStore(store, [Fault("put", "fail", nth=4, times=0, error=OSError(errno.ENOSPC, "No space"))])
    clock = [1000.0]
    dr = Drainer(co, [dir_tier("nvme", nvme, store=store), s3_tier(moto_s3)], clock=lambda: clock[0])
    dr.start()
    try:
        save(co, job, 1, size=2000)                  # ~20 KiB per rank: fits
        dr.drain_now()
        good = {k: DirStore(nvme).get(k) for k in DirStore(nvme).list()}
        assert manifest_key(job, 1, "n0") in good
        save(co, job, 2, size=40000)                 # ~240 KiB per rank: does not fit
        res = dr.drain_now()
        assert ("nvme", job, 2, False) in res and ("s3", job, 2, True) in res   # the other tiers carry on
        st = dr.stats()["nvme"]
        assert not st.healthy and "disk full" in st.reason
        assert "checkpoint.tier_unhealthy" in ev.kinds()
        assert not DirStore(nvme).exists(manifest_key(job, 2, "n0")) and not DirStore(nvme).list(f"{job}/000000000002/")
        assert _no_temp(nvme)
        assert {k: DirStore(nvme).get(k) for k in DirStore(nvme).list()} == good     # nothing stored damaged
        save(co, job, 3, size=2000)                  # training goes on: saves still commit
        assert co.info(job, 3).state == "COMMITTED"
        if real:
            import subprocess

            assert subprocess.run(["mount", "-o", "remount,ro", str(nvme)]).returncode == 0
            clock[0] += 3600                         # past the retry backoff
            res = dr.drain_now()
            assert ("nvme", job, 3, False) in res
            assert "read-only" in dr.stats()["nvme"].reason
            assert {k: DirStore(nvme).get(k) for k in DirStore(nvme).list()} == good
            subprocess.run(["mount", "-o", "remount,rw", str(nvme)])
        clock[0] += 7200
        save(co, job, 4, size=2000)
        res = dr.drain_now()
        assert ("nvme", job, 4, True) in res and dr.stats()["nvme"].healthy
        assert "checkpoint.tier_healthy" in ev.kinds()
    finally:
        if real:
            umount(nvme)


def test_s3_outage_keeps_a_bounded_backlog_and_drains_when_it_returns(redis_server, tmp_path: Path) -> None:
    s3 = MotoS3().start()
    ev = Events()
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev, keep_committed=4), job_id()
    clock = [1000.0]
    tier = s3_tier(s3, TierRule("s3", every_n=1, max_backlog_bytes=50_000))
    dr = Drainer(co, [tier], clock=lambda: clock[0])
    dr.start()
    try:
        s3.stop()
        for step in (1, 2, 3):
            save(co, job, step, verified=step == 1)
        res = dr.drain_now()
        assert res and not any(ok for *_, ok in res)
        st = dr.stats()["s3"]
        assert not st.healthy and "TierUnavailableError" in st.reason
        assert "checkpoint.tier_unhealthy" in ev.kinds()
        assert 0 < st.backlog_bytes <= 50_000 + co.info(job, 1).nbytes
        assert "checkpoint.drain_dropped" in ev.kinds()          # over the bound: the oldest wanted one dropped
        assert dr.plan(clock[0]) == []                           # backing off: no hammering
        s3.start()                                               # back, same port, same data
        clock[0] += 3600
        res = dr.drain_now()
        assert res and all(ok for *_, ok in res)
        assert {s for (_, s) in dr.tiers[0].catalog} >= {1, 3}   # the newest VERIFIED and the newest
        assert dr.stats()["s3"].healthy and dr.stats()["s3"].backlog_bytes == 0
    finally:
        s3.stop()


@pytest.mark.parametrize("kind", ["flip", "truncate"])
def test_a_written_copy_that_does_not_verify_is_not_committed(redis_server, tmp_path: Path, kind: str) -> None:
    ev = Events()
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev), job_id()
    store = FaultyStore(DirStore(tmp_path / "nvme"), [Fault("put", kind, nth=1, offset=100)])
    clock = [1000.0]
    dr = Drainer(co, [dir_tier("nvme", tmp_path / "nvme", store=store)], clock=lambda: clock[0])
    dr.start()
    save(co, job, 1)
    assert dr.drain_now() == [("nvme", job, 1, False)]
    assert "checkpoint.tier_verify_failed" in ev.kinds() and dr.stats()["nvme"].verify_failures == 1
    assert DirStore(tmp_path / "nvme").list() == []             # neither the bad blob nor a manifest
    clock[0] += 60
    assert dr.drain_now() == [("nvme", job, 1, True)]


def test_hung_tier_is_marked_and_gets_no_new_copies(redis_server, tmp_path: Path) -> None:
    ev = Events()
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev), job_id()
    store = FaultyStore(DirStore(tmp_path / "nvme"), [Fault("put", "hang", nth=1, hang_s=30)])
    dr = Drainer(co, [dir_tier("nvme", tmp_path / "nvme", store=store, hop_timeout_s=0.2, concurrency=1)])
    dr.start()
    save(co, job, 1)

    async def go() -> None:
        assert await dr.tick() == [("nvme", job, 1)]
        await asyncio.sleep(0.4)
        save(co, job, 2)
        assert await dr.tick() == []                               # hung: nothing new starts there
        assert dr.stats()["nvme"].reason == "hung" and "checkpoint.tier_unhealthy" in ev.kinds()
        store.release()

    asyncio.run(go())
    dr.close()


def test_crash_leftovers_are_cleaned_and_the_drain_resumes(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0"), job_id()
    save(co, job, 1)
    nvme = DirStore(tmp_path / "nvme")
    m0, m1 = co.shard_manifest(job, 1, 0), co.shard_manifest(job, 1, 1)
    # what a kill -9 mid-hop leaves: rank 0 stored whole, rank 1 half written under a temp name, no manifest
    nvme.put(m0.blob, co.store.get(m0.blob))
    tmp = (tmp_path / "nvme" / m1.blob).with_name("rank-00001.bin.tmp-999-1")
    tmp.write_bytes(co.store.get(m1.blob)[:1000])
    (tmp_path / "nvme" / "other-job" / "000000000009").mkdir(parents=True)
    (tmp_path / "nvme" / "other-job" / "000000000009" / "rank-00000.bin").write_bytes(b"orphan")
    dr = Drainer(co, [dir_tier("nvme", tmp_path / "nvme")], orphan_ttl_s=0)
    dr.start()
    assert not tmp.exists()                                        # node-local tier: temp files swept at start
    assert [(t, s, ok) for t, _, s, ok in dr.drain_now()] == [("nvme", 1, True)]
    assert dr.stats()["nvme"].bytes == m1.nbytes                   # rank 0 verified in place, not copied again
    dr.maintain()
    assert nvme.list() == sorted([m0.blob, m1.blob, manifest_key(job, 1, "n0")])
    assert dr.stats()["nvme"].orphans_deleted == 1


def test_retention_never_deletes_the_newest_verified_copy(redis_server, tmp_path: Path) -> None:
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=1), job_id()
    dr = Drainer(co, [dir_tier("nvme", tmp_path / "nvme", TierRule("nvme", keep_newest=1))])
    dr.start()
    save(co, job, 1, verified=True)
    for step in (2, 3, 4):
        save(co, job, step)
        dr.drain_now()
        dr.maintain()
    assert sorted(s for (_, s) in dr.tiers[0].catalog) == [1, 4]
    # the state the tier keeps follows the Redis: revoked -> it may go
    co.on_job_event(job, 1, "sdc", time.time())
    dr.maintain()
    dr.maintain()
    assert sorted(s for (_, s) in dr.tiers[0].catalog) == [4]


def test_pure_policy() -> None:
    rule = TierRule("flash", every_n=3)
    c = [Candidate(s, False, 10) for s in (7, 8)]
    assert plan_drains(rule, c, [Held(2, False, 0.0)], [3, 4, 5, 6, 7, 8], 0).steps == (8,)
    assert plan_drains(rule, c, [Held(2, False, 0.0)], [3, 4], 0).steps == (7,)   # 3, 4, 7: the third
    assert plan_drains(rule, c, [Held(6, False, 0.0)], [], 0).steps == ()
    assert plan_drains(TierRule("s3", every_n=0, every_s=60), c, [Held(2, False, 0.0)], [], 100).steps == (8,)
    assert plan_drains(TierRule("s3", every_n=0, every_s=60), c, [Held(2, False, 50.0)], [], 100).steps == ()
    v = [Candidate(5, True, 10), Candidate(9, False, 10)]
    assert plan_drains(TierRule("s3", every_n=0), v, [], [], 0).steps == (5,)
    p = plan_drains(TierRule("n", max_backlog_bytes=20), [Candidate(s, s == 1, 10) for s in (1, 2, 3)], [], [], 0)
    assert p.steps == (1, 3) and p.dropped == (2,)
    held = [Held(s, s == 2, float(s)) for s in range(1, 11)]
    assert plan_retention(TierRule("n", keep_newest=2, keep_every_steps=5), held, 10) == [1, 3, 4, 6, 7, 8]
    assert plan_retention(TierRule("n", keep_newest=1, keep_age_s=3), held, 10, protected=[1]) == [3, 4, 5, 6]
    assert restore_order(["s3", "nvme", "memory", "flash"]) == ["memory", "nvme", "flash", "s3"]
    assert restore_order(["nvme", "flash"], {"nvme": 2.0, "flash": 1.0}) == ["flash", "nvme"]


def test_a_corrupt_source_is_never_drained(redis_server, tmp_path: Path) -> None:
    ev = Events()
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev), job_id()
    dr = Drainer(co, [dir_tier("nvme", tmp_path / "nvme")])
    dr.start()
    save(co, job, 1)
    m = co.shard_manifest(job, 1, 1)
    flip_bit(Path(co.location) / m.blob, 10)
    assert dr.drain_now() == [("nvme", job, 1, False)]
    assert "checkpoint.drain_source_corrupt" in ev.kinds()
    assert DirStore(tmp_path / "nvme").list() == []
    assert dr.drain_now() == []                                    # not retried: no good source exists
    with pytest.raises(CorruptCheckpointError):
        dr.drain_one(dr.tiers[0], job, 1)


def test_a_checkpoint_evicted_while_its_drain_is_queued_is_skipped_not_critical(redis_server, tmp_path: Path) -> None:
    """Memory retention (or a rollback) drops a step after its hop was planned: its blobs vanish under the
    read. That is a skip (logged), never `checkpoint.drain_source_corrupt` (CRITICAL, pages)."""
    ev = Events()
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev), job_id()
    dr = Drainer(co, [dir_tier("nvme", tmp_path / "nvme")])
    dr.start()
    save(co, job, 1)
    save(co, job, 2)
    planned = dr._sources

    def then_evicted(rt: Any, j: str, step: int) -> Any:   # the hop has its sources; retention runs now
        got = planned(rt, j, step)
        if step == 2:
            co.on_job_event(job, 1, "rollback", time.time())   # drops step 2: tombstone, then its blobs
        return got

    dr._sources = then_evicted
    hops = dr.drain_now()
    assert ("nvme", job, 2, False) in hops, hops
    assert "checkpoint.drain_source_corrupt" not in ev.kinds(), ev
    assert not any(k.startswith(f"{job}/000000000002") for k in DirStore(tmp_path / "nvme").list())


def test_tier_only_listings_say_what_vouched(redis_server, tmp_path: Path) -> None:
    """Issue 18: a checkpoint only the durable tiers know (the Redis index gone) still shows what vouched for
    its bytes in `ckpt ls/show`: the tier manifest carries the record's evidence (replica sets whose
    fingerprints agreed; for a job without replicas, its own fingerprints and clean checks), and a manifest
    written without it gets it recomputed from its shard manifests."""
    import json

    import torch

    from checkpoint.tier_manifest import TierManifest, scan
    from daemon.cli_ckpt import format_show

    co = node(redis_server.port, tmp_path, "n0")
    replicated, alone = job_id("rep"), job_id("alone")
    for r in range(3):   # three replicas saving the same bytes
        g = torch.Generator().manual_seed(5)
        snap = Snapshotter(co, replicated, r, 3, SnapshotConfig(chunk_bytes=4096), replica_set="world")
        assert not snap.save(5, {"w": torch.randn(500, generator=g)}).result(30).error
        snap.close()
    co.on_job_event(replicated, 5, "vote_agreed", time.time())
    save(co, alone, 5)
    co.on_job_event(alone, 5, "checks_clean", time.time())
    assert co.info(replicated, 5).state == co.info(alone, 5).state == "VERIFIED"
    tier_root = tmp_path / "nvme"
    dr = Drainer(co, [dir_tier("nvme", tier_root, TierRule("nvme", keep_newest=5))])
    dr.start()
    dr.drain_now()
    for job in (replicated, alone):
        co.store.remove_all()
        forget_job(co, job)
    fresh = Drainer(co, [dir_tier("nvme", tier_root, TierRule("nvme", keep_newest=5))])   # a restarted agent
    fresh.start()
    svc = CheckpointService(co, drainer=fresh)
    (rep,) = svc._with_tiers([], replicated)
    (solo,) = svc._with_tiers([], alone)
    from proto.sdcwatch.v1 import checkpoint_pb2

    assert rep.state == solo.state == checkpoint_pb2.CHECKPOINT_STATE_VERIFIED
    assert rep.reason == "held by the durable tiers only"
    assert rep.vouched_by.startswith("bytes agreed: replica set 'world' (ranks 0,1,2): 1 tensor fingerprints "
                                     "identical"), rep.vouched_by
    assert solo.vouched_by.startswith("bytes unreplicated: ranks 0,1 unreplicated: own fingerprints"), solo.vouched_by
    assert "vouched by: bytes agreed: replica set 'world'" in format_show(rep, time.time())
    # a manifest from before the field existed: the evidence is recomputed from the shards' fingerprints
    store = DirStore(tier_root, fsync=True)
    key = manifest_key(replicated, 5, "n0")
    obj = json.loads(store.get(key))
    del obj["vouched_by"]
    store.put(key, json.dumps(obj).encode())
    assert TierManifest.from_json(store.get(key)).vouched_by == ""
    tc = scan(store, replicated)[(replicated, 5)]
    assert tc.vouched_by.startswith("bytes agreed: replica set 'world' (ranks 0,1,2)")
    assert tc.vouched_by.endswith("(recomputed from the tier's shard manifests)")


def test_drain_all_puts_the_newest_and_newest_verified_on_every_tier_with_progress_per_chunk(
        redis_server, tmp_path: Path) -> None:
    """`sdcwatch ckpt drain`'s work: the tiers' policies (every 5th step here) would copy nothing yet;
    the drain copies the newest (3) and the newest VERIFIED (1) to every tier, verified, reporting after
    every chunk; a second drain finds nothing missing; a tier that fails says why."""
    ev = Events()
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev), job_id()
    tiers = [dir_tier("nvme", tmp_path / "nvme", TierRule("nvme", every_n=5, newest_verified=False)),
             dir_tier("flash", tmp_path / "flash", TierRule("flash", every_n=5, newest_verified=False),
                      shared=True)]
    dr = Drainer(co, tiers)
    dr.start()
    for step in (1, 2, 3):
        save(co, job, step, size=8000, verified=step == 1)
    assert dr.drain_now() == []                      # the policies want nothing yet
    seen: list[tuple[int, int, str]] = []
    res = dr.drain_all(progress=lambda done, total, what: seen.append((done, total, what)))
    assert sorted((r.tier, r.step, r.ok) for r in res) == [("flash", 1, True), ("flash", 3, True),
                                                            ("nvme", 1, True), ("nvme", 3, True)]
    chunks = [c.length for s in (1, 3) for r in (0, 1) for c in co.shard_manifest(job, s, r).chunks]
    assert len(chunks) >= 8
    assert len(seen) == 2 * len(chunks)              # one update per chunk copied, on each of the two tiers
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    assert seen[-1][0] == seen[-1][1] == 2 * sum(chunks)
    assert {w for *_, w in seen} == {f"{t} {job} step {s}" for t in ("nvme", "flash") for s in (1, 3)}
    assert {(rt.tier.name, s) for rt in dr.tiers for (_, s) in rt.catalog} == {
        ("nvme", 1), ("nvme", 3), ("flash", 1), ("flash", 3)}
    assert dr.drain_all() == []                      # nothing missing now
    # verify reports per chunk too: every copy (memory, nvme, flash) of both ranks
    seen.clear()
    checks = CheckpointService(co, drainer=dr).verify_copies(job, 3, lambda d, t, w: seen.append((d, t, w)))
    assert len(checks) == 6 and all(c["ok"] for c in checks)
    per_copy = [c.length for r in (0, 1) for c in co.shard_manifest(job, 3, r).chunks]
    assert len(seen) == 3 * len(per_copy) and seen[-1][0] == seen[-1][1] == 3 * sum(per_copy)
    # a tier that cannot take the copy: the drain says so (and tries it once)
    save(co, job, 4, size=8000)
    full = Fault("put", "fail", times=0, error=OSError(errno.ENOSPC, "No space"))
    dr.tiers[1].tier.store = FaultyStore(dr.tiers[1].tier.store, [full])
    res = dr.drain_all(job)
    assert sorted((r.tier, r.step, r.ok) for r in res) == [("flash", 4, False), ("nvme", 4, True)]
    assert "disk full" in next(r.detail for r in res if not r.ok)


def test_drain_without_a_durable_tier_is_refused(redis_server, tmp_path: Path) -> None:
    """No tier configured: the checkpoints live in memory only; `Drain` says so (FAILED_PRECONDITION, which
    `sdcwatch ckpt drain` turns into exit 1), rather than reporting nothing to do."""
    from proto.sdcwatch.v1 import checkpoint_pb2 as pb

    svc = CheckpointService(node(redis_server.port, tmp_path, "n0"))

    class Context:
        async def abort(self, code: Any, message: str) -> None:
            raise RuntimeError(f"{code.name}: {message}")

    async def drain() -> None:
        async for _ in svc.Drain(pb.DrainRequest(), Context()):
            pass

    with pytest.raises(RuntimeError, match="FAILED_PRECONDITION: no durable checkpoint tier is configured"):
        asyncio.run(drain())


def test_a_rollback_drops_the_tier_copies_of_the_history_it_left(redis_server, tmp_path: Path) -> None:
    """Issue 18: steps 2 and 3 were drained to NVMe, then the job went back to step 1. Those copies hold the
    history it left (in the README loop, a step whose replicas differed): they go at once (the service, on the
    ranks' ReportRestore or the rollback event) and at the next maintenance on any node, and the redone step 2,
    a new record with new bytes, is drained to NVMe and kept (before: the old copy stood in for it, listed)."""
    ev = Events()
    co, job = node(redis_server.port, tmp_path, "n0", publish=ev, keep_committed=10), job_id()
    dr = Drainer(co, [dir_tier("nvme", tmp_path / "nvme", TierRule("nvme", keep_newest=10))])
    dr.start()
    for step in (1, 2, 3):
        save(co, job, step, verified=step == 1)
        dr.drain_now()
    nvme = dr.tiers[0]
    assert sorted(s for (_, s) in nvme.catalog) == [1, 2, 3]
    time.sleep(0.01)
    co.on_job_event(job, 1, "rollback", time.time())      # what the service's job_event does, then:
    dr.drop_left_history(job)
    assert sorted(s for (_, s) in nvme.catalog) == [1]
    assert not DirStore(tmp_path / "nvme").list(f"{job}/000000000002/")
    assert sum("history the job left" in e[1] for e in ev) == 2
    save(co, job, 2)                                         # redone after the restore: new bytes
    dr.drain_now()
    dr.maintain()
    dr.drop_left_history(job)
    assert sorted(s for (_, s) in nvme.catalog) == [1, 2], "the redone step is drained and stays"
    # a node that never saw the event (no call to drop_left_history) finds the cut at its maintenance
    save(co, job, 4)
    dr.drain_now()
    assert sorted(s for (_, s) in nvme.catalog) == [1, 2, 4]
    time.sleep(0.01)
    co.on_job_event(job, 2, "rollback", time.time())
    dr.maintain()
    assert sorted(s for (_, s) in nvme.catalog) == [1, 2]


def test_a_copy_drained_before_its_vote_learns_verified_after_memory_evicted_the_record(redis_server,
                                                                                       tmp_path: Path) -> None:
    """The drain wrote the NVMe copy while the record was COMMITTED; the vote verified it, and memory retention
    evicted the record before the drainer's next round: the tombstone keeps the state it had (dropped_from), so
    the copy still becomes VERIFIED (before: it stayed COMMITTED for good, listed so)."""
    co, job = node(redis_server.port, tmp_path, "n0", keep_committed=1, rollback_span_steps=0), job_id()
    dr = Drainer(co, [dir_tier("nvme", tmp_path / "nvme", TierRule("nvme", keep_newest=10))])
    dr.start()
    save(co, job, 1)
    dr.drain_now()
    assert dr.tiers[0].catalog[(job, 1)].parts["n0"].state == "COMMITTED"
    co.on_job_event(job, 1, "vote_agreed", time.time())
    save(co, job, 2, verified=True)
    co.maintain_job(job, time.time())
    assert [i.step for i in co.list(job)] == [2], "memory evicted step 1"
    assert co.info(job, 1).dropped_from == "VERIFIED"
    dr.maintain()
    assert dr.tiers[0].catalog[(job, 1)].parts["n0"].state == "VERIFIED"
