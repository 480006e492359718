"""What ranks send each other through torch's object collectives (`broadcast_object_list`,
`all_gather_object`): a retained batch for a replay, the op witness's traces and captured outputs.

`map_tensors` rebuilds a batch with a function applied to every tensor, keeping the containers batches come
in. `portable` / `restored` carry the tensors those collectives cannot: torch pickles a tensor through its
legacy typed storage, and the unsigned dtypes wider than a byte have none, so a uint16/32/64 tensor pickles
on the sending rank and fails to unpickle on the receiving one only ("UntypedStorage has no attribute
'dtype'": a fused attention op's RNG seed and offset on a GPU, a batch of uint16 token ids). They travel as
their bits in the signed dtype of the same width, restored bit for bit on arrival.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


class Unsigned:
    """An unsigned tensor in transit: its dtype's name and its bits as the signed dtype of its width (not a
    dataclass: `map_tensors` must not look inside)."""

    __slots__ = ("dtype", "bits")

    def __init__(self, dtype: str, bits: torch.Tensor) -> None:
        self.dtype, self.bits = dtype, bits

    def __reduce__(self) -> tuple[Any, ...]:
        return (Unsigned, (self.dtype, self.bits))


def map_tensors(obj: Any, fn: Callable[[Any], Any], leaf: type | tuple[type, ...] = torch.Tensor) -> Any:
    """`obj` with `fn` applied to every `leaf` (a tensor) in it, the containers batches come in kept as they
    were: lists, tuples and named tuples, dicts and other mappings (a Hugging Face `BatchEncoding`, rebuilt
    from a dict, else a plain dict), dataclasses; anything else as is."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):             # a named tuple
        return type(obj)(*(map_tensors(o, fn, leaf) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn, leaf) for o in obj)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn, leaf) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            return type(obj)(items)
        except Exception:  # noqa: BLE001 (a mapping its type cannot rebuild from a dict: the dict)
            return items
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn, leaf)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _encode(t: torch.Tensor) -> Any:
    twin = SIGNED_TWIN.get(t.dtype)
    return t if twin is None else Unsigned(str(t.dtype).removeprefix("torch."), t.view(twin))


def portable(obj: Any) -> Any:
    """`obj` ready for an object collective: every unsigned tensor wider than a byte as `Unsigned`."""
    return map_tensors(obj, _encode)


def restored(obj: Any) -> Any:
    """`portable`'s inverse, on the receiving rank."""
    return map_tensors(obj, lambda u: u.bits.view(getattr(torch, u.dtype)), leaf=Unsigned)
