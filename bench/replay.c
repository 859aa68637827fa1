/* replay.c - kvtier-bench replay: a Mooncake-format request trace fed
 * through the real engine API (kvtier.h), with the hit rates of LRU and
 * Belady computed offline on the same requests.
 *
 * The trace is JSONL, one request per line:
 *   {"timestamp": 27482, "input_length": 6955, "output_length": 52,
 *    "hash_ids": [46, 47, 48, ...]}
 * A hash id names a 512-token block *and its whole prefix* (equal ids, equal
 * prefix KV), so it is used directly as the chunk key: key = {id, KEY_HI}.
 * A chunk is one trace block (chunk_tokens = 512; the last block of a
 * prompt may be partial in the trace; it is replayed as a chunk too).
 *
 * The tier.  A segment of --capacity slots (one chunk each), created by
 * this process as a CLIENT of world 1 with the host DMA backend
 * (KVT_F_NO_ENV: KVTIER_* variables do not change the run).  The "device"
 * KV cache is a malloc'd buffer: one layer group of 1 layer,
 * --bytes-per-token bytes per token, --block-tokens tokens per block; a
 * request's chunk j lives in blocks perm[j*bpc .. (j+1)*bpc) of a fixed
 * random permutation, so copies gather scattered blocks as an engine's do.
 *
 * Per request, one scheduler step:
 *   1. HBM: with --hbm-chunks N, an LRU of N chunks models the engine's own
 *      GPU prefix cache: the longest prefix of the request present there
 *      is an HBM hit, and the tier is asked only for the rest (the GPU-miss
 *      tail), from that position on, as engines do.
 *   2. kvt_lookup(tail) -> hits + lease; kvt_step(this lease).
 *   3. kvt_load(lease, hits) + kvt_wait: the lease is released by the load
 *      (world 1).  The loaded blocks are checked: each block carries a stamp
 *      (its chunk's id and its index) written before it was saved.
 *   4. kvt_save(the tail's misses, first_depth = their position) + kvt_wait
 *      (chunks present in the tier beyond the first miss are deduplicated).
 *   5. The HBM LRU is touched with every chunk of the request, tail first,
 *      so a request's prefix is its most recent part (vLLM frees a
 *      request's blocks tail first).
 * Latencies are CLOCK_MONOTONIC per call: lookup = kvt_lookup; load =
 * kvt_load + kvt_wait; save = kvt_save + kvt_wait (one sample per request
 * that had something to load / save).
 *
 * Offline, on the same tier requests (the tails of step 1) and the same
 * capacity in chunks:
 *   LRU     one list of chunks; a request's chunks are touched after it is
 *           counted, tail first (as the HBM LRU).
 *   Belady  OPT over the stream of the tails' chunks in order: on a miss
 *           with a full cache, the chunk whose next use is farthest is
 *           evicted, or the new chunk is not kept when its own next use is
 *           the farthest.
 * Two hit rates each: "prefix" counts, per request, the leading run of hit
 * chunks (what a tier lookup can return, comparable to the tier's); "chunk"
 * counts every chunk found (an upper bound ignoring prefix order).  Belady
 * is optimal for the chunk rate; for the prefix rate it is the usual
 * reference, not a proven bound.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvt_clock.h"
#include "kvtier.h"
#include "trace.h"
#include "kvt_core.h" /* KVT_NAME_MAX; the disk engine's handle */
#include "kvt_disk.h"

#define KEY_HI         0x6b76747265706c79ULL /* "kvtreply" */
#define CHUNK_TOKENS   512u                  /* one Mooncake trace block */
/* the trace shipped next to the repository, from the repository root */
#define DEFAULT_TRACE  "../shared/traces/mooncake_conversation_trace.jsonl"
#define STAMP_MAGIC    0x706d6174u                           /* "tamp" */
#define NONE           UINT32_MAX       /* no index / not cached */
#define NEVER          (UINT32_MAX - 1) /* next use: none */

struct opts {
	const char *trace;
	char segment[KVT_NAME_MAX + 1];
	uint32_t capacity;
	uint32_t hbm_chunks;
	uint32_t limit;
	uint32_t bytes_per_token;
	uint32_t block_tokens;
	int json;
	int keep;
	const char *disk;       /* --disk: a disk tier on this file */
	uint64_t disk_bytes;    /* its size: what holds disk_chunks */
	uint32_t disk_chunks;
	uint32_t disk_admit;
};

/* ---- the trace: bench/trace.c ---- */

/* ---- LRU over dense chunk indices ---------------------------------------- */

struct lru {
	uint32_t *prev, *next;
	uint8_t *in;
	uint32_t head, tail, count, cap;
};

static int lru_init(struct lru *l, uint32_t n_ids, uint32_t cap)
{
	memset(l, 0, sizeof(*l));
	l->prev = malloc((size_t)n_ids * sizeof(*l->prev));
	l->next = malloc((size_t)n_ids * sizeof(*l->next));
	l->in = calloc(n_ids ? n_ids : 1, 1);
	l->head = l->tail = NONE;
	l->cap = cap;
	return l->prev && l->next && l->in ? 0 : -ENOMEM;
}

static void lru_fini(struct lru *l)
{
	free(l->prev);
	free(l->next);
	free(l->in);
}

static void lru_unlink(struct lru *l, uint32_t x)
{
	if (l->prev[x] != NONE)
		l->next[l->prev[x]] = l->next[x];
	else
		l->head = l->next[x];
	if (l->next[x] != NONE)
		l->prev[l->next[x]] = l->prev[x];
	else
		l->tail = l->prev[x];
}

/* Makes x the most recent, inserting it (and evicting the least recent
 * beyond the capacity). */
static void lru_touch(struct lru *l, uint32_t x)
{
	if (!l->cap)
		return;
	if (l->in[x]) {
		lru_unlink(l, x);
	} else {
		l->in[x] = 1;
		if (++l->count > l->cap) {
			uint32_t v = l->tail;
			lru_unlink(l, v);
			l->in[v] = 0;
			l->count--;
		}
	}
	l->prev[x] = NONE;
	l->next[x] = l->head;
	if (l->head != NONE)
		l->prev[l->head] = x;
	l->head = x;
	if (l->tail == NONE)
		l->tail = x;
}

/* ---- offline policies -------------------------------------------------- */

struct sim {
	uint64_t asked, prefix_hits, chunk_hits;
};

/* start[r]: the first chunk of request r the tier is asked for. */
static int sim_lru(const struct trace *t, const uint32_t *start, uint32_t cap, struct sim *s)
{
	struct lru l;

	memset(s, 0, sizeof(*s));
	if (lru_init(&l, t->n_ids, cap)) {
		lru_fini(&l);
		return -ENOMEM;
	}
	for (uint32_t r = 0; r < t->n_req; r++) {
		const uint32_t *c = t->ids + t->off[r];
		uint32_t n = t->off[r + 1] - t->off[r], j = start[r], lead = 1;
		for (; j < n; j++) {
			s->asked++;
			if (l.in[c[j]]) {
				s->chunk_hits++;
				s->prefix_hits += lead;
			} else {
				lead = 0;
			}
		}
		for (j = n; j-- > start[r];)
			lru_touch(&l, c[j]);
	}
	lru_fini(&l);
	return 0;
}

struct hent {
	uint32_t next, id;
};

static void heap_push(struct hent *h, uint64_t *n, struct hent e)
{
	uint64_t i = (*n)++;
	while (i) {
		uint64_t p = (i - 1) / 2;
		if (h[p].next >= e.next)
			break;
		h[i] = h[p];
		i = p;
	}
	h[i] = e;
}

static void heap_pop(struct hent *h, uint64_t *n)
{
	struct hent e = h[--(*n)];
	uint64_t i = 0;

	for (;;) {
		uint64_t c = 2 * i + 1;
		if (c >= *n)
			break;
		if (c + 1 < *n && h[c + 1].next > h[c].next)
			c++;
		if (h[c].next <= e.next)
			break;
		h[i] = h[c];
		i = c;
	}
	if (*n)
		h[i] = e;
}

static int sim_belady(const struct trace *t, const uint32_t *start, uint32_t cap,
		      struct sim *s)
{
	uint64_t m = 0, pos = 0, hn = 0, count = 0;
	uint32_t *nextuse = NULL, *last = NULL, *cur = NULL;
	struct hent *heap = NULL;
	int ret = -ENOMEM;

	memset(s, 0, sizeof(*s));
	for (uint32_t r = 0; r < t->n_req; r++)
		m += t->off[r + 1] - t->off[r] - start[r];
	if (m >= NEVER)
		return -EOVERFLOW;
	nextuse = malloc((m ? m : 1) * sizeof(*nextuse));
	last = malloc((size_t)(t->n_ids ? t->n_ids : 1) * sizeof(*last));
	cur = malloc((size_t)(t->n_ids ? t->n_ids : 1) * sizeof(*cur));
	heap = malloc((m ? m : 1) * sizeof(*heap));
	if (!nextuse || !last || !cur || !heap)
		goto out;
	for (uint32_t i = 0; i < t->n_ids; i++) {
		last[i] = NEVER;
		cur[i] = NONE;
	}
	/* next use of each position of the stream, backwards */
	pos = m;
	for (uint32_t r = t->n_req; r-- > 0;) {
		const uint32_t *c = t->ids + t->off[r];
		for (uint32_t j = t->off[r + 1] - t->off[r]; j-- > start[r];) {
			pos--;
			nextuse[pos] = last[c[j]];
			last[c[j]] = (uint32_t)pos;
		}
	}
	pos = 0;
	for (uint32_t r = 0; r < t->n_req; r++) {
		const uint32_t *c = t->ids + t->off[r];
		uint32_t n = t->off[r + 1] - t->off[r], lead = 1;
		for (uint32_t j = start[r]; j < n; j++, pos++) {
			uint32_t x = c[j], nu = nextuse[pos];
			s->asked++;
			if (cur[x] != NONE) {
				s->chunk_hits++;
				s->prefix_hits += lead;
				cur[x] = nu;
				heap_push(heap, &hn, (struct hent){ nu, x });
				continue;
			}
			lead = 0;
			if (!cap)
				continue;
			if (count == cap) {
				/* drop stale entries: an entry is live iff it holds
				 * the id's current next use (positions are unique; an
				 * id whose next use is NEVER is not accessed again) */
				while (hn && cur[heap[0].id] != heap[0].next)
					heap_pop(heap, &hn);
				if (nu >= heap[0].next)
					continue; /* the newcomer is needed last: not kept */
				cur[heap[0].id] = NONE;
				heap_pop(heap, &hn);
				count--;
			}
			cur[x] = nu;
			heap_push(heap, &hn, (struct hent){ nu, x });
			count++;
		}
	}
	ret = 0;
out:
	free(nextuse);
	free(last);
	free(cur);
	free(heap);
	return ret;
}

/* The HBM prefix cache in front of the tier: start[r] = the length of the
 * longest prefix of request r present in an LRU of hbm chunks (0 without
 * one); the request's chunks are then touched, tail first. */
static int hbm_starts(const struct trace *t, uint32_t hbm, uint32_t *start, uint64_t *hits)
{
	struct lru l;

	*hits = 0;
	if (!hbm) {
		memset(start, 0, (size_t)t->n_req * sizeof(*start));
		return 0;
	}
	if (lru_init(&l, t->n_ids, hbm)) {
		lru_fini(&l);
		return -ENOMEM;
	}
	for (uint32_t r = 0; r < t->n_req; r++) {
		const uint32_t *c = t->ids + t->off[r];
		uint32_t n = t->off[r + 1] - t->off[r], h = 0;
		while (h < n && l.in[c[h]])
			h++;
		start[r] = h;
		*hits += h;
		for (uint32_t j = n; j-- > 0;)
			lru_touch(&l, c[j]);
	}
	lru_fini(&l);
	return 0;
}

/* ---- the replay through kvtier.h ------------------------------------------ */

struct lat {
	uint64_t *ns;
	uint64_t n, chunks;
};

struct pct {
	double p50, p90, p99, max, mean_chunks;
	uint64_t n;
};

struct result {
	uint64_t requests, chunks, hbm_hits, asked, hits, saves_asked, saves_written;
	uint64_t verified, bad_stamps, load_errors, save_errors;
	struct lat lookup, load, save, promote;
	double seconds;
	struct kvt_stats st;
	struct sim lru, opt;
	/* with a disk tier */
	uint64_t disk_pending, disk_hits, dram_hits_alone, dram_asked_alone;
	struct sim lru_all, opt_all, inf;
};

struct stamp {
	uint64_t id;
	uint32_t block;
	uint32_t magic;
};

static void lat_add(struct lat *l, uint64_t ns, uint32_t chunks)
{
	l->ns[l->n++] = ns;
	l->chunks += chunks;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* Nearest-rank percentile q (0..1] of sorted samples, in µs. */
static double rank_us(const struct lat *l, double q)
{
	uint64_t k = (uint64_t)(q * (double)l->n + 0.999999);

	k = k ? k - 1 : 0;
	return (double)l->ns[k < l->n ? k : l->n - 1] / 1e3;
}

static struct pct lat_pct(struct lat *l)
{
	struct pct p = { 0 };

	p.n = l->n;
	if (!l->n)
		return p;
	qsort(l->ns, l->n, sizeof(*l->ns), cmp_u64);
	p.p50 = rank_us(l, 0.50);
	p.p90 = rank_us(l, 0.90);
	p.p99 = rank_us(l, 0.99);
	p.max = (double)l->ns[l->n - 1] / 1e3;
	p.mean_chunks = (double)l->chunks / (double)l->n;
	return p;
}

/* Removes the segment wherever the library put it (kvt_unlink looks in
 * POSIX shm and the hugetlbfs mounts a creator uses). */
static void remove_segment(const char *name)
{
	(void)kvt_unlink(name, NULL);
}

static int fail(const char *what, int r)
{
	fprintf(stderr, "kvtier-bench replay: %s: %s (%s)\n", what, kvt_last_error(),
		kvt_strerror(r));
	return r;
}

/* The disk tier's engine, in this process: a second attachment of the
 * segment through core (a CLIENT entry that owns the segment), as kvtierd
 * holds it.  Between requests the replay lets it finish its writes (an
 * engine that keeps up with the saves) and, for a request with chunks
 * pending on disk, its reads: the promotion latency is the request's
 * wait from its first lookup to the lookup that hits them. */
struct disk_run {
	kvt_seg *seg;
	kvt_disk *d;
};

static int disk_start(const struct opts *o, struct disk_run *dr)
{
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = o->segment, .dir = "/dev/shm",
					 .role = KVT_ROLE_CLIENT };
	char err[512];
	int r = kvt_seg_attach(&a, &dr->seg);

	if (!r)
		r = kvt_seg_own(dr->seg);
	if (r) {
		fprintf(stderr, "kvtier-bench replay: disk engine's handle: %s\n",
			kvt_core_last_error());
		return r;
	}
	/* an empty disk: the run starts from nothing (a file left by an
	 * earlier run would be replayed, and its chunks hit) */
	if (unlink(o->disk) && errno != ENOENT) {
		fprintf(stderr, "kvtier-bench replay: %s: %s\n", o->disk, strerror(errno));
		return -errno;
	}
	struct kvt_disk_opts dop = { .size = sizeof(dop), .path = o->disk, .bytes = o->disk_bytes,
				     .admit = o->disk_admit, .reset = 1 };
	r = kvt_disk_open(dr->seg, &dop, &dr->d, err, sizeof(err));
	if (r)
		fprintf(stderr, "kvtier-bench replay: %s\n", err);
	return r;
}

static void disk_stop(const struct opts *o, struct disk_run *dr)
{
	kvt_disk_close(dr->d);
	if (dr->d && !o->keep)
		unlink(o->disk);
	if (dr->seg)
		kvt_seg_detach(dr->seg);
	memset(dr, 0, sizeof(*dr));
}

static int replay_run(const struct opts *o, const struct trace *t, const uint32_t *start,
		      struct result *res, int with_disk)
{
	struct disk_run dr = { 0 };
	const uint32_t bpc = CHUNK_TOKENS / o->block_tokens;
	const uint64_t block_bytes = (uint64_t)o->block_tokens * o->bytes_per_token;
	const uint64_t n_blocks = (uint64_t)(t->max_len ? t->max_len : 1) * bpc;
	struct kvt_group_desc gd = { .n_layers = 1, .bytes_per_token = o->bytes_per_token,
				     .tokens_per_block = o->block_tokens, .replicated = 0 };
	struct kvt_config cfg;
	struct kvt_group_buffers gb;
	kvt_tier *tier = NULL;
	uint8_t *dev = NULL;
	uint32_t *perm = NULL;
	kvt_key *keys = NULL;
	uint64_t base, seed = 0x9e3779b97f4a7c15ULL, t0;
	int r;

	res->lookup.ns = calloc(t->n_req ? t->n_req : 1, sizeof(uint64_t));
	res->promote.ns = calloc(t->n_req ? t->n_req : 1, sizeof(uint64_t));
	res->load.ns = calloc(t->n_req ? t->n_req : 1, sizeof(uint64_t));
	res->save.ns = calloc(t->n_req ? t->n_req : 1, sizeof(uint64_t));
	perm = malloc(n_blocks * sizeof(*perm));
	keys = malloc((size_t)(t->max_len ? t->max_len : 1) * sizeof(*keys));
	if (posix_memalign((void **)&dev, 4096, n_blocks * block_bytes))
		dev = NULL;
	if (!res->lookup.ns || !res->load.ns || !res->save.ns || !res->promote.ns || !perm ||
	    !keys || !dev) {
		r = -ENOMEM;
		fprintf(stderr, "kvtier-bench replay: out of memory\n");
		goto out_free;
	}
	memset(dev, 0, n_blocks * block_bytes);
	/* a fixed shuffle of the device blocks: a request's chunk j uses
	 * blocks perm[j * bpc ..], scattered as an engine's block table */
	for (uint64_t i = 0; i < n_blocks; i++)
		perm[i] = (uint32_t)i;
	for (uint64_t i = n_blocks; i > 1; i--) {
		seed ^= seed << 13;
		seed ^= seed >> 7;
		seed ^= seed << 17;
		uint64_t k = seed % i;
		uint32_t x = perm[i - 1];
		perm[i - 1] = perm[k];
		perm[k] = x;
	}

	memset(&cfg, 0, sizeof(cfg));
	cfg.size = sizeof(cfg);
	cfg.flags = KVT_F_CREATE | KVT_F_REPLACE | KVT_F_NO_ENV;
	cfg.role = KVT_TIER_CLIENT;
	cfg.instance = 0;
	cfg.rank = 0;
	cfg.world = 1;
	cfg.chunk_tokens = CHUNK_TOKENS;
	cfg.segment = o->segment;
	cfg.model = "kvtier-bench-replay";
	cfg.dma = "host";
	cfg.n_groups = 1;
	cfg.groups = &gd;
	cfg.n_slots = o->capacity;
	if (with_disk) {
		cfg.disk_chunks = o->disk_chunks;
		cfg.segment_dir = "/dev/shm"; /* where the engine's handle finds it */
	}
	r = kvt_open(&cfg, &tier);
	if (r) {
		fail("open", r);
		goto out_free;
	}
	if (with_disk && (r = disk_start(o, &dr)))
		goto out_close;
	base = (uint64_t)(uintptr_t)dev;
	gb.layer_base = &base;
	gb.block_stride = block_bytes;
	gb.n_blocks = n_blocks;
	r = kvt_register_kv(tier, 1, &gb);
	if (r) {
		fail("register_kv", r);
		goto out_close;
	}

	t0 = kvt__now_ns();
	for (uint32_t q = 0; q < t->n_req; q++) {
		const uint32_t *c = t->ids + t->off[q];
		const uint32_t n = t->off[q + 1] - t->off[q], s = start[q], ask = n - s;
		kvt_lease_id lease = 0;
		kvt_op op = 0;
		int hits;
		uint64_t a, b;

		res->requests++;
		res->chunks += n;
		res->hbm_hits += s;
		if (!ask) { /* all in HBM: the tier is not asked */
			kvt_step(tier, NULL, 0);
			continue;
		}
		for (uint32_t j = 0; j < ask; j++)
			keys[j] = (kvt_key){ .lo = t->raw[c[s + j]], .hi = KEY_HI };
		struct kvt_lookup_res lx = { .size = sizeof(lx) };
		a = kvt__now_ns();
		if (with_disk) {
			hits = kvt_lookup_ex(tier, keys, ask, KVT_LOOKUP_PROMOTE, &lx);
			lease = lx.lease;
		} else {
			hits = kvt_lookup(tier, keys, ask, &lease);
		}
		b = kvt__now_ns();
		if (hits < 0) {
			r = fail("lookup", hits);
			goto out_close;
		}
		lat_add(&res->lookup, b - a, ask);
		if (with_disk && lx.pending) {
			/* ask again once the engine read them back */
			int h0 = hits;
			res->disk_pending += lx.pending;
			for (int round = 0; round < 4 && lx.pending; round++) {
				if (lease)
					kvt_release(tier, lease);
				lease = 0;
				if ((r = kvt_disk_drain(dr.d, 0, 30LL * 1000000000LL))) {
					fprintf(stderr, "kvtier-bench replay: disk: %s\n", strerror(-r));
					goto out_close;
				}
				hits = kvt_lookup_ex(tier, keys, ask, KVT_LOOKUP_PROMOTE, &lx);
				if (hits < 0) {
					r = fail("lookup", hits);
					goto out_close;
				}
				lease = lx.lease;
				if (!lx.requested)
					break;
			}
			lat_add(&res->promote, kvt__now_ns() - a, (uint32_t)(hits - h0));
			res->disk_hits += (uint32_t)(hits - h0);
		}
		res->asked += ask;
		res->hits += (uint32_t)hits;
		r = kvt_step(tier, lease ? &lease : NULL, lease ? 1 : 0);
		if (r < 0) {
			r = fail("step", r);
			goto out_close;
		}

		if (hits > 0) {
			const uint32_t *tabs[1] = { perm + (uint64_t)s * bpc };
			for (uint64_t k = (uint64_t)s * bpc; k < (uint64_t)(s + hits) * bpc; k++)
				memset(dev + perm[k] * block_bytes, 0, sizeof(struct stamp));
			a = kvt__now_ns();
			r = kvt_load(tier, lease, (uint32_t)hits, tabs, &op);
			if (r < 0) {
				r = fail("load", r);
				goto out_close;
			}
			r = op ? kvt_wait(tier, op, -1) : 0;
			b = kvt__now_ns();
			lat_add(&res->load, b - a, (uint32_t)hits);
			if (r < 0) {
				res->load_errors++;
				kvt_release(tier, lease);
			} else {
				for (uint32_t j = s; j < s + (uint32_t)hits; j++) {
					for (uint32_t k = 0; k < bpc; k++) {
						struct stamp st;
						memcpy(&st, dev + perm[(uint64_t)j * bpc + k] * block_bytes,
						       sizeof(st));
						res->verified++;
						if (st.id != t->raw[c[j]] || st.block != k ||
						    st.magic != STAMP_MAGIC)
							res->bad_stamps++;
					}
				}
			}
		}

		if ((uint32_t)hits < ask) {
			const uint32_t first = s + (uint32_t)hits, miss = ask - (uint32_t)hits;
			const uint32_t *tabs[1] = { perm + (uint64_t)first * bpc };
			/* "prefill": the computed blocks carry their chunk's stamp */
			for (uint32_t j = first; j < n; j++)
				for (uint32_t k = 0; k < bpc; k++) {
					struct stamp st = { .id = t->raw[c[j]], .block = k,
							    .magic = STAMP_MAGIC };
					memcpy(dev + perm[(uint64_t)j * bpc + k] * block_bytes, &st,
					       sizeof(st));
				}
			a = kvt__now_ns();
			r = kvt_save(tier, keys + hits, miss, first, tabs, &op);
			if (r < 0) {
				r = fail("save", r);
				goto out_close;
			}
			res->saves_asked += miss;
			res->saves_written += (uint32_t)r;
			r = op ? kvt_wait(tier, op, -1) : 0;
			b = kvt__now_ns();
			lat_add(&res->save, b - a, miss);
			if (r < 0)
				res->save_errors++;
			if (with_disk && (r = kvt_disk_drain(dr.d, 1, 30LL * 1000000000LL))) {
				fprintf(stderr, "kvtier-bench replay: disk: %s\n", strerror(-r));
				goto out_close;
			}
		}
	}
	res->seconds = (double)(kvt__now_ns() - t0) / 1e9;
	memset(&res->st, 0, sizeof(res->st));
	res->st.size = sizeof(res->st);
	r = kvt_stats(tier, &res->st);
	if (r)
		fail("stats", r);
out_close:
	disk_stop(o, &dr);
	kvt_close(tier);
	if (!o->keep)
		remove_segment(o->segment);
out_free:
	free(dev);
	free(perm);
	free(keys);
	return r;
}

/* ---- output ------------------------------------------------------------ */

static double pc(uint64_t a, uint64_t b)
{
	return b ? 100.0 * (double)a / (double)b : 0.0;
}

static void print_text(const struct opts *o, const struct trace *t, struct result *res)
{
	struct pct pl = lat_pct(&res->lookup), pd = lat_pct(&res->load), ps = lat_pct(&res->save);

	printf("kvtier-bench replay: %s\n", o->trace);
	printf("  %" PRIu64 " requests, %" PRIu64 " chunks of %u tokens (%u distinct), %.2f s "
	       "(%.0f requests/s)\n", res->requests, res->chunks, CHUNK_TOKENS, t->n_ids,
	       res->seconds, res->seconds > 0 ? (double)res->requests / res->seconds : 0.0);
	printf("  tier: %u chunks of %" PRIu64 " bytes (host DMA, world 1); HBM prefix cache: ",
	       o->capacity, (uint64_t)res->st.chunk_bytes);
	if (o->hbm_chunks)
		printf("LRU of %u chunks, %" PRIu64 " chunk hits (%.2f%% of all chunks)\n",
		       o->hbm_chunks, res->hbm_hits, pc(res->hbm_hits, res->chunks));
	else
		printf("none\n");
	printf("  the tier was asked for %" PRIu64 " chunks (the GPU-miss tails)\n\n", res->asked);
	printf("  %-26s %16s %16s\n", "policy (same requests)", "prefix hit rate", "chunk hit rate");
	printf("  %-26s %15.2f%% %16s\n", "kvtier (real API)", pc(res->hits, res->asked), "-");
	printf("  %-26s %15.2f%% %15.2f%%\n", "LRU (offline)", pc(res->lru.prefix_hits, res->asked),
	       pc(res->lru.chunk_hits, res->asked));
	printf("  %-26s %15.2f%% %15.2f%%\n", "Belady (offline)",
	       pc(res->opt.prefix_hits, res->asked), pc(res->opt.chunk_hits, res->asked));
	if (o->hbm_chunks)
		printf("  %-26s %15.2f%%\n", "HBM + kvtier, of all", pc(res->hbm_hits + res->hits,
									  res->chunks));
	if (o->disk) {
		uint64_t all = (uint64_t)o->capacity + o->disk_chunks;
		printf("\n  with a disk tier of %u chunks (admission %s), DRAM + disk = %" PRIu64
		       " chunks:\n", o->disk_chunks, kvt_disk_admit_name(o->disk_admit), all);
		printf("  %-34s %7.2f%%\n", "kvtier DRAM alone (real API)",
		       pc(res->dram_hits_alone, res->dram_asked_alone));
		printf("  %-34s %7.2f%%   (%.2f%% of asked chunks from disk)\n",
		       "kvtier DRAM + disk (real API)", pc(res->hits, res->asked),
		       pc(res->disk_hits, res->asked));
		printf("  %-34s %7.2f%% %15.2f%%\n", "LRU (offline, DRAM + disk)",
		       pc(res->lru_all.prefix_hits, res->asked), pc(res->lru_all.chunk_hits, res->asked));
		printf("  %-34s %7.2f%% %15.2f%%\n", "Belady (offline, DRAM + disk)",
		       pc(res->opt_all.prefix_hits, res->asked), pc(res->opt_all.chunk_hits, res->asked));
		printf("  %-34s %7.2f%% %15.2f%%\n", "infinite cache (every repeat hits)",
		       pc(res->inf.prefix_hits, res->asked), pc(res->inf.chunk_hits, res->asked));
	}
	printf("\n  %-8s %9s %9s %9s %9s %9s %12s\n", "latency", "p50 µs", "p90 µs", "p99 µs",
	       "max µs", "calls", "chunks/call");
	struct { const char *name; struct pct *p; } rows[] = {
		{ "lookup", &pl }, { "load", &pd }, { "save", &ps } };
	for (int i = 0; i < 3; i++)
		printf("  %-8s %9.1f %9.1f %9.1f %9.1f %9" PRIu64 " %12.1f\n", rows[i].name,
		       rows[i].p->p50, rows[i].p->p90, rows[i].p->p99, rows[i].p->max, rows[i].p->n,
		       rows[i].p->mean_chunks);
	if (o->disk) {
		struct pct pp = lat_pct(&res->promote);
		printf("  %-8s %9.1f %9.1f %9.1f %9.1f %9" PRIu64 " %12.1f\n", "promote",
		       pp.p50, pp.p90, pp.p99, pp.max, pp.n, pp.mean_chunks);
		printf("  (promote: a request with chunks on disk, from its first lookup to the\n"
		       "  lookup that hits them: the disk reads, checksums and publication)\n");
		printf("\n  disk counters: written %" PRIu64 ", read back %" PRIu64 ", evicted %"
		       PRIu64 ", admission rejects %" PRIu64 ", checksum errors %" PRIu64
		       ", promote requests %" PRIu64 ", promote drops %" PRIu64 "\n",
		       (uint64_t)res->st.disk_writes, (uint64_t)res->st.disk_reads,
		       (uint64_t)res->st.disk_evictions, (uint64_t)res->st.disk_admit_rejects,
		       (uint64_t)res->st.disk_checksum_errors, (uint64_t)res->st.promote_requests,
		       (uint64_t)res->st.promote_drops);
	}
	printf("\n  tier counters: saved %" PRIu64 ", save skips %" PRIu64 ", no space %" PRIu64
	       ", evictions %" PRIu64 ", loaded %" PRIu64 ", stale unpins %" PRIu64
	       ", double unpins %" PRIu64 "\n", (uint64_t)res->st.saved_chunks,
	       (uint64_t)res->st.save_skips, (uint64_t)res->st.save_nospc,
	       (uint64_t)res->st.evictions, (uint64_t)res->st.loaded_chunks,
	       (uint64_t)res->st.stale_unpins, (uint64_t)res->st.double_unpins);
	printf("  loaded blocks checked: %" PRIu64 ", wrong: %" PRIu64 "; failed loads %" PRIu64
	       ", failed saves %" PRIu64 "\n", res->verified, res->bad_stamps, res->load_errors,
	       res->save_errors);
	printf("\n  prefix hit rate: per request, the leading run of hit chunks / chunks asked.\n"
	       "  chunk hit rate: every asked chunk found / chunks asked (ignores prefix order).\n"
	       "  LRU: touched tail first after each request.  Belady: evicts the chunk used\n"
	       "  farthest ahead in the stream of asked chunks (or does not keep the new one).\n");
}

static void json_pct(const char *name, struct pct *p, int last)
{
	printf("\"%s\":{\"calls\":%" PRIu64 ",\"chunks_per_call\":%.3f,\"p50_us\":%.3f,"
	       "\"p90_us\":%.3f,\"p99_us\":%.3f,\"max_us\":%.3f}%s", name, p->n, p->mean_chunks,
	       p->p50, p->p90, p->p99, p->max, last ? "" : ",");
}

static void print_json(const struct opts *o, const struct trace *t, struct result *res)
{
	struct pct pl = lat_pct(&res->lookup), pd = lat_pct(&res->load), ps = lat_pct(&res->save);

	printf("{\"bench\":\"replay\",\"trace\":\"");
	for (const char *p = o->trace; *p; p++)
		printf(*p == '"' || *p == '\\' ? "\\%c" : "%c", *p);
	printf("\",\"requests\":%" PRIu64 ",\"chunks\":%" PRIu64 ",\"distinct_chunks\":%u,"
	       "\"chunk_tokens\":%u,\"capacity_chunks\":%u,\"chunk_bytes\":%" PRIu64 ","
	       "\"hbm_chunks\":%u,\"hbm_hit_chunks\":%" PRIu64 ",\"asked_chunks\":%" PRIu64 ","
	       "\"seconds\":%.3f,", res->requests, res->chunks, t->n_ids, CHUNK_TOKENS,
	       o->capacity, (uint64_t)res->st.chunk_bytes, o->hbm_chunks, res->hbm_hits,
	       res->asked, res->seconds);
	printf("\"kvtier\":{\"hit_chunks\":%" PRIu64 ",\"prefix_hit_rate\":%.6f},", res->hits,
	       res->asked ? (double)res->hits / (double)res->asked : 0.0);
	printf("\"lru\":{\"prefix_hit_rate\":%.6f,\"chunk_hit_rate\":%.6f},",
	       res->asked ? (double)res->lru.prefix_hits / (double)res->asked : 0.0,
	       res->asked ? (double)res->lru.chunk_hits / (double)res->asked : 0.0);
	printf("\"belady\":{\"prefix_hit_rate\":%.6f,\"chunk_hit_rate\":%.6f},",
	       res->asked ? (double)res->opt.prefix_hits / (double)res->asked : 0.0,
	       res->asked ? (double)res->opt.chunk_hits / (double)res->asked : 0.0);
	printf("\"latency\":{");
	json_pct("lookup", &pl, 0);
	json_pct("load", &pd, 0);
	json_pct("save", &ps, 1);
	printf("},\"counters\":{\"saved_chunks\":%" PRIu64 ",\"save_skips\":%" PRIu64
	       ",\"save_nospc\":%" PRIu64 ",\"evictions\":%" PRIu64 ",\"loaded_chunks\":%" PRIu64
	       ",\"stale_unpins\":%" PRIu64 ",\"double_unpins\":%" PRIu64 "},",
	       (uint64_t)res->st.saved_chunks, (uint64_t)res->st.save_skips,
	       (uint64_t)res->st.save_nospc, (uint64_t)res->st.evictions,
	       (uint64_t)res->st.loaded_chunks, (uint64_t)res->st.stale_unpins,
	       (uint64_t)res->st.double_unpins);
	printf("\"save_chunks_asked\":%" PRIu64 ",\"save_chunks_written\":%" PRIu64 ",",
	       res->saves_asked, res->saves_written);
	if (o->disk) {
		struct pct pp = lat_pct(&res->promote);
		double n = res->asked ? (double)res->asked : 1.0;
		printf("\"disk\":{\"chunks\":%u,\"admission\":\"%s\",\"dram_alone_prefix_hit_rate\":"
		       "%.6f,\"prefix_hit_rate\":%.6f,\"from_disk_rate\":%.6f,"
		       "\"lru_prefix_hit_rate\":%.6f,\"belady_prefix_hit_rate\":%.6f,"
		       "\"infinite_prefix_hit_rate\":%.6f,\"writes\":%" PRIu64 ",\"reads\":%"
		       PRIu64 ",\"checksum_errors\":%" PRIu64 ",", o->disk_chunks,
		       kvt_disk_admit_name(o->disk_admit),
		       res->dram_asked_alone ? (double)res->dram_hits_alone / (double)res->dram_asked_alone : 0.0,
		       (double)res->hits / n, (double)res->disk_hits / n,
		       (double)res->lru_all.prefix_hits / n, (double)res->opt_all.prefix_hits / n,
		       (double)res->inf.prefix_hits / n, (uint64_t)res->st.disk_writes,
		       (uint64_t)res->st.disk_reads, (uint64_t)res->st.disk_checksum_errors);
		json_pct("promote", &pp, 1);
		printf("},");
	}
	printf("\"verified_blocks\":%" PRIu64 ",\"wrong_blocks\":%" PRIu64 ",\"failed_loads\":%"
	       PRIu64 ",\"failed_saves\":%" PRIu64 "}\n", res->verified, res->bad_stamps,
	       res->load_errors, res->save_errors);
}

/* ---- options ------------------------------------------------------------- */

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kvtier-bench replay [options] [TRACE]\n"
		"\n"
		"Feeds a Mooncake-format trace (JSONL: {\"hash_ids\": [...], ...} per request)\n"
		"through a real kvtier segment: per request, lookup the prefix, load the hits,\n"
		"save the misses, one step; a chunk is a trace block (512 tokens).  Prints the\n"
		"tier's prefix hit rate next to LRU and Belady computed offline on the same\n"
		"requests, and lookup/load/save latency percentiles.\n"
		"\n"
		"  TRACE                  default: %s from the\n"
		"                         repository root (the current directory, else the one\n"
		"                         above this program's build/bench/)\n"
		"  --capacity N           tier capacity in chunks (default 4096)\n"
		"  --hbm-chunks N         an LRU of N chunks in front of the tier, as the engine's\n"
		"                         GPU prefix cache: the tier is asked only for the\n"
		"                         GPU-miss tail (default 0: none)\n"
		"  --limit N              the first N requests only\n"
		"  --bytes-per-token B    chunk size: 512 x B bytes (default 64: 32 KiB)\n"
		"  --block-tokens T       the engine's block size; divides 512 (default 16)\n"
		"  --segment NAME         segment name (default kvt-replay-<pid>)\n"
		"  --keep                 do not remove the segment at the end\n"
		"  --json                 one JSON object instead of the table\n"
		"  --disk FILE            also run with a disk tier on FILE (formatted; the\n"
		"                         engine runs in this process and keeps up between\n"
		"                         requests): DRAM + disk beside DRAM alone, LRU and\n"
		"                         Belady at the combined capacity, the infinite\n"
		"                         cache; promotion latency\n"
		"  --disk-chunks N        its capacity in chunks (default 16 x --capacity)\n"
		"  --disk-admit POLICY    all | second-hit | none (default all)\n", DEFAULT_TRACE);
}

static int parse_u32_opt(const char *name, const char *s, uint32_t min, uint32_t *out)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s || *end || s[0] == '-' || v > UINT32_MAX || v < min) {
		fprintf(stderr, "kvtier-bench replay: --%s %s: expected an integer >= %u\n",
			name, s, min);
		return -EINVAL;
	}
	*out = (uint32_t)v;
	return 0;
}

static int parse_opts(int argc, char **argv, struct opts *o)
{
	static const struct option lo[] = {
		{ "capacity", required_argument, NULL, 'c' },
		{ "hbm-chunks", required_argument, NULL, 'H' },
		{ "limit", required_argument, NULL, 'l' },
		{ "bytes-per-token", required_argument, NULL, 'b' },
		{ "block-tokens", required_argument, NULL, 't' },
		{ "segment", required_argument, NULL, 's' },
		{ "keep", no_argument, NULL, 'k' },
		{ "json", no_argument, NULL, 'j' },
		{ "disk", required_argument, NULL, 'D' },
		{ "disk-chunks", required_argument, NULL, 'N' },
		{ "disk-admit", required_argument, NULL, 'A' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int c;

	memset(o, 0, sizeof(*o));
	o->capacity = 4096;
	o->bytes_per_token = 64;
	o->block_tokens = 16;
	snprintf(o->segment, sizeof(o->segment), "kvt-replay-%d", (int)getpid());
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		switch (c) {
		case 'c': if (parse_u32_opt("capacity", optarg, 1, &o->capacity)) return 2; break;
		case 'H': if (parse_u32_opt("hbm-chunks", optarg, 0, &o->hbm_chunks)) return 2; break;
		case 'l': if (parse_u32_opt("limit", optarg, 1, &o->limit)) return 2; break;
		case 'b':
			if (parse_u32_opt("bytes-per-token", optarg, 1, &o->bytes_per_token))
				return 2;
			break;
		case 't':
			if (parse_u32_opt("block-tokens", optarg, 1, &o->block_tokens))
				return 2;
			break;
		case 's':
			if (strlen(optarg) >= sizeof(o->segment)) {
				fprintf(stderr, "kvtier-bench replay: --segment: at most %d characters\n",
					KVT_NAME_MAX);
				return 2;
			}
			snprintf(o->segment, sizeof(o->segment), "%s", optarg);
			break;
		case 'k': o->keep = 1; break;
		case 'j': o->json = 1; break;
		case 'D': o->disk = optarg; break;
		case 'N': if (parse_u32_opt("disk-chunks", optarg, 1, &o->disk_chunks)) return 2; break;
		case 'A':
			if (kvt_disk_admit_parse(optarg, &o->disk_admit)) {
				fprintf(stderr, "kvtier-bench replay: --disk-admit %s: expected all, "
					"second-hit or none\n", optarg);
				return 2;
			}
			break;
		case 'h': usage(stdout); return 1;
		default: usage(stderr); return 2;
		}
	}
	if (optind < argc)
		o->trace = argv[optind++];
	if (optind < argc) {
		fprintf(stderr, "kvtier-bench replay: one trace only\n");
		return 2;
	}
	if (o->disk && !o->disk_chunks)
		o->disk_chunks = o->capacity > (1u << 30) / 16 ? (1u << 30) : o->capacity * 16;
	if (CHUNK_TOKENS % o->block_tokens) {
		fprintf(stderr, "kvtier-bench replay: --block-tokens %u does not divide %u\n",
			o->block_tokens, CHUNK_TOKENS);
		return 2;
	}
	if ((uint64_t)o->block_tokens * o->bytes_per_token < sizeof(struct stamp) ||
	    (uint64_t)o->bytes_per_token * CHUNK_TOKENS > (1ULL << 30)) {
		fprintf(stderr, "kvtier-bench replay: a block must hold 16 bytes and a chunk at "
			"most 1 GiB (--block-tokens x --bytes-per-token)\n");
		return 2;
	}
	return 0;
}

/* The default trace: from the current directory when it is the
 * repository root, else from the root above this program (build/bench/). */
const char *kvt_bench_default_trace(char *buf, size_t len);

/* The trace shipped with the source tree, found from the executable's
 * place (<root>/build/bench) when not from the current directory. */
const char *kvt_bench_default_trace(char *buf, size_t len)
{
	char exe[PATH_MAX];
	ssize_t n;

	if (access(DEFAULT_TRACE, R_OK) == 0)
		return DEFAULT_TRACE;
	n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	if (n > 0) {
		exe[n] = 0;
		char *slash = strrchr(exe, '/');
		if (slash) {
			*slash = 0; /* <root>/build/bench */
			snprintf(buf, len, "%s/../../%s", exe, DEFAULT_TRACE);
			if (access(buf, R_OK) == 0)
				return buf;
		}
	}
	return NULL;
}

int kvt_bench_replay(int argc, char **argv)
{
	struct opts o;
	struct trace t;
	struct result res;
	uint32_t *start = NULL;
	char buf[PATH_MAX + 64];
	int r;

	r = parse_opts(argc, argv, &o);
	if (r)
		return r == 1 ? 0 : r;
	if (!o.trace) {
		o.trace = kvt_bench_default_trace(buf, sizeof(buf));
		if (!o.trace) {
			fprintf(stderr, "kvtier-bench replay: no TRACE given and %s not found from "
				"the repository root\n", DEFAULT_TRACE);
			return 2;
		}
	}
	r = trace_load(o.trace, o.limit, &t);
	if (r) {
		trace_free(&t);
		return 1;
	}
	memset(&res, 0, sizeof(res));
	start = malloc((size_t)t.n_req * sizeof(*start));
	if (!start || hbm_starts(&t, o.hbm_chunks, start, &res.hbm_hits) ||
	    sim_lru(&t, start, o.capacity, &res.lru) || sim_belady(&t, start, o.capacity, &res.opt)) {
		fprintf(stderr, "kvtier-bench replay: out of memory\n");
		r = 1;
		goto out;
	}
	res.hbm_hits = 0; /* counted again by the replay, per request */
	if (o.disk) {
		/* the file's size for the chunks asked; the index gets what it
		 * holds.  One chunk = one shard of the replay's geometry. */
		struct kvt_geometry g = { .chunk_tokens = CHUNK_TOKENS, .world = 1, .n_groups = 1,
					  .groups = { { 1, o.bytes_per_token } } };
		uint64_t shard = kvt_geometry_shard_bytes(&g), got = 0;
		char err[512];
		o.disk_bytes = (2ULL << 20) + (uint64_t)o.disk_chunks * (shard + 64);
		if (kvt_disk_plan(o.disk, o.disk_bytes, shard, 1, &got, err, sizeof(err)) ||
		    got > (1u << 30)) {
			fprintf(stderr, "kvtier-bench replay: %s\n", err);
			r = 2;
			goto out;
		}
		o.disk_chunks = (uint32_t)got;
		/* DRAM alone first, then DRAM + disk; offline references at the
		 * combined capacity and without a limit */
		struct result alone;
		uint64_t all = (uint64_t)o.capacity + o.disk_chunks;
		memset(&alone, 0, sizeof(alone));
		r = replay_run(&o, &t, start, &alone, 0);
		free(alone.lookup.ns);
		free(alone.load.ns);
		free(alone.save.ns);
		free(alone.promote.ns);
		if (r) {
			r = 1;
			goto out;
		}
		res.dram_hits_alone = alone.hits;
		res.dram_asked_alone = alone.asked;
		if (sim_lru(&t, start, (uint32_t)(all > UINT32_MAX ? UINT32_MAX : all), &res.lru_all) ||
		    sim_belady(&t, start, (uint32_t)(all > UINT32_MAX ? UINT32_MAX : all), &res.opt_all) ||
		    sim_lru(&t, start, t.n_ids ? t.n_ids : 1, &res.inf)) {
			fprintf(stderr, "kvtier-bench replay: out of memory\n");
			r = 1;
			goto out;
		}
	}
	r = replay_run(&o, &t, start, &res, o.disk != NULL);
	if (r) {
		r = 1;
		goto out;
	}
	if (o.json)
		print_json(&o, &t, &res);
	else
		print_text(&o, &t, &res);
	if (res.bad_stamps || res.load_errors || res.save_errors) {
		fprintf(stderr, "kvtier-bench replay: %" PRIu64 " wrong blocks, %" PRIu64
			" failed loads, %" PRIu64 " failed saves\n", res.bad_stamps,
			res.load_errors, res.save_errors);
		r = 1;
	}
out:
	free(res.lookup.ns);
	free(res.load.ns);
	free(res.save.ns);
	free(res.promote.ns);
	free(start);
	trace_free(&t);
	return r;
}
