"""The layer rules in pyproject.toml ([tool.importlinter]) hold: `lint-imports` passes on this tree.

The contracts say what may import what: the training side never imports the agent, the agent never
imports torch, the shared base imports nothing above it, the rule modules do no I/O, the Monitor builds no
protobufs, and no package or module imports in a cycle. The second test breaks three rules in a copy of
the tree and checks that `lint-imports` names each, so a contract that stopped checking anything would fail
here.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("sdcwatch", "daemon", "probes", "checksums", "checkpoint", "proto", "demo", "integrations")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} is missing: install the test extra (import-linter)"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_layer_contracts_hold() -> None:
    run = _lint(REPO)
    assert run.returncode == 0, f"lint-imports found broken layer rules:\n{run.stdout}\n{run.stderr}"
    assert "0 broken" in run.stdout


def test_a_broken_rule_is_reported(tmp_path: Path) -> None:
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "checksums" / "replica_vote.py", "a") as f:
        f.write("\nimport socket  # a rule module doing I/O\n")
    with open(tmp_path / "checkpoint" / "records.py", "a") as f:
        f.write("\n\ndef _late() -> None:\n    from daemon import events  # a rank reaching into the agent\n")
    with open(tmp_path / "daemon" / "cli_ckpt.py", "a") as f:
        f.write("\n\ndef _restore() -> None:\n    from checkpoint import restore  # the agent's CLI loading torch\n")
    run = _lint(tmp_path)
    assert run.returncode != 0, run.stdout
    broken = [line for line in run.stdout.splitlines() if line.endswith(" BROKEN")]
    assert "Rule modules do no I/O BROKEN" in broken
    assert "The training side never imports the agent BROKEN" in broken
    assert "The agent never imports torch BROKEN" in broken
    assert "checksums.replica_vote -> socket" in run.stdout
    assert "checkpoint.records -> daemon.events" in run.stdout
    assert "daemon.cli_ckpt -> checkpoint.restore" in run.stdout
