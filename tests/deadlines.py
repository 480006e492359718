"""How long the tests wait: every deadline is a base (what an idle 2-core machine needs, with margin) times
one factor, so a busy CI machine or laptop passes the same suite, only slower. No test asserts a duration.

    SDCWATCH_TEST_SLOWDOWN=3 pytest ...      # every wait 3x as long (default: from the load average)

The default factor is 1 on an idle machine and grows with the 1-minute load average per core (2 busy loops
beside the suite on 2 cores: about 2), capped at 4; the variable overrides it. The suite runs in parallel
(pytest-xdist, a worker per core): the other workers count as load from the start (the load average lags
the session's first minute), and `scaled` reads the load average again on each call, so a wait that starts
once the machine has grown busier gets the longer deadline. Waits poll a condition and
return as soon as it holds: a longer deadline costs nothing when things are fast.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def _given() -> float | None:
    given = os.environ.get("SDCWATCH_TEST_SLOWDOWN", "")
    if not given:
        return None
    try:
        value = float(given)
    except ValueError:
        raise ValueError(f"SDCWATCH_TEST_SLOWDOWN must be a number (a factor like 2), got {given!r}") from None
    if not value > 0:
        raise ValueError(f"SDCWATCH_TEST_SLOWDOWN must be > 0, got {given!r}")
    return value


def _from_load() -> float:
    cores = os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)   # set by pytest-xdist in its workers
    try:
        per_core = os.getloadavg()[0] / cores
    except OSError:
        return 2.0
    return min(4.0, max(1.0, 1.0 + per_core, 1.0 + (workers - 1) / cores))


_GIVEN = _given()
SLOWDOWN = _GIVEN if _GIVEN is not None else _from_load()


def scaled(seconds: float) -> float:
    """`seconds` (enough on an idle machine) times the suite's slowdown factor, or the factor the load average
    says now where that is higher (unless SDCWATCH_TEST_SLOWDOWN set it)."""
    return seconds * (SLOWDOWN if _GIVEN is not None else max(SLOWDOWN, _from_load()))


def wait_until(pred: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.05) -> T:
    """pred()'s first truthy value, polled every `interval`; AssertionError naming `what` once
    `scaled(timeout)` seconds have passed."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached in {limit:.0f}s ({timeout:.0f}s x slowdown {SLOWDOWN:.1f})")
        time.sleep(interval)


def describe() -> dict[str, Any]:
    return {"slowdown": SLOWDOWN, "from": "SDCWATCH_TEST_SLOWDOWN" if os.environ.get("SDCWATCH_TEST_SLOWDOWN")
            else "load average"}
