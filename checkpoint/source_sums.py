"""A shard's chunk checksums and tensor fingerprints from fingerprints taken at the source: torch-free.

The shard blob lays the tensors out at ALIGN-aligned offsets (checkpoint.snapshot.layout) with zero bytes
between them, and is cut into chunks of `chunk_bytes`. Cut every tensor's bytes at the chunk boundaries
into *pieces*: each piece is a byte range of one tensor inside one chunk. The GPU fingerprints every piece
(read as a 1-D uint8 tensor) from the source tensors, on the side stream, with the copy (one fused kernel
launch over all pieces, at HBM speed); the host then gets, for each piece, its word sums exactly back from
its fingerprint (`fingerprint_host.sums_from_tensor_words`: the mixing is a bijection) and adds them up:

    a chunk's sums  = sum over its pieces of  shift(piece sums, piece start in the chunk / 4)
    a tensor's sums = sum over its pieces of  shift(piece sums, piece start in the tensor / 4)

(the zero bytes between tensors add nothing), then mixes them with the chunk's uint8 header (an
FP_ALGORITHM chunk checksum) and the tensor's dtype/shape header (the tensor fingerprint). These are the
very integers numpy computes from the host bytes: exact, not a second opinion. The host does a few integer
operations per piece; it never reads the shard's bytes to commit it.

Needs `chunk_bytes % 4 == 0` (so piece starts are whole words in both the chunk and the tensor) and the
gaps between tensors zero in the staging buffer (checkpoint.snapshot zeroes them when a layout is new).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from checkpoint.chunks import FP_ALGORITHM, Chunk, chunk_ranges, fp_hex
from checkpoint.errors import InvalidInputError
from checksums.fingerprint_host import MASK64, fmix64, fmix64_inverse, header_words


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    tensor: int        # index of the tensor in the shard
    start: int         # byte offset in the tensor (a multiple of 4)
    length: int        # bytes (> 0)
    chunk: int         # index of the chunk
    chunk_start: int   # byte offset in the chunk (a multiple of 4)


def pieces(offsets: Sequence[int], sizes: Sequence[int], chunk_bytes: int) -> list[Piece]:
    """Cut each tensor (byte `offsets[i]` in the blob, `sizes[i]` bytes) at the chunk boundaries."""
    if chunk_bytes <= 0 or chunk_bytes % 4:
        raise InvalidInputError(f"source checksums need chunk_bytes a positive multiple of 4, got {chunk_bytes}")
    out = []
    for i, (off, n) in enumerate(zip(offsets, sizes)):
        if off % 4:
            raise InvalidInputError(f"tensor {i} starts at byte {off}, not a multiple of 4")
        pos = off
        while pos < off + n:
            c = pos // chunk_bytes
            end = min(off + n, (c + 1) * chunk_bytes)
            out.append(Piece(i, pos - off, end - pos, c, pos - c * chunk_bytes))
            pos = end
    return out


@functools.lru_cache(maxsize=1 << 14)
def _header(dtype_name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """`header_words`, cached: a layout's pieces, chunks and tensors repeat from save to save (computing the
    headers was about half of `combine`'s time)."""
    return header_words(dtype_name, shape)


def combine(cut: Sequence[Piece], piece_words: Sequence[Sequence[int]], total: int, chunk_bytes: int,
            tensors: Sequence[tuple[str, Sequence[int]]]) -> tuple[list[Chunk], list[tuple[int, int]]]:
    """(the blob's FP_ALGORITHM chunks, each tensor's fingerprint) from the pieces' fingerprint words
    (`piece_words[k]` = (f0, f1) of piece k as a 1-D uint8 tensor; signed or unsigned ints). `tensors[i]` =
    (dtype name, shape) of tensor i.

    The same integers as `fingerprint_host.sums_from_tensor_words` / `shift_sums` /
    `tensor_words_from_sums`, inlined with the headers cached (this runs once per save, in the background)."""
    if len(piece_words) != len(cut):
        raise InvalidInputError(f"{len(piece_words)} piece fingerprints for {len(cut)} pieces")
    ranges = chunk_ranges(total, chunk_bytes)
    c0 = [0] * len(ranges)
    c1 = [0] * len(ranges)
    t0 = [0] * len(tensors)
    t1 = [0] * len(tensors)
    inv = fmix64_inverse
    for p, words in zip(cut, piece_words):
        f0 = int(words[0]) & MASK64
        h0, h1 = _header("uint8", (p.length,))
        s0 = inv(f0) ^ h0                                   # sums_from_tensor_words, exactly
        s1 = ((inv(int(words[1]) & MASK64) - f0) & MASK64) ^ h1
        c0[p.chunk] += s0                                   # shift_sums by the piece's word offsets
        c1[p.chunk] += s1 + (p.chunk_start >> 2) * s0
        t0[p.tensor] += s0
        t1[p.tensor] += s1 + (p.start >> 2) * s0
    chunks = [Chunk(off, n, fp_hex(_words(c0[k], c1[k], "uint8", (n,))), FP_ALGORITHM)
              for k, (off, n) in enumerate(ranges)]
    fps = [_words(t0[i], t1[i], dt, tuple(int(d) for d in shape)) for i, (dt, shape) in enumerate(tensors)]
    return chunks, fps


def _words(s0: int, s1: int, dtype_name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """`tensor_words_from_sums` with the header cached."""
    h0, h1 = _header(dtype_name, shape)
    f0 = fmix64((s0 & MASK64) ^ h0)
    return f0, fmix64((((s1 & MASK64) ^ h1) + f0) & MASK64)
