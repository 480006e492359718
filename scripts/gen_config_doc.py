"""Regenerate docs/config.md (every config key) from the config tree in daemon/config.py.

Usage: python scripts/gen_config_doc.py        (tests/test_config.py fails while the file is stale)
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from daemon import config, config_tree  # noqa: E402  (after the path: run from anywhere)


def main() -> None:
    (ROOT / "docs" / "config.md").write_text(config_tree.markdown(config.Config, config.DOC_INTRO))


if __name__ == "__main__":
    main()
