"""Agent-side checkpoint coordinator over a Redis client passed in (the job's coordination Redis).

Lifecycle of one checkpoint (job J, step k, world size W):

1. `begin(J, k, rank, W)`        each rank; the first creates the PENDING record. Returns where to write
                                 (this node's memory tier directory and the shard's blob key). A begin that
                                 carries the rank's restore (`restored`) first cuts the history there, once.
2. the rank writes its shard blob into that tier (data first) ...
3. `commit_shard(J, k, rank, W, manifest_json)`   checks the blob (size, and every chunk checksum when
                                 `verify_on_commit`), then ONE Lua script records the shard and, when all
                                 W shards are in, flips the record to COMMITTED (the marker, written last).
                                 Idempotent: the same manifest again changes nothing.
   Once COMMITTED, the bytes are compared across replicas (`checkpoint.replica_bytes.compare` over every
   rank's manifest: ranks of one replica set must have saved identical tensor fingerprints); the verdict
   and which fingerprints vouched are kept on the record (`bytes_check`, `vouched_by`); a mismatch is
   journaled (checkpoint.replicas_differ) and that checkpoint is never VERIFIED.
4. `on_job_event(J, step, kind, now)`  replica votes, clean in-step checks and SDC/NaN/fatal-hardware
                                 events: COMMITTED <-> VERIFIED (see `checkpoint.policy.verified_steps`);
                                 each change is published.
5. `maintain(now)`              retention (keep newest K + newest verified, memory cap), abort stale
                                 PENDING saves and delete their partial blobs, sweep evicted blobs.

Redis keys (all of one job share the hash tag `{J}`, so the scripts work on Redis Cluster):
  sdcw:ckpt:jobs                   SET of job ids
  sdcw:ckpt:{J}:idx                ZSET step -> step, every live record (a record leaves it when tombstoned)
  sdcw:ckpt:{J}:s:<k>              HASH state, world_size, begun_at, committed_at, verified_at, reason, bytes,
                                   bytes_check (agreed | mismatch | unreplicated | imported), vouched_by;
                                   a tombstone adds dropped_at and dropped_from (COMMITTED or VERIFIED: the
                                   state it had, which the tier copies keep)
  sdcw:ckpt:{J}:s:<k>:shards       HASH rank -> shard manifest JSON
  sdcw:ckpt:{J}:s:<k>:copies       HASH "<rank>@<node>" -> location (memory tier directory on that node)
  sdcw:ckpt:{J}:votes              HASH step -> vote_agreed | vote_mismatch; bounded: past MAX_VOTES + slack
                                   fields it is pruned to the newest MAX_VOTES steps plus the steps of live
                                   records (their VERIFIED depends on them); read per record (HMGET), never whole
  sdcw:ckpt:{J}:checked            the highest step the job's checks reported clean through (an agreed vote, or
                                   clean in-step checks without replicas); lowered to the target on rollback
  sdcw:ckpt:{J}:bad                ZSET "<kind>:<step>:<time>" -> step (bad events since the last rollback);
                                   bounded to the MAX_BAD lowest steps (VERIFIED needs only the lowest)
  sdcw:ckpt:{J}:epoch              the highest writer epoch seen for the job (checkpoint/commit_fence.py)
  sdcw:ckpt:{J}:cuts               HASH step -> time: the job went back to step at that time, so every copy of a
                                   later step made before it (on any tier, any node) is history it left
                                   (`cuts`; the drainers delete those tier copies); the newest MAX_CUTS_KEPT
  sdcw:ckpt:{J}:restores           HASH step -> time: the newest restore of step a rank's begin carried
                                   (`cut_at_restore`: that restore's cut is made); the newest MAX_CUTS_KEPT
  sdcw:ckpt:nodes                  HASH node -> its agent's lease (checkpoint/node_leases.py): restore plans leave
                                   out the copies of nodes whose agents are gone

Begin and commit go through `CommitFence`: the scripts refuse a writer from an older primary era, and with
replicas configured a call counts only once Redis's WAIT says the replicas have it (Sentinel HA,
docs/sentinel.md). A commit is idempotent per rank: the rank whose shard completed the record is told
`committed` again when it retries (its first reply may have been lost in a failover); the event is
published once per record by this coordinator.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from checkpoint import policy, replica_bytes
from checkpoint.blobstore import BlobStore
from checkpoint.chunks import ALGORITHM, verify
from checkpoint.commit_fence import CommitFence, fenced
from checkpoint.coordinator_config import CoordinatorConfig
from checkpoint.errors import CommitError, InvalidInputError, NotInMemoryError, UnknownCheckpointError
from checkpoint.manifest import ShardManifest
from checkpoint.names import validate_job_id, validate_rank, validate_step
from checkpoint.node_leases import Lease, dead_nodes, live_copies
from checkpoint.tier_policy import TIER_ORDER
from checkpoint.records import (LATEST, LATEST_VERIFIED, BeginResult, CheckpointInfo, CommitResult, Copy,
                                Restored, RestorePlan, RestoreReportMsg, SaveReport, ShardPlan)
from sdcwatch import event_kinds as ek
from sdcwatch.event_kinds import EventKind, Publish

if TYPE_CHECKING:
    from checkpoint.shard_layout import ShardLayout

log = logging.getLogger(__name__)

RetentionHold = Callable[[str], set[int]]   # job id -> steps to keep a little longer

_BEGIN = """
local st = redis.call('HGET', KEYS[1], 'state')
if st and st ~= 'ABORTED' and st ~= 'EVICTED' then
  if tonumber(redis.call('HGET', KEYS[1], 'world_size')) ~= tonumber(ARGV[2]) then
    return {'ERR_WORLD', redis.call('HGET', KEYS[1], 'world_size')}
  end
  return {st, ''}
end
redis.call('DEL', KEYS[1], KEYS[3], KEYS[4])
redis.call('HSET', KEYS[1], 'state', 'PENDING', 'step', ARGV[1], 'world_size', ARGV[2], 'begun_at', ARGV[3],
           'bytes', 0)
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
return {'PENDING', ''}
"""

_COMMIT_SHARD = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {'ERR_UNKNOWN', 0, 0} end
if st == 'ABORTED' or st == 'EVICTED' then return {st, 0, 0} end
local ws = tonumber(redis.call('HGET', KEYS[1], 'world_size'))
if ws ~= tonumber(ARGV[3]) then return {'ERR_WORLD', 0, ws} end
local prev = redis.call('HGET', KEYS[2], ARGV[1])
if prev and prev ~= ARGV[2] then
  if st ~= 'PENDING' then return {'ERR_CONFLICT', 0, 0} end
end
if not prev then redis.call('HINCRBY', KEYS[1], 'bytes', ARGV[5]) end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[6], ARGV[7])
local n = redis.call('HLEN', KEYS[2])
if st == 'PENDING' and n == ws then
  redis.call('HSET', KEYS[1], 'state', 'COMMITTED', 'committed_at', ARGV[4], 'completed_by', ARGV[1])
  return {'COMMITTED', 1, n}
end
if prev == ARGV[2] and redis.call('HGET', KEYS[1], 'completed_by') == ARGV[1] then return {st, 1, n} end
return {st, 0, n}
"""

# Set state only if the record is in the expected state. ARGV: new state, field, value, expected state.
# Raise a number to ARGV[1] if it is lower (or absent).
_RAISE = """
local cur = tonumber(redis.call('GET', KEYS[1]))
if cur == nil or cur < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return {1}
"""

# Set fields (ARGV: field, value, ...) on a record that is still COMMITTED or VERIFIED and has no bytes_check
# yet (two evaluations racing record and announce one verdict).
_SET_IF_LIVE = """
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'COMMITTED' and st ~= 'VERIFIED' then return {0} end
if redis.call('HEXISTS', KEYS[1], 'bytes_check') == 1 then return {0} end
for i = 1, #ARGV - 1, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return {1}
"""

_TRANSITION = """
if redis.call('HGET', KEYS[1], 'state') ~= ARGV[4] then return {0} end
redis.call('HSET', KEYS[1], 'state', ARGV[1], ARGV[2], ARGV[3])
return {1}
"""


PARSED_KEPT = 64   # parsed manifests the coordinator remembers (by their JSON text), per coordinator


def blob_key(job_id: str, step: int, rank: int) -> str:
    return f"{job_id}/{step:012d}/rank-{rank:05d}.bin"


MAX_VOTES = 512        # vote fields kept per job (plus those of live records)
MAX_CUTS_KEPT = 64     # cuts kept per job (`cuts`)
VOTE_PRUNE_SLACK = 64  # pruned when this many more have piled up: one HKEYS per 64 votes, not per vote
SCRUB_FIELD = "scrub:"      # record field scrub:<rank>: pending | ok | bad: <why> (source-checksummed shards)
SCRUB_PENDING = "pending"
SCRUB_OK = "ok"
SCRUB_QUEUE = 256           # shards queued for the scrub at most (newest first; maintenance re-queues live ones)
MAX_BAD = 1024         # bad events kept per job (the lowest steps: policy.verified_steps needs only the lowest)


class Coordinator:
    """See the module docstring. `store` is this node's memory tier, `location` its directory (what a
    rank on this node is told to write into); `publish` journals events (the agent's callback); `fence`
    the epoch and replication rules of begin and commit (default: epoch 0, no WAIT: a single Redis)."""

    def __init__(self, redis: Any, store: BlobStore, *, node: str, location: str,
                 config: CoordinatorConfig | None = None, publish: Publish | None = None,
                 fence: CommitFence | None = None) -> None:
        self.redis = redis
        self.store = store
        self.node = node
        self.location = location
        self.config = config or CoordinatorConfig()
        self.publish = publish
        p = self.config.key_prefix
        self._p = p
        self.fence = fence or CommitFence()
        self._begin = redis.register_script(fenced(_BEGIN))
        self._commit = redis.register_script(fenced(_COMMIT_SHARD))
        self._announced: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._transition = redis.register_script(fenced(_TRANSITION))
        self._raise = redis.register_script(fenced(_RAISE))
        self._set_live = redis.register_script(fenced(_SET_IF_LIVE))
        self.stats: dict[str, int] = {"shards_committed": 0, "checkpoints_committed": 0, "bytes_committed": 0,
                                      "evictions": 0, "aborted": 0, "checksum_failures": 0,
                                      "verified": 0, "revoked": 0, "replicas_differ": 0, "slots_swept": 0,
                                      "saves_skipped": 0, "scrubbed_bytes": 0, "scrub_failures": 0,
                                      "restores": 0, "restores_failed": 0, "restore_fallbacks": 0}
        self.restore_sources: collections.Counter[str] = collections.Counter()   # tier -> restores served
        # (name, seconds) samples for histograms, drained by daemon.checkpoint_metrics; bounded.
        self.observations: collections.deque[tuple[str, float]] = collections.deque(maxlen=4096)
        # The scrub (`scrub`): shards committed here with source checksums, whose bytes in this node's memory
        # tier are still to be checked: (job, step, rank) in commit order, and the one being checked now.
        self._scrub_queue: collections.OrderedDict[tuple[str, int, int], None] = collections.OrderedDict()
        self._scrub_at: tuple[tuple[str, int, int], ShardManifest, int] | None = None
        self._scrub_buf = bytearray()
        self._scrub_lock = threading.Lock()   # commits (the RPC pool) queue, the scrub (maintenance) takes
        # manifests parsed on commit, by their exact JSON: the VERIFIED evaluation right after (the replica
        # comparison) reads the same text back from Redis and need not parse and validate it again
        self._parsed: collections.OrderedDict[str, ShardManifest] = collections.OrderedDict()
        self._parsed_lock = threading.Lock()

    # ---- keys ---------------------------------------------------------------------------------------
    def _jk(self, job: str, suffix: str) -> str:
        return f"{self._p}{{{job}}}:{suffix}"

    def _meta(self, job: str, step: int) -> str:
        return self._jk(job, f"s:{step}")

    def _keys(self, job: str, step: int) -> list[str]:
        meta = self._meta(job, step)
        return [meta, meta + ":shards", meta + ":copies"]

    # ---- rank-facing --------------------------------------------------------------------------------
    def begin(self, job_id: str, step: int, rank: int, world_size: int, now: float | None = None, *,
              restored: Restored | None = None) -> BeginResult:
        """`restored`: the rank's last restore into its training state (None: none since it started): the
        history is cut there first, if that restore's cut was not made yet (`cut_at_restore`), so a save right
        after a resume, before any step report showed the job went back, begins afresh."""
        validate_job_id(job_id)
        validate_step(step)
        validate_rank(rank, world_size)
        now = time.time() if now is None else now
        cut = self.cut_at_restore(job_id, restored, now) if restored is not None else False
        meta, shards, copies = self._keys(job_id, step)
        state, extra = self.fence.run(self.redis, self._begin, [meta, self._jk(job_id, "idx"), shards, copies],
                                      [step, world_size, repr(now)], self._jk(job_id, "epoch"))[:2]
        state = _s(state)
        if state == "ERR_WORLD":
            raise CommitError(f"job {job_id} step {step} was begun with world size {_s(extra)}, not {world_size}")
        self.redis.sadd(self._p + "jobs", job_id)
        return BeginResult(state, self.node, self.location, blob_key(job_id, step, rank), cut)

    def commit_shard(self, job_id: str, step: int, rank: int, world_size: int, manifest_json: str,
                     now: float | None = None, report: SaveReport | None = None) -> CommitResult:
        validate_job_id(job_id)
        validate_step(step)
        validate_rank(rank, world_size)
        now = time.time() if now is None else now
        m = self._manifest(manifest_json)
        if (m.job_id, m.step, m.rank, m.world_size) != (job_id, step, rank, world_size):
            raise InvalidInputError(
                f"manifest is for job {m.job_id} step {m.step} rank {m.rank}/{m.world_size}, request says "
                f"job {job_id} step {step} rank {rank}/{world_size}")
        if m.blob != blob_key(job_id, step, rank):
            raise InvalidInputError(f"manifest blob {m.blob!r} is not {blob_key(job_id, step, rank)!r}")
        self._check_blob(m)
        meta, shards, copies = self._keys(job_id, step)
        scrub = m.algorithm != ALGORITHM   # checksummed at the source: the bytes here are checked by the scrub
        if scrub:   # before the record can flip to COMMITTED: VERIFIED waits for this field to say "ok"
            self.redis.hsetnx(meta, SCRUB_FIELD + str(rank), SCRUB_PENDING)
        state, committed_now, n = self.fence.run(
            self.redis, self._commit, [meta, shards, copies],
            [rank, manifest_json, world_size, repr(now), m.nbytes, f"{rank}@{self.node}", self.location],
            self._jk(job_id, "epoch"))
        state = _s(state)
        if state == "ERR_UNKNOWN":
            raise NotInMemoryError(
                f"job {job_id} step {step} has no PENDING record (never begun, or Redis lost it): call begin first")
        if state == "ERR_WORLD":
            raise CommitError(f"job {job_id} step {step} has world size {n}, shard says {world_size}")
        if state == "ERR_CONFLICT":
            raise CommitError(f"job {job_id} step {step} rank {rank} is already committed with a different manifest")
        if state in (policy.ABORTED, policy.EVICTED):
            raise CommitError(f"job {job_id} step {step} was {state.lower()}; the shard is not kept")
        self.stats["shards_committed"] += 1
        if scrub:
            with self._scrub_lock:
                self._scrub_queue[(job_id, step, rank)] = None
                while len(self._scrub_queue) > SCRUB_QUEUE:   # the oldest first: retention drops them first
                    self._scrub_queue.popitem(last=False)
        if report is not None:
            self.stats["saves_skipped"] += max(0, int(report.skipped_saves))
            for name, v in (("save_blocking", report.blocking_s), ("save_safe", report.safe_s),
                            ("save_stall", report.stall_s)):
                if v > 0:
                    self.observations.append((name, float(v)))
        if committed_now and self._first_announcement(job_id, step):
            self.stats["checkpoints_committed"] += 1
            info = self.info(job_id, step)
            self.stats["bytes_committed"] += info.nbytes
            if info.begun_at:
                self.observations.append(("save_commit", max(0.0, now - info.begun_at)))
            self.emit(ek.CHECKPOINT_COMMITTED, job_id,
                      f"checkpoint step {step} committed ({world_size} shards, {info.nbytes} bytes)",
                      {"step": step, "bytes": info.nbytes, "world_size": world_size})
            self.evaluate(job_id, now)
            self.maintain_job(job_id, now)
        return CommitResult(state if not committed_now else self.info(job_id, step).state,
                            bool(committed_now), int(n))

    def commit_words(self, job_id: str, step: int, rank: int, world_size: int, layout: "ShardLayout",
                     words: Any, created: float, now: float | None = None, *, blob: str | None = None,
                     report: SaveReport | None = None) -> CommitResult:
        """`commit_shard` of a source-checksummed shard given as its layout and its pieces' words
        (checkpoint.shard_layout): the manifest rendered here, for this step's blob (`blob`, when given,
        must be it), then committed as any is."""
        validate_job_id(job_id)
        validate_step(step)
        validate_rank(rank, world_size)
        layout.check_for(job_id, rank, world_size)
        text = layout.render(step, blob or blob_key(job_id, step, rank), words, created)
        return self.commit_shard(job_id, step, rank, world_size, text, now, report)

    def _manifest(self, text: str) -> ShardManifest:
        """`ShardManifest.from_json(text)` (validated), remembered for the last PARSED_KEPT texts: a commit's
        manifest is read back by the evaluation that follows it (parsing 600 tensors' JSON is milliseconds
        of the agent's commit path, per save)."""
        with self._parsed_lock:
            m = self._parsed.get(text)
            if m is not None:
                self._parsed.move_to_end(text)
                return m
        m = ShardManifest.from_json(text)
        with self._parsed_lock:
            self._parsed[text] = m
            while len(self._parsed) > PARSED_KEPT:
                self._parsed.popitem(last=False)
        return m

    def _first_announcement(self, job_id: str, step: int) -> bool:
        """True once per (job, step) on this coordinator: a rank retrying a commit whose reply was lost is
        told `committed` again, but the record is counted and published once (bounded memory)."""
        if (job_id, step) in self._announced:
            return False
        self._announced[(job_id, step)] = None
        while len(self._announced) > 4096:
            self._announced.popitem(last=False)
        return True

    def _check_blob(self, m: ShardManifest) -> None:
        try:
            size = self.store.size(m.blob)
        except KeyError:
            raise CommitError(f"shard blob {m.blob!r} is not in this node's memory tier ({self.location})") from None
        if size != m.nbytes:
            raise CommitError(f"shard blob {m.blob!r} has {size} bytes, manifest says {m.nbytes}")
        if not self.config.verify_on_commit or m.algorithm != ALGORITHM:   # source checksums: the scrub's
            return
        buf = bytearray(max((c.length for c in m.chunks), default=0))
        view = memoryview(buf)
        for c in m.chunks:
            n = self.store.readinto(m.blob, c.offset, view[: c.length])
            if not verify(view[:n], c):
                self.stats["checksum_failures"] += 1
                raise CommitError(f"shard blob {m.blob!r} chunk at {c.offset} fails its checksum on commit")

    def report_restore(self, r: RestoreReportMsg) -> None:
        """Record how a rank's restore went (metrics; a failed or degraded restore is journaled)."""
        validate_job_id(r.job_id)
        validate_step(r.step)
        self.stats["restores"] += 1
        self.stats["restore_fallbacks"] += max(0, int(r.fallbacks))
        self.stats["checksum_failures"] += max(0, int(r.checksum_failures))
        if r.seconds > 0:
            self.observations.append(("restore", float(r.seconds)))
        tier = r.source.split("@", 1)[0] if r.ok and r.source else ""
        if tier:   # a metric label: one of the known tiers, never a client's free string
            self.restore_sources[tier if tier in TIER_ORDER else "other"] += 1
            if tier not in ("memory",):
                self.emit(ek.CHECKPOINT_RESTORED_FROM_TIER, r.job_id,
                          f"rank {r.rank} restored step {r.step} from {r.source} in {r.seconds:.2f}s",
                          {"step": r.step, "rank": r.rank, "source": r.source, "seconds": r.seconds})
        if not r.ok:
            self.stats["restores_failed"] += 1
            self.emit(ek.CHECKPOINT_RESTORE_FAILED, r.job_id,
                      f"restore of step {r.step} failed on rank {r.rank}: {r.error}",
                      {"step": r.step, "rank": r.rank, "error": r.error})
        elif r.checksum_failures:
            self.emit(ek.CHECKPOINT_RESTORE_FALLBACK, r.job_id,
                      f"restore of step {r.step} on rank {r.rank}: {r.checksum_failures} bad chunk(s), "
                      f"{r.fallbacks} read from another copy", {"step": r.step, "rank": r.rank,
                                                                "checksum_failures": r.checksum_failures,
                                                                "fallbacks": r.fallbacks})

    def _keep_time(self, key: str, step: int, at: float) -> None:
        """HSET step -> at (the later of the two, if one is there) in a hash kept to MAX_CUTS_KEPT steps."""
        old = self.redis.hget(key, str(step))
        self.redis.hset(key, str(step), repr(at if old is None else max(at, float(_s(old)))))
        if self.redis.hlen(key) > MAX_CUTS_KEPT:
            fields = sorted(self.redis.hgetall(key).items(), key=lambda kv: float(_s(kv[1])))
            self.redis.hdel(key, *(k for k, _ in fields[:-MAX_CUTS_KEPT]))

    def cut_history(self, job_id: str, step: int, before: float) -> None:
        """The job went back to `step` (the agent saw it at `before`, in a rank's step report): drop its records
        after `step` begun before then (the history it left), and note the cut for the tiers (`cuts`: the
        drainers delete the tier copies it left). The agent calls this at once, so a redone save of a step
        begins afresh instead of finding the left record; the `rollback` job event does it again, later, with
        the votes and bad events (through the feed, which keeps their order).

        A restore of `step` a rank's begin already told (`cut_at_restore`) is when the job went back, exactly:
        the cut is made at that time when it is earlier than `before`. The ranks may have saved again between
        their restore and the step report that shows it (a resume that saves before it reports), and those
        saves are the job's new history, not the history it left."""
        validate_job_id(job_id)
        validate_step(step)
        known = self.redis.hget(self._jk(job_id, "restores"), str(step))
        if known is not None:
            before = min(before, float(_s(known)))
        self._cut(job_id, step, before)

    def cut_at_restore(self, job_id: str, restored: Restored, now: float) -> bool:
        """A rank's begin says it restored `restored.step` at `restored.at` (its last restore into training
        state): cut the history there (`cut_history`'s drop, at the restore's time: the saves begun since are
        the job's new history) unless that restore's cut was made already (`restores`: the newest restore of
        the step cut so far; a retried begin, or another rank of the same restore, cuts nothing new). Returns
        whether it cut. A restore time after `now` is taken as `now`. A reader never begins a save, so its
        restores never cut."""
        validate_job_id(job_id)
        validate_step(restored.step)
        at = float(restored.at)
        if not math.isfinite(at) or at <= 0:
            raise InvalidInputError(f"restored_at must be a time (seconds since the epoch), got {restored.at}")
        at = min(at, now)
        key = self._jk(job_id, "restores")
        known = self.redis.hget(key, str(restored.step))
        if known is not None and float(_s(known)) >= at:
            return False
        self._cut(job_id, restored.step, at)
        self._keep_time(key, restored.step, at)   # after the cut: a cut that failed half way is made again
        return True

    def _cut(self, job_id: str, step: int, before: float) -> None:
        for info in self.list(job_id):
            if info.step > step and info.begun_at < before:
                self._drop(job_id, info.step, policy.EVICTED, f"rolled back to step {step}", before)
        self._keep_time(self._jk(job_id, "cuts"), step, before)

    def cuts(self, job_id: str) -> dict[int, float]:
        """Step -> time: the job went back to step then; a copy of a later step made before it is left history."""
        return {int(_s(k)): float(_s(v)) for k, v in self.redis.hgetall(self._jk(job_id, "cuts")).items()}

    # ---- queries ------------------------------------------------------------------------------------
    def knows_job(self, job_id: str) -> bool:
        """Whether this coordinator has (or had, until retention) a checkpoint record of `job_id`."""
        return bool(self.redis.sismember(self._p + "jobs", job_id))

    def jobs(self) -> list[str]:
        return sorted(_s(j) for j in self.redis.smembers(self._p + "jobs"))

    def _steps(self, job_id: str) -> list[int]:
        return [int(float(_s(x))) for x in self.redis.zrange(self._jk(job_id, "idx"), 0, -1)]

    def info(self, job_id: str, step: int) -> CheckpointInfo:
        meta, shards, copies = self._keys(job_id, step)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(meta)
        pipe.hlen(shards)
        pipe.hgetall(copies)
        h, n, cp = pipe.execute()
        if not h:
            raise UnknownCheckpointError(f"job {job_id} has no checkpoint at step {step}")
        h = {_s(k): _s(v) for k, v in h.items()}
        cps = []
        for k, loc in cp.items():
            r, _, node = _s(k).partition("@")
            cps.append(Copy(int(r), node, _s(loc)))
        cps.sort(key=lambda c: (c.rank, c.node != self.node, c.node))
        return CheckpointInfo(job_id, step, h.get("state", "?"), int(h.get("world_size", 0)), int(n),
                              int(h.get("bytes", 0)), float(h.get("begun_at", 0)), float(h.get("committed_at", 0)),
                              float(h.get("verified_at", 0)), h.get("reason", ""), tuple(cps),
                              h.get("vouched_by", ""), h.get("dropped_from", ""))

    def list(self, job_id: str) -> list[CheckpointInfo]:
        validate_job_id(job_id)
        out = []
        gone = []
        for step in self._steps(job_id):
            try:
                info = self.info(job_id, step)
            except UnknownCheckpointError:   # expired: indexed before tombstones left the index
                gone.append(step)
                continue
            if info.state in policy.LIVE_STATES:
                out.append(info)
            else:                            # a tombstone indexed by an older agent
                gone.append(step)
        if gone:
            self.redis.zrem(self._jk(job_id, "idx"), *gone)
        return out

    def latest(self, job_id: str) -> CheckpointInfo | None:
        c = [i for i in self.list(job_id) if i.state in policy.RESTORABLE_STATES]
        return c[-1] if c else None

    def latest_verified(self, job_id: str) -> CheckpointInfo | None:
        c = [i for i in self.list(job_id) if i.state == policy.VERIFIED]
        return c[-1] if c else None

    def resolve(self, job_id: str, target: int | str) -> CheckpointInfo:
        """The checkpoint `target` (a step, "latest" or "latest_verified") names, restorable, or a clear error."""
        validate_job_id(job_id)
        infos = self.list(job_id)
        if (not infos and not self.redis.exists(self._jk(job_id, "idx"))
                and not self.redis.sismember(self._p + "jobs", job_id)):
            raise NotInMemoryError(
                f"job {job_id}: not in memory: no checkpoint record (the coordination Redis has no record of this job; "
                "it may have restarted empty). Restore from a durable tier instead.")
        restorable = [i for i in infos if i.state in policy.RESTORABLE_STATES]
        have = ", ".join(f"{i.step}:{i.state}" for i in infos) or "none"
        if target == LATEST:
            if not restorable:
                raise UnknownCheckpointError(f"job {job_id}: no committed checkpoint in memory (have: {have})")
            return restorable[-1]
        if target == LATEST_VERIFIED:
            v = [i for i in restorable if i.state == policy.VERIFIED]
            if not v:
                raise UnknownCheckpointError(f"job {job_id}: no VERIFIED checkpoint in memory (have: {have})")
            return v[-1]
        if isinstance(target, str) or isinstance(target, bool) or not isinstance(target, int):
            raise InvalidInputError(f"restore target must be a step, {LATEST!r} or {LATEST_VERIFIED!r}, got {target!r}")
        validate_step(target)
        for i in infos:
            if i.step == target:
                if i.state not in policy.RESTORABLE_STATES:
                    raise UnknownCheckpointError(
                        f"job {job_id} step {target} is {i.state} ({i.shards}/{i.world_size} shards), not committed")
                return i
        raise UnknownCheckpointError(f"job {job_id} has no checkpoint at step {target} in memory (have: {have})")

    def restore_plan(self, job_id: str, target: int | str, rank: int | None = None) -> RestorePlan:
        """The checkpoint's shards and their memory copies, this node's first; the copies on nodes whose agents
        are gone (`dead_nodes`) are left out. A shard left with no copy at all: NotInMemoryError naming the
        gone nodes (the agent's service then plans from the durable tiers)."""
        info = self.resolve(job_id, target)
        if rank is not None:
            validate_rank(rank, info.world_size)
        ranks = range(info.world_size) if rank is None else [rank]
        raw = self.redis.hmget(self._keys(job_id, info.step)[1], [str(r) for r in ranks])
        dead = self.dead_nodes() if any(c.node != self.node for c in info.copies) else set()
        shards = []
        for r, text in zip(ranks, raw):
            if text is None:
                raise NotInMemoryError(f"job {job_id} step {info.step}: manifest of rank {r} is missing")
            copies = tuple(c for c in info.copies if c.rank == r)
            live = live_copies(copies, dead)
            if copies and not live:
                raise NotInMemoryError(
                    f"job {job_id} step {info.step}: every memory copy of rank {r} is on a node whose agent is "
                    f"gone ({', '.join(sorted({c.node for c in copies}))})")
            shards.append(ShardPlan(r, ShardManifest.from_json(_s(text)), live))
        return RestorePlan(info, tuple(shards))

    # ---- node leases (checkpoint/node_leases.py) ----------------------------------------------------------
    def _server_time(self) -> float:
        sec, usec = self.redis.time()
        return float(sec) + float(usec) / 1e6

    def renew_lease(self) -> None:
        """This node's agent is alive for another `node_lease_s` (the Redis server's clock)."""
        lease = Lease(self._server_time(), self.config.node_lease_s)
        self.redis.hset(self._p + "nodes", self.node, lease.to_json())

    def say_goodbye(self) -> None:
        """This node's agent stops cleanly: its copies leave other nodes' restore plans until it renews."""
        lease = Lease(self._server_time(), self.config.node_lease_s, gone=True)
        self.redis.hset(self._p + "nodes", self.node, lease.to_json())

    def dead_nodes(self) -> set[str]:
        """The nodes whose agents are known gone now (goodbye said, or the lease ran out)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self._p + "nodes")
        pipe.time()
        raw, (sec, usec) = pipe.execute()
        leases = {_s(node): Lease.from_json(text) for node, text in raw.items()}
        return dead_nodes(leases, float(sec) + float(usec) / 1e6, self.node)

    def shard_manifests(self, job_id: str, step: int) -> dict[int, ShardManifest]:
        """Every committed shard's manifest by rank: one read, as many as were committed (never `world_size`
        lookups: a declared world size costs nothing until its shards exist)."""
        raw = self.redis.hgetall(self._keys(job_id, step)[1])
        return {int(_s(r)): ShardManifest.from_json(_s(text)) for r, text in raw.items()}

    def shard_manifest(self, job_id: str, step: int, rank: int) -> ShardManifest:
        """The committed manifest of one shard, whatever the checkpoint's state (replication uses it)."""
        text = self.redis.hget(self._keys(job_id, step)[1], str(rank))
        if text is None:
            raise UnknownCheckpointError(f"job {job_id} step {step} rank {rank}: no committed shard")
        return ShardManifest.from_json(_s(text))

    def add_copy(self, job_id: str, step: int, rank: int, node: str, location: str) -> None:
        """Record that `node` holds a verified copy of the shard (peer replication calls this)."""
        meta, _, copies = self._keys(job_id, step)
        state = self.redis.hget(meta, "state")
        if state is None:
            raise UnknownCheckpointError(f"job {job_id} has no checkpoint at step {step}")
        if _s(state) not in policy.LIVE_STATES:   # dropped meanwhile: the peer sweeps its copy
            raise UnknownCheckpointError(f"job {job_id} step {step} is {_s(state)}; the copy is not recorded")
        self.redis.hset(copies, f"{rank}@{node}", location)

    # ---- verification -------------------------------------------------------------------------------
    def on_job_event(self, job_id: str, step: int | None, kind: str, now: float, reason: str = "") -> list[int]:
        """Feed a replica vote or an SDC/NaN/fatal-hardware event (kinds in `policy.EVENT_KINDS`).

        `step` None means "now": the newest step begun for the job. "rollback" (the job restored `step`; `now`
        is when the agent saw it, in a rank's step report): the records after `step` begun before `now` are
        dropped, with the bad events and votes after `step`; a record begun since is the job's new history
        (saved again after the restore: this event comes through the agent's feed, seconds late when it is
        loaded) and stays. "clear": an operator accepts
        the bad events at or before `step`. "repaired": the replicas agree again at `step` R without a restore
        (checksums.replica_recovery repaired the odd replica in place): the records saved from the first
        mismatching step M of the vote mismatches before R up to R - 1 hold weights from diverged replicas
        and are dropped, and those vote mismatches no longer block the checkpoints from R on; nor do the
        compute checks' "diverged" events at or before R (the replicas computing from different weights: the
        same incident, their updates dropped), whichever arrives first (the agent does not report a
        "diverged" step a repair already covered: daemon/jobs.py).

        Returns the steps whose record became VERIFIED or lost it (`evaluate`).
        """
        validate_job_id(job_id)
        if kind not in policy.EVENT_KINDS:
            raise InvalidInputError(f"unknown job event kind {kind!r}; expected one of {policy.EVENT_KINDS}")
        if step is None:
            steps = self._steps(job_id)
            if not steps:
                return []
            step = steps[-1]
        validate_step(step)
        votes, bad = self._jk(job_id, "votes"), self._jk(job_id, "bad")
        if kind in policy.CLEAN_KINDS:
            if kind == policy.VOTE_AGREED:
                self._add_vote(job_id, votes, step, kind)
            self.fence.run(self.redis, self._raise, [self._jk(job_id, "checked")], [step], self._jk(job_id, "epoch"))
        elif kind in policy.BAD_KINDS:
            if kind == policy.VOTE_MISMATCH:
                self._add_vote(job_id, votes, step, kind)
            self.redis.zadd(bad, {f"{kind}:{step}:{now}": step})
            if self.redis.zcard(bad) > MAX_BAD:
                self.redis.zremrangebyrank(bad, MAX_BAD, -1)   # keep the lowest steps
        elif kind == "rollback":
            self.cut_history(job_id, step, now)
            self.redis.zremrangebyscore(bad, f"({step}", "+inf")
            checked = self.redis.get(self._jk(job_id, "checked"))
            if checked is not None and int(_s(checked)) > step:   # the steps after the target are gone
                self.redis.set(self._jk(job_id, "checked"), step)
            for f in self.redis.hkeys(votes):
                if int(_s(f)) > step:
                    self.redis.hdel(votes, f)
        elif kind == "clear":
            self.redis.zremrangebyscore(bad, "-inf", step)
        elif kind == policy.REPAIRED:
            self._repaired(job_id, bad, step, now)
        return self.evaluate(job_id, now, reason or kind)

    def _repaired(self, job_id: str, bad: str, step: int, now: float) -> None:
        """See `on_job_event` ("repaired")."""
        mismatch, diverged = policy.VOTE_MISMATCH + ":", policy.DIVERGED + ":"
        mismatches = [(_s(m), int(float(sc))) for m, sc in self.redis.zrangebyscore(bad, "-inf", step,
                                                                                   withscores=True)
                      if (_s(m).startswith(mismatch) and float(sc) < step) or _s(m).startswith(diverged)]
        if not mismatches:
            return
        first = min(sc for _, sc in mismatches)
        for s in self._steps(job_id):
            if first <= s < step:
                self._drop(job_id, s, policy.EVICTED, f"saved while the replicas differed (from step {first}); "
                           f"they were repaired in place at step {step}", now)
        self.redis.zrem(bad, *(m for m, _ in mismatches))

    def _add_vote(self, job_id: str, votes: str, step: int, kind: str) -> None:
        """Record the vote at `step`; past MAX_VOTES + slack fields, keep the newest MAX_VOTES steps and the
        steps of live records (an old VERIFIED checkpoint keeps its vote)."""
        self.redis.hset(votes, str(step), kind)
        if self.redis.hlen(votes) <= MAX_VOTES + VOTE_PRUNE_SLACK:
            return
        steps = sorted(int(_s(f)) for f in self.redis.hkeys(votes))
        live = set(self._steps(job_id))
        old = [s for s in steps[:-MAX_VOTES] if s not in live]
        if old:
            self.redis.hdel(votes, *(str(s) for s in old))

    def evaluate(self, job_id: str, now: float, reason: str = "") -> list[int]:
        """Apply `policy.verified_steps` to the records, publishing each VERIFIED / revoked change. Reads the
        records, the job's checked-through step and its lowest bad steps, never the whole votes hash. A
        committed record whose bytes were not compared yet (this agent just committed it, or the one that did
        stopped first) is compared here. Returns the steps that became VERIFIED or lost it."""
        infos = [i for i in self.list(job_id) if i.state in policy.RESTORABLE_STATES]
        verdicts = {}
        for i in infos:
            verdict = self.redis.hget(self._meta(job_id, i.step), "bytes_check")
            verdicts[i.step] = _s(verdict) if verdict is not None else self._check_bytes(job_id, i.step, now)
            unchecked = self._unscrubbed(job_id, i.step)
            if unchecked:   # the host bytes of a source-checksummed shard are not checked (yet, or failed)
                verdicts[i.step] = f"host bytes {unchecked}"
        checked, bad_steps = self._checks(job_id)
        changed = []
        good = policy.verified_steps([i.step for i in infos], verdicts, checked, bad_steps)
        for i in infos:
            meta = self._meta(job_id, i.step)
            if i.step in good and i.state == policy.COMMITTED:
                if self._move(job_id, meta, policy.VERIFIED, "verified_at", repr(now), policy.COMMITTED):
                    self.stats["verified"] += 1
                    changed.append(i.step)
                    vouched = _s(self.redis.hget(meta, "vouched_by") or "")
                    self.emit(ek.CHECKPOINT_VERIFIED, job_id, f"checkpoint step {i.step} is VERIFIED ({vouched})",
                              {"step": i.step, "vouched_by": vouched})
            elif i.step not in good and i.state == policy.VERIFIED:
                why = reason or "a bad event at or before this step"
                if self._move(job_id, meta, policy.COMMITTED, "reason", f"verification revoked: {why}",
                              policy.VERIFIED):
                    self.stats["revoked"] += 1
                    changed.append(i.step)
                    self.emit(ek.CHECKPOINT_REVOKED, job_id,
                              f"checkpoint step {i.step} is no longer VERIFIED: {why}", {"step": i.step})
        return changed

    def _checks(self, job_id: str) -> tuple[int | None, list[int]]:
        """The job's checked-through step (None before its first clean check) and its bad steps."""
        checked = self.redis.get(self._jk(job_id, "checked"))
        bad = self.redis.zrange(self._jk(job_id, "bad"), 0, -1, withscores=True)
        return (None if checked is None else int(_s(checked))), [int(float(s)) for _, s in bad]

    def _next_to_verify(self, job_id: str, infos: list[CheckpointInfo]) -> set[int]:
        """`policy.next_to_verify` for retention (as a set, empty or one step): a record's bytes verdict as
        judged (None: not yet), a shard whose host bytes were found bad counting as not vouching; read only
        for the records the rule asks about (usually one)."""
        def verdict(step: int) -> str | None:
            raw = self.redis.hget(self._meta(job_id, step), "bytes_check")
            v = None if raw is None else _s(raw)
            if v is not None and v not in replica_bytes.VOUCHING:
                return v
            # host bytes found bad (the scrub): never VERIFIED
            return replica_bytes.MISMATCH if self._unscrubbed(job_id, step).startswith("bad") else v

        checked, bad_steps = self._checks(job_id)
        committed = [i.step for i in infos if i.state == policy.COMMITTED]
        verified = [i.step for i in infos if i.state == policy.VERIFIED]
        step = policy.next_to_verify(committed, verdict, verified, checked, bad_steps)
        return set() if step is None else {step}

    # ---- the scrub: host bytes of source-checksummed shards -----------------------------------------------
    def _unscrubbed(self, job_id: str, step: int) -> str:
        """"" when every shard of the record saved with source checksums had its bytes checked here (or
        none was); else what is missing ("not checked yet (ranks 0, 3)" / "bad (rank 2: ...)")."""
        fields = self._scrub_fields(self._meta(job_id, step))
        bad = sorted(f"rank {k[len(SCRUB_FIELD):]}: {v}" for k, v in fields.items()
                     if v not in (SCRUB_OK, SCRUB_PENDING))
        if bad:
            return f"bad ({'; '.join(bad)})"
        pending = sorted(int(k[len(SCRUB_FIELD):]) for k, v in fields.items() if v == SCRUB_PENDING)
        return f"not checked yet (ranks {', '.join(map(str, pending))})" if pending else ""

    def _scrub_fields(self, meta: str) -> dict[str, str]:
        """The record's scrub:<rank> fields (HSCAN on the small record hash, never a whole-hash read)."""
        return {_s(k): _s(v) for k, v in self.redis.hscan_iter(meta, match=SCRUB_FIELD + "*")}

    def scrub(self, now: float, budget_bytes: int) -> int:
        """Check up to about `budget_bytes` of the shards committed here with source checksums against their
        chunk checksums, reading this node's memory tier (the agent calls it at a bounded rate: its
        `[checkpoints] scrub_bytes_per_s`). A shard whose every chunk matches gets `scrub:<rank>` = ok on its
        record (VERIFIED needs every such shard ok); a bad chunk marks it bad (never VERIFIED: the restore
        reads another copy) and is journaled. Returns the bytes read."""
        done = 0
        while done < budget_bytes:
            if self._scrub_at is None:
                with self._scrub_lock:
                    if not self._scrub_queue:
                        break
                    key, _ = self._scrub_queue.popitem(last=True)   # the newest: the next VERIFIED
                m = self._scrub_manifest(*key)
                if m is None:
                    continue
                self._scrub_at = (key, m, 0)
            key, m, k = self._scrub_at
            if k >= len(m.chunks):
                self._scrub_at = None
                self._scrub_mark(key, SCRUB_OK, now)
                continue
            c = m.chunks[k]
            if len(self._scrub_buf) < c.length:
                self._scrub_buf = bytearray(c.length)
            view = memoryview(self._scrub_buf)[:c.length]
            try:
                n = self.store.readinto(m.blob, c.offset, view)
            except (KeyError, OSError) as e:   # evicted meanwhile, or the tier lost it: nothing to vouch for
                self._scrub_at = None
                log.info("scrub of %s stopped: %s", m.blob, e)
                continue
            done += n
            self.stats["scrubbed_bytes"] += n
            if not verify(view[:n], c):
                self._scrub_at = None
                self.stats["checksum_failures"] += 1
                self.stats["scrub_failures"] += 1
                why = f"chunk at {c.offset} differs from its checksum taken at the source"
                self._scrub_mark(key, f"bad: {why}", now)
                self.emit(ek.CHECKPOINT_COPY_CORRUPT, key[0],
                          f"checkpoint step {key[1]} rank {key[2]}: the bytes in node memory do not match the "
                          f"source ({why}): never VERIFIED", {"step": key[1], "rank": key[2], "tier": "memory",
                                                               "offset": c.offset})
                continue
            self._scrub_at = (key, m, k + 1)
        return done

    def scrub_pending(self) -> int:
        """Shards waiting for the scrub (the one being checked included)."""
        return len(self._scrub_queue) + (self._scrub_at is not None)

    def _scrub_manifest(self, job_id: str, step: int, rank: int) -> ShardManifest | None:
        meta, shards, _ = self._keys(job_id, step)
        raw = self.redis.hget(shards, str(rank))
        if raw is None or _s(self.redis.hget(meta, SCRUB_FIELD + str(rank)) or "") != SCRUB_PENDING:
            return None   # dropped meanwhile, or already judged
        try:
            return ShardManifest.from_json(_s(raw))
        except InvalidInputError as e:
            log.error("job %s step %d rank %d: manifest unreadable for the scrub: %s", job_id, step, rank, e)
            return None

    def _scrub_mark(self, key: tuple[str, int, int], verdict: str, now: float) -> None:
        job_id, step, rank = key
        meta = self._meta(job_id, step)
        if _s(self.redis.hget(meta, "state") or "") not in policy.RESTORABLE_STATES:
            return   # evicted or aborted meanwhile: nothing to record
        fields = {SCRUB_FIELD + str(rank): verdict}
        if verdict != SCRUB_OK:   # what `sdcwatch ckpt show` prints for it
            fields["reason"] = f"never VERIFIED: rank {rank}'s bytes in node memory: {verdict}"
        self.redis.hset(meta, mapping=fields)
        self.evaluate(job_id, now, "host bytes checked")

    def _requeue_scrubs(self, job_id: str, steps: Sequence[int]) -> None:
        """Shards of this node still waiting for the scrub that this coordinator does not know (the agent
        restarted): queue them again."""
        for step in steps:
            meta, _, copies = self._keys(job_id, step)
            for f, v in self._scrub_fields(meta).items():
                if v != SCRUB_PENDING:
                    continue
                rank = int(f[len(SCRUB_FIELD):])
                key = (job_id, step, rank)
                at = self._scrub_at[0] if self._scrub_at is not None else None
                if key != at and key not in self._scrub_queue and self.redis.hexists(copies, f"{rank}@{self.node}"):
                    with self._scrub_lock:
                        self._scrub_queue[key] = None

    def _move(self, job_id: str, meta: str, state: str, field: str, value: str, expected: str) -> bool:
        """Set `state` (and `field`) if the record is in `expected`: fenced and acknowledged like a commit, so
        a VERIFIED that was announced is on the replicas."""
        return bool(self.fence.run(self.redis, self._transition, [meta], [state, field, value, expected],
                                   self._jk(job_id, "epoch"))[0])

    def _check_bytes(self, job_id: str, step: int, now: float) -> str:
        """Compare the bytes every rank saved across replicas (`checkpoint.replica_bytes`); keep the verdict
        and which fingerprints vouched on the record; journal a mismatch. Returns the verdict."""
        meta, shards, _ = self._keys(job_id, step)
        raw = self.redis.hgetall(shards)
        try:
            check = replica_bytes.compare(self._manifest(_s(t)) for t in raw.values())
        except InvalidInputError as e:   # validated on commit: only a damaged record gets here
            log.error("job %s step %d: shard manifests unreadable: %s", job_id, step, e)
            return replica_bytes.MISMATCH
        fields = {"bytes_check": check.verdict, "vouched_by": check.summary()}
        if check.verdict in (replica_bytes.MISMATCH, replica_bytes.IMPORTED):
            fields["reason"] = f"never VERIFIED: {check.summary()}"
        if not self._set_if_live(job_id, meta, fields):
            return check.verdict
        if check.verdict == replica_bytes.MISMATCH:
            self.stats["replicas_differ"] += 1
            self.emit(ek.CHECKPOINT_REPLICAS_DIFFER, job_id,
                      f"checkpoint step {step}: replicas saved different bytes ({check.summary()})",
                      {"step": step, "odd_ranks": list(check.odd_ranks),
                       "differing": sorted({p for s in check.sets for p in s.differing})})
        return check.verdict

    def _set_if_live(self, job_id: str, meta: str, fields: Mapping[str, str]) -> bool:
        """Set `fields` on a record still COMMITTED or VERIFIED whose bytes were not judged yet (fenced like
        every other write); False when another evaluation got there first or the record is gone."""
        args = [x for kv in fields.items() for x in kv]
        return bool(self.fence.run(self.redis, self._set_live, [meta], args, self._jk(job_id, "epoch"))[0])

    # ---- retention and GC ---------------------------------------------------------------------------
    def _local_bytes(self, job_id: str) -> dict[int, int]:
        out: dict[int, int] = {}
        for key in self.store.list(job_id + "/"):
            try:
                step = int(key.split("/")[1])
                out[step] = out.get(step, 0) + self.store.size(key)
            except (ValueError, IndexError, KeyError):
                continue
        return out

    def maintain_job(self, job_id: str, now: float, hold: RetentionHold | None = None) -> list[int]:
        """Retention and GC for one job; returns the steps evicted or aborted. `hold(job_id)`: steps retention
        should keep a little longer (the drainer's: not yet on the first durable tier; soft, the memory cap
        still evicts them)."""
        local = self._local_bytes(job_id)
        infos = self.list(job_id)
        self._requeue_scrubs(job_id, [i.step for i in infos if i.state in policy.RESTORABLE_STATES])
        at = self._scrub_at
        scrubbing = {at[0][1]} if at is not None and at[0][0] == job_id else set()
        records = [policy.Record(i.step, i.state, local.get(i.step, 0), i.begun_at) for i in infos]
        dropped = []
        for step in policy.stale_pending(records, now, self.config.pending_timeout_s):
            self._drop(job_id, step, policy.ABORTED, "save never completed on every rank", now)
            self.stats["aborted"] += 1
            dropped.append(step)
        records = [r for r in records if r.step not in dropped]
        held: set[int] = set()
        if hold is not None:
            try:
                held = hold(job_id)
            except Exception:  # noqa: BLE001 - a hint only
                log.exception("retention hold failed")
        # the drainer's steps, the one being scrubbed, and the one that becomes VERIFIED next (else, saved
        # faster than a loaded agent's votes arrive, each would go before its vote: nothing to roll back to)
        live = [i for i in infos if i.step not in dropped]
        keep = set(held) | scrubbing | self._next_to_verify(job_id, live)
        for step in policy.plan_retention(records, self.config.keep_committed, self.config.memory_cap_bytes or None,
                                           self.config.rollback_span_steps, keep):
            self._drop(job_id, step, policy.EVICTED, "retention", now)
            self.stats["evictions"] += 1
            dropped.append(step)
        self._sweep_blobs(job_id, local, now)
        return sorted(dropped)

    def reconcile_local(self, now: float) -> dict[str, list[int]]:
        """After an agent (or its Redis) restarted: every live record's copy on this node must still be in the
        memory tier whole (its blob there, of the manifest's size). A copy whose bytes are gone (the node
        rebooted, /dev/shm was cleared) is removed from the record; a COMMITTED or VERIFIED record left with
        a rank that has no copy at all is evicted with the reason (a durable tier may still hold it: restore
        plans then come from the tiers). Returns job -> steps evicted. The checksums are checked on restore."""
        out: dict[str, list[int]] = {}
        for job in self.jobs():
            try:
                validate_job_id(job)
            except InvalidInputError:
                continue
            for info in self.list(job):
                lost = []
                manifests = self.shard_manifests(job, info.step)
                for c in info.copies:
                    if c.node != self.node or c.tier != "memory" or c.location != self.location:
                        continue   # another node's, or a memory dir this agent does not serve: not ours to judge
                    m = manifests.get(c.rank)
                    try:
                        whole = m is not None and self.store.size(m.blob) == m.nbytes
                    except (KeyError, OSError):   # gone, or a link planted in its place: not a copy
                        whole = False
                    if not whole:
                        lost.append(c)
                if not lost:
                    continue
                self.redis.hdel(self._keys(job, info.step)[2], *(f"{c.rank}@{c.node}" for c in lost))
                left = {c.rank for c in info.copies if c not in lost}
                missing = sorted(set(manifests) - left)
                log.warning("job %s step %d: %d copy(ies) on this node lost their bytes (ranks %s)", job,
                            info.step, len(lost), [c.rank for c in lost])
                if info.state in policy.RESTORABLE_STATES and missing:
                    self._drop(job, info.step, policy.EVICTED,
                               f"the bytes of rank(s) {missing[:8]} are gone from memory (found after a restart)", now)
                    self.stats["evictions"] += 1
                    out.setdefault(job, []).append(info.step)
        return out

    def maintain(self, now: float, hold: RetentionHold | None = None) -> dict[str, list[int]]:
        """`maintain_job` over every job; one job's failure is logged, not raised."""
        out = {}
        sweep = getattr(self.store, "sweep_temp", None)
        if sweep is not None:  # temp files of puts interrupted long ago (a rank died mid-write)
            sweep(self.config.pending_timeout_s, now)
        sweep_slots = getattr(self.store, "sweep_slots", None)
        if sweep_slots is not None:  # staging slots of ranks that are gone (checkpoint.slots)
            try:
                self.stats["slots_swept"] += sweep_slots(now)
            except OSError:
                log.exception("sweeping dead ranks' staging slots failed")
        for job in self.jobs():
            try:
                out[job] = self.maintain_job(job, now, hold)
            except Exception:  # noqa: BLE001 - keep maintaining the other jobs
                log.exception("checkpoint maintenance failed for job %s", job)
        return out

    def _drop(self, job_id: str, step: int, state: str, reason: str, now: float) -> None:
        """Tombstone the record (other nodes sweep their blobs on seeing it) and delete this node's blobs."""
        meta, shards, copies = self._keys(job_id, step)
        was = _s(self.redis.hget(meta, "state") or "")
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(meta, mapping={"state": state, "reason": reason, "dropped_at": repr(now),
                                 "dropped_from": was if was in policy.RESTORABLE_STATES else ""})
        pipe.delete(shards, copies)
        pipe.expire(meta, self.config.tombstone_ttl_s)
        # out of the job's index: the tombstone (its own key, for tombstone_ttl_s) is what late ranks and other
        # nodes read; listing the live records must not walk every step evicted in the last hour (saving every
        # step, that is thousands of round trips per commit)
        pipe.zrem(self._jk(job_id, "idx"), step)
        pipe.execute()
        self._delete_step_blobs(job_id, step)
        kind = ek.CHECKPOINT_ABORTED if state == policy.ABORTED else ek.CHECKPOINT_EVICTED
        self.emit(kind, job_id, f"checkpoint step {step} {state.lower()}: {reason}", {"step": step})

    def _sweep_blobs(self, job_id: str, local: Mapping[int, int], now: float) -> None:
        """Delete this node's blobs whose record is tombstoned; leave unknown ones until they are old."""
        for step in local:
            state = self.redis.hget(self._meta(job_id, step), "state")
            state = _s(state) if state is not None else None
            if state in policy.LIVE_STATES:
                continue
            keys = self.store.list(f"{job_id}/{step:012d}/")
            if state is None and not all(self._old(k, now) for k in keys):
                continue
            self._delete_step_blobs(job_id, step)

    def _delete_step_blobs(self, job_id: str, step: int) -> None:
        prefix = f"{job_id}/{step:012d}/"
        purge = getattr(self.store, "purge", None)
        if purge is not None:  # also removes temp files of a rank that died mid-write
            purge(prefix)
            return
        for key in self.store.list(prefix):
            self.store.delete(key)

    def _old(self, key: str, now: float) -> bool:
        mtime = getattr(self.store, "mtime", None)   # DirStore: an lstat by dir fd, never through a link
        if mtime is None:
            return False
        try:
            return now - mtime(key) > self.config.orphan_blob_ttl_s
        except (KeyError, OSError):
            return False

    def emit(self, kind: EventKind, job_id: str, message: str, details: dict) -> None:
        """Journal a checkpoint event about `job_id` through the agent's `publish` (if any); a failure to
        journal is logged, never raised: it must not break the commit path."""
        log.info("%s job=%s %s", kind, job_id, message)
        if self.publish is None:
            return
        try:
            self.publish(kind, f"job/{job_id}", message, {"job_id": job_id, **details})
        except Exception:  # noqa: BLE001 - journaling must not break the commit path
            log.exception("publishing %s failed", kind)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def copies_by_rank(plan: RestorePlan) -> dict[int, Sequence[Copy]]:
    return {s.rank: s.copies for s in plan.shards}
