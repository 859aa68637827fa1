#!/usr/bin/env bash
# The main job: builds kvtier and runs the benchmark on an embedded default
# segment (created, measured and removed by the bench itself).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs" >/dev/null
exec build/bench/kvtier-bench ops "$@"
