"""The one JSON form of every `--json` output (events, status, checkpoints): docs/json.md is its contract.

    to_json(message)   a protobuf message -> a dict: proto field names, every field present, integers as
                       JSON numbers (never "1"), enums as lowercase words without their type's prefix
                       (SEVERITY_INFO -> "info", CHECKPOINT_STATE_VERIFIED -> "verified"), maps and
                       google.protobuf.Struct as objects (a Struct's integral numbers as integers: rank 1,
                       not 1.0), bytes as base64 text
    dump(obj, stream)  one object per line (events) or one indented document (the rest)
"""
from __future__ import annotations

import base64
import json
import re
from typing import Any

from google.protobuf import json_format, struct_pb2
from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

_INTS = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
         FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
         FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED32,
         FieldDescriptor.TYPE_SFIXED64}


def is_repeated(field: FieldDescriptor) -> bool:
    """protobuf 7 dropped `label`; earlier ones have no `is_repeated`."""
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


def enum_word(enum: EnumDescriptor, number: int) -> str:
    """`Severity` 1 -> 'info'; `CheckpointState` 3 -> 'verified'; a number the stubs do not know -> its digits."""
    value = enum.values_by_number.get(number)
    if value is None:
        return str(number)
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
    return value.name.removeprefix(prefix).lower()


def _plain(value: Any) -> Any:
    """A Struct / Value / ListValue's content with integral floats as ints."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _scalar(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_json(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return enum_word(field.enum_type, value)
    if field.type in _INTS:
        return int(value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode()
    return value


def to_json(message: Message) -> Any:
    """`message` in the schema of the module docstring (docs/json.md)."""
    if isinstance(message, (struct_pb2.Struct, struct_pb2.Value, struct_pb2.ListValue)):
        return _plain(json_format.MessageToDict(message))
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vfield = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): _scalar(vfield, v) for k, v in value.items()}
        elif is_repeated(field):
            out[field.name] = [_scalar(field, v) for v in value]
        else:
            out[field.name] = _scalar(field, value)
    return out


def dump(obj: Any, *, line: bool = False) -> str:
    """The text printed for `obj`: one line (streams: one object per line) or an indented document."""
    return json.dumps(obj, separators=(",", ":")) if line else json.dumps(obj, indent=2)
