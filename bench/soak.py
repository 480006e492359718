"""The ReportStep soak: N ranks reporting at H Hz to the real agent, on its unix socket (issue 20).

  python -m bench.soak [--ranks 256] [--hz 10] [--minutes 10] [--deadline-s 0.5] [--vote-every 10] [--json OUT]

Starts the real agent (`sdcwatch run`, embedded Redis, a temp state dir), drives it with one grpc.aio client
whose tasks are the ranks, and prints one line per minute: reports offered, accepted, late (deadline
exceeded), skipped (the rank was behind: counted in its next `dropped_reports`, as the training-side reporter
does), accepted per second, the agent's RSS, health Check p50/p99 (one probe every 0.2 s), and the journal's
new events. At the end: vote steps sent vs those the checkpoint coordinator holds,
`sdcwatch_events_dropped_total{sink="checkpoint-job-events"}`, and one `summary:` JSON line (`summarize`: RSS
growth, health p50/p99 over every probe and the worst window, accepted/s first and last window, errors, the
load average before and after). The temp state dir and the agent's memory dir are removed at the end.

Each rank behaves like the training-side reporter (checksums/reporter.py): its step s is produced at t0 + s/H
into a queue of `queue_size` (256); one call in flight with the reporter's deadline; a report that finds the
queue full, or whose call fails, is dropped and counted in the next report's `dropped_reports`. Every
`--vote-every` steps the step's replica vote (agreed) rides on its report; a rank whose vote report was
dropped carries the vote on its next report. tests/test_soak.py runs a
short form of the same driver (`run_soak`) and asserts what must hold; the timings are measured here only.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from proto.sdcwatch.v1 import agent_pb2 as pb  # noqa: E402
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc  # noqa: E402


@dataclasses.dataclass
class Minute:
    """One sampling window's numbers."""
    offered: int = 0
    accepted: int = 0
    late: int = 0
    errors: int = 0
    skipped: int = 0
    health_ms: list[float] = dataclasses.field(default_factory=list)
    rss_mb: float = 0.0
    events: int = 0
    seconds: float = 0.0

    def line(self, index: int) -> str:
        h = sorted(self.health_ms)
        p50 = statistics.median(h) if h else float("nan")
        p99 = h[min(len(h) - 1, int(len(h) * 0.99))] if h else float("nan")
        rate = self.accepted / self.seconds if self.seconds else 0.0
        return (f"window {index:2d}: offered {self.offered:7d}  accepted {self.accepted:7d} ({rate:7.0f}/s)  "
                f"late {self.late:6d}  skipped {self.skipped:6d}  errors {self.errors:4d}  "
                f"rss {self.rss_mb:6.1f} MB  health p50 {p50:6.2f} ms p99 {p99:7.2f} ms  journal +{self.events}")


@dataclasses.dataclass
class SoakResult:
    windows: list[Minute]
    votes_sent: set[int]            # vote steps carried by a report the agent accepted
    offered: int = 0
    accepted: int = 0
    late: int = 0
    errors: int = 0
    skipped: int = 0
    error_codes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # accepted reports the agent's loss detector must have judged late (a step 2 newer had been accepted
    # before the report was sent) and may have (a step 2 newer had been sent before its answer came): the
    # job's straggler count lies between them, whatever the machine's load made the ranks' drift
    straggled_min: int = 0
    straggled_max: int = 0


def _rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def _last_seq(stub: pb_grpc.AgentStub) -> int:
    return (await stub.GetStatus(pb.GetStatusRequest(), timeout=30)).last_event_seq


async def run_soak(target: str, *, job: str, ranks: int, hz: float, seconds: float, deadline_s: float = 0.5,
                   vote_every: int = 10, window_s: float = 60.0, agent_pid: int | None = None,
                   queue_size: int = 256, on_window=None) -> SoakResult:
    """Drive the agent at `target` (module docstring); returns the totals and the per-window numbers."""
    windows = [Minute()]
    totals = SoakResult(windows, set())
    async with grpc.aio.insecure_channel(target) as ch:
        stub, health = pb_grpc.AgentStub(ch), health_pb2_grpc.HealthStub(ch)
        seq = await _last_seq(stub)
        t0 = time.monotonic()
        stop_at = t0 + seconds
        total_steps = int(seconds * hz)

        newest = {"sent": -1, "done": -1}   # the newest step any rank sent / had accepted (the detector's
                                            # staleness: a step is judged once one 2 newer arrives)

        async def rank_loop(rank: int) -> None:
            queued: collections.deque[int] = collections.deque()
            produced, carried, vote_pending = 0, 0, None
            while True:
                now = time.monotonic()
                while produced < total_steps and t0 + produced / hz <= now:   # the rank's steps so far
                    if len(queued) >= queue_size:
                        carried += 1                  # the reporter's queue is full: dropped, counted
                        windows[-1].skipped += 1
                        if produced % vote_every == 0:
                            vote_pending = produced
                    else:
                        queued.append(produced)
                    produced += 1
                if not queued:
                    if produced >= total_steps:
                        return
                    await asyncio.sleep(max(0.0, t0 + produced / hz - time.monotonic()))
                    continue
                step = queued.popleft()
                if step % vote_every == 0:
                    vote_pending = step
                req = pb.ReportStepRequest(job_id=job, rank=rank, world_size=ranks, step=step, host="soak",
                                           loss=2.0 + 0.01 * ((step * 7 + rank) % 5), grad_norm=1.0,
                                           dropped_reports=carried)
                if vote_pending is not None:
                    req.vote.CopyFrom(pb.ReplicaVote(checked=True, agreed=True, replicas=ranks, step=vote_pending,
                                                     method="majority"))
                windows[-1].offered += 1
                surely_late = newest["done"] >= step + 2
                newest["sent"] = max(newest["sent"], step)
                try:
                    await stub.ReportStep(req, timeout=deadline_s)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                        windows[-1].late += 1   # out of time (the server cancels a call past its deadline)
                    else:
                        windows[-1].errors += 1
                        totals.error_codes[exc.code().name] += 1
                    carried += 1
                else:
                    windows[-1].accepted += 1
                    totals.straggled_min += surely_late
                    totals.straggled_max += newest["sent"] >= step + 2
                    newest["done"] = max(newest["done"], step)
                    carried = 0
                    if vote_pending is not None:
                        totals.votes_sent.add(vote_pending)
                        vote_pending = None

        async def health_loop() -> None:
            while True:
                t = time.perf_counter()
                try:
                    await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                    windows[-1].health_ms.append((time.perf_counter() - t) * 1e3)
                except grpc.aio.AioRpcError:
                    windows[-1].health_ms.append(5000.0)
                await asyncio.sleep(0.2)

        async def sampler() -> None:
            nonlocal seq
            started = time.monotonic()
            while True:
                await asyncio.sleep(max(0.0, min(window_s, stop_at - time.monotonic())))
                w = windows[-1]
                w.seconds = time.monotonic() - started
                w.rss_mb = _rss_mb(agent_pid)
                now_seq = await _last_seq(stub)
                w.events, seq = now_seq - seq, now_seq
                if on_window is not None:
                    on_window(len(windows), w)
                started = time.monotonic()
                if started >= stop_at - 1e-3:
                    return
                windows.append(Minute())

        side = [asyncio.create_task(health_loop())]
        sample = asyncio.create_task(sampler())
        await asyncio.gather(*(rank_loop(r) for r in range(ranks)))
        await sample
        for t in side:
            t.cancel()
        await asyncio.gather(*side, return_exceptions=True)
    for w in windows:
        totals.offered += w.offered
        totals.accepted += w.accepted
        totals.late += w.late
        totals.errors += w.errors
        totals.skipped += w.skipped
    return totals


def _p99(values: list[float]) -> float:
    h = sorted(values)
    return h[min(len(h) - 1, int(len(h) * 0.99))] if h else float("nan")


def summarize(result: SoakResult, load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict:
    """The run in one object: RSS growth (first window to last, and the largest), health Check p50/p99 over
    every probe and the worst window's p99, probes over 100 ms, accepted/s (first, last, min, max of the
    windows before the final drain), errors,
    and the 1-minute load average before and after (other work on the machine)."""
    ws = result.windows
    probes = [ms for w in ws for ms in w.health_ms]
    # accepted/s per window; the last window also counts the reports the ranks drain after the end: left out
    rate = [w.accepted / w.seconds if w.seconds else 0.0 for w in (ws[:-1] if len(ws) > 1 else ws)]
    return {"windows": len(ws), "offered": result.offered, "accepted": result.accepted,
            "accepted_pct": round(100 * result.accepted / max(1, result.offered), 2), "late": result.late,
            "skipped": result.skipped, "errors": result.errors, "error_codes": dict(result.error_codes),
            "rss_first_mb": round(ws[0].rss_mb, 1), "rss_last_mb": round(ws[-1].rss_mb, 1),
            "rss_max_mb": round(max(w.rss_mb for w in ws), 1),
            "rss_growth_mb": round(ws[-1].rss_mb - ws[0].rss_mb, 1),
            "health_probes": len(probes), "health_p50_ms": round(statistics.median(probes), 2) if probes else None,
            "health_p99_ms": round(_p99(probes), 2), "health_worst_window_p99_ms":
                round(max(_p99(w.health_ms) for w in ws), 2),
            "health_over_100ms": sum(ms > 100 for ms in probes),
            "accepted_per_s_first": round(rate[0]), "accepted_per_s_last": round(rate[-1]),
            "accepted_per_s_min": round(min(rate)), "accepted_per_s_max": round(max(rate)),
            "journal_events": sum(w.events for w in ws),
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in load_after]}


def feed_dropped(metrics_address: str) -> float:
    """`sdcwatch_events_dropped_total{sink="checkpoint-job-events"}` from the agent's /metrics."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith('sdcwatch_events_dropped_total{sink="checkpoint-job-events"}'):
            return float(line.split()[-1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--hz", type=float, default=10.0)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--deadline-s", type=float, default=0.5)
    ap.add_argument("--vote-every", type=int, default=10)
    ap.add_argument("--json", help="also write the summary (and each window) here")
    args = ap.parse_args()
    load_before = os.getloadavg()
    state = Path(tempfile.mkdtemp(prefix="sdcw-soak-", dir="/tmp")) / "state"
    sock = state / "agent.sock"
    log = open(state.parent / "agent.log", "ab")
    agent = subprocess.Popen([sys.executable, "-m", "daemon.cli", "run", "--state-dir", str(state),
                              "--metrics-listen", "127.0.0.1:0"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (state / "agent.json").exists():
            if agent.poll() is not None or time.monotonic() > deadline:
                print(f"the agent did not start; see {state.parent / 'agent.log'}", file=sys.stderr)
                return 1
            time.sleep(0.1)
        info = json.loads((state / "agent.json").read_text())
        print(f"soak: {args.ranks} ranks at {args.hz:g} Hz for {args.minutes:g} min "
              f"({args.ranks * args.hz:,.0f} reports/s offered), deadline {args.deadline_s}s; agent pid {agent.pid}")
        result = asyncio.run(run_soak(f"unix:{sock}", job="soak", ranks=args.ranks, hz=args.hz,
                                      seconds=args.minutes * 60, deadline_s=args.deadline_s,
                                      vote_every=args.vote_every, window_s=args.window_s, agent_pid=agent.pid,
                                      on_window=lambda i, w: print(w.line(i), flush=True)))
        print(f"total: offered {result.offered}, accepted {result.accepted} "
              f"({100 * result.accepted / max(1, result.offered):.1f}%), late {result.late}, skipped "
              f"{result.skipped}, errors {result.errors} {dict(result.error_codes)}")
        drops = feed_dropped(info['metrics'])
        print(f"votes: {len(result.votes_sent)} vote steps accepted; checkpoint feed drops: {drops:.0f}")
        summary = summarize(result, load_before, os.getloadavg())
        print("summary: " + json.dumps(summary))
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"command": " ".join(sys.argv), **summary, "vote_steps": len(result.votes_sent),
                 "feed_drops": drops, "per_window": [dataclasses.asdict(w) | {"health_ms": None}
                                                  for w in result.windows]}, indent=1) + "\n")
        return 0
    finally:
        agent.terminate()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
        log.close()
        from checkpoint.shm_store import default_shm_root
        from sdcwatch.safe_fs import remove_tree
        remove_tree(default_shm_root(state).parent)   # the memory dir the agent keeps for a restart
        shutil.rmtree(state.parent, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
