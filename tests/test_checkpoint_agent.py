"""In-memory checkpoints through the real agent process: a rank's CheckpointClient on the agent's socket,
replica votes through ReportStep deciding VERIFIED, a bit-exact restore, `sdcwatch ckpt ls` and
`sdcwatch ckpt restore` (to files, without torch)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import torch

from agent_harness import AgentProcess, cli
from checkpoint.client import CheckpointClient
from checkpoint.manifest import ShardManifest
from checkpoint.shm_store import default_shm_root
from checkpoint.snapshot import SnapshotConfig
from checkpoint.state_tree import DTYPES, unflatten
from ckpt_support import assert_same, job_id, state_dict
from proto.sdcwatch.v1 import agent_pb2 as apb
from proto.sdcwatch.v1 import agent_pb2_grpc as apb_grpc
from deadlines import scaled


def _vote(job: str, step: int, agreed: bool) -> apb.ReportStepRequest:
    vote = apb.ReplicaVote(checked=True, agreed=agreed, replicas=2, step=step,
                           method="majority" if agreed else "all_disagreeing")
    if not agreed:
        vote.suspects.add(rank=0)
        vote.suspects.add(rank=1)
    return apb.ReportStepRequest(job_id=job, rank=0, world_size=2, step=step + 1, vote=vote)


def _wait_for(pred, timeout: float = 15.0):
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _restore_to_files_without_torch(sock: str, job: str, out: Path) -> None:
    """`sdcwatch ckpt restore` writes each rank's verified bytes and manifest; the CLI process never loads
    torch (fingerprints checked by the numpy path), and the files rebuild the saved state dicts exactly."""
    code = ("import sys; from daemon.cli import main; rc = main(sys.argv[1:]); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code, "ckpt", "restore", "latest_verified", "--job", job,
                          "--out", str(out), "--socket", sock], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "no torch" and f"job {job} step 1 (VERIFIED)" in run.stdout
    assert "\x1b[" not in run.stdout + run.stderr and "B/s" not in run.stdout   # no bar: stdout is no terminal
    shown = _on_a_terminal(["ckpt", "restore", "latest_verified", "--job", job, "--out", str(out / "tty"),
                            "--socket", sock])
    assert f"restore {job}" in shown and "B/s" in shown, shown   # rich's bar, advanced chunk by chunk
    for rank in (0, 1):
        manifest = ShardManifest.from_json((out / f"rank-{rank:05d}.json").read_text())
        buf = torch.frombuffer(bytearray((out / f"rank-{rank:05d}.bin").read_bytes()), dtype=torch.uint8)
        tensors = [buf[e.offset:e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.shape) for e in manifest.tensors]
        assert_same(unflatten(manifest.tree, tensors), state_dict(rank, 1))
    assert cli("ckpt", "restore", "9", "--job", job, "--out", str(out), "--socket", sock).returncode == 1


def _on_a_terminal(args: list[str]) -> str:
    """What `sdcwatch ARGS` writes when its stdout and stderr are a terminal (a pty)."""
    import os
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", *args], stdout=slave, stderr=slave,
                            cwd=Path(__file__).resolve().parent.parent, env=dict(os.environ, TERM="xterm",
                                                                                 COLUMNS="120"))
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:   # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(60) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_save_vote_verify_restore_and_ls_through_the_real_agent(short_tmp: Path) -> None:
    state = short_tmp / f"ckpt-{uuid.uuid4().hex[:8]}"
    memory = default_shm_root(state)
    job = job_id("e2e")
    try:
        with AgentProcess(state) as agent:
            ranks = [CheckpointClient.connect(job, r, 2, target=agent.target, deadline_s=10,
                                              config=SnapshotConfig(chunk_bytes=4096)) for r in (0, 1)]
            client = ranks[0]
            try:
                for step in (1, 2):
                    res = [c.save(step, state_dict(c.rank, step)).result(30) for c in ranks]
                    assert all(r.error == "" for r in res) and res[1].state == "COMMITTED", res
                with grpc.insecure_channel(agent.target) as ch:
                    stub = apb_grpc.AgentStub(ch)
                    stub.ReportStep(_vote(job, 1, agreed=True), timeout=10)
                    stub.ReportStep(_vote(job, 2, agreed=False), timeout=10)
                _wait_for(lambda: {i.step: i.state for i in client.list()} == {1: "VERIFIED", 2: "COMMITTED"})
                assert client.latest_verified().step == 1
                assert client.latest().step == 2
                for c in ranks:
                    assert_same(c.restore("latest_verified"), state_dict(c.rank, 1))
                    assert_same(c.restore(2), state_dict(c.rank, 2))
            finally:
                for c in ranks:
                    c.close()

            sock = str(agent.socket)
            out = cli("ckpt", "ls", "--socket", sock)
            assert out.returncode == 0, out.stderr
            lines = [ln.split() for ln in out.stdout.splitlines() if ln.startswith(job)]
            assert [(ln[1], ln[2]) for ln in lines] == [("1", "VERIFIED"), ("2", "COMMITTED")]
            assert all("2/2" in ln for ln in lines)
            js = json.loads(cli("ckpt", "ls", "--job", job, "--json", "--socket", sock).stdout)
            copies = [c for i in js["checkpoints"] for c in i["copies"]]
            assert len(copies) == 4 and all(c["location"] == str(memory) for c in copies)
            shown = cli("ckpt", "show", "1", "--job", job, "--socket", sock)
            assert shown.returncode == 0 and "VERIFIED" in shown.stdout and str(memory) in shown.stdout
            assert cli("ckpt", "show", "7", "--job", job, "--socket", sock).returncode == 1
            _restore_to_files_without_torch(sock, job, short_tmp / f"{job}-out")
        assert cli("ckpt", "ls", "--socket", sock).returncode == 2  # agent gone: cannot reach
    finally:
        shutil.rmtree(memory.parent, ignore_errors=True)


def test_a_resume_that_saves_before_it_reports_lands_and_verifies_through_the_real_agent(short_tmp: Path) -> None:
    """Issue 18 follow-up, through the agent process: the job saved steps 1-3 and reported step 4; a resume
    restores step 1 and saves step 2 before it reports any step. The save's Begin carries the restore, so the
    agent cuts the history first and the save lands (before: "already COMMITTED", lost). The step report that
    then shows the job went back (the agent's cut at once, and the `rollback` event through its feed) keeps
    it, and the replicas' vote verifies it: the restored bytes are the redone save's."""
    state = short_tmp / f"ckpt-{uuid.uuid4().hex[:8]}"
    memory = default_shm_root(state)
    job = job_id("resume")
    clients: list[CheckpointClient] = []

    def ranks() -> list[CheckpointClient]:
        clients.extend(CheckpointClient.connect(job, r, 2, target=agent.target, deadline_s=10,
                                                config=SnapshotConfig(chunk_bytes=4096)) for r in (0, 1))
        return clients[-2:]

    def report(stub, step: int, vote_step: int | None = None) -> None:
        req = (_vote(job, vote_step, agreed=True) if vote_step is not None
               else apb.ReportStepRequest(job_id=job, rank=0, world_size=2, step=step))
        assert req.step == step
        stub.ReportStep(req, timeout=10)

    try:
        with AgentProcess(state, "--checkpoints-keep-committed", "10") as agent, \
                grpc.insecure_channel(agent.target) as ch:
            stub = apb_grpc.AgentStub(ch)
            old = ranks()
            for step in (1, 2, 3):
                res = [c.save(step, state_dict(c.rank, 100 + step)).result(30) for c in old]
                assert res[1].state == "COMMITTED", res
            report(stub, 2, vote_step=1)
            report(stub, 4)
            _wait_for(lambda: {i.step: i.state for i in old[0].list()} == {1: "VERIFIED", 2: "COMMITTED",
                                                                          3: "COMMITTED"})
            new = ranks()                     # the job resumes from step 1 and saves step 2 at once
            for c in new:
                assert_same(c.restore("latest_verified"), state_dict(c.rank, 101))
            res = [c.save(2, state_dict(c.rank, 2)).result(30) for c in new]
            assert [(r.state, r.error) for r in res] == [("PENDING", ""), ("COMMITTED", "")], res
            assert {i.step for i in new[0].list()} == {1, 2}
            report(stub, 2)                   # the agent sees the job went back (restored step 1)
            report(stub, 3, vote_step=2)      # the replicas agree at step 2
            _wait_for(lambda: {i.step: i.state for i in new[0].list()} == {1: "VERIFIED", 2: "VERIFIED"})
            for c in new:
                assert_same(c.restore(2, resume=False), state_dict(c.rank, 2))
            journal = cli("events", "--socket", str(agent.socket)).stdout
            assert "restored step 1" in journal, journal[-2000:]
    finally:
        for c in clients:
            c.close()
        shutil.rmtree(memory.parent, ignore_errors=True)
