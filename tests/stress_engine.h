/* stress_engine.h - the engine of the multi-process stress and crash tests:
 * rank writers and a scheduler working one segment, every payload stamped
 * with (key, shard, generation) and checked on every pinned read.
 *
 * Workers (processes, or threads in the TSan variant):
 *
 *   rank r (0 .. world-1)  a RANK handle (instance 0, rank r) that saves
 *                          shard r of a sequence of prompts that all ranks
 *                          follow, and loads the leases the scheduler
 *                          publishes; plus a CLIENT handle of its own
 *                          instance r+1 for lookups of its own, which it
 *                          releases, loads for every rank, releases twice,
 *                          or abandons to its own kvt_seg_step.
 *   scheduler (id world)   a SCHEDULER handle (instance 0): looks prompts
 *                          up, publishes the leases in a mailbox for the
 *                          ranks to load, steps with the published leases
 *                          as its live set, and drops a published lease
 *                          from that set after `expire_steps` steps (its
 *                          step then releases it as stale).
 *
 * Each instance has exactly one stepper, so a lease is only ever released
 * by its holder's decision: a pinned read can never race a release, and a
 * stamp that does not match is corruption.  Published leases are read
 * under a reader mask in the mailbox entry: the scheduler drops a lease
 * from its live set only when no rank is reading it (one CAS on one word
 * decides), so reads of published leases cannot race a release either,
 * and the thread variant is free of data races by construction — what
 * TSan reports there is the segment's fault.
 *
 * In crash mode processes die and the reaper releases leases under their
 * readers (the leases of a dead builder, those waiting for a dead rank):
 * a mismatch then counts as corruption only if the lease is still live
 * after the read; otherwise the read raced a release and is discarded.
 *
 * The stamp of a shard (shard_bytes / 8 words): key lo, key hi,
 * rank << 32 | shard, the slot generation the writer got, then a filler
 * derived from all of them.  Aborted writes scribble garbage instead, which
 * must never be served.
 */
#ifndef STRESS_ENGINE_H
#define STRESS_ENGINE_H

#include "kvt_clock.h"
#include "kvt_mix.h"
#include "safe_kill.h"
#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvt_core.h"
#include "kvt_format.h" /* se_share_mapping() only: see there */

#define SE_CPP       8u   /* chunks per prompt; depth = chunk index */
#define SE_BOX       8u   /* mailbox entries (published leases) */
#define SE_MAX_WORLD 6u
#define SE_KEY_HI    0x5354524553530000ULL
#define SE_STORM       32u   /* scheduler: iterations a pin storm takes pins */
#define SE_STORM_HOLD  128u  /* ... and holds them */
#define SE_STORM_EVERY 1024u /* ... once every so many iterations */
#define SE_STORM_MAX   192u  /* leases a storm holds at most */

/* Exit statuses of worker processes. */
enum { SE_EXIT_OK = 0, SE_EXIT_BAD = 1, SE_EXIT_ERROR = 2, SE_EXIT_ATTACH = 3 };

enum se_stat {
	SE_OPS, SE_WRITES, SE_SAVED, SE_MADE_READY, SE_WRITE_ABORTS, SE_WRITE_SKIP,
	SE_WRITE_NOSPC, SE_WRITE_STALE, SE_WRITE_AGAIN,
	SE_LOOKUPS, SE_HITS, SE_LOOKUP_NOSPC, SE_VERIFIED, SE_BAD, SE_RACED,
	SE_RELEASED, SE_EALREADY, SE_DOUBLE, SE_ABANDONED,
	SE_LOADED, SE_LOAD_RELEASED, SE_LOAD_STALE, SE_BOX_LOADS,
	SE_STEPS, SE_STALE, SE_PUBLISHED, SE_DROPPED, SE_GONE_BY_LOAD,
	SE_REAPS, SE_REAPED, SE_PROGRESS, SE_ERRORS,
	SE__N
};

static const char *const se_stat_names[SE__N] = {
	"ops", "writes", "saved", "made_ready", "write_aborts", "write_skip",
	"write_nospc", "write_stale", "write_again",
	"lookups", "hits", "lookup_nospc", "verified_chunks", "BAD", "raced",
	"released", "ealready", "double_release", "abandoned",
	"loaded", "load_released", "load_stale", "box_loads",
	"steps", "stale", "published", "dropped", "gone_by_load",
	"reaps", "reaped", "progress", "ERRORS",
};

struct se_stats {
	_Atomic uint64_t c[SE__N];
	_Atomic int have_msg;
	char msg[200];
};

/* A published lease.  ctl: bit 31 = dropped from the live set, bit 30 =
 * retired (released, the entry about to be reused), bits 0..world-1 =
 * ranks reading it.  A rank sets its bit only while neither flag is set;
 * the scheduler sets a flag only while no bit is set. */
#define SE_CTL_DROPPED 0x80000000u
#define SE_CTL_RETIRED 0x40000000u
#define SE_CTL_READERS 0x0000ffffu
struct se_box {
	_Atomic uint64_t lease;         /* 0: free */
	_Atomic uint64_t base;          /* first key index */
	_Atomic uint32_t n;             /* chunks pinned */
	_Atomic uint32_t ctl;
	_Atomic uint64_t load_released; /* id whose last load released it */
};

/* Shared by all workers (MAP_SHARED anonymous, made before fork). */
struct se_shared {
	_Atomic int stop;
	_Atomic int attached;
	_Atomic uint32_t ranks_done; /* ranks past their op count */
	_Atomic uint64_t cursor[SE_MAX_WORLD]; /* next sequence element per rank */
	struct se_box box[SE_BOX];
	struct se_stats st[SE_MAX_WORLD + 1];
};

struct se_cfg {
	const char *name;
	uint32_t world;
	uint32_t n_prompts;    /* key space: n_prompts * SE_CPP keys */
	uint64_t ops;          /* per rank; 0 = until stop */
	uint32_t expire_steps; /* 0: never drop a published lease */
	int crash;             /* releases may race reads (the reaper) */
	int sched_reaps;       /* the scheduler calls kvt_seg_reap now and then */
	uint64_t seed;
};

struct se_worker {
	const struct se_cfg *cfg;
	struct se_shared *sh;
	struct se_stats *st;
	uint32_t id;     /* rank, or world for the scheduler */
	kvt_seg *h;      /* RANK or SCHEDULER handle */
	kvt_seg *ch;     /* a rank's CLIENT handle (instance id + 1) */
	uint64_t rng;
	uint64_t sbytes;
	uint32_t nsh;
	uint64_t steps;
	uint32_t waited;           /* rank: ops skipped for being ahead */
	uint64_t done[SE_BOX];     /* rank: last published id loaded per box */
	uint64_t pub_step[SE_BOX]; /* scheduler: step of publication */
	uint32_t nstorm;           /* scheduler: leases held by a pin storm */
	uint64_t storm[SE_STORM_MAX], storm_key[SE_STORM_MAX];
};

/* ---- small helpers ---- */

static inline uint64_t se_rand(uint64_t *s)
{
	*s += 0x9e3779b97f4a7c15ULL;
	return kvt__mix64(*s);
}

static inline uint64_t se_env_u64(const char *name, uint64_t def)
{
	const char *v = getenv(name);
	char *end;
	unsigned long long x;

	if (!v || !*v)
		return def;
	x = strtoull(v, &end, 0);
	return *end ? def : (uint64_t)x;
}

static inline kvt_key se_key(uint64_t i)
{
	kvt_key k = { i, SE_KEY_HI };
	return k;
}

static inline void se_count(struct se_worker *w, enum se_stat c, uint64_t v)
{
	/* Relaxed: statistics, read by the parent after the workers stopped. */
	atomic_fetch_add_explicit(&w->st->c[c], v, memory_order_relaxed);
}

static inline void se_msg(struct se_stats *st, const char *fmt, va_list ap)
{
	int expect = 0;

	if (atomic_compare_exchange_strong(&st->have_msg, &expect, 1))
		vsnprintf(st->msg, sizeof(st->msg), fmt, ap);
}

/* An unexpected API result. */
static inline __attribute__((format(printf, 2, 3)))
void se_error(struct se_worker *w, const char *fmt, ...)
{
	va_list ap;

	se_count(w, SE_ERRORS, 1);
	va_start(ap, fmt);
	se_msg(w->st, fmt, ap);
	va_end(ap);
}

/* A corrupted chunk was served. */
static inline __attribute__((format(printf, 2, 3)))
void se_bad(struct se_worker *w, const char *fmt, ...)
{
	va_list ap;

	se_count(w, SE_BAD, 1);
	va_start(ap, fmt);
	se_msg(w->st, fmt, ap);
	va_end(ap);
}

/* ---- stamps ---- */

static inline uint64_t se_fill(const kvt_key *k, uint64_t gen, uint32_t shard, uint64_t j)
{
	return kvt__mix64(k->lo * 0x9e3779b97f4a7c15ULL ^ k->hi ^ (gen << 20) ^
		      ((uint64_t)shard << 56) ^ j);
}

static inline void se_stamp(void *p, uint64_t bytes, const kvt_key *k, uint32_t rank,
			    uint32_t shard, uint64_t gen)
{
	uint64_t *q = p;

	for (uint64_t j = 4; j < bytes / 8; j++)
		q[j] = se_fill(k, gen, shard, j);
	q[0] = k->lo;
	q[1] = k->hi;
	q[2] = (uint64_t)rank << 32 | shard;
	q[3] = gen;
}

/* 0 if the shard holds the stamp of (key, shard, gen32); else 1 and why. */
static inline int se_check_shard(const void *p, uint64_t bytes, const kvt_key *k,
				 uint32_t shard, uint64_t gen32, char *why, size_t len)
{
	const uint64_t *q = p;

	if (!p) {
		snprintf(why, len, "no address for shard %u", shard);
		return 1;
	}
	if (q[0] != k->lo || q[1] != k->hi) {
		snprintf(why, len, "shard %u holds key %#" PRIx64 "/%#" PRIx64
			 " instead of %#" PRIx64 "/%#" PRIx64, shard, q[1], q[0], k->hi, k->lo);
		return 1;
	}
	if ((uint32_t)q[2] != shard) {
		snprintf(why, len, "shard %u holds the stamp of shard %u", shard,
			 (uint32_t)q[2]);
		return 1;
	}
	if ((q[3] & 0xffffffffULL) != gen32) {
		snprintf(why, len, "key %#" PRIx64 " shard %u was written in generation %"
			 PRIu64 ", the lease pinned %" PRIu64, k->lo, shard, q[3], gen32);
		return 1;
	}
	for (uint64_t j = 4; j < bytes / 8; j++)
		if (q[j] != se_fill(k, q[3], shard, j)) {
			snprintf(why, len, "key %#" PRIx64 " shard %u: word %" PRIu64
				 " is torn", k->lo, shard, j);
			return 1;
		}
	return 0;
}

/* Verifies the chunks of `lease`, which `h` looked up (or loads) for keys
 * base .. base+n-1.  0: all good; 1: the lease was released under us
 * (crash mode only); -1: corruption or an API error (counted). */
static inline int se_verify_lease(struct se_worker *w, kvt_seg *h, uint64_t lease,
				  uint64_t base, int n)
{
	uint32_t slots[SE_CPP], slots2[SE_CPP];
	uint64_t gens[SE_CPP], gens2[SE_CPP];
	char why[160] = "";
	int got, bad = 0;

	got = kvt_lease_slots(h, lease, slots, gens, SE_CPP);
	if (got == -ESTALE && w->cfg->crash) {
		se_count(w, SE_RACED, 1);
		return 1;
	}
	if (got != n) {
		se_error(w, "worker %u: kvt_lease_slots(%#" PRIx64 ") = %d, lookup hit %d: %s",
			 w->id, lease, got, n, kvt_core_last_error());
		return -1;
	}
	for (int i = 0; i < n && !bad; i++) {
		kvt_key k = se_key(base + (uint64_t)i);
		for (int j = 0; j < i; j++)
			if (slots[j] == slots[i]) {
				snprintf(why, sizeof(why), "keys %" PRIu64 " and %" PRIu64
					 " share slot %u", base + (uint64_t)j, base + (uint64_t)i,
					 slots[i]);
				bad = 1;
			}
		for (uint32_t sh = 0; sh < w->nsh && !bad; sh++)
			bad = se_check_shard(kvt_slot_shard_ptr(h, slots[i], sh), w->sbytes,
					     &k, sh, gens[i], why, sizeof(why));
	}
	if (!bad) {
		se_count(w, SE_VERIFIED, (uint64_t)n);
		return 0;
	}
	/* Was the lease live all along?  Then it pinned a bad chunk. */
	got = kvt_lease_slots(h, lease, slots2, gens2, SE_CPP);
	if (got == n && !memcmp(slots, slots2, sizeof(slots[0]) * (size_t)n) &&
	    !memcmp(gens, gens2, sizeof(gens[0]) * (size_t)n)) {
		se_bad(w, "worker %u, lease %#" PRIx64 ": %s", w->id, lease, why);
		return -1;
	}
	if (w->cfg->crash) {
		se_count(w, SE_RACED, 1);
		return 1;
	}
	se_bad(w, "worker %u, lease %#" PRIx64 " released under its reader: %s",
	       w->id, lease, why);
	return -1;
}

/* ---- what to write, what to look up ----
 *
 * The ranks save the same sequence of chunks, as an engine's ranks save the
 * same requests: element i is chunk i % SE_CPP of prompt i / SE_CPP, or,
 * one time in four, that chunk of an older prompt (mostly a dedupe skip,
 * or a refill of an evicted chunk).  Each rank walks the sequence at its
 * own pace, at most SE_LEAD elements ahead of the slowest rank still
 * working, so chunks complete instead of piling up half written; in crash
 * mode a dead rank holds nobody back for more than SE_LEAD_WAIT operations. */
#define SE_LEAD      8u
#define SE_LEAD_WAIT 64u
#define SE_DONE      UINT64_MAX
#define SE_LOOKBACK  20u /* prompts looked up: up to this far behind */

static inline uint64_t se_seq_key(const struct se_worker *w, uint64_t i, uint32_t *depth)
{
	uint64_t h = kvt__mix64(w->cfg->seed ^ (i * 0x9e3779b97f4a7c15ULL));
	uint64_t p = i / SE_CPP;

	if (h % 4 == 0 && p > 8)
		p -= 1 + (h >> 8) % 8;
	*depth = (uint32_t)(i % SE_CPP);
	return (p % w->cfg->n_prompts) * SE_CPP + *depth;
}

/* Whether this rank is too far ahead of the slowest one still working. */
static inline int se_ahead(struct se_worker *w, uint64_t mine)
{
	uint64_t lo = SE_DONE;

	for (uint32_t r = 0; r < w->cfg->world; r++) {
		uint64_t c = atomic_load_explicit(&w->sh->cursor[r], memory_order_relaxed);
		if (r != w->id && c < lo)
			lo = c;
	}
	return lo != SE_DONE && mine > lo + SE_LEAD;
}

/* A prompt to look up: the one being written or up to SE_LOOKBACK behind. */
static inline uint32_t se_lookup_prompt(struct se_worker *w)
{
	uint64_t c = SE_DONE;
	uint32_t n = w->cfg->n_prompts;

	if (w->id < w->cfg->world)
		c = atomic_load_explicit(&w->sh->cursor[w->id], memory_order_relaxed);
	if (c == SE_DONE)
		c = atomic_load_explicit(&w->sh->cursor[0], memory_order_relaxed);
	if (c == SE_DONE)
		c = 0;
	return (uint32_t)((c / SE_CPP + n * 64 - se_rand(&w->rng) % SE_LOOKBACK) % n);
}

/* ---- rank operations ---- */

/* Saves the next element of the sequence.  0, or -1 when too far ahead. */
static inline int se_rank_write(struct se_worker *w)
{
	uint64_t i = atomic_load_explicit(&w->sh->cursor[w->id], memory_order_relaxed);
	struct kvt_wref wr;
	uint32_t j;
	kvt_key k;
	int r, e, ok;
	void *ptr;

	if (se_ahead(w, i) && (!w->cfg->crash || ++w->waited < SE_LEAD_WAIT))
		return -1;
	w->waited = 0;
	k = se_key(se_seq_key(w, i, &j));
	atomic_store_explicit(&w->sh->cursor[w->id], i + 1, memory_order_relaxed);
	se_count(w, SE_WRITES, 1);
	r = kvt_write_begin(w->h, &k, j, w->id, &wr);
	if (r == KVT_SKIP) {
		se_count(w, SE_WRITE_SKIP, 1);
		return 0;
	}
	if (r == -ENOSPC) {
		se_count(w, SE_WRITE_NOSPC, 1);
		return 0;
	}
	if (r == -EAGAIN) {
		se_count(w, SE_WRITE_AGAIN, 1);
		return 0;
	}
	if (r != 0) {
		se_error(w, "rank %u: kvt_write_begin = %d: %s", w->id, r, kvt_core_last_error());
		return 0;
	}
	ptr = kvt_slot_shard_ptr(w->h, wr.slot, w->id);
	if (!ptr || wr.shard != w->id) {
		se_error(w, "rank %u: write ref slot %u shard %u has no address", w->id,
			 wr.slot, wr.shard);
		return 0;
	}
	ok = se_rand(&w->rng) % 256 != 0;
	if (ok)
		se_stamp(ptr, w->sbytes, &k, w->id, w->id, wr.gen);
	else
		memset(ptr, 0xee, (size_t)w->sbytes / 2); /* never to be served */
	e = kvt_write_end(w->h, &wr, ok);
	if (!ok) {
		se_count(w, SE_WRITE_ABORTS, 1);
		if (e != 0)
			se_error(w, "rank %u: aborting write_end = %d: %s", w->id, e,
				 kvt_core_last_error());
		return 0;
	}
	if (e == 0 || e == 1) {
		se_count(w, SE_SAVED, 1);
		se_count(w, SE_MADE_READY, (uint64_t)e);
		se_count(w, SE_PROGRESS, 1);
	} else if (e == -ESTALE) {
		se_count(w, SE_WRITE_STALE, 1);
	} else {
		se_error(w, "rank %u: kvt_write_end = %d: %s", w->id, e, kvt_core_last_error());
	}
	return 0;
}

static inline void se_release(struct se_worker *w, kvt_seg *h, uint64_t lease, int twice)
{
	int r = kvt_lease_release(h, lease);

	if (r == 0)
		se_count(w, SE_RELEASED, 1);
	else if (r == -EALREADY && w->cfg->crash)
		se_count(w, SE_EALREADY, 1); /* the reaper was first */
	else
		se_error(w, "worker %u: kvt_lease_release(%#" PRIx64 ") = %d: %s", w->id,
			 lease, r, kvt_core_last_error());
	if (!twice)
		return;
	se_count(w, SE_DOUBLE, 1);
	r = kvt_lease_release(h, lease);
	if (r == -EALREADY)
		se_count(w, SE_EALREADY, 1);
	else
		se_error(w, "worker %u: second release of %#" PRIx64 " = %d, expected "
			 "-EALREADY", w->id, lease, r);
}

/* Loads `lease` for every rank, in a random order: exactly the last one
 * releases it (its loads are this handle's to make). */
static inline void se_load_all(struct se_worker *w, kvt_seg *h, uint64_t lease)
{
	uint32_t order[SE_MAX_WORLD], n = w->cfg->world;

	for (uint32_t i = 0; i < n; i++)
		order[i] = i;
	for (uint32_t i = n - 1; i > 0; i--) {
		uint32_t j = (uint32_t)(se_rand(&w->rng) % (i + 1)), t = order[i];
		order[i] = order[j];
		order[j] = t;
	}
	for (uint32_t i = 0; i < n; i++) {
		int r = kvt_lease_loaded(h, lease, order[i]);
		se_count(w, SE_LOADED, 1);
		if (r != (i == n - 1 ? 1 : 0)) {
			se_error(w, "worker %u: kvt_lease_loaded(%#" PRIx64 ", %u) = %d as load "
				 "%u of %u", w->id, lease, order[i], r, i + 1, n);
			return;
		}
	}
	se_count(w, SE_LOAD_RELEASED, 1);
}

/* A lookup of the rank's own (instance id+1), which nobody else releases. */
static inline void se_rank_lookup(struct se_worker *w)
{
	uint64_t base = (uint64_t)se_lookup_prompt(w) * SE_CPP, lease = 0;
	uint32_t n = 1 + (uint32_t)(se_rand(&w->rng) % SE_CPP), choice;
	kvt_key keys[SE_CPP];
	int hits;

	for (uint32_t i = 0; i < n; i++)
		keys[i] = se_key(base + i);
	hits = kvt_seg_lookup(w->ch, keys, n, &lease);
	se_count(w, SE_LOOKUPS, 1);
	if (hits == -ENOSPC) {
		se_count(w, SE_LOOKUP_NOSPC, 1);
		return;
	}
	if (hits < 0 || (uint32_t)hits > n || (hits > 0) != (lease != 0)) {
		se_error(w, "rank %u: kvt_seg_lookup = %d, lease %#" PRIx64 ": %s", w->id, hits,
			 lease, kvt_core_last_error());
		return;
	}
	se_count(w, SE_HITS, (uint64_t)hits);
	if (!hits)
		return;
	(void)se_verify_lease(w, w->ch, lease, base, hits);
	choice = (uint32_t)(se_rand(&w->rng) % 100);
	if (choice < 35) {
		se_release(w, w->ch, lease, 0);
	} else if (choice < 70) {
		se_load_all(w, w->ch, lease);
	} else if (choice < 80) {
		se_release(w, w->ch, lease, 1);
	} else if (choice < 88) {
		/* a partial load, then an abort */
		int r = kvt_lease_loaded(w->ch, lease, w->id);
		se_count(w, SE_LOADED, 1);
		if (r != (w->cfg->world == 1))
			se_error(w, "rank %u: partial load = %d", w->id, r);
		if (w->cfg->world > 1)
			se_release(w, w->ch, lease, 0);
	} else {
		se_count(w, SE_ABANDONED, 1); /* for our own kvt_seg_step */
	}
}

/* Loads one published lease this rank has not loaded yet. */
static inline void se_rank_box(struct se_worker *w)
{
	uint32_t start = (uint32_t)(se_rand(&w->rng) % SE_BOX);
	uint32_t bit = 1u << w->id;

	for (uint32_t k = 0; k < SE_BOX; k++) {
		struct se_box *b = &w->sh->box[(start + k) % SE_BOX];
		/* Acquire: pairs with the scheduler's release store of the id,
		 * which follows its stores of base and n. */
		uint64_t id = atomic_load_explicit(&b->lease, memory_order_acquire);
		uint32_t c, n;
		uint64_t base;
		int r;

		if (!id || id == w->done[(start + k) % SE_BOX])
			continue;
		c = atomic_load_explicit(&b->ctl, memory_order_relaxed);
		do {
			if (c & (SE_CTL_DROPPED | SE_CTL_RETIRED))
				break;
		} while (!atomic_compare_exchange_weak(&b->ctl, &c, c | bit));
		if (c & (SE_CTL_DROPPED | SE_CTL_RETIRED))
			continue;
		/* The entry is retired only while no rank reads it: if it still
		 * holds id, base and n are id's until we clear our bit. */
		if (atomic_load(&b->lease) != id) {
			atomic_fetch_and(&b->ctl, ~bit);
			continue;
		}
		w->done[(start + k) % SE_BOX] = id;
		base = atomic_load_explicit(&b->base, memory_order_relaxed);
		n = atomic_load_explicit(&b->n, memory_order_relaxed);
		se_count(w, SE_BOX_LOADS, 1);
		if (se_verify_lease(w, w->h, id, base, (int)n) == 0) {
			r = kvt_lease_loaded(w->h, id, w->id);
			se_count(w, SE_LOADED, 1);
			if (r == 1) {
				atomic_store(&b->load_released, id);
				se_count(w, SE_LOAD_RELEASED, 1);
			} else if (r == -ESTALE && w->cfg->crash) {
				se_count(w, SE_LOAD_STALE, 1);
			} else if (r != 0) {
				se_error(w, "rank %u: kvt_lease_loaded(%#" PRIx64 ") = %d: %s",
					 w->id, id, r, kvt_core_last_error());
			}
		}
		/* Release: our reads of the payload happen before the
		 * scheduler may drop the lease. */
		atomic_fetch_and_explicit(&b->ctl, ~bit, memory_order_release);
		return;
	}
}

static inline void se_own_step(struct se_worker *w)
{
	int r = kvt_seg_step(w->ch, NULL, 0);

	if (r < 0)
		se_error(w, "rank %u: kvt_seg_step = %d: %s", w->id, r, kvt_core_last_error());
	else
		se_count(w, SE_STALE, (uint64_t)r);
	se_count(w, SE_STEPS, 1);
}

/* Whether the rank loop goes on: with an op count, until every rank has
 * done its count (so that the ranks keep saving the same chunks to the
 * end); else until stopped. */
static inline int se_rank_more(struct se_worker *w, uint64_t op)
{
	if (!w->cfg->ops)
		return !atomic_load_explicit(&w->sh->stop, memory_order_relaxed);
	if (op == w->cfg->ops)
		atomic_fetch_add(&w->sh->ranks_done, 1);
	return op < w->cfg->ops || atomic_load(&w->sh->ranks_done) < w->cfg->world;
}

static inline void se_rank_loop(struct se_worker *w)
{
	for (uint64_t op = 0; se_rank_more(w, op); op++) {
		uint32_t what = (uint32_t)(se_rand(&w->rng) % 100);

		if (what < 55 && se_rank_write(w) < 0) {
			sched_yield();
			what = 75; /* too far ahead: load instead */
		}
		if (what < 55)
			;
		else if (what < 75)
			se_rank_lookup(w);
		else
			se_rank_box(w);
		if (op % 16 == 15)
			se_own_step(w);
		se_count(w, SE_OPS, 1);
	}
	/* Hold nobody back any more. */
	atomic_store_explicit(&w->sh->cursor[w->id], SE_DONE, memory_order_relaxed);
}

/* ---- the scheduler ---- */

static inline void se_sched_poll(struct se_worker *w)
{
	for (uint32_t i = 0; i < SE_BOX; i++) {
		struct se_box *b = &w->sh->box[i];
		uint64_t id = atomic_load_explicit(&b->lease, memory_order_relaxed); /* ours */
		uint32_t c;
		int r;

		if (!id)
			continue;
		c = atomic_load_explicit(&b->ctl, memory_order_relaxed);
		r = kvt_lease_slots(w->h, id, NULL, NULL, 0);
		if (r == -ESTALE) {
			/* Acquire: the last reader's load_released store (before
			 * it cleared its bit with release) is visible. */
			if ((c & SE_CTL_READERS) ||
			    !atomic_compare_exchange_strong_explicit(&b->ctl, &c, SE_CTL_RETIRED,
								     memory_order_acq_rel,
								     memory_order_relaxed))
				continue; /* a rank still reads it */
			if (!(c & SE_CTL_DROPPED)) {
				/* It was in our live set: only its loads may have
				 * released it (or, in crash mode, the reaper). */
				if (atomic_load(&b->load_released) == id)
					se_count(w, SE_GONE_BY_LOAD, 1);
				else if (!w->cfg->crash)
					se_error(w, "scheduler: lease %#" PRIx64 " in the live set was "
						 "released, not by its loads", id);
			}
			atomic_store_explicit(&b->lease, 0, memory_order_relaxed);
			continue;
		}
		if (r < 0) {
			se_error(w, "scheduler: kvt_lease_slots(%#" PRIx64 ") = %d: %s", id, r,
				 kvt_core_last_error());
			continue;
		}
		if (w->cfg->expire_steps && !(c & SE_CTL_DROPPED) &&
		    w->steps - w->pub_step[i] >= w->cfg->expire_steps) {
			uint32_t zero = 0;
			/* Acquire: the readers' payload reads are done before our
			 * step lets the slot go. */
			if (atomic_compare_exchange_strong_explicit(&b->ctl, &zero, SE_CTL_DROPPED,
								    memory_order_acq_rel,
								    memory_order_relaxed))
				se_count(w, SE_DROPPED, 1);
		}
	}
}

static inline void se_sched_lookup(struct se_worker *w)
{
	uint64_t base = (uint64_t)se_lookup_prompt(w) * SE_CPP, lease = 0;
	kvt_key keys[SE_CPP];
	int hits;

	for (uint32_t i = 0; i < SE_CPP; i++)
		keys[i] = se_key(base + i);
	hits = kvt_seg_lookup(w->h, keys, SE_CPP, &lease);
	se_count(w, SE_LOOKUPS, 1);
	if (hits == -ENOSPC) {
		se_count(w, SE_LOOKUP_NOSPC, 1);
		return;
	}
	if (hits < 0 || hits > (int)SE_CPP || (hits > 0) != (lease != 0)) {
		se_error(w, "scheduler: kvt_seg_lookup = %d: %s", hits, kvt_core_last_error());
		return;
	}
	se_count(w, SE_HITS, (uint64_t)hits);
	se_count(w, SE_PROGRESS, 1);
	if (!hits)
		return;
	if (se_verify_lease(w, w->h, lease, base, hits) != 0) {
		se_release(w, w->h, lease, 0);
		return;
	}
	for (uint32_t i = 0; i < SE_BOX; i++) {
		struct se_box *b = &w->sh->box[i];
		if (atomic_load_explicit(&b->lease, memory_order_relaxed))
			continue;
		atomic_store_explicit(&b->base, base, memory_order_relaxed);
		atomic_store_explicit(&b->n, (uint32_t)hits, memory_order_relaxed);
		atomic_store_explicit(&b->ctl, 0, memory_order_relaxed);
		atomic_store_explicit(&b->load_released, 0, memory_order_relaxed);
		w->pub_step[i] = w->steps;
		/* Release: base, n and ctl before the id (pairs with the ranks'
		 * acquire load of it). */
		atomic_store_explicit(&b->lease, lease, memory_order_release);
		se_count(w, SE_PUBLISHED, 1);
		return;
	}
	se_release(w, w->h, lease, se_rand(&w->rng) % 8 == 0);
}

/* A pin storm: every SE_STORM_EVERY iterations the scheduler spends
 * SE_STORM iterations looking every key up alone and holds all the leases
 * (in its live set) until iteration SE_STORM_HOLD: that pins every READY
 * chunk of the arena, so saves meet -ENOSPC until it checks and releases
 * them all. */
static inline void se_sched_storm(struct se_worker *w, uint64_t it)
{
	uint32_t phase = (uint32_t)(it % SE_STORM_EVERY);
	uint64_t nk = (uint64_t)w->cfg->n_prompts * SE_CPP;

	if (phase < SE_STORM) {
		for (uint64_t i = nk * phase / SE_STORM; i < nk * (phase + 1) / SE_STORM &&
		     w->nstorm < SE_STORM_MAX; i++) {
			kvt_key k = se_key(i);
			uint64_t lease = 0;
			int hits = kvt_seg_lookup(w->h, &k, 1, &lease);

			se_count(w, SE_LOOKUPS, 1);
			if (hits == -ENOSPC) {
				se_count(w, SE_LOOKUP_NOSPC, 1);
				return;
			}
			if (hits < 0 || hits > 1) {
				se_error(w, "scheduler: storm kvt_seg_lookup = %d: %s", hits,
					 kvt_core_last_error());
				return;
			}
			se_count(w, SE_HITS, (uint64_t)hits);
			if (hits && se_verify_lease(w, w->h, lease, i, 1) == 0) {
				w->storm[w->nstorm] = lease;
				w->storm_key[w->nstorm++] = i;
			} else if (hits) {
				se_release(w, w->h, lease, 0);
			}
		}
		return;
	}
	if (phase < SE_STORM_HOLD)
		return;
	for (uint32_t i = 0; i < w->nstorm; i++) {
		/* In the live set all along: each still holds what it pinned. */
		if (se_verify_lease(w, w->h, w->storm[i], w->storm_key[i], 1) >= 0)
			se_release(w, w->h, w->storm[i], 0);
	}
	w->nstorm = 0;
}

static inline void se_sched_step(struct se_worker *w)
{
	uint64_t live[SE_BOX + SE_STORM_MAX];
	uint32_t n = 0;
	int r;

	for (uint32_t i = 0; i < w->nstorm; i++)
		live[n++] = w->storm[i];

	for (uint32_t i = 0; i < SE_BOX; i++) {
		struct se_box *b = &w->sh->box[i];
		uint64_t id = atomic_load_explicit(&b->lease, memory_order_relaxed);
		if (id && !(atomic_load_explicit(&b->ctl, memory_order_relaxed) & SE_CTL_DROPPED))
			live[n++] = id;
	}
	r = kvt_seg_step(w->h, live, n);
	w->steps++;
	se_count(w, SE_STEPS, 1);
	if (r < 0)
		se_error(w, "scheduler: kvt_seg_step = %d: %s", r, kvt_core_last_error());
	else
		se_count(w, SE_STALE, (uint64_t)r);
}

static inline void se_sched_loop(struct se_worker *w)
{
	for (uint64_t it = 0; !atomic_load_explicit(&w->sh->stop, memory_order_relaxed); it++) {
		se_sched_poll(w);
		se_sched_lookup(w);
		se_sched_storm(w, it);
		se_sched_step(w);
		if (w->cfg->sched_reaps && it % 64 == 63) {
			int r = kvt_seg_reap(w->h);
			se_count(w, SE_REAPS, 1);
			if (r < 0)
				se_error(w, "scheduler: kvt_seg_reap = %d: %s", r, kvt_core_last_error());
			else
				se_count(w, SE_REAPED, (uint64_t)r);
		}
		se_count(w, SE_OPS, 1);
		if (it % 4 == 3)
			sched_yield(); /* leave the CPUs to the ranks */
	}
}

/* ---- workers ---- */

/* The TSan variant runs the workers as threads, each with its own handles.
 * ThreadSanitizer keys its shadow memory by virtual address, and every
 * kvt_seg_attach maps the segment at an address of its own, so two
 * handles' accesses to one word look unrelated to it (checked: a plain
 * counter incremented through two mappings by two threads reports no
 * race).  So the threads' handles are pointed at the creator's mapping,
 * after attach, with the handle's private layout; the size assertion makes
 * any change of the handle fail to compile here instead of going stale. */
_Static_assert(sizeof(struct kvt_seg) == 720,
	       "struct kvt_seg changed: update se_share_mapping()");

static inline void se_share_mapping(kvt_seg *s, const kvt_seg *p)
{
	uint8_t *old = s->base;
	uint32_t block = s->entry == UINT32_MAX ? s->d.n_entries : s->entry;

	s->base = p->base;
	s->hdr = p->hdr;
	s->ents = p->ents;
	s->counters = p->counters;
	s->leases = p->leases;
	s->buckets = p->buckets;
	s->slots = p->slots;
	s->arena = p->arena;
	s->disk = p->disk;
	s->drings = p->drings;
	s->dents = p->dents;
	s->my_counters = (uint64_t *)(s->counters + (uint64_t)block * s->d.counter_block);
	munmap(old, s->size);
}

/* Detaches a handle rebased by se_share_mapping without unmapping the
 * creator's mapping: detach unmaps s->base, so give it a reservation. */
static inline void se_detach_shared(kvt_seg *s)
{
	void *resv = mmap(NULL, s->size, PROT_NONE,
			  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);

	if (resv != MAP_FAILED)
		s->base = resv;
	kvt_seg_detach(s);
}

static inline int se_attach(struct se_worker *w, uint32_t role, uint32_t inst,
			    uint32_t rank, kvt_seg **out)
{
	struct kvt_seg_attach_opts a = {
		.size = sizeof(a), .name = w->cfg->name, .role = role, .instance = inst,
		.rank = rank, .world = role == KVT_ROLE_RANK ? w->cfg->world : 0 };
	int r = kvt_seg_attach(&a, out);

	if (r)
		se_error(w, "worker %u: attach role %u instance %u rank %u = %d: %s", w->id,
			 role, inst, rank, r, kvt_core_last_error());
	return r;
}

/* Runs worker `id` to the end.  `share`: the creator's handle, to share its
 * mapping (threads), or NULL (processes).  Returns an SE_EXIT_ status. */
static inline int se_worker_run(const struct se_cfg *cfg, struct se_shared *sh,
				uint32_t id, uint64_t seed, const kvt_seg *share)
{
	struct se_worker w;
	int rank = id < cfg->world;

	memset(&w, 0, sizeof(w));
	w.cfg = cfg;
	w.sh = sh;
	w.st = &sh->st[id];
	w.id = id;
	w.rng = kvt__mix64(seed ^ (0x1000193ULL * (id + 1)));
	if (se_attach(&w, rank ? KVT_ROLE_RANK : KVT_ROLE_SCHEDULER, 0, id, &w.h))
		return SE_EXIT_ATTACH;
	if (rank && se_attach(&w, KVT_ROLE_CLIENT, id + 1, 0, &w.ch)) {
		kvt_seg_detach(w.h);
		return SE_EXIT_ATTACH;
	}
	if (share) {
		se_share_mapping(w.h, share);
		if (w.ch)
			se_share_mapping(w.ch, share);
	}
	w.sbytes = kvt_seg_shard_bytes(w.h);
	w.nsh = kvt_seg_n_shards(w.h);
	atomic_fetch_add(&sh->attached, 1);
	if (rank)
		se_rank_loop(&w);
	else
		se_sched_loop(&w);
	if (share) {
		if (w.ch)
			se_detach_shared(w.ch);
		se_detach_shared(w.h);
	} else {
		if (w.ch)
			kvt_seg_detach(w.ch);
		kvt_seg_detach(w.h);
	}
	if (atomic_load(&w.st->c[SE_BAD]))
		return SE_EXIT_BAD;
	return atomic_load(&w.st->c[SE_ERRORS]) ? SE_EXIT_ERROR : SE_EXIT_OK;
}

static inline pid_t se_fork_worker(const struct se_cfg *cfg, struct se_shared *sh,
				   uint32_t id, uint64_t seed)
{
	pid_t p = fork();

	if (p == 0)
		_exit(se_worker_run(cfg, sh, id, seed, NULL));
	return p;
}

/* ---- the parent's side ---- */

static inline struct se_shared *se_shared_map(void)
{
	void *p = mmap(NULL, sizeof(struct se_shared), PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_ANONYMOUS, -1, 0);

	return p == MAP_FAILED ? NULL : p;
}

static inline struct kvt_geometry se_geometry(uint32_t world, uint32_t slots,
					      uint32_t fill_ms)
{
	struct kvt_geometry g;

	memset(&g, 0, sizeof(g));
	g.chunk_tokens = 16;
	g.world = world;
	g.n_instances = world + 1; /* 0: the ranks and scheduler; r+1: rank r's own */
	g.mode = KVT_MODE_SHARDED;
	g.n_groups = 1;
	g.groups[0].layers = 1;
	g.groups[0].bytes_per_token = 16; /* 256-byte shards */
	g.model_id.lo = 0x57e55;
	g.n_slots = slots;
	g.n_leases = 256;
	g.lease_max_chunks = SE_CPP;
	g.fill_timeout_ms = fill_ms;
	return g;
}

/* Adds a run's per-worker stats into totals (and returns them). */
static inline void se_sum(const struct se_shared *sh, uint32_t workers, uint64_t tot[SE__N])
{
	for (uint32_t i = 0; i < workers; i++)
		for (int c = 0; c < SE__N; c++)
			tot[c] += atomic_load(&sh->st[i].c[c]);
}

static inline void se_print_msgs(const struct se_shared *sh, uint32_t workers)
{
	for (uint32_t i = 0; i < workers; i++)
		if (atomic_load(&sh->st[i].have_msg))
			fprintf(stderr, "worker %u: %s\n", i, sh->st[i].msg);
}

static inline void se_print_stats(const char *what, const uint64_t tot[SE__N])
{
	fprintf(stderr, "%s:", what);
	for (int c = 0; c < SE__N; c++)
		fprintf(stderr, "%s %s=%" PRIu64, c % 8 ? "" : "\n ", se_stat_names[c], tot[c]);
	fprintf(stderr, "\n");
}

/* Looks every key up alone through h (quiescent) and checks every hit
 * strictly, counting into *st. */
static inline void se_verify_all(const struct se_cfg *cfg, kvt_seg *h, struct se_stats *st)
{
	struct se_cfg strict = *cfg;
	struct se_worker w;
	uint64_t nk = (uint64_t)cfg->n_prompts * SE_CPP;

	strict.crash = 0; /* nothing runs: no release can race a read */
	memset(&w, 0, sizeof(w));
	w.cfg = &strict;
	w.st = st;
	w.id = 99;
	w.h = h;
	w.sbytes = kvt_seg_shard_bytes(h);
	w.nsh = kvt_seg_n_shards(h);
	for (uint64_t i = 0; i < nk; i++) {
		kvt_key k = se_key(i);
		uint64_t lease = 0;
		int hits = kvt_seg_lookup(h, &k, 1, &lease);

		se_count(&w, SE_LOOKUPS, 1);
		if (hits < 0) {
			se_error(&w, "parent: kvt_seg_lookup = %d: %s", hits, kvt_core_last_error());
			return;
		}
		se_count(&w, SE_HITS, (uint64_t)hits);
		if (!hits)
			continue;
		(void)se_verify_lease(&w, h, lease, i, 1);
		se_release(&w, h, lease, 0);
	}
}

#endif /* STRESS_ENGINE_H */
