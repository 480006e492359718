"""The agent's own error: a bad configuration value. The root (`SdcwatchError`, `transient`) and
`FatalError` are in sdcwatch/errors.py, shared with the training side."""
from __future__ import annotations

from sdcwatch.errors import FatalError


class ConfigError(FatalError):
    """A bad configuration value. `key` is the dotted config key ('agent.listen')."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why
