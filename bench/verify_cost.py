"""What VERIFIED and a replica repair cost (issue 18), on a GPT-2-small-sized model.

    python -m bench.verify_cost --device cuda --world 2          # the H200 pair (NCCL)
    python -m bench.verify_cost --device cpu --world 2 --model tiny   # the CPU check of this script

Per rank (DDP replicas, AdamW, one optimizer step per iteration), it prints:
1. the training step with the Monitor alone and with `ReplicaRecovery` attached (its GATE stage reads the
   votes before each update: on CUDA one host wait per step on the previous step's fingerprint gather);
2. the agent's byte comparison per checkpoint (`checkpoint.replica_bytes.compare` over every rank's shard
   manifest, parsing included: model + AdamW state, one manifest per rank). It runs on the agent after the
   commit, so it adds nothing to the time `save()` blocks; it is printed as the agent's time per checkpoint;
3. one in-place repair: every parameter and AdamW state tensor broadcast from rank 0 over the replica group,
   then fingerprinted and compared (all_gather), as `replica.repair` does (forced here: with two replicas
   the real vote has no majority and asks for a rollback instead).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def _worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    from checksums.monitor import Monitor
    from checksums.replica_recovery import ReplicaRecovery

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.world)
    try:
        torch.manual_seed(0)
        model, idx = _model(args.model, device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        monitor = Monitor.attach(ddp, opt, job_id="bench-verify", reporter=False)
        _steps(ddp, opt, monitor, idx, args.warmup, device)
        plain = _steps(ddp, opt, monitor, idx, args.steps, device)
        recovery = ReplicaRecovery.attach(monitor)
        gated = _steps(ddp, opt, monitor, idx, args.steps, device)
        recovery.detach()
        repair = _repair_cost(model, opt, device, args.reps)
        row: dict[str, Any] = {"rank": rank, "step_s": plain, "step_gated_s": gated, "repair_s": repair,
                               "state_bytes": sum(t.numel() * t.element_size()
                                                  for t in ReplicaRecovery._state_tensors(opt))}
        if rank == 0:
            manifests = _manifests(model, opt, args.world)
            row["compare_s"], row["verdict"], row["tensors"] = _compare_cost(manifests, args.reps)
            row["manifest_chars"] = sum(len(m) for m in manifests)
        monitor.close()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(row, f)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--world", type=int, default=2, help="ranks (one GPU each on cuda)")
    p.add_argument("--model", choices=("gpt2-small", "tiny"), default="gpt2-small")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=5, help="repairs and comparisons timed")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        p.error(f"--world {args.world} needs {args.world} GPUs, {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args, os.path.join(tmp, "store"), tmp), nprocs=args.world, join=True)
        rows = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.world)]
    r0 = rows[0]
    step, gated = max(r["step_s"] for r in rows), max(r["step_gated_s"] for r in rows)
    print(f"model {args.model} on {args.world} x {args.device}: {r0['state_bytes'] / 2**20:.0f} MiB of weights + "
          "AdamW state per replica")
    print(f"{'training step, Monitor':<44} {step * 1e3:9.2f} ms")
    print(f"{'training step, Monitor + ReplicaRecovery':<44} {gated * 1e3:9.2f} ms   "
          f"({(gated / step - 1) * 100:+.1f}%: the GATE's vote read)")
    print(f"{'agent: compare saved bytes per checkpoint':<44} {r0['compare_s'] * 1e3:9.2f} ms   "
          f"({args.world} manifests, {r0['tensors']} tensors, {r0['manifest_chars'] / 2**10:.0f} KiB JSON; "
          f"verdict {r0['verdict']}; after commit: 0 ms added to save())")
    print(f"{'in-place repair (broadcast + fingerprint check)':<44} {max(r['repair_s'] for r in rows) * 1e3:9.2f} ms")
    print("JSON " + json.dumps({"model": args.model, "world": args.world, "device": args.device, "ranks": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
