"""How bad an event is. Its own module because both the event catalogue (`sdcwatch.event_kinds`) and the
shared values (`sdcwatch.types`, which re-exports it) need it, and the catalogue is below the values."""
from __future__ import annotations

import enum


class Severity(enum.IntEnum):
    """Values match proto `sdcwatch.v1.Severity`."""

    INFO = 1
    WARNING = 2
    CRITICAL = 3
