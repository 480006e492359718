"""`FaultyStore`: a BlobStore wrapper that injects faults into one hop (tests), wrapped around a tier's
store from outside: the drainer never knows it is there.

    store = FaultyStore(DirStore(d), [Fault("put", "fail", nth=2, error=OSError(errno.ENOSPC, "full"))])

Kinds: `fail` (raise `error`, default EIO), `truncate` (a put stores only the first half of the bytes; a read
returns half), `flip` (one bit flipped at `offset` of the bytes passing through: written by a put, or
returned by a read), `hang` (block until `release()` or `hang_s`). A fault fires on calls nth..nth+times-1
of `op` (1-based; `times=0`: from nth on forever; `op="*"`: any operation).
"""
from __future__ import annotations

import dataclasses
import errno
import threading
from typing import Any

from checkpoint.blobstore import BlobStore, Data, as_buffers

KINDS = ("fail", "truncate", "flip", "hang")


@dataclasses.dataclass
class Fault:
    op: str
    kind: str
    nth: int = 1
    times: int = 1
    error: BaseException | None = None
    offset: int = 0
    hang_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if self.nth < 1 or self.times < 0:
            raise ValueError(f"fault nth must be >= 1 and times >= 0, got nth={self.nth} times={self.times}")

    def fires(self, n: int) -> bool:
        return n >= self.nth and (self.times == 0 or n < self.nth + self.times)


class FaultyStore:
    # Not a directory store as far as readers know: the drainer maps a store's files directly when it has a
    # `root` (checkpoint/drainer.py `_mapped`), which would let reads bypass the injected faults.
    root = None

    def __init__(self, inner: BlobStore, faults: list[Fault] | None = None) -> None:
        self.inner = inner
        self.faults = list(faults or [])
        self.calls: dict[str, int] = {}
        self.fired: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._release = threading.Event()

    def __getattr__(self, name: str) -> Any:   # sweep_temp, purge, path, location... pass through
        return getattr(self.inner, name)

    def release(self) -> None:
        """Let every hung call return (it then fails with TimeoutError)."""
        self._release.set()

    def _fault(self, op: str) -> Fault | None:
        with self._lock:
            n = self.calls[op] = self.calls.get(op, 0) + 1
            for f in self.faults:
                if (f.op == op or f.op == "*") and f.fires(n):
                    self.fired.append((op, f.kind, n))
                    return f
        return None

    def _pre(self, f: Fault | None) -> None:
        if f is None:
            return
        if f.kind == "fail":
            raise f.error if f.error is not None else OSError(errno.EIO, "injected I/O error")
        if f.kind == "hang":
            self._release.wait(f.hang_s)
            raise TimeoutError("injected hang released")

    def put(self, key: str, data: Data) -> int:
        f = self._fault("put")
        self._pre(f)
        if f is not None and f.kind in ("truncate", "flip"):
            bufs = [bytes(b) for b in as_buffers(data)]
            blob = bytearray(b"".join(bufs))
            if f.kind == "truncate":
                blob = blob[: len(blob) // 2]
            elif f.offset < len(blob):
                blob[f.offset] ^= 0x01
            self.inner.put(key, bytes(blob))
            return sum(len(b) for b in bufs)   # the store claims success: only a verify can tell
        return self.inner.put(key, data)

    def _mangle(self, f: Fault | None, data: bytes, offset: int) -> bytes:
        if f is None:
            return data
        if f.kind == "truncate":
            return data[: len(data) // 2]
        if f.kind == "flip" and offset <= f.offset < offset + len(data):
            b = bytearray(data)
            b[f.offset - offset] ^= 0x01
            return bytes(b)
        return data

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        f = self._fault("get")
        self._pre(f)
        return self._mangle(f, self.inner.get(key, offset, length), offset)

    def readinto(self, key: str, offset: int, buf: memoryview) -> int:
        f = self._fault("readinto")
        self._pre(f)
        view = memoryview(buf).cast("B")
        n = self.inner.readinto(key, offset, view)
        if f is not None and f.kind in ("truncate", "flip"):
            data = self._mangle(f, bytes(view[:n]), offset)
            view[: len(data)] = data
            return len(data)
        return n

    def exists(self, key: str) -> bool:
        self._pre(self._fault("exists"))
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        self._pre(self._fault("size"))
        return self.inner.size(key)

    def list(self, prefix: str = "") -> list[str]:
        self._pre(self._fault("list"))
        return self.inner.list(prefix)

    def delete(self, key: str) -> bool:
        self._pre(self._fault("delete"))
        return self.inner.delete(key)

