"""The in-job canary: a known-answer GEMM enqueued on the training's own stream between steps.

    canary = InJobCanary(budget_fraction=0.005)           # at attach: inputs, expected answers, buffers
    ...
    result = canary.maybe_run(step, step_time_s)           # once per step, after the optimizer step
    if result is not None and result.status is Status.FAIL: ...

`maybe_run` never synchronises with the GPU and never allocates host memory: it first looks (with
`Event.query()`) whether the canary enqueued at an earlier step has finished, and if so compares the
fingerprint words that were copied to a pinned host buffer with the expected ones (a result is returned);
then, if the time budget allows (`checksums.canary_budget.budget_allows`: canary time so far plus the next
one's estimated cost within `budget_fraction` of the training time), it enqueues the next canary: the GEMM,
the fingerprint of its output (`fingerprint_tensors_async`), a non-blocking copy of the two words to
pinned memory, and timing events. Dtypes rotate from run to run. Only on a FAIL does it synchronise, once,
to localise the wrong rows/columns/tiles.

On the CPU the same steps run synchronously and the result is returned by the same call.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from checksums import canary_gemm
from checksums.canary_budget import InJobBudget, budget_allows
from checksums.canary_gemm import KnownAnswerSpec, Matmul
from checksums.fingerprint import fingerprint_list_from_parts, fingerprint_tensors_async, to_signed64
from sdcwatch.canary import CheckResult, Status

log = logging.getLogger(__name__)


class InJobCanary:
    def __init__(self, device: torch.device | str | None = None, *, budget_fraction: float = 0.005,
                 budget: InJobBudget | None = None, dtypes: Sequence[str] | None = None,
                 shape: tuple[int, int, int] = (2048, 2048, 2048), seed: int = 7,
                 matmul: Matmul = canary_gemm.default_matmul, label: str = "") -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.budget = budget or InJobBudget(budget_fraction=budget_fraction)
        ok, _ = canary_gemm.supported_dtypes(self.device)
        self.dtypes = [d for d in (dtypes or ok) if d in ok]
        if not self.dtypes:
            raise ValueError(f"none of the dtypes {list(dtypes or [])} run on {self.device} (supported: {ok})")
        self.label = label or str(self.device)
        self.matmul = matmul
        m, n, k = shape
        self.specs = [KnownAnswerSpec(dt, m, n, k, seed=seed + i, shape_name="injob") for i, dt in enumerate(self.dtypes)]
        self._inputs = [canary_gemm.build_inputs(s, self.device) for s in self.specs]
        self._expected = [tuple(to_signed64(v) for v in fingerprint_list_from_parts(
            [canary_gemm.expected_fingerprint(s, self.device)])) for s in self.specs]
        self._cuda = self.device.type == "cuda"
        self._dev_words = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._host_words = torch.zeros(2, dtype=torch.int64, pin_memory=self._cuda)
        self._events: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event] | None = None
        if self._cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event())
        self._out: torch.Tensor | None = None
        self._pending: tuple[int, int] | None = None      # (spec index, step)
        self._next = 0
        self.train_time_s = 0.0
        self.canary_time_s = 0.0
        self.est_cost_s = 0.0
        self.last_run_step: int | None = None
        self.runs = 0
        self.failures = 0
        self.last_reason = ""

    # -- the per-step hook ----------------------------------------------------------------------------------
    def maybe_run(self, step: int, step_time_s: float) -> CheckResult | None:
        """Account `step_time_s`; return the result of a finished earlier canary (or None); maybe enqueue."""
        if step_time_s > 0:
            self.train_time_s += step_time_s
        result = self.poll()
        if self._pending is None:
            ok, why = budget_allows(self.budget, step=step, last_run_step=self.last_run_step,
                                    train_time_s=self.train_time_s, canary_time_s=self.canary_time_s,
                                    est_cost_s=self.est_cost_s)
            self.last_reason = why
            if ok:
                self._enqueue(step)
                if not self._cuda and result is None:
                    result = self.poll()
        return result

    def _enqueue(self, step: int) -> None:
        i = self._next
        self._next = (self._next + 1) % len(self.specs)
        spec, (a, b) = self.specs[i], self._inputs[i]
        t0 = time.perf_counter()
        if self._events is not None:
            self._events[0].record()
        self._out = self.matmul(a, b, spec)
        fingerprint_tensors_async([self._out], out=self._dev_words)
        self._host_words.copy_(self._dev_words, non_blocking=self._cuda)
        if self._events is not None:
            self._events[1].record()
            self._events[2].record()
        else:
            self._account(time.perf_counter() - t0)
        self._pending = (i, step)
        self.last_run_step = step

    def _account(self, cost_s: float) -> None:
        self.canary_time_s += cost_s
        self.est_cost_s = cost_s if self.runs == 0 else 0.7 * self.est_cost_s + 0.3 * cost_s
        self.runs += 1

    def poll(self) -> CheckResult | None:
        """The pending canary's result if it has finished (no sync), else None."""
        if self._pending is None:
            return None
        if self._events is not None:
            if not self._events[2].query():
                return None
            self._account(self._events[0].elapsed_time(self._events[1]) / 1000.0)
        i, step = self._pending
        self._pending = None
        spec = self.specs[i]
        got = tuple(int(v) for v in self._host_words.tolist())
        details = {"spec": spec.to_json(), "step": step, "expected_list_fingerprint": [hex(v & (2**64 - 1)) for v in self._expected[i]],
                   "actual_list_fingerprint": [hex(v & (2**64 - 1)) for v in got]}
        if got == self._expected[i]:
            return CheckResult("gemm", f"injob/{spec.name}", Status.PASS, (self.label,), self.est_cost_s, details=details)
        self.failures += 1
        assert self._out is not None
        mismatch = canary_gemm.localise(canary_gemm.expected_output(spec, self.device), self._out)  # syncs, once
        why = mismatch.summary() if mismatch else "fingerprint mismatch"
        if mismatch is not None:
            details["mismatch"] = mismatch.to_json()
        log.error("in-job canary failed at step %d on %s: %s", step, self.label, why)
        return CheckResult("gemm", f"injob/{spec.name}", Status.FAIL, (self.label,), self.est_cost_s, why=why,
                           details=details)

    @property
    def overhead_fraction(self) -> float:
        return self.canary_time_s / self.train_time_s if self.train_time_s > 0 else 0.0
