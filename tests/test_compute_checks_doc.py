"""docs/compute-checks.md's loop, extracted from the doc and run as written: 3 gloo ranks under DDP, a small
classifier, the real agent on a temp socket. One element of rank 1's gradient is set to 100 in its backward
at step FAULT (before DDP reduces it; the replica vote cannot see that: the all-reduce averages it into every
replica). The loop as written catches it on its step: the update is dropped on every rank, rank 1 is named
(transient: its replay computes the clean gradient), the agent's journal holds a critical compute.fault
naming rank 1, and the replicas stay bit-identical. The clean steps raise no suspicion."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from agent_harness import ROOT, AgentProcess, cli
from deadlines import wait_until
from framework_support import replicas_identical
from rank_spawn import spawn

WORLD, STEPS, FAULT = 3, 60, 40


LOOPS = {"loop": 'job_id="run-42"', "grad-scaler-loop": "GradScaler(device)", "pipeline": "step_fn=step_fn"}


def doc_loop(which: str) -> str:
    """The doc's python block `which` of LOOPS (the one holding its marker): the loop, the loop under a
    GradScaler, a pipeline stage's loop."""
    text = (ROOT / "docs" / "compute-checks.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if LOOPS[which] in b]
    assert len(blocks) == 1, f"docs/compute-checks.md: {len(blocks)} python blocks hold {LOOPS[which]!r}"
    return blocks[0]


def _worker(rank: int, store: str, outdir: str, socket: str, code: str) -> None:
    os.environ["SDCWATCH_SOCKET"] = socket
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    out: dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        ddp_model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        loader = [(torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen))
                  for _ in range(STEPS)]
        g: dict[str, Any] = {"ddp_model": ddp_model, "optimizer": optimizer, "loader": loader,
                             "device": "cpu"}
        fired: list[int] = []

        def one_bad_element(grad: torch.Tensor) -> torch.Tensor | None:
            if rank == 1 and not fired and g["monitor"].guard.step == FAULT - 1:
                fired.append(FAULT)
                grad = grad.clone()
                # under a GradScaler the gradient is the scale times larger: the same fault in its units
                grad.view(-1)[3] = 100.0 * (g["scaler"].get_scale() if "scaler" in g else 1.0)
                return grad
            return None

        model[2].weight.register_hook(one_bad_element)
        exec(code, g)
        g["monitor"].flush()
        checks = g["checks"]
        out["status"] = dataclasses.asdict(checks.status())
        out["findings"] = [dataclasses.asdict(f) for f in checks.findings]
        out["skipped"] = g["monitor"].guard.skipped_count
        out["fired"] = fired
        out["identical"] = replicas_identical(list(model.parameters()))
        out["mode"] = checks.mode()
        out["scale"] = float(g["scaler"].get_scale()) if "scaler" in g else None
        g["monitor"].close()
        checks.close()
    finally:
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


@pytest.mark.parametrize("block", ["loop", "grad-scaler-loop"])
def test_the_doc_loop_drops_a_faulty_gradient_and_names_the_rank(short_tmp: Path, tmp_path: Path,
                                                                 block: str) -> None:
    """The grad-scaler loop is the doc's GradScaler loop as written (fp16 autocast on the CPU, the scaler
    passed): the same fault, in the scale's units, is caught on its step, rank 1 named as transient (its
    replay, under the step's scale, computes the clean gradient and the others agree), every replay exact."""
    agent = AgentProcess(short_tmp / "state").start()
    try:
        spawn(_worker, (str(tmp_path / "store"), str(tmp_path), str(agent.socket), doc_loop(block)), WORLD)

        def journal() -> list[str]:
            lines = cli("events", "--socket", str(agent.socket)).stdout.splitlines()
            return [line for line in lines if "compute.fault" in line]

        faults = wait_until(journal, 30, "a compute.fault in the agent's journal")
    finally:
        agent.stop()
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert res[1]["fired"] == [FAULT], res[1]
    for r in res:
        named = [(f["faulty"], f["cause"], f["step"], f["dropped"]) for f in r["findings"] if f["faulty"]]
        assert named == [([1], "transient", FAULT, True)], r
        assert r["mode"] == "exact" and r["identical"], r
        if block == "loop":  # nothing else happened (under the scaler an overflow step is the data's own)
            assert r["skipped"] == 1 and len(r["findings"]) == 1 and r["scale"] is None, r
            assert r["status"]["steps"] == STEPS and r["status"]["suspicions"] == 1, r["status"]
        else:
            assert r["scale"], r
    assert all("critical" in line and "rank 1" in line for line in faults), faults
