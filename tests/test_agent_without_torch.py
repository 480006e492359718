"""The agent process never loads torch: the real agent on embedded defaults (embedded Redis, checkpoint
service), NVML on through a fake scenario and the canary scheduler on, after its first canary round.

The import-linter contract "The agent never imports torch" (pyproject.toml) checks the import graph; this
checks the running process: /proc/PID/maps holds no torch library, and its resident memory stays within
the issue's bound (150 MB on the GPU-less CI machine; `bench/agent_rss.py` measures the same on a GPU host).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import grpc
import pytest

from agent_harness import AgentProcess
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
from deadlines import scaled

SCENARIO = Path(__file__).parent / "scenarios" / "clean.json"
TORCH_LIB = re.compile(r"/(libtorch[^/]*\.so|torch/_C[^/]*\.so|libtriton[^/]*\.so)")
RSS_BOUND_MB = 150.0


def _canary_probe(target: str) -> pb.ProbeStatus | None:
    with grpc.insecure_channel(target) as ch:
        resp = pb_grpc.AgentStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10)
    assert resp.nvml_available, resp.nvml_reason
    return next((p for p in resp.probes if p.name == "canary"), None)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def test_the_agent_maps_no_torch_after_a_canary_round(short_tmp: Path, record_property: pytest.RecordProperty) -> None:
    with AgentProcess(short_tmp / "state", "--nvml-scenario", str(SCENARIO), "--canary-enabled") as agent:
        assert agent.proc is not None
        deadline = time.monotonic() + scaled(60)
        probe = _canary_probe(agent.target)
        while (probe is None or probe.runs < 1) and time.monotonic() < deadline:
            time.sleep(0.1)
            probe = _canary_probe(agent.target)
        assert probe is not None and probe.runs >= 1, "the canary scheduler did not finish a round"
        assert probe.state == pb.PROBE_STATE_OK, probe.last_error
        maps = Path(f"/proc/{agent.proc.pid}/maps").read_text()
        rss = _rss_mb(agent.proc.pid)
        record_property("agent_rss_mb", round(rss, 1))
        print(f"agent RSS after a canary round: {rss:.1f} MB")
    assert not TORCH_LIB.search(maps), sorted(set(m.group(0) for m in TORCH_LIB.finditer(maps)))
    assert rss <= RSS_BOUND_MB, f"agent RSS {rss:.1f} MB over {RSS_BOUND_MB} MB"
