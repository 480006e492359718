"""Validation of the names that end up in store keys and Redis keys.

A job id is checked by the one rule the agent and the rank library apply too (`sdcwatch.names.JOB_ID`: a job
the Monitor and the agent take can save checkpoints under the same name). A key segment may hold letters,
digits and `_ - . : @ + =` (not `.`/`..` alone, not leading `.`), so it can never climb out of a directory,
split a Redis key, or match a glob. Anything else is
rejected with `InvalidInputError` naming the bad value (shown cut to `SHOWN` characters: an error never
echoes an unbounded client string, e.g. into gRPC metadata). A key is at most `MAX_KEY` characters, well
under PATH_MAX once under the store's root.
"""
from __future__ import annotations

import re

from checkpoint.errors import InvalidInputError
from sdcwatch.names import JOB_ID

_SEGMENT = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.:@+=\-]{0,127}$")
MAX_KEY = 1024
SHOWN = 80


def shown(value: object) -> str:
    """`value` for an error message: its repr, cut to SHOWN characters."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


def validate_job_id(job_id: object) -> str:
    """Return `job_id` if it is a safe name, else raise InvalidInputError saying why."""
    if not isinstance(job_id, str) or not job_id:
        raise InvalidInputError(f"job id must be a non-empty string, got {shown(job_id)}")
    problem = JOB_ID.problem("job id", job_id)
    if problem:
        raise InvalidInputError(problem)
    return job_id


def validate_key(key: object) -> str:
    """A store key: segments joined by '/', each a safe name (no '..', no leading '/')."""
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"store key must be a non-empty string, got {shown(key)}")
    if len(key) > MAX_KEY:
        raise InvalidInputError(f"store key {shown(key)} is over {MAX_KEY} characters")
    if ".tmp-" in key:
        raise InvalidInputError(f"store key {shown(key)} must not contain '.tmp-' (reserved for partial writes)")
    for seg in key.split("/"):
        if not _SEGMENT.fullmatch(seg):
            raise InvalidInputError(
                f"store key {shown(key)} has a bad segment {shown(seg)}: segments are 1-128 letters, "
                "digits and '_ - . : @ + =', not starting with '.'")
    return key


def validate_prefix(prefix: object) -> str:
    """A listing prefix: '' (everything), or whole safe segments followed by a partial last segment."""
    if not isinstance(prefix, str):
        raise InvalidInputError(f"prefix must be a string, got {shown(prefix)}")
    if prefix == "":
        return prefix
    if len(prefix) > MAX_KEY:
        raise InvalidInputError(f"prefix {shown(prefix)} is over {MAX_KEY} characters")
    *whole, last = prefix.split("/")
    for seg in whole:
        if not _SEGMENT.fullmatch(seg):
            raise InvalidInputError(f"prefix {shown(prefix)} has a bad segment {shown(seg)}")
    if last and not _SEGMENT.fullmatch(last):
        raise InvalidInputError(f"prefix {shown(prefix)} has a bad last segment {shown(last)}")
    return prefix


def validate_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidInputError(f"step must be a non-negative int, got {shown(step)}")
    return step


def validate_rank(rank: object, world_size: object) -> tuple[int, int]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidInputError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidInputError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return rank, world_size
