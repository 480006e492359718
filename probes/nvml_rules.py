"""Pure rules over NVML readings: counter deltas, rate windows, and the evidence each signal implies.

Everything here takes (previous reading, current reading, now, config) and returns values; no NVML, no
clock. `make_readings` turns one poll's raw field values into a `GpuReadings` (deltas that survive a GPU
reset, rate windows); `evaluate` applies every rule and returns evidence (source 'nvml') and findings.

Rules (see docs/gpu-state-rules.md for the states):
- ECC: any increase of the volatile uncorrected count -> 'ecc.uncorrected' DEGRADED; corrected errors
  >= `sbe_storm_count` within `sbe_window_s` -> 'ecc.sbe_storm' SUSPECT (DCGM ignores these).
- Row remapping: failure -> FAILED, pending -> DEGRADED; page retirement pending -> DEGRADED.
- Recovery action field: mapped by the XID catalog.
- PCIe: replays within `pcie_window_s` above `pcie_replay_threshold(gen, width)`, a link trained narrower
  than its maximum width.
- NVLink: per link CRC / replay / recovery errors within `nvlink_window_s` above thresholds; a link that
  was up at the first reading and is now down.
- Thermal / power: clock-event reasons with a thermal or power-brake slowdown, or slowdown time of at
  least `throttle_fraction` of the poll interval.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

from probes import xid_catalog
from probes.nvml_fields import ECC_KINDS, NVLINK_KINDS, spec_for
from sdcwatch import event_kinds as ek
from sdcwatch.types import Evidence, Finding, Severity, State

SOURCE = "nvml"

# nvmlClocksEventReason* bits (nvml.h)
CLOCK_EVENT_BITS: dict[str, int] = {
    "gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
    "sync_boost": 0x10, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80, "display_clock_setting": 0x100,
}
SLOWDOWN_BITS = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
SLOWDOWN_THROTTLE_NS = ("thermal", "sw_thermal", "hw_thermal", "hw_power_brake")
PCIE_GTPS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


@dataclasses.dataclass(kw_only=True, slots=True)
class RuleConfig:
    sbe_storm_count: int = 10
    sbe_window_s: float = 3600.0
    pcie_window_s: float = 60.0
    pcie_ber_budget: float = 2.5e-13
    pcie_min_replays: float = 2.0
    nvlink_window_s: float = 60.0
    nvlink_crc_max: int = 100
    nvlink_replay_max: int = 10
    nvlink_recovery_max: int = 0
    throttle_fraction: float = 0.1
    throttle_hold_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("sbe_window_s", "pcie_window_s", "nvlink_window_s", "throttle_hold_s", "pcie_ber_budget"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RuleConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.sbe_storm_count < 1:
            raise ValueError(f"RuleConfig.sbe_storm_count must be >= 1, got {self.sbe_storm_count}")
        for name in ("nvlink_crc_max", "nvlink_replay_max", "nvlink_recovery_max", "pcie_min_replays"):
            if getattr(self, name) < 0:
                raise ValueError(f"RuleConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.throttle_fraction <= 1:
            raise ValueError(f"RuleConfig.throttle_fraction must be in (0, 1], got {self.throttle_fraction}")

    def nvlink_max(self, kind: str) -> int:
        return {"crc": self.nvlink_crc_max, "replay": self.nvlink_replay_max,
                "recovery": self.nvlink_recovery_max}[kind]


@dataclasses.dataclass(frozen=True, slots=True)
class RateWindow:
    """Counts seen in the last `span_s` seconds, as (time, count) pairs. Immutable: `add` returns a new one."""

    span_s: float
    events: tuple[tuple[float, float], ...] = ()

    def add(self, now: float, n: float) -> "RateWindow":
        kept = tuple(e for e in self.events if e[0] > now - self.span_s)
        if n > 0:
            kept += ((now, n),)
        return RateWindow(self.span_s, kept)

    def total(self, now: float) -> float:
        return sum(n for t, n in self.events if t > now - self.span_s)

    def at_most_from(self, limit: float) -> float:
        """When the total drops to <= limit if nothing new arrives (the expiry of a rate verdict)."""
        remaining = sum(n for _, n in self.events)
        for t, n in self.events:
            if remaining <= limit:
                break
            remaining -= n
            if remaining <= limit:
                return t + self.span_s
        return self.events[0][0] + self.span_s if self.events else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class GpuReadings:
    """One poll of one GPU: raw values, counter deltas since the previous poll (never negative; a counter
    that went down was reset and its delta is its new value), unsupported fields, per-field errors, and the
    rate windows the rules use. Metrics are built from this."""

    uuid: str
    time: float
    values: Mapping[str, int | float]
    deltas: Mapping[str, int | float]
    unsupported: frozenset[str]
    errors: Mapping[str, str]
    reset_detected: bool
    interval_s: float | None
    windows: Mapping[str, RateWindow]
    nvlink_baseline: frozenset[int]
    # When each value was last read from the GPU (the probe reads some fields in rotation and carries
    # their last answer between reads), and, for counters read this poll, the seconds since their previous
    # read: the span their delta covers.
    read_time: Mapping[str, float] = dataclasses.field(default_factory=dict)
    field_interval_s: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def get(self, name: str) -> int | float | None:
        return self.values.get(name)

    @property
    def temperature_c(self) -> float | None:
        return self.values.get("temp.gpu")

    @property
    def power_w(self) -> float | None:
        return self.values.get("power.usage_w")

    @property
    def nvlink_links(self) -> list[int]:
        return sorted({nv[0] for nv in map(nvlink_field, self.values) if nv is not None})

    def clock_events(self) -> list[str]:
        """Names of the active clock-event (throttle) reasons."""
        mask = self.values.get("clocks_event_reasons")
        if mask is None:
            return []
        return [n for n, bit in CLOCK_EVENT_BITS.items() if int(mask) & bit]


@dataclasses.dataclass(frozen=True, slots=True)
class RuleOutput:
    evidence: list[Evidence]
    findings: list[Finding]


# ----------------------------------------------------------------------------------------------------------
# Readings
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8192)
def nvlink_field(name: str) -> tuple[int, str] | None:
    """(link, kind) for `nvlink.<link>.<kind>` (kind: state, replay, recovery, crc), else None. Cached: a poll
    asks this of every field name, every second."""
    if not name.startswith("nvlink."):
        return None
    parts = name.split(".")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2]


@functools.lru_cache(maxsize=8192)
def _traits(name: str) -> tuple[bool, bool, tuple[int, str] | None]:
    """(counter, volatile, NVLink (link, kind) or None) of a field name."""
    spec = spec_for(name)
    return spec.counter, spec.volatile, nvlink_field(name)


def _ecc_sum(values: Mapping[str, int | float], deltas: Mapping[str, int | float], kind: str
             ) -> tuple[bool, float]:
    """(readable, delta) of the volatile count of one ECC kind: the total, else DRAM + SRAM."""
    total = f"ecc.{kind}.volatile.total"
    if total in values:
        return True, deltas.get(total, 0)
    parts = [f"ecc.{kind}.volatile.{loc}" for loc in ("dram", "sram")]
    if any(p in values for p in parts):
        return True, sum(deltas.get(p, 0) for p in parts)
    agg = f"ecc.{kind}.aggregate.total"
    if agg in values:
        return True, deltas.get(agg, 0)
    return False, 0


def make_readings(uuid: str, prev: GpuReadings | None, values: Mapping[str, int | float],
                  unsupported: frozenset[str], errors: Mapping[str, str], now: float,
                  cfg: RuleConfig, fresh: frozenset[str] | None = None) -> GpuReadings:
    """Build this poll's readings from raw values and the previous readings (pure).

    `fresh`: the names read from the GPU this poll (None: all of them); the others carry their last
    answer, so their counters do not move and keep their read time."""
    deltas: dict[str, int | float] = {}
    reset = False
    pvals = prev.values if prev is not None else {}
    ptimes = prev.read_time if prev is not None else {}
    pw = prev.windows if prev is not None else {}
    ptime = prev.time if prev is not None else None
    read_time: dict[str, float] = {}
    field_interval: dict[str, float] = {}
    windows: dict[str, RateWindow] = {}
    up: list[int] = []
    for name, value in values.items():  # one pass: a poll sees ~120 fields (18 NVLink links), every second
        counter, volatile, nv = _traits(name)
        is_fresh = fresh is None or name in fresh
        read_time[name] = now if is_fresh else ptimes.get(name, now)
        if counter and name in pvals:
            if not is_fresh:
                deltas[name] = 0
            else:
                since = ptimes.get(name, ptime)
                if since is not None and now > since:
                    field_interval[name] = now - since
                d = value - pvals[name]
                if d < 0:
                    if volatile:
                        reset = True
                    d = value
                deltas[name] = d
        if nv is None:
            continue
        if nv[1] == "state":
            if value:
                up.append(nv[0])
        elif nv[1] in NVLINK_KINDS:
            old = pw.get(name)
            if old is not None and not is_fresh and not old.events:
                windows[name] = old  # carried, nothing to expire: no new window object
            else:
                windows[name] = (old or RateWindow(cfg.nvlink_window_s)).add(now, deltas.get(name, 0))
    # A reset that zeroed volatile counters which were already zero is invisible in counters; the recovery
    # action going back to NONE after asking for a reset is the other trace it leaves.
    if prev is not None and pvals.get("recovery_action") in (1, 4, 6) and values.get("recovery_action") == 0:
        reset = True
    ok, corrected = _ecc_sum(values, deltas, "corrected")
    if ok:
        windows["ecc.corrected"] = pw.get("ecc.corrected", RateWindow(cfg.sbe_window_s)).add(now, corrected)
    if "pcie.replay" in values:
        windows["pcie.replay"] = pw.get("pcie.replay", RateWindow(cfg.pcie_window_s)).add(
            now, deltas.get("pcie.replay", 0))
    up_now = frozenset(up)
    baseline = prev.nvlink_baseline if prev is not None and prev.nvlink_baseline else up_now
    return GpuReadings(
        uuid=uuid, time=now, values=dict(values), deltas=deltas, unsupported=frozenset(unsupported),
        errors=dict(errors), reset_detected=reset,
        interval_s=(now - prev.time) if prev is not None else None, windows=windows,
        nvlink_baseline=baseline, read_time=read_time, field_interval_s=field_interval)


# ----------------------------------------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------------------------------------


def pcie_replay_threshold(gen: int | None, width: int | None, window_s: float, cfg: RuleConfig) -> float:
    """Replays allowed per window for a link: the bit-error budget times the link's raw bit rate.

    With the default budget (a quarter of PCIe's 1e-12 BER target) a Gen5 x16 link allows ~7.7 replays per
    minute (DCGM warns at 8/min), Gen4 x16 ~3.8; never below `pcie_min_replays`."""
    gtps = PCIE_GTPS.get(int(gen) if gen else 5, 32.0)
    lanes = int(width) if width else 16
    return max(cfg.pcie_min_replays, cfg.pcie_ber_budget * gtps * 1e9 * lanes * window_s)


def _ev(signal: str, value: object, implies: State, reason: str, now: float,
        expires: float | None = None) -> Evidence:
    return Evidence(SOURCE, signal, str(value), implies, reason, now, expires=expires)


def _jump_severity(name: str) -> Severity:
    if name.startswith("ecc.uncorrected") or name == "remap.uncorrectable" or name == "retired_pages.dbe":
        return Severity.CRITICAL
    if name.startswith(("remap.", "retired_pages.", "nvlink.")):
        return Severity.WARNING
    return Severity.INFO


def counter_jumps(cur: GpuReadings) -> list[Finding]:
    """One finding per counter that moved (ECC aggregate only where its volatile twin is not read)."""
    out: list[Finding] = []
    for name, d in sorted(cur.deltas.items()):
        if d <= 0 or name.startswith(("energy.", "throttle_ns.")):
            continue
        if ".aggregate." in name and name.replace(".aggregate.", ".volatile.") in cur.values:
            continue
        out.append(Finding(ek.GPU_COUNTER_JUMP, _jump_severity(name), f"gpu/{cur.uuid}",
                           f"{name} +{d:g} (now {cur.values[name]:g})",
                           {"field": name, "delta": d, "value": cur.values[name]}))
    return out


def ecc_rules(prev: GpuReadings | None, cur: GpuReadings, now: float, cfg: RuleConfig) -> list[Evidence]:
    out: list[Evidence] = []
    ok, unc = _ecc_sum(cur.values, cur.deltas, "uncorrected")
    if ok and unc > 0:
        out.append(_ev("ecc.uncorrected", unc, State.DEGRADED,
                       f"uncorrected ECC errors +{unc:g} since the previous poll", now))
    win = cur.windows.get("ecc.corrected")
    if win is not None:
        n = win.total(now)
        if n >= cfg.sbe_storm_count:
            out.append(_ev("ecc.sbe_storm", n, State.SUSPECT,
                           f"correctable ECC storm: {n:g} corrected errors in the last "
                           f"{cfg.sbe_window_s:g}s (threshold {cfg.sbe_storm_count})", now,
                           expires=win.at_most_from(cfg.sbe_storm_count - 1)))
    return out


def memory_repair_rules(prev: GpuReadings | None, cur: GpuReadings, now: float,
                        cfg: RuleConfig) -> list[Evidence]:
    out: list[Evidence] = []
    v = cur.values
    if "remap.failure" in v:
        bad = bool(v["remap.failure"])
        out.append(_ev("remap.failure", int(bad), State.FAILED if bad else State.HEALTHY,
                       "row remapping failed: no spare rows left (RMA)" if bad else "row remapping ok", now))
    if "remap.pending" in v:
        bad = bool(v["remap.pending"])
        out.append(_ev("remap.pending", int(bad), State.DEGRADED if bad else State.HEALTHY,
                       "row remap pending: reset the GPU to apply it" if bad else "no row remap pending", now))
    if "retired_pages.pending" in v:
        bad = bool(v["retired_pages.pending"])
        out.append(_ev("retired_pages.pending", int(bad), State.DEGRADED if bad else State.HEALTHY,
                       "page retirement pending: reset the GPU to apply it" if bad
                       else "no page retirement pending", now))
    if "recovery_action" in v:
        name, action, state = xid_catalog.recovery_action(int(v["recovery_action"]))
        reason = (f"driver recovery action {name}: {action.value}" if state is not State.HEALTHY
                  else "driver recovery action NONE")
        out.append(_ev("recovery_action", name, state, reason, now))
    return out


def pcie_rules(prev: GpuReadings | None, cur: GpuReadings, now: float, cfg: RuleConfig) -> list[Evidence]:
    out: list[Evidence] = []
    v = cur.values
    gen = v.get("pcie.gen.current") or v.get("pcie.gen.max")
    width = v.get("pcie.width.current") or v.get("pcie.width.max")
    win = cur.windows.get("pcie.replay")
    if win is not None:
        n = win.total(now)
        thr = pcie_replay_threshold(int(gen) if gen else None, int(width) if width else None,
                                    cfg.pcie_window_s, cfg)
        if n > thr:
            out.append(_ev("pcie.replay_rate", n, State.SUSPECT,
                           f"PCIe replays: {n:g} in the last {cfg.pcie_window_s:g}s on a Gen{gen or '?'} "
                           f"x{width or '?'} link (threshold {thr:.1f})", now, expires=win.at_most_from(thr)))
    cw, mw = v.get("pcie.width.current"), v.get("pcie.width.max")
    if cw and mw:
        narrow = cw < mw
        out.append(_ev("pcie.link_width", f"x{cw:g}/x{mw:g}", State.SUSPECT if narrow else State.HEALTHY,
                       f"PCIe link trained at x{cw:g} of x{mw:g}" if narrow else "PCIe link at full width", now))
    return out


def nvlink_rules(prev: GpuReadings | None, cur: GpuReadings, now: float, cfg: RuleConfig) -> list[Evidence]:
    out: list[Evidence] = []
    states = {}
    for k, v in cur.values.items():
        nv = nvlink_field(k)
        if nv is not None and nv[1] == "state":
            states[nv[0]] = v
    if states:
        down = sorted(link for link in cur.nvlink_baseline if not states.get(link, 0))
        out.append(_ev("nvlink.down", ",".join(map(str, down)) or "none",
                       State.DEGRADED if down else State.HEALTHY,
                       f"NVLink link(s) {', '.join(map(str, down))} down (were up)" if down
                       else f"{sum(1 for s in states.values() if s)} NVLink links up", now))
    over: list[str] = []
    expires = now
    busy = [(name, win) for name, win in cur.windows.items() if win.events and name.startswith("nvlink.")]
    for name, win in sorted(busy, key=lambda kv: _link_order(kv[0])):
        parts = name.split(".")
        if parts[0] != "nvlink":
            continue
        n = win.total(now)
        if n > cfg.nvlink_max(parts[2]):
            over.append(f"link {parts[1]} {parts[2]} {n:g}")
            expires = max(expires, win.at_most_from(cfg.nvlink_max(parts[2])))
    if over:
        out.append(_ev("nvlink.errors", len(over), State.SUSPECT,
                       f"NVLink errors in the last {cfg.nvlink_window_s:g}s: " + ", ".join(over), now,
                       expires=expires))
    return out


def _link_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1, name)


def thermal_rules(prev: GpuReadings | None, cur: GpuReadings, now: float, cfg: RuleConfig) -> list[Evidence]:
    causes = [r for r in cur.clock_events() if r in SLOWDOWN_BITS]
    for r in SLOWDOWN_THROTTLE_NS:
        name = f"throttle_ns.{r}"
        d = cur.deltas.get(name, 0)
        span = cur.field_interval_s.get(name) or cur.interval_s  # the time this counter's delta covers
        if d and span and d / (span * 1e9) >= cfg.throttle_fraction:
            causes.append(f"{r} {100 * d / (span * 1e9):.0f}% of the last {span:.0f}s")
    if not causes:
        return []
    temp = cur.values.get("temp.gpu")
    return [_ev("thermal", ",".join(causes), State.SUSPECT,
                f"clock slowdown: {', '.join(causes)}" + (f" at {temp:g} C" if temp is not None else ""), now,
                expires=now + cfg.throttle_hold_s)]


RULE_FUNCTIONS = (ecc_rules, memory_repair_rules, pcie_rules, nvlink_rules, thermal_rules)


def evaluate(prev: GpuReadings | None, cur: GpuReadings, now: float, cfg: RuleConfig) -> RuleOutput:
    """Every rule over one GPU's readings: evidence (source 'nvml') and findings (counter jumps, reset)."""
    evidence: list[Evidence] = []
    for rule in RULE_FUNCTIONS:
        evidence.extend(rule(prev, cur, now, cfg))
    findings = counter_jumps(cur)
    if cur.reset_detected:
        evidence.append(_ev("gpu_reset", now, State.HEALTHY, "GPU reset seen: volatile counters went down", now))
        findings.append(Finding(ek.GPU_RESET_DETECTED, Severity.WARNING, f"gpu/{cur.uuid}",
                                "GPU reset detected (volatile counters cleared)", {}))
    return RuleOutput(evidence, findings)


__all__ = ["RuleConfig", "RateWindow", "GpuReadings", "RuleOutput", "make_readings", "evaluate",
           "pcie_replay_threshold", "counter_jumps", "ecc_rules", "memory_repair_rules", "pcie_rules",
           "nvlink_rules", "thermal_rules", "CLOCK_EVENT_BITS", "ECC_KINDS"]
