"""`sdcwatch canary`: the canary suite as a preflight (Slurm prolog, Kubernetes init container).

The suite runs in the same short-lived child process as the agent's canary rounds (probes.canary_process):
this command never imports torch, and a broken CUDA stack or a crashed kernel cannot take it down with a
traceback. Without torch installed the child says "needs torch: pip install 'sdcwatch[torch]'".

Exit codes: 0 every check passed; 1 a check failed (evidence written when --evidence-dir is given), or
the node has GPUs that NVML sees but CUDA cannot use (fallen off the bus, a broken driver, a CUDA/driver
mismatch): a failure of the node, with the reason; 2 the canary could not run (no GPU at all, no such
GPU, no torch, a check that could not run, a bad replay file, the child crashed or overran --timeout-s):
it says why. `--json` prints a record on every exit, with `exit_code` and `reason`. The CPU run (fp32
checks only) happens only with an explicit `--device cpu`: a node without a usable GPU never passes.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from daemon.cli_common import table
from probes.canary_process import CanaryChildError, PreflightReply, child_preflight, child_replay
from sdcwatch.canary import ALL_DTYPES, LEVELS, Status, SuiteConfig, SuiteReport, exit_code

EXIT_OK, EXIT_FAIL, EXIT_CANNOT_RUN = 0, 1, 2


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "canary", help="run the GPU canaries (preflight): exact GEMMs, cross-GPU vote, copies",
        description="Known-answer tensor-core GEMMs in every supported dtype, random-data GEMMs voted "
                    "across the node's GPUs, host/peer copies and an NCCL all-reduce, all checked bit for bit. "
                    "Exit 0 all pass, 1 any fail, 2 could not run.")
    p.add_argument("--gpus", default=None, help="comma-separated GPU indices (default: all visible)")
    p.add_argument("--level", choices=LEVELS, default="quick",
                   help="quick (default, a few seconds per GPU), full, or tiny (toy sizes, for tests)")
    p.add_argument("--dtypes", default=None, help=f"comma-separated subset of {','.join(ALL_DTYPES)}")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--evidence-dir", default=None, help="write evidence of each failure here (JSON files)")
    p.add_argument("--replay", default=None, metavar="FILE", help="rerun an evidence file on --gpus (first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the node's GPUs, exit 1 if NVML sees GPUs CUDA cannot use, 2 if there "
                        "are none; cpu: fp32 checks on the CPU (a test of the install, not of a GPU)")
    p.add_argument("--nvml-scenario", default=None, metavar="FILE",
                   help="read the GPUs NVML sees from a fake NVML scenario (tests, demos)")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="give up (exit 2) when the suite has not finished after this many seconds (default 1800)")
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
        cfg = SuiteConfig(level=args.level, dtypes=dtypes, seed=args.seed,
                          evidence_dir=Path(args.evidence_dir).resolve() if args.evidence_dir else None)
        if not args.timeout_s > 0:
            raise ValueError(f"--timeout-s must be > 0, got {args.timeout_s}")
    except ValueError as exc:
        return _cannot_run(args, str(exc))
    if args.replay:
        return _replay(args, gpus)
    try:
        reply = child_preflight(cfg, gpus=gpus, device=args.device, nvml_scenario=args.nvml_scenario,
                                timeout_s=args.timeout_s)
    except CanaryChildError as exc:
        return _cannot_run(args, f"cannot run: {exc}")
    verdict = preflight_verdict(reply.inventory) if args.device == "cuda" else None
    if reply.report is None:
        code, reason = verdict if verdict is not None else (EXIT_CANNOT_RUN, reply.note)
        if code == EXIT_CANNOT_RUN:
            return _cannot_run(args, f"cannot run: {reason}", reply.inventory)
        return _print(args, None, reply, code, reason)
    code, reason = exit_code(reply.report), ""
    if verdict is not None and verdict[0] == EXIT_FAIL:  # some GPUs checked, others unusable: the node fails
        code, reason = EXIT_FAIL, verdict[1]
    return _print(args, reply.report, reply, code, reason)


def preflight_verdict(inventory: dict[str, Any]) -> tuple[int, str] | None:
    """(exit code, reason) when what NVML sees and what CUDA can use decide the preflight, else None.

    NVML sees GPUs and CUDA can use none, or fewer (by UUID when CUDA_VISIBLE_DEVICES is unset): exit 1,
    the node is broken. Neither sees a GPU: exit 2, there is nothing to check."""
    nvml = inventory.get("nvml") or {}
    seen = [str(u) for u in nvml.get("uuids") or []]
    usable = [str(u) for u in inventory.get("cuda_uuids") or []]
    cuda_why = inventory.get("cuda_error") or "CUDA sees no GPU"
    if not usable:
        if seen:
            return EXIT_FAIL, (f"NVML sees {len(seen)} GPU(s) ({', '.join(seen)}) but CUDA can use none: "
                               f"{cuda_why}")
        return EXIT_CANNOT_RUN, f"no GPU: NVML: {nvml.get('error') or 'sees no GPU'}; CUDA: {cuda_why}"
    if inventory.get("cuda_visible_devices") is None:
        missing = [u for u in seen if u not in usable]
        if missing and all(u in seen for u in usable):
            return EXIT_FAIL, f"NVML sees {len(missing)} GPU(s) that CUDA cannot use: {', '.join(missing)}"
    return None


def _cannot_run(args: argparse.Namespace, why: str, inventory: dict[str, Any] | None = None) -> int:
    print(f"sdcwatch canary: {why}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"status": Status.UNKNOWN.value, "exit_code": EXIT_CANNOT_RUN, "reason": why,
                          "inventory": inventory or {}}, indent=1, default=str))
    return EXIT_CANNOT_RUN


def _print(args: argparse.Namespace, report: SuiteReport | None, reply: PreflightReply, code: int,
           reason: str) -> int:
    if args.json:
        out: dict[str, Any] = report.to_json() if report is not None else {"status": Status.FAIL.value}
        if reason:
            out["status"] = Status.FAIL.value
        out.update(note=reply.note, exit_code=code, reason=reason, inventory=reply.inventory)
        print(json.dumps(out, indent=1, default=str))
    else:
        if report is not None:
            print(format_report(report, reply.note))
        if reason:
            print(f"FAIL: {reason}")  # the last line: the Slurm prolog puts it in the drain reason
    return code


def _replay(args: argparse.Namespace, gpus: list[int] | None) -> int:
    try:
        outcome = child_replay(Path(args.replay).resolve(), gpus=gpus, timeout_s=args.timeout_s)
    except CanaryChildError as exc:
        return _cannot_run(args, str(exc))
    if args.json:
        print(json.dumps({"reproduces": outcome.reproduces, "same_output": outcome.same_output,
                          "result": outcome.result.to_json(), "note": outcome.note}, indent=1, default=str))
    else:
        if outcome.note:
            print(outcome.note)
        print(f"replay of {outcome.recorded.get('name')} (recorded on "
              f"{', '.join(d.get('label', '?') for d in outcome.recorded.get('devices', []))}): {outcome.summary}")
    if outcome.result.status is Status.UNKNOWN:
        return EXIT_CANNOT_RUN
    return EXIT_FAIL if outcome.reproduces else EXIT_OK


def format_report(report: SuiteReport, note: str = "") -> str:
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
