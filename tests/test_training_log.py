"""Reading CSV / JSON-lines training logs, and the errors bad logs get (with their line numbers)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from probes.training_log import TrainingLogError, read_training_log

from loss_curves import bigscience, nanogpt


def write(tmp_path: Path, text: str, name: str = "log.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_csv_with_comments_and_auto_detected_columns(tmp_path: Path) -> None:
    p = write(tmp_path, "# a comment\nstep,loss,grad_norm,lr\n1,3.5,0.9,1e-4\n\n# another\n2,3.4,,1e-4\n3,nan,inf,1e-4\n")
    log = read_training_log(p)
    assert log.format == "csv" and log.columns.step == "step" and log.columns.grad_norm == "grad_norm"
    assert log.columns.loss_scale is None and log.columns.run is None
    (run,) = log.runs
    assert [s.step for s in run.samples] == [1, 2, 3]
    assert [s.line for s in run.samples] == [3, 6, 7]
    assert run.samples[1].grad_norm is None
    assert math.isnan(run.samples[2].loss) and math.isinf(run.samples[2].grad_norm)


def test_jsonl_skips_other_record_types(tmp_path: Path) -> None:
    rows = [{"step": 10, "loss": 2.5, "grad_norm": 1.0}, {"step": 10, "eval_loss": 2.7},
            {"step": 20, "loss": "NaN", "grad_norm": 1.1}, {"global_step": 30}]
    p = write(tmp_path, "\n".join(json.dumps(r) for r in rows) + "\n", "log.jsonl")
    log = read_training_log(p)
    assert log.format == "jsonl" and log.skipped_rows == 2
    assert [s.step for s in log.runs[0].samples] == [10, 20] and math.isnan(log.runs[0].samples[1].loss)


def test_explicit_columns_and_tab_separated(tmp_path: Path) -> None:
    p = write(tmp_path, "it\tmy loss\tgn\n1\t3.0\t1\n2\t2.9\t1\n")
    log = read_training_log(p, step_col="it", loss_col="my loss", grad_norm_col="gn")
    assert [s.loss for s in log.runs[0].samples] == [3.0, 2.9]


def test_runs_and_equal_steps(tmp_path: Path) -> None:
    p = write(tmp_path, "run,step,loss\na,1,3\nb,1,4\na,2,3\nb,2,4\na,2,3.1\n")
    log = read_training_log(p)
    assert [(r.name, [s.step for s in r.samples]) for r in log.runs] == [("a", [1, 2, 2]), ("b", [1, 2])]


def test_eval_rows_are_skipped(tmp_path: Path) -> None:
    p = write(tmp_path, "iter,kind,loss\n1,train,3\n2,eval,3.2\n2,train,2.9\n")
    log = read_training_log(p)
    assert log.skipped_rows == 1 and [s.step for s in log.runs[0].samples] == [1, 2]


@pytest.mark.parametrize("text,line,what", [
    ("step,lr\n1,0.1\n", 1, "no loss column"),
    ("loss,lr\n1,0.1\n", 1, "no step column"),
    ("step,loss\n1,3.0\n2,abc\n", 3, "expected a number, got 'abc'"),
    ("step,loss\n1,3.0\nx,3.0\n", 3, "expected a number, got 'x'"),
    ("step,loss\n1,3.0\n2.5,3.0\n", 3, "whole number"),
    ("step,loss\n1,3.0\n,3.0\n", 3, "step is empty"),
    ("step,loss\n5,3.0\n6,3.0\n4,3.0\n", 4, "step 4 is lower than step 6 at line 3"),
    ("step,loss\n1,3.0,7\n", 2, "3 fields where the header (line 1) has 2"),
    ("# only a comment\n\n", 0, "empty log"),
    ("step,loss\n", 0, "no training samples"),
    ("", 0, "empty log"),
])
def test_bad_logs_name_the_line(tmp_path: Path, text: str, line: int, what: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(TrainingLogError) as info:
        read_training_log(p)
    assert info.value.line == line
    assert what in str(info.value)
    assert (f"{p}:{line}:" if line else f"{p}:") in str(info.value)


def test_bad_json_line(tmp_path: Path) -> None:
    p = write(tmp_path, '{"step": 1, "loss": 3}\n{"step": 2, "loss": \n', "log.jsonl")
    with pytest.raises(TrainingLogError, match=r":2: not a JSON object"):
        read_training_log(p)


def test_unknown_explicit_column_and_missing_file(tmp_path: Path) -> None:
    p = write(tmp_path, "step,loss\n1,3\n")
    with pytest.raises(TrainingLogError, match="no column 'nope' \\(from --loss-col\\)"):
        read_training_log(p, loss_col="nope")
    with pytest.raises(TrainingLogError, match="cannot read"):
        read_training_log(tmp_path / "missing.csv")


def test_restarts_split_into_segments(tmp_path: Path) -> None:
    p = write(tmp_path, "step,loss\n1,3\n2,3\n3,3\n2,3\n3,3\n")
    with pytest.raises(TrainingLogError, match="--allow-restarts"):
        read_training_log(p)
    log = read_training_log(p, allow_restarts=True)
    assert [(r.name, [s.step for s in r.samples]) for r in log.runs] == [("log", [1, 2, 3]), ("log#2", [2, 3])]


def test_bigscience_excerpts_columns() -> None:
    log = read_training_log(bigscience(), allow_restarts=True)
    c = log.columns
    assert (c.step, c.loss, c.grad_norm, c.loss_scale, c.run) == ("iteration", "lm_loss", "grad_norm", "loss_scale", "run")
    assert log.n_samples == 65
    assert {r.name.split("#")[0] for r in log.runs} == {"tr1-13B-base", "tr11-176B-ml", "tr8-104B-wide", "tr8b-104B"}
    bloom = next(r for r in log.runs if r.name == "tr11-176B-ml")
    assert bloom.samples[0].loss_scale is None           # bf16: no loss scale in those lines


def test_bigscience_excerpts_are_unsorted_without_allow_restarts() -> None:
    with pytest.raises(TrainingLogError) as info:
        read_training_log(bigscience())
    assert info.value.line == 26 and "step 2 is lower than step 45000" in str(info.value)


def test_nanogpt_excerpt() -> None:
    log = read_training_log(nanogpt())
    assert (log.columns.step, log.columns.loss, log.columns.kind) == ("iter", "loss", "kind")
    assert log.skipped_rows == 1
    steps = [s.step for s in log.runs[0].samples]
    assert steps[0] == 2920 and 3010 in steps
    assert math.isnan(next(s.loss for s in log.runs[0].samples if s.step == 3010))
