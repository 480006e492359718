"""`ScenarioBackend`: an `NvmlBackend` driven by a scenario file, for CPU tests and alert rehearsal.

Select it in the agent with `--nvml-scenario FILE`. Scenario time is seconds since the backend was
created, read from the `clock` callable (the agent's monotonic clock; tests pass their own).

Scenario format (JSON; docs/nvml-scenarios.md has examples)::

    {
      "description": "free text",
      "driver_version": "550.90.07",                  # optional
      "unavailable": "libnvidia-ml.so.1 not found",   # optional: behave as if there were no NVML at all
      "gpus": [
        {"uuid": "GPU-...", "pci_bus_id": "00000000:19:00.0", "name": "NVIDIA H200", "serial": "...",
         "nvlink_links": 18,                          # default 18; 0 for none
         "fields": {"temp.gpu": 41},                  # initial values over a healthy H200-like default
         "unsupported": ["retired_pages.*"],          # field names, globs or NVML call names; "xid_events"
                                                      # (no NVML events at all) or "event.<name>" (that one)
         "supported": []}                             # remove defaults from the unsupported set
      ],
      "timeline": [                                   # items in any order; applied when time >= "at"
        {"at": 5,  "gpu": 0, "set": {"remap.pending": 1}},          # gpu: index or UUID
        {"at": 5,  "gpu": 0, "add": {"ecc.corrected.volatile.dram": 3}},
        {"at": 10, "gpu": 0, "rate": {"pcie.replay": 2.5}, "until": 40},   # per second in [at, until)
        {"at": 12, "gpu": 1, "xid": 79},
        {"at": 1, "gpu": 0, "xid": 13, "count": 800000, "until": 61},   # a flood: count XIDs spread evenly
        {"at": 3, "gpu": 0, "event": "sbe_storm"},     # an NVML event (EVENT_TYPES name), "data" optional
        {"at": 12, "gpu": 1, "lost": true},           # fell off the bus: every call raises GpuLost
        {"at": 30, "gpu": 1, "reset": true},          # GPU reset: volatile counters zeroed, pending
                                                      # remap/retirement applied, recovery action NONE,
                                                      # a lost GPU back
        {"at": 3,  "gpu": 0, "unsupported": ["nvmlDeviceGetRemappedRows"]},
        {"at": 8,  "gpu": 0, "supported": ["nvmlDeviceGetRemappedRows"]},
        {"at": 2,  "hang": {"call": "nvmlDeviceGetRemappedRows", "seconds": 3, "gpu": 0, "times": 1}}
      ],
      "agent_faults": [{"at": 5, "freeze_loop": "nvml"}],  # rehearse the agent's watchdog: from `at` on,
                                                          # the agent's nvml loop stops (daemon/watchdog.py)
      "expect": [{"at": 13, "gpu": 1, "state": "FAILED", "reason": "XID 79"}]   # read by the tests only
    }

Counter semantics: adding to a volatile ECC count (`ecc.<kind>.volatile.<dram|sram>`) also adds to its
aggregate twin and to both totals, as the driver does. A hang blocks the first `times` calls (default 1)
of the named NVML call made at or after `at`, for `seconds` of real time (`release_hangs()` ends them
early); call names are those of `probes.nvml_fields.FieldSpec.call`, plus `nvmlDeviceGetCount`,
`nvmlDeviceGetUUID` (identity) and `nvmlEventSetWait_v2` (the XID wait).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from probes.nvml_fields import (
    ECC_LOCATIONS,
    EVENT_TYPES,
    ECC_SCOPES,
    REMAP_HIST_BUCKETS,
    THROTTLE_REASONS,
    FieldSpec,
    field_specs,
    names_matching,
)
from probes.nvml_types import EventFold, FieldNotSupported, GpuIdentity, GpuLost, NvmlError, NvmlUnavailable, RawXid

log = logging.getLogger(__name__)

DEFAULT_UNSUPPORTED = ("retired_pages.*",)  # Hopper answers NotSupported for page retirement
_TIMELINE_KEYS = {"at", "gpu", "set", "add", "rate", "until", "xid", "count", "lost", "reset", "unsupported",
                  "supported", "hang", "event", "data"}


def default_fields(nvlink_links: int) -> dict[str, float]:
    """A healthy, idle H200-like GPU."""
    v: dict[str, float] = {"ecc.enabled": 1}
    for kind in ("corrected", "uncorrected"):
        for scope in ECC_SCOPES:
            for loc in ECC_LOCATIONS:
                v[f"ecc.{kind}.{scope}.{loc}"] = 0
    v.update({"retired_pages.sbe": 0, "retired_pages.dbe": 0, "retired_pages.pending": 0,
              "remap.correctable": 0, "remap.uncorrectable": 0, "remap.pending": 0, "remap.failure": 0,
              "recovery_action": 0, "pcie.replay": 0, "pcie.gen.current": 5, "pcie.gen.max": 5,
              "pcie.width.current": 16, "pcie.width.max": 16, "nvlink.count": nvlink_links,
              "temp.gpu": 38, "temp.memory": 45, "power.usage_w": 120.0, "power.limit_w": 700.0,
              "energy.total_j": 0.0, "clock.sm_mhz": 1980, "clock.mem_mhz": 3201, "clock.sm_max_mhz": 1980,
              "clocks_event_reasons": 0})
    v.update({f"remap.hist.{b}": (640 if b == "max" else 0) for b in REMAP_HIST_BUCKETS})
    v.update({f"throttle_ns.{r}": 0 for r in THROTTLE_REASONS})
    for link in range(nvlink_links):
        v[f"nvlink.{link}.state"] = 1
        for kind in ("replay", "recovery", "crc"):
            v[f"nvlink.{link}.{kind}"] = 0
    return v


class _Gpu:
    def __init__(self, index: int, spec: Mapping[str, Any], driver: str | None) -> None:
        for key in ("uuid", "pci_bus_id"):
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise ValueError(f"scenario gpus[{index}]: '{key}' is required (a non-empty string)")
        links = spec.get("nvlink_links", 18)
        if not isinstance(links, int) or links < 0:
            raise ValueError(f"scenario gpus[{index}]: nvlink_links must be an integer >= 0, got {links!r}")
        self.identity = GpuIdentity(uuid=spec["uuid"], pci_bus_id=spec["pci_bus_id"],
                                    name=spec.get("name", "NVIDIA H200"), index=index,
                                    serial=spec.get("serial"), driver_version=driver)
        self.specs: dict[str, FieldSpec] = field_specs(links)
        self.values = default_fields(links)
        self._set(spec.get("fields", {}), f"gpus[{index}].fields")
        self.unsupported: set[str] = names_matching(DEFAULT_UNSUPPORTED, self.specs)
        self.unsupported |= self._match(spec.get("unsupported", []), f"gpus[{index}].unsupported")
        self.unsupported -= self._match(spec.get("supported", []), f"gpus[{index}].supported")
        self._unsupported_events = set(spec.get("unsupported", []))
        self.lost = False
        self.rates: list[tuple[float, float, dict[str, float]]] = []  # (start, until, per-second)

    def events_supported(self, name: str) -> bool:
        """Whether this GPU delivers NVML event `name` ("xid_events" unsupported: no events at all)."""
        return "xid_events" not in self._unsupported_events and f"event.{name}" not in self._unsupported_events

    def _match(self, patterns: Any, where: str) -> set[str]:
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise ValueError(f"scenario {where}: expected a list of field names/globs/NVML calls")
        pats = [p for p in patterns if p != "xid_events"]
        return names_matching(pats, self.specs)

    def _check(self, name: str, where: str) -> None:
        if name not in self.specs:
            raise ValueError(f"scenario {where}: unknown field {name!r} for GPU {self.identity.uuid} "
                             f"(see probes.nvml_fields.field_specs)")

    def _set(self, fields: Any, where: str) -> None:
        if not isinstance(fields, dict):
            raise ValueError(f"scenario {where}: expected an object of field -> number")
        for name, value in fields.items():
            self._check(name, where)
            if not isinstance(value, (int, float)):
                raise ValueError(f"scenario {where}: {name} must be a number, got {value!r}")
            self.values[name] = value

    def add(self, fields: Mapping[str, float], where: str) -> None:
        for name, n in fields.items():
            self._check(name, where)
            if not isinstance(n, (int, float)):
                raise ValueError(f"scenario {where}: {name} must be a number, got {n!r}")
            for target in _twins(name):
                self.values[target] = self.values.get(target, 0) + n

    def reset(self) -> None:
        for name, spec in self.specs.items():
            if spec.volatile and spec.counter:
                self.values[name] = 0
        for name in ("remap.pending", "retired_pages.pending", "recovery_action"):
            self.values[name] = 0
        self.lost = False

    def read(self, name: str) -> int | float | NvmlError:
        if name not in self.specs:
            return NvmlError(f"unknown field {name}")
        if name in self.unsupported:
            return FieldNotSupported(f"{name}: Not Supported")
        v = self.values.get(name, 0)
        return int(v) if self.specs[name].counter and self.specs[name].unit != "joules" else v


def _twins(name: str) -> list[str]:
    """The counters the driver moves together with `name` (aggregate twin and totals for ECC)."""
    parts = name.split(".")
    if parts[0] != "ecc" or len(parts) != 4:
        return [name]
    _, kind, scope, loc = parts
    scopes = ("volatile", "aggregate") if scope == "volatile" else (scope,)
    locs = (loc, "total") if loc != "total" else ("total",)
    return [f"ecc.{kind}.{s}.{l}" for s in scopes for l in locs]


class ScenarioBackend:
    """`NvmlBackend` over a scenario (see the module docstring). Thread-safe; a hang blocks only the calling
    thread (the XID listener and other GPUs' reads continue)."""

    def __init__(self, scenario: Mapping[str, Any], clock: Callable[[], float] | None = None) -> None:
        if not isinstance(scenario, Mapping):
            raise ValueError("scenario must be a JSON object")
        if scenario.get("unavailable"):
            raise NvmlUnavailable(f"NVML unavailable (scenario): {scenario['unavailable']}")
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._xid_wakeup = threading.Condition(self._lock)
        gpus = scenario.get("gpus")
        if not isinstance(gpus, list) or not gpus:
            raise ValueError("scenario: 'gpus' must be a non-empty list")
        driver = scenario.get("driver_version", "550.90.07")
        self._gpus = [_Gpu(i, g, driver) for i, g in enumerate(gpus)]
        uuids = [g.identity.uuid for g in self._gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"scenario: duplicate GPU UUIDs in {uuids}")
        timeline = scenario.get("timeline", [])
        if not isinstance(timeline, list):
            raise ValueError("scenario: 'timeline' must be a list")
        self._pending = sorted((self._validate(i, item) for i, item in enumerate(timeline)),
                               key=lambda it: (it["at"], it["_order"]))
        self._hangs: list[dict[str, Any]] = []
        self._xids: collections.deque[list[Any]] = collections.deque()   # [event, how many times]
        self._floods: list[list[Any]] = []
        self._xid_open = False
        self._last_t = 0.0
        self._closed = False
        self.description = scenario.get("description", "")
        self._freeze = self._validate_faults(scenario.get("agent_faults", []))

    @classmethod
    def from_file(cls, path: str | Path, clock: Callable[[], float] | None = None) -> "ScenarioBackend":
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError as exc:
            raise ValueError(f"NVML scenario file {p} does not exist") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"NVML scenario file {p} is not valid JSON: {exc}") from exc
        return cls(data, clock=clock)

    # -- scenario time --------------------------------------------------------------------------------------

    def now(self) -> float:
        """Scenario seconds since creation."""
        return self._clock() - self._t0

    @staticmethod
    def _validate_faults(faults: Any) -> dict[str, float]:
        if not isinstance(faults, list):
            raise ValueError("scenario: 'agent_faults' must be a list")
        out = {}
        for i, f in enumerate(faults):
            if not isinstance(f, dict) or set(f) != {"at", "freeze_loop"} or not isinstance(f["freeze_loop"], str) \
                    or not isinstance(f["at"], (int, float)) or f["at"] < 0:
                raise ValueError(f"scenario agent_faults[{i}]: expected {{\"at\": seconds >= 0, \"freeze_loop\": "
                                 f"name}}, got {f!r}")
            out[f["freeze_loop"]] = float(f["at"])
        return out

    def loop_frozen(self, name: str) -> bool:
        """True from the scenario's `freeze_loop` time for `name` on (a rehearsal of the agent's watchdog)."""
        at = self._freeze.get(name)
        return at is not None and self.now() >= at

    def _gpu_ref(self, ref: Any, where: str) -> int:
        if isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < len(self._gpus):
            return ref
        for g in self._gpus:
            if g.identity.uuid == ref:
                return g.identity.index
        raise ValueError(f"scenario {where}: 'gpu' must be an index or a UUID of a listed GPU, got {ref!r}")

    def _validate(self, i: int, item: Any) -> dict[str, Any]:
        where = f"timeline[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"scenario {where}: expected an object")
        unknown = set(item) - _TIMELINE_KEYS
        if unknown:
            raise ValueError(f"scenario {where}: unknown keys {sorted(unknown)}")
        at = item.get("at")
        if not isinstance(at, (int, float)) or at < 0:
            raise ValueError(f"scenario {where}: 'at' must be a number >= 0, got {at!r}")
        out = dict(item, _order=i, _where=where)
        if "hang" in item:
            h = item["hang"]
            if not isinstance(h, dict) or not isinstance(h.get("call"), str):
                raise ValueError(f"scenario {where}: 'hang' needs a 'call' (an NVML function name)")
            if not isinstance(h.get("seconds"), (int, float)) or h["seconds"] <= 0:
                raise ValueError(f"scenario {where}: hang 'seconds' must be a number > 0")
            if "gpu" in h:
                h = dict(h, gpu=self._gpu_ref(h["gpu"], where))
            out["hang"] = dict(h, times=int(h.get("times", 1)))
            return out
        out["gpu"] = self._gpu_ref(item.get("gpu"), where)
        g = self._gpus[out["gpu"]]
        for key in ("set", "add", "rate"):
            if key in item:
                if not isinstance(item[key], dict):
                    raise ValueError(f"scenario {where}: '{key}' must be an object of field -> number")
                for name in item[key]:
                    g._check(name, where)
        if "rate" in item and not isinstance(item.get("until"), (int, float)):
            raise ValueError(f"scenario {where}: 'rate' needs 'until' (seconds)")
        if "xid" in item and (not isinstance(item["xid"], int) or item["xid"] <= 0):
            raise ValueError(f"scenario {where}: 'xid' must be a positive integer")
        if "count" in item and (not isinstance(item["count"], int) or item["count"] < 1 or "xid" not in item
                                or not isinstance(item.get("until"), (int, float)) or item["until"] <= at):
            raise ValueError(f"scenario {where}: 'count' (>= 1) goes with 'xid' and 'until' (> at)")
        if "event" in item and (item["event"] not in EVENT_TYPES or item["event"] == "xid"):
            raise ValueError(f"scenario {where}: 'event' must be one of "
                             f"{sorted(n for n in EVENT_TYPES if n != 'xid')}, got {item.get('event')!r}")
        return out

    def _advance(self) -> None:
        """Apply every timeline item due by now, and the counter rates (call with the lock held)."""
        now = self.now()
        while self._pending and self._pending[0]["at"] <= now:
            item = self._pending.pop(0)
            self._apply_rates(item["at"])
            self._apply(item)
        self._apply_rates(now)

    def _apply_floods(self, t: float) -> None:
        """Queue the XIDs of each flood due by `t` as runs (one queue entry per run, not per XID)."""
        for fl in self._floods:
            g, xid, start, until, count, done = fl
            due = count if t >= until else int(count * max(0.0, t - start) / (until - start))
            if due > done and self._xid_open and g.events_supported("xid"):
                self._xids.append([RawXid(g.identity.uuid, xid), due - done])
                self._xid_wakeup.notify_all()
            fl[5] = max(done, due)

    def _apply_rates(self, t: float) -> None:
        self._apply_floods(t)
        if t <= self._last_t:
            return
        for g in self._gpus:
            for start, until, per_s in g.rates:
                span = min(t, until) - max(self._last_t, start)
                if span > 0:
                    g.add({k: v * span for k, v in per_s.items()}, "rate")
        self._last_t = t

    def _apply(self, item: dict[str, Any]) -> None:
        where = item["_where"]
        if "hang" in item:
            self._hangs.append(dict(item["hang"]))
            return
        g = self._gpus[item["gpu"]]
        if "set" in item:
            g._set(item["set"], where)
        if "add" in item:
            g.add(item["add"], where)
        if "rate" in item:
            g.rates.append((item["at"], float(item["until"]), dict(item["rate"])))
        if "unsupported" in item:
            g.unsupported |= g._match(item["unsupported"], where)
        if "supported" in item:
            g.unsupported -= g._match(item["supported"], where)
        if item.get("reset"):
            g.reset()
        if item.get("lost"):
            g.lost = True
        if "xid" in item and "count" in item:
            self._floods.append([g, int(item["xid"]), float(item["at"]), float(item["until"]), int(item["count"]), 0])
        elif "xid" in item and self._xid_open and g.events_supported("xid"):
            self._xids.append([RawXid(g.identity.uuid, int(item["xid"])), 1])
            self._xid_wakeup.notify_all()
        if "event" in item and self._xid_open and g.events_supported(item["event"]):
            self._xids.append([RawXid(g.identity.uuid, int(item.get("data", 0)), event=item["event"]), 1])
            self._xid_wakeup.notify_all()

    def _maybe_hang(self, calls: set[str], index: int | None) -> None:
        """Block (outside the lock) if a due hang names one of `calls`."""
        with self._lock:
            self._advance()
            hang = None
            for h in self._hangs:
                if h["times"] > 0 and h["call"] in calls and h.get("gpu", index) == index:
                    h["times"] -= 1
                    hang = h
                    break
        if hang is not None:
            log.info("scenario: hanging %s for %.1fs", hang["call"], hang["seconds"])
            self._release.wait(hang["seconds"])

    def release_hangs(self) -> None:
        """End every current and future hang immediately (tests, shutdown)."""
        self._release.set()

    # -- protocol -------------------------------------------------------------------------------------------

    def _live(self) -> None:
        if self._closed:
            raise NvmlError("backend is closed")

    def device_count(self) -> int:
        self._live()
        self._maybe_hang({"nvmlDeviceGetCount"}, None)
        return len(self._gpus)

    def identity(self, index: int) -> GpuIdentity:
        self._live()
        self._maybe_hang({"nvmlDeviceGetUUID"}, index)
        with self._lock:
            g = self._gpu(index)
            if g.lost:
                raise GpuLost(f"GPU {g.identity.uuid}: GPU is lost")
            return g.identity

    def _gpu(self, index: int) -> _Gpu:
        if not 0 <= index < len(self._gpus):
            raise NvmlError(f"no GPU at index {index}", code=2)
        return self._gpus[index]

    def read_fields(self, index: int, names: Sequence[str]) -> dict[str, int | float | NvmlError]:
        self._live()
        g = self._gpu(index)
        self._maybe_hang({g.specs[n].call for n in names if n in g.specs}, index)
        with self._lock:
            self._advance()
            if g.lost:
                raise GpuLost(f"GPU {g.identity.uuid}: GPU is lost")
            return {n: g.read(n) for n in names}

    def xid_open(self) -> list[int]:
        self._live()
        with self._lock:
            self._xid_open = True
            self._advance()
            return {g.identity.index: [n for n in EVENT_TYPES if g.events_supported(n)] for g in self._gpus
                    if g.events_supported("xid")}

    def xid_wait(self, timeout_ms: int) -> RawXid | None:
        self._live()
        if not self._xid_open:
            raise NvmlError("xid_wait before xid_open")
        if not self._xids:   # draining a queue does not wait (nor does NVML's event set with events queued)
            self._maybe_hang({"nvmlEventSetWait_v2"}, None)
        with self._lock:
            if not self._xids:   # a queue being drained is not re-timed per event (a flood's cost stays ours)
                self._advance()
            if not self._xids and timeout_ms > 0:
                self._xid_wakeup.wait(min(timeout_ms, 50) / 1000.0)
                self._advance()
            if not self._xids:
                return None
            head = self._xids[0]
            head[1] -= 1
            if head[1] <= 0:
                self._xids.popleft()
            return head[0]

    def xid_drain(self, max_events: int) -> list[RawXid]:
        """What is queued now, whole runs at a time (a run of 800,000 repeats is one entry, as the real
        backend's fold makes it), at most `max_events` events."""
        self._live()
        if not self._xid_open:
            raise NvmlError("xid_drain before xid_open")
        fold = EventFold()
        left = max_events
        with self._lock:
            self._advance()
            while self._xids and left > 0:
                head = self._xids[0]
                n = min(head[1], left)
                fold.add((dataclasses.replace(head[0], count=n),))
                left -= n
                head[1] -= n
                if head[1] <= 0:
                    self._xids.popleft()
        return fold.take()

    def xid_close(self) -> None:
        with self._lock:
            self._xid_open = False
            self._xids.clear()

    def close(self) -> None:
        self.release_hangs()
        self._closed = True
