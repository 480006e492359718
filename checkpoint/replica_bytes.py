"""Do the bytes each rank saved agree across replicas? Pure: shard manifests in, a verdict out.

A rank's shard manifest names its replica set (`ShardManifest.replica_set`, from the Monitor's replica group
through the step guard: the ranks that must hold bit-identical weights after every update). Every rank of one
set saved the same state, so every tensor of one path must have the same fingerprint (the exact integer
fingerprint of the bytes saved, taken from the host copy after the copy) on every rank of the set. That is
what vouches for the bytes of a checkpoint: not the step number a vote was taken at, but the bytes.

Verdicts:
- AGREED: every replica set of two or more ranks holds identical fingerprints, path for path; ranks with no
  replica (a set of one, or no set named) are listed as unreplicated;
- MISMATCH: some set disagrees: the differing paths and, where a strict majority of the set agrees, the odd
  ranks (with two replicas, or no majority, every rank of the set is odd);
- IMPORTED: a shard came from outside (`sdcwatch ckpt import` of a stock DCP directory): no watched rank
  saved it, no in-step check or replica vote covered the step, so nothing vouches for the bytes beyond their
  checksums from the import on: restorable as COMMITTED, never VERIFIED;
- UNREPLICATED: no rank has a replica (plain FSDP or one rank): the bytes cannot be compared; what vouches
  then is that they are the bytes the rank fingerprinted and checksummed (on CUDA: equal to the GPU's
  fingerprint before the copy) and that the rank's in-step checks reported clean through the step with no
  fault open (checkpoint.policy).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from typing import Iterable

from checkpoint.manifest import ShardManifest

AGREED = "agreed"
MISMATCH = "mismatch"
UNREPLICATED = "unreplicated"
IMPORTED = "imported"               # bytes brought in from outside (ShardManifest.origin): nothing vouches
VOUCHING = (AGREED, UNREPLICATED)   # verdicts that let a checkpoint become VERIFIED
_MAX_PATHS = 8                      # differing paths named in a verdict


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaSet:
    name: str
    ranks: tuple[int, ...]
    tensors: int
    digest: str                     # a short hash of the fingerprints the set agreed on ("" on a mismatch)
    differing: tuple[str, ...] = ()  # tensor paths whose fingerprints differ (at most _MAX_PATHS)
    odd_ranks: tuple[int, ...] = ()  # ranks outside the set's strict majority (all, without one)


@dataclasses.dataclass(frozen=True, slots=True)
class BytesCheck:
    verdict: str
    sets: tuple[ReplicaSet, ...]
    unreplicated: tuple[int, ...]   # ranks whose shard has no replica
    origin: str = ""                # IMPORTED: where the bytes came from

    @property
    def odd_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for s in self.sets for r in s.odd_ranks}))

    def summary(self) -> str:
        """One line for `sdcwatch ckpt show`: which fingerprints vouched (or why none did)."""
        if self.verdict == IMPORTED:
            return (f"bytes imported ({self.origin}): saved by no rank sdcwatch watched, so no in-step check "
                    "or replica vote covers them; checksummed from the import on; restorable, never VERIFIED")
        parts = []
        for s in self.sets:
            ranks = ",".join(map(str, s.ranks))
            if s.differing:
                parts.append(f"replica set {s.name!r} (ranks {ranks}) DIFFERS in {', '.join(s.differing)}"
                             + (f"; odd ranks {','.join(map(str, s.odd_ranks))}" if s.odd_ranks else ""))
            else:
                parts.append(f"replica set {s.name!r} (ranks {ranks}): {s.tensors} tensor fingerprints "
                             f"identical (digest {s.digest})")
        if self.unreplicated:
            parts.append(f"ranks {','.join(map(str, self.unreplicated))} unreplicated: own fingerprints and "
                         "checksums of the saved bytes, in-step checks clean through the step, no open fault")
        return f"bytes {self.verdict}: " + "; ".join(parts)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


def compare(manifests: Iterable[ShardManifest]) -> BytesCheck:
    """The verdict over one checkpoint's shard manifests (one per rank)."""
    by_set: dict[str, list[ShardManifest]] = collections.defaultdict(list)
    alone: list[int] = []
    manifests = list(manifests)
    imported = sorted({m.origin for m in manifests if m.origin})
    if imported:
        return BytesCheck(IMPORTED, (), tuple(sorted(m.rank for m in manifests)), "; ".join(imported)[:512])
    for m in manifests:
        if m.replica_set:
            by_set[m.replica_set].append(m)
        else:
            alone.append(m.rank)
    sets = []
    for name, members in sorted(by_set.items()):
        members.sort(key=lambda m: m.rank)
        if len(members) < 2:
            alone.extend(m.rank for m in members)
            continue
        sets.append(_compare_set(name, members))
    if not sets:
        verdict = UNREPLICATED
    elif any(s.differing for s in sets):
        verdict = MISMATCH
    else:
        verdict = AGREED
    return BytesCheck(verdict, tuple(sets), tuple(sorted(alone)))


def _signature(m: ShardManifest) -> tuple:
    return tuple(sorted((t.path, t.dtype, t.shape, t.fingerprint) for t in m.tensors))


def _compare_set(name: str, members: list[ShardManifest]) -> ReplicaSet:
    ranks = tuple(m.rank for m in members)
    sigs = {m.rank: _signature(m) for m in members}
    counts = collections.Counter(sigs.values())
    top, n = counts.most_common(1)[0]
    if len(counts) == 1:
        digest = hashlib.blake2b(repr(top).encode(), digest_size=8).hexdigest()
        return ReplicaSet(name, ranks, len(top), digest)
    majority = top if n * 2 > len(members) else None
    odd = tuple(r for r in ranks if majority is None or sigs[r] != majority)
    per_path: dict[str, set] = collections.defaultdict(set)
    for m in members:
        for t in m.tensors:
            per_path[t.path].add((t.dtype, t.shape, t.fingerprint))
        for path in {t.path for other in members for t in other.tensors} - {t.path for t in m.tensors}:
            per_path[path].add(("missing on rank", m.rank))
    differing = tuple(sorted(p for p, v in per_path.items() if len(v) > 1))[:_MAX_PATHS]
    return ReplicaSet(name, ranks, len(top), "", differing or ("the tensor list",), odd)
