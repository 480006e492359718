"""Our top-level names collide with other packages (python-daemon, proto-plus): check they are ours,
and that the committed gRPC stubs match the .proto files."""
from __future__ import annotations

import filecmp
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["sdcwatch", "daemon", "proto", "probes", "checksums", "checkpoint", "demo",
                                  "integrations"])
def test_top_level_packages_are_ours(name):
    mod = importlib.import_module(name)
    assert Path(mod.__file__).resolve().parent == ROOT / name, f"{name} imported from {mod.__file__}"


def test_generated_stubs_are_current(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    gen_proto.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated but not committed: run scripts/gen_proto.py"
        assert filecmp.cmp(tmp_path / rel, committed, shallow=False), \
            f"{rel} is stale: run python scripts/gen_proto.py"
    for committed in (ROOT / "proto").rglob("*_pb2*.py*"):
        if "__pycache__" in committed.parts:   # Python's bytecode cache of a stub, not a stub
            continue
        assert committed.relative_to(ROOT) in generated, f"{committed} has no .proto any more"


def test_the_stub_generator_is_pinned_to_the_committed_stubs_version():
    """The committed stubs name the grpcio-tools that wrote them (GRPC_GENERATED_VERSION): the test extra
    installs exactly that one, else a fresh install takes the newest on PyPI and the check above fails on a
    clean clone (1.85.4 came out after the stubs were written with 1.85.1)."""
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = [e for e in extras if re.match(r"grpcio-tools\b", e)]
    assert len(pins) == 1 and "==" in pins[0], pins
    pinned = pins[0].split("==")[1].strip()
    stubs = sorted((ROOT / "proto").rglob("*_pb2_grpc.py"))
    assert stubs
    for stub in stubs:
        got = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", stub.read_text(), re.M)
        assert got is not None and got.group(1) == pinned, (stub, got and got.group(1), pinned)


def test_console_script_entry_point():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="console_scripts") if e.name == "sdcwatch"]
    assert eps and eps[0].value == "daemon.cli:main"
