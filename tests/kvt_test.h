/* kvt_test.h - helpers shared by the core unit tests. */
#ifndef KVT_TEST_H
#define KVT_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "kvt_core.h"
#include "safe_kill.h"

/* A small sharded geometry: 16-token chunks of 16 B/token -> 256-B shards. */
static inline struct kvt_geometry kvt_test_geo(uint32_t world, uint32_t slots)
{
	struct kvt_geometry g;

	memset(&g, 0, sizeof(g));
	g.chunk_tokens = 16;
	g.world = world;
	g.n_instances = 1;
	g.mode = KVT_MODE_SHARDED;
	g.n_groups = 1;
	g.groups[0].layers = 1;
	g.groups[0].bytes_per_token = 16;
	g.model_id.lo = 42;
	g.n_slots = slots;
	g.n_leases = 64;
	g.lease_max_chunks = 64;
	return g;
}

/* A test that needs what the host lacks calls KVT_TEST_SKIP(); its executable
 * then ends with kvt_test_result(), which exits 77 (CTest: skipped) when
 * a test skipped and none failed.  Such tests get CTest entries of their
 * own (the executable run with the test's name as a filter), so that a
 * skip never hides passes, nor a pass a skip. */
static int kvt_test_skipped;
#define KVT_TEST_SKIP() do { kvt_test_skipped++; skip(); } while (0)

static inline int kvt_test_result(int failures)
{
	return failures ? failures : kvt_test_skipped ? 77 : 0;
}

/* main's start: run only the test named by argv[1], or every test but
 * those matching `own_entry` (a cmocka pattern; NULL: none). */
static inline void kvt_test_select(int argc, char **argv, const char *own_entry)
{
	if (argc > 1)
		cmocka_set_test_filter(argv[1]);
	else if (own_entry)
		cmocka_set_skip_filter(own_entry);
}

static inline const char *kvt_test_name(const char *tag)
{
	static char name[64];

	snprintf(name, sizeof(name), "t-%s-%d", tag, (int)getpid());
	return name;
}

static inline kvt_seg *kvt_test_create(const char *name, const struct kvt_geometry *g,
				       const struct kvt_seg_attach_opts *a)
{
	struct kvt_seg_create_opts c = {
		.size = sizeof(c), .name = name, .geo = g, .flags = KVT_SEG_F_REPLACE };
	kvt_seg *s = NULL;
	int r = kvt_seg_create(&c, a, &s);

	if (r)
		fprintf(stderr, "create: %d %s\n", r, kvt_core_last_error());
	assert_int_equal(r, 0);
	return s;
}

static inline int kvt_test_attach(const char *name, uint32_t role, uint32_t inst,
				  uint32_t rank, uint32_t world, kvt_seg **out)
{
	struct kvt_seg_attach_opts a = {
		.size = sizeof(a), .name = name, .role = role, .instance = inst,
		.rank = rank, .world = world };
	return kvt_seg_attach(&a, out);
}

static inline kvt_key kvt_test_key(uint64_t i)
{
	kvt_key k = { i, 0x5eed };
	return k;
}

/* Saves key on every shard (as one handle acting for all). Returns the
 * last write_end result (1 when it became READY). */
static inline int kvt_test_save_all(kvt_seg *s, uint64_t i, uint32_t depth)
{
	kvt_key k = kvt_test_key(i);
	int r = 0;

	for (uint32_t sh = 0; sh < kvt_seg_n_shards(s); sh++) {
		struct kvt_wref w;
		r = kvt_write_begin(s, &k, depth, sh, &w);
		if (r)
			return r;
		memset(kvt_slot_shard_ptr(s, w.slot, sh), (int)(i & 0xff),
		       (size_t)kvt_seg_shard_bytes(s));
		r = kvt_write_end(s, &w, 1);
		if (r < 0)
			return r;
	}
	return r;
}

/* A shard's stamp: every word a function of (key, shard, word index). */
static inline uint64_t kvt_test_word(const kvt_key *k, uint32_t shard, uint64_t i)
{
	uint64_t z = k->lo * 0x9e3779b97f4a7c15ULL ^ k->hi ^ ((uint64_t)shard << 56) ^ (i << 8);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	return z ^ (z >> 31);
}

static inline void kvt_test_stamp(kvt_seg *s, uint32_t slot, uint32_t shard, const kvt_key *k)
{
	uint64_t *q = kvt_slot_shard_ptr(s, slot, shard);

	for (uint64_t i = 0; i < kvt_seg_shard_bytes(s) / 8; i++)
		q[i] = kvt_test_word(k, shard, i);
}

/* 1 when sub-slot (slot, shard) holds the stamp of key k, every word. */
static inline int kvt_test_stamped(kvt_seg *s, uint32_t slot, uint32_t shard, const kvt_key *k)
{
	const uint64_t *q = kvt_slot_shard_ptr(s, slot, shard);

	for (uint64_t i = 0; i < kvt_seg_shard_bytes(s) / 8; i++)
		if (q[i] != kvt_test_word(k, shard, i))
			return 0;
	return 1;
}

/* write_begin + stamp + write_end of one shard of key i: write_end's
 * result, or write_begin's when nonzero. */
static inline int kvt_test_save_shard(kvt_seg *s, uint64_t i, uint32_t shard)
{
	kvt_key k = kvt_test_key(i);
	struct kvt_wref w;
	int r = kvt_write_begin(s, &k, 0, shard, &w);

	if (r)
		return r;
	kvt_test_stamp(s, w.slot, shard, &k);
	return kvt_write_end(s, &w, 1);
}

static inline void kvt_test_assert_check(kvt_seg *s)
{
	char msg[256];
	int r = kvt_check(s, msg, sizeof(msg));

	if (r)
		fprintf(stderr, "kvt_check: %s\n", msg);
	assert_int_equal(r, 0);
}

static inline uint64_t kvt_test_counter(kvt_seg *s, enum kvt_counter c)
{
	uint64_t v[KVT_C__COUNT];

	kvt_counters_read(s, v);
	return v[c];
}

#endif
