#!/usr/bin/env bash
# ctest scripts.gpu_check_dry: scripts/gpu-check.sh --dry on this build's test_cuda (and
# cuda_bench in a CUDA build), without rebuilding: the pack is made and fits what travels, and
# summary.md and results.json report the GPU part as skipped.
#   gpu_check_dry.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -euo pipefail
src=$1 build=$2 work=$3
rm -rf "$work"
bash "$src/scripts/gpu-check.sh" --dry --build-dir "$build" --pack "$work/pack" "$work/out"
python3 - "$work/out/results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["mode"] == "dry", r["mode"]
assert r["gpu"]["status"] == "skipped" and r["gpu"]["reason"], r["gpu"]
assert r["pack"]["fits"] and 0 < r["pack"]["bytes"] <= r["pack"]["limit_bytes"], r["pack"]
names = [f["name"] for f in r["pack"]["files"] if f["kind"] == "bin"]
assert "test_cuda" in names, names
print("gpu-check dry run: pack of", r["pack"]["bytes"], "bytes,", ", ".join(names))
PY
grep -q "skipped" "$work/out/summary.md"
ls "$work/pack"/lockstep-gpu-pack.tar.gz >/dev/null
