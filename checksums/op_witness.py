"""The op witness: which of two GPUs computes wrong, decided at the one op where they first part.

Two ranks, a persistent fault each GPU repeats, and the model-level CPU witness (`Replayer.witness`: the
whole gradient recomputed in float64 and projected between the GPUs') named nobody. Two ways that happens:
the GPUs' float32 recomputations agree, because the fault lives only in the low-precision path (a tensor
core's: bf16/fp16 matmuls, never the float32 ones), or the projection sits between the two (a small fault
in bf16, where everything after it re-rounds). Then both ranks replay that batch as the step computes,
under `OpTrace`, a dispatch mode that fingerprints what every op reads and its outputs on the device (no
host copy); deterministic kernels on one GPU model give the same bits for the same inputs, so the first op
whose output differs between the GPUs while its inputs are bit for bit equal is where one of them computed
wrong. That op
alone is run again on the host CPU in float64 from those inputs and projected as the model-level witness
projects (`witness_projection`: t near 0 when GPU 0's output is the float64 one, near 1 when GPU 1's is): one
op's rounding is at most about half a unit in the last place of its output, so a fault of a few units is
plain, where a whole bf16 model's rounding pattern is as large as a small fault's effect.

Used only where bit-for-bit determinism holds (exact replays, one GPU model, CUDA and torch on both ranks):
elsewhere the first differing op is rounding, not a fault. The trace fingerprints each op's inputs too (what
it reads, before it runs): the op wanted is the first whose inputs are equal on both ranks and whose outputs
are not. Ops whose inputs differ are passed over, so ops that are meant to differ between ranks do not end
the search: under FSDP2 (`checksums.fsdp_replay`) each rank copies its own shard into the all-gather buffer;
collectives themselves are not fingerprinted (their output is written asynchronously). Integer and boolean
outputs are fingerprinted too (a top-k's indices, a comparison's mask), except the fused attention ops' (their
RNG seed and offset may come back unwritten), and decided exactly: the CPU's result equals one GPU's where the
two part and never the other's. No answer (NaN, and why) when the two GPUs do not run the same op sequence,
when no op computes differently from equal inputs, or when the CPU has no float64 kernel for the op (the
GPU-only fused attention ops are recomputed by their definition: `_attention_reference`; with dropout, no
answer: its mask is the GPU's random draw).

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from checksums.fingerprint import DTENSOR
from checksums.rank_transit import portable, restored
from checksums.replay_modes import eager

# ops whose output is memory not yet written: its bits are whatever was there (never compared)
_UNWRITTEN = ("aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
              "aten.empty_permuted", "aten.resize_", "aten.set_")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# collectives (c10d's ops, the functional collectives, DTensor's): neither inputs nor outputs fingerprinted (an
# asynchronous collective writes its output after the op returns; its buffers hold other ranks' data)
_COLLECTIVE = ("c10d.", "_c10d_functional.", "c10d_functional.", "_dtensor.")
# a fused attention op's RNG arguments: unwritten when it draws no dropout (its forward returns them empty)
_RNG_ARGS = frozenset({"philox_seed", "philox_offset", "rng_state", "unused"})


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def _is_plain(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and _plain_type(type(x))


def _plain_type(t: type) -> bool:
    """A tensor type with no dispatch of its own (torch.Tensor, nn.Parameter; not a DTensor)."""
    return getattr(t, "__torch_dispatch__", None) is torch._C._disabled_torch_dispatch_impl


def redispatched(types: Any) -> bool:
    """An op whose tensor types include a subclass that runs it as plain ops on its local tensors (DTensor, a
    functional collective's AsyncCollectiveTensor): `OpTrace` returns NotImplemented for it, so the plain
    ops are traced (bench.compute_faults' fault injection does the same, so the fault is in the GPU's op)."""
    return any(issubclass(t, _redispatched()) for t in types)


@functools.cache
def _redispatched() -> tuple[type, ...]:
    """The tensor subclasses whose ops `OpTrace` leaves to their own dispatch, tracing the plain ops they run
    instead: DTensor, and the functional collectives' AsyncCollectiveTensor (it waits, then runs the op on
    the plain result). Not fake or functional tensors: their dispatch defers to an active mode."""
    out: list[type] = [DTENSOR] if DTENSOR is not None else []
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        out.append(AsyncCollectiveTensor)
    except ImportError:                    # (a build without torch.distributed)
        pass
    return tuple(out)


def _plain(obj: Any) -> list[torch.Tensor]:
    """`obj`'s tensors that are no tensor subclass with a dispatch of its own (a DTensor: fingerprinting one
    would run its collectives; `OpTrace` traces the ops it runs on its local tensors instead)."""
    return [x for x in tree_flatten(obj)[0] if _is_plain(x)]


def _named(func: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    """An op's arguments by their schema's names."""
    named = dict(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    return named


def reads(func: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """An op's (args, kwargs) without what it does not read: its `out=` arguments (it writes them: memory not
    yet written, whatever bits were there) and a fused attention op's RNG seed and offset when it draws no
    dropout (its forward returned them unwritten). Pure."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return args, kwargs
    skip = {a.name for a in schema.arguments if a.is_out}
    if "attention" in str(func) and not float(_named(func, args, kwargs).get("dropout_p") or 0.0):
        skip |= _RNG_ARGS
    if not skip:
        return args, kwargs
    names = [a.name for a in schema.arguments]
    return (tuple(None if i < len(names) and names[i] in skip else x for i, x in enumerate(args)),
            {k: v for k, v in kwargs.items() if k not in skip})


def _consts(obj: Any) -> int:
    """A host digest of `obj`'s arguments that are no tensor (sizes, a dim, a rank number, a dtype; a device
    by its type), in their places: an op given other numbers on the two ranks reads different inputs.
    Deterministic across processes (crc32 of their repr). Pure."""
    return _consts_of(*tree_flatten(obj))


def _consts_of(leaves: list[Any], spec: Any) -> int:
    return zlib.crc32(repr((spec, [None if isinstance(x, torch.Tensor) else _rank_free(x) for x in leaves]))
                      .encode())


def _rank_free(x: Any) -> Any:
    """A non-tensor argument as both ranks' ops compare it: a device by its type (rank 0 computes on cuda:0,
    rank 1 on cuda:1, the same op)."""
    return x.type if isinstance(x, torch.device) else x


def _compared(name: str, out: Any) -> list[torch.Tensor]:
    """An op's outputs the trace fingerprints: every plain tensor, but not a fused attention op's integer
    ones (its RNG seed and offset come back unwritten when it draws no dropout)."""
    attention = "attention" in name
    return [x for x in _plain(out) if not attention or x.is_floating_point() or x.is_complex()]


def witness_projection(ref: torch.Tensor, g0: torch.Tensor, g1: torch.Tensor) -> float:
    """The CPU witness's t = <ref - g0, g1 - g0> / |g1 - g0|^2 (float64 host tensors): 0 when GPU 0's
    gradient is the reference, 1 when GPU 1's is; NaN when they are equal. Pure."""
    d = g1 - g0
    dd = float(d.dot(d))
    return float((ref - g0).dot(d)) / dd if dd > 0 else float("nan")


def op_print(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """An int64 0-dim tensor, on the tensors' device, that changes when any bit of any of them changes
    (`_position_sum` of each tensor's bits read as integers, combined in order; read where it lies: a strided
    view is not copied; no host synchronisation). None for no tensor data (an op returning none, or only
    empty, meta, sparse or nested tensors). Not checksums.fingerprint's spec'd fingerprint: on CUDA that
    builds a Triton plan per tensor list, kept in the 16-entry cache the replica vote's plans live in, and its
    torch path runs about ten ops and three int64 copies a tensor; a trace fingerprints thousands of ops'
    outputs once each."""
    acc: torch.Tensor | None = None
    for t in tensors:
        if t.layout != torch.strided or t.is_nested or t.device.type == "meta" or t.numel() == 0:
            continue                  # (a sparse or nested tensor: not fingerprinted; `digest` compares it)
        s = _position_sum(_bits_view(t.detach()))
        acc = s if acc is None else acc.to(s.device) * 1_000_003 + s
    return acc


_WIDE_1D = 1 << 16       # a longer 1-D tensor is read as rows of this many (its int64 marginal stays small)
_DIM_WEIGHTS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)


def _position_sum(bits: torch.Tensor) -> torch.Tensor:
    """The sum of an integer tensor plus, for each dim, its marginal sums weighted by their index: values
    moved between positions change it (a plain sum does not: two chunks of an all-reduced gradient whose
    differences cancel left a split's inputs "equal" and its outputs not). One int64 reduction a dim (no
    int64 copy of the tensor), all modulo 2**64."""
    if bits.dim() == 1 and bits.numel() > _WIDE_1D:
        n, (st,) = bits.numel(), bits.stride()
        rows = n // _WIDE_1D
        body = bits.as_strided((rows, _WIDE_1D), (_WIDE_1D * st, st))
        tail = bits[rows * _WIDE_1D:]
        return _position_sum(body) + (_position_sum(tail) * 31 if tail.numel() else 0)
    total = bits.sum(dtype=torch.int64)
    for d in range(bits.dim()):
        if bits.shape[d] < 2:
            continue
        others = [o for o in range(bits.dim()) if o != d]
        marginal = bits.sum(dim=others, dtype=torch.int64) if others else bits.to(torch.int64)
        index = torch.arange(1, bits.shape[d] + 1, dtype=torch.int64, device=bits.device)
        total = total + (marginal * index).sum() * _DIM_WEIGHTS[d % len(_DIM_WEIGHTS)]
    return total


def _host(obj: Any) -> Any:
    """`obj` with every tensor copied to the host (a clone: an in-place op changes its argument after)."""
    return tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, obj)


class OpTrace(TorchDispatchMode):
    """Names every op run under it, the autograd engine's backward ops included, and fingerprints
    (`op_print`, on the device) what it reads, before it runs (`reads`), and its outputs (`_compared`); with
    `capture=i` also keeps op i's function, its arguments as they were before it ran and its outputs, on the
    host (`captured`)."""

    def __init__(self, capture: int = -1) -> None:
        super().__init__()
        self.names: list[str] = []
        self.ins: list[torch.Tensor | None] = []
        self.consts: list[int] = []                  # `_consts` of what each op reads (host)
        self.outs: list[torch.Tensor | None] = []
        self.capture = capture
        self.captured: tuple[Any, Any, Any, Any] | None = None     # (func, args, kwargs, outputs), host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if any(not _plain_type(t) for t in types):
            if redispatched(types):
                # a DTensor's op (a tensor-parallel layer's), or one reading a functional collective's
                # result: the subclass's own dispatch runs it with this trace still on, so the ops it runs
                # on its local tensors (the GPU's own compute) are traced
                return NotImplemented
            # another subclass's (DTensor's sharding propagation on fake tensors, on a cache miss): not the
            # step's compute, run untraced
            return func(*args, **kwargs)
        i = len(self.names)
        name = str(func)
        self.names.append(name)
        local = not name.startswith(_COLLECTIVE)
        leaves, spec = tree_flatten(reads(func, args, kwargs)) if local else ([], None)
        self.ins.append(op_print([x for x in leaves if _is_plain(x)]) if local else None)
        self.consts.append(_consts_of(leaves, spec) if local else 0)
        before = _host((args, kwargs)) if i == self.capture else None
        out = func(*args, **kwargs)
        if before is not None:
            self.captured = (func, before[0], before[1], _host(out))
        unwritten = name.rsplit(".", 1)[0] in _UNWRITTEN
        self.outs.append(op_print(_compared(name, out)) if local and not unwritten else None)
        return out

    def host_prints(self) -> list[tuple[tuple[int, int], int]]:
        """Each op's ((inputs, their non-tensor arguments), outputs) fingerprints as host ints (one transfer
        after the device finished every stream's work; 0 for none)."""
        if not self.names:
            return []
        every = [p for p in self.ins + self.outs if p is not None]
        dev = next((p.device for p in every if p.device.type != "cpu"), torch.device("cpu"))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)       # prints made on FSDP's all-gather and reduce-scatter streams too
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        flat = torch.stack([zero if p is None else p.to(dev) for p in self.ins + self.outs]).cpu().tolist()
        n = len(self.names)
        return list(zip(zip(flat[:n], self.consts), flat[n:]))


def first_divergence(a: tuple[list[str], list[tuple[Any, int]]],
                     b: tuple[list[str], list[tuple[Any, int]]]) -> tuple[int | None, str]:
    """The index of the first op whose inputs are equal in two traces (names, (inputs, outputs)
    fingerprints) and whose outputs are not, or None and why not (the op sequences part: the GPUs did not
    run the same ops; no op computes differently from equal inputs). Ops whose inputs differ are passed over
    (an FSDP2 rank's own shard). Pure."""
    (na, pa), (nb, pb) = a, b
    other = 0                  # ops whose outputs differ after inputs that differ
    for i, (x, y) in enumerate(zip(na, nb)):
        if x != y:
            return None, f"the GPUs' op sequences part at op {i} ({x} vs {y})"
        (ia, oa), (ib, ob) = pa[i], pb[i]
        if oa != ob:
            if ia == ib:
                return i, ""
            other += 1
    if len(na) != len(nb):
        return None, f"the GPUs ran {len(na)} and {len(nb)} ops"
    if other:
        return None, (f"no op of {len(na)} computes differently from equal inputs ({other} differ after inputs "
                      "that already differ: a change no op made)")
    return None, f"all {len(na)} ops agree bit for bit"


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and _differing(x, y) == 0


def _differing(x: torch.Tensor, y: torch.Tensor) -> int:
    """Elements whose bits differ between two tensors of one dtype and shape."""
    return int((_bits_view(x) != _bits_view(y)).sum())


def _bits_view(t: torch.Tensor) -> torch.Tensor:
    """t's raw bits as integers of its element size, its shape kept (complex: a last dimension of 2)."""
    t = t.resolve_conj().resolve_neg()       # (a conjugate or negative view: its values, not its storage)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t


def _flat_bits(t: torch.Tensor) -> torch.Tensor:
    return _bits_view(t.contiguous()).reshape(-1)


def digest(obj: Any) -> str:
    """A digest of `obj`'s structure, values (a device by its type) and tensors' raw bits (host tensors;
    blake2b), so two ranks compare an op's inputs without sending them. Pure."""
    h = hashlib.blake2b(digest_size=16)
    leaves, spec = tree_flatten(obj)
    h.update(repr(spec).encode())
    for x in leaves:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            h.update(f"{x.dtype}{tuple(x.shape)}{x.layout}".encode())
            h.update(_flat_bits(x.to_dense() if x.layout != torch.strided else x).numpy().tobytes())
        else:
            h.update(repr(_rank_free(x)).encode())
    return h.hexdigest()


def cpu_reference(func: Callable[..., Any], args: Any, kwargs: Any, wide: bool = True) -> Any:
    """Op `func` run on the host CPU with its floating-point tensor arguments in float64 (`wide`; else in
    their own dtypes; a `device=` argument moved to the CPU); the GPU-only fused attention ops (flash,
    memory-efficient, cuDNN; forward and backward) by their definition instead (`_attention_reference`:
    their leading outputs only). Raises what the op raises (no CPU kernel, no float64 kernel)."""
    def widen(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(torch.float64) if x.is_floating_point() and wide else x
        return torch.device("cpu") if isinstance(x, torch.device) else x
    args, kwargs = tree_map(widen, args), tree_map(widen, kwargs)
    if str(func).rsplit(".", 1)[0] in _ATTENTION:
        return _attention_reference(func, args, kwargs)
    with torch.no_grad():
        return func(*args, **kwargs)


# the fused attention ops scaled_dot_product_attention dispatches to on a GPU: no CPU kernel; the number of
# outputs the reference gives (forward: the attention's output; backward: the query's, key's and value's
# gradients)
_ATTENTION = {"aten._scaled_dot_product_flash_attention": 1, "aten._scaled_dot_product_efficient_attention": 1,
              "aten._scaled_dot_product_cudnn_attention": 1,
              "aten._scaled_dot_product_flash_attention_backward": 3,
              "aten._scaled_dot_product_efficient_attention_backward": 3,
              "aten._scaled_dot_product_cudnn_attention_backward": 3}


def _attention_reference(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """A fused attention op's leading outputs by its definition, softmax(q k^T * scale + bias, causal
    mask) v on [batch, heads, length, dim] float64 tensors (autograd for a backward's gradients). Raises
    ValueError where the op draws dropout (its random mask cannot be recomputed here)."""
    named = _named(func, args, kwargs)
    if float(named.get("dropout_p") or 0.0) > 0.0:
        raise ValueError("attention with dropout: its random mask is the GPU's")
    bias = named.get("attn_bias")
    scale = named.get("scale")
    scale = scale if scale is not None else 1.0 / math.sqrt(named["query"].shape[-1])

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[-3] != q.shape[-3]:              # grouped-query attention: key/value heads shared
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        s = (q @ k.transpose(-2, -1)) * scale
        if named.get("is_causal"):
            keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril()
            s = s.masked_fill(~keep, float("-inf"))
        if isinstance(bias, torch.Tensor):
            s = s + bias.to(s.dtype)
        return torch.softmax(s, dim=-1) @ v
    qkv = [named["query"], named["key"], named["value"]]
    if _ATTENTION[str(func).rsplit(".", 1)[0]] == 1:
        with torch.no_grad():
            return [attend(*qkv)]
    grad_out = named.get("grad_out", named.get("grad_out_"))
    leaves = [x.detach().requires_grad_(True) for x in qkv]
    with torch.enable_grad():
        return list(torch.autograd.grad(attend(*leaves), leaves, grad_out))


@dataclasses.dataclass(frozen=True, slots=True)
class OpEvidence:
    """What one op's float64 recomputation says about two GPUs' outputs that differ."""
    t: float                       # `witness_projection` over the differing outputs (NaN: none to project)
    differ: int                    # elements that differ between the GPUs
    ulps: tuple[float, float]      # each GPU's largest distance from float64 there, in its output's ulps
    #                                (at the element or at the output's root mean square, the larger: `_ulps`);
    #                                for integer outputs (`exact`) how many of those elements are not the CPU's
    exact: bool = False            # integer or boolean outputs: compared for equality

    def fault(self) -> bool:
        """One GPU's output is a fault's distance from float64 (OP_FAULT_ULPS units in the last place or
        more) and the other's a rounding's (within a unit, or a quarter of the first), on the side t says:
        two GPUs differing by rounding alone (a kernel choosing another summation order) both sit within
        about a unit, and then a t near 0 or 1 is chance (one element), never a verdict. Integer outputs:
        one GPU's equal to the CPU's everywhere the two part, the other's nowhere. Pure."""
        lo, hi = sorted(self.ulps)
        if self.exact:
            return not math.isnan(self.t) and lo == 0 < hi and (self.ulps[1] > self.ulps[0]) == (self.t < 0.5)
        if math.isnan(self.t) or hi < OP_FAULT_ULPS or lo > max(1.0, hi / 4):
            return False
        return (self.ulps[1] > self.ulps[0]) == (self.t < 0.5)

    def describe(self, ref: str) -> str:
        """Each GPU's distance from the CPU's result (`ref`: how to call it), in words."""
        if self.exact:
            return (f"GPU 0's output differs from {ref} in {self.ulps[0]:.0f} and GPU 1's in "
                    f"{self.ulps[1]:.0f} of the {self.differ} elements where they part")
        return f"GPU 0 {self.ulps[0]:.1f} and GPU 1 {self.ulps[1]:.1f} units in the last place from {ref}"


def exact_projection(ref: list[torch.Tensor], out0: list[torch.Tensor], out1: list[torch.Tensor]) -> OpEvidence:
    """The evidence of integer and boolean outputs the GPUs disagree on: t 0 when the CPU's result equals
    GPU 0's at every element where the GPUs part, 1 when it equals GPU 1's, NaN when neither (a tie broken
    another way: no answer); differ 0 when no such output differs. Pure."""
    miss, differ = [0, 0], 0
    for a, b, c in zip(ref, out0, out1):
        if b.is_floating_point() or b.is_complex() or not a.shape == b.shape == c.shape or b.dtype != c.dtype:
            continue
        d = b != c
        n = int(d.sum())
        if not n:
            continue
        differ += n
        want = a.to(b.dtype)[d]
        miss[0] += int((want != b[d]).sum())
        miss[1] += int((want != c[d]).sum())
    t = 0.0 if miss[0] == 0 < miss[1] else 1.0 if miss[1] == 0 < miss[0] else float("nan")
    return OpEvidence(t if differ else float("nan"), differ, (float(miss[0]), float(miss[1])), exact=True)


OP_FAULT_ULPS = 2.0
CPU_RESULT = "the CPU's result"


def _ulps(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, rms: float) -> torch.Tensor:
    """|x - ref| in units in the last place of `dtype`, at ref or at the output's root mean square `rms`,
    whichever unit is larger (float64 tensors): an element that cancels to near 0 carries the summation's
    error of its large terms, many of its own units, a few of the output's at most."""
    fi = torch.finfo(dtype)
    mag = torch.maximum(ref.abs(), torch.full_like(ref, rms)).clamp_min(fi.tiny)
    return (x - ref).abs() / (torch.exp2(torch.floor(torch.log2(mag))) * fi.eps)


def op_projection(ref: Any, out0: Any, out1: Any) -> OpEvidence:
    """The witness's evidence over the floating-point outputs the two GPUs disagree on: t
    (`witness_projection`: 0 when GPU 0's outputs are the float64 reference's, 1 when GPU 1's are), how
    many elements differ, and each GPU's distance from the reference there in units in the last place; when
    only integer or boolean outputs differ, `exact_projection`'s. t NaN when no output can be compared
    (differ 0: none differs at all) or the reference has another structure. Pure."""
    none = OpEvidence(float("nan"), 0, (0.0, 0.0))
    r, o0, o1 = (_tensors(x) for x in (ref, out0, out1))
    if len(o0) != len(o1) or not 0 < len(r) <= len(o0):
        return none
    o0, o1 = o0[:len(r)], o1[:len(r)]        # a reference of a fused op's leading outputs (`cpu_reference`)
    if all(_same_bits(b, c) for b, c in zip(o0, o1)):
        return none
    picked = [(a, b, c) for a, b, c in zip(r, o0, o1)
              if b.is_floating_point() and b.shape == c.shape == a.shape and not _same_bits(b, c)]
    if not picked:                  # only integer or boolean outputs differ (or ones of another shape)
        ev = exact_projection(r, o0, o1)
        return ev if ev.differ else OpEvidence(float("nan"), 1, (0.0, 0.0))
    refs, g0s, g1s, ulps = [], [], [], [0.0, 0.0]
    for a, b, c in picked:
        ra, rb, rc = (x.reshape(-1).to(torch.float64) for x in (a, b, c))
        keep = (rb != rc) & torch.isfinite(ra) & torch.isfinite(rb) & torch.isfinite(rc)
        refs.append(ra[keep])
        g0s.append(rb[keep])
        g1s.append(rc[keep])
        finite = ra[torch.isfinite(ra)]
        rms = float(finite.square().mean().sqrt()) if finite.numel() else 0.0
        for k, g in enumerate((rb, rc)):
            if bool(keep.any()):
                ulps[k] = max(ulps[k], float(_ulps(g[keep], ra[keep], b.dtype, rms).max()))
    differ = sum(_differing(b, c) for _, b, c in picked)
    ref_f, g0, g1 = torch.cat(refs), torch.cat(g0s), torch.cat(g1s)
    if ref_f.numel() == 0:          # only non-finite elements differ: an overflow, nothing to project
        return OpEvidence(float("nan"), differ, (0.0, 0.0))
    return OpEvidence(witness_projection(ref_f, g0, g1), differ, (ulps[0], ulps[1]))


ROWS = 64       # the op witness recomputes at most this many output rows of a matmul on the CPU


def row_subset(func: Any, args: Any, kwargs: Any, out0: Any, out1: Any,
               limit: int = ROWS) -> tuple[Any, Any, Any, Any]:
    """For a matmul (`aten.mm`, `addmm`, `bmm`): the arguments and both GPUs' outputs cut to at most `limit`
    of the output rows (bmm: batches) where the GPUs differ, spread evenly over them; a row of a matmul's
    output depends on that row of its left operand only, so the CPU recomputes those rows alone (a large
    model's matmul in float64 on the CPU took minutes; the GPUs' other ranks wait in a collective). Other
    ops: as given. Pure."""
    name = str(func)
    if not isinstance(out0, torch.Tensor) or not isinstance(out1, torch.Tensor) or out0.shape != out1.shape \
            or not out0.is_floating_point():
        return args, kwargs, out0, out1
    if name == "aten.mm.default" or name == "aten.addmm.default":
        left = 0 if name == "aten.mm.default" else 1
        dims = (1,)
    elif name == "aten.bmm.default":
        left, dims = 0, (1, 2)
    else:
        return args, kwargs, out0, out1
    differ = (_bits_view(out0) != _bits_view(out1)).any(dim=dims) if out0.dim() > 1 else None
    if differ is None:
        return args, kwargs, out0, out1
    rows = differ.nonzero().reshape(-1)
    if rows.numel() > limit:
        rows = rows[torch.linspace(0, rows.numel() - 1, limit).long()]
    a = list(args)
    a[left] = a[left][rows]
    if name == "aten.addmm.default" and isinstance(a[0], torch.Tensor) and a[0].dim() == 2 \
            and a[0].shape[0] == out0.shape[0]:
        a[0] = a[0][rows]                    # a bias given per row (else broadcast over the rows)
    if name == "aten.bmm.default":
        a[1] = a[1][rows]
    return tuple(a), kwargs, out0[rows], out1[rows]


def exchange(obj: Any, group: Any, device: torch.device) -> list[Any]:
    """Every rank's `obj`, in rank order (a collective: one `broadcast_object_list` from each rank, on
    `device` for NCCL, as the replay's other object broadcasts; `rank_transit.portable` in transit)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    out: list[Any] = []
    for src in range(world):
        box = [portable(obj) if src == rank else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, src) if group is not None else src,
                                   group=group, device=device if device.type == "cuda" else None)
        out.append(obj if src == rank else restored(box[0]))
    return out


def op_witness(replay: Callable[[], Any], group: Any, device: torch.device) -> tuple[float, str]:
    """Two ranks (a collective: both call, `replay` runs the witness's retained batch on each, as the step
    computes, through `Replayer.agreed`): t as `Replayer.witness` returns it, and what it rests on (or why
    there is none, with t NaN). Two replays: one tracing every op's fingerprint, one capturing the first op
    that differs; one op's inputs and outputs travel once. A compiled model replays eagerly (`eager`)."""
    out = [witness_between(replay, group, 0, 1, device, settle=False)]
    dist.broadcast_object_list(out, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group,
                               device=device if device.type == "cuda" else None)
    return out[0]


def witness_between(replay: Callable[[], Any], group: Any, first: int, second: int, device: torch.device,
                    settle: bool = True) -> tuple[float, str]:
    """The op witness's work between group ranks `first` and `second` (a collective of `group`: every rank
    replays, `replay` as in `op_witness`): the first op computing differently on the two from equal inputs,
    recomputed on the CPU; the decision (`decide`: t near 0 when `first`'s output is the float64 one) on rank
    `first`, (NaN, why) on every other rank. `settle` False: when no op differs, every rank returns at once
    (no second replay); True: every rank replays a second time whatever it found (a replay that is a
    collective of more ranks than `group`'s, where other groups may have found an op:
    checksums.lane_witness)."""
    trace = OpTrace()
    with eager(), trace:
        replay()
    traces = exchange((trace.names, trace.host_prints()), group, device)
    i, why = first_divergence(traces[first], traces[second])
    if i is None and not settle:
        return float("nan"), why
    cap = OpTrace(capture=-1 if i is None else i)
    with eager(), cap:
        replay()
    got = cap.captured if i is not None else None
    if got is not None and str(got[0]) != trace.names[i]:     # type: ignore[index]
        got = None                  # the second replay ran other ops (both traces named op i alike)
    # `first` keeps its own capture; `second` sends the digest of its inputs and its outputs (None when it has
    # none or cannot digest them: `first` then answers "not captured", never waits for more)
    me = dist.get_rank(group)
    sent = None
    if me == second and got is not None:
        try:
            sent = (digest(reads(*got[:3])), got[3])
        except Exception:  # noqa: BLE001 (`first` waits in the exchange: never raise before it)
            sent = None
    theirs = exchange(sent, group, device)
    if me != first or i is None:
        return float("nan"), why
    own = None if got is None else (got[1], got[2], got[3])
    strict = device.type != "cuda" or torch.are_deterministic_algorithms_enabled()
    try:
        return decide(i, len(trace.names), got[0] if got is not None else None, [own, theirs[second]],
                      exact_ints=strict)
    except Exception as exc:  # noqa: BLE001 (the others wait in the caller's collective: never raise)
        return float("nan"), f"op {i}: the decision failed ({type(exc).__name__}: {str(exc)[:200]})"


def decide(i: int, n_ops: int, func: Any, captured: list[Any], limit: int | None = ROWS,
           exact_ints: bool = True) -> tuple[float, str]:
    """Rank 0's answer from both ranks' captures of op i (rank 0's (args, kwargs, outputs), the other's
    (digest of its args and kwargs, outputs); host), the CPU recomputing at most `limit` rows of a matmul
    (`row_subset`; None: the whole op). Integer outputs (`exact_projection`) are decided only with
    `exact_ints` (on a GPU: under torch.use_deterministic_algorithms, where an integer op's result is
    fixed), only where the CPU's result in the op's own precision is the float64 one's, and never on a tie
    (`_tie`)."""
    if func is None or any(c is None for c in captured):
        return float("nan"), f"op {i} was not captured again (the second replay ran other ops)"
    (a0, k0, o0), (d1, o1) = captured
    where = f"{func} (op {i} of {n_ops}, the first to compute differently from equal inputs)"  # why none
    if digest(reads(func, a0, k0)) != d1:
        return float("nan"), f"{where}: its inputs already differ (a change no op made)"
    total = sum(_differing(x, y) for x, y in zip(_tensors(o0), _tensors(o1))
                if x.dtype == y.dtype and x.shape == y.shape)
    if limit is not None:
        a0, k0, o0, o1 = row_subset(func, a0, k0, o0, o1, limit)
    try:
        ref = cpu_reference(func, a0, k0)
    except Exception as exc:  # noqa: BLE001 (an op the CPU cannot run in float64: no witness, said)
        return float("nan"), f"{where}: the CPU cannot run it in float64 ({type(exc).__name__})"
    ev = op_projection(ref, o0, o1)
    if math.isnan(ev.t):
        if ev.exact:
            return ev.t, f"{where}: {ev.describe(CPU_RESULT)}: no side"
        return ev.t, (f"{where}: no output to compare" if ev.differ else
                      f"{where}: its outputs agree when replayed again (the fault did not repeat)")
    if not ev.fault():
        return float("nan"), f"{where}: {ev.describe('float64')} (t={ev.t:.3f}): rounding, or no clear side"
    if ev.exact:
        why = _integer_doubt(func, a0, k0, o0, o1, ev, exact_ints)
        if why:
            return float("nan"), f"{where}: {why}"
    return ev.t, (f"the CPU's float64 result of {func} (op {i} of the {n_ops} in the replay, the first to "
                  f"compute differently on the two GPUs from inputs equal on both, in {total} elements "
                  f"({ev.differ} recomputed); {ev.describe('it')})")


def _integer_doubt(func: Any, args: Any, kwargs: Any, out0: Any, out1: Any, ev: OpEvidence,
                   exact_ints: bool) -> str:
    """Why an integer output's verdict `ev` (float64 inputs) is not to be trusted, or "": nondeterministic
    algorithms allowed; the CPU's result in the op's own precision (a comparison with a number computed in
    bf16 on the GPU) not the same verdict; a selection op's two GPUs pointing at equal values (a tie, which
    either may break)."""
    if not exact_ints:
        return "integer outputs are decided only under torch.use_deterministic_algorithms(True)"
    try:
        own = op_projection(cpu_reference(func, args, kwargs, wide=False), out0, out1)
    except Exception as exc:  # noqa: BLE001 (no CPU kernel in that precision: no verdict)
        return f"the CPU cannot run it in its own precision ({type(exc).__name__})"
    if not own.exact or own.t != ev.t:
        return "the CPU's results in float64 and in the op's own precision disagree where the GPUs part"
    if _tie(func, args, kwargs, out0, out1):
        return "the GPUs' indices point at equal values (a tie either may break)"
    return ""


# ops selecting elements along a dim, whose last output is the chosen indices (dim None: the flattened input)
_SELECT = {"aten.topk": -1, "aten.sort": -1, "aten.kthvalue": -1, "aten.mode": -1, "aten.median": None,
           "aten.nanmedian": None, "aten.max": None, "aten.min": None, "aten.argmax": None, "aten.argmin": None,
           "aten.cummax": None, "aten.cummin": None}


def _tie(func: Any, args: Any, kwargs: Any, out0: Any, out1: Any) -> bool:
    """For a selection op (`_SELECT`): whether the two GPUs' indices, where they part, point at equal values
    of its input (a tie: no verdict); True too when that cannot be read (conservative). Other ops: False.
    Pure."""
    base = str(func).rsplit(".", 1)[0]
    if base not in _SELECT:
        return False
    try:
        named = _named(func, args, kwargs)
        x = named["self"]
        dim = named.get("dim", _SELECT[base])
        i0, i1 = (_tensors(o)[-1] for o in (out0, out1))
        if dim is None:
            v0, v1 = x.reshape(-1)[i0], x.reshape(-1)[i1]
        else:
            dim = dim % max(x.dim(), 1)
            if i0.dim() < x.dim():                      # keepdim=False: the reduced dim dropped
                i0, i1 = i0.unsqueeze(dim), i1.unsqueeze(dim)
            v0, v1 = x.gather(dim, i0), x.gather(dim, i1)
        part = i0 != i1
        return bool((_bits_view(v0)[part] == _bits_view(v1)[part]).any())
    except Exception:  # noqa: BLE001 (an argument layout not foreseen: no verdict)
        return True
