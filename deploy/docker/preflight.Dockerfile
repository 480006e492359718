# The preflight canary: sdcwatch with torch (CUDA wheels from PyPI bundle the CUDA runtime; the driver comes
# from the host through the NVIDIA container runtime). Runs the known-answer GEMMs and exits 0 pass,
# 1 fail, 2 could not run: a Kubernetes Job or initContainer before a job lands, or the Slurm prolog.
#   docker build -f deploy/docker/preflight.Dockerfile -t sdcwatch-preflight:0.1.0 .
#   docker run --rm --runtime nvidia --gpus all sdcwatch-preflight:0.1.0 canary --level quick
# Its `run` is also the agent with the agent's own idle-GPU canaries (the image is larger: torch).
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
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG SDCWATCH_VERSION
LABEL org.opencontainers.image.title="sdcwatch preflight" \
      org.opencontainers.image.description="Known-answer GPU canaries (torch, CUDA) before a job lands" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 sdcwatch \
 && useradd --system --uid 10001 --gid sdcwatch --no-create-home --shell /usr/sbin/nologin sdcwatch
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --find-links /wheels "sdcwatch[torch,k8s,s3]==${SDCWATCH_VERSION}" \
 && rm -rf /wheels
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
ENTRYPOINT ["sdcwatch"]
CMD ["canary", "--level", "quick"]
