#!/usr/bin/env bash
# `lockstep run` across two "machines": two network namespaces joined by a veth pair, one agent in
# each (--nnodes 2), training the DDP test MLP for a few steps; both agents must exit 0 and both
# ranks must end with identical parameters. Needs root (ip netns); without it the test fails.
# Usage: two_machines.sh <path-to-lockstep> <path-to-launch_worker>
set -uo pipefail
tool=$1
worker=$2
fail() { echo "FAIL: $*"; exit 1; }

source "$(dirname "$0")/netns_pair.sh"
netns_pair ls
port=29555

mkdir -p "$work/out"
# The secret the two machines share (a job on several machines needs one).
(umask 077 && head -c 24 /dev/urandom | base64 > "$work/token")
# Node 1 first: its agent must wait for node 0's.
for node in 1 0; do
  ns_var=ns$node
  timeout -k 10 240 ip netns exec "${!ns_var}" "$tool" run --nnodes 2 --node-rank "$node" \
    --master-addr "$addr0" --master-port "$port" --nproc-per-node 1 --rdzv-timeout 120 \
    --token-file "$work/token" \
    "$worker" ddp "$work/out" 5 > "$work/node$node.log" 2>&1 &
  pids[$node]=$!
  sleep 1
done
status=0
for node in 0 1; do
  wait "${pids[$node]}"
  rc=$?
  echo "--- node $node (exit code $rc) ---"
  cat "$work/node$node.log"
  [ "$rc" -eq 0 ] || { echo "FAIL: node $node's agent exited $rc (124: hung)"; status=1; }
done
[ "$status" -eq 0 ] || exit 1

h0=$(cat "$work/out/rank0.hash" 2> /dev/null)
h1=$(cat "$work/out/rank1.hash" 2> /dev/null)
[ -n "$h0" ] && [ -n "$h1" ] || fail "a rank wrote no parameter hash"
[ "$h0" = "$h1" ] || fail "the ranks' parameters differ: $h0 vs $h1"
# The ranks ran in different namespaces: rank 1 on node 1.
grep -q "^\[rank1\]: rank 1 trained 5 steps" "$work/node1.log" || fail "rank 1 did not run on node 1"
# Node 0's store listens on the address the other node connects to, not on every interface.
grep -q "the store listens on $addr0:$port " "$work/node0.log" ||
  fail "node 0's store does not listen on $addr0:$port only"
echo PASS
