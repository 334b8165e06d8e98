#!/usr/bin/env bash
# Accuracy against wall time with gradient compression between emulated machines: N network
# namespaces with their own hostnames and rate-limited links (tests/cluster/shaped_cluster.sh),
# one rank each, examples/train_fashion_mnist (the MLP, batch 64 per rank) for EPOCHS epochs
# with each communication hook in HOOKS, one after another in the same run. Each row: the hook,
# the test accuracy after each epoch, and the wall time of the whole job (start-up included:
# the same for every hook).
#
#   bench/shaped_powersgd.sh [BUILD_DIR]    (root)
#   NODES=4 RATE=1gbit EPOCHS=2 HOOKS="none bf16 powersgd" PSGD_RANK=4 bench/shaped_powersgd.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath "${1:-$root/build/release}")
tool=$build/tools/lockstep mnist=$build/examples/train_fashion_mnist
fail() { echo "FAIL: $*" >&2; exit 1; }
[ -x "$tool" ] && [ -x "$mnist" ] || fail "build lockstep and the example first (make build)"
source "$root/tests/cluster/shaped_cluster.sh"
nodes=${NODES:-4} rate=${RATE:-1gbit} epochs=${EPOCHS:-2} hooks=${HOOKS:-none bf16 powersgd}
work=$(mktemp -d)
shaped_cluster_up "$nodes"
trap 'shaped_cluster_down; rm -rf "$work"' EXIT
(umask 077 && head -c 24 /dev/urandom | base64 > "$work/token")
port=$((29000 + $$ % 1000)) runs=0
shaped_cluster_rate "$rate"
echo "# $nodes nodes x 1 rank, rate $rate, MLP, batch 64 per rank, $epochs epochs," \
  "$(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg), $(date -u +%FT%TZ)"
for hook in $hooks; do
  runs=$((runs + 1)) pids=()
  extra=()
  [ "$hook" = powersgd ] && extra=(--powersgd-rank "${PSGD_RANK:-4}" --powersgd-start "${PSGD_START:-10}")
  t0=$(date +%s.%N)
  for ((i = 0; i < nodes; i++)); do
    LOCKSTEP_BACKEND=gloo OMP_NUM_THREADS=1 sc_exec "$i" timeout 900 "$tool" run \
      --nnodes "$nodes" --node-rank "$i" --master-addr "${sc_addr[0]}" \
      --master-port "$((port + runs))" --nproc-per-node 1 --token-file "$work/token" \
      --run-id "r$runs" "$mnist" --eval --threads 1 --epochs "$epochs" --comm-hook "$hook" \
      "${extra[@]}" > "$work/r$runs.$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < nodes; i++)); do
    wait "${pids[i]}" || { cat "$work/r$runs.$i.log" >&2; fail "$hook: node $i's job failed"; }
  done
  wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  acc=$(awk '/epoch [0-9]+ train_loss/ { for (i = 1; i < NF; i++) if ($i == "test_accuracy") printf "%s ", $(i + 1) }' "$work/r$runs.0.log")
  printf "%-9s accuracy by epoch: %s wall %s s\n" "$hook" "$acc" "$wall"
done
