"""`sdcwatch spikes replay FILE`: run the loss detector over a training log and print its events.

    sdcwatch spikes replay FILE [--format F | --pattern REGEX] [--step-col C --loss-col C --grad-norm-col C
                                 --loss-scale-col C --run-col C] [--allow-restarts] [--json] [--plot out.png]

FILE is a CSV, JSON-lines or text log (probes/training_log.py: `--format` presets for Megatron/NeMo,
Hugging Face Trainer, nanoGPT, torchtitan and `key: value` lines; `--pattern` for anything else); options
go before or after it.

One line per event (with --json, one JSON object per line: run, step, kind, signal, severity
('info' | 'warning' | 'critical'), value, baseline, magnitude, start_step, line, message; non-finite
numbers are written as null). Each run (the run column) gets its own detector; with
--allow-restarts, a step that goes back starts a new segment with a new detector. Exit status: 0 no
critical event, 1 at least one, 2 the log cannot be read, or --plot without matplotlib (the reason on
stderr).

`main(argv)` takes the arguments after `sdcwatch spikes replay`; `add_arguments` and `run` are what the
sdcwatch CLI registers.
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
from probes.training_log import FORMATS, LogRun, TrainingLog, TrainingLogError, read_training_log
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


PLOT_COLUMNS = 4          # small multiples: at most this many panels per row
PLOT_MAX_PANELS = 24      # more runs than this: the ones with the most severe events are drawn


def plot_events(tlog: TrainingLog, events: Sequence[ReplayEvent], out: Path) -> None:
    """The loss (log scale) of each run with its events: one panel for one run, a grid of small multiples
    (PLOT_COLUMNS wide, PLOT_MAX_PANELS at most: the runs with the most severe events) for many. Events
    are markers, coloured by severity and shaped by signal, with a legend; only critical ones are named."""
    import matplotlib  # an optional extra (plot): `main` checks for it before calling

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = [r for r in tlog.runs if r.samples]
    by_run: dict[str, list[ReplayEvent]] = {}
    for rev in events:
        by_run.setdefault(rev.run, []).append(rev)
    dropped = 0
    if len(runs) > PLOT_MAX_PANELS:
        def weight(run: LogRun) -> tuple[int, int]:
            evs = by_run.get(run.name, [])
            return (-sum(1 for e in evs if e.event.severity == Severity.CRITICAL), -len(evs))
        keep = {r.name for r in sorted(runs, key=weight)[:PLOT_MAX_PANELS]}
        dropped = len(runs) - len(keep)
        runs = [r for r in runs if r.name in keep]
    n = max(1, len(runs))
    cols = min(PLOT_COLUMNS, n)
    rows = -(-n // cols)
    width, height = (10.0, 4.0) if n == 1 else (4.2 * cols, 2.6 * rows + 0.6)
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    colors = {Severity.INFO: "tab:green", Severity.WARNING: "tab:orange", Severity.CRITICAL: "tab:red"}
    shapes = {"loss": "v", "grad_norm": "^", "loss_scale": "s"}
    small = n > 1
    for ax, run in zip(axes.flat, runs):
        steps = [s.step for s in run.samples]
        losses = [s.loss if s.loss is not None and math.isfinite(s.loss) and s.loss > 0 else float("nan")
                  for s in run.samples]
        ax.plot(steps, losses, ".-", lw=0.8, ms=2 if small else 3, color="tab:blue")
        ax.set_yscale("log")
        ax.set_title(run.name, fontsize=8 if small else 10)
        ax.tick_params(which="both", labelsize=6 if small else 8)
        finite = [v for v in losses if math.isfinite(v)]
        top = max(finite) if finite else 1.0
        for rev in by_run.get(run.name, []):
            ev = rev.event
            y = ev.value if ev.signal == "loss" and math.isfinite(ev.value) and ev.value > 0 else top
            ax.plot([ev.step], [y], shapes.get(ev.signal, "o"), color=colors[ev.severity], ms=5 if small else 7,
                    markeredgecolor="black", markeredgewidth=0.4)
            if ev.severity == Severity.CRITICAL:
                ax.annotate(ev.kind, (ev.step, y), fontsize=6 if small else 8, xytext=(3, 3),
                            textcoords="offset points", color=colors[ev.severity])
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    for ax in axes[-1, :]:
        ax.set_xlabel("step", fontsize=8)
    handles = [Line2D([], [], ls="", marker="o", color=c, label=sev.name.lower()) for sev, c in colors.items()]
    handles += [Line2D([], [], ls="", marker=m, color="grey", label=sig) for sig, m in shapes.items()]
    title = f"{Path(tlog.path).name}: {len(tlog.runs)} run(s), {len(events)} events"
    if dropped:
        title += f" ({dropped} runs without critical events not drawn)"
    fig.suptitle(title, fontsize=10)
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94 if n == 1 else 1 - 0.5 / height))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The replay's arguments (options in any order, before or after FILE), on `sdcwatch spikes replay`'s
    parser (daemon/cli.py) or `build_parser()`'s."""
    p.add_argument("file", type=Path, help="training log (CSV with a header, JSON lines, or a text log)")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="auto",
                   help="the log's format: auto (default: JSON lines, CSV, else the text preset that matches "
                        "most lines), csv, jsonl, or a text preset: megatron, nemo, hf, nanogpt, torchtitan, "
                        "kv (key: value / key=value fields)")
    p.add_argument("--pattern", metavar="REGEX",
                   help="a text log's lines: a regular expression with named groups step and loss (optionally "
                        "grad_norm, loss_scale, run), e.g. 'iter (?P<step>\\d+).*loss (?P<loss>[0-9.eE+-]+)'")
    p.add_argument("--step-col", help="step column (default: step, iteration, iter, global_step, ...)")
    p.add_argument("--loss-col", help="loss column (default: loss, lm_loss, train_loss, ...)")
    p.add_argument("--grad-norm-col", help="gradient-norm column (default: grad_norm, ... if present)")
    p.add_argument("--loss-scale-col", help="fp16 loss-scale column (default: loss_scale, ... if present)")
    p.add_argument("--run-col", help="column naming separate runs (default: run, run_id, ... if present)")
    p.add_argument("--allow-restarts", action="store_true",
                   help="a step lower than the previous one starts a new segment (runs resumed from a "
                        "checkpoint, excerpts) instead of being an error")
    p.add_argument("--json", action="store_true", help="one JSON object per event and line")
    p.add_argument("--plot", type=Path, metavar="OUT.png",
                   help="draw the curves with the events (one panel per run, a grid for many)")


DESCRIPTION = ("Replay a training log (CSV, JSON lines or text) through the loss detector. Exit 0: no critical "
               "event, 1: at least one, 2: unreadable.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdcwatch spikes replay", description=DESCRIPTION)
    add_arguments(p)
    return p


def run(args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Replay with parsed arguments (`add_arguments`'s); the exit status."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    if args.plot is not None and not available("matplotlib"):
        print(f"sdcwatch spikes replay: --plot {needs('matplotlib')}", file=err)
        return EXIT_UNREADABLE
    try:
        tlog = read_training_log(args.file, step_col=args.step_col, loss_col=args.loss_col,
                                 grad_norm_col=args.grad_norm_col, loss_scale_col=args.loss_scale_col,
                                 run_col=args.run_col, allow_restarts=args.allow_restarts, fmt=args.fmt,
                                 pattern=args.pattern)
    except TrainingLogError as exc:
        print(f"sdcwatch spikes replay: {exc}", file=err)
        return EXIT_UNREADABLE
    events = replay_log(tlog)
    for rev in events:
        print(json.dumps(event_json(rev)) if args.json else event_line(rev), file=out)
    n_crit = sum(1 for r in events if r.event.severity == Severity.CRITICAL)
    if not args.json:
        print(f"# {tlog.n_samples} samples in {len(tlog.runs)} run(s) ({tlog.format}), {len(events)} events, "
              f"{n_crit} critical", file=out)
    if args.plot is not None:
        try:
            plot_events(tlog, events, args.plot)
        except OSError as exc:
            print(f"sdcwatch spikes replay: cannot write {args.plot}: {exc}", file=err)
    return EXIT_CRITICAL if n_crit else EXIT_OK


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    try:
        args = build_parser().parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:   # argparse reports usage errors itself
        return int(exc.code) if isinstance(exc.code, int) else EXIT_UNREADABLE
    return run(args, stdout=stdout, stderr=stderr)


if __name__ == "__main__":
    raise SystemExit(main())
