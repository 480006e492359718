"""Non-tensor state as bytes, and back, without pickle: JSON for plain values, bytes raw (torch-free).

A training state holds more than tensors: an optimizer's param groups (floats, ints, tuples, strings), an LR
scheduler's state, a data loader's position, torchtitan's `BytesIO` items. `encode_item` turns one such
value into (kind, payload bytes); the payload is stored in the shard blob like a tensor's bytes (a uint8
tensor), so it gets chunk checksums and a fingerprint, and replicas compare it. `decode_item` turns it back.

Kinds:
- "bytes" / "bytesio": a `bytes` (or `bytearray`, restored as bytes) / `io.BytesIO` value, stored raw; a
  BytesIO is restored as a new BytesIO holding the same bytes, positioned at 0 (as torch.load returns one);
- "json": everything else that is a plain value, as canonical JSON (UTF-8):
  None, bool, str, int (any size, stays an int), float (bit-exact: finite values as their shortest repr,
  which round-trips; inf, -inf and NaN, payload and sign included, as {"__sdcw_float__": "<16 hex digits of
  the IEEE-754 bits>"}), list, tuple (as {"__sdcw_tuple__": [...]}: restored as a tuple, not a list), dict
  with str keys (any Mapping, restored as a dict; keys starting "__sdcw_" are reserved) or with int keys
  (as {"__sdcw_items__": [[key, value], ...]}), and bytes / BytesIO nested inside (base64).
  Subclasses of int, float, str, list, tuple are stored as their base type (an IntEnum as its int, a
  namedtuple as a tuple, numpy.float64 as a float).
Anything else (a tensor inside a plain value, a numpy array, a numpy integer, a set, an arbitrary object)
is refused with `InvalidInputError` naming the path and saying what to do. Decoding never unpickles and
never calls anything the payload names: it builds only the types above.
"""
from __future__ import annotations

import base64
import io
import json
import math
import struct
from typing import Any, Mapping

from checkpoint.errors import InvalidInputError
from checkpoint.manifest import ITEMS_MARK, TUPLE_MARK, VALUE_KINDS

FLOAT_MARK = "__sdcw_float__"
BYTES_MARK = "__sdcw_bytes__"
BYTESIO_MARK = "__sdcw_bytesio__"
RESERVED = "__sdcw_"
JSON, BYTES, BYTESIO = KINDS = VALUE_KINDS
_MARKS = (FLOAT_MARK, BYTES_MARK, BYTESIO_MARK, TUPLE_MARK, ITEMS_MARK)

WHAT_IS_PLAIN = ("a checkpoint holds tensors, bytes / io.BytesIO, and plain values: None, bool, int, float, "
                 "str, list, tuple, dict with str or int keys")


def is_bytes_like(obj: Any) -> bool:
    return isinstance(obj, (bytes, bytearray, io.BytesIO))


def encode_item(obj: Any, path: str) -> tuple[str, bytes]:
    """(kind, payload) for one non-tensor value; InvalidInputError naming `path` for anything unsupported."""
    if isinstance(obj, io.BytesIO):
        return BYTESIO, obj.getvalue()
    if isinstance(obj, (bytes, bytearray)):
        return BYTES, bytes(obj)
    return JSON, encode_json(obj, path)


def decode_item(kind: str, payload: bytes | memoryview) -> Any:
    if kind == BYTES:
        return bytes(payload)
    if kind == BYTESIO:
        return io.BytesIO(bytes(payload))
    if kind == JSON:
        return decode_json(payload)
    raise InvalidInputError(f"unknown stored value kind {kind!r} (expected one of {KINDS})")


def encode_json(obj: Any, path: str) -> bytes:
    try:
        tree = _to_json(obj, path)
        return json.dumps(tree, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except RecursionError:
        raise InvalidInputError(f"{path}: nested too deeply (or contains itself)") from None


def _float_bits(x: float) -> str:
    return struct.pack(">d", x).hex()


_EXACT_ATOMS = frozenset((int, str))   # these exact types (not bool, not a subclass) encode as themselves


def _to_json(obj: Any, path: str) -> Any:
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        x = float(obj)
        return x if math.isfinite(x) else {FLOAT_MARK: _float_bits(x)}
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, io.BytesIO):
        return {BYTESIO_MARK: base64.b64encode(obj.getvalue()).decode()}
    if isinstance(obj, (bytes, bytearray)):
        return {BYTES_MARK: base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, tuple):
        return {TUPLE_MARK: [_to_json(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        if set(map(type, obj)) <= _EXACT_ATOMS:   # a list of ints or strs (an optimizer group's params): as is
            return list(obj)
        return [_to_json(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj):
            out = {}
            for k, v in obj.items():
                if k.startswith(RESERVED):
                    raise InvalidInputError(f"{path}: dict key {k!r} is reserved (keys starting "
                                            f"{RESERVED!r})")
                out[str(k)] = _to_json(v, f"{path}/{k}")
            return out
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (int, str)):
                raise InvalidInputError(f"{path}: dict key {k!r} is a {type(k).__name__}; keys must be str "
                                        "or int")
            items.append([int(k) if isinstance(k, int) else str(k), _to_json(v, f"{path}/{k}")])
        return {ITEMS_MARK: items}
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    hint = ("a tensor inside a plain value: put it directly in the state dict (a dict of tensors), not in a "
            "list mixed with other values" if _is_tensor(obj) else
            "convert it to one of those (e.g. int(x), x.tolist(), a dict of its fields, or bytes you encode "
            "yourself), or save the object's own state_dict()")
    raise InvalidInputError(f"{path}: {kind} is not supported; {WHAT_IS_PLAIN}: {hint}")


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "dtype") and hasattr(obj, "shape")


def decode_json(payload: bytes | memoryview) -> Any:
    def refuse(name: str) -> Any:
        raise InvalidInputError(f"stored value holds the bare constant {name} (written as {FLOAT_MARK})")

    try:
        tree = json.loads(bytes(payload).decode(), parse_constant=refuse)
        return _from_json(tree)
    except (ValueError, UnicodeDecodeError) as e:
        if isinstance(e, InvalidInputError):
            raise
        raise InvalidInputError(f"stored plain value is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidInputError("stored plain value is nested too deeply") from None


def _from_json(tree: Any) -> Any:
    if isinstance(tree, list):
        return [_from_json(v) for v in tree]
    if not isinstance(tree, dict):
        return tree
    marks = [k for k in tree if k in _MARKS]
    if not marks:
        if any(k.startswith(RESERVED) for k in tree):
            raise InvalidInputError(f"stored plain value has an unknown reserved key in {sorted(tree)[:4]}")
        return {k: _from_json(v) for k, v in tree.items()}
    if len(tree) != 1:
        raise InvalidInputError(f"stored plain value has a malformed marker object with keys "
                                f"{sorted(tree)[:4]}")
    mark, v = marks[0], tree[marks[0]]
    try:
        if mark == FLOAT_MARK:
            if not isinstance(v, str) or len(v) != 16:
                raise ValueError(v)
            return struct.unpack(">d", bytes.fromhex(v))[0]
        if mark in (BYTES_MARK, BYTESIO_MARK):
            raw = base64.b64decode(v, validate=True)
            return raw if mark == BYTES_MARK else io.BytesIO(raw)
        if mark == TUPLE_MARK:
            if not isinstance(v, list):
                raise ValueError(v)
            return tuple(_from_json(x) for x in v)
        out = {}
        for k, x in v:   # ITEMS_MARK
            if isinstance(k, bool) or not isinstance(k, (int, str)):
                raise ValueError(k)
            out[k] = _from_json(x)
        return out
    except (ValueError, TypeError) as e:
        raise InvalidInputError(f"stored plain value has a malformed {mark} entry: {str(e)[:80]}") from None
