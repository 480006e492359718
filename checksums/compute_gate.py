"""The compute gate: pre-reduction checks every step, replay audits every K steps, a veto before the update.

    checks = ComputeChecks.attach(ddp_model, optimizer, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    for batch in loader:
        checks.retain(batch)                  # the replayable step: the batch and the RNG state
        loss_fn(ddp_model, batch).backward()  # the DDP hook summarises each bucket before its all-reduce
        optimizer.step()                      # GATE: the ranks compare; a suspect step is replayed, classified,
        optimizer.zero_grad()                 #       and applied or dropped (a Veto keeps the step's number)

The stage (`name="compute"`, `Phase.GATE`) runs on every rank in the same order, so its collectives pair
up: one all-gather of the bucket summaries every step (checksums.grad_checks), the robust comparison, and,
only when a rank is an outlier, has a non-finite value or is due for an audit, the replays of
checksums.replay. Every rank reaches the same verdict from the same gathered rows, so all drop or all
apply. A step is replayed at most once per suspect and never retried: the gate never loops.

How the update is masked (`mask=`). "host" (gloo/CPU; the default without a fused optimizer): the gather
is synchronous and the verdict is on the host before `optimizer.step()`; a suspect step's update is vetoed
through the step guard (`Veto`), its number kept. "device" (the default on CUDA with a fused optimizer,
e.g. `torch.optim.Adam(fused=True)`): the gather and the comparison (checksums.device_verdict's `device_flag`, the same rule as the
host's) are device ops, and the verdict is a 0-d float flag set as `optimizer.found_inf`, which a fused
optimizer honours on the device exactly as it does GradScaler's (parameters, moments and step count left
unchanged; combined with the scaler's flag when there is one; the AFTER stage takes it back: the shared
mechanism of checksums/device_mask.py, which the replica vote's gate uses too): no host
synchronisation in the step. The rows travel to pinned host memory without waiting; the next step reads
them (`_settle_previous`), learns the spread, and replays and classifies a masked step from its retained
batch (its weights are unchanged, the masked update changed nothing). A masked step classified DATA there
is lost rather than applied late. A step settled after a restore or a replica repair (`StepGuard.rewrites`
moved: a rollback loaded other weights, or ReplicaRecovery copied a majority's) is not replayed: its verdict
gates nothing after. Audit steps (every `audit_every`) take the host path: one synchronisation per audit.
Cost of the device path per step: the bucket summaries (a norm, a max-abs and the fingerprint kernel per
bucket), one all-gather of 32 bytes per bucket per rank, and a handful of tiny
kernels (median, log, compare) for the flag, replayed as one CUDA graph once the spread is learnt
(checksums.device_verdict). With the C++ comm hook (DDP on CUDA) the gather, the graph's replay and the copies
to pinned memory all run in the hook, right after its last bucket's all-reduce (`_arm_finish`): the stage
before the update then takes the slot the hook filled and makes its stream wait once. In both forms a
step's verdict reads the device's spread as the last AFTER stage copied it, on every rank alike.

FSDP2 (`fully_shard`): the rows come from a custom reduce-scatter (checksums.grad_checks.FsdpGradSummaries)
and replays are collective (checksums.fsdp_replay: every rank replays at once; an audit step audits every
rank); `witness_model=` (a factory of the bare model) gives two ranks their CPU witness.

FSDP2/HSDP with tensor parallelism (a tp mesh dim in the parameters' DTensor mesh): each tp group is one
data-parallel rank here (checksums.tp_lanes: its lanes' rows side by side, every decision gathered over the
whole mesh, batches within a lane); a finding names the group's GPUs, `one_of`. Context parallelism
(`context_parallel=` the cp DeviceMesh, or a mesh dim named "cp" beside FSDP's) joins each cp group (and its
tp groups) into one such group, each rank retaining its own chunk of the sequence; expert parallelism
(`expert_parallel=`, the experts' DTensor mesh dim "ep", or ranks named "ep" beside FSDP's) joins each ep
group alike, each rank retaining its own batch (its tokens go to the experts' ranks and back inside every
MoE layer); pipeline parallelism (`pipeline_parallel=`, or a mesh dim named "pp" beside FSDP's) joins each
pp group (one rank of every stage), its stages' rows side by side, and replays rerun the loop's schedule
(`step_fn=`, given instead of `loss_fn=`). DDP with tensor parallelism, or with `context_parallel=`,
`expert_parallel=`, `pipeline_parallel=` or `step_fn=`, is refused at attach (context or expert parallelism
the checks are not told of: the first step's check finds replays do not reproduce and turns them off; a
stage of a pipeline found with `loss_fn=`, or `step_fn=` where FSDP's mesh holds part of the job and no pp
group says who holds the rest: refused at attach).

Loss scaling: a loop that back-propagates `scaler.scale(loss)` (a `torch.amp.GradScaler`) passes `scaler=`;
replays multiply `loss_fn`'s loss by the scale the step ran under (checksums.replay), so they reproduce the
step bit for bit, and a rank whose scaled gradient overflowed is cleared as DATA (the overflow reproduces
everywhere; the scaler skips the step itself). At the first step the replay of rank 0's batch is compared
with that step's own rows: when it does not reproduce them (no `scaler=` under a scaler, a `loss_fn` that
is not what the loop back-propagates), no GPU is named on the evidence of a replay: audits stop, and a
suspect step is dropped without a finding; an error in the log and GetStatus's compute mode
("unreproducible: ...") say why.

torch's composable `replicate()` (torchtitan's DDP: no `.module` wrapper, its DDP made at the first
forward) is checked through the DDP it keeps inside, made at attach (checksums.composable_ddp); replays run
the model without replicate's hooks.

DDP takes one communication hook, and the checks are one: a job that reduces through its own
(`bf16_compress_hook`, PowerSGD, ...) passes it as `comm_hook=` (and `comm_state=`) instead of registering
it; each bucket is summarised, then handed to it (checksums.grad_checks.GradSummaries).

MoE experts (DDP): a bucket holding only experts' parameters (`experts=`, a predicate on the parameter's
name; by default a name with an `experts` or `local_experts` part, not `shared_experts`, as Mixtral, Qwen-MoE,
DeepSeek and Megatron name them) is exactly zero on a rank none of whose tokens chose those experts. Once
DDP's bucket layout has settled such buckets are declared zeroable to the spread
(`SpreadTracker.declare_zeroable`): a zero there is the data's from the start, not a suspicion the first
time it happens after the warm-up (a lost update under the device mask). `experts=None`: learnt only.

Findings (`ComputeFinding`) name the faulty rank with its host and GPU UUID and the evidence; with
`monitor=` the Monitor's next step report carries them to the agent (ReportStepRequest.compute). Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import socket
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checksums.composable_ddp import hooks_off, inner_ddp, qualified_names
from checksums.device_mask import DeviceMask, choose_mask
from checksums.device_verdict import DeviceVerdict
from checksums.collectives import gathered_fingerprints
from checksums.fsdp_replay import FsdpReplayer
from checksums.grad_checks import (
    FsdpGradSummaries,
    GradSummaries,
    SpreadTracker,
    StatsVerdict,
    fsdp_mesh,
    fsdp_roots,
    fsdp_shard_size,
    model_parallel_dims,
    stats_of,
)
from checksums.host_ring import HostRing, HostSlot, batch_stats
from checksums.replay import Cause, Classification, LossFn, ReplayFailed, Replayer, Retained
from checksums.reporter import ComputeFinding
from checksums.step_guard import Phase, StepContext, StepGuard, Veto
from checksums.lane_witness import lane_witness
from checksums.tp_lanes import Lanes, find_lanes, group_of, named_ranks
from sdcwatch.arguments import count, function, wire_name
from sdcwatch.names import GPU_UUID, HOST

logger = logging.getLogger(__name__)

NO_BATCH = "no batch retained: call checks.retain(batch) before each forward"
DEFAULT_AUDIT_EVERY = 334      # one replay per 334 steps: <= 0.3% when a replay costs about one step
DEFAULT_WARMUP = 20            # steps whose bucket statistics only teach the spread (no rank judged)
LEARN_BATCH = 8                # the device path's unmasked steps learnt at once, once the spread is armed
RING_BYTES = 32 << 20          # at most this much pinned host memory for the rows waiting to be learnt
# SDCWATCH_HOOK_VERDICT=0 keeps the device verdict's replay in the step guard (`_arm_finish`)
_HOOK_VERDICT = os.environ.get("SDCWATCH_HOOK_VERDICT", "1") != "0"


# what a job whose replays do not reproduce may have left out
_UNREPRODUCIBLE_HINT = (". If the loop splits each sequence over ranks (context parallelism, FSDP2), pass "
                        "context_parallel=world_mesh['cp']; if an MoE's experts are split over ranks (expert "
                        "parallelism), expert_parallel=world_mesh['ep']; if it runs its forward and backward "
                        "inside a context (one that turns context parallelism's attention on, an sdpa_kernel "
                        "choice), pass replay_context= a function returning it")


_TOGETHER = {"cp": ("context_parallel", "context parallelism"),
             "ep": ("expert_parallel", "expert parallelism"),
             "pp": ("pipeline_parallel", "pipeline parallelism")}


def _ranks_together(given: Any, mesh: Any, fsdp: bool, dim: str = "cp") -> Any:
    """The ranks named `dim` that compute one replica together (context parallelism's "cp" and expert
    parallelism's "ep", each rank on its own data; pipeline parallelism's "pp", each rank one stage of the
    model): `given` (context_parallel= / expert_parallel= / pipeline_parallel=: a 1-D DeviceMesh or a
    ProcessGroup), else ranks named `dim` beside FSDP's `mesh` (`named_ranks`), else None."""
    arg, what = _TOGETHER[dim]
    if given is None:
        found = named_ranks(mesh, dim) if mesh is not None else None
        if found is not None:
            logger.info("sdcwatch: compute checks: %s over the ranks named '%s' (%d a group): each %s group "
                        "is checked as one replica", what, dim, found.size(), dim)
        return found
    if hasattr(given, "get_group"):
        if given.ndim != 1:
            raise ValueError(f"{arg}= takes the {dim} dim's 1-D DeviceMesh (world_mesh['{dim}']), got "
                             f"a {given.ndim}-D mesh {given.mesh_dim_names}")
    elif not isinstance(given, dist.ProcessGroup):
        raise ValueError(f"{arg}= takes the {dim} DeviceMesh (world_mesh['{dim}']) or its ProcessGroup, "
                         f"got {type(given).__name__}")
    if not fsdp:
        raise ValueError(f"ComputeChecks: {arg}= under DDP: a {dim} group's forward is a collective "
                         "of its ranks, while DDP's checks replay per rank. Supported with FSDP2 "
                         + ("(fully_shard over each stage's data-parallel ranks, torchtitan's layout)"
                            if dim == "pp" else
                            f"(fully_shard over the data-parallel and {dim} ranks, torchtitan's layout)"))
    if (given.size() if hasattr(given, "get_group") else dist.get_world_size(given)) < 2:
        return None
    return given


def _expert_parallel(given: Any, module: nn.Module, mesh: Any, fsdp: bool, split: list[str]) -> Any:
    """The expert-parallel ranks (each its own batch, the experts split over them, tokens exchanged inside
    each MoE layer), checked as one replica: `given` (expert_parallel=), else the dim "ep" of the experts'
    DTensor mesh (torchtitan's experts, Shard(0) over ep: `split` names it), else ranks named "ep" beside
    FSDP's mesh (`named_ranks`), else None."""
    if given is None and "ep" in split:         # (split names it: some parameter is a DTensor over "ep")
        for p in module.parameters():
            if "ep" in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()):
                logger.info("sdcwatch: compute checks: expert parallelism over the experts' mesh dim 'ep' "
                            "(%d ranks a group): each ep group is checked as one replica",
                            p.device_mesh["ep"].size())
                return p.device_mesh["ep"]
    return _ranks_together(given, mesh, fsdp, "ep")


def expert_param(name: str) -> bool:
    """The default `experts=`: a parameter of an MoE layer's routed experts, by its qualified name (a part
    `experts` or ending in `_experts`, as `layers.0.block_sparse_moe.experts.3.w1.weight` or Megatron's
    `local_experts`; not `shared_experts`, which every token uses)."""
    return any(part == "experts" or (part.endswith("_experts") and not part.startswith("shared"))
               for part in name.split("."))


@dataclasses.dataclass(frozen=True, slots=True)
class ComputeStatus:
    exact: bool                # replays compare exact fingerprints (False: the rounding-aware bound)
    steps: int
    suspicions: int
    dropped: int
    audits: int
    replays: int
    audit_every: int
    spread_max: float          # the largest learned clean spread (log units) over buckets and statistics
    max_score_clean: float     # the largest score of a clean step after warm-up (units of the spread)
    margin: float
    hook_gathers: int = 0      # steps whose rows the C++ comm hook all-gathered (not the step guard)
    hook_verdicts: int = 0     # steps whose device verdict the C++ comm hook replayed after its gather


class ComputeChecks:
    """The GATE stage of the compute checks (see the module docstring). Build with `ComputeChecks.attach`."""

    name = "compute"
    phase = Phase.GATE
    lanes: Lanes | None = None     # FSDP2 + tensor parallelism: this rank's place (checksums.tp_lanes)

    def __init__(self, ddp: nn.Module, optimizer: torch.optim.Optimizer, *, loss_fn: LossFn | None = None,
                 margin: float = 3.0, warmup: int = DEFAULT_WARMUP, audit_every: int = DEFAULT_AUDIT_EVERY,
                 group: Any = None, host: str | None = None, gpu_uuid: str = "",
                 mask: str = "auto", monitor: Any = None, inject_bucket: Callable[[int, torch.Tensor], None] | None = None,
                 max_findings: int = 1000, witness_model: Callable[[], nn.Module] | None = None,
                 comm_hook: Callable[[Any, Any], Any] | None = None, comm_state: Any = None,
                 side_stream: bool | None = None, scaler: Any = None,
                 experts: Callable[[str], bool] | None = expert_param, native: bool | None = None,
                 context_parallel: Any = None, replay_context: Callable[[], Any] | None = None,
                 expert_parallel: Any = None, pipeline_parallel: Any = None,
                 step_fn: Callable[[nn.Module, Any], Any] | None = None) -> None:
        function("loss_fn", loss_fn, optional=step_fn is not None,
                 why="it recomputes a step's loss for the replays: (model, batch) -> loss tensor; or pass "
                 "step_fn=")
        function("step_fn", step_fn, why="it reruns a step's forward and backward for the replays, as the "
                 "loop runs them (a pipeline schedule's step): (model, batch) -> None")
        if loss_fn is not None and step_fn is not None:
            raise ValueError("ComputeChecks: pass loss_fn= (the replays back-propagate its loss) or step_fn= "
                             "(it runs the forward and backward itself), not both")
        function("experts", experts, why="a predicate on a parameter's qualified name (name -> bool), or None")
        function("replay_context", replay_context, why="it makes the context manager each replay's forward "
                 "and backward run in, as the loop's own do: () -> context manager")
        wire_name("host", host, HOST)
        wire_name("gpu_uuid", gpu_uuid, GPU_UUID)
        gpu_uuid = gpu_uuid or ""           # None as the Monitor takes it: not known
        audit_every = count("audit_every", audit_every, "a number of steps (0: no audits)")
        max_findings = count("max_findings", max_findings, "the findings kept for GetStatus")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("ComputeChecks compares the ranks of a data-parallel job: call "
                             "torch.distributed.init_process_group and wrap the model in DistributedDataParallel "
                             "or fully_shard first (a single process: world size 1 works)")
        # FSDP2: a fully_shard module, or a container of them with no parameter of its own (a rank's model
        # parts: an interleaved pipeline's virtual stages)
        self.fsdp = bool(fsdp_roots(ddp))
        split = model_parallel_dims(ddp, self.fsdp)
        if split and not self.fsdp:   # before any hook or collective: every rank refuses alike
            raise ValueError(
                f"ComputeChecks: the model is also split across ranks over {split} (tensor, sequence or context "
                "parallelism) under DDP: its forward is a collective of those ranks, while the checks' "
                "replays and verdicts would be per data-parallel group (a stalled or corrupted step). "
                "Supported with FSDP2 (fully_shard over the data-parallel mesh dims, as torchtitan lays it "
                "out); under DDP the checks refuse here rather than stall the job later")
        if step_fn is not None and not self.fsdp:
            raise ValueError("ComputeChecks: step_fn= replays a step through the model's own backward, a "
                             "collective of every rank: supported with FSDP2 (fully_shard); under DDP pass "
                             "loss_fn=")
        dp_mesh = fsdp_mesh(ddp) if self.fsdp else None
        if self.fsdp and fsdp_shard_size(ddp) == 1:
            # (FSDP2 runs no reduce-scatter over one rank, so its custom one, which summarises each group's
            # gradient, is never called: every step's check would fail)
            shape = tuple(dp_mesh.mesh.shape) if dp_mesh is not None else "?"
            raise ValueError(f"ComputeChecks: FSDP2 shards over one rank here (its mesh {shape} "
                             f"{getattr(dp_mesh, 'mesh_dim_names', None)}): it makes no reduce-scatter, "
                             "which the checks read each group's gradient from (one process, HSDP with "
                             "shards of one rank, FSDP2's replicate(), a pipeline stage without data "
                             "parallelism). Shard over 2 or more ranks, or use DistributedDataParallel")
        pp = _ranks_together(pipeline_parallel, dp_mesh, self.fsdp, "pp")
        if pp is not None and step_fn is None:
            raise ValueError("ComputeChecks: this rank holds one stage of a pipeline (pipeline parallelism "
                             f"over ranks {dist.get_process_group_ranks(group_of(pp))}): a replay reruns "
                             "the pipeline's step, so pass step_fn= (model, batch) -> None running the "
                             "loop's schedule.step on that batch, not loss_fn=")
        if pp is not None and witness_model is not None:
            raise ValueError("ComputeChecks: witness_model= rebuilds the whole model on one CPU; a pipeline "
                             "stage holds part of it: leave it out (the op witness names a GPU)")
        cp = _ranks_together(context_parallel, dp_mesh, self.fsdp)
        ep = _expert_parallel(expert_parallel, ddp, dp_mesh, self.fsdp, split)
        if (step_fn is not None and pp is None and not split and cp is None and ep is None
                and dp_mesh is not None and dp_mesh.mesh.numel() < dist.get_world_size()):
            # (a step_fn's forward reaches ranks FSDP's mesh does not hold: a pipeline the checks were not
            # told of would replay on some stages only, and wait for the others for ever)
            raise ValueError(f"ComputeChecks: step_fn= with FSDP's mesh holding {dp_mesh.mesh.numel()} of "
                             f"the job's {dist.get_world_size()} ranks: if this rank holds one stage of a "
                             "pipeline, pass pipeline_parallel= (the pp dim's DeviceMesh, "
                             "world_mesh['pp'], or its ProcessGroup)")
        if ep is not None:       # the experts' ep dim: ranks with their own batches, not a tp lane split
            split = [d for d in split if d not in (getattr(ep, "mesh_dim_names", None) or ("ep",))]
        # FSDP2 + tensor, context, expert or pipeline parallelism: a tp (cp, ep, pp) group is one
        # data-parallel rank to the checks (checksums.tp_lanes)
        self.lanes = (find_lanes(ddp, dp_mesh, split, group, cp, ep, pp)
                      if split or cp is not None or ep is not None or pp is not None else None)
        if self.lanes is not None:
            group = self.lanes.dp_group
        self.group = group
        self.wide = None if self.lanes is not None else group    # where every decision is agreed: the mesh
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if comm_hook is not None and self.fsdp:
            raise ValueError("comm_hook= is DDP's (a communication hook per bucket); FSDP2 reduces through its "
                             "reduce-scatter")
        # what the caller passed is checked before the hook goes on the model: DDP takes one hook and
        # cannot take it back, so a refused attach must leave the model as it was (a retry with the
        # error's advice would otherwise be refused as "already has a communication hook")
        first = next((p for p in ddp.parameters() if p.requires_grad), None)   # the hook's params[0]
        device = first.device if first is not None else torch.device("cpu")
        self.device = device
        self.mask = _choose_mask(mask, optimizer, device)
        self.tracker = SpreadTracker(margin=margin, warmup=warmup)      # (checks margin and warmup)
        if self.fsdp:                  # FSDP2: the rows before each reduce-scatter; collective replays
            self.summaries: Any = FsdpGradSummaries(ddp, group=group, inject=inject_bucket, lanes=self.lanes)
            if self.lanes is not None:     # each lane's FSDP groups (a pipeline's stages count differently)
                self.lanes = self.summaries.lanes = self.lanes.sized(len(self.summaries.groups))
        else:
            inner = inner_ddp(ddp)       # torch's composable replicate() (torchtitan's DDP): the DDP it keeps
            self.summaries = GradSummaries(inner if inner is not None else ddp, group=group,
                                           inject=inject_bucket, comm_hook=comm_hook, comm_state=comm_state,
                                           side_stream=side_stream, native=native)
            if inner is not None:        # its parameters' names in the model; replays without its hooks
                self.summaries.names = qualified_names(ddp, self.summaries.params)
                replay_context = _without_replicate_hooks(ddp, replay_context)
        self.replayer: Replayer = (
            FsdpReplayer(ddp, self.summaries, loss_fn, device=device, group=group,
                         witness_model=witness_model, scaler=scaler, lanes=self.lanes,
                         context=replay_context, step_fn=step_fn) if self.fsdp else
            Replayer(getattr(ddp, "module", ddp), self.summaries, loss_fn, device=device, group=group,
                     scaler=scaler, context=replay_context))
        if self.replayer.cross_rank:
            logger.warning("sdcwatch: compute checks: %d SyncBatchNorm layer(s) (%s) normalise by every rank's "
                           "batch, so no replay can reproduce a step: the statistics checks run every step, "
                           "audits and replays are off, a suspect step is dropped without naming a GPU "
                           "(GetStatus: compute mode 'unreproducible'). BatchNorm or GroupNorm keep replays.",
                           len(self.replayer.cross_rank), self.replayer.cross_rank[0])
        # the experts' parameters (indices into the hook's `params`, by its `names`), declared zeroable
        # bucket by bucket once DDP's layout settles (`_declare_experts`); FSDP2's groups are whole layers
        # (never zero on a rank), so only DDP
        self._experts: frozenset[int] = frozenset()
        if experts is not None and not self.fsdp:
            self._experts = frozenset(i for i, n in enumerate(self.summaries.names) if experts(n))
        self.expert_buckets: tuple[int, ...] | None = None if self._experts else ()
        self.audit_every = audit_every
        where: list[Any] = [None] * dist.get_world_size(self.wide)
        dist.all_gather_object(where, (host if host is not None else socket.gethostname(), gpu_uuid,
                                       _hardware(device)), group=self.wide)
        # (rank, host, GPU) of each rank's GPUs: one, or a tp group's, lane by lane (global ranks)
        self.where: list[tuple[tuple[int, str, str], ...]] = (
            [((r, where[r][0], where[r][1]),) for r in range(self.world)] if self.lanes is None else
            [tuple((g, where[g][0], where[g][1]) for g in self.lanes.members(d)) for d in range(self.world)])
        # ranks on other GPU models (or CUDA, torch) round differently: the first step's check then names no
        # GPU for computing its own result (checksums.replay.classify_start)
        self.replayer.same_hardware = len({w[2] for w in where}) == 1  # type: ignore[index]
        self.findings: collections.deque[ComputeFinding] = collections.deque(maxlen=max_findings)
        self._unreported: collections.deque[ComputeFinding] = collections.deque(maxlen=64)
        self._last_audit: dict[int, int] = {}      # rank -> the step of its last audit that passed
        self._first_step = 1                       # the first step this process judged (a resumed job's > 1)
        self.last_verdict: StatsVerdict | None = None
        self._steps = 0
        self._suspicions = 0
        self._dropped = 0
        self._audits = 0
        self._determinism_checked = False
        self._replicated = False        # DDP: the ranks' parameters agreed at the first step (replicas)
        self._optimizer_ref = weakref.ref(optimizer)
        # the device path's last step, judged at the next: (step, host slot, armed, retained, restore epoch)
        self._pending: tuple[int, HostSlot, bool, Retained, int] | None = None
        # the steps the device did not mask, learnt on the host after an update is enqueued, a batch at a time
        # once the spread is armed (`_learn_deferred`, the AFTER stage)
        self._learn_queue: list[HostSlot] = []
        self._learn_batch = LEARN_BATCH
        self._host_only_said = False
        self._said_no_batch = False
        self._said_failed: set[str] = set()          # replay failures logged (each reason once)
        self._last_step = 0                   # the number of the last step the stage ran for
        self._no_batch = False                # the last step asked had no batch retained on some rank
        self._not_replayed = ""               # why the last `_classify` replayed nothing ("": it could)
        self._spread_dev: torch.Tensor | None = None
        self._verdict = DeviceVerdict(margin)             # the device path's rule: one graph replay a step
        self._ring: HostRing | None = None     # the device path's rows and flag on the host (`_host_slot`)
        self._spread_version = -1
        self._spread_pinned: list[torch.Tensor | None] = [None, None]   # the spread's way to the device
        self._spread_done: list[Any] = [None, None]
        self._spread_i = 0
        # the verdict's flag while the C++ hook replays the verdict after its gather (`_arm_finish`)
        self._finish: torch.Tensor | None = None
        self._finish_refused = False
        self.guard = StepGuard.attach(optimizer)
        self.guard.add(self)
        # checksums/device_mask.py: found_inf set here, put back AFTER the update (only the device path masks)
        self._device_mask = DeviceMask.of(self.guard) if self.mask == "device" else None
        self._after: _LearnAfter | None = None
        if self.mask == "device":
            self._after = _LearnAfter(self)
            self.guard.add(self._after)
        if monitor is not None:
            monitor.report_compute(self.take_findings, self.mode)

    @classmethod
    def attach(cls, ddp: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> ComputeChecks:
        return cls(ddp, optimizer, **kwargs)

    def retain(self, batch: Any) -> None:
        """The step's batch and RNG state, kept so the step can be replayed; call before the forward."""
        if self.summaries.pending():      # the last backward's step never reached optimizer.step()
            self._judge_skipped()
        self.replayer.retain(batch)

    def _judge_skipped(self) -> None:
        """The loop did not call `optimizer.step()` after the last synchronised backward (a GradScaler found
        inf in the reduced gradient and skipped the update; every rank alike, as the scaler follows the
        reduced gradient): that step's rows are judged now, before the next step's first batch is retained (a
        collective). A suspect is replayed and classified as at any step (an overflow reproduces everywhere:
        DATA, no GPU named; a fault that made one rank's gradient non-finite names it); nothing is vetoed:
        there was no update. Its number is the skipped step's, whether or not the Monitor counted it."""
        rows = self._rows_on_host()
        self.summaries.clear()
        try:
            stats = stats_of(rows)
            jumps, verdict = self._assess(stats)
            outcomes = self._classify(verdict, rows, jumps)
            # its number: the guard's when the Monitor counted the skipped step, else the one after the last
            step = max(self.guard.step, self._last_step + 1)
            self._conclude(step, stats, verdict, outcomes, masked=True)
        finally:
            self.replayer.end_step()

    # ---- the stage ----------------------------------------------------------------------------------

    def run(self, ctx: StepContext) -> Veto | None:
        self._steps += 1
        self._last_step = ctx.step
        if self.expert_buckets is None:
            self._declare_experts()
        start = None
        if not self._determinism_checked:
            self._determinism_checked = True
            self._first_step = ctx.step
            if not self.fsdp and self.world >= 2:      # (collective: every rank's first step)
                self._replicated = len(set(self._param_words())) == 1
            if not self._unreplayable(None):
                start = self._check_replays()
        audit_due = (bool(self.audit_every) and ctx.step % self.audit_every == 0
                     and not self._unreplayable(None))
        try:
            if self.mask == "device":
                self._settle_previous(defer=not audit_due)   # an audit's host verdict learns in order
                if not audit_due and start is None:
                    return self._mask_on_device(ctx)
            rows = self._rows_on_host()
            self.summaries.clear()
            # GPUs computing wrong from the start: an outcome of this step (its update carries their fault)
            return self._judge_now(ctx, rows, audit_due,
                                   [] if start is None else [("audit", start.faulty[0], start)])
        finally:
            self.replayer.end_step()              # the next retain() starts the next step's micro-batches

    def _declare_experts(self) -> None:
        """Once DDP's bucket layout has settled: its buckets of experts' parameters only, declared zeroable
        (see the module docstring); said once in the log."""
        layout = self.summaries.settled_layout()
        if layout is None:
            return
        buckets = tuple(sorted(b for b, idx in layout.items() if idx and self._experts.issuperset(idx)))
        self.expert_buckets = buckets
        if buckets:
            self.tracker.declare_zeroable(buckets, len(layout))
            logger.info("sdcwatch: compute checks: gradient bucket(s) %s hold MoE experts' parameters "
                        "only: a zero there (no token of a rank chose them) is left out of the comparison",
                        list(buckets))

    def _check_replays(self) -> Classification | None:
        """At the first step (a collective): replays are deterministic (else the rounding-aware bound), and
        they reproduce the step they replay (compared with rank 0's and rank 1's own rows of this step).
        Returns the GPUs found computing wrong from the start (`classify_start`), or None."""
        try:
            exact = self.replayer.check_determinism(self._rows_on_host())
        except ReplayFailed as exc:     # a model a replay cannot run: as replays that do not reproduce
            exact, self.replayer.reproduces, self.replayer.why_not = True, False, str(exc)
        if not exact:
            logger.warning("sdcwatch: %s; compute replays compare norms within a rounding bound instead of "
                           "fingerprints (a small fault can hide within it)", self.replayer.why_bounded)
        if not self.replayer.reproduces:
            logger.error("sdcwatch: compute replays do not reproduce this job's steps (%s); no GPU will be "
                         "named on a replay's evidence: audits are off and a suspect step is dropped "
                         "without a finding%s", self.replayer.why_not,
                         _UNREPRODUCIBLE_HINT)
            return None
        return self.replayer.start_fault

    def _unreplayable(self, retained: Retained | None) -> str:
        """Why a step (`retained`, default this one) cannot be replayed; "" when it can. Replays that do not
        reproduce steps would blame a GPU for the loss_fn's mismatch; a step with no batch retained has
        nothing to replay. Every rank must take the same path (replays are collectives), so the ranks agree
        that each kept its batch: one tiny all-reduce, on a suspect or audit step only."""
        if not self.replayer.reproduces:
            return self.replayer.why_not
        retained = retained if retained is not None else self.replayer.retained
        kept = torch.tensor([1 if retained.micro else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(kept, op=dist.ReduceOp.MIN, group=self.wide)
        self._no_batch = not int(kept.item())
        if not self._no_batch:
            return ""
        if not self._said_no_batch:
            self._said_no_batch = True
            logger.error("sdcwatch: compute checks: a step with no batch retained (call checks.retain(batch) "
                         "before each forward, on every rank): its suspects are dropped without a replay and "
                         "no GPU is named; audits skip such steps (said once)")
        return NO_BATCH

    def _classify(self, verdict: StatsVerdict, rows: torch.Tensor, jumps: tuple[float, ...],
                  retained: Retained | None = None) -> list[tuple[str, int, Classification]]:
        """Replay and classify a step's suspects: each of at most two (3+ ranks), or both batches on both
        ranks at once (two ranks: `classify_pair`). [] when there are none, or when the step cannot be
        replayed (`_unreplayable`: the reason is kept in `_not_replayed`)."""
        self._not_replayed = ""
        if not verdict.suspects:
            return []
        self._not_replayed = self._unreplayable(retained)
        if self._not_replayed:
            return []
        try:
            if self.world == 2:
                c = self.replayer.classify_pair(rows, retained, (jumps[0], jumps[1]))
                detector = "nonfinite" if verdict.nonfinite else "stats"
                named = c.faulty[0] if len(c.faulty) == 1 else max((0, 1), key=lambda r: verdict.scores[r])
                return [(detector, named, c)]
            return [("nonfinite" if r in verdict.nonfinite else "stats", r,
                     self.replayer.classify(r, rows[r], retained))
                    for r in verdict.suspects[:2]]              # at most two replays per step: bounded
        except ReplayFailed as exc:     # held back without a finding, as a step with no batch is
            self._not_replayed = self._replay_failed(exc)
            return []

    def _replay_failed(self, exc: ReplayFailed) -> str:
        """A replay round raised (on every rank alike, `Replayer.agreed`): its reason, logged once."""
        why = str(exc)
        if why not in self._said_failed and len(self._said_failed) < 16:
            self._said_failed.add(why)
            logger.error("sdcwatch: a compute replay failed (%s); its step's suspects are dropped without a "
                         "finding and an audit then is skipped (each reason said once)", why,
                         exc_info=exc.__cause__ is not None)
        return why

    def _judge_now(self, ctx: StepContext, rows: torch.Tensor, audit_due: bool,
                   found: list[tuple[str, int, Classification]] | None = None) -> Veto | None:
        """The host path: this step's verdict before its update (gloo/CPU every step; CUDA on audit steps).
        `found`: outcomes of this step known already (the first step's check)."""
        stats = stats_of(rows)
        jumps, verdict = self._assess(stats)             # the jumps before the verdict learns this step
        outcomes = self._classify(verdict, rows, jumps) + (found or [])
        # an audit runs only on a step the statistics passed: no rank's history jump is evidence then (a
        # persistent fault below the margin was learnt as clean since it began), so the two-rank tie-break
        # gets none and a symmetric mismatch goes to the CPU witness (a 1.5-spread jump of the clean rank
        # named it on FSDP2 with the fault on rank 0)
        no_jumps = (0.0, 0.0)
        held = ""          # an audit's replay differed and classifying it failed: the update is held back
        try:
            if not outcomes and audit_due:            # every rank audited at once (by its neighbour)
                self._audits += 1
                got_all = self.replayer.audit_all(rows, no_jumps)
                outcomes.extend(("audit", audited, c) for audited, c in got_all)
                if not got_all:
                    self._last_audit.update((r, ctx.step) for r in range(self.world))
        except ReplayFailed as exc:     # the audit did not complete: no finding; applied unless it differed
            self._audits -= 1
            why = self._replay_failed(exc)
            if exc.after_mismatch:
                held = f"an audit's replay differed from the step's own and could not be classified ({why})"
        drop = self._conclude(ctx.step, stats, verdict, outcomes)
        if drop:
            return Veto(self.name, self._why(verdict, outcomes))
        if held:
            self._dropped += 1
            return Veto(self.name, held)
        if verdict.suspects and self._not_replayed:
            self._dropped += 1
            return Veto(self.name, self._why(verdict, outcomes))
        return None

    def _why(self, verdict: StatsVerdict, outcomes: list[tuple[str, int, Classification]]) -> str:
        """Why a step's update is dropped: its classified suspects, or its suspects not replayed."""
        if outcomes:
            return "; ".join(f"{d} rank {r}: {c.cause.value} ({c.detail})" for d, r, c in outcomes)
        if verdict.suspects and self._not_replayed:
            return f"ranks {list(verdict.suspects)} suspect, not replayed ({self._not_replayed})"
        return "the device's verdict"

    def _conclude(self, step: int, stats: torch.Tensor, verdict: StatsVerdict,
                  outcomes: list[tuple[str, int, Classification]], masked: bool = False) -> bool:
        """Record the outcomes of one step's suspicions; whether its update is (or was) dropped."""
        if not outcomes:
            return False
        self._suspicions += 1
        outcomes = self._weights_checked(outcomes)
        if self.lanes is not None:
            outcomes = self._lanes_named(outcomes)
        drop = masked or any(c.drop or d == "nonfinite" for d, _, c in outcomes)
        if all(c.cause is Cause.DATA for _, _, c in outcomes):
            self.tracker.learn(stats)                    # the data's own spread: widen it
        for detector, r, c in outcomes:
            self._record(step, detector, r, c, drop, verdict)
        if drop:
            self._dropped += 1
        return drop

    def _lanes_named(self, outcomes: list[tuple[str, int, Classification]]
                     ) -> list[tuple[str, int, Classification]]:
        """Tensor or context parallelism: for a group found repeating a wrong result (persistent) while
        another group agrees with the rest, which of its GPUs computed wrong, by the lane witness
        (checksums.lane_witness: every rank replays that group's batch of this step under the op trace,
        lane by lane against the good group; a collective, on such a step only, every rank with the same
        outcomes). Only where replays are bit for bit on one GPU model (the op witness's ground); a lane
        named goes in the classification (`lane`), else the finding stays `one_of`."""
        lanes = self.lanes
        # (each condition the same on every rank: a rank without the batch fails the replay on every rank)
        if lanes is None or lanes.lanes < 2 or not self.replayer.exact or not self.replayer.same_hardware:
            return outcomes
        out = []
        for detector, r, c in outcomes:
            good = next((d for d in range(self.world) if d not in c.faulty), None)
            if c.cause is not Cause.PERSISTENT or len(c.faulty) != 1 or good is None:
                out.append((detector, r, c))
                continue
            suspect = c.faulty[0]
            try:
                retained = self.replayer.fetch(suspect)
                lane, why = lane_witness(
                    lambda: self.replayer.agreed(lambda: self.replayer._rows_of_replay(retained)),
                    lanes, suspect, good, self.device)
            except ReplayFailed as exc:
                lane, why = None, f"its replay failed ({exc})"
            self.replayer.replays += 2
            named = None if lane is None else lanes.members(suspect)[lane]
            if dist.get_rank() in (0, named):        # said once, and on the GPU it names
                logger.warning("sdcwatch: the lane witness %s: %s", "names no GPU" if named is None else
                               f"names rank {named} (lane {lane} of group {list(lanes.members(suspect))})",
                               why)
            if lane is not None:
                c = dataclasses.replace(c, lane=lane, detail=f"{c.detail}; the lane witness: {why}"[:2000])
            out.append((detector, r, c))
        return out

    def _weights_checked(self, outcomes: list[tuple[str, int, Classification]]
                         ) -> list[tuple[str, int, Classification]]:
        """DDP: before a GPU is named, are the ranks' weights the same? A rank whose weights differ (a bit
        flipped in its copy of a parameter, or its Adam state, which the next update turns into its weights)
        replays every batch unlike the rest, which reads as a persistent fault of its arithmetic, repeated
        every step until the replicas are repaired or rolled back (the agent would fail the GPU and stop the
        job on the second). Every parameter's fingerprint is gathered (a collective, only on a step whose
        outcome names a rank: every rank has the same outcomes), where the parameters agreed at the first
        step (ranks that hold different parameters, experts sharded across them say, are no replicas: their
        faults are named as before); a named rank whose weights differ from a
        strict majority's (two ranks: from each other) is `diverged`, nobody named, the update dropped: the
        replica vote names the rank and the repair or the rollback recovers. Sharded parameters (FSDP2,
        HSDP) are not compared here: their replica groups are (`classify_replays`' groups)."""
        if not self._replicated or not any(c.faulty for _, _, c in outcomes):
            return outcomes
        rows = self._param_words()
        common, n = collections.Counter(rows).most_common(1)[0]
        if n == self.world:
            return outcomes
        majority = 2 * n > self.world
        apart = {r for r, w in enumerate(rows) if w != common} if majority else set(range(self.world))
        who = (f"rank(s) {sorted(apart)} hold other weights than the rest" if majority and len(apart) <= 8
               else f"{len(apart)} ranks hold other weights than "
               + ("the rest" if majority else "each other, no majority"))
        out = []
        for detector, r, c in outcomes:
            if c.faulty and set(c.faulty) <= apart:
                c = Classification(Cause.DIVERGED, (), True, f"{who} (parameter fingerprints differ): the "
                                   f"replicas diverged, not their arithmetic; {c.detail}")
            out.append((detector, r, c))
        return out

    def _param_words(self) -> list[tuple[int, ...]]:
        """Every rank's fingerprint of its parameters, gathered (a collective; read on the host: the first
        step, and a step whose outcome names a rank)."""
        return gathered_fingerprints([p.detach() for p in self.summaries.params], self.group)

    # ---- the device path (CUDA, fused optimizers): mask now, judge a step later ---------------------

    def _rows_on_host(self) -> torch.Tensor:
        """Every rank's rows of this step on the host (the host path's gather: a collective). A host slot
        the C++ hook's verdict filled meanwhile is taken in turn, unread (`_finish`)."""
        rows = self.summaries.gather().cpu()
        if self.summaries.finished >= 0:
            self._host_slot(rows, self.summaries.finished)
        return rows

    def _mask_on_device(self, ctx: StepContext) -> None:
        """Gather and compare on the device; a 0-d flag masks the update through the optimizer's own
        `found_inf` (a fused optimizer skips params, moments and step count on the device). The rows go to
        pinned host memory without waiting; `_settle_previous` reads them at the next step.

        Once the verdict is a CUDA graph and the C++ hook gathers the rows, the hook replays the graph and
        copies the rows and the flag to the next host slot itself, right after its gather (`_arm_finish`):
        then this only takes that slot and the graph's flag (the current stream already waits for it)."""
        own = self.summaries.bucket_count()
        per = self.lanes.merged_rows(own) if self.lanes is not None else own
        inp = self._verdict.input(self.world * per, self.device)
        rows = self.summaries.gather(out=inp)
        finished = self.summaries.finished
        self.summaries.clear()
        # the slot the hook filled is taken in turn either way (unread where the gate had it disarmed)
        hooked = self._host_slot(rows, finished) if finished >= 0 else None
        flag = self._finish
        if hooked is not None and flag is not None:
            slot, armed = hooked, True
        else:
            if flag is not None:           # armed, but the hook did not finish this step: replayed here
                self._disarm_finish()      # until it can again
            spread = self._spread_dev      # as the last AFTER stage left it, as the hook's verdict reads it
            armed = (spread is not None and self.tracker.learned >= self.tracker.warmup
                     and spread.shape[0] == rows.shape[1])
            flag = self._verdict.flag(rows, spread if armed else None)
            slot = self._host_slot(rows)
            slot.rows.copy_(rows, non_blocking=True)
            slot.flag.copy_(flag, non_blocking=True)
            slot.record()
            if armed and spread is not None:
                self._arm_finish(flag, spread)
        assert self._device_mask is not None
        self._device_mask.add(ctx, flag)                  # combined with GradScaler's found_inf, if any
        self._pending = (ctx.step, slot, armed, self.replayer.retained, self.guard.rewrites)

    def _arm_finish(self, flag: torch.Tensor, spread: torch.Tensor) -> None:
        """From the next step, the C++ hook replays the verdict's graph right after its gather and copies
        the rows and the flag to the host slots in turn (GradSummaries.arm_finish): the stage before the
        update then launches nothing (its graph replay, two copies and an event took ~0.1 ms of host time
        inside a host-bound GPT-2-small step, docs/BENCHMARKS.md). The device's copy of the spread is made
        after each update (`_LearnAfter`, either way), before the next backward's verdict reads it. Off with
        SDCWATCH_HOOK_VERDICT=0; where it cannot be armed, said once in the log."""
        if (self.fsdp or not _HOOK_VERDICT or self._finish_refused or self._ring is None
                or not self.summaries.gathers_in_hook):    # (not yet: it arms after a few eager gathers)
            return
        handle = self._verdict.exec_handle()
        if not handle:
            if self._verdict.graphs:       # a graph, but this torch hands out no cudaGraphExec_t
                self._finish_refused = True
                logger.info("sdcwatch: the compute verdict stays in the step guard: this torch has no "
                            "CUDAGraph.raw_cuda_graph_exec")
            return
        why = self.summaries.arm_finish(handle, flag, [spread], self._ring.fill(), self._ring.following())
        if why:
            self._finish_refused = True
            logger.info("sdcwatch: the compute verdict stays in the step guard, not in the C++ hook: %s", why)
            return
        self._finish = flag

    def _disarm_finish(self) -> None:
        if self._finish is not None:
            self._finish = None
            self.summaries.disarm_finish()

    def _host_slot(self, rows: torch.Tensor, finished: int = -1) -> HostSlot:
        """The pinned host slot this step's rows and flag land in (checksums/host_ring.py), made once: no
        step allocates host memory. The ring has room for a learning batch, the step settled and this one
        (`_settle_previous` keeps the queue at most a batch long), so no slot waiting to be read is reused;
        the batch is smaller where the rows are large (a world of thousands of ranks), within RING_BYTES.
        `finished` >= 0: the slot the C++ hook filled (the next in turn, as the ring's own)."""
        if self._ring is None:
            row_bytes = max(1, rows.numel() * rows.element_size())
            self._learn_batch = max(1, min(LEARN_BATCH, RING_BYTES // row_bytes - 2))
            self._ring = HostRing(self._learn_batch + 2)
        return self._ring.take(finished) if finished >= 0 else self._ring.next(rows)

    def _spread_on(self, device: torch.device) -> torch.Tensor | None:
        """The learned spread on the device, copied there only when its values changed (`spread_version`:
        every step while it is learnt, at most once a learning batch after). The copy goes through one of
        two pinned buffers used in turn (a non-blocking copy from pageable memory may synchronise with the
        stream, CUDA's rules). A buffer is reused once its copy, two changes ago, is done: waited for if it
        is not (a query only used to skip the change to a later step, which made the step a rank takes a
        change depend on its own device's timing; every rank must judge each step against the same spread,
        or one rank masks an update the others apply and the replicas part). Called after each update (the
        AFTER stage): a step's device verdict reads the spread learnt up to the update before it, on every
        rank alike, whether the C++ hook replays the verdict or the stage does."""
        version = self.tracker.spread_version
        if version == self._spread_version and self._spread_dev is not None:
            return self._spread_dev                       # unchanged (most steps): no tensor made
        spread = self.tracker.signed_spread
        if spread is None:
            return None
        if self._spread_dev is None or self._spread_dev.shape != spread.shape:
            self._disarm_finish()                         # the hook's verdict graph reads the old buffer
            self._spread_dev = spread.to(device)          # on arming and after a bucket rebuild only
        elif device.type != "cuda":
            self._spread_dev.copy_(spread)
        else:
            i = self._spread_i ^ 1
            buf, done = self._spread_pinned[i], self._spread_done[i]
            if buf is None or buf.shape != spread.shape:
                buf = self._spread_pinned[i] = torch.empty(spread.shape, dtype=spread.dtype, pin_memory=True)
                done = self._spread_done[i] = torch.cuda.Event()
            elif not done.query():
                done.synchronize()                        # enqueued two changes ago: done, in practice
            buf.copy_(spread)
            self._spread_dev.copy_(buf, non_blocking=True)
            done.record()
            self._spread_i = i
        self._spread_version = version
        return self._spread_dev

    def _settle_previous(self, defer: bool = False) -> None:
        """The previous step's verdict on the host (its copy landed a step ago): learn the spread, and
        replay and classify a step the device masked, from its retained batch (its weights are still the
        ones it saw: the masked update changed nothing). A step classified DATA here is lost, not applied.

        `defer`: a step the device did not mask (its flag, copied with the rows, is 0: most steps) is only
        learnt from, and that waits for the AFTER stage (`_learn_deferred`), after an update is enqueued, and
        once the spread is armed for a batch of such steps (LEARN_BATCH), learnt in one pass: on a host-bound
        step the host's time there is step time (the judge was ~40 us of host time alone and ~0.3 ms inside a
        GPT-2-small step on the H200's host, bench/hook_host.py and `compute_faults --host-parts`). The
        device's copy of the spread then lags by up to a batch: after the warm-up it widens rarely."""
        if self._pending is None:
            return
        step, slot, armed, retained, epoch = self._pending
        self._pending = None
        slot.wait()                                       # recorded a step ago: already complete
        masked = slot.flagged()                           # the device's verdict skipped this update
        if defer and not masked:
            queue = self._learn_queue
            if queue and (len(queue) >= self._learn_batch or queue[0].rows.shape != slot.rows.shape):
                self._learn_deferred(flush=True)          # the AFTER stage did not run, or other buckets
            self._learn_queue.append(slot)
            return
        host = slot.rows
        stats = stats_of(host)
        jumps, verdict = self._assess(stats)
        if (not armed and not verdict.nonfinite) or epoch != self.guard.rewrites:
            if masked or verdict.suspects:     # restored or repaired since: a replay would run on other weights
                restored = epoch != self.guard.rewrites
                logger.info("sdcwatch: compute check of step %d not replayed: %s", step,
                            "the weights were restored or repaired since" if restored else "not armed")
            outcomes, self._not_replayed = [], ""
        else:
            outcomes = self._classify(verdict, host, jumps, retained)
        self._conclude(step, stats, verdict, outcomes, masked=masked)
        if masked:
            if not outcomes:                              # no finding, but no update either
                self._dropped += 1
            self.guard.masked(step, self.name, self._why(verdict, outcomes))

    def _learn_deferred(self, flush: bool = False) -> None:
        """The host verdicts of the queued steps the device did not mask: the spread and each rank's history
        learn from them, oldest first: a whole batch in one pass (`SpreadTracker.learn_clean`) when each is
        clean, else one by one. Runs when the queue holds a batch (one step while the spread is still
        warming up, so it arms on time) or `flush`. Where the host finds a suspect the device did not (its
        copy of the spread lagged a change, or a score within rounding of the margin), the update was
        applied: nothing is replayed (the weights moved on), and that is said once in the log."""
        queue = self._learn_queue
        if not queue or (not flush and len(queue) < (
                self._learn_batch if self.tracker.learned >= self.tracker.warmup else 1)):
            return
        self._learn_queue = []                            # a new list: `queue` is learnt below
        verdict = self.tracker.learn_clean(batch_stats(queue)) if len(queue) > 1 else None
        if verdict is None:
            for slot in queue:
                _, verdict = self.tracker.assess(stats_of(slot.rows))
                if verdict.suspects and not self._host_only_said:
                    self._host_only_said = True
                    logger.info("sdcwatch: the host's compute verdict named rank(s) %s on a step the "
                                "device's verdict passed (a spread copy behind a change, or a score at the "
                                "margin); its update was applied (said once)", list(verdict.suspects))
        self.last_verdict = verdict

    def _assess(self, stats: torch.Tensor) -> tuple[tuple[float, ...], StatsVerdict]:
        """A step's host verdict (`SpreadTracker.assess`) with the steps queued before it learnt first, in
        order: every host verdict but the queue's own goes through here."""
        self._learn_deferred(flush=True)
        jumps, verdict = self.tracker.assess(stats)
        self.last_verdict = verdict
        return jumps, verdict

    def _record(self, step: int, detector: str, suspect: int, c: Classification, drop: bool,
                verdict: StatsVerdict) -> None:
        score = verdict.scores[suspect] if suspect < len(verdict.scores) else 0.0
        where = tuple(w for r in c.faulty for w in self.where[r])
        # an audit finds what may have slipped through since the rank's last clean audit
        # (before the rank's first clean audit: from this process's first step; a resumed job's earlier steps
        # were judged by the audits of the process that trained them)
        since = self._last_audit.get(suspect, self._first_step - 1) + 1 if detector == "audit" else step
        faulty, detail, who = c.faulty, c.detail, suspect
        if self.lanes is not None and c.lane is not None and len(c.faulty) == 1:   # the lane witness's GPU
            where = (self.where[c.faulty[0]][c.lane],)
            faulty = (where[0][0],)
            who = where[0][0]
            detail = (f"{' x '.join(self.lanes.dims)} group {list(self.lanes.members(suspect))} "
                      f"(data-parallel index {suspect}): rank {who} computed wrong, named by the lane "
                      f"witness: {c.detail}")
        elif self.lanes is not None:   # a tp group computes as one: its GPUs (global ranks), one faulty
            faulty, who = tuple(w[0] for w in where), self.lanes.members(suspect)[0]
            detail = (f"{' x '.join(self.lanes.dims)} group {list(self.lanes.members(suspect))} "
                      f"(data-parallel index {suspect}); its replays name the group, not which of its GPUs: "
                      f"{c.detail}")
        finding = ComputeFinding(step=step, detector=detector, suspect=who, cause=c.cause.value,
                                 faulty=faulty, dropped=drop, detail=detail, score=score,
                                 bucket=verdict.bucket, stat=verdict.stat, where=where, since_step=since,
                                 one_of=self.lanes is not None and len(where) > 1)
        self.findings.append(finding)
        self._unreported.append(finding)
        # a suspicion the replays cleared is no warning; a tp group's first lane speaks for it
        if (self.rank == 0 or self.rank in c.faulty) and (self.lanes is None or self.lanes.lane == 0):
            logger.log(logging.INFO if c.cause is Cause.DATA else logging.WARNING,
                       "sdcwatch: compute check at step %d: %s on rank %d -> %s, faulty %s%s, %s%s",
                       step, detector, who, c.cause.value, "one of " if finding.one_of else "", list(where),
                       "dropped" if drop else "applied",
                       f" ({c.detail})" if c.cause in (Cause.DATA, Cause.DIVERGED) else "")

    # ---- what it says -------------------------------------------------------------------------------

    def mode(self) -> str:
        """How replays compare, for the agent's GetStatus: "exact" (bit-exact fingerprints), "bounded: ..."
        (the determinism check found replays differ: norms within a rounding bound), "unreproducible: ..."
        (a replay does not give its step's gradient: no GPU is named on replays), "" before the check."""
        if not self._determinism_checked:
            return ""
        if not self.replayer.reproduces or self._no_batch:
            return f"unreproducible: {self.replayer.why_not or NO_BATCH}"[:120]
        if self.replayer.exact:
            return "exact"
        return f"bounded: {self.replayer.why_bounded}; norms within 1e-3"[:120]

    def take_findings(self) -> tuple[ComputeFinding, ...]:
        """The findings not handed out yet, oldest first (the Monitor puts them on its next step report)."""
        out = tuple(self._unreported)
        self._unreported.clear()
        return out

    def status(self) -> ComputeStatus:
        """What the checks did so far. The spread and its clean maximum are the learnt batches' (the device
        path's last few unmasked steps wait for theirs): reading the status learns nothing, so a rank that
        asks (rank 0 logging it, say) judges the next steps against the spread the other ranks use."""
        spread = self.tracker.spread
        return ComputeStatus(exact=self.replayer.exact, steps=self._steps, suspicions=self._suspicions,
                             dropped=self._dropped, audits=self._audits, replays=self.replayer.replays,
                             audit_every=self.audit_every,
                             spread_max=float(spread.max()) if spread is not None else 0.0,
                             max_score_clean=self.tracker.max_score_clean, margin=self.tracker.margin,
                             hook_gathers=getattr(self.summaries, "hook_gathers", 0),
                             hook_verdicts=getattr(self.summaries, "hook_finishes", 0))

    def close(self) -> None:
        self._disarm_finish()
        self.guard.remove(self.name)
        if self._after is not None:
            self.guard.remove(self._after.name)


class _LearnAfter:
    """ComputeChecks' AFTER stage: `_learn_deferred` once the update is enqueued."""

    phase = Phase.AFTER

    def __init__(self, owner: ComputeChecks) -> None:
        self.name = f"{owner.name}-learn"
        self._owner = weakref.ref(owner)

    def run(self, ctx: StepContext) -> None:
        owner = self._owner()
        if owner is not None:
            owner._learn_deferred()
            owner._spread_on(owner.device)    # what the next step's device verdict reads


def _without_replicate_hooks(model: nn.Module, given: Callable[[], Any] | None) -> Callable[[], Any]:
    """The replays' context for a model under torch's composable replicate(): its forward without the
    replicate hooks (a replay is one rank's own, never a reduction), inside the caller's `replay_context`."""
    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with hooks_off(model), (given() if given is not None else contextlib.nullcontext()):
            yield
    return context


def _hardware(device: torch.device) -> str:
    """What makes two ranks' arithmetic round alike: the GPU model and the CUDA and torch builds."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}|cuda {torch.version.cuda}|torch {torch.__version__}"
    return f"{device.type}|torch {torch.__version__}"


_choose_mask = choose_mask   # the name this module had for it


__all__ = ["Cause", "ComputeChecks", "ComputeFinding", "ComputeStatus", "expert_param"]
