"""`sdcwatch ckpt`: the checkpoints the agent knows, in memory and on the durable tiers (sdcwatch.v1.Checkpoints).

    sdcwatch ckpt ls [--job JOB] [--json]        step, state, shards, size, age, tiers holding it, copies
    sdcwatch ckpt show STEP --job JOB [--json]   one checkpoint: every shard copy, its tier and location
    sdcwatch ckpt tiers [--json]                 each durable tier: health, backlog, what it holds
    sdcwatch ckpt verify STEP --job JOB [--json] re-read every copy on every tier, chunk checksums
                                                 (a progress bar per chunk on a terminal)
    sdcwatch ckpt drain [--job JOB] [--json]     copy this node's checkpoints to the durable tiers now and
                                                 wait (before maintenance): the tiers' pending copies and the
                                                 newest and newest VERIFIED of each job onto every tier
    sdcwatch ckpt restore TARGET --job JOB --out DIR [--rank R]
                                                 fetch a verified copy (fastest good tier first, chunk by
                                                 chunk fallback) into DIR: rank-<r>.bin + rank-<r>.json
    sdcwatch ckpt export STEP --job JOB --dcp DIR [--force] [--rank R]
                                                 write a stock torch.distributed.checkpoint directory that
                                                 `dcp.load` reads without sdcwatch installed
    sdcwatch ckpt import DIR --job JOB --step N  bring a stock DCP directory (FileSystemWriter) into the tiers
                                                 as step N: COMMITTED, never VERIFIED

Exit codes: 0 success; 1 no such checkpoint, or a bad copy found (`verify`) / no good copy (`restore`,
`export`) / a copy that failed or no durable tier configured (`drain`); 2 bad usage or the agent cannot be
reached (for `export` and `import` also: step not found, an output directory not empty without --force, a
missing, partial or non-DCP input directory).
`export` and `import` need torch; they run in a child (`python -m checkpoint.dcp_export`), so this command
never imports torch, and they run on the agent's node (they read and write its memory tier).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from checkpoint.errors import CheckpointError
from daemon import cli_json
from daemon.cli_common import (EXIT_OK, EXIT_USAGE, NO_AGENT_HINT, Parser, add_connection_flags, ago, connect,
                               fail, progress_bar, progress_meter, rpc_error, spinner, table)
from proto.sdcwatch.v1 import checkpoint_pb2 as pb
from proto.sdcwatch.v1 import checkpoint_pb2_grpc as pb_grpc
from sdcwatch.extras import available, needs
from sdcwatch.paths import locate_socket

EXIT_NOT_FOUND = 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("ckpt", help="checkpoints: list, show, tiers, verify, drain, restore",
                              description="The checkpoints this agent knows, in memory and on the durable tiers.")
    sub = p.add_subparsers(dest="ckpt_command", required=True, parser_class=Parser)
    ls = sub.add_parser("ls", help="list checkpoints: step, state, size, where each copy is")
    ls.add_argument("--job", default="", help="only this job (default: every job)")
    ls.add_argument("--json", action="store_true", help="print JSON (one object with a list)")
    add_connection_flags(ls)
    ls.set_defaults(func=cmd_ls)
    show = sub.add_parser("show", help="one checkpoint: every shard copy and its location")
    show.add_argument("step", type=int, help="the checkpoint's step")
    show.add_argument("--job", required=True, help="the job id")
    show.add_argument("--json", action="store_true", help="print JSON")
    add_connection_flags(show)
    show.set_defaults(func=cmd_show)
    tiers = sub.add_parser("tiers", help="durable tiers: health, backlog, checkpoints held")
    tiers.add_argument("--json", action="store_true", help="print JSON")
    add_connection_flags(tiers)
    tiers.set_defaults(func=cmd_tiers)
    ver = sub.add_parser("verify", help="re-check every copy of a checkpoint on every tier")
    ver.add_argument("step", type=int, help="the checkpoint's step")
    ver.add_argument("--job", required=True, help="the job id")
    ver.add_argument("--json", action="store_true", help="print JSON")
    ver.add_argument("--no-progress", action="store_true",
                     help="no progress bar (there is one, per chunk read, only when stdout is a terminal)")
    add_connection_flags(ver)
    ver.set_defaults(func=cmd_verify, timeout=600.0)
    drain = sub.add_parser(
        "drain", help="copy this node's checkpoints to the durable tiers now, and wait",
        description="Copy this node's checkpoints to the durable tiers (NVMe, flash, S3) now, verified, and "
        "wait: what the tiers' policies have pending, and the newest and the newest VERIFIED checkpoint of "
        "each job onto every tier that lacks them (e.g. before maintenance). Exit 0 when every copy was made "
        "or nothing was missing, 1 when a copy failed or no tier is configured, 2 when the agent cannot be "
        "reached.")
    drain.add_argument("--job", default="", help="only this job (default: every job in this node's memory)")
    drain.add_argument("--json", action="store_true", help="print JSON")
    drain.add_argument("--no-progress", action="store_true",
                       help="no progress bar (there is one, per chunk, only when stdout is a terminal)")
    add_connection_flags(drain)
    drain.set_defaults(func=cmd_drain, timeout=3600.0)
    rest = sub.add_parser("restore", help="fetch a verified copy of a checkpoint into a directory")
    rest.add_argument("target", help="a step, 'latest' or 'latest_verified'")
    rest.add_argument("--job", required=True, help="the job id")
    rest.add_argument("--out", required=True, help="directory to write rank-<r>.bin and rank-<r>.json into")
    rest.add_argument("--rank", type=int, default=-1, help="only this rank's shard (default: every rank)")
    rest.add_argument("--no-progress", action="store_true",
                      help="no progress bar (there is one, per chunk, only when stdout is a terminal)")
    add_connection_flags(rest)
    rest.set_defaults(func=cmd_restore)
    exp = sub.add_parser("export", help="write a checkpoint as a stock DCP directory",
                         description="Write a checkpoint as a plain DCP directory (FileSystemWriter's "
                                     "format): torch.distributed.checkpoint.load reads it without sdcwatch "
                                     "installed, into any world size or sharding. Every byte is verified on "
                                     "the way out.")
    exp.add_argument("step", help="a step, 'latest' or 'latest_verified'")
    exp.add_argument("--job", required=True, help="the job id")
    exp.add_argument("--dcp", required=True, metavar="DIR", help="the directory to write (new, or empty)")
    exp.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    exp.add_argument("--rank", type=int, default=None,
                     help="a CheckpointClient checkpoint of several ranks: export this rank's state dict")
    add_connection_flags(exp)
    exp.set_defaults(func=cmd_export)
    imp = sub.add_parser("import", help="bring a stock DCP directory into the tiers as a checkpoint",
                         description="Read a directory written by torch.distributed.checkpoint.save "
                                     "(FileSystemWriter) and store it as step N of the job: COMMITTED, "
                                     "restorable with dcp.load at any world size, never VERIFIED (no watched "
                                     "step made it).")
    imp.add_argument("dir", help="the DCP directory")
    imp.add_argument("--job", required=True, help="the job id")
    imp.add_argument("--step", type=int, required=True, help="the step to store it as")
    add_connection_flags(imp)
    imp.set_defaults(func=cmd_import)


def _list(args: argparse.Namespace, job: str) -> tuple[int, list[Any]]:

    client = connect(args)
    try:
        resp = pb_grpc.CheckpointsStub(client.channel).List(pb.ListCheckpointsRequest(job_id=job),
                                                             timeout=args.timeout)
    except grpc.RpcError as exc:
        return rpc_error(exc, "checkpoints", client.where), []
    finally:
        client.close()
    return EXIT_OK, list(resp.checkpoints)


def state_name(v: int) -> str:

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
        if c.tier in ("", "memory", "peer"):
            count[c.node] = count.get(c.node, 0) + 1
    if not count:
        return "-"
    parts = [f"{node} ({n} shard{'s' if n != 1 else ''})" for node, n in sorted(count.items())]
    del parts[8:]
    return ", ".join(parts)


def format_list(infos: list[Any], now: float) -> str:

    if not infos:
        return "no checkpoints in memory"
    rows = [["JOB", "STEP", "STATE", "SHARDS", "SIZE", "COMMITTED", "TIERS", "WHERE"]]
    for i in sorted(infos, key=lambda i: (i.job_id, i.step)):
        rows.append([i.job_id, str(i.step), state_name(i.state), f"{i.shards}/{i.world_size}",
                     human_bytes(i.bytes), ago(i.committed_at, now) if i.committed_at else "-",
                     ",".join(i.tiers) or "-", where(i)])
    return table(rows)




def cmd_ls(args: argparse.Namespace) -> int:
    code, infos = _list(args, args.job)
    if code != EXIT_OK:
        return code
    if args.json:
        print(cli_json.dump({"checkpoints": [cli_json.to_json(i) for i in infos]}))
    else:
        print(format_list(infos, time.time()))
    return EXIT_OK


def format_show(i: Any, now: float) -> str:

    lines = [f"job {i.job_id} step {i.step}: {state_name(i.state)}",
             f"  shards {i.shards}/{i.world_size}, {human_bytes(i.bytes)} ({i.bytes} bytes)",
             f"  begun {ago(i.begun_at, now)}, committed {ago(i.committed_at, now)}, "
             f"verified {ago(i.verified_at, now)}"]
    if i.vouched_by:
        lines.append(f"  vouched by: {i.vouched_by}")
    if i.reason:
        lines.append(f"  reason: {i.reason}")
    if i.tiers:
        lines.append(f"  held on: {', '.join(i.tiers)}")
    rows = [["RANK", "TIER", "NODE", "LOCATION"]] + [[str(c.rank), c.tier or "memory", c.node, c.location]
                                                    for c in i.copies]
    lines.append(table(rows) if i.copies else "  no copies recorded")
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
        print(cli_json.dump(cli_json.to_json(hit[0])))
    else:
        print(format_show(hit[0], time.time()))
    return EXIT_OK


def _rpc(args: argparse.Namespace, name: str, request: Any) -> tuple[int, Any]:

    client = connect(args)
    try:
        return EXIT_OK, getattr(pb_grpc.CheckpointsStub(client.channel), name)(request, timeout=args.timeout)
    except grpc.RpcError as exc:
        code = rpc_error(exc, "checkpoints", client.where)
        return (EXIT_NOT_FOUND if exc.code() == grpc.StatusCode.NOT_FOUND else code), None
    finally:
        client.close()


def cmd_tiers(args: argparse.Namespace) -> int:

    code, resp = _rpc(args, "Tiers", pb.TiersRequest())
    if code != EXIT_OK:
        return code
    if args.json:
        print(cli_json.dump({"tiers": [cli_json.to_json(t) for t in resp.tiers]}))
        return EXIT_OK
    if not resp.tiers:
        print("no durable tiers configured (memory only)")
        return EXIT_OK
    rows = [["TIER", "HEALTH", "BACKLOG", "CHECKPOINTS", "SIZE", "LOCATION"]]
    for t in resp.tiers:
        rows.append([t.tier, "ok" if t.healthy else f"UNHEALTHY ({t.reason})", human_bytes(t.backlog_bytes),
                     str(t.checkpoints), human_bytes(t.bytes), t.location])
    print(table(rows))
    return EXIT_OK


def _stream(args: argparse.Namespace, name: str, request: Any, label: str) -> tuple[int, Any]:
    """Call the streaming RPC `name`: its progress updates drive a bar (per chunk, on a terminal); returns
    (exit code, the final `result`). An agent without the RPC (older) gets the unary call `fallback`."""
    client = connect(args)
    try:
        stub = pb_grpc.CheckpointsStub(client.channel)
        result = None
        with progress_meter(label, enabled=not args.no_progress) as update:
            for msg in getattr(stub, name)(request, timeout=args.timeout):
                if msg.WhichOneof("update") == "progress":
                    update(msg.progress.done_bytes, msg.progress.total_bytes, msg.progress.what)
                else:
                    result = msg.result
        if result is None:
            print(f"sdcwatch: {name}: the agent ended the call without a result", file=sys.stderr)
            return EXIT_USAGE, None
        return EXIT_OK, result
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED and name == "WatchVerifyCopies":
            with spinner(label, enabled=not args.no_progress):   # an agent older than the streaming call
                return _rpc(args, "VerifyCopies", request)
        code = rpc_error(exc, "checkpoints", client.where)
        if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
            code = EXIT_NOT_FOUND
        return code, None
    finally:
        client.close()


def cmd_verify(args: argparse.Namespace) -> int:

    code, resp = _stream(args, "WatchVerifyCopies", pb.VerifyCopiesRequest(job_id=args.job, step=args.step),
                         f"verify {args.job} step {args.step}")
    if code != EXIT_OK:
        return code
    bad = [c for c in resp.checks if not c.ok]
    if args.json:
        print(cli_json.dump({"ok": not bad, "checks": [cli_json.to_json(c) for c in resp.checks]}))
    else:
        rows = [["TIER", "RANK", "RESULT", "DETAIL", "LOCATION"]]
        for c in resp.checks:
            rows.append([c.tier, str(c.rank), "ok" if c.ok else "BAD", c.detail, c.location])
        print(table(rows))
        print(f"{len(resp.checks) - len(bad)}/{len(resp.checks)} copies good"
              + (f"; {len(bad)} BAD (restore skips them chunk by chunk)" if bad else ""))
    return EXIT_NOT_FOUND if bad else EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    """Copy this node's checkpoints to the durable tiers now, verified, and wait (before maintenance): what
    the tiers' policies have pending, and the newest and newest VERIFIED checkpoint of each job onto every
    tier. Exit 0: every copy made (or nothing was missing); 1: a copy failed, or no tier is configured."""
    what = f"job {args.job}" if args.job else "every job"
    code, resp = _stream(args, "Drain", pb.DrainRequest(job_id=args.job), f"drain {what}")
    if code != EXIT_OK:
        return code
    bad = [h for h in resp.hops if not h.ok]
    if args.json:
        print(cli_json.dump({"ok": not bad, "hops": [cli_json.to_json(h) for h in resp.hops],
                             "tiers": [cli_json.to_json(t) for t in resp.tiers]}))
        return EXIT_NOT_FOUND if bad else EXIT_OK
    if not resp.hops:
        print(f"nothing to drain: the tiers already hold what {what} has in this node's memory")
    else:
        rows = [["TIER", "JOB", "STEP", "RESULT", "SIZE", "DETAIL"]]
        for h in resp.hops:
            rows.append([h.tier, h.job_id, str(h.step), "ok" if h.ok else "FAILED", human_bytes(h.bytes),
                         "" if h.ok else h.detail])
        print(table(rows))
        print(f"{len(resp.hops) - len(bad)}/{len(resp.hops)} copies made"
              + (f"; {len(bad)} FAILED: those checkpoints are not on that tier" if bad else ""))
    for t in resp.tiers:
        if not t.healthy:
            print(f"tier {t.tier} is UNHEALTHY: {t.reason}", file=sys.stderr)
    return EXIT_NOT_FOUND if bad else EXIT_OK


def cmd_restore(args: argparse.Namespace) -> int:
    """Fetch verified shards to files with the rank-side read path (same plan, same fallback chunk by chunk,
    chunk checksums and tensor fingerprints verified on the host bytes: no torch needed)."""
    # the read path (and numpy, for the fingerprints) loads here, not for every `sdcwatch` command: a CLI
    # call that only asks the agent (status, events, ckpt ls) starts ~0.2 s sooner without it
    from checkpoint.agent_link import GrpcAgentLink
    from checkpoint.locations import dir_store_for
    from checkpoint.shard_reader import RestoreReport, copies_for, read_checked

    target: int | str = args.target
    if args.target not in ("latest", "latest_verified"):
        try:
            target = int(args.target)
        except ValueError:
            print(f"sdcwatch: restore target must be a step, 'latest' or 'latest_verified', got {args.target!r}",
                  file=sys.stderr)
            return EXIT_USAGE
    client = connect(args)
    link = GrpcAgentLink(client.channel, args.timeout)
    out = Path(args.out)
    try:
        plan = link.restore_plan(args.job, target, None if args.rank < 0 else args.rank)
        out.mkdir(parents=True, exist_ok=True)
        total = sum(s.manifest.nbytes for s in plan.shards)
        with progress_bar(f"restore {args.job}", total, enabled=not args.no_progress) as advance:
            for shard in plan.shards:
                report = RestoreReport()
                buf = bytearray(shard.manifest.nbytes)
                read_checked(shard.manifest, copies_for(shard, dir_store_for), memoryview(buf), report,
                             on_chunk=advance)
                (out / f"rank-{shard.rank:05d}.bin").write_bytes(buf)
                (out / f"rank-{shard.rank:05d}.json").write_text(shard.manifest.to_json())
                print(f"rank {shard.rank}: {human_bytes(shard.manifest.nbytes)} from {report.source or '-'}"
                      + (f" ({report.fallbacks} chunk(s) from another copy)" if report.fallbacks else ""))
    except CheckpointError as exc:
        print(f"sdcwatch: restore of job {args.job} {args.target}: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    finally:
        client.close()
    print(f"job {args.job} step {plan.checkpoint.step} ({plan.checkpoint.state}) -> {out}")
    return EXIT_OK


def _dcp_child(args: argparse.Namespace, argv: list[str]) -> int:
    """Run `python -m checkpoint.dcp_export ARGV` (torch) against the agent's local socket; its exit code."""
    if getattr(args, "address", None):
        return fail("export and import read and write the agent's memory tier: run them on its node, with "
                    "--socket or --state-dir, not --address")
    if not available("torch"):
        return fail(f"ckpt {argv[0]} {needs('torch')}")
    try:
        located = locate_socket(args.socket, args.state_dir)
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    if not located.path.exists():
        return fail(f"cannot reach the agent: no socket at {located.describe()}; {NO_AGENT_HINT}")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "checkpoint.dcp_export", *argv, "--socket", str(located.path),
           "--timeout", str(max(args.timeout, 30.0))]
    rc = subprocess.run(cmd, env=env).returncode
    return rc if rc in (0, 1, 2) else EXIT_NOT_FOUND


def cmd_export(args: argparse.Namespace) -> int:
    argv = ["export", args.step, "--job", args.job, "--dcp", str(Path(args.dcp).absolute())]
    if args.force:
        argv.append("--force")
    if args.rank is not None:
        argv += ["--rank", str(args.rank)]
    return _dcp_child(args, argv)


def cmd_import(args: argparse.Namespace) -> int:
    return _dcp_child(args, ["import", str(Path(args.dir).absolute()), "--job", args.job,
                             "--step", str(args.step)])
