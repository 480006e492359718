"""Optional dependencies: which pip extra brings each, and the one message a missing one gives.

The core install (`pip install sdcwatch`) runs the agent and the CLI; torch (the training side, the canary
child, the demo), matplotlib (plots) and psutil (benchmarks) come with extras. A command that needs one says
so plainly, e.g. "needs torch: pip install 'sdcwatch[torch]'", and exits 2 instead of a traceback.
"""
from __future__ import annotations

import importlib.util

from sdcwatch.errors import SdcwatchError

EXTRA_OF = {"torch": "torch", "triton": "triton", "matplotlib": "plot", "psutil": "bench", "boto3": "s3",
            "transformers": "hf", "lightning": "lightning", "torchtitan": "torchtitan"}


class MissingExtraError(SdcwatchError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def needs(module: str) -> str:
    """The message for a missing optional `module`: "needs torch: pip install 'sdcwatch[torch]'"."""
    return f"needs {module}: pip install 'sdcwatch[{EXTRA_OF[module]}]'"


def available(module: str) -> bool:
    """Whether the optional `module` can be imported (found, not imported: nothing heavy is loaded)."""
    return importlib.util.find_spec(module) is not None


def require(module: str) -> None:
    """Raise `MissingExtraError` naming the extra when the optional `module` is not installed."""
    if not available(module):
        raise MissingExtraError(needs(module), name=module)
