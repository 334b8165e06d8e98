#!/usr/bin/env bash
# lockstep's DDP against PyTorch's DDP between emulated machines with rate-limited links: N
# network namespaces with their own hostnames (tests/cluster/shaped_cluster.sh), one rank each,
# the Fashion-MNIST MLP (or CNN), batch 64 per rank, 1 thread per rank, SGD with momentum.
# lockstep runs bench/ddp's worker under `lockstep run` on every node; PyTorch runs
# bench/pytorch_ddp.py's worker under torchrun on every node (Gloo on the node's eth0). Each
# repetition runs both, alternating which goes first; rank 0's time per step (after WARMUP
# steps) is printed for both and their ratio (PyTorch ms / lockstep ms: above 1, lockstep is
# faster). torchrun gets --redirects 0:1 --tee 0:1: its default "0" is parsed as None under
# Python 3.11 (torch 1.13), which fails its start.
#
#   bench/shaped_ddp.sh [BUILD_DIR]     (root; needs Debian's python3-torch)
#   NODES=4 RATES="1gbit" REPS=3 STEPS=60 MODEL=mlp bench/shaped_ddp.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/bench/shaped_common.sh"
/usr/bin/python3 -c 'import torch' 2> /dev/null || fail "PyTorch is missing: apt-get install python3-torch"
rates=${RATES:-1gbit} reps=${REPS:-3} steps=${STEPS:-60} warmup=${WARMUP:-5}
model=${MODEL:-mlp} hook_config=${CONFIG:-1}
shaped_start "${NODES:-4}" "${1:-$root/build/release}" bench/ddp

# run_job KIND: one job on every node; prints rank 0's line: samples/s and ms per step (and for
# lockstep: forward, backward, optimizer, exposed communication and all-reduce-alone ms, gradient
# bytes, buckets).
run_job() {
  local kind=$1 i pids=() out run
  out=$(mktemp "$work/$kind.XXXXXX")
  if [ "$kind" = lockstep ]; then
    shaped_run lockstep 1 LOCKSTEP_BENCH_DDP="$hook_config:$model:64:$warmup:$steps:$out" \
      LOCKSTEP_BACKEND=gloo -- "$build/bench/ddp"
  else
    run=$(shaped_next_run)
    for ((i = 0; i < nodes; i++)); do
      GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 sc_exec "$i" timeout 600 /usr/bin/python3 -m \
        torch.distributed.run --redirects 0:1 --tee 0:1 --nnodes "$nodes" --node_rank "$i" \
        --nproc_per_node 1 --master_addr "${sc_addr[0]}" --master_port "$((port + run))" \
        "$root/bench/pytorch_ddp.py" --worker "$model" 64 "$warmup" "$steps" "$out" \
        > "$work/pytorch.$i.log" 2>&1 &
      pids+=($!)
    done
    for ((i = 0; i < nodes; i++)); do
      wait "${pids[i]}" || { cat "$work/pytorch.$i.log" >&2; fail "pytorch: node $i's job failed"; }
    done
  fi
  cat "$out"
}

echo "# $model, $nodes nodes x 1 rank, batch 64 per rank, $steps steps after $warmup," \
  "$(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg), $(date -u +%FT%TZ)"
for ((rep = 1; rep <= reps; rep++)); do
  for rate in $rates; do
    shaped_cluster_rate "$rate"
    if ((rep % 2)); then a=$(run_job lockstep) b=$(run_job pytorch)
    else b=$(run_job pytorch) a=$(run_job lockstep); fi
    awk -v r="$rate" -v n="$rep" -v a="$a" -v b="$b" 'BEGIN {
      split(a, l, " "); split(b, t, " ")
      printf "rate %-7s rep %d: lockstep %.1f ms/step, PyTorch %.1f ms/step, PyTorch/lockstep %.2f" \
             " (lockstep: fwd %.1f bwd %.1f opt %.1f exposed %.1f, all-reduce alone %.1f ms," \
             " %d buckets)\n", r, n, l[2], t[2], t[2] / l[2], l[3], l[4], l[5], l[6], l[7], l[9] }'
  done
done
