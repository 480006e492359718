"""The Triton fingerprint kernel under TRITON_INTERPRET=1 on CPU tensors, against the numpy path.

The interpreter must be chosen before triton is first imported, so the kernel runs in a child process
(this file, run as a script); the test compares what it reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cases():
    import torch

    gen = torch.Generator().manual_seed(11)

    def rnd(nbytes: int) -> torch.Tensor:
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)

    big = rnd(4 * 9000 + 8).view(torch.float32)  # many tiles and several items at block 64
    cases = {
        "every_dtype": [rnd(37 * 8)[: 37 * s].view(dt) for dt, s in [
            (torch.float32, 4), (torch.float64, 8), (torch.bfloat16, 2), (torch.float16, 2),
            (torch.float8_e4m3fn, 1), (torch.float8_e5m2, 1), (torch.int8, 1), (torch.uint8, 1),
            (torch.int16, 2), (torch.int32, 4), (torch.int64, 8)]] + [rnd(13).bool()],
        "odd_sizes_and_empty": [rnd(n) for n in (0, 1, 2, 3, 4, 5, 15, 16, 17, 31, 33, 255, 257)]
        + [torch.empty(0, 5), torch.tensor(2.5)],
        "misaligned_views": [big[1:], big[3:-2], rnd(4002).view(torch.int16)[1:1001], rnd(999)[3:]],
        "multi_tile_items": [big, big[4:], rnd(64 * 4 * 7 + 12), torch.randn(300, 7)],
        "non_contiguous": [torch.randn(20, 30).T, torch.randn(9, 9)[::2, 1:]],
    }
    # a checkpoint shard's pieces (checkpoint.source_sums): uint8 views of tensors cut at chunk boundaries
    # (1000 bytes: a multiple of 4, not of 16, so pieces start misaligned for the 128-bit loads)
    from checkpoint.snapshot import _piece_views
    from checkpoint.source_sums import pieces

    shard = [torch.randn(3001, generator=gen), rnd(77), torch.randn(50, generator=gen).to(torch.bfloat16)]
    cut = pieces([0, 12032, 12160], [t.numel() * t.element_size() for t in shard], 1000)
    cases["shard_pieces"] = _piece_views(shard, cut)
    return cases


def guard_interpreted_loads(allowed: list[tuple[int, int]], stray: list[int]) -> None:
    """Under TRITON_INTERPRET=1: every masked load of a kernel is checked against the address ranges in
    `allowed` (filled by the caller as it goes); addresses outside all of them are appended to `stray`."""
    import numpy as np
    import triton.runtime.interpreter as interp

    original_load = interp.InterpreterBuilder.create_masked_load

    def checked_load(self, ptrs, mask, *rest, **kwargs):  # every read inside an allowed range
        addrs = np.ravel(ptrs.data if mask is None else ptrs.data[mask.data]).astype(np.uint64)
        inside = np.zeros(addrs.shape, dtype=bool)
        for lo, hi in allowed:
            inside |= (addrs >= np.uint64(lo)) & (addrs < np.uint64(hi))
        stray.extend(addrs[~inside].tolist())
        return original_load(self, ptrs, mask, *rest, **kwargs)

    interp.InterpreterBuilder.create_masked_load = checked_load


def _child() -> None:
    from checksums.fingerprint import (
        canonical_dtype_name,
        fingerprint_bytes,
        fingerprint_list_from_parts,
    )


    allowed: list[tuple[int, int]] = []
    stray: list[int] = []
    guard_interpreted_loads(allowed, stray)
    from interpreter_support import patch_language_once_per_launch
    patch_language_once_per_launch()   # the interpreter's set-up once a launch, not once a nested call
    from checksums.fingerprint_triton import TritonFingerprintPlan

    report = {}
    for name, tensors in _cases().items():
        for block in (64, 256):
            plan = TritonFingerprintPlan(tensors, block=block, num_warps=4)
            allowed[:] = [(x.data_ptr(), x.data_ptr() + x.numel() * x.element_size())
                          for x in [*plan._tensors, plan.items, plan.table, plan.acc]]
            stray.clear()
            lw = [v & (2**64 - 1) for v in plan.run_async().tolist()]
            per = [[v & (2**64 - 1) for v in row] for row in plan.per_tensor[: plan.n].tolist()]
            lw2 = plan.run_async().tolist()
            host = [fingerprint_bytes(t.contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes(),
                                      canonical_dtype_name(t.dtype), tuple(t.shape)) for t in tensors]
            report[f"{name}/{block}"] = {
                "per_tensor_equal": [list(a) == list(b) for a, b in zip(per, host)],
                "list_equal": list(lw) == list(fingerprint_list_from_parts(host)),
                "stray_reads": len(stray),
                "repeat_equal": [v & (2**64 - 1) for v in lw2] == list(lw),
            }
    print("REPORT " + json.dumps(report))


@pytest.fixture(scope="module")
def report() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.mark.parametrize("case", ["every_dtype", "odd_sizes_and_empty", "misaligned_views", "multi_tile_items",
                                  "non_contiguous", "shard_pieces"])
@pytest.mark.parametrize("block", [64, 256])
def test_interpreted_kernel_matches_numpy(report: dict, case: str, block: int) -> None:
    r = report[f"{case}/{block}"]
    assert all(r["per_tensor_equal"]), r
    assert r["list_equal"]
    assert r["repeat_equal"]  # a second run of one plan (accumulators re-zeroed) gives the same words
    assert r["stray_reads"] == 0  # no load outside the tensors and the plan's tables


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _child()
