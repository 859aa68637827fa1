/* kvtier-size - plans the memory of a kvtier segment from a model's
 * config.json and checks it against the NUMA node(s) it will be bound to.
 *
 *   kvtier-size [options] CONFIG.json
 *
 * Exit status: 0 the plan fits, 1 it does not, in memory or, for AMD, in the
 * driver's pinning budget (the numbers and the largest
 * tier that would fit are printed), 2 bad usage or a config it cannot size.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include "kvt_numa.h"
#include "kvt_size.h"

#define GiB (1024.0 * 1024.0 * 1024.0)
#define EXIT_NOFIT 1
#define EXIT_USAGE 2

struct opts {
	const char *config;
	const char *numa_nodes;
	uint32_t kv_dtype, indexer_dtype, tp, pp, chunk, layout, hp;
	uint64_t fixed, tier, tokens;
	double node_free_gib;
	int have_node_free, json, indexer_layers;
	uint32_t gpu, instances;   /* GPU_*; engine instances on the segment */
	uint64_t ram;              /* --ram-gib; 0: MemTotal */
};

enum { GPU_AUTO = 0, GPU_NONE, GPU_AMD, GPU_NVIDIA };

static void usage(FILE *f)
{
	fprintf(f,
"usage: kvtier-size [options] CONFIG.json\n"
"\n"
"Plans a kvtier segment for the model in CONFIG.json (a Hugging Face config)\n"
"and checks  F + shards x tier <= free memory  of the NUMA node(s) it is bound\n"
"to (shards = TP x PP when sharded, 1 when replicated: MLA models).\n"
"\n"
"  --kv-dtype D        KV cache dtype: bf16 fp16 fp8 fp4 fp32 (default: the\n"
"                      model's torch_dtype, else bf16)\n"
"  --indexer-dtype D   DSA indexer cache dtype: fp8 (default), fp4 (vLLM's\n"
"                      MXFP4 indexer cache) or bf16\n"
"  --indexer-layers N  layers that own an indexer cache (overrides the config)\n"
"  --tp N, --pp N      tensor and pipeline parallel sizes (default 1)\n"
"  --layout L          auto (default: MLA replicated, else sharded), sharded,\n"
"                      replicated\n"
"  --chunk-tokens N    tokens per chunk (default 256)\n"
"  --fixed-gib F       the engine's fixed host memory on the node(s) (default 0)\n"
"  --tier-gib G        one rank's tier, GiB          } neither: the largest\n"
"  --tokens N          tokens the tier must hold     } tier that fits\n"
"  --numa-nodes LIST   nodes the arena is bound to (default: as kvtier chooses:\n"
"                      KVTIER_NUMA_NODES, numactl policy, GPU-local, local)\n"
"  --node-free-gib X   free memory of each node instead of sysfs (planning for\n"
"                      another machine; with --numa-nodes for several nodes)\n"
"  --hugepages M       auto (default: the segment on the nodes' reserved 2 MiB\n"
"                      pages when they hold it, else 4 KiB pages), on, off\n"
"  --gpu G             auto (default: amd when /dev/kfd exists), amd, nvidia,\n"
"                      none; amd checks the driver's pinning budget: every\n"
"                      rank's lock of its shard counts, against RAM - RAM/64\n"
"                      - 1 GiB for the whole node\n"
"  --instances N       engine instances sharing the segment (default 1): each\n"
"                      one's ranks lock the arena again (amd)\n"
"  --ram-gib X         the node's RAM for the pinning budget instead of\n"
"                      /proc/meminfo's MemTotal\n"
"  --json              machine-readable output\n"
"\n"
"Exit status: 0 fits, 1 does not fit (memory, or AMD's pinning budget), 2 usage\n"
"or config error.\n"
"Free memory is MemFree of sysfs node meminfo (KVTIER_SYSFS_ROOT overrides /sys).\n");
}

static int bad(const char *opt, const char *val, const char *why)
{
	fprintf(stderr, "kvtier-size: %s '%s': %s\n", opt, val, why);
	return -EINVAL;
}

static int parse_u32(const char *opt, const char *s, uint32_t min, uint32_t max, uint32_t *out)
{
	char *end;
	unsigned long long v;

	if (!s || *s < '0' || *s > '9')
		return bad(opt, s ? s : "", "expected a whole number");
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || v < min || v > max) {
		char why[64];

		snprintf(why, sizeof(why), "expected a whole number in %u..%u", min, max);
		return bad(opt, s, why);
	}
	*out = (uint32_t)v;
	return 0;
}

static int parse_gib(const char *opt, const char *s, double *out)
{
	char *end;
	double v;

	if (!s || !((*s >= '0' && *s <= '9') || *s == '.'))
		return bad(opt, s ? s : "", "expected a size in GiB, e.g. 64 or 0.5");
	errno = 0;
	v = strtod(s, &end);
	if (errno || *end || !isfinite(v) || v < 0 || v > 1e9)
		return bad(opt, s, "expected a size in GiB, e.g. 64 or 0.5");
	*out = v;
	return 0;
}

static uint64_t gib_bytes(double g)
{
	return (uint64_t)llround(g * GiB);
}

static int parse_args(int argc, char **argv, struct opts *o)
{
	enum { O_KV = 256, O_IDX, O_IDXL, O_TP, O_PP, O_LAYOUT, O_CHUNK, O_FIXED, O_TIER,
	       O_TOKENS, O_NODES, O_FREE, O_HP, O_JSON, O_HELP, O_GPU, O_INST, O_RAM };
	static const struct option lo[] = {
		{"kv-dtype", required_argument, 0, O_KV},
		{"indexer-dtype", required_argument, 0, O_IDX},
		{"indexer-layers", required_argument, 0, O_IDXL},
		{"tp", required_argument, 0, O_TP},
		{"pp", required_argument, 0, O_PP},
		{"layout", required_argument, 0, O_LAYOUT},
		{"chunk-tokens", required_argument, 0, O_CHUNK},
		{"fixed-gib", required_argument, 0, O_FIXED},
		{"tier-gib", required_argument, 0, O_TIER},
		{"tokens", required_argument, 0, O_TOKENS},
		{"numa-nodes", required_argument, 0, O_NODES},
		{"node-free-gib", required_argument, 0, O_FREE},
		{"hugepages", required_argument, 0, O_HP},
		{"json", no_argument, 0, O_JSON},
		{"gpu", required_argument, 0, O_GPU},
		{"instances", required_argument, 0, O_INST},
		{"ram-gib", required_argument, 0, O_RAM},
		{"help", no_argument, 0, O_HELP},
		{0, 0, 0, 0},
	};
	double g;
	int c, r = 0;

	memset(o, 0, sizeof(*o));
	o->tp = o->pp = 1;
	o->chunk = 256;
	o->indexer_layers = -1;
	o->instances = 1;
	opterr = 0;
	while (r == 0 && (c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		uint32_t u;

		switch (c) {
		case O_KV:
			if (kvt_dtype_parse(optarg, &o->kv_dtype))
				r = bad("--kv-dtype", optarg, kvt_numa_last_error());
			break;
		case O_IDX:
			if (kvt_dtype_parse(optarg, &o->indexer_dtype))
				r = bad("--indexer-dtype", optarg, kvt_numa_last_error());
			break;
		case O_IDXL:
			if (!(r = parse_u32("--indexer-layers", optarg, 0, 4096, &u)))
				o->indexer_layers = (int)u;
			break;
		case O_TP: r = parse_u32("--tp", optarg, 1, 64, &o->tp); break;
		case O_INST: r = parse_u32("--instances", optarg, 1, 64, &o->instances); break;
		case O_GPU:
			if (!strcmp(optarg, "auto"))
				o->gpu = GPU_AUTO;
			else if (!strcmp(optarg, "none"))
				o->gpu = GPU_NONE;
			else if (!strcmp(optarg, "amd"))
				o->gpu = GPU_AMD;
			else if (!strcmp(optarg, "nvidia"))
				o->gpu = GPU_NVIDIA;
			else
				r = bad("--gpu", optarg, "expected auto, amd, nvidia or none");
			break;
		case O_RAM:
			if (!(r = parse_gib("--ram-gib", optarg, &g)))
				o->ram = gib_bytes(g);
			if (!r && !o->ram)
				r = bad("--ram-gib", optarg, "RAM must be larger than 0");
			break;
		case O_PP: r = parse_u32("--pp", optarg, 1, 64, &o->pp); break;
		case O_CHUNK: r = parse_u32("--chunk-tokens", optarg, 1, 1u << 20, &o->chunk); break;
		case O_LAYOUT:
			if (!strcmp(optarg, "auto"))
				o->layout = KVT_SIZE_LAYOUT_AUTO;
			else if (!strcmp(optarg, "sharded"))
				o->layout = KVT_SIZE_SHARDED;
			else if (!strcmp(optarg, "replicated"))
				o->layout = KVT_SIZE_REPLICATED;
			else
				r = bad("--layout", optarg, "expected auto, sharded or replicated");
			break;
		case O_FIXED:
			if (!(r = parse_gib("--fixed-gib", optarg, &g)))
				o->fixed = gib_bytes(g);
			break;
		case O_TIER:
			if (!(r = parse_gib("--tier-gib", optarg, &g)))
				o->tier = gib_bytes(g);
			if (!r && !o->tier)
				r = bad("--tier-gib", optarg, "a tier must be larger than 0");
			break;
		case O_TOKENS: {
			char *end;

			errno = 0;
			o->tokens = strtoull(optarg, &end, 10);
			if (errno || *end || *optarg < '1' || *optarg > '9')
				r = bad("--tokens", optarg, "expected a positive whole number");
			else if (o->tokens > (1ULL << 50))
				r = bad("--tokens", optarg, "more than 2^50 tokens (a segment holds "
					"at most 2^30 chunks of at most 2^20 tokens)");
			break;
		}
		case O_NODES: {
			struct kvt_nodemask m;

			if (kvt_nodemask_parse(optarg, "--numa-nodes", &m)) {
				fprintf(stderr, "kvtier-size: %s\n", kvt_numa_last_error());
				r = -EINVAL;
			}
			o->numa_nodes = optarg;
			break;
		}
		case O_FREE:
			r = parse_gib("--node-free-gib", optarg, &o->node_free_gib);
			o->have_node_free = 1;
			break;
		case O_HP:
			if (kvt_hp_want_parse(optarg, "--hugepages", &o->hp)) {
				fprintf(stderr, "kvtier-size: %s\n", kvt_numa_last_error());
				r = -EINVAL;
			}
			break;
		case O_JSON: o->json = 1; break;
		case 'h':
		case O_HELP: usage(stdout); exit(0);
		default:
			fprintf(stderr, "kvtier-size: unknown option or missing value: %s\n",
				argv[optind - 1]);
			r = -EINVAL;
		}
	}
	if (r)
		return r;
	if (o->tier && o->tokens) {
		fprintf(stderr, "kvtier-size: give --tier-gib or --tokens, not both\n");
		return -EINVAL;
	}
	if (optind != argc - 1) {
		fprintf(stderr, "kvtier-size: expected one CONFIG.json (see --help)\n");
		return -EINVAL;
	}
	o->config = argv[optind];
	return 0;
}

struct logbuf {
	char reason[1024];
};

static void log_cb(void *arg, int level, const char *msg)
{
	struct logbuf *l = arg;

	if (level == KVT_NUMA_LOG_WARN)
		fprintf(stderr, "kvtier-size: warning: %s\n", msg);
	else
		snprintf(l->reason, sizeof(l->reason), "%s", msg);
}

/* The nodes and what each carries, from --node-free-gib (planning) or from
 * this machine's topology and kvtier's own placement choice. */
static int build_nodes(const struct opts *o, uint32_t n_shards, uint32_t world,
		       struct kvt_size_node *nodes, uint32_t *n_nodes, char *placement,
		       size_t plen)
{
	struct kvt_nodemask set;
	struct kvt_numa_topo *t = NULL;
	struct kvt_numa_plan plan;
	struct kvt_numa_request req;
	struct logbuf lb = {""};
	int ids[KVT_SIZE_MAX_NODES];
	uint32_t n = 0;
	int r;

	if (o->have_node_free) {
		if (o->hp == KVT_HP_ON) {
			fprintf(stderr, "kvtier-size: --hugepages on needs the nodes' huge page "
				"pools from sysfs; --node-free-gib gives only free memory\n");
			return -EINVAL;
		}
		kvt_nodemask_zero(&set);
		if (o->numa_nodes)
			kvt_nodemask_parse(o->numa_nodes, "--numa-nodes", &set);
		else
			kvt_nodemask_set(&set, 0);
		if (kvt_nodemask_count(&set) > KVT_SIZE_MAX_NODES) {
			fprintf(stderr, "kvtier-size: at most %d nodes\n", KVT_SIZE_MAX_NODES);
			return -EINVAL;
		}
		for (int nd = kvt_nodemask_first(&set); nd >= 0; nd = kvt_nodemask_next(&set, nd))
			ids[n++] = nd;
		memset(nodes, 0, n * sizeof(*nodes));
		/* No topology: ranks fill the nodes in order (rank r on node
		 * r * nodes / world), as GPUs do on a symmetric machine; a
		 * replicated arena is spread over all of them. */
		for (uint32_t i = 0; i < n; i++) {
			nodes[i].node = ids[i];
			nodes[i].free_bytes = gib_bytes(o->node_free_gib);
			nodes[i].fixed_share = 1.0 / n;
			nodes[i].has_meta = i == 0;
			if (n_shards == 1)
				nodes[i].shards = 1.0 / n;
		}
		if (n_shards > 1)
			for (uint32_t s = 0; s < n_shards; s++)
				nodes[(uint64_t)s * n / n_shards].shards += 1.0;
		if (n == 1)
			snprintf(placement, plen, "node %d, %.2f GiB free (--node-free-gib)",
				 ids[0], o->node_free_gib);
		else
			snprintf(placement, plen, "nodes %s, %.2f GiB free each (--node-free-gib); "
				 "%s", o->numa_nodes, o->node_free_gib, n_shards > 1 ?
				 "ranks fill the nodes in order, each shard on its rank's node" :
				 "the shared arena interleaved over them");
		*n_nodes = n;
		return 0;
	}

	r = kvt_numa_topo_read(NULL, &t);
	if (r) {
		fprintf(stderr, "kvtier-size: %s (give --node-free-gib to plan without it)\n",
			kvt_numa_last_error());
		return r;
	}
	memset(&req, 0, sizeof(req));
	req.size = sizeof(req);
	req.n_shards = n_shards;
	req.n_ranks = world > n_shards ? world : n_shards;
	req.nodes = o->numa_nodes;
	req.log = log_cb;
	req.log_arg = &lb;
	r = kvt_numa_choose(t, &req, &plan);
	if (r) {
		fprintf(stderr, "kvtier-size: %s\n", kvt_numa_last_error());
		kvt_numa_topo_free(t);
		return r;
	}
	snprintf(placement, plen, "%s", lb.reason);
	for (int nd = kvt_nodemask_first(&plan.nodes); nd >= 0 && n < KVT_SIZE_MAX_NODES;
	     nd = kvt_nodemask_next(&plan.nodes, nd)) {
		const struct kvt_numa_node *node = kvt_numa_topo_node(t, nd);
		const struct kvt_numa_hp *hp = kvt_numa_topo_hp(t, nd, 2u << 20);
		struct kvt_size_node *sn = &nodes[n];

		memset(sn, 0, sizeof(*sn));
		sn->node = nd;
		sn->free_bytes = node ? node->mem_free : 0;
		if (o->hp != KVT_HP_OFF && hp && hp->total > 0) {
			sn->use_hp = 1;
			sn->hp_free_bytes = hp->free * (2u << 20);
		} else if (o->hp == KVT_HP_ON) {
			fprintf(stderr, "kvtier-size: --hugepages on, but node %d has no 2 MiB "
				"huge pages reserved\n", nd);
			kvt_numa_topo_free(t);
			return -ENOMEM;
		}
		for (uint32_t s = 0; s < plan.n_shards; s++)
			if (kvt_nodemask_test(&plan.shard[s].nodes, nd))
				sn->shards += 1.0 / kvt_nodemask_count(&plan.shard[s].nodes);
		sn->fixed_share = 1.0 / kvt_nodemask_count(&plan.nodes);
		/* The creator touches the metadata first; it lands on the
		 * first node of shard 0. */
		sn->has_meta = nd == kvt_nodemask_first(&plan.shard[0].nodes);
		n++;
	}
	kvt_numa_topo_free(t);
	*n_nodes = n;
	return 0;
}

/* 1234567 -> "1,234,567" */
static const char *commas(uint64_t v, char *buf, size_t len)
{
	char tmp[32];
	int n = snprintf(tmp, sizeof(tmp), "%" PRIu64, v), o = 0;

	for (int i = 0; i < n && (size_t)o + 2 < len; i++) {
		if (i && (n - i) % 3 == 0)
			buf[o++] = ',';
		buf[o++] = tmp[i];
	}
	buf[o] = '\0';
	return buf;
}

static double gib(uint64_t b)
{
	return (double)b / GiB;
}

static void print_model(const struct kvt_model *m, const struct kvt_size_plan *p)
{
	if (m->dsv4)
		printf("model       %s (model_type %s): DeepSeek V4, %u layers (%u compress by "
		       "4 with the indexer, %u by 128), head_dim %u, window %u; the caches as "
		       "kvtier.vllm keeps them (a window's tail per chunk)\n", m->arch,
		       m->model_type, m->layers, m->c4_layers, m->c128_layers, m->head_dim,
		       m->window);
	else if (m->attn == KVT_ATTN_MLA)
		printf("model       %s (model_type %s): MLA, %u layers, kv_lora_rank %u + "
		       "qk_rope_head_dim %u = %u values per token per layer\n", m->arch,
		       m->model_type, m->layers, m->kv_lora_rank, m->qk_rope_head_dim,
		       m->kv_lora_rank + m->qk_rope_head_dim);
	else
		printf("model       %s (model_type %s): %s, %u layers, %u KV heads x head_dim "
		       "%u\n", m->arch, m->model_type,
		       m->n_kv_heads == m->n_heads ? "MHA" : m->n_kv_heads == 1 ? "MQA" : "GQA",
		       m->layers, m->n_kv_heads, m->head_dim);
	if (m->indexer_layers && !m->dsv4)
		printf("indexer     %u of %u layers own an indexer cache, index_head_dim %u, "
		       "%s: %u bytes per token per layer\n", m->indexer_layers, m->layers,
		       m->index_head_dim, kvt_dtype_name(p->indexer_dtype),
		       p->groups[1].bytes_per_token);
	printf("kv cache    %s; TP %u x PP %u = %u rank%s; ", kvt_dtype_name(p->kv_dtype),
	       p->tp, p->pp, p->world, p->world > 1 ? "s" : "");
	if (p->layout == KVT_SIZE_REPLICATED)
		printf("replicated layout (every rank holds the same latent: one shared copy)\n");
	else if (m->attn == KVT_ATTN_GQA)
		printf("sharded layout (each rank holds %u of %u KV heads%s)\n",
		       p->kv_heads_rank, m->n_kv_heads,
		       p->pp > 1 ? " of its stage's layers" : "");
	else
		printf("sharded layout (each rank keeps its own copy of the latent)\n");
	printf("chunk       %u tokens\n", p->chunk_tokens);
}

/* AMD's pinning budget (kvt_size_kfd_limit): what the plan's ranks lock
 * against the driver's node-wide limit. */
static struct {
	int on, fits;
	uint64_t ram, limit, locked, max_tier;
} A;

static uint64_t mem_total(void)
{
	char line[256];
	unsigned long long kb = 0;
	FILE *f = fopen("/proc/meminfo", "r");

	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "MemTotal: %llu kB", &kb) == 1)
			break;
	fclose(f);
	return (uint64_t)kb << 10;
}

static int amd_budget(const struct opts *o, const struct kvt_size_plan *p)
{
	uint64_t ranks = (uint64_t)o->instances * p->world;

	A.on = o->gpu == GPU_AMD || (o->gpu == GPU_AUTO && access("/dev/kfd", F_OK) == 0);
	if (!A.on)
		return 0;
	A.ram = o->ram ? o->ram : mem_total();
	if (!A.ram) {
		fprintf(stderr, "kvtier-size: --gpu amd: no MemTotal in /proc/meminfo; give "
			"--ram-gib\n");
		return -EINVAL;
	}
	A.limit = kvt_size_kfd_limit(A.ram);
	A.locked = kvt_size_amd_locked(p, o->instances);
	A.fits = A.locked <= A.limit;
	A.max_tier = (A.limit / ranks) & ~((2ull << 20) - 1);
	return 0;
}

static void print_amd(const struct opts *o, const struct kvt_size_plan *p)
{
	if (!A.on)
		return;
	printf("\namd pinning %u instance%s x %u ranks x %.2f GiB locked = %.2f GiB (each rank "
	       "locks its shard%s), against the driver's node-wide limit %.2f GiB (RAM %.2f GiB "
	       "- 1/64 - 1 GiB), shared with the engine's own pinned memory: %s\n",
	       o->instances, o->instances > 1 ? "s" : "", p->world, gib(p->tier_bytes),
	       gib(A.locked), p->layout == KVT_SIZE_REPLICATED ? ": replicated, the whole "
	       "arena each" : "", gib(A.limit), gib(A.ram), A.fits ? "fits" : "EXCEEDS IT");
	if (!A.fits)
		printf("            the ranks past it fail to register their KV cache "
		       "(hsa_amd_memory_lock_to_pool: OUT_OF_RESOURCES, -ENOMEM); largest tier "
		       "within it: %.2f GiB per rank, or load amdgpu with no_system_mem_limit=1\n",
		       gib(A.max_tier));
}

static void print_text(const struct opts *o, const struct kvt_model *m,
		       const struct kvt_size_plan *p, const char *placement, const char *hp_note)
{
	char a[32], b[32], c[32], d[32];

	print_model(m, p);
	printf("\n%-14s %16s %20s\n", "", "per rank", p->n_shards > 1 ? "all shards" :
	       "segment (1 shard)");
	printf("%-14s %16s %20s   ", "bytes/token", commas(p->token_bytes_rank, a, sizeof(a)),
	       commas(p->token_bytes_all, b, sizeof(b)));
	for (uint32_t g = 0; g < p->n_groups; g++)
		printf("%s%u %s%slayers x %s B", g ? " + " : "", p->groups[g].layers,
		       g || m->dsv4 ? p->groups[g].name : "", g || m->dsv4 ? " " : "",
		       commas(p->groups[g].bytes_per_token, c, sizeof(c)));
	printf("\n");
	printf("%-14s %16s %20s   %u tokens\n", "bytes/chunk",
	       commas(p->chunk_bytes_rank, a, sizeof(a)), commas(p->chunk_bytes_all, b, sizeof(b)),
	       p->chunk_tokens);
	printf("%-14s %12.2f GiB %16.2f GiB   %s chunks = %s tokens\n", "tier",
	       gib(p->tier_bytes), gib(p->arena_bytes), commas(p->n_slots, c, sizeof(c)),
	       commas(p->tokens, d, sizeof(d)));
	printf("%-14s %16s %16.2f GiB   arena %u x %.2f GiB + metadata ~%.1f MiB\n", "segment",
	       "", gib(p->segment_bytes), p->n_shards, gib(p->tier_bytes),
	       (double)p->meta_bytes / (1 << 20));
	if (p->layout == KVT_SIZE_REPLICATED && p->world > 1)
		printf("%-14s %16s %16.2f GiB   saved against %u private per-rank tiers "
		       "(%.2f GiB)\n", "replication", "", gib(p->private_bytes - p->tier_bytes),
		       p->world, gib(p->private_bytes));

	if (!p->checked)
		return;
	printf("\nplacement   %s\n", placement);
	if (hp_note[0])
		printf("huge pages  %s\n", hp_note);
	printf("\n%-6s %12s %14s %12s %14s  %s\n", "node", "F share", "segment part", "need",
	       "free", "result");
	for (uint32_t i = 0; i < p->n_nodes; i++) {
		const struct kvt_size_node_result *n = &p->nodes[i];

		printf("%-6d %8.2f GiB %10.2f GiB %8.2f GiB %10.2f GiB  %s\n", n->node,
		       gib(n->fixed_bytes), gib(n->seg_bytes), gib(n->fixed_bytes + n->seg_bytes),
		       gib(n->mem_free_bytes), n->fits ? "fits" : "DOES NOT FIT");
		if (n->use_hp)
			printf("%-6s %12s %14s %12s %10.2f GiB  (2 MiB huge pages for the segment)\n",
			       "", "", "", "", gib(n->free_bytes));
	}
	printf("\ncheck       F + %u x tier + metadata = %.2f + %.2f = %.2f GiB, free %.2f GiB: "
	       "%s\n",
	       p->n_shards, gib(o->fixed), gib(p->segment_bytes), gib(p->need_bytes),
	       gib(p->free_bytes), p->fits ? "fits" : "DOES NOT FIT");
	if (p->max_slots)
		printf("largest     tier that fits: %.2f GiB per rank = %s chunks = %s tokens%s\n",
		       gib(p->max_tier_bytes), commas(p->max_slots, a, sizeof(a)),
		       commas(p->max_tokens, b, sizeof(b)),
		       p->max_on_4k ? " (on 4 KiB pages: more than the huge page pool holds)" : "");
	else
		printf("largest     tier that fits: none (F and the segment's metadata alone "
		       "leave no room for one chunk)\n");
}

static void print_json(const struct opts *o, const struct kvt_model *m,
		       const struct kvt_size_plan *p, const char *placement, const char *hp_note)
{
	json_object *j = json_object_new_object(), *mo = json_object_new_object();
	json_object *groups = json_object_new_array();

#define I64(obj, k, v) json_object_object_add(obj, k, json_object_new_int64((int64_t)(v)))
#define STR(obj, k, v) json_object_object_add(obj, k, json_object_new_string(v))
	STR(mo, "arch", m->arch);
	STR(mo, "model_type", m->model_type);
	STR(mo, "attention", m->attn == KVT_ATTN_MLA ? "mla" : "gqa");
	I64(mo, "layers", m->layers);
	if (m->attn == KVT_ATTN_MLA) {
		I64(mo, "kv_lora_rank", m->kv_lora_rank);
		I64(mo, "qk_rope_head_dim", m->qk_rope_head_dim);
	} else {
		I64(mo, "num_key_value_heads", m->n_kv_heads);
		I64(mo, "head_dim", m->head_dim);
	}
	if (m->indexer_layers) {
		I64(mo, "index_head_dim", m->index_head_dim);
		I64(mo, "indexer_layers", m->indexer_layers);
	}
	json_object_object_add(j, "model", mo);
	STR(j, "kv_dtype", kvt_dtype_name(p->kv_dtype));
	if (m->indexer_layers)
		STR(j, "indexer_dtype", kvt_dtype_name(p->indexer_dtype));
	I64(j, "tp", p->tp);
	I64(j, "pp", p->pp);
	I64(j, "world", p->world);
	STR(j, "layout", p->layout == KVT_SIZE_REPLICATED ? "replicated" : "sharded");
	I64(j, "shards", p->n_shards);
	I64(j, "chunk_tokens", p->chunk_tokens);
	for (uint32_t g = 0; g < p->n_groups; g++) {
		json_object *go = json_object_new_object();

		STR(go, "cache", p->groups[g].name ? p->groups[g].name : "kv");
		I64(go, "layers", p->groups[g].layers);
		I64(go, "bytes_per_token", p->groups[g].bytes_per_token);
		json_object_array_add(groups, go);
	}
	json_object_object_add(j, "layer_groups", groups);
	I64(j, "bytes_per_token_rank", p->token_bytes_rank);
	I64(j, "bytes_per_token_all", p->token_bytes_all);
	I64(j, "bytes_per_chunk_rank", p->chunk_bytes_rank);
	I64(j, "bytes_per_chunk_all", p->chunk_bytes_all);
	I64(j, "chunks", p->n_slots);
	I64(j, "tokens", p->tokens);
	I64(j, "tier_bytes_rank", p->tier_bytes);
	I64(j, "arena_bytes", p->arena_bytes);
	I64(j, "metadata_bytes_estimate", p->meta_bytes);
	I64(j, "segment_bytes", p->segment_bytes);
	I64(j, "private_tiers_bytes", p->private_bytes);
	I64(j, "fixed_bytes", o->fixed);
	if (p->checked) {
		json_object *arr = json_object_new_array();

		STR(j, "placement", placement);
		if (hp_note[0])
			STR(j, "hugepages_note", hp_note);
		for (uint32_t i = 0; i < p->n_nodes; i++) {
			const struct kvt_size_node_result *n = &p->nodes[i];
			json_object *no = json_object_new_object();

			I64(no, "node", n->node);
			I64(no, "fixed_bytes", n->fixed_bytes);
			I64(no, "segment_bytes", n->seg_bytes);
			I64(no, "mem_free_bytes", n->mem_free_bytes);
			json_object_object_add(no, "hugepages", json_object_new_boolean(n->use_hp));
			if (n->use_hp)
				I64(no, "hugepage_free_bytes", n->free_bytes);
			json_object_object_add(no, "fits", json_object_new_boolean(n->fits));
			json_object_array_add(arr, no);
		}
		json_object_object_add(j, "nodes", arr);
		I64(j, "need_bytes", p->need_bytes);
		I64(j, "free_bytes", p->free_bytes);
		json_object_object_add(j, "fits", json_object_new_boolean(p->fits));
		I64(j, "max_chunks", p->max_slots);
		I64(j, "max_tokens", p->max_tokens);
		I64(j, "max_tier_bytes_rank", p->max_tier_bytes);
		json_object_object_add(j, "max_on_4k_pages", json_object_new_boolean(p->max_on_4k));
	}
	if (A.on) {
		json_object *ao = json_object_new_object();

		I64(ao, "ram_bytes", A.ram);
		I64(ao, "limit_bytes", A.limit);
		I64(ao, "locked_bytes", A.locked);
		I64(ao, "instances", o->instances);
		I64(ao, "max_tier_bytes_rank", A.max_tier);
		json_object_object_add(ao, "fits", json_object_new_boolean(A.fits));
		json_object_object_add(j, "amd_pinning", ao);
	}
#undef I64
#undef STR
	printf("%s\n", json_object_to_json_string_ext(j, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED |
						      JSON_C_TO_STRING_NOSLASHESCAPE));
	json_object_put(j);
}

int main(int argc, char **argv)
{
	struct kvt_size_node nodes[KVT_SIZE_MAX_NODES];
	struct kvt_size_plan plan;
	struct kvt_size_req req;
	struct kvt_model m;
	struct opts o;
	char placement[1024] = "", hp_note[256] = "";
	uint32_t n_nodes = 0;

	if (parse_args(argc, argv, &o))
		return EXIT_USAGE;
	if (kvt_model_load(o.config, &m)) {
		fprintf(stderr, "kvtier-size: %s\n", kvt_numa_last_error());
		return EXIT_USAGE;
	}
	if (o.indexer_layers >= 0) {
		if (!m.index_head_dim && o.indexer_layers > 0) {
			fprintf(stderr, "kvtier-size: --indexer-layers: %s has no index_head_dim\n",
				o.config);
			return EXIT_USAGE;
		}
		if ((uint32_t)o.indexer_layers > m.layers) {
			fprintf(stderr, "kvtier-size: --indexer-layers %d: the model has %u "
				"layers\n", o.indexer_layers, m.layers);
			return EXIT_USAGE;
		}
		m.indexer_layers = (uint32_t)o.indexer_layers;
		if (!m.indexer_layers)
			m.index_head_dim = 0;
	}

	memset(&req, 0, sizeof(req));
	req.size = sizeof(req);
	req.model = &m;
	req.kv_dtype = o.kv_dtype;
	req.indexer_dtype = o.indexer_dtype;
	req.tp = o.tp;
	req.pp = o.pp;
	req.chunk_tokens = o.chunk;
	req.layout = o.layout;
	req.tier_bytes = o.tier;
	req.tokens = o.tokens;
	req.fixed_bytes = o.fixed;
	/* A first pass without nodes resolves the layout (shards) that the
	 * placement needs. */
	{
		struct kvt_size_req r0 = req;

		if (!r0.tier_bytes && !r0.tokens)
			r0.tokens = 1;
		if (kvt_size_compute(&r0, &plan)) {
			fprintf(stderr, "kvtier-size: %s\n", kvt_numa_last_error());
			return EXIT_USAGE;
		}
	}
	if (build_nodes(&o, plan.n_shards, plan.world, nodes, &n_nodes, placement,
			sizeof(placement)))
		return EXIT_USAGE;
	req.nodes = nodes;
	req.n_nodes = n_nodes;
	if (kvt_size_compute(&req, &plan)) {
		fprintf(stderr, "kvtier-size: %s\n", kvt_numa_last_error());
		return EXIT_USAGE;
	}
	/* AUTO does what the runtime does (kvt_hugepages_choose): huge pages
	 * when the pools hold the segment, else 4 KiB pages from MemFree.  So
	 * the largest tier that fits is the larger of the two placements' --
	 * a small pool reserved must not shrink it to what the pool holds --
	 * and when no size was asked, that largest is the plan. */
	if (o.hp == KVT_HP_AUTO) {
		struct kvt_size_node flat[KVT_SIZE_MAX_NODES];
		struct kvt_size_plan p4k;
		int any = 0;

		for (uint32_t i = 0; i < n_nodes; i++) {
			flat[i] = nodes[i];
			any |= flat[i].use_hp;
			flat[i].use_hp = 0;
			flat[i].hp_free_bytes = 0;
		}
		req.nodes = flat;
		if (any && kvt_size_compute(&req, &p4k) == 0) {
			int sized = !o.tier && !o.tokens;  /* the plan is the largest */

			if ((!plan.fits && (p4k.fits || p4k.max_tier_bytes > plan.max_tier_bytes)) ||
			    (sized && p4k.max_tier_bytes > plan.max_tier_bytes)) {
				snprintf(hp_note, sizeof(hp_note), "the 2 MiB huge page pool%s too "
					 "small: as kvtier would, the segment falls back to 4 KiB pages "
					 "(reserve more pages, or --hugepages off)",
					 n_nodes > 1 ? "s are" : " is");
				plan = p4k;
			} else if (p4k.max_tier_bytes > plan.max_tier_bytes) {
				/* this segment fits the pool; a larger one would go on
				 * 4 KiB pages, as kvtier would put it */
				plan.max_slots = p4k.max_slots;
				plan.max_tokens = p4k.max_tokens;
				plan.max_tier_bytes = p4k.max_tier_bytes;
				plan.max_on_4k = 1;
			}
		}
	}
	if (amd_budget(&o, &plan))
		return EXIT_USAGE;
	if (o.json) {
		print_json(&o, &m, &plan, placement, hp_note);
	} else {
		print_text(&o, &m, &plan, placement, hp_note);
		print_amd(&o, &plan);
	}
	if (!plan.fits || plan.n_slots == 0 || (A.on && !A.fits))
		return EXIT_NOFIT;
	return 0;
}
