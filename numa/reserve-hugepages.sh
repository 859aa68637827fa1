#!/bin/sh
# Reserves a few 2 MiB huge pages and mounts hugetlbfs so that the huge page
# tests (test_numa_hugetlbfs) run instead of skipping.  Meant for CI: it tries
# and reports, and never fails the run (exit 0 always).
#
# Usage: numa/reserve-hugepages.sh [PAGES] [MOUNTPOINT]
#   PAGES       2 MiB pages wanted in the pool in total (default 16 = 32 MiB)
#   MOUNTPOINT  where to mount hugetlbfs if none is mounted (default
#               /dev/hugepages, where systemd mounts it)
#
# Needs root (or sudo without a password).  Reserving asks the kernel for
# contiguous 2 MiB blocks: on a fragmented machine it may get fewer than
# asked, which the script reports.  Nothing is changed if enough pages are
# already free and a 2 MiB hugetlbfs is mounted.
pages=${1:-16}
mnt=${2:-/dev/hugepages}
pool=/sys/kernel/mm/hugepages/hugepages-2048kB

say() { echo "reserve-hugepages: $*" >&2; }

case $pages in
''|*[!0-9]*) say "PAGES must be a number, not '$pages'"; exit 0 ;;
esac
if [ ! -d "$pool" ]; then
	say "this kernel has no 2 MiB huge page pool ($pool): nothing to do"
	exit 0
fi

SUDO=
if [ "$(id -u)" -ne 0 ]; then
	if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
		SUDO="sudo -n"
	fi
fi
run() { $SUDO "$@" 2>/dev/null; }

total=$(cat "$pool/nr_hugepages" 2>/dev/null || echo 0)
free=$(cat "$pool/free_hugepages" 2>/dev/null || echo 0)
if [ "$free" -lt "$pages" ]; then
	want=$((total + pages - free))
	# Raise the pool by what is missing; the kernel may grant less.
	if echo "$want" | run tee "$pool/nr_hugepages" >/dev/null; then
		:
	else
		say "cannot write $pool/nr_hugepages (not root, or a container without" \
		    "write access to /sys): huge page tests will skip"
	fi
	total=$(cat "$pool/nr_hugepages" 2>/dev/null || echo 0)
	free=$(cat "$pool/free_hugepages" 2>/dev/null || echo 0)
fi
say "2 MiB pool: $total pages, $free free (wanted $pages free)"

if grep -qs ' hugetlbfs .*pagesize=2M' /proc/mounts; then
	say "hugetlbfs already mounted: $(awk '$3 == "hugetlbfs" && /pagesize=2M/ {print $2; exit}' /proc/mounts)"
	exit 0
fi
if run mkdir -p "$mnt" && run mount -t hugetlbfs -o pagesize=2M,mode=1777 none "$mnt"; then
	# mode 1777: any user may create a segment, only its owner may remove it
	# (the sticky bit, as on /dev/shm).
	say "mounted hugetlbfs (2 MiB pages) on $mnt"
else
	say "cannot mount hugetlbfs on $mnt: huge page tests will skip"
fi
exit 0
