"""Evaluate the loss detector (and the anchors' rules) on labelled synthetic curves and real excerpts.

    python -m bench.spikes_eval [--seeds eval|tuning] [--n N] [--data DIR] [--set key=value ...]

Per class: recall, detection delay in steps, and false critical events per 10,000 clean steps, for
probes.loss_detector with its defaults (or `--set` overrides) side by side with the rules of
llm-foundry (KillLossSpike: loss >= 2x the mean of the last 100 for more than 4 steps), OLMo-core /
levanter (6 sigma over the last 128 steps), Megatron-LM (10x the max of the first 100 values) and
metaseq (loss / EWM(span 9) of the loss > 1.5; the ratio is a flag there, off by default). The anchors
see the loss only. Then the replay of the real excerpts. The short table is printed last.

Scoring, per anomaly (the generator's labels, bench/loss_synth.py):
  nan          caught: a critical `nonfinite` on the very step it appears
  sustained    caught: a critical event within 50 steps of the start (the issue's patience bound)
  divergence   caught: a critical event after the start and before the noiseless loss doubles
  loss scale   caught: a critical event within 50 steps of the start of the overflow run
  spike        recall: a spike event (any severity) by the end of the spike + 8 steps;
               "crit on spike": the fraction of transient spikes that drew a critical event
  clean steps  all steps outside anomalies (clean curves, spike curves outside spikes + 100 steps,
               and the steps before the start in the others); a critical event there is false
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import dataclasses
import datetime
import math
import statistics
import sys
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bench.loss_synth import CLASSES, EVAL_SEEDS, TUNING_SEEDS, Curve, curves
from probes.loss_detector import LossDetector, LossDetectorConfig, LossEvent
from sdcwatch.types import Severity

SUSTAINED_BOUND = 50
SPIKE_GRACE = 8
SPIKE_CLEAN_MARGIN = 100
DEFAULT_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "loss-curves"


@dataclasses.dataclass(frozen=True, slots=True)
class Trigger:
    step: int
    critical: bool
    kind: str


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
            out += [_trigger(e) for e in evs]
        return out


def _trigger(e: LossEvent) -> Trigger:
    kind = e.kind if e.signal != "grad_norm" else f"grad_{e.kind}"
    return Trigger(e.step, e.severity == Severity.CRITICAL, kind)


# -- the anchors' rules (loss only; reimplemented from their descriptions) -------------------------------

def foundry(c: Curve) -> list[Trigger]:
    window: deque[float] = deque(maxlen=100)
    run, out = 0, []
    for step, x in zip(c.steps, c.loss):
        if not math.isfinite(x):
            continue
        if len(window) == window.maxlen and x >= 2 * (sum(window) / len(window)):
            run += 1
            if run > 4:
                out.append(Trigger(int(step), True, "foundry"))
                run = 0
            continue
        run = 0
        window.append(float(x))
    return out


def olmo(c: Curve) -> list[Trigger]:
    window: deque[float] = deque(maxlen=128)
    out = []
    for step, x in zip(c.steps, c.loss):
        if not math.isfinite(x):
            continue
        if len(window) >= 20:
            arr = np.fromiter(window, float)
            if x > arr.mean() + 6 * arr.std():
                out.append(Trigger(int(step), True, "olmo"))
                continue      # the step is skipped: its loss does not enter the statistics
        window.append(float(x))
    return out


def megatron(c: Curve) -> list[Trigger]:
    first: list[float] = []
    out = []
    for step, x in zip(c.steps, c.loss):
        if not math.isfinite(x):
            continue
        if len(first) < 100:
            first.append(float(x))
            continue
        if x > 10 * max(first):
            out.append(Trigger(int(step), True, "megatron"))
    return out


def metaseq(c: Curve) -> list[Trigger]:
    alpha = 2 / (9 + 1)
    ewm: float | None = None
    out = []
    for step, x in zip(c.steps, c.loss):
        if not math.isfinite(x):
            continue
        if ewm is not None and x / ewm > 1.5:
            out.append(Trigger(int(step), True, "metaseq"))
        ewm = float(x) if ewm is None else alpha * float(x) + (1 - alpha) * ewm
    return out


# -- scoring -----------------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class Score:
    caught: dict[str, list[bool]] = dataclasses.field(default_factory=dict)
    delays: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    spike_crit: list[bool] = dataclasses.field(default_factory=list)
    false_crit: int = 0
    clean_steps: int = 0
    div_ratio: list[float] = dataclasses.field(default_factory=list)   # loss at detection / at start

    def add(self, cls: str, ok: bool, delay: int | None) -> None:
        self.caught.setdefault(cls, []).append(ok)
        if ok and delay is not None:
            self.delays.setdefault(cls, []).append(delay)


def _apply(detector: Detector, data: Sequence[Curve], workers: int) -> list[list[Trigger]]:
    if workers <= 1:
        return [detector(c) for c in data]
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(detector, data, chunksize=8))


def score(detector: Detector, data: Sequence[Curve], workers: int = 1) -> Score:
    sc = Score()
    for c, trig in zip(data, _apply(detector, data, workers)):
        crit = [t for t in trig if t.critical]
        s0, s_end = int(c.steps[0]), int(c.steps[-1])
        busy = np.zeros(len(c), dtype=bool)      # steps excluded from the clean count
        for a in c.anomalies:
            i0 = a.start - s0
            if a.kind == "spike":
                busy[i0:a.end - s0 + SPIKE_CLEAN_MARGIN + 1] = True
                seen = [t for t in trig if a.start <= t.step <= a.end + SPIKE_GRACE and "spike" in t.kind
                        and not t.kind.startswith("grad")]
                sc.add("spike", bool(seen), (seen[0].step - a.start) if seen else None)
                sc.spike_crit.append(any(a.start <= t.step <= a.end + SPIKE_CLEAN_MARGIN for t in crit))
                continue
            busy[i0:] = True
            after = [t for t in crit if t.step >= a.start]
            first = after[0] if after else None
            if a.kind == "nan":
                ok = any(t.step == a.start and t.kind.endswith("nonfinite") for t in crit)
                sc.add("nan", ok, 0 if ok else None)
            elif a.kind in ("sustained", "loss_scale_collapse"):
                ok = first is not None and first.step - a.start <= SUSTAINED_BOUND
                sc.add(a.kind, ok, first.step - a.start if first else None)
            elif a.kind == "divergence":
                assert a.double_step is not None
                ok = first is not None and first.step < a.double_step
                sc.add("divergence", ok, first.step - a.start if first else None)
                if first is not None and first.step <= s_end:
                    i = first.step - s0
                    sc.div_ratio.append(float(c.clean_loss[i] / c.clean_loss[a.start - s0]))
        sc.clean_steps += int((~busy).sum())
        sc.false_crit += sum(1 for t in crit if not busy[t.step - s0])
    return sc


def _pct(xs: Sequence[bool]) -> str:
    return f"{100.0 * sum(xs) / len(xs):.1f}%" if xs else "-"


def _delay(xs: Sequence[int]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.0f}/{np.percentile(xs, 95):.0f}/{max(xs)}"


def table(rows: list[tuple[str, Score]]) -> str:
    head = ("detector", "NaN on step", "sustained<=50", "delay med/p95/max", "divergence<2x", "delay med/p95/max",
            "loss-scale", "spike seen", "crit on spike", "false crit/10k")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name, sc in rows:
        fp = 1e4 * sc.false_crit / max(1, sc.clean_steps)
        lines.append(" | ".join((
            name, _pct(sc.caught.get("nan", [])), _pct(sc.caught.get("sustained", [])),
            _delay(sc.delays.get("sustained", [])), _pct(sc.caught.get("divergence", [])),
            _delay(sc.delays.get("divergence", [])), _pct(sc.caught.get("loss_scale_collapse", [])),
            _pct(sc.caught.get("spike", [])) if name == "sdcwatch" else "-", _pct(sc.spike_crit), f"{fp:.2f} ({sc.false_crit} in {sc.clean_steps})")))
    return "\n".join("| " + ln + " |" for ln in lines)


def replay_excerpts(data_dir: Path) -> str:
    from probes.spikes_replay import event_line, replay_log
    from probes.training_log import TrainingLogError, read_training_log

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
    ap.add_argument("--seeds", choices=("eval", "tuning"), default="eval")
    ap.add_argument("--n", type=int, default=0, help="use only the first N seeds of the set")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="real loss-curve excerpts (CSV)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="detector config override")
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    seeds = list(EVAL_SEEDS if args.seeds == "eval" else TUNING_SEEDS)
    if args.n:
        seeds = seeds[:args.n]
    config = LossDetectorConfig(**parse_sets(args.set))  # type: ignore[arg-type]
    data = curves(seeds)
    n_steps = sum(len(c) for c in data)
    print(f"# {len(data)} curves ({len(seeds)} {args.seeds} seeds x {len(CLASSES)} classes), {n_steps} steps; "
          f"{datetime.date.today().isoformat()}")
    w = args.workers
    rows = [("sdcwatch", score(SdcwatchDetector(config), data, w))]
    sc = rows[0][1]
    if sc.div_ratio:
        print(f"# sdcwatch divergence: loss at detection / loss at start: median {statistics.median(sc.div_ratio):.2f}, "
              f"max {max(sc.div_ratio):.2f}")
    for cls in ("sustained", "divergence", "loss_scale_collapse"):
        missed = sum(1 for ok in sc.caught.get(cls, []) if not ok)
        if missed:
            print(f"# sdcwatch missed {missed} {cls}")
    if not args.no_anchors:
        rows += [("llm-foundry 2x mean(100) >4 steps", score(foundry, data, w)),
                 ("OLMo 6 sigma(128)", score(olmo, data, w)),
                 ("Megatron 10x max(first 100)", score(megatron, data, w)),
                 ("metaseq loss/EWM(9) > 1.5", score(metaseq, data, w))]
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
