#!/usr/bin/env bash
# Build a small Debian 12 base image without any container registry: debootstrap a minbase root
# filesystem with python3 and python3-venv, add this machine's CA bundle (so pip and uv work behind a
# TLS-intercepting proxy), and `docker import` it. The project Dockerfile builds on it with
#   docker build --build-arg BASE_IMAGE=local/ddp-base:bookworm .
#   docker/build-base.sh [TAG]      TAG defaults to local/ddp-base:bookworm; REBUILD=1 rebuilds an
#                                   existing image. Environment: DEBIAN_MIRROR (default: debootstrap's
#                                   own), CA_BUNDLE. Needs root.
set -euo pipefail

tag=${1:-local/ddp-base:bookworm}
ca_bundle=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

if [ "${REBUILD:-0}" != 1 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag exists (REBUILD=1 to rebuild); next: BASE_IMAGE=$tag docker compose up"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "debootstrap needs root" >&2
  exit 1
fi

command -v debootstrap >/dev/null || "$(dirname "$0")/../harness/apt_install.sh" debootstrap

rootfs=$(mktemp -d /tmp/ddp-base.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"}
if [ -f "$ca_bundle" ]; then
  cp "$ca_bundle" "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*

cert=/etc/ssl/certs/ca-certificates.crt
tar -C "$rootfs" -c . | docker import \
  -c "ENV SSL_CERT_FILE=$cert PIP_CERT=$cert REQUESTS_CA_BUNDLE=$cert" \
  -c 'CMD ["/bin/bash"]' - "$tag"
echo "built $tag; next: BASE_IMAGE=$tag docker compose up (or make two-node-cpu BASE_IMAGE=$tag)"
