/* fuzz_hfconfig.c - the config.json reader (numa/hf_config.c) and the
 * sizing rules on whatever model it accepts (numa/sizing.c, kvtier-size):
 * an error or a plan whose figures are consistent, never a crash, a
 * division by zero or a wrapped size. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvt_size.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static const uint32_t tps[] = { 1, 2, 8, 64 };
	struct kvt_model m;
	char *buf = malloc(size + 1);

	if (!buf)
		return 0;
	memcpy(buf, data, size);
	buf[size] = 0;
	if (kvt_model_parse(buf, "fuzz", &m) == 0) {
		for (size_t i = 0; i < sizeof(tps) / sizeof(tps[0]); i++) {
			struct kvt_size_req r;
			struct kvt_size_plan p;
			memset(&r, 0, sizeof(r));
			r.size = sizeof(r);
			r.model = &m;
			r.tp = tps[i];
			r.pp = 1;
			r.tokens = size ? (uint64_t)data[0] << 20 | 1 : 1;
			if (kvt_size_compute(&r, &p) == 0) {
				/* a plan: the figures the library would take */
				if (!p.chunk_bytes_rank || p.chunk_bytes_all < p.chunk_bytes_rank ||
				    !p.groups[0].bytes_per_token ||
				    p.groups[0].bytes_per_token > (1u << 20))
					abort();
			}
		}
	}
	free(buf);
	return 0;
}
