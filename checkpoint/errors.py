"""Checkpoint errors, under sdcwatch's one root (sdcwatch/errors.py), classed transient (retry may help) or fatal.

`InvalidInputError` is also a `ValueError`, so callers that catch ValueError for bad input keep working.
"""
from __future__ import annotations

from sdcwatch.errors import SdcwatchError


class CheckpointError(SdcwatchError):
    """Root of every checkpoint error. `transient` says whether retrying the same call may succeed."""


class InvalidInputError(CheckpointError, ValueError):
    """A caller passed something malformed (a job id with path characters, an unsupported object...)."""


class UnknownCheckpointError(CheckpointError, LookupError):
    """The requested checkpoint does not exist (unknown step, nothing committed, nothing verified)."""


class NotInMemoryError(UnknownCheckpointError):
    """The coordination Redis has no record of the job at all (e.g. it restarted empty), or the bytes of
    a checkpoint are gone from every memory tier that was tried."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes failed their checksum or fingerprint on every copy that was tried."""


class CommitError(CheckpointError):
    """A shard could not be committed (conflicting manifest, world size mismatch, aborted save)."""


class AgentUnavailableError(CheckpointError):
    """The node agent did not answer within the deadline."""

    transient = True


class StoreUnavailableError(CheckpointError):
    """The coordination store did not confirm a write: it was not replicated in time, the primary refused it
    (too few replicas), or a newer primary era fenced it (checkpoint/commit_fence.py). Nothing was reported
    as done; the same call may succeed once the failover completes."""

    transient = True


# What an agent's CommitShard answers (FAILED_PRECONDITION) for a layout_id it does not keep (restarted, or
# never sent): the rank sends the layout's JSON again (checkpoint.shard_layout)
UNKNOWN_LAYOUT = "unknown shard layout"
