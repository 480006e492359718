"""Fault injection for the canaries, as wrappers around the real operations (never a path in the checks).

- `FaultyMatmul`: flips one bit of one output element, or of one input element before the GEMM runs;
- `FaultyDevice`: a `matmul_for` that gives one device (by label) a faulty matmul, the others the real one
  ("one GPU of three returns a different bit");
- `FaultyCopier`: flips bits of one byte in the copy to one device, or in one GPU pair's peer copy;
- `FaultyAllReduce`: corrupts one element of the all-reduce result on one device;
- `simulated_devices` / `cpu_all_reduce`: several labelled "devices" on the CPU for the vote and pair tests.

Used by the CPU tests and the GPU tests alike: on a GPU the real tensor cores compute, and the wrapper
corrupts their real output, so everything after the GEMM (fingerprint, compare, localise, evidence) is the
production path.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from checksums.canary_gemm import Matmul, default_matmul
from probes.canary_copy import AllReduce, Copier, TorchCopier
from sdcwatch.canary import DeviceInfo


def flip_bit(t: torch.Tensor, index: tuple[int, ...], bit: int) -> torch.Tensor:
    """A copy of `t` (same strides) with one bit of one element flipped."""
    width = 8 * t.element_size()
    if not 0 <= bit < width:
        raise ValueError(f"bit must be in [0, {width}), got {bit}")
    out = t.clone()
    v = out.view(_INT_VIEW[t.element_size()])       # same element size: same shape and strides
    mask = 1 << bit
    if bit == width - 1 and v.dtype != torch.uint8:
        mask -= 1 << width                  # the sign bit as a value of the signed integer view
    v[index] = v[index] ^ mask
    return out


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass
class FaultyMatmul:
    """Wraps a matmul: corrupts `where` ('output', 'input_a' or 'input_b') at `index` by flipping `bit`.

    `dtypes` limits it to some canary dtypes (None: all); `calls` counts how often it corrupted."""

    where: str = "output"
    index: tuple[int, int] = (0, 0)
    bit: int = 0
    inner: Matmul = default_matmul
    dtypes: tuple[str, ...] | None = None
    calls: int = 0

    def __post_init__(self) -> None:
        if self.where not in ("output", "input_a", "input_b"):
            raise ValueError(f"where must be output, input_a or input_b, got {self.where!r}")

    def __call__(self, a: torch.Tensor, b: torch.Tensor, spec: Any) -> torch.Tensor:
        if self.dtypes is not None and spec.dtype not in self.dtypes:
            return self.inner(a, b, spec)
        self.calls += 1
        bit = min(self.bit, 8 * a.element_size() - 1)
        if self.where == "input_a":
            return self.inner(flip_bit(a, self.index, bit), b, spec)
        if self.where == "input_b":
            return self.inner(a, flip_bit(b, self.index, min(self.bit, 8 * b.element_size() - 1)), spec)
        out = self.inner(a, b, spec)
        return flip_bit(out, self.index, min(self.bit, 8 * out.element_size() - 1))


@dataclasses.dataclass
class FaultyDevice:
    """`matmul_for` giving the device labelled `label` the faulty matmul."""

    label: str
    fault: Callable[..., torch.Tensor] = dataclasses.field(default_factory=FaultyMatmul)
    inner: Matmul = default_matmul

    def __call__(self, dev: DeviceInfo) -> Callable[..., torch.Tensor]:
        return self.fault if dev.label == self.label else self.inner


@dataclasses.dataclass
class FaultyCopier:
    """Corrupts one byte (xor `mask` at `offset`) of the copy to `h2d_device`, or of the peer copy
    `pair` = (src label, dst label)."""

    offset: int = 0
    mask: int = 0x10
    h2d_device: str | None = None
    pair: tuple[str, str] | None = None
    inner: Copier = dataclasses.field(default_factory=TorchCopier)

    def to_device(self, host: torch.Tensor, dev: DeviceInfo) -> torch.Tensor:
        out = self.inner.to_device(host, dev)
        return self._corrupt(out) if dev.label == self.h2d_device else out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return self.inner.to_host(t)

    def peer(self, t: torch.Tensor, src: DeviceInfo, dst: DeviceInfo) -> torch.Tensor:
        out = self.inner.peer(t, src, dst)
        return self._corrupt(out) if self.pair == (src.label, dst.label) else out

    def _corrupt(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        flat = t.view(-1).view(torch.uint8)
        flat[self.offset] = flat[self.offset] ^ self.mask
        return t


class SimCopier:
    """Copies between simulated CPU devices (clones, so each 'device' holds its own bytes)."""

    def to_device(self, host: torch.Tensor, dev: DeviceInfo) -> torch.Tensor:
        return host.to(torch.device(dev.device)).clone()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu").clone()

    def peer(self, t: torch.Tensor, src: DeviceInfo, dst: DeviceInfo) -> torch.Tensor:
        return t.to(torch.device(dst.device)).clone()


def cpu_all_reduce(tensors: list[torch.Tensor]) -> None:
    """The all-reduce on simulated devices: sum in rank order, written into every tensor."""
    total = torch.zeros_like(tensors[0].cpu())
    for t in tensors:
        total += t.cpu()
    for t in tensors:
        t.copy_(total)


@dataclasses.dataclass
class FaultyAllReduce:
    rank: int = 0
    offset: int = 0
    mask: int = 0x01
    inner: AllReduce = cpu_all_reduce

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        self.inner(tensors)
        t = tensors[self.rank]
        v = t.view(torch.int32)
        v[self.offset] = v[self.offset] ^ self.mask


def simulated_devices(n: int, device: str = "cpu", name: str = "sim") -> list[DeviceInfo]:
    """`n` labelled devices that all compute on `device` (default: the CPU)."""
    return [DeviceInfo(label=f"{name}-{i}", device=device, index=i, uuid=f"{name.upper()}-{i}", name=name)
            for i in range(n)]
