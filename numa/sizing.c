/* sizing.c - the sizing rules, pure.
 *
 * Bytes per token, per rank:
 *   GQA/MHA   2 x (num_key_value_heads / TP) x head_dim x layers x dtype
 *             (K and V; with fewer KV heads than TP each rank keeps one,
 *             as engines replicate them)
 *   MLA       (kv_lora_rank + qk_rope_head_dim) x layers x dtype, the same
 *             on every rank: one shared copy in kvtier's replicated layout
 *   indexer   + indexer_layers x (index_head_dim + 4 x ceil(index_head_dim /
 *             128)) in fp8 (GLM-5.x, DeepSeek-V3.2)
 * with layers divided over the pipeline stages (the largest stage sizes the
 * sub-slot).  A chunk's shard is stored rounded as core does it (to 64
 * bytes, or to 4 KiB from 4 KiB up), each rank's part of the arena to 2 MiB.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "kvt_size.h"
#include "numa_internal.h"

#define MiB2 (2ull << 20)
#define MAX_SLOTS (1ull << 30)   /* core: n_slots 1..2^30 */
#define MAX_WORLD 64u
#define MAX_LAYERS 4096u         /* core: KVT_MAX_LAYERS, layers of a group */
#define MAX_BPT (1ull << 20)     /* core: KVT_MAX_BPT, bytes per token and layer */

static uint64_t round_up(uint64_t x, uint64_t a)
{
	return (x + a - 1) / a * a;
}

static const struct {
	const char *name;
	uint32_t dt;
} dtype_names[] = {
	{"auto", KVT_DTYPE_AUTO},
	{"bf16", KVT_DTYPE_BF16}, {"bfloat16", KVT_DTYPE_BF16},
	{"fp16", KVT_DTYPE_FP16}, {"float16", KVT_DTYPE_FP16}, {"half", KVT_DTYPE_FP16},
	{"fp8", KVT_DTYPE_FP8}, {"fp8_e4m3", KVT_DTYPE_FP8}, {"fp8_e5m2", KVT_DTYPE_FP8},
	{"float8_e4m3fn", KVT_DTYPE_FP8}, {"float8_e5m2", KVT_DTYPE_FP8},
	{"fp4", KVT_DTYPE_FP4}, {"nvfp4", KVT_DTYPE_FP4}, {"mxfp4", KVT_DTYPE_FP4},
	{"fp32", KVT_DTYPE_FP32}, {"float32", KVT_DTYPE_FP32}, {"float", KVT_DTYPE_FP32},
};

int kvt_dtype_parse(const char *s, uint32_t *out)
{
	for (size_t i = 0; s && i < sizeof(dtype_names) / sizeof(dtype_names[0]); i++)
		if (!strcmp(s, dtype_names[i].name)) {
			*out = dtype_names[i].dt;
			return 0;
		}
	return kvt__numa_err(-EINVAL, "dtype '%s' unknown: use bf16, fp16, fp8, fp4 or fp32",
			     s ? s : "(null)");
}

const char *kvt_dtype_name(uint32_t dt)
{
	switch (dt) {
	case KVT_DTYPE_AUTO: return "auto";
	case KVT_DTYPE_BF16: return "bf16";
	case KVT_DTYPE_FP16: return "fp16";
	case KVT_DTYPE_FP8:  return "fp8";
	case KVT_DTYPE_FP4:  return "fp4";
	case KVT_DTYPE_FP32: return "fp32";
	}
	return "?";
}

uint32_t kvt_dtype_bits(uint32_t dt)
{
	switch (dt) {
	case KVT_DTYPE_BF16: return 16;
	case KVT_DTYPE_FP16: return 16;
	case KVT_DTYPE_FP8:  return 8;
	case KVT_DTYPE_FP4:  return 4;
	case KVT_DTYPE_FP32: return 32;
	}
	return 0;
}

uint32_t kvt_indexer_token_bytes(uint32_t index_head_dim, uint32_t dtype)
{
	switch (dtype) {
	case KVT_DTYPE_AUTO:
	case KVT_DTYPE_FP8:
		return index_head_dim + 4 * ((index_head_dim + 127) / 128);
	case KVT_DTYPE_BF16:
	case KVT_DTYPE_FP16:
		return 2 * index_head_dim;
	case KVT_DTYPE_FP32:
		return 4 * index_head_dim;
	case KVT_DTYPE_FP4:
		/* MXFP4 (vLLM's indexer_kv_dtype "mxfp4", DeepSeek V4's on
		 * MI355X): two values a byte and one UE8M0 scale byte a 32 */
		return (index_head_dim + 1) / 2 + (index_head_dim + 31) / 32;
	}
	return 0;
}

int kvt_model_check(const struct kvt_model *m)
{
	if (!m)
		return kvt__numa_err(-EINVAL, "model: NULL");
	if (m->layers == 0 || m->layers > 4096)
		return kvt__numa_err(-EINVAL, "model: num_hidden_layers %u not in 1..4096",
				     m->layers);
	if (m->attn == KVT_ATTN_GQA) {
		if (!m->n_kv_heads || !m->head_dim || m->head_dim > 65536 ||
		    m->n_kv_heads > 65536)
			return kvt__numa_err(-EINVAL, "model: KV heads %u x head_dim %u",
					     m->n_kv_heads, m->head_dim);
	} else if (m->attn == KVT_ATTN_MLA) {
		if (!m->kv_lora_rank || m->kv_lora_rank > 65536 ||
		    m->qk_rope_head_dim > 65536)
			return kvt__numa_err(-EINVAL, "model: kv_lora_rank %u + "
					     "qk_rope_head_dim %u", m->kv_lora_rank,
					     m->qk_rope_head_dim);
	} else {
		return kvt__numa_err(-EINVAL, "model: attention kind %u unknown", m->attn);
	}
	if (m->index_head_dim > 65536 || m->indexer_layers > m->layers ||
	    (m->index_head_dim != 0) != (m->indexer_layers != 0))
		return kvt__numa_err(-EINVAL, "model: indexer %u layers x head_dim %u "
				     "(of %u layers)", m->indexer_layers, m->index_head_dim,
				     m->layers);
	return 0;
}

/* The segment's metadata as core's layout v2 computes it (core/kvt_format.h):
 * header page, rank table, counters, leases, index, slot meta, each region
 * page aligned, the arena 2 MiB aligned.  An estimate until core exports
 * the computation; it is a few MiB against GiBs of arena. */
static uint64_t meta_estimate(uint32_t world, uint32_t n_shards, uint64_t slots)
{
	const uint64_t page = 4096, line = 64;
	uint64_t entries = 1 * (world + 1) + 32;          /* one instance + clients */
	uint64_t counters = (entries + 1) * round_up(24 * 8, line);
	uint64_t leases = 1024 * (64 + 8ull * world + 512 * 8); /* defaults */
	uint64_t buckets = 2, want = (slots * 4 + 6) / 7;
	uint64_t off = page;

	while (buckets < want)
		buckets <<= 1;
	off += round_up(entries * 64, page);
	off += round_up(counters, page);
	off += round_up(leases, page);
	off += round_up(buckets * 64, page);
	off += round_up(slots * round_up(64 + 8ull * n_shards, line), page);
	return round_up(off, MiB2);
}

/* Everything that follows from the slot count. */
static void fill_slots(struct kvt_size_plan *p, uint64_t slots)
{
	p->n_slots = slots;
	p->tokens = slots * p->chunk_tokens;
	p->tier_bytes = round_up(slots * p->chunk_bytes_rank, MiB2);
	p->arena_bytes = p->tier_bytes * p->n_shards;
	p->meta_bytes = meta_estimate(p->world, p->n_shards, slots);
	p->segment_bytes = p->meta_bytes + p->arena_bytes;
	/* Private per-rank tiers of the same capacity: every rank its own. */
	p->private_bytes = p->tier_bytes * p->world;
}

static int meta_node(const struct kvt_size_req *r)
{
	for (uint32_t i = 0; i < r->n_nodes; i++)
		if (r->nodes[i].has_meta)
			return (int)i;
	return 0;
}

/* The fit check for the plan's current slot count. */
static int check(const struct kvt_size_req *r, struct kvt_size_plan *p)
{
	int mi = meta_node(r);

	p->checked = 1;
	p->fits = 1;
	p->need_bytes = r->fixed_bytes + p->segment_bytes;
	p->free_bytes = 0;
	p->n_nodes = r->n_nodes;
	for (uint32_t i = 0; i < r->n_nodes; i++) {
		const struct kvt_size_node *n = &r->nodes[i];
		struct kvt_size_node_result *o = &p->nodes[i];

		memset(o, 0, sizeof(*o));
		o->node = n->node;
		o->use_hp = n->use_hp;
		o->mem_free_bytes = n->free_bytes;
		o->fixed_bytes = (uint64_t)ceil(n->fixed_share * (double)r->fixed_bytes);
		o->seg_bytes = (uint64_t)ceil(n->shards * (double)p->tier_bytes);
		if ((int)i == mi)
			o->seg_bytes += p->meta_bytes;
		if (n->use_hp) {
			o->free_bytes = n->hp_free_bytes;
			o->fits = o->fixed_bytes <= n->free_bytes && o->seg_bytes <= n->hp_free_bytes;
			p->free_bytes += n->free_bytes + n->hp_free_bytes;
		} else {
			o->free_bytes = n->free_bytes;
			o->fits = o->fixed_bytes + o->seg_bytes <= n->free_bytes;
			p->free_bytes += n->free_bytes;
		}
		if (!o->fits)
			p->fits = 0;
	}
	return p->fits;
}

/* Blocks of a chunk kvtier.vllm keeps of a sliding window (its
 * _caches._tail_blocks): the window's tail before the chunk's end, rounded
 * up to divide the chunk's bpc blocks; every block when the window reaches
 * past it. */
static uint32_t tail_blocks(uint32_t window, uint32_t block, uint32_t bpc)
{
	uint32_t need = window > 1 ? (window - 1 + block - 1) / block : 1;

	if (need >= bpc)
		return bpc;
	while (bpc % need)
		need++;
	return need;
}

/* DeepSeek V4's caches as kvtier.vllm keeps them (vLLM 0.32, block size
 * 256: the sparse-SWA cache in 64-token blocks, the compressors' state in
 * blocks of 4 (ratio 4) and 8 (ratio 128) tokens).  Per cache kind, the
 * bytes of one chunk for one layer: the blocks it keeps times a block's
 * data, rounded up to whole bytes per kvtier token (the chunk's tokens
 * over its kept blocks) as the connector copies it.  state: one stored
 * state (fp8_ds_mla: 448 fp8 + 64 bf16 + 8 scale bytes = 584; bf16:
 * head_dim x 2). */
static uint64_t dsv4_chunk(uint32_t chunk, uint32_t block, uint64_t block_data,
			   uint32_t window)
{
	uint32_t bpc = chunk / block;
	uint32_t kept = window ? tail_blocks(window, block, bpc) : bpc;
	uint64_t tpb = chunk / kept;

	return kept * ((block_data + tpb - 1) / tpb * tpb);
}

static int dsv4_groups(const struct kvt_size_req *r, const struct kvt_model *m,
		       struct kvt_size_plan *p)
{
	const uint32_t C = p->chunk_tokens, L = m->layers, n4 = m->c4_layers,
		       n128 = m->c128_layers;
	uint64_t state, ib = 0;
	struct { const char *name; uint32_t layers; uint64_t chunk; } g[7];
	uint32_t n = 0;

	if (C % 256)
		return kvt__numa_err(-EINVAL, "DeepSeek V4: a chunk of %u tokens is not a "
				     "multiple of vLLM's 256-token blocks", C);
	if (p->pp > 1)
		return kvt__numa_err(-EINVAL, "DeepSeek V4: PP %u not sized (its replicated "
				     "caches are one shard)", p->pp);
	switch (r->kv_dtype) {
	case KVT_DTYPE_AUTO:
	case KVT_DTYPE_FP8:
		state = 584; /* fp8_ds_mla, vLLM's V4 default on GPUs */
		p->kv_dtype = KVT_DTYPE_FP8;
		break;
	case KVT_DTYPE_BF16:
	case KVT_DTYPE_FP16:
		state = (uint64_t)m->head_dim * 2;
		p->kv_dtype = r->kv_dtype;
		break;
	default:
		return kvt__numa_err(-EINVAL, "DeepSeek V4: kv dtype %s: use fp8 (fp8_ds_mla) "
				     "or bf16", kvt_dtype_name(r->kv_dtype));
	}
	if (n4) {
		p->indexer_dtype = r->indexer_dtype ? r->indexer_dtype : KVT_DTYPE_FP8;
		ib = kvt_indexer_token_bytes(m->index_head_dim, p->indexer_dtype);
		if (!ib)
			return kvt__numa_err(-EINVAL, "indexer dtype %s: use fp8, fp4 or bf16",
					     kvt_dtype_name(p->indexer_dtype));
	}
#define G(nm, ly, ck) do { if (ly) { g[n].name = nm; g[n].layers = ly; \
			       g[n].chunk = ck; n++; } } while (0)
	G("swa", L, dsv4_chunk(C, 64, 64 * state, m->window));
	G("c4", n4, dsv4_chunk(C, 256, 64 * state, 0));
	G("c128", n128, dsv4_chunk(C, 256, 2 * state, 0));
	G("indexer", n4, dsv4_chunk(C, 256, 64 * ib, 0));
	/* the compressors' running state, fp32: 2 x overlap x width a token,
	 * over a window of overlap x ratio tokens (overlap 2 at ratio 4) */
	G("indexer-state", n4, dsv4_chunk(C, 4, 4ull * 2 * 2 * m->index_head_dim * 4, 8));
	G("c4-state", n4, dsv4_chunk(C, 4, 4ull * 2 * 2 * m->head_dim * 4, 8));
	G("c128-state", n128, dsv4_chunk(C, 8, 8ull * 2 * 1 * m->head_dim * 4, 128));
#undef G
	p->n_groups = n;
	p->chunk_bytes_rank = 0;
	for (uint32_t i = 0; i < n; i++) {
		p->groups[i].name = g[i].name;
		p->groups[i].layers = g[i].layers;
		p->groups[i].bytes_per_token = (uint32_t)((g[i].chunk + C - 1) / C);
		p->chunk_bytes_rank += g[i].layers * g[i].chunk;
	}
	p->token_bytes_rank = (p->chunk_bytes_rank + C - 1) / C;
	return 0;
}

/* Resolves dtypes, layout and the per-token and per-chunk figures. */
static int base(const struct kvt_size_req *r, struct kvt_size_plan *p)
{
	const struct kvt_model *m = r->model;
	uint32_t bits, stage_layers;
	uint64_t per_layer;
	int rc;

	if ((rc = kvt_model_check(m)))
		return rc;
	memset(p, 0, sizeof(*p));
	p->tp = r->tp;
	p->pp = r->pp;
	if (!p->tp || !p->pp || p->tp > MAX_WORLD || p->pp > MAX_WORLD ||
	    p->tp * p->pp > MAX_WORLD)
		return kvt__numa_err(-EINVAL, "TP %u x PP %u: the world must be 1..%u ranks",
				     r->tp, r->pp, MAX_WORLD);
	p->world = p->tp * p->pp;
	if (r->pp > m->layers)
		return kvt__numa_err(-EINVAL, "PP %u is more than the %u layers", r->pp,
				     m->layers);
	p->chunk_tokens = r->chunk_tokens ? r->chunk_tokens : 256;
	if (p->chunk_tokens > (1u << 20))
		return kvt__numa_err(-EINVAL, "chunk of %u tokens: at most 2^20", p->chunk_tokens);

	p->kv_dtype = r->kv_dtype;
	if (p->kv_dtype == KVT_DTYPE_AUTO)
		p->kv_dtype = m->dtype == KVT_DTYPE_FP16 || m->dtype == KVT_DTYPE_FP32 ?
			      m->dtype : KVT_DTYPE_BF16;
	bits = kvt_dtype_bits(p->kv_dtype);
	if (!bits)
		return kvt__numa_err(-EINVAL, "kv dtype %u unknown", r->kv_dtype);

	p->layout = r->layout;
	if (p->layout == KVT_SIZE_LAYOUT_AUTO)
		p->layout = m->attn == KVT_ATTN_MLA ? KVT_SIZE_REPLICATED : KVT_SIZE_SHARDED;
	if (p->layout != KVT_SIZE_SHARDED && p->layout != KVT_SIZE_REPLICATED)
		return kvt__numa_err(-EINVAL, "layout %u unknown", r->layout);
	if (p->layout == KVT_SIZE_REPLICATED && m->attn != KVT_ATTN_MLA && p->tp > 1)
		return kvt__numa_err(-EINVAL, "a replicated layout needs the same KV on every "
				     "rank (MLA); with GQA each of the %u ranks holds other "
				     "heads: use the sharded layout", p->tp);
	if (p->layout == KVT_SIZE_REPLICATED && p->pp > 1)
		return kvt__numa_err(-EINVAL, "a replicated layout keeps one shard shared by "
				     "the whole world, but with PP %u the stages hold different "
				     "layers: use --layout sharded (or PP 1)", p->pp);
	p->n_shards = p->layout == KVT_SIZE_SHARDED ? p->world : 1;

	/* The largest pipeline stage sets the sub-slot size. */
	stage_layers = (m->layers + p->pp - 1) / p->pp;
	if (m->attn == KVT_ATTN_GQA) {
		uint32_t kvh = m->n_kv_heads;

		if (kvh % p->tp == 0)
			p->kv_heads_rank = kvh / p->tp;
		else if (p->tp % kvh == 0)
			p->kv_heads_rank = 1; /* engines replicate the heads */
		else
			return kvt__numa_err(-EINVAL, "TP %u does not divide the %u KV heads "
					     "(nor do they divide TP)", p->tp, kvh);
		per_layer = ((uint64_t)2 * p->kv_heads_rank * m->head_dim * bits + 7) / 8;
	} else if (m->indexer_layers && p->kv_dtype == KVT_DTYPE_FP8 &&
		   m->kv_lora_rank == 512 && m->qk_rope_head_dim == 64) {
		/* DeepSeek V3.2 / GLM-5.x in fp8: the engines' fp8_ds_mla, 512
		 * fp8 values, 4 fp32 scales and 64 bf16 rope values (vLLM's
		 * state_content_bytes 656, as kvtier.vllm copies it) */
		per_layer = 656;
	} else {
		per_layer = ((uint64_t)(m->kv_lora_rank + m->qk_rope_head_dim) * bits + 7) / 8;
	}
	/* The limits kvt_open applies: a plan beyond them is refused here,
	 * never printed as valid (and the figures below cannot wrap). */
	if (per_layer > MAX_BPT)
		return kvt__numa_err(-EINVAL, "%" PRIu64 " bytes per token per layer and rank: "
				     "kvtier holds at most %llu (2^20); raise TP, or use a "
				     "narrower kv dtype", per_layer, (unsigned long long)MAX_BPT);
	if (stage_layers > MAX_LAYERS)
		return kvt__numa_err(-EINVAL, "%u layers per stage: kvtier holds at most %u",
				     stage_layers, MAX_LAYERS);
	if (m->dsv4) {
		if ((rc = dsv4_groups(r, m, p)))
			return rc;
		p->token_bytes_all = p->token_bytes_rank * p->n_shards;
		p->chunk_bytes_rank = p->chunk_bytes_rank < 4096 ?
				      round_up(p->chunk_bytes_rank, 64) :
				      round_up(p->chunk_bytes_rank, 4096);
		p->chunk_bytes_all = p->chunk_bytes_rank * p->n_shards;
		return 0;
	}
	p->n_groups = 1;
	p->groups[0].name = "kv";
	p->groups[0].layers = stage_layers;
	p->groups[0].bytes_per_token = (uint32_t)per_layer;
	if (m->indexer_layers) {
		uint32_t ib;

		p->indexer_dtype = r->indexer_dtype ? r->indexer_dtype : KVT_DTYPE_FP8;
		ib = kvt_indexer_token_bytes(m->index_head_dim, p->indexer_dtype);
		if (!ib)
			return kvt__numa_err(-EINVAL, "indexer dtype %s: use fp8, fp4 or bf16",
					     kvt_dtype_name(p->indexer_dtype));
		p->n_groups = 2;
		p->groups[1].name = "indexer";
		p->groups[1].layers = (m->indexer_layers + p->pp - 1) / p->pp;
		p->groups[1].bytes_per_token = ib;
	}
	for (uint32_t g = 0; g < p->n_groups; g++)
		p->token_bytes_rank += (uint64_t)p->groups[g].layers * p->groups[g].bytes_per_token;
	p->token_bytes_all = p->token_bytes_rank * p->n_shards;
	/* Stored as core stores a shard: 64-byte lines, or whole pages. */
	p->chunk_bytes_rank = p->token_bytes_rank * p->chunk_tokens;
	p->chunk_bytes_rank = p->chunk_bytes_rank < 4096 ? round_up(p->chunk_bytes_rank, 64) :
			      round_up(p->chunk_bytes_rank, 4096);
	p->chunk_bytes_all = p->chunk_bytes_rank * p->n_shards;
	return 0;
}

int kvt_size_compute(const struct kvt_size_req *r, struct kvt_size_plan *out)
{
	struct kvt_size_plan p;
	uint64_t slots;
	int rc;

	if (!r || !out || r->size < sizeof(*r) || r->reserved)
		return kvt__numa_err(-EINVAL, "kvt_size_compute: bad request");
	if (r->n_nodes > KVT_SIZE_MAX_NODES || (r->n_nodes && !r->nodes))
		return kvt__numa_err(-EINVAL, "kvt_size_compute: %u nodes (at most %d)",
				     r->n_nodes, KVT_SIZE_MAX_NODES);
	if ((rc = base(r, &p)))
		return rc;
	if (r->fixed_bytes > (1ull << 60) || r->tier_bytes > (1ull << 60))
		return kvt__numa_err(-EINVAL, "sizes over an exabyte are a typo");

	if (r->n_nodes) {
		/* The largest tier that fits: fits() falls as slots grow, so
		 * bisect between "nothing" and "more than all the memory". */
		uint64_t total = 0, lo = 0, hi;

		for (uint32_t i = 0; i < r->n_nodes; i++)
			total += r->nodes[i].free_bytes + r->nodes[i].hp_free_bytes;
		hi = total / p.chunk_bytes_rank + 1;
		if (hi > MAX_SLOTS)
			hi = MAX_SLOTS + 1;
		fill_slots(&p, 0);
		if (!check(r, &p)) {
			hi = 0;  /* F and the metadata alone do not fit */
		} else {
			while (lo + 1 < hi) {
				uint64_t mid = lo + (hi - lo) / 2;

				fill_slots(&p, mid);
				if (check(r, &p))
					lo = mid;
				else
					hi = mid;
			}
			hi = lo;
		}
		p.max_slots = hi;
		p.max_tokens = hi * p.chunk_tokens;
		p.max_tier_bytes = round_up(hi * p.chunk_bytes_rank, MiB2);
	}

	if (r->tier_bytes) {
		slots = r->tier_bytes / p.chunk_bytes_rank;
		if (!slots)
			return kvt__numa_err(-EINVAL, "a tier of %" PRIu64 " bytes holds no chunk "
					     "(one chunk is %" PRIu64 " bytes per rank)",
					     r->tier_bytes, p.chunk_bytes_rank);
	} else if (r->tokens) {
		/* no tokens + chunk - 1: it wraps for counts near 2^64 */
		slots = r->tokens / p.chunk_tokens + (r->tokens % p.chunk_tokens != 0);
	} else if (r->n_nodes) {
		slots = p.max_slots;
	} else {
		return kvt__numa_err(-EINVAL, "give a tier size or a token count (or node "
				     "memory, to size the largest tier that fits)");
	}
	if (slots > MAX_SLOTS)
		return kvt__numa_err(-EINVAL, "%" PRIu64 " chunks: a segment holds at most 2^30 "
				     "(use larger chunks)", slots);
	fill_slots(&p, slots);
	if (r->n_nodes)
		check(r, &p);
	*out = p;
	return 0;
}

uint64_t kvt_size_kfd_limit(uint64_t ram)
{
	const uint64_t reserve = 1ull << 30; /* AMDGPU_RESERVE_MEM_LIMIT */
	uint64_t l = ram - (ram >> 6);

	return l < 2 * reserve ? l >> 1 : l - reserve;
}

uint64_t kvt_size_amd_locked(const struct kvt_size_plan *p, uint32_t instances)
{
	/* each rank locks its shard, tier_bytes: the whole arena when
	 * replicated (one shard) */
	return (uint64_t)(instances ? instances : 1) * p->world * p->tier_bytes;
}
