"""The agent's canary rounds in a short-lived child process: `python -m probes.canary_child`.

Run in the agent, torch initialised CUDA contexts there (RSS 525 MB -> 1.66 GB on an H200 host), seconds of
GEMMs driven from Python on a thread raised the agent's gRPC p99 from 1.7 ms to 7-10 ms (the GIL), the NVML
snapshot called `nvmlInit` in the agent (which keeps NVML in children since NVML heap corruption killed it,
probes.nvml_isolated), and a sticky CUDA error on a faulty GPU (XID 13/31/43) would poison the agent's CUDA
context for good. Now each round is a new child that reads one JSON request from stdin, writes one JSON
reply to stdout and exits; nothing is unpickled. Requests:

- ``{"op": "snapshots"}`` -> the `GpuSnapshot` fields of every GPU (``[]`` without NVML);
- ``{"op": "run", "labels": [...], "level": ..., "evidence_dir": ..., "memory_cap_bytes": ...}`` -> the
  `SuiteReport.to_json()` of the suite run on the discovered devices whose UUID or label is in `labels`.

Replies: ``{"ok": result}`` or ``{"error": "why"}``. The parent side (`child_snapshots`, `child_run_suite`)
runs the child in its own process group and kills the group when it is done, crashed or overran its
timeout; every failure raises `CanaryChildError` (a crash is not proof of bad math: the probe reports it as
`canary.unknown`). This module imports torch only where a suite runs or its report is rebuilt.
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
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from probes.canary_schedule import GpuSnapshot
from sdcwatch.canary import CheckResult, DeviceInfo, Status

if TYPE_CHECKING:
    from probes.canary_suite import SuiteReport

log = logging.getLogger(__name__)

TEST_HOOK_ENV = "SDCWATCH_CANARY_CHILD_TEST"   # tests only: "hang" or "abort" instead of answering


class CanaryChildError(RuntimeError):
    """The child answered with an error, crashed, or did not finish in time."""


# -- the parent side ------------------------------------------------------------------------------------------
def child_snapshots(timeout_s: float) -> list[GpuSnapshot]:
    """`nvml_snapshots()` in a child: NVML is never initialised in the agent."""
    return [GpuSnapshot(**s) for s in call_child({"op": "snapshots"}, timeout_s)]


def child_run_suite(labels: Sequence[str], *, level: str, evidence_dir: Path | None, memory_cap_bytes: int,
                    timeout_s: float) -> "SuiteReport":
    """The suite on the GPUs named by `labels` (UUIDs), run in a child; the parent never touches CUDA."""
    return suite_from_json(call_child({"op": "run", "labels": list(labels), "level": level,
                                       "evidence_dir": None if evidence_dir is None else str(evidence_dir),
                                       "memory_cap_bytes": int(memory_cap_bytes)}, timeout_s))


def call_child(request: Mapping[str, Any], timeout_s: float) -> Any:
    """One round trip to a new child; its `ok` result, else `CanaryChildError` saying why."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "probes.canary_child"], stdin=subprocess.PIPE,
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


def suite_from_json(d: Mapping[str, Any]) -> "SuiteReport":
    """The inverse of `SuiteReport.to_json()` (its derived `status` is recomputed, not read)."""
    from probes.canary_suite import SuiteReport  # torch: the agent reads replies without loading it

    results = [CheckResult(**{**r, "status": Status(r["status"]), "devices": tuple(r["devices"])})
               for r in d["results"]]
    return SuiteReport(str(d["level"]), [DeviceInfo(**x) for x in d["devices"]], results, dict(d["skipped"]),
                       bool(d["on_cpu"]), float(d["duration_s"]), dict(d["versions"]))


# -- the child ------------------------------------------------------------------------------------------------
def nvml_snapshots() -> list[GpuSnapshot]:
    """Utilization and free memory of every GPU from NVML (empty when NVML is unavailable)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            try:
                util: float | None = float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except pynvml.NVMLError:
                util = None
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                free, total = int(mem.free), int(mem.total)
            except pynvml.NVMLError:
                free = total = None  # type: ignore[assignment]
            try:
                procs: int | None = len(pynvml.nvmlDeviceGetComputeRunningProcesses(h))
            except pynvml.NVMLError:
                procs = None
            out.append(GpuSnapshot(uuid, i, util, free, total, procs))
        return out
    except Exception as exc:
        log.debug("NVML snapshot unavailable: %s", exc)
        return []


def run_round(labels: Sequence[str], level: str, evidence_dir: str | None,
              memory_cap_bytes: int) -> dict[str, Any]:
    """The reply to a `run` request."""
    from probes import canary_suite

    devices = [d for d in canary_suite.discover_devices()[0] if d.uuid in labels or d.label in labels]
    if not devices:
        return {"error": "the GPUs chosen for a canary are not visible to torch"}
    _cap_memory(devices, memory_cap_bytes)
    cfg = canary_suite.SuiteConfig(level=level, evidence_dir=Path(evidence_dir) if evidence_dir else None,
                                   copies=True)
    return {"ok": canary_suite.run_suite(devices, cfg).to_json()}


def _cap_memory(devices: Sequence[DeviceInfo], cap_bytes: int) -> None:
    """Cap torch's allocator on each GPU to the canary's share, so a job starting meanwhile still fits."""
    import torch

    for d in devices:
        if torch.device(d.device).type != "cuda":
            continue
        try:
            total = torch.cuda.get_device_properties(torch.device(d.device)).total_memory
            frac = min(1.0, (cap_bytes + (512 << 20)) / total)
            torch.cuda.set_per_process_memory_fraction(frac, torch.device(d.device))
        except Exception as exc:
            log.warning("cannot cap canary memory on %s: %s", d.label, exc)


def _test_hook(hook: str) -> None:
    """Tests only: a child that hangs or crashes, as a wedged driver or a corrupted heap would make it."""
    if hook == "hang":  # with a grandchild, which the parent's kill of the process group must reach too
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(600)
    elif hook == "abort":
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core dump: a piped core_pattern can take seconds
        os.abort()


def _die_with_parent() -> None:
    """The child has its own session (so that its whole group can be killed); this keeps it from outliving an
    agent that is killed mid-round (Linux: PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the agent died before the signal was armed
        os._exit(1)


def main() -> int:
    _die_with_parent()
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints from torch or the CUDA libraries go to stderr, not into the reply
    try:
        _test_hook(os.environ.get(TEST_HOOK_ENV, ""))
        req = json.loads(sys.stdin.buffer.read())
        if req.get("op") == "snapshots":
            reply: dict[str, Any] = {"ok": [dataclasses.asdict(s) for s in nvml_snapshots()]}
        elif req.get("op") == "run":
            reply = run_round(req["labels"], req["level"], req.get("evidence_dir"),
                              int(req["memory_cap_bytes"]))
        else:
            reply = {"error": f"unknown canary child op {req.get('op')!r}"}
    except Exception as exc:  # no torch, no CUDA, a bug: an answer, not a crash
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    with os.fdopen(reply_fd, "w") as out:
        json.dump(reply, out, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
