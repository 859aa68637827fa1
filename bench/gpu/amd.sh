#!/usr/bin/env bash
# bench/gpu/amd.sh - the DMA bandwidth run on a machine with an AMD GPU
# (MI300X, MI325X, MI355X, ...), beside bench/gpu/check.sh for NVIDIA.
#
#   bench/gpu/amd.sh [OUTDIR] [--quick]
#
# Builds kvtier-bench with the hsa backend and the HIP runtime (CMake;
# headers from Debian's libhsa-runtime-dev / libamdhip64-dev or from
# /opt/rocm/include), runs the DMA test suite against the real ROCm runtime
# (test_dma_backend with KVTIER_DMA=hsa, by DMA and again with every plan
# through the copy kernel, test_dma_plan, test_dma_hip: a
# hipMalloc'ed KV cache through the hsa backend, byte exact; a save after a
# HIP fill on the engine's stream, with and without the order on the device),
# `kvtier-bench pin` (N processes locking one arena against the amdgpu
# pinning budget kvtier-size assumes; not with --quick), then
# `kvtier-bench bandwidth --backend hsa --device-memory hip`: the KV cache
# in hipMalloc'ed device memory, as a ROCm engine's torch tensors are,
# saved to and loaded from a real segment, over chunk sizes and in two
# engine layouts (GLM-5.x MLA + indexer; Llama-70B at TP8), each figure next
# to HIP's own pinned copy measured right after it (hipMemcpyAsync from
# hipHostMalloc'ed memory, chunk-sized copies over the same device memory:
# what an AMD engine's own offload does) -- the `ceil` column -- and the hsa
# backend's own copy from runtime-pinned memory (`peak`).  A second sweep
# takes the ceiling from hipHostRegister'ed memory instead.
#
# The target: save and load >= 0.95 x the HIP ceiling for pages >= 64 KiB
# at depth > 1.  A row below it FAILs the run (exit 1).
#
# Everything lands in OUTDIR (default ./bench-amd-out): the tables, the
# JSON, the logs, machine.txt, and SUMMARY.txt (PASS, FAIL, NOTE per check).
#
# Dry run without a GPU, against tests/fakes (checks the script, not the
# hardware; ratios are then recorded as MISS, not judged):
#   KVTIER_HSA_LIBRARY=<build>/tests/dma/fakes/hsa56/libhsa-runtime64.so.1 \
#   KVTIER_HIP_LIBRARY=<build>/tests/dma/fakes/hip/libamdhip64.so.5 \
#   KVT_BW_ARGS="--run-bytes 16M --dev-bytes 32M --reg-bytes 0" bench/gpu/amd.sh OUT --quick
# KVT_GPU_BUILD_DIR=<build> uses that build instead of making one.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=common.sh
. "$here/common.sh" bench-amd-out "$@"

# ---- 1. the machine ------------------------------------------------------------
step machine
{
	machine_common
	if command -v amd-smi >/dev/null; then
		amd-smi static --asic --board 2>/dev/null | head -40
	elif command -v rocm-smi >/dev/null; then
		rocm-smi --showproductname --showmeminfo vram 2>/dev/null | head -40
	else
		echo "amd-smi / rocm-smi: not available"
	fi
	ls -l /dev/kfd 2>/dev/null || echo "/dev/kfd: absent"
	grep -E 'HugePages_(Total|Free)|Hugepagesize' /proc/meminfo
	free -g | head -2
} | tee "$out/machine.txt"

dry=
if [ -n "${KVTIER_HSA_LIBRARY:-}" ] || [ -n "${KVTIER_HIP_LIBRARY:-}" ]; then
	dry=1
	for v in KVTIER_HSA_LIBRARY KVTIER_HIP_LIBRARY; do
		[ -n "${!v:-}" ] && [ ! -f "${!v}" ] && die "$v=${!v}: no such file"
	done
	rec NOTE "KVTIER_HSA_LIBRARY / KVTIER_HIP_LIBRARY set: NOT the system runtime (a dry run; ratios are not judged)"
else
	[ -e /dev/kfd ] || die "/dev/kfd not found: no AMD GPU (or the amdgpu driver is not loaded)"
	ldconfig -p 2>/dev/null | grep -q 'libhsa-runtime64\.so\.1' ||
		ls /opt/rocm/lib/libhsa-runtime64.so.1 >/dev/null 2>&1 ||
		die "libhsa-runtime64.so.1 not found: install ROCm"
fi
if [ -d /opt/rocm/include ] && [ ! -f /usr/include/hip/hip_runtime_api.h ]; then
	export CPATH=/opt/rocm/include${CPATH:+:$CPATH}
	export LD_LIBRARY_PATH=/opt/rocm/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
	rec NOTE "headers and libraries from /opt/rocm"
fi

# ---- 2. build ------------------------------------------------------------------
step build
if [ -n "${KVT_GPU_BUILD_DIR:-}" ]; then
	bdir=$(cd "$KVT_GPU_BUILD_DIR" && pwd)
	rec NOTE "using the build in $bdir (KVT_GPU_BUILD_DIR)"
else
	bdir=$out/build
	if cmake -S "$root" -B "$bdir" -DCMAKE_BUILD_TYPE=Release -DKVTIER_WITH_HSA=ON \
		-DKVTIER_WITH_HIP=ON >"$out/build.log" 2>&1 &&
	   cmake --build "$bdir" -j "$jobs" --target kvtier-bench >>"$out/build.log" 2>&1; then
		rec PASS "CMake build with the hsa backend and HIP"
	else
		tail -30 "$out/build.log"
		die "kvtier-bench does not build with hsa + HIP (build.log)"
	fi
fi
bench=$bdir/bench/kvtier-bench
[ -x "$bench" ] || die "$bench: not built"

# ---- 3. the DMA suite against the runtime --------------------------------------------
step "DMA test suite, KVTIER_DMA=hsa"
if cmake --build "$bdir" -j "$jobs" --target test_dma_backend test_dma_plan test_dma_hip \
	>>"$out/build.log" 2>&1; then
	for t in test_dma_backend test_dma_hip test_dma_plan; do
		if KVTIER_DMA=hsa timeout 600 "$bdir/tests/dma/$t" >"$out/$t.log" 2>&1; then
			rec PASS "$t: $(grep -c '\[       OK \]' "$out/$t.log") ok, $(grep -c '\[  SKIPPED \]' "$out/$t.log") skip lines"
		else
			tail -40 "$out/$t.log"
			fail "$t ($t.log)"
		fi
	done
	# again with every plan through the copy kernel (dma/src/copy_kernel.c,
	# compiled for this GPU by the node's hiprtc at the first bind): its
	# copies byte exact on the device, ordered after the engine's stream
	t=test_dma_backend
	if KVTIER_DMA=hsa KVTIER_TEST_KERNEL=all timeout 600 "$bdir/tests/dma/$t" \
		>"$out/$t-kernel.log" 2>&1; then
		rec PASS "$t with every plan through the copy kernel: $(grep -c '\[       OK \]' "$out/$t-kernel.log") ok"
	else
		tail -40 "$out/$t-kernel.log"
		fail "$t with the copy kernel ($t-kernel.log)"
	fi
else
	rec NOTE "DMA test suite not built (cmocka or the HIP headers missing?): only the bench's own verification ran"
fi

# ---- 4. AMD's pinning budget ------------------------------------------------------------
# Every lock of the arena is charged to the amdgpu driver's one node-wide
# budget, one charge per process however many lock the same pages: N
# processes lock one shared arena of 0.55 x the budget kvtier-size assumes
# (RAM - RAM/64 - 1 GiB), and the count that fits is checked against it.
step "pinning budget: kvtier-bench pin against kvtier-size --gpu amd"
pin_args=(--backend hsa --device 0)
if [ -n "$dry" ]; then
	# the fake runtime's budget, one ledger shared by the processes
	export FAKE_HSA_LOCK_BUDGET=$((64 << 20)) FAKE_HSA_LOCK_LEDGER=$out/pin-ledger
	rm -f "$FAKE_HSA_LOCK_LEDGER"
	pin_args+=(--budget 64M --procs 3)
elif [ "$quick" = --quick ]; then
	pin_args=()
fi
if [ ${#pin_args[@]} -eq 0 ]; then
	rec NOTE "pinning budget: not run with --quick (it locks about half the RAM, twice)"
else
	timeout 1800 "$bench" pin "${pin_args[@]}" >"$out/pin.txt" 2>&1
	pin_rc=$?
	cat "$out/pin.txt"
	verdict=$(grep '^pin: budget' "$out/pin.txt")
	if [ $pin_rc -eq 3 ]; then
		fail "pinning budget: a refusal did not name the budget (pin.txt)"
	elif [ $pin_rc -ne 0 ] || [ -z "$verdict" ]; then
		fail "kvtier-bench pin failed (pin.txt)"
	elif [[ $verdict == *MATCH ]]; then
		rec PASS "$verdict"
	else
		rec NOTE "$verdict"
	fi
	unset FAKE_HSA_LOCK_BUDGET FAKE_HSA_LOCK_LEDGER
fi

# ---- 5. bandwidth --------------------------------------------------------------------
step "kvtier-bench bandwidth, hipMalloc'ed KV, HIP ceiling"
bw_base=(--backend hsa --device 0 --device-memory hip)
bw bandwidth "${sweep[@]}"
bw bandwidth-hipregister "${sweep[@]}" --hip-pinned register --reg-bytes 0
bw_sweeps
# the same 4 KiB pages by DMA only: the copy kernel's gain at the engine's
# smallest pages (bandwidth-llama70b-tp8 has it when the node's hiprtc
# compiled it: the backend's line says "copy kernel pages below ...")
bw bandwidth-llama70b-tp8-dma --layout llama70b-tp8 --depths 1,4,32 --ranks "$ranks" \
	--reg-bytes 0 --copy-kernel off

# ---- 6. checks -------------------------------------------------------------------------
step checks
if grep -q '^kvtier-bench bandwidth: hsa' "$out/bandwidth.txt" 2>/dev/null &&
   grep -q 'device memory: hipMalloc' "$out/bandwidth.txt"; then
	rec PASS "the hsa backend ran on hipMalloc'ed memory ($(head -1 "$out/bandwidth.txt" | cut -c1-200))"
else
	fail "bandwidth.txt does not show the hsa backend on hipMalloc'ed memory"
fi
grep -q 'differs from its host address' "$out/bandwidth-hipregister.txt" 2>/dev/null &&
	rec NOTE "hipHostGetDevicePointer gave another address than the host's for a registered buffer (expected on some ROCm systems; the copies use the host address)"
# ordering: a HIP fill on the engine's stream, then a save with and without
# the order after that stream on the device (test_dma_hip)
race=$(grep -h '^save after a HIP fill' "$out/test_dma_hip.log" 2>/dev/null)
[ -n "$race" ] && rec NOTE "$race"
kline=$(grep -o 'copy kernel [^|]*' "$out/bandwidth-llama70b-tp8.txt" 2>/dev/null | head -1)
rec NOTE "${kline:-copy kernel: not named in bandwidth-llama70b-tp8.txt}"
for f in bandwidth bandwidth-hipregister bandwidth-adjacent bandwidth-glm5 bandwidth-llama70b-tp8; do
	check_ratios "$f" "$out/$f.txt" "$([ -n "$dry" ] && echo MISS || echo FAIL)"
done
step summary
cat "$summary"
exit $status
