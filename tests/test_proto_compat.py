"""scripts/proto_compat.py: the current .proto files keep the released wire, and the check catches breaks.

The repository's own definitions are compared against the committed released snapshot (a failure here
means a change would break running jobs on a DaemonSet upgrade: docs/wire-compat.md). Then copies of the
.proto files are broken on purpose, one way at a time, compiled with protoc and compared against the same
snapshot: each break must be reported with its file, element and member, and additions must pass.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

import sdcwatch

ROOT = Path(__file__).resolve().parent.parent
AGENT = "proto/sdcwatch/v1/agent.proto"
CKPT = "proto/sdcwatch/v1/checkpoint.proto"
PEER = "proto/sdcwatch/v1/peer.proto"


def _load_script(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


compat = _load_script("proto_compat")
RELEASED = compat.load_descriptor_set(compat.latest_snapshot())


def _tree(tmp: Path, edits: dict[str, list[tuple[str, str]]]) -> Path:
    """A copy of proto/ under `tmp` with each (old, new) text replaced; `old` must occur exactly once."""
    for src in (ROOT / "proto").rglob("*.proto"):
        dst = tmp / src.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    for rel, pairs in edits.items():
        path = tmp / rel
        text = path.read_text()
        for old, new in pairs:
            assert text.count(old) == 1, f"{rel}: {old!r} occurs {text.count(old)} times; fix the test's edit"
            text = text.replace(old, new)
        path.write_text(text)
    return tmp


def _changes(tmp: Path, edits: dict[str, list[tuple[str, str]]],
             released: descriptor_pb2.FileDescriptorSet = RELEASED) -> list[str]:
    return [str(c) for c in compat.breaking_changes(released, compat.compile_descriptor_set(_tree(tmp, edits)))]


# ---- the repository itself -------------------------------------------------------------------------------


def test_current_protos_keep_the_released_wire() -> None:
    """The check as CI and a developer run it: the script, on the working tree, against the newest snapshot."""
    out = subprocess.run([sys.executable, "scripts/proto_compat.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"breaking changes against the released wire:\n{out.stdout}{out.stderr}"
    assert "compatible with sdcwatch-" in out.stdout


def test_released_snapshot_holds_the_services_and_no_future_version() -> None:
    """The snapshot holds the three services, and no snapshot claims a version newer than the package."""
    latest = compat.latest_snapshot()
    assert compat.snapshot_version(latest) <= tuple(int(x) for x in sdcwatch.__version__.split(".")[:3])
    files = {f.name: f for f in RELEASED.file}
    assert {AGENT, CKPT, PEER, "google/protobuf/struct.proto"} <= set(files)
    services = {s.name: [m.name for m in s.method] for f in files.values() for s in f.service}
    assert {"Agent", "Checkpoints", "PeerStore"} <= set(services)
    assert {"GetStatus", "WatchEvents", "ReportStep", "ClearGpu"} <= set(services["Agent"])


# ---- breaks are reported ------------------------------------------------------------------------------------

BREAKS = {
    "removed field": (
        {AGENT: [("  optional double loss = 5;\n", "")]},
        [f'{AGENT}: message sdcwatch.v1.ReportStepRequest: field 5 "loss": deleted',
         "[FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED]"]),
    "renumbered field": (
        {AGENT: [("uint64 checks_run = 19;", "uint64 checks_run = 41;")]},
        [f'{AGENT}: message sdcwatch.v1.ReportStepRequest: field 19 "checks_run": renumbered 19 -> 41']),
    "changed type": (
        {AGENT: [("double uptime_s = 11;", "float uptime_s = 11;")]},
        [f'{AGENT}: message sdcwatch.v1.GetStatusResponse: field 11 "uptime_s": type changed double -> float',
         "[FIELD_SAME_TYPE]"]),
    "changed message type": (
        {AGENT: [("message CheckpointSummary {", "message JobCheckpoints {"),
                 ("repeated CheckpointSummary checkpoints = 14;", "repeated JobCheckpoints checkpoints = 14;")]},
        [f"{AGENT}: message sdcwatch.v1.CheckpointSummary: deleted", "[MESSAGE_NO_DELETE]",
         "field 14 \"checkpoints\": type changed message sdcwatch.v1.CheckpointSummary -> "
         "message sdcwatch.v1.JobCheckpoints"]),
    "removed rpc": (
        {AGENT: [("  rpc ClearGpu(ClearGpuRequest) returns (ClearGpuResponse);\n", "")]},
        [f"{AGENT}: service sdcwatch.v1.Agent: rpc ClearGpu: deleted", "[RPC_NO_DELETE]"]),
    "removed enum value": (
        {AGENT: [("  STATE_UNKNOWN = 5;", "  // gone")]},
        [f'{AGENT}: enum sdcwatch.v1.State: value 5 "STATE_UNKNOWN": deleted',
         "[ENUM_VALUE_NO_DELETE_UNLESS_NUMBER_RESERVED]"]),
    "renamed enum value": (
        {AGENT: [("STATE_SUSPECT = 2;", "STATE_SDC = 2;")]},
        [f'{AGENT}: enum sdcwatch.v1.State: value 2 "STATE_SUSPECT": renamed to "STATE_SDC"']),
    "renamed field": (
        {AGENT: [("string gpu_uuid = 11;", "string gpu = 11;")]},
        [f'message sdcwatch.v1.ReportStepRequest: field 11 "gpu_uuid": renamed to "gpu" [FIELD_SAME_NAME]']),
    "json_name": (
        {AGENT: [("string host = 10;", 'string host = 10 [json_name = "hostName"];')]},
        ['field 10 "host": json_name changed "host" -> "hostName" [FIELD_SAME_JSON_NAME]']),
    "presence dropped": (
        {AGENT: [("optional double grad_norm = 6;", "double grad_norm = 6;")]},
        ['field 6 "grad_norm": cardinality changed optional (explicit presence) -> singular',
         "[FIELD_SAME_CARDINALITY]"]),
    "made repeated": (
        {AGENT: [("double uptime_s = 11;", "repeated double uptime_s = 11;")]},
        ['field 11 "uptime_s": cardinality changed singular -> repeated']),
    "moved out of a oneof": (
        {CKPT: [("  oneof target {\n    int64 step = 2;\n", "  int64 step = 2;\n  oneof target {\n")]},
        [f'{CKPT}: message sdcwatch.v1.RestorePlanRequest: field 2 "step": moved from target to no oneof',
         "[FIELD_SAME_ONEOF]"]),
    "changed request type": (
        {CKPT: [("rpc Latest(LatestRequest)", "rpc Latest(ListCheckpointsRequest)")]},
        ["service sdcwatch.v1.Checkpoints: rpc Latest: request type changed sdcwatch.v1.LatestRequest -> "
         "sdcwatch.v1.ListCheckpointsRequest [RPC_SAME_REQUEST_TYPE]"]),
    "unary instead of stream": (
        {AGENT: [("returns (stream Event);", "returns (Event);")]},
        ["rpc WatchEvents: server streaming changed True -> False [RPC_SAME_SERVER_STREAMING]"]),
    "package renamed": (
        {PEER: [("package sdcwatch.v1;", "package sdcwatch.v2;")]},
        [f"{PEER}: service sdcwatch.v1.PeerStore: deleted",
         f"{PEER}: message sdcwatch.v1.PutBlobRequest: deleted"]),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_break_is_reported_with_file_element_and_member(tmp_path: Path, name: str) -> None:
    edits, expected = BREAKS[name]
    found = "\n".join(_changes(tmp_path, edits))
    for text in expected:
        assert text in found, f"{name}: expected {text!r} in:\n{found}"


def test_a_reused_reserved_number_is_reported(tmp_path: Path) -> None:
    """Retiring a field properly passes; a later release that reuses its number or name does not."""
    retire = {AGENT: [("  optional double loss = 5;\n", '  reserved 5;\n  reserved "loss";\n')]}
    assert _changes(tmp_path / "retired", retire) == []
    retired = compat.compile_descriptor_set(_tree(tmp_path / "retired2", retire))
    reuse = {AGENT: [("  optional double loss = 5;\n", "  string loss = 5;\n")]}
    found = "\n".join(_changes(tmp_path / "reused", reuse, released=retired))
    assert 'message sdcwatch.v1.ReportStepRequest: field 5 "loss": reuses the reserved number 5' in found
    assert 'reuses the reserved name "loss"' in found


def test_additions_are_accepted(tmp_path: Path) -> None:
    edits = {
        AGENT: [("  CanaryResult canary = 20;", "  CanaryResult canary = 20;\n  string note = 41;\n"
                 "  optional Extra extra = 42;"),
                ("  STATE_UNKNOWN = 5;", "  STATE_UNKNOWN = 5;\n  STATE_QUARANTINED = 6;"),
                ("  rpc ClearGpu(ClearGpuRequest) returns (ClearGpuResponse);",
                 "  rpc ClearGpu(ClearGpuRequest) returns (ClearGpuResponse);\n"
                 "  rpc Ping(GetStatusRequest) returns (stream Event);"),
                ("message GetStatusRequest {}", "message GetStatusRequest {}\n\nmessage Extra { string a = 1; }\n"
                 "service Extras { rpc Get(Extra) returns (Extra); }")],
        CKPT: [("// sdcwatch.v1.Checkpoints:", "// edited comment. sdcwatch.v1.Checkpoints:")],
    }
    assert _changes(tmp_path, edits) == []


def test_the_script_prints_each_break_and_exits_1(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {AGENT: [("  optional double loss = 5;\n", ""),
                                    ("  rpc ClearGpu(ClearGpuRequest) returns (ClearGpuResponse);\n", "")]})
    out = subprocess.run([sys.executable, "scripts/proto_compat.py", "--root", str(tree)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    lines = out.stdout.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f'{AGENT}: message sdcwatch.v1.ReportStepRequest: field 5 "loss": deleted')
    assert lines[1].startswith(f"{AGENT}: service sdcwatch.v1.Agent: rpc ClearGpu: deleted")
    assert "2 breaking change(s) against sdcwatch-" in out.stderr


def test_the_script_refuses_bad_input_with_exit_2(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree", {AGENT: [("message GetStatusRequest {}", "message GetStatusRequest {")]})
    run = lambda *a: subprocess.run([sys.executable, "scripts/proto_compat.py", *a], cwd=ROOT,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    bad_proto = run("--root", str(tree))
    assert bad_proto.returncode == 2 and "protoc failed" in bad_proto.stderr, bad_proto
    missing = run("--against", str(tmp_path / "nope.binpb"))
    assert missing.returncode == 2 and "nope.binpb" in missing.stderr, missing
    existing = run("--cut", "0.1.0")
    assert existing.returncode == 2 and "never rewritten" in existing.stderr, existing
    assert "Traceback" not in bad_proto.stderr + missing.stderr + existing.stderr
