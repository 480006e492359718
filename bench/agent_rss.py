"""The agent's resident memory, and whether it maps libtorch, after one canary round.

  python bench/agent_rss.py [--nvml-scenario FILE] [--no-canary] [--timeout 600] [--json OUT]

Starts the real agent (`python -m daemon.cli run`, embedded defaults, a temp state dir, NVML and the canary
scheduler on), waits until it is SERVING, then until the canary probe has finished one round (its `runs` in
GetStatus; the canary's findings in the event journal are printed), then reads /proc/PID/status (VmRSS,
VmHWM) and /proc/PID/maps. Without a canary probe (no NVML on the node, or the canary off) it waits
`--settle-s` after SERVING instead and says so. Prints one JSON object; exit 1 when libtorch is mapped.

On a GPU host: `python bench/agent_rss.py` (real NVML; the first canary round starts at the agent's start on
idle GPUs). On a machine without GPUs: `python bench/agent_rss.py --nvml-scenario tests/scenarios/clean.json`.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
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

TORCH_LIB = re.compile(r"/(libtorch[^/]*\.so|torch/_C[^/]*\.so)")


def status_kib(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM ... from /proc/PID/status, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            out[key] = int(value.split()[0])
    return out


def torch_libraries(pid: int) -> list[str]:
    """The torch shared libraries mapped into the process (empty: torch was never imported)."""
    libs = {m.group(0) for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if (m := TORCH_LIB.search(line))}
    return sorted(libs)


def wait_serving(stub: health_pb2_grpc.HealthStub, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited with {proc.returncode}")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise SystemExit("the agent was not SERVING in time")


def canary_probe(agent: pb_grpc.AgentStub) -> pb.ProbeStatus | None:
    for p in agent.GetStatus(pb.GetStatusRequest(), timeout=5).probes:
        if p.name == "canary":
            return p
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvml-scenario", help="a fake NVML scenario (tests/scenarios/*.json) instead of real NVML")
    ap.add_argument("--no-canary", action="store_true", help="run the agent with the canary scheduler off")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a canary round")
    ap.add_argument("--settle-s", type=float, default=5.0, help="wait after SERVING when there is no canary")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()

    state = Path(tempfile.mkdtemp(prefix="sdcw-rss-"))
    sock = state / "agent.sock"
    cmd = [sys.executable, "-m", "daemon.cli", "run", "--state-dir", str(state), "--metrics-listen", "127.0.0.1:0"]
    if args.nvml_scenario:
        cmd += ["--nvml-scenario", str(Path(args.nvml_scenario).resolve())]
    cmd += ["--no-canary-enabled"] if args.no_canary else []
    log = open(state.parent / f"{state.name}.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    result: dict[str, object] = {"command": " ".join(cmd), "pid": proc.pid}
    try:
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            deadline = time.monotonic() + args.timeout
            while not sock.exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            wait_serving(health_pb2_grpc.HealthStub(ch), proc, deadline)
            result["serving_after_s"] = round(time.monotonic() - t0, 2)
            agent = pb_grpc.AgentStub(ch)
            probe = canary_probe(agent)
            if probe is None or probe.state == pb.PROBE_STATE_DISABLED:
                result["canary"] = "no canary probe (no NVML, or the canary is off)"
                time.sleep(args.settle_s)
            else:
                while probe is not None and probe.runs < 1 and time.monotonic() < deadline:
                    time.sleep(0.5)
                    probe = canary_probe(agent)
                if probe is None or probe.runs < 1:
                    result["canary"] = f"no canary round finished within {args.timeout:.0f}s"
                else:
                    result["canary"] = {"runs": probe.runs, "state": pb.ProbeState.Name(probe.state),
                                        "duration_s": round(probe.last_duration_s, 2),
                                        "last_error": probe.last_error}
                    events = agent.WatchEvents(pb.WatchEventsRequest(kinds=["canary."]),
                                               timeout=10)
                    result["canary_events"] = [f"{e.kind} {e.subject}: {e.message}" for e in events]
        time.sleep(1.0)  # let the round's garbage go
        kib = status_kib(proc.pid)
        libs = torch_libraries(proc.pid)
        result.update(rss_mb=round(kib["VmRSS"] / 1024, 1), peak_rss_mb=round(kib["VmHWM"] / 1024, 1),
                      libtorch_mapped=bool(libs), torch_libraries=libs)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(state, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if result.get("libtorch_mapped") else 0


if __name__ == "__main__":
    sys.exit(main())
