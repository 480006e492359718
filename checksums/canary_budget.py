"""The in-job canary's time budget: a pure policy, no clock and no I/O (times are passed in).

`budget_allows`: whether a canary fits the budget at a step: the time spent in canaries so far plus the
next one's estimated cost stays within `budget_fraction` of the training time so far.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True, slots=True)
class InJobBudget:
    """The in-job time budget: canaries take at most `budget_fraction` of the training time.

    `min_steps_between` spaces runs out; `warmup_steps` skips the first steps (compilation, allocator)."""

    budget_fraction: float = 0.005
    min_steps_between: int = 10
    warmup_steps: int = 20

    def __post_init__(self) -> None:
        if not 0.0 < self.budget_fraction < 1.0:
            raise ValueError(f"budget_fraction must be in (0, 1), got {self.budget_fraction}")
        if self.min_steps_between < 1 or self.warmup_steps < 0:
            raise ValueError("min_steps_between must be >= 1 and warmup_steps >= 0")


def budget_allows(budget: InJobBudget, *, step: int, last_run_step: int | None, train_time_s: float,
                  canary_time_s: float, est_cost_s: float) -> tuple[bool, str]:
    """Whether to enqueue a canary at `step`, and why (pure)."""
    if step < budget.warmup_steps:
        return False, f"warm-up (step {step} < {budget.warmup_steps})"
    if last_run_step is not None and step - last_run_step < budget.min_steps_between:
        return False, f"ran at step {last_run_step}"
    if train_time_s <= 0:
        return False, "no training time measured yet"
    allowed = budget.budget_fraction * train_time_s
    if canary_time_s + max(0.0, est_cost_s) > allowed:
        return False, (f"over budget: {canary_time_s * 1e3:.2f} ms spent + {est_cost_s * 1e3:.2f} ms > "
                       f"{allowed * 1e3:.2f} ms allowed")
    return True, "within budget"
