"""The agent image's size (target: < 300 MB), two ways.

    python bench/image_size.py            # estimate from this environment's installed distributions
    python bench/image_size.py --build    # replay the image's install steps here and measure the result

Default: the distributions `sdcwatch[k8s,s3]` pulls, sized from their RECORD files (the files a wheel
installs, without bytecode, tests included), plus the slim base image. Run it in a fresh venv of the project
(`scripts/setup.sh`; an editable install made before an extra changed reports the old extra's packages).

--build: what deploy/docker/agent.Dockerfile does, on this machine's Python: `pip install --no-compile
--ignore-installed --prefix TMP ".[k8s,s3]"` from the index, its tests/ and __pycache__ removed, the debug
info of the extension modules that carry it stripped (binutils' `strip`), then bytecode written for what
the agent imports at start; the layer's bytes are summed (apparent sizes, as an image layer's tar holds
them) and the base image's size added. No Docker engine runs here: the base's size is its published
uncompressed size, not measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_images import BASE_IMAGE_MB, closure  # the one definition of what the image holds

# what the agent image's last RUN imports to write their bytecode (deploy/docker/agent.Dockerfile)
WARM = (
    "import daemon.cli, daemon.compose, daemon.k8s_nodes, lightkube.resources.core_v1, boto3, numpy"
)


def estimate() -> int:
    rows = []
    for name in sorted(closure("sdcwatch", {"k8s", "s3"}) - {"sdcwatch"}):
        dist = metadata.distribution(name)
        rows.append((sum((f.size or 0) for f in (dist.files or [])) / 1e6, name, dist.version))
    total = BASE_IMAGE_MB + sum(r[0] for r in rows)
    print(f"agent image, estimated: {total:.0f} MB ({BASE_IMAGE_MB} MB base + {total - BASE_IMAGE_MB:.0f} MB "
          f"of {len(rows)} distributions' files, no bytecode); target < 300 MB")
    for mb, name, version in sorted(rows, reverse=True)[:10]:
        print(f"  {mb:6.1f} MB  {name} {version}")
    return 0


def _bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() or p.is_symlink())


def build() -> int:
    strip, readelf = shutil.which("strip"), shutil.which("readelf")
    if strip is None or readelf is None:
        print("--build needs binutils' strip and readelf (apt-get install binutils)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="sdcwatch-image-size-") as tmp:
        prefix = Path(tmp) / "install"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "--no-compile"]
        subprocess.run([*pip, "--ignore-installed", "--prefix", str(prefix), f"{ROOT}[k8s,s3]"], check=True)
        installed = _bytes(prefix)
        removed = 0
        for d in sorted(prefix.rglob("*"), key=lambda p: -len(p.parts)):
            if d.is_dir() and d.name in ("tests", "__pycache__") and d.exists():
                removed += _bytes(d)
                shutil.rmtree(d)
        # only those that carry debug info (uvloop, awscrt, ...): stripping the libraries auditwheel patched
        # (numpy.libs/) breaks them
        def has_debug_info(p: Path) -> bool:
            out = subprocess.run([readelf, "-S", str(p)], check=False, capture_output=True, text=True)
            return ".debug_info" in out.stdout

        sos = [p for p in prefix.rglob("*.so*") if p.is_file() and has_debug_info(p)]
        before = sum(p.stat().st_size for p in sos)
        subprocess.run([strip, "--strip-debug", *map(str, sos)], check=True)
        stripped = before - sum(p.stat().st_size for p in sos)
        layer = _bytes(prefix)
        site = prefix / Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
        # -S: only the stdlib and the layer on sys.path; cwd outside the repo so its packages are not found
        subprocess.run(
            [sys.executable, "-S", "-c", WARM], check=True, cwd=tmp, env={**env, "PYTHONPATH": str(site)}
        )
        pyc = _bytes(prefix) - layer
        total = BASE_IMAGE_MB + (layer + pyc) / 1e6
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        print(f"agent image, install replayed on Python {py}: {total:.0f} MB ({BASE_IMAGE_MB} MB base + "
              f"{layer / 1e6:.0f} MB packages + {pyc / 1e6:.0f} MB start-up bytecode); target < 300 MB")
        print(f"  pip installed {installed / 1e6:.0f} MB; removed {removed / 1e6:.0f} MB of tests/ and "
              f"__pycache__, {stripped / 1e6:.0f} MB of debug info")
        tops: dict[str, int] = {}
        for p in site.iterdir():
            key = p.name.split("-")[0].split(".")[0].lstrip("_")
            tops[key] = tops.get(key, 0) + (_bytes(p) if p.is_dir() else p.lstat().st_size)
        for name, n in sorted(tops.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {n / 1e6:6.1f} MB  {name}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="replay the image's install steps and measure them")
    return build() if ap.parse_args().build else estimate()


if __name__ == "__main__":
    raise SystemExit(main())
