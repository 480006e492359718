#!/usr/bin/env bash
# Build deploy/docker/agent.Dockerfile for real on a Debian machine that reaches Debian's mirrors and PyPI
# but no container registry (this workplace): python:3.12-slim cannot be pulled, so a stand-in base is made
# from Debian (debootstrap minbase) plus this machine's own CPython (scripts/stand_in_python_base.sh), and
# the Dockerfile is built on it with PYTHON_IMAGE pointing there. Every RUN step of the Dockerfile runs; the layers the Dockerfile adds are
# measured with `docker history` (the stand-in base is larger than python:3.12-slim: add the real base's size,
# ~125-130 MB, to the layers to get the image's). Needs root; installs docker.io and debootstrap with apt;
# starts its own dockerd (vfs storage, no iptables, host network for builds) and stops it at the end.
# Without a Docker engine: scripts/build_agent_image_buildah.sh (Debian's buildah, daemonless).
#
#   sudo bash scripts/build_agent_image_local.sh [WORKDIR]     # default WORKDIR: /tmp/sdcwatch-image-build
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/sdcwatch-image-build}
BASE=sdcwatch-local/python-base:latest
TAG=sdcwatch-agent:local
mkdir -p "$WORK"
export DOCKER_HOST="unix://$WORK/docker.sock"

command -v dockerd > /dev/null && command -v debootstrap > /dev/null \
  || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap

dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=vfs --data-root="$WORK/root" \
  --exec-root="$WORK/exec" --pidfile="$WORK/dockerd.pid" -H "$DOCKER_HOST" > "$WORK/dockerd.log" 2>&1 &
DOCKERD=$!
# dockerd leaves its default network namespace mounted under its exec root: unmounted, so WORK can be removed
trap 'kill "$DOCKERD" 2> /dev/null || true; wait "$DOCKERD" 2> /dev/null || true
  umount "$WORK/exec/netns/default" 2> /dev/null || true' EXIT
for _ in $(seq 60); do docker version > /dev/null 2>&1 && break; sleep 1; done
docker version > /dev/null

if ! docker image inspect "$BASE" > /dev/null 2>&1; then
  ROOTFS="$WORK/rootfs"
  bash "$ROOT/scripts/stand_in_python_base.sh" "$ROOTFS"
  tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' - "$BASE"
fi

docker build --network host --build-arg PYTHON_IMAGE="$BASE" -f "$ROOT/deploy/docker/agent.Dockerfile" \
  -t "$TAG" "$ROOT"
# what the Dockerfile adds on top of its base, layer by layer
docker history --no-trunc --format '{{.Size}}\t{{.CreatedBy}}' "$TAG" | cut -c1-110
docker image inspect --format '{{.Size}}' "$TAG" "$BASE" | paste -sd' ' | awk \
  '{printf "image %.0f MB = stand-in base %.0f MB + %.0f MB of layers\n", $1/1e6, $2/1e6, ($1-$2)/1e6}'
docker run --rm --entrypoint python "$TAG" \
  -c "import os, daemon.compose, daemon.k8s_nodes, lightkube, boto3; print('uid', os.getuid(), 'imports ok')"
# the agent starts in it, as user 10001, on a simulated clean node (NVML from a scenario file)
NAME=sdcwatch-agent-check-$$
docker run -d --rm --name "$NAME" --network host -v "$ROOT/tests/scenarios:/scenarios:ro" "$TAG" run \
  --state-dir=/tmp/state --socket=/tmp/state/agent.sock --metrics-listen=127.0.0.1:0 \
  --nvml-scenario=/scenarios/clean.json > /dev/null
for _ in $(seq 120); do docker logs "$NAME" 2>&1 | grep -q agent.ready && break; sleep 1; done
docker logs "$NAME" 2>&1 | grep agent.ready || { docker logs "$NAME"; docker rm -f "$NAME"; exit 1; }
docker rm -f "$NAME" > /dev/null
echo "agent image $TAG: built, the agent started in it"
