"""Issue 11 on N ranks of one host: replica vote, vote cost, canary consensus, checkpoint commit, HSDP groups.

    torchrun --standalone --nproc-per-node N --max-restarts 1 bench/multi_rank.py [--device cpu] [--out F]

NCCL on GPUs (NVLink multicast stays off: NCCL_NVLS_ENABLE=0), gloo on the CPU. Parts (--parts, default all):
  1  replica vote, DDP: a bit flipped on one rank's weights at step k is named alone (a strict majority;
     with 2 ranks both are suspect, as the vote's rule says), at step k, with its GPU UUID (empty on the
     CPU); then --clean-steps clean steps give no event.
  2  the vote's cost per step: a GPT-2-small step (on the CPU a small GPT, said in the output) with the
     Monitor against without it, interleaved blocks in rotated order; plus the fingerprint launch and the
     all_gather of the fingerprint words timed alone.
  3  canary cross-device vote: the seeded random GEMM on every rank's device with one device's output
     corrupted on purpose (one low mantissa bit, below any rounding bound); fingerprints gathered and voted
     (`probes.canary_random.vote_outputs`); then rank 0 runs the agent's own path (`run_random`) over every
     GPU of the host (CPU: N simulated devices) with the same fault. Only that device may be named.
  4  in-memory checkpoint: saves 1..S commit on all N ranks (agent started here, or --agent-socket); the
     blocking time of each save ("stall") per rank against bytes / pinned-copy bandwidth measured in the
     same run, all ranks copying at once; then rank N-1 is SIGKILLed in the middle of save S+1 (after Begin,
     while publishing its shard). torchrun tears the job down and restarts it (--max-restarts 1): the
     restarted ranks find S+1 uncommitted (N-1 shards) and restore S bit for bit from node memory.
  5  FSDP2 with HSDP (`fully_shard` on a (replicate, shard) DeviceMesh, --hsdp RxS, default 2x2 for 4 ranks,
     4x2 for 8): the Monitor picks the replicate dim's group by itself; a bit flipped on one rank's shard is
     named within its replica group only (alone with >= 3 replicas; with 2 both are suspect), and the other
     replica groups see no event; every rank reports to an agent (--agent-socket, or one started for this
     part), which must take every report and tell one incident, of that group, at that step.
Each part prints PASS/FAIL with its evidence; a table comes last; the exit status is non-zero if one failed.
Part 4 needs the restart: run with `--max-restarts 1` (or leave it out: --parts 1,2,3,5).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device docs); set before NCCL starts

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("multi_rank")
# torch 2.13 deprecates all_gather_into_tensor (the Monitor's gather): N ranks saying so drown the output
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")
ALL_PARTS = (1, 2, 3, 4, 5)
TITLES = {1: "replica vote (DDP)", 2: "vote cost per step", 3: "canary cross-device vote",
          4: "checkpoint commit, rank killed", 5: "HSDP replica groups"}
STATE_FILE = "attempt0.json"     # results of the first attempt (parts 1,2,3,5 and the saves of part 4)
MARKERS = ("survivor-", "victim-")


# ------------------------------------------------------------------------------------------------ setup
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parts", default="1,2,3,4,5", help="comma-separated part numbers (default: all)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file (rank 0)")
    p.add_argument("--workdir", default=None,
                   help="a dir all ranks see, kept across the restart (default: /tmp/sdcw-mr-<run id>-<pid>)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="process group timeout")
    p.add_argument("--verbose", action="store_true", help="keep the Monitor's own warnings")
    g = p.add_argument_group("part 1 (replica vote)")
    g.add_argument("--flip-step", type=int, default=7)
    g.add_argument("--clean-steps", type=int, default=None, help="default 1000 on cuda, 200 on cpu")
    g.add_argument("--mlp-width", type=int, default=None, help="default 256 on cuda, 32 on cpu")
    g = p.add_argument_group("part 2 (cost; the model defaults to GPT-2 small on cuda, a small GPT on cpu)")
    for name, cuda, cpu in (("layers", 12, 2), ("width", 768, 64), ("heads", 12, 4), ("vocab", 50257, 512),
                            ("seq", 1024, 64), ("batch", 8, 2), ("block", 20, 3), ("rounds", 6, 2),
                            ("warmup", 10, 2)):
        g.add_argument(f"--{name}", type=int, default=None, help=f"default {cuda} on cuda, {cpu} on cpu")
    g = p.add_argument_group("part 3 (canary)")
    g.add_argument("--canary-dtype", default=None, help="default bf16 on cuda, fp32 on cpu")
    g.add_argument("--canary-mnk", default=None,
                   help="MxNxK; default 1024x1024x2048 (the agent's quick level) on cuda, 32x32x64 on cpu")
    g = p.add_argument_group("part 4 (checkpoint)")
    g.add_argument("--agent-socket", default=None, help="use this agent; default: start one from rank 0")
    g.add_argument("--ckpt-mib", type=float, default=None,
                   help="state per rank; default 512 on cuda, 4 on cpu")
    g.add_argument("--saves", type=int, default=7, help="committed saves before the killed one (>= 2)")
    g = p.add_argument_group("part 5 (HSDP)")
    g.add_argument("--hsdp", default=None, help="RxS mesh (replicate x shard); default 2x2 (4), 4x2 (8)")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    defaults = {"clean_steps": (1000, 200), "mlp_width": (256, 32), "layers": (12, 2), "width": (768, 64),
                "heads": (12, 4), "vocab": (50257, 512), "seq": (1024, 64), "batch": (8, 2), "block": (20, 3),
                "rounds": (6, 2), "warmup": (10, 2), "canary_dtype": ("bf16", "fp32"),
                "canary_mnk": ("1024x1024x2048", "32x32x64"), "ckpt_mib": (512.0, 4.0)}
    for k, (on_cuda, on_cpu) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, on_cuda if cuda else on_cpu)
    try:
        a.parts = sorted({int(x) for x in a.parts.split(",") if x.strip()})
    except ValueError:
        p.error(f"--parts must be comma-separated numbers from {ALL_PARTS}, got {a.parts!r}")
    if not a.parts or set(a.parts) - set(ALL_PARTS):
        p.error(f"--parts must name parts among {ALL_PARTS}, got {a.parts}")
    if a.flip_step < 1 or a.clean_steps < 1 or a.saves < 2 or a.ckpt_mib <= 0:
        p.error("--flip-step and --clean-steps must be >= 1, --saves >= 2, --ckpt-mib > 0")
    if min(a.block, a.rounds) < 1 or a.warmup < 0:
        p.error("--block and --rounds must be >= 1, --warmup >= 0")
    try:
        mnk = tuple(int(v) for v in a.canary_mnk.lower().split("x"))
    except ValueError:
        mnk = ()
    if len(mnk) != 3 or min(mnk) < 1:
        p.error(f"--canary-mnk must look like 1024x1024x2048, got {a.canary_mnk!r}")
    a.canary_mnk = mnk
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible: pass --device cpu")
    return a


@dataclasses.dataclass
class Ctx:
    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    uuid: str                   # this rank's GPU UUID ("" on the CPU)
    uuids: list[str]            # every rank's
    attempt: int                # torchrun restart count
    workdir: Path
    tag: str                    # this run's id (the same on every attempt)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def part_result(part: int, passed: bool, evidence: str, **data: Any) -> dict[str, Any]:
    return {"part": part, "title": TITLES[part], "passed": bool(passed), "evidence": evidence, "data": data}


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip one bit of element `index` of `t` in place (through an integer view of the same bytes)."""
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    with torch.no_grad():
        t.view(view).view(-1)[index] ^= 1 << bit


def mlp(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, 8))


def first_weight(model: nn.Sequential) -> torch.Tensor:
    return cast(nn.Linear, model[0]).weight


def expected_named(group: list[int], flipped: int) -> tuple[list[int], str]:
    """Who the vote must name when `flipped` differs inside replica group `group`: the rule of
    checksums.replica_vote (a strict majority needs >= 3 replicas; 2 that differ are both suspect)."""
    return ([flipped], "majority") if len(group) >= 3 else (sorted(group), "all_disagreeing")


# ------------------------------------------------------------------------------------ part 1: the vote
def _train_steps(ctx: Ctx, model: nn.Module, opt: torch.optim.Optimizer, monitor: Any, steps: int, width: int,
                 after_step: Callable[[int], None] | None = None) -> None:
    gen = torch.Generator(device=ctx.device).manual_seed(1000 + ctx.rank)
    for i in range(1, steps + 1):
        x = torch.randn(16, width, device=ctx.device, generator=gen)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(i)
        monitor.step(loss.detach())
    monitor.flush()


def _mismatches(monitor: Any) -> list[dict[str, Any]]:
    return [{"step": e.step, "method": e.details["method"], "group": e.details["replica_group"],
             "suspects": [(s["rank"], s["gpu_uuid"]) for s in e.details["suspects"]]}
            for e in monitor.events if e.kind == "replica.mismatch"]


def part_vote(ctx: Ctx) -> dict[str, Any]:
    from checksums.monitor import Monitor

    a, width = ctx.args, ctx.args.mlp_width
    flipped = 1 % ctx.world
    want, method = expected_named(list(range(ctx.world)), flipped)

    def ddp_model() -> tuple[nn.Sequential, nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = mlp(width).to(ctx.device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.cuda else None)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        return model, ddp, opt, Monitor.attach(ddp, opt, job_id=f"mr-{ctx.tag}-vote", reporter=False)

    model, ddp, opt, monitor = ddp_model()

    def flip(i: int) -> None:
        if i == a.flip_step and ctx.rank == flipped:
            flip_bit(first_weight(model), index=5, bit=3)

    _train_steps(ctx, ddp, opt, monitor, a.flip_step + 2, width, flip)
    flip_view = {"mismatches": _mismatches(monitor), "votes": monitor.stats.votes,
                 "other_events": [e.kind for e in monitor.events if e.kind != "replica.mismatch"]}
    monitor.close()
    t0 = time.perf_counter()
    _, ddp, opt, monitor = ddp_model()
    _train_steps(ctx, ddp, opt, monitor, a.clean_steps, width)
    clean_s = time.perf_counter() - t0
    clean_view = {"events": [e.kind for e in monitor.events], "votes": monitor.stats.votes,
                  "mismatches": monitor.stats.mismatches}
    monitor.close()
    views = ctx.gather({"flip": flip_view, "clean": clean_view})
    want_pairs = [[r, ctx.uuids[r]] for r in want]
    bad_flip = [r for r, v in enumerate(views)
                if len(v["flip"]["mismatches"]) != 1 or v["flip"]["other_events"]
                or v["flip"]["mismatches"][0]["step"] != a.flip_step
                or [list(s) for s in v["flip"]["mismatches"][0]["suspects"]] != want_pairs
                or v["flip"]["mismatches"][0]["method"] != method]
    bad_clean = [r for r, v in enumerate(views) if v["clean"]["events"] or v["clean"]["mismatches"]
                 or v["clean"]["votes"] != a.clean_steps]
    got = views[0]["flip"]["mismatches"]
    named = ", ".join(f"rank {r} ({u or 'no GPU UUID on cpu'})" for r, u in got[0]["suspects"]) \
        if got else "nobody"
    evidence = (f"bit flipped on rank {flipped} at step {a.flip_step}: every rank's vote named {named} at "
                f"step {got[0]['step'] if got else '-'} ({got[0]['method'] if got else '-'}, "
                f"{ctx.world} replicas); "
                f"{a.clean_steps} clean steps: {sum(len(v['clean']['events']) for v in views)} events, "
                f"{views[0]['clean']['votes']} votes per rank ({clean_s / a.clean_steps * 1e3:.2f} ms/step)")
    if bad_flip or bad_clean:
        evidence += (f"; WRONG on ranks flip={bad_flip} clean={bad_clean}: "
                     f"{views[bad_flip[0] if bad_flip else bad_clean[0]]}")
    return part_result(1, not bad_flip and not bad_clean, evidence, flipped=flipped, expected=want_pairs,
                       method=method, views=views, clean_steps=a.clean_steps)


# ------------------------------------------------------------------------------------ part 2: its cost
def part_cost(ctx: Ctx) -> dict[str, Any]:
    from bench.tiny_gpt import GPTConfig, TinyGPT
    from checksums.collectives import all_gather_single
    from checksums.fingerprint import NUM_WORDS, fingerprint_tensors_async
    from checksums.monitor import Monitor

    a = ctx.args
    cfg = GPTConfig(layers=a.layers, width=a.width, heads=a.heads, vocab=a.vocab, seq=a.seq)
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(ctx.device)
    params = list(model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.cuda else None)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True if ctx.cuda else None)
    gen = torch.Generator(device=ctx.device).manual_seed(1234 + ctx.rank)
    idx = torch.randint(0, cfg.vocab, (a.batch, cfg.seq), device=ctx.device, generator=gen)
    tgt = torch.randint(0, cfg.vocab, (a.batch, cfg.seq), device=ctx.device, generator=gen)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.cuda else contextlib.nullcontext()
    monitor = Monitor.attach(ddp, opt, job_id=f"mr-{ctx.tag}-cost", reporter=False)

    def step(with_monitor: bool) -> None:
        with autocast:
            loss = ddp(idx, tgt)
        loss.backward()
        opt.step()
        if with_monitor:
            monitor.step(loss.detach())
        opt.zero_grad(set_to_none=True)

    def block(mode: str, steps: int) -> float:
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(mode == "monitor")
        if mode == "monitor":
            monitor.flush()
        ctx.sync()
        return (time.perf_counter() - t0) / steps

    modes = ["off", "monitor"]
    for m in modes:
        block(m, a.warmup)
    per: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for m in modes[r % 2:] + modes[:r % 2]:
            per[m].append(block(m, a.block))
    stats = monitor.stats
    events = [e.kind for e in monitor.events]
    monitor.close()

    def timed(fn: Callable[[], Any], n: int) -> float:
        fn()
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ctx.sync()
        return (time.perf_counter() - t0) / n

    words = torch.zeros(NUM_WORDS, dtype=torch.int64, device=ctx.device)
    gathered = torch.zeros(NUM_WORDS * ctx.world, dtype=torch.int64, device=ctx.device)
    gather_s = timed(lambda: all_gather_single(gathered, words), 200 if ctx.cuda else 30)
    fp_out = torch.zeros(NUM_WORDS, dtype=torch.int64, device=ctx.device)
    fp_s = timed(lambda: fingerprint_tensors_async(params, out=fp_out), 20)
    off, mon = statistics.median(per["off"]), statistics.median(per["monitor"])
    views = ctx.gather({"events": events, "votes": stats.votes, "mismatches": stats.mismatches})
    quiet = all(not v["events"] and v["mismatches"] == 0 and v["votes"] > 0 for v in views)
    n_params = sum(p.numel() for p in params)
    model_note = ("GPT-2 small" if (a.layers, a.width, a.vocab, a.seq) == (12, 768, 50257, 1024)
                  else f"a small GPT, NOT GPT-2 small ({a.layers}x{a.width}, vocab {a.vocab}, seq {a.seq})")
    evidence = (f"{model_note}, {n_params / 1e6:.1f}M params, batch {a.batch}x{cfg.seq} per rank, "
                f"DDP x{ctx.world}: step {off * 1e3:.2f} ms without, {mon * 1e3:.2f} ms with the Monitor "
                f"({(mon / off - 1) * 100:+.2f}%, median of {a.rounds} interleaved blocks of {a.block}); "
                f"alone: fingerprint {fp_s * 1e3:.3f} ms, "
                f"all_gather of {NUM_WORDS} words x {ctx.world} ranks {gather_s * 1e6:.0f} us; "
                f"{stats.votes} votes, {len(events)} events")
    if not quiet:
        evidence += f"; FALSE ALARM or no vote: {views}"
    return part_result(2, quiet, evidence, model=model_note, params_m=n_params / 1e6, off_ms=off * 1e3,
                       monitor_ms=mon * 1e3, overhead_pct=(mon / off - 1) * 100, fingerprint_ms=fp_s * 1e3,
                       all_gather_us=gather_s * 1e6, blocks={m: [x * 1e3 for x in v] for m, v in per.items()})


# ------------------------------------------------------------------------------------ part 3: canary
def _canary_agent_path(ctx: Ctx, spec: Any, bad: int, fault: Any, vers: dict[str, str]) -> dict[str, Any]:
    """The agent's own path, on rank 0: `run_random` over every GPU of the host in one process (CPU:
    simulated devices), the same fault on the GPU of rank `bad`."""
    from probes.canary_faults import FaultyDevice, simulated_devices
    from sdcwatch.canary import Status
    from probes.canary_random import group_key, run_random
    from probes.canary_suite import discover_devices

    devices = discover_devices()[0] if ctx.cuda else simulated_devices(ctx.world)
    culprit = devices[bad % len(devices)].label
    results = run_random(spec, devices, matmul_for=FaultyDevice(culprit, fault),
                         groups={d.label: group_key(d, vers) for d in devices})
    failed = [r.devices[0] for r in results if r.status is Status.FAIL]
    want = [culprit] if len(devices) >= 3 else sorted(d.label for d in devices)
    known = all(r.status is not Status.UNKNOWN for r in results)
    return {"devices": len(devices), "culprit": culprit, "failed": failed,
            "ok": sorted(failed) == sorted(want) and known,
            "why": next((r.why for r in results if r.devices[0] == culprit), "")}


def part_canary(ctx: Ctx) -> dict[str, Any]:
    from checksums.fingerprint import fingerprint_tensor
    from probes.canary_faults import FaultyMatmul
    from checksums.canary_gemm import default_matmul
    from sdcwatch.canary import DeviceInfo
    from probes.canary_random import RandomSpec, device_inputs, group_key, vote_outputs
    from probes.canary_suite import versions

    a = ctx.args
    m, n, k = a.canary_mnk
    spec = RandomSpec(a.canary_dtype, m, n, k, seed=11)
    bad = ctx.world // 2
    where = (m // 3, n // 5)
    fault = FaultyMatmul(where="output", index=where, bit=0)   # the lowest mantissa bit
    vers = versions()
    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else (platform.processor() or "cpu")
    label = ctx.uuid or f"{socket.gethostname()}/cpu-rank{ctx.rank}"
    group = group_key(DeviceInfo(label, str(ctx.device), name=name), vers)
    x, y = device_inputs(spec, ctx.device)
    matmul: Callable[..., torch.Tensor] = fault if ctx.rank == bad else default_matmul
    out = matmul(x, y, spec)
    fp = tuple(fingerprint_tensor(out))
    rows = ctx.gather((label, group, fp))
    outcome = vote_outputs({lab: f for lab, _, f in rows}, {lab: g for lab, g, _ in rows})
    labels = [lab for lab, _, _ in rows]
    bad_label = labels[bad]
    if ctx.world >= 3:
        ok_dist = list(outcome.odd) == [bad_label] and not outcome.undecided
    else:
        ok_dist = not outcome.odd and sorted(outcome.split) == sorted(labels)
    # the agent's own path on rank 0: every GPU of the host in one process (CPU: simulated devices)
    agent_view: dict[str, Any] = {}
    try:
        if ctx.rank == 0:
            agent_view = _canary_agent_path(ctx, spec, bad, fault, vers)
    except Exception as exc:  # said to every rank (they wait in the gather below), then a FAIL
        log.exception("the canary's agent path failed")
        agent_view = {"devices": 0, "culprit": "", "failed": [], "ok": False, "why": f"error: {exc}"}
    agent_view = ctx.gather(agent_view)[0]
    passed = ok_dist and agent_view["ok"]
    named = list(outcome.odd) or (f"both, no majority: {list(outcome.split)}" if outcome.split else "nobody")
    evidence = (f"{spec.name} on {ctx.world} ranks' devices, output bit 0 of element {where} flipped "
                f"on rank {bad} ({bad_label}): gathered vote named {named} "
                f"({outcome.reason or 'unanimous'}); agent path (run_random over {agent_view['devices']} "
                f"{'GPUs' if ctx.cuda else 'simulated devices'}) failed {agent_view['failed']}: "
                f"{agent_view['why'][:120]}")
    return part_result(3, passed, evidence, corrupted_rank=bad, corrupted_label=bad_label,
                       odd=list(outcome.odd), split=list(outcome.split), agree=list(outcome.agree),
                       agent_path=agent_view)


# ------------------------------------------------------------------------------------ part 5: HSDP
def hsdp_shape(arg: str | None, world: int) -> tuple[int, int]:
    if arg:
        try:
            r, s = (int(v) for v in arg.lower().split("x"))
        except ValueError:
            raise ValueError(f"--hsdp must look like RxS (e.g. 4x2), got {arg!r}") from None
    else:
        s = 2 if world >= 4 and world % 2 == 0 else 1
        r = world // s
    if r * s != world or r < 2 or s < 1:
        raise ValueError(f"--hsdp {r}x{s} must multiply to the world size {world} with >= 2 replicas")
    return r, s


def part_hsdp(ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    a, width = ctx.args, ctx.args.mlp_width
    reps, shards = hsdp_shape(a.hsdp, ctx.world)
    mesh = init_device_mesh(ctx.device.type, (reps, shards), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = mlp(width).to(ctx.device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # every rank reports to an agent (--agent-socket, or one rank 0 starts for this part), whose events are
    # read back: each rank's local view is not enough (a sub-world group's name was once refused by the
    # agent on every report while each rank's own events looked right)
    agent = _part_agent(ctx, "hsdp")
    try:
        return _hsdp_reported(ctx, model, opt, reps, shards, agent)
    finally:
        if ctx.rank == 0:
            stop_agent(agent)


def _hsdp_reported(ctx: Ctx, model: nn.Module, opt: torch.optim.Optimizer, reps: int, shards: int,
                   agent: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from checksums.monitor import Monitor

    a, width = ctx.args, ctx.args.mlp_width
    job = f"mr-{ctx.tag}-hsdp"
    monitor = Monitor.attach(model, opt, job_id=job, agent_socket=agent["target"])
    flipped = shards                                   # replicate index 1, shard index 0
    groups = [[j * shards + i for j in range(reps)] for i in range(shards)]
    flipped_group = groups[flipped % shards]
    want, method = expected_named(flipped_group, flipped)

    def flip(i: int) -> None:
        if i == a.flip_step and ctx.rank == flipped:
            with torch.no_grad():                      # to_local() is then the shard itself, not a copy
                flip_bit(cast(DTensor, first_weight(model)).to_local(), index=1, bit=4)

    steps = a.flip_step + 2
    _train_steps(ctx, model, opt, monitor, steps, width, flip)
    monitor.close()                                    # every report sent (or counted as lost)
    stats = monitor.stats
    mine = {"group": monitor.replica_group_name, "mismatches": _mismatches(monitor),
            "votes": stats.votes,
            "reports": [stats.reports_sent, stats.reports_failed, stats.reports_dropped],
            "other_events": [e.kind for e in monitor.events if e.kind != "replica.mismatch"],
            "placements": str(cast(DTensor, first_weight(model)).placements)}
    views = ctx.gather(mine)
    told = ctx.gather(_agent_mismatches(agent["target"], job) if ctx.rank == 0 else None)[0]
    want_pairs = [[r, ctx.uuids[r]] for r in want]
    flipped_name = views[flipped]["group"]
    # the agent: one incident, of the flipped group, at the flip's step, naming whom the vote names
    agent_ok = told == [{"group": flipped_name, "step": a.flip_step, "ranks": want}]
    unsent = [r for r, v in enumerate(views) if v["reports"] != [steps, 0, 0]]
    wrong = []
    for r, v in enumerate(views):
        group = next(g for g in groups if r in g)
        expect_group = "ranks:" + ",".join(map(str, group)) if len(group) < ctx.world else "world"
        if v["group"] != expect_group or v["other_events"] or v["votes"] != steps:
            wrong.append(r)
        elif group is flipped_group:
            m = v["mismatches"]
            if len(m) != 1 or m[0]["step"] != a.flip_step or m[0]["method"] != method \
                    or [list(s) for s in m[0]["suspects"]] != want_pairs:
                wrong.append(r)
        elif v["mismatches"]:
            wrong.append(r)
    seen = views[flipped_group[0]]["mismatches"]
    quiet = [g for g in groups if g is not flipped_group]
    evidence = (f"mesh {reps}x{shards} (replicate x shard), params {views[0]['placements']}, replica groups "
                f"{groups}; bit flipped on rank {flipped}'s shard at step {a.flip_step}: group "
                f"{views[flipped]['group']} named {[s[0] for s in seen[0]['suspects']] if seen else 'nobody'}"
                f" ({seen[0]['method'] if seen else '-'}) at step {seen[0]['step'] if seen else '-'}; "
                f"other groups "
                f"{quiet}: {sum(len(views[r]['mismatches']) for g in quiet for r in g)} events in "
                f"{sum(views[r]['votes'] for g in quiet for r in g)} rank-votes")
    evidence += (f"; the agent ({'given' if not agent['started_here'] else 'started here'}) took "
                 f"{sum(v['reports'][0] for v in views)} of {steps * ctx.world} reports and told {told}")
    if wrong:
        evidence += f"; WRONG on ranks {wrong}: {[views[r] for r in wrong[:2]]}"
    if unsent:
        evidence += f"; reports not taken on ranks {unsent}: {[views[r]['reports'] for r in unsent[:4]]}"
    if not agent_ok:
        evidence += (f"; the AGENT told {told}, not one incident of {flipped_name} at step {a.flip_step} "
                     f"naming {want}")
    return part_result(5, not wrong and not unsent and agent_ok, evidence, mesh=[reps, shards], groups=groups,
                       flipped=flipped, expected=want_pairs, method=method, views=views, agent_told=told)


def _part_agent(ctx: Ctx, name: str = "") -> dict[str, Any]:
    """The agent a part reports to: --agent-socket, else one rank 0 starts now (`stop_agent` stops it)."""
    given = ctx.args.agent_socket
    if given is not None:
        return {"target": given if given.startswith("unix:") else f"unix:{given}", "started_here": False}
    info = ctx.gather(_try(lambda: start_agent(ctx, name)) if ctx.rank == 0 else None)[0]
    if "error" in info:
        raise RuntimeError(f"could not start the agent: {info['error']}")
    return info


def _agent_mismatches(target: str, job: str) -> list[dict[str, Any]]:
    """The replica-mismatch incidents the agent told for `job`, each by its first event (a fold window that
    closes publishes the incident's later occurrences again): group, step and the ranks named."""
    import grpc

    from proto.sdcwatch.v1 import agent_pb2 as pb
    from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as ch:
        request = pb.WatchEventsRequest(since_seq=0, kinds=["replica.mismatch"])
        events = pb_grpc.AgentStub(ch).WatchEvents(request, timeout=30)
        first = {}
        for e in events:
            if e.kind == "replica.mismatch" and e.subject == f"job/{job}":
                first.setdefault(int(e.details["incident"]), e)
        return [{"group": e.details["replica_group"], "step": int(e.details["step"]),
                 "ranks": sorted(int(x["rank"]) for x in e.details["suspects"])} for e in first.values()]


# ------------------------------------------------------------------------------------ part 4: checkpoint
def _wait_serving(target: str, proc: subprocess.Popen[bytes] | None, log_path: Path, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the agent exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with grpc.insecure_channel(target) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = resp.status
        except grpc.RpcError as exc:
            last = exc.code()
        time.sleep(0.1)
    raise TimeoutError(f"the agent at {target} is not SERVING after {timeout:.0f}s (last: {last})")


def start_agent(ctx: Ctx, name: str = "") -> dict[str, Any]:
    """Rank 0 starts `sdcwatch run` in its own session (it must outlive the killed attempt). `name` tells
    two agents of one run apart (their state dirs and logs)."""
    state = ctx.workdir / (f"agent-{ctx.tag}-{name}" if name else f"agent-{ctx.tag}")
    state.mkdir(parents=True, exist_ok=True)
    log_path = ctx.workdir / (f"{name}-agent.log" if name else "agent.log")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "daemon.cli", "run", "--state-dir", str(state), "--metrics-listen",
           "127.0.0.1:0", "--shutdown-grace-s", "1", "--no-canary-enabled", "--log-level", "WARNING"]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    target = f"unix:{state / 'agent.sock'}"
    _wait_serving(target, proc, log_path, 60)
    return {"target": target, "pid": proc.pid, "state_dir": str(state), "started_here": True}


def stop_agent(info: dict[str, Any]) -> None:
    """Stop the agent this script started (by its pid) and remove its state and node-memory dirs."""
    if not info.get("started_here"):
        return
    import shutil

    from checkpoint.shm_store import default_shm_root

    pid = int(info["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        with contextlib.suppress(ChildProcessError):    # our child on attempt 0; init's after a restart
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        time.sleep(0.1)
    else:
        if Path(f"/proc/{pid}").exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(default_shm_root(info["state_dir"]).parent, ignore_errors=True)
    shutil.rmtree(info["state_dir"], ignore_errors=True)


def ckpt_state(rank: int, step: int, nbytes: int, device: torch.device) -> dict[str, Any]:
    """Deterministic per (rank, step) on a given device: fp32 and bf16 tensors of <= 32 MiB, and extras."""
    g = torch.Generator(device=device).manual_seed(1_000_003 * (rank + 1) + step)
    model: dict[str, torch.Tensor] = {}
    left, i = nbytes, 0
    while left > 0:
        dt = torch.float32 if i % 2 == 0 else torch.bfloat16
        size = torch.empty((), dtype=dt).element_size()
        n = max(1, min(32 << 20, left) // size)
        model[f"p{i}"] = torch.randn(n, generator=g, device=device).to(dt)
        left -= n * size
        i += 1
    return {"model": model, "step": step, "rank": rank}


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].cpu().view(torch.uint8), b[k].cpu().view(torch.uint8))
        for k in a)


class _DyingStore:
    """Failure injection around the rank's blob store: the process is SIGKILLed while it publishes its shard
    (after Begin, the bytes already in its staging slot or part-written), once the other ranks' saves of the
    same step are done (so they are not torn down before they commit their shards)."""

    def __init__(self, inner: Any, die: Callable[[], None]) -> None:
        self._inner, self._die = inner, die

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def link_in(self, key: str, src: Any) -> Any:
        self._die()                          # returns unless armed
        return self._inner.link_in(key, src)

    def put(self, key: str, data: Any) -> int:
        def first_piece_then_die() -> Any:
            for piece in data:
                yield piece
                self._die()
        return self._inner.put(key, first_piece_then_die())


def _save(client: Any, step: int, sd: dict[str, Any]) -> Any:
    handle = client.save(step, sd)
    if handle is None:                  # only with SnapshotConfig(policy="skip"), not used here
        raise RuntimeError(f"the save of step {step} was skipped")
    return handle.result(600)


def part_ckpt_save(ctx: Ctx, agent: dict[str, Any]) -> tuple[dict[str, Any], Any, dict[str, bool]]:
    """Attempt 0: the saves that commit, the stall against the pinned-copy bound. Returns the evidence
    (gathered), the client and its failure switch; the kill comes after, in `crash_save`."""
    from checkpoint.client import CheckpointClient
    from checkpoint.snapshot import SnapshotConfig
    from checkpoint.locations import dir_store_for

    a = ctx.args
    nbytes = int(a.ckpt_mib * (1 << 20))
    armed = {"on": False}
    victim = ctx.world - 1

    def die() -> None:
        if not armed["on"]:
            return
        (ctx.workdir / f"victim-{ctx.rank}.json").write_text(json.dumps({"rank": ctx.rank, "in_save": True}))
        deadline = time.monotonic() + 300
        survivors = [r for r in range(ctx.world) if r != ctx.rank]
        while time.monotonic() < deadline and \
                not all((ctx.workdir / f"survivor-{r}.json").exists() for r in survivors):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    store_for = (lambda loc: _DyingStore(dir_store_for(loc), die)) if ctx.rank == victim else dir_store_for
    cfg = SnapshotConfig()
    client = CheckpointClient.connect(f"mr-{ctx.tag}", ctx.rank, ctx.world, target=agent["target"],
                                      deadline_s=60, config=cfg, store_for=store_for)
    saves: list[dict[str, Any]] = []
    for step in range(1, a.saves + 1):
        sd = ckpt_state(ctx.rank, step, nbytes, ctx.device)
        ctx.sync()
        res = _save(client, step, sd)
        saves.append({"step": step, "state": res.state, "error": res.error, "blocking_s": res.blocking_s,
                      "stall_s": res.stall_s, "staging": res.staging, "nbytes": res.nbytes,
                      "safe_s": res.safe_s})
        del sd
    dist.barrier()
    latest = client.latest()
    # the bound: the same bytes copied into a reused (pinned, on CUDA) host buffer, all ranks at once
    sd = ckpt_state(ctx.rank, a.saves, nbytes, ctx.device)
    tensors = list(sd["model"].values())
    total = sum(t.numel() * t.element_size() for t in tensors)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=ctx.cuda)
    times = []
    for _ in range(4):
        ctx.sync()
        t0 = time.perf_counter()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            host[off:off + n].view(t.dtype).copy_(t, non_blocking=ctx.cuda)
            off += n
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
        times.append(time.perf_counter() - t0)
    bound_s = min(times[1:])
    del host, sd, tensors
    steady = [s for s in saves if s["step"] > cfg.max_slots + 1] or saves[1:]
    mine = {"rank": ctx.rank, "saves": saves, "latest": latest.step if latest else None, "bound_s": bound_s,
            "bytes": total, "steady_blocking_s": statistics.median(s["blocking_s"] for s in steady),
            "steady_staging": sorted({s["staging"] for s in steady})}
    info = {"ranks": ctx.gather(mine), "victim": victim, "crash_step": a.saves + 1, "saves": a.saves,
            "agent": agent, "job": f"mr-{ctx.tag}", "bytes_per_rank": total}
    return info, client, armed


def crash_save(ctx: Ctx, save_info: dict[str, Any], client: Any, armed: dict[str, bool]) -> None:
    """Everyone saves step S+1; the victim dies inside it; the others record their result and wait for
    torchrun to tear the job down and restart it."""
    step = save_info["crash_step"]
    sd = ckpt_state(ctx.rank, step, int(ctx.args.ckpt_mib * (1 << 20)), ctx.device)
    ctx.sync()
    armed["on"] = ctx.rank == save_info["victim"]
    res = _save(client, step, sd)
    if armed["on"]:
        print(f"rank {ctx.rank}: the save of step {step} finished although this rank should have died",
              file=sys.stderr, flush=True)
        os._exit(5)
    (ctx.workdir / f"survivor-{ctx.rank}.json").write_text(json.dumps(
        {"rank": ctx.rank, "state": res.state, "error": res.error}))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:           # torchrun ends this process when it sees the victim die
        time.sleep(0.5)
    print(f"rank {ctx.rank}: not restarted after rank {save_info['victim']} died: is --max-restarts >= 1?",
          file=sys.stderr, flush=True)
    os._exit(6)


def part_ckpt_restore(ctx: Ctx, save_info: dict[str, Any]) -> dict[str, Any]:
    """Attempt 1 (after the restart): the killed save is not committed; the previous one restores exactly."""
    from checkpoint.client import CheckpointClient

    a = ctx.args
    crash, prev = save_info["crash_step"], save_info["saves"]
    client = CheckpointClient.connect(save_info["job"], ctx.rank, ctx.world,
                                      target=save_info["agent"]["target"], deadline_s=60)
    infos = {i.step: i for i in client.list()}
    latest = client.latest()
    t0 = time.perf_counter()
    restored = client.restore("latest")
    restore_s = time.perf_counter() - t0
    want = ckpt_state(ctx.rank, prev, int(a.ckpt_mib * (1 << 20)), ctx.device)
    same = restored.get("step") == prev and restored.get("rank") == ctx.rank and _same_bits(restored["model"],
                                                                                            want["model"])
    client.close()
    c = infos.get(crash)
    mine = {"rank": ctx.rank, "crash_state": c.state if c else "absent", "crash_shards": c.shards if c else 0,
            "latest": latest.step if latest else None, "restored_step": restored.get("step"),
            "same_bits": same,
            "restore_s": restore_s}
    views = ctx.gather(mine)
    survivors = {}
    for r in range(ctx.world):
        f = ctx.workdir / f"survivor-{r}.json"
        survivors[r] = json.loads(f.read_text()) if f.exists() else None
    victim = save_info["victim"]
    victim_in_save = (ctx.workdir / f"victim-{victim}.json").exists()
    ranks = save_info["ranks"]
    committed_before = all(not s["error"] for v in ranks for s in v["saves"]) and \
        all(v["latest"] == prev for v in ranks)
    survivors_pending = all(s is not None and s["state"] == "PENDING" and not s["error"]
                            for r, s in survivors.items() if r != victim)
    no_commit = all(v["crash_state"] not in ("COMMITTED", "VERIFIED") and v["crash_shards"] == ctx.world - 1
                    for v in views)
    restored_ok = all(v["latest"] == prev and v["same_bits"] for v in views)
    ratios = [v["steady_blocking_s"] / v["bound_s"] for v in ranks]
    stall = "; ".join(f"r{v['rank']} {v['steady_blocking_s'] * 1e3:.1f}/{v['bound_s'] * 1e3:.1f} ms"
                      for v in ranks)
    mb = save_info["bytes_per_rank"] / 1e6
    where = "after Begin, publishing its shard" if victim_in_save else "NOT in its save"
    evidence = (f"{prev} saves of {mb:.1f} MB/rank committed on all {ctx.world} ranks: {committed_before}; "
                f"rank {victim} SIGKILLed inside save {crash} ({where}), the others' saves "
                f"{'PENDING' if survivors_pending else survivors}; after the restart: step {crash} "
                f"{views[0]['crash_state']} with {views[0]['crash_shards']}/{ctx.world} shards, "
                f"latest {views[0]['latest']}, "
                f"{sum(v['same_bits'] for v in views)}/{ctx.world} ranks restored step {prev} bit for bit "
                f"(max {max(v['restore_s'] for v in views) * 1e3:.0f} ms); save stall (steady, blocking) vs "
                f"pinned-copy bound per rank: {stall} (ratio median {statistics.median(ratios):.2f}, "
                f"max {max(ratios):.2f})")
    passed = committed_before and victim_in_save and survivors_pending and no_commit and restored_ok
    return part_result(4, passed, evidence, saves=ranks, after_restart=views, survivors=survivors,
                       stall_over_bound=ratios, crash_step=crash, previous_step=prev, victim=victim)


# ------------------------------------------------------------------------------------------ running
def setup(args: argparse.Namespace) -> Ctx:
    import datetime as _dt

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --standalone --nproc-per-node 4 "
                         "--max-restarts 1 "
                         "bench/multi_rank.py --device cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = _dt.timedelta(seconds=args.timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun shares its rendezvous TCPStore with the workers and keeps it across restarts; without a
        # prefix per attempt the restarted ranks read the dead attempt's keys (gloo: connectFullMesh refused;
        # NCCL: a stale unique id; pytorch/pytorch#135712). So each attempt gets its own key space.
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"sdcw-multirank/attempt-{attempt}", base),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    from checksums.monitor import _gpu_uuid

    uid = _gpu_uuid(device)
    uuids: list[Any] = [None] * world
    dist.all_gather_object(uuids, uid)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    workdir = Path(args.workdir or f"/tmp/sdcw-mr-{run_id}-{os.getppid()}")
    tag = [uuid.uuid4().hex[:10]]
    if attempt == 0:
        dist.broadcast_object_list(tag, src=0)
        if rank == 0:
            workdir.mkdir(parents=True, exist_ok=True)
            for f in workdir.iterdir():
                if f.name == STATE_FILE or f.name.startswith(MARKERS):
                    f.unlink()
            (workdir / "tag").write_text(tag[0])
        dist.barrier()
    else:
        tag = [(workdir / "tag").read_text().strip()]
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    if not args.verbose:   # the events are the evidence here; N ranks logging each would drown the output
        logging.getLogger("checksums.monitor").setLevel(logging.ERROR)
    return Ctx(args, rank, world, device, uid, [str(u) for u in uuids], attempt, workdir, tag[0])


def print_part(ctx: Ctx, res: dict[str, Any]) -> None:
    verdict = "PASS" if res["passed"] else "FAIL"
    took = f" ({res['seconds']:.1f} s)" if "seconds" in res else ""
    ctx.say(f"[part {res['part']}] {res['title']}: {verdict}{took}\n    {res['evidence']}")


def print_table(ctx: Ctx, meta: dict[str, Any], results: list[dict[str, Any]]) -> None:
    ctx.say(f"\nmulti_rank: {meta['world']} ranks, {meta['backend']} on {meta['device']}, "
            f"torch {meta['torch']}, "
            f"{meta['host']}, {meta['date']}")
    ctx.say(f"{'part':<5}{'check':<34}{'result':<8}key figure")
    for r in sorted(results, key=lambda r: r["part"]):
        ctx.say(f"{r['part']:<5}{r['title']:<34}{'PASS' if r['passed'] else 'FAIL':<8}{key_figure(r)}")


def key_figure(r: dict[str, Any]) -> str:
    d = r["data"]
    if "error" in d:
        return f"error: {d['error'][:80]}"
    if r["part"] == 1:
        v = d["views"][0]
        m = v["flip"]["mismatches"]
        return (f"named {[s[0] for s in m[0]['suspects']] if m else []} at step {m[0]['step'] if m else '-'} "
                f"(flipped {d['flipped']}); {d['clean_steps']} clean steps, "
                f"{sum(len(x['clean']['events']) for x in d['views'])} events")
    if r["part"] == 2:
        return (f"{d['off_ms']:.2f} -> {d['monitor_ms']:.2f} ms/step ({d['overhead_pct']:+.2f}%), "
                f"gather {d['all_gather_us']:.0f} us")
    if r["part"] == 3:
        return f"corrupted {d['corrupted_label'][:22]}: named {[x[:22] for x in d['odd']] or d['split']}"
    if r["part"] == 4:
        v = d["after_restart"][0]
        return (f"step {d['crash_step']} {v['crash_state']} {v['crash_shards']}/{len(d['after_restart'])}, "
                f"restored {d['previous_step']}; "
                f"stall/bound median {statistics.median(d['stall_over_bound']):.2f}")
    if r["part"] == 5:
        m = d["views"][d["flipped"]]["mismatches"]
        return (f"mesh {d['mesh'][0]}x{d['mesh'][1]}: flipped {d['flipped']}, its group named "
                f"{[s[0] for s in m[0]['suspects']] if m else []}, other groups quiet")
    return ""


def _try(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # reported to every rank, which then fail the part together
        log.exception("failed")
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_part(ctx: Ctx, part: int, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        res = fn()
    except Exception as exc:  # a part that breaks is a FAIL with its error, the others still run
        log.exception("part %d failed", part)
        why = f"{type(exc).__name__}: {exc}"
        res = part_result(part, False, f"error: {why}", error=why)
    res["seconds"] = time.perf_counter() - t0
    print_part(ctx, res)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if 4 in args.parts and max_restarts < 1:
        print("multi_rank: part 4 kills a rank mid-save and needs the job restarted: run torchrun with "
              "--max-restarts 1 (or leave part 4 out: --parts 1,2,3,5)", file=sys.stderr)
        return 2
    ctx = setup(args)
    if ctx.world < 2:
        ctx.say("multi_rank: needs at least 2 ranks")
        return 2
    meta = {"world": ctx.world, "device": str(ctx.device.type), "backend": dist.get_backend(),
            "torch": torch.__version__, "host": socket.gethostname(), "gpus": ctx.uuids if ctx.cuda else [],
            "gpu_name": torch.cuda.get_device_name(ctx.device) if ctx.cuda else platform.processor() or "cpu",
            "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv if argv is None else argv, "parts": args.parts,
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    state_path = ctx.workdir / STATE_FILE
    if ctx.attempt == 0:
        results: list[dict[str, Any]] = []
        parts = {1: lambda: part_vote(ctx), 2: lambda: part_cost(ctx), 3: lambda: part_canary(ctx),
                 5: lambda: part_hsdp(ctx)}
        for p in args.parts:
            if p in parts:
                results.append(run_part(ctx, p, parts[p]))
        save_info, client, armed = None, None, {"on": False}
        if 4 in args.parts:
            agent: dict[str, Any] = {"started_here": False}
            try:
                agent = _part_agent(ctx)
                save_info, client, armed = part_ckpt_save(ctx, agent)
            except Exception as exc:
                log.exception("part 4 (saves) failed")
                results.append(part_result(4, False, f"error before the kill: {type(exc).__name__}: {exc}",
                                           error=f"{type(exc).__name__}: {exc}"))
                print_part(ctx, results[-1])
                if ctx.rank == 0 and agent.get("started_here"):
                    stop_agent(agent)
        if ctx.rank == 0:
            state_path.write_text(json.dumps({"meta": meta, "results": results, "save_info": save_info,
                                              "final": save_info is None}))
        dist.barrier()
        if save_info is not None:
            crash_save(ctx, save_info, client, armed)   # never returns: this attempt ends with the kill
    else:
        if not state_path.exists():
            ctx.say(f"multi_rank: restarted (attempt {ctx.attempt}) but the first attempt left no results in "
                    f"{state_path}: it failed before part 4's kill (see its output above)")
            dist.destroy_process_group()
            return 1
        state = json.loads(state_path.read_text())
        results, save_info, meta = state["results"], state["save_info"], state["meta"]
        if save_info is not None and not state["final"]:
            results.append(run_part(ctx, 4, lambda: part_ckpt_restore(ctx, save_info)))
            if ctx.rank == 0:
                state["final"] = True
                state["results"] = results
                state_path.write_text(json.dumps(state))
                stop_agent(save_info["agent"])
        meta["restarts"] = ctx.attempt
    passed = all(r["passed"] for r in results)
    print_table(ctx, meta, results)
    if ctx.rank == 0 and args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "passed": passed, "results": results}, indent=1))
    dist.barrier()
    if ctx.rank == 0 and args.workdir is None:
        if passed:
            import shutil

            shutil.rmtree(ctx.workdir, ignore_errors=True)
        else:
            print(f"multi_rank: kept {ctx.workdir} (agent.log, the first attempt's results)", flush=True)
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
