"""Pinned host slots that the compute gate's device path copies each step's rows and flag into, used in turn.

    ring = HostRing(slots=10)
    slot = ring.next(rows)                 # a free slot shaped like `rows` (made once; again on a new shape)
    slot.rows.copy_(rows, non_blocking=True); slot.flag.copy_(flag, non_blocking=True); slot.record()
    ...                                    # a step later
    slot.wait(); slot.flagged(); batch_stats(slots)   # numpy views: no torch op on the host to read them

The C++ comm hook may fill the slots in the same turn itself (`fill`, `following`, `take`). A slot is
reused `slots` steps after it was filled, so its rows may wait that long to be read (the gate
learns its unmasked steps a batch at a time, checksums/compute_gate.py); nothing is allocated in a step once
the slots exist (a pinned allocation in a step costs more than the step's whole check). The reads are
numpy views of the pinned memory, each a fraction of a microsecond, where a torch op on a tiny CPU tensor
costs several. CPU rows (gloo tests of the device path) get plain memory and no event.

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


class HostSlot:
    """One step's rows (int64 [world, buckets, 4]) and device flag (0-d float32) on the host."""

    __slots__ = ("rows", "flag", "done", "words", "_flag_np")

    def __init__(self, shape: torch.Size, cuda: bool) -> None:
        self.rows = torch.empty(shape, dtype=torch.int64, device="cpu", pin_memory=cuda)
        self.flag = torch.empty((), dtype=torch.float32, device="cpu", pin_memory=cuda)
        self.done: Any = torch.cuda.Event(blocking=True) if cuda else None
        self.words = self.rows.numpy()          # the rows as numpy (a view of the pinned memory)
        self._flag_np = self.flag.numpy()

    def record(self) -> None:
        """After the copies are enqueued: `wait` returns once they landed."""
        if self.done is not None:
            self.done.record()

    def wait(self) -> None:
        done = self.done
        if done is not None and not done.query():   # landed a step ago, in practice: a query keeps the GIL,
            done.synchronize()                      # where a wait lets it go and takes it back

    def flagged(self) -> bool:
        """The device's verdict masked this step's update."""
        return self._flag_np.item() != 0.0     # a Python float: 0.1 us (a numpy comparison: 1.1 us)


class HostRing:
    """`slots` HostSlots used in turn (see the module docstring)."""

    def __init__(self, slots: int) -> None:
        if slots < 2:
            raise ValueError(f"a host ring needs at least 2 slots, got {slots}")
        self._slots: list[HostSlot | None] = [None] * slots
        self._i = slots - 1

    def next(self, rows: torch.Tensor) -> HostSlot:
        """The next slot in turn, shaped like `rows` (made on first use and when the shape changes)."""
        self._i = (self._i + 1) % len(self._slots)
        slot = self._slots[self._i]
        if slot is None or slot.rows.shape != rows.shape:
            slot = self._slots[self._i] = HostSlot(rows.shape, rows.device.type == "cuda")
        return slot

    def fill(self) -> list[HostSlot]:
        """Every slot, each made like the newest one (`next` was called) and its event created: what the
        C++ comm hook fills in turn (checksums/native_hook.cpp `arm_finish`)."""
        newest = self._slots[self._i]
        assert newest is not None, "fill() after next()"
        cuda = newest.done is not None
        for i, slot in enumerate(self._slots):
            if slot is None or slot.rows.shape != newest.rows.shape:
                slot = self._slots[i] = HostSlot(newest.rows.shape, cuda)
            if cuda and not slot.done.cuda_event:
                slot.done.record()          # the event is made at its first record (a no-op to wait for)
        return list(self._slots)  # type: ignore[arg-type]

    def following(self) -> int:
        """The index of the slot `next` gives next."""
        return (self._i + 1) % len(self._slots)

    def take(self, i: int) -> HostSlot:
        """Slot `i`, filled by the C++ hook as the next in turn (`fill`): the ring goes on from it."""
        self._i = i
        slot = self._slots[i]
        assert slot is not None, "take() of a slot fill() made"
        return slot


def batch_stats(slots: list[HostSlot]) -> np.ndarray:
    """float64 [k, world, buckets, 2]: the statistics of `slots` (one shape) stacked, one copy."""
    return np.stack([s.words[..., :2] for s in slots]).view(np.float64)


__all__ = ["HostRing", "HostSlot", "batch_stats"]
