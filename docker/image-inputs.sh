#!/bin/sh
# One checksum of what the image is built from: every file .dockerignore lets into the build context (its !
# lines, the Dockerfile and .dockerignore among them) but bytecode and snapshots, which Docker leaves out too.
# Computed alike on both sides: by the Dockerfile over its build context, into the image's /app/.image-inputs,
# whoever builds it (make or docker compose), and by `make image-current` over the working tree, which
# rebuilds only when the two differ.
#   docker/image-inputs.sh [DIR]            the checksum of DIR, a repository or a build context (default: .)
#   docker/image-inputs.sh --files [DIR]    the files it covers, one a line
set -eu
list=
if [ "${1:-}" = --files ]; then list=1; shift; fi
cd "${1:-.}"
# shellcheck disable=SC2046  # one path per ! line, none with spaces
files() { find $(sed -n 's/^!//p' .dockerignore) -type f ! -path '*/__pycache__/*' ! -name '*.pt' -print0 \
  | LC_ALL=C sort -z; }
if [ -n "$list" ]; then files | tr '\0' '\n'; else files | xargs -0 sha256sum | sha256sum | cut -c1-16; fi
