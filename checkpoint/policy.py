"""Pure checkpoint policies: which checkpoints are VERIFIED, which to evict, which saves to abort.

No Redis, no clock: the coordinator passes records and `now` in and applies the verdicts.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping

from checkpoint.replica_bytes import VOUCHING

PENDING = "PENDING"
COMMITTED = "COMMITTED"
VERIFIED = "VERIFIED"
ABORTED = "ABORTED"
EVICTED = "EVICTED"
LIVE_STATES = (PENDING, COMMITTED, VERIFIED)
RESTORABLE_STATES = (COMMITTED, VERIFIED)

VOTE_AGREED = "vote_agreed"
VOTE_MISMATCH = "vote_mismatch"
CHECKS_CLEAN = "checks_clean"   # a job without replicas: every rank's in-step checks ran clean through the step
EVENTS_LOST = "events_lost"   # job events the agent could not queue (daemon/checkpoint_feed.py): bad from there
DIVERGED = "diverged"   # a compute check found the replicas computing from different weights (no GPU named)
BAD_KINDS = ("vote_mismatch", "sdc", "nan", "fatal_hardware", "loss_anomaly", DIVERGED, EVENTS_LOST)
REPAIRED = "repaired"   # the replicas agree again without a restore (repaired in place): see the coordinator
CLEAR_KINDS = ("rollback", "clear", REPAIRED)
EVENT_KINDS = (VOTE_AGREED, CHECKS_CLEAN, *BAD_KINDS, *CLEAR_KINDS)
CLEAN_KINDS = (VOTE_AGREED, CHECKS_CLEAN)   # move the job's "checked through" step forward


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """What retention needs to know about one checkpoint."""

    step: int
    state: str
    nbytes: int          # bytes this node holds for it
    begun_at: float = 0.0


def verified_steps(committed: Iterable[int], bytes_verdicts: Mapping[int, str], checked_through: int | None,
                   bad_steps: Iterable[int]) -> set[int]:
    """Steps that are VERIFIED: committed, and
    - the bytes each rank saved agree across its replicas (`bytes_verdicts[k]` is
      `checkpoint.replica_bytes.AGREED`), or no rank has a replica (UNREPLICATED): bytes, not step numbers;
    - the job's checks reported clean through step k (`checked_through` >= k: an agreed replica vote, or for
      a job without replicas its ranks' in-step checks, at k or later; the vote is read a step after the
      update, so until then a fault at k could still be on its way);
    - no bad event (SDC, NaN, fatal hardware, vote mismatch, loss anomaly, lost events) at or before k since
      the last rollback/clear: DESIGN.md's "no bad event since the previous verified checkpoint". A bad event
      at step s blocks every checkpoint >= s, and a later report of it revokes those already verified.
    """
    first_bad = min(bad_steps, default=None)
    if checked_through is None:
        return set()
    return {k for k in committed
            if bytes_verdicts.get(k) in VOUCHING and k <= checked_through
            and (first_bad is None or k < first_bad)}


def next_to_verify(committed: Iterable[int], verdict: Callable[[int], str | None], verified: Iterable[int],
                   checked_through: int | None, bad_steps: Iterable[int]) -> int | None:
    """The checkpoint that becomes VERIFIED next, when the job's checks reach it: the oldest COMMITTED step
    newer than every VERIFIED one whose bytes vouch (`verdict(k)` in VOUCHING, or None: not compared yet)
    and that no bad event precedes (`verified_steps`' rules less "checked through k"). `verdict` is asked
    in step order, only until the answer is found (the coordinator reads it from Redis). None when there is
    none, or the job never reported a clean check (`checked_through` None: a job whose checks never run would
    keep it for good). Retention keeps it (`plan_retention`'s `hold`): saved faster than a loaded agent's
    feed brings the votes (Gemini-style saves seconds apart), the newest `keep_committed` would otherwise
    push every checkpoint out before its vote came, leaving no VERIFIED step to roll back to. At most one
    copy more, and only until the checks reach it."""
    if checked_through is None:
        return None
    first_bad = min(bad_steps, default=None)
    newest_verified = max(verified, default=None)
    for k in sorted(committed):
        if newest_verified is not None and k <= newest_verified:
            continue
        if first_bad is not None and k >= first_bad:
            return None
        v = verdict(k)
        if v is None or v in VOUCHING:
            return k
    return None


def plan_retention(records: Iterable[Record], keep_committed: int, memory_cap_bytes: int | None,
                   rollback_span_steps: int = 0, hold: Iterable[int] = ()) -> list[int]:
    """Steps to evict, oldest first.

    Keep the newest `keep_committed` restorable checkpoints, the newest VERIFIED one, and (with
    `rollback_span_steps` > 0) the newest VERIFIED one at least that many steps older than the newest
    checkpoint, and the oldest VERIFIED one inside that span: an anomaly is seen some steps after it
    starts (the loss detector's patience), and the rollback needs a verified checkpoint from before its
    start. Evict the other restorable ones. Then, while the kept bytes exceed `memory_cap_bytes`, evict the oldest
    unverified kept checkpoint; never the newest VERIFIED (the only verified copy kept). PENDING saves
    are left to `stale_pending` (they are still being written). `hold` steps (not yet copied to a durable
    tier) are kept too, but only softly: the memory cap evicts them like any unverified checkpoint.
    """
    if keep_committed < 1:
        raise ValueError(f"keep_committed must be >= 1, got {keep_committed}")
    restorable = sorted((r for r in records if r.state in RESTORABLE_STATES), key=lambda r: r.step)
    verified = [r for r in restorable if r.state == VERIFIED]
    newest_verified = verified[-1].step if verified else None
    keep = {r.step for r in restorable[-keep_committed:]}
    if newest_verified is not None:
        keep.add(newest_verified)
    if rollback_span_steps > 0 and restorable:
        # at most two more copies: the newest verified behind the span, and the oldest inside it (which
        # becomes the one behind the span later, so a target older than any anomaly start inside the span
        # always exists and is at most two spans old)
        horizon = restorable[-1].step - rollback_span_steps
        behind = [r.step for r in verified if r.step <= horizon]
        inside = [r.step for r in verified if r.step > horizon]
        if behind:
            keep.add(behind[-1])
        if inside:
            keep.add(inside[0])
    keep |= set(hold) & {r.step for r in restorable}
    evict = [r.step for r in restorable if r.step not in keep]
    if memory_cap_bytes is not None:
        pending_bytes = sum(r.nbytes for r in records if r.state == PENDING)
        kept = [r for r in restorable if r.step in keep]
        used = pending_bytes + sum(r.nbytes for r in kept)
        # Oldest unverified first, then older verified ones, never the newest verified.
        order = [r for r in kept if r.state != VERIFIED] + [r for r in kept if r.state == VERIFIED]
        for r in order:
            if used <= memory_cap_bytes:
                break
            if r.step == newest_verified:
                continue
            evict.append(r.step)
            used -= r.nbytes
    return sorted(evict)


def stale_pending(records: Iterable[Record], now: float, timeout_s: float) -> list[int]:
    """PENDING saves to abort: begun more than `timeout_s` ago, or older than a committed checkpoint
    (a newer one committed, so this one's missing ranks are not coming)."""
    recs = list(records)
    newest_committed = max((r.step for r in recs if r.state in RESTORABLE_STATES), default=None)
    return sorted(r.step for r in recs if r.state == PENDING and (
        now - r.begun_at > timeout_s or (newest_committed is not None and r.step < newest_committed)))
