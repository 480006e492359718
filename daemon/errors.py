"""The agent's one exception root. Transient errors may be retried; fatal ones stop what raised them."""
from __future__ import annotations


class SdcwatchError(Exception):
    """Root of every error sdcwatch raises on purpose."""

    transient = False


class TransientError(SdcwatchError):
    transient = True


class FatalError(SdcwatchError):
    transient = False


class ConfigError(FatalError):
    """A bad configuration value. `key` is the dotted config key ('agent.listen')."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


class RedisUnavailable(TransientError):
    pass
