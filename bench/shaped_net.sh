#!/usr/bin/env bash
# all_reduce between emulated machines with rate-limited links: N network namespaces with their
# own hostnames (tests/cluster/shaped_cluster.sh), L ranks each, `lockstep run` per node running
# bench/net_allreduce, for each rate in RATES. Rank 0's table compares every size with the time
# a ring needs at that rate.
#
#   bench/shaped_net.sh [BUILD_DIR]     (root; BUILD_DIR defaults to build/release)
#   NODES=4 NPROC=1 RATES="1gbit" BACKEND=gloo ARGS="--max-bytes 16777216" bench/shaped_net.sh
# The cost model's settings (LOCKSTEP_NET_ALPHA_US, LOCKSTEP_NET_GBPS, LOCKSTEP_ALLREDUCE_ALGO,
# LOCKSTEP_NET_CALIBRATE) are passed on to every node.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/bench/shaped_common.sh"
nproc=${NPROC:-1} rates=${RATES:-1gbit}
shaped_start "${NODES:-4}" "${1:-$root/build/release}" bench/net_allreduce

for rate in $rates; do
  shaped_cluster_rate "$rate"
  gbps=$(awk -v r="$rate" 'BEGIN { if (r ~ /gbit$/) print r + 0; else if (r ~ /mbit$/) print (r + 0) / 1000; else print 100 }')
  shaped_run "$rate" "$nproc" LOCKSTEP_BACKEND="${BACKEND:-auto}" \
    LOCKSTEP_NET_ALPHA_US="${LOCKSTEP_NET_ALPHA_US:-}" LOCKSTEP_NET_GBPS="${LOCKSTEP_NET_GBPS:-}" \
    LOCKSTEP_ALLREDUCE_ALGO="${LOCKSTEP_ALLREDUCE_ALGO:-}" \
    LOCKSTEP_NET_CALIBRATE="${LOCKSTEP_NET_CALIBRATE:-0}" -- \
    "$build/bench/net_allreduce" --gbps "$gbps" ${ARGS:-}
  echo "# $nodes nodes x $nproc ranks, rate $rate, $(nproc) cores, $(date -u +%FT%TZ)"
  cat "$work/$rate.0.log"
done
