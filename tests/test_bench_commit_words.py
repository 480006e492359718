"""bench/commit_words.py runs end to end on the CPU against the real checkpoint service: both modes commit
GPT-2 small's layout and the table names them. No timing claims."""
from __future__ import annotations

import pytest

from bench.commit_words import gpt2_layout, main


def test_the_commit_words_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--commits", "3"]) == 0
    out = capsys.readouterr().out
    assert "594 tensors" in out and "manifest rendered on the rank (commit_shard)" in out
    assert "layout once + words (commit_words)" in out and "words / json" in out


def test_the_benchs_layout_is_gpt2_small_with_adamw() -> None:
    layout = gpt2_layout("j")
    paths = [e[0] for e in layout.entries]
    for k in ("/exp_avg", "/exp_avg_sq", "/step"):     # AdamW's state for each of the 148 parameters
        assert sum(p.endswith(k) for p in paths) == 148, k
    assert len(paths) == 594 and paths[-1].endswith("/param_groups")   # the model's 149 and the groups' value
    assert layout.n_pieces > len(paths)            # tensors cut at chunk boundaries
