#!/usr/bin/env bash
# Install Debian/Ubuntu packages as root, retrying the whole download up to three times.
#   harness/apt_install.sh PACKAGE...
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 PACKAGE..." >&2; exit 2; }
export DEBIAN_FRONTEND=noninteractive
for try in 1 2 3; do
  if apt-get update -q && apt-get install -y -q --no-install-recommends "$@"; then
    exit 0
  fi
  echo "apt-get install $* failed (try $try of 3)" >&2
  [ "$try" -eq 3 ] || sleep $((try * 5))
done
exit 1
