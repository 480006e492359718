# The sdcwatch node agent: slim, non-root, no CUDA runtime, no torch (the agent never imports torch; NVML
# comes from the driver that the NVIDIA container runtime injects: runtimeClassName nvidia).
#   docker build -f deploy/docker/agent.Dockerfile -t sdcwatch:0.1.0 .
# The canary child needs torch with CUDA, which this image does not carry: here the agent runs with
# [canary] enabled = false (SDCWATCH_CANARY_ENABLED=false), and canaries run from the preflight image
# (deploy/docker/preflight.Dockerfile: a Kubernetes Job, an initContainer or the Slurm prolog). A node that
# wants the agent's own idle-GPU canaries runs the agent from the preflight image instead.
# Checked in the suite: hadolint, every RUN step's shell (tests/test_images.py), every RUN step run as far as it
# can without an image (tests/test_image_run_steps.py); built for real without a Docker engine by
# scripts/build_agent_image_buildah.sh (Debian's buildah, minutes); its size: bench/image_size.py
# (docs/BENCHMARKS.md, "Agent image size"). Size: the packages are installed in the build stage without
# bytecode, their tests/ and the debug info of their extension modules (uvloop, awscrt ship it), and copied
# over in one layer; the final stage then writes bytecode for what the agent imports at start only.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG SDCWATCH_VERSION=0.1.0

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sdcwatch ./sdcwatch
COPY daemon ./daemon
COPY probes ./probes
COPY checksums ./checksums
COPY checkpoint ./checkpoint
COPY proto ./proto
COPY demo ./demo
COPY integrations ./integrations
# wheels of the agent and of everything it needs: the core, the Kubernetes client (lightkube), S3
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[k8s,s3]"
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends binutils \
 && rm -rf /var/lib/apt/lists/*
ARG SDCWATCH_VERSION
# from the wheels just built, nothing from an index: the build stage resolved every version. No bytecode
# (the final stage writes the part the agent uses), no tests, no debug info (only in the modules that carry
# it: stripping the libraries auditwheel patched, numpy.libs/, breaks them).
# hadolint ignore=SC2016
RUN pip install --no-cache-dir --no-compile --no-index --find-links /wheels --prefix /install \
      "sdcwatch[k8s,s3]==${SDCWATCH_VERSION}" \
 && find /install -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} + \
 && find /install -type f -name "*.so*" -exec sh -c 'for f; do \
      if readelf -S "$f" | grep -q "[.]debug_info"; then strip --strip-debug "$f"; fi; done' sh {} +

FROM ${PYTHON_IMAGE}
ARG SDCWATCH_VERSION
LABEL org.opencontainers.image.title="sdcwatch agent" \
      org.opencontainers.image.description="GPU reliability and silent-data-corruption monitor: node agent" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 sdcwatch \
 && useradd --system --uid 10001 --gid sdcwatch --no-create-home --home-dir /var/lib/sdcwatch \
      --shell /usr/sbin/nologin sdcwatch
COPY --from=build /install /usr/local
# bytecode for the modules the agent loads at start (~14 MB, where bytecode for every installed module
# is ~50 MB): without it each start compiles them again (about 3x the start time); the rest compile in
# memory when first used (the agent's user cannot write here, PYTHONDONTWRITEBYTECODE below)
RUN python -c "import daemon.cli, daemon.compose, daemon.k8s_nodes, lightkube.resources.core_v1, boto3" \
 && python -c "import numpy" \
 && sdcwatch --help > /dev/null
ENV SDCWATCH_CANARY_ENABLED=false \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 9464 9465
ENTRYPOINT ["sdcwatch"]
CMD ["run", "--state-dir=/var/lib/sdcwatch", "--socket=/run/sdcwatch/agent.sock"]
