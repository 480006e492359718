"""Append-only JSON-lines journal, sequence numbered, rotated by size, resumable across restarts.

Files: `<dir>/<prefix>-<first seq, 12 digits>.jsonl`. Each line is one JSON object whose first key is `seq`.
On open, the newest file's last complete line gives the next sequence number; a torn last line (the agent
was killed mid-write, or the disk filled mid-line) is truncated away, and the seq it held is never reused.
Lines whose seq is not an integer in 1..MAX_SEQ (`{"seq":1e999}`, a string, a number past the wire's range)
are skipped, on open and when read; `repairs` says what open() repaired or skipped (the agent journals it).
Rotation starts a new file when the current one passes `max_bytes`; only the newest `keep_files` are kept.

Writing never leaves the journal broken: lines are buffered here and written with `os.write` (no hidden
buffer that a failed flush leaves half full and a later flush writes anyway). A failed write (disk full,
read-only, EPERM, I/O error) truncates the file back to its last complete line, drops the lines it held and
raises `JournalWriteError` with their exact number (`lost`); the seqs they held are spent, never reused; the
next write tries again, so the journal recovers by itself once the disk does. A failed rotation keeps
writing to the current file.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator

from sdcwatch.errors import FatalError, SdcwatchError

log = logging.getLogger(__name__)

MAX_SEQ = (1 << 62) - 1      # a seq past this is damage (the wire's uint64 holds it with room to spare)
BUFFER_BYTES = 1 << 16       # a buffered journal (flush_each=False) writes once this much is pending
_TORN_SEQ = re.compile(rb'\{"seq":(\d{1,19})[,}]')
_SEQ_PREFIX = b'{"seq":'


class JournalWriteError(SdcwatchError, OSError):
    """Lines were not written (`lost` of them, exactly); the journal stays usable and retries on the next
    write."""

    transient = True

    def __init__(self, message: str, lost: int) -> None:
        super().__init__(message)
        self.lost = lost


class JournalOpenError(FatalError):
    """The journal's directory or newest file cannot be opened for writing (at start)."""


def valid_seq(seq: object) -> bool:
    """A seq as the journal writes them: an int (not a bool, not a float) in 1..MAX_SEQ."""
    return type(seq) is int and 0 < seq <= MAX_SEQ


class Journal:
    def __init__(self, directory: str | Path, *, prefix: str = "events", max_bytes: int = 64 << 20,
                 keep_files: int = 8, flush_each: bool = True) -> None:
        self.dir = Path(directory)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.keep_files = keep_files
        self.flush_each = flush_each
        self.last_seq = 0
        self.repairs: list[str] = []   # what open() truncated or skipped, for the agent to journal
        self.lost = 0                  # lines not written since open (JournalWriteError.lost, summed)
        self._name_re = re.compile(rf"^{re.escape(prefix)}-(\d{{12,19}})\.jsonl$")
        self._fd: int | None = None
        self._size = 0                 # bytes of complete lines in the current file
        self._buf: list[bytes] = []
        self._buf_bytes = 0
        self._resync = False           # a failed write may have left bytes past _size that truncate could not drop

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    # -- files -------------------------------------------------------------------------------------
    def files(self) -> list[Path]:
        """The journal's files, oldest first (names that are not `<prefix>-<digits>.jsonl` are not ours)."""
        try:
            names = [p for p in self.dir.iterdir() if self._name_re.match(p.name)]
        except FileNotFoundError:
            return []
        return sorted(names, key=self._first_seq)

    def _first_seq(self, path: Path) -> int:
        m = self._name_re.match(path.name)
        return int(m.group(1)) if m else 0

    def open(self) -> "Journal":
        """Find the last seq (repairing the newest file's tail) and open the newest file for appending.
        JournalOpenError when the directory or file cannot be written."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            files = self.files()
            for path in reversed(files):
                seq = self._repair_and_last_seq(path)
                if seq:
                    self.last_seq = seq
                    break
            if files:   # never below the newest file's name: its first seq was handed out
                self.last_seq = max(self.last_seq, self._first_seq(files[-1]) - 1)
            self._open_file(files[-1] if files else self._name_for(self.last_seq + 1))
        except OSError as exc:
            raise JournalOpenError(f"cannot open the journal in {self.dir} for writing: {exc.strerror or exc}; "
                                   "make the directory writable by the agent's user (or choose another "
                                   "--state-dir)") from None
        return self

    def _name_for(self, first_seq: int) -> Path:
        return self.dir / f"{self.prefix}-{first_seq:012d}.jsonl"

    def _open_file(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        self._size = os.fstat(fd).st_size
        self._resync = False

    def _repair_and_last_seq(self, path: Path) -> int:
        """The last complete record's seq (or the seq a torn tail held, so it is never reused); truncate a
        torn tail; skip lines whose seq is not valid (noted in `repairs`)."""
        with open(path, "rb+") as fh:
            fh.seek(0, os.SEEK_END)
            end = fh.tell()
            if end == 0:
                return 0
            block = min(end, 1 << 20)
            fh.seek(end - block)
            data = fh.read(block)
            lines = data.split(b"\n")
            tail = lines.pop()  # after the last newline: empty if the file ends cleanly
            torn = 0
            if tail:
                self._repair(f"{path.name}: truncated a torn last line ({len(tail)} bytes)")
                fh.truncate(end - len(tail))
                m = _TORN_SEQ.match(tail)
                if m:
                    torn = int(m.group(1))
                elif _SEQ_PREFIX.startswith(tail) or (tail.startswith(_SEQ_PREFIX) and tail[7:].isdigit()):
                    torn = -1   # it held a seq we cannot read whole: spend the next one
            skipped = 0
            for line in reversed(lines):
                if not line.strip():
                    continue
                seq = _line_seq(line)
                if seq is None:
                    skipped += 1
                    continue
                if skipped:
                    self._repair(f"{path.name}: skipped {skipped} line(s) after seq {seq} without a valid seq")
                return max(seq + (torn == -1), torn if torn <= MAX_SEQ else 0)
            if skipped:
                self._repair(f"{path.name}: skipped {skipped} line(s) without a valid seq")
        return torn if 0 < torn <= MAX_SEQ else 0

    def _repair(self, note: str) -> None:
        log.warning("journal %s: %s", self.dir, note)
        if len(self.repairs) < 16:
            self.repairs.append(note)

    # -- writing -----------------------------------------------------------------------------------
    def append(self, record: dict[str, Any]) -> int:
        """Assign the next seq to `record` (in place), write it, return the seq. JournalWriteError when it
        could not be written (the seq stays spent)."""
        record.pop("seq", None)
        self.last_seq += 1
        try:
            body = json.dumps(record, separators=(",", ":"), default=str)
        except (ValueError, TypeError, RecursionError) as exc:
            raise JournalWriteError(f"journal {self.dir}: a record could not be encoded: {exc}", 1) from None
        finally:
            record["seq"] = self.last_seq
        inner = body[1:-1]
        return self._write(f'{{"seq":{self.last_seq}{"," if inner else ""}{inner}}}\n'.encode())

    def append_body(self, body: str) -> int:
        """Like `append` for a record already formatted as the inside of a JSON object (`"k":v,...`, no
        braces, no "seq"): the fast path for the step log. The caller guarantees it is valid JSON."""
        self.last_seq += 1
        return self._write(f'{{"seq":{self.last_seq},{body}}}\n'.encode())

    def _write(self, line: bytes) -> int:
        if self._fd is None:
            raise JournalWriteError("the journal is closed", 1)
        if self._size + self._buf_bytes + len(line) > self.max_bytes and self._size + self._buf_bytes > 0:
            self._rotate()
        self._buf.append(line)
        self._buf_bytes += len(line)
        if self.flush_each or self._buf_bytes >= BUFFER_BYTES:
            self.flush()
        return self.last_seq

    def flush(self) -> None:
        """Write the buffered lines. JournalWriteError (with the number of lines dropped) when they could not
        be written: the file is cut back to its last complete line."""
        if not self._buf or self._fd is None:
            return
        data = b"".join(self._buf)
        n = len(self._buf)
        self._buf.clear()
        self._buf_bytes = 0
        if self._resync and not self._cut_back():
            data = b"\n" + data   # whatever a failed write left is then a line of its own, skipped by readers
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            self._cut_back()
            self.lost += n
            raise JournalWriteError(f"journal {self.dir}: {n} line(s) not written: {exc.strerror or exc}",
                                    n) from None
        if self._resync:
            self._resync = False
            self._size = os.fstat(self._fd).st_size
        else:
            self._size += len(data)

    def _cut_back(self) -> bool:
        """Drop what a failed write left past the last complete line; False if that may not have worked."""
        assert self._fd is not None
        try:
            if os.fstat(self._fd).st_size != self._size:
                os.ftruncate(self._fd, self._size)
            self._resync = False
        except OSError:
            self._resync = True
        return not self._resync

    def _rotate(self) -> None:
        self.flush()
        try:
            self._open_file(self._name_for(self.last_seq))
        except OSError as exc:   # keep writing to the current file; the next write tries again
            log.warning("journal %s: cannot start a new file (%s); writing on in the current one",
                        self.dir, exc.strerror or exc)
            return
        files = self.files()
        for old in files[: max(0, len(files) - self.keep_files)]:
            try:
                old.unlink()
            except OSError:
                pass

    def close(self) -> None:
        """Flush, fsync and close (a failed write is logged: nothing else can be done at close)."""
        if self._fd is None:
            return
        try:
            self.flush()
            os.fsync(self._fd)
        except OSError as exc:
            log.error("journal %s: closing: %s", self.dir, exc)
        finally:
            os.close(self._fd)
            self._fd = None

    # -- reading -----------------------------------------------------------------------------------
    def read_since(self, since_seq: int, limit: int | None = None) -> Iterator[dict[str, Any]]:
        """Records with seq > since_seq, oldest first, from the files still kept (lines already written;
        lines without a valid seq are skipped)."""
        files = self.files()
        starts = [self._first_seq(p) for p in files]
        first = 0
        for i, start in enumerate(starts):  # skip files that end before since_seq
            if start <= since_seq + 1:
                first = i
        n = 0
        for path in files[first:]:
            try:
                fh = open(path, "rb")
            except FileNotFoundError:   # rotated away meanwhile
                continue
            with fh:
                for line in fh:
                    if not line.endswith(b"\n"):
                        break
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if not isinstance(rec, dict) or not valid_seq(rec.get("seq")):
                        continue
                    if rec["seq"] > since_seq:
                        yield rec
                        n += 1
                        if limit is not None and n >= limit:
                            return


def _line_seq(line: bytes) -> int | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    seq = rec.get("seq") if isinstance(rec, dict) else None
    return seq if valid_seq(seq) else None
