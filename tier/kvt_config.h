/* kvt_config.h - resolution of struct kvt_config against KVTIER_* variables
 * (strictly validated) and defaults.  Internal to tier/. */
#ifndef KVT_CONFIG_H
#define KVT_CONFIG_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "kvtier.h"

struct kvt_tier_env {
	char segment[72];
	char segment_dir[PATH_MAX];
	char model[1024]; /* KVT_MODEL_TEXT_MAX: the segment header keeps as much */
	char dma[8];
	char numa_nodes[128];
	uint32_t role, instance, rank, world;
	uint32_t chunk_tokens, max_inflight, n_instances, log_level;
	uint32_t copy_threads;   /* KVTIER_COPY_THREADS; 0: sized by the backend */
	uint64_t copy_kernel;    /* KVTIER_COPY_KERNEL: 0 auto, UINT64_MAX off, else the
				  * page size below which cuda's copy kernel copies */
	uint32_t copy_kernel_ctas; /* KVTIER_COPY_KERNEL_CTAS; 0: the backend's default */
	uint32_t close_timeout_s;  /* KVTIER_CLOSE_TIMEOUT: kvt_close's wait for copies */
	uint32_t register_bg;      /* KVTIER_REGISTER: 1 background (default), 0 foreground */
	uint64_t register_piece;   /* KVTIER_REGISTER_PIECE: bytes a piece (1 GiB) */
	uint32_t test_dma_fault; /* KVTIER_TEST_DMA_FAULT: testing, host backend: the
				  * nth copy ticket this rank submits fails (0: none) */
	uint32_t numa_fallback;
	uint32_t witness;        /* KVTIER_WITNESS: 1 on (default), 0 off */
	uint64_t tier_bytes;
	void (*log)(void *log_arg, int level, const char *msg); /* config.log */
	void *log_arg;
};

enum { KVT_LOG_ERROR = 0, KVT_LOG_WARN = 1, KVT_LOG_INFO = 2, KVT_LOG_DEBUG = 3 };

/* Fills *env from cfg, then the environment (unless KVT_F_NO_ENV), then
 * defaults.  0, or -EINVAL with a message naming the option or variable
 * and what was expected. */
int kvt_tier_env_resolve(const struct kvt_config *cfg, struct kvt_tier_env *env,
			 char *err, size_t len);

/* Strict parsers (exposed for the tests). */
int kvt_parse_u32(const char *what, const char *s, uint32_t min, uint32_t max,
		  uint32_t *out, char *err, size_t len);
int kvt_parse_gib(const char *what, const char *s, uint64_t *bytes, char *err, size_t len);
int kvt_parse_kernel(const char *what, const char *s, uint64_t *below, char *err, size_t len);
int kvt_parse_nodes(const char *what, const char *s, char *err, size_t len);

#endif
