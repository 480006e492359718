"""Typed settings: how a component's config dataclass gives each field its help text, and the one error a
bad value raises. Both sides use it (the agent's config tree in daemon/config.py reads the help text for
`sdcwatch run --help` and docs/config.md; rule modules raise `SettingError` from `__post_init__`).

    @dataclasses.dataclass(kw_only=True, slots=True)
    class WindowConfig:
        window: int = setting(128, "samples in the baseline window")

        def __post_init__(self) -> None:
            if self.window < 1:
                raise SettingError("WindowConfig", "window", f"must be >= 1, got {self.window!r}")
"""
from __future__ import annotations

import dataclasses
from typing import Any

from sdcwatch.errors import SdcwatchError

HELP = "help"


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with one line of help (shown by `sdcwatch run --help` and docs/config.md)."""
    if "\n" in help:
        raise ValueError(f"setting help is one line, got {help!r}")
    return dataclasses.field(default=default, default_factory=factory, metadata={HELP: help})


def help_of(f: dataclasses.Field[Any]) -> str:
    """The help line of a field made by `setting` ('' for another field)."""
    return str(f.metadata.get(HELP, ""))


class SettingError(SdcwatchError, ValueError):
    """A setting's value is wrong: `name` is the field, `why` says what is wrong and what would do."""

    def __init__(self, owner: str, name: str, why: str) -> None:
        super().__init__(f"{owner}.{name} {why}")
        self.owner = owner
        self.name = name
        self.why = why
