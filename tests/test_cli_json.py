"""Every `--json` output has one schema (docs/json.md): proto field names, every field present, integers as
JSON numbers, enums as lowercase words, details' integral numbers as integers. Checked against the proto
descriptors over every subcommand that has `--json`, on a real agent holding a verified checkpoint."""
from __future__ import annotations

import argparse
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from agent_harness import AgentProcess, cli
from checkpoint.client import CheckpointClient
from checkpoint.shm_store import default_shm_root
from checkpoint.snapshot import SnapshotConfig
from ckpt_support import job_id, state_dict
from daemon.cli import build_parser
from daemon.cli_json import enum_word, is_repeated
from proto.sdcwatch.v1 import agent_pb2 as apb
from proto.sdcwatch.v1 import agent_pb2_grpc as apb_grpc
from proto.sdcwatch.v1 import checkpoint_pb2 as cpb
from proto.sdcwatch.v1 import checkpoint_pb2_grpc as cpb_grpc

INTS = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64}


def conforms(desc: Descriptor, obj: Any, where: str = "$") -> None:
    """`obj` is `desc`'s message in the schema: every field, each of its type."""
    assert isinstance(obj, dict), where
    assert set(obj) == {f.name for f in desc.fields}, (where, set(obj) ^ {f.name for f in desc.fields})
    for f in desc.fields:
        v, at = obj[f.name], f"{where}.{f.name}"
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            assert isinstance(v, dict), at
            continue
        for i, item in enumerate(v if is_repeated(f) else [v]):
            _value(f, item, f"{at}[{i}]")


def _value(f: FieldDescriptor, v: Any, at: str) -> None:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        if f.message_type.full_name == "google.protobuf.Struct":
            assert isinstance(v, dict), at
            _no_integral_floats(v, at)
        else:
            conforms(f.message_type, v, at)
    elif f.type == FieldDescriptor.TYPE_ENUM:
        words = {enum_word(f.enum_type, n.number) for n in f.enum_type.values}
        assert v in words and v == v.lower(), (at, v, words)
    elif f.type in INTS:
        assert type(v) is int, (at, v)
    elif f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        assert type(v) in (int, float), (at, v)
    elif f.type == FieldDescriptor.TYPE_BOOL:
        assert type(v) is bool, (at, v)
    else:
        assert isinstance(v, str), (at, v)


def _no_integral_floats(v: Any, at: str) -> None:
    if isinstance(v, float):
        assert not v.is_integer(), (at, v)
    elif isinstance(v, dict):
        for k, x in v.items():
            _no_integral_floats(x, f"{at}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _no_integral_floats(x, f"{at}[{i}]")


def _json_commands() -> set[tuple[str, ...]]:
    found = set()

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, path + (name,))
            elif "--json" in a.option_strings and a.nargs == 0:
                found.add(path)
    walk(build_parser(), ())
    return found


def test_every_json_command_in_one_schema(short_tmp: Path, tmp_path: Path) -> None:
    checked: set[tuple[str, ...]] = set()

    def run(*words: str, rcs: tuple[int, ...] = (0,)) -> Any:
        cmd = tuple(w for w in words if not w.startswith("-") and not w[0].isdigit())
        out = cli(*words, "--json", *conn, timeout=120)
        assert out.returncode in rcs, (words, out.stderr)
        checked.add(cmd[:2] if cmd[0] in ("ckpt", "spikes") else cmd[:1])
        return out.stdout

    state = short_tmp / f"json-{uuid.uuid4().hex[:6]}"
    memory = default_shm_root(state)
    job = job_id("json")
    try:
        with AgentProcess(state, "--metrics-listen", "off") as agent:
            conn = ["--socket", str(agent.socket)]
            ranks = [CheckpointClient.connect(job, r, 2, target=agent.target, deadline_s=10,
                                              config=SnapshotConfig(chunk_bytes=4096)) for r in (0, 1)]
            try:
                assert all(c.save(1, state_dict(c.rank, 1)).result(30).error == "" for c in ranks)
            finally:
                for c in ranks:
                    c.close()
            with grpc.insecure_channel(agent.target) as ch:   # an event whose details hold a rank
                apb_grpc.AgentStub(ch).ReportStep(apb.ReportStepRequest(job_id=job, rank=1, world_size=2, step=2,
                                                                         loss=float("nan")), timeout=10)

            st = json.loads(run("status", rcs=(0, 1, 3)))   # 3: no NVML here, GPUs UNKNOWN
            conforms(apb.GetStatusResponse.DESCRIPTOR, st)
            assert st["node_state"] in ("unknown", "healthy", "suspect")
            events = [json.loads(ln) for ln in run("events").splitlines()]
            assert len(events) >= 2
            for e in events:
                conforms(apb.Event.DESCRIPTOR, e)
            assert events[0]["seq"] == 1 and events[0]["severity"] == "info"
            assert type(events[0]["details"]["pid"]) is int
            nonfinite = [e for e in events if e["kind"].startswith("loss.nonfinite")]
            assert nonfinite and nonfinite[0]["severity"] in ("warning", "critical")
            ls = json.loads(run("ckpt", "ls", "--job", job))
            for i in ls["checkpoints"]:
                conforms(cpb.CheckpointInfo.DESCRIPTOR, i)
            assert [(i["step"], i["state"]) for i in ls["checkpoints"]] == [(1, "committed")]
            conforms(cpb.CheckpointInfo.DESCRIPTOR, json.loads(run("ckpt", "show", "1", "--job", job)))
            for t in json.loads(run("ckpt", "tiers"))["tiers"]:
                conforms(cpb.TierStatus.DESCRIPTOR, t)
            ver = json.loads(run("ckpt", "verify", "1", "--job", job))
            assert ver["ok"] is True and ver["checks"]
            for c in ver["checks"]:
                conforms(cpb.CopyCheck.DESCRIPTOR, c)
            drained = json.loads(run("ckpt", "drain", "--job", job))   # the default NVMe tier (state dir)
            assert drained["ok"] is True and [t["tier"] for t in drained["tiers"]] == ["nvme"]
            for h in drained["hops"]:
                conforms(cpb.DrainHop.DESCRIPTOR, h)
            for t in drained["tiers"]:
                conforms(cpb.TierStatus.DESCRIPTOR, t)
            with grpc.insecure_channel(agent.target) as ch:   # what drives `verify`'s bar: updates per chunk
                updates = list(cpb_grpc.CheckpointsStub(ch).WatchVerifyCopies(
                    cpb.VerifyCopiesRequest(job_id=job, step=1), timeout=60))
            assert [u.WhichOneof("update") for u in updates][-1] == "result"
            done = [(u.progress.done_bytes, u.progress.total_bytes) for u in updates[:-1]]
            assert done and done == sorted(done) and done[-1][0] == done[-1][1] > 0
            result = updates[-1].result
            assert len(result.checks) == len(ver["checks"]) and all(c.ok for c in result.checks)
    finally:
        shutil.rmtree(memory.parent, ignore_errors=True)
    conn = []
    log = tmp_path / "train.csv"
    log.write_text("step,loss\n" + "".join(f"{i},{3.0 - i * 0.001:.4f}\n" for i in range(1, 300))
                   + "300,40.0\n" + "".join(f"{i},{2.7:.4f}\n" for i in range(301, 330)))
    lines = run("spikes", "replay", str(log)).splitlines()   # a spike that recovers: warnings, exit 0
    assert lines
    for line in lines:
        e = json.loads(line)
        assert e["severity"] in ("info", "warning", "critical") and type(e["step"]) is int, e
    report = json.loads(run("canary", "--level", "tiny", "--device", "cpu"))
    # the canary's report keeps its own words (PASS / FAIL / UNKNOWN: evidence files share them; docs/json.md)
    assert report["status"] in ("PASS", "FAIL", "UNKNOWN") and type(report["exit_code"]) is int
    assert checked == _json_commands(), _json_commands() ^ checked
