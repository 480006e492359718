"""`sdcwatch ckpt`: the in-memory checkpoints the agent knows (sdcwatch.v1.Checkpoints).

    sdcwatch ckpt ls [--job JOB] [--json]        step, state, shards, size, age, where the copies are
    sdcwatch ckpt show STEP --job JOB [--json]   one checkpoint: every shard copy, with its location

Exit codes: 0 success; 1 no such checkpoint (`show`); 2 bad usage or the agent cannot be reached.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc
from google.protobuf import json_format

EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE = 0, 1, 2


def register(subparsers: Any) -> None:
    from daemon.cli import _client_flags, _Parser

    p = subparsers.add_parser("ckpt", help="in-memory checkpoints: list, show",
                              description="The in-memory checkpoints this agent's Redis indexes.")
    sub = p.add_subparsers(dest="ckpt_command", required=True, parser_class=_Parser)
    ls = sub.add_parser("ls", help="list checkpoints: step, state, size, where each copy is")
    ls.add_argument("--job", default="", help="only this job (default: every job)")
    ls.add_argument("--json", action="store_true", help="print JSON (one object with a list)")
    _client_flags(ls)
    ls.set_defaults(func=cmd_ls)
    show = sub.add_parser("show", help="one checkpoint: every shard copy and its location")
    show.add_argument("step", type=int)
    show.add_argument("--job", required=True)
    show.add_argument("--json", action="store_true")
    _client_flags(show)
    show.set_defaults(func=cmd_show)


def _list(args: argparse.Namespace, job: str) -> tuple[int, list[Any]]:
    from daemon.cli import _connect
    from proto.sdcwatch.v1 import checkpoint_pb2 as pb
    from proto.sdcwatch.v1 import checkpoint_pb2_grpc as pb_grpc

    client = _connect(args)
    try:
        resp = pb_grpc.CheckpointsStub(client.channel).List(pb.ListCheckpointsRequest(job_id=job),
                                                             timeout=args.timeout)
    except grpc.RpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            print(f"sdcwatch: cannot reach the agent (checkpoints): {exc.details()}", file=sys.stderr)
        else:
            print(f"sdcwatch: checkpoints: {code.name}: {exc.details()}", file=sys.stderr)
        return EXIT_USAGE, []
    finally:
        client.close()
    return EXIT_OK, list(resp.checkpoints)


def state_name(v: int) -> str:
    from proto.sdcwatch.v1 import checkpoint_pb2 as pb

    return pb.CheckpointState.Name(v).removeprefix("CHECKPOINT_STATE_")


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def where(info: Any) -> str:
    """'node-a (4 shards), node-b (4)': the nodes holding copies, with how many shards each."""
    count: dict[str, int] = {}
    for c in info.copies:
        count[c.node] = count.get(c.node, 0) + 1
    if not count:
        return "-"
    parts = [f"{node} ({n} shard{'s' if n != 1 else ''})" for node, n in sorted(count.items())]
    return ", ".join(parts)


def format_list(infos: list[Any], now: float) -> str:
    from daemon.cli import _ago, _table

    if not infos:
        return "no checkpoints in memory"
    rows = [["JOB", "STEP", "STATE", "SHARDS", "SIZE", "COMMITTED", "WHERE"]]
    for i in sorted(infos, key=lambda i: (i.job_id, i.step)):
        rows.append([i.job_id, str(i.step), state_name(i.state), f"{i.shards}/{i.world_size}",
                     human_bytes(i.bytes), _ago(i.committed_at, now) if i.committed_at else "-", where(i)])
    return _table(rows)


def _to_json(i: Any) -> dict[str, Any]:
    d = json_format.MessageToDict(i, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    d["state"] = state_name(i.state)
    return d


def cmd_ls(args: argparse.Namespace) -> int:
    code, infos = _list(args, args.job)
    if code != EXIT_OK:
        return code
    if args.json:
        print(json.dumps({"checkpoints": [_to_json(i) for i in infos]}, indent=1))
    else:
        print(format_list(infos, time.time()))
    return EXIT_OK


def format_show(i: Any, now: float) -> str:
    from daemon.cli import _ago, _table

    lines = [f"job {i.job_id} step {i.step}: {state_name(i.state)}",
             f"  shards {i.shards}/{i.world_size}, {human_bytes(i.bytes)} ({i.bytes} bytes)",
             f"  begun {_ago(i.begun_at, now)}, committed {_ago(i.committed_at, now)}, "
             f"verified {_ago(i.verified_at, now)}"]
    if i.reason:
        lines.append(f"  reason: {i.reason}")
    rows = [["RANK", "NODE", "LOCATION"]] + [[str(c.rank), c.node, c.location]
                                            for c in sorted(i.copies, key=lambda c: (c.rank, c.node))]
    lines.append(_table(rows) if i.copies else "  no copies recorded")
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    code, infos = _list(args, args.job)
    if code != EXIT_OK:
        return code
    hit = [i for i in infos if i.step == args.step]
    if not hit:
        have = ", ".join(str(i.step) for i in infos) or "none"
        print(f"sdcwatch: job {args.job} has no checkpoint at step {args.step} in memory (have: {have})",
              file=sys.stderr)
        return EXIT_NOT_FOUND
    if args.json:
        print(json.dumps(_to_json(hit[0]), indent=1))
    else:
        print(format_show(hit[0], time.time()))
    return EXIT_OK
