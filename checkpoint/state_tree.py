"""A state dict as tensors plus a JSON tree, and back (the training side: torch).

`flatten` splits a state dict into the `tree` of its `ShardManifest` (checkpoint.manifest: the structure as
JSON, each tensor replaced by {"__sdcw_tensor__": index}, each tuple by {"__sdcw_tuple__": [...]}) and the
list of its tensors; `unflatten` rebuilds it from the tree and the restored tensors. `DTYPES` maps the
manifest's dtype names (checkpoint.manifest.DTYPE_SIZES) to torch dtypes.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from checkpoint.errors import InvalidInputError
from checkpoint.manifest import DTYPE_SIZES, ITEMS_MARK, TENSOR_MARK, TUPLE_MARK

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidInputError(f"unsupported tensor dtype {dtype}; supported: {sorted(DTYPES)}") from None


def flatten(state_dict: Mapping[str, Any]) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Split `state_dict` into (JSON tree with tensor references, [(path, tensor)]) or raise
    InvalidInputError naming the path of the first unsupported object."""
    if not isinstance(state_dict, Mapping):
        raise InvalidInputError(f"state dict must be a mapping, got {type(state_dict).__name__}")
    tensors: list[tuple[str, torch.Tensor]] = []
    seen: dict[int, int] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter):
                raise InvalidInputError(
                    f"{path}: tensor subclass {type(obj).__name__} is not supported here "
                    "(use checkpoint.dcp with torch.distributed.checkpoint for DTensor / sharded tensors)")
            if obj.layout != torch.strided or obj.is_quantized:
                raise InvalidInputError(f"{path}: only dense strided tensors are supported, got {obj.layout}")
            dtype_name(obj.dtype)
            if id(obj) in seen:  # the same tensor object twice (tied weights): stored once
                return {TENSOR_MARK: seen[id(obj)]}
            seen[id(obj)] = len(tensors)
            # The object itself, not a detached alias: caches keyed on it (the GPU fingerprint plan) then live
            # as long as the user's tensor, not one save; callers copy under torch.no_grad().
            tensors.append((path, obj))
            return {TENSOR_MARK: len(tensors) - 1}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, Mapping):
            if not all(isinstance(k, str) for k in obj):
                # optimizer state dicts key their state by int parameter id: keep the key types exactly
                items = []
                for k, v in obj.items():
                    if isinstance(k, bool) or not isinstance(k, (int, str)):
                        raise InvalidInputError(
                            f"{path}: dict key {k!r} is a {type(k).__name__}; keys must be str or int")
                    items.append([k, walk(v, f"{path}/{k}")])
                return {ITEMS_MARK: items}
            out = {}
            for k, v in obj.items():
                if k.startswith("__sdcw_"):
                    raise InvalidInputError(f"{path}: dict key {k!r} is reserved")
                out[k] = walk(v, f"{path}/{k}")
            return out
        if isinstance(obj, tuple):
            return {TUPLE_MARK: [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        raise InvalidInputError(
            f"{path}: unsupported object of type {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint "
            "holds tensors and JSON-safe values (dict with str keys, list, tuple, str, int, float, bool, None)")

    tree = walk(state_dict, "state_dict")
    # Tied tensors: a second reference reuses the index, so refs may repeat; keep one entry per index.
    return tree, tensors


def unflatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of `flatten`: rebuild the state dict from the tree and the restored tensors."""
    if isinstance(tree, dict):
        if set(tree) == {TENSOR_MARK}:
            return tensors[tree[TENSOR_MARK]]
        if set(tree) == {TUPLE_MARK}:
            return tuple(unflatten(v, tensors) for v in tree[TUPLE_MARK])
        if set(tree) == {ITEMS_MARK}:
            return {k: unflatten(v, tensors) for k, v in tree[ITEMS_MARK]}
        return {k: unflatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    return tree
