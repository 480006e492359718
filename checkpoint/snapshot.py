"""Rank side of a save: GPU -> host staging buffer on a side stream, then everything else in the background.

`Snapshotter.save(step, state_dict)`:
  1. flattens the state dict (tensors + JSON-safe rest; anything else is a clear error, before any copy);
  2. picks the staging buffer: by default (`staging="slots"`) a slot of `checkpoint.slots.SlotRing`, a file
     in the agent's memory dir mapped once and cudaHostRegister'ed, so the copy below IS the write into
     node memory (the bytes survive this process as soon as it completes); otherwise (`staging="private"`,
     or no free slot, or the agent's dir is not visible here, or the first save, which learns where the
     agent's dir is from its Begin) one private pinned arena reused across saves;
  3. on CUDA: on a side stream that waits for the current stream, fingerprints the GPU tensors (on a
     fingerprint stream the side stream then waits for: `_enqueue_fingerprints`;
     `checksums.fingerprint.fingerprint_tensors_async`, no sync) and copies every tensor into the buffer
     (gathered, `SnapshotConfig.gather_bytes`: packed on the device into a bounce buffer and copied a chunk
     at a time, tens of copies instead of one per tensor: checkpoint.gather);
  4. returns when the copy is complete (`block="copy"`) or as soon as it is enqueued (`block="enqueue"`:
     the current stream then waits for the copy on the GPU, so later in-place updates cannot race it; the
     host never blocks), or as soon as it is enqueued with only the next optimizer step made to wait for
     it (`block="update"`, what `block="auto"`, the default, means when a step guard is bound, else "copy").

Overlap (`block="update"`, issue 21): the copy runs while the next forward and backward run. The tensors
are split in two groups: those `optimizer.step()` changes (the bound optimizer's parameters and its state,
matched by storage) are copied last, and only the update waits for them: the `CheckpointCopies` stage,
`Phase.COPIES` of the optimizer's `checksums.step_guard.StepGuard`, makes the current stream wait for
their copy's event (a device-side `wait_event`, never a host sync); every other tensor (a buffer the
forward updates in place, e.g. BatchNorm's running stats, an EMA copy) is copied first and the current
stream waits for that group at once, so nothing but the optimizer can overwrite a tensor before its copy
read it. With no optimizer known every tensor is in the first group's place in the update's wait. Do not
change the optimizer's tensors in place outside `optimizer.step()` between a save and the next step
(`CheckpointClient.restore` and `close` order themselves after the copies; anything else should call
`Snapshotter.order_before_update()` first).

Background (one worker thread: saves are committed one after another, in step order; with
`max_inflight` > 1 several wait in its queue, each in its own staging slot, and the whole ring is made
up front by a thread of their own, then only reused: no slot is made in steady state):
`sink.begin` (its round trip overlaps the copy) -> wait for the copy's events (the GIL released) ->
publish the shard as the blob `<job>/<step>/rank-<r>.bin`: a hard link of the slot (no bytes move) or, for
a private buffer, a streamed file write -> xxh3-128 of each chunk -> fingerprint of the host bytes, which
must equal the GPU fingerprint -> `sink.commit_shard(manifest)` -> create the next staging slot ahead
(`SlotRing.ensure_spare`), so no save blocks on creating one. Each host byte is checksummed once and
fingerprinted once. `prepare(state_dict)` makes the first save's buffer ahead, in the background, too.

Checksums at the source (`SnapshotConfig.checksums`, "source" by default for CUDA state): step 3
fingerprints the tensors' pieces (cut at chunk boundaries, checkpoint.source_sums) with one fused launch
before the copies, and the background commits the pieces' words with the shard's layout
(checkpoint.shard_layout: the layout sent once): the agent builds the chunk checksums (algorithm sdcw-fp1),
the tensor fingerprints and the manifest from them (a sink without `commit_words` gets the manifest built
here, numpy on whole arrays and a template made once per layout). The host reads no byte of the shard to
commit it; the agent's scrub checks the host bytes later and VERIFIED waits for it (docs/checkpoints.md).
A save that finds no host buffer ready (the first) copies into a GPU buffer and returns; the background
makes the host buffer and copies it there (`device_staging`).

A save requested while the previous one is still in the background waits for it (`policy="wait"`) or is
skipped (`policy="skip"`); every skip is counted by reason (`Snapshotter.stats`, and the next commit tells
the agent how many saves were skipped before it); a staging buffer is never overwritten under a running
save, and a slot is never overwritten while a stored checkpoint still references it.

Checkpoint every step: `SnapshotConfig.every_step()` = `policy="skip"`, `block="update"`,
`max_slots="auto"` (the ring size from memory: `checkpoint.slots.ring_size`), and the loop calls `save`
after every `optimizer.step()`. A save that finds the previous one still copying or still being hashed
and committed is skipped and counted ("copying" / "writing"); the committed ones are what
`stats.committed` counts.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import inspect
import logging
import math
import operator
import os
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np
import torch

from checkpoint.blobstore import BlobStore
from checkpoint.chunks import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    checksum_chunks,
    iter_checksummed,
    iter_chunks,
)
from checkpoint.errors import CorruptCheckpointError, InvalidInputError
from checkpoint.gather import GatherPlan
from checkpoint.locations import dir_store_for
from checkpoint.manifest import ShardManifest, TensorEntry
from checkpoint.names import validate_job_id, validate_rank, validate_step
from checkpoint.records import Restored, SaveReport
from checkpoint.slots import Slot, SlotRing, memory_budget, ring_size
from checkpoint.shard_layout import ShardLayout
from checkpoint.source_sums import Piece, pieces
from checkpoint.state_tree import Flattener, dtype_name
from checksums.fingerprint import (
    MASK64,
    fingerprint_bytes,
    fingerprint_tensors_async,
    prepare_fingerprint,
    prepare_fingerprint_torch,
    triton_available,
)
from checksums.optimizer_parts import param_states
from checksums.step_guard import Phase, StepContext, Veto

log = logging.getLogger(__name__)

ALIGN = 64
DEVICE_STAGING_SHARE = 0.8   # a GPU staging buffer may take at most this share of the GPU's free memory
HOST_PIECES_INLINE = 1 << 20   # host pieces (CPU tensors of the state) under this many bytes in all are
                               # fingerprinted on the background thread itself, not through its pool
HELD_SLOTS = 5               # pipelined, max_slots="auto": slots the agent may hold as stored checkpoints
                             # (keep_committed 2 + the newest VERIFIED + the rollback span's 2)


class ShardSink(Protocol):
    """Who is told about a shard: the agent over gRPC (`checkpoint.client`) or a `Coordinator` directly."""

    def begin(self, job_id: str, step: int, rank: int, world_size: int) -> Any: ...
    # a sink whose begin also takes `restored=` (checkpoint.records.Restored) hears the rank's last restore

    def commit_shard(self, job_id: str, step: int, rank: int, world_size: int, manifest_json: str, *,
                     report: SaveReport | None = None) -> Any: ...
    # a sink with `commit_words(job_id, step, rank, world_size, layout, words, created, *, blob, report)`
    # renders a source-checksummed shard's manifest itself (checkpoint.shard_layout): the agent does


@dataclasses.dataclass(kw_only=True, slots=True)
class SnapshotConfig:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    policy: str = "wait"            # a save while the previous is still writing: "wait" or "skip"
    block: str = "auto"             # save() returns when the host copy is "copy" (done) or "enqueue"(d),
                                    # or enqueued with the next optimizer step waiting for it: "update";
                                    # "auto": "update" when a step guard is bound (copy_fence), else "copy"
    pin_memory: bool | None = None  # None: pin when CUDA is available
    check_source_fingerprint: bool | None = None  # None: for CUDA tensors (CPU tensors cannot change under us)
    fingerprint_threads: int = 4    # host fingerprints of the tensors run in parallel (numpy frees the GIL)
    staging: str = "slots"          # "slots": agent-owned shm slot files; "private": own pinned buffer + file write
    max_slots: int | str = 4        # slots per rank (keep_committed + newest verified + one being written),
                                    # or "auto": from memory (checkpoint.slots.ring_size)
    ring_fraction: float = 0.5      # max_slots="auto": share of min(MemAvailable, memory dir free) for slots
    skip_until_ready: bool = False  # a save that finds no staging buffer ready is skipped (counted
                                    # "preparing") while one is made in the background, instead of
                                    # making it inline (blocking); every_step() sets it
    device_staging: bool = True     # a save that finds no host buffer ready (the first) copies to a GPU
                                    # buffer and returns; the background makes the host buffer and copies
                                    # on (costs the state's size in GPU memory, for that save only)
    max_inflight: int = 1           # saves in the background at once, each in its own staging slot (one
                                    # worker commits them in step order): a save is skipped (or waits)
                                    # only when this many are still copying/committing or no slot is free;
                                    # every_step() sets 2: every step can commit when the background's
                                    # work per save fits in a step; its ring is made up front
                                    # (max_slots="auto": pipelined_ring) and then only reused
    checksums: str = "auto"         # "source": chunk checksums and tensor fingerprints computed from the
                                    # source tensors with the copy (the GPU kernel; torch on CPU): the
                                    # host hashes nothing to commit, the agent's scrub checks the bytes;
                                    # "host": hashed on the host from the landed bytes (xxh3-128 + numpy);
                                    # "auto": "source" when the state has a CUDA tensor, else "host"
    gather_bytes: int = 0           # CUDA into host memory: the tensors' bytes are gathered on the device
                                    # into a bounce buffer of up to this many bytes (made once, kept) and
                                    # copied to the host a chunk at a time (checkpoint.gather): tens of
                                    # copies per save instead of one per tensor; 0 (the default until its
                                    # H200 run): one copy per tensor; opt-in e.g. 256 << 20
    copy_thread: bool = True        # block="update" on CUDA: the copies the update waits for are enqueued
                                    # by a thread of the snapshotter's, not by save() on the training
                                    # thread (a save's few hundred copies queue behind the previous
                                    # save's in the driver: 12-16 ms of blocked enqueue a save on the
                                    # H200 with 2 in flight, issue 21); save() only orders them

    @classmethod
    def every_step(cls, **kw: Any) -> "SnapshotConfig":
        """Checkpoint after every optimizer step: the copy overlaps the next forward/backward, a save that
        finds the previous still copying or committing is skipped (counted), the ring size from memory."""
        kw.setdefault("policy", "skip")
        kw.setdefault("block", "update")
        kw.setdefault("max_slots", "auto")
        kw.setdefault("skip_until_ready", True)
        # three in flight: a save reaches COMMITTED about 1.6 steps after its call (the host's lead of a
        # step, the copy, the commit), so with one most saves are skipped (23-30% of steps COMMITTED on the
        # H200), with two 1-3 of 78 still are at a 73 ms step, with three none (docs/BENCHMARKS.md, issue 21)
        kw.setdefault("max_inflight", 3)
        return cls(**kw)

    def __post_init__(self) -> None:
        if self.policy not in ("wait", "skip"):
            raise InvalidInputError(f"policy must be 'wait' or 'skip', got {self.policy!r}")
        if self.block not in ("auto", "copy", "enqueue", "update"):
            raise InvalidInputError(f"block must be 'auto', 'copy', 'enqueue' or 'update', "
                                    f"got {self.block!r}")
        if not (0.0 < self.ring_fraction <= 1.0):
            raise InvalidInputError(f"ring_fraction must be in (0, 1], got {self.ring_fraction}")
        if self.chunk_bytes <= 0:
            raise InvalidInputError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.staging not in ("slots", "private"):
            raise InvalidInputError(f"staging must be 'slots' or 'private', got {self.staging!r}")
        slots = self.max_slots
        if slots != "auto" and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 1):
            raise InvalidInputError(f"max_slots must be an int >= 1 or 'auto', got {self.max_slots!r}")
        if self.checksums not in ("auto", "source", "host"):
            raise InvalidInputError(f"checksums must be 'auto', 'source' or 'host', got {self.checksums!r}")
        if self.checksums == "source" and self.chunk_bytes % 4:
            raise InvalidInputError(f"checksums='source' needs chunk_bytes a multiple of 4, "
                                    f"got {self.chunk_bytes}")
        if isinstance(self.max_inflight, bool) or not isinstance(self.max_inflight, int) or self.max_inflight < 1:
            raise InvalidInputError(f"max_inflight must be an int >= 1, got {self.max_inflight!r}")
        gb = self.gather_bytes
        if isinstance(gb, bool) or not isinstance(gb, int) or gb < 0:
            raise InvalidInputError(f"gather_bytes must be an int >= 0 (0: one copy per tensor), "
                                    f"got {self.gather_bytes!r}")
        if self.fingerprint_threads < 1:
            raise InvalidInputError(f"fingerprint_threads must be >= 1, got {self.fingerprint_threads}")


@dataclasses.dataclass(slots=True)
class SaveResult:
    step: int
    state: str                  # COMMITTED / VERIFIED / PENDING (others still writing) / FAILED
    committed_now: bool = False
    nbytes: int = 0
    blocking_s: float = 0.0     # time save() blocked the caller
    stall_s: float = 0.0        # of which waiting for the previous save, still writing
    safe_s: float = 0.0         # from save() returning until the shard was in the node memory tier
    commit_s: float = 0.0       # from save() returning until the agent accepted the shard
    checksum_s: float = 0.0     # background time spent on chunk checksums
    fingerprint_s: float = 0.0  # background time spent on the host fingerprint
    staging: str = ""           # "slot" (copy landed in node memory) or "private" (copied again after)
    skipped_before: int = 0     # saves skipped (by policy) since the previous save handed to the background
    spare_s: float = 0.0        # background time creating the next staging slot ahead (after the commit)
    error: str = ""
    host_s: float = 0.0         # background wall time of this save after its copy landed (begin, publish,
                                # checksums, commit): the pace limit of every-step saves, GIL waits included
    cpu_s: float = 0.0          # of which the background thread's CPU time (its own work, no GIL waits)
    checksums: str = ""         # "source" (at the source, with the copy) or "host" (from the landed bytes)
    device_staged: bool = False  # copied to a GPU buffer first (no host buffer was ready): save() did not
                                 # wait for a host buffer to be made
    phases: dict[str, float] = dataclasses.field(default_factory=dict)   # host seconds per phase (profiling):
                                 # "t.<phase>" the training thread's save() call, "b.<phase>" the background's
                                 # wall time and "b.<phase>.cpu" its thread's CPU time (the rest: GIL waits)


@dataclasses.dataclass(frozen=True, slots=True)
class SaveStats:
    """A Snapshotter's counts since it was made (`Snapshotter.stats`)."""

    saves: int                  # saves handed to the background
    committed: int              # of which reached COMMITTED or VERIFIED (as far as finished)
    failed: int                 # of which failed
    skipped: int                # saves skipped by policy="skip"
    skipped_by: dict[str, int]  # reason -> count: "copying" (the previous copy still in flight), "writing"
                                # (the previous save still hashed/committed), "preparing" (no buffer ready)
    slots: int                  # staging slots in the ring now
    ring_size: int              # the ring's limit (max_slots, or what "auto" chose)
    slots_ahead: int            # slots created in the background, before a save needed them
    slots_inline: int           # slots created inside a save (the blocking kind; 0 in steady state)
    in_flight: int = 0          # saves in the background now (copying, hashed or committed)
    most_in_flight: int = 0     # the most at once so far (SnapshotConfig.max_inflight bounds it)
    update_wait_s: float = 0.0  # seconds optimizer steps waited on the host for the copy thread to have
                                # enqueued a save's copies (normally 0: long done when the update comes)
    update_waits: int = 0       # how many of those waits found the enqueue not yet done


def _takes_restored(sink: Any) -> bool:
    """Whether `sink.begin` takes `restored=` (a sink written before it existed does not: its begins go
    without it, as before)."""
    try:
        params = inspect.signature(sink.begin).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return False
    return any(p.name == "restored" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class SaveHandle:
    """A save in flight: `result(timeout)` waits for the background part."""

    def __init__(self, step: int, future: "concurrent.futures.Future[SaveResult]") -> None:
        self.step = step
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        return self.future.result(timeout)


class _Arena:
    """One host buffer (pinned when asked) reused across saves; grows, never shrinks."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buf = torch.empty(0, dtype=torch.uint8)

    def ready(self, nbytes: int) -> bool:
        return self.buf.numel() >= nbytes

    def ensure(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return self.buf

    def release(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)


class _WordBuffers:
    """Pinned host buffers of fingerprint words ((n, 2) int64) a save's fingerprint stream copies into,
    reused: a save takes one (`take`) and its background gives it back before it is done (`give`), so a
    steady save allocates no host memory (issue 21). Given back only once nothing writes it any more: the
    save's background finishes after waiting for every event of the save's copies (the side stream waits for
    the words' copy before them), the plan thread after synchronising the side stream. At most `keep` kept
    per size."""

    def __init__(self, pin: bool, keep: int = 8) -> None:
        self.pin, self.keep = pin, keep
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.made = 0   # buffers allocated (tests: steady saves make none)

    def take(self, n: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(n)
            if free:
                return free.pop()
            self.made += 1
        return torch.empty(n, 2, dtype=torch.int64, pin_memory=self.pin)

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            for b in bufs:
                free = self._free.setdefault(b.shape[0], [])
                if len(free) < self.keep:
                    free.append(b)


def pipelined_ring(max_inflight: int) -> int:
    """Slots a pipelined ring (`max_slots="auto"`) holds: the saves in flight, the checkpoints the agent
    may hold (`HELD_SLOTS`) and one free for the next save. Made up front, then reused."""
    return max_inflight + HELD_SLOTS + 1


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in the arena (ALIGN-aligned) and the total size."""
    offsets, pos = [], 0
    for t in tensors:
        pos = (pos + ALIGN - 1) // ALIGN * ALIGN
        offsets.append(pos)
        pos += t.numel() * t.element_size()
    return offsets, pos


_PTR = torch.Tensor.data_ptr
_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_NBYTES = operator.attrgetter("nbytes")
_PATH = operator.itemgetter(0)


def _signature(named: list[tuple[str, torch.Tensor]], tensors: list[torch.Tensor],
               values: list[int] | None = None) -> tuple[Any, ...]:
    """What a save's plan depends on, per tensor: address, dtype, shape, device, contiguity, path. A few
    C-level `map`s (tens of microseconds for 600 tensors), compared with the last plan's. `values`: the
    indices of the plain values' byte tensors (flatten makes them anew at every save, on the host): their
    address is left out (no plan reads it; their size is in the shape)."""
    ptrs = list(map(_PTR, tensors))
    for i in values or ():
        ptrs[i] = 0
    return (tuple(ptrs), tuple(map(_DTYPE, tensors)), tuple(map(_SHAPE, tensors)),
            tuple(map(_DEVICE, tensors)), tuple(map(_CONTIGUOUS, tensors)), tuple(map(_PATH, named)))


@dataclasses.dataclass(slots=True, eq=False)
class _SavePlan:
    """What a save derives from its state's layout, made by the first save of the layout and kept while it
    stays (issue 21: no Python per tensor on the training thread in steady state, but the signature): the
    offsets, the manifest entries, the source-checksum pieces, the grouping by device, the optimizer's
    tensors, the copy order and the keys of the caches below it."""

    sig: tuple[Any, ...]
    offsets: list[int]
    total: int
    entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]
    by_dev: dict[torch.device, list[int]]
    source: bool
    cut: list[Piece] | None = None
    by_dev_pieces: dict[torch.device, list[int]] = dataclasses.field(default_factory=dict)
    zero_key: tuple[tuple[int, ...], int] | None = None
    late_key: Any = None                      # the optimizer's key `late` was computed for
    late: list[bool] | None = None
    fp_keys: dict[torch.device, Any] = dataclasses.field(default_factory=dict)   # fingerprint plan keys
    dev_pieces: dict[torch.device, list[Piece]] | None = None
    orders: dict[Any, tuple[list[int], int]] = dataclasses.field(default_factory=dict)  # copy order, early
    dst_keys: dict[torch.device, Any] = dataclasses.field(default_factory=dict)   # dev -> (offsets, key)
    subs: dict[Any, Any] = dataclasses.field(default_factory=dict)   # a device's share of a mixed state
    gathers: dict[Any, GatherPlan] = dataclasses.field(default_factory=dict)   # gathered copies (CUDA)


def _copy_order(plan: _SavePlan | None, order_key: Any, late: list[bool] | None, n: int
                ) -> tuple[list[int], int]:
    """The copy order of a device's `n` tensors and how many come first (those only the optimizer does not
    change: `late[j]` False; all `n` in one group without `late`), kept in the plan under `order_key`."""
    got = plan.orders.get(order_key) if plan is not None and order_key is not None else None
    if got is None:
        order = sorted(range(n), key=lambda j: bool(late[j])) if late is not None else None
        early = sum(1 for x in late if not x) if late is not None else 0
        got = (list(order if order is not None else range(n)), early)
        if plan is not None and order_key is not None:
            plan.orders[order_key] = got
    return got


def _dev_subsets(plan: _SavePlan | None, dev: torch.device, idx: list[int], mine: list[int],
                 tensors: list[torch.Tensor], offsets: list[int], late: list[bool] | None,
                 cut: list[Piece] | None) -> tuple[list[torch.Tensor], list[int], list[bool] | None,
                                                   list[Piece] | None]:
    """One device's tensors, offsets, late flags and pieces of a state on several devices (a GPU state with
    its plain values on the host): the lists kept in the plan, the tensors picked by one C-level getter."""
    pick = [tensors[idx[0]]] if len(idx) == 1 else None
    if plan is None or offsets is not plan.offsets or (late is not None and late is not plan.late) or (
            cut is not None and cut is not plan.cut):
        return (pick or [tensors[i] for i in idx], [offsets[i] for i in idx],
                None if late is None else [late[i] for i in idx], None if cut is None else [cut[k] for k in mine])
    key = (dev, late is not None and plan.late_key, cut is not None)
    held = plan.subs.get(key)
    if held is None:
        held = plan.subs[key] = (operator.itemgetter(*idx) if len(idx) > 1 else None, [offsets[i] for i in idx],
                                 None if late is None else [late[i] for i in idx],
                                 None if cut is None else [cut[k] for k in mine])
    getter, sub_off, sub_late, sub_cut = held
    return pick or list(getter(tensors)), sub_off, sub_late, sub_cut


class _Phases:
    """Host time per phase of a save (`SaveResult.phases`): a few clock reads per save, always on. `cpu`:
    also the thread's CPU time per phase (the background: wall minus CPU is time waiting, e.g. for the GIL)."""

    __slots__ = ("c", "cpu", "out", "prefix", "t")

    def __init__(self, prefix: str, cpu: bool = False, out: dict[str, float] | None = None) -> None:
        self.out: dict[str, float] = {} if out is None else out
        self.prefix, self.cpu = prefix, cpu
        self.t = time.perf_counter()
        self.c = time.thread_time() if cpu else 0.0

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        key = self.prefix + name
        self.out[key] = self.out.get(key, 0.0) + now - self.t
        self.t = now
        if self.cpu:
            c = time.thread_time()
            self.out[key + ".cpu"] = self.out.get(key + ".cpu", 0.0) + c - self.c
            self.c = c


class Snapshotter:
    def __init__(self, sink: ShardSink, job_id: str, rank: int, world_size: int,
                 config: SnapshotConfig | None = None,
                 store_for: Callable[[str], BlobStore] = dir_store_for, replica_set: str = "") -> None:
        validate_job_id(job_id)
        validate_rank(rank, world_size)
        self.sink = sink
        self.replica_set = replica_set   # stamped on each manifest: ranks of one set saved identical bytes
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.config = config or SnapshotConfig()
        pin = self.config.pin_memory
        if pin is None:
            pin = torch.cuda.is_available()
        self._arena = _Arena(bool(pin))
        self._words = _WordBuffers(bool(pin))
        self._taken: list[torch.Tensor] = []   # the word buffers this save took (save(), under self._lock)
        self._store_for = store_for
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdcw-ckpt")
        self._prep: concurrent.futures.Future[None] | None = None   # prepare(): buffers made ahead
        self._fp_pool = concurrent.futures.ThreadPoolExecutor(self.config.fingerprint_threads,
                                                              thread_name_prefix="sdcw-ckpt-fp")
        self._last: SaveHandle | None = None
        self._pending: list[SaveHandle] = []    # saves handed to the background, not known done (oldest first)
        self._most_in_flight = 0
        self._update_wait_s = 0.0   # the host's waits in order_before_update for the copy thread (stats)
        self._update_waits = 0
        self._arena_user: concurrent.futures.Future[SaveResult] | None = None   # the save reading the arena
        # pipelined (max_inflight > 1): slots are made ahead by a thread of their own, so a slot being made
        # (fallocate + populate + cudaHostRegister: ~0.5 s a GB) never holds up the commits queued behind it
        self._spare_pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdcw-ckpt-slots")
                            if self.config.max_inflight > 1 else None)
        self._spare_fut: concurrent.futures.Future[float] | None = None
        self._short = False   # the ring cannot hold the agent's checkpoints and a save (`_ring_short`)
        self._lock = threading.Lock()
        self._side: dict[torch.device, Any] = {}
        self._fp_streams: dict[torch.device, Any] = {}
        self._ring: SlotRing | None = None
        self._location: str | None = None      # the agent's memory dir, learned from the first begin
        # the rank's last restore into its training state (`note_restore`): each save's begin carries it, so
        # the agent cuts the history the job left there before the first save after it (docs/checkpoints.md)
        self.restored: Restored | None = None
        self._sink_takes_restored = _takes_restored(sink)
        # a sink that renders the manifest itself from the pieces' words (the agent: checkpoint.shard_layout)
        self._sink_takes_words = callable(getattr(sink, "commit_words", None))
        self._reset_ring = False                # the agent's dir moved or vanished: rebuild the slots
        self._slots_off = self.config.staging != "slots"
        self._warned_full = False
        self._skipped = 0                       # saves skipped since the last one handed to the background
        self._skips: collections.Counter[str] = collections.Counter()   # reason -> saves skipped
        self._saves = self._committed = self._failed = 0
        self._last_events: list[Any] = []      # the last save's copy events (is it still copying?)
        self._ring_lock = threading.Lock()      # the ring is made/reset from both threads
        self._ring_limit = 0                    # what max_slots resolved to (auto: from memory)
        self._inflight: list[tuple[torch.device, Any]] = []  # block="update": copies the update must wait for
        # copy_thread: enqueues them (its thread starts on the first submit: prepare() starts it)
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdcw-ckpt-copy")
        self._last_copy: concurrent.futures.Future[None] | None = None   # the last job handed to it
        self._fence: CheckpointCopies | None = None
        self._opt_key: tuple[int, int, int] | None = None    # the optimizer's storages, cached per layout
        self._opt_storages: frozenset[int] = frozenset()
        self._cuts: tuple[Any, list[Piece]] | None = None   # source checksums: the pieces of the last layout
        self._fp_plans: dict[torch.device, tuple[Any, Any]] = {}   # device -> (layout key, fingerprint plan)
        self._zeroed: dict[int, Any] = {}       # staging buffer address -> the layout whose gaps it has zero
        self._staged_sizes: set[int] = set()    # state sizes a save staged on the GPU for (once each)
        self._plan_lock = threading.Lock()
        self._dst_cache: dict[Any, Any] = {}   # "layout" -> key; slot address -> its destination views
        self._host_dst_cache: dict[Any, Any] = {}   # the same for the state's host tensors (a GPU state's
                                                    # plain values and step counts; a CPU state's all)
        self._cache_lock = threading.Lock()    # _dst_cache and _zeroed: the slot thread fills them ahead
        self._zero_hint: tuple[tuple[int, ...], int] | None = None   # the last source-checksummed layout
        self._plan_pool: concurrent.futures.ThreadPoolExecutor | None = None   # fingerprint plans, ahead
        self._plan_fut: concurrent.futures.Future[None] | None = None
        self._combine: tuple[Any, ...] | None = None   # background: (cut, total, entries, tree, ShardLayout)
        self._plan: _SavePlan | None = None    # the last layout's save plan (the training thread's)
        self._flatten = Flattener()             # save()'s walk of the state (under self._lock)
        self._same_dirs: tuple[str, str] | None = None   # (agent dir, ring root) found to be the same dir
        self._bounce: dict[torch.device, torch.Tensor] = {}   # gathered copies: each device's bounce buffer
        self._gap_zeros: dict[torch.device, torch.Tensor] = {}   # and its ALIGN zero bytes (the gaps)
        self._gather_off: set[torch.device] = set()   # devices whose bounce did not fit: per-tensor copies

    def _block(self) -> str:
        block = self.config.block
        if block == "auto":
            return "update" if self._fence is not None else "copy"
        return block

    def save(self, step: int, state_dict: Mapping[str, Any]) -> SaveHandle | None:
        """Snapshot `state_dict` as `step`; None when skipped by policy. Raises InvalidInputError on
        unsupported content (before anything is copied)."""
        validate_step(step)
        block = self._block()
        if block == "update" and self._fence is None:
            raise InvalidInputError("SnapshotConfig(block='update') leaves the copy in flight until the next "
                                    "optimizer.step(): bind a step guard so the update waits for it "
                                    "(CheckpointClient(..., guard=monitor.guard)), or use block='enqueue'")
        t0 = time.perf_counter()
        ph = _Phases("t.")
        skip = self.config.policy == "skip"
        ahead = self.config.skip_until_ready
        with self._lock:
            pending = self._pending = [h for h in self._pending if not h.done()]
            busy = [h.future for h in pending[:max(0, len(pending) - self.config.max_inflight + 1)]]
            busy += [f for f in (self._prep, self._arena_user) if f is not None and not f.done()
                     and (f is self._prep or self._ring is None)]   # the arena matters until slots work
            if busy:
                if skip:   # before walking the state: skipped saves (most, every step) stay cheap
                    self._skip(step, self._busy_reason())
                    return None
                t_wait = time.perf_counter()
                concurrent.futures.wait(busy)
                stall = time.perf_counter() - t_wait
            else:
                stall = 0.0
            ph.mark("pending")
            values: list[int] = []
            tree, named = self._flatten(state_dict, values)   # the last structure replayed (state_tree)
            tensors = [t for _, t in named]
            ph.mark("flatten")
            sig = _signature(named, tensors, values)
            plan = self._plan if self._plan is not None and self._plan.sig == sig else None
            offsets, total = (plan.offsets, plan.total) if plan is not None else layout(tensors)
            ph.mark("layout")
            # skip_until_ready never blocks on making a buffer: with none ready it skips and makes one ahead
            slot = self._acquire_slot(total, create=not ahead)
            if slot is None and self._spare_pool is not None and self._ring is not None:
                # pipelined and slots work here: every slot is in flight or holds a stored checkpoint, or
                # the next is still being made; never fall back to the one private buffer meanwhile, but
                # when every slot holds a stored checkpoint and none is in flight: the agent frees a slot
                # only when a newer checkpoint commits, so skipping (or waiting) would stop checkpoints for
                # good (a ring cut by memory below the agent's retention); this save takes the private buffer
                self._want_spares(total)
                if not pending and self._ring_full(total):
                    self._ring_short(self._ring, total)
                elif skip:
                    self._skip(step, "slots" if self._ring_full(total) else "preparing")
                    return None
                else:
                    concurrent.futures.wait([h.future for h in pending])   # policy wait: the ring drains
                    slot = self._acquire_slot(total, create=True)
            elif slot is not None and self._spare_pool is not None:
                self._want_spares(total)   # top the ring up while this one is in flight
            staged = None   # no host buffer ready: stage on the GPU, the host buffer made in the background
            if slot is None and not self._arena.ready(total):
                if ahead:   # skip_until_ready (every_step): skipped and counted; the buffers, views and
                    self._skip(step, "preparing")   # plans made in the background (issue 21: this call
                    self._prepare(named, offsets, total, values)   # costs what a steady one costs)
                    return None
                staged = self._device_stage(tensors, total, block)
            if staged is not None:
                arena = staged
            else:
                arena = slot.tensor if slot is not None else self._arena.ensure(total)
            if plan is None:
                plan = self._save_plan(named, tensors, sig)
                offsets = plan.offsets   # the same numbers; the plan's list keys its caches
            ph.mark("buffer")
            late = self._plan_late(plan, tensors) if block == "update" else None
            ph.mark("late")
            cut = plan.cut
            transfer_check = True
            if cut is not None and not self._plans_ready(tensors, cut, plan):
                # the fingerprint plan of this layout (tables built and uploaded: milliseconds of host work,
                # and the kernel's compile before the first) is made in the background, never here: this
                # save is checksummed on the host from the landed bytes instead (the "host" path, without
                # the transfer check, which would need the same plan)
                self._plan_ahead(tensors, cut)
                cut, transfer_check = None, False
            ph.mark("plan")
            if cut is not None and staged is None:   # a staging buffer on the GPU is made of zeros
                self._zero_gaps(arena, tensors, offsets, total, plan.zero_key)
            ph.mark("zero")
            self._taken = []
            try:
                if self._last_copy is not None:   # the copy thread's last enqueue comes first on the side
                    concurrent.futures.wait([self._last_copy])   # stream (normally long done: a step waited)
                with torch.no_grad():
                    events, src_fps = self._copy(tensors, offsets, arena, block, late, cut, transfer_check,
                                                 plan, ph)
            except BaseException:
                if slot is not None and self._ring is not None:
                    self._ring.release(slot)
                raise
            ph.mark("copy")
            if block == "copy":
                for ev in events:
                    ev.synchronize()
            ph.mark("copy_wait")
            entries = plan.entries
            skipped, self._skipped = self._skipped, 0
            self._saves += 1
            self._last_events = events
            ph.mark("entries")
            blocking = time.perf_counter() - t0
            taken, self._taken = self._taken, []
            fut = self._pool.submit(self._background_giving, taken, step, tree, entries, total, arena, events,
                                    src_fps, blocking, time.perf_counter(), slot, stall, skipped, cut,
                                    [staged] if staged is not None else None, ph.out, [tensors],
                                    self.restored)
            self._last = SaveHandle(step, fut)
            if slot is None:   # the private arena (or, staged on the GPU, the arena it is copied into next)
                self._arena_user = fut
            self._pending.append(self._last)
            self._most_in_flight = max(self._most_in_flight, len(self._pending))
            ph.mark("submit")
            return self._last

    def _source_mode(self, tensors: list[torch.Tensor]) -> bool:
        mode = self.config.checksums
        if mode == "auto":
            return self.config.chunk_bytes % 4 == 0 and any(t.device.type == "cuda" for t in tensors)
        return mode == "source"

    def _save_plan(self, named: list[tuple[str, torch.Tensor]], tensors: list[torch.Tensor],
                   sig: tuple[Any, ...] | None = None) -> _SavePlan:
        """The plan of this state's layout: the last one when the signature is the same, else a new one
        (the training thread's first save of a layout, or the plan thread's prepare)."""
        sig = _signature(named, tensors) if sig is None else sig
        held = self._plan
        if held is not None and held.sig == sig:
            return held
        offsets, total = layout(tensors)
        entries = [(path, t.dtype, tuple(t.shape), off, t.numel() * t.element_size())
                   for (path, t), off in zip(named, offsets)]
        by_dev: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dev.setdefault(t.device, []).append(i)
        plan = _SavePlan(sig, offsets, total, entries, by_dev, self._source_mode(tensors),
                         zero_key=(tuple(offsets), total))
        if plan.source:
            plan.cut = self._source_cut(tensors, offsets)
            for k, p in enumerate(plan.cut):
                plan.by_dev_pieces.setdefault(tensors[p.tensor].device, []).append(k)
        self._plan = plan
        return plan

    def _plan_late(self, plan: _SavePlan, tensors: list[torch.Tensor]) -> list[bool]:
        """`_changed_by_update` for the plan's layout, kept with it while the optimizer's layout stays."""
        opt = self._fence.optimizer if self._fence is not None else None
        key = None if opt is None else (id(opt), len(opt.state), sum(len(g["params"]) for g in opt.param_groups))
        if plan.late is None or plan.late_key != key:
            plan.late = self._changed_by_update(tensors)
            plan.late_key = key
            plan.orders = {}
            plan.gathers = {}
        return plan.late

    def _source_cut(self, tensors: list[torch.Tensor], offsets: list[int]) -> list[Piece]:
        """The pieces of this layout (checkpoint.source_sums), cached while the layout stays."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        key = (tuple(offsets), tuple(sizes), self.config.chunk_bytes)
        if self._cuts is None or self._cuts[0] != key:
            self._cuts = (key, pieces(offsets, sizes, self.config.chunk_bytes))
        return self._cuts[1]

    def _zero_gaps(self, arena: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int],
                   total: int, key: tuple[tuple[int, ...], int] | None = None) -> None:
        """Zero the bytes between tensors in the staging buffer (the source checksums count them as zero),
        once per buffer and layout: a reused slot may hold another layout's bytes there."""
        key = (tuple(offsets), total) if key is None else key
        ptr = arena.data_ptr()
        with self._cache_lock:
            self._zero_hint = key   # slots made ahead from now on are marked zero for this layout
            if self._zeroed.get(ptr) == key:
                return
        end = 0
        for t, off in zip(tensors, offsets):
            if off > end:
                arena[end:off].zero_()
            end = off + t.numel() * t.element_size()
        self._mark_zeroed(ptr, key)

    def _mark_zeroed(self, ptr: int, key: Any) -> None:
        with self._cache_lock:
            self._zeroed[ptr] = key
            while len(self._zeroed) > 64:
                self._zeroed.pop(next(iter(self._zeroed)))

    def prepare(self, state_dict: Mapping[str, Any]) -> "concurrent.futures.Future[None]":
        """Make, in the background, everything the first save of `state_dict`'s layout would (call it once
        the state has its final shapes, e.g. after the first optimizer step created the optimizer's state):
        the staging buffer (a slot when the agent's dir is known from an earlier save, else the private
        pinned buffer the first save copies into), the optimizer's storages, the source-checksum pieces,
        the side streams and, on the plan thread, the fingerprint plans (after the kernel's compile). A save
        meanwhile waits for the buffer only (`policy="wait"`) or is skipped; a plan not ready yet never
        blocks one (that save checksums on the host). The future is done when all of it is. Nothing is
        copied."""
        values: list[int] = []
        with self._lock:   # the save's own walker: its skeleton of this state is made here, not in the save
            _, named = self._flatten(state_dict, values)
            return self._prepare(named, values=values)

    def _prepare(self, named: list[tuple[str, torch.Tensor]], offsets: list[int] | None = None,
                 total: int = 0, values: list[int] | None = None) -> "concurrent.futures.Future[None]":
        """`prepare` from the flattened state, `self._lock` held (prepare(), or a save that found nothing
        ready and is skipped): the buffers on the background thread, the save plan (issue 21: the first
        save after it computes no offsets, entries or pieces) and the fingerprint plans on the plan thread."""
        tensors = [t for _, t in named]
        if offsets is None:
            offsets, total = layout(tensors)
        # the destination views of the buffer the first save copies into, made with it (a few hundred view
        # ops: milliseconds the first save would otherwise spend on the training thread, issue 21): per
        # device, as `_dsts` keeps them (a GPU state's plain values and step counts are a host group)
        by_dev: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dev.setdefault(t.device, []).append(i)
        metas = [(dev, [offsets[i] for i in idx], [(tensors[i].dtype, tensors[i].shape) for i in idx])
                 for dev, idx in by_dev.items()]
        if self._prep is None or self._prep.done():
            self._prep = self._pool.submit(self._prepare_buffers, total, offsets, metas)
        prep = self._prep
        with self._plan_lock:
            if self._plan_pool is None:
                self._plan_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdcw-ckpt-plan")
            plans = self._plan_fut = self._plan_pool.submit(self._prepare_plans, tensors, offsets, named, values)
        both: concurrent.futures.Future[None] = concurrent.futures.Future()

        def one_done(_: Any) -> None:
            if prep.done() and plans.done() and not both.done():
                try:
                    both.set_result(None)
                except concurrent.futures.InvalidStateError:   # the other callback got there first
                    pass
        prep.add_done_callback(one_done)
        plans.add_done_callback(one_done)
        return both

    def _prepare_plans(self, tensors: list[torch.Tensor], offsets: list[int],
                       named: list[tuple[str, torch.Tensor]] | None = None, values: list[int] | None = None
                       ) -> None:
        """Plan thread (`prepare`): the save plan, the optimizer's storages, the pieces, the side streams and
        the fingerprint plans."""
        try:
            plan = (self._save_plan(named, tensors, _signature(named, tensors, values)) if named is not None
                    else None)
            if self._fence is not None:
                if plan is not None:
                    self._plan_late(plan, tensors)
                else:
                    self._changed_by_update(tensors)
            _warm_ops({t.dtype for t in tensors if t.device.type == "cpu"})
            cuda = {t.device for t in tensors if t.device.type == "cuda"}
            for dev in cuda:
                self._make_streams(dev)
            if cuda and self.config.copy_thread:
                self._copier.submit(lambda: None)   # its thread started now, not by the first save
            if plan is not None and self.config.gather_bytes:
                try:
                    self._prepare_gathers(plan, tensors)
                except Exception as e:  # noqa: BLE001 - the first save makes them
                    log.warning("preparing the gathered copies failed: %s", e)
            if self._source_mode(tensors):
                self._build_plans(tensors, self._source_cut(tensors, offsets))
                if plan is not None and plan.cut is not None:
                    # the plan's keys made, and the plans just built keyed by them (a save then compares
                    # by identity, not ~700 pieces' tuples)
                    self._plans_ready(tensors, plan.cut, plan)
        except Exception as e:  # noqa: BLE001 - the first save makes what is missing (or checksums on the host)
            log.warning("preparing checkpoint plans failed: %s", e)

    def _prepare_gathers(self, plan: _SavePlan, tensors: list[torch.Tensor]) -> None:
        """Plan thread: each CUDA device's gathered-copy plan and bounce buffer, as the first save into host
        memory would make them (`_copy_cuda`), so that save makes none on the training thread."""
        late = plan.late if self._block() == "update" else None
        for dev, idx in plan.by_dev.items():
            if dev.type != "cuda" or dev in self._gather_off:
                continue
            if len(plan.by_dev) == 1:
                sub_t, sub_off, sub_late = tensors, plan.offsets, late
            else:
                sub_t, sub_off, sub_late, _ = _dev_subsets(plan, dev, idx, [], tensors, plan.offsets, late,
                                                           None)
            # the keys the save uses (its `late` is the plan's; without one, one group)
            order_key = (dev, plan.late_key) if sub_late is not None else None
            seq, early = _copy_order(plan, order_key, sub_late, len(sub_t))
            with torch.cuda.device(dev), torch.cuda.stream(self._side_stream(dev)):
                try:
                    gp = self._gather_plan(dev, sub_t, sub_off, seq, early, plan,
                                           order_key if order_key is not None else (dev, None))
                    self._bounce_for(dev, gp.bounce_bytes)
                except torch.cuda.OutOfMemoryError as e:
                    self._no_gather(dev, e)

    @property
    def stats(self) -> SaveStats:
        ring = self._ring
        return SaveStats(self._saves, self._committed, self._failed, sum(self._skips.values()),
                         dict(self._skips), len(ring) if ring is not None else 0, self._ring_limit,
                         ring.created_ahead if ring is not None else 0,
                         ring.created_inline if ring is not None else 0,
                         sum(1 for h in list(self._pending) if not h.done()), self._most_in_flight,
                         self._update_wait_s, self._update_waits)

    def _skip(self, step: int, reason: str) -> None:
        self._skipped += 1
        self._skips[reason] += 1
        n = self._skips[reason]
        if n == 1 or n % 1000 == 0:   # counted always; said on the first and every 1000th of a kind
            prev = self._last.step if self._last is not None else None
            log.warning("checkpoint step %d skipped (%s; previous save: step %s): %d skipped for this reason "
                        "so far (Snapshotter.stats)", step, _SKIP_WHY[reason], prev, n)

    def _busy_reason(self) -> str:
        if self._prep is not None and not self._prep.done():
            return "preparing"
        if any(not _event_done(ev) for ev in self._last_events):
            return "copying"
        return "writing"

    def copy_fence(self, optimizer: torch.optim.Optimizer | None = None) -> "CheckpointCopies":
        """The stage that makes the next optimizer step wait for this snapshotter's copies in flight; put it
        on the optimizer's `StepGuard` (the checkpoint client does). `optimizer`: whose tensors only the
        update waits for (the others' copies are ordered at once); None: every tensor waits for the update."""
        if self._fence is None:
            self._fence = CheckpointCopies(self, optimizer)
        elif optimizer is not None:
            self._fence.optimizer = optimizer
        return self._fence

    def warm_up(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Start, in the background, what the first save on the optimizer's GPUs would wait for: the
        fingerprint kernel's compile (a thread of its own) and the side streams. Cheap; the client calls it
        when bound to a step guard. `prepare(state_dict)` builds the rest (buffers, plans) once the state
        has its shapes."""
        if optimizer is None or self.config.checksums == "host":
            return
        devs = {p.device for g in optimizer.param_groups for p in g["params"]
                if isinstance(p, torch.Tensor) and p.device.type == "cuda"}
        for dev in devs:
            self._make_streams(dev)
            if triton_available():
                _triton_ready(dev)

    def order_before_update(self) -> None:
        """Make each device's current stream wait for the copies still in flight (block="update"): on the
        device, the host never waits. Nothing to do on CPU or in the other modes (save ordered them)."""
        if not self._inflight:
            return
        inflight, self._inflight = self._inflight, []
        for dev, ev in inflight:
            if isinstance(ev, _QueuedCopy) and not ev.job.done():   # the host waits: counted (stats)
                t0 = time.perf_counter()
                ev.job.exception()
                self._update_wait_s += time.perf_counter() - t0
                self._update_waits += 1
            _stream_wait(dev, ev)

    def _changed_by_update(self, tensors: list[torch.Tensor]) -> list[bool]:
        """Per tensor: does the bound optimizer's step change it (its parameters and state, by storage)?
        Every tensor when no optimizer is known. Cached while the optimizer's layout stays the same."""
        opt = self._fence.optimizer if self._fence is not None else None
        if opt is None:
            return [True] * len(tensors)
        key = (id(opt), len(opt.state), sum(len(g["params"]) for g in opt.param_groups))
        if key != self._opt_key:
            self._opt_storages = optimizer_storages(opt)
            self._opt_key = key
        mine = self._opt_storages
        return [_storage(t) in mine for t in tensors]

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        last = self._last
        return None if last is None else last.result(timeout)

    def settle(self, timeout: float) -> bool:
        """Wait (up to `timeout` seconds in all) until every save handed to the background has finished
        (its begin and commit told the agent); False if one is still going."""
        with self._lock:
            pending = [h.future for h in self._pending if not h.done()]
        if not pending:
            return True
        _, not_done = concurrent.futures.wait(pending, timeout)
        return not not_done

    def note_restore(self, step: int, at: float) -> None:
        """The rank restored `step` into its training state; the restore began at `at` (time.time()). The
        saves snapshotted from now on carry it in their begin (`ShardSink`)."""
        validate_step(step)
        self.restored = Restored(step, at)

    def close(self) -> None:
        self.order_before_update()   # whatever the caller does to the weights next comes after the copies
        self._copier.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self._plan_pool is not None:
            self._plan_pool.shutdown(wait=True)
        if self._spare_pool is not None:
            self._spare_pool.shutdown(wait=True)
        self._fp_pool.shutdown(wait=True)
        self._bounce, self._gap_zeros = {}, {}   # the copies that used them are done (the background waited)
        if self._plan is not None:
            self._plan.gathers = {}   # their views of the state's tensors
        self._dst_cache = {}   # views of the slots: their mappings go with the ring
        self._host_dst_cache = {}
        with self._ring_lock:
            if self._ring is not None:
                self._ring.close()
                self._ring = None

    # ---- staging ------------------------------------------------------------------------------------
    def _ring_for(self, total: int) -> SlotRing | None:
        """The slot ring in the agent's memory dir (made on first need; cheap: no file), or None when
        slots are off or the dir is not known or not visible here."""
        with self._ring_lock:
            if self._slots_off:
                return None
            if self._reset_ring and self._ring is not None:
                self._dst_cache = {}
                self._host_dst_cache = {}
                self._ring.close()
                self._ring = None
            self._reset_ring = False
            if self._location is None:
                return None
            if self._ring is None:
                if not os.path.isdir(self._location):
                    log.warning("agent memory dir %s is not visible from this process: staging in a private "
                                "buffer (the shard is copied again into node memory after save returns)",
                                self._location)
                    self._slots_off = True
                    return None
                limit = self.config.max_slots
                if limit == "auto":
                    avail, free, local = memory_budget(self._location)
                    limit = ring_size(total, mem_available=avail, dir_free=free, local_ranks=local,
                                      fraction=self.config.ring_fraction)
                    if self._spare_pool is not None:   # pipelined: the ring is made up front, so only
                        limit = min(limit, pipelined_ring(self.config.max_inflight))   # what it needs
                    log.info("checkpoint ring for %s rank %d: %d slots of %d bytes (%.0f%% of "
                             "min(MemAvailable %d, memory dir free %d) over %d local ranks)", self.job_id,
                             self.rank, limit, total, 100 * self.config.ring_fraction, avail, free, local)
                assert isinstance(limit, int)
                self._ring_limit = limit
                self._ring = SlotRing(self._location, self.job_id, self.rank, max_slots=limit,
                                      register_cuda=bool(self._arena.pin))
            return self._ring

    def _acquire_slot(self, total: int, create: bool = True) -> Slot | None:
        """A staging slot in the agent's memory dir, or None (use the private arena). The dir is learned
        from the agent's answer to the first save's Begin (in the background: save() never waits on an
        RPC), so the first save stages privately and slots are used from the second on. Slots are made
        ahead by the background (`_make_spare`); one is made here only when `create` and none is ready."""
        ring = self._ring_for(total)
        if ring is None:
            return None
        try:
            slot = ring.acquire(total, create=create)
        except OSError as e:
            log.warning("cannot create a staging slot of %d bytes in %s (%s): using a private buffer",
                        total, self._location, e)
            return None
        if slot is None:
            # (pipelined, a full ring means saves skipped or, with none in flight, `_ring_short`: said there)
            if len(ring) >= ring.max_slots and not self._warned_full and self._spare_pool is None:
                self._warned_full = True
                log.warning("all %d staging slots hold stored checkpoints: this save uses a private buffer "
                            "(raise SnapshotConfig.max_slots above the agent's keep_committed + 2)",
                            ring.max_slots)
            return None
        if self._arena.buf.numel() and not self._short:   # (a short ring keeps it for the saves it cannot take)
            self._dst_cache.pop(self._arena.buf.data_ptr(), None)   # its views would keep it alive
            self._host_dst_cache.pop(self._arena.buf.data_ptr(), None)
            old = self._arena.buf
            self._arena.release()  # slots work here: the private buffer is no longer needed
            try:   # freed by the background (unmapping a state-sized buffer takes milliseconds)
                self._pool.submit(_drop, [old])
            except RuntimeError:   # closed
                pass
            del old
        return slot

    def _make_spare(self, total: int) -> float:
        """Background: create the next slot ahead when none is free (so no save blocks on creating one);
        the seconds it took (0 when nothing was made)."""
        ring = self._ring_for(total)
        if ring is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            made = ring.ensure_spare(total)
        except OSError as e:
            log.warning("cannot create a staging slot of %d bytes in %s ahead (%s)", total, self._location, e)
            return 0.0
        if made is not None:
            self._ready_fresh(made)
        return time.perf_counter() - t0 if made is not None else 0.0

    def _prepare_buffers(self, total: int, offsets: list[int] | None = None,
                         metas: list[tuple[torch.device, list[int], list[Any]]] | None = None) -> None:
        """Background (`prepare`, or a skipped save that found no buffer): a free slot of `total` bytes if
        slots work here, else the private pinned arena."""
        try:
            if self._spare_pool is not None:
                self._make_spares(total)   # pipelined: the whole ring, up front
            else:
                self._make_spare(total)
            ring = self._ring
            if ring is not None and ring.free_slots(total):
                return
            fresh = not self._arena.ready(total)
            buf = self._arena.ensure(total)
            if fresh and offsets is not None:   # made of zeros: its gaps need no zeroing in the first save
                self._mark_zeroed(buf.data_ptr(), (tuple(offsets), total))
            for dev, offs, group in metas or ():
                self._ready_views(buf, dev, offs, group)
        except Exception as e:  # noqa: BLE001 - the save that needs it makes it or reports why
            log.warning("preparing a %d-byte checkpoint buffer failed: %s", total, e)

    # ---- the copy -----------------------------------------------------------------------------------
    def _copy(self, tensors: list[torch.Tensor], offsets: list[int], arena: torch.Tensor, block: str = "copy",
              late: list[bool] | None = None, cut: list[Piece] | None = None, transfer_check: bool = True,
              plan: _SavePlan | None = None, ph: _Phases | None = None
              ) -> tuple[list[Any], dict[Any, torch.Tensor]]:
        """Enqueue every copy; return CUDA events to wait on and the source fingerprints: host-mode
        {tensor index: host fingerprint words}, or with `cut` (source checksums) {("pieces", device):
        (piece indices, host words [n, 2])}. `late[i]`: tensor i changes only in the optimizer step
        (block="update": only the update waits). `plan`: the save plan of this layout (its groupings)."""
        if plan is not None:
            by_dev = plan.by_dev
        else:
            by_dev = {}
            for i, t in enumerate(tensors):
                by_dev.setdefault(t.device, []).append(i)
        if plan is not None and cut is not None and cut is plan.cut:
            by_dev_pieces = plan.by_dev_pieces
        else:
            by_dev_pieces = {}
            for k, p in enumerate(cut or ()):
                by_dev_pieces.setdefault(tensors[p.tensor].device, []).append(k)
        one = len(by_dev) == 1   # one device (the usual): every list as it is, no per-tensor subsetting
        events: list[Any] = []
        src_fps: dict[Any, Any] = {}
        for dev, idx in by_dev.items():
            mine = by_dev_pieces.get(dev, [])
            if dev.type == "cuda":
                order_key = (dev, plan.late_key) if plan is not None and late is plan.late else None
                if one:
                    sub_t, sub_off, sub_late, sub_cut = tensors, offsets, late, cut
                else:
                    sub_t, sub_off, sub_late, sub_cut = _dev_subsets(plan, dev, idx, mine, tensors, offsets,
                                                                     late, cut)
                if ph is not None:
                    ph.mark("copy.group")
                ev, fps = self._copy_cuda(dev, sub_t, sub_off, arena, block, sub_late,
                                          None if cut is None else (tensors, sub_cut or []),
                                          transfer_check, plan, order_key, ph)
                events.append(ev)
                if cut is not None:
                    src_fps[("pieces", dev)] = (mine, fps)
                elif fps is not None:
                    src_fps.update({i: fps[j] for j, i in enumerate(idx)})
                continue
            if cut is not None and mine and arena.device.type == "cuda":   # torch on the source tensors
                views = _piece_views(tensors, [cut[k] for k in mine])
                per = torch.empty(len(views), 2, dtype=torch.int64)
                fingerprint_tensors_async(views, per_tensor_out=per)
                src_fps[("pieces", dev)] = (mine, per)
            elif cut is not None and mine:   # CPU -> host memory: the copy below is a synchronous memcpy, so
                src_fps[("host pieces", dev)] = mine   # the background fingerprints them (numpy, no GIL)
            check = cut is None and transfer_check and bool(self.config.check_source_fingerprint)
            if check and idx:
                per = torch.empty(len(idx), 2, dtype=torch.int64)
                fingerprint_tensors_async([tensors[i] for i in idx], per_tensor_out=per)
                src_fps.update({i: per[j] for j, i in enumerate(idx)})
            if dev.type == "cpu" and arena.device.type == "cpu" and idx:
                # host tensors into host memory (a CPU state; a GPU state's plain values and step counts):
                # the plan's per-device lists, the views kept per buffer, one foreach copy (issue 21)
                sub_t, sub_off = ((tensors, offsets) if one else
                                  _dev_subsets(plan, dev, idx, [], tensors, offsets, None, None)[:2])
                gp = None
                if _GATHER_ON_HOST and self.config.gather_bytes and dev not in self._gather_off:
                    # tests: the CUDA path's gather on CPU; made per save: the plain values' byte tensors are
                    # new at every save (no plan keeps them)
                    gp = self._gather_plan(dev, sub_t, sub_off, list(range(len(sub_t))), 0, None, None)
                    try:
                        bounce = self._bounce_for(dev, gp.bounce_bytes)
                    except torch.cuda.OutOfMemoryError as e:
                        self._no_gather(dev, e)
                        gp = None
                if gp is not None:
                    gp.run(1, arena, bounce, sub_t, non_blocking=False)
                else:
                    copy_all(self._dsts(dev, arena, sub_t, sub_off, plan, host=True), sub_t,
                             range(len(sub_t)))
                if ph is not None:
                    ph.mark("copy.host")
                continue
            for i in idx:
                t = tensors[i]
                if not t.numel():
                    continue
                if arena.device.type == "cuda":   # a GPU staging buffer: a pinned upload never syncs the host
                    _dst(arena, offsets[i], t).copy_(t.to("cpu").pin_memory(), non_blocking=True)
                else:
                    _dst(arena, offsets[i], t).copy_(t.to("cpu"))
            if arena.device.type == "cuda" and idx:   # the uploads ran on the current stream: wait for them
                up = _sync_event()
                up.record(torch.cuda.current_stream(arena.device))
                events.append(up)
        return events, src_fps

    def _copy_cuda(self, dev: torch.device, tensors: list[torch.Tensor], offsets: list[int],
                   arena: torch.Tensor, block: str, late: list[bool] | None,
                   source: tuple[list[torch.Tensor], list[Piece]] | None = None, transfer_check: bool = True,
                   plan: _SavePlan | None = None, order_key: Any = None, ph: _Phases | None = None
                   ) -> tuple[Any, torch.Tensor | None]:
        mark = ph.mark if ph is not None else (lambda name: None)
        side = self._side_stream(dev)
        cur = torch.cuda.current_stream(dev)
        run_pieces = None
        if source is not None and source[1]:
            with torch.cuda.stream(side):   # a new plan's tables go up before the side stream waits for work
                key = plan.fp_keys.get(dev) if plan is not None else None   # `_plans_ready` made them
                run_pieces = self._piece_fingerprinter(dev, *source, key=key)
        side.wait_stream(cur)
        check = source is None and transfer_check and self.config.check_source_fingerprint is not False
        fps_host = None
        with torch.cuda.stream(side):
            # first what anything but the optimizer may change (ordered at once below), then the rest
            seq, early = _copy_order(plan, order_key, late, len(tensors))
            ev_early = None
            gp = bounce = None
            if self.config.gather_bytes and arena.device.type == "cpu" and dev not in self._gather_off:
                # gathered (checkpoint.gather): tens of copies, the early group's chunks first, then the event
                # kept under the copy order's key; without `late`, one group: (dev, None)
                gkey = order_key if order_key is not None or late is not None else (dev, None)
                try:
                    gp = self._gather_plan(dev, tensors, offsets, seq, early, plan, gkey)
                    bounce = self._bounce_for(dev, gp.bounce_bytes)
                except torch.cuda.OutOfMemoryError as e:   # nothing enqueued yet: copy per tensor instead
                    self._no_gather(dev, e)
                    gp = None
            # the copies only the update waits for go to the copy thread (block="update"): their enqueue can
            # block in the driver behind the previous save's queued copies; with no early group the pieces'
            # fingerprints go with them (nothing changes a late tensor before the update's wait)
            defer = (gp is None and block == "update" and late is not None and early < len(tensors)
                     and self.config.copy_thread)
            fp_later = defer and early == 0
            if run_pieces is not None:
                fps_host = self._words.take(len(source[1]))  # type: ignore[index]
                self._taken.append(fps_host)
            elif source is not None:
                fps_host = _NO_WORDS
            if check:
                fps_host = self._words.take(len(tensors))
                self._taken.append(fps_host)
            fingerprints = (run_pieces, tensors if check else None, fps_host, self._fp_stream(dev))
            if not fp_later:   # the pieces' fingerprints, before any copy reads on
                _enqueue_fingerprints(dev, *fingerprints)
            mark("copy.fingerprint")
            ev = _sync_event()
            if gp is not None:
                mark("copy.views")
                gp.run(0, arena, bounce, tensors)
                if 0 < early < len(tensors):
                    ev_early = _sync_event()
                    ev_early.record(side)
                gp.run(1, arena, bounce, tensors)
            else:
                dsts = self._dsts(dev, arena, tensors, offsets, plan)
                mark("copy.views")
                if 0 < early < len(tensors):
                    copy_all(dsts, tensors, seq[:early])
                    ev_early = _sync_event()
                    ev_early.record(side)
                    rest = seq[early:]
                else:
                    rest = seq
                if defer:
                    job = self._copy_job(dev, side, dsts, tensors, rest, ev, fingerprints if fp_later else None)
                    self._last_copy = job
                    ev = _QueuedCopy(side, ev, job)
                else:
                    copy_all(dsts, tensors, rest)
            if not defer:   # (the copy thread records it after its copies)
                ev.record(side)
            mark("copy.enqueue")
        # no record_stream per tensor (hundreds of allocator calls per save, issue 21): the save's background
        # holds a reference to every source tensor until it has seen the copy's event complete, so none is
        # freed (and its memory reused on any stream) while the side stream still reads it
        if block == "enqueue" or (block == "update" and late is not None and early == len(tensors)):
            cur.wait_event(ev)
        elif block == "update":
            if ev_early is not None:
                cur.wait_event(ev_early)      # tensors the optimizer does not change: ordered now
            self._inflight.append((dev, ev))  # the optimizer's: the update waits (CheckpointCopies)
        return ev, fps_host

    def _copy_job(self, dev: torch.device, side: Any, dsts: list[torch.Tensor | None], tensors: list[torch.Tensor],
                  idx: list[int], ev: Any, fingerprints: tuple[Any, Any, Any] | None
                  ) -> "concurrent.futures.Future[None]":
        """Hand the copies `idx` (and, when given, the pieces' fingerprints before them) to the copy thread,
        which enqueues them on the side stream and records `ev` after them."""
        def enqueue() -> None:
            with torch.no_grad(), torch.cuda.device(dev), torch.cuda.stream(side):
                if fingerprints is not None:
                    _enqueue_fingerprints(dev, *fingerprints)
                copy_all(dsts, tensors, idx)
                ev.record(side)
        return self._copier.submit(enqueue)

    def _gather_plan(self, dev: torch.device, tensors: list[torch.Tensor], offsets: list[int], seq: list[int],
                     early: int, plan: _SavePlan | None, order_key: Any) -> GatherPlan:
        """The gathered copies of this device's tensors (the first `early` of `seq` in a group of their own,
        copied first), kept in the save plan while its layout and copy order stay (issue 21: the chunk plan is
        made once per layout; a save loops over its tens of operations). Made on the current stream (the
        side stream: the gaps' zero bytes are allocated there)."""
        key = (order_key, self.config.gather_bytes)
        held = plan.gathers.get(key) if plan is not None and order_key is not None else None
        if held is None:
            zeros = self._gap_zeros.get(dev)
            if zeros is None:
                zeros = self._gap_zeros[dev] = torch.zeros(ALIGN, dtype=torch.uint8, device=dev)
            held = GatherPlan(tensors, offsets, [seq[:early], seq[early:]], self.config.gather_bytes, zeros)
            if plan is not None and order_key is not None:
                plan.gathers[key] = held
        return held

    def _no_gather(self, dev: torch.device, e: BaseException) -> None:
        """The bounce buffer does not fit in the device's memory: this device's saves copy per tensor."""
        self._gather_off.add(dev)
        self._bounce.pop(dev, None)
        log.warning("no GPU memory for the checkpoint's %d-byte bounce buffer on %s (%s): copying one "
                    "tensor at a time (SnapshotConfig.gather_bytes lower or 0 avoids this)",
                    self.config.gather_bytes, dev, e)

    def _bounce_for(self, dev: torch.device, need: int) -> torch.Tensor | None:
        """The device's bounce buffer of at least `need` bytes, made once (on the current stream: the side
        stream, the only one that uses it, so the allocator reuses its memory in stream order if it grows)."""
        if not need:
            return None
        held = self._bounce.get(dev)
        if held is None or held.numel() < need:
            held = self._bounce[dev] = torch.empty(need, dtype=torch.uint8, device=dev)
        return held

    def _dsts(self, dev: torch.device, arena: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int],
              plan: _SavePlan | None = None, host: bool = False) -> list[torch.Tensor | None]:
        """Each tensor's destination view in the staging buffer (None for an empty tensor), kept per buffer
        and layout: a slot is reused every few saves, and three view ops per tensor per save are a real
        share of the save's host time for a few hundred tensors. `host`: the views of a state's host tensors
        (kept apart: a GPU state's host group is another layout of the same buffers)."""
        attr = "_host_dst_cache" if host else "_dst_cache"
        ring, ptr = self._ring, arena.data_ptr()
        mine = arena.device.type == "cpu" and (
            (ptr == self._arena.buf.data_ptr() and arena.numel() == self._arena.buf.numel())
            or (ring is not None and any(sl.tensor.data_ptr() == ptr and sl.nbytes == arena.numel()
                                         for sl in list(ring.slots))))
        if not mine:   # only a slot or the private buffer: a cached view would keep a GPU staging buffer alive
            return [_dst(arena, off, t) if t.numel() else None for t, off in zip(tensors, offsets)]
        held = plan.dst_keys.get(dev) if plan is not None else None
        if held is not None and held[0] is offsets:   # the plan's offsets (or its per-device subset)
            key = held[1]
        else:
            key = (dev, tuple(offsets), tuple((t.dtype, tuple(t.shape)) for t in tensors))
            if plan is not None:
                plan.dst_keys[dev] = (offsets, key)
        with self._cache_lock:
            cache = getattr(self, attr)
            if cache.get("layout") != key:   # a new layout: the old views go (and their slots' pages)
                cache = {"layout": key}
                setattr(self, attr, cache)
            got = cache.get(ptr)
        if got is None:
            got = [_dst(arena, off, t) if t.numel() else None for t, off in zip(tensors, offsets)]
            with self._cache_lock:
                cache = getattr(self, attr)
                if cache.get("layout") == key:
                    cache[ptr] = got
                    while len(cache) > (ring.max_slots if ring is not None else 0) + 2:   # + arena
                        cache.pop(next(k for k in cache if k != "layout"))
        return got

    def _piece_fingerprinter(self, dev: torch.device, tensors: list[torch.Tensor], cut: list[Piece],
                             key: Any = None) -> Callable[[], torch.Tensor]:
        """A call that launches (on the current stream: the fingerprint stream) the fingerprint of every
        piece of this device's tensors and returns int64 [len(cut), 2] on the device. The fused Triton plan
        is kept while the layout (the tensors' addresses, dtypes, shapes and the pieces) stays; without
        Triton (or for a non-contiguous tensor, fingerprinted from a contiguous copy), torch ops."""
        key = self._plan_key(tensors, cut) if key is None else key
        held = self._fp_plans.get(dev)
        if held is None or (held[0] is not key and held[0] != key):
            held = None
            if (triton_available() and _triton_ready(dev)
                    and all(tensors[p.tensor].is_contiguous() for p in cut)):
                held = self._fp_plans[dev] = (key, prepare_fingerprint(_piece_views(tensors, cut)))
        if held is not None:
            plan = held[1]

            def run() -> torch.Tensor:
                per = torch.empty(len(cut), 2, dtype=torch.int64, device=dev)
                plan.run_async(per_tensor_out=per)
                return per
            return run
        # torch ops (no Triton, or its kernel still compiling in the background): the per-piece header table
        # goes up now, before the side stream waits for the training's work (a pageable upload syncs it)
        if all(tensors[p.tensor].is_contiguous() for p in cut):   # views: read when the kernels run
            return prepare_fingerprint_torch(_piece_views(tensors, cut))

        def run_copied() -> torch.Tensor:   # a non-contiguous tensor is read (copied) after the wait only
            per = torch.empty(len(cut), 2, dtype=torch.int64, device=dev)
            fingerprint_tensors_async(_piece_views(tensors, cut), per_tensor_out=per)
            return per
        return run_copied

    def _plan_key(self, tensors: list[torch.Tensor], cut: list[Piece]) -> tuple[Any, Any]:
        return (tuple((tensors[p.tensor].data_ptr(), p.start, p.length) for p in cut),
                tuple((tensors[p.tensor].dtype, tuple(tensors[p.tensor].shape)) for p in cut))

    def _dev_pieces(self, tensors: list[torch.Tensor], cut: list[Piece]) -> dict[torch.device, list[Piece]]:
        out: dict[torch.device, list[Piece]] = {}
        for p in cut:
            dev = tensors[p.tensor].device
            if dev.type == "cuda":
                out.setdefault(dev, []).append(p)
        return out

    def _plans_ready(self, tensors: list[torch.Tensor], cut: list[Piece], plan: _SavePlan | None = None
                     ) -> bool:
        """Is every CUDA device's fused fingerprint plan for this layout built (or will the torch ops be used
        anyway: no Triton, or a non-contiguous tensor)? A save never builds one (`_plan_ahead` does).
        `plan`: the save plan whose pieces `cut` are; its per-device pieces and plan keys are kept in it."""
        if not triton_available():
            return True
        if plan is not None and plan.cut is cut:
            keys = self._fp_keys(plan, tensors)
        else:
            keys = {dev: self._fp_key(tensors, mine) for dev, mine in self._dev_pieces(tensors, cut).items()}
        for dev, key in keys.items():
            if key is False:
                continue
            held = self._fp_plans.get(dev)
            if held is None:
                return False
            if held[0] is not key:   # built on the plan thread from a key of its own: compared once, then
                if held[0] != key:   # the save plan's key object stands for it (an identity check per save)
                    return False
                self._fp_plans[dev] = (key, held[1])
        return True

    def _fp_key(self, tensors: list[torch.Tensor], mine: list[Piece]) -> Any:
        """A device's fingerprint plan key for its pieces `mine`; False when a tensor is not contiguous (torch
        ops fingerprint it: no plan)."""
        return self._plan_key(tensors, mine) if all(tensors[p.tensor].is_contiguous() for p in mine) else False

    def _fp_keys(self, plan: _SavePlan, tensors: list[torch.Tensor]) -> dict[torch.device, Any]:
        """Each CUDA device's fingerprint plan key for the save plan's pieces, made once per plan (by
        prepare()'s plan thread, or the first save) and kept in it."""
        if plan.dev_pieces is None:
            plan.dev_pieces = self._dev_pieces(tensors, plan.cut or [])
        for dev, mine in plan.dev_pieces.items():
            if dev not in plan.fp_keys:
                plan.fp_keys[dev] = self._fp_key(tensors, mine)
        return plan.fp_keys

    def _plan_ahead(self, tensors: list[torch.Tensor], cut: list[Piece]) -> None:
        """Build this layout's fingerprint plans on the plan thread (once at a time; a later save that finds
        them ready uses them)."""
        with self._plan_lock:
            if self._plan_fut is not None and not self._plan_fut.done():
                return
            if self._plan_pool is None:
                self._plan_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdcw-ckpt-plan")
            self._plan_fut = self._plan_pool.submit(self._build_plans, list(tensors), list(cut))

    def _build_plans(self, tensors: list[torch.Tensor], cut: list[Piece], timeout: float = 600.0) -> None:
        """Plan thread (or prepare()): wait for the fingerprint kernel's compile, then build and upload each
        CUDA device's plan for this layout on its side stream (what the first save would otherwise do)."""
        try:
            for dev, mine in self._dev_pieces(tensors, cut).items():
                if not triton_available():
                    return
                _triton_ready(dev)
                if not _warm[dev].wait(timeout):
                    log.warning("the fingerprint kernel did not compile on %s in %.0f s", dev, timeout)
                    return
                side = self._side_stream(dev)
                with torch.cuda.device(dev), torch.cuda.stream(side):
                    run = self._piece_fingerprinter(dev, tensors, mine)
                    # one run now (its result unused): the first save then finds its pinned words buffer
                    # made and the launch path warm
                    host = self._words.take(len(mine))
                    host.copy_(run(), non_blocking=True)
                side.synchronize()
                self._words.give([host])
        except Exception as e:  # noqa: BLE001 - saves go on with host checksums until a plan is there
            log.warning("building the checkpoint fingerprint plan failed: %s", e)

    def _make_streams(self, dev: torch.device) -> None:
        """The save's streams on `dev` (side and fingerprint), made ahead of the first save."""
        self._side_stream(dev)
        self._fp_stream(dev)

    def _fp_stream(self, dev: torch.device) -> Any:
        """The stream a save's fingerprint kernels run on (`_enqueue_fingerprints`): one per device, made
        with the side stream ahead of the first save (`prepare`, a guard's binding) or by that save."""
        st = self._fp_streams.get(dev)
        if st is None:
            st = self._fp_streams[dev] = torch.cuda.Stream(device=dev)
        return st

    def _side_stream(self, dev: torch.device) -> Any:
        side = self._side.get(dev)
        if side is None:
            side = self._side[dev] = torch.cuda.Stream(device=dev)
        return side

    # ---- the background -----------------------------------------------------------------------------
    def _background_giving(self, taken: list[torch.Tensor], *args: Any) -> SaveResult:
        """`_background`, then the fingerprint words' buffers this save took given back (`_WordBuffers`),
        before its future is done: a later save that waited for this one finds them free (given back from a
        done-callback instead, they raced that save and a steady save could make a buffer)."""
        try:
            return self._background(*args)
        finally:
            if taken:
                self._words.give(taken)

    def _background(self, step: int, tree: Any, entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int]],
                    total: int, arena: torch.Tensor, events: list[Any], src_fps: dict[int, torch.Tensor],
                    blocking: float, returned: float, slot: Slot | None = None, stall: float = 0.0,
                    skipped: int = 0, cut: list[Piece] | None = None,
                    staged_box: list[torch.Tensor] | None = None,
                    phases: dict[str, float] | None = None, sources: list[Any] | None = None,
                    restored: Restored | None = None) -> SaveResult:
        res = SaveResult(step, "FAILED", nbytes=total, blocking_s=blocking, stall_s=stall,
                         checksums="host" if cut is None else "source", phases=phases or {})
        ph = _Phases("b.", cpu=True, out=res.phases)
        ph.t -= time.perf_counter() - returned   # queued behind earlier saves: counted as the wait
        try:
            try:   # begun while the copy runs: its round trip overlaps the copy (issue 21)
                if restored is not None and self._sink_takes_restored:   # the restore known at the copy
                    begin = self.sink.begin(self.job_id, step, self.rank, self.world_size, restored=restored)
                else:
                    begin = self.sink.begin(self.job_id, step, self.rank, self.world_size)
                ph.mark("begin")
            finally:   # whatever happens next (the slot released, reused), the copy has landed first
                failed: BaseException | None = None
                for ev in events:
                    try:
                        ev.synchronize()   # the GIL released while it waits
                    except Exception as e:  # noqa: BLE001 - every device's copies are waited for first
                        failed = failed or e
                if sources:   # the copy read them: their memory may be freed and reused from now on
                    sources.clear()
                ph.mark("wait_copy")
                if failed is not None:
                    raise failed
            res.host_s, res.cpu_s = -time.perf_counter(), -time.thread_time()   # the work from here on
            if staged_box:   # the copy went to a GPU buffer: now the host buffer, and the copy to it
                res.device_staged = True
                arena = self._unstage(staged_box.pop(), total, tuple(e[3] for e in entries))
                # the box held the only reference past save(): the GPU memory goes back now
            ph.mark("unstage")
            if begin.state not in ("PENDING",):
                res.state = begin.state
                res.error = f"step {step} is already {begin.state}; shard not written again"
                if slot is not None and self._ring is not None:
                    self._ring.release(slot)
                res.host_s = res.cpu_s = 0.0
                return res
            view = memoryview(arena.numpy()).cast("B")[:total]
            store = self._store_for(begin.location)
            chunks: list[Chunk] = []
            res.staging = "private"
            if slot is not None and self._publish_slot(store, begin, slot):
                res.staging = "slot"
                res.safe_s = time.perf_counter() - returned
                if cut is None:
                    t0 = time.perf_counter()
                    chunks = checksum_chunks(view, self.config.chunk_bytes)
                    res.checksum_s = time.perf_counter() - t0
            elif cut is not None:   # checksums known from the source: the write only moves bytes
                store.put(begin.blob_key, iter_chunks(view, self.config.chunk_bytes))
                res.safe_s = time.perf_counter() - returned
            else:
                t0 = time.perf_counter()
                store.put(begin.blob_key, iter_checksummed(view, self.config.chunk_bytes, chunks))
                res.safe_s = time.perf_counter() - returned
                res.checksum_s = res.safe_s - (t0 - returned)  # checksums interleaved with the write
            if not self._slots_off:
                self._location = begin.location
            ph.mark("publish")
            if cut is not None:
                words = self._piece_words(step, entries, src_fps, cut, res, arena)
                shard = self._shard_layout(tree, entries, total, cut)
                report = SaveReport(blocking, res.safe_s, stall, skipped, res.staging)
                if self._sink_takes_words:   # the agent renders the manifest from the words (shard_layout)
                    ph.mark("sums")
                    commit = self.sink.commit_words(self.job_id, step, self.rank, self.world_size, shard,
                                                    words, time.time(), blob=begin.blob_key, report=report)
                else:
                    text = shard.render(step, begin.blob_key, words, time.time())
                    ph.mark("sums_json")
                    commit = self.sink.commit_shard(self.job_id, step, self.rank, self.world_size,
                                                    text, report=report)
                ph.mark("commit")
                res.commit_s = time.perf_counter() - returned
                res.state, res.committed_now = commit.state, commit.committed_now
                out = self._finish(res, slot, skipped, total)
                ph.mark("finish")
                return out
            t0 = time.perf_counter()
            fps = list(self._fp_pool.map(lambda e: fingerprint_bytes(view[e[3]:e[3] + e[4]], dtype_name(e[1]), e[2]),
                                         entries))
            res.fingerprint_s = time.perf_counter() - t0
            ph.mark("sums")
            tensors = []
            for i, (path, dt, shape, off, n) in enumerate(entries):
                fp = fps[i]
                src = src_fps.get(i)
                if src is not None:
                    want = tuple(int(v) & MASK64 for v in src.tolist())
                    if want != fp:
                        raise CorruptCheckpointError(
                            f"step {step} rank {self.rank} tensor {path}: host copy fingerprint {fp} differs from "
                            f"the GPU fingerprint {want} taken before the copy (corrupted in transfer)")
                tensors.append(TensorEntry(path, dtype_name(dt), shape, off, n, fp))
            manifest = ShardManifest(self.job_id, step, self.rank, self.world_size, begin.blob_key, total,
                                     self.config.chunk_bytes, tuple(chunks), tuple(tensors), tree, time.time(),
                                     replica_set=self.replica_set)
            text = manifest.to_json()
            ph.mark("json")
            report = SaveReport(blocking, res.safe_s, stall, skipped, res.staging)
            commit = self.sink.commit_shard(self.job_id, step, self.rank, self.world_size, text,
                                            report=report)
            ph.mark("commit")
            res.commit_s = time.perf_counter() - returned
            res.state, res.committed_now = commit.state, commit.committed_now
        except Exception as e:  # noqa: BLE001 - a failed save must never reach the training loop
            res.error = f"{type(e).__name__}: {e}"
            log.warning("checkpoint step %d rank %d failed: %s", step, self.rank, res.error)
        return self._finish(res, slot, skipped, total)

    def _device_stage(self, tensors: list[torch.Tensor], total: int, block: str) -> torch.Tensor | None:
        """A zeroed GPU buffer of `total` bytes for a save that finds no host buffer ready (the first one,
        or the first after the state changed size: once per size, never in steady state), when the state
        is on one GPU with room to spare and the save does not promise a finished host copy (`block` is
        not "copy"). The copy into it runs at device memory speed; the background makes the pinned host
        buffer and copies there (`_unstage`). Costs `total` bytes of GPU memory until then (given back to
        torch's caching allocator). None: stage on the host as before."""
        if not self.config.device_staging or block == "copy" or total == 0 or total in self._staged_sizes:
            return None   # once per state size: later saves find a buffer made ahead (or skip / wait)
        devs = {t.device for t in tensors if t.device.type == "cuda"}
        if len(devs) != 1:
            return None
        dev = devs.pop()
        try:
            free, _ = torch.cuda.mem_get_info(dev)
            free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        except RuntimeError:
            return None
        if total > DEVICE_STAGING_SHARE * free:
            log.info("no room to stage a %d-byte checkpoint on %s (%d bytes free): staging on the host, "
                     "blocking while its buffer is made", total, dev, free)
            return None
        self._staged_sizes.add(total)
        return torch.zeros(total, dtype=torch.uint8, device=dev)

    def _unstage(self, staged: torch.Tensor, total: int, offsets: tuple[int, ...]) -> torch.Tensor:
        """Background: the private host buffer (made now, pinned), holding the GPU staging buffer's bytes."""
        host = self._arena.ensure(total)
        if staged.device.type == "cuda":
            side = self._side[staged.device]
            with torch.cuda.stream(side):
                host[:total].copy_(staged, non_blocking=True)
                ev = _sync_event()
                ev.record(side)
            ev.synchronize()
        else:
            host[:total].copy_(staged)
        self._mark_zeroed(host.data_ptr(), (offsets, total))   # the gaps came over as zeros
        return host

    def _piece_words(self, step: int, entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int]],
                     src_fps: dict[Any, Any], cut: list[Piece], res: SaveResult,
                     arena: torch.Tensor) -> np.ndarray:
        """The pieces' fingerprint words [pieces, 2] int64 (checkpoint.source_sums), in one array: the GPU's,
        and for CPU tensors' pieces the host's, fingerprinted here from the host copy (numpy, threads). No
        host byte of a GPU tensor is read; the manifest follows from these (`ShardLayout.render`)."""
        t0 = time.perf_counter()
        words = np.zeros((len(cut), 2), dtype=np.int64)
        filled = np.zeros(len(cut), dtype=bool)
        view = None
        for key, val in src_fps.items():
            if isinstance(key, tuple) and key[0] == "pieces":
                idx, per = val
                if len(idx):
                    at = np.asarray(idx, dtype=np.intp)
                    words[at] = per.numpy().reshape(len(idx), 2)
                    filled[at] = True
            elif isinstance(key, tuple) and key[0] == "host pieces":
                if view is None:
                    view = memoryview(arena.numpy()).cast("B")

                def piece_words(j: int, host: memoryview = view) -> tuple[int, int]:
                    p = cut[j]
                    at = entries[p.tensor][3] + p.start
                    return fingerprint_bytes(host[at:at + p.length], "uint8", (p.length,))
                small = sum(cut[j].length for j in val) < HOST_PIECES_INLINE
                # a GPU state's few host tensors (its plain values, step counts): here, not through the pool
                got = [piece_words(j) for j in val] if small else list(self._fp_pool.map(piece_words, val))
                if got:
                    at = np.asarray(val, dtype=np.intp)
                    words[at] = np.array(got, dtype=np.uint64).view(np.int64).reshape(len(got), 2)
                    filled[at] = True
        if not filled.all():
            raise CorruptCheckpointError(f"step {step} rank {self.rank}: a piece has no source fingerprint")
        res.checksum_s = time.perf_counter() - t0
        return words

    def _shard_layout(self, tree: Any, entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int]],
                      total: int, cut: list[Piece]) -> ShardLayout:
        """This layout's ShardLayout (its CombinePlan and ManifestTemplate), kept while the layout (the
        pieces, the entries, the tree) stays: a comparison per save, the plan's arrays and JSON fragments
        once per layout."""
        held = self._combine
        if (held is not None and held[0] is cut and held[1] == total
                and (held[2] is entries or held[2] == entries)   # the save plan's list, the Flattener's tree:
                and (held[3] is tree or held[3] == tree)):       # the same objects while the layout stays
            return held[4]
        named = [(path, dtype_name(dt), shape, off, n) for path, dt, shape, off, n in entries]
        shard = ShardLayout(self.job_id, self.rank, self.world_size, total, self.config.chunk_bytes, named, tree,
                            self.replica_set, cut=cut)
        self._combine = (cut, total, entries, tree, shard)
        return shard

    def _finish(self, res: SaveResult, slot: Slot | None, skipped: int, total: int) -> SaveResult:
        if res.host_s < 0:
            res.host_s += time.perf_counter()
            res.cpu_s += time.thread_time()
        if slot is not None and self._ring is not None:
            self._ring.release(slot)
        if res.error:
            self._failed += 1
        elif res.state in ("COMMITTED", "VERIFIED"):
            self._committed += 1
        res.skipped_before = skipped
        if self._spare_pool is not None:   # pipelined: the slot thread makes them; the next commit goes on
            self._want_spares(total)
            return res
        try:
            res.spare_s = self._make_spare(total)   # the next save's slot, made now, off the training thread
        except Exception as e:  # noqa: BLE001
            log.warning("creating a staging slot ahead failed: %s", e)
        return res

    def _want_spares(self, total: int) -> None:
        """Pipelined: have the slot thread fill the ring to its limit (unless it is at it). Once the ring is
        full (after warm-up) this is one length check: no slot is made in steady state, so no pinned
        allocation or cudaHostRegister runs beside training (they stall its CUDA calls and the GIL); a save
        that finds no free slot then is skipped ("slots") until the agent frees one."""
        pool = self._spare_pool
        ring = self._ring
        if pool is None or (ring is not None and not self._reset_ring and len(ring) >= ring.max_slots):
            return
        fut = self._spare_fut
        if fut is not None and not fut.done():
            return
        try:
            self._spare_fut = pool.submit(self._make_spares, total)
        except RuntimeError:   # closed
            pass

    def _make_spares(self, total: int) -> float:
        """Slot thread (or prepare()): create slots until the ring is at its limit, all in one go (warm-up:
        the first saves after the agent's dir is known); seconds taken."""
        t0 = time.perf_counter()
        try:
            while True:
                ring = self._ring_for(total)
                made = ring.ensure_spare(total, want=ring.max_slots) if ring is not None else None
                if made is None:
                    break
                self._ready_fresh(made)
        except OSError as e:
            log.warning("cannot create a staging slot of %d bytes in %s ahead (%s)", total, self._location, e)
        except Exception as e:  # noqa: BLE001 - saves go on (skipped, counted) without a spare
            log.warning("creating staging slots ahead failed: %s", e)
        return time.perf_counter() - t0

    def _ready_fresh(self, slot: Slot) -> None:
        """Off the training thread, for a slot just made (all zero bytes): mark its gaps zero for the last
        layout and make its destination views, so its first save costs a steady one."""
        try:
            with self._cache_lock:
                hint = self._zero_hint
                if hint is not None and hint[1] == slot.nbytes:
                    self._zeroed[slot.tensor.data_ptr()] = hint
            for attr in ("_dst_cache", "_host_dst_cache"):
                with self._cache_lock:
                    key = getattr(self, attr).get("layout")
                if key is None:
                    continue
                _, offs, metas = key
                arena = slot.tensor
                views = []
                for off, (dt, shape) in zip(offs, metas):
                    n = math.prod(shape) * dt.itemsize
                    if off + n > arena.numel():
                        break   # another layout: its first save makes its views
                    views.append(arena[off:off + n].view(dt).view(shape) if n else None)
                else:
                    with self._cache_lock:
                        cache = getattr(self, attr)
                        if cache.get("layout") == key:
                            cache[arena.data_ptr()] = views
        except Exception as e:  # noqa: BLE001 - an optimisation: the save makes what is missing
            log.debug("preparing a fresh slot's views failed: %s", e)

    def _ready_views(self, arena: torch.Tensor, dev: torch.device, offsets: list[int],
                     metas: list[tuple[torch.dtype, Any]]) -> None:
        """Off the training thread (prepare): the destination views of `arena` for this layout, as `_dsts`
        keeps them, so the first save into it makes none."""
        key = (dev, tuple(offsets), tuple((dt, tuple(shape)) for dt, shape in metas))
        views = []
        for off, (dt, shape) in zip(offsets, metas):
            n = math.prod(shape) * dt.itemsize
            views.append(arena[off:off + n].view(dt).view(shape) if n else None)
        attr = "_host_dst_cache" if dev.type == "cpu" else "_dst_cache"   # as `_dsts` keeps them
        with self._cache_lock:
            cache = getattr(self, attr)
            if cache.get("layout") != key:
                cache = {"layout": key}
                setattr(self, attr, cache)
            cache[arena.data_ptr()] = views

    def _same_dir(self, location: str, root: str) -> bool:
        """Is the agent's dir the ring's? Resolved once per pair (two realpath calls per save were system
        calls and GIL round trips beside training, issue 21); a moved or wiped dir shows when the link fails."""
        if self._same_dirs == (location, root):
            return True
        same = os.path.realpath(location) == os.path.realpath(root)
        if same:
            self._same_dirs = (location, root)
        return same

    def _ring_short(self, ring: SlotRing, total: int) -> None:
        """A pipelined save found every slot holding a stored checkpoint and none in flight: the ring is
        smaller than the agent's retention plus a save (cut by memory, or `max_slots`). Said once; from now
        on the private buffer is kept for such saves (not freed when a slot is taken again)."""
        if not self._short:
            self._short = True
            log.warning("checkpoint ring for %s rank %d: all %d slots of %d bytes hold checkpoints the agent "
                        "keeps and none is in flight, so the agent frees none until a newer checkpoint "
                        "commits: such saves go through a private buffer (copied again into node memory). "
                        "A ring of %d slots avoids it (SnapshotConfig.max_slots: max_inflight + the checkpoints "
                        "the agent may keep + 1); with max_slots='auto' the ring was cut by memory", self.job_id,
                        self.rank, ring.max_slots, total,
                        pipelined_ring(self.config.max_inflight))

    def _ring_full(self, total: int) -> bool:
        ring = self._ring
        return ring is not None and len(ring) >= ring.max_slots and not ring.free_slots(total)

    def _publish_slot(self, store: BlobStore, begin: Any, slot: Slot) -> bool:
        """Publish the slot as the shard's blob by a hard link; False when that cannot be done here (the
        agent's dir moved or was wiped, or the store is not a directory): the caller copies instead."""
        link_in = getattr(store, "link_in", None)
        ring = self._ring
        if link_in is None or ring is None or not self._same_dir(begin.location, ring.root):
            self._reset_ring = True
            return False
        try:
            link_in(begin.blob_key, slot.path)
            return True
        except OSError as e:
            log.warning("publishing staging slot %s as %s failed (%s); copying instead", slot.path,
                        begin.blob_key, e)
            self._reset_ring = True
            return False


class CheckpointCopies:
    """`Phase.COPIES` stage of the step guard: the update waits (on the device) for the copies of the
    weights a save left in flight (`SnapshotConfig(block="update")`). Costs one list check per step.
    `optimizer`: the guarded optimizer, whose tensors are the ones left in flight (see the module doc)."""

    phase = Phase.COPIES

    def __init__(self, snapshotter: Snapshotter, optimizer: torch.optim.Optimizer | None = None) -> None:
        self._snapshotter = snapshotter
        self.optimizer = optimizer
        self.name = f"checkpoint.copies[{snapshotter.job_id} rank {snapshotter.rank}]"

    def run(self, ctx: StepContext) -> Veto | None:
        self._snapshotter.order_before_update()
        return None


_SKIP_WHY = {"copying": "the previous save's copy is still in flight",
             "slots": "every staging slot is in flight or holds a stored checkpoint (the ring is full)",
             "writing": "the previous save is still being hashed and committed",
             "preparing": "its staging buffer is still being made, in the background"}


def optimizer_storages(optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """The storage addresses of everything `optimizer.step()` changes: its parameters and its state (a
    container's, torchtitan's `OptimizersContainer`: the states of the optimizers it holds)."""
    out: set[int | None] = set()
    for p, st in param_states(optimizer):
        out.add(_storage(p))
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.add(_storage(v))
    out.discard(None)
    return frozenset(x for x in out if x is not None)


def _storage(t: torch.Tensor) -> int | None:
    """The address of `t`'s storage; None when it has none to read (a tensor subclass without storage):
    such a tensor is never matched, so its copy is ordered at once (the safe side)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return ptr or None


_ops_warm: set[torch.dtype] = set()   # the dtypes `_warm_ops` copied once


def _warm_ops(dtypes: Iterable[torch.dtype] = ()) -> None:
    """The first foreach copy and the first slice-and-view in a process cost milliseconds (the dispatcher's
    first calls: 1.5 ms and 0.8 ms on the 2-core VM), and the first copy of each dtype after it a fraction
    of one (uint8, a plain value's bytes: 0.17 ms on the 2-core VM, 0.4 ms on the H200's host): made here by
    prepare(), for the dtypes of the state's host tensors and plain values, not by the first save."""
    for dt in (torch.float32, torch.uint8, *dtypes):
        if dt in _ops_warm:
            continue
        buf = torch.zeros(64, dtype=torch.uint8)
        src = [torch.ones(4, dtype=dt)]
        copy_all([_dst(buf, 0, src[0])], src, [0])
        _ops_warm.add(dt)


def _drop(box: list[Any]) -> None:
    box.clear()


def _event_done(ev: Any) -> bool:
    """Has a copy's event completed? Non-blocking (a query)."""
    return bool(ev.query())


def _stream_wait(dev: torch.device, ev: Any) -> None:
    """The device's current stream waits for `ev` (on the device; the host goes on; for copies the copy
    thread enqueues, the host first waits for their enqueue, normally long done)."""
    if isinstance(ev, _QueuedCopy):
        ev = ev.enqueued()
    torch.cuda.current_stream(dev).wait_event(ev)


class _QueuedCopy:
    """The event of copies handed to the copy thread (`SnapshotConfig.copy_thread`): recorded by that thread
    once it has enqueued them. Waits and queries see the enqueue first, then the event."""

    __slots__ = ("side", "event", "job")

    def __init__(self, side: Any, event: Any, job: "concurrent.futures.Future[None]") -> None:
        self.side, self.event, self.job = side, event, job

    def enqueued(self) -> Any:
        """The event to order on: the copy thread's, or when its enqueue failed an event after whatever
        it did enqueue on the side stream (that save fails; the update still comes after its copies)."""
        try:
            self.job.result()
            return self.event
        except Exception as e:  # noqa: BLE001 - the save reports it; the update must not hang or race
            log.warning("enqueueing a checkpoint's copies failed: %s", e)
            ev = torch.cuda.Event()
            ev.record(self.side)
            return ev

    def synchronize(self) -> None:
        try:
            self.job.result()
        except Exception:   # the save fails with the enqueue's error, once what it enqueued has run
            self.side.synchronize()
            raise
        self.event.synchronize()

    def query(self) -> bool:
        if not self.job.done():
            return False
        return self.job.exception() is not None or bool(self.event.query())


def _enqueue_fingerprints(dev: torch.device, run_pieces: Callable[[], torch.Tensor] | None,
                          check: list[torch.Tensor] | None, fps_host: torch.Tensor | None, fst: Any) -> None:
    """Called on the side stream, before the copies read on: the pieces' fingerprints (`run_pieces`, source
    checksums) or each tensor's (`check`: the transfer check), into `fps_host`, on the fingerprint stream
    `fst` after what the side stream has waited for (the training's work up to the save); the side stream
    then waits on the device for a plain event after them, so the copies, their event (which the update and
    the save's background wait for) and the words' reader come after them. Not the kernels on the side
    stream itself: with the event the host synchronises on behind them there (or a blocking-sync event right
    after them on their own stream), some clients paid +1.5 ms a step with 3 GB/s coming in over PCIe, where
    this arrangement cost them what it costs the others (issue 21, H200 ckpt41-46)."""
    if fps_host is None or (run_pieces is None and check is None):
        return
    side = torch.cuda.current_stream(dev)
    fst.wait_stream(side)
    with torch.cuda.stream(fst):
        if run_pieces is not None:
            fps_host.copy_(run_pieces(), non_blocking=True)
        else:
            per = torch.empty(len(check), 2, dtype=torch.int64, device=dev)   # type: ignore[arg-type]
            fingerprint_tensors_async(check, per_tensor_out=per)   # type: ignore[arg-type]
            fps_host.copy_(per, non_blocking=True)
        done = torch.cuda.Event()   # only streams wait for it, never the host
        done.record(fst)
    side.wait_event(done)


_NO_WORDS = torch.empty(0, 2, dtype=torch.int64)   # a device whose tensors have no pieces: no words


def _sync_event() -> Any:
    """A CUDA event of the save that the background (or a blocking save) waits for on the host:
    blocking-sync, so that synchronize() sleeps in the driver instead of spinning a core for the whole copy
    (H200: 48-88 ms of CPU per save with a default event, issue 21)."""
    return torch.cuda.Event(blocking=True)


_GATHER_ON_HOST = False   # tests: a CPU state's copies into host memory take the gathered path (as on CUDA)

_warm_lock = threading.Lock()
_warm: dict[torch.device, threading.Event] = {}


def _triton_ready(dev: torch.device) -> bool:
    """Is the fingerprint kernel compiled for `dev`? If not, compile it in a thread of its own (on a tiny
    tensor and a stream of its own) and say no: a save never blocks on the JIT (seconds); it fingerprints
    with torch ops meanwhile."""
    with _warm_lock:
        ev = _warm.get(dev)
        if ev is None:
            ev = _warm[dev] = threading.Event()
            threading.Thread(target=_warm_triton, args=(dev, ev), name="sdcw-ckpt-fp-jit", daemon=True).start()
    return ev.is_set()


def _warm_triton(dev: torch.device, done: threading.Event) -> None:
    try:
        with torch.cuda.device(dev):
            stream = torch.cuda.Stream(device=dev)
            with torch.cuda.stream(stream):
                t = torch.zeros(256, dtype=torch.uint8, device=dev)
                # 1, 2 and 16 tensors: Triton specializes an int argument (the finaliser's count) equal to 1
                # or divisible by 16, so each kind is compiled here, not in a save
                for m in (1, 2, 16):
                    prepare_fingerprint([t[: 4 * k + 5] for k in range(m)]).run_async()
            stream.synchronize()
        done.set()
    except Exception as e:  # noqa: BLE001 - saves go on with torch ops
        log.warning("compiling the fingerprint kernel on %s failed (%s): checkpoint fingerprints use torch ops",
                    dev, e)


def _piece_views(tensors: list[torch.Tensor], cut: list[Piece]) -> list[torch.Tensor]:
    """Each piece as a 1-D uint8 view of its tensor's bytes (a contiguous copy of a non-contiguous one)."""
    flat: dict[int, torch.Tensor] = {}
    out = []
    for p in cut:
        b = flat.get(p.tensor)
        if b is None:
            t = tensors[p.tensor]
            b = flat[p.tensor] = t.detach().contiguous().reshape(-1).view(torch.uint8)
        out.append(b[p.start:p.start + p.length])
    return out


def copy_all(dsts: list[torch.Tensor | None], srcs: list[torch.Tensor], idx: list[int]) -> None:
    """`dsts[j].copy_(srcs[j], non_blocking=True)` for j in `idx` (skipping empty ones), enqueued by one
    `torch._foreach_copy_` call (one dispatch instead of one per tensor); per tensor if that is refused."""
    pairs = [(dsts[j], srcs[j]) for j in idx if dsts[j] is not None]
    if not pairs:
        return
    d = [p[0] for p in pairs]
    s = [p[1] for p in pairs]
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach(d, s, non_blocking=True)
            return
        except (RuntimeError, TypeError, NotImplementedError) as e:   # copies are idempotent: redo them one by one
            log.debug("torch._foreach_copy_ refused the checkpoint copies (%s): copying one by one", e)
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)


def _dst(arena: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
    n = t.numel() * t.element_size()
    return arena[offset:offset + n].view(t.dtype).view(t.shape)
