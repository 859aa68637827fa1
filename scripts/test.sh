#!/usr/bin/env bash
# The whole test suite: installs what is missing, then builds and runs the
# CTest suite three times: a normal build, ASan+UBSan, and TSan.
# Usage: scripts/test.sh [quick]   ("quick": the normal build only)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh

jobs=$(nproc 2>/dev/null || echo 2)
run_suite() {   # $1 build dir, rest: cmake args
  local dir=$1; shift
  echo "== kvtier test: $dir $*"
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
  cmake --build "$dir" -j "$jobs" >/dev/null
  (cd "$dir" && ctest --output-on-failure -j "$jobs" --timeout 600)
}

run_suite build
if [ "${1:-}" != quick ]; then
  run_suite build-asan -DKVTIER_SANITIZE=address,undefined
  run_suite build-tsan -DKVTIER_SANITIZE=thread
fi
