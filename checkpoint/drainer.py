"""The drainer: copies committed checkpoints down the tiers (memory -> NVMe -> flash -> S3), verified.

Lifecycle (the agent owns one `Drainer`; see daemon/drain_wiring.py):

1. `start()`          scan every tier's manifests (its catalog); sweep temp files a killed agent left.
2. `run()`            asyncio loop: every `interval_s` (or at once after `kick()`, which the Checkpoints
                      service calls on each global commit) plan with `checkpoint.tier_policy.plan_drains`
                      and hand each (tier, job, step) hop to that tier's thread pool (`concurrency`
                      threads, a token-bucket `bandwidth_bytes_s`); a hop over `hop_timeout_s` marks the
                      tier HUNG and no new hop starts there until it returns.
3. a hop              (blocking, in the tier's pool) for each of this node's shards: read each chunk from
                      the fastest tier holding it (memory first) and verify its xxh3-128, falling back to
                      the next copy chunk by chunk; stream into the tier's store (atomic put); verify the
                      written copy (read back every chunk, or the store's own checksum for S3); then write
                      the tier manifest (`checkpoint.tier_manifest`), the tier's commit, and read it back.
                      A mismatch is an event and nothing is committed (the bad blob is deleted).
4. `maintain(now)`    per tier: retention (`tier_policy.plan_retention`; manifest deleted first, then the
                      blobs), orphan blobs no manifest names (after `orphan_ttl_s`), stale temp files /
                      multipart uploads, manifest state refresh (VERIFIED / revoked).

Failures: ENOSPC / EROFS / EDQUOT / EIO / S3 unreachable mark the tier unhealthy with an event; the hop's
partial blobs are deleted (never a manifest), the tier is retried with exponential backoff, and training
never waits (all of this runs on the drainer's threads; memory retention only *prefers* to keep
undrained checkpoints, see `hold`). A kill -9 mid-hop leaves blobs without a manifest: after restart the
hop runs again (blobs already complete and verified are kept: resume), temp files are swept at start on
node-local tiers, orphans after `orphan_ttl_s` elsewhere.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import mmap
import os
import re
import threading
import time
from typing import Any, Callable, Iterator

from checkpoint import policy
from checkpoint.blobstore import BlobStore
from checkpoint.chunks import verify
from checkpoint.coordinator import Coordinator
from checkpoint.errors import CheckpointError, CorruptCheckpointError, UnknownCheckpointError
from checkpoint.manifest import ShardManifest
from checkpoint.records import Copy
from checkpoint.tier_manifest import (MAX_VOUCHED, TierCheckpoint, TierManifest, manifest_key, orphans, scan)
from checkpoint.tier_policy import Candidate, DrainPlan, Held, TierRule, plan_drains, plan_retention
from sdcwatch import event_kinds as ek
from sdcwatch.errors import SdcwatchError
from sdcwatch.event_kinds import EventKind, Publish

log = logging.getLogger(__name__)

_UNHEALTHY_ERRNOS = {errno.ENOSPC: "disk full", errno.EROFS: "read-only filesystem", errno.EDQUOT: "quota exceeded",
                     errno.EIO: "I/O error", errno.EACCES: "permission denied"}


_THROTTLE_SLICE = 1 << 20

Progress = Callable[[int, int, str], None]   # (done_bytes, total_bytes, what): a long operation's progress


class _Meter:
    """Counts bytes handled towards a total and reports each step to a `Progress` callback (if any)."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.done, self.what, self._progress = total, 0, "", progress

    def add(self, n: int) -> None:
        if n <= 0:
            return
        self.done += n
        self.total = max(self.total, self.done)
        if self._progress is not None:
            self._progress(self.done, self.total, self.what)


class VerifyError(CheckpointError):
    """The copy written to a tier does not read back as what was sent (it is deleted; the next attempt may
    succeed)."""

    transient = True


@dataclasses.dataclass(slots=True)
class Tier:
    name: str                        # "nvme", "flash", "s3": also the metric label and restore-plan tier
    store: BlobStore
    location: str                    # what a rank opens (a directory, or an s3:// URL)
    rule: TierRule
    concurrency: int = 2
    bandwidth_bytes_s: float = 0.0   # 0: unlimited
    verify: str = "readback"         # or "store": the store's own checksum (S3Store.verify_stored)
    shared: bool = False             # other nodes write here too (flash, S3): temp files swept by age only
    hop_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.verify not in ("readback", "store"):
            raise ValueError(f"tier {self.name}: verify must be 'readback' or 'store', got {self.verify!r}")
        if self.concurrency < 1:
            raise ValueError(f"tier {self.name}: concurrency must be >= 1")


class Throttle:
    """A token bucket shared by a tier's hops: `take(n)` sleeps until n more bytes fit under the rate."""

    def __init__(self, rate_bytes_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self.clock, self.sleep = rate_bytes_s, clock, sleep
        self._next = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            now = self.clock()
            start = max(now, self._next)
            self._next = start + n / self.rate
            wait = start - now
        if wait > 0:
            self.sleep(wait)


@dataclasses.dataclass(frozen=True, slots=True)
class DrainResult:
    """One copy `Drainer.drain_all` tried (or skipped): to `tier`, of this node's part of (`job`, `step`)."""
    tier: str
    job: str
    step: int
    ok: bool
    detail: str
    bytes: int


@dataclasses.dataclass(slots=True)
class TierStats:
    bytes: int = 0
    hops: int = 0
    failures: int = 0
    errors: int = 0
    verify_failures: int = 0
    retention_deletions: int = 0
    orphans_deleted: int = 0
    backlog_bytes: int = 0
    held: int = 0
    held_bytes: int = 0
    healthy: bool = True
    reason: str = ""
    last_throughput: float = 0.0


class _TierRuntime:
    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.pool = concurrent.futures.ThreadPoolExecutor(tier.concurrency, thread_name_prefix=f"sdcw-drain-{tier.name}")
        self.throttle = Throttle(tier.bandwidth_bytes_s)
        self.catalog: dict[tuple[str, int], TierCheckpoint] = {}
        self.inflight: dict[tuple[str, int], float] = {}
        self.stats = TierStats()
        self.retry_at = 0.0
        self.fail_streak = 0
        self.step_failures: collections.Counter[tuple[str, int]] = collections.Counter()
        self.orphan_seen: dict[str, float] = {}
        self.hung = False
        self.dropped_noted: set[tuple[str, int]] = set()
        self.last_error: dict[tuple[str, int], str] = {}   # why the newest hop of (job, step) failed
        self.lock = threading.Lock()


def safe_node(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", node).lstrip(".") or "node"


class Drainer:
    def __init__(self, coordinator: Coordinator, tiers: list[Tier], *, publish: Publish | None = None,
                 clock: Callable[[], float] = time.time, interval_s: float = 2.0, orphan_ttl_s: float = 3600.0,
                 max_step_failures: int = 3, backoff_cap_s: float = 300.0) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or "memory" in names or "peer" in names:
            raise ValueError(f"tier names must be unique and not 'memory'/'peer', got {names}")
        self.coordinator = coordinator
        self.node = safe_node(coordinator.node)
        self.tiers = [_TierRuntime(t) for t in tiers]
        self.publish = publish
        self.clock = clock
        self.interval_s = interval_s
        self.orphan_ttl_s = orphan_ttl_s
        self.max_step_failures = max_step_failures
        self.backoff_cap_s = backoff_cap_s
        self._seen: dict[str, set[int]] = {}
        self._kick: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # (tier, seconds, bytes) per completed hop, drained by the metrics; bounded
        self.observations: collections.deque[tuple[str, float, int]] = collections.deque(maxlen=1024)
        # catalogs and planning (Redis, the tiers' listings): one thread of the drainer's own, never asyncio's
        # shared default executor; a round still running when the next is due is waited for, not doubled
        self._planner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdcw-drain-plan")

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Blocking: catalogs, and temp files of interrupted puts (node-local tiers: all of them)."""
        now = self.clock()
        for rt in self.tiers:
            self._sweep_temp(rt, now, 0.0 if not rt.tier.shared else self.orphan_ttl_s)
            self._refresh_catalog(rt)

    def kick(self) -> None:
        """Plan now (a checkpoint committed). Safe from any thread."""
        if self._kick is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._kick.set)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        await self._loop.run_in_executor(self._planner, self.start)
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one bad round never stops the drainer
                log.exception("drain round failed")
            try:
                await asyncio.wait_for(self._kick.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()

    async def tick(self) -> list[tuple[str, str, int]]:
        now = self.clock()
        self._check_hung(now)
        plans = await asyncio.get_running_loop().run_in_executor(self._planner, self.plan, now)
        started = []
        for rt, job, step in plans:
            if len(rt.inflight) >= rt.tier.concurrency:
                continue
            rt.inflight[(job, step)] = time.monotonic()
            fut = rt.pool.submit(self._hop_guarded, rt, job, step)
            fut.add_done_callback(lambda _f, rt=rt, k=(job, step): rt.inflight.pop(k, None))
            started.append((rt.tier.name, job, step))
        return started

    def close(self) -> None:
        self._planner.shutdown(wait=False, cancel_futures=True)
        for rt in self.tiers:
            rt.pool.shutdown(wait=False, cancel_futures=True)

    def drain_now(self, now: float | None = None) -> list[tuple[str, str, int, bool]]:
        """Blocking: plan and run every hop to completion, tier by tier (tests, benchmarks, operators)."""
        now = self.clock() if now is None else now
        out = []
        for _ in range(len(self.tiers) + 1):
            plans = self.plan(now)
            if not plans:
                break
            for rt, job, step in plans:
                rt.inflight[(job, step)] = time.monotonic()
                try:
                    out.append((rt.tier.name, job, step, self._hop_guarded(rt, job, step)))
                finally:
                    rt.inflight.pop((job, step), None)
        return out

    def drain_all(self, job: str = "", progress: Progress | None = None, now: float | None = None,
                  wait_s: float = 3600.0) -> list[DrainResult]:
        """Blocking (`sdcwatch ckpt drain`, e.g. before maintenance): copy, verified, what the tiers'
        policies have pending now and the newest and the newest VERIFIED checkpoint of each job in this node's
        memory (or of `job`) onto every tier that lacks this node's part of it, fastest tier first, ignoring
        the retry backoff; copies the background drainer is already making are waited for (up to `wait_s`).
        Each (tier, job, step) is tried at most once. A hung tier is not tried (its result says so).
        `progress(done_bytes, total_bytes, what)` after every chunk. Returns every copy tried or skipped."""
        now = self.clock() if now is None else now
        meter = _Meter(0, progress)
        results: dict[tuple[str, str, int], DrainResult] = {}
        give_up = time.monotonic() + wait_s
        while True:
            targets = [t for t in self._drain_targets(job, now)
                       if (t[0].tier.name, t[1], t[2]) not in results]
            runnable = [t for t in targets if (t[1], t[2]) not in t[0].inflight]
            if not runnable:   # the background drainer is copying the rest: wait for its results
                for rt, j, step, _ in targets:
                    started = rt.inflight.get((j, step))
                    late = started is not None and time.monotonic() - started > rt.tier.hop_timeout_s
                    if rt.hung or late or time.monotonic() > give_up:
                        results[(rt.tier.name, j, step)] = DrainResult(
                            rt.tier.name, j, step, False, "tier hung: a copy there has run over "
                            f"{rt.tier.hop_timeout_s:.0f}s" if rt.hung or late else
                            f"still being copied after {wait_s:.0f}s", 0)
                if not targets:
                    break
                time.sleep(0.05)
                continue
            meter.total += sum(n for *_, n in runnable)
            for rt, j, step, nbytes in runnable:
                key = (rt.tier.name, j, step)
                if rt.hung:
                    results[key] = DrainResult(rt.tier.name, j, step, False, "tier hung: a copy there has "
                                               f"run over {rt.tier.hop_timeout_s:.0f}s; not tried", 0)
                    meter.add(nbytes)
                    continue
                meter.what = f"{rt.tier.name} {j} step {step}"
                start = meter.done
                rt.inflight[(j, step)] = time.monotonic()
                try:
                    ok = self._hop_guarded(rt, j, step, meter.add)
                finally:
                    rt.inflight.pop((j, step), None)
                meter.add(start + nbytes - meter.done)
                why = "copied, verified" if ok else rt.last_error.get((j, step), "failed")
                results[key] = DrainResult(rt.tier.name, j, step, ok, why, nbytes if ok else 0)
        return list(results.values())

    def _drain_targets(self, job: str, now: float) -> list[tuple[_TierRuntime, str, int, int]]:
        """(tier, job, step, this node's bytes) that `drain_all` copies, tier order."""
        mem = self._memory_checkpoints()
        wanted: dict[str, set[int]] = collections.defaultdict(set)
        for (j, step), (state, *_rest) in mem.items():
            if job and j != job:
                continue
            wanted[j].add(step)
        newest: dict[str, set[int]] = {}
        for j, steps in wanted.items():
            verified = [s for s in steps if mem[(j, s)][0] == policy.VERIFIED]
            newest[j] = {max(steps), *([max(verified)] if verified else [])}
        nbytes = {k: v[3] for k, v in mem.items()}
        out: list[tuple[_TierRuntime, str, int, int]] = []
        for rt, j, step in self.plan(now):
            if not job or j == job:
                out.append((rt, j, step, nbytes.get((j, step), 0)))
        planned = {(rt.tier.name, j, step) for rt, j, step, _ in out}
        for rt in self.tiers:
            for j, steps in sorted(newest.items()):
                for step in sorted(steps):
                    tc = rt.catalog.get((j, step))
                    if (tc is None or self.node not in tc.parts) and (rt.tier.name, j, step) not in planned:
                        out.append((rt, j, step, nbytes.get((j, step), 0)))
        order = {rt.tier.name: i for i, rt in enumerate(self.tiers)}
        return sorted(out, key=lambda t: (order[t[0].tier.name], t[1], -t[2]))

    # ---- planning -----------------------------------------------------------------------------------
    def _memory_checkpoints(self) -> dict[tuple[str, int], tuple[str, int, frozenset[int], int]]:
        """(job, step) -> (state, world_size, ranks this node holds in memory, bytes) for restorable records."""
        out = {}
        for job in self.coordinator.jobs():
            try:
                infos = self.coordinator.list(job)
            except Exception as e:  # noqa: BLE001
                log.warning("listing checkpoints of %s failed: %s", job, e)
                continue
            for i in infos:
                if i.state not in policy.RESTORABLE_STATES:
                    continue
                ranks = frozenset(c.rank for c in i.copies if c.node == self.coordinator.node)
                if ranks:
                    out[(job, i.step)] = (i.state, i.world_size, ranks, i.nbytes * len(ranks) // max(1, i.world_size))
                self._seen.setdefault(job, set()).add(i.step)
        return out

    def _in_memory(self, job: str, step: int) -> bool:
        """Whether (job, step) is still a restorable checkpoint; True when that cannot be read (then a bad
        source is reported as before). The coordinator tombstones a record before deleting its blobs, so a
        source that vanished with its record was evicted, not corrupted."""
        try:
            infos = self.coordinator.list(job)
        except Exception:  # noqa: BLE001 - Redis unreachable: cannot tell
            return True
        return any(i.step == step and i.state in policy.RESTORABLE_STATES for i in infos)

    def plan(self, now: float) -> list[tuple[_TierRuntime, str, int]]:
        mem = self._memory_checkpoints()
        states = {k: v[0] for k, v in mem.items()}
        out: list[tuple[_TierRuntime, str, int]] = []
        faster: dict[tuple[str, int], int] = {k: v[3] for k, v in mem.items()}   # available above this tier
        verified = {k for k, v in mem.items() if v[0] == policy.VERIFIED}
        for rt in self.tiers:
            mine = {k: tc for k, tc in rt.catalog.items() if self.node in tc.parts}
            for k, tc in mine.items():
                if tc.parts[self.node].state == policy.VERIFIED and k not in states:
                    verified.add(k)
            backlog = 0
            jobs = {k[0] for k in faster} | {k[0] for k in mine}
            for job in sorted(jobs):
                cands = [Candidate(s, (j, s) in verified, n) for (j, s), n in faster.items() if j == job]
                held = [Held(s, states.get((j, s), tc.parts[self.node].state) == policy.VERIFIED,
                             tc.parts[self.node].created) for (j, s), tc in mine.items() if j == job]
                p: DrainPlan = plan_drains(rt.tier.rule, cands, held, self._seen.get(job, ()), now)
                for step in p.dropped:
                    if (job, step) in rt.dropped_noted:
                        continue
                    rt.dropped_noted.add((job, step))
                    self._emit(ek.CHECKPOINT_DRAIN_DROPPED, job,
                               f"step {step} not copied to {rt.tier.name}: the drain backlog is over its bound",
                               {"step": step, "tier": rt.tier.name})
                for step in p.steps:
                    if rt.step_failures[(job, step)] >= self.max_step_failures:
                        continue
                    backlog += faster.get((job, step), 0)
                    if (job, step) not in rt.inflight and now >= rt.retry_at and not rt.hung:
                        out.append((rt, job, step))
            rt.stats.backlog_bytes = backlog + sum(faster.get(k, 0) for k in rt.inflight)
            for k, tc in mine.items():
                faster.setdefault(k, tc.parts[self.node].nbytes)
        return out

    def hold(self, job_id: str) -> set[int]:
        """Steps memory retention should keep a little longer: the newest two not yet on the first tier,
        while that tier is healthy (soft: a memory cap still evicts them; an unhealthy tier holds nothing,
        so memory never grows because a disk is down)."""
        if not self.tiers or not self.tiers[0].stats.healthy:
            return set()
        first = self.tiers[0]
        undrained = [s for s in sorted(self._seen.get(job_id, ())) if (job_id, s) not in first.catalog]
        return set(undrained[-2:])

    # ---- a hop --------------------------------------------------------------------------------------
    def _hop_guarded(self, rt: _TierRuntime, job: str, step: int,
                     on_chunk: Callable[[int], None] | None = None) -> bool:
        name = rt.tier.name
        rt.last_error.pop((job, step), None)
        try:
            nbytes, seconds = self.drain_one(rt, job, step, on_chunk)
        except VerifyError as e:
            self._fail(rt, job, step, ek.CHECKPOINT_TIER_VERIFY_FAILED, str(e), retry=True)
            rt.stats.verify_failures += 1
            return False
        except CorruptCheckpointError as e:
            rt.step_failures[(job, step)] = self.max_step_failures  # no good source: do not retry
            if not self._in_memory(job, step):   # retention or a rollback dropped it while its drain was queued
                log.info("drain of %s step %d to %s skipped: the checkpoint left memory meanwhile (%s)",
                         job, step, name, e)
                rt.last_error[(job, step)] = f"skipped: the checkpoint left memory meanwhile ({e})"
                return False
            self._fail(rt, job, step, ek.CHECKPOINT_DRAIN_SOURCE_CORRUPT, str(e), retry=False)
            return False
        except UnknownCheckpointError as e:
            log.info("drain of %s step %d to %s skipped: %s", job, step, name, e)
            rt.last_error[(job, step)] = f"skipped: {e}"
            return False
        except Exception as e:  # noqa: BLE001 - disk full, read-only, S3 down, hung...
            why = _why(e)
            if isinstance(e, SdcwatchError) and not e.transient:   # e.g. refused: the same copy cannot succeed
                rt.step_failures[(job, step)] = self.max_step_failures
            self._fail(rt, job, step, ek.CHECKPOINT_TIER_UNHEALTHY, why, retry=True, unhealthy=why)
            return False
        rt.fail_streak = 0
        rt.retry_at = 0.0
        rt.step_failures.pop((job, step), None)
        if not rt.stats.healthy:
            rt.stats.healthy, rt.stats.reason = True, ""
            self._emit(ek.CHECKPOINT_TIER_HEALTHY, job, f"checkpoint tier {name} works again",
                       {"tier": name})
        rt.stats.hops += 1
        rt.stats.bytes += nbytes
        rt.stats.last_throughput = nbytes / seconds if seconds > 0 else 0.0
        self.observations.append((name, seconds, nbytes))
        self._emit(ek.CHECKPOINT_DRAINED, job,
                   f"step {step} copied to {name} ({nbytes} bytes in {seconds:.2f}s, verified)",
                   {"step": step, "tier": name, "bytes": nbytes, "seconds": round(seconds, 4)})
        return True

    def _fail(self, rt: _TierRuntime, job: str, step: int, kind: EventKind, why: str, *, retry: bool,
              unhealthy: str = "") -> None:
        name = rt.tier.name
        rt.last_error[(job, step)] = why
        while len(rt.last_error) > 1024:
            rt.last_error.pop(next(iter(rt.last_error)))
        rt.stats.failures += 1
        rt.stats.errors += 1
        rt.step_failures[(job, step)] += 1
        rt.fail_streak += 1
        if retry:
            rt.retry_at = self.clock() + min(self.backoff_cap_s, 2.0 ** min(rt.fail_streak, 16) * 0.5)
        if unhealthy and (rt.stats.healthy or rt.stats.reason != unhealthy):
            rt.stats.healthy, rt.stats.reason = False, unhealthy
            self._emit(kind, job, f"checkpoint tier {name} unhealthy: {unhealthy} (step {step} not "
                       "copied; training is not affected; retrying)", {"tier": name, "step": step, "error": why})
        elif not unhealthy:
            self._emit(kind, job, f"step {step} not committed to {name}: {why}",
                       {"tier": name, "step": step, "error": why})
        else:
            log.info("drain of %s step %d to %s failed again: %s", job, step, name, why)

    def _sources(self, rt: _TierRuntime, job: str, step: int) -> tuple[
            dict[int, ShardManifest], dict[int, list[tuple[str, BlobStore]]], int, str, str]:
        """Shard manifests of this node's ranks, their sources fastest first, world size, state and what
        vouched for the bytes (the record's, else the faster tier's manifest's)."""
        manifests: dict[int, ShardManifest] = {}
        sources: dict[int, list[tuple[str, BlobStore]]] = collections.defaultdict(list)
        world, state, vouched = 0, policy.COMMITTED, ""
        try:
            info = self.coordinator.info(job, step)
        except UnknownCheckpointError:
            info = None
        if info is not None and info.state in policy.RESTORABLE_STATES:
            world, state, vouched = info.world_size, info.state, info.vouched_by
            for c in info.copies:
                if c.node == self.coordinator.node:
                    try:
                        manifests[c.rank] = self.coordinator.shard_manifest(job, step, c.rank)
                        sources[c.rank].append(("memory", self.coordinator.store))
                    except UnknownCheckpointError:
                        pass
        for other in self.tiers:
            if other is rt:
                break
            tc = other.catalog.get((job, step))
            part = tc.parts.get(self.node) if tc else None
            if part is None:
                continue
            world = world or part.world_size
            if info is None or info.state not in policy.RESTORABLE_STATES:
                state = part.state
                vouched = vouched or part.vouched_by
            for s in part.shards:
                manifests.setdefault(s.rank, s)
                sources[s.rank].append((other.tier.name, other.tier.store))
        if not manifests:
            raise UnknownCheckpointError(f"{job} step {step}: no source copy on this node any more")
        return manifests, sources, world, state, vouched

    def drain_one(self, rt: _TierRuntime, job: str, step: int,
                  on_chunk: Callable[[int], None] | None = None) -> tuple[int, float]:
        """Copy this node's shards of (job, step) to the tier, verified, then commit the tier manifest;
        `on_chunk(nbytes)` after each chunk sent (or each shard found already there, for its size)."""
        t0 = time.perf_counter()
        manifests, sources, world, state, vouched = self._sources(rt, job, step)
        dest = rt.tier.store
        written: list[str] = []
        total = 0
        try:
            for rank, m in sorted(manifests.items()):
                if self._already_there(dest, m):
                    if on_chunk is not None:
                        on_chunk(m.nbytes)
                    continue  # resume: a previous (killed) hop stored this shard whole
                written.append(m.blob)
                dest.put(m.blob, self._verified_chunks(m, sources[rank], rt.throttle, on_chunk))
                self._verify_written(rt, m)
                total += m.nbytes
            tm = TierManifest(job, step, world, self.node, state, self.clock(),
                              tuple(manifests[r] for r in sorted(manifests)), vouched[:MAX_VOUCHED])
            key = manifest_key(job, step, self.node)
            text = tm.to_json()
            dest.put(key, text.encode())
            if dest.get(key) != text.encode():
                dest.delete(key)
                raise VerifyError(f"tier {rt.tier.name}: manifest {key} reads back different; not committed")
        except BaseException:
            for key in written:
                try:
                    dest.delete(key)
                except Exception:  # noqa: BLE001 - orphan GC retries
                    pass
            raise
        with rt.lock:
            tc = rt.catalog.setdefault((job, step), TierCheckpoint(job, step, world, {}))
            tc.parts[self.node] = tm
        self._refresh_part(rt, job, step, tm)   # verified (or revoked) while the hop ran
        return total, time.perf_counter() - t0

    def _already_there(self, dest: BlobStore, m: ShardManifest) -> bool:
        try:
            if dest.size(m.blob) != m.nbytes:
                return False
        except KeyError:
            return False
        except Exception:  # noqa: BLE001 - the put will tell
            return False
        return not self._bad_chunks(dest, m)

    def _verified_chunks(self, m: ShardManifest, srcs: list[tuple[str, BlobStore]],
                         throttle: Throttle,
                         on_chunk: Callable[[int], None] | None = None) -> Iterator[memoryview]:
        buf = memoryview(bytearray(max((c.length for c in m.chunks), default=0)))
        with contextlib.ExitStack() as maps:
            mapped = [maps.enter_context(_mapped(store, m.blob, m.nbytes)) for _, store in srcs]
            for c in m.chunks:
                tried = []
                for (name, store), view in zip(srcs, mapped):
                    try:
                        if view is not None:      # a file: hash and write straight from its pages, no copy
                            dst = view[c.offset:c.offset + c.length]
                            n = len(dst)
                        else:
                            dst = buf[: c.length]
                            n = store.readinto(m.blob, c.offset, dst)
                        if verify(dst[:n], c):
                            break
                        tried.append(f"{name} (checksum mismatch)")
                    except KeyError:
                        tried.append(f"{name} (missing)")
                    except OSError as e:
                        tried.append(f"{name} (read error {e})")
                else:
                    raise CorruptCheckpointError(f"{m.blob} bytes {c.offset}..{c.offset + c.length}: no good copy "
                                                 f"to drain from: {'; '.join(tried) or 'no source'}")
                if throttle.rate <= 0:
                    yield dst
                else:
                    for off in range(0, c.length, _THROTTLE_SLICE):   # paced in slices: a big chunk too
                        piece = dst[off:off + _THROTTLE_SLICE]
                        throttle.take(len(piece))
                        yield piece
                if on_chunk is not None:
                    on_chunk(c.length)

    def _bad_chunks(self, store: BlobStore, m: ShardManifest,
                    on_chunk: Callable[[int], None] | None = None) -> list[str]:
        """What is wrong with `store`'s copy of the shard: [] when every chunk checksum matches.
        `on_chunk(nbytes)` after each chunk read."""
        try:
            size = store.size(m.blob)
        except KeyError:
            return ["missing"]
        if size != m.nbytes:
            return [f"size {size} != {m.nbytes} (truncated or grown)"]
        buf = memoryview(bytearray(max((c.length for c in m.chunks), default=0)))
        bad = []
        with _mapped(store, m.blob, m.nbytes) as view:
            for c in m.chunks:
                if view is not None:
                    got = view[c.offset:c.offset + c.length]
                else:
                    try:
                        got = buf[: store.readinto(m.blob, c.offset, buf[: c.length])]
                    except KeyError:
                        return ["missing"]
                if not verify(got, c):
                    bad.append(f"chunk @{c.offset}: " + ("short read" if len(got) != c.length else "checksum mismatch"))
                if on_chunk is not None:
                    on_chunk(c.length)
        return bad

    def _verify_written(self, rt: _TierRuntime, m: ShardManifest) -> None:
        store = rt.tier.store
        if rt.tier.verify == "store":
            check = getattr(store, "verify_stored", None)
            ok = check(m.blob) if check is not None else None
            if ok is True and store.size(m.blob) == m.nbytes:
                return
            if ok is False:
                raise VerifyError(f"tier {rt.tier.name}: {m.blob}: the store's checksum differs from what was sent")
        bad = self._bad_chunks(store, m)
        if bad:
            raise VerifyError(f"tier {rt.tier.name}: {m.blob} written but reads back wrong: {', '.join(bad[:4])}")

    # ---- catalog, retention, GC ---------------------------------------------------------------------
    def _refresh_catalog(self, rt: _TierRuntime) -> None:
        try:
            cat = scan(rt.tier.store)
        except Exception as e:  # noqa: BLE001
            log.warning("scanning tier %s failed: %s", rt.tier.name, e)
            rt.stats.errors += 1
            return
        with rt.lock:
            rt.catalog = cat
        mine = [tc.parts[self.node] for tc in cat.values() if self.node in tc.parts]
        rt.stats.held, rt.stats.held_bytes = len(mine), sum(m.nbytes for m in mine)

    def _sweep_temp(self, rt: _TierRuntime, now: float, older_than_s: float) -> None:
        sweep = getattr(rt.tier.store, "sweep_temp", None)
        if sweep is None:
            return
        try:
            n = sweep(older_than_s, now)
            if n:
                log.info("tier %s: removed %d temp file(s)/upload(s) of interrupted copies", rt.tier.name, n)
        except Exception as e:  # noqa: BLE001
            log.warning("tier %s: sweeping temp files failed: %s", rt.tier.name, e)

    def maintain(self, now: float | None = None) -> dict[str, list[tuple[str, int]]]:
        """Blocking: refresh catalogs and manifest states, retention, orphans. Returns deletions per tier."""
        now = self.clock() if now is None else now
        out: dict[str, list[tuple[str, int]]] = {}
        for rt in self.tiers:
            try:
                out[rt.tier.name] = self._maintain_tier(rt, now)
            except Exception as e:  # noqa: BLE001 - one tier's failure never stops the others
                rt.stats.errors += 1
                log.warning("maintenance of tier %s failed: %s", rt.tier.name, e)
        return out

    def _maintain_tier(self, rt: _TierRuntime, now: float) -> list[tuple[str, int]]:
        self._refresh_catalog(rt)
        self._sweep_temp(rt, now, self.orphan_ttl_s)
        store, name = rt.tier.store, rt.tier.name
        deleted: list[tuple[str, int]] = []
        mine = {k: tc.parts[self.node] for k, tc in rt.catalog.items() if self.node in tc.parts}
        for (job, step), part in list(mine.items()):   # refresh VERIFIED / revoked, and its evidence, from Redis
            mine[(job, step)] = self._refresh_part(rt, job, step, part)
        busy = set(rt.inflight)
        for job in sorted({k[0] for k in mine}):
            for step in self._left_behind(rt, job, self.coordinator.cuts(job)):
                mine.pop((job, step), None)
                deleted.append((job, step))
            held = [Held(s, m.state == policy.VERIFIED, m.created) for (j, s), m in mine.items() if j == job]
            protected = {s for (j, s) in busy if j == job}
            for step in plan_retention(rt.tier.rule, held, now, protected):
                if not self._delete_part(rt, job, step, mine[(job, step)]):
                    continue
                rt.stats.retention_deletions += 1
                deleted.append((job, step))
                self._emit(ek.CHECKPOINT_TIER_DELETED, job, f"step {step} deleted from {name} by retention",
                           {"step": step, "tier": name})
        keys = store.list("")
        for key in orphans(keys, rt.catalog, busy):
            first = rt.orphan_seen.setdefault(key, now)
            if now - first >= self.orphan_ttl_s:
                store.delete(key)
                rt.orphan_seen.pop(key, None)
                rt.stats.orphans_deleted += 1
                log.info("tier %s: deleted orphan blob %s (no manifest names it)", name, key)
        live = set(keys)
        rt.orphan_seen = {k: t for k, t in rt.orphan_seen.items() if k in live}
        self._refresh_catalog(rt)
        return deleted

    def _refresh_part(self, rt: _TierRuntime, job: str, step: int, part: TierManifest) -> TierManifest:
        """This node's tier copy of (job, step) with the record's state and evidence (rewritten if they changed).
        A record evicted from memory keeps, in its tombstone, the state it had (`dropped_from`)."""
        try:
            info = self.coordinator.info(job, step)
        except UnknownCheckpointError:
            return part
        st = info.state if info.state in policy.RESTORABLE_STATES else info.dropped_from
        vouched = (info.vouched_by or part.vouched_by)[:MAX_VOUCHED]
        if st not in policy.RESTORABLE_STATES or (st, vouched) == (part.state, part.vouched_by):
            return part
        new = part.with_state(st, vouched)
        with rt.lock:
            tc = rt.catalog.get((job, step))
            if tc is None or tc.parts.get(self.node) is not part:
                return part   # deleted or rewritten meanwhile
            rt.tier.store.put(manifest_key(job, step, self.node), new.to_json().encode())
            tc.parts[self.node] = new
        return new

    def refresh_states(self, job: str, steps: list[int]) -> None:
        """Blocking: the records of these steps became VERIFIED or lost it; their tier copies on this node say
        so now (the checkpoint service calls this; maintenance would, a round later)."""
        for rt in self.tiers:
            for step in steps:
                tc = rt.catalog.get((job, step))
                part = tc.parts.get(self.node) if tc is not None else None
                if part is not None:
                    try:
                        self._refresh_part(rt, job, step, part)
                    except Exception as e:  # noqa: BLE001 - maintenance retries
                        log.warning("tier %s: refreshing %s step %d failed: %s", rt.tier.name, job, step, e)

    def _delete_part(self, rt: _TierRuntime, job: str, step: int, part: TierManifest) -> bool:
        """Delete this node's copy of (job, step) from the tier: out of the catalog (False: another thread took
        it first), then the manifest (uncommit), then the bytes."""
        with rt.lock:
            tc = rt.catalog.get((job, step))
            if tc is None or tc.parts.get(self.node) is not part:
                return False
            tc.parts.pop(self.node, None)
            if not tc.parts:
                del rt.catalog[(job, step)]
        rt.tier.store.delete(manifest_key(job, step, self.node))
        for s in part.shards:
            rt.tier.store.delete(s.blob)
        return True

    def _left_behind(self, rt: _TierRuntime, job: str, cuts: dict[int, float]) -> list[int]:
        """Delete this node's tier copies of `job` that hold history the job left: a step after a step it went
        back to, with bytes a rank made (its shards' `created`) before it went back (`Coordinator.cuts`). A copy
        of the same step saved again after the restore is another record, with other bytes, and stays."""
        if not cuts:
            return []
        out, ordered = [], sorted(cuts.items())
        for (j, step), tc in list(rt.catalog.items()):
            part = tc.parts.get(self.node)
            if j != job or part is None or not part.shards:
                continue
            made = min(sh.created for sh in part.shards)
            cut = next((c for c, at in ordered if c < step and made < at), None)
            if cut is None or not self._delete_part(rt, job, step, part):
                continue
            out.append(step)
            self._emit(ek.CHECKPOINT_TIER_DELETED, job, f"step {step} deleted from {rt.tier.name}: history the "
                       f"job left when it went back to step {cut}", {"step": step, "tier": rt.tier.name})
        return out

    def drop_left_history(self, job: str) -> None:
        """Blocking: delete this node's tier copies that hold history `job` left (`Coordinator.cuts`), at once
        after it went back (the checkpoint service calls this; every node's maintenance finds them too)."""
        cuts = self.coordinator.cuts(job)
        for rt in self.tiers:
            try:
                self._left_behind(rt, job, cuts)
            except Exception as e:  # noqa: BLE001 - maintenance retries; one tier never stops the others
                rt.stats.errors += 1
                log.warning("tier %s: dropping the copies job %s left failed: %s", rt.tier.name, job, e)

    def _check_hung(self, now: float) -> None:
        mono = time.monotonic()
        for rt in self.tiers:
            hung = any(mono - t > rt.tier.hop_timeout_s for t in rt.inflight.values())
            if hung and not rt.hung:
                rt.hung = True
                rt.stats.healthy, rt.stats.reason = False, "hung"
                rt.stats.errors += 1
                self._emit(ek.CHECKPOINT_TIER_UNHEALTHY, "-", f"checkpoint tier {rt.tier.name}: a copy has "
                           f"run over {rt.tier.hop_timeout_s:.0f}s (hung); no new copies start there until it returns",
                           {"tier": rt.tier.name, "error": "hung"})
            elif not hung and rt.hung:
                rt.hung = False

    # ---- queries: restore plans, verify ---------------------------------------------------------------
    def tier_copies(self, job: str, step: int) -> dict[int, list[Copy]]:
        """rank -> copies on the tiers, tier order (fastest first)."""
        out: dict[int, list[Copy]] = collections.defaultdict(list)
        for rt in self.tiers:
            tc = rt.catalog.get((job, step))
            if tc is None:
                continue
            for node, part in sorted(tc.parts.items(), key=lambda kv: kv[0] != self.node):
                if not rt.tier.shared and node != self.node:
                    continue
                for s in part.shards:
                    out[s.rank].append(Copy(s.rank, node, rt.tier.location, rt.tier.name))
        return out

    def tiers_holding(self, job: str, step: int) -> list[str]:
        return [rt.tier.name for rt in self.tiers if (job, step) in rt.catalog]

    def tier_checkpoints(self, job: str = "") -> dict[tuple[str, int], TierCheckpoint]:
        """Every checkpoint some tier holds whole (the union of parts over tiers), fastest tier's first."""
        out: dict[tuple[str, int], TierCheckpoint] = {}
        for rt in self.tiers:
            for k, tc in rt.catalog.items():
                if job and k[0] != job:
                    continue
                if k not in out:
                    out[k] = TierCheckpoint(tc.job_id, tc.step, tc.world_size, dict(tc.parts))
                else:
                    for node, part in tc.parts.items():
                        out[k].parts.setdefault(node, part)
        return out

    def verify_copies(self, job: str, step: int, memory: list[tuple[str, str, BlobStore]],
                      progress: Progress | None = None) -> list[dict[str, Any]]:
        """Re-read every copy of (job, step): `memory` [(tier, location, store)] plus every tier; each shard
        copy gets {tier, location, rank, ok, detail}. Bad copies count as tier errors and are journaled.
        `progress(done_bytes, total_bytes, what)` after every chunk read (and once per copy that could not
        be read, for its whole size)."""
        manifests = self.coordinator.shard_manifests(job, step)   # the shards that exist, not world_size of them
        copies: list[tuple[str, str, BlobStore, ShardManifest]] = []
        for tier, location, store in memory:
            for m in manifests.values():
                copies.append((tier, location, store, m))
        for rt in self.tiers:
            tc = rt.catalog.get((job, step))
            if tc is None:
                continue
            for node, part in tc.parts.items():
                if rt.tier.shared or node == self.node:
                    for m in part.shards:
                        copies.append((rt.tier.name, rt.tier.location, rt.tier.store, m))
        if not copies:
            raise UnknownCheckpointError(f"job {job} step {step}: no copy on any tier this node can read")
        out = []
        meter = _Meter(sum(m.nbytes for *_, m in copies), progress)
        for tier, location, store, m in copies:
            meter.what = f"{tier} rank {m.rank}"
            start = meter.done
            try:
                bad = self._bad_chunks(store, m, meter.add)
            except Exception as e:  # noqa: BLE001
                bad = [f"read error: {_why(e)}"]
            meter.add(start + m.nbytes - meter.done)   # a copy cut short still counts as handled
            out.append({"tier": tier, "location": location, "rank": m.rank, "ok": not bad,
                        "detail": "; ".join(bad[:4]) or f"{len(m.chunks)} chunks ok", "bytes": m.nbytes})
            if bad:
                for rt in self.tiers:
                    if rt.tier.name == tier:
                        rt.stats.errors += 1
                self._emit(ek.CHECKPOINT_COPY_CORRUPT, job,
                           f"step {step} rank {m.rank} on {tier} ({location}) is bad: {'; '.join(bad[:4])}",
                           {"step": step, "rank": m.rank, "tier": tier})
        return out

    def stats(self) -> dict[str, TierStats]:
        return {rt.tier.name: dataclasses.replace(rt.stats) for rt in self.tiers}

    def _emit(self, kind: EventKind, job_id: str, message: str, details: dict) -> None:
        self.coordinator.emit(kind, job_id, message, details)




@contextlib.contextmanager
def _mapped(store: BlobStore, key: str, nbytes: int) -> Iterator[memoryview | None]:
    """A read-only mapping of a directory store's blob (None for other stores, or when it cannot be mapped:
    the caller then reads with `readinto`). The file is pinned by a hard link under `<root>/.pins/` while
    mapped (`DirStore.pinned`, made fd-relative without following a link): a file with more than one link is
    never recycled by ShmStore nor reused as a rank's staging slot, so nobody truncates it under the mapping
    (which would be a SIGBUS)."""
    pinned = getattr(store, "pinned", None)
    if pinned is None or nbytes == 0:
        yield None
        return
    with contextlib.ExitStack() as stack:
        try:
            fd = stack.enter_context(pinned(key))
            mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) if os.fstat(fd).st_size == nbytes else None
        except (OSError, ValueError, KeyError):
            mm = None
        if mm is None:
            yield None
            return
        view = memoryview(mm)
        try:
            yield view
        finally:
            view.release()
            try:
                mm.close()
            except BufferError:  # a consumer still holds a slice; the mapping goes with the last reference
                pass


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno in _UNHEALTHY_ERRNOS:
        return f"{_UNHEALTHY_ERRNOS[e.errno]}: {e}"
    return f"{type(e).__name__}: {e}"
