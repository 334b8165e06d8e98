#!/usr/bin/env bash
# The shm backend in a container's small /dev/shm: a tmpfs of the given size mounted over
# /dev/shm in a private mount namespace (as Docker's default 64 MiB, or smaller). A group whose
# segment does not fit fails at once on every rank with an error naming /dev/shm, its size, what
# the group needs and the remedies; never SIGBUS in a collective (Note [Pages reserved at
# creation]). The gloo backend, the remedy it names, runs in the same /dev/shm. Needs root
# (mount namespaces); fails without it.
# Usage: small_dev_shm.sh LOCKSTEP_TOOL LAUNCH_WORKER
set -euo pipefail
tool=${1:?usage: small_dev_shm.sh LOCKSTEP_TOOL LAUNCH_WORKER}
worker=${2:?usage: small_dev_shm.sh LOCKSTEP_TOOL LAUNCH_WORKER}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# in_small_shm SIZE COMMAND...: runs COMMAND with a fresh tmpfs of SIZE over /dev/shm.
in_small_shm() {
  unshare -m bash -c 'mount -t tmpfs -o size="$0" tmpfs /dev/shm && exec "$@"' "$@"
}
in_small_shm 1m true || fail "cannot mount a tmpfs in a private mount namespace (needs root)"

# job NAME SIZE NPROC [VAR=VALUE...]: a DDP job of launch_worker; its exit code in $rc.
job() {
  local name=$1 size=$2 nproc=$3
  shift 3
  mkdir -p "$work/$name"
  set +e
  env "$@" OMP_NUM_THREADS=1 bash -c "$(declare -f in_small_shm); in_small_shm \"\$@\"" _ "$size" \
    "$tool" run --standalone --nproc-per-node "$nproc" "$worker" ddp "$work/$name" 3 \
    > "$work/$name.out" 2> "$work/$name.err"
  rc=$?
  set -e
}

expect_refused() {
  local name=$1 free=$2 needs=$3
  [ "$rc" = 1 ] || { cat "$work/$name.out" "$work/$name.err"; fail "$name: exit $rc, expected 1"; }
  for want in "cannot reserve the shared-memory segment: /dev/shm has $free MiB free of $free MiB" \
              "needs $needs MiB" "docker run --shm-size=" "LOCKSTEP_BACKEND=gloo"; do
    grep -qF -- "$want" "$work/$name.err" || { cat "$work/$name.err"; fail "$name: no '$want'"; }
  done
  ! grep -q "SIGBUS" "$work/$name.err" || { cat "$work/$name.err"; fail "$name: SIGBUS"; }
  echo "ok: $name refused, naming /dev/shm and the remedies"
}

# 1 MiB: two ranks' segment (two 4 MiB slots) does not fit.
job two_in_1m 1m 2
expect_refused two_in_1m 1.0 8.0
# Docker's default 64 MiB: sixteen 4 MiB slots and the control page do not fit.
job sixteen_in_64m 64m 16
expect_refused sixteen_in_64m 64.0 64.0

# The remedy it names: gloo in the same 1 MiB trains.
job gloo_in_1m 1m 2 LOCKSTEP_BACKEND=gloo
[ "$rc" = 0 ] || { cat "$work/gloo_in_1m.out" "$work/gloo_in_1m.err"; fail "gloo in 1 MiB: exit $rc"; }
grep -q "rank 1 trained 3 steps" "$work/gloo_in_1m.out" || fail "gloo in 1 MiB did not train"
# Room enough: shm in 16 MiB trains.
job shm_in_16m 16m 2
[ "$rc" = 0 ] || { cat "$work/shm_in_16m.out" "$work/shm_in_16m.err"; fail "shm in 16 MiB: exit $rc"; }
grep -q "rank 1 trained 3 steps" "$work/shm_in_16m.out" || fail "shm in 16 MiB did not train"
echo "ok: gloo in 1 MiB and shm in 16 MiB train"
