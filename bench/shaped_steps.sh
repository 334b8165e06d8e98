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
source "$root/bench/shaped_common.sh"
rates=${RATES:-1gbit none} reps=${REPS:-2}
shaped_start "${NODES:-4}" "${1:-$root/build/release}" examples/train_fashion_mnist

# seconds STEPS: wall seconds of one job of STEPS steps on every node.
seconds() {
  local t0
  t0=$(date +%s.%N)
  shaped_run "steps$1" 1 LOCKSTEP_BACKEND="${BACKEND:-gloo}" -- \
    "$build/examples/train_fashion_mnist" --no-eval --log-every 0 --threads 1 --epochs 1 \
    --max-steps "$1"
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
