"""What VERIFIED and a replica repair cost (issue 18), on a GPT-2-small-sized model, against the save itself.

    python -m bench.verify_cost --device cuda --world 2                    # two GPUs (NCCL)
    python -m bench.verify_cost --device cuda --world 1                    # one GPU
    python -m bench.verify_cost --device cuda --world 2 --backend gloo     # one GPU, both ranks on cuda:0
    python -m bench.verify_cost --device cpu --world 2 --model tiny        # the CPU check of this script

Per rank (DDP replicas, fused AdamW, one optimizer step per iteration), side by side in one run:
1. the training step with the Monitor alone, with `ReplicaRecovery` gating on the host (it reads the votes
   before each update: on CUDA one host wait per step) and gating on the device (the newest vote's words
   compared on the GPU, the update masked through found_inf: no host wait; on a synchronous vote, gloo, the
   device gate is forced with the host's settle lag 0). With one rank there is no vote: the rows say so;
2. rank 0 saves the model + AdamW state as every replica of a job would (`Snapshotter` into an in-process
   coordinator over a private redis-server, staging slots in /dev/shm), alternating saves with the agent's
   byte comparison and with it stubbed out: save() blocking time with / without it (the ratio shows that
   VERIFIED adds no blocking time: it runs after the commit, on the agent), the time to committed, and the
   VERIFIED transition (the vote event's evaluation);
3. the agent's byte comparison per checkpoint (`checkpoint.replica_bytes.compare` over every replica's shard
   manifest, parsing included), against the save's blocking time and its time to committed;
4. one in-place repair: every parameter and AdamW state tensor broadcast from rank 0 over the replica group,
   then fingerprinted and compared (all_gather), as `replica.repair` does (forced here: with two replicas
   the real vote has no majority and asks for a rollback instead; with one rank the broadcast is a no-op
   and only the fingerprint is measured), against the save's blocking time.
Ratios are against the baselines measured in the same run; a machine, not a test, decides the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from bench.rank_start import start_ranks


def _model(name: str, device: torch.device) -> tuple[torch.nn.Module, Any]:
    from bench.tiny_gpt import GPTConfig, TinyGPT

    cfg = GPTConfig() if name == "gpt2-small" else GPTConfig(layers=2, width=64, heads=4, vocab=256, seq=64)
    model = TinyGPT(cfg).to(device)
    batch = 8 if name == "gpt2-small" else 2
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq), device=device)
    return model, idx


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steps(ddp: Any, opt: Any, monitor: Any, idx: torch.Tensor, n: int, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        loss = ddp(idx, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        monitor.step(loss.detach())
    monitor.flush()
    _sync(device)
    return (time.perf_counter() - t0) / n


def _manifests(model: torch.nn.Module, opt: Any, world: int, chunk: int = 64 << 20) -> list[str]:
    """Every rank's shard manifest for {"model", "optim"}: the real tensors' fingerprints, chunk records of
    the real count (their checksums are not what is timed), one manifest per rank."""
    from checkpoint.chunks import Chunk
    from checkpoint.manifest import ShardManifest, TensorEntry
    from checkpoint.state_tree import dtype_name, flatten
    from checksums.fingerprint import fingerprint_tensors

    tree, named = flatten({"model": model.state_dict(), "optim": opt.state_dict()})
    entries, off = [], 0
    for path, t in named:
        n = t.numel() * t.element_size()
        entries.append(TensorEntry(path, dtype_name(t.dtype), tuple(t.shape), off, n,
                                   tuple(fingerprint_tensors([t.detach()]))))
        off += n
    chunks = tuple(Chunk(o, min(chunk, off - o), "0" * 32) for o in range(0, off, chunk))
    return [ShardManifest("bench", 100, r, world, f"bench/000000000100/rank-{r:05d}.bin", off, chunk, chunks,
                          tuple(entries), tree, 0.0, replica_set="world").to_json() for r in range(world)]


def _compare_cost(manifests: list[str], reps: int) -> tuple[float, str, int]:
    from checkpoint import replica_bytes
    from checkpoint.manifest import ShardManifest

    t0 = time.perf_counter()
    for _ in range(reps):
        check = replica_bytes.compare(ShardManifest.from_json(m) for m in manifests)
    return (time.perf_counter() - t0) / reps, check.verdict, sum(len(json.loads(m)["tensors"]) for m in manifests)


def _repair_cost(model: torch.nn.Module, opt: Any, device: torch.device, reps: int) -> float:
    from checksums.fingerprint import fingerprint_tensors_async
    from checksums.replica_recovery import ReplicaRecovery

    tensors = ReplicaRecovery._state_tensors(opt)
    world = dist.get_world_size()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, src=0)
        mine = fingerprint_tensors_async(tensors).to(torch.int64).reshape(-1)
        got = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(got, mine)
        assert all(torch.equal(g, got[0]) for g in got), "replicas differ after the copy"
    _sync(device)
    return (time.perf_counter() - t0) / reps


def _save_cost(state: dict[str, Any], replicas: int, saves: int, device: torch.device) -> dict[str, Any]:
    """Rank 0 saves `state` as each of `replicas` replicas of a job would, into an in-process coordinator
    (private redis-server, /dev/shm slots), alternating the agent's real byte comparison with a stub; then
    the vote event that makes each VERIFIED. Returns the steady-state timings (the best of each)."""
    import shutil
    import tempfile
    from pathlib import Path

    import redis

    from bench.bench_checkpoint import start_redis
    from checkpoint import coordinator as coordinator_mod
    from checkpoint import replica_bytes
    from checkpoint.coordinator import Coordinator
    from checkpoint.coordinator_config import CoordinatorConfig
    from checkpoint.shm_store import ShmStore
    from checkpoint.snapshot import Snapshotter, SnapshotConfig

    real_compare = replica_bytes.compare

    def stub(manifests: Any) -> Any:
        ranks = tuple(sorted(m.rank for m in manifests))
        return replica_bytes.BytesCheck(replica_bytes.AGREED, (), ranks)

    work = Path(tempfile.mkdtemp(prefix="sdcw-verify-cost-"))
    shm_root = Path(tempfile.mkdtemp(prefix="sdcw-verify-cost-", dir="/dev/shm" if Path("/dev/shm").is_dir()
                                     else None))
    proc, sock = start_redis(work, "coord")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows: dict[str, list[float]] = {k: [] for k in ("block_real", "block_stub", "commit_real", "commit_stub",
                                                     "verified", "compare_live", "scrub_rate")}
    try:
        co = Coordinator(redis.Redis(unix_socket_path=sock), ShmStore(shm_root), node="bench",
                         location=str(shm_root),
                         config=CoordinatorConfig(keep_committed=1, rollback_span_steps=0))
        snaps = {mode: [Snapshotter(co, f"verify-{mode}", r, replicas, SnapshotConfig(), replica_set="world")
                        for r in range(replicas)] for mode in ("real", "stub")}
        for step in range(1, 2 * (saves + 3)):
            mode = "real" if step % 2 else "stub"
            coordinator_mod.replica_bytes.compare = (  # type: ignore[attr-defined]
                real_compare if mode == "real" else stub)
            try:
                results = []
                for snap in snaps[mode]:
                    sync()
                    results.append(snap.save(step, state).result(600))
                    assert results[-1].error == "", results[-1].error
            finally:
                coordinator_mod.replica_bytes.compare = real_compare  # type: ignore[attr-defined]
            if step <= 4:                      # the first saves build the slots: not steady state
                continue
            rows[f"block_{mode}"].append(min(r.blocking_s for r in results))
            rows[f"commit_{mode}"].append(results[-1].commit_s)   # the last replica's commit compares
            if mode == "real":
                # shards checksummed at the source (CUDA): the agent's scrub checks their host bytes first
                # (VERIFIED waits for it); its rate, from the bytes of every pending shard
                t0, n = time.perf_counter(), 0
                while co.scrub_pending():
                    n += co.scrub(time.time(), 1 << 40)
                if n:
                    rows["scrub_rate"].append(-n / (time.perf_counter() - t0))   # min() of these: the best
                t0 = time.perf_counter()
                co.on_job_event(f"verify-{mode}", step, "vote_agreed", time.time())
                rows["verified"].append(time.perf_counter() - t0)
                assert co.info(f"verify-{mode}", step).state == "VERIFIED"
                shards = co.shard_manifests(f"verify-{mode}", step)
                t0 = time.perf_counter()
                check = real_compare(shards.values())
                rows["compare_live"].append(time.perf_counter() - t0)
                assert check.verdict == replica_bytes.AGREED, check.summary()
        for group in snaps.values():
            for snap in group:
                snap.close()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {k: min(v) for k, v in rows.items() if v}
    if "scrub_rate" in out:
        out["scrub_rate"] = -out["scrub_rate"]
    out["replicas"] = replicas
    out["save_bytes"] = sum(t.numel() * t.element_size() for t in _tensors(state))
    return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    from checksums.monitor import Monitor
    from checksums.replica_recovery import ReplicaRecovery

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend, init_method=f"file://{store}", rank=rank, world_size=args.world)
    try:
        torch.manual_seed(0)
        model, idx = _model(args.model, device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.fused)
        monitor = Monitor.attach(ddp, opt, job_id="bench-verify", reporter=False)
        _steps(ddp, opt, monitor, idx, args.warmup, device)
        row: dict[str, Any] = {"rank": rank, "vote": monitor.replica_group is not None,
                               "vote_async": bool(monitor.vote_lag)}
        variants = [("step_s", None), ("step_host_gate_s", "host")]
        if args.fused:
            variants.append(("step_device_gate_s", "device"))
        for _ in range(2):                     # twice, interleaved: the second round is what is printed
            for key, mask in variants:
                recovery = None if mask is None else ReplicaRecovery.attach(monitor, mask=mask)
                row[key] = _steps(ddp, opt, monitor, idx, args.steps, device)
                if recovery is not None:
                    row[key.replace("_s", "_mask")] = recovery.mask
                    recovery.detach()
        repair = _repair_cost(model, opt, device, args.reps)
        row.update({"repair_s": repair, "state_bytes": sum(t.numel() * t.element_size()
                                                           for t in ReplicaRecovery._state_tensors(opt))})
        if rank == 0:
            replicas = max(args.world, 2)      # one rank: compare as if it had a replica
            manifests = _manifests(model, opt, replicas)
            row["compare_s"], row["verdict"], row["tensors"] = _compare_cost(manifests, args.reps)
            row["manifest_chars"] = sum(len(m) for m in manifests)
            if args.saves:
                try:
                    row["save"] = _save_cost({"model": model.state_dict(), "optim": opt.state_dict()},
                                             replicas, args.saves, device)
                except Exception as e:  # noqa: BLE001 - no redis-server here: the other rows still count
                    row["save_error"] = f"{type(e).__name__}: {e}"
        monitor.close()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(row, f)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None, start: Callable[..., None] = start_ranks) -> int:
    """`start(fn, args, nprocs)` runs the ranks: bench.rank_start's by default; the suite passes its own."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--world", type=int, default=2, help="ranks (rank r on cuda:r mod the GPUs visible)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl on cuda, gloo on cpu; gloo on cuda lets ranks share one GPU")
    p.add_argument("--no-fused", dest="fused", action="store_false",
                   help="plain AdamW (no found_inf: no device gate)")
    p.add_argument("--saves", type=int, default=4, help="saves timed per variant (0: skip the save rows)")
    p.add_argument("--model", choices=("gpt2-small", "tiny"), default="gpt2-small")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=5, help="repairs and comparisons timed")
    args = p.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cpu" and args.backend == "nccl":
        p.error("--backend nccl needs --device cuda")
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < 1:
            p.error("--device cuda: no GPU visible")
        if args.backend == "nccl" and gpus < args.world:
            p.error(f"--world {args.world} over NCCL needs {args.world} GPUs, {gpus} visible (NCCL refuses "
                    "two ranks on one GPU): use --backend gloo to put them on one")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        start(_worker, (args, os.path.join(tmp, "store"), tmp), args.world)
        rows = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.world)]
    print_rows(args, rows)
    return 0


def print_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    r0 = rows[0]
    step = max(r["step_s"] for r in rows)
    print(f"model {args.model} on {args.world} rank(s), {args.device}, {args.backend}: "
          f"{r0['state_bytes'] / 2**20:.0f} MiB of weights + AdamW state per replica")
    print(f"{'training step, Monitor':<62} {step * 1e3:9.2f} ms")
    if not r0["vote"]:
        print("  (one rank: no replica vote, so the gates below have nothing to read: they cost a call)")
    for key, what in (("step_host_gate_s", "host gate (vote read before the update)"),
                      ("step_device_gate_s", "device gate (found_inf mask, no host wait)")):
        if key in r0:
            t = max(r[key] for r in rows)
            print(f"{'  + ReplicaRecovery, ' + what:<62} {t * 1e3:9.2f} ms   ({(t / step - 1) * 100:+.1f}%, "
                  f"mask {r0[key.replace('_s', '_mask')]})")
    save = r0.get("save")
    compare = r0["compare_s"]
    repair = max(r["repair_s"] for r in rows)
    if save:
        blk, blk_stub = save["block_real"], save["block_stub"]
        print(f"{'save(): blocking, with the agent byte check':<62} {blk * 1e3:9.2f} ms   "
              f"({save['save_bytes'] / 2**20:.0f} MiB per replica, {save['replicas']} replicas)")
        print(f"{'save(): blocking, byte check stubbed out':<62} {blk_stub * 1e3:9.2f} ms   "
              f"(with/without {blk / blk_stub:.2f}x: VERIFIED adds no blocking time when ~1.00)")
        print(f"{'save() return -> committed (last replica)':<62} {save['commit_real'] * 1e3:9.2f} ms   "
              f"(stubbed {save['commit_stub'] * 1e3:.2f} ms: the check runs here, after save() returned)")
        print(f"{'agent: vote event -> VERIFIED (evaluate)':<62} {save['verified'] * 1e3:9.2f} ms")
        if "scrub_rate" in save:
            print(f"{'agent: scrub of the host bytes (source checksums), one thread':<62} "
                  f"{save['scrub_rate'] / 1e9:9.2f} GB/s   (VERIFIED waits for it; the agent runs it at "
                  "[checkpoints] scrub_bytes_per_s)")
        print(f"{'agent: compare saved bytes, live manifests':<62} {save['compare_live'] * 1e3:9.2f} ms   "
              f"({save['compare_live'] / blk:.3f}x save blocking, "
              f"{save['compare_live'] / (blk + save['commit_real']):.3f}x save call -> committed)")
    elif "save_error" in r0:
        print(f"save rows not run: {r0['save_error']}")
    base = f"{compare / save['block_real']:.3f}x save blocking" if save else "no save measured"
    print(f"{'agent: compare saved bytes per checkpoint':<62} {compare * 1e3:9.2f} ms   "
          f"({max(args.world, 2)} manifests, {r0['tensors']} tensors, "
          f"{r0['manifest_chars'] / 2**10:.0f} KiB JSON; verdict {r0['verdict']}; {base})")
    ratio = f"{repair / save['block_real']:.2f}x save blocking" if save else "no save measured"
    print(f"{'in-place repair (broadcast + fingerprint check)':<62} {repair * 1e3:9.2f} ms   ({ratio}"
          + ("; one rank: fingerprint only" if args.world == 1 else "") + ")")
    print("JSON " + json.dumps({"model": args.model, "world": args.world, "device": args.device,
                               "backend": args.backend, "ranks": rows}))


if __name__ == "__main__":
    raise SystemExit(main())
