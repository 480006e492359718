"""Pure tiering policy: which checkpoints to copy down to each tier, and which copies a tier may delete.

No I/O, no clock: the drainer passes what it sees and `now`, and applies the verdicts.

Drain (`plan_drains`), per tier, over the checkpoints a faster tier holds (`candidates`):
- every Nth (`every_n`): counted over the checkpoints the drainer has seen committed (`seen`) since the
  newest one the tier holds; N=1 copies every one, 0 turns counting off;
- every T seconds (`every_s`): when the tier's newest copy is older than T, the newest candidate;
- always the newest VERIFIED (`newest_verified`): a tier never lags behind the rollback target.
Newest first; the bytes planned are capped by `max_backlog_bytes` (the bounded backlog): older ones
beyond it are dropped (the newest VERIFIED is never dropped).

Retention (`plan_retention`), per tier: keep the newest K (`keep_newest`), steps that are multiples of
`keep_every_steps`, copies younger than `keep_age_s`, the tier's newest VERIFIED copy (so the newest
verified checkpoint is never deleted from anywhere it is held), and anything `protected` (being read or
written); delete the rest.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from checkpoint.errors import InvalidInputError


@dataclasses.dataclass(frozen=True, slots=True)
class TierRule:
    name: str
    every_n: int = 1
    every_s: float = 0.0
    newest_verified: bool = True
    keep_newest: int = 3
    keep_every_steps: int = 0
    keep_age_s: float = 0.0
    max_backlog_bytes: int = 0          # 0: unbounded

    def __post_init__(self) -> None:
        if self.every_n < 0 or self.every_s < 0 or self.keep_age_s < 0 or self.keep_every_steps < 0:
            raise InvalidInputError(f"tier {self.name}: every_n, every_s, keep_every_steps and keep_age_s must "
                                    "be >= 0")
        if self.keep_newest < 1:
            raise InvalidInputError(f"tier {self.name}: keep_newest must be >= 1, got {self.keep_newest}")
        if self.max_backlog_bytes < 0:
            raise InvalidInputError(f"tier {self.name}: max_backlog_bytes must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    step: int
    verified: bool
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    step: int
    verified: bool
    created: float


@dataclasses.dataclass(frozen=True, slots=True)
class DrainPlan:
    steps: tuple[int, ...]          # to copy, newest first
    dropped: tuple[int, ...]        # wanted but over the backlog bound


def plan_drains(rule: TierRule, candidates: Iterable[Candidate], held: Iterable[Held], seen: Iterable[int],
                now: float) -> DrainPlan:
    cands = sorted(candidates, key=lambda c: c.step)
    held_l = list(held)
    have = {h.step for h in held_l}
    last_held = max(have, default=-1)
    newest_held_at = max((h.created for h in held_l), default=None)
    want: set[int] = set()
    if rule.every_n:
        seen_after = sorted(s for s in set(seen) | {c.step for c in cands} if s > last_held)
        count = 0
        for s in seen_after:
            count += 1
            if count >= rule.every_n:
                want.add(s)
                count = 0
    if rule.every_s and cands and (newest_held_at is None or now - newest_held_at >= rule.every_s):
        newer = [c.step for c in cands if c.step > last_held]
        if newer:
            want.add(newer[-1])
    newest_verified = None
    if rule.newest_verified:
        v = [c.step for c in cands if c.verified]
        held_v = max((h.step for h in held_l if h.verified), default=-1)
        if v and v[-1] > held_v:
            newest_verified = v[-1]
            want.add(newest_verified)
    by_step = {c.step: c for c in cands}
    todo = sorted((s for s in want if s in by_step and s not in have), reverse=True)
    if newest_verified in todo:  # the rollback target goes first
        todo.remove(newest_verified)
        todo.insert(0, newest_verified)
    if not rule.max_backlog_bytes:
        return DrainPlan(tuple(todo), ())
    kept, dropped, total = [], [], 0
    for s in todo:
        n = by_step[s].nbytes
        if s == newest_verified or total + n <= rule.max_backlog_bytes or not kept:
            kept.append(s)
            total += n
        else:
            dropped.append(s)
    return DrainPlan(tuple(kept), tuple(dropped))


def plan_retention(rule: TierRule, held: Iterable[Held], now: float,
                   protected: Iterable[int] = ()) -> list[int]:
    """Steps the tier may delete, oldest first (see module docstring)."""
    hs = sorted(held, key=lambda h: h.step)
    keep = {h.step for h in hs[-rule.keep_newest:]}
    keep |= set(protected)
    verified = [h.step for h in hs if h.verified]
    if verified:
        keep.add(verified[-1])
    for h in hs:
        if rule.keep_every_steps and h.step % rule.keep_every_steps == 0:
            keep.add(h.step)
        if rule.keep_age_s and now - h.created <= rule.keep_age_s:
            keep.add(h.step)
    return [h.step for h in hs if h.step not in keep]


TIER_ORDER = ("memory", "peer", "nvme", "flash", "s3")


def restore_order(tiers: Iterable[str], measured_s_per_gib: dict[str, float] | None = None) -> list[str]:
    """Tiers fastest first: by measured restore seconds per GiB where known, else in `TIER_ORDER`
    (unknown names after the known ones, in the order given)."""
    names = list(dict.fromkeys(tiers))
    rank = {t: i for i, t in enumerate(TIER_ORDER)}
    measured = measured_s_per_gib or {}

    def key(t: str) -> tuple[float, int, int]:
        return (measured.get(t, float("inf")), rank.get(t, len(TIER_ORDER)), names.index(t))

    if measured and all(t in measured for t in names):
        return sorted(names, key=key)
    return sorted(names, key=lambda t: (rank.get(t, len(TIER_ORDER)), names.index(t)))
