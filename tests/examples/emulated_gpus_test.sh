#!/usr/bin/env bash
# The multi-GPU path on a machine without GPUs: the examples with --device cuda and the nccl
# backend on emulated GPUs (LOCKSTEP_TEST_EMULATE_GPUS, Note [Emulated CUDA devices]), started by
# the real launcher at 2 and 4 ranks, each compared with the same run on CPUs. The emulated nccl
# group keeps NCCL's contract (device tensors of the rank's own GPU only), so a host tensor sent
# through it, as the evaluation's counts once were, fails the run; the emulated GPUs compute with
# the CPU kernels and reduce through the CPU transport in its order, so a run is bitwise the CPU
# run wherever both use the same kernels (the Fashion-MNIST models: checkpoints compared byte for
# byte), and within rounding where the GPU lacks a kernel the CPU has (train_gpt's attention,
# composed of matmul and softmax there: losses within 1e-5 relative after 20 steps).
# Usage: emulated_gpus_test.sh <train_fashion_mnist> <train_gpt> <lockstep> <case>
set -uo pipefail
mnist=$1
gpt=$2
tool=$3
case_name=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
export OMP_NUM_THREADS=1
unset LOCKSTEP_TEST_EMULATE_GPUS LOCKSTEP_BACKEND

# Runs `lockstep run --nproc-per-node $1 ARGS...` into $work/$2 (stdout and stderr), on emulated
# GPUs when $3 is "gpu" (as many as ranks, or $4), on CPUs when "cpu".
launch() {
  local n=$1 out=$2 where=$3 gpus=${4:-$1}
  shift 4
  if [ "$where" = gpu ]; then
    LOCKSTEP_TEST_EMULATE_GPUS=$gpus "$tool" run --standalone --nproc-per-node "$n" "$@" \
      > "$work/$out" 2>&1
  else
    "$tool" run --standalone --nproc-per-node "$n" "$@" > "$work/$out" 2>&1
  fi || { cat "$work/$out"; fail "$out: '$*' on $n ranks ($where) failed"; }
}

# subset_data N_TRAIN: the first N_TRAIN train samples and 2000 test samples of the installed
# Fashion-MNIST as plain files in $work/data (tests/examples/fashion_mnist_subset.py), for
# `--data "$work/data"`: these cases compare two runs on the same data, and each process starts
# in a third of the time, most of which is decompressing and scaling the 60000 train images.
subset_data() {
  command -v python3 > /dev/null || fail "python3 is missing (scripts/install-deps.sh installs it)"
  python3 "$(dirname "$0")/fashion_mnist_subset.py" "$work/data" "$1" 2000 \
    || fail "could not write the data subset"
}

# Rank 0's final line, without the throughput (which differs between any two runs).
final_of() { grep -h "^\[rank0\]: final " "$1" | tail -n 1 | sed 's/ samples_per_s=.*//; s/ tokens_per_s=[0-9.]*//'; }

# The emulated run $1 must have run on emulated GPUs through nccl and said so, and end as the
# CPU run $2 does: the same final line and byte-identical checkpoints (files $3...).
same_as_cpu() {
  local gpu=$1 cpu=$2
  shift 2
  grep -q "WARNING: EMULATED GPUs" "$work/$gpu" || fail "$gpu: the emulation did not say it was on"
  grep -q "backend=nccl device=cuda:0" "$work/$gpu" || { cat "$work/$gpu"; fail "$gpu: not on nccl and cuda:0"; }
  local a b
  a=$(final_of "$work/$gpu") b=$(final_of "$work/$cpu")
  [ -n "$a" ] && [ "$a" = "$b" ] || fail "$gpu ended with '$a', the CPU run with '$b'"
  for f in "$@"; do
    cmp "$work/$gpu.ck/$f" "$work/$cpu.ck/$f" || fail "$gpu: checkpoint $f differs from the CPU run's"
  done
  echo "ok: $gpu = $cpu: $a"
}

case "$case_name" in
  mnist2)
    # The MLP on 2 ranks: 20 steps with checkpoints every 10, the evaluation, the epoch's mean
    # loss, --check-sync-every (a hash of every parameter all-gathered) and --metrics (the step
    # times of every rank ride in DDP's first bucket); then the emulated run resumes from its
    # step-10 checkpoint and ends on the same bytes.
    subset_data 6000
    common=(--data "$work/data" --model mlp --max-steps 20 --threads 1 --log-every 10
      --check-sync-every 5 --save-every 10)
    for w in cpu gpu; do
      dev=()
      [ $w = gpu ] && dev=(--device cuda --backend nccl)
      launch 2 mlp.$w $w 2 "$mnist" "${common[@]}" "${dev[@]}" --save "$work/mlp.$w.ck/ck.safetensors" \
        --metrics "$work/mlp.$w.jsonl"
    done
    losses() { grep -o '"step":[0-9]*,.*"loss":[^,]*' "$1" | sed 's/"epoch".*"loss"/"loss"/'; }
    [ "$(losses "$work/mlp.gpu.jsonl" | wc -l)" -eq 20 ] && grep -q '"slowest_rank_ms"' "$work/mlp.gpu.jsonl" \
      && [ "$(losses "$work/mlp.gpu.jsonl")" = "$(losses "$work/mlp.cpu.jsonl")" ] \
      || { cat "$work/mlp.gpu.jsonl"; fail "the emulated run's metrics are not the CPU run's 20 steps"; }
    grep -q "backend=shm device=cpu" "$work/mlp.cpu" || fail "the CPU run was not on shm"
    same_as_cpu mlp.gpu mlp.cpu ck.safetensors ck.step00000010.safetensors
    # The README's multi-GPU command (--nproc-per-node gpu counts the emulated GPUs) with bf16
    # autocast, and fp16 with the GradScaler's dynamic loss scale, 10 steps each.
    for amp in bf16 fp16; do
      launch 2 $amp.cpu cpu 2 "$mnist" --data "$work/data" --max-steps 10 --threads 1 --log-every 5 \
        --amp $amp --save "$work/$amp.cpu.ck/ck.safetensors"
      LOCKSTEP_TEST_EMULATE_GPUS=2 "$tool" run --standalone --nproc-per-node gpu "$mnist" \
        --data "$work/data" --device cuda --backend nccl --amp $amp --max-steps 10 --threads 1 \
        --log-every 5 --save "$work/$amp.gpu.ck/ck.safetensors" > "$work/$amp.gpu" 2>&1 \
        || { cat "$work/$amp.gpu"; fail "--amp $amp with --nproc-per-node gpu failed"; }
      grep -q "nproc-per-node gpu = 2" "$work/$amp.gpu" || { cat "$work/$amp.gpu"; fail "gpu did not count 2"; }
      same_as_cpu $amp.gpu $amp.cpu ck.safetensors
    done
    mkdir -p "$work/resumed.gpu.ck"
    launch 2 resumed.gpu gpu 2 "$mnist" "${common[@]}" --device cuda --backend nccl \
      --resume "$work/mlp.gpu.ck/ck.step00000010.safetensors" --save "$work/resumed.gpu.ck/ck.safetensors"
    grep -q "resum" "$work/resumed.gpu" || { cat "$work/resumed.gpu"; fail "no resume line"; }
    cmp "$work/resumed.gpu.ck/ck.safetensors" "$work/mlp.cpu.ck/ck.safetensors" \
      || fail "the emulated run resumed at step 10 ended elsewhere than the uninterrupted run"
    ;;
  cnn2)
    # The CNN with ZeRO-1 on 2 ranks, and the CNN with BatchNorm under --sync-bn.
    subset_data 6000
    for w in cpu gpu; do
      dev=()
      [ $w = gpu ] && dev=(--device cuda --backend nccl)
      launch 2 cnn.$w $w 2 "$mnist" --data "$work/data" --model cnn --zero 1 --max-steps 8 --threads 1 \
        --log-every 4 "${dev[@]}" --save "$work/cnn.$w.ck/ck.safetensors"
      launch 2 bn.$w $w 2 "$mnist" --data "$work/data" --model cnn-bn --sync-bn --max-steps 8 \
        --threads 1 --log-every 4 "${dev[@]}" --save "$work/bn.$w.ck/ck.safetensors"
    done
    same_as_cpu cnn.gpu cnn.cpu ck.safetensors
    same_as_cpu bn.gpu bn.cpu ck.safetensors
    ;;
  mnist4)
    # 4 ranks: plain DDP with --zero 1, checkpoints and the sync check; the CNN with BatchNorm
    # under --sync-bn.
    subset_data 6000
    for w in cpu gpu; do
      dev=()
      [ $w = gpu ] && dev=(--device cuda --backend nccl)
      launch 4 zero.$w $w 4 "$mnist" --data "$work/data" --zero 1 --max-steps 12 --threads 1 \
        --log-every 6 --check-sync-every 6 "${dev[@]}" --save "$work/zero.$w.ck/ck.safetensors"
      launch 4 bn4.$w $w 4 "$mnist" --data "$work/data" --model cnn-bn --sync-bn --max-steps 4 \
        --threads 1 --log-every 2 --batch-size 16 "${dev[@]}" --save "$work/bn4.$w.ck/ck.safetensors"
    done
    same_as_cpu zero.gpu zero.cpu ck.safetensors
    same_as_cpu bn4.gpu bn4.cpu ck.safetensors
    ;;
  uneven)
    # --uneven (Note [Uneven inputs] in train_fashion_mnist.cpp): 6009 samples (the first of the
    # train set; all 60000 make the same batches at ten times the compute) over 7 ranks without
    # padding give ranks 0-2 four batches (286, 286, 286, 1) and ranks 3-6 three; those shadow
    # the last step through Join (its exchange of who is active travels on the GPU), and every
    # rank leaves the epoch together for the evaluation and the mean loss.
    subset_data 6009
    for w in cpu gpu; do
      dev=()
      [ $w = gpu ] && dev=(--device cuda --backend nccl)
      launch 7 uneven.$w $w 7 "$mnist" --data "$work/data" --uneven --batch-size 286 --max-steps 4 \
        --threads 1 --log-every 1 --momentum 0.9 "${dev[@]}" --save "$work/uneven.$w.ck/ck.safetensors"
    done
    grep -q "rank 6 ran out of batches after 3 forwards and shadowed 1" "$work/uneven.gpu" \
      || { cat "$work/uneven.gpu"; fail "rank 6 did not shadow the last step"; }
    same_as_cpu uneven.gpu uneven.cpu ck.safetensors
    ;;
  dp)
    # DataParallel in one process: replicas on cuda:0..K-1 (K = 2, 4 emulated GPUs), the batch
    # split across them and the gradients summed on cuda:0, against K replicas on the CPU.
    for k in 2 4; do
      "$mnist" --dp $k --max-steps 10 --log-every 5 --threads 1 > "$work/dp$k.cpu" 2>&1 \
        || { cat "$work/dp$k.cpu"; fail "--dp $k on the CPU failed"; }
      LOCKSTEP_TEST_EMULATE_GPUS=4 "$mnist" --dp $k --max-steps 10 --log-every 5 --threads 1 \
        --device cuda > "$work/dp$k.gpu" 2>&1 || { cat "$work/dp$k.gpu"; fail "--dp $k --device cuda failed"; }
      a=$(sed -n 's/^final \(.*\) samples_per_s=.*/\1/p' "$work/dp$k.gpu")
      b=$(sed -n 's/^final \(.*\) samples_per_s=.*/\1/p' "$work/dp$k.cpu")
      grep -q "device=cuda:0" "$work/dp$k.gpu" || { cat "$work/dp$k.gpu"; fail "--dp $k not on cuda:0"; }
      [ -n "$a" ] && [ "$a" = "$b" ] || fail "--dp $k on emulated GPUs ended with '$a', on the CPU with '$b'"
      echo "ok: --dp $k: $a"
    done
    ;;
  gpt)
    # train_gpt --device cuda on 2 and 4 ranks (nccl by default for cuda tensors), 20 steps,
    # against the CPU: the emulated GPUs run the CPU's kernels, the fused attention's too (Note
    # [Emulated kernels]), so the losses and the checkpoint are the same bits. Then the flags'
    # errors without (emulated) GPUs.
    for i in $(seq 1 400); do echo "the quick brown fox $i jumps over the lazy dog"; done > "$work/tiny.txt"
    "$gpt" --prepare "$work/tiny.txt" --out "$work/tiny" > "$work/prep" 2>&1 || { cat "$work/prep"; fail "--prepare failed"; }
    small=(--data "$work/tiny" --block-size 32 --n-layer 2 --n-head 2 --n-embd 32 --threads 1
      --eval-batches 2 --batch-size 4 --max-steps 20 --warmup-steps 2 --eval-every 10)
    for n in 2 4; do
      launch $n gpt$n.cpu cpu $n "$gpt" "${small[@]}" --save "$work/gpt$n.cpu.safetensors"
      launch $n gpt$n.gpu gpu $n "$gpt" "${small[@]}" --device cuda --save "$work/gpt$n.gpu.safetensors"
      grep -q "backend=nccl threads=1 device=cuda:0" "$work/gpt$n.gpu" \
        || { cat "$work/gpt$n.gpu"; fail "train_gpt --device cuda not on nccl and cuda:0"; }
      grep -q "^\[rank0\]: peak device memory per rank:\( [0-9.]*\)\{$n\} MiB" "$work/gpt$n.gpu" \
        || { cat "$work/gpt$n.gpu"; fail "no device memory line for $n ranks"; }
      # The same bits: every logged loss, the final line and the checkpoint.
      cmp <(grep -o "^\[rank0\]: step .* loss [0-9.]* val_loss [0-9.]*" "$work/gpt$n.cpu") \
        <(grep -o "^\[rank0\]: step .* loss [0-9.]* val_loss [0-9.]*" "$work/gpt$n.gpu") \
        || fail "train_gpt on $n emulated GPUs logged other losses than on the CPU"
      [ "$(grep -c "^\[rank0\]: step " "$work/gpt$n.cpu")" -eq 2 ] || fail "not 2 log lines"
      [ -n "$(final_of "$work/gpt$n.cpu")" ] && [ "$(final_of "$work/gpt$n.cpu")" = "$(final_of "$work/gpt$n.gpu")" ] \
        || fail "train_gpt on $n emulated GPUs: '$(final_of "$work/gpt$n.gpu")', on the CPU '$(final_of "$work/gpt$n.cpu")'"
      cmp "$work/gpt$n.cpu.safetensors" "$work/gpt$n.gpu.safetensors" \
        || fail "train_gpt on $n emulated GPUs saved another checkpoint than on the CPU"
      echo "ok: train_gpt on $n emulated GPUs: $(final_of "$work/gpt$n.gpu")"
      # FSDP (--zero 3) on the nccl backend: DDP's checkpoint on the CPU, byte for byte.
      launch $n gpt$n.fsdp gpu $n "$gpt" "${small[@]}" --device cuda --zero 3 \
        --save "$work/gpt$n.fsdp.safetensors"
      grep -q "^\[rank0\]: fsdp: 3 units" "$work/gpt$n.fsdp" || { cat "$work/gpt$n.fsdp"; fail "no fsdp line"; }
      cmp "$work/gpt$n.cpu.safetensors" "$work/gpt$n.fsdp.safetensors" \
        || fail "train_gpt --zero 3 on $n emulated GPUs saved another checkpoint than DDP on the CPU"
    done
    # Without GPUs: --device cuda is a usage error naming why, before any data is read.
    "$gpt" "${small[@]}" --device cuda > "$work/nogpu" 2>&1
    rc=$?
    [ $rc -eq 2 ] || { cat "$work/nogpu"; fail "train_gpt --device cuda without a GPU exited $rc, expected 2"; }
    grep -q -e "--device cuda: no GPU is visible" -e "--device cuda: this build of lockstep has no CUDA support" "$work/nogpu" \
      || { cat "$work/nogpu"; fail "train_gpt --device cuda without a GPU did not say why"; }
    "$gpt" "${small[@]}" --backend nccl > "$work/nccl" 2>&1
    rc=$?
    [ $rc -eq 2 ] && grep -q "nccl" "$work/nccl" || { cat "$work/nccl"; fail "--backend nccl on the CPU: exit $rc"; }
    ;;
  *)
    fail "unknown case $case_name"
    ;;
esac
