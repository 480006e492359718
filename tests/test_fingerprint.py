"""CPU tests of the fingerprint spec: numpy and torch paths agree, and the detection guarantees hold."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checksums.fingerprint import (
    fingerprint_bytes,
    fingerprint_list_from_parts,
    fingerprint_numpy,
    fingerprint_tensor,
    fingerprint_tensors,
    fingerprint_tensors_async,
    fingerprint_words_to_ints,
)
from checksums.fingerprint import (
    DTYPE_IDS,
    GOLDEN,
    ITEMSIZE,
    canonical_dtype_name,
    fingerprint_tensors_torch,
    fmix64,
    word_sums_numpy,
)

TORCH_DTYPES = [
    torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int8, torch.uint8, torch.int16, torch.int32,
    torch.int64, torch.bool, torch.complex64, torch.complex128,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bits of the dtype (every bit pattern, NaNs included)."""
    numel = int(np.prod(shape, dtype=np.int64))
    nbytes = numel * ITEMSIZE[canonical_dtype_name(dtype)]
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def host_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def fp_host(t: torch.Tensor) -> tuple[int, int]:
    return fingerprint_bytes(host_bytes(t), canonical_dtype_name(t.dtype), tuple(t.shape))


def test_known_answers_pin_the_spec() -> None:
    assert fmix64(GOLDEN) == 0xE220A8397B1DCDAF  # splitmix64's first output for seed 0
    assert word_sums_numpy(b"\x01\x02\x03\x04\x05") == (0x04030201 + 5, 5)
    assert fingerprint_bytes(b"\x01\x02\x03\x04\x05", "uint8", (5,)) == (1272719284265464790,
                                                                          5292069772397194236)
    assert fingerprint_bytes(b"", "float32", (0, 3)) == (4503793805327417583, 9472218719133423663)
    parts = [fingerprint_bytes(b"\x01\x02\x03\x04\x05", "uint8", (5,)), fingerprint_bytes(b"", "float32", (0, 3))]
    assert fingerprint_list_from_parts(parts) == (7976208271827151054, 7624128183687000092)


def test_dtype_ids_are_unique_and_complete() -> None:
    assert len(set(DTYPE_IDS.values())) == len(DTYPE_IDS)
    assert set(DTYPE_IDS) == set(ITEMSIZE)
    for dt in TORCH_DTYPES:
        assert torch.empty(0, dtype=dt).element_size() == ITEMSIZE[canonical_dtype_name(dt)]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3,), (5, 7), (2, 3, 33), (4097,)])
def test_torch_and_numpy_agree(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(hash((str(dtype), shape)) & 0xFFFF)
    t = random_tensor(shape, dtype, gen)
    assert fingerprint_tensor(t) == fp_host(t)          # on the CPU: the host path (fingerprint_tensors_host)
    words, per = fingerprint_tensors_torch([t])        # the torch ops (any device) give the same integers
    assert fingerprint_words_to_ints(per[0]) == fp_host(t)
    assert torch.equal(words, fingerprint_tensors_async([t]))


def test_numpy_arrays_with_native_and_raw_dtypes() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((6, 5)).astype(np.float32)
    assert fingerprint_numpy(a) == fingerprint_tensor(torch.from_numpy(a))
    assert fingerprint_numpy(a.astype(">f4")) == fingerprint_numpy(a)  # values, not host byte order
    assert fingerprint_numpy(a.T) == fingerprint_tensor(torch.from_numpy(a).T)
    bf = torch.randn(4, 9).to(torch.bfloat16)
    bits = bf.view(torch.int16).numpy().view(np.uint16)
    assert fingerprint_numpy(bits, "bfloat16") == fingerprint_tensor(bf)
    raw = np.frombuffer(host_bytes(bf), np.uint8)
    assert fingerprint_numpy(raw, "torch.bfloat16", shape=(4, 9)) == fingerprint_tensor(bf)
    assert fingerprint_numpy(np.array([True, False, True])) == fingerprint_tensor(torch.tensor([True, False, True]))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_single_bit_flip_changes_it(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    n = max(1, 24 // ITEMSIZE[canonical_dtype_name(dtype)])
    t = random_tensor((n,), dtype, gen)
    name, base = canonical_dtype_name(dtype), bytearray(host_bytes(t))
    seen = {fingerprint_bytes(bytes(base), name, (n,))}
    for bit in range(len(base) * 8):
        flipped = bytearray(base)
        flipped[bit // 8] ^= 1 << (bit % 8)
        seen.add(fingerprint_bytes(bytes(flipped), name, (n,)))
    # every flip differs from the original and from every other flip (a 2-bit difference)
    assert len(seen) == len(base) * 8 + 1


def test_single_bit_flips_through_torch_path() -> None:
    t = torch.randn(3, 5, dtype=torch.float32)
    base = fingerprint_tensor(t)
    ints = t.view(torch.int32)
    for i in range(ints.numel()):
        for b in range(32):
            c = ints.clone().reshape(-1)
            c[i] ^= torch.tensor(1 << b, dtype=torch.int64).to(torch.int32)
            assert fingerprint_tensor(c.view(torch.float32).reshape(3, 5)) != base


def test_every_two_bit_flip_changes_it() -> None:
    buf = bytes(range(11, 23))  # 12 bytes, 96 bits: all 4560 pairs
    base = fingerprint_bytes(buf, "uint8", (12,))
    for a, b in itertools.combinations(range(96), 2):
        f = bytearray(buf)
        f[a // 8] ^= 1 << (a % 8)
        f[b // 8] ^= 1 << (b % 8)
        assert fingerprint_bytes(bytes(f), "uint8", (12,)) != base, (a, b)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_swaps_and_moves_change_it(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    t = random_tensor((20,), dtype, gen)
    base = fingerprint_tensor(t)
    for i, j in itertools.combinations(range(20), 2):
        if torch.equal(t[i : i + 1].view(torch.uint8), t[j : j + 1].view(torch.uint8)):
            continue
        s = t.clone()
        s[i], s[j] = t[j], t[i]
        assert fp_host(s) != base, (i, j)
    assert fingerprint_tensor(torch.roll(t, 1)) != base
    moved = torch.cat([t[:5], t[6:12], t[5:6], t[12:]])
    assert fingerprint_tensor(moved) != base


def test_dtype_and_shape_are_mixed_in() -> None:
    raw = bytes(range(24))
    fps = {
        fingerprint_bytes(raw, "float32", (6,)), fingerprint_bytes(raw, "int32", (6,)),
        fingerprint_bytes(raw, "uint32", (6,)), fingerprint_bytes(raw, "float32", (2, 3)),
        fingerprint_bytes(raw, "float32", (3, 2)), fingerprint_bytes(raw, "float32", (1, 6)),
        fingerprint_bytes(raw, "bfloat16", (12,)), fingerprint_bytes(raw, "float16", (12,)),
        fingerprint_bytes(raw, "uint8", (24,)), fingerprint_bytes(raw, "float8_e4m3fn", (24,)),
        fingerprint_bytes(raw, "float8_e5m2", (24,)), fingerprint_bytes(raw, "float64", (3,)),
    }
    assert len(fps) == 12
    zero = {fingerprint_bytes(b"", "float32", s) for s in [(0,), (0, 1), (1, 0), (0, 0)]}
    zero |= {fingerprint_bytes(b"", "bfloat16", (0,))}
    assert len(zero) == 5
    assert fingerprint_bytes(b"\0" * 4, "float32", ()) != fingerprint_bytes(b"\0" * 4, "float32", (1,))


def test_non_contiguous_views_fingerprint_their_logical_order() -> None:
    t = torch.randn(6, 8)
    h = torch.randn(9).to(torch.bfloat16)
    assert fingerprint_tensor(h[1:]) == fp_host(h[1:].clone())  # contiguous, but starts mid-word
    for view in [t.T, t[:, 1:5], t[::2], t[1:, 3], t.expand(2, 6, 8)[1], -t, h[1:]]:
        assert fingerprint_tensor(view) == fingerprint_tensor(view.contiguous()) == fp_host(view.contiguous())
        per = fingerprint_tensors_torch([view.contiguous()])[1]
        assert fingerprint_words_to_ints(per[0]) == fp_host(view)
    z = torch.randn(3, 2, dtype=torch.complex64)
    assert fingerprint_tensor(z.conj()) == fp_host(z.conj().resolve_conj())   # a lazy conjugate: its values
    assert fingerprint_tensor(t.T) != fingerprint_tensor(t)


def test_lists_depend_on_order_and_match_parts() -> None:
    a, b, c = torch.randn(5), torch.randn(3, 2).to(torch.bfloat16), torch.arange(7, dtype=torch.int64)
    fp = fingerprint_tensors([a, b, c])
    assert fp == fingerprint_list_from_parts([fp_host(a), fp_host(b), fp_host(c)])
    assert fp != fingerprint_tensors([b, a, c])
    assert fp != fingerprint_tensors([a, b])
    assert fingerprint_tensors([a, a]) != fingerprint_tensors([a])
    assert fingerprint_tensors([]) == fingerprint_list_from_parts([])
    per = torch.empty(3, 2, dtype=torch.int64)
    words = fingerprint_tensors_async([a, b, c], per_tensor_out=per)
    assert words.dtype == torch.int64 and words.shape == (2,)
    assert [fingerprint_words_to_ints(r) for r in per] == [fingerprint_tensor(x) for x in (a, b, c)]


def test_grad_tensors_and_parameters() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4))
    assert fingerprint_tensor(p) == fp_host(p.detach())
    lin = torch.nn.Linear(8, 3)
    params = list(lin.parameters())
    assert fingerprint_tensors(params) == fingerprint_list_from_parts([fp_host(x.detach()) for x in params])


def test_bad_input_gives_clear_errors() -> None:
    with pytest.raises(ValueError, match="needs 24"):
        fingerprint_bytes(b"\0" * 23, "float32", (6,))
    with pytest.raises(ValueError, match="unsupported dtype"):
        fingerprint_bytes(b"", "float4", (0,))
    with pytest.raises(ValueError, match="itemsize"):
        fingerprint_numpy(np.zeros(4, np.uint8), "float32")
    with pytest.raises(ValueError, match="torch.Tensor"):
        fingerprint_tensor(np.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="words"):
        fingerprint_list_from_parts([(1, 2, 3)])


def test_dtensor_local_shard() -> None:
    import torch.distributed as dist

    assert dist.is_available(), "this torch build has no torch.distributed"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.randn(8, 4)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        assert fingerprint_tensor(dt) == fingerprint_tensor(full)
        assert fingerprint_tensors([dt, full]) == fingerprint_tensors([full, full])
    finally:
        if created:
            dist.destroy_process_group()


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=200),
    dtype=st.sampled_from([torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.int64]),
    bit=st.integers(min_value=0),
)
def test_property_torch_numpy_and_flip(data: bytes, dtype: torch.dtype, bit: int) -> None:
    size = ITEMSIZE[canonical_dtype_name(dtype)]
    data = data[: len(data) // size * size]
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype) if data else torch.empty(0, dtype=dtype)
    name = canonical_dtype_name(dtype)
    host = fingerprint_bytes(data, name, (len(data) // size,))
    assert fingerprint_tensor(t) == host
    words, _ = fingerprint_tensors_torch([t])
    assert fingerprint_words_to_ints(words) == fingerprint_list_from_parts([host])
    if data:
        f = bytearray(data)
        bit %= len(f) * 8
        f[bit // 8] ^= 1 << (bit % 8)
        assert fingerprint_bytes(bytes(f), name, (len(data) // size,)) != host
