#!/usr/bin/env bash
# The main job: builds kvtier (Release) and runs the benchmark on an
# embedded default segment that the bench creates and removes itself:
# metadata operations, then save/load bandwidth through the segment with
# the DMA backend KVTIER_DMA picks (auto: a GPU when there is one, else
# host memcpy), beside the platform's own copy ceiling.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh main
scripts/build-release.sh build-release
build-release/bench/kvtier-bench ops "$@"
echo
# The bench puts each segment where kvt_open would: on hugetlbfs when enough
# 2 MiB pages are free (2.1 GiB for the largest configuration below),
# else /dev/shm.  Reserve them for the run (best effort, needs root) and give
# back what was added afterwards.
pool=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
before=$(cat "$pool" 2>/dev/null || true)
restore_pool() {
  if [ -n "$before" ] && [ "$(cat "$pool" 2>/dev/null)" != "$before" ]; then
    echo "$before" >"$pool" 2>/dev/null || true
  fi
}
trap restore_pool EXIT
sh numa/reserve-hugepages.sh 1280 || true
build-release/bench/kvtier-bench bandwidth --chunk-sizes 64K,256K,1M,4M --depths 1,32 \
  --ranks 1,2 --run-bytes 128M --dev-bytes 256M --repeat 3 --reg-bytes 256M
