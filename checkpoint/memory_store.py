"""`MemoryStore`: a BlobStore in this process's memory (tests, and a tier for single-process use).

Not crash-safe: the bytes die with the process. The node's durable-across-rank-crash tier is
`checkpoint.shm_store.ShmStore` (see docs/checkpoints.md for the measurement behind that choice).
"""
from __future__ import annotations

import threading

from checkpoint.blobstore import Data, as_buffers, check_range
from checkpoint.names import validate_key, validate_prefix


class MemoryStore:
    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: Data) -> int:
        validate_key(key)
        blob = b"".join(bytes(b) for b in as_buffers(data))
        with self._lock:
            self._blobs[key] = blob
        return len(blob)

    def _blob(self, key: str) -> bytes:
        validate_key(key)
        with self._lock:
            try:
                return self._blobs[key]
            except KeyError:
                raise KeyError(f"no blob {key!r} in memory store") from None

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        blob = self._blob(key)
        off, n = check_range(offset, length, len(blob), key)
        return blob[off:off + n]

    def readinto(self, key: str, offset: int, buf: memoryview) -> int:
        data = self.get(key, offset, len(buf))
        memoryview(buf).cast("B")[: len(data)] = data
        return len(data)

    def exists(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            return key in self._blobs

    def size(self, key: str) -> int:
        return len(self._blob(key))

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        with self._lock:
            return sorted(k for k in self._blobs if k.startswith(prefix))

    def delete(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            return self._blobs.pop(key, None) is not None

    def corrupt(self, key: str, offset: int) -> None:
        """Test hook: flip the lowest bit of one byte."""
        with self._lock:
            b = bytearray(self._blobs[key])
            b[offset] ^= 1
            self._blobs[key] = bytes(b)
