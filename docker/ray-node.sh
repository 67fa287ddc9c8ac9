#!/usr/bin/env bash
# One node of the two-container Ray job (compose/ray.yaml), in the project image as /app/tools/ray-node.sh.
#   ray-node.sh head SCRIPT ARGS...     start the Ray head here, wait until the cluster offers the CPUs of
#                                       both nodes (the worker node has joined), run SCRIPT on it with one
#                                       worker per CPU, stop the head; the exit status is SCRIPT's
#   ray-node.sh worker HEAD_HOST:PORT   join that head, stay until it stops, then stop and exit 0
# Environment: NODE_CPUS (CPUs this node offers, default 2), PEER_CPUS (head: the worker node's, default 2),
# JOIN_TIMEOUT (seconds the head waits for the worker node and the worker node for the head, default 60).
# Each container has its own process table, so `ray stop` here ends this container's Ray only.
set -uo pipefail

cpus=${NODE_CPUS:-2}
join_timeout=${JOIN_TIMEOUT:-60}
port=6379
# a small object store: the job passes no data through it, and the container's /dev/shm is 1 GB
ray_opts=(--num-cpus="$cpus" --disable-usage-stats --object-store-memory=100000000)
trap 'ray stop >/dev/null 2>&1; exit 143' TERM INT

usage() {
  echo "usage: $0 head SCRIPT [ARGS...] | worker HEAD_HOST:PORT" >&2
  exit 2
}

case ${1:-} in
head)
  [ $# -ge 2 ] || usage
  shift
  workers=$((cpus + ${PEER_CPUS:-2}))
  ray start --head --port="$port" --include-dashboard=false "${ray_opts[@]}" || exit
  # The driver places its workers on what the cluster offers when it starts: wait for the other node.
  python - "$workers" "$join_timeout" <<'EOF'
import sys
import time

import ray

ray.init(address="auto", logging_level="ERROR")
workers, wait = float(sys.argv[1]), float(sys.argv[2])
deadline = time.monotonic() + wait
while (cpus := ray.cluster_resources().get("CPU", 0)) < workers:
    if time.monotonic() > deadline:
        sys.exit(f"error: the Ray cluster offers {cpus:g} CPUs after {wait:g} s, not {workers:g}: "
                 "did the worker node join?")
    time.sleep(1)
EOF
  status=$?
  if [ "$status" -eq 0 ]; then
    python "$@" --address="$HOSTNAME:$port" --nproc="$workers"
    status=$?
  fi
  ray stop
  exit "$status"
  ;;
worker)
  [ $# -eq 2 ] || usage
  head=$2
  deadline=$((SECONDS + join_timeout))
  until timeout 60 ray start --address="$head" "${ray_opts[@]}"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "error: no Ray head answered at $head within $join_timeout s" >&2
      exit 1
    fi
    sleep 2
  done
  # The head's node runs the job: stay in the cluster until the head stops (its port closes or its name
  # goes away with its container).
  while (exec 3<>"/dev/tcp/${head%:*}/${head##*:}") 2>/dev/null; do
    sleep 2
  done
  echo "the Ray head at $head has stopped: leaving"
  ray stop --force >/dev/null # without their head, this node's Ray processes would wait out a grace period
  exit 0
  ;;
*)
  usage
  ;;
esac
