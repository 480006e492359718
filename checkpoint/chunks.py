"""Split a shard's bytes into fixed-size chunks, each with a 128-bit checksum.

A chunk is a byte range of one blob. Chunks are the unit of verification and of fallback on restore:
a chunk that fails its checksum is read again from another copy, not the whole shard.

Two checksum algorithms (the manifest's `algorithm` names which; every chunk of a manifest uses it):
- "xxh3-128": xxh3-128 of the chunk's bytes, computed on the host from the bytes that landed there;
- "sdcw-fp1": the exact fingerprint (checksums.fingerprint_host, spec version 1) of the chunk's bytes read
  as a 1-D uint8 tensor, `f0` then `f1` as 32 hex digits. Being linear sums, it can be computed where the
  bytes come from (the GPU kernel over the source tensors, checkpoint.snapshot's "source" checksums) and
  checked on the host with numpy; the same integers either way.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import xxhash

from checkpoint.errors import InvalidInputError
from checksums.fingerprint_host import fingerprint_bytes

DEFAULT_CHUNK_BYTES = 16 << 20
ALGORITHM = "xxh3-128"          # the default, and what a manifest without the field means
FP_ALGORITHM = "sdcw-fp1"       # exact fingerprint words of the chunk (computable at the source)
ALGORITHMS = (ALGORITHM, FP_ALGORITHM)


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    offset: int
    length: int
    checksum: str  # 32 hex digits of `algorithm`
    algorithm: str = ALGORITHM   # the manifest's (not in the chunk's JSON)

    def to_json(self) -> list[object]:
        return [self.offset, self.length, self.checksum]

    @classmethod
    def from_json(cls, obj: object) -> "Chunk":
        if (not isinstance(obj, list) or len(obj) != 3 or not all(isinstance(x, int) for x in obj[:2])
                or not isinstance(obj[2], str) or len(obj[2]) != 32 or obj[0] < 0 or obj[1] < 0):
            raise InvalidInputError(f"bad chunk record {obj!r}: want [offset, length, 32 hex digits]")
        try:
            int(obj[2], 16)
        except ValueError:
            raise InvalidInputError(f"bad chunk checksum {obj[2]!r}: not hex") from None
        return cls(obj[0], obj[1], obj[2])


def checksum(buf: bytes | bytearray | memoryview, algorithm: str = ALGORITHM) -> str:
    """The chunk checksum of `buf` (32 hex digits): xxh3-128, or the fingerprint words (FP_ALGORITHM)."""
    if algorithm == FP_ALGORITHM:
        view = memoryview(buf).cast("B")
        return fp_hex(fingerprint_bytes(view, "uint8", (len(view),)))
    if algorithm != ALGORITHM:
        raise InvalidInputError(f"unknown chunk checksum algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    return xxhash.xxh3_128_hexdigest(buf)


def fp_hex(words: tuple[int, ...]) -> str:
    """Two fingerprint words as the 32 hex digits of an FP_ALGORITHM chunk checksum."""
    f0, f1 = words
    return f"{f0:016x}{f1:016x}"


def chunk_ranges(nbytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of a blob of `nbytes`; an empty blob has no chunks."""
    if chunk_bytes <= 0:
        raise InvalidInputError(f"chunk size must be positive, got {chunk_bytes}")
    if nbytes < 0:
        raise InvalidInputError(f"blob size must be >= 0, got {nbytes}")
    return [(off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]


def checksum_chunks(buf: memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Chunk]:
    view = memoryview(buf).cast("B")
    return [Chunk(off, n, checksum(view[off:off + n])) for off, n in chunk_ranges(len(view), chunk_bytes)]


def iter_checksummed(buf: memoryview, chunk_bytes: int, out: list[Chunk]) -> Iterator[memoryview]:
    """Yield the chunks of `buf` one by one, appending each one's Chunk record to `out` first
    (so a store's streaming `put` hashes and writes each chunk while it is still in cache)."""
    view = memoryview(buf).cast("B")
    for off, n in chunk_ranges(len(view), chunk_bytes):
        piece = view[off:off + n]
        out.append(Chunk(off, n, checksum(piece)))
        yield piece


def iter_chunks(buf: memoryview, chunk_bytes: int) -> Iterator[memoryview]:
    """Yield the chunks of `buf` (their checksums are known already: computed at the source)."""
    view = memoryview(buf).cast("B")
    for off, n in chunk_ranges(len(view), chunk_bytes):
        yield view[off:off + n]


def verify(buf: bytes | bytearray | memoryview, chunk: Chunk) -> bool:
    return len(buf) == chunk.length and checksum(buf, chunk.algorithm) == chunk.checksum


def chunks_covering(chunks: list[Chunk], offset: int, nbytes: int) -> list[Chunk]:
    """The chunks that overlap [offset, offset+nbytes)."""
    end = offset + nbytes
    return [c for c in chunks if c.offset < end and c.offset + c.length > offset]
