#!/usr/bin/env bash
# ctest scripts.gpu_check_dry: scripts/gpu-check.sh --dry on this build's test_cuda (and
# cuda_bench in a CUDA build, train_gpt with the GPT's data), without rebuilding: the pack is made
# and fits what travels, summary.md and results.json report the GPU part as skipped, and the
# GPT-2 124M plan is there.
#   gpu_check_dry.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -euo pipefail
src=$1 build=$2 work=$3
rm -rf "$work"
# What travels to the GPU machine is a release build's pack (docs/GPU.md); a sanitizer build's
# carries libasan and instrumented binaries past the size limit and is never sent. The release
# half of CI runs this test; here it says why it does not.
if grep -q -- "-fsanitize" "$build/CMakeCache.txt" 2> /dev/null; then
  echo "SKIP: $build is a sanitizer build; the GPU pack is checked in a release build"
  exit 77
fi
bash "$src/scripts/gpu-check.sh" --dry --build-dir "$build" --pack "$work/pack" "$work/out"
python3 - "$work/out/results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["mode"] == "dry", r["mode"]
assert r["gpu"]["status"] == "skipped" and r["gpu"]["reason"], r["gpu"]
assert r["pack"]["fits"] and 0 < r["pack"]["bytes"] <= r["pack"]["limit_bytes"], r["pack"]
names = [f["name"] for f in r["pack"]["files"] if f["kind"] == "bin"]
assert "test_cuda" in names, names
# A build with the examples packs train_gpt and plans GPT-2 124M (the GPU runs' model).
if "train_gpt" in names:
    assert any("vocab=50304 params=124475904" in l for l in r["gpt_plan"]), r["gpt_plan"]
    assert any(l.startswith("plan flops_per_token=") for l in r["gpt_plan"]), r["gpt_plan"]
print("gpu-check dry run: pack of", r["pack"]["bytes"], "bytes,", ", ".join(names))
PY
grep -q "skipped" "$work/out/summary.md"
ls "$work/pack"/lockstep-gpu-pack.tar.gz >/dev/null
