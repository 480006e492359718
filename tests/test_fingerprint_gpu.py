"""On a CUDA GPU: the fused Triton kernel, torch on CUDA and numpy on host bytes give the same words."""

from __future__ import annotations

import pytest
import torch

from checksums.fingerprint import fingerprint_list_from_parts, fingerprint_tensor, fingerprint_tensors_async
from checksums.fingerprint import (
    ITEMSIZE,
    canonical_dtype_name,
    fingerprint_bytes,
    fingerprint_tensors_torch,
    fingerprint_words_to_ints,
    triton_available,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def rand_cuda(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    nbytes = numel * ITEMSIZE[canonical_dtype_name(dtype)]
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype)


def host_fp(t: torch.Tensor) -> tuple[int, int]:
    data = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return fingerprint_bytes(data, canonical_dtype_name(t.dtype), tuple(t.shape))


def check_three_ways(tensors: list[torch.Tensor]) -> None:
    per = torch.empty(len(tensors), 2, dtype=torch.int64, device="cuda")
    words = fingerprint_tensors_async(tensors, per_tensor_out=per)
    torch_words, torch_per = fingerprint_tensors_torch(tensors)
    host = [host_fp(t) for t in tensors]
    assert [fingerprint_words_to_ints(r) for r in per] == host
    assert [fingerprint_words_to_ints(r) for r in torch_per] == host
    assert fingerprint_words_to_ints(words) == fingerprint_list_from_parts(host)
    assert fingerprint_words_to_ints(torch_words) == fingerprint_list_from_parts(host)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_small_and_big(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    sizes = [0, 1, 3, 7, 8, 4095, 4096, 4097, 65537, 3_000_001]
    check_three_ways([rand_cuda(n, dtype, gen) for n in sizes])


def test_large_tensor_many_items() -> None:
    gen = torch.Generator(device="cuda").manual_seed(6)
    t = rand_cuda(150_000_003, torch.bfloat16, gen)  # ~300 MB: hundreds of work items
    check_three_ways([t, t[1:], t[2:-7]])


def test_hundreds_of_tensors_with_odd_views() -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    g = torch.Generator().manual_seed(7)
    tensors = []
    for i in range(400):
        n = int(torch.randint(1, 200_000, (1,), generator=g))
        tensors.append(rand_cuda(n, DTYPES[i % len(DTYPES)], gen))
    big = rand_cuda(5_000_000, torch.float32, gen).reshape(1000, 5000)
    tensors += [big.T, big[:, 3:4001], big[1:], torch.empty(0, device="cuda"), torch.zeros((), device="cuda")]
    check_three_ways(tensors)


def test_repeat_calls_reuse_the_plan_and_see_updates() -> None:
    w = torch.randn(1000, 1000, device="cuda")
    b = torch.randn(1000, device="cuda")
    first = fingerprint_words_to_ints(fingerprint_tensors_async([w, b]))
    assert fingerprint_words_to_ints(fingerprint_tensors_async([w, b])) == first
    w.view(torch.int32).view(-1)[123_457] ^= 1 << 17
    second = fingerprint_words_to_ints(fingerprint_tensors_async([w, b]))
    assert second != first
    assert second == fingerprint_list_from_parts([fingerprint_tensor(w), fingerprint_tensor(b)])


@pytest.mark.gpu
def test_tensors_on_another_gpu_than_the_current_one() -> None:
    """Triton launches on the current device: the plan must switch to the tensors' device (and stream)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from checksums.fingerprint import fingerprint_numpy, fingerprint_tensor

    with torch.cuda.device(0):
        for _ in range(5):
            a = torch.randn(4096, 4096, device="cuda:1")
            b = a @ a  # produced on cuda:1's stream
            got = fingerprint_tensor(b)
            want = fingerprint_numpy(b.cpu().numpy())
            assert got == want
