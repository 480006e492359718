"""On a CUDA GPU: the fused gradient-bucket summary (checksums/grad_summary_triton.py) compiled for the device
gives the torch path's row (fingerprint exactly, statistics to float rounding), repeats bit for bit, carries
NaN/Inf, and is what bucket_summary and the DDP hook run. (bench/gpu_run.sh ONLY=gradsum runs it.)"""

from __future__ import annotations

import math

import pytest
import torch

from checksums.fingerprint import triton_available
from checksums.grad_checks import bucket_summary, bucket_summary_torch, fusable, stats_of, summary_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 9, 1000, 4099, (25 << 20) // 4 + 3, (100 << 20) // 2 + 1]


def _check(x: torch.Tensor) -> None:
    plan = summary_plan([x])
    assert getattr(plan, "summarises", False) and fusable(x)
    row, again = plan.run_async(x), plan.run_async(x)
    ref = bucket_summary_torch([x])
    assert torch.equal(row, again)                       # deterministic: a fixed reduction order
    assert torch.equal(row[2:], ref[2:])                 # the fingerprint words, exactly
    (n, a), (rn, ra) = stats_of(row.cpu()).tolist(), stats_of(ref.cpu()).tolist()
    assert a == ra and abs(n - rn) <= 1e-5 * max(n, rn), (n, rn, a, ra)
    assert torch.equal(bucket_summary([x]), row)         # the dispatch (a cached plan) runs the kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_fused_row_matches_torch(dtype: torch.dtype, n: int) -> None:
    x = (torch.randn(n + 16, device="cuda") * 1e-2).to(dtype)[:n]
    _check(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4099, (25 << 20) // 4 + 3])
def test_the_one_launch_form_matches_and_repeats(dtype: torch.dtype, n: int) -> None:
    from checksums.grad_summary_triton import GradSummaryPlan

    x = (torch.randn(n, device="cuda") * 1e-2).to(dtype)
    two = GradSummaryPlan(x, one_launch=False).run_async(x)
    one = GradSummaryPlan(x, one_launch=True)
    rows = torch.stack([one.run_async(x) for _ in range(200)])   # back to back: the counter re-arms each run
    assert torch.equal(rows, two.expand_as(rows)), (rows != two).any(dim=1).sum()
    assert int(one.counter) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [7, 9, 4099, (25 << 20) // 4 + 3])
@pytest.mark.parametrize("scale", [1 / 2, 1 / 3, 1 / 7])
def test_the_in_place_scaling_is_torchs_mul_bit_for_bit(dtype: torch.dtype, n: int, scale: float) -> None:
    """GradSummaries at world size > 1: the summary pass also scales the bucket by 1/world; the buffer must
    be what DDP's own `mul` leaves, bit for bit (subnormals kept), and the row the unscaled buffer's."""
    from checksums.grad_summary_triton import GradSummaryPlan

    x = (torch.randn(n + 16, device="cuda") * 1e-2).to(dtype)[:n]
    if dtype == torch.float32 and n > 9:
        x[3], x[4] = 1e-39, -3e-42
    want = x.clone().mul_(scale)
    plan = GradSummaryPlan(x)
    row = plan.run_async(x.clone())
    y = x.clone()
    got = plan.launch(y, scale=scale)
    assert torch.equal(got, row)
    diff = (y.view(torch.uint8) != want.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} bytes differ from torch's mul_"
    z = x.clone()
    assert torch.equal(bucket_summary([z], scale=scale), row) and torch.equal(z, want)   # the dispatch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("where", [0, -1])
def test_non_finite_values_make_both_statistics_nan(dtype: torch.dtype, bad: float, where: int) -> None:
    x = torch.randn(10_003, device="cuda").to(dtype)
    x[where] = bad
    row = bucket_summary([x])
    assert all(math.isnan(v) for v in stats_of(row.cpu()).tolist())
    assert torch.equal(row[2:], bucket_summary_torch([x])[2:])


def test_a_misaligned_buffer_falls_back() -> None:
    x = torch.randn(1001, device="cuda")[1:]
    assert not fusable(x)
    assert torch.equal(bucket_summary([x]), bucket_summary_torch([x]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_direct_launches_give_the_jit_entrys_rows_and_buffers(monkeypatch, dtype: torch.dtype,
                                                              scale: float) -> None:
    """After its first launch a plan calls the compiled kernel directly (no JIT entry): the rows and the
    scaled buffers are bit for bit those of launches through the JIT entry (SDCWATCH_GS_DIRECT=0), for
    buffers at other addresses, including one in another allocation (its offset from the plan's anchor
    can need 64 bits)."""
    import checksums.grad_summary_triton as gst

    n = (3 << 20) + 5
    big = (torch.randn(4 * n + 128, device="cuda") * 1e-2).to(dtype)
    other = (torch.randn(n + 8, device="cuda") * 1e-2).to(dtype)
    stride = n + 11 + (-(n + 11)) % 16                   # 16 elements: every slice starts 16-byte aligned
    bufs = [big[k * stride: k * stride + n] for k in range(3)] + [other[:n]]
    assert all(b.data_ptr() % 16 == 0 for b in bufs)

    def run_all(direct: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
        monkeypatch.setattr(gst, "DIRECT_LAUNCH", direct)
        plan = gst.GradSummaryPlan(bufs[0])
        xs = [b.clone() for b in bufs]
        out = torch.zeros(len(xs) * 2, 4, dtype=torch.int64, device="cuda")
        rows = []
        for k in range(2):                                    # twice: the second round all direct
            for i, x in enumerate(xs):
                rows.append(plan.launch(x, out[k * len(xs) + i] if k else None, scale=1.0 if k else scale))
        return rows, xs, plan

    d_rows, d_bufs, d_plan = run_all(True)
    j_rows, j_bufs, j_plan = run_all(False)
    assert all(torch.equal(a, b) for a, b in zip(d_rows, j_rows))
    assert all(torch.equal(a, b) for a, b in zip(d_bufs, j_bufs))        # scaled alike, bit for bit
    assert any(d.ok for d in d_plan._direct.values())                    # the direct path ran
    assert not any(d.ok for d in j_plan._direct.values())
    ref = bucket_summary_torch([bufs[1]])
    assert torch.equal(d_rows[1][2:], ref[2:])                           # and it is the right row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_a_bound_launch_gives_launchs_row_and_buffer_on_any_stream(monkeypatch, dtype: torch.dtype,
                                                                    scale: float) -> None:
    """`GradSummaryPlan.bound` (the DDP hook's launch once a bucket settled: integer addresses, a raw stream
    handle) writes the row and scales the buffer bit for bit as `launch` does, on the current stream and on
    another one; it is None before the variant was launched and when direct launches are off, and a refused
    launch returns False without launching."""
    import checksums.grad_summary_triton as gst

    n = (3 << 20) + 5
    x = (torch.randn(n + 16, device="cuda") * 1e-2).to(dtype)[:n]
    plan = gst.GradSummaryPlan(x)
    out = torch.zeros(4, dtype=torch.int64, device="cuda")
    assert plan.bound(x, out, scale) is None                 # nothing compiled for it yet
    want_buf = x.clone()
    want = plan.launch(want_buf, out.clone(), scale=scale).clone()   # compiles; direct from the next call
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        y = x.clone()
        row = torch.zeros(4, dtype=torch.int64, device="cuda")
        plan.launch(y, row, scale=scale)        # this address's variant (its offset may need 64 bits)
        y.copy_(x)
        row.zero_()
        b = plan.bound(y, row, scale)
        assert b is not None
        side.wait_stream(torch.cuda.current_stream())
        assert b(stream.cuda_stream)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(row, want) and torch.equal(y, want_buf), stream    # row and scaled buffer
    b._direct.ok = False                                     # a launcher that refused once
    row.zero_()
    assert b(torch.cuda.current_stream().cuda_stream) is False
    torch.cuda.synchronize()
    assert not row.any()                                     # nothing was launched
    monkeypatch.setattr(gst, "DIRECT_LAUNCH", False)
    off = gst.GradSummaryPlan(x)
    off.launch(x.clone(), out, scale=scale)
    off.launch(x.clone(), out, scale=scale)
    assert off.bound(x, out, scale) is None                  # direct launches off: never bound
