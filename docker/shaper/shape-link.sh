#!/usr/bin/env bash
# Shape what leaves this network namespace through DEVICE: at most RATE, and DELAY added when the kernel has
# netem. Then stay until DEVICE goes away (the container whose namespace this is has stopped) or a stop
# signal comes, so that `docker compose up` ends with the job.
#   shape-link RATE [DELAY] [DEVICE]    RATE as tc writes it (100mbit, 1gbit, 500kbit), DELAY like 5ms,
#                                       DEVICE defaults to eth0. Needs NET_ADMIN.
# A qdisc shapes egress only: shape both ends of a link for the same rate both ways.
set -euo pipefail

usage="usage: shape-link RATE [DELAY] [DEVICE]   e.g. shape-link 100mbit 5ms eth0"
rate=${1:-}
delay=${2:-}
dev=${3:-eth0}
if ! [[ $rate =~ ^[0-9]+(\.[0-9]+)?[kmgt]?bit$ ]]; then
  echo "$usage" >&2
  echo "shape-link: error: RATE must be a number followed by bit, kbit, mbit, gbit or tbit, not '$rate'" >&2
  exit 2
fi
if [ -n "$delay" ] && ! [[ $delay =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]]; then
  echo "$usage" >&2
  echo "shape-link: error: DELAY must be a number followed by us, ms or s, not '$delay'" >&2
  exit 2
fi
if ! ip link show dev "$dev" >/dev/null 2>&1; then
  echo "shape-link: error: no network device $dev here" >&2
  exit 1
fi

# htb computes its own burst for the rate; one class takes all traffic (a fixed quantum: with a single
# class it only sets how much is sent per round, and htb's default from the rate is out of range at 1gbit).
tc qdisc replace dev "$dev" root handle 1: htb default 1
tc class replace dev "$dev" parent 1: classid 1:1 htb rate "$rate" ceil "$rate" quantum 60000
shaped="rate $rate"
if [ -n "$delay" ]; then
  if err=$(tc qdisc replace dev "$dev" parent 1:1 handle 10: netem delay "$delay" 2>&1); then
    shaped="$shaped, delay $delay"
  else
    echo "shape-link: warning: cannot add delay $delay: this kernel has no netem qdisc ($err)." \
      "Shaping bandwidth only." >&2
  fi
fi
echo "shape-link: $(hostname) $dev egress shaped: $shaped"

trap 'exit 0' TERM INT
while ip link show dev "$dev" >/dev/null 2>&1; do
  sleep 1
done
echo "shape-link: $dev is gone, the node has stopped"
