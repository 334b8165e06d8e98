#!/usr/bin/env bash
# The GPU check of lockstep (docs/GPU.md): one prepared script for a GPU machine, which may have
# the CUDA libraries, PyTorch and python3 but none of lockstep's other dependencies (OpenBLAS,
# Gloo, GoogleTest, ...) and no package registry. So the programs are built where lockstep builds
# ("here") and copied to the GPU machine as a pack.
#
#   scripts/gpu-check.sh [--dry | --device] [--build-dir DIR] [--pack DIR] OUTDIR
#
# Here (no GPU; the default when nvidia-smi is absent or sees no GPU), or with --dry: builds
# test_cuda and cuda_bench with CUDA into build/gpu-check (or takes them from --build-dir, which
# is then not rebuilt), packs them with the shared libraries the GPU image lacks into
# build/gpu-pack/ (one gzipped tarball), checks that the pack is within its limit (60 MiB), and
# writes OUTDIR/summary.md and OUTDIR/results.json with the GPU part reported as skipped.
#
# On the GPU machine (the default when a GPU is visible, or --device): unpacks build/gpu-pack,
# finds the CUDA libraries the image has (the toolkit's lib dirs, and the nvidia-* Python
# packages beside PyTorch for cuDNN and NCCL), runs test_cuda (the `gpu` tests), cuda_bench
# (GEMM through lockstep and through cuBLASLt directly, copy bandwidth, Fashion-MNIST training
# steps) and bench/pytorch_cuda.py (the same in PyTorch eager), then GPT-2 124M in bf16 at
# batch 8 and 16, T 1024 (Note [GPT-2 124M preset] in examples/train_gpt_flags.h): train_gpt
# against bench/pytorch_gpt.py eager and torch.compile on the same card and data (the fortunes
# corpus, prepared here and packed): tokens/s, MFU, peak device memory. Writes into OUTDIR:
# summary.md, results.json, test_cuda.json (GoogleTest's), test_cuda.log, cuda_bench.json,
# pytorch_cuda.json, bench.log, gpt_plan.txt, gpt-*.log and gpt-torch-*.json. Aims at 8 minutes;
# the GPT runs that would start past GPU_CHECK_BUDGET_S (default 450) seconds are reported as
# not run. The dry mode writes gpt_plan.txt too: the model's size and FLOPs per token.
#
# On a GPU machine that receives the working tree and build/gpu-pack (docs/GPU.md), after a dry
# run here:  bash scripts/gpu-check.sh --device OUTDIR
#
# Exit status: 0 when everything ran and every test passed (or the dry run packed within the
# limit), 1 when a test failed or a step broke, 2 on bad usage.
set -uo pipefail

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

repo=$(cd "$(dirname "$0")/.." && pwd)
mode=auto
build_dir=""
pack_dir="$repo/build/gpu-pack"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) mode=dry ;;
    --device) mode=device ;;
    --build-dir) build_dir=$2; shift ;;
    --pack) pack_dir=$2; shift ;;
    -h|--help) usage ;;
    -*) echo "gpu-check: unknown option $1" >&2; usage ;;
    *) [ -z "$out" ] || usage; out=$1 ;;
  esac
  shift
done
[ -n "$out" ] || usage
mkdir -p "$out"
out=$(cd "$out" && pwd)
mkdir -p "$pack_dir"
pack_dir=$(cd "$pack_dir" && pwd)

# The pack's size limit: small enough to copy to a GPU machine beside the working tree.
readonly limit_bytes=$((60 * 1024 * 1024))
readonly tarball="$pack_dir/lockstep-gpu-pack.tar.gz"
started=$(date +%s)

log() { echo "gpu-check: $*" >&2; }

gpu_visible() {
  command -v nvidia-smi >/dev/null 2>&1 && grep -q '^GPU ' <(nvidia-smi -L 2>/dev/null)
}

if [ "$mode" = auto ]; then
  if gpu_visible; then mode=device; else mode=dry; fi
fi

# ---------------------------------------------------------------------------------------------
# Here: build and pack.

# Libraries never packed: the C runtime, which every Linux has (the GPU image's is newer), and the
# CUDA libraries, which the GPU image has (its toolkit, its driver, PyTorch's nvidia-* packages)
# and which are far too large to copy (cuBLASLt alone is ~500 MB).
readonly system_libs='^(linux-vdso|libc|libm|libdl|librt|libpthread|ld-linux[^ ]*|libstdc\+\+|libgcc_s|libresolv|libutil)\.so'
readonly cuda_libs='^lib(cuda|cudart|cublas|cublasLt|cudnn[a-z_]*|nccl|nvrtc[a-z-]*|nvJitLink|curand|cufft|cusparse|cusolver|nvToolsExt|cupti)\.so'

build() {
  if [ -n "$build_dir" ]; then
    [ -x "$build_dir/tests/test_cuda" ] || { log "no tests/test_cuda in $build_dir"; return 1; }
    return 0
  fi
  build_dir="$repo/build/gpu-check"
  local launcher=()
  if command -v ccache >/dev/null 2>&1; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  # sm_90 machine code only (Hopper: H100, H200): one architecture halves the CUDA compile time
  # and the binaries' size. For a GPU of another architecture, pass such a build with --build-dir.
  cmake -S "$repo" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90-real "${launcher[@]}" >"$out/build.log" 2>&1 || {
    log "configure failed (see $out/build.log)"; return 1; }
  local targets=(test_cuda) t
  for t in cuda_bench train_gpt; do
    if grep -q "^$t:" <(ninja -C "$build_dir" -t targets all 2>/dev/null); then targets+=("$t"); fi
  done
  log "building ${targets[*]} in $build_dir"
  ninja -C "$build_dir" -j "${GPU_CHECK_JOBS:-2}" "${targets[@]}" >>"$out/build.log" 2>&1 || {
    log "build failed (see $out/build.log)"; return 1; }
}

pack() {
  local stage="$pack_dir/stage"
  rm -rf "$stage" "$tarball" "$pack_dir/manifest.txt"
  mkdir -p "$stage/bin" "$stage/lib"
  local bins=("$build_dir/tests/test_cuda")
  [ -x "$build_dir/bench/cuda_bench" ] && bins+=("$build_dir/bench/cuda_bench")
  [ -x "$build_dir/examples/train_gpt" ] && bins+=("$build_dir/examples/train_gpt")
  local bin
  {
    echo "# lockstep GPU pack, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    for bin in "${bins[@]}"; do
      cp "$bin" "$stage/bin/"
      echo "bin $(basename "$bin")"
    done
    # ldd lists every library loaded at start, dependencies of dependencies included.
    for bin in "${bins[@]}"; do ldd "$bin"; done | awk '$2 == "=>" {print $1, $3}' | sort -u |
      while read -r name path; do
        if [[ "$name" =~ $system_libs ]]; then continue; fi
        if [[ "$name" =~ $cuda_libs ]]; then echo "from-device $name"; continue; fi
        if [ "$path" = "not" ]; then echo "missing-here $name"; continue; fi
        cp -L "$path" "$stage/lib/$name"
        echo "lib $name $(stat -c %s "$stage/lib/$name")"
      done
  } >"$pack_dir/manifest.txt"
  cp "$pack_dir/manifest.txt" "$stage/"
  # The GPT's data: the fortunes corpus as byte tokens (~2.5 MB), the same files for train_gpt
  # and pytorch_gpt.py on the GPU machine.
  if [ -x "$build_dir/examples/train_gpt" ]; then
    "$build_dir/examples/train_gpt" --prepare --out "$stage/gpt-data" >>"$out/build.log" 2>&1 || {
      log "train_gpt --prepare failed (see $out/build.log)"; return 1; }
  fi
  # gzip: about a quarter of the size in a few seconds of one core (xz -6 halves that again but
  # takes ten times longer, too slow for the ctest); python3's tarfile unpacks it on the GPU machine.
  tar -C "$stage" -czf "$tarball" . || return 1
  rm -rf "$stage"
}

pack_bytes() { du -cb "$pack_dir" | tail -1 | cut -f1; }

# GPT-2 124M's plan (train_gpt --plan): parameters, FLOPs per token, memory of the weights; the
# summary's MFU divides by its FLOPs per token.
readonly gpt_flags=(--preset gpt2-124m)
gpt_plan() {
  local exe=$1 b
  [ -x "$exe" ] || { echo "no train_gpt in this build" >"$out/gpt_plan.txt"; return 0; }
  for b in 8 16; do
    "$exe" "${gpt_flags[@]}" --batch-size "$b" --plan || return 1
  done >"$out/gpt_plan.txt" 2>&1
}

# ---------------------------------------------------------------------------------------------
# On the GPU machine: unpack, find the CUDA libraries, run.

unpack() {
  local dest=$1
  rm -rf "$dest" && mkdir -p "$dest"
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$tarball" "$dest"
}

# The image's CUDA libraries: the toolkit, the driver's folder, and the nvidia-* wheels beside
# PyTorch (cuDNN and NCCL may exist only there).
cuda_library_path() {
  local dirs=() d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
           /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib \
           /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && dirs+=("$d")
  done
  local py
  py=$(python3 - <<'EOF' 2>/dev/null
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
seen = []
for root in roots:
    for d in sorted(glob.glob(os.path.join(root, "*", "lib")) + glob.glob(os.path.join(root, "*", "*", "lib"))):
        if d not in seen and glob.glob(os.path.join(d, "*.so*")):
            seen.append(d)
print(":".join(seen))
EOF
)
  local joined
  joined=$(IFS=:; echo "${dirs[*]}")
  echo "${joined}${py:+:$py}"
}

run_device() {
  local dest=/tmp/lockstep-gpu-pack
  [ -f "$tarball" ] || { log "no pack at $tarball: run the dry mode here first"; return 1; }
  log "unpacking $(basename "$tarball") into $dest"
  unpack "$dest" || { log "unpacking failed"; return 1; }
  export LD_LIBRARY_PATH="$dest/lib:$(cuda_library_path)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  GPU_CHECK_DEVICE_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sed -n 1p)
  export GPU_CHECK_DEVICE_NAME
  {
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    nvidia-smi -L 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
    for b in "$dest"/bin/*; do
      echo "== ldd $(basename "$b") (unresolved)"
      ldd "$b" 2>&1 | grep 'not found' || echo "(none)"
    done
  } >"$out/bench.log" 2>&1
  cat "$out/bench.log" >&2

  # One process per test: a kernel that faults leaves a sticky error that would fail every
  # later test of the process, and a crash would lose the whole JSON. Tests not started by the
  # deadline are reported as not run.
  log "test_cuda, one process per test"
  local test_rc=0 parts="$dest/test-json" deadline=$(( $(date +%s) + 240 )) name rc
  mkdir -p "$parts"
  : >"$out/test_cuda.log"
  "$dest/bin/test_cuda" --gtest_list_tests 2>>"$out/test_cuda.log" |
    awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}' >"$dest/tests.txt"
  while read -r name; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "NOT RUN (time) $name" >>"$out/test_cuda.log"
      continue
    fi
    rc=0
    timeout 120 "$dest/bin/test_cuda" --gtest_filter="$name" \
      --gtest_output="json:$parts/$name.json" >>"$out/test_cuda.log" 2>&1 </dev/null || rc=$?
    if [ "$rc" -ne 0 ]; then
      test_rc=1
      [ -f "$parts/$name.json" ] || echo "CRASHED (exit $rc) $name" >>"$out/test_cuda.log"
    fi
  done <"$dest/tests.txt"
  python3 - "$parts" "$dest/tests.txt" "$out/test_cuda.log" "$out/test_cuda.json" <<'EOF'
import glob, json, os, sys
parts, listed, log, dest = sys.argv[1:]
suites = {}
for path in sorted(glob.glob(os.path.join(parts, "*.json"))):
    for suite in json.load(open(path)).get("testsuites", []):
        suites.setdefault(suite["name"], []).extend(suite.get("testsuite", []))
seen = {f"{s}.{c['name']}" for s, cases in suites.items() for c in cases}
notes = {}
for line in open(log, errors="replace"):
    for tag in ("CRASHED", "NOT RUN (time)"):
        if line.startswith(tag):
            notes[line.split()[-1]] = line.strip()
for name in (l.strip() for l in open(listed)):
    if name and name not in seen:
        suite, case = name.split(".", 1)
        why = notes.get(name, "no result (crashed before writing its JSON)")
        suites.setdefault(suite, []).append(
            {"name": case, "result": "COMPLETED", "failures": [{"failure": why}]})
if not any(l.strip() for l in open(listed)):
    suites["test_cuda"] = [{"name": "start", "result": "COMPLETED", "failures": [
        {"failure": "test_cuda listed no tests: it did not start (see test_cuda.log)"}]}]
json.dump({"testsuites": [{"name": s, "testsuite": c} for s, c in suites.items()]},
          open(dest, "w"), indent=1)
EOF
  tail -3 "$out/test_cuda.log" >&2
  local step_rc=0 section
  if [ -x "$dest/bin/cuda_bench" ]; then
    # One process per section, for the same reason; merged into cuda_bench.json.
    for section in gemm copy train; do
      log "cuda_bench --only $section"
      timeout 100 "$dest/bin/cuda_bench" --only "$section" --json "$dest/bench-$section.json" \
        >>"$out/bench.log" 2>&1 || {
        step_rc=$?; echo "cuda_bench --only $section exited with $step_rc" >>"$out/bench.log"; }
    done
    python3 - "$dest" "$out/cuda_bench.json" <<'EOF'
import json, os, sys
dest, path = sys.argv[1:]
merged = {"device": None, "gemm": [], "copy": None, "train": []}
for section in ("gemm", "copy", "train"):
    try:
        part = json.load(open(os.path.join(dest, f"bench-{section}.json")))
    except Exception as e:
        err = {"what": section, "error": f"no output ({e.__class__.__name__})"}
        part = {section: None if section == "copy" else [err]}
    merged["device"] = merged["device"] or part.get("device")
    merged[section] = part.get(section)
    merged["memory_" + section] = part.get("memory")
json.dump(merged, open(path, "w"), indent=2)
EOF
  else
    echo "cuda_bench not in the pack (a build without CUDA)" >>"$out/bench.log"
    step_rc=1
  fi
  log "bench/pytorch_cuda.py"
  PYTHONUNBUFFERED=1 timeout 90 python3 "$repo/bench/pytorch_cuda.py" --json "$out/pytorch_cuda.json" \
    >>"$out/bench.log" 2>&1 || {
    step_rc=$?; echo "pytorch_cuda.py exited with $step_rc" >>"$out/bench.log"; }
  run_gpt "$dest" || step_rc=1
  [ "$test_rc" -ne 0 ] && return "$test_rc"
  return "$step_rc"
}

# GPT-2 124M, bf16, T 1024, batch 8 and 16: train_gpt, then pytorch_gpt.py eager and compiled,
# 30 steps each from the same flags; tokens/s is over the steps after the first 10 (the
# allocator's warm-up, torch.compile's compilation). Each run's log or JSON goes to OUTDIR.
run_gpt() {
  local dest=$1 rc=0 b mode budget=${GPU_CHECK_BUDGET_S:-450}
  if [ ! -x "$dest/bin/train_gpt" ]; then
    echo "train_gpt not in the pack" >>"$out/bench.log"
    return 1
  fi
  gpt_plan "$dest/bin/train_gpt" || { log "train_gpt --plan failed (see gpt_plan.txt)"; rc=1; }
  local common=(--data "$dest/gpt-data" --amp bf16 --warmup-steps 2)
  for b in 8 16; do
    if [ $(( $(date +%s) - started )) -ge "$budget" ]; then
      echo "NOT RUN (time) lockstep b$b" >"$out/gpt-lockstep-b$b.log"; continue
    fi
    log "train_gpt GPT-2 124M bf16, batch $b"
    timeout 150 "$dest/bin/train_gpt" "${gpt_flags[@]}" "${common[@]}" --device cuda \
      --batch-size "$b" --max-steps 30 --eval-every 30 --eval-batches 1 \
      --metrics "$out/gpt-lockstep-b$b.jsonl" >"$out/gpt-lockstep-b$b.log" 2>&1 || {
      echo "train_gpt batch $b exited with $?" >>"$out/bench.log"; rc=1; }
  done
  # Correctness: the same weights and batches in lockstep and PyTorch, f32 with TF32 off, the
  # losses of 10 steps within 1e-4 relative (bench/gpt_losses.py).
  if [ $(( $(date +%s) - started )) -lt "$budget" ]; then
    log "bench/gpt_losses.py: GPT-2 124M in f32, 10 steps, against PyTorch"
    timeout 240 python3 "$repo/bench/gpt_losses.py" --train-gpt "$dest/bin/train_gpt" \
      --data "$dest/gpt-data" --device cuda --steps 10 --json "$out/gpt_losses.json" -- \
      --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --vocab-size 50304 --lr 6e-4 \
      --batch-size 4 --warmup-steps 2 >"$out/gpt_losses.log" 2>&1 || {
      echo "gpt_losses.py exited with $?" >>"$out/bench.log"; rc=1; }
  else
    echo "NOT RUN (time)" >"$out/gpt_losses.log"
  fi
  for mode in eager compile; do
    for b in 8 16; do
      if [ $(( $(date +%s) - started )) -ge "$budget" ]; then
        echo "NOT RUN (time)" >"$out/gpt-torch-$mode-b$b.log"; continue
      fi
      log "bench/pytorch_gpt.py GPT-2 124M bf16 $mode, batch $b"
      local extra=()
      [ "$mode" = compile ] && extra=(--compile)
      PYTHONUNBUFFERED=1 timeout 200 python3 "$repo/bench/pytorch_gpt.py" "${common[@]}" \
        --device cuda "${extra[@]}" --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 \
        --vocab-size 50304 --lr 6e-4 --batch-size "$b" --steps 30 --skip 10 \
        --json "$out/gpt-torch-$mode-b$b.json" >"$out/gpt-torch-$mode-b$b.log" 2>&1 || {
        echo "pytorch_gpt.py $mode batch $b exited with $?" >>"$out/bench.log"; rc=1; }
    done
  done
  return "$rc"
}

# ---------------------------------------------------------------------------------------------
# summary.md and results.json, from whatever the steps left in OUTDIR.

summarize() {
  local mode=$1 status=$2 reason=$3
  python3 - "$out" "$mode" "$status" "$reason" "$(pack_bytes)" "$limit_bytes" \
    "$pack_dir/manifest.txt" "$(( $(date +%s) - started ))" \
    "$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)" <<'EOF'
import json, os, sys
out, mode, status, reason, pack_bytes, limit, manifest, secs, commit = sys.argv[1:]
pack_bytes, limit, secs = int(pack_bytes), int(limit), int(secs)

def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception:
        return None

files = []
if os.path.exists(manifest):
    for line in open(manifest):
        parts = line.split()
        if parts and parts[0] in ("bin", "lib", "from-device", "missing-here"):
            files.append({"kind": parts[0], "name": parts[1],
                          "bytes": int(parts[2]) if len(parts) > 2 else None})
res = {"mode": mode, "commit": commit, "seconds": secs,
       "pack": {"bytes": pack_bytes, "limit_bytes": limit, "fits": pack_bytes <= limit,
                "files": files},
       "gpu": {"status": status, "reason": reason}}
md = [f"# lockstep GPU check ({mode})", "",
      f"Commit {commit}, {secs} s. Pack: {pack_bytes / 2**20:.1f} MiB of {limit / 2**20:.0f} MiB"
      f" ({'fits' if pack_bytes <= limit else 'TOO LARGE'}); libraries taken from the GPU image: "
      + (", ".join(f["name"] for f in files if f["kind"] == "from-device") or "none") + ".", ""]

if not any(f["kind"] == "bin" and f["name"] == "cuda_bench" for f in files):
    md += ["The pack holds no cuda_bench: it was built without CUDA, so its tests would only "
           "skip on a GPU (build where nvcc is, or pass a CUDA build with --build-dir).", ""]
try:
    plan = [l.rstrip() for l in open(os.path.join(out, "gpt_plan.txt")) if l.strip()]
except OSError:
    plan = []
res["gpt_plan"] = plan
if plan:
    md += ["GPT-2 124M as the GPT runs plan it (train_gpt --preset gpt2-124m --plan, batch 8 "
           "and 16):", "", "```"] + plan + ["```", ""]
if status != "ran":
    md += [f"GPU part: **skipped** ({reason}).", ""]
else:
    tests = load("test_cuda.json")
    t = {"total": 0, "passed": 0, "failed": 0, "skipped": 0, "failures": []}
    if tests:
        for suite in tests.get("testsuites", []):
            for case in suite.get("testsuite", []):
                t["total"] += 1
                name = f"{suite['name']}.{case['name']}"
                if case.get("failures"):
                    t["failed"] += 1
                    msg = "\n".join(f.get("failure", "") for f in case["failures"])
                    t["failures"].append({"name": name, "message": msg[:4000]})
                elif case.get("result") == "SKIPPED" or case.get("status") == "NOTRUN":
                    t["skipped"] += 1
                else:
                    t["passed"] += 1
    else:
        t["error"] = "no test_cuda.json (test_cuda crashed or did not start: see test_cuda.log)"
    # GoogleTest's JSON has no skip messages; its log has them, on the line after "Skipped".
    reasons = set()
    try:
        lines = open(os.path.join(out, "test_cuda.log")).read().splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.endswith(": Skipped") and lines[i + 1].strip():
                reasons.add(lines[i + 1].strip())
    except OSError:
        pass
    t["skip_reasons"] = sorted(reasons)
    res["gpu"]["tests"] = t
    ls, pt = load("cuda_bench.json"), load("pytorch_cuda.json")
    res["gpu"]["device"] = ((ls or pt or {}).get("device") or os.environ.get("GPU_CHECK_DEVICE_NAME")
                            or "unknown (no benchmark output, no name from nvidia-smi)")
    res["gpu"]["lockstep_bench"], res["gpu"]["pytorch_bench"] = ls, pt
    md += [f"Device: {res['gpu']['device']}.", "",
           f"## Tests (test_cuda): {t['passed']} passed, {t['failed']} failed, "
           f"{t['skipped']} skipped of {t['total']}", ""]
    if "error" in t:
        md += [t["error"], ""]
    if t["skip_reasons"]:
        md += ["Skipped because: " + "; ".join(t["skip_reasons"]) + ".", ""]
    for f in t["failures"][:40]:
        first = f["message"].strip().splitlines()
        md.append(f"- FAILED {f['name']}: " + " / ".join(first[:3])[:600])
    md.append("")

    def key(r):
        return (r.get("m"), r.get("dtype"), r.get("model"), r.get("batch"))
    ptg = {key(r): r for r in (pt or {}).get("gemm", [])}
    ptt = {key(r): r for r in (pt or {}).get("train", [])}
    gemm_rows, train_rows, errors = [], [], []
    md += ["## GEMM (TFLOP/s; f32 runs as TF32 in all three)", "",
           "| shape | dtype | lockstep | cuBLASLt | PyTorch | lockstep / cuBLASLt | lockstep / PyTorch |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in (ls or {}).get("gemm", []):
        if "error" in r:
            md.append(f"| {r.get('what')} | | error: {r['error'][:200]} | | | | |")
            errors.append(r)
            continue
        p = ptg.get(key(r), {})
        row = {"shape": f"{r['m']}x{r['n']}x{r['k']}", "dtype": r["dtype"],
               "lockstep_tflops": r["lockstep_tflops"], "cublaslt_tflops": r["cublaslt_tflops"],
               "torch_tflops": p.get("torch_tflops"), "vs_cublaslt": r["ratio"],
               "vs_torch": r["lockstep_tflops"] / p["torch_tflops"] if p.get("torch_tflops") else None,
               "max_rel_diff": r.get("max_rel_diff")}
        gemm_rows.append(row)
        fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"
        md.append(f"| {row['shape']} | {row['dtype']} | {fmt(row['lockstep_tflops'])} | "
                  f"{fmt(row['cublaslt_tflops'])} | {fmt(row['torch_tflops'])} | "
                  f"{fmt(row['vs_cublaslt'], 2)} | {fmt(row['vs_torch'], 2)} |")
    c, pc = (ls or {}).get("copy") or {}, (pt or {}).get("copy") or {}
    md += ["", "## Device-to-device copy, 1 GiB (GB/s, read + write)", "",
           f"lockstep copy_: {c.get('lockstep_gbs', '-')}; cudaMemcpyAsync: "
           f"{c.get('cudamemcpy_gbs', '-')}; PyTorch copy_: {pc.get('torch_gbs', '-')}.", "",
           "## Training step, synthetic Fashion-MNIST batches, SGD momentum (samples/s)", "",
           "| model | batch | dtype | lockstep | PyTorch eager | lockstep / PyTorch |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in (ls or {}).get("train", []):
        if "error" in r:
            md.append(f"| {r.get('what')} | | | error: {r['error'][:200]} | | |")
            errors.append(r)
            continue
        p = ptt.get(key(r), {})
        ratio = r["samples_per_s"] / p["samples_per_s"] if p.get("samples_per_s") else None
        train_rows.append({"model": r["model"], "batch": r["batch"], "dtype": r["dtype"],
                           "lockstep_samples_per_s": r["samples_per_s"],
                           "torch_samples_per_s": p.get("samples_per_s"), "vs_torch": ratio})
        md.append(f"| {r['model']} | {r['batch']} | {r['dtype']} | {r['samples_per_s']:.0f} | "
                  f"{p.get('samples_per_s', 0):.0f} | {'-' if ratio is None else f'{ratio:.2f}'} |")
    # GPT-2 124M (run_gpt): tokens/s over steps 11-30, MFU against the card's dense bf16 peak.
    flops = None
    try:
        for line in open(os.path.join(out, "gpt_plan.txt")):
            if line.startswith("plan ") and "flops_per_token=" in line:
                flops = float(line.split("flops_per_token=")[1].split()[0])
                break
    except (OSError, ValueError):
        pass
    name = res["gpu"]["device"]
    # Dense bf16 tensor-core peaks from NVIDIA's data sheets (FLOP/s).
    peak = next((v for k, v in (("H200", 989.4e12), ("H100 PCIe", 756e12), ("H100", 989.4e12),
                                ("A100", 312e12), ("L40S", 362e12)) if k in name), None)

    def lockstep_gpt(b):
        try:
            recs = [json.loads(l) for l in open(os.path.join(out, f"gpt-lockstep-b{b}.jsonl"))]
        except (OSError, ValueError):
            return None
        steps = [r for r in recs if r.get("kind") == "train" and r.get("step", 0) > 10]
        if not steps:
            return None
        secs = sum(b / r["samples_per_s"] for r in steps)
        row = {"tokens_per_s": len(steps) * b * 1024 / secs}
        try:
            for line in open(os.path.join(out, f"gpt-lockstep-b{b}.log")):
                if line.startswith("peak device memory per rank:"):
                    row["peak_device_mib"] = float(line.split(":")[1].split()[0])
        except (OSError, ValueError, IndexError):
            pass
        return row

    gpt_rows = []
    md += ["", "## GPT-2 124M, bf16, T 1024 (tokens/s; MFU against "
           + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "an unknown peak") + ")", "",
           "| batch | lockstep | PyTorch eager | torch.compile | vs eager | vs compile | "
           "MFU lockstep | peak MiB lockstep / eager / compile |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b in (8, 16):
        ls_row = lockstep_gpt(b)
        eager, comp = load(f"gpt-torch-eager-b{b}.json"), load(f"gpt-torch-compile-b{b}.json")
        tl = ls_row and ls_row["tokens_per_s"]
        te, tc = eager and eager.get("tokens_per_s"), comp and comp.get("tokens_per_s")
        row = {"batch": b, "lockstep_tokens_per_s": tl, "eager_tokens_per_s": te,
               "compile_tokens_per_s": tc,
               "vs_eager": tl / te if tl and te else None, "vs_compile": tl / tc if tl and tc else None,
               "mfu": tl * flops / peak if tl and flops and peak else None,
               "peak_device_mib": [ls_row and ls_row.get("peak_device_mib"),
                                   eager and (eager.get("peak_device_mib") or [None])[0],
                                   comp and (comp.get("peak_device_mib") or [None])[0]]}
        gpt_rows.append(row)
        f0 = lambda v: "-" if v is None else f"{v:.0f}"
        f2 = lambda v: "-" if v is None else f"{v:.2f}"
        md.append(f"| {b} | {f0(tl)} | {f0(te)} | {f0(tc)} | {f2(row['vs_eager'])} | "
                  f"{f2(row['vs_compile'])} | "
                  + ("-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%") + " | "
                  + " / ".join(f0(v) for v in row["peak_device_mib"]) + " |")
    losses = load("gpt_losses.json")
    md += ["", "Step-for-step check (bench/gpt_losses.py: GPT-2 124M in f32, TF32 off, the same "
           "weights and batches in both, 10 steps): "
           + ("no result (see gpt_losses.log)" if not losses else
              f"largest relative difference of the losses {losses['max_rel_diff']:.2e} "
              f"(goal 1e-4: {'met' if losses['agree'] else 'NOT met'})") + "."]
    res["gpu"]["gpt_losses"] = losses
    res["gpu"]["ratios"] = {"gemm": gemm_rows, "train": train_rows, "gpt": gpt_rows}
    res["gpu"]["bench_errors"] = errors
    goals = {
        # Tests that skipped (no GPU seen) prove nothing: some must have run.
        "ops_within_tolerance": bool(tests) and t["failed"] == 0 and t["passed"] > 0,
        "gemm_ge_90pct_cublaslt": bool(gemm_rows) and not any("gemm" in e.get("what", "") for e in errors)
                                  and all(g["vs_cublaslt"] >= 0.9 for g in gemm_rows),
        "gpt_ge_compile_and_1_3x_eager": bool(gpt_rows) and all(
            g["vs_compile"] is not None and g["vs_eager"] is not None
            and g["vs_compile"] >= 1.0 and g["vs_eager"] >= 1.3
            for g in gpt_rows),
        "gpt_losses_agree_1e_4": bool(losses) and losses["agree"],
        "gpt_mfu_ge_40pct": bool(gpt_rows) and all(
            g["mfu"] is not None and g["mfu"] >= 0.4 for g in gpt_rows),
        "train_ge_pytorch": bool(train_rows) and not any("train" in e.get("what", "") for e in errors)
                            and all(
            g["vs_torch"] is not None and g["vs_torch"] >= 1.0 for g in train_rows),
    }
    res["gpu"]["goals"] = goals
    md += ["", "## Goals", ""] + [f"- {k}: {'met' if v else 'NOT met'}"
                                             for k, v in goals.items()]
    md.append("")
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(res, f, indent=2)
with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("\n".join(md) + "\n")
print("\n".join(md))
EOF
}

# ---------------------------------------------------------------------------------------------

rc=0
if [ "$mode" = dry ]; then
  if build && pack && gpt_plan "$build_dir/examples/train_gpt"; then
    bytes=$(pack_bytes)
    log "pack: $bytes bytes in $pack_dir (limit $limit_bytes)"
    if [ "$bytes" -gt "$limit_bytes" ]; then
      log "the pack is larger than what travels; its largest files:"
      sort -k3 -n -r "$pack_dir/manifest.txt" | sed -n 1,5p >&2
      rc=1
    fi
  else
    rc=1
  fi
  if gpu_visible; then why="dry run requested"; else why="no GPU here (nvidia-smi absent or sees none)"; fi
  summarize dry skipped "$why" >/dev/null || rc=1
  log "wrote $out/summary.md and $out/results.json"
else
  run_device || rc=1
  summarize device ran "" || rc=1
fi
exit "$rc"
