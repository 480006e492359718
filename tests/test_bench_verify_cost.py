"""bench/verify_cost.py runs end to end on CPU (the GPU commands are in its docstring and bench/gpu_run.sh):
two gloo ranks with the host and the device replica gate, the saves with and without the agent's byte check,
the comparison and a repair. The numbers are the machine's; only that every row is printed is checked."""
from __future__ import annotations

import pytest

from bench import verify_cost
from rank_spawn import spawn


def test_verify_cost_prints_every_row_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert verify_cost.main(["--device", "cpu", "--world", "2", "--model", "tiny", "--steps", "3", "--warmup", "1",
                             "--reps", "1", "--saves", "1"], start=spawn) == 0
    out = capsys.readouterr().out
    for row in ("training step, Monitor", "host gate", "device gate (found_inf mask, no host wait)",
                "save(): blocking, with the agent byte check", "byte check stubbed out",
                "save() return -> committed", "vote event -> VERIFIED", "compare saved bytes per checkpoint",
                "in-place repair"):
        assert row in out, f"{row!r} missing:\n{out}"
    assert "mask device" in out and "save rows not run" not in out


def test_verify_cost_refuses_nccl_on_cpu() -> None:
    with pytest.raises(SystemExit) as err:
        verify_cost.main(["--device", "cpu", "--backend", "nccl"])
    assert err.value.code == 2
