"""FAILED GPU -> Kubernetes node condition latency, against the recording API server (tests/k8s_support.py).

    PYTHONPATH=$PWD python bench/bench_node_conditions.py [--cycles 200]

The agent's real path: GpuRegistry (evidence -> FAILED) -> the health-changed event -> NodeHealth.sync ->
NodeConditions.notify -> NodeReporter.push through the `lightkube` client (GET the node, PATCH its
status, PATCH its taints). Each cycle makes a GPU FAILED and measures until the PATCH that says
SdcwatchGPUProblem=True arrives at the server, then clears it (until False arrives). Prints p50 / p99 / max
of both; target: p99 < 1 s. CPU only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from grpc_health.v1._async import HealthServicer  # noqa: E402

from daemon.background import Background  # noqa: E402
from daemon.gpus import GpuRegistry  # noqa: E402
from daemon.health import NodeHealth  # noqa: E402
from daemon.jobs import JobTracker  # noqa: E402
from daemon.k8s_nodes import NodeConditions, NodeReporter  # noqa: E402
from daemon.metrics import AgentMetrics  # noqa: E402
from daemon.node_conditions import GPU_PROBLEM  # noqa: E402
from k8s_support import FakeApiServer  # noqa: E402
from sdcwatch.types import Evidence, State  # noqa: E402

NODE = "bench-node"


def arrival(server: FakeApiServer, status: str, after: float) -> float | None:
    for r in server.patches():
        if r.at >= after and r.path.endswith("/status"):
            for c in r.body["status"]["conditions"]:
                if c["type"] == GPU_PROBLEM and c["status"] == status:
                    return r.at
    return None


async def run(cycles: int) -> tuple[list[float], list[float]]:
    server = FakeApiServer(NODE).start()
    try:
        changed = asyncio.Event()
        gpus = GpuRegistry(on_transition=lambda *a: changed.set())
        for i in range(8):
            gpus.ensure(f"GPU-{i}", time.time())
            gpus.add_evidence(
                f"GPU-{i}",
                [Evidence("nvml", "poll", "ok", State.HEALTHY, "readable", time.time())],
                time.time(),
            )
        live = NodeConditions(NodeReporter(server.api(), NODE, taint_key="sdcwatch.io/gpu-failed"), gpus)
        health = NodeHealth(
            HealthServicer(), gpus, AgentMetrics(jobs=JobTracker()), changed, followers=[live]
        )
        bg = Background()
        health.start(bg)
        await health.set_serving(True)
        failed, cleared = [], []
        for _ in range(cycles):
            for to, out, status in ((State.FAILED, failed, "True"), (State.HEALTHY, cleared, "False")):
                t0 = time.monotonic()
                if to is State.FAILED:
                    gpus.add_evidence(
                        "GPU-3",
                        [Evidence("nvml", "xid", "79", State.FAILED, "XID 79", time.time())],
                        time.time(),
                    )
                else:
                    gpus.clear("GPU-3", time.time(), by="bench", why="cycle")
                    gpus.add_evidence(
                        "GPU-3",
                        [Evidence("nvml", "poll", "ok", State.HEALTHY, "readable", time.time())],
                        time.time(),
                    )
                deadline = t0 + 30
                while (t := arrival(server, status, t0)) is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no {GPU_PROBLEM}={status} within 30 s")
                    await asyncio.sleep(0.001)
                out.append(t - t0)
        await bg.cancel()
        return failed, cleared
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200)
    args = ap.parse_args()
    failed, cleared = asyncio.run(run(args.cycles))

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1000

    for name, xs in (("FAILED -> condition True", failed), ("cleared -> condition False", cleared)):
        print(
            f"{name}: p50 {statistics.median(xs) * 1000:.1f} ms, p99 {q(xs, 0.99):.1f} ms, "
            f"max {max(xs) * 1000:.1f} ms over {len(xs)}"
        )
    ok = q(failed, 0.99) < 1000
    print("PASS (p99 < 1 s)" if ok else "FAIL (p99 >= 1 s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
