/* bandwidth.c - kvtier-bench bandwidth: save and load GB/s through a real
 * segment, beside the platform's own copy ceiling measured in the same run.
 *
 * For every rank count R and chunk size C (or an engine layout), the parent
 * creates a segment (world R, sharded) and forks R rank processes; the
 * parent itself never touches a GPU runtime (CUDA does not survive fork).
 * Each rank attaches as a client, opens the DMA backend, allocates its KV
 * cache in device memory (cudaMalloc/hipMalloc-equivalent; ordinary memory
 * for the host backend), registers the layout and its own shard of the
 * arena (timed), and then, for every in-flight depth D, `repeat` times:
 *
 *   save  N chunks: kvt_write_begin -> plan -> kvt_dma_submit (D2H) ->
 *         wait -> kvt_write_end, at most D tickets in flight;
 *   load  the same N chunks: kvt_seg_lookup -> kvt_lease_slots -> submit
 *         (H2D, into other blocks) -> wait -> kvt_lease_release.
 *
 * Ranks start each phase together (a process-shared barrier); a phase's
 * GB/s is all ranks' bytes over (last end - first start).  Right after each
 * run, in R processes at once (on a busy machine both shift alike):
 *
 *   ceil  host: the run's own copies again -- same plans, device blocks and
 *         sub-slots -- by memcpy in one thread per rank (the platform's
 *         memcpy on exactly these pages); cuda: the driver's own pinned
 *         copy (kvt_dma_ceiling: cudaMemcpyAsync from cudaMallocHost
 *         memory), C-byte copies over the same device memory; hsa with HIP
 *         device memory: HIP's own pinned copy (hipMemcpyAsync from
 *         hipHostMalloc'ed memory, or hipHostRegister'ed with
 *         --hip-pinned register), the same copies -- what an AMD engine's
 *         own offload would do;
 *   peak  kvt_dma_ceiling(): host: memcpy of whole C-byte chunks over the
 *         same device memory (what memcpy does without the engine's page
 *         scatter); cuda: the same as ceil; hsa: the backend's own copy
 *         (hsa_amd_memory_async_copy from runtime-pinned pool memory).
 *
 * Device memory on AMD (hsa): hipMalloc through the HIP runtime, loaded at
 * run time (bench/hip.c), when it loads and finds the GPU (--device-memory
 * auto, the default; hip: required; backend: the hsa backend's own pool
 * allocation).  hipMalloc'ed memory is what a ROCm engine's KV cache is; the
 * hsa backend copies it directly (it is HSA pool memory).
 *
 * Medians of `repeat` runs (and of the per-run ratios) are printed.
 * Before timing, each configuration is verified once: a saved sub-slot must
 * hold the device pages token by token, and a load must reproduce them in
 * other blocks.
 *
 * The arena is sized so that no run evicts another's chunks (loads must
 * find them all) and goes where kvt_open would put it: on a hugetlbfs
 * mount with enough free huge pages, else in /dev/shm (--hugetlbfs).
 * Registration time of the arena and of a 4 KiB / 2 MiB page memfd of the
 * same size (the probe) is reported.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvt_core.h"
#include "bench_util.h"
#include "safe_kill.h"
#include "kvt_dma.h"
#include "kvt_numa.h"
#include "hip.h"

#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21u << 26)
#endif

#define MAX_LIST   16
#define MAX_RANKS  8
#define MAX_REP    9
#define KEY_HI     0x62616e6477696474ULL   /* "bandwidt" */
#define VERIFY_RUN 0xffu

struct opts {
	const char *backend;
	int device;
	const char *layout;            /* synth | glm5 | llama70b-tp8 */
	uint64_t chunks[MAX_LIST];
	uint32_t n_chunks;
	uint32_t depths[MAX_LIST];
	uint32_t n_depths;
	uint32_t ranks[MAX_LIST];
	uint32_t n_ranks;
	uint32_t layers, block_tokens, chunk_tokens;
	int random_blocks;
	uint64_t run_bytes;            /* per rank per run */
	uint64_t dev_bytes;            /* device KV per rank */
	uint32_t repeat;
	int json, no_2d, quiet;
	int no_kernel;                 /* --copy-kernel off */
	uint64_t kernel_below;         /* --copy-kernel SIZE (0: the backend's default) */
	int best;                      /* --stat best: maxima instead of medians */
	int warm;                      /* --warm: rewrite what a phase writes first */
	const char *plot;
	const char *hugetlbfs;         /* "auto" (default), "none" or a directory */
	uint64_t reg_bytes;            /* registration probe size */
	uint32_t workers;              /* host: copy threads, cuda: streams (0: default) */
	const char *dev_mem;           /* auto | backend | hip */
	int hip_register;              /* --hip-pinned register */
};

/* One configuration: a layout and a rank count. */
struct conf {
	struct kvt_geometry geo;
	uint32_t tpb[KVT_MAX_GROUPS];
	uint64_t chunk_bytes;          /* chunk_tokens * sum(layers * bpt) */
	uint64_t page;                 /* largest page of the layout */
	uint32_t ranks;
	uint32_t n;                    /* chunks per rank per run */
	uint64_t n_blocks;             /* per layer */
	char name[64];
	char dir[256];                 /* segment directory ("": /dev/shm) */
};

/* Results of one rank, in memory shared with the parent. */
struct rank_res {
	uint64_t t0[MAX_LIST][MAX_REP][2], t1[MAX_LIST][MAX_REP][2];
	uint64_t chunks[MAX_LIST][MAX_REP][2];
	double ceil_s[MAX_LIST][MAX_REP][2];  /* the ceiling next to each run */
	uint64_t ceil_b[MAX_LIST][MAX_REP][2]; /* bytes it moved */
	double peak_s[MAX_LIST][MAX_REP][2];  /* host: contiguous memcpy */
	uint64_t ceil_bytes, ceil_iters;
	uint64_t reg_ns, reg_bytes;
	uint32_t copies;               /* copies in a save plan */
	int failed;
	int hip;                       /* device memory from hipMalloc, HIP ceiling */
	int devptr_differs;            /* hipHostRegister: device address != host */
	char msg[512];
	char describe[512];
};

struct shared {
	pthread_barrier_t bar;
	struct rank_res r[MAX_RANKS];
};

/* One printed row. */
struct row {
	char layout[64];
	uint32_t ranks, depth, copies;
	uint64_t chunk, page;
	double gbs[2], ceil[2], ratio[2];
	double peak[2], peak_ratio[2]; /* host: contiguous memcpy; else = ceil */
	uint64_t reg_ns, reg_bytes;
	int huge;                      /* arena on hugetlbfs */
};


static int parse_list(const char *s, int sizes, uint64_t *v64, uint32_t *v32, uint32_t *n,
		      uint64_t max)
{
	char buf[256], *save = NULL, *tok;

	snprintf(buf, sizeof(buf), "%s", s);
	*n = 0;
	for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		uint64_t v;
		char *end;

		if (*n == MAX_LIST)
			return -1;
		if (sizes) {
			if (parse_size(tok, &v))
				return -1;
		} else {
			v = strtoull(tok, &end, 10);
			if (*end)
				return -1;
		}
		if (!v || v > max)
			return -1;
		if (v64)
			v64[*n] = v;
		else
			v32[*n] = (uint32_t)v;
		(*n)++;
	}
	return *n ? 0 : -1;
}

static void usage(FILE *f)
{
	fprintf(f,
"usage: kvtier-bench bandwidth [options]\n"
"  --backend B          auto | host | hsa | cuda (default: $KVTIER_DMA, else auto)\n"
"  --device N           GPU ordinal (default 0)\n"
"  --layout L           synth (default): one group of --layers layers, chunk sizes\n"
"                       from --chunk-sizes; glm5: 78 x 576 B + 21 x 132 B per token,\n"
"                       64-token blocks; llama70b-tp8: 160 x 256 B, 16-token blocks\n"
"  --chunk-sizes LIST   synth chunk sizes (default 64K,256K,1M,4M,16M)\n"
"  --layers N           synth layers (default 4)\n"
"  --block-tokens N     synth tokens per block (default 16)\n"
"  --chunk-tokens N     tokens per chunk (default 256)\n"
"  --blocks seq|random  block ids of a chunk: adjacent, or scattered (default random)\n"
"  --depths LIST        chunks in flight per rank (default 1,4,32)\n"
"  --ranks LIST         rank processes (default 1,2)\n"
"  --run-bytes SIZE     bytes each rank saves per run (default 128M)\n"
"  --dev-bytes SIZE     device KV per rank (default 256M)\n"
"  --repeat N           runs per measurement (default 3)\n"
"  --stat median|best   print medians (default) or the best run (busy machines)\n"
"  --reg-bytes SIZE     registration probe size (default 1G; 0: skip)\n"
"  --hugetlbfs DIR|auto|none\n"
"                       where the segment goes: auto (default) takes a hugetlbfs\n"
"                       mount with enough free huge pages, as kvt_open does,\n"
"                       else /dev/shm (4 KiB pages); none: /dev/shm\n"
"  --no-2d              plans without 2-D copies\n"
"  --copy-kernel auto|off|SIZE\n"
"                       cuda, hsa: chunks whose pages average below SIZE go\n"
"                       through the copy kernel (auto: the backend's 28K; off:\n"
"                       DMA only)\n"
"  --workers N          host: copy threads per rank (default: from the CPUs\n"
"                       this process may use, shared by the run's ranks);\n"
"                       cuda: streams per rank (default 4)\n"
"  --device-memory M    auto (default): hipMalloc when the backend is hsa and the\n"
"                       HIP runtime finds the GPU, else the backend's own; hip:\n"
"                       hipMalloc, required; backend: the backend's allocation\n"
"  --hip-pinned P       the HIP ceiling's host memory: malloc (hipHostMalloc,\n"
"                       default) or register (malloc + hipHostRegister)\n"
"  --warm               before each phase, write twice (untimed) the memory it\n"
"                       writes: the arena, and the host backend's device memory\n"
"  --json               one JSON object instead of the table\n"
"  --plot FILE          also draw FILE (PNG, gnuplot; FILE.gp and FILE.dat kept)\n");
}

static int parse(int argc, char **argv, struct opts *o)
{
	static const struct option lo[] = {
		{ "backend", 1, 0, 'b' }, { "device", 1, 0, 'd' }, { "layout", 1, 0, 'L' },
		{ "chunk-sizes", 1, 0, 'c' }, { "layers", 1, 0, 'l' },
		{ "block-tokens", 1, 0, 't' }, { "chunk-tokens", 1, 0, 'T' },
		{ "blocks", 1, 0, 'B' }, { "depths", 1, 0, 'D' }, { "ranks", 1, 0, 'r' },
		{ "run-bytes", 1, 0, 'R' }, { "dev-bytes", 1, 0, 'V' }, { "repeat", 1, 0, 'n' },
		{ "reg-bytes", 1, 0, 'G' }, { "hugetlbfs", 1, 0, 'H' }, { "no-2d", 0, 0, '2' },
		{ "copy-kernel", 1, 0, 'K' },
		{ "workers", 1, 0, 'w' }, { "device-memory", 1, 0, 'M' }, { "hip-pinned", 1, 0, 'P' },
		{ "stat", 1, 0, 's' }, { "json", 0, 0, 'j' }, { "warm", 0, 0, 'W' }, { "plot", 1, 0, 'p' }, { "help", 0, 0, 'h' },
		{ 0, 0, 0, 0 },
	};
	int c;

	memset(o, 0, sizeof(*o));
	o->device = 0;
	o->layout = "synth";
	parse_list("64K,256K,1M,4M,16M", 1, o->chunks, NULL, &o->n_chunks, 1ULL << 40);
	parse_list("1,4,32", 0, NULL, o->depths, &o->n_depths, KVT_DMA_INFLIGHT_MAX);
	parse_list("1,2", 0, NULL, o->ranks, &o->n_ranks, MAX_RANKS);
	o->layers = 4;
	o->block_tokens = 16;
	o->chunk_tokens = 256;
	o->random_blocks = 1;
	o->run_bytes = 128ULL << 20;
	o->dev_bytes = 256ULL << 20;
	o->repeat = 3;
	o->reg_bytes = 1ULL << 30;
	o->hugetlbfs = "auto";
	o->dev_mem = "auto";
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		int bad = 0;

		switch (c) {
		case 'b': o->backend = optarg; break;
		case 'd': o->device = atoi(optarg); bad = o->device < 0; break;
		case 'L':
			o->layout = optarg;
			bad = strcmp(optarg, "synth") && strcmp(optarg, "glm5") &&
			      strcmp(optarg, "llama70b-tp8");
			break;
		case 'c': bad = parse_list(optarg, 1, o->chunks, NULL, &o->n_chunks, 1ULL << 40); break;
		case 'l': o->layers = (uint32_t)atoi(optarg); bad = !o->layers; break;
		case 't': o->block_tokens = (uint32_t)atoi(optarg); bad = !o->block_tokens; break;
		case 'T': o->chunk_tokens = (uint32_t)atoi(optarg); bad = !o->chunk_tokens; break;
		case 'B':
			bad = strcmp(optarg, "seq") && strcmp(optarg, "random");
			o->random_blocks = !strcmp(optarg, "random");
			break;
		case 'D': bad = parse_list(optarg, 0, NULL, o->depths, &o->n_depths,
					   KVT_DMA_INFLIGHT_MAX); break;
		case 'r': bad = parse_list(optarg, 0, NULL, o->ranks, &o->n_ranks, MAX_RANKS); break;
		case 'R': bad = parse_size(optarg, &o->run_bytes); break;
		case 'V': bad = parse_size(optarg, &o->dev_bytes); break;
		case 'n': o->repeat = (uint32_t)atoi(optarg); bad = !o->repeat || o->repeat > MAX_REP; break;
		case 'G':
			if (!strcmp(optarg, "0"))
				o->reg_bytes = 0;
			else
				bad = parse_size(optarg, &o->reg_bytes);
			break;
		case 'H': o->hugetlbfs = optarg; bad = !*optarg; break;
		case '2': o->no_2d = 1; break;
		case 'K':
			o->no_kernel = !strcmp(optarg, "off");
			o->kernel_below = 0;
			if (!o->no_kernel && strcmp(optarg, "auto"))
				bad = parse_size(optarg, &o->kernel_below) || !o->kernel_below;
			break;
		case 'w':
			o->workers = (uint32_t)atoi(optarg);
			bad = !o->workers || o->workers > 64;
			break;
		case 'M':
			o->dev_mem = optarg;
			bad = strcmp(optarg, "auto") && strcmp(optarg, "backend") && strcmp(optarg, "hip");
			break;
		case 'P':
			bad = strcmp(optarg, "malloc") && strcmp(optarg, "register");
			o->hip_register = !strcmp(optarg, "register");
			break;
		case 's':
			bad = strcmp(optarg, "median") && strcmp(optarg, "best");
			o->best = !strcmp(optarg, "best");
			break;
		case 'j': o->json = 1; break;
		case 'W': o->warm = 1; break;
		case 'p': o->plot = optarg; break;
		case 'h': usage(stdout); return 1;
		default: usage(stderr); return 2;
		}
		if (bad) {
			fprintf(stderr, "bandwidth: bad value: %s\n", optarg ? optarg : "");
			return 2;
		}
	}
	if (optind < argc) {
		usage(stderr);
		return 2;
	}
	if (o->chunk_tokens % o->block_tokens) {
		fprintf(stderr, "bandwidth: --chunk-tokens must be a multiple of --block-tokens\n");
		return 2;
	}
	return 0;
}

/* ---- configurations ------------------------------------------------------ */

static int conf_make(const struct opts *o, uint64_t chunk, uint32_t ranks, struct conf *cf)
{
	struct kvt_geometry *g = &cf->geo;
	uint64_t set = 0; /* bytes of one block in every layer of every group */
	uint32_t nb_max = 0;
	char b[32];

	memset(cf, 0, sizeof(*cf));
	g->chunk_tokens = o->chunk_tokens;
	g->world = ranks;
	g->n_instances = 1;
	g->mode = KVT_MODE_SHARDED;
	g->model_id.lo = 0xba2d;
	if (!strcmp(o->layout, "glm5")) {
		g->chunk_tokens = 256;
		g->n_groups = 2;
		g->groups[0] = (struct kvt_layer_group){ 78, 576 };
		g->groups[1] = (struct kvt_layer_group){ 21, 132 };
		cf->tpb[0] = cf->tpb[1] = 64;
		snprintf(cf->name, sizeof(cf->name), "glm5");
	} else if (!strcmp(o->layout, "llama70b-tp8")) {
		g->chunk_tokens = 256;
		g->n_groups = 1;
		g->groups[0] = (struct kvt_layer_group){ 160, 256 };
		cf->tpb[0] = 16;
		snprintf(cf->name, sizeof(cf->name), "llama70b-tp8");
	} else {
		uint64_t per = (uint64_t)o->layers * o->chunk_tokens;

		if (chunk % per || chunk / per > UINT32_MAX) {
			fprintf(stderr, "bandwidth: chunk %s is not a multiple of layers x "
				"chunk tokens (%llu)\n", human(chunk, b, sizeof(b)),
				(unsigned long long)per);
			return -1;
		}
		g->n_groups = 1;
		g->groups[0] = (struct kvt_layer_group){ o->layers, (uint32_t)(chunk / per) };
		cf->tpb[0] = o->block_tokens;
		snprintf(cf->name, sizeof(cf->name), "synth");
	}
	for (uint32_t i = 0; i < g->n_groups; i++) {
		uint64_t page = (uint64_t)cf->tpb[i] * g->groups[i].bytes_per_token;

		cf->chunk_bytes += (uint64_t)g->chunk_tokens * g->groups[i].layers *
				   g->groups[i].bytes_per_token;
		set += page * g->groups[i].layers;
		if (page > cf->page)
			cf->page = page;
		if (g->chunk_tokens / cf->tpb[i] > nb_max)
			nb_max = g->chunk_tokens / cf->tpb[i];
	}
	cf->ranks = ranks;
	cf->n = (uint32_t)(o->run_bytes / cf->chunk_bytes);
	if (cf->n < 2)
		cf->n = 2;
	if (cf->n > 65536)
		cf->n = 65536;
	/* enough blocks for a save set and a disjoint load set of a chunk */
	cf->n_blocks = o->dev_bytes / set;
	if (cf->n_blocks < 4ULL * nb_max)
		cf->n_blocks = 4ULL * nb_max;
	if (cf->n_blocks > UINT32_MAX)
		cf->n_blocks = UINT32_MAX;
	return 0;
}

/* ---- a rank process ------------------------------------------------------ */

struct rank {
	const struct opts *o;
	const struct conf *cf;
	struct rank_res *res;
	pthread_barrier_t *bar;
	uint32_t rank;
	kvt_seg *seg;
	kvt_dma *d;
	kvt_hip *hip;                 /* device memory and ceiling through HIP */
	kvt_dma_mr *mr;
	struct kvt_kv_layout layout;
	uint64_t *bases;
	uint64_t dev[KVT_MAX_GROUPS];
	uint64_t dev_len[KVT_MAX_GROUPS];
	struct kvt_plan plan;
	uint32_t *blocks;             /* [groups][blocks per chunk] scratch */
	uint32_t nb[KVT_MAX_GROUPS];
	uint64_t seed;
	/* tickets in flight: FIFO */
	kvt_dma_ticket *t;
	struct kvt_wref *w;
	uint32_t q_head, q_n, q_cap;
	uint32_t depth;               /* tickets in flight allowed now */
	void *arena;                  /* this rank's part of the arena */
	uint64_t arena_len;
	/* what the last run did, for the host ceiling to do again */
	char **subs;                  /* [cf->n] sub-slot of chunk i, NULL: none */
	uint64_t run_seed;            /* k->seed when the run started */
};

static int fail(struct rank *k, const char *what, int rc, const char *detail)
{
	if (!k->res->failed)
		snprintf(k->res->msg, sizeof(k->res->msg), "rank %u: %s: %d (%s)", k->rank,
			 what, rc, detail ? detail : strerror(rc < 0 ? -rc : rc));
	k->res->failed = 1;
	return -1;
}

/* Block ids of a chunk: seq from a start, or random distinct; save sets use
 * the first half of the blocks, load sets the second half. */
static void pick_blocks(struct rank *k, uint32_t chunk, int load)
{
	const struct conf *cf = k->cf;
	uint64_t half = cf->n_blocks / 2;

	for (uint32_t g = 0; g < cf->geo.n_groups; g++) {
		uint32_t *b = k->blocks + g * 64;
		uint32_t nb = k->nb[g];

		if (!k->o->random_blocks) {
			uint64_t start = ((uint64_t)chunk * nb) % (half - nb + 1);

			for (uint32_t i = 0; i < nb; i++)
				b[i] = (uint32_t)(start + i + (load ? half : 0));
			continue;
		}
		for (uint32_t i = 0; i < nb; i++) {
			uint32_t v;
			int dup;

			do {
				v = (uint32_t)(rnd(&k->seed) % half + (load ? half : 0));
				dup = 0;
				for (uint32_t j = 0; j < i; j++)
					dup |= b[j] == v;
			} while (dup);
			b[i] = v;
		}
	}
}

static int build(struct rank *k, uint32_t chunk, int load)
{
	const uint32_t *bp[KVT_MAX_GROUPS];
	int rc;

	pick_blocks(k, chunk, load);
	for (uint32_t g = 0; g < k->cf->geo.n_groups; g++)
		bp[g] = k->blocks + g * 64;
	rc = kvt_dma_plan_build(k->d, &k->plan, bp, k->cf->geo.chunk_tokens);
	return rc < 0 ? fail(k, "plan", rc, kvt_dma_last_error()) : 0;
}

/* Keys are hashes in real use (XXH3-128): mix (run, i) the same way, so the
 * index sees the distribution it is built for. */
static kvt_key key_of(uint32_t run, uint32_t i)
{
	uint64_t s = (uint64_t)run << 32 | i;
	kvt_key key;

	key.lo = rnd(&s);
	key.hi = rnd(&s) ^ KEY_HI;
	return key;
}

/* Waits for the oldest ticket; ends its write (saves). */
static int retire(struct rank *k, int save)
{
	uint32_t h = k->q_head;
	int rc = kvt_dma_wait(k->d, k->t[h], -1);

	k->q_head = (h + 1) % k->q_cap;
	k->q_n--;
	if (save)
		kvt_write_end(k->seg, &k->w[h], rc == 0);
	return rc ? fail(k, "copy", rc, kvt_dma_last_error()) : 0;
}

static int submit(struct rank *k, void *sub, enum kvt_dma_dir dir, const struct kvt_wref *w)
{
	kvt_dma_ticket t;
	int rc;

	while (k->q_n >= k->depth)
		if (retire(k, dir == KVT_DMA_D2H))
			return -1;
	while ((rc = kvt_dma_submit(k->d, &k->plan, sub, dir, &t)) == -EAGAIN)
		if (retire(k, dir == KVT_DMA_D2H))
			return -1;
	if (rc)
		return fail(k, "submit", rc, kvt_dma_last_error());
	k->t[(k->q_head + k->q_n) % k->q_cap] = t;
	if (w)
		k->w[(k->q_head + k->q_n) % k->q_cap] = *w;
	k->q_n++;
	return 0;
}

static int save_run(struct rank *k, uint32_t run)
{
	memset(k->subs, 0, k->cf->n * sizeof(*k->subs));
	k->run_seed = k->seed;
	for (uint32_t i = 0; i < k->cf->n && !k->res->failed; i++) {
		kvt_key key = key_of(run, i);
		struct kvt_wref w;
		int rc = kvt_write_begin(k->seg, &key, i, k->rank, &w);

		if (rc == KVT_SKIP)
			continue;
		if (rc)
			return fail(k, "kvt_write_begin", rc, kvt_core_last_error());
		k->subs[i] = kvt_slot_shard_ptr(k->seg, w.slot, w.shard);
		if (build(k, i, 0) || submit(k, k->subs[i], KVT_DMA_D2H, &w)) {
			kvt_write_end(k->seg, &w, 0);
			return -1;
		}
	}
	while (k->q_n)
		if (retire(k, 1))
			return -1;
	return 0;
}

/* Loads every chunk of a run; returns how many were found. */
static int64_t load_run(struct rank *k, uint32_t run)
{
	kvt_key keys[256];
	uint32_t slots[256];
	uint64_t gens[256];
	int64_t loaded = 0;

	memset(k->subs, 0, k->cf->n * sizeof(*k->subs));
	k->run_seed = k->seed;
	for (uint32_t i = 0; i < k->cf->n && !k->res->failed;) {
		uint32_t n = k->cf->n - i < 256 ? k->cf->n - i : 256;
		uint64_t lease = 0;
		int hits, got;

		for (uint32_t j = 0; j < n; j++)
			keys[j] = key_of(run, i + j);
		hits = kvt_seg_lookup(k->seg, keys, n, &lease);
		if (hits < 0)
			return fail(k, "kvt_seg_lookup", hits, kvt_core_last_error());
		got = hits ? kvt_lease_slots(k->seg, lease, slots, gens, n) : 0;
		if (got < 0)
			return fail(k, "kvt_lease_slots", got, kvt_core_last_error());
		for (int j = 0; j < got; j++) {
			k->subs[i + j] = kvt_slot_shard_ptr(k->seg, slots[j], k->rank);
			if (build(k, i + (uint32_t)j, 1) ||
			    submit(k, k->subs[i + j], KVT_DMA_H2D, NULL))
				break;
		}
		while (k->q_n)
			if (retire(k, 0))
				break;
		if (lease)
			kvt_lease_release(k->seg, lease);
		loaded += got;
		if ((uint32_t)got < n) /* a miss ends the prefix: nothing more to find */
			break;
		i += n;
	}
	return loaded;
}

/* Device memory: HIP's when the rank uses it, else the backend's. */
static int dev_alloc(struct rank *k, uint64_t bytes, uint64_t *dev)
{
	return k->hip ? kvt_hip_malloc(k->hip, bytes, dev) : kvt_dma_dev_alloc(k->d, bytes, dev);
}

static int dev_write(struct rank *k, uint64_t dev, const void *src, uint64_t len)
{
	return k->hip ? kvt_hip_write(k->hip, dev, src, len) : kvt_dma_dev_write(k->d, dev, src, len);
}

static int dev_read(struct rank *k, void *dst, uint64_t dev, uint64_t len)
{
	return k->hip ? kvt_hip_read(k->hip, dst, dev, len) : kvt_dma_dev_read(k->d, dst, dev, len);
}

static const char *dev_error(const struct rank *k)
{
	return k->hip ? kvt_hip_last_error() : kvt_dma_last_error();
}

/* Saves one chunk and loads it back into other blocks, checking both. */
static int verify(struct rank *k)
{
	const struct conf *cf = k->cf;
	const struct kvt_kv_layout *l = &k->layout;
	uint32_t save_b[KVT_MAX_GROUPS][64], load_b[KVT_MAX_GROUPS][64];
	uint64_t shard = kvt_kv_layout_shard_bytes(l), off = 0;
	uint8_t *page = NULL, *page2 = NULL;
	char *sub;
	kvt_key key = key_of(VERIFY_RUN << 24 | k->rank, 0);
	struct kvt_wref w;
	int rc;

	rc = kvt_write_begin(k->seg, &key, 0, k->rank, &w);
	if (rc)
		return fail(k, "verify: kvt_write_begin", rc, kvt_core_last_error());
	sub = kvt_slot_shard_ptr(k->seg, w.slot, w.shard);
	memset(sub, 0xa5, shard);
	if (build(k, 7, 0))
		return -1;
	memcpy(save_b, k->blocks, sizeof(save_b[0]) * cf->geo.n_groups);
	if (submit(k, sub, KVT_DMA_D2H, &w) || retire(k, 1))
		return -1;
	if (build(k, 7, 1) || submit(k, sub, KVT_DMA_H2D, NULL) || retire(k, 0))
		return -1;
	memcpy(load_b, k->blocks, sizeof(load_b[0]) * cf->geo.n_groups);
	page = malloc(cf->page);
	page2 = malloc(cf->page);
	if (!page || !page2) {
		free(page);
		free(page2);
		return fail(k, "verify", -ENOMEM, NULL);
	}
	for (uint32_t g = 0; g < l->n_groups && !k->res->failed; g++) {
		const struct kvt_kv_group *gr = &l->groups[g];
		uint64_t pg = (uint64_t)gr->tokens_per_block * gr->bytes_per_token;

		for (uint32_t ly = 0; ly < gr->n_layers && !k->res->failed; ly++)
			for (uint32_t i = 0; i < k->nb[g] && !k->res->failed; i++) {
				uint64_t so = off + (uint64_t)ly * l->chunk_tokens * gr->bytes_per_token +
					      i * pg;

				if ((rc = dev_read(k, page, gr->layer_base[ly] +
						   (uint64_t)save_b[g][i] * gr->block_stride, pg)) ||
				    (rc = dev_read(k, page2, gr->layer_base[ly] +
						   (uint64_t)load_b[g][i] * gr->block_stride, pg)))
					fail(k, "verify: device read", rc, dev_error(k));
				else if (memcmp(sub + so, page, pg))
					fail(k, "verify: saved sub-slot differs from the device pages", -EIO,
					     "save path broken");
				else if (memcmp(page2, page, pg))
					fail(k, "verify: loaded pages differ from the saved ones", -EIO,
					     "load path broken");
			}
		off += (uint64_t)gr->n_layers * l->chunk_tokens * gr->bytes_per_token;
	}
	free(page);
	free(page2);
	return k->res->failed ? -1 : 0;
}

static int rank_setup(struct rank *k)
{
	const struct conf *cf = k->cf;
	struct kvt_seg_attach_opts ao = { .size = sizeof(ao), .name = seg_name,
					  .dir = cf->dir[0] ? cf->dir : NULL,
					  .role = KVT_ROLE_CLIENT };
	struct kvt_dma_config dc = { .size = sizeof(dc), .backend = k->o->backend,
				     .device = k->o->device, .flags = KVT_DMA_F_QUIET };
	struct kvt_dma_mr_info info;
	uint32_t depth_max = 1, n_layers = 0, li = 0;
	void *arena;
	uint64_t arena_len;
	uint8_t *fill;
	int rc;

	for (uint32_t i = 0; i < k->o->n_depths; i++)
		if (k->o->depths[i] > depth_max)
			depth_max = k->o->depths[i];
	if ((rc = kvt_seg_attach(&ao, &k->seg)))
		return fail(k, "kvt_seg_attach", rc, kvt_core_last_error());
	dc.max_inflight = depth_max;
	dc.n_workers = k->o->workers;
	dc.node_ranks = cf->ranks; /* the rank processes of this run share the CPUs */
	if (k->o->no_2d)
		dc.flags |= KVT_DMA_F_NO_2D;
	if (k->o->no_kernel)
		dc.flags |= KVT_DMA_F_NO_KERNEL;
	dc.kernel_below = k->o->kernel_below;
	if ((rc = kvt_dma_open(&dc, &k->d)))
		return fail(k, "kvt_dma_open", rc, kvt_dma_last_error());
	snprintf(k->res->describe, sizeof(k->res->describe), "%s", kvt_dma_describe(k->d));
	/* AMD: the KV cache in hipMalloc'ed memory, as a ROCm engine has it */
	if (!strcmp(k->o->dev_mem, "hip") ||
	    (!strcmp(k->o->dev_mem, "auto") && !strcmp(kvt_dma_backend(k->d), "hsa"))) {
		rc = kvt_hip_open(k->o->device, &k->hip);
		size_t l = strlen(k->res->describe);
		if (rc && !strcmp(k->o->dev_mem, "hip"))
			return fail(k, "HIP runtime", rc, kvt_hip_last_error());
		if (rc)
			snprintf(k->res->describe + l, sizeof(k->res->describe) - l,
				 "; device memory from the backend (HIP: %s)", kvt_hip_last_error());
		else
			snprintf(k->res->describe + l, sizeof(k->res->describe) - l,
				 "; device memory: hipMalloc (%s)", kvt_hip_describe(k->hip));
		k->res->hip = !rc;
	}

	/* The KV cache: one allocation per group, layers one after another. */
	for (uint32_t g = 0; g < cf->geo.n_groups; g++)
		n_layers += cf->geo.groups[g].layers;
	k->bases = calloc(n_layers, sizeof(*k->bases));
	k->blocks = calloc(KVT_MAX_GROUPS * 64, sizeof(*k->blocks));
	k->q_cap = depth_max + 1;
	k->t = calloc(k->q_cap, sizeof(*k->t));
	k->w = calloc(k->q_cap, sizeof(*k->w));
	k->subs = calloc(cf->n, sizeof(*k->subs));
	if (!k->bases || !k->blocks || !k->t || !k->w || !k->subs)
		return fail(k, "setup", -ENOMEM, NULL);
	k->layout.chunk_tokens = cf->geo.chunk_tokens;
	k->layout.n_groups = cf->geo.n_groups;
	for (uint32_t g = 0; g < cf->geo.n_groups; g++) {
		struct kvt_kv_group *gr = &k->layout.groups[g];
		uint64_t page = (uint64_t)cf->tpb[g] * cf->geo.groups[g].bytes_per_token;
		uint64_t per_layer = page * cf->n_blocks;

		gr->n_layers = cf->geo.groups[g].layers;
		gr->bytes_per_token = cf->geo.groups[g].bytes_per_token;
		gr->tokens_per_block = cf->tpb[g];
		gr->block_stride = page;
		gr->n_blocks = cf->n_blocks;
		gr->layer_base = k->bases + li;
		k->nb[g] = cf->geo.chunk_tokens / cf->tpb[g];
		if (k->nb[g] > 64)
			return fail(k, "setup", -EINVAL, "more than 64 blocks per chunk");
		k->dev_len[g] = per_layer * gr->n_layers;
		if ((rc = dev_alloc(k, k->dev_len[g], &k->dev[g])))
			return fail(k, "device allocation", rc, dev_error(k));
		for (uint32_t l = 0; l < gr->n_layers; l++)
			k->bases[li + l] = k->dev[g] + l * per_layer;
		li += gr->n_layers;
		/* recognizable, non-zero content (verify compares it) */
		fill = malloc(64u << 20);
		if (!fill)
			return fail(k, "setup", -ENOMEM, NULL);
		for (uint64_t i = 0; i < (64u << 20); i += 8) {
			uint64_t x = rnd(&k->seed);

			memcpy(fill + i, &x, 8);
		}
		for (int pass = 0; pass < 2; pass++) /* twice: see the arena below */
			for (uint64_t o = 0; o < k->dev_len[g] && !rc; o += 64u << 20)
				rc = dev_write(k, k->dev[g] + o, fill,
					       k->dev_len[g] - o < (64u << 20)
					       ? k->dev_len[g] - o : 64u << 20);
		free(fill);
		if (rc)
			return fail(k, "device fill", rc, dev_error(k));
	}
	if ((rc = kvt_dma_kv_register(k->d, &k->layout)))
		return fail(k, "kvt_dma_kv_register", rc, kvt_dma_last_error());
	if ((rc = kvt_plan_init(&k->plan, kvt_kv_layout_max_copies(&k->layout))))
		return fail(k, "plan", rc, NULL);

	/* Its own shard of the arena, registered (timed). */
	if ((rc = kvt_seg_arena(k->seg, k->rank, &arena, &arena_len)))
		return fail(k, "kvt_seg_arena", rc, kvt_core_last_error());
	k->arena = arena;
	k->arena_len = arena_len;
	/* Fault in before registering, as kvtierd does -- twice: on some VMs a
	 * page stays slow after its first touch until written again (2.5 vs
	 * 18 GB/s measured), and every run writes fresh slots. */
	memset(arena, 0xff, arena_len);
	memset(arena, 0, arena_len);
	if ((rc = kvt_dma_mem_register(k->d, arena, arena_len, kvt_seg_shard_bytes(k->seg),
				       &k->mr)))
		return fail(k, "kvt_dma_mem_register", rc, kvt_dma_last_error());
	kvt_dma_mr_info(k->mr, &info);
	k->res->reg_ns = info.register_ns;
	k->res->reg_bytes = info.len;
	if (build(k, 0, 0))
		return -1;
	k->res->copies = k->plan.n;
	return 0;
}

static void rank_teardown(struct rank *k)
{
	if (k->d) {
		if (k->mr)
			kvt_dma_mem_unregister(k->d, k->mr);
		for (uint32_t g = 0; g < KVT_MAX_GROUPS; g++)
			if (k->dev[g] && k->hip)
				kvt_hip_free(k->hip, k->dev[g]);
			else if (k->dev[g])
				kvt_dma_dev_free(k->d, k->dev[g]);
		kvt_dma_close(k->d);
	}
	kvt_hip_close(k->hip);
	kvt_plan_fini(&k->plan);
	if (k->seg)
		kvt_seg_detach(k->seg);
	free(k->bases);
	free(k->blocks);
	free(k->t);
	free(k->w);
	free(k->subs);
}

static void barrier(struct rank *k)
{
	pthread_barrier_wait(k->bar);
}

/* --warm: write the memory the next phase writes, twice, untimed.  On some
 * VMs (this project's CI VM) a page written once, or left idle for a few
 * seconds, is slow to touch again (2-5 vs 14-18 GB/s measured with plain
 * memcpy) until it has been written twice; a serving tier cycling its
 * arena sees warm pages, and the ceiling warms its own buffer, so runs
 * into cold pages would measure the VM.  The host backend's device memory
 * is ordinary memory and is warmed the same way before both phases. */
static void warm(struct rank *k, int load)
{
	if (!k->o->warm || k->res->failed)
		return;
	for (int pass = 0; pass < 2; pass++) {
		if (!load)
			memset(k->arena, pass, k->arena_len);
		/* host: the device memory, read by saves and written by loads */
		if (!strcmp(kvt_dma_backend(k->d), "host"))
			for (uint32_t g = 0; g < k->cf->geo.n_groups; g++)
				memset((void *)(uintptr_t)k->dev[g], pass, k->dev_len[g]);
	}
}

/* The host ceiling: the copies the run just made -- the same plans, device
 * blocks and arena sub-slots -- again, by memcpy in this one thread (only
 * the copies are timed, not the plans).  What memcpy itself does with
 * these pages: scattered 4 KiB pages copy at half the speed of one long
 * run on common CPUs (a TLB miss and a prefetcher restart per page), and
 * no copy engine should be credited or blamed for that.  The memory was
 * just touched by the run, so this favours the ceiling, if anything. */
static void replay(struct rank *k, int load, double *seconds, uint64_t *bytes)
{
	const struct kvt_plan *p = &k->plan;
	uint64_t seed = k->seed, ns = 0, b = 0;

	k->seed = k->run_seed;
	for (uint32_t i = 0; i < k->cf->n && !k->res->failed; i++) {
		uint64_t t0;

		if (!k->subs[i])
			continue;
		if (build(k, i, load))
			break;
		t0 = kvt__now_ns();
		for (uint32_t c = 0; c < p->n; c++) {
			const struct kvt_copy *cp = &p->copies[c];

			for (uint32_t r = 0; r < cp->rows; r++) {
				char *dev = (char *)(uintptr_t)(cp->dev + r * cp->dev_pitch);
				char *host = k->subs[i] + cp->off + r * cp->host_pitch;

				if (load)
					memcpy(dev, host, cp->len);
				else
					memcpy(host, dev, cp->len);
			}
		}
		ns += kvt__now_ns() - t0;
		b += p->bytes;
	}
	k->seed = seed;
	*seconds = ns * 1e-9;
	*bytes = b;
}

/* The ceilings next to run (di, rep) in direction dir: for the host
 * backend, memcpy of the same copies (ceil) and contiguous chunk-sized
 * memcpy over the same device memory (peak); with HIP device memory, HIP's
 * pinned copy (ceil) and the backend's own (peak); for a GPU backend
 * otherwise, the runtime's pinned copy (both). */
static void ceiling(struct rank *k, uint32_t di, uint32_t rep, enum kvt_dma_dir dir)
{
	const struct conf *cf = k->cf;
	struct rank_res *x = k->res;
	int rc;

	if (x->failed || !x->ceil_bytes)
		return;
	rc = kvt_dma_ceiling(k->d, dir, k->dev[0], x->ceil_bytes, cf->chunk_bytes,
			     (uint32_t)x->ceil_iters, &x->peak_s[di][rep][dir]);
	if (rc) {
		fail(k, "ceiling", rc, kvt_dma_last_error());
		return;
	}
	if (!strcmp(kvt_dma_backend(k->d), "host")) {
		replay(k, dir == KVT_DMA_H2D, &x->ceil_s[di][rep][dir], &x->ceil_b[di][rep][dir]);
	} else if (k->hip) {
		rc = kvt_hip_ceiling(k->hip, dir == KVT_DMA_D2H, k->dev[0], x->ceil_bytes,
				     cf->chunk_bytes, (uint32_t)x->ceil_iters,
				     k->o->hip_register ? KVT_HIP_HOST_REGISTER : KVT_HIP_HOST_MALLOC,
				     &x->ceil_s[di][rep][dir], &x->devptr_differs);
		if (rc) {
			fail(k, "HIP ceiling", rc, kvt_hip_last_error());
			return;
		}
		x->ceil_b[di][rep][dir] = x->ceil_bytes * x->ceil_iters;
	} else {
		x->ceil_s[di][rep][dir] = x->peak_s[di][rep][dir];
		x->ceil_b[di][rep][dir] = x->ceil_bytes * x->ceil_iters;
	}
}

static int rank_main(const struct opts *o, const struct conf *cf, struct shared *sh,
		     uint32_t rank)
{
	struct rank k = { .o = o, .cf = cf, .res = &sh->r[rank], .bar = &sh->bar,
			  .rank = rank, .seed = 0x5eed + rank, .depth = 1 };
	uint64_t ceil_bytes = 0;

	/* Every rank passes every barrier, failed or not, so none waits forever. */
	rank_setup(&k);
	/* The ceiling moves as many bytes as a run, in C-byte copies over the
	 * device memory, right after the run it is compared with: the same
	 * conditions (a busy machine shifts both alike). */
	if (!k.res->failed) {
		uint64_t run = (uint64_t)cf->n * cf->chunk_bytes;

		ceil_bytes = k.dev_len[0] < run ? k.dev_len[0] : run;
		ceil_bytes -= ceil_bytes % cf->chunk_bytes;
		if (ceil_bytes) {
			k.res->ceil_bytes = ceil_bytes;
			k.res->ceil_iters = (run + ceil_bytes - 1) / ceil_bytes;
		}
	}
	barrier(&k);
	if (!k.res->failed)
		verify(&k);
	for (uint32_t di = 0; di < o->n_depths; di++) {
		for (uint32_t rep = 0; rep < o->repeat; rep++) {
			uint32_t run = di * MAX_REP + rep;
			int64_t got = 0;

			/* the depth bound: at most depths[di] tickets at once */
			k.depth = o->depths[di];
			warm(&k, 0);
			barrier(&k);
			k.res->t0[di][rep][0] = kvt__now_ns();
			if (!k.res->failed && save_run(&k, run) == 0)
				k.res->chunks[di][rep][0] = k.cf->n;
			k.res->t1[di][rep][0] = kvt__now_ns();
			barrier(&k);
			ceiling(&k, di, rep, KVT_DMA_D2H);
			warm(&k, 1);
			barrier(&k);
			k.res->t0[di][rep][1] = kvt__now_ns();
			if (!k.res->failed)
				got = load_run(&k, run);
			k.res->t1[di][rep][1] = kvt__now_ns();
			k.res->chunks[di][rep][1] = got > 0 ? (uint64_t)got : 0;
			barrier(&k);
			ceiling(&k, di, rep, KVT_DMA_H2D);
		}
	}
	rank_teardown(&k);
	return k.res->failed;
}

/* ---- registration probe: 4 KiB pages vs huge pages -------------------------- */

struct reg_res {
	double small_s, huge_s;
	uint64_t small_b, huge_b;
	int failed;
	char msg[256];
	char backend[16];
};

static uint64_t free_huge_bytes(void)
{
	FILE *f = fopen("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "r");
	unsigned long n = 0;

	if (!f)
		return 0;
	if (fscanf(f, "%lu", &n) != 1)
		n = 0;
	fclose(f);
	return (uint64_t)n << 21;
}

static double reg_time(kvt_dma *d, char *p, uint64_t len, char *msg, size_t mlen)
{
	kvt_dma_mr *mr;
	uint64_t t0;
	double s;
	int rc;

	memset(p, 1, len); /* faulted in: registration time only */
	t0 = kvt__now_ns();
	rc = kvt_dma_mem_register(d, p, len, 2u << 20, &mr);
	s = (kvt__now_ns() - t0) * 1e-9;
	if (rc) {
		snprintf(msg, mlen, "register: %s", kvt_dma_last_error());
		return -1;
	}
	kvt_dma_mem_unregister(d, mr);
	return s;
}

static void reg_child(const struct opts *o, struct reg_res *r)
{
	struct kvt_dma_config dc = { .size = sizeof(dc), .backend = o->backend,
				     .device = o->device, .flags = KVT_DMA_F_QUIET };
	uint64_t small = o->reg_bytes & ~((2ULL << 20) - 1), huge;
	kvt_dma *d;
	char *p;
	int fd;

	if (kvt_dma_open(&dc, &d)) {
		snprintf(r->msg, sizeof(r->msg), "%s", kvt_dma_last_error());
		r->failed = 1;
		return;
	}
	snprintf(r->backend, sizeof(r->backend), "%s", kvt_dma_backend(d));
	/* shared memory of 4 KiB pages, like the /dev/shm arena */
	fd = memfd_create("kvtier-bench-4k", 0);
	if (fd >= 0 && small && !ftruncate(fd, (off_t)small)) {
		p = mmap(NULL, small, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (p != MAP_FAILED) {
			r->small_s = reg_time(d, p, small, r->msg, sizeof(r->msg));
			r->small_b = small;
			munmap(p, small);
		}
	}
	if (fd >= 0)
		close(fd);
	huge = free_huge_bytes();
	if (huge > small)
		huge = small;
	if (huge) {
		fd = memfd_create("kvtier-bench-2m", MFD_HUGETLB | MFD_HUGE_2MB);
		if (fd >= 0 && !ftruncate(fd, (off_t)huge)) {
			p = mmap(NULL, huge, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
			if (p != MAP_FAILED) {
				r->huge_s = reg_time(d, p, huge, r->msg, sizeof(r->msg));
				r->huge_b = huge;
				munmap(p, huge);
			}
		}
		if (fd >= 0)
			close(fd);
	}
	kvt_dma_close(d);
}

/* ---- the parent -------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/* The median, or with best the largest. */
static double pick(double *v, uint32_t n, int best)
{
	qsort(v, n, sizeof(*v), cmp_double);
	if (best)
		return v[n - 1];
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void quiet_log(void *arg, int level, const char *msg)
{
	(void)arg;
	(void)level;
	(void)msg;
}

/* Where the segment goes (cf->dir): --hugetlbfs DIR; auto: a hugetlbfs
 * mount with enough free huge pages for the whole segment, as kvt_open's
 * create path decides (kvt_hugepages_choose), else /dev/shm. */
static int arena_dir(const struct opts *o, struct conf *cf)
{
	struct kvt_numa_topo *topo;
	struct kvt_hp_request hr;
	struct kvt_hp_choice hc;
	int rc;

	cf->dir[0] = 0;
	if (!strcmp(o->hugetlbfs, "none"))
		return 0;
	if (strcmp(o->hugetlbfs, "auto")) {
		snprintf(cf->dir, sizeof(cf->dir), "%s", o->hugetlbfs);
		return 0;
	}
	if (kvt_numa_topo_read(NULL, &topo))
		return 0; /* no topology: /dev/shm */
	memset(&hr, 0, sizeof(hr));
	hr.size = sizeof(hr);
	hr.want = KVT_HP_AUTO;
	hr.seg_bytes = kvt_geometry_segment_bytes(&cf->geo);
	hr.log = quiet_log;
	rc = kvt_hugepages_choose(topo, NULL, &hr, &hc);
	kvt_numa_topo_free(topo);
	if (rc == 0 && hc.use)
		snprintf(cf->dir, sizeof(cf->dir), "%s", hc.dir);
	return 0;
}

static int run_conf(const struct opts *o, struct conf *cf, struct shared *sh,
		    struct row *rows, uint32_t *n_rows, char *describe, size_t dlen)
{
	struct kvt_seg_create_opts co;
	pthread_barrierattr_t ba;
	kvt_seg *s = NULL;
	pid_t pids[MAX_RANKS];
	uint64_t runs = (uint64_t)o->n_depths * o->repeat;
	int rc, failed = 0;

	/* no run evicts another's chunks: room for all of them, + verify */
	if ((uint64_t)cf->n * runs + cf->ranks + 8 > (1ULL << 30)) {
		fprintf(stderr, "bandwidth: too many chunks; lower --run-bytes\n");
		return -1;
	}
	cf->geo.n_slots = (uint32_t)(cf->n * runs + cf->ranks + 8);
	cf->geo.lease_max_chunks = 256;
	if (arena_dir(o, cf))
		return -1;
	snprintf(seg_name, sizeof(seg_name), "kvtier-bw-%d", (int)getpid());
	seg_dir = cf->dir[0] ? cf->dir : NULL;
	co = (struct kvt_seg_create_opts){ .size = sizeof(co), .name = seg_name, .dir = seg_dir,
					   .geo = &cf->geo, .flags = KVT_SEG_F_REPLACE };
	if ((rc = kvt_seg_create(&co, NULL, &s))) {
		fprintf(stderr, "bandwidth: segment of %u slots x %u shards x %llu B: %s\n",
			cf->geo.n_slots, cf->ranks,
			(unsigned long long)kvt_geometry_shard_bytes(&cf->geo), kvt_core_last_error());
		seg_name[0] = 0;
		return -1;
	}
	memset(sh, 0, sizeof(*sh));
	pthread_barrierattr_init(&ba);
	pthread_barrierattr_setpshared(&ba, PTHREAD_PROCESS_SHARED);
	pthread_barrier_init(&sh->bar, &ba, cf->ranks);
	pthread_barrierattr_destroy(&ba);
	fflush(NULL);
	for (uint32_t r = 0; r < cf->ranks; r++) {
		pids[r] = fork();
		if (pids[r] == 0)
			_exit(rank_main(o, cf, sh, r));
		if (pids[r] < 0) {
			perror("bandwidth: fork");
			/* the barrier would wait forever for the missing ranks */
			for (uint32_t i = 0; i < r; i++)
				kvt_kill_pid(pids[i], SIGKILL);
			for (uint32_t i = 0; i < r; i++)
				waitpid(pids[i], NULL, 0);
			kvt_seg_detach(s);
			kvt_seg_unlink(seg_name, seg_dir);
			seg_name[0] = 0;
			return -1;
		}
	}
	for (uint32_t r = 0; r < cf->ranks; r++) {
		int st = 0;

		waitpid(pids[r], &st, 0);
		if (!WIFEXITED(st) || WEXITSTATUS(st) || sh->r[r].failed) {
			fprintf(stderr, "bandwidth: %s\n", sh->r[r].msg[0] ? sh->r[r].msg
				: "a rank process died");
			failed = 1;
		}
	}
	pthread_barrier_destroy(&sh->bar);
	kvt_seg_detach(s);
	kvt_seg_unlink(seg_name, seg_dir);
	seg_name[0] = 0;
	if (failed)
		return -1;
	snprintf(describe, dlen, "%s", sh->r[0].describe);
	if (sh->r[0].devptr_differs && strlen(describe) + 96 < dlen)
		strcat(describe, "; hipHostGetDevicePointer: the device address of the pinned "
		       "buffer differs from its host address");

	for (uint32_t di = 0; di < o->n_depths; di++) {
		struct row *w = &rows[(*n_rows)++];
		double g[2][MAX_REP], c[2][MAX_REP];

		memset(w, 0, sizeof(*w));
		snprintf(w->layout, sizeof(w->layout), "%s", cf->name);
		w->ranks = cf->ranks;
		w->depth = o->depths[di];
		w->chunk = cf->chunk_bytes;
		w->page = cf->page;
		w->copies = sh->r[0].copies;
		w->reg_ns = sh->r[0].reg_ns;
		w->reg_bytes = sh->r[0].reg_bytes;
		w->huge = cf->dir[0] != 0;
		for (int dir = 0; dir < 2; dir++) {
			double q[MAX_REP], qp[MAX_REP], pk[MAX_REP];

			for (uint32_t rep = 0; rep < o->repeat; rep++) {
				uint64_t t0 = UINT64_MAX, t1 = 0, bytes = 0, cb = 0;
				double worst = 0, worst_p = 0;

				/* ranks run side by side: all bytes over the slowest */
				for (uint32_t r = 0; r < cf->ranks; r++) {
					const struct rank_res *x = &sh->r[r];

					if (x->t0[di][rep][dir] < t0)
						t0 = x->t0[di][rep][dir];
					if (x->t1[di][rep][dir] > t1)
						t1 = x->t1[di][rep][dir];
					bytes += x->chunks[di][rep][dir] * cf->chunk_bytes;
					cb += x->ceil_b[di][rep][dir];
					if (x->ceil_s[di][rep][dir] > worst)
						worst = x->ceil_s[di][rep][dir];
					if (x->peak_s[di][rep][dir] > worst_p)
						worst_p = x->peak_s[di][rep][dir];
				}
				g[dir][rep] = t1 > t0 ? bytes / (double)(t1 - t0) : 0;
				c[dir][rep] = worst > 0 ? cb / worst * 1e-9 : 0;
				pk[rep] = worst_p > 0 ? cf->ranks * (double)sh->r[0].ceil_bytes *
							sh->r[0].ceil_iters / worst_p * 1e-9 : 0;
				q[rep] = c[dir][rep] > 0 ? g[dir][rep] / c[dir][rep] : 0;
				qp[rep] = pk[rep] > 0 ? g[dir][rep] / pk[rep] : 0;
			}
			w->gbs[dir] = pick(g[dir], o->repeat, o->best);
			w->ceil[dir] = pick(c[dir], o->repeat, o->best);
			w->peak[dir] = pick(pk, o->repeat, o->best);
			/* best: the best run over the best ceiling; median: the
			 * median of each run over the ceiling right after it */
			w->ratio[dir] = o->best ? (w->ceil[dir] > 0 ? w->gbs[dir] / w->ceil[dir] : 0)
						: pick(q, o->repeat, 0);
			w->peak_ratio[dir] = o->best ? (w->peak[dir] > 0 ? w->gbs[dir] / w->peak[dir] : 0)
						     : pick(qp, o->repeat, 0);
		}
	}
	return 0;
}

static void print_table(const struct opts *o, const struct row *rows, uint32_t n,
			const char *describe, const struct reg_res *reg)
{
	char a[32], b[32], c[32];

	int host = strstr(describe, "host") == describe;
	uint32_t n_huge = 0;

	printf("kvtier-bench bandwidth: %s\n", describe);
	printf("layout %s, %s blocks,%s %u run(s) per point (%s)\n",
	       o->layout, o->random_blocks ? "random" : "adjacent",
	       o->warm ? " warm memory," : "", o->repeat,
	       o->best ? "best run; ratio: best over best ceiling"
		       : "medians; ratio: median of each run over the ceiling right after it");
	if (host)
		printf("ceil: memcpy of the same copies (same plans, pages and sub-slots), one thread\n"
		       "      per rank process; peak: memcpy of whole chunks over the same memory\n\n");
	else if (strstr(describe, "device memory: hipMalloc"))
		printf("ceil: HIP's own pinned copy -- hipMemcpyAsync from %s memory, chunk-sized\n"
		       "      copies over the same device memory, one stream per rank process (what an\n"
		       "      AMD engine's own offload does); peak: the hsa backend's own copy\n"
		       "      (hsa_amd_memory_async_copy from runtime-pinned pool memory)\n\n",
		       o->hip_register ? "hipHostRegister'ed" : "hipHostMalloc'ed");
	else
		printf("ceil = peak: the runtime's own copy from memory it pinned itself, in\n"
		       "      chunk-sized copies, one stream per rank process\n\n");
	printf("%-12s %5s %7s %7s %6s %6s | %9s %7s %5s %7s %5s | %9s %7s %5s %7s %5s | %5s\n",
	       "layout", "ranks", "chunk", "page", "depth", "copies", "save GB/s", "ceil", "ratio",
	       "peak", "ratio", "load GB/s", "ceil", "ratio", "peak", "ratio", "arena");
	for (uint32_t i = 0; i < n; i++) {
		const struct row *w = &rows[i];

		printf("%-12s %5u %7s %7s %6u %6u | %9.2f %7.2f %5.2f %7.2f %5.2f | %9.2f %7.2f "
		       "%5.2f %7.2f %5.2f | %5s\n",
		       w->layout, w->ranks, human(w->chunk, a, sizeof(a)),
		       human(w->page, b, sizeof(b)), w->depth, w->copies, w->gbs[0], w->ceil[0],
		       w->ratio[0], w->peak[0], w->peak_ratio[0], w->gbs[1], w->ceil[1],
		       w->ratio[1], w->peak[1], w->peak_ratio[1], w->huge ? "2M" : "4K");
		n_huge += w->huge;
	}
	printf("\narena: 2M = hugetlbfs (2 MiB pages), 4K = /dev/shm (4 KiB pages)%s\n",
	       n_huge == n ? "" : ": no hugetlbfs mount with enough free huge pages for"
	       " the 4K rows (numa/reserve-hugepages.sh)");
	printf("arena registration (per rank):\n");
	for (uint32_t i = 0; i < n && strstr(describe, "host") != describe; i++)
		if (i == 0 || rows[i].chunk != rows[i - 1].chunk || rows[i].ranks != rows[i - 1].ranks)
			printf("  %-12s ranks %u chunk %7s: %s in %.3f s (%.2f GB/s)\n",
			       rows[i].layout, rows[i].ranks, human(rows[i].chunk, a, sizeof(a)),
			       human(rows[i].reg_bytes, c, sizeof(c)), rows[i].reg_ns * 1e-9,
			       rows[i].reg_ns ? rows[i].reg_bytes / (double)rows[i].reg_ns : 0.0);
	if (strstr(describe, "host") == describe)
		printf("  none: the host backend's registration is a no-op\n");
	if (reg && strcmp(reg->backend, "host")) {
		printf("registration probe (memfd, faulted in):\n");
		if (reg->small_b)
			printf("  4 KiB pages: %s in %.3f s (%.2f GB/s)\n",
			       human(reg->small_b, a, sizeof(a)), reg->small_s,
			       reg->small_s > 0 ? reg->small_b / reg->small_s * 1e-9 : 0.0);
		if (reg->huge_b)
			printf("  2 MiB pages: %s in %.3f s (%.2f GB/s)\n",
			       human(reg->huge_b, a, sizeof(a)), reg->huge_s,
			       reg->huge_s > 0 ? reg->huge_b / reg->huge_s * 1e-9 : 0.0);
		else
			printf("  2 MiB pages: none free on this node\n");
		if (reg->msg[0])
			printf("  note: %s\n", reg->msg);
	}
}

static void json_str(const char *s)
{
	putchar('"');
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			putchar('\\');
		if ((unsigned char)*s >= 0x20)
			putchar(*s);
	}
	putchar('"');
}

static void print_json(const struct opts *o, const struct row *rows, uint32_t n,
		       const char *describe, const struct reg_res *reg)
{
	printf("{\"bench\":\"bandwidth\",\"backend\":");
	json_str(describe);
	printf(",\"layout\":\"%s\",\"blocks\":\"%s\",\"repeat\":%u,\"stat\":\"%s\",\"rows\":[",
	       o->layout, o->random_blocks ? "random" : "seq", o->repeat,
	       o->best ? "best" : "median");
	for (uint32_t i = 0; i < n; i++) {
		const struct row *w = &rows[i];

		printf("%s{\"layout\":\"%s\",\"ranks\":%u,\"chunk_bytes\":%llu,\"page_bytes\":%llu,"
		       "\"depth\":%u,\"copies_per_chunk\":%u,\"save_gbs\":%.3f,\"save_ceiling_gbs\":%.3f,"
		       "\"save_ratio\":%.3f,\"save_peak_gbs\":%.3f,\"save_peak_ratio\":%.3f,"
		       "\"load_gbs\":%.3f,\"load_ceiling_gbs\":%.3f,"
		       "\"load_ratio\":%.3f,\"load_peak_gbs\":%.3f,\"load_peak_ratio\":%.3f,"
		       "\"arena_hugetlbfs\":%s,\"register_bytes\":%llu,"
		       "\"register_s\":%.6f}", i ? "," : "", w->layout, w->ranks,
		       (unsigned long long)w->chunk, (unsigned long long)w->page, w->depth, w->copies,
		       w->gbs[0], w->ceil[0], w->ratio[0], w->peak[0], w->peak_ratio[0],
		       w->gbs[1], w->ceil[1], w->ratio[1], w->peak[1], w->peak_ratio[1],
		       w->huge ? "true" : "false",
		       (unsigned long long)w->reg_bytes, w->reg_ns * 1e-9);
	}
	printf("]");
	if (reg)
		printf(",\"registration\":{\"small_bytes\":%llu,\"small_s\":%.6f,"
		       "\"huge_bytes\":%llu,\"huge_s\":%.6f}", (unsigned long long)reg->small_b,
		       reg->small_s, (unsigned long long)reg->huge_b, reg->huge_s);
	printf("}\n");
}

static int write_plot(const struct opts *o, const struct row *rows, uint32_t n,
		      const char *describe)
{
	char dat[512], gp[512], cmd[1200];
	FILE *f;

	snprintf(dat, sizeof(dat), "%s.dat", o->plot);
	snprintf(gp, sizeof(gp), "%s.gp", o->plot);
	/* rows are grouped by (ranks, chunk) and ordered by depth: re-sort the
	 * blocks by (ranks, depth) for lines over chunk size */
	if (!(f = fopen(dat, "w")))
		return -1;
	fprintf(f, "# ranks depth chunk_bytes save_gbs save_ceiling load_gbs load_ceiling\n");
	for (uint32_t r = 0; r < o->n_ranks; r++)
		for (uint32_t di = 0; di < o->n_depths; di++) {
			for (uint32_t i = 0; i < n; i++)
				if (rows[i].ranks == o->ranks[r] && rows[i].depth == o->depths[di])
					fprintf(f, "%u %u %llu %.3f %.3f %.3f %.3f\n", rows[i].ranks,
						rows[i].depth, (unsigned long long)rows[i].chunk,
						rows[i].gbs[0], rows[i].ceil[0], rows[i].gbs[1],
						rows[i].ceil[1]);
			fprintf(f, "\n\n");
		}
	fclose(f);
	if (!(f = fopen(gp, "w")))
		return -1;
	fprintf(f, "set terminal pngcairo size 1200,500 noenhanced\nset output '%s'\n"
		"set multiplot layout 1,2 title 'kvtier-bench bandwidth: %s'\n"
		"set logscale x 2\nset format x '%%.0b%%B'\nset xlabel 'chunk bytes'\nset ylabel 'GB/s'\nset key left top\n"
		"set grid\n", o->plot, describe);
	for (int dir = 0; dir < 2; dir++) {
		uint32_t idx = 0;

		fprintf(f, "set title '%s'\nplot ", dir ? "load (H2D)" : "save (D2H)");
		for (uint32_t r = 0; r < o->n_ranks; r++)
			for (uint32_t di = 0; di < o->n_depths; di++, idx++)
				fprintf(f, "%s'%s' index %u using 3:%d with linespoints title "
					"'%u rank%s, depth %u'", idx ? ", " : "", dat, idx, dir ? 6 : 4,
					o->ranks[r], o->ranks[r] > 1 ? "s" : "", o->depths[di]);
		for (uint32_t r = 0; r < o->n_ranks; r++)
			fprintf(f, ", '%s' index %u using 3:%d with lines dashtype 2 title "
				"'ceiling, %u rank%s'", dat, r * o->n_depths, dir ? 7 : 5,
				o->ranks[r], o->ranks[r] > 1 ? "s" : "");
		fprintf(f, "\n");
	}
	fprintf(f, "unset multiplot\n");
	fclose(f);
	snprintf(cmd, sizeof(cmd), "gnuplot '%s' 2>&1", gp);
	if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
		fprintf(stderr, "bandwidth: gnuplot not found; wrote %s and %s\n", gp, dat);
		return 0;
	}
	if (system(cmd) != 0) {
		fprintf(stderr, "bandwidth: gnuplot failed on %s\n", gp);
		return -1;
	}
	return 0;
}

int kvt_bench_bandwidth(int argc, char **argv)
{
	struct opts o;
	struct shared *sh;
	struct row *rows;
	struct reg_res *reg = NULL;
	char describe[512] = "";
	uint32_t n_rows = 0, n_confs;
	int r, rc = 0;

	r = parse(argc, argv, &o);
	if (r)
		return r == 1 ? 0 : r;
	n_confs = (!strcmp(o.layout, "synth") ? o.n_chunks : 1) * o.n_ranks;
	sh = mmap(NULL, sizeof(*sh) + sizeof(*reg), PROT_READ | PROT_WRITE,
		  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	rows = calloc((size_t)n_confs * o.n_depths, sizeof(*rows));
	if (sh == MAP_FAILED || !rows) {
		perror("bandwidth");
		return 1;
	}
	seg_guard_install();

	if (o.reg_bytes) {
		pid_t p;
		int st = 0;

		reg = (struct reg_res *)(sh + 1);
		memset(reg, 0, sizeof(*reg));
		fflush(NULL);
		p = fork();
		if (p == 0) {
			reg_child(&o, reg);
			_exit(0);
		}
		if (p > 0)
			waitpid(p, &st, 0);
		if (p < 0 || reg->failed) {
			fprintf(stderr, "bandwidth: %s\n", reg->msg);
			return 1;
		}
	}
	for (uint32_t ri = 0; ri < o.n_ranks && !rc; ri++)
		for (uint32_t ci = 0; ci < (!strcmp(o.layout, "synth") ? o.n_chunks : 1) && !rc; ci++) {
			struct conf cf;

			if (conf_make(&o, o.chunks[ci], o.ranks[ri], &cf) ||
			    run_conf(&o, &cf, sh, rows, &n_rows, describe, sizeof(describe)))
				rc = 1;
			else if (!o.json && !o.quiet)
				fprintf(stderr, "bandwidth: %s, %u rank(s), chunk %llu B: done\n",
					cf.name, cf.ranks, (unsigned long long)cf.chunk_bytes);
		}
	if (n_rows) {
		if (o.json)
			print_json(&o, rows, n_rows, describe, reg);
		else
			print_table(&o, rows, n_rows, describe, reg);
		if (o.plot && write_plot(&o, rows, n_rows, describe))
			rc = 1;
	}
	free(rows);
	munmap(sh, sizeof(*sh) + sizeof(*reg));
	return rc;
}
