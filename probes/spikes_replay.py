"""`sdcwatch spikes replay FILE`: run the loss detector over a training log and print its events.

    sdcwatch spikes replay FILE [--step-col C --loss-col C --grad-norm-col C --loss-scale-col C
                                 --run-col C] [--allow-restarts] [--json] [--plot out.png]

One line per event (with --json, one JSON object per line: run, step, kind, signal, severity
('info' | 'warning' | 'critical'), value, baseline, magnitude, start_step, line, message; non-finite
numbers are written as null). Each run (the run column) gets its own detector; with
--allow-restarts, a step that goes back starts a new segment with a new detector. Exit status: 0 no
critical event, 1 at least one, 2 the log cannot be read, or --plot without matplotlib (the reason on
stderr).

`main(argv)` takes the arguments after `sdcwatch spikes replay`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path
from typing import Sequence, TextIO

from probes.loss_detector import LossDetector, LossDetectorConfig, LossEvent
from probes.training_log import LogRun, TrainingLog, TrainingLogError, read_training_log
from sdcwatch.extras import available, needs
from sdcwatch.types import Severity

log = logging.getLogger(__name__)

EXIT_OK, EXIT_CRITICAL, EXIT_UNREADABLE = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayEvent:
    run: str
    line: int          # file line of the sample that triggered it (0 for end-of-data events)
    event: LossEvent


def replay_run(run: LogRun, config: LossDetectorConfig | None = None) -> list[ReplayEvent]:
    """Feed one run's samples to a fresh detector; `now` is the sample index (logs carry no clock)."""
    det = LossDetector(config)
    out: list[ReplayEvent] = []
    for i, s in enumerate(run.samples):
        for ev in det.update(s.step, s.loss, s.grad_norm, float(i), loss_scale=s.loss_scale):
            out.append(ReplayEvent(run.name, s.line, ev))
    for ev in det.flush(float(len(run.samples))):
        out.append(ReplayEvent(run.name, run.samples[-1].line if run.samples else 0, ev))
    return out


def replay_log(tlog: TrainingLog, config: LossDetectorConfig | None = None) -> list[ReplayEvent]:
    events: list[ReplayEvent] = []
    for run in tlog.runs:
        events += replay_run(run, config)
    return events


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def event_json(rev: ReplayEvent) -> dict[str, object]:
    ev = rev.event
    return {"run": rev.run, "step": ev.step, "kind": ev.kind, "signal": ev.signal,
            "severity": ev.severity.name.lower(), "value": _num(ev.value), "baseline": _num(ev.baseline),
            "magnitude": _num(ev.magnitude), "start_step": ev.start_step, "line": rev.line, "message": ev.message}


def event_line(rev: ReplayEvent) -> str:
    ev = rev.event
    mag = f"{ev.magnitude:.2f}x" if math.isfinite(ev.magnitude) else "-"
    return (f"{rev.run}  step {ev.step}  {ev.severity.name.lower():8s} {ev.kind:19s} {ev.signal:10s} "
            f"value {ev.value:.6g}  baseline {ev.baseline:.6g}  {mag}  start {ev.start_step}  "
            f"(line {rev.line}): {ev.message}")


def plot_events(tlog: TrainingLog, events: Sequence[ReplayEvent], out: Path) -> None:
    """One panel per run: the loss (log scale) with the events marked by severity."""
    import matplotlib  # an optional extra (plot): `main` checks for it before calling

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in tlog.runs if r.samples]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), squeeze=False)
    colors = {Severity.INFO: "tab:green", Severity.WARNING: "tab:orange", Severity.CRITICAL: "tab:red"}
    for ax, run in zip(axes[:, 0], runs):
        steps = [s.step for s in run.samples]
        losses = [s.loss if s.loss is not None and math.isfinite(s.loss) and s.loss > 0 else float("nan")
                  for s in run.samples]
        ax.plot(steps, losses, ".-", lw=0.8, ms=3, color="tab:blue", label="loss")
        ax.set_yscale("log")
        ax.set_title(run.name, fontsize=9)
        finite = [v for v in losses if math.isfinite(v)]
        top = max(finite) if finite else 1.0
        for rev in events:
            if rev.run != run.name:
                continue
            ev = rev.event
            y = ev.value if ev.signal == "loss" and math.isfinite(ev.value) and ev.value > 0 else top
            ax.axvline(ev.step, color=colors[ev.severity], lw=0.6, alpha=0.6)
            ax.plot([ev.step], [y], "v", color=colors[ev.severity], ms=6)
            ax.annotate(f"{ev.signal} {ev.kind}", (ev.step, y), fontsize=6, rotation=30,
                        xytext=(2, 4), textcoords="offset points")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


DESCRIPTION = "Replay a CSV or JSON-lines training log through the loss detector."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdcwatch spikes replay", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The replay's arguments, on `sdcwatch spikes replay`'s parser (daemon/cli.py) or `build_parser()`'s."""
    p.add_argument("file", type=Path, help="training log (CSV with a header, or JSON lines)")
    p.add_argument("--step-col", help="step column (default: step, iteration, iter, global_step, ...)")
    p.add_argument("--loss-col", help="loss column (default: loss, lm_loss, train_loss, ...)")
    p.add_argument("--grad-norm-col", help="gradient-norm column (default: grad_norm, ... if present)")
    p.add_argument("--loss-scale-col", help="fp16 loss-scale column (default: loss_scale, ... if present)")
    p.add_argument("--run-col", help="column naming separate runs (default: run, run_id, ... if present)")
    p.add_argument("--allow-restarts", action="store_true",
                   help="a step lower than the previous one starts a new segment (runs resumed from a "
                        "checkpoint, excerpts) instead of being an error")
    p.add_argument("--json", action="store_true", help="one JSON object per event and line")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="draw the curves with the events")


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:   # argparse reports usage errors itself
        return int(exc.code) if isinstance(exc.code, int) else EXIT_UNREADABLE
    return run(args, stdout=stdout, stderr=stderr)


def run(args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """The replay for parsed arguments (`add_arguments`'s)."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    if args.plot is not None and not available("matplotlib"):
        print(f"sdcwatch spikes replay: --plot {needs('matplotlib')}", file=err)
        return EXIT_UNREADABLE
    try:
        tlog = read_training_log(args.file, step_col=args.step_col, loss_col=args.loss_col,
                                 grad_norm_col=args.grad_norm_col, loss_scale_col=args.loss_scale_col,
                                 run_col=args.run_col, allow_restarts=args.allow_restarts)
    except TrainingLogError as exc:
        print(f"sdcwatch spikes replay: {exc}", file=err)
        return EXIT_UNREADABLE
    events = replay_log(tlog)
    for rev in events:
        print(json.dumps(event_json(rev)) if args.json else event_line(rev), file=out)
    n_crit = sum(1 for r in events if r.event.severity == Severity.CRITICAL)
    if not args.json:
        print(f"# {tlog.n_samples} samples in {len(tlog.runs)} run(s), {len(events)} events, {n_crit} critical",
              file=out)
    if args.plot is not None:
        try:
            plot_events(tlog, events, args.plot)
        except OSError as exc:
            print(f"sdcwatch spikes replay: cannot write {args.plot}: {exc}", file=err)
    return EXIT_CRITICAL if n_crit else EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
