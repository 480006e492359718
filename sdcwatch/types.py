"""The vocabulary shared by probes, detectors and the agent: states, severities, evidence, findings.

The integer values of `State` and `Severity` equal the `sdcwatch.v1` proto enums, so converting is
`pb.State.Value(...)`-free: `int(state)`.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from sdcwatch.event_kinds import EventKind
from sdcwatch.severity import Severity

__all__ = ["State", "worst", "Severity", "Evidence", "Finding"]


class State(enum.IntEnum):
    """A GPU's (or the node's) state. Values match proto `sdcwatch.v1.State`."""

    HEALTHY = 1
    SUSPECT = 2
    DEGRADED = 3
    FAILED = 4
    UNKNOWN = 5

    @property
    def badness(self) -> int:
        """Order for 'worst of': HEALTHY < UNKNOWN < SUSPECT < DEGRADED < FAILED."""
        return _BADNESS[self]


_BADNESS = {State.HEALTHY: 0, State.UNKNOWN: 1, State.SUSPECT: 2, State.DEGRADED: 3, State.FAILED: 4}


def worst(states: "list[State] | tuple[State, ...]", default: State = State.UNKNOWN) -> State:
    """The worst state of a collection (`default` when empty)."""
    return max(states, key=lambda s: s.badness) if states else default


@dataclasses.dataclass(frozen=True, slots=True)
class Evidence:
    """One fact behind a GPU's state.

    `key` (source, signal) identifies the fact: a newer reading of the same fact replaces the older.
    `expires` (unix seconds, or None for 'until cleared by newer evidence or an operator') lets
    windowed rules age out without latching forever.
    """

    source: str
    signal: str
    value: str
    implies: State
    reason: str
    time: float
    count: int = 1
    expires: float | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.source, self.signal)


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """Something a probe or detector wants journaled as an event (the agent assigns seq and time).
    `kind` is a member of the catalogue (sdcwatch/event_kinds.py), never a string."""

    kind: EventKind
    severity: Severity
    subject: str
    message: str
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.kind, str):
            raise TypeError(f"Finding kind {self.kind!r}: pass the sdcwatch.event_kinds member, not its name")
        self.kind.check(self.severity, self.subject)
