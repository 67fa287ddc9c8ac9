#!/usr/bin/env bash
# Simulated hosts on one machine: a Linux bridge plus one network namespace per host.
#   harness/netns.sh up   NAME SUBNET HOST...   e.g. up ddp 10.77.1 node0 node1
#   harness/netns.sh down NAME HOST...
# The bridge NAME-br gets SUBNET.1 on this machine; HOST number i (from 0) is namespace NAME-HOST
# with address SUBNET.(i+2)/24 on interface eth0, so a command run there sees a host much like a container.
# /etc/netns/NAME-HOST/hosts maps every HOST name (and this machine's own name to loopback), and an empty
# resolv.conf keeps lookups local, so `ip netns exec` resolves names at once without any DNS. Needs root.
set -euo pipefail

usage() {
  echo "usage: $0 up NAME SUBNET HOST... | down NAME HOST..." >&2
  exit 2
}

[ $# -ge 2 ] || usage
action=$1 name=$2
shift 2
bridge="${name}-br"

down() {
  for host in "$@"; do
    ip netns del "${name}-${host}" 2>/dev/null || true
    rm -rf "/etc/netns/${name}-${host}"
  done
  if command -v iptables >/dev/null; then
    while iptables -D FORWARD -i "$bridge" -o "$bridge" -j ACCEPT 2>/dev/null; do :; done
  fi
  ip link del "$bridge" 2>/dev/null || true
}

case "$action" in
  up)
    [ $# -ge 2 ] || usage
    subnet=$1
    shift
    down "$@"
    ip link add "$bridge" type bridge
    ip addr add "${subnet}.1/24" dev "$bridge"
    ip link set "$bridge" up
    # A running dockerd sets the FORWARD policy to DROP; let traffic between our own hosts through.
    if command -v iptables >/dev/null; then
      iptables -I FORWARD -i "$bridge" -o "$bridge" -j ACCEPT 2>/dev/null || true
    fi
    hosts=""
    i=2
    for host in "$@"; do
      hosts+="${subnet}.${i} ${host}"$'\n'
      i=$((i + 1))
    done
    i=2
    for host in "$@"; do
      ns="${name}-${host}"
      veth="${name}${i}"
      ip netns add "$ns"
      ip link add "$veth" type veth peer name eth0 netns "$ns"
      ip link set "$veth" master "$bridge" up
      ip -n "$ns" addr add "${subnet}.${i}/24" dev eth0
      ip -n "$ns" link set eth0 up
      ip -n "$ns" link set lo up
      mkdir -p "/etc/netns/${ns}"
      printf '127.0.0.1 localhost %s\n%s' "$(uname -n)" "$hosts" >"/etc/netns/${ns}/hosts"
      : >"/etc/netns/${ns}/resolv.conf"
      printf '%s\n' "$host" >"/etc/netns/${ns}/hostname"
      i=$((i + 1))
    done
    ;;
  down) down "$@" ;;
  *) usage ;;
esac
