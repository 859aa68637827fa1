/* fuzz_env.c - the KVTIER_* parser (tier/config.c).  The input is lines
 * NAME=VALUE; names of KVTIER_* variables are set (every other one is
 * left alone), the rest of the environment is cleared of KVTIER_*, then
 * kvt_tier_env_resolve runs with config fields set or not by the first
 * byte.  It must return 0 with values in range, or an error whose message
 * names a variable or a config field. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvtier.h"
#include "kvt_config.h"

static const char *const vars[] = {
	"KVTIER_SEGMENT", "KVTIER_SEGMENT_DIR", "KVTIER_MODEL", "KVTIER_ROLE",
	"KVTIER_INSTANCE", "KVTIER_WORLD", "KVTIER_RANK", "KVTIER_CHUNK_TOKENS",
	"KVTIER_MAX_INFLIGHT", "KVTIER_COPY_THREADS", "KVTIER_COPY_KERNEL",
	"KVTIER_COPY_KERNEL_CTAS", "KVTIER_REGISTER", "KVTIER_REGISTER_PIECE", "KVTIER_CLOSE_TIMEOUT", "KVTIER_INSTANCES", "KVTIER_DMA",
	"KVTIER_NUMA_NODES", "KVTIER_NUMA_FALLBACK", "KVTIER_LOG_LEVEL", "KVTIER_TIER_GIB",
	"KVTIER_HUGEPAGES",
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct kvt_config cfg;
	struct kvt_tier_env env;
	char err[512], *buf = malloc(size + 1), *save = NULL;
	int r;

	if (!buf)
		return 0;
	for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
		unsetenv(vars[i]);
	memcpy(buf, data, size);
	buf[size] = 0;
	memset(&cfg, 0, sizeof(cfg));
	cfg.size = sizeof(cfg);
	cfg.instance = -1;
	cfg.rank = -1;
	if (size && (data[0] & 1))
		cfg.world = 4;
	if (size && (data[0] & 2))
		cfg.rank = 1;
	if (size && (data[0] & 4))
		cfg.role = KVT_TIER_SCHEDULER;
	for (char *l = strtok_r(buf + (size ? 1 : 0), "\n", &save); l;
	     l = strtok_r(NULL, "\n", &save)) {
		char *eq = strchr(l, '=');
		if (!eq)
			continue;
		*eq = 0;
		for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
			if (!strcmp(l, vars[i]))
				setenv(l, eq + 1, 1);
	}
	err[0] = 0;
	r = kvt_tier_env_resolve(&cfg, &env, err, sizeof(err));
	if (r == 0) {
		if ((env.role == KVT_TIER_RANK && (!env.world || env.rank >= env.world)) ||
		    !env.chunk_tokens || !env.max_inflight || !env.n_instances ||
		    env.copy_threads > 64 || !env.segment[0])
			abort();
	} else if (!strstr(err, "KVTIER_") && !strstr(err, "config")) {
		abort(); /* an error that names nothing */
	}
	free(buf);
	return 0;
}
