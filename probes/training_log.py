"""Read training logs (CSV, JSON lines, or text as training scripts print it) into per-run sample series
for the loss detector.

Formats (`fmt=`, the CLI's `--format`): `auto` (the default), `csv`, `jsonl`, and text presets:

  megatron    Megatron-LM / Megatron-DeepSpeed iteration lines: `iteration 100/ 5000 | ... | lm loss:
              2.77E+00 | loss scale: 32768.0 | grad norm: 0.52 | ...` (read as `kv`)
  nemo        NeMo / PyTorch Lightning progress lines: `... reduced_train_loss=2.34, global_step=99.0, ...`
              (read as `kv`)
  hf          Hugging Face Trainer log dicts: `{'loss': 2.345, 'grad_norm': 1.2, 'learning_rate': 5e-05,
              'epoch': 0.1}` (no step in them: the step is the dict's ordinal, or `step` if present)
  nanogpt     nanoGPT: `iter 100: loss 4.2345, time 98.12ms, mfu 12.34%`
  torchtitan  torchtitan: `step:  10  loss:  7.8125  grad_norm:  1.23  memory: ...` (colour codes removed)
  kv          any line of `key: value`, `key=value` fields separated by `|`, `,`, `;` or runs of spaces
              (`iter 100 | loss=2.3 | grad norm: 0.9`); a field `iteration 100/5000` or `step 100` is the
              step; keys are matched like CSV column names

and `pattern=` (the CLI's `--pattern REGEX`): a regular expression with named groups `step` and `loss`
(optionally `grad_norm`, `loss_scale`, `run`) searched in every line. In text formats lines that do not
match are skipped (log chatter); a log where no line matches is an error that names `--format` and
`--pattern`. `auto` reads JSON lines when the first data line is a JSON object, CSV when its first line
is a header with step and loss columns, else the text preset that matches the most lines. In CSV,
lines starting with `#` are comments; in both, blank lines are skipped. Columns are picked by name
(`step_col=`, ...) or detected from the usual names (Megatron's `iteration`, `lm_loss`, `grad_norm`,
`loss_scale`; nanoGPT's `iter`, `loss`; Hugging Face's `step`, `loss`, `grad_norm`). Rows whose kind
column (`kind`, `split`, `phase`, `mode`) says eval/val/test are skipped, as are JSON records without
the loss key (other record types). `nan`/`inf` are valid values; an empty cell is "not reported".

Anything else wrong raises `TrainingLogError` naming the file line: missing columns, text in a numeric
column, a step that goes back within a run (unless `allow_restarts`, where it starts a new segment:
logs of runs resumed from a checkpoint do that), an empty log. Equal steps are further samples of
that step (ranks, micro-batches), except with `allow_restarts`, where a repeated step is a relaunch
too (the BigScience excerpts hold separate launches that all logged iteration 2).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from sdcwatch.errors import SdcwatchError

log = logging.getLogger(__name__)

STEP_NAMES = ("step", "iteration", "iter", "global_step", "trainer/global_step", "train/step", "_step", "steps",
              "it", "update", "num_updates")
LOSS_NAMES = ("loss", "lm_loss", "train_loss", "train/loss", "training_loss", "train/lm_loss", "loss/train",
              "train_lm_loss", "lm loss", "reduced_train_loss", "train_loss_step")
GRAD_NORM_NAMES = ("grad_norm", "grad norm", "gradient_norm", "train/grad_norm", "grad_norm/total", "gnorm",
                   "total_grad_norm", "grad_norm_total", "train/gnorm")
LOSS_SCALE_NAMES = ("loss_scale", "loss scale", "grad_scale", "scaler/scale", "train/loss_scale", "scale")
RUN_NAMES = ("run", "run_id", "run_name", "job", "job_id", "experiment")
KIND_NAMES = ("kind", "split", "phase", "mode")
SKIPPED_KINDS = frozenset({"eval", "evaluation", "val", "valid", "validation", "test"})


_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|NaN|inf|Inf|infinity|Infinity)"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TEXT_PRESETS: dict[str, str] = {
    "nanogpt": rf"\biter\s+(?P<step>\d+):\s*loss\s+(?P<loss>{_NUM})",
    "torchtitan": (rf"\bstep:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{_NUM})"
                   rf"(?=(?:.*?\bgrad_norm:\s*(?P<grad_norm>{_NUM}))?)"),
    "hf": (rf"\{{.*?'loss':\s*(?P<loss>{_NUM})(?=(?:.*?'grad_norm':\s*(?P<grad_norm>{_NUM}))?)"
           rf"(?=(?:.*?'(?:step|global_step)':\s*(?P<step>\d+))?)"),
}
_KV_PRESETS = ("megatron", "nemo", "kv")
FORMATS = ("auto", "csv", "jsonl") + tuple(_TEXT_PRESETS) + _KV_PRESETS
_FIELD_SPLIT = re.compile(r"\s*[|,;]\s*")
_TOKEN_FIELD = re.compile(rf"(?<![\w/.\-])(?P<key>[A-Za-z_][\w/.\-]*)\s*[:=]\s*(?P<val>{_NUM})(?![\w.])")
_FIELD = re.compile(rf"^(?P<key>[A-Za-z_][\w/ .()\-]*?)\s*[:=]\s*(?P<val>{_NUM})(?:\s*[A-Za-z%]*)?$")
_STEP_FIELD = re.compile(r"^(?P<key>iteration|iter|step|global_step)\s+(?P<val>\d+)(?:\s*/\s*\d+)?:?$", re.I)


class TrainingLogError(SdcwatchError, ValueError):
    """A log that cannot be read, with the file line (1-based; 0 when not about one line)."""

    def __init__(self, path: str | Path, line: int, what: str) -> None:
        self.path, self.line, self.what = str(path), line, what
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(f"{where}: {what}")


@dataclasses.dataclass(frozen=True, slots=True)
class LogSample:
    line: int
    step: int
    loss: float | None
    grad_norm: float | None
    loss_scale: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class LogRun:
    """The samples of one run (or, with restarts allowed, one segment of it) in file order."""

    name: str
    samples: tuple[LogSample, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class LogColumns:
    """The column names used (None = absent)."""

    step: str
    loss: str
    grad_norm: str | None
    loss_scale: str | None
    run: str | None
    kind: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class TrainingLog:
    path: str
    format: str                  # "csv", "jsonl", a text preset's name, or "pattern"
    columns: LogColumns
    runs: tuple[LogRun, ...]
    skipped_rows: int            # eval rows, JSON records of another type

    @property
    def n_samples(self) -> int:
        return sum(len(r.samples) for r in self.runs)


def _norm(name: str) -> str:
    return re.sub(r"[\s\-]+", "_", name.strip().lower())


def _pick(header: list[str], wanted: str | None, candidates: Iterable[str], what: str, flag: str,
          path: str | Path, line: int, required: bool) -> str | None:
    if wanted is not None:
        if wanted in header:
            return wanted
        by_norm = {_norm(h): h for h in header}
        if _norm(wanted) in by_norm:
            return by_norm[_norm(wanted)]
        raise TrainingLogError(path, line, f"no column {wanted!r} (from {flag}); columns are: {', '.join(header)}")
    by_norm = {}
    for h in header:
        by_norm.setdefault(_norm(h), h)
    for cand in candidates:
        if _norm(cand) in by_norm:
            return by_norm[_norm(cand)]
    if required:
        raise TrainingLogError(path, line, f"no {what} column (looked for {', '.join(candidates)}); columns are: "
                                           f"{', '.join(header) or '(none)'}; name it with {flag}")
    return None


def _number(raw: Any, path: str | Path, line: int, column: str) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise TrainingLogError(path, line, f"column {column!r}: expected a number, got {raw!r}")
    if isinstance(raw, (int, float)):
        return float(raw)
    text = str(raw).strip()
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        raise TrainingLogError(path, line, f"column {column!r}: expected a number, got {text!r}") from None


def _step(raw: Any, path: str | Path, line: int, column: str) -> int:
    value = _number(raw, path, line, column)
    if value is None:
        raise TrainingLogError(path, line, f"column {column!r}: the step is empty")
    if not math.isfinite(value) or value != int(value) or value < 0:
        raise TrainingLogError(path, line, f"column {column!r}: the step must be a whole number >= 0, got {raw!r}")
    return int(value)


def _records(path: Path, text: str) -> tuple[str, list[str], list[tuple[int, dict[str, Any]]]]:
    """(format, header, [(line, record)]) from the text; header = union of keys for JSON lines."""
    lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise TrainingLogError(path, 0, "empty log: no header and no samples")
    first_no, first = lines[0]
    if first.lstrip().startswith("{"):
        header: dict[str, None] = {}
        records = []
        for no, ln in lines:
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError as exc:
                raise TrainingLogError(path, no, f"not a JSON object: {exc.msg}") from None
            if not isinstance(rec, dict):
                raise TrainingLogError(path, no, f"not a JSON object: {type(rec).__name__}")
            for k in rec:
                header.setdefault(str(k), None)
            records.append((no, rec))
        return "jsonl", list(header), records
    delimiter = "\t" if "\t" in first and "," not in first else ","
    header_row = next(csv.reader([first], delimiter=delimiter))
    header_list = [h.strip() for h in header_row]
    records = []
    for no, ln in lines[1:]:
        row = next(csv.reader([ln], delimiter=delimiter))
        if len(row) != len(header_list):
            raise TrainingLogError(path, no, f"{len(row)} fields where the header (line {first_no}) has "
                                             f"{len(header_list)}")
        records.append((no, dict(zip(header_list, row))))
    return "csv", header_list, records


Records = list[tuple[int, dict[str, Any]]]


def _kv_record(line: str) -> dict[str, Any]:
    """The `key: value` / `key=value` fields of one text line (keys as written, values as text)."""
    rec: dict[str, Any] = {}
    for field in _FIELD_SPLIT.split(line.strip().strip("|").strip()):
        m = _STEP_FIELD.match(field) or _FIELD.match(field)
        if m:     # the whole field: keys may have spaces (`lm loss: 2.7`, `iteration 100/ 5000`)
            rec.setdefault(m.group("key").strip(), m.group("val"))
            continue
        for m in _TOKEN_FIELD.finditer(field):     # `step=100 loss=2.3`: one-word keys
            rec.setdefault(m.group("key"), m.group("val"))
    return rec


def _regex_records(lines: list[tuple[int, str]], rx: re.Pattern[str], ordinal_step: bool) -> Records:
    out: Records = []
    for no, ln in lines:
        m = rx.search(ln)
        if m is None:
            continue
        rec = {k: v for k, v in m.groupdict().items() if v is not None}
        if "step" not in rec and ordinal_step:
            rec["step"] = str(len(out) + 1)        # HF's printed dicts carry no step: their ordinal
        out.append((no, rec))
    return out


def _text_parser(name: str, pattern: str | None) -> Callable[[list[tuple[int, str]]], Records]:
    if pattern is not None:
        rx = re.compile(pattern)
        return lambda lines: _regex_records(lines, rx, ordinal_step=False)
    if name in _TEXT_PRESETS:
        rx = re.compile(_TEXT_PRESETS[name])
        return lambda lines: _regex_records(lines, rx, ordinal_step=name == "hf")
    return lambda lines: [(no, rec) for no, ln in lines if (rec := _kv_record(ln))]   # megatron, nemo, kv


def _text_records(path: Path, text: str, fmt: str, pattern: str | None) -> tuple[str, list[str], Records]:
    """Records of a text log, by preset or pattern; in `auto`, the preset matching the most lines."""
    lines = [(i + 1, _ANSI.sub("", ln)) for i, ln in enumerate(text.splitlines()) if ln.strip()]
    if pattern is not None:
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise TrainingLogError(path, 0, f"--pattern {pattern!r} is not a regular expression: {exc}") from None
        missing = {"step", "loss"} - set(rx.groupindex)
        if missing:
            raise TrainingLogError(path, 0, f"--pattern needs the named groups step and loss (missing: "
                                            f"{', '.join(sorted(missing))}), e.g. 'iter (?P<step>\\d+).*loss "
                                            f"(?P<loss>[0-9.eE+-]+)'")
        names = ["pattern"]
    else:
        names = [fmt] if fmt != "auto" else list(_TEXT_PRESETS) + ["kv"]
    best: tuple[str, Records] | None = None
    for name in names:
        recs = [(no, r) for no, r in _text_parser(name, pattern)(lines) if _has_step_and_loss(r)]
        if recs and (best is None or len(recs) > len(best[1])):
            best = (name, recs)
        if fmt != "auto":
            break
    if best is None:
        tried = "--pattern" if pattern is not None else f"--format {fmt}" if fmt != "auto" else "every --format"
        raise TrainingLogError(path, 0, f"no line has a step and a loss ({tried}); name the log's format with "
                                        f"--format ({', '.join(FORMATS[3:])}) or give --pattern REGEX with "
                                        "named groups step and loss (e.g. 'iter (?P<step>\\d+).*loss "
                                        "(?P<loss>[0-9.eE+-]+)')")
    name, records = best
    header: dict[str, None] = {}
    for _, rec in records:
        for k in rec:
            header.setdefault(k, None)
    return name, list(header), records


def _has_step_and_loss(rec: dict[str, Any]) -> bool:
    keys = {_norm(k) for k in rec}
    return bool(keys & {_norm(n) for n in STEP_NAMES}) and bool(keys & {_norm(n) for n in LOSS_NAMES})


def _looks_tabular(text: str) -> bool:
    """JSON lines (the first data line is a JSON object), or CSV/TSV: a header of two or more names (no
    numbers, no `key: value`); or nothing but comments (an empty log)."""
    first = next((ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), None)
    if first is None:
        return True
    if first.lstrip().startswith("{"):
        try:
            return isinstance(json.loads(first), dict)
        except json.JSONDecodeError:
            return False
    delimiter = "\t" if "\t" in first and "," not in first else ","
    header = next(csv.reader([first], delimiter=delimiter), [])
    return len(header) >= 2 and not any(re.fullmatch(_NUM, h.strip()) or ":" in h or "=" in h for h in header)


def read_training_log(path: str | Path, *, step_col: str | None = None, loss_col: str | None = None,
                      grad_norm_col: str | None = None, loss_scale_col: str | None = None,
                      run_col: str | None = None, allow_restarts: bool = False, fmt: str = "auto",
                      pattern: str | None = None) -> TrainingLog:
    """Read and check a whole log. Raises `TrainingLogError` (a ValueError) with the line number."""
    p = Path(path)
    if fmt not in FORMATS:
        raise TrainingLogError(p, 0, f"unknown --format {fmt!r}; formats are: {', '.join(FORMATS)}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TrainingLogError(p, 0, f"not a UTF-8 text file ({exc.reason})") from None
    except OSError as exc:
        raise TrainingLogError(p, 0, f"cannot read: {exc.strerror or exc}") from None
    if pattern is not None or fmt not in ("auto", "csv", "jsonl") or (fmt == "auto" and not _looks_tabular(text)):
        fmt, header, records = _text_records(p, text, fmt, pattern)
        header_line = 0
    else:
        fmt, header, records = _records(p, text)
        header_line = next(i + 1 for i, ln in enumerate(text.splitlines())
                           if ln.strip() and not ln.lstrip().startswith("#"))
    cols = LogColumns(
        step=_pick(header, step_col, STEP_NAMES, "step", "--step-col", p, header_line, True) or "",
        loss=_pick(header, loss_col, LOSS_NAMES, "loss", "--loss-col", p, header_line, True) or "",
        grad_norm=_pick(header, grad_norm_col, GRAD_NORM_NAMES, "grad norm", "--grad-norm-col", p, header_line, False),
        loss_scale=_pick(header, loss_scale_col, LOSS_SCALE_NAMES, "loss scale", "--loss-scale-col", p,
                         header_line, False),
        run=_pick(header, run_col, RUN_NAMES, "run", "--run-col", p, header_line, False),
        kind=_pick(header, None, KIND_NAMES, "kind", "", p, header_line, False),
    )
    runs: dict[str, list[list[LogSample]]] = {}
    last: dict[str, LogSample] = {}
    skipped = 0
    for no, rec in records:
        if cols.kind is not None and str(rec.get(cols.kind, "")).strip().lower() in SKIPPED_KINDS:
            skipped += 1
            continue
        if fmt != "csv" and (cols.loss not in rec or cols.step not in rec):
            skipped += 1
            continue
        step = _step(rec.get(cols.step), p, no, cols.step)
        sample = LogSample(
            line=no, step=step,
            loss=_number(rec.get(cols.loss), p, no, cols.loss),
            grad_norm=_number(rec.get(cols.grad_norm), p, no, cols.grad_norm) if cols.grad_norm else None,
            loss_scale=_number(rec.get(cols.loss_scale), p, no, cols.loss_scale) if cols.loss_scale else None,
        )
        run = str(rec.get(cols.run, "")).strip() if cols.run else ""
        segments = runs.setdefault(run, [[]])
        prev = last.get(run)
        if prev is not None and step <= prev.step and (step < prev.step or allow_restarts):
            if not allow_restarts:
                where = f" in run {run!r}" if cols.run else ""
                hint = "" if cols.run else "; a log that interleaves runs needs --run-col NAME"
                raise TrainingLogError(p, no, f"step {step} is lower than step {prev.step} at line {prev.line}{where} "
                                              "(unsorted steps; a log of a run restarted from a checkpoint can be "
                                              f"read with --allow-restarts{hint})")
            segments.append([])
        segments[-1].append(sample)
        last[run] = sample
    if not runs:
        raise TrainingLogError(p, 0, f"no training samples ({skipped} eval or other rows skipped)")
    out: list[LogRun] = []
    for run, segments in runs.items():
        base = run or p.stem
        for i, seg in enumerate(segments):
            out.append(LogRun(name=base if i == 0 else f"{base}#{i + 1}", samples=tuple(seg)))
    log.debug("read %s: %s, %d runs, %d samples, %d skipped", p, fmt, len(out), sum(len(r.samples) for r in out),
              skipped)
    return TrainingLog(path=str(p), format=fmt, columns=cols, runs=tuple(out), skipped_rows=skipped)
