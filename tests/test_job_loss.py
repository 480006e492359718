"""The per-job loss aggregation that feeds the detector: a step's mean over its ranks, fed once, in order."""
from __future__ import annotations

import math

from daemon.job_loss import JobLoss
from probes.loss_detector import LossDetectorConfig


class Recorder(JobLoss):
    """JobLoss whose detector records what it is fed (the aggregation is what is tested here)."""

    def __init__(self) -> None:
        super().__init__(LossDetectorConfig())
        self.fed: list[tuple[int, float | None, float | None, float | None]] = []
        inner = self.detector.update

        def update(step, loss, grad, now, loss_scale=None):   # type: ignore[no-untyped-def]
            self.fed.append((step, loss, grad, loss_scale))
            return inner(step, loss, grad, now, loss_scale=loss_scale)

        self.detector.update = update  # type: ignore[method-assign]


def test_a_step_is_fed_once_when_every_rank_reported_with_the_mean() -> None:
    jl = Recorder()
    for rank, loss in enumerate((1.0, 2.0, 3.0)):
        jl.add(10, rank, 4, loss, 0.5 + rank, None, 0.0)
    assert jl.fed == [], "3 of 4 ranks: not complete"
    jl.add(10, 1, 4, 99.0, 99.0, None, 0.0)
    assert jl.fed == [], "a rank's second report of a step is ignored"
    jl.add(10, 3, 4, 6.0, 3.5, 1024.0, 0.0)
    assert jl.fed == [(10, 3.0, 2.0, 1024.0)]
    jl.add(10, 0, 4, 1.0, 1.0, None, 0.0)
    assert len(jl.fed) == 1, "a late report of a judged step is not fed again"


def test_a_missing_rank_does_not_stall_the_detector() -> None:
    jl = Recorder()
    for step in (1, 2, 3, 4):
        for rank in (0, 1):   # world 3: rank 2's reports are lost
            jl.add(step, rank, 3, float(step), None, None, 0.0)
    # step s is fed, stale, once step s + 2 has arrived
    assert [f[0] for f in jl.fed] == [1, 2]
    assert jl.fed[0][1] == 1.0 and jl.fed[0][2] is None


def test_a_straggler_and_a_restart_keep_step_order() -> None:
    jl = Recorder()
    jl.add(5, 0, 2, 1.0, None, None, 0.0)
    jl.add(7, 0, 2, 1.0, None, None, 0.0)
    jl.add(6, 0, 2, 1.0, None, None, 0.0)    # out of order: kept in step order
    jl.add(6, 1, 2, 3.0, None, None, 0.0)    # completes 6 (5 went stale when 7 arrived)
    assert jl.fed == [(5, 1.0, None, None), (6, 2.0, None, None)]
    jl.add(3, 1, 2, 5.0, None, None, 0.0)    # a straggler's step already judged: late, no reset
    assert jl.late == 1 and jl.horizon == 6
    jl.restarted(2)                          # the job restored step 1 (the tracker saw a rank go back)
    for rank in (0, 1):
        jl.add(2, rank, 2, 4.0, None, None, 0.0)
    assert jl.fed[-1] == (2, 4.0, None, None)


def test_a_non_finite_rank_makes_the_mean_non_finite() -> None:
    jl = Recorder()
    jl.add(1, 0, 2, math.nan, None, None, 0.0)
    jl.add(1, 1, 2, 1.0, math.inf, None, 0.0)
    assert math.isnan(jl.fed[0][1]) and jl.fed[0][2] == math.inf
