/* fuzz_trace.c - kvtier-bench replay's trace reader (bench/trace.c) on
 * arbitrary bytes: it returns 0 or an error, never crashes, and a request
 * it accepted indexes only chunks it recorded. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "trace.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct trace t;
	int r;

	trace_quiet = 1; /* a message per bad line: not wanted 10^6 times */
	r = trace_parse((const char *)data, size, 0, &t);
	if (r == 0) {
		for (uint32_t q = 0; q < t.n_req; q++)
			if (t.off[q] > t.off[q + 1] || t.off[q + 1] > t.n_chunks)
				abort();
		for (uint64_t i = 0; i < t.n_chunks; i++)
			if (t.ids[i] >= t.n_ids)
				abort();
	}
	trace_free(&t);
	return 0;
}
