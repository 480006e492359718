"""The CLI as a new user meets it: `--help` on every subcommand, options in any order, a closed pipe ends
quietly, shell completion, progress only on a terminal."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent_harness import ROOT, AgentProcess, cli
from daemon.cli import build_parser


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every runnable subcommand's words, e.g. ('ckpt', 'restore')."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [path]
    return [leaf for name, p in subs[0].choices.items() for leaf in _leaves(p, path + (name,))]


LEAVES = _leaves(build_parser())


def test_every_subcommand_is_seen() -> None:
    assert {("run",), ("status",), ("events",), ("gpu", "clear"), ("spikes", "replay"), ("ckpt", "restore"),
            ("canary",), ("demo",), ("completion",)} <= set(LEAVES)


@pytest.mark.parametrize("words", LEAVES, ids=[" ".join(w) for w in LEAVES])
def test_help_on_every_subcommand(words: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*words, "--help"])
    assert done.value.code == 0


def test_help_in_a_subprocess_prints_usage() -> None:
    out = cli("spikes", "replay", "--help")
    assert out.returncode == 0 and "usage: sdcwatch spikes replay" in out.stdout and "--plot" in out.stdout


def test_options_before_and_after_positionals(tmp_path: Path) -> None:
    log = tmp_path / "train.csv"
    log.write_text("step,loss\n" + "".join(f"{i},{3.0 - i * 0.001:.4f}\n" for i in range(1, 400)))
    a = cli("spikes", "replay", "--json", "--allow-restarts", str(log))
    b = cli("spikes", "replay", str(log), "--allow-restarts", "--json")
    assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
    assert a.stdout == b.stdout
    p = build_parser()
    for argv in (["gpu", "clear", "--reason", "r", "GPU-1", "--socket", "/s"],
                 ["gpu", "clear", "GPU-1", "--socket", "/s", "--reason", "r"]):
        args = p.parse_args(argv)
        assert (args.uuid, args.reason, args.socket) == ("GPU-1", "r", "/s")
    for argv in (["ckpt", "restore", "--job", "j", "latest", "--out", "o"],
                 ["ckpt", "restore", "--out", "o", "--state-dir", "/d", "--job", "j", "latest"]):
        args = p.parse_args(argv)
        assert (args.target, args.job, args.out) == ("latest", "j", "o")


def _with_closed_stdout(*args: str) -> subprocess.CompletedProcess[bytes]:
    """Run `sdcwatch ARGS` with stdout a pipe whose reader has already gone (`| head` that exited)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "daemon.cli", *args], cwd=ROOT, stdout=w,
                              stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(w)


def test_a_closed_pipe_ends_quietly(short_tmp: Path) -> None:
    out = _with_closed_stdout("completion", "bash")
    assert out.returncode == 141 and out.stderr == b"", out.stderr.decode()
    with AgentProcess(short_tmp / "state", "--metrics-listen", "off") as agent:
        for cmd in (["events"], ["events", "--json"], ["status"], ["status", "--json"], ["ckpt", "ls"]):
            out = _with_closed_stdout(*cmd, "--socket", str(agent.socket))
            assert out.returncode == 141, (cmd, out.stderr.decode())
            assert out.stderr == b"", (cmd, out.stderr.decode())


def test_bash_completion_completes_subcommands_and_flags(tmp_path: Path) -> None:
    out = cli("completion", "bash")
    assert out.returncode == 0, out.stderr
    script = tmp_path / "sdcwatch.bash"
    script.write_text(out.stdout)
    probe = ('source "$1"; complete_words() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _shtab_sdcwatch; '
             'echo "${COMPREPLY[*]}"; }; complete_words sdcwatch ck; complete_words sdcwatch status --sta; '
             'complete_words sdcwatch spikes replay --all; complete_words sdcwatch ckpt re')
    got = subprocess.run(["bash", "-c", probe, "-", str(script)], capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split("\n")[:4] == ["ckpt", "--state-dir", "--allow-restarts", "restore"], got.stdout


def test_zsh_completion_names_the_subcommands() -> None:
    out = cli("completion", "zsh")
    assert out.returncode == 0 and out.stdout.startswith("#compdef sdcwatch"), out.stdout[:200]
    assert "spikes" in out.stdout and "--state-dir" in out.stdout
    if shutil.which("zsh"):
        check = subprocess.run(["zsh", "-n"], input=out.stdout, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
