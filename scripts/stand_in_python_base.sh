#!/usr/bin/env bash
# A stand-in for the python:3.X-slim base image, for machines that reach Debian's mirrors and PyPI but no
# container registry (this workplace): Debian bookworm minbase (debootstrap) plus this machine's own CPython
# as /usr/local, its standard library without tests, site-packages or GUI modules, pip from ensurepip.
# Writes the root file system to ROOTFS (kept: a second call reuses it). Used by
# scripts/build_agent_image_local.sh (Docker engine) and scripts/build_agent_image_buildah.sh (daemonless).
# Needs root and debootstrap.
#
#   sudo bash scripts/stand_in_python_base.sh ROOTFS
set -euo pipefail

ROOTFS=${1:?usage: stand_in_python_base.sh ROOTFS}
if [ -x "$ROOTFS/usr/local/bin/python3" ] && [ -f "$ROOTFS/.sdcwatch-stand-in-base" ]; then
  exit 0
fi
[ -x "$ROOTFS/bin/sh" ] || debootstrap --variant=minbase bookworm "$ROOTFS" http://deb.debian.org/debian
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
chroot "$ROOTFS" /bin/sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
  --no-install-recommends libssl3 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 libreadline8 libncursesw6 \
  libuuid1 zlib1g libexpat1 libnsl2 libtirpc3 ca-certificates netbase \
  && apt-get clean && rm -rf /var/lib/apt/lists/*'
PY=$(python3 -c 'import sys; print(sys.base_prefix)')
VER=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
mkdir -p "$ROOTFS/usr/local/bin" "$ROOTFS/usr/local/lib/python$VER/site-packages"
cp -a "$PY/bin/python$VER" "$ROOTFS/usr/local/bin/"
ln -sf "python$VER" "$ROOTFS/usr/local/bin/python3"
ln -sf "python$VER" "$ROOTFS/usr/local/bin/python"
cp -a "$PY"/lib/libpython"$VER".so* "$ROOTFS/usr/local/lib/" 2> /dev/null || true
tar -C "$PY/lib" -c --exclude="python$VER/site-packages" --exclude="python$VER/test" \
  --exclude="python$VER/config-$VER-*/*.a" --exclude="python$VER/idlelib" --exclude="python$VER/tkinter" \
  --exclude="python$VER/turtledemo" "python$VER" | tar -x -C "$ROOTFS/usr/local/lib"
echo /usr/local/lib > "$ROOTFS/etc/ld.so.conf.d/usr-local.conf"
chroot "$ROOTFS" /sbin/ldconfig
# this machine's CA bundle: PyPI may be reached through a proxy with its own CA
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
chroot "$ROOTFS" /usr/local/bin/python -m ensurepip --default-pip > /dev/null
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb
touch "$ROOTFS/.sdcwatch-stand-in-base"
