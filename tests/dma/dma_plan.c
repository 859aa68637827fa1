/* dma_plan.c - unit tests of KV layouts and copy plans: merging, 2-D rows,
 * empty/partial chunks, several groups, bounds, and a randomized check that
 * applying a plan moves exactly the chunk's bytes and nothing else. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <cmocka.h>

#include "kvt_dma.h"

/* Simulated device memory: device address A is sim[A - SIM_BASE]. */
#define SIM_BASE 0x10000ull

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void)
{
	uint64_t x = rng_state;

	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return rng_state = x;
}

static uint32_t rnd_below(uint32_t n)
{
	return (uint32_t)(rnd() % n);
}

struct sim {
	struct kvt_kv_layout l;
	uint64_t bases[KVT_DMA_MAX_GROUPS][64];
	uint32_t blocks[KVT_DMA_MAX_GROUPS][512];
	const uint32_t *bptr[KVT_DMA_MAX_GROUPS];
	uint8_t *dev;
	uint64_t dev_size;
};

/* Lays group g's layers out one after another, `gap` bytes apart
 * (gap 0: exactly n_blocks * stride). */
static void sim_group(struct sim *s, uint32_t g, uint32_t layers, uint32_t bpt,
		      uint32_t tpb, uint64_t stride, uint64_t n_blocks, uint64_t gap)
{
	struct kvt_kv_group *gr = &s->l.groups[g];

	gr->n_layers = layers;
	gr->bytes_per_token = bpt;
	gr->tokens_per_block = tpb;
	gr->block_stride = stride;
	gr->n_blocks = n_blocks;
	gr->layer_base = s->bases[g];
	for (uint32_t l = 0; l < layers; l++) {
		s->bases[g][l] = SIM_BASE + s->dev_size;
		s->dev_size += n_blocks * stride + gap;
	}
	s->bptr[g] = s->blocks[g];
	if (g + 1 > s->l.n_groups)
		s->l.n_groups = g + 1;
}

static void sim_alloc(struct sim *s)
{
	s->dev = malloc(s->dev_size);
	assert_non_null(s->dev);
	for (uint64_t i = 0; i < s->dev_size; i++)
		s->dev[i] = (uint8_t)rnd();
}

static void sim_free(struct sim *s)
{
	free(s->dev);
	s->dev = NULL;
}

#define GUARD 256

/* Applies plan p (device -> sub-slot) and compares with a token-by-token
 * reference; checks that no byte outside the chunk's tokens changed. */
static void sim_verify(struct sim *s, const struct kvt_plan *p, uint32_t n_tokens)
{
	uint64_t shard = kvt_kv_layout_shard_bytes(&s->l);
	uint8_t *got = malloc(shard + 2 * GUARD), *want = malloc(shard + 2 * GUARD);
	uint64_t gbase = 0;

	assert_non_null(got);
	assert_non_null(want);
	memset(got, 0xa5, shard + 2 * GUARD);
	memset(want, 0xa5, shard + 2 * GUARD);
	for (uint32_t i = 0; i < p->n; i++) {
		const struct kvt_copy *c = &p->copies[i];

		for (uint32_t r = 0; r < c->rows; r++) {
			uint64_t dev = c->dev + (uint64_t)r * c->dev_pitch - SIM_BASE;
			uint64_t off = c->off + (uint64_t)r * c->host_pitch;

			assert_true(dev + c->len <= s->dev_size);
			assert_true(off + c->len <= shard);
			memcpy(got + GUARD + off, s->dev + dev, c->len);
		}
	}
	for (uint32_t g = 0; g < s->l.n_groups; g++) {
		const struct kvt_kv_group *gr = &s->l.groups[g];

		for (uint32_t l = 0; l < gr->n_layers; l++)
			for (uint32_t t = 0; t < n_tokens; t++) {
				if (s->bptr[g][t / gr->tokens_per_block] == KVT_DMA_BLOCK_SKIP)
					continue; /* no block: its sub-slot bytes untouched */
				uint64_t dev = gr->layer_base[l] - SIM_BASE +
					       (uint64_t)s->bptr[g][t / gr->tokens_per_block] *
					       gr->block_stride +
					       (uint64_t)(t % gr->tokens_per_block) * gr->bytes_per_token;
				uint64_t off = gbase + (uint64_t)l * s->l.chunk_tokens *
					       gr->bytes_per_token + (uint64_t)t * gr->bytes_per_token;

				memcpy(want + GUARD + off, s->dev + dev, gr->bytes_per_token);
			}
		gbase += (uint64_t)gr->n_layers * s->l.chunk_tokens * gr->bytes_per_token;
	}
	assert_int_equal(gbase, shard);
	assert_memory_equal(got, want, shard + 2 * GUARD);
	free(got);
	free(want);
}

static void plan_ok(struct sim *s, struct kvt_plan *p,
		    const struct kvt_plan_caps *caps, uint32_t n_tokens)
{
	char msg[200] = "";
	int rc = kvt_plan_build(p, &s->l, caps, s->bptr, n_tokens);

	assert_true(rc >= 0);
	assert_int_equal((uint32_t)rc, p->n);
	rc = kvt_plan_check(p, &s->l, msg, sizeof(msg));
	if (rc)
		fail_msg("plan_check: %s", msg);
	if (caps)
		for (uint32_t i = 0; i < p->n; i++) {
			const struct kvt_copy *c = &p->copies[i];

			assert_true(c->rows <= (caps->max_rows ? caps->max_rows : 1));
			if (c->rows > 1) {
				assert_true(c->dev_pitch <= caps->max_pitch);
				assert_true(c->host_pitch <= caps->max_pitch);
				assert_int_equal(c->dev_pitch % caps->pitch_align, 0);
				assert_int_equal(c->host_pitch % caps->pitch_align, 0);
				assert_int_equal(c->len % caps->pitch_align, 0);
				assert_int_equal(c->off % caps->pitch_align, 0);
				assert_int_equal(c->dev % caps->pitch_align, 0);
			}
		}
	else
		for (uint32_t i = 0; i < p->n; i++)
			assert_int_equal(p->copies[i].rows, 1);
	sim_verify(s, p, n_tokens);
}

static const struct kvt_plan_caps caps2d = {
	.max_rows = 1u << 16, .pitch_align = 4, .max_pitch = 1ull << 40,
};

/* ---- layouts ---------------------------------------------------------- */

static void test_layout_check(void **state)
{
	uint64_t bases[2] = { 0x1000, 0x100000 };
	struct kvt_kv_layout l = {
		.chunk_tokens = 256, .n_groups = 1,
		.groups[0] = { .n_layers = 2, .bytes_per_token = 64, .tokens_per_block = 16,
			       .block_stride = 1024, .n_blocks = 10, .layer_base = bases },
	};
	char msg[200];

	(void)state;
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), 0);
	assert_int_equal(kvt_kv_layout_shard_bytes(&l), 256 * 2 * 64);
	l.n_groups = 0;
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), -EINVAL);
	l.n_groups = KVT_DMA_MAX_GROUPS + 1;
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), -EINVAL);
	l.n_groups = 1;
	l.chunk_tokens = 250; /* not a multiple of 16 */
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), -EINVAL);
	assert_non_null(strstr(msg, "multiple"));
	l.chunk_tokens = 256;
	l.groups[0].block_stride = 1000; /* below the page */
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), -EINVAL);
	l.groups[0].block_stride = 1024;
	bases[1] = UINT64_MAX - 100; /* the layer's cache wraps */
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), -EINVAL);
	bases[1] = 0;
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), -EINVAL);
	bases[1] = 0x100000;
	l.groups[0].flags = 0x80;
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), -EINVAL);
	l.groups[0].flags = KVT_GROUP_F_REPLICATED;
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), 0);
	l.groups[0].layer_base = NULL;
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), -EINVAL);
	l.groups[0].layer_base = bases;
	l.groups[0].n_blocks = UINT64_MAX / 512; /* n_blocks * stride overflows */
	assert_int_equal(kvt_kv_layout_check(&l, msg, sizeof(msg)), -EINVAL);
	assert_int_equal(kvt_kv_layout_check(NULL, msg, sizeof(msg)), -EINVAL);
	assert_int_equal(kvt_kv_layout_shard_bytes(NULL), 0);
}

/* GLM-5.x: 78 MLA caches of 576 B/token + 21 indexer caches of 132 B/token. */
static void test_layout_glm5(void **state)
{
	static uint64_t mla[78], idx[21];
	struct kvt_kv_layout l = {
		.chunk_tokens = 256, .n_groups = 2,
		.groups[0] = { .n_layers = 78, .bytes_per_token = 576, .tokens_per_block = 64,
			       .block_stride = 64 * 576, .n_blocks = 1000, .layer_base = mla,
			       .flags = KVT_GROUP_F_REPLICATED },
		.groups[1] = { .n_layers = 21, .bytes_per_token = 132, .tokens_per_block = 64,
			       .block_stride = 64 * 132, .n_blocks = 1000, .layer_base = idx,
			       .flags = KVT_GROUP_F_REPLICATED },
	};

	(void)state;
	for (int i = 0; i < 78; i++)
		mla[i] = 0x7f0000000000ull + (uint64_t)i * (64 << 20);
	for (int i = 0; i < 21; i++)
		idx[i] = 0x7f8000000000ull + (uint64_t)i * (16 << 20);
	assert_int_equal(kvt_kv_layout_check(&l, NULL, 0), 0);
	assert_int_equal(kvt_kv_layout_shard_bytes(&l), 47700ull * 256);
	assert_int_equal(kvt_kv_layout_offset(&l, 0, 0), 0);
	assert_int_equal(kvt_kv_layout_offset(&l, 0, 1), 576ull * 256);
	assert_int_equal(kvt_kv_layout_offset(&l, 1, 0), 78ull * 576 * 256);
	assert_int_equal(kvt_kv_layout_offset(&l, 1, 20), 78ull * 576 * 256 + 20ull * 132 * 256);
	assert_int_equal(kvt_kv_layout_offset(&l, 1, 21), UINT64_MAX);
	assert_int_equal(kvt_kv_layout_offset(&l, 2, 0), UINT64_MAX);
	assert_int_equal(kvt_kv_layout_max_copies(&l), 78 * 4 + 21 * 4);
}

/* ---- merging ---------------------------------------------------------- */

static void test_merge_adjacent(void **state)
{
	struct sim s = { .l.chunk_tokens = 64 };
	struct kvt_plan p;

	(void)state;
	sim_group(&s, 0, 3, 32, 16, 16 * 32, 40, 512);
	sim_alloc(&s);
	assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
	for (int i = 0; i < 4; i++)
		s.blocks[0][i] = 7 + i;
	plan_ok(&s, &p, NULL, 64);
	assert_int_equal(p.n, 3); /* one copy per layer */
	for (uint32_t i = 0; i < p.n; i++)
		assert_int_equal(p.copies[i].len, 64 * 32);
	assert_int_equal(p.bytes, 3 * 64 * 32);
	assert_int_equal(p.span, 3 * 64 * 32);
	/* layers evenly spaced: the three layers become one 2-D copy */
	plan_ok(&s, &p, &caps2d, 64);
	assert_int_equal(p.n, 1);
	assert_int_equal(p.copies[0].rows, 3);
	assert_int_equal(p.copies[0].host_pitch, 64 * 32);

	/* two runs: 7,8 and 20,21 */
	s.blocks[0][2] = 20;
	s.blocks[0][3] = 21;
	plan_ok(&s, &p, NULL, 64);
	assert_int_equal(p.n, 6);
	plan_ok(&s, &p, &caps2d, 64);
	assert_int_equal(p.n, 2); /* each run across the layers */
	kvt_plan_fini(&p);
	sim_free(&s);
}

static void test_merge_scattered(void **state)
{
	struct sim s = { .l.chunk_tokens = 64 };
	const uint32_t ids[4] = { 9, 3, 7, 1 };
	struct kvt_plan p;

	(void)state;
	sim_group(&s, 0, 5, 16, 16, 16 * 16, 12, 0);
	sim_alloc(&s);
	memcpy(s.blocks[0], ids, sizeof(ids));
	assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
	plan_ok(&s, &p, NULL, 64);
	assert_int_equal(p.n, 20);
	plan_ok(&s, &p, &caps2d, 64);
	assert_int_equal(p.n, 4); /* block i in every layer: rows = 5 */
	for (uint32_t i = 0; i < p.n; i++)
		assert_int_equal(p.copies[i].rows, 5);
	kvt_plan_fini(&p);
	sim_free(&s);
}

/* The scattered plan again, each layer its own allocation (caps.ranges):
 * no 2-D copy runs from one into another, the rows stay inside a layer. */
static void test_rows_stay_in_one_allocation(void **state)
{
	struct sim s = { .l.chunk_tokens = 64 };
	const uint32_t ids[4] = { 9, 3, 7, 1 };
	struct kvt_range r[5];
	struct kvt_plan_caps c = caps2d;
	struct kvt_plan p;

	(void)state;
	sim_group(&s, 0, 5, 16, 16, 16 * 16, 12, 0);
	sim_alloc(&s);
	memcpy(s.blocks[0], ids, sizeof(ids));
	for (int i = 0; i < 5; i++)
		r[i] = (struct kvt_range){ s.bases[0][i], s.bases[0][i] + 12 * 16 * 16 };
	c.ranges = r;
	c.n_ranges = 5;
	assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
	plan_ok(&s, &p, &c, 64);
	/* per layer: block 9, blocks 3 and 7 as a 2-row copy, block 1 */
	assert_int_equal(p.n, 15);
	for (uint32_t i = 0; i < p.n; i++) {
		const struct kvt_copy *cp = &p.copies[i];
		uint64_t end = cp->dev + (uint64_t)(cp->rows - 1) * cp->dev_pitch + cp->len;
		int in = 0;

		for (int k = 0; k < 5; k++)
			in |= cp->dev >= r[k].start && end <= r[k].end;
		assert_true(in);
	}
	/* one allocation for all of them: the rows across the layers again */
	r[0].end = r[4].end;
	c.n_ranges = 1;
	plan_ok(&s, &p, &c, 64);
	assert_int_equal(p.n, 4);
	kvt_plan_fini(&p);
	sim_free(&s);
}

/* FlashInfer-style: K at base, V at base + page, stride 2 pages. */
static void test_merge_strided(void **state)
{
	struct sim s = { .l.chunk_tokens = 64 };
	struct kvt_plan p;
	uint64_t page = 16 * 128;

	(void)state;
	sim_group(&s, 0, 2, 128, 16, 2 * page, 32, 0);
	s.bases[0][1] = s.bases[0][0] + page;
	sim_alloc(&s);
	for (int i = 0; i < 4; i++)
		s.blocks[0][i] = 10 + i;
	assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
	plan_ok(&s, &p, NULL, 64);
	assert_int_equal(p.n, 8); /* pages never adjacent */
	plan_ok(&s, &p, &caps2d, 64);
	assert_int_equal(p.n, 2); /* one strided copy per layer */
	assert_int_equal(p.copies[0].rows, 4);
	assert_int_equal(p.copies[0].dev_pitch, 2 * page);
	assert_int_equal(p.copies[0].host_pitch, page);
	/* a pitch limit below the stride forbids the rows */
	{
		struct kvt_plan_caps c = caps2d;

		c.max_pitch = 2 * page - 4;
		plan_ok(&s, &p, &c, 64);
		assert_int_equal(p.n, 8);
		c.max_rows = 1;
		plan_ok(&s, &p, &c, 64);
		assert_int_equal(p.n, 8);
	}
	kvt_plan_fini(&p);
	sim_free(&s);
}

static void test_partial_and_empty(void **state)
{
	struct sim s = { .l.chunk_tokens = 64 };
	struct kvt_plan p;

	(void)state;
	sim_group(&s, 0, 3, 24, 16, 16 * 24, 20, 0);
	sim_alloc(&s);
	for (int i = 0; i < 4; i++)
		s.blocks[0][i] = 3 + i;
	assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
	/* 40 tokens: blocks 3, 4 and half of 5 */
	plan_ok(&s, &p, NULL, 40);
	assert_int_equal(p.n, 3);
	assert_int_equal(p.bytes, 3 * 40 * 24);
	assert_int_equal(p.copies[0].len, 40 * 24);
	assert_true(p.span <= kvt_kv_layout_shard_bytes(&s.l));
	plan_ok(&s, &p, &caps2d, 40);
	plan_ok(&s, &p, &caps2d, 1);
	assert_int_equal(p.bytes, 3 * 24);
	/* empty chunk */
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, s.bptr, 0), 0);
	assert_int_equal(p.n, 0);
	assert_int_equal(p.bytes, 0);
	assert_int_equal(p.span, 0);
	/* more tokens than a chunk */
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, s.bptr, 65), -EINVAL);
	kvt_plan_fini(&p);
	sim_free(&s);
}

static void test_errors(void **state)
{
	struct sim s = { .l.chunk_tokens = 32 };
	struct kvt_plan p;

	(void)state;
	sim_group(&s, 0, 4, 8, 8, 64, 10, 0);
	sim_alloc(&s);
	for (int i = 0; i < 4; i++)
		s.blocks[0][i] = (uint32_t)(2 * i);
	assert_int_equal(kvt_plan_init(&p, 3), 0); /* needs 16 */
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, s.bptr, 32), -ENOSPC);
	kvt_plan_fini(&p);
	assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
	s.blocks[0][3] = 10; /* == n_blocks */
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, s.bptr, 32), -ERANGE);
	/* ...but a block beyond n_tokens is not read */
	assert_true(kvt_plan_build(&p, &s.l, NULL, s.bptr, 24) > 0);
	s.bptr[0] = NULL;
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, s.bptr, 8), -EINVAL);
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, NULL, 8), -EINVAL);
	assert_int_equal(kvt_plan_init(&p, 0), -EINVAL);
	kvt_plan_fini(&p);
	sim_free(&s);
}

/* KVT_DMA_BLOCK_SKIP: no copy for that block, runs end at it, its bytes
 * counted as skipped; a chunk of skips is an empty plan. */
static void test_skip(void **state)
{
	struct sim s = { .l.chunk_tokens = 64 };
	struct kvt_plan p;
	char msg[200];

	(void)state;
	sim_group(&s, 0, 3, 32, 16, 16 * 32, 40, 512);
	sim_alloc(&s);
	assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
	s.blocks[0][0] = 7;
	s.blocks[0][1] = KVT_DMA_BLOCK_SKIP;
	s.blocks[0][2] = 9;
	s.blocks[0][3] = 10;
	plan_ok(&s, &p, NULL, 64);
	assert_int_equal(p.n, 6); /* 7, then 9-10, in each layer */
	assert_int_equal(p.bytes, 3 * 48 * 32);
	assert_int_equal(p.skipped, 3 * 16 * 32);
	for (uint32_t i = 0; i < p.n; i++)
		assert_true(p.copies[i].off % (64 * 32) != 16 * 32); /* block 1's pages */
	plan_ok(&s, &p, &caps2d, 64);
	/* the skip ends the run of 8 -> 9 even where ids would be adjacent */
	s.blocks[0][0] = 8;
	plan_ok(&s, &p, NULL, 64);
	assert_int_equal(p.n, 6);
	/* a skipped partial last block counts only its tokens */
	s.blocks[0][2] = KVT_DMA_BLOCK_SKIP;
	plan_ok(&s, &p, NULL, 40);
	assert_int_equal(p.skipped, 3 * 24 * 32);
	assert_int_equal(p.bytes, 3 * 16 * 32);
	/* every block a skip: nothing to copy */
	for (int i = 0; i < 4; i++)
		s.blocks[0][i] = KVT_DMA_BLOCK_SKIP;
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, s.bptr, 64), 0);
	assert_int_equal(p.n, 0);
	assert_int_equal(p.bytes, 0);
	assert_int_equal(p.skipped, 3 * 64 * 32);
	assert_int_equal(kvt_plan_check(&p, &s.l, msg, sizeof(msg)), 0);
	/* a plan claiming fewer skipped bytes than it left out is caught */
	s.blocks[0][0] = 7;
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, s.bptr, 64), 3);
	p.skipped -= 32;
	assert_int_equal(kvt_plan_check(&p, &s.l, msg, sizeof(msg)), -EUCLEAN);
	kvt_plan_fini(&p);
	sim_free(&s);
}

/* Several groups with different page shapes sharing one block table. */
static void test_multi_group(void **state)
{
	struct sim s = { .l.chunk_tokens = 256 };
	struct kvt_plan p;

	(void)state;
	sim_group(&s, 0, 6, 576, 64, 64 * 576, 16, 4096);
	sim_group(&s, 1, 3, 132, 64, 64 * 132, 16, 0);
	sim_group(&s, 2, 2, 40, 16, 16 * 40 * 2, 64, 0); /* other block size: own table */
	sim_alloc(&s);
	{
		const uint32_t t[4] = { 5, 6, 2, 11 };

		memcpy(s.blocks[0], t, sizeof(t));
		s.bptr[1] = s.blocks[0];
	}
	for (int i = 0; i < 16; i++)
		s.blocks[2][i] = (uint32_t)(63 - i * 3);
	assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
	plan_ok(&s, &p, NULL, 256);
	plan_ok(&s, &p, &caps2d, 256);
	plan_ok(&s, &p, &caps2d, 100);
	plan_ok(&s, &p, NULL, 17);
	for (uint32_t i = 1; i < p.n; i++)
		assert_true(p.copies[i].group >= p.copies[i - 1].group);
	kvt_plan_fini(&p);
	sim_free(&s);
}

/* Random layouts, block tables, token counts and caps. */
static void test_random(void **state)
{
	(void)state;
	for (int iter = 0; iter < 400; iter++) {
		struct sim s;
		struct kvt_plan p;
		struct kvt_plan_caps caps;
		uint32_t tpbs[] = { 1, 2, 4, 16 };
		uint32_t ng = 1 + rnd_below(3), mult = 1 + rnd_below(8);
		uint32_t tpb0 = tpbs[rnd_below(4)];

		memset(&s, 0, sizeof(s));
		s.l.chunk_tokens = tpb0 * mult;
		for (uint32_t g = 0; g < ng; g++) {
			uint32_t tpb = tpb0 > 1 ? tpb0 >> rnd_below(2) : 1;
			uint32_t bpt = rnd_below(3) ? 4 * (1 + rnd_below(16)) : 1 + rnd_below(40);
			uint64_t page = (uint64_t)tpb * bpt;
			uint64_t stride = rnd_below(2) ? page : page + 4 * rnd_below(8);
			uint32_t nblk = s.l.chunk_tokens / tpb;
			uint64_t n_blocks = nblk + rnd_below(3 * nblk + 2);
			uint32_t run = 0;

			sim_group(&s, g, 1 + rnd_below(5), bpt, tpb, stride, n_blocks,
				  rnd_below(2) ? 0 : 4 * rnd_below(100));
			for (uint32_t i = 0; i < nblk; i++) {
				if (i && run && s.blocks[g][i - 1] + 1 < n_blocks) {
					s.blocks[g][i] = s.blocks[g][i - 1] + 1;
					run--;
				} else {
					s.blocks[g][i] = rnd_below((uint32_t)n_blocks);
					run = rnd_below(4);
				}
			}
		}
		/* a third of the layouts: some blocks are skips (loads into
		 * a window, after a local hit) */
		if (iter % 3 == 0)
			for (uint32_t g = 0; g < ng; g++)
				for (uint32_t i = 0; i < s.l.chunk_tokens / s.l.groups[g].tokens_per_block;
				     i++)
					if (!rnd_below(4))
						s.blocks[g][i] = KVT_DMA_BLOCK_SKIP;
		sim_alloc(&s);
		assert_int_equal(kvt_kv_layout_check(&s.l, NULL, 0), 0);
		assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
		memset(&caps, 0, sizeof(caps));
		caps.max_rows = 1 + rnd_below(6);
		caps.pitch_align = 1u << rnd_below(4);
		caps.max_pitch = rnd_below(2) ? 1ull << 40 : 64 + rnd_below(2048);
		for (int k = 0; k < 3; k++) {
			uint32_t n = rnd_below(s.l.chunk_tokens + 1);

			plan_ok(&s, &p, NULL, n);
			plan_ok(&s, &p, &caps, n);
			plan_ok(&s, &p, &caps2d, n);
		}
		kvt_plan_fini(&p);
		sim_free(&s);
	}
}

/* kvt_plan_check catches plans that leave the sub-slot or overlap. */
static void test_check_catches(void **state)
{
	struct sim s = { .l.chunk_tokens = 32 };
	struct kvt_plan p;
	char msg[200];

	(void)state;
	sim_group(&s, 0, 2, 16, 16, 256, 8, 0);
	sim_alloc(&s);
	s.blocks[0][0] = 1;
	s.blocks[0][1] = 5;
	assert_int_equal(kvt_plan_init(&p, kvt_kv_layout_max_copies(&s.l)), 0);
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, s.bptr, 32), 4);
	assert_int_equal(kvt_plan_check(&p, &s.l, msg, sizeof(msg)), 0);
	p.copies[3].off += 1; /* past the end of the sub-slot */
	assert_int_equal(kvt_plan_check(&p, &s.l, msg, sizeof(msg)), -EUCLEAN);
	p.copies[3].off -= 1;
	p.copies[1].off = p.copies[0].off; /* overlap */
	assert_int_equal(kvt_plan_check(&p, &s.l, msg, sizeof(msg)), -EUCLEAN);
	assert_int_equal(kvt_plan_build(&p, &s.l, NULL, s.bptr, 32), 4);
	p.copies[2].dev = s.bases[0][1] + 8 * 256 - 8; /* past the layer */
	assert_int_equal(kvt_plan_check(&p, &s.l, msg, sizeof(msg)), -EUCLEAN);
	kvt_plan_fini(&p);
	sim_free(&s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_layout_check),
		cmocka_unit_test(test_layout_glm5),
		cmocka_unit_test(test_merge_adjacent),
		cmocka_unit_test(test_merge_scattered),
		cmocka_unit_test(test_rows_stay_in_one_allocation),
		cmocka_unit_test(test_merge_strided),
		cmocka_unit_test(test_partial_and_empty),
		cmocka_unit_test(test_errors),
		cmocka_unit_test(test_skip),
		cmocka_unit_test(test_multi_group),
		cmocka_unit_test(test_random),
		cmocka_unit_test(test_check_catches),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
