/* numa_sizing.c - the sizing rules on real config.json files: known bytes
 * per token (Llama-3.1-8B, DeepSeek-V3, a GLM-5-like DSA model), the fit
 * check and the largest tier that fits, and clear errors for configs that
 * cannot be sized. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvt_size.h"
#include "kvt_numa.h"
#ifdef KVTIER_NUMA_HAVE_SEG
#include "kvt_core.h"
#endif

#define GiB (1ull << 30)
#define MiB2 (2ull << 20)

static void load(const char *file, struct kvt_model *m)
{
	char path[512];

	snprintf(path, sizeof(path), "%s/%s", KVT_TEST_DATA, file);
	if (kvt_model_load(path, m))
		fail_msg("%s: %s", file, kvt_numa_last_error());
}

static struct kvt_size_req req(const struct kvt_model *m, uint32_t dt, uint32_t tp)
{
	struct kvt_size_req r;

	memset(&r, 0, sizeof(r));
	r.size = sizeof(r);
	r.model = m;
	r.kv_dtype = dt;
	r.tp = tp;
	r.pp = 1;
	r.tokens = 1;
	return r;
}

static struct kvt_size_plan plan(const struct kvt_size_req *r)
{
	struct kvt_size_plan p;

	if (kvt_size_compute(r, &p))
		fail_msg("kvt_size_compute: %s", kvt_numa_last_error());
	return p;
}

static void t_llama_8b(void **state)
{
	struct kvt_model m;
	struct kvt_size_req r;
	struct kvt_size_plan p;

	(void)state;
	load("llama-3.1-8b.json", &m);
	assert_int_equal(m.attn, KVT_ATTN_GQA);
	assert_int_equal(m.layers, 32);
	assert_int_equal(m.n_kv_heads, 8);
	assert_int_equal(m.head_dim, 128);   /* hidden_size / heads: no head_dim field */
	assert_int_equal(m.dtype, KVT_DTYPE_BF16);
	assert_string_equal(m.arch, "LlamaForCausalLM");

	r = req(&m, KVT_DTYPE_BF16, 1);
	p = plan(&r);
	assert_int_equal(p.token_bytes_rank, 131072);
	assert_int_equal(p.layout, KVT_SIZE_SHARDED);
	assert_int_equal(p.n_shards, 1);
	assert_int_equal(p.chunk_bytes_rank, 131072 * 256);

	r.tp = 4;
	p = plan(&r);
	assert_int_equal(p.token_bytes_rank, 32768);
	assert_int_equal(p.token_bytes_all, 131072);
	assert_int_equal(p.kv_heads_rank, 2);
	assert_int_equal(p.n_shards, 4);
	assert_int_equal(p.chunk_bytes_rank, 32768 * 256);
	assert_int_equal(p.groups[0].layers, 32);
	assert_int_equal(p.groups[0].bytes_per_token, 1024);

	/* AUTO is the config's bf16. */
	r.kv_dtype = KVT_DTYPE_AUTO;
	assert_int_equal(plan(&r).token_bytes_rank, 32768);
	r.tp = 1;
	r.kv_dtype = KVT_DTYPE_FP8;
	assert_int_equal(plan(&r).token_bytes_rank, 65536);
	r.kv_dtype = KVT_DTYPE_FP4;
	assert_int_equal(plan(&r).token_bytes_rank, 32768);

	/* TP 8 = KV heads: one each; TP 16: heads replicated, still one. */
	r.kv_dtype = KVT_DTYPE_BF16;
	r.tp = 8;
	assert_int_equal(plan(&r).token_bytes_rank, 16384);
	r.tp = 16;
	p = plan(&r);
	assert_int_equal(p.kv_heads_rank, 1);
	assert_int_equal(p.token_bytes_rank, 16384);
	/* TP 3 splits no head evenly. */
	r.tp = 3;
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "TP 3"));

	/* PP 2: each stage holds 16 layers; the world is 8. */
	r.tp = 4;
	r.pp = 2;
	p = plan(&r);
	assert_int_equal(p.world, 8);
	assert_int_equal(p.n_shards, 8);
	assert_int_equal(p.token_bytes_rank, 16384);
}

static void t_other_gqa(void **state)
{
	struct kvt_model m;
	struct kvt_size_req r;

	(void)state;
	/* Explicit head_dim (Qwen3). */
	load("qwen3-8b.json", &m);
	r = req(&m, KVT_DTYPE_AUTO, 1);
	assert_int_equal(plan(&r).token_bytes_rank, 2ull * 8 * 128 * 36 * 2);
	/* MHA without num_key_value_heads, fp16 from the config. */
	load("mha-7b.json", &m);
	assert_int_equal(m.n_kv_heads, 32);
	assert_int_equal(m.dtype, KVT_DTYPE_FP16);
	r = req(&m, KVT_DTYPE_AUTO, 1);
	assert_int_equal(plan(&r).kv_dtype, KVT_DTYPE_FP16);
	assert_int_equal(plan(&r).token_bytes_rank, 524288);
	/* Multimodal: the language model in text_config. */
	load("multimodal-text-config.json", &m);
	assert_string_equal(m.model_type, "llama4_text");
	assert_int_equal(m.layers, 48);
	r = req(&m, KVT_DTYPE_BF16, 8);
	assert_int_equal(plan(&r).token_bytes_rank, 2ull * 1 * 128 * 48 * 2);
}

static void t_deepseek_v3(void **state)
{
	struct kvt_model m;
	struct kvt_size_req r;
	struct kvt_size_plan p;

	(void)state;
	load("deepseek-v3.json", &m);
	assert_int_equal(m.attn, KVT_ATTN_MLA);
	assert_int_equal(m.kv_lora_rank, 512);
	assert_int_equal(m.qk_rope_head_dim, 64);
	assert_int_equal(m.indexer_layers, 0);
	r = req(&m, KVT_DTYPE_BF16, 8);
	r.tier_bytes = 64 * GiB;
	r.tokens = 0;
	p = plan(&r);
	/* 61 layers x 576 x 2 */
	assert_int_equal(p.token_bytes_rank, 70272);
	assert_int_equal(p.layout, KVT_SIZE_REPLICATED);
	assert_int_equal(p.n_shards, 1);            /* x1, not x TP */
	assert_int_equal(p.token_bytes_all, 70272);
	assert_int_equal(p.arena_bytes, p.tier_bytes);
	assert_int_equal(p.private_bytes, 8 * p.tier_bytes);
	assert_int_equal(p.n_slots, 64 * GiB / (70272ull * 256));
	assert_true(p.tier_bytes <= 64 * GiB);

	/* Private per-rank copies (what today's tiers do): x TP. */
	r.layout = KVT_SIZE_SHARDED;
	p = plan(&r);
	assert_int_equal(p.n_shards, 8);
	assert_int_equal(p.token_bytes_rank, 70272);
	assert_int_equal(p.token_bytes_all, 8 * 70272);

	/* fp8 halves it; PP with the replicated layout is refused, clearly. */
	r.layout = KVT_SIZE_LAYOUT_AUTO;
	r.kv_dtype = KVT_DTYPE_FP8;
	assert_int_equal(plan(&r).token_bytes_rank, 35136);
	r.pp = 2;
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "PP 2"));
	r.layout = KVT_SIZE_SHARDED;
	p = plan(&r);
	assert_int_equal(p.groups[0].layers, 31);   /* the larger stage of 61 */
}

static void t_glm5_like_indexer(void **state)
{
	struct kvt_model m;
	struct kvt_size_req r;
	struct kvt_size_plan p;

	(void)state;
	load("glm-5-like.json", &m);
	assert_int_equal(m.attn, KVT_ATTN_MLA);
	assert_int_equal(m.layers, 78);
	assert_int_equal(m.index_head_dim, 128);
	assert_int_equal(m.indexer_layers, 21);     /* "full" entries of indexer_types */
	assert_int_equal(kvt_indexer_token_bytes(128, KVT_DTYPE_FP8), 132);
	/* MXFP4 (vLLM 0.32's deepseek_v4 attention.py: "64 packed values + 4
	 * UE8M0 scales = 68") */
	assert_int_equal(kvt_indexer_token_bytes(128, KVT_DTYPE_FP4), 68);
	r = req(&m, KVT_DTYPE_FP8, 8);
	p = plan(&r);
	/* 78 x 656 (fp8_ds_mla: 512 fp8 + 4 fp32 scales + 64 bf16 rope, what
	 * vLLM stores and kvtier.vllm copies) + 21 x 132 (indexer fp8 + fp32
	 * scale) = 51,168 + 2,772 = 53,940: the two layer groups of DESIGN.md. */
	assert_int_equal(p.n_groups, 2);
	assert_int_equal(p.groups[0].layers, 78);
	assert_int_equal(p.groups[0].bytes_per_token, 656);
	assert_int_equal(p.groups[1].layers, 21);
	assert_int_equal(p.groups[1].bytes_per_token, 132);
	assert_int_equal(p.token_bytes_rank, 53940);
	assert_int_equal(p.n_shards, 1);
	/* bf16 MLA, indexer still fp8 (as engines keep it). */
	r.kv_dtype = KVT_DTYPE_BF16;
	assert_int_equal(plan(&r).token_bytes_rank, 78 * 1152 + 21 * 132);
	r.indexer_dtype = KVT_DTYPE_BF16;
	assert_int_equal(plan(&r).token_bytes_rank, 78 * 1152 + 21 * 256);

	/* DeepSeek-V3.2: an indexer on every layer. */
	load("deepseek-v3.2.json", &m);
	assert_int_equal(m.indexer_layers, 61);
	r = req(&m, KVT_DTYPE_BF16, 8);
	assert_int_equal(plan(&r).token_bytes_rank, 70272 + 61 * 132);
}

/* DeepSeek-V4-Flash's published config.json (deepseek-v4-flash.json):
 * 43 layers, compress_ratios 0, 0, then 4 / 128 alternating, ending in 4
 * (21 layers by 4 with the indexer, 20 by 128), head_dim 512, window 128,
 * index_head_dim 128.  Per 256-token chunk and layer, as kvtier.vllm keeps
 * it (fp8_ds_mla: 584 bytes a state):
 *   swa         every layer: the window's tail, 2 of 4 64-token blocks:
 *               128 x 584                               =     74,752
 *   c4          64 states x 584                         =     37,376
 *   c128        2 x 584 = 1,168, rounded up to 5 B x 256 =      1,280
 *   indexer     64 states x 132 (fp8 + a scale per 128)  =      8,448
 *   indexer-state  2 of 64 4-token blocks (window 8) of 4 x 2 x 2 x 128
 *               fp32 = 8,192 each                        =     16,384
 *   c4-state    2 blocks of 4 x 2 x 2 x 512 fp32 = 32,768 =     65,536
 *   c128-state  16 of 32 8-token blocks (window 128) of 8 x 2 x 512 fp32
 *               = 32,768 each                            =    524,288
 * A chunk: 43 x 74,752 + 21 x (37,376 + 8,448 + 16,384 + 65,536)
 *   + 20 x (1,280 + 524,288) = 3,214,336 + 2,682,624 + 10,511,360
 *   = 16,408,320 bytes (64,095 a token), one copy for all 8 ranks.  The
 * same formula gave the 802,816 bytes a chunk that the library logged for
 * test_hybrid_caches.py's two-layer model (one layer of each kind). */
static void t_deepseek_v4_flash(void **state)
{
	struct kvt_model m;
	struct kvt_size_req r;
	struct kvt_size_plan p;

	(void)state;
	load("deepseek-v4-flash.json", &m);
	assert_int_equal(m.dsv4, 1);
	assert_int_equal(m.attn, KVT_ATTN_MLA);
	assert_int_equal(m.layers, 43);
	assert_int_equal(m.c4_layers, 21);
	assert_int_equal(m.c128_layers, 20);
	assert_int_equal(m.window, 128);
	r = req(&m, KVT_DTYPE_AUTO, 8);
	p = plan(&r);
	assert_int_equal(p.n_shards, 1);            /* replicated: one copy */
	assert_int_equal(p.n_groups, 7);
	assert_string_equal(p.groups[0].name, "swa");
	assert_int_equal(p.groups[0].layers, 43);
	assert_int_equal(p.groups[0].bytes_per_token, 74752 / 256);
	assert_string_equal(p.groups[6].name, "c128-state");
	assert_int_equal(p.groups[6].bytes_per_token, 524288 / 256);
	/* stored as core stores a shard: in whole 4 KiB pages */
	assert_int_equal(p.chunk_bytes_rank, (16408320 + 4095) / 4096 * 4096);
	assert_int_equal(p.token_bytes_rank, 64095);
	/* vLLM's MXFP4 indexer cache (--indexer-dtype fp4): 64 states x 68 =
	 * 4,352 a chunk and c4 layer instead of 8,448: 21 x 4,096 less */
	r.indexer_dtype = KVT_DTYPE_FP4;
	p = plan(&r);
	assert_int_equal(p.chunk_bytes_rank, (16408320 - 21 * 4096 + 4095) / 4096 * 4096);
	assert_int_equal(p.indexer_dtype, KVT_DTYPE_FP4);
	r.indexer_dtype = KVT_DTYPE_AUTO;
	/* bf16 KV: a state is 512 x 2 = 1,024 bytes; c128's 2,048 divide */
	r.kv_dtype = KVT_DTYPE_BF16;
	p = plan(&r);
	assert_int_equal(p.chunk_bytes_rank,
			 (43ull * 128 * 1024 + 21ull * (64 * 1024 + 8448 + 16384 + 65536) +
			  20ull * (2048 + 524288) + 4095) / 4096 * 4096);
	/* the two-layer model of test_hybrid_caches.py, by the same rules */
	m.layers = 2;
	m.c4_layers = 1;
	m.c128_layers = 1;
	m.indexer_layers = 1;
	r = req(&m, KVT_DTYPE_AUTO, 1);
	assert_int_equal(plan(&r).chunk_bytes_rank, 802816);
}

/* One node with free memory; F on it. */
static struct kvt_size_node one_node(uint64_t free_bytes)
{
	struct kvt_size_node n;

	memset(&n, 0, sizeof(n));
	n.free_bytes = free_bytes;
	n.shards = 0;     /* set by the caller */
	n.fixed_share = 1.0;
	n.has_meta = 1;
	return n;
}

static void t_fit_and_largest(void **state)
{
	struct kvt_model m;
	struct kvt_size_req r;
	struct kvt_size_plan p, q;
	struct kvt_size_node n = one_node(100 * GiB);

	(void)state;
	load("llama-3.1-8b.json", &m);
	n.shards = 4;
	r = req(&m, KVT_DTYPE_BF16, 4);
	r.tokens = 0;
	r.fixed_bytes = 20 * GiB;
	r.n_nodes = 1;
	r.nodes = &n;

	/* F + 4 x 16 GiB + metadata = ~84 GiB <= 100 GiB */
	r.tier_bytes = 16 * GiB;
	p = plan(&r);
	assert_int_equal(p.checked, 1);
	assert_int_equal(p.fits, 1);
	assert_int_equal(p.tier_bytes, 16 * GiB);
	assert_int_equal(p.n_slots, 2048);
	assert_int_equal(p.tokens, 2048 * 256);
	assert_int_equal(p.need_bytes, 20 * GiB + p.segment_bytes);
	assert_int_equal(p.nodes[0].fixed_bytes, 20 * GiB);
	assert_int_equal(p.nodes[0].seg_bytes, p.segment_bytes);
	assert_int_equal(p.nodes[0].fits, 1);

	/* 4 x 32 GiB does not: and the largest tier that does is reported. */
	r.tier_bytes = 32 * GiB;
	p = plan(&r);
	assert_int_equal(p.fits, 0);
	assert_int_equal(p.nodes[0].fits, 0);
	assert_true(p.max_slots > 0);
	assert_true(20 * GiB + 4 * p.max_tier_bytes <= 100 * GiB);
	/* ... and it is the largest: it fits, one more chunk does not. */
	r.tier_bytes = 0;
	r.tokens = p.max_slots * 256;
	q = plan(&r);
	assert_int_equal(q.fits, 1);
	r.tokens = (p.max_slots + 1) * 256;
	q = plan(&r);
	assert_int_equal(q.fits, 0);

	/* A token count near 2^64 is refused, not wrapped to a 0-chunk plan
	 * that "fits" (tokens + chunk - 1 wrapped before). */
	struct kvt_size_plan w;
	r.tokens = UINT64_MAX;
	assert_int_equal(kvt_size_compute(&r, &w), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "at most 2^30"));

	/* Neither tier nor tokens: the plan is the largest tier. */
	r.tokens = 0;
	q = plan(&r);
	assert_int_equal(q.n_slots, p.max_slots);
	assert_int_equal(q.fits, 1);

	/* F alone is more than the node has: nothing fits. */
	r.fixed_bytes = 101 * GiB;
	q = plan(&r);
	assert_int_equal(q.max_slots, 0);
	assert_int_equal(q.n_slots, 0);
	assert_int_equal(q.fits, 0);
}

static void t_fit_replicated_and_nodes(void **state)
{
	struct kvt_model m;
	struct kvt_size_req r;
	struct kvt_size_plan p;
	struct kvt_size_node n[2];

	(void)state;
	load("deepseek-v3.json", &m);
	r = req(&m, KVT_DTYPE_BF16, 8);
	r.tokens = 0;
	r.tier_bytes = 300 * GiB;
	r.fixed_bytes = 100 * GiB;
	/* Replicated over two nodes, interleaved: half the arena each, F split. */
	n[0] = one_node(250 * GiB);
	n[1] = one_node(250 * GiB);
	n[1].has_meta = 0;
	n[0].shards = n[1].shards = 0.5;
	n[0].fixed_share = n[1].fixed_share = 0.5;
	r.n_nodes = 2;
	r.nodes = n;
	p = plan(&r);
	assert_int_equal(p.fits, 1);
	assert_int_equal(p.nodes[0].fixed_bytes, 50 * GiB);
	assert_true(p.nodes[1].seg_bytes <= p.tier_bytes / 2 + 1);
	/* With per-rank private tiers (sharded: x8) the same tier cannot fit. */
	r.layout = KVT_SIZE_SHARDED;
	n[0].shards = n[1].shards = 4;
	p = plan(&r);
	assert_int_equal(p.fits, 0);
	assert_int_equal(p.n_shards, 8);

	/* Huge pages: the segment must fit the pool, F the rest. */
	r.layout = KVT_SIZE_LAYOUT_AUTO;
	r.n_nodes = 1;
	n[0] = one_node(120 * GiB);
	n[0].shards = 1;
	n[0].use_hp = 1;
	n[0].hp_free_bytes = 310 * GiB;
	p = plan(&r);
	assert_int_equal(p.fits, 1);
	assert_int_equal(p.nodes[0].use_hp, 1);
	assert_int_equal(p.nodes[0].free_bytes, 310 * GiB);
	n[0].hp_free_bytes = 200 * GiB;
	p = plan(&r);
	assert_int_equal(p.fits, 0);
	assert_true(p.max_tier_bytes <= 200 * GiB);
}

static void t_request_errors(void **state)
{
	struct kvt_model m;
	struct kvt_size_req r;
	struct kvt_size_plan p;

	(void)state;
	load("llama-3.1-8b.json", &m);
	r = req(&m, KVT_DTYPE_BF16, 1);
	r.tokens = 0;
	r.tier_bytes = 1 << 20;   /* less than one 32 MiB chunk */
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "holds no chunk"));
	r.tier_bytes = 0;         /* nothing to size, no nodes */
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
	r.tokens = 1;
	r.tp = 0;
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
	r.tp = 8;
	r.pp = 16;
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);   /* world 128 */
	r.pp = 1;
	r.layout = KVT_SIZE_REPLICATED;   /* GQA cannot share one copy */
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "sharded"));
	r.layout = KVT_SIZE_SHARDED;
	r.tokens = 1ull << 40;            /* 2^32 chunks: more than a segment holds */
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
	r.tokens = 1;
	/* huge shapes: refused (bytes per token were kept in 32 bits: a
	 * wrapped figure with success, or 0 and a division by zero) */
	{
		struct kvt_model big = m;
		big.n_kv_heads = 65536;
		big.head_dim = 65536;   /* 2^33 bytes per token and layer at TP 1 */
		r = req(&big, KVT_DTYPE_BF16, 1);
		assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
		assert_non_null(strstr(kvt_numa_last_error(), "at most 1048576"));
		big.n_kv_heads = 8;
		big.head_dim = 65536;   /* 2^21: still over the library's 2^20 */
		r = req(&big, KVT_DTYPE_BF16, 1);
		assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
		big.head_dim = 32768;   /* exactly 2^20 per layer: the library takes it */
		r = req(&big, KVT_DTYPE_BF16, 1);
		r.tokens = 256;
		assert_int_equal(kvt_size_compute(&r, &p), 0);
		assert_int_equal(p.groups[0].bytes_per_token, 1u << 20);
		r = req(&m, KVT_DTYPE_BF16, 1);
		r.tokens = 1;
	}
	r.reserved = 1;
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
	r.reserved = 0;
	m.layers = 0;
	assert_int_equal(kvt_size_compute(&r, &p), -EINVAL);
}

static void t_dtypes(void **state)
{
	uint32_t d;

	(void)state;
	assert_int_equal(kvt_dtype_parse("bfloat16", &d), 0);
	assert_int_equal(d, KVT_DTYPE_BF16);
	assert_int_equal(kvt_dtype_parse("fp8_e4m3", &d), 0);
	assert_int_equal(d, KVT_DTYPE_FP8);
	assert_int_equal(kvt_dtype_parse("nvfp4", &d), 0);
	assert_int_equal(kvt_dtype_bits(d), 4);
	assert_int_equal(kvt_dtype_parse("int3", &d), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "bf16, fp16, fp8, fp4"));
	assert_string_equal(kvt_dtype_name(KVT_DTYPE_FP16), "fp16");
}

static void expect_error(const char *file, int err, const char *words)
{
	struct kvt_model m;
	char path[512];

	snprintf(path, sizeof(path), "%s/%s", KVT_TEST_DATA, file);
	assert_int_equal(kvt_model_load(path, &m), err);
	if (!strstr(kvt_numa_last_error(), words))
		fail_msg("%s: message '%s' lacks '%s'", file, kvt_numa_last_error(), words);
}

static void t_bad_configs(void **state)
{
	struct kvt_model m;

	(void)state;
	expect_error("malformed-truncated.json", -EINVAL, "not valid JSON");
	expect_error("malformed-comma.json", -EINVAL, "not valid JSON");
	expect_error("wrong-type.json", -EINVAL, "num_hidden_layers must be an integer");
	expect_error("unknown-mamba.json", -ENOTSUP, "cannot size model_type mamba");
	expect_error("not-a-model.json", -ENOTSUP, "not a transformer config");
	expect_error("hybrid-linear.json", -ENOTSUP, "linear_attention");
	expect_error("indexer-freq.json", -ENOTSUP, "indexer_types");
	expect_error("no-such-config.json", -ENOENT, "no-such-config.json");

	assert_int_equal(kvt_model_parse("[1, 2]", "t", &m), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "not a JSON object"));
	assert_int_equal(kvt_model_parse("{} {}", "t", &m), -EINVAL);
	assert_int_equal(kvt_model_parse("", "t", &m), -EINVAL);
	assert_int_equal(kvt_model_parse(
		"{\"num_hidden_layers\": -4, \"num_attention_heads\": 8, \"hidden_size\": 64}",
		"t", &m), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "out of range"));
	assert_int_equal(kvt_model_parse(
		"{\"num_hidden_layers\": 4, \"num_attention_heads\": 8, \"head_dim\": 64.0}",
		"t", &m), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "head_dim must be an integer"));
	assert_int_equal(kvt_model_parse(
		"{\"num_hidden_layers\": 4, \"num_attention_heads\": 8, \"hidden_size\": 100}",
		"t", &m), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "not a multiple"));
	assert_int_equal(kvt_model_parse(
		"{\"num_hidden_layers\": 4, \"num_attention_heads\": 8, \"num_key_value_heads\": 3,"
		" \"head_dim\": 64}", "t", &m), -EINVAL);
	assert_int_equal(kvt_model_parse(
		"{\"num_hidden_layers\": 4, \"num_attention_heads\": 8, \"kv_lora_rank\": 512}",
		"t", &m), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "qk_rope_head_dim"));
	assert_int_equal(kvt_model_parse(
		"{\"num_hidden_layers\": 2, \"kv_lora_rank\": 512, \"qk_rope_head_dim\": 64,"
		" \"index_head_dim\": 128, \"indexer_types\": [\"full\"]}", "t", &m), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "1 entries for 2 layers"));
	assert_int_equal(kvt_model_parse(
		"{\"num_hidden_layers\": 2, \"kv_lora_rank\": 512, \"qk_rope_head_dim\": 64,"
		" \"index_head_dim\": 128, \"indexer_types\": [\"full\", \"half\"]}", "t", &m),
		-EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "indexer_types[1]"));
	/* a message that wraps an earlier one reads whole (it was formatted
	 * onto itself) */
	assert_int_equal(kvt_model_parse(
		"{\"num_hidden_layers\": 4, \"num_attention_heads\": 8}", "t", &m), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "t: no head_dim, and t: "));
	assert_non_null(strstr(kvt_numa_last_error(), "hidden_size"));
	/* not a regular file: refused at once, never read (a FIFO blocked) */
	{
		char fifo[64];
		snprintf(fifo, sizeof(fifo), "/tmp/kvt-fifo-%d", (int)getpid());
		assert_int_equal(mkfifo(fifo, 0600), 0);
		assert_int_equal(kvt_model_load(fifo, &m), -EINVAL);
		assert_non_null(strstr(kvt_numa_last_error(), "not a regular file"));
		unlink(fifo);
		assert_int_equal(kvt_model_load("/dev/zero", &m), -EINVAL);
		assert_int_equal(kvt_model_load("/tmp", &m), -EINVAL);
	}
	/* A minimal valid MLA config. */
	assert_int_equal(kvt_model_parse(
		"{\"num_hidden_layers\": 2, \"kv_lora_rank\": 512, \"qk_rope_head_dim\": 64}",
		"t", &m), 0);
	assert_int_equal(m.attn, KVT_ATTN_MLA);
}

#ifdef KVTIER_NUMA_HAVE_SEG
/* The plan's figures are what the core really builds: shard bytes, and the
 * segment size (metadata estimate included). */
static void t_matches_core(void **state)
{
	struct kvt_model m;
	struct kvt_size_req r;
	struct kvt_size_plan p;
	struct kvt_geometry g;
	struct kvt_seg_create_opts c;
	char name[64];
	kvt_seg *seg = NULL;

	(void)state;
	load("llama-3.1-8b.json", &m);
	r = req(&m, KVT_DTYPE_BF16, 4);
	r.chunk_tokens = 16;
	r.tokens = 16 * 100;
	p = plan(&r);
	memset(&g, 0, sizeof(g));
	g.chunk_tokens = p.chunk_tokens;
	g.world = p.world;
	g.n_instances = 1;
	g.mode = KVT_MODE_SHARDED;
	g.n_groups = p.n_groups;
	for (uint32_t i = 0; i < p.n_groups; i++) {
		g.groups[i].layers = p.groups[i].layers;
		g.groups[i].bytes_per_token = p.groups[i].bytes_per_token;
	}
	g.n_slots = (uint32_t)p.n_slots;
	assert_int_equal(kvt_geometry_shard_bytes(&g), p.chunk_bytes_rank);
	snprintf(name, sizeof(name), "kvt-numa-size-%d", (int)getpid());
	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.name = name;
	c.geo = &g;
	c.flags = KVT_SEG_F_REPLACE;
	assert_int_equal(kvt_seg_create(&c, NULL, &seg), 0);
	if (kvt_seg_size(seg) != p.segment_bytes)
		fail_msg("kvtier-size estimates %llu bytes, the core made %llu: update "
			 "meta_estimate() in numa/sizing.c", (unsigned long long)p.segment_bytes,
			 (unsigned long long)kvt_seg_size(seg));
	kvt_seg_detach(seg);
	kvt_seg_unlink(name, NULL);
}
#endif

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(t_llama_8b),
		cmocka_unit_test(t_other_gqa),
		cmocka_unit_test(t_deepseek_v3),
		cmocka_unit_test(t_deepseek_v4_flash),
		cmocka_unit_test(t_glm5_like_indexer),
		cmocka_unit_test(t_fit_and_largest),
		cmocka_unit_test(t_fit_replicated_and_nodes),
		cmocka_unit_test(t_request_errors),
		cmocka_unit_test(t_dtypes),
		cmocka_unit_test(t_bad_configs),
#ifdef KVTIER_NUMA_HAVE_SEG
		cmocka_unit_test(t_matches_core),
#endif
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
