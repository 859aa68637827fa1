#!/usr/bin/env bash
# Installs what kvtierd's Mooncake Store L3 (--l3 mooncake://...) needs on
# this node: Debian's libraries under Mooncake's wheel (libibverbs1 for its
# transfer engine, even over TCP; libnuma1; libcurl4 for an HTTP metadata
# server), and the wheel itself -- its Python client, mooncake_master and
# mooncake_client -- in a virtual environment of its own.
#
# Usage: scripts/mooncake.sh VENV
# Then:  kvtierd ... --l3 mooncake://MASTER --l3-python VENV/bin/python
#        (a master of this version: VENV/bin/mooncake_master)
# Idempotent: a VENV with this version is kept.  Network: PyPI.
set -euo pipefail
venv=${1:?usage: scripts/mooncake.sh VENV}
# the non-CUDA build: the client moves host memory (kvtier's arena) only.
# The fleet's master and clients should run the same version.
pin=${KVTIER_MOONCAKE_PIN:-mooncake-transfer-engine-non-cuda==0.3.13.post1}

pkgs=(python3-venv libibverbs1 libnuma1 libcurl4)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
    || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "mooncake: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
fi

want=${pin#*==}
have=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('${pin%%==*}'))" \
       2>/dev/null || true)
if [ "$have" != "$want" ]; then
  rm -rf "$venv"
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "$pin"
fi
# the client loads (its shared libraries found) and the master runs
"$venv/bin/python" -c "from mooncake.store import MooncakeDistributedStore"
[ -x "$venv/bin/mooncake_master" ]
echo "mooncake: $pin in $venv (kvtierd --l3-python $venv/bin/python)"
