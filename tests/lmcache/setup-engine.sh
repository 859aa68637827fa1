#!/usr/bin/env bash
# LMCache's wheel (lmcache==0.5.6) for an engine's environment, without
# touching it: installed without its dependencies into a folder of its own,
# which the engine's test puts first on PYTHONPATH.  vLLM's environment has
# every module LMCache's client and its vLLM connector import but
# sortedcontainers, installed there too (tests/vllm/test_lmcache_engine.py);
# SGLang's lacks a few more, named after the folder
# (tests/sglang/test_lmcache_sglang.py: tests/lmcache/setup-engine.sh
# SGLANG_VENV FOLDER --sglang).
# Usage: tests/lmcache/setup-engine.sh VENV FOLDER [--sglang].  Idempotent.
set -euo pipefail
venv=$1
target=$2
LMCACHE_PIN=${KVTIER_LMCACHE_PIN:-lmcache==0.5.6}
pkgs=("$LMCACHE_PIN" sortedcontainers==2.4.0)
if [ "${3:-}" = --sglang ]; then
  # what LMCache's SGLang connector imports that SGLang's environment lacks
  # (at the versions LMCache 0.5.6's own environment resolves)
  pkgs+=(cachetools==8.0.3 prometheus_client==0.24.1 py-cpuinfo==9.0.0 aiofile==3.12.3
         caio==0.12.10 cryptography==51.0.1 cffi==2.1.1 pycparser==3.12 numba==0.68.1
         llvmlite==0.50.0)
fi
stamp="$target/.kvtier-packages"
if [ -f "$target/lmcache/integration/vllm/lmcache_mp_connector.py" ] &&
   [ "$(cat "$stamp" 2>/dev/null)" = "${pkgs[*]}" ]; then
  exit 0
fi
rm -rf "$target"
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --target "$target" "${pkgs[@]}"
echo "${pkgs[*]}" >"$stamp"
