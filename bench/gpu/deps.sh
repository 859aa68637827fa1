#!/usr/bin/env bash
# bench/gpu/deps.sh - what the GPU check's build needs beyond a C compiler
# and CMake, as Debian packages, for a machine that has none of Debian's
# -dev packages and no network (the GPU image: CUDA's nvcc, CMake, Python,
# torch).  Run here, on the Debian machine; the folder travels with the
# working tree (the device run's `carry`), and bench/gpu/check.sh builds
# against it (KVT_GPU_DEPS).
#
#   bench/gpu/deps.sh [DIR]        (default: build-gpu-deps, git-ignored)
#
# DIR/debs: the packages as apt fetched them (their versions in
# DIR/PACKAGES); DIR/root: their files, unpacked (dpkg-deb -x), so the
# other machine needs neither dpkg nor root.  The packages:
#   libxxhash-dev, libxxhash0   chunk keys (tier/hash.c: XXH3, inlined)
#   libcmocka-dev, libcmocka0   the DMA tests
# Their libraries need glibc 2.17 or newer.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/build-gpu-deps}
pkgs=(libxxhash-dev libxxhash0 libcmocka-dev libcmocka0)

mkdir -p "$dir/debs"
dir=$(cd "$dir" && pwd)
cd "$dir/debs"
rm -f ./*.deb
# (apt's sandbox user cannot write here: download as root, quietly)
if ! apt-get download -o APT::Sandbox::User=root "${pkgs[@]}" >"$dir/download.log" 2>&1; then
	cat "$dir/download.log" >&2
	echo "deps.sh: apt-get download ${pkgs[*]} failed (apt-get update first?)" >&2
	exit 1
fi
rm -rf "$dir/root"
: >"$dir/PACKAGES"
for f in ./*.deb; do
	dpkg-deb -x "$f" "$dir/root"
	dpkg-deb -f "$f" Package Version Architecture | tr '\n' ' ' >>"$dir/PACKAGES"
	echo >>"$dir/PACKAGES"
done
rm -rf "$dir/root/usr/share"
arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
for f in usr/include/xxhash.h usr/include/cmocka.h \
	"usr/lib/$arch/libxxhash.so" "usr/lib/$arch/libcmocka.so"; do
	[ -e "$dir/root/$f" ] || { echo "deps.sh: $f missing from the packages" >&2; exit 1; }
done
echo "$arch" >"$dir/ARCH"
echo "deps.sh: $(wc -l <"$dir/PACKAGES") packages unpacked in $dir/root ($arch)"
