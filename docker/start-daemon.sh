#!/usr/bin/env bash
# Make a Docker daemon and the pinned Compose available on a Debian/Ubuntu machine that has none (CI).
# Compose: docker/install-compose.sh (the `docker compose` plugin, skipped when already the pinned version).
# Daemon: nothing to do when `docker info` already answers; otherwise, as root, installs docker.io and
# iptables from the distribution (retried), starts dockerd in the background and waits, bounded, until it
# answers.
#   docker/start-daemon.sh            environment: DOCKERD_WAIT (seconds, default 60),
#                                     DOCKERD_LOG (default /var/log/dockerd.log)
set -euo pipefail

wait_s=${DOCKERD_WAIT:-60}
log=${DOCKERD_LOG:-/var/log/dockerd.log}

if docker info >/dev/null 2>&1; then
  echo "docker daemon already running"
  exec "$(dirname "$0")/install-compose.sh"
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "no reachable docker daemon, and starting one needs root" >&2
  exit 1
fi

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v iptables >/dev/null || missing+=(iptables)
if [ ${#missing[@]} -gt 0 ]; then
  "$(dirname "$0")/../harness/apt_install.sh" "${missing[@]}"
fi

if ! docker info >/dev/null 2>&1; then
  nohup dockerd >"$log" 2>&1 &
  echo "started dockerd (pid $!), log in $log"
  deadline=$((SECONDS + wait_s))
  until docker info >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "dockerd did not answer within ${wait_s}s; last lines of $log:" >&2
      tail -n 30 "$log" >&2
      exit 1
    fi
    sleep 1
  done
fi
docker version --format 'docker daemon {{.Server.Version}} ready'
"$(dirname "$0")/install-compose.sh"
