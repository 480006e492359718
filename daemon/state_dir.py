"""The agent's claim on its state dir and its socket, made without following planted links.

Lifecycle: `StateDir(path, mode, gid).lock()` (at start, before anything else is opened: creates and checks
the directory with `sdcwatch.safe_fs.secure_dir`, opens `agent.lock` with O_NOFOLLOW and no O_TRUNC, takes
the flock, then truncates the checked fd and writes our pid) -> `claim_socket(path)` (a socket file already
there: a live agent answers on it -> refuse; nobody answers -> the stale socket is removed; anything but a
socket -> refuse) -> `release()` at stop.

Every refusal is an `UnsafePathError` or a `FatalError` naming the path and the fix; the CLI exits 2 on the
former, 1 on the latter.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

from daemon.errors import ConfigError
from sdcwatch.errors import FatalError
from sdcwatch.safe_fs import UnsafePathError, check_dir, open_private_file, secure_dir

log = logging.getLogger(__name__)

LOCK_NAME = "agent.lock"


def ensure_state_dir(path: Path, mode: int = 0o700, gid: int = -1) -> None:
    """Create and check the state dir (`secure_dir`) before anything is built in it: ConfigError (exit 2,
    the path and the reason named) when it cannot be made, is a link, is another user's or open to others."""
    try:
        secure_dir(path, mode, gid)
    except UnsafePathError as exc:
        raise ConfigError("agent.state_dir", f"cannot use {path}: {exc} (or give another --state-dir)") from None
    except OSError as exc:
        raise ConfigError("agent.state_dir", f"cannot create or write {path}: {exc.strerror or exc}"
                          f"{f' ({exc.filename})' if exc.filename and str(exc.filename) != str(path) else ''}; "
                          "give a writable --state-dir (or $SDCWATCH_STATE_DIR)") from None


class AgentRunningError(FatalError):
    """Another live agent holds the state dir or answers on the socket."""


class StateDir:
    def __init__(self, path: str | os.PathLike[str], *, mode: int = 0o700, gid: int = -1) -> None:
        self.path = Path(path)
        self.mode = mode
        self.gid = gid
        self._fd: int | None = None

    @property
    def locked(self) -> bool:
        return self._fd is not None

    def lock(self) -> None:
        """Create and check the directory, take `agent.lock` (AgentRunningError when another agent has it)."""
        self.path = secure_dir(self.path, self.mode, self.gid)
        fd = open_private_file(self.path, LOCK_NAME, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise AgentRunningError(f"another agent (pid {holder}) is running on {self.path}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim_socket(path: str | os.PathLike[str], timeout_s: float = 1.0) -> None:
    """Make way for our socket at `path`: nothing there -> nothing to do; a socket a live process accepts on
    -> AgentRunningError (never unlink another agent's live socket); a dead socket -> removed; a link or any
    other file -> UnsafePathError. Its directory is checked first (`check_dir`: no planted link on the way,
    root's or ours, writable by its owner only), whether it is the state dir or an explicit `--socket`'s."""
    p = os.fspath(path)
    check_dir(os.path.dirname(os.path.abspath(p)), "socket's directory")
    try:
        st = os.stat(p, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePathError(p, "it exists and is not a socket (a link or a file)",
                              "remove it if it is stale, or pass another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout_s)
    try:
        probe.connect(p)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise AgentRunningError(f"the socket {p} exists and cannot be checked ({exc}); remove it if no "
                                    "agent is running, or pass another --socket") from None
    else:
        raise AgentRunningError(f"another agent is listening on {p}; stop it or pass another --socket")
    finally:
        probe.close()
    log.info("removing stale socket %s", p)
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
