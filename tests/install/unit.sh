#!/usr/bin/env bash
# The shipped systemd unit (packaging/kvtierd.service.in), as installed:
#  * `systemd-analyze verify` finds no error in it;
#  * `systemd-analyze security --offline=yes` rates its exposure at most
#    MAX_EXPOSURE (2.0, the top of systemd's "OK" band: the unit before
#    issue 24, root and no sandbox, rated 9.6 UNSAFE; this one 1.6);
#  * the directives the sandbox rests on are there (a dedicated user, no
#    capabilities, a read-only system, the exit statuses that must not
#    restart, the segment directory of its own);
#  * the sysusers.d and tmpfiles.d files are installed beside it;
#  * as root: the built kvtierd runs as an unprivileged system user made
#    here, under no_new_privs, in a segment directory of that user's, and
#    stops cleanly: it needs no root.
# What this cannot check without systemd as PID 1 (a container here): the
# unit started for real under its namespaces and seccomp filter.
# Exit 77 (skipped) without systemd-analyze.  Usage: unit.sh BUILD_DIR
set -euo pipefail
build=$1
MAX_EXPOSURE=${MAX_EXPOSURE:-2.0}
command -v systemd-analyze >/dev/null || { echo "skip: no systemd-analyze (apt-get install systemd)"; exit 77; }
tmp=$(mktemp -d /tmp/kvtier-unit.XXXXXX)
user=
cleanup() {
  [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true
  [ -n "$user" ] && userdel "$user" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
cmake --install "$build" --prefix "$tmp/p" >"$tmp/install.log"
unit=${UNIT_FILE:-$tmp/p/lib/systemd/system/kvtierd.service}
[ -f "$unit" ] || { echo "unit not installed"; cat "$tmp/install.log"; exit 1; }
for f in lib/sysusers.d/kvtier.conf lib/tmpfiles.d/kvtier.conf etc/kvtier/kvtierd.conf; do
  [ -f "$tmp/p/$f" ] || { echo "not installed: $f"; exit 1; }
done
grep -q '^u kvtier ' "$tmp/p/lib/sysusers.d/kvtier.conf"
grep -q '^d /dev/shm/kvtier 0750 kvtier kvtier' "$tmp/p/lib/tmpfiles.d/kvtier.conf"

if ! systemd-analyze verify "$unit" >"$tmp/verify.log" 2>&1 || [ -s "$tmp/verify.log" ]; then
  echo "systemd-analyze verify:"; cat "$tmp/verify.log"; exit 1
fi
systemd-analyze security --offline=yes "$unit" >"$tmp/security.log" 2>&1 || true
score=$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p' "$tmp/security.log")
[ -n "$score" ] || { echo "no exposure level:"; cat "$tmp/security.log"; exit 1; }
echo "systemd-analyze security: exposure $score (at most $MAX_EXPOSURE)"
awk -v s="$score" -v m="$MAX_EXPOSURE" 'BEGIN { exit !(s <= m) }' \
  || { grep '✗' "$tmp/security.log" | head -30; echo "exposure $score > $MAX_EXPOSURE"; exit 1; }
for d in 'User=kvtier' 'Group=kvtier' 'NoNewPrivileges=yes' 'CapabilityBoundingSet=$' \
         'ProtectSystem=strict' 'ProtectHome=yes' 'PrivateTmp=yes' 'PrivateDevices=yes' \
         'RestrictAddressFamilies=AF_UNIX AF_INET$' 'LimitMEMLOCK=infinity' \
         'StateDirectory=kvtier' 'RestartPreventExitStatus=.*\b5\b' 'RemoveIPC=no' \
         'Environment=KVTIER_SEGMENT_DIR=/dev/shm/kvtier' 'ProtectProc=default'; do
  grep -Eq "^$d" "$unit" || { echo "unit: no $d"; exit 1; }
done

if [ "$(id -u)" -ne 0 ] || ! command -v useradd >/dev/null || ! command -v setpriv >/dev/null; then
  echo "unit OK (the unprivileged run needs root, useradd and setpriv: not run)"
  exit 0
fi
user=kvtu$$
useradd --system --no-create-home --shell /usr/sbin/nologin "$user"
segdir=$tmp/seg
install -d -m 0750 -o "$user" -g "$user" "$segdir"
chmod 0755 "$tmp"
kvtierd=$tmp/p/sbin/kvtierd
name=unit-$$
setpriv --reuid="$user" --regid="$user" --clear-groups --no-new-privs --inh-caps=-all \
  "$kvtierd" --segment "$name" --segment-dir "$segdir" --group 2:256 --world 1 --slots 16 \
  --no-http --no-lock --unlink >"$tmp/run.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  grep -q ' up: ' "$tmp/run.log" && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
grep -q ' up: ' "$tmp/run.log" || { echo "kvtierd as $user did not come up:"; cat "$tmp/run.log"; exit 1; }
[ "$(stat -c %U "$segdir/kvtier.$name")" = "$user" ]
grep -q 'NoNewPrivs:[[:space:]]*1' "/proc/$pid/status"
kill -TERM "$pid"
rc=0; wait "$pid" || rc=$?
pid=
[ "$rc" -eq 0 ] || { echo "kvtierd as $user exited $rc:"; cat "$tmp/run.log"; exit 1; }
[ ! -e "$segdir/kvtier.$name" ]
echo "unit OK; kvtierd ran as $user (no root, no_new_privs) and stopped cleanly"
