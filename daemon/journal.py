"""Append-only JSON-lines journal, sequence numbered, rotated by size, resumable across restarts.

Files: `<dir>/<prefix>-<first seq, 12 digits>.jsonl`. Each line is one JSON object with at least `seq`.
On open, the newest file's last complete line gives the next sequence number; a torn last line (the agent
was killed mid-write) is truncated away. Rotation starts a new file when the current one passes
`max_bytes`; only the newest `keep_files` files are kept.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)


class Journal:
    def __init__(self, directory: str | Path, *, prefix: str = "events", max_bytes: int = 64 << 20,
                 keep_files: int = 8, flush_each: bool = True) -> None:
        self.dir = Path(directory)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.keep_files = keep_files
        self.flush_each = flush_each
        self.last_seq = 0
        self._fh: Any = None
        self._size = 0

    @property
    def is_open(self) -> bool:
        return self._fh is not None

    # -- files -------------------------------------------------------------------------------------
    def files(self) -> list[Path]:
        return sorted(self.dir.glob(f"{self.prefix}-*.jsonl"))

    def open(self) -> "Journal":
        self.dir.mkdir(parents=True, exist_ok=True)
        files = self.files()
        for path in reversed(files):
            seq = self._repair_and_last_seq(path)
            if seq:
                self.last_seq = seq
                break
        if files:
            self._open_file(files[-1])
        else:
            self._open_file(self._name_for(self.last_seq + 1))
        return self

    def _name_for(self, first_seq: int) -> Path:
        return self.dir / f"{self.prefix}-{first_seq:012d}.jsonl"

    def _open_file(self, path: Path) -> None:
        self._fh = open(path, "ab", buffering=1 << 16)
        self._size = self._fh.tell()

    @staticmethod
    def _repair_and_last_seq(path: Path) -> int:
        """The last complete record's seq; truncate a torn tail."""
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
            if tail:
                log.warning("journal %s: truncating a torn last line (%d bytes)", path, len(tail))
                fh.truncate(end - len(tail))
            for line in reversed(lines):
                if not line.strip():
                    continue
                try:
                    return int(json.loads(line)["seq"])
                except (ValueError, KeyError, TypeError):
                    continue
        return 0

    # -- writing -----------------------------------------------------------------------------------
    def append(self, record: dict[str, Any]) -> int:
        """Assign the next seq to `record` (in place), write it, return the seq."""
        self.last_seq += 1
        record["seq"] = self.last_seq
        return self._write((json.dumps(record, separators=(",", ":"), default=str) + "\n").encode())

    def append_body(self, body: str) -> int:
        """Like `append` for a record already formatted as the inside of a JSON object (`"k":v,...`, no
        braces, no "seq"): the fast path for the step log. The caller guarantees it is valid JSON."""
        self.last_seq += 1
        return self._write(f'{{"seq":{self.last_seq},{body}}}\n'.encode())

    def _write(self, line: bytes) -> int:
        if self._size + len(line) > self.max_bytes and self._size > 0:
            self._rotate()
        self._fh.write(line)
        self._size += len(line)
        if self.flush_each:
            self._fh.flush()
        return self.last_seq

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def _rotate(self) -> None:
        self._fh.close()
        self._open_file(self._name_for(self.last_seq))
        files = self.files()
        for old in files[: max(0, len(files) - self.keep_files)]:
            try:
                old.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    # -- reading -----------------------------------------------------------------------------------
    def read_since(self, since_seq: int, limit: int | None = None) -> Iterator[dict[str, Any]]:
        """Records with seq > since_seq, oldest first, from the files still kept."""
        self.flush()
        files = self.files()
        starts = [int(p.stem.rsplit("-", 1)[1]) for p in files]
        first = 0
        for i, start in enumerate(starts):  # skip files that end before since_seq
            if start <= since_seq + 1:
                first = i
        n = 0
        for path in files[first:]:
            with open(path, "rb") as fh:
                for line in fh:
                    if not line.endswith(b"\n"):
                        break
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if rec.get("seq", 0) > since_seq:
                        yield rec
                        n += 1
                        if limit is not None and n >= limit:
                            return
