#!/usr/bin/env bash
# tests/dma/gpu_check_dryrun.sh BUILD_DIR FAKE_LIBCUDA NVRTC
#   bench/gpu/check.sh, the file the GPU machine runs, run whole against
#   the fake libcuda (CTest: bench_gpu_check_dryrun), and what it left
#   checked: exit 0, no FAIL, every kind of check there, three files out.
#   The Debian packages it carries are fetched once into BUILD_DIR/gpu-deps
#   (bench/gpu/deps.sh); NVRTC (scripts/nvrtc.sh) compiles the copy kernel,
#   which the fake runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
b=$1
fake=$2
nvrtc=$3
[ -f "$nvrtc" ] || { echo "gpu_check_dryrun: $nvrtc: no NVRTC (scripts/nvrtc.sh build/nvrtc)"; exit 1; }
[ -f "$b/gpu-deps/ARCH" ] || "$root/bench/gpu/deps.sh" "$b/gpu-deps"
out=$b/gpu-check-dryrun
rm -rf "$out"
KVTIER_CUDA_LIBRARY=$fake KVTIER_NVRTC_LIBRARY=$nvrtc KVT_CHECK_QUICK=1 KVT_GPU_DEPS=$b/gpu-deps \
	PYTHON=${PYTHON:-/usr/bin/python3} "$root/bench/gpu/check.sh" "$out" >"$b/gpu-check-dryrun.log" 2>&1 || {
	tail -40 "$b/gpu-check-dryrun.log"
	echo "gpu_check_dryrun: check.sh failed"
	exit 1
}
s=$out/SUMMARY.txt
bad=0
if grep '^FAIL' "$s"; then bad=1; fi
for want in "KVTIER_MINIMAL build" "test_dma_backend on the fake" "test_dma_plan" \
	"test_dma_backend with every plan through the copy kernel" \
	"without the order the save-after-compute test fails" "span probe" \
	"per-layer: .* ordered after it.*byte-exact" "per-layer: .* WITHOUT the order.*old bytes" \
	"block-outer: .* ordered after it.*byte-exact" "block-outer: .* WITHOUT the order.*old bytes" \
	"bandwidth at 7 engine shapes" "bandwidth bw-llama70b-tp8 " "bandwidth bw-llama70b-tp8-dma" \
	"bandwidth bw-glm5" \
	"bandwidth bw-sweep"; do
	grep -q -- "$want" "$s" || { echo "gpu_check_dryrun: no line '$want' in SUMMARY.txt"; bad=1; }
done
n=$(find "$out" -type f | wc -l)
[ "$n" = 3 ] || { echo "gpu_check_dryrun: $n files in OUT (the device brings back 8 at most; check.sh leaves 3)"; bad=1; }
# (listed once: grep -q ending a pipe early fails tar's side under pipefail)
listing=$(tar -tzf "$out/gpu-check.tar.gz")
for f in run.log build.log dma_suite.log dma_no_order.log span_probe.txt engine_check.log \
	engine_check.json bw-sweep.txt; do
	grep -qx "\./$f" <<<"$listing" ||
		{ echo "gpu_check_dryrun: $f not in gpu-check.tar.gz"; bad=1; }
done
[ "$bad" = 0 ] && echo "gpu_check_dryrun: check.sh ran whole against the fake: $(grep -c '^PASS' "$s") PASS"
exit "$bad"
