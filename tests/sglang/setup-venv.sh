#!/usr/bin/env bash
# Makes (or checks) the virtual environment of the kvtier.sglang tests:
# SGLang's pinned release (sglang==0.5.23, kvtier.sglang's TESTED) without
# its dependencies, beside the packages its storage and cache-controller
# modules import (tests/sglang/requirements.txt: PyTorch 2.14.1 as SGLang
# pins it, from the machines' disk), pytest, and the kvtier package.
# Usage: tests/sglang/setup-venv.sh VENV.  Idempotent: a complete one is kept.
set -euo pipefail
venv=$1
SGLANG_PIN=${KVTIER_SGLANG_PIN:-sglang==0.5.23}
here=$(cd "$(dirname "$0")/../.." && pwd)
if [ -x "$venv/bin/python" ] &&
   KVTIER_LIBRARY=${KVTIER_LIBRARY:-} "$venv/bin/python" -c "import sglang, pytest, torch" 2>/dev/null; then
  exit 0
fi
py=${KVTIER_SGLANG_PYTHON:-$(command -v python3.11 || command -v python3)}
rm -rf "$venv"
"$py" -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" -r "$here/tests/sglang/requirements.txt"
"${pip[@]}" --no-deps "$SGLANG_PIN"
"${pip[@]}" --no-deps --no-build-isolation "$here/bindings/python"
"$venv/bin/python" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"
