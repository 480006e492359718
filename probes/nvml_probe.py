"""The NVML probe: discovers GPUs, polls their fields, listens for XIDs, and turns it all into evidence.

The same code runs over `PynvmlBackend` and `ScenarioBackend`. Every method here blocks; the agent calls
`discover` and `poll` off its event loop with a timeout (a call that does not return marks the probe HUNG
and is not re-entered), and runs `run_xid_listener` on a dedicated thread.

Lifecycle: `NvmlProbe(backend, config)` -> `discover()` (also done by the first `poll`) -> `poll(now)`
every interval; in parallel `run_xid_listener(on_event, stop)`; `xid_evidence(event)` for each event;
`close()` at the end (closes the backend).

GPUs are named by UUID and PCI bus id; the backend index is used only to talk to the backend.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from probes import nvml_rules, xid_catalog
from probes.nvml_backend import (
    FieldNotSupported,
    GpuIdentity,
    GpuLost,
    NvmlBackend,
    NvmlError,
    field_specs,
)
from probes.nvml_rules import GpuReadings, RuleConfig
from probes.types import Evidence, Finding, Severity, State

log = logging.getLogger(__name__)

SOURCE = "nvml"
__all__ = ["NvmlProbe", "NvmlProbeConfig", "PollResult", "XidEvent", "GpuIdentity", "GpuReadings"]


@dataclasses.dataclass(kw_only=True, slots=True)
class NvmlProbeConfig:
    rules: RuleConfig = dataclasses.field(default_factory=RuleConfig)
    xid_wait_ms: int = 500
    read_nvlink: bool = True
    skip_fields: tuple[str, ...] = ()
    slow_every: int = 30   # slow-changing fields (SLOW_PREFIXES) are read every Nth poll; 1 = every poll

    def __post_init__(self) -> None:
        if self.slow_every < 1:
            raise ValueError(f"NvmlProbeConfig.slow_every must be >= 1, got {self.slow_every}")
        if not 1 <= self.xid_wait_ms <= 60_000:
            raise ValueError(f"NvmlProbeConfig.xid_wait_ms must be in [1, 60000], got {self.xid_wait_ms}")


# Fields that change rarely or only matter as state (not as a rate): read every `slow_every`th poll. Each
# NVML call costs 0.1-7 ms on a virtualised H200 host, so the per-poll cost is mostly the number of calls.
# Fields read through the one field-values call per poll (NVLink, throttle time, recovery action) stay fast:
# they add no call.
SLOW_PREFIXES = ("ecc.enabled", "ecc.corrected.aggregate.", "ecc.uncorrected.aggregate.", "retired_pages.",
                 "remap.hist.", "pcie.gen.", "pcie.width.", "power.limit_w", "clock.")


def is_slow_field(name: str) -> bool:
    return name.startswith(SLOW_PREFIXES)


@dataclasses.dataclass(frozen=True, slots=True)
class XidEvent:
    uuid: str
    pci_bus_id: str
    xid: int
    time: float


@dataclasses.dataclass(slots=True)
class PollResult:
    """One poll of every GPU, keyed by UUID."""

    time: float
    identities: dict[str, GpuIdentity]
    evidence: dict[str, list[Evidence]]
    unsupported: dict[str, frozenset[str]]
    readings: dict[str, GpuReadings | None]
    findings: list[Finding]
    errors: dict[str, dict[str, str]]
    poll_seconds: dict[str, float]


@dataclasses.dataclass(slots=True)
class _Slot:
    identity: GpuIdentity
    names: list[str]
    prev: GpuReadings | None = None
    polls: int = 0
    slow_cache: dict[str, Any] = dataclasses.field(default_factory=dict)
    implied: dict[str, State] = dataclasses.field(default_factory=dict)
    lost: bool = False
    warned: set[str] = dataclasses.field(default_factory=set)


_CHANGE_SEVERITY = {State.HEALTHY: Severity.INFO, State.UNKNOWN: Severity.WARNING, State.SUSPECT: Severity.WARNING,
                    State.DEGRADED: Severity.CRITICAL, State.FAILED: Severity.CRITICAL}


class NvmlProbe:
    def __init__(self, backend: NvmlBackend, config: NvmlProbeConfig | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        if not isinstance(backend, NvmlBackend):
            raise ValueError(f"backend {backend!r} does not implement NvmlBackend")
        self.backend = backend
        self.config = config or NvmlProbeConfig()
        self._clock = clock or time.time
        self._slots: dict[str, _Slot] = {}
        self._by_uuid_lock = threading.Lock()
        self._discovered = False

    # -- discovery ------------------------------------------------------------------------------------------

    def discover(self) -> list[GpuIdentity]:
        """Enumerate GPUs (by UUID). Re-discovery keeps each known UUID's history even if its index moved."""
        found: dict[str, _Slot] = {}
        for index in range(self.backend.device_count()):
            try:
                ident = self.backend.identity(index)
            except NvmlError as err:
                log.warning("GPU index %d: cannot read its identity: %s", index, err)
                continue
            if ident.uuid in found:
                raise ValueError(f"two GPUs report UUID {ident.uuid}")
            old = self._slots.get(ident.uuid)
            links = 0
            if self.config.read_nvlink:
                try:
                    v = self.backend.read_fields(index, ["nvlink.count"]).get("nvlink.count")
                    links = int(v) if isinstance(v, (int, float)) else 0
                except NvmlError as err:
                    log.info("GPU %s: NVLink count unreadable: %s", ident.uuid, err)
            names = [n for n in field_specs(links) if n not in self.config.skip_fields]
            slot = _Slot(ident, names)
            if old is not None:
                slot.prev, slot.implied, slot.warned = old.prev, old.implied, old.warned
            found[ident.uuid] = slot
        with self._by_uuid_lock:
            self._slots = found
            self._discovered = True
        return [s.identity for s in found.values()]

    def identities(self) -> list[GpuIdentity]:
        return [s.identity for s in self._slots.values()]

    def _index_of(self, uuid: str | None) -> GpuIdentity | None:
        if uuid is None:
            return None
        slot = self._slots.get(uuid)
        return slot.identity if slot else None

    # -- polling --------------------------------------------------------------------------------------------

    def poll(self, now: float) -> PollResult:
        if not self._discovered:
            self.discover()
        res = PollResult(now, {}, {}, {}, {}, [], {}, {})
        for uuid, slot in list(self._slots.items()):
            t0 = time.perf_counter()
            evidence, readings, unsupported, errors, findings = self._poll_gpu(slot, now)
            res.poll_seconds[uuid] = time.perf_counter() - t0
            res.identities[uuid] = slot.identity
            res.evidence[uuid] = evidence
            res.readings[uuid] = readings
            res.unsupported[uuid] = unsupported
            res.errors[uuid] = errors
            res.findings.extend(findings)
            res.findings.extend(self._changes(slot, evidence))
        return res

    def _read(self, slot: _Slot) -> dict[str, Any]:
        """Every field on the first poll and every `slow_every`th; the fast ones in between, with the slow
        ones' last answers. Rate rules only use fast fields, so their rates stay exact."""
        full = slot.polls % self.config.slow_every == 0 or not slot.slow_cache
        slot.polls += 1
        names = slot.names if full else [n for n in slot.names if not is_slow_field(n)]
        raw = self.backend.read_fields(slot.identity.index, names)
        if full:
            slot.slow_cache = {n: v for n, v in raw.items() if is_slow_field(n)}
            return raw
        return {**slot.slow_cache, **raw}

    def _poll_gpu(self, slot: _Slot, now: float
                  ) -> tuple[list[Evidence], GpuReadings | None, frozenset[str], dict[str, str], list[Finding]]:
        ident = slot.identity
        subject = ident.subject
        findings: list[Finding] = []
        try:
            raw = self._read(slot)
        except GpuLost as err:
            ev = [Evidence(SOURCE, "gpu_lost", "lost", State.FAILED, f"GPU lost (fell off the bus): {err}", now),
                  Evidence(SOURCE, "readable", "0", State.UNKNOWN, f"GPU lost: {err}", now)]
            if not slot.lost:
                findings.append(Finding("gpu.lost", Severity.CRITICAL, subject, f"GPU {ident.pci_bus_id} lost: "
                                        f"{err}", {"uuid": ident.uuid, "pci_bus_id": ident.pci_bus_id}))
            slot.lost = True
            return ev, None, frozenset(), {"*": str(err)}, findings
        except NvmlError as err:
            return ([Evidence(SOURCE, "readable", "0", State.UNKNOWN, f"NVML read failed: {err}", now)],
                    None, frozenset(), {"*": str(err)}, findings)
        slot.lost = False
        values: dict[str, int | float] = {}
        unsupported: set[str] = set()
        errors: dict[str, str] = {}
        for name, v in raw.items():
            if isinstance(v, FieldNotSupported):
                unsupported.add(name)
            elif isinstance(v, NvmlError):
                errors[name] = str(v)
                if not v.transient and name not in slot.warned:
                    slot.warned.add(name)
                    log.warning("GPU %s: field %s: %s", ident.uuid, name, v)
            else:
                values[name] = v
        if not values:
            why = f"no field readable ({len(unsupported)} unsupported, {len(errors)} errors"
            why += f"; e.g. {next(iter(errors.values()))})" if errors else ")"
            return ([Evidence(SOURCE, "readable", "0", State.UNKNOWN, why, now)], None, frozenset(unsupported),
                    errors, findings)
        cfg = self.config.rules
        readings = nvml_rules.make_readings(ident.uuid, slot.prev, values, frozenset(unsupported), errors, now, cfg)
        out = nvml_rules.evaluate(slot.prev, readings, now, cfg)
        slot.prev = readings
        evidence = [Evidence(SOURCE, "readable", str(len(values)), State.HEALTHY,
                             f"{len(values)} fields read, {len(unsupported)} unsupported, {len(errors)} errors",
                             now)]
        evidence.extend(out.evidence)
        findings.extend(out.findings)
        return evidence, readings, frozenset(unsupported), errors, findings

    def _changes(self, slot: _Slot, evidence: list[Evidence]) -> list[Finding]:
        """A finding for each signal whose implied state changed since the last poll."""
        out: list[Finding] = []
        for ev in evidence:
            if ev.signal == "gpu_reset":
                continue
            before = slot.implied.get(ev.signal)
            slot.implied[ev.signal] = ev.implies
            if before is ev.implies or (before is None and ev.implies is State.HEALTHY):
                continue
            out.append(Finding("gpu.signal", _CHANGE_SEVERITY[ev.implies], slot.identity.subject,
                               f"{ev.signal}: {before.name if before else 'new'} -> {ev.implies.name}: {ev.reason}",
                               {"signal": ev.signal, "value": ev.value, "implies": ev.implies.name,
                                "before": before.name if before else None, "uuid": slot.identity.uuid,
                                "pci_bus_id": slot.identity.pci_bus_id}))
        return out

    # -- XID events -----------------------------------------------------------------------------------------

    def xid_step(self, timeout_ms: int | None = None) -> XidEvent | None:
        """Wait once for an XID (at most timeout_ms); None when nothing came."""
        raw = self.backend.xid_wait(self.config.xid_wait_ms if timeout_ms is None else timeout_ms)
        if raw is None:
            return None
        ident = self._index_of(raw.uuid)
        uuid = raw.uuid or "unknown"
        return XidEvent(uuid=uuid, pci_bus_id=ident.pci_bus_id if ident else "unknown", xid=raw.xid,
                        time=self._clock())

    def run_xid_listener(self, on_event: Callable[[XidEvent], None], stop: threading.Event) -> None:
        """Loop on the NVML event set until `stop` is set; call `on_event` for each XID. Run on its own
        thread. Returns if XID events cannot be opened (logged); transient errors are retried."""
        try:
            registered = self.backend.xid_open()
        except NvmlError as err:
            log.warning("XID events unavailable: %s", err)
            return
        log.info("XID listener registered on %d GPU(s)", len(registered))
        try:
            while not stop.is_set():
                try:
                    ev = self.xid_step()
                except NvmlError as err:
                    if not err.transient and not isinstance(err, GpuLost):
                        log.error("XID listener stopping: %s", err)
                        return
                    log.warning("XID wait failed (retrying): %s", err)
                    stop.wait(min(1.0, self.config.xid_wait_ms / 1000))
                    continue
                if ev is None:
                    continue
                try:
                    on_event(ev)
                except Exception:  # noqa: BLE001 - one bad handler must not kill the listener
                    log.exception("XID handler failed for %s", ev)
        finally:
            try:
                self.backend.xid_close()
            except NvmlError as err:
                log.warning("closing XID events: %s", err)

    @staticmethod
    def xid_evidence(ev: XidEvent) -> tuple[Evidence, Finding]:
        """Pure: the evidence (counted by `GpuEvidenceStore`) and the journal event for one XID."""
        entry = xid_catalog.classify(ev.xid)
        label = f"XID {ev.xid} ({entry.name})" if entry.known else f"unknown XID {ev.xid}"
        evidence = Evidence(SOURCE, f"xid.{ev.xid}", str(ev.xid), entry.implies,
                            f"{label}: {entry.action.value}", ev.time)
        finding = Finding("gpu.xid", entry.severity, f"gpu/{ev.uuid}",
                          f"{label} on {ev.pci_bus_id}: {entry.meaning} Action: {entry.action.value}",
                          {"xid": ev.xid, "name": entry.name, "action": entry.action.value,
                           "implies": entry.implies.name, "known": entry.known, "uuid": ev.uuid,
                           "pci_bus_id": ev.pci_bus_id, "time": ev.time})
        return evidence, finding

    def close(self) -> None:
        self.backend.close()
