"""The loss detector on hand-made sequences: one test per class, plus the rollback policy."""
from __future__ import annotations

import math

import numpy as np
import pytest

from probes.loss_detector import LossDetector, LossDetectorConfig, LossEvent, RollbackPolicy
from sdcwatch.types import Finding, Severity
from sdcwatch import event_kinds as ek


def noisy(n: int, level: float = 3.0, sigma: float = 0.01, seed: int = 0, decay: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return level * (1 + decay * 1000 / (t + 1000)) * np.exp(rng.normal(0, sigma, n))


def feed(det: LossDetector, losses, start: int = 0, grads=None, scales=None) -> list[LossEvent]:
    out: list[LossEvent] = []
    for i, x in enumerate(losses):
        g = None if grads is None else float(grads[i])
        s = None if scales is None else float(scales[i])
        out += det.update(start + i, float(x), g, float(i), loss_scale=s)
    return out


def crit(events: list[LossEvent]) -> list[LossEvent]:
    return [e for e in events if e.severity == Severity.CRITICAL]


def test_clean_decaying_curve_has_no_events() -> None:
    events = feed(LossDetector(), noisy(3000, decay=1.0))
    assert crit(events) == []
    assert [e for e in events if e.kind == "spike"] == []


def test_nan_is_critical_on_its_step_once_per_run() -> None:
    x = noisy(300)
    x[200:205] = math.nan
    x[250] = math.inf
    events = feed(LossDetector(), x)
    nonfinite = [e for e in events if e.kind == "nonfinite"]
    assert [(e.step, e.severity) for e in nonfinite] == [(200, Severity.CRITICAL), (250, Severity.CRITICAL)]
    assert nonfinite[0].start_step == 200 and nonfinite[0].signal == "loss"


def test_nan_grad_norm_is_critical_without_a_loss_scale_but_not_with_one() -> None:
    x, g = noisy(100), noisy(100, level=1.0, sigma=0.1, seed=1)
    g[60] = math.nan
    events = feed(LossDetector(), x, grads=g)
    assert [(e.step, e.signal, e.kind) for e in crit(events)] == [(60, "grad_norm", "nonfinite")]
    g[60] = math.inf      # an fp16 overflow step: the scaler skips it
    scales = np.full(100, 2.0 ** 16)
    assert crit(feed(LossDetector(), x, grads=g, scales=scales)) == []


def test_one_step_spike_is_a_warning_then_recovers_never_critical() -> None:
    x = noisy(400)
    x[200] *= 4.0
    events = feed(LossDetector(), x)
    assert crit(events) == []
    spike = [e for e in events if e.kind == "spike"]
    assert len(spike) == 1 and spike[0].step == 200 and spike[0].severity == Severity.WARNING
    assert spike[0].magnitude == pytest.approx(4.0, rel=0.05)
    rec = [e for e in events if e.kind == "recovered"]
    assert len(rec) == 1 and rec[0].severity == Severity.INFO and rec[0].step > 200


def test_short_decaying_spike_is_not_critical() -> None:
    x = noisy(400)
    x[200:215] *= 1 + 3 * np.exp(-np.arange(15) / 3.0)
    events = feed(LossDetector(), x)
    assert crit(events) == [] and any(e.kind == "spike" for e in events)


@pytest.mark.parametrize("jump", [1.2, 1.5, 3.0])
def test_sustained_jump_is_critical_within_patience(jump: float) -> None:
    cfg = LossDetectorConfig()
    x = noisy(600, sigma=0.02)
    x[300:] *= jump
    events = crit(feed(LossDetector(cfg), x))
    assert len(events) == 1
    ev = events[0]
    assert ev.kind == "sustained" and ev.signal == "loss"
    assert 300 + cfg.patience_steps <= ev.step <= 300 + 50
    assert 295 <= ev.start_step <= 305
    assert ev.magnitude == pytest.approx(jump, rel=0.1)


def test_spike_that_does_not_recover_becomes_sustained() -> None:
    x = noisy(600)
    x[300] *= 5
    x[301:] *= 1.8
    kinds = [(e.kind, e.severity) for e in feed(LossDetector(), x)]
    assert ("spike", Severity.WARNING) in kinds and ("sustained", Severity.CRITICAL) in kinds


def test_slow_divergence_is_critical_before_the_loss_doubles() -> None:
    x = noisy(3000, sigma=0.02)
    t = np.arange(3000)
    x[1000:] *= np.exp(math.log(2) * (t[1000:] - 1000) / 1500)   # doubles at step 2500
    events = crit(feed(LossDetector(), x))
    assert events and events[0].kind in ("divergence", "sustained")
    assert 1000 < events[0].step < 2500
    assert events[0].start_step >= 900


def test_gradual_rise_is_labelled_divergence() -> None:
    x = noisy(4000, sigma=0.01)
    t = np.arange(4000)
    x[1000:] *= 1 + (t[1000:] - 1000) / 2000          # linear in the loss: doubles at step 3000
    events = crit(feed(LossDetector(), x))
    assert events and events[0].kind == "divergence" and events[0].step < 3000


def test_lr_warmup_and_benign_shift_are_not_anomalies() -> None:
    # a from-scratch curve falling from ~10 during warm-up, then a 6% benign shift (a data change)
    t = np.arange(3000)
    x = (2.5 + 8 * (1 + t / 50) ** -0.6) * np.exp(np.random.default_rng(3).normal(0, 0.02, 3000))
    x[1500:] *= 1 + 0.06 * np.minimum(1, (t[1500:] - 1500) / 50)
    assert crit(feed(LossDetector(), x)) == []


def test_step_gaps_are_nothing() -> None:
    x = noisy(200)
    steps = np.cumsum(np.random.default_rng(1).integers(1, 500, 200))
    det = LossDetector()
    events = [e for i, v in enumerate(x) for e in det.update(int(steps[i]), float(v), None, float(i))]
    assert events == []


def test_grad_norm_spike_warns_before_the_loss() -> None:
    x, g = noisy(400), noisy(400, level=0.3, sigma=0.1, seed=2)
    g[250:256] *= [4, 10, 60, 400, 900, 300]
    x[253] *= 2.3
    events = feed(LossDetector(), x, grads=g)
    grad = [e for e in events if e.signal == "grad_norm" and e.kind == "spike"]
    loss = [e for e in events if e.signal == "loss" and e.kind == "spike"]
    assert grad and loss and grad[0].step < loss[0].step
    assert all(e.severity != Severity.CRITICAL for e in events if e.signal == "grad_norm")


def test_loss_scale_collapse() -> None:
    n = 300
    scales = np.full(n, 2.0 ** 16)
    scales[200:] = 2.0 ** 16 / 2.0 ** np.minimum(np.arange(1, n - 199), 16)
    events = crit(feed(LossDetector(), noisy(n), scales=scales))
    assert len(events) == 1 and events[0].kind == "loss_scale_collapse"
    assert events[0].step == 202 and events[0].start_step == 200     # 8x below the settled 65536


def test_loss_scale_calibration_and_constant_bf16_scale_are_fine() -> None:
    calib = np.array([2.0 ** max(16, 32 - i) for i in range(400)])   # halving from 2^32 to 2^16
    assert crit(feed(LossDetector(), noisy(400), scales=calib)) == []
    assert crit(feed(LossDetector(), noisy(400), scales=np.ones(400))) == []


def test_occasional_overflow_halving_is_fine() -> None:
    scales = np.full(2000, 2.0 ** 16)
    scales[500:] /= 2
    scales[1200:] /= 2
    assert crit(feed(LossDetector(), noisy(2000), scales=scales)) == []


def test_restart_from_checkpoint_drops_the_open_anomaly() -> None:
    det = LossDetector()
    x = noisy(400)
    feed(det, x[:300])
    feed(det, x[300:310] * 2.0, start=300)          # a spike episode opens
    events = feed(det, x[310:400], start=250)        # restarted from a checkpoint at step 250
    assert crit(events) == []


def _power_law(steps: range, seed: int) -> np.ndarray:
    """A small model's decay (a power of the step), 2% noise."""
    rng = np.random.default_rng(seed)
    return np.array([2.0 * (s + 10) ** -0.8 for s in steps]) * np.exp(rng.normal(0, 0.02, len(steps)))


@pytest.mark.parametrize("frozen", [20, 80, 150])
def test_a_replay_after_a_long_frozen_stretch_is_judged_against_the_steps_before_the_restore(frozen: int) -> None:
    """A replica mismatch at step 100: every update vetoed (the weights frozen, the loss flat) until the
    rollback to step 50 came, `frozen` steps later (a loaded agent). The replay's losses from step 51 are
    those of a model 50 steps younger, above the flat stretch: judged against a trend that kept the frozen
    stretch they read as a sustained rise from step 51 (a second rollback that skipped 199 good batches).
    Judged against the steps before the restore, the replay is clean, and a real rise in it still pages."""
    det = LossDetector()
    feed(det, _power_law(range(0, 101), 1))
    level = 2.0 * 110 ** -0.8
    feed(det, level * np.exp(np.random.default_rng(2).normal(0, 0.02, frozen)), start=101)
    replay = _power_law(range(51, 400), 3)
    assert crit(feed(det, replay[:250], start=51)) == []
    risen = feed(det, replay[250:] * 3.0, start=301)           # the data goes bad at step 301 of the replay
    assert [(e.kind, e.start_step >= 290) for e in crit(risen)][:1] == [("sustained", True)], crit(risen)


def test_per_rank_noise_does_not_page() -> None:
    # several ranks' micro-batch losses reported at the same step (heavy-tailed, 5% noise)
    rng = np.random.default_rng(5)
    det = LossDetector()
    events = []
    for step in range(2000):
        for _ in range(4):
            events += det.update(step, 3.0 * math.exp(0.05 * rng.standard_t(4) / math.sqrt(2)), None, 0.0)
    assert crit(events) == []


def test_non_positive_values_are_ignored_and_zero_grad_norm_is_not_an_anomaly() -> None:
    x = noisy(200)
    events = feed(LossDetector(), x, grads=np.zeros(200))
    assert events == []


def test_flush_reports_an_open_excursion() -> None:
    det = LossDetector()
    feed(det, noisy(100))
    feed(det, [9.0, 9.0], start=100)
    out = det.flush(now=1.0)
    assert len(out) == 1 and out[0].kind == "spike" and out[0].start_step == 100


def test_event_to_finding() -> None:
    x = noisy(100)
    x[50] = math.nan
    ev = crit(feed(LossDetector(), x))[0]
    f = ev.to_finding("job-1", rank=3)
    assert isinstance(f, Finding)
    assert f.kind is ek.LOSS_NONFINITE and f.severity == Severity.CRITICAL and f.subject == "job/job-1/rank/3"
    assert f.details["step"] == 50 and f.details["value"] == "nan"


@pytest.mark.parametrize("bad", [dict(window=0), dict(spike_ratio=1.0), dict(sustained_z=-1.0),
                                 dict(min_samples=500), dict(patience_steps=2.5), dict(loss_scale_floor=0.0),
                                 dict(divergence_max_jump=0.0), dict(warmup_steps=-1)])
def test_config_is_validated(bad: dict) -> None:
    with pytest.raises(ValueError, match="LossDetectorConfig"):
        LossDetectorConfig(**bad)


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        LossDetectorConfig(128)  # type: ignore[misc]


def test_step_must_be_an_int() -> None:
    with pytest.raises(ValueError, match="step"):
        LossDetector().update(1.5, 3.0, None, 0.0)  # type: ignore[arg-type]


def test_warmup_steps_suppress_level_rules() -> None:
    x = noisy(300)
    x[100:] *= 2
    assert crit(feed(LossDetector(LossDetectorConfig(warmup_steps=1000)), x)) == []


# -- rollback policy --------------------------------------------------------------------------------

def _event(kind: str = "sustained", start: int = 1000, severity: Severity = Severity.CRITICAL) -> LossEvent:
    return LossEvent(step=start + 40, kind=kind, signal="loss", severity=severity, value=6.0, baseline=3.0,  # type: ignore[arg-type]
                     magnitude=2.0, start_step=start, message="")


def test_rollback_targets_newest_verified_step_strictly_older() -> None:
    d = RollbackPolicy().decide(_event(start=1000), [200, 600, 900, 1000, 1100])
    assert d is not None and d.target_step == 900
    assert d.skip_batches == 200 and d.skip_from_step == 900 and d.skip_to_step == 1100


def test_rollback_skip_window_starts_before_the_anomaly() -> None:
    d = RollbackPolicy(skip_batches=300, skip_before_steps=100).decide(_event(start=5000), [1000, 2000])
    assert d is not None and d.target_step == 2000 and (d.skip_from_step, d.skip_to_step) == (4900, 5200)


def test_rollback_none_without_older_checkpoint_or_for_non_critical() -> None:
    assert RollbackPolicy().decide(_event(start=100), [100, 200]) is None
    assert RollbackPolicy().decide(_event(kind="spike", severity=Severity.WARNING), [1, 2]) is None
    assert RollbackPolicy().decide(_event(), []) is None
    with pytest.raises(ValueError):
        RollbackPolicy(skip_batches=-1)


def falling(n: int, sigma: float, seed: int = 0, start: int = 0) -> np.ndarray:
    """A from-scratch loss falling steeply (10.8 -> ~2.5, a power law), multiplicative noise `sigma`."""
    rng = np.random.default_rng(seed)
    t = np.arange(start, start + n)
    return (2.2 + 8.6 * (1 + t / 40.0) ** -0.7) * np.exp(rng.normal(0, sigma, n))


@pytest.mark.parametrize("at", [150, 1500])
def test_a_small_shift_many_sigma_wide_is_caught_on_a_falling_curve(at: int) -> None:
    """+8% is 16 sigma of 0.5% noise: caught (a WARNING level shift, under the 1.1x of a page) within 50
    steps, in the steep early decline (step 150) and later (step 1500): the trend follows the curve."""
    x = falling(2500, 0.005, seed=at)
    x[at:] *= 1.08
    events = feed(LossDetector(), x)
    assert crit(events) == []
    shift = [e for e in events if e.kind == "shift" and e.signal == "loss"]
    assert shift and shift[0].severity == Severity.WARNING and at <= shift[0].step <= at + 50
    assert abs(shift[0].start_step - at) <= 5 and shift[0].magnitude == pytest.approx(1.08, abs=0.02)


@pytest.mark.parametrize("at", [150, 1500])
def test_a_15pct_shift_pages_within_50_steps_even_while_the_loss_falls_steeply(at: int) -> None:
    x = falling(2500, 0.01, seed=at)
    x[at:] *= 1.15
    events = crit(feed(LossDetector(), x))
    assert len(events) == 1 and events[0].kind == "sustained" and at <= events[0].step <= at + 50
    assert abs(events[0].start_step - at) <= 5


def test_an_episode_closes_and_a_jump_on_top_is_caught_with_its_size() -> None:
    """A +5% shift (10 sigma) is a WARNING and becomes the level; a x1.5 jump on top is then CRITICAL
    within 50 steps, measured against the shifted level (not the old one)."""
    x = noisy(3000, sigma=0.005, seed=4)
    x[1000:] *= 1.05
    x[2000:] *= 1.5
    events = feed(LossDetector(), x)
    warn = [e for e in events if e.kind == "shift" and e.severity == Severity.WARNING]
    assert warn and 1000 <= warn[0].step <= 1050
    (page,) = crit(events)
    assert 2000 <= page.step <= 2050 and 1990 <= page.start_step <= 2002     # early is the safe side
    assert page.magnitude == pytest.approx(1.5, rel=0.05)


def test_ramp_onset_is_estimated_and_the_rollback_lands_before_it() -> None:
    x = noisy(2000, sigma=0.005, seed=6)
    k = np.arange(2000 - 1000)
    x[1000:] *= np.exp(np.log(1.5) * np.minimum(1.0, (k + 1) / 100))     # from step 1000 on
    page = crit(feed(LossDetector(), x))[0]
    assert page.kind == "sustained" and page.step <= 1050 and abs(page.start_step - 1000) <= 10
    decision = RollbackPolicy().decide(page, list(range(0, 2000, 50)))
    assert decision is not None and decision.target_step < 1000


def test_a_lone_blip_under_2x_is_not_reported_a_confirmed_one_is() -> None:
    x = noisy(400)
    x[200] *= 1.6
    assert feed(LossDetector(), x) == []
    x[201] *= 1.6
    (spike, rec) = feed(LossDetector(), x)
    assert (spike.kind, spike.step, spike.start_step, spike.severity) == ("spike", 201, 200, Severity.WARNING)
    assert rec.kind == "recovered"


def test_no_grad_norm_warning_in_the_first_steps_of_a_clean_run() -> None:
    """A run from scratch: gradient norms swing 3x during the first steps (the GPU demo warned at steps
    10 and 15): nothing is reported."""
    rng = np.random.default_rng(8)
    t = np.arange(600)
    grads = (1 + 3 * np.exp(-t / 200.0)) * np.exp(rng.normal(0, 0.1 + 0.6 * np.exp(-t / 25.0)))
    events = feed(LossDetector(), falling(600, 0.01), grads=grads)
    assert events == []


def test_heavy_tailed_noisy_curve_warns_rarely() -> None:
    """5% noise with Student-t (4) tails, 20,000 steps: no page, and at most 2 warnings per 10,000 steps."""
    rng = np.random.default_rng(9)
    x = falling(20_000, 0.0) * np.exp(0.05 * rng.standard_t(4, 20_000) / math.sqrt(2))
    events = feed(LossDetector(), x)
    assert crit(events) == []
    assert len([e for e in events if e.severity == Severity.WARNING]) <= 4


@pytest.mark.parametrize("sigma", [0.01, 0.03, 0.045])
def test_noisy_ramp_start_is_before_the_climb(sigma: float) -> None:
    """A slow ramp in noise: the reported start (the rollback's bound) is before the climb began, for
    every seed, and not far before it (the onset_slack bound, issue 22)."""
    for seed in range(8):
        x = noisy(1400, sigma=sigma, seed=seed)
        ramp = np.clip((np.arange(1400) - 1000) / 150.0, 0.0, 1.0)
        x = x * np.exp(math.log(1.3) * ramp)
        events = crit(feed(LossDetector(), x))
        assert events, f"seed {seed}: the ramp was not caught"
        assert 1000 - 120 <= events[0].start_step <= 1000, (seed, events[0])


def test_onset_slack_zero_reports_the_best_knot_later_than_the_bound() -> None:
    x = noisy(1400, sigma=0.03, seed=3) * np.exp(math.log(1.3) * np.clip((np.arange(1400) - 1000) / 150.0, 0, 1))
    bound = crit(feed(LossDetector(), x))[0].start_step
    best = crit(feed(LossDetector(LossDetectorConfig(onset_slack=0.0)), x))[0].start_step
    assert bound <= best


def test_a_lone_grad_norm_sample_is_not_a_warning_but_two_in_a_row_are() -> None:
    """The H200's clean run had lone grad-norm samples of 4-9x its baseline, back on the next step."""
    x, g = noisy(600), noisy(600, level=0.6, sigma=0.1, seed=4)
    g[340] *= 9.4
    g[480] *= 8.4
    events = feed(LossDetector(), x, grads=g)
    assert [e for e in events if e.severity >= Severity.WARNING] == []
    g[520:522] *= 9.0
    events = feed(LossDetector(), x, grads=g)
    warned = [e for e in events if e.severity >= Severity.WARNING]
    assert [(e.signal, e.kind, e.start_step) for e in warned] == [("grad_norm", "spike", 520)]
    g[560] *= 1000.0       # an exponent flip or an overflow: reported on its own sample
    assert any(e.start_step == 560 and e.step == 560 for e in feed(LossDetector(), x, grads=g))
