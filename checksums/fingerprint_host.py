"""Exact tensor fingerprints, the specification and its host path (numpy on raw bytes): torch-free.

The torch paths (any device; the Triton kernel on CUDA) are in checksums.fingerprint, which also exports
everything here; the agent side (a restore from the CLI, copies verified on a node) imports this module
alone and never loads torch.

Specification (version 1). Every implementation here (the Triton kernel, torch on any device, numpy on host
bytes) computes exactly these integers; reduction order cannot matter because only integer sums mod 2**64
are taken before the final, fixed mixing.

1. Bytes. The tensor's elements in logical row-major (C) order, each in its native little-endian byte
   layout (a non-contiguous view is read as its contiguous copy; a DTensor as its local shard). Let ``B`` be
   the byte count (numel * itemsize).
2. Words. The bytes read as little-endian uint32 words ``w_0 .. w_{n-1}``, ``n = ceil(B / 4)``, the last word
   zero-padded.
3. Sums, mod 2**64::

       S0 = sum_i w_i            S1 = sum_i i * w_i

4. Header. ``absorb(h, v) = fmix64(((h ^ v) + GOLDEN) mod 2**64)``, with ``fmix64`` the splitmix64
   finaliser. ``h0`` and ``h1`` absorb, from the seeds ``SEED_H0`` and ``SEED_H1``, the sequence
   ``[dtype id, ndim, *shape]`` (dtype ids in ``DTYPE_IDS``; they never change).
5. Tensor fingerprint, two uint64 words::

       f0 = fmix64(S0 ^ h0)          f1 = fmix64(((S1 ^ h1) + f0) mod 2**64)

6. List fingerprint of tensors ``0..m-1`` with tensor fingerprints ``(f0_k, f1_k)``::

       L0 = sum_k fmix64(f0_k ^ absorb(SEED_P0, k))      L1 = sum_k fmix64(f1_k ^ absorb(SEED_P1, k))
       F0 = fmix64(L0 ^ absorb(SEED_N0, m))             F1 = fmix64(((L1 ^ absorb(SEED_N1, m)) + F0) mod 2**64)

What is guaranteed (not merely likely):

- Any change of one word (so any single-bit flip, any change inside one 4-byte word) changes ``S0``.
- Any change to two words ``i != j`` with ``|i - j| < 2**32`` (tensors under 16 GiB always qualify),
  in particular every 2-bit error and every swap of two different 32-bit words, changes ``(S0, S1)``: if
  ``S0`` is unchanged the two deltas are ``d`` and ``-d`` with ``0 < |d| < 2**32`` and ``S1`` moves by
  ``d * (i - j)``, nonzero mod 2**64 as ``|d * (i - j)| < 2**64``.
  Swapping two elements of 1, 2 or 4 bytes is such a change. For 8-byte elements a swap is caught unless the
  two elements' (low word + high word) sums are equal mod 2**64 (about 2**-32 for random values).
- Step 5 is injective in ``(S0, S1)`` for a fixed header, so the above carries to ``(f0, f1)``; step 6 is
  injective in each single ``(f0_k, f1_k)``, so a change confined to one tensor of a list changes ``F``.
- Different dtype, shape or list position change the header or position words; distinct headers give
  distinct fingerprints with probability 1 - 2**-64 per word (no guarantee: it is a hash).

Larger or multi-tensor corruptions are caught unless two linear sums mod 2**64 both happen to cancel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
SEED_H0 = 0x243F6A8885A308D3
SEED_H1 = 0x13198A2E03707344
SEED_P0 = 0xA4093822299F31D0
SEED_P1 = 0x082EFA98EC4E6C89
SEED_N0 = 0x452821E638D01377
SEED_N1 = 0xBE5466CF34E90C6C
SPEC_VERSION = 1
NUM_WORDS = 2

# Fixed forever: changing an id changes every fingerprint of that dtype.
DTYPE_IDS: dict[str, int] = {
    "bool": 1, "uint8": 2, "int8": 3, "int16": 4, "uint16": 5, "int32": 6, "uint32": 7, "int64": 8,
    "uint64": 9, "float16": 10, "bfloat16": 11, "float32": 12, "float64": 13, "float8_e4m3fn": 14,
    "float8_e5m2": 15, "float8_e4m3fnuz": 16, "float8_e5m2fnuz": 17, "float8_e8m0fnu": 18,
    "complex32": 19, "complex64": 20, "complex128": 21,
}
ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
    "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "complex32": 4, "complex64": 8, "complex128": 16,
}
_ALIASES = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
    "fp64": "float64", "double": "float64", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
    "bool_": "bool", "long": "int64", "int": "int32",
}
_NP_ROW = 4096  # words per row of the blocked host sums
_NP_CHUNK_WORDS = 1 << 22


# ---------------------------------------------------------------- spec pieces (host, Python ints)


def fmix64(z: int) -> int:
    """The splitmix64 finaliser (a bijection on 64-bit integers)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def absorb(h: int, v: int) -> int:
    return fmix64(((h ^ (v & MASK64)) + GOLDEN) & MASK64)


def canonical_dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16, 'torch.bfloat16', 'bf16', np.float32 -> 'float32', ..."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.").lower()
    elif type(dtype).__module__ == "torch" and str(dtype).startswith("torch."):  # a torch.dtype, without torch
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError as exc:
            raise ValueError(f"unsupported dtype {dtype!r}") from exc
    name = _ALIASES.get(name, name)
    if name not in DTYPE_IDS:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPE_IDS)}")
    return name


def header_words(dtype_name: str, shape: Sequence[int]) -> tuple[int, int]:
    """(h0, h1): the dtype and shape words of spec step 4 (cached: a model's few shapes recur every step)."""
    return _header_words(canonical_dtype_name(dtype_name), tuple(int(d) for d in shape))


@functools.lru_cache(maxsize=4096)
def _header_words(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    seq = [DTYPE_IDS[name], len(shape), *shape]
    h0, h1 = SEED_H0, SEED_H1
    for v in seq:
        h0 = absorb(h0, v)
        h1 = absorb(h1, v)
    return h0, h1


def position_words(k: int) -> tuple[int, int]:
    return absorb(SEED_P0, k), absorb(SEED_P1, k)


def count_words(m: int) -> tuple[int, int]:
    return absorb(SEED_N0, m), absorb(SEED_N1, m)


def tensor_words_from_sums(s0: int, s1: int, dtype_name: str, shape: Sequence[int]) -> tuple[int, int]:
    """Spec step 5: the tensor fingerprint from its sums and header."""
    h0, h1 = header_words(dtype_name, shape)
    f0 = fmix64((s0 & MASK64) ^ h0)
    f1 = fmix64((((s1 & MASK64) ^ h1) + f0) & MASK64)
    return f0, f1


_INV_C1 = pow(0xBF58476D1CE4E5B9, -1, 1 << 64)
_INV_C2 = pow(0x94D049BB133111EB, -1, 1 << 64)


def _unxorshift(y: int, k: int) -> int:
    x, shift = y, k
    while shift < 64:
        x ^= y >> shift
        shift += k
    return x & MASK64


def fmix64_inverse(z: int) -> int:
    """The inverse of `fmix64` (a bijection): `fmix64_inverse(fmix64(x)) == x`."""
    z = _unxorshift(z & MASK64, 31)
    z = _unxorshift((z * _INV_C2) & MASK64, 27)
    return _unxorshift((z * _INV_C1) & MASK64, 30)


def sums_from_tensor_words(f0: int, f1: int, dtype_name: str, shape: Sequence[int]) -> tuple[int, int]:
    """Spec step 5 inverted: the sums (S0, S1) behind a tensor fingerprint (exact: fmix64 is a bijection).
    So the fingerprints of byte ranges, taken where the bytes are (the GPU kernel), combine on the host
    into the fingerprint of any concatenation of them (`combine_sums`) without reading a byte."""
    h0, h1 = header_words(dtype_name, shape)
    s0 = fmix64_inverse(f0) ^ h0
    s1 = ((fmix64_inverse(f1) - (f0 & MASK64)) & MASK64) ^ h1
    return s0, s1


def shift_sums(s0: int, s1: int, word_offset: int) -> tuple[int, int]:
    """The sums of a word range that starts `word_offset` words into a longer range: S1 gains
    `word_offset * S0` (every word's index moves by the offset), S0 is unchanged."""
    return s0 & MASK64, (s1 + word_offset * s0) & MASK64


def fingerprint_list_from_parts(parts: Sequence[Sequence[int]]) -> tuple[int, int]:
    """Spec step 6: combine per-tensor fingerprints (in list order) into the list fingerprint."""
    l0 = l1 = 0
    for k, part in enumerate(parts):
        if len(part) != NUM_WORDS:
            raise ValueError(f"part {k} has {len(part)} words, expected {NUM_WORDS}")
        p0, p1 = position_words(k)
        l0 = (l0 + fmix64((int(part[0]) & MASK64) ^ p0)) & MASK64
        l1 = (l1 + fmix64((int(part[1]) & MASK64) ^ p1)) & MASK64
    n0, n1 = count_words(len(parts))
    big0 = fmix64(l0 ^ n0)
    return big0, fmix64(((l1 ^ n1) + big0) & MASK64)


def to_signed64(v: int) -> int:
    v &= MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


# ---------------------------------------------------------------- numpy path (host bytes)


def word_sums_numpy(buf: bytes | bytearray | memoryview | np.ndarray) -> tuple[int, int]:
    """(S0, S1) of spec step 3 over raw bytes.

    Blocked: the words are viewed as rows of `_NP_ROW` and summed along both axes, so S1 needs one
    multiply per row and per column instead of one per word (about 10x faster than a per-word product).
    With r the row, c the column and R = _NP_ROW: S1 = sum((rR + c) w) = R sum(r rows[r]) + sum(c cols[c]),
    all mod 2^64 (numpy's uint64 array arithmetic wraps, which is exactly the modulus we want).
    """
    raw = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    pad = (-raw.size) % 4
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
    words = raw.view("<u4")
    s0 = s1 = 0
    row = _NP_ROW
    col_index = np.arange(row, dtype=np.uint64)
    for start in range(0, words.size, _NP_CHUNK_WORDS):
        chunk = words[start:start + _NP_CHUNK_WORDS]
        nb = chunk.size // row
        c0 = c1 = 0
        if nb:
            block = chunk[: nb * row].reshape(nb, row)
            rows = block.sum(axis=1, dtype=np.uint64)
            cols = block.sum(axis=0, dtype=np.uint64)
            c0 = int(rows.sum(dtype=np.uint64))
            c1 = (row * int((rows * np.arange(nb, dtype=np.uint64)).sum(dtype=np.uint64))
                  + int((cols * col_index).sum(dtype=np.uint64)))
        tail = chunk[nb * row:].astype(np.uint64)
        if tail.size:
            c0 += int(tail.sum(dtype=np.uint64))
            c1 += int((tail * (np.arange(tail.size, dtype=np.uint64) + np.uint64(nb * row))).sum(dtype=np.uint64))
        s0 = (s0 + c0) & MASK64
        s1 = (s1 + c1 + start * c0) & MASK64
    return s0, s1


def fingerprint_bytes(buf: bytes | bytearray | memoryview, dtype_name: str,
                      shape: Sequence[int]) -> tuple[int, int]:
    """Fingerprint of a tensor given its raw (C-order, little-endian) bytes, dtype name and shape."""
    name = canonical_dtype_name(dtype_name)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    expected = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[name]
    nbytes = memoryview(buf).nbytes
    if nbytes != expected:
        raise ValueError(f"buffer holds {nbytes} bytes but a {name} tensor of shape {shape} needs {expected}")
    s0, s1 = word_sums_numpy(buf)
    return tensor_words_from_sums(s0, s1, name, shape)


def fingerprint_numpy(arr: np.ndarray, dtype_name: str | None = None,
                      shape: Sequence[int] | None = None) -> tuple[int, int]:
    """Fingerprint of a host array.

    With ``dtype_name`` the array's bytes are taken as raw data of that dtype (use this for bfloat16 and
    float8, which numpy lacks: pass the bits as uint16/uint8 or raw uint8 bytes); ``shape`` defaults to the
    array's shape when the item sizes match.
    """
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"expected a numpy array, got {type(arr).__name__}")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    name = canonical_dtype_name(dtype_name if dtype_name is not None else arr.dtype)
    if shape is None:
        if arr.dtype.itemsize != ITEMSIZE[name]:
            raise ValueError(f"array itemsize {arr.dtype.itemsize} differs from {name}'s "
                             f"{ITEMSIZE[name]}: pass shape=")
        shape = arr.shape
    return fingerprint_bytes(memoryview(arr).cast("B"), name, shape)
