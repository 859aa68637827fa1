#!/usr/bin/env bash
# Fuzzes every target for SECONDS each (default 30) with libFuzzer (Debian
# clang): builds build-fuzz with clang, ASan+UBSan and coverage, then runs
# each target on a scratch copy of its committed corpus.  A crash (or a
# leak, a timeout) leaves its input in build-fuzz/crashes/<target>/ and the
# script fails: add the input to tests/fuzz/corpus/<target>/, where every
# build then runs it as a regression test.  Usage: tests/fuzz/run.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-30}
dir=build-fuzz
command -v clang >/dev/null || { echo "fuzz: clang is not installed (scripts/deps.sh)" >&2; exit 1; }
CC=clang cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVTIER_FUZZ=ON \
  -DKVTIER_SANITIZE=address,undefined,fuzzer-no-link >/dev/null
targets=(segment env hfconfig trace config http lmc)
cmake --build "$dir" -j "$(nproc)" --target "${targets[@]/#/fuzz_}" >/dev/null
status=0
for t in "${targets[@]}"; do
  work=$dir/fuzz-work/$t
  rm -rf "$work"; mkdir -p "$work" "$dir/crashes/$t"
  cp tests/fuzz/corpus/"$t"/* "$work"/
  maxlen=4096
  [ "$t" = segment ] && maxlen=65536
  [ "$t" = http ] && maxlen=16384    # past the 8 KiB header limit
  echo "== fuzz $t: ${secs}s"
  if ! "$dir/tests/fuzz/fuzz_$t" -max_total_time="$secs" -max_len="$maxlen" -timeout=10 \
       -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$dir/crashes/$t/" \
       "$work" > "$dir/fuzz-$t.log" 2>&1; then
    echo "fuzz $t: FAILED, input in $dir/crashes/$t/ (log: $dir/fuzz-$t.log)" >&2
    tail -30 "$dir/fuzz-$t.log" >&2
    status=1
  fi
  { grep -E "stat::number_of_executed_units|stat::new_units_added" "$dir/fuzz-$t.log" || true; } |
    tr -s ' \n' ' '
  echo
done
exit $status
