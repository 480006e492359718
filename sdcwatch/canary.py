"""Canary result values, shared by the code that runs canaries and the agent that reads their results.

Torch-free: the canary kernels (checksums.canary_gemm, probes.canary_*) run in the training job or in the
agent's canary child process, while the agent itself and `sdcwatch canary` only read these values: a suite's
report crosses the child's pipe as JSON (`SuiteReport.to_json` / `SuiteReport.from_json`) and is judged here
(`device_status`, `evidence_by_device`, `exit_code`). A `DeviceInfo.device` is a torch device string
("cuda:0", "cpu"); code that runs kernels turns it into `torch.device(info.device)`.
"""
from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any, Mapping, Sequence

from sdcwatch.types import Evidence, State

LEVELS = ("tiny", "quick", "full")
ALL_DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
# checks whose failure is wrong data, not slowness
SDC_CHECKS = ("gemm", "gemm_sm", "random", "h2d", "p2p", "allreduce")


class Status(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    UNKNOWN = "UNKNOWN"


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One device the canary runs on. `label` names it in reports (the GPU UUID on CUDA)."""

    label: str
    device: str                   # torch device string: "cuda:0", "cpu"
    index: int = -1
    uuid: str = ""
    name: str = ""


@dataclasses.dataclass(slots=True)
class CheckResult:
    """One canary check: PASS, FAIL (with evidence in `details`) or UNKNOWN (with `why`)."""

    check: str                    # gemm | random | determinism | h2d | p2p | allreduce | slow
    name: str                     # e.g. "gemm/bf16/large/4096x4096x4096"
    status: Status
    devices: tuple[str, ...]      # device labels involved (one GPU, a pair, or all)
    duration_s: float = 0.0
    tflops: float | None = None
    why: str = ""
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    evidence_path: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        d["devices"] = list(self.devices)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "CheckResult":
        return cls(**{**d, "status": Status(d["status"]), "devices": tuple(d["devices"])})


@dataclasses.dataclass(kw_only=True, slots=True)
class SuiteConfig:
    level: str = "quick"
    dtypes: Sequence[str] | None = None          # None: every dtype the device supports
    evidence_dir: Path | None = None
    seed: int = 0
    random: bool = True
    copies: bool = True
    slow_fraction: float = 0.7                   # below this fraction of the peers' median: slow
    fail_on_slow: bool = True

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.dtypes is not None:
            bad = [d for d in self.dtypes if d not in ALL_DTYPES]
            if bad:
                raise ValueError(f"unknown canary dtypes {bad}; known: {list(ALL_DTYPES)}")
        if not 0.0 < self.slow_fraction < 1.0:
            raise ValueError(f"slow_fraction must be in (0, 1), got {self.slow_fraction}")


@dataclasses.dataclass(slots=True)
class SuiteReport:
    level: str
    devices: list[DeviceInfo]
    results: list[CheckResult]
    skipped: dict[str, dict[str, str]]           # device -> {dtype: why not run}
    on_cpu: bool
    duration_s: float
    versions: dict[str, str]

    @property
    def status(self) -> Status:
        if any(r.status is Status.FAIL for r in self.results):
            return Status.FAIL
        if not self.results or any(r.status is Status.UNKNOWN for r in self.results):
            return Status.UNKNOWN
        return Status.PASS

    def device_status(self, label: str) -> tuple[Status, list[CheckResult]]:
        """(FAIL / UNKNOWN / PASS, the failed or unknown results) for one device."""
        mine = [r for r in self.results if label in r.devices]
        fails = [r for r in mine if r.status is Status.FAIL]
        if fails:
            return Status.FAIL, fails
        unknown = [r for r in mine if r.status is Status.UNKNOWN]
        if unknown or not mine:
            return Status.UNKNOWN, unknown
        return Status.PASS, []

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "status": self.status.value, "on_cpu": self.on_cpu,
                "duration_s": self.duration_s, "versions": self.versions,
                "devices": [dataclasses.asdict(d) for d in self.devices],
                "skipped": self.skipped, "results": [r.to_json() for r in self.results]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SuiteReport":
        """The inverse of `to_json` (its derived `status` is recomputed, not read)."""
        return cls(str(d["level"]), [DeviceInfo(**x) for x in d["devices"]],
                   [CheckResult.from_json(r) for r in d["results"]], dict(d["skipped"]), bool(d["on_cpu"]),
                   float(d["duration_s"]), dict(d["versions"]))


def exit_code(report: SuiteReport) -> int:
    """0 every check passed, 1 any failed, 2 a check could not run (and none failed)."""
    return {Status.PASS: 0, Status.FAIL: 1, Status.UNKNOWN: 2}[report.status]


def evidence_by_device(report: SuiteReport, now: float,
                       consecutive_failures: Mapping[str, int] | None = None) -> dict[str, list[Evidence]]:
    """Evidence per device label: canary 'fail' (SUSPECT; FAILED when the previous run failed too),
    'slow' (DEGRADED for an hour), or 'pass' (HEALTHY) when every check on it passed."""
    prev = consecutive_failures or {}
    out: dict[str, list[Evidence]] = {}
    for dev in report.devices:
        mine = [r for r in report.results if dev.label in r.devices]
        fails = [r for r in mine if r.status is Status.FAIL and r.check in SDC_CHECKS]
        slow = [r for r in mine if r.check == "slow" and r.status is Status.FAIL]
        evs: list[Evidence] = []
        if fails:
            repeat = prev.get(dev.label, 0) >= 1
            names = ", ".join(r.name for r in fails[:3]) + (f" (+{len(fails) - 3} more)" if len(fails) > 3 else "")
            evs.append(Evidence("canary", "fail", names, State.FAILED if repeat else State.SUSPECT,
                                f"canary failed{' again' if repeat else ''}: {fails[0].name}: {fails[0].why}",
                                now, count=len(fails)))
        if slow:
            evs.append(Evidence("canary", "slow", slow[0].why, State.DEGRADED, f"slow GPU: {slow[0].why}", now,
                                expires=now + 3600.0))
        if not fails and not slow and mine and all(r.status is Status.PASS for r in mine):
            evs.append(Evidence("canary", "pass", report.level, State.HEALTHY,
                                f"canary {report.level} passed ({len(mine)} checks)", now))
        if evs:
            out[dev.label] = evs
    return out
