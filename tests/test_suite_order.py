"""The suite's order (tests/conftest.py): every file named in LONGEST_FIRST exists, so a renamed file is not
silently dropped from the front, and the collection puts those files first in that order."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import LONGEST_FIRST, pytest_collection_modifyitems

TESTS = Path(__file__).resolve().parent


def test_every_file_named_longest_first_exists() -> None:
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [n for n in LONGEST_FIRST if not (TESTS / n).is_file()] == []


def test_collection_puts_the_longest_files_first_and_keeps_each_files_order(pytestconfig: pytest.Config) -> None:
    class Item:
        def __init__(self, name: str, i: int) -> None:
            self.path, self.i, self.keywords = TESTS / name, i, {}

        def get_closest_marker(self, _name: str) -> None:
            return None

        def add_marker(self, _marker: object) -> None:
            pass

    items = [Item("test_a.py", 0), Item(LONGEST_FIRST[1], 1), Item("test_a.py", 2), Item(LONGEST_FIRST[0], 3),
             Item(LONGEST_FIRST[1], 4)]
    pytest_collection_modifyitems(pytestconfig, items)  # type: ignore[arg-type]
    assert [(it.path.name, it.i) for it in items] == [(LONGEST_FIRST[0], 3), (LONGEST_FIRST[1], 1),
                                                     (LONGEST_FIRST[1], 4), ("test_a.py", 0), ("test_a.py", 2)]
