"""Per-step cost of the loss detector (it runs on the agent's ReportStep path): a tight loop.

    python -m bench.loss_step_cost [--steps N]

Feeds one detector a clean, noisy, decaying loss and a grad norm, and prints microseconds per step
(best of three runs).
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from probes.loss_detector import LossDetector


def per_step_us(steps: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    loss = (2.0 + 8.0 * (1 + t / 100.0) ** -0.5) * np.exp(rng.normal(0, 0.02, steps))
    grad = (1.0 + 3.0 * np.exp(-t / 200.0)) * np.exp(rng.normal(0, 0.1, steps))
    pairs = list(zip(t.tolist(), loss.tolist(), grad.tolist()))
    det = LossDetector()
    start = time.perf_counter()
    for step, x, g in pairs:
        det.update(step, x, g, 0.0)
    return (time.perf_counter() - start) / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000)
    args = ap.parse_args(argv)
    best = min(per_step_us(args.steps) for _ in range(3))
    assert math.isfinite(best)
    print(f"loss detector: {best:.1f} us per step (loss + grad norm, {args.steps} steps, best of 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
