/* lmc.h - kvtierd's LMCache front end: the multiprocess protocol of
 * `lmcache server` (LMCache 0.5.6, ZeroMQ) in front of the node's segment,
 * so that engines whose LMCache client speaks it (vLLM's
 * LMCacheMPConnector, SGLang's and ATOM's lmcache_mp) use kvtier
 * unchanged.  See lmc.c's design comment. */
#ifndef KVTD_LMC_H
#define KVTD_LMC_H

#include <stdint.h>

typedef struct lmc_front lmc_front;

struct lmc_cfg {
	const char *addr;          /* the ZeroMQ endpoint's address ("127.0.0.1") */
	uint16_t port;
	const char *segment, *segment_dir, *model; /* as kvtierd opened it */
	int group;                 /* kvtierd --group: the segment's mode 0660 */
	void (*log)(int level, const char *msg, void *arg); /* KVT_LOG_LEVEL_* */
	void *log_arg;
};

/* Opens the front end's handles on the segment, binds the endpoint and
 * starts its thread.  0 and *out, or a negative errno with a sentence in
 * err (the endpoint in use, a bad address). */
int lmc_start(const struct lmc_cfg *cfg, lmc_front **out, char *err, size_t err_len);

/* Stops the thread: the copies in flight finish, every lease it holds is
 * released, every client's memory unmapped.  NULL is ignored. */
void lmc_stop(lmc_front *f);

struct lmc_counts {
	uint64_t requests, refused, registrations, lookups, lookup_hit_chunks;
	uint64_t stored_chunks, retrieved_chunks, retrieve_misses, disconnects;
	uint32_t clients, sessions, leases;
};
/* Thread-safe snapshot. */
void lmc_counts(lmc_front *f, struct lmc_counts *c);

#endif
