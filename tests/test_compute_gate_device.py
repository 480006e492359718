"""The compute gate's device path (checksums/compute_gate.py with checksums/device_verdict.py): the verdict
replayed from a CUDA graph equals the eager rule on every input, and a training run with the graph masks
and trains bit for bit as one with the eager ops. On the CPU the same run checks the path without graphs
(the suite); on a GPU (bench/gpu_run.sh: `pytest -m gpu`) with them."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from rank_spawn import spawn

CUDA = torch.cuda.is_available()


def _rows_of(stats: torch.Tensor) -> torch.Tensor:
    """int64 rows [world * buckets, 4] whose first two words are `stats` [world, buckets, 2] (float64)."""
    w, b, _ = stats.shape
    rows = torch.zeros(w * b, 4, dtype=torch.int64, device=stats.device)
    rows[:, :2] = stats.reshape(-1, 2).contiguous().view(torch.int64)
    return rows


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_graph_verdict_is_the_eager_rule_on_every_input() -> None:
    from checksums.device_verdict import DeviceVerdict, device_flag
    from checksums.grad_checks import stats_of

    world, buckets, margin = 5, 7, 3.0
    v = DeviceVerdict(margin, graphs=True)
    inp = v.input(world * buckets, torch.device("cuda"))
    spread = torch.full((buckets, 4), math.log(1.05), dtype=torch.float64, device="cuda")   # 4 columns
    g = torch.Generator().manual_seed(3)
    cases = []
    for k in range(40):
        stats = torch.exp(torch.randn(world, buckets, 2, generator=g, dtype=torch.float64) * 0.01)
        if k % 4 == 1:
            stats[k % world, k % buckets, k % 2] *= 1.5          # an outlier far beyond the spread
        if k % 4 == 2:
            stats[k % world, 0, 0] = float("nan") if k % 8 == 2 else float("inf")
        if k % 5 == 3:
            stats[k % world, k % buckets, 0] *= 1.0 + 2.5 * math.log(1.05)   # near the margin
        cases.append(stats)
    flags = []
    for k, stats in enumerate(cases):
        if k == 20:
            spread.mul_(20.0)                 # the gate updates the spread in place: the graph reads it
        inp.copy_(_rows_of(stats.cuda()))
        rows = inp.view(world, buckets, 4)
        got = v.flag(rows, spread)
        want = device_flag(stats_of(rows), spread, margin)
        flags.append((float(got), float(want)))
    assert v.captures == 1                    # one capture, replayed 39 times
    assert all(a == b for a, b in flags), flags
    assert {a for a, _ in flags} == {0.0, 1.0}
    # a new input buffer (DDP rebuilt its buckets) captures again
    inp2 = v.input(world * (buckets + 1), torch.device("cuda"))
    spread2 = torch.full((buckets + 1, 4), 0.1, dtype=torch.float64, device="cuda")
    inp2.zero_()
    inp2[:, 0] = torch.tensor(1.0, dtype=torch.float64).view(torch.int64)
    assert float(v.flag(inp2.view(world, buckets + 1, 4), spread2)) == 0.0 and v.captures == 2


class _NeverStored(dict):
    """A bucket -> bound launch map that keeps nothing: the hook's general path on every call."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def _train(rank: int, init: str, device_name: str, out: str, variant: str = "graphs") -> None:
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks

    device = torch.device(device_name)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=1)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    poison = {"step": -1}

    def inject(idx: int, buf: torch.Tensor) -> None:
        if poison["step"] == arm_step["now"] and idx == 0:
            buf.view(-1)[3] = float("nan")

    arm_step = {"now": 0}
    runs = []
    # variant "graphs": the verdict through a CUDA graph, then eager; "side": the bucket summaries and
    # reductions on the hooks' side stream, then on the backward's stream; "fast" ("fast-inline": without the
    # side stream): the Python hook's bound launches (`_fast_path`), then its general path every call;
    # "native" ("native-inline"): the C++ hook's bound launches, then the Python hook's general path every
    # call (no fault injection there, which keeps every bucket on the Python fallback: the NaN is the batch's)
    native_variant = variant.startswith("native")
    for first in (True, False):
        m = nn.Sequential(*[type(layer)(*(() if isinstance(layer, nn.GELU) else
                                          (layer.in_features, layer.out_features))) for layer in base])
        m.load_state_dict(base.state_dict())
        m.to(device)
        ddp = DDP(m, bucket_cap_mb=0.01)                     # several buckets
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2, fused=True)
        checks = ComputeChecks.attach(
            ddp, opt, mask="device", audit_every=4 if variant == "native-audits" else 0, warmup=3,
            loss_fn=lambda mod, b: nn.functional.mse_loss(mod(b[0]), b[1]),
            inject_bucket=None if native_variant else inject,
            side_stream=(first if variant == "side" else False if variant in ("fast-inline", "native-inline")
                         else None),
            native=(first if native_variant else False if variant.startswith("fast") else None))
        if (variant.startswith("fast") or native_variant) and not first:
            checks.summaries._fast = _NeverStored()      # the general path every call
        if variant == "graphs":
            checks._verdict.graphs = first
        runs.append((ddp, opt, checks))
    poison["step"] = 9
    masked_ok, same_every_step, same_rows = True, True, True
    # CUDA events made in each run's backward and rows() once warm (torch's `wait_stream` makes one a call)
    made = [0, 0]
    counting = {"run": -1}
    real_event = torch.cuda.Event

    class CountedEvent(real_event):  # type: ignore[misc, valid-type]
        def __new__(cls, *a: Any, **k: Any) -> Any:
            if counting["run"] >= 0:
                made[counting["run"]] += 1
            return real_event.__new__(cls, *a, **k)
    torch.cuda.Event = torch.cuda.streams.Event = CountedEvent   # (this spawned process only)
    g = torch.Generator().manual_seed(7)
    for s in range(1, 15):
        arm_step["now"] = s
        x, y = torch.randn(16, 32, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
        if native_variant and s == poison["step"]:
            x[3, 5] = float("nan")
        rows = []
        for k, (ddp, opt, checks) in enumerate(runs):
            before = [p.detach().clone() for p in ddp.parameters()]
            checks.retain((x, y))
            counting["run"] = k if s > 3 else -1
            nn.functional.mse_loss(ddp(x), y).backward()
            got_rows = checks.summaries.rows()
            counting["run"] = -1
            rows.append(got_rows.clone())    # (the gate clears them in the step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if s == poison["step"]:          # the NaN step's update was masked on the device
                masked_ok &= all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
        same_every_step &= all(torch.equal(a, b) for a, b in zip(runs[0][0].parameters(),
                                                                  runs[1][0].parameters()))
        same_rows &= rows[0].shape == rows[1].shape and torch.equal(rows[0], rows[1])
    with open(out, "w") as f:
        json.dump({"masked": masked_ok, "same": same_every_step, "same_rows": same_rows,
                   "sides": [len(c.summaries._sides) for _, _, c in runs], "events_made": made,
                   "fast": [len(c.summaries._fast) for _, _, c in runs],
                   "native": [c.summaries.native for _, _, c in runs],
                   "bound": [len(c.summaries._native.bound()) if c.summaries.native else 0
                             for _, _, c in runs],
                   "native_calls": [c.summaries._native.native_calls() if c.summaries.native else 0
                                    for _, _, c in runs],
                   "buckets": [len(c.summaries.layout) for _, _, c in runs],
                   "captures": [c._verdict.captures for _, _, c in runs],
                   "finishes": [c.status().hook_verdicts for _, _, c in runs],
                   "audits": [c.status().audits for _, _, c in runs],
                   "suspicions": [c.status().suspicions for _, _, c in runs],
                   "dropped": [c.status().dropped for _, _, c in runs],
                   "finite": all(bool(torch.isfinite(p).all()) for d, _, _ in runs for p in d.parameters())}, f)
    dist.destroy_process_group()


def _run(tmp_path, device: str, variant: str = "graphs") -> dict:
    import json
    out = tmp_path / "out.json"
    spawn(_train, (str(tmp_path / "init"), device, str(out), variant), nprocs=1)
    return json.loads(out.read_text())


class _Busy:
    """A CUDA event whose copy has not landed yet (as `query` says on a device running behind the host)."""

    def __init__(self, event: Any) -> None:
        self.event, self.waited = event, 0

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.waited += 1
        self.event.synchronize()

    def record(self) -> None:
        self.event.record()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_spread_change_reaches_the_device_at_once_even_while_its_buffer_is_busy() -> None:
    """Issue 19: every rank must judge a step against the same spread, or one rank's device masks an update
    the others apply. A change found while the pinned buffer's last copy still looked queued was put off to
    a later step: the step a rank took it on depended on its own device's timing. Now it is copied at once
    (the copy two changes ago waited for)."""
    import numpy as np

    from checksums.compute_gate import ComputeChecks
    from checksums.grad_checks import SpreadTracker

    gate = object.__new__(ComputeChecks)
    gate.tracker = SpreadTracker(warmup=0)
    gate._spread_dev, gate._spread_version, gate._spread_i = None, -1, 0
    gate._spread_pinned, gate._spread_done = [None, None], [None, None]
    gate._finish = None
    dev = torch.device("cuda")
    busy = []
    for k in range(6):
        gate.tracker._set(np.full((3, 2), 0.05 * (k + 1)), np.zeros(3, dtype=bool))
        got = gate._spread_on(dev)
        assert torch.equal(got.cpu(), torch.full((3, 2), 0.05 * (k + 1), dtype=torch.float64)), k
        for j, done in enumerate(gate._spread_done):     # each buffer's last copy now seems still queued
            if done is not None and not isinstance(done, _Busy):
                gate._spread_done[j] = _Busy(done)
                busy.append(gate._spread_done[j])
    assert sum(b.waited for b in busy) >= 3, "a busy buffer is waited for, not skipped"


def test_the_device_path_masks_a_nan_step_and_trains_on_cpu(tmp_path) -> None:
    got = _run(tmp_path, "cpu")
    assert got["masked"] and got["same"] and got["finite"], got
    assert got["captures"] == [0, 0]             # no graphs off CUDA
    assert got["suspicions"] == [1, 1] and got["dropped"] == [1, 1], got


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_graph_path_masks_and_trains_bit_for_bit_as_the_eager_one(tmp_path) -> None:
    got = _run(tmp_path, "cuda")
    assert got["masked"] and got["same"] and got["finite"], got
    assert got["captures"] == [1, 0], got        # captured once when the spread was armed; eager beside it
    assert got["suspicions"] == [1, 1] and got["dropped"] == [1, 1], got


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_summaries_on_a_side_stream_give_the_same_rows_mask_and_training(tmp_path) -> None:
    """Issue 19: `side_stream=True` (the summary and the reduction beside the backward) gives the rows, the
    masked NaN step and the weights of the summaries on the backward's own stream, bit for bit."""
    got = _run(tmp_path, "cuda", "side")
    assert got["sides"] == [1, 0], got
    # no event made a bucket or a step by the side stream's waits once warm (its two are kept and recorded
    # again): the side-stream run's backward and rows() make no more than those of the run without it
    assert got["events_made"][0] <= got["events_made"][1], got
    assert got["masked"] and got["same"] and got["same_rows"] and got["finite"], got
    assert got["suspicions"] == [1, 1] and got["dropped"] == [1, 1], got


def test_the_side_stream_option_is_inert_without_cuda(tmp_path) -> None:
    got = _run(tmp_path, "cpu", "side")
    assert got["sides"] == [0, 0], got           # CPU buckets: no stream made
    assert got["masked"] and got["same"] and got["same_rows"] and got["finite"], got


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
def test_deviations_take_torchs_lower_median(world: int) -> None:
    """The device rule's medians (from a sort: deterministic) are torch.median's, over the ranks and over a
    rank's buckets (the relative columns), for odd and even counts (5 and 4 buckets), with ties, zeros and
    non-finite values."""
    from checksums.grad_checks import _TINY, deviations

    g = torch.Generator().manual_seed(world)
    for k in range(40):
        buckets = 5 - k % 2
        stats = torch.exp(torch.randn(world, buckets, 2, generator=g, dtype=torch.float64))
        if k % 3 == 0:
            stats[0] = stats[-1]                                        # ties
        if k % 4 == 1:
            stats[k % world, k % buckets, 0] = [0.0, float("nan"), float("inf")][k % 3]
        x = torch.nan_to_num(stats, nan=0.0, posinf=0.0, neginf=0.0).clamp_min(_TINY).log()
        d = x - x.median(dim=0).values
        want = torch.cat([d.abs(), (d - d.median(dim=1, keepdim=True).values).abs()], dim=-1)
        assert torch.equal(deviations(stats), want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_device_rule_runs_under_deterministic_algorithms() -> None:
    """A job with torch.use_deterministic_algorithms(True) (no warn_only) gets a verdict, not an error
    (median(dim=) on CUDA raises there), eager and from the graph."""
    from checksums.device_verdict import DeviceVerdict, device_flag
    from checksums.grad_checks import stats_of

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        v = DeviceVerdict(3.0, graphs=True)
        inp = v.input(3 * 4, torch.device("cuda"))
        stats = torch.exp(torch.randn(3, 4, 2, dtype=torch.float64) * 0.01)
        stats[1, 2, 0] *= 2.0
        inp.copy_(_rows_of(stats.cuda()))
        spread = torch.full((4, 4), 0.05, dtype=torch.float64, device="cuda")
        rows = inp.view(3, 4, 4)
        assert float(device_flag(stats_of(rows), spread, 3.0)) == 1.0
        assert float(v.flag(rows, spread)) == 1.0 and v.captures == 1
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["fast", "fast-inline"])
def test_the_hooks_bound_launches_give_the_general_paths_rows_mask_and_training(tmp_path, variant: str) -> None:
    """Issue 19: once a bucket's layout settled, the hook launches its summary bound to the buffer and row
    (GradSummaryPlan.bound, integer addresses, the streams without Python stream objects): the rows, the
    masked NaN step (injected in a bucket the bound path summarises) and the weights are bit for bit those
    of the general path, on the side stream and without it."""
    got = _run(tmp_path, "cuda", variant)
    assert got["fast"][0] == got["buckets"][0] >= 1 and got["fast"][1] == 0, got   # every bucket bound, or none
    assert got["masked"] and got["same"] and got["same_rows"] and got["finite"], got
    assert got["suspicions"] == [1, 1] and got["dropped"] == [1, 1], got


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["native", "native-inline", "native-audits"])
def test_the_cpp_hooks_bound_launches_give_the_python_paths_rows_mask_and_training(tmp_path,
                                                                                   variant: str) -> None:
    """The C++ comm hook (checksums/native_hook.cpp) launching each bucket's bound summary itself, on the
    side stream and without it: the Python hook's general path's rows every step, the same masked NaN step
    (a NaN in the batch at step 9) and the same weights, bit for bit. Once the spread is armed the C++ hook
    also gathers the rows, replays the verdict's graph and copies rows and flag to the host slots itself
    (`arm_finish`): the NaN step is masked by that flag and judged from that slot; with audits every 4th
    step (host-path steps between the hook's) too."""
    got = _run(tmp_path, "cuda", variant)
    assert got["native"] == [True, False], got
    assert got["finishes"][0] >= 5 and got["finishes"][1] == 0, got
    assert got["audits"][0] == got["audits"][1] == (3 if variant == "native-audits" else 0), got
    assert got["bound"][0] == got["buckets"][0] >= 1 and got["fast"] == [0, 0], got   # bound in C++ only
    assert got["native_calls"][0] >= 5 * got["buckets"][0] and got["native_calls"][1] == 0, got
    assert got["sides"] == ([0, 0] if variant == "native-inline" else [1, 1]), got
    assert got["masked"] and got["same"] and got["same_rows"] and got["finite"], got
    assert got["suspicions"][0] == got["suspicions"][1] >= 1, got
    assert got["dropped"][0] == got["dropped"][1] >= 1, got


def _scaled(rank: int, init: str, device_name: str, out: str) -> None:
    """The device path under a GradScaler: fp16 autocast on CUDA (fp32 on the CPU), fused Adam (the scaler
    hands it found_inf and always calls step()), audits every 3rd step; step 8's data overflows the scaled
    gradient. The verdict of a masked step is settled a step later, after `scaler.update()` halved the
    scale: its replay must use the scale the step ran under (kept with its retained batch)."""
    import contextlib
    import json

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.compute_gate import ComputeChecks

    device = torch.device(device_name)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init}",
                            rank=rank, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    model.to(device)
    ddp = DDP(model, bucket_cap_mb=0.01)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12, growth_interval=4)
    amp = ((lambda: torch.autocast("cuda", dtype=torch.float16)) if device.type == "cuda"
           else contextlib.nullcontext)

    def loss_fn(m: nn.Module, b: tuple) -> torch.Tensor:
        with amp():
            return nn.functional.mse_loss(m(b[0]).float(), b[1])

    checks = ComputeChecks.attach(ddp, opt, loss_fn=loss_fn, mask="device", audit_every=3, warmup=3,
                                  scaler=scaler)
    g = torch.Generator().manual_seed(7)
    scales = []
    for s in range(1, 19):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        if s == 8:
            x = x * 3e4 if device.type == "cuda" else x * 1e30     # fp16 / fp32 overflow of the scaled loss
        x, y = x.to(device), y.to(device)
        checks.retain((x, y))
        scaler.scale(loss_fn(ddp, (x, y))).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(float(scaler.get_scale()))
    st = checks.status()
    with open(out, "w") as f:
        json.dump({"mode": checks.mode(), "audits": st.audits, "suspicions": st.suspicions, "scales": scales,
                   "findings": [(f.step, f.detector, f.cause, list(f.faulty)) for f in checks.findings],
                   "finite": all(bool(torch.isfinite(p).all()) for p in ddp.parameters())}, f)
    dist.destroy_process_group()


def _scaled_run(tmp_path, device: str) -> dict:
    import json
    out = tmp_path / "out.json"
    spawn(_scaled, (str(tmp_path / "init"), device, str(out)), nprocs=1)
    return json.loads(out.read_text())


def _check_scaled(got: dict) -> None:
    assert got["mode"] == "exact" and got["finite"], got
    assert got["audits"] >= 4, got                          # each audit's replay agreed (no finding from one)
    # the overflow: masked, settled at step 9 with step 8's scale (the scaler had halved it), cleared as data
    assert got["findings"] == [[8, "nonfinite", "data", []]] and got["suspicions"] == 1, got
    assert got["scales"][7] == got["scales"][6] / 2, got["scales"]


def test_the_device_path_replays_under_the_scale_its_step_ran_with_on_cpu(tmp_path) -> None:
    _check_scaled(_scaled_run(tmp_path, "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_device_path_replays_under_the_scale_its_step_ran_with(tmp_path) -> None:
    """fp16 autocast with a GradScaler on the GPU (issue 19's replays under loss scaling)."""
    _check_scaled(_scaled_run(tmp_path, "cuda"))
