"""Issue 21: why one ring of staging slots slows the training beside its copies and another does not.

`bench/ckpt_overlap.py` part b found every-step checkpoints at batch 16 two-valued by a mode's place in
the process (+0.8% or +2.2%): in the slow modes the device-to-host copies of a save take ~10% longer and
the forward+backward beside them ~1 ms longer. What a mode makes anew is its slot ring (tmpfs files,
mapped, `cudaHostRegister`ed). This bench makes rings over and over in one process and, per slot, measures
the copy alone, the training's forward+backward alone and with the copy beside it, and where the slot's
pages are: NUMA node (`/proc/self/numa_maps`), physical contiguity (`/proc/self/pagemap`, root only): the
share of 2 MiB chunks that are one physically contiguous, aligned run, and the number of runs. A
driver-pinned buffer (`pin_memory`) made anew each mode is the control.

    python bench/pinned_placement.py --modes 10 --slots 3 --batch 16
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import mmap
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoint.slots import SlotRing, register_host_memory, unregister_host_memory  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
HUGE = 2 << 20


def pagemap_stats(addr: int, nbytes: int) -> dict[str, Any]:
    """Physical layout of [addr, addr+nbytes): runs of contiguous frames, the share of 2 MiB-aligned
    virtual chunks backed by one aligned contiguous 2 MiB run, lowest/highest physical GiB. Empty when
    frame numbers are hidden (not root)."""
    first, n = addr // PAGE, nbytes // PAGE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            ents = np.frombuffer(f.read(n * 8), dtype=np.uint64)
    except OSError:
        return {}
    present = (ents >> np.uint64(63)).astype(bool)
    pfns = np.where(present, ents & np.uint64((1 << 55) - 1), np.uint64(0)).astype(np.int64)
    if not pfns.any():
        return {}
    runs = 1 + int(np.count_nonzero(np.diff(pfns) != 1))
    per = HUGE // PAGE
    start = (-first) % per      # first 2 MiB-aligned virtual page
    chunks = (n - start) // per
    good = 0
    if chunks > 0:
        c = pfns[start:start + chunks * per].reshape(chunks, per)
        good = int(np.count_nonzero((c[:, 0] > 0) & (c[:, 0] % per == 0)
                                    & (c - c[:, :1] == np.arange(per)).all(axis=1)))
    nz = pfns[pfns > 0]
    return {"runs": runs, "huge_share": good / max(1, chunks),
            "phys_lo_gib": int(nz.min()) * PAGE / 2**30, "phys_hi_gib": int(nz.max()) * PAGE / 2**30}


def meminfo_kb(key: str) -> float:
    """A /proc/meminfo figure in kB (NaN when it is not there)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return float(line.split()[1])
    except OSError:
        pass
    return float("nan")


def numa_nodes(path: str) -> str:
    """`N0=.. N1=..` page counts of the mapping of `path` in /proc/self/numa_maps ('' when not there)."""
    try:
        text = Path("/proc/self/numa_maps").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if path in line:
            return " ".join(w for w in line.split() if re.fullmatch(r"N\d+=\d+", w))
    return ""


def host_facts() -> list[str]:
    facts = []
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    facts.append(f"numa nodes: {len(nodes)} ({' '.join(nodes)})")
    for k in ("enabled", "shmem_enabled"):
        p = Path("/sys/kernel/mm/transparent_hugepage") / k
        facts.append(f"thp {k}: {p.read_text().strip() if p.exists() else '?'}")
    if torch.cuda.is_available():
        for dev in Path("/sys/bus/pci/devices").glob("*"):
            cls = (dev / "class").read_text().strip() if (dev / "class").exists() else ""
            if cls.startswith("0x0302") or cls.startswith("0x0300"):
                nn = (dev / "numa_node").read_text().strip() if (dev / "numa_node").exists() else "?"
                facts.append(f"gpu {dev.name}: numa_node {nn}")
    facts += [f"{k}: {meminfo_kb(k):.0f} kB"
              for k in ("MemFree", "MemAvailable", "Shmem", "ShmemHugePages", "HugePages_Total")]
    return facts


def anon_buffer(nbytes: int, huge: bool) -> tuple[Any, torch.Tensor, bool]:
    """Anonymous memory with transparent huge pages asked for (`huge`) or refused, populated and registered:
    how much the page size alone changes the copy and the training beside it."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(0)                                      # fault every page in
    return mm, t, register_host_memory(t.data_ptr(), nbytes)


class HostLoad:
    """`threads` threads streaming host memory (numpy copies between two 256 MiB arrays, the GIL released)
    while the block runs: does host memory traffic slow the copies' DMA and the training beside them?"""

    def __init__(self, threads: int) -> None:
        self._stop = threading.Event()
        self._bytes = [0] * threads     # each thread's own count (no lost updates between threads)
        self._arrs = [(np.ones(1 << 25), np.ones(1 << 25)) for _ in range(threads)]   # 256 MiB, faulted in
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        a, b = self._arrs[i]
        while not self._stop.is_set():
            np.copyto(b, a)
            self._bytes[i] += 2 * a.nbytes

    def __enter__(self) -> HostLoad:
        self._t0 = time.perf_counter()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.gbps = sum(self._bytes) / max(time.perf_counter() - self._t0, 1e-9) / 1e9


def timed(fn: Callable[[], None], stream: torch.cuda.Stream) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    with torch.cuda.stream(stream):
        fn()
    b.record(stream)
    b.synchronize()
    return a.elapsed_time(b)


def gpt_training(batch: int, dev: torch.device) -> tuple[Callable[[], None], list[torch.Tensor], int]:
    """GPT-2 small (bf16 autocast, fused AdamW) after one step: (its forward+backward, the state's device
    tensors: weights and Adam's moments, their bytes)."""
    from bench.tiny_gpt import GPTConfig, TinyGPT

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = TinyGPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq), device=dev)

    def fwd_bwd() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x)
        loss.backward()

    fwd_bwd()
    opt.step()
    opt.zero_grad(set_to_none=True)
    srcs = [t for t in list(model.state_dict().values()) +
            [v for s in opt.state.values() for v in s.values()] if t.is_cuda]
    nbytes = sum(t.numel() * t.element_size() for t in srcs)
    print(f"state: {len(srcs)} tensors, {nbytes / 1e9:.3f} GB; batch {batch}")
    return fwd_bwd, srcs, nbytes


def copy_into(srcs: list[torch.Tensor], buf: torch.Tensor) -> Callable[[], None]:
    """Enqueue (on the current stream) each source tensor's copy into `buf`, packed."""
    def go() -> None:
        off = 0
        for t in srcs:
            n = t.numel() * t.element_size()
            buf[off:off + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            off += n
    return go


def sleep_cycles(lead_ms: float, stream: torch.cuda.Stream) -> int:
    """Cycles of `torch.cuda._sleep` that keep the device busy `lead_ms`: long enough for the host to
    enqueue a timed block behind it, so the block never waits on the host's launches."""
    t_sleep = timed(lambda: torch.cuda._sleep(10**8), stream)
    return int(10**8 * lead_ms / t_sleep)


def copy_beside_training(copy: Callable[[], None], fwd_bwd: Callable[[], None], side: torch.cuda.Stream,
                         main_s: torch.cuda.Stream, cycles: int, repeat: int) -> tuple[float, float, float, float]:
    """(the copy alone, forward+backward alone, forward+backward with the copy beside it on `side`, the copy
    beside forward+backward): medians in ms over `repeat`; both arms start from a sleeping device."""
    def ev() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    cp, fb, both, cp_both = [], [], [], []
    for _ in range(repeat):
        torch.cuda.synchronize()
        cp.append(timed(copy, side))
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        a, b = ev(), ev()
        a.record(main_s)
        fwd_bwd()
        b.record(main_s)
        torch.cuda.synchronize()
        fb.append(a.elapsed_time(b))
        torch.cuda._sleep(cycles)
        a, b, c, d = ev(), ev(), ev(), ev()
        a.record(main_s)
        side.wait_event(a)
        with torch.cuda.stream(side):
            c.record(side)
            copy()
            d.record(side)
        fwd_bwd()
        b.record(main_s)
        torch.cuda.synchronize()
        both.append(a.elapsed_time(b))
        cp_both.append(c.elapsed_time(d))
    return statistics.median(cp), statistics.median(fb), statistics.median(both), statistics.median(cp_both)


@dataclasses.dataclass
class GpuTraining:
    fwd_bwd: Callable[[], None]
    srcs: list[torch.Tensor]
    nbytes: int
    main_s: torch.cuda.Stream
    cycles: int   # of torch.cuda._sleep: the lead a timed block is enqueued behind


def training_on_gpu(batch: int, lead_ms: float) -> GpuTraining | None:
    """The benches' common start: the host's facts printed, GPT-2 small's training on the GPU after one
    step, the sleep that leads each timed block; None (and a line on stderr) without CUDA."""
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return None
    for f in host_facts():
        print(f)
    fwd_bwd, srcs, nbytes = gpt_training(batch, torch.device("cuda"))
    main_s = torch.cuda.current_stream()
    return GpuTraining(fwd_bwd, srcs, nbytes, main_s, sleep_cycles(lead_ms, main_s))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", type=int, default=10, help="rings made one after another (default 10)")
    ap.add_argument("--slots", type=int, default=3, help="slots per ring (default 3)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5, help="timings per slot and measure (median)")
    ap.add_argument("--lead-ms", type=float, default=90.0,
                    help="the sleep kernel ahead of each timed block, long enough for the host to enqueue it")
    ap.add_argument("--host-load", type=int, default=0,
                    help="threads streaming host memory while each mode is measured (default 0: none)")
    ap.add_argument("--root", default=os.environ.get("SDCW_BENCH_MEM_ROOT", "/dev/shm"),
                    help="where the rings' memory dirs are made (a tmpfs; default /dev/shm)")
    ap.add_argument("--anon", default="huge,small",
                    help="anonymous buffers per mode as well: huge (MADV_HUGEPAGE), small (MADV_NOHUGEPAGE); '' none")
    args = ap.parse_args(argv)
    try:
        args.anon = [{"huge": True, "small": False}[w] for w in args.anon.split(",") if w]
    except KeyError as e:
        ap.error(f"--anon: {e} is not huge or small")
    tr = training_on_gpu(args.batch, args.lead_ms)
    if tr is None:
        return 2
    fwd_bwd, srcs, nbytes, main_s, cycles = tr.fwd_bwd, tr.srcs, tr.nbytes, tr.main_s, tr.cycles
    side = torch.cuda.Stream()

    def measure(buf: torch.Tensor) -> tuple[float, float, float, float]:
        return copy_beside_training(copy_into(srcs, buf), fwd_bwd, side, main_s, cycles, args.repeat)

    print(f"{'mode':>4} {'buffer':<10} {'copy ms':>8} {'GB/s':>6} {'f+b ms':>7} {'f+b+copy':>9} {'slower':>7} "
          f"{'cp beside':>9} {'runs':>7} {'2M share':>8} {'phys GiB':>13}  numa")
    for mode in range(args.modes):
        with tempfile.TemporaryDirectory(dir=args.root, prefix="sdcw-place-") as d:
            ring = SlotRing(d, "place", 0, max_slots=args.slots)
            t0 = time.perf_counter()
            slots = [ring.acquire(nbytes) for _ in range(args.slots)]
            made = time.perf_counter() - t0
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            bufs: list[tuple[str, torch.Tensor, str]] = [
                (f"slot{i}{'' if s.registered else '!'}", s.tensor, str(s.path)) for i, s in enumerate(slots)]
            bufs.append(("pinned", pinned, ""))
            anon = [anon_buffer(nbytes, h) for h in args.anon]
            bufs += [(f"anon-{'2M' if h else '4K'}{'' if r else '!'}", t, "")
                     for h, (_, t, r) in zip(args.anon, anon)]
            load = HostLoad(args.host_load) if args.host_load > 0 else None
            with load if load is not None else contextlib.nullcontext():
                for name, buf, path in bufs:
                    cp, fb, both, cpb = measure(buf)
                    st = pagemap_stats(buf.data_ptr(), nbytes)
                    lay = (f"{st['runs']:>7} {st['huge_share']:>8.2f} "
                           f"{st['phys_lo_gib']:>6.1f}-{st['phys_hi_gib']:<6.1f}" if st
                           else f"{'?':>7} {'?':>8} {'?':>13}")
                    print(f"{mode:>4} {name:<10} {cp:>8.2f} {nbytes / cp / 1e6:>6.1f} {fb:>7.2f} {both:>9.2f} "
                          f"{both - fb:>+7.2f} {cpb:>9.2f} {lay}  {numa_nodes(path) if path else ''}", flush=True)
            if load is not None:
                print(f"     (host load: {args.host_load} threads streamed {load.gbps:.1f} GB/s meanwhile)")
            print(f"     (ring of {args.slots} made in {made:.1f} s)")
            for s in slots:
                ring.release(s)
            for _, t, r in anon:
                if r:
                    unregister_host_memory(t.data_ptr())
            del pinned, bufs, anon
            ring.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
