#!/usr/bin/env bash
# Compares one benchmark program of two build trees on this machine, interleaved so that both see
# the same load: ROUNDS rounds of (before, after), each 3 repetitions; prints each benchmark's
# median time in both and the ratio after/before. For refactors that must not change speed.
# Usage: scripts/bench-compare.sh BEFORE_BUILD AFTER_BUILD [program=ops_bench] [rounds=5] [filter]
set -euo pipefail
before=$1 after=$2 prog=${3:-ops_bench} rounds=${4:-5} filter=${5:-.}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  for side in before after; do
    dir=$before
    [ "$side" = after ] && dir=$after
    "$dir/bench/$prog" --benchmark_filter="$filter" --benchmark_repetitions=3 \
      --benchmark_out="$out/$side.$r.json" --benchmark_out_format=json >/dev/null
  done
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
times = {"before": {}, "after": {}}
for side in times:
    for f in glob.glob(f"{sys.argv[1]}/{side}.*.json"):
        for b in json.load(open(f))["benchmarks"]:
            if b.get("run_type") == "iteration":
                times[side].setdefault(b["run_name"], []).append(b["real_time"])
print(f"{'benchmark':45} {'before':>12} {'after':>12} {'after/before':>13}")
for name in times["before"]:
    if name not in times["after"]:
        continue
    b, a = statistics.median(times["before"][name]), statistics.median(times["after"][name])
    print(f"{name:45} {b:12.1f} {a:12.1f} {a / b:13.3f}")
PY
