#!/usr/bin/env bash
# bench/gpu/run.sh - the DMA bandwidth run on a machine with an NVIDIA GPU.
#
#   bench/gpu/run.sh [OUTDIR] [--quick]
#
# Builds kvtier-bench with the CUDA backend (CMake; straight cc if CMake or
# a test dependency is missing -- the machine may have no network), runs the
# DMA test suite against the real driver when cmocka is there (among its
# checks test_save_after_compute: a save ordered after an engine stream
# still writing the blocks holds the bytes written last), measures the
# engine's own reference (cudaMemcpyAsync from cudaMallocHost memory,
# bench/gpu/pinned_copy.c, when libcudart is there), then `kvtier-bench
# bandwidth --backend cuda`: a KV cache allocated in device memory
# (cuMemAlloc in the primary context, which is what cudaMalloc does) in a
# synthetic layout over chunk sizes, and in two engine layouts (GLM-5.x MLA
# + indexer; Llama-70B at TP8), saved to and loaded from a real segment.
#
# Everything lands in OUTDIR (default: ./bench-gpu-out): bandwidth.txt (the
# table), bandwidth.json, bandwidth.png when gnuplot exists, pinned_copy.txt,
# the logs, and SUMMARY.txt, which lists every check with PASS, FAIL, MISS
# (a target not met) or NOTE.  Exit status 0 unless a check FAILed.
#
# Dry run without a GPU (checks the script, not the hardware):
#   KVTIER_CUDA_LIBRARY=<build>/tests/dma/fakes/cuda/libcuda.so.1 \
#   KVT_BW_ARGS="--run-bytes 32M --dev-bytes 64M --reg-bytes 64M" bench/gpu/run.sh OUT --quick
# KVT_GPU_BUILD_DIR=<build> uses that build instead of making one (the test
# suite's dry run, bench_gpu_nvidia_dryrun).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=common.sh
. "$here/common.sh" bench-gpu-out "$@"

# ---- 1. the machine ------------------------------------------------------------
step machine
{
	machine_common
	nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
		--format=csv 2>/dev/null || echo "nvidia-smi: not available"
	grep -E 'HugePages_(Total|Free)|Hugepagesize' /proc/meminfo
	free -g | head -2
} | tee "$out/machine.txt"

if [ -n "${KVTIER_CUDA_LIBRARY:-}" ]; then
	# a dry run of this script against tests/fakes/libcuda.so.1
	[ -f "$KVTIER_CUDA_LIBRARY" ] || die "KVTIER_CUDA_LIBRARY=$KVTIER_CUDA_LIBRARY: no such file"
	rec NOTE "KVTIER_CUDA_LIBRARY=$KVTIER_CUDA_LIBRARY: NOT the system driver (a dry run)"
elif ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1' &&
   ! ls /usr/lib*/libcuda.so.1 /usr/lib/*/libcuda.so.1 >/dev/null 2>&1; then
	die "libcuda.so.1 not found: no NVIDIA driver on this machine"
fi
cuda=
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-* /usr; do
	if [ -n "$d" ] && [ -f "$d/include/cuda.h" ] && [ -f "$d/include/cudaTypedefs.h" ]; then
		cuda=$d
		break
	fi
done
[ -n "$cuda" ] || die "CUDA headers (cuda.h, cudaTypedefs.h) not found; set CUDA_HOME"
rec NOTE "CUDA headers from $cuda"

# ---- 2. build ------------------------------------------------------------------
step build
bdir=$out/build
bench=
if [ -n "${KVT_GPU_BUILD_DIR:-}" ]; then
	# the dry run in the test suite: the build that is already there
	bdir=$(cd "$KVT_GPU_BUILD_DIR" && pwd)
	bench=$bdir/bench/kvtier-bench
	[ -x "$bench" ] || die "$bench: not built"
	rec NOTE "using the build in $bdir (KVT_GPU_BUILD_DIR)"
elif cmake -S "$root" -B "$bdir" -DCMAKE_BUILD_TYPE=Release -DKVTIER_WITH_CUDA=ON \
	-DKVTIER_CUDA_INCLUDE="$cuda/include" >"$out/build.log" 2>&1 &&
   cmake --build "$bdir" -j "$jobs" --target kvtier-bench >>"$out/build.log" 2>&1; then
	bench=$bdir/bench/kvtier-bench
	rec PASS "CMake build with the CUDA backend"
else
	rec NOTE "CMake build failed (build.log); building kvtier-bench directly"
	mkdir -p "$out/direct"
	# core + dma + the bench's ops and bandwidth commands; replay needs the
	# public library (tier, numa) and is stubbed out here
	cat >"$out/direct/stub.c" <<-'EOF'
		int kvt_bench_replay(int argc, char **argv);
		int kvt_bench_replay(int argc, char **argv) { (void)argc; (void)argv; return 2; }
	EOF
	if cc -O2 -g -std=c11 -D_GNU_SOURCE -DKVTIER_HAVE_CUDA=1 -DKVT_BENCH_HAVE_BANDWIDTH=1 \
		-I"$root/core/include" -I"$root/core" -I"$root/dma/include" -I"$root/dma/src" \
		-isystem "$cuda/include" \
		"$root"/core/*.c "$root"/dma/src/plan.c "$root"/dma/src/dma.c \
		"$root"/dma/src/host.c "$root"/dma/src/cuda.c \
		"$root"/bench/main.c "$root"/bench/ops.c "$root"/bench/bandwidth.c "$out/direct/stub.c" \
		-ldl -lpthread -lrt -o "$out/direct/kvtier-bench" >>"$out/build.log" 2>&1; then
		bench=$out/direct/kvtier-bench
		rec PASS "direct build with the CUDA backend"
	else
		tail -30 "$out/build.log"
		die "kvtier-bench does not build (build.log)"
	fi
fi

# ---- 3. the DMA suite against the real driver ------------------------------------
step "DMA test suite, KVTIER_DMA=cuda, real driver"
if [ -f "$bdir/CMakeCache.txt" ] &&
   cmake --build "$bdir" -j "$jobs" --target test_dma_backend test_dma_plan >>"$out/build.log" 2>&1; then
	if KVTIER_DMA=cuda timeout 600 "$bdir/tests/dma/test_dma_backend" \
		>"$out/test_dma_backend_cuda.log" 2>&1; then
		rec PASS "test_dma_backend against libcuda: $(grep -c '\[       OK \]' "$out/test_dma_backend_cuda.log") ok, $(grep -c '\[  SKIPPED \]' "$out/test_dma_backend_cuda.log") skip lines"
	else
		tail -40 "$out/test_dma_backend_cuda.log"
		fail "test_dma_backend against libcuda (test_dma_backend_cuda.log)"
	fi
	timeout 300 "$bdir/tests/dma/test_dma_plan" >"$out/test_dma_plan.log" 2>&1 &&
		rec PASS "test_dma_plan" || fail "test_dma_plan (test_dma_plan.log)"
else
	rec NOTE "DMA test suite not built (cmocka missing?): only the bench's own verification ran"
fi

# ---- 4. the engine's reference: cudaMemcpyAsync from pinned memory ----------------
step "cudaMemcpyAsync from cudaMallocHost memory"
libdirs=()
for l in "$cuda/lib64" "$cuda/lib" "$cuda/targets/x86_64-linux/lib" "$cuda/targets/sbsa-linux/lib"; do
	[ -d "$l" ] && libdirs+=("-L$l" "-Wl,-rpath,$l")
done
if cc -O2 -std=c11 -isystem "$cuda/include" "$here/pinned_copy.c" "${libdirs[@]}" -lcudart \
	-o "$out/pinned_copy" >>"$out/build.log" 2>&1; then
	if timeout 300 "$out/pinned_copy" 0 64K 256K 1M 4M 16M >"$out/pinned_copy.txt" 2>&1; then
		cat "$out/pinned_copy.txt"
		rec PASS "pinned_copy reference measured"
	else
		cat "$out/pinned_copy.txt"
		rec NOTE "pinned_copy failed (libcudart newer than the driver?); the bench's own driver-API ceiling stands alone"
	fi
else
	rec NOTE "pinned_copy not built (no libcudart); the bench's own driver-API ceiling stands alone"
fi

# ---- 5. bandwidth --------------------------------------------------------------------
step "kvtier-bench bandwidth"
bw_base=(--backend cuda --device 0)
bw bandwidth "${sweep[@]}" --plot "$out/bandwidth.png"
bw_sweeps

# ---- 6. checks -------------------------------------------------------------------------
step checks
if grep -q '^kvtier-bench bandwidth: cuda' "$out/bandwidth.txt" 2>/dev/null; then
	rec PASS "the cuda backend ran ($(head -1 "$out/bandwidth.txt" | cut -c1-160))"
else
	fail "bandwidth.txt does not show the cuda backend"
fi
# Target: >= 0.95 x the driver's pinned copy for pages >= 64 KiB (depth > 1).
for f in bandwidth bandwidth-adjacent bandwidth-glm5 bandwidth-llama70b-tp8; do
	check_ratios "$f" "$out/$f.txt" MISS
done
if [ -f "$out/pinned_copy.txt" ] && grep -q 'GB/s' "$out/pinned_copy.txt"; then
	rec NOTE "compare the bench's ceiling columns with pinned_copy.txt (cudaMemcpyAsync)"
fi
step summary
cat "$summary"
exit $status
