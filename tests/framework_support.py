"""Shared by the framework tests (issue 25): ranks started like torchrun (the rendezvous in the environment),
a one-bit weight flip, and the checks on the agent's journal and checkpoints after a run."""
from __future__ import annotations

import itertools
import json
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from agent_harness import AgentProcess, cli
from sdcwatch.event_kinds import REPEATS
from conftest import free_port
from deadlines import scaled, wait_until
from rank_spawn import spawn as fork_spawn


def torchrun_env(rank: int, world: int, port: int, socket: str) -> None:
    """What torchrun sets for a rank (frameworks read these and call init_process_group themselves)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "NODE_RANK": "0", "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SDCWATCH_SOCKET": socket,
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)


def flip_bit(weight: torch.Tensor, index: int = 5, bit: int = 22) -> None:
    """Flip one mantissa bit of one float32 element of `weight` in place (the silent corruption)."""
    with torch.no_grad():
        weight.view(torch.int32).view(-1)[index] ^= 1 << bit


def preloads(*modules: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a rank worker with the framework modules its ranks import (`spawn` has the forkserver import them
    first, so each rank forks with them imported: ~5 s of CPU a rank for Lightning or Hugging Face's Trainer
    on the CI machine)."""
    def mark(worker: Callable[..., None]) -> Callable[..., None]:
        worker.preload = modules  # type: ignore[attr-defined]
        return worker
    return mark


def spawn(worker: Callable[..., None], world: int, socket: str, outdir: Path,
          *args: Any) -> list[dict[str, Any]]:
    """Run `worker(rank, world, port, socket, outdir, *args)` on `world` processes; their rank{r}.json. The
    ranks fork from the session's forkserver (tests/rank_spawn.py), which has torch imported already, and
    the worker's `preloads` modules."""
    port = free_port()
    fork_spawn(worker, (world, port, socket, str(outdir), *args), nprocs=world,
               preload=getattr(worker, "preload", ()))
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world)]


def journal(agent: AgentProcess) -> list[str]:
    return cli("events", "--socket", str(agent.socket)).stdout.splitlines()


def _events(target: str, kinds: tuple[str, ...] = ()) -> list[Any]:
    """The agent's journal (kinds by prefix, as `sdcwatch events --kind`) over gRPC: what the polls below read.
    A `sdcwatch events` process per poll cost ~0.3 s of CPU, taken from the agent whose work the poll waits
    for on a loaded machine."""
    import grpc

    from proto.sdcwatch.v1 import agent_pb2 as pb
    from proto.sdcwatch.v1 import agent_pb2_grpc as pb_grpc
    with grpc.insecure_channel(target) as ch:
        return list(pb_grpc.AgentStub(ch).WatchEvents(pb.WatchEventsRequest(kinds=list(kinds)), timeout=30))


def wait_verified(job: str, timeout: float = 60.0) -> None:
    """In a rank (SDCWATCH_SOCKET set): block until the agent holds a VERIFIED checkpoint of `job`. On a
    loaded machine the agent's verification can trail a fast run by the whole run up to the flip; a flip
    with nothing VERIFIED before it is `job.rollback_impossible` (right, but not what a flip test tests).
    Called before the flip; the other ranks wait in the next collective."""
    from checkpoint.agent_link import GrpcAgentLink
    link = GrpcAgentLink.connect(None, 10)
    try:
        wait_until(lambda: link.latest_verified(job) is not None, timeout, f"a VERIFIED checkpoint of {job}",
                   interval=0.2)
    finally:
        link.close()


HOLD_AFTER_FLIP = 3   # steps after the flip at which the flip tests hold the run for the agent's directive


def wait_directive(job: str, timeout: float = 60.0, kind: str = "job.rollback_directive") -> None:
    """In a rank (SDCWATCH_SOCKET set): block until the agent has journaled a rollback directive for `job`.
    The agent plans it once its checkpoint feed has taken every event before the mismatch (daemon/rollback.py),
    seconds behind a tiny model's steps on a loaded machine: a run that ends first has nothing left to roll
    back (its last checkpoints are not VERIFIED and the mismatch is journaled: right, but not what a flip test
    tests). The flip's rank calls it HOLD_AFTER_FLIP steps after the flip; the other ranks wait in the next
    collective; the directive reaches every rank in its next ReportStep reply. `kind`: the directive's event
    (`job.stop_directive` for a STOP)."""
    target = f"unix:{os.environ['SDCWATCH_SOCKET']}"

    def issued() -> bool:
        return any(e.subject == f"job/{job}" for e in _events(target, (kind,)))

    wait_until(issued, timeout, f"a {kind} for {job}", interval=0.2)


def mismatch_events(agent: AgentProcess) -> list[dict[str, Any]]:
    """The journal's critical replica.mismatch events, with their details (`sdcwatch events --json`)."""
    out = cli("events", "--socket", str(agent.socket), "--json", "--kind", "replica.mismatch",
              "--min-severity", "critical").stdout
    events = [json.loads(line) for line in out.splitlines()]
    return [e for e in events if e["kind"] == "replica.mismatch" and e["severity"] == "critical"]


def checkpoint_states(agent: AgentProcess, job: str) -> dict[int, str]:
    from checkpoint.agent_link import GrpcAgentLink
    link = GrpcAgentLink.connect(agent.target, 10)
    try:
        return {i.step: i.state for i in link.list(job)}
    finally:
        link.close()


def _steps(lines: list[str], kind: str, said: str) -> set[int]:
    return {int(m.group(1)) for line in lines if kind in line
            for m in [re.search(rf"step (\d+) {said}", line)] if m}


def newest_verified(lines: list[str]) -> bool:
    """Whether the newest committed checkpoint in `lines` is journaled VERIFIED. (Not every older one: on a
    loaded machine retention can evict a checkpoint from memory before the agent's background comparison
    of its replicas' bytes has vouched for it; such a copy left on a tier lists as COMMITTED.)"""
    committed = _steps(lines, "checkpoint.committed", "committed")
    return bool(committed) and max(committed) in _steps(lines, "checkpoint.verified", "is VERIFIED")


def settled_journal(agent: AgentProcess, since: str | None = None) -> list[str]:
    """The journal once the newest committed checkpoint (among the lines from the first holding `since`,
    if given) is VERIFIED (the agent compares the replicas' bytes in the background: on a loaded machine
    that can trail the run), or after the deadline. Polled over gRPC; the lines returned are `sdcwatch
    events`' once it holds."""
    def done() -> bool:
        got = [f"{e.kind} {e.subject}: {e.message}" for e in _events(agent.target)]
        at = next((i for i, line in enumerate(got) if since in line), len(got)) if since else 0
        return newest_verified(got[at:])

    try:
        wait_until(done, 20, "checkpoints VERIFIED", interval=0.2)
    except AssertionError:
        pass
    return journal(agent)


def check_recovered(res: list[dict[str, Any]], lines: list[str], states: dict[int, str],
                    flip: int, steps: int, mismatches: list[dict[str, Any]]) -> None:
    """The flip run: both ranks rolled back together to a checkpoint before the flip, none holding the
    flip was VERIFIED before the rollback, the replicas are bit-identical at the end, the run reached its
    last step and its newest checkpoint is VERIFIED. `mismatches`: `mismatch_events(agent)`; the one
    incident raised one critical event, published at once, and the catalogue's repeat folding (fold_s) may
    add one summary per window that closed before the journal was read (a slow run on a loaded machine), each
    with the repeat count in `repeats`: all of the one incident."""
    for r in res:
        assert r["rollbacks"] and all(t < flip for t in r["rollbacks"]), (r, lines[-30:])
        assert r["identical"], "the replicas are bit-identical at the end"
    assert res[0]["rollbacks"] == res[1]["rollbacks"], "both ranks restored the same step, together"
    assert res[0]["final_step"] == res[1]["final_step"] == res[0]["framework_step"], res
    rolled = next(i for i, line in enumerate(lines) if "job.rollback " in line)
    early = [line for line in lines[:rolled] if "checkpoint.verified" in line
             and int(re.search(r"step (\d+) is VERIFIED", line).group(1)) >= flip]
    assert not early, f"a checkpoint holding the flip was VERIFIED: {early}"
    assert any("job.rollback_directive" in line and "replica mismatch from step" in line for line in lines)
    assert len({e["details"].get("incident") for e in mismatches}) == 1, ("one incident", mismatches)
    first = [e for e in mismatches if REPEATS not in e["details"]]
    assert len(first) == 1, ("one incident, one event (later ones folded with a repeat count)", mismatches)
    assert res[0]["final_step"] == steps, "the steps the rollback took back were redone, to max_steps"
    assert newest_verified(lines[rolled:]), [line for line in lines[rolled:] if "checkpoint." in line]


def check_clean(res: list[dict[str, Any]], lines: list[str], states: dict[int, str], steps: int) -> None:
    """The clean run: no rollback, no mismatch, no warning or worse in the journal (but a straggler's late
    report, `job.reports_dropped`, which a loaded 2-core machine causes, and the rank's side of it, its
    Monitor's `agent.unreachable` when a report missed its deadline), the newest checkpoint VERIFIED, the
    replicas identical."""
    for r in res:
        assert not r["rollbacks"] and r["identical"] and r["final_step"] == steps, r
        events = [k for k in r["monitor_events"] if k != "agent.unreachable"]
        assert not events, r["monitor_events"]
    bad = [line for line in lines if re.search(r"\b(warning|error|critical)\b", line)
           and "job.reports_dropped" not in line]
    assert not bad, bad
    assert newest_verified(lines), ([line for line in lines if "checkpoint." in line], states)


def run_with_agent(state: Path, outdir: Path, job: str, worker: Callable[..., None],
                   *args: Any) -> tuple[list[dict[str, Any]], list[str], dict[int, str]]:
    """Two ranks of `worker(*args)` against a real agent on `state`: the ranks' results, the agent's settled
    journal and the job's checkpoint states."""
    agent = AgentProcess(state).start()
    try:
        res = spawn(worker, 2, str(agent.socket), outdir, *args)
        return res, settled_journal(agent), checkpoint_states(agent, job)
    finally:
        agent.stop()


def check_dropped_and_named(res: list[dict[str, Any]], lines: list[str], fault: int, steps: int) -> None:
    """A one-step fault on rank 1 under the compute checks: on both ranks one update dropped, at step `fault`,
    rank 1 named `transient`, the run on to `steps` with no rollback and the replicas identical; the
    agent's compute.fault events name rank 1."""
    for r in res:
        hit = [f for f in r["findings"] if f["dropped"]]
        assert len(hit) == 1 and hit[0]["faulty"] == [1] and hit[0]["cause"] == "transient", r["findings"]
        assert hit[0]["step"] == fault, hit[0]
        assert r["skipped"] == 1 and r["compute"]["dropped"] == 1 and r["compute"]["mode"] == "exact", r
        assert r["identical"] and not r["rollbacks"] and r["final_step"] == steps, r
    faults = [line for line in lines if "compute.fault" in line]
    assert faults and all("rank 1" in line for line in faults), (faults, lines[-20:])


def check_stopped(res: list[dict[str, Any]], lines: list[str], states: dict[int, str], fault: int,
                  steps: int) -> None:
    """Rank 1 computing wrong from step `fault` on: both ranks stopped at one step before `steps` by the
    agent's STOP, whose target is a VERIFIED checkpoint before the fault and whose reason names rank 1; the
    checks named rank 1 `persistent`."""
    stops = [r["stopped"] for r in res]
    assert all(stops) and stops[0] == stops[1], (stops, [line for line in lines if "stop" in line][-5:])
    assert res[0]["final_step"] == res[1]["final_step"] < steps, [r["final_step"] for r in res]
    assert stops[0]["target"] < fault and states.get(stops[0]["target"]) == "VERIFIED", (stops[0], states)
    assert "persistent compute fault" in stops[0]["reason"] and "rank 1" in stops[0]["reason"], stops[0]
    assert any("job.stop_directive" in line for line in lines)
    for r in res:
        named = [f for f in r["findings"] if f["cause"] == "persistent"]
        assert named and named[0]["faulty"] == [1], r["findings"]


_READS = itertools.count()


def replicas_identical(params: list[torch.Tensor]) -> bool:
    """Every rank's parameters bit-identical (through the store: bench/rank_start.py says why). The store lives
    in rank 0: once every rank has read the others' digests it says so in the store, and rank 0 returns only
    when all have (a forked rank leaves at once when its function returns, taking the store with it, and a
    rank still reading then failed "Connection reset by peer" on a loaded machine)."""
    import torch.distributed as dist

    from bench.rank_start import same_on_every_rank
    same = same_on_every_rank(params)
    store = dist.distributed_c10d._get_default_store()
    n, rank, world = next(_READS), dist.get_rank(), dist.get_world_size()
    store.set(f"sdcwatch-read/{n}/{rank}", "1")
    if rank == 0:
        store.wait([f"sdcwatch-read/{n}/{r}" for r in range(world)], timedelta(seconds=scaled(120)))
    return same
