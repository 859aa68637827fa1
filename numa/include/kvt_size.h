/* kvt_size.h - sizing rules: bytes per token and per chunk of a model's KV
 * cache, the tier and segment they make, and the fit check
 *
 *     F + shards x tier  <=  free memory of the node(s) the arena is bound to
 *
 * where F is the engine's fixed host memory and tier is one rank's part
 * (shards = TP x PP for a sharded layout, 1 for MLA's replicated layout).
 *
 * kvt_size_compute() is pure (no I/O, no global state) so tier/ can size a
 * segment from the same rules as the operator's tool (kvtier-size); it lives
 * in kvtier_numa.  Reading a Hugging Face config.json into a struct kvt_model
 * (kvt_model_load) needs json-c and lives in kvtier_hfconfig.
 *
 * Errors follow kvt_numa.h: -errno, with a sentence in kvt_numa_last_error().
 * Everything here is thread-safe; only kvt_model_load blocks (reads a file).
 */
#ifndef KVT_SIZE_H
#define KVT_SIZE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kvt_dtype {
	KVT_DTYPE_AUTO = 0, /* the model's dtype (bf16 when it has none) */
	KVT_DTYPE_BF16 = 1,
	KVT_DTYPE_FP16 = 2,
	KVT_DTYPE_FP8  = 3, /* e4m3 / e5m2: one byte */
	KVT_DTYPE_FP4  = 4, /* half a byte; block scales not counted */
	KVT_DTYPE_FP32 = 5,
};
/* "bf16" "bfloat16" "fp16" "float16" "half" "fp8" "fp8_e4m3" "fp8_e5m2"
 * "float8_e4m3fn" "fp4" "nvfp4" "mxfp4" "fp32" "float32" "auto".  0 or
 * -EINVAL (message lists the accepted names). */
int kvt_dtype_parse(const char *s, uint32_t *out);
const char *kvt_dtype_name(uint32_t dt);
uint32_t kvt_dtype_bits(uint32_t dt); /* 0 for AUTO or unknown */

enum kvt_attn {
	KVT_ATTN_GQA = 1, /* MHA, GQA, MQA: K and V per KV head */
	KVT_ATTN_MLA = 2, /* DeepSeek-V2/V3, Kimi K2, GLM-5.x: one latent per token */
};

/* What sizing needs from a model config. */
struct kvt_model {
	char model_type[64];
	char arch[96];            /* architectures[0], or model_type */
	uint32_t attn;            /* enum kvt_attn */
	uint32_t layers;          /* num_hidden_layers */
	/* GQA */
	uint32_t n_heads;         /* num_attention_heads */
	uint32_t n_kv_heads;      /* num_key_value_heads (= n_heads when absent) */
	uint32_t head_dim;        /* head_dim, else hidden_size / num_attention_heads */
	/* MLA */
	uint32_t kv_lora_rank;
	uint32_t qk_rope_head_dim;
	/* DSA indexer (DeepSeek-V3.2, GLM-5.x): 0 when the model has none */
	uint32_t index_head_dim;
	uint32_t indexer_layers;  /* layers that own an indexer cache: all, or
				   * the "full" entries of indexer_types */
	uint32_t dtype;           /* torch_dtype / dtype; AUTO when absent */
	/* DeepSeek V4 (model_type deepseek_v4): every layer keeps a sliding-
	 * window cache; the compressed ones also a cache of one state per 4
	 * (with the indexer) or 128 tokens and a compressor's running state.
	 * head_dim is the state's width (512); attn is MLA (replicated). */
	uint32_t dsv4;            /* 1 for DeepSeek V4 */
	uint32_t c4_layers;       /* compress_ratios 4 */
	uint32_t c128_layers;     /* compress_ratios 128 */
	uint32_t window;          /* sliding_window */
};

/* Checks that a model struct is complete and consistent.  0 or -EINVAL. */
int kvt_model_check(const struct kvt_model *m);

/* Bytes one layer of the indexer cache takes per token: fp8 keys plus one
 * fp32 scale per 128 values (how vLLM and SGLang store it: 132 for
 * index_head_dim 128), MXFP4's half a byte per value plus a scale byte
 * per 32 (vLLM's indexer_kv_dtype mxfp4: 68), or 2 bytes per value in
 * bf16/fp16.  0 for a dtype no engine keeps it in. */
uint32_t kvt_indexer_token_bytes(uint32_t index_head_dim, uint32_t dtype);

enum kvt_size_layout {
	KVT_SIZE_LAYOUT_AUTO = 0, /* MLA: replicated; else sharded */
	KVT_SIZE_SHARDED     = 1,
	KVT_SIZE_REPLICATED  = 2,
};

/* One NUMA node the arena is bound to. */
struct kvt_size_node {
	int node;
	uint32_t use_hp;          /* the segment goes on huge pages here */
	uint64_t free_bytes;      /* free memory (MemFree) */
	uint64_t hp_free_bytes;   /* free huge page bytes (use_hp) */
	double shards;            /* arena shards bound here; a shard spread over
				   * k nodes counts 1/k on each */
	double fixed_share;       /* share of F on this node, 0..1 */
	uint32_t has_meta;        /* the segment's metadata is here (one node) */
	uint32_t reserved;
};

struct kvt_size_req {
	size_t size;              /* sizeof(struct kvt_size_req) */
	const struct kvt_model *model;
	uint32_t kv_dtype;        /* enum kvt_dtype */
	uint32_t indexer_dtype;   /* AUTO: fp8 (engines keep the indexer in fp8) */
	uint32_t tp, pp;          /* >= 1 */
	uint32_t chunk_tokens;    /* 0: 256 */
	uint32_t layout;          /* enum kvt_size_layout */
	uint64_t tier_bytes;      /* one rank's tier; 0: use tokens */
	uint64_t tokens;          /* tokens to hold; 0 with tier_bytes 0: the
				   * largest tier that fits the nodes */
	uint64_t fixed_bytes;     /* F */
	uint32_t n_nodes;         /* 0: no fit check */
	uint32_t reserved;        /* must be 0 */
	const struct kvt_size_node *nodes;
};

#define KVT_SIZE_MAX_NODES 64

struct kvt_size_node_result {
	int node;
	uint32_t fits;
	uint32_t use_hp;
	uint32_t reserved;
	uint64_t free_bytes;      /* what the arena part is checked against
				   * (huge page pool when use_hp) */
	uint64_t mem_free_bytes;  /* MemFree */
	uint64_t fixed_bytes;     /* F's share */
	uint64_t seg_bytes;       /* the segment's part (arena share + metadata) */
};

struct kvt_size_plan {
	uint32_t layout;          /* SHARDED or REPLICATED (resolved) */
	uint32_t kv_dtype;        /* resolved */
	uint32_t indexer_dtype;   /* resolved */
	uint32_t tp, pp, world;
	uint32_t n_shards;        /* world (sharded) or 1 (replicated) */
	uint32_t chunk_tokens;
	uint32_t kv_heads_rank;   /* GQA: KV heads one rank holds */
	uint32_t n_groups;        /* layer groups, as in struct kvt_geometry */
	struct {
		uint32_t layers;          /* one pipeline stage's layers */
		uint32_t bytes_per_token; /* per layer, one rank (DeepSeek V4: a
					   * chunk's bytes / chunk_tokens) */
		const char *name;         /* "kv", "indexer", DeepSeek V4's caches */
	} groups[8];
	uint64_t token_bytes_rank;  /* one token, one rank */
	uint64_t token_bytes_all;   /* one token, every shard */
	uint64_t chunk_bytes_rank;  /* one shard of one chunk, as stored */
	uint64_t chunk_bytes_all;
	uint64_t n_slots;           /* chunks the tier holds */
	uint64_t tokens;            /* n_slots x chunk_tokens */
	uint64_t tier_bytes;        /* one rank's part, 2 MiB aligned */
	uint64_t arena_bytes;       /* n_shards x tier_bytes */
	uint64_t meta_bytes;        /* header, tables, index: an estimate of
				     * core's layout v1 */
	uint64_t segment_bytes;     /* meta + arena */
	uint64_t private_bytes;     /* world private per-rank tiers of the same
				     * size (what a replicated layout saves) */
	/* fit check (n_nodes > 0) */
	uint32_t checked;
	uint32_t fits;
	uint64_t need_bytes;        /* F + segment */
	uint64_t free_bytes;        /* summed over the nodes */
	uint32_t n_nodes;
	uint32_t reserved;
	struct kvt_size_node_result nodes[KVT_SIZE_MAX_NODES];
	uint64_t max_slots;         /* largest tier that fits (checked) */
	uint64_t max_tokens;
	uint64_t max_tier_bytes;
	uint32_t max_on_4k;         /* kvtier-size: the largest is on 4 KiB pages,
				     * the plan's segment on huge pages */
	uint32_t reserved2;
};

/* Sizes a tier.  Returns 0 with *out filled (out->fits says whether it
 * fits; with neither tier_bytes nor tokens the plan is the largest tier that
 * fits, possibly 0 slots), or -EINVAL: bad request, TP that does not divide
 * the KV heads, a replicated layout with PP > 1 (the segment keeps one
 * shared shard per world), a world over 64, a tier under one chunk, or
 * numbers that overflow.  Pure: no I/O. */
int kvt_size_compute(const struct kvt_size_req *r, struct kvt_size_plan *out);

/* AMD's pinning budget.  Every hsa_amd_memory_lock_to_pool (a rank
 * registering its shard of the arena) is charged in full to the amdgpu
 * KFD driver's one node-wide counter of pinned system memory (userptr and
 * GTT together, every process and GPU; the engine's own pinned buffers
 * too), and a lock past its limit fails (HSA_STATUS_ERROR_OUT_OF_RESOURCES,
 * which the HSA backend reports as -ENOMEM).  Each rank locks its own
 * shard: in the sharded layout the ranks lock the arena once between them,
 * in the replicated one each rank locks all of it, and each engine
 * instance on the segment locks it again.  The limit as the driver sets it
 * at load (amdgpu_amdkfd_gpuvm_init_mem_limits, read from the amdgpu
 * sources): RAM - RAM/64 - 1 GiB (halved instead below 2 GiB); older
 * kernels took 15/16 of the RAM free at load; the module parameter
 * amdgpu.no_system_mem_limit=1 lifts it. */
uint64_t kvt_size_kfd_limit(uint64_t ram_bytes);
/* Bytes the ranks of `instances` engine instances lock for plan p. */
uint64_t kvt_size_amd_locked(const struct kvt_size_plan *p, uint32_t instances);

/* ---- Hugging Face config.json (kvtier_hfconfig, needs json-c) ---------- */

/* Reads a config.json: MHA/GQA (num_key_value_heads, head_dim or
 * hidden_size / num_attention_heads), MLA (kv_lora_rank, qk_rope_head_dim),
 * the DSA indexer (index_head_dim; indexer_types when only some layers own
 * one), a nested text_config (multimodal models).  Returns 0, -ENOENT (no
 * file), -EINVAL (not JSON, or a field of the wrong type or range: the
 * message names it), -ENOTSUP (an architecture it cannot size: no attention
 * fields, linear-attention layers, an indexer layout it cannot count). */
int kvt_model_load(const char *path, struct kvt_model *out);
/* The same from text; `what` names it in messages. */
int kvt_model_parse(const char *json, const char *what, struct kvt_model *out);

#ifdef __cplusplus
}
#endif
#endif /* KVT_SIZE_H */
