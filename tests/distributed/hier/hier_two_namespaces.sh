#!/usr/bin/env bash
# The default backend ("auto") across two "machines": two network namespaces joined by a veth
# pair, each with its own host name (a UTS namespace: network namespaces alone share the host name
# and boot id, so the backend would see one machine). First 2 ranks in each: test_distributed's
# hier workers in "sweep_detected" mode, where auto must choose hier for 2 machines x 2 ranks and
# every collective x ReduceOp x dtype must equal the reference (which is what flat Gloo gives).
# Then 1 rank in each ("one_per_machine"): auto must choose gloo. Needs root (ip netns); without
# it the test fails.
# Usage: hier_two_namespaces.sh <path-to-test_distributed>
set -uo pipefail
bin=$1
fail() { echo "FAIL: $*"; exit 1; }

command -v unshare > /dev/null || fail "'unshare' not found (install util-linux)"
source "$(dirname "$0")/../../launch/netns_pair.sh"
netns_pair lh
ns=("$ns0" "$ns1")
port=29566

# Ranks started this way (no launcher) on two machines share a token (Note [Who may reach rank 0's
# store]): without it rank 0's store would listen on every interface, open to anyone.
token=LOCKSTEP_STORE_TOKEN=hier-test-$$

# run_job MODE PER_MACHINE: 2 x PER_MACHINE ranks, machine 0 (which hosts the store) holding
# the first PER_MACHINE. The workers take the default backend, "auto", which must choose hier
# for 2 machines x 2 ranks (sweep_detected) and gloo for 2 machines x 1 rank (one_per_machine).
run_job() {
  local mode=$1 per=$2 world=$(($2 * 2)) status=0 r m rc
  local pids=()
  for ((r = 0; r < world; r++)); do
    m=$((r / per))
    env -i PATH="$PATH" RANK=$r WORLD_SIZE=$world LOCAL_RANK=$((r % per)) LOCAL_WORLD_SIZE=$per \
      MASTER_ADDR="$addr0" MASTER_PORT=$port "$token" OMP_NUM_THREADS=1 \
      LOCKSTEP_TEST_HIER_MODE=$mode LOCKSTEP_TEST_HIER_REPORT="$work/report$r" \
      timeout -k 10 240 ip netns exec "${ns[$m]}" \
      unshare --uts sh -c "hostname lockstep-hier-machine$m && exec \"\$0\"" "$bin" \
      > "$work/$mode.rank$r.log" 2>&1 &
    pids[$r]=$!
  done
  for ((r = 0; r < world; r++)); do
    wait "${pids[$r]}"
    rc=$?
    echo "--- $mode: rank $r (exit code $rc) ---"
    cat "$work/$mode.rank$r.log"
    [ "$rc" -eq 0 ] || { echo "FAIL: $mode: rank $r exited $rc (124: hung)"; status=1; }
  done
  return $status
}
run_job sweep_detected 2 || exit 1
port=$((port + 1))
run_job one_per_machine 1 || exit 1

# Without the token every rank refuses at once (within seconds, not at a timeout), saying how to
# set one; no store is opened.
token=LOCKSTEP_STORE_INSECURE=0
port=$((port + 1))
started=$(date +%s)
if run_job one_per_machine 1 > "$work/no_token.out"; then
  cat "$work/no_token.out"
  fail "ranks on two machines without a token ran"
fi
for r in 0 1; do
  grep -q "rank 0 would host the rendezvous store on every interface" "$work/one_per_machine.rank$r.log" ||
    { cat "$work/no_token.out"; fail "rank $r did not refuse the open store"; }
done
[ $(($(date +%s) - started)) -lt 60 ] || fail "the refusal took until a timeout"
echo "ok: without a token every rank refused the open store"
echo PASS
