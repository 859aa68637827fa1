#!/usr/bin/env bash
# kvtier-bench replay's trace reader (json-c, strict, one object a line):
# malformed JSON is refused with the line and the reason, valid JSON the old
# hand-written reader refused (escaped quotes in keys, nested values) is read.
# Usage: replay_input.sh KVTIER_BENCH
set -u
bench=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail=0

expect() {  # expect ok|bad PATTERN LINE...
	local want=$1 pat=$2; shift 2
	printf '%s\n' "$@" > "$dir/t.jsonl"
	out=$("$bench" replay --capacity 4 "$dir/t.jsonl" 2>&1); rc=$?
	if [ "$want" = ok ] && [ $rc -ne 0 ]; then
		echo "FAIL: refused valid input ($*): $out"; fail=1
	elif [ "$want" = bad ] && [ $rc -eq 0 ]; then
		echo "FAIL: accepted bad input ($*)"; fail=1
	elif ! grep -q -- "$pat" <<<"$out"; then
		echo "FAIL: ($*): no '$pat' in: $out"; fail=1
	else
		echo "ok: $want $*"
	fi
}

expect bad 'line 1: not a trace record' '{"hash_ids": [1,2,]}'
expect bad 'line 2: not a trace record' '{"hash_ids": [1]}' '{"hash_ids": [1,2]},'
expect bad 'bytes after\|unexpected' '{"hash_ids": [1,2]} {"x": 1}'
expect bad 'non-negative integer' '{"hash_ids": [1,-2]}'
expect bad 'non-negative integer' '{"hash_ids": [1.5]}'
expect bad 'non-negative integer' '{"hash_ids": ["7"]}'
expect bad 'not a JSON object' '[1,2]'
expect bad 'no "hash_ids" array' '{"hash_ids": 3}'
expect bad 'not a JSON object' 'null'
expect bad '2^64 - 1 or more' '{"hash_ids": [1, 99999999999999999999999]}'
expect bad 'does not end on this line\|unexpected' '{"hash_ids": [1,'
expect bad 'timestamp is not' '{"timestamp": -1, "hash_ids": [1]}'
expect bad 'timestamp is not' '{"timestamp": "5", "hash_ids": [1]}'
expect bad 'timestamp is not' '{"timestamp": 1.5, "hash_ids": [1]}'
expect ok '1 requests' '{"timestamp": 27482, "hash_ids": [1, 2]}'
expect ok '1 requests' '{"a\"b": 1, "n": {"x": [1, {"y": "}"}]}, "hash_ids": [1, 2]}'
expect ok '2 requests' '{"hash_ids": [1, 2]}' '' '{"hash_ids": [1, 3]}'
# a NUL byte inside a line: printf writes it
printf '{"hash_ids": [1]}\0junk\n' > "$dir/t.jsonl"
if "$bench" replay --capacity 4 "$dir/t.jsonl" 2>&1 | grep -q 'a NUL byte'; then
	echo "ok: bad NUL"
else
	echo "FAIL: a NUL byte was not refused"; fail=1
fi
exit $fail
