# bench/gpu/common.sh - what the GPU run scripts share (sourced by amd.sh;
# the NVIDIA check is check.sh, on its own): the output directory and its SUMMARY.txt,
# the step/record helpers, and the check of a bandwidth table's ratios.
#
# A script sets $here and $root, sources it as
#   . "$here/common.sh" DEFAULT_OUTDIR "$@"
# (its own arguments: OUTDIR, then --quick or nothing), and uses $out, $quick
# and $status (0 unless a check FAILed; its exit status).

out=${2:-$PWD/$1}
quick=${3:-}
mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)

# The bandwidth sweep: short with --quick, the full one otherwise.
if [ "$quick" = --quick ]; then
	sweep=(--chunk-sizes 64K,1M,16M --depths 1,32 --ranks 1 --repeat 3)
	ranks=1
else
	sweep=(--chunk-sizes 64K,256K,1M,4M,16M --depths 1,4,32 --ranks 1,2 --repeat 3)
	ranks=1,2
fi
# KVT_BW_ARGS: extra options for every run (e.g. "--run-bytes 64M" for a dry run)
read -r -a extra <<<"${KVT_BW_ARGS:-}"
summary=$out/SUMMARY.txt
: >"$summary"
exec > >(tee "$out/run.log") 2>&1
status=0
jobs=$(nproc 2>/dev/null || echo 4)

step() { echo; echo "== $*"; }
rec() { echo "$1: $2"; echo "$1: $2" >>"$summary"; }
fail() { rec FAIL "$1"; status=1; }
die() { rec FAIL "$1"; exit 1; }

# The lines of machine.txt every vendor's script starts with.
machine_common() {
	echo "date: $(date -u +%FT%TZ)"
	echo "host: $(uname -srm), $(nproc) CPUs"
	echo "kvtier: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)" \
	     "$(git -C "$root" status --porcelain 2>/dev/null | grep -q . && echo '(dirty tree)')"
}

# bw NAME ARGS...
#   One "$bench bandwidth" run with the script's ${bw_base[@]}, ARGS and
#   $KVT_BW_ARGS; the table goes to NAME.txt, errors to NAME.err.
bw() {
	local name=$1
	shift
	echo "-- $name: $bench bandwidth ${bw_base[*]} $* ${extra[*]}"
	if timeout 900 "$bench" bandwidth "${bw_base[@]}" "$@" "${extra[@]}" >"$out/$name.txt" \
		2>"$out/$name.err"; then
		cat "$out/$name.txt"
		rec PASS "bandwidth $name (verified: saved sub-slots and loaded pages compared)"
	else
		cat "$out/$name.err"
		fail "bandwidth $name ($name.err)"
	fi
}

# bw_sweeps: the runs every vendor's script makes after its own: adjacent
#   pages, the GLM-5 and Llama-70B-TP8 shapes, and the sweep as JSON.
bw_sweeps() {
	bw bandwidth-adjacent "${sweep[@]}" --blocks seq --reg-bytes 0
	bw bandwidth-glm5 --layout glm5 --depths 1,4,32 --ranks "$ranks" --reg-bytes 0
	bw bandwidth-llama70b-tp8 --layout llama70b-tp8 --depths 1,4,32 --ranks "$ranks" --reg-bytes 0
	timeout 900 "$bench" bandwidth "${bw_base[@]}" "${sweep[@]}" --reg-bytes 0 --json "${extra[@]}" \
		>"$out/bandwidth.json" 2>>"$out/bandwidth.err" || fail "bandwidth --json"
}

# check_ratios NAME TABLE VERDICT_BELOW
#   For every row of a kvtier-bench bandwidth table with pages >= 64 KiB and
#   depth > 1: PASS when save and load are both >= 0.95 x the ceiling, else
#   VERDICT_BELOW (MISS: recorded; FAIL: recorded and fails the run).
check_ratios() {
	local name=$1 table=$2 below=$3
	[ -f "$table" ] || return 0
	awk -v f="$name" -v below="$below" '
	function bytes(s,   n) { n = s + 0; if (s ~ /K$/) n *= 1024; else if (s ~ /M$/) n *= 1048576;
		else if (s ~ /G$/) n *= 1073741824; return n }
	$7 == "|" && $1 != "layout" && bytes($4) >= 65536 && $5 > 1 {
		save = $10; load = $16
		printf "%s %s ranks=%s chunk=%s page=%s depth=%s save/ceil=%.2f load/ceil=%.2f\n",
			(save >= 0.95 && load >= 0.95) ? "PASS" : below, f, $2, $3, $4, $5, save, load
	}' "$table" | while read -r verdict rest; do
		rec "$verdict" "target 0.95: $rest"
		[ "$verdict" = FAIL ] && echo 1 >"$out/.ratio_failed"
	done
	if [ -f "$out/.ratio_failed" ]; then
		rm -f "$out/.ratio_failed"
		status=1
	fi
}
