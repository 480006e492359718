"""`RedisSupervisor`: keeps the agent's embedded redis-server (daemon/redis_embedded.py) running.

Lifecycle: built with the `EmbeddedRedis` after it started -> `start(background)` runs `_watch()`: every
`poll_s` it asks whether the child exited (`Popen.poll`, no I/O). When it died: `redis.down` is published,
the health name `sdcwatch.v1.Checkpoints` goes NOT_SERVING and GetStatus's probe `redis` says FAILING with
the exit code; then it is started again, waiting `backoff(n)` before the n-th attempt in a row (doubling
from `first_delay_s`, at most `max_delay_s`: bounded, and never a busy loop). Once it answers PING:
`on_restarted()` (the checkpoint service reconciles the reloaded index with the memory dir), `redis.restarted`,
health SERVING, probe OK. The checkpoint service's clients reconnect by themselves; while the server is
down their calls answer UNAVAILABLE.

The embedded server persists its index in the state dir (an append-only file, daemon/redis_embedded.py), so
the restarted server has every checkpoint the old one had committed: they stay listed and restorable.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from daemon.background import Background
from daemon.probe_runner import ProbeStatus
from daemon.redis_embedded import EmbeddedRedis
from sdcwatch import event_kinds as ek
from sdcwatch.event_kinds import Publish

log = logging.getLogger(__name__)

CHECKPOINTS_HEALTH = "sdcwatch.v1.Checkpoints"


def backoff(attempt: int, first_delay_s: float = 0.5, max_delay_s: float = 30.0) -> float:
    """Seconds to wait before restart attempt `attempt` (1, 2, ...) in a row: doubling, capped."""
    return min(max_delay_s, first_delay_s * 2 ** max(0, attempt - 1))


class RedisSupervisor:
    def __init__(self, redis: EmbeddedRedis, *, publish: Publish,
                 set_health: Callable[[str, bool], Awaitable[None]],
                 on_restarted: Callable[[], Awaitable[None]], poll_s: float = 0.5,
                 first_delay_s: float = 0.5, max_delay_s: float = 30.0) -> None:
        self.redis = redis
        self.publish = publish
        self.set_health = set_health
        self.on_restarted = on_restarted
        self.poll_s = poll_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.status = ProbeStatus(name="redis", state="OK", last_run=time.time(), runs=1)
        self.up = True

    def start(self, background: Background) -> None:
        background.start(self._watch(), name="redis-supervisor")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            proc = self.redis.proc
            code = proc.poll() if proc is not None else None
            if proc is None or code is None:
                continue
            await self._down(code)
            await self._restart()

    async def _down(self, code: int) -> None:
        self.up = False
        why = f"redis-server pid {self.redis.proc.pid if self.redis.proc else '?'} exited with code {code}"
        self.status.state, self.status.last_error = "FAILING", why + "; restarting"
        self.status.failures += 1
        log.error("embedded %s; checkpoints are unavailable until it is back", why)
        self.publish(ek.REDIS_DOWN, "node", f"embedded {why}: checkpoints unavailable until it is restarted",
                     {"exit_code": code, "socket": str(self.redis.socket)})
        await self.set_health(CHECKPOINTS_HEALTH, False)

    async def _restart(self) -> None:
        attempt, down_since = 0, time.time()
        while True:
            attempt += 1
            delay = backoff(attempt, self.first_delay_s, self.max_delay_s)
            await asyncio.sleep(delay)
            started = time.time()
            try:
                await asyncio.to_thread(self.redis.start)
            except Exception as exc:  # noqa: BLE001 - keep trying, with backoff
                self.status.last_error = f"restart attempt {attempt} failed: {exc}"
                log.warning("embedded redis-server restart attempt %d failed: %s", attempt, exc)
                continue
            self.status.runs += 1
            self.status.last_run, self.status.last_duration_s = started, time.time() - started
            break
        try:
            await self.on_restarted()
        except Exception:  # noqa: BLE001 - the server is back either way
            log.exception("after the redis-server restart: cleaning up failed")
        self.up = True
        self.status.state, self.status.last_error = "OK", ""
        self.publish(ek.REDIS_RESTARTED, "node",
                     f"embedded redis-server back after {time.time() - down_since:.1f}s ({attempt} attempt(s)); "
                     "checkpoints work again (the index reloaded from the state dir)",
                     {"attempts": attempt, "down_s": round(time.time() - down_since, 3)})
        await self.set_health(CHECKPOINTS_HEALTH, True)
