"""What every `sdcwatch` client command shares: the parser class, the agent-connection flags and the client
they build, the error exits, and the table / age formatting.

    p = sub.add_parser("thing", help="...")
    cli_common.add_connection_flags(p)
    ...
    client = cli_common.connect(args)          # exits 2 with a message if the flags cannot make a channel

Exit codes: 0 success; 1 unhealthy / not found / a failed check; 2 bad usage, a bad config, or the agent
cannot be reached.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from typing import Callable, Iterator, NoReturn

import grpc

from daemon.client import AgentClient
from sdcwatch.channels import agent_channel, read_token
from sdcwatch.paths import locate_socket

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2
EXIT_UNKNOWN = 3  # `sdcwatch status`: no evidence to judge by (node-problem-detector's "unknown")


class Parser(argparse.ArgumentParser):
    """argparse with one error format: usage, then `sdcwatch: error: ...`, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"sdcwatch: error: {message}\n")


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say how to reach the agent (read by `connect`)."""
    g = p.add_argument_group("agent connection")
    g.add_argument("--state-dir", help="the agent's state dir, as given to `sdcwatch run --state-dir` (its socket "
                   "is DIR/agent.sock; default $SDCWATCH_STATE_DIR, else the agent's default)")
    g.add_argument("--socket", help="the agent's unix socket (default: DIR/agent.sock of --state-dir, else "
                   "$SDCWATCH_SOCKET, else the state dir's)")
    g.add_argument("--address", help="HOST:PORT of an agent serving TCP with TLS")
    g.add_argument("--tls-ca", help="CA bundle to verify the agent's certificate (default: the system roots)")
    g.add_argument("--tls-server-name", help="expected name in the agent's certificate")
    g.add_argument("--token-file", help="file holding the bearer token (TCP only)")
    g.add_argument("--insecure", action="store_true", help="plain TCP (no TLS): only for testing")
    g.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default 5)")


def connect(args: argparse.Namespace) -> AgentClient:
    """A client for the agent named by the connection flags; exits 2 with the reason when they are wrong.
    `--address` wins over `--socket` and `--state-dir`; the socket is found by `sdcwatch.paths.locate_socket`
    (the rule the agent chose it by), and when no socket is there it exits 2 saying where it looked.
    The channel rules are `sdcwatch.channels.agent_channel`'s."""
    try:
        token = read_token(args.token_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(fail(f"cannot read --token-file: {exc}"))
    try:
        if args.address:
            where = args.address
            channel = agent_channel(args.address, tls_ca=args.tls_ca, tls_server_name=args.tls_server_name,
                                    token=token, insecure=args.insecure)
        else:
            located = locate_socket(args.socket, args.state_dir)
            where = located.describe()
            if not located.path.exists():
                raise SystemExit(fail(f"cannot reach the agent: no socket at {where}; {NO_AGENT_HINT}"))
            channel = agent_channel(located.path)   # a unix socket: no TLS, no token
    except (ValueError, OSError) as exc:
        raise SystemExit(fail(str(exc)))
    return AgentClient(channel, timeout_s=args.timeout, where=where)


NO_AGENT_HINT = ("start one with `sdcwatch run`, or say where it runs: --state-dir DIR (as given to `sdcwatch "
                 "run`), --socket PATH, $SDCWATCH_STATE_DIR or $SDCWATCH_SOCKET")


def fail(message: str) -> int:
    """Print `sdcwatch: message` to stderr; returns EXIT_USAGE (2)."""
    print(f"sdcwatch: {message}", file=sys.stderr)
    return EXIT_USAGE


def rpc_error(exc: grpc.RpcError, what: str, where: str = "") -> int:
    """Print why the RPC `what` failed (to the agent at `where`, as `AgentClient.where` says); returns
    EXIT_USAGE (an unreachable agent is a usage problem here)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else exc
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        at = f" at {where}" if where else ""
        return fail(f"cannot reach the agent{at} ({what}): {details}; {NO_AGENT_HINT}")
    return fail(f"{what}: {code.name if code is not None else 'ERROR'}: {details}")


def ago(t: float, now: float) -> str:
    """'12s ago', '5m ago', '3.2h ago'; 'never' for 0."""
    if not t:
        return "never"
    d = max(0.0, now - t)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago" if d < 7200 else f"{d / 3600:.1f}h ago"


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart; the first row is the header."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


@contextlib.contextmanager
def progress_bar(label: str, total: int, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """`advance(nbytes)` for a rich progress bar over `total` bytes, drawn only when stdout is a terminal
    (and `enabled`); otherwise a no-op. `advance` may be called from any thread (per chunk, from the read
    pool). Lines printed meanwhile appear above the bar."""
    if not (enabled and sys.stdout.isatty()):
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    lock = threading.Lock()
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn()) as p:
        task = p.add_task(label, total=total)

        def advance(n: int) -> None:
            with lock:
                p.advance(task, n)

        yield advance


@contextlib.contextmanager
def progress_meter(label: str, enabled: bool = True) -> Iterator[Callable[[int, int, str], None]]:
    """`update(done_bytes, total_bytes, what)` for a rich progress bar fed by the agent's progress updates
    (cumulative, per chunk), drawn only when stdout is a terminal (and `enabled`); otherwise a no-op."""
    if not (enabled and sys.stdout.isatty()):
        yield lambda done, total, what: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), transient=True) as p:
        task = p.add_task(label, total=None)

        def update(done: int, total: int, what: str) -> None:
            p.update(task, completed=done, total=total or None,
                     description=f"{label}: {what}" if what else label)

        yield update


@contextlib.contextmanager
def spinner(label: str, enabled: bool = True) -> Iterator[None]:
    """A rich spinner with the elapsed time while one long call runs, only when stdout is a terminal."""
    if not (enabled and sys.stdout.isatty()):
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), "[progress.description]{task.description}", TimeElapsedColumn(),
                  transient=True) as p:
        p.add_task(label, total=None)
        yield
