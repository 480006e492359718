"""Recovery from a replica mismatch, in the step guard: the vote's verdict gates the next update, and with a
majority (3+ replicas) the odd replicas are repaired in place from a majority replica's state.

    recovery = ReplicaRecovery.attach(monitor)     # after Monitor.attach(model, optimizer, ...)

Two stages on the optimizer's `StepGuard` (checksums/step_guard.py), apart from any other GATE stage:

- `replica.vote_gate` (Phase.GATE) gates the update with the vote's verdict, in one of two ways (`mask=`):

  * on the device ("device"; the default on CUDA with NCCL and a fused optimizer, e.g.
    `torch.optim.Adam(fused=True)`): no host synchronisation. The gate takes the newest fingerprint check's
    gathered words, still on the GPU (`Monitor.latest_vote_words`: the current stream waits for that gather
    on the device), computes "some replica differs" there (`device_disagree`, a 0-d flag) and masks this
    update with it through the optimizer's `found_inf` (checksums/device_mask.py, the mechanism the compute
    gate uses: a fused optimizer leaves parameters, moments and step count unchanged, as it does for
    GradScaler). Every replica computes the flag from the same all_gathered words, so all mask the same
    step. While the replicas differ every later vote disagrees too, so every later update is masked and no
    update mixes the odd replica in; with `every` > 1 the flag of the newest check holds until the next.
    The host acts on a vote once every replica has surely read it, which needs no wait of its own: the
    Monitor reads a vote at the latest when its slot of the ring is reused, `Monitor.vote_lag` (4) step()
    calls later, so the gate acts on the votes launched that many calls ago. For those that disagreed it
    records the masked updates as skipped steps (`guard.masked`, so `guard.skipped` and the Monitor's
    step.skipped events say which updates were lost) and hands the first one to the REPAIR stage. On CUDA
    with 3+ replicas a mismatch at step M is therefore repaired at the update of step M + 5, and the updates
    of steps M + 1 .. M + 5 are masked: the result is bit-identical to a clean run that skipped those
    batches. After a repair or a restore (`StepGuard.restores`: the guard renumbered to a lower step, or
    `note_restore`, which `CheckpointClient.restore` calls) the votes launched before it are about weights
    that no longer exist: the flag clears, a gathered vote of an older restore epoch is never compared, and
    the next check decides again.
  * on the host ("host"; CPU/gloo, or an optimizer that is not fused): reads the votes of the steps taken
    so far (`monitor.flush()`: on CPU they are already read, so it costs nothing; on CUDA it waits for the
    previous step's gather: one host wait per step, and the host never runs more than a step ahead). A
    vote that disagreed, and that this stage has not acted on, vetoes this update (a `Veto`, its number
    kept); the REPAIR stage acts in the same step. A vote launched before a restore (an older
    `StepVote.epoch` than the guard's `restores`) vetoes nothing after it: the first redone update applies.
  * HSDP (FSDP2 on a (replicate, shard) mesh), either way: each shard's replica group votes apart, but the
    model's shards step together, so a verdict of any group gates the update on every rank of the mesh (a
    model whose shards applied different steps is no clean run's: before, the agreeing groups applied the
    update the odd group's gate held back). The device gate combines the flags with an all_reduce (MAX) of
    one float over each other mesh dim, every step, on the device (no host wait), and records the masked
    updates from a pinned copy once it landed; the host gate reads the same all_reduce on the host. So
    under HSDP every rank of the mesh attaches (and detaches) it, as every rank attaches its Monitor: the
    all_reduce is a collective of each step. The ranks that must attach it (the mesh under HSDP, the
    replica group otherwise) say so through torch.distributed's store at attach; the first gate waits for
    all of them (`attach_wait_s`, 120 s) and, if some never attach, logs an error and does without the
    collectives those ranks would not join: no combined flag, no repair (each group's gate still holds
    back its own shard's updates). Before 2026-12-07 a rank without it left the others waiting for ever.

- `replica.repair` (Phase.REPAIR): for a disagreeing vote with a strict majority (3+ replicas), every
  parameter and optimizer-state tensor (under FSDP2/HSDP a DTensor's local shard: c10d has no DTensor
  collectives) is broadcast from the lowest-ranked majority replica over the replica
  group, then fingerprinted and compared across the group (an all_gather of two int64; this rare path reads
  the result on the host): the repair counts only if every replica now holds the majority's exact bytes.
  The weights are then those after the last agreed update; the skipped steps' batches are lost:
  bit-identical to a clean run that skipped them. With two replicas (no majority), or when the comparison
  after the copy fails, nothing is repaired: the gate keeps vetoing (masking) updates while the replicas
  differ, and the agent's rollback directive (the newest VERIFIED checkpoint older than the mismatch)
  brings every replica back; after the restore, call `monitor.guard.renumber(target)` (a restore through a
  `CheckpointClient` bound to the guard notes it itself; a lower step is one too).

Training-side module: torch and torch.distributed only; never imports the agent.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from checksums.device_mask import DeviceMask, choose_mask, device_disagree
from checksums.collectives import gathered_fingerprints
from checksums.fingerprint import local_tensor
from checksums.optimizer_parts import param_states
from checksums.step_guard import Phase, StepContext, Veto
from sdcwatch.arguments import above, count

logger = logging.getLogger(__name__)

_ATTACHES = itertools.count()      # ReplicaRecovery objects made in this process (the ranks make them alike)
ATTACH_WAIT_S = 120.0              # how long the first gate waits for the other ranks to have attached


@dataclasses.dataclass(frozen=True, slots=True)
class Repair:
    """One repair attempt: the vote's step, the replica copied from, whether every replica matched after."""

    vote_step: int
    at_step: int
    source_rank: int
    ok: bool
    reason: str


class ReplicaRecovery:
    """See the module docstring. `monitor`: the rank's `checksums.monitor.Monitor` (its guard, replica group
    and votes). `mask`: "auto" (the device gate on CUDA with NCCL and a fused optimizer, else the host gate),
    "host" or "device" (forces the device gate, on CPU too: how the tests run it). `settle_lag`: calls after
    which the device gate acts on a vote on the host (default `monitor.vote_lag`; a test may set the CUDA
    value on CPU). `attach_wait_s`: how long the first gate waits for every rank that must attach one to
    have attached (see the module docstring)."""

    def __init__(self, monitor: Any, *, mask: str = "auto", settle_lag: int | None = None,
                 attach_wait_s: float = ATTACH_WAIT_S) -> None:
        if monitor.guard is None:
            raise ValueError("ReplicaRecovery needs a Monitor attached with an optimizer (its step guard)")
        wait_s = above("attach_wait_s", attach_wait_s, "the seconds the first step waits for every rank to "
                       "have attached", 0.0)
        self.monitor = monitor
        self.guard = monitor.guard
        optimizer = monitor._optimizer
        chosen = choose_mask(mask, optimizer, monitor.device)
        if mask == "auto" and chosen == "device" and not monitor.vote_lag:
            chosen = "host"           # a synchronous vote (gloo on CUDA): read at once, nothing to save
        self.mask = chosen
        if settle_lag is not None:
            settle_lag = count("settle_lag", settle_lag, "a number of steps")
        self.settle_lag = monitor.vote_lag if settle_lag is None else settle_lag
        self._acted: Any = None           # host gate: the last vote acted on
        self._pending: Any = None         # a disagreeing vote to repair for, at this step's REPAIR stage
        self.repairs: list[Repair] = []
        self.vetoed = 0                   # updates skipped for a disagreeing vote (device: once read)
        # the device gate's state (host side: ints and the flag tensor, never read on the host)
        self._flag: torch.Tensor | None = None    # 0-d float on the device: the newest vote disagreed
        self._flag_call = 0               # the call of the vote the flag was computed from
        self._flag_step = 0               # and its step
        self._mask_from: collections.deque[tuple[int, int]] = collections.deque(maxlen=64)  # (step, its vote)
        self._settled_call = 0            # votes launched up to this call were looked at on the host
        self._fresh_from = 0              # votes launched before this call: weights since repaired
        self._restores = self.guard.restores   # the restore epoch the device flag was computed in
        self._device_mask: DeviceMask | None = None
        # HSDP: the mesh's other dims (the shard groups). Each shard's replica group votes apart, but the
        # model's shards step together: a verdict of any group gates the update on every rank (a model whose
        # shards applied different steps is no clean run's). One tiny all_reduce (MAX) a step over each.
        self._peers = monitor.mesh_peer_groups()
        self._peer_flag: torch.Tensor | None = None      # device gate: [this group's flag, the combined one]
        self._peer_word: torch.Tensor | None = None      # host gate: this rank's verdict, then everyone's
        # device gate: the combined flag of each recent step, copied to the host for `_settle` to record
        self._peer_slots: collections.deque[_PeerSlot] = collections.deque()
        self._peer_free: list[_PeerSlot] = []
        if self._peers and self.mask == "device":   # made here: nothing is allocated in a step
            self._peer_flag = torch.zeros(2, dtype=torch.float32, device=monitor.device)
            self._peer_free = [_PeerSlot(monitor.device.type == "cuda") for _ in range(self.settle_lag + 2)]
        elif self._peers:
            self._peer_word = torch.zeros(1, dtype=torch.int32, device=monitor.device)
        self.gate = _Gate(self)
        self.repair = _Repair(self)
        # every rank that joins this object's collectives (the HSDP mesh, else the replica group) counts
        # itself in the store; the first gate waits for them all (`_check_attached`)
        self._attach_wait_s = wait_s
        self._members = self._collective_ranks()
        self._attached_key = ""
        self._store = _default_store() if len(self._members) > 1 else None
        if self._store is not None:
            digest = hashlib.sha1(",".join(map(str, self._members)).encode()).hexdigest()[:16]
            self._attached_key = f"sdcwatch/replica_recovery/{next(_ATTACHES)}/{digest}"
            self._store.add(self._attached_key, 1)
        self._all_attached: bool | None = None if self._store is not None else True
        self._repair_off = ""             # why repairs are off (not every replica attached), "" when on

    @classmethod
    def attach(cls, monitor: Any, **kwargs: Any) -> "ReplicaRecovery":
        rec = cls(monitor, **kwargs)
        rec.guard.add(rec.gate)
        rec.guard.add(rec.repair)
        if rec.mask == "device":
            rec._device_mask = DeviceMask.of(rec.guard)
        return rec

    def detach(self) -> None:
        self.guard.remove(self.gate.name)
        self.guard.remove(self.repair.name)

    def _collective_ranks(self) -> list[int]:
        """The ranks that must attach a ReplicaRecovery alongside this one: under HSDP every rank of the mesh
        (the combined flag is a collective of the shard dims), else the replica group (the repair's copy)."""
        if self._peers:
            sharded = self.monitor._sharded()
            if sharded is not None:
                return sorted(int(r) for r in sharded[0].device_mesh.mesh.flatten().tolist())
        if self.monitor.replica_group is None:
            return []
        return sorted(int(r) for r in dist.get_process_group_ranks(self.monitor.replica_group))

    def _check_attached(self) -> None:
        """At the first gate: every rank in `_members` attached a ReplicaRecovery (counted in the store),
        waited for up to `attach_wait_s` (a rank may run behind). The first rank to decide writes its answer
        to the store and every rank takes that one, so all decide alike however late. If not all attached,
        said once, and the collectives the missing ranks would never join are dropped: the shard groups'
        combined flag and the repair (a wait for ever before)."""
        assert self._store is not None
        deadline = time.monotonic() + self._attach_wait_s
        pause = 0.005
        while True:
            got = int(self._store.add(self._attached_key, 0))
            if got >= len(self._members) or time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        # the first rank to decide decides for all (a rank far behind must not combine flags the others
        # gave up on): its answer is kept in the store, and every later one reads it
        mine = "all" if got >= len(self._members) else "missing"
        agreed = self._store.compare_set(self._attached_key + "/verdict", "", mine)
        self._all_attached = (agreed.decode() if isinstance(agreed, bytes) else str(agreed)) == "all"
        if self._all_attached:
            return
        what = "the HSDP mesh" if self._peers else "the replica group"
        logger.error("sdcwatch: ReplicaRecovery was attached on %d of the %d ranks of %s within %.0f s of a "
                     "rank's first step: attach it on every rank (its gate and repair are collectives of "
                     "them). This rank gates its own group's updates only: no repair%s", got,
                     len(self._members), what, self._attach_wait_s,
                     ", and the shard groups' verdicts are not combined" if self._peers else "")
        self._peers = []
        self._repair_off = f"ReplicaRecovery attached on {got} of the {len(self._members)} ranks of {what}"

    # ---- the gate ------------------------------------------------------------------------------------
    def _gate(self, ctx: StepContext) -> Veto | None:
        if self._all_attached is None:
            self._check_attached()
        if self.mask == "device":
            return self._gate_on_device(ctx)
        own = self._gate_on_host(ctx)
        if self._peers and self._peers_disagree(own is not None):
            self.guard.note_rewrite()    # every rank of the mesh, this step: a group may repair its shard now
            if own is None:
                self.vetoed += 1
                return Veto(self.gate.name, "the replica vote of another shard's replica group disagreed: the "
                                            "update is not applied on any shard (the model's shards step "
                                            "together)")
        return own

    def _peers_disagree(self, mine: bool) -> bool:
        """Host gate, HSDP: whether any rank of the mesh vetoes this update for its group's vote (a host read,
        as the host gate's `flush` is)."""
        word = self._peer_word
        assert word is not None
        word.fill_(1 if mine else 0)
        for group in self._peers:
            dist.all_reduce(word, op=dist.ReduceOp.MAX, group=group)
        return bool(word.item())

    def _gate_on_host(self, ctx: StepContext) -> Veto | None:
        if self.monitor.replica_group is None:
            return None
        self.monitor.flush()
        vote = self.monitor.last_vote
        if vote is None or vote is self._acted or vote.result.agreed:
            return None
        if vote.epoch != self.guard.restores:   # taken before a restore: about weights the job left
            return None
        self._acted = vote
        self._pending = vote
        self.vetoed += 1
        return Veto(self.gate.name, f"replica vote at step {vote.step} disagreed ({vote.result.method}): "
                                    "the update is not applied")

    def _gate_on_device(self, ctx: StepContext) -> None:
        """Mask this update on the device with the newest vote's verdict; act on the host on the votes every
        replica has read by now (`settle_lag` calls old). No host synchronisation, no veto."""
        mon = self.monitor
        calls = mon.step_calls
        if mon.replica_group is None and not self._peers:
            return None
        restores = self.guard.restores
        if restores != self._restores:        # a restore since the last gate: the flag is about old weights
            self._restores, self._flag = restores, None
        latest = mon.latest_vote_words()
        if latest is not None:
            step, call, words, epoch = latest
            if epoch != restores or call < self._fresh_from or step >= ctx.step:
                self._flag = None                 # about weights since restored or repaired: no verdict
            elif call != self._flag_call:
                flag = device_disagree(words)
                if flag.device != mon.device:     # a synchronous vote on host buffers (forced device gate)
                    flag = flag.to(mon.device, non_blocking=True)
                self._flag, self._flag_call, self._flag_step = flag, call, step
        assert self._device_mask is not None
        if self._peers:                           # HSDP: every group's flag, on every rank (MAX), masks
            self._mask_with_peers(ctx)
        elif self._flag is not None:
            self._device_mask.add(ctx, self._flag)
            self._mask_from.append((ctx.step, self._flag_call))
        self._settle(ctx, calls)
        if self._peers:
            self._settle_peers(calls)
        return None

    def _mask_with_peers(self, ctx: StepContext) -> None:
        """Mask this update with the MAX of every mesh rank's flag (an all_reduce on the device, each step,
        whether or not this rank has a flag: every rank makes the same calls), and copy both flags to the
        host, where `_settle` records the masked update once the copy landed (at the latest `settle_lag`
        calls later, when it waits for it)."""
        assert self._device_mask is not None
        pair = self._peer_flag
        assert pair is not None
        if self._flag is not None:
            pair.copy_(self._flag.reshape(1).expand(2))
            self._mask_from.append((ctx.step, self._flag_call))
        else:
            pair.zero_()
        combined = pair[1:]
        for group in self._peers:
            dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=group)
        self._device_mask.add(ctx, pair[1])
        slot = self._peer_free.pop() if self._peer_free else _PeerSlot(pair.is_cuda)
        slot.fill(ctx.step, self.monitor.step_calls, self._flag_step if self._flag is not None else 0, pair)
        self._peer_slots.append(slot)

    def _settle(self, ctx: StepContext, calls: int) -> None:
        """The host's part, on votes every replica has read (so every replica decides the same, at the same
        step): record the updates a disagreeing vote masked, and hand the first disagreeing vote of weights
        not yet repaired to the REPAIR stage."""
        through = calls - self.settle_lag
        if through <= self._settled_call:
            return
        for call, vote in self.monitor.recent_votes:
            if call <= self._settled_call or call > through:
                continue
            if vote.result.agreed:
                continue
            why = (f"replica vote at step {vote.step} disagreed ({vote.result.method}): the update was "
                   "masked on the device")
            for step, by in self._mask_from:
                if by == call and not self._peers:      # HSDP: recorded from the combined flag (_settle_peers)
                    self.guard.masked(step, self.gate.name, why)
                    self.vetoed += 1
            if call >= self._fresh_from and vote.epoch == self.guard.restores and self._pending is None:
                self._pending = vote              # the REPAIR stage, this step
        self._settled_call = through

    def _settle_peers(self, calls: int) -> None:
        """HSDP, device gate: record the updates the combined flag masked as soon as their host copies
        landed; the slots `settle_lag` calls old (waited for: landed long before, in practice) are done with,
        and each that masked says, on every rank at the same call, that a group may repair its shard now."""
        for slot in self._peer_slots:
            if slot.recorded:
                continue
            if not (slot.landed() or slot.call <= calls - self.settle_lag):
                break                             # in order: the next ones landed later
            self._record_peer(slot)
        through = calls - self.settle_lag
        while self._peer_slots and self._peer_slots[0].call <= through:
            slot = self._peer_slots.popleft()
            if slot.combined:
                self.guard.note_rewrite()
            self._peer_free.append(slot)

    def _record_peer(self, slot: "_PeerSlot") -> None:
        own, slot.combined = slot.read()
        slot.recorded = True
        if slot.combined:
            self.guard.masked(slot.step, self.gate.name,
                              f"replica vote at step {slot.vote_step} disagreed: the update was masked on the "
                              "device on every shard" if own else
                              "the replica vote of another shard's replica group disagreed: the update was "
                              "masked on the device on every shard (the model's shards step together)")
            self.vetoed += 1

    # ---- the repair ----------------------------------------------------------------------------------
    def _repair(self, ctx: StepContext) -> Veto | None:
        vote, self._pending = self._pending, None
        if vote is None:
            return None
        result = vote.result
        if self._repair_off:          # a replica would never join the copy: the rollback directive recovers
            self.repairs.append(Repair(vote.step, ctx.step, -1, False, self._repair_off))
            return None
        if result.majority is None:   # two replicas, or no strict majority: the rollback directive recovers
            self.repairs.append(Repair(vote.step, ctx.step, -1, False, f"no majority ({result.method})"))
            return None
        if self.mask == "device":     # the votes launched before the next step() are about unrepaired weights
            self._fresh_from = self.monitor.step_calls + 1
        if not self._peers:           # every rank of the group repairs at this step (HSDP: noted mesh-wide)
            self.guard.note_rewrite()
        odd = {s.rank for s in result.suspects}
        source = min(r for r in vote.ranks if r not in odd)
        group = self.monitor.replica_group
        tensors = self._state_tensors(ctx.optimizer)
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, src=source, group=group)
        ok = len(set(gathered_fingerprints(tensors, group))) == 1
        why = (f"every replica matches rank {source} after the copy" if ok else
               "replicas still differ after the copy (fingerprints compared): rollback needed")
        self.repairs.append(Repair(vote.step, ctx.step, source, ok, why))
        (logger.warning if ok else logger.error)(
            "sdcwatch: replica repair at step %d (vote at step %d, odd ranks %s): %s", ctx.step, vote.step,
            sorted(odd), why)
        return None

    @staticmethod
    def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Every parameter and every optimizer-state tensor, in an order all replicas share. A DTensor (FSDP2,
        HSDP: this rank's shard) is its local tensor, which shares its storage: the copy goes over the
        replica group shard for shard, as the vote compared them (c10d has no DTensor collectives)."""
        out: list[torch.Tensor] = []
        for p, state in param_states(optimizer):      # a container's: its optimizers' states
            out.append(local_tensor(p.data))
            for key in sorted(state):
                v = state[key]
                if isinstance(v, torch.Tensor):
                    out.append(local_tensor(v))
        return out


class _PeerSlot:
    """One step's two flags (this group's, the combined one) on the host: pinned on CUDA, with an event."""

    __slots__ = ("step", "call", "vote_step", "host", "done", "_np", "recorded", "combined")

    def __init__(self, cuda: bool) -> None:
        self.step = self.call = self.vote_step = 0
        self.recorded = self.combined = False
        self.host = torch.zeros(2, dtype=torch.float32, pin_memory=cuda)
        self._np = self.host.numpy()              # read as numpy: no torch op on the host
        self.done: Any = torch.cuda.Event() if cuda else None

    def fill(self, step: int, call: int, vote_step: int, pair: torch.Tensor) -> None:
        self.step, self.call, self.vote_step = step, call, vote_step
        self.recorded = self.combined = False
        self.host.copy_(pair, non_blocking=self.done is not None)
        if self.done is not None:
            self.done.record()

    def landed(self) -> bool:
        return self.done is None or bool(self.done.query())

    def read(self) -> tuple[bool, bool]:
        if self.done is not None and not self.done.query():   # settle_lag calls old: landed, in practice
            self.done.synchronize()
        return bool(self._np[0] != 0.0), bool(self._np[1] != 0.0)


class _Gate:
    phase = Phase.GATE
    name = "replica.vote_gate"

    def __init__(self, owner: ReplicaRecovery) -> None:
        self._owner = owner

    def run(self, ctx: StepContext) -> Veto | None:
        return self._owner._gate(ctx)


class _Repair:
    phase = Phase.REPAIR
    name = "replica.repair"

    def __init__(self, owner: ReplicaRecovery) -> None:
        self._owner = owner

    def run(self, ctx: StepContext) -> Veto | None:
        return self._owner._repair(ctx)


def _default_store() -> Any:
    """torch.distributed's store of the default process group (torch keeps it in a private attribute), or
    None where there is none: then the ranks that attached are not counted (and a missing one still hangs)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
