"""Clients find the agent by the rule the agent chose its socket with (sdcwatch/paths.py): `--state-dir`,
`--socket`, `$SDCWATCH_STATE_DIR`, `$SDCWATCH_SOCKET`, the default state dir; when no agent is there they say
where they looked. A state dir the agent cannot create or write exits 2 with the reason."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from agent_harness import AgentProcess, cli, remove_test_dir
from sdcwatch.paths import Located, default_state_dir, locate_socket

CLEAN = {"SDCWATCH_SOCKET": "", "SDCWATCH_STATE_DIR": "", "SDCWATCH_AGENT_SOCKET": "",
         "SDCWATCH_AGENT_STATE_DIR": ""}


def test_the_rule_in_order() -> None:
    env = {"XDG_RUNTIME_DIR": "/run/user/7"}
    assert locate_socket(environ=env, uid=7) == Located(Path("/run/user/7/sdcwatch/agent.sock"),
                                                        "the default state dir, $XDG_RUNTIME_DIR/sdcwatch")
    assert locate_socket(environ=env, uid=0) == Located(Path("/run/sdcwatch/agent.sock"),
                                                        "the default state dir, /run/sdcwatch")
    env["SDCWATCH_STATE_DIR"] = "/s"
    assert default_state_dir(env) == Path("/s")
    assert locate_socket(environ=env).path == Path("/s/agent.sock")
    env["SDCWATCH_SOCKET"] = "/k.sock"
    assert locate_socket(environ=env) == Located(Path("/k.sock"), "$SDCWATCH_SOCKET")
    env["SDCWATCH_AGENT_STATE_DIR"] = "/a"          # the agent's own config variable beats the defaults
    assert locate_socket(environ=env).path == Path("/a/agent.sock")
    env["SDCWATCH_AGENT_SOCKET"] = "/a.sock"
    assert locate_socket(environ=env).path == Path("/a.sock")
    assert locate_socket(state_dir="/d", environ=env) == Located(Path("/d/agent.sock"), "--state-dir /d")
    assert locate_socket("/x.sock", "/d", environ=env) == Located(Path("/x.sock"), "--socket")


@pytest.fixture(scope="module")
def started() -> Iterator[AgentProcess]:
    d = Path(tempfile.mkdtemp(prefix="sdcw-disc-", dir="/tmp"))   # short: unix socket paths < 108 bytes
    agent = AgentProcess(d / "state", "--metrics-listen", "off").start()
    try:
        yield agent
    finally:
        agent.stop()
        remove_test_dir(d)


def test_status_finds_the_agent_started_with_a_state_dir(started: AgentProcess) -> None:
    state = str(started.state_dir)
    for args, env in ((["--state-dir", state], CLEAN), ([], CLEAN | {"SDCWATCH_STATE_DIR": state}),
                      ([], CLEAN | {"SDCWATCH_SOCKET": str(started.socket)}),
                      ([], CLEAN | {"SDCWATCH_AGENT_STATE_DIR": state}),
                      (["--socket", str(started.socket)], CLEAN | {"SDCWATCH_STATE_DIR": "/nowhere"}),
                      (["--state-dir", state], CLEAN | {"SDCWATCH_SOCKET": "/nowhere.sock"})):
        out = cli("status", *args, env=env)
        assert out.returncode != 2 and out.stdout.startswith("node "), (args, env, out.stderr)   # reached
        out = cli("events", *args, "--kind", "agent.ready", env=env)
        assert out.returncode == 0 and "agent.ready" in out.stdout, (args, env, out.stderr)
        out = cli("ckpt", "ls", *args, env=env)
        assert out.returncode == 0, (args, env, out.stderr)


def test_the_agent_honours_the_process_wide_state_dir(short_tmp: Path) -> None:
    state = short_tmp / "from-env"    # `sdcwatch run` with no --state-dir: $SDCWATCH_STATE_DIR chooses it
    env = CLEAN | {"SDCWATCH_STATE_DIR": str(state)}
    with AgentProcess(state, "--metrics-listen", "off", env=env, state_dir_flag=False):
        out = cli("status", env=env)
        assert out.returncode != 2 and out.stdout.startswith("node "), out.stderr   # reached (3: GPUs UNKNOWN)


def test_no_agent_says_where_it_looked(short_tmp: Path) -> None:
    nobody = short_tmp / "nobody"
    for args, env, source in ((["--state-dir", str(nobody)], CLEAN, f"--state-dir {nobody}"),
                              ([], CLEAN | {"SDCWATCH_STATE_DIR": str(nobody)}, "$SDCWATCH_STATE_DIR"),
                              ([], CLEAN | {"SDCWATCH_SOCKET": str(nobody / "agent.sock")}, "$SDCWATCH_SOCKET"),
                              # root's default is the fixed /run/sdcwatch, whatever XDG_RUNTIME_DIR says
                              *([] if os.getuid() == 0 else
                                [([], CLEAN | {"XDG_RUNTIME_DIR": str(nobody)}, "the default state dir")])):
        for cmd in (["status"], ["events"], ["ckpt", "ls"], ["gpu", "clear", "GPU-1", "--reason", "r"]):
            out = cli(*cmd, *args, env=env)
            assert out.returncode == 2, (cmd, args, out.stderr)
            assert f"{nobody}" in out.stderr and source in out.stderr, (cmd, out.stderr)
            assert "--state-dir" in out.stderr and "Traceback" not in out.stderr


def test_a_stale_socket_says_where_it_looked(short_tmp: Path) -> None:
    import socket

    path = short_tmp / "agent.sock"
    with socket.socket(socket.AF_UNIX) as s:   # bound, never listening, then closed: nobody answers
        s.bind(str(path))
    out = cli("status", "--state-dir", str(short_tmp), "--timeout", "2", env=CLEAN)
    assert out.returncode == 2
    assert "cannot reach the agent at" in out.stderr and str(path) in out.stderr


@pytest.mark.parametrize("make", ["missing-parent", "file", "unwritable"])
def test_a_bad_state_dir_exits_2_with_the_reason(short_tmp: Path, make: str) -> None:
    if make == "missing-parent":
        state = "/proc/sdcwatch-no-such/state"     # /proc refuses new directories, even to root
    elif make == "file":
        (short_tmp / "f").write_text("x")
        state = str(short_tmp / "f" / "state")
    else:
        state = "/proc/self"                        # exists, a directory, not writable
    out = cli("run", "--state-dir", state, "--metrics-listen", "off", env=CLEAN)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "agent.state_dir" in out.stderr and state in out.stderr and "--state-dir" in out.stderr
