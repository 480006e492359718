"""Every RUN step of the two Dockerfiles (deploy/docker), run here as far as it can run without building an
image. No container registry resolves from these machines and no Docker engine runs on them; a real
daemonless build (scripts/build_agent_image_buildah.sh: Debian's buildah, a stand-in base made from Debian)
takes minutes here (docs/BENCHMARKS.md, "Agent image size"), beyond the suite's budget, so it is a script, not
a test. This module runs each step's own text (parsed from the Dockerfile, paths moved into a temp dir) and
says exactly what of it is not run here and where that part is run instead:

agent.Dockerfile, build stage
  1. `pip wheel --wheel-dir /wheels ".[k8s,s3]"`   RUN, with `--no-deps`, in a build context holding only
     the files the Dockerfile COPYs (a missing COPY fails it). NOT here: the dependencies' wheels from PyPI
     (bench/image_size.py --build installs them from the index; the buildah script builds them).
  2. `apt-get install binutils`                     NOT run (it would change this machine); what step 3 uses
     from it (readelf, strip) is this machine's binutils (scripts/setup.sh --test installs it).
  3. `pip install --no-compile --no-index --prefix /install "sdcwatch[k8s,s3]==V"` + the find/strip clean-up
     RUN: the install with `--no-deps --ignore-installed` from step 1's wheel (the version pin must match the wheel), then the
     clean-up as written on that prefix plus a tests/ dir, a __pycache__ and an extension module with debug
     info (copied from this venv): all three are gone/stripped, the module is still an ELF shared object.
agent.Dockerfile, final stage
  4. `groupadd ... && useradd ...`                 RUN with `--prefix` on a temp /etc (this machine's is left
     alone): the user and group the final USER names, with the home and shell written there.
  5. `python -c "import daemon.cli, ..." && python -c "import numpy" && sdcwatch --help`
     RUN as written with this venv's python and sdcwatch (the image runs it on its own install: the buildah
     script).
preflight.Dockerfile
  6. `pip wheel --no-deps --wheel-dir /wheels .`    RUN as written in the same COPY-only build context.
  7. `groupadd ... && useradd ...`                 RUN as step 4.
  8. `pip install --find-links /wheels "sdcwatch[torch,k8s,s3]==V" && rm -rf /wheels`
     RUN with `--no-deps --ignore-installed --no-index` into a temp prefix from step 6's wheel, then the rm. NOT here: torch and the other
     dependencies from PyPI (torch with CUDA is ~2.5 GB; the preflight image is built on GPU hosts).
A RUN step that is not classified below fails `test_every_run_step_is_classified`: a new step needs a runner
here or a stated reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from deploy_support import ROOT
from test_images import DOCKER, _instructions

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
PIP = f"{sys.executable} -m pip"
BIN = str(Path(sys.executable).parent)


def runs(name: str) -> list[str]:
    return [a for i, a in _instructions(DOCKER / name) if i == "RUN"]


def kind(cmd: str) -> str:
    """Which of the module docstring's classes a RUN step is ("" when none)."""
    if cmd.startswith("pip wheel"):
        return "wheel"
    if cmd.startswith("apt-get update") and "install -y --no-install-recommends binutils" in cmd:
        return "apt-binutils"
    if cmd.startswith("pip install") and "--prefix /install" in cmd:
        return "install-prefix"
    if cmd.startswith("pip install") and "--find-links /wheels" in cmd:
        return "install-wheels"
    if cmd.startswith("groupadd"):
        return "user"
    if cmd.startswith('python -c "import daemon.cli'):
        return "warm"
    return ""


def sh(cmd: str, cwd: Path, timeout: float = 300) -> str:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", SDCWATCH_VERSION=VERSION)
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", cmd],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_every_run_step_is_classified() -> None:
    found = {name: [kind(c) for c in runs(name)] for name in ("agent.Dockerfile", "preflight.Dockerfile")}
    assert found == {
        "agent.Dockerfile": ["wheel", "apt-binutils", "install-prefix", "user", "warm"],
        "preflight.Dockerfile": ["wheel", "user", "install-wheels"],
    }, "a RUN step changed: run it here (tests/test_image_run_steps.py) or say why not in its docstring"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 6: the project's wheel, built by each Dockerfile's `pip wheel` line (with `--no-deps`) in
    a build context that holds only what that Dockerfile COPYs into /src."""
    out = tmp_path_factory.mktemp("wheels")
    for name in ("agent.Dockerfile", "preflight.Dockerfile"):
        ctx = tmp_path_factory.mktemp(f"context-{name.split('.')[0]}")
        for i, a in _instructions(DOCKER / name):
            if i == "COPY" and not a.startswith("--from"):
                *srcs, _dest = a.split()
                for s in srcs:
                    src = ROOT / s
                    if src.is_dir():
                        shutil.copytree(src, ctx / s, ignore=shutil.ignore_patterns("__pycache__"))
                    else:
                        shutil.copy2(src, ctx / s)
        (cmd,) = [c for c in runs(name) if kind(c) == "wheel"]
        if "--no-deps" not in cmd:
            cmd = cmd.replace("pip wheel", "pip wheel --no-deps", 1)
        sh(cmd.replace("pip ", f"{PIP} ", 1).replace("/wheels", str(out)), ctx)
    built = sorted(p.name for p in out.glob("sdcwatch-*.whl"))
    assert built == [f"sdcwatch-{VERSION}-py3-none-any.whl"], built
    return out


def _debug_module() -> Path:
    """An extension module of this venv that carries debug info (psutil's, the test extra's)."""
    import psutil._psutil_linux as m

    so = Path(m.__file__)
    assert ".debug_info" in sh(f"readelf -S {so}", ROOT), f"{so} has no debug info to strip any more"
    return so


def test_agent_build_stage_install_and_clean_up(wheels: Path, tmp_path: Path) -> None:
    (cmd,) = [c for c in runs("agent.Dockerfile") if kind(c) == "install-prefix"]
    prefix = tmp_path / "install"
    install, _, clean = cmd.partition(" && ")
    # step 3's install with --no-deps (their wheels are not here; the version pin must match step 1's wheel)
    # and --ignore-installed (this venv has sdcwatch, the image's build stage has none)
    install = install.replace("pip install", f"{PIP} install --no-deps --ignore-installed", 1)
    install = install.replace("/wheels", str(wheels))
    sh(install.replace("/install", str(prefix)), tmp_path)
    site = next(prefix.glob("lib/python3*/site-packages"))
    assert (site / "daemon" / "compose.py").exists() and not list(site.rglob("*.pyc")), "--no-compile"
    # what the clean-up must remove or strip
    (site / "numpy" / "tests").mkdir(parents=True)
    (site / "numpy" / "tests" / "test_x.py").write_text("")
    (site / "daemon" / "__pycache__").mkdir()
    (site / "daemon" / "__pycache__" / "compose.cpython-311.pyc").write_bytes(b"")
    so = site / "psutil" / _debug_module().name
    so.parent.mkdir()
    shutil.copy2(_debug_module(), so)
    sh(clean.replace("/install", str(prefix)), tmp_path)
    assert not (site / "numpy" / "tests").exists() and not (site / "daemon" / "__pycache__").exists()
    sections = sh(f"readelf -S {so}", tmp_path)
    assert ".debug_info" not in sections and ".text" in sections, "stripped of debug info, still a module"
    assert "DYN" in sh(f"readelf -h {so}", tmp_path)


def _etc(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "etc" / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (root / "etc" / "gshadow").write_text("root:*::\n")
    return root


@pytest.mark.parametrize("name", ["agent.Dockerfile", "preflight.Dockerfile"])
def test_the_user_steps_make_the_user_that_user_names(name: str, tmp_path: Path) -> None:
    (cmd,) = [c for c in runs(name) if kind(c) == "user"]
    root = _etc(tmp_path)
    host = Path("/etc/passwd").read_text()
    sh(re.sub(r"\b(groupadd|useradd) ", rf"\1 --prefix {root} ", cmd), tmp_path)
    user = [a for i, a in _instructions(DOCKER / name) if i == "USER"][-1]
    uid, gid = user.split(":")
    passwd = {
        line.split(":")[0]: line.split(":") for line in (root / "etc" / "passwd").read_text().splitlines()
    }
    group = {
        line.split(":")[0]: line.split(":") for line in (root / "etc" / "group").read_text().splitlines()
    }
    assert (passwd["sdcwatch"][2], passwd["sdcwatch"][3], group["sdcwatch"][2]) == (uid, gid, gid)
    assert passwd["sdcwatch"][6] == "/usr/sbin/nologin"
    if name == "agent.Dockerfile":
        assert passwd["sdcwatch"][5] == "/var/lib/sdcwatch", "the state dir the CMD names"
        assert "--state-dir=/var/lib/sdcwatch" in " ".join(
            a for i, a in _instructions(DOCKER / name) if i == "CMD"
        )
    assert Path("/etc/passwd").read_text() == host, "this machine's /etc is left alone"


def test_the_agent_final_stage_warm_up_step_runs(tmp_path: Path) -> None:
    (cmd,) = [c for c in runs("agent.Dockerfile") if kind(c) == "warm"]
    sh(cmd, tmp_path)


def test_preflight_install_step(wheels: Path, tmp_path: Path) -> None:
    (cmd,) = [c for c in runs("preflight.Dockerfile") if kind(c) == "install-wheels"]
    install, _, rm = cmd.partition(" && ")
    own = tmp_path / "wheels"
    shutil.copytree(wheels, own)
    pip = f"{PIP} install --no-deps --ignore-installed --no-index --prefix {tmp_path / 'p'}"
    install = install.replace("pip install", pip, 1)
    sh(install.replace("/wheels", str(own)), tmp_path)
    assert next((tmp_path / "p").glob("lib/python3*/site-packages/sdcwatch/__init__.py"))
    sh(rm.replace("/wheels", str(own)), tmp_path)
    assert not own.exists()
