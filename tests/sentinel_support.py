"""Real Redis Sentinel HA for tests and bench/bench_sentinel.py (not a test module): 3 redis-server (one
primary, two replicas) and 3 redis-sentinel on free ports of 127.0.0.1, and "agents" (a real Coordinator
each, with its own Sentinel-discovered client and memory tier) saving shards in threads while the primary
is killed. Torch-free: shards are plain bytes with a checksummed manifest.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import redis
from deadlines import scaled

from checkpoint.chunks import checksum_chunks
from checkpoint.commit_fence import CommitFence
from checkpoint.coordinator import Coordinator, blob_key
from checkpoint.coordinator_config import CoordinatorConfig
from checkpoint.errors import CheckpointError, NotInMemoryError
from checkpoint.manifest import ShardManifest
from checkpoint.redis_connect import RedisOptions, connect, epoch_source, era_source
from checkpoint.shm_store import DirStore
from sdcwatch.proc import die_with_parent
from sdcwatch import event_kinds as ek
from sdcwatch.event_kinds import EventKind

SERVICE = "sdcw"
# The settings docs/sentinel.md recommends (and why); the tests and the bench use exactly these.
DOWN_AFTER_MS = 1500
FAILOVER_TIMEOUT_MS = 5000


def redis_binary(name: str) -> str:
    found = shutil.which(name)
    if not found:
        raise RuntimeError(
            f"{name} is not on PATH: `apt-get install redis-server redis-sentinel` "
            "(scripts/setup.sh --test does)"
        )
    return found


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# How many times a server or Sentinel is started on another free port when the one picked was taken before it
# could bind (another test's server, or any process's outgoing connection: its source port is from the same
# ephemeral range, and a connected socket holds the port against a listener even with SO_REUSEADDR).
PORT_TRIES = 5


class ExitedError(RuntimeError):
    """A redis-server or redis-sentinel we started exited before serving (its log's tail says why)."""


def wait_for(pred: Callable[[], object], timeout_s: float, what: str, every: float = 0.02) -> object:
    """pred()'s first truthy value (a RedisError counts as not yet); TimeoutError after `timeout_s` (enough on
    an idle machine) times the suite's slowdown (tests/deadlines.py)."""
    limit = scaled(timeout_s)
    deadline = time.monotonic() + limit
    while True:
        try:
            v = pred()
            if v:
                return v
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit:.0f} s ({timeout_s:.0f} s scaled) waiting for {what}")
        time.sleep(every)


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class SentinelCluster:
    """Start with `start()`, stop with `stop()`. `min_replicas`: the servers' min-replicas-to-write;
    `down_after_ms`: the Sentinels' down-after-milliseconds."""

    def __init__(
        self,
        workdir: Path,
        *,
        min_replicas: int = 1,
        min_replicas_max_lag: int = 5,
        down_after_ms: int = DOWN_AFTER_MS,
    ) -> None:
        self.workdir = workdir
        self.down_after_ms = down_after_ms
        self.min_replicas = min_replicas
        self.max_lag = min_replicas_max_lag
        self.ports: list[int] = []
        self.sentinel_ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{SERVICE}"

    def _serving(self, port: int, proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
        """Until `proc` serves on `port` (INFO names its pid: ours, not another process's); ExitedError at
        once if it exits (the port was taken, most likely)."""
        c = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=2, decode_responses=True)

        def ours() -> bool:
            if proc.poll() is not None:
                raise ExitedError(f"{what} on {port} exited with {proc.returncode}: {_log_tail(log)}")
            return c.info("server")["process_id"] == proc.pid

        try:
            wait_for(ours, 20, f"our {what} on {port}")
        finally:
            c.close()

    def _on_a_free_port(self, start: Callable[[int], None], first: int | None = None) -> int:
        """start(port) on `first` (or a free port), then on fresh free ports while the port was taken under
        it; the port it serves on."""
        exited: list[str] = []
        for i in range(PORT_TRIES):
            port = first if first is not None and i == 0 else _free_ports(1)[0]
            try:
                start(port)
                return port
            except ExitedError as e:
                self.procs.pop(port, None)
                exited.append(str(e))
        raise ExitedError(f"no port in {PORT_TRIES} tries: " + "; ".join(exited))

    def _server(self, port: int, replica_of: int | None) -> None:
        d = self.workdir / f"redis-{port}"
        d.mkdir(parents=True, exist_ok=True)
        args = [
            redis_binary("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
            "--repl-diskless-sync",
            "yes",
            "--repl-diskless-sync-delay",
            "0",
            "--min-replicas-to-write",
            str(self.min_replicas),
            "--min-replicas-max-lag",
            str(self.max_lag),
            "--repl-ping-replica-period",
            "1",
            "--logfile",
            str(d / "redis.log"),
        ]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        proc = self.procs[port] = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(os.getpid()),
        )
        self._serving(port, proc, d / "redis.log", "redis-server")

    def _sentinel(self, port: int, primary: int) -> None:
        d = self.workdir / f"sentinel-{port}"
        d.mkdir(parents=True, exist_ok=True)
        conf = d / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 2\n"
        )
        proc = self.procs[port] = subprocess.Popen(
            [redis_binary("redis-sentinel"), str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(os.getpid()),
        )
        self._serving(port, proc, d / "sentinel.log", "redis-sentinel")

    def start(self) -> "SentinelCluster":
        # each port is picked just before its process starts (not all up front: the replicas' connections to
        # the primary, and every other process's, take source ports from the same range meanwhile)
        primary = self._on_a_free_port(lambda p: self._server(p, None))
        self.ports = [primary] + [self._on_a_free_port(lambda p: self._server(p, primary)) for _ in range(2)]
        pc = redis.Redis(port=primary, decode_responses=True)
        wait_for(lambda: pc.info("replication").get("connected_slaves") == 2, 30, "two replicas")
        self.sentinel_ports = [self._on_a_free_port(lambda p: self._sentinel(p, primary)) for _ in range(3)]
        for p in self.sentinel_ports:
            s = redis.Redis(port=p, decode_responses=True, socket_connect_timeout=0.2)
            wait_for(
                lambda: (lambda m: m["num-other-sentinels"] == 2 and m["num-slaves"] == 2)(
                    s.sentinel_master(SERVICE)
                ),
                60,
                f"sentinel {p} to see its peers and replicas",
            )
        return self

    def primary_port(self) -> int:
        """The primary the Sentinels agree on (waits until a majority name the same live one)."""

        def agreed() -> int | None:
            seen = []
            for p in self.sentinel_ports:
                try:
                    m = redis.Redis(port=p, decode_responses=True, socket_timeout=1).sentinel_master(SERVICE)
                    seen.append(int(m["port"]))
                except redis.RedisError:
                    continue
            top = max(set(seen), key=seen.count) if seen else None
            if top is None or seen.count(top) < 2 or not self.alive(top):
                return None
            role = redis.Redis(port=top, socket_timeout=1).role()[0]
            return top if role in (b"master", "master") else None

        return int(wait_for(agreed, 60, "the Sentinels to agree on a primary", every=0.05))  # type: ignore[arg-type]

    def alive(self, port: int) -> bool:
        p = self.procs.get(port)
        return p is not None and p.poll() is None

    def kill(self, port: int) -> None:
        p = self.procs[port]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def pause(self, port: int, paused: bool) -> None:
        os.kill(self.procs[port].pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def restart(self, port: int) -> int:
        """Start a killed server again, empty, as a replica of the current primary: on its old port, which
        the Sentinels know (or, if another process took the port meanwhile, on a fresh one); returns the
        port."""
        primary = self.primary_port()
        del self.procs[port]
        new = self._on_a_free_port(lambda p: self._server(p, primary), first=port)
        self.ports[self.ports.index(port)] = new
        return new

    def wait_healthy(self, timeout_s: float = 60) -> None:
        """Until the primary has two replicas online and in sync and every Sentinel knows them (Sentinel
        learns a new replica from the primary's INFO, every 10 s): only a replica Sentinel knows can be
        promoted, so killing the primary before that is a second failure, not a failover."""

        def healthy() -> bool:
            primary = self.primary_port()
            info = redis.Redis(port=primary, decode_responses=True, socket_timeout=1).info("replication")
            offset = int(info["master_repl_offset"])
            online = {
                int(v["port"])
                for k, v in info.items()
                if k.startswith("slave")
                and isinstance(v, dict)
                and v.get("state") == "online"
                and offset - int(v["offset"]) < 1_000_000
            }
            if len(online) < 2:
                return False
            for p in self.sentinel_ports:
                reps = redis.Redis(port=p, decode_responses=True, socket_timeout=1).sentinel_slaves(SERVICE)
                known = {
                    int(r["port"]) for r in reps if not r["is_sdown"] and r.get("master-port") == primary
                }
                if not online <= known:
                    return False
            return True

        wait_for(healthy, timeout_s, "two in-sync replicas that every Sentinel knows", every=0.2)

    def epoch(self) -> int:
        return epoch_source(self.url)()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def shard(job: str, step: int, rank: int, world: int, nbytes: int = 4096) -> tuple[bytes, str]:
    """Deterministic bytes for (job, step, rank) and their manifest JSON."""
    seed = f"{job}/{step}/{rank}".encode()
    data = (seed * (nbytes // len(seed) + 1))[:nbytes]
    m = ShardManifest(
        job,
        step,
        rank,
        world,
        blob_key(job, step, rank),
        len(data),
        1024,
        tuple(checksum_chunks(memoryview(data), 1024)),
        (),
        {},
        time.time(),
    )
    return data, m.to_json()


@dataclasses.dataclass
class SaveLog:
    """What agents were told: (step, rank) -> time a commit of that shard was reported."""

    reported: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    attempts: list[tuple[float, float]] = dataclasses.field(
        default_factory=list
    )  # (start, end) of each reported try
    completed: dict[int, list[int]] = dataclasses.field(
        default_factory=dict
    )  # step -> ranks told "committed"
    announced: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> CHECKPOINT_COMMITTED events
    verified: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> CHECKPOINT_VERIFIED events
    errors: list[str] = dataclasses.field(default_factory=list)
    retried: list[tuple[float, str]] = dataclasses.field(default_factory=list)  # (time, error) of each retry
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def agent(
    url: str,
    root: Path,
    name: str,
    log: SaveLog,
    *,
    replicas: int = 1,
    fence: CommitFence | None = None,
    failover_s: float = 15.0,
) -> Coordinator:
    """A coordinator as an agent builds it for a Sentinel URL (daemon/checkpoint_service.py)."""
    opts = RedisOptions(timeout_s=2.0, failover_s=failover_s, replicas_to_ack=replicas, ack_timeout_ms=1000)

    def publish(kind: EventKind, subject: str, message: str, details: dict) -> None:
        with log.lock:
            if kind is ek.CHECKPOINT_COMMITTED:
                log.announced[details["step"]] = log.announced.get(details["step"], 0) + 1
            elif kind is ek.CHECKPOINT_VERIFIED:
                log.verified[details["step"]] = log.verified.get(details["step"], 0) + 1

    return Coordinator(
        connect(url, opts),
        DirStore(root / name),
        node=name,
        location=str(root / name),
        config=CoordinatorConfig(keep_committed=100_000, pending_timeout_s=3600.0),
        publish=publish,
        fence=fence
        or CommitFence(epoch_source(url, opts), replicas=replicas, ack_timeout_ms=1000, all_online=True,
                       era_source=era_source(url, opts)),
    )


def save_shard(
    co: Coordinator,
    job: str,
    step: int,
    rank: int,
    world: int,
    log: SaveLog,
    deadline_s: float,
    vote: bool = False,
) -> bool:
    """begin -> write -> commit (-> vote) for one shard, retrying what is transient until `deadline_s`
    (a lost begin is begun again); True once reported."""
    data, manifest = shard(job, step, rank, world)
    co.store.put(blob_key(job, step, rank), data)
    deadline = time.monotonic() + deadline_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        start = time.monotonic()
        try:
            co.begin(job, step, rank, world)
            r = co.commit_shard(job, step, rank, world, manifest)
            with log.lock:
                log.reported[(step, rank)] = time.monotonic()
                log.attempts.append((start, log.reported[(step, rank)]))
                if r.committed_now and rank not in log.completed.get(step, []):  # a retry after the vote
                    log.completed.setdefault(step, []).append(rank)
            if vote and r.committed_now:
                co.on_job_event(job, step, "vote_agreed", time.time())
            return True
        except NotInMemoryError:
            continue  # the begin was lost with the old primary: begin again
        except (CheckpointError, redis.RedisError) as e:
            last = e
            with log.lock:
                log.retried.append((time.monotonic(), f"{type(e).__name__}: {e}"[:200]))
            if not getattr(e, "transient", True) and not isinstance(e, redis.RedisError):
                with log.lock:
                    log.errors.append(f"step {step} rank {rank}: {type(e).__name__}: {e}")
                return False
            time.sleep(0.05)
    with log.lock:
        log.errors.append(f"step {step} rank {rank}: not reported within {deadline_s} s (last: {last!r})")
    return False


def resumed_after(log: SaveLog, killed: float) -> float | None:
    """Seconds from `killed` to the first commit reported by a try that started after it (None: none yet)."""
    with log.lock:
        ends = [end for start, end in log.attempts if start > killed]
    return min(ends) - killed if ends else None
