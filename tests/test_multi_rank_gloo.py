"""bench/multi_rank.py (issue 11) with 4 and 8 gloo ranks on the CPU, all five parts, small sizes.

The ranks are launched the way torchrun launches them (its environment: RANK, WORLD_SIZE, MASTER_ADDR/PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS; its rule: when a rank dies the attempt ends, the other
ranks are stopped and all are started again), but forked from a forkserver that has torch imported already:
torchrun starts fresh interpreters, which on this 2-core machine costs ~25 s for 8 ranks, twice (the restart).
The real torchrun path is what docs/BENCHMARKS.md records.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from deadlines import scaled

ROOT = Path(__file__).resolve().parent.parent
FLIP_STEP = 3
SMALL = ["--device", "cpu", "--flip-step", str(FLIP_STEP), "--timeout-s", f"{scaled(90):.0f}", "--block", "2",
         "--rounds", "2", "--warmup", "1", "--ckpt-mib", "1", "--saves", "3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(env: dict[str, str], argv: list[str]) -> None:
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    from bench import multi_rank

    code = multi_rank.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def launch(world: int, argv: list[str], max_restarts: int = 1,
           timeout: float = 80.0) -> list[list[int | None]]:
    """Run `world` ranks like torchrun --max-restarts; the exit codes of every attempt."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp", "grpc",
                                "checksums.monitor", "checkpoint.client", "probes.canary_random"])
    attempts: list[list[int | None]] = []
    deadline = time.monotonic() + scaled(timeout)
    for attempt in range(max_restarts + 1):
        port = _free_port()
        procs = []
        for r in range(world):
            env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                   "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
                   "TORCHELASTIC_RUN_ID": "test"}
            procs.append(ctx.Process(target=_rank, args=(env, argv)))
        for p in procs:
            p.start()
        try:
            while True:
                codes = [p.exitcode for p in procs]
                if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} ranks still running after {scaled(timeout):.0f}s: "
                                       f"exit codes {codes}")
                time.sleep(0.05)
        finally:
            for p in procs:                     # torchrun stops the others when one dies
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
        attempts.append([p.exitcode for p in procs])
        if all(c == 0 for c in attempts[-1]):
            break
    return attempts


def _by_part(out: Path) -> dict[int, dict[str, Any]]:
    res = json.loads(out.read_text())
    return {r["part"]: r for r in res["results"]}


def _check_common(parts: dict[int, dict[str, Any]], world: int) -> None:
    failed = {p: r["evidence"] for p, r in parts.items() if not r["passed"]}
    assert not failed, failed
    assert sorted(parts) == [1, 2, 3, 4, 5]
    vote = parts[1]["data"]
    assert vote["flipped"] == 1 and vote["expected"] == [[1, ""]] and vote["method"] == "majority"
    for view in vote["views"]:           # every rank saw the same single event, at the flip's step
        (event,) = view["flip"]["mismatches"]
        assert event["step"] == FLIP_STEP and event["suspects"] == [[1, ""]] and event["group"] == "world"
        assert view["clean"]["events"] == [] and view["clean"]["votes"] == vote["clean_steps"]
    cost = parts[2]["data"]
    assert "NOT GPT-2 small" in cost["model"] and cost["off_ms"] > 0 and cost["monitor_ms"] > 0
    canary = parts[3]["data"]
    bad = world // 2
    assert canary["corrupted_rank"] == bad and canary["odd"] == [canary["corrupted_label"]]
    assert len(canary["agree"]) == world - 1 and canary["agent_path"]["failed"] == [f"sim-{bad}"]
    ckpt = parts[4]["data"]
    assert ckpt["victim"] == world - 1 and ckpt["crash_step"] == 4 and ckpt["previous_step"] == 3
    for view in ckpt["after_restart"]:
        assert view["crash_state"] == "PENDING" and view["crash_shards"] == world - 1
        assert view["latest"] == 3 and view["restored_step"] == 3 and view["same_bits"]
    states = [s["state"] for r, s in ckpt["survivors"].items() if int(r) != world - 1]
    assert states == ["PENDING"] * (world - 1)
    assert ckpt["survivors"][str(world - 1)] is None           # the killed rank never finished its save
    assert len(ckpt["stall_over_bound"]) == world and all(x > 0 for x in ckpt["stall_over_bound"])
    for rank in ckpt["saves"]:
        assert [s["error"] for s in rank["saves"]] == [""] * 3 and rank["latest"] == 3


def _killed_then_restarted(attempts: list[list[int | None]], world: int) -> None:
    assert len(attempts) == 2, attempts
    first, second = attempts
    assert first[world - 1] == -9, first                       # SIGKILLed inside its save
    assert first[:-1] == [-15] * (world - 1), first            # the others waited, stopped by the launcher
    assert second == [0] * world, second


def test_four_ranks_all_parts(short_tmp: Path) -> None:
    out = short_tmp / "out.json"
    argv = SMALL + ["--clean-steps", "60", "--workdir", str(short_tmp / "w"), "--out", str(out)]
    attempts = launch(4, argv)
    _killed_then_restarted(attempts, 4)
    parts = _by_part(out)
    _check_common(parts, 4)
    hsdp = parts[5]["data"]                   # 2x2: two replicas per group, so both are suspect
    assert hsdp["mesh"] == [2, 2] and hsdp["groups"] == [[0, 2], [1, 3]] and hsdp["flipped"] == 2
    assert hsdp["expected"] == [[0, ""], [2, ""]] and hsdp["method"] == "all_disagreeing"
    # every rank reported to the agent the script started, which told one incident of the flipped group
    assert hsdp["agent_told"] == [{"group": "ranks:0,2", "step": FLIP_STEP, "ranks": [0, 2]}]
    assert all(view["reports"] == [FLIP_STEP + 2, 0, 0] for view in hsdp["views"]), hsdp["views"]
    for rank, view in enumerate(hsdp["views"]):
        if rank in (0, 2):
            (event,) = view["mismatches"]
            assert event["step"] == FLIP_STEP and event["group"] == "ranks:0,2"
        else:
            assert view["group"] == "ranks:1,3" and view["mismatches"] == []
    agent_dirs = [p for p in (short_tmp / "w").iterdir() if p.name.startswith("agent-")]
    assert agent_dirs == []                    # the agent the script started is stopped and removed


def test_eight_ranks_all_parts_with_a_given_agent(short_tmp: Path) -> None:
    from agent_harness import AgentProcess

    from checkpoint.shm_store import default_shm_root

    state = short_tmp / f"st{os.getpid()}"
    out = short_tmp / "out.json"
    agent = AgentProcess(state, "--no-canary-enabled").start()
    try:
        argv = SMALL + ["--clean-steps", "20", "--workdir", str(short_tmp / "w"), "--out", str(out),
                        "--agent-socket", str(agent.socket)]
        attempts = launch(8, argv)
        assert agent.proc is not None and agent.proc.poll() is None   # a given agent is left running
    finally:
        agent.stop()
        shutil.rmtree(default_shm_root(state).parent, ignore_errors=True)
    _killed_then_restarted(attempts, 8)
    parts = _by_part(out)
    _check_common(parts, 8)
    hsdp = parts[5]["data"]                   # 4x2: four replicas per group, the flipped one named alone
    assert hsdp["mesh"] == [4, 2] and hsdp["groups"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert hsdp["expected"] == [[2, ""]] and hsdp["method"] == "majority"
    # the given agent told one incident of the flipped group
    assert hsdp["agent_told"] == [{"group": "ranks:0,2,4,6", "step": FLIP_STEP, "ranks": [2]}]
    for rank, view in enumerate(hsdp["views"]):
        if rank % 2 == 0:
            (event,) = view["mismatches"]
            assert event["suspects"] == [[2, ""]] and event["group"] == "ranks:0,2,4,6"
        else:
            assert view["mismatches"] == [] and view["votes"] == FLIP_STEP + 2


def test_part_four_without_restarts_is_refused(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import multi_rank

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert multi_rank.main(["--device", "cpu"]) == 2
    assert "--max-restarts 1" in capsys.readouterr().err


@pytest.mark.parametrize("arg, world, want", [(None, 4, (2, 2)), (None, 8, (4, 2)), (None, 2, (2, 1)),
                                              (None, 3, (3, 1)), ("2x4", 8, (2, 4))])
def test_hsdp_shapes(arg: str | None, world: int, want: tuple[int, int]) -> None:
    from bench.multi_rank import hsdp_shape

    assert hsdp_shape(arg, world) == want


@pytest.mark.parametrize("arg", ["3x3", "8x1x1", "ax2", "1x8"])
def test_bad_hsdp_shape_is_a_value_error(arg: str) -> None:
    from bench.multi_rank import hsdp_shape

    with pytest.raises(ValueError, match="--hsdp"):
        hsdp_shape(arg, 8)


def test_expected_suspects_follow_the_vote_rule() -> None:
    from bench.multi_rank import expected_named

    assert expected_named([0, 2, 4, 6], 2) == ([2], "majority")
    assert expected_named([2, 0], 2) == ([0, 2], "all_disagreeing")
