#!/usr/bin/env bash
# Checks examples/train_gpt end to end: --prepare on good text (the token files hold the text, the
# last line is machine-readable), on the fortunes corpus, and on bad input (a missing, empty or
# non-UTF-8 file: exit 1 naming the file), and that training says it is not built yet (exit 2).
# Usage: train_gpt_test.sh <path-to-train_gpt> <case>
set -uo pipefail
exe=$1
case_name=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# Runs the example, expects exit code $1 and its output to contain $2.
expect_exit() {
  local want=$1 pattern=$2
  shift 2
  "$exe" "$@" > "$work/out" 2>&1
  local rc=$?
  [ "$rc" -eq "$want" ] || { cat "$work/out"; fail "'$*' exited $rc, expected $want"; }
  grep -q -- "$pattern" "$work/out" || { cat "$work/out"; fail "'$*' output lacks '$pattern'"; }
}

# A token file's tokens (u8: the bytes after its 32-byte header).
tokens_of() { tail -c +33 "$1"; }

# Checks the last line and that train + val hold the concatenated text.
check_prepared() {
  local out=$1 text=$2 last total train val
  last=$(tail -n 1 "$work/out")
  [[ "$last" =~ ^prepared\ files=([0-9]+)\ train_tokens=([0-9]+)\ val_tokens=([0-9]+)\ entropy_bits=([0-9.]+)\ entropy_nats=([0-9.]+)$ ]] \
    || fail "last line is not machine-readable: $last"
  train=${BASH_REMATCH[2]}
  val=${BASH_REMATCH[3]}
  total=$(stat -c %s "$text")
  [ $((train + val)) -eq "$total" ] || fail "train $train + val $val != $total bytes of text"
  [ "$train" -eq $((total * 9 / 10)) ] || fail "train $train is not 90% of $total"
  cmp <(tokens_of "$out/train.tokens"; tokens_of "$out/val.tokens") "$text" \
    || fail "train.tokens + val.tokens differ from the text"
  [ "$(head -c 8 "$out/train.tokens")" = "LSTOKENS" ] || fail "train.tokens lacks the magic"
  awk -v b="${BASH_REMATCH[4]}" -v n="${BASH_REMATCH[5]}" \
    'BEGIN { exit !(b > 0 && b < 8 && (n / b - log(2)) ^ 2 < 1e-8) }' \
    || fail "entropy ${BASH_REMATCH[4]} bits / ${BASH_REMATCH[5]} nats is not a byte entropy"
}

case "$case_name" in
  prepare)
    for i in $(seq 1 200); do echo "fortune number $i: caf$(printf '\xc3\xa9') au lait"; echo "%"; done > "$work/a.txt"
    printf 'the last line, without a newline\n' > "$work/b.txt"
    cat "$work/a.txt" "$work/b.txt" > "$work/all.txt"
    expect_exit 0 "unigram entropy of the training bytes" --prepare "$work/a.txt" "$work/b.txt" --out "$work/d"
    cat "$work/out"
    check_prepared "$work/d" "$work/all.txt"
    ;;
  fortunes)
    # The default corpus: the Debian package fortunes, which scripts/install-deps.sh installs
    # (without it this check fails, it is not skipped).
    dir=/usr/share/games/fortunes
    [ -d "$dir" ] || fail "$dir is missing: run scripts/install-deps.sh (package fortunes)"
    expect_exit 0 "the fortunes corpus" --prepare --out "$work/d"
    cat "$work/out"
    # The same files, concatenated as prepare does (a newline after a file that lacks one).
    for f in $(find "$dir" -maxdepth 1 -type f ! -name '*.dat' | LC_ALL=C sort); do
      cat "$f"
      [ "$(tail -c 1 "$f" | od -An -tx1 | tr -d ' ')" = "0a" ] || echo
    done > "$work/all.txt"
    check_prepared "$work/d" "$work/all.txt"
    ;;
  bad_input)
    printf 'some text\n' > "$work/ok.txt"
    : > "$work/empty.txt"
    printf 'caf\xe9 (Latin-1)\n' > "$work/latin1.txt"
    expect_exit 1 "cannot open $work/missing.txt: No such file" --prepare "$work/ok.txt" "$work/missing.txt" --out "$work/d"
    expect_exit 1 "$work/empty.txt is empty (0 bytes)" --prepare "$work/empty.txt" --out "$work/d"
    expect_exit 1 "$work/latin1.txt is not valid UTF-8: the first invalid sequence starts at byte offset 3 (0xE9" \
      --prepare "$work/ok.txt" "$work/latin1.txt" --out "$work/d"
    [ ! -e "$work/d" ] || fail "a failed --prepare left $work/d behind"
    expect_exit 1 "is not a directory" --prepare --fortunes-dir "$work/nowhere" --out "$work/d"
    ;;
  usage)
    expect_exit 2 "training is not built yet" --data "$work/d"
    expect_exit 2 "training is not built yet"
    expect_exit 2 "without --prepare it does nothing" --out "$work/d"
    expect_exit 2 "--block-size must be an integer from 1 to 65536, got '0'" --block-size 0
    expect_exit 0 "--prepare" --help
    ;;
  *) fail "unknown case $case_name" ;;
esac
echo "PASS: $case_name"
