#!/usr/bin/env bash
# The main job: builds kvtier (Release) and runs the benchmark on an
# embedded default segment that the bench creates and removes itself:
# metadata operations, then save/load bandwidth through the segment with
# the DMA backend KVTIER_DMA picks (auto: a GPU when there is one, else
# host memcpy), beside the platform's own copy ceiling.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build-release -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-release -j "$jobs" >/dev/null
build-release/bench/kvtier-bench ops "$@"
echo
build-release/bench/kvtier-bench bandwidth --chunk-sizes 64K,256K,1M,4M --depths 1,32 \
  --ranks 1,2 --run-bytes 128M --dev-bytes 256M --repeat 3 --reg-bytes 256M
