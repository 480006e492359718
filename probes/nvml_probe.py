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

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, ContextManager, Protocol, Sequence

from probes import nvml_rules, xid_catalog
from probes.nvml_backend import NvmlBackend, read_many
from probes.nvml_fields import field_specs, names_matching
from probes.nvml_types import EventFold, FieldNotSupported, GpuIdentity, GpuLost, NvmlError, RawXid
from probes.nvml_rules import GpuReadings, RuleConfig
from sdcwatch import event_kinds as ek
from sdcwatch.event_kinds import REPEATS
from sdcwatch.types import Evidence, Finding, Severity, State

log = logging.getLogger(__name__)

SOURCE = "nvml"
__all__ = ["NvmlProbe", "NvmlProbeConfig", "PollResult", "XidEvent", "GpuIdentity", "GpuReadings"]


# Not read unless asked for: `energy.total_j` costs 2.8 ms per read on an H200 (driver 580), more than the
# whole rest of a poll, and power draw (`power.usage_w`, 2 us) is read every poll.
DEFAULT_SKIP = ("energy.total_j",)



class ListenerBeat(Protocol):
    """The event listener's heartbeat (the agent's `daemon.watchdog.ThreadBeat`)."""

    def beat(self) -> None: ...

    def waiting(self) -> ContextManager[None]: ...

@dataclasses.dataclass(kw_only=True, slots=True)
class NvmlProbeConfig:
    rules: RuleConfig = dataclasses.field(default_factory=RuleConfig)
    xid_wait_ms: int = 500
    # Under a flood (a read that found at least `xid_flood_events` queued), the listener pauses before it
    # reads again, so the driver's queue gathers a batch: xid_flood_pause_ms after the first such read,
    # doubling while the flood lasts up to xid_flood_pause_max_ms, back to none when a read finds a few.
    # Each batch costs the agent about half a millisecond (evidence, metrics, journal); a storm of 40,000
    # XIDs a second then costs 10 batches a second, not one per event. Counts stay exact while the
    # driver's event queue holds what arrives in one pause.
    xid_flood_events: int = 64
    xid_flood_pause_ms: int = 20
    xid_flood_pause_max_ms: int = 100
    read_nvlink: bool = True
    skip_fields: tuple[str, ...] = DEFAULT_SKIP  # names, globs or NVML call names (`names_matching`)
    rotate_per_poll: int = 1   # rotated units read per poll (see `poll_class`); more = fresher, costlier
    sweep_s: float = 30.0  # the costly fields ("sweep" in `poll_class`) are read together this often

    def __post_init__(self) -> None:
        if self.rotate_per_poll < 1:
            raise ValueError(f"NvmlProbeConfig.rotate_per_poll must be >= 1, got {self.rotate_per_poll}")
        if not self.sweep_s > 0:
            raise ValueError(f"NvmlProbeConfig.sweep_s must be > 0, got {self.sweep_s}")
        if not 1 <= self.xid_wait_ms <= 60_000:
            raise ValueError(f"NvmlProbeConfig.xid_wait_ms must be in [1, 60000], got {self.xid_wait_ms}")
        if not 0 <= self.xid_flood_pause_ms <= self.xid_flood_pause_max_ms <= 1000 or self.xid_flood_events < 1:
            raise ValueError("NvmlProbeConfig: need 0 <= xid_flood_pause_ms <= xid_flood_pause_max_ms <= 1000 and "
                             f"xid_flood_events >= 1, got {self.xid_flood_pause_ms}, {self.xid_flood_pause_max_ms}, "
                             f"{self.xid_flood_events}")


# What a poll reads (costs measured by bench/nvml_fields.py on H200s, driver 580.159.04; docs/BENCHMARKS.md):
# - "fast": every poll. What the state and rate rules need at once, each a cheap read: volatile ECC counts,
#   row remapping, recovery action, PCIe link state, temperatures, power, clocks, clock-event reasons (the
#   instant throttle evidence). Most cost 1-10 us.
# - "rotate": counters and state that may lag by a rotation: each poll reads the next `rotate_per_poll`
#   unit(s) of `rotation_unit`: each throttle-time counter, the ECC aggregates, ... and the PCIe replay counter
#   (0.45 ms in a poll; a rate over a 60 s window: a few seconds' lag is harmless).
# - "sweep": the costly fields, read together after the poll every `sweep_s` (GPUs staggered), never inside a
#   poll. Three throttle-time counters (thermal, HW thermal, HW power brake: ~0.7 ms each warm, 2-3 ms in the
#   slowest polls; the clock-event reasons read every poll are the instant evidence of the same slowdowns),
#   and every NVLink link's state and DL error counters (replay, recovery, CRC). The first NVLink read costs
#   ~2 ms of driver CPU (one link's counters 2.4-3.2 ms, every link's state 2.0 ms; no NVML call or field id is
#   cheaper, and the all-link TOTAL fields answer NotSupported on the H200); all 18 links in one call cost
#   ~18 ms, 1 ms a link. A link that goes down also raises an NVLink XID, which arrives at once.
# - "static": read on the first poll and after a GPU reset only (maximum clocks 1.9 ms, ECC mode, maximum
#   PCIe link).
STATIC_FIELDS = frozenset({"ecc.enabled", "pcie.gen.max", "pcie.width.max", "clock.sm_max_mhz", "nvlink.count"})
SWEPT_FIELDS = frozenset({"throttle_ns.thermal", "throttle_ns.hw_thermal", "throttle_ns.hw_power_brake"})
_ROTATED_PREFIXES = ("ecc.corrected.aggregate.", "ecc.uncorrected.aggregate.", "retired_pages.", "remap.hist.",
                     "throttle_ns.", "energy.", "pcie.replay")


def poll_class(name: str) -> str:
    """"fast", "rotate", "sweep" or "static" (see above)."""
    if name in STATIC_FIELDS:
        return "static"
    if name in SWEPT_FIELDS:
        return "sweep"
    if name.startswith("nvlink."):
        parts = name.split(".")
        if len(parts) == 3 and parts[1].isdigit():
            return "sweep"
    return "rotate" if name.startswith(_ROTATED_PREFIXES) else "fast"


def rotation_unit(name: str) -> str:
    """The unit a rotated field is read with: one throttle counter (some cost 0.7 ms each), or one family of
    cheap fields."""
    parts = name.split(".")
    if parts[0] == "throttle_ns":
        return name
    if ".aggregate." in name:
        return "ecc.aggregate"
    return parts[0]


@dataclasses.dataclass(frozen=True, slots=True)
class XidEvent:
    """One NVML event (an XID, or another `EVENT_TYPES` event: `event`), or `count` identical ones in a
    row (a batch drained from the event set under a flood; `time` is the last one's)."""

    uuid: str
    pci_bus_id: str
    xid: int
    time: float
    event: str = "xid"
    count: int = 1


def fold_batch(events: Sequence[XidEvent]) -> list[XidEvent]:
    """Pure: identical events of a batch (same GPU, event and data) as one with their count, in first-seen
    order. 800,000 repeated XIDs cost the agent one evidence update and one journal offer per batch."""
    return EventFold().add(events).take()


#: Non-XID NVML events: (implied state, seconds the evidence holds, severity, what it means). The polled
#: fields carry the lasting state (remap pending, recovery action, ...); the event makes it known at once.
_EVENT_MEANING: dict[str, tuple[State, float, Severity, str]] = {
    "sbe_storm": (State.SUSPECT, 3600.0, Severity.WARNING,
                  "single-bit ECC storm: corrected memory errors at storm rate (memory wearing out)"),
    "dram_retirement": (State.SUSPECT, 3600.0, Severity.WARNING,
                        "a DRAM row/page was retired after errors (repaired at the next reset)"),
    "dram_retirement_failure": (State.DEGRADED, 86400.0, Severity.CRITICAL,
                                "retiring a failing DRAM row/page failed: the bad memory stays in use"),
    "poison_nonfatal": (State.SUSPECT, 3600.0, Severity.WARNING,
                        "poisoned data was contained to the application that touched it"),
    "poison_fatal": (State.DEGRADED, 86400.0, Severity.CRITICAL,
                     "poisoned data was consumed and could not be contained"),
    "gpu_unavailable": (State.FAILED, 86400.0, Severity.CRITICAL, "the GPU became unavailable"),
    "recovery_action": (State.SUSPECT, 600.0, Severity.WARNING,
                        "the driver changed the GPU's recovery action (read from the recovery-action field)"),
}


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
    sweep_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # sweeps after this poll


@dataclasses.dataclass(slots=True)
class _Slot:
    identity: GpuIdentity
    names: list[str]
    fast: list[str] = dataclasses.field(default_factory=list)
    fast_set: frozenset[str] = frozenset()
    static: list[str] = dataclasses.field(default_factory=list)
    units: list[list[str]] = dataclasses.field(default_factory=list)
    sweep: list[str] = dataclasses.field(default_factory=list)   # "sweep" fields: NVLink, costly throttle counters
    swept: set[str] = dataclasses.field(default_factory=set)     # read by a sweep, not yet seen by a poll
    next_sweep: float = 0.0
    prev: GpuReadings | None = None
    rotation: int = 0
    reread_static: bool = False
    full_read: bool = False          # every field read once (then the fast ones, rotated units and statics)
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)  # last answer of every non-fast field
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
            every = list(field_specs(links))
            skipped = names_matching(self.config.skip_fields, every) if self.config.skip_fields else set()
            slot = _Slot(ident, [n for n in every if n not in skipped])
            units: dict[str, list[str]] = {}
            for n in slot.names:
                kind = poll_class(n)
                if kind == "fast":
                    slot.fast.append(n)
                elif kind == "static":
                    slot.static.append(n)
                elif kind == "sweep":
                    slot.sweep.append(n)
                else:
                    units.setdefault(rotation_unit(n), []).append(n)
            slot.units = list(units.values())
            slot.fast_set = frozenset(slot.fast)
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
        slots = list(self._slots.items())
        plans = [self._names(slot) for _, slot in slots]
        t0 = time.perf_counter()
        raws = read_many(self.backend, [(slot.identity.index, names) for (_, slot), names in zip(slots, plans)])
        share = (time.perf_counter() - t0) / max(1, len(slots))  # each GPU's part of the one round trip
        for (uuid, slot), raw in zip(slots, raws):
            t0 = time.perf_counter()
            evidence, readings, unsupported, errors, findings = self._poll_gpu(slot, raw, now)
            res.poll_seconds[uuid] = share + time.perf_counter() - t0
            res.identities[uuid] = slot.identity
            res.evidence[uuid] = evidence
            res.readings[uuid] = readings
            res.unsupported[uuid] = unsupported
            res.errors[uuid] = errors
            res.findings.extend(findings)
            res.findings.extend(self._changes(slot, evidence))
        every = self.config.sweep_s
        for i, (uuid, slot) in enumerate(slots):
            if not slot.sweep or slot.lost or not slot.full_read:
                continue
            if slot.next_sweep == 0.0:  # links just read by the full read: stagger the GPUs over one interval
                slot.next_sweep = now + every * (i + 1) / len(slots)
            elif now >= slot.next_sweep:
                t0 = time.perf_counter()
                self._sweep(slot)
                res.sweep_seconds[uuid] = time.perf_counter() - t0
                slot.next_sweep = max(slot.next_sweep + every, now + every / 2)
        return res

    def _sweep(self, slot: _Slot) -> None:
        """Read the costly fields in one call; the next poll judges them (as read now)."""
        try:
            raw = self.backend.read_fields(slot.identity.index, slot.sweep)
        except NvmlError as err:  # GpuLost included: the next poll reports the GPU itself
            log.info("GPU %s: sweep of the costly fields failed: %s", slot.identity.uuid, err)
            return
        slot.cache.update(raw)
        slot.swept.update(raw)

    def _names(self, slot: _Slot) -> list[str]:
        """What this poll reads of a GPU. Every field on the first poll; then the fast fields, the next rotated
        unit(s), and the static fields again after a GPU reset; the rest carry their last answer."""
        if not slot.full_read:  # until one read of every field has succeeded (a failed first poll retries)
            return slot.names
        names = list(slot.fast)
        if slot.units:
            for _ in range(min(self.config.rotate_per_poll, len(slot.units))):
                names += slot.units[slot.rotation % len(slot.units)]
                slot.rotation += 1
        if slot.reread_static:
            names += slot.static
        return names

    def _absorb(self, slot: _Slot, raw: dict[str, Any] | NvmlError) -> tuple[dict[str, Any], frozenset[str]]:
        """(values, names read since the last poll, a sweep's included) from this poll's read of a GPU."""
        if isinstance(raw, NvmlError):
            raise raw
        slot.reread_static = False
        slot.full_read = True
        fast = slot.fast_set
        slot.cache.update((n, v) for n, v in raw.items() if n not in fast)
        fresh = frozenset(raw) | slot.swept if slot.swept else frozenset(raw)
        slot.swept = set()
        return {**slot.cache, **raw}, fresh

    def _poll_gpu(self, slot: _Slot, raw_read: dict[str, Any] | NvmlError, now: float
                  ) -> tuple[list[Evidence], GpuReadings | None, frozenset[str], dict[str, str], list[Finding]]:
        ident = slot.identity
        subject = ident.subject
        findings: list[Finding] = []
        try:
            raw, fresh = self._absorb(slot, raw_read)
        except GpuLost as err:
            ev = [Evidence(SOURCE, "gpu_lost", "lost", State.FAILED, f"GPU lost (fell off the bus): {err}", now),
                  Evidence(SOURCE, "readable", "0", State.UNKNOWN, f"GPU lost: {err}", now)]
            if not slot.lost:
                findings.append(Finding(ek.GPU_LOST, Severity.CRITICAL, subject, f"GPU {ident.pci_bus_id} lost: "
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
        readings = nvml_rules.make_readings(ident.uuid, slot.prev, values, frozenset(unsupported), errors, now, cfg,
                                            fresh=fresh)
        slot.reread_static = readings.reset_detected  # a reset can apply a pending ECC mode or relink PCIe
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
            storm = ev.signal == "ecc.sbe_storm" and ev.implies is not State.HEALTHY  # its own kind and alert
            out.append(Finding(ek.GPU_ECC_STORM if storm else ek.GPU_SIGNAL,
                               Severity.WARNING if storm else _CHANGE_SEVERITY[ev.implies], slot.identity.subject,
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
        return self._event_of(raw, self._clock())

    def xid_drain(self, max_events: int) -> list[XidEvent]:
        """The events queued now (no wait), folded with their counts (the backend folds them at the source)."""
        now = self._clock()
        return [self._event_of(raw, now) for raw in self.backend.xid_drain(max_events)]

    def _event_of(self, raw: RawXid, now: float) -> XidEvent:
        ident = self._index_of(raw.uuid)
        return XidEvent(uuid=raw.uuid or "unknown", pci_bus_id=ident.pci_bus_id if ident else "unknown",
                        xid=raw.xid, time=now, event=raw.event, count=raw.count)

    def run_xid_listener(self, on_event: Callable[[XidEvent], None], stop: threading.Event, *,
                         on_batch: Callable[[list[XidEvent]], None] | None = None,
                         on_open: Callable[[dict[int, list[str]]], None] | None = None,
                         batch_max: int = 4096, beat: ListenerBeat | None = None) -> None:
        """Loop on the NVML event set until `stop` is set; call `on_event` for each event, or, with
        `on_batch`, drain what is queued (up to `batch_max`) and hand it over folded (`fold_batch`). `on_open`
        gets the event types registered per GPU index (the others are NotSupported there). Run on its own
        thread. Returns if events cannot be opened (logged); transient errors are retried. `beat` (the agent's
        watchdog): `beat()` every round, the driver's waits inside `beat.waiting()`."""
        try:
            registered = self.backend.xid_open()
        except NvmlError as err:
            log.warning("NVML events unavailable: %s", err)
            return
        log.info("NVML events registered on %d GPU(s): %s", len(registered),
                 {i: ",".join(names) for i, names in registered.items()})
        if on_open is not None:
            on_open(registered)
        try:
            waiting = beat.waiting if beat is not None else contextlib.nullcontext
            pause_ms = 0     # the flood pause now (0: no flood)
            while not stop.is_set():
                if beat is not None:
                    beat.beat()
                try:
                    with waiting():
                        ev = self.xid_step()
                    batch = [ev] if ev is not None else []
                    if on_batch is not None and batch:   # what else is queued, in one backend call
                        batch += self.xid_drain(batch_max)
                except NvmlError as err:
                    if not err.transient and not isinstance(err, GpuLost):
                        log.error("NVML event listener stopping: %s", err)
                        return
                    log.warning("NVML event wait failed (retrying): %s", err)
                    stop.wait(min(1.0, self.config.xid_wait_ms / 1000))
                    continue
                if not batch:
                    continue
                try:
                    if on_batch is not None:
                        on_batch(fold_batch(batch))
                    else:
                        on_event(batch[0])
                except Exception:  # noqa: BLE001 - one bad handler must not kill the listener
                    log.exception("NVML event handler failed for %s", batch[0])
                if sum(ev.count for ev in batch) >= self.config.xid_flood_events:   # a flood: let it gather
                    pause_ms = min(2 * pause_ms, self.config.xid_flood_pause_max_ms) if pause_ms \
                        else self.config.xid_flood_pause_ms
                    stop.wait(pause_ms / 1000.0)
                else:
                    pause_ms = 0
        finally:
            try:
                self.backend.xid_close()
            except NvmlError as err:
                log.warning("closing NVML events: %s", err)

    @staticmethod
    def event_evidence(ev: XidEvent) -> tuple[Evidence, Finding]:
        """Pure: the evidence and the journal event for one NVML event (an XID: `xid_evidence`)."""
        if ev.event == "xid":
            return NvmlProbe.xid_evidence(ev)
        implies, hold_s, severity, meaning = _EVENT_MEANING.get(
            ev.event, (State.SUSPECT, 3600.0, Severity.WARNING, f"NVML event {ev.event}"))
        n = f" x{ev.count}" if ev.count > 1 else ""
        evidence = Evidence(SOURCE, f"event.{ev.event}", str(ev.xid), implies, f"NVML event {ev.event}{n}: {meaning}",
                            ev.time, count=ev.count, expires=ev.time + hold_s)
        details = {"event": ev.event, "data": ev.xid, "implies": implies.name, "uuid": ev.uuid,
                   "pci_bus_id": ev.pci_bus_id, "time": ev.time}
        if ev.count > 1:
            details[REPEATS] = ev.count
        kind = ek.GPU_ECC_STORM if ev.event == "sbe_storm" else ek.GPU_NVML_EVENT
        return evidence, Finding(kind, severity, f"gpu/{ev.uuid}",
                                 f"NVML event {ev.event} on {ev.pci_bus_id}: {meaning}", details)

    @staticmethod
    def xid_evidence(ev: XidEvent) -> tuple[Evidence, Finding]:
        """Pure: the evidence (counted by `GpuEvidenceStore`) and the journal event for one XID."""
        entry = xid_catalog.classify(ev.xid)
        label = f"XID {ev.xid} ({entry.name})" if entry.known else f"unknown XID {ev.xid}"
        evidence = Evidence(SOURCE, f"xid.{ev.xid}", str(ev.xid), entry.implies,
                            f"{label}: {entry.action.value}", ev.time, count=ev.count)
        details: dict[str, Any] = {"xid": ev.xid, "name": entry.name, "action": entry.action.value,
                                   "implies": entry.implies.name, "known": entry.known, "solo": entry.solo,
                                   "uuid": ev.uuid, "pci_bus_id": ev.pci_bus_id, "time": ev.time}
        if ev.count > 1:
            details[REPEATS] = ev.count   # a batch of identical XIDs: the bus folds and counts them
        finding = Finding(ek.GPU_XID, entry.severity, f"gpu/{ev.uuid}",
                          f"{label} on {ev.pci_bus_id}: {entry.meaning} Action: {entry.action.value}", details)
        return evidence, finding

    def close(self) -> None:
        self.backend.close()
