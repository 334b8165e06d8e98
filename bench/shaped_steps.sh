#!/usr/bin/env bash
# The Fashion-MNIST MLP's DDP step across machines with rate-limited links: N emulated machines
# (tests/cluster/shaped_cluster.sh: a network namespace and a hostname each, links through one
# bridge, tc tbf on both ends), one rank each, `lockstep run` per node. The marginal time per step
# is (time of 120 steps - time of 20 steps) / 100, so that start-up (loading the data, the
# rendezvous) cancels; each rate runs REPS times, alternating, and every pair is printed.
#
#   bench/shaped_steps.sh [BUILD_DIR]      (root; BUILD_DIR defaults to build/release)
#   NODES=4 RATES="1gbit none" REPS=2 BACKEND=gloo bench/shaped_steps.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath "${1:-$root/build/release}")
tool=$build/tools/lockstep mnist=$build/examples/train_fashion_mnist
fail() { echo "FAIL: $*" >&2; exit 1; }
[ -x "$tool" ] && [ -x "$mnist" ] || fail "build lockstep and the example first (make build)"
source "$root/tests/cluster/shaped_cluster.sh"
nodes=${NODES:-4} rates=${RATES:-1gbit none} reps=${REPS:-2}
work=$(mktemp -d)
shaped_cluster_up "$nodes"
trap 'shaped_cluster_down; rm -rf "$work"' EXIT
(umask 077 && head -c 24 /dev/urandom | base64 > "$work/token")
port=$((29000 + $$ % 1000)) runs=0

# seconds STEPS: wall seconds of one job of STEPS steps on every node.
seconds() {
  local steps=$1 i pids=() t0
  runs=$((runs + 1))
  t0=$(date +%s.%N)
  for ((i = 0; i < nodes; i++)); do
    LOCKSTEP_BACKEND=${BACKEND:-gloo} OMP_NUM_THREADS=1 sc_exec "$i" timeout 600 "$tool" run \
      --nnodes "$nodes" --node-rank "$i" --master-addr "${sc_addr[0]}" --master-port "$port" \
      --nproc-per-node 1 --token-file "$work/token" --run-id "r$runs" \
      "$mnist" --no-eval --log-every 0 --threads 1 --epochs 1 --max-steps "$steps" \
      > "$work/r$runs.$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < nodes; i++)); do
    wait "${pids[i]}" || { cat "$work/r$runs.$i.log"; fail "node $i's job failed"; }
  done
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }'
}

echo "# $nodes nodes x 1 rank, backend ${BACKEND:-gloo}, $(nproc) cores, $(date -u +%FT%TZ)"
for ((rep = 1; rep <= reps; rep++)); do
  for rate in $rates; do
    shaped_cluster_rate "$rate"
    a=$(seconds 20)
    b=$(seconds 120)
    awk -v r="$rate" -v n="$rep" -v a="$a" -v b="$b" 'BEGIN {
      printf "rate %-7s rep %d: 20 steps %.2f s, 120 steps %.2f s, %.1f ms/step\n", r, n, a, b,
             (b - a) * 10 }'
  done
done
