#!/usr/bin/env bash
# Makes (or checks) the virtual environment of the LMCache front end's
# tests: LMCache's own client, the pinned wheel from PyPI (lmcache==0.5.6)
# installed without its dependencies (tests/lmcache/requirements.txt holds
# what its client imports on a CPU-only machine, PyTorch 2.13.0's CPU build
# from the machines' disk among them), and pytest.
# Usage: tests/lmcache/setup-venv.sh VENV.  Idempotent: a complete one is kept.
set -euo pipefail
venv=$1
LMCACHE_PIN=${KVTIER_LMCACHE_PIN:-lmcache==0.5.6}
here=$(cd "$(dirname "$0")/../.." && pwd)
if [ -x "$venv/bin/python" ] &&
   "$venv/bin/python" -c "import pytest, torch, zmq
from lmcache.v1.multiprocess.transport.zmq_impl.client import ZmqMultiprocessClient" 2>/dev/null &&
   [ -f "$venv/lmcache-0.5.0/lmcache/v1/multiprocess/protocol.py" ]; then
  exit 0
fi
py=${KVTIER_LMCACHE_PYTHON:-$(command -v python3.11 || command -v python3)}
rm -rf "$venv"
"$py" -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" -r "$here/tests/lmcache/requirements.txt"
"${pip[@]}" --no-deps "$LMCACHE_PIN"
# an older client, of another protocol (its operations numbered otherwise):
# what kvtierd must refuse, run from its own folder on PYTHONPATH
"${pip[@]}" --no-deps --target "$venv/lmcache-0.5.0" lmcache==0.5.0
"$venv/bin/python" -c "import importlib.metadata as m, torch; print('lmcache', m.version('lmcache'), 'torch', torch.__version__)"
