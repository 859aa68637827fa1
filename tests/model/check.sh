#!/usr/bin/env bash
# Checks the Promela models of core/ with spin, exhaustively (tests/model):
# every configuration of the layout-2 protocol must be clean, and the
# layout-1 protocol must be caught (if the model of the old protocol stopped
# finding its bugs, the model would have become too weak to trust).
#
# Usage: tests/model/check.sh [long]   ("long": three more configurations of
# tens to hundreds of millions of states, minutes and 4-10 GB each; the
# default set runs in about a minute on two cores, configurations in
# parallel, KVTIER_MODEL_JOBS at a time, default nproc)
# Exit 77 when spin or a C compiler is missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
command -v spin >/dev/null && command -v cc >/dev/null || { echo "spin or cc missing"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
jobs=${KVTIER_MODEL_JOBS:-$(nproc 2>/dev/null || echo 2)}

# run MODEL "DEFINES" EXPECT [WBITS]
#   EXPECT: clean | assert:TEXT | endstate
# Queues one configuration; finish() checks them all, $jobs at a time, each
# in a directory of its own, and prints the verdicts in queue order.
n=0
run() {
	n=$((n + 1))
	printf '%s\n' "$1" "$2" "$3" "${4:-24}" >"$work/cfg.$n"
}

check_one() { # $1: queue number; prints the verdict line, exit 1 on FAIL
	local i=$1 model defs expect w out errors states verdict t0
	{ read -r model; read -r defs; read -r expect; read -r w; } <"$work/cfg.$i"
	mkdir -p "$work/$i" && cd "$work/$i"
	t0=$(date +%s)
	cp "$here/$model" m.pml
	# shellcheck disable=SC2086
	spin $defs -a m.pml >/dev/null
	cc -O2 -w -DSAFETY -DCOLLAPSE -o pan pan.c
	out=$(./pan -m1000000 -w"$w" 2>&1 || true)
	errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' <<<"$out")
	states=$(sed -n 's/^ *\([0-9e.+]*\) states, stored.*/\1/p' <<<"$out" | head -1)
	case $expect in
	clean)    [ "$errors" = 0 ] && verdict=ok || verdict=FAIL ;;
	assert:*) grep -qF "assertion violated ${expect#assert:}" <<<"$out" && verdict=ok || verdict=FAIL ;;
	endstate) grep -q "invalid end state" <<<"$out" && [ "$errors" != 0 ] && verdict=ok || verdict=FAIL ;;
	esac
	printf '%-4s %-9s %-44s expect %-28s errors %s, %s states, %ss\n' "$verdict" "$model" \
		"${defs:-(default)}" "$expect" "${errors:-?}" "${states:-?}" "$(($(date +%s) - t0))"
	if [ "$verdict" != ok ]; then
		grep -E "pan:|violated|invalid end" <<<"$out" | head -5 || true
		return 1
	fi
	rm -f pan pan.* m.pml*
}

finish() {
	local i fail=0
	export -f check_one
	export here work
	seq 1 "$n" | xargs -P "$jobs" -I{} bash -c 'check_one {} >"$work/out.{}" 2>&1' || fail=1
	for i in $(seq 1 "$n"); do cat "$work/out.$i"; done
	return $fail
}

S="-DNSH=1 -DNW=2 -DITER=1"
# the slot state machine: claims, doom, reclaim, eviction
run slot.pml "$S -DAUX_ITER=1" clean
run slot.pml "$S -DAUX_ITER=2" clean
run slot.pml "-DNSH=2 -DNW=2 -DITER=1 -DAUX_ITER=1" clean
# two operations of one writer: its second join of a shard it wrote meets a
# chunk completed and evicted under its claim (the last-out reclaim of a
# join that finds its shard written): 28 M states, ~35 s, ~2.2 GB.  Both
# writers twice (207 M states, ~6 min, ~10 GB) is in the long set; this
# configuration already finds the bug it guards against (NO_JOIN_RECLAIM).
run slot.pml "-DNSH=2 -DNW=2 -DITER=1 -DITER0=2 -DAUX_ITER=1" clean 27
run slot.pml "-DNSH=2 -DNW=2 -DITER=1 -DITER0=2 -DAUX_ITER=1 -DNO_JOIN_RECLAIM" "assert:((st!=4)&&(st!=3))"
run slot.pml "$S -DAUX_ITER=1 -DLAYOUT1" "assert:((inflight[0]"      # finding 1
run slot.pml "-DNSH=2 -DNW=2 -DITER=1 -DAUX_ITER=1 -DLAYOUT1" "assert:((inflight[0]"
# pins, journals, freeze repair, adoption, dying reapers, re-attach
run pins.pml "-DDEATHS=2" clean
run pins.pml "-DDEATHS=3" clean
run pins.pml "-DDEATHS=2 -DREATTACH" clean
run pins.pml "-DDEATHS=3 -DREATTACH" clean
run pins.pml "-DDEATHS=3 -DLAYOUT1" endstate                          # finding 4
run pins.pml "-DDEATHS=2 -DREATTACH -DLAYOUT1" "assert:(pins<=extra_pins)" # finding 5
# stopped processes (SIGSTOP, the freezer): every wait on a live process is
# bounded; unbounded (layout 5) it deadlocks, a give-up that does not count
# a pending pin lets the slot be evicted under a reader
run pins.pml "-DDEATHS=2 -DSTOPS=1" clean
run pins.pml "-DDEATHS=2 -DSTOPS=2" clean
run pins.pml "-DDEATHS=2 -DSTOPS=1 -DREATTACH" clean
run pins.pml "-DDEATHS=1 -DSTOPS=1 -DNO_BOUND" endstate
run pins.pml "-DDEATHS=1 -DSTOPS=1 -DOPTIMISTIC" "assert:(pins>0)"
# the disk tier: the index entry's seqlock with a dying engine, demotion
# without a pin
run disk.pml "-DPART=1" clean
run disk.pml "-DPART=1 -DPUTS=3" clean
run disk.pml "-DPART=2 -DLIVES=3" clean
run disk.pml "-DPART=1 -DNO_SEQCHECK" "assert:((lo==v)"
run disk.pml "-DPART=2 -DNO_LIFECHECK" "assert:((c0==g)"
# promotion by an engine that dies with its read in flight: the claim lives
# as long as the ring holds the lock descriptor
run disk.pml "-DPART=3" clean
run disk.pml "-DPART=3 -DNO_RING_HOLD" "assert:(pbytes==pkey)"
if [ "${1:-}" = long ]; then
	run slot.pml "-DNSH=2 -DNW=2 -DITER=2 -DAUX_ITER=1" clean 28
	run slot.pml "-DNSH=1 -DNW=3 -DITER=1 -DAUX_ITER=1" clean 28
	run slot.pml "-DNSH=1 -DNW=2 -DITER=2 -DAUX_ITER=2" clean 28
fi
finish
