/* preempt_engine.h - the preemption stress: many keys over few slots, fast
 * and slow writers (a slow one sleeps between kvt_write_begin and its
 * copy, as a DMA behind a busy engine does), readers that pin and check
 * every chunk byte by byte, in processes or threads, replicated or
 * sharded; with schedule points live (kvtier_core_sp, or a
 * -DKVTIER_SCHEDULE_POINTS=ON build), random delays at every protocol
 * step.  Used by tests/core_preempt.c (a bounded run) and by
 * `kvtier-bench preempt` (a long one).
 *
 * Worker w is a CLIENT of its own instance w: its leases are released only
 * by itself (explicitly, by its loads for every rank, or by its own step
 * sweep), so a pinned read can never race a release and any stamp that
 * does not match is corruption.  A stamp is (key, shard, the slot
 * generation the writer claimed): a copy that landed in another life of
 * the slot shows as a generation that is not the lease's.
 *
 * What must hold: no wrong byte read; no write_end that finds its claim
 * gone or its slot doomed (nobody dies here, no slot with a live claim is
 * ever doomed, so -ESTALE and -EINVAL from write_end are lost claims);
 * kvt_check clean at the end; the lost_claims counter 0.
 */
#ifndef PREEMPT_ENGINE_H
#define PREEMPT_ENGINE_H

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "stress_engine.h" /* stamps, se_share_mapping, helpers */

#define PE_MAX_WORKERS 16u
#define PE_RUN_MAX     4u  /* keys one lookup asks for */

struct pe_cfg {
	const char *name;
	uint32_t world;        /* ranks (shards when sharded) */
	int replicated;
	uint32_t slots, keys, workers;
	uint32_t slow;         /* workers 0..slow-1 are slow writers */
	uint32_t slow_us;      /* ... sleeping this long before each copy */
	uint64_t ops;          /* per worker; 0: until `seconds` */
	double seconds;
	uint32_t fill_ms;
	int threads;
	uint64_t seed;
};

enum pe_stat {
	PE_OPS, PE_WRITES, PE_SAVED, PE_MADE_READY, PE_SKIPS, PE_NOSPC, PE_AGAIN,
	PE_ABORTS, PE_LOST, PE_LOOKUPS, PE_HITS, PE_VERIFIED, PE_BAD, PE_RELEASED,
	PE_LOAD_RELEASED, PE_ABANDONED, PE_STALE, PE_ERRORS, PE__N
};

static const char *const pe_stat_names[PE__N] = {
	"ops", "writes", "saved", "made_ready", "skips", "nospc", "again",
	"aborts", "LOST_CLAIMS", "lookups", "hits", "verified_chunks", "BAD",
	"released", "load_released", "abandoned", "stale", "ERRORS",
};

struct pe_shared {
	_Atomic int stop;
	_Atomic uint64_t c[PE_MAX_WORKERS][PE__N];
	_Atomic int have_msg;
	char msg[240];
};

struct pe_worker {
	const struct pe_cfg *cfg;
	struct pe_shared *sh;
	uint32_t id;
	kvt_seg *h;
	uint64_t rng;
	uint64_t sbytes;
	uint32_t nsh;
};

static inline void pe_count(struct pe_worker *w, enum pe_stat s, uint64_t v)
{
	atomic_fetch_add_explicit(&w->sh->c[w->id][s], v, memory_order_relaxed);
}

static inline __attribute__((format(printf, 3, 4)))
void pe_fail(struct pe_worker *w, enum pe_stat s, const char *fmt, ...)
{
	va_list ap;
	int expect = 0;

	pe_count(w, s, 1);
	if (!atomic_compare_exchange_strong(&w->sh->have_msg, &expect, 1))
		return;
	va_start(ap, fmt);
	vsnprintf(w->sh->msg, sizeof(w->sh->msg), fmt, ap);
	va_end(ap);
}

static inline void pe_usleep(uint64_t us)
{
	struct timespec ts = { (time_t)(us / 1000000), (long)(us % 1000000) * 1000 };

	nanosleep(&ts, NULL);
}

static inline kvt_key pe_key(uint64_t i)
{
	kvt_key k = { i, 0x505245454d505400ULL };
	return k;
}

/* One shard of one key. */
static inline void pe_write(struct pe_worker *w, uint64_t key, uint32_t shard)
{
	kvt_key k = pe_key(key);
	struct kvt_wref wr;
	int r = kvt_write_begin(w->h, &k, 0, shard, &wr), e, ok;

	pe_count(w, PE_WRITES, 1);
	if (r == KVT_SKIP) {
		pe_count(w, PE_SKIPS, 1);
		return;
	}
	if (r == -ENOSPC || r == -EAGAIN) {
		pe_count(w, r == -ENOSPC ? PE_NOSPC : PE_AGAIN, 1);
		return;
	}
	if (r) {
		pe_fail(w, PE_ERRORS, "worker %u: write_begin = %d: %s", w->id, r,
			kvt_core_last_error());
		return;
	}
	void *p = kvt_slot_shard_ptr(w->h, wr.slot, shard);
	if (w->id < w->cfg->slow && w->cfg->slow_us) /* a slow copy: slow_us +-50% */
		pe_usleep(w->cfg->slow_us / 2 + se_rand(&w->rng) % (w->cfg->slow_us + 1));
	ok = se_rand(&w->rng) % 64 != 0;
	if (ok)
		se_stamp(p, w->sbytes, &k, w->id, shard, wr.gen);
	else
		memset(p, 0xee, (size_t)w->sbytes); /* must never be served */
	e = kvt_write_end(w->h, &wr, ok);
	if (!ok) {
		pe_count(w, PE_ABORTS, 1);
		if (e)
			pe_fail(w, PE_LOST, "worker %u: aborting write_end = %d: %s", w->id, e,
				kvt_core_last_error());
	} else if (e == 0 || e == 1) {
		pe_count(w, PE_SAVED, 1);
		pe_count(w, PE_MADE_READY, (uint64_t)e);
	} else {
		pe_fail(w, PE_LOST, "worker %u: write_end of key %" PRIu64 " shard %u = %d: %s "
			"(a live writer lost its claim)", w->id, key, shard, e,
			kvt_core_last_error());
	}
}

/* Checks every shard of every chunk of a lease of ours (nothing else can
 * release it). */
static inline int pe_verify(struct pe_worker *w, uint64_t lease, const uint64_t *keys, int n)
{
	uint32_t slots[PE_RUN_MAX];
	uint64_t gens[PE_RUN_MAX];
	char why[160];
	int got = kvt_lease_slots(w->h, lease, slots, gens, PE_RUN_MAX);

	if (got != n) {
		pe_fail(w, PE_ERRORS, "worker %u: lease_slots = %d, lookup hit %d: %s", w->id,
			got, n, kvt_core_last_error());
		return -1;
	}
	for (int i = 0; i < n; i++) {
		kvt_key k = pe_key(keys[i]);
		for (uint32_t sh = 0; sh < w->nsh; sh++)
			if (se_check_shard(kvt_slot_shard_ptr(w->h, slots[i], sh), w->sbytes, &k, sh,
					   gens[i], why, sizeof(why))) {
				pe_fail(w, PE_BAD, "worker %u: pinned read of slot %u: %s", w->id,
					slots[i], why);
				return -1;
			}
	}
	pe_count(w, PE_VERIFIED, (uint64_t)n);
	return 0;
}

static inline void pe_read(struct pe_worker *w)
{
	uint64_t keys[PE_RUN_MAX], lease;
	kvt_key kk[PE_RUN_MAX];
	uint32_t n = 1 + (uint32_t)(se_rand(&w->rng) % PE_RUN_MAX);
	uint64_t first = se_rand(&w->rng) % w->cfg->keys;
	int hits;

	for (uint32_t i = 0; i < n; i++) {
		keys[i] = (first + i) % w->cfg->keys;
		kk[i] = pe_key(keys[i]);
	}
	hits = kvt_seg_lookup(w->h, kk, n, &lease);
	pe_count(w, PE_LOOKUPS, 1);
	if (hits == -ENOSPC)
		return;
	if (hits < 0 || (uint32_t)hits > n || (hits > 0) != (lease != 0)) {
		pe_fail(w, PE_ERRORS, "worker %u: lookup = %d: %s", w->id, hits,
			kvt_core_last_error());
		return;
	}
	pe_count(w, PE_HITS, (uint64_t)hits);
	if (!hits)
		return;
	(void)pe_verify(w, lease, keys, hits);
	uint32_t what = (uint32_t)(se_rand(&w->rng) % 8);
	if (what < 4) {
		if (kvt_lease_release(w->h, lease) != 0)
			pe_fail(w, PE_ERRORS, "worker %u: release: %s", w->id, kvt_core_last_error());
		pe_count(w, PE_RELEASED, 1);
	} else if (what < 7) {
		for (uint32_t r = 0; r < w->cfg->world; r++) {
			int e = kvt_lease_loaded(w->h, lease, r);
			if (e != (r == w->cfg->world - 1 ? 1 : 0)) {
				pe_fail(w, PE_ERRORS, "worker %u: loaded(rank %u) = %d: %s", w->id, r,
					e, kvt_core_last_error());
				return;
			}
		}
		pe_count(w, PE_LOAD_RELEASED, 1);
	} else {
		pe_count(w, PE_ABANDONED, 1); /* for our own step sweep */
	}
}

static inline int pe_more(struct pe_worker *w, uint64_t op)
{
	if (w->cfg->ops)
		return op < w->cfg->ops;
	return !atomic_load_explicit(&w->sh->stop, memory_order_relaxed);
}

static inline void pe_loop(struct pe_worker *w)
{
	for (uint64_t op = 0; pe_more(w, op); op++) {
		uint32_t what = (uint32_t)(se_rand(&w->rng) % 16);
		uint64_t key = se_rand(&w->rng) % w->cfg->keys;

		if (what < 9) {
			if (w->cfg->replicated || w->nsh == 1)
				pe_write(w, key, 0);
			else if (w->id % 2)
				for (uint32_t sh = 0; sh < w->nsh; sh++) /* a whole chunk */
					pe_write(w, key, sh);
			else
				pe_write(w, key, w->id / 2 % w->nsh); /* one shard: joins */
		} else {
			pe_read(w);
		}
		if (op % 8 == 7) {
			int r = kvt_seg_step(w->h, NULL, 0);
			if (r < 0)
				pe_fail(w, PE_ERRORS, "worker %u: step: %s", w->id, kvt_core_last_error());
			else
				pe_count(w, PE_STALE, (uint64_t)r);
		}
		pe_count(w, PE_OPS, 1);
	}
	for (int k = 0; k < 2; k++) { /* our abandoned leases go */
		int r = kvt_seg_step(w->h, NULL, 0);
		if (r > 0)
			pe_count(w, PE_STALE, (uint64_t)r);
	}
}

static inline int pe_attach(const struct pe_cfg *cfg, uint32_t id, kvt_seg **out)
{
	struct kvt_seg_attach_opts a = {
		.size = sizeof(a), .name = cfg->name, .role = KVT_ROLE_CLIENT, .instance = id };

	return kvt_seg_attach(&a, out);
}

static inline void pe_worker_init(struct pe_worker *w, const struct pe_cfg *cfg,
				  struct pe_shared *sh, uint32_t id)
{
	memset(w, 0, sizeof(*w));
	w->cfg = cfg;
	w->sh = sh;
	w->id = id;
	w->rng = kvt__mix64(cfg->seed ^ (0x100000001b3ULL * (id + 1)));
}

static inline int pe_process(const struct pe_cfg *cfg, struct pe_shared *sh, uint32_t id)
{
	struct pe_worker w;

	pe_worker_init(&w, cfg, sh, id);
	if (pe_attach(cfg, id, &w.h)) {
		pe_fail(&w, PE_ERRORS, "worker %u: attach: %s", id, kvt_core_last_error());
		return 2;
	}
	w.sbytes = kvt_seg_shard_bytes(w.h);
	w.nsh = kvt_seg_n_shards(w.h);
	pe_loop(&w);
	kvt_seg_detach(w.h);
	return 0;
}

struct pe_thread {
	struct pe_worker w;
	const kvt_seg *share;
	pthread_t t;
};

static inline void *pe_thread_main(void *arg)
{
	struct pe_thread *pt = arg;

	pe_loop(&pt->w);
	return NULL;
}

/* The run's totals and the final checks' verdict. */
struct pe_result {
	uint64_t tot[PE__N];
	uint64_t counters[KVT_C__COUNT];
	double seconds;
	int check;        /* kvt_check at the end */
	char check_msg[256];
	char msg[240];    /* the first failure a worker saw */
};

/* Verifies every READY chunk once more from h (quiescent). */
static inline void pe_verify_all(const struct pe_cfg *cfg, kvt_seg *h, struct pe_shared *sh)
{
	struct pe_worker w;

	pe_worker_init(&w, cfg, sh, 0);
	w.h = h;
	w.sbytes = kvt_seg_shard_bytes(h);
	w.nsh = kvt_seg_n_shards(h);
	for (uint64_t i = 0; i < cfg->keys; i++) {
		kvt_key k = pe_key(i);
		uint64_t lease;
		if (kvt_seg_lookup(h, &k, 1, &lease) == 1) {
			(void)pe_verify(&w, lease, &i, 1);
			kvt_lease_release(h, lease);
		}
	}
}

static inline int pe_run(const struct pe_cfg *cfg, struct pe_result *res)
{
	struct kvt_geometry g = se_geometry(cfg->world, cfg->slots, cfg->fill_ms);
	struct kvt_seg_create_opts c = {
		.size = sizeof(c), .name = cfg->name, .geo = &g, .flags = KVT_SEG_F_REPLACE };
	struct pe_shared *sh;
	struct pe_thread *pt = NULL;
	pid_t pids[PE_MAX_WORKERS];
	kvt_seg *seg;
	uint64_t t0;
	int r;

	memset(res, 0, sizeof(*res));
	if (cfg->workers < 1 || cfg->workers > PE_MAX_WORKERS)
		return -EINVAL;
	g.mode = cfg->replicated ? KVT_MODE_REPLICATED : KVT_MODE_SHARDED;
	g.n_instances = cfg->workers;
	g.n_leases = 64;
	g.lease_max_chunks = PE_RUN_MAX;
	sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED)
		return -ENOMEM;
	memset(sh, 0, sizeof(*sh));
	r = kvt_seg_create(&c, NULL, &seg);
	if (r) {
		snprintf(res->msg, sizeof(res->msg), "create: %s", kvt_core_last_error());
		munmap(sh, sizeof(*sh));
		return r;
	}
	t0 = kvt__now_ns();
	if (cfg->threads) {
		pt = calloc(cfg->workers, sizeof(*pt));
		for (uint32_t i = 0; pt && i < cfg->workers; i++) {
			pe_worker_init(&pt[i].w, cfg, sh, i);
			if (pe_attach(cfg, i, &pt[i].w.h)) {
				snprintf(res->msg, sizeof(res->msg), "attach: %s", kvt_core_last_error());
				r = -EIO;
				break;
			}
			se_share_mapping(pt[i].w.h, seg); /* TSan sees one address */
			pt[i].w.sbytes = kvt_seg_shard_bytes(seg);
			pt[i].w.nsh = kvt_seg_n_shards(seg);
		}
		for (uint32_t i = 0; !r && i < cfg->workers; i++)
			pthread_create(&pt[i].t, NULL, pe_thread_main, &pt[i]);
	} else {
		for (uint32_t i = 0; i < cfg->workers; i++) {
			pids[i] = fork();
			if (pids[i] == 0)
				_exit(pe_process(cfg, sh, i));
		}
	}
	if (!r && !cfg->ops) {
		pe_usleep((uint64_t)(cfg->seconds * 1e6));
		atomic_store(&sh->stop, 1);
	}
	if (cfg->threads) {
		for (uint32_t i = 0; !r && i < cfg->workers; i++)
			pthread_join(pt[i].t, NULL);
		for (uint32_t i = 0; pt && i < cfg->workers; i++)
			if (pt[i].w.h)
				se_detach_shared(pt[i].w.h);
		free(pt);
	} else {
		for (uint32_t i = 0; i < cfg->workers; i++) {
			int st;
			waitpid(pids[i], &st, 0);
			if (!WIFEXITED(st) || WEXITSTATUS(st))
				atomic_fetch_add(&sh->c[0][PE_ERRORS], 1);
		}
	}
	res->seconds = (double)(kvt__now_ns() - t0) / 1e9;
	pe_verify_all(cfg, seg, sh);
	res->check = kvt_check(seg, res->check_msg, sizeof(res->check_msg));
	for (uint32_t i = 0; i < cfg->workers; i++)
		for (int s = 0; s < PE__N; s++)
			res->tot[s] += atomic_load(&sh->c[i][s]);
	kvt_counters_read(seg, res->counters);
	if (atomic_load(&sh->have_msg))
		snprintf(res->msg, sizeof(res->msg), "%s", sh->msg);
	kvt_seg_detach(seg);
	kvt_seg_unlink(cfg->name, NULL);
	munmap(sh, sizeof(*sh));
	return r;
}

static inline void pe_print(FILE *f, const char *what, const struct pe_result *res)
{
	fprintf(f, "%s: %.2f s", what, res->seconds);
	for (int s = 0; s < PE__N; s++)
		fprintf(f, "%s %s=%" PRIu64, s % 6 ? "" : "\n ", pe_stat_names[s], res->tot[s]);
	fprintf(f, "\n evictions=%" PRIu64 " fill_timeouts=%" PRIu64 " lost_claims=%" PRIu64
		" check=%s%s%s\n", res->counters[KVT_C_EVICTIONS],
		res->counters[KVT_C_FILL_TIMEOUTS], res->counters[KVT_C_LOST_CLAIMS],
		res->check ? "FAILED: " : "clean", res->check ? res->check_msg : "", "");
	if (res->msg[0])
		fprintf(f, " first failure: %s\n", res->msg);
}

/* Nonzero when the run upheld every invariant. */
static inline int pe_ok(const struct pe_result *res)
{
	return !res->check && !res->tot[PE_BAD] && !res->tot[PE_LOST] && !res->tot[PE_ERRORS] &&
	       !res->counters[KVT_C_LOST_CLAIMS] && !res->counters[KVT_C_REAPED_RANKS];
}

#endif /* PREEMPT_ENGINE_H */
