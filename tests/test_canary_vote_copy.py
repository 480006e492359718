"""Cross-device vote (simulated devices on the CPU) and the data-movement canaries."""
from __future__ import annotations

import pytest
import torch

from probes import canary_copy as cc
from probes import canary_random as cr
from probes.canary_faults import (FaultyAllReduce, FaultyCopier, FaultyDevice, FaultyMatmul, SimCopier,
                                  cpu_all_reduce, simulated_devices)
from sdcwatch.canary import Status

SPEC = cr.RandomSpec("fp32", 32, 32, 64, seed=5)


def test_vote_outputs_pure_cases() -> None:
    a, b = (1, 2), (1, 3)
    v = cr.vote_outputs({"g0": a, "g1": b, "g2": a})
    assert v.odd == ("g1",) and set(v.agree) == {"g0", "g2"} and not v.undecided
    v = cr.vote_outputs({"g0": a, "g1": b})
    assert v.odd == () and set(v.split) == {"g0", "g1"}
    v = cr.vote_outputs({"g0": a, "g1": b, "g2": a, "h0": b}, {"g0": "A", "g1": "A", "g2": "A", "h0": "H"})
    assert v.odd == ("g1",) and v.undecided == ("h0",) and v.split == ()
    v = cr.vote_outputs({"g0": a, "g1": b, "g2": (9, 9)})
    assert set(v.split) == {"g0", "g1", "g2"}


def test_one_gpu_of_three_with_a_different_bit_is_named() -> None:
    devs = simulated_devices(3)
    res = cr.run_random(SPEC, devs, matmul_for=FaultyDevice("sim-1", FaultyMatmul("output", (3, 4), 0)))
    status = {r.devices[0]: r.status for r in res}
    assert status == {"sim-0": Status.PASS, "sim-1": Status.FAIL, "sim-2": Status.PASS}
    bad = next(r for r in res if r.status is Status.FAIL)
    assert bad.details["mismatch"]["rows"] == [3] and bad.details["mismatch"]["cols"] == [4]
    assert "outvoted" in bad.why


def test_two_gpus_that_disagree_are_both_suspect_unless_the_bound_decides() -> None:
    devs = simulated_devices(2)
    low = cr.run_random(SPEC, devs, matmul_for=FaultyDevice("sim-1", FaultyMatmul("output", (0, 0), 0)))
    assert [r.status for r in low] == [Status.FAIL, Status.FAIL]
    high = cr.run_random(SPEC, devs, matmul_for=FaultyDevice("sim-1", FaultyMatmul("output", (0, 0), 29)))
    assert {r.devices[0]: r.status for r in high} == {"sim-0": Status.PASS, "sim-1": Status.FAIL}


def test_single_device_is_judged_by_the_float64_bound() -> None:
    dev = simulated_devices(1)
    assert cr.run_random(SPEC, dev)[0].status is Status.PASS
    bad = cr.run_random(SPEC, dev, matmul_for=FaultyDevice("sim-0", FaultyMatmul("output", (1, 1), 30)))[0]
    assert bad.status is Status.FAIL and bad.details["float64_bound"]["worst"]["row"] == 1


def test_rounding_bound_holds_for_bf16_and_tf32_rounding() -> None:
    for dt in ("bf16", "fp16", "tf32"):
        spec = cr.RandomSpec(dt, 32, 32, 128, seed=2)
        a, bt = cr.random_host_inputs(spec)
        if spec.info.tf32:   # emulate TF32 inputs: round to 10 mantissa bits
            a = (a.view(torch.int32) & ~0x1FFF).view(torch.float32)
            bt = (bt.view(torch.int32) & ~0x1FFF).view(torch.float32)
        out = (a.float() @ bt.float().t()).to(spec.out_dtype)
        assert cr.bound_check(spec, out)["ok"], dt


def test_determinism_check_detects_nondeterminism() -> None:
    dev = simulated_devices(1)[0]
    calls = {"n": 0}

    def flaky(a, b, spec):
        calls["n"] += 1
        out = a @ b
        return out + (1e-3 if calls["n"] % 2 else 0.0)

    r = cr.determinism_check(SPEC, dev, lambda d: flaky)
    assert r.status is Status.UNKNOWN and "float64 bound" in r.why
    assert cr.determinism_check(SPEC, dev).status is Status.PASS


def test_bit_pattern_has_the_fixed_blocks() -> None:
    p = cc.bit_pattern(6 * cc.BLOCK, seed=1)
    assert int(p[: cc.BLOCK].max()) == 0 and int(p[cc.BLOCK: 2 * cc.BLOCK].min()) == 255
    assert int(p[2 * cc.BLOCK]) == 0x55 and int(p[3 * cc.BLOCK]) == 0xAA
    assert p[4 * cc.BLOCK: 4 * cc.BLOCK + 8].tolist() == [1, 2, 4, 8, 16, 32, 64, 128]
    assert torch.equal(p, cc.bit_pattern(6 * cc.BLOCK, seed=1))


@pytest.mark.parametrize("nbytes", [1, 4095, 4 * 4096 + 9, 5 * 4096 + 100, 6 * 4096 + 5, 13 * 4096 + 3,
                                    11 * 4096 + 77])
def test_bit_pattern_matches_its_per_byte_definition(nbytes: int) -> None:
    """Built block-wise for speed, every fixed block is its per-byte definition (partial last blocks
    included) and the random blocks are seeded: the same for a seed, different across seeds."""
    fixed = {0: 0x00, 1: 0xFF, 2: 0x55, 3: 0xAA}
    p = cc.bit_pattern(nbytes, seed=7).tolist()
    for i, v in enumerate(p):
        kind = (i // cc.BLOCK) % 6
        if kind in fixed:
            assert v == fixed[kind], i
        elif kind == 4:
            assert v == 1 << (i % 8), i
    assert cc.bit_pattern(nbytes, seed=7).tolist() == p
    random = [v for i, v in enumerate(p) if (i // cc.BLOCK) % 6 == 5]
    if len(random) > 64:
        other = [v for i, v in enumerate(cc.bit_pattern(nbytes, seed=8).tolist()) if (i // cc.BLOCK) % 6 == 5]
        assert other != random and len(set(random)) > 64


def test_h2d_corrupted_byte_is_found() -> None:
    dev = simulated_devices(1)[0]
    assert cc.check_h2d(dev, 1 << 16, SimCopier()).status is Status.PASS
    r = cc.check_h2d(dev, 1 << 16, FaultyCopier(offset=12345, mask=0x04, h2d_device="sim-0", inner=SimCopier()))
    assert r.status is Status.FAIL and r.details["mismatch"]["offsets"] == [12345]
    assert r.details["mismatch"]["bytes"][0]["xor"] == "0x4"


def test_p2p_corrupted_byte_names_the_pair() -> None:
    devs = simulated_devices(3)
    res = cc.check_p2p_all(devs, 1 << 14, FaultyCopier(offset=7, pair=("sim-2", "sim-0"), inner=SimCopier()))
    assert len(res) == 6
    failed = [r for r in res if r.status is Status.FAIL]
    assert [r.devices for r in failed] == [("sim-2", "sim-0")]
    assert "sim-2 -> sim-0" in failed[0].why
    assert cc.blame_pairs(res) == {"pairs": [["sim-2", "sim-0"]], "common_device": ["sim-0", "sim-2"]}


def test_allreduce_known_answer_and_fault() -> None:
    devs = simulated_devices(3)
    assert cc.check_allreduce(devs, 1 << 12, cpu_all_reduce).status is Status.PASS
    r = cc.check_allreduce(devs, 1 << 12, FaultyAllReduce(rank=2, offset=100))
    assert r.status is Status.FAIL and r.devices == ("sim-2",)
    assert cc.check_allreduce(devs[:1], 16).status is Status.UNKNOWN
    assert "CUDA" in cc.check_allreduce(devs, 16).why
