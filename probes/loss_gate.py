"""The in-rank loss gate (opt-in, issue 19): a critical loss event vetoes the next update, in the rank.

The agent runs the loss detector (probes.loss_detector) on the reported losses and answers a critical event
with a rollback, a round trip and several steps later. This stage runs the same pure detector in the rank,
as a GATE stage of the step guard, so the update that follows a critical loss event is masked before the
optimizer applies it:

    gate = LossGate.attach(optimizer, module=model, loss_fn=loss_fn)   # or checks=ComputeChecks(...)
    for batch in loader:
        gate.retain(batch)                   # not with checks=: the compute gate's retain() serves both
        loss = loss_fn(ddp_model, batch)
        loss.backward()
        gate.observe(loss)                   # a non-blocking copy of the loss; read at the next step
        optimizer.step()                     # GATE: the previous step's loss through the detector

No GPU synchronisation per step: `observe` copies the loss to pinned host memory without waiting, and the
next step's gate reads it (the copy landed a step ago), so a loss event of step N is seen at step N+1's
gate and vetoes update N+1 (the one computed on the weights the suspicious step produced). Every rank runs
its own detector on its own loss; the ranks agree with one tiny collective of one flag per rank per step
(gloo: on the host; NCCL with a fused optimizer: on the device, the flags becoming the optimizer's
`found_inf`, as checksums.compute_gate's device mask does, and read back a step later).

A flagged step is then recomputed, forward only, from its retained micro-batches (bounded: at most two
flagged ranks, one replay each, never retried): every rank replays the flagged rank's batch on the current
weights (one update later than the original, so "reproduces" means closer to the original loss than to
the detector's baseline, in log space; NaN reproduces NaN) and `classify_loss_replays` (pure) decides, as
the compute gate does: reproduces on every rank: DATA (the loss is the data's or the model's: the update
is applied and the agent's detector handles it); reproduces nowhere: TRANSIENT on the flagged rank
(dropped); reproduces only on the flagged rank: PERSISTENT on its GPU (dropped; with two ranks the loss's
own baseline is the third witness); a minority that does not reproduce a majority's: PERSISTENT there.
One rank alone cannot tell a persistent fault from the data: a reproduced loss is DATA. On the device path
the update is masked before the replay runs, so a step classified DATA there is lost, not applied late.

Findings are `ComputeFinding`s with detector "loss" (carried to the agent on the Monitor's reports, with
`checks=` through the compute gate's, else with `monitor=`).

Lives in probes/ because the detector does (the rank library, checksums/, sits below probes/ in the
layers); it imports torch, so the agent never imports it (pyproject's import-linter contracts).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checksums.device_mask import DeviceMask, choose_mask
from checksums.replay import Cause, Classification, LossFn, ReplayFailed, Replayer, Retained
from checksums.reporter import ComputeFinding
from checksums.step_guard import Phase, StepContext, StepGuard, Veto
from probes.loss_detector import LossDetector, LossDetectorConfig, LossEvent
from sdcwatch.arguments import count, function, wire_name
from sdcwatch.names import GPU_UUID, HOST

logger = logging.getLogger(__name__)


def classify_loss_replays(
    suspect: int, original: float, baseline: float, replays: Sequence[float]
) -> Classification:
    """Decide a flagged loss from its original value, the flagged rank's detector baseline and every rank's
    replay of its batch (see the module docstring). Pure."""

    def reproduces(x: float) -> bool:
        if not math.isfinite(original):
            return not math.isfinite(x)
        if not math.isfinite(x) or x <= 0 or original <= 0:
            return x == original
        if not (math.isfinite(baseline) and baseline > 0):
            return abs(math.log(x / original)) < 0.01
        return abs(math.log(x / original)) < abs(math.log(x / baseline))

    world = len(replays)
    rep = [reproduces(x) for x in replays]
    got = ", ".join(f"{x:.4g}" for x in replays)
    if all(rep):
        finite = math.isfinite(original)
        return Classification(
            Cause.DATA,
            (),
            not finite,
            f"rank {suspect}'s loss {original:.4g} reproduces on "
            f"every rank ({got}; baseline {baseline:.4g})"
            + ("" if finite else "; a non-finite update is never applied"),
        )
    if not any(rep):
        return Classification(
            Cause.TRANSIENT,
            (suspect,),
            True,
            f"rank {suspect}'s loss {original:.4g} does not repeat ({got}; baseline {baseline:.4g})",
        )
    yes = [r for r in range(world) if rep[r]]
    no = [r for r in range(world) if not rep[r]]
    if len(yes) * 2 > world:  # a majority reproduces it: the dissenters recompute wrong
        return Classification(
            Cause.PERSISTENT,
            tuple(no),
            True,
            f"ranks {no} recompute rank {suspect}'s batch to another loss ({got})",
        )
    if rep[suspect] and len(yes) == 1:  # it repeats only on its own GPU; the rest and the baseline agree
        return Classification(
            Cause.PERSISTENT,
            (suspect,),
            True,
            f"rank {suspect}'s loss {original:.4g} repeats only on its GPU ({got}; baseline {baseline:.4g})",
        )
    return Classification(
        Cause.UNRESOLVED, tuple(yes), True, f"replays of rank {suspect}'s batch split ({got})"
    )


@dataclasses.dataclass(slots=True)
class _Obs:
    """One step's observed loss: its pinned host copy (and the event it lands on), whether it was non-finite
    (known on the host: CPU; or a device flag: CUDA), the step's micro-batches, the detector's baseline."""

    step: int
    buf: torch.Tensor
    event: Any
    now: bool | None
    now_dev: torch.Tensor | None
    retained: Retained | None
    baseline: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LossGateStatus:
    steps: int
    flagged: int  # steps on which some rank's detector raised a gating event
    dropped: int
    replays: int


class LossGate:
    """The GATE stage of the in-rank loss gate (see the module docstring). Build with `LossGate.attach`."""

    name = "loss"
    phase = Phase.GATE

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        module: nn.Module | None = None,
        loss_fn: LossFn | None = None,
        checks: Any = None,
        config: LossDetectorConfig | None = None,
        gate_on: Callable[[LossEvent], bool] | None = None,
        group: Any = None,
        mask: str = "auto",
        monitor: Any = None,
        gpu_uuid: str = "",
        host: str | None = None,
        max_findings: int = 1000,
    ) -> None:
        if module is not None and not isinstance(module, nn.Module):
            raise ValueError(f"module is the training's nn.Module (replayed on a critical loss), got "
                             f"{type(module).__name__}")
        function("loss_fn", loss_fn)
        function("gate_on", gate_on)
        if checks is not None and not hasattr(checks, "replayer"):
            raise ValueError("checks is a ComputeChecks (its replayer replays the step), got "
                             f"{type(checks).__name__}")
        if config is not None and not isinstance(config, LossDetectorConfig):
            raise ValueError(f"config is a LossDetectorConfig, got {type(config).__name__}")
        wire_name("host", host, HOST)
        wire_name("gpu_uuid", gpu_uuid, GPU_UUID)
        gpu_uuid = gpu_uuid or ""           # None as the Monitor takes it: not known
        max_findings = count("max_findings", max_findings, "the findings and events kept for GetStatus")
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self._checks: Any = None
        if checks is not None:
            self.replayer: Replayer = checks.replayer
            self._checks = weakref.ref(checks)
        else:
            if module is None or loss_fn is None:
                raise ValueError("LossGate needs module= and loss_fn= (the replayable step), or checks=")
            params = list(module.parameters())
            device = params[0].device if params else torch.device("cpu")
            self.replayer = Replayer(
                getattr(module, "module", module), None, loss_fn, device=device, group=group
            )
        self.device = self.replayer.device
        self.detector = LossDetector(config)
        self.gate_on = gate_on if gate_on is not None else (lambda e: e.critical)
        self.mask = choose_mask(mask, optimizer, self.device)
        self._optimizer_ref = weakref.ref(optimizer)
        pin = self.device.type == "cuda"
        self._bufs = [torch.zeros(1, dtype=torch.float32, pin_memory=pin) for _ in range(3)]  # step % 3
        self._observed: _Obs | None = None  # this step's loss, until the gate files it
        self._obs: collections.deque[_Obs] = collections.deque(maxlen=2)  # the last steps' losses
        self._handled: collections.deque[int] = collections.deque(maxlen=4)  # steps gated on their own loss
        self._flags = torch.zeros((max(self.world, 1), 2), dtype=torch.float32, pin_memory=pin)
        self._pending: tuple[Any, Any, dict[int, _Obs]] | None = None  # device path: judged a step later
        if self.world > 1:
            where: list[Any] = [None] * self.world
            dist.all_gather_object(
                where, (host if host is not None else socket.gethostname(), gpu_uuid), group=group
            )
            self.where = [tuple(w) for w in where]
        else:
            self.where = [(host if host is not None else socket.gethostname(), gpu_uuid)]
        self.findings: collections.deque[ComputeFinding] = collections.deque(maxlen=max_findings)
        self._unreported: collections.deque[ComputeFinding] = collections.deque(maxlen=64)
        self.events: collections.deque[LossEvent] = collections.deque(maxlen=max_findings)
        self._steps = self._flagged = self._dropped = 0
        self._replays0 = self.replayer.replays
        self.guard = StepGuard.attach(optimizer)
        self.guard.add(self)
        # checksums/device_mask.py: found_inf set here, put back AFTER the update (the device path only)
        self._device_mask = DeviceMask.of(self.guard) if self.mask == "device" else None
        if monitor is not None and checks is None:
            monitor.report_compute(self.take_findings, lambda: "")

    @classmethod
    def attach(cls, optimizer: torch.optim.Optimizer, **kwargs: Any) -> LossGate:
        return cls(optimizer, **kwargs)

    def retain(self, batch: Any) -> None:
        """Keep this micro-batch and its RNG state (call before its forward). With `checks=` the compute
        gate's `retain` keeps it for both: do not call this one as well."""
        if self._checks is not None:
            raise RuntimeError("this loss gate shares the compute gate's replayer: call checks.retain(batch)")
        self.replayer.retain(batch)

    def observe(self, loss: torch.Tensor | float) -> None:
        """This step's loss, once per optimizer step (with accumulation: the step's summed loss). A tensor is
        copied to pinned host memory without waiting and read at the next step; on CUDA its non-finiteness
        is also taken on the device for this step's mask."""
        step = self.guard.step + 1
        buf = self._bufs[step % 3]
        event = now_dev = None
        now: bool | None = None
        if isinstance(loss, torch.Tensor):
            x = loss.detach().reshape(-1)[:1].float()
            if x.device.type == "cuda":
                buf.copy_(x, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                now_dev = (~torch.isfinite(x)).float().reshape(())
            else:
                buf.copy_(x)
                now = not math.isfinite(float(buf[0]))
        else:
            buf.fill_(float(loss))
            now = not math.isfinite(float(loss))
        self._observed = _Obs(step, buf, event, now, now_dev, None)

    # ---- the stage ----------------------------------------------------------------------------------

    def run(self, ctx: StepContext) -> Veto | None:
        self._steps += 1
        obs = self._observed
        if obs is not None:
            if obs.step != ctx.step:
                obs = None  # observed for another step: ignore it
            else:
                obs.retained = self.replayer.retained
        try:
            if self.mask == "device":
                self._settle_previous()
            prev = self._obs[-1] if self._obs and self._obs[-1].step == ctx.step - 1 else None
            prev_flag = self._judge(prev) if prev is not None else False
            now_flag = bool(obs is not None and obs.now)
            if self.mask == "device":
                self._mask_on_device(ctx, prev, obs, prev_flag)
                return None
            flags = self._agree(prev_flag, now_flag)
            now_ranks = [r for r in range(flags.shape[0]) if flags[r, 1] > 0]
            prev_ranks = [r for r in range(flags.shape[0]) if flags[r, 0] > 0]
            if now_ranks and obs is not None:
                self._handled.append(obs.step)
                return self._decide(obs, now_ranks, masked=False)
            if prev_ranks and prev is not None:
                return self._decide(prev, prev_ranks, masked=False)
            return None
        finally:
            if obs is not None:
                self._obs.append(obs)
            self._observed = None
            if self._checks is None:
                self.replayer.end_step()

    def _judge(self, prev: _Obs) -> bool:
        """The previous step's loss (landed a step ago) through this rank's detector: whether it gates."""
        if prev.event is not None:
            prev.event.synchronize()  # recorded a step ago: already complete
        prev.baseline = self._baseline()
        events = self.detector.update(prev.step, float(prev.buf[0]), None, time.time())
        self.events.extend(events)
        if prev.step in self._handled or not any(self.gate_on(e) for e in events):
            return False
        # a step whose update was skipped (another gate dropped it) changed no weight: nothing to protect
        return not any(k.step == prev.step for k in self.guard.skipped[-4:])

    def _baseline(self) -> float:
        tracker = self.detector._loss
        return math.exp(tracker.baseline()) if tracker.trend.pts else math.nan

    def _agree(self, prev_flag: bool, now_flag: bool) -> torch.Tensor:
        """Every rank's two flags [world, 2] (the previous step's detector, this step's non-finite loss) on
        the host: a tiny all-reduce (gloo: host; NCCL with the host mask: one sync a step)."""
        flags = self._flags
        flags.zero_()
        flags[self.rank, 0] = float(prev_flag)
        flags[self.rank, 1] = float(now_flag)
        if self.world > 1:
            t = flags if self.device.type == "cpu" else flags.to(self.device)
            dist.all_reduce(t, group=self.group)
            return t.cpu()
        return flags.clone()

    def _mask_on_device(self, ctx: StepContext, prev: _Obs | None, obs: _Obs | None, prev_flag: bool) -> None:
        """The flags on the device, all-reduced there, become the optimizer's found_inf (no host sync); they
        come back to pinned host memory and are read at the next step (`_settle_previous`)."""
        flags = self._flags
        flags.zero_()
        flags[self.rank, 0] = float(prev_flag)
        t = flags.to(self.device, non_blocking=True)
        if obs is not None:
            if obs.now_dev is not None:
                t[self.rank, 1] = obs.now_dev
            elif obs.now:
                t[self.rank, 1] = 1.0
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        assert self._device_mask is not None
        self._device_mask.add(ctx, (t.sum() > 0).float())  # combined with the other gates' and GradScaler's
        back = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.device.type == "cuda")
        back.copy_(t, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        kept = {k: o for k, o in ((0, prev), (1, obs)) if o is not None}
        self._pending = (back, done, kept)

    def _settle_previous(self) -> None:
        """The previous step's flags (landed a step ago): replay and classify what they flagged; the update
        was masked already."""
        if self._pending is None:
            return
        back, done, kept = self._pending
        self._pending = None
        if done is not None:
            done.synchronize()
        now = [r for r in range(back.shape[0]) if back[r, 1] > 0]
        prev = [r for r in range(back.shape[0]) if back[r, 0] > 0]
        if now and 1 in kept:
            self._handled.append(kept[1].step)
            self._decide(kept[1], now, masked=True)
        elif prev and 0 in kept:
            self._decide(kept[0], prev, masked=True)
        elif now or prev:
            self._flagged += 1
            self._dropped += 1

    def _decide(self, obs: _Obs, flagged: list[int], *, masked: bool) -> Veto | None:
        """Replay and classify a flagged step (a collective on a suspicion only; every rank has the same
        `flagged`); a Veto when the update must not be applied (host path)."""
        self._flagged += 1
        if obs.event is not None:
            obs.event.synchronize()
        mine = (float(obs.buf[0]), obs.baseline if obs.baseline is not None else self._baseline())
        outcomes = []
        try:
            for r in flagged[:2]:  # bounded: at most two flagged ranks, one replay each
                if self.world > 1:
                    box: list[Any] = [mine]
                    dist.broadcast_object_list(
                        box, src=r, group=self.group,
                        device=self.device if self.device.type == "cuda" else None,
                    )
                    orig_r, base_r = box[0]
                    theirs = self.replayer.fetch(r, obs.retained)
                    value = self.replayer.agreed(lambda b=theirs: self.replayer.replay_loss(b))
                    got: list[Any] = [None] * self.world
                    dist.all_gather_object(got, value, group=self.group)
                else:
                    orig_r, base_r = mine
                    assert obs.retained is not None
                    kept = obs.retained
                    got = [self.replayer.agreed(lambda b=kept: self.replayer.replay_loss(b))]
                outcomes.append((r, classify_loss_replays(r, orig_r, base_r, got)))
        except ReplayFailed as exc:  # every rank alike: the flagged step is held back, no rank named
            logger.error("sdcwatch: the loss gate could not replay step %d (%s); its update is dropped "
                         "without a finding", obs.step, exc)
            self._dropped += 1
            return None if masked else Veto(self.name, f"loss of rank(s) {flagged} at step {obs.step}: "
                                                       f"not replayed ({exc})")
        drop = masked or any(c.drop for _, c in outcomes)
        if drop:
            self._dropped += 1
        for r, c in outcomes:
            self._record(obs.step, r, c, drop)
        if drop and not masked:
            return Veto(
                self.name,
                "; ".join(
                    f"loss of rank {r} at step {obs.step}: {c.cause.value} ({c.detail})" for r, c in outcomes
                ),
            )
        return None

    def _record(self, step: int, suspect: int, c: Classification, drop: bool) -> None:
        where = tuple((r, *self.where[r]) for r in c.faulty if r < len(self.where))
        finding = ComputeFinding(
            step=step,
            detector="loss",
            suspect=suspect,
            cause=c.cause.value,
            faulty=c.faulty,
            dropped=drop,
            detail=c.detail,
            where=where,
            since_step=step,
        )
        self.findings.append(finding)
        checks = self._checks() if self._checks is not None else None
        if checks is not None:
            checks._unreported.append(finding)
        else:
            self._unreported.append(finding)
        if self.rank == 0 or self.rank in c.faulty:
            logger.warning(
                "sdcwatch: loss gate at step %d: rank %d -> %s, faulty %s, next update %s",
                step,
                suspect,
                c.cause.value,
                list(where),
                "dropped" if drop else "applied",
            )

    def take_findings(self) -> tuple[ComputeFinding, ...]:
        out = tuple(self._unreported)
        self._unreported.clear()
        return out

    def status(self) -> LossGateStatus:
        return LossGateStatus(
            steps=self._steps,
            flagged=self._flagged,
            dropped=self._dropped,
            replays=self.replayer.replays - self._replays0,
        )

    def close(self) -> None:
        self.guard.remove(self.name)


__all__ = ["LossGate", "LossGateStatus", "classify_loss_replays"]
