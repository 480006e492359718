"""Validation of the names that end up in store keys and Redis keys.

A job id or key segment may hold letters, digits, `_`, `-`, `.` (not `.`/`..` alone, not leading `.`),
so it can never climb out of a directory, split a Redis key, or match a glob. Anything else is
rejected with `InvalidInputError` naming the bad value.
"""
from __future__ import annotations

import re

from checkpoint.errors import InvalidInputError

_SEGMENT = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,127}$")


def validate_job_id(job_id: object) -> str:
    """Return `job_id` if it is a safe name, else raise InvalidInputError saying why."""
    if not isinstance(job_id, str) or not job_id:
        raise InvalidInputError(f"job id must be a non-empty string, got {job_id!r}")
    if not _SEGMENT.match(job_id):
        raise InvalidInputError(
            f"job id {job_id!r} is not allowed: use 1-128 letters, digits, '_', '-' or '.', not starting "
            "with '.' (no '/', '\\', spaces, or other path characters)")
    return job_id


def validate_key(key: object) -> str:
    """A store key: segments joined by '/', each a safe name (no '..', no leading '/')."""
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"store key must be a non-empty string, got {key!r}")
    if ".tmp-" in key:
        raise InvalidInputError(f"store key {key!r} must not contain '.tmp-' (reserved for partial writes)")
    for seg in key.split("/"):
        if not _SEGMENT.match(seg):
            raise InvalidInputError(
                f"store key {key!r} has a bad segment {seg!r}: segments are 1-128 letters, digits, '_', "
                "'-' or '.', not starting with '.'")
    return key


def validate_prefix(prefix: object) -> str:
    """A listing prefix: '' (everything), or whole safe segments followed by a partial last segment."""
    if not isinstance(prefix, str):
        raise InvalidInputError(f"prefix must be a string, got {prefix!r}")
    if prefix == "":
        return prefix
    *whole, last = prefix.split("/")
    for seg in whole:
        if not _SEGMENT.match(seg):
            raise InvalidInputError(f"prefix {prefix!r} has a bad segment {seg!r}")
    if last and not _SEGMENT.match(last):
        raise InvalidInputError(f"prefix {prefix!r} has a bad last segment {last!r}")
    return prefix


def validate_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidInputError(f"step must be a non-negative int, got {step!r}")
    return step


def validate_rank(rank: object, world_size: object) -> tuple[int, int]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidInputError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidInputError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return rank, world_size
