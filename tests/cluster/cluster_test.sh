#!/usr/bin/env bash
# ctest cluster.<case>: the Fashion-MNIST example started by a real scheduler, ending with the
# very checkpoint of `lockstep run --standalone` on the same number of ranks. The SLURM cases run
# a two-node cluster on this machine (tests/cluster/slurm_cluster.sh); the commands are the
# copy-paste blocks of docs/CLUSTERS.md (each marked `<!-- ci: NAME -->`), run as they are.
#
#   srun_n2     srun -n2 of the example: 2 ranks on one node
#   srun        the docs' srun block: 2 nodes x 2 ranks
#   sbatch      the docs' batch script, `lockstep run` per node, under `sbatch --wait`
#   mpirun      the docs' mpirun block (Open MPI; no SLURM)
#   preempt     the batch script again, stopped at a random step by `scancel --signal=TERM` (the
#               ranks save and exit 143, which this cluster's RequeueExit requeues), then again
#               by `scontrol requeue`; the job resumes each time and ends on the uninterrupted bits
#   preempt_srun  ranks started by srun directly, stopped by `scancel --signal=TERM` at a random
#               step; srun again with --resume auto ends on the uninterrupted bits
#
# The docs' `train_fashion_mnist` and `lockstep` are this build's, through a folder on PATH; the
# example's name there runs it shortened (no evaluation, few steps, on the first train samples:
# one epoch of 4 ranks, written by tests/examples/fashion_mnist_subset.py, which spares each
# process most of its start, decompressing and scaling all 60000 images), which the blocks leave
# alone by naming no step count.
#   cluster_test.sh CASE SOURCE_DIR LOCKSTEP TRAIN_FASHION_MNIST
set -euo pipefail
case_name=$1 src=$(realpath "$2") tool=$(realpath "$3") mnist=$(realpath "$4")
here=$(dirname "$(realpath "$0")")
source "$here/slurm_cluster.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }

case "$case_name" in
  srun_n2 | srun | sbatch | mpirun | preempt | preempt_srun) ;;
  *) fail "unknown case '$case_name'" ;;
esac
steps=30
case "$case_name" in preempt*) steps=120 ;; esac  # room for the stops
[ "$case_name" = mpirun ] || slurm_isolate "$0" "$@"
work=$(mktemp -d /tmp/lockstep-cluster-XXXXXX)
chmod 755 "$work"
cleanup() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -n "${slurm_dir:-}" ]; then
    tail -n 20 "$slurm_dir"/log/*.log >&2 2> /dev/null || true
  fi
  if ! slurm_down && [ "$rc" -eq 0 ]; then rc=1; fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
[ "$case_name" = mpirun ] || slurm_up
cd "$work"
export HOME=$work OMP_NUM_THREADS=1
mkdir bin
ln -s "$tool" bin/lockstep
python3 "$src/tests/examples/fashion_mnist_subset.py" "$work/data" $((steps * 64 * 4)) 1
cat > bin/train_fashion_mnist <<EOF
#!/bin/sh
exec "$mnist" --data "$work/data" --no-eval --log-every 1 --threads 1 --max-steps $steps "\$@"
EOF
chmod +x bin/train_fashion_mnist
export PATH=$work/bin:$PATH

# docs_block NAME: the block of docs/CLUSTERS.md marked <!-- ci: NAME -->, as a file.
docs_block() {
  python3 - "$src/docs/CLUSTERS.md" "$1" > "$work/$1.sh" <<'PY'
import re, sys
text, name = open(sys.argv[1]).read(), sys.argv[2]
blocks = re.findall(r"<!-- ci: %s -->\n```(?:bash|sh)?\n(.*?)```" % re.escape(name), text, re.S)
assert len(blocks) == 1, "docs/CLUSTERS.md has %d blocks marked 'ci: %s', expected 1" % (len(blocks), name)
sys.stdout.write(blocks[0])
PY
  echo "$work/$1.sh"
}

# reference N: the checkpoint of `lockstep run --standalone --nproc-per-node N`, in ref/.
reference() {
  lockstep run --standalone --nproc-per-node "$1" train_fashion_mnist --save ref/model.safetensors \
    > ref.out 2>&1 || { cat ref.out; fail "the reference run failed"; }
}

# same_as_reference WHAT: ckpt/model.safetensors holds the reference's bits.
same_as_reference() {
  [ -f ckpt/model.safetensors ] || fail "$1 wrote no ckpt/model.safetensors"
  cmp ref/model.safetensors ckpt/model.safetensors \
    || fail "$1 ended with other parameters or optimizer state than lockstep run"
  echo "PASS: $1 ended bitwise equal to lockstep run"
}

# job_state ID: the job's state as slurmctld sees it (PENDING, RUNNING, COMPLETED, ...).
job_state() { scontrol show job "$1" 2> /dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }

case "$case_name" in
  srun_n2)
    reference 2
    srun -n2 train_fashion_mnist --save ckpt/model.safetensors > run.out 2>&1 \
      || { cat run.out; fail "srun -n2 failed"; }
    grep -q "world_size=2" run.out || { cat run.out; fail "srun -n2 did not make a world of 2"; }
    same_as_reference "srun -n2"
    ;;
  srun)
    reference 4
    bash "$(docs_block srun)" > run.out 2>&1 || { cat run.out; fail "the docs' srun block failed"; }
    grep -q "world_size=4" run.out || { cat run.out; fail "srun did not make a world of 4"; }
    [ -f .lockstep-token ] || fail "the docs' srun block made no token file"
    same_as_reference "srun --nodes 2 --ntasks-per-node 2"
    ;;
  sbatch)
    reference 4
    (umask 077; head -c 32 /dev/urandom | base64 > .lockstep-token)
    sbatch --wait --output=job.out "$(docs_block sbatch)" > submit.out 2>&1 \
      || { cat submit.out job.out; fail "the docs' batch script failed"; }
    cat job.out
    grep -q "world_size=4" job.out || fail "the batch job did not make a world of 4"
    same_as_reference "sbatch of lockstep run per node"
    ;;
  preempt)
    # Note [Preemption] in include/lockstep/distributed/preemption.h. A requeued job starts again
    # once its old credential expired (cred_expire: 5 s on this cluster, 120 s by default).
    reference 4
    (umask 077; head -c 32 /dev/urandom | base64 > .lockstep-token)
    id=$(sbatch --parsable --open-mode=append --output=job.out "$(docs_block sbatch)") \
      || fail "sbatch failed: $id"
    # wait_for PATTERN: until job.out has a line matching it (60 s at most).
    wait_for() {
      for _ in $(seq 600); do grep -q "$1" job.out 2> /dev/null && return 0; sleep 0.1; done
      cat job.out; scontrol show job "$id"; fail "no '$1' in the job's output within 60 s"
    }
    # restarted N: the job went back to the queue (its N-th restart).
    restarted() {
      for _ in $(seq 600); do grep -q "Restarts=$1 " <(scontrol show job "$id") && return 0; sleep 0.1; done
      cat job.out; scontrol show job "$id"; fail "the job was not requeued"
    }
    stops=()
    # stopped N: the job's N-th stop, at the step named in its output; the run after it resumes there.
    stopped() {
      local s
      wait_for "stopped by SIGTERM after step"
      s=$(sed -n 's/.*stopped by SIGTERM after step \([0-9]*\), saved as .*/\1/p' job.out | sed -n "$1p")
      [ -n "$s" ] || { cat job.out; fail "stop $1 named no step"; }
      stops+=("$s")
    }
    k=$((RANDOM % 20 + 5))
    wait_for "epoch 0 step $k loss"
    scancel --signal=TERM "$id"
    stopped 1
    restarted 1
    wait_for "resumed ckpt/model.step$(printf %08d "${stops[0]}").safetensors: step ${stops[0]},"
    k=$((stops[0] + RANDOM % 20 + 5))
    wait_for "epoch 0 step $k loss"
    scontrol requeue "$id"
    for _ in $(seq 600); do [ "$(grep -c "stopped by SIGTERM after step" job.out)" -ge 2 ] && break; sleep 0.1; done
    stopped 2
    restarted 2
    wait_for "resumed ckpt/model.step$(printf %08d "${stops[1]}").safetensors: step ${stops[1]},"
    for _ in $(seq 600); do [ "$(job_state "$id")" = COMPLETED ] && break; sleep 0.1; done
    [ "$(job_state "$id")" = COMPLETED ] || { cat job.out; scontrol show job "$id"; fail "the job did not complete"; }
    cat job.out
    echo "stopped by scancel --signal=TERM after step ${stops[0]}, by scontrol requeue after ${stops[1]}"
    same_as_reference "the job stopped twice and requeued"
    ;;
  preempt_srun)
    reference 4
    k=$((RANDOM % 30 + 5))
    run=(srun --nodes 2 --ntasks-per-node 2 train_fashion_mnist --save ckpt/model.safetensors --resume auto)
    "${run[@]}" > run1.out 2>&1 &
    pid=$!
    for _ in $(seq 600); do grep -q "epoch 0 step $k loss" run1.out && break; sleep 0.1; done
    id=$(squeue -h -o %i)
    id=${id%%$'\n'*}  # the first job: the only one
    [ -n "$id" ] || { cat run1.out; fail "no job in the queue"; }
    scancel --signal=TERM "$id"
    wait "$pid" && rc=0 || rc=$?
    [ "$rc" -eq 143 ] || { cat run1.out; fail "srun exited $rc after scancel --signal=TERM, expected 143"; }
    s=$(sed -n 's/.*stopped by SIGTERM after step \([0-9]*\), saved as .*/\1/p' run1.out)
    [ -n "$s" ] || { cat run1.out; fail "the ranks did not say where they stopped"; }
    "${run[@]}" > run2.out 2>&1 || { cat run2.out; fail "srun --resume auto after the stop failed"; }
    grep -q "resumed ckpt/model.step$(printf %08d "$s").safetensors: step $s," run2.out \
      || { cat run2.out; fail "the second srun did not resume from step $s"; }
    echo "stopped by scancel --signal=TERM after step $s"
    same_as_reference "srun stopped by scancel --signal=TERM and run again"
    ;;
  mpirun)
    command -v mpirun > /dev/null || slurm_skip "no mpirun: scripts/install-deps.sh installs openmpi-bin"
    reference 2
    # Open MPI refuses root and more ranks than cores unless told.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_rmaps_base_oversubscribe=1 MASTER_PORT=$(slurm_free_port)
    bash "$(docs_block mpirun)" > run.out 2>&1 || { cat run.out; fail "the docs' mpirun block failed"; }
    grep -q "world_size=2" run.out || { cat run.out; fail "mpirun did not make a world of 2"; }
    same_as_reference "mpirun -np 2"
    ;;
esac
