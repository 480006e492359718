"""A directive's reason carried in the ranks' directive rows (`Monitor.agreed_directive`).

The rows travel in `step()` as int64 words all-reduced with MAX over the world group: ranks the agent has
handed the directive contribute its reason, the others zeros, so every rank reads the agent's words in the
same step's result, with no collective of its own. Seven bytes of UTF-8 a word (big-endian), so every word
is non-negative and MAX with a rank's zeros keeps it; a reason longer than `REASON_BYTES` is cut at a
character boundary. Pure.

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

REASON_WORDS = 64                  # int64 words of reason text in a directive row
_PER_WORD = 7                      # bytes a word: the top byte stays 0 (a non-negative int64)
REASON_BYTES = REASON_WORDS * _PER_WORD


def encode_reason(text: str) -> list[int]:
    """`REASON_WORDS` non-negative ints holding `text`'s UTF-8 (cut to `REASON_BYTES` at a character
    boundary; zero-padded)."""
    data = text.encode("utf-8")[:REASON_BYTES]
    while data:                    # not inside a character cut in two
        try:
            data.decode("utf-8")
            break
        except UnicodeDecodeError:
            data = data[:-1]
    data = data.ljust(REASON_BYTES, b"\0")
    return [int.from_bytes(data[i:i + _PER_WORD], "big") for i in range(0, REASON_BYTES, _PER_WORD)]


def decode_reason(words: list[int] | tuple[int, ...]) -> str:
    """The text `encode_reason` wrote ("" for zeros or for words out of range)."""
    if len(words) != REASON_WORDS or any(not 0 <= w < 1 << (8 * _PER_WORD) for w in words):
        return ""
    data = b"".join(int(w).to_bytes(_PER_WORD, "big") for w in words).rstrip(b"\0")
    return data.decode("utf-8", errors="replace")
