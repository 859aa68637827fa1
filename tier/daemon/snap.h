/* snap.h - a snapshot of a live segment and its renderings (Prometheus
 * text, JSON, the kvtier-stat screen), shared by kvtierd and kvtier-stat.
 *
 * A snapshot is read from an observer handle (no table entry: reading
 * never changes the segment).  Every value is a racy read of words that
 * their writers update with relaxed stores: each word is exact, the set
 * of them is not one instant.  Entry fields are bounds-checked by core
 * (kvt_seg_entry_info); a corrupt entry is reported as such, never
 * interpreted.
 */
#ifndef KVTD_SNAP_H
#define KVTD_SNAP_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvt_core.h"
#include "kvt_l3_chan.h"

struct kvtd_entry {
	struct kvt_entry_info info;
	uint64_t ctr[KVT_C__COUNT];
	int bad;                       /* -EUCLEAN from core: state word corrupt */
	int stopped;                   /* attached, alive, and stopped or frozen */
};

/* Per engine instance: its ranks' and its scheduler's counters summed. */
struct kvtd_inst {
	uint64_t lookups, lookup_chunks, hit_chunks, hit_tokens;
	uint64_t saved_chunks, loaded_chunks;
	uint64_t shared_hits;          /* hits on other instances' chunks */
	uint32_t ranks_up, scheduler_up;
	uint32_t write_only;           /* saves and no lookups (kvtd_write_only) */
	uint32_t unshared;             /* looks up, finds none of others' (kvtd_unshared) */
};

struct kvtd_snap {
	char name[KVT_NAME_MAX + 1];
	uint64_t mono_ns, wall_ns;
	struct kvt_geometry geo;
	uint32_t n_shards, n_entries;
	uint64_t shard_bytes, chunk_bytes, segment_bytes;
	struct kvt_occupancy occ;
	uint64_t ctr[KVT_C__COUNT];
	struct kvt_hist_snap hist[KVT_H__COUNT];
	struct kvtd_entry *ents;       /* n_entries */
	struct kvtd_inst inst[KVT_MAX_INSTANCES];
	int owner_pid;                 /* 0: no live owner */
	int draining;
	int has_disk;                  /* the segment has a disk tier's index */
	struct kvt_disk_status disk;   /* its engine's status (has_disk) */
};

/* The daemon's view, added to what the segment says. */
struct kvtd_ctx {
	const char *version;
	const char *model;             /* the model string, when known */
	uint32_t expect_instances;     /* instances whose ranks health requires */
	uint32_t expect_schedulers;    /* 1: their schedulers too */
	uint64_t start_wall_ns;        /* the daemon's start (0: not a daemon) */
	int draining;
	const uint32_t *write_only_window; /* per instance, from the daemon's
					    * history: KVTD_V_* bits; NULL:
					    * totals only */
	/* the daemon's exit witness (core/witness_srv.c) */
	int witness_up;                /* its socket listens */
	uint32_t witness_ranks;        /* ranks whose lock it holds now */
	uint64_t witness_exited, witness_byes, witness_refused;
	/* the L3 tier (tier/l3/kvt_l3_chan.h), copied by the daemon's loop, or
	 * asked of it (kvtier-stat) */
	int l3_on;
	struct kvt_l3c_status l3;
	/* the LMCache front end (--lmcache-port): /healthcheck then answers in
	 * LMCache's form, {"status":"healthy"} */
	int lmcache_form;
	int lmcache_up;                /* its endpoint is bound and served */
	struct kvtd_lmc {              /* its counters (lmc.h's lmc_counts) */
		uint64_t requests, refused, registrations, lookups, hit_chunks;
		uint64_t stored, retrieved, misses, disconnects;
		uint32_t clients, sessions, leases;
	} lmc;
};

int kvtd_snap_read(kvt_seg *s, struct kvtd_snap *out);
void kvtd_snap_free(struct kvtd_snap *s);

/* Write-only instances.  Totals: ranks saved chunks and its scheduler made
 * no lookup since creation.  Window (old != NULL): in the interval from
 * old to now its ranks saved and its scheduler made no lookup. */
void kvtd_write_only(struct kvtd_snap *now, const struct kvtd_snap *old,
		     uint32_t out[KVT_MAX_INSTANCES]);

/* The windowed verdicts' bits (kvtd_ctx.write_only_window). */
#define KVTD_V_WRITE_ONLY 1u
#define KVTD_V_UNSHARED   2u

/* An instance's counters at one time, for the windowed verdicts. */
struct kvtd_isample {
	uint64_t saved, lookups, lookup_chunks, shared_hits;
};
#define KVTD_UNSHARED_MIN 64 /* chunks looked up, and shards others saved */
/* Unshared instances: with two instances or more, instance i looked up at
 * least KVTD_UNSHARED_MIN chunks while the others saved at least as many
 * chunk shards, and it hit none of theirs -- engines that should share a
 * prefix cache and do not: another hash seed or salt on one side, a
 * LoRA or multimodal extra key, or prompts that do not overlap.  Since
 * creation (old == NULL) or since old (per instance). */
void kvtd_unshared(const struct kvtd_snap *now, const struct kvtd_isample *old,
		   uint32_t out[KVT_MAX_INSTANCES]);
void kvtd_isample(const struct kvtd_snap *s, struct kvtd_isample out[KVT_MAX_INSTANCES]);

/* Health: 1 when every expected rank (and scheduler, if asked) is attached
 * and alive and the segment is not draining; writes a JSON body. */
int kvtd_health(const struct kvtd_snap *s, const struct kvtd_ctx *c, char **json);

/* Renderings; each returns a malloc'd string (NULL: out of memory). */
char *kvtd_prometheus(const struct kvtd_snap *s, const struct kvtd_ctx *c);
char *kvtd_json(const struct kvtd_snap *s, const struct kvtd_ctx *c,
		const struct kvtd_snap *prev);
/* The kvtier-stat screen; prev (may be NULL) gives rates. */
char *kvtd_screen(const struct kvtd_snap *s, const struct kvtd_ctx *c,
		  const struct kvtd_snap *prev, int width);

/* Latency quantile q (0..1) of a histogram, in ns (interpolated within
 * its bucket); 0 when empty. */
double kvtd_hist_quantile(const struct kvt_hist_snap *h, double q);

/* A growing string. */
struct kvtd_buf {
	char *p;
	size_t len, cap;
	int oom;
};
void kvtd_printf(struct kvtd_buf *b, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

#endif
