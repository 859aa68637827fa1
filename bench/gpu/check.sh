#!/usr/bin/env bash
# bench/gpu/check.sh - the GPU check: one call on a machine with an NVIDIA
# GPU (an image with CUDA's nvcc and headers, CMake, Python and a CUDA torch,
# none of Debian's -dev packages, no network), all of it bytes-exact.
#
#   bench/gpu/deps.sh                 (here, once: the Debian packages it needs)
#   bench/gpu/check.sh [OUTDIR]       (there; OUTDIR default: $OUT, else ./gpu-check-out)
#
# The device call, from the repository root, carrying the unpacked packages:
#   run(command="bench/gpu/check.sh", carry=["build-gpu-deps"], timeout_s=600)
#
# In order of value:
#   1. the DMA suite (tests/dma/dma_backend.c) on the real driver, then its
#      ordering tests again with KVTIER_TEST_NO_ORDER=1, which must FAIL
#      (the engine's stream held on a host flag: an unordered save reads
#      the old bytes every time);
#   2. bench/gpu/span_probe.c: does the driver take a copy whose rows lie in
#      two back-to-back cuMemAlloc allocations;
#   3. bench/gpu/engine_check.py: a torch mini-engine (per-layer and
#      block-outermost caches written by torch kernels on the engine's held
#      stream, saved ordered after it, loaded and compared; unordered must
#      fail), then
#   4. bandwidth at the engine's shapes against the driver's pinned copy of
#      the same pages and its 4 MiB peak, saves and loads alone and at once;
#      and kvtier-bench bandwidth's engine layouts and chunk sweep;
#   5. registration time of a /dev/shm arena and, when huge pages can be
#      had, a hugetlbfs one.
#
# Limits it keeps: one overall deadline (KVT_CHECK_DEADLINE, default 480 s;
# every step gets what is left, so one hang cannot lose the call), the
# build and logs in a scratch folder, and three files in OUTDIR:
# SUMMARY.txt (every check: PASS, FAIL, MISS, NOTE), machine.txt, and
# gpu-check.tar.gz (every log and table).  Exit 1 when a check FAILed.
#
# The test suite runs this same file as a dry run (bench_gpu_check_dryrun):
# KVTIER_CUDA_LIBRARY naming tests/fakes' libcuda, KVT_CHECK_QUICK=1.
# Other settings: KVT_GPU_DEPS (the unpacked packages; default
# build-gpu-deps), PYTHON (default python3), CUDA_HOME.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-${OUT:-$PWD/gpu-check-out}}
deadline=${KVT_CHECK_DEADLINE:-480}

# ---- the outer run: the deadline, then the packing, whatever happened -------------
if [ -z "${KVT_CHECK_WORK:-}" ]; then
	mkdir -p "$out" || exit 1
	out=$(cd "$out" && pwd)
	work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gpu-check.XXXXXX") || exit 1
	KVT_CHECK_WORK=$work KVT_CHECK_START=$(date +%s) \
		timeout -k 10 "$deadline" "$0" "$out"
	rc=$?
	if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
		echo "FAIL: the check's deadline (${deadline}s) ended it in: $(tail -1 "$work/.step" 2>/dev/null)" |
			tee -a "$work/SUMMARY.txt"
		rc=1
	elif [ "$rc" != 0 ] && ! grep -q '^FAIL' "$work/SUMMARY.txt" 2>/dev/null; then
		echo "FAIL: check.sh stopped (exit $rc) in: $(tail -1 "$work/.step" 2>/dev/null)" |
			tee -a "$work/SUMMARY.txt"
	fi
	touch "$work/SUMMARY.txt" "$work/machine.txt"
	tar -C "$work" --exclude=./build --exclude=./seg -czf "$out/gpu-check.tar.gz" . ||
		echo "check.sh: packing the logs failed" >&2
	cp "$work/SUMMARY.txt" "$work/machine.txt" "$out/"
	rm -rf "$work"
	echo
	echo "== SUMMARY ($out)"
	cat "$out/SUMMARY.txt"
	exit "$rc"
fi

# ---- the inner run ---------------------------------------------------------------
work=$KVT_CHECK_WORK
start=$KVT_CHECK_START
summary=$work/SUMMARY.txt
: >"$summary"
exec > >(tee "$work/run.log") 2>&1
status=0
jobs=$(nproc 2>/dev/null || echo 4)
quick=${KVT_CHECK_QUICK:-}
python=${PYTHON:-python3}

step() { echo; echo "== $*"; echo "$*" >>"$work/.step"; }
rec() { echo "$1: $2"; echo "$1: $2" >>"$summary"; }
fail() { rec FAIL "$1"; status=1; }
die() { rec FAIL "$1"; exit 1; }
# left [RESERVE]: seconds of the deadline left for a step (at least 5)
left() {
	local l=$((deadline - ($(date +%s) - start) - ${1:-15}))
	[ "$l" -lt 5 ] && l=5
	echo "$l"
}
# lim SECONDS CMD...: CMD under the smaller of SECONDS and what is left
lim() {
	local s=$1 l
	shift
	l=$(left)
	[ "$s" -gt "$l" ] && s=$l
	timeout -k 5 "$s" "$@"
}

# ---- 1. the machine ----------------------------------------------------------------
step machine
dry=
if [ -n "${KVTIER_CUDA_LIBRARY:-}" ]; then
	dry=1
	[ -f "$KVTIER_CUDA_LIBRARY" ] || die "KVTIER_CUDA_LIBRARY=$KVTIER_CUDA_LIBRARY: no such file"
	rec NOTE "a dry run: KVTIER_CUDA_LIBRARY=$KVTIER_CUDA_LIBRARY, NOT the system driver"
fi
# The driver: the loader's path, the usual folders, and the read-only mount
# container runtimes use (/usr/local/nvidia).  kvtier dlopens libcuda.so.1,
# so a folder the loader does not know goes on LD_LIBRARY_PATH.
libcuda=
for d in $(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF}' | xargs -r -n1 dirname) \
	$(echo "${LD_LIBRARY_PATH:-}" | tr ':' ' ') /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib \
	/usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/wsl/lib; do
	if [ -e "$d/libcuda.so.1" ]; then
		libcuda=$d/libcuda.so.1
		break
	fi
done
if [ -z "$dry" ]; then
	[ -n "$libcuda" ] || die "libcuda.so.1 not found (ldconfig, LD_LIBRARY_PATH, /usr/lib*, /usr/local/nvidia): no NVIDIA driver here"
	export LD_LIBRARY_PATH=$(dirname "$libcuda")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
cuda=
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-*; do
	if [ -n "$d" ] && [ -f "$d/include/cuda.h" ] && [ -f "$d/include/cudaTypedefs.h" ]; then
		cuda=$d
		break
	fi
done
{
	echo "date: $(date -u +%FT%TZ)"
	echo "host: $(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
	echo "kvtier: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'unknown (no git here)')"
	echo "driver library: ${libcuda:-none}"
	cat /proc/driver/nvidia/version 2>/dev/null | head -1
	nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max,clocks.max.sm \
		--format=csv 2>/dev/null || echo "nvidia-smi: not available"
	nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' || true
	echo "CUDA headers: ${cuda:-none}"
	"${cuda:-/nonexistent}/bin/nvcc" --version 2>/dev/null | tail -2 | head -1 || true
	cmake --version 2>/dev/null | head -1 || echo "cmake: none"
	cc --version 2>/dev/null | head -1 || echo "cc: none"
	"$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1 | tail -1
	echo "memlock limit: $(ulimit -l)"
	df -h /dev/shm /tmp 2>/dev/null
	grep -E 'HugePages_(Total|Free)|Hugepagesize' /proc/meminfo
	grep hugetlbfs /proc/mounts || echo "no hugetlbfs mount"
} 2>&1 | tee "$work/machine.txt"
[ -n "$cuda" ] || die "CUDA headers (cuda.h, cudaTypedefs.h) not found; set CUDA_HOME"
# NVRTC for the copy kernel (dma/src/copy_kernel.c): the toolkit's, else the
# one torch's wheel carries (nvidia-cuda-nvrtc); every step below gets it
if [ -z "${KVTIER_NVRTC_LIBRARY:-}" ]; then
	for f in "$cuda"/lib64/libnvrtc.so.[0-9]* "$cuda"/targets/*/lib/libnvrtc.so.[0-9]* \
		$("$python" -c 'import glob, os, site
ps = site.getsitepackages() + [site.getusersitepackages()]
print(" ".join(f for p in ps for f in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib", "libnvrtc.so.[0-9]*")) + glob.glob(os.path.join(p, "torch", "lib", "libnvrtc*.so*")))))' 2>/dev/null); do
		case $f in *alt*|*builtins*) continue ;; esac
		if [ -f "$f" ]; then
			export KVTIER_NVRTC_LIBRARY=$f
			break
		fi
	done
fi
if [ -n "${KVTIER_NVRTC_LIBRARY:-}" ]; then
	echo "NVRTC: $KVTIER_NVRTC_LIBRARY" | tee -a "$work/machine.txt"
else
	rec NOTE "no NVRTC (toolkit or torch's wheel): copies are DMA only, the copy kernel is not checked"
fi

# ---- 2. build: KVTIER_MINIMAL, against the carried packages -------------------------
step build
deps=${KVT_GPU_DEPS:-$root/build-gpu-deps}
[ -f "$deps/ARCH" ] || die "$deps: no unpacked packages; run bench/gpu/deps.sh on the Debian machine and carry build-gpu-deps"
arch=$(cat "$deps/ARCH")
inc=$deps/root/usr/include
lib=$deps/root/usr/lib/$arch
b=$work/build
if lim 300 cmake -S "$root" -B "$b" -DCMAKE_BUILD_TYPE=Release -DKVTIER_MINIMAL=ON \
	-DKVTIER_WITH_CUDA=ON -DKVTIER_WITH_HSA=OFF -DKVTIER_WITH_HIP=OFF \
	-DKVTIER_WITH_NUMA=OFF -DKVTIER_WITH_URING=OFF -DKVTIER_CUDA_INCLUDE="$cuda/include" \
	-DXXHASH_INCLUDE="$inc" -DXXHASH_LIB="$lib/libxxhash.so" \
	-DCMOCKA_INCLUDE="$inc" -DCMOCKA_LIB="$lib/libcmocka.so" >"$work/build.log" 2>&1 &&
   lim 300 cmake --build "$b" -j "$jobs" >>"$work/build.log" 2>&1; then
	rec PASS "KVTIER_MINIMAL build with the CUDA backend ($(cat "$deps/PACKAGES" | awk '{printf "%s %s; ", $2, $4}'))"
else
	tail -30 "$work/build.log"
	die "the build failed (build.log)"
fi
bench=$b/bench/kvtier-bench

# ---- 3. the DMA suite on the driver, and without the order ---------------------------
step "DMA suite, KVTIER_DMA=cuda"
t=$b/tests/dma/test_dma_backend
if KVTIER_DMA=cuda lim 240 "$t" >"$work/dma_suite.log" 2>&1; then
	rec PASS "test_dma_backend on ${dry:+the fake, not }the driver: $(grep -c '\[       OK \]' "$work/dma_suite.log") ok, $(grep -c '\[  SKIPPED \]' "$work/dma_suite.log") skipped"
else
	tail -40 "$work/dma_suite.log"
	fail "test_dma_backend (dma_suite.log)"
fi
if [ -n "${KVTIER_NVRTC_LIBRARY:-}" ]; then
	# the copy kernel on the device: every plan of the suite through it
	if KVTIER_DMA=cuda KVTIER_TEST_KERNEL=all lim 240 "$t" >"$work/dma_kernel.log" 2>&1; then
		rec PASS "test_dma_backend with every plan through the copy kernel: $(grep -c '\[       OK \]' "$work/dma_kernel.log") ok, $(grep -c '\[  SKIPPED \]' "$work/dma_kernel.log") skipped"
	else
		tail -40 "$work/dma_kernel.log"
		fail "test_dma_backend through the copy kernel (dma_kernel.log)"
	fi
fi
lim 120 "$b/tests/dma/test_dma_plan" >"$work/dma_plan.log" 2>&1 &&
	rec PASS "test_dma_plan" || fail "test_dma_plan (dma_plan.log)"
KVTIER_DMA=cuda KVTIER_TEST_NO_ORDER=1 KVTIER_TEST_ONLY='*_after_compute' \
	lim 120 "$t" >"$work/dma_no_order.log" 2>&1
if grep -q '\[  FAILED  \] test_save_after_compute' "$work/dma_no_order.log"; then
	rec PASS "without the order the save-after-compute test fails, as it must (dma_no_order.log)"
else
	tail -20 "$work/dma_no_order.log"
	fail "KVTIER_TEST_NO_ORDER=1: test_save_after_compute did not fail -- the ordering test proves nothing on this device (dma_no_order.log)"
fi

# ---- 4. a copy across back-to-back allocations ------------------------------------------
step "copies across two back-to-back allocations"
lim 60 "$b/bench/kvt-span-probe" >"$work/span_probe.txt" 2>&1
rc=$?
cat "$work/span_probe.txt"
case $rc in
0) rec NOTE "span probe: $(grep -E '^(2d|1d):' "$work/span_probe.txt" | tr '\n' ';')" ;;
2) rec NOTE "span probe: no back-to-back allocations to ask with" ;;
*) fail "span probe (span_probe.txt)" ;;
esac

# ---- 5. the torch mini-engine, and bandwidth at the engine's shapes ------------------
step "torch mini-engine (bench/gpu/engine_check.py)"
segdir=/dev/shm
shm_free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2{print int($4/1048576)}')
if [ -z "$dry" ] && [ "${shm_free:-0}" -lt 6 ]; then
	segdir=$work/seg
	mkdir -p "$segdir"
	rec NOTE "/dev/shm has ${shm_free:-?} GiB free: the mini-engine's segments go to $segdir instead"
fi
KVTIER_LIBRARY=$b/tier/libkvtier.so KVTIER_DMA=cuda lim 240 "$python" "$here/engine_check.py" \
	${quick:+--quick} --segment-dir "$segdir" --json "$work/engine_check.json" \
	>"$work/engine_check.log" 2>&1
rc=$?
grep -v '^kvtier' "$work/engine_check.log"
grep -E '^(PASS|FAIL|NOTE): ' "$work/engine_check.log" >>"$summary"
grep -q '^FAIL: ' "$work/engine_check.log" && status=1
[ "$rc" = 0 ] || fail "engine_check.py exited $rc (engine_check.log)"

# ---- 6. kvtier-bench bandwidth: engine layouts, the sweep, registration -------------------
step "kvtier-bench bandwidth"
read -r -a extra <<<"${KVT_BW_ARGS:-}"
if [ -n "$quick" ]; then
	sweep=(--chunk-sizes 64K,1M --depths 1,32 --ranks 1 --repeat 1)
	extra+=(--run-bytes 16M --dev-bytes 32M)
	reg=16M
else
	sweep=(--chunk-sizes 64K,256K,1M,4M,16M --depths 1,4,32 --ranks 1,2 --repeat 3)
	reg=1G
	[ "${shm_free:-0}" -lt 6 ] && extra+=(--run-bytes 32M --dev-bytes 64M) && reg=256M
fi
bw() {
	local name=$1
	shift
	echo "-- $name: kvtier-bench bandwidth --backend cuda --device 0 $* ${extra[*]}"
	if lim 150 "$bench" bandwidth --backend cuda --device 0 "$@" "${extra[@]}" \
		>"$work/$name.txt" 2>"$work/$name.err"; then
		cat "$work/$name.txt"
		rec PASS "bandwidth $name (every configuration verified before timing)"
	else
		tail -5 "$work/$name.err"
		fail "bandwidth $name ($name.err)"
	fi
}
bw bw-llama70b-tp8 --layout llama70b-tp8 --depths 1,32 --ranks 1 --reg-bytes "$reg" --hugetlbfs none
# the same 4 KiB pages by DMA only: the copy kernel's gain at the engine's
# smallest pages (the run above has it when NVRTC was found)
bw bw-llama70b-tp8-dma --layout llama70b-tp8 --depths 1,32 --ranks 1 --reg-bytes 0 \
	--hugetlbfs none --copy-kernel off
bw bw-glm5 --layout glm5 --depths 1,32 --ranks 1 --reg-bytes 0 --hugetlbfs none
bw bw-sweep "${sweep[@]}" --reg-bytes 0 --hugetlbfs none
# registration on huge pages: a mount with free pages, or pages this
# machine lets us reserve (root, /proc/sys/vm writable)
if [ -z "$dry" ] && ! grep -q hugetlbfs /proc/mounts; then
	mkdir -p "$work/huge" && mount -t hugetlbfs none "$work/huge" 2>/dev/null ||
		rec NOTE "no hugetlbfs mount and none can be made"
fi
hfree=$(awk '/HugePages_Free/{print $2}' /proc/meminfo)
if [ -z "$dry" ] && [ "${hfree:-0}" -lt 1024 ]; then
	echo 1100 >/proc/sys/vm/nr_hugepages 2>/dev/null
	hfree=$(awk '/HugePages_Free/{print $2}' /proc/meminfo)
fi
if [ -z "$dry" ] && [ "${hfree:-0}" -ge 600 ] && grep -q hugetlbfs /proc/mounts; then
	bw bw-reg-hugetlbfs --layout llama70b-tp8 --depths 32 --ranks 1 --reg-bytes "$reg" --hugetlbfs auto
else
	rec NOTE "registration on huge pages not measured (${hfree:-0} free 2 MiB pages${dry:+; a dry run})"
fi
grep -h -A3 -E '^(arena registration|registration probe)' "$work"/bw-*.txt 2>/dev/null |
	sed 's/^/  /' | tee "$work/registration.txt"

# ---- 7. the ratios -------------------------------------------------------------------
step checks
for f in bw-llama70b-tp8 bw-llama70b-tp8-dma bw-glm5 bw-sweep bw-reg-hugetlbfs; do
	[ -f "$work/$f.txt" ] || continue
	awk -v f="$f" '
	function bytes(s,   n) { n = s + 0; if (s ~ /K$/) n *= 1024; else if (s ~ /M$/) n *= 1048576;
		else if (s ~ /G$/) n *= 1073741824; return n }
	$7 == "|" && $1 != "layout" && bytes($4) >= 65536 && $5 > 1 {
		printf "%s: target 0.95: %s ranks=%s chunk=%s page=%s depth=%s save/ceil=%.2f load/ceil=%.2f\n",
			($10 >= 0.95 && $16 >= 0.95) ? "PASS" : "MISS", f, $2, $3, $4, $5, $10, $16
	}' "$work/$f.txt" | tee -a "$summary"
done
step done
echo "$(( $(date +%s) - start )) s of the ${deadline} s deadline used" | tee -a "$work/machine.txt"
exit $status
