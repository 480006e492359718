"""The replica vote, row by row (pure)."""
from __future__ import annotations

import pytest

from checksums.replica_vote import (METHOD_ALL_DISAGREEING, METHOD_MAJORITY, METHOD_SINGLE, Suspect,
                                    vote)

A, B, C, D = (1, 2), (1, 3), (9, 9), (2**63, 5)


@pytest.mark.parametrize(
    "fps, agreed, method, suspects, majority",
    [
        # one rank: nothing to compare
        ({0: A}, True, METHOD_SINGLE, (), A),
        # all equal
        ({0: A, 1: A}, True, METHOD_MAJORITY, (), A),
        ({0: A, 1: A, 2: A}, True, METHOD_MAJORITY, (), A),
        # two replicas that differ: both suspect
        ({0: A, 1: B}, False, METHOD_ALL_DISAGREEING, (0, 1), None),
        # three: the odd one out
        ({0: A, 1: A, 2: B}, False, METHOD_MAJORITY, (2,), A),
        ({0: B, 1: A, 2: A}, False, METHOD_MAJORITY, (0,), A),
        ({0: A, 1: B, 2: A}, False, METHOD_MAJORITY, (1,), A),
        # three all different: no majority, all suspect
        ({0: A, 1: B, 2: C}, False, METHOD_ALL_DISAGREEING, (0, 1, 2), None),
        # four, 3-1: majority
        ({0: A, 1: A, 2: C, 3: A}, False, METHOD_MAJORITY, (2,), A),
        # four, 2-2: no strict majority, all suspect
        ({0: A, 1: A, 2: B, 3: B}, False, METHOD_ALL_DISAGREEING, (0, 1, 2, 3), None),
        # four, 2-1-1: a plurality is not a majority
        ({0: A, 1: A, 2: B, 3: C}, False, METHOD_ALL_DISAGREEING, (0, 1, 2, 3), None),
        # five, 3-1-1: strict majority, two suspects
        ({0: A, 1: B, 2: A, 3: C, 4: A}, False, METHOD_MAJORITY, (1, 3), A),
        # five, 3-2: the pair is outvoted
        ({0: B, 1: B, 2: A, 3: A, 4: A}, False, METHOD_MAJORITY, (0, 1), A),
        # non-contiguous global ranks (a replica group of HSDP)
        ({3: A, 7: A, 11: D}, False, METHOD_MAJORITY, (11,), A),
        # fingerprints that differ only in the last word
        ({0: (5, 6, 7), 1: (5, 6, 7), 2: (5, 6, 8)}, False, METHOD_MAJORITY, (2,), (5, 6, 7)),
    ],
)
def test_vote_rows(fps, agreed, method, suspects, majority) -> None:
    result = vote(fps)
    assert result.agreed is agreed
    assert result.method == method
    assert result.suspect_ranks == suspects
    assert result.majority == majority
    assert result.replicas == len(fps)


def test_suspects_carry_host_uuid_and_their_own_fingerprint() -> None:
    where = {0: ("node-a", "GPU-0"), 1: ("node-a", "GPU-1"), 2: ("node-b", "GPU-2")}
    result = vote({0: A, 1: A, 2: C}, where)
    assert result.suspects == (Suspect(rank=2, host="node-b", gpu_uuid="GPU-2", fingerprint=C),)


def test_missing_location_is_empty_strings() -> None:
    result = vote({0: A, 1: B}, {0: ("h", "u")})
    assert [(s.rank, s.host, s.gpu_uuid) for s in result.suspects] == [(0, "h", "u"), (1, "", "")]


@pytest.mark.parametrize("bad, message", [
    ({}, "at least one"),
    ({0: ()}, "empty fingerprint"),
    ({-1: A}, "non-negative"),
])
def test_bad_input_is_a_value_error(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        vote(bad)
