"""Issue 20 Critical 2 and High 8: the (root) agent never follows a link a local user can plant, never uses a
directory another user made, and never replaces another live agent's socket. Each refusal is exit 2 (exit 1
for a live agent) with a message naming the path."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_harness import ROOT, AgentProcess
from checkpoint.shm_store import default_shm_root, sweep_dead_slots
from checkpoint.slots import SlotRing
from sdcwatch import paths
from sdcwatch.safe_fs import UnsafePathError, remove_tree, secure_dir

NOBODY = 65534


def run_agent(state: Path, *extra: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`sdcwatch run` expected to refuse: it must exit by itself within `timeout` (an agent that starts is
    stopped and the test fails)."""
    cmd = [sys.executable, "-m", "daemon.cli", "run", "--state-dir", str(state), "--metrics-listen", "off",
           "--shutdown-grace-s", "0", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the agent started instead of refusing:\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory of root's that a planted link points at: it must come out untouched."""
    d = tmp_path / "victim"
    d.mkdir()
    (d / "precious").write_text("keep me\n")
    return d


def test_a_planted_memory_link_is_refused_and_its_target_kept(tmp_path: Path, victim: Path) -> None:
    state = tmp_path / "node"
    memory = default_shm_root(state)
    memory.parent.mkdir(parents=True, exist_ok=True)
    try:
        memory.symlink_to(victim)
        out = run_agent(state, "--socket", str(tmp_path / "a.sock"))
        assert out.returncode == 2, out.stdout
        assert str(memory) in out.stdout and "link" in out.stdout
        assert (victim / "precious").read_text() == "keep me\n", "the link's target was emptied"
    finally:
        remove_tree(memory.parent)
    assert (victim / "precious").exists()


def test_a_planted_agent_lock_link_truncates_nothing(tmp_path: Path, victim: Path) -> None:
    state = tmp_path / "node"
    state.mkdir(mode=0o700)
    (state / "agent.lock").symlink_to(victim / "precious")
    out = run_agent(state)
    assert out.returncode == 2, out.stdout
    assert "agent.lock" in out.stdout
    assert (victim / "precious").read_text() == "keep me\n"
    remove_tree(default_shm_root(state).parent)


def test_a_planted_redis_log_link_is_refused(tmp_path: Path, victim: Path) -> None:
    state = tmp_path / "node"
    state.mkdir(mode=0o700)
    (state / "redis.log").symlink_to(victim / "precious")
    out = run_agent(state)
    assert out.returncode == 2, out.stdout
    assert "redis.log" in out.stdout
    assert (victim / "precious").read_text() == "keep me\n"
    remove_tree(default_shm_root(state).parent)


def test_a_state_dir_another_user_created_is_refused(tmp_path: Path) -> None:
    """The predictable default (/tmp/sdcwatch-<uid>) pre-created by another local user."""
    state = tmp_path / "node"
    state.mkdir(mode=0o777)
    os.chown(state, NOBODY, NOBODY)
    out = run_agent(state)
    assert out.returncode == 2, out.stdout
    assert f"refusing to use {state}" in out.stdout and f"owned by uid {NOBODY}" in out.stdout
    assert not (state / "agent.lock").exists()


def test_a_parent_others_can_write_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafePathError, match="no sticky bit"):
        secure_dir(open_dir / "state")
    open_dir.chmod(0o1777)   # like /tmp: fine
    assert secure_dir(open_dir / "state") == open_dir / "state"
    assert (open_dir / "state").stat().st_mode & 0o777 == 0o700


def test_a_link_on_the_way_is_refused_unless_root_owns_it_in_a_root_dir(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    os.chown(link, NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        secure_dir(link / "state")
    assert not (real / "state").exists()


def test_a_second_agent_on_the_same_socket_refuses_and_leaves_the_live_one(tmp_path: Path) -> None:
    """High 8: another state dir, the same --socket: the first agent's live socket must not be unlinked."""
    sock = tmp_path / "shared.sock"
    first = AgentProcess(tmp_path / "first", "--socket", str(sock))
    first.socket = sock
    with first:
        inode = sock.stat().st_ino
        out = run_agent(tmp_path / "second", "--socket", str(sock))
        assert out.returncode != 0 and "another agent is listening" in out.stdout, out.stdout
        assert sock.stat().st_ino == inode, "the live socket was replaced"
        first.wait_serving(10)
    for s in ("first", "second"):
        remove_tree(default_shm_root(tmp_path / s).parent)


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    sock = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    s.close()   # bound, never listening, closed: a socket file nobody answers on
    agent = AgentProcess(tmp_path / "node", "--socket", str(sock))
    agent.socket = sock
    with agent:
        agent.wait_serving(10)
    remove_tree(default_shm_root(tmp_path / "node").parent)


def test_state_dirs_with_the_same_name_get_separate_memory_dirs(tmp_path: Path) -> None:
    """Issue 21: two agents on /a/x and /b/x shared /dev/shm/.../x and wiped each other's files."""
    a, b = default_shm_root(tmp_path / "a" / "x"), default_shm_root(tmp_path / "b" / "x")
    assert a != b and a.parent != b.parent
    assert default_shm_root(tmp_path / "a" / "x") == a, "stable for one state dir"
    assert paths.memory_namespace(tmp_path / "a" / "x").startswith("x-")


def test_removing_a_tree_never_follows_links(tmp_path: Path, victim: Path) -> None:
    top = tmp_path / "memory"
    (top / "job" / "5").mkdir(parents=True)
    (top / "job" / "5" / "rank-0").write_bytes(b"x")
    (top / "job" / "6").symlink_to(victim)
    (top / "file-link").symlink_to(victim / "precious")
    assert remove_tree(top) == 3
    assert not top.exists() and (victim / "precious").read_text() == "keep me\n"
    link_top = tmp_path / "link-top"
    link_top.symlink_to(victim)
    assert remove_tree(link_top) == 0 and (victim / "precious").exists()


def test_the_slot_sweep_never_follows_a_planted_link(tmp_path: Path, victim: Path) -> None:
    root = tmp_path / "memory"
    root.mkdir()
    (root / ".slots").symlink_to(victim)
    old = time.time() + 3600
    assert sweep_dead_slots(root, now=old, min_age_s=0) == 0
    assert (victim / "precious").exists()


def test_defaults_root_uses_system_paths_a_user_their_own() -> None:
    assert paths.default_state_dir({}, uid=0) == Path("/run/sdcwatch")
    assert paths.default_state_dir({"XDG_RUNTIME_DIR": "/run/user/1000"}, uid=1000) == Path("/run/user/1000/sdcwatch")
    assert paths.default_state_dir({}, uid=1000) == Path("/tmp/sdcwatch-1000")
    assert paths.memory_base(uid=0) == Path("/dev/shm/sdcwatch")
    assert paths.memory_base(uid=1000) == Path("/dev/shm/sdcwatch-1000")
    assert paths.default_socket({"SDCWATCH_SOCKET": "/x.sock"}, uid=1000) == Path("/x.sock")
    assert paths.default_socket({}, uid=0) == Path("/run/sdcwatch/agent.sock")


def test_a_rank_never_creates_slots_through_a_planted_link(tmp_path: Path, victim: Path) -> None:
    """The memory dir is shared with the ranks' group: a link planted as `.slots/<job>` is refused (the save
    then stages privately), never written through."""
    memory = tmp_path / "memory"
    (memory / ".slots").mkdir(parents=True)
    (memory / ".slots" / "j").symlink_to(victim)
    ring = SlotRing(memory, "j", 0, register_cuda=False)
    with pytest.raises(OSError, match="not a directory of uid"):
        ring.acquire(16)
    assert sorted(p.name for p in victim.iterdir()) == ["precious"]


@pytest.mark.parametrize("case", ["open to all", "sticky like /tmp", "group-writable", "another user's",
                                  "planted link", "missing"])
def test_an_explicit_socket_directory_is_checked_like_the_state_dir(tmp_path: Path, case: str) -> None:
    """Issue 20: `--socket PATH` was bound wherever PATH's directory was (another user's, a link someone planted,
    a directory anyone can write and so swap our socket in): now the same checks as the default location,
    exit 2 naming the directory, nothing created there."""
    d = tmp_path / "sockdir"
    if case == "planted link":
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        d.symlink_to(real)
        os.chown(d, NOBODY, NOBODY, follow_symlinks=False)
    elif case != "missing":
        d.mkdir()
        d.chmod({"open to all": 0o777, "sticky like /tmp": 0o1777, "group-writable": 0o770}.get(case, 0o755))
        if case == "another user's":
            os.chown(d, NOBODY, NOBODY)
    state = tmp_path / "node"
    try:
        out = run_agent(state, "--socket", str(d / "agent.sock"))
        assert out.returncode == 2, out.stdout
        assert f"refusing to use {d}" in out.stdout, out.stdout
        assert {"open to all": "others may write", "sticky like /tmp": "others may write",
                "group-writable": "others may write", "another user's": f"owned by uid {NOBODY}",
                "planted link": "symbolic link", "missing": "does not exist"}[case] in out.stdout, out.stdout
        assert "Traceback" not in out.stdout
        assert not (d / "agent.sock").exists() and not (tmp_path / "real" / "agent.sock").exists()
    finally:
        remove_tree(default_shm_root(state).parent)


def test_an_explicit_socket_in_a_directory_of_ours_is_fine(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    agent = AgentProcess(tmp_path / "node", "--socket", str(d / "agent.sock"))
    agent.socket = d / "agent.sock"
    with agent:
        agent.wait_serving(10)
    remove_tree(default_shm_root(tmp_path / "node").parent)
