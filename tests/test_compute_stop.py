"""Issue 19, end to end: a GPU that keeps computing wrong stops the job, naming where to restart from.

Three gloo ranks train the harness's MLP under DDP with the Monitor, the compute checks (an audit every 5
steps) and the checkpoint client (a save every 10 steps), all reporting to the real agent on a temp socket.
From step FAULT rank 1's forward is wrong by 5% on the faulty layer's output, persistently (its replays too:
the same GPU computes wrong again); the statistics do not see so small a fault, so the updates between the
rank's last clean audit and the audit that finds it carry it. The agent's answer: a compute.fault event
naming rank 1's GPU, no checkpoint from the fault's first suspect step on VERIFIED, and a STOP directive that
every rank takes at the same iteration (`Monitor.agreed_directive`), whose target is the newest VERIFIED
checkpoint older than that step: where to restart from without the GPU. Only the agent decides: the ranks
keep training until the directive comes (up to a scaled deadline)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agent_harness import AgentProcess, cli
from deadlines import scaled
from rank_spawn import spawn

JOB, WORLD, FAULT, SAVE_EVERY, MIN_STEPS = "compute-stop", 3, 42, 10, 80


def _worker(rank: int, store: str, outdir: str, socket: str, extend_s: float) -> None:
    os.environ["SDCWATCH_SOCKET"] = socket
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    try:
        from bench import compute_faults as cf
        from checkpoint.client import CheckpointClient
        from checksums.compute_gate import ComputeChecks
        from checksums.monitor import Monitor

        cf.MODEL["name"] = "mlp"
        model, target = cf.make_model(0)
        step_now = {"step": 0}

        def faulty(mod: nn.Module, inp: Any, output: torch.Tensor) -> None:
            if rank == 1 and step_now["step"] >= FAULT and torch.is_grad_enabled():
                with torch.no_grad():      # every forward of this GPU from FAULT on: its replays too
                    output.mul_(1.05)

        target.register_forward_hook(faulty)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        uuid, host = f"GPU-e2e-{rank}", f"node{rank}"
        monitor = Monitor.attach(ddp, opt, job_id=JOB, gpu_uuid=uuid, host=host)
        checks = ComputeChecks.attach(ddp, opt, loss_fn=cf.loss_fn, audit_every=5, warmup=10, monitor=monitor,
                                      gpu_uuid=uuid, host=host)
        ckpt = CheckpointClient.connect(JOB, rank, WORLD, guard=monitor.guard)
        group = dist.new_group(backend="gloo")
        deadline = None
        step = 0
        while True:
            step += 1
            step_now["step"] = step
            batch = cf.batch_for(rank, step, torch.device("cpu"))
            checks.retain(batch)
            loss = cf.loss_fn(ddp, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            monitor.step(loss.detach())
            if monitor.step_count % SAVE_EVERY == 0:
                ckpt.save(monitor.step_count, {"model": model.state_dict()})
            directive = monitor.agreed_directive()
            if directive is not None and directive.kind == directive.KIND_STOP:
                out["stop"] = {"at": monitor.step_count, "target": directive.target_step,
                               "reason": directive.reason, "iteration": step}
                break
            if step >= MIN_STEPS:          # the ranks decide together whether to go on waiting
                deadline = deadline if deadline is not None else time.monotonic() + extend_s
                go = torch.tensor([int(time.monotonic() < deadline)])
                dist.all_reduce(go, op=dist.ReduceOp.MIN, group=group)
                if not go.item():
                    break
        out["steps"] = step
        out["findings"] = [{"step": f.step, "cause": f.cause, "since": f.since_step, "detector": f.detector,
                            "faulty": [list(w) for w in f.where]} for f in checks.findings]
        ckpt.wait(60)
        monitor.flush()
        monitor.close()
        ckpt.close()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def test_a_persistent_compute_fault_stops_every_rank_at_once_naming_the_checkpoint_to_restart_from(
        short_tmp: Path, tmp_path: Path) -> None:
    agent = AgentProcess(short_tmp / "state", "--checkpoints-keep-committed", "100").start()
    try:
        spawn(_worker, (str(tmp_path / "store"), str(tmp_path), str(agent.socket), scaled(60)), nprocs=WORLD)
        from checkpoint.agent_link import GrpcAgentLink
        link = GrpcAgentLink.connect(agent.target, 10)
        infos = link.list(JOB)
        link.close()
        journal = cli("events", "--socket", str(agent.socket)).stdout.splitlines()
    finally:
        agent.stop()
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    found = [f for f in res[0]["findings"] if f["faulty"] and f["cause"] == "persistent"]
    assert found, ("the audit did not name the faulty GPU", res[0]["findings"])
    first = found[0]
    assert first["detector"] == "audit" and [w[0] for w in first["faulty"]] == [1], first
    assert first["step"] >= FAULT and first["since"] <= FAULT, first
    stops = [r.get("stop") for r in res]
    assert all(stops), ("a rank was not told to stop", stops, [line for line in journal if "stop" in line])
    assert len({(s["at"], s["iteration"], s["target"]) for s in stops}) == 1, f"not at the same iteration: {stops}"
    stop = stops[0]
    verified = sorted(i.step for i in infos if i.state == "VERIFIED")
    assert verified and max(verified) < first["since"], (verified, first)
    assert stop["target"] == max(verified) and stop["target"] < FAULT, (stop, verified)
    assert "GPU-e2e-1" in stop["reason"] and f"VERIFIED step {stop['target']}" in stop["reason"], stop
    assert any("compute.fault" in line and "GPU-e2e-1" in line for line in journal)
    assert sum("job.stop_directive" in line for line in journal) == 1, [l for l in journal if "stop" in l]
