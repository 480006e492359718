"""Repeat folding (pure): one event per (kind, subject, window), by the catalogue's `fold_s`.

The key is (kind, subject) plus the kind's `fold_by` details (e.g. the XID number). An occurrence whose
details carry `repeats` already stands for that many (a batch of XIDs). The first occurrence of a key is
published at once and opens a window of the kind's
`fold_s` seconds. Later occurrences inside the window are counted, not published. When the window closes
(`due(now)`, or the next `offer` after it), the folded occurrences become one event: the last one's message
and details, the worst severity among them, and `repeats` (how many occurrences it stands for) in its
details. A window that folded something is followed at once by the next window, so a steady stream (a
replica mismatch on every step) gives one event per window; a window that folded nothing just ends, and the
next occurrence is again published at once. Kinds with `fold_s` 0 pass straight through.

No clock and no I/O: `offer` and `due` take `now`; `daemon.events.EventBus` is the shell that publishes
what they return. Memory is bounded by `max_keys` open windows (the one closing soonest is flushed early).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from sdcwatch.event_kinds import REPEATS, EventKind
from sdcwatch.types import Severity



@dataclasses.dataclass(frozen=True, slots=True)
class Occurrence:
    """One event to publish (as offered, or the summary of a closed window)."""

    kind: EventKind
    severity: Severity
    subject: str
    message: str
    details: Mapping[str, Any]


@dataclasses.dataclass(slots=True)
class _Window:
    until: float
    folded: int = 0
    last: Occurrence | None = None
    severity: Severity = Severity.INFO


class RepeatFolder:
    """Lifecycle: `offer(occurrence, now)` for every event (returns what to publish now, in order) ->
    `due(now)` periodically (the summaries of closed windows) -> `flush()` at shutdown (every summary)."""

    def __init__(self, max_keys: int = 4096) -> None:
        if max_keys < 1:
            raise ValueError(f"RepeatFolder max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._windows: dict[tuple[str, ...], _Window] = {}

    def __len__(self) -> int:
        return len(self._windows)

    def offer(self, occ: Occurrence, now: float) -> list[Occurrence]:
        window_s = occ.kind.fold_s
        if window_s <= 0:
            return [occ]
        key = (occ.kind.name, occ.subject, *(str(occ.details.get(k, "")) for k in occ.kind.fold_by))
        out: list[Occurrence] = []
        w = self._windows.get(key)
        if w is not None and now >= w.until:
            out += self._close(key, w, now)
            w = self._windows.get(key)
        if w is None:
            if len(self._windows) >= self.max_keys:
                soonest = min(self._windows, key=lambda k: self._windows[k].until)
                out += self._summary(soonest, self._windows.pop(soonest))
            self._windows[key] = _Window(until=now + window_s)
            out.append(occ)
            return out
        w.folded += int(occ.details.get(REPEATS, 1))   # an occurrence may already stand for several
        w.last = occ
        if occ.severity > w.severity:
            w.severity = occ.severity
        return out

    def due(self, now: float) -> list[Occurrence]:
        """The summaries of the windows closed by `now` (oldest window first)."""
        out: list[Occurrence] = []
        for key in sorted((k for k, w in self._windows.items() if now >= w.until),
                          key=lambda k: self._windows[k].until):
            out += self._close(key, self._windows[key], now)
        return out

    def flush(self) -> list[Occurrence]:
        """Every pending summary, windows forgotten (the agent is stopping)."""
        out: list[Occurrence] = []
        for key, w in list(self._windows.items()):
            out += self._summary(key, w)
        self._windows.clear()
        return out

    def _close(self, key: tuple[str, ...], w: _Window, now: float) -> list[Occurrence]:
        """Close `w` (and the empty windows after it up to `now`); a window that folded something is
        followed by the next one."""
        if not w.folded:
            del self._windows[key]
            return []
        out = self._summary(key, w)
        assert w.last is not None
        window_s = w.last.kind.fold_s
        nxt = w.until + window_s
        if now >= nxt:   # the following window has passed too, empty: the stream stopped
            del self._windows[key]
        else:
            self._windows[key] = _Window(until=nxt)
        return out

    @staticmethod
    def _summary(key: tuple[str, ...], w: _Window) -> list[Occurrence]:
        if not w.folded or w.last is None:
            return []
        last = w.last
        n = w.folded
        message = (f"{last.message} [{last.kind.name} x{n} on {last.subject} within {last.kind.fold_s:g}s, "
                   f"folded into this event]") if n > 1 else last.message
        return [Occurrence(last.kind, w.severity, last.subject, message,
                           {**dict(last.details), REPEATS: n})]
