"""The agent's event bus: journal first, then memory ring, watchers, Redis stream and metrics.

`publish(kind, subject, message, details)` takes a member of the catalogue (sdcwatch/event_kinds.py) and
refuses anything else; it runs on the event loop thread (use `publish_threadsafe()` from other threads).
Repeats are folded here, by the kind's `fold_s` (daemon/event_fold.py): `tick()` publishes the counts of
closed windows, `flush_folds()` the rest at shutdown. An event is durable in the journal before anyone
sees it. `watch(since_seq)` yields every event with a larger seq,
from memory when it is still there and from the journal files otherwise, so a client that reconnects
with its last seq misses nothing the journal still holds. Memory is bounded: a ring of the newest
events, and a bounded queue to the Redis stream (overflow is counted, never blocks).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from typing import Any, AsyncIterator, Callable, Mapping, Protocol

from daemon.event_fold import REPEATS, Occurrence, RepeatFolder
from daemon.journal import Journal
from sdcwatch.event_kinds import EventKind, UnknownEventKind, is_member
from sdcwatch.types import Finding, Severity

log = logging.getLogger(__name__)

SEVERITY_NAMES = {Severity.INFO: "info", Severity.WARNING: "warning", Severity.CRITICAL: "critical"}
SEVERITY_BY_NAME = {v: k for k, v in SEVERITY_NAMES.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    seq: int
    time: float
    kind: str
    severity: Severity
    subject: str
    message: str
    details: Mapping[str, Any]
    host: str = ""

    @property
    def occurrences(self) -> int:
        """How many occurrences this event stands for (its `repeats` when repeats were folded into it)."""
        n = self.details.get(REPEATS, 1)
        return n if isinstance(n, int) and n >= 1 else 1

    def to_record(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.time, "kind": self.kind,
                "severity": SEVERITY_NAMES[self.severity], "subject": self.subject,
                "message": self.message, "details": dict(self.details), "host": self.host}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> "Event":
        return cls(seq=int(rec["seq"]), time=float(rec.get("time", 0.0)), kind=str(rec.get("kind", "")),
                   severity=SEVERITY_BY_NAME.get(rec.get("severity", "info"), Severity.INFO),
                   subject=str(rec.get("subject", "")), message=str(rec.get("message", "")),
                   details=rec.get("details") or {}, host=str(rec.get("host", "")))


class Publisher(Protocol):
    """What a component that journals events needs of the bus (EventBus is the agent's)."""

    def publish(self, kind: EventKind, subject: str, message: str, details: Mapping[str, Any] | None = None,
                *, severity: Severity | None = None) -> "Event | None": ...

    def publish_finding(self, finding: Finding) -> "Event | None": ...


class EventBus:
    def __init__(self, journal: Journal, *, ring_size: int = 10_000, host: str = "",
                 clock: Callable[[], float] = time.time,
                 on_event: Callable[[Event], None] | None = None,
                 stream_queue_size: int = 10_000) -> None:
        self.journal = journal
        self.host = host
        self.clock = clock
        self.on_event = on_event  # metrics hook; must not raise
        self._ring: collections.deque[Event] = collections.deque(maxlen=ring_size)
        self._cond: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stream_queue: asyncio.Queue[Event] | None = None
        self._stream_queue_size = stream_queue_size
        self.stream_dropped = 0
        self.closed = False
        self.folder = RepeatFolder()

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._cond = asyncio.Condition()
        self.stream_queue = asyncio.Queue(maxsize=self._stream_queue_size)

    @property
    def last_seq(self) -> int:
        return self.journal.last_seq

    def publish(self, kind: EventKind, subject: str, message: str, details: Mapping[str, Any] | None = None,
                *, severity: Severity | None = None) -> Event | None:
        """Journal one event of a catalogue kind (severity: the kind's own unless given, and one it allows).
        Returns the event, or None when it was folded into a repeat count (the kind's `fold_s`).
        Raises UnknownEventKind for anything that is not a catalogue member, ValueError for a severity or
        subject the kind does not allow."""
        if not is_member(kind):
            raise UnknownEventKind(f"publish({kind!r}): not a member of the event catalogue "
                                   "(pass a sdcwatch.event_kinds member, e.g. event_kinds.REPLICA_MISMATCH)")
        sev = kind.severity if severity is None else Severity(severity)
        kind.check(sev, subject)
        occ = Occurrence(kind, sev, subject, message, dict(details or {}))
        if not kind.fold_s:
            return self._append(occ)
        out = self.folder.offer(occ, self.clock())
        events = [self._append(o) for o in out]   # a closed window's count first, then this one (if not folded)
        return events[-1] if out and out[-1] is occ else None

    def publish_finding(self, finding: Finding) -> Event | None:
        return self.publish(finding.kind, finding.subject, finding.message, finding.details,
                            severity=finding.severity)

    def publish_threadsafe(self, kind: EventKind, subject: str, message: str,
                           details: Mapping[str, Any] | None = None, *, severity: Severity | None = None) -> None:
        if not is_member(kind):  # refuse in the caller's thread, where the bug is
            raise UnknownEventKind(f"publish_threadsafe({kind!r}): not a member of the event catalogue")
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(functools.partial(self.publish, kind, subject, message, details,
                                                          severity=severity))

    def tick(self) -> list[Event]:
        """Publish the repeat counts of the fold windows that have closed (call it every second or so)."""
        return [self._append(o) for o in self.folder.due(self.clock())]

    def flush_folds(self) -> list[Event]:
        """Publish every pending repeat count now (at shutdown, before the journal closes)."""
        return [self._append(o) for o in self.folder.flush()]

    def _append(self, occ: Occurrence) -> Event:
        now = self.clock()
        kind = occ.kind.name
        record = {"time": now, "kind": kind, "severity": SEVERITY_NAMES[occ.severity],
                  "subject": occ.subject, "message": occ.message, "details": occ.details, "host": self.host}
        seq = self.journal.append(record)
        event = Event(seq=seq, time=now, kind=kind, severity=occ.severity, subject=occ.subject,
                      message=occ.message, details=occ.details, host=self.host)
        self._ring.append(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a metrics bug must not lose events
                log.exception("event hook failed")
        if self.stream_queue is not None:
            try:
                self.stream_queue.put_nowait(event)
            except asyncio.QueueFull:
                self.stream_dropped += 1
        if self._cond is not None and self._loop is not None:
            self._loop.create_task(self._notify())
        log.log(_LEVEL[event.severity], "event %d %s %s: %s", seq, kind, occ.subject, occ.message)
        return event

    async def _notify(self) -> None:
        assert self._cond is not None
        async with self._cond:
            self._cond.notify_all()

    async def close(self) -> None:
        self.closed = True
        if self._cond is not None:
            await self._notify()

    def recent(self, since_seq: int) -> list[Event] | None:
        """Events with seq > since_seq from memory; None if memory no longer reaches back that far."""
        ring = self._ring
        if not ring:
            return [] if since_seq >= self.journal.last_seq else None
        if since_seq + 1 < ring[0].seq:
            return None
        # ring is sorted by seq and contiguous: index arithmetic
        start = max(0, since_seq + 1 - ring[0].seq)
        return [ring[i] for i in range(start, len(ring))]

    async def watch(self, since_seq: int, follow: bool) -> AsyncIterator[Event]:
        """Every event with seq > since_seq (oldest first); with follow, then new ones as they come."""
        assert self._cond is not None, "bind_loop() first"
        last = since_seq
        while True:
            batch = self.recent(last)
            if batch is None:  # fell out of memory: read the journal files (off the loop)
                records = await asyncio.to_thread(lambda: list(self.journal.read_since(last, limit=1000)))
                batch = [Event.from_record(r) for r in records]
                if not batch:  # nothing older kept on disk: jump to memory
                    ring_first = self._ring[0].seq if self._ring else self.journal.last_seq + 1
                    last = max(last, ring_first - 1)
                    continue
            for event in batch:
                yield event
                last = event.seq
            if batch:
                continue
            if not follow or self.closed:
                return
            async with self._cond:
                await self._cond.wait_for(lambda: self.journal.last_seq > last or self.closed)
            if self.closed and self.journal.last_seq <= last:
                return


_LEVEL = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.CRITICAL: logging.ERROR}
