"""Where the agent keeps its state and listens: one rule, used by the agent to choose its socket and by every
client (the CLI, the training-side reporter and checkpoint client) to find it.

The socket, first match wins:

1. an explicit socket (the agent's `[agent] socket` / `--socket`; a client's `--socket`);
2. an explicit state dir's `agent.sock` (the agent's `[agent] state_dir` / `--state-dir`; a client's
   `--state-dir`);
3. `$SDCWATCH_AGENT_SOCKET`, then `$SDCWATCH_AGENT_STATE_DIR/agent.sock` (the agent's config variables:
   a client in the same environment finds the agent they configured);
4. `$SDCWATCH_SOCKET`, then `$SDCWATCH_STATE_DIR/agent.sock` (the process-wide switches);
5. the default state dir's `agent.sock`: `/run/sdcwatch` for root (fixed system paths no other user can
   create first); for a user `$XDG_RUNTIME_DIR/sdcwatch` when XDG_RUNTIME_DIR is set, else
   `/tmp/sdcwatch-<uid>`; a user's client whose own agent's socket does not exist finds the system agent's
   (`/run/sdcwatch/agent.sock`: ranks of many users reaching one root agent) when that exists.

Defaults of a root agent: state dir `/run/sdcwatch` (mode 0750, group `sdcwatch` when that group exists:
`[agent] group`), memory tier base `/dev/shm/sdcwatch`; of a user's agent: its own dirs (mode 0700) and
`/dev/shm/sdcwatch-<uid>`. The agent creates and checks every directory with `sdcwatch.safe_fs` and refuses
to start on a link, another user's directory or one others may write to (exit 2, naming the path and fix).

The memory dir of an agent is `<memory base>/<state dir name>-<12 hex of sha256(absolute state dir)>/memory`:
two agents whose state dirs end in the same folder name (`/a/x`, `/b/x`) never share, wipe or sweep each
other's files; the name part only makes it readable.

`locate_socket` returns the path with the rule that chose it (`Located.source`), so a client that finds
no agent can say where it looked and why there. These functions only compute paths; they create nothing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Mapping

SOCKET_NAME = "agent.sock"
SOCKET_ENV = "SDCWATCH_SOCKET"
STATE_DIR_ENV = "SDCWATCH_STATE_DIR"
AGENT_SOCKET_ENV = "SDCWATCH_AGENT_SOCKET"        # the agent's own config variables ([agent] socket, state_dir)
AGENT_STATE_DIR_ENV = "SDCWATCH_AGENT_STATE_DIR"
SYSTEM_STATE_DIR = Path("/run/sdcwatch")
SHM = Path("/dev/shm")
GROUP = "sdcwatch"   # a root agent gives its socket, state dir and memory dir to this group when it exists


@dataclasses.dataclass(frozen=True)
class Located:
    """A socket path and the rule that chose it, e.g. `$SDCWATCH_STATE_DIR (/x)` or `the default state dir`."""

    path: Path
    source: str

    def describe(self) -> str:
        return f"{self.path} (from {self.source})"


def _uid() -> int:
    getuid = getattr(os, "getuid", None)
    return getuid() if getuid is not None else 0


def default_state_dir(environ: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """The state dir when none is configured: `$SDCWATCH_STATE_DIR`, else `/run/sdcwatch` for root, else
    `$XDG_RUNTIME_DIR/sdcwatch`, else `/tmp/sdcwatch-<uid>`."""
    env = os.environ if environ is None else environ
    uid = _uid() if uid is None else uid
    if env.get(STATE_DIR_ENV, ""):
        return Path(env[STATE_DIR_ENV])
    if uid == 0:
        return SYSTEM_STATE_DIR
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime:
        return Path(runtime) / "sdcwatch"
    return Path("/tmp") / f"sdcwatch-{uid}"


def locate_socket(socket: str | os.PathLike[str] | None = None, state_dir: str | os.PathLike[str] | None = None,
                  environ: Mapping[str, str] | None = None, *, flag_names: tuple[str, str] = ("--socket",
                                                                                              "--state-dir"),
                  uid: int | None = None) -> Located:
    """The agent's socket under the order of the module docstring. `socket` / `state_dir` are the explicit
    settings (empty or None: not given); `flag_names` name them in `Located.source`."""
    env = os.environ if environ is None else environ
    if socket:
        return Located(Path(socket), flag_names[0])
    if state_dir:
        return Located(Path(state_dir) / SOCKET_NAME, f"{flag_names[1]} {os.fspath(state_dir)}")
    for name, is_dir in ((AGENT_SOCKET_ENV, False), (AGENT_STATE_DIR_ENV, True), (SOCKET_ENV, False),
                         (STATE_DIR_ENV, True)):
        value = env.get(name, "")
        if value:
            return Located(Path(value) / SOCKET_NAME if is_dir else Path(value), f"${name}")
    uid = _uid() if uid is None else uid
    own = default_state_dir(env, uid) / SOCKET_NAME
    system = SYSTEM_STATE_DIR / SOCKET_NAME
    if uid == 0:
        return Located(own, f"the default state dir, {SYSTEM_STATE_DIR}")
    if not own.exists() and system.exists():
        return Located(system, f"the system agent's state dir, {SYSTEM_STATE_DIR}")
    where = "$XDG_RUNTIME_DIR/sdcwatch" if env.get("XDG_RUNTIME_DIR", "") else "/tmp/sdcwatch-<uid>"
    return Located(own, f"the default state dir, {where}")


def default_socket(environ: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """The agent's unix socket when nothing explicit is given: `locate_socket()`'s path."""
    return locate_socket(environ=environ, uid=uid).path


def memory_base(uid: int | None = None, shm: Path = SHM) -> Path:
    """The directory holding every agent's memory dir on this node: `/dev/shm/sdcwatch` for root, else
    `/dev/shm/sdcwatch-<uid>`."""
    uid = _uid() if uid is None else uid
    return shm / ("sdcwatch" if uid == 0 else f"sdcwatch-{uid}")


def memory_namespace(state_dir: str | os.PathLike[str]) -> str:
    """`<state dir name>-<12 hex of sha256 of its absolute path>`: one agent's folder under the memory base."""
    full = os.path.abspath(os.fspath(state_dir))
    return f"{Path(full).name or 'root'}-{hashlib.sha256(full.encode()).hexdigest()[:12]}"
