"""`DirStore` / `ShmStore`: blobs as files in a directory; on tmpfs (/dev/shm) this is the node memory tier.

Why files in node shared memory (measured, see docs/checkpoints.md and bench/bench_checkpoint.py): a
rank writes its shard straight from its pinned host buffer into a tmpfs file (one memory copy, no
serialisation, no socket), and the file belongs to the node, not to the rank: it survives the death of
the training process. The agent owns the directory (creates it, evicts, garbage-collects); Redis holds
manifests, commit records and the index of copies.

Atomicity: `put` writes `<name>.tmp-<pid>-<n>` and renames it over the final name (rename is atomic
within a filesystem); temp files are never listed and are swept by `sweep_temp`. `fsync` is off by
default (pointless on tmpfs); turn it on for a disk directory (the NVMe and flash tiers): then the file is
fsynced before the rename and its directory (and any directory `put` created) after it, so a blob under its
final name survives a power loss whole. An error (ENOSPC, EROFS, EIO) removes the temp file and leaves any
older blob under that name untouched.

Recycling (`spares=N`, on by default for `ShmStore`): on tmpfs, writing a new file costs page
allocation and zeroing, measured at 4-5x a plain memory copy; overwriting pages that already exist
runs at memory-copy speed. So `delete` keeps up to N deleted blobs as spare files under `.spares/`,
and `put` renames a spare to its temp name, overwrites it in place, truncates it to size and renames
it over the final name: the same atomic rename, without new pages. Spares count as used memory.

Staging slots (checkpoint.slots, the rank's side) live under `.slots/`; `sweep_dead_slots` (the agent's
side) returns those of ranks that are gone. Torch-free: the agent imports this module.
"""
from __future__ import annotations

import fcntl
import itertools
import os
import stat
import threading
import time
from pathlib import Path

from checkpoint.blobstore import Data, as_buffers, check_range
from checkpoint.names import validate_key, validate_prefix
from sdcwatch.paths import SHM, memory_base, memory_namespace
from sdcwatch.safe_fs import remove_tree, secure_dir

_TMP_MARK = ".tmp-"
SLOTS_DIR = ".slots"       # the ranks' staging slots (checkpoint.slots), swept by `sweep_dead_slots`
_counter = itertools.count()
_MAX_WRITE = 1 << 30


def default_shm_root(state_dir: str | os.PathLike[str]) -> Path:
    """The node memory tier's directory: `<memory base>/<namespace>/memory` (sdcwatch.paths: /dev/shm/sdcwatch
    for root, /dev/shm/sdcwatch-<uid> else; the namespace is derived from the full state dir path) when
    /dev/shm exists, else `<state dir>/memory` (which is only memory if the state dir is on tmpfs)."""
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        return memory_base() / memory_namespace(state_dir) / "memory"
    return Path(state_dir) / "memory"


def secure_memory_dir(root: str | os.PathLike[str], gid: int = -1) -> Path:
    """Create and check the memory dir `root` and its parent (sdcwatch.safe_fs.secure_dir: never a link,
    never another user's): the parent 0750 (0700 without a group), `root` and its `.slots` 2770 with group
    `gid` (ranks of other users write their shards and staging slots there; files keep the group) or 0700
    without one."""
    root = Path(os.path.abspath(root))
    secure_dir(root.parent, 0o750 if gid >= 0 else 0o700, gid)
    out = secure_dir(root, 0o2770 if gid >= 0 else 0o700, gid)
    secure_dir(root / SLOTS_DIR, 0o2770 if gid >= 0 else 0o700, gid)   # the agent's: ranks make their job dirs
    return out


class DirStore:
    """A BlobStore over a directory. `ShmStore` is the same over a tmpfs directory."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False, create: bool = True,
                 mode: int = 0o700, spares: int = 0) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.spares = spares
        if create:
            self.root.mkdir(parents=True, exist_ok=True, mode=mode)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    def path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def put(self, key: str, data: Data) -> int:
        final = self.path(key)
        created = self._makedirs(final.parent)
        tmp = final.with_name(f"{final.name}{_TMP_MARK}{os.getpid()}-{next(_counter)}")
        written = 0
        fd = self._open_spare(tmp)
        if fd is None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for buf in as_buffers(data):
                view = buf
                while len(view):
                    n = os.write(fd, view[:_MAX_WRITE])
                    view = view[n:]
                    written += n
            os.ftruncate(fd, written)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            for d in [final.parent, *created]:
                _fsync_dir(d)
        return written

    def _makedirs(self, d: Path) -> list[Path]:
        """mkdir -p `d`; return the parents of the directories it created (to fsync), nearest first."""
        missing = []
        p = d
        while not p.is_dir() and p != self.root and p != p.parent:
            missing.append(p)
            p = p.parent
        d.mkdir(parents=True, exist_ok=True)
        return [m.parent for m in missing]

    def link_in(self, key: str, src: str | os.PathLike[str]) -> int:
        """Publish the existing file `src` (on the same filesystem) as blob `key` by a hard link: atomic
        (link to a temp name, rename over the final one), no bytes copied. `src` is a rank's staging slot
        (checkpoint.slots); the blob and the slot are then two names of one file. Returns its size."""
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}{_TMP_MARK}{os.getpid()}-{next(_counter)}")
        os.link(src, tmp)
        try:
            size = os.stat(tmp).st_size
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return size

    def _spare_dir(self) -> Path:
        return self.root / ".spares"

    def _open_spare(self, tmp: Path) -> int | None:
        """Take the largest spare file (renamed to `tmp`) for overwriting in place, or None."""
        if not self.spares:
            return None
        with self._lock:
            try:
                spares = sorted(self._spare_dir().iterdir(), key=lambda p: p.stat().st_size)
            except FileNotFoundError:
                return None
            for sp in reversed(spares):
                try:
                    os.rename(sp, tmp)
                except FileNotFoundError:
                    continue
                return os.open(tmp, os.O_WRONLY)
        return None

    def _recycle(self, p: Path) -> bool:
        if not self.spares:
            return False
        try:
            if os.stat(p).st_nlink > 1:
                return False  # also a rank's staging slot (link_in): never reuse its pages for another blob
        except FileNotFoundError:
            return False
        d = self._spare_dir()
        with self._lock:
            d.mkdir(exist_ok=True)
            if len(os.listdir(d)) >= self.spares:
                return False
            try:
                os.rename(p, d / f"spare-{os.getpid()}-{next(_counter)}")
            except FileNotFoundError:
                return False
        return True

    def _open(self, key: str) -> int:
        try:
            return os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise KeyError(f"no blob {key!r} in {self.root}") from None

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        fd = self._open(key)
        try:
            off, n = check_range(offset, length, os.fstat(fd).st_size, key)
            out = bytearray(n)
            got = _pread_into(fd, memoryview(out), off)
            return bytes(out[:got])
        finally:
            os.close(fd)

    def readinto(self, key: str, offset: int, buf: memoryview) -> int:
        fd = self._open(key)
        try:
            view = memoryview(buf).cast("B")
            off, n = check_range(offset, len(view), os.fstat(fd).st_size, key)
            return _pread_into(fd, view[:n], off)
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            raise KeyError(f"no blob {key!r} in {self.root}") from None

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        if not self.root.is_dir():
            return []
        # Walk only the deepest directory the prefix names fully.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / base_rel if base_rel else self.root
        if not base.is_dir():
            return []
        out = []
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel_dir = os.path.relpath(dirpath, self.root)
            for f in files:
                if _TMP_MARK in f:
                    continue
                key = f if rel_dir == "." else f"{rel_dir}/{f}"
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    def delete(self, key: str) -> bool:
        p = self.path(key)
        try:
            if not self._recycle(p):
                p.unlink()
        except FileNotFoundError:
            return False
        # Remove now-empty parent directories up to the root (best effort; racing puts recreate them).
        parent = p.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
        return True

    def sweep_temp(self, older_than_s: float, now: float) -> int:
        """Delete temp files of interrupted puts older than `older_than_s`; return how many."""
        n = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                if _TMP_MARK not in f:
                    continue
                p = Path(dirpath) / f
                try:
                    if now - p.stat().st_mtime > older_than_s:
                        p.unlink()
                        n += 1
                except FileNotFoundError:
                    pass
        return n

    def purge(self, prefix_dir: str) -> int:
        """Delete everything under the directory `prefix_dir` (finished blobs and temp files of
        interrupted puts alike); return the files removed."""
        base = self.root / validate_key(prefix_dir.rstrip("/"))
        n = 0
        for dirpath, _dirs, files in os.walk(base, topdown=False):
            for f in files:
                p = Path(dirpath) / f
                if _TMP_MARK in f or not self._recycle(p):
                    p.unlink(missing_ok=True)
                n += 1
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
        return n

    def used_bytes(self) -> int:
        """Bytes of every file under the root (blobs, spares, staging slots), each file counted once
        however many names it has (a published slot is both a slot and a blob)."""
        total, seen = 0, set()
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                try:
                    st = (Path(dirpath) / f).stat()
                except FileNotFoundError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
        return total

    def sweep_slots(self, now: float, min_age_s: float = 60.0) -> int:
        """Unlink the staging slots of ranks that are gone (see checkpoint.slots); return how many."""
        return sweep_dead_slots(self.root, now, min_age_s)

    def remove_all(self, keep_root: bool = False) -> int:
        """Delete the whole directory tree (blobs, spares, slots; the root itself unless `keep_root`); return
        the files removed. For an agent whose index died with it (embedded Redis): the bytes could never be
        restored again."""
        return remove_tree(self.root, keep_root)   # never follows a link (sdcwatch.safe_fs)


class ShmStore(DirStore):
    """DirStore on tmpfs: the node's memory tier (bytes survive the training process); recycles up to
    `spares` deleted blobs (default 8) so steady-state saves overwrite existing pages."""

    def __init__(self, root: str | os.PathLike[str], *, spares: int = 8, **kw: object) -> None:
        super().__init__(root, spares=spares, **kw)  # type: ignore[arg-type]


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:got + _MAX_WRITE]], offset + got)
        if n == 0:
            break
        got += n
    return got


def sweep_dead_slots(root: str | os.PathLike[str], now: float | None = None, min_age_s: float = 60.0) -> int:
    """Unlink slot files under `root/.slots` whose owner is gone (their flock can be taken exclusively)
    and that are older than `min_age_s` (a slot is locked right after creation); return how many.
    Blobs linked to a removed slot keep their bytes (they are other names of the same file)."""
    base = Path(root) / SLOTS_DIR
    if not base.is_dir():
        return 0
    now = time.time() if now is None else now
    n = 0
    # fwalk without following links (a rank may write here: a planted link is skipped, never followed);
    # names opened relative to their directory's fd, with O_NOFOLLOW and O_NONBLOCK (a FIFO never blocks)
    for dirpath, _dirs, files, dfd in os.fwalk(base, topdown=False, follow_symlinks=False):
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except OSError:
                continue   # gone, or a link
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or now - st.st_ctime <= min_age_s:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live rank holds it
                try:
                    os.unlink(f, dir_fd=dfd)
                    n += 1
                except FileNotFoundError:
                    pass
            finally:
                os.close(fd)
        if Path(dirpath) != base:
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    return n
