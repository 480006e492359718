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
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from checkpoint.chunks import FP_ALGORITHM, Chunk, chunk_ranges, fp_hex
from checkpoint.errors import InvalidInputError
from checkpoint.manifest import FORMAT
from checksums.fingerprint_host import _INV_C1, _INV_C2, MASK64, fmix64, fmix64_inverse, header_words


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


_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_IC1 = np.uint64(_INV_C1)
_IC2 = np.uint64(_INV_C2)


def _fmix64_np(z: np.ndarray) -> np.ndarray:
    """`fmix64` on a uint64 array (numpy's uint64 arithmetic wraps mod 2**64, the spec's)."""
    z = (z ^ (z >> np.uint64(30))) * _C1
    z = (z ^ (z >> np.uint64(27))) * _C2
    return z ^ (z >> np.uint64(31))


def _unxorshift_np(y: np.ndarray, k: int) -> np.ndarray:
    x, shift = y.copy(), k
    while shift < 64:
        x ^= y >> np.uint64(shift)
        shift += k
    return x


def _fmix64_inverse_np(z: np.ndarray) -> np.ndarray:
    z = _unxorshift_np(z, 31)
    z = _unxorshift_np(z * _IC2, 27)
    return _unxorshift_np(z * _IC1, 30)


def _u64(values: Sequence[int]) -> np.ndarray:
    return np.array([v & MASK64 for v in values], dtype=np.uint64).reshape(-1)


class CombinePlan:
    """`combine` for one layout, vectorised: the per-piece, per-chunk and per-tensor constants (indices,
    word shifts, headers) as arrays, built once per layout; each save then costs a few numpy operations on
    whole arrays (no Python per piece: issue 21, the background's GIL share). Same integers as `combine`."""

    def __init__(self, cut: Sequence[Piece], total: int, chunk_bytes: int,
                 tensors: Sequence[tuple[str, Sequence[int]]]) -> None:
        n = len(cut)
        self.n_pieces = n
        self.ranges = chunk_ranges(total, chunk_bytes)
        self.n_tensors = len(tensors)
        self.chunk = np.fromiter((p.chunk for p in cut), dtype=np.intp, count=n)
        self.tensor = np.fromiter((p.tensor for p in cut), dtype=np.intp, count=n)
        self.cshift = np.fromiter((p.chunk_start >> 2 for p in cut), dtype=np.uint64, count=n)
        self.tshift = np.fromiter((p.start >> 2 for p in cut), dtype=np.uint64, count=n)
        heads = [_header("uint8", (p.length,)) for p in cut]
        self.h0, self.h1 = _u64([h[0] for h in heads]), _u64([h[1] for h in heads])
        heads = [_header("uint8", (ln,)) for _, ln in self.ranges]
        self.ch0, self.ch1 = _u64([h[0] for h in heads]), _u64([h[1] for h in heads])
        heads = [_header(dt, tuple(int(d) for d in shape)) for dt, shape in tensors]
        self.th0, self.th1 = _u64([h[0] for h in heads]), _u64([h[1] for h in heads])

    def run(self, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(chunk words uint64 [chunks, 2], tensor words uint64 [tensors, 2]) from the pieces' words
        (`words[k]` = (f0, f1) of piece k; int64 or uint64 [pieces, 2])."""
        if words.shape != (self.n_pieces, 2):
            raise InvalidInputError(f"{words.shape[0]} piece fingerprints for {self.n_pieces} pieces")
        w = np.ascontiguousarray(words).view(np.uint64)
        f0 = w[:, 0]
        s0 = _fmix64_inverse_np(f0) ^ self.h0                         # sums_from_tensor_words, exactly
        s1 = (_fmix64_inverse_np(w[:, 1]) - f0) ^ self.h1
        c0 = np.zeros(len(self.ranges), dtype=np.uint64)
        c1 = np.zeros(len(self.ranges), dtype=np.uint64)
        t0 = np.zeros(self.n_tensors, dtype=np.uint64)
        t1 = np.zeros(self.n_tensors, dtype=np.uint64)
        np.add.at(c0, self.chunk, s0)                                  # shift_sums by the word offsets
        np.add.at(c1, self.chunk, s1 + self.cshift * s0)
        np.add.at(t0, self.tensor, s0)
        np.add.at(t1, self.tensor, s1 + self.tshift * s0)
        return _finish(c0, c1, self.ch0, self.ch1), _finish(t0, t1, self.th0, self.th1)


def _finish(s0: np.ndarray, s1: np.ndarray, h0: np.ndarray, h1: np.ndarray) -> np.ndarray:
    """`tensor_words_from_sums` over arrays: [n, 2] uint64."""
    f0 = _fmix64_np(s0 ^ h0)
    return np.stack([f0, _fmix64_np((s1 ^ h1) + f0)], axis=1)


class ManifestTemplate:
    """A source-checksummed shard manifest's JSON for one layout, with the per-save parts (step, blob,
    chunk checksums, tensor fingerprints, time) filled in: the exact text `ShardManifest.to_json` writes,
    without a TensorEntry or a dict per tensor per save (issue 21)."""

    def __init__(self, job_id: str, rank: int, world_size: int, nbytes: int, chunk_bytes: int,
                 ranges: Sequence[tuple[int, int]],
                 entries: Sequence[tuple[str, str, tuple[int, ...], int, int]], tree: Any,
                 replica_set: str) -> None:
        d = json.dumps
        self.head = (f'{{"format":{d(FORMAT)},"job_id":{d(job_id)},"step":')
        self.mid = (f',"rank":{d(rank)},"world_size":{d(world_size)},"blob":')
        self.after_blob = (f',"nbytes":{d(nbytes)},"chunk_bytes":{d(chunk_bytes)},"algorithm":'
                           f'{d(FP_ALGORITHM)},"chunks":[')
        self.chunk_heads = [f"[{off},{n},\"" for off, n in ranges]
        self.tensor_heads = [
            f'{{"path":{d(path)},"dtype":{d(dt)},"shape":{d([int(x) for x in shape], separators=(",", ":"))},'
            f'"offset":{d(off)},"nbytes":{d(n)},"fingerprint":['
            for path, dt, shape, off, n in entries]
        self.tree = tree
        self.tail = (f'],"tree":{d(tree, separators=(",", ":"), allow_nan=True)},"created":')
        self.end = f',"replica_set":{d(replica_set)}}}'

    def render(self, step: int, blob: str, chunk_words: np.ndarray, tensor_words: np.ndarray,
               created: float) -> str:
        cw = chunk_words.tolist()
        tw = tensor_words.tolist()
        chunks = ",".join([f'{h}{a:016x}{b:016x}"]' for h, (a, b) in zip(self.chunk_heads, cw)])
        tensors = ",".join([f"{h}{a},{b}]}}" for h, (a, b) in zip(self.tensor_heads, tw)])
        return "".join((self.head, json.dumps(step), self.mid, json.dumps(blob), self.after_blob, chunks,
                        '],"tensors":[', tensors, self.tail, json.dumps(created), self.end))


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
