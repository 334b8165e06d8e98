#!/usr/bin/env bash
# Every environment variable the library and its examples read goes through one parser
# (src/base/env_var.cpp), which checks its value against a range and names the variable in its
# error. A getenv anywhere else in src/, include/ or examples/ reads a LOCKSTEP_ variable (or
# another) unchecked: `abc` or `-5` silently taken as a number. This test lists every such call;
# read through env_string, env_int, env_double or env_flag (lockstep/base/env_var.h) instead.
# The launcher (tools/lockstep) checks its variables with its flags and is not listed.
set -euo pipefail
repo=${1:?usage: env_reads.sh REPO}
cd "$repo"

parser=src/base/env_var.cpp
out=${TMPDIR:-/tmp}/env_reads.$$
trap 'rm -f "$out"' EXIT
# getenv, std::getenv, ::getenv, secure_getenv; lines that are only a comment do not count.
grep -rnE --include='*.cpp' --include='*.cc' --include='*.h' --include='*.hpp' --include='*.cu' \
  --include='*.cuh' 'getenv[[:space:]]*\(' src include examples |
  grep -vE '^[^:]+:[0-9]+:[[:space:]]*//' | grep -v "^$parser:" > "$out" || true
if [ -s "$out" ]; then
  cat "$out" >&2
  echo "FAIL: getenv outside $parser (above); read through lockstep/base/env_var.h" >&2
  exit 1
fi
echo "no getenv outside $parser"
