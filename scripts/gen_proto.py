"""Regenerate the committed gRPC stubs from proto/sdcwatch/v1/*.proto.

Usage: python scripts/gen_proto.py [--out DIR]   (default: the repository root)

Generated with `-I <repo root>` so the modules import as `proto.sdcwatch.v1.agent_pb2`.
tests/test_proto_current.py regenerates into a temp dir and diffs against the committed files.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").rglob("*.proto"))


def generate(out: Path) -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *proto_files()]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT)
    generate(ap.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
