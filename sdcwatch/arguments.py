"""Checks of what a caller passes to the rank library's constructors (`ComputeChecks.attach`,
`Monitor.attach`, `LossGate.attach`, ...): each refuses a value of the wrong kind at once with a ValueError
naming the argument and what it is, before anything is attached to the model or optimizer, instead of
taking it (a NaN margin compares false with every score; `True` passes as 1) or failing later in another
library's words. Pure."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from sdcwatch.names import Rule


def count(what: str, value: Any, why: str, least: int = 0) -> int:
    """`value` as an int >= `least` (numpy's integers too; not a bool, not 2.5)."""
    try:
        n = operator.index(value)
    except TypeError:
        n = least - 1
    if isinstance(value, bool) or n < least:
        raise ValueError(f"{what} is {why}, an int >= {least}, got {value!r}")
    return n


def above(what: str, value: Any, why: str, low: float) -> float:
    """`value` as a finite real number > `low` (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low < value < math.inf:
        raise ValueError(f"{what} is {why}, a finite number > {low:g}, got {value!r}")
    return float(value)


def text(what: str, value: Any, *, optional: bool = True) -> None:
    """`value` is a string (or None where `optional`)."""
    if not isinstance(value, str) and not (optional and value is None):
        raise ValueError(f"{what} is a string, got {type(value).__name__}")


def function(what: str, value: Any, *, optional: bool = True, why: str = "") -> None:
    """`value` is callable (or None where `optional`); `why`: what the function is for, for the message."""
    if not callable(value) and not (optional and value is None):
        raise ValueError(f"{what} is a function{f' ({why})' if why else ''}, got {type(value).__name__}")


def wire_name(what: str, value: Any, rule: Rule, *, optional: bool = True) -> None:
    """`value` is a string (or None where `optional`; never empty where not) that keeps the `rule` the agent
    checks reports by (sdcwatch.names): a name it would refuse is refused here, in its words, not on every
    report after."""
    text(what, value, optional=optional)
    if not optional and not value:
        raise ValueError(f"{what} is a non-empty string")
    err = rule.problem(what, value or "")
    if err:
        raise ValueError(err)
