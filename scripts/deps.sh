#!/usr/bin/env bash
# Installs the Debian packages that kvtier's build and test suite need, when
# they are missing. Idempotent: a machine that has them all runs no apt-get.
set -euo pipefail

# Usage: scripts/deps.sh [main]   main: only what the main job needs (the
# build and kvtier-bench), not the test tools (pytest, torch, spin, clang).
pkgs=(
  build-essential cmake pkg-config      # the build
  libcmocka-dev                         # C unit tests
  libnuma-dev                           # numa/: mbind, get_mempolicy, move_pages
  libjson-c-dev                         # kvtier-size reads config.json, kvtier-bench replay its trace
  libxxhash-dev                         # key hashing (XXH3-128)
  liburing-dev                          # the disk tier (io_uring: kvtierd, kvtier-bench disk)
  libmicrohttpd-dev                     # kvtierd's HTTP server (/healthcheck, /metrics)
  libinih-dev                           # kvtierd's config file (key = value lines)
  libssl-dev                            # the disk tier's chunk MAC (ChaCha20-Poly1305, libcrypto)
  libhiredis-dev                        # the L3 tier's Redis (Cluster) client
  libzmq3-dev libmsgpack-dev            # kvtierd's LMCache front end (ZeroMQ, msgpack)
  libhsa-runtime-dev                    # hsa backend headers + real runtime
  libamdhip64-dev                       # HIP headers + runtime: kvtier-bench's hipMalloc'ed KV
                                        # and HIP ceiling on AMD, the fake HIP of the tests
)
[ "${1:-}" = main ] || pkgs+=(
  python3-pytest python3-numpy          # Python binding tests (/usr/bin/python3)
  python3-torch                         # CPU tensors as a fake KV cache (binding tests)
  spin                                  # model checker of core's protocols (tests/model)
  clang libclang-rt-14-dev              # libFuzzer: the fuzz targets (tests/fuzz/run.sh)
  curl tmux prometheus                  # kvtierd's tests: HTTP client, a terminal for
                                        # kvtier-stat --watch, promtool and a real server
  python3-venv                          # the vLLM engine tests' virtual environment
  systemd                               # systemd-analyze: the shipped unit's verify and security checks
  redis-server redis-tools              # the L3 tests' real Redis Cluster (redis-cli --cluster)
)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
    || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=
[ "$(id -u)" -ne 0 ] && SUDO=sudo
echo "deps: installing ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
