"""bench/ckpt_overlap.py runs end to end on the CPU with tiny sizes (the H200 runs it at 2 and 12 GiB):
every part prints its table, the saved bytes equal the weights before the next update. No timing claims."""
from __future__ import annotations

import pytest

from bench.ckpt_overlap import main


def test_the_overlap_bench_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "--smoke", "--fp-threads", "2", "--profile"]) == 0
    out = capsys.readouterr().out
    for title in ("a. added step time per save", "b. checkpoint every step", "c. first save vs steady",
                  "d. ours vs DCP async_save"):
        assert title in out, out
    assert "3/3 identical" in out, out
    assert "added step time per save" in out and "steps whose checkpoint reached COMMITTED" in out
    assert "4 in flight" in out and "1 in flight" in out and "background host work per save" in out
    assert "first save blocking, with prepare()" in out and "torch.save to local disk" in out
    assert "profile: training flatten" in out and "profile: background commit" in out   # --profile (issue 21)
    assert "first save made, every_step(), no prepare()" in out
    assert "FAILED" not in out, out
