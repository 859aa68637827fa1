#!/usr/bin/env bash
# The vLLM releases the connector supports that have no CPU build (the CUDA
# package only: 0.33, 0.34): each one's wheel, without its dependencies,
# unpacked without its compiled parts (vllm/*.py and data; no .so) into
# DIR/vllm-X, and tests/vllm's scheduler-driven, connector and fold tests
# run with it first on PYTHONPATH, on VENV's CPU torch and the rest of its
# packages (tests/vllm/test_scheduler_driven.py says what that runs and
# what not).  Idempotent: an unpacked release is kept.
# Usage: tests/vllm/other-releases.sh VENV DIR [VERSION...]
set -euo pipefail
venv=$1
# absolute: the wheel is unpacked from inside the release's folder
dir=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.33.0 0.34.0)
here=$(cd "$(dirname "$0")" && pwd)
for v in "${versions[@]}"; do
  src=$dir/vllm-$v
  if [ ! -f "$src/vllm/__init__.py" ]; then
    rm -rf "$src" "$dir/wheel-$v"
    "$venv/bin/pip" download -q --disable-pip-version-check --no-deps -d "$dir/wheel-$v" \
      "vllm==$v"
    mkdir -p "$src.part"
    (cd "$src.part" && unzip -q "$dir"/wheel-"$v"/vllm-"$v"-*.whl 'vllm/*' -x '*.so')
    rm -rf "$dir/wheel-$v"
    mv "$src.part" "$src"
  fi
  echo "== vLLM $v (its scheduler and connector code; no engine)"
  PYTHONPATH=$src KVTIER_VLLM_EXPECT=$v "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    "$here/test_scheduler_driven.py" "$here/test_connector_config.py" "$here/test_offload_env.py"
done
