#!/usr/bin/env bash
# RTT emulation with network namespaces + veth + tc netem (needs root and the sch_netem module).
#
#   scripts/netem.sh check          exit 0 if netem works here; otherwise say why, name the fallback, exit 3
#   scripts/netem.sh up RTT_MS      create namespaces specdec-cloud (10.201.0.1) and specdec-edge (10.201.0.2)
#                                   joined by a veth pair, with RTT_MS/2 of netem delay on each end
#   scripts/netem.sh set RTT_MS     change the delay of an existing set-up
#   scripts/netem.sh down           remove both namespaces
#   scripts/netem.sh exec cloud|edge CMD...   run CMD inside a namespace
#
# Where netem is missing (e.g. "Specified qdisc kind is unknown"), `specdec bench` uses the asyncio
# delay proxy instead:  python -m specdec.remote.delay_proxy --listen PORT --to HOST:PORT --rtt-ms R
set -euo pipefail

CLOUD_NS=specdec-cloud
EDGE_NS=specdec-edge
CLOUD_IF=sd-cloud0
EDGE_IF=sd-edge0
CLOUD_IP=10.201.0.1
EDGE_IP=10.201.0.2
FALLBACK="the bench uses the asyncio delay proxy instead (python -m specdec.remote.delay_proxy --listen PORT --to HOST:PORT --rtt-ms R)"

die() { echo "netem.sh: $*" >&2; exit 2; }

unavailable() {
    echo "netem unavailable: $1; $FALLBACK"
    exit 3
}

half_delay() {  # RTT_MS -> "<RTT/2>ms" (netem takes fractional milliseconds)
    [[ "$1" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "RTT must be a number of milliseconds, got '$1'"
    awk -v r="$1" 'BEGIN { printf "%.3fms", r / 2 }'
}

create() {  # NS_A NS_B IF_A IF_B IP_A IP_B
    ip netns add "$1"
    ip netns add "$2"
    ip link add "$3" netns "$1" type veth peer name "$4" netns "$2"
    ip -n "$1" addr add "$5/24" dev "$3"
    ip -n "$2" addr add "$6/24" dev "$4"
    for ns in "$1" "$2"; do ip -n "$ns" link set lo up; done
    ip -n "$1" link set "$3" up
    ip -n "$2" link set "$4" up
}

remove() {  # NS...
    for ns in "$@"; do ip netns del "$ns" 2>/dev/null || true; done
}

qdisc() {  # add|change RTT_MS NS_A IF_A NS_B IF_B
    local d
    d=$(half_delay "$2")
    ip netns exec "$3" tc qdisc "$1" dev "$4" root netem delay "$d" limit 100000
    ip netns exec "$5" tc qdisc "$1" dev "$6" root netem delay "$d" limit 100000
}

check() {
    [[ $(id -u) -eq 0 ]] || unavailable "needs root (network namespaces and tc)"
    command -v ip >/dev/null || unavailable "the 'ip' command (iproute2) is missing"
    command -v tc >/dev/null || unavailable "the 'tc' command (iproute2) is missing"
    local a="specdec-chk-a-$$" b="specdec-chk-b-$$" err
    trap 'remove "$a" "$b"' EXIT
    err=$(create "$a" "$b" sdchka0 sdchkb0 10.202.0.1 10.202.0.2 2>&1) \
        || unavailable "cannot create namespaces and a veth pair ($(echo "$err" | head -n1))"
    err=$(ip netns exec "$a" tc qdisc add dev sdchka0 root netem delay 1ms 2>&1) \
        || unavailable "the kernel has no netem qdisc ($(echo "$err" | head -n1))"
    echo "netem available"
}

up() {
    local rtt=${1:?usage: netem.sh up RTT_MS}
    half_delay "$rtt" >/dev/null
    [[ $(id -u) -eq 0 ]] || unavailable "needs root (network namespaces and tc)"
    remove "$CLOUD_NS" "$EDGE_NS"
    create "$CLOUD_NS" "$EDGE_NS" "$CLOUD_IF" "$EDGE_IF" "$CLOUD_IP" "$EDGE_IP"
    if ! err=$(qdisc add "$rtt" "$CLOUD_NS" "$CLOUD_IF" "$EDGE_NS" "$EDGE_IF" 2>&1); then
        remove "$CLOUD_NS" "$EDGE_NS"
        unavailable "the kernel has no netem qdisc ($(echo "$err" | head -n1))"
    fi
    echo "netem up: cloud $CLOUD_NS $CLOUD_IP <-> edge $EDGE_NS $EDGE_IP, RTT ${rtt} ms"
}

set_rtt() {
    local rtt=${1:?usage: netem.sh set RTT_MS}
    qdisc change "$rtt" "$CLOUD_NS" "$CLOUD_IF" "$EDGE_NS" "$EDGE_IF"
    echo "netem RTT ${rtt} ms"
}

run_in() {
    local side=${1:?usage: netem.sh exec cloud|edge CMD...}
    shift
    case "$side" in
        cloud) exec ip netns exec "$CLOUD_NS" "$@" ;;
        edge) exec ip netns exec "$EDGE_NS" "$@" ;;
        *) die "exec needs 'cloud' or 'edge', got '$side'" ;;
    esac
}

case "${1:-}" in
    check) check ;;
    up) up "${2:-}" ;;
    set) set_rtt "${2:-}" ;;
    down) remove "$CLOUD_NS" "$EDGE_NS"; echo "netem down" ;;
    exec) shift; run_in "$@" ;;
    *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
