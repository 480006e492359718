"""bench/bench_fingerprint_cpu.py runs end to end: every case's two paths agree (it exits otherwise) and the
table has a row each. No timing claims."""
from __future__ import annotations

import pytest

from bench.bench_fingerprint_cpu import main


def test_the_cpu_fingerprint_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--rounds", "1"])
    out = capsys.readouterr().out
    for case in ("harness bucket 4,420 fp32", "MLP's 6 parameters", "DDP bucket 25 MB fp32", "16 x 64K bf16"):
        assert case in out, out
    assert "torch/host" in out
