"""The GIL switch interval a snapshotter asks for (SnapshotConfig.gil_switch_interval): held while it lives,
the shortest request wins, what was there before comes back, and a user's own interval is never touched."""
from __future__ import annotations

import sys

import pytest

from checkpoint.errors import InvalidInputError
from checkpoint.snapshot import SnapshotConfig, Snapshotter
from checkpoint.switch_interval import INTERVAL, PYTHON_DEFAULT, SwitchInterval


class Interp:
    """An interpreter's switch interval, as get/set."""

    def __init__(self, now: float = PYTHON_DEFAULT) -> None:
        self.now = now
        self.sets: list[float] = []

    def get(self) -> float:
        return self.now

    def set(self, v: float) -> None:
        self.now = v
        self.sets.append(v)


def test_shortest_request_wins_and_the_last_release_puts_back_the_default() -> None:
    it = Interp()
    si = SwitchInterval(it.get, it.set)
    a = si.hold(2e-4)
    assert it.now == 2e-4
    b = si.hold(1e-3)                    # longer: the shorter stays
    assert it.now == 2e-4
    c = si.hold(1e-4)
    assert it.now == 1e-4
    si.release(c)
    assert it.now == 2e-4                # back to the shortest still held
    si.release(a)
    assert it.now == 1e-3
    si.release(b)
    assert it.now == PYTHON_DEFAULT
    si.release(b)                        # twice: nothing
    assert it.sets == [2e-4, 1e-4, 2e-4, 1e-3, PYTHON_DEFAULT]


def test_an_interval_the_process_set_is_kept() -> None:
    it = Interp(now=0.01)                # the user's own choice before any snapshotter
    si = SwitchInterval(it.get, it.set)
    t = si.hold(2e-4)
    assert it.now == 0.01
    si.release(t)
    assert it.now == 0.01 and it.sets == []


def test_an_interval_set_after_ours_is_not_overwritten() -> None:
    it = Interp()
    si = SwitchInterval(it.get, it.set)
    a = si.hold(2e-4)
    it.now = 0.003                       # the user sets theirs while a snapshotter lives
    b = si.hold(1e-4)                    # a later request does not take it back
    assert it.now == 0.003
    si.release(a)
    si.release(b)
    assert it.now == 0.003               # and the release leaves theirs


@pytest.mark.parametrize("bad", [0, -1e-3, 2.0, float("nan"), True, "0.001"])
def test_config_refuses_a_bad_interval(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="gil_switch_interval"):
        SnapshotConfig(gil_switch_interval=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0.0, -1e-3, float("nan")])
def test_hold_refuses_a_non_positive_interval(bad: float) -> None:
    it = Interp()
    with pytest.raises(ValueError, match="switch interval"):
        SwitchInterval(it.get, it.set).hold(bad)
    assert it.sets == []


def test_every_step_snapshotter_holds_the_interval_until_closed() -> None:
    """The real interpreter: every_step() asks for 0.2 ms; close() puts back Python's default (or, where
    another test's snapshotter in this worker is still open, keeps that one's request)."""
    others = dict(INTERVAL._held)
    before = sys.getswitchinterval()
    assert others or before == pytest.approx(PYTHON_DEFAULT)
    cfg = SnapshotConfig.every_step(staging="private")
    assert cfg.gil_switch_interval == 2e-4 and SnapshotConfig().gil_switch_interval is None
    snap = Snapshotter(_NoSink(), "job-gil", 0, 1, cfg)
    try:
        assert sys.getswitchinterval() == pytest.approx(2e-4)
        plain = Snapshotter(_NoSink(), "job-gil2", 0, 1, SnapshotConfig())   # asks nothing: no change
        plain.close()
        assert sys.getswitchinterval() == pytest.approx(2e-4)
    finally:
        snap.close()
    assert sys.getswitchinterval() == pytest.approx(before)
    snap.close()                         # closed twice: unchanged
    assert sys.getswitchinterval() == pytest.approx(before)
    assert INTERVAL._held == others


class _NoSink:
    def begin(self, job_id: str, step: int, rank: int, world_size: int) -> None:
        raise AssertionError("no save in this test")

    def commit_shard(self, *a: object, **k: object) -> None:
        raise AssertionError("no save in this test")
