"""The checkpoint commit path on the agent's embedded Redis with each persistence mode, side by side.

    PYTHONPATH=$PWD python bench/bench_redis_persist.py [--dir /var/lib/x] [--rounds 5] [--commits 200] [--world 8]

One embedded redis-server per mode (daemon/redis_embedded.py's settings: "none", "aof" = appendfsync no (the
agent's), "aof-everysec", "aof-always", "rdb" = a snapshot each second with a change), each with its
state dir under `--dir` (default: a temp dir in /tmp; give the disk the agent's state dir is on, e.g.
/var/lib/sdcwatch's). A real `Coordinator` commits checkpoints of `--world` shards (Begin and CommitShard of
every rank, the Lua scripts and the blob check the agent runs; tiny blobs, so Redis dominates), one after
another, the modes taking turns commit by commit (a load that drifts hits every mode alike). Prints per
mode: checkpoint commits per second, the latency of one checkpoint commit (p50, p99), each as a ratio
against "none"; then the durability check: writes a client saw acknowledged, lost when the server is
SIGKILLed right after (`--kills` times per mode, 50 writes each).
CPU only.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from checkpoint.coordinator import Coordinator, CoordinatorConfig, blob_key  # noqa: E402
from checkpoint.manifest import ShardManifest  # noqa: E402
from checkpoint.shm_store import DirStore  # noqa: E402
from daemon import redis_embedded  # noqa: E402
from daemon.redis_embedded import EmbeddedRedis  # noqa: E402

MODES = {
    "none": redis_embedded.PERSISTENCE["none"],
    "aof": redis_embedded.PERSISTENCE["aof"],
    "aof-everysec": ["--appendonly", "yes", "--appendfsync", "everysec", "--appendfilename", "redis.aof",
                     "--save", ""],
    "aof-always": ["--appendonly", "yes", "--appendfsync", "always", "--appendfilename", "redis.aof",
                   "--save", ""],
    "rdb": redis_embedded.PERSISTENCE["rdb"],
}


def _manifest(job: str, step: int, rank: int, world: int, blob: bytes) -> str:
    from checkpoint.chunks import checksum_chunks

    return ShardManifest(job_id=job, step=step, rank=rank, world_size=world, blob=blob_key(job, step, rank),
                         nbytes=len(blob), chunk_bytes=4096, chunks=tuple(checksum_chunks(memoryview(blob), 4096)),
                         tensors=(), tree={}, created=time.time()).to_json()


class Server:
    def __init__(self, mode: str, root: Path) -> None:
        self.mode = mode
        redis_embedded.PERSISTENCE.setdefault(mode, MODES[mode])
        self.er = EmbeddedRedis(root / mode, persistence=mode)
        self.er.start()
        store = DirStore(root / mode / "memory")
        self.client = redis.Redis(unix_socket_path=str(self.er.socket))
        self.co = Coordinator(self.client, store, node="n0", location=str(store.root),
                              config=CoordinatorConfig(keep_committed=2, verify_on_commit=False))
        self.step = 0
        self.blob = os.urandom(4096)

    def commit_one(self, world: int) -> float:
        self.step += 1
        job, step = "bench", self.step
        t0 = time.perf_counter()
        for r in range(world):
            self.co.begin(job, step, r, world, now=time.time())
        for r in range(world):
            self.co.store.put(blob_key(job, step, r), self.blob)
            self.co.commit_shard(job, step, r, world, _manifest(job, step, r, world, self.blob), now=time.time())
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.client.close()
        self.er.stop()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def lost_on_kill(mode: str, root: Path, kills: int, writes: int = 50) -> int:
    """Acknowledged writes missing after a SIGKILL of the server and a restart, summed over `kills`."""
    d = root / f"kill-{mode}"
    redis_embedded.PERSISTENCE.setdefault(mode, MODES[mode])
    expected, lost = 0, 0
    for _ in range(kills):
        er = EmbeddedRedis(d, persistence=mode)
        er.start()
        c = redis.Redis(unix_socket_path=str(er.socket))
        have = c.dbsize()
        lost += max(0, expected - have)
        expected = have
        for _ in range(writes):
            c.set(f"k{expected}", b"x" * 512)
            expected += 1
        c.close()
        assert er.proc is not None
        os.kill(er.proc.pid, signal.SIGKILL)
        er.proc.wait()
    er = EmbeddedRedis(d, persistence=mode)
    er.start()
    c = redis.Redis(unix_socket_path=str(er.socket))
    lost += max(0, expected - c.dbsize())
    c.close()
    er.stop()
    return lost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="", help="where the state dirs go (the agent's state dir's filesystem)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--commits", type=int, default=200, help="checkpoint commits per mode per round")
    ap.add_argument("--world", type=int, default=8, help="shards per checkpoint")
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs of each server for the durability check")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sdcw-bench-persist-", dir=args.dir or "/tmp") as d:
        root = Path(d)
        servers = {m: Server(m, root) for m in MODES}
        lat: dict[str, list[float]] = {m: [] for m in MODES}
        wall: dict[str, float] = {m: 0.0 for m in MODES}
        try:
            for s in servers.values():   # warm up
                for _ in range(10):
                    s.commit_one(args.world)
            order = list(MODES)
            for i in range(args.rounds * args.commits):   # one commit per mode in turn: drifting load hits all
                k = i % len(order)
                for m in order[k:] + order[:k]:
                    t0 = time.perf_counter()
                    lat[m].append(servers[m].commit_one(args.world))
                    wall[m] += time.perf_counter() - t0
        finally:
            for s in servers.values():
                s.stop()
        print(f"checkpoint commits ({args.world} shards: {2 * args.world} Redis script calls each), "
              f"{args.rounds} x {args.commits} per mode, state dirs on {root}")
        base_rate = args.rounds * args.commits / wall["none"]
        base_p50 = statistics.median(lat["none"])
        print(f"{'mode':<13} {'commits/s':>10} {'ratio':>6} {'p50 ms':>8} {'ratio':>6} {'p99 ms':>8}")
        for m in MODES:
            rate = args.rounds * args.commits / wall[m]
            p50 = statistics.median(lat[m])
            print(f"{m:<13} {rate:>10.0f} {rate / base_rate:>6.2f} {p50 * 1e3:>8.2f} {p50 / base_p50:>6.2f} "
                  f"{_pct(lat[m], 0.99) * 1e3:>8.2f}")
        print(f"acknowledged writes lost over {args.kills} SIGKILLs of the server (50 writes each):")
        for m in MODES:
            print(f"{m:<13} {lost_on_kill(m, root, args.kills)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
