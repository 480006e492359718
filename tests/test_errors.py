"""One exception root (sdcwatch/errors.py): every error class sdcwatch defines derives from `SdcwatchError`,
every one is raised somewhere, and `transient` decides retries where the code retries (the drainer, the probe
runner, alert delivery, S3)."""
from __future__ import annotations

import ast
import builtins
import asyncio
import re
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from checkpoint.drainer import Drainer, Tier
from checkpoint.errors import AgentUnavailableError, CheckpointError, InvalidInputError
from fault_store import Fault, FaultyStore
from checkpoint.grpc_store import PeerStoreError
from checkpoint.s3_store import is_transient as s3_is_transient
from checkpoint.shm_store import DirStore
from checkpoint.snapshot import SnapshotConfig, Snapshotter
from checkpoint.tier_policy import TierRule
from ckpt_support import job_id, node, state_dict
from daemon.alerts import DeliveryError
from daemon.errors import ConfigError
from daemon.probe_runner import MAX_BACKOFF_S, ProbeRunner, next_run_delay
from probes.nvml_backend import NvmlError, NvmlUnavailable
from sdcwatch.errors import FatalError, SdcwatchError, is_transient
from deadlines import scaled

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "probes", "checkpoint", "checksums", "sdcwatch")
BUILTIN_ERRORS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _error_classes() -> dict[str, tuple[Path, list[str]]]:
    """Every class in the packages whose bases make it an exception: name -> (file, base names)."""
    classes: dict[str, tuple[Path, list[str]]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for n in ast.walk(ast.parse(path.read_text())):
                if isinstance(n, ast.ClassDef):
                    bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                             for b in n.bases]
                    classes[n.name] = (path, bases)
    errors: dict[str, tuple[Path, list[str]]] = {}
    changed = True
    while changed:
        changed = False
        for name, (path, bases) in classes.items():
            if name not in errors and any(b in BUILTIN_ERRORS or b in errors for b in bases):
                errors[name] = (path, bases)
                changed = True
    return errors


def test_every_error_class_derives_from_the_one_root() -> None:
    errors = _error_classes()

    def rooted(name: str) -> bool:
        return name == "SdcwatchError" or any(b in errors and rooted(b) for b in errors[name][1])

    stray = [f"{p.relative_to(ROOT)}: {n}({', '.join(b)})" for n, (p, b) in errors.items()
             if not n.startswith("_") and not rooted(n)]
    assert not stray, "error classes outside the root (derive from sdcwatch.errors.SdcwatchError):\n" + \
        "\n".join(stray)


def test_every_error_class_is_raised_somewhere() -> None:
    """An error class nobody raises is dead (or a failure path that lost its error)."""
    errors = _error_classes()
    src = "\n".join(p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    bases = {b for _, bs in errors.values() for b in bs}
    dead = [n for n in errors if not n.startswith("_") and n not in bases
            and not re.search(rf"(?<!class ){n}\(", src)]
    assert not dead, f"error classes never raised: {dead}"


def test_the_families_share_the_root() -> None:
    for cls in (ConfigError, FatalError, CheckpointError, InvalidInputError, NvmlError, PeerStoreError,
                DeliveryError):
        assert issubclass(cls, SdcwatchError), cls
    assert issubclass(InvalidInputError, ValueError) and issubclass(PeerStoreError, OSError)


def test_transient_is_a_class_default_an_instance_may_override() -> None:
    assert AgentUnavailableError("x").transient and not InvalidInputError("x").transient
    assert NvmlError("busy", transient=True).transient and not NvmlUnavailable("no driver").transient
    assert PeerStoreError("down", grpc.StatusCode.UNAVAILABLE).transient
    assert not PeerStoreError("refused", grpc.StatusCode.PERMISSION_DENIED).transient
    assert DeliveryError("HTTP 503", transient=True).transient and not DeliveryError("HTTP 400").transient
    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError())
    assert not is_transient(KeyError("k")) and not is_transient(ConfigError("a.b", "bad"))
    assert s3_is_transient(AgentUnavailableError("x")) and not s3_is_transient(InvalidInputError("x"))


# ---- the probe runner backs off a probe whose error is not transient -------------------------------------------

def test_next_run_delay() -> None:
    assert next_run_delay(10.0, 0) == 10.0
    assert next_run_delay(10.0, 1) == 20.0 and next_run_delay(10.0, 3) == 80.0
    assert next_run_delay(10.0, 50) == MAX_BACKOFF_S
    assert next_run_delay(600.0, 5) == 600.0   # never shorter than the interval


@pytest.mark.parametrize("error, streak", [(NvmlUnavailable("no driver"), 1),
                                           (NvmlError("busy", transient=True), 0),
                                           (RuntimeError("a bug"), 0)])
def test_probe_runner_counts_only_non_transient_failures(error: Exception, streak: int) -> None:
    def fn(now: float) -> Any:
        raise error

    async def scenario() -> None:
        runner = ProbeRunner("p", fn, interval_s=0.01, timeout_s=5, on_result=lambda r, now: None,
                             publish=lambda *a, **k: None)
        task = asyncio.create_task(runner.run_forever())
        deadline = time.monotonic() + scaled(30)
        while runner.status.runs < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        runner.stop()
        assert runner.status.runs >= 1 and runner.status.state == "FAILING"
        assert runner.fatal_streak == streak * runner.status.runs

    asyncio.run(scenario())


# ---- the drainer retries a transient failure and gives a step up on a non-transient one --------------------------

def _save(co: Any, job: str, step: int) -> None:
    snap = Snapshotter(co, job, 0, 1, SnapshotConfig(chunk_bytes=4096))
    assert not snap.save(step, state_dict(0, step, 500)).result(30).error
    snap.close()


@pytest.mark.parametrize("code, retried", [(grpc.StatusCode.UNAVAILABLE, True),
                                           (grpc.StatusCode.PERMISSION_DENIED, False)])
def test_drainer_honours_transient(redis_server, tmp_path: Path, code: grpc.StatusCode, retried: bool) -> None:
    job = job_id()
    co = node(redis_server.port, tmp_path, f"node-{job}")   # its own node: no other test's steps to drain
    store = FaultyStore(DirStore(tmp_path / "flash", fsync=True),
                        [Fault("put", "fail", nth=1, times=1, error=PeerStoreError("peer said no", code))])
    clock = [1000.0]
    dr = Drainer(co, [Tier("flash", store, str(tmp_path / "flash"), TierRule("flash"))], clock=lambda: clock[0])
    dr.start()
    try:
        _save(co, job, 1)
        assert ("flash", job, 1, False) in dr.drain_now()
        clock[0] += 3600   # past the backoff
        again = dr.drain_now()
        assert (("flash", job, 1, True) in again) is retried
        assert not [r for r in again if r[2] == 1 and not r[3]], "a given-up step is not tried again"
    finally:
        dr.close()
