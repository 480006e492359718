"""`sdcwatch canary`: the canary suite as a preflight (Slurm prolog, Kubernetes init container).

Exit codes: 0 every check passed; 1 a check failed (evidence written when --evidence-dir is given);
2 the canary could not run (no such GPU, a check that could not run, a bad replay file): it says why.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from daemon.cli_common import table

EXIT_OK, EXIT_FAIL, EXIT_CANNOT_RUN = 0, 1, 2


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "canary", help="run the GPU canaries (preflight): exact GEMMs, cross-GPU vote, copies",
        description="Known-answer tensor-core GEMMs in every supported dtype, random-data GEMMs voted "
                    "across the node's GPUs, host/peer copies and an NCCL all-reduce, all checked bit for bit. "
                    "Exit 0 all pass, 1 any fail, 2 could not run.")
    p.add_argument("--gpus", default=None, help="comma-separated GPU indices (default: all visible)")
    p.add_argument("--level", choices=["quick", "full", "tiny"], default="quick",
                   help="quick (default, a few seconds per GPU), full, or tiny (toy sizes, for tests)")
    p.add_argument("--dtypes", default=None, help="comma-separated subset of fp32,tf32,fp16,bf16,fp8_e4m3,fp8_e5m2")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--evidence-dir", default=None, help="write evidence of each failure here (JSON files)")
    p.add_argument("--replay", default=None, metavar="FILE", help="rerun an evidence file on --gpus (first)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_canary)


def _parse_gpus(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"--gpus wants comma-separated indices, got {text!r}") from exc


def cmd_canary(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        gpus = _parse_gpus(args.gpus)
        dtypes = [d.strip() for d in args.dtypes.split(",")] if args.dtypes else None
        from probes import canary_suite

        cfg = canary_suite.SuiteConfig(level=args.level, dtypes=dtypes, seed=args.seed,
                                       evidence_dir=Path(args.evidence_dir) if args.evidence_dir else None)
    except ValueError as exc:
        print(f"sdcwatch canary: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    devices, note = canary_suite.discover_devices(gpus)
    if not devices:
        print(f"sdcwatch canary: cannot run: {note}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if args.replay:
        return _replay(args, devices[0], note)
    report = canary_suite.run_suite(devices, cfg)
    code = canary_suite.exit_code(report)
    if args.json:
        out = report.to_json()
        out["note"] = note
        out["exit_code"] = code
        print(json.dumps(out, indent=1, default=str))
    else:
        print(format_report(report, note))
    return code


def _replay(args: argparse.Namespace, dev: Any, note: str) -> int:
    from probes import canary_suite

    try:
        outcome = canary_suite.replay(args.replay, dev)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"sdcwatch canary: cannot replay {args.replay}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if args.json:
        print(json.dumps({"reproduces": outcome.reproduces, "same_output": outcome.same_output,
                          "result": outcome.result.to_json(), "note": note}, indent=1, default=str))
    else:
        if note:
            print(note)
        print(f"replay of {outcome.recorded.get('name')} (recorded on "
              f"{', '.join(d.get('label', '?') for d in outcome.recorded.get('devices', []))}): {outcome.summary()}")
    if outcome.result.status.value == "UNKNOWN":
        return EXIT_CANNOT_RUN
    return EXIT_FAIL if outcome.reproduces else EXIT_OK


def format_report(report: Any, note: str = "") -> str:
    lines = []
    if report.on_cpu:
        lines.append("ran on the CPU: " + (note or "no CUDA GPU visible"))
    lines.append(f"canary {report.level}: {report.status.value} in {report.duration_s:.1f}s on "
                 f"{len(report.devices)} device(s); torch {report.versions.get('torch')}, CUDA "
                 f"{report.versions.get('cuda') or '-'}, driver {report.versions.get('driver', '-')}")
    rows = [["STATUS", "CHECK", "DEVICES", "TIME", "TFLOP/s", "WHY"]]
    for r in report.results:
        rows.append([r.status.value, r.name, ",".join(r.devices), f"{r.duration_s * 1e3:.0f}ms",
                     f"{r.tflops:.1f}" if r.tflops else "-", (r.why or "-")[:120]])
    lines.append(table(rows))
    for label, why in report.skipped.items():
        by_reason: dict[str, list[str]] = {}
        for d, w in why.items():
            by_reason.setdefault(w, []).append(d)
        lines.append(f"{label}: not checked: " + "; ".join(f"{', '.join(ds)} ({w})" for w, ds in by_reason.items()))
    for d in report.devices:
        st, bad = report.device_status(d.label)
        extra = f": {bad[0].why}" if bad else ""
        lines.append(f"{d.label} ({d.name or d.device}): {st.value}{extra}")
    for r in report.results:
        if r.evidence_path:
            lines.append(f"evidence: {r.evidence_path}")
    return "\n".join(lines)
