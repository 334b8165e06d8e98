#!/usr/bin/env bash
# Diagnosis across machines: two agents in two network namespaces (--nnodes 2):
# 1. rank 1, on node 1, stops itself (SIGSTOP) while rank 0, on node 0, waits for it in an
#    all_reduce: node 0's launcher must warn, naming rank 1 as stopped, from the view node 1's
#    agent published through the store, and start the failure summary with the same verdict.
# 2. a node lost mid-job, seen from both sides: the link between the namespaces goes down; node
#    0 must fail the job naming node 1 as lost, and node 1 must stop on losing node 0's store,
#    each within a few --node-timeouts rather than at a collective timeout.
# Needs root (ip netns).
# Usage: two_machines_diagnosis.sh <path-to-lockstep> <path-to-launch_worker>
set -uo pipefail
tool=$1
worker=$2
fail() { echo "FAIL: $*"; exit 1; }

source "$(dirname "$0")/netns_pair.sh"
netns_pair ll
port=29556

(umask 077 && head -c 24 /dev/urandom | base64 > "$work/token")

# 1. The stopped rank on the other machine. (The workers share /dev/shm and the boot id, so the
# auto backend picks shm; what crosses the namespaces is the agents' views, through the store.)
for node in 0 1; do
  ns_var=ns$node
  LOCKSTEP_RENDEZVOUS_TIMEOUT=60 timeout -k 10 120 ip netns exec "${!ns_var}" "$tool" run \
    --nnodes 2 --node-rank "$node" --master-addr "$addr0" --master-port "$port" \
    --nproc-per-node 1 --rdzv-timeout 60 --timeout 12 --stall-timeout 2 \
    --token-file "$work/token" "$worker" hang stop > "$work/stop$node.log" 2>&1 &
  pids[$node]=$!
done
for node in 0 1; do wait "${pids[$node]}"; rcs[$node]=$?; done
echo "--- stopped rank: node 0 (exit code ${rcs[0]}) ---"
cat "$work/stop0.log"
echo "--- stopped rank: node 1 (exit code ${rcs[1]}) ---"
cat "$work/stop1.log"
[ "${rcs[0]}" -eq 1 ] && [ "${rcs[1]}" -eq 1 ] || fail "expected both agents to exit 1"
named="rank 1 never issued all_reduce #2 (sum, 1024 x f32) (it last finished all_reduce #1"
grep -q "warning: $named" "$work/stop0.log" || fail "node 0 did not warn about rank 1"
grep -q "warning: .*it is stopped (state [Tt])" "$work/stop0.log" ||
  fail "node 0's warning does not say rank 1 is stopped"
grep -q "verdict: $named.*it is stopped (state [Tt])" "$work/stop0.log" ||
  fail "node 0's summary does not start with the verdict naming the stopped rank"
grep -q "verdict: $named" "$work/stop1.log" || fail "node 1's summary has no verdict"
grep -q "  rank 1 (node 1, host .*): stopped" "$work/stop0.log" ||
  fail "node 0 does not show rank 1's state from node 1"

# 2. The lost link.
for node in 0 1; do
  ns_var=ns$node
  # The workers sleep (120 s, then fail): only the agents can notice the lost link.
  timeout -k 10 150 ip netns exec "${!ns_var}" "$tool" run --nnodes 2 --node-rank "$node" \
    --master-addr "$addr0" --master-port "$port" --nproc-per-node 1 --rdzv-timeout 60 \
    --node-timeout 5 --token-file "$work/token" \
    "$worker" sleep > "$work/node$node.log" 2>&1 &
  pids[$node]=$!
done
# Both workers started: each agent has joined and its worker wrote its pid file... the workers
# print nothing, so wait until both agents have been running a while after the rendezvous.
for _ in $(seq 1 60); do
  [ "$(grep -c "store listens" "$work/node0.log")" -ge 1 ] && break
  sleep 0.5
done
sleep 6  # the agents' first heartbeats are exchanged
ip -n "$ns0" link set "$veth0" down || fail "cannot take $veth0 down"
cut=$(date +%s)
status=0
for node in 0 1; do
  wait "${pids[$node]}"
  rc=$?
  took=$(($(date +%s) - cut))
  echo "--- node $node (exit code $rc, $took s after the cut) ---"
  cat "$work/node$node.log"
  [ "$rc" -eq 1 ] || { echo "FAIL: node $node's agent exited $rc, expected 1 (124: hung)"; status=1; }
  # --node-timeout 5 plus a watch interval and the stop: far below the workers' 120 s.
  [ "$took" -le 40 ] || { echo "FAIL: node $node took $took s to notice"; status=1; }
done
[ "$status" -eq 0 ] || exit 1
grep -q "the job failed: node 1 (host .*) is lost: its launcher has not been heard from for" \
  "$work/node0.log" || fail "node 0 did not name node 1 as lost"
grep -q "lost node 0's store at $addr0:$port" "$work/node1.log" ||
  fail "node 1 did not say it lost node 0's store"
echo PASS
