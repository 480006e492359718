"""Staging slots: the rank's pinned host buffer IS a file in the agent's memory tier.

Why (measured, docs/checkpoints.md): writing a fresh tmpfs file costs 2-6x a plain memory copy (page
allocation and zeroing), so a save that copies GPU -> private pinned buffer -> /dev/shm file makes its
bytes safe only several copies after `save` returns. Instead each rank keeps a small ring of slot files
in `<memory dir>/.slots/<job>/`, each preallocated, mapped once (MAP_SHARED | MAP_POPULATE) and, on
CUDA, registered with `cudaHostRegister` (so the device-to-host copy is a real async DMA). The copy into
a slot is the write into node memory: once it completes, the bytes survive the training process.
Publishing the shard is then a hard link (`DirStore.link_in`): no bytes move.

Lifecycle of a slot:
0. `SlotRing.ensure_spare(nbytes)`  run off the training thread (the Snapshotter's background worker,
                               after a commit, or `Snapshotter.prepare`): creates a slot of `nbytes`
                               ahead, so the next save finds one ready and never pays fallocate +
                               populate + cudaHostRegister;
1. `SlotRing.acquire(nbytes)`  a slot of exactly `nbytes` that no checkpoint references (its file's link
                               count is 1: only the slot name), created on first use (up to `max_slots`) only
                               when none was made ahead;
2. the caller copies into `slot.tensor` and the background publishes it as the shard's blob (link count 2);
3. when the agent evicts or aborts that checkpoint it unlinks the blob name, the link count drops to 1
   and the slot is free again: the filesystem is the reference count, no protocol needed;
4. `SlotRing.close()` unregisters, unmaps and unlinks the slot names (published blobs stay).

Ownership: the rank holds a shared `flock` on each slot file for its lifetime. The agent's
`checkpoint.shm_store.sweep_dead_slots` unlinks slot names whose lock it can take exclusively (the rank is
gone), so a killed rank's staging memory is returned; blobs linked to those slots keep their bytes.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import itertools
import logging
import mmap
import os
import stat
import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from checkpoint.errors import InvalidInputError
from checkpoint.names import validate_job_id
from checkpoint.shm_store import SLOTS_DIR, disk_filesystem

log = logging.getLogger(__name__)

_counter = itertools.count()


def _cudart_call(name: str, *args: int) -> int:
    """`torch.cuda.cudart().<name>(*args)` on a thread of its own, its cudaError returned. A failing runtime
    call also leaves its error as the calling thread's "last error", which the next kernel launch's check
    there (torch's) raises as its own: a slot whose registration failed on the training thread made the
    next forward fail with "CUDA error: invalid argument" (H200, 2026-12-02). The runtime keeps that error
    per host thread, so on a thread that then ends it reaches no one."""
    box: list[int | BaseException] = []

    def call() -> None:
        try:
            box.append(int(getattr(torch.cuda.cudart(), name)(*args)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append(e)
    t = threading.Thread(target=call, name="sdcw-cudart", daemon=True)
    t.start()
    t.join()
    got = box[0] if box else RuntimeError(f"{name} did not return")
    if isinstance(got, BaseException):
        raise got
    return got


def _why_not_pinned(where: Path | None) -> str:
    kind = disk_filesystem(where) if where is not None else ""
    if kind:
        return (f" ({where} is on {kind}: the kernel does not pin a disk filesystem's file pages for a "
                "device; put the memory dir on tmpfs, e.g. under /dev/shm)")
    return ""


def register_host_memory(ptr: int, nbytes: int, where: Path | None = None) -> bool:
    """`cudaHostRegister` (portable) the range; False (and a log line, naming `where`'s filesystem when that
    is the likely cause) when CUDA or the call fails."""
    if not torch.cuda.is_available() or nbytes == 0:
        return False
    try:
        err = _cudart_call("cudaHostRegister", ptr, nbytes, 1)  # 1 = cudaHostRegisterPortable
    except Exception as e:  # noqa: BLE001 - registration is an optimisation; unregistered memory still works
        log.warning("cudaHostRegister of %d bytes failed (%s)%s: device copies into the slot run "
                    "synchronously", nbytes, e, _why_not_pinned(where))
        return False
    if err == _ALREADY_REGISTERED:
        # the range was just mapped, so a registration that starts at it outlived an earlier mapping there
        # (memory unmapped while registered: a slot of a client dropped without close() before its slots
        # unpinned themselves, or anyone's): that one is stale; drop it and register ours
        try:
            if _cudart_call("cudaHostUnregister", ptr) == 0:
                log.warning("cudaHostRegister: a stale registration at the new slot's address was dropped "
                            "(memory unmapped while still registered with CUDA)")
                err = _cudart_call("cudaHostRegister", ptr, nbytes, 1)
        except Exception as e:  # noqa: BLE001 - as above: the slot works unpinned
            log.warning("dropping a stale registration failed (%s)", e)
    if err != 0:
        log.warning("cudaHostRegister of %d bytes returned cudaError %d%s: device copies into the slot run "
                    "synchronously", nbytes, err, _why_not_pinned(where))
        return False
    return True


_ALREADY_REGISTERED = 712   # cudaErrorHostMemoryAlreadyRegistered


def _release_slot(registered_ptr: int | None, fd: int) -> None:
    """A slot's end (`Slot.release`): its registration dropped, then its file closed."""
    if registered_ptr is not None:
        unregister_host_memory(registered_ptr)
    try:
        os.close(fd)
    except OSError:
        pass


def unregister_host_memory(ptr: int) -> None:
    try:
        err = _cudart_call("cudaHostUnregister", ptr)
        if err != 0:
            log.warning("cudaHostUnregister returned cudaError %d", err)
    except Exception as e:  # noqa: BLE001
        log.warning("cudaHostUnregister failed: %s", e)


def _check_own_dir(d: Path, root: Path) -> None:
    """`d` must be a real directory of ours or of the memory dir's owner (the agent): OSError (ELOOP) if not,
    so the save falls back to a private buffer instead of writing where a planted link points."""
    st = os.lstat(d)
    owners = {os.geteuid(), os.stat(root).st_uid}
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid not in owners:
        raise OSError(errno.ELOOP, f"{d} is not a directory of uid {sorted(owners)} (a link, or another "
                      "user's): staging slots are not created there")


@dataclasses.dataclass(eq=False)
class Slot:
    path: Path
    fd: int
    nbytes: int
    mm: mmap.mmap | None
    tensor: torch.Tensor          # uint8 view of the whole mapping
    registered: bool
    busy: bool = False            # a save is using it (copy enqueued, not yet published or released)
    # unregisters the mapping and closes the file once: at `_drop`, or when the slot is collected unclosed
    # (a client dropped without close()) before its mapping goes: memory unmapped while registered leaves a
    # registration that fails every later registration or pinned allocation at that address in the process,
    # and the open file's lock keeps the agent from sweeping the slot
    release: Any = dataclasses.field(default=None, repr=False)

    def links(self) -> int:
        return os.fstat(self.fd).st_nlink

    def free(self) -> bool:
        """Not in use by a save here and not the bytes of any stored checkpoint."""
        return not self.busy and self.links() == 1


def ring_size(nbytes: int, *, mem_available: int, dir_free: int, local_ranks: int = 1,
              fraction: float = 0.5, most: int = 16) -> int:
    """How many slots of `nbytes` a rank may keep (`SnapshotConfig(max_slots="auto")`), from memory:
    the slots of every rank on the node together take at most `fraction` of the smaller of the host's
    available memory and the memory dir's free space; at most `most`, at least 1.

    Pure: the caller reads the inputs (`memory_budget`). A ring must hold the agent's `keep_committed`
    checkpoints (their slots stay referenced until evicted) plus one save being written; with fewer slots
    a save stages in the private buffer (logged once)."""
    if nbytes <= 0:
        return most
    budget = fraction * min(mem_available, dir_free) / max(1, local_ranks)
    return max(1, min(most, int(budget // nbytes)))


def memory_budget(root: str | os.PathLike[str]) -> tuple[int, int, int]:
    """(MemAvailable bytes, free bytes of the filesystem of `root`, ranks on this node) for `ring_size`.
    Ranks on the node: torchrun's LOCAL_WORLD_SIZE, else 1."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return (avail or free), free, max(1, local)


class SlotRing:
    """A rank's slots for one job in one agent memory dir. The slot list is guarded by a lock: the
    Snapshotter `acquire`s on the training thread while its background worker `release`s and creates
    slots ahead (`ensure_spare`); a slot being created is invisible until its file is mapped and
    registered."""

    def __init__(self, root: str | os.PathLike[str], job_id: str, rank: int, *, max_slots: int = 4,
                 register_cuda: bool | None = None) -> None:
        validate_job_id(job_id)
        if max_slots < 1:
            raise InvalidInputError(f"max_slots must be >= 1, got {max_slots}")
        self.root = Path(root)
        self.dir = self.root / SLOTS_DIR / job_id
        self.rank = rank
        self.max_slots = max_slots
        self.register_cuda = torch.cuda.is_available() if register_cuda is None else register_cuda
        self.slots: list[Slot] = []
        self._lock = threading.Lock()
        self._creating = 0            # slots being created outside the lock (count against max_slots)
        self.created_ahead = 0        # slots made by ensure_spare (off the training thread)
        self.created_inline = 0       # slots made by acquire (on the caller's thread: the blocking kind)

    def __len__(self) -> int:
        return len(self.slots)

    def acquire(self, nbytes: int, *, create: bool = True) -> Slot | None:
        """A free slot of exactly `nbytes`, marked busy; one is created here only when `create` and none is
        free (a slot made ahead by `ensure_spare` is the usual case). None when all `max_slots` are
        referenced by stored checkpoints or in use (or none is free and `create` is False)."""
        with self._lock:
            self._drop_other_sizes(nbytes)
            for s in self.slots:
                if s.nbytes == nbytes and s.free():
                    s.busy = True
                    return s
            if not create or len(self.slots) + self._creating >= self.max_slots:
                return None
            self._creating += 1
        try:
            s = self._create(nbytes)
        finally:
            with self._lock:
                self._creating -= 1
        s.busy = True
        with self._lock:
            self.slots.append(s)
            self.created_inline += 1
        return s

    def ensure_spare(self, nbytes: int, want: int = 1) -> Slot | None:
        """Create one slot of `nbytes` ahead when fewer than `want` are free and the ring has room (off the
        training thread: this is the fallocate + populate + cudaHostRegister a save would otherwise block
        on). The slot created (its bytes are all zero), or None."""
        with self._lock:
            self._drop_other_sizes(nbytes)
            if sum(1 for s in self.slots if s.nbytes == nbytes and s.free()) >= want:
                return None
            if len(self.slots) + self._creating >= self.max_slots:
                return None
            self._creating += 1
        try:
            s = self._create(nbytes)
        finally:
            with self._lock:
                self._creating -= 1
        with self._lock:
            self.slots.append(s)
            self.created_ahead += 1
        return s

    def free_slots(self, nbytes: int) -> int:
        with self._lock:
            return sum(1 for s in self.slots if s.nbytes == nbytes and s.free())

    def _drop_other_sizes(self, nbytes: int) -> None:
        for s in list(self.slots):
            if s.nbytes != nbytes and s.free():
                self._drop(s)  # the state changed size: its slots are useless now

    def release(self, slot: Slot) -> None:
        with self._lock:
            slot.busy = False

    def _create(self, nbytes: int) -> Slot:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for d in (self.dir.parent, self.dir):   # `.slots` and `.slots/<job>`: never a link another user planted
            _check_own_dir(d, self.root)
        path = self.dir / f"rank-{self.rank:05d}-{os.getpid()}-{next(_counter)}.slot"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held for our lifetime: the agent sweeps slots it can lock
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)  # allocate the tmpfs pages now, not on the first copy
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mm = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                tensor = torch.frombuffer(mm, dtype=torch.uint8)
                registered = self.register_cuda and register_host_memory(tensor.data_ptr(), nbytes, self.dir)
            else:
                mm, tensor, registered = None, torch.empty(0, dtype=torch.uint8), False
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        log.debug("staging slot %s: %d bytes, cuda-registered=%s", path, nbytes, registered)
        slot = Slot(path, fd, nbytes, mm, tensor, registered)
        slot.release = weakref.finalize(slot, _release_slot, tensor.data_ptr() if registered else None, fd)
        slot.release.atexit = False   # at exit the process's registrations and files go with it
        return slot

    def _drop(self, s: Slot) -> None:
        self.slots.remove(s)
        if s.release is not None:
            s.release()   # unregisters and closes the file, once (the mapping stays valid)
        s.tensor = torch.empty(0, dtype=torch.uint8)
        if s.mm is not None:
            try:
                s.mm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes when it does
                log.debug("slot %s still has views; unmapped later", s.path)
        # Unmap before unlinking the slot name: a blob still linked to it then holds no mapped pages.
        try:
            os.unlink(s.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        with self._lock:
            for s in list(self.slots):
                self._drop(s)
        try:
            self.dir.rmdir()
        except OSError:
            pass
