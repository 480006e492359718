"""Tensor-parallel lanes: the compute checks of an FSDP2 (or HSDP) model that tensor parallelism also splits.

A tensor-parallel (tp) group computes one data-parallel replica's step together: every forward and backward
is a collective of its ranks, each holding a shard of the weights (a lane). So the checks treat a tp group as
one data-parallel rank, a "dp index": its rows are its lanes' rows side by side (lane-major: [lanes * B, 4]),
compared with the other dp indices' as one rank's buckets are. Every decision is taken from rows gathered
over every rank of the mesh (the default group: the mesh must span the job), so every rank takes it alike:
which step is replayed, which batch, how often. A replay is a collective of the whole mesh: each tp group replays the batch it is given, each lane
its own shard of the gradient, and the tp groups' collectives inside the forward pair up as the step's did.
Batches and RNG states travel within a lane (`dp_group`: the ranks holding the same shard), from the rank
of the same lane in the sending tp group, which ran the same batch.

Context parallelism (torchtitan's cp: each rank of a cp group holds one chunk of every sequence, and the
attention is a collective of the group) makes the same kind of group: a cp group's ranks (and their tp
groups) compute one replica's step together, so they join into one group (`context_table`), lane l one
(cp place, tp lane). The cp ranks come from the caller (`context_parallel=`: the cp DeviceMesh or its
group) or from ranks named "cp" beside FSDP's mesh (`named_ranks`); FSDP's mesh must hold them (its
reduce-scatter sums the cp ranks' gradients, as torchtitan's `dp_shard_cp` does). Each lane retains its own
chunk, so a replay of a group's batch is that group's chunks, each replayed by the rank of the same cp place.

Pipeline parallelism (torchtitan's pp: each rank of a pp group holds one stage of the model, activations
and their gradients passed between the stages) makes such a group too, joined last (lane l one (stage, cp
place, tp lane)); unlike cp and ep, FSDP's mesh holds a stage's data-parallel ranks only, and the stages
hold different layers, so each lane counts its own rows (`Lanes.counts`, `sized`): each rank pads its rows
to the largest count for a gather (`pad`) and `merge` leaves the padding out. With tp, each stage's tp mesh
spans that stage only, so the stages' tables are gathered from every rank.

Naming: replays tell which tp group computed wrong, not which of its GPUs (the group's forward mixes its
lanes: a fault on one lane reaches every lane's gradient), so a finding names every GPU of that group,
marked `one_of`, unless the lane witness (checksums.lane_witness) finds the GPU of a persistent fault (the agent makes them SUSPECT, never FAILED, on that evidence; a persistent fault still
stops the job).

Training-side module: never imports the agent (`daemon`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True, slots=True)
class Lanes:
    """Where this rank sits in a (data-parallel x tensor-parallel) mesh (`find_lanes`)."""

    dp: int                      # the tp groups (data-parallel replicas or shards)
    lanes: int                   # ranks in one tp group
    dp_rank: int                 # this rank's tp group
    lane: int                    # this rank's place in it
    ranks: tuple[int, ...]       # global ranks in (dp index, lane) order (the mesh spans the default group)
    dp_group: Any                # this lane's data-parallel group (rank d = dp index d)
    dims: tuple[str, ...]        # the mesh dims the model is split over besides data parallelism
    # each lane's rows (its FSDP groups; `sized`): a pipeline's stages hold different layers, so their
    # counts differ; () where every lane has as many (tp, cp, ep lanes hold shards of the same layers)
    counts: tuple[int, ...] = ()
    # `ranks` on each device it was used on: made once, not a host-to-device copy every step
    _index: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    _keep: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def size(self) -> int:
        return self.dp * self.lanes

    def members(self, d: int) -> tuple[int, ...]:
        """The global ranks of tp group `d`, lane by lane."""
        return self.ranks[d * self.lanes:(d + 1) * self.lanes]

    @property
    def padded(self) -> int:
        """The rows every rank sends in a gather: the most any lane has (0: each rank's own count)."""
        return max(self.counts) if self.counts else 0

    def sized(self, rows: int) -> Lanes:
        """These lanes with each lane's row count, from this rank's (`rows`: its FSDP groups); a collective
        of every rank. ValueError where the ranks of one lane count differently (they hold the same
        layers)."""
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, int(rows))
        counts = tuple(int(every[self.ranks[lane]]) for lane in range(self.lanes))
        for d in range(self.dp):
            for lane, r in enumerate(self.members(d)):
                if every[r] != counts[lane]:
                    raise ValueError(f"ComputeChecks: rank {r} has {every[r]} FSDP groups, rank "
                                     f"{self.ranks[lane]} of the same lane {counts[lane]}: ranks holding the "
                                     "same layers must shard them alike")
        return dataclasses.replace(self, counts=() if len(set(counts)) == 1 else counts)

    def merged_rows(self, own: int) -> int:
        """The rows of one group after `merge`, this rank having `own`."""
        return sum(self.counts) if self.counts else self.lanes * own

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows [..., B, W] as every rank sends them in a gather: padded with zero rows to the
        lanes' largest count (unchanged where every lane has as many)."""
        n = self.padded
        if not n or rows.shape[-2] == n:
            return rows
        return torch.cat([rows, rows.new_zeros((*rows.shape[:-2], n - rows.shape[-2], rows.shape[-1]))], -2)

    def merge(self, gathered: torch.Tensor) -> torch.Tensor:
        """Rows gathered over the default group, [size, *pre, B, W] in global rank order (each rank's `pad`),
        as the dp indices': [dp, *pre, rows, W], each group's lanes side by side (lanes * B rows; with
        `counts`, the padding left out: sum(counts) rows)."""
        index = self._index.get(gathered.device)
        if index is None:
            index = self._index[gathered.device] = torch.tensor(self.ranks, device=gathered.device)
        x = gathered.index_select(0, index)
        x = x.reshape(self.dp, self.lanes, *gathered.shape[1:]).movedim(1, -3)
        x = x.reshape(self.dp, *gathered.shape[1:-2], self.lanes * gathered.shape[-2], gathered.shape[-1])
        if not self.counts:
            return x
        keep = self._keep.get(gathered.device)
        if keep is None:
            n = self.padded
            rows = [lane * n + b for lane, c in enumerate(self.counts) for b in range(c)]
            keep = self._keep[gathered.device] = torch.tensor(rows, device=gathered.device)
        return x.index_select(-2, keep)


def lane_table(grid: torch.Tensor, dp_dims: list[int], world: int, whole: bool = True) -> list[list[int]]:
    """The tp groups of a mesh (`grid`: its global ranks, one dim per mesh dim; `dp_dims`: the data-parallel
    ones), row d the ranks of tp group d lane by lane. A lane's ranks (a column) must rise with d, as every
    process group numbers its ranks (a lane's group rank is then its dp index), and the mesh must hold every
    rank of the job once (`whole`; False: one pipeline stage's mesh); ValueError otherwise. Pure."""
    tp_dims = [d for d in range(grid.ndim) if d not in dp_dims]
    dp = math.prod(grid.shape[d] for d in dp_dims)
    table = [[int(r) for r in row] for row in grid.permute(*dp_dims, *tp_dims).reshape(dp, -1).tolist()]
    if whole and sorted(r for row in table for r in row) != list(range(world)):
        raise ValueError(f"ComputeChecks: the model's mesh holds {grid.numel()} ranks, not every rank of the "
                         f"job ({world}) once: tensor parallelism is checked on a mesh of the whole job")
    return _numbered_alike(table)


def _numbered_alike(table: list[list[int]]) -> list[list[int]]:
    """`table` if each lane's ranks (a column) rise with the group's index, else ValueError."""
    if any(table[d][lane] >= table[d + 1][lane]
           for d in range(len(table) - 1) for lane in range(len(table[0]))):
        raise ValueError("ComputeChecks: the mesh orders a lane's data-parallel ranks unlike their global "
                         "ranks (a custom mesh): its groups cannot be numbered alike in every lane")
    return table


def context_table(table: list[list[int]], cp_groups: list[tuple[int, ...]]) -> list[list[int]]:
    """The groups that compute one replica's step together when context parallelism also splits every
    sequence: `table`'s rows (tp groups from `lane_table`, or one rank each) joined through the cp groups
    (`cp_groups[r]`: rank r's cp group, its ranks in group order), each group's ranks ordered by (place in
    its cp group, tp lane), so lane l of every group holds the same chunk of the sequence and the same shard
    of the weights; groups numbered by their first rank. ValueError where the cp groups do not tile the
    rows alike (a rank outside its own cp group, groups of different shapes). Pure."""
    row_of = {r: i for i, row in enumerate(table) for r in row}
    lane_of = {r: lane for row in table for lane, r in enumerate(row)}
    if sorted(row_of) != list(range(len(cp_groups))):
        raise ValueError(f"ComputeChecks: {len(cp_groups)} ranks' context-parallel groups for a mesh of "
                         f"{len(row_of)} ranks")
    root = list(range(len(table)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i
    for r, cp in enumerate(cp_groups):
        if r not in cp or any(q not in row_of for q in cp):
            raise ValueError(f"ComputeChecks: rank {r}'s context-parallel group {list(cp)} does not hold it, "
                             "or holds ranks outside the job")
        for q in cp:
            root[find(row_of[q])] = find(row_of[r])
    members: dict[int, list[int]] = {}
    for i, row in enumerate(table):
        members.setdefault(find(i), []).extend(row)

    def key(r: int) -> tuple[int, int]:
        return cp_groups[r].index(r), lane_of[r]
    out = sorted((sorted(ranks, key=key) for ranks in members.values()), key=lambda g: min(g))
    shape = [key(r) for r in out[0]]
    if len(set(shape)) != len(shape):
        raise ValueError("ComputeChecks: two ranks of one replica hold the same cp place and tp lane")
    size = len(cp_groups[out[0][0]]) * len(table[0])
    for group in out:
        if [key(r) for r in group] != shape or len(group) != size or any(
                set(cp_groups[r]) - set(group) for r in group):
            raise ValueError("ComputeChecks: the context-parallel groups and the tensor-parallel groups do "
                             "not form groups of one shape (each replica: every cp place x every tp lane "
                             "once)")
    return _numbered_alike(out)


def group_of(ranks: Any) -> Any:
    """The ProcessGroup of a 1-D DeviceMesh, or a ProcessGroup itself."""
    return ranks.get_group() if hasattr(ranks, "get_group") else ranks


def find_lanes(module: Any, fsdp_mesh: Any, dims: list[str], group: Any = None, cp: Any = None,
               ep: Any = None, pp: Any = None) -> Lanes:
    """The lanes of an FSDP2 `module` whose DTensor parameters are also split over mesh `dims` (names from
    `checksums.grad_checks.model_parallel_dims`), whose sequences context parallelism splits over `cp`, and
    whose experts expert parallelism splits over `ep` (this rank's cp or ep DeviceMesh or ProcessGroup, or
    None: ranks that compute their steps together, each on its own data); `fsdp_mesh` is FSDP's own mesh of
    the dense parameters (its dims are the data-parallel ones, and the cp and ep ranks with them:
    torchtitan's `dp_shard_cp`). `pp`: the pipeline-parallel ranks (this rank's pp DeviceMesh or group),
    each holding other layers (a stage) of one replica's model: joined after cp and ep (lane = stage, then cp
    place, then tp lane), and FSDP's mesh must not hold them. A collective of every rank (it may make the
    lanes' data-parallel groups).
    `group`: the caller's data-parallel group, which must be this lane's. ValueError for a layout it cannot
    check."""
    world = dist.get_world_size()
    if dims:
        table = _tp_table(module, fsdp_mesh, dims, world, each_stage=pp is not None)
    else:
        table = [[r] for r in range(world)]
    names = tuple(dims)
    joined = False
    for together, kind, default in ((cp, "context-parallel", "cp"), (ep, "expert-parallel", "ep"),
                                    (pp, "pipeline-parallel", "pp")):
        if together is None:
            continue
        pg = group_of(together)
        mine = tuple(dist.get_process_group_ranks(pg))
        spans = set(int(r) for r in fsdp_mesh.mesh.reshape(-1).tolist())
        if default == "pp" and set(mine) & spans != {dist.get_rank()}:
            raise ValueError(f"ComputeChecks: FSDP's mesh (ranks {sorted(spans)}) holds more than this rank "
                             f"of its pipeline-parallel ranks {list(mine)}: each stage's parameters are "
                             "sharded over the data-parallel ranks of that stage only")
        if default != "pp" and not set(mine) <= spans:
            raise ValueError(f"ComputeChecks: FSDP's mesh (ranks {sorted(spans)}) does not hold this rank's "
                             f"{kind} ranks {list(mine)}: shard the parameters over the data-parallel and "
                             f"{default} ranks together (torchtitan's dp_shard_cp), so FSDP sums their "
                             "gradients")
        groups: list[Any] = [None] * world
        dist.all_gather_object(groups, mine)
        table = context_table(table, groups)
        names = (*((getattr(together, "mesh_dim_names", None) or (default,))[:1]), *names)
        joined = joined or default != "pp"     # (a stage's data-parallel ranks are FSDP's group)
    dp, lanes = len(table), len(table[0])
    ranks = tuple(r for row in table for r in row)
    columns = [[row[lane] for row in table] for lane in range(lanes)]
    me = ranks.index(dist.get_rank())
    dp_rank, lane = divmod(me, lanes)
    if fsdp_mesh.ndim == 1 and not joined:   # FSDP2's own group is this lane's
        dp_group = fsdp_mesh.get_group()
    else:              # HSDP, context or expert parallelism: each lane's data-parallel ranks, made here
        dp_group, _ = dist.new_subgroups_by_enumeration(columns)
    if dist.get_process_group_ranks(dp_group) != columns[lane]:
        raise ValueError("ComputeChecks: FSDP's group does not hold this lane's data-parallel ranks in mesh "
                         "order")
    if group is not None and dist.get_process_group_ranks(group) != columns[lane]:
        raise ValueError(f"ComputeChecks: group= holds ranks {dist.get_process_group_ranks(group)}, not this "
                         f"rank's data-parallel ranks {columns[lane]} (the ranks holding the same shard)")
    return Lanes(dp=dp, lanes=lanes, dp_rank=dp_rank, lane=lane, ranks=ranks,
                 dp_group=group if group is not None else dp_group, dims=names)


def named_ranks(fsdp_mesh: Any, name: str = "cp") -> Any:
    """The context-parallel ranks beside FSDP's mesh, named "cp" (torchtitan's name; `name`: another, as
    expert parallelism's "ep"), where they span more than one rank: the root mesh's dim `name` (a
    DeviceMesh; torchtitan's `world_mesh["dp_shard_cp"]` layout) or a dim flattened under that name, else
    the one process group a mesh unflattened from the same root made for a dim `name` (newer torchtitan's
    data-loading mesh beside its dense one: `world_mesh._unflatten(0, (.., cp, ..), (.., "cp", ..))`; torch
    names each such group `mesh_cp`). None where there is none or the meshes cannot say."""
    try:
        root = fsdp_mesh._get_root_mesh()
        names = tuple(root.mesh_dim_names or ())
        if name in names:
            return root[name] if root.mesh.shape[names.index(name)] > 1 else None
        flat = getattr(root, "_flatten_mapping", {}).get(name)
        if flat is not None:
            return flat if flat.size() > 1 else None
        groups = {tuple(dist.get_process_group_ranks(pg)): pg for pg in root._pg_registry.values()
                  if getattr(pg, "group_desc", None) == f"mesh_{name}" and pg.size() > 1}
        if len(groups) == 1:
            return next(iter(groups.values()))
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        pass
    return None


def _tp_table(module: Any, fsdp_mesh: Any, dims: list[str], world: int,
              each_stage: bool = False) -> list[list[int]]:
    """`lane_table` of the one mesh `module`'s parameters are split over (data-parallel x `dims`).
    `each_stage` (pipeline parallelism: that mesh spans this rank's stage only): every stage's table,
    gathered from every rank (a collective), their rows together, ordered by their first rank."""
    from checksums.fingerprint import DTENSOR
    split = [p.device_mesh for p in module.parameters()
             if DTENSOR is not None and isinstance(p, DTENSOR) and p.device_mesh.ndim > fsdp_mesh.ndim]
    meshes = {(tuple(m.mesh.reshape(-1).tolist()), tuple(m.mesh.shape), m.mesh_dim_names): m for m in split}
    if not meshes:
        raise ValueError("ComputeChecks: no parameter's mesh holds both the data-parallel and the "
                         f"{dims} dims")
    if len(meshes) > 1:         # the experts split over tp too, on a mesh of their own: not one layout
        raise ValueError(f"ComputeChecks: the parameters are split over {len(meshes)} different meshes "
                         f"({sorted({str(k[2]) for k in meshes})}): the checks take one (data-parallel x "
                         "tensor-parallel) mesh; expert parallelism with the experts also split over "
                         "tensor parallelism is not supported")
    mesh = next(iter(meshes.values()))
    names = tuple(mesh.mesh_dim_names or ())
    dp_names = tuple(fsdp_mesh.mesh_dim_names or ())
    if names and dp_names:
        dp_dims = [d for d in range(mesh.ndim) if names[d] in dp_names]
    else:                                          # FSDP2's mesh first, then the model's own dims
        dp_dims = list(range(fsdp_mesh.ndim))
    if not each_stage:
        return lane_table(mesh.mesh, dp_dims, world)
    mine = lane_table(mesh.mesh, dp_dims, mesh.mesh.numel(), whole=False)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    rows = sorted({tuple(row) for table in every for row in table})
    if sorted(r for row in rows for r in row) != list(range(world)) or len({len(row) for row in rows}) != 1:
        raise ValueError("ComputeChecks: the stages' tensor-parallel meshes do not hold every rank of the "
                         "job once, in groups of one size")
    return [list(row) for row in rows]
