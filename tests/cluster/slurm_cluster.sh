# A SLURM cluster of two nodes on this machine, for the cluster tests (sourced, not run):
# munged, slurmctld and two slurmd ("n1" and "n2", each with a port of its own) under a
# temporary folder, with a slurm.conf of their own; nothing of the machine's configuration is
# read or changed.
#
#   source slurm_cluster.sh
#   slurm_isolate "$0" "$@"   # re-runs the calling script in private PID and mount namespaces
#   trap '...; slurm_down' EXIT  # however the test ends
#   slurm_up                  # starts the daemons
#
# Everything runs inside a PID namespace whose first process is the calling script: when it
# ends, the kernel kills whatever is left in the namespace (a daemon that ignored SIGTERM, a
# job step's slurmstepd), so a failing test cannot leave a daemon or a listening port behind.
# slurm_down still stops each daemon by its PID and checks that it went, so a daemon that would
# not stop is an error, not a leak. In the same mount namespace a private /etc/hosts names n1
# and n2 (both 127.0.0.1), which is what lets SLURM_NODELIST's first host serve as MASTER_ADDR.
#
# Needs root (namespaces, daemons that run as root) and the packages slurmctld, slurmd,
# slurm-client and munge (scripts/install-deps.sh installs them). Without either, the calling
# test exits 77 (skipped) and says why.

# slurm_skip REASON: the test cannot run here; ctest counts exit 77 as skipped.
slurm_skip() {
  echo "SKIP: $*" >&2
  exit 77
}

# slurm_isolate SCRIPT ARGS...: re-executes SCRIPT in new PID and mount namespaces (once: inside
# them, returns at once).
slurm_isolate() {
  [ -n "${LOCKSTEP_SLURM_ISOLATED:-}" ] && return 0
  [ "$(id -u)" -eq 0 ] || slurm_skip "the SLURM daemons and the namespaces need root"
  local c
  for c in munged slurmctld slurmd srun sbatch scontrol sinfo unshare; do
    command -v "$c" > /dev/null \
      || slurm_skip "no '$c' on PATH: scripts/install-deps.sh installs slurmctld, slurmd, slurm-client and munge"
  done
  unshare --pid --fork --mount-proc true 2> /dev/null \
    || slurm_skip "cannot create a PID namespace here (unshare --pid --fork --mount-proc)"
  # --kill-child: killed from outside (a ctest timeout), unshare takes the namespace with it.
  LOCKSTEP_SLURM_ISOLATED=1 exec unshare --pid --fork --mount-proc --kill-child bash "$@"
}

slurm_free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# slurm_up: starts munged, slurmctld and slurmd n1, n2, and waits until both nodes are idle.
# Sets SLURM_CONF (every SLURM command reads it) and slurm_dir.
slurm_up() {
  # Only as the first process of the namespaces: the /etc/hosts below must stay private.
  [ -n "${LOCKSTEP_SLURM_ISOLATED:-}" ] && [ $$ -eq 1 ] \
    || { echo "FAIL: slurm_up outside the namespaces of slurm_isolate" >&2; exit 1; }
  slurm_dir=$(mktemp -d /tmp/lockstep-slurm-XXXXXX)
  # munged refuses a socket folder that others may write to, and checks every parent.
  chmod 755 "$slurm_dir"
  mkdir -m 755 "$slurm_dir/munge" "$slurm_dir/log"
  mkdir -p "$slurm_dir/state" "$slurm_dir/spool/n1" "$slurm_dir/spool/n2"
  head -c 1024 /dev/urandom > "$slurm_dir/munge/munge.key"
  chmod 400 "$slurm_dir/munge/munge.key"

  # The private /etc/hosts: the machine's, plus the two node names.
  { cat /etc/hosts; echo "127.0.0.1 n1 n2"; } > "$slurm_dir/hosts"
  mount --bind "$slurm_dir/hosts" /etc/hosts || slurm_skip "cannot bind-mount a private /etc/hosts"

  munged --force --key-file="$slurm_dir/munge/munge.key" --socket="$slurm_dir/munge/socket" \
    --pid-file="$slurm_dir/munged.pid" --log-file="$slurm_dir/log/munged.log" \
    --seed-file="$slurm_dir/munge/seed" \
    || slurm_fail_up "munged did not start" "$slurm_dir/log/munged.log"

  slurm_ports=("$(slurm_free_port)" "$(slurm_free_port)" "$(slurm_free_port)")
  cat > "$slurm_dir/slurm.conf" <<CONF
# Written by tests/cluster/slurm_cluster.sh: two nodes on one machine.
ClusterName=lockstep-test
# Job ids name the ranks' default store port (20000 + id mod 20000): not the same in every run.
FirstJobId=$((RANDOM % 10000 + 1))
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=${slurm_ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds (120 by default) before it starts again.
AuthInfo=socket=$slurm_dir/munge/socket,cred_expire=5
CredType=cred/munge
# The cgroup freezer is not mounted in a container: track a step's processes by their parents.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# Each node claims more CPUs than the machine has: the tests start more ranks than cores.
SlurmdParameters=config_overrides
ReturnToService=2
# What a preempted job's requeue needs: jobs may be requeued, and a requeued one starts again.
JobRequeue=1
# A requeued job is started by the next pass of the scheduler, every 60 s by default.
SchedulerParameters=sched_interval=1
KillWait=30
# A job that exits 143 (a rank stopped by SIGTERM after saving: Note [Preemption]) is requeued.
RequeueExit=143
StateSaveLocation=$slurm_dir/state
SlurmdSpoolDir=$slurm_dir/spool/%n
SlurmctldPidFile=$slurm_dir/slurmctld.pid
SlurmdPidFile=$slurm_dir/slurmd.%n.pid
SlurmctldLogFile=$slurm_dir/log/slurmctld.log
SlurmdLogFile=$slurm_dir/log/slurmd.%n.log
NodeName=n1 NodeAddr=127.0.0.1 Port=${slurm_ports[1]} CPUs=8 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=${slurm_ports[2]} CPUs=8 State=UNKNOWN
PartitionName=test Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF=$slurm_dir/slurm.conf
  slurmctld -i || slurm_fail_up "slurmctld did not start" "$slurm_dir/log/slurmctld.log"
  slurmd -N n1 || slurm_fail_up "slurmd n1 did not start" "$slurm_dir/log/slurmd.n1.log"
  slurmd -N n2 || slurm_fail_up "slurmd n2 did not start" "$slurm_dir/log/slurmd.n2.log"
  local i
  for i in $(seq 100); do
    [ "$(sinfo -h -o '%T %D' 2> /dev/null)" = "idle 2" ] && return 0
    sleep 0.1
  done
  sinfo >&2 || true
  slurm_fail_up "the two nodes were not idle within 10 s" "$slurm_dir/log/slurmctld.log"
}

# slurm_fail_up WHAT LOG: a daemon did not come up; prints its log and fails the test.
slurm_fail_up() {
  echo "FAIL: $1; its log ($2):" >&2
  tail -n 30 "$2" >&2 2> /dev/null || true
  exit 1
}

# slurm_down: stops every daemon by the PID in its PID file, waits until each is gone (SIGKILL
# after 10 s), and checks that none of their ports is still listened on; returns 1 (after
# saying what) when one was left or had to be killed. For the caller's EXIT trap; does nothing
# before slurm_up.
slurm_down() {
  [ -n "${slurm_dir:-}" ] && [ -d "$slurm_dir" ] || return 0
  local f pid left=() i p
  # Jobs first, so that no slurmstepd outlives its slurmd.
  scancel --full --quiet --user root 2> /dev/null || true
  for f in slurmd.n1 slurmd.n2 slurmctld munged; do
    [ -f "$slurm_dir/$f.pid" ] || continue
    pid=$(cat "$slurm_dir/$f.pid")
    kill "$pid" 2> /dev/null || continue
    for i in $(seq 100); do kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2> /dev/null; then
      left+=("$f (pid $pid) ignored SIGTERM for 10 s")
      kill -9 "$pid" 2> /dev/null || true
    fi
  done
  for p in "${slurm_ports[@]}"; do
    ss -Hltn "sport = :$p" 2> /dev/null | grep -q . && left+=("port $p is still listened on")
  done
  umount /etc/hosts 2> /dev/null || true
  if [ ${#left[@]} -gt 0 ]; then
    printf 'FAIL: the SLURM daemons did not stop cleanly: %s\n' "${left[@]}" >&2
    tail -n 20 "$slurm_dir"/log/*.log >&2 2> /dev/null || true
    rm -rf "$slurm_dir"
    return 1
  fi
  rm -rf "$slurm_dir"
}
