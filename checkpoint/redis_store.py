"""`RedisStore`: blobs as Redis strings (`<prefix><key>`). Measured slow for bulk bytes (docs/checkpoints.md)
but useful for small blobs and as a tier when no shared memory is available.

Atomicity: a streamed put APPENDs into a temp key and RENAMEs it over the final key. Redis strings are
limited to 512 MB (proto-max-bulk-len), so shards larger than that belong in `ShmStore`.
"""
from __future__ import annotations

import itertools
import os
from typing import Any

from checkpoint.blobstore import Data, as_buffers, check_range
from checkpoint.names import validate_key, validate_prefix

_counter = itertools.count()
_GLOB = str.maketrans({c: "\\" + c for c in "*?[]\\"})


class RedisStore:
    def __init__(self, client: Any, prefix: str = "sdcw:blob:") -> None:
        self.client = client
        self.prefix = prefix

    def _k(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def put(self, key: str, data: Data) -> int:
        final = self._k(key)
        bufs = list(as_buffers(data)) if not isinstance(data, (bytes, bytearray, memoryview)) else None
        if bufs is None:
            view = memoryview(data).cast("B")  # type: ignore[arg-type]
            self.client.set(final, view.tobytes() if not isinstance(data, bytes) else data)
            return len(view)
        tmp = f"{final}.tmp-{os.getpid()}-{next(_counter)}"
        written = 0
        try:
            self.client.set(tmp, b"")
            for b in bufs:
                self.client.append(tmp, b.tobytes())
                written += len(b)
            self.client.rename(tmp, final)
        except BaseException:
            self.client.delete(tmp)
            raise
        return written

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        k = self._k(key)
        size = self.client.strlen(k)
        if size == 0 and not self.client.exists(k):
            raise KeyError(f"no blob {key!r} in Redis")
        off, n = check_range(offset, length, size, key)
        if off == 0 and n == size:
            return bytes(self.client.get(k) or b"")
        if n == 0:
            return b""
        return bytes(self.client.getrange(k, off, off + n - 1))

    def readinto(self, key: str, offset: int, buf: memoryview) -> int:
        view = memoryview(buf).cast("B")
        data = self.get(key, offset, len(view))
        view[: len(data)] = data
        return len(data)

    def exists(self, key: str) -> bool:
        return bool(self.client.exists(self._k(key)))

    def size(self, key: str) -> int:
        k = self._k(key)
        if not self.client.exists(k):
            raise KeyError(f"no blob {key!r} in Redis")
        return int(self.client.strlen(k))

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        pattern = (self.prefix + prefix).translate(_GLOB) + "*"
        out = []
        for raw in self.client.scan_iter(match=pattern, count=1000):
            k = raw.decode() if isinstance(raw, bytes) else raw
            if ".tmp-" in k:
                continue
            out.append(k[len(self.prefix):])
        return sorted(out)

    def delete(self, key: str) -> bool:
        return bool(self.client.delete(self._k(key)))
