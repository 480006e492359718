"""sdcwatch.arguments: the rank library's constructor-argument checks, and LossGate's use of them (the
Monitor's and ComputeChecks' are in their own tests)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from sdcwatch.arguments import above, count, function, text


def test_count_takes_whole_numbers_and_refuses_the_rest_by_name() -> None:
    assert count("n", 3, "steps") == 3 and count("n", np.int64(4), "steps") == 4
    assert type(count("n", np.int64(4), "steps")) is int
    assert count("n", 1, "steps", least=1) == 1
    for bad in (True, False, 2.5, -1, "3", None, np.float64(2.0)):
        with pytest.raises(ValueError, match=r"n is steps, an int >= 0, got"):
            count("n", bad, "steps")
    with pytest.raises(ValueError, match=">= 1, got 0"):
        count("n", 0, "steps", least=1)


def test_above_refuses_nan_infinity_bools_and_the_bound() -> None:
    assert above("m", 3, "a margin", 1.0) == 3.0 and above("m", np.float32(1.5), "a margin", 1.0) == 1.5
    for bad in (math.nan, math.inf, 1.0, 0.5, True, "3", None):
        with pytest.raises(ValueError, match=r"m is a margin, a finite number > 1, got"):
            above("m", bad, "a margin", 1.0)


def test_text_and_function() -> None:
    text("host", "h")
    text("host", None)
    function("cb", print)
    function("cb", None)
    with pytest.raises(ValueError, match="host is a string, got int"):
        text("host", 3)
    with pytest.raises(ValueError, match="uuid is a string, got NoneType"):
        text("uuid", None, optional=False)
    with pytest.raises(ValueError, match="cb is a function, got str"):
        function("cb", "print")
    with pytest.raises(ValueError, match="cb is a function, got NoneType"):
        function("cb", None, optional=False)
    with pytest.raises(ValueError, match=r"cb is a function \(called back\), got int"):
        function("cb", 3, why="called back")


@pytest.mark.parametrize("kwargs, message", [
    ({"loss_fn": 3}, "loss_fn is a function"),
    ({"module": 3}, "module is the training's nn.Module"),
    ({"gate_on": "critical"}, "gate_on is a function"),
    ({"max_findings": -1}, "max_findings"),
    ({"max_findings": 2.5}, "max_findings"),
    ({"host": 3}, "host is a string"),
    ({"gpu_uuid": b"GPU-1"}, "gpu_uuid is a string"),
    ({"gpu_uuid": "0"}, r"gpu_uuid '0' is not a GPU UUID \(GPU-... or MIG-...\)"),
    ({"host": "node 7"}, "host 'node 7' is not a hostname"),
    ({"config": {"spike_ratio": 2}}, "config is a LossDetectorConfig"),
    ({"checks": object()}, "checks is a ComputeChecks"),
])
def test_loss_gate_refuses_arguments_of_the_wrong_kind_before_it_hooks_the_optimizer(kwargs, message) -> None:
    """Each was taken (a non-callable loss_fn failed at the first replay, host=3 in the findings) or failed
    in another library's words ('int' object has no attribute 'parameters'); and the optimizer is left
    without the gate's hooks."""
    from checksums.step_guard import StepGuard
    from probes.loss_gate import LossGate

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = {"module": model, "loss_fn": lambda m, b: m(b[0]).sum(), **kwargs}
    with pytest.raises(ValueError, match=message):
        LossGate.attach(opt, **args)
    assert StepGuard.attach(opt)._stages == {}, "a refused gate left a stage on the optimizer's guard"


@pytest.mark.parametrize("kwargs, message", [
    ({"job_id": "llama 70b #3"}, "job_id 'llama 70b #3' is invalid: 1-128 characters"),
    ({"job_id": "-x"}, "starting with a letter, digit or _"),
    ({"host": "node/7"}, "host 'node/7' is not a hostname"),
    ({"gpu_uuid": "cuda:0"}, r"gpu_uuid 'cuda:0' is not a GPU UUID"),
])
def test_the_monitor_refuses_a_name_the_agent_would_refuse_on_every_report(kwargs, message) -> None:
    """The agent refuses a report whose job id, host or GPU UUID breaks its rule (INVALID_ARGUMENT): such a
    name was taken at attach, and the job then trained with every report refused. One rule for both sides
    (sdcwatch.names), said at attach in the agent's words; a valid name and the agent's own check agree."""
    from checksums.monitor import Monitor
    from daemon.validation import check_job_id

    with pytest.raises(ValueError, match=message) as refused:
        Monitor.attach(nn.Linear(2, 2), **{"job_id": "j", "reporter": False, **kwargs})
    if "job_id" in kwargs:                       # the agent's words for the same name
        assert check_job_id(kwargs["job_id"]) == str(refused.value)
    Monitor.attach(nn.Linear(2, 2), job_id="llama-70b.run_3", host="node_7.cluster", gpu_uuid="MIG-1a/2/3",
                   reporter=False).close()


def test_the_compute_checks_refuse_a_host_or_gpu_uuid_the_agent_would_refuse() -> None:
    """Their findings name the faulty rank's host and GPU: a name the agent refuses would have its report
    refused whole (the finding with it)."""
    from checksums.compute_gate import ComputeChecks

    for kwargs, message in (({"gpu_uuid": "0"}, "gpu_uuid '0' is not a GPU UUID"),
                            ({"host": "a b"}, "host 'a b' is not a hostname")):
        with pytest.raises(ValueError, match=message):
            ComputeChecks(object(), object(), loss_fn=lambda m, b: b, **kwargs)  # type: ignore[arg-type]
