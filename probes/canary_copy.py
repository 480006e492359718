"""Data-movement canaries: the links that GEMMs never see, checked bit for bit.

- host -> device -> host: a known bit pattern (all zeros, all ones, 0x55/0xAA checkerboards, walking
  ones, seeded random bytes, in 4 KiB blocks) from pinned host memory to the GPU and back;
- peer to peer: the pattern placed on GPU i (and read back from it, so a bad upload is not blamed on the
  link), copied to GPU j, read back from j: every ordered pair, so a bad pair or link is named;
- all-reduce: small integers (exact in fp32) summed over NCCL (`torch.cuda.nccl.all_reduce`, one process,
  every local GPU) and compared with the known sum on every GPU.

Every copy call can return success while the bytes are wrong (an IOMMU/ACS setting or a driver bug); only
the comparison tells. The copies go through a `Copier` so fault injection wraps them.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from sdcwatch.canary import CheckResult, DeviceInfo, Status

log = logging.getLogger(__name__)

BLOCK = 4096
MAX_OFFSETS = 64


def bit_pattern(nbytes: int, seed: int = 0) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes`: 4 KiB blocks cycling 0x00, 0xFF, 0x55, 0xAA, walking ones, random
    (seeded). Built block-wise in place, the random blocks drawn 8 bytes at a time: the full suite's 512 MiB
    at memset speed rather than one generator call per byte."""
    if nbytes < 1:
        raise ValueError(f"pattern size must be >= 1 byte, got {nbytes}")
    out = torch.empty(nbytes, dtype=torch.uint8)
    walking = (torch.ones(BLOCK, dtype=torch.int64) << (torch.arange(BLOCK) % 8)).to(torch.uint8)
    full = nbytes // BLOCK
    rows = out[:full * BLOCK].view(full, BLOCK)
    for kind, value in _FIXED_BLOCKS.items():
        rows[kind::6] = value
    rows[4::6] = walking
    tail = out[full * BLOCK:]
    n_random = rows[5::6].numel() + (tail.numel() if full % 6 == 5 else 0)
    words = (n_random + 7) // 8
    gen = torch.Generator().manual_seed(seed)
    random = torch.randint(-2 ** 63, 2 ** 63 - 1, (max(words, 1),), generator=gen, dtype=torch.int64)
    random = random.view(torch.uint8)[:n_random]
    rows[5::6] = random[:rows[5::6].numel()].view(-1, BLOCK)
    if tail.numel():
        kind = full % 6
        if kind in _FIXED_BLOCKS:
            tail.fill_(_FIXED_BLOCKS[kind])
        elif kind == 4:
            tail.copy_(walking[:tail.numel()])
        else:
            tail.copy_(random[rows[5::6].numel():])
    return out


_FIXED_BLOCKS = {0: 0x00, 1: 0xFF, 2: 0x55, 3: 0xAA}   # block kind (index mod 6) -> its byte


@runtime_checkable
class Copier(Protocol):
    """How bytes move. `to_device` from (pinned) host memory, `to_host` back, `peer` GPU to GPU."""

    def to_device(self, host: torch.Tensor, dev: DeviceInfo) -> torch.Tensor: ...

    def to_host(self, t: torch.Tensor) -> torch.Tensor: ...

    def peer(self, t: torch.Tensor, src: DeviceInfo, dst: DeviceInfo) -> torch.Tensor: ...


class TorchCopier:
    """The real copies: `Tensor.to` (cudaMemcpyAsync; peer-to-peer when the driver allows it)."""

    def to_device(self, host: torch.Tensor, dev: DeviceInfo) -> torch.Tensor:
        return host.to(torch.device(dev.device), non_blocking=False)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    def peer(self, t: torch.Tensor, src: DeviceInfo, dst: DeviceInfo) -> torch.Tensor:
        out = t.to(torch.device(dst.device))
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        return out


def compare_bytes(expected: torch.Tensor, got: torch.Tensor) -> dict[str, Any] | None:
    """None when identical; else count, first offsets, the byte values and the flipped bits."""
    if got.numel() != expected.numel():
        return {"count": -1, "why": f"size {got.numel()} bytes, expected {expected.numel()}"}
    if torch.equal(got, expected):   # the usual case, at memory speed; the diff below only on a mismatch
        return None
    diff = got != expected
    n = int(diff.sum())
    offs = diff.nonzero().reshape(-1)[:MAX_OFFSETS].tolist()
    return {"count": n, "offsets": offs,
            "bytes": [{"offset": o, "expected": hex(int(expected[o])), "actual": hex(int(got[o])),
                       "xor": hex(int(expected[o]) ^ int(got[o]))} for o in offs[:16]],
            "blocks": sorted({o // BLOCK for o in offs})}


def _pinned(t: torch.Tensor) -> torch.Tensor:
    if torch.cuda.is_available():
        try:
            return t.pin_memory()
        except RuntimeError:
            return t
    return t


def check_h2d(dev: DeviceInfo, nbytes: int, copier: Copier | None = None, seed: int = 0) -> CheckResult:
    copier = copier or TorchCopier()
    t0 = time.perf_counter()
    name = f"h2d/{dev.label}"
    try:
        pattern = bit_pattern(nbytes, seed)
        back = copier.to_host(copier.to_device(_pinned(pattern), dev))
    except Exception as exc:
        return CheckResult("h2d", name, Status.UNKNOWN, (dev.label,), time.perf_counter() - t0,
                           why=f"{type(exc).__name__}: {exc}"[:500])
    dur = time.perf_counter() - t0
    bad = compare_bytes(pattern, back)
    details = {"bytes": nbytes, "seed": seed, "GB_per_s": 2 * nbytes / dur / 1e9 if dur > 0 else None}
    if bad is None:
        return CheckResult("h2d", name, Status.PASS, (dev.label,), dur, details=details)
    details["mismatch"] = bad
    return CheckResult("h2d", name, Status.FAIL, (dev.label,), dur,
                       why=f"host <-> {dev.label}: {bad['count']} bytes differ after the round trip", details=details)


def peer_access(src: DeviceInfo, dst: DeviceInfo) -> bool | None:
    if torch.device(src.device).type != "cuda" or torch.device(dst.device).type != "cuda":
        return None
    try:
        return bool(torch.cuda.can_device_access_peer(torch.device(src.device), torch.device(dst.device)))
    except Exception:
        return None


def check_p2p_pair(src: DeviceInfo, dst: DeviceInfo, nbytes: int, copier: Copier | None = None,
                   seed: int = 0) -> CheckResult:
    """src -> dst, with the copy on src read back first so an upload error is not blamed on the pair."""
    copier = copier or TorchCopier()
    name = f"p2p/{src.label}->{dst.label}"
    t0 = time.perf_counter()
    try:
        pattern = bit_pattern(nbytes, seed)
        on_src = copier.to_device(_pinned(pattern), src)
        src_bad = compare_bytes(pattern, copier.to_host(on_src))
        if src_bad is not None:
            return CheckResult("p2p", name, Status.UNKNOWN, (src.label, dst.label), time.perf_counter() - t0,
                               why=f"the pattern did not arrive intact on {src.label} (see its h2d check)",
                               details={"upload_mismatch": src_bad})
        t1 = time.perf_counter()
        on_dst = copier.peer(on_src, src, dst)
        copy_s = time.perf_counter() - t1
        back = copier.to_host(on_dst)
    except Exception as exc:
        return CheckResult("p2p", name, Status.UNKNOWN, (src.label, dst.label), time.perf_counter() - t0,
                           why=f"{type(exc).__name__}: {exc}"[:500])
    dur = time.perf_counter() - t0
    bad = compare_bytes(pattern, back)
    details: dict[str, Any] = {"bytes": nbytes, "seed": seed, "peer_access": peer_access(src, dst),
                               "GB_per_s": nbytes / copy_s / 1e9 if copy_s > 0 else None}
    if bad is None:
        return CheckResult("p2p", name, Status.PASS, (src.label, dst.label), dur, details=details)
    details["mismatch"] = bad
    return CheckResult("p2p", name, Status.FAIL, (src.label, dst.label), dur,
                       why=f"copy {src.label} -> {dst.label}: {bad['count']} bytes differ (the pair's link "
                       f"or peer mapping; peer access {details['peer_access']})", details=details)


def check_p2p_all(devices: Sequence[DeviceInfo], nbytes: int, copier: Copier | None = None,
                  seed: int = 0) -> list[CheckResult]:
    return [check_p2p_pair(s, d, nbytes, copier, seed + i)
            for i, (s, d) in enumerate(itertools.permutations(devices, 2))]


def blame_pairs(results: Sequence[CheckResult]) -> dict[str, Any]:
    """From failed pair checks: the pairs, and a device on every failed pair (likely its link)."""
    failed = [r.devices for r in results if r.check == "p2p" and r.status is Status.FAIL]
    if not failed:
        return {}
    common = set(failed[0])
    for pair in failed[1:]:
        common &= set(pair)
    return {"pairs": [list(p) for p in failed], "common_device": sorted(common)}


# ----------------------------------------------------------------------------- all-reduce


AllReduce = Callable[[list[torch.Tensor]], None]


def nccl_all_reduce(tensors: list[torch.Tensor]) -> None:
    """In-place sum over one tensor per local GPU (torch.cuda.nccl, single process)."""
    import torch.cuda.nccl as nccl

    if not nccl.is_available(tensors):
        raise RuntimeError("NCCL cannot run on these tensors (needs one CUDA tensor per distinct GPU)")
    nccl.all_reduce(tensors)
    for t in tensors:
        torch.cuda.synchronize(t.device)


def allreduce_inputs(n: int, rank: int) -> torch.Tensor:
    """Small integers (|x| <= 8) in fp32: any sum over <= 2**20 ranks is exact."""
    i = torch.arange(n, dtype=torch.int64)
    return (((i * 7 + rank * 13 + (i >> 4) * 3) % 17) - 8).to(torch.float32)


def check_allreduce(devices: Sequence[DeviceInfo], n: int = 1 << 20,
                    allreduce: AllReduce | None = None) -> CheckResult:
    labels = tuple(d.label for d in devices)
    t0 = time.perf_counter()
    if len(devices) < 2:
        return CheckResult("allreduce", "allreduce", Status.UNKNOWN, labels, 0.0,
                           why="needs at least two GPUs")
    if allreduce is None:
        if any(torch.device(d.device).type != "cuda" for d in devices):
            return CheckResult("allreduce", "allreduce", Status.UNKNOWN, labels, 0.0,
                               why="NCCL all-reduce needs CUDA GPUs")
        allreduce = nccl_all_reduce
    expected = sum((allreduce_inputs(n, r) for r in range(len(devices))), torch.zeros(n))
    try:
        bufs = [allreduce_inputs(n, r).to(torch.device(d.device)) for r, d in enumerate(devices)]
        allreduce(bufs)
        outs = [b.to("cpu") for b in bufs]
    except Exception as exc:
        return CheckResult("allreduce", "allreduce", Status.UNKNOWN, labels, time.perf_counter() - t0,
                           why=f"{type(exc).__name__}: {exc}"[:500])
    dur = time.perf_counter() - t0
    exp_bytes = expected.view(torch.uint8)
    bad = {d.label: m for d, o in zip(devices, outs)
           if (m := compare_bytes(exp_bytes, o.contiguous().view(torch.uint8))) is not None}
    details: dict[str, Any] = {"elements": n, "ranks": len(devices)}
    if not bad:
        return CheckResult("allreduce", "allreduce", Status.PASS, labels, dur, details=details)
    details["mismatch"] = bad
    who = sorted(bad)
    why = (f"all-reduce result wrong on {', '.join(who)}" if len(who) < len(devices)
           else "all-reduce result wrong on every GPU (the collective or a link it crossed)")
    return CheckResult("allreduce", "allreduce", Status.FAIL, tuple(who), dur, why=why, details=details)


@dataclasses.dataclass(frozen=True, slots=True)
class CopySizes:
    h2d_bytes: int
    p2p_bytes: int
    allreduce_elems: int


COPY_SIZES = {"tiny": CopySizes(1 << 16, 1 << 16, 1 << 12), "quick": CopySizes(64 << 20, 64 << 20, 1 << 22),
              "full": CopySizes(512 << 20, 256 << 20, 1 << 26)}
