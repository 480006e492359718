"""sdcwatch's one exception root, shared by the agent and the training side.

Every error sdcwatch raises on purpose derives from `SdcwatchError` (the agent's config and start-up
errors, checkpoint errors, NVML errors, canary-child errors, alert delivery, peer stores, ...), so a caller
can catch them all, and each says whether retrying may help: `transient` (a class default that an instance
may override, e.g. an NVML return code or an HTTP status decides it). The code that retries or gives up asks
`is_transient(exc)`, which also classes the standard library's connection and timeout errors as transient.

A family that is also a standard error keeps that base too (`InvalidInputError` is a `ValueError`,
`PeerStoreError` an `OSError`), so callers that catch those keep working.
"""
from __future__ import annotations


class SdcwatchError(Exception):
    """Root of every error sdcwatch raises on purpose. `transient`: a later attempt may succeed."""

    transient: bool = False

    def __init__(self, *args: object, transient: bool | None = None) -> None:
        super().__init__(*args)
        if transient is not None:
            self.transient = transient


class FatalError(SdcwatchError):
    """The agent cannot go on (another agent holds the state dir, Redis is unreachable at start-up, ...)."""


def is_transient(exc: BaseException) -> bool:
    """Whether retrying what raised `exc` may succeed: an SdcwatchError says so itself; connection and
    timeout errors are transient; anything else (a bug, bad input) is not."""
    if isinstance(exc, SdcwatchError):
        return exc.transient
    return isinstance(exc, (ConnectionError, TimeoutError))
