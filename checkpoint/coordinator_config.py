"""`CoordinatorConfig`: retention and verification of the in-memory checkpoints (checkpoint/coordinator.py),
the agent's `[checkpoints]` config section. Torch-free and I/O-free, so the agent's config tree imports it
without the coordinator."""
from __future__ import annotations

import dataclasses

from sdcwatch.settings import SettingError, setting


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """Retention and verification of the in-memory checkpoints, and where the memory tier lives: the agent's
    `[checkpoints]` config section."""

    keep_committed: int = setting(2, "newest restorable checkpoints kept in memory per job (>= 1)")
    rollback_span_steps: int = setting(160, "also keep VERIFIED checkpoints reaching this many steps back (0: off)")
    memory_cap_bytes: int = setting(0, "bytes of checkpoints kept in memory per job; older ones evicted first (0: no cap)")
    verify_on_commit: bool = setting(True, "re-read every chunk's checksum when a shard commits (shards checksummed "
                                     "on the host; those checksummed at the source are checked by the scrub)")
    scrub_bytes_per_s: float = setting(1e9, "rate at which the agent checks the bytes of shards checksummed at the "
                                       "source (on the GPU) against their checksums, after COMMITTED; VERIFIED "
                                       "waits for it (0: never checked, never VERIFIED)")
    pending_timeout_s: float = setting(600.0, "a save not committed by every rank after this long is aborted")
    tombstone_ttl_s: int = setting(3600, "seconds an evicted checkpoint's record stays (so late ranks learn it)")
    orphan_blob_ttl_s: float = setting(3600.0, "shard files no record names are deleted after this long")
    key_prefix: str = setting("sdcw:ckpt:", "prefix of this agent's keys in the coordination Redis")
    node_lease_s: float = setting(30.0, "an agent renews its node's lease every third of this; a node whose lease ran "
                                  "out (or whose agent said goodbye) is gone: its copies leave restore plans")
    max_world_size: int = setting(65536, "largest world_size a checkpoint may declare (Begin/CommitShard beyond it "
                                  "are refused; the work a request causes is bounded by what exists)")
    memory_base: str = setting("", "the directory holding the node's agents' memory dirs (a tmpfs: a dedicated "
                               "mount, with a size limit or huge pages; on a disk the memory tier writes to it and "
                               "the GPU cannot pin the ranks' staging slots there, and the agent says so at start); "
                               "this agent's is <memory_base>/<state dir "
                               "name>-<hash of its path>/memory (empty: /dev/shm/sdcwatch for root, "
                               "/dev/shm/sdcwatch-<uid> otherwise)")

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> SettingError:
            return SettingError("CoordinatorConfig", name, why)

        if self.keep_committed < 1:
            raise bad("keep_committed", f"must be >= 1, got {self.keep_committed}")
        for name, value in (("rollback_span_steps", self.rollback_span_steps),
                            ("memory_cap_bytes", self.memory_cap_bytes), ("tombstone_ttl_s", self.tombstone_ttl_s),
                            ("orphan_blob_ttl_s", self.orphan_blob_ttl_s)):
            if not value >= 0:
                raise bad(name, f"must be >= 0, got {value}")
        if not self.scrub_bytes_per_s >= 0:
            raise bad("scrub_bytes_per_s", f"must be >= 0, got {self.scrub_bytes_per_s}")
        if not self.node_lease_s > 0:
            raise bad("node_lease_s", f"must be positive, got {self.node_lease_s}")
        if not self.pending_timeout_s > 0:
            raise bad("pending_timeout_s", f"must be positive, got {self.pending_timeout_s}")
        if not 1 <= self.max_world_size <= 2**31 - 1:
            raise bad("max_world_size", f"must be in 1..2147483647, got {self.max_world_size}")
        if self.memory_base and not self.memory_base.startswith("/"):
            raise bad("memory_base", f"must be an absolute path, got {self.memory_base!r}")
        if not self.key_prefix:
            raise bad("key_prefix", "must not be empty (it keeps this agent's keys apart in a shared Redis)")
