"""Prometheus metrics for GPUs (documented in docs/metrics.md, section "GPU metrics").

Every series is labelled by `uuid`, `pci_bus_id` and `model`. Counters follow the probe's deltas, which
never go negative: a GPU reset zeroes the GPU's volatile counters but our `_total` series keep growing.
`sdcwatch_gpu_info` also carries the node's `hostname`; the recording rules `sdcwatch:gpu_info:dcgm` and
`sdcwatch:gpu_state:dcgm` (deploy/prometheus/sdcwatch-rules.yml) copy `uuid`, `model`, `hostname` and
`index` to dcgm-exporter's `UUID`, `modelName`, `Hostname` and `gpu`, so the two exporters join. (The
agent does not export camelCase labels itself: `promtool check metrics` rejects them.)
"""
from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from probes.nvml_fields import ECC_KINDS
from probes.nvml_rules import CLOCK_EVENT_BITS, GpuReadings
from probes.nvml_types import GpuIdentity
from sdcwatch.types import State
from probes.xid_catalog import RecoveryAction

L = ("uuid", "pci_bus_id", "model")


class GpuMetrics:
    """`hostname`: the node's name as dcgm-exporter reports it in `Hostname` (the agent's `[agent] hostname`;
    in Kubernetes the node name), the `hostname` label of `sdcwatch_gpu_info`."""

    def __init__(self, registry: CollectorRegistry, hostname: str = "") -> None:
        r = registry
        self.hostname = hostname
        self.info = Gauge("sdcwatch_gpu_info", "GPU identity (value 1); hostname is the node's name",
                          L + ("index", "serial", "driver_version", "hostname"), registry=r)
        self.state = Gauge("sdcwatch_gpu_state", "1 for the GPU's current state, 0 for the others", L + ("state",),
                           registry=r)
        self.xid = Counter("sdcwatch_gpu_xid_events", "XID events seen", L + ("xid",), registry=r)
        self.ecc = Counter("sdcwatch_gpu_ecc_errors", "ECC errors (from volatile counter deltas)",
                           L + ("type", "location"), registry=r)
        self.ecc_agg = Gauge("sdcwatch_gpu_ecc_errors_aggregate", "Lifetime ECC error count reported by the GPU",
                             L + ("type", "location"), registry=r)
        self.remapped = Gauge("sdcwatch_gpu_remapped_rows", "Row remapping: rows remapped (correctable, "
                              "uncorrectable) and flags (pending, failure)", L + ("kind",), registry=r)
        self.retired = Gauge("sdcwatch_gpu_retired_pages", "Retired pages by cause (sbe, dbe) and pending flag",
                             L + ("cause",), registry=r)
        self.pcie_replays = Counter("sdcwatch_gpu_pcie_replays", "PCIe replays", L, registry=r)
        self.pcie_gen = Gauge("sdcwatch_gpu_pcie_link_generation", "PCIe link generation", L + ("which",),
                              registry=r)
        self.pcie_width = Gauge("sdcwatch_gpu_pcie_link_width_lanes", "PCIe link width", L + ("which",),
                                registry=r)
        self.nvlink_errors = Counter("sdcwatch_gpu_nvlink_errors", "NVLink errors by link and kind",
                                     L + ("link", "kind"), registry=r)
        self.nvlink_up = Gauge("sdcwatch_gpu_nvlink_link_up", "1 if the NVLink link is active", L + ("link",),
                               registry=r)
        self.throttle = Counter("sdcwatch_gpu_throttle_seconds", "Time clocks were held down, by reason",
                                L + ("reason",), registry=r)
        self.clock_event = Gauge("sdcwatch_gpu_clock_event_active", "1 while a clock-event (throttle) reason "
                                 "is active", L + ("reason",), registry=r)
        self.temp = Gauge("sdcwatch_gpu_temperature_celsius", "Temperature", L + ("sensor",), registry=r)
        self.power = Gauge("sdcwatch_gpu_power_watts", "Power draw", L, registry=r)
        self.power_limit = Gauge("sdcwatch_gpu_power_limit_watts", "Enforced power limit", L, registry=r)
        self.energy = Counter("sdcwatch_gpu_energy_joules", "Energy consumed", L, registry=r)
        self.clock = Gauge("sdcwatch_gpu_clock_hertz", "Current clocks", L + ("clock",), registry=r)
        self.recovery = Gauge("sdcwatch_gpu_recovery_action", "1 for the driver's current recovery action",
                              L + ("action",), registry=r)
        self.resets = Counter("sdcwatch_gpu_resets_detected", "GPU resets recognised from counters", L,
                              registry=r)
        self.unsupported = Gauge("sdcwatch_gpu_unsupported_fields", "Fields the GPU answers NotSupported", L,
                                 registry=r)
        self.up = Gauge("sdcwatch_gpu_readable", "1 if the last poll read any field of the GPU", L, registry=r)
        self.canary_runs = Counter("sdcwatch_gpu_canary_runs", "Canary suite runs on the GPU, by result "
                                   "(pass, fail, unknown)", L + ("result",), registry=r)
        self.canary_failures = Counter("sdcwatch_gpu_canary_failures", "Canary suite runs that FAILED", L,
                                       registry=r)
        # per GPU: (metric, labels) -> the labelled child, so a poll's ~150 updates are dict lookups
        self._children: dict[str, dict[tuple[object, tuple[str, ...]], Any]] = {}
        self.identities: dict[str, GpuIdentity] = {}   # uuid -> identity, from NVML (`identify`)

    @staticmethod
    def _labels(identity: GpuIdentity) -> tuple[str, str, str]:
        return identity.uuid, identity.pci_bus_id, identity.name

    def _child(self, identity: GpuIdentity, metric: Any, extra: tuple[str, ...]) -> Any:
        kids = self._children.get(identity.uuid)
        if kids is None:
            kids = self._children[identity.uuid] = {}
        key = (metric, extra)
        child = kids.get(key)
        if child is None:
            child = kids[key] = metric.labels(*self._labels(identity), *extra)
        return child

    def _set(self, identity: GpuIdentity, metric: Gauge, extra: tuple[str, ...], value: float) -> None:
        self._child(identity, metric, extra).set(value)

    def _inc(self, identity: GpuIdentity, metric: Counter, extra: tuple[str, ...], value: float) -> None:
        child = self._child(identity, metric, extra)  # created at 0 on first sight
        if value > 0:
            child.inc(value)

    def observe_canary(self, identity: GpuIdentity, result: str) -> None:
        """One canary run on the GPU: result is 'pass', 'fail' or 'unknown'."""
        self._inc(identity, self.canary_runs, (result,), 1)
        self._inc(identity, self.canary_failures, (), 1 if result == "fail" else 0)

    def observe_xid(self, identity: GpuIdentity, xid: int, count: int = 1) -> None:
        self._inc(identity, self.xid, (str(int(xid)),), count)

    def identify(self, identity: GpuIdentity) -> None:
        """The GPU's identity as NVML reports it (its labels); series are kept only for identified GPUs."""
        self.identities[identity.uuid] = identity

    def identity(self, uuid: str) -> GpuIdentity | None:
        return self.identities.get(uuid)

    def state_changed(self, uuid: str, state: State) -> None:
        """A GPU's state changed (daemon/gpu_transitions.py): the state gauge of an identified GPU follows."""
        identity = self.identities.get(uuid)
        if identity is not None:
            self.set_state(identity, state)

    def set_state(self, identity: GpuIdentity, state: State) -> None:
        """The derived state alone (on a transition between polls)."""
        for s in State:
            self._set(identity, self.state, (s.name,), 1 if s is state else 0)

    def update(self, identity: GpuIdentity, readings: GpuReadings | None, state: State) -> None:
        """One poll's readings (None when the GPU could not be read) and the derived state."""
        i = identity
        self._set(i, self.info, (str(i.index), i.serial or "", i.driver_version or "", self.hostname), 1)
        for s in State:
            self._set(i, self.state, (s.name,), 1 if s is state else 0)
        self._set(i, self.up, (), 1 if readings is not None else 0)
        if readings is None:
            return
        v, d = readings.values, readings.deltas
        self._set(i, self.unsupported, (), len(readings.unsupported))
        for kind in ECC_KINDS:
            for loc in ("total", "dram", "sram"):
                name = f"ecc.{kind}.volatile.{loc}"
                if name in v:
                    self._inc(i, self.ecc, (kind, loc), d.get(name, 0))
                agg = f"ecc.{kind}.aggregate.{loc}"
                if agg in v:
                    self._set(i, self.ecc_agg, (kind, loc), v[agg])
        for kind, name in (("correctable", "remap.correctable"), ("uncorrectable", "remap.uncorrectable"),
                           ("pending", "remap.pending"), ("failure", "remap.failure")):
            if name in v:
                self._set(i, self.remapped, (kind,), v[name])
        for cause in ("sbe", "dbe", "pending"):
            if f"retired_pages.{cause}" in v:
                self._set(i, self.retired, (cause,), v[f"retired_pages.{cause}"])
        if "pcie.replay" in v:
            self._inc(i, self.pcie_replays, (), d.get("pcie.replay", 0))
        for which in ("current", "max"):
            if f"pcie.gen.{which}" in v:
                self._set(i, self.pcie_gen, (which,), v[f"pcie.gen.{which}"])
            if f"pcie.width.{which}" in v:
                self._set(i, self.pcie_width, (which,), v[f"pcie.width.{which}"])
        for name, value in v.items():
            parts = name.split(".")
            if parts[0] == "nvlink" and len(parts) == 3 and parts[1].isdigit():
                if parts[2] == "state":
                    self._set(i, self.nvlink_up, (parts[1],), 1 if value else 0)
                else:
                    self._inc(i, self.nvlink_errors, (parts[1], parts[2]), d.get(name, 0))
            elif parts[0] == "throttle_ns":
                self._inc(i, self.throttle, (parts[1],), d.get(name, 0) / 1e9)
        if "clocks_event_reasons" in v:
            active = set(readings.clock_events())
            for reason in CLOCK_EVENT_BITS:
                self._set(i, self.clock_event, (reason,), 1 if reason in active else 0)
        for sensor, name in (("gpu", "temp.gpu"), ("memory", "temp.memory")):
            if name in v:
                self._set(i, self.temp, (sensor,), v[name])
        if "power.usage_w" in v:
            self._set(i, self.power, (), v["power.usage_w"])
        if "power.limit_w" in v:
            self._set(i, self.power_limit, (), v["power.limit_w"])
        if "energy.total_j" in v:
            self._inc(i, self.energy, (), d.get("energy.total_j", 0))
        for clock, name in (("sm", "clock.sm_mhz"), ("memory", "clock.mem_mhz")):
            if name in v:
                self._set(i, self.clock, (clock,), v[name] * 1e6)
        if "recovery_action" in v:
            for ra in RecoveryAction:
                self._set(i, self.recovery, (ra.name,), 1 if int(v["recovery_action"]) == ra.value else 0)
        if readings.reset_detected:
            self._inc(i, self.resets, (), 1)

    def forget(self, identity: GpuIdentity) -> None:
        """Remove every series of a GPU that left the node."""
        for metric, extra in self._children.pop(identity.uuid, {}):
            try:
                metric.remove(*self._labels(identity), *extra)  # type: ignore[attr-defined]
            except KeyError:
                pass

    def gpus(self) -> Iterable[str]:
        return list(self._children)
