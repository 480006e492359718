"""Agent latency, throughput and memory, side by side with a bare grpc.aio server, in the same run.

  python bench/bench_agent.py [--calls 3000] [--rounds 3] [--memory-calls 100000] [--concurrency 16]

Starts the real agent (`sdcwatch run`, embedded Redis, unix socket) and a bare grpc.aio server that
answers the same RPCs with constant replies on another unix socket, then measures, interleaving the two:
  - health Check and ReportStep latency (p50, p99) from one sequential client,
  - ReportStep throughput with N concurrent in-flight calls (grpc.aio client),
  - the agent's resident memory over --memory-calls ReportStep calls (sampled every 10%).
Prints ratios agent/bare. Targets (issue 2): within 1.5x of the bare server; RSS flat.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from proto.sdcwatch.v1 import agent_pb2 as pb  # noqa: E402
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc  # noqa: E402
from sdcwatch.extras import available, needs  # noqa: E402


# -- the bare server -------------------------------------------------------------------------------
class BareHealth(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class BareAgent(pb_grpc.AgentServicer):
    async def ReportStep(self, request, context):
        return pb.ReportStepResponse(accepted=True)


async def serve_bare(sock: str) -> None:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(BareHealth(), server)
    pb_grpc.add_AgentServicer_to_server(BareAgent(), server)
    server.add_insecure_port(f"unix:{sock}")
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


# -- measurement -----------------------------------------------------------------------------------
def report(i: int, job: str = "bench", rank: int | None = None, world: int = 16) -> pb.ReportStepRequest:
    """Step i of a training rank: each (job, rank) stream has increasing steps, as a real rank's has."""
    if rank is None:
        rank, i = i % 8, i // 8
    return pb.ReportStepRequest(job_id=job, rank=rank, world_size=world, step=i, loss=2.0 + (i % 7) * 0.01,
                                grad_norm=1.0, fingerprint=[i, i * 3, 7, 11], time=time.time(),
                                timings=pb.StepTimings(step_s=0.03, check_s=0.0001),
                                host="bench-host", gpu_uuid=f"GPU-{rank % 8:08d}-0000-0000-0000-000000000000")


def wait_health(target: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(target) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    raise TimeoutError(target)


def latencies(target: str, kind: str, n: int, offset: int) -> list[float]:
    out = []
    with grpc.insecure_channel(target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        agent = pb_grpc.AgentStub(ch)
        req = health_pb2.HealthCheckRequest()
        for _ in range(50):  # warm the channel
            health.Check(req, timeout=5)
        for i in range(n):
            t0 = time.perf_counter()
            if kind == "health":
                health.Check(req, timeout=5)
            else:
                agent.ReportStep(report(offset + i), timeout=5)
            out.append(time.perf_counter() - t0)
    return out


async def throughput(target: str, seconds: float, concurrency: int, offset: int) -> float:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.AgentStub(ch)
        done = 0
        deadline = time.perf_counter() + seconds

        async def worker(w: int) -> None:
            # Each worker is one training rank, as on a node: jobs of 8 ranks (world size 8), one report in
            # flight per rank, steps increasing. The job's loss detector runs once per step, not per call.
            nonlocal done
            i = 0
            while time.perf_counter() < deadline:
                await stub.ReportStep(report(offset + i, job=f"tput-{w // 8}", rank=w % 8, world=8), timeout=5)
                i += 1
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return done / (time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cpu_s(pid: int) -> float:
    import psutil  # the bench extra: main checks for it

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds of the process's main thread (its event loop: the one thread every call goes through,
    so what bounds throughput when the GIL is the limit). NaN where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    import psutil  # the bench extra: main checks for it

    return psutil.Process(pid).memory_info().rss / 2**20


async def memory_run(target: str, calls: int, pid: int, concurrency: int) -> list[tuple[int, float]]:
    samples = [(0, rss_mb(pid))]
    step = max(1, calls // 10)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.AgentStub(ch)
        sent = 0
        while sent < calls:
            batch = min(step, calls - sent)

            async def worker(w: int, count: int, base: int) -> None:
                for i in range(count):
                    await stub.ReportStep(report(base + i, job=f"mem-{w % 4}", rank=w), timeout=10)

            per = max(1, batch // concurrency)  # a last batch smaller than the concurrency still sends
            await asyncio.gather(*(worker(w, per, 10_000_000 + sent) for w in range(concurrency)))
            sent += per * concurrency
            samples.append((sent, rss_mb(pid)))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000, help="sequential calls per latency block")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (agent, bare, agent, ...)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per throughput block")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--memory-calls", type=int, default=100_000)
    ap.add_argument("--no-nvml", action="store_true", help="run the agent without its NVML probe")
    ap.add_argument("--with-canary", action="store_true",
                    help="leave the agent's canary on (on a GPU host it runs at start on idle GPUs)")
    ap.add_argument("--bare-server", help=argparse.SUPPRESS)
    ap.add_argument("--bare-uvloop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not available("psutil"):
        sys.exit(f"bench_agent: {needs('psutil')}")
    if args.bare_server:
        if args.bare_uvloop:
            import uvloop

            uvloop.run(serve_bare(args.bare_server))
        else:
            asyncio.run(serve_bare(args.bare_server))
        return

    tmp = Path(tempfile.mkdtemp(prefix="sdcw-bench-", dir="/tmp"))
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""))
    # The canary is off unless --with-canary: on a GPU host it runs at the agent's start on idle GPUs (seconds
    # of GEMMs), which is not the RPC path this compares. NVML polling stays on, as deployed.
    agent = subprocess.Popen([sys.executable, "-m", "daemon.cli", "run", "--state-dir", str(tmp / "a"),
                              "--metrics-listen", "off", "--log-level", "WARNING",
                              *([] if args.with_canary else ["--no-canary-enabled"]),
                              *(["--no-nvml-enabled"] if args.no_nvml else [])], cwd=ROOT, env=env)
    bare = subprocess.Popen([sys.executable, __file__, "--bare-server", str(tmp / "bare.sock")], cwd=ROOT, env=env)
    targets = {"agent": f"unix:{tmp / 'a' / 'agent.sock'}", "bare": f"unix:{tmp / 'bare.sock'}"}
    servers = [agent, bare]
    import importlib.util

    if importlib.util.find_spec("uvloop"):  # the agent runs on uvloop when it is installed: show that baseline too
        bare_uv = subprocess.Popen([sys.executable, __file__, "--bare-server", str(tmp / "bare-uv.sock"),
                                    "--bare-uvloop"], cwd=ROOT, env=env)
        servers.append(bare_uv)
        targets["bare-uvloop"] = f"unix:{tmp / 'bare-uv.sock'}"
    try:
        for t in targets.values():
            wait_health(t)
        lat: dict[tuple[str, str], list[float]] = {}
        tput: dict[str, list[float]] = {k: [] for k in targets}
        cpu_us: dict[str, list[float]] = {k: [] for k in targets}  # server CPU per call in the throughput blocks
        loop_us: dict[str, list[float]] = {k: [] for k in targets}  # of which the main (event loop) thread
        pids = {k: p.pid for k, p in zip(targets, servers)}
        offset = 0
        for r in range(args.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for who in order:
                for kind in ("health", "report"):
                    if who == "bare-uvloop":
                        continue  # latency: agent vs the bare asyncio server (the baseline)
                    lat.setdefault((who, kind), []).extend(latencies(targets[who], kind, args.calls, offset))
                    offset += args.calls
                c0, m0, t0 = cpu_s(pids[who]), main_thread_cpu_s(pids[who]), time.perf_counter()
                rate = asyncio.run(throughput(targets[who], args.seconds, args.concurrency, offset))
                calls = rate * (time.perf_counter() - t0)
                tput[who].append(rate)
                cpu_us[who].append((cpu_s(pids[who]) - c0) / max(calls, 1) * 1e6)
                loop_us[who].append((main_thread_cpu_s(pids[who]) - m0) / max(calls, 1) * 1e6)
                offset += 10_000_000
        mem = asyncio.run(memory_run(targets["agent"], args.memory_calls, agent.pid, args.concurrency))
    finally:
        for p in servers:
            p.send_signal(signal.SIGTERM)
        for p in servers:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nsdcwatch agent vs bare grpc.aio server (unix socket, python {sys.version.split()[0]}, "
          f"grpc {grpc.__version__}, {os.cpu_count()} cpus; agent NVML {'off' if args.no_nvml else 'on'}, "
          f"canary {'on' if args.with_canary else 'off'})")
    print(f"{'rpc':<12}{'agent p50':>11}{'bare p50':>10}{'ratio':>7}{'agent p99':>11}{'bare p99':>10}{'ratio':>7}")
    for kind, label in (("health", "Check"), ("report", "ReportStep")):
        a, b = lat[("agent", kind)], lat[("bare", kind)]
        a50, b50, a99, b99 = pct(a, .5) * 1e6, pct(b, .5) * 1e6, pct(a, .99) * 1e6, pct(b, .99) * 1e6
        print(f"{label:<12}{a50:>9.0f}us{b50:>8.0f}us{a50 / b50:>7.2f}{a99:>9.0f}us{b99:>8.0f}us{a99 / b99:>7.2f}")
    ta, tb = statistics.median(tput["agent"]), statistics.median(tput["bare"])
    print(f"ReportStep throughput, {args.concurrency} in flight: agent {ta:,.0f}/s, bare {tb:,.0f}/s, "
          f"ratio bare/agent {tb / ta:.2f}")
    ca, cb = statistics.median(cpu_us["agent"]), statistics.median(cpu_us["bare"])
    print(f"server CPU per ReportStep in those blocks (all threads): agent {ca:.0f} us, bare {cb:.0f} us, "
          f"ratio {ca / cb:.2f} (what bounds throughput when the server, not the client, is saturated)")
    la, lb = statistics.median(loop_us["agent"]), statistics.median(loop_us["bare"])
    print(f"  of which the event-loop thread: agent {la:.0f} us, bare {lb:.0f} us, ratio {la / lb:.2f}")
    if tput.get("bare-uvloop"):
        tu, cu = statistics.median(tput["bare-uvloop"]), statistics.median(cpu_us["bare-uvloop"])
        lu = statistics.median(loop_us["bare-uvloop"])
        print(f"  the same against a bare server on uvloop (the agent's loop): {tu:,.0f}/s, ratio bare/agent "
              f"{tu / ta:.2f}; CPU {cu:.0f} us, ratio {ca / cu:.2f}; event-loop thread {lu:.0f} us, "
              f"ratio {la / lu:.2f}")
    print("  throughput per round (agent / bare): " + ", ".join(
        f"{a:,.0f}/{b:,.0f}" for a, b in zip(tput["agent"], tput["bare"])))
    first = mem[1][1] if len(mem) > 1 else mem[0][1]
    print("agent RSS over ReportStep calls: " + ", ".join(f"{n // 1000}k:{m:.0f}MB" for n, m in mem))
    print(f"RSS growth from the first 10% to the end: {mem[-1][1] - first:+.1f} MB over {mem[-1][0]:,} calls")


if __name__ == "__main__":
    main()
