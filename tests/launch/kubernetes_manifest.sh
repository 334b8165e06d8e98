#!/usr/bin/env bash
# ctest launch.kubernetes_manifest: the PyTorchJob of docs/CLUSTERS.md, its pods played by two
# processes on this machine. The container command is read from the manifest, and the test
# appends `--save model.safetensors` to it; each "pod" runs in a directory of its own and gets the
# variables Kubeflow's training operator sets (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
# PET_MASTER_ADDR, PET_MASTER_PORT, and MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK of the pod) and
# the token of the Secret. Twice:
#   - PET_NNODES=2, as the manifest runs: one world of 4 ranks;
#   - PET_NNODES=1:2, as an elasticPolicy job sets it (lockstep run --nnodes 1:2): both pods join
#     one rendezvous (it starts at once when MAX are in; LOCKSTEP_RDZV_LAST_CALL only bounds the
#     wait if the second pod is late) and make one generation of 4 ranks. Members are ordered by
#     --node-rank, so pod 0 holds ranks 0-1 and pod 1 ranks 2-3, as in the fixed job.
# Each must end, in pod 0 (rank 0 writes the checkpoint), on the bytes of
# `lockstep run --standalone --nproc-per-node 4 PROGRAM ARGS --save model.safetensors` with the
# same program arguments.
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
export OMP_NUM_THREADS=1

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
for a in "${cmd[@]}"; do
  [ "$a" != --save ] || fail "the manifest's command has --save; the test gives its own"
done
cmd+=(--save model.safetensors)

# The image's PATH: lockstep and train_fashion_mnist by those names.
mkdir -p "$work/bin"
ln -s "$tool" "$work/bin/lockstep"
ln -s "$mnist" "$work/bin/train_fashion_mnist"
export PATH=$work/bin:$PATH
token=$(head -c 24 /dev/urandom | base64)

# The reference: the same program and arguments, 4 ranks on one machine.
mkdir "$work/ref"
(cd "$work/ref" && lockstep run --standalone --nproc-per-node 4 "${cmd[@]:2}" > run.log 2>&1) \
  || { cat "$work/ref/run.log"; fail "the reference run (lockstep run --standalone) failed"; }
[ -f "$work/ref/model.safetensors" ] || fail "the reference run wrote no model.safetensors"

# pods NAME NNODES: the job's two pods with PET_NNODES=NNODES, in NAME/pod0 and NAME/pod1 (logs
# NAME/pod0.log, NAME/pod1.log); rank 0 must start once, in a world of 4, and train to the end.
pods() {
  local dir=$work/$1 port r
  port=$(python3 -c \
    'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  pids=()
  for r in 0 1; do
    mkdir -p "$dir/pod$r"
    (cd "$dir/pod$r" && env PET_NNODES="$2" PET_NPROC_PER_NODE=2 PET_NODE_RANK=$r \
      PET_MASTER_ADDR=127.0.0.1 PET_MASTER_PORT="$port" MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
      WORLD_SIZE=2 RANK=$r LOCKSTEP_STORE_TOKEN="$token" LOCKSTEP_RDZV_LAST_CALL=10 \
      "${cmd[@]}" > "$dir/pod$r.log" 2>&1) &
    pids+=($!)
  done
  for r in 0 1; do
    wait "${pids[$r]}" || { cat "$dir/pod0.log" "$dir/pod1.log"; fail "$1: pod $r failed"; }
  done
  [ "$(grep -c '^\[rank0\]: model=' "$dir/pod0.log")" = 1 ] \
    && grep -q '^\[rank0\]: model=.* world_size=4 ' "$dir/pod0.log" \
    || { cat "$dir/pod0.log"; fail "$1: rank 0 did not start once in a world of 4"; }
  grep "^\[rank0\]: final " "$dir/pod0.log" || { cat "$dir/pod0.log"; fail "$1: no final line"; }
}

# same_as_reference NAME: pod 0 (rank 0 writes) holds the reference's bytes, pod 1 no checkpoint.
same_as_reference() {
  [ -f "$work/$1/pod0/model.safetensors" ] || fail "$1: pod 0 wrote no model.safetensors"
  [ ! -e "$work/$1/pod1/model.safetensors" ] || fail "$1: pod 1 (ranks 2-3) wrote a checkpoint"
  cmp "$work/ref/model.safetensors" "$work/$1/pod0/model.safetensors" \
    || fail "$1: the job ended with other parameters or optimizer state than lockstep run"
  echo "PASS: $1: the PyTorchJob of docs/CLUSTERS.md trained 4 ranks on 2 pods," \
    "bitwise equal to lockstep run --standalone"
}

fixed="PET_NNODES=2"
pods "$fixed" 2
same_as_reference "$fixed"

# Elastic: one rendezvous, generation 0 of both pods (node 0's ranks 0-1, node 1's 2-3), no other
# (a pod that joined late would make generation 1, after generation 0 ran without it).
elastic="PET_NNODES=1:2"
pods "$elastic" 1:2
e=$work/$elastic
grep -q "^lockstep run: generation 0: 2 node(s) by --node-rank: 0 (.*), 1 (.*); world size 4$" \
  "$e/pod0.log" \
  && grep -q "generation 0: this machine is node 1 of 2 (ranks 2 to 3); world size 4$" \
    "$e/pod1.log" \
  && ! grep -q "generation [1-9]" "$e/pod0.log" "$e/pod1.log" \
  || { cat "$e/pod0.log" "$e/pod1.log"
       fail "$elastic: the pods did not make one generation of 4 ranks, node 0's first"; }
same_as_reference "$elastic"
