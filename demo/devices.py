"""`python -m demo.devices`: how many CUDA GPUs torch sees here, as one JSON line on stdout.

The `sdcwatch demo` command asks this child instead of importing torch itself (the CLI is the agent's
program and stays torch-free): {"torch": "2.13.0+cpu", "cuda_devices": 0}.
"""
from __future__ import annotations

import json

import torch


def main() -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(json.dumps({"torch": torch.__version__, "cuda_devices": n}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
