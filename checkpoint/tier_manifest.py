"""The per-tier commit: one manifest per checkpoint per node per tier, written last.

A tier (NVMe dir, flash dir, S3 bucket) holds a node's shards of checkpoint (job, step) under the same
keys as the memory tier (`<job>/<step:012d>/rank-<r>.bin`) and, written only after every shard blob is
stored and verified, `<job>/<step:012d>/manifest-<node>.json`:

    {"format": "sdcwatch.ckpt.tier.v1", "job_id", "step", "world_size", "node", "state", "created",
     "shards": {"<rank>": <the shard's ShardManifest JSON object>, ...}, "vouched_by": "..."}

The manifest is that tier's commit: a blob without a manifest naming its rank is never listed (it is a
partial drain, an orphan for `orphans`), and a checkpoint is complete on a tier when the manifests of all
nodes together name every rank. `state` is COMMITTED or VERIFIED as the coordination Redis said when the
copy was written (refreshed when it changes), so a durable tier still knows its newest VERIFIED checkpoint
after the Redis is gone. `vouched_by` is the record's evidence as the coordinator wrote it (which replica
sets' tensor fingerprints agreed, or, for ranks without replicas, that their own fingerprints and checksums
and clean in-step checks vouch; checkpoint.replica_bytes), refreshed with the state, so
`sdcwatch ckpt ls/show` says it for a checkpoint only the tiers still hold. A manifest without it (written
before it existed) gets it recomputed from its shard manifests' fingerprints (`TierCheckpoint.vouched_by`).
Everything is validated on read (`TierManifest.from_json`), like shard manifests.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Iterable

from checkpoint import replica_bytes
from checkpoint.blobstore import BlobStore
from checkpoint.errors import InvalidInputError
from checkpoint.manifest import ShardManifest
from checkpoint.names import validate_job_id, validate_step

log = logging.getLogger(__name__)

FORMAT = "sdcwatch.ckpt.tier.v1"
_MANIFEST_RE = re.compile(r"^(?P<job>[^/]+)/(?P<step>\d{12})/manifest-(?P<node>[^/]+)\.json$")
STATES = ("COMMITTED", "VERIFIED")
MAX_VOUCHED = 4096   # characters of `vouched_by` kept (the coordinator's line is far shorter)


def step_prefix(job_id: str, step: int) -> str:
    return f"{job_id}/{step:012d}/"


def manifest_key(job_id: str, step: int, node: str) -> str:
    return f"{step_prefix(job_id, step)}manifest-{node}.json"


@dataclasses.dataclass(frozen=True, slots=True)
class TierManifest:
    job_id: str
    step: int
    world_size: int
    node: str
    state: str
    created: float
    shards: tuple[ShardManifest, ...]
    vouched_by: str = ""       # the coordinator record's evidence (checkpoint.replica_bytes), "" unknown

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(s.rank for s in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def with_state(self, state: str, vouched_by: str | None = None) -> "TierManifest":
        vouched = self.vouched_by if vouched_by is None else vouched_by[:MAX_VOUCHED]
        return dataclasses.replace(self, state=state, vouched_by=vouched)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "job_id": self.job_id, "step": self.step,
                           "world_size": self.world_size, "node": self.node, "state": self.state,
                           "created": self.created,
                           "shards": {str(s.rank): json.loads(s.to_json()) for s in self.shards},
                           "vouched_by": self.vouched_by[:MAX_VOUCHED]},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "TierManifest":
        try:
            obj = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidInputError(f"tier manifest is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise InvalidInputError(f"not a {FORMAT} manifest")
        try:
            job, step, world = validate_job_id(obj["job_id"]), validate_step(obj["step"]), obj["world_size"]
            node, state, created, shards = obj["node"], obj["state"], obj["created"], obj["shards"]
        except KeyError as e:
            raise InvalidInputError(f"tier manifest lacks field {e}") from None
        if not isinstance(world, int) or world < 1 or not isinstance(node, str) or not node:
            raise InvalidInputError(f"tier manifest has a bad world_size/node {world!r}/{node!r}")
        if state not in STATES or not isinstance(created, (int, float)) or not isinstance(shards, dict):
            raise InvalidInputError(f"tier manifest has a bad state/created/shards {state!r}/{created!r}")
        vouched = obj.get("vouched_by", "")      # absent in manifests written before it existed
        if not isinstance(vouched, str) or len(vouched) > MAX_VOUCHED:
            raise InvalidInputError("tier manifest has a bad vouched_by (a string of at most "
                                    f"{MAX_VOUCHED} characters)")
        parsed = []
        for r, m in shards.items():
            sm = ShardManifest.from_json(json.dumps(m))
            if str(sm.rank) != r or (sm.job_id, sm.step, sm.world_size) != (job, step, world):
                raise InvalidInputError(f"tier manifest of {job} step {step}: shard {r} is for "
                                        f"{sm.job_id} step {sm.step} rank {sm.rank}/{sm.world_size}")
            parsed.append(sm)
        return cls(job, step, world, node, state, float(created), tuple(sorted(parsed, key=lambda s: s.rank)),
                   vouched)


@dataclasses.dataclass(slots=True)
class TierCheckpoint:
    """What one tier holds of one checkpoint: every node's committed part."""

    job_id: str
    step: int
    world_size: int
    parts: dict[str, TierManifest]

    @property
    def ranks(self) -> frozenset[int]:
        out: set[int] = set()
        for m in self.parts.values():
            out |= m.ranks
        return frozenset(out)

    @property
    def complete(self) -> bool:
        ranks = self.ranks   # as many as exist: never a set of world_size numbers built to compare
        return len(ranks) == self.world_size and all(0 <= r < self.world_size for r in ranks)

    @property
    def state(self) -> str:
        return "VERIFIED" if any(m.state == "VERIFIED" for m in self.parts.values()) else "COMMITTED"

    @property
    def created(self) -> float:
        return max(m.created for m in self.parts.values())

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.parts.values())

    @property
    def vouched_by(self) -> str:
        """What vouched for the bytes: the coordinator's line a part carries (a VERIFIED part's first), else,
        for a complete checkpoint, the comparison of its shard manifests' fingerprints recomputed here."""
        parts = sorted(self.parts.values(), key=lambda m: (m.state != "VERIFIED", m.node))
        for m in parts:
            if m.vouched_by:
                return m.vouched_by
        if not self.complete:
            return ""
        shards = [s for m in parts for s in m.shards]
        return replica_bytes.compare(shards).summary() + " (recomputed from the tier's shard manifests)"

    def shard(self, rank: int) -> ShardManifest | None:
        for m in self.parts.values():
            for s in m.shards:
                if s.rank == rank:
                    return s
        return None


def scan(store: BlobStore, job_id: str = "") -> dict[tuple[str, int], TierCheckpoint]:
    """Every committed checkpoint (part) on a tier, from its manifests; unreadable manifests are skipped
    with a warning (the checkpoint is then not listed on that tier)."""
    out: dict[tuple[str, int], TierCheckpoint] = {}
    for key in store.list(f"{job_id}/" if job_id else ""):
        m = _MANIFEST_RE.match(key)
        if not m:
            continue
        try:
            tm = TierManifest.from_json(store.get(key))
        except (InvalidInputError, KeyError) as e:
            log.warning("skipping tier manifest %s on %r: %s", key, store, e)
            continue
        if (tm.job_id, tm.step) != (m["job"], int(m["step"])):
            log.warning("skipping tier manifest %s: it is for %s step %d", key, tm.job_id, tm.step)
            continue
        tc = out.setdefault((tm.job_id, tm.step), TierCheckpoint(tm.job_id, tm.step, tm.world_size, {}))
        tc.parts[tm.node] = tm
    return out


def orphans(keys: Iterable[str], catalog: dict[tuple[str, int], TierCheckpoint],
            busy: set[tuple[str, int]]) -> list[str]:
    """Blob keys no committed manifest names (partial drains), except under checkpoints being written now."""
    out = []
    for key in keys:
        parts = key.split("/")
        if len(parts) != 3 or _MANIFEST_RE.match(key) or not parts[1].isdigit():
            continue
        job, step = parts[0], int(parts[1])
        if (job, step) in busy:
            continue
        tc = catalog.get((job, step))
        named = tc is not None and any(s.blob == key for m in tc.parts.values() for s in m.shards)
        if not named:
            out.append(key)
    return out
