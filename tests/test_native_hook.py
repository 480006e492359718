"""The C++ DDP comm hook (checksums/native_hook.cpp, built by checksums/native_hook.py): it is what
GradSummaries registers by default, it reduces and summarises exactly as the Python hook does (rows and
gradients bit for bit, on 3 gloo ranks here; with its bound kernel launches on a GPU, `-m gpu`), a second
hook on the same DDP model is refused with the first one's name, and where it cannot be built the Python
hook runs and the reason is said."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rank_spawn import spawn

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()


def _twins(rank: int, init: str, world: int, device_name: str, out: str, python_rank: int = -1,
           ddp_kw: dict | None = None, arm_after: int = 0) -> None:
    """Two identical DDP models, one through the C++ hook and one through the Python hook, the same batches:
    their rows and reduced gradients after each step, compared. Between each backward and its gather the
    job all-reduces its loss (a collective of its own there, as a loop logging the mean loss does): every
    rank's gather must pair with every other's, wherever it is issued. `python_rank`: that rank's first
    model takes the Python hook too (its C++ hook not built there). `ddp_kw`: DDP's own options
    (static_graph, find_unused_parameters). `arm_after`: gathers before the hook's is armed (0: the
    default)."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums import grad_checks, native_hook
    from checksums.grad_checks import GradSummaries

    if arm_after:
        grad_checks._GATHER_ARM_AFTER = arm_after

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init}",
                           rank=rank, world_size=world)
    torch.manual_seed(0)
    def make() -> nn.Module:     # > DDP's first bucket (1 MB) so its rebuilt buckets are several
        return nn.Sequential(nn.Linear(32, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                             nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 4))
    base = make()
    runs = []
    for native in (False if rank == python_rank else None, False):
        m = make()
        m.load_state_dict(base.state_dict())
        ddp = DDP(m.to(device), bucket_cap_mb=0.004, **(ddp_kw or {}))   # several buckets
        runs.append((ddp, GradSummaries(ddp, native=native)))
    g = torch.Generator().manual_seed(rank)                     # each rank its own data
    same_rows = same_grads = True
    counts, losses_summed, kept = [], True, []
    for s in range(8):
        x, y = torch.randn(16, 32, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
        rows, grads = [], []
        for ddp, summaries in runs:
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            mine = torch.tensor([float(rank + 1)], device=device)
            dist.all_reduce(mine)                                 # the job's own collective, then the gather
            losses_summed &= mine.item() == world * (world + 1) / 2
            got = summaries.gather()
            rows.append(got.clone())
            kept.append((got, rows[-1]))        # the caller's own: no later backward may write it
            counts.append(summaries.bucket_count())
            summaries.clear()
            grads.append([p.grad.clone() for p in ddp.parameters()])
            ddp.zero_grad(set_to_none=True)
        same_rows &= torch.equal(rows[0], rows[1])
        same_grads &= all(torch.equal(a, b) for a, b in zip(*grads))
    first = runs[0][1]
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"native": [s.native for _, s in runs], "why": native_hook.why(),
                       "same_rows": same_rows, "same_grads": same_grads, "buckets": counts,
                       "calls": [s.hook_calls for _, s in runs],
                       "native_calls": first._native.native_calls() if first.native else -1,
                       "hook_gathers": [s.hook_gathers for _, s in runs], "losses_summed": losses_summed,
                       "kept": all(torch.equal(a, b) for a, b in kept),
                       "bound": first._native.bound() if first.native else [],
                       "pending_after_clear": first.pending()}, f)
    dist.destroy_process_group()


def _run_twins(tmp_path: Path, world: int, device: str, python_rank: int = -1,
               ddp_kw: dict | None = None, arm_after: int = 0) -> dict:
    out = tmp_path / "out.json"
    spawn(_twins, (str(tmp_path / "init"), world, device, str(out), python_rank, ddp_kw, arm_after),
          nprocs=world)
    return json.loads(out.read_text())


def test_the_cpp_hook_reduces_and_summarises_as_the_python_hook_on_three_ranks(tmp_path: Path) -> None:
    got = _run_twins(tmp_path, 3, "cpu")
    assert got["native"] == [True, False], got            # the default is the C++ hook; it built here
    assert got["same_rows"] and got["same_grads"] and got["losses_summed"] and got["kept"], got
    # the C++ hook gathers the rows itself after three eager gathers (the job's all-reduce between)
    assert got["hook_gathers"] == [8 - 3, 0], got
    n = got["buckets"][-1]           # DDP's first step: one bucket; rebuilt after it
    assert n >= 3 and all(c == n for c in got["buckets"][2:]), got
    assert got["calls"] == [got["calls"][1]] * 2 and got["calls"][1] == 7 * n + got["buckets"][0], got
    assert got["native_calls"] == 0 and got["bound"] == [], got   # the CPU: every bucket through Python
    assert not got["pending_after_clear"]


def test_a_rank_without_the_cpp_hook_keeps_every_rank_gathering_in_the_step(tmp_path: Path) -> None:
    """Rank 1 runs the Python hook (its C++ hook not built): the ranks agree, once, to keep the rows'
    all-gather where every rank can issue it, so each gather still pairs with the others' around the job's
    own all-reduce: the same rows and sums as the twins through the Python hook everywhere."""
    got = _run_twins(tmp_path, 3, "cpu", python_rank=1)
    assert got["native"] == [True, False], got            # rank 0's first model: the C++ hook
    assert got["same_rows"] and got["same_grads"] and got["losses_summed"], got
    assert got["hook_gathers"] == [0, 0], got


@pytest.mark.parametrize("ddp_kw", [{"static_graph": True}, {"find_unused_parameters": True}],
                         ids=["static_graph", "find_unused_parameters"])
def test_the_hooks_gather_follows_ddps_own_modes(tmp_path: Path, ddp_kw: dict) -> None:
    """DDP's static graph (its buckets rebuilt from the recorded graph) and its search for unused
    parameters (every bucket marked ready at the end of the backward): the hook still gathers once the
    buckets have settled, the rows and gradients are the Python hook's."""
    got = _run_twins(tmp_path, 3, "cpu", ddp_kw=ddp_kw)
    assert got["same_rows"] and got["same_grads"] and got["losses_summed"] and got["kept"], got
    # the static graph rebuilds its buckets after the second step: armed at the third gather either way
    assert got["hook_gathers"] == [5, 0], got


def test_the_hooks_gather_armed_before_ddps_rebuild_is_disarmed_on_every_rank_and_armed_again(
        tmp_path: Path) -> None:
    """Armed after the first gather, before DDP rebuilds its buckets (1 bucket -> several): at the second
    step the hook gathers one bucket's row after bucket 0 on every rank; every rank sees the bucket count
    changed, disarms and gathers eagerly, and arms again with the new count: the rows stay the Python
    hook's, the gathers pair up around the job's own all-reduce, and the hook gathers from the third step."""
    got = _run_twins(tmp_path, 3, "cpu", arm_after=1)
    assert got["same_rows"] and got["same_grads"] and got["losses_summed"] and got["kept"], got
    assert got["buckets"][0] == 1 and got["buckets"][2] > 1, got
    assert got["hook_gathers"] == [8 - 2, 0], got


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_cpp_hooks_bound_launches_give_the_python_hooks_rows_and_gradients(tmp_path: Path) -> None:
    got = _run_twins(tmp_path, 1, "cuda")
    assert got["native"] == [True, False] and got["same_rows"] and got["same_grads"], got
    n = got["buckets"][-1]
    assert sorted(got["bound"]) == list(range(n)), got    # every bucket's launch bound once settled
    # DDP rebuilds its buckets after step 1; each bucket's layout is taken for 3 calls, bound at the 4th;
    # the launches from then on ran in C++
    assert got["native_calls"] >= 3 * n and got["calls"][0] == got["calls"][1], got
    assert got["hook_gathers"] == [8 - 3, 0] and got["losses_summed"], got   # NCCL: the hook's gather too


def _second_hook(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from checksums.grad_checks import GradSummaries

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=1)
    ddp = DDP(nn.Linear(4, 4))
    first = GradSummaries(ddp)
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        return None

    errors = []
    for again in (lambda: GradSummaries(ddp), lambda: GradSummaries(ddp, native=False),
                  lambda: ddp.register_comm_hook(None, hook)):
        try:
            again()
            errors.append("")
        except (ValueError, RuntimeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    # compiled autograd's Python reducer calls a hook a parameter at a time: refused, saying so
    import torch._dynamo
    mode = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        per_param = DDP(nn.Linear(4, 4))
    finally:
        torch._dynamo.config.optimize_ddp = mode
    try:
        GradSummaries(per_param)
        errors.append("")
    except ValueError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    per_param = None
    native = first.native
    # the model and its hook collected (the hook's Python callbacks let go under the GIL), and with them the
    # GradSummaries (no cycle through the C++ hook keeps it and the model's parameters), then another model
    import gc
    import weakref
    handle, gone = first._native, weakref.ref(first)
    first = ddp = again = None          # (the lambdas above hold `ddp` in a cell: emptied, not deleted)
    gc.collect()
    collected = [gone() is None, handle.alive(), handle.reduced(),
                 handle.bind(0, 0, 0, 1, [1, 1, 1], 32, 0, [])]
    ddp2 = DDP(nn.Linear(4, 4))
    second = GradSummaries(ddp2)
    ddp2(torch.ones(2, 4)).sum().backward()
    with open(out, "w") as f:
        json.dump({"native": native, "errors": errors, "second": [second.native, list(second.rows().shape)],
                   "collected": collected}, f)
    dist.destroy_process_group()


def test_a_second_hook_on_the_model_is_refused_naming_the_first(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    spawn(_second_hook, (str(tmp_path / "init"), str(out)), nprocs=1)
    got = json.loads(out.read_text())
    assert got["native"] is True and got["second"] == [True, [1, 4]], got
    assert got["collected"] == [True, False, [], "the hook is gone (its DDP model was collected)"], got
    ours, ours_py, torchs, per_param = got["errors"]
    assert per_param.startswith("ValueError") and "python_reducer" in per_param, per_param
    assert ours.startswith("ValueError") and "GradSummaries._hook" in ours and "comm_hook=" in ours, ours
    assert ours_py == ours, got
    assert torchs.startswith("RuntimeError") and "once" in torchs, torchs   # DDP's reducer takes one hook


def test_without_a_compiler_the_python_hook_runs_and_says_why(tmp_path: Path) -> None:
    code = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from checksums import native_hook
from checksums.grad_checks import GradSummaries
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
ddp = DDP(nn.Linear(4, 4))
s = GradSummaries(ddp)
ddp(torch.ones(2, 4)).sum().backward()
print(json.dumps({"native": s.native, "why": native_hook.why(), "rows": list(s.rows().shape),
                  "main": native_hook.main()}))
"""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
           "SDCWATCH_NATIVE_CACHE": str(tmp_path / "c"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "init")], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["native"] is False and "no C++ compiler" in got["why"], got
    assert got["rows"] == [1, 4] and got["main"] == 1, got       # the Python hook summarised the bucket
    assert "the C++ comm hook is not used (no C++ compiler" in done.stderr, done.stderr
    assert "native hook: not built: no C++ compiler" in done.stderr
    assert not list((tmp_path / "c").glob("*.so"))


def test_a_build_that_fails_says_the_compilers_error(tmp_path: Path) -> None:
    """A compiler that fails: its last lines in the reason, no library left in the cache."""
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\n"
                    "echo 'fatal error: torch/csrc/distributed/c10d/reducer.hpp: No such file' >&2\nexit 1\n")
    fake.chmod(0o755)
    code = ("import sys; from checksums import native_hook; m = native_hook.load(); "
            "print(m is None); print(native_hook.why())")
    env = {**os.environ, "CXX": str(fake), "SDCWATCH_NATIVE_CACHE": str(tmp_path / "c"),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "True" and "failed (exit 1)" in lines[1] and "reducer.hpp: No such file" in done.stdout
    assert not list((tmp_path / "c").glob("*.so")) and not list((tmp_path / "c").glob("*.tmp"))


def test_a_cache_reached_through_a_link_is_refused_and_a_loose_one_made_private(tmp_path: Path) -> None:
    """The library is loaded into the training process: its cache must be ours alone. A cache path through a
    link (another user could have planted it) is refused (the Python hook runs, saying why); a cache
    directory others may write is made 0700 before anything is built or loaded from it."""
    code = ("from checksums import native_hook; m = native_hook.load(); print(m is None); "
            "print(native_hook.why())")
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    env = {**os.environ, "SDCWATCH_NATIVE_CACHE": str(tmp_path / "link"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.stdout.splitlines()[0] == "True" and "link" in done.stdout.splitlines()[1], done.stdout
    assert not list(real.iterdir())
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    from checksums import native_hook
    built = native_hook.load()                       # this process's library: the same key, no second build
    assert built is not None, native_hook.why()
    shutil.copy(built.__file__, loose / Path(built.__file__).name)
    env["SDCWATCH_NATIVE_CACHE"] = str(loose)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.stdout.splitlines()[0] == "False", done.stdout + done.stderr    # built and loaded
    assert loose.stat().st_mode & 0o777 == 0o700 and list(loose.glob("*.so"))


def test_the_switch_turns_it_off() -> None:
    code = "from checksums import native_hook; print(native_hook.load() is None, native_hook.why())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "SDCWATCH_NATIVE_HOOK": "0", "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "True off (SDCWATCH_NATIVE_HOOK=0)", done.stdout + done.stderr


def _compiled(signature: dict, **md: object) -> SimpleNamespace:
    meta = {"num_warps": 4, "shared": 128, "global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1,
            "launch_cooperative_grid": False, "launch_pdl": False, **md}
    return SimpleNamespace(function=0xABC, metadata=SimpleNamespace(**meta),
                           src=SimpleNamespace(signature=signature))


def test_a_triton_launch_is_described_for_cuLaunchKernel_or_refused() -> None:
    from checksums.grad_summary_triton import native_launch_of

    sig = {"x": "*fp32", "n": "i32", "big": "i64", "scale": "fp32", "BLOCK": "constexpr", "flag": "constexpr"}
    got = native_launch_of(_compiled(sig), (7, 1, 1), (1 << 40, 5, 1 << 33, 0.5, 1024, True))
    assert got is not None and got.function == 0xABC and got.grid == (7, 1, 1)
    assert got.block == 128 and got.shared == 128                  # 4 warps of 32 threads
    assert got.params == ((0, 1 << 40), (1, 5), (0, 1 << 33), (2, 0.5)), got.params   # constexprs left out
    # what a plain launch cannot do, or arguments it cannot type: refused (Triton's launcher then)
    args = (1, 5, 1, 0.5, 1, True)
    assert native_launch_of(_compiled(sig, global_scratch_size=64), (1, 1, 1), args) is None
    assert native_launch_of(_compiled(sig, num_ctas=2), (1, 1, 1), args) is None
    assert native_launch_of(_compiled(sig, launch_pdl=True), (1, 1, 1), args) is None
    assert native_launch_of(_compiled({"a": "bf16"}), (1, 1, 1), (1.0,)) is None
    assert native_launch_of(_compiled({"a": "i32"}), (1, 1, 1), (1.5,)) is None        # a float as an int
    assert native_launch_of(_compiled({"a": "fp32"}), (1, 1, 1), (1,)) is None         # an int as a float
    assert native_launch_of(_compiled(sig), (1, 1, 1), (1, 5)) is None                 # too few arguments
    # a value the compiled parameter cannot hold (a variant compiled for another bucket's sizes)
    assert native_launch_of(_compiled(sig), (1, 1, 1), (1, 1 << 31, 1, 0.5, 1, True)) is None
    assert native_launch_of(_compiled(sig), (1, 1, 1), (-8, 5, 1, 0.5, 1, True)) is None   # negative address
    top = native_launch_of(_compiled({"a": "u32"}), (1, 1, 1), ((1 << 32) - 1,))
    assert top is not None and top.params == ((1, (1 << 32) - 1),)
    assert native_launch_of(SimpleNamespace(function=None), (1, 1, 1), ()) is None


@pytest.mark.skipif(CUDA, reason="the CPU's answer; the GPU's binding is tested with a kernel above")
def test_binding_a_launch_without_a_cuda_driver_says_why(tmp_path: Path) -> None:
    """On a machine without CUDA the C++ hook binds no launch and says why (every bucket then summarises
    through Python, as test_the_cpp_hook_reduces_and_summarises... shows)."""
    from checksums import native_hook

    module = native_hook.load()
    assert module is not None, native_hook.why()
    assert module.driver_why() == "libcuda.so.1 is not loaded in this process"
