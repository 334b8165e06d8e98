#!/usr/bin/env bash
# Sourced by the bench/shaped_*.sh scripts: the setup they share and the way they start a job.
#
#   shaped_start NODES BUILD_DIR PROGRAM...
# Sets build, tool (the launcher), work (a scratch directory holding a job token) and port; checks
# that each PROGRAM (a path in the build directory) is built; brings up a shaped cluster of NODES
# emulated machines (tests/cluster/shaped_cluster.sh) and takes it and the scratch directory down
# when the script exits, however it exits.
#
#   shaped_run NAME NPROC [VAR=VALUE...] -- PROGRAM ARGS...
# Runs PROGRAM ARGS under `lockstep run` on every node at once, NPROC ranks each, with
# OMP_NUM_THREADS=1 and each VAR=VALUE in their environment, and waits for all of them. Each job
# gets its own run id and port; node i writes $work/NAME.i.log. A node that fails prints its log
# and fails the script.
#
#   shaped_next_run
# Prints the next job number (1, 2, ...), counted in $work so that jobs started from subshells
# ($(...)) count too; a job's port is $port + its number.
#
# The caller sets root (the repository) before sourcing this file.
: "${root:?set root to the repository before sourcing bench/shaped_common.sh}"
source "$root/tests/cluster/shaped_cluster.sh"

fail() { echo "FAIL: $*" >&2; exit 1; }

shaped_start() {
  local n=$1 p
  build=$(realpath "$2")
  shift 2
  tool=$build/tools/lockstep
  for p in tools/lockstep "$@"; do
    [ -x "$build/$p" ] || fail "$build/$p is not built (make build builds the programs and benches)"
  done
  nodes=$n
  work=$(mktemp -d)
  shaped_cluster_up "$nodes"
  trap 'shaped_cluster_down; rm -rf "$work"' EXIT
  (umask 077 && head -c 24 /dev/urandom | base64 > "$work/token")
  port=$((29000 + $$ % 1000))
  echo 0 > "$work/runs"
}

shaped_next_run() {
  local n
  n=$(($(cat "$work/runs") + 1))
  echo "$n" > "$work/runs"
  echo "$n"
}

shaped_run() {
  local name=$1 nproc=$2 i pids=() vars=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
  [ $# -gt 1 ] || fail "shaped_run: expected VAR=VALUE... -- PROGRAM ARGS..., got no program"
  shift
  local run
  run=$(shaped_next_run)
  for ((i = 0; i < nodes; i++)); do
    (
      export OMP_NUM_THREADS=1 "${vars[@]}"
      sc_exec "$i" timeout 900 "$tool" run --nnodes "$nodes" --node-rank "$i" \
        --master-addr "${sc_addr[0]}" --master-port "$((port + run))" \
        --nproc-per-node "$nproc" --token-file "$work/token" --run-id "r$run" "$@"
    ) > "$work/$name.$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < nodes; i++)); do
    wait "${pids[i]}" || { cat "$work/$name.$i.log" >&2; fail "$name: node $i's job failed"; }
  done
}
