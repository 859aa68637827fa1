/* plan.c - KV layouts and copy plans: pure code, no I/O, no allocation
 * after kvt_plan_init().
 *
 * A chunk of T tokens covers nb = ceil(n_tokens / tpb) blocks of each
 * group.  In layer l, block i of the chunk is one page of tpb * bpt bytes at
 * base[l] + blk[i] * stride on the device and at
 * gbase + l * T * bpt + i * page in the sub-slot.  A plan is those pages,
 * merged:
 *
 *  1. Runs.  Pages i and i+1 of a layer are adjacent on the device exactly
 *     when stride == page and blk[i+1] == blk[i] + 1 (they are always
 *     adjacent in the sub-slot), and that does not depend on the layer; so
 *     the maximal runs of adjacent blocks are computed once per group and
 *     each (layer, run) is one contiguous segment.
 *  2. Rows.  Consecutive segments of equal length whose device and sub-slot
 *     addresses advance by constant pitches become one 2-D copy, when the
 *     backend can do 2-D (caps).  Two orders expose different regularity:
 *     layer-major (layer outer, runs inner: strided runs of blocks) and
 *     run-major (runs outer, layers inner: the same block in every layer,
 *     when the engine allocated the layers at a constant spacing).  Both
 *     are counted and the one with fewer copies is emitted (layer-major on
 *     a tie: its rows are the longer ones).  A copy's device extent stays
 *     inside one allocation where the backend knows them (caps->ranges,
 *     from bind): with one tensor per layer, the same block of evenly
 *     spaced layers is not one 2-D copy, which a runtime may refuse.
 *  3. Skips.  A block id KVT_DMA_BLOCK_SKIP is no block: it gets no copy,
 *     ends the run before it and starts none; its sub-slot pages are left
 *     alone (p->skipped counts their bytes).
 *
 * Safety: every address is derived from a checked layout (no wraps, block
 * ids checked against n_blocks), so a plan cannot leave the sub-slot's used
 * bytes or the layer's device range; kvt_plan_check() verifies it
 * independently for the tests.
 */
#include "dma_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvt_kv_layout_check(const struct kvt_kv_layout *l, char *msg, size_t len)
{
	uint64_t total = 0, copies = 0;

	if (!l)
		return kvt__fmt(-EINVAL, msg, len, "layout is NULL");
	if (l->chunk_tokens == 0)
		return kvt__fmt(-EINVAL, msg, len, "chunk_tokens is 0");
	if (l->n_groups == 0 || l->n_groups > KVT_DMA_MAX_GROUPS)
		return kvt__fmt(-EINVAL, msg, len, "n_groups %u not in 1..%u",
				   l->n_groups, KVT_DMA_MAX_GROUPS);
	for (uint32_t g = 0; g < l->n_groups; g++) {
		const struct kvt_kv_group *gr = &l->groups[g];
		uint64_t page, extent, bytes;

		if (gr->n_layers == 0 || gr->bytes_per_token == 0 ||
		    gr->tokens_per_block == 0 || gr->n_blocks == 0)
			return kvt__fmt(-EINVAL, msg, len,
				"group %u: n_layers, bytes_per_token, tokens_per_block "
				"and n_blocks must be >= 1", g);
		if (gr->flags & ~KVT_GROUP_F_MASK)
			return kvt__fmt(-EINVAL, msg, len, "group %u: unknown flags 0x%x",
					   g, gr->flags);
		if (l->chunk_tokens % gr->tokens_per_block)
			return kvt__fmt(-EINVAL, msg, len,
				"group %u: chunk_tokens is not a multiple of "
				"tokens_per_block %u", g, gr->tokens_per_block);
		if (!gr->layer_base)
			return kvt__fmt(-EINVAL, msg, len, "group %u: layer_base is NULL", g);
		page = (uint64_t)gr->tokens_per_block * gr->bytes_per_token;
		if (gr->block_stride < page)
			return kvt__fmt(-EINVAL, msg, len,
				"group %u: block_stride below tokens_per_block * "
				"bytes_per_token (%u tokens)", g, gr->tokens_per_block);
		/* a layer's cache: [base, base + (n_blocks - 1) * stride + page) */
		if (kvt__mul_overflow(gr->n_blocks - 1, gr->block_stride, &extent) ||
		    kvt__add_overflow(extent, page, &extent))
			return kvt__fmt(-EINVAL, msg, len,
				"group %u: n_blocks * block_stride overflows", g);
		for (uint32_t i = 0; i < gr->n_layers; i++) {
			uint64_t end;

			if (gr->layer_base[i] == 0)
				return kvt__fmt(-EINVAL, msg, len,
					"group %u: layer %u has a NULL base", g, i);
			if (kvt__add_overflow(gr->layer_base[i], extent, &end))
				return kvt__fmt(-EINVAL, msg, len,
					"group %u: layer %u's cache wraps the address space",
					g, i);
		}
		/* sub-slot bytes of the group: layers * T * bpt */
		if (kvt__mul_overflow((uint64_t)gr->n_layers * gr->bytes_per_token,
				      l->chunk_tokens, &bytes) ||
		    kvt__add_overflow(total, bytes, &total) ||
		    total > (UINT64_MAX >> 2))
			return kvt__fmt(-EINVAL, msg, len,
				"group %u: sub-slot size overflows", g);
		copies += (uint64_t)gr->n_layers *
			  (l->chunk_tokens / gr->tokens_per_block);
		if (copies > UINT32_MAX / 2)
			return kvt__fmt(-EINVAL, msg, len,
				"group %u: too many pages per chunk", g);
	}
	return 0;
}

uint64_t kvt_kv_layout_shard_bytes(const struct kvt_kv_layout *l)
{
	uint64_t total = 0;

	if (kvt_kv_layout_check(l, NULL, 0))
		return 0;
	for (uint32_t g = 0; g < l->n_groups; g++)
		total += (uint64_t)l->groups[g].n_layers *
			 l->groups[g].bytes_per_token * l->chunk_tokens;
	return total;
}

/* offset of group g's first layer; layout assumed checked */
static uint64_t group_base(const struct kvt_kv_layout *l, uint32_t g)
{
	uint64_t off = 0;

	for (uint32_t i = 0; i < g; i++)
		off += (uint64_t)l->groups[i].n_layers *
		       l->groups[i].bytes_per_token * l->chunk_tokens;
	return off;
}

uint64_t kvt_kv_layout_offset(const struct kvt_kv_layout *l, uint32_t g,
			      uint32_t layer)
{
	if (kvt_kv_layout_check(l, NULL, 0) || g >= l->n_groups ||
	    layer >= l->groups[g].n_layers)
		return UINT64_MAX;
	return group_base(l, g) + (uint64_t)layer *
	       l->groups[g].bytes_per_token * l->chunk_tokens;
}

uint32_t kvt_kv_layout_max_copies(const struct kvt_kv_layout *l)
{
	uint64_t n = 0;

	if (kvt_kv_layout_check(l, NULL, 0))
		return 0;
	for (uint32_t g = 0; g < l->n_groups; g++)
		n += (uint64_t)l->groups[g].n_layers *
		     (l->chunk_tokens / l->groups[g].tokens_per_block);
	return (uint32_t)n;
}

int kvt_plan_init(struct kvt_plan *p, uint32_t cap)
{
	if (!p || cap == 0)
		return -EINVAL;
	memset(p, 0, sizeof(*p));
	p->copies = calloc(cap, sizeof(*p->copies));
	if (!p->copies)
		return -ENOMEM;
	p->cap = cap;
	return 0;
}

void kvt_plan_fini(struct kvt_plan *p)
{
	if (!p)
		return;
	free(p->copies);
	memset(p, 0, sizeof(*p));
}

/* ---- the emitter: merges a stream of 1-D segments ------------------------ */

struct emitter {
	struct kvt_copy *out;   /* NULL: count only */
	uint32_t cap;
	uint32_t n;
	int open;
	int overflow;
	uint32_t cur_layer;     /* layer of the open copy's last row */
	struct kvt_copy cur;
	uint32_t max_rows;
	uint64_t align_mask;
	uint64_t max_pitch;
	const struct kvt_range *ranges; /* device allocations (caps), or NULL */
	uint32_t n_ranges;
};

static void em_init(struct emitter *e, struct kvt_copy *out, uint32_t cap,
		    const struct kvt_plan_caps *caps)
{
	memset(e, 0, sizeof(*e));
	e->out = out;
	e->cap = cap;
	e->max_rows = 1;
	if (caps && caps->max_rows > 1 && caps->pitch_align &&
	    !(caps->pitch_align & (caps->pitch_align - 1)) && caps->max_pitch) {
		e->max_rows = caps->max_rows;
		e->align_mask = caps->pitch_align - 1;
		e->max_pitch = caps->max_pitch;
	}
	if (caps && caps->ranges && caps->n_ranges) {
		e->ranges = caps->ranges;
		e->n_ranges = caps->n_ranges;
	}
}

/* Whether device bytes [a, end) lie in the one allocation holding a (no
 * known allocation holds a: nothing to keep to). */
static int em_one_alloc(const struct emitter *e, uint64_t a, uint64_t end)
{
	uint32_t lo = 0, hi = e->n_ranges;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (e->ranges[mid].end <= a)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo == e->n_ranges || e->ranges[lo].start > a)
		return 1;
	return end <= e->ranges[lo].end;
}

static void em_flush(struct emitter *e)
{
	if (!e->open)
		return;
	if (e->out) {
		if (e->n < e->cap)
			e->out[e->n] = e->cur;
		else
			e->overflow = 1;
	}
	e->n++;
	e->open = 0;
}

static int em_pitch_ok(const struct emitter *e, uint64_t pitch, uint64_t len)
{
	return pitch >= len && pitch <= e->max_pitch && !(pitch & e->align_mask);
}

/* A 1-D copy never spans two layers, even where their caches happen to be
 * adjacent: they may be separate allocations, and runtimes reject a copy
 * that crosses from one allocation into another.  Rows of a 2-D copy may
 * each lie in a different layer, but all in one allocation when the
 * backend says where its allocations are (caps->ranges): a 2-D copy's
 * extent from its first row's start to its last row's end is what a
 * driver checks, gaps included. */
static void em_add(struct emitter *e, uint64_t dev, uint64_t off, uint64_t len,
		   uint32_t group, uint32_t layer)
{
	struct kvt_copy *c = &e->cur;

	if (e->open) {
		/* 1-D: continues the open copy on both sides */
		if (c->rows == 1 && layer == e->cur_layer && c->group == group &&
		    c->dev + c->len == dev && c->off + c->len == off) {
			c->len += len;
			return;
		}
		if (len == c->len && e->max_rows > 1) {
			if (c->rows > 1 && c->rows < e->max_rows &&
			    dev == c->dev + c->rows * c->dev_pitch &&
			    off == c->off + c->rows * c->host_pitch &&
			    (!e->ranges || em_one_alloc(e, c->dev, dev + len))) {
				c->rows++;
				e->cur_layer = layer;
				return;
			}
			if (c->rows == 1 && dev > c->dev && off > c->off &&
			    !((c->dev | c->off | len) & e->align_mask) &&
			    em_pitch_ok(e, dev - c->dev, len) &&
			    em_pitch_ok(e, off - c->off, len) &&
			    (!e->ranges || em_one_alloc(e, c->dev, dev + len))) {
				c->dev_pitch = dev - c->dev;
				c->host_pitch = off - c->off;
				c->rows = 2;
				e->cur_layer = layer;
				return;
			}
		}
		em_flush(e);
	}
	c->dev = dev;
	c->off = off;
	c->len = len;
	c->rows = 1;
	c->dev_pitch = 0;
	c->host_pitch = 0;
	c->group = group;
	e->cur_layer = layer;
	e->open = 1;
}

/* Geometry of one group for one chunk. */
struct gplan {
	const struct kvt_kv_group *gr;
	const uint32_t *blk;
	uint32_t g;
	uint32_t nb;            /* blocks touched */
	uint64_t page;          /* tpb * bpt */
	uint64_t last;          /* bytes of the last (maybe partial) block */
	uint64_t gbase;         /* sub-slot offset of layer 0 */
	uint64_t lstride;       /* sub-slot bytes per layer: T * bpt */
};

/* End (exclusive) of the run of adjacent blocks starting at i. */
static uint32_t run_end(const struct gplan *gp, uint32_t i)
{
	uint32_t j = i + 1;

	if (gp->gr->block_stride != gp->page)
		return j;
	while (j < gp->nb && gp->blk[j] != KVT_DMA_BLOCK_SKIP && gp->blk[j] == gp->blk[j - 1] + 1)
		j++;
	return j;
}

static void seg(struct emitter *e, const struct gplan *gp, uint32_t layer,
		uint32_t i, uint32_t j)
{
	uint64_t len = (uint64_t)(j - i - 1) * gp->page +
		       (j == gp->nb ? gp->last : gp->page);

	em_add(e, gp->gr->layer_base[layer] + (uint64_t)gp->blk[i] * gp->gr->block_stride,
	       gp->gbase + layer * gp->lstride + (uint64_t)i * gp->page, len, gp->g,
	       layer);
}

static void emit_layer_major(struct emitter *e, const struct gplan *gp)
{
	for (uint32_t l = 0; l < gp->gr->n_layers; l++)
		for (uint32_t i = 0, j; i < gp->nb; i = j) {
			if (gp->blk[i] == KVT_DMA_BLOCK_SKIP) {
				j = i + 1;
				continue;
			}
			j = run_end(gp, i);
			seg(e, gp, l, i, j);
		}
	em_flush(e);
}

static void emit_run_major(struct emitter *e, const struct gplan *gp)
{
	for (uint32_t i = 0, j; i < gp->nb; i = j) {
		if (gp->blk[i] == KVT_DMA_BLOCK_SKIP) {
			j = i + 1;
			continue;
		}
		j = run_end(gp, i);
		for (uint32_t l = 0; l < gp->gr->n_layers; l++)
			seg(e, gp, l, i, j);
	}
	em_flush(e);
}

int kvt_plan_build(struct kvt_plan *p, const struct kvt_kv_layout *l,
		   const struct kvt_plan_caps *caps,
		   const uint32_t *const *blocks, uint32_t n_tokens)
{
	struct emitter e;
	uint64_t gbase = 0, bytes = 0, skipped = 0;
	int rc;

	if (!p || !p->copies || !blocks)
		return -EINVAL;
	rc = kvt_kv_layout_check(l, NULL, 0);
	if (rc)
		return rc;
	if (n_tokens > l->chunk_tokens)
		return -EINVAL;
	p->n = 0;
	p->bytes = 0;
	p->span = 0;
	p->skipped = 0;
	p->n_tokens = n_tokens;
	if (n_tokens == 0)
		return 0;

	em_init(&e, p->copies, p->cap, caps);
	for (uint32_t g = 0; g < l->n_groups; g++) {
		const struct kvt_kv_group *gr = &l->groups[g];
		struct gplan gp = {
			.gr = gr, .blk = blocks[g], .g = g,
			.nb = (n_tokens + gr->tokens_per_block - 1) / gr->tokens_per_block,
			.page = (uint64_t)gr->tokens_per_block * gr->bytes_per_token,
			.gbase = gbase,
			.lstride = (uint64_t)l->chunk_tokens * gr->bytes_per_token,
		};
		struct emitter cnt;
		uint32_t n_layer, n_run;
		uint64_t gskip = 0;

		if (!gp.blk)
			return -EINVAL;
		gp.last = (uint64_t)(n_tokens - (gp.nb - 1) * gr->tokens_per_block) *
			  gr->bytes_per_token;
		for (uint32_t i = 0; i < gp.nb; i++) {
			if (gp.blk[i] == KVT_DMA_BLOCK_SKIP)
				gskip += i + 1 == gp.nb ? gp.last : gp.page;
			else if (gp.blk[i] >= gr->n_blocks)
				return -ERANGE;
		}
		gskip *= gr->n_layers;

		em_init(&cnt, NULL, 0, caps);
		emit_layer_major(&cnt, &gp);
		n_layer = cnt.n;
		em_init(&cnt, NULL, 0, caps);
		emit_run_major(&cnt, &gp);
		n_run = cnt.n;
		if (n_run < n_layer)
			emit_run_major(&e, &gp);
		else
			emit_layer_major(&e, &gp);
		if (e.overflow)
			return -ENOSPC;

		bytes += (uint64_t)gr->n_layers * n_tokens * gr->bytes_per_token - gskip;
		skipped += gskip;
		gbase += (uint64_t)gr->n_layers * gp.lstride;
	}
	p->n = e.n;
	p->bytes = bytes;
	p->skipped = skipped;
	for (uint32_t i = 0; i < p->n; i++) {
		const struct kvt_copy *c = &p->copies[i];
		uint64_t end = c->off + (uint64_t)(c->rows - 1) * c->host_pitch + c->len;

		if (end > p->span)
			p->span = end;
	}
	return (int)p->n;
}

/* ---- independent verification ------------------------------------------- */

struct ival {
	uint64_t a, b;
};

static int ival_cmp(const void *x, const void *y)
{
	const struct ival *p = x, *q = y;

	return p->a < q->a ? -1 : p->a > q->a;
}

static int check_fail(char *msg, size_t len, const char *what, uint32_t i,
		      uint32_t r)
{
	if (msg && len)
		snprintf(msg, len, "copy %u row %u: %s", i, r, what);
	return -EUCLEAN;
}

int kvt_plan_check(const struct kvt_plan *p, const struct kvt_kv_layout *l,
		   char *msg, size_t len)
{
	uint64_t shard, bytes = 0, want = 0;
	struct ival *iv;
	size_t n_iv = 0, max_iv = 0;
	int rc = 0;

	if (kvt_kv_layout_check(l, msg, len))
		return -EINVAL;
	if (!p || (p->n && !p->copies) || p->n_tokens > l->chunk_tokens)
		return check_fail(msg, len, "bad plan", 0, 0);
	shard = kvt_kv_layout_shard_bytes(l);
	for (uint32_t i = 0; i < p->n; i++)
		max_iv += p->copies[i].rows;
	iv = calloc(max_iv ? max_iv : 1, sizeof(*iv));
	if (!iv)
		return -ENOMEM;
	for (uint32_t i = 0; i < p->n && !rc; i++) {
		const struct kvt_copy *c = &p->copies[i];
		const struct kvt_kv_group *gr;
		uint64_t g0, g1;

		if (c->group >= l->n_groups || c->rows == 0 || c->len == 0) {
			rc = check_fail(msg, len, "bad group, rows or len", i, 0);
			break;
		}
		gr = &l->groups[c->group];
		g0 = group_base(l, c->group);
		g1 = g0 + (uint64_t)gr->n_layers * gr->bytes_per_token * l->chunk_tokens;
		for (uint32_t r = 0; r < c->rows && !rc; r++) {
			uint64_t off = c->off + (uint64_t)r * c->host_pitch;
			uint64_t dev = c->dev + (uint64_t)r * c->dev_pitch;
			int in_layer = 0;

			if (off < g0 || off > g1 || c->len > g1 - off || g1 > shard)
				rc = check_fail(msg, len, "outside the group's part of the sub-slot", i, r);
			for (uint32_t k = 0; k < gr->n_layers && !in_layer; k++) {
				uint64_t b = gr->layer_base[k];
				uint64_t e = b + (gr->n_blocks - 1) * gr->block_stride +
					     (uint64_t)gr->tokens_per_block * gr->bytes_per_token;

				in_layer = dev >= b && dev < e && c->len <= e - dev;
			}
			if (!rc && !in_layer)
				rc = check_fail(msg, len, "outside every layer's device cache", i, r);
			iv[n_iv].a = off;
			iv[n_iv].b = off + c->len;
			n_iv++;
			bytes += c->len;
		}
	}
	if (!rc) {
		qsort(iv, n_iv, sizeof(*iv), ival_cmp);
		for (size_t k = 1; k < n_iv && !rc; k++)
			if (iv[k].a < iv[k - 1].b)
				rc = check_fail(msg, len, "sub-slot rows overlap", 0, 0);
	}
	for (uint32_t g = 0; g < l->n_groups; g++)
		want += (uint64_t)l->groups[g].n_layers * l->groups[g].bytes_per_token *
			p->n_tokens;
	/* skipped blocks: the only bytes a plan may leave out, and then only
	 * whole pages (bytes + skipped == want) */
	if (!rc && (p->skipped > want || bytes != want - p->skipped || bytes != p->bytes))
		rc = check_fail(msg, len, "payload differs from n_tokens' bytes (less what "
				"the plan skips)", 0, 0);
	free(iv);
	return rc;
}
