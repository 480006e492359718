"""The replica vote: which ranks of a data-parallel replica group hold different weights.

Pure: it takes each rank's fingerprint words (and where each rank runs) and returns a verdict.

Rules (n = ranks that voted):
- n == 1: nothing to compare; agreed, method "single".
- all fingerprints equal: agreed, method "majority", no suspects.
- a strict majority (> n/2) holds one fingerprint and n >= 3: the ranks outside it are suspect,
  method "majority".
- otherwise (two replicas that differ, or no strict majority among three or more): no fingerprint
  can be trusted, so every rank of the group is suspect, method "all_disagreeing".
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

METHOD_MAJORITY = "majority"
METHOD_ALL_DISAGREEING = "all_disagreeing"
METHOD_SINGLE = "single"


@dataclasses.dataclass(frozen=True, slots=True)
class Suspect:
    rank: int
    host: str
    gpu_uuid: str
    fingerprint: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class VoteResult:
    agreed: bool
    method: str                         # "majority", "all_disagreeing" or "single"
    replicas: int                       # ranks that voted
    suspects: tuple[Suspect, ...]       # sorted by rank
    majority: tuple[int, ...] | None    # the fingerprint a strict majority holds; None without one

    @property
    def suspect_ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.suspects)


def vote(
    fingerprints: Mapping[int, Sequence[int]],
    where: Mapping[int, tuple[str, str]] | None = None,
) -> VoteResult:
    """Vote on `fingerprints` (rank -> words). `where` maps rank -> (host, gpu_uuid); missing -> ("", "")."""
    if not fingerprints:
        raise ValueError("replica vote needs at least one rank's fingerprint, got none")
    fps: dict[int, tuple[int, ...]] = {}
    for rank, words in fingerprints.items():
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"replica vote: rank must be a non-negative int, got {rank!r}")
        fp = tuple(int(w) for w in words)
        if not fp:
            raise ValueError(f"replica vote: rank {rank} has an empty fingerprint")
        fps[rank] = fp
    where = where or {}
    n = len(fps)
    counts = collections.Counter(fps.values())
    top_fp, top_count = counts.most_common(1)[0]

    def suspects_of(ranks: list[int]) -> tuple[Suspect, ...]:
        return tuple(
            Suspect(rank=r, host=where.get(r, ("", ""))[0], gpu_uuid=where.get(r, ("", ""))[1],
                    fingerprint=fps[r])
            for r in sorted(ranks))

    if n == 1:
        return VoteResult(True, METHOD_SINGLE, 1, (), top_fp)
    if top_count == n:
        return VoteResult(True, METHOD_MAJORITY, n, (), top_fp)
    if n >= 3 and 2 * top_count > n:
        odd = [r for r, fp in fps.items() if fp != top_fp]
        return VoteResult(False, METHOD_MAJORITY, n, suspects_of(odd), top_fp)
    return VoteResult(False, METHOD_ALL_DISAGREEING, n, suspects_of(list(fps)), None)
