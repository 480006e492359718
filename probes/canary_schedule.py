"""When canaries run: pure policies, no clock and no I/O (samples and `now` are passed in).

- `AgentCanaryPolicy.choose`: in the agent, which GPUs get a canary now: idle by NVML utilization, enough
  free memory for the canary within its memory cap, due (not run within `interval_s`), never one that
  already has a canary running (or hung), and at most `max_gpus_per_round` per round.

The in-job budget (the Monitor's canary, in the training job) is `checksums.canary_budget`.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping


@dataclasses.dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """What the agent knows about a GPU right now (from the NVML probe). None: not readable."""

    uuid: str
    index: int
    utilization_pct: float | None
    memory_free_bytes: int | None
    memory_total_bytes: int | None = None
    busy_processes: int | None = None          # compute processes on it (None: unknown)


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    uuid: str
    run: bool
    why: str


@dataclasses.dataclass(kw_only=True, slots=True)
class AgentCanaryPolicy:
    interval_s: float = 3600.0          # per GPU, between canaries
    idle_util_pct: float = 5.0          # at or below: idle
    memory_cap_bytes: int = 2 << 30     # the canary may use at most this much GPU memory
    headroom_bytes: int = 1 << 30       # free memory left to others beyond the canary's own use
    max_gpus_per_round: int = 1
    require_no_processes: bool = False  # also require no compute process on the GPU

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if not 0 <= self.idle_util_pct <= 100:
            raise ValueError(f"idle_util_pct must be within [0, 100], got {self.idle_util_pct}")
        if self.memory_cap_bytes <= 0 or self.headroom_bytes < 0:
            raise ValueError("memory_cap_bytes must be > 0 and headroom_bytes >= 0")
        if self.max_gpus_per_round < 1:
            raise ValueError(f"max_gpus_per_round must be >= 1, got {self.max_gpus_per_round}")

    def choose(self, gpus: Iterable[GpuSnapshot], *, now: float, need_bytes: int,
               last_run: Mapping[str, float], running: Iterable[str] = ()) -> list[Decision]:
        """One decision per GPU; those with run=True are the ones to canary now (oldest first)."""
        busy = set(running)
        out: list[Decision] = []
        due: list[tuple[float, GpuSnapshot]] = []
        for g in gpus:
            last = last_run.get(g.uuid)
            if g.uuid in busy:
                out.append(Decision(g.uuid, False, "a canary is already running (or hung) on this GPU"))
            elif need_bytes > self.memory_cap_bytes:
                out.append(Decision(g.uuid, False, f"the canary needs {need_bytes >> 20} MiB, over the "
                                    f"memory cap of {self.memory_cap_bytes >> 20} MiB"))
            elif last is not None and now - last < self.interval_s:
                out.append(Decision(g.uuid, False, f"ran {now - last:.0f}s ago (interval {self.interval_s:.0f}s)"))
            elif g.utilization_pct is None:
                out.append(Decision(g.uuid, False, "utilization unknown: not treated as idle"))
            elif g.utilization_pct > self.idle_util_pct:
                out.append(Decision(g.uuid, False, f"busy: {g.utilization_pct:.0f}% utilization"))
            elif self.require_no_processes and (g.busy_processes is None or g.busy_processes > 0):
                out.append(Decision(g.uuid, False, "compute processes on the GPU (or unknown)"))
            elif g.memory_free_bytes is None:
                out.append(Decision(g.uuid, False, "free memory unknown"))
            elif g.memory_free_bytes < need_bytes + self.headroom_bytes:
                out.append(Decision(g.uuid, False, f"{g.memory_free_bytes >> 20} MiB free, needs "
                                    f"{(need_bytes + self.headroom_bytes) >> 20} MiB"))
            else:
                due.append((last if last is not None else float("-inf"), g))
        due.sort(key=lambda x: (x[0], x[1].index))
        for i, (last, g) in enumerate(due):
            if i < self.max_gpus_per_round:
                out.append(Decision(g.uuid, True, "idle and due" if last != float("-inf") else "idle, never run"))
            else:
                out.append(Decision(g.uuid, False, "due, waits for a later round"))
        return out
