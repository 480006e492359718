"""grpc.aio servicer for `sdcwatch.v1.Checkpoints` (proto/sdcwatch/v1/checkpoint.proto).

Built by the agent's composition (daemon/compose.py), with what it uses passed in:

    svc = build_checkpoint_service(redis_url, state_dir, publish, node=hostname,   # publish: EventBus.publish
                                   drainer_factory=..., metrics=CheckpointMetrics(registry))  # (event_kinds.Publish)
    # peer replicas ([peers], daemon/peers_wiring.py): build_checkpoint_service(..., replicator_factory=
    #     peers_wiring.replicator_factory(config.peers, hostname), replicate_timeout_s=config.peers.timeout_s)
    # durable tiers ([tiers], daemon/drain_wiring.py): drainer_factory=drain_wiring.drainer_factory(...)
    await svc.open()                 # after the agent holds its state dir: reconciles index and memory dir
    register(server, svc)            # Checkpoints and PeerStore; SERVICE_NAMES lists both
    svc.start(background)            # the maintenance loop (retention + GC) and the drainer, as tasks
    # replica votes and bad events, from the detectors (kinds in checkpoint.policy.EVENT_KINDS:
    # "vote_agreed", "vote_mismatch", "sdc", "nan", "diverged", "fatal_hardware", "rollback", "clear",
    # "repaired"):
    await svc.job_event(job_id, step_or_None, "vote_agreed", time.time())
    svc.stats()  # counters for /metrics: shards/checkpoints committed, bytes, evictions, aborted, ...
    svc.summaries()  # per-job summary, refreshed each maintenance round (no I/O): GetStatus, metrics
    await svc.close()  # on stop; the memory dir stays (its checkpoints are restorable after a restart)

The memory tier outlives the agent: the embedded Redis persists its index in the state dir
(daemon/redis_embedded.py), an external Redis is the job's. `open()` (at start, and after the embedded
server was restarted) reconciles the two: a record's copy on this node whose bytes are gone is dropped
(`Coordinator.reconcile_local`), and with `own_index=True` (the agent's own embedded Redis: nobody else can
index this node's memory dir) the job dirs no record names are removed (a previous index was lost).

Every request is validated (INVALID_ARGUMENT with the reason; a world_size over `[checkpoints]
max_world_size` too), and the work it causes is proportional to what exists (VerifyCopies reads the shards
that were committed, not `world_size` of them). The RPCs' Redis and store I/O runs in the service's own
bounded pool (`pool`, a daemon/pools.py WorkPool; PeerStore has its own), never on the event loop, and never
in the threads other services need; the agent's health watches the pools. Errors map to codes: unknown step / not in memory ->
NOT_FOUND, commit conflicts -> FAILED_PRECONDITION, corrupt bytes -> DATA_LOSS, Redis down -> UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import logging
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import grpc
import redis

from checkpoint import policy
from checkpoint.coordinator import Coordinator, CoordinatorConfig, blob_key
from checkpoint.drainer import Drainer
from checkpoint.commit_fence import CommitFence
from checkpoint.errors import (UNKNOWN_LAYOUT, CommitError, CorruptCheckpointError, InvalidInputError,
                               StoreUnavailableError, UnknownCheckpointError)
from checkpoint.locations import dir_store_for
from checkpoint.names import validate_job_id, validate_rank, validate_step
from checkpoint.peers import Replicator
from checkpoint.redis_connect import RedisOptions, connect, epoch_source, era_source
from checkpoint.records import (LATEST, LATEST_VERIFIED, CheckpointInfo, Copy, Restored, RestorePlan,
                                RestoreReportMsg, SaveReport, ShardPlan)
from sdcwatch.event_kinds import Publish
from checkpoint.shard_layout import ShardLayout
from checkpoint.shm_store import ShmStore, default_shm_root, disk_filesystem, secure_memory_dir
from daemon.background import Background, cancel_tasks
from daemon.pools import WorkPool, run_in_thread
from daemon.checkpoint_metrics import CheckpointMetrics
from daemon.peer_store_service import PeerStoreService
from daemon import peer_store_service
from proto.sdcwatch.v1 import agent_pb2
from proto.sdcwatch.v1 import checkpoint_pb2 as pb
from proto.sdcwatch.v1 import checkpoint_pb2_grpc as pb_grpc
from proto.sdcwatch.v1 import peer_pb2

log = logging.getLogger(__name__)

STATE_TO_PB = {
    policy.PENDING: pb.CHECKPOINT_STATE_PENDING, policy.COMMITTED: pb.CHECKPOINT_STATE_COMMITTED,
    policy.VERIFIED: pb.CHECKPOINT_STATE_VERIFIED, policy.ABORTED: pb.CHECKPOINT_STATE_ABORTED,
    policy.EVICTED: pb.CHECKPOINT_STATE_EVICTED,
}
PB_TO_STATE = {v: k for k, v in STATE_TO_PB.items()}
# shard layouts (checkpoint.shard_layout) the agent keeps, the newest first: a node's ranks' current ones. Bounded
# by count and by their tensors in all (about half a KB of plans and JSON fragments each); the newest is kept
LAYOUTS_KEPT = 64
LAYOUT_ENTRIES_KEPT = 1 << 19


def copy_to_pb(c: Copy, node: str = "") -> pb.ShardCopy:
    tier = "peer" if c.tier == "memory" and node and c.node != node else c.tier
    return pb.ShardCopy(rank=c.rank, node=c.node, location=c.location, tier=tier)


def info_to_pb(i: CheckpointInfo, tiers: list[str] | None = None, node: str = "") -> pb.CheckpointInfo:
    return pb.CheckpointInfo(
        job_id=i.job_id, step=i.step, state=STATE_TO_PB.get(i.state, pb.CHECKPOINT_STATE_UNSPECIFIED),
        world_size=i.world_size, shards=i.shards, bytes=i.nbytes, begun_at=i.begun_at,
        committed_at=i.committed_at, verified_at=i.verified_at, reason=i.reason,
        copies=[copy_to_pb(c, node) for c in i.copies], tiers=tiers or [], vouched_by=i.vouched_by)


class CheckpointService(pb_grpc.CheckpointsServicer):
    """`replicator` copies each committed shard to the peers; `drainer` copies checkpoints to the durable
    tiers (restore plans and listings include its copies); `metrics` is updated every maintenance round."""

    def __init__(self, coordinator: Coordinator, *, replicator: Replicator | None = None,
                 drainer: Drainer | None = None, metrics: CheckpointMetrics | None = None,
                 maintenance_timeout_s: float = 60.0, clock: Callable[[], float] = time.time,
                 own_index: bool = False, replicate_timeout_s: float = 120.0,
                 pool: WorkPool | None = None, peer_pool: WorkPool | None = None) -> None:
        self.coordinator = coordinator
        self.replicator = replicator
        self.drainer = drainer
        self.metrics = metrics
        self.maintenance_timeout_s = maintenance_timeout_s
        self.clock = clock
        self.own_index = own_index
        self.replicate_timeout_s = replicate_timeout_s   # one shard to every peer (daemon/peers_config.py)
        # the PeerStore servicer over this node's memory tier: one for every server (unix socket, TCP)
        self.pool = pool or WorkPool("checkpoints")
        self.peer_store = PeerStoreService(coordinator.store, pool=peer_pool)
        # the background work's own pools (never asyncio's shared default executor): a maintenance round that
        # hangs (Redis, the memory dir) holds one of these, and the next rounds are skipped, not queued
        wedged = self.pool.wedged_after_s
        self.maintenance_pool = WorkPool("checkpoint-maintenance", workers=2, wedged_after_s=wedged)
        self.replication_pool = WorkPool("replication", workers=4, wedged_after_s=wedged)
        self.lease_pool = WorkPool("node-lease", workers=1, wedged_after_s=wedged)   # never behind maintenance
        self._background: set[asyncio.Task[Any]] = set()
        # the shard layouts ranks sent (checkpoint.shard_layout), by (job, rank, layout id): the newest kept
        self._layouts: collections.OrderedDict[tuple[str, int, str], ShardLayout] = collections.OrderedDict()
        self._layouts_lock = threading.Lock()
        self._drain_lock = asyncio.Lock()
        self._summaries: list[agent_pb2.CheckpointSummary] = []
        self._summary_at = 0.0
        self._memory_bytes = 0

    # ---- RPCs ---------------------------------------------------------------------------------------
    async def Begin(self, request: pb.BeginRequest, context: grpc.aio.ServicerContext) -> pb.BeginResponse:
        job, step, rank, world = await self._shard_args(request, context)
        restored = None
        if request.restored_at != 0 or request.restored_step != 0:   # 0, 0: no restore, or an older client
            at = request.restored_at
            if request.restored_step < 0 or not math.isfinite(at) or at <= 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "restored_step must be >= 0 and restored_at a time (seconds since the "
                                    f"epoch), got restored_step {request.restored_step} restored_at {at}")
            restored = Restored(request.restored_step, at)
        r = await self._call(context, self._begin, job, step, rank, world, self.clock(), restored)
        if r.cut:   # the rank's restore cut the history: its tier copies go now, in the background
            self._spawn(self._drop_left_history(job))
        return pb.BeginResponse(state=STATE_TO_PB.get(r.state, 0), node=r.node, location=r.location,
                                blob_key=r.blob_key)

    def _begin(self, job: str, step: int, rank: int, world: int, now: float,
               restored: Restored | None) -> Any:
        return self.coordinator.begin(job, step, rank, world, now, restored=restored)

    async def CommitShard(self, request: pb.CommitShardRequest,
                          context: grpc.aio.ServicerContext) -> pb.CommitShardResponse:
        job, step, rank, world = await self._shard_args(request, context)
        if not request.layout_id and not request.manifest_json:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "manifest_json is empty")
        report = SaveReport(max(0.0, request.blocking_seconds), max(0.0, request.safe_seconds),
                            max(0.0, request.stall_seconds), request.skipped_saves, request.staging[:16])
        r = await self._call(context, self._commit_shard, job, step, rank, world, request, report)
        if self.replicator is not None:
            self._spawn(self._replicate(job, step, rank))
        if r.committed_now and self.drainer is not None:
            self.drainer.kick()
        return pb.CommitShardResponse(state=STATE_TO_PB.get(r.state, 0), committed=r.committed_now, shards=r.shards)

    def _commit_shard(self, job: str, step: int, rank: int, world: int, req: pb.CommitShardRequest,
                      report: SaveReport) -> Any:
        """Pool thread: the commit, its manifest sent as JSON or (a layout id) rendered here first."""
        text = self._render_words(job, step, rank, world, req) if req.layout_id else req.manifest_json
        return self.coordinator.commit_shard(job, step, rank, world, text, self.clock(), report)

    def _render_words(self, job: str, step: int, rank: int, world: int, req: pb.CommitShardRequest) -> str:
        """Pool thread: the manifest of a shard sent as its layout (by id, its JSON with the first commit)
        and its pieces' words. CommitError (FAILED_PRECONDITION, saying UNKNOWN_LAYOUT) for a layout id this
        agent does not keep; InvalidInputError for a layout or words that do not fit."""
        key = (job, rank, req.layout_id)
        with self._layouts_lock:
            layout = self._layouts.get(key)
            if layout is not None:
                self._layouts.move_to_end(key)
        if layout is None:
            if not req.layout_json:
                raise CommitError(f"{UNKNOWN_LAYOUT} {req.layout_id[:16]} for job {job} rank {rank} on this agent: "
                                  "send layout_json with the commit")
            if hashlib.sha256(req.layout_json.encode()).hexdigest() != req.layout_id:
                raise InvalidInputError("layout_id is not the sha256 of layout_json")
            layout = ShardLayout.from_json(req.layout_json)
            layout.check_for(job, rank, world)
            with self._layouts_lock:
                self._layouts[key] = layout
                held = sum(len(v.entries) for v in self._layouts.values())
                while len(self._layouts) > 1 and (len(self._layouts) > LAYOUTS_KEPT or held > LAYOUT_ENTRIES_KEPT):
                    _, old = self._layouts.popitem(last=False)
                    held -= len(old.entries)
        words = layout.words_from_bytes(req.piece_words)
        created = req.created if math.isfinite(req.created) and req.created > 0 else self.clock()
        return layout.render(step, blob_key(job, step, rank), words, created)

    async def List(self, request: pb.ListCheckpointsRequest,
                   context: grpc.aio.ServicerContext) -> pb.ListCheckpointsResponse:
        job = await self._job(request.job_id, context) if request.job_id else ""
        infos = await self._call(context, self.coordinator.list, job) if job else await self._call(context, self._list_all)
        return pb.ListCheckpointsResponse(checkpoints=self._with_tiers(infos, job))

    def _with_tiers(self, infos: list[CheckpointInfo], job: str) -> list[pb.CheckpointInfo]:
        """Memory records plus the checkpoints only the durable tiers still hold; `tiers` says where."""
        node = self.coordinator.node
        if self.drainer is None:
            return [info_to_pb(i, ["memory"] if i.state in policy.RESTORABLE_STATES else [], node) for i in infos]
        out = []
        seen = set()
        for i in infos:
            seen.add((i.job_id, i.step))
            mem = ["memory"] if i.state in policy.RESTORABLE_STATES else []
            out.append(info_to_pb(i, mem + self.drainer.tiers_holding(i.job_id, i.step), node))
        for (j, step), tc in sorted(self.drainer.tier_checkpoints(job).items()):
            if (j, step) in seen:
                continue
            out.append(info_to_pb(tier_info(tc, self.drainer.tier_copies(j, step)),
                                  self.drainer.tiers_holding(j, step), node))
        return out

    async def ReportRestore(self, request: pb.ReportRestoreRequest,
                            context: grpc.aio.ServicerContext) -> pb.ReportRestoreResponse:
        job = await self._job(request.job_id, context)
        if request.step < 0 or request.rank < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"step and rank must be >= 0, got step {request.step} rank {request.rank}")
        msg = RestoreReportMsg(job, request.step, request.rank, max(0.0, request.seconds), request.bytes,
                               request.chunks, request.fallbacks, request.checksum_failures, request.ok,
                               request.error[:2000], request.source[:200])
        if not await self._call(context, self._knows_job, job):   # never journal a job this node never saw
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint of job {job} is known on this node")
        await self._call(context, self.coordinator.report_restore, msg)
        return pb.ReportRestoreResponse()

    def _knows_job(self, job: str) -> bool:
        """Blocking: a checkpoint record of `job` in the index, or a copy of it on a durable tier."""
        return self.coordinator.knows_job(job) or bool(self.drainer is not None and
                                                       self.drainer.tier_checkpoints(job))

    async def Latest(self, request: pb.LatestRequest, context: grpc.aio.ServicerContext) -> pb.LatestResponse:
        job = await self._job(request.job_id, context)
        i = await self._call(context, self.coordinator.latest, job)
        return pb.LatestResponse(found=i is not None, checkpoint=info_to_pb(i) if i else None)

    async def LatestVerified(self, request: pb.LatestRequest,
                             context: grpc.aio.ServicerContext) -> pb.LatestResponse:
        job = await self._job(request.job_id, context)
        i = await self._call(context, self.coordinator.latest_verified, job)
        return pb.LatestResponse(found=i is not None, checkpoint=info_to_pb(i) if i else None)

    async def RestorePlan(self, request: pb.RestorePlanRequest,
                          context: grpc.aio.ServicerContext) -> pb.RestorePlanResponse:
        job = await self._job(request.job_id, context)
        which = request.WhichOneof("target")
        target: int | str
        if which == "step":
            target = request.step
            if target < 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step must be >= 0, got {target}")
        elif which == "selector" and request.selector == pb.RESTORE_SELECTOR_LATEST:
            target = LATEST
        elif which == "selector" and request.selector == pb.RESTORE_SELECTOR_LATEST_VERIFIED:
            target = LATEST_VERIFIED
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "restore target missing: set step or selector (LATEST / LATEST_VERIFIED)")
        if request.rank < -1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank must be >= -1, got {request.rank}")
        rank = None if request.rank == -1 else request.rank
        plan = await self._call(context, self.restore_plan, job, target, rank)
        node = self.coordinator.node
        return pb.RestorePlanResponse(checkpoint=info_to_pb(plan.checkpoint, node=node), shards=[
            pb.ShardPlan(rank=s.rank, manifest_json=s.manifest.to_json(), copies=[copy_to_pb(c, node) for c in s.copies])
            for s in plan.shards])

    def restore_plan(self, job: str, target: int | str, rank: int | None) -> RestorePlan:
        """Blocking. Memory first (this node, then peers), then every durable tier holding the checkpoint,
        fastest first; a checkpoint memory no longer has (evicted, or the Redis restarted empty) is planned
        from the tiers alone."""
        try:
            plan = self.coordinator.restore_plan(job, target, rank)
        except UnknownCheckpointError as e:
            if self.drainer is None:
                raise
            return self._tier_plan(job, target, rank, e)
        if self.drainer is None:
            return plan
        extra = self.drainer.tier_copies(job, plan.checkpoint.step)
        return RestorePlan(plan.checkpoint, tuple(
            ShardPlan(s.rank, s.manifest, tuple(s.copies) + tuple(extra.get(s.rank, ()))) for s in plan.shards))

    def _tier_plan(self, job: str, target: int | str, rank: int | None, why: Exception) -> RestorePlan:
        cps = {s: tc for (j, s), tc in self.drainer.tier_checkpoints(job).items() if tc.complete}
        steps = sorted(cps)
        if target == LATEST:
            pick = steps[-1] if steps else None
        elif target == LATEST_VERIFIED:
            v = [s for s in steps if cps[s].state == policy.VERIFIED]
            pick = v[-1] if v else None
        else:
            pick = target if target in cps else None
        if pick is None:
            have = ", ".join(f"{s}:{cps[s].state}" for s in steps) or "none"
            raise UnknownCheckpointError(f"{why}; the durable tiers hold no match either (have: {have})")
        tc = cps[pick]
        copies = self.drainer.tier_copies(job, pick)
        info = tier_info(tc, copies)
        ranks = range(tc.world_size) if rank is None else [rank]
        if rank is not None:
            validate_rank(rank, tc.world_size)
        shards = []
        for r in ranks:
            m = tc.shard(r)
            if m is None:
                raise UnknownCheckpointError(f"job {job} step {pick}: no tier holds rank {r}'s shard")
            shards.append(ShardPlan(r, m, tuple(copies.get(r, ()))))
        return RestorePlan(info, tuple(shards))

    async def VerifyCopies(self, request: pb.VerifyCopiesRequest,
                           context: grpc.aio.ServicerContext) -> pb.VerifyCopiesResponse:
        job = await self._job(request.job_id, context)
        if request.step < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step must be >= 0, got {request.step}")
        checks = await self._call(context, self.verify_copies, job, request.step)
        return pb.VerifyCopiesResponse(checks=[pb.CopyCheck(**c) for c in checks])

    async def WatchVerifyCopies(self, request: pb.VerifyCopiesRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[pb.VerifyCopiesUpdate]:
        """VerifyCopies with progress: an update after every chunk read (coalesced while the client is
        slower), then the result."""
        job = await self._job(request.job_id, context)
        if request.step < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step must be >= 0, got {request.step}")
        async for kind, value in self._with_progress(context, self.verify_copies, job, request.step):
            if kind == "progress":
                yield pb.VerifyCopiesUpdate(progress=value)
            else:
                checks = [pb.CopyCheck(**c) for c in value]
                yield pb.VerifyCopiesUpdate(result=pb.VerifyCopiesResponse(checks=checks))

    async def Drain(self, request: pb.DrainRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DrainUpdate]:
        """Copy this node's checkpoints to the durable tiers now and wait (`Drainer.drain_all`): progress
        after every chunk, then every copy tried and the tiers' state. FAILED_PRECONDITION without tiers."""
        job = request.job_id
        if job:
            job = await self._job(job, context)
        if self.drainer is None or not self.drainer.tiers:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "no durable checkpoint tier is configured ([tiers] nvme, flash or s3): a "
                                "node's checkpoints live in memory only and cannot be drained")
        async with self._drain_lock:   # one drain at a time; a second waits for the first
            async for kind, value in self._with_progress(context, self.drainer.drain_all, job):
                if kind == "progress":
                    yield pb.DrainUpdate(progress=value)
                else:
                    hops = [pb.DrainHop(tier=r.tier, job_id=r.job, step=r.step, ok=r.ok, detail=r.detail,
                                        bytes=r.bytes) for r in value]
                    yield pb.DrainUpdate(result=pb.DrainResponse(hops=hops, tiers=self.tier_status()))

    async def _with_progress(self, context: grpc.aio.ServicerContext, fn: Callable[..., Any],
                             *args: Any) -> AsyncIterator[tuple[str, Any]]:
        """Run the blocking `fn(*args, progress)` on a thread of its own (a long drain must not hold one of
        the RPC pool's workers, nor the loop's shutdown); yield ("progress", pb.Progress) as it reports (the
        newest only, when several are waiting), then ("result", its return value). Errors map like
        `_call`'s."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[tuple[int, int, str]] = asyncio.Queue()

        def progress(done: int, total: int, what: str) -> None:
            with contextlib.suppress(RuntimeError):   # the loop is gone: the agent is stopping
                loop.call_soon_threadsafe(updates.put_nowait, (done, total, what))

        name = getattr(fn, "__name__", "checkpoint-op")
        done = run_in_thread(loop, name, fn, *args, progress)
        # its error is always retrieved: a caller gone while this generator waits at a `yield` leaves it
        # suspended until it is collected, after the future, which asyncio would log as never retrieved
        done.add_done_callback(_retrieved)
        try:
            while True:
                getter = asyncio.ensure_future(updates.get())
                try:
                    await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter.done() and not getter.cancelled():
                    latest = getter.result()
                    while not updates.empty():
                        latest = updates.get_nowait()
                    yield "progress", pb.Progress(done_bytes=latest[0], total_bytes=latest[1], what=latest[2])
                    continue
                if done.done():
                    break
        finally:
            if not done.done():   # the caller left (cancelled, past its deadline): the work goes on, its
                done.add_done_callback(functools.partial(_orphan_ended, name))   # end said, not "never retrieved"
        try:
            result = done.result()
        except Exception as e:  # noqa: BLE001
            code, msg = _status_for(e, fn)
            await context.abort(code, msg)
        yield "result", result

    def verify_copies(self, job: str, step: int, progress: Any = None) -> list[dict[str, Any]]:
        """Blocking: re-check every copy (memory here and on peers this node can open, every tier);
        `progress(done_bytes, total_bytes, what)` after every chunk (checkpoint.drainer.Progress)."""
        memory: list[tuple[str, str, Any]] = []
        try:
            info = self.coordinator.info(job, step)
            if info.state in policy.RESTORABLE_STATES:
                for loc in dict.fromkeys(c.location for c in info.copies if c.tier == "memory"):
                    node = next(c.node for c in info.copies if c.location == loc)
                    try:
                        store = self.coordinator.store if node == self.coordinator.node else dir_store_for(loc)
                        memory.append(("memory" if node == self.coordinator.node else "peer", loc, store))
                    except OSError:
                        continue
        except UnknownCheckpointError:
            pass
        if self.drainer is not None:
            return self.drainer.verify_copies(job, step, memory, progress)
        return Drainer(self.coordinator, []).verify_copies(job, step, memory, progress)

    async def Tiers(self, request: pb.TiersRequest, context: grpc.aio.ServicerContext) -> pb.TiersResponse:
        return pb.TiersResponse(tiers=self.tier_status())

    def tier_status(self) -> list[pb.TierStatus]:
        """Per durable tier: health, backlog, what it holds (cached; no I/O)."""
        if self.drainer is None:
            return []
        out = []
        for rt in self.drainer.tiers:
            st = rt.stats
            out.append(pb.TierStatus(tier=rt.tier.name, location=rt.tier.location, healthy=st.healthy,
                                     reason=st.reason, backlog_bytes=st.backlog_bytes, checkpoints=st.held,
                                     bytes=st.held_bytes))
        return out

    # ---- agent-facing -------------------------------------------------------------------------------
    def verified_steps(self, job_id: str) -> list[int]:
        """Blocking: the job's VERIFIED checkpoint steps (daemon/rollback.py plans rollbacks to them)."""
        return [i.step for i in self.coordinator.list(job_id) if i.state == policy.VERIFIED]

    async def open(self) -> None:
        """Called once the agent holds its state dir (and again after its embedded Redis restarted): drop the
        copies whose bytes are gone from this node's memory tier; with `own_index`, remove the job dirs no
        record names (bytes indexed by nothing, e.g. the index file was lost)."""
        await self._maintenance(self.coordinator.renew_lease)   # alive again: our copies are planned again
        evicted = await self._maintenance(self.coordinator.reconcile_local, self.clock())
        for job, steps in evicted.items():
            log.warning("job %s: checkpoint(s) %s evicted: their bytes are gone from %s", job, steps,
                        self.coordinator.location)
        if self.own_index:
            n = await self._maintenance(self._remove_unindexed)
            if n:
                log.info("removed %d unindexed file(s) from %s", n, self.coordinator.location)

    def _remove_unindexed(self) -> int:
        """Blocking: delete the memory dir's job dirs that no record of the index names (own index only)."""
        store = self.coordinator.store
        root = getattr(store, "root", None)
        purge = getattr(store, "purge", None)
        if root is None or purge is None or not Path(root).is_dir():
            return 0
        known = set(self.coordinator.jobs())
        n = 0
        for entry in Path(root).iterdir():
            if entry.name.startswith(".") or entry.name in known or not entry.is_dir() or entry.is_symlink():
                continue
            try:
                n += purge(entry.name)
            except (OSError, ValueError) as e:   # a name that is no job id: leave it
                log.warning("cannot remove unindexed %s: %s", entry, e)
        return n

    def start(self, background: Background, maintenance_interval_s: float = 10.0) -> None:
        """The maintenance loop and, with durable tiers, the drainer: tasks of `background`."""
        background.start(self.run_maintenance(interval_s=maintenance_interval_s), name="checkpoint-maintenance")
        background.start(self.run_leases(), name="checkpoint-node-lease")
        if self.coordinator.config.scrub_bytes_per_s > 0:
            background.start(self.run_scrub(), name="checkpoint-scrub")
        if self.drainer is not None and self.drainer.tiers:
            background.start(self.drainer.run(), name="checkpoint-drainer")
            log.info("checkpoint tiers: %s", ", ".join(f"{rt.tier.name}={rt.tier.location}"
                                                         for rt in self.drainer.tiers))

    async def job_event(self, job_id: str, step: int | None, kind: str, now: float, reason: str = "") -> None:
        """Feed a replica vote / SDC / NaN / fatal-hardware / rollback event (see module docstring)."""
        changed = await self.pool.run(self.coordinator.on_job_event, job_id, step, kind, now, reason)
        if kind == "rollback":   # in the background: the feed never waits on the tiers
            self._spawn(self._drop_left_history(job_id))
        if changed:   # the tier copies say VERIFIED (or no longer) now, not a maintenance round later
            self._spawn(self._refresh_tiers(job_id, changed))

    def cut_history(self, job_id: str, step: int, now: float) -> None:
        """The job went back to `step` (seen at `now` in a rank's step report): its records after `step` begun
        before then, and their tier copies, go now, in the background (`Coordinator.cut_history`), not when the
        `rollback` event gets through the feed: the ranks may save the same steps again before that."""
        self._spawn(self._cut_history(job_id, step, now))

    async def _cut_history(self, job_id: str, step: int, now: float) -> None:
        try:
            await self.pool.run(self.coordinator.cut_history, job_id, step, now)
        except Exception as e:  # noqa: BLE001 - the rollback event cuts it again
            log.warning("cutting the history of job %s at step %d failed: %s", job_id, step, e)
            return
        await self._drop_left_history(job_id)

    async def _refresh_tiers(self, job_id: str, steps: list[int]) -> None:
        if self.drainer is not None:
            try:
                await self._maintenance(self.drainer.refresh_states, job_id, steps)
            except Exception as e:  # noqa: BLE001 - the drainer's maintenance refreshes them again
                log.warning("refreshing the tier copies of job %s failed: %s", job_id, e)

    async def _drop_left_history(self, job_id: str) -> None:
        """The job went back: this node's tier copies of the history it left go now (not at the next round)."""
        if self.drainer is not None:
            try:
                await self._maintenance(self.drainer.drop_left_history, job_id)
            except Exception as e:  # noqa: BLE001 - the drainer's maintenance finds them again
                log.warning("dropping the tier copies job %s left failed: %s", job_id, e)

    def pools(self) -> tuple[WorkPool, ...]:
        """Every pool of this service's blocking work."""
        return self.pool, self.peer_store.pool, self.maintenance_pool, self.replication_pool, self.lease_pool

    def local_pools(self) -> tuple[WorkPool, ...]:
        """The pools whose work is this node's own (Redis, the memory dir): wedged, the agent's health says
        NOT_SERVING. Replication waits on peers: a hung peer is not this agent's failure (logged, bounded)."""
        return self.pool, self.peer_store.pool, self.maintenance_pool, self.lease_pool

    async def _maintenance(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the maintenance pool, bounded by `maintenance_timeout_s` (a call that overruns goes
        on in its thread: its worker stays busy, and the pool says wedged once none finishes)."""
        return await asyncio.wait_for(self.maintenance_pool.run(fn, *args), self.maintenance_timeout_s)

    async def maintain_once(self) -> dict[str, list[int]]:
        if self.maintenance_pool.full():
            log.warning("checkpoint maintenance skipped: %s (an earlier round still runs)",
                        self.maintenance_pool.describe())
            return {}
        hold = self.drainer.hold if self.drainer is not None else None
        out = await self._maintenance(self.coordinator.maintain, self.clock(), hold)
        if self.drainer is not None:
            try:
                await self._maintenance(self.drainer.maintain, self.clock())
            except asyncio.TimeoutError:
                log.warning("tier maintenance took over %.0fs; it goes on in its thread", self.maintenance_timeout_s)
        await self.refresh_summaries()
        if self.metrics is not None:
            try:
                self.metrics.update(self)
            except Exception:  # noqa: BLE001 - metrics never break maintenance
                log.exception("updating checkpoint metrics failed")
        return out

    async def refresh_summaries(self) -> list[agent_pb2.CheckpointSummary]:
        """Recompute the per-job summaries (Redis reads, off the loop); `summaries()` returns them."""
        infos = await self._maintenance(self._list_all)
        used = getattr(self.coordinator.store, "used_bytes", None)
        if used is not None:
            self._memory_bytes = await self._maintenance(used)
        self._summaries = summarize(infos)
        self._summary_at = self.clock()
        return self._summaries

    def memory_bytes(self) -> int:
        """Bytes in this node's memory tier as of the last maintenance round."""
        return self._memory_bytes

    def summaries(self) -> list[agent_pb2.CheckpointSummary]:
        """Per-job summaries as of the last maintenance round (no I/O: safe in GetStatus)."""
        return list(self._summaries)

    def _list_all(self) -> list[CheckpointInfo]:
        out: list[CheckpointInfo] = []
        for job in self.coordinator.jobs():
            try:
                out.extend(self.coordinator.list(job))
            except InvalidInputError:
                log.warning("ignoring a malformed job id in Redis: %r", job)
        return out

    async def run_maintenance(self, interval_s: float = 10.0) -> None:
        """Retention and GC forever; a failed or timed-out round is logged and the loop goes on."""
        while True:
            try:
                await self.maintain_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("checkpoint maintenance round failed")
            await asyncio.sleep(interval_s)

    async def run_scrub(self, interval_s: float = 0.1) -> None:
        """The scrub (Coordinator.scrub) forever, at `[checkpoints] scrub_bytes_per_s` on average: every
        `interval_s`, that rate's share of bytes of the source-checksummed shards committed here is checked
        against their checksums, in the maintenance pool (another process than the training ranks: no GIL
        shared with them; one core at most, for the time the bytes take)."""
        rate = self.coordinator.config.scrub_bytes_per_s
        while True:
            await asyncio.sleep(interval_s)
            if not self.coordinator.scrub_pending() or self.maintenance_pool.full():
                continue
            try:
                await self._maintenance(self.coordinator.scrub, self.clock(), max(1, int(rate * interval_s)))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next round goes on; an unchecked shard stays unverified
                log.exception("checkpoint scrub round failed")

    async def run_leases(self) -> None:
        """Renew this node's lease every third of `node_lease_s` (checkpoint/node_leases.py), forever; a
        failed renewal is logged (three in a row and other nodes plan without our copies)."""
        every = self.coordinator.config.node_lease_s / 3
        while True:
            await asyncio.sleep(every)
            try:
                if self.lease_pool.full():
                    log.warning("renewing this node's lease skipped: %s", self.lease_pool.describe())
                    continue
                await asyncio.wait_for(self.lease_pool.run(self.coordinator.renew_lease), every)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis down: the supervisor or a failover brings it back
                log.warning("renewing this node's lease failed: %s", e)

    def stats(self) -> dict[str, int]:
        out = dict(self.coordinator.stats)
        if self.peer_store is not None:
            out.update(self.peer_store.stats)
        return out

    async def close(self, remove_memory: bool = False, timeout_s: float = 5.0) -> None:
        """Stop background work; remove this node's memory dir only when `remove_memory` (never by default:
        the checkpoints stay restorable by the next agent on the same state dir). Waits at most `timeout_s`
        for its tasks (`cancel_tasks`); the pools never wait for a call in progress."""
        await cancel_tasks(self._background, timeout_s)
        try:   # other nodes' restore plans leave our copies out until an agent here renews the lease
            await asyncio.wait_for(self.lease_pool.run(self.coordinator.say_goodbye), 2.0)
        except Exception as e:  # noqa: BLE001 - best effort: the lease runs out by itself
            log.info("saying goodbye in the coordination Redis failed: %s", e)
        if self.drainer is not None:
            self.drainer.close()
        if remove_memory:
            remove = getattr(self.coordinator.store, "remove_all", None)
            if remove is not None:
                try:
                    n = await self._maintenance(remove)
                    log.info("removed the checkpoint memory dir %s (%d files)", self.coordinator.location, n)
                except asyncio.TimeoutError:
                    log.warning("removing the checkpoint memory dir %s took over %.0fs (%s); left to the next "
                                "agent's start", self.coordinator.location, self.maintenance_timeout_s,
                                self.maintenance_pool.describe())
        for p in self.pools():
            p.shutdown()

    # ---- helpers ------------------------------------------------------------------------------------
    async def _replicate(self, job: str, step: int, rank: int) -> None:
        assert self.replicator is not None
        try:
            await asyncio.wait_for(self.replication_pool.run(self.replicator.replicate, job, step, rank),
                                   self.replicate_timeout_s)
        except asyncio.TimeoutError:
            log.warning("peer replication of job %s step %d rank %d took over %.0fs; abandoned here (its "
                        "thread finishes or fails on its own)", job, step, rank, self.replicate_timeout_s)
        except Exception as e:  # noqa: BLE001
            log.warning("peer replication of job %s step %d rank %d failed: %s", job, step, rank, e)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _job(self, job_id: str, context: grpc.aio.ServicerContext) -> str:
        try:
            return validate_job_id(job_id)
        except InvalidInputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise

    async def _shard_args(self, request: Any, context: grpc.aio.ServicerContext) -> tuple[str, int, int, int]:
        try:
            job = validate_job_id(request.job_id)
            step = validate_step(request.step)
            rank, world = validate_rank(request.rank, request.world_size)
            limit = self.coordinator.config.max_world_size
            if world > limit:
                raise InvalidInputError(f"world_size {world} is over this agent's limit of {limit} "
                                        "([checkpoints] max_world_size)")
        except InvalidInputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise
        return job, step, rank, world

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await self.pool.run(fn, *args)
        except Exception as e:  # noqa: BLE001
            code, msg = _status_for(e, fn)
        await context.abort(code, msg)


def _status_for(e: Exception, fn: Any) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a checkpoint RPC answers for the error its work `fn` raised."""
    if isinstance(e, InvalidInputError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, UnknownCheckpointError):
        return grpc.StatusCode.NOT_FOUND, str(e)
    if isinstance(e, StoreUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, f"coordination store: {e}"
    if isinstance(e, CommitError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    if isinstance(e, CorruptCheckpointError):
        return grpc.StatusCode.DATA_LOSS, str(e)
    if isinstance(e, redis.RedisError):
        return grpc.StatusCode.UNAVAILABLE, f"coordination Redis unavailable: {e}"
    log.error("checkpoint RPC %s failed", getattr(fn, "__name__", fn), exc_info=e)
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


def register(server: grpc.aio.Server, service: CheckpointService) -> None:
    """Add `Checkpoints` and `PeerStore` (other nodes' agents reading and writing this node's memory tier
    for peer replicas, daemon/peer_store_service.py) to `server`; `SERVICE_NAMES` lists both for reflection."""
    pb_grpc.add_CheckpointsServicer_to_server(service, server)
    peer_store_service.register(server, service.peer_store)


SERVICE_NAMES = [pb.DESCRIPTOR.services_by_name["Checkpoints"].full_name,
                 peer_pb2.DESCRIPTOR.services_by_name["PeerStore"].full_name]


def build_checkpoint_service(redis_url: str, state_dir: str | os.PathLike[str], publish: Publish | None = None, *,
                             node: str | None = None, config: CoordinatorConfig | None = None,
                             memory_dir: str | os.PathLike[str] | None = None,
                             replicator_factory: Callable[[Coordinator], Replicator] | None = None,
                             replicate_timeout_s: float = 120.0,
                             drainer_factory: Callable[[Coordinator], Drainer | None] | None = None,
                             metrics: CheckpointMetrics | None = None,
                             own_index: bool = False, gid: int = -1, workers: int = 8,
                             wedged_after_s: float = 60.0,
                             redis_options: RedisOptions | None = None) -> CheckpointService:
    """The service with production defaults: the memory tier in /dev/shm (owned by this agent, survives
    training processes and the agent), the coordination Redis at `redis_url` (connected on first use).
    `own_index`: the Redis is the agent's embedded one: `open()` removes job dirs it does not index (see
    the module docstring). `replicator_factory`
    (daemon/peers_wiring.py) builds the peer Replicator from the coordinator; each shard's copy to the peers
    is bounded by `replicate_timeout_s`. `drainer_factory` (daemon/drain_wiring.py) builds the durable tiers'
    Drainer from the coordinator (None: no tiers). The memory dir is created and checked by
    `secure_memory_dir` (never a link; `gid`: the group of ranks running as other users, -1 none).
    `redis_options`: timeouts, how long to ride out a failover, and how many replicas must acknowledge a
    begin/commit (checkpoint/commit_fence.py); a `redis+sentinel://` URL fences commits with Sentinel's epoch."""
    base = config.memory_base if config is not None else ""
    root = secure_memory_dir(Path(memory_dir) if memory_dir is not None else default_shm_root(state_dir, base), gid)
    kind = disk_filesystem(root)
    if kind:
        log.warning("the checkpoint memory dir %s is on %s, not tmpfs: the memory tier writes to that disk, and "
                    "the GPU cannot pin the ranks' staging slots there (their copies run synchronously); set "
                    "[checkpoints] memory_base to a tmpfs (e.g. /dev/shm/sdcwatch)", root, kind)
    store = ShmStore(root)
    opts = redis_options or RedisOptions(timeout_s=10.0)
    client = connect(redis_url, opts)
    fence = CommitFence(epoch_source(redis_url, opts), replicas=opts.replicas_to_ack,
                        ack_timeout_ms=opts.ack_timeout_ms, all_online=opts.ack_all_online,
                        era_source=era_source(redis_url, opts))
    coordinator = Coordinator(client, store, node=node or socket.gethostname(), location=str(root),
                              config=config, publish=publish, fence=fence)
    return CheckpointService(coordinator, replicator=replicator_factory(coordinator) if replicator_factory else None,
                             drainer=drainer_factory(coordinator) if drainer_factory else None, metrics=metrics,
                             own_index=own_index, replicate_timeout_s=replicate_timeout_s,
                             pool=WorkPool("checkpoints", workers=workers, wedged_after_s=wedged_after_s),
                             peer_pool=WorkPool("peer-store", workers=workers, wedged_after_s=wedged_after_s))


def tier_info(tc: Any, copies: dict[int, list[Copy]]) -> CheckpointInfo:
    """A CheckpointInfo for a checkpoint only the durable tiers hold (a `tier_manifest.TierCheckpoint`)."""
    return CheckpointInfo(tc.job_id, tc.step, tc.state, tc.world_size, len(tc.ranks), tc.nbytes, 0.0,
                          tc.created, 0.0, "held by the durable tiers only",
                          tuple(c for r in sorted(copies) for c in copies[r]), vouched_by=tc.vouched_by)


def summarize(infos: list[CheckpointInfo]) -> list[agent_pb2.CheckpointSummary]:
    """One `CheckpointSummary` per job from its live checkpoint records (oldest first)."""
    by_job: dict[str, list[CheckpointInfo]] = {}
    for i in infos:
        by_job.setdefault(i.job_id, []).append(i)
    out = []
    for job, items in sorted(by_job.items()):
        items.sort(key=lambda i: i.step)
        restorable = [i for i in items if i.state in policy.RESTORABLE_STATES]
        verified = [i for i in items if i.state == policy.VERIFIED]
        out.append(agent_pb2.CheckpointSummary(
            job_id=job, count=len(items), latest_step=restorable[-1].step if restorable else -1,
            latest_verified_step=verified[-1].step if verified else -1,
            latest_verified_at=verified[-1].verified_at if verified else 0.0,
            bytes=sum(i.nbytes for i in items), latest_state=items[-1].state))
    return out


def _retrieved(fut: "asyncio.Future[Any]") -> None:
    if not fut.cancelled():
        fut.exception()


def _orphan_ended(name: str, fut: "asyncio.Future[Any]") -> None:
    """The end of a checkpoint operation whose caller left before it finished (a WatchVerifyCopies or Drain
    stream cancelled, or past its deadline): one INFO line."""
    if fut.cancelled():
        return
    error = fut.exception()
    log.info("sdcwatch: %s, whose caller left before it finished, ended %s", name,
             f"with {type(error).__name__}: {error}" if error is not None else "normally")
