#!/usr/bin/env bash
# all_reduce between emulated machines with rate-limited links: N network namespaces with their
# own hostnames (tests/cluster/shaped_cluster.sh), L ranks each, `lockstep run` per node running
# bench/net_allreduce, for each rate in RATES. Rank 0's table compares every size with the time
# a ring needs at that rate.
#
#   bench/shaped_net.sh [BUILD_DIR]     (root; BUILD_DIR defaults to build/release)
#   NODES=4 NPROC=1 RATES="1gbit" BACKEND=gloo ARGS="--max-bytes 16777216" bench/shaped_net.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath "${1:-$root/build/release}")
tool=$build/tools/lockstep bench=$build/bench/net_allreduce
fail() { echo "FAIL: $*" >&2; exit 1; }
[ -x "$tool" ] && [ -x "$bench" ] || fail "build lockstep and bench/net_allreduce first"
source "$root/tests/cluster/shaped_cluster.sh"
nodes=${NODES:-4} nproc=${NPROC:-1} rates=${RATES:-1gbit}
work=$(mktemp -d)
shaped_cluster_up "$nodes"
trap 'shaped_cluster_down; rm -rf "$work"' EXIT
(umask 077 && head -c 24 /dev/urandom | base64 > "$work/token")
port=$((29000 + $$ % 1000)) runs=0

for rate in $rates; do
  shaped_cluster_rate "$rate"
  gbps=$(awk -v r="$rate" 'BEGIN { if (r ~ /gbit$/) print r + 0; else if (r ~ /mbit$/) print (r + 0) / 1000; else print 100 }')
  runs=$((runs + 1)) pids=()
  for ((i = 0; i < nodes; i++)); do
    LOCKSTEP_BACKEND=${BACKEND:-auto} OMP_NUM_THREADS=1 \
      LOCKSTEP_NET_ALPHA_US=${LOCKSTEP_NET_ALPHA_US:-} LOCKSTEP_NET_GBPS=${LOCKSTEP_NET_GBPS:-} \
      LOCKSTEP_ALLREDUCE_ALGO=${LOCKSTEP_ALLREDUCE_ALGO:-} sc_exec "$i" timeout 900 "$tool" run \
      --nnodes "$nodes" --node-rank "$i" --master-addr "${sc_addr[0]}" --master-port "$port" \
      --nproc-per-node "$nproc" --token-file "$work/token" --run-id "r$runs" \
      "$bench" --gbps "$gbps" ${ARGS:-} > "$work/r$runs.$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < nodes; i++)); do
    wait "${pids[i]}" || { cat "$work/r$runs.$i.log"; fail "node $i's job failed"; }
  done
  echo "# $nodes nodes x $nproc ranks, rate $rate, $(nproc) cores, $(date -u +%FT%TZ)"
  cat "$work/r$runs.0.log"
done
