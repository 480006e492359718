"""Checkpoint overlap (issue 21): what a checkpoint adds to a training step, side by side in one run.

    python bench/ckpt_overlap.py                               # CUDA, parts a b c d, 2 GiB state
    python bench/ckpt_overlap.py --parts d --gib 12            # part d on a 12 GiB state
    python bench/ckpt_overlap.py --device cpu --smoke          # tiny sizes, for the test suite (no claims)
    python bench/ckpt_overlap.py --parts bc --checksums source --inflight 4,2,1 --profile   # issue 21 pace
    python bench/ckpt_overlap.py --parts b --checksums source --inflight 2 --gather 256,0 --profile
                                          # gathered copies (256 MiB bounce) against one copy per tensor
    python bench/ckpt_overlap.py --parts bc --checksums source --inflight 2,1 --copy-thread 1,0 --profile
                                          # the copy thread against save() enqueueing the copies

`--profile` (part b) prints the host time of each phase of a save, medians over the timed saves
(`SaveResult.phases`): the training thread's (state(), flatten, layout/signature, buffer, fingerprint launch,
views, the copies' enqueue, submit) and the background's, wall and its thread's CPU (wall - CPU: waiting for
the copy, an RPC or the GIL). The agent runs in a process of its own (`--agent process`, as in production:
bench/ckpt_agent_proc.py); `--agent inproc` puts it in this process, as the runs before issue 21's profile
did (its commit work then runs under the training process's GIL).

Our save is `CheckpointClient(config=SnapshotConfig(...), guard=StepGuard.attach(optimizer))` with a
Coordinator (a Redis of its own) as the agent, in a process of its own by default: `save` enqueues the device-to-host copies on a
side stream into a staging slot and returns; the guard's COPIES stage makes the next `optimizer.step()`
wait for them on the device; hashing and commit run in the background.

Parts (every ratio is against a baseline measured in the same run, modes interleaved in blocks):
  a  Added step time per save: a training loop over --gib GiB of fp32 parameters (16-64 MiB tensors) with
     SGD updating them in place and a GPU "forward/backward" of --busy-ms (matmuls; default: 2x the copy,
     so the copy fits). Modes `off` and `ckpt` (a save after every step, policy skip: a save is skipped
     while the previous is still hashed/committed). Added per save = (ckpt block time - off block time) /
     saves in the block; against the pinned copy of the same bytes (target <= 5%). Then a check: the saved
     bytes equal the weights before the next update (restored and compared, for 3 saves).
  b  Every step on GPT-2 small (bf16 autocast, fp32 parameters, fused AdamW: 1.5 GB of state) for each
     --batches size: `off` against `every` (SnapshotConfig.every_step()), interleaved while the training
     runs on (no sync between blocks; each block timed on the device by events on the training's stream,
     after 3 settling steps of its mode: `interleave_running`); the overhead per step (target < 1%), paired
     by round with its 95% interval, the saves that reached COMMITTED and the skips by reason, the device's
     idle while the host runs state() + save(), and the copy time against the step time ("fits": the copy
     is shorter than a step's forward+backward).
  c  First save against steady saves: blocking time of save() for a fresh client without prepare(), with
     prepare() (the buffer made ahead, in the background), and the steady saves after.
  d  The same --gib bytes (half bf16, half fp32) saved by: ours (blocking, until the copy is done, until
     COMMITTED), DCP async_save with its default stager and with DefaultStager(pinned memory), and
     torch.save to local disk. DCP's "added" = call + wait for its staging (the weights may change only
     after).

Prints tables last. The memory dir is /dev/shm when it has room (3x the state), else a temp dir.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import gc
import inspect
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_checkpoint import make_state, start_redis  # noqa: E402
from bench.gpu_sampler import GpuSampler  # noqa: E402
from bench.paired import paired_interval  # noqa: E402
from bench.pinned_placement import (copy_beside_training, copy_into, meminfo_kb, pagemap_stats,  # noqa: E402
                                    sleep_cycles, timed)
from checkpoint.client import CheckpointClient  # noqa: E402
from checkpoint.coordinator import Coordinator, CoordinatorConfig  # noqa: E402
from checkpoint.shm_store import ShmStore  # noqa: E402
from checkpoint.snapshot import SnapshotConfig  # noqa: E402
from checksums.step_guard import StepGuard  # noqa: E402
from sdcwatch.extras import available, needs  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
Row = tuple[str, float, str]


# ------------------------------------------------------------------------------------------- harness
class Node:
    """A Redis + Coordinator + memory dir for the run: the agent in a process of its own, as in production
    (`agent="process"`: bench/ckpt_agent_proc.py, the ranks talk gRPC to it), or in this process
    (`agent="inproc"`: its commit work runs under the training process's GIL)."""

    def __init__(self, need_bytes: int, tag: str, agent: str = "process") -> None:
        self.work = Path(tempfile.mkdtemp(prefix=f"sdcw-ovl-{tag}-"))
        # the memory tier's filesystem (bench only): SDCW_BENCH_MEM_ROOT, e.g. a tmpfs mounted huge=always
        shm = Path(os.environ.get("SDCW_BENCH_MEM_ROOT", "/dev/shm"))
        root = None
        if shm.is_dir():
            st = os.statvfs(shm)
            if st.f_bavail * st.f_frsize > 3 * need_bytes:
                root = shm
        self.mem = Path(tempfile.mkdtemp(prefix=f"sdcw-ovl-{tag}-mem-",
                                         dir=str(root) if root else str(self.work)))
        self.proc, sock = start_redis(self.work, "r")
        import redis

        # one rank, no replicas: keep 2 committed, no rollback span (so slots are freed as saves go on)
        self.co = Coordinator(redis.Redis(unix_socket_path=sock), ShmStore(self.mem), node="bench",
                              location=str(self.mem),
                              config=CoordinatorConfig(keep_committed=2, rollback_span_steps=0))
        self.jobs = 0
        self.agent: subprocess.Popen | None = None
        self.target = ""
        if agent == "process":
            sock_path = self.work / "agent.sock"
            self.agent = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve().parent / "ckpt_agent_proc.py"), "--redis-socket",
                 sock, "--memory", str(self.mem), "--socket", str(sock_path)],
                stdout=subprocess.PIPE, text=True)
            assert self.agent.stdout is not None
            line = self.agent.stdout.readline()   # "ready" once serving; "" if it died (its stderr says why)
            if line.strip() != "ready":
                self.close()
                raise SystemExit(f"the bench's agent process did not start (said {line!r})")
            self.target = f"unix:{sock_path}"

    def client(self, optimizer: torch.optim.Optimizer, config: SnapshotConfig, tag: str) -> CheckpointClient:
        self.jobs += 1
        job = f"ovl-{tag}-{self.jobs}-{os.getpid()}"
        if self.target:
            return CheckpointClient.connect(job, 0, 1, target=self.target, deadline_s=60, config=config,
                                            guard=StepGuard.attach(optimizer))
        return CheckpointClient(self.co, job, 0, 1, config=config, guard=StepGuard.attach(optimizer))

    def close(self) -> None:
        if self.agent is not None:
            self.agent.terminate()
            self.agent.wait()
            self.agent = None
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.mem, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_copy_time(tensors: list[torch.Tensor], device: torch.device, repeat: int = 3) -> float:
    """Best time of a device-to-host copy of `tensors` into a reused pinned buffer (the baseline)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    times = []
    for _ in range(repeat + 1):
        sync(device)
        t0 = time.perf_counter()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            buf[off:off + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            off += n
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def interleave(modes: dict[str, Callable[[], Any]], block: int, rounds: int, device: torch.device
               ) -> dict[str, list[float]]:
    """Per mode, the per-step mean of each block (order rotated each round), each block from an idle
    device until the training's own stream has run its last step: a save's copy left running on the side
    stream after the block's last step overlaps the next step in training, so it is not charged to the
    block."""
    names = list(modes)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(block):
                modes[name]()
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            out[name].append((time.perf_counter() - t0) / block)
    return out


SETTLE = 3   # untimed steps of a mode before its block (interleave_running)


class GcPauses:
    """The collector's pauses on this process while recording, per arm (`arm` is set by the caller before
    each step): a full collection scans every tracked object, and a pause on the training thread is host
    time the step's enqueue does not get back when the host has no lead."""

    def __init__(self) -> None:
        self.arm = ""
        self.by_arm: dict[str, list[tuple[int, float]]] = {}
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.arm:
            self.by_arm.setdefault(self.arm, []).append((info["generation"], time.perf_counter() - self._t0))

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._cb)

    def row(self, tag: str, arm: str, steps: int) -> Row:
        got = self.by_arm.get(arm, [])
        full = [d for g, d in got if g == 2]
        total = sum(d for _, d in got)
        return (f"[{tag}] GC pauses in the '{arm}' arm, per step", total / max(1, steps),
                f"{len(got)} collections over {steps} steps ({len(full)} full, "
                f"{1e3 * sum(full):.1f} ms; longest {1e3 * max((d for _, d in got), default=0):.1f} ms)")


def interleave_running(modes: dict[str, Callable[[], Any]], block: int, rounds: int, device: torch.device,
                       settle: int = SETTLE) -> dict[str, list[float]]:
    """`interleave` without stopping the training: no sync between blocks, the modes switch in place as
    the loop runs on, and each block is timed on the device by an event pair on the training's stream (on
    the CPU by the clock), after `settle` untimed steps of its mode (the switch: the previous mode's last
    saves still copying and committing, the host's lead over the device rebuilt). Every timed step then
    runs as in training: the host as far ahead as it gets, the previous step's save in flight beside it.
    (A block timed from an idle device starts with the host's lead at zero, where every host cost of a
    save shows, and a device-wide sync at its end waits for the last save's copy when it was enqueued in
    time: both were in the H200 runs before this.)"""
    names = list(modes)
    cuda = device.type == "cuda"
    pairs = ([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(rounds * len(names))] if cuda else [])
    got: list[tuple[str, Any]] = []
    sync(device)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(settle):
                modes[name]()
            if cuda:
                a, b = pairs[len(got)]
                a.record()
            else:
                t0 = time.perf_counter()
            for _ in range(block):
                modes[name]()
            if cuda:
                b.record()
                got.append((name, (a, b)))
            else:
                got.append((name, time.perf_counter() - t0))
    sync(device)
    out: dict[str, list[float]] = {n: [] for n in names}
    for name, x in got:
        out[name].append((x[0].elapsed_time(x[1]) / 1e3 if cuda else x) / block)
    return out


class StepPhases:
    """The device time of a step's forward, backward and optimizer step (which, with a save in flight,
    includes the update's wait for that save's copies on the device), per arm, from event quadruples
    recorded on the training's stream (made before the timed blocks: no allocation in the step). `mark(k)`:
    0 before the forward, 1 before the backward, 2 before `optimizer.step()`, 3 after it."""

    MARKS = 4

    def __init__(self) -> None:
        self.arm = ""
        self._free: list[list[Any]] = []
        self._cur: list[Any] | None = None
        self.got: dict[str, list[list[Any]]] = {}

    def start(self, n: int) -> None:
        self._free = [[torch.cuda.Event(enable_timing=True) for _ in range(self.MARKS)] for _ in range(n)]
        self.got = {}

    def stop(self) -> None:
        self._free, self._cur, self.arm = [], None, ""

    def mark(self, k: int) -> None:
        if k == 0:
            self._cur = self._free.pop() if self._free and self.arm else None
        if self._cur is not None:
            self._cur[k].record()
            if k == self.MARKS - 1:
                self.got.setdefault(self.arm, []).append(self._cur)
                self._cur = None

    def rows(self, tag: str) -> list[Row]:
        out: list[Row] = []
        for arm, marks in self.got.items():
            fw = [m[0].elapsed_time(m[1]) / 1e3 for m in marks]
            bw = [m[1].elapsed_time(m[2]) / 1e3 for m in marks]
            fb = [m[0].elapsed_time(m[2]) / 1e3 for m in marks]
            up = [m[2].elapsed_time(m[3]) / 1e3 for m in marks]
            out.append((f"[{tag}] device: forward+backward, '{arm}' arm (median)", statistics.median(fb),
                        f"mean {1e3 * statistics.fmean(fb):.3f} ms over {len(fb)} steps (forward "
                        f"{1e3 * statistics.median(fw):.3f} ms, backward {1e3 * statistics.median(bw):.3f} ms: "
                        "medians; the save's copies run beside the forward first)"))
            out.append((f"[{tag}] device: optimizer step, '{arm}' arm (median)", statistics.median(up),
                        f"mean {1e3 * statistics.fmean(up):.3f} ms, largest {1e3 * max(up):.3f} ms (with a save: "
                        "its wait for the copies of the tensors it changes)"))
        return out


# ------------------------------------------------------------------------------------------- part a
def busy_fn(device: torch.device, ms: float) -> Callable[[], None]:
    """A GPU 'forward/backward' of about `ms` (bf16 matmuls), calibrated here."""
    n = 4096 if device.type == "cuda" else 64
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)

    def once(k: int) -> None:
        for _ in range(k):
            torch.mm(a, b)

    sync(device)
    t0 = time.perf_counter()
    once(20)
    sync(device)
    per = max((time.perf_counter() - t0) / 20, 1e-6)
    k = max(1, round(ms / 1e3 / per))
    return lambda: once(k)


def part_a(args: argparse.Namespace, device: torch.device) -> list[Row]:
    nbytes = int(args.gib * GiB)
    per = 64 * MiB if nbytes >= 4 * GiB else 16 * MiB
    params = [torch.nn.Parameter(torch.randn(max(1, min(per, nbytes - i)) // 4, device=device))
              for i in range(0, nbytes, per)]
    for p in params:
        p.grad = torch.full_like(p, 1e-6)
    opt = torch.optim.SGD(params, lr=1.0)
    t_copy = pinned_copy_time(params, device)
    busy_ms = args.busy_ms if args.busy_ms > 0 else max(1.0, 2e3 * t_copy)
    busy = busy_fn(device, busy_ms)
    node = Node(nbytes, "a", args.agent)
    rows: list[Row] = []
    try:
        client = node.client(opt, SnapshotConfig(policy="skip", fingerprint_threads=args.fp_threads), "a")
        sd = {f"p{i}": p for i, p in enumerate(params)}

        def step_off() -> None:
            busy()
            opt.step()

        saves: list[Any] = []
        blocking: list[float] = []

        def step_ckpt() -> None:
            busy()
            opt.step()
            t0 = time.perf_counter()
            h = client.save(client.guard.step, sd)
            blocking.append(time.perf_counter() - t0)
            if h is not None:
                saves.append(h)

        client.prepare(sd).result(600)
        for _ in range(args.warmup):
            step_ckpt()
        client.wait(600)
        sync(device)
        saves.clear()
        blocking.clear()
        counted: dict[str, int] = {}
        times: dict[str, list[float]] = {"off": [], "ckpt": []}
        for r in range(args.rounds):   # per round: how many saves the ckpt block made
            n0 = len(saves)
            got = interleave({"off": step_off, "ckpt": step_ckpt} if r % 2 == 0 else
                             {"ckpt": step_ckpt, "off": step_off}, args.block, 1, device)
            for k, v in got.items():
                times[k] += v
            counted[f"r{r}"] = len(saves) - n0
        client.wait(600)
        results = [h.result(600) for h in saves]
        committed = sum(1 for res in results if res.state in ("COMMITTED", "VERIFIED"))
        per_round = [(c - o) * args.block / max(1, n) for c, o, n in
                     zip(times["ckpt"], times["off"], counted.values())]
        added = statistics.median(per_round)
        off_step = statistics.median(times["off"])
        rows += [
            (f"pinned copy of the {args.gib:g} GiB (baseline)", t_copy, f"{nbytes / t_copy / 1e9:.1f} GB/s"),
            ("step without checkpoint (busy + SGD update)", off_step, f"busy {busy_ms:.1f} ms"),
            ("step with a save after it", statistics.median(times["ckpt"]), ""),
            ("added step time per save (median over rounds)", added,
             f"{100 * added / t_copy:.1f}% of the pinned copy (target <= 5%)"),
            ("  of which save() call, host (median)",
             statistics.median(blocking) if blocking else float("nan"),
             f"{100 * statistics.median(blocking) / t_copy:.1f}% of the copy" if blocking else ""),
            ("  saves made / committed / skipped", float(len(results)),
             f"{committed} committed; skipped {client.stats.skipped_by}"),
            ("  save call -> safe in node memory (median)", statistics.median(r.safe_s for r in results)
             if results else float("nan"), "from the save's return"),
            ("  save call -> COMMITTED (median)", statistics.median(r.commit_s for r in results)
             if results else float("nan"), f"{args.fp_threads} fingerprint threads"),
        ]
        rows.append(check_bytes(client, node, opt, sd, busy, device))
        client.close()
    finally:
        node.close()
    return rows


def check_bytes(client: CheckpointClient, node: Node, opt: torch.optim.Optimizer, sd: dict,
                busy: Callable[[], None], device: torch.device) -> Row:
    """3 saves: the restored bytes equal the weights before the next update (cloned on the current stream
    before save: the exact values the copy must read); a step right after each save races it if nothing
    orders them."""
    ok = 0
    for _ in range(3):
        client.wait(600)
        busy()
        opt.step()
        ref = {k: v.detach().clone() for k, v in sd.items()}
        step = client.guard.step
        h = client.save(step, sd)
        busy()
        opt.step()                      # the next update: waits for the copy on the device
        res = h.result(600) if h is not None else None
        if res is None or res.error:
            return ("saved bytes == weights before the next update", float("nan"),
                    f"FAILED: {res.error if res else 'skipped'}")
        got = client.restore(step, device=device, resume=False)   # a look: the run goes on
        ok += all(torch.equal(got[k], ref[k]) for k in ref)
    return ("saved bytes == weights before the next update", float(ok), f"{ok}/3 identical")


# ------------------------------------------------------------------------------------------- part b
def part_b(args: argparse.Namespace, device: torch.device) -> list[Row]:
    from bench.tiny_gpt import GPTConfig, TinyGPT

    cfg = GPTConfig(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq)
    rows: list[Row] = []
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
           else torch.autocast("cpu", dtype=torch.bfloat16, enabled=False))
    gen = torch.Generator(device=device).manual_seed(1)
    phases = StepPhases()
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731

    for batch in args.batches:
        x = torch.randint(0, cfg.vocab, (batch, cfg.seq), device=device, generator=gen)

        def fwd_bwd(mark: Callable[[int], None] = lambda k: None) -> None:
            mark(0)
            with amp:
                loss = model(x, x)
            mark(1)
            loss.backward()
            mark(2)

        def step_off() -> None:
            fwd_bwd(phases.mark)
            opt.step()
            phases.mark(3)
            opt.zero_grad(set_to_none=True)

        step_off()   # the optimizer's state exists from here
        tensors = [t for t in _tensors(state())]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        t_copy = pinned_copy_time(tensors, device)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(3):
            fwd_bwd()
        sync(device)
        t_fb = (time.perf_counter() - t0) / 3
        opt.zero_grad(set_to_none=True)
        # --one-node: every mode of this batch on one agent and memory dir (each mode still its own client
        # and slot ring); otherwise a node per mode
        shared = Node(nbytes, "b", args.agent) if args.one_node else None
        try:
            for mode, inflight, gather, copy_thread, interval, gc_mode, prio, index in itertools.product(
                    args.checksums, args.inflight, args.gather, args.copy_thread, args.switch_interval, args.gc,
                    args.side_priority, args.side_index):
                old = sys.getswitchinterval()
                if interval > 0:   # the GIL's switch interval for this mode (both its arms)
                    sys.setswitchinterval(interval)
                try:
                    got = _part_b_mode(args, device, opt, state, step_off, batch, mode, nbytes, t_copy, t_fb,
                                       inflight, gather, bool(copy_thread), gc_mode, phases, prio, shared,
                                       index)
                finally:
                    sys.setswitchinterval(old)
                what = f"GIL switch {1e3 * interval:g} ms" if interval else "GIL switch Python's"
                what += "" if gc_mode == "on" else f", gc {gc_mode}"
                what += "" if prio is None else f", side stream priority {prio}"
                what += "" if index is None else f", side stream pool index {index}"
                rows += [(n.replace("] ", f", {what}] ", 1), v, note) for n, v, note in got]
        finally:
            if shared is not None:
                shared.close()
    return rows


def _part_b_mode(args: argparse.Namespace, device: torch.device, opt: torch.optim.Optimizer,
                 state: Callable[[], dict], step_off: Callable[[], None], batch: int, mode: str, nbytes: int,
                 t_copy: float, t_fb: float, inflight: int = 4, gather_mib: int = 256,
                 copy_thread: bool = True, gc_mode: str = "on", phases: StepPhases | None = None,
                 side_priority: int | None = None, shared: Node | None = None,
                 side_index: int | None = None) -> list[Row]:
    """Part b with one `SnapshotConfig.checksums` mode: "source" (fingerprints at the source, nothing hashed
    on the host to commit) or "host" (the rank hashes the landed bytes: the old path), and one
    `max_inflight` (1: one save in the background at a time, the path before pipelining), and one
    `gather_bytes` (MiB; 0: one device-to-host copy per tensor), and `copy_thread` (the copies the update
    waits for enqueued by the snapshotter's copy thread, or by save() on the training thread); `gc_mode`
    "freeze": everything alive after the warm-up moved out of the collector's scans (gc.freeze(), as
    training loops that manage the collector do), "on": as the process has it."""
    rows: list[Row] = []
    tag = f"b={batch}, {mode}, {inflight} in flight, " + (f"gather {gather_mib} MiB" if gather_mib else
                                                          "per-tensor copies")
    tag += ", copy thread" if copy_thread else ", enqueued by save()"
    node = shared if shared is not None else Node(nbytes, "b", args.agent)
    try:
        cfg_every = SnapshotConfig.every_step(fingerprint_threads=args.fp_threads, checksums=mode,
                                              max_inflight=inflight, gather_bytes=gather_mib * MiB,
                                              copy_thread=copy_thread)
        client = node.client(opt, cfg_every, f"b{batch}{mode[0]}")
        handles: list[Any] = []

        calls: list[float] = []
        saved_calls: list[float] = []   # the calls that copied (not skipped): like for like across settings

        state_calls: list[float] = []
        # CUDA, the timed blocks' steps: an event pair on the training's stream around state() + save() (made
        # before the blocks: no allocation in the step). The device reaches the second right after the first
        # when the host was ahead of it; the time between them is the device idle while the host ran them
        marks: list[tuple[Any, Any]] = []
        marked: list[tuple[Any, Any]] = []

        def step_every() -> None:
            step_off()
            pair = marks.pop() if marks else None
            if pair is not None:
                pair[0].record()
            t0 = time.perf_counter()
            sd = state()
            t1 = time.perf_counter()
            h = client.save(client.guard.step, sd)
            calls.append(time.perf_counter() - t0)
            if pair is not None:
                pair[1].record()
                marked.append(pair)
            if h is not None:
                saved_calls.append(calls[-1])
                state_calls.append(t1 - t0)
                handles.append(h)

        if (side_priority is not None or side_index is not None) and device.type == "cuda":
            # the save's side stream, made here: with this priority, or torch's pool stream at this index
            dev = torch.device("cuda", torch.cuda.current_device())
            client.snapshotter._side[dev] = pool_stream(dev, side_priority or 0, side_index)
        client.prepare(state()).result(600)
        slot_uses = _count_slot_uses(client)
        for _ in range(args.warmup):
            step_off()
            step_every()
        client.wait(600)
        spares = client.snapshotter._spare_fut   # pipelined: the ring's spare slots made before measuring
        if spares is not None:
            spares.result(600)
        huge_kb = meminfo_kb("ShmemHugePages")   # the ring made (the warm-up's saves and the spares)
        handles.clear()
        calls.clear()
        if device.type == "cuda":
            marks[:] = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range((args.block + SETTLE) * args.rounds)]
        saved_calls.clear()
        state_calls.clear()
        skipped0 = dict(client.stats.skipped_by)
        made0 = client.stats.slots_ahead + client.stats.slots_inline
        waits0 = (client.stats.update_waits, client.stats.update_wait_s)
        if gc_mode == "freeze":
            gc.collect()
            gc.freeze()
        pauses = GcPauses()

        cuda_phases = phases if phases is not None and device.type == "cuda" else None
        if cuda_phases is not None:
            cuda_phases.start(2 * args.rounds * (args.block + SETTLE))

        sampler = GpuSampler(torch.cuda.current_device()) if device.type == "cuda" else None

        def arm(name: str, fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                pauses.arm = name
                if sampler is not None:
                    sampler.arm = name
                if cuda_phases is not None:
                    cuda_phases.arm = name
                fn()
            return run

        cpu0 = _host_cpu(node)
        with pauses, sampler if sampler is not None else contextlib.nullcontext():
            times = interleave_running({"off": arm("off", step_off), "every": arm("every", step_every)},
                                       args.block, args.rounds, device)
        cpu1 = _host_cpu(node)
        if cuda_phases is not None:
            cuda_phases.stop()
        if gc_mode == "freeze":
            gc.unfreeze()
        client.wait(600)
        attempts = len(calls)             # every save() call of the timed blocks (their settling steps too)
        sync(device)
        idle_at_save = [a.elapsed_time(b) / 1e3 for a, b in marked]
        marks.clear()                     # the diagnosis's steps after this are not timed so
        waits = (client.stats.update_waits - waits0[0], client.stats.update_wait_s - waits0[1])
        timed = list(handles)
        made = client.stats.slots_ahead + client.stats.slots_inline - made0   # steady state: 0
        skipped = {k: v - skipped0.get(k, 0) for k, v in client.stats.skipped_by.items()
                   if v - skipped0.get(k, 0)}
        host_rows = _host_bound_rows(tag, step_off, step_every, device, args.block) if args.diagnose else []
        gpu_rows = _gpu_profile_rows(tag, step_off, step_every, device, args.block) if args.diagnose else []
        client.wait(600)
        results = [h.result(600) for h in timed]
        committed = sum(1 for r in results if r.state in ("COMMITTED", "VERIFIED"))
        host_work = [r.host_s for r in results]
        host_cpu = [r.cpu_s for r in results]
        off = statistics.median(times["off"])
        every = statistics.median(times["every"])
        over = (every - off) / off
        ratios = [e / o for e, o in zip(times["every"], times["off"])]   # block k of each mode: round k
        lo, hi = paired_interval(ratios)
        fits = "fits" if t_copy < t_fb else "does NOT fit"
        rows += [
            (f"[{tag}] step, no checkpoint", off, f"fwd+bwd {t_fb * 1e3:.1f} ms; state "
             f"{nbytes / 1e9:.2f} GB"),
            (f"[{tag}] step, checkpoint every step", every,
             f"{100 * over:+.2f}% of the step (target < 1%); paired by round: median "
             f"{100 * (statistics.median(ratios) - 1):+.2f}%, mean {100 * (statistics.fmean(ratios) - 1):+.2f}% "
             f"[{100 * lo:+.2f}, {100 * hi:+.2f}] (95%, {len(ratios)} rounds: "
             + " ".join(f"{100 * (x - 1):+.1f}" for x in ratios) + ")"),
            (f"[{tag}] state() + save() call, host (median)", statistics.median(calls) if calls else float("nan"),
             f"{100 * statistics.median(calls) / off:.2f}% of the step (the training thread's share)"
             if calls else ""),
            (f"[{tag}] state() + save() call that saved (median)",
             statistics.median(saved_calls) if saved_calls else float("nan"),
             f"{100 * statistics.median(saved_calls) / off:.2f}% of the step; {len(saved_calls)} of "
             f"{len(calls)} calls saved (a skipped call returns before walking the state)"
             if saved_calls else ""),
            (f"[{tag}] pinned copy of the state", t_copy,
             f"{t_copy / t_fb:.2f}x fwd+bwd: the copy {fits} in a step"),
            (f"[{tag}] steps whose checkpoint reached COMMITTED", committed / attempts,
             f"fraction of {attempts} steps (target 1.0); {len(results)} saves made, {committed} committed; "
             f"skipped {skipped}; at most {client.stats.most_in_flight} in flight, ring "
             f"{client.stats.ring_size} slots, {made} made while timed (steady state: 0)"),
            (f"[{tag}] staging slots made while timed", float(made),
             f"count, not seconds (steady state: 0; each is a pinned slot of {nbytes / 1e9:.2f} GB made "
             f"during training); ring {client.stats.slots} slots of {client.stats.ring_size}"),
            (f"[{tag}] background host work per save (median)",
             statistics.median(host_work) if host_work else float("nan"),
             f"{statistics.median(host_work) / off:.2f}x the step (the background keeps up when < 1); "
             f"its thread's CPU {1e3 * statistics.median(host_cpu):.1f} ms" if host_work else ""),
            (f"[{tag}] save call -> COMMITTED (median)",
             statistics.median(r.commit_s for r in results) if results else float("nan"),
             "the background's pace: one commit per this much"),
            (f"[{tag}] background: checksums + host fingerprints (median)",
             statistics.median(r.checksum_s + r.fingerprint_s for r in results) if results else float("nan"),
             "host time spent hashing per save" if mode == "host" else
             "host time combining the GPU's words" if device.type == "cuda" else
             "host: numpy over the pieces (CPU state: one pass, in the background)"),
        ]
        if idle_at_save:
            rows.append((f"[{tag}] device idle while the host ran state() + save(), per step",
                         statistics.fmean(idle_at_save),
                         f"mean (median {1e3 * statistics.median(idle_at_save):.3f} ms, largest "
                         f"{1e3 * max(idle_at_save):.3f} ms, over {len(idle_at_save)} steps): "
                         f"{100 * statistics.fmean(idle_at_save) / off:.2f}% of the step; ~0 when the host is ahead"))
        rows.append((f"[{tag}] the update's host wait for the copy thread, per step", waits[1] / max(1, attempts),
                     f"{waits[0]} of {attempts} optimizer steps waited on the host for a save's copies to be "
                     f"enqueued ({1e3 * waits[1]:.1f} ms in all; the host's lead over the device shrinks by it)"))
        rows.append((f"[{tag}] host: shmem in huge pages with the ring made (GB)", huge_kb / 1e6,
                     f"/proc/meminfo ShmemHugePages; the memory dir {node.mem}"))
        arm_steps = args.rounds * (args.block + SETTLE)
        rows += [pauses.row(tag, "off", arm_steps), pauses.row(tag, "every", arm_steps)]
        rows.append(_host_cpu_row(tag, cpu0, cpu1, 2 * arm_steps))
        if cuda_phases is not None:
            rows += cuda_phases.rows(tag)
            sides = [f"{d}: id {st.stream_id}, handle {st.cuda_stream:#x}"
                     for d, st in client.snapshotter._side.items()]
            rows.append((f"[{tag}] the save's side stream", float(len(sides)), "; ".join(sides)))
        rows.append(copy_ops_row(tag, client, state()))
        rows.append(_slot_row(tag, client, slot_uses))
        if sampler is not None:   # on CUDA
            rows += sampler.rows(tag)
            ms = torch.cuda.memory_stats()
            rows.append((f"[{tag}] device memory: the caching allocator's segments", float(ms.get("segment.all.current", 0)),
                         f"reserved {ms.get('reserved_bytes.all.current', 0) / 1e9:.2f} GB, allocated "
                         f"{ms.get('allocated_bytes.all.current', 0) / 1e9:.2f} GB, large-pool segments "
                         f"{ms.get('segment.large_pool.current', 0)}, retries {ms.get('num_alloc_retries', 0)}"))
            cuda_state = [t for t in _tensors(state()) if t.is_cuda]
            rows.append(_slot_copy_row(tag, client, cuda_state))
            rows += _beside_rows(tag, client, cuda_state, step_off, slot_uses, every_slot=args.beside_every_slot,
                                 with_fp=args.beside_fp)
        if args.toggles:   # (on CPU: the arms' code paths, for a smoke run)
            rows += _toggle_rows(tag, client, step_off, step_every, device, args.block, args.rounds, args.toggles)
        if args.after_actions:
            rows += _after_action_rows(tag, client, step_off, step_every, device, args.block, args.rounds,
                                       args.after_actions)
        if args.profile:
            rows += profile_rows(tag, results, state_calls, off)
        rows += host_rows + gpu_rows
        client.close()
    finally:
        if shared is None:
            node.close()
    return rows


def _host_cpu(node: Node) -> tuple[float, float, float, float, float]:
    """(wall, this process's CPU s, the agent process's CPU s, the host's busy CPU s, its idle CPU s)."""
    import psutil  # the bench extra: main checks for it

    def proc_s(pid: int | None) -> float:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return t.user + t.system

    host = psutil.cpu_times()
    idle = host.idle + getattr(host, "iowait", 0.0)
    return (time.perf_counter(), proc_s(None), proc_s(node.agent.pid) if node.agent else 0.0,
            sum(host) - idle - getattr(host, "guest", 0.0) - getattr(host, "guest_nice", 0.0), idle)


def _host_cpu_row(tag: str, a: tuple[float, ...], b: tuple[float, ...], steps: int) -> Row:
    """The host's CPU over the timed blocks (both arms): this process, the agent process, the whole host
    (cores busy on average): does a slow mode run beside more host work (memory traffic the copies' DMA
    competes with)?"""
    wall = b[0] - a[0]
    return (f"[{tag}] host CPU over the timed blocks, per step", (b[1] - a[1]) / max(1, steps),
            f"this process {1e3 * (b[1] - a[1]) / max(1, steps):.1f} ms a step, the agent "
            f"{1e3 * (b[2] - a[2]) / max(1, steps):.1f} ms, the host {(b[3] - a[3]) / max(wall, 1e-9):.2f} "
            f"cores busy of {((b[3] - a[3]) + (b[4] - a[4])) / max(wall, 1e-9):.1f}")


def pool_stream(dev: torch.device, priority: int = 0, index: int | None = None) -> torch.cuda.Stream:
    """A stream from torch's pool (handed out round-robin, 32 a priority): the next one, or the first at pool
    `index` (the bits above the stream id's low 5)."""
    for _ in range(64):
        st = torch.cuda.Stream(device=dev, priority=priority)
        if index is None or st.stream_id >> 5 == index:
            return st
    raise RuntimeError(f"no pool stream at index {index} in 64 tries")


def _count_slot_uses(client: CheckpointClient) -> dict[str, int]:
    """Count the saves that staged in each slot (the snapshotter's `_acquire_slot` wrapped: a bench-only
    probe), by slot file name."""
    uses: dict[str, int] = {}
    snap = client.snapshotter
    acquire = snap._acquire_slot

    def counted(total: int, create: bool = True) -> Any:
        s = acquire(total, create=create)
        if s is not None:
            uses[s.path.name] = uses.get(s.path.name, 0) + 1
        return s
    snap._acquire_slot = counted  # type: ignore[method-assign]
    return uses


def _slot_row(tag: str, client: CheckpointClient, uses: dict[str, int]) -> Row:
    """Which of the ring's slots the saves used, and each slot's physical layout (runs of contiguous
    frames, root only): does a slow mode stage in other memory than a fast one?"""
    ring = client.snapshotter._ring
    parts = []
    for i, s in enumerate(ring.slots if ring is not None else []):
        st = pagemap_stats(s.tensor.data_ptr(), s.nbytes) if s.nbytes else {}
        lay = f"{st['runs']} runs {st['phys_lo_gib']:.1f}-{st['phys_hi_gib']:.1f} GiB" if st else "layout ?"
        parts.append(f"#{i} {uses.get(s.path.name, 0)} saves, {lay}, va {s.tensor.data_ptr():#x}")
    return (f"[{tag}] staging slots: uses and layout", float(len(parts)), "; ".join(parts))


def _slot_copy_row(tag: str, client: CheckpointClient, tensors: list[torch.Tensor], repeat: int = 3) -> Row:
    """Each of the ring's free slots (not one holding a stored checkpoint) with the state's copies alone in
    it (packed, on the current stream, the training stopped; median ms): is a slow mode's staging
    memory slow by itself, or only in the save?"""
    ring = client.snapshotter._ring
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    stream = torch.cuda.current_stream()   # (no new pool stream: the next mode's side stream stays where it was)
    parts = []
    for i, s in enumerate(ring.slots if ring is not None else []):
        if s.nbytes < nbytes or not s.free():
            parts.append(f"#{i} held")
            continue
        go = copy_into(tensors, s.tensor)
        torch.cuda.synchronize()
        parts.append(f"#{i} {statistics.median(timed(go, stream) for _ in range(repeat)):.2f}")
    return (f"[{tag}] staging slots: the copy alone in each (ms)", float(len(parts)), ", ".join(parts))


def _beside_rows(tag: str, client: CheckpointClient, tensors: list[torch.Tensor], train: Callable[[], None],
                 uses: dict[str, int], repeat: int = 3, every_slot: bool = False, with_fp: bool = False
                 ) -> list[Row]:
    """Outside the save path, after the mode's timed blocks: the state's copies on the save's side stream
    beside a training step (both from a sleeping device), into one of the mode's used slots and into a
    driver-pinned buffer, with the PCIe traffic NVML sees meanwhile. Does a slow mode's staging memory slow
    the copies and the training beside them by itself, and does the GPU read host memory (PCIe rx) while
    it does? `every_slot`: each free slot of the ring in turn (its own NVML arm), not only the most used.
    `with_fp`: each also with the client's fingerprint kernels launched before the copy, on the same stream,
    as a save does (ckpt30: in a slow client those kernels bring the host-memory reads and the cost)."""
    snap = client.snapshotter
    ring = snap._ring
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    dev = tensors[0].device if tensors else torch.device("cuda")
    side = snap._side.get(dev, torch.cuda.current_stream())
    main_s = torch.cuda.current_stream()
    free = [s for s in (ring.slots if ring is not None else []) if s.nbytes >= nbytes and s.free()]
    free.sort(key=lambda s: -uses.get(s.path.name, 0))
    copies = [(f"slot {s.path.name} ({uses.get(s.path.name, 0)} saves)", copy_into(tensors, s.tensor))
              for s in (free if every_slot else free[:1])]
    if every_slot and len(free) > 1:   # as the saves do: the next slot at each copy
        turn = itertools.cycle([copy_into(tensors, s.tensor) for s in free])
        copies.append((f"the {len(free)} free slots in turn", lambda: next(turn)()))
    copies.append(("driver-pinned", copy_into(tensors, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))))
    held = snap._fp_plans.get(dev)
    if with_fp and held is not None:
        plan = held[1]

        def fp_then(copy: Callable[[], None]) -> Callable[[], None]:
            def go() -> None:
                plan.run_async()
                copy()
            return go
        copies += [(f"{name}, fingerprint kernels first", fp_then(copy)) for name, copy in list(copies)]
    cycles = sleep_cycles(90.0, main_s)
    rows: list[Row] = []
    with GpuSampler(dev.index or 0) as gs:
        for name, copy in copies:
            gs.arm = name
            cp, fb, both, cpb = copy_beside_training(copy, train, side, main_s, cycles, repeat)
            gs.arm = ""
            rows.append((f"[{tag}] outside the save: the copy beside a step, {name}", cpb / 1e3,
                         f"copy alone {cp:.2f} ms, beside a step {cpb:.2f} ms; the step alone {fb:.2f} ms, beside "
                         f"the copy {both:.2f} ms ({both - fb:+.2f})"))
    return rows + gs.rows(f"{tag}, outside the save")


TOGGLE_ARMS = ("nofp", "inflight1", "timed", "onside", "fplate", "evdefault")


def _toggle_rows(tag: str, client: CheckpointClient, step_off: Callable[[], None], step_every: Callable[[], None],
                 device: torch.device, block: int, rounds: int, which: list[str]) -> list[Row]:
    """`--toggles` (CUDA), after the mode's timed blocks, in the same client (a slow mode stays slow with its
    client): the save path with one part changed at a time, interleaved with no checkpoint, each arm with its
    PCIe traffic: no fingerprint kernels nor words (nofp), one save in flight (inflight1), the fingerprints
    timed on the device (timed: CUDA events around each save's, the median reported), the fingerprints on the
    side stream itself as before ckpt46 (onside), the fingerprint stream replaced by one made now (fplate),
    the save's events without blocking sync (evdefault: the background then spins on them). (Measured and
    removed: the copy thread and an L2 evict-first hint, ckpt30; the kernels alone, their words alone and the
    kernels after the copies, ckpt30-33; the training's stream and a lighter grid, ckpt34; the bench's own
    streams for the kernels, waited for or not, ckpt34-45, and a sweep of torch's pool streams, ckpt39-40,
    until the product took the arrangement that was fast in every client, ckpt46.)
    `which`: the arms' keys (TOGGLE_ARMS), "every" always."""
    import checkpoint.snapshot as snapmod
    snap = client.snapshotter
    cfg = snap.config
    real_fp = snapmod._enqueue_fingerprints
    real_event = snapmod._sync_event
    base = (cfg.copy_thread, cfg.max_inflight)
    cuda = device.type == "cuda"
    real_fst = snap._fp_stream(device) if cuda else None
    spans: dict[str, list[tuple[Any, Any]]] = {}   # arm -> CUDA events around each save's fingerprints
    gs = GpuSampler(device.index or 0)

    def timed(dev: torch.device, *a: Any) -> Any:
        """The real fingerprints on the current stream, between two events (kept under the arm's name)."""
        if not cuda:
            real_fp(dev, *a)
            return None
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        real_fp(dev, *a)
        e1.record()
        spans.setdefault(gs.arm, []).append((e0, e1))
        return e1

    own = torch.cuda.Stream(device=device) if cuda else None

    def no_fp(*_: Any) -> None:
        return None

    def on_side(dev: torch.device, run_pieces: Any, check: Any, fps_host: Any, fst: Any) -> None:
        """The arrangement before the fingerprint stream: the kernels on the side stream itself, ahead of the
        copies whose event the background synchronises on."""
        real_fp(dev, run_pieces, check, fps_host, torch.cuda.current_stream(dev))

    def arm(name: str, fp: Callable[..., None] | None = None, inflight: int = base[1],
            event: Callable[[], Any] | None = None, fst: Any = None) -> Callable[[], None]:
        def run() -> None:
            gs.arm = name
            cfg.copy_thread, cfg.max_inflight = base[0], inflight
            snapmod._sync_event = event or real_event
            if cuda:
                snap._fp_streams[device] = fst or real_fst
            # set for this step and left set until the next step sets its own: a save's fingerprints may be
            # enqueued by the copy thread after save() returns, which then sees this arm's (at a switch of arms,
            # the settling steps take the mix)
            snapmod._enqueue_fingerprints = fp or real_fp
            step_every()
        return run

    def off() -> None:
        gs.arm = "off"
        cfg.copy_thread, cfg.max_inflight = base
        snapmod._sync_event = real_event
        if cuda:
            snap._fp_streams[device] = real_fst
        step_off()

    # key -> (the row's text, the arm's name: GPU sampler and spans, its arguments)
    every: dict[str, tuple[str, str, dict[str, Any]]] = {
        "nofp": ("every, no fingerprint kernels nor words", "no fingerprints", {"fp": no_fp}),
        "inflight1": ("every, 1 in flight", "1 in flight", {"inflight": 1}),
        "timed": ("every, fingerprints timed", "fp timed", {"fp": timed}),
        "onside": ("every, the fingerprints on the side stream ahead of the copies (before ckpt46)",
                   "fp on side", {"fp": on_side}),
        "fplate": ("every, the fingerprint stream replaced by a stream made now", "fp late stream",
                   {"fst": own}),
        "evdefault": ("every, the save's events without blocking sync", "default events",
                      {"event": lambda: torch.cuda.Event()})}
    chosen = [every[k] for k in TOGGLE_ARMS if k in which]
    arms = {"off": off, "every": arm("every")}
    arms.update({text: arm(name, **kw) for text, name, kw in chosen})
    try:
        with gs:
            times = interleave_running(arms, block, rounds, device)
            client.wait(600)
    finally:
        snapmod._enqueue_fingerprints = real_fp
        snapmod._sync_event = real_event
        if cuda:
            snap._fp_streams[device] = real_fst
        cfg.copy_thread, cfg.max_inflight = base
    base_t = statistics.median(times["off"])
    if spans:
        torch.cuda.synchronize(device)
    notes = {name: f"; the fingerprints on the device: median {statistics.median(ms):.2f} ms, max {ms[-1]:.2f} ms "
                   f"over {len(ms)} saves"
             for name, ms in ((n, sorted(a.elapsed_time(b) for a, b in pairs)) for n, pairs in spans.items())}
    name_of = {text: name for text, name, _ in chosen}
    rows: list[Row] = [(f"[{tag}] toggled in this client: {text}", statistics.median(v),
                        f"{100 * (statistics.median(v) - base_t) / base_t:+.2f}% of the step (no checkpoint "
                        f"{1e3 * base_t:.2f} ms, {len(v)} blocks)" + notes.get(name_of.get(text, text), ""))
                       for text, v in times.items() if text != "off"]
    if cuda:
        rows.append((f"[{tag}] toggle arms' streams", 0.0,
                     f"side id {snap._side_stream(device).stream_id}, fingerprints id {real_fst.stream_id}, "
                     f"made now id {own.stream_id}"))
    return rows + gs.rows(f"{tag}, toggled")


AFTER_ACTIONS = ("replan", "reregister", "borrow")
_LAST_PLANS: dict[str, Any] = {}   # the previous mode's fingerprint plans (`borrow`)


def _after_action_rows(tag: str, client: CheckpointClient, step_off: Callable[[], None],
                       step_every: Callable[[], None], device: torch.device, block: int, rounds: int,
                       which: list[str]) -> list[Row]:
    """`--after-actions` (CUDA), after the mode's timed blocks (and toggles), in the same client: one change
    that stays, then checkpoint every step against none again, with the PCIe traffic. Where does a slow
    client's state live (ckpt30-31: its fingerprint kernels make the GPU read host memory while the copies
    run, and cost ~1.8% of the step; a fast client's do not)?
    replan: a new fingerprint plan (its anchor, work items and accumulators made again);
    reregister: every free slot unregistered and registered again (cudaHostRegister: new GPU mappings);
    borrow: the previous mode's plan (same tensors, its buffers) in this client."""
    from checkpoint.slots import register_host_memory, unregister_host_memory

    snap = client.snapshotter
    rows: list[Row] = []
    prev, _LAST_PLANS["plans"] = _LAST_PLANS.get("plans"), dict(snap._fp_plans)   # this mode's own, for the next
    for action in which:
        note = ""
        if action == "replan":
            snap._fp_plans.clear()
            note = "the plan made again at the next save"
        elif action == "reregister":
            ring = snap._ring
            done = 0
            for s in list(ring.slots if ring is not None else []):
                if s.registered and s.free():
                    unregister_host_memory(s.tensor.data_ptr())
                    s.registered = register_host_memory(s.tensor.data_ptr(), s.nbytes)
                    done += 1
            note = f"{done} free slots registered again"
        elif action == "borrow":
            if not prev:
                rows.append((f"[{tag}] after borrow: no previous mode's plan", float("nan"), ""))
                continue
            snap._fp_plans.clear()
            snap._fp_plans.update(prev)
            note = "the previous mode's plan"
        gs = GpuSampler(device.index or 0)

        def off() -> None:
            gs.arm = "off"
            step_off()

        def every() -> None:
            gs.arm = "every"
            step_every()

        with gs:
            times = interleave_running({"off": off, "every": every}, block, rounds, device)
            client.wait(600)
        o, e = statistics.median(times["off"]), statistics.median(times["every"])
        rows.append((f"[{tag}] after {action}: checkpoint every step", e,
                     f"{100 * (e - o) / o:+.2f}% of the step (no checkpoint {1e3 * o:.2f} ms); {note}"))
        rows += gs.rows(f"{tag}, after {action}")
    return rows


def copy_ops_row(tag: str, client: CheckpointClient, sd: dict) -> Row:
    """How many copy operations a save enqueues on the device: the gathered plan's (checkpoint.gather:
    chunks, large tensors copied straight, per-tensor fallbacks) or one per tensor."""
    plan = client.snapshotter._plan
    gathers = list(plan.gathers.values()) if plan is not None else []
    if gathers:
        st = gathers[-1].stats
        return (f"[{tag}] copy operations per save", float(gathers[-1].n_ops),
                f"count: {st.chunks} gathered chunks ({st.gathered_bytes / 1e9:.2f} GB, bounce "
                f"{gathers[-1].bounce_bytes / MiB:.0f} MiB), {st.direct} large tensors straight, "
                f"{st.tensors} per tensor")
    n = sum(1 for t in _tensors(sd) if t.device.type == "cuda" and t.numel())
    return (f"[{tag}] copy operations per save", float(n), "count: one per device tensor")


def profile_rows(tag: str, results: list[Any], state_calls: list[float], step: float) -> list[Row]:
    """`--profile`: the median host seconds of each phase of a save (SaveResult.phases), the training
    thread's (t.*: inside save(), after `state()`) and the background's (b.*: wall, and its thread's CPU;
    wall - CPU is waiting: for the copy, an RPC, the GIL)."""
    rows: list[Row] = [(f"[{tag}] profile: state() (model + optimizer state_dict)",
                        statistics.median(state_calls) if state_calls else float("nan"),
                        "training thread, per saving call")]
    keys: list[str] = []
    for r in results:
        keys += [k for k in r.phases if k not in keys]
    for k in keys:
        if k.endswith(".cpu"):
            continue
        vals = [r.phases.get(k, 0.0) for r in results]
        cpu = [r.phases.get(k + ".cpu", 0.0) for r in results]
        v = statistics.median(vals)
        note = f"{100 * v / step:.2f}% of a step"
        if k.startswith("b."):
            note += f"; its CPU {1e3 * statistics.median(cpu):.2f} ms"
        rows.append((f"[{tag}] profile: {'training' if k.startswith('t.') else 'background'} {k[2:]}", v,
                     note))
    t_sum = [sum(v for k, v in r.phases.items() if k.startswith("t.")) for r in results]
    b_cpu = [sum(v for k, v in r.phases.items() if k.startswith("b.") and k.endswith(".cpu")) for r in results]
    if results:
        rows += [(f"[{tag}] profile: training thread in save(), sum", statistics.median(t_sum), ""),
                 (f"[{tag}] profile: background CPU per save, sum", statistics.median(b_cpu),
                  "GIL-held Python (and C) beside the training thread")]
    return rows


def _host_bound_rows(tag: str, step_off: Callable[[], None], step_every: Callable[[], None],
                     device: torch.device, block: int) -> list[Row]:
    """`--diagnose`: is the step host-bound? Each mode's host time to enqueue one step (timed from a synced
    device, so the launch queue is empty and nothing waits on it) against the step's wall time. A step
    whose host time is near its device time has no slack: any host work (the save's Python, the GIL held
    by its background) then lands in the step."""
    rows: list[Row] = []
    for name, fn in (("off", step_off), ("every", step_every)):
        enq, wall = [], []
        for _ in range(block):
            sync(device)
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            sync(device)
            enq.append(t1 - t0)
            wall.append(time.perf_counter() - t0)
        e, w = statistics.median(enq), statistics.median(wall)
        rows.append((f"[{tag}] diagnose: host enqueue of a step, {name}", e,
                     f"{100 * e / w:.0f}% of its synced step ({1e3 * w:.1f} ms): the host's share"))
    return rows


def _gpu_profile_rows(tag: str, step_off: Callable[[], None], step_every: Callable[[], None],
                      device: torch.device, block: int, top: int = 6) -> list[Row]:
    """`--diagnose` on CUDA: where a save's cost lands (torch.profiler over one block of each mode).
    The device work it adds (kernels and copies that differ most), and the compute stream's idle time per
    step, split by cause: "host" (the next kernel was launched after the stream ran dry: the host was
    late) or "wait" (launched before: it waited on the device for something, an event, another stream)."""
    if device.type != "cuda":
        return []
    import json as _json

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    per: dict[str, dict[str, tuple[float, float]]] = {}
    idle: dict[str, tuple[float, float, list[tuple[str, float]]]] = {}
    traces: dict[str, dict] = {}
    for name, fn in (("off", step_off), ("every", step_every)):
        sync(device)
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(block):
                fn()
            sync(device)
        per[name] = {e.key[:80]: (e.self_device_time_total / 1e3 / block, e.count / block)
                     for e in prof.key_averages() if e.self_device_time_total > 0}
        trace = Path(tempfile.mkstemp(suffix=".json")[1])
        try:
            prof.export_chrome_trace(str(trace))
            traces[name] = _json.loads(trace.read_text())
            idle[name] = _stream_gaps(traces[name], block)
        finally:
            trace.unlink(missing_ok=True)
    tot = {n: sum(v[0] for v in d.values()) for n, d in per.items()}
    rows: list[Row] = [(f"[{tag}] diagnose: device time per step, {n}", tot[n] / 1e3, "all kernels and copies")
                       for n in per]
    keys = set(per["off"]) | set(per["every"])
    diff = sorted(((k, per["every"].get(k, (0.0, 0.0))[0] - per["off"].get(k, (0.0, 0.0))[0],
                    per["every"].get(k, (0.0, 0.0))[1] - per["off"].get(k, (0.0, 0.0))[1]) for k in keys),
                  key=lambda d: -abs(d[1]))
    rows += [(f"[{tag}] diagnose: every - off, {k}", ms / 1e3, f"{ms:+.3f} ms, {n:+.1f} calls a step")
             for k, ms, n in diff[:top]]
    for n, (host, wait, where) in idle.items():
        rows.append((f"[{tag}] diagnose: compute stream idle per step, {n}", (host + wait) / 1e3,
                     f"host-late {host:.3f} ms, waiting on the device {wait:.3f} ms; the largest before: " +
                     ", ".join(f"{k[:50]} {v:.2f} ms" for k, v in where[:3])))
    if "off" in traces and "every" in traces:
        rows += _slowdown_rows(tag, traces["off"], traces["every"], block)
        rows += _copy_rows(tag, traces["every"], block)
        rows += _launch_rows(tag, traces["off"], traces["every"])
    return rows


def _main_stream_work(trace: dict) -> tuple[list[dict], list[dict]]:
    """(the busiest stream's kernels, everything on the other streams), each sorted by start."""
    evs = trace.get("traceEvents", [])
    work = [e for e in evs if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy: dict[Any, float] = {}
    for e in work:
        busy[e["args"].get("stream")] = busy.get(e["args"].get("stream"), 0.0) + e.get("dur", 0.0)
    if not busy:
        return [], []
    main = max(busy, key=busy.__getitem__)
    mine = sorted((e for e in work if e["args"].get("stream") == main), key=lambda e: e["ts"])
    other = sorted((e for e in work if e["args"].get("stream") != main), key=lambda e: e["ts"])
    return mine, other


def _kernel_key(e: dict) -> tuple:
    """A kernel's name with its launch shape (one name runs many shapes: a GEMM of each layer kind)."""
    a = e.get("args", {})
    return (e["name"], tuple(a.get("grid", ()) or ()), tuple(a.get("block", ()) or ()))


def _slowdown_rows(tag: str, off: dict, every: dict, steps: int, top: int = 6) -> list[Row]:
    """`--diagnose`: where the training's own kernels run longer with saves. Each main-stream kernel of the
    `every` arm against the mean of its name and launch shape in `off`, split by what ran beside it on other
    streams: the fingerprint kernel (any overlap), the copies (over half of it), nothing. Per step, ms: how
    much of the step's extra device time each kind of overlap explains, and the kernel names that grew most."""
    base_k, _ = _main_stream_work(off)
    mine, other = _main_stream_work(every)
    if not base_k or not mine:
        return []
    durs: dict[tuple, list[float]] = {}
    for e in base_k:
        durs.setdefault(_kernel_key(e), []).append(e["dur"])
    mean_off = {k: statistics.fmean(v) for k, v in durs.items()}
    fp = [(e["ts"], e["ts"] + e["dur"]) for e in other if "fp_" in e["name"]]
    cp = [(e["ts"], e["ts"] + e["dur"]) for e in other if e.get("cat") == "gpu_memcpy"]

    def overlaps(iv: list[tuple[float, float]], a: float, b: float) -> float:
        # the share of [a, b) covered by the intervals (they do not overlap each other on one stream)
        i = max(0, bisect.bisect_left(iv, (a, a)) - 1)
        got = 0.0
        while i < len(iv) and iv[i][0] < b:
            got += max(0.0, min(b, iv[i][1]) - max(a, iv[i][0]))
            i += 1
        return got / max(b - a, 1e-9)

    cls = {"fingerprint": [0.0, 0.0, 0], "copies": [0.0, 0.0, 0], "nothing": [0.0, 0.0, 0]}
    grew: dict[str, float] = {}
    for e in mine:
        base = mean_off.get(_kernel_key(e))
        if base is None:
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        kind = ("fingerprint" if fp and overlaps(fp, a, b) > 0 else
                "copies" if cp and overlaps(cp, a, b) > 0.5 else "nothing")
        c = cls[kind]
        c[0] += e["dur"] / 1e3
        c[1] += (e["dur"] - base) / 1e3
        c[2] += 1
        grew[e["name"]] = grew.get(e["name"], 0.0) + (e["dur"] - base) / 1e3
    rows: list[Row] = []
    for kind, (t, extra, n) in cls.items():
        rows.append((f"[{tag}] diagnose: training kernels beside {kind}, per step", extra / steps / 1e3,
                     f"{extra / steps:+.3f} ms longer than in 'off' over {t / steps:.2f} ms of kernels "
                     f"({n / steps:.0f} a step)"))
    for k, ms in sorted(grew.items(), key=lambda kv: -kv[1])[:top]:
        rows.append((f"[{tag}] diagnose: kernel grew, {k[:70]}", ms / steps / 1e3, f"{ms / steps:+.3f} ms a step"))
    return rows


def _copy_rows(tag: str, trace: dict, steps: int, apart_us: float = 2000.0, small: int = 64 << 10,
               large: int = 4 << 20) -> list[Row]:
    """`--diagnose`: how a save's device-to-host copies run. The copies (off the busiest stream) grouped into
    saves (a gap of `apart_us` or more starts a new one); per save (medians): the copies, their summed
    copy-engine time, their span first start to last end, and the idle inside the span (copies trickled in
    by the host, or waiting on the stream, show as idle); per copy: the median time of a small one
    (< `small` bytes: its fixed cost) and the rate of a large one (>= `large` bytes)."""
    _, other = _main_stream_work(trace)
    cps = [e for e in other if e.get("cat") == "gpu_memcpy"]
    if not cps:
        return []
    saves: list[list[dict]] = [[cps[0]]]
    for a, b in zip(cps, cps[1:]):
        if b["ts"] - (a["ts"] + a.get("dur", 0.0)) >= apart_us:
            saves.append([])
        saves[-1].append(b)
    busy = [sum(e.get("dur", 0.0) for e in g) / 1e3 for g in saves]
    span = [(max(e["ts"] + e.get("dur", 0.0) for e in g) - g[0]["ts"]) / 1e3 for g in saves]
    count = [len(g) for g in saves]
    size = lambda e: int(e.get("args", {}).get("bytes", 0) or 0)  # noqa: E731
    small_us = [e.get("dur", 0.0) for e in cps if 0 < size(e) < small]
    large_gbs = [size(e) / e["dur"] / 1e3 for e in cps if size(e) >= large and e.get("dur", 0.0) > 0]
    med = statistics.median
    return [
        (f"[{tag}] diagnose: a save's copies, span first to last (median)", med(span) / 1e3,
         f"{med(span):.2f} ms span, {med(busy):.2f} ms copying, idle inside {med(s - b for s, b in zip(span, busy)):.2f} "
         f"ms; {med(count):.0f} copies a save, {len(saves)} saves in {steps} steps"),
        (f"[{tag}] diagnose: one small copy (< {small >> 10} KiB), median", med(small_us) / 1e6 if small_us else float("nan"),
         f"{med(small_us):.2f} us over {len(small_us)} copies" if small_us else "none"),
        (f"[{tag}] diagnose: one large copy (>= {large >> 20} MiB), rate (median)",
         med(large_gbs) if large_gbs else float("nan"),
         f"{med(large_gbs):.1f} GB/s over {len(large_gbs)} copies" if large_gbs else "none"),
    ]


def _launch_rows(tag: str, off: dict, every: dict) -> list[Row]:
    """`--diagnose`: the host's time in each launch call (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync,
    ...) per thread kind: the training's threads against the save's (the thread that enqueued most memcpys
    is the save's). Median and 90th percentile, `off` and `every`: launches held up behind another thread's
    in the driver grow here."""
    def calls(trace: dict) -> dict[tuple[str, str], list[float]]:
        evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
               and e.get("cat") in ("cuda_runtime", "cuda_driver")]
        cp_by_tid: dict[Any, int] = {}
        for e in evs:
            if "Memcpy" in e.get("name", ""):
                cp_by_tid[e.get("tid")] = cp_by_tid.get(e.get("tid"), 0) + 1
        saver = max(cp_by_tid, key=cp_by_tid.__getitem__) if cp_by_tid else None
        out: dict[tuple[str, str], list[float]] = {}
        for e in evs:
            who = "save" if saver is not None and e.get("tid") == saver else "training"
            out.setdefault((who, e["name"]), []).append(e.get("dur", 0.0))
        return out

    def q(v: list[float], f: float) -> float:
        v = sorted(v)
        return v[min(len(v) - 1, int(f * len(v)))]

    got = {"off": calls(off), "every": calls(every)}
    rows: list[Row] = []
    for key in sorted(set(got["off"]) | set(got["every"]), key=lambda k: -len(got["every"].get(k, []))):
        a, b = got["off"].get(key, []), got["every"].get(key, [])
        if len(b) < 20 and len(a) < 20:
            continue
        fmt = lambda v: f"median {q(v, 0.5):.1f} us, p90 {q(v, 0.9):.1f} us ({len(v)})" if v else "none"  # noqa: E731
        rows.append((f"[{tag}] diagnose: host launch call, {key[0]} thread, {key[1]}",
                     q(b, 0.5) / 1e6 if b else float("nan"), f"off {fmt(a)}; every {fmt(b)}"))
    return rows[:8]


def _stream_gaps(trace: dict, steps: int, least_us: float = 5.0) -> tuple[float, float, list[tuple[str, float]]]:
    """The busiest stream's idle time per step in a chrome trace (ms): (host-late, waiting, where), where
    a gap is host-late when the kernel after it was launched after the stream ran dry, and `where` lists
    the kernels the most idle time came before (ms per step)."""
    launch = {e["args"].get("correlation"): e["ts"] for e in trace.get("traceEvents", [])
              if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "args" in e}
    ks, _ = _main_stream_work(trace)
    if not ks:
        return 0.0, 0.0, []
    host = wait = 0.0
    where: dict[str, float] = {}
    for a, b in zip(ks, ks[1:]):
        gap = b["ts"] - (a["ts"] + a.get("dur", 0.0))
        if gap < least_us:
            continue
        at = launch.get(b["args"].get("correlation"))
        if at is not None and at > a["ts"] + a.get("dur", 0.0):
            host += gap
        else:
            wait += gap
        where[b["name"]] = where.get(b["name"], 0.0) + gap
    top = sorted(where.items(), key=lambda kv: -kv[1])
    return host / 1e3 / steps, wait / 1e3 / steps, [(k, v / 1e3 / steps) for k, v in top]


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    from checkpoint.state_tree import flatten

    for _, t in flatten(tree)[1]:
        yield t


# ------------------------------------------------------------------------------------------- part c
def part_c(args: argparse.Namespace, device: torch.device) -> list[Row]:
    nbytes = int(args.gib * GiB)
    sd = make_state(nbytes, device)
    params = [torch.nn.Parameter(t) for t in sd["model"].values()]
    sd["model"] = {f"p{i}": p for i, p in enumerate(params)}
    opt = torch.optim.SGD(params, lr=0.0)
    rows: list[Row] = []
    node = Node(nbytes, "c", args.agent)
    try:
        for prepared in (False, True):
            client = node.client(opt, SnapshotConfig(), f"c{int(prepared)}")
            t_prep = 0.0
            if prepared:
                t0 = time.perf_counter()
                client.prepare(sd).result(600)
                t_prep = time.perf_counter() - t0
            blk, results = _timed_saves(client, opt, sd, device, 2 + args.repeat)
            staged = [res.device_staged for res in results]
            sums = [res.checksums for res in results]
            phases = [{k: v for k, v in res.phases.items() if k.startswith("t.")} for res in results]
            steady = statistics.median(blk[2:])
            tag = "with prepare()" if prepared else "no prepare()"
            rows += [
                (f"first save blocking, {tag}", blk[0], f"{blk[0] / steady:.2f}x steady (median), "
                 f"{blk[0] / min(blk[2:]):.2f}x the fastest; where it differs: {_phase_diff(phases)}" +
                 (f"; prepare took {t_prep:.2f} s in the background" if prepared else "") +
                 ("; staged on the GPU" if staged[0] else "") + f"; checksums {sums[0]} (target <= 1.0x)"),
                (f"second save blocking, {tag}", blk[1], f"{blk[1] / steady:.2f}x steady; checksums {sums[1]}; "
                 f"where it differs: {_phase_diff(phases, 1)}"),
                (f"steady save blocking, {tag}", steady,
                 f"slots made ahead {client.stats.slots_ahead}, inline {client.stats.slots_inline}"),
            ]
            client.close()
        if args.fresh > 1:
            rows += _part_c_fresh(args, node, opt, sd, device)
        rows += _part_c_every_step(args, node, opt, sd, device)
    finally:
        node.close()
    return rows


def _phase_diff(phases: list[dict[str, float]], which: int = 0, top: int = 3) -> str:
    """The training thread's phases (`SaveResult.phases`, "t.*") where save `which` took longest over the
    steady saves' median (saves 2 on), in ms: what a first save still does that a steady one does not."""
    steady = phases[2:]
    diff = {k: v - statistics.median(p.get(k, 0.0) for p in steady) for k, v in phases[which].items()}
    worst = sorted(diff.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k[2:]} +{v * 1e3:.2f} ms" for k, v in worst if v > 0) or "nowhere"


def _timed_saves(client: CheckpointClient, opt: torch.optim.Optimizer, sd: dict, device: torch.device,
                 n: int) -> tuple[list[float], list[Any]]:
    """`n` saves one at a time, each from an idle device: how long each blocked, and each one's result."""
    blk, results = [], []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        h = client.save(client.guard.step, sd)
        blk.append(time.perf_counter() - t0)
        opt.step()          # lr 0: orders after the copy, changes nothing
        assert h is not None
        res = h.result(600)
        assert res.error == "", res.error
        results.append(res)
    return blk, results


def _part_c_fresh(args: argparse.Namespace, node: Node, opt: torch.optim.Optimizer, sd: dict,
                  device: torch.device) -> list[Row]:
    """`--fresh K`: K fresh clients with prepare(), each timing its first save and its steady saves: the
    first save over the steady median, per client, then the median and range over the K (one client's
    ratio moves by the run-to-run spread of a save of a millisecond or two)."""
    ratios, firsts, steadies = [], [], []
    for k in range(args.fresh):
        client = node.client(opt, SnapshotConfig(), f"cf{k}")
        try:
            client.prepare(sd).result(600)
            blk, _ = _timed_saves(client, opt, sd, device, 2 + args.repeat)
        finally:
            client.close()
        steady = statistics.median(blk[2:])
        ratios.append(blk[0] / steady)
        firsts.append(blk[0])
        steadies.append(steady)
    return [(f"first save over steady, with prepare(), {args.fresh} fresh clients (median)",
             statistics.median(ratios), f"ratio, not seconds; range {min(ratios):.2f}-{max(ratios):.2f}; "
             f"first {1e3 * statistics.median(firsts):.2f} ms, steady {1e3 * statistics.median(steadies):.2f} ms "
             f"(medians; target <= 1.0x)")]


def _part_c_every_step(args: argparse.Namespace, node: Node, opt: torch.optim.Optimizer, sd: dict,
                       device: torch.device) -> list[Row]:
    """Part c with `SnapshotConfig.every_step()` and no prepare(): the first call finds nothing ready, is
    skipped (counted "preparing") and has the buffers, views and plans made in the background; the first
    save made after that costs a steady one (issue 21)."""
    client = node.client(opt, SnapshotConfig.every_step(), "ce")
    try:
        sync(device)
        t0 = time.perf_counter()
        h = client.save(client.guard.step, sd)
        first = time.perf_counter() - t0
        opt.step()
        skipped = h is None
        snap = client.snapshotter
        for fut in (snap._prep, snap._plan_fut):   # what the skipped call set going, in the background
            if fut is not None:
                fut.result(600)
        blk: list[float] = []
        tries = 0
        while len(blk) < 2 + args.repeat:
            tries += 1
            if tries > 10 * (2 + args.repeat):   # never spin: a save skipped for good is a finding
                raise RuntimeError(f"every_step(): {tries} calls made {len(blk)} saves; skipped "
                                   f"{client.stats.skipped_by}")
            sync(device)
            t0 = time.perf_counter()
            h = client.save(client.guard.step, sd)
            took = time.perf_counter() - t0
            opt.step()
            if h is None:          # skipped (a buffer or the slot ring still being made): tried again once made
                client.wait(600)
                for fut in (snap._prep, snap._spare_fut):
                    if fut is not None:
                        fut.result(600)
                continue
            blk.append(took)
            res = h.result(600)
            assert res.error == "", res.error
            if snap._spare_fut is not None:   # pipelined: the ring is made once the agent's dir is known (after
                snap._spare_fut.result(600)   # the first save): the steady saves are timed without it going on
        steady = statistics.median(blk[2:])   # a typical steady save (the fastest is printed too)
        return [
            ("first call blocking, every_step(), no prepare()", first,
             f"{first / steady:.2f}x steady; " + ("skipped (counted 'preparing'), made ready in the background"
                                                  if skipped else "saved")),
            ("first save made, every_step(), no prepare()", blk[0],
             f"{blk[0] / steady:.2f}x steady (median), {blk[0] / min(blk[2:]):.2f}x the fastest (target <= 1.0x); "
             f"skipped before it {client.stats.skipped_by}"),
            ("steady save blocking, every_step()", steady, ""),
        ]
    finally:
        client.close()


# ------------------------------------------------------------------------------------------- part d
def part_d(args: argparse.Namespace, device: torch.device) -> list[Row]:
    nbytes = int(args.gib * GiB)
    sd = make_state(nbytes, device)
    tensors = list(sd["model"].values())
    params = [torch.nn.Parameter(t) for t in tensors]
    sd["model"] = {f"p{i}": p for i, p in enumerate(params)}
    opt = torch.optim.SGD(params, lr=0.0)
    tag = f"{args.gib:g} GiB"
    t_copy = pinned_copy_time(params, device)
    rows: list[Row] = [(f"[{tag}] pinned copy (baseline)", t_copy, f"{nbytes / t_copy / 1e9:.1f} GB/s")]
    node = Node(nbytes, "d", args.agent)
    disk = Path(tempfile.mkdtemp(prefix="sdcw-ovl-disk-", dir=args.disk_dir))
    try:
        # two slots: saves 2 and 3 land in slots, save 1 in the prepared private buffer (disk/shm stays bounded)
        client = node.client(opt, SnapshotConfig(fingerprint_threads=args.fp_threads, max_slots=2), "d")
        client.prepare(sd).result(600)
        res_all = []
        for _ in range(args.repeat + 1):
            sync(device)
            t0 = time.perf_counter()
            h = client.save(client.guard.step, sd)
            t_call = time.perf_counter() - t0
            opt.step()                 # what the step waits for: the copy
            sync(device)
            t_added = time.perf_counter() - t0
            res = h.result(600)
            res_all.append((t_call, t_added, res))
        steady = res_all[1:]
        rows += [
            (f"[{tag}] ours: save() call", min(c for c, _, _ in steady), "host blocking"),
            (f"[{tag}] ours: save() + update's wait for the copy", min(a for _, a, _ in steady),
             f"{min(a for _, a, _ in steady) / t_copy:.2f}x copy (no compute to hide it here)"),
            (f"[{tag}] ours: save() -> COMMITTED", min(c + r.commit_s for c, _, r in steady),
             f"first save {res_all[0][0]:.3f} s blocking"),
        ]
        client.close()
        node.close()              # our checkpoints' memory back before DCP and torch.save write theirs
        plain = detached(sd)      # what model.state_dict() hands DCP: plain tensors, not Parameters
        rows += dcp_rows(plain, disk, args.repeat, device, tag, t_copy)
        f = disk / "ts.pt"
        times = []
        for _ in range(args.repeat):
            sync(device)
            t0 = time.perf_counter()
            torch.save(plain, f)
            times.append(time.perf_counter() - t0)
            f.unlink()
        rows.append((f"[{tag}] torch.save to local disk (blocking)", min(times),
                     f"{min(times) / t_copy:.1f}x copy"))
    finally:
        node.close()
        shutil.rmtree(disk, ignore_errors=True)
    return rows


def detached(tree: Any) -> Any:
    """`tree` with every tensor detached (a Parameter becomes a plain tensor on the same storage), as
    `model.state_dict()` gives it. DCP's StateDictStager (the pinned stager) deep-copies a Parameter through
    its class, whose metaclass torch 2.11's copier table lacks (KeyError: <class 'type'>, seen on the H200)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    if isinstance(tree, dict):
        return {k: detached(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(detached(v) for v in tree)
    return tree


def dcp_rows(sd: dict, disk: Path, repeat: int, device: torch.device, tag: str, t_copy: float) -> list[Row]:
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as e:
        return [(f"[{tag}] DCP: not run ({e})", float("nan"), "")]
    kw: dict[str, Any] = {}
    if "no_dist" in inspect.signature(dcp.async_save).parameters:
        kw["no_dist"] = True
    rows: list[Row] = []
    stagers: list[tuple[str, Callable[[], Any]]] = [
        ("default stager", lambda: None),
        ("DefaultStager(pinned)", lambda: DefaultStager(StagingOptions(
            use_pinned_memory=device.type == "cuda", use_shared_memory=False, use_async_staging=True,
            use_non_blocking_copy=device.type == "cuda"))),
    ]
    for name, make in stagers:
        calls, staged, done = [], [], []
        stager = None
        try:
            stager = make()
            for i in range(repeat + 1):
                sync(device)
                t0 = time.perf_counter()
                out = dcp.async_save(sd, checkpoint_id=str(disk / f"dcp-{name[:7]}-{i}"),
                                     **({"async_stager": stager} if stager is not None else {}), **kw)
                t1 = time.perf_counter()
                staging = getattr(out, "staging_completion", None)
                upload = getattr(out, "upload_completion", out)
                if staging is not None:
                    staging.result()
                t2 = time.perf_counter()
                upload.result()
                t3 = time.perf_counter()
                calls.append(t1 - t0)
                staged.append(t2 - t0)
                done.append(t3 - t0)
                shutil.rmtree(disk / f"dcp-{name[:7]}-{i}", ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - DCP's API moves between versions: say so, go on
            where = traceback.extract_tb(e.__traceback__)[-1]
            rows.append((f"[{tag}] DCP async_save, {name}: failed ({type(e).__name__}: {str(e)[:80]})",
                         float("nan"), f"at {Path(where.filename).name}:{where.lineno} {where.name}"))
            continue
        finally:
            close = getattr(stager, "close", None)
            if close is not None:
                close()
        k = slice(1, None) if len(calls) > 1 else slice(None)
        rows += [
            (f"[{tag}] DCP async_save, {name}: call", min(calls[k]), f"first {calls[0]:.3f} s"),
            (f"[{tag}] DCP async_save, {name}: call + staging", min(staged[k]),
             f"{min(staged[k]) / t_copy:.2f}x copy: the added step time"),
            (f"[{tag}] DCP async_save, {name}: until written", min(done[k]), "local disk"),
        ]
    return rows


# ------------------------------------------------------------------------------------------- main
@dataclasses.dataclass
class Smoke:
    gib: float = 4 / 1024
    busy_ms: float = 2.0
    batches: tuple[int, ...] = (2,)
    layers: int = 1
    width: int = 32
    heads: int = 2
    vocab: int = 128
    seq: int = 16
    block: int = 3
    rounds: int = 2
    warmup: int = 2
    repeat: int = 1


def _csv(conv: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type: a side-by-side list ("a,b,c"), each value converted (argparse names the flag and
    exits 2 on a bad one)."""
    def parse(text: str) -> list[Any]:
        return [conv(v) for v in text.split(",") if v]
    parse.__name__ = f"list of {conv.__name__}"
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="abcd")
    ap.add_argument("--gib", type=float, default=2.0, help="state size for parts a, c, d")
    ap.add_argument("--busy-ms", type=float, default=0.0, help="part a's forward/backward (0: 2x the copy)")
    ap.add_argument("--batches", type=_csv(int), default="8,16,32", help="part b: batch sizes (x --seq tokens)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--block", type=int, default=10, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--switch-interval", type=_csv(float), default="0",
                    help="part b: the GIL's switch interval in seconds for each mode, a list (0: Python's "
                         "default, 5 ms): does the background's Python, holding the GIL up to this long "
                         "when the training thread wants it, land in the step?")
    ap.add_argument("--side-priority", type=_csv(int), default="",
                    help="part b (CUDA): the save's side stream made by the bench with this priority, a list side "
                         "by side (e.g. 0,-1; -1 is the higher; empty: the snapshotter's own)")
    ap.add_argument("--side-index", type=_csv(int), default="",
                    help="part b (CUDA): the save's side stream the bench takes from torch's pool at this index "
                         "(0-31), a list side by side (empty: the snapshotter's own)")
    ap.add_argument("--beside-every-slot", action="store_true",
                    help="part b (CUDA): outside the save, the copy beside a step into every free slot of the ring "
                         "(each with its PCIe traffic), not only the most used one")
    ap.add_argument("--beside-fp", action="store_true",
                    help="part b (CUDA): outside the save, each copy beside a step also with the client's fingerprint "
                         "kernels launched first (slot against driver-pinned memory)")
    ap.add_argument("--toggles", type=_csv(str), default="",
                    help="part b (CUDA): after each mode, in its client, the save with one part changed, interleaved "
                         "with no checkpoint (which part costs?): a list of " + ",".join(TOGGLE_ARMS) + " or all")
    ap.add_argument("--after-actions", type=_csv(str), default="",
                    help="part b: after each mode, in its client, one lasting change then every step against none "
                         "again, in this order: a list of " + ",".join(AFTER_ACTIONS))
    ap.add_argument("--one-node", action="store_true",
                    help="part b: every mode of a batch on one agent and memory dir (default: a fresh one each)")
    ap.add_argument("--gc", type=_csv(str), default="on",
                    help="part b: the collector in each mode, a list side by side (on: as the process has it; "
                         "freeze: what lives after the warm-up moved out of its scans, gc.freeze())")
    ap.add_argument("--fresh", type=int, default=1,
                    help="part c: this many fresh clients with prepare(), first save over steady for each")
    ap.add_argument("--checksums", type=_csv(str), default="source,host",
                    help="part b: SnapshotConfig.checksums modes, side by side (source: fingerprints at the source; "
                         "host: hashed on the host, the old path)")
    ap.add_argument("--inflight", type=_csv(int), default="4,1",
                    help="part b: SnapshotConfig.max_inflight values, side by side (1: one save in the "
                         "background at a time, the path before pipelining)")
    ap.add_argument("--copy-thread", type=_csv(int), default="1",
                    help="part b: SnapshotConfig.copy_thread values, side by side (1: the update's copies "
                         "enqueued by the copy thread; 0: by save() on the training thread; e.g. 1,0)")
    ap.add_argument("--gather", type=_csv(int), default="0",
                    help="part b: SnapshotConfig.gather_bytes in MiB, side by side (0: one device-to-host copy "
                         "per tensor; e.g. 256,0 compares gathered and per-tensor copies)")
    ap.add_argument("--fp-threads", type=int, default=max(4, min(12, (os.cpu_count() or 4) - 4)),
                    help="host fingerprint threads of the background (the commit's pace)")
    ap.add_argument("--disk-dir", default=None, help="where torch.save / DCP write (default: a temp dir)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--agent", choices=("process", "inproc"), default="process",
                    help="the agent in a process of its own (as in production) or in this one (its commit "
                         "work then runs under the training process's GIL: the runs before issue 21's profile)")
    ap.add_argument("--diagnose", action="store_true",
                    help="part b: the host's share of a step (enqueue time from a synced device) and, on CUDA, "
                         "the device work a save adds (torch.profiler), after the timed blocks")
    ap.add_argument("--profile", action="store_true",
                    help="part b: host time per phase of a save, training thread and background")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU test); no timing claims")
    args = ap.parse_args(argv)
    if "b" in args.parts and not available("psutil"):   # part b's host CPU rows
        ap.error(needs("psutil"))
    # a `timeout` (SIGTERM) unwinds like an exception, so each part's finally removes its agent and its memory
    # dir in /dev/shm (a killed run left 17 GB there, and the next run's ring was cut by memory)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.side_priority = args.side_priority or [None]
    args.side_index = args.side_index or [None]
    if any(i is not None and not 0 <= i < 32 for i in args.side_index):
        ap.error("--side-index: pool indices are 0-31")
    if set(args.gc) - {"on", "freeze"}:
        ap.error(f"--gc: 'on' or 'freeze', not {args.gc}")
    if set(args.parts) - set("abcd") or not args.parts:
        ap.error(f"--parts: letters of abcd, not {args.parts!r}")
    if set(args.after_actions) - set(AFTER_ACTIONS):
        ap.error(f"--after-actions: {sorted(set(args.after_actions) - set(AFTER_ACTIONS))} not among "
                 f"{', '.join(AFTER_ACTIONS)}")
    if args.toggles == ["all"]:
        args.toggles = list(TOGGLE_ARMS)
    if set(args.toggles) - set(TOGGLE_ARMS):
        ap.error(f"--toggles: {sorted(set(args.toggles) - set(TOGGLE_ARMS))} not among {', '.join(TOGGLE_ARMS)} (or all)")
    if args.smoke:
        for k, v in dataclasses.asdict(Smoke()).items():
            setattr(args, k, list(v) if isinstance(v, tuple) else v)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu --smoke for a smoke run")
    parts = {"a": ("a. added step time per save vs the pinned copy", part_a),
             "b": ("b. checkpoint every step, GPT-2-sized model, interleaved with none", part_b),
             "c": ("c. first save vs steady saves (blocking)", part_c),
             "d": ("d. ours vs DCP async_save vs torch.save, same bytes", part_d)}
    tables = []
    for p in args.parts:
        title, fn = parts[p]
        t0 = time.perf_counter()
        tables.append((title, fn(args, device), time.perf_counter() - t0))
    print(f"\nhost: {os.cpu_count()} cores, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", torch {torch.__version__}, state {args.gib:g} GiB, "
          + time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))
    for title, rows, took in tables:
        print(f"\n{title}  ({took:.0f} s)")
        print(f"{'measure':<66} {'value':>10}  note")
        for name, v, note in rows:
            print(f"{name:<66} {v:10.4f}  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
