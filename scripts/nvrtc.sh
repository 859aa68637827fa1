#!/usr/bin/env bash
# NVRTC from PyPI (NVIDIA's nvidia-cuda-nvrtc wheel: the library an engine's
# CUDA torch carries), unpacked into DIR, for compiling the copy kernel
# (dma/src/copy_kernel.c) in the tests on a machine without a CUDA toolkit:
# the real compiler takes the real source, so a syntax or parameter error
# fails CI.  No GPU is needed to compile.
#
# Usage: scripts/nvrtc.sh DIR      -> DIR/libnvrtc.so.13 (KVTIER_NVRTC_LIBRARY)
# Idempotent: a DIR with this version is kept.  Network: PyPI (~90 MB).
set -euo pipefail
dir=${1:?usage: scripts/nvrtc.sh DIR}
pin=${KVTIER_NVRTC_PIN:-nvidia-cuda-nvrtc==13.0.88}
if [ -f "$dir/VERSION" ] && [ "$(cat "$dir/VERSION")" = "$pin" ] && [ -f "$dir/libnvrtc.so.13" ]; then
  exit 0
fi
rm -rf "$dir"
mkdir -p "$dir/wheel"
/usr/bin/python3 -m pip download -q --disable-pip-version-check --no-deps \
  --only-binary=:all: -d "$dir/wheel" "$pin" >&2
/usr/bin/python3 - "$dir" <<'PY'
import glob, os, sys, zipfile
d = sys.argv[1]
whl = glob.glob(os.path.join(d, "wheel", "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        base = os.path.basename(n)
        # the library and the builtins it loads from its own folder
        if base in ("libnvrtc.so.13", "libnvrtc-builtins.so.13.0"):
            with z.open(n) as src, open(os.path.join(d, base), "wb") as dst:
                dst.write(src.read())
PY
rm -rf "$dir/wheel"
[ -f "$dir/libnvrtc.so.13" ] || { echo "nvrtc.sh: no libnvrtc.so.13 in $pin" >&2; exit 1; }
echo "$pin" >"$dir/VERSION"
echo "nvrtc.sh: $pin in $dir" >&2
