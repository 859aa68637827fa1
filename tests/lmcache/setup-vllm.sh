#!/usr/bin/env bash
# LMCache's wheel (lmcache==0.5.6) for a vLLM environment, without touching
# it: installed without its dependencies into a folder of its own, which the
# engine test (tests/vllm/test_lmcache_engine.py) puts first on the engine's
# PYTHONPATH.  vLLM's environment has every module LMCache's client and its
# vLLM connector import but sortedcontainers, installed there too.
# Usage: tests/lmcache/setup-vllm.sh VLLM_VENV FOLDER.  Idempotent.
set -euo pipefail
venv=$1
target=$2
LMCACHE_PIN=${KVTIER_LMCACHE_PIN:-lmcache==0.5.6}
if [ -f "$target/lmcache/integration/vllm/lmcache_mp_connector.py" ] &&
   [ -d "$target/sortedcontainers" ]; then
  exit 0
fi
rm -rf "$target"
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --target "$target" \
  "$LMCACHE_PIN" sortedcontainers==2.4.0
