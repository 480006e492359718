"""The order the xdist workers take the test files in: longest first, by each file's seconds in
tests/durations.json (written by scripts/test_durations.py from a `--durations=0` run).

With `--dist loadfile --no-loadscope-reorder` (pyproject's addopts) the controller hands files out in the
workers' collection order, which tests/conftest.py sorts here. xdist's own reorder (by number of tests) put
the longest files last (the 10,000 clean steps, the fuzz: one test each): one worker ran them for the run's
last ~100 s while the others idled. Each file keeps its tests' order; a file with no entry counts as the
median, so a new file is neither first nor last."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Sequence


def load_costs(path: Path) -> dict[str, float]:
    """File -> seconds; empty where the file is missing or unreadable (the collection order then stands)."""
    try:
        raw = json.loads(path.read_text())
        return {str(k): float(v) for k, v in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def heaviest_files_first(items: list[Any], costs: dict[str, float]) -> None:
    """Sort `items` (pytest items: anything with a `nodeid`) in place, their files longest first."""
    if not costs:
        return
    default = statistics.median(costs.values())
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(_file(item), i)

    def key(item: Any) -> tuple[float, int]:
        path = _file(item)
        return -costs.get(path, default), first[path]

    items.sort(key=key)     # stable: a file's tests stay in their order


def _file(item: Any) -> str:
    return str(item.nodeid).split("::", 1)[0]


def order_of(items: Sequence[Any]) -> list[str]:
    """The files of `items` in the order they first appear."""
    return list(dict.fromkeys(_file(i) for i in items))
