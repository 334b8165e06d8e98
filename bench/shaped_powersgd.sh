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
source "$root/bench/shaped_common.sh"
rate=${RATE:-1gbit} epochs=${EPOCHS:-2} hooks=${HOOKS:-none bf16 powersgd}
shaped_start "${NODES:-4}" "${1:-$root/build/release}" examples/train_fashion_mnist
shaped_cluster_rate "$rate"
echo "# $nodes nodes x 1 rank, rate $rate, MLP, batch 64 per rank, $epochs epochs," \
  "$(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg), $(date -u +%FT%TZ)"
for hook in $hooks; do
  extra=()
  [ "$hook" = powersgd ] && extra=(--powersgd-rank "${PSGD_RANK:-4}" --powersgd-start "${PSGD_START:-10}")
  t0=$(date +%s.%N)
  shaped_run "$hook" 1 LOCKSTEP_BACKEND=gloo -- "$build/examples/train_fashion_mnist" --eval \
    --threads 1 --epochs "$epochs" --comm-hook "$hook" "${extra[@]}"
  wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  acc=$(awk '/epoch [0-9]+ train_loss/ { for (i = 1; i < NF; i++) if ($i == "test_accuracy") printf "%s ", $(i + 1) }' "$work/$hook.0.log")
  printf "%-9s accuracy by epoch: %s wall %s s\n" "$hook" "$acc" "$wall"
done
