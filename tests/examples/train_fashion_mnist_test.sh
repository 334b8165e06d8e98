#!/usr/bin/env bash
# Checks examples/train_fashion_mnist end to end on the real Fashion-MNIST data: a shortened run
# of each model must learn (test accuracy far above chance), bad input must exit with code 2 and
# say why, and --save must write a loadable safetensors file.
# Usage: train_fashion_mnist_test.sh <path-to-train_fashion_mnist> <case> [<path-to-lockstep>]
set -uo pipefail
exe=$1
case_name=$2
tool=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# Runs the example, expects exit code $1 and stderr/stdout to contain $2.
expect_exit() {
  local want=$1 pattern=$2
  shift 2
  "$exe" "$@" > "$work/out" 2>&1
  local rc=$?
  [ "$rc" -eq "$want" ] || { cat "$work/out"; fail "'$*' exited $rc, expected $want"; }
  grep -q -- "$pattern" "$work/out" || { cat "$work/out"; fail "'$*' output lacks '$pattern'"; }
}

# Flips one bit of a file's last byte (in a checkpoint: tensor data; every safetensors check but
# the SHA-256 still passes).
corrupt() {
  local f=$1 size byte
  size=$(stat -c %s "$f")
  byte=$(tail -c 1 "$f" | od -An -tu1 | tr -d ' ')
  printf "\\$(printf %03o $((byte ^ 32)))" | dd of="$f" bs=1 seek=$((size - 1)) conv=notrunc status=none
}

# subset_data N_TRAIN [N_TEST]: the first N_TRAIN train samples (and N_TEST test samples, else all
# 10000) of the installed data as plain files in $work/data, for --data in the cases whose point
# is not the data (equalities between runs, a stop, a shape of batches): each process then starts
# in a third of the time, most of which is decompressing and scaling the 60000 train images.
# A TCP port on loopback that the kernel just gave as free (a random one may be in use).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
subset_data() {
  command -v python3 > /dev/null || fail "python3 is missing (scripts/install-deps.sh installs it)"
  python3 "$(dirname "$0")/fashion_mnist_subset.py" "$work/data" "$@" || fail "could not write the data subset"
}

# The train_loss of a run's final line.
final_loss() { sed -n 's/^\(\[rank0\]: \)\{0,1\}final .* train_loss=\([0-9.]*\) .*/\2/p' "$1"; }

# Runs a short training and checks the final line's accuracy against a floor.
train_check() {
  local floor=$1
  shift
  "$exe" --log-every 0 "$@" > "$work/out" 2>&1 || { cat "$work/out"; fail "training run failed"; }
  cat "$work/out"
  local last acc
  last=$(tail -n 1 "$work/out")
  [[ "$last" =~ ^final\ test_accuracy=([0-9.]+)\ train_loss=([0-9.]+)\ steps=([0-9]+)\ samples_per_s=([0-9.]+)$ ]] \
    || fail "last line is not machine-readable: $last"
  acc=${BASH_REMATCH[1]}
  awk -v a="$acc" -v f="$floor" 'BEGIN { exit !(a >= f) }' || fail "test accuracy $acc below $floor"
}

case "$case_name" in
  mlp) train_check 0.75 --model mlp --max-steps 250 --threads 2 ;;
  cnn) train_check 0.70 --model cnn --max-steps 150 --threads 2 ;;
  usage)
    expect_exit 2 "bogus" --bogus
    expect_exit 2 "--batch-size must be an integer from 1 to 1000000000, got '0'" --batch-size 0
    expect_exit 2 "not a directory" --data "$work/does-not-exist"
    expect_exit 2 "model" --model resnet
    # One --help for every check of its text (each run of the example costs 0.4 s to start).
    expect_exit 0 "--max-steps" --help
    for pattern in "--test-crash-at-step" "Testing only (the crash-recovery tests)" \
        "an integer from 1 to 1000000000" "cnn-bn" "--powersgd-rank" "--powersgd-start" \
        "FLOAT|auto"; do
      grep -q -- "$pattern" "$work/out" || { cat "$work/out"; fail "'--help' output lacks '$pattern'"; }
    done
    expect_exit 2 "comm-hook" --comm-hook gzip
    expect_exit 2 "^error: --powersgd-rank applies to --comm-hook powersgd, and --comm-hook is bf16" \
      --comm-hook bf16 --powersgd-rank 2
    expect_exit 2 "^error: --powersgd-start applies to --comm-hook powersgd, and --comm-hook is none" \
      --powersgd-start 0
    expect_exit 2 "--stop-signals: 'KILL' is not a signal to stop on" --stop-signals TERM,KILL
    expect_exit 2 "--stop-signals cannot be combined with --uneven" --uneven --stop-signals USR1
    expect_exit 2 "amp" --amp fp8
    expect_exit 2 "cannot be combined with --dp" --amp bf16 --dp 2
    expect_exit 2 "lr-scaling" --lr-scaling cubic
    # Every numeric flag reads its whole text as a number of its type and range, and names itself
    # and the range in words (Note [Numeric flags]): no clamping, no wrapping, no 309-digit bound.
    # (--dp 0 and --accum-steps 0 are here, and --help's range text is checked above.)
    while read -r flag value range; do
      expect_exit 2 "^$flag must be $range, got '$value'" "$flag" "$value"
    done <<'EOF'
--epochs 0 an integer from 1 to 1000000000
--epochs 1e3 an integer from 1 to 1000000000
--max-steps -1 an integer of at least 0
--batch-size 99999999999999999999 an integer from 1 to 1000000000
--batch-size -5 an integer from 1 to 1000000000
--batch-size 0x10 an integer from 1 to 1000000000
--lr -0.1 a number of at least 0
--lr 1e999 a number of at least 0
--lr nan a number of at least 0
--momentum inf a number of at least 0
--weight-decay -1 a number of at least 0
--seed -1 an integer of at least 0
--seed 18446744073709551616 an integer of at least 0
--threads 4097 an integer from 0 to 4096
--log-every -1 an integer of at least 0
--workers 5000 an integer from 0 to 4096
--save-every -3 an integer of at least 0
--keep -1 an integer of at least 0
--test-crash-at-step -1 an integer of at least 0
--bucket-mb 0 auto or a number above 0 and at most 1048576
--bucket-mb 1e7 auto or a number above 0 and at most 1048576
--bucket-mb fast auto or a number above 0 and at most 1048576
--timeout 0 a number above 0 and at most 604800
--timeout -5 a number above 0 and at most 604800
--timeout 1e9 a number above 0 and at most 604800
--timeout 30s a number above 0 and at most 604800
--dp 0 an integer from 1 to 4096
--accum-steps 0 an integer from 1 to 1000000000
--accum-steps 1000000001 an integer from 1 to 1000000000
--base-batch 0 an integer of at least 1
--warmup-steps -1 an integer of at least 0
--clip-grad-norm -1 a number of at least 0
--powersgd-rank 0 an integer from 1 to 1024
--powersgd-rank 2.5 an integer from 1 to 1024
--powersgd-start -1 an integer from 0 to 1000000000
EOF
    # --uneven and --sync-bn: what they cannot be combined with, and what --sync-bn needs.
    expect_exit 2 "uneven cannot be combined with --accum-steps" --uneven --accum-steps 2
    expect_exit 2 "uneven cannot be combined with --save-every" --uneven --save "$work/c" --save-every 5
    expect_exit 2 "uneven cannot be combined with --sync-bn" --uneven --sync-bn --model cnn-bn
    expect_exit 2 "has none: use --model cnn-bn" --sync-bn
    expect_exit 2 "sync-bn needs a process group" --sync-bn --model cnn-bn --dp 2
    # An empty split (IDX files of 0 items) is refused, not "trained" for zero steps with exit 0.
    mkdir -p "$work/empty"
    printf '\x00\x00\x08\x03\x00\x00\x00\x00\x00\x00\x00\x1c\x00\x00\x00\x1c' \
      > "$work/empty/train-images-idx3-ubyte"
    printf '\x00\x00\x08\x01\x00\x00\x00\x00' > "$work/empty/train-labels-idx1-ubyte"
    expect_exit 1 "the train split holds no samples; there is nothing to train on" \
      --data "$work/empty" --no-eval
    ;;
  diverged)
    # --lr 1e300 sends SGD's parameters to Inf at the first step: the next loss is not finite, and
    # the run stops naming the step (exit 1) instead of training on NaN to exit 0.
    subset_data 6000
    expect_exit 1 "step 2: the loss is \(NaN\|Inf\): the training has diverged" --lr 1e300 \
      --max-steps 20 --threads 1 --no-eval --data "$work/data"
    grep -q -- "--clip-grad-norm" "$work/out" || fail "the message offers no remedy"
    ;;
  save)
    subset_data 6000
    "$exe" --data "$work/data" --log-every 0 --max-steps 3 --no-eval \
      --save "$work/model.safetensors" > "$work/out" 2>&1 \
      || { cat "$work/out"; fail "run with --save failed"; }
    [ -s "$work/model.safetensors" ] || fail "no file written"
    grep -a -q '"model.1.weight"' "$work/model.safetensors" || fail "parameter names missing from header"
    grep -q "^epoch 0 train_loss [0-9.]* samples/s [0-9.]* test_accuracy none " "$work/out" \
      || { cat "$work/out"; fail "--no-eval: the epoch line does not say no evaluation ran"; }
    grep -q "^final test_accuracy=none train_loss=" "$work/out" || fail "--no-eval still evaluated"
    # A --save that cannot be written fails before training, naming the path and the reason (the
    # tests run as root, which a read-only directory does not stop: a path under a regular file,
    # and /proc, stop everyone).
    echo x > "$work/somefile"
    for bad in "$work/somefile/sub/ck.safetensors" /proc/lockstep-test/ck.safetensors "$work"; do
      expect_exit 1 "error: --save $bad cannot be written: " --data "$work/data" --log-every 1 \
        --max-steps 3 --no-eval --save "$bad"
      ! grep -q "^model=\|^epoch\|^final" "$work/out" || { cat "$work/out"; fail "--save $bad: trained first"; }
    done
    grep -q "is a directory" "$work/out" || fail "--save DIR: no reason given"
    ;;
  dp) train_check 0.70 --model mlp --dp 2 --max-steps 150 --threads 1 ;;
  ddp)
    # Two ranks with torchrun's variables: DDP on each rank's shard; only rank 0 prints; the
    # shared evaluation and the mean loss come out once; --save is written by rank 0 alone.
    port=$(free_port)
    for r in 0 1; do
      RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=$port OMP_NUM_THREADS=1 \
        "$exe" --log-every 0 --max-steps 150 --threads 1 --bucket-mb 1 --ddp-stats \
        --save "$work/ddp.safetensors" > "$work/rank$r" 2>&1 &
      pids[$r]=$!
    done
    for r in 0 1; do wait "${pids[$r]}" || { cat "$work/rank0" "$work/rank1"; fail "rank $r failed"; }; done
    cat "$work/rank0"
    [ ! -s "$work/rank1" ] || { cat "$work/rank1"; fail "rank 1 printed"; }
    grep -q "world_size=2 global_batch=128" "$work/rank0" || fail "no world size / global batch line"
    grep -q "^ddp: .* buckets" "$work/rank0" || fail "--ddp-stats printed nothing"
    [ -s "$work/ddp.safetensors" ] || fail "rank 0 wrote no checkpoint"
    last=$(tail -n 1 "$work/rank0")
    [[ "$last" =~ ^final\ test_accuracy=([0-9.]+) ]] || fail "last line: $last"
    awk -v a="${BASH_REMATCH[1]}" 'BEGIN { exit !(a >= 0.70) }' || fail "accuracy ${BASH_REMATCH[1]}"
    # A rank-dependent --seed (and another --momentum on rank 1) would shuffle each rank's shard
    # its own way: every rank refuses at the start, naming the first setting and both values
    # (Note [Same settings]). They read the first 6000 train samples.
    subset_data 6000
    port=$(free_port)
    for r in 0 1; do
      RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=$port OMP_NUM_THREADS=1 \
        "$exe" --data "$work/data" --max-steps 5 --threads 1 --seed $((7 + r)) --momentum 0.$((9 - r)) \
        > "$work/rank$r" 2>&1 &
      pids[$r]=$!
    done
    for r in 0 1; do
      wait "${pids[$r]}" && { cat "$work/rank$r"; fail "rank $r trained with another rank's --seed"; }
      grep -q "ranks disagree on --seed: rank 0 has 7, and rank 1 has 8. Every rank must train" \
        "$work/rank$r" || { cat "$work/rank$r"; fail "rank $r does not name the --seed values"; }
    done
    ;;
  demo)
    # What `make demo` runs, shortened: DDP on 2 processes through `lockstep run --standalone`;
    # only rank 0's lines reach the terminal, prefixed with its rank.
    [ -x "$tool" ] || fail "no lockstep binary given"
    "$tool" run --standalone --nproc-per-node 2 "$exe" --log-every 0 --max-steps 150 \
      > "$work/out" 2> "$work/err" || { cat "$work/out" "$work/err"; fail "lockstep run failed"; }
    cat "$work/out" "$work/err"
    grep -q "^\[rank0\]: model=mlp .* world_size=2 global_batch=128" "$work/out" \
      || fail "no header line from rank 0"
    ! grep -q "^\[rank1\]" "$work/out" || fail "rank 1 printed to stdout"
    # Rank 0's final line (the other ranks' output may come after it).
    last=$(grep "^\[rank0\]: final " "$work/out" | tail -n 1)
    [[ "$last" =~ ^\[rank0\]:\ final\ test_accuracy=([0-9.]+) ]] || fail "last line: $last"
    awk -v a="${BASH_REMATCH[1]}" 'BEGIN { exit !(a >= 0.70) }' || fail "accuracy ${BASH_REMATCH[1]}"
    ;;
  backend)
    # DDP over the shm backend (--backend, LOCKSTEP_BACKEND passed through `lockstep run`, and
    # the default, auto, which chooses shm for ranks on one machine) ends on the same line as
    # over gloo: 2 ranks sum in the same order on both, bit for bit. (40 steps of 2 ranks read
    # 5120 train samples; the evaluation's 2000 samples decide its line as much as 10000 do.)
    [ -x "$tool" ] || fail "no lockstep binary given"
    subset_data 6000 2000
    for b in gloo shm env default; do
      flag=(--backend "$b")
      # gloo's buckets come from its cost model: another bucketing, the same bits.
      [ "$b" = gloo ] && flag+=(--bucket-mb auto)
      [ "$b" = env ] && flag=()
      # The default run also checks every 5 steps that the ranks hold the same parameters.
      [ "$b" = default ] && flag=(--check-sync-every 5)
      LOCKSTEP_BACKEND=$([ "$b" = env ] && echo shm) OMP_NUM_THREADS=1 \
        "$tool" run --standalone --nproc-per-node 2 "$exe" --data "$work/data" --log-every 0 \
        --max-steps 40 --threads 1 "${flag[@]}" > "$work/$b" 2> "$work/$b.err" \
        || { cat "$work/$b" "$work/$b.err"; fail "--backend $b failed"; }
      cat "$work/$b" "$work/$b.err"
    done
    grep -q "^\[rank0\]: model=mlp .* backend=gloo device=cpu$" "$work/gloo" || fail "gloo run not on gloo"
    grep -q "^\[rank0\]: model=mlp .* backend=shm device=cpu$" "$work/shm" || fail "--backend shm not on shm"
    grep -q "^\[rank0\]: model=mlp .* backend=shm device=cpu$" "$work/env" || fail "LOCKSTEP_BACKEND=shm not on shm"
    grep -q "^\[rank0\]: model=mlp .* backend=shm device=cpu$" "$work/default" || fail "the default (auto) did not choose shm on one machine"
    final() { tail -n 1 "$1" | sed -n 's/^\[rank0\]: final \(test_accuracy=[0-9.]* train_loss=[0-9.]* steps=[0-9]*\) .*/\1/p'; }
    g=$(final "$work/gloo")
    [ -n "$g" ] || fail "no final line from the gloo run"
    for b in shm env default; do
      [ "$(final "$work/$b")" = "$g" ] || fail "$b ended on '$(final "$work/$b")', gloo on '$g'"
    done
    # nccl: not a backend of a build without CUDA; with CUDA, it needs --device cuda.
    expect_exit 2 "nccl" --backend nccl --max-steps 1
    expect_exit 2 "backend" --backend ucc --max-steps 1
    ;;
  amp)
    # One epoch of the MLP with bf16 autocast reaches the f32 target (cosine schedule: 0.869 in
    # f32 and bf16 alike over three seeds).
    train_check 0.85 --amp bf16 --schedule cosine --threads 2
    ;;
  powersgd)
    # 2 ranks with --comm-hook powersgd (rank 4 after 10 plain steps) end within 0.02 of the
    # uncompressed run's accuracy: 0.813 and 0.8235 (rank 2 reaches 0.765 in these 60 steps, and
    # 3 points below in 126). 60 steps of 2 ranks read 7680 samples.
    [ -x "$tool" ] || fail "no lockstep binary given"
    subset_data 8000 2000
    for h in none powersgd; do
      flags=(--comm-hook "$h")
      [ "$h" = powersgd ] && flags+=(--powersgd-rank 4 --powersgd-start 10)
      OMP_NUM_THREADS=1 "$tool" run --standalone --nproc-per-node 2 "$exe" --data "$work/data" \
        --log-every 0 --max-steps 60 --threads 1 --ddp-stats "${flags[@]}" > "$work/$h" 2>&1 \
        || { cat "$work/$h"; fail "--comm-hook $h failed"; }
      grep "final\|ddp:" "$work/$h"
    done
    acc() { grep "^\[rank0\]: final " "$1" | sed -n 's/.*final test_accuracy=\([0-9.]*\).*/\1/p'; }
    a=$(acc "$work/none"); p=$(acc "$work/powersgd")
    [ -n "$a" ] && [ -n "$p" ] || fail "no final accuracy"
    awk -v a="$a" -v p="$p" 'BEGIN { d = a - p; if (d < 0) d = -d; exit !(d <= 0.02 && p >= 0.65) }' \
      || fail "powersgd accuracy $p against uncompressed $a"
    ;;
  amp_fp16)
    # A short f16 run uses the loss scaler.
    subset_data 6000
    "$exe" --data "$work/data" --amp fp16 --max-steps 60 --log-every 20 --no-eval > "$work/out" 2>&1 \
      || { cat "$work/out"; fail "fp16 run failed"; }
    cat "$work/out"
    grep -q "loss_scale 65536" "$work/out" || fail "fp16 printed no loss scale"
    ;;
  amp_ddp)
    # 2 processes: bf16 within 0.01 of f32, one epoch each.
    [ -x "$tool" ] || fail "no lockstep binary given"
    for a in none bf16; do
      "$tool" run --standalone --nproc-per-node 2 "$exe" --log-every 0 --amp $a \
        --schedule cosine > "$work/$a" 2>&1 || { cat "$work/$a"; fail "--amp $a failed"; }
      tail -n 1 "$work/$a"
    done
    f32=$(tail -n 1 "$work/none" | sed -n 's/.*final test_accuracy=\([0-9.]*\).*/\1/p')
    b16=$(tail -n 1 "$work/bf16" | sed -n 's/.*final test_accuracy=\([0-9.]*\).*/\1/p')
    [ -n "$f32" ] && [ -n "$b16" ] || fail "no final accuracy"
    awk -v a="$f32" -v b="$b16" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 0.01 && b >= 0.85) }' \
      || fail "bf16 accuracy $b16 against f32 $f32"
    ;;
  device)
    # --device cuda where no GPU is: a usage error (exit 2) that says why, before any data is
    # read. With a GPU: the cuda case below runs instead, and this one checks the flag's range.
    expect_exit 2 "--device" --device tpu
    if ! "$exe" --device cuda --max-steps 0 --no-eval > "$work/out" 2>&1; then
      grep -q -e "no GPU is visible" -e "no CUDA support" "$work/out" \
        || { cat "$work/out"; fail "--device cuda without a GPU gave no reason"; }
      expect_exit 2 "no" --device cuda
    fi
    ;;
  cuda)
    # On a GPU (label gpu; skipped, exit 77, where there is none): the MLP and the CNN learn on
    # cuda as on the CPU, bf16 autocast too; 100 steps end within 1e-3 of the CPU's loss; and 2
    # ranks on one GPU train through gloo (staging through pinned host memory).
    if ! "$exe" --device cuda --max-steps 1 --no-eval --log-every 0 > "$work/probe" 2>&1; then
      echo "SKIP: no CUDA device: $(tail -n 1 "$work/probe")"
      exit 77
    fi
    train_check 0.75 --model mlp --max-steps 250 --device cuda
    train_check 0.70 --model cnn --max-steps 150 --device cuda
    train_check 0.75 --model mlp --max-steps 250 --device cuda --amp bf16
    "$exe" --log-every 0 --max-steps 100 --threads 1 > "$work/cpu" 2>&1 || fail "cpu run failed"
    "$exe" --log-every 0 --max-steps 100 --device cuda > "$work/gpu" 2>&1 || fail "cuda run failed"
    a=$(final_loss "$work/cpu"); b=$(final_loss "$work/gpu")
    awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-3) }' \
      || fail "100 steps: cpu loss $a, cuda loss $b"
    if [ -x "$tool" ]; then
      "$tool" run --standalone --nproc-per-node 2 "$exe" --log-every 0 --max-steps 100 \
        --device cuda --backend gloo > "$work/ddp" 2>&1 || { cat "$work/ddp"; fail "DDP on cuda failed"; }
      tail -n 1 "$work/ddp"
    fi
    ;;
  accum)
    # --accum-steps 4: steps and the schedule count optimizer steps; the effective batch and the
    # linearly scaled lr are printed. (20 steps of 4 x 64 read 5120 of the 12000 samples.)
    subset_data 12000
    "$exe" --data "$work/data" --accum-steps 4 --max-steps 20 --lr-scaling linear --base-batch 64 \
      --lr 0.01 --warmup-steps 5 --log-every 5 --no-eval > "$work/out" 2>&1 \
      || { cat "$work/out"; fail "run failed"; }
    cat "$work/out"
    grep -q "accum_steps=4 effective_batch=256 lr=0.04 " "$work/out" || fail "header"
    grep -q "step 5 loss .* lr 0.04$" "$work/out" || fail "warmup did not reach the scaled lr at step 5"
    [ "$(grep -c "^epoch 0 step [0-9]* loss" "$work/out")" -eq 4 ] \
      || fail "expected 4 loss lines (optimizer steps 5, 10, 15, 20)"
    grep -q "steps=20 " "$work/out" || fail "--max-steps must count optimizer steps"
    # Note [Accumulation window]: an epoch of 3 micro-batches (5000, 5000, 2000 samples) under
    # --accum-steps 4 is one step on its 12000 samples, the very step of --batch-size 12000: the
    # same loss at step 1 and, after that step's update, at step 2. With 2 ranks (3 micro-batches
    # of 2500, 2500, 1000 each) it is that step again. (A weight of 1/K reports 3/4 of the loss
    # and shrinks the update.) The epoch is the first 12000 samples of the train set: all 60000
    # make the same windows at five times the compute. The losses are compared as printed, to 4
    # decimals: the runs sum in different orders, so a loss within 1e-7 of a rounding boundary
    # would print two ways (the first 6000 samples' 2.318050 does).
    common=(--data "$work/data" --log-every 0 --no-eval --epochs 2 --max-steps 2 --lr 0.5)
    "$exe" "${common[@]}" --threads 2 --batch-size 12000 > "$work/full" 2>&1 \
      || { cat "$work/full"; fail "full-batch run failed"; }
    "$exe" "${common[@]}" --threads 2 --batch-size 5000 --accum-steps 4 > "$work/acc" 2>&1 \
      || { cat "$work/acc"; fail "accumulation run failed"; }
    port=$(free_port)
    for r in 0 1; do
      RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=$port OMP_NUM_THREADS=1 "$exe" "${common[@]}" --threads 1 \
        --batch-size 2500 --accum-steps 4 > "$work/ddp$r" 2>&1 &
      pids[$r]=$!
    done
    for r in 0 1; do wait "${pids[$r]}" || { cat "$work/ddp0" "$work/ddp1"; fail "rank $r failed"; }; done
    cat "$work/full" "$work/acc" "$work/ddp0"
    for run in acc ddp0; do
      for e in 0 1; do
        want=$(sed -n "s/^epoch $e train_loss \([0-9.]*\) .*/\1/p" "$work/full")
        got=$(sed -n "s/^epoch $e train_loss \([0-9.]*\) .*/\1/p" "$work/$run")
        [ -n "$want" ] && [ "$want" = "$got" ] \
          || fail "$run: epoch $e train_loss $got, the full batch's is $want"
      done
    done
    ;;
  resume)
    # Exact resume with 1 process: 40 optimizer steps straight, against a run killed (SIGKILL)
    # after step 20 and resumed from its step-20 checkpoint with the same command: the final
    # checkpoints (model, optimizer state, position; nothing time-dependent) are the same bytes.
    # 40 steps read 2560 samples: the first 6000 of the train set hold them (and each of the
    # dozen runs starts in a third of the time).
    subset_data 6000
    args=(--data "$work/data" --log-every 0 --no-eval --threads 2 --schedule cosine --max-steps 40)
    "$exe" "${args[@]}" --save "$work/a/ck.safetensors" > "$work/a.out" 2>&1 \
      || { cat "$work/a.out"; fail "straight run failed"; }
    "$exe" "${args[@]}" --save "$work/b/ck.safetensors" --save-every 10 --keep 2 \
      --test-crash-at-step 20 > "$work/b1.out" 2>&1
    rc=$?
    [ "$rc" -eq 137 ] || { cat "$work/b1.out"; fail "--test-crash-at-step 20 exited $rc, expected 137"; }
    [ ! -e "$work/b/ck.safetensors" ] || fail "a killed run wrote its end-of-run checkpoint"
    "$exe" "${args[@]}" --save "$work/b/ck.safetensors" --save-every 10 --keep 2 --resume auto \
      > "$work/b2.out" 2>&1 || { cat "$work/b2.out"; fail "resumed run failed"; }
    cat "$work/b2.out"
    grep -q "INFO: resumed .*ck.step00000020.safetensors: step 20, epoch 0 after 1280 of its samples" \
      "$work/b2.out" || fail "did not resume from the step-20 checkpoint"
    # --max-steps counts the steps before the checkpoint: 20 more, to 40.
    grep -q "steps=40 " "$work/b2.out" || fail "the resumed run did not stop at step 40"
    cmp "$work/a/ck.safetensors" "$work/b/ck.safetensors" \
      || fail "resumed run ended with other parameters or state than the straight run"
    # The checkpoint carries the epoch's loss sum: the resumed epoch's train_loss is the straight
    # run's (all 40 steps), not the mean of the 20 since the resume.
    [ -n "$(final_loss "$work/a.out")" ] && [ "$(final_loss "$work/a.out")" = "$(final_loss "$work/b2.out")" ] \
      || fail "train_loss after the resume $(final_loss "$work/b2.out"), straight $(final_loss "$work/a.out")"
    # --keep 2: the newest two periodic checkpoints stay.
    [ "$(ls "$work/b" | tr '\n' ' ')" = "ck.safetensors ck.step00000030.safetensors ck.step00000040.safetensors " ] \
      || { ls "$work/b"; fail "--keep 2 kept other files"; }
    # A checkpoint of another model: an error naming the first mismatched tensor.
    expect_exit 1 "holds another model than --model cnn: .*unexpected key '1.weight'" --model cnn --no-eval \
      --data "$work/data" --resume "$work/a/ck.safetensors"
    expect_exit 1 "no such checkpoint file" --data "$work/data" --resume "$work/nothing.safetensors"
    expect_exit 2 "needs --save" --resume auto
    expect_exit 2 "needs --save" --save-every 5
    # Nothing to resume yet: auto starts from step 0.
    "$exe" --data "$work/data" --log-every 0 --no-eval --max-steps 2 --save "$work/c/ck.safetensors" \
      --resume auto > "$work/c.out" 2>&1 || { cat "$work/c.out"; fail "--resume auto without a checkpoint failed"; }
    grep -q "starting from step 0" "$work/c.out" || fail "no fresh-start message"
    # A checkpoint from before the epoch's loss sums were recorded (the keys taken out, the
    # SHA-256 made anew) still resumes; an info line says what its train_loss covers.
    # python3 comes with scripts/install-deps.sh; without it this check fails, it is not skipped.
    command -v python3 > /dev/null || fail "python3 is missing (scripts/install-deps.sh installs it)"
    {
      mkdir -p "$work/f"
      python3 - "$work/b/ck.step00000030.safetensors" "$work/f/ck.safetensors" <<'PY' \
        || fail "could not write an old-style checkpoint"
import hashlib, json, struct, sys
src, dst = sys.argv[1:]
raw = open(src, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
meta = header["__metadata__"]
del meta["user.epoch_loss_sums"], meta["user.epoch_loss_steps"]
sha = hashlib.sha256()
for k in sorted(meta):
    if k != "sha256":
        sha.update(k.encode() + b"\0" + meta[k].encode() + b"\0")
sha.update(data)
meta["sha256"] = sha.hexdigest()
out = json.dumps(header, separators=(",", ":")).encode()
out += b" " * (-len(out) % 8)
open(dst, "wb").write(struct.pack("<Q", len(out)) + out + data)
PY
      "$exe" "${args[@]}" --resume "$work/f/ck.safetensors" > "$work/f.out" 2>&1 \
        || { cat "$work/f.out"; fail "resuming a checkpoint without loss sums failed"; }
      grep -q "records no losses of epoch 0 (an older checkpoint)" "$work/f.out" \
        || { cat "$work/f.out"; fail "no line about the missing loss sums"; }
      grep -q "steps=40 " "$work/f.out" || fail "the old checkpoint's run did not reach step 40"
    }
    # A corrupt newest checkpoint: auto resumes the newest that verifies with a warning naming the
    # skipped one and why, never writes over it (its step's periodic save is skipped, said so),
    # and still ends in the straight run's state.
    mkdir -p "$work/d"
    cp "$work/b/ck.step00000030.safetensors" "$work/b/ck.step00000040.safetensors" "$work/d/"
    corrupt "$work/d/ck.step00000040.safetensors"
    cp "$work/d/ck.step00000040.safetensors" "$work/corrupt40"
    "$exe" "${args[@]}" --save "$work/d/ck.safetensors" --save-every 10 --keep 1 --resume auto \
      > "$work/d.out" 2>&1 || { cat "$work/d.out"; fail "resume past a corrupt checkpoint failed"; }
    cat "$work/d.out"
    grep -q "WARNING: --resume auto: skipping $work/d/ck.step00000040.safetensors, which does not verify (.*corrupt" \
      "$work/d.out" || fail "no warning naming the corrupt checkpoint"
    grep -q "INFO: resumed .*d/ck.step00000030.safetensors: step 30" "$work/d.out" \
      || fail "did not resume from the newest valid checkpoint"
    grep -q "WARNING: not saving step 40 to $work/d/ck.step00000040.safetensors" "$work/d.out" \
      || fail "no warning for the skipped periodic save"
    cmp "$work/corrupt40" "$work/d/ck.step00000040.safetensors" || fail "the corrupt checkpoint was changed"
    cmp "$work/a/ck.safetensors" "$work/d/ck.safetensors" || fail "resumed past a corrupt file: other state"
    [ "$(final_loss "$work/a.out")" = "$(final_loss "$work/d.out")" ] || fail "train_loss after resuming at 30"
    # An explicit --resume of the corrupt file is not replaced: an error.
    expect_exit 1 "corrupt" --data "$work/data" --no-eval --resume "$work/d/ck.step00000040.safetensors"
    # A corrupt end-of-run file: left as it is, this run's result goes beside it as step 40's.
    mkdir -p "$work/e"
    cp "$work/a/ck.safetensors" "$work/e/"
    cp "$work/b/ck.step00000030.safetensors" "$work/e/"
    corrupt "$work/e/ck.safetensors"
    cp "$work/e/ck.safetensors" "$work/corrupt_base"
    "$exe" "${args[@]}" --save "$work/e/ck.safetensors" --resume auto > "$work/e.out" 2>&1 \
      || { cat "$work/e.out"; fail "resume past a corrupt --save file failed"; }
    cat "$work/e.out"
    grep -q "WARNING: --save $work/e/ck.safetensors holds the corrupt checkpoint .* saving to $work/e/ck.step00000040.safetensors instead" \
      "$work/e.out" || fail "no warning for the redirected end-of-run save"
    cmp "$work/corrupt_base" "$work/e/ck.safetensors" || fail "the corrupt --save file was changed"
    cmp "$work/a/ck.safetensors" "$work/e/ck.step00000040.safetensors" || fail "the redirected save: other state"
    # Nothing verifies: an error listing each file, and every file stays.
    corrupt "$work/d/ck.step00000030.safetensors"
    corrupt "$work/d/ck.safetensors"
    expect_exit 1 "no checkpoint of $work/d/ck.safetensors verifies" --data "$work/data" --no-eval \
      --save "$work/d/ck.safetensors" --resume auto
    grep -q "ck.step00000030.safetensors: " "$work/out" || fail "the error does not list step 30's file"
    cmp "$work/corrupt40" "$work/d/ck.step00000040.safetensors" || fail "the corrupt checkpoint was changed"
    ;;
  resume_ddp)
    # 2 processes under `lockstep run --max-restarts 1`: rank 1 is killed after step 25, the
    # launcher restarts the group, --resume auto continues from the step-15 checkpoint, and the
    # job ends with the very state of an uninterrupted run. Then the 2-rank checkpoint resumes
    # with 1 process (another world size) and runs to --max-steps.
    [ -x "$tool" ] || fail "no lockstep binary given"
    # 40 steps of 2 ranks read 5120 train samples. (Not in args, whose 40s become 30 below.)
    subset_data 6000
    data=(--data "$work/data")
    args=(--log-every 0 --no-eval --threads 1 --schedule cosine --max-steps 40)
    "$tool" run --standalone --nproc-per-node 2 "$exe" "${data[@]}" "${args[@]}" \
      --save "$work/a/ck.safetensors" > "$work/a.out" 2>&1 || { cat "$work/a.out"; fail "straight run failed"; }
    "$tool" run --standalone --nproc-per-node 2 --max-restarts 1 "$exe" "${data[@]}" "${args[@]}" \
      --save "$work/b/ck.safetensors" --save-every 15 --resume auto --test-crash-at-step 25 \
      > "$work/b.out" 2>&1 || { cat "$work/b.out"; fail "restarted run failed"; }
    cat "$work/b.out"
    grep -q "rank 1 on node 0 (host .*) ended with signal SIGKILL" "$work/b.out" || fail "rank 1 was not killed"
    grep -q "^\[rank0\]: .* INFO: resumed .*ck.step00000015.safetensors: step 15" "$work/b.out" \
      || fail "the restarted group did not resume from step 15"
    cmp "$work/a/ck.safetensors" "$work/b/ck.safetensors" \
      || fail "the restarted job ended with other parameters or state than the straight run"
    "$exe" "${data[@]}" "${args[@]/40/30}" --save "$work/c/ck.safetensors" \
      --resume "$work/b/ck.step00000015.safetensors" > "$work/c.out" 2>&1 \
      || { cat "$work/c.out"; fail "resuming with 1 process failed"; }
    cat "$work/c.out"
    grep -q "epoch 0 after 1920 of its samples (written by 2 ranks, now 1)" "$work/c.out" \
      || fail "no world-size change reported"
    grep -q "steps=30 " "$work/c.out" || fail "the 1-process continuation did not stop at step 30"
    ;;
  rescale)
    # Exact rescaling (Note [Rescaling], Note [Sample log] in the example): 2 ranks train until
    # rank 1 dies after step 12, 3 ranks resume the step-9 checkpoint with --resume auto and
    # finish the epoch. What the final model trained on (each run's sample log, less the steps
    # after the one the next run resumed from) is the train set, each sample once; the learning
    # rate grew by 3/2 (--lr-scaling linear); the metrics' world_size goes from 2 to 3.
    # The sizes leave no padding, so "once" is exact: 60000 samples in batches of 1000 are 30
    # steps of 2 ranks; the checkpoint at step 9 holds 9 x 2000 = 18000 of them, and the other
    # 42000 are 14 batches on each of 3 ranks (a world that did not divide them would get up to
    # 2 padding samples, the epoch's first in its order, read twice).
    [ -x "$tool" ] || fail "no lockstep binary given"
    command -v python3 > /dev/null || fail "python3 is missing (scripts/install-deps.sh installs it)"
    args=(--log-every 0 --no-eval --threads 1 --batch-size 1000 --lr 0.05 --base-batch 2000
          --lr-scaling linear --save "$work/ck/ck.safetensors" --save-every 9 --resume auto
          --metrics "$work/metrics.jsonl")
    "$tool" run --standalone --nproc-per-node 2 "$exe" "${args[@]}" --test-crash-at-step 12 \
      --test-sample-log "$work/samples.2" > "$work/a.out" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] || { cat "$work/a.out"; fail "the 2-rank job survived --test-crash-at-step 12"; }
    grep -q "rank 1 .*ended with signal SIGKILL" "$work/a.out" \
      || { cat "$work/a.out"; fail "rank 1 was not killed"; }
    "$tool" run --standalone --nproc-per-node 3 "$exe" "${args[@]}" \
      --test-sample-log "$work/samples.3" > "$work/b.out" 2>&1 \
      || { cat "$work/b.out"; fail "the 3-rank job failed"; }
    cat "$work/b.out"
    grep -q "INFO: resumed .*ck.step00000009.safetensors: step 9, epoch 0 after 18000 of its samples (written by 2 ranks, now 3)" \
      "$work/b.out" || fail "the 3-rank job did not resume from step 9"
    grep -q "INFO: learning rate rescaled from 0.05 to 0.075 (world size 2 -> 3, --lr-scaling linear)" \
      "$work/b.out" || fail "no line saying the learning rate was rescaled"
    grep -q "^\[rank0\]: final .* steps=23 " "$work/b.out" || fail "the epoch did not end at step 23 (9 + 14)"
    python3 - "$work/samples.2" "$work/samples.3" "$work/metrics.jsonl" "$(dirname "$0")" <<'PY' || fail "rescaling was not exact"
import json, sys
sys.path.insert(0, sys.argv[4])
from sample_log import check_epoch, kept_records

kept, resumes = kept_records(sys.argv[1:3])
[(resumed_at, dropped)] = resumes
assert resumed_at == 9, f"the 3-rank run resumed after step {resumed_at}, expected 9"
assert {r["step"] for r in dropped} >= {10, 11, 12}, "the 2-rank run's steps 10-12 not logged"
by_step = check_epoch(kept, 60000)
assert sorted(by_step) == list(range(1, 24)), f"steps {sorted(by_step)}, expected 1..23"
for step, rs in by_step.items():
    assert rs[0]["world_size"] == (2 if step <= 9 else 3), f"step {step}: {rs[0]}"

# The metrics: world_size 2 until the crash, then 3; the lr 3/2 of the 2-rank run's.
train = [json.loads(l) for l in open(sys.argv[3]) if '"kind":"train"' in l]
worlds = [t["world_size"] for t in train]
assert worlds == [2] * 12 + [3] * 14, f"world_size over the records: {worlds}"
lr2 = {t["lr"] for t in train if t["world_size"] == 2}
lr3 = {t["lr"] for t in train if t["world_size"] == 3}
assert len(lr2) == 1 and len(lr3) == 1, f"the lr varied within a world size: {lr2}, {lr3}"
ratio = lr3.pop() / lr2.pop()
assert abs(ratio - 1.5) < 1e-12, f"lr at 3 ranks / lr at 2 ranks = {ratio!r}, expected 1.5"
print(f"rescale: 60000 samples once each over steps 1-23; lr x {ratio:.15g}; world_size 2 -> 3")
PY
    # `lockstep plot` reads the file with its world-size change.
    "$tool" plot "$work/metrics.jsonl" -o "$work/curves.svg" > "$work/plot" 2>&1 \
      || { cat "$work/plot"; fail "plot failed"; }
    expect_exit 1 "--test-sample-log: cannot open $work/none/samples: No such file or directory" \
      --no-eval --max-steps 1 --test-sample-log "$work/none/samples"
    ;;
  elastic)
    # Elastic membership with exact rescaling (Note [Membership] in the launcher, Note
    # [Rescaling] here): two agents of `lockstep run --nnodes 1:2` on this machine, one worker
    # each. Node 0 trains alone (world 1) to a checkpoint; node 1 joins, and both go on in
    # generation 1 (world 2) from the newest checkpoint; once generation 1 has written one, node
    # 1's agent is SIGKILLed and node 0 goes on alone (generation 2, world 1) from the newest
    # checkpoint to the end of the epoch. What the final model trained on is the train set,
    # each sample once; the lr doubles at world 2 and halves back (--lr-scaling linear); the
    # metrics' world_size goes 1 -> 2 -> 1. Batches of 1000 leave no padding: every checkpoint
    # holds a multiple of 1000 samples, and the epoch ends in a world of 1.
    [ -x "$tool" ] || fail "no lockstep binary given"
    command -v python3 > /dev/null || fail "python3 is missing (scripts/install-deps.sh installs it)"
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    agent=(--nnodes 1:2 --nproc-per-node 1 --master-port "$port" --run-id "elastic-$$"
           --rdzv-last-call 0 --node-timeout 3 --timeout 60 --monitor-interval 0.05)
    args=(--log-every 0 --no-eval --threads 1 --batch-size 1000 --lr 0.05 --base-batch 1000
          --lr-scaling linear --save "$work/ck/ck.safetensors" --save-every 4 --resume auto
          --metrics "$work/metrics.jsonl" --test-sample-log "$work/samples")
    # Waits (up to 120 s) until file $1 has at least $3 lines matching $2.
    wait_lines() {
      local i
      for ((i = 0; i < 2400; ++i)); do
        [ "$(grep -c -- "$2" "$1" 2> /dev/null)" -ge "$3" ] && return 0
        sleep 0.05
      done
      cat "$work"/n*.out
      fail "no $3 lines with '$2' in $1 within 120 s"
    }
    "$tool" run "${agent[@]}" --node-rank 0 "$exe" "${args[@]}" > "$work/n0.out" 2>&1 &
    pid0=$!
    wait_lines "$work/n0.out" "INFO: saved .*ck.step00000008" 1
    "$tool" run "${agent[@]}" --node-rank 1 "$exe" "${args[@]}" > "$work/n1.out" 2>&1 &
    pid1=$!
    wait_lines "$work/n0.out" "generation 1: 2 node(s)" 1
    saved=$(grep -c "INFO: saved " "$work/n0.out")
    wait_lines "$work/n0.out" "INFO: saved " $((saved + 1))
    kill -KILL "$pid1"
    wait "$pid1"
    rc1=$?
    wait "$pid0"
    rc0=$?
    cat "$work/n0.out"
    [ "$rc1" -eq 137 ] || fail "node 1's agent exited $rc1, expected 137 (SIGKILL)"
    [ "$rc0" -eq 0 ] || fail "node 0's agent exited $rc0 after node 1 was lost"
    grep -q "generation 2: 1 node(s) by --node-rank: 0 " "$work/n0.out" || fail "no generation 2 of node 0 alone"
    grep -q "INFO: resumed .*(written by 1 ranks, now 2)" "$work/n0.out" || fail "generation 1 did not resume"
    grep -q "INFO: resumed .*(written by 2 ranks, now 1)" "$work/n0.out" || fail "generation 2 did not resume"
    grep -q "learning rate rescaled from 0.05 to 0.1 (world size 1 -> 2" "$work/n0.out" || fail "no lr rescale 1 -> 2"
    grep -q "learning rate rescaled from 0.1 to 0.05 (world size 2 -> 1" "$work/n0.out" || fail "no lr rescale 2 -> 1"
    python3 - "$work/samples" "$work/metrics.jsonl" "$(dirname "$0")" <<'PY' || fail "elastic rescaling was not exact"
import itertools, json, sys
sys.path.insert(0, sys.argv[3])
from sample_log import check_epoch, kept_records

kept, resumes = kept_records([sys.argv[1]])
assert len(resumes) == 2, f"{len(resumes) + 1} generations, expected 3"
by_step = check_epoch(kept, 60000)
restarts = [(r["restart"], r["world_size"]) for s in sorted(by_step) for r in by_step[s][:1]]
assert [k for k, _ in itertools.groupby(restarts)] == [(0, 1), (1, 2), (2, 1)], (
    f"(restart, world size) over the kept steps: {[k for k, _ in itertools.groupby(restarts)]}")
train = [json.loads(l) for l in open(sys.argv[2]) if '"kind":"train"' in l]
worlds = [k for k, _ in itertools.groupby(t["world_size"] for t in train)]
assert worlds == [1, 2, 1], f"world_size over the metrics: {worlds}"
lrs = {t["world_size"]: set() for t in train}
for t in train:
    lrs[t["world_size"]].add(t["lr"])
assert all(len(v) == 1 for v in lrs.values()), f"the lr varied within a world size: {lrs}"
assert abs(lrs[2].pop() / lrs[1].pop() - 2) < 1e-12, "the lr at world 2 is not twice world 1's"
print(f"elastic: 60000 samples once each over {len(by_step)} steps; "
      f"resumed after steps {[s for s, _ in resumes]}; world_size 1 -> 2 -> 1")
PY
    ;;
  metrics)
    # --metrics: one JSON line per optimizer step (with rank 0's peak resident memory) and one
    # per evaluation, appended across a resumed run; `lockstep plot` (a strict reader: file:line
    # for any malformed line) draws it.
    [ -x "$tool" ] || fail "no lockstep binary given"
    m="$work/run/metrics.jsonl"
    # 30 steps read 1920 train samples; the evaluation is of the whole test set.
    subset_data 6000
    "$exe" --data "$work/data" --log-every 0 --max-steps 30 --metrics "$m" \
      --save "$work/run/ck.safetensors" --save-every 20 --test-crash-at-step 25 > "$work/out1" 2>&1
    [ "$(grep -c '"kind":"train"' "$m")" -eq 25 ] || { cat "$m"; fail "expected 25 train records"; }
    "$exe" --data "$work/data" --log-every 0 --max-steps 30 --metrics "$m" \
      --save "$work/run/ck.safetensors" --resume auto > "$work/out2" 2>&1 || { cat "$work/out2"; fail "resumed run failed"; }
    [ "$(grep -c '"kind":"train"' "$m")" -eq 35 ] || fail "expected 25 + 10 train records"
    [ "$(grep -c '"kind":"eval"' "$m")" -eq 1 ] || fail "expected one eval record"
    grep -q '^{"kind":"train","step":21,"epoch":0,"world_size":1,"loss":[0-9.e-]*,"lr":0.05,"samples_per_s":[0-9.e+-]*,"peak_rss_mib":[0-9.e+]*,"time":[0-9.e+]*,"elapsed":[0-9.e+-]*}$' "$m" \
      || { cat "$m"; fail "train record format"; }
    grep -q '^{"kind":"eval","step":30,"epoch":0,"test_accuracy":0\.[0-9]*,' "$m" || fail "eval record"
    # Every line is one JSON object: the plot tool rejects anything else with the line number.
    "$tool" plot "$m" -o "$work/curves.svg" > "$work/plot" 2>&1 || { cat "$work/plot"; fail "plot failed"; }
    grep -q "<svg" "$work/curves.svg" || fail "no SVG written"
    # fp16 with clipping records the loss scale and the gradient norm.
    "$exe" --data "$work/data" --log-every 0 --no-eval --max-steps 3 --amp fp16 --clip-grad-norm 1 \
      --metrics "$work/amp.jsonl" > "$work/out3" 2>&1 || { cat "$work/out3"; fail "fp16 run failed"; }
    grep -q '"loss_scale":65536.0,"grad_norm":[0-9.e+-]*,' "$work/amp.jsonl" \
      || { cat "$work/amp.jsonl"; fail "no loss_scale / grad_norm"; }
    ;;
  progress)
    # The launcher says its stdout is a terminal: rank 0 redraws one progress line with '\r'
    # (epoch, step/total, loss, samples/s, ETA) instead of printing periodic loss lines. The
    # first 12000 train samples: an epoch of 188 steps.
    subset_data 12000
    LOCKSTEP_STDOUT_IS_TTY=1 "$exe" --data "$work/data" --max-steps 120 --no-eval --log-every 50 \
      > "$work/out" 2>&1 || { cat "$work/out"; fail "run failed"; }
    grep -q $'\r' "$work/out" || fail "no carriage return: no bar was drawn"
    grep -q "^epoch 0 \[=*>* *\] step 120/188 loss [0-9.]* [0-9]* samples/s ETA [0-9:]*" <(tr '\r' '\n' < "$work/out") \
      || { tr '\r' '\n' < "$work/out" | tail -3; fail "no final progress line"; }
    ! grep -q "^epoch 0 step 50 loss" "$work/out" || fail "periodic loss lines printed beside the bar"
    # Not a terminal: the periodic lines, no bar.
    LOCKSTEP_STDOUT_IS_TTY=0 "$exe" --data "$work/data" --max-steps 120 --no-eval --log-every 50 \
      > "$work/out" 2>&1
    grep -q "^epoch 0 step 50 loss" "$work/out" || fail "no periodic loss line without a terminal"
    ! grep -q $'\r' "$work/out" || fail "a bar was drawn without a terminal"
    ;;
  uneven)
    # --uneven (Note [Uneven inputs]): 6009 samples (the first of the train set; all 60000 cost
    # ten times the compute for the same shapes) over 7 ranks without padding are 859 on ranks
    # 0-2 and 858 on ranks 3-6, so --batch-size 286 gives them 4 batches and 3. Ranks 3-6 shadow
    # the last step (dist::Join) and every rank leaves the epoch together: the evaluation (of the
    # whole test set) and the mean loss after it, collectives of all ranks, go through, and the
    # model learned (0.32 here; 0.10 is chance).
    [ -x "$tool" ] || fail "no lockstep binary given"
    subset_data 6009
    OMP_NUM_THREADS=1 "$tool" run --standalone --nproc-per-node 7 "$exe" --uneven \
      --data "$work/data" --batch-size 286 --threads 1 --log-every 1 > "$work/out" 2> "$work/err" \
      || { cat "$work/out" "$work/err"; fail "--uneven run failed"; }
    cat "$work/out" "$work/err"
    for r in 3 4 5 6; do
      grep -q "^\[rank$r\]: .*--uneven: rank $r ran out of batches after 3 forwards and shadowed 1 " \
        "$work/out" "$work/err" \
        || fail "rank $r did not shadow the last step"
    done
    ! grep -q "rank [012] ran out of batches" "$work/out" "$work/err" || fail "a rank with 4 batches shadowed"
    grep -q "^\[rank0\]: epoch 0 step 4 loss" "$work/out" || fail "rank 0 did not take step 4"
    # Rank 0's final line (the other ranks' output may come after it).
    last=$(grep "^\[rank0\]: final " "$work/out" | tail -n 1)
    [[ "$last" =~ ^\[rank0\]:\ final\ test_accuracy=([0-9.]+)\ .*\ steps=4\  ]] || fail "last line: $last"
    awk -v a="${BASH_REMATCH[1]}" 'BEGIN { exit !(a >= 0.20) }' || fail "accuracy ${BASH_REMATCH[1]}"
    # With --zero 1 the ranks out of data also take the last step with the others (Note [Join
    # and ZeRO]; without it the others would wait in the step's all-gather); with --zero 3 (FSDP)
    # they also run the model on their last batch, so that their gathers and reduce-scatters
    # match (Note [Join and FSDP]). Each ends on plain DDP's final line, its parameters being
    # bitwise plain DDP's.
    for z in 1 3; do
      OMP_NUM_THREADS=1 "$tool" run --standalone --nproc-per-node 7 "$exe" --uneven --zero $z \
        --data "$work/data" --batch-size 286 --threads 1 --log-every 1 \
        > "$work/z$z.out" 2> "$work/z$z.err" \
        || { cat "$work/z$z.out" "$work/z$z.err"; fail "--uneven --zero $z run failed"; }
      zlast=$(grep "^\[rank0\]: final " "$work/z$z.out" | tail -n 1)
      [ "${zlast% samples_per_s=*}" = "${last% samples_per_s=*}" ] \
        || { cat "$work/z$z.out" "$work/z$z.err"; fail "--zero $z ended with '$zlast', plain DDP with '$last'"; }
    done
    ;;
  sync_bn)
    # --sync-bn: 2 ranks of --batch-size 32 normalize as one process of 64. Rank r reads positions
    # r, r + 2, ... of the sampler's permutation, so each step the two ranks hold the one
    # process's batch, and DDP averages their mean losses: the same steps, hence the same epoch
    # train_loss (the mean of all ranks' step losses) and, with the same running statistics, the
    # same test accuracy. Without --sync-bn each rank normalizes with its own 32 samples.
    [ -x "$tool" ] || fail "no lockstep binary given"
    # 5 steps of 64 read 320 train samples; the evaluation is of the whole test set.
    subset_data 6000
    common=(--data "$work/data" --model cnn-bn --max-steps 5 --log-every 0)
    "$exe" "${common[@]}" --batch-size 64 --threads 2 > "$work/one" 2>&1 \
      || { cat "$work/one"; fail "one-process run failed"; }
    for v in sync local; do
      flag=(--sync-bn)
      [ "$v" = local ] && flag=()
      OMP_NUM_THREADS=1 "$tool" run --standalone --nproc-per-node 2 "$exe" "${common[@]}" \
        --batch-size 32 --threads 1 "${flag[@]}" > "$work/$v" 2> "$work/$v.err" \
        || { cat "$work/$v" "$work/$v.err"; fail "2 ranks ($v BatchNorm) failed"; }
    done
    cat "$work/one" "$work/sync" "$work/local"
    accuracy() { sed -n 's/^\(\[rank0\]: \)\{0,1\}final test_accuracy=\([0-9.]*\) .*/\2/p' "$1"; }
    near() { awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= t) }'; }
    one=$(final_loss "$work/one") sync=$(final_loss "$work/sync") local=$(final_loss "$work/local")
    [ -n "$one" ] && [ -n "$sync" ] && [ -n "$local" ] || fail "a run printed no final train_loss"
    near "$sync" "$one" 2e-4 || fail "--sync-bn train_loss $sync, one process of 64: $one"
    near "$(accuracy "$work/sync")" "$(accuracy "$work/one")" 5e-4 \
      || fail "--sync-bn test_accuracy $(accuracy "$work/sync"), one process: $(accuracy "$work/one")"
    ! near "$local" "$one" 2e-3 \
      || fail "without --sync-bn train_loss $local is as close to $one: the comparison shows nothing"
    ;;
  slow_rank)
    # --test-slow-rank 1: rank 1's forward sleeps 100 ms in every training step (Note [Testing
    # hooks]). DDP carries every rank's compute time in its first bucket (Note [Slow rank]):
    # the metrics name rank 1 the slowest with at least the delay, --ddp-stats says so, and rank 0
    # warns once rank 1 has been above 1.5x the median for 20 steps. A busy machine may hold
    # rank 0 back in a step or two, so 20 of the 25 records must name rank 1.
    [ -x "$tool" ] || fail "no lockstep binary given"
    m="$work/metrics.jsonl"
    subset_data 6000  # 25 steps of 2 ranks read 3200 train samples
    OMP_NUM_THREADS=1 "$tool" run --standalone --nproc-per-node 2 "$exe" --data "$work/data" \
      --log-every 0 --no-eval --max-steps 25 --threads 1 --metrics "$m" --ddp-stats --test-slow-rank 1 \
      > "$work/out" 2>&1 || { cat "$work/out"; fail "lockstep run failed"; }
    cat "$work/out"
    [ "$(grep -c '"kind":"train"' "$m")" -eq 25 ] || { cat "$m"; fail "expected 25 train records"; }
    named=$(grep -c '"slowest_rank":1,"slowest_rank_ms":' "$m")
    [ "$named" -ge 20 ] || { cat "$m"; fail "rank 1 named the slowest in $named of 25 steps"; }
    sed -n 's/.*"slowest_rank":1,"slowest_rank_ms":\([0-9.e+]*\),"median_rank_ms":\([0-9.e+]*\),.*/\1 \2/p' "$m" \
      | awk '$1 < 100 || $2 <= 0 { bad = 1; print "slowest " $1 " ms, median " $2 " ms" } END { exit bad }' \
      || fail "rank 1 named with less than its 100 ms of sleep, or no median"
    grep -q "^\[rank0\]: ddp: .*; slowest rank 1: [0-9.]* ms of compute last step, median" "$work/out" \
      || fail "--ddp-stats does not name rank 1"
    grep -q "^\[rank0\]: .* WARNING: rank 1 is the slowest for 20 steps: [0-9.]* ms of compute per step against a median of [0-9.]* ms" "$work/out" \
      || fail "no warning naming rank 1"
    ;;
  zero)
    # --zero 1 (ZeRO-1, Note [ZeRO-1]): 3 ranks write the very checkpoints (parameters and the
    # full, gathered optimizer state) that 3 ranks of plain DDP write; rank 0 keeps a third of the
    # state. Its step-6 checkpoint resumes in 2 ranks, with --zero 1 and without, to the same end.
    # (12 steps carry the momentum through a checkpoint and 6 more steps; 30 cost twice the time.)
    [ -x "$tool" ] || fail "no lockstep binary given"
    # 12 steps of 3 ranks read 2304 samples.
    subset_data 6000
    args=(--data "$work/data" --log-every 0 --no-eval --threads 1 --momentum 0.9 --max-steps 12
      --save-every 6)
    for z in 0 1; do
      OMP_NUM_THREADS=1 "$tool" run --standalone --nproc-per-node 3 "$exe" "${args[@]}" --zero $z \
        --save "$work/z$z/ck.safetensors" > "$work/z$z.out" 2>&1 \
        || { cat "$work/z$z.out"; fail "3 ranks with --zero $z failed"; }
    done
    cat "$work/z1.out"
    cmp "$work/z0/ck.safetensors" "$work/z1/ck.safetensors" \
      || fail "--zero 1 ended with other parameters or optimizer state than --zero 0"
    cmp "$work/z0/ck.step00000006.safetensors" "$work/z1/ck.step00000006.safetensors" \
      || fail "the step-6 checkpoints of --zero 1 and --zero 0 differ"
    [[ "$(grep -o 'zero: rank 0 keeps [0-9]* bytes .* shard of [0-9]* of the [0-9]* parameter' "$work/z1.out")" =~ keeps\ ([0-9]+)\ bytes.*of\ the\ ([0-9]+)\ parameter ]] \
      || fail "no optimizer-state line"
    # SGD with momentum: one f32 per element; rank 0 holds about a third of them.
    awk -v b="${BASH_REMATCH[1]}" -v n="${BASH_REMATCH[2]}" 'BEGIN { exit !(b <= 4 * (n / 3 + 3) && b >= 4 * (n / 3 - 3)) }' \
      || fail "rank 0 keeps ${BASH_REMATCH[1]} bytes of state for ${BASH_REMATCH[2]} elements"
    for z in 0 1; do
      OMP_NUM_THREADS=1 "$tool" run --standalone --nproc-per-node 2 "$exe" "${args[@]}" --zero $z \
        --resume "$work/z1/ck.step00000006.safetensors" --save "$work/r$z/ck.safetensors" \
        > "$work/r$z.out" 2>&1 || { cat "$work/r$z.out"; fail "resuming in 2 ranks with --zero $z failed"; }
    done
    grep -q "written by 3 ranks, now 2" "$work/r1.out" || { cat "$work/r1.out"; fail "no world-size change"; }
    cmp "$work/r0/ck.safetensors" "$work/r1/ck.safetensors" \
      || fail "the 2-rank continuations with --zero 1 and --zero 0 differ"
    ;;
  fsdp)
    # --zero 2 and --zero 3 (FullyShardedDataParallel, each Linear of the MLP a unit; 784 x 1024
    # + 1024 elements in the first, which 3 does not divide) write the very checkpoints plain DDP
    # writes, after 12 steps, at 2 ranks on shm and 3 on Gloo. The step-6 checkpoint of 3 FSDP
    # ranks resumes in 2 ranks of plain DDP and of FSDP to the same end. (12 steps carry the
    # momentum and the clipping through a checkpoint and 6 more steps; 30 cost twice the time.)
    [ -x "$tool" ] || fail "no lockstep binary given"
    # 12 steps of 3 ranks read 2304 samples.
    subset_data 6000
    args=(--data "$work/data" --log-every 0 --no-eval --threads 1 --momentum 0.9 --max-steps 12
      --save-every 6 --clip-grad-norm 1)
    for layout in "2 shm" "3 gloo"; do
      read -r world backend <<< "$layout"
      for z in 0 2 3; do
        OMP_NUM_THREADS=1 "$tool" run --standalone --nproc-per-node "$world" "$exe" "${args[@]}" \
          --backend "$backend" --zero $z --save "$work/w$world.z$z/ck.safetensors" \
          > "$work/w$world.z$z.out" 2>&1 \
          || { cat "$work/w$world.z$z.out"; fail "$world ranks with --zero $z failed"; }
      done
      for z in 2 3; do
        for f in ck.safetensors ck.step00000006.safetensors; do
          cmp "$work/w$world.z0/$f" "$work/w$world.z$z/$f" \
            || fail "$world ranks on $backend: --zero $z wrote another $f than plain DDP"
        done
      done
    done
    for z in 0 3; do
      OMP_NUM_THREADS=1 "$tool" run --standalone --nproc-per-node 2 "$exe" "${args[@]}" --zero $z \
        --resume "$work/w3.z3/ck.step00000006.safetensors" --save "$work/r$z/ck.safetensors" \
        > "$work/r$z.out" 2>&1 || { cat "$work/r$z.out"; fail "resuming in 2 ranks with --zero $z failed"; }
    done
    grep -q "written by 3 ranks, now 2" "$work/r3.out" || { cat "$work/r3.out"; fail "no world-size change"; }
    cmp "$work/r0/ck.safetensors" "$work/r3/ck.safetensors" \
      || fail "the 2-rank continuations with --zero 3 and --zero 0 differ"
    ;;
  preempt)
    # Preemption (Note [Preemption] in include/lockstep/distributed/preemption.h): SIGTERM at a
    # random step, to `lockstep run` (which passes it on to its 2 workers) and to a single
    # process. Each finishes its step, saves the step's checkpoint beside --save and exits 143;
    # started again with --resume auto it ends on the very bits of an uninterrupted run. The
    # stopped run's last step is one of the --log-every lines, and the resumed one starts there.
    [ -x "$tool" ] || fail "no lockstep binary given"
    # 60 steps (the signal comes after step 5 to 20's line, the stop up to 6 steps later on a
    # busy machine) of 2 ranks read 7680 samples: the first 7680 of the train set are one epoch.
    subset_data 7680
    args=(--data "$work/data" --log-every 1 --no-eval --threads 1 --schedule cosine --max-steps 60)
    export OMP_NUM_THREADS=1
    # signalled NAME K [--worker] COMMAND...: runs COMMAND in the background and sends SIGTERM
    # once its output shows step K: to it, or with --worker to one of the workers it started.
    # The exit code in $rc. stopped: the run must have exited 143 after a later step that it
    # saved, that step in $stopped_step.
    signalled() {
      local name=$1 k=$2 pid target
      shift 2
      local to_worker=false
      if [ "$1" = --worker ]; then to_worker=true; shift; fi
      "$@" > "$work/$name.out" 2>&1 &
      pid=$!
      until grep -q "epoch 0 step $k loss" "$work/$name.out"; do
        kill -0 "$pid" 2> /dev/null || { cat "$work/$name.out"; fail "$name ended before step $k"; }
        sleep 0.02
      done
      target=$pid
      if $to_worker; then target=$(pgrep -P "$pid" | tail -n 1); fi
      kill -TERM "$target"
      wait "$pid" && rc=0 || rc=$?
    }
    stopped() {
      local name=$1 k=$2 s
      signalled "$@"
      [ "$rc" -eq 143 ] || { cat "$work/$name.out"; fail "$name: exit $rc after SIGTERM, expected 143"; }
      s=$(sed -n 's/.*stopped by SIGTERM after step \([0-9]*\), saved as .*/\1/p' "$work/$name.out")
      [ -n "$s" ] && [ "$s" -ge "$k" ] && [ "$s" -le 60 ] \
        || { cat "$work/$name.out"; fail "$name: no 'stopped by SIGTERM after step N' (N from $k to 60)"; }
      echo "$name: SIGTERM after step $k's line, stopped after step $s"
      stopped_step=$s
    }
    for n in 2 1; do
      if [ "$n" = 2 ]; then run=("$tool" run --standalone --nproc-per-node 2 "$exe"); else run=("$exe"); fi
      "${run[@]}" "${args[@]}" --save "$work/a$n/ck.safetensors" > "$work/a$n.out" 2>&1 \
        || { cat "$work/a$n.out"; fail "the uninterrupted run of $n failed"; }
      stopped "b$n" $((RANDOM % 16 + 5)) "${run[@]}" "${args[@]}" --save "$work/b$n/ck.safetensors" \
        --resume auto
      [ -f "$work/b$n/ck.step$(printf %08d "$stopped_step").safetensors" ] || fail "no step-$stopped_step checkpoint"
      "${run[@]}" "${args[@]}" --save "$work/b$n/ck.safetensors" --resume auto > "$work/c$n.out" 2>&1 \
        || { cat "$work/c$n.out"; fail "the resumed run of $n failed"; }
      grep -q "resumed .*ck.step$(printf %08d "$stopped_step").safetensors: step $stopped_step," "$work/c$n.out" \
        || { cat "$work/c$n.out"; fail "the run after the stop did not resume from step $stopped_step"; }
      cmp "$work/a$n/ck.safetensors" "$work/b$n/ck.safetensors" \
        || fail "$n rank(s): stopped at step $stopped_step and resumed, the run ends elsewhere than the uninterrupted one"
    done
    # SIGTERM to one worker of `lockstep run --max-restarts 3`: every rank stops after the same
    # step and saves, and the launcher takes the workers' exit 143 for a stop, not a failure to
    # restart from (the error file's stop record), and exits 143 itself.
    stopped one 5 --worker "$tool" run --standalone --nproc-per-node 2 --max-restarts 3 "$exe" \
      "${args[@]}" --save "$work/one/ck.safetensors"
    grep -q "lockstep run: rank [01] stopped on SIGTERM to save (it exits 143)" "$work/one.out" \
      && ! grep -q "restarting" "$work/one.out" \
      || { cat "$work/one.out"; fail "a worker's own stop was not taken for a stop of the job"; }
    # Without --save the stop says that nothing was saved; with --stop-signals none, SIGTERM ends
    # the process at once, as before, with no stop line.
    signalled nosave 5 "$exe" "${args[@]}"
    [ "$rc" -eq 143 ] && grep -q "stopped by SIGTERM after step [0-9]*; nothing saved (no --save)" \
      "$work/nosave.out" || { cat "$work/nosave.out"; fail "no 'nothing saved' after SIGTERM without --save"; }
    signalled none 5 "$exe" "${args[@]}" --stop-signals none --save "$work/none/ck.safetensors"
    { [ "$rc" -eq 143 ] && ! grep -q "stopped by" "$work/none.out" && [ -z "$(ls "$work/none")" ]; } \
      || { cat "$work/none.out"; ls "$work/none"; fail "--stop-signals none still stopped cleanly"; }
    ;;
  *) fail "unknown case $case_name" ;;
esac
echo PASS
