#!/usr/bin/env bash
# Installs the build into a scratch prefix, checks the files a distribution
# expects, builds tests/install/hello.c against the installed header and
# library with `pkg-config --cflags --libs kvtier` only, and runs it; with
# "deb", makes the .deb with CPack and checks its contents and Depends.
# Usage: check.sh BUILD_DIR SOURCE_DIR [deb]
# KVTIER_EXPECT_L3=0: a build without the L3 (no liburing), whose install
# has no Mooncake companion.
set -euo pipefail
build=$1 src=$2 mode=${3:-install}
companion=libexec/kvtier/kvtier-l3-mooncake
[ "${KVTIER_EXPECT_L3:-1}" = 1 ] || companion=
tmp=$(mktemp -d /tmp/kvtier-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
command -v pkg-config >/dev/null || { echo "pkg-config missing (scripts/deps.sh)"; exit 1; }

if [ "$mode" = deb ]; then
  (cd "$build" && cpack -G DEB -B "$tmp/pkg" >"$tmp/cpack.log" 2>&1) \
    || { cat "$tmp/cpack.log"; exit 1; }
  deb=$(ls "$tmp"/pkg/kvtier_*.deb)
  dpkg-deb -c "$deb" >"$tmp/contents"
  for f in ./usr/include/kvtier.h ./usr/sbin/kvtierd ./usr/bin/kvtier-stat \
           ./usr/bin/kvtier-size ./usr/bin/kvtier-bench ./usr/lib/systemd/system/kvtierd.service \
           ./etc/kvtier/kvtierd.conf ./usr/lib/sysusers.d/kvtier.conf \
           ./usr/lib/tmpfiles.d/kvtier.conf ./usr/libexec/kvtier/kvtier-witness \
           ${companion:+./usr/$companion}; do
    grep -q " $f\$" "$tmp/contents" || { echo "deb: $f missing"; cat "$tmp/contents"; exit 1; }
  done
  grep -q "libkvtier.so.1" "$tmp/contents" || { echo "deb: libkvtier.so.1 missing"; exit 1; }
  grep -q "/pkgconfig/kvtier.pc\$" "$tmp/contents" || { echo "deb: kvtier.pc missing"; exit 1; }
  dpkg-deb -f "$deb" Depends | tee "$tmp/depends"
  grep -q libmicrohttpd "$tmp/depends" || { echo "deb: Depends lacks libmicrohttpd"; exit 1; }
  dpkg-deb -e "$deb" "$tmp/ctl"
  grep -qx /etc/kvtier/kvtierd.conf "$tmp/ctl/conffiles"
  [ -x "$tmp/ctl/postinst" ] && grep -q "systemd-sysusers" "$tmp/ctl/postinst" \
    || { echo "deb: no postinst making the service user"; exit 1; }
  dpkg-deb -x "$deb" "$tmp/root"
  grep -q "^ExecStart=/usr/sbin/kvtierd --config /etc/kvtier/kvtierd.conf" \
    "$tmp/root/usr/lib/systemd/system/kvtierd.service"
  echo "deb OK: $(basename "$deb")"
  exit 0
fi

cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log"
p=$tmp/prefix
libdir=$(cd "$p" && { ls -d lib*/pkgconfig lib/*/pkgconfig 2>/dev/null || true; } | head -1)
[ -n "$libdir" ] || { echo "no pkgconfig directory under the prefix"; cat "$tmp/install.log"; exit 1; }
for f in include/kvtier.h sbin/kvtierd bin/kvtier-stat bin/kvtier-size bin/kvtier-bench \
         lib/systemd/system/kvtierd.service etc/kvtier/kvtierd.conf "$libdir/kvtier.pc" \
         libexec/kvtier/kvtier-witness $companion; do
  [ -e "$p/$f" ] || { echo "not installed: $f"; cat "$tmp/install.log"; exit 1; }
done
{ ls "$p"/lib*/libkvtier.so.1 "$p"/lib/*/libkvtier.so.1 2>/dev/null || true; } | grep -q . \
  || { echo "no versioned libkvtier.so.1"; exit 1; }
grep -q "^ExecStart=$p/sbin/kvtierd --config $p/etc/kvtier/kvtierd.conf" \
  "$p/lib/systemd/system/kvtierd.service" || { echo "unit paths:"; cat "$p/lib/systemd/system/kvtierd.service"; exit 1; }
export PKG_CONFIG_PATH="$p/$libdir"
flags=$(pkg-config --cflags --libs kvtier)
rpath=$(pkg-config --variable=libdir kvtier)
echo "pkg-config: $flags"
cc -std=c11 -Wall -Wextra -Werror "$src/tests/install/hello.c" $flags -Wl,-rpath,"$rpath" \
  -o "$tmp/hello"
# it runs against the installed library, not the build tree's
# (ldd's output kept first: with pipefail, grep -q closing the pipe early
# would make ldd's SIGPIPE the pipeline's status)
deps=$(ldd "$tmp/hello")
grep -q "$p" <<<"$deps" || { echo "hello does not load the installed library"; echo "$deps"; exit 1; }
"$tmp/hello"
"$p/sbin/kvtierd" --version
"$p/bin/kvtier-stat" --version
echo "install OK"
