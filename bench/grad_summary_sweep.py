"""Which launch configuration of the fused gradient summary reads a DDP bucket fastest, on one GPU, in one run
(`python -m bench.bench_grad_summary --device cuda --sweep`; this module is that flag's body).

Why: in a GPT-2-small DDP step on the H200 torch.profiler saw `gs_partials_kernel` read the step's 13 fp32
buckets (498 MB) at ~1.5 TB/s (0.332 ms of kernels a step), where HBM reads at ~4.2 TB/s. The plan's
defaults (checksums/grad_summary_triton.py: BLOCK, num_warps, work items per SM, one launch or two) are read
from SDCWATCH_GS_BLOCK, SDCWATCH_GS_WARPS, SDCWATCH_GS_ITEMS_PER_SM and SDCWATCH_GS_ONE_LAUNCH; this finds
the values to put there. In order:

1. the grid: fp32 and bf16 buckets of 25 and 40 MB (``--dtypes``, ``--sizes``), every BLOCK in
   {512, 1024, 2048, 4096} x num_warps {4, 8, 16} x items/SM {1, 2, 4, 8, 16, 32} x one launch or two
   (`GRID`): `GradSummaryPlan.run_async` per call, in GB/s and against a plain read of the same buffers
   (``buf.sum(dtype=torch.float32)``) timed in the same run. Then the in-place scaled variant (the summary
   that also scales the bucket by 1/world: scale 0.5, then 2.0 on the next rotation, so the buffers keep
   their values) for the default and each case's best three.
2. the GPT-2-small step: its 13 fp32 buckets as DDP cuts them (`gpt2_bucket_numels`: 9.4 MB, 11 x 28.4 MB
   and 176 MB, the tied embedding alone being 154 MB), launched back to back as one step launches them, for
   the default and the grid's best three (by the geometric mean over the cases of time against the
   default's): device time a step and its share of the step's 41 ms of device time (docs/BENCHMARKS.md).
3. a short table last: each case's best against the default, the step's times, and the environment that
   selects the configuration with the fastest step.

Timing is device time: each measurement runs a batch of calls once (first launches compile and load), then
captures it as one CUDA graph and replays it between CUDA events; the median over `REPLAYS` replays, per
call. A graph leaves the host's launch cost out, as the profiler's kernel times did; so the one-launch
form's saving, a launch's host time a bucket (docs/BENCHMARKS.md), is not in these numbers.
The calls rotate over several buffers of the size, together more than twice the H200's 60 MB L2, so the
bytes come from HBM as in training. The read and the default are timed at the start and again after the
grid (the default a third time inside it): their spread is the noise floor of a comparison.

Rows: each configuration's row of a case's first buffer is compared with the default's: the fingerprint
words and the max-abs bit for bit, the norm to 1e-5 relative (another cut into items sums the squares in
another order). A difference is printed as MISMATCH, the configuration leaves the rankings, and the run
exits non-zero after the table. A configuration the plan rejects is counted; one that fails to compile or
launch is printed with its error and counted; neither stops the sweep.

Budget: ``--sweep-budget`` seconds (default 100) from the sweep's start; the grid stops at 85% of it, the
scaled timings at all of it, and what is left is skipped and counted. Compiles are inside it: each
BLOCK x num_warps x launches x dtype compiles on its first launch (48 for the grid on a cold Triton cache;
each combination line says how long its first launch took). The GPT-2 step runs after it (a few seconds).

On the CPU (``--device cpu``: TRITON_INTERPRET=1) the grid is 4 combinations of a 20 KB bucket and the GPT-2
cut is shrunk 10^5 times, timed on the host: it shows that everything runs (tests/test_grad_summary_triton.py
runs it); the numbers mean nothing there.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from bench.bench_grad_summary import L2_BYTES
from checksums.grad_checks import stats_of
from checksums.grad_summary_triton import (
    DEFAULT_BLOCK,
    DEFAULT_ITEMS_PER_SM,
    DEFAULT_ONE_LAUNCH,
    DEFAULT_WARPS,
    GradSummaryPlan,
)

# block, num_warps, items per SM, one launch
GRID = {"cuda": ((512, 1024, 2048, 4096), (4, 8, 16), (1, 2, 4, 8, 16, 32), (True, False)),
        "cpu": ((512, 1024), (4,), (1,), (True, False))}
SIZES_MB = {"cuda": (25.0, 40.0), "cpu": (0.02,)}
MIN_CALLS = {"cuda": 24, "cpu": 2}       # calls in a timed batch (a graph's length on CUDA)
STEPS = {"cuda": 4, "cpu": 2}            # GPT-2 steps in a timed batch
REPLAYS = 7
STEP_DEVICE_S = 0.041                    # the GPT-2-small DDP step's device time on the H200 (docs/BENCHMARKS.md)
CPU_SHRINK = 100_000                     # the GPT-2 cut on the CPU: each bucket this many times smaller
NORM_REL = 1e-5
GRID_SHARE = 0.85                        # of the budget, for the grid; the rest for the scaled timings
TOP = 3
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Config(NamedTuple):
    """One launch configuration of `GradSummaryPlan`; printed block/warps/items-per-SM/launches."""
    block: int
    warps: int
    items_per_sm: int
    one_launch: bool

    def plan(self, like: torch.Tensor) -> GradSummaryPlan:
        return GradSummaryPlan(like, block=self.block, num_warps=self.warps, items_per_sm=self.items_per_sm,
                               one_launch=self.one_launch)

    def env(self) -> str:
        """The environment that makes this the plan's default (read when grad_summary_triton is imported)."""
        return (f"SDCWATCH_GS_BLOCK={self.block} SDCWATCH_GS_WARPS={self.warps} "
                f"SDCWATCH_GS_ITEMS_PER_SM={self.items_per_sm} SDCWATCH_GS_ONE_LAUNCH={int(self.one_launch)}")

    def __str__(self) -> str:
        return f"{self.block}/{self.warps}/{self.items_per_sm}/{1 if self.one_launch else 2}"


DEFAULT = Config(DEFAULT_BLOCK, DEFAULT_WARPS, DEFAULT_ITEMS_PER_SM, DEFAULT_ONE_LAUNCH)


def grid_groups(kind: str) -> list[list[Config]]:
    """The grid in groups that share a compile per dtype (block x warps x launches), items/SM inside."""
    blocks, warps, per_sms, ones = GRID[kind]
    return [[Config(b, w, s, o) for s in per_sms] for b, w, o in itertools.product(blocks, warps, ones)]


def ddp_bucket_numels(numels: Sequence[int], elem_bytes: int,
                      caps: Sequence[int] = (1 << 20, 25 << 20)) -> list[int]:
    """DDP's cut of parameters (element counts, in bucket order) into buckets: a bucket closes once its bytes
    reach the current cap, the first cap serving the first bucket and the last every later one (torch's
    `_compute_bucket_assignment_by_size` with DDP's default caps, 1 MiB then 25 MiB)."""
    out: list[int] = []
    size, k = 0, 0
    for n in numels:
        size += n
        if size * elem_bytes >= caps[k]:
            out.append(size)
            size, k = 0, min(k + 1, len(caps) - 1)
    if size:
        out.append(size)
    return out


def gpt2_bucket_numels() -> list[int]:
    """GPT-2 small's fp32 gradient buckets (element counts) in the order a step launches them: the project's
    model (bench.tiny_gpt, on the meta device), parameters in the order backward readies their gradients
    (the reverse of registration; the tied embedding, used first, is ready last), cut as DDP cuts them when
    it rebuilds its buckets in that order after the first step."""
    from bench.tiny_gpt import GPTConfig, TinyGPT

    with torch.device("meta"):
        model = TinyGPT(GPTConfig())
    return ddp_bucket_numels([p.numel() for p in model.parameters() if p.requires_grad][::-1], 4)


def row_difference(row: torch.Tensor, ref: torch.Tensor) -> str:
    """'' when `row` (int64 [4], on the CPU) summarises the same bytes as `ref`: fingerprint words and max-abs
    bit for bit, the norm to NORM_REL; otherwise what differs."""
    if not torch.equal(row[2:], ref[2:]):
        return f"fingerprint words {row[2:].tolist()} != the default's {ref[2:].tolist()}"
    if row[1].item() != ref[1].item():
        return f"max-abs {stats_of(row)[1].item()!r} != the default's {stats_of(ref)[1].item()!r}"
    norm, norm0 = stats_of(row)[0].item(), stats_of(ref)[0].item()
    if not abs(norm - norm0) <= NORM_REL * abs(norm0):
        return f"norm {norm!r} vs the default's {norm0!r}"
    return ""


class Timer:
    """Median seconds per call of a batch of `n` calls ``call(0) .. call(n - 1)``.

    CUDA: device time. The batch runs once eagerly (compiles, module loads), is captured as one graph on a
    side stream, and is replayed once untimed, then REPLAYS times between events. CPU: each call on the host
    clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def per_call(self, call: Callable[[int], object], n: int) -> float:
        if self._side is None:
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                call(i)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        for i in range(n):
            call(i)
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._side):
            graph.capture_begin()
            try:
                for i in range(n):
                    call(i)
            finally:
                graph.capture_end()
        current.wait_stream(self._side)
        graph.replay()
        times = []
        for _ in range(REPLAYS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / n)
        return statistics.median(times)


@dataclass
class Case:
    """Buffers of one size and dtype: several on CUDA, together over twice the L2 (a batch reads HBM)."""
    dtype: torch.dtype
    mb: float
    bufs: list[torch.Tensor]
    ref: torch.Tensor | None = None                   # the default's row of bufs[0]
    read_s: list[float] = field(default_factory=list)
    default_s: list[float] = field(default_factory=list)

    @classmethod
    def make(cls, mb: float, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> "Case":
        es = torch.empty(0, dtype=dtype).element_size()
        numel = max(1, int(mb * 1e6) // es) + 3          # an odd tail, like a real bucket's end
        nbuf = max(1, math.ceil(2.2 * L2_BYTES / (numel * es))) if device.type == "cuda" else 1
        return cls(dtype, numel * es / 1e6,
                   [(torch.randn(numel, generator=gen, device=device) * 1e-3).to(dtype) for _ in range(nbuf)])

    @property
    def name(self) -> str:
        return f"{SHORT[self.dtype]} {self.mb:.3g} MB"

    @property
    def nbytes(self) -> int:
        return self.bufs[0].numel() * self.bufs[0].element_size()

    def calls(self, kind: str, pairs: bool = False) -> int:
        """Calls in a timed batch: whole rotations over the buffers (twice as many with `pairs`)."""
        rot = len(self.bufs) * (2 if pairs else 1)
        return rot * math.ceil(MIN_CALLS[kind] / rot)

    def time_read(self, timer: Timer, kind: str) -> float:
        bufs = self.bufs
        s = timer.per_call(lambda i: bufs[i % len(bufs)].sum(dtype=torch.float32), self.calls(kind))
        self.read_s.append(s)
        return s


def _scale(i: int, nbuf: int) -> float:
    """0.5 on one rotation over the buffers, 2.0 on the next: each buffer is back to its bits after a pair."""
    return 0.5 if (i // nbuf) % 2 == 0 else 2.0


def measure(cfg: Config, case: Case, timer: Timer, kind: str, first_launch: dict, scaled: bool = False) -> dict:
    """cfg's plan for the case: its row of bufs[0] checked against the default's, then timed. Never raises:
    a rejection, a compile or launch error, or a differing row is the result's status."""
    res: dict = {**cfg._asdict(), "dtype": SHORT[case.dtype], "mb": case.mb, "scaled": scaled}
    try:
        plan = cfg.plan(case.bufs[0])
    except ValueError as exc:
        return {**res, "status": "rejected", "error": str(exc)}
    res["items"] = plan.n_items
    bufs, nbuf = case.bufs, len(case.bufs)
    out = torch.empty(4, dtype=torch.int64, device=bufs[0].device)
    try:
        key = (cfg.block, cfg.warps, cfg.one_launch, case.dtype, scaled)
        t0 = time.perf_counter()
        if scaled:      # a pair of calls leaves the buffer as it was
            plan.run_async(bufs[0], out, scale=0.5)
            plan.run_async(bufs[0], out, scale=2.0)
        row = plan.run_async(bufs[0], out).cpu()
        first_launch.setdefault(key, time.perf_counter() - t0)      # the first of a key compiles
        res["first_launch_s"] = first_launch[key]
        res["row"] = row.tolist()
        bad = "" if case.ref is None else row_difference(row, case.ref)
        if bad:
            return {**res, "status": "MISMATCH", "error": bad}
        if scaled:
            s = timer.per_call(lambda i: plan.run_async(bufs[i % nbuf], out, scale=_scale(i, nbuf)),
                               case.calls(kind, pairs=True))
        else:
            s = timer.per_call(lambda i: plan.run_async(bufs[i % nbuf], out), case.calls(kind))
    except Exception as exc:  # noqa: BLE001 (a compile or launch error fails this combination, not the sweep)
        return {**res, "status": "failed", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {**res, "status": "ok", "s": s, "GBps": case.nbytes / s / 1e9}


def _say(r: dict, case: Case) -> None:
    what = f"{case.name:14} {str(_cfg(r)):13}{' scaled' if r['scaled'] else ''}"
    if r["status"] == "ok":
        first = f"  first launch {r['first_launch_s']:.2f} s" if r["first_launch_s"] > 0.2 else ""
        print(f"  {what} ({r['items']:5d} items) {r['s'] * 1e6:9.2f} us {r['GBps']:8.1f} GB/s "
              f"{case.read_s[0] / r['s']:5.2f}x read{first}", flush=True)
    else:
        print(f"  {r['status'].upper()} {what}: {r['error']}", flush=True)


def _cfg(r: dict) -> Config:
    return Config(r["block"], r["warps"], r["items_per_sm"], r["one_launch"])


def rank(grid: list[dict], cases: list[Case]) -> list[tuple[float, Config]]:
    """Configurations measured in every case, by the geometric mean over the cases of their time over the
    default's (median of its measurements): the fastest first."""
    times: dict[Config, dict[str, float]] = {}
    for r in grid:
        if r["status"] == "ok":
            times.setdefault(_cfg(r), {})[f"{r['dtype']} {r['mb']}"] = r["s"]
    base = {f"{SHORT[c.dtype]} {c.mb}": statistics.median(c.default_s) for c in cases}
    scored = [(math.exp(statistics.fmean(math.log(t[k] / base[k]) for k in base)), cfg)
              for cfg, t in times.items() if set(t) == set(base)]
    return sorted(scored)


def gpt2_step(configs: list[Config], device: torch.device, gen: torch.Generator, timer: Timer,
              kind: str) -> dict:
    """The GPT-2 step's buckets summarised back to back by each configuration (the first is the reference
    for the rows): device time a step, plain and scaled; the same buckets' plain reads beside them."""
    numels = gpt2_bucket_numels()
    if kind == "cpu":
        numels = [max(1, n // CPU_SHRINK) for n in numels]
    bufs = [torch.randn(n, generator=gen, device=device) * 1e-3 for n in numels]
    nbytes = sum(n * 4 for n in numels)
    steps = STEPS[kind]
    res: dict = {"bucket_numels": numels, "nbytes": nbytes,
                 "read_s": timer.per_call(lambda i: [b.sum(dtype=torch.float32) for b in bufs], steps),
                 "configs": []}
    ref: torch.Tensor | None = None
    runs = []
    for cfg in configs:
        r: dict = {**cfg._asdict(), "status": "ok"}
        res["configs"].append(r)
        try:
            plans = [cfg.plan(b) for b in bufs]
            outs = torch.empty(len(bufs), 4, dtype=torch.int64, device=device)

            def step(i: int, plans: list = plans, outs: torch.Tensor = outs, scale: bool = False) -> None:
                for k, (p, b) in enumerate(zip(plans, bufs)):
                    p.run_async(b, outs[k], scale=(0.5 if i % 2 == 0 else 2.0) if scale else 1.0)

            step(0)
            rows = outs.cpu()
            ref = rows if ref is None else ref
            bad = {k: d for k in range(len(bufs)) if (d := row_difference(rows[k], ref[k]))}
            if bad:
                k = min(bad)
                r.update(status="MISMATCH", error=f"bucket {k}: {bad[k]} ({len(bad)} buckets differ)")
                continue
            r["s"] = timer.per_call(step, steps)
            runs.append((r, step))
        except Exception as exc:  # noqa: BLE001 (one configuration's failure, not the sweep's)
            r.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
    for r, step in runs:     # scaled last: a failure half-way would leave the buffers scaled for the rows above
        try:
            r["scaled_s"] = timer.per_call(lambda i, step=step: step(i, scale=True), steps)
        except Exception as exc:  # noqa: BLE001
            r["scaled_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return res


def run_sweep(device: torch.device, dtypes: list[torch.dtype], sizes: list[float] | None, budget_s: float,
              json_path: str = "") -> dict:
    kind = device.type
    t_start = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(19)
    timer = Timer(device)
    cases = [Case.make(mb, dt, device, gen) for dt in dtypes for mb in (sizes or SIZES_MB[kind])]
    groups = grid_groups(kind)
    total = len(cases) * sum(len(g) for g in groups)
    print(f"sweep: {total} combinations (block/warps/items-per-SM/launches) over "
          f"{', '.join(c.name for c in cases)}; default {DEFAULT}; budget {budget_s:.0f} s "
          f"(the grid until {GRID_SHARE * budget_s:.0f} s)", flush=True)
    first_launch: dict = {}
    for c in cases:      # the reference row and times, before any other configuration
        c.time_read(timer, kind)
        r = measure(DEFAULT, c, timer, kind, first_launch)
        if r["status"] != "ok":
            raise SystemExit(f"the default configuration {DEFAULT} fails on {c.name}: {r.get('error')}")
        c.ref, c.default_s = torch.tensor(r["row"]), [r["s"]]
        print(f"  {c.name:14} read {c.read_s[0] * 1e6:9.2f} us {c.nbytes / c.read_s[0] / 1e9:8.1f} GB/s; "
              f"default {DEFAULT} {r['s'] * 1e6:9.2f} us {r['GBps']:8.1f} GB/s", flush=True)
    grid: list[dict] = []
    skipped = 0
    for group in groups:
        for c in cases:
            for cfg in group:
                if time.perf_counter() - t_start > GRID_SHARE * budget_s:
                    skipped += 1
                    continue
                grid.append(r := measure(cfg, c, timer, kind, first_launch))
                if cfg == DEFAULT and r["status"] == "ok":
                    c.default_s.append(r["s"])
                _say(r, c)
    for c in cases:      # again after the grid: the spread of repeated measurements
        c.time_read(timer, kind)
        r = measure(DEFAULT, c, timer, kind, first_launch)
        if r["status"] == "ok":
            c.default_s.append(r["s"])
    ranked = rank(grid, cases)
    scaled: list[dict] = []
    for c in cases:      # the scaled variant: the default and this case's best three
        name = SHORT[c.dtype]
        mine = sorted((r for r in grid if r["status"] == "ok" and r["dtype"] == name and r["mb"] == c.mb),
                      key=lambda r: r["s"])
        for cfg in dict.fromkeys([DEFAULT] + [_cfg(r) for r in mine[:TOP]]):
            if time.perf_counter() - t_start > budget_s:
                skipped += 1
                continue
            scaled.append(r := measure(cfg, c, timer, kind, first_launch, scaled=True))
            _say(r, c)
    sweep_s = time.perf_counter() - t_start
    best = [cfg for _, cfg in ranked if cfg != DEFAULT][:TOP]
    step = gpt2_step([DEFAULT] + best, device, gen, timer, kind)
    res = {"device": kind, "default": DEFAULT._asdict(), "budget_s": budget_s, "sweep_s": sweep_s,
           "total_s": time.perf_counter() - t_start, "skipped": skipped, "combinations": total,
           "first_launch_s": sum(first_launch.values()), "compiles": len(first_launch),
           "cases": [{"dtype": SHORT[c.dtype], "mb": c.mb, "buffers": len(c.bufs),
                      "read_s": c.read_s, "default_s": c.default_s} for c in cases],
           "grid": grid, "scaled": scaled, "ranked": [(s, cfg._asdict()) for s, cfg in ranked], "gpt2_step": step}
    report(res, cases, grid, scaled, ranked, step)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    bad = [r for r in grid + scaled + step["configs"] if r["status"] == "MISMATCH"]
    if bad:
        raise SystemExit(f"{len(bad)} configuration(s) whose rows differ from the default's (MISMATCH above)")
    return res


def report(res: dict, cases: list[Case], grid: list[dict], scaled: list[dict],
           ranked: list[tuple[float, Config]], step: dict) -> None:
    """The short table, last (the part of the output a device run's reply keeps)."""
    clock = ("device time per call, the bytes from HBM" if res["device"] == "cuda"
             else "host time per call, interpreted: meaningless")
    print(f"\nbest per case (block/warps/items-per-SM/launches; {clock}; x read: GB/s over a plain read's)")
    print(f"{'case':15} {'read GB/s':>10} {'default GB/s':>12} {'x read':>6} {'best':>14} {'GB/s':>8} "
          f"{'x read':>6} {'scaled best/default GB/s':>24}  noise (read, default: max/min)")
    for c in cases:
        name = SHORT[c.dtype]
        mine = [r for r in grid if r["status"] == "ok" and r["dtype"] == name and r["mb"] == c.mb]
        read, dflt = statistics.median(c.read_s), statistics.median(c.default_s)
        line = f"{c.name:15} {c.nbytes / read / 1e9:10.1f} {c.nbytes / dflt / 1e9:12.1f} {read / dflt:6.2f}"
        if mine:
            b = min(mine, key=lambda r: r["s"])
            line += f" {str(_cfg(b)):>14} {b['GBps']:8.1f} {read / b['s']:6.2f}"
        else:
            line += f" {'-':>14} {'-':>8} {'-':>6}"
        sc = {_cfg(r): r["GBps"] for r in scaled if r["status"] == "ok" and r["dtype"] == name and r["mb"] == c.mb}
        sc_best = max(sc.values(), default=float("nan"))
        line += (f" {sc_best:11.1f}/{sc.get(DEFAULT, float('nan')):<12.1f}"
                 f"  {max(c.read_s) / min(c.read_s):.3f}, {max(c.default_s) / min(c.default_s):.3f}")
        print(line)
    gb = step["nbytes"] / 1e9
    print(f"\nGPT-2 small step: {len(step['bucket_numels'])} fp32 buckets, {gb * 1e3:.1f} MB "
          f"(largest {max(step['bucket_numels']) * 4 / 1e6:.1f} MB), back to back; share of a "
          f"{STEP_DEVICE_S * 1e3:.0f} ms step's device time")
    print(f"{'config':20} {'ms/step':>8} {'share':>7} {'TB/s':>6} {'scaled ms':>9}  rows")
    read_tag = f"read ({len(step['bucket_numels'])} sums)"
    print(f"{read_tag:20} {step['read_s'] * 1e3:8.3f} {step['read_s'] / STEP_DEVICE_S * 100:6.2f}% "
          f"{gb / step['read_s'] / 1e3:6.2f}")
    for r in step["configs"]:
        tag = f"{'default ' if _cfg(r) == DEFAULT else ''}{_cfg(r)}"
        if "s" in r:
            print(f"{tag:20} {r['s'] * 1e3:8.3f} {r['s'] / STEP_DEVICE_S * 100:6.2f}% {gb / r['s'] / 1e3:6.2f} "
                  f"{r.get('scaled_s', float('nan')) * 1e3:9.3f}  ok")
        else:
            print(f"{tag:20} {r['status'].upper()}: {r['error']}")
    counts = {s: sum(r["status"] == s for r in grid + scaled) for s in ("ok", "rejected", "failed", "MISMATCH")}
    print(f"\n{res['combinations']} grid combinations + {len(scaled)} scaled: {counts['ok']} measured, "
          f"{counts['rejected']} rejected, {counts['failed']} failed, {counts['MISMATCH']} MISMATCH, "
          f"{res['skipped']} skipped past the {res['budget_s']:.0f} s budget; {res['compiles']} first launches "
          f"{res['first_launch_s']:.1f} s; sweep {res['sweep_s']:.1f} s, all {res['total_s']:.1f} s")
    timed_step = [r for r in step["configs"] if "s" in r]
    if ranked and timed_step:
        win = min(timed_step, key=lambda r: r["s"])
        dflt = next((r for r in timed_step if _cfg(r) == DEFAULT), None)
        vs = f" against {dflt['s'] * 1e3:.3f} ms at the default" if dflt else ""
        print(f"fastest GPT-2 step: {_cfg(win)}, {win['s'] * 1e3:.3f} ms{vs}; the grid's best by time over the "
              f"default's (geometric mean over the cases): "
              f"{', '.join(f'{cfg} {s:.2f}x' for s, cfg in ranked[:TOP + 1])}")
        print(f"set: {_cfg(win).env()}")
    else:
        print("set: nothing measured in every case (see the lines above)")
