"""A state dict as tensors plus a JSON tree, and back (the training side: torch).

`flatten` splits a state dict into the `tree` of its `ShardManifest` (checkpoint.manifest: the structure as
JSON, each tensor replaced by {"__sdcw_tensor__": index}, each tuple by {"__sdcw_tuple__": [...]}, each
tensor-free part by {"__sdcw_value__": {"__sdcw_tensor__": index}, "kind": ...}) and the list of its
tensors, the values' bytes among them as uint8 tensors (checkpoint.plain_values: JSON for plain values, raw
for bytes and BytesIO);
`unflatten` rebuilds it from the tree and the restored tensors. `DTYPES` maps the manifest's dtype names
(checkpoint.manifest.DTYPE_SIZES) to torch dtypes.
"""
from __future__ import annotations

import itertools
import operator
from collections import OrderedDict
from collections import abc
from typing import Any, Mapping

import torch

from checkpoint.errors import InvalidInputError
from checkpoint.manifest import DTYPE_SIZES, ITEMS_MARK, KIND_KEY, TENSOR_MARK, TUPLE_MARK, VALUE_MARK
from checkpoint.plain_values import BYTES_MARK, BYTESIO_MARK, decode_item, encode_item, is_bytes_like

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidInputError(f"unsupported tensor dtype {dtype}; supported: {sorted(DTYPES)}") from None


def value_tensor(payload: bytes) -> torch.Tensor:
    """A value's bytes as a 1-D uint8 tensor (its own buffer)."""
    if not payload:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def flatten(state_dict: Mapping[str, Any], values: list[int] | None = None
            ) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Split `state_dict` into (JSON tree with tensor and value references, [(path, tensor)]) or raise
    InvalidInputError naming the path of the first unsupported object. Each bytes / BytesIO value, and each
    maximal part without tensors or bytes (a plain value, a dict or list of them), becomes one uint8 tensor
    of its encoded bytes (checkpoint.plain_values), at its path. `values`: if given, the indices of those
    value tensors (made here, new at every call) are appended to it."""
    if not isinstance(state_dict, Mapping):
        raise InvalidInputError(f"state dict must be a mapping, got {type(state_dict).__name__}")
    tensors: list[tuple[str, torch.Tensor]] = []
    seen: dict[int, int] = {}

    def value(obj: Any, path: str) -> dict[str, Any]:
        kind, payload = encode_item(obj, path)
        if values is not None:
            values.append(len(tensors))
        tensors.append((path, value_tensor(payload)))
        return {VALUE_MARK: {TENSOR_MARK: len(tensors) - 1}, KIND_KEY: kind}

    def child(path: str, k: Any, index: bool) -> str:
        return f"{path}[{k}]" if index else f"{path}/{k}"

    def children(items: Any, path: str, index: bool) -> list[tuple[Any, Any]] | None:
        """[(key, subtree)] with the tensor-free children stored as values, or None if none holds a tensor."""
        walked = []
        plain = True
        for k, v in items:   # scalars (most of a param group) are plain without a call; tensors (most of a
            tv = type(v)     # state dict) go straight to `tensor` (issue 21: the save's walk, per step)
            if tv in _SCALARS:
                walked.append((k, _PLAIN, v))
                continue
            w = (tensor(v, f"{path}[{k}]" if index else f"{path}/{k}") if tv in _TENSORS
                 else walk(v, child(path, k, index)))
            plain = plain and w is _PLAIN
            walked.append((k, w, v))
        if plain:
            return None
        return [(k, value(v, child(path, k, index)) if w is _PLAIN else w) for k, w, v in walked]

    def tensor(obj: torch.Tensor, path: str) -> dict[str, int]:
        if obj.layout != torch.strided or obj.is_quantized:
            raise InvalidInputError(f"{path}: only dense strided tensors are supported, got {obj.layout}")
        dtype_name(obj.dtype)
        i = seen.get(id(obj))
        if i is not None:  # the same tensor object twice (tied weights): stored once
            return {TENSOR_MARK: i}
        seen[id(obj)] = len(tensors)
        # The object itself, not a detached alias: caches keyed on it (the GPU fingerprint plan) then live
        # as long as the user's tensor, not one save; callers copy under torch.no_grad().
        tensors.append((path, obj))
        return {TENSOR_MARK: len(tensors) - 1}

    def walk(obj: Any, path: str) -> Any:
        """The subtree for `obj`, or _PLAIN when it holds no tensor (its parent stores it whole)."""
        if isinstance(obj, torch.Tensor):
            if type(obj) not in _TENSORS:
                raise InvalidInputError(
                    f"{path}: tensor subclass {type(obj).__name__} is not supported here "
                    "(use checkpoint.dcp with torch.distributed.checkpoint for DTensor / sharded tensors)")
            return tensor(obj, path)
        if is_bytes_like(obj):   # bytes / BytesIO: stored raw at their own path (never base64 inside JSON)
            return value(obj, path)
        if isinstance(obj, (dict, abc.Mapping)):
            if not all(type(k) is str or isinstance(k, str) for k in obj):
                # optimizer state dicts key their state by int parameter id: keep the key types exactly
                for k in obj:
                    if isinstance(k, bool) or not isinstance(k, (int, str)):
                        raise InvalidInputError(
                            f"{path}: dict key {k!r} is a {type(k).__name__}; keys must be str or int")
                kids = children(obj.items(), path, False)
                return _PLAIN if kids is None else {ITEMS_MARK: [[k, w] for k, w in kids]}
            for k in obj:
                if k.startswith("__sdcw_"):
                    raise InvalidInputError(f"{path}: dict key {k!r} is reserved")
            kids = children(obj.items(), path, False)
            return _PLAIN if kids is None else dict(kids)
        if isinstance(obj, (tuple, list)):
            kids = children(enumerate(obj), path, True)
            if kids is None:
                return _PLAIN
            return {TUPLE_MARK: [w for _, w in kids]} if isinstance(obj, tuple) else [w for _, w in kids]
        return _PLAIN   # a leaf: plain_values encodes it (or refuses it, naming the path) with its parent

    tree = walk(state_dict, "state_dict")
    if tree is _PLAIN:   # no tensor at all: the whole state is one value
        tree = value(state_dict, "state_dict")
    # Tied tensors: a second reference reuses the index, so refs may repeat; keep one entry per index.
    return tree, tensors


class _Plain:
    pass


_SCALARS = frozenset((type(None), bool, int, float, str))
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_PLAIN_DICTS = frozenset((dict, OrderedDict))

_PLAIN = _Plain()


def unflatten(tree: Any, tensors: list[torch.Tensor], host: list[torch.Tensor] | None = None) -> Any:
    """Inverse of `flatten`: rebuild the state dict from the tree and the restored tensors. Values are
    decoded from `host` (the host copies, when `tensors` were moved to a device) or from `tensors`."""
    src = tensors if host is None else host

    def walk(tree: Any) -> Any:
        if isinstance(tree, dict):
            if set(tree) == {TENSOR_MARK}:
                return tensors[tree[TENSOR_MARK]]
            if set(tree) == {VALUE_MARK, KIND_KEY}:
                t = src[tree[VALUE_MARK][TENSOR_MARK]]
                return decode_item(tree[KIND_KEY], t.cpu().numpy().tobytes() if t.numel() else b"")
            if set(tree) == {TUPLE_MARK}:
                return tuple(walk(v) for v in tree[TUPLE_MARK])
            if set(tree) == {ITEMS_MARK}:
                return {k: walk(v) for k, v in tree[ITEMS_MARK]}
            return {k: walk(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [walk(v) for v in tree]
        return tree

    return walk(tree)


_LAYOUT = operator.attrgetter("layout")
_SECOND = operator.itemgetter(1)
_STRIDED = frozenset((torch.strided,))
_DTYPE = operator.attrgetter("dtype")


class Flattener:
    """`flatten`, with the last state's structure kept (issue 21: a save walks the state at every step).

    The structure of the last call is kept as a skeleton of the tree; the next call checks the new state
    against it and takes its tensors with C-level operations per dict of tensors (its keys, its values'
    types, layouts and dtypes, all at once), re-encoding only the plain values. Anything different (a key,
    a type, a plain value's kind, a tensor seen twice, something unsupported) falls back to `flatten`, which
    says what is wrong and makes the next skeleton. Same result as `flatten`: the tree object itself is
    reused while the structure stays (callers only read it). Not thread-safe: one per saving thread."""

    def __init__(self) -> None:
        self._skel: Any = None
        self._tree: Any = None
        self.fast = 0    # calls served from the skeleton (for tests and benches)

    def __call__(self, state_dict: Mapping[str, Any], values: list[int] | None = None
                 ) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
        if self._skel is not None and isinstance(state_dict, Mapping):
            named: list[tuple[str, torch.Tensor]] = []
            vals: list[int] = []
            try:
                ok = _replay(self._skel, state_dict, named, vals) and _tensors_ok(named, vals)
            except InvalidInputError:   # flatten below says it with the path
                ok = False
            if ok:
                if values is not None:
                    values.extend(vals)
                self.fast += 1
                return self._tree, named
        vals = []
        tree, named = flatten(state_dict, vals)
        if values is not None:
            values.extend(vals)
        self._tree = tree
        self._skel = _skeleton(tree, named)
        return tree, named


def _skeleton(tree: Any, named: list[tuple[str, torch.Tensor]]) -> Any:
    """The skeleton of a flattened state (None when there is none worth keeping: a tensor-free state, or a
    tensor referenced twice). Nodes: ("T", path), ("V", path, kind), ("TD", keys, paths) a dict of tensors
    only, ("D", keys, children, int keys allowed), ("L", is tuple, children)."""
    refs: set[int] = set()

    def node(t: Any) -> Any:
        if isinstance(t, dict):
            if set(t) == {TENSOR_MARK}:
                i = t[TENSOR_MARK]
                if i in refs:
                    raise _NoSkeleton
                refs.add(i)
                return ("T", named[i][0])
            if set(t) == {VALUE_MARK, KIND_KEY}:
                i = t[VALUE_MARK][TENSOR_MARK]
                refs.add(i)
                return ("V", named[i][0], t[KIND_KEY])
            if set(t) == {TUPLE_MARK}:
                return ("L", True, _kid_nodes([node(v) for v in t[TUPLE_MARK]]))
            if set(t) == {ITEMS_MARK}:
                keys = tuple(k for k, _ in t[ITEMS_MARK])
                return _dict_node(keys, [node(v) for _, v in t[ITEMS_MARK]], True)
            kids = [node(v) for v in t.values()]
            if kids and all(k[0] == "T" for k in kids):
                return ("TD", tuple(t), tuple(k[1] for k in kids))
            return _dict_node(tuple(t), kids, False)
        if isinstance(t, list):
            return ("L", False, _kid_nodes([node(v) for v in t]))
        raise _NoSkeleton

    if isinstance(tree, dict) and set(tree) == {VALUE_MARK, KIND_KEY}:
        return None   # the whole state is one value
    try:
        return node(tree)
    except _NoSkeleton:
        return None


def _dict_node(keys: tuple[Any, ...], kids: list[Any], any_keys: bool) -> Any:
    """A dict's skeleton node: ("DT", keys, inner keys, paths, any_keys, kids) when every value is a dict of
    tensors with the same keys (an optimizer's per-parameter state: replayed with a few C-level operations
    for all of them), else ("D", keys, kids, any_keys) (kids a tuple when none of them is deferred)."""
    if len(kids) > 1 and all(k[0] == "TD" for k in kids) and len({k[1] for k in kids}) == 1:
        return ("DT", keys, kids[0][1], tuple(p for k in kids for p in k[2]), any_keys, tuple(kids))
    return ("D", keys, _kid_nodes(kids), any_keys)


def _kid_nodes(kids: list[Any]) -> Any:
    """A container's child nodes: a tuple when none of them is a deferred plain value (replayed in one pass,
    `_replay_kids`), else the list."""
    return kids if any(map(_deferred, kids)) else tuple(kids)


class _NoSkeleton(Exception):
    pass


_KEY_TYPES = frozenset((int, str))
_BYTES_IN_JSON = f'"{BYTES_MARK}"'.encode()
_BYTESIO_IN_JSON = f'"{BYTESIO_MARK}"'.encode()


def _replay(skel: Any, obj: Any, named: list[tuple[str, torch.Tensor]], vals: list[int]) -> bool:
    """Take `obj`'s tensors (and its plain values' bytes) as `skel` says; False at the first difference."""
    kind = skel[0]
    if kind == "TD":
        if not _is_dict(obj) or tuple(obj) != skel[1]:
            return False
        got = list(obj.values())
        if not set(map(type, got)) <= _TENSORS:
            return False
        named.extend(zip(skel[2], got))
        return True
    if kind == "T":
        if type(obj) not in _TENSORS:
            return False
        named.append((skel[1], obj))
        return True
    if kind == "V":
        if type(obj) in _TENSORS:
            return False
        k, payload = encode_item(obj, skel[1])
        if k != skel[2] or (k == "json" and (_BYTES_IN_JSON in payload or _BYTESIO_IN_JSON in payload)):
            return False   # bytes inside a plain part: flatten stores them raw, at their own path
        vals.append(len(named))
        named.append((skel[1], value_tensor(payload)))
        return True
    if kind == "DT":
        if not _is_dict(obj) or tuple(obj) != skel[1]:
            return False
        if skel[4] and not set(map(type, obj)) <= _KEY_TYPES:   # bool keys equal 0 / 1: refused by flatten
            return False
        inner = list(obj.values())
        if set(map(type, inner)) <= _PLAIN_DICTS and all(map(skel[2].__eq__, map(tuple, inner))):
            got = list(itertools.chain.from_iterable(map(dict.values, inner)))
            if not set(map(type, got)) <= _TENSORS:
                return False
            named.extend(zip(skel[3], got))
            return True
        return _replay_kids(skel[5], inner, named, vals)   # other mappings: one by one
    if kind == "D":
        if not _is_dict(obj) or tuple(obj) != skel[1]:
            return False
        if skel[3] and not set(map(type, obj)) <= _KEY_TYPES:   # bool keys equal 0 / 1: refused by flatten
            return False
        return _replay_kids(skel[2], list(obj.values()), named, vals)
    # "L"
    if not isinstance(obj, (tuple, list)) or isinstance(obj, tuple) != skel[1] or len(obj) != len(skel[2]):
        return False
    return _replay_kids(skel[2], obj, named, vals)


def _is_dict(obj: Any) -> bool:
    """A mapping flatten walks as a dict (a plain dict at once, without the ABC's check)."""
    return type(obj) in _PLAIN_DICTS or (isinstance(obj, Mapping) and not is_bytes_like(obj))


def _replay_kids(kids: Any, objs: Any, named: list[tuple[str, torch.Tensor]], vals: list[int]) -> bool:
    """A container's children in flatten's order: the tensors, bytes and what holds them first, in order,
    then its plain (JSON) values, in order. `kids` a tuple: none is deferred (one pass)."""
    if type(kids) is tuple:
        return all(map(_replay, kids, objs, itertools.repeat(named), itertools.repeat(vals)))
    if not all(_replay(s, v, named, vals) for s, v in zip(kids, objs) if not _deferred(s)):
        return False
    return all(_replay(s, v, named, vals) for s, v in zip(kids, objs) if _deferred(s))


def _deferred(skel: Any) -> bool:
    return skel[0] == "V" and skel[2] == "json"


def _tensors_ok(named: list[tuple[str, torch.Tensor]], vals: list[int]) -> bool:
    """flatten's checks over the tensors, all at once: dense strided, not quantized, a supported dtype, each
    object once (a tensor now referenced twice goes through flatten, which stores it once). A quantized
    tensor's dtype (qint8, ...) is not a supported one, so the dtype check refuses it too."""
    ts = list(map(_SECOND, named))
    return (set(map(_LAYOUT, ts)) <= _STRIDED and set(map(_DTYPE, ts)) <= DTYPE_NAMES.keys()
            and len(set(map(id, ts))) == len(ts))
