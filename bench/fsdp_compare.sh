#!/usr/bin/env bash
# FSDP beside DDP in examples/train_gpt, on this machine:
#  1. speed: tokens/s of 2 ranks (1 thread each) with --zero 0 (DDP), --zero 2 and --zero 3,
#     rounds alternating the order, medians;
#  2. memory: each rank's peak of tensor memory at 4 ranks for a GPT whose parameters, gradients
#     and AdamW state dominate (24 layers of width 256, one window of 32 tokens per rank), from
#     the example's "peak tensor memory per rank" line (Note [Memory split]).
# Usage: bench/fsdp_compare.sh [build dir] [rounds]
set -euo pipefail
build=${1:-build/release}
rounds=${2:-3}
exe=$build/examples/train_gpt
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq 1 2000); do echo "the quick brown fox $i jumps over the lazy dog"; done > "$work/text.txt"
"$exe" --prepare "$work/text.txt" --out "$work/data" > /dev/null

# name, world, then flags: runs the ranks (torchrun's variables, loopback), rank 0's output kept.
ranks() {
  local name=$1 world=$2 port=$((20000 + RANDOM % 20000)) r
  shift 2
  for ((r = 0; r < world; ++r)); do
    RANK=$r WORLD_SIZE=$world LOCAL_RANK=$r LOCAL_WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port OMP_NUM_THREADS=1 "$exe" --data "$work/data" --threads 1 "$@" \
      > "$work/$name.rank$r" 2>&1 &
    pids[$r]=$!
  done
  for ((r = 0; r < world; ++r)); do wait "${pids[$r]}" || { cat "$work/$name.rank$r"; exit 1; }; done
}
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

speed=(--n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --batch-size 8 --max-steps 30
  --warmup-steps 2 --eval-every 1000 --eval-batches 1)
echo "speed: 2 ranks, GPT 4 x 128, T 64, batch 8 per rank, 30 steps; $rounds rounds"
for ((k = 0; k < rounds; ++k)); do
  for z in 0 2 3; do
    ranks "s$z.$k" 2 "${speed[@]}" --zero $z
    sed -n 's/^final .* tokens_per_s=\([0-9.]*\) .*/\1/p' "$work/s$z.$k.rank0" >> "$work/tps$z"
  done
done
d=$(median < "$work/tps0")
for z in 0 2 3; do
  m=$(median < "$work/tps$z")
  echo "  --zero $z: tokens/s $(paste -sd' ' "$work/tps$z"), median $m ($(awk -v a="$m" -v b="$d" 'BEGIN { printf "%.2f", a / b }')x DDP)"
done

memory=(--n-layer 24 --n-head 8 --n-embd 256 --block-size 32 --batch-size 1 --max-steps 3
  --warmup-steps 1 --eval-batches 1)
echo "memory: 4 ranks, GPT 24 x 256 (19.0 M parameters), T 32, batch 1 per rank"
for z in 0 2 3; do
  ranks "m$z" 4 "${memory[@]}" --zero $z
  echo "  --zero $z: $(grep '^peak tensor memory per rank:' "$work/m$z.rank0")"
done
ddp=$(sed -n 's/^peak tensor memory per rank: \([0-9. ]*\) MiB.*/\1/p' "$work/m0.rank0" | tr ' ' '\n' | sort -g | tail -1)
for z in 2 3; do
  worst=$(sed -n 's/^peak tensor memory per rank: \([0-9. ]*\) MiB.*/\1/p' "$work/m$z.rank0" | tr ' ' '\n' | sort -g | tail -1)
  echo "  --zero $z: the fullest rank holds $(awk -v a="$worst" -v b="$ddp" 'BEGIN { printf "%.3f", a / b }')x what a DDP rank holds"
done
