"""Regenerate the committed gRPC stubs from proto/sdcwatch/v1/*.proto.

Usage: python scripts/gen_proto.py [--out DIR]   (default: the repository root)

Generated with `-I <repo root>` so the modules import as `proto.sdcwatch.v1.agent_pb2`.
tests/test_packaging.py regenerates into a temp dir and diffs against the committed files.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def proto_files(root: Path = ROOT) -> list[str]:
    """The .proto files under `root`/proto, as absolute paths (protoc names them relative to `root`)."""
    return sorted(str(p) for p in (root / "proto").rglob("*.proto"))


class ProtocError(RuntimeError):
    """protoc refused the input; it has printed why on stderr."""


def run_protoc(*args: str, root: Path = ROOT) -> None:
    """protoc with the include paths every caller needs: `root` (so files are named `proto/...`) and
    grpc_tools' well-known types. Raises ProtocError when protoc fails."""
    # grpcio-tools is a development dependency only: imported here so `--help` works without it
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    if protoc.main(["protoc", f"-I{root}", f"-I{include}", *args]) != 0:
        raise ProtocError(f"protoc failed on the .proto files under {root} (its messages are above)")


def generate(out: Path) -> None:
    run_protoc(f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *proto_files())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT)
    try:
        generate(ap.parse_args().out)
    except ProtocError as e:
        raise SystemExit(f"gen_proto: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
