/* config.c - KVTIER_* environment variables, strictly validated.
 *
 * Precedence: a field set in struct kvt_config, else its variable (unless
 * KVT_F_NO_ENV), else the default.  A variable that is set but malformed
 * or out of range is an error naming it and what was expected -- never a
 * silent default: a rank that falls back to world=1 would write a tier
 * that lookups never read.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt_config.h"
#include "kvt_core.h"

#define EXPECT(...) (snprintf(err, len, __VA_ARGS__), -EINVAL)

int kvt_parse_u32(const char *what, const char *s, uint32_t min, uint32_t max,
		  uint32_t *out, char *err, size_t len)
{
	uint64_t v = 0;
	const char *p = s;

	if (!*p)
		return EXPECT("%s is empty: expected an integer in %u..%u", what, min, max);
	for (; *p; p++) {
		if (*p < '0' || *p > '9')
			return EXPECT("%s='%.40s': expected an integer in %u..%u", what, s, min, max);
		v = v * 10 + (uint64_t)(*p - '0');
		if (v > UINT32_MAX)
			return EXPECT("%s='%.40s': out of range %u..%u", what, s, min, max);
	}
	if (v < min || v > max)
		return EXPECT("%s=%llu: out of range %u..%u", what, (unsigned long long)v, min, max);
	*out = (uint32_t)v;
	return 0;
}

int kvt_parse_gib(const char *what, const char *s, uint64_t *bytes, char *err, size_t len)
{
	uint64_t whole = 0, frac = 0, scale = 1;
	const char *p = s;
	int digits = 0;

	for (; *p >= '0' && *p <= '9'; p++, digits++) {
		whole = whole * 10 + (uint64_t)(*p - '0');
		if (whole > (1u << 20))
			return EXPECT("%s='%.40s': more than 1048576 GiB", what, s);
	}
	if (*p == '.') {
		for (p++; *p >= '0' && *p <= '9'; p++, digits++)
			if (scale < 1000000000ULL) {
				frac = frac * 10 + (uint64_t)(*p - '0');
				scale *= 10;
			}
	}
	if (*p || !digits)
		return EXPECT("%s='%.40s': expected a size in GiB such as 64 or 0.5", what, s);
	*bytes = (whole << 30) + (frac << 30) / scale;
	if (*bytes == 0)
		return EXPECT("%s='%.40s': must be more than 0", what, s);
	return 0;
}

/* A size in bytes with an optional K, M or G (binary) suffix, in
 * [1, max]: 0, or -ENOENT (not a size) */
static int parse_size(const char *s, uint64_t max, uint64_t *out)
{
	uint64_t v = 0;
	const char *p = s;

	for (; *p >= '0' && *p <= '9' && v <= max; p++)
		v = v * 10 + (uint64_t)(*p - '0');
	if (p != s && (*p == 'K' || *p == 'k'))
		v <<= 10, p++;
	else if (p != s && (*p == 'M' || *p == 'm'))
		v <<= 20, p++;
	else if (p != s && (*p == 'G' || *p == 'g'))
		v <<= 30, p++;
	if (p == s || *p || !v || v > max)
		return -ENOENT;
	*out = v;
	return 0;
}

int kvt_parse_kernel(const char *what, const char *s, uint64_t *below, char *err, size_t len)
{
	if (!strcmp(s, "auto")) {
		*below = 0;
		return 0;
	}
	if (!strcmp(s, "off")) {
		*below = UINT64_MAX;
		return 0;
	}
	if (parse_size(s, 1u << 30, below))
		return EXPECT("%s='%.40s': expected auto, off, or a page size from 1 to 1G "
			      "such as 28K (pages below it are copied by the GPU's copy kernel)",
			      what, s);
	return 0;
}

int kvt_parse_nodes(const char *what, const char *s, char *err, size_t len)
{
	const char *p = s;

	if (!*p)
		return EXPECT("%s is empty: expected NUMA nodes such as 0 or 0,1 or 0-3", what);
	while (*p) {
		unsigned a = 0, b;
		int n = 0;
		while (*p >= '0' && *p <= '9' && n < 5)
			a = a * 10 + (unsigned)(*p++ - '0'), n++;
		if (!n || a > 1023)
			return EXPECT("%s='%.60s': expected NUMA nodes such as 0 or 0,1 or 0-3", what, s);
		b = a;
		if (*p == '-') {
			p++;
			b = 0;
			n = 0;
			while (*p >= '0' && *p <= '9' && n < 5)
				b = b * 10 + (unsigned)(*p++ - '0'), n++;
			if (!n || b > 1023 || b < a)
				return EXPECT("%s='%.60s': bad range", what, s);
		}
		if (*p == ',' && p[1])
			p++;
		else if (*p)
			return EXPECT("%s='%.60s': expected NUMA nodes such as 0 or 0,1 or 0-3", what, s);
	}
	return 0;
}

static const char *var(const struct kvt_config *cfg, const char *name)
{
	const char *v;

	if (cfg->flags & KVT_F_NO_ENV)
		return NULL;
	v = getenv(name);
	return v;
}

static int copy_str(char *dst, size_t cap, const char *what, const char *s, char *err, size_t len)
{
	if (strlen(s) >= cap)
		return EXPECT("%s: longer than %zu characters", what, cap - 1);
	memcpy(dst, s, strlen(s) + 1);
	return 0;
}

/* Resolves one u32: cfg value when `set`, else the variable, else def. */
static int pick_u32(const struct kvt_config *cfg, int set, uint32_t cfgv, const char *name,
		    uint32_t min, uint32_t max, uint32_t def, uint32_t *out, char *err, size_t len)
{
	const char *v;

	if (set) {
		if (cfgv < min || cfgv > max)
			return EXPECT("config value for %s: %u out of range %u..%u", name, cfgv, min, max);
		*out = cfgv;
		return 0;
	}
	v = var(cfg, name);
	if (!v) {
		*out = def;
		return 0;
	}
	return kvt_parse_u32(name, v, min, max, out, err, len);
}

int kvt_tier_env_resolve(const struct kvt_config *cfg, struct kvt_tier_env *e,
			 char *err, size_t len)
{
	const char *v;
	int r;

	memset(e, 0, sizeof(*e));
	/* segment name */
	v = cfg->segment ? cfg->segment : var(cfg, "KVTIER_SEGMENT");
	if (!v)
		v = "kvtier";
	if (kvt_seg_name_valid(v))
		return EXPECT("%s='%.80s': a segment name is 1..64 of [A-Za-z0-9._-] (not a path)",
			      cfg->segment ? "config.segment" : "KVTIER_SEGMENT", v);
	if ((r = copy_str(e->segment, sizeof(e->segment), "KVTIER_SEGMENT", v, err, len)))
		return r;
	v = cfg->segment_dir ? cfg->segment_dir : var(cfg, "KVTIER_SEGMENT_DIR");
	if (v) {
		if (v[0] != '/')
			return EXPECT("KVTIER_SEGMENT_DIR='%.80s': expected an absolute directory "
				      "(a hugetlbfs mount)", v);
		if ((r = copy_str(e->segment_dir, sizeof(e->segment_dir), "KVTIER_SEGMENT_DIR", v, err, len)))
			return r;
	}
	v = cfg->model ? cfg->model : var(cfg, "KVTIER_MODEL");
	if ((r = copy_str(e->model, sizeof(e->model), "KVTIER_MODEL", v ? v : "", err, len)))
		return r;
	/* role */
	if (cfg->role) {
		if (cfg->role > KVT_TIER_CLIENT)
			return EXPECT("config.role: %u is not rank (1), scheduler (2) or client (3)", cfg->role);
		e->role = cfg->role;
	} else if ((v = var(cfg, "KVTIER_ROLE"))) {
		if (!strcmp(v, "rank"))
			e->role = KVT_TIER_RANK;
		else if (!strcmp(v, "scheduler"))
			e->role = KVT_TIER_SCHEDULER;
		else if (!strcmp(v, "client"))
			e->role = KVT_TIER_CLIENT;
		else
			return EXPECT("KVTIER_ROLE='%.40s': expected rank, scheduler or client", v);
	} else {
		e->role = KVT_TIER_RANK;
	}
	if ((r = pick_u32(cfg, cfg->instance >= 0, (uint32_t)cfg->instance, "KVTIER_INSTANCE",
			  0, KVT_MAX_INSTANCES - 1, 0, &e->instance, err, len)))
		return r;
	if ((r = pick_u32(cfg, cfg->world != 0, cfg->world, "KVTIER_WORLD", 1, KVT_MAX_WORLD,
			  0, &e->world, err, len)))
		return r;
	if ((r = pick_u32(cfg, cfg->rank >= 0, (uint32_t)cfg->rank, "KVTIER_RANK", 0,
			  KVT_MAX_WORLD - 1, UINT32_MAX, &e->rank, err, len)))
		return r;
	if (e->role == KVT_TIER_RANK) {
		if (e->rank == UINT32_MAX)
			return EXPECT("KVTIER_RANK: a rank must say which rank it is (config.rank or KVTIER_RANK)");
		if (!e->world)
			return EXPECT("KVTIER_WORLD: a rank must say its world size (config.world or KVTIER_WORLD)");
		if (e->rank >= e->world)
			return EXPECT("KVTIER_RANK=%u: out of range for world=%u", e->rank, e->world);
	} else if (e->rank == UINT32_MAX) {
		e->rank = 0;
	}
	if ((r = pick_u32(cfg, cfg->chunk_tokens != 0, cfg->chunk_tokens, "KVTIER_CHUNK_TOKENS",
			  1, 1u << 20, 256, &e->chunk_tokens, err, len)))
		return r;
	if ((r = pick_u32(cfg, cfg->max_inflight != 0, cfg->max_inflight, "KVTIER_MAX_INFLIGHT",
			  1, 4096, 32, &e->max_inflight, err, len)))
		return r;
	if ((r = pick_u32(cfg, 0, 0, "KVTIER_COPY_THREADS", 1, 64, 0, &e->copy_threads, err, len)))
		return r;
	/* cuda's copy kernel: auto (its default crossover), off, or a size */
	e->copy_kernel = 0;
	if ((v = var(cfg, "KVTIER_COPY_KERNEL")) &&
	    (r = kvt_parse_kernel("KVTIER_COPY_KERNEL", v, &e->copy_kernel, err, len)))
		return r;
	if ((r = pick_u32(cfg, 0, 0, "KVTIER_COPY_KERNEL_CTAS", 1, 1024, 0, &e->copy_kernel_ctas,
			  err, len)))
		return r;
	/* the arena's registration (register_kv): in the background after its
	 * first piece, or all of it before register_kv returns; its pieces */
	e->register_bg = 1;
	if ((v = var(cfg, "KVTIER_REGISTER"))) {
		if (!strcmp(v, "background"))
			e->register_bg = 1;
		else if (!strcmp(v, "foreground"))
			e->register_bg = 0;
		else
			return EXPECT("KVTIER_REGISTER='%.40s': expected background or foreground",
				      v);
	}
	e->register_piece = 1ull << 30;
	if ((v = var(cfg, "KVTIER_REGISTER_PIECE")) &&
	    parse_size(v, 64ull << 30, &e->register_piece))
		return EXPECT("KVTIER_REGISTER_PIECE='%.40s': expected a size from 1 to 64G "
			      "such as 1G or 256M (rounded down to whole sub-slots, at least one)",
			      v);
	/* kvt_close's wait for copies in flight, in seconds (see kvt_close) */
	if ((r = pick_u32(cfg, 0, 0, "KVTIER_CLOSE_TIMEOUT", 1, 86400, 60, &e->close_timeout_s,
			  err, len)))
		return r;
	if ((r = pick_u32(cfg, 0, 0, "KVTIER_TEST_DMA_FAULT", 1, UINT32_MAX, 0, &e->test_dma_fault,
			  err, len)))
		return r;
	if ((r = pick_u32(cfg, cfg->n_instances != 0, cfg->n_instances, "KVTIER_INSTANCES",
			  1, KVT_MAX_INSTANCES, 1, &e->n_instances, err, len)))
		return r;
	/* DMA backend */
	v = cfg->dma ? cfg->dma : var(cfg, "KVTIER_DMA");
	if (!v)
		v = "auto";
	if (strcmp(v, "auto") && strcmp(v, "hsa") && strcmp(v, "cuda") && strcmp(v, "host"))
		return EXPECT("%s='%.40s': expected auto, hsa, cuda or host",
			      cfg->dma ? "config.dma" : "KVTIER_DMA", v);
	memcpy(e->dma, v, strlen(v) + 1);
	/* NUMA nodes: syntax here, placement in numa/ */
	if ((v = var(cfg, "KVTIER_NUMA_NODES"))) {
		if ((r = kvt_parse_nodes("KVTIER_NUMA_NODES", v, err, len)))
			return r;
		if ((r = copy_str(e->numa_nodes, sizeof(e->numa_nodes), "KVTIER_NUMA_NODES", v, err, len)))
			return r;
	}
	if ((v = var(cfg, "KVTIER_NUMA_FALLBACK")) &&
	    (r = kvt_parse_u32("KVTIER_NUMA_FALLBACK", v, 0, 1, &e->numa_fallback, err, len)))
		return r;
	/* read by numa/bind.c's prefault itself; refused here when bad */
	if ((v = var(cfg, "KVTIER_PREFAULT_THREADS"))) {
		uint32_t t;
		if ((r = kvt_parse_u32("KVTIER_PREFAULT_THREADS", v, 1, 64, &t, err, len)))
			return r;
	}
	e->witness = 1;
	if ((v = var(cfg, "KVTIER_WITNESS"))) {
		if (!strcmp(v, "on"))
			e->witness = 1;
		else if (!strcmp(v, "off"))
			e->witness = 0;
		else
			return EXPECT("KVTIER_WITNESS='%.40s': expected on or off", v);
	}
	if ((v = var(cfg, "KVTIER_LOG_LEVEL"))) {
		static const char *const lv[] = { "error", "warn", "info", "debug" };
		uint32_t i;
		for (i = 0; i < 4 && strcmp(v, lv[i]); i++)
			;
		if (i == 4)
			return EXPECT("KVTIER_LOG_LEVEL='%.40s': expected error, warn, info or debug", v);
		e->log_level = i;
	} else {
		e->log_level = KVT_LOG_INFO;
	}
	e->log = cfg->log;
	e->log_arg = cfg->log_arg;
	if (cfg->tier_bytes) {
		e->tier_bytes = cfg->tier_bytes;
	} else if ((v = var(cfg, "KVTIER_TIER_GIB"))) {
		if ((r = kvt_parse_gib("KVTIER_TIER_GIB", v, &e->tier_bytes, err, len)))
			return r;
	} else {
		e->tier_bytes = 1ULL << 30;
	}
	return 0;
}
