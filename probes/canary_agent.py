"""The agent's canary probe: a blocking `run_once(now)` for `daemon.probe_runner.ProbeRunner`.

Each round: read a snapshot of every GPU (NVML utilization, free memory), ask `AgentCanaryPolicy` which
are idle and due, run the suite on those one GPU at a time (the runner's single worker thread, plus a
lock here, mean never two canaries at once on a GPU; a hung canary makes the runner HUNG and it is not
re-entered), cap this process's GPU memory (`torch.cuda.set_per_process_memory_fraction`), save evidence
of failures in the state dir, and return a `CanaryReport` whose `evidence` the agent attaches to each GPU
(`GpuRegistry.add_evidence(uuid, evs, now)`) and whose `findings` it journals.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Callable, Sequence

from probes import canary_suite
from probes.canary_gemm import DeviceInfo, Status
from probes.canary_schedule import AgentCanaryPolicy, Decision, GpuSnapshot
from probes.types import Evidence, Finding, Severity

log = logging.getLogger(__name__)

NEED_BYTES = {"tiny": 64 << 20, "quick": 1536 << 20, "full": 4 << 30}


@dataclasses.dataclass(slots=True)
class CanaryReport:
    decisions: list[Decision]
    suite: canary_suite.SuiteReport | None
    evidence: dict[str, list[Evidence]]           # GPU UUID -> evidence to attach
    findings: list[Finding]


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


class AgentCanaryProbe:
    def __init__(self, *, policy: AgentCanaryPolicy | None = None, level: str = "quick",
                 evidence_dir: Path | None = None, snapshots: Callable[[], list[GpuSnapshot]] = nvml_snapshots,
                 devices: Callable[[], list[DeviceInfo]] | None = None,
                 run_suite: Callable[..., canary_suite.SuiteReport] = canary_suite.run_suite) -> None:
        self.policy = policy or AgentCanaryPolicy()
        self.level = level
        self.evidence_dir = evidence_dir
        self.snapshots = snapshots
        self._devices = devices or (lambda: canary_suite.discover_devices()[0])
        self._run_suite = run_suite
        self.last_run: dict[str, float] = {}
        self.consecutive_failures: dict[str, int] = {}
        self._running: set[str] = set()
        self._lock = threading.Lock()
        self._capped: set[str] = set()

    def run_once(self, now: float) -> CanaryReport:
        snaps = self.snapshots()
        decisions = self.policy.choose(snaps, now=now, need_bytes=NEED_BYTES.get(self.level, 2 << 30),
                                       last_run=self.last_run, running=self._running)
        chosen = {d.uuid for d in decisions if d.run}
        if not chosen:
            return CanaryReport(decisions, None, {}, [])
        devices = [d for d in self._devices() if d.uuid in chosen or d.label in chosen]
        if not devices:
            return CanaryReport(decisions, None, {}, [Finding(
                "canary.unknown", Severity.WARNING, "node", "the GPUs chosen for a canary are not visible to torch",
                {"chosen": sorted(chosen)})])
        if not self._lock.acquire(blocking=False):
            return CanaryReport(decisions, None, {}, [])
        try:
            self._running.update(d.label for d in devices)
            self._cap_memory(devices)
            cfg = canary_suite.SuiteConfig(level=self.level, evidence_dir=self.evidence_dir, copies=True)
            suite = self._run_suite(devices, cfg)
        finally:
            self._running.difference_update(d.label for d in devices)
            self._lock.release()
        for d in devices:
            self.last_run[d.label] = now
        evidence = canary_suite.evidence_by_device(suite, now, self.consecutive_failures)
        findings: list[Finding] = []
        for d in devices:
            st, bad = suite.device_status(d.label)
            if st is Status.FAIL:
                self.consecutive_failures[d.label] = self.consecutive_failures.get(d.label, 0) + 1
                findings.append(Finding("canary.fail", Severity.CRITICAL, f"gpu/{d.label}",
                                        f"canary failed on {d.label}: {bad[0].name}: {bad[0].why}",
                                        {"checks": [r.name for r in bad],
                                         "evidence": [r.evidence_path for r in bad if r.evidence_path]}))
            else:
                self.consecutive_failures.pop(d.label, None)
                if st is Status.UNKNOWN:
                    findings.append(Finding("canary.unknown", Severity.WARNING, f"gpu/{d.label}",
                                            f"canary could not run fully on {d.label}: "
                                            f"{bad[0].why if bad else 'no checks ran'}", {}))
        return CanaryReport(decisions, suite, evidence, findings)

    def _cap_memory(self, devices: Sequence[DeviceInfo]) -> None:
        import torch

        for d in devices:
            if d.torch_device.type != "cuda" or d.label in self._capped:
                continue
            try:
                total = torch.cuda.get_device_properties(d.torch_device).total_memory
                frac = min(1.0, (self.policy.memory_cap_bytes + (512 << 20)) / total)
                torch.cuda.set_per_process_memory_fraction(frac, d.torch_device)
                self._capped.add(d.label)
            except Exception as exc:
                log.warning("cannot cap canary memory on %s: %s", d.label, exc)
