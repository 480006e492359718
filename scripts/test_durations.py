"""Write tests/durations.json, each test file's seconds in a suite run, from pytest's `--durations=0` report:

    .venv/bin/python -m pytest -q --durations=0 > /tmp/durations.log
    .venv/bin/python scripts/test_durations.py /tmp/durations.log

tests/conftest.py hands the files to the xdist workers heaviest first (longest first: the run does not end
with one worker alone on a long file while the others idle). Rounded to whole seconds; a file the report
does not name keeps no entry (tests/suite_order.py counts it as the median)."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (?:call|setup|teardown)\s+(tests/[^:\s]+\.py)")
OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="tests/durations.json from a pytest `--durations=0` report")
    p.add_argument("report", help="the run's output (pytest ... --durations=0)")
    p.add_argument("--out", default=str(OUT), help="where to write (default: tests/durations.json)")
    args = p.parse_args(argv)
    try:
        text = Path(args.report).read_text(errors="replace")
    except OSError as exc:
        print(f"test_durations: cannot read {args.report}: {exc.strerror}", file=sys.stderr)
        return 2
    seconds: dict[str, float] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
    if not seconds:
        print(f"test_durations: no `--durations=0` lines in {args.report}", file=sys.stderr)
        return 2
    table = {k: max(1, round(v)) for k, v in sorted(seconds.items())}
    out = Path(args.out)
    out.write_text(json.dumps(table, indent=0, sort_keys=True) + "\n")
    print(f"{out}: {len(table)} files, {sum(table.values())} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
