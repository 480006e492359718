"""The agent's canary probe: a blocking `run_once(now)` for `daemon.probe_runner.ProbeRunner`.

Each round: read a snapshot of every GPU (NVML utilization, free memory), ask `AgentCanaryPolicy` which
are idle and due, run the suite on those one GPU at a time (the runner's single worker thread, plus a
lock here, mean never two canaries at once on a GPU; a hung canary makes the runner HUNG and it is not
re-entered), save evidence of failures in the state dir, and return a `CanaryReport` whose `evidence` the
agent attaches to each GPU (`GpuRegistry.add_evidence(uuid, evs, now)`) and whose `findings` it journals.

The snapshot and the suite run in short-lived child processes (probes.canary_process): NVML, torch, its
CUDA contexts, the GIL-bound GEMM loop and a faulty GPU's sticky CUDA error stay out of the agent, which
knows GPUs only by UUID and never imports torch (the report comes back as sdcwatch.canary values). A child that
errs, crashes or overruns its share of `timeout_s` is killed and reported as `canary.unknown`: a crash is
not proof of bad math.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from probes.canary_process import CanaryChildError, child_run_suite, child_snapshots
from probes.canary_schedule import AgentCanaryPolicy, Decision, GpuSnapshot
from sdcwatch.canary import DeviceInfo, Status, SuiteConfig, SuiteReport, evidence_by_device
from sdcwatch import event_kinds as ek
from sdcwatch.types import Evidence, Finding, Severity

NEED_BYTES = {"tiny": 64 << 20, "quick": 1536 << 20, "full": 4 << 30}
SNAPSHOT_TIMEOUT_S = 30.0

RunSuite = Callable[[Sequence[Any], SuiteConfig], SuiteReport]


@dataclasses.dataclass(slots=True)
class CanaryReport:
    decisions: list[Decision]
    suite: SuiteReport | None
    evidence: dict[str, list[Evidence]]           # GPU UUID -> evidence to attach
    findings: list[Finding]


class AgentCanaryProbe:
    """Injection points (tests): `snapshots()`, and `devices()`, torch devices in this process whose chosen
    ones `run_suite(devices, cfg)` gets. By default the snapshot comes from a child (of a fake NVML
    `nvml_scenario` when given), the parent knows GPUs only by UUID (it never imports torch), and `run_suite`
    gets the chosen UUIDs and runs the suite in a child that discovers them. `timeout_s` bounds a round (keep
    it below the runner's, which would mark the probe HUNG): the snapshot's child gets at most
    `SNAPSHOT_TIMEOUT_S` of it, the suite's child the rest."""

    def __init__(self, *, policy: AgentCanaryPolicy | None = None, level: str = "quick",
                 evidence_dir: Path | None = None, nvml_scenario: str | None = None,
                 snapshots: Callable[[], list[GpuSnapshot]] | None = None,
                 devices: Callable[[], list[DeviceInfo]] | None = None,
                 run_suite: RunSuite | None = None, timeout_s: float = 270.0) -> None:
        self.policy = policy or AgentCanaryPolicy()
        self.level = level
        self.evidence_dir = evidence_dir
        snapshot_s = min(SNAPSHOT_TIMEOUT_S, timeout_s / 4)
        self.snapshots = snapshots or functools.partial(child_snapshots, snapshot_s, nvml_scenario)
        self._devices = devices
        self._run_suite = run_suite or functools.partial(self._run_in_child, timeout_s=timeout_s - snapshot_s)
        self.last_run: dict[str, float] = {}
        self.consecutive_failures: dict[str, int] = {}
        self._running: set[str] = set()
        self._lock = threading.Lock()

    def run_once(self, now: float) -> CanaryReport:
        try:
            snaps = self.snapshots()
        except CanaryChildError as exc:
            return CanaryReport([], None, {}, [_unknown(f"no GPU snapshot for the canary: {exc}")])
        decisions = self.policy.choose(snaps, now=now, need_bytes=NEED_BYTES.get(self.level, 2 << 30),
                                       last_run=self.last_run, running=self._running)
        chosen = {d.uuid for d in decisions if d.run}
        if not chosen:
            return CanaryReport(decisions, None, {}, [])
        targets: list[Any] = sorted(chosen)
        if self._devices is not None:
            targets = [d for d in self._devices() if d.uuid in chosen or d.label in chosen]
            if not targets:
                return CanaryReport(decisions, None, {}, [
                    _unknown("the GPUs chosen for a canary are not visible to torch", chosen)])
        if not self._lock.acquire(blocking=False):
            return CanaryReport(decisions, None, {}, [])
        try:
            self._running.update(chosen)
            cfg = SuiteConfig(level=self.level, evidence_dir=self.evidence_dir, copies=True)
            suite = self._run_suite(targets, cfg)
        except CanaryChildError as exc:
            return CanaryReport(decisions, None, {}, [_unknown(str(exc), chosen)])
        finally:
            self._running.difference_update(chosen)
            self._lock.release()
            for uuid in chosen:  # tried, whatever came of it: a crashing canary is not retried every round
                self.last_run[uuid] = now
        evidence = evidence_by_device(suite, now, self.consecutive_failures)
        findings: list[Finding] = []
        for d in suite.devices:
            st, bad = suite.device_status(d.label)
            if st is Status.FAIL:
                self.consecutive_failures[d.label] = self.consecutive_failures.get(d.label, 0) + 1
                findings.append(Finding(ek.CANARY_FAIL, Severity.CRITICAL, f"gpu/{d.label}",
                                        f"canary failed on {d.label}: {bad[0].name}: {bad[0].why}",
                                        {"checks": [r.name for r in bad],
                                         "evidence": [r.evidence_path for r in bad if r.evidence_path]}))
            else:
                self.consecutive_failures.pop(d.label, None)
                if st is Status.UNKNOWN:
                    findings.append(Finding(ek.CANARY_UNKNOWN, Severity.WARNING, f"gpu/{d.label}",
                                            f"canary could not run fully on {d.label}: "
                                            f"{bad[0].why if bad else 'no checks ran'}", {}))
        return CanaryReport(decisions, suite, evidence, findings)

    def _run_in_child(self, labels: Sequence[str], cfg: SuiteConfig, *, timeout_s: float) -> SuiteReport:
        return child_run_suite(cfg, labels=labels, memory_cap_bytes=self.policy.memory_cap_bytes,
                               timeout_s=timeout_s)[0]


def _unknown(why: str, chosen: Iterable[str] = ()) -> Finding:
    return Finding(ek.CANARY_UNKNOWN, Severity.WARNING, "node", why, {"chosen": sorted(chosen)})
