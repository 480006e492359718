"""`GpuTransitions`: what a GPU's state change does (the GPU table, `daemon/gpus.py`, calls it).

A `gpu.state` event (CRITICAL into FAILED or SUSPECT, WARNING into DEGRADED, INFO otherwise); the GPU's state
gauge; into FAILED, a `fatal_hardware` event for the checkpoints of every job whose ranks run on it (their
newer checkpoints are not VERIFIED); and the node's health is marked for a sync (daemon/health.py).
"""
from __future__ import annotations

import asyncio

from daemon.checkpoint_feed import CheckpointFeed
from daemon.events import Publisher
from daemon.gpu_metrics import GpuMetrics
from daemon.gpus import GpuRecord
from daemon.jobs import JobTracker
from sdcwatch import event_kinds as ek
from sdcwatch.types import Severity, State


class GpuTransitions:
    def __init__(self, *, publisher: Publisher, jobs: JobTracker, checkpoints: CheckpointFeed,
                 gpu_metrics: GpuMetrics | None, health_changed: asyncio.Event) -> None:
        self.publisher = publisher
        self.jobs = jobs
        self.checkpoints = checkpoints
        self.gpu_metrics = gpu_metrics
        self.health_changed = health_changed

    def __call__(self, rec: GpuRecord, old: State, new: State, reason: str) -> None:
        severity = (Severity.CRITICAL if new in (State.FAILED, State.SUSPECT)
                    else Severity.WARNING if new is State.DEGRADED else Severity.INFO)
        self.publisher.publish(ek.GPU_STATE, f"gpu/{rec.uuid}",
                               f"GPU {rec.uuid} ({rec.pci_bus_id or '?'}) {old.name} -> {new.name}: {reason}",
                               {"uuid": rec.uuid, "pci_bus_id": rec.pci_bus_id, "from": old.name,
                                "to": new.name, "reason": reason}, severity=severity)
        if self.gpu_metrics is not None:
            self.gpu_metrics.state_changed(rec.uuid, rec.state)
        if new is State.FAILED:
            for job in self.jobs.jobs_on_gpu(rec.uuid):
                self.checkpoints.put(job.job_id, None, "fatal_hardware", f"GPU {rec.uuid} FAILED: {reason}")
        self.health_changed.set()
