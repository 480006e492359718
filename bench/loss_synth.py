"""Labelled synthetic training curves for evaluating loss-anomaly detectors.

A curve is a power-law loss decay driven by a learning-rate schedule (linear warm-up, then cosine,
WSD or step decay, sometimes a re-warm). What real curves show, and the generator therefore has:

- noise in log space (multiplicative) whose size GROWS as the loss falls (the relative noise of a
  trained model's loss is larger than early in the run), heavy-tailed (Student t), with a slow wander;
- benign one-step spikes (a hard batch) of up to 2x, labelled `blip`;
- data-order spikes (x1.1 to x1.6, 1-3 steps) at steps fixed by the configuration: the reruns of one
  configuration (`make_curve(seed, cls, rerun=k)`) have them at the same steps, with fresh noise;
  labelled `data_spike`;
- a benign data-mixture level shift of -3%..+7% over 50 steps on some curves, labelled `mix_shift`;
- restarts within a log: on some curves the steps go back 20-300 steps (a resume from a checkpoint) and
  the curve is trained again from there with fresh noise (the data-order spikes recur);
- a gradient norm that is erratic during the first steps of a run from scratch, and (for fp16 curves)
  a dynamic loss scale.

Benign labels (`blip`, `data_spike`, `mix_shift`) are never anomalies: a critical event on them is
false; their steps are left out of the clean-step count. One anomaly class is injected per curve:

  clean                 nothing injected (the benign effects above only)
  spike                 1-4 transient spikes (x1.3 to x6; a 2-4 step plateau, or a decay with a 1-4 step
                        time constant, or one step): they recover within about 20 steps
  shift                 a lasting level jump after the first tenth of the run: +5% to +15% (half),
                        +15% to +30% (a quarter) or x1.3 to x3, abrupt or ramped over 2-10 steps
  early_shift           the same on a run from scratch, during the steep early decline: in the first
                        tenth of the run after the warm-up
  ramp                  a slow lasting rise: x1.15 to x2 spread linearly (in log) over 30-300 steps;
                        the label's start is where it begins
  divergence            a slow blow-up doubling the loss in 150-2500 steps
  nan                   NaN or Inf loss (one step, a few, or for good), or a NaN grad norm only
  loss_scale_collapse   fp16: overflow on every step from the start (the scale halves to 1)

Every anomaly records `sigma`, the noise scale (sd of the log loss) at its start, so that an evaluation
can ask how many sigmas a shift was. Arrays are in log order (`index` is the position of an anomaly's
start in them; with a restart the steps are not monotonic).

Seeds: `TUNING_SEEDS` were used to choose the detector's defaults; `EVAL_SEEDS` are for the reported
numbers only (never tune on them). A seed, a class and a rerun give the same curve on every machine
(numpy's PCG64).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

CLASSES = ("clean", "spike", "shift", "early_shift", "ramp", "divergence", "nan", "loss_scale_collapse")
BENIGN = ("blip", "data_spike", "mix_shift")
TUNING_SEEDS = range(0, 60)
EVAL_SEEDS = range(100_000, 100_120)
NOISY_SIGMA = 0.02      # a curve whose end-of-run noise is at least this (log sd) counts as noisy


@dataclasses.dataclass(frozen=True, slots=True)
class Anomaly:
    kind: str          # one of CLASSES[1:] or BENIGN
    index: int         # position of the first anomalous sample in the curve's arrays
    start: int         # first anomalous step
    end_index: int     # position of the last sample the anomaly is visible in
    magnitude: float   # peak ratio (spike), plateau ratio (shift, ramp), 2.0 (divergence)
    shape: str
    sigma: float       # noise sd of the log loss at the start
    double_step: int | None = None   # divergence: first step where the noiseless loss is 2x its start
    length: int = 0                  # ramp: steps from the start to the full level

    @property
    def benign(self) -> bool:
        return self.kind in BENIGN


@dataclasses.dataclass(frozen=True, slots=True)
class Curve:
    name: str
    cls: str
    seed: int
    steps: np.ndarray                 # int64, in log order (goes back at a restart)
    loss: np.ndarray                  # float64, may hold nan/inf
    grad_norm: np.ndarray
    loss_scale: np.ndarray | None     # fp16 curves only
    clean_loss: np.ndarray            # the noiseless loss with the anomaly applied
    anomalies: tuple[Anomaly, ...]
    noisy: bool                       # end-of-run noise sd >= NOISY_SIGMA
    warmup_end: int                   # index where the LR warm-up ends (0: not from scratch)
    restart_index: int | None = None  # position of the first sample after a restart

    def __len__(self) -> int:
        return int(self.steps.size)


def _schedule(rng: np.random.Generator, n: int, warm: int) -> np.ndarray:
    """Learning rate / peak, per step of the underlying run."""
    total = int(n * rng.uniform(1.0, 4.0))
    t = np.arange(n, dtype=np.float64)
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


def _base_loss(rng: np.random.Generator, lr: np.ndarray, step0: int) -> np.ndarray:
    l_inf = rng.uniform(1.6, 3.2)
    l0 = math.log(rng.choice([32_000, 50_257, 128_000, 250_000]))
    alpha = rng.uniform(0.3, 0.8)
    tau0 = rng.uniform(20, 200)
    progress = step0 * rng.uniform(0.5, 1.0) + np.cumsum(lr)
    loss = l_inf + (l0 - l_inf) * (1 + progress / tau0) ** (-alpha)
    anneal = rng.uniform(0.0, 0.08)            # loss drops as the LR anneals (and rises on a re-warm)
    return loss * (1 - anneal * (1 - lr))


def _sigma(rng: np.random.Generator, loss: np.ndarray, lr: np.ndarray) -> np.ndarray:
    """Per-step noise sd of the log loss: larger as the loss falls, a little larger at high LR."""
    sigma_end = math.exp(rng.uniform(math.log(0.003), math.log(0.06)))
    growth = rng.uniform(0.3, 1.2)
    return sigma_end * (loss[-1] / loss) ** growth * (0.8 + 0.2 * lr)


def _noise(rng: np.random.Generator, sigma: np.ndarray, df: float) -> np.ndarray:
    n = sigma.size
    t = rng.standard_t(df, size=n) / math.sqrt(df / (df - 2))
    wander = np.zeros(n)
    steps = rng.normal(0.0, 1.0, size=n) * sigma * 0.05
    for i in range(1, n):
        wander[i] = wander[i - 1] * 0.995 + steps[i]
    return sigma * t + wander


def _grad_norm(rng: np.random.Generator, n: int, from_scratch: bool) -> np.ndarray:
    g0 = math.exp(rng.uniform(math.log(0.1), math.log(5.0)))
    t = np.arange(n, dtype=np.float64)
    trend = g0 * (1 + 3 * np.exp(-t / 200.0) if from_scratch else np.ones(n)) * (0.8 + 0.4 * t / n)
    sig = rng.uniform(0.05, 0.3)
    if from_scratch:   # the first steps of a run: large, erratic gradient norms (up to ~3x swings)
        sig = sig + 0.5 * np.exp(-t / 25.0)
    return trend * np.exp(rng.normal(0.0, 1.0, size=n) * sig)


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
    """Log-excess of one transient spike starting at `at`; (excess, shape, last visible index)."""
    ex = np.zeros(n)
    shape = str(rng.choice(["one_step", "plateau", "decay"], p=[0.3, 0.3, 0.4]))
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


def _shift_magnitude(rng: np.random.Generator) -> float:
    u = rng.random()
    if u < 0.5:
        return math.exp(rng.uniform(math.log(1.05), math.log(1.15)))
    if u < 0.75:
        return math.exp(rng.uniform(math.log(1.15), math.log(1.3)))
    return math.exp(rng.uniform(math.log(1.3), math.log(3.0)))


def make_curve(seed: int, cls: str, rerun: int = 0) -> Curve:
    """The curve of class `cls` for `seed` (deterministic). Reruns of one seed and class share the
    configuration (schedule, loss curve, anomaly, data-order spikes) and differ in their noise."""
    if cls not in CLASSES:
        raise ValueError(f"unknown class {cls!r}; classes are {CLASSES}")
    rng = np.random.default_rng([seed, CLASSES.index(cls)])                    # the configuration
    nrng = np.random.default_rng([seed, CLASSES.index(cls), 1_000 + rerun])   # this run's noise
    from_scratch = cls == "early_shift" or rng.random() < 0.5
    step0 = 0 if from_scratch else int(rng.integers(1_000, 200_000))
    fp16 = cls == "loss_scale_collapse" or rng.random() < 0.3
    n = int(rng.integers(1500, 4000))
    warm = int(rng.uniform(50, 0.1 * n)) if from_scratch else 0
    early_end = warm + n // 10
    lo = max(early_end, 300)
    if cls == "early_shift":
        start = int(rng.integers(warm + 20, early_end))
    else:
        start = int(rng.integers(lo, n - 400))
    d = 0
    if cls == "divergence":
        d = int(math.exp(rng.uniform(math.log(150), math.log(2500))))
        n = max(n, start + int(1.3 * d) + 50)
    lr = _schedule(rng, n, warm)
    loss = _base_loss(rng, lr, step0)
    sigma = _sigma(rng, loss, lr)
    df = float(rng.choice([4.0, 8.0, 30.0]))
    benign: list[tuple[str, int, int, float, str]] = []   # (kind, index, end index, magnitude, shape)
    log_ben = np.zeros(n)                                  # benign effects (recur in reruns)
    if rng.random() < 0.2:                                 # a data-mixture change
        at = int(rng.integers(lo, n - 100))
        f = rng.uniform(0.97, 1.07)
        log_ben += math.log(f) * np.clip((np.arange(n) - at) / 50.0, 0.0, 1.0)
        benign.append(("mix_shift", at, n - 1, f, "ramp50"))
    for at in sorted(set(int(a) for a in rng.integers(max(20, warm), n - 5, size=int(rng.integers(0, 4))))):
        k, f = int(rng.integers(1, 4)), rng.uniform(1.1, 1.6)
        log_ben[at:at + k] = np.maximum(log_ben[at:at + k], math.log(f))
        benign.append(("data_spike", at, at + k - 1, f, f"{k}_steps"))

    log_ex = np.zeros(n)          # the anomaly, as log excess over the clean loss
    g_ex = np.zeros(n)
    nan_mask = np.zeros(n, dtype=bool)
    inf_mask = np.zeros(n, dtype=bool)
    g_nan = np.zeros(n, dtype=bool)
    found: list[tuple[str, int, int, float, str, int]] = []    # (kind, index, end, magnitude, shape, length)

    def precursor(at: int, factor: float) -> None:
        lead = int(rng.integers(0, 5))
        k = np.arange(0, 40)
        prof = np.log(factor) * np.exp(-k / rng.uniform(2, 8))
        s0 = max(0, at - lead)
        m = min(prof.size, n - s0)
        g_ex[s0:s0 + m] = np.maximum(g_ex[s0:s0 + m], prof[:m])

    if cls == "spike":
        grid = np.arange(lo, n - 50, 150)
        for at in sorted(rng.choice(grid, size=min(int(rng.integers(1, 5)), grid.size), replace=False)):
            peak = math.exp(rng.uniform(math.log(1.3), math.log(6.0)))
            ex, shape, last = _spike_profile(rng, n, int(at), peak)
            log_ex = np.maximum(log_ex, ex)
            if rng.random() < 0.7:
                precursor(int(at), peak ** rng.uniform(1, 3))
            found.append(("spike", int(at), last, peak, shape, 0))
    elif cls in ("shift", "early_shift"):
        m = _shift_magnitude(rng)
        shape = str(rng.choice(["step", "ramp"], p=[0.7, 0.3]))
        k = 1 if shape == "step" else int(rng.integers(2, 11))
        log_ex[start:] = math.log(m) * np.minimum(1.0, (np.arange(n - start) + 1) / k)
        if rng.random() < 0.5:
            precursor(start, m ** rng.uniform(1, 4))
        found.append((cls, start, n - 1, m, shape, k))
    elif cls == "ramp":
        m = math.exp(rng.uniform(math.log(1.15), math.log(2.0)))
        k = int(rng.integers(30, 301))
        log_ex[start:] = math.log(m) * np.minimum(1.0, np.arange(n - start) / k)
        found.append(("ramp", start, n - 1, m, "linear", k))
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
        found.append(("divergence", start, n - 1, 2.0, shape, d))
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
        found.append(("nan", start, n - 1 if shape == "nan_forever" else start, math.inf, shape, 0))
    elif cls == "loss_scale_collapse":
        found.append(("loss_scale_collapse", start, n - 1, 0.0, "overflow_every_step", 0))
        # skipped steps: the weights stop improving, and the loss drifts up a little
        log_ex[start:] = np.log(rng.uniform(1.0, 1.5)) * np.minimum(1.0, np.arange(n - start) / 20.0)

    # A restart: the log holds run[0:r], then run[r-back:] trained again (fresh noise).
    restart: tuple[int, int] | None = None
    first_anomaly = min((f[1] for f in found), default=n)
    if rng.random() < 0.25 and min(first_anomaly - 150, n - 200) > lo:
        r = int(rng.integers(lo, min(first_anomaly - 150, n - 200)))
        restart = (r, int(rng.integers(20, min(300, r) + 1)))
    blip_rate = rng.uniform(1 / 2000, 1 / 300)

    clean_run = loss * np.exp(log_ex + log_ben)
    steps_run = np.arange(step0, step0 + n, dtype=np.int64)
    idx = np.arange(n) if restart is None else np.r_[np.arange(restart[0]), np.arange(restart[0] - restart[1], n)]
    m_total = idx.size
    noise = _noise(nrng, sigma[idx], df)
    blips = np.zeros(m_total)
    hits = np.nonzero(nrng.random(m_total) < blip_rate)[0]
    blips[hits] = np.log(nrng.uniform(1.03, 2.0, size=hits.size))
    gnorm = _grad_norm(nrng, n, from_scratch)[idx]
    clean_loss = clean_run[idx]
    observed = clean_loss * np.exp(noise + blips)
    observed[nan_mask[idx]] = np.nan
    observed[inf_mask[idx]] = np.inf
    g = gnorm * np.exp(g_ex[idx])
    g[g_nan[idx]] = np.nan
    steps = steps_run[idx]
    scale = None
    if fp16:
        collapse_at = None
        if cls == "loss_scale_collapse":
            collapse_at = start if restart is None else start + restart[1]
        scale = _loss_scale(nrng, m_total, from_scratch, collapse_at)
        g = np.where(np.r_[False, scale[1:] < scale[:-1]], np.inf, g)   # overflow steps: inf grad norm

    def positions(i: int) -> list[int]:   # log positions of run index i (two after a restart)
        return [int(p) for p in np.nonzero(idx == i)[0]]

    anomalies: list[Anomaly] = []
    for kind, at, end, mag, shape, length in found:
        p = positions(at)[-1]
        anomalies.append(Anomaly(kind, p, int(steps[p]), p + (end - at), mag, shape, float(sigma[at]),
                                 _double_step(clean_run, steps_run, at) if kind == "divergence" else None,
                                 length))
    for kind, at, end, mag, shape in benign:
        for p in positions(at):
            anomalies.append(Anomaly(kind, p, int(steps[p]), min(m_total - 1, p + (end - at)), mag, shape,
                                     float(sigma[at])))
    for p in hits:
        anomalies.append(Anomaly("blip", int(p), int(steps[p]), int(p), float(math.exp(blips[p])), "one_step",
                                 float(sigma[idx[p]])))
    anomalies.sort(key=lambda a: a.index)
    return Curve(name=f"{cls}-{seed}" + (f"-r{rerun}" if rerun else ""), cls=cls, seed=seed, steps=steps,
                 loss=observed, grad_norm=g, loss_scale=scale, clean_loss=clean_loss, anomalies=tuple(anomalies),
                 noisy=bool(sigma[-1] >= NOISY_SIGMA), warmup_end=warm,
                 restart_index=None if restart is None else restart[0])


def _double_step(clean: np.ndarray, steps: np.ndarray, at: int) -> int:
    hit = np.nonzero(clean[at:] >= 2 * clean[at])[0]
    return int(steps[at + hit[0]]) if hit.size else int(steps[-1]) + 1


def curves(seeds: range | list[int], classes: tuple[str, ...] = CLASSES) -> list[Curve]:
    return [make_curve(s, c) for c in classes for s in seeds]
