"""`sdcwatch`: the agent (`run`) and its client commands.

Exit codes: 0 success / healthy; 1 the node is not healthy (`status`: the node, a GPU or a job is
SUSPECT, DEGRADED or FAILED) or a check failed; 2 bad usage, a bad config, or the agent cannot be reached;
3 (`status`) UNKNOWN: no evidence to judge the node by (no GPUs, NVML unreadable); 141 (128 + SIGPIPE, as
other shell tools) the reader of stdout went away (`sdcwatch events | head`), quietly. The table is in
docs/oncall.md ("Exit codes").
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import getpass
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from daemon import cli_canary, cli_ckpt, cli_demo, cli_json, config
from daemon.cli_common import (EXIT_OK, EXIT_UNHEALTHY, EXIT_UNKNOWN, EXIT_USAGE, Parser, add_connection_flags, ago,
                               connect, fail, rpc_error, table)
from daemon.errors import ConfigError
from probes import spikes_replay
from sdcwatch.errors import FatalError
from sdcwatch.proc import bind_to_parent
from sdcwatch.safe_fs import UnsafePathError
from sdcwatch import __version__

EXIT_BROKEN_PIPE = 141
STATE_NAMES = {0: "UNSPECIFIED", 1: "HEALTHY", 2: "SUSPECT", 3: "DEGRADED", 4: "FAILED", 5: "UNKNOWN"}
SEVERITY_NAMES = {0: "-", 1: "info", 2: "warning", 3: "critical"}
PROBE_NAMES = {0: "-", 1: "OK", 2: "FAILING", 3: "HUNG", 4: "DISABLED", 5: "PENDING"}


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, registered here: run, status, events, gpu, spikes, ckpt, canary, demo."""
    parser = Parser(prog="sdcwatch", description="Silent-data-corruption and GPU reliability monitor")
    parser.add_argument("--version", action="version", version=f"sdcwatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    run = sub.add_parser(
        "run", help="run the node agent", usage="sdcwatch run [--config FILE] [--log-level LEVEL] [--SECTION-KEY VALUE ...]",
        description="Run the node agent in the foreground. Every setting below is a key of the --config file "
                    "([section] key), a flag (--section-key; [agent] keys without the section) and an environment "
                    "variable (SDCWATCH_SECTION_KEY); a flag wins over the environment, which wins over the file. "
                    "docs/config.md lists them all.")
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                     help="the agent's log level on stderr (default INFO)")
    config.add_flags(run)
    run.set_defaults(func=cmd_run)

    st = sub.add_parser("status", help="show the node, GPUs, probes and jobs")
    st.add_argument("--json", action="store_true", help="print the full status as JSON")
    add_connection_flags(st)
    st.set_defaults(func=cmd_status)

    ev = sub.add_parser("events", help="print the event journal")
    ev.add_argument("--since", type=int, default=0, metavar="SEQ", help="events after this sequence number")
    ev.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    ev.add_argument("--json", action="store_true", help="one JSON object per line")
    ev.add_argument("--min-severity", choices=["info", "warning", "critical"], default=None,
                    help="only events at least this severe")
    ev.add_argument("--kind", action="append", default=[], help="only kinds with this prefix (repeatable)")
    add_connection_flags(ev)
    ev.set_defaults(func=cmd_events)

    gpu = sub.add_parser("gpu", help="GPU operations")
    gsub = gpu.add_subparsers(dest="gpu_command", required=True, parser_class=Parser)
    clear = gsub.add_parser("clear", help="clear a GPU's latched state (journaled with who and why)")
    clear.add_argument("uuid", help="the GPU's UUID (as `sdcwatch status` shows it)")
    clear.add_argument("--reason", required=True, help="why (journaled)")
    clear.add_argument("--who", default=None, help="who clears it (default: the login name)")
    add_connection_flags(clear)
    clear.set_defaults(func=cmd_gpu_clear)

    spikes = sub.add_parser("spikes", help="loss-spike tools")
    ssub = spikes.add_subparsers(dest="spikes_command", required=True, parser_class=Parser)
    replay = ssub.add_parser("replay", help="run the loss detector over a training log",
                             description=spikes_replay.DESCRIPTION)
    spikes_replay.add_arguments(replay)
    replay.set_defaults(func=spikes_replay.run)

    cli_ckpt.register(sub)
    cli_canary.register(sub)
    cli_demo.register(sub)

    comp = sub.add_parser("completion", help="print a shell completion script (bash or zsh)",
                          description="Print the completion script for every subcommand and flag. Activate it:\n"
                                      "  bash: eval \"$(sdcwatch completion bash)\"   (in ~/.bashrc)\n"
                                      "  zsh:  sdcwatch completion zsh > \"${fpath[1]}/_sdcwatch\"",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    comp.add_argument("shell", choices=["bash", "zsh"], help="the shell")
    comp.set_defaults(func=cmd_completion)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()   # a closed pipe shows here, not in the interpreter's exit
        return code
    except ConfigError as exc:
        print(f"sdcwatch: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # `sdcwatch events | head`: the reader left; end quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # the exit's flush has nowhere to fail
        return EXIT_BROKEN_PIPE


def cmd_completion(args: argparse.Namespace) -> int:
    """shtab writes a static script from this parser: every subcommand and flag, no Python run per TAB."""
    import shtab   # here, not at the top: every other command (and the agent) starts without it

    print(shtab.complete(build_parser(), shell=args.shell))
    return EXIT_OK


# -- run ---------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from daemon.state_dir import ensure_state_dir  # the agent's modules load only for `run`, not for the clients
    from daemon.compose import build_agent

    bind_to_parent()   # started by `sdcwatch demo` (or any starter that passes its pid): die with it
    cfg = config.build(args)  # ConfigError -> exit 2 in main
    ensure_state_dir(Path(cfg.agent.state_dir), cfg.agent.state_dir_mode(),   # ConfigError (exit 2) before
                     cfg.agent.group_id())                                   # anything is built in it
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    profile = os.environ.get("SDCWATCH_PROFILE")  # a path: write cProfile stats of the agent there on exit
    try:
        run, loop_name = _loop_runner(cfg.agent.event_loop)
        agent = build_agent(cfg, versions={"event_loop": loop_name})   # ConfigError ([peers]) -> exit 2
        if profile:
            import cProfile

            cProfile.runctx("run(agent.run())", globals(), {"run": run, "agent": agent}, filename=profile)
        else:
            run(agent.run())
    except ConfigError:
        raise   # main: exit 2 with the key and the fix
    except UnsafePathError as exc:   # a planted link, another user's dir: a setup problem, like bad config
        print(f"sdcwatch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FatalError as exc:
        print(f"sdcwatch: {exc}", file=sys.stderr)
        return 1
    except (FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError) as exc:
        return fail(f"cannot use {exc.filename}: {exc.strerror} (a configured directory: check the --state-dir "
                    "and --tiers-*-dir settings)")   # a bad setting, not a crash: exit 2, no traceback
    return EXIT_OK


def _loop_runner(kind: str) -> tuple[Callable[[Any], Any], str]:
    """(run(coroutine), name) for `agent.event_loop`. uvloop cuts grpc.aio's CPU per unary call by ~20%
    (bench/bench_agent.py prints the agent against bare servers on both loops)."""
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise FatalError("agent.event_loop = uvloop, but uvloop is not installed") from None
        else:
            return uvloop.run, f"uvloop {uvloop.__version__}"
    return asyncio.run, "asyncio"


# -- client commands ---------------------------------------------------------------------------------
def status_exit_code(node_state: int, gpu_states: list[int], job_states: Sequence[int] = ()) -> int:
    """0 healthy; 1 the node, a GPU or a job is SUSPECT/DEGRADED/FAILED; 3 UNKNOWN: the node or a GPU has no
    evidence, or there are no GPUs to judge (2, unreachable, is `rpc_error`'s)."""
    bad = (2, 3, 4)
    if node_state in bad or any(s in bad for s in gpu_states) or any(s in bad for s in job_states):
        return EXIT_UNHEALTHY
    if node_state == 5 or not gpu_states or any(s == 5 for s in gpu_states):
        return EXIT_UNKNOWN
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    client = connect(args)
    try:
        st = client.status()
    except grpc.RpcError as exc:
        return rpc_error(exc, "status", client.where)
    finally:
        client.close()
    code = status_exit_code(st.node_state, [g.state for g in st.gpus], [j.state for j in st.jobs])
    if args.json:
        print(cli_json.dump(cli_json.to_json(st)))
        return code
    print(format_status(st))
    return code


def format_status(st: Any) -> str:
    import time

    now = time.time()
    lines = [f"node {st.hostname}: {STATE_NAMES.get(st.node_state, '?')}  ({st.node_reason})",
             f"agent sdcwatch {st.versions.get('sdcwatch', '?')}, up {st.uptime_s:.0f}s, "
             f"ready={'yes' if st.ready else 'no'}, last event #{st.last_event_seq}"]
    if not st.nvml_available:
        lines.append(f"NVML: not available: {st.nvml_reason}")
    if st.gpus:
        rows = [["GPU", "UUID", "PCI", "NAME", "STATE", "REASON"]]
        for g in st.gpus:
            rows.append([str(g.index) if g.index >= 0 else "-", g.uuid, g.pci_bus_id or "-", g.name or "-",
                         STATE_NAMES.get(g.state, "?"), g.reason])
        lines += ["", table(rows)]
        for g in st.gpus:
            if g.unsupported_fields:
                lines.append(f"  {g.uuid}: not supported: {', '.join(g.unsupported_fields)}")
    if st.probes:
        rows = [["PROBE", "STATE", "LAST RUN", "RUNS", "FAILURES", "LAST ERROR"]]
        for p in st.probes:
            rows.append([p.name, PROBE_NAMES.get(p.state, "?"), ago(p.last_run, now), str(p.runs),
                         str(p.failures), p.last_error or "-"])
        lines += ["", table(rows)]
    if st.jobs:
        # COMPUTE: the compute checks' replay mode, its first word ("-": no checks); a mode with a reason
        # ("bounded: ..." says why small faults can hide, and what to set) on its own line under the table,
        # so the table stays as narrow as a terminal
        rows = [["JOB", "RANKS", "LAST STEP", "LAST REPORT", "DROPPED", "STATE", "REASON", "COMPUTE"]]
        said = []
        for j in st.jobs:
            ranks = f"{len(j.ranks)}" if len(j.ranks) > 8 else ",".join(map(str, j.ranks))
            mode, _, why = (j.compute_checks or "-").partition(":")
            rows.append([j.job_id, ranks, str(j.last_step), ago(j.last_report, now), str(j.dropped_reports),
                         STATE_NAMES.get(j.state, "?"), j.reason or "-", mode])
            if why.strip():
                said.append(f"  {j.job_id} compute checks {mode}: {why.strip()}")
        lines += ["", table(rows), *said]
    return "\n".join(lines)


def format_event(ev: Any) -> str:
    ts = dt.datetime.fromtimestamp(ev.time, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
    return f"#{ev.seq:<6} {ts} {SEVERITY_NAMES.get(ev.severity, '?'):8} {ev.kind:22} {ev.subject}: {ev.message}"


def cmd_events(args: argparse.Namespace) -> int:
    if args.since < 0:
        return fail("--since must be >= 0")
    client = connect(args)
    sev = {"info": 1, "warning": 2, "critical": 3}.get(args.min_severity or "", 0)
    try:
        for ev in client.events(since=args.since, follow=args.follow, min_severity=sev, kinds=args.kind):
            if args.json:
                print(cli_json.dump(cli_json.to_json(ev), line=True), flush=True)
            else:
                print(format_event(ev), flush=True)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED:
            return EXIT_OK
        return rpc_error(exc, "events", client.where)
    finally:
        client.close()
    return EXIT_OK


def cmd_gpu_clear(args: argparse.Namespace) -> int:
    client = connect(args)
    who = args.who or getpass.getuser()
    try:
        resp = client.clear_gpu(args.uuid, who, args.reason)
    except grpc.RpcError as exc:
        return rpc_error(exc, "gpu clear", client.where)
    finally:
        client.close()
    print(f"{args.uuid}: {STATE_NAMES.get(resp.previous)} -> {STATE_NAMES.get(resp.state)} (cleared by {who})")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
