"""Slurm prolog/epilog, run for real under bash against fake `sdcwatch` and `scontrol` on PATH."""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from deploy_support import ROOT

SLURM = ROOT / "deploy" / "slurm"


def _script(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture()
def fakes(tmp_path: Path) -> Path:
    """bin/sdcwatch: records its args; `canary` exits $FAKE_CANARY_RC after printing a line; `status --json`
    prints $FAKE_STATUS and exits $FAKE_STATUS_RC as the real one does (0 healthy, 1 unhealthy, 3 unknown:
    the JSON printed; 2 unreachable: a message only). bin/scontrol and bin/logger record their args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    _script(bin_dir / "sdcwatch", f"""echo "sdcwatch $*" >> {calls}
case "$1" in
  canary) echo "${{FAKE_CANARY_OUT:-canary $3: GPU-1 bf16 GEMM mismatch at [3,7]}}"; exit "${{FAKE_CANARY_RC:-0}}" ;;
  status) rc="${{FAKE_STATUS_RC:-0}}"
          case "$rc" in 0|1|3) ;; *) echo "agent not reachable" >&2; exit "$rc" ;; esac
          s="${{FAKE_STATUS:-}}"; [ -n "$s" ] || s='{{}}'; printf '%s\\n' "$s"; exit "$rc" ;;
esac
""")
    _script(bin_dir / "scontrol", f'echo "scontrol $*" >> {calls}\nexit "${{FAKE_SCONTROL_RC:-0}}"\n')
    _script(bin_dir / "logger", f'echo "logger $*" >> {calls}\n')
    return tmp_path


def _run(script: str, fakes: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {"PATH": f"{fakes / 'bin'}:{os.environ['PATH']}", "SLURMD_NODENAME": "gpu-node-7",
            "SLURM_JOB_ID": "4242", "HOME": str(fakes), **env}
    return subprocess.run(["bash", str(SLURM / script)], env=full, capture_output=True, text=True, timeout=30)


def _calls(fakes: Path) -> list[str]:
    path = fakes / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_prolog_pass_starts_the_job(fakes: Path) -> None:
    r = _run("prolog.sh", fakes, FAKE_CANARY_RC="0")
    assert r.returncode == 0, r.stderr
    assert _calls(fakes) == ["sdcwatch canary --level quick"]


def test_prolog_fail_drains_the_node_and_fails_the_prolog(fakes: Path) -> None:
    r = _run("prolog.sh", fakes, FAKE_CANARY_RC="1")
    assert r.returncode == 1
    drains = [c for c in _calls(fakes) if c.startswith("scontrol")]
    assert len(drains) == 1
    assert "update nodename=gpu-node-7 state=drain reason=sdcwatch canary FAIL before job 4242" in drains[0]
    assert "bf16 GEMM mismatch" in drains[0]           # the canary's last line goes into the reason
    assert "canary FAILED" in r.stderr


def test_prolog_drains_a_node_whose_gpus_cuda_cannot_use(fakes: Path) -> None:
    why = "FAIL: NVML sees 8 GPU(s) (GPU-1, ...) but CUDA can use none: CUDA driver initialization failed"
    r = _run("prolog.sh", fakes, FAKE_CANARY_RC="1", FAKE_CANARY_OUT=why)
    assert r.returncode == 1
    drains = [c for c in _calls(fakes) if c.startswith("scontrol")]
    assert len(drains) == 1 and "state=drain" in drains[0] and "CUDA can use none" in drains[0]


def test_prolog_could_not_run_says_why(fakes: Path) -> None:
    why = "sdcwatch canary: cannot run: no GPU: NVML: NVML unavailable: driver not loaded; CUDA: no CUDA"
    r = _run("prolog.sh", fakes, FAKE_CANARY_RC="2", FAKE_CANARY_OUT=why)
    assert r.returncode == 0
    assert not [c for c in _calls(fakes) if c.startswith("scontrol")]
    assert f"could not run (exit 2), job allowed: why: {why}" in r.stderr
    assert any(c.startswith("logger -t sdcwatch-prolog") and "why: " in c for c in _calls(fakes))


def test_prolog_could_not_run_only_logs(fakes: Path) -> None:
    r = _run("prolog.sh", fakes, FAKE_CANARY_RC="2")
    assert r.returncode == 0
    assert not [c for c in _calls(fakes) if c.startswith("scontrol")]
    assert "could not run (exit 2)" in r.stderr
    assert any(c.startswith("logger -t sdcwatch-prolog") for c in _calls(fakes))


def test_prolog_other_failures_do_not_block_the_node(fakes: Path) -> None:
    r = _run("prolog.sh", fakes, FAKE_CANARY_RC="124")
    assert r.returncode == 0 and "exit 124" in r.stderr
    r = _run("prolog.sh", fakes, SDCWATCH_BIN=str(fakes / "missing"))
    assert r.returncode == 0 and "exit 127" in r.stderr
    assert not [c for c in _calls(fakes) if c.startswith("scontrol")]


def test_prolog_level_and_no_drain_settings(fakes: Path) -> None:
    r = _run("prolog.sh", fakes, FAKE_CANARY_RC="1", SDCWATCH_CANARY_LEVEL="full", SDCWATCH_DRAIN="0")
    assert r.returncode == 1
    assert _calls(fakes)[0] == "sdcwatch canary --level full"
    assert not [c for c in _calls(fakes) if c.startswith("scontrol")]


def test_prolog_reports_a_failed_drain(fakes: Path) -> None:
    r = _run("prolog.sh", fakes, FAKE_CANARY_RC="1", FAKE_SCONTROL_RC="1")
    assert r.returncode == 1 and "could not drain" in r.stderr


def test_epilog_collects_status_json(fakes: Path) -> None:
    status = {"node_state": "HEALTHY", "gpus": [{"uuid": "GPU-1"}]}
    out_dir = fakes / "jobs"
    r = _run("epilog.sh", fakes, FAKE_STATUS=json.dumps(status), SDCWATCH_JOB_DIR=str(out_dir))
    assert r.returncode == 0, r.stderr
    assert json.loads((out_dir / "4242.status.json").read_text()) == status
    assert _calls(fakes) == ["sdcwatch status --json"]
    assert [p.name for p in out_dir.iterdir()] == ["4242.status.json"]   # no temp files left


def test_epilog_keeps_the_record_of_an_unhealthy_or_unknown_node(fakes: Path) -> None:
    """The record matters most when the node is not healthy: `status` exits 1 (SUSPECT/DEGRADED/FAILED) or
    3 (UNKNOWN) with the JSON printed, and the epilog keeps it (and still never fails the job)."""
    for rc, state in (("1", "FAILED"), ("3", "UNKNOWN")):
        status = {"node_state": state, "gpus": [{"uuid": "GPU-1", "state": state}]}
        out_dir = fakes / f"jobs-{rc}"
        r = _run("epilog.sh", fakes, FAKE_STATUS=json.dumps(status), FAKE_STATUS_RC=rc, SDCWATCH_JOB_DIR=str(out_dir))
        assert r.returncode == 0, r.stderr
        assert json.loads((out_dir / "4242.status.json").read_text()) == status
        assert [p.name for p in out_dir.iterdir()] == ["4242.status.json"]


def test_epilog_never_fails_the_job(fakes: Path) -> None:
    out_dir = fakes / "jobs"
    r = _run("epilog.sh", fakes, FAKE_STATUS_RC="2", SDCWATCH_JOB_DIR=str(out_dir))
    assert r.returncode == 0
    assert "sdcwatch status failed (exit 2): agent not reachable" in r.stderr
    assert list(out_dir.iterdir()) == []
    r = _run("epilog.sh", fakes, SDCWATCH_JOB_DIR="/proc/not-writable/jobs")
    assert r.returncode == 0 and "cannot create" in r.stderr
