"""What every NVML backend speaks: the error classes and the values a backend returns.

Shared by the real backend (`probes.nvml_backend`), the scenario fake (`probes.nvml_fake`), the isolated
backend's parent and child (`probes.nvml_isolated`, `probes.nvml_child`) and the probe; no NVML here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from sdcwatch.errors import SdcwatchError


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------


class NvmlError(SdcwatchError):
    """Root of every NVML failure (under sdcwatch's root). `transient`: a later call may succeed (decided by
    the NVML return code); `code`: the NVML return code."""

    def __init__(self, message: str, *, code: int | None = None, transient: bool | None = None) -> None:
        super().__init__(message, transient=transient)
        self.code = code


class FieldNotSupported(NvmlError):
    """NVML_ERROR_NOT_SUPPORTED (or the driver lacks the function): the GPU cannot report this field."""


class NvmlUnavailable(NvmlError):
    """NVML cannot be used at all on this host (no library, no driver, version mismatch)."""


class GpuLost(NvmlError):
    """NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus; every call on it fails."""


class GpuNeedsReset(NvmlError):
    """NVML_ERROR_RESET_REQUIRED: the GPU needs a reset before it answers again."""


# ----------------------------------------------------------------------------------------------------------
# Identities and events
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class GpuIdentity:
    """Who a GPU is. `uuid` and `pci_bus_id` name it everywhere; `index` is only this NVML session's handle."""

    uuid: str
    pci_bus_id: str
    name: str
    index: int
    serial: str | None = None
    driver_version: str | None = None

    @property
    def subject(self) -> str:
        return f"gpu/{self.uuid}"


@dataclasses.dataclass(frozen=True, slots=True)
class RawXid:
    """One NVML event as the backend saw it: the GPU's UUID (None if NVML could not tell), the event's data
    (the XID number for an XID) and which event (`event`: a name of `probes.nvml_backend.EVENT_TYPES`), or
    `count` identical ones."""

    uuid: str | None
    xid: int
    event: str = "xid"
    count: int = 1            # identical events in a row, folded (`xid_drain`)


class EventFold:
    """Identical events (same GPU, event and data) kept as one with their count, in first-seen order: memory
    is bounded by the distinct events, however many repeats arrive. For `RawXid` (a backend's drain) and
    `probes.nvml_probe.XidEvent` alike (both have uuid, event, xid, count). Not thread-safe (callers lock)."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, str, int], list[Any]] = {}   # key -> [last event, count]

    def add(self, events: Iterable[Any]) -> "EventFold":
        runs = self._runs
        for ev in events:
            key = (ev.uuid, ev.event, ev.xid)
            run = runs.get(key)
            if run is None:
                runs[key] = [ev, ev.count]
            else:
                run[0] = ev
                run[1] += ev.count
        return self

    def take(self) -> list[Any]:
        """The folded events so far (each the last of its run, with the run's count); the fold is emptied."""
        runs, self._runs = self._runs, {}
        return [ev if n == ev.count else dataclasses.replace(ev, count=n) for ev, n in runs.values()]
