"""Evaluate the loss detector (and the anchors' rules) on labelled synthetic curves and real excerpts.

    python -m bench.spikes_eval [--seeds eval|tuning] [--n N] [--data DIR] [--set key=value ...]

The curves are bench/loss_synth.py's (evaluation seeds by default; the detector's defaults were chosen
on the tuning seeds). probes.loss_detector with its defaults (or `--set` overrides) is scored side by
side with the anchors' rules (bench/loss_anchors.py: OLMo 6 sigma, llm-foundry, metaseq, Megatron),
which see the loss only and act (count as critical) on every trigger. The target table is printed last.

Scoring, per anomaly (positions in the log; `sigma` is the generator's noise sd at the start):
  NaN on step     a critical `nonfinite` on the very sample it appears
  shift ~10%      shifts of x1.09..1.15 that are >= 5 sigma: any event (warning or critical) within
                  50 steps of the start (`shift` class: after the first tenth of the run)
  shift >=15%     shifts of x1.15 or more that are >= 5 sigma: a critical event within 50 steps
  early ...       the same for `early_shift` (the first tenth of a run after the warm-up)
  ramp            a critical event within 50 steps of the full level (or of the start + 300); onset
                  error = reported start_step - true start (median/p95 of |error|, signed median);
                  "target < onset": with verified checkpoints every 50 steps, the newest one before the
                  reported start is before the true start
  divergence      a critical event after the start and before the noiseless loss doubles
  loss scale      a critical event within 50 steps of the start of the overflow run
  spike seen      a warning about the loss by the end of the spike + 8 steps; "crit on spike": the share
                  of transient spikes that drew a critical event
  clean steps     samples outside every anomaly and benign label (one-step blips, data-order spikes:
                  + 20 samples; a data-mix shift: + 300; a lasting anomaly: everything from its start);
                  critical events there are false; "crit benign": critical events on benign labels;
                  warnings (loss or grad norm) per 10,000 clean samples of the noisy curves (end-of-run
                  noise >= 2%), and of all curves
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bench.loss_anchors import ANCHORS, AnchorRule
from bench.loss_synth import CLASSES, EVAL_SEEDS, TUNING_SEEDS, Curve, curves
from probes.loss_detector import LossDetector, LossDetectorConfig, LossEvent
from probes.spikes_replay import event_line, replay_log
from probes.training_log import TrainingLogError, read_training_log
from sdcwatch.types import Severity

WITHIN = 50
SPIKE_GRACE = 8
BENIGN_MARGIN = 20
MIX_MARGIN = 300
SPIKE_CLEAN_MARGIN = 100
CKPT_EVERY = 50
MIN_Z = 5.0
DEFAULT_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "loss-curves"


@dataclasses.dataclass(frozen=True, slots=True)
class Trigger:
    index: int          # position of the sample that raised it
    critical: bool
    kind: str           # "spike", "sustained", ...; "grad_spike", ... for the grad norm; the anchor's name
    start_step: int


Detector = Callable[[Curve], list[Trigger]]


@dataclasses.dataclass(frozen=True)
class SdcwatchDetector:
    """probes.loss_detector on one curve (a class, so that worker processes can receive it)."""

    config: LossDetectorConfig

    def __call__(self, c: Curve) -> list[Trigger]:
        det = LossDetector(self.config)
        out: list[Trigger] = []
        scale = c.loss_scale
        for i in range(len(c)):
            evs = det.update(int(c.steps[i]), float(c.loss[i]), float(c.grad_norm[i]), float(i),
                             loss_scale=None if scale is None else float(scale[i]))
            out += [_trigger(i, e) for e in evs]
        return out


def _trigger(i: int, e: LossEvent) -> Trigger:
    kind = e.kind if e.signal != "grad_norm" else f"grad_{e.kind}"
    return Trigger(i, e.severity == Severity.CRITICAL, kind, e.start_step) if e.severity != Severity.INFO \
        else Trigger(i, False, "info", e.start_step)


@dataclasses.dataclass(frozen=True)
class AnchorDetector:
    rule: AnchorRule

    def __call__(self, c: Curve) -> list[Trigger]:
        return [Trigger(i, True, "anchor", int(c.steps[i])) for i in self.rule(c.loss.tolist())]


@dataclasses.dataclass(slots=True)
class Score:
    caught: dict[str, list[bool]] = dataclasses.field(default_factory=dict)
    delays: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    onset_err: list[int] = dataclasses.field(default_factory=list)
    target_ok: list[bool] = dataclasses.field(default_factory=list)
    spike_crit: list[bool] = dataclasses.field(default_factory=list)
    false_crit: int = 0
    benign_crit: int = 0
    clean_steps: int = 0
    warnings: int = 0
    noisy_steps: int = 0
    noisy_warnings: int = 0
    early_warnings: int = 0          # warnings on the first 50 clean samples of runs from scratch
    early_curves: int = 0

    def add(self, key: str, ok: bool, delay: int | None = None) -> None:
        self.caught.setdefault(key, []).append(ok)
        if ok and delay is not None:
            self.delays.setdefault(key, []).append(delay)


def _apply(detector: Detector, data: Sequence[Curve], workers: int) -> list[list[Trigger]]:
    if workers <= 1:
        return [detector(c) for c in data]
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(detector, data, chunksize=8))


def _rollback_target(start_step: int) -> int:
    """The newest verified checkpoint strictly older than `start_step`, checkpoints every CKPT_EVERY."""
    return ((start_step - 1) // CKPT_EVERY) * CKPT_EVERY


def _score_curve(sc: Score, c: Curve, trig: list[Trigger]) -> None:
    crit = [t for t in trig if t.critical]
    busy = np.zeros(len(c), dtype=bool)      # samples excluded from the clean count
    benign = np.zeros(len(c), dtype=bool)
    for a in c.anomalies:
        i0 = a.index
        if a.benign:
            benign[i0:a.end_index + 1 + (MIX_MARGIN if a.kind == "mix_shift" else BENIGN_MARGIN)] = True
            continue
        if a.kind == "spike":
            busy[i0:a.end_index + SPIKE_CLEAN_MARGIN + 1] = True
            seen = [t for t in trig if i0 <= t.index <= a.end_index + SPIKE_GRACE
                    and t.kind in ("spike", "sustained", "anchor")]
            sc.add("spike", bool(seen), (seen[0].index - i0) if seen else None)
            sc.spike_crit.append(any(i0 <= t.index <= a.end_index + SPIKE_CLEAN_MARGIN for t in crit))
            continue
        busy[i0:] = True
        first = next((t for t in crit if t.index >= i0), None)
        if a.kind == "nan":
            sc.add("nan", any(t.index == i0 and t.kind.endswith("nonfinite") for t in crit), 0)
        elif a.kind in ("shift", "early_shift"):
            z = math.log(a.magnitude) / a.sigma
            if z < MIN_Z:
                sc.add(f"{a.kind} <5sigma", first is not None and first.index - i0 <= WITHIN)
                continue
            anyev = next((t for t in trig if t.index >= i0 and t.kind != "info" and not t.kind.startswith("grad")),
                         None)
            if 1.09 <= a.magnitude < 1.15:
                ok = anyev is not None and anyev.index - i0 <= WITHIN
                sc.add(f"{a.kind} 10%", ok, anyev.index - i0 if ok and anyev else None)
            elif a.magnitude >= 1.15:
                ok = first is not None and first.index - i0 <= WITHIN
                sc.add(f"{a.kind} 15%", ok, first.index - i0 if ok and first else None)
        elif a.kind == "ramp":
            bound = i0 + min(a.length, 300) + WITHIN
            ok = first is not None and first.index <= bound
            sc.add("ramp", ok, first.index - i0 if ok and first else None)
            if ok and first is not None:
                sc.onset_err.append(first.start_step - a.start)
                sc.target_ok.append(_rollback_target(first.start_step) < a.start)
        elif a.kind == "loss_scale_collapse":
            ok = first is not None and first.index - i0 <= WITHIN
            sc.add(a.kind, ok, first.index - i0 if first else None)
        elif a.kind == "divergence":
            assert a.double_step is not None
            ok = first is not None and int(c.steps[first.index]) < a.double_step
            sc.add("divergence", ok, first.index - i0 if first else None)
    clean = ~busy & ~benign
    sc.clean_steps += int(clean.sum())
    sc.false_crit += sum(1 for t in crit if clean[t.index])
    sc.benign_crit += sum(1 for t in crit if benign[t.index] and not busy[t.index])
    warn = [t for t in trig if not t.critical and t.kind != "info" and clean[t.index]]
    sc.warnings += len(warn)
    if c.noisy:
        sc.noisy_steps += int(clean.sum())
        sc.noisy_warnings += len(warn)
    if c.warmup_end:
        sc.early_curves += 1
        sc.early_warnings += sum(1 for t in warn if t.index < 50)


def score(detector: Detector, data: Sequence[Curve], workers: int = 1) -> Score:
    sc = Score()
    for c, trig in zip(data, _apply(detector, data, workers)):
        _score_curve(sc, c, trig)
    return sc


def _pct(xs: Sequence[bool]) -> str:
    return f"{100.0 * sum(xs) / len(xs):.1f}% ({len(xs)})" if xs else "-"


def _delay(xs: Sequence[int]) -> str:
    return f"{statistics.median(xs):.0f}/{np.percentile(xs, 95):.0f}/{max(xs)}" if xs else "-"


def _rate(n: int, steps: int) -> str:
    return f"{1e4 * n / max(1, steps):.2f}"


# (column, target, value)
def table(rows: list[tuple[str, Score]]) -> str:
    def cols(sc: Score) -> list[tuple[str, str, str]]:
        err = sc.onset_err
        return [
            ("NaN on step", "100%", _pct(sc.caught.get("nan", []))),
            ("shift ~10% >=5σ, any event <=50", ">=95%", _pct(sc.caught.get("shift 10%", []))),
            ("shift >=15% >=5σ, critical <=50", ">=95%", _pct(sc.caught.get("shift 15%", []))),
            ("delay med/p95/max", "", _delay(sc.delays.get("shift 15%", []))),
            ("early ~10% >=5σ, any event <=50", ">=95%", _pct(sc.caught.get("early_shift 10%", []))),
            ("early >=15% >=5σ, critical <=50", ">=95%", _pct(sc.caught.get("early_shift 15%", []))),
            ("shift <5σ, critical <=50 (info)", "", _pct(sc.caught.get("shift <5sigma", []))),
            ("ramp critical", "", _pct(sc.caught.get("ramp", []))),
            ("ramp onset |err| med/p95 (signed med)", "med <=10",
             f"{statistics.median([abs(e) for e in err]):.0f}/{np.percentile([abs(e) for e in err], 95):.0f} "
             f"({statistics.median(err):+.0f})" if err else "-"),
            ("ramp rollback target < onset", "100%", _pct(sc.target_ok)),
            ("divergence < 2x", "", _pct(sc.caught.get("divergence", []))),
            ("loss-scale collapse <=50", "", _pct(sc.caught.get("loss_scale_collapse", []))),
            ("transient spike seen", "", _pct(sc.caught.get("spike", []))),
            ("crit on transient spike", "", _pct(sc.spike_crit)),
            ("false crit (clean steps)", "0", f"{sc.false_crit} in {sc.clean_steps}"),
            ("crit on benign blips/data spikes/mix shifts", "0", str(sc.benign_crit)),
            ("warnings /10k clean, noisy curves", "<=2", _rate(sc.noisy_warnings, sc.noisy_steps)),
            ("warnings /10k clean, all curves", "", _rate(sc.warnings, sc.clean_steps)),
            ("warnings in first 50 samples of runs from scratch", "0",
             f"{sc.early_warnings} in {sc.early_curves} runs"),
        ]
    names = [name for name, _ in rows]
    built = [cols(sc) for _, sc in rows]
    head = ["measure", "target"] + names
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for k, (label, target, _) in enumerate(built[0]):
        lines.append("| " + " | ".join([label, target] + [b[k][2] for b in built]) + " |")
    return "\n".join(lines)


def replay_excerpts(data_dir: Path) -> str:
    out = []
    for f in sorted(data_dir.glob("*.csv")):
        try:
            tlog = read_training_log(f, allow_restarts=True)
        except TrainingLogError as exc:
            out.append(f"{f.name}: unreadable: {exc}")
            continue
        out.append(f"== {f.name}")
        out += [event_line(e) for e in replay_log(tlog)]
    return "\n".join(out)


def parse_sets(items: list[str]) -> dict[str, object]:
    fields = {f.name: f for f in dataclasses.fields(LossDetectorConfig)}
    out: dict[str, object] = {}
    for item in items:
        key, _, raw = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--set: unknown field {key!r}")
        default = getattr(LossDetectorConfig(), key)
        out[key] = (raw.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)(raw)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", choices=("eval", "tuning", "fresh"), default="eval",
                    help="eval (the reported set), tuning (defaults chosen on it), or fresh: --seed-base onwards")
    ap.add_argument("--seed-base", type=int, default=300_000,
                    help="first seed of the fresh set (a check on seeds neither chosen nor reported before)")
    ap.add_argument("--n", type=int, default=0, help="use only the first N seeds of the set")
    ap.add_argument("--classes", default=",".join(CLASSES), help="comma-separated classes to generate")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="real loss-curve excerpts (CSV)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="detector config override")
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    seeds = list(EVAL_SEEDS if args.seeds == "eval" else TUNING_SEEDS if args.seeds == "tuning"
                 else range(args.seed_base, args.seed_base + len(EVAL_SEEDS)))
    if args.n:
        seeds = seeds[:args.n]
    classes = tuple(c for c in args.classes.split(",") if c)
    config = LossDetectorConfig(**parse_sets(args.set))  # type: ignore[arg-type]
    data = curves(seeds, classes)
    n_steps = sum(len(c) for c in data)
    print(f"# {len(data)} curves ({len(seeds)} {args.seeds} seeds x {len(classes)} classes), {n_steps} steps; "
          f"{datetime.date.today().isoformat()}")
    w = args.workers
    rows = [("sdcwatch", score(SdcwatchDetector(config), data, w))]
    if not args.no_anchors:
        rows += [(name, score(AnchorDetector(rule), data, w)) for name, rule in ANCHORS.items()]
    if args.no_replay:
        pass
    elif args.data.is_dir():
        print("\n# replay of the real excerpts (--allow-restarts)")
        print(replay_excerpts(args.data))
    else:
        print(f"\n# no excerpts at {args.data}")
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
