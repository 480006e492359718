"""Start the real agent as a subprocess on a temp unix socket, wait on its health check, tear it down."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deadlines import scaled

ROOT = Path(__file__).resolve().parent.parent


class AgentProcess:
    def __init__(self, state_dir: Path, *extra: str, env: dict[str, str] | None = None,
                 state_dir_flag: bool = True) -> None:
        """`state_dir_flag=False`: run without `--state-dir` (the environment must choose `state_dir`)."""
        self.state_dir = Path(state_dir)
        self.state_dir_flag = state_dir_flag
        self.socket = self.state_dir / "agent.sock"
        self.extra = list(extra)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.state_dir.parent / f"{self.state_dir.name}.agent.log"

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    def start(self, wait: bool = True, timeout: float = 30.0) -> "AgentProcess":
        env = dict(os.environ)
        env.update(self.env or {})
        env.setdefault("PYTHONUNBUFFERED", "1")
        where = ["--state-dir", str(self.state_dir)] if self.state_dir_flag else []
        cmd = [sys.executable, "-m", "daemon.cli", "run", *where,
               "--metrics-listen", "127.0.0.1:0", "--shutdown-grace-s", "1", *self.extra]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_serving(timeout)
        return self

    def wait_serving(self, timeout: float = 30.0, service: str = "") -> None:
        """Polls the health check; `timeout` is for an idle machine (scaled by the suite's slowdown)."""
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists():
                try:
                    with grpc.insecure_channel(self.target) as ch:
                        resp = health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(service=service), timeout=1)
                        if resp.status == health_pb2.HealthCheckResponse.SERVING:
                            return
                        last = resp.status
                except grpc.RpcError as exc:
                    last = exc
            time.sleep(0.05)
        raise TimeoutError(f"agent not SERVING after {timeout}s (last: {last}):\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def runtime_info(self) -> dict[str, Any]:
        import json

        return json.loads((self.state_dir / "agent.json").read_text())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(scaled(timeout))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "AgentProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def remove_memory_dirs(tmp: Path) -> None:
    """The node memory dirs of agents whose state dirs were under `tmp`, two levels down at most (they
    outlive their agents by design; each is named after its state dir's path, so only these go)."""
    from checkpoint.shm_store import default_shm_root
    from sdcwatch.safe_fs import remove_tree

    def dirs(d: Path) -> list[Path]:
        try:
            return [p for p in d.iterdir() if p.is_dir() and not p.is_symlink()]
        except OSError:
            return []

    if not tmp.is_dir():
        return
    children = dirs(tmp)
    for state in [tmp, *children, *(g for c in children for g in dirs(c))]:
        mem = default_shm_root(state)
        if mem.parent.is_dir():
            remove_tree(mem.parent)


def remove_test_dir(tmp: Path) -> None:
    """A test's temp dir and the memory dirs of the agents whose state dirs were in it."""
    import shutil

    remove_memory_dirs(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def cli(*args: str, timeout: float = 30.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`sdcwatch ARGS` in a subprocess; `timeout` is for an idle machine (scaled by the suite's slowdown)."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(timeout), env=e)
