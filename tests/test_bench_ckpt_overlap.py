"""bench/ckpt_overlap.py runs end to end on the CPU with tiny sizes (the H200 runs it at 2 and 12 GiB):
every part prints its table, the saved bytes equal the weights before the next update. No timing claims."""
from __future__ import annotations

import statistics

import pytest

from bench.ckpt_overlap import main


def test_the_overlap_bench_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    # --one-node: part b's two modes (4 and 1 in flight) on one agent and memory dir
    assert main(["--device", "cpu", "--smoke", "--fp-threads", "2", "--profile", "--one-node"]) == 0
    out = capsys.readouterr().out
    for title in ("a. added step time per save", "b. checkpoint every step", "c. first save vs steady",
                  "d. ours vs DCP async_save"):
        assert title in out, out
    assert "3/3 identical" in out, out
    assert "added step time per save" in out and "steps whose checkpoint reached COMMITTED" in out
    assert "4 in flight" in out and "1 in flight" in out and "background host work per save" in out
    assert "first save blocking, with prepare()" in out and "torch.save to local disk" in out
    assert "profile: training flatten" in out and "profile: background commit" in out   # --profile (issue 21)
    assert "first save made, every_step(), no prepare()" in out
    assert "FAILED" not in out, out


def test_the_diagnosis_and_fresh_clients_run_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """--diagnose (the host's share of a step) and --fresh (first save over steady on several clients)."""
    assert main(["--device", "cpu", "--smoke", "--parts", "bc", "--inflight", "2", "--checksums", "source",
                 "--diagnose", "--fresh", "2", "--switch-interval", "0,0.0005", "--gc", "on,freeze"]) == 0
    out = capsys.readouterr().out
    assert "diagnose: host enqueue of a step, off" in out and "diagnose: host enqueue of a step, every" in out
    assert "first save over steady, with prepare(), 2 fresh clients (median)" in out
    assert "paired by round" in out
    assert "copy thread, GIL switch 0.5 ms] step, checkpoint every step" in out    # --switch-interval
    assert "the update's host wait for the copy thread, per step" in out
    # --gc: the frozen mode's rows and each arm's collector pauses; the collector is on again after it
    assert "GIL switch 0.5 ms, gc freeze] step, checkpoint every step" in out
    assert "GC pauses in the 'every' arm, per step" in out and "GC pauses in the 'off' arm, per step" in out
    assert "(95%, 2 rounds: " in out                  # each round's ratio
    import gc
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_bad_lists_are_refused_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--smoke", "--parts", "b", "--gc", "off"])
    assert e.value.code == 2 and "--gc" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--smoke", "--parts", "b", "--inflight", "3,x"])
    assert e.value.code == 2 and "--inflight" in capsys.readouterr().err


def test_stream_gaps_split_host_late_from_device_waits() -> None:
    """A gap is host-late when the kernel after it was launched after the stream ran dry, a device wait
    when it was launched before; only the busiest stream counts."""
    from bench.ckpt_overlap import _stream_gaps

    def kernel(name: str, ts: float, dur: float, stream: int, corr: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream, "correlation": corr}}

    def launch(ts: float, corr: int) -> dict:
        return {"ph": "X", "cat": "cuda_runtime", "ts": ts, "dur": 1, "args": {"correlation": corr}}

    trace = {"traceEvents": [launch(0, 1), kernel("a", 10, 100, 7, 1),
                             launch(150, 2), kernel("b", 160, 100, 7, 2),      # launched late: 50 us host
                             launch(20, 3), kernel("c", 400, 100, 7, 3),       # launched early: 140 us wait
                             kernel("copy", 400, 10, 9, 4)]}
    host, wait, where = _stream_gaps(trace, steps=2)
    assert (host, wait) == (0.025, 0.07)            # ms per step
    assert where == [("c", 0.07), ("b", 0.025)]


def test_slowdown_rows_split_by_what_ran_beside() -> None:
    """--diagnose's kernel split: a training kernel overlapped by the fingerprint kernel, one by copies only and
    one alone, each against the mean of its name and launch shape in the 'off' arm (synthetic chrome traces,
    1 step)."""
    from bench.ckpt_overlap import _slowdown_rows

    def k(name: str, ts: float, dur: float, stream: int, cat: str = "kernel") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    off = {"traceEvents": [k("gemm", 0, 100, 7), k("norm", 100, 10, 7), k("attn", 110, 50, 7)]}
    every = {"traceEvents": [k("gemm", 0, 130, 7), k("norm", 130, 10, 7), k("attn", 140, 60, 7),
                             k("fp_partials_kernel", 10, 5, 9), k("Memcpy DtoH", 135, 80, 9, "gpu_memcpy")]}
    rows = {name.split("] ", 1)[1]: v for name, v, _ in _slowdown_rows("t", off, every, 1)}
    assert abs(rows["diagnose: training kernels beside fingerprint, per step"] - 30e-6) < 1e-12
    assert abs(rows["diagnose: training kernels beside copies, per step"] - 10e-6) < 1e-12   # norm +0, attn +10
    assert rows["diagnose: training kernels beside nothing, per step"] == 0.0
    assert abs(rows["diagnose: kernel grew, gemm"] - 30e-6) < 1e-12


def test_slowdown_rows_compare_each_launch_shape_with_its_own() -> None:
    """One kernel name at two launch shapes (a GEMM of two layer kinds) is two baselines: unchanged kernels
    show no growth, where a per-name mean would show +45 and -45 us."""
    from bench.ckpt_overlap import _slowdown_rows

    def k(ts: float, dur: float, grid: list[int]) -> dict:
        return {"ph": "X", "cat": "kernel", "name": "gemm", "ts": ts, "dur": dur,
                "args": {"stream": 7, "grid": grid, "block": [128, 1, 1]}}

    off = {"traceEvents": [k(0, 100, [8, 1, 1]), k(100, 10, [2, 1, 1])]}
    every = {"traceEvents": [k(0, 100, [8, 1, 1]), k(100, 10, [2, 1, 1])]}
    rows = {name.split("] ", 1)[1]: v for name, v, _ in _slowdown_rows("t", off, every, 1)}
    assert rows["diagnose: training kernels beside nothing, per step"] == 0.0


def test_copy_rows_group_saves_and_read_the_idle_inside_them() -> None:
    """--diagnose's copy rows: copies off the training's stream grouped into saves by a 2 ms gap; a save's
    span, its copy-engine time and the idle inside; a small copy's time and a large copy's rate."""
    from bench.ckpt_overlap import _copy_rows

    def c(ts: float, dur: float, nbytes: int) -> dict:
        return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": ts, "dur": dur,
                "args": {"stream": 9, "bytes": nbytes}}

    main = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100000, "args": {"stream": 7}}]
    # save 1: 3 copies with 10 us idle between the last two; save 2 (5 ms later): 30 us idle
    evs = main + [c(0, 5, 1024), c(5, 1000, 8 << 20), c(1015, 5, 1024),
                  c(6000, 7, 2048), c(6007, 2000, 8 << 20), c(8037, 5, 1024)]
    rows = {name.split("] ", 1)[1]: (v, note) for name, v, note in _copy_rows("t", {"traceEvents": evs}, 2)}
    span, note = rows["diagnose: a save's copies, span first to last (median)"]
    assert abs(span - (1.02 + 2.042) / 2 / 1e3) < 1e-12
    assert "2 saves in 2 steps" in note and "3 copies a save" in note
    assert "idle inside 0.02 ms" in note   # the median of 0.010 and 0.030
    small, _ = rows["diagnose: one small copy (< 64 KiB), median"]
    assert small == 5e-6
    rate, _ = rows["diagnose: one large copy (>= 4 MiB), rate (median)"]
    assert abs(rate - statistics.median([(8 << 20) / 1000 / 1e3, (8 << 20) / 2000 / 1e3])) < 1e-9


def test_launch_rows_tell_the_saves_thread_from_the_trainings() -> None:
    """--diagnose's launch rows: the thread that enqueued most memcpys is the save's; each launch call's
    host time, median and 90th percentile, per thread kind, in both arms."""
    from bench.ckpt_overlap import _launch_rows

    def call(name: str, tid: int, dur: float) -> dict:
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "tid": tid, "ts": 0, "dur": dur, "args": {}}

    off = {"traceEvents": [call("cudaLaunchKernel", 1, 4.0) for _ in range(30)]}
    every = {"traceEvents": [call("cudaLaunchKernel", 1, 4.0) for _ in range(20)] +
             [call("cudaLaunchKernel", 1, 40.0) for _ in range(10)] +
             [call("cudaMemcpyAsync", 2, 3.0) for _ in range(25)]}
    rows = {name.split("] ", 1)[1]: (v, note) for name, v, note in _launch_rows("t", off, every)}
    v, note = rows["diagnose: host launch call, training thread, cudaLaunchKernel"]
    assert v == 4e-6
    assert "off median 4.0 us, p90 4.0 us (30)" in note and "every median 4.0 us, p90 40.0 us (30)" in note
    v, note = rows["diagnose: host launch call, save thread, cudaMemcpyAsync"]
    assert v == 3e-6 and note.startswith("off none;")


def test_step_phases_split_forward_backward_and_update() -> None:
    """The event quadruples' rows: forward+backward (with its forward and backward), the optimizer step."""
    from bench.ckpt_overlap import StepPhases

    class Ev:   # a recorded CUDA event's stand-in: elapsed_time in ms, as torch's
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, later: "Ev") -> float:
            return later.ms - self.ms

    ph = StepPhases()
    ph.got = {"every": [[Ev(0), Ev(10), Ev(30), Ev(31)], [Ev(100), Ev(112), Ev(134), Ev(135.5)]]}
    rows = {name.split("] ", 1)[1]: (v, note) for name, v, note in ph.rows("t")}
    v, note = rows["device: forward+backward, 'every' arm (median)"]
    assert abs(v - 0.032) < 1e-12 and "forward 11.000 ms, backward 21.000 ms" in note
    v, note = rows["device: optimizer step, 'every' arm (median)"]
    assert abs(v - 0.00125) < 1e-12 and "largest 1.500 ms" in note


def test_gpu_sampler_rows_per_arm_and_without_nvml() -> None:
    """bench/gpu_sampler.py: samples tagged by arm give one row per arm (medians, minima, the throttle reasons
    seen); with NVML absent (no GPU here) the row says so instead of failing the bench."""
    from bench.gpu_sampler import GpuSampler

    gs = GpuSampler()
    gs.samples = {"off": [(1980, 3201, 5, 16, 10, 20, 300, 40), (1980, 3201, 5, 16, 30, 20, 320, 41),
                          (1755, 3201, 5, 16, 20, 20, 310, 42)],
                  "every": [(1980, 3201, 5, 16, 24000, 50, 330, 43)]}
    gs.reasons = {"off": 0x1, "every": 0x4}
    rows = {name.split("] ", 1)[1]: (v, note) for name, v, note in gs.rows("t")}
    v, note = rows["GPU clocks and PCIe (NVML), 'off' arm, SM MHz (median)"]
    assert v == 1980 and "sm MHz 1980 (min 1755)" in note and "pcie tx MB/s 20 (min 10)" in note
    assert "throttle reasons seen 0x1; 3 samples" in note
    assert "throttle reasons seen 0x4; 1 samples" in rows["GPU clocks and PCIe (NVML), 'every' arm, SM MHz (median)"][1]
    import torch

    if not torch.cuda.is_available():
        with GpuSampler() as bare:
            pass
        assert bare.error and "NVML" in bare.rows("t")[0][2]
