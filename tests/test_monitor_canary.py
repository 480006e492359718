"""The Monitor's in-job canary hook: results reach the report (and a FAIL is an event) without breaking
training. On the CPU the canary runs synchronously; the same code enqueues on the stream on CUDA."""
from __future__ import annotations

import torch

from support import RecordingReporter

from checksums.canary_budget import InJobBudget
from checksums.canary_injob import InJobCanary
from checksums.monitor import Monitor
from probes.canary_faults import FaultyMatmul


def _run(matmul) -> tuple[Monitor, RecordingReporter]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    canary = InJobCanary("cpu", budget=InJobBudget(budget_fraction=0.99, min_steps_between=1, warmup_steps=0),
                         dtypes=["fp32"], shape=(64, 64, 64),
                         matmul=matmul, label="GPU-00000000-0000-4000-8000-0000000000c0")
    cap = RecordingReporter()
    mon = Monitor.attach(model, opt, job_id="canary-test", reporter=cap, canary=canary,
                         gpu_uuid="GPU-00000000-0000-4000-8000-0000000000c0")
    for step in range(12):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step(loss.detach(), step=step)
    mon.close()
    return mon, cap


def test_passing_canary_is_reported() -> None:
    mon, cap = _run(matmul=lambda a, b, spec: __import__("checksums.canary_gemm", fromlist=["x"]).default_matmul(a, b, spec))
    results = [r.canary for r in cap.requests if r.HasField("canary")]
    assert results and all(c.status == "PASS" for c in results)
    assert not [e for e in mon.events if e.kind == "canary.fail"]


def test_failing_canary_is_an_event_and_reported() -> None:
    mon, cap = _run(matmul=FaultyMatmul(where="output", index=(3, 5), bit=20))
    results = [r.canary for r in cap.requests if r.HasField("canary")]
    assert results and results[0].status == "FAIL" and results[0].why
    assert [e for e in mon.events if e.kind == "canary.fail"]
