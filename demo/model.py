"""A compact GPT-style language model (pre-LN transformer, causal self-attention, tied embeddings).

Sized by `GPTConfig`; the demo trains a tiny byte-level one on the CPU, the benchmarks a GPT-2-small
one (12 layers, 768 wide, 12 heads, vocab 50257, 1024 context) on the GPU.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    context: int = 64
    layers: int = 2
    heads: int = 4
    width: int = 64
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")

    @classmethod
    def gpt2_small(cls) -> "GPTConfig":
        return cls(vocab_size=50257, context=1024, layers=12, heads=12, width=768)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(x)
        return x + self.mlp(self.ln2(x))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of the normalised `x`, projected (the residual branch)."""
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP of the normalised `h` (the residual branch; a routed one in bench.compute_faults' MoE)."""
        return self.out(F.gelu(self.fc(h)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("out.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = idx.shape
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the context {self.cfg.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss
