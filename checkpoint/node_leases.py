"""Which nodes' agents are gone, so their copies leave restore plans at once (issue 21 item 6).

Each agent holds a lease in the coordination Redis (`<prefix>nodes`, a hash node -> JSON): it renews it every
third of `lease_s` (`Coordinator.renew_lease`) and marks it gone when it stops cleanly
(`Coordinator.say_goodbye`). Times are the Redis server's (`TIME`), written and compared on one clock, so the
nodes' own clocks never matter. A node is dead when its lease says goodbye or was not renewed for `lease_s`;
a node with no lease at all (an agent from before leases, a test's bare coordinator) is not known to be gone
and keeps its copies; the node asking is never dead to itself.

Pure: no Redis, no clock; the coordinator reads the leases and the server's time and passes them in. A dead
node's copies are only left out of plans, never deleted: when its agent comes back (a restart keeps the
memory tier) and renews its lease, they are planned again.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Mapping

from checkpoint.records import Copy


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    renewed_at: float    # the Redis server's time of the last renewal (or of the goodbye)
    lease_s: float       # how long the renewal holds
    gone: bool = False   # the agent said goodbye (a clean stop)

    def to_json(self) -> str:
        return json.dumps({"renewed_at": self.renewed_at, "lease_s": self.lease_s, "gone": self.gone})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Lease | None":
        """The lease, or None when the text is not one (a damaged field is not proof of death)."""
        try:
            obj = json.loads(text)
            return cls(float(obj["renewed_at"]), float(obj["lease_s"]), bool(obj.get("gone", False)))
        except (ValueError, TypeError, KeyError):
            return None


def dead_nodes(leases: Mapping[str, Lease | None], now: float, me: str = "") -> set[str]:
    """The nodes known gone at `now` (the Redis server's time): goodbye said, or the lease ran out."""
    return {node for node, lease in leases.items()
            if node != me and lease is not None and (lease.gone or now - lease.renewed_at > lease.lease_s)}


def live_copies(copies: Iterable[Copy], dead: set[str]) -> tuple[Copy, ...]:
    """`copies` without the memory copies of dead nodes (a shared tier's copy, S3, is no node's memory)."""
    return tuple(c for c in copies if not (c.tier == "memory" and c.node in dead))
