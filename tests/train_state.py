"""A whole training state (not a test module): model + AdamW after a few steps through DCP's
`get_state_dict`, an LR scheduler, a data loader's position with awkward plain values, torchtitan-style
BytesIO items; and a bit-exact comparison that knows NaN payloads, -0.0, ints vs floats, tuples vs lists."""
from __future__ import annotations

import io
import math
import struct
from typing import Any

import torch

NAN_PAYLOAD = struct.unpack(">d", bytes.fromhex("fff8000000000123"))[0]   # a negative NaN with a payload
W_ROWS = 6


def trained(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def loader_state(seed: int = 0) -> dict[str, Any]:
    return {"epoch": 2 + seed, "pos": 12345678901234567890123 + seed, "order": (3, 1, 2), "shuffle": True,
            "name": "shard-ü", "none": None, "inf": math.inf, "ninf": -math.inf, "nan": NAN_PAYLOAD,
            "neg0": -0.0, "tiny": 5e-324, "third": 1 / 3, "nested": [{"a": [1, 2.0]}, (None, "x")]}


def train_extras(seed: int = 0) -> dict[str, Any]:
    """torchtitan's TrainState keeps lists of losses as BytesIO of torch.save bytes; raw bytes too."""
    return {"global_avg_losses": io.BytesIO(b"losses\x00\xff" * (3 + seed)),
            "raw": b"\x00\x01\xfe" + bytes([seed]), "empty": b""}


def full_state(seed: int = 0) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = trained(seed)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict(), "loader": loader_state(seed),
            "train": train_extras(seed)}


def w_full() -> torch.Tensor:
    return torch.arange(W_ROWS * 5, dtype=torch.float32).reshape(W_ROWS, 5) / 7


def same(a: Any, b: Any, path: str = "") -> None:
    """Bit-for-bit equality: types exact (tuple is not list, int is not float, BytesIO is not bytes)."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), \
        f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}"
        raw = lambda t: t.detach().reshape(-1).view(torch.uint8)   # noqa: E731
        assert torch.equal(raw(a), raw(b)) if a.numel() and a.dtype != torch.bool else torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b), f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, io.BytesIO):
        assert a.getvalue() == b.getvalue(), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"
