/* kvtier.c - the engine-facing API: joins core/ (the segment) and dma/ (the
 * copies) behind kvtier.h.
 *
 * Saves.  kvt_save claims every chunk's shard at once (kvt_write_begin:
 * dedupe and -ENOSPC are decided there, so the return value is exact),
 * then feeds the claimed chunks to the DMA backend as its in-flight window
 * allows.  A chunk's ready bit is set (kvt_write_end(ok)) only after its
 * ticket completed without error; a failed copy aborts the claim, so a
 * chunk with bad bytes is never published.  Loads work the same way from
 * a lease's pinned slots; when every chunk of a load completed, the rank
 * sets its bit in the lease's loaded mask, and the last rank's bit
 * releases the pins.
 *
 * Progress is driven by the caller (kvt_poll / kvt_wait / the next
 * kvt_save or kvt_load): no thread of ours touches the segment, so a
 * handle is used by one thread at a time, as the header says.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <xxhash.h>

#include "kvt_clock.h"
#include "kvtier.h"
#include "kvt_core.h"
#include "kvt_dma.h"
#include "kvt_config.h"
#include "kvt_hash.h"
#include "kvt_l3_client.h"
#if defined(KVTIER_HAVE_NUMA) && defined(KVTIER_NUMA_HAVE_SEG)
#include "kvt_numa.h"
#include "kvt_tier_int.h"
#define TIER_PLACEMENT 1
#endif

#define KVT_MAX_OPS 256u

enum chunk_state { CH_QUEUED, CH_INFLIGHT, CH_DONE, CH_FAILED };
enum op_kind { OP_FREE = 0, OP_SAVE, OP_LOAD };

struct op_chunk {
	uint32_t state;
	uint32_t slot;
	kvt_dma_ticket ticket;
	struct kvt_wref w;
};

struct op {
	uint32_t kind;
	uint32_t gen;
	uint32_t n;
	uint32_t next;       /* first chunk not submitted yet */
	uint32_t done;       /* chunks finished (done or failed) */
	int err;             /* first error */
	char why[240];       /* its message, given by kvt_poll/kvt_wait */
	kvt_lease_id lease;  /* loads */
	uint64_t t0;         /* CLOCK_MONOTONIC at submission (latency histogram) */
	uint32_t timed;      /* its latency was counted */
	struct op_chunk *ch;
	uint32_t *blocks;    /* n * blocks_per_chunk(g) per group, group-major */
};

struct kvt_tier {
	kvt_seg *seg;
	kvt_dma *dma;
	kvt_dma_mr *mr;
	struct kvt_plan plan;
	struct kvt_tier_env env;
	struct kvt_kv_layout layout;   /* registered (device pointers) */
	uint64_t *bases;               /* owned copies of the layer bases */
	uint32_t role, rank, shard;
	uint32_t chunk_tokens;
	uint32_t bpc[KVT_MAX_GROUPS];  /* blocks per chunk, per group */
	uint32_t blocks_per_chunk;     /* sum of bpc */
	uint32_t n_groups;
	struct kvt_group_desc groups[KVT_MAX_GROUPS];
	kvt_key fingerprint;
	kvt_key key_root;                /* key[-1]: H(fingerprint) */
	kvt__hash_chain_fn *hash_chain;  /* this CPU's kernel (kvt_hash.h) */
	struct op ops[KVT_MAX_OPS];
	uint32_t op_hint;
	/* Disk chunks this handle asked back lately (kvt_lookup_ex), by index
	 * entry: a scheduler asking again each step queues a chunk once. */
	struct { uint32_t pos, seq; uint64_t ns; } asked[256];
	kvt_l3c *l3c;                    /* the L3 channel (kvt_lookup_ex) */
};

static _Thread_local char tier_err[1280];

/* Sets the thread's message (kvt_last_error); also the library's other
 * files' (model_id.c).  terr for short. */
int kvt__tier_err(int code, const char *fmt, ...)
{
	char tmp[sizeof(tier_err)];
	va_list ap;

	/* Through a copy: an argument may be this very buffer (a message
	 * that wraps the previous one); vsnprintf onto itself garbles it. */
	va_start(ap, fmt);
	vsnprintf(tmp, sizeof(tmp), fmt, ap);
	va_end(ap);
	memcpy(tier_err, tmp, sizeof(tmp));
	return code;
}
#define terr kvt__tier_err

/* Passes a core or dma failure through with its message. */
static int terr_core(int code, const char *what)
{
	return terr(code, "%s: %.1000s", what, kvt_core_last_error());
}

static int terr_dma(int code, const char *what)
{
	return terr(code, "%s: %.250s", what, kvt_dma_last_error());
}

const char *kvt_last_error(void)
{
	return tier_err[0] ? tier_err : "no error";
}

const char *kvt_strerror(int err)
{
	switch (err) {
	case 0: return "success";
	case -EINVAL: return "invalid argument or configuration";
	case -EPROTO: return "the segment is corrupt or not a kvtier segment";
	case -ESTALE: return "stale: the object is no longer live, or the segment "
			     "holds another model or layout";
	case -EBUSY: return "busy: attached by a live process, or in use";
	case -ENOENT: return "not found";
	case -ENODEV: return "backend unavailable: no usable device";
	case -ENOSPC: return "no space: nothing could be evicted, or a table is full";
	case -ENOMEM: return "out of memory";
	case -EPERM: return "not permitted for this role or owner";
	case -EALREADY: return "already done (double release)";
	case -EINPROGRESS: return "in progress";
	case -ETIMEDOUT: return "timed out";
	case -EIO: return "a copy failed";
	case -ENOTSUP: return "header and library versions differ";
	case -EAGAIN: return "try again";
	case -EUCLEAN: return "an invariant of the segment does not hold";
	case -EOVERFLOW: return "a size overflows";
	case -ELOOP: return "a symbolic link where a segment file was expected: refused";
	case -EACCES: return "permission denied";
	case -EEXIST: return "already exists";
	case -ENOTDIR: return "not a directory";
	case -EISDIR: return "a directory where a segment file was expected";
	case -ERANGE: return "out of range (a block id beyond the registered KV cache)";
	case -EFBIG: return "too large: more than the segment's filesystem (or a file) can hold";
	default:
		if (err < 0) {
			/* any other errno: the C library's own words */
			const char *d = strerrordesc_np(-err);
			return d ? d : "unknown error";
		}
		return "not an error code";
	}
}

/* ---- placement: NUMA nodes and huge pages for a segment we create ----
 *
 * Order (numa/): explicit nodes (KVTIER_NUMA_NODES), else this process's
 * memory policy (numactl --membind ...), else the ranks' GPU-local nodes
 * (rank r on GPU r), else the local node.  Huge pages: when KVTIER_SEGMENT_DIR
 * is not given, the segment goes to a hugetlbfs mount with enough free
 * pages if there is one (KVTIER_HUGEPAGES=auto|on|off), else to /dev/shm
 * on 4 KiB pages with a warning.  Other processes that open the segment by
 * name find it there too (attach_any below).  The arena is bound with mbind
 * before its first touch, then pre-faulted and verified. */

static void tier_log(void *arg, int level, const char *msg)
{
	const struct kvt_tier_env *e = arg;

	if (level == 1 /* warn */ ? e->log_level < KVT_LOG_WARN : e->log_level < KVT_LOG_INFO)
		return;
	if (e->log)
		e->log(e->log_arg, level == 1 ? KVT_LOG_LEVEL_WARN : KVT_LOG_LEVEL_INFO, msg);
	else
		fprintf(stderr, "kvtier: %s\n", msg);
}

/* The DMA backend's lines, through the same logger (named as its own). */
static void dma_log(void *arg, int level, const char *msg)
{
	const struct kvt_tier_env *e = arg;
	char line[600];
	int lv = level == KVT_DMA_LOG_ERR ? KVT_LOG_LEVEL_ERROR :
		 level == KVT_DMA_LOG_INFO ? KVT_LOG_LEVEL_INFO : KVT_LOG_LEVEL_DEBUG;

	if (lv > (int)e->log_level)
		return;
	snprintf(line, sizeof(line), "dma: %s", msg);
	if (e->log)
		e->log(e->log_arg, lv, line);
	else
		fprintf(stderr, "kvtier %s\n", line);
}

/* An error line of the tier's own, through the same logger. */
__attribute__((format(printf, 2, 3)))
static void tier_error(const struct kvt_tier_env *e, const char *fmt, ...)
{
	char line[600];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	if (e->log)
		e->log(e->log_arg, KVT_LOG_LEVEL_ERROR, line);
	else
		fprintf(stderr, "kvtier: %s\n", line);
}

/* A segment directory the creator was given (KVTIER_SEGMENT_DIR or
 * config.segment_dir): it must exist; KVTIER_HUGEPAGES=on needs it to be
 * hugetlbfs; a disk filesystem is a warning (the arena would be a file the
 * kernel writes back). */
static int segment_dir_check(kvt_tier *t, const struct kvt_config *cfg)
{
	const char *dir = t->env.segment_dir;
	const char *what = cfg->segment_dir ? "config.segment_dir" : "KVTIER_SEGMENT_DIR";
	const char *hp = (cfg->flags & KVT_F_NO_ENV) ? NULL : getenv("KVTIER_HUGEPAGES");
	struct statfs sf;
	struct stat st;

	if (stat(dir, &st))
		return terr(-errno, "%s=%.200s: %s", what, dir, strerror(errno));
	if (!S_ISDIR(st.st_mode))
		return terr(-ENOTDIR, "%s=%.200s: not a directory", what, dir);
	if (statfs(dir, &sf))
		return terr(-errno, "%s=%.200s: %s", what, dir, strerror(errno));
	/* the same words kvt_hugepages_choose takes, checked here too: with a
	 * directory given it is not consulted */
	if (hp && strcmp(hp, "auto") && strcmp(hp, "on") && strcmp(hp, "off"))
		return terr(-EINVAL, "KVTIER_HUGEPAGES='%.40s': expected auto, on or off%s", hp,
			    *hp ? "" : " (set but empty: unset it for auto)");
	if (hp && !strcmp(hp, "on") && (unsigned long)sf.f_type != HUGETLBFS_MAGIC)
		return terr(-EINVAL, "KVTIER_HUGEPAGES=on, but %s=%.200s is not a hugetlbfs "
			    "mount: the segment would be on 4 KiB pages (name a hugetlbfs mount, "
			    "or unset %s to let kvtier find one)", what, dir, what);
	if ((unsigned long)sf.f_type != HUGETLBFS_MAGIC && (unsigned long)sf.f_type != TMPFS_MAGIC &&
	    (unsigned long)sf.f_type != RAMFS_MAGIC) {
		char msg[400];
		snprintf(msg, sizeof(msg), "%s=%.200s is not tmpfs or hugetlbfs (filesystem "
			 "0x%lx): the arena is then a disk file the kernel writes back; use "
			 "/dev/shm or a hugetlbfs mount", what, dir, (unsigned long)sf.f_type);
		tier_log(&t->env, 1, msg);
	}
	return 0;
}

#ifdef TIER_PLACEMENT
struct place_arg {
	const struct kvt_numa_plan *plan;
	struct kvt_numa_bind_opts bo;
	char msg[200];
};

/* kvt_seg_create's prepare step: binds each shard's part of the arena and
 * pre-faults it through the bound mapping, before core reserves the arena
 * and before anyone else can attach. */
static int place_arena(kvt_seg *seg, void *arg)
{
	struct place_arg *pa = arg;
	struct kvt_numa_bind_report rep;
	int r = kvt_numa_bind_segment(seg, pa->plan, &pa->bo, &rep);

	if (r)
		snprintf(pa->msg, sizeof(pa->msg), "%s", kvt_numa_last_error());
	return r;
}

static int create_placed(kvt_tier *t, const struct kvt_config *cfg,
			 struct kvt_seg_create_opts *c, const struct kvt_seg_attach_opts *a)
{
	struct kvt_numa_topo *topo = NULL;
	struct kvt_numa_request req;
	struct kvt_numa_plan plan;
	struct kvt_hp_request hr;
	struct kvt_hp_choice hc;
	struct place_arg pa;
	struct kvt_seg_attach_opts at = *a;
	uint32_t nf = (cfg->flags & KVT_F_NO_ENV) ? KVT_NUMA_F_NO_ENV : 0;
	int r;

	if (t->env.numa_fallback)
		nf |= KVT_NUMA_F_FALLBACK;
	r = kvt_numa_topo_read(NULL, &topo);
	if (r)
		return terr(r, "create: NUMA topology: %.200s", kvt_numa_last_error());
	memset(&req, 0, sizeof(req));
	req.size = sizeof(req);
	req.flags = nf;
	req.n_shards = c->geo->mode == KVT_MODE_SHARDED ? c->geo->world : 1;
	req.n_ranks = c->geo->world;
	req.nodes = t->env.numa_nodes[0] ? t->env.numa_nodes : NULL;
	req.log = tier_log;
	req.log_arg = &t->env;
	r = kvt_numa_choose(topo, &req, &plan);
	if (r) {
		terr(r, "create: NUMA placement: %.200s", kvt_numa_last_error());
		goto out_topo;
	}
	if (!c->dir) {
		memset(&hr, 0, sizeof(hr));
		hr.size = sizeof(hr);
		hr.want = KVT_HP_AUTO;
		hr.flags = (cfg->flags & KVT_F_NO_ENV) ? 0 : KVT_HP_F_ENV;
		hr.seg_bytes = kvt_geometry_segment_bytes(c->geo);
		hr.log = tier_log;
		hr.log_arg = &t->env;
		r = kvt_hugepages_choose(topo, &plan, &hr, &hc);
		if (r) {
			terr(r, "create: huge pages: %.200s", kvt_numa_last_error());
			goto out_topo;
		}
		if (hc.use) {
			snprintf(t->env.segment_dir, sizeof(t->env.segment_dir), "%s", hc.dir);
			c->dir = t->env.segment_dir;
			at.dir = c->dir;
		}
	}
	memset(&pa, 0, sizeof(pa));
	pa.plan = &plan;
	pa.bo.size = sizeof(pa.bo);
	pa.bo.flags = nf & KVT_NUMA_F_FALLBACK;
	pa.bo.log = tier_log;
	pa.bo.log_arg = &t->env;
	c->flags &= ~KVT_SEG_F_PREFAULT; /* binding pre-faults, after mbind */
	c->prepare = place_arena;
	c->prepare_arg = &pa;
	r = kvt_seg_create(c, &at, &t->seg);
	if (r) {
		if (pa.msg[0])
			terr(r, "create: binding the arena: %.250s", pa.msg);
		else
			terr_core(r, "create");
	}
out_topo:
	kvt_numa_topo_free(topo);
	return r;
}
#endif

/* Attaches by name: in the given directory, else in /dev/shm, else in a
 * hugetlbfs mount (where a creator that found huge pages put it). */
static int attach_any(kvt_tier *t, struct kvt_seg_attach_opts *a)
{
	int r = kvt_seg_attach(a, &t->seg);

#ifdef TIER_PLACEMENT
	static const uint64_t sizes[2] = { 2ULL << 20, 1ULL << 30 };
	for (int i = 0; r == -ENOENT && !a->dir && i < 2; i++) {
		struct kvt_hugetlbfs h;
		if (kvt_hugetlbfs_find(NULL, sizes[i], 0, &h) == 0) {
			struct kvt_seg_attach_opts b = *a;
			b.dir = h.dir;
			r = kvt_seg_attach(&b, &t->seg);
			if (r == 0)
				snprintf(t->env.segment_dir, sizeof(t->env.segment_dir), "%s", h.dir);
			if (r != -ENOENT)
				return r; /* found there: its verdict stands */
			r = kvt_seg_attach(a, &t->seg); /* report the /dev/shm miss */
		}
	}
#endif
	return r;
}

/* ---- open ---- */

static int geometry_from(kvt_tier *t, uint32_t world, uint32_t n_instances,
			 uint64_t tier_bytes, uint32_t n_slots, struct kvt_geometry *g)
{
	uint32_t repl = 0;
	XXH128_hash_t h;

	memset(g, 0, sizeof(*g));
	g->chunk_tokens = t->chunk_tokens;
	g->world = world;
	g->n_instances = n_instances;
	g->n_groups = t->n_groups;
	for (uint32_t i = 0; i < t->n_groups; i++) {
		const struct kvt_group_desc *d = &t->groups[i];
		if (d->replicated > 1)
			return terr(-EINVAL, "groups[%u].replicated: %u is not 0 or 1", i, d->replicated);
		if (!d->tokens_per_block || t->chunk_tokens % d->tokens_per_block)
			return terr(-EINVAL, "groups[%u].tokens_per_block: %u does not divide "
				    "chunk_tokens=%u", i, d->tokens_per_block, t->chunk_tokens);
		repl += d->replicated;
		g->groups[i].layers = d->n_layers;
		g->groups[i].bytes_per_token = d->bytes_per_token;
	}
	if (repl && repl != t->n_groups)
		return terr(-EINVAL, "groups: mixing replicated and sharded groups in one "
			    "segment is not supported; use two segments");
	g->mode = repl ? KVT_MODE_REPLICATED : KVT_MODE_SHARDED;
	h = XXH3_128bits(t->env.model, strlen(t->env.model));
	g->model_id.lo = h.low64;
	g->model_id.hi = h.high64;
	if (!n_slots) {
		uint64_t shard = kvt_geometry_shard_bytes(g);
		uint64_t per = shard * (repl ? 1 : world), n = per ? tier_bytes / per : 0;
		if (n < 1)
			return terr(-EINVAL, "tier_bytes: %llu bytes hold no chunk of %llu bytes",
				    (unsigned long long)tier_bytes, (unsigned long long)per);
		/* Refused, never clamped: a silently smaller (or 35 TB) tier
		 * is not what the operator asked for. */
		if (n > (1u << 30))
			return terr(-EINVAL, "tier_bytes: %llu bytes are %llu chunks of %llu "
				    "bytes; a segment holds at most 2^30 chunks (raise "
				    "chunk_tokens or lower the tier size)",
				    (unsigned long long)tier_bytes, (unsigned long long)n,
				    (unsigned long long)per);
		n_slots = (uint32_t)n;
	}
	g->n_slots = n_slots;
	return 0;
}

int kvt_open_v(const struct kvt_config *cfg, unsigned api_version, kvt_tier **out)
{
	struct kvt_seg_attach_opts a;
	struct kvt_geometry g;
	kvt_tier *t;
	int r;

	/* Version 1 callers differ only in what they do not call: the
	 * structs they pass have the same size (disk_chunks was reserved). */
	if (api_version < 1 || api_version > KVT_API_VERSION)
		return terr(-ENOTSUP, "kvtier.h speaks API version %u, this library 1..%u",
			    api_version, KVT_API_VERSION);
	if (!cfg || !out)
		return terr(-EINVAL, "open: NULL argument");
	if (cfg->size < sizeof(*cfg))
		return terr(-EINVAL, "config.size: %zu, expected %zu", cfg->size, sizeof(*cfg));
	if (cfg->flags & ~KVT_F_MASK)
		return terr(-EINVAL, "config.flags: unknown bits 0x%x", cfg->flags & ~KVT_F_MASK);
	if (cfg->reserved[0])
		return terr(-EINVAL, "config.reserved[0]: must be 0");
	if (cfg->disk_chunks > (1u << 30))
		return terr(-EINVAL, "config.disk_chunks: %llu above 2^30",
			    (unsigned long long)cfg->disk_chunks);
	if (cfg->disk_chunks && !(cfg->flags & KVT_F_CREATE))
		return terr(-EINVAL, "config.disk_chunks: only with KVT_F_CREATE (the disk index "
			    "is sized when the segment is made)");
	if (cfg->n_groups > KVT_MAX_GROUPS || (cfg->n_groups && !cfg->groups))
		return terr(-EINVAL, "config.n_groups: %u (1..%u, with groups)",
			    cfg->n_groups, KVT_MAX_GROUPS);
	t = calloc(1, sizeof(*t));
	if (!t)
		return terr(-ENOMEM, "open: out of memory");
	r = kvt_tier_env_resolve(cfg, &t->env, tier_err, sizeof(tier_err));
	if (r)
		goto out_free;
	t->role = t->env.role;
	t->rank = t->env.rank;
	t->chunk_tokens = t->env.chunk_tokens;
	if (t->role != KVT_TIER_RANK && cfg->rank < 0 && !(cfg->flags & KVT_F_NO_ENV) &&
	    getenv("KVTIER_RANK")) {
		char msg[160];
		snprintf(msg, sizeof(msg), "KVTIER_RANK=%.40s is ignored: this process opens "
			 "as a %s, which has no rank", getenv("KVTIER_RANK"),
			 t->role == KVT_TIER_SCHEDULER ? "scheduler" : "client");
		tier_log(&t->env, 1, msg);
	}
	if ((cfg->flags & KVT_F_CREATE) && t->env.segment_dir[0]) {
		r = segment_dir_check(t, cfg);
		if (r)
			goto out_free;
	}
	t->n_groups = cfg->n_groups;
	if (cfg->n_groups)
		memcpy(t->groups, cfg->groups, cfg->n_groups * sizeof(*cfg->groups));
	if (t->role == KVT_TIER_RANK && !cfg->n_groups) {
		r = terr(-EINVAL, "config.groups: a rank must describe its KV layout");
		goto out_free;
	}

	memset(&a, 0, sizeof(a));
	a.size = sizeof(a);
	a.name = t->env.segment;
	a.dir = t->env.segment_dir[0] ? t->env.segment_dir : NULL;
	a.role = t->role;
	a.instance = t->env.instance;
	a.rank = t->env.rank;
	a.world = t->env.world;
	a.flags = ((cfg->flags & KVT_F_ANY_UID) ? KVT_SEG_F_ANY_UID : 0) |
		  ((cfg->flags & KVT_F_GROUP) ? KVT_SEG_F_GROUP : 0);
	a.model = t->env.model; /* kept by a segment made here; named in a mismatch */
	if (cfg->n_groups) {
		r = geometry_from(t, t->env.world ? t->env.world : 1, t->env.n_instances,
				  t->env.tier_bytes, cfg->n_slots, &g);
		if (r)
			goto out_free;
		g.disk_chunks = (uint32_t)cfg->disk_chunks;
		kvt_geometry_fingerprint(&g, &t->fingerprint);
		/* Without a world (a scheduler or client that did not say) the
		 * fingerprint cannot be predicted: the segment's is adopted. */
		if (t->env.world) {
			a.fingerprint = &t->fingerprint;
			a.geo = &g;
		}
	}
	if (cfg->flags & KVT_F_CREATE) {
		struct kvt_seg_create_opts c = {
			.size = sizeof(c), .name = a.name, .dir = a.dir, .geo = &g,
			.flags = ((cfg->flags & KVT_F_REPLACE) ? KVT_SEG_F_REPLACE : 0) |
				 ((cfg->flags & KVT_F_GROUP) ? KVT_SEG_F_GROUP : 0) |
				 ((cfg->flags & KVT_F_PREFAULT) ? KVT_SEG_F_PREFAULT : 0) };
		if (!cfg->n_groups || !t->env.world) {
			r = terr(-EINVAL, "create: needs the KV layout (groups) and the world size");
			goto out_free;
		}
#ifdef TIER_PLACEMENT
		r = create_placed(t, cfg, &c, &a);
		if (r)
			goto out_free;
#else
		r = kvt_seg_create(&c, &a, &t->seg);
		if (r) {
			terr_core(r, "create");
			goto out_free;
		}
		tier_log(&t->env, 1, "built without libnuma: the arena is not NUMA-bound");
#endif
	} else {
		r = attach_any(t, &a);
		if (r) {
			terr_core(r, "attach");
			if (t->env.segment_dir[0] && !cfg->segment_dir) {
				/* say where the directory came from */
				char why[sizeof(tier_err)];
				snprintf(why, sizeof(why), "%s", tier_err);
				terr(r, "%.1100s (KVTIER_SEGMENT_DIR=%.80s)", why, t->env.segment_dir);
			}
			goto out_free;
		}
	}
	{
		const struct kvt_geometry *sg = kvt_seg_geometry(t->seg);
		kvt_seg_fingerprint(t->seg, &t->fingerprint);
		t->key_root = kvt__hash_root(&t->fingerprint);
		t->hash_chain = kvt__hash_chain(NULL);
		if (!cfg->n_groups) {
			t->chunk_tokens = sg->chunk_tokens;
		} else if (sg->chunk_tokens != t->chunk_tokens) {
			r = terr(-EINVAL, "chunk_tokens: this process uses %u, the segment %u",
				 t->chunk_tokens, sg->chunk_tokens);
			goto out_detach;
		}
		t->shard = sg->mode == KVT_MODE_SHARDED ? t->rank : 0;
		for (uint32_t i = 0; i < t->n_groups; i++) {
			t->bpc[i] = t->chunk_tokens / t->groups[i].tokens_per_block;
			t->blocks_per_chunk += t->bpc[i];
		}
	}
	*out = t;
	return 0;
out_detach:
	kvt_seg_detach(t->seg);
out_free:
	free(t);
	return r;
}

/* ---- ops ---- */

static struct op *op_get(kvt_tier *t, kvt_op id)
{
	uint32_t i = (uint32_t)id;

	if (i == 0 || i > KVT_MAX_OPS)
		return NULL;
	struct op *o = &t->ops[i - 1];
	return o->kind != OP_FREE && o->gen == (uint32_t)(id >> 32) ? o : NULL;
}

static struct op *op_new(kvt_tier *t, uint32_t kind, uint32_t n, kvt_op *id)
{
	for (uint32_t k = 0; k < KVT_MAX_OPS; k++) {
		uint32_t i = (t->op_hint + k) % KVT_MAX_OPS;
		struct op *o = &t->ops[i];
		if (o->kind != OP_FREE)
			continue;
		o->ch = calloc(n ? n : 1, sizeof(*o->ch));
		o->blocks = calloc((size_t)(n ? n : 1) * t->blocks_per_chunk, sizeof(uint32_t));
		if (!o->ch || !o->blocks) {
			free(o->ch);
			free(o->blocks);
			return NULL;
		}
		o->kind = kind;
		o->gen++;
		o->n = n;
		o->next = o->done = 0;
		o->err = 0;
		o->why[0] = 0;
		o->lease = 0;
		o->t0 = kvt__now_ns();
		o->timed = 0;
		t->op_hint = i + 1;
		*id = ((uint64_t)o->gen << 32) | (i + 1);
		return o;
	}
	return NULL;
}

static void op_free(struct op *o)
{
	free(o->ch);
	free(o->blocks);
	o->ch = NULL;
	o->blocks = NULL;
	o->kind = OP_FREE;
}

/* Copies chunk rows of the caller's block tables into the op. */
_Static_assert(KVT_BLOCK_SKIP == KVT_DMA_BLOCK_SKIP, "one skip id");

static int op_tables(kvt_tier *t, struct op *o, const uint32_t *const *tables)
{
	uint32_t *dst = o->blocks;

	if (!tables || !tables[0])
		return terr(-EINVAL, "tables: NULL block table");
	for (uint32_t g = 0; g < t->n_groups; g++) {
		const uint32_t *src = tables[g] ? tables[g] : tables[0];
		if (g && !tables[g] && t->groups[g].tokens_per_block != t->groups[0].tokens_per_block)
			return terr(-EINVAL, "tables[%u]: NULL, but group %u's block size differs "
				    "from group 0's", g, g);
		memcpy(dst, src, (size_t)o->n * t->bpc[g] * sizeof(uint32_t));
		if (o->kind == OP_SAVE)
			for (size_t i = 0; i < (size_t)o->n * t->bpc[g]; i++)
				if (dst[i] == KVT_BLOCK_SKIP)
					return terr(-EINVAL, "save: tables[%u][%zu] is KVT_BLOCK_SKIP: a "
						    "chunk is saved whole (skip is for loads)", g, i);
		dst += (size_t)o->n * t->bpc[g];
	}
	return 0;
}

static int chunk_submit(kvt_tier *t, struct op *o, uint32_t i)
{
	const uint32_t *tabs[KVT_MAX_GROUPS];
	const uint32_t *base = o->blocks;
	void *sub;
	int r;

	for (uint32_t g = 0; g < t->n_groups; g++) {
		tabs[g] = base + (size_t)i * t->bpc[g];
		base += (size_t)o->n * t->bpc[g];
	}
	r = kvt_dma_plan_build(t->dma, &t->plan, tabs, t->chunk_tokens);
	if (r < 0)
		return terr_dma(r, "plan");
	if (r == 0)
		return 1; /* a load whose blocks are all KVT_BLOCK_SKIP: nothing to copy */
	sub = kvt_slot_shard_ptr(t->seg, o->ch[i].slot, t->shard);
	if (!sub)
		return terr(-EUCLEAN, "slot %u out of range", o->ch[i].slot);
	r = kvt_dma_submit(t->dma, &t->plan, sub,
			   o->kind == OP_SAVE ? KVT_DMA_D2H : KVT_DMA_H2D, &o->ch[i].ticket);
	return r && r != -EAGAIN ? terr_dma(r, "submit") : r;
}

static void chunk_finish(kvt_tier *t, struct op *o, uint32_t i, int status)
{
	struct op_chunk *c = &o->ch[i];

	if (o->kind == OP_SAVE) {
		int r = kvt_write_end(t->seg, &c->w, status == 0);
		if (status == 0 && r == -ESTALE)
			status = -ESTALE; /* reclaimed while written: not saved */
	}
	if (status) {
		if (status == -EIO)
			kvt_counter_add(t->seg, KVT_C_DMA_ERRORS, 1);
		if (!o->err) {
			o->err = status;
			/* chunk_submit's failures left their reason in tier_err;
			 * a copy's failure has only its code */
			if (c->state == CH_QUEUED)
				snprintf(o->why, sizeof(o->why), "chunk %u: %.180s", i, tier_err);
			else if (status == -ESTALE)
				snprintf(o->why, sizeof(o->why), "chunk %u: its slot was reclaimed "
					 "while it was written (not saved)", i);
			else
				/* the DMA core's reason, set by the poll or wait
				 * that just returned this status on this thread */
				snprintf(o->why, sizeof(o->why), "chunk %u: the copy failed: %.200s", i,
					 kvt_dma_last_error()[0] ? kvt_dma_last_error() :
					 kvt_strerror(status));
		}
		c->state = CH_FAILED;
	} else {
		c->state = CH_DONE;
		if (o->kind == OP_LOAD)
			kvt_counter_add(t->seg, KVT_C_BYTES_LOADED,
					kvt_kv_layout_shard_bytes(&t->layout));
	}
	o->done++;
}

/* Completes finished tickets and submits queued chunks.  Returns the op's
 * status: 0 done, -EINPROGRESS, or its error once everything settled. */
static int op_progress(kvt_tier *t, struct op *o)
{
	for (uint32_t i = 0; i < o->next; i++) {
		if (o->ch[i].state != CH_INFLIGHT)
			continue;
		int r = kvt_dma_poll(t->dma, o->ch[i].ticket);
		if (r != -EINPROGRESS)
			chunk_finish(t, o, i, r);
	}
	while (o->next < o->n) {
		uint32_t i = o->next;
		if (o->ch[i].state != CH_QUEUED) {
			o->next++;
			continue;
		}
		int r = chunk_submit(t, o, i);
		if (r == -EAGAIN)
			break; /* window full: the next progress call resumes */
		o->next++;
		if (r) {
			chunk_finish(t, o, i, r > 0 ? 0 : r);
			continue;
		}
		o->ch[i].state = CH_INFLIGHT;
	}
	if (o->done < o->n)
		return -EINPROGRESS;
	if (!o->timed) {
		/* Submission to the last chunk's completion, as this caller
		 * saw it (it drives progress): what the engine waited. */
		o->timed = 1;
		kvt_hist_add(t->seg, o->kind == OP_SAVE ? KVT_H_SAVE : KVT_H_LOAD, kvt__now_ns() - o->t0);
		kvt_seg_heartbeat(t->seg);
	}
	if (o->kind == OP_LOAD && o->lease && !o->err) {
		int r = kvt_lease_loaded(t->seg, o->lease, t->rank);
		if (r < 0)
			o->err = r;
		o->lease = 0;
	}
	return o->err;
}

static int need_kv(kvt_tier *t, const char *what)
{
	if (!t)
		return terr(-EINVAL, "%s: NULL handle", what);
	if (!t->dma)
		return terr(-EPERM, "%s: no KV cache registered (kvt_register_kv)", what);
	return 0;
}

int kvt_order_after(kvt_tier *t, uint64_t stream)
{
	int r;

	if ((r = need_kv(t, "order_after")))
		return r;
	r = kvt_dma_order_after(t->dma, stream);
	return r ? terr_dma(r, "order_after") : 0;
}

int kvt_save(kvt_tier *t, const kvt_key *keys, uint32_t n, uint32_t first_depth,
	     const uint32_t *const *tables, kvt_op *opid)
{
	struct op *o;
	uint32_t claimed = 0;
	int r;

	if (!opid)
		return terr(-EINVAL, "save: op is NULL (kvt_poll/kvt_wait need the op)");
	*opid = 0;
	if ((r = need_kv(t, "save")))
		return r;
	if (!n)
		return 0;
	if (!keys)
		return terr(-EINVAL, "save: NULL keys");
	o = op_new(t, OP_SAVE, n, opid);
	if (!o)
		return terr(-ENOSPC, "save: %u operations are pending; poll them", KVT_MAX_OPS);
	r = op_tables(t, o, tables);
	if (r)
		goto out_free;
	for (uint32_t i = 0; i < n; i++) {
		struct kvt_wref w;
		r = kvt_write_begin(t->seg, &keys[i], first_depth + i, t->shard, &w);
		if (r == 0) {
			o->ch[i].state = CH_QUEUED;
			o->ch[i].slot = w.slot;
			o->ch[i].w = w;
			claimed++;
		} else {
			/* skipped (dedupe) or no space: counted by core; not ours */
			o->ch[i].state = CH_DONE;
			o->done++;
		}
	}
	if (!claimed) {
		op_free(o);
		*opid = 0;
		return 0;
	}
	(void)op_progress(t, o);
	return (int)claimed;
out_free:
	op_free(o);
	*opid = 0;
	return r;
}

int kvt_load(kvt_tier *t, kvt_lease_id lease, uint32_t n,
	     const uint32_t *const *tables, kvt_op *opid)
{
	struct op *o;
	uint32_t *slots;
	int r, hits;

	if (!opid)
		return terr(-EINVAL, "load: op is NULL (kvt_poll/kvt_wait need the op)");
	*opid = 0;
	if ((r = need_kv(t, "load")))
		return r;
	slots = malloc((n ? n : 1) * sizeof(*slots));
	if (!slots)
		return terr(-ENOMEM, "load: out of memory");
	hits = kvt_lease_slots(t->seg, lease, slots, NULL, n);
	if (hits < 0) {
		free(slots);
		return terr_core(hits, "load");
	}
	if ((uint32_t)hits < n) {
		free(slots);
		return terr(-EINVAL, "load: %u chunks asked, the lease holds %d", n, hits);
	}
	o = op_new(t, OP_LOAD, n, opid);
	if (!o) {
		free(slots);
		return terr(-ENOSPC, "load: %u operations are pending; poll them", KVT_MAX_OPS);
	}
	o->lease = lease;
	r = op_tables(t, o, tables);
	if (r) {
		free(slots);
		op_free(o);
		*opid = 0;
		return r;
	}
	for (uint32_t i = 0; i < n; i++) {
		o->ch[i].state = CH_QUEUED;
		o->ch[i].slot = slots[i];
	}
	free(slots);
	if (n == 0) {
		r = op_progress(t, o);
		op_free(o);
		*opid = 0;
		return r < 0 ? terr_core(r, "load") : 0;
	}
	(void)op_progress(t, o);
	return 0;
}

int kvt_poll(kvt_tier *t, kvt_op id)
{
	struct op *o;
	int r;

	if (!t)
		return terr(-EINVAL, "poll: NULL handle");
	o = op_get(t, id);
	if (!o)
		return terr(-ESTALE, "poll: op %#llx is not live", (unsigned long long)id);
	r = op_progress(t, o);
	if (r == -EINPROGRESS)
		return r;
	if (r) {
		char why[sizeof(o->why)];
		const char *kind = o->kind == OP_LOAD ? "load" : "save";
		snprintf(why, sizeof(why), "%s", o->why[0] ? o->why : kvt_strerror(r));
		op_free(o);
		return terr(r, "%s failed: %s", kind, why);
	}
	op_free(o);
	return 0;
}

int kvt_wait(kvt_tier *t, kvt_op id, int64_t timeout_ns)
{
	uint64_t deadline = timeout_ns < 0 ? UINT64_MAX : kvt__now_ns() + (uint64_t)timeout_ns;

	if (!t)
		return terr(-EINVAL, "wait: NULL handle");
	for (;;) {
		struct op *o = op_get(t, id);
		if (!o)
			return terr(-ESTALE, "wait: op %#llx is not live", (unsigned long long)id);
		int r = kvt_poll(t, id);
		if (r != -EINPROGRESS)
			return r;
		/* Sleep on the oldest ticket in flight (or just yield). */
		uint64_t now = kvt__now_ns();
		if (now >= deadline)
			return terr(-ETIMEDOUT, "wait: op %#llx still in flight", (unsigned long long)id);
		int64_t slice = (int64_t)((deadline - now) < 1000000ULL ? (deadline - now) : 1000000ULL);
		for (uint32_t i = 0; i < o->next; i++) {
			if (o->ch[i].state == CH_INFLIGHT) {
				int w = kvt_dma_wait(t->dma, o->ch[i].ticket, slice);
				if (w != -ETIMEDOUT)
					chunk_finish(t, o, i, w);
				break;
			}
		}
	}
}

/* ---- registration ---- */

int kvt_register_kv(kvt_tier *t, uint32_t n_groups, const struct kvt_group_buffers *gb)
{
	struct kvt_dma_config dc;
	void *arena;
	uint64_t len, total = 0;
	char msg[200];
	int r;

	if (!t)
		return terr(-EINVAL, "register_kv: NULL handle");
	if (t->role == KVT_TIER_SCHEDULER)
		return terr(-EPERM, "register_kv: a scheduler has no KV cache");
	if (t->dma)
		return terr(-EALREADY, "register_kv: already registered");
	if (!gb)
		return terr(-EINVAL, "register_kv: the group buffers are NULL");
	if (n_groups != t->n_groups)
		return terr(-EINVAL, "register_kv: %u groups given, the layout has %u",
			    n_groups, t->n_groups);
	for (uint32_t g = 0; g < n_groups; g++)
		total += t->groups[g].n_layers;
	free(t->bases); /* left by a registration that failed */
	t->bases = calloc(total ? total : 1, sizeof(uint64_t));
	if (!t->bases)
		return terr(-ENOMEM, "register_kv: out of memory");
	memset(&t->layout, 0, sizeof(t->layout));
	t->layout.chunk_tokens = t->chunk_tokens;
	t->layout.n_groups = n_groups;
	total = 0;
	for (uint32_t g = 0; g < n_groups; g++) {
		struct kvt_kv_group *kg = &t->layout.groups[g];
		if (!gb[g].layer_base)
			return terr(-EINVAL, "register_kv: groups[%u].layer_base is NULL", g);
		memcpy(t->bases + total, gb[g].layer_base, t->groups[g].n_layers * sizeof(uint64_t));
		kg->n_layers = t->groups[g].n_layers;
		kg->bytes_per_token = t->groups[g].bytes_per_token;
		kg->tokens_per_block = t->groups[g].tokens_per_block;
		kg->flags = t->groups[g].replicated ? KVT_GROUP_F_REPLICATED : 0;
		kg->block_stride = gb[g].block_stride;
		kg->n_blocks = gb[g].n_blocks;
		kg->layer_base = t->bases + total;
		total += kg->n_layers;
	}
	if (kvt_kv_layout_check(&t->layout, msg, sizeof(msg)))
		return terr(-EINVAL, "register_kv: %s", msg);
	if (kvt_kv_layout_shard_bytes(&t->layout) > kvt_seg_shard_bytes(t->seg))
		return terr(-EINVAL, "register_kv: a chunk is %llu bytes, the segment's "
			    "sub-slot %llu", (unsigned long long)kvt_kv_layout_shard_bytes(&t->layout),
			    (unsigned long long)kvt_seg_shard_bytes(t->seg));
	memset(&dc, 0, sizeof(dc));
	dc.size = sizeof(dc);
	dc.backend = t->env.dma;
	dc.device = -1;
	dc.max_inflight = t->env.max_inflight;
	/* host copy threads: $KVTIER_COPY_THREADS, else the backend sizes
	 * them from this process's CPUs shared by the node's ranks: this
	 * instance's world at least (its ranks may still be attaching), or
	 * every rank of every instance attached now */
	dc.n_workers = t->env.copy_threads;
	dc.fault_nth = t->env.test_dma_fault; /* testing: a copy that fails */
	dc.flags |= KVT_DMA_F_HOST_WORKERS; /* KVTIER_COPY_THREADS: not CUDA's streams */
	{
		int live = kvt_seg_live_ranks(t->seg);
		dc.node_ranks = live > (int)t->env.world ? (uint32_t)live : t->env.world;
	}
	if (t->env.log_level < KVT_LOG_INFO)
		dc.flags |= KVT_DMA_F_QUIET;
	/* the copy kernel for small pages, cuda and hsa (KVTIER_COPY_KERNEL) */
	if (t->env.copy_kernel == UINT64_MAX)
		dc.flags |= KVT_DMA_F_NO_KERNEL;
	else
		dc.kernel_below = t->env.copy_kernel;
	dc.kernel_ctas = t->env.copy_kernel_ctas;
	/* registration pieces: at least one sub-slot each */
	dc.piece_max = t->env.register_piece > kvt_seg_shard_bytes(t->seg) ?
		       t->env.register_piece : kvt_seg_shard_bytes(t->seg);
	dc.log = dma_log;
	dc.log_arg = &t->env;
	r = kvt_dma_open(&dc, &t->dma);
	if (r)
		return terr_dma(r, "register_kv: DMA backend");
	/* A GPU backend's saves are the driver's copies, which may run on
	 * after this process was killed: the exit witness keeps our entry,
	 * hence our claims, until the process has wholly exited
	 * (core/witness.c).  The host backend's copies die with our threads. */
	if (strcmp(kvt_dma_backend(t->dma), "host")) {
		if (t->env.witness) {
			r = kvt_seg_witness(t->seg);
			if (r) {
				terr(r, "register_kv: the exit witness, which keeps this rank's "
				     "slots from reuse while a killed rank's GPU copies may "
				     "still land: %s (KVTIER_WITNESS=off runs without it, "
				     "accepting that window)", kvt_core_last_error());
				goto out_close;
			}
			{
				char why[160], line[320];
				int held = kvt_seg_witness_daemon(t->seg, why, sizeof(why));
				snprintf(line, sizeof(line), "exit witness: pid %d%s%s%s",
					 kvt_seg_witness_pid(t->seg),
					 held ? "; kvtierd holds this rank's claims too" :
						"; kvtierd does not hold them too (",
					 held ? "" : why, held ? "" : "): a kill of this rank's "
					 "whole cgroup is not covered");
				tier_log(&t->env, 2, line);
			}
		} else {
			tier_log(&t->env, 1, "KVTIER_WITNESS=off: a GPU save in flight when "
				 "this rank is killed may land in a slot given to another "
				 "chunk (docs/FAULTS.md)");
		}
	}
	r = kvt_dma_kv_register(t->dma, &t->layout);
	if (r) {
		terr_dma(r, "register_kv");
		goto out_close;
	}
	r = kvt_seg_arena(t->seg, t->shard, &arena, &len);
	if (r) {
		terr_core(r, "register_kv");
		goto out_close;
	}
	/* a large arena's registration must not hold the engine's start: the
	 * first piece now, the rest in the background (KVTIER_REGISTER), each
	 * usable as it is registered */
	r = (t->env.register_bg ? kvt_dma_mem_register_bg : kvt_dma_mem_register)(
		t->dma, arena, len, kvt_seg_shard_bytes(t->seg), &t->mr);
	if (r) {
		terr_dma(r, "register_kv: arena registration");
		goto out_close;
	}
	r = kvt_plan_init(&t->plan, kvt_kv_layout_max_copies(&t->layout));
	if (r) {
		terr(r, "register_kv: plan allocation");
		goto out_unreg;
	}
	return 0;
out_unreg:
	kvt_dma_mem_unregister(t->dma, t->mr);
	t->mr = NULL;
out_close:
	kvt_dma_close(t->dma);
	t->dma = NULL;
	return r;
}

/* ---- keys, lookups, leases ---- */

int kvt_hash_tokens(const kvt_tier *t, const uint32_t *tokens, size_t n_tokens,
		    const kvt_key *parent, kvt_key *keys, size_t max_keys)
{
	size_t chunks;
	kvt_key prev;

	if (!t)
		return terr(-EINVAL, "hash_tokens: NULL handle");
	chunks = n_tokens / t->chunk_tokens;
	if (chunks > max_keys)
		chunks = max_keys;
	if (chunks > INT_MAX)
		chunks = INT_MAX;
	if (!chunks)
		return 0;
	if (!tokens || !keys)
		return terr(-EINVAL, "hash_tokens: NULL argument");
	prev = parent ? *parent : t->key_root;
	t->hash_chain(tokens, t->chunk_tokens, chunks, prev, keys);
	return (int)chunks;
}

int kvt_lookup(kvt_tier *t, const kvt_key *keys, uint32_t n, kvt_lease_id *lease)
{
	int r;

	if (!t || !lease || (n && !keys))
		return terr(-EINVAL, "lookup: NULL argument");
	uint64_t t0 = kvt__now_ns();
	r = kvt_seg_lookup(t->seg, keys, n, lease);
	if (r >= 0)
		kvt_hist_add(t->seg, KVT_H_LOOKUP, kvt__now_ns() - t0);
	return r < 0 ? terr_core(r, "lookup") : r;
}

/* Whether this handle asked for index entry (pos, seq) within 200 ms;
 * with mark, records that it asks now. */
static int asked_lately(kvt_tier *t, const struct kvt_disk_ref *r, uint64_t now, int mark)
{
	uint32_t i = (r->pos ^ (r->pos >> 8)) & 255u;

	if (t->asked[i].pos == r->pos && t->asked[i].seq == r->seq &&
	    now - t->asked[i].ns < 200000000ULL)
		return 1;
	if (mark) {
		t->asked[i].pos = r->pos;
		t->asked[i].seq = r->seq;
		t->asked[i].ns = now;
	}
	return 0;
}

int kvt_lookup_ex(kvt_tier *t, const kvt_key *keys, uint32_t n, uint32_t flags,
		  struct kvt_lookup_res *res)
{
	kvt_lease_id lease = 0;
	uint32_t pending = 0, requested = 0;
	int r;

	if (!t || !res || (n && !keys))
		return terr(-EINVAL, "lookup_ex: NULL argument");
	if (res->size < sizeof(*res))
		return terr(-EINVAL, "lookup_ex: res->size %zu, expected %zu", res->size,
			    sizeof(*res));
	if (flags & ~KVT_LOOKUP_F_MASK)
		return terr(-EINVAL, "lookup_ex: unknown flag bits 0x%x", flags & ~KVT_LOOKUP_F_MASK);
	uint32_t first = (flags & KVT_LOOKUP_DEPTH) ? res->first_depth : 0;
	if (first > UINT32_MAX - n)
		return terr(-EINVAL, "lookup_ex: first_depth %u + %u keys overflows", first, n);
	/* the L3 is asked only by a caller that says keys[0]'s depth (an
	 * object is checked against the depth it is asked at): one built
	 * against version <= 3 sees the disk only, as before */
	int depth_known = (flags & KVT_LOOKUP_DEPTH) != 0;
	if ((flags & KVT_LOOKUP_PROMOTE) && depth_known && !t->l3c)
		t->l3c = kvt__l3c_new(); /* NULL (no memory): no L3 asks */
	uint64_t t0 = kvt__now_ns();
	r = kvt_seg_lookup(t->seg, keys, n, &lease);
	if (r < 0)
		return terr_core(r, "lookup");
	kvt_seg *s = t->seg;
	uint32_t hits = (uint32_t)r;
	uint32_t cap = kvt_seg_geometry(s)->lease_max_chunks;
	int disk = hits < n && kvt_disk_online(s);
	int l3 = hits < n && depth_known && t->l3c && kvt__l3c_begin(t->l3c, s, t0);
	if (disk || l3) {
		/* The chunks after the hits: on disk (ask for them), in DRAM
		 * already (promoted, got from the L3, or being written) behind
		 * one that is not yet, or asked of the L3 (kvt_l3_chan.h) and
		 * not answered "missing". */
		/* pending and requested before the first chunk the L3 counts */
		uint32_t l3_from = UINT32_MAX, l3_req = 0, l3_asked = 0;
		int l3_failed = 0;
		for (uint32_t i = hits; i < n && hits + pending < cap; i++) {
			struct kvt_disk_ref ref;
			if (disk && kvt_disk_find(s, &keys[i], &ref)) {
				if ((flags & KVT_LOOKUP_PROMOTE) && !asked_lately(t, &ref, t0, 0) &&
				    kvt_disk_request(s, &ref) == 0) {
					asked_lately(t, &ref, t0, 1);
					requested++;
				}
			} else if (kvt_seg_peek(s, &keys[i], 1) == 1) {
				/* in DRAM, not READY yet */
			} else if (l3) {
				int st = kvt__l3c_state(t->l3c, &keys[i], t0);
				if (st == KVT_L3C_NOT_THERE)
					break;
				if (st == KVT_L3C_NOT_ASKED) {
					if (!(flags & KVT_LOOKUP_PROMOTE))
						break;
					int q = kvt__l3c_queue(t->l3c, &keys[i], first + i, t0);
					if (q == -ENOBUFS) { /* a message full: sent, and on */
						if (kvt__l3c_send(t->l3c, t0)) {
							l3_failed = 1;
							break;
						}
						q = kvt__l3c_queue(t->l3c, &keys[i], first + i, t0);
					}
					if (q)
						break;
				}
				if (l3_from == UINT32_MAX) {
					l3_from = pending;
					l3_req = requested;
				}
				if (st == KVT_L3C_NOT_ASKED) {
					l3_asked++;
					requested++;
				}
			} else {
				break;
			}
			pending++;
		}
		if (l3_failed || (l3_asked && kvt__l3c_send(t->l3c, t0))) {
			/* not asked after all (and, the connection gone, nothing
			 * earlier is pending either): up to the L3's first only */
			pending = l3_from;
			requested = l3_req;
		}
	}
	kvt_hist_add(s, KVT_H_LOOKUP, kvt__now_ns() - t0);
	res->lease = lease;
	res->hits = hits;
	res->pending = pending;
	res->requested = requested;
	memset(res->reserved, 0, sizeof(res->reserved));
	return (int)hits;
}

int kvt_release(kvt_tier *t, kvt_lease_id lease)
{
	int r;

	if (!t)
		return terr(-EINVAL, "release: NULL handle");
	r = kvt_lease_release(t->seg, lease);
	return r < 0 ? terr_core(r, "release") : r;
}

int kvt_step(kvt_tier *t, const kvt_lease_id *live, uint32_t n)
{
	int r;

	if (!t)
		return terr(-EINVAL, "step: NULL handle");
	kvt_seg_heartbeat(t->seg);
	r = kvt_seg_step(t->seg, live, n);
	return r < 0 ? terr_core(r, "step") : r;
}

int kvt_reap(kvt_tier *t)
{
	int r;

	if (!t)
		return terr(-EINVAL, "reap: NULL handle");
	r = kvt_seg_reap(t->seg);
	return r < 0 ? terr_core(r, "reap") : r;
}

int kvt_stats(kvt_tier *t, struct kvt_stats *o)
{
	uint64_t c[KVT_C__COUNT];
	struct kvt_occupancy occ;
	const struct kvt_geometry *g;

	if (!t)
		return terr(-EINVAL, "stats: NULL handle");
	g = kvt_seg_geometry(t->seg);
	if (!o || (o->size != sizeof(*o) && o->size != KVT_STATS_V1_SIZE))
		return terr(-EINVAL, "stats: size must be sizeof(struct kvt_stats) (%zu, or %u "
			    "for API version 1)", sizeof(*o), KVT_STATS_V1_SIZE);
	struct kvt_stats full;
	size_t want = o->size;
	struct kvt_stats *caller = o;
	o = &full;
	kvt_counters_read(t->seg, c);
	kvt_occupancy_read(t->seg, &occ);
	memset(o, 0, sizeof(*o));
	o->lookups = c[KVT_C_LOOKUPS];
	o->lookup_chunks = c[KVT_C_LOOKUP_CHUNKS];
	o->hit_chunks = c[KVT_C_HIT_CHUNKS];
	o->hit_tokens = c[KVT_C_HIT_TOKENS];
	o->saved_chunks = c[KVT_C_SAVED_CHUNKS];
	o->save_skips = c[KVT_C_SAVE_SKIPS];
	o->save_nospc = c[KVT_C_SAVE_NOSPC];
	o->loaded_chunks = c[KVT_C_LOADED_CHUNKS];
	o->bytes_saved = c[KVT_C_BYTES_SAVED];
	o->bytes_loaded = c[KVT_C_BYTES_LOADED];
	o->evictions = c[KVT_C_EVICTIONS];
	o->stale_unpins = c[KVT_C_STALE_UNPINS];
	o->double_unpins = c[KVT_C_DOUBLE_UNPINS];
	o->reaped_ranks = c[KVT_C_REAPED_RANKS];
	o->dma_errors = c[KVT_C_DMA_ERRORS];
	o->slots = g->n_slots;
	o->slots_free = occ.free;
	o->slots_filling = occ.filling;
	o->slots_ready = occ.ready;
	o->slots_pinned = occ.pinned;
	o->leases_live = occ.leases_live;
	o->chunk_bytes = kvt_seg_chunk_bytes(t->seg);
	o->chunk_tokens = g->chunk_tokens;
	o->world = g->world;
	struct kvt_disk_status ds;
	if (kvt_disk_capacity(t->seg) && kvt_disk_status_read(t->seg, &ds) == 0) {
		o->disk_chunks = ds.chunks;
		o->disk_used = ds.used;
		o->disk_online = (uint32_t)ds.online;
	}
	o->disk_writes = c[KVT_C_DISK_WRITES];
	o->disk_reads = c[KVT_C_DISK_READS];
	o->disk_bytes_written = c[KVT_C_DISK_BYTES_WRITTEN];
	o->disk_bytes_read = c[KVT_C_DISK_BYTES_READ];
	o->disk_checksum_errors = c[KVT_C_DISK_CSUM_ERRORS];
	o->disk_admit_rejects = c[KVT_C_DISK_ADMIT_REJECTS];
	o->disk_evictions = c[KVT_C_DISK_EVICTIONS];
	o->promote_requests = c[KVT_C_PROMOTE_REQUESTS];
	o->promote_drops = c[KVT_C_PROMOTE_DROPS];
	o->size = want;
	memcpy(caller, o, want);
	return 0;
}
_Static_assert(offsetof(struct kvt_stats, disk_chunks) == KVT_STATS_V1_SIZE,
	       "KVT_STATS_V1_SIZE is the version-1 struct");

int kvt_unlink(const char *name, const char *dir)
{
	int r;

	if (!name)
		return terr(-EINVAL, "unlink: NULL name");
	if (kvt_seg_name_valid(name))
		return terr(-EINVAL, "unlink: '%.80s' is not a segment name (1..64 of "
			    "[A-Za-z0-9._-])", name);
	if (dir && dir[0] != '/')
		return terr(-EINVAL, "unlink: dir '%.80s' is not an absolute directory", dir);
	r = kvt_seg_unlink(name, dir);
	if (r == 0 || dir)
		return r ? terr_core(r, "unlink") : 0;
#ifdef TIER_PLACEMENT
	{	/* not in /dev/shm: the huge page mounts kvt_open uses */
		static const uint64_t sizes[2] = { 2ULL << 20, 1ULL << 30 };
		int shm_r = r;
		for (int i = 0; r == -ENOENT && i < 2; i++) {
			struct kvt_hugetlbfs h;
			if (kvt_hugetlbfs_find(NULL, sizes[i], 0, &h) == 0)
				r = kvt_seg_unlink(name, h.dir);
		}
		if (r == -ENOENT)
			r = shm_r;
	}
#endif
	return r ? terr_core(r, "unlink") : 0;
}

void kvt_fingerprint(const kvt_tier *t, kvt_key *out)
{
	if (t && out)
		*out = t->fingerprint;
}

int kvt_segment_model(const kvt_tier *t, char *buf, size_t len)
{
	if (!t || !buf || !len)
		return terr(-EINVAL, "segment_model: needs a handle and a buffer");
	kvt_seg_model(t->seg, buf, len);
	return (int)strlen(buf);
}

/* Handles closed with copies the device never finished (kvt_close): kept
 * whole until the process exits -- reachable from here. */
static pthread_mutex_t kept_mu = PTHREAD_MUTEX_INITIALIZER;
static kvt_tier *kept[16];
static unsigned n_kept;

static int64_t left_ns(uint64_t deadline)
{
	uint64_t now = kvt__now_ns();

	return now >= deadline ? 0 : (int64_t)(deadline - now);
}

/* Closing waits for the copies in flight to land before their claims end
 * (a save's slot, a load's pinned chunk), up to KVTIER_CLOSE_TIMEOUT
 * seconds in all (60).  A copy still running then -- a hung or lost
 * device -- is abandoned, and with it the whole handle: its save claims
 * stay (no other writer gets those slots), the segment stays mapped, the
 * DMA handle keeps the arena registered, and the rank stays attached, so
 * nothing the device may still write is reused while this process lives;
 * when it exits, the reaper (and the exit witness) repair what it held, as
 * for any rank that died mid-copy.  Logged as an error: the process should
 * exit. */
void kvt_close(kvt_tier *t)
{
	uint64_t deadline;
	uint32_t abandoned = 0, saves = 0;

	if (!t)
		return;
	deadline = kvt__now_ns() + (uint64_t)t->env.close_timeout_s * 1000000000ull;
	for (uint32_t i = 0; i < KVT_MAX_OPS; i++) {
		struct op *o = &t->ops[i];
		uint32_t mine = 0;

		if (o->kind == OP_FREE)
			continue;
		/* Let in-flight copies land before their claims end. */
		for (uint32_t k = 0; k < o->next; k++)
			if (o->ch[k].state == CH_INFLIGHT) {
				int r = kvt_dma_wait(t->dma, o->ch[k].ticket, left_ns(deadline));

				if (r == -ETIMEDOUT) {
					mine++;
					saves += o->kind == OP_SAVE;
					continue; /* its claim stays */
				}
				chunk_finish(t, o, k, r);
			}
		if (o->kind == OP_SAVE)
			for (uint32_t k = o->next; k < o->n; k++)
				if (o->ch[k].state == CH_QUEUED)
					kvt_write_end(t->seg, &o->ch[k].w, 0);
		abandoned += mine;
		if (!mine)
			op_free(o);
	}
	if (abandoned) {
		tier_error(&t->env, "close: %u copies (%u saves) still running after %u s "
		     "(KVTIER_CLOSE_TIMEOUT): the device is not finishing them. Abandoned, with "
		     "this handle: their slots stay claimed, the arena mapped and registered and "
		     "the rank attached until this process exits, so that nothing the device "
		     "may still write is reused; exit the process", abandoned, saves,
		     t->env.close_timeout_s);
		/* (t keeps its DMA handle whole: registrations, streams) */
		pthread_mutex_lock(&kept_mu);
		if (n_kept < sizeof(kept) / sizeof(kept[0]))
			kept[n_kept++] = t;
		pthread_mutex_unlock(&kept_mu);
		return;
	}
	if (t->dma) {
		kvt_plan_fini(&t->plan);
		if (t->mr)
			kvt_dma_mem_unregister(t->dma, t->mr);
		if (kvt_dma_close_within(t->dma, left_ns(deadline))) {
			/* (no ticket of ours was left: nothing should remain) */
			tier_error(&t->env, "close: the DMA handle had copies left; kept");
		}
	}
	kvt__l3c_free(t->l3c);
	kvt_seg_detach(t->seg);
	free(t->bases);
	free(t);
}

/* ---- for kvtierd (tier/kvt_tier_int.h; not exported by libkvtier.so) ---- */

kvt_seg *kvt__tier_seg(const kvt_tier *t)
{
	return t ? t->seg : NULL;
}

const char *kvt__tier_segment_dir(const kvt_tier *t)
{
	return t && t->env.segment_dir[0] ? t->env.segment_dir : NULL;
}
