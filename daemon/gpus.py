"""The node's GPUs: identity, evidence, state. One record per GPU, keyed by UUID.

The state is derived by `probes.gpu_state` from the evidence (pure); this module only stores it, notices
transitions and tells the agent (events, health, metrics) through `on_transition`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from probes.gpu_state import GpuEvidenceStore
from sdcwatch.types import Evidence, State, worst


@dataclasses.dataclass(slots=True)
class GpuRecord:
    uuid: str
    pci_bus_id: str = ""
    name: str = ""
    index: int = -1
    discovered_by: str = "nvml"      # a GPU exists because NVML says so (reports never create one)
    store: GpuEvidenceStore = dataclasses.field(default_factory=GpuEvidenceStore)
    state: State = State.UNKNOWN
    reason: str = "no evidence yet"
    state_since: float = 0.0
    unsupported: list[str] = dataclasses.field(default_factory=list)


Transition = Callable[[GpuRecord, State, State, str], None]


class GpuRegistry:
    def __init__(self, on_transition: Transition | None = None, max_gpus: int = 64) -> None:
        self.gpus: dict[str, GpuRecord] = {}
        self.on_transition = on_transition
        self.max_gpus = max_gpus
        self.nvml_available = False
        self.nvml_reason = "NVML not probed yet"

    def ensure(self, uuid: str, now: float, **identity: object) -> GpuRecord:
        rec = self.gpus.get(uuid)
        if rec is None:
            if len(self.gpus) >= self.max_gpus:
                raise ValueError(f"more than {self.max_gpus} GPUs on one node")
            rec = GpuRecord(uuid=uuid, state_since=now)
            self.gpus[uuid] = rec
        for key, value in identity.items():
            if value not in (None, "", -1):
                setattr(rec, key, value)
        return rec

    def add_evidence(self, uuid: str, evidence: Iterable[Evidence], now: float) -> GpuRecord:
        rec = self.gpus[uuid]
        for ev in evidence:
            rec.store.put(ev)
        self._rederive(rec, now)
        return rec

    def replace_source(self, uuid: str, source: str, evidence: Iterable[Evidence], now: float) -> GpuRecord:
        """A poll's full evidence from `source`: readings that vanished from it are dropped."""
        rec = self.gpus[uuid]
        rec.store.put_all(source, evidence)
        self._rederive(rec, now)
        return rec

    def set_unsupported(self, uuid: str, fields: Iterable[str]) -> None:
        self.gpus[uuid].unsupported = sorted(set(fields))

    def clear(self, uuid: str, now: float, by: str = "", why: str = "") -> tuple[State, State, list[Evidence]]:
        rec = self.gpus[uuid]
        before = rec.state
        removed = rec.store.clear(now, by=by, why=why)
        self._rederive(rec, now)
        return before, rec.state, removed

    def refresh(self, now: float) -> None:
        """Re-derive every GPU (evidence may have expired)."""
        for rec in self.gpus.values():
            self._rederive(rec, now)

    def _rederive(self, rec: GpuRecord, now: float) -> None:
        state, reason = rec.store.derive(now)
        old = rec.state
        rec.reason = reason
        if state is not old:
            rec.state = state
            rec.state_since = now
            if self.on_transition is not None:
                self.on_transition(rec, old, state, reason)

    def node_state(self) -> tuple[State, str]:
        if not self.gpus:
            return State.UNKNOWN, (self.nvml_reason if not self.nvml_available else "no GPUs found")
        states = [r.state for r in self.gpus.values()]
        state = worst(states)
        bad = [r for r in self.gpus.values() if r.state is state]
        if state is State.HEALTHY:
            return state, f"{len(states)} GPU(s) healthy"
        return state, "; ".join(f"{r.uuid} ({r.pci_bus_id or '?'}): {r.reason}" for r in bad[:4])
