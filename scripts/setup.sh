#!/usr/bin/env bash
# Install sdcwatch into ./.venv on a fresh Debian machine (Python >= 3.10).
#   bash scripts/setup.sh          the package with the training side and the demo: sdcwatch[demo]
#                                  (the core, which runs the agent, + torch + matplotlib)
#   bash scripts/setup.sh --test   sdcwatch[test] (also psutil and the test tools) and the system packages
#                                  the tests start (Prometheus' promtool and Alertmanager, redis-server and
#                                  redis-sentinel from Debian)
# torch: `pip install torch==2.13.0` (the CPU wheel where one is provided locally, never a CUDA download);
# a torch already in the venv that satisfies the requirement is kept. The agent alone needs none of it:
# `pip install sdcwatch` is the core.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

apt_pkgs=()
python3 -c 'import ensurepip, venv' 2>/dev/null || apt_pkgs+=(python3-venv)
# the compute checks' C++ comm hook is built on first use (checksums/native_hook.py): a C++ compiler and the
# Python headers (without them the checks run through the Python hook, with more host time a bucket)
command -v c++ >/dev/null || apt_pkgs+=(g++)
python3 -c 'import os, sysconfig as s; assert os.path.isfile(s.get_paths()["include"] + "/Python.h")' \
  2>/dev/null || apt_pkgs+=(python3-dev)
if [ "$want_test" = 1 ]; then
  command -v promtool >/dev/null || apt_pkgs+=(prometheus)
  command -v prometheus-alertmanager >/dev/null || command -v alertmanager >/dev/null || apt_pkgs+=(prometheus-alertmanager)
  # the Sentinel HA tests start real redis-server and redis-sentinel processes (tests/sentinel_support.py)
  command -v redis-server >/dev/null || apt_pkgs+=(redis-server)
  command -v redis-sentinel >/dev/null || apt_pkgs+=(redis-sentinel)
  # tests/test_image_run_steps.py runs the agent Dockerfile's clean-up step (readelf, strip) and its
  # groupadd/useradd (in a temp /etc)
  command -v strip >/dev/null && command -v readelf >/dev/null || apt_pkgs+=(binutils)
  command -v useradd >/dev/null && command -v groupadd >/dev/null || apt_pkgs+=(passwd)
  # tests/test_images.py checks the systemd unit with systemd-analyze verify
  command -v systemd-analyze >/dev/null || apt_pkgs+=(systemd)
fi
if [ "${#apt_pkgs[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
    # the Debian packages start their services: the tests start their own on free ports
    for svc in prometheus prometheus-alertmanager prometheus-node-exporter redis-server redis-sentinel; do
      (systemctl stop "$svc" 2>/dev/null || service "$svc" stop 2>/dev/null || true) >/dev/null 2>&1
    done
  else
    echo "setup: please install: ${apt_pkgs[*]} (needs root)" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
if [ "$want_test" = 1 ]; then
  .venv/bin/python -m pip install -q -e '.[test]'
else
  .venv/bin/python -m pip install -q -e '.[demo]'
fi
# built now, so no rank pays the compile (~20 s) at its first step; a failure is said and is not fatal
.venv/bin/python -m checksums.native_hook >/dev/null \
  || echo "setup: the C++ comm hook was not built (above); the checks use the Python hook" >&2
echo "setup: sdcwatch installed in $(pwd)/.venv"
