#!/usr/bin/env bash
# Checks the Promela models of core/ with spin, exhaustively (tests/model):
# every configuration of the layout-2 protocol must be clean, and the
# layout-1 protocol must be caught (if the model of the old protocol stopped
# finding its bugs, the model would have become too weak to trust).
#
# Usage: tests/model/check.sh [long]   ("long": two more configurations of
# tens of millions of states, minutes and ~4 GB each; the default set has
# one of those, ~4 min in all on two cores)
# Exit 77 when spin or a C compiler is missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
command -v spin >/dev/null && command -v cc >/dev/null || { echo "spin or cc missing"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail=0

# run MODEL "DEFINES" EXPECT [WBITS]
#   EXPECT: clean | assert:TEXT | endstate
run() {
	local model=$1 defs=$2 expect=$3 w=${4:-24} out errors
	cp "$here/$model" m.pml
	# shellcheck disable=SC2086
	spin $defs -a m.pml >/dev/null
	cc -O2 -w -DSAFETY -DCOLLAPSE -o pan pan.c
	out=$(./pan -m1000000 -w"$w" 2>&1 || true)
	errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' <<<"$out")
	local states=$(sed -n 's/^ *\([0-9e.+]*\) states, stored.*/\1/p' <<<"$out" | head -1)
	local verdict
	case $expect in
	clean)    [ "$errors" = 0 ] && verdict=ok || verdict=FAIL ;;
	assert:*) grep -qF "assertion violated ${expect#assert:}" <<<"$out" && verdict=ok || verdict=FAIL ;;
	endstate) grep -q "invalid end state" <<<"$out" && [ "$errors" != 0 ] && verdict=ok || verdict=FAIL ;;
	esac
	printf '%-4s %-9s %-44s expect %-28s errors %s, %s states\n' "$verdict" "$model" \
		"${defs:-(default)}" "$expect" "${errors:-?}" "${states:-?}"
	if [ "$verdict" != ok ]; then
		fail=1
		grep -E "pan:|violated|invalid end" <<<"$out" | head -5 || true
	fi
}

S="-DNSH=1 -DNW=2 -DITER=1"
# the slot state machine: claims, doom, reclaim, eviction
run slot.pml "$S -DAUX_ITER=1" clean
run slot.pml "$S -DAUX_ITER=2" clean
run slot.pml "-DNSH=2 -DNW=2 -DITER=1 -DAUX_ITER=1" clean
# two operations per writer: a writer's second join of a shard it wrote
# meets a chunk completed and evicted under its claim (the last-out reclaim
# of a join that finds its shard written): ~86 M states, ~2.5 min, ~4 GB
run slot.pml "-DNSH=2 -DNW=2 -DITER=2 -DAUX_ITER=1" clean 28
run slot.pml "$S -DAUX_ITER=1 -DLAYOUT1" "assert:((inflight[0]"      # finding 1
run slot.pml "-DNSH=2 -DNW=2 -DITER=1 -DAUX_ITER=1 -DLAYOUT1" "assert:((inflight[0]"
# pins, journals, freeze repair, adoption, dying reapers, re-attach
run pins.pml "-DDEATHS=2" clean
run pins.pml "-DDEATHS=3" clean
run pins.pml "-DDEATHS=2 -DREATTACH" clean
run pins.pml "-DDEATHS=3 -DREATTACH" clean
run pins.pml "-DDEATHS=3 -DLAYOUT1" endstate                          # finding 4
run pins.pml "-DDEATHS=2 -DREATTACH -DLAYOUT1" "assert:(pins==0)"     # finding 5
# the disk tier: the index entry's seqlock with a dying engine, demotion
# without a pin
run disk.pml "-DPART=1" clean
run disk.pml "-DPART=1 -DPUTS=3" clean
run disk.pml "-DPART=2 -DLIVES=3" clean
run disk.pml "-DPART=1 -DNO_SEQCHECK" "assert:((lo==v)"
run disk.pml "-DPART=2 -DNO_LIFECHECK" "assert:((c0==g)"
if [ "${1:-}" = long ]; then
	run slot.pml "-DNSH=1 -DNW=3 -DITER=1 -DAUX_ITER=1" clean 28
	run slot.pml "-DNSH=1 -DNW=2 -DITER=2 -DAUX_ITER=2" clean 28
fi
exit $fail
