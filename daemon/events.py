"""The agent's event bus: journal first, then memory ring, watchers, Redis stream and metrics.

`publish(kind, subject, message, details)` takes a member of the catalogue (sdcwatch/event_kinds.py) and
refuses anything else (in the caller's thread); called from another thread while the loop runs (the
checkpoint service's pools and the drainer hand it `publish`), it has the loop publish the event, so events
reach the ring and the watchers in seq order and the loop's structures are touched by the loop alone.
Repeats are folded here, by the kind's `fold_s` (daemon/event_fold.py): `tick()` publishes the counts of
closed windows, `flush_folds()` the rest at shutdown. An event is written to the journal before anyone
sees it. `watch(since_seq)` yields every event with a larger seq, from memory when it is still there and
from the journal files otherwise, so a client that reconnects with its last seq misses nothing the journal
still holds. Memory is bounded: a ring of the newest events, and a bounded queue to the Redis stream
(overflow is counted, never blocks).

A journal that cannot be written never stops the bus (nor the caller: `publish` does not raise for it): the
event keeps its seq and goes on from memory (ring, watchers, stream, alerts); the loss is counted and, once
writes work again, journaled as one `journal.write_failed` event. A watcher that cannot be given some events
(lost to such a failure, or rotated out of the kept files) gets one `events.skipped` event in their place
(from_seq..to_seq, seq = to_seq): it is told, never silently skipped. Watchers are woken together, at most
every `FANOUT_S` (one wake-up per batch of events, not one task per event per watcher), and at most
`max_watchers` follow at once (`TooManyWatchers` beyond).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Mapping, Protocol

from daemon.event_fold import REPEATS, Occurrence, RepeatFolder
from daemon.journal import Journal, JournalWriteError
from daemon.pools import WorkPool
from sdcwatch import event_kinds as ek
from sdcwatch.errors import SdcwatchError
from sdcwatch.event_kinds import EventKind, UnknownEventKind, is_member
from sdcwatch.types import Finding, Severity

log = logging.getLogger(__name__)

SEVERITY_NAMES = {Severity.INFO: "info", Severity.WARNING: "warning", Severity.CRITICAL: "critical"}
SEVERITY_BY_NAME = {v: k for k, v in SEVERITY_NAMES.items()}
FANOUT_S = 0.02            # watchers are woken at most this often (one wake-up for every event meanwhile)
MAX_WATCHERS = 1024        # following watchers at once
JOURNAL_ERROR_EVERY_S = 60.0


class TooManyWatchers(SdcwatchError):
    """`max_watchers` watchers are following already."""

    transient = True


class JournalReadTimeout(SdcwatchError):
    """A watcher's read of the journal files did not finish in time (a hung disk): gRPC UNAVAILABLE."""

    transient = True


class WatchAhead(SdcwatchError):
    """A watcher asked for events after a seq this agent has not reached (gRPC OUT_OF_RANGE): its since_seq
    came from before a restart whose journal lost its tail, or from another agent. Answered at once, never
    waited on: the seqs it expects would be given to other events."""

    def __init__(self, since_seq: int, last_seq: int) -> None:
        super().__init__(f"since_seq {since_seq} is ahead of this agent's newest event (seq {last_seq}): the "
                         f"events it counts on do not exist here (the agent restarted with a journal that lost "
                         f"its tail, or this is another agent); watch again with since_seq={last_seq} (from now "
                         f"on) or 0 (everything kept)")
        self.since_seq = since_seq
        self.last_seq = last_seq


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
        when = rec.get("time", 0.0)
        return cls(seq=int(rec["seq"]), time=float(when) if isinstance(when, (int, float)) else 0.0,
                   kind=str(rec.get("kind", "")),
                   severity=SEVERITY_BY_NAME.get(str(rec.get("severity", "info")), Severity.INFO),
                   subject=str(rec.get("subject", "")), message=str(rec.get("message", "")),
                   details=details if isinstance(details := rec.get("details"), dict) else {},
                   host=str(rec.get("host", "")))


class Publisher(Protocol):
    """What a component that journals events needs of the bus (EventBus is the agent's)."""

    def publish(self, kind: EventKind, subject: str, message: str, details: Mapping[str, Any] | None = None,
                *, severity: Severity | None = None) -> "Event | None": ...

    def publish_finding(self, finding: Finding) -> "Event | None": ...


class EventBus:
    def __init__(self, journal: Journal, *, ring_size: int = 10_000, host: str = "",
                 clock: Callable[[], float] = time.time,
                 on_event: Callable[[Event], None] | None = None,
                 stream_queue_size: int = 10_000, max_watchers: int = MAX_WATCHERS,
                 on_journal_lost: Callable[[int], None] | None = None,
                 read_pool: WorkPool | None = None, read_timeout_s: float = 30.0) -> None:
        self.journal = journal
        # watchers' journal reads: their own pool (never asyncio's shared default executor), each bounded
        self.read_pool = read_pool or WorkPool("journal-reads", workers=2)
        self.read_timeout_s = read_timeout_s
        self.host = host
        self.clock = clock
        self.on_event = on_event  # metrics hook; must not raise
        self.on_journal_lost = on_journal_lost  # metrics hook: events not journaled (their number)
        self._ring: collections.deque[Event] = collections.deque(maxlen=ring_size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._direct = threading.RLock()   # publishing outside a running loop (start-up, shutdown): one at a time
        self._wake: asyncio.Future[None] | None = None   # resolved to wake every waiting watcher at once
        self._wake_due = False
        self._waiting = 0
        self.watchers = 0
        self.max_watchers = max_watchers
        self.stream_queue: asyncio.Queue[Event] | None = None
        self._stream_queue_size = stream_queue_size
        self.stream_dropped = 0
        self.closed = False
        self.folder = RepeatFolder()
        self.journal_lost = 0                      # events not journaled, since start
        self._unjournaled: list[int] = []         # [first seq, last seq, count] of the current failure
        self._unjournaled_error = ""
        self._journal_error_logged = float("-inf")
        self._reporting_loss = False

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.stream_queue = asyncio.Queue(maxsize=self._stream_queue_size)
        if self.journal.repairs:
            self.publish(ek.JOURNAL_REPAIRED, "node", f"the journal needed repair at start: "
                         f"{'; '.join(self.journal.repairs)}", {"repairs": list(self.journal.repairs)})
            self.journal.repairs.clear()

    @property
    def last_seq(self) -> int:
        return self.journal.last_seq

    def publish(self, kind: EventKind, subject: str, message: str, details: Mapping[str, Any] | None = None,
                *, severity: Severity | None = None) -> Event | None:
        """Journal one event of a catalogue kind (severity: the kind's own unless given, and one it allows).
        Returns the event, or None when it was folded into a repeat count (the kind's `fold_s`).
        Raises UnknownEventKind for anything that is not a catalogue member, ValueError for a severity or
        subject the kind does not allow. Never raises because the journal cannot be written."""
        if not is_member(kind):
            raise UnknownEventKind(f"publish({kind!r}): not a member of the event catalogue "
                                   "(pass a sdcwatch.event_kinds member, e.g. event_kinds.REPLICA_MISMATCH)")
        sev = kind.severity if severity is None else Severity(severity)
        kind.check(sev, subject)
        occ = Occurrence(kind, sev, subject, message, dict(details or {}))
        loop = self._loop
        if loop is not None and loop.is_running() and not self._on_loop(loop):
            # another thread (the checkpoint service's pools, the drainer): the loop publishes it, in order.
            # Published here, two threads' events could reach the ring out of seq order (a watcher then
            # reported the earlier one as lost: `events.skipped`), and the loop's own structures are not
            # thread-safe. Such a caller gets None (the event is published a moment later).
            try:
                loop.call_soon_threadsafe(self._publish_occ, occ)
                return None
            except RuntimeError:    # the loop closed meanwhile: publish here
                pass
        with self._direct:
            return self._publish_occ(occ)

    @staticmethod
    def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
        try:
            return asyncio.get_running_loop() is loop
        except RuntimeError:
            return False

    def _publish_occ(self, occ: Occurrence) -> Event | None:
        if not occ.kind.fold_s:
            return self._append(occ)
        out = self.folder.offer(occ, self.clock())
        events = [self._append(o) for o in out]   # a closed window's count first, then this one (if not folded)
        return events[-1] if out and out[-1] is occ else None

    def publish_finding(self, finding: Finding) -> Event | None:
        return self.publish(finding.kind, finding.subject, finding.message, finding.details,
                            severity=finding.severity)

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
        try:
            seq = self.journal.append(record)
        except JournalWriteError as exc:   # the seq is spent; the event goes on from memory
            seq = self.journal.last_seq
            self._not_journaled(seq, exc)
        else:
            if self._unjournaled and not self._reporting_loss:
                self._report_loss()
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
        if self._waiting and not self._wake_due and self._loop is not None:
            self._wake_due = True   # one wake-up for every event until it runs
            self._loop.call_later(FANOUT_S, self._fan_out)
        log.log(_LEVEL[event.severity], "event %d %s %s: %s", seq, kind, occ.subject, _escape(occ.message))
        return event

    def _not_journaled(self, seq: int, exc: Exception) -> None:
        self.journal_lost += 1
        if self._unjournaled:
            self._unjournaled[1] = seq
            self._unjournaled[2] += 1
        else:
            self._unjournaled = [seq, seq, 1]
        self._unjournaled_error = str(exc)
        if self.on_journal_lost is not None:
            try:
                self.on_journal_lost(1)
            except Exception:
                log.exception("journal-loss hook failed")
        now = time.monotonic()
        if now - self._journal_error_logged >= JOURNAL_ERROR_EVERY_S:
            self._journal_error_logged = now
            log.error("event %d not journaled (%s); events go on from memory and the journal retries on each "
                      "event", seq, exc)

    def _report_loss(self) -> None:
        """The journal works again: journal what it missed, as one event."""
        first, last, count = self._unjournaled
        self._unjournaled = []
        self._reporting_loss = True
        try:
            self.publish(ek.JOURNAL_WRITE_FAILED, "node",
                         f"{count} event(s) (seq {first}..{last}) were not written to the journal: "
                         f"{self._unjournaled_error}; watchers, the Redis stream and alerts had them from memory",
                         {"count": count, "from_seq": first, "to_seq": last, "error": self._unjournaled_error})
        finally:
            self._reporting_loss = False

    def _fan_out(self) -> None:
        self._wake_due = False
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _wait_for_more(self, last: int) -> None:
        """Until an event after `last` exists or the bus closes (woken with every other watcher)."""
        if self.last_seq > last or self.closed:
            return
        assert self._loop is not None, "bind_loop() first"
        if self._wake is None or self._wake.done():
            self._wake = self._loop.create_future()
        self._waiting += 1
        try:
            await asyncio.shield(self._wake)   # shielded: one watcher's cancellation is not everyone's wake-up
        finally:
            self._waiting -= 1

    async def close(self) -> None:
        self.closed = True
        self._fan_out()

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

    def skipped(self, first: int, last: int, why: str) -> Event:
        """The `events.skipped` event a watcher gets in place of events first..last (never journaled)."""
        return Event(seq=last, time=self.clock(), kind=ek.EVENTS_SKIPPED.name, severity=Severity.WARNING,
                     subject="node", message=f"events {first}..{last} cannot be sent: {why}",
                     details={"from_seq": first, "to_seq": last, "count": last - first + 1, "reason": why},
                     host=self.host)

    async def watch(self, since_seq: int, follow: bool) -> AsyncIterator[Event]:
        """Every event with seq > since_seq (oldest first); with follow, then new ones as they come. Events
        that cannot be sent (not journaled, rotated away) come as one `events.skipped` event (`skipped`); with
        since_seq 0 ("from the oldest kept") what was rotated away before the oldest kept is not a gap.
        TooManyWatchers when `max_watchers` follow already; WatchAhead, before anything is sent, when
        since_seq is past the newest seq (it would otherwise wait, silently, for seqs that mean other events)."""
        assert self._loop is not None, "bind_loop() first"
        if since_seq > self.last_seq:
            raise WatchAhead(since_seq, self.last_seq)
        if follow and self.watchers >= self.max_watchers:
            raise TooManyWatchers(f"{self.watchers} watchers follow the events already (the limit); retry later")
        self.watchers += follow
        try:
            async for event in self._watch(since_seq, follow):
                yield event
        finally:
            self.watchers -= follow

    async def _watch(self, since_seq: int, follow: bool) -> AsyncIterator[Event]:
        last = since_seq
        while True:
            batch = self.recent(last)
            if batch is None:  # fell out of memory: read the journal files (off the loop)
                batch = await self._from_journal(last)
                if not batch:  # nothing newer kept on disk: jump to memory
                    ring_first = self._ring[0].seq if self._ring else self.journal.last_seq + 1
                    if ring_first - 1 > last:
                        if last > 0:
                            yield self.skipped(last + 1, ring_first - 1, "not in the journal files kept")
                        last = ring_first - 1
                    continue
            for event in batch:
                if event.seq > last + 1 and last > 0:
                    yield self.skipped(last + 1, event.seq - 1, "not in the journal (a write failed, or the "
                                       "file was rotated away)")
                yield event
                last = event.seq
            if batch:
                continue
            if not follow or self.closed:
                return
            await self._wait_for_more(last)
            if self.closed and self.journal.last_seq <= last:
                return

    async def _from_journal(self, last: int) -> list[Event]:
        def read() -> list[dict[str, Any]]:
            try:
                return list(self.journal.read_since(last, limit=1000))
            except OSError as exc:
                log.warning("reading the journal for a watcher failed: %s", exc)
                return []

        try:
            records = await asyncio.wait_for(self.read_pool.run(read), self.read_timeout_s)
        except asyncio.TimeoutError:
            raise JournalReadTimeout(f"reading the journal took over {self.read_timeout_s:.0f}s "
                                     f"({self.read_pool.describe()}); retry later") from None
        return [Event.from_record(r) for r in records]


def _escape(text: str) -> str:
    """A client's string in a log line: newlines and other control characters escaped, so it cannot forge
    lines."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


_LEVEL = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.CRITICAL: logging.ERROR}
