"""Connections to the coordination Redis: the one place a URL becomes a client, plain or through Sentinel.

URLs:
  redis://[user:password@]host:port[/db], rediss://..., unix:///path/to/sock   one server (redis-py's own)
  redis+sentinel://[user:password@]host1:26379,host2:26379,host3:26379/<service>[/<db>][?sentinel_password=...]
                                                 the primary of Sentinel's `<service>`, discovered on every
                                                 (re)connect; user/password are the data nodes'
                                                 (`sentinel_password` the Sentinels' own, if they have one)

A failover is ridden out by retrying commands on connection errors for `RedisOptions.failover_s`: each retry
reconnects, and a Sentinel-managed connection asks the Sentinels for the primary again (redis-py turns an old
primary's READONLY reply into a connection error). The scripts the coordinator retries are idempotent.

`epoch_source(url)` gives the fencing epoch: Sentinel's `config-epoch` of the service (raised by every
failover), 0 for a single server. checkpoint/commit_fence.py explains how the store checks it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.retry
import redis.sentinel
from redis.backoff import ExponentialBackoff

from checkpoint.redis_url import (PLAIN_SCHEMES, SENTINEL_SCHEME, RedisOptions, SentinelUrl,  # noqa: F401
                                   is_sentinel, parse_sentinel_url, redact, validate_url)

_BACKOFF_CAP_S = 0.25
_RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class _SentinelConnection(redis.sentinel.SentinelManagedConnection):
    """Reconnects through the Sentinels. redis-py 8.1 reconnects a dropped connection inside
    `send_packed_command` straight to its cached address, so the retry after a failover dials the dead
    primary until its retries run out (measured: 15 s of refused connects with `failover_s` 15, against
    2.5 s with this class). `connect()` asks the Sentinels for the primary first.

    And checks that the server it reached is the primary (`ROLE`): a Sentinel that has not heard of the
    failover yet names the old primary, which, restarted, answers reads from an empty data set until it
    has resynced as a replica (tests/test_sentinel_ha.py saw "no checkpoint at step N" from such a read)."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            self.connect()
        super().send_packed_command(command, check_health)

    def on_connect_check_health(self, check_health: bool = True) -> None:
        super().on_connect_check_health(check_health)
        if self.connection_pool.is_master:
            self.send_command("ROLE", check_health=False)
            _check_primary(self.read_response(), self.host, self.port)


class _AsyncSentinelConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    """`_SentinelConnection` for asyncio clients."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await self.connect()
        await super().send_packed_command(command, check_health)

    async def on_connect_check_health(self, check_health: bool = True) -> None:
        await super().on_connect_check_health(check_health)
        if self.connection_pool.is_master:
            await self.send_command("ROLE", check_health=False)
            _check_primary(await self.read_response(), self.host, self.port)


def _check_primary(role: Any, host: Any, port: Any) -> None:
    name = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
    if name != "master":
        raise redis.ConnectionError(f"{host}:{port} is a {name}, not the primary (a Sentinel's stale answer)")


def _retries(options: RedisOptions) -> int:
    return max(1, math.ceil(options.failover_s / _BACKOFF_CAP_S))


def _sentinel_kwargs(s: SentinelUrl, options: RedisOptions) -> dict[str, Any]:
    kw: dict[str, Any] = {"socket_timeout": options.timeout_s, "socket_connect_timeout": options.timeout_s}
    if s.sentinel_password:
        kw["password"] = s.sentinel_password
    return kw


def connect(url: str, options: RedisOptions | None = None) -> redis.Redis:
    """A synchronous client (the checkpoint coordinator's, used from worker threads)."""
    o = options or RedisOptions()
    validate_url(url)
    retry = redis.retry.Retry(ExponentialBackoff(cap=_BACKOFF_CAP_S, base=0.02), _retries(o), _RETRY_ERRORS)
    common = {
        "socket_timeout": o.timeout_s,
        "socket_connect_timeout": o.timeout_s,
        "retry": retry,
        "retry_on_error": list(_RETRY_ERRORS),
    }
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **common)
    s = parse_sentinel_url(url)
    sentinel = redis.sentinel.Sentinel(list(s.sentinels), sentinel_kwargs=_sentinel_kwargs(s, o))
    return sentinel.master_for(
        s.service,
        db=s.db,
        username=s.username,
        password=s.password,
        connection_class=_SentinelConnection,
        **common,
    )


def connect_async(url: str, options: RedisOptions | None = None) -> redis.asyncio.Redis:
    """An asyncio client (the agent's event stream)."""
    o = options or RedisOptions()
    validate_url(url)
    retry = redis.asyncio.retry.Retry(
        ExponentialBackoff(cap=_BACKOFF_CAP_S, base=0.02), _retries(o), _RETRY_ERRORS
    )
    common = {
        "socket_timeout": o.timeout_s,
        "socket_connect_timeout": o.timeout_s,
        "retry": retry,
        "retry_on_error": list(_RETRY_ERRORS),
    }
    if not is_sentinel(url):
        return redis.asyncio.Redis.from_url(url, **common)
    s = parse_sentinel_url(url)
    sentinel = redis.asyncio.sentinel.Sentinel(list(s.sentinels), sentinel_kwargs=_sentinel_kwargs(s, o))
    return sentinel.master_for(
        s.service,
        db=s.db,
        username=s.username,
        password=s.password,
        connection_class=_AsyncSentinelConnection,
        **common,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Era:
    """What the Sentinels say of the service now: the highest `config-epoch`, and whether any of them
    thinks the primary is down or is failing it over (`s_down`, `o_down`, `failover_in_progress` in its
    flags): a write acknowledged then may be on a primary about to be demoted."""

    epoch: int
    unsettled: bool = False


_UNSETTLED_FLAGS = {"s_down", "o_down", "failover_in_progress"}


def era_source(url: str, options: RedisOptions | None = None) -> Callable[[], Era]:
    """A callable returning the `Era` from every reachable Sentinel (a Sentinel that has not heard of a
    failover yet reports the older epoch, hence the highest); `Era(0)` for a single server. Raises
    redis.ConnectionError when no Sentinel answers."""
    if not is_sentinel(url):
        return lambda: Era(0)
    o = options or RedisOptions()
    s = parse_sentinel_url(url)
    clients = [
        redis.Redis(host=h, port=p, decode_responses=True, **_sentinel_kwargs(s, o)) for h, p in s.sentinels
    ]

    def current() -> Era:
        best, unsettled, errors = -1, False, []
        for c in clients:
            try:
                state = c.sentinel_master(s.service)
            except redis.RedisError as e:
                errors.append(f"{c.connection_pool.connection_kwargs.get('port')}: {e}")
                continue
            best = max(best, int(state.get("config-epoch", 0)))
            flags = state.get("flags", "")
            flags = set(flags.split(",")) if isinstance(flags, str) else set(flags)
            unsettled = unsettled or bool(flags & _UNSETTLED_FLAGS)
        if best < 0:
            raise redis.ConnectionError(f"no Sentinel answered for {s.service!r}: {'; '.join(errors)}")
        return Era(best, unsettled)

    return current


def epoch_source(url: str, options: RedisOptions | None = None) -> Callable[[], int]:
    """A callable returning the current fencing epoch: `era_source`'s epoch, 0 for a single server."""
    era = era_source(url, options)
    return lambda: era().epoch
