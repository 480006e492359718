"""torchtitan's own `Trainer` with `SdcwatchCheckpointer` on GPUs (issue 25): the run the CPU test
(tests/test_torchtitan_trainer.py) makes, with torchtitan's device code on CUDA and FlexAttention.

The ranks start as `torchtitan.train.main` starts them (`ConfigManager().parse_args(["--module",
"bench.titan_tiny", "--config", "sdcwatch_tiny", ...])`, `config.build()`, `trainer.train()`), spawned like
torchrun (one per GPU, HSDP with every rank a replica), against an agent started here on a temporary socket.

  overhead  rounds of the same run, the order rotated each round: `off` (torchtitan's own CheckpointManager,
            disabled) and `sdcwatch` (SdcwatchCheckpointer: Monitor fingerprints and vote every step,
            ReplicaRecovery, the full train state through the agent every --save-every steps); ms/step over
            the steps after --warmup (device synchronised at the two ends only); the medians side by side
            and the ratio;
  resume    a run of --steps saves through the agent; a second run of the same job resumes from the agent's
            checkpoint of step --save-every * k (`sdcwatch_resume`, `--checkpoint.load_step`) and redoes the
            rest; whether its final weights are bit-identical to the first run's (torchtitan's
            `debug.deterministic` on for this pair);
  flip      (2+ ranks) one bit flipped in rank 1's weights after step --flip: the rollbacks, the final step,
            whether the replicas end bit-identical.

  python -m bench.torchtitan_trainer --device cuda                      # 2 GPUs if there are, else 1
  python -m bench.torchtitan_trainer --device cuda --flavor debugmodel --seq 2048 --batch 8
  python -m bench.torchtitan_trainer --device cpu --steps 12 --warmup 2 --rounds 1 --save-every 4 --flip 9
                                                                        # smoke run without a GPU
Needs `pip install 'sdcwatch[torchtitan]'`. With torch 2.13.0 (not nightly) `titan_tiny.torch_compat()`
names `torch.distributed.set_timeout`; on the CPU `titan_tiny.run_on_cpu()` is the device shim.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--nproc", type=int, default=0,
                   help="ranks (default: 2 GPUs if there are, else 1; cpu: 2)")
    p.add_argument("--flavor", choices=("tiny", "debugmodel"), default="tiny")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--flip", type=int, default=33,
                   help="step after which rank 1 flips a bit (0: no flip run)")
    return p.parse_args(argv)


def _worker(rank: int, world: int, port: int, env: dict[str, str], out: str, timing: tuple[int, int],
            flip_at: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                       **env})
    import torch
    import torch.distributed as dist

    from bench import titan_tiny
    from bench.rank_start import same_on_every_rank
    if env["TITAN_TINY_DEVICE"] == "cpu":
        torch.set_num_threads(1)
        titan_tiny.run_on_cpu()
    titan_tiny.torch_compat()
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", "bench.titan_tiny", "--config", "sdcwatch_tiny",
                                         *env.get("TITAN_TINY_ARGS", "").split()])
    trainer = config.build()
    params = [p.to_local() for m in trainer.model_parts for p in m.parameters()]
    marks: dict[int, float] = {}
    cuda = env["TITAN_TINY_DEVICE"] == "cuda"

    def hook(*_: Any) -> None:          # after each optimizer step: a sync and a time at the two ends only
        if trainer.step in timing and trainer.step not in marks:
            if cuda:
                torch.cuda.synchronize()
            marks[trainer.step] = time.perf_counter()
        if flip_at and rank == 1 and trainer.step == flip_at and "flipped" not in marks:
            marks["flipped"] = 1.0  # type: ignore[index]
            with torch.no_grad():
                params[0].view(torch.int32).view(-1)[5] ^= 1 << 22

    for opt in trainer.optimizers.optimizers:
        opt.register_step_post_hook(hook)
    try:
        trainer.train()
        ckpt = trainer.checkpointer
        mine = torch.cat([p.detach().reshape(-1).float() for p in params])
        identical = same_on_every_rank([mine])       # through the store: bench/rank_start.py says why
        timed = timing[0] in marks and timing[1] in marks      # a resumed run starts past the warmup
        result = {"ms_per_step": (1000 * (marks[timing[1]] - marks[timing[0]]) / (timing[1] - timing[0])
                                  if timed else None),
                  "step": trainer.step,
                  "rollbacks": [d.target_step for d in getattr(ckpt, "rollbacks", [])],
                  "identical": identical,
                  "weights_sha": hashlib.sha256(mine.cpu().numpy().tobytes()).hexdigest()}
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace, nproc: int, env: dict[str, str], tmp: Path, name: str,
        flip_at: int = 0) -> dict[str, Any]:
    import torch.multiprocessing as mp
    out = tmp / f"{name}.json"
    mp.spawn(_worker, args=(nproc, _free_port(), env, str(out), (args.warmup, args.steps), flip_at),
             nprocs=nproc, join=True)
    return json.loads(out.read_text())


def start_agent(tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    state = tmp / "state"
    log = open(tmp / "agent.log", "ab")
    agent = subprocess.Popen([sys.executable, "-m", "daemon.cli", "run", "--state-dir", str(state)], cwd=ROOT,
                             stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (state / "agent.json").exists():
        if agent.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the agent did not start; see {tmp / 'agent.log'}")
        time.sleep(0.1)
    return agent, state / "agent.sock"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from bench.titan_tiny import make_assets
    nproc = args.nproc or (2 if args.device == "cpu" else min(2, torch.cuda.device_count()))
    if nproc < 1:
        raise SystemExit("no CUDA device; use --device cpu for a smoke run")
    tmp = Path(tempfile.mkdtemp(prefix="sdcw-titan-", dir="/tmp"))
    tok, data = make_assets(tmp / "assets")
    agent, sock = start_agent(tmp)
    base = {"TITAN_TINY_DEVICE": args.device, "TITAN_TINY_FLAVOR": args.flavor,
            "TITAN_TINY_TOKENIZER": str(tok), "TITAN_TINY_DATA": str(data),
            "TITAN_TINY_STEPS": str(args.steps), "TITAN_TINY_SEQ": str(args.seq),
            "TITAN_TINY_BATCH": str(args.batch), "TITAN_TINY_SAVE_EVERY": str(args.save_every),
            "HF_DATASETS_CACHE": str(tmp / "hf-datasets"), "SDCWATCH_SOCKET": str(sock)}
    print(f"torchtitan Trainer, {args.flavor} flavour, {nproc} rank(s) on {args.device}, seq {args.seq}, "
          f"batch {args.batch}, {args.steps} steps ({args.warmup} warmup), agent saves every "
          f"{args.save_every}")
    try:
        times: dict[str, list[float]] = {"off": [], "sdcwatch": []}
        for r in range(args.rounds):
            for mode in (("off", "sdcwatch") if r % 2 == 0 else ("sdcwatch", "off")):
                env = {**base, "TITAN_TINY_SDCWATCH": "1" if mode == "sdcwatch" else "0",
                       "TITAN_TINY_JOB": f"titan-bench-{r}", "TITAN_TINY_DUMP": str(tmp / f"dump-{mode}-{r}")}
                res = run(args, nproc, env, tmp, f"{mode}{r}")
                times[mode].append(res["ms_per_step"])
                print(f"  round {r} {mode:9s} {res['ms_per_step']:9.2f} ms/step", flush=True)
        off, sdc = statistics.median(times["off"]), statistics.median(times["sdcwatch"])
        print(f"overhead: off {off:.2f} ms/step, sdcwatch {sdc:.2f} ms/step, ratio {sdc / off:.4f} "
              f"({100 * (sdc / off - 1):+.2f}%)")

        resume_at = args.save_every * max(1, (args.steps // args.save_every) // 2)
        det = {**base, "TITAN_TINY_JOB": "titan-bench-resume", "TITAN_TINY_DETERMINISTIC": "1",
               "TITAN_TINY_DUMP": str(tmp / "dump-resume")}
        first = run(args, nproc, det, tmp, "resume-first")
        resumed = {**det, "TITAN_TINY_RESUME": "1", "TITAN_TINY_ARGS": f"--checkpoint.load_step {resume_at}"}
        second = run(args, nproc, resumed, tmp, "resume-second")
        print(f"resume: from the agent's step {resume_at} to {second['step']}: weights bit-identical to the "
              f"uninterrupted run: {second['weights_sha'] == first['weights_sha']}")

        if args.flip and nproc >= 2:
            flip = run(args, nproc, {**base, "TITAN_TINY_JOB": "titan-bench-flip",
                                     "TITAN_TINY_DUMP": str(tmp / "dump-flip")}, tmp, "flip", args.flip)
            print(f"flip after step {args.flip} on rank 1: rolled back to {flip['rollbacks']}, ended at step "
                  f"{flip['step']}, replicas bit-identical: {flip['identical']}")
        elif args.flip:
            print("flip: needs 2 ranks (no replica to vote with on one GPU)")
    finally:
        agent.terminate()
        agent.wait(30)
        from checkpoint.shm_store import default_shm_root
        from sdcwatch.safe_fs import remove_tree
        mem = default_shm_root(sock.parent)              # the agent's memory tier outlives it
        if mem.parent.is_dir():
            remove_tree(mem.parent)
    print(f"agent log and data: {tmp}")


if __name__ == "__main__":
    main()
