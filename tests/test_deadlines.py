"""The suite's one slowdown factor (tests/deadlines.py): set by SDCWATCH_TEST_SLOWDOWN, else from the load."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _factor(value: str | None, workers: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SDCWATCH_TEST_SLOWDOWN", "PYTEST_XDIST_WORKER_COUNT")}
    if value is not None:
        env["SDCWATCH_TEST_SLOWDOWN"] = value
    if workers is not None:
        env["PYTEST_XDIST_WORKER_COUNT"] = str(workers)
    return subprocess.run([sys.executable, "-c", "import deadlines; print(deadlines.SLOWDOWN, deadlines.scaled(10))"],
                          cwd=TESTS, env=env | {"PYTHONPATH": str(TESTS)}, capture_output=True, text=True,
                          timeout=60)


def test_the_variable_sets_the_factor_and_scales_every_deadline() -> None:
    assert _factor("3").stdout.split() == ["3.0", "30.0"]
    got = _factor(None)
    slowdown = float(got.stdout.split()[0])
    assert 1.0 <= slowdown <= 4.0, got   # from the load average: never below idle, capped


def test_parallel_workers_count_as_load_from_the_start() -> None:
    """Under pytest-xdist every worker shares the cores: W workers on C cores wait at least 1 + (W - 1) / C as
    long, before the load average has caught up; the variable still wins."""
    cores = os.cpu_count() or 1
    got = _factor(None, workers=2 * cores + 1)
    assert float(got.stdout.split()[0]) >= 3.0, got
    assert _factor("1.5", workers=2 * cores + 1).stdout.split() == ["1.5", "15.0"]


def test_a_bad_factor_is_refused_with_its_name() -> None:
    for bad in ("fast", "0", "-2"):
        out = _factor(bad)
        assert out.returncode != 0 and "SDCWATCH_TEST_SLOWDOWN" in out.stderr, (bad, out.stderr)


def test_wait_until_returns_the_first_truthy_value_and_names_what_it_waited_for() -> None:
    from deadlines import wait_until

    seen = iter([0, None, "ready"])
    assert wait_until(lambda: next(seen), 5, interval=0) == "ready"
    try:
        wait_until(lambda: False, 0.01, "the impossible", interval=0)
    except AssertionError as exc:
        assert "the impossible" in str(exc) and "slowdown" in str(exc)
    else:
        raise AssertionError("wait_until returned on a false condition")
