"""Coordination-Redis URLs and options, without redis-py: what the agent's config and the CLI need to check
a `[redis]` section (checkpoint/redis_connect.py, which imports redis-py, re-exports all of it). Keeping
redis-py out of this module keeps it out of every `sdcwatch` client command's start-up (about a third of
its import time).

URL forms: see checkpoint/redis_connect.py.
"""

from __future__ import annotations

import dataclasses
import urllib.parse

from checkpoint.errors import InvalidInputError

SENTINEL_SCHEME = "redis+sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RedisOptions:
    """How the agent talks to the coordination Redis (the agent's `[redis]` section fills it)."""

    timeout_s: float = 5.0  # connect, and per command
    failover_s: float = 10.0  # commands retry on connection errors this long (a failover's duration)
    replicas_to_ack: int = 0  # a begin/commit counts once this many replicas have it (Redis WAIT)
    ack_timeout_ms: int = 1000  # how long WAIT waits for them
    ack_all_online: bool = True  # ... and for every replica online, if more (checkpoint/commit_fence.py)


@dataclasses.dataclass(frozen=True, slots=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME + "://")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Parse a `redis+sentinel://` URL; InvalidInputError names what is wrong and the expected form."""
    form = "redis+sentinel://[user:password@]host:port[,host:port...]/<service>[/<db>]"
    if not is_sentinel(url):
        raise InvalidInputError(f"not a Sentinel URL (expected {form}): {url!r}")
    rest = url[len(SENTINEL_SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    creds, at, hosts_path = rest.rpartition("@")
    if not at:
        creds, hosts_path = "", rest
    hosts, _, path = hosts_path.partition("/")
    sentinels = []
    for hp in filter(None, hosts.split(",")):
        host, colon, port = hp.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInputError(f"Sentinel address {hp!r} is not host:port (expected {form})")
        sentinels.append((host.strip("[]"), int(port)))
    if not sentinels:
        raise InvalidInputError(f"no Sentinel address in {redact(url)!r} (expected {form})")
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise InvalidInputError(f"the Sentinel URL names no service (expected {form}): {redact(url)!r}")
    if len(parts) == 2 and not parts[1].isdigit():
        raise InvalidInputError(f"the database {parts[1]!r} is not a number (expected {form})")
    user, _, password = creds.partition(":")
    q = urllib.parse.parse_qs(query)
    unknown = set(q) - {"sentinel_password"}
    if unknown:
        raise InvalidInputError(
            f"unknown Sentinel URL parameter(s) {sorted(unknown)}; known: sentinel_password"
        )
    return SentinelUrl(
        tuple(sentinels),
        urllib.parse.unquote(parts[0]),
        int(parts[1]) if len(parts) == 2 else 0,
        urllib.parse.unquote(user) or None,
        urllib.parse.unquote(password) or None,
        q["sentinel_password"][0] if "sentinel_password" in q else None,
    )


def validate_url(url: str) -> None:
    """InvalidInputError unless `url` is one this module connects to."""
    if is_sentinel(url):
        parse_sentinel_url(url)
        return
    if urllib.parse.urlsplit(url).scheme not in PLAIN_SCHEMES:
        raise InvalidInputError(
            f"expected a redis://, rediss://, unix:// or {SENTINEL_SCHEME}:// URL, got {redact(url)!r}"
        )


def redact(url: str) -> str:
    """`url` with its credentials replaced by ***."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url
