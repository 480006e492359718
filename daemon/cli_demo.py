"""`sdcwatch demo`: a real small training run with the agent, injected faults, detection, rollback, report.

Starts the agent on the embedded defaults (unless `--socket` names a running one), trains a small GPT on
the Python standard library's source text with N data-parallel ranks (gloo on CPU, NCCL on GPUs), each
with the Monitor, the compute checks and in-memory checkpoints, injects the planned faults (a weight bit
flip, a wrong gradient element in one rank's backward, a corrupted data range), shows what is detected as it
happens, and writes a report (loss curve PNG, summary JSON, the event journal) into `--out`.
Exit 0 only if every injected fault was detected and training finished.

The ranks are processes (`python -m demo.worker`, the training side: torch); this command never imports
torch or the demo package. Without torch it says "needs torch: pip install 'sdcwatch[torch]'" (exit 2);
without matplotlib the report has no loss curve and says which extra draws it.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from checkpoint.shm_store import default_shm_root
from daemon.demo.report import Display, build_summary, write_report
from daemon.demo.scenario import write_scenario
from proto.sdcwatch.v1 import agent_pb2 as pb
from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
from sdcwatch.channels import agent_channel
from sdcwatch.extras import available, needs
from sdcwatch.proc import parent_env
from sdcwatch.safe_fs import remove_tree

ROOT = Path(__file__).resolve().parent.parent


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="train a small model with injected faults and show detection and rollback",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--ranks", type=int, default=3, help="data-parallel ranks (default 3)")
    p.add_argument("--out", help="report folder (default: ./sdcwatch-demo-<time>)")
    p.add_argument("--no-faults", action="store_true", help="inject nothing (a clean run detects nothing)")
    p.add_argument("--flip-step", type=int, default=60, help="step after which a weight bit flips (-1: none)")
    p.add_argument("--flip-rank", type=int, default=None, help="rank whose weights flip (default: the last)")
    p.add_argument("--compute-step", type=int, default=100, help="step whose backward computes one wrong "
                   "gradient element on one rank (-1: none)")
    p.add_argument("--compute-rank", type=int, default=0, help="rank of the compute fault (default 0)")
    p.add_argument("--bad-data-start", type=int, default=150, help="first corrupted batch (-1: none)")
    p.add_argument("--bad-data-length", type=int, default=100, help="corrupted batches in a row")
    p.add_argument("--xid-at", type=float, default=-1, help="XID 79 on one simulated GPU at this many seconds "
                   "after the agent starts (CPU runs only; -1: none)")
    p.add_argument("--ckpt-every", type=int, default=10, help="in-memory checkpoint every N steps")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--width", type=int, default=64, help="model width (default 64)")
    p.add_argument("--socket", help="use a running agent on this socket instead of starting one")
    p.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    p.add_argument("--quiet", action="store_true", help="no live display, only the summary")
    p.set_defaults(func=cmd_demo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AgentHandle:
    """The agent subprocess the demo starts (embedded Redis, temp state dir)."""

    def __init__(self, state: Path, scenario: Path | None) -> None:
        self.state = state
        self.socket = str(state / "agent.sock")
        cmd = [sys.executable, "-m", "daemon.cli", "run", "--state-dir", str(state), "--metrics-listen", "off",
               "--log-level", "WARNING", "--nvml-poll-interval-s", "0.5"]
        if scenario is not None:
            cmd += ["--nvml-scenario", str(scenario)]
        self.log = open(state.parent / "agent.log", "wb")
        # its own process group (a terminal's ^C reaches the demo, which stops the agent in order), and it dies
        # with the demo however the demo ends (SIGKILL from a CI timeout included); so does its redis-server
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=parent_env(_env()), start_new_session=True)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the agent exited with {self.proc.returncode}; see {self.state.parent / 'agent.log'}")
            if os.path.exists(self.socket):
                try:
                    with agent_channel(self.socket) as ch:
                        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
                            service="sdcwatch.v1.Agent"), timeout=1)
                        if r.status == health_pb2.HealthCheckResponse.SERVING:
                            return
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise TimeoutError("the agent did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class EventFollower(threading.Thread):
    def __init__(self, socket_path: str, on_event: Any) -> None:
        super().__init__(daemon=True, name="demo-events")
        self.socket_path = socket_path
        self.on_event = on_event
        self.events: list[dict[str, Any]] = []
        self._call: Any = None
        self.last_seq = 0

    def run(self) -> None:
        while True:
            try:
                with agent_channel(self.socket_path) as ch:
                    self._call = pb_grpc.AgentStub(ch).WatchEvents(
                        pb.WatchEventsRequest(since_seq=self.last_seq, follow=True))
                    for ev in self._call:
                        rec = json_format.MessageToDict(ev, preserving_proto_field_name=True)
                        rec["seq"] = int(rec.get("seq", 0))
                        self.last_seq = rec["seq"]
                        self.events.append(rec)
                        self.on_event(rec)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED:
                    return
                time.sleep(0.2)

    def stop(self) -> None:
        if self._call is not None:
            self._call.cancel()


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    if args.no_faults:
        return {"bitflips": [], "bad_data": [], "compute": []}
    flips, bad, compute = [], [], []
    if 0 <= args.flip_step < args.steps:
        rank = args.ranks - 1 if args.flip_rank is None else args.flip_rank
        flips.append({"step": args.flip_step, "rank": rank, "param": "", "index": 7, "bit": 21})
    if 0 <= args.bad_data_start < args.steps:
        bad.append({"start": args.bad_data_start, "length": args.bad_data_length})
    if 0 < args.compute_step < args.steps:
        compute.append({"step": args.compute_step, "rank": args.compute_rank, "value": 1e4})
    return {"bitflips": flips, "bad_data": bad, "compute": compute}


def cuda_devices(timeout_s: float = 120.0) -> int:
    """How many CUDA GPUs torch sees, asked of a child (`python -m demo.devices`): the CLI stays torch-free.
    Raises RuntimeError saying why when the child cannot answer (a broken torch or CUDA install)."""
    try:
        run = subprocess.run([sys.executable, "-m", "demo.devices"], cwd=ROOT, env=_env(), capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"python -m demo.devices did not answer within {timeout_s:.0f}s") from None
    try:
        return int(json.loads(run.stdout.strip().splitlines()[-1])["cuda_devices"])
    except (ValueError, IndexError, KeyError, TypeError):
        raise RuntimeError(f"python -m demo.devices failed (exit {run.returncode}): "
                           f"{run.stderr.strip()[-500:]}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    if args.ranks < 2:
        print("sdcwatch demo: --ranks must be at least 2 (the replica vote needs replicas)", file=sys.stderr)
        return 2
    if args.steps < 10:
        print("sdcwatch demo: --steps must be at least 10", file=sys.stderr)
        return 2
    for flag, rank in (("--flip-rank", args.flip_rank), ("--compute-rank", args.compute_rank)):
        if rank is not None and not 0 <= rank < args.ranks:
            print(f"sdcwatch demo: {flag} {rank} is not a rank of {args.ranks} (0..{args.ranks - 1})",
                  file=sys.stderr)
            return 2
    if not available("torch"):
        print(f"sdcwatch demo: {needs('torch')}", file=sys.stderr)
        return 2
    use_cuda = False
    if args.device != "cpu":
        try:
            gpus = cuda_devices()
        except RuntimeError as exc:
            print(f"sdcwatch demo: cannot ask torch for GPUs: {exc}", file=sys.stderr)
            return 2
        if args.device == "cuda" and gpus < args.ranks:
            print(f"sdcwatch demo: {args.ranks} ranks need {args.ranks} GPUs, found {gpus}", file=sys.stderr)
            return 2
        use_cuda = gpus >= args.ranks
    out = Path(args.out or f"sdcwatch-demo-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.jsonl"):
        old.unlink()
    tmp = Path(tempfile.mkdtemp(prefix="sdcw-demo-", dir="/tmp"))
    plan = _plan(args)
    display = Display(quiet=args.quiet, steps=args.steps)
    agent = None
    ranks: list[subprocess.Popen[bytes]] = []
    uuids: list[str] = []
    started = time.time()
    stop_on_signals()
    try:
        if args.socket:
            sock = args.socket
        else:
            scenario = None
            if not use_cuda:
                scenario = tmp / "scenario.json"
                xid = 79 if args.xid_at >= 0 and not args.no_faults else None
                uuids = write_scenario(scenario, args.ranks, xid=xid, xid_gpu=0, xid_at=max(0.0, args.xid_at))
                if xid:
                    plan["xid"] = {"xid": 79, "gpu_uuid": uuids[0], "at_s": args.xid_at}
            agent = AgentHandle(tmp / "state", scenario)   # tmp is the demo's own: so is the memory tier
            agent.wait_ready()
            sock = agent.socket
        display.info(f"agent ready on {sock}; training {args.steps} steps on {args.ranks} "
                     f"{'GPU' if use_cuda else 'CPU'} ranks ({'nccl' if use_cuda else 'gloo'})")
        follower = EventFollower(sock, display.event)
        follower.start()
        job_id = f"demo-{int(started)}"
        spec = {"out": str(out), "socket": sock, "job_id": job_id, "steps": args.steps,
                "ckpt_every": args.ckpt_every, "device": "cuda" if use_cuda else "cpu", "faults": plan,
                "gpu_uuids": uuids, "model": {"width": args.width, "heads": 4, "layers": 2, "context": 64},
                "seed": 0}
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps(spec))
        port = _free_port()
        for r in range(args.ranks):
            env = _env() | {"RANK": str(r), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(r),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            ranks.append(subprocess.Popen([sys.executable, "-m", "demo.worker", str(spec_path)], cwd=ROOT,
                                          env=parent_env(env), stdout=open(out / f"rank{r}.log", "wb"),
                                          stderr=subprocess.STDOUT))
        codes = display.follow_training(out / "rank0.jsonl", ranks, deadline=started + args.timeout,
                                        stopped=stop_requested)
        time.sleep(1.0)  # let the last reports and events arrive
        follower.stop()
        status = _status(sock)
        summary = build_summary(out, plan, follower.events, codes, status, started, uuids)
        write_report(out, summary, follower.events)
        display.summary(summary, out)
        if not available("matplotlib"):
            print(f"sdcwatch demo: no loss curve (loss.png): {needs('matplotlib')}", file=sys.stderr)
        return 0 if summary["ok"] else 1
    finally:
        for p in ranks:   # stopped from outside: the ranks first, then the agent (and its redis-server)
            if p.poll() is None:
                p.kill()
                p.wait()
        if agent is not None:
            agent.stop()
            # the memory tier outlives its agent (issue 21); the demo's is its own: removed with its state dir
            remove_tree(default_shm_root(tmp / "state").parent)
        shutil.rmtree(tmp, ignore_errors=True)


_STOPPED: list[int] = []   # the exit code of a stop signal received (the training loop checks it too)


def stop_on_signals() -> None:
    """SIGINT (^C), SIGTERM and SIGHUP end the demo through its `finally` (ranks killed, the agent stopped in
    order), with exit code 128 + the signal; a SIGKILL cannot be caught, and then the children's
    parent-death signal stops them. The signal is also recorded and the training loop polls for it: an
    exception raised by a handler while the main thread runs a finalizer (`__del__`) is swallowed by
    Python, and the demo then trained on to the end and exited 0 after a ^C (seen under load)."""
    def handler(signum: int, _frame: Any) -> None:
        _STOPPED.append(128 + signum)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def stop_requested() -> int | None:
    """The exit code of a stop signal received so far, or None."""
    return _STOPPED[0] if _STOPPED else None


def _status(sock: str) -> dict[str, Any]:
    try:
        with agent_channel(sock) as ch:
            st = pb_grpc.AgentStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)
        return json_format.MessageToDict(st, preserving_proto_field_name=True)
    except grpc.RpcError as exc:
        return {"error": str(exc)}
