"""The step log: one JSON line per accepted ReportStep (`step_line`, in `<state>/steps/steps-*.jsonl`), written
off the loop.

The event loop only appends `(request, time)` to a deque (well under a microsecond). A writer thread formats
and writes the records in slices of `SLICE`, releasing the GIL between slices, and flushes every `FLUSH_S`:
- formatting on the request path cost ~24 us of the loop thread per report inside the gRPC server (cold
  caches; 6 us in a tight loop), a fifth of the agent's own work per ReportStep;
- formatting a second of records in one piece on the loop stalled every RPC behind it (~12 ms a second);
- a slice of 8 holds the GIL for ~0.1-0.2 ms (measured in the agent under load on the 2-core VM; slices of 32
  held it 0.5-1.2 ms, which an RPC arriving meanwhile waited out), so the loop never waits long for it.
A full or failing disk loses step records, never a report: the step log is for analysis; the event journal is
the record. Losses are counted exactly (`lost_total`: each record dropped from the queue or from a failed
write of the journal's buffer, `JournalWriteError.lost`; `on_lost` gets each count), logged at most every
`ERROR_EVERY_S`; the journal retries on the next write. Memory is bounded by `MAX_PENDING`.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from daemon.journal import Journal, JournalWriteError
from proto.sdcwatch.v1 import agent_pb2 as pb

log = logging.getLogger(__name__)

SLICE = 8               # records formatted per hold of the GIL
FLUSH_S = 1.0           # the file is flushed this often
WAKE_AT = 1024          # pending records that wake the writer early
MAX_PENDING = 200_000   # records held at most while the disk is stalled; more are dropped (counted)
ERROR_EVERY_S = 60.0    # a failing step log is reported at most this often


class StepLog:
    def __init__(self, journal: Journal, on_lost: Callable[[int], None] | None = None) -> None:
        self.journal = journal
        self.on_lost = on_lost          # e.g. a metric's inc: records lost, as they are counted
        self.lost_total = 0             # records lost since start (queue overflow and failed writes)
        self._pending: collections.deque[tuple[Any, float]] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()   # one writer at a time: the thread, or `drain` at close
        self._thread: threading.Thread | None = None
        self.lost = 0                   # records not written since the last error report
        self.dropped = 0                # records not queued: the writer was MAX_PENDING behind
        self._error_logged = float("-inf")

    def add(self, req: Any, now: float) -> None:
        """Queue one record (the event loop's whole cost of the step log)."""
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1  # reported by the writer
            return
        pending = self._pending
        pending.append((req, now))
        if len(pending) == WAKE_AT:   # once, on the way up: setting the event costs a lock and a notify
            self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sdcwatch-step-log", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the writer, write what is pending, flush and close the file."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
            if self._thread.is_alive():  # stuck in a write (a hung disk): leave it the file, never hang the stop
                log.error("step log: the writer is stuck in a write; %d record(s) not written", len(self._pending))
                return
        self.drain()
        self.journal.close()   # nothing buffered is left: drain flushed it

    def drain(self) -> None:
        """Write every pending record and flush (also called directly at close)."""
        self._write(flush=True)

    def _run(self) -> None:
        last_flush = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            due = time.monotonic() - last_flush >= FLUSH_S
            self._write(flush=due)
            if due:
                last_flush = time.monotonic()

    def _write(self, *, flush: bool) -> None:
        self._report_dropped()
        with self._lock:
            while self._write_slice():
                time.sleep(0)  # let the event loop have the GIL between slices
            if flush:
                try:
                    self.journal.flush()
                except JournalWriteError as exc:
                    self._failed(exc.lost, exc)

    def _write_slice(self) -> bool:
        """Format and write up to SLICE records; False when nothing was pending."""
        pending, append = self._pending, self.journal.append_body
        n = 0
        while n < SLICE and pending:
            req, now = pending.popleft()
            n += 1
            try:
                append(step_line(req, now))
            except JournalWriteError as exc:   # this record and those buffered with it
                self._failed(exc.lost, exc)
            except (OSError, ValueError) as exc:   # a journal that raised on its own: this record
                self._failed(1, exc)
        return n > 0

    def _report_dropped(self) -> None:
        if self.dropped:
            dropped, self.dropped = self.dropped, 0
            self._failed(dropped, RuntimeError(f"the writer fell {MAX_PENDING} records behind"))

    def _failed(self, records: int, exc: Exception) -> None:
        self.lost += records
        self.lost_total += records
        if records and self.on_lost is not None:
            self.on_lost(records)
        now = time.monotonic()
        if now - self._error_logged >= ERROR_EVERY_S:
            log.error("step log: %d record(s) not written since the last report of this: %s", self.lost, exc)
            self._error_logged, self.lost = now, 0


_INF = float("inf")


def _json_number(x: float) -> str:
    """A float as JSON: repr for finite values, a quoted string for NaN and the infinities."""
    return repr(x) if x == x and x not in (_INF, -_INF) else f'"{x}"'


def step_line(req: pb.ReportStepRequest, now: float) -> str:
    """The step-log record of one accepted ReportStep, as a JSON object body without braces (the journal
    adds the sequence number). Formatted directly (4x faster than building a dict for json.dumps): job ids
    and hosts were validated to hold no character JSON would need to escape."""
    parts = [f'"t":{now!r},"job":"{req.job_id}","rank":{req.rank},"step":{req.step}']
    if req.HasField("loss"):
        parts.append(f',"loss":{_json_number(req.loss)}')
    if req.HasField("grad_norm"):
        parts.append(f',"grad_norm":{_json_number(req.grad_norm)}')
    if req.fingerprint:
        parts.append(',"fp":["' + '","'.join([f"{w:016x}" for w in req.fingerprint]) + '"]')
    if req.HasField("vote") and req.vote.checked:
        parts.append(f',"agreed":{"true" if req.vote.agreed else "false"}')
    return "".join(parts)
