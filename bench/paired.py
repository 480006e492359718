"""Paired overheads from interleaved blocks: how finely a run resolves an arm's cost."""
from __future__ import annotations

import random


def paired_interval(ratios: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of an arm's overhead from its rounds' ratios to base (each round's block over the base
    block of the same round): the 2.5th and 97.5th percentiles of the mean ratio over resamples of the
    rounds (bootstrap, seeded), minus 1. How finely this run resolves the arm's overhead."""
    if len(ratios) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    n = len(ratios)
    means = sorted(sum(rng.choices(ratios, k=n)) / n for _ in range(resamples))
    return (means[int(0.025 * resamples)] - 1.0, means[int(0.975 * resamples) - 1] - 1.0)
