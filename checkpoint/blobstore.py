"""The `BlobStore` protocol: where checkpoint bytes live (node memory, Redis, a directory, S3...).

Lifecycle of a blob, in order:

1. `put(key, data)`   write the whole blob; atomic: a reader sees all of it or nothing (never a prefix).
                      `data` is one buffer or an iterable of buffers (streamed, e.g. chunk by chunk).
2. `exists(key)` / `size(key)` / `list(prefix)`   find blobs; a half-written blob is never listed.
3. `get(key, offset, length)` / `readinto(key, offset, buf)`   ranged reads (a chunk at a time).
4. `delete(key)`      remove; deleting a missing key returns False, never raises.

Keys are '/'-separated safe names (see `checkpoint.names.validate_key`). Missing keys raise `KeyError`.
Stores hold bytes only: checksums, manifests and commit records are the coordinator's business.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Union, runtime_checkable

Buffer = Union[bytes, bytearray, memoryview]
Data = Union[Buffer, Iterable[Buffer]]


@runtime_checkable
class BlobStore(Protocol):
    def put(self, key: str, data: Data) -> int:
        """Store `data` under `key` atomically, replacing any old blob; return the bytes written."""
        ...

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset+length) of the blob (to the end when length is None)."""
        ...

    def readinto(self, key: str, offset: int, buf: memoryview) -> int:
        """Fill `buf` from the blob starting at `offset`; return the bytes read (short at the end)."""
        ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int: ...

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with `prefix`, sorted."""
        ...

    def delete(self, key: str) -> bool: ...


def as_buffers(data: Data) -> Iterable[memoryview]:
    """Normalise `data` to an iterable of byte memoryviews."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return (memoryview(data).cast("B"),)
    return (memoryview(b).cast("B") for b in data)


def check_range(offset: int, length: int | None, size: int, key: str) -> tuple[int, int]:
    """Validate a read range against a blob of `size` bytes; return (offset, length) clipped to the end."""
    if offset < 0 or (length is not None and length < 0):
        raise ValueError(f"bad range offset={offset} length={length} for {key!r}")
    if offset > size:
        raise ValueError(f"offset {offset} is past the end of {key!r} ({size} bytes)")
    end = size if length is None else min(size, offset + length)
    return offset, end - offset
