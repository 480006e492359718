"""The benchmarks' GPT: `demo.model.GPT` (one model in the project) with the benchmarks' config
names. GPT-2 small by default: 12 x 768, 12 heads, vocab 50257, context 1024, tied embeddings, so 148
parameter tensors and ~124M parameters.
"""
from __future__ import annotations

import dataclasses

import torch

from demo.model import GPT
from demo.model import GPTConfig as ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50257
    seq: int = 1024

    def __post_init__(self) -> None:
        if min(self.layers, self.width, self.heads, self.vocab, self.seq) < 1:
            raise ValueError(f"every GPTConfig field must be >= 1: {self}")

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab, context=self.seq, layers=self.layers, heads=self.heads,
                           width=self.width)


class TinyGPT(GPT):
    """`model(idx)` -> logits; `model(idx, targets)` -> the loss (what the benchmarks' loops expect)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.model_config())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        logits, loss = super().forward(idx, targets)
        return logits if loss is None else loss
