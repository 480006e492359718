"""Check that proto/sdcwatch/v1/*.proto still speak the last released wire, or cut a new released snapshot.

Usage:
  python scripts/proto_compat.py                  # compare against the newest proto/released/*.binpb
  python scripts/proto_compat.py --against FILE   # compare against a given FileDescriptorSet
  python scripts/proto_compat.py --cut 0.2.0      # at release: write proto/released/sdcwatch-0.2.0.binpb

A DaemonSet upgrade meets running jobs that still hold the old library, and a rank upgraded first meets an
old agent: both directions must keep working. The released definitions are kept as compiled
FileDescriptorSets (protoc --descriptor_set_out --include_imports); the current .proto files are compiled
fresh with grpc_tools.protoc and the two are compared element by element, by full name, through
google.protobuf.descriptor_pb2 (no .proto text parsing). The rules are a subset of buf's breaking-change
rules, near its PACKAGE level (stricter than WIRE_JSON: the CLI prints messages as JSON with the proto
field names, and Python code calls enum `Name()`), rule names in brackets:

  - messages, enums, services are never deleted                    [MESSAGE/ENUM/SERVICE_NO_DELETE]
  - a field is deleted only with its number and name reserved     [FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED]
  - a field keeps its name, json_name, type (message and enum types by full name), cardinality
    (implicit / optional / repeated) and oneof                    [FIELD_SAME_NAME, FIELD_SAME_JSON_NAME,
                                     FIELD_SAME_TYPE, FIELD_SAME_CARDINALITY, FIELD_SAME_ONEOF]
  - an enum value is deleted only with its number and name reserved; a number keeps its name
                                     [ENUM_VALUE_NO_DELETE_UNLESS_NUMBER_RESERVED, ENUM_VALUE_SAME_NAME]
  - reserved numbers and names stay reserved and are never reused [RESERVED_MESSAGE/ENUM_NO_DELETE]
  - an RPC is never deleted and keeps its request and response types and its streaming on both sides
                                     [RPC_NO_DELETE, RPC_SAME_REQUEST_TYPE, RPC_SAME_RESPONSE_TYPE,
                                      RPC_SAME_CLIENT_STREAMING, RPC_SAME_SERVER_STREAMING]
  - a file keeps its syntax                                        [FILE_SAME_SYNTAX]

Adding fields, messages, enum values, RPCs and services is always accepted. Well-known types
(google/protobuf/*) are not checked: they belong to protobuf. Exit status: 0 compatible, 1 breaking
changes (each printed on its own line), 2 bad input (no snapshot, protoc failed, snapshot exists).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from google.protobuf import descriptor_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))
# a sibling script, not a package: one protoc invocation for both scripts
from gen_proto import ROOT, ProtocError, proto_files, run_protoc  # noqa: E402

RELEASED_DIR = ROOT / "proto" / "released"
SNAPSHOT_NAME = re.compile(r"^sdcwatch-(\d+)\.(\d+)\.(\d+)\.binpb$")

FDP = descriptor_pb2.FieldDescriptorProto
_Reserving = descriptor_pb2.DescriptorProto | descriptor_pb2.EnumDescriptorProto
_LABELS = {FDP.LABEL_OPTIONAL: "singular", FDP.LABEL_REPEATED: "repeated", FDP.LABEL_REQUIRED: "required"}


@dataclasses.dataclass(frozen=True)
class Change:
    """One breaking change: where it is (file, element, member) and which rule it breaks."""

    rule: str
    file: str        # the .proto file of the released element
    element: str     # "message sdcwatch.v1.ReportStepRequest", "service sdcwatch.v1.Agent", ...
    member: str      # "field 5 \"loss\"", "value 3 \"STATE_FAILED\"", "rpc ReportStep", or "" for the element
    detail: str

    def __str__(self) -> str:
        where = f"{self.element}: {self.member}" if self.member else self.element
        return f"{self.file}: {where}: {self.detail} [{self.rule}]"


# ---- pure comparison: two FileDescriptorSets in, a list of Changes out --------------------------------


@dataclasses.dataclass(frozen=True)
class _Defs:
    """The named elements of a descriptor set, by full name, each with the file that defines it."""

    messages: dict[str, tuple[str, descriptor_pb2.DescriptorProto]]
    enums: dict[str, tuple[str, descriptor_pb2.EnumDescriptorProto]]
    services: dict[str, tuple[str, descriptor_pb2.ServiceDescriptorProto]]
    syntax: dict[str, str]


def _is_well_known(f: descriptor_pb2.FileDescriptorProto) -> bool:
    return f.name.startswith("google/protobuf/")


def _walk_messages(prefix: str, messages: Iterable[descriptor_pb2.DescriptorProto]
                   ) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for m in messages:
        name = f"{prefix}.{m.name}"
        yield name, m
        yield from _walk_messages(name, m.nested_type)


def _defs(fds: descriptor_pb2.FileDescriptorSet) -> _Defs:
    out = _Defs({}, {}, {}, {})
    for f in fds.file:
        if _is_well_known(f):
            continue
        out.syntax[f.name] = f.syntax or "proto2"
        prefix = f".{f.package}" if f.package else ""
        for e in f.enum_type:
            out.enums[f"{prefix}.{e.name}"] = (f.name, e)
        for name, m in _walk_messages(prefix, f.message_type):
            out.messages[name] = (f.name, m)
            for e in m.enum_type:
                out.enums[f"{name}.{e.name}"] = (f.name, e)
        for s in f.service:
            out.services[f"{prefix}.{s.name}"] = (f.name, s)
    return out


def _reserved_numbers(ranges: Iterable[descriptor_pb2.DescriptorProto.ReservedRange], end_inclusive: bool
                      ) -> set[int]:
    # message reserved ranges are [start, end); enum reserved ranges are [start, end]
    return {n for r in ranges for n in range(r.start, r.end + 1 if end_inclusive else r.end)}


def _cardinality(f: descriptor_pb2.FieldDescriptorProto) -> str:
    if f.label == FDP.LABEL_OPTIONAL and f.proto3_optional:
        return "optional (explicit presence)"
    return _LABELS.get(f.label, str(f.label))


def _type(f: descriptor_pb2.FieldDescriptorProto) -> str:
    name = FDP.Type.Name(f.type).removeprefix("TYPE_").lower()
    return f"{name} {f.type_name.lstrip('.')}" if f.type_name else name


def _oneof(m: descriptor_pb2.DescriptorProto, f: descriptor_pb2.FieldDescriptorProto) -> str:
    """The real oneof a field belongs to ('' for none; proto3 `optional` makes a synthetic one: none)."""
    if not f.HasField("oneof_index") or f.proto3_optional:
        return ""
    return m.oneof_decl[f.oneof_index].name


def _compare_message(file: str, name: str, old: descriptor_pb2.DescriptorProto,
                     new: descriptor_pb2.DescriptorProto) -> Iterator[Change]:
    element = f"message {name.lstrip('.')}"
    new_by_number = {f.number: f for f in new.field}
    new_by_name = {f.name: f for f in new.field}
    reserved_numbers = _reserved_numbers(new.reserved_range, end_inclusive=False)
    reserved_names = set(new.reserved_name)
    for f in old.field:
        member = f'field {f.number} "{f.name}"'
        g = new_by_number.get(f.number)
        if g is None:
            if f.number in reserved_numbers and f.name in reserved_names:
                continue
            moved = new_by_name.get(f.name)
            if moved is not None:
                detail = f"renumbered {f.number} -> {moved.number}: peers still send and read {f.number}"
                yield Change("FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED", file, element, member, detail)
            else:
                yield Change("FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED", file, element, member,
                             f'deleted: to retire a field write `reserved {f.number};` and '
                             f'`reserved "{f.name}";` (and check no released peer still relies on it)')
            continue
        if g.name != f.name:
            yield Change("FIELD_SAME_NAME", file, element, member, f'renamed to "{g.name}"')
        if g.json_name != f.json_name:
            yield Change("FIELD_SAME_JSON_NAME", file, element, member,
                         f'json_name changed "{f.json_name}" -> "{g.json_name}"')
        if _type(g) != _type(f):
            yield Change("FIELD_SAME_TYPE", file, element, member, f"type changed {_type(f)} -> {_type(g)}")
        if _cardinality(g) != _cardinality(f):
            yield Change("FIELD_SAME_CARDINALITY", file, element, member,
                         f"cardinality changed {_cardinality(f)} -> {_cardinality(g)}")
        if _oneof(new, g) != _oneof(old, f):
            was, now = _oneof(old, f) or "no oneof", _oneof(new, g) or "no oneof"
            yield Change("FIELD_SAME_ONEOF", file, element, member, f"moved from {was} to {now}")
    yield from _compare_reserved(file, element, old, new, end_inclusive=False,
                                 used_numbers={f.number: f.name for f in new.field},
                                 used_names={f.name for f in new.field}, what="field")


def _compare_enum(file: str, name: str, old: descriptor_pb2.EnumDescriptorProto,
                  new: descriptor_pb2.EnumDescriptorProto) -> Iterator[Change]:
    element = f"enum {name.lstrip('.')}"
    new_by_number = {v.number: v for v in new.value}
    new_by_name = {v.name: v for v in new.value}
    reserved_numbers = _reserved_numbers(new.reserved_range, end_inclusive=True)
    reserved_names = set(new.reserved_name)
    for v in old.value:
        member = f'value {v.number} "{v.name}"'
        g = new_by_number.get(v.number)
        if g is None:
            if v.number in reserved_numbers and v.name in reserved_names:
                continue
            moved = new_by_name.get(v.name)
            detail = (f"renumbered {v.number} -> {moved.number}" if moved is not None else
                      f'deleted: to retire a value write `reserved {v.number};` and `reserved "{v.name}";`')
            yield Change("ENUM_VALUE_NO_DELETE_UNLESS_NUMBER_RESERVED", file, element, member, detail)
        elif g.name != v.name and v.name not in new_by_name:
            # an added alias (allow_alias) keeps the old name: only a name that is gone breaks readers
            yield Change("ENUM_VALUE_SAME_NAME", file, element, member, f'renamed to "{g.name}"')
    yield from _compare_reserved(file, element, old, new, end_inclusive=True,
                                 used_numbers={v.number: v.name for v in new.value},
                                 used_names={v.name for v in new.value}, what="value")


def _compare_reserved(file: str, element: str, old: _Reserving, new: _Reserving, *, end_inclusive: bool,
                      used_numbers: dict[int, str], used_names: set[str], what: str) -> Iterator[Change]:
    kind = "MESSAGE" if what == "field" else "ENUM"
    old_numbers = _reserved_numbers(old.reserved_range, end_inclusive)
    new_numbers = _reserved_numbers(new.reserved_range, end_inclusive)
    for n in sorted(old_numbers - new_numbers):
        if n in used_numbers:
            yield Change(f"RESERVED_{kind}_NO_DELETE", file, element, f'{what} {n} "{used_numbers[n]}"',
                         f"reuses the reserved number {n}: released peers read it as the retired {what}")
        else:
            yield Change(f"RESERVED_{kind}_NO_DELETE", file, element, "",
                         f"reserved number {n} is no longer reserved")
    for n in sorted(set(old.reserved_name) - set(new.reserved_name)):
        detail = (f'reuses the reserved name "{n}"' if n in used_names else
                  f'reserved name "{n}" is no longer reserved')
        yield Change(f"RESERVED_{kind}_NO_DELETE", file, element, "", detail)


def _compare_service(file: str, name: str, old: descriptor_pb2.ServiceDescriptorProto,
                     new: descriptor_pb2.ServiceDescriptorProto) -> Iterator[Change]:
    element = f"service {name.lstrip('.')}"
    new_methods = {m.name: m for m in new.method}
    for m in old.method:
        member = f"rpc {m.name}"
        g = new_methods.get(m.name)
        if g is None:
            yield Change("RPC_NO_DELETE", file, element, member,
                         "deleted (or renamed): released peers call it and get UNIMPLEMENTED")
            continue
        if g.input_type != m.input_type:
            yield Change("RPC_SAME_REQUEST_TYPE", file, element, member,
                         f"request type changed {m.input_type.lstrip('.')} -> {g.input_type.lstrip('.')}")
        if g.output_type != m.output_type:
            yield Change("RPC_SAME_RESPONSE_TYPE", file, element, member,
                         f"response type changed {m.output_type.lstrip('.')} -> {g.output_type.lstrip('.')}")
        for side in ("client_streaming", "server_streaming"):
            if getattr(g, side) != getattr(m, side):
                yield Change(f"RPC_SAME_{side.upper()}", file, element, member,
                             f"{side.replace('_', ' ')} changed {getattr(m, side)} -> {getattr(g, side)}")


def breaking_changes(released: descriptor_pb2.FileDescriptorSet,
                     current: descriptor_pb2.FileDescriptorSet) -> list[Change]:
    """Every way `current` breaks peers built from `released`, in a stable order (empty: compatible)."""
    old, new = _defs(released), _defs(current)
    out: list[Change] = []
    for fname, syntax in sorted(old.syntax.items()):
        if fname in new.syntax and new.syntax[fname] != syntax:
            out.append(Change("FILE_SAME_SYNTAX", fname, "file", "",
                              f"syntax changed {syntax} -> {new.syntax[fname]}"))
    for name, (fname, m) in sorted(old.messages.items()):
        out.extend(_compare_message(fname, name, m, new.messages[name][1]) if name in new.messages
                   else [_deleted("message", fname, name)])
    for name, (fname, e) in sorted(old.enums.items()):
        out.extend(_compare_enum(fname, name, e, new.enums[name][1]) if name in new.enums
                   else [_deleted("enum", fname, name)])
    for name, (fname, s) in sorted(old.services.items()):
        out.extend(_compare_service(fname, name, s, new.services[name][1]) if name in new.services
                   else [_deleted("service", fname, name)])
    return out


def _deleted(kind: str, file: str, name: str) -> Change:
    return Change(f"{kind.upper()}_NO_DELETE", file, f"{kind} {name.lstrip('.')}", "",
                  "deleted (or renamed, or its package changed)")


# ---- I/O: compile, load, find and cut snapshots ------------------------------------------------------


def compile_descriptor_set(root: Path = ROOT) -> descriptor_pb2.FileDescriptorSet:
    """The .proto files under `root`/proto, compiled fresh (imports included, no source info)."""
    with tempfile.TemporaryDirectory(prefix="proto-compat-") as tmp:
        out = Path(tmp) / "current.binpb"
        run_protoc(f"--descriptor_set_out={out}", "--include_imports", *proto_files(root), root=root)
        return load_descriptor_set(out)


def load_descriptor_set(path: Path) -> descriptor_pb2.FileDescriptorSet:
    return descriptor_pb2.FileDescriptorSet.FromString(Path(path).read_bytes())


def snapshot_version(path: Path) -> tuple[int, int, int]:
    m = SNAPSHOT_NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path.name}: a released snapshot is named sdcwatch-MAJOR.MINOR.PATCH.binpb")
    return int(m[1]), int(m[2]), int(m[3])


def latest_snapshot(directory: Path = RELEASED_DIR) -> Path:
    """The newest released snapshot in `directory` (by version, not by file time)."""
    found = [p for p in directory.glob("sdcwatch-*.binpb") if SNAPSHOT_NAME.match(p.name)]
    if not found:
        raise FileNotFoundError(f"no released snapshot (sdcwatch-X.Y.Z.binpb) in {directory}: "
                                "cut one with --cut VERSION")
    return max(found, key=snapshot_version)


def cut_snapshot(version: str, root: Path = ROOT, directory: Path = RELEASED_DIR) -> Path:
    """Write the current definitions as the released snapshot of `version`; never overwrite one."""
    path = directory / f"sdcwatch-{version}.binpb"
    snapshot_version(path)
    if path.exists():
        raise FileExistsError(f"{path} exists: a released snapshot is never rewritten")
    directory.mkdir(parents=True, exist_ok=True)
    path.write_bytes(compile_descriptor_set(root).SerializeToString(deterministic=True))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path,
                    help="released FileDescriptorSet (default: the newest in proto/released)")
    ap.add_argument("--root", type=Path, default=ROOT, help="tree whose proto/ holds the current .proto files")
    ap.add_argument("--cut", metavar="VERSION", help="write proto/released/sdcwatch-VERSION.binpb and exit")
    args = ap.parse_args(argv)
    try:
        if args.cut:
            print(f"wrote {cut_snapshot(args.cut, args.root)}")
            return 0
        against = args.against or latest_snapshot()
        released = load_descriptor_set(against)
        current = compile_descriptor_set(args.root)
    except (OSError, ValueError, ProtocError) as e:
        print(f"proto_compat: {e}", file=sys.stderr)
        return 2
    changes = breaking_changes(released, current)
    for c in changes:
        print(c)
    name = against.name
    if changes:
        print(f"{len(changes)} breaking change(s) against {name}; see docs/wire-compat.md", file=sys.stderr)
        return 1
    print(f"compatible with {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
