"""The suite hands its longest files out first (tests/suite_order.py, tests/conftest.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from suite_order import heaviest_files_first, load_costs, order_of

ROOT = Path(__file__).resolve().parents[1]


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_longest_files_go_first_and_each_keeps_its_order() -> None:
    items = _items("tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/c.py::t1", "tests/c.py::t2",
                   "tests/d.py::t1")
    heaviest_files_first(items, {"tests/a.py": 5, "tests/b.py": 100, "tests/c.py": 20, "tests/d.py": 1})
    assert [i.nodeid for i in items] == ["tests/b.py::t1", "tests/c.py::t1", "tests/c.py::t2",
                                         "tests/a.py::t1", "tests/a.py::t2", "tests/d.py::t1"]


def test_a_file_without_an_entry_counts_as_the_median_and_ties_keep_the_collection_order() -> None:
    items = _items("tests/new.py::t", "tests/x.py::t", "tests/y.py::t", "tests/z.py::t", "tests/w.py::t")
    heaviest_files_first(items, {"tests/x.py": 1, "tests/y.py": 10, "tests/z.py": 50, "tests/w.py": 10})
    # median of 1, 10, 50, 10 is 10: the new file ties with y and w and keeps its place before them
    assert order_of(items) == ["tests/z.py", "tests/new.py", "tests/y.py", "tests/w.py", "tests/x.py"]


def test_no_costs_leave_the_order_alone(tmp_path: Path) -> None:
    items = _items("tests/b.py::t", "tests/a.py::t")
    for bad in ("", "[1, 2]", "{\"tests/a.py\": \"slow\"}", "not json"):
        (tmp_path / "d.json").write_text(bad)
        costs = load_costs(tmp_path / "d.json")
        assert costs == {}
        heaviest_files_first(items, costs)
        assert order_of(items) == ["tests/b.py", "tests/a.py"]
    assert load_costs(tmp_path / "missing.json") == {}


def test_the_durations_file_names_test_files_that_exist() -> None:
    costs = load_costs(ROOT / "tests" / "durations.json")
    assert len(costs) > 100, "tests/durations.json is missing or nearly empty: scripts/test_durations.py"
    gone = [p for p in costs if not (ROOT / p).is_file()]
    assert len(gone) <= len(costs) // 10, f"stale entries in tests/durations.json (rewrite it): {gone}"
    assert costs["tests/test_compute_clean_steps.py"] > costs["tests/test_layers.py"]


def test_the_durations_script_reads_a_durations_report(tmp_path: Path) -> None:
    report = tmp_path / "d.log"
    report.write_text("=== slowest durations ===\n12.50s call     tests/test_x.py::test_a\n"
                      "0.40s setup    tests/test_x.py::test_a\n3.00s call     tests/test_y.py::test_b[1-2]\n")
    out = tmp_path / "durations.json"
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "test_durations.py"), str(report), "--out",
                          str(out)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert json.loads(out.read_text()) == {"tests/test_x.py": 13, "tests/test_y.py": 3}
    empty = tmp_path / "e.log"
    empty.write_text("no durations here\n")
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "test_durations.py"), str(empty), "--out",
                          str(out)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 2 and "no `--durations=0` lines" in got.stderr
