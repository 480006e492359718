"""The canary from outside: each request runs in a new short-lived child, `python -m probes.canary_child`.

The agent's canary rounds (probes.canary_agent) and the `sdcwatch canary` preflight both come through here,
so neither imports torch: the suite, torch's CUDA contexts, the GIL-bound GEMM loop and a faulty GPU's
sticky CUDA error (XID 13/31/43) stay in the child. In the agent, torch raised the RSS from 525 MB to
1.66 GB on an H200 host once CUDA was initialised and seconds of GEMMs on a thread raised the gRPC p99
from 1.7 ms to 7-10 ms; NVML stays out of the agent too (NVML heap corruption killed it once,
probes.nvml_isolated).

Protocol: the child reads one JSON request from stdin, writes one JSON reply to stdout and exits; nothing
is unpickled. Requests (see probes.canary_child for the child's side):

- ``{"op": "snapshots", "nvml_scenario": path | None}`` -> the `GpuSnapshot` fields of every GPU (``[]``
  without NVML; a fake scenario's GPUs have unknown utilization, so the canary never picks them);
- ``{"op": "run", "labels": [...] | None, "gpus": [...] | None, "level", "dtypes", "seed", "evidence_dir",
  "memory_cap_bytes"}`` -> ``{"report": SuiteReport.to_json(), "note": ...}``: the suite on the devices whose
  UUID or label is in `labels` (the agent), or with those torch indices in `gpus` (the CLI; None: all);
  With ``"device": "cuda" | "cpu"`` (the preflight; default "auto": the CPU when CUDA is absent) and
  ``"inventory": true, "nvml_scenario"``, the reply adds ``"inventory"`` (the GPUs NVML sees, the UUIDs CUDA
  can use, why CUDA is unavailable) and has ``"report": null`` when no CUDA GPU could be used;
- ``{"op": "replay", "path": ..., "gpus": [...] | None}`` -> the replay of one evidence file.

Replies: ``{"ok": result}`` or ``{"error": "why"}``. The child runs in its own process group, which is
killed when it is done, crashed or overran its timeout; every failure raises `CanaryChildError` (a crash is
not proof of bad math: the agent reports it as `canary.unknown`, the CLI exits 2).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from probes.canary_schedule import GpuSnapshot
from sdcwatch.canary import CheckResult, SuiteConfig, SuiteReport
from sdcwatch.errors import SdcwatchError
from sdcwatch.proc import parent_env

log = logging.getLogger(__name__)

CHILD_MODULE = "probes.canary_child"


class CanaryChildError(SdcwatchError, RuntimeError):
    """The child answered with an error, crashed, or did not finish in time (the round is UNKNOWN; the next
    one may succeed)."""

    transient = True


@dataclasses.dataclass(slots=True)
class ReplayReply:
    """A replayed evidence file (probes.canary_suite.ReplayOutcome, as the child reports it)."""

    reproduces: bool              # the replay fails too
    same_output: bool | None      # the replay's output has the recorded wrong fingerprint (None: n/a)
    result: CheckResult
    recorded: dict[str, Any]
    summary: str
    note: str


def child_snapshots(timeout_s: float, nvml_scenario: str | None = None) -> list[GpuSnapshot]:
    """Utilization and free memory of every GPU, read in a child: NVML is never initialised in the agent."""
    return [GpuSnapshot(**s) for s in call_child({"op": "snapshots", "nvml_scenario": nvml_scenario}, timeout_s)]


def child_run_suite(config: SuiteConfig, *, timeout_s: float, labels: Sequence[str] | None = None,
                    gpus: Sequence[int] | None = None, memory_cap_bytes: int = 0) -> tuple[SuiteReport, str]:
    """(the suite's report, a note such as "ran on the CPU") from a child, on the GPUs named by `labels`
    (UUIDs) or with the torch indices `gpus` (None: every visible one). Only `config`'s level, dtypes, seed
    and evidence_dir cross the pipe. The parent never touches CUDA."""
    reply = call_child({"op": "run", "labels": None if labels is None else list(labels),
                        "gpus": None if gpus is None else [int(g) for g in gpus], "level": config.level,
                        "dtypes": None if config.dtypes is None else list(config.dtypes), "seed": config.seed,
                        "evidence_dir": None if config.evidence_dir is None else str(config.evidence_dir),
                        "memory_cap_bytes": int(memory_cap_bytes)}, timeout_s)
    return SuiteReport.from_json(reply["report"]), str(reply["note"])


@dataclasses.dataclass(slots=True)
class PreflightReply:
    """The preflight's round: the report (None when no GPU could be used), a note, and what NVML and CUDA
    see (`inventory`: {"nvml": {"uuids", "error"}, "cuda_uuids", "cuda_error", "cuda_visible_devices"})."""

    report: SuiteReport | None
    note: str
    inventory: dict[str, Any]


def child_preflight(config: SuiteConfig, *, timeout_s: float, device: str, gpus: Sequence[int] | None = None,
                    nvml_scenario: str | None = None) -> PreflightReply:
    """The `sdcwatch canary` preflight's round in a child: the suite on `device` ("cuda" or "cpu"), plus the
    inventory that tells a node whose GPUs NVML sees but CUDA cannot use from a node without GPUs."""
    reply = call_child({"op": "run", "labels": None, "gpus": None if gpus is None else [int(g) for g in gpus],
                        "level": config.level, "dtypes": None if config.dtypes is None else list(config.dtypes),
                        "seed": config.seed, "device": device, "inventory": True, "nvml_scenario": nvml_scenario,
                        "evidence_dir": None if config.evidence_dir is None else str(config.evidence_dir),
                        "memory_cap_bytes": 0}, timeout_s)
    report = None if reply.get("report") is None else SuiteReport.from_json(reply["report"])
    return PreflightReply(report, str(reply["note"]), dict(reply.get("inventory") or {}))


def child_replay(path: str | Path, *, timeout_s: float, gpus: Sequence[int] | None = None) -> ReplayReply:
    """Rerun an evidence file's check in a child, on the first of `gpus` (default: the first device)."""
    r = call_child({"op": "replay", "path": str(path), "gpus": None if gpus is None else [int(g) for g in gpus]},
                   timeout_s)
    return ReplayReply(bool(r["reproduces"]), r["same_output"], CheckResult.from_json(r["result"]),
                       dict(r["recorded"]), str(r["summary"]), str(r["note"]))


def call_child(request: Mapping[str, Any], timeout_s: float) -> Any:
    """One round trip to a new child; its `ok` result, else `CanaryChildError` saying why."""
    env = parent_env()          # the child's bind_to_parent compares its parent with this pid
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=None, env=env, close_fds=True, start_new_session=True)
    try:
        out, exited = _exchange(proc, json.dumps(request).encode(), t0 + timeout_s)
    finally:
        try:  # the whole group: whatever the child started (a CUDA helper, a compiler) goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
    reply = _parse(out)
    if reply is None:
        how = _exit_reason(proc.returncode) if exited else f"did not finish within {timeout_s:.0f}s and was killed"
        why = f"the canary child process ({request['op']}) {how} after {time.monotonic() - t0:.1f}s"
        log.warning("%s", why)
        raise CanaryChildError(why)
    if "error" in reply:
        raise CanaryChildError(str(reply["error"]))
    return reply["ok"]


def _exchange(proc: subprocess.Popen[bytes], request: bytes, deadline: float) -> tuple[bytes, bool]:
    """(what the child wrote, whether it exited before the deadline). The child is not reaped here: while it
    is a zombie its pid cannot be reused, so killing its process group afterwards cannot hit a stranger."""
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(request)
        proc.stdin.close()
    except BrokenPipeError:  # it died before reading: its exit says why
        pass
    fd, out = proc.stdout.fileno(), b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return out, False
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        out += chunk
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:  # EOF: it is exiting
        if time.monotonic() >= deadline:
            return out, False
        time.sleep(0.01)
    return out, True


def _parse(out: bytes) -> dict[str, Any] | None:
    try:
        reply = json.loads(out)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) and ("ok" in reply or "error" in reply) else None


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} without a reply"
