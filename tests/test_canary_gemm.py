"""Known-answer construction, exactness, comparison and localisation (CPU)."""
from __future__ import annotations

import pytest
import torch

from checksums import canary_gemm as cg
from sdcwatch.canary import DeviceInfo, Status
from probes.canary_faults import FaultyMatmul, flip_bit

CPU = DeviceInfo("cpu", "cpu")


@pytest.mark.parametrize("dtype", cg.ALL_DTYPES)
@pytest.mark.parametrize("shape", [("small", 64, 64, 64), ("large", 8192, 8192, 8192), ("skinny", 16, 4096, 8192),
                                   ("splitk", 128, 128, 32768)])
def test_value_ranges_keep_every_partial_sum_exact(dtype: str, shape: tuple) -> None:
    _, m, n, k = shape
    if dtype.startswith("fp8") and k > 16384:
        k = 16384
    spec = cg.KnownAnswerSpec(dtype, m, n, k)
    ra, rb, e = cg.value_ranges(spec)
    assert ra >= 1 and rb >= 1
    assert k * ra * rb * 4 ** e < 2 ** 24
    info = spec.info
    assert ra * 2 ** e <= info.max_int_a and rb * 2 ** e <= info.max_int_b * 2 ** e


@pytest.mark.parametrize("dtype", cg.ALL_DTYPES)
def test_inputs_are_exact_in_their_dtype_and_expected_is_the_exact_product(dtype: str) -> None:
    spec = cg.KnownAnswerSpec(dtype, 48, 32, 256, seed=3)
    a, b = cg.build_inputs(spec, "cpu")
    tiles = cg.base_tiles(spec)
    a_exact = cg._expand_rows(tiles.a0, spec.m) * tiles.row_scale[:, None]
    b_exact = (cg._expand_rows(tiles.b0.t().contiguous(), spec.n) * tiles.col_scale[:, None]).t()
    assert torch.equal(a.float(), a_exact + 0.0) and torch.equal(b.float(), b_exact + 0.0)
    exact = a.double() @ b.double()
    assert torch.equal(exact, exact.round())
    expected = cg.expected_output(spec)
    assert expected.dtype == spec.out_dtype
    assert torch.equal(expected, exact.float().to(spec.out_dtype))   # one RNE rounding from the exact value
    if spec.out_dtype == torch.float32:
        assert torch.equal(expected.double(), exact)


def test_fp8_b_is_column_major() -> None:
    _, b = cg.build_inputs(cg.KnownAnswerSpec("fp8_e4m3", 32, 48, 64), "cpu")
    assert b.shape == (64, 48) and b.stride() == (1, 64)


def test_fp32_known_answer_passes_on_cpu_for_every_tiny_shape() -> None:
    for spec in cg.known_answer_specs("full", ["fp32"], "cpu"):
        r = cg.run_known_answer(spec, CPU, repeats=1)
        assert r.status is Status.PASS, r.why
        assert r.details["expected_fingerprint"] == r.details["actual_fingerprint"]


def test_negative_zero_is_canonical() -> None:
    spec = cg.KnownAnswerSpec("fp32", 16, 128, 256)
    e = cg.expected_output(spec)
    assert not bool(((e == 0) & torch.signbit(e)).any())


def test_one_thousand_clean_runs_never_fail() -> None:
    fails = [s for s in range(1000)
             if cg.run_known_answer(cg.KnownAnswerSpec("fp32", 16, 16, 32, seed=s), CPU).status is not Status.PASS]
    assert fails == []


@pytest.mark.parametrize("bit", [0, 12, 31])
def test_corrupted_output_element_names_element_and_tile(bit: int) -> None:
    spec = cg.KnownAnswerSpec("fp32", 64, 256, 128, shape_name="t")
    r = cg.run_known_answer(spec, CPU, matmul=FaultyMatmul("output", (37, 200), bit), tile=(32, 64))
    assert r.status is Status.FAIL
    mm = r.details["mismatch"]
    assert mm["count"] == 1 and mm["pattern"] == "element"
    assert mm["tiles"] == [[1, 3]] and mm["rows"] == [37] and mm["cols"] == [200]
    assert int(mm["positions"][0]["xor"], 16) == 1 << bit
    assert r.details["expected_fingerprint"] != r.details["actual_fingerprint"]


def test_corrupted_input_row_and_column_are_named() -> None:
    spec = cg.KnownAnswerSpec("fp32", 64, 256, 128)
    ra = cg.run_known_answer(spec, CPU, matmul=FaultyMatmul("input_a", (5, 17), 30))
    assert ra.status is Status.FAIL and ra.details["mismatch"]["rows"] == [5]
    assert ra.details["mismatch"]["pattern"] == "row"
    rb = cg.run_known_answer(spec, CPU, matmul=FaultyMatmul("input_b", (17, 130), 30))
    assert rb.status is Status.FAIL and rb.details["mismatch"]["cols"] == [130]
    assert rb.details["mismatch"]["pattern"] == "column"


def test_localise_tile_pattern_and_identity() -> None:
    e = torch.zeros(256, 256)
    assert cg.localise(e, e.clone()) is None
    a = e.clone()
    a[130:140, 5:9] = 1.0
    m = cg.localise(e, a, tile=(128, 128))
    assert m is not None and m.pattern == "tile" and m.tiles == [[1, 0]] and m.count == 40
    assert "tile (1, 0)" in m.summary()
    with pytest.raises(ValueError):
        cg.localise(e, torch.zeros(2, 2))


def test_flip_bit_bf16_sign_and_strided() -> None:
    t = torch.ones(4, 4, dtype=torch.bfloat16)
    f = flip_bit(t, (1, 2), 15)
    assert float(f[1, 2]) == -1.0 and float(t[1, 2]) == 1.0
    s = torch.ones(8, 4).t()          # column-major view
    g = flip_bit(s, (3, 5), 31)
    assert g.stride() == s.stride() and float(g[3, 5]) == -1.0 and int((g != s).sum()) == 1


def test_bad_specs_are_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="unknown canary dtype"):
        cg.KnownAnswerSpec("int4", 1, 1, 1)
    with pytest.raises(ValueError, match="multiples of 16"):
        cg.KnownAnswerSpec("fp8_e4m3", 10, 16, 16)
    with pytest.raises(ValueError, match="too large"):
        cg.KnownAnswerSpec("fp32", 16, 16, 1 << 25)


def test_settings_restored_after_the_check() -> None:
    m = torch.backends.cuda.matmul
    before = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    with cg.exact_matmul_settings(tf32=False):
        assert m.allow_bf16_reduced_precision_reduction is False
        assert m.allow_fp16_reduced_precision_reduction is False
    assert (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction) == before


def test_cpu_supports_fp32_only_with_reasons() -> None:
    ok, why = cg.supported_dtypes("cpu")
    assert ok == ["fp32"] and set(why) == set(cg.ALL_DTYPES) - {"fp32"}
