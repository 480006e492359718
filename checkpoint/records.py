"""The checkpoint records both sides exchange: what a rank is told and tells, what the agent lists.

Plain frozen values, no I/O and no torch: the rank's client, snapshot, restore and DCP code and the
agent's coordinator and service all import them from here, so the rank never imports the agent-side
coordinator for its types.
"""
from __future__ import annotations

import dataclasses

from checkpoint.manifest import ShardManifest

LATEST = "latest"
LATEST_VERIFIED = "latest_verified"


@dataclasses.dataclass(frozen=True, slots=True)
class Copy:
    rank: int
    node: str
    location: str        # the memory tier directory on `node`, a tier's directory, or an s3:// URL
    tier: str = "memory"  # memory (this node's or a peer's), nvme, flash, s3 (checkpoint.drainer tiers)


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointInfo:
    job_id: str
    step: int
    state: str
    world_size: int
    shards: int          # shards committed so far
    nbytes: int
    begun_at: float
    committed_at: float
    verified_at: float
    reason: str
    copies: tuple[Copy, ...]
    vouched_by: str = ""  # which fingerprints vouched for the bytes, or why none did (checkpoint.replica_bytes)
    dropped_from: str = ""  # a tombstone (EVICTED): the state it had, COMMITTED or VERIFIED ("" unknown)


@dataclasses.dataclass(frozen=True, slots=True)
class SaveReport:
    """How a save went on the rank (sent with its CommitShard; feeds the agent's metrics)."""

    blocking_s: float = 0.0
    safe_s: float = 0.0
    stall_s: float = 0.0
    skipped_saves: int = 0
    staging: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreReportMsg:
    """How a restore went on the rank (ReportRestore; feeds the agent's metrics and journal)."""

    job_id: str
    step: int
    rank: int
    seconds: float
    nbytes: int
    chunks: int
    fallbacks: int
    checksum_failures: int
    ok: bool
    error: str = ""
    source: str = ""     # the copy that served most bytes, "<tier>@<node>" (e.g. "nvme@node-a")


@dataclasses.dataclass(frozen=True, slots=True)
class Restored:
    """A rank's last restore into its training state: the step it restored and when the restore began (seconds
    since the epoch, the node's clock). Its saves' begins carry it; the agent cuts the job's history there."""
    step: int
    at: float


@dataclasses.dataclass(frozen=True, slots=True)
class BeginResult:
    state: str           # PENDING (write your shard), or COMMITTED/VERIFIED (already done: skip)
    node: str
    location: str        # directory of this node's memory tier
    blob_key: str
    cut: bool = False    # this begin cut the job's history at the rank's restore (the agent's side only)


@dataclasses.dataclass(frozen=True, slots=True)
class CommitResult:
    state: str
    committed_now: bool  # this call completed the global commit
    shards: int


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPlan:
    rank: int
    manifest: ShardManifest
    copies: tuple[Copy, ...]  # this node's copy first


@dataclasses.dataclass(frozen=True, slots=True)
class RestorePlan:
    checkpoint: CheckpointInfo
    shards: tuple[ShardPlan, ...]
