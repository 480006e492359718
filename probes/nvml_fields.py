"""The NVML field catalogue: every GPU reading sdcwatch takes, by name, and how the real backend reads it.

Pure data and lookups (no NVML, no I/O), shared by both backends (`probes.nvml_backend.PynvmlBackend`,
`probes.nvml_fake.ScenarioBackend`), the probe, the rules (`probes.nvml_rules`) and the agent's metrics.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any, Iterable

@dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    """One readable field. `call` is the NVML function that reads it (what a scenario hangs or marks
    unsupported); `args`/`pick`/`scale` tell the real backend how. `counter`: monotonic, read as deltas;
    `volatile`: zeroed by a GPU reset."""

    name: str
    call: str
    args: tuple[Any, ...] = ()
    pick: int | str | None = None
    scale: float = 1.0
    counter: bool = False
    volatile: bool = False
    unit: str = ""


ECC_KINDS = ("corrected", "uncorrected")
ECC_SCOPES = ("volatile", "aggregate")
ECC_LOCATIONS = ("total", "dram", "sram")
NVLINK_KINDS = ("replay", "recovery", "crc")
THROTTLE_REASONS = (
    "sw_power_cap", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability",
    "sw_thermal", "hw_thermal", "hw_power_brake",
)
REMAP_HIST_BUCKETS = ("max", "high", "partial", "low", "none")

# NVML constants (values from nvml.h / nvidia-ml-py; kept here so the fake needs no pynvml import).
_MEMORY_ERROR_TYPE = {"corrected": 0, "uncorrected": 1}
_ECC_COUNTER_TYPE = {"volatile": 0, "aggregate": 1}
_MEMORY_LOCATION = {"dram": 2, "sram": 7}
_FI_GET_GPU_RECOVERY_ACTION = 230
_FI_NVLINK_LINK_COUNT = 91
_FI_NVLINK_ERROR_DL = {"replay": 161, "recovery": 162, "crc": 163}
_FI_NVLINK_GET_STATE = 165
_FI_MEMORY_TEMP = 82
_FI_TOTAL_ENERGY_CONSUMPTION = 83
_FI_THROTTLE = {
    "sw_power_cap": 74, "thermal": 75, "sync_boost": 76, "board_limit": 77, "low_utilization": 78,
    "reliability": 79, "sw_thermal": 269, "hw_thermal": 270, "hw_power_brake": 271,
}
_TEMPERATURE_GPU = 0
_CLOCK_SM = 1
_CLOCK_MEM = 2
_PAGE_RETIREMENT_CAUSE = {"sbe": 0, "dbe": 1}
FIELD_VALUES_CALL = "nvmlDeviceGetFieldValues"


def _base_specs() -> list[FieldSpec]:
    specs: list[FieldSpec] = [FieldSpec("ecc.enabled", "nvmlDeviceGetEccMode", pick=0)]
    for kind in ECC_KINDS:
        for scope in ECC_SCOPES:
            volatile = scope == "volatile"
            specs.append(FieldSpec(
                f"ecc.{kind}.{scope}.total", "nvmlDeviceGetTotalEccErrors",
                (_MEMORY_ERROR_TYPE[kind], _ECC_COUNTER_TYPE[scope]), counter=True, volatile=volatile,
                unit="errors"))
            for loc, loc_id in _MEMORY_LOCATION.items():
                specs.append(FieldSpec(
                    f"ecc.{kind}.{scope}.{loc}", "nvmlDeviceGetMemoryErrorCounter",
                    (_MEMORY_ERROR_TYPE[kind], _ECC_COUNTER_TYPE[scope], loc_id), counter=True,
                    volatile=volatile, unit="errors"))
    specs += [
        FieldSpec("retired_pages.sbe", "nvmlDeviceGetRetiredPages", (_PAGE_RETIREMENT_CAUSE["sbe"],),
                  pick="len", counter=True, unit="pages"),
        FieldSpec("retired_pages.dbe", "nvmlDeviceGetRetiredPages", (_PAGE_RETIREMENT_CAUSE["dbe"],),
                  pick="len", counter=True, unit="pages"),
        FieldSpec("retired_pages.pending", "nvmlDeviceGetRetiredPagesPendingStatus", volatile=True),
        FieldSpec("remap.correctable", "nvmlDeviceGetRemappedRows", pick=0, counter=True, unit="rows"),
        FieldSpec("remap.uncorrectable", "nvmlDeviceGetRemappedRows", pick=1, counter=True, unit="rows"),
        FieldSpec("remap.pending", "nvmlDeviceGetRemappedRows", pick=2, volatile=True),
        FieldSpec("remap.failure", "nvmlDeviceGetRemappedRows", pick=3),
    ]
    specs += [FieldSpec(f"remap.hist.{b}", "nvmlDeviceGetRowRemapperHistogram", pick=b, unit="banks")
              for b in REMAP_HIST_BUCKETS]
    specs += [
        FieldSpec("recovery_action", FIELD_VALUES_CALL, (_FI_GET_GPU_RECOVERY_ACTION, 0), volatile=True),
        FieldSpec("pcie.replay", "nvmlDeviceGetPcieReplayCounter", counter=True, volatile=True,
                  unit="replays"),
        FieldSpec("pcie.gen.current", "nvmlDeviceGetCurrPcieLinkGeneration"),
        FieldSpec("pcie.gen.max", "nvmlDeviceGetMaxPcieLinkGeneration"),
        FieldSpec("pcie.width.current", "nvmlDeviceGetCurrPcieLinkWidth", unit="lanes"),
        FieldSpec("pcie.width.max", "nvmlDeviceGetMaxPcieLinkWidth", unit="lanes"),
        FieldSpec("nvlink.count", FIELD_VALUES_CALL, (_FI_NVLINK_LINK_COUNT, 0), unit="links"),
        FieldSpec("temp.gpu", "nvmlDeviceGetTemperature", (_TEMPERATURE_GPU,), unit="celsius"),
        FieldSpec("temp.memory", FIELD_VALUES_CALL, (_FI_MEMORY_TEMP, 0), unit="celsius"),
        FieldSpec("power.usage_w", "nvmlDeviceGetPowerUsage", scale=1e-3, unit="watts"),
        FieldSpec("power.limit_w", "nvmlDeviceGetEnforcedPowerLimit", scale=1e-3, unit="watts"),
        FieldSpec("energy.total_j", FIELD_VALUES_CALL, (_FI_TOTAL_ENERGY_CONSUMPTION, 0), scale=1e-3,
                  counter=True, unit="joules"),
        FieldSpec("clock.sm_mhz", "nvmlDeviceGetClockInfo", (_CLOCK_SM,), unit="MHz"),
        FieldSpec("clock.mem_mhz", "nvmlDeviceGetClockInfo", (_CLOCK_MEM,), unit="MHz"),
        FieldSpec("clock.sm_max_mhz", "nvmlDeviceGetMaxClockInfo", (_CLOCK_SM,), unit="MHz"),
        FieldSpec("clocks_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", unit="bitmask"),
    ]
    specs += [FieldSpec(f"throttle_ns.{r}", FIELD_VALUES_CALL, (fid, 0), counter=True, unit="ns")
              for r, fid in _FI_THROTTLE.items()]
    return specs


def _nvlink_specs(links: int) -> list[FieldSpec]:
    out: list[FieldSpec] = []
    for link in range(links):
        out.append(FieldSpec(f"nvlink.{link}.state", FIELD_VALUES_CALL, (_FI_NVLINK_GET_STATE, link)))
        for kind in NVLINK_KINDS:
            out.append(FieldSpec(f"nvlink.{link}.{kind}", FIELD_VALUES_CALL, (_FI_NVLINK_ERROR_DL[kind], link),
                                 counter=True, volatile=True, unit="errors"))
    return out


_BASE = {s.name: s for s in _base_specs()}


def field_specs(nvlink_links: int = 0) -> dict[str, FieldSpec]:
    """Every field sdcwatch reads, by name; NVLink fields for links 0..nvlink_links-1."""
    if nvlink_links < 0:
        raise ValueError(f"nvlink_links must be >= 0, got {nvlink_links}")
    out = dict(_BASE)
    out.update({s.name: s for s in _nvlink_specs(nvlink_links)})
    return out


@functools.lru_cache(maxsize=4096)
@functools.lru_cache(maxsize=8192)
def spec_for(name: str) -> FieldSpec:
    """The spec of one field name (NVLink names for any link number). Cached: the rules ask it of every
    field of every poll."""
    if name in _BASE:
        return _BASE[name]
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "nvlink" and parts[1].isdigit():
        link = int(parts[1])
        for s in _nvlink_specs(link + 1)[-(1 + len(NVLINK_KINDS)):]:
            if s.name == name:
                return s
    raise ValueError(f"unknown NVML field name {name!r}")


def names_matching(patterns: Iterable[str], names: Iterable[str]) -> set[str]:
    """Field names matched by patterns: an exact name, a glob (`retired_pages.*`) or an NVML call name."""
    pats = list(patterns)
    out: set[str] = set()
    for n in names:
        call = spec_for(n).call
        if any(fnmatch.fnmatchcase(n, p) or p == call for p in pats):
            out.add(n)
    return out


#: The NVML event types the agent registers where the GPU supports them (nvmlDeviceGetSupportedEventTypes),
#: name -> nvmlEventType bit. Not the per-error single-bit ECC event (0x1): under a storm of 20,000 corrected
#: errors a second it would be 20,000 events a second; the driver's storm event says the same once.
EVENT_TYPES: dict[str, int] = {
    "xid": 0x8,                          # nvmlEventTypeXidCriticalError
    "sbe_storm": 0x200,                  # nvmlEventTypeSingleBitEccErrorStorm
    "dram_retirement": 0x400,            # nvmlEventTypeDramRetirementEvent
    "dram_retirement_failure": 0x800,    # nvmlEventTypeDramRetirementFailure
    "poison_nonfatal": 0x1000,           # nvmlEventTypeNonFatalPoisonError (contained)
    "poison_fatal": 0x2000,              # nvmlEventTypeFatalPoisonError
    "gpu_unavailable": 0x4000,           # nvmlEventTypeGpuUnavailableError
    "recovery_action": 0x8000,           # nvmlEventTypeGpuRecoveryAction
}
