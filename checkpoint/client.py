"""Rank-side `CheckpointClient`: save / restore / list through the node agent's `sdcwatch.v1.Checkpoints`.

    client = CheckpointClient.connect(job_id, rank, world_size)          # agent socket from sdcwatch.paths
    client.save(step, state_dict)            # returns after the pinned copy; the rest is in the background
    sd = client.restore("latest_verified", device="cuda")   # or "latest", or a step number
    client.restore(5, resume=False)          # a look only (e.g. a check): its saves do not cut the history
    client.list()

Every RPC carries a deadline. If the agent is down, `save` logs and drops the checkpoint (training goes
on: the failure shows in the SaveHandle's result), and queries raise `AgentUnavailableError` after
the deadline. Bytes go straight into the agent's memory tier (files), never through gRPC.

`replica_set`: the ranks that save identical bytes (None: the guard's, which the Monitor sets from its replica
group; "" when this rank's shard has no replica, or when the saved state differs per rank, e.g. holds the
rank's RNG state). The agent compares the fingerprints of the bytes saved across the set before a checkpoint
can be VERIFIED (checkpoint.replica_bytes).

`link` may be a `GrpcAgentLink` (checkpoint.agent_link) or anything with the same methods, e.g. a
`Coordinator` in-process.

`guard=` (the optimizer's `checksums.step_guard.StepGuard`, e.g. `monitor.guard`) binds the client to the
optimizer's steps: `save(step, ...)` is refused unless `step` is the guard's step (the number of optimizer
steps taken, the Monitor's step too), and `save` then returns as soon as the device-to-host copies are
enqueued on a side stream: the guard's COPIES stage makes the next update wait, on the device, for the
copies of the optimizer's tensors (`SnapshotConfig(block="auto")`; checkpoint.snapshot says which tensors
wait where). Without a guard `save` returns when the copy is complete.

    client.prepare(state_dict)   # optional, once the state has its shapes: the first save's buffer, ahead
    client.stats                 # saves, committed, skipped (by reason), slots made ahead / inline

Every step: `CheckpointClient(..., config=SnapshotConfig.every_step(), guard=monitor.guard)` and a `save`
after each `optimizer.step()`; saves that find the previous still copying or committing are skipped and
counted (`client.stats.skipped_by`).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from checkpoint.agent_link import GrpcAgentLink
from checkpoint.blobstore import BlobStore
from checkpoint.errors import InvalidInputError
from checkpoint.locations import dir_store_for
from checkpoint.records import LATEST_VERIFIED, CheckpointInfo, RestoreReportMsg
from checkpoint.restore import restore_from_plan
from checkpoint.shard_reader import RestoreReport
from checkpoint.snapshot import SaveHandle, SaveStats, Snapshotter, SnapshotConfig
from checksums.step_guard import StepGuard

log = logging.getLogger(__name__)

SETTLE_S = 60.0   # a resuming restore waits at most this long for the saves in flight to finish


class CheckpointClient:
    def __init__(self, link: Any, job_id: str, rank: int, world_size: int, *,
                 config: SnapshotConfig | None = None,
                 store_for: Callable[[str], BlobStore] = dir_store_for,
                 guard: StepGuard | None = None, replica_set: str | None = None) -> None:
        self.link = link
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.store_for = store_for
        if replica_set is None:
            replica_set = guard.replica_set if guard is not None else ""
        self.snapshotter = Snapshotter(link, job_id, rank, world_size, config, store_for, replica_set)
        self.guard = guard
        if guard is not None:
            guard.add(self.snapshotter.copy_fence(guard.optimizer))
            self.snapshotter.warm_up(guard.optimizer)   # the fingerprint kernel compiles meanwhile

    @classmethod
    def connect(cls, job_id: str, rank: int, world_size: int, target: str | None = None,
                deadline_s: float = 5.0, **kw: Any) -> "CheckpointClient":
        return cls(GrpcAgentLink.connect(target, deadline_s), job_id, rank, world_size, **kw)

    def save(self, step: int, state_dict: Mapping[str, Any]) -> SaveHandle | None:
        guard = self.guard
        if guard is not None and step != guard.step:
            raise InvalidInputError(
                f"save(step={step!r}) but the optimizer has taken {guard.step} steps (the step guard's count, "
                f"skipped steps included, which the Monitor reports too): save as step {guard.step} "
                "(monitor.step_count) so the checkpoint and the replica vote name the same weights")
        return self.snapshotter.save(step, state_dict)

    def wait(self, timeout: float | None = None) -> Any:
        return self.snapshotter.wait(timeout)

    def prepare(self, state_dict: Mapping[str, Any]) -> Any:
        """Make the staging buffer for `state_dict`'s size ahead, in the background (a future)."""
        return self.snapshotter.prepare(state_dict)

    @property
    def stats(self) -> SaveStats:
        return self.snapshotter.stats

    def restore(self, target: int | str = LATEST_VERIFIED, device: Any = "cpu",
                report: RestoreReport | None = None, *, resume: bool = True) -> dict[str, Any]:
        """The rank's shard of checkpoint `target`, verified. `resume` (default): the rank goes on training from
        it, so the saves it makes from now on carry the restore in their begin and the agent cuts the history
        the job left there (docs/checkpoints.md, "Going back cuts the history"); the saves still in flight are
        let finish first (their records are history the restore leaves). `resume=False`: a look only (a check
        of a checkpoint inside a training process), which cuts nothing. A process that never saves (a reader)
        never cuts either way. With `guard=`, a resuming restore is noted on the guard
        (`StepGuard.note_restore`): the replica votes and checks taken before it gate no later update."""
        self.snapshotter.order_before_update()   # loading the result into the model comes after any copy
        if resume and not self.snapshotter.settle(SETTLE_S):
            log.warning("restore: a save is still in flight after %.0f s; it may outlive the restore", SETTLE_S)
        started = time.time()
        plan = self.link.restore_plan(self.job_id, target, self.rank)
        report = report if report is not None else RestoreReport()
        t0 = time.perf_counter()
        ok, error = False, ""
        try:
            out = restore_from_plan(plan, self.rank, self.store_for, device, report)
            ok = True
            if resume:
                self.snapshotter.note_restore(plan.checkpoint.step, started)
                if self.guard is not None:    # votes and checks taken before it gate no later update
                    self.guard.note_restore(plan.checkpoint.step)
            return out
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            self._report_restore(RestoreReportMsg(
                self.job_id, plan.checkpoint.step, self.rank, time.perf_counter() - t0,
                sum(s.manifest.nbytes for s in plan.shards if s.rank == self.rank), report.chunks,
                report.fallbacks, len(report.failures), ok, error, report.source))

    def _report_restore(self, msg: RestoreReportMsg) -> None:
        send = getattr(self.link, "report_restore", None)
        if send is None:
            return
        try:
            send(msg)
        except Exception as e:  # noqa: BLE001 - metrics only: never fail a restore over them
            log.info("could not report the restore to the agent: %s", e)

    def list(self) -> list[CheckpointInfo]:
        return self.link.list(self.job_id)

    def latest(self) -> CheckpointInfo | None:
        return self.link.latest(self.job_id)

    def latest_verified(self) -> CheckpointInfo | None:
        return self.link.latest_verified(self.job_id)

    def close(self) -> None:
        if self.guard is not None:
            self.guard.remove(self.snapshotter.copy_fence().name)
        self.snapshotter.close()
        close = getattr(self.link, "close", None)
        if close is not None:
            close()
