"""`sdcwatch ckpt export` / `import` (issue 21 item 3): a checkpoint out as a stock DCP directory that
torch.distributed.checkpoint loads in a python that cannot import sdcwatch, bit-exact; a stock DCP directory
in as a COMMITTED, never VERIFIED checkpoint; bad input exits 2 with a message, and nothing pickled runs."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from agent_harness import cli
from checkpoint import dcp_export
from checkpoint.client import CheckpointClient
from checkpoint.dcp import SdcwStorageReader, SdcwStorageWriter
from checkpoint.snapshot import SnapshotConfig
from ckpt_support import AgentServer, job_id, node
from deadlines import scaled
from train_state import full_state, same


@pytest.fixture()
def agent(redis_server, tmp_path: Path, short_tmp: Path):
    from daemon.checkpoint_service import CheckpointService

    co = node(redis_server.port, tmp_path, "n0")
    sock = short_tmp / "agent.sock"
    server = AgentServer(CheckpointService(co), sock).start()
    try:
        yield co, str(sock)
    finally:
        server.stop()


def _state() -> dict:
    sd = full_state(0)
    sd["bf"] = torch.linspace(-3, 3, 7).to(torch.bfloat16)
    return sd


# The stock side: no sdcwatch. The venv has sdcwatch installed (editable), so besides -I (no PYTHONPATH, no
# cwd on sys.path) a finder refuses every sdcwatch package before anything else is imported.
STOCK = textwrap.dedent('''
    import importlib, importlib.abc, io, struct, sys
    OURS = {"sdcwatch", "checkpoint", "checksums", "daemon", "probes", "proto", "demo"}
    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in OURS:
                raise ModuleNotFoundError(name)
    sys.meta_path.insert(0, Refuse())
    import torch, torch.distributed.checkpoint as dcp
    for name in OURS:
        try:
            importlib.import_module(name)
            raise SystemExit(f"could import {name}")
        except ModuleNotFoundError:
            pass
    want = torch.load(sys.argv[2], weights_only=False)   # the test's own files: what was saved, a fresh state
    sd = torch.load(sys.argv[3], weights_only=False)
    dcp.load(sd, checkpoint_id=sys.argv[1], no_dist=True)
    def same(a, b, path=""):
        assert type(a) is type(b), (path, type(a), type(b))
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, path
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), path
            for k in a:
                same(a[k], b[k], f"{path}/{k}")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), path
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{path}[{i}]")
        elif isinstance(a, float):
            assert struct.pack(">d", a) == struct.pack(">d", b), (path, a, b)
        elif isinstance(a, io.BytesIO):
            assert a.getvalue() == b.getvalue(), path
        else:
            assert a == b, (path, a, b)
    same(sd, want)
    assert not [m for m in sys.modules if m.split(".")[0] in OURS]
    print("stock load ok:", len(sd), "top-level keys")
''')


def test_export_loads_with_plain_torch_without_sdcwatch(agent, tmp_path: Path) -> None:
    co, sock = agent
    job = job_id("exp")
    writer = SdcwStorageWriter(co, job)
    dcp.save(_state(), storage_writer=writer, checkpoint_id=5)
    writer.close()
    out = tmp_path / "exported"
    run = cli("ckpt", "export", "5", "--job", job, "--dcp", str(out), "--socket", sock, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "stock DCP" in run.stdout and (out / ".metadata").is_file()
    torch.save(_state(), tmp_path / "want.pt")
    fresh = full_state(1)
    fresh["bf"] = torch.zeros(7, dtype=torch.bfloat16)
    torch.save(fresh, tmp_path / "fresh.pt")
    (tmp_path / "stock.py").write_text(STOCK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    stock = subprocess.run([sys.executable, "-I", str(tmp_path / "stock.py"), str(out),
                            str(tmp_path / "want.pt"), str(tmp_path / "fresh.pt")], cwd=tmp_path,
                           capture_output=True, text=True, timeout=scaled(120), env=env)
    assert stock.returncode == 0, stock.stdout + stock.stderr
    assert "stock load ok" in stock.stdout
    # DCP's own tool rebuilds the nesting from the planner data: DCP's format through and through
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(out, tmp_path / "whole.pt")
    same(torch.load(tmp_path / "whole.pt", weights_only=False), _state())
    # an existing, non-empty directory: refused without --force, replaced with it
    again = cli("ckpt", "export", "5", "--job", job, "--dcp", str(out), "--socket", sock, timeout=120)
    assert again.returncode == 2 and "not empty" in again.stderr and "--force" in again.stderr
    assert _export(sock, "latest", "--job", job, "--dcp", str(out), "--force") == 0


def _export(sock: str, *args: str) -> int:
    return dcp_export.main(["export", *args, "--socket", sock])


def test_export_of_client_checkpoints_and_bad_input(agent, tmp_path: Path, capsys) -> None:
    co, sock = agent
    job = job_id("expc")
    one = CheckpointClient(co, job, 0, 1, config=SnapshotConfig(chunk_bytes=4096))
    sd = full_state(0)
    assert one.save(3, sd).result(30).error == ""
    one.close()
    assert _export(sock, "3", "--job", job, "--dcp", str(tmp_path / "c1")) == 0
    back = full_state(2)
    dcp.load(back, checkpoint_id=str(tmp_path / "c1"), no_dist=True)   # DCP's own FileSystemReader
    same(back, sd)
    job2 = job_id("expc2")
    clients = [CheckpointClient(co, job2, r, 2, config=SnapshotConfig(chunk_bytes=4096)) for r in range(2)]
    for c in clients:
        assert c.save(8, {"w": torch.full((3,), float(c.rank)), "rank": c.rank}).result(30).error == ""
        c.close()
    capsys.readouterr()
    assert _export(sock, "8", "--job", job2, "--dcp", str(tmp_path / "c2")) == 2
    assert "on 2 ranks" in capsys.readouterr().err
    assert _export(sock, "8", "--job", job2, "--dcp", str(tmp_path / "c2"), "--rank", "1") == 0
    got = {"w": torch.zeros(3), "rank": -1}
    dcp.load(got, checkpoint_id=str(tmp_path / "c2"), no_dist=True)
    same(got, {"w": torch.ones(3), "rank": 1})
    for args, msg in [(("99", "--job", job), "no checkpoint at step 99"),
                      (("3", "--job", "../evil"), "job id"),
                      (("x3", "--job", job), "STEP must be"),
                      (("3", "--job", job, "--rank", "4"), "no rank 4")]:
        capsys.readouterr()
        assert _export(sock, *args, "--dcp", str(tmp_path / "bad")) == 2, args
        assert msg in capsys.readouterr().err, args
    (tmp_path / "file").write_text("x")
    assert _export(sock, "3", "--job", job, "--dcp", str(tmp_path / "file")) == 2
    assert "not a directory" in capsys.readouterr().err


def _stock_dir(path: Path, sd: dict) -> Path:
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


def test_import_stock_dir_is_committed_never_verified(agent, tmp_path: Path) -> None:
    co, sock = agent
    job = job_id("imp")
    src = _stock_dir(tmp_path / "stock", full_state(0))   # plain torch: FileSystemWriter
    run = cli("ckpt", "import", str(src), "--job", job, "--step", "7", "--socket", sock, timeout=120)
    assert run.returncode == 0, run.stderr
    assert co.info(job, 7).state == "COMMITTED"
    co.on_job_event(job, 100, "checks_clean", time.time())   # even with the job's checks clean past it
    info = co.info(job, 7)
    assert info.state == "COMMITTED" and "never VERIFIED" in info.reason and "imported" in info.reason
    shown = cli("ckpt", "show", "7", "--job", job, "--socket", sock)
    assert shown.returncode == 0 and "COMMITTED" in shown.stdout
    assert "never VERIFIED: bytes imported" in shown.stdout
    assert str(src) in shown.stdout
    back = full_state(3)
    dcp.load(back, storage_reader=SdcwStorageReader(co, job), checkpoint_id=7)
    same(back, full_state(0))
    dup = cli("ckpt", "import", str(src), "--job", job, "--step", "7", "--socket", sock, timeout=120)
    assert dup.returncode == 2 and "already has a checkpoint at step 7" in dup.stderr


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_import_refuses_bad_directories_and_runs_nothing(agent, tmp_path: Path, capsys) -> None:
    co, sock = agent
    job = job_id("impb")
    marker = tmp_path / "ran"

    def imp(src: Path, step: int = 1) -> tuple[int, str]:
        capsys.readouterr()
        rc = dcp_export.main(["import", str(src), "--job", job, "--step", str(step), "--socket", sock])
        return rc, capsys.readouterr().err

    nope = tmp_path / "nope"
    assert imp(nope) == (2, f"sdcwatch: import of job {job}: {nope}: no such directory\n")
    (tmp_path / "empty").mkdir()
    rc, err = imp(tmp_path / "empty")
    assert rc == 2 and "no .metadata" in err
    good = _stock_dir(tmp_path / "good", {"w": torch.arange(50.0), "lr": 0.5})
    part = tmp_path / "partial"
    part.mkdir()
    for f in good.iterdir():
        (part / f.name).write_bytes(f.read_bytes()[:40] if f.suffix == ".distcp" else f.read_bytes())
    rc, err = imp(part)
    assert rc == 2 and "partial DCP checkpoint" in err
    # a .metadata that names something other than DCP's metadata classes is never unpickled
    evil_md = tmp_path / "evilmd"
    evil_md.mkdir()
    (evil_md / ".metadata").write_bytes(pickle.dumps(Evil(str(marker))))
    rc, err = imp(evil_md)
    assert rc == 2 and "posix.system" in err and "refused" in err and not marker.exists()
    # a non-tensor item that is a pickled object (not plain data): refused, not run
    evil_item = _stock_dir(tmp_path / "evilitem", {"w": torch.ones(2), "cfg": Evil(str(marker))})
    assert not marker.exists()
    rc, err = imp(evil_item)
    assert rc == 2 and "'cfg'" in err and "not plain data" in err and not marker.exists()
    # data file names come from .metadata: a path out of the directory is refused before anything is opened
    with open(good / ".metadata", "rb") as f:
        md = pickle.load(f)   # the test's own file
    for info in md.storage_data.values():
        info.relative_path = "../good/" + info.relative_path
    escape = tmp_path / "escape"
    escape.mkdir()
    (escape / ".metadata").write_bytes(pickle.dumps(md))
    rc, err = imp(escape)
    assert rc == 2 and "not a file name inside the directory" in err
    assert co.list(job) == [] and imp(good, 2)[0] == 0 and [i.step for i in co.list(job)] == [2]
    got = {"w": torch.zeros(50), "lr": 0.0}
    dcp.load(got, storage_reader=SdcwStorageReader(co, job), checkpoint_id=2)
    same(got, {"w": torch.arange(50.0), "lr": 0.5})
