#!/usr/bin/env bash
# No source file in src/, tools/ or examples/ is over 800 lines: past that a reader loses the
# thread (split by concept, as examples/train_fashion_mnist.cpp is split into its flags, its
# setup, its checkpoint position and the training loop). This test lists every longer file.
set -euo pipefail
repo=${1:?usage: file_length.sh REPO}
limit=${2:-800}
cd "$repo"

long=0
while IFS= read -r -d '' f; do
  n=$(wc -l < "$f")
  if [ "$n" -gt "$limit" ]; then
    echo "$f: $n lines (at most $limit)" >&2
    long=$((long + 1))
  fi
done < <(find src tools examples -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' \
  -o -name '*.cuh' -o -name '*.py' -o -name '*.sh' \) -print0)
if [ "$long" -gt 0 ]; then
  echo "FAIL: $long files over $limit lines (above)" >&2
  exit 1
fi
echo "no file over $limit lines in src/, tools/ or examples/"
