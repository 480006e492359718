"""The real loss-curve excerpts the tests replay (tests/data/loss-curves, copied from the shared data so
that a clone has them). A test that needs one and does not find it fails: the data is part of the repo."""
from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "loss-curves"


def excerpt(name: str) -> Path:
    """The path of one excerpt; an AssertionError (a failure, never a skip) when it is missing."""
    path = DATA / name
    assert path.is_file(), f"test data missing: {path} (tests/data/loss-curves is part of the repository)"
    return path


def bigscience() -> Path:
    return excerpt("bigscience_chronicles_megatron_iter_lines.csv")


def nanogpt() -> Path:
    return excerpt("nanogpt_issue215_fp16_nan_excerpt.csv")
