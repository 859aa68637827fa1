#!/usr/bin/env bash
# The whole test suite: installs what is missing, then builds and runs the
# CTest suite three times -- a normal build, ASan+UBSan, and TSan -- and the
# Python binding's tests (Debian's python3 and pytest) against the normal
# build.  Usage: scripts/test.sh [quick]   ("quick": the normal build only)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# A few 2 MiB huge pages, so that the huge-page tests run instead of
# skipping; best effort, never fails (needs root).
sh numa/reserve-hugepages.sh 32 || true

jobs=$(nproc 2>/dev/null || echo 2)
run_suite() {   # $1 build dir, rest: cmake args
  local dir=$1; shift
  echo "== kvtier test: $dir $*"
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
  cmake --build "$dir" -j "$jobs" >/dev/null
  (cd "$dir" && ctest --output-on-failure -j "$jobs" --timeout 900)
}

run_suite build
if [ -d bindings/python/tests ]; then
  echo "== kvtier test: python"
  KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider bindings/python/tests
fi
if [ -x build/tier/daemon/kvtierd ]; then
  echo "== kvtier test: kvtierd (real daemon, rank processes, curl, Prometheus, tmux)"
  KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" KVTIER_BUILD="$PWD/build" \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/daemon
else
  echo "kvtier test: kvtierd was not built (libmicrohttpd-dev missing?)" >&2
  exit 1
fi
if [ "${1:-}" != quick ]; then
  run_suite build-asan -DKVTIER_SANITIZE=address,undefined
  run_suite build-tsan -DKVTIER_SANITIZE=thread
  # libFuzzer (clang), a bounded time per target; the corpora already ran
  # as regression tests in each build above
  echo "== kvtier test: fuzz"
  tests/fuzz/run.sh "${KVTIER_FUZZ_SECONDS:-20}"
fi
