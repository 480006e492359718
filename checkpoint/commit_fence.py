"""`CommitFence`: what makes a begin or commit in the coordination Redis count, across a Sentinel failover.

Two rules, both enforced by Redis itself (no home-made consensus):

1. **Epoch fence.** Every fenced script carries the writer's epoch (Sentinel's `config-epoch` of the service,
   which every failover raises; checkpoint/redis_connect.py `epoch_source`) and the job's fence key
   (`<prefix>{J}:epoch`, same hash slot as the job's records). `FENCE_LUA`, run first in the script, refuses
   an epoch lower than the highest the store has seen for the job (reply `ERR_FENCED`) and raises the stored
   one otherwise. A writer that decided under the old primary's era (a stalled agent, a retry queued before
   the failover) cannot land on the new primary once anyone wrote there under the new era: it re-reads the
   epoch and redoes the call, which re-checks the record as the new primary has it (e.g. a begin the old
   primary never replicated is gone: the commit says so instead of flipping a record that lost shards).
2. **Replication ack.** With `replicas > 0` the script is followed, on the same connection (one pipeline),
   by `WAIT replicas ack_timeout_ms`; the call counts only when Redis says that many replicas have the
   write, otherwise `StoreUnavailableError` (transient: the caller retries; the scripts are idempotent).
   A commit reported to a rank is therefore on a replica, which Sentinel promotes; a commit whose primary
   died before replicating is never reported. `all_online` (the default with Sentinel): WAIT for every
   replica the primary has online (INFO replication), at least `replicas`: Sentinel promotes the replica
   with the highest offset it last saw, which need not be the one that acknowledged, so a write only one of
   two replicas had could be lost with one failure (measured: tests/test_sentinel_ha.py lost a reported
   commit that way once in a few runs with WAIT 1). Right after a failover only one replica is online and
   WAIT asks for that one, so commits resume. Pair it with the primary's `min-replicas-to-write` so an
   isolated old primary refuses writes outright (docs/sentinel.md).
3. **Era check.** After WAIT the Sentinels are asked again (`redis_connect.era_source`); a write does not
   count, even acknowledged, when the epoch moved or a Sentinel reports the primary down or failing over
   (`s_down`, `o_down`, `failover_in_progress`): a primary being demoted (a failover of a live but slow
   primary, under load) still takes writes, and WAIT counts the replicas it still has, which then resync from
   the promoted one and drop them (tests/test_sentinel_ha.py lost a reported commit that way at load 28 on
   2 cores). The caller retries in the new era (one extra retry per failover; one query per Sentinel per
   replicated write).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import redis

from checkpoint.errors import StoreUnavailableError

log = logging.getLogger(__name__)

FENCED = "ERR_FENCED"

# Prepended to a script whose last KEY is the fence key and last ARGV the writer's epoch.
FENCE_LUA = """
local fence_key = KEYS[#KEYS]
local epoch = tonumber(ARGV[#ARGV])
local fence = tonumber(redis.call('GET', fence_key) or '0')
if epoch < fence then return {'ERR_FENCED', tostring(fence), 0} end
if epoch > fence then redis.call('SET', fence_key, epoch) end
"""


def fenced(script_body: str) -> str:
    """`script_body` with the fence check in front (see FENCE_LUA for its KEYS/ARGV convention)."""
    return FENCE_LUA + script_body


class CommitFence:
    """The epoch a writer presents and the replication it waits for. `epoch_source()` returns the current
    epoch (0 for a single server); it is read once and again whenever the store refuses the cached one."""

    def __init__(
        self,
        epoch_source: Callable[[], int] = lambda: 0,
        *,
        replicas: int = 0,
        ack_timeout_ms: int = 1000,
        all_online: bool = False,
        era_source: Callable[[], Any] | None = None,
    ) -> None:
        if replicas < 0 or ack_timeout_ms < 0:
            raise ValueError(f"replicas and ack_timeout_ms must be >= 0, got {replicas}, {ack_timeout_ms}")
        self._source = epoch_source
        self._era = era_source   # redis_connect.era_source: the epoch and whether a failover is under way
        self.replicas = replicas
        self.all_online = all_online
        self.ack_timeout_ms = ack_timeout_ms
        self._epoch: int | None = None
        self._lock = threading.Lock()
        self.stats = {"fenced": 0, "not_replicated": 0, "era_changed": 0}

    def epoch(self) -> int:
        with self._lock:
            if self._epoch is None:
                self._epoch = self._read()
            return self._epoch

    def refresh(self) -> int:
        with self._lock:
            self._epoch = self._read()
            return self._epoch

    def _read(self) -> int:
        try:
            return int(self._source())
        except redis.RedisError as e:
            raise StoreUnavailableError(f"cannot read the coordination store's epoch: {e}") from e

    def _needed(self, client: Any) -> int:
        """The replicas a write must reach: `replicas`, or with `all_online` every online one (at least
        `replicas`)."""
        if not self.replicas or not self.all_online:
            return self.replicas
        return max(self.replicas, online_replicas(client))

    def run(self, client: Any, script: Any, keys: Sequence[str], args: Sequence[Any], fence_key: str) -> list:
        """Run a `fenced` script (plus WAIT when `replicas`) in one pipeline; return the script's reply.
        A refused epoch is re-read once and the call redone; refused again, or not replicated in time, raises
        StoreUnavailableError."""
        for attempt in range(2):
            epoch = self.epoch() if attempt == 0 else self.refresh()
            pipe = client.pipeline(transaction=False)
            script(keys=[*keys, fence_key], args=[*args, epoch], client=pipe)
            need = self._needed(client)
            if need:
                pipe.wait(need, self.ack_timeout_ms)
            try:
                replies = pipe.execute()
            except redis.ResponseError as e:
                if "NOREPLICAS" in str(e):
                    self.stats["not_replicated"] += 1
                    raise StoreUnavailableError(
                        f"the coordination store's primary refuses writes: {e}"
                    ) from e
                raise
            reply = list(replies[0])
            if _s(reply[0]) == FENCED:
                self.stats["fenced"] += 1
                log.warning(
                    "write fenced: epoch %s is older than the store's %s; re-reading it", epoch, _s(reply[1])
                )
                continue
            if need and int(replies[1]) < need:
                self.stats["not_replicated"] += 1
                raise StoreUnavailableError(
                    f"the write reached {int(replies[1])} of {need} replicas within "
                    f"{self.ack_timeout_ms} ms; it does not count (retry)"
                )
            if need:
                self._check_era(epoch)
            return reply
        raise StoreUnavailableError(
            f"the coordination store fenced epoch {epoch} (a newer primary era exists) "
            "and the epoch read again is no newer"
        )


    def _check_era(self, epoch: int) -> None:
        """After WAIT: the write counts only if no failover began meanwhile. A primary Sentinel is demoting
        (a false failover under load, or the promotion of a replica already under way) still takes writes,
        and WAIT counts the replicas it still has, which are about to resync from the promoted one and drop
        them: an acknowledged write lost. A moved epoch makes this ack uncertain: the call raises
        StoreUnavailableError (transient) and the caller redoes it, idempotently, in the new era."""
        if self._era is None:
            now, unsettled = self._read(), False
        else:
            try:
                era = self._era()
            except redis.RedisError as e:
                raise StoreUnavailableError(f"cannot read the coordination store's epoch: {e}") from e
            now, unsettled = int(era.epoch), bool(era.unsettled)
        if now == epoch and not unsettled:
            return
        with self._lock:
            self._epoch = now
        self.stats["era_changed"] += 1
        if now != epoch:
            why = f"the coordination store failed over during this write (epoch {epoch} -> {now})"
        else:
            why = "a Sentinel reports the primary down or failing over"
        raise StoreUnavailableError(f"{why}: whether the write survived is uncertain; it does not count "
                                    "(retry)")


def online_replicas(client: Any) -> int:
    """How many replicas the primary has online (INFO replication: `slaveN` entries in state online)."""
    info = client.info("replication")
    return sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
               and v.get("state") == "online")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
