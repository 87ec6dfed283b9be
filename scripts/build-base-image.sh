#!/usr/bin/env bash
# Build a python:3.11-slim compatible base image from Debian packages, for machines that reach a
# Debian mirror but no image registry (air-gapped or behind a mirror). Needs root, mmdebstrap and
# podman (or docker). The result: Debian bookworm minbase + python3 + python3-venv +
# ca-certificates + passwd, with a virtual environment at /usr/local, so `python`, `pip` and
# site-packages sit where the official image has them and `pip install` works (no PEP 668 refusal).
#
#   scripts/build-base-image.sh                 # tags localhost/python:3.11-slim
#   BASE_TAG=localhost/calibrl-python:3.11 DEBIAN_MIRROR=http://mirror.example/debian \
#     scripts/build-base-image.sh
#
# `FROM python:3.11-slim` then resolves to the local image without a pull
# (podman: short names resolve to localhost/ first when such an image exists).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_TAG="${BASE_TAG:-localhost/python:3.11-slim}"
DEBIAN_SUITE="${DEBIAN_SUITE:-bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SECURITY="${DEBIAN_SECURITY:-http://deb.debian.org/debian-security}"
ENGINE="${ENGINE:-podman}"
if [ "$ENGINE" = podman ]; then . scripts/podman-env.sh; fi

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT
# No documentation, manual pages or translations in the image (the copyright files stay).
mmdebstrap --variant=minbase --mode=root \
  --include=python3,python3-venv,ca-certificates,passwd \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook='chroot "$1" python3 -m venv /usr/local' \
  --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*.log' \
  "$DEBIAN_SUITE" "$workdir/rootfs.tar" \
  "deb $DEBIAN_MIRROR $DEBIAN_SUITE main" \
  "deb $DEBIAN_MIRROR $DEBIAN_SUITE-updates main" \
  "deb $DEBIAN_SECURITY $DEBIAN_SUITE-security main"
"$ENGINE" import \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$workdir/rootfs.tar" "$BASE_TAG"
"$ENGINE" run --rm "$BASE_TAG" python -c 'import sys, ssl, venv; print(sys.version.split()[0], sys.prefix)'
