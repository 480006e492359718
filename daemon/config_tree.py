"""Walks the config tree (daemon/config.py's `Config`): every key with its type, default, help, flag and
environment variable; reads the three sources (TOML file, environment, flags) into one set of raw values;
builds the typed tree from them. The tree's classes are plain dataclasses whose fields carry their help
(`sdcwatch.settings.setting`); a field whose type is a dataclass is a nested table (`[tiers.nvme]`).

Names: `[section] key` -> flag `--section-key`, env `SDCWATCH_SECTION_KEY`; `[tiers.nvme] dir` ->
`--tiers-nvme-dir`, `SDCWATCH_TIERS_NVME_DIR`; `[agent] key` -> `--key` (env `SDCWATCH_AGENT_KEY`).
Precedence: flag > environment > file > default. Anything wrong raises `ConfigError(dotted key, why)`,
the why naming the value, where it came from and what would do.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from typing import Any, Mapping

from daemon.errors import ConfigError
from sdcwatch.settings import SettingError, help_of

ENV_PREFIX = "SDCWATCH_"
# Environment switches of other parts of the program that share a config section's prefix: never settings.
PROCESS_SWITCHES = frozenset({
    "SDCWATCH_NVML_TIMING",            # probes/nvml_backend.py: log each NVML call's time
    "SDCWATCH_NVML_INPROCESS",         # probes/nvml_backend.py: NVML in the agent process (no child)
    "SDCWATCH_NVML_CHILD_SCENARIO",    # probes/nvml_child.py: the NVML child's fake scenario (tests)
    "SDCWATCH_CANARY_CHILD_TEST",      # probes/canary_child.py: test hook of the canary child
})
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          frozenset: "a list of names (comma-separated on a flag or in the environment)"}


@dataclasses.dataclass(frozen=True, slots=True)
class Key:
    """One setting: its place in the tree, type, default and help."""

    path: tuple[str, ...]      # ("tiers", "nvme", "dir")
    kind: type                 # bool, int, float, str or frozenset (of str)
    default: Any
    help: str

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def flag(self) -> str:
        parts = self.path[1:] if self.path[0] == "agent" else self.path
        return "--" + "-".join(parts).replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + "_".join(self.path).upper()

    @property
    def dest(self) -> str:
        return "cfg__" + "__".join(self.path)

    def shown_default(self) -> str:
        if self.kind is bool:
            return "true" if self.default else "false"
        if self.kind is frozenset:
            return ",".join(sorted(self.default))
        return repr(self.default) if self.kind is str else str(self.default)


@dataclasses.dataclass(frozen=True, slots=True)
class Table:
    """A table of the tree (`[tiers]`, `[tiers.nvme]`): its path, help, and the keys directly in it."""

    path: tuple[str, ...]
    help: str
    keys: tuple[Key, ...]

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def tables(root: type) -> list[Table]:
    """Every table of the tree under `root` (a dataclass type), depth first, in field order."""
    out: list[Table] = []
    _walk(root, dataclasses.asdict(root()), (), "", out)
    return out


def keys(root: type) -> list[Key]:
    return [k for t in tables(root) for k in t.keys]


def _walk(cls: type, defaults: Mapping[str, Any], path: tuple[str, ...], help: str, out: list[Table]) -> None:
    hints = typing.get_type_hints(cls)
    declared = cls.__dict__.get("__annotations__", {})   # a subclass's own keys first (a tier's dir, url)
    fields = sorted(dataclasses.fields(cls), key=lambda f: f.name not in declared)
    own = tuple(Key(path + (f.name,), _kind(cls, f.name, hints[f.name]), defaults[f.name], help_of(f))
                for f in fields if not dataclasses.is_dataclass(hints[f.name]))
    if path:
        out.append(Table(path, help, own))
    for f in fields:
        if dataclasses.is_dataclass(hints[f.name]):
            _walk(hints[f.name], defaults[f.name], path + (f.name,), help_of(f), out)


def _kind(cls: type, name: str, hint: Any) -> type:
    origin = typing.get_origin(hint) or hint
    if origin in (bool, int, float, str, frozenset):
        return origin  # type: ignore[no-any-return]
    raise TypeError(f"{cls.__name__}.{name}: a setting's type is bool, int, float, str or frozenset[str], "
                    f"not {hint}")


# -- the sources ------------------------------------------------------------------------------------------
Raw = dict[str, tuple[Any, str]]     # dotted key -> (value, where it came from)


def from_file(data: Mapping[str, Any], root: type, where: str) -> Raw:
    """A parsed TOML document -> raw values. Unknown tables and keys are errors naming the known ones."""
    by_path = {t.path: t for t in tables(root)}
    raw: Raw = {}

    def visit(table: Mapping[str, Any], path: tuple[str, ...]) -> None:
        known = {k.path[-1]: k for k in by_path[path].keys} if path else {}
        subs = {p[-1] for p in by_path if len(p) == len(path) + 1 and p[:len(path)] == path}
        for name, value in table.items():
            dotted = ".".join(path + (name,))
            if name in subs:
                if not isinstance(value, Mapping):
                    raise ConfigError(dotted, f"is a table ([{dotted}]), got {value!r} in {where}")
                visit(value, path + (name,))
            elif name in known:
                raw[dotted] = (value, f"in {where}")
            else:
                raise ConfigError(dotted, f"unknown {'key' if path else 'section'} in {where}: "
                                  + (_moved(name, path, by_path) or _known(sorted(known) + sorted(subs), name)))

    visit(data, ())
    return raw


def _moved(name: str, path: tuple[str, ...], by_path: Mapping[tuple[str, ...], Table]) -> str:
    """For an old flat key (`[tiers] nvme_dir`): where it lives now; '' if it is not one."""
    for p, table in by_path.items():
        if len(p) == len(path) + 1 and p[:len(path)] == path and name.startswith(p[-1] + "_"):
            rest = name[len(p[-1]) + 1:]
            for k in table.keys:
                if k.path[-1] == rest:
                    return f"it moved to [{table.dotted}] {rest} (flag {k.flag}, env {k.env})"
    return ""


def _known(names: list[str], given: str) -> str:
    close = difflib.get_close_matches(given, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}known: {', '.join(names)}"


def from_env(environ: Mapping[str, str], root: type) -> Raw:
    """`SDCWATCH_<SECTION>_<KEY>` variables -> raw values. A variable under a section's prefix that names
    no key is an error (a typo would otherwise be ignored), except the PROCESS_SWITCHES."""
    all_keys = keys(root)
    by_env = {k.env: k for k in all_keys}
    prefixes = tuple(ENV_PREFIX + "_".join(t.path).upper() + "_" for t in tables(root))
    raw: Raw = {}
    for name, value in environ.items():
        key = by_env.get(name)
        if key is not None:
            raw[key.dotted] = (value, f"from ${name}")
        elif name.startswith(prefixes) and name not in PROCESS_SWITCHES:
            raise ConfigError(name, "names no setting: " + _known(sorted(by_env), name))
    return raw


def add_flags(parser: argparse.ArgumentParser, root: type) -> None:
    """One flag per key, grouped by table, with its help and default. Values are coerced by `from_flags`."""
    for t in tables(root):
        title = f"[{t.dotted}]" + (" (flags without the section name)" if t.path == ("agent",) else "")
        group = parser.add_argument_group(title, t.help or None)
        for k in t.keys:
            shown = "" if k.default == "" else f" (default {k.shown_default()})"   # '': the help says
            text = f"{k.help}{shown}".replace("%", "%%")
            if k.kind is bool:
                group.add_argument(k.flag, dest=k.dest, default=None, action=argparse.BooleanOptionalAction,
                                   help=text)
            else:
                group.add_argument(k.flag, dest=k.dest, default=None, help=text,
                                   metavar={int: "N", float: "X", frozenset: "A,B"}.get(k.kind, "TEXT"))


def from_flags(args: argparse.Namespace, root: type) -> Raw:
    return {k.dotted: (value, f"from {k.flag}") for k in keys(root)
            if (value := vars(args).get(k.dest)) is not None}


# -- values and the tree ----------------------------------------------------------------------------------
def coerce(key: Key, value: Any, where: str) -> Any:
    """A raw value (TOML-typed from the file, text from a flag or the environment) as the key's type."""
    kind = key.kind
    text = isinstance(value, str)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if text and value.strip().lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.strip().lower() in ("true", "yes", "1", "on")
    elif kind is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if text:
            try:
                return int(value.strip())
            except ValueError:
                pass
    elif kind is float and not isinstance(value, bool):
        if isinstance(value, (int, float)):
            return float(value)
        if text:
            try:
                return float(value.strip())
            except ValueError:
                pass
    elif kind is str:
        if text:
            return value
    elif kind is frozenset:
        if text:
            return frozenset(p.strip() for p in value.split(",") if p.strip())
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return frozenset(value)
    raise ConfigError(key.dotted, f"expected {_KINDS[kind]}, got {value!r} {where}")


def construct(root: type, raw: Raw) -> Any:
    """The tree under `root` with `raw` applied over the defaults (coerced, each table built once, so a
    table's own checks in `__post_init__` run on the final values). Not `validate()`d yet."""
    by_dotted = {k.dotted: k for k in keys(root)}
    values: dict[str, Any] = {}
    for dotted, (value, where) in raw.items():
        key = by_dotted.get(dotted)
        if key is None:
            raise ConfigError(dotted, f"unknown key {where}: " + _known(sorted(by_dotted), dotted))
        values[dotted] = coerce(key, value, where)
    return _build(root, dataclasses.asdict(root()), (), values, raw)


def _build(cls: type, defaults: Mapping[str, Any], path: tuple[str, ...], values: Mapping[str, Any],
           raw: Raw) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        dotted = ".".join(path + (f.name,))
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], defaults[f.name], path + (f.name,), values, raw)
        else:
            kwargs[f.name] = values.get(dotted, defaults[f.name])
    try:
        return cls(**kwargs)
    except SettingError as exc:
        dotted = ".".join(path + (exc.name,))
        raise ConfigError(dotted, exc.why + where_from(raw, dotted)) from None


def where_from(raw: Raw, dotted: str) -> str:
    """' (in FILE)', ' (from --flag)', ... for a key set by a source; '' for a default."""
    return f" ({raw[dotted][1]})" if dotted in raw else ""


# -- the reference ----------------------------------------------------------------------------------------
def markdown(root: type, intro: str) -> str:
    """docs/config.md: `intro`, then each table with every key's type, default, flag, variable and help."""
    kinds = {bool: "bool", int: "int", float: "float", str: "string", frozenset: "list"}
    out = [intro.rstrip(), ""]
    for t in tables(root):
        out += [f"## [{t.dotted}]", ""]
        if t.help:
            out += [t.help[0].upper() + t.help[1:] + ".", ""]
        if not t.keys:
            continue
        out += ["| key | type | default | flag | environment | meaning |", "|---|---|---|---|---|---|"]
        for k in t.keys:
            default = k.shown_default().replace("|", "\\|")
            out.append(f"| `{k.path[-1]}` | {kinds[k.kind]} | `{default}` | `{k.flag}` | `{k.env}` | "
                       f"{k.help.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)
