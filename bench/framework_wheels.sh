#!/usr/bin/env bash
# The wheels bench/bench_frameworks.py needs on the GPU machine (Python 3.12, no network there, its own
# CUDA torch): transformers, accelerate, lightning and their pure-Python or abi3 dependencies, downloaded
# here into .whl/ WITHOUT their dependencies resolved (so no torch is fetched); bench/gpu_run.sh installs
# .whl/*.whl with --no-deps. Run on a machine with the package registry:  bash bench/framework_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PKGS=(transformers accelerate lightning pytorch-lightning lightning-utilities torchmetrics huggingface_hub
      tokenizers safetensors hf-xet tqdm regex pyyaml filelock packaging typing_extensions fsspec psutil
      click typer shellingham annotated-doc httpx2 httpcore2 h11 anyio sniffio idna certifi truststore)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl "${PKGS[@]}"
# torchtitan (bench/torchtitan_trainer.py, issue 25): its dependencies but torch's own (numpy, sympy, jinja2,
# networkx, ...) and those above; the list is the closure of torchtitan 0.3.0's requirements in the CPU venv
# (importlib.metadata), not yet tried on the GPU machine
TITAN=(torchtitan torchdata torch-checkpointing spmd-types datasets tyro docstring-parser typeguard einops
       tensorboard tensorboard-data-server wandb pillow pyarrow pandas python-dateutil tzdata six dill multiprocess
       requests urllib3 charset-normalizer xxhash absl-py markdown werkzeug pydantic pydantic-core
       annotated-types typing-inspection platformdirs distro cwevals opentelemetry-api opentelemetry-sdk
       opentelemetry-proto opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-http
       opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
       opentelemetry-exporter-http-transport googleapis-common-protos httpx httpcore)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl "${TITAN[@]}"
ls .whl
