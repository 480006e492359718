"""A directive's reason in the ranks' directive rows (checksums.directive_text): it survives the rows' MAX
with the zeros of ranks that do not hold it."""
from __future__ import annotations

import torch

from checksums.directive_text import REASON_BYTES, REASON_WORDS, decode_reason, encode_reason


def test_a_reason_survives_the_max_with_ranks_that_lack_it():
    reason = "persistent compute fault at step 40 on rank 1 on node-7 GPU-4f2a…: restart from VERIFIED step 30"
    words = encode_reason(reason)
    assert len(words) == REASON_WORDS and all(w >= 0 for w in words)
    rows = torch.tensor([[0] * REASON_WORDS, words, words, [0] * REASON_WORDS], dtype=torch.int64)
    assert decode_reason(rows.max(dim=0).values.tolist()) == reason
    assert decode_reason([0] * REASON_WORDS) == ""
    assert decode_reason([-1] * REASON_WORDS) == "" and decode_reason([1, 2]) == ""


def test_a_long_reason_is_cut_at_a_character_boundary():
    for text in ("é" * REASON_BYTES, "x" + "€" * REASON_BYTES, "a" * (REASON_BYTES + 9)):
        got = decode_reason(encode_reason(text))
        assert text.startswith(got) and REASON_BYTES - 3 <= len(got.encode()) <= REASON_BYTES, (text[:3], got[-3:])
