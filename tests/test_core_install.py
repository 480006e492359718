"""The core install runs the agent: `pip install sdcwatch` (no extras) into a fresh venv, without torch, then
`sdcwatch run` (embedded defaults, fake NVML, canary on) and `sdcwatch status` against it; the commands
that need torch or matplotlib say which extra brings it and exit 2.

The wheel is built once from a copy of the sources (the repo tree is left untouched); its dependencies come
through pip's usual configuration and cache.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from deadlines import scaled

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "sdcwatch", "daemon", "probes", "checksums", "checkpoint", "proto", "demo",
           "integrations")
SCENARIO = ROOT / "tests" / "scenarios" / "clean.json"
NEEDS_TORCH = "needs torch: pip install 'sdcwatch[torch]'"
NEEDS_PLOT = "needs matplotlib: pip install 'sdcwatch[plot]'"


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _core_venv(tmp: Path, env: dict[str, str]) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                  str(tmp / "wheels"), str(src)], env, tmp, 300)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp / "wheels").glob("sdcwatch-*.whl")
    venv = tmp / "venv"
    # no pip in the venv (ensurepip costs seconds of CPU): the suite's pip installs into it (--python)
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, tmp, 300)
    assert made.returncode == 0, made.stderr[-3000:]
    # --no-compile: pip's byte-compiling of every installed module (the dependencies' too) is ~4 of the test's
    # ~16 s; the agent and the commands below compile what they import, as any interpreter does
    installed = _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                      "--no-compile", str(wheel)], env, tmp, 900)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv


def _wait_serving(target: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the agent exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with grpc.insecure_channel(target) as ch:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the agent was not SERVING after {timeout}s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_the_core_install_runs_the_agent_without_torch(short_tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    venv = _core_venv(short_tmp, env)
    py, sdcwatch = str(venv / "bin" / "python"), str(venv / "bin" / "sdcwatch")
    code = "import importlib.util as u, daemon; print(u.find_spec('torch') is None, daemon.__file__)"
    probe = _run([py, "-c", code], env, short_tmp, 60)
    no_torch, where = probe.stdout.split()
    assert no_torch == "True" and where.startswith(str(venv)), probe.stdout + probe.stderr

    state, log = short_tmp / "state", short_tmp / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen([sdcwatch, "run", "--state-dir", str(state), "--metrics-listen", "127.0.0.1:0",
                                  "--nvml-scenario", str(SCENARIO), "--shutdown-grace-s", "1"],
                                 env=env, cwd=short_tmp, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_serving(f"unix:{state / 'agent.sock'}", agent, log)
        status = _run([sdcwatch, "status", "--state-dir", str(state)], env, short_tmp, 60)   # as `run` was given
        assert status.returncode in (0, 3), status.stdout + status.stderr  # HEALTHY, or UNKNOWN before a poll
        assert "canary" in status.stdout and "HEALTHY" in status.stdout, status.stdout
        assert "libtorch" not in Path(f"/proc/{agent.pid}/maps").read_text()
        for cmd in (["canary", "--level", "tiny"], ["demo", "--steps", "10", "--out", str(short_tmp / "demo")]):
            run = _run([sdcwatch, *cmd], env, short_tmp, 120)
            assert run.returncode == 2 and NEEDS_TORCH in run.stderr, (cmd, run.stdout, run.stderr)
        (short_tmp / "train.csv").write_text("step,loss\n" + "".join(f"{i},{2.0 - i / 100}\n" for i in range(50)))
        run = _run([sdcwatch, "spikes", "replay", str(short_tmp / "train.csv"), "--plot", str(short_tmp / "p.png")],
                   env, short_tmp, 60)
        assert run.returncode == 2 and NEEDS_PLOT in run.stderr, (run.stdout, run.stderr)
        run = _run([sdcwatch, "completion", "bash"], env, short_tmp, 60)   # shtab: a core dependency
        assert run.returncode == 0 and "_shtab_sdcwatch" in run.stdout, run.stderr
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, log.read_text()[-3000:]
