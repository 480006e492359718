"""The demo's corpus: the Python standard library's own source text (ships with every Python, no
download), read as bytes for a byte-level model, with a deterministic batch sampler.

The sampler is indexed by (step, rank) so a run that rolls back and skips batches stays reproducible and
every data-parallel rank draws a different batch.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

MODULES = ("textwrap", "argparse", "json/__init__", "json/decoder", "json/encoder", "csv", "string",
           "shlex", "fractions", "heapq", "bisect", "difflib", "calendar", "statistics", "dataclasses")


def load_corpus(max_bytes: int = 400_000) -> torch.Tensor:
    """The corpus as a uint8 tensor (at least 64 KiB); raises RuntimeError if the stdlib is unreadable."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for name in MODULES:
        path = stdlib / f"{name}.py"
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"\n".join(chunks)[:max_bytes]
    if len(text) < 65536:
        raise RuntimeError(f"could not read enough of the standard library's source under {stdlib}")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


class Batches:
    def __init__(self, corpus: torch.Tensor, batch: int, context: int, seed: int = 1234) -> None:
        self.corpus = corpus.long()
        self.batch = batch
        self.context = context
        self.seed = seed

    def get(self, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number `index` for `rank` (inputs, targets), independent of anything run before."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 1009 + rank)
        starts = torch.randint(0, len(self.corpus) - self.context - 1, (self.batch,), generator=g)
        x = torch.stack([self.corpus[s: s + self.context] for s in starts.tolist()])
        y = torch.stack([self.corpus[s + 1: s + 1 + self.context] for s in starts.tolist()])
        return x, y
