#!/usr/bin/env bash
# Build deploy/docker/agent.Dockerfile for real with buildah, Debian's daemonless builder (no Docker engine,
# no daemon), on a machine that reaches Debian's mirrors and PyPI but no container registry (this
# workplace): the base is a stand-in made from Debian (scripts/stand_in_python_base.sh), committed to
# buildah's local storage, and the Dockerfile is built on it with PYTHON_IMAGE pointing there. Every RUN step
# of the Dockerfile runs (chroot isolation, the host's network). Then the image's agent is started in a
# container (buildah run, as the image's user) on a simulated clean node and must report agent.ready.
# Prints the seconds each phase took and the layers the Dockerfile adds over its base (the stand-in base is
# larger than python:3.12-slim: add the real base's ~125-130 MB to the layers to get the image's size).
# Needs root; installs buildah and debootstrap with apt when missing. Storage: vfs under WORKDIR (removed
# with it), so it works inside containers and touches no system-wide image store.
#
#   sudo bash scripts/build_agent_image_buildah.sh [WORKDIR]   # default WORKDIR: /tmp/sdcwatch-buildah
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/sdcwatch-buildah}
BASE=localhost/sdcwatch-local/python-base:latest
TAG=localhost/sdcwatch-agent:buildah
mkdir -p "$WORK"
BUILDAH=(buildah --root "$WORK/storage" --runroot "$WORK/run" --storage-driver vfs)
t0=$(date +%s)
phase() { echo "[$(($(date +%s) - t0)) s] $*"; }

command -v buildah > /dev/null && command -v debootstrap > /dev/null \
  || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah debootstrap
phase "buildah $(buildah --version | awk '{print $3}')"

if ! "${BUILDAH[@]}" inspect --type image "$BASE" > /dev/null 2>&1; then
  bash "$ROOT/scripts/stand_in_python_base.sh" "$WORK/rootfs"
  phase "stand-in base root file system"
  ctr=$("${BUILDAH[@]}" from scratch)
  "${BUILDAH[@]}" copy --quiet "$ctr" "$WORK/rootfs/" / > /dev/null
  "${BUILDAH[@]}" config --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --cmd python3 "$ctr"
  "${BUILDAH[@]}" commit --quiet "$ctr" "$BASE" > /dev/null
  "${BUILDAH[@]}" rm "$ctr" > /dev/null
  phase "stand-in base committed as $BASE"
fi

"${BUILDAH[@]}" build --isolation chroot --network host --build-arg PYTHON_IMAGE="$BASE" \
  -f "$ROOT/deploy/docker/agent.Dockerfile" -t "$TAG" "$ROOT" > "$WORK/build.log" 2>&1 \
  || { tail -n 40 "$WORK/build.log"; exit 1; }
phase "agent image built: $TAG (log: $WORK/build.log)"
"${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}'
echo "the Dockerfile's steps in the final stage's history:"
"${BUILDAH[@]}" inspect --type image "$TAG" | python3 -c 'import json, sys
for h in json.load(sys.stdin)["Docker"].get("history", [])[-6:]:
    print("  ", h.get("created_by", "")[:100])'

# the agent starts in it, as the image's user, on a simulated clean node (NVML from a scenario file)
ctr=$("${BUILDAH[@]}" from --quiet "$TAG")
mnt=$("${BUILDAH[@]}" mount "$ctr")
du -sm "$mnt" | awk '{print "image root file system: " $1 " MB (the stand-in base included)"}'
mkdir -p "$mnt/scenarios" "$mnt/tmp/state"
cp "$ROOT/tests/scenarios/clean.json" "$mnt/scenarios/"
chown 10001:10001 "$mnt/tmp/state"
"${BUILDAH[@]}" umount "$ctr" > /dev/null
run() { "${BUILDAH[@]}" run --isolation chroot --network host --user 10001:10001 "$ctr" -- "$@"; }
run python -c "import os, daemon.compose, daemon.k8s_nodes, lightkube, boto3; print('uid', os.getuid(), 'imports ok')"
# started in the background inside the container, stopped by its PID once ready (or after 120 s)
run sh -c 'sdcwatch run --state-dir=/tmp/state --socket=/tmp/state/agent.sock --metrics-listen=127.0.0.1:0 \
    --nvml-scenario=/scenarios/clean.json > /tmp/state/agent.log 2>&1 & pid=$!
  i=0
  until grep -q agent.ready /tmp/state/agent.log; do
    i=$((i + 1)); if [ "$i" -gt 240 ] || ! kill -0 "$pid" 2> /dev/null; then break; fi; sleep 0.5
  done
  kill -TERM "$pid" 2> /dev/null; wait "$pid"
  grep agent.ready /tmp/state/agent.log || { cat /tmp/state/agent.log; exit 1; }' \
  || { echo "the agent did not report agent.ready in the image" >&2; "${BUILDAH[@]}" rm "$ctr" > /dev/null; exit 1; }
"${BUILDAH[@]}" rm "$ctr" > /dev/null
phase "agent image $TAG: built with buildah, the agent started in it (agent.ready)"
