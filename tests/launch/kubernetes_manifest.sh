#!/usr/bin/env bash
# ctest launch.kubernetes_manifest: the PyTorchJob of docs/CLUSTERS.md, its pods played by two
# processes on this machine. The container command is read from the manifest; each "pod" gets the
# variables Kubeflow's training operator sets (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
# PET_MASTER_ADDR, PET_MASTER_PORT, and MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK of the pod) and
# the token of the Secret; the job must train its 4 ranks to the end.
#   kubernetes_manifest.sh SOURCE_DIR LOCKSTEP TRAIN_FASHION_MNIST
set -euo pipefail
src=$1 tool=$(realpath "$2") mnist=$(realpath "$3")
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2> /dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# The Master's container command, e.g. ["lockstep", "run", "train_fashion_mnist", ...].
command_line=$(python3 - "$src/docs/CLUSTERS.md" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
manifest = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
commands = re.findall(r"^\s*command: (\[.*\])$", manifest, re.M)
assert len(commands) == 2 and commands[0] == commands[1], commands
assert "nprocPerNode: \"2\"" in manifest and manifest.count("replicas: 1") == 2, manifest
print("\n".join(json.loads(commands[0])))
PY
) || fail "could not read the manifest's command from docs/CLUSTERS.md"
mapfile -t cmd <<< "$command_line"
[ "${cmd[0]}" = lockstep ] && [ "${cmd[1]}" = run ] && [ "${cmd[2]}" = train_fashion_mnist ] \
  || fail "the manifest runs '${cmd[*]}', expected lockstep run train_fashion_mnist ..."

# The image's PATH: lockstep and train_fashion_mnist by those names.
mkdir -p "$work/bin"
ln -s "$tool" "$work/bin/lockstep"
ln -s "$mnist" "$work/bin/train_fashion_mnist"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
token=$(head -c 24 /dev/urandom | base64)
for r in 0 1; do
  (cd "$work" && env PATH="$work/bin:$PATH" PET_NNODES=2 PET_NPROC_PER_NODE=2 PET_NODE_RANK=$r \
    PET_MASTER_ADDR=127.0.0.1 PET_MASTER_PORT="$port" MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    WORLD_SIZE=2 RANK=$r LOCKSTEP_STORE_TOKEN="$token" OMP_NUM_THREADS=1 \
    "${cmd[@]}" > "$work/pod$r.log" 2>&1) &
  pids+=($!)
done
for r in 0 1; do
  wait "${pids[$r]}" || { cat "$work/pod0.log" "$work/pod1.log"; fail "pod $r failed"; }
done
grep -q "^\[rank0\]: .*world_size=4" "$work/pod0.log" \
  || { cat "$work/pod0.log"; fail "the job did not run 4 ranks"; }
grep -q "^\[rank0\]: final " "$work/pod0.log" || { cat "$work/pod0.log"; fail "no final line"; }
grep "^\[rank0\]: final " "$work/pod0.log"
echo "PASS: the PyTorchJob of docs/CLUSTERS.md trained 4 ranks on 2 pods"
