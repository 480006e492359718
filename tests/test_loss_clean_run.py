"""bench/loss_clean_run.py on the CPU: a small GPT trained from scratch raises no loss or grad-norm event
(the warm-up's erratic gradient norms included). The H200 runs the same script with GPT-2 small."""
from __future__ import annotations

import pytest

from bench.loss_clean_run import main


def test_a_clean_run_from_scratch_raises_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--device", "cpu", "--steps", "400", "--layers", "2", "--width", "64", "--heads", "2",
               "--vocab", "256", "--seq", "64", "--batch", "8", "--warmup", "40", "--lr", "1e-3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "400 steps, 0 warnings or critical events" in out
