#!/usr/bin/env bash
# ctest cluster.shaped_links: four machines on a switch (tests/cluster/shaped_cluster.sh), one
# rank each, `lockstep run` per node training the Fashion-MNIST MLP over the gloo backend. With
# every link limited to 1 Gbit/s the job must train and end on the very bits of the same job on
# unlimited links; the shaping must have held traffic back (the token buckets report overlimits);
# and nothing of the cluster may be left afterwards, also when a run fails.
#   shaped_links_test.sh SOURCE_DIR LOCKSTEP TRAIN_FASHION_MNIST
set -euo pipefail
src=$(realpath "$1") tool=$(realpath "$2") mnist=$(realpath "$3")
here=$(dirname "$(realpath "$0")")
fail() { echo "FAIL: $*" >&2; exit 1; }
skip() { echo "SKIP: $*" >&2; exit 77; }
source "$here/shaped_cluster.sh"

nodes=4 steps=8
work=$(mktemp -d /tmp/lockstep-shaped-XXXXXX)
shaped_cluster_up $nodes
# The cluster's trap, then the work folder.
trap 'shaped_cluster_down; rm -rf "$work"' EXIT
(umask 077 && head -c 24 /dev/urandom | base64 > "$work/token")
python3 "$src/tests/examples/fashion_mnist_subset.py" "$work/data" $((steps * 64 * nodes)) 1
port=$((29000 + $$ % 1000))

# run NAME: the job on every node; node 0's rank 0 saves NAME/model.safetensors.
run() {
  local name=$1 i pids=() rc=0
  mkdir -p "$work/$name"
  for ((i = 0; i < nodes; i++)); do
    LOCKSTEP_BACKEND=gloo OMP_NUM_THREADS=1 sc_exec "$i" timeout -k 5 240 "$tool" run \
      --nnodes $nodes --node-rank "$i" --master-addr "${sc_addr[0]}" --master-port "$port" \
      --nproc-per-node 1 --rdzv-timeout 60 --token-file "$work/token" --run-id "$name" \
      "$mnist" --data "$work/data" --no-eval --log-every 1 --threads 1 --max-steps $steps \
      --save "$work/$name/model.safetensors" > "$work/$name/node$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < nodes; i++)); do
    wait "${pids[i]}" || { rc=$?; echo "--- node $i exited $rc ---"; cat "$work/$name/node$i.log"; }
  done
  [ "$rc" -eq 0 ] || fail "the $name job failed"
  grep -q "^\[rank0\]: final .* steps=$steps " "$work/$name/node0.log" ||
    { cat "$work/$name/node0.log"; fail "the $name job did not train $steps steps"; }
}

# The MLP's 7.45 MB of gradients cross every link each step: ~60 ms at 1 Gbit/s.
shaped_cluster_rate 1gbit
[ "$(sc_exec 0 hostname)" = "${sc_host[0]}" ] || fail "node 0 does not have its own hostname"
run limited
held=0
for ((i = 0; i < nodes; i++)); do
  stats=$(tc -s -n "${sc_ns[i]}" qdisc show dev eth0)
  sent=$(awk '/Sent/ {print $2; exit}' <<< "$stats")
  over=$(grep -o 'overlimits [0-9]*' <<< "$stats" | awk '{print $2}')
  echo "node $i uplink: $sent bytes sent, $over overlimits"
  [ "${sent:-0}" -gt $((steps * 1000000)) ] || fail "node $i sent only ${sent:-0} bytes through its 1 Gbit/s link"
  [ "${over:-0}" -gt 0 ] && held=$((held + 1))
done
[ "$held" -gt 0 ] || fail "no link's token bucket ever held traffic back: the rate limit did not bite"

shaped_cluster_rate none
run unlimited
cmp "$work/limited/model.safetensors" "$work/unlimited/model.safetensors" ||
  fail "the job on 1 Gbit/s links ended with other parameters than on unlimited links"

shaped_cluster_down
left=$(shaped_cluster_leftovers)
[ -z "$left" ] || fail "the shaped cluster left behind: $left"
echo PASS
