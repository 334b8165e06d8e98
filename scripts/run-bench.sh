#!/usr/bin/env bash
# Runs every benchmark program in a build tree, prints its table and writes JSON to
# bench/results/<name>.json. Usage: scripts/run-bench.sh [build-dir] [extra benchmark flags]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
shift || true
mkdir -p bench/results
for exe in "$build"/bench/*_bench; do
  [ -x "$exe" ] || continue
  name=$(basename "$exe")
  echo "== $name ($(nproc) cores, $(date -u +%Y-%m-%d))"
  "$exe" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
    --benchmark_out="bench/results/$name.json" --benchmark_out_format=json "$@"
done
# all_reduce through the public API, 2 processes, the shm backend beside the gloo backend (not
# Google Benchmark: it starts its own ranks).
if [ -x "$build/bench/allreduce" ]; then
  echo "== allreduce ($(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%Y-%m-%d))"
  "$build/bench/allreduce" --json bench/results/allreduce.json
fi
# Checkpoints: rank-0 save, every-rank load against rank-0 load + broadcast (2 processes).
if [ -x "$build/bench/checkpoint" ]; then
  echo "== checkpoint ($(nproc) cores, $(date -u +%Y-%m-%d))"
  "$build/bench/checkpoint"
fi
# Data-parallel training: 1 process against DDP (2 processes, over gloo and over shm) and
# DataParallel (2 replicas).
if [ -x "$build/bench/ddp" ]; then
  echo "== ddp ($(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%Y-%m-%d))"
  "$build/bench/ddp" --json bench/results/ddp.json
fi
