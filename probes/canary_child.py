"""The canary child program: `python -m probes.canary_child`, one request on stdin, one reply on stdout.

Started only through probes.canary_process (the agent's rounds, the `sdcwatch canary` preflight), which
documents the requests and kills the child's process group when it is done, crashed or overran. This is
the side that imports torch: only where a suite or a replay runs (the snapshot reads NVML alone), so
without torch installed the reply says "needs torch: pip install 'sdcwatch[torch]'" instead of crashing.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from probes.canary_schedule import GpuSnapshot
from sdcwatch.canary import DeviceInfo, SuiteConfig
from sdcwatch.extras import needs
from sdcwatch.proc import PARENT_ENV, bind_to_parent

log = logging.getLogger(__name__)

TEST_HOOK_ENV = "SDCWATCH_CANARY_CHILD_TEST"   # tests only: "hang" or "abort" instead of answering


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


def scenario_snapshots(path: str) -> list[GpuSnapshot]:
    """The GPUs of a fake NVML scenario (probes.nvml_fake). Their utilization and free memory are unknown, so
    the agent's canary policy never picks them: the scheduler runs, and no canary runs on a GPU that the
    scenario only pretends to have."""
    from probes.nvml_backend import open_backend  # the fake backend only where a scenario is configured

    backend = open_backend(path)
    try:
        return [GpuSnapshot(backend.identity(i).uuid, i, None, None) for i in range(backend.device_count())]
    finally:
        backend.close()


def nvml_inventory(scenario: str | None) -> dict[str, Any]:
    """The GPUs NVML sees (a fake scenario's when given): {"uuids": [...], "error": why NVML is unavailable}."""
    from probes.nvml_backend import PynvmlBackend  # NVML only where the preflight asks for it
    from probes.nvml_fake import ScenarioBackend
    from probes.nvml_types import NvmlError

    try:
        backend = ScenarioBackend.from_file(scenario) if scenario else PynvmlBackend()
    except (NvmlError, ValueError, OSError) as exc:
        return {"uuids": [], "error": str(exc)}
    try:
        return {"uuids": [backend.identity(i).uuid for i in range(backend.device_count())], "error": None}
    except NvmlError as exc:
        return {"uuids": [], "error": str(exc)}
    finally:
        backend.close()


def _devices(gpus: Sequence[int] | None, labels: Sequence[str] | None,
             device: str = "auto") -> tuple[list[DeviceInfo], str]:
    """(the devices a request names, a note); no devices and an error message when none is usable."""
    # torch is an optional extra: imported here, where a suite or a replay runs, never for a snapshot
    from probes import canary_suite

    devices, note = canary_suite.discover_devices(gpus, device)
    if labels is not None:
        devices = [d for d in devices if d.uuid in labels or d.label in labels]
        if not devices:
            return [], "the GPUs chosen for a canary are not visible to torch"
    return devices, note


def run_round(req: Mapping[str, Any]) -> dict[str, Any]:
    """The reply to a `run` request. With "inventory" set (the preflight) the reply also carries what NVML
    and CUDA see, and a preflight whose CUDA GPUs are missing answers that instead of an error."""
    from probes import canary_suite  # torch: see _devices

    device = str(req.get("device") or "auto")
    inventory = None
    if req.get("inventory"):
        inventory = {"nvml": nvml_inventory(req.get("nvml_scenario")), "cuda_uuids": canary_suite.cuda_uuids(),
                     "cuda_error": canary_suite.cuda_unavailable_reason(),
                     "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    devices, note = _devices(req.get("gpus"), req.get("labels"), device)
    if not devices:
        if inventory is not None:
            return {"ok": {"report": None, "note": note, "inventory": inventory}}
        return {"error": note}
    if req.get("memory_cap_bytes"):
        _cap_memory(devices, int(req["memory_cap_bytes"]))
    cfg = SuiteConfig(level=req["level"], dtypes=req.get("dtypes"), seed=int(req.get("seed", 0)),
                      evidence_dir=Path(req["evidence_dir"]) if req.get("evidence_dir") else None, copies=True)
    return {"ok": {"report": canary_suite.run_suite(devices, cfg).to_json(), "note": note, "inventory": inventory}}


def replay(req: Mapping[str, Any]) -> dict[str, Any]:
    """The reply to a `replay` request."""
    from probes import canary_suite  # torch: see _devices

    devices, note = _devices(req.get("gpus"), None)
    if not devices:
        return {"error": note}
    try:
        outcome = canary_suite.replay(req["path"], devices[0])
    except (ValueError, KeyError, TypeError) as exc:
        return {"error": f"cannot replay {req['path']}: {exc}"}
    return {"ok": {"reproduces": outcome.reproduces, "same_output": outcome.same_output,
                   "result": outcome.result.to_json(), "recorded": outcome.recorded, "summary": outcome.summary(),
                   "note": note}}


def _cap_memory(devices: Sequence[DeviceInfo], cap_bytes: int) -> None:
    """Cap torch's allocator on each GPU to the canary's share, so a job starting meanwhile still fits."""
    import torch  # an optional extra, already loaded by the suite (see _devices)

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


def main() -> int:
    # The child has its own session (so that its whole group can be killed); this keeps it from outliving an
    # agent killed mid-round, even one killed while this child was still starting (the starter's pid comes in
    # $SDCWATCH_PARENT_PID: getppid() here would already be 1 then).
    bind_to_parent(signal.SIGKILL, parent_pid=None if os.environ.get(PARENT_ENV) else os.getppid())
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints from torch or the CUDA libraries go to stderr, not into the reply
    try:
        _test_hook(os.environ.get(TEST_HOOK_ENV, ""))
        req = json.loads(sys.stdin.buffer.read())
        op = req.get("op")
        if op == "snapshots":
            snaps = scenario_snapshots(req["nvml_scenario"]) if req.get("nvml_scenario") else nvml_snapshots()
            reply: dict[str, Any] = {"ok": [dataclasses.asdict(s) for s in snaps]}
        elif op == "run":
            reply = run_round(req)
        elif op == "replay":
            reply = replay(req)
        else:
            reply = {"error": f"unknown canary child op {op!r}"}
    except ModuleNotFoundError as exc:
        reply = {"error": needs("torch") if exc.name == "torch" else f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # no CUDA, a bug: an answer, not a crash
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    with os.fdopen(reply_fd, "w") as out:
        json.dump(reply, out, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
