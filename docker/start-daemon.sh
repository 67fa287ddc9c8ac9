#!/usr/bin/env bash
# Make a Docker daemon and docker-compose available on a Debian/Ubuntu machine that has none (CI).
# Does nothing when `docker info` already answers. Otherwise, as root: installs docker.io,
# docker-compose (v1) and iptables from the distribution (retried), starts dockerd in the background
# and waits, bounded, until it answers.
#   docker/start-daemon.sh            environment: DOCKERD_WAIT (seconds, default 60),
#                                     DOCKERD_LOG (default /var/log/dockerd.log)
set -euo pipefail

wait_s=${DOCKERD_WAIT:-60}
log=${DOCKERD_LOG:-/var/log/dockerd.log}

have_compose() {
  docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null
}

if docker info >/dev/null 2>&1 && have_compose; then
  echo "docker daemon already running"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "no reachable docker daemon, and starting one needs root" >&2
  exit 1
fi

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
have_compose || missing+=(docker-compose)
command -v iptables >/dev/null || missing+=(iptables)
if [ ${#missing[@]} -gt 0 ]; then
  "$(dirname "$0")/../tools/apt-install.sh" "${missing[@]}"
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
