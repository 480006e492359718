"""bench/mixed_sources.py's claim, small: on mixed-source batches (3 ranks of a tiny GPT) the clean steps raise
no suspicion, and a fault that scales rank 1's whole MLP output 10x is caught on its step by the columns
relative to the rank's own buckets where the plain distance from the other ranks catches it on none."""
from __future__ import annotations

from bench import mixed_sources


def test_mixed_sources_relative_columns_catch_what_the_plain_ones_cannot() -> None:
    r = mixed_sources.run("mixed", clean=60, per_fault=4)
    assert r["suspicions"] == 0, r
    assert r["spread_plain"][0] > 3 * r["spread_relative"][0], r
    plain, both = r["caught"]["whole x10"]
    assert plain == 0 and both == 4, r["caught"]
    assert all(b >= p for p, b in r["caught"].values()), r["caught"]
