"""Build and load sdcwatch's C++ DDP communication hook (`native_hook.cpp`), once per torch and source.

GradSummaries registers it instead of its Python hook when it loads: the summary launch, the streams and
the all-reduce of each bucket then run without Python once a bucket's launch is bound, where a Python comm
hook costs ~130 us of host time a bucket inside a step (the GIL, a GradBucket object, a future and its
`then` callback: docs/BENCHMARKS.md). It is compiled on first use with the C++ compiler Triton and torch's
extensions use (`$CXX`, else `c++`, `g++` or `clang++`), against the installed torch's headers, into
`$SDCWATCH_NATIVE_CACHE` (default `~/.cache/sdcwatch/native`; where that cannot be made, a directory of
ours in the temp directory), under a lock, so ranks and test workers starting together build it once. The
directory is made private first (0700, ours, no link on the way: `sdcwatch.safe_fs.secure_dir`), since
what is loaded from it runs in the training process. No CUDA toolkit is needed. Where it cannot be built or loaded (no
compiler, no Python headers, a torch without its C++ headers), `load()` returns None, the reason is logged
once and `why()` says it, and the Python hook is used: the same rows and gradients, more host time.

`SDCWATCH_NATIVE_HOOK=0` turns it off.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_hook.cpp")
_MODULE = "_sdcwatch_native_hook"
_BUILD_TIMEOUT_S = 600

_loaded: ModuleType | None = None
_why: str | None = None          # None: not tried yet


def enabled() -> bool:
    return os.environ.get("SDCWATCH_NATIVE_HOOK", "1") != "0"


def why() -> str:
    """Why the hook is not loaded ('' when it is, or has not been tried)."""
    return _why or ""


def cache_dir() -> Path:
    base = os.environ.get("SDCWATCH_NATIVE_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "sdcwatch" / "native"


def _cache_root() -> Path:
    """The cache directory, made private (0700, ours, reached without links another user planted: a
    library loaded from it runs in the training process); a default one that cannot be made (a read-only
    home) is replaced by one in the temp directory, made the same way."""
    from sdcwatch.safe_fs import secure_dir

    try:
        return secure_dir(cache_dir(), 0o700)
    except OSError:
        if os.environ.get("SDCWATCH_NATIVE_CACHE"):
            raise
    return secure_dir(Path(tempfile.gettempdir()) / f"sdcwatch-native-{os.getuid()}", 0o700)


def _compiler() -> str | None:
    """$CXX when set (nothing else then), else the first of c++, g++, clang++ on the PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((found for cxx in ("c++", "g++", "clang++") if (found := shutil.which(cxx))), None)


def _key(cxx: str) -> str:
    import torch

    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, getattr(torch.version, "git_version", ""), sys.version, cxx,
                 str(Path(torch.__file__).parent)):
        h.update(part.encode())
    return h.hexdigest()[:20]


def _command(cxx: str, out: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    torch_lib = str(Path(torch.__file__).parent / "lib")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-DTORCH_EXTENSION_NAME={_MODULE}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *(f"-I{p}" for p in includes), str(SOURCE), f"-L{torch_lib}",
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{torch_lib}", "-o", str(out)]


def build() -> Path:
    """The built library's path (compiled now if its key's is not in the cache). Raises RuntimeError with
    the reason when it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'c++, g++, clang++'} not found; "
                           "apt install g++)")
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        raise RuntimeError(f"no Python headers in {sysconfig.get_paths()['include']} "
                           "(apt install python3-dev)")
    root = _cache_root()
    lib = root / f"{_MODULE}-{_key(cxx)}.so"
    if lib.is_file():
        return lib
    with open(root / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)           # another rank or worker may be building it
        if lib.is_file():
            return lib
        tmp = lib.with_suffix(f".{socket.gethostname()}.{os.getpid()}.tmp")   # a home shared by nodes
        try:
            done = subprocess.run(_command(cxx, tmp), capture_output=True, text=True,
                                  timeout=_BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"building {SOURCE.name} took over {_BUILD_TIMEOUT_S} s") from exc
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
            raise RuntimeError(f"building {SOURCE.name} failed (exit {done.returncode}):\n{tail}")
        os.replace(tmp, lib)
    return lib


def load() -> ModuleType | None:
    """The hook's module, built if need be; None (and `why()` says why) where it cannot be."""
    global _loaded, _why
    if _loaded is not None:
        return _loaded
    if _why is not None:
        return None
    if not enabled():
        _why = "off (SDCWATCH_NATIVE_HOOK=0)"
        return None
    try:
        import torch.distributed  # noqa: F401  (the c10d types the module's functions take)

        lib = build()
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(lib))
        spec = importlib.util.spec_from_file_location(_MODULE, lib, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 (any failure: the Python hook does the same work)
        _why = str(exc) or type(exc).__name__
        logger.warning("sdcwatch: the C++ comm hook is not used (%s); the checks run through the Python "
                       "hook, with more host time a bucket", _why)
        return None
    _loaded, _why = module, ""
    return module


def main(argv: list[str] | None = None) -> int:
    """`python -m checksums.native_hook`: build the hook now (an image build, CI's set-up) and say where."""
    module = load()
    if module is None:
        print(f"native hook: not built: {why()}", file=sys.stderr)
        return 1
    print(f"native hook: {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
