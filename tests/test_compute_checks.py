"""The compute checks (issue 19): the cross-rank comparison and the replay classification as pure logic, and
three real gloo ranks under DDP with faults injected in one rank's forward and gradient (bench/compute_faults)."""
from __future__ import annotations

import math

import pytest
import torch

from bench import compute_faults
from checksums.compute_gate import _choose_mask
from checksums.grad_checks import SpreadTracker, bucket_summary, stats_of
from checksums.replay import Cause, audit_every, classify_replays


def _stats(norms: list[float], amax: list[float] | None = None, buckets: int = 2) -> torch.Tensor:
    amax = amax if amax is not None else norms
    return torch.tensor([[[n, a]] * buckets for n, a in zip(norms, amax)], dtype=torch.float64)


def _rows(fp: int, world: int = 3, buckets: int = 2) -> torch.Tensor:
    row = torch.tensor([0, 0, fp, fp + 1], dtype=torch.int64)
    return row.repeat(world, buckets, 1)


def test_spread_learns_then_names_the_outlier_rank():
    t = SpreadTracker(margin=3.0, warmup=5)
    for k in range(5):
        v = t.judge(_stats([1.0, 1.1 + 0.01 * k, 0.95]))
        assert v.warming and v.suspects == ()
    assert t.judge(_stats([1.0, 1.08, 0.97])).suspects == ()
    v = t.judge(_stats([1.0, 40.0, 0.97]))
    assert v.outliers == (1,) and v.scores[1] > 3.0 and v.stat in ("norm", "maxabs")
    # a clean step after it still passes: the outlier did not widen the spread
    assert t.judge(_stats([1.0, 1.08, 0.97])).suspects == ()


def test_non_finite_names_the_rank_at_once_even_while_warming():
    t = SpreadTracker(warmup=100)
    v = t.judge(_stats([1.0, 1.0, math.nan, 1.0]))
    assert v.nonfinite == (2,) and v.suspects == (2,)
    v = t.judge(_stats([math.inf, 1.0, 1.0, 1.0]))
    assert v.nonfinite == (0,)


def test_two_ranks_make_both_suspects():
    t = SpreadTracker(warmup=3)
    for _ in range(3):
        t.judge(_stats([1.0, 1.1]))
    assert t.judge(_stats([1.0, 100.0])).outliers == (0, 1)


def test_buckets_rebuilt_restart_learning():
    t = SpreadTracker(warmup=2)
    t.judge(_stats([1.0, 1.1, 1.0], buckets=1))
    t.judge(_stats([1.0, 1.1, 1.0], buckets=1))
    assert t.judge(_stats([1.0, 50.0, 1.0], buckets=3)).warming


def test_margin_must_exceed_one():
    with pytest.raises(ValueError, match="margin"):
        SpreadTracker(margin=1.0)


def test_bucket_summary_carries_nan_and_exact_fingerprint():
    g = [torch.ones(3, 4), torch.arange(5.0)]
    a, b = bucket_summary(g), bucket_summary([t.clone() for t in g])
    assert torch.equal(a, b)
    s = stats_of(a)
    assert s[0] == pytest.approx(math.sqrt(12 + 30)) and s[1] == 4.0
    g2 = [g[0].clone(), g[1].clone()]
    g2[1][2] = torch.nextafter(g2[1][2], torch.tensor(10.0))     # one ulp
    assert not torch.equal(bucket_summary(g2)[2:], a[2:])
    g2[0][0, 0] = math.nan
    assert not torch.isfinite(stats_of(bucket_summary(g2))).all()


def test_classify_replays():
    orig_ok, orig_bad = _rows(10)[0], _rows(99)[0]
    same = _rows(10)
    assert classify_replays(1, orig_ok, same).cause is Cause.DATA
    assert not classify_replays(1, orig_ok, same).drop
    c = classify_replays(1, orig_bad, same)
    assert (c.cause, c.faulty, c.drop) == (Cause.TRANSIENT, (1,), True)
    persistent = same.clone()
    persistent[1] = _rows(99)[1]
    c = classify_replays(1, orig_bad, persistent)
    assert (c.cause, c.faulty) == (Cause.PERSISTENT, (1,))
    # the auditor's GPU is the wrong one: the original and the third rank agree
    c = classify_replays(0, orig_ok, persistent)
    assert (c.cause, c.faulty, c.drop) == (Cause.PERSISTENT, (1,), True)
    # two ranks that disagree: no majority
    two = _rows(10, world=2)
    two[1] = _rows(99, world=2)[1]
    c = classify_replays(1, orig_bad, two)
    assert (c.cause, c.faulty, c.drop) == (Cause.UNRESOLVED, (1,), True)
    # two ranks, a transient fault: both replays agree, the original differs
    c = classify_replays(1, orig_bad, _rows(10, world=2))
    assert c.cause is Cause.TRANSIENT


def test_audit_cadence_from_the_budget():
    assert audit_every(0.003, replay_s=0.1, step_s=0.1) == 334
    assert audit_every(0.003, replay_s=0.0, step_s=0.1) == 10
    with pytest.raises(ValueError):
        audit_every(0.0, 1.0, 1.0)


CATCH = ["mm one elem =1e4", "grad elem =100", "grad elem NaN", "mm one elem x1.01 persistent",
         "mm channel x2 persistent", "mm one elem ulp"]


def test_three_gloo_ranks_catch_name_and_drop(tmp_path):
    """The suite form of the harness: each fault on rank 1 is caught, rank 1 named, its update dropped; the
    transient one-ulp fault falls on a step that audits rank 1 (50: audits every 5 take ranks in turn), so the audit catches it."""
    results = compute_faults.main(["--world", "3", "--fault-step", "50", "--cases", ",".join(CATCH),
                                   "--clean", "600", "--audit-every", "5"])
    for name in CATCH:
        caught = results[name]["caught"]
        assert "compute" in caught, f"{name}: not caught ({caught})"
        hit = caught["compute"]
        assert hit["named"] == [1] and hit["dropped"], f"{name}: {hit}"
        assert hit["step"] - 50 <= 5, f"{name}: caught late: {hit}"
    assert results["mm one elem =1e4"]["caught"]["compute"]["cause"] == "transient"
    # the Monitor's step reports carried the finding to the agent's side, naming rank 1's host and GPU
    reported = results["mm one elem =1e4"]["reported"]
    assert reported and reported[0][:3] == [50, "stats", "transient"]
    assert [w[0] for w in reported[0][3]] == [1] and reported[0][3][0][2] == "GPU-fake-1"
    assert results["mm one elem x1.01 persistent"]["caught"]["compute"]["cause"] == "persistent"
    clean = results["clean"]
    assert clean["status"]["suspicions"] == 0 and clean["status"]["dropped"] == 0, clean["status"]
    assert clean["status"]["exact"] and clean["status"]["audits"] >= 100


def test_device_mask_skips_the_update_through_found_inf_and_judges_a_step_later():
    """The CUDA design run on CPU: fused Adam's found_inf masks the suspect step with no host veto (weights,
    moments and step count unchanged); the rows are judged and the masked step replayed at the next step."""
    results = compute_faults.main(["--world", "3", "--fault-step", "47", "--mask", "device",
                                   "--cases", "mm one elem =1e4,grad elem NaN"])
    for name in ("mm one elem =1e4", "grad elem NaN"):
        r = results[name]
        assert r["fault_step_unchanged"] is True, f"{name}: the masked step changed the weights"
        hit = r["caught"]["compute"]
        assert hit["step"] == 47 and hit["named"] == [1] and hit["dropped"], f"{name}: {hit}"


def test_device_mask_needs_a_fused_optimizer():
    plain = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    fused = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], fused=True)
    with pytest.raises(ValueError, match="fused optimizer"):
        _choose_mask("device", plain, torch.device("cpu"))
    assert _choose_mask("device", fused, torch.device("cpu")) == "device"
    assert _choose_mask("auto", fused, torch.device("cpu")) == "host"
    with pytest.raises(ValueError, match="mask is"):
        _choose_mask("sometimes", fused, torch.device("cpu"))
