# The sdcwatch node agent: slim, non-root, no CUDA runtime, no torch (the agent never imports torch; NVML
# comes from the driver that the NVIDIA container runtime injects: runtimeClassName nvidia).
#   docker build -f deploy/docker/agent.Dockerfile -t sdcwatch:0.1.0 .
# The canary child needs torch with CUDA, which this image does not carry: here the agent runs with
# [canary] enabled = false (SDCWATCH_CANARY_ENABLED=false), and canaries run from the preflight image
# (deploy/docker/preflight.Dockerfile: a Kubernetes Job, an initContainer or the Slurm prolog). A node that
# wants the agent's own idle-GPU canaries runs the agent from the preflight image instead.
# Checked in the suite: hadolint, every RUN step's shell, and the installed size (tests/test_images.py).
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
# wheels of the agent and of everything it needs: the core, the Kubernetes client, S3
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[k8s,s3]"

FROM ${PYTHON_IMAGE}
ARG SDCWATCH_VERSION
LABEL org.opencontainers.image.title="sdcwatch agent" \
      org.opencontainers.image.description="GPU reliability and silent-data-corruption monitor: node agent" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 sdcwatch \
 && useradd --system --uid 10001 --gid sdcwatch --no-create-home --home-dir /var/lib/sdcwatch \
      --shell /usr/sbin/nologin sdcwatch
COPY --from=build /wheels /wheels
# from the wheels just built, nothing from an index: the build stage resolved every version
RUN pip install --no-cache-dir --no-index --find-links /wheels "sdcwatch[k8s,s3]==${SDCWATCH_VERSION}" \
 && rm -rf /wheels
ENV SDCWATCH_CANARY_ENABLED=false \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 9464 9465
ENTRYPOINT ["sdcwatch"]
CMD ["run", "--state-dir=/var/lib/sdcwatch", "--socket=/run/sdcwatch/agent.sock"]
