#!/usr/bin/env bash
# all_reduce, 2 processes on this machine: lockstep's shm and gloo backends (bench/allreduce,
# alternating round by round) and then Open MPI's MPI_Allreduce on the same sizes
# (bench/mpi/mpi_allreduce), back to back; the lockstep part also with 4 processes (more than
# these 2 cores). Installs Open MPI (Debian's openmpi-bin and
# libopenmpi-dev) for this benchmark only, and builds the two programs in BUILD.
# Usage: scripts/bench-allreduce.sh [BUILD (default build/release)] [ROUNDS (default 7)]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
rounds=${2:-7}
if ! command -v mpirun > /dev/null || [ ! -e /usr/include/x86_64-linux-gnu/mpi.h ] &&
  ! command -v mpicxx > /dev/null; then
  [ "$(id -u)" -eq 0 ] || { echo "bench-allreduce: needs root to install Open MPI" >&2; exit 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev > /dev/null
fi
[ -f "$build/CMakeCache.txt" ] || { echo "bench-allreduce: configure $build first (make build)" >&2; exit 1; }
cmake "$build" > /dev/null  # finds MPI now that it is installed
cmake --build "$build" --target allreduce mpi_allreduce
mkdir -p bench/results
echo "== $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"
OMP_NUM_THREADS=1 "$build/bench/allreduce" --procs 2,4 --rounds "$rounds" --json bench/results/allreduce.json
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  mpirun -np 2 --bind-to none "$build/bench/mpi_allreduce" --rounds "$rounds" \
  --json bench/results/mpi_allreduce.json
echo "== load at the end $(cut -d' ' -f1-3 /proc/loadavg)"
