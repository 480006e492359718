"""Commits through Redis Sentinel failovers: time-to-resume over repeated primary kills.

    PYTHONPATH=$PWD python bench/bench_sentinel.py [--cycles 20] [--agents 3] [--down-after-ms 1500]

Starts 3 redis-server (primary + 2 replicas) and 3 redis-sentinel (tests/sentinel_support.py, the settings
docs/sentinel.md recommends), runs `--agents` agents (one rank each, a real Coordinator over a
`redis+sentinel://` URL, WAIT for one replica) saving step after step, and kills the primary `--cycles`
times (SIGKILL; the dead server is restarted empty as a replica once saves resumed, and the next kill waits
until both replicas are in sync and known to every Sentinel: one failure at a time). Prints, per cycle,
the seconds from the kill to the first commit reported by a try begun after it, then p50/max and the
checks: nothing
reported is lost, nothing VERIFIED is lost, each step completed and announced once. Target: max < 5 s.
CPU only (no GPU needed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from checkpoint import policy  # noqa: E402
from sentinel_support import (
    DOWN_AFTER_MS,
    SaveLog,
    SentinelCluster,
    agent,
    resumed_after,
    save_shard,
    wait_for,
)  # noqa: E402

JOB = "bench-ha"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument(
        "--down-after-ms",
        type=int,
        default=DOWN_AFTER_MS,
        help=f"the Sentinels' down-after-milliseconds (default {DOWN_AFTER_MS}, docs/sentinel.md)",
    )
    ap.add_argument("--workdir", help="keep the servers' logs here (default: a temp dir, removed)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sdcw-bench-ha-") as d:
        root = Path(args.workdir or d)
        cluster = SentinelCluster(root / "redis", down_after_ms=args.down_after_ms).start()
        log, stop, world = SaveLog(), threading.Event(), args.agents
        try:
            agents = [agent(cluster.url, root, f"node{r}", log) for r in range(world)]

            def run(rank: int) -> None:
                step = 0
                while not stop.is_set():
                    step += 1
                    save_shard(agents[rank], JOB, step, rank, world, log, deadline_s=60, vote=rank == 0)

            threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
            for t in threads:
                t.start()
            resume = []
            print(f"down-after-milliseconds {args.down_after_ms}; {world} agents; {args.cycles} kill cycles")
            for cycle in range(args.cycles):
                n = len(log.reported)
                wait_for(lambda: len(log.reported) >= n + 3 * world, 120, "saves before the kill")
                cluster.wait_healthy(120)
                primary, killed = cluster.primary_port(), time.monotonic()
                cluster.kill(primary)
                resume.append(
                    float(
                        wait_for(
                            lambda: resumed_after(log, killed),
                            120,  # type: ignore[arg-type]
                            "a commit after the kill",
                        )
                    )
                )
                print(
                    f"cycle {cycle + 1:2d}: primary :{primary} killed, "
                    f"commits resumed after {resume[-1]:.2f} s "
                    f"(epoch {cluster.epoch()})",
                    flush=True,
                )
                cluster.restart(primary)
            stop.set()
            for t in threads:
                t.join(120)
            final = {i.step: i for i in agents[0].list(JOB)}
            complete = {s for s, _ in log.reported if all((s, r) in log.reported for r in range(world))}
            lost = sorted(
                s for s in complete if s not in final or final[s].state not in policy.RESTORABLE_STATES
            )
            unverified = sorted(
                s for s in log.verified if final.get(s) is None or final[s].state != policy.VERIFIED
            )
            twice = sorted(s for s, r in log.completed.items() if len(r) != 1 or log.announced.get(s) != 1)
            print(
                f"time to resume: p50 {statistics.median(resume):.2f} s, max {max(resume):.2f} s "
                f"(target < 5 s) over {len(resume)} kills"
            )
            print(
                f"checkpoints committed: {len(complete)}; reported but lost: {lost or 'none'}; "
                f"VERIFIED lost: {unverified or 'none'}; completed or announced twice: {twice or 'none'}; "
                f"errors: {log.errors or 'none'}"
            )
            ok = not lost and not unverified and not twice and not log.errors and max(resume) < 5.0
            print("PASS" if ok else "FAIL")
            return 0 if ok else 1
        finally:
            stop.set()
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
