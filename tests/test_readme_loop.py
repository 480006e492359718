"""Issue 18 item 4: README.md's "In the training script" loop, extracted from the README and run as written
(2 gloo ranks, a tiny model, the real agent on a temp socket), with one bit flipped in rank 1's weights after
the update of step FLIP. Outcomes: the checkpoint holding the flip is never VERIFIED (its replicas' bytes
differ); the vote gates the updates; the agent's rollback directive takes both ranks, at the same iteration,
back to a VERIFIED checkpoint before the flip; the replicas are bit-identical at the end and later checkpoints
are VERIFIED. And with a corrupted range of batches: the loss detector's directive takes both ranks back once,
to a checkpoint before the range, and the batches are skipped. Only `device="cuda"` becomes "cpu" (no GPU
here).

Both runs' loaders go on past their STEPS batches with clean ones, as a user's long run would, while the
ranks agree that the rollback has not happened yet (up to a scaled deadline): on a loaded machine the agent's
directive can come after the 200th step (the loss detector sees the range 32 steps in; either plan waits for
the checkpoint coordinator to take the votes before it, and a loaded agent's feed runs seconds behind)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from agent_harness import ROOT, AgentProcess, cli
from rank_spawn import spawn
from framework_support import replicas_identical, wait_directive
from deadlines import scaled, wait_until

STEPS, FLIP = 200, 100
FAULT_STEP = 112  # the compute_stop run: rank 1's GPU computes wrong from this step on (saves at 50, 100)
HOLD = 10         # ... and rank 1 waits for the agent's STOP this many steps after (the audit at 115 finds it)
JOB = "llama-7b-run3"   # the README loop's job
BAD = (130, 170)   # the corrupted batches (loader positions) of the bad-data run


def readme_loop() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"In the training script[^\n]*\n\n```python\n(.*?)```", text, re.S)
    assert m, "README.md has no python block after 'In the training script'"
    return m.group(1).replace('device="cuda"', 'device="cpu"')


class LongerLoader:
    """`batches`, then `more()` ones while the ranks still want them: until `done()` (the rollback happened,
    waited for at most `extend_s` seconds) and `after` batches more (the skip, then steps on the restored weights:
    a late second directive would show). The ranks decide together (a MIN all-reduce on their own group at
    each extra batch: the README loop asks for batches at the same iterations on every rank)."""

    def __init__(self, batches: list[Any], more: Callable[[], Any], done: Callable[[], bool], extend_s: float,
                 after: int = 100) -> None:
        self.batches, self.more, self.done, self.extend_s, self.after = batches, more, done, extend_s, after
        self.group = dist.new_group(backend="gloo")
        self.extra = 0

    def __iter__(self) -> Iterator[Any]:
        yield from self.batches
        deadline = time.monotonic() + self.extend_s
        done_at = None
        while True:
            if done_at is None and self.done():
                done_at = self.extra
            # the deadline bounds the wait for the rollback only: once it happened, `after` batches follow
            # whatever the time (a directive that came late on a loaded machine, near the deadline, left the
            # restored run too few steps for a checkpoint after the restore: seen once in a loaded suite)
            want = (self.extra - done_at < self.after if done_at is not None
                    else time.monotonic() < deadline)
            go = torch.tensor([int(want)])
            dist.all_reduce(go, op=dist.ReduceOp.MIN, group=self.group)
            if not go.item():
                return
            self.extra += 1
            yield self.more()


def _worker(rank: int, store: str, outdir: str, socket: str, code: str, scenario: str = "flip",
            extend_s: float = 0.0) -> None:
    os.environ["SDCWATCH_SOCKET"] = socket
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"restores": []}
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        ddp_model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        w_true = torch.linspace(-1, 1, 8).reshape(8, 1)        # a task the model learns smoothly
        xs = [torch.randn(16, 8, generator=gen) for _ in range(STEPS)]
        loader = [(x, x @ w_true) for x in xs]
        if scenario == "bad_data":                             # a corrupted range of batches: wild targets
            loader = [(x, y * 1000.0 if BAD[0] <= i < BAD[1] else y) for i, (x, y) in enumerate(loader)]

        def clean() -> Any:
            x = torch.randn(16, 8, generator=gen)
            return x, x @ w_true

        loader = LongerLoader(loader, clean, lambda: bool(out["restores"]), extend_s)
        g: dict[str, Any] = {"ddp_model": ddp_model, "model": model, "optimizer": optimizer, "rank": rank,
                             "world_size": 2, "loader": loader}
        flipped: list[int] = []
        held: list[int] = []

        def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
            x, y = batch
            return ((module(x) - y) ** 2).mean()

        def train_step(batch: Any) -> torch.Tensor:
            x, y = batch
            if "checks" in g:
                g["checks"].retain(batch)
            loss = ((ddp_model(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            g["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            monitor = g["monitor"]
            if scenario == "compute_stop" and rank == 1 and monitor.guard.step == FAULT_STEP + HOLD and not held:
                held.append(1)   # the agent's STOP is planned seconds behind a tiny model's steps on a loaded
                wait_directive(JOB, kind="job.stop_directive")   # machine: rank 0 waits in the next all-reduce
            if scenario == "flip" and rank == 1 and monitor.guard.step == FLIP and not flipped:
                flipped.append(FLIP)
                with torch.no_grad():
                    model[0].weight.view(torch.int32).view(-1)[5] ^= 1 << 22
            return loss

        g["train_step"] = train_step
        real_restore: Any = None

        def recording_restore(target: Any, **kw: Any) -> Any:
            out["restores"].append(target)
            g["skips_at_restore"] = g["monitor"].guard.skipped_count
            return real_restore(target, **kw)

        code_main, _, _ = code.partition("batches = iter(loader)")
        exec(code_main, g)                               # the imports, attach and connect
        real_restore = g["ckpt"].restore
        g["ckpt"].restore = recording_restore
        if scenario == "compute_stop":                   # the README's bullet: the compute checks beside it
            from checksums.compute_gate import ComputeChecks
            g["checks"] = ComputeChecks.attach(ddp_model, optimizer, loss_fn=loss_fn, monitor=g["monitor"],
                                               audit_every=5, warmup=10)

            def wrong(mod: nn.Module, inp: Any, output: torch.Tensor) -> None:
                # rank 1's GPU computes its first layer 5% wrong from step FAULT_STEP on (its replays too)
                if rank == 1 and g["monitor"].guard.step >= FAULT_STEP - 1 and torch.is_grad_enabled():
                    with torch.no_grad():
                        output.mul_(1.05)

            model[0].register_forward_hook(wrong)
        try:
            exec("batches = iter(loader)" + code.partition("batches = iter(loader)")[2], g)   # the loop
        except SystemExit as stop:                       # the loop's exit on the agent's STOP
            out["exit"] = str(stop.code)
            out["exit_step"] = g["monitor"].step_count
        g["ckpt"].wait(60)
        g["monitor"].flush()
        out["identical"] = replicas_identical(list(model.parameters()))
        out["final_step"] = g["monitor"].step_count
        if "skips_at_restore" in g:      # updates skipped after the last restore (a stale vote's veto would show)
            out["skips_after_restore"] = g["monitor"].guard.skipped_count - g["skips_at_restore"]
        out["extra_batches"] = getattr(loader, "extra", 0)
        g["monitor"].close()
        g["ckpt"].close()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def test_the_readme_loop_recovers_from_a_flip(short_tmp: Path, tmp_path: Path) -> None:
    code = readme_loop()
    agent = AgentProcess(short_tmp / "state").start()
    try:
        spawn(_worker, (str(tmp_path / "store"), str(tmp_path), str(agent.socket), code, "flip",
                                scaled(60)), nprocs=2)
        res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        from checkpoint.agent_link import GrpcAgentLink
        link = GrpcAgentLink.connect(agent.target, 10)
        # the agent compares each checkpoint's replicas in the background: on a loaded machine it may still
        # be on the last few when the job ends. Wait (a deadline that scales) until every checkpoint redone
        # after the restore is VERIFIED or accounted for; one that never is fails below all the same
        seen: dict[str, Any] = {}

        def vouched() -> bool:
            seen["infos"] = link.list("llama-7b-run3")
            seen["journal"] = cli("events", "--socket", str(agent.socket)).stdout.splitlines()
            return not _unvouched(seen["infos"], seen["journal"], res[0]["restores"])

        with contextlib.suppress(AssertionError):          # judged below, with what it saw last
            wait_until(vouched, 60, "redone checkpoints VERIFIED", interval=0.5)
        infos, journal = seen["infos"], seen["journal"]
        link.close()
    finally:
        agent.stop()
    why = [line for line in journal if "rollback" in line or "checkpoint." in line][:60]
    for r in res:
        assert r["restores"] and all(t < FLIP for t in r["restores"]), (r, why)
        assert r["identical"], "the replicas are bit-identical at the end"
        assert r["skips_after_restore"] == 0, "a vote taken before the restore vetoed no redone update"
    assert res[0]["restores"] == res[1]["restores"], "both ranks restored the same step, together"
    assert res[0]["final_step"] == res[1]["final_step"]
    rolled = next(i for i, line in enumerate(journal) if "job.rollback " in line)
    early = [line for line in journal[:rolled] if "checkpoint.verified" in line
             and int(re.search(r"step (\d+) is VERIFIED", line).group(1)) >= FLIP]
    assert not early, f"a checkpoint holding the flip was VERIFIED: {early}"
    assert any("job.rollback_directive" in line and "replica mismatch from step" in line for line in journal)
    assert sum("critical replica.mismatch" in line for line in journal) == 1, "one incident, one event"
    states = {i.step: i.state for i in infos}
    assert states, "checkpoints listed"
    after = [s for s, st in states.items() if s > res[0]["restores"][-1]]
    since = journal[rolled:]
    unvouched = _unvouched(infos, journal, res[0]["restores"])
    assert after and not unvouched, (unvouched, states,
                                      [line for line in journal if "checkpoint" in line or "rollback" in line])
    assert not [line for line in since if "checkpoint.replicas_differ" in line
                and int(re.search(r"step (\d+):", line).group(1)) in after], "a redone checkpoint's replicas differ"


def test_the_readme_loop_exits_when_a_gpu_keeps_computing_wrong(short_tmp: Path, tmp_path: Path) -> None:
    """The README's loop with the compute checks its bullet describes, and rank 1's GPU computing 5% wrong
    from step 112 (too small for the statistics; its replays repeat it): the audit names rank 1 (two ranks:
    the CPU witness), the agent's STOP reaches both ranks at the same iteration, and the loop as written
    exits with the reason (non-zero, for a launcher to restart the job without that GPU) naming the GPU's
    rank and the VERIFIED step to restart from."""
    code = readme_loop()
    agent = AgentProcess(short_tmp / "state").start()
    try:
        spawn(_worker, (str(tmp_path / "store"), str(tmp_path), str(agent.socket), code, "compute_stop",
                                0.0), nprocs=2)
        from checkpoint.agent_link import GrpcAgentLink
        link = GrpcAgentLink.connect(agent.target, 10)
        verified = sorted(i.step for i in link.list("llama-7b-run3") if i.state == "VERIFIED")
        link.close()
        journal = cli("events", "--socket", str(agent.socket)).stdout.splitlines()
    finally:
        agent.stop()
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all("exit" in r for r in res), ([r.get("final_step") for r in res], [l for l in journal if "stop" in l])
    assert res[0]["exit"] == res[1]["exit"] and res[0]["exit_step"] == res[1]["exit_step"] < STEPS, res
    reason = res[0]["exit"]
    assert reason.startswith("sdcwatch: persistent compute fault") and "rank 1" in reason, reason
    target = int(re.search(r"VERIFIED step (\d+)", reason).group(1))
    assert target < FAULT_STEP and target in verified, (reason, verified)
    assert any("job.stop_directive" in line for line in journal)


def _unvouched(infos: list[Any], journal: list[str], restores: list[int]) -> list[int]:
    """The checkpoints redone after the last restore that are not VERIFIED (the newest may still be
    compared), but for one that retention evicted from memory before the agent's background comparison
    reached it (a loaded machine; its copy on a tier lists as COMMITTED: never VERIFIED without the
    comparison, which is right)."""
    states = {i.step: i.state for i in infos}
    rolled = next((i for i, line in enumerate(journal) if "job.rollback " in line), len(journal))
    since = journal[rolled:]
    return [s for s in states if restores and s > restores[-1] and s < max(states)
            and states[s] != "VERIFIED" and not _evicted_before_verified(since, s)]


def _evicted_before_verified(lines: list[str], step: int) -> bool:
    """Whether the journal `lines` say checkpoint `step` was evicted by retention before it was VERIFIED."""
    for line in lines:
        if "checkpoint.verified" in line and f"checkpoint step {step} is VERIFIED" in line:
            return False
        if "checkpoint.evicted" in line and f"checkpoint step {step} evicted" in line:
            return True
    return False


def test_the_readme_loop_rolls_back_before_a_corrupted_data_range(short_tmp: Path, tmp_path: Path) -> None:
    code = readme_loop()
    agent = AgentProcess(short_tmp / "state", "--rollback-skip-batches", "60",
                         "--rollback-skip-before-steps", "0").start()
    try:
        spawn(_worker, (str(tmp_path / "store"), str(tmp_path), str(agent.socket), code, "bad_data",
                                scaled(60)), nprocs=2)
        journal = cli("events", "--socket", str(agent.socket)).stdout.splitlines()
    finally:
        agent.stop()
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert res[0]["restores"] == res[1]["restores"] and res[0]["restores"], (res, journal[-30:])
    assert len(res[0]["restores"]) == 1 and res[0]["restores"][0] < BAD[0], "once, to a checkpoint before the range"
    assert all(r["identical"] for r in res)
    assert any("job.rollback_directive" in line for line in journal)
