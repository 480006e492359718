"""Directories and files the agent creates, made and opened without following links another user can plant.

The agent often runs as root, and its paths sit in places other local users can write (/tmp, /dev/shm) or
name (`--socket`). So nothing is trusted by name alone:

- `secure_dir(path, mode, gid)` walks `path` from `/` one component at a time with `openat` (dir fds,
  `O_NOFOLLOW`), creating what is missing. Each directory above must be owned by root or by us and, when
  others may write to it, carry the sticky bit (/tmp, /dev/shm); a symlink on the way is refused unless root
  owns it and its directory (/var/run -> /run). The directory itself is never a link (whoever made it), must
  be ours (created now or before); its mode and group are then set to what was asked.
- `check_dir(path, what)` checks, creating and changing nothing, an existing directory the agent puts a
  name in (an explicit `--socket`'s directory): the same walk, and the directory writable by its owner only.
- `open_private_file(dir, name, flags)` opens a file inside such a directory with `O_NOFOLLOW` (and no
  `O_TRUNC`: a truncation happens on the fd, after `fstat` proved it is our regular file).
- `PlantedLinkError`: what a store working fd-relative in a directory others may write (the 2770 memory dir,
  shared with the ranks' group) raises on a link or special file where its own file or directory should be:
  refused, never followed. An `OSError` (ELOOP) too, so callers that treat a missing or unreadable copy as
  "try another copy" do so.
- `remove_tree(path)` empties a directory with `os.fwalk(follow_symlinks=False)`: links are unlinked, never
  followed, and a top that is itself a link is left alone.

A check that fails raises `UnsafePathError` naming the path, what is wrong and the fix; the CLI turns it
into exit 2 (a setup problem, like a config error). Standard library only: the agent and the ranks import it.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from sdcwatch.errors import FatalError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 16


class UnsafePathError(FatalError):
    """A path the agent would use is not safe (a link, another user's, writable by others)."""

    def __init__(self, path: str | os.PathLike[str], problem: str, fix: str) -> None:
        super().__init__(f"refusing to use {os.fspath(path)}: {problem}; {fix}")
        self.path = os.fspath(path)


class PlantedLinkError(UnsafePathError, OSError):
    """A link (or FIFO, socket, device) where a store expected its own regular file or directory."""

    def __init__(self, path: str | os.PathLike[str], what: str = "a symbolic link or special file") -> None:
        super().__init__(path, f"it is {what}, not the agent's own file (someone who can write the directory may "
                         "have planted it); it is neither followed nor read", "remove it, and see who made it")
        self.errno = errno.ELOOP
        self.filename = os.fspath(path)


def open_dir(path: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """An fd of the directory `path` (relative to `dir_fd` when given), opened with O_NOFOLLOW: a link there
    is PlantedLinkError (ENOTDIR for a file; FileNotFoundError as usual)."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:   # Linux says ENOTDIR for a link with O_DIRECTORY | O_NOFOLLOW, ELOOP without
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(path, dir_fd)):
            raise PlantedLinkError(path) from None
        raise


def _is_link(path: str | os.PathLike[str], dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _euid() -> int:
    return os.geteuid()


def _check_parent(path: str, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(path, "it is not a directory", "remove it or choose another path")
    if st.st_uid not in (0, _euid()):
        raise UnsafePathError(path, f"it is owned by uid {st.st_uid}, not by root or uid {_euid()}",
                              "choose a path whose directories belong to root or to you")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafePathError(path, f"others may write to it (mode {stat.S_IMODE(st.st_mode):04o}) and it has no "
                              "sticky bit, so they could swap what is inside",
                              f"chmod go-w {path}, or choose another path")


def secure_dir(path: str | os.PathLike[str], mode: int = 0o700, gid: int = -1) -> Path:
    """Create (if missing) and check the directory `path` and every directory above it (module docstring);
    set its mode to `mode` and, with `gid` >= 0, its group. Returns the absolute path."""
    target = os.path.abspath(os.fspath(path))
    for _ in range(_MAX_LINKS):
        resolved = _walk(target, mode, gid)
        if resolved is None:
            return Path(target)
        target = resolved
    raise UnsafePathError(path, "too many symbolic links on the way", "use a path without links")


def check_dir(path: str | os.PathLike[str], what: str = "directory") -> Path:
    """Check, without creating or changing anything, an existing directory the agent puts a name in that
    others must not swap (an explicit `--socket`'s directory): every directory on the way as `secure_dir`
    checks them (no link but root's, owned by root or us, others' write only with the sticky bit), and the
    directory itself owned by root or us and writable by nobody else (group and others: with write access
    they could rename another socket over ours). Returns the absolute path (links on the way resolved)."""
    target = os.path.abspath(os.fspath(path))
    for _ in range(_MAX_LINKS):
        resolved = _walk(target, 0, -1, check_only=what)
        if resolved is None:
            return Path(target)
        target = resolved
    raise UnsafePathError(path, "too many symbolic links on the way", "use a path without links")


def _walk(target: str, mode: int, gid: int, check_only: str = "") -> str | None:
    """One pass down `target`; a root-owned link on the way returns the path with it resolved (walk again).
    With `check_only` (what the directory is for, for messages) nothing is created or changed."""
    parts = [p for p in target.split("/") if p]
    fd = os.open("/", _DIR_FLAGS)
    try:
        here = "/"
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            path = os.path.join(here, name)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if check_only:
                    raise UnsafePathError(path, f"it does not exist (it should be the {check_only})",
                                          "create it (owned by root or you, writable by its owner only) or "
                                          "choose another path") from None
                try:
                    os.mkdir(name, mode if last else 0o755, dir_fd=fd)
                except FileExistsError:
                    pass   # made meanwhile: checked below like any other
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                parent = os.fstat(fd)
                if last or st.st_uid != 0 or parent.st_uid != 0 or parent.st_mode & 0o022:
                    raise UnsafePathError(path, f"it is a symbolic link (owned by uid {st.st_uid}) to "
                                          f"{os.readlink(name, dir_fd=fd)!r}",
                                          "remove the link (someone may have planted it) or give the real path")
                link = os.readlink(name, dir_fd=fd)
                return os.path.normpath(os.path.join(here, link, *parts[i + 1:]))
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise UnsafePathError(path, f"it cannot be opened as a directory ({exc.strerror})",
                                      "remove it or choose another path") from None
            os.close(fd)
            fd = nfd
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise UnsafePathError(path, "it changed while it was checked", "look for another process "
                                      "racing to replace it, then start again")
            if not last:
                _check_parent(path, now)
                here = path
                continue
            if check_only:
                _check_parent(path, now)
                if now.st_mode & 0o022:
                    raise UnsafePathError(path, f"it is the {check_only} and others may write to it (mode "
                                          f"{stat.S_IMODE(now.st_mode):04o}), so they could put their own "
                                          "socket in place of ours", f"chmod go-w {path}, or choose a "
                                          "directory only its owner can write (the default: the state dir)")
                return None
            if now.st_uid != _euid():
                raise UnsafePathError(path, f"it is owned by uid {now.st_uid}, not by this agent's uid {_euid()}",
                                      "remove it (someone else created it) or choose another path")
            os.fchmod(fd, mode)
            if gid >= 0 and now.st_gid != gid:
                os.fchown(fd, -1, gid)
        return None
    finally:
        os.close(fd)


def open_private_file(directory: str | os.PathLike[str], name: str, flags: int, mode: int = 0o600) -> int:
    """Open `directory/name` (the directory already checked by `secure_dir`) without following a link;
    the file must be a regular file owned by us. `flags` must not hold O_TRUNC (truncate the fd instead)."""
    if flags & os.O_TRUNC:
        raise ValueError("open_private_file: truncate the checked fd, not at open")
    dfd = os.open(directory, _DIR_FLAGS)
    try:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dfd)
        except OSError as exc:
            path = os.path.join(os.fspath(directory), name)
            if exc.errno in (40, 6):   # ELOOP: a link; ENXIO: a FIFO/socket with nobody on it
                raise UnsafePathError(path, "it is a symbolic link or a special file",
                                      "remove it (someone may have planted it)") from None
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != _euid() or st.st_nlink != 1:
        os.close(fd)
        raise UnsafePathError(os.path.join(os.fspath(directory), name),
                              f"it is not a regular file of uid {_euid()} with one name (uid {st.st_uid}, "
                              f"{st.st_nlink} link(s))", "remove it (someone may have planted it)")
    os.set_blocking(fd, True)
    return fd


def remove_tree(path: str | os.PathLike[str], keep_root: bool = False) -> int:
    """Delete everything under the directory `path` (and `path` itself unless `keep_root`) without following
    a link anywhere (a top that is a link is left as it is); return the files (non-directories) removed."""
    n = 0
    top = os.fspath(path)
    try:
        st = os.stat(top, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return 0
    for _dirpath, dirs, files, dfd in os.fwalk(top, topdown=False, follow_symlinks=False):
        for f in files:
            try:
                os.unlink(f, dir_fd=dfd)
                n += 1
            except FileNotFoundError:
                pass
        for d in dirs:   # links to directories are listed here too: unlink those, rmdir the rest
            try:
                if stat.S_ISLNK(os.stat(d, dir_fd=dfd, follow_symlinks=False).st_mode):
                    os.unlink(d, dir_fd=dfd)
                    n += 1
                else:
                    os.rmdir(d, dir_fd=dfd)
            except OSError:
                pass
    if not keep_root:
        try:
            os.rmdir(top)
        except OSError:
            pass
    return n
