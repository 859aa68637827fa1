/* l3_engine.c - the L3 engine (kvt_l3e.h: the design).  The segment's
 * protocols are core's: kvt_slot_ready / kvt_slot_same_life around a put
 * (no pin: a READY slot's payload does not change in its life, and a life
 * that ended during the put voids it), kvt_write_begin / kvt_write_end
 * around a get (the claims are this handle's; published only checked).
 * No new shared-memory step: the engine's state is its own. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create */
#endif
#include "kvt_clock.h"
#include "kvt_l3e.h"
#include "kvt_log.h"
#include "kvt_l3_asks.h"
#include "kvt_disk.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>

#define REC_BITS 16 /* the put record: 65,536 keys */
#define NEG_BITS 12 /* the negative cache: 4,096 keys */
#define AQ_MAX   KVT_L3E_QUEUE /* asks waiting for a job */
#define JOBS_MAX 256
_Static_assert(JOBS_MAX + AQ_MAX <= KVT_L3_ASKS_MAX, "every ask in flight fits in the set");

enum { J_FREE = 0, J_PUT, J_EXISTS, J_GET };

struct job {
	int kind;
	kvt_key key;
	uint32_t depth, slot;
	uint64_t w;                /* put: the slot's life */
	uint32_t left;             /* requests not completed */
	uint32_t staged;           /* put: staging buffers held (stage[]) */
	int err;                   /* the first failure */
	uint64_t t0;
	char keys[KVT_L3_MAX_SHARDS][KVT_L3_KEY_MAX];
	uint8_t hdr[KVT_L3_MAX_SHARDS][KVT_L3_HDR_SIZE];
	uint8_t tag[KVT_L3_MAX_SHARDS][KVT_L3_TAG_SIZE];
	struct iovec iov[KVT_L3_MAX_SHARDS][3];
	struct kvt_l3_req q[KVT_L3_MAX_SHARDS];
	struct kvt_wref wr[KVT_L3_MAX_SHARDS];
	uint32_t stage[KVT_L3_MAX_SHARDS];
};

struct kvt_l3e {
	kvt_seg *s;
	struct kvt_l3e_opts o;
	kvt_l3 *l3;
	kvt_l3_sealer *seal;
	uint64_t fp;
	uint32_t n_shards, n_slots;
	uint64_t payload;
	struct job *jobs;
	uint32_t live;
	uint64_t cursor;
	kvt_key rec[1u << REC_BITS];
	struct { kvt_key k; uint32_t depth; uint64_t ns; } neg[1u << NEG_BITS]; /* misses */
	kvt_key ghost[1u << NEG_BITS]; /* second-hit: refused once */
	uint32_t *seen;            /* per slot: the life considered (gen + 1) */
	uint8_t *rejected;         /* ... and refused by second-hit */
	uint64_t lap_idle, idle_hand, idle_ns;
	uint32_t reserve;          /* jobs the put scan leaves to asks */
	struct { kvt_key k; uint32_t depth; } aq[AQ_MAX]; /* asks waiting for a job */
	struct kvt_l3_asks as;     /* asks in flight: queued or in a job */
	uint32_t aq_head, aq_n;
	/* encrypting: the staging (a memfd the store's companion may map),
	 * buffers of one shard's payload, and the free ones */
	uint8_t *stage;
	int stage_fd;
	uint32_t n_stage, *stage_free, n_stage_free;
	struct kvt_l3e_info info;
};

static void elog(const kvt_l3e *e, int level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void elog(const kvt_l3e *e, int level, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	kvt__vlog(e->o.log, e->o.log_arg, "l3", level, fmt, ap);
	va_end(ap);
}

static uint32_t hash_of(const kvt_key *k, int bits)
{
	uint64_t h = (k->lo ^ (k->hi * 0x9e3779b97f4a7c15ull)) * 0xbf58476d1ce4e5b9ull;

	return (uint32_t)(h >> (64 - bits));
}

static int same(const kvt_key *a, const kvt_key *b)
{
	return a->lo == b->lo && a->hi == b->hi;
}

static int rec_has(const kvt_l3e *e, const kvt_key *k)
{
	return same(&e->rec[hash_of(k, REC_BITS)], k);
}

static void rec_add(kvt_l3e *e, const kvt_key *k)
{
	e->rec[hash_of(k, REC_BITS)] = *k; /* bounded: a collision forgets one */
}

/* A miss is remembered for its (key, depth): an ask at a wrong depth (its
 * get refused by the header check) cannot make the right one a miss. */
static int neg_has(kvt_l3e *e, const kvt_key *k, uint32_t depth, uint64_t now)
{
	uint32_t i = hash_of(k, NEG_BITS);

	return same(&e->neg[i].k, k) && e->neg[i].depth == depth &&
	       now - e->neg[i].ns < (uint64_t)e->o.negative_ms * 1000000ull;
}

static void neg_add(kvt_l3e *e, const kvt_key *k, uint32_t depth)
{
	uint32_t i = hash_of(k, NEG_BITS);

	e->neg[i].k = *k;
	e->neg[i].depth = depth;
	e->neg[i].ns = kvt__now_ns();
}

static void hist_add(struct kvt_hist_snap *h, uint64_t ns)
{
	uint32_t i = 0;

	while (i + 1 < KVT_HIST_BUCKETS && ns > kvt_hist_bound_ns(i))
		i++;
	h->bucket[i]++;
	h->sum_ns += ns;
	h->count++;
}

/* The asker's answer for a fetch's key (kvt_l3e_opts.answer). */
static void answer(kvt_l3e *e, const kvt_key *k, int result)
{
	if (e->o.answer)
		e->o.answer(e->o.answer_arg, k, result);
}

static struct job *job_get(kvt_l3e *e, int kind)
{
	for (uint32_t i = 0; i < e->o.jobs; i++)
		if (e->jobs[i].kind == J_FREE) {
			struct job *j = &e->jobs[i];
			j->kind = kind;
			j->err = 0;
			j->left = 0;
			j->staged = 0;
			j->t0 = kvt__now_ns();
			e->live++;
			return j;
		}
	return NULL;
}

static void job_put(kvt_l3e *e, struct job *j)
{
	if (j->kind == J_EXISTS || j->kind == J_GET)
		kvt_l3_asks_del(&e->as, &j->key, j->depth);
	while (j->staged) /* the store is done reading them */
		e->stage_free[e->n_stage_free++] = j->stage[--j->staged];
	j->kind = J_FREE;
	e->live--;
}

static void req_set(kvt_l3e *e, struct job *j, uint32_t sh, uint32_t op, void *payload)
{
	struct kvt_l3_req *q = &j->q[sh];

	memset(q, 0, sizeof(*q));
	j->iov[sh][0] = (struct iovec){ j->hdr[sh], KVT_L3_HDR_SIZE };
	j->iov[sh][1] = (struct iovec){ payload, (size_t)e->payload };
	j->iov[sh][2] = (struct iovec){ j->tag[sh], KVT_L3_TAG_SIZE };
	q->op = op;
	q->n_keys = 1;
	memcpy(q->key, j->keys[sh], KVT_L3_KEY_MAX);
	q->iov = j->iov[sh];
	q->iovcnt = 3;
	q->tag = (uint64_t)(j - e->jobs) << 8 | sh;
}

/* Submits the job's first n requests; the store's queue is sized for every
 * job's (open), so all are taken. */
static int submit(kvt_l3e *e, struct job *j, uint32_t n)
{
	struct kvt_l3_req *qs[KVT_L3_MAX_SHARDS];

	for (uint32_t i = 0; i < n; i++)
		qs[i] = &j->q[i];
	j->left = n;
	int r = kvt_l3_submit(e->l3, qs, n);
	if (r == (int)n)
		return 0;
	/* cannot happen with the queue's size; if it does, the job waits
	 * for what was taken and fails */
	j->left = r > 0 ? (uint32_t)r : 0;
	j->err = -EAGAIN;
	return -EAGAIN;
}

/* ---- put ---- */

static int put_start(kvt_l3e *e, uint32_t x, const kvt_key *k, uint32_t depth, uint64_t w)
{
	/* the last jobs are the asks': a lookup waits on them, a put does
	 * not (a put backlog must not turn every ask into a miss) */
	struct job *j;

	if (e->stage && e->n_stage_free < e->n_shards) {
		e->info.put_waits++; /* the staging full: the next poll */
		return 0;
	}
	j = e->live + e->reserve < e->o.jobs ? job_get(e, J_PUT) : NULL;
	if (!j)
		return 0;
	j->key = *k;
	j->depth = depth;
	j->slot = x;
	j->w = w;
	if (e->o.test_before_seal) /* the window the life check closes */
		e->o.test_before_seal(e->o.test_arg, x);
	for (uint32_t sh = 0; sh < e->n_shards; sh++) {
		void *p = kvt_slot_shard_ptr(e->s, x, sh), *from = p;
		int r;

		kvt_l3_key(j->keys[sh], e->fp, k, sh);
		if (p && e->stage) { /* encrypted into a buffer of its own */
			j->stage[j->staged] = e->stage_free[--e->n_stage_free];
			from = e->stage + (uint64_t)j->stage[j->staged++] * e->payload;
			r = kvt_l3_encrypt_pieces(e->seal, j->hdr[sh], p, from, j->tag[sh], e->fp,
						  k, sh, e->n_shards, depth, e->payload);
		} else {
			r = !p || kvt_l3_seal_pieces(e->seal, j->hdr[sh], p, j->tag[sh], e->fp, k,
						     sh, e->n_shards, depth, e->payload);
		}
		if (r) {
			e->info.put_drops++;
			job_put(e, j);
			return -1;
		}
		req_set(e, j, sh, KVT_L3_PUT, from);
	}
	/* Sealed over the bytes of this life only: a life that ended between
	 * kvt_slot_ready and the seal leaves another chunk's bytes under this
	 * chunk's tag -- a valid object with the wrong content, which no get
	 * could refuse.  (After the seal, a change fails the tag instead; an
	 * encrypted put's bytes are the staging's, which nothing changes.) */
	if (!kvt_slot_same_life(e->s, x, w)) {
		e->info.put_drops++;
		job_put(e, j);
		return -1;
	}
	submit(e, j, e->n_shards);
	if (!j->left) {
		e->info.put_drops++;
		job_put(e, j);
		return -1;
	}
	return 1;
}

static void put_done(kvt_l3e *e, struct job *j)
{
	/* the life must not have ended while the pieces were read */
	if (j->err || !kvt_slot_same_life(e->s, j->slot, j->w)) {
		e->info.put_drops++;
	} else {
		rec_add(e, &j->key);
		e->info.puts++;
		e->info.put_bytes += e->payload * e->n_shards;
		hist_add(&e->info.put_ns, kvt__now_ns() - j->t0);
	}
	job_put(e, j);
}

static int ghost_has(kvt_l3e *e, const kvt_key *k)
{
	return same(&e->ghost[hash_of(k, NEG_BITS)], k);
}

/* Slot x: 1 put started, 0 stop (no job), -1 next. */
static int put_consider(kvt_l3e *e, uint32_t x)
{
	kvt_key k;
	uint32_t depth, ref;
	uint64_t w;

	if (!kvt_slot_ready(e->s, x, &k, &depth, &ref, &w))
		return -1;
	uint32_t g = (uint32_t)(w >> 24) + 1;
	if (!g)
		g = 1;
	if (e->seen[x] == g && !e->rejected[x])
		return -1; /* this life was put, found, or dropped already */
	if (rec_has(e, &k)) {
		e->seen[x] = g;
		e->rejected[x] = 0;
		return -1;
	}
	/* (a put in flight for this life was marked seen when it started;
	 * a get in flight holds its slot FILLING, never READY) */
	/* second-hit: hit in DRAM since it was saved, or a new life of a key
	 * refused before (evicted and saved again: asked for twice) */
	if (e->o.admit == KVT_ADMIT_SECOND_HIT && ref < 2 &&
	    (e->seen[x] == g || !ghost_has(e, &k))) {
		if (e->seen[x] != g) {
			e->ghost[hash_of(&k, NEG_BITS)] = k;
			e->info.put_skips++;
		}
		e->seen[x] = g;
		e->rejected[x] = 1;
		return -1;
	}
	int r = put_start(e, x, &k, depth, w);
	if (r != 0) { /* started or dropped: this life is done with */
		e->seen[x] = g;
		e->rejected[x] = 0;
	}
	return r;
}

static int put_scan(kvt_l3e *e)
{
	uint64_t h = kvt_seg_clock_hand(e->s), n = e->n_slots;
	int started = 0;

	uint64_t now = kvt__now_ns();

	if (e->o.admit == KVT_ADMIT_NONE)
		return 0;
	/* a lap that started nothing, and no slot allocated since: look again
	 * after 100 ms (a chunk refused by second-hit may have been hit) */
	if (e->lap_idle >= n) {
		if (h == e->idle_hand && now - e->idle_ns < 100000000ull)
			return 0;
		e->lap_idle = 0;
	}
	if (e->cursor < h || e->cursor >= h + n)
		e->cursor = h; /* from the hand: what is evicted next goes first */
	for (uint32_t i = 0; i < e->o.scan && e->cursor < h + n &&
			     e->live + e->reserve < e->o.jobs; i++) {
		int r = put_consider(e, (uint32_t)(e->cursor % n));
		if (r == 0)
			break;
		e->cursor++;
		if (r == 1) {
			started++;
			e->lap_idle = 0;
		} else if (++e->lap_idle == n) {
			e->idle_hand = h;
			e->idle_ns = now;
		}
	}
	return started;
}

/* ---- fetch ---- */

/* A get that cannot start: the first `claimed` shard claims freed, the
 * chunk a miss (counted, remembered for its depth), the job ended. */
static void get_drop(kvt_l3e *e, struct job *j, uint32_t claimed)
{
	while (claimed--)
		kvt_write_end(e->s, &j->wr[claimed], 0);
	e->info.get_drops++;
	neg_add(e, &j->key, j->depth);
	answer(e, &j->key, KVT_L3E_MISSING);
	job_put(e, j);
}

static void get_start(kvt_l3e *e, struct job *j)
{
	uint32_t sh;

	/* in DRAM meanwhile (a rank saved it, another fetch): nothing to do */
	if (kvt_seg_peek(e->s, &j->key, 1) == 1) {
		answer(e, &j->key, KVT_L3E_HERE);
		job_put(e, j);
		return;
	}
	for (sh = 0; sh < e->n_shards; sh++) {
		int r = kvt_write_begin(e->s, &j->key, j->depth, sh, &j->wr[sh]);

		if (r == KVT_SKIP && sh == 0) {
			answer(e, &j->key, KVT_L3E_HERE);
			job_put(e, j);
			return;
		}
		if (r) { /* no slot, or a rank writes a shard now: its save wins */
			get_drop(e, j, sh);
			return;
		}
	}
	j->kind = J_GET;
	j->slot = j->wr[0].slot;
	for (sh = 0; sh < e->n_shards; sh++)
		req_set(e, j, sh, KVT_L3_GET, kvt_slot_shard_ptr(e->s, j->wr[sh].slot, sh));
	if (submit(e, j, e->n_shards) && !j->left) {
		get_drop(e, j, e->n_shards);
		return;
	}
	/* claimed: the asker's lookups see the chunk (FILLING) until the
	 * gets end, published or freed */
	answer(e, &j->key, KVT_L3E_HERE);
}

static void exists_done(kvt_l3e *e, struct job *j)
{
	if (j->err) {
		/* not there, or the store failed: a miss either way, and
		 * remembered, so that asking again is answered at once */
		if (j->err == -ENOENT)
			e->info.misses++;
		else
			e->info.get_drops++;
		neg_add(e, &j->key, j->depth);
		answer(e, &j->key, KVT_L3E_MISSING);
		job_put(e, j);
	} else {
		get_start(e, j);
	}
}

static void get_done(kvt_l3e *e, struct job *j)
{
	int ok = !j->err;

	for (uint32_t sh = 0; ok && sh < e->n_shards; sh++)
		if (kvt_l3_check_pieces(e->seal, j->hdr[sh],
					kvt_slot_shard_ptr(e->s, j->wr[sh].slot, sh), j->tag[sh],
					e->fp, &j->key, sh, e->n_shards, j->depth, e->payload)) {
			ok = 0;
			e->info.refused++;
			elog(e, 1, "key %016llx%016llx shard %u: the object's check failed (torn, "
			     "forged, another layout's or written without the fleet key): a "
			     "miss, not served", (unsigned long long)j->key.hi,
			     (unsigned long long)j->key.lo, sh);
		}
	for (uint32_t sh = 0; sh < e->n_shards; sh++)
		kvt_write_end(e->s, &j->wr[sh], ok);
	if (ok) {
		rec_add(e, &j->key); /* in the store: not put again */
		e->info.gets++;
		e->info.get_bytes += e->payload * e->n_shards;
		hist_add(&e->info.get_ns, kvt__now_ns() - j->t0);
	} else {
		/* the asker, told HERE at the claim, finds the chunk gone and
		 * asks again: the negative cache answers MISSING at once */
		neg_add(e, &j->key, j->depth);
		if (j->err == -ENOENT) /* evicted since the EXISTS */
			e->info.misses++;
		else if (j->err)
			e->info.get_drops++;
	}
	job_put(e, j);
}

/* A (key, depth) a job or the queue asks for already. */
static int asked_already(const kvt_l3e *e, const kvt_key *k, uint32_t depth)
{
	uint32_t i;

	return kvt_l3_asks_find(&e->as, k, depth, &i);
}

/* The EXISTS of an ask, in job j. */
static int exists_start(kvt_l3e *e, struct job *j, const kvt_key *k, uint32_t depth)
{
	j->key = *k;
	j->depth = depth;
	kvt_l3_asks_add(&e->as, k, depth); /* until job_put */
	for (uint32_t sh = 0; sh < e->n_shards; sh++)
		kvt_l3_key(j->keys[sh], e->fp, k, sh);
	memset(&j->q[0], 0, sizeof(j->q[0]));
	j->q[0].op = KVT_L3_EXISTS;
	j->q[0].n_keys = e->n_shards;
	j->q[0].keys = (const char (*)[KVT_L3_KEY_MAX])j->keys;
	j->q[0].tag = (uint64_t)(j - e->jobs) << 8;
	e->info.fetches++;
	if (submit(e, j, 1)) {
		/* the store refused at once (down): its completion, if any, is
		 * not awaited by anyone */
		if (!j->left)
			job_put(e, j);
		neg_add(e, k, depth);
		return KVT_L3E_MISSING;
	}
	return KVT_L3E_ASKED;
}

/* fresh: set when this call started (or queued) the ask. */
static int ask(kvt_l3e *e, const kvt_key *k, uint32_t depth, int *fresh)
{
	struct job *j;

	*fresh = 0;
	if (depth == KVT_L3_ANY_DEPTH)
		return KVT_L3E_MISSING; /* the check's "any", never an asker's depth */
	if (kvt_seg_peek(e->s, k, 1) == 1)
		return KVT_L3E_HERE;
	if (neg_has(e, k, depth, kvt__now_ns())) {
		e->info.negative_hits++;
		return KVT_L3E_MISSING;
	}
	if (asked_already(e, k, depth))
		return KVT_L3E_ASKED; /* its answer comes with that one's */
	*fresh = 1;
	if (!(j = job_get(e, J_EXISTS))) {
		/* every job busy: queued (a long prompt asks for more chunks
		 * than there are jobs), a miss only when the queue is full */
		if (e->aq_n == AQ_MAX) {
			*fresh = 0;
			e->info.ask_drops++;
			return KVT_L3E_MISSING;
		}
		uint32_t t = (e->aq_head + e->aq_n++) % AQ_MAX;
		e->aq[t].k = *k;
		e->aq[t].depth = depth;
		kvt_l3_asks_add(&e->as, k, depth); /* until asks_start takes it */
		return KVT_L3E_ASKED;
	}
	return exists_start(e, j, k, depth);
}

int kvt_l3e_ask(kvt_l3e *e, const kvt_key *k, uint32_t depth)
{
	int fresh;

	return ask(e, k, depth, &fresh);
}

int kvt_l3e_fetch(kvt_l3e *e, const kvt_key *keys, const uint32_t *depths, uint32_t n)
{
	int asked = 0, fresh;

	for (uint32_t i = 0; i < n; i++)
		if (ask(e, &keys[i], depths[i], &fresh) == KVT_L3E_ASKED && fresh)
			asked++;
	return asked;
}

/* The queued asks, while jobs are free (before the put scan takes them):
 * what meanwhile came into DRAM or was remembered missing is answered. */
static int asks_start(kvt_l3e *e)
{
	int n = 0;

	while (e->aq_n) {
		struct job *j = NULL;
		kvt_key k = e->aq[e->aq_head].k;
		uint32_t depth = e->aq[e->aq_head].depth;
		int here = kvt_seg_peek(e->s, &k, 1) == 1;
		int neg = !here && neg_has(e, &k, depth, kvt__now_ns());

		if (!here && !neg && !(j = job_get(e, J_EXISTS)))
			break;
		e->aq_head = (e->aq_head + 1) % AQ_MAX;
		e->aq_n--;
		n++;
		kvt_l3_asks_del(&e->as, &k, depth); /* in a job again below, or answered */
		if (here)
			answer(e, &k, KVT_L3E_HERE);
		else if (neg)
			answer(e, &k, KVT_L3E_MISSING);
		else if (exists_start(e, j, &k, depth) == KVT_L3E_MISSING)
			answer(e, &k, KVT_L3E_MISSING);
	}
	return n;
}

/* ---- the loop ---- */

static int completions(kvt_l3e *e)
{
	struct kvt_l3_req *done[64];
	int n, total = 0;

	while ((n = kvt_l3_reap(e->l3, done, 64)) > 0) {
		for (int i = 0; i < n; i++) {
			uint64_t ji = done[i]->tag >> 8;
			struct job *j;

			if (ji >= e->o.jobs)
				continue;
			j = &e->jobs[ji];
			if (done[i]->status && !j->err)
				j->err = done[i]->status;
			if (j->left && --j->left)
				continue;
			if (j->kind == J_PUT)
				put_done(e, j);
			else if (j->kind == J_EXISTS)
				exists_done(e, j);
			else if (j->kind == J_GET)
				get_done(e, j);
		}
		total += n;
	}
	return total;
}

/* Completions, then the queued asks, then (scan) the puts. */
static int step(kvt_l3e *e, int scan)
{
	int n = completions(e);

	n += asks_start(e);
	return scan ? n + put_scan(e) : n;
}

int kvt_l3e_poll(kvt_l3e *e)
{
	return step(e, 1);
}

void kvt_l3e_set_answer(kvt_l3e *e, void (*fn)(void *, const kvt_key *, int), void *arg)
{
	e->o.answer = fn;
	e->o.answer_arg = arg;
}

int kvt_l3e_event_fd(const kvt_l3e *e)
{
	return kvt_l3_event_fd(e->l3);
}

int kvt_l3e_drain(kvt_l3e *e, int put_all, int64_t timeout_ns)
{
	uint64_t end = timeout_ns < 0 ? UINT64_MAX : kvt__now_ns() + (uint64_t)timeout_ns;

	for (;;) {
		/* the scan only when asked to put everything: a close must end */
		int n = step(e, put_all);

		if (!e->live && !e->aq_n && (!put_all || !n))
			return 0;
		if (kvt__now_ns() >= end)
			return -ETIMEDOUT;
		if (e->live) {
			struct pollfd p = { .fd = kvt_l3_event_fd(e->l3), .events = POLLIN };
			poll(&p, 1, 10);
		}
	}
}

void kvt_l3e_info(kvt_l3e *e, struct kvt_l3e_info *out)
{
	*out = e->info;
	out->inflight = e->live;
	out->asking = e->as.n;
	kvt_l3_status(e->l3, &out->store);
}

/* The staging of encrypted puts: buffers of one shard's payload, as many
 * as the put jobs can fill, at most stage_bytes (64 MiB) but at least one
 * chunk's.  A memfd, so that a backend's companion can map it (as the
 * arena: kvt_l3_conf.stage); never registered for a peer to reach. */
static int stage_open(kvt_l3e *e, char *err, size_t len)
{
	uint64_t cap = e->o.stage_bytes ? e->o.stage_bytes : 64ull << 20;
	uint64_t want = (uint64_t)(e->o.jobs - e->reserve) * e->n_shards, n = cap / e->payload;

	if (n > want)
		n = want;
	if (n < e->n_shards)
		n = e->n_shards;
	e->stage_fd = memfd_create("kvtier-l3-stage", MFD_CLOEXEC);
	e->stage_free = calloc(n, sizeof(*e->stage_free));
	if (e->stage_fd < 0 || !e->stage_free || ftruncate(e->stage_fd, (off_t)(n * e->payload)) ||
	    (e->stage = mmap(NULL, n * e->payload, PROT_READ | PROT_WRITE, MAP_SHARED,
			     e->stage_fd, 0)) == MAP_FAILED) {
		int rc = errno ? -errno : -ENOMEM;
		e->stage = NULL;
		snprintf(err, len, "l3: the staging of encrypted puts (%llu bytes): %s",
			 (unsigned long long)(n * e->payload), strerror(-rc));
		return rc;
	}
	e->n_stage = (uint32_t)n;
	for (uint32_t i = e->n_stage; i-- > 0;)
		e->stage_free[e->n_stage_free++] = i;
	e->info.stage_bytes = n * e->payload;
	e->o.store.stage = e->stage;
	e->o.store.stage_len = n * e->payload;
	e->o.store.stage_fd = e->stage_fd;
	return 0;
}

static void stage_close(kvt_l3e *e)
{
	if (e->stage)
		munmap(e->stage, (uint64_t)e->n_stage * e->payload);
	if (e->stage_fd >= 0)
		close(e->stage_fd);
	free(e->stage_free);
	e->stage = NULL;
	e->stage_fd = -1;
	e->stage_free = NULL;
}

int kvt_l3e_open(kvt_seg *s, const struct kvt_l3e_opts *o, kvt_l3e **out, char *err,
		 size_t len)
{
	kvt_l3e *e;
	kvt_key fp;
	int rc;

	*out = NULL;
	if (!s || !o || o->size < sizeof(*o) || !o->key_path || o->jobs > JOBS_MAX ||
	    o->admit > KVT_ADMIT_NONE)
		return snprintf(err, len, "l3: bad options (a key file is required; jobs <= 256)"),
		       -EINVAL;
	if (kvt_seg_n_shards(s) > KVT_L3_MAX_SHARDS)
		return snprintf(err, len, "l3: %u shards, at most %u", kvt_seg_n_shards(s),
				KVT_L3_MAX_SHARDS), -EINVAL;
	e = calloc(1, sizeof(*e));
	if (!e)
		return snprintf(err, len, "out of memory"), -ENOMEM;
	e->s = s;
	e->o = *o;
	e->stage_fd = -1;
	if (!e->o.jobs)
		e->o.jobs = 32;
	if (!e->o.scan)
		e->o.scan = 1024;
	if (!e->o.negative_ms)
		e->o.negative_ms = 2000;
	e->reserve = e->o.jobs > 1 && e->o.jobs < 4 ? 1 : e->o.jobs / 4;
	e->n_shards = kvt_seg_n_shards(s);
	e->n_slots = kvt_seg_geometry(s)->n_slots;
	e->payload = kvt_seg_chunk_bytes(s);
	kvt_seg_fingerprint(s, &fp);
	e->fp = fp.lo ^ fp.hi;
	if (e->payload > UINT32_MAX) {
		snprintf(err, len, "l3: a shard of %llu bytes: objects hold at most 4 GiB",
			 (unsigned long long)e->payload);
		free(e);
		return -EINVAL;
	}
	e->jobs = calloc(e->o.jobs, sizeof(*e->jobs));
	e->seen = calloc(e->n_slots, sizeof(*e->seen));
	e->rejected = calloc(e->n_slots, 1);
	if (!e->jobs || !e->seen || !e->rejected) {
		free(e->jobs);
		free(e->seen);
		free(e->rejected);
		free(e);
		return snprintf(err, len, "out of memory"), -ENOMEM;
	}
	rc = kvt_l3_seal_open(o->key_path, (int)o->create_key, &e->seal, &e->info.key_created,
			      err, len);
	if (rc)
		goto fail;
	if (o->encrypt && (rc = stage_open(e, err, len)))
		goto fail;
	/* room for every job's requests: submit never comes back short */
	if (e->o.store.depth < e->o.jobs * e->n_shards)
		e->o.store.depth = e->o.jobs * e->n_shards;
	/* the arena, for a backend that registers it (mooncake): its file
	 * is the handle's own description, so a companion that maps it keeps
	 * this entry -- and the claims its gets land in -- live as long as
	 * it can write (l3_mooncake.c) */
	void *arena;
	uint64_t arena_len;
	if (!e->o.store.mem && !kvt_seg_arena(s, UINT32_MAX, &arena, &arena_len) &&
	    kvt_seg_lock_fd(s) >= 0) {
		e->o.store.mem = arena;
		e->o.store.mem_len = arena_len;
		e->o.store.mem_off = (uint64_t)((uint8_t *)arena - (uint8_t *)kvt_seg_base(s));
		e->o.store.mem_fd = kvt_seg_lock_fd(s);
	}
	rc = kvt_l3_open(&e->o.store, &e->l3, err, len);
	if (rc)
		goto fail;
	*out = e;
	return 0;
fail:
	stage_close(e);
	kvt_l3_seal_close(e->seal);
	free(e->jobs);
	free(e->seen);
	free(e->rejected);
	free(e);
	return rc;
}

void kvt_l3e_close(kvt_l3e *e)
{
	if (!e)
		return;
	/* every request completes within the store's timeouts: gets release
	 * their claims (unchecked ones unpublished), puts end */
	kvt_l3e_drain(e, 0, -1);
	kvt_l3_close(e->l3);
	stage_close(e);
	kvt_l3_seal_close(e->seal);
	free(e->jobs);
	free(e->seen);
	free(e->rejected);
	free(e);
}
