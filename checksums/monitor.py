"""The training-side Monitor: fingerprints, the replica vote, NaN/Inf and frozen-parameter checks.

Usage (after wrapping the model in DDP / fully_shard and after torch.compile, if any):

    monitor = Monitor.attach(model, optimizer, job_id="run-42")   # also guards optimizer.step()
    for batch in data:
        loss = ...; loss.backward(); optimizer.step()
        monitor.step(loss, grad_norm=gn)          # once per optimizer step, before zero_grad
        optimizer.zero_grad()
    monitor.close()

Step numbers: with an optimizer, the Monitor's step is its `StepGuard`'s (`checksums.step_guard`, the
guard is `monitor.guard`): the number of optimizer steps taken, skipped ones included, so a checkpoint
client bound to the same guard names the same weights. A `step()` with no optimizer step since the previous
one (GradScaler skipped it) counts a skipped step; `step=` renumbers the guard (the loop owns the numbers).
Without an optimizer the Monitor counts its own `step()` calls.

Per step (`every` steps for the fingerprint check):
1. on the main stream: one fingerprint launch over all trainable parameters (DTensor: the local shard),
   one over the frozen ones (if any), optionally the optimizer state and the gradients; the loss,
   grad norm and loss scale (when tensors) are copied into a preallocated device buffer;
2. the fingerprint words are all_gathered across the replica group (async on NCCL);
3. on a side stream: wait for the gather, copy the buffer into pinned host memory, record an event;
4. at a later `step()` (normally the next one), once the event has completed, the host reads the words:
   the replica vote, the frozen check and the NaN/Inf check run, and one StepReport goes to the reporter.
Once `agreed_directive()` has been called, each step also carries the rank's directive row (4 int64 from a
pinned buffer, copied host->device non_blocking) in the same pipeline: an async all_reduce (MAX) over the
world group, waited for on the side stream and copied to pinned host memory with the vote's words.
Nothing in `step()` synchronises with the GPU or allocates host buffers; all buffers are allocated at
attach. On CPU (gloo) the same steps run synchronously and are read in the same `step()` call.

The vote vector of a rank is its parameter words, then its frozen-parameter words (if any frozen
parameters), then optimizer-state words (check_optimizer_state), then gradient words (check_grads).
Every replica must hold identical values for all of them after the optimizer step.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import math
import os
import socket
import time
from typing import Any, Callable, Iterable, Literal, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from checksums.canary_injob import InJobCanary
from checksums.collectives import all_gather_single
from checksums.directive_text import REASON_WORDS, decode_reason, encode_reason
from checksums.fingerprint import (
    DTENSOR, NUM_WORDS, fingerprint_tensors_async, local_tensor, prepare_fingerprint,
)
from checksums.optimizer_parts import param_states
from checksums.replica_vote import VoteResult, vote
from checksums.reporter import (
    CanaryReport, ComputeFinding, Directive, ReporterStats, StepReport, StepReporter, StepSink,
)
from checksums.step_guard import StepGuard
from sdcwatch.arguments import count, function, text, wire_name
from sdcwatch.names import GPU_UUID, HOST, JOB_ID

logger = logging.getLogger(__name__)

FingerprintFn = Callable[[Sequence[torch.Tensor]], torch.Tensor]
DirectiveCallback = Callable[[Directive], None]

_U64 = (1 << 64) - 1
_N_SCALARS = 3          # loss, grad_norm, loss_scale
_N_HEAD = 4             # a directive row: event seq + 1, kind, target step + 1, skip batches (0s: none),
_N_DIRECTIVE = _N_HEAD + REASON_WORDS     # then its reason's text (checksums.directive_text)
_CUDA_SLOTS = 4         # ring of in-flight steps on CUDA
_NONFINITE_LOG_EVERY = 1000

# Scalar source kinds stored per slot.
_NONE, _VALUE, _DEVICE = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class MonitorEvent:
    """A local event. kind: replica.mismatch, frozen.changed, nonfinite.loss, nonfinite.grad_norm,
    agent.unreachable, directive, vote.disabled, vote.unavailable (sharded without replicas: plain FSDP),
    step.skipped (a guard stage vetoed the update)."""

    kind: str
    step: int
    message: str
    details: Mapping[str, Any]
    time: float


@dataclasses.dataclass(frozen=True, slots=True)
class StepVote:
    """The replica vote about `step` (read one step later on CUDA). `epoch`: the step guard's restore epoch
    when the vote was launched (`StepGuard.restores`): a vote of an older epoch is about weights a restore
    left, and gates no update after it."""

    step: int
    result: VoteResult
    replica_group: str
    ranks: tuple[int, ...]
    epoch: int = 0


class LatestVote(NamedTuple):
    """The newest fingerprint check with a vote (`Monitor.latest_vote_words`)."""

    step: int
    call: int                # the step() call that launched it
    words: torch.Tensor      # the gathered fingerprints, [replicas, V] int64 on the Monitor's buffer device
    epoch: int               # the step guard's restore epoch at its launch (StepVote.epoch)


@dataclasses.dataclass(frozen=True, slots=True)
class MonitorStats:
    steps: int              # step() calls
    checks_run: int         # fingerprint checks read back
    votes: int              # replica votes taken (group of 2 or more)
    mismatches: int         # votes that disagreed
    frozen_changes: int     # checks where a frozen parameter had changed
    nonfinite: int          # steps with NaN/Inf loss or grad norm
    reports_sent: int
    reports_dropped: int    # never reached the agent (queue full or failed call)
    reports_failed: int
    agent_down: bool


@dataclasses.dataclass(slots=True)
class _Slot:
    dev: torch.Tensor               # [G*V words | 3 float64 scalars | 4 directive ints] on the buffer device
    host: torch.Tensor              # pinned copy (CUDA async) or `dev` itself
    gathered: torch.Tensor          # dev[:G*V], the all_gather output
    scalar_views: list[torch.Tensor]  # one-element float64 views of dev's scalar tail
    local: torch.Tensor             # this rank's V words on the fingerprint device (the gather input)
    local_parts: list[torch.Tensor]  # W-word views of `local`, one per word group
    ready: Any = None               # CUDA event on the main stream (copy stream waits on it)
    done: Any = None                # CUDA event after the host copy
    work: Any = None                # the async all_gather handle of this slot
    directive: torch.Tensor | None = None  # dev's directive tail (the world MAX lands here)
    directive_src: torch.Tensor | None = None  # pinned host row copied into `directive` (CUDA async)
    directive_work: Any = None      # the async world all_reduce of the directive row
    directive_row: tuple[int, ...] | None = None  # the world MAX, once read (None: not launched this step)
    src_seq: int = 0                # whose reason text `directive_src` holds (event seq + 1; 0: zeros)
    busy: bool = False
    call: int = 0                   # the step() call that launched it (1 for the first)
    epoch: int = 0                  # the guard's restore epoch at the launch (StepVote.epoch)
    device_work: bool = False       # the host must wait for `done` before reading
    step: int = 0
    checked: bool = False
    wall_time: float = 0.0
    step_s: float = 0.0
    check_s: float = 0.0
    kinds: list[int] = dataclasses.field(default_factory=lambda: [_NONE] * _N_SCALARS)
    values: list[float] = dataclasses.field(default_factory=lambda: [0.0] * _N_SCALARS)


def _unwrap(model: nn.Module) -> nn.Module:
    """The original module under torch.compile's OptimizedModule and DDP wrappers."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            break
    return model


def _gpu_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    try:
        raw = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # an old torch without .uuid
        return ""
    return raw if raw.startswith(("GPU-", "MIG-")) else "GPU-" + raw


def _group_name(ranks: Sequence[int], world: bool) -> str:
    if world:
        return "world"
    joined = ",".join(str(r) for r in ranks)
    if len(ranks) <= 16 and len(joined) <= 122:       # the agent's limit on a group's name: 128 with "ranks:"
        return "ranks:" + joined
    digest = hashlib.sha1(joined.encode()).hexdigest()[:12]
    return f"ranks:{ranks[0]}..{ranks[-1]}#{len(ranks)}:{digest}"


class Monitor:
    """See the module docstring. Build with `Monitor.attach(...)`; call `step()` once per optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        job_id: str,
        every: int = 1,
        replica_group: Any = None,
        vote_enabled: bool = True,
        check_optimizer_state: bool = False,
        check_grads: bool = False,
        frozen: Iterable[str] | None = None,
        reporter: StepSink | Literal[False] | None = None,
        agent_socket: str | None = None,
        on_directive: DirectiveCallback | None = None,
        start_step: int | None = None,
        max_events: int = 1000,
        fingerprint_fn: FingerprintFn | None = None,
        host: str | None = None,
        gpu_uuid: str | None = None,
        canary: Any = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"Monitor.attach needs an nn.Module, got {type(model).__name__}")
        wire_name("job_id", job_id, JOB_ID, optional=False)
        every = count("every", every, "the steps between fingerprints", least=1)
        max_events = count("max_events", max_events, "the events kept for the job's history")
        if (check_optimizer_state and optimizer is None):
            raise ValueError("check_optimizer_state=True needs the optimizer")
        if isinstance(frozen, (str, bytes)):
            raise ValueError(f"frozen is a collection of parameter names, got the string {frozen!r} "
                             "(a list of one name: [name])")
        wire_name("host", host, HOST)
        wire_name("gpu_uuid", gpu_uuid, GPU_UUID)
        text("agent_socket", os.fspath(agent_socket) if isinstance(agent_socket, os.PathLike)
             else agent_socket)
        function("on_directive", on_directive)
        function("fingerprint_fn", fingerprint_fn)
        if not (canary is None or isinstance(canary, bool) or callable(getattr(canary, "maybe_run", None))):
            raise ValueError("canary is True (the in-job canary on this device), False, or an object with "
                             f"maybe_run(step, step_s) (checksums.canary_injob.InJobCanary), got {canary!r}")
        self._custom_fp = fingerprint_fn is not None
        if fingerprint_fn is None:
            fingerprint_fn = fingerprint_tensors_async
        self._fp = fingerprint_fn
        self.job_id = job_id
        self.every = every
        self._optimizer = optimizer
        self._check_opt = check_optimizer_state
        self._check_grads = check_grads
        self._on_directive = on_directive
        # The step number: the optimizer's guard owns it; without an optimizer, the Monitor counts.
        self.guard: StepGuard | None = StepGuard.attach(optimizer) if optimizer is not None else None
        if self.guard is not None and start_step is not None:
            self.guard.renumber(start_step)
        self._step = self.guard.step if self.guard is not None else (start_step or 0)
        self._guard_attempts = self.guard.attempts if self.guard is not None else 0
        self._guard_skips = self.guard.skipped_count if self.guard is not None else 0
        self._calls = 0
        self._events: collections.deque[MonitorEvent] = collections.deque(maxlen=max_events)
        self._module = _unwrap(model)
        self._extra_frozen = set(frozen or ())
        self._collect_parameters(self._extra_frozen)
        self.device = self._pick_device()
        self.host = host if host is not None else socket.gethostname()
        self.gpu_uuid = gpu_uuid if gpu_uuid is not None else _gpu_uuid(self.device)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._setup_group(replica_group, vote_enabled)
        self._setup_words()
        self._verify_replicas_at_attach()
        if self.guard is not None:   # the checkpoint client compares saved bytes across this set
            self.guard.replica_set = self.replica_group_name
        self._setup_buffers()
        self._setup_reporter(reporter, agent_socket)
        # counters and state
        self._pending: collections.deque[_Slot] = collections.deque()
        self._next = 0
        self._checks_run = 0
        self._votes = 0
        self._mismatches = 0
        self._frozen_changes = 0
        self._nonfinite = 0
        self._last_vote: StepVote | None = None
        self._recent_votes: collections.deque[tuple[int, StepVote]] = collections.deque(
            maxlen=4 * _CUDA_SLOTS)
        self._latest_checked: _Slot | None = None   # the newest slot whose check launched a vote
        self._latest_checked_call = 0
        self._last_suspects: tuple[int, ...] = ()
        self._directives: collections.deque[Directive] = collections.deque(maxlen=64)
        self._seen_directive_seqs: collections.deque[int] = collections.deque(maxlen=256)
        self._agreed_seq = -1                  # the newest directive agreed across the ranks (agreed_directive)
        self._reason_words: tuple[int, torch.Tensor] | None = None   # (seq + 1, its reason's row words)
        self._sync_words = False               # the host row's reason words hold text from the last MAX
        self._agreeing = False                 # set by the first agreed_directive(): step() carries the rows
        self._directive_slot: _Slot | None = None  # the slot agreed_directive() reads (see there)
        self._agent_down_said = False
        self._report_error_said = False
        self._read_errors = 0
        self._last_step_end = time.perf_counter()
        self._closed = False
        # in-job canary: True = checksums.canary_injob.InJobCanary on this device within 0.5% of step time
        self._canary: Any = None
        self._canary_result: Any = None
        self._compute_findings: Callable[[], tuple[ComputeFinding, ...]] | None = None
        self._compute_mode: Callable[[], str] | None = None
        if canary is True:
            self._canary = InJobCanary(self.device, budget_fraction=0.005, label=self.gpu_uuid or str(self.device))
        elif canary:
            self._canary = canary

    @classmethod
    def attach(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               **kwargs: Any) -> "Monitor":
        """Build a Monitor for `model` (see `Monitor.__init__` for the keyword arguments)."""
        return cls(model, optimizer, **kwargs)

    # ---- attach-time setup -----------------------------------------------------------------------

    def _collect_parameters(self, extra_frozen: set[str]) -> None:
        named = list(self._module.named_parameters())
        names = {n for n, _ in named}
        unknown = sorted(extra_frozen - names)
        if unknown:
            raise ValueError(f"frozen names not among the model's parameters: {unknown[:5]}"
                             f"{' ...' if len(unknown) > 5 else ''}")
        self._params: list[tuple[str, torch.Tensor]] = []
        self._frozen: list[tuple[str, torch.Tensor]] = []
        for name, p in named:
            if not p.requires_grad or name in extra_frozen:
                self._frozen.append((name, p))
            else:
                self._params.append((name, p))
        if not named:
            raise ValueError("the model has no parameters to fingerprint")

    def _pick_device(self) -> torch.device:
        devices = {local_tensor(p).device for _, p in self._params + self._frozen}
        cuda = sorted((d for d in devices if d.type == "cuda"), key=str)
        device = cuda[0] if cuda else torch.device("cpu")
        if len(devices) > 1:
            skipped = [n for n, p in self._params + self._frozen if local_tensor(p).device != device]
            logger.warning("sdcwatch: parameters on several devices; fingerprinting those on %s, "
                           "skipping %d (%s ...)", device, len(skipped), skipped[:3])
            self._params = [(n, p) for n, p in self._params if local_tensor(p).device == device]
            self._frozen = [(n, p) for n, p in self._frozen if local_tensor(p).device == device]
        self._bind_tensors()
        return device

    def _bind_tensors(self) -> None:
        self._param_tensors = [local_tensor(p) for _, p in self._params]
        self._frozen_tensors = [local_tensor(p) for _, p in self._frozen]
        self._ptr_objs = [p._local_tensor if DTENSOR is not None and isinstance(p, DTENSOR) else p
                          for _, p in self._params + self._frozen]
        self._ptrs = self._current_ptrs()

    def _current_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self._ptr_objs]

    def _storages_moved(self) -> bool:
        """True if a parameter's storage was replaced since attach (FSDP lazy init, assign=True loads)."""
        if DTENSOR is not None and any(isinstance(p, DTENSOR) and p._local_tensor is not t
                                        for (_, p), t in zip(self._params + self._frozen, self._ptr_objs)):
            return True
        return self._current_ptrs() != self._ptrs

    def _setup_group(self, replica_group: Any, vote_enabled: bool) -> None:
        self._group: Any = None
        self.vote_unavailable = ""     # why no vote is possible (plain FSDP: no replica of a shard), or ""
        if vote_enabled and dist.is_available() and dist.is_initialized():
            if replica_group is not None:
                self._group = replica_group
            else:
                self._group = self._auto_group()
        if self._group is not None and dist.get_world_size(self._group) < 2:
            self._group = None                      # a one-rank "vote" compares nothing: skipped
        if self._group is None:
            self._vote_off()
            return
        self._group_ranks = tuple(dist.get_process_group_ranks(self._group))
        self._group_rank = dist.get_rank(self._group)
        world = self._group is dist.group.WORLD or len(self._group_ranks) == self.world_size
        self.replica_group_name = _group_name(self._group_ranks, world)
        gathered: list[Any] = [None] * len(self._group_ranks)
        dist.all_gather_object(gathered, (self.rank, self.host, self.gpu_uuid), group=self._group)
        self._where = {int(r): (str(h), str(u)) for r, h, u in gathered}
        backend = str(dist.get_backend(self._group)).lower()
        self._async = self.device.type == "cuda" and "nccl" in backend
        if self.device.type == "cuda" and not self._async:
            logger.warning("sdcwatch: replica group backend %r cannot gather CUDA tensors asynchronously; "
                           "the vote runs synchronously (a host sync per check)", backend)

    def _vote_off(self) -> None:
        self._group = None
        self._group_ranks: tuple[int, ...] = (self.rank,)
        self._group_rank = 0
        self.replica_group_name = ""
        self._where: dict[int, tuple[str, str]] = {self.rank: (self.host, self.gpu_uuid)}
        self._async = self.device.type == "cuda"

    def _verify_replicas_at_attach(self) -> None:
        """Replicas must already agree at attach (DDP broadcasts at wrap time). If they do not, the group is
        not a set of data-parallel replicas (model parallelism, or attached before the wrap): voting would
        mark healthy GPUs suspect at every step, so the vote is turned off, loudly."""
        if self._group is None:
            return
        mine = self._words(self._fp(self._param_tensors or self._frozen_tensors)) + self._frozen_baseline
        gathered: list[Any] = [None] * len(self._group_ranks)
        dist.all_gather_object(gathered, mine, group=self._group)
        if all(tuple(g) == mine for g in gathered):
            return
        logger.warning("sdcwatch: parameters already differ across replica group %s at attach, so these "
                       "ranks are not data-parallel replicas (model parallel? attached before DDP?); the "
                       "replica vote is OFF. Pass the replica group (HSDP: device_mesh['replicate']"
                       ".get_group()) or vote_enabled=False.", self.replica_group_name)
        self._event("vote.disabled", self._step, "replicas differ at attach; replica vote off",
                    {"replica_group": self.replica_group_name})
        self._vote_off()

    def _sharded(self) -> tuple[Any, list[int]] | None:
        """The first DTensor parameter and its replicate mesh dims, or None (no DTensor: DDP)."""
        for _, p in self._params + self._frozen:
            if DTENSOR is not None and isinstance(p, DTENSOR):
                return p, [i for i, pl in enumerate(p.placements) if pl.is_replicate()]
        return None

    def _auto_group(self) -> Any:
        """World for plain DDP; the Replicate mesh dim for HSDP; None (no vote) for plain FSDP."""
        sharded = self._sharded()
        if sharded is None:
            return dist.group.WORLD
        p, replicate = sharded
        if len(replicate) == 1:
            return p.device_mesh.get_group(mesh_dim=replicate[0])
        self.vote_unavailable = (f"sharded parameters without exactly one replicate mesh dim "
                                 f"(placements {tuple(str(x) for x in p.placements)}): no replica "
                                 "holds this rank's shard, so no vote is possible")
        self._event("vote.unavailable", self._step,
                    f"{self.vote_unavailable}; replica_group= enables it when replicas exist "
                    "(HSDP: device_mesh['replicate'].get_group())",
                    {"placements": [str(x) for x in p.placements]})
        return None

    def _setup_words(self) -> None:
        probe = self._fp(self._param_tensors or self._frozen_tensors)
        self._w = int(probe.numel())
        if probe.dtype != torch.int64 or self._w < 1:
            raise ValueError(f"fingerprint function returned {probe.dtype} x {self._w}; expected int64 words")
        try:
            empty = self._fp([]).to(self.device)
        except Exception:  # a fingerprint function without an empty-list case
            empty = torch.zeros(self._w, dtype=torch.int64, device=self.device)
        self._empty_words = empty
        self._runners: list[Callable[[torch.Tensor], Any]] = [self._fixed_runner(self._param_tensors)]
        groups = ["params"]
        if self._frozen:
            self._runners.append(self._fixed_runner(self._frozen_tensors))
            groups.append("frozen")
        if self._check_opt:
            self._runners.append(self._dynamic_runner(self._optimizer_tensors))
            groups.append("optimizer")
        if self._check_grads:
            self._runners.append(self._dynamic_runner(self._grad_tensors))
            groups.append("grads")
        self._word_groups = groups
        self._v = self._w * len(groups)
        self._frozen_at = self._w if self._frozen else -1
        self._frozen_baseline: tuple[int, ...] = ()
        self._frozen_each: list[tuple[int, ...]] = []
        if self._frozen:
            self._frozen_baseline = self._words(self._fp(self._frozen_tensors))
            self._frozen_each = self._per_tensor_words(self._frozen_tensors)

    def _per_tensor_words(self, tensors: list[torch.Tensor]) -> list[tuple[int, ...]]:
        """Each tensor's own fingerprint words (one launch on the default path); syncs."""
        if self._custom_fp:
            return [self._words(self._fp([t])) for t in tensors]
        per = torch.empty(len(tensors), NUM_WORDS, dtype=torch.int64, device=self.device)
        self._fp(tensors, per_tensor_out=per)  # type: ignore[call-arg]
        return [tuple(int(x) & _U64 for x in row) for row in per.tolist()]

    @staticmethod
    def _words(t: torch.Tensor) -> tuple[int, ...]:
        """Host ints (uint64) of a words tensor; syncs: attach time and the rare frozen-change path only."""
        return tuple(int(x) & _U64 for x in t.reshape(-1).tolist())

    def _fixed_runner(self, tensors: list[torch.Tensor]) -> Callable[[torch.Tensor], Any]:
        """Writes the words of a list whose storages stay put into `out` (int64 [W] on the device)."""
        if not tensors:
            return lambda out: out.copy_(self._empty_words)
        if not self._custom_fp and self.device.type == "cuda":
            try:
                plan = prepare_fingerprint(tensors)  # the hot path: one fused launch, no per-call host work
                return lambda out: plan.run_async(out=out)
            except ValueError as err:
                logger.info("sdcwatch: no fused fingerprint plan (%s); using the per-call path", err)
        return self._dynamic_runner(lambda: tensors)

    def _dynamic_runner(self, tensors_fn: Callable[[], list[torch.Tensor]]) -> Callable[[torch.Tensor], Any]:
        """Writes the words of a list collected at each check (optimizer state, gradients) into `out`."""
        def run(out: torch.Tensor) -> Any:
            tensors = tensors_fn()
            if not tensors:
                return out.copy_(self._empty_words)
            if self._custom_fp:
                return out.copy_(self._fp(tensors))
            return self._fp(tensors, out=out)  # type: ignore[call-arg]
        return run

    def _setup_directive_mode(self) -> None:
        """How step() carries the directive rows over the world group (agreed_directive): in the slot's
        device buffer, all_reduced asynchronously and copied with the vote (NCCL world, buffers on the GPU);
        otherwise a synchronous all_reduce of a preallocated tensor (gloo: on the host, read at once)."""
        self._directive_world = dist.is_available() and dist.is_initialized() and dist.get_world_size() >= 2
        nccl = self._directive_world and "nccl" in str(dist.get_backend()).lower()
        self._directive_async = bool(self._async and nccl)
        sync_device = self.device if nccl else torch.device("cpu")
        self._directive_sync = torch.zeros(_N_DIRECTIVE, dtype=torch.int64, device=sync_device)

    def _setup_buffers(self) -> None:
        self._setup_directive_mode()
        g = len(self._group_ranks)
        n = g * self._v + _N_SCALARS + _N_DIRECTIVE
        buf_device = self.device if self._async else torch.device("cpu")
        slots = _CUDA_SLOTS if self._async else 1
        self._slots: list[_Slot] = []
        for _ in range(slots):
            dev = torch.zeros(n, dtype=torch.int64, device=buf_device)
            host = torch.zeros(n, dtype=torch.int64, pin_memory=True) if self._async else dev
            local = torch.zeros(self._v, dtype=torch.int64, device=self.device)
            at = g * self._v
            tail = dev[at:at + _N_SCALARS].view(torch.float64)
            slot = _Slot(dev=dev, host=host, gathered=dev[: g * self._v],
                         scalar_views=[tail[i:i + 1] for i in range(_N_SCALARS)], local=local,
                         local_parts=[local[i * self._w:(i + 1) * self._w] for i in range(len(self._runners))])
            slot.directive = dev[n - _N_DIRECTIVE:]
            if self._directive_async:
                slot.directive_src = torch.zeros(_N_DIRECTIVE, dtype=torch.int64, pin_memory=True)
            if self._async:
                slot.ready = torch.cuda.Event()
                slot.done = torch.cuda.Event()
            self._slots.append(slot)
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._async else None
        self._directive_slot = None

    def _setup_reporter(self, reporter: StepSink | Literal[False] | None, agent_socket: str | None) -> None:
        """`reporter`: a StepSink, False (none), or None (a StepReporter to the agent at `agent_socket`)."""
        self._reporter: StepSink | None = None
        self._own_reporter: StepReporter | None = None
        if reporter is False:
            return
        if reporter is not None:
            if not isinstance(reporter, StepSink):
                raise ValueError(f"reporter must have submit(StepReport), take_directives() and stats() "
                                 f"(checksums.reporter.StepSink), got {type(reporter).__name__}")
            self._reporter = reporter
            return
        try:
            self._own_reporter = StepReporter(agent_socket)
            self._reporter = self._own_reporter
        except Exception as err:  # the agent is optional: never fail training for it
            logger.warning("sdcwatch: no reporter to the agent (%s); checks run locally only", err)

    def refresh_parameters(self) -> None:
        """Re-read the parameter list (after the model's parameters were replaced, e.g. assign=True loads).
        Must be called on every rank of the replica group; frozen baselines are taken again."""
        self.flush()
        self._collect_parameters(self._extra_frozen)
        if self._pick_device() != self.device:
            raise ValueError(f"refresh_parameters: the parameters moved from {self.device}; attach again")
        self._setup_words()
        self._setup_buffers()
        self._next = 0
        self._latest_checked = None

    # ---- the training step -----------------------------------------------------------------------

    def step(self, loss: Any = None, grad_norm: Any = None, loss_scale: Any = None, *,
             step: int | None = None) -> None:
        """Record one optimizer step. Call after `optimizer.step()` (before `zero_grad` if check_grads).

        `loss`, `grad_norm`, `loss_scale`: Python numbers or one-element tensors (read a step later on
        CUDA, never with `.item()` here). `step`: the step number (default: the guard's, see the module
        docstring; without an optimizer, previous + 1).
        """
        if self._closed:
            raise RuntimeError("Monitor.step() after close()")
        t0 = time.perf_counter()
        self._calls += 1
        if self.guard is not None:
            self._take_guard_step(step)
        else:
            self._step = self._step + 1 if step is None else int(step)
        self._drain(block=False)
        slot = self._take_slot()
        slot.step = self._step
        slot.call = self._calls
        slot.epoch = self.guard.restores if self.guard is not None else 0
        slot.checked = self._step % self.every == 0
        slot.wall_time = time.time()
        slot.step_s = t0 - self._last_step_end
        device_work = False
        if slot.checked:
            self._launch_check(slot)
            device_work = self._async
            if self._group is not None:
                self._latest_checked, self._latest_checked_call = slot, slot.call
        for i, x in enumerate((loss, grad_norm, loss_scale)):
            device_work |= self._stage_scalar(slot, i, x)
        slot.directive_row = None
        if self._agreeing and self._directive_async:   # the row rides this step's async pipeline
            self._poll_directives()
            self._launch_directive(slot)
            device_work = True
        slot.device_work = device_work
        if device_work:
            self._finish_on_copy_stream(slot)
        slot.busy = True
        slot.check_s = time.perf_counter() - t0
        self._pending.append(slot)
        if not self._async:
            self._drain(block=True)
        if self._canary is not None:
            self._run_canary(slot.step, slot.step_s)
        self._poll_directives()
        if self._agreeing and not self._directive_async:  # synchronous (gloo): reduced and read at once
            self._launch_directive(slot)
        if self._agreeing:
            self._directive_slot = slot
        self._last_step_end = time.perf_counter()

    def _take_guard_step(self, step: int | None) -> None:
        guard = self.guard
        assert guard is not None
        if guard.attempts == self._guard_attempts:
            guard.skip("optimizer.step() was not called before Monitor.step() (e.g. GradScaler found inf)")
        self._guard_attempts = guard.attempts
        if step is not None:
            guard.renumber(int(step))
        self._step = guard.step
        if guard.skipped_count != self._guard_skips:          # rare: report the vetoed steps
            new = guard.skipped_count - self._guard_skips
            self._guard_skips = guard.skipped_count
            for s in guard.skipped[-new:]:
                if s.stage:
                    self._event("step.skipped", s.step, f"step {s.step} skipped (weights unchanged): "
                                f"{s.stage} vetoed the update: {s.reason}",
                                {"stage": s.stage, "reason": s.reason})

    def _run_canary(self, step: int, step_s: float) -> None:
        """Between steps, on the training's stream, within its time budget; results are read a step later."""
        try:
            result = self._canary.maybe_run(step, step_s)
        except Exception as exc:  # the canary must never break training
            logger.warning("sdcwatch: in-job canary disabled after an error: %s", exc)
            self._canary = None
            return
        if result is None:
            return
        self._canary_result = (step, result)
        status = getattr(result.status, "value", str(result.status))
        if status == "FAIL":
            self._event("canary.fail", step, f"in-job canary {result.name} FAILED on rank {self.rank} "
                        f"({self.host} {self.gpu_uuid}): {result.why}",
                        {"check": result.name, "why": result.why, "rank": self.rank, "gpu_uuid": self.gpu_uuid})

    def _take_slot(self) -> _Slot:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot.busy:                 # in flight since len(slots) steps ago: wait for it (rarely blocks)
            self._drain(block=True, until=slot)
        return slot

    def _launch_check(self, slot: _Slot) -> None:
        if self._storages_moved():
            logger.info("sdcwatch: parameter storages were replaced (lazy init or a load); re-binding "
                        "the fingerprint to the new storages and re-taking the frozen baseline")
            self._bind_tensors()
            self._setup_words()
        for run, part in zip(self._runners, slot.local_parts):
            run(part)
        if self._group is None:
            slot.gathered.copy_(slot.local)          # async: on the stream; CPU: a plain copy
        elif self._async:
            slot.work = all_gather_single(slot.gathered, slot.local, group=self._group,
                                                    async_op=True)
        else:                                        # gloo: synchronous, on host tensors
            all_gather_single(slot.gathered, slot.local.cpu(), group=self._group)

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        assert self._optimizer is not None
        out: list[torch.Tensor] = []
        for _, state in param_states(self._optimizer):      # a container's: its optimizers' states
            for key in sorted(state, key=str):
                v = state[key]
                if torch.is_tensor(v) and v.numel() > 0:
                    lv = local_tensor(v)
                    if lv.device == self.device:
                        out.append(lv)
        return out

    def _grad_tensors(self) -> list[torch.Tensor]:
        return [local_tensor(p.grad) for _, p in self._params if p.grad is not None]

    def _stage_scalar(self, slot: _Slot, i: int, x: Any) -> bool:
        """Put scalar i in the slot; True if that queued device work."""
        if x is None:
            slot.kinds[i] = _NONE
            return False
        if torch.is_tensor(x):
            if x.numel() != 1:
                raise ValueError(f"{('loss', 'grad_norm', 'loss_scale')[i]} must be one value, "
                                 f"got a tensor of shape {tuple(x.shape)}")
            if self._async and x.device == self.device:
                slot.scalar_views[i].copy_(x.detach().reshape(1))
                slot.kinds[i] = _DEVICE
                return True
            # A CPU tensor: no GPU involved. (A CUDA tensor here means the synchronous fallback mode.)
            x = x.detach().reshape(()).item()
        slot.kinds[i] = _VALUE
        slot.values[i] = float(x)
        return False

    def _directive_row(self) -> tuple[list[int], torch.Tensor | None]:
        """This rank's row: the head of the oldest directive it holds that the ranks have not agreed on yet
        (zeros: none), and its reason as `REASON_WORDS` int64 words (a host tensor made once a directive)."""
        for d in self._directives:
            if int(d.event_seq) > self._agreed_seq:
                seq1 = int(d.event_seq) + 1
                if self._reason_words is None or self._reason_words[0] != seq1:
                    self._reason_words = (seq1, torch.tensor(encode_reason(d.reason), dtype=torch.int64))
                return [seq1, int(d.kind), int(d.target_step) + 1, int(d.skip_batches)], self._reason_words[1]
        return [0] * _N_HEAD, None

    def _launch_directive(self, slot: _Slot) -> None:
        """All_reduce (MAX) this rank's directive row over the world group, as part of this step. The reason's
        words are written only when they change (a directive held for several steps: once a slot)."""
        head, words = self._directive_row()
        if self._directive_async:
            assert slot.directive is not None and slot.directive_src is not None
            src = slot.directive_src      # pinned and free: its slot's previous copy has completed
            for i, x in enumerate(head):
                src[i] = x
            if slot.src_seq != head[0]:
                if words is not None:
                    src[_N_HEAD:].copy_(words)
                else:
                    src[_N_HEAD:].zero_()
                slot.src_seq = head[0]
            slot.directive.copy_(src, non_blocking=True)
            slot.directive_work = dist.all_reduce(slot.directive, op=dist.ReduceOp.MAX, async_op=True)
            return
        t = self._directive_sync          # gloo: host tensors, synchronous; NCCL with host buffers: syncs
        for i, x in enumerate(head):
            t[i] = x
        if words is not None:
            t[_N_HEAD:].copy_(words)
        elif self._sync_words:            # the last MAX left another rank's reason there
            t[_N_HEAD:].zero_()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slot.directive_row = tuple(int(x) for x in t.tolist())
        self._sync_words = slot.directive_row[0] != 0

    def _finish_on_copy_stream(self, slot: _Slot) -> None:
        assert self._copy_stream is not None
        main = torch.cuda.current_stream(self.device)
        slot.ready.record(main)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(slot.ready)
            if slot.work is not None:
                slot.work.wait()        # the copy stream waits for the gather (no host wait on NCCL)
                slot.work = None
            if slot.directive_work is not None:
                slot.directive_work.wait()   # and for the directive all_reduce (kept for _read)
            slot.host.copy_(slot.dev, non_blocking=True)
            slot.done.record(self._copy_stream)

    # ---- reading results (host side) -------------------------------------------------------------

    def _drain(self, block: bool, until: _Slot | None = None) -> None:
        while self._pending:
            slot = self._pending[0]
            if slot.device_work:
                if not slot.done.query():
                    if not block:
                        return
                    slot.done.synchronize()
            self._pending.popleft()
            slot.busy = False
            try:
                self._read(slot)
            except Exception:  # reading/reporting must never break training; said once, then counted
                self._read_errors += 1
                if self._read_errors == 1:
                    logger.exception("sdcwatch: failed to read the check of step %d (said once)", slot.step)
            if until is not None and slot is until:
                return

    @staticmethod
    def _has_device(slot: _Slot) -> bool:
        return _DEVICE in slot.kinds

    def _read(self, slot: _Slot) -> None:
        n = len(slot.host)
        at = len(self._group_ranks) * self._v
        scalars = slot.host[at:at + _N_SCALARS].view(torch.float64).tolist() if self._has_device(slot) else None
        if slot.directive_work is not None:     # the world MAX of this step's directive rows, now on the host
            slot.directive_work = None
            slot.directive_row = tuple(int(x) for x in slot.host[n - _N_DIRECTIVE:].tolist())
        values: list[float | None] = []
        for i in range(_N_SCALARS):
            kind = slot.kinds[i]
            values.append(None if kind == _NONE else
                          slot.values[i] if kind == _VALUE else float(scalars[i]))  # type: ignore[index]
        loss, grad_norm, loss_scale = values
        self._check_finite(slot.step, loss, grad_norm)
        mine: list[int] = []
        frozen_changed: list[str] = []
        step_vote: StepVote | None = None
        if slot.checked:
            self._checks_run += 1
            g, v = len(self._group_ranks), self._v
            flat = [w & _U64 for w in slot.host[: g * v].tolist()]
            rows = [tuple(flat[i * v:(i + 1) * v]) for i in range(g)]
            mine = list(rows[self._group_rank])
            frozen_changed = self._check_frozen(slot.step, mine)
            if self._group is not None:
                step_vote = self._take_vote(slot.step, rows, slot.call, slot.epoch)
        self._report(slot, loss, grad_norm, loss_scale, mine, step_vote, frozen_changed)

    def _check_finite(self, step: int, loss: float | None, grad_norm: float | None) -> None:
        bad = [(k, x) for k, x in (("loss", loss), ("grad_norm", grad_norm))
               if x is not None and not math.isfinite(x)]
        if not bad:
            return
        self._nonfinite += 1
        for kind, x in bad:
            self._event(f"nonfinite.{kind}", step, f"{kind} is {x} at step {step}", {kind: str(x)},
                        log=self._nonfinite == 1 or self._nonfinite % _NONFINITE_LOG_EVERY == 0)

    def _check_frozen(self, step: int, mine: list[int]) -> list[str]:
        if self._frozen_at < 0:
            return []
        now = tuple(mine[self._frozen_at:self._frozen_at + self._w])
        if now == self._frozen_baseline:
            return []
        # Rare path (an SDC signal): name the changed tensors, one fingerprint each, then re-baseline.
        each = self._per_tensor_words(self._frozen_tensors)
        names = [n for (n, _), a, b in zip(self._frozen, self._frozen_each, each) if a != b]
        self._frozen_each = each
        self._frozen_baseline = self._words(self._fp(self._frozen_tensors))
        names = names or ["<frozen set>"]
        self._frozen_changes += 1
        self._event("frozen.changed", step,
                    f"frozen parameter(s) changed at step {step} on rank {self.rank} "
                    f"({self.host} {self.gpu_uuid}): {', '.join(names[:5])}",
                    {"names": names, "rank": self.rank, "host": self.host, "gpu_uuid": self.gpu_uuid})
        return names

    def _take_vote(self, step: int, rows: list[tuple[int, ...]], call: int = 0, epoch: int = 0) -> StepVote:
        result = vote({r: rows[i] for i, r in enumerate(self._group_ranks)}, self._where)
        self._votes += 1
        sv = StepVote(step=step, result=result, replica_group=self.replica_group_name,
                      ranks=self._group_ranks, epoch=epoch)
        self._last_vote = sv
        self._recent_votes.append((call, sv))
        if not result.agreed:
            self._mismatches += 1
            if result.suspect_ranks != self._last_suspects:
                who = "; ".join(f"rank {s.rank} ({s.host} {s.gpu_uuid or '-'})" for s in result.suspects)
                self._event("replica.mismatch", step,
                            f"replica fingerprints disagree at step {step} ({result.method}, "
                            f"{result.replicas} replicas); suspect: {who}",
                            {"method": result.method, "replicas": result.replicas,
                             "replica_group": self.replica_group_name,
                             "suspects": [{"rank": s.rank, "host": s.host, "gpu_uuid": s.gpu_uuid}
                                          for s in result.suspects]})
        self._last_suspects = result.suspect_ranks
        return sv

    def _event(self, kind: str, step: int, message: str, details: Mapping[str, Any], log: bool = True) -> None:
        self._events.append(MonitorEvent(kind=kind, step=step, message=message, details=details,
                                         time=time.time()))
        if log:
            logger.warning("sdcwatch [%s] %s", kind, message)

    # ---- reporting and directives ----------------------------------------------------------------

    def _report(self, slot: _Slot, loss: float | None, grad_norm: float | None, loss_scale: float | None,
                mine: list[int], step_vote: StepVote | None, frozen_changed: list[str]) -> None:
        if self._reporter is None:
            return
        try:
            canary = None
            if self._canary_result is not None:
                cstep, cres = self._canary_result
                self._canary_result = None
                canary = CanaryReport(step=cstep, check=cres.name, why=cres.why or "",
                                      status=str(getattr(cres.status, "value", cres.status)))
            self._reporter.submit(StepReport(
                job_id=self.job_id, rank=self.rank, world_size=self.world_size, step=slot.step,
                time=slot.wall_time, host=self.host, gpu_uuid=self.gpu_uuid, replica_group=self.replica_group_name,
                fingerprint=tuple(mine), frozen_changed=tuple(frozen_changed), checks_run=self._checks_run,
                loss=loss, grad_norm=grad_norm, loss_scale=loss_scale, step_s=slot.step_s, check_s=slot.check_s,
                vote=None if step_vote is None else step_vote.result, canary=canary,
                compute=self._compute_findings() if self._compute_findings is not None else (),
                compute_checks=self._compute_mode() if self._compute_mode is not None else "",
                vote_unavailable=self.vote_unavailable,
                stage_errors=self.guard.stats.errors if self.guard is not None else 0,
                stage_error=self.guard.last_error if self.guard is not None else ""))
            if not self._agent_down_said:
                stats = self._reporter.stats()
                if stats.agent_down:
                    self._agent_down_said = True
                    self._event("agent.unreachable", slot.step,
                                f"the sdcwatch agent is not answering ({stats.last_error}); "
                                "training continues, reports are dropped and counted", {}, log=False)
        except Exception:
            if not self._report_error_said:
                self._report_error_said = True
                logger.exception("sdcwatch: could not report step %d to the agent (said once)", slot.step)

    def report_compute(self, take: Callable[[], tuple[ComputeFinding, ...]], mode: Callable[[], str]) -> None:
        """Put what `take()` returns (the compute gate's new findings) and `mode()` (its replay mode) on each
        step report."""
        self._compute_findings = take
        self._compute_mode = mode

    def _poll_directives(self) -> None:
        if self._reporter is None:
            return
        for d in self._reporter.take_directives():
            seq = int(getattr(d, "event_seq", 0))
            if seq:
                if seq in self._seen_directive_seqs:
                    continue
                self._seen_directive_seqs.append(seq)
            self._directives.append(d)
            self._event("directive", self._step, f"agent directive {d.kind} target_step={d.target_step} "
                        f"skip_batches={d.skip_batches}: {d.reason}",
                        {"kind": int(d.kind), "target_step": int(d.target_step),
                         "skip_batches": int(d.skip_batches), "reason": d.reason, "event_seq": seq})
            if self._on_directive is not None:
                self._on_directive(d)

    # ---- public state ----------------------------------------------------------------------------

    def pending_directive(self) -> Directive | None:
        """The oldest directive from the agent not yet taken (a `checksums.reporter.Directive`), or None."""
        return self._directives.popleft() if self._directives else None

    def agreed_directive(self) -> Directive | None:
        """A directive every rank acts on at the same iteration (call it on every rank at the same point of
        the loop, e.g. after `step()`). The agent hands a directive to each rank in its own next reply, so
        ranks see it at different iterations; acting on `pending_directive()` alone would restore some ranks
        a step before the others. Each `step()` carries this rank's directive row (event seq, kind, target,
        skip of the oldest directive it holds and the ranks have not agreed on) in the step's pipeline: an
        all_reduce (MAX) over the world group, on NCCL asynchronous and copied to pinned host memory with the
        vote. Here the ranks read the same step's result, so all get the directive at the same call, once; a
        copy that reaches a rank later is ignored. No collective and no host synchronisation of its own.

        Which step's result: on CUDA (NCCL) the previous `step()`'s, so a directive is acted on one step later
        than it reaches the last rank that needed it (it waits for that step's copy only if the GPU runs more
        than a step behind the host, like the vote's ring); on CPU (gloo) the last `step()`'s, read at once.
        The first call switches the rows on (every rank calls it at the same point, so they switch together);
        it returns None. Calling it every few steps is fine: a directive waits in the rows until read.
        Without torch.distributed or with one rank: `pending_directive()`."""
        self._poll_directives()
        if not self._directive_world:
            return self._directives.popleft() if self._directives else None
        if not self._agreeing:
            self._agreeing = True
            return None
        slot = self._directive_slot
        if slot is None:
            return None
        if self._directive_async:
            if slot is self._slots[(self._next - 1) % len(self._slots)]:   # the newest step: read the one before
                slot = self._slots[(self._next - 2) % len(self._slots)]
            if slot.busy:             # normally read already; else wait for that step's copy (as the ring does)
                self._drain(block=True, until=slot)
        row = slot.directive_row
        if row is None:
            return None
        seq1, kind, target1, skip = row[:_N_HEAD]
        if seq1 == 0 or seq1 - 1 <= self._agreed_seq:
            return None
        self._agreed_seq = seq = seq1 - 1
        self._seen_directive_seqs.append(seq)          # its copy, arriving later here, is not acted on again
        mine = next((d for d in self._directives if int(d.event_seq) == seq), None)
        self._directives = collections.deque((d for d in self._directives if int(d.event_seq) > seq), maxlen=64)
        # a rank the agent has not handed it yet (its reply comes later on a busy host) reads the reason the
        # holders sent in the row
        reason = mine.reason if mine is not None else decode_reason(row[_N_HEAD:]) or "agreed across the ranks"
        return Directive(kind=kind, target_step=target1 - 1, skip_batches=skip, reason=reason, event_seq=seq)

    @property
    def events(self) -> list[MonitorEvent]:
        return list(self._events)

    @property
    def replica_group(self) -> Any:
        """The process group the replica vote runs over, or None (no replicas, or the vote is off)."""
        return self._group

    def mesh_peer_groups(self) -> list[Any]:
        """HSDP: the process groups of the parameters' mesh dims other than the replicate one (the shard
        dim): the ranks that step the same model holding its other shards, each voting in its own replica
        group. [] for DDP (no DTensor parameters), plain FSDP (no replicate dim) or dims of one rank. Known
        whether or not this rank's vote is on, so every rank of the mesh answers alike."""
        sharded = self._sharded()
        if sharded is None or len(sharded[1]) != 1:
            return []
        (p, (replicate,)) = sharded
        mesh = p.device_mesh
        return [mesh.get_group(mesh_dim=d) for d in range(mesh.ndim) if d != replicate and mesh.size(d) > 1]

    @property
    def last_vote(self) -> StepVote | None:
        return self._last_vote

    @property
    def step_count(self) -> int:
        return self._step

    # ---- for a device-side gate (checksums/replica_recovery.py) ----------------------------------------

    @property
    def step_calls(self) -> int:
        """`step()` calls so far; a vote is numbered by the call that launched it (`recent_votes`)."""
        return self._calls

    @property
    def vote_lag(self) -> int:
        """Every rank has read the vote launched by call c once call c + `vote_lag` has returned, without any
        wait of its own: on CUDA the ring of in-flight steps (a call reuses the slot of `vote_lag` calls ago,
        reading it first if it is still in flight); on CPU 0 (read in the call that launched it)."""
        return len(self._slots) if self._async else 0

    @property
    def recent_votes(self) -> list[tuple[int, StepVote]]:
        """The newest votes read on the host (up to 16), oldest first, each with the call that launched it."""
        return list(self._recent_votes)

    def latest_vote_words(self) -> LatestVote | None:
        """(step, call, words, epoch) of the newest fingerprint check with a vote, read or not: `words` is its
        gathered fingerprints, [replicas, V] int64 on the Monitor's buffer device; `epoch` the guard's restore
        epoch at its launch (a vote of an older epoch is about weights a restore left). On CUDA the current
        stream is made to wait for that gather (a device-side wait: no host synchronisation), so device work
        queued after this call may read `words` until the slot is reused (`vote_lag` calls later). None before
        the first check, without a vote, or once the slot holds a newer step."""
        slot = self._latest_checked
        if slot is None or slot.call != self._latest_checked_call or not slot.checked:
            return None
        if slot.device_work and slot.done is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.done)
        words = slot.gathered.view(len(self._group_ranks), self._v)
        return LatestVote(slot.step, slot.call, words, slot.epoch)

    @property
    def stats(self) -> MonitorStats:
        r = self._reporter.stats() if self._reporter is not None else ReporterStats()
        return MonitorStats(
            steps=self._calls, checks_run=self._checks_run, votes=self._votes, mismatches=self._mismatches,
            frozen_changes=self._frozen_changes, nonfinite=self._nonfinite, reports_sent=r.sent,
            reports_dropped=r.dropped, reports_failed=r.failed, agent_down=r.agent_down)

    def flush(self) -> None:
        """Read every step still in flight (waits for the GPU). For the end of training, not the step."""
        self._drain(block=True)
        self._poll_directives()

    def close(self, timeout: float = 2.0) -> None:
        """Flush, then close the reporter if the Monitor created it. Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._own_reporter is not None:
            self._own_reporter.close(timeout)
