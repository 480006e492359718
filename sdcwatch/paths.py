"""Where the agent keeps its state and listens, shared by the agent and the training-side reporter.

Order for the socket: `$SDCWATCH_SOCKET`, else `<state dir>/agent.sock`. The state dir is
`$XDG_RUNTIME_DIR/sdcwatch` when XDG_RUNTIME_DIR is set, else `/tmp/sdcwatch-<uid>`.
Both functions only compute paths; they create nothing.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

SOCKET_NAME = "agent.sock"
SOCKET_ENV = "SDCWATCH_SOCKET"


def _uid() -> int:
    getuid = getattr(os, "getuid", None)
    return getuid() if getuid is not None else 0


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The agent's state dir (holds agent.sock): `$XDG_RUNTIME_DIR/sdcwatch` or `/tmp/sdcwatch-<uid>`."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime:
        return Path(runtime) / "sdcwatch"
    return Path("/tmp") / f"sdcwatch-{_uid()}"


def default_socket(environ: Mapping[str, str] | None = None) -> Path:
    """The agent's unix socket: `$SDCWATCH_SOCKET`, else `<default_state_dir()>/agent.sock`."""
    env = os.environ if environ is None else environ
    explicit = env.get(SOCKET_ENV, "")
    if explicit:
        return Path(explicit)
    return default_state_dir(env) / SOCKET_NAME

