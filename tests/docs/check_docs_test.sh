#!/usr/bin/env bash
# The test of the doc test: check_docs.py fails on tests/docs/fixtures/bad.md, reporting each of
# its problems at its line and nothing else, and passes tests/docs/fixtures/good.md (its runnable
# blocks included), each held to the sentence limit.
set -euo pipefail
repo=${1:?usage: check_docs_test.sh REPO BUILD_DIR}
build=${2:?usage: check_docs_test.sh REPO BUILD_DIR}
check=(python3 "$repo/tests/docs/check_docs.py" --repo "$repo" --build "$build")
fail() { echo "FAIL: $*" >&2; exit 1; }

bad=tests/docs/fixtures/bad.md
rc=0
out=$("${check[@]}" --conforming "$bad" "$bad" 2>&1) || rc=$?
echo "$out"
[ "$rc" = 1 ] || fail "check_docs.py exited with $rc on $bad, not 1"
expected=(
  "$bad:3: path: src/distributed/no_such_file.cpp does not exist"
  "$bad:3: path: header lockstep/nn/no_such_header.h does not exist"
  "$bad:5: path: ./build/release/examples/train_nothing: no program train_nothing"
  "$bad:8: flag: --no-such-flag is not a flag of \`train_fashion_mnist\`"
  "$bad:9: flag: --no-such-launcher-flag is not a flag of \`lockstep run\`"
  "$bad:10: flag: --modle is not a flag of \`train_fashion_mnist\`"
  "$bad:11: flag: \`lockstep\` has no subcommand runn"
  "$bad:14: link: NO_SUCH.md leads to no file"
  "$bad:14: link: #no-such-heading is no heading of $bad"
  "$bad:14: flag: --zeroo is a flag of none of"
  "$bad:16: sentence: a sentence of 41 words"
  "$bad:20: run: the block exited with 1"
  "$bad:25: run: a doc-test marker with no code block after it"
)
for line in "${expected[@]}"; do
  grep -qF -- "$line" <<< "$out" || fail "not reported: $line"
done
[ "$(grep -c "^$bad:" <<< "$out")" = "${#expected[@]}" ] ||
  fail "check_docs.py reported other problems than the ${#expected[@]} expected (above)"
grep -qF "FAIL: ${#expected[@]} problems" <<< "$out" || fail "no FAIL line with the count"

good=tests/docs/fixtures/good.md
out=$("${check[@]}" --conforming "$good" "$good" 2>&1) || fail "check_docs.py failed on $good:
$out"
echo "$out"
[ "$(grep -c "^$good: ran the block" <<< "$out")" = 2 ] || fail "$good's two blocks did not run"
echo "check_docs.py fails on each problem of $bad and passes $good"
