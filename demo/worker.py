"""One data-parallel rank of `sdcwatch demo`: trains the small GPT with the Monitor, the compute checks and
in-memory checkpoints, applies the fault plan, and rolls back when the vote or the agent says so.

Run by the demo orchestrator as `python -m demo.worker SPEC.json` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. Writes JSON lines to `<out>/rank<R>.jsonl` (rank 0: one per step).

Rollback is collective: every step the ranks all-reduce (MAX) a small request vector made of what each
rank knows (its vote result, a directive from the agent); when any rank asks, rank 0 picks the target
(the directive's, or the newest VERIFIED checkpoint older than the anomaly) and broadcasts it, so every
rank restores the same step and skips the same batches.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from checkpoint.client import CheckpointClient
from checksums.compute_gate import ComputeChecks
from checksums.monitor import Monitor
from demo.data import Batches, load_corpus
from demo.faults import FaultPlan, Injector
from demo.model import GPT, GPTConfig
from sdcwatch.proc import bind_to_parent

ROLLBACK_VOTE, ROLLBACK_DIRECTIVE = 1, 2


class Log:
    def __init__(self, path: Path) -> None:
        self.fh = open(path, "a", buffering=1)

    def write(self, **rec: Any) -> None:
        rec.setdefault("t", time.time())
        self.fh.write(json.dumps(rec) + "\n")


def main(spec_path: str) -> int:
    bind_to_parent()   # dies with `sdcwatch demo`, even when that is SIGKILLed (sdcwatch/proc.py)
    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = spec.get("device") == "cuda" and torch.cuda.is_available()
    if use_cuda:
        # the compute checks' replays compare gradients bit for bit only under deterministic kernels (else
        # they fall back to a rounding bound, said in `sdcwatch status`): cuBLAS's workspace setting before
        # its first handle, and warn_only=False (warn_only=True leaves a non-deterministic kernel in place)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    log = Log(Path(spec["out"]) / f"rank{rank}.jsonl")
    try:
        return train(spec, rank, world, device, log)
    finally:
        dist.destroy_process_group()


def train(spec: dict[str, Any], rank: int, world: int, device: torch.device, log: Log) -> int:
    torch.manual_seed(spec.get("seed", 0))  # same init on every rank (DDP also broadcasts it)
    cfg = GPTConfig(**spec.get("model", {}))
    model = GPT(cfg).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 2e-3), weight_decay=0.0)
    batches = Batches(load_corpus(), spec.get("batch", 8), cfg.context, seed=spec.get("seed", 0))
    injector = Injector(FaultPlan.from_json(spec.get("faults", {})), rank)
    uuids = spec.get("gpu_uuids") or []
    sock = spec["socket"]
    monitor = Monitor.attach(ddp, opt, job_id=spec["job_id"], agent_socket=sock, every=1,
                             gpu_uuid=uuids[rank] if rank < len(uuids) else None)
    # each rank's gradient compared across ranks before the all-reduce, a suspect update held back and replayed
    checks = ComputeChecks.attach(ddp, opt, loss_fn=gpt_loss, monitor=monitor,
                                  gpu_uuid=uuids[rank] if rank < len(uuids) else "")
    injector.attach(model)
    ckpt = CheckpointClient.connect(spec["job_id"], rank, world, target=sock, deadline_s=10, guard=monitor.guard)
    steps, every = int(spec["steps"]), int(spec.get("ckpt_every", 10))
    step, data_index, iteration = 0, 0, 0
    seen_vote: Any = None
    handled_seq = 0
    log.write(event="start", rank=rank, world=world, device=str(device), params=sum(p.numel() for p in model.parameters()))
    while step < steps:
        x, y = batches.get(data_index, rank)
        x, y, bad = injector.batch(data_index, x, y, cfg.vocab_size)
        x, y = x.to(device), y.to(device)
        checks.retain((x, y))
        for rec in injector.before_forward(step):
            log.write(event="injected", **rec)
        _, loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        injector.after_backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for rec in injector.after_optimizer_step(step, model):
            log.write(event="injected", **rec)
        monitor.step(loss.detach(), grad_norm.detach(), step=step)
        if rank == 0:
            vote = monitor.last_vote
            log.write(i=iteration, step=step, data=data_index, loss=loss.item(), grad_norm=grad_norm.item(),
                      bad_batch=bad, vote_step=vote.step if vote else None,
                      agreed=vote.result.agreed if vote else None)
        if step % every == 0:
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                             "meta": {"step": step, "data_index": data_index}})
        # -- rollback, decided together ---------------------------------------------------------------
        # request: [kind, directive target + 1, skip, anomaly step, directive seq]; MAX over the ranks
        request = torch.zeros(5, dtype=torch.int64)
        vote = monitor.last_vote
        if vote is not None and vote is not seen_vote:
            seen_vote = vote
            if not vote.result.agreed:
                request[0], request[3] = ROLLBACK_VOTE, vote.step
        directive = monitor.pending_directive()
        while directive is not None and directive.event_seq <= handled_seq:
            directive = monitor.pending_directive()  # one another rank already acted on
        if directive is not None and directive.kind == 1:  # KIND_ROLLBACK
            request[0] = max(int(request[0]), ROLLBACK_DIRECTIVE)
            request[1], request[2] = directive.target_step + 1, directive.skip_batches
            request[4] = directive.event_seq
        request = _all_reduce_max(request, device)
        if int(request[0]):
            handled_seq = max(handled_seq, int(request[4]))
            monitor.flush()  # votes about steps before the rollback are read now and ignored
            seen_vote = monitor.last_vote
            target = torch.tensor([-1, 0], dtype=torch.int64)
            if rank == 0:
                target[0], target[1] = pick_target(ckpt, request)
            target = _broadcast(target, device)
            if int(target[0]) >= 0:
                t0 = time.time()
                ckpt.wait(timeout=30)
                state = ckpt.restore(int(target[0]), device=str(device))
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
                meta = state["meta"]
                skip = int(target[1])
                log.write(event="rollback", rank=rank, at_step=step, to_step=int(meta["step"]), skip=skip,
                          reason="vote" if int(request[0]) == ROLLBACK_VOTE else "directive",
                          seconds=time.time() - t0)
                step, data_index = int(meta["step"]) + 1, int(meta["data_index"]) + 1 + skip
                iteration += 1
                continue
            log.write(event="rollback_impossible", rank=rank, at_step=step, reason="no verified checkpoint")
        step += 1
        data_index += 1
        iteration += 1
    ckpt.wait(timeout=30)
    monitor.close(timeout=5)
    stats = monitor.stats
    cs = checks.status()
    log.write(event="finished", rank=rank, step=step, iterations=iteration, checks=stats.checks_run,
              mismatches=stats.mismatches, dropped=stats.reports_dropped,
              compute={"mode": checks.mode(), "suspicions": cs.suspicions, "dropped": cs.dropped,
                       "audits": cs.audits, "replays": cs.replays})
    ckpt.close()
    return 0


def gpt_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The step's loss from the bare model and a retained batch (the compute checks' replays)."""
    x, y = batch
    return module(x, y)[1]


def _all_reduce_max(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """All-reduce (MAX) a small host tensor over whatever backend the group has (NCCL needs CUDA)."""
    on = t.to(device)
    dist.all_reduce(on, op=dist.ReduceOp.MAX)
    return on.cpu()


def _broadcast(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    on = t.to(device)
    dist.broadcast(on, 0)
    return on.cpu()


def pick_target(ckpt: Any, request: torch.Tensor) -> tuple[int, int]:
    """Rank 0: the step to restore and the batches to skip."""
    if int(request[0]) == ROLLBACK_DIRECTIVE and int(request[1]) > 0:
        return int(request[1]) - 1, int(request[2])
    anomaly = int(request[3])
    deadline = time.time() + 10
    while True:
        verified = [c.step for c in ckpt.list() if c.state == "VERIFIED" and c.step < anomaly]
        if verified or time.time() > deadline:
            return (max(verified) if verified else -1), 0
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
