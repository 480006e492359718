"""Labelled synthetic training curves for evaluating loss-anomaly detectors.

A curve is a power-law loss decay driven by a learning-rate schedule (linear warm-up, then cosine,
WSD or step decay, sometimes a re-warm), with heteroscedastic heavy-tailed multiplicative noise, a
slow benign wander, benign one-step bumps, a gradient norm and (for fp16 curves) a dynamic loss scale.
One anomaly class is injected per curve, labelled with where it starts and, for divergence, where the
noiseless loss has doubled:

  clean                 nothing injected (but all the benign effects above)
  spike                 1-4 transient spikes (x1.3 to x6; one step, a 2-4 step plateau, or a decay
                        with a 1-4 step time constant): they recover well within 20 steps
  sustained             a jump of x1.2 to x3 that stays (abrupt, ramped over 2-10 steps, or a spike
                        that decays onto a plateau)
  divergence            a slow blow-up doubling the loss in 150-2500 steps (exponential, accelerating,
                        or linear in the loss)
  nan                   NaN or Inf loss (one step, a few, or for good), or a NaN grad norm only
  loss_scale_collapse   fp16: overflow on every step from the start (the scale halves to 1)

Seeds: `TUNING_SEEDS` were used to choose the detector's defaults; `EVAL_SEEDS` are for the reported
numbers only. A seed and a class give the same curve on every machine (numpy's PCG64).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

CLASSES = ("clean", "spike", "sustained", "divergence", "nan", "loss_scale_collapse")
TUNING_SEEDS = range(0, 60)
EVAL_SEEDS = range(100_000, 100_120)


@dataclasses.dataclass(frozen=True, slots=True)
class Anomaly:
    kind: str          # one of CLASSES[1:]
    start: int         # first anomalous step
    end: int           # last step the anomaly is visible (for lasting ones, the curve's last step)
    magnitude: float   # peak ratio to the clean loss (spike), plateau ratio (sustained), 2.0 (divergence)
    shape: str
    double_step: int | None = None   # divergence: first step where the noiseless loss is 2x its start


@dataclasses.dataclass(frozen=True, slots=True)
class Curve:
    name: str
    cls: str
    seed: int
    steps: np.ndarray                 # int64, contiguous
    loss: np.ndarray                  # float64, may hold nan/inf
    grad_norm: np.ndarray
    loss_scale: np.ndarray | None     # fp16 curves only
    clean_loss: np.ndarray            # the noiseless loss with the anomaly applied
    anomalies: tuple[Anomaly, ...]

    def __len__(self) -> int:
        return int(self.steps.size)


def _schedule(rng: np.random.Generator, n: int, from_scratch: bool) -> np.ndarray:
    """Learning rate / peak, per step of this curve."""
    total = int(n * rng.uniform(1.0, 4.0))
    t = np.arange(n, dtype=np.float64)
    warm = int(rng.uniform(100, 1500)) if from_scratch else 0
    kind = rng.choice(["cosine", "wsd", "step"])
    if kind == "cosine":
        lr = 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * np.minimum(t / total, 1.0)))
    elif kind == "wsd":
        decay_at = int(n * rng.uniform(0.5, 0.9))
        lr = np.where(t < decay_at, 1.0, np.maximum(0.05, 1.0 - (t - decay_at) / max(1, n - decay_at)))
    else:
        lr = np.ones(n)
        for at in sorted(rng.integers(n // 4, n, size=int(rng.integers(1, 3)))):
            lr[at:] *= rng.uniform(0.1, 0.5)
    if warm:
        lr = lr * np.minimum(1.0, (t + 1) / warm)
    if rng.random() < 0.3:  # a re-warm: the LR jumps back up for the rest (or a while)
        at = int(rng.integers(n // 3, n - 150))
        length = int(rng.integers(100, n - at + 1))
        lr[at:at + length] = np.maximum(lr[at:at + length], rng.uniform(0.5, 1.0))
    return lr


def _base_loss(rng: np.random.Generator, n: int, lr: np.ndarray, step0: int) -> np.ndarray:
    l_inf = rng.uniform(1.6, 3.2)
    l0 = math.log(rng.choice([32_000, 50_257, 128_000, 250_000]))
    alpha = rng.uniform(0.3, 0.8)
    tau0 = rng.uniform(20, 200)
    progress = step0 * rng.uniform(0.5, 1.0) + np.cumsum(lr)
    loss = l_inf + (l0 - l_inf) * (1 + progress / tau0) ** (-alpha)
    anneal = rng.uniform(0.0, 0.08)            # loss drops as the LR anneals (and rises on a re-warm)
    loss = loss * (1 - anneal * (1 - lr))
    if rng.random() < 0.2:                     # a data-mixture change: a small benign level shift
        at = int(rng.integers(n // 4, n))
        f = rng.uniform(0.97, 1.07)
        ramp = np.clip((np.arange(n) - at) / 50.0, 0.0, 1.0)
        loss = loss * (1 + (f - 1) * ramp)
    return loss


def _noise(rng: np.random.Generator, n: int, lr: np.ndarray) -> np.ndarray:
    """Multiplicative log-noise: heavy-tailed, larger at high LR, with a slow mean-reverting wander."""
    sigma0 = math.exp(rng.uniform(math.log(0.004), math.log(0.04)))
    df = float(rng.choice([3.0, 5.0, 30.0]))
    t = rng.standard_t(df, size=n) / math.sqrt(df / (df - 2))
    sigma = sigma0 * (0.6 + 0.4 * lr) * (1 + 0.5 * rng.random())
    wander = np.zeros(n)
    w_sigma, w_keep = sigma0 * 0.05, 0.995
    steps = rng.normal(0.0, w_sigma, size=n)
    for i in range(1, n):
        wander[i] = wander[i - 1] * w_keep + steps[i]
    bumps = np.zeros(n)
    hits = rng.random(n) < 1 / 700             # benign one-step bumps (a hard batch)
    bumps[hits] = np.log(rng.uniform(1.03, 1.15, size=int(hits.sum())))
    return sigma * t + wander + bumps


def _grad_norm(rng: np.random.Generator, n: int, lr: np.ndarray, from_scratch: bool) -> np.ndarray:
    g0 = math.exp(rng.uniform(math.log(0.1), math.log(5.0)))
    t = np.arange(n, dtype=np.float64)
    trend = g0 * (1 + 3 * np.exp(-t / 200.0) if from_scratch else np.ones(n)) * (0.8 + 0.4 * t / n)
    sig = rng.uniform(0.05, 0.3)
    return trend * np.exp(rng.normal(0.0, sig, size=n))


def _loss_scale(rng: np.random.Generator, n: int, from_scratch: bool, collapse_at: int | None) -> np.ndarray:
    scale = 2.0 ** 32 if from_scratch else 2.0 ** int(rng.integers(12, 20))
    out = np.empty(n)
    clean_run = 0
    calibrating = from_scratch
    for i in range(n):
        overflow = (calibrating and scale > 2.0 ** 16) or rng.random() < 1 / 2500 or (
            collapse_at is not None and i >= collapse_at)
        if overflow:
            scale = max(1.0, scale / 2)
            clean_run = 0
        else:
            calibrating = False
            clean_run += 1
            if clean_run >= 1000:
                scale, clean_run = min(scale * 2, 2.0 ** 24), 0
        out[i] = scale
    return out


def _spike_profile(rng: np.random.Generator, n: int, at: int, peak: float) -> tuple[np.ndarray, str, int]:
    """Log-excess of one transient spike starting at `at`; (excess, shape, last visible step index)."""
    ex = np.zeros(n)
    shape = str(rng.choice(["one_step", "plateau", "decay"], p=[0.5, 0.2, 0.3]))
    if shape == "one_step":
        ex[at] = math.log(peak)
        return ex, shape, at
    if shape == "plateau":
        k = int(rng.integers(2, 5))
        ex[at:at + k] = math.log(peak)
        return ex, shape, min(n - 1, at + k - 1)
    tau = rng.uniform(1.0, 4.0)
    k = np.arange(0, 30)
    prof = np.log1p((peak - 1) * np.exp(-k / tau))
    prof = prof[prof > math.log(1.02)]
    m = min(prof.size, n - at)
    ex[at:at + m] = prof[:m]
    return ex, shape, at + m - 1


def make_curve(seed: int, cls: str) -> Curve:
    """The curve of class `cls` for `seed` (deterministic)."""
    if cls not in CLASSES:
        raise ValueError(f"unknown class {cls!r}; classes are {CLASSES}")
    rng = np.random.default_rng([seed, CLASSES.index(cls)])
    from_scratch = rng.random() < 0.5
    step0 = 0 if from_scratch else int(rng.integers(1_000, 200_000))
    fp16 = cls == "loss_scale_collapse" or rng.random() < 0.3
    n = int(rng.integers(1500, 4000))
    lo = 600 if from_scratch else 300
    anomalies: list[Anomaly] = []
    start = int(rng.integers(lo, n - 400))
    double_step = None
    if cls == "divergence":
        d = int(math.exp(rng.uniform(math.log(150), math.log(2500))))
        n = max(n, start + int(1.3 * d) + 50)
    lr = _schedule(rng, n, from_scratch)
    loss = _base_loss(rng, n, lr, step0)
    noise = _noise(rng, n, lr)
    gnorm = _grad_norm(rng, n, lr, from_scratch)
    log_ex = np.zeros(n)          # anomaly, as log excess over the clean loss
    g_ex = np.zeros(n)
    nan_mask = np.zeros(n, dtype=bool)
    inf_mask = np.zeros(n, dtype=bool)
    g_nan = np.zeros(n, dtype=bool)
    steps = np.arange(step0, step0 + n, dtype=np.int64)

    def precursor(at: int, factor: float) -> None:
        lead = int(rng.integers(0, 5))
        k = np.arange(0, 40)
        prof = np.log(factor) * np.exp(-k / rng.uniform(2, 8))
        s0 = max(0, at - lead)
        m = min(prof.size, n - s0)
        g_ex[s0:s0 + m] = np.maximum(g_ex[s0:s0 + m], prof[:m])

    if cls == "spike":
        count = int(rng.integers(1, 5))
        ats = sorted(rng.choice(np.arange(lo, n - 50, 150), size=min(count, len(range(lo, n - 50, 150))),
                            replace=False))
        for at in ats:
            peak = math.exp(rng.uniform(math.log(1.3), math.log(6.0)))
            ex, shape, last = _spike_profile(rng, n, int(at), peak)
            log_ex = np.maximum(log_ex, ex)
            if rng.random() < 0.7:
                precursor(int(at), peak ** rng.uniform(1, 3))
            anomalies.append(Anomaly("spike", int(steps[at]), int(steps[last]), peak, shape))
    elif cls == "sustained":
        m = math.exp(rng.uniform(math.log(1.2), math.log(3.0)))
        shape = str(rng.choice(["step", "ramp", "spike_then_plateau"]))
        if shape == "step":
            log_ex[start:] = math.log(m)
        elif shape == "ramp":
            k = int(rng.integers(2, 11))
            log_ex[start:] = math.log(m) * np.minimum(1.0, (np.arange(n - start) + 1) / k)
        else:
            m = math.exp(rng.uniform(math.log(1.2), math.log(2.0)))
            peak = rng.uniform(2.0, 6.0)
            k = np.arange(n - start)
            log_ex[start:] = np.log(m + (peak - m) * np.exp(-k / rng.uniform(1.0, 4.0)))
        if rng.random() < 0.7:
            precursor(start, m ** rng.uniform(1, 4))
        anomalies.append(Anomaly("sustained", int(steps[start]), int(steps[-1]), m, shape))
    elif cls == "divergence":
        shape = str(rng.choice(["exponential", "accelerating", "linear"]))
        k = np.arange(n - start, dtype=np.float64)
        if shape == "exponential":
            log_ex[start:] = math.log(2) * k / d
        elif shape == "accelerating":
            log_ex[start:] = math.log(2) * (k / d) ** 2
        else:
            log_ex[start:] = np.log1p(k / d)
        g_ex[start:] = log_ex[start:] * rng.uniform(1.0, 3.0)
        clean = loss * np.exp(log_ex)
        hit = np.nonzero(clean[start:] >= 2 * clean[start])[0]
        double_step = int(steps[start + hit[0]]) if hit.size else int(steps[-1]) + 1
        anomalies.append(Anomaly("divergence", int(steps[start]), int(steps[-1]), 2.0, shape, double_step))
    elif cls == "nan":
        shape = str(rng.choice(["nan_forever", "nan_one", "nan_few", "inf_one", "grad_nan"]))
        if shape == "nan_forever":
            nan_mask[start:] = True
        elif shape == "nan_one":
            nan_mask[start] = True
        elif shape == "nan_few":
            nan_mask[start:start + int(rng.integers(2, 6))] = True
        elif shape == "inf_one":
            inf_mask[start] = True
        else:
            g_nan[start] = True
            fp16 = False       # with a loss scale an inf grad norm is the scaler's business
        end = int(steps[-1]) if shape == "nan_forever" else int(steps[start])
        anomalies.append(Anomaly("nan", int(steps[start]), end, math.inf, shape))
    elif cls == "loss_scale_collapse":
        anomalies.append(Anomaly("loss_scale_collapse", int(steps[start]), int(steps[-1]), 0.0, "overflow_every_step"))
        # skipped steps: the weights stop improving, and the loss drifts up a little
        log_ex[start:] = np.log(rng.uniform(1.0, 1.5)) * np.minimum(1.0, np.arange(n - start) / 20.0)

    clean_loss = loss * np.exp(log_ex)
    observed = clean_loss * np.exp(noise)
    observed[nan_mask] = np.nan
    observed[inf_mask] = np.inf
    g = gnorm * np.exp(g_ex)
    g[g_nan] = np.nan
    scale = None
    if fp16:
        scale = _loss_scale(rng, n, from_scratch, start if cls == "loss_scale_collapse" else None)
        g = np.where(np.r_[False, scale[1:] < scale[:-1]], np.inf, g)   # overflow steps: inf grad norm
    return Curve(name=f"{cls}-{seed}", cls=cls, seed=seed, steps=steps, loss=observed, grad_norm=g,
                 loss_scale=scale, clean_loss=clean_loss, anomalies=tuple(anomalies))


def curves(seeds: range | list[int], classes: tuple[str, ...] = CLASSES) -> list[Curve]:
    return [make_curve(s, c) for c in classes for s in seeds]
