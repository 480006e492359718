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

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Iterator, NoReturn

from checkpoint.blobstore import Data, as_buffers, check_range
from checkpoint.names import validate_key, validate_prefix
from sdcwatch.paths import SHM, memory_base, memory_namespace
from sdcwatch.safe_fs import PlantedLinkError, open_dir, remove_tree, secure_dir

_TMP_MARK = ".tmp-"
SLOTS_DIR = ".slots"       # the ranks' staging slots (checkpoint.slots), swept by `sweep_dead_slots`
SPARES_DIR = ".spares"     # deleted blobs kept for recycling
PINS_DIR = ".pins"         # second names of blobs being mapped (`DirStore.pinned`)
log = logging.getLogger(__name__)
_Level = tuple[str, int, list[os.DirEntry[str]], list[str], list[str]]   # rel, fd, files, dirs, others
_counter = itertools.count()
_MAX_WRITE = 1 << 30


def default_shm_root(state_dir: str | os.PathLike[str], base: str | os.PathLike[str] | None = None) -> Path:
    """The node memory tier's directory: `<memory base>/<namespace>/memory` (the namespace is derived from
    the full state dir path). `base`: the configured memory base (`[checkpoints] memory_base`); without one,
    sdcwatch.paths' (/dev/shm/sdcwatch for root, /dev/shm/sdcwatch-<uid> else) when /dev/shm exists, else
    `<state dir>/memory` (which is only memory if the state dir is on tmpfs)."""
    if base:
        return Path(base) / memory_namespace(state_dir) / "memory"
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        return memory_base() / memory_namespace(state_dir) / "memory"
    return Path(state_dir) / "memory"


MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs")   # a memory dir on anything else is a disk's


def filesystem_type(path: str | os.PathLike[str], mounts: str | None = None) -> str:
    """The type of the filesystem `path` is on ("tmpfs", "ext4", ...), from the longest mount point above its
    real path in `/proc/self/mounts` (or `mounts`, that file's text); "" when unknown."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return ""
    real = os.path.realpath(path)
    best, kind = -1, ""
    for line in mounts.splitlines():
        f = line.split()
        if len(f) < 3:
            continue
        mnt = f[1].replace("\\040", " ")
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) > best:
            best, kind = len(mnt), f[2]
    return kind


def disk_filesystem(path: str | os.PathLike[str]) -> str:
    """The type of `path`'s filesystem when it is not a memory one ("ext4", "xfs", ...): a memory dir or a
    staging slot there is written to a disk, and the GPU cannot pin its pages; "" on tmpfs, hugetlbfs or
    when unknown."""
    kind = filesystem_type(path)
    return kind if kind and kind not in MEMORY_FILESYSTEMS else ""


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
    """A BlobStore over a directory. `ShmStore` is the same over a tmpfs directory.

    Every file operation is relative to one fd of the root, opened once with O_NOFOLLOW|O_DIRECTORY (openat
    and friends: `dir_fd=`, `follow_symlinks=False`, O_NOFOLLOW): the memory dir is shared with the ranks'
    group (mode 2770), so a member could plant a link under a blob's, a directory's or a spare's name. Such a
    link is refused (`PlantedLinkError`, an OSError: readers fall back to another copy), counted in `refused`
    and logged, never followed: the agent never reads, truncates, overwrites or removes what it points at (a
    planted name itself may be unlinked: it is in our directory)."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False, create: bool = True,
                 mode: int = 0o700, spares: int = 0) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.spares = spares
        self.refused = 0           # planted links / special files refused, since start
        self._lock = threading.Lock()
        self._dfd: int | None = None
        if create:
            self.root.mkdir(parents=True, exist_ok=True, mode=mode)
            self._root_fd()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the root's fd (opened again on the next call)."""
        fd, self._dfd = getattr(self, "_dfd", None), None
        if fd is not None:
            os.close(fd)

    def path(self, key: str) -> Path:
        """The blob's path, for messages only: never open it by this name (see the class docstring)."""
        return self.root / validate_key(key)

    # ---- fd-relative plumbing ------------------------------------------------------------------------
    def _root_fd(self) -> int:
        fd = self._dfd
        if fd is None:
            with self._lock:
                if self._dfd is None:
                    try:
                        self._dfd = open_dir(self.root)
                    except PlantedLinkError:
                        self._refuse(str(self.root))
                fd = self._dfd
        assert fd is not None
        return fd

    def _refuse(self, rel: str, what: str = "a symbolic link or special file") -> NoReturn:
        self.refused += 1
        path = rel if rel.startswith("/") else str(self.root / rel)
        log.warning("refused %s in the checkpoint directory: it is %s, not ours (planted?); not followed",
                    path, what)
        raise PlantedLinkError(path, what)

    def _open_dir(self, rel: str, create: bool = False, created: list[int] | None = None) -> int:
        """An fd (the caller closes it) of the directory `rel` under the root ("" = the root), each component
        opened with O_NOFOLLOW from the one above; with `create`, missing ones are made (and, with `created`,
        an fd of each directory that got a new entry is appended, to fsync)."""
        fd = os.dup(self._root_fd())
        done: list[str] = []
        try:
            for part in rel.split("/") if rel else ():
                done.append(part)
                try:
                    nfd = open_dir(part, fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                        if created is not None:
                            created.append(os.dup(fd))
                    except FileExistsError:
                        pass
                    nfd = open_dir(part, fd)
                except PlantedLinkError:
                    self._refuse("/".join(done))
                except NotADirectoryError:
                    self._refuse("/".join(done), "not a directory")
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _parent(self, key: str, create: bool = False, created: list[int] | None = None) -> tuple[int, str]:
        """(fd of the key's directory, the key's last component); FileNotFoundError when a directory is
        missing (and not `create`)."""
        rel, _, name = validate_key(key).rpartition("/")
        return self._open_dir(rel, create, created), name

    def _lstat(self, dfd: int, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)

    def _open_file(self, dfd: int, name: str, rel: str, flags: int = os.O_RDONLY) -> int:
        """Open our regular file `name` in `dfd` without following a link (nor blocking on a FIFO)."""
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):
                self._refuse(rel)
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self._refuse(rel, "not a regular file")
        return fd

    def _tree(self, dfd: int, rel: str = "", hidden: bool = True) -> Iterator[_Level]:
        """Top-down walk below the directory fd `dfd` (`rel` its path under the root) without following links:
        (rel, fd, regular files, directories, others: links and special files). Each directory is opened
        with O_NOFOLLOW from its parent's fd; trimming the directories list prunes the walk."""
        files: list[os.DirEntry[str]] = []
        dirs: list[str] = []
        odd: list[str] = []
        with os.scandir(dfd) as it:
            for e in it:
                if e.is_symlink():
                    odd.append(e.name)
                elif e.is_dir(follow_symlinks=False):
                    if hidden or not e.name.startswith("."):
                        dirs.append(e.name)
                elif e.is_file(follow_symlinks=False):
                    files.append(e)
                else:
                    odd.append(e.name)
        yield rel, dfd, files, dirs, odd
        for d in dirs:
            try:
                nfd = open_dir(d, dfd)
            except OSError:   # gone, or swapped for a link meanwhile: skipped, never followed
                continue
            try:
                yield from self._tree(nfd, f"{rel}/{d}" if rel else d, hidden)
            finally:
                os.close(nfd)

    # ---- the BlobStore ------------------------------------------------------------------------------
    def put(self, key: str, data: Data) -> int:
        created: list[int] = []
        pfd, name = self._parent(key, create=True, created=created)
        try:
            tmp = f"{name}{_TMP_MARK}{os.getpid()}-{next(_counter)}"
            fd = self._open_spare(pfd, tmp)
            if fd is None:
                fd = self._create(pfd, tmp)
            written = 0
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
                _unlink(pfd, tmp)
                raise
            os.close(fd)
            try:
                os.replace(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)   # over a planted link: replaces the link
            except BaseException:
                _unlink(pfd, tmp)
                raise
            if self.fsync:
                for d in [pfd, *created]:
                    os.fsync(d)
            return written
        finally:
            os.close(pfd)
            for d in created:
                os.close(d)

    @staticmethod
    def _create(pfd: int, tmp: str) -> int:
        """A new temp file: O_EXCL (never through a name someone else made; a leftover of an earlier process
        with our pid, or a planted link, is unlinked first)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o600, dir_fd=pfd)
        except FileExistsError:
            _unlink(pfd, tmp)
            return os.open(tmp, flags, 0o600, dir_fd=pfd)

    def link_in(self, key: str, src: str | os.PathLike[str]) -> int:
        """Publish the existing file `src` (on the same filesystem) as blob `key` by a hard link: atomic
        (link to a temp name, rename over the final one), no bytes copied. `src` is a rank's staging slot
        (checkpoint.slots); the blob and the slot are then two names of one file. Returns its size. A link
        at `src` is linked as a link (never followed) and refused."""
        pfd, name = self._parent(key, create=True)
        try:
            tmp = f"{name}{_TMP_MARK}{os.getpid()}-{next(_counter)}"
            os.link(src, tmp, dst_dir_fd=pfd, follow_symlinks=False)
            try:
                st = self._lstat(pfd, tmp)
                if not stat.S_ISREG(st.st_mode):
                    self._refuse(os.fspath(src), "not a regular file")
                os.replace(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
            except BaseException:
                _unlink(pfd, tmp)
                raise
            return st.st_size
        finally:
            os.close(pfd)

    def _spare_dir(self) -> Path:
        return self.root / SPARES_DIR

    def _open_spare(self, pfd: int, tmp: str) -> int | None:
        """Take the largest spare file (renamed to `tmp` in `pfd`) for overwriting in place, or None. Only our
        regular files with one name: a planted link or a hard link to someone's file is never written."""
        if not self.spares:
            return None
        with self._lock:
            try:
                sfd = self._open_dir(SPARES_DIR)
            except (FileNotFoundError, PlantedLinkError, NotADirectoryError):
                return None   # none yet; or a link planted in its place (refused, logged): no recycling
            try:
                spares = []
                with os.scandir(sfd) as it:
                    for e in it:
                        if e.is_file(follow_symlinks=False):
                            spares.append((e.stat(follow_symlinks=False).st_size, e.name))
                        else:
                            _unlink(sfd, e.name)   # not ours to write: drop the name, never its target
                for _size, sp in sorted(spares, reverse=True):
                    try:
                        os.rename(sp, tmp, src_dir_fd=sfd, dst_dir_fd=pfd)
                    except FileNotFoundError:
                        continue
                    try:
                        fd = self._open_file(pfd, tmp, tmp, os.O_WRONLY)
                    except OSError:
                        _unlink(pfd, tmp)
                        continue
                    if os.fstat(fd).st_nlink != 1:
                        os.close(fd)
                        _unlink(pfd, tmp)
                        continue
                    os.set_blocking(fd, True)
                    return fd
            finally:
                os.close(sfd)
        return None

    def _recycle(self, pfd: int, name: str) -> bool:
        """Move our regular file `name` (in `pfd`) to the spares; False when it is not to be recycled."""
        if not self.spares:
            return False
        try:
            st = self._lstat(pfd, name)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            return False  # a link; or also a rank's staging slot (link_in): never reuse its pages for another blob
        with self._lock:
            try:
                sfd = self._open_dir(SPARES_DIR, create=True)
            except (PlantedLinkError, NotADirectoryError):
                return False   # refused and logged; the blob is deleted instead
            try:
                if len(os.listdir(sfd)) >= self.spares:
                    return False
                try:
                    os.rename(name, f"spare-{os.getpid()}-{next(_counter)}", src_dir_fd=pfd, dst_dir_fd=sfd)
                except FileNotFoundError:
                    return False
            finally:
                os.close(sfd)
        return True

    def open_blob(self, key: str) -> int:
        """A read-only fd of blob `key` (the caller closes it), opened fd-relative without following a link:
        KeyError when there is none, PlantedLinkError for a link or special file."""
        return self._open(key)

    def _open(self, key: str) -> int:
        try:
            pfd, name = self._parent(key)
        except FileNotFoundError:
            raise KeyError(f"no blob {key!r} in {self.root}") from None
        try:
            return self._open_file(pfd, name, key)
        except FileNotFoundError:
            raise KeyError(f"no blob {key!r} in {self.root}") from None
        finally:
            os.close(pfd)

    @contextlib.contextmanager
    def pinned(self, key: str) -> Iterator[int]:
        """A read-only fd of blob `key` while a second name of it (under `.pins/`) keeps it from being recycled
        or reused as a staging slot (a file with more than one link never is): the drainer maps it. Made
        without following a link; KeyError when there is no such blob."""
        pfd, name = self._parent(key)
        try:
            pin = f"{os.getpid()}-{next(_counter)}"
            sfd = self._open_dir(PINS_DIR, create=True)
            try:
                os.link(name, pin, src_dir_fd=pfd, dst_dir_fd=sfd, follow_symlinks=False)
            except FileNotFoundError:
                os.close(sfd)
                raise KeyError(f"no blob {key!r} in {self.root}") from None
            try:
                fd = self._open_file(sfd, pin, key)
                try:
                    yield fd
                finally:
                    os.close(fd)
            finally:
                _unlink(sfd, pin)
                os.close(sfd)
        finally:
            os.close(pfd)

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

    def _stat(self, key: str) -> os.stat_result:
        """lstat of blob `key`: KeyError when missing, PlantedLinkError when not a regular file."""
        try:
            pfd, name = self._parent(key)
        except FileNotFoundError:
            raise KeyError(f"no blob {key!r} in {self.root}") from None
        try:
            st = self._lstat(pfd, name)
        except FileNotFoundError:
            raise KeyError(f"no blob {key!r} in {self.root}") from None
        finally:
            os.close(pfd)
        if not stat.S_ISREG(st.st_mode):
            self._refuse(key, "not a regular file" if not stat.S_ISLNK(st.st_mode) else "a symbolic link")
        return st

    def exists(self, key: str) -> bool:
        try:
            self._stat(key)
        except (KeyError, PlantedLinkError, NotADirectoryError):
            return False
        return True

    def size(self, key: str) -> int:
        return self._stat(key).st_size

    def mtime(self, key: str) -> float:
        """When blob `key` was last written (KeyError when missing)."""
        return self._stat(key).st_mtime

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        # Walk only the deepest directory the prefix names fully.
        base_rel = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        try:
            dfd = self._open_dir(base_rel)
        except (FileNotFoundError, NotADirectoryError, PlantedLinkError):
            return []
        out = []
        try:
            for rel, _fd, files, _dirs, _odd in self._tree(dfd, base_rel, hidden=False):
                for e in files:
                    if _TMP_MARK in e.name:
                        continue
                    key = f"{rel}/{e.name}" if rel else e.name
                    if key.startswith(prefix):
                        out.append(key)
        finally:
            os.close(dfd)
        return sorted(out)

    def delete(self, key: str) -> bool:
        try:
            pfd, name = self._parent(key)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            if not self._recycle(pfd, name):
                os.unlink(name, dir_fd=pfd)   # a planted link: the name goes, its target is never touched
        except (FileNotFoundError, IsADirectoryError):   # a directory: the key only prefixes other keys
            return False
        finally:
            os.close(pfd)
        # Remove now-empty parent directories up to the root (best effort; racing puts recreate them).
        parts = key.split("/")[:-1]
        while parts:
            try:
                dfd = self._open_dir("/".join(parts[:-1]))
            except OSError:
                break
            try:
                os.rmdir(parts[-1], dir_fd=dfd)
            except OSError:
                break
            finally:
                os.close(dfd)
            parts.pop()
        return True

    def sweep_temp(self, older_than_s: float, now: float) -> int:
        """Delete temp files of interrupted puts older than `older_than_s`; return how many."""
        n = 0
        dfd = self._open_dir("")
        try:
            for _rel, fd, files, _dirs, odd in self._tree(dfd):
                for e in files:
                    if _TMP_MARK not in e.name:
                        continue
                    try:
                        if now - e.stat(follow_symlinks=False).st_mtime > older_than_s:
                            os.unlink(e.name, dir_fd=fd)
                            n += 1
                    except FileNotFoundError:
                        pass
                for name in odd:
                    if _TMP_MARK in name and _unlink(fd, name):
                        n += 1
        finally:
            os.close(dfd)
        return n

    def purge(self, prefix_dir: str) -> int:
        """Delete everything under the directory `prefix_dir` (finished blobs and temp files of
        interrupted puts alike); return the files removed."""
        try:
            pfd, name = self._parent(prefix_dir.rstrip("/"))
        except (FileNotFoundError, NotADirectoryError):
            return 0
        try:
            try:
                dfd = open_dir(name, pfd)
            except (FileNotFoundError, NotADirectoryError):
                return 0
            except PlantedLinkError:
                self.refused += 1
                log.warning("refused %s: a symbolic link where a checkpoint directory should be; the name is "
                            "removed, its target untouched", self.root / prefix_dir)
                return int(_unlink(pfd, name))
            try:
                n = self._purge_fd(dfd)
            finally:
                os.close(dfd)
            try:
                os.rmdir(name, dir_fd=pfd)
            except OSError:
                pass
            return n
        finally:
            os.close(pfd)

    def _purge_fd(self, dfd: int) -> int:
        n = 0
        _rel, _fd, files, dirs, odd = next(self._tree(dfd))
        for e in files:
            if _TMP_MARK in e.name or not self._recycle(dfd, e.name):
                _unlink(dfd, e.name)
            n += 1
        for name in odd:
            _unlink(dfd, name)   # links and special files: the name only
            n += 1
        for d in dirs:
            try:
                cfd = open_dir(d, dfd)
            except OSError:
                continue
            try:
                n += self._purge_fd(cfd)
            finally:
                os.close(cfd)
            try:
                os.rmdir(d, dir_fd=dfd)
            except OSError:
                pass
        return n

    def used_bytes(self) -> int:
        """Bytes of every file under the root (blobs, spares, staging slots), each file counted once
        however many names it has (a published slot is both a slot and a blob)."""
        total, seen = 0, set()
        try:
            dfd = self._open_dir("")
        except FileNotFoundError:
            return 0
        try:
            for _rel, _fd, files, _dirs, _odd in self._tree(dfd):
                for e in files:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
        finally:
            os.close(dfd)
        return total

    def sweep_slots(self, now: float, min_age_s: float = 60.0) -> int:
        """Unlink the staging slots of ranks that are gone (see checkpoint.slots); return how many."""
        return sweep_dead_slots(self.root, now, min_age_s)

    def remove_all(self, keep_root: bool = False) -> int:
        """Delete the whole directory tree (blobs, spares, slots; the root itself unless `keep_root`); return
        the files removed. For an agent whose index died with it (embedded Redis): the bytes could never be
        restored again."""
        n = remove_tree(self.root, keep_root)   # never follows a link (sdcwatch.safe_fs)
        if not keep_root:
            self.close()
        return n


class ShmStore(DirStore):
    """DirStore on tmpfs: the node's memory tier (bytes survive the training process); recycles up to
    `spares` deleted blobs (default 8) so steady-state saves overwrite existing pages."""

    def __init__(self, root: str | os.PathLike[str], *, spares: int = 8, **kw: object) -> None:
        super().__init__(root, spares=spares, **kw)  # type: ignore[arg-type]


def _unlink(dfd: int, name: str) -> bool:
    """Unlink `name` in `dfd` (never follows: a link's target is untouched); False when it was gone."""
    try:
        os.unlink(name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False


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
