"""Reading CSV / JSON-lines training logs, and the errors bad logs get (with their line numbers)."""
from __future__ import annotations

import json
import math
import re
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


# -- text logs ----------------------------------------------------------------------------------------

TEXT_LOGS = Path(__file__).resolve().parent / "data" / "training-logs"


def text_log(name: str) -> Path:
    path = TEXT_LOGS / name
    assert path.is_file(), f"test data missing: {path}"
    return path


@pytest.mark.parametrize("name,fmt,expected", [
    # (file, the preset auto-detection picks, [(line, step, loss, grad_norm, loss_scale)])
    ("megatron.log", "kv", [(2, 100, 2.775923, 0.523, 32768.0), (3, 110, 2.772822, 0.511, 32768.0)]),
    ("nemo.log", "kv", [(1, 99, 2.34, None, None), (2, 100, 2.338, None, None)]),
    ("hf.log", "hf", [(1, 1, 2.3456, 1.234, None), (3, 2, 2.3012, math.nan, None)]),
    ("nanogpt.log", "nanogpt", [(2, 0, 10.9876, None, None), (3, 10, 9.1234, None, None)]),
    ("torchtitan.log", "torchtitan", [(1, 1, 12.2345, 3.2103, None), (2, 2, 11.1, None, None)]),
    ("kv.log", "kv", [(1, 100, 2.34, 0.5, None), (2, 110, 2.3, 0.6, None)]),
])
def test_text_logs_as_trainers_print_them(name: str, fmt: str, expected: list) -> None:
    log = read_training_log(text_log(name))
    assert log.format == fmt
    got = [(s.line, s.step, s.loss, s.grad_norm, s.loss_scale) for s in log.runs[0].samples]
    for g, e in zip(got, expected, strict=True):
        assert g[:2] == e[:2]
        for a, b in zip(g[2:], e[2:]):
            assert (a is None and b is None) or (a is not None and b is not None and (
                math.isnan(a) and math.isnan(b) or a == pytest.approx(b)))


def test_hf_nan_grad_norm_and_eval_dicts_skipped() -> None:
    samples = read_training_log(text_log("hf.log")).runs[0].samples
    assert math.isnan(samples[1].grad_norm) and len(samples) == 2


@pytest.mark.parametrize("fmt", ["megatron", "nemo", "kv"])
def test_named_kv_presets_read_megatron_lines(fmt: str) -> None:
    log = read_training_log(text_log("megatron.log"), fmt=fmt)
    assert [s.step for s in log.runs[0].samples] == [100, 110]


def test_pattern_with_named_groups(tmp_path: Path) -> None:
    p = write(tmp_path, "noise\n[100] L=2.5 g=0.3\n[101] L=nan g=0.4\nmore noise\n", "log.txt")
    log = read_training_log(p, pattern=r"\[(?P<step>\d+)\] L=(?P<loss>\S+) g=(?P<grad_norm>\S+)")
    assert log.format == "pattern"
    assert [(s.line, s.step, s.grad_norm) for s in log.runs[0].samples] == [(2, 100, 0.3), (3, 101, 0.4)]
    assert math.isnan(log.runs[0].samples[1].loss)


@pytest.mark.parametrize("kwargs,what", [
    (dict(pattern=r"step (?P<step>\d+)"), "needs the named groups step and loss (missing: loss)"),
    (dict(pattern=r"(?P<step>"), "is not a regular expression"),
    (dict(fmt="nanogpt"), "no line has a step and a loss (--format nanogpt)"),
    (dict(fmt="bogus"), "unknown --format 'bogus'"),
])
def test_text_errors_name_the_flags(kwargs: dict, what: str) -> None:
    with pytest.raises(TrainingLogError, match=re.escape(what)):
        read_training_log(text_log("megatron.log"), **kwargs)


def test_unreadable_text_log_suggests_format_and_pattern(tmp_path: Path) -> None:
    p = write(tmp_path, "hello\nworld 12\n", "log.txt")
    with pytest.raises(TrainingLogError) as info:
        read_training_log(p)
    assert "--format (" in str(info.value) and "--pattern REGEX" in str(info.value)
    assert "--step-col" not in str(info.value)


def test_step_going_back_without_a_run_column_names_run_col(tmp_path: Path) -> None:
    p = write(tmp_path, "step,loss\n5,3.0\n6,3.0\n4,3.0\n")
    with pytest.raises(TrainingLogError, match="--allow-restarts; a log that interleaves runs needs --run-col"):
        read_training_log(p)
