#!/usr/bin/env bash
# Under `set -o pipefail` a pipeline into a reader that stops early (grep -q, grep -m, head) fails
# when the writer is still writing: the writer dies of SIGPIPE, and the pipeline's status is its
# 141 although the reader found the line. Such a check passes or fails by luck (it failed CI once,
# examples.train_fashion_mnist.uneven). This test lists every such pipeline in the repository's
# shell scripts; write `grep -q PATTERN FILE...` or `grep -q PATTERN <(command)` instead.
set -euo pipefail
repo=${1:?usage: pipefail_readers.sh REPO}
cd "$repo"

found=0
while IFS= read -r f; do
  grep -q 'pipefail' "$f" || continue
  # A pipe into grep with -q or -m among its options, or into head.
  if grep -nE '\|[[:space:]]*(grep([[:space:]]+-[[:alnum:]-]+)*[[:space:]]+-[[:alpha:]]*[qm]|head)([[:space:]]|$)' "$f" \
       > "${TMPDIR:-/tmp}/pipefail_readers.$$"; then
    sed "s|^|$f:|" "${TMPDIR:-/tmp}/pipefail_readers.$$" >&2
    found=1
  fi
done < <(git ls-files '*.sh' .ci/run 2>/dev/null ||
         find . -path ./build -prune -o \( -name '*.sh' -o -path ./.ci/run \) -type f -print)
rm -f "${TMPDIR:-/tmp}/pipefail_readers.$$"
[ "$found" = 0 ] || { echo "FAIL: pipelines into an early-exiting reader under pipefail (above)" >&2; exit 1; }
echo "no pipeline into grep -q, grep -m or head under pipefail"
