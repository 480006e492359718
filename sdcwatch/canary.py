"""Canary result values, shared by the code that runs canaries and the agent that reads their results.

Torch-free: the canary kernels (checksums.canary_gemm, probes.canary_*) run in the training job or in the
agent's canary child process, while the agent itself only reads these values. A `DeviceInfo.device` is a
torch device string ("cuda:0", "cpu"); code that runs kernels turns it into `torch.device(info.device)`.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any


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
