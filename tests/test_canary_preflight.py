"""`sdcwatch canary` as a preflight: exit codes from what NVML sees and what CUDA can use (fake NVML
scenarios; CUDA hidden with CUDA_VISIBLE_DEVICES="" so the same holds on a GPU host), through the real
child process, and the decision itself (`preflight_verdict`) on inventories."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from daemon import cli_canary
from daemon.cli_canary import EXIT_CANNOT_RUN, EXIT_FAIL, preflight_verdict

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
TWO_GPUS = SCENARIOS / "clean.json"
NO_NVML = SCENARIOS / "unavailable.json"
U0, U1 = "GPU-5dc0a7e1-0000-4000-8000-000000000000", "GPU-5dc0a7e1-0000-4000-8000-000000000001"


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sdcwatch")
    cli_canary.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_gpus_nvml_sees_but_cuda_cannot_use_fail_the_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["canary", "--level", "tiny", "--nvml-scenario", str(TWO_GPUS)]) == EXIT_FAIL
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("FAIL: NVML sees 2 GPU(s)") and U0 in out[-1] and "CUDA can use none" in out[-1]
    assert _cli(["canary", "--level", "tiny", "--json", "--nvml-scenario", str(TWO_GPUS)]) == EXIT_FAIL
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 1 and data["status"] == "FAIL" and "CUDA can use none" in data["reason"]
    assert data["inventory"]["nvml"]["uuids"] == [U0, U1] and data["inventory"]["cuda_uuids"] == []


def test_no_gpu_at_all_could_not_run_with_a_json_record(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["canary", "--level", "tiny", "--nvml-scenario", str(NO_NVML)]) == EXIT_CANNOT_RUN
    err = capsys.readouterr().err
    assert "no GPU" in err and "libnvidia-ml.so.1" in err
    assert _cli(["canary", "--json", "--nvml-scenario", str(NO_NVML)]) == EXIT_CANNOT_RUN
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 2 and data["status"] == "UNKNOWN" and "no GPU" in data["reason"]
    assert _cli(["canary", "--json", "--gpus", "0", "--nvml-scenario", str(NO_NVML)]) == EXIT_CANNOT_RUN
    assert json.loads(capsys.readouterr().out)["exit_code"] == 2
    assert _cli(["canary", "--json", "--dtypes", "int3"]) == EXIT_CANNOT_RUN  # bad usage: a record too
    assert "int3" in json.loads(capsys.readouterr().out)["reason"]


def test_cpu_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["canary", "--level", "tiny", "--device", "cpu", "--nvml-scenario", str(NO_NVML)]) == 0
    assert "--device cpu: ran on the CPU" in capsys.readouterr().out


@pytest.mark.parametrize("inventory,expect", [
    ({"nvml": {"uuids": [U0, U1]}, "cuda_uuids": [], "cuda_error": "CUDA driver initialization failed"},
     (1, "CUDA can use none: CUDA driver initialization failed")),
    ({"nvml": {"uuids": [U0, U1]}, "cuda_uuids": [U0], "cuda_visible_devices": None},
     (1, f"NVML sees 1 GPU(s) that CUDA cannot use: {U1}")),
    ({"nvml": {"uuids": [U0, U1]}, "cuda_uuids": [U0], "cuda_visible_devices": "0"}, None),  # a job's share
    ({"nvml": {"uuids": [U0, U1]}, "cuda_uuids": [U0, U1], "cuda_visible_devices": None}, None),
    ({"nvml": {"uuids": [], "error": "NVML unavailable: no driver"}, "cuda_uuids": [], "cuda_error": "no CUDA"},
     (2, "no GPU: NVML: NVML unavailable: no driver; CUDA: no CUDA")),
    ({"nvml": {"uuids": [], "error": "x"}, "cuda_uuids": [U0]}, None),  # CUDA works, NVML does not: run it
])
def test_preflight_verdict(inventory: dict, expect: tuple[int, str] | None) -> None:
    got = preflight_verdict(inventory)
    if expect is None:
        assert got is None
    else:
        assert got is not None and got[0] == expect[0] and expect[1] in got[1]
