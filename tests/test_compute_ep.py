"""The compute checks under FSDP2 with expert parallelism (issue 19): an MoE's experts split over the ranks of
an ep group, each rank routing its own batch's tokens to the experts' ranks and back inside every MoE layer,
so an ep group computes its ranks' steps together and is checked as one replica (checksums.tp_lanes, as a
cp group is). Real gloo ranks running bench/ep_moe's expert parallelism: torchtitan's stacked experts
distributed over the ep dim as DTensors (found from the experts' mesh), and experts kept as modules of their
own on each rank (passed as `expert_parallel=`)."""
from __future__ import annotations

from rank_spawn import compute_faults as _faults

BASE = ["--fsdp", "--model", "tiny-moe", "--ep", "2", "--world", "6", "--fault-rank", "3",
        "--fault-step", "22", "--after", "6", "--audit-every", "5", "--clean", "10"]


def test_torchtitans_experts_over_an_ep_dim_are_checked_by_ep_group_and_the_faulty_gpu_named():
    """dp 3 x ep 2 on 6 gloo ranks under bf16 autocast, each MoE block's 4 experts stacked and distributed
    over the ep dim (Shard(0), then FSDP2 over the ranks holding the same experts: a 2-D DTensor), the ep dim
    found from the experts' mesh (before: the attach took it for tensor parallelism and refused: "no
    parameter's mesh holds both the data-parallel and the ['efsdp'] dims"). A gradient element set to 100 on
    rank 3 is caught on its step, its ep group [2, 3] named (`one_of`: rank 3's gradient reaches rank 2's
    through the tokens its experts computed), the update dropped; a persistent x2 on one output channel
    inside rank 3's experts' batched matmul is found by the audit at 25 and the lane witness names rank 3
    alone (the op computing differently from equal inputs on that GPU). 10 clean steps: 2 exact audits, no
    suspicion."""
    results = _faults([*BASE, "--ep-style", "dtensor", "--cpu-autocast",
                       "--cases", "grad elem =100,tc channel x2 persistent"])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["detector"] == "stats" and hit["named"] == [2, 3], hit
    assert hit["one_of"] and hit["dropped"] and "ep group [2, 3]" in hit["detail"], hit
    hit = results["tc channel x2 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["detector"] == "audit" and hit["cause"] == "persistent", hit
    assert hit["named"] == [3] and not hit["one_of"] and hit["dropped"], hit
    assert "rank 3 computed wrong, named by the lane witness" in hit["detail"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["dropped"], st["audits"]) == (10, 0, 0, 2) and st["exact"], st


def test_experts_of_their_own_on_each_rank_are_checked_when_the_ep_group_is_passed():
    """The same layout with each rank's experts kept as modules of their own (plain parameters, FSDP2 over
    the ranks holding them) and the ep dim named otherwise, passed as `expert_parallel=`: a persistent x2 on
    an output channel of rank 3's first expert (the hook's, after the op) is found by the audit at 25 with
    the ep group named; 10 clean steps, 2 exact audits. Not passed (`--cp-pass none`): nothing tells the
    checks that an ep group's ranks compute together, so the first step's check finds that replays do not
    reproduce a step and turns them off (GetStatus `unreproducible`), no GPU named, no suspicion."""
    results = _faults([*BASE, "--cp-pass", "arg", "--cases", "mm channel x2 persistent"])
    hit = results["mm channel x2 persistent"]["caught"].get("compute")
    assert hit and hit["step"] == 25 and hit["cause"] == "persistent" and hit["named"] == [2, 3], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["audits"]) == (10, 0, 2) and st["exact"], st
    results = _faults([*BASE, "--cp-pass", "none", "--cases", "mm channel x2 persistent"])
    hit = results["mm channel x2 persistent"]["caught"].get("compute")
    assert not hit or not hit["named"], hit
    st = results["clean"]["status"]
    assert st["suspicions"] == 0 and st["audits"] == 0 and not st["exact"], st
    assert results["clean"]["mode"].startswith("unreproducible"), results["clean"]


def test_experts_under_hsdp_are_checked_by_ep_group_within_each_replica():
    """HSDP with expert parallelism (torchtitan's dp_replicate outside: a (replicate 2, efsdp 2, ep 2) mesh on
    8 gloo ranks; the stacked experts sharded by HSDP over (replicate, efsdp), the rest over (replicate,
    efsdp x ep)): a gradient element set to 100 on rank 5 is caught on its step, its ep group [4, 5] named
    and the update dropped on every rank; 10 clean steps: 2 exact audits, no suspicion (before, the harness
    refused --ep with --hsdp: the layout was never run)."""
    results = _faults(["--fsdp", "--model", "tiny-moe", "--ep", "2", "--hsdp", "2", "--world", "8",
                       "--ep-style", "dtensor", "--fault-rank", "5", "--fault-step", "22", "--after", "4",
                       "--audit-every", "5", "--clean", "10", "--cases", "grad elem =100"])
    hit = results["grad elem =100"]["caught"].get("compute")
    assert hit and hit["step"] == 22 and hit["detector"] == "stats" and hit["named"] == [4, 5], hit
    assert hit["one_of"] and hit["dropped"] and "ep group [4, 5]" in hit["detail"], hit
    st = results["clean"]["status"]
    assert (st["steps"], st["suspicions"], st["dropped"], st["audits"]) == (10, 0, 0, 2) and st["exact"], st
