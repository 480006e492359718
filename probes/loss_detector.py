"""Loss and gradient-norm anomaly detection: a pure, online detector, and the rollback policy.

Feed one `LossDetector` per job (or per job and rank) with `update(step, loss, grad_norm, now,
loss_scale)` for every reported step; it returns the `LossEvent`s that sample triggers. Nothing here
reads a clock, a file or the network, and memory is O(window) per detector.

The rules (docs/loss-detector.md has the reasons and the evaluation behind the defaults):

- `nonfinite`   NaN or Inf loss (or grad norm, unless the run reports a loss scale, where an
                infinite grad norm is the scaler's overflow skip): CRITICAL on the step it appears.
- `spike`       one sample at least `spike_ratio` x the baseline AND `spike_z` robust sigmas above
                it: WARNING, reported on the step it appears; a `recovered` INFO event follows with
                the peak magnitude when the level comes back.
- `sustained`   the level (median of the samples of the last `level_steps` steps) at least
                `sustained_ratio` x the baseline AND `sustained_z` sigmas of that median above it,
                held for `patience_steps` steps and confirmed on every sample of that run: CRITICAL
                (a spike that does not recover becomes `sustained` the same way).
- `divergence`  block medians (`divergence_block` samples) rising gradually to at least
                `divergence_ratio` x the lowest block since the last reset: CRITICAL.
- `loss_scale_collapse`  an fp16 loss scale that falls `loss_scale_collapse_factor` x below a
                settled value (one seen on two consecutive samples) within `loss_scale_window_steps`
                steps, or down to `loss_scale_floor` from above it: CRITICAL.
- The same `spike`/`sustained` rules run on the gradient norm with their own thresholds as an early
  warning (WARNING, never CRITICAL unless `grad_norm_critical`).

Everything works in log space, so ratios are differences and multiplicative (heteroscedastic) noise
has a constant scale. The baseline is the median of the last `window` accepted samples (samples inside
an anomaly are not accepted, so an anomaly never becomes its own baseline); the noise scale is the MAD
of successive differences of those samples (insensitive to the downward trend of a loss curve). Until
`sigma_samples` samples are in, the scale is at least `prior_sigma`. Step gaps mean nothing: windows
count samples, durations count steps. A step lower than the previous one is a restart from a
checkpoint: open anomalies are dropped, the baselines are kept.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import deque
from typing import Literal, Sequence

from sdcwatch import event_kinds as ek
from sdcwatch.event_kinds import EventKind
from sdcwatch.settings import SettingError, setting
from sdcwatch.types import Finding, Severity

log = logging.getLogger(__name__)

AnomalyKind = Literal["nonfinite", "spike", "recovered", "shift", "sustained", "divergence", "loss_scale_collapse"]
Signal = Literal["loss", "grad_norm", "loss_scale"]
# the critical kinds a rollback can answer (a spike is a WARNING, `recovered` is INFO)
ROLLBACK_KINDS: frozenset[str] = frozenset({"nonfinite", "sustained", "divergence", "loss_scale_collapse"})

# (signal, kind) -> the catalogue member it is journaled as
EVENT_KINDS: dict[tuple[str, str], EventKind] = {
    ("loss", "nonfinite"): ek.LOSS_NONFINITE, ("loss", "spike"): ek.LOSS_SPIKE,
    ("loss", "recovered"): ek.LOSS_RECOVERED, ("loss", "shift"): ek.LOSS_SHIFT, ("loss", "sustained"): ek.LOSS_SUSTAINED,
    ("loss", "divergence"): ek.LOSS_DIVERGENCE,
    ("grad_norm", "nonfinite"): ek.GRAD_NORM_NONFINITE, ("grad_norm", "spike"): ek.GRAD_NORM_SPIKE,
    ("grad_norm", "recovered"): ek.GRAD_NORM_RECOVERED, ("grad_norm", "sustained"): ek.GRAD_NORM_SUSTAINED,
    ("loss_scale", "loss_scale_collapse"): ek.LOSS_SCALE_COLLAPSE,
}

_MEDIAN_EFFICIENCY = 1.2533  # sd(median of n) ~ 1.2533 * sigma / sqrt(n) for normal noise
_MAD_TO_SIGMA = 1.4826
_SLOPE_SHRINK_T2 = 2.25        # a trend slope within 1.5 standard errors of 0 counts as none
_CLIP_Z = 3.0                  # accepted samples enter the trend clipped to this many sigmas around it
_RAMP_PATIENCE = 10            # a still-rising excursion may stay open this many patience_steps
_LEVEL_FLOOR = math.log(1.01)   # no excursion under 1%, whatever the noise (min_sigma's counterpart)


@dataclasses.dataclass(kw_only=True, slots=True)
class LossDetectorConfig:
    """Thresholds of one job's detector. Ratios are multiplicative (1.2 = 20% above the baseline);
    `*_z` are in robust sigmas of the log value; `*_steps` count training steps; the other sizes
    count samples. Defaults are the ones chosen by bench/spikes_eval.py (see docs/loss-detector.md).
    The agent's `[loss]` config section."""

    window: int = setting(128, "samples in the noise-scale window (and the history an onset is estimated on)")
    trend_samples: int = setting(64, "accepted samples the trend line (the baseline) is fitted on (at most window)")
    trend_min_samples: int = setting(16, "samples before the trend has a slope (until then: their median)")
    min_samples: int = setting(3, "samples before any level rule runs (at most window)")
    sigma_samples: int = setting(16, "samples before the measured noise scale replaces prior_sigma")
    prior_sigma: float = setting(0.05, "noise scale (log space) until sigma_samples samples are in")
    min_sigma: float = setting(0.002, "floor on the noise scale (log space)")
    warmup_steps: int = setting(0, "steps from the start of a job during which nothing is reported")

    spike_ratio: float = setting(1.2, "a loss spike is at least this many times the baseline")
    spike_z: float = setting(6.0, "a loss spike is at least this many robust sigmas above the baseline")
    spike_alone_ratio: float = setting(2.0, "a spike this many times the baseline is reported on its own sample; "
                                       "a smaller one when the next sample confirms it")
    level_z: float = setting(5.0, "an excursion opens when the level is this many sigmas (of the level's "
                             "estimate) above the trend")
    level_steps: int = setting(8, "steps whose samples' median is the level that sustained rules test")
    sustained_ratio: float = setting(1.1, "a CRITICAL sustained excursion: the level this many times the baseline")
    sustained_z: float = setting(5.0, "a sustained excursion holds the level this many sigmas (of the median of "
                                 "its samples) above the baseline")
    shift_ratio: float = setting(1.02, "a held excursion under sustained_ratio but this many times the baseline "
                                 "is a WARNING level shift")
    patience_steps: int = setting(32, "steps an excursion must last to be sustained (CRITICAL)")
    onset_slack: float = setting(6.63, "the reported start of a climb is the earliest knot of a broken-stick "
                                 "fit within this many residual variances of the best one (6.63: a 99% "
                                 "likelihood-ratio bound), so a rollback lands before the climb; 0 = the best "
                                 "knot")
    min_sustained_samples: int = setting(3, "samples an excursion needs before it can be called sustained")

    divergence_ratio: float = setting(1.2, "divergence: block medians climbing to this many times the lowest")
    divergence_z: float = setting(4.0, "the climb must also be this many sigmas of a block median")
    divergence_block: int = setting(16, "samples per block of the divergence rule")
    divergence_min_blocks: int = setting(3, "blocks the climb must span")
    divergence_max_jump: float = setting(0.5, "largest share of the climb one block may carry")

    grad_norm_spike_ratio: float = setting(2.0, "a grad-norm spike is at least this many times its baseline")
    grad_norm_spike_z: float = setting(6.0, "a grad-norm spike is at least this many sigmas above its baseline")
    grad_norm_sustained_ratio: float = setting(1.5, "a sustained grad-norm excursion: this many times the baseline")
    grad_norm_sustained_z: float = setting(5.0, "a sustained grad-norm excursion: this many sigmas above it")
    grad_norm_spike_alone_ratio: float = setting(100.0, "a grad-norm spike this many times its baseline is "
                                                 "reported on its own sample; a smaller one when the next "
                                                 "sample confirms it (clean runs show lone 4-10x samples)")
    grad_norm_warmup_steps: int = setting(100, "steps from the start of a job before the grad-norm rules run "
                                          "(the first steps of a run have erratic gradient norms)")
    grad_norm_critical: bool = setting(False, "a sustained grad-norm excursion is CRITICAL, not a WARNING")

    loss_scale_collapse_factor: float = setting(8.0, "a loss scale falling this many times below its settled value collapses")
    loss_scale_window_steps: int = setting(50, "steps within which that fall counts")
    loss_scale_floor: float = setting(1.0, "a loss scale falling to this value (from above) collapses")

    def __post_init__(self) -> None:
        positive_ints = ("window", "trend_samples", "trend_min_samples", "min_samples", "sigma_samples", "level_steps", "patience_steps",
                         "min_sustained_samples", "divergence_block",
                         "divergence_min_blocks", "loss_scale_window_steps")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in positive_ints and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise _bad(f.name, f"must be an integer >= 1, got {value!r}")
            finite = isinstance(value, (int, float)) and math.isfinite(value)
            if f.name in _RATIOS and not (finite and value > 1.0):
                raise _bad(f.name, f"must be a finite ratio > 1, got {value!r}")
            if f.name in _NON_NEGATIVE and not (finite and value >= 0):
                raise _bad(f.name, f"must be a finite number >= 0, got {value!r}")
        for name in ("warmup_steps", "grad_norm_warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _bad(name, f"must be an integer >= 0, got {value!r}")
        if self.min_samples > min(self.window, self.trend_samples):
            raise _bad("min_samples", f"({self.min_samples}) must be <= window ({self.window}) and trend_samples "
                                      f"({self.trend_samples})")
        if not 0.0 < self.divergence_max_jump <= 1.0:
            raise _bad("divergence_max_jump", f"must be in (0, 1], got {self.divergence_max_jump!r}")
        if not math.isfinite(self.loss_scale_floor) or self.loss_scale_floor <= 0:
            raise _bad("loss_scale_floor", f"must be > 0, got {self.loss_scale_floor!r}")


_RATIOS = frozenset({"spike_ratio", "spike_alone_ratio", "shift_ratio", "grad_norm_spike_alone_ratio",
                     "sustained_ratio", "divergence_ratio", "grad_norm_spike_ratio",
                     "grad_norm_sustained_ratio", "loss_scale_collapse_factor"})
_NON_NEGATIVE = frozenset({"level_z", "spike_z", "sustained_z", "divergence_z", "grad_norm_spike_z", "grad_norm_sustained_z",
                           "prior_sigma", "min_sigma", "onset_slack"})


def _bad(name: str, why: str) -> SettingError:
    return SettingError("LossDetectorConfig", name, why)


@dataclasses.dataclass(frozen=True, slots=True)
class LossEvent:
    """One anomaly (or recovery) found by the detector.

    `value` is the sample (or the level for `sustained`/`divergence`) in the signal's units,
    `baseline` what it was compared with, `magnitude` = value / baseline. `start_step` is where the
    anomaly began: a rollback must target a checkpoint strictly older than it.
    """

    step: int
    kind: AnomalyKind
    signal: Signal
    severity: Severity
    value: float
    baseline: float
    magnitude: float
    start_step: int
    message: str
    time: float = 0.0

    @property
    def critical(self) -> bool:
        return self.severity == Severity.CRITICAL

    @property
    def event_kind(self) -> EventKind:
        """The catalogue member this event is journaled as (`loss.spike`, `grad_norm.spike`,
        `loss_scale.collapse`, ...)."""
        return EVENT_KINDS[(self.signal, self.kind)]

    def to_finding(self, job_id: str, rank: int | None = None) -> Finding:
        """The event as a journal `Finding` (kind `event_kind`, subject `job/<id>[/rank/<r>]`)."""
        subject = f"job/{job_id}" if rank is None else f"job/{job_id}/rank/{rank}"
        details = {"job_id": job_id, "step": self.step, "start_step": self.start_step, "signal": self.signal,
                   "value": _json_number(self.value), "baseline": _json_number(self.baseline),
                   "magnitude": _json_number(self.magnitude)}
        if rank is not None:
            details["rank"] = rank
        return Finding(self.event_kind, self.severity, subject, self.message, details)


def _json_number(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


@dataclasses.dataclass(frozen=True, slots=True)
class _Rules:
    """The thresholds one signal tracker uses (loss and grad norm differ)."""

    signal: Signal
    spike_ratio: float
    spike_z: float
    spike_alone_ratio: float
    sustained_ratio: float
    sustained_z: float
    sustained_severity: Severity
    spike_severity: Severity
    warmup_steps: int                    # the signal's rules run from this step on
    divergence: bool


def _u(step: int) -> float:
    """The trend's abscissa: log(step + 1). A loss decays about as a power of the step, which is close to
    a line in log-log, so a line extrapolated a few dozen steps through the steep early decline stays
    close to the curve (in steps it would fall below a decelerating curve); late in a run it is
    proportional to the step."""
    return math.log1p(step)


class _Trend:
    """Least-squares line of the log value on log(step + 1) through the last `n` accepted samples, O(1)
    per sample (running sums, recentred every `n` samples so that they stay exact)."""

    __slots__ = ("pts", "ref", "s1", "s2", "sx", "stx", "_since")

    def __init__(self, n: int) -> None:
        self.pts: deque[tuple[float, float]] = deque(maxlen=n)     # (u, log value)
        self.ref = 0.0
        self.s1 = self.s2 = self.sx = self.stx = 0.0
        self._since = 0

    def add(self, u: float, x: float) -> None:
        pts = self.pts
        if len(pts) == pts.maxlen:
            ot, ox = pts[0]
            d = ot - self.ref
            self.s1 -= d
            self.s2 -= d * d
            self.sx -= ox
            self.stx -= d * ox
        pts.append((u, x))
        self._since += 1
        if self._since >= (pts.maxlen or 1) or len(pts) == 1:
            self._recentre(u)
            return
        d = u - self.ref
        self.s1 += d
        self.s2 += d * d
        self.sx += x
        self.stx += d * x

    def _recentre(self, ref: float) -> None:
        self.ref, self._since = ref, 0
        self.s1 = self.s2 = self.sx = self.stx = 0.0
        for t, x in self.pts:
            d = t - ref
            self.s1 += d
            self.s2 += d * d
            self.sx += x
            self.stx += d * x

    def clear(self) -> None:
        self.pts.clear()
        self._since = 0
        self.s1 = self.s2 = self.sx = self.stx = 0.0

    def line(self, min_fit: int, sigma: float) -> _Line:
        """The fitted line; with fewer than `min_fit` samples (or all on one step): their median, flat. The
        slope is shrunk towards 0 by its own uncertainty (noise `sigma`): a slope within 1.5 standard
        errors of 0 is none (a flat curve, a line refitted on few samples after a shift, must not be extrapolated
        as a decline), one many standard errors wide (the steep early decline) is kept."""
        n = len(self.pts)
        den = n * self.s2 - self.s1 * self.s1
        if n < min_fit or den <= 1e-12 * max(1e-12, self.s2) * n:
            xs = sorted(x for _, x in self.pts)
            return _Line(self.ref, _median_of_sorted(xs), 0.0, n, self.ref, 0.0)
        sxx = den / n
        b = (n * self.stx - self.s1 * self.sx) / den
        t2 = b * b * sxx / (sigma * sigma)          # (slope / its standard error)^2
        b *= max(0.0, 1.0 - _SLOPE_SHRINK_T2 / t2) if t2 > 0 else 0.0
        ubar = self.ref + self.s1 / n
        a = self.sx / n - b * (ubar - self.ref)
        return _Line(self.ref, a, b, n, ubar, sxx)


@dataclasses.dataclass(frozen=True, slots=True)
class _Line:
    """x = a + b * (u(step) - ref), u capped at `until`; with its least-squares variance factor."""

    ref: float
    a: float
    b: float
    n: int
    ubar: float
    sxx: float                 # 0: a median, no slope
    until: float = math.inf

    def predict(self, step: int) -> float:
        return self.a + self.b * (min(_u(step), self.until) - self.ref)

    def var(self, step: int) -> float:
        """Variance of the prediction at `step`, in units of the noise variance."""
        if self.sxx <= 0.0:
            return _MEDIAN_EFFICIENCY ** 2 / self.n
        d = min(_u(step), self.until) - self.ubar
        return 1.0 / self.n + d * d / self.sxx


@dataclasses.dataclass(slots=True)
class _Episode:
    """An open excursion above the trend: from its first elevated sample until it recovers, is adopted
    as the new level, or escalates. The trend is frozen while it is open."""

    start_step: int
    line: _Line                          # the trend when it opened, extrapolated at most 2 patiences
    peak: float = 0.0                    # largest log residual seen
    peak_step: int = 0
    spike_reported: bool = False
    last_spike_step: int | None = None
    pending: tuple[int, float, float] | None = None    # an unconfirmed spike: (step, x, residual)
    in_spike: bool = False
    abrupt: bool = False                 # it opened on a spike: it began on that sample
    elevated_since: int | None = None    # start of the current run of elevated levels
    run_residuals: list[float] = dataclasses.field(default_factory=list)

    def predict(self, step: int) -> float:
        return self.line.predict(step)


@dataclasses.dataclass(slots=True)
class _Divergence:
    """The divergence rule's state: the lowest block median since the last reset and the climb since."""

    ref: float | None = None
    ref_step: int = 0
    low_step: int = 0
    prev: float = 0.0
    max_jump: float = 0.0
    blocks_since: int = 0
    armed: int = 0


def _median_of_sorted(xs: Sequence[float]) -> float:
    """statistics.median of data already sorted (the same value, without sorting again)."""
    n = len(xs)
    if n == 0:
        raise statistics.StatisticsError("no median for empty data")
    half = n // 2
    return xs[half] if n % 2 else (xs[half - 1] + xs[half]) / 2



def _hinge(pts: Sequence[tuple[int, float]], slack: float = 0.0) -> int | None:
    """The knot of the best broken-stick fit x = a + b*t + c*max(0, t - t0) over the samples (least
    squares over every sample as t0, O(n) with suffix sums): where a climb began. None without a knot
    that bends the line upwards (c > 0) inside the samples."""
    n = len(pts)
    if n < 8:
        return None
    t_first = pts[0][0]
    ts = [float(st - t_first) for st, _ in pts]
    xs = [x for _, x in pts]
    s1, s2 = sum(ts), sum(t * t for t in ts)
    sx, stx = sum(xs), sum(t * x for t, x in zip(ts, xs))
    best: tuple[float, int] | None = None
    fits: list[tuple[float, int]] = []
    ns = s1s = s2s = sxs = stxs = 0.0          # suffix sums over the samples after the knot
    for k in range(n - 1, 1, -1):
        t, x = ts[k], xs[k]
        ns, s1s, s2s, sxs, stxs = ns + 1, s1s + t, s2s + t * t, sxs + x, stxs + t * x
        t0 = ts[k - 1]
        if ns < 4 or n - ns < 4:
            continue
        sh = s1s - t0 * ns
        shh = s2s - 2 * t0 * s1s + t0 * t0 * ns
        sth = s2s - t0 * s1s
        sxh = stxs - t0 * sxs
        # normal equations of (a, b, c): [[n, s1, sh], [s1, s2, sth], [sh, sth, shh]] . beta = [sx, stx, sxh]
        m = ((n, s1, sh), (s1, s2, sth), (sh, sth, shh))
        det = _det3(m)
        if abs(det) < 1e-9:
            continue
        y = (sx, stx, sxh)
        coef = [_det3(tuple(tuple(y[r] if col == j else m[r][col] for col in range(3)) for r in range(3))) / det
                for j in range(3)]
        fit = coef[0] * sx + coef[1] * stx + coef[2] * sxh      # beta . X'y: SSE = sum x^2 - fit
        if coef[2] > 0:
            fits.append((fit, k - 1))
            if best is None or fit > best[0]:
                best = (fit, k - 1)
    if best is None:
        return None
    if slack <= 0.0 or n <= 4:
        return pts[best[1]][0]
    # the earliest knot whose fit is within `slack` residual variances of the best one: a lower confidence
    # bound on where the climb began (a likelihood-ratio interval on the knot)
    sse_min = max(sum(x * x for x in xs) - best[0], 0.0)
    allowed = slack * sse_min / (n - 4)
    return pts[min(k for fit, k in fits if best[0] - fit <= allowed)][0]


def _det3(m: Sequence[Sequence[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


class _SignalTracker:
    """Trend, robust scale, spike/sustained episodes and divergence for one positive signal."""

    def __init__(self, cfg: LossDetectorConfig, rules: _Rules) -> None:
        self.cfg = cfg
        self.rules = rules
        self.accepted: deque[float] = deque(maxlen=cfg.window)     # the noise scale's samples
        self.trend = _Trend(min(cfg.trend_samples, cfg.window))
        self.recent: deque[tuple[int, float, float]] = deque(maxlen=cfg.window)    # (step, u, x)
        self.history: deque[tuple[int, float]] = deque(maxlen=3 * cfg.window)   # every sample (onsets)
        self.episode: _Episode | None = None
        self.block: list[float] = []
        self.div = _Divergence()
        self._sigma_cache: tuple[tuple[int, int], float] | None = None
        self._accepted_count = 0         # accepted samples ever (cache key)
        self._low_since: int | None = None   # start of a run of levels below the trend

    # -- statistics ------------------------------------------------------------------------------
    def baseline(self, step: int | None = None) -> float:
        """The expected log value at `step` (default: the last accepted one): the trend line, or the
        frozen one of an open episode. StatisticsError when no sample was accepted."""
        ep = self.episode
        line = ep.line if ep is not None else self.trend.line(self.cfg.trend_min_samples, self.sigma())
        if step is None:
            return line.a + line.b * (min(self.trend.pts[-1][0] if self.trend.pts else 0.0, line.until) - line.ref)
        return line.predict(step)

    def sigma(self) -> float:
        """Robust noise scale of the log value: MAD of successive differences / sqrt(2)."""
        cfg = self.cfg
        # Recomputed every 8 accepted samples once the window has enough (the scale moves slowly).
        key = ((0, self._accepted_count) if len(self.accepted) < cfg.sigma_samples
               else (1, self._accepted_count // 8))
        if self._sigma_cache is not None and self._sigma_cache[0] == key:
            return self._sigma_cache[1]
        vals = list(self.accepted)
        if len(vals) < cfg.sigma_samples:
            s = cfg.prior_sigma      # too few samples (or ones far apart) for a scale of their own
        else:
            diffs = sorted([b - a for a, b in zip(vals, vals[1:])])
            med = _median_of_sorted(diffs)
            mad = _median_of_sorted(sorted([abs(d - med) for d in diffs]))
            s = _MAD_TO_SIGMA * mad / math.sqrt(2.0)
        s = max(s, cfg.min_sigma)
        self._sigma_cache = (key, s)
        return s

    def _accept(self, step: int, x: float, clip: tuple[float, float] | None = None, u: float | None = None) -> None:
        """Take a sample into the noise window and (clipped to `clip`, a band around the trend, so that
        a bump under the thresholds does not tilt the line) into the trend."""
        self.accepted.append(x)
        self.trend.add(_u(step) if u is None else u, x if clip is None else min(max(x, clip[0]), clip[1]))
        if len(self.trend.pts) == self.cfg.trend_min_samples:   # the line gets its slope: from clipped samples
            self._refit(list(self.trend.pts))
        self._accepted_count += 1

    def _adopt(self, since: int, clear_divergence: bool) -> None:
        """Adopt the samples from step `since` on as the new level: the trend restarts from them (the
        noise scale is kept: a level shift does not change the noise)."""
        self._refit([(_u(st), x) for st, x in self.history if st >= since])
        self.episode = None
        if clear_divergence:
            self.block.clear()
            self.div = _Divergence()

    def _refit(self, pts: Sequence[tuple[float, float]]) -> None:
        """The trend through `pts` (u, x), clipped to 3 sigmas of a robust first fit through them: a spike
        among them (a blip on the first sample of a job, a decaying spike's tail) must not tilt the line."""
        clip = _CLIP_Z * self.sigma()
        self.trend.clear()
        if not pts:
            return
        # Theil-Sen (the median of the pairwise slopes): O(n^2), only when the trend is rebuilt
        slopes = sorted((x2 - x1) / (u2 - u1) for i, (u1, x1) in enumerate(pts) for u2, x2 in pts[i + 1:]
                        if u2 > u1)
        b = _median_of_sorted(slopes) if len(pts) >= self.cfg.trend_min_samples and slopes else 0.0
        a = statistics.median(x - b * u for u, x in pts)
        for u, x in pts:
            mid = a + b * u
            self.trend.add(u, min(max(x, mid - clip), mid + clip))

    def restart(self, step: int) -> None:
        """A restart from a checkpoint, going on at `step`: forget open anomalies and every sample of the
        steps being replaced (from `step` on). The trend is refitted on the samples before `step`: those
        after it describe a history the restore undid, and may be what it undid. Weights frozen for a hundred
        steps while a replica mismatch's rollback came (each update vetoed) left a flat trend there, and the
        replayed steps' higher losses read as a sustained rise from the restored step: a second rollback
        that skipped 199 good batches (tests/test_readme_loop.py on a loaded machine). With nothing before
        `step` in the history the trend starts afresh (its warm-up judges nothing). The noise scale stays."""
        self.episode = None
        self.recent.clear()
        self.block.clear()
        self.div.armed = 0
        kept = [(st, x) for st, x in self.history if st < step]
        if len(kept) < len(self.history):    # the trend's samples are among the history's
            n = self.trend.pts.maxlen or len(kept)
            self._refit([(_u(st), x) for st, x in kept[-n:]])
        self.history.clear()
        self.history.extend(kept)

    def _onset(self, ep: _Episode, until: int, s: float, now_step: int, rising: bool) -> int:
        """Where the excursion began: the last minimum of the cumulative residual above the frozen
        trend (less a quarter sigma per sample) over the samples before `until` (a ramp starts well
        before it crosses any threshold); while still `rising`, no later than the lower confidence
        bound on a broken-stick knot (`_hinge` with `onset_slack`)."""
        lookback = ep.start_step - 2 * self.cfg.patience_steps
        best, best_step, acc = 0.0, ep.start_step, 0.0
        kappa = 0.25 * s
        for st, x in self.history:
            if st < lookback or st > until:
                continue
            acc += x - ep.predict(st) - kappa
            if acc <= best:
                best, best_step = acc, st
        # the minimum is the last sample before the climb, or its first sample by a hair: report it (a
        # rollback goes strictly before the start, and one step early is the safe side)
        start = ep.start_step if ep.abrupt else min(ep.start_step, best_step)
        if not rising:
            return start
        # Still climbing (a ramp): the cumulative sum's minimum lags its start (the residual must outgrow
        # kappa first), and an episode that opened on a spike may sit on a climb that began before it. The
        # broken-stick fit's lower confidence bound on the knot, over the same look-back, is the safe side.
        knot = _hinge([(st, x) for st, x in self.history if lookback <= st <= now_step],
                      self.cfg.onset_slack)
        return start if knot is None else min(start, knot)

    # -- one sample ------------------------------------------------------------------------------
    def update(self, step: int, value: float, now: float, judge: bool) -> list[LossEvent]:
        cfg, rules = self.cfg, self.rules
        x = math.log(value)
        u = _u(step)
        self.recent.append((step, u, x))
        self.history.append((step, x))
        while self.recent and self.recent[0][0] <= step - cfg.level_steps:
            self.recent.popleft()
        if not judge or step < rules.warmup_steps or len(self.trend.pts) < cfg.min_samples:
            self._accept(step, x)
            self._divergence_feed(step, x, now, judge=False)
            return []
        events = self._divergence_feed(step, x, now, judge=True)
        if events:        # a divergence closes whatever was open (the detector was rebased)
            return events
        ep = self.episode
        s = self.sigma()
        line = ep.line if ep is not None else self.trend.line(cfg.trend_min_samples, s)
        b = line.predict(step)
        pvar = line.var(step)
        r = x - b
        # The level: the median of the last `level_steps` steps, only since the start of an open episode
        # (so the samples before a spike do not hide it), against the trend at each sample's step.
        la, lb, lref, luntil = line.a, line.b, line.ref, line.until
        since = ep.start_step if ep is not None else -1
        level_rs = [xi - la - lb * (min(ui, luntil) - lref) for st, ui, xi in self.recent if st >= since] or [r]
        level_rs.sort()
        level = _median_of_sorted(level_rs)
        n = len(level_rs)
        sd_level = s * math.sqrt(_MEDIAN_EFFICIENCY ** 2 / n + pvar)
        # (a median baseline, over few samples, has prior_sigma as its scale: conservative enough)
        spike_thr = max(math.log(rules.spike_ratio), rules.spike_z * s * (math.sqrt(1.0 + pvar) if line.sxx else 1.0))
        elev_thr = max(_LEVEL_FLOOR, cfg.level_z * sd_level)
        recover_thr = max(0.5 * _LEVEL_FLOOR, 2.0 * sd_level)
        is_spike = r >= spike_thr
        is_elev = level >= elev_thr

        if ep is None:
            if not (is_spike or is_elev):
                clip = _CLIP_Z * s * math.sqrt(1.0 + pvar)   # (a median over few samples: not clipped)
                self._accept(step, x, (b - clip, b + clip) if line.sxx > 0.0 else None, u)
                self._follow_drop(step, level, elev_thr)
                return events
            half = 0.5 * level
            start = step if is_spike else next((st for st, _, xi in self.recent
                                                if xi - line.predict(st) >= half), step)
            frozen = dataclasses.replace(line, until=_u(step + 2 * cfg.patience_steps))
            ep = self.episode = _Episode(start_step=start, line=frozen, peak=r, peak_step=step, abrupt=is_spike)
        if r > ep.peak:
            ep.peak, ep.peak_step = r, step

        # A spike: reported at once when it is spike_alone_ratio x the trend, else when the next sample
        # confirms it (still half as high, or the level elevated): a lone sample is a benign blip.
        pend = ep.pending
        if pend is not None and step > pend[0]:
            ep.pending = None
            if r >= 0.5 * spike_thr:
                events.append(self._spike(ep, pend[0], pend[1], pend[2], ep.predict(pend[0]), now, step))
        if is_spike and not ep.in_spike and (ep.last_spike_step is None
                                             or step - ep.last_spike_step >= cfg.level_steps):
            if r >= math.log(rules.spike_alone_ratio):
                events.append(self._spike(ep, step, x, r, b, now, step))
            elif ep.pending is None:
                ep.pending = (step, x, r)
        ep.in_spike = is_spike

        # The elevated run: starts when the level crosses the threshold, ends under recovery.
        if ep.elevated_since is None:
            if is_elev:
                half = 0.5 * level
                ep.elevated_since = max(ep.start_step, next((st for st, _, xi in self.recent
                                                             if xi - ep.predict(st) >= half), step))
                ep.run_residuals = [xi - ep.predict(st) for st, _, xi in self.recent if st >= ep.elevated_since]
        else:
            ep.run_residuals.append(r)

        if level < recover_thr and not is_spike and ep.pending is None:
            if ep.spike_reported:
                events.append(self._event(
                    step, "recovered", Severity.INFO, b + ep.peak, b, ep.start_step, now,
                    f"{rules.signal} back to its baseline at step {step} after {step - ep.start_step} steps "
                    f"(peak {math.exp(ep.peak):.2f}x at step {ep.peak_step})"))
            self.episode = None
            self._accept(step, x)
            return events

        rising = False
        if ep.elevated_since is not None and step - ep.elevated_since >= cfg.patience_steps:
            run = ep.run_residuals
            k = len(run) // 2
            ordered = sorted(run)
            run_level = _median_of_sorted(ordered)
            run_sd = s * math.sqrt(_MEDIAN_EFFICIENCY ** 2 / len(run) + pvar)
            held = len(run) >= cfg.min_sustained_samples and run_level >= cfg.sustained_z * run_sd
            # still climbing (a ramp): the later half of the run above the earlier half
            rise = statistics.median(run[k:]) - statistics.median(run[:k]) if k else 0.0
            rising = rise >= max(0.25 * run_level, 3.0 * s * _MEDIAN_EFFICIENCY * math.sqrt(2.0 / max(1, k)))
            floor = math.log(rules.sustained_ratio)
            if held and level >= floor and (run_level >= floor or rising):
                start = self._onset(ep, ep.elevated_since, s, step, rising)
                events.append(self._event(
                    step, "sustained", rules.sustained_severity, b + level, b, start, now,
                    f"{rules.signal} {math.exp(level):.2f}x its baseline {math.exp(b):.6g} for "
                    f"{step - start} steps (since step {start}; peak {math.exp(ep.peak):.2f}x)"))
                self._adopt(ep.elevated_since, clear_divergence=True)
                return events
            if held and not rising and run_level >= math.log(cfg.shift_ratio):
                start = self._onset(ep, ep.elevated_since, s, step, rising)
                events.append(self._event(      # the grad norm's is a (WARNING) sustained excursion
                    step, "shift" if rules.signal == "loss" else "sustained", Severity.WARNING, b + run_level, b,
                    start, now,
                    f"{rules.signal} level shift: {math.exp(run_level):.3f}x its baseline {math.exp(b):.6g} "
                    f"for {step - start} steps (since step {start}; {run_level / s:.0f} sigma of its noise), "
                    f"under the {rules.sustained_ratio}x of a critical excursion; adopted as the new level"))
                # the new level is where the run ended (its start may still carry a decaying spike's tail)
                self._adopt(max(ep.elevated_since, step - cfg.level_steps), clear_divergence=False)
                return events
            if not is_elev:      # the run did not hold: wait for a new one
                ep.elevated_since, ep.run_residuals = None, []
        if step - ep.start_step >= (_RAMP_PATIENCE if rising else 3) * cfg.patience_steps:
            # neither recovered nor escalated: the level is adopted (an episode never stays open)
            log.debug("%s: excursion since step %d neither recovered nor held: adopted as the level",
                      rules.signal, ep.start_step)
            self._adopt(step - cfg.level_steps, clear_divergence=False)
        return events

    def _follow_drop(self, step: int, level: float, thr: float) -> None:
        """A level as far BELOW the trend as an excursion would be above it (an LR drop, a step decay):
        once it has held for `level_steps`, the trend restarts from it (a line through a drop would
        slope down too steeply and make the flat curve after it look elevated)."""
        if level > -thr:
            self._low_since = None
        elif self._low_since is None:
            self._low_since = step
        elif step - self._low_since >= self.cfg.level_steps:
            self._adopt(self._low_since, clear_divergence=False)
            self._low_since = None

    def _spike(self, ep: _Episode, at: int, x: float, r: float, b: float, now: float, step: int) -> LossEvent:
        ep.spike_reported, ep.last_spike_step = True, at
        rules = self.rules
        return self._event(step, "spike", rules.spike_severity, x, b, at, now,
                           f"{rules.signal} spike at step {at}: {math.exp(x):.6g} is "
                           f"{math.exp(r):.2f}x the baseline {math.exp(b):.6g}")

    def _divergence_feed(self, step: int, x: float, now: float, judge: bool) -> list[LossEvent]:
        """Block medians against the lowest block since the last reset (O(1) state): a rise of
        `divergence_ratio` spread over at least `divergence_min_blocks` blocks, with no single block
        carrying more than `divergence_max_jump` of it (that would be a jump: the sustained rule's
        case), seen on two consecutive blocks."""
        cfg, rules = self.cfg, self.rules
        if not rules.divergence:
            return []
        self.block.append(x)
        if len(self.block) < cfg.divergence_block:
            return []
        m = statistics.median(self.block)
        self.block.clear()
        d = self.div
        if d.ref is None or m <= d.ref:
            d.ref, d.ref_step, d.low_step, d.max_jump, d.blocks_since, d.prev, d.armed = m, step, step, 0.0, 0, m, 0
            return []
        block_sigma = self.sigma() * _MEDIAN_EFFICIENCY / math.sqrt(cfg.divergence_block)
        if m <= d.ref + max(0.02, 3 * block_sigma):
            d.low_step = step       # still level with the lowest block: the climb starts after this
        d.max_jump = max(d.max_jump, m - d.prev)
        d.blocks_since += 1
        d.prev = m
        rise = m - d.ref
        thr = max(math.log(cfg.divergence_ratio),
                  cfg.divergence_z * self.sigma() * _MEDIAN_EFFICIENCY * math.sqrt(2.0 / cfg.divergence_block))
        if not (judge and rise >= thr and d.blocks_since >= cfg.divergence_min_blocks
                and d.max_jump <= cfg.divergence_max_jump * rise):
            d.armed = 0
            return []
        d.armed += 1
        if d.armed < 2:
            return []
        start = _hinge(list(self.history), cfg.onset_slack)
        start = d.low_step + 1 if start is None else min(start, d.low_step + 1)
        event = self._event(step, "divergence", Severity.CRITICAL, m, d.ref, start, now,
                            f"{rules.signal} trending up: {math.exp(rise):.2f}x its lowest level "
                            f"{math.exp(d.ref):.6g} (step {d.ref_step}) over {step - d.ref_step} steps")
        self._adopt(step - cfg.level_steps, clear_divergence=True)
        return [event]

    def _event(self, step: int, kind: AnomalyKind, severity: Severity, x: float, b: float, start: int,
               now: float, message: str) -> LossEvent:
        return LossEvent(step=step, kind=kind, signal=self.rules.signal, severity=severity, value=math.exp(x),
                         baseline=math.exp(b), magnitude=math.exp(x - b), start_step=start, message=message,
                         time=now)


class _LossScaleTracker:
    """fp16 dynamic loss scale: collapse = a fall far below a recently settled scale."""

    def __init__(self, cfg: LossDetectorConfig) -> None:
        self.cfg = cfg
        self.prev: tuple[int, float] | None = None
        self.settled: deque[tuple[int, float]] = deque(maxlen=cfg.window)
        self.drop_start: int | None = None
        self.armed = True

    def restart(self) -> None:
        self.prev = None
        self.drop_start = None

    def update(self, step: int, scale: float, now: float) -> list[LossEvent]:
        cfg = self.cfg
        events: list[LossEvent] = []
        prev = self.prev
        self.prev = (step, scale)
        if prev is not None and scale < prev[1]:
            if self.drop_start is None:
                self.drop_start = step
        elif prev is not None and scale >= prev[1]:
            self.drop_start = None
        while self.settled and self.settled[0][0] < step - cfg.loss_scale_window_steps:
            self.settled.popleft()
        if self.settled and self.armed:
            ref = max(v for _, v in self.settled)
            collapsed = scale * cfg.loss_scale_collapse_factor <= ref or (
                scale <= cfg.loss_scale_floor < ref)
            if collapsed:
                self.armed = False
                start = self.drop_start if self.drop_start is not None else step
                events.append(LossEvent(
                    step=step, kind="loss_scale_collapse", signal="loss_scale", severity=Severity.CRITICAL,
                    value=scale, baseline=ref, magnitude=scale / ref, start_step=start, time=now,
                    message=f"loss scale collapsed to {scale:g} from {ref:g} (falling since step {start}): "
                            f"fp16 overflow on step after step"))
        if prev is not None and scale == prev[1]:
            if not self.armed:
                self.settled.clear()
                self.armed = True
            self.settled.append((step, scale))
        return events


class LossDetector:
    """One job's (or one rank's) loss, grad-norm and loss-scale detector. Pure; O(window) memory.

    Lifecycle: build with a `LossDetectorConfig`, call `update` once per reported step in step order
    (equal steps are further samples of the same step; a lower step is a restart), and optionally
    `flush` at the end of a replay to report an anomaly still open.
    """

    def __init__(self, config: LossDetectorConfig | None = None) -> None:
        self.config = cfg = config if config is not None else LossDetectorConfig()
        self._loss = _SignalTracker(cfg, _Rules(
            "loss", cfg.spike_ratio, cfg.spike_z, cfg.spike_alone_ratio, cfg.sustained_ratio, cfg.sustained_z,
            Severity.CRITICAL, Severity.WARNING, warmup_steps=cfg.warmup_steps, divergence=True))
        grad_sev = Severity.CRITICAL if cfg.grad_norm_critical else Severity.WARNING
        self._grad = _SignalTracker(cfg, _Rules(
            "grad_norm", cfg.grad_norm_spike_ratio, cfg.grad_norm_spike_z, cfg.grad_norm_spike_alone_ratio,
            cfg.grad_norm_sustained_ratio, cfg.grad_norm_sustained_z, grad_sev, Severity.WARNING,
            warmup_steps=max(cfg.warmup_steps, cfg.grad_norm_warmup_steps), divergence=False))
        self._scale = _LossScaleTracker(cfg)
        self._last_step: int | None = None
        self._nonfinite_open = {"loss": False, "grad_norm": False}
        self._ignored_warned = False

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def update(self, step: int, loss: float | None, grad_norm: float | None, now: float,
               loss_scale: float | None = None) -> list[LossEvent]:
        """Feed one sample; returns the events it triggers (usually none). `None` = not reported."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an int, got {step!r}")
        if self._last_step is not None and step < self._last_step:
            log.info("step went back from %d to %d: treated as a restart from a checkpoint", self._last_step, step)
            self._loss.restart(step)
            self._grad.restart(step)
            self._scale.restart()
            self._nonfinite_open = {"loss": False, "grad_norm": False}
        self._last_step = step
        judge = step >= self.config.warmup_steps
        events: list[LossEvent] = []
        fp16 = loss_scale is not None
        for signal, value, tracker in (("grad_norm", grad_norm, self._grad), ("loss", loss, self._loss)):
            if value is None:
                continue
            value = float(value)
            if not math.isfinite(value):
                if signal == "grad_norm" and fp16:
                    log.debug("step %d: grad norm %s with a loss scale: the scaler's overflow skip", step, value)
                elif not self._nonfinite_open[signal]:
                    self._nonfinite_open[signal] = True
                    base = tracker.baseline() if tracker.trend.pts else math.nan
                    events.append(LossEvent(
                        step=step, kind="nonfinite", signal=signal, severity=Severity.CRITICAL,  # type: ignore[arg-type]
                        value=value, baseline=math.exp(base) if math.isfinite(base) else math.nan,
                        magnitude=math.inf, start_step=step, time=now,
                        message=f"{signal} is {value} at step {step}"))
                continue
            self._nonfinite_open[signal] = False
            if value <= 0.0:
                if not self._ignored_warned:
                    self._ignored_warned = True
                    log.info("step %d: %s %r is not positive; such samples are ignored", step, signal, value)
                continue
            events += tracker.update(step, value, now, judge)
        if loss_scale is not None and math.isfinite(loss_scale) and loss_scale > 0:
            events += self._scale.update(step, float(loss_scale), now)
        return events

    def flush(self, now: float) -> list[LossEvent]:
        """At the end of the data: an excursion still open is reported as a WARNING `spike`."""
        events: list[LossEvent] = []
        for tracker in (self._loss, self._grad):
            ep = tracker.episode
            if ep is None or self._last_step is None:
                continue
            step = self._last_step
            base = ep.predict(step)
            last = tracker.recent[-1][2] if tracker.recent else base + ep.peak
            events.append(tracker._event(
                step, "spike", Severity.WARNING, last, base, ep.start_step, now,
                f"{tracker.rules.signal} still {math.exp(last - base):.2f}x its baseline at the end "
                f"of the data ({step - ep.start_step} steps since step {ep.start_step}; "
                f"peak {math.exp(ep.peak):.2f}x)"))
        return events


# -- rollback ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class RollbackDecision:
    """Restore `target_step`, then skip the data batches of steps [skip_from_step, skip_to_step)."""

    target_step: int
    skip_batches: int
    skip_from_step: int
    skip_to_step: int
    reason: str


@dataclasses.dataclass(kw_only=True, slots=True)
class RollbackPolicy:
    """Pure rollback rule (PaLM's recipe by default: restart about 100 steps before the spike and skip
    200 batches from there). The agent's `[rollback]` config section.

    Target: the newest VERIFIED checkpoint step strictly older than the anomaly's start. Skipped data:
    `skip_batches` batches starting `skip_before_steps` steps before the anomaly (never before the
    target), so the batches around the anomaly are not seen again.
    """

    skip_batches: int = setting(200, "data batches the job skips after restoring (0: replay them all)")
    skip_before_steps: int = setting(100, "the skipped batches start this many steps before the anomaly began")
    kinds: frozenset[str] = setting(ROLLBACK_KINDS, "critical loss event kinds that roll the job back "
                                    "(of nonfinite, sustained, divergence, loss_scale_collapse)")

    def __post_init__(self) -> None:
        for name in ("skip_batches", "skip_before_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SettingError("RollbackPolicy", name, f"must be an integer >= 0, got {value!r}")
        self.kinds = frozenset(self.kinds)
        unknown = sorted(self.kinds - ROLLBACK_KINDS)
        if unknown:
            raise SettingError("RollbackPolicy", "kinds", f"{', '.join(unknown)} cannot roll back: choose from "
                               f"{', '.join(sorted(ROLLBACK_KINDS))}")

    def decide(self, event: LossEvent, verified_steps: Sequence[int]) -> RollbackDecision | None:
        """None unless the event is critical, of a rollback kind, and a verified step precedes it."""
        if event.severity != Severity.CRITICAL or event.kind not in self.kinds:
            return None
        older = [s for s in verified_steps if s < event.start_step]
        if not older:
            return None
        target = max(older)
        skip_from = max(target, event.start_step - self.skip_before_steps)
        return RollbackDecision(
            target_step=target, skip_batches=self.skip_batches, skip_from_step=skip_from,
            skip_to_step=skip_from + self.skip_batches,
            reason=f"{event.signal} {event.kind} from step {event.start_step}: roll back to verified step "
                   f"{target}, skip the batches of steps {skip_from}..{skip_from + self.skip_batches - 1}")
