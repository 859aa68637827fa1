/* lmc.c - kvtierd's LMCache front end (lmc.h).
 *
 * What it is.  `lmcache server`'s multiprocess protocol (LMCache 0.5.6:
 * a ZeroMQ ROUTER, msgpack frames, lmc_wire.h) answered from the node's
 * kvtier segment, in LMCache's "lmcache_driven" mode: the server does the
 * copies between the engine's KV blocks and its own memory.  An engine
 * whose LMCache client speaks that protocol (vLLM's LMCacheMPConnector,
 * SGLang's and ATOM's lmcache_mp) then uses the segment -- its chunks,
 * the disk tier and the L3 below -- with no change but the server it
 * points at.
 *
 * Mapping onto kvtier.
 *  * Chunks: LMCache's chunk is the segment's chunk (get_chunk_size
 *    answers chunk_tokens).  A chunk's key is kvt_hash_tokens' chain of the
 *    request's token ids under a parent of our own: XXH3-128 of the model
 *    name, the world size, the cache salt, the clear() epoch and the
 *    layout tag (below).  So engines with another model name, salt or
 *    layout never share a chunk, and a kvtier connector's engine on the
 *    same segment (whose parent is the fingerprint's) never meets these.
 *  * The layout tag: what a chunk's bytes mean -- the tensors' kind (HND,
 *    NHD: vLLM's 5-D [2, blocks, ., ., head_size]; MLA: [blocks, block,
 *    head_size]), dtype, block size, planes and bytes per token.  The first
 *    registration of a (model, world) fixes it for this run; another
 *    layout under the same name is refused, named.  The tag enters the
 *    keys, so a kvtierd restarted with another engine behind it never
 *    serves the old engine's bytes as the new one's.
 *  * The KV cache: each tensor is a cpu_shm descriptor (a POSIX shm name
 *    and a view).  The front end maps it (the same physical pages as the
 *    engine's), and describes it to kvtier as one group of planes: per
 *    layer the K and the V plane (5-D) or the one latent plane (MLA), each
 *    a run of blocks of `block_stride` bytes.  The segment's --group line
 *    must be that group (LAYERS = planes, BYTES = one plane's bytes per
 *    token); a registration that does not fit is refused with the line
 *    that would.  Only names under /lmcache_ are mapped (a client can name
 *    no segment nor another program's memory), only objects of kvtierd's
 *    own user (the protocol names no user: a root kvtierd would map any
 *    user's KV for any client), and only when the object is as large as
 *    the view claims (a view past its end would be SIGBUS).
 *  * GPU KV caches (cuda: torch's shared storage, the cudaMalloc block's
 *    handle behind a version byte and 'c', the storage's offset in the
 *    block; cuda_raw: a driver handle, an offset, a length): the device
 *    is the one whose UUID the metadata names (kvtierd's ordinals need not
 *    be the engine's), the engine's allocation is opened there
 *    (kvt_dma_ipc_mem_open, in the primary context every cuda handle of
 *    this process shares), and the view is checked against the
 *    allocation's size as the driver reports it -- never against the
 *    client's word alone.  The rank handle copies with the cuda backend.
 *    ROCm engines send the same descriptors (torch's ROCm build), with
 *    HIP's handles inside: the UUID finds the driver too -- the cuda
 *    backend's devices first, then the hsa backend's (HIP's UUIDs, its
 *    IPC through the HIP runtime, SDMA copies; dma/src/hsa.c "IPC").
 *    Ordering, per registration a fence (kvt_dma_fence): before a store's
 *    or retrieve's copies, the engine's event (recorded on its stream
 *    before it asked) is waited for on the fence's stream, and the rank
 *    handle's copies are ordered after that stream (kvt_order_after) --
 *    on the device, kvtierd's thread never blocks on it.  The answer's
 *    completion event is the fence's interprocess event, recorded when
 *    the copies have completed (pend_finish, after kvt_poll), on a stream
 *    that waits for nothing: the engine's wait on it cannot run ahead of
 *    them.  LMCache's isolated-IPC events (timeline semaphores: a word of
 *    IPC memory, "!B64sQQ", TIMELINE_BYTES) the same way: a wait for the
 *    engine's value on the fence's stream (kvt_dma_fence_wait_value), and
 *    the answer a value of the fence's own word, in the form the request
 *    came in.  Why not record it behind the copies on the device and answer
 *    at once, as LMCache's server does: kvtier queues a save or load whose
 *    in-flight slots are full and submits it later, so at answer time the
 *    copies may not be on any stream yet; the cost is the engine thread's
 *    wait for a retrieve's answer.
 *  * Ranks: a registration is one engine rank's KV.  At its first store
 *    or retrieve (register_kv_cache carries no rank; the keys' worker_id
 *    does) the front end opens a kvtier RANK handle for it, rank worker_id,
 *    in the first instance whose rank entry is free, with the host DMA
 *    backend over the mapped tensors (the cuda backend over GPU ones),
 *    and registers them.  Copies are
 *    kvtier's: kvt_save / kvt_load and their ops, polled by this thread.
 *  * Lookups and locks: a lookup is kvt_lookup_ex with PROMOTE (the disk
 *    tier and the L3 answer it too): its hits are pinned under a lease,
 *    which is LMCache's "lookup locks" (over a world of one, the replicated
 *    layout, a lease for each of the key's num_kv_readers: lock_readers).
 *    While chunks after the hits are on their way up (pending),
 *    query_prefetch_status answers nil (LMCache's "still running") and the
 *    lookup is asked again each ~20 ms, for at most 2 s.  A retrieve loads
 *    from its request's (next) lease; when every rank has loaded, kvtier
 *    releases it.  free_lookup_locks covering the whole
 *    hit, end_session, the client's disconnect and a TTL (300 s, LMCache's
 *    read TTL) release it too.  A retrieve whose request has no lease
 *    (another server's lookup, a late rank) looks up itself and releases
 *    after its load.  A miss answers ok=false: the engine recomputes.
 *  * A client that goes away: ZeroMQ's ROUTER does not say which identity
 *    a disconnect was; the socket monitor says which fd, and each message's
 *    ZMQ_SRCFD says which fd an identity speaks on.  The monitor is drained
 *    after a message is read and before its fd is recorded: with one I/O
 *    thread, a disconnect of an fd is queued before any message of a new
 *    connection that reuses the fd, so a new client is never taken for
 *    the old one.  Its sessions' leases are released and its registrations
 *    closed (after their copies).
 *  * Pings: a worker's ping from an instance with no registration here
 *    (kvtierd restarted, a connection that came back under a new
 *    identity) is answered false once, then true: LMCache's client
 *    registers again on that edge (ping_answer says why).
 *  * Refusals: the protocol has no error reply (LMCache's own server stays
 *    silent and the client waits out its timeout, 300 s).  kvtierd answers
 *    what it refuses with an operation frame that is the reason
 *    ("kvtierd: ..."): LMCache's client raises at once, ValueError
 *    "Response operation 'kvtierd: ...' does not match request 'lookup'".
 *    A frame count other than 0.5.6's for the operation, an operation this
 *    version does not have, an older client's key (no num_kv_readers) are
 *    refused so, naming the protocol spoken: a client of another version
 *    is refused at its first message, never half-served.
 *  * Engine-driven transfers (vLLM's default for CPU tensors) are refused
 *    naming the setting that selects lmcache_driven.
 *  * The tensors kvtierd reads: vLLM's per-layer caches as LMCache's vLLM
 *    adapter registers them -- [2, blocks, heads, block, head_size] (HND;
 *    NHD swaps heads and block), vLLM 0.32 CPU's [blocks, heads, block,
 *    2 x head_size] (K and V in one row: one plane), MLA's [blocks, block,
 *    head_size].  SGLang's MHA pools as its LMCache connector registers
 *    them (engine "sglang", kv_list_layout "k_v", its page size in the
 *    hints): every layer's K then every layer's V, each [token slots,
 *    heads, head_dim], a page of slots a block (the client's block id is
 *    slot / page); their 3-D shape would read as MLA's, so the engine
 *    type and both hints decide.  SGLang's MLA pools as its unified
 *    connector registers them (kv_list_layout "unified", 3-D): per layer
 *    a [pages, page, width] view of MLATokenToKVPool's [slots, 1, width],
 *    and ATOM's MLA latent caches (engine "atom", no hints): per layer
 *    [blocks, block, width] -- both as vLLM's MLA (the same bytes, the
 *    same tag; the connectors name one KV world, every TP rank reads).
 *    Contiguous views only.
 *  * Index caches: DeepSeek V3.2 / GLM-5 engines register their DSA
 *    indexer's cache beside the MLA latent -- ATOM a [blocks, block,
 *    width] cache a layer, SGLang's unified connector its page-native
 *    [pages, bytes] buffers (as [pages, 1, 1, bytes] views, a kernel group
 *    of their own with the latent's block ids).  The tensors of one other
 *    layout than kv_cache[0]'s, with its block, are a second kvtier group
 *    (the segment's second --group: LAYERS:BYTES a token), loaded and
 *    saved with the latent's block table; anything else that differs is
 *    refused, named.
 *
 * Threads.  One thread owns the socket, every kvtier handle (one at a
 * time, as kvtier.h asks) and every table; lmc_counts reads atomics.
 *
 * Not here yet: cuda_vmm descriptors, PyTorch's expandable segments;
 * hybrid models (several engine groups, sliding-window or
 * recurrent ones: a vLLM engine runs with its hybrid KV cache manager off
 * instead, HYBRID_OFF); the engine-driven SHM pool.  Each is refused by
 * name.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <xxhash.h>
#include <zmq.h>

#include "kvtier.h"
#include "kvt_core.h"
#include "kvt_dma.h"
#include "kvt_tier_int.h"
#include "lmc.h"
#include "lmc_wire.h"

#define MAX_PEERS   256
#define MAX_GPUS    64
#define N_GPU_BACKENDS 2
static const char *const GPU_BACKENDS[N_GPU_BACKENDS] = { "cuda", "hsa" };
#define MAX_REGS    128
#define MAX_SESS    4096
#define MAX_PEND    1024
#define MAX_WAIT    256
#define MAX_NS      64
#define MAX_FRAMES  16
#define MAX_TOLD    64
#define LEASE_TTL_NS   (300ull * 1000000000ull)
#define SESS_TTL_NS    (600ull * 1000000000ull)
#define PENDING_NS     (2ull * 1000000000ull)
#define RELOOK_NS      (20ull * 1000000ull)
#define SHM_PREFIX     "/lmcache_"

static const char stub_handle[] = "stub_ipc_handle";

struct ident {
	uint32_t n;
	unsigned char b[256];
};

static int ident_eq(const struct ident *a, const struct ident *b)
{
	return a->n == b->n && !memcmp(a->b, b->b, a->n);
}

struct small {
	uint32_t n;
	unsigned char b[80];
};

/* Where a reply goes: the peer and the request's uid and op frames. */
struct route {
	struct ident id;
	struct small uid, op;
};

struct peer {
	int used, fd;
	int foreign;                 /* another protocol version: refused */
	struct ident id;
	char reason[512];
};

struct layout {
	char tag[200];               /* both groups' (the keys' parent has it) */
	uint32_t planes_per_tensor, bpt, bs;
	int replicated;
	/* The index cache's group beside an MLA latent (DeepSeek V3.2, GLM-5:
	 * ATOM's per-layer index caches, SGLang's DSA indexer pages): its
	 * planes and bytes per token; 0 planes without one. */
	uint32_t side_planes, side_bpt;
};

/* A (model, world)'s layout, kept after its registrations go. */
struct ns {
	int used;
	char model[LMC_MAX_NAME];
	uint32_t world, epoch;
	struct layout lay;
};

struct map {
	char name[LMC_MAX_NAME];
	void *addr;
	size_t len;
};

struct reg {
	int used, peer, dying;
	uint64_t iid;
	int ns;
	uint32_t n_maps, n_planes, busy;
	struct map *maps;
	uint64_t *bases;             /* n_planes, then lay.side_planes */
	uint64_t block_stride, n_blocks;
	uint64_t side_stride, side_blocks;
	struct layout lay;
	kvt_tier *t;
	int rank;
	/* GPU descriptors (cuda, cuda_raw): the device, the engine's
	 * allocations opened here (one opening each tensor: the driver counts
	 * them), and the fence that orders the copies after the engine's
	 * events and answers with an event of ours */
	int gpu;                     /* ordinal, -1: cpu_shm */
	int gpu_be;                  /* its driver: GPU_BACKENDS' index */
	uint64_t *ipc_base;
	uint32_t n_ipc;
	kvt_dma_fence *fence;
};

enum { S_FREE, S_RUNNING, S_READY, S_TAKEN };

struct sess {
	int state, peer;
	char rid[LMC_MAX_NAME];
	kvt_lease_id lease;          /* the next retrieve's */
	kvt_lease_id *more;          /* one world: a lease for each further reader */
	uint32_t n_more, readers;
	uint32_t hits, n_keys;
	kvt_key *keys;
	uint64_t t0, deadline, next_look, t_lease;
};

struct pend {
	int used, reg, retrieve;
	int timeline;                   /* answer with a timeline semaphore */
	char rid[LMC_MAX_NAME];         /* the request's, for the log */
	struct route rt;
	kvt_op *ops;
	uint32_t n_ops, chunks;
	int ok;
	kvt_lease_id release;
};

struct waiter {
	int used;
	struct route rt;
	char rid[LMC_MAX_NAME];
	uint64_t deadline;
};

struct lmc_front {
	struct lmc_cfg cfg;
	char segment[80], segment_dir[4096], model[1024];
	void *ctx, *sock, *mon;
	pthread_t thread;
	atomic_int stop;
	kvt_tier *look;              /* lookups and releases (a client handle) */
	uint32_t world, chunk, n_instances, lease_cap, n_groups;
	struct kvt_layer_group seg_groups[KVT_MAX_GROUPS];
	int mode_replicated;
	struct peer peers[MAX_PEERS];
	struct reg regs[MAX_REGS];
	struct sess sess[MAX_SESS];
	struct pend pend[MAX_PEND];
	struct waiter wait[MAX_WAIT];
	struct ns ns[MAX_NS];
	/* the GPU drivers (GPU_BACKENDS), for GPU descriptors: a handle per
	 * device used (opening the engines' handles and the fences), and one
	 * unbound, for the devices' UUIDs; opened at the first GPU
	 * registration (a driver that cannot be opened is not tried again:
	 * its reason is kept) */
	kvt_dma *gpu_any[N_GPU_BACKENDS], *gpu[N_GPU_BACKENDS][MAX_GPUS];
	char gpu_fail[N_GPU_BACKENDS][256]; /* a driver that did not open: why */
	int cur_peer;                /* the request's peer */
	uint64_t told[MAX_TOLD];     /* instances a ping was answered false (ring) */
	uint8_t told_set[MAX_TOLD];
	uint32_t n_told;
	char why[512];
	_Atomic uint64_t n_requests, n_refused, n_regs, n_lookups, n_hit_chunks;
	_Atomic uint64_t n_stored, n_retrieved, n_retrieve_misses, n_disconnects;
	_Atomic uint32_t n_clients, n_sessions, n_leases;
};

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void flog(lmc_front *f, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void flog(lmc_front *f, int level, const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (f->cfg.log)
		f->cfg.log(level, msg, f->cfg.log_arg);
	else
		fprintf(stderr, "kvtierd lmcache: %s\n", msg);
}

static int refuse_why(lmc_front *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int refuse_why(lmc_front *f, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(f->why, sizeof(f->why), fmt, ap);
	va_end(ap);
	return -1;
}

/* ---- replies ---- */

static int send_frame(lmc_front *f, const void *p, size_t n, int more)
{
	return zmq_send(f->sock, p, n, (more ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT) < 0 ? -1 : 0;
}

/* [identity, uid, op] + the payload when given (n >= 0). */
static void reply(lmc_front *f, const struct route *rt, const void *payload, int n)
{
	if (send_frame(f, rt->id.b, rt->id.n, 1) ||
	    send_frame(f, rt->uid.b, rt->uid.n, 1) ||
	    send_frame(f, rt->op.b, rt->op.n, n >= 0)) {
		if (zmq_errno() != EHOSTUNREACH)
			flog(f, KVT_LOG_LEVEL_WARN, "a reply could not be sent: %s",
			     zmq_strerror(zmq_errno()));
		return;
	}
	if (n >= 0 && send_frame(f, payload, (size_t)n, 0))
		flog(f, KVT_LOG_LEVEL_WARN, "a reply's payload could not be sent: %s",
		     zmq_strerror(zmq_errno()));
}

static void reply_none(lmc_front *f, const struct route *rt)
{
	reply(f, rt, NULL, -1);
}

static void reply_uint(lmc_front *f, const struct route *rt, uint64_t v)
{
	unsigned char b[16];
	reply(f, rt, b, lmc_enc_uint(b, sizeof(b), v));
}

static void reply_nil(lmc_front *f, const struct route *rt)
{
	unsigned char b[4];
	reply(f, rt, b, lmc_enc_nil(b, sizeof(b)));
}

/* LMCache's timeline-semaphore event handle (its isolated-IPC mode, for
 * containers that share no /dev/shm: CUDA's event handles do not resolve
 * there, its memory handles do): struct "!B64sQQ" -- version 1, the
 * semaphore allocation's CUDA IPC memory handle, the word's offset (8-byte
 * aligned, below 4096 words), the value to reach. */
#define TIMELINE_BYTES 81
#define TIMELINE_WORDS 4096

static uint64_t be64(const uint8_t *p)
{
	uint64_t v = 0;
	for (int i = 0; i < 8; i++)
		v = v << 8 | p[i];
	return v;
}

static void put_be64(uint8_t *p, uint64_t v)
{
	for (int i = 7; i >= 0; i--, v >>= 8)
		p[i] = (uint8_t)v;
}

/* A store's or retrieve's answer: (completion event, ok).  The event is
 * LMCache's CPU stub for cpu_shm registrations; for GPU ones an IPC event
 * of the registration's fence (timeline: a value of its semaphore word),
 * recorded now -- after the copies, which have completed (pend_finish) or
 * never started -- so the engine's wait on it never runs ahead of them.  A
 * fence that fails answers an empty handle and ok=false, as LMCache's
 * server does for an unknown instance. */
static void reply_handle(lmc_front *f, const struct route *rt, int ok, struct reg *r,
			 int timeline)
{
	unsigned char b[160], ev[TIMELINE_BYTES];

	if (r && r->fence) {
		uint64_t off = 0, val = 0;
		int e = timeline ? kvt_dma_fence_signal_value(r->fence, ev + 1, &off, &val) :
			kvt_dma_fence_signal(r->fence, ev);
		if (e)
			flog(f, KVT_LOG_LEVEL_WARN, "the completion event of instance %llu: %s: "
			     "ok=false", (unsigned long long)r->iid, kvt_dma_last_error());
		if (timeline) { /* "!B64sQQ" */
			ev[0] = 1;
			put_be64(ev + 1 + KVT_DMA_IPC_BYTES, off);
			put_be64(ev + 9 + KVT_DMA_IPC_BYTES, val);
		}
		reply(f, rt, b, lmc_enc_handle_ok(b, sizeof(b), ev, e ? 0 : timeline ?
						  TIMELINE_BYTES : KVT_DMA_IPC_BYTES, ok && !e));
		return;
	}
	reply(f, rt, b, lmc_enc_handle_ok(b, sizeof(b), stub_handle, sizeof(stub_handle) - 1, ok));
}

/* The refusal: the operation frame is the reason (see the design comment). */
static void refuse(lmc_front *f, const struct route *rt, const char *op)
{
	char msg[768];
	unsigned char b[800];
	struct route r = *rt;
	int n;

	/* logged before the reply leaves: the operator's line is there when
	 * the client's error is */
	atomic_fetch_add(&f->n_refused, 1);
	flog(f, KVT_LOG_LEVEL_WARN, "refused %s: %s", op, f->why);
	snprintf(msg, sizeof(msg), "kvtierd: %s [kvtierd speaks %s]", f->why, LMC_PROTOCOL);
	n = lmc_enc_str(b, sizeof(b), msg);
	if (n < 0 || (size_t)n > sizeof(r.op.b)) {
		/* longer than an op frame we keep: send it as it is */
		if (send_frame(f, rt->id.b, rt->id.n, 1) || send_frame(f, rt->uid.b, rt->uid.n, 1) ||
		    send_frame(f, b, n < 0 ? 0 : (size_t)n, 0))
			flog(f, KVT_LOG_LEVEL_WARN, "a refusal could not be sent");
	} else {
		memcpy(r.op.b, b, (size_t)n);
		r.op.n = (uint32_t)n;
		reply_none(f, &r);
	}
}

/* ---- tables ---- */

static int find_reg(lmc_front *f, uint64_t iid)
{
	for (int i = 0; i < MAX_REGS; i++)
		if (f->regs[i].used && !f->regs[i].dying && f->regs[i].iid == iid)
			return i;
	return -1;
}

static struct sess *find_sess(lmc_front *f, const char *rid)
{
	for (int i = 0; i < MAX_SESS; i++)
		if (f->sess[i].state != S_FREE && !strcmp(f->sess[i].rid, rid))
			return &f->sess[i];
	return NULL;
}

static int find_ns(lmc_front *f, const char *model, uint32_t world)
{
	for (int i = 0; i < MAX_NS; i++)
		if (f->ns[i].used && f->ns[i].world == world && !strcmp(f->ns[i].model, model))
			return i;
	return -1;
}

static void lease_release(lmc_front *f, kvt_lease_id *l)
{
	if (*l) {
		int r = kvt_release(f->look, *l);
		if (r && r != -EALREADY && r != -ESTALE)
			flog(f, KVT_LOG_LEVEL_WARN, "releasing a lease: %s", kvt_last_error());
		atomic_fetch_sub(&f->n_leases, 1);
	}
	*l = 0;
}

/* Every lock the session's lookup holds (its lease, the further readers'). */
static void sess_unlock(lmc_front *f, struct sess *s)
{
	lease_release(f, &s->lease);
	while (s->n_more)
		lease_release(f, &s->more[--s->n_more]);
}

/* The session's lease has gone to a reader (or is dead): the next
 * reader's is the next of lock_readers'. */
static void sess_next(struct sess *s)
{
	s->lease = s->n_more ? s->more[--s->n_more] : 0;
}

static void sess_drop(lmc_front *f, struct sess *s)
{
	sess_unlock(f, s);
	free(s->more);
	free(s->keys);
	memset(s, 0, sizeof(*s));
	atomic_fetch_sub(&f->n_sessions, 1);
}

static struct sess *sess_new(lmc_front *f, const char *rid)
{
	struct sess *s = find_sess(f, rid), *old = NULL;

	if (s) {
		sess_unlock(f, s);
		free(s->keys);
		s->keys = NULL;
		return s;
	}
	for (int i = 0; i < MAX_SESS; i++) {
		if (f->sess[i].state == S_FREE) {
			s = &f->sess[i];
			break;
		}
		if (!old || f->sess[i].t0 < old->t0)
			old = &f->sess[i];
	}
	if (!s) { /* full: the oldest goes (its lease too) */
		sess_drop(f, old);
		s = old;
	}
	atomic_fetch_add(&f->n_sessions, 1);
	snprintf(s->rid, sizeof(s->rid), "%s", rid);
	return s;
}

static void reg_close(lmc_front *f, struct reg *g)
{
	if (g->t)
		kvt_close(g->t);
	kvt_dma_fence_close(g->fence);
	for (uint32_t i = 0; i < g->n_ipc; i++)
		kvt_dma_ipc_mem_close(f->gpu[g->gpu_be][g->gpu], g->ipc_base[i]);
	free(g->ipc_base);
	for (uint32_t i = 0; i < g->n_maps; i++)
		munmap(g->maps[i].addr, g->maps[i].len);
	free(g->maps);
	free(g->bases);
	memset(g, 0, sizeof(*g));
	atomic_fetch_sub(&f->n_clients, 1);
}

/* ---- keys ---- */

static void parent_key(lmc_front *f, int ns, const char *salt, kvt_key *out)
{
	char buf[LMC_MAX_NAME * 2 + 256];
	const struct ns *n = &f->ns[ns];
	int len = snprintf(buf, sizeof(buf), "lmcache-mp%c%s%c%u%c%s%c%u%c%s", 0, n->model, 0,
			   n->world, 0, salt, 0, n->epoch, 0, n->lay.tag);
	XXH128_hash_t h = XXH3_128bits(buf, (size_t)len);
	out->lo = h.low64;
	out->hi = h.high64;
}

/* Keys of the first n chunks of the key's tokens; NULL (why set) when
 * out of memory. */
static kvt_key *chunk_keys(lmc_front *f, int ns, const struct lmc_key *k, uint32_t n)
{
	kvt_key parent, *keys = malloc((n ? n : 1) * sizeof(*keys));
	if (!keys) {
		refuse_why(f, "out of memory");
		return NULL;
	}
	parent_key(f, ns, k->salt, &parent);
	if (n && kvt_hash_tokens(f->look, k->tokens, (size_t)n * f->chunk, &parent, keys, n) !=
		     (int)n) {
		refuse_why(f, "hashing the token ids: %s", kvt_last_error());
		free(keys);
		return NULL;
	}
	return keys;
}

/* ---- register_kv_cache ---- */

static void told_forget(lmc_front *f, uint64_t iid);

/* A vLLM engine whose hybrid KV cache manager is off (LMCache's connector
 * is SupportsHMA, so vLLM keeps it on) lays a model that mixes
 * sliding-window and full layers out whole in one group -- a
 * sliding-window layer's blocks all real (vLLM's
 * _promote_local_kv_cache_specs): kvtierd keeps that (measured: a
 * gemma2-shaped engine, refused with the manager on, stored its chunks
 * with it off).  A model of sliding-window layers alone stays a
 * sliding-window group either way. */
#define HYBRID_OFF "; a vLLM engine of a model mixing sliding-window and full layers: " \
	"start it with --disable-hybrid-kv-cache-manager (every layer kept whole, one group)"

static int tensor_layout(lmc_front *f, const struct lmc_register *g, const struct lmc_tensor *t,
			 uint32_t i, struct layout *lay, uint64_t *block_stride,
			 uint64_t *n_blocks, uint64_t *plane_stride)
{
	uint32_t isz = lmc_dtype_size(t->dtype);
	const char *kind;
	uint64_t inner, bs;
	int sglang, unified;

	if (strcmp(t->type, "cpu_shm") && strcmp(t->type, "cuda") && strcmp(t->type, "cuda_raw"))
		return refuse_why(f, "kv_cache[%u] is a '%s' descriptor: kvtierd serves cpu_shm, "
				  "cuda and cuda_raw ones (cuda_vmm, LMCache's use_vmm_api, is not "
				  "built: its POSIX fds travel out of band, a channel LMCache 0.5.6's "
				  "own server lacks too; start the engine without use_vmm_api)", i,
				  t->type);
	if (strcmp(t->type, g->tensors[0].type))
		return refuse_why(f, "kv_cache[%u] is a '%s' descriptor, kv_cache[0] a '%s' one", i,
				  t->type, g->tensors[0].type);
	if (!isz)
		return refuse_why(f, "kv_cache[%u]: dtype '%s' is not one kvtierd knows", i, t->dtype);
	/* contiguous: stride[d] = prod(shape[d+1:]) */
	inner = 1;
	for (int d = (int)t->ndim - 1; d >= 0; d--) {
		if (t->stride[d] != inner && t->shape[d] > 1)
			return refuse_why(f, "kv_cache[%u]: not a contiguous tensor (stride[%d] is "
					  "%llu, %llu expected)", i, d,
					  (unsigned long long)t->stride[d],
					  (unsigned long long)inner);
		inner *= t->shape[d];
		if (inner > (1ull << 40))
			return refuse_why(f, "kv_cache[%u]: %llu elements", i,
					  (unsigned long long)inner);
	}
	sglang = !strcmp(g->engine, "sglang");
	unified = !strcmp(g->kv_list_layout, "unified");
	if (sglang && unified && t->ndim == 4 && t->shape[1] == 1 && t->shape[2] == 1 && i &&
	    g->tensors[0].ndim == 3) {
		/* SGLang's DSA indexer pages beside its MLA pool (the unified
		 * connector's [pages, 1, 1, bytes] views of DSATokenToKVPool's
		 * page-native [pages, bytes] buffers): a page's row holds its
		 * tokens' index keys and scales, opaque; a page is the latent's
		 * page (kv_cache[0]'s), the block of a group of its own. */
		kind = "SGL-IDX";
		bs = g->tensors[0].shape[1];
		lay->planes_per_tensor = 1;
		*n_blocks = t->shape[0];
		*block_stride = t->shape[3] * isz;
		*plane_stride = 0;
		lay->replicated = 1;
	} else if (sglang && !(unified && t->ndim == 3)) {
		/* SGLang's MHA pools as its LMCache clients hand them: 2 x layers
		 * tensors (every layer's K, then every layer's V), token-major; a
		 * page of slots is a block (the client's block id is slot / page).
		 * The "k_v" connector sends each pool [token slots, heads,
		 * head_dim] with the page in the hints; the "unified" one (SGLang
		 * 0.5.23's LMCacheUnifiedRadixCache) a view [pages, page, heads,
		 * head_dim].  The bytes of a page are the same: one tag.  (Its MLA
		 * pool, as the unified connector hands it -- per layer a [pages,
		 * page, width] view of MLATokenToKVPool's [slots, 1, width] -- is
		 * a vLLM MLA cache's bytes, read as one below, kept once for every
		 * rank: the connector's key names one KV world and num_kv_readers
		 * the TP ranks.) */
		uint64_t page = g->hint_tokens_per_block;
		if (t->ndim == 4 && !strcmp(g->kv_list_layout, "unified")) {
			if (page && page != t->shape[1])
				return refuse_why(f, "kv_cache[%u]: pages of %llu slots, the hints' "
						  "tokens_per_block %llu", i,
						  (unsigned long long)t->shape[1],
						  (unsigned long long)page);
			page = t->shape[1];
			*n_blocks = t->shape[0];
		} else if (t->ndim == 3 && !strcmp(g->kv_list_layout, "k_v")) {
			*n_blocks = page ? t->shape[0] / page : 0;
		} else {
			return refuse_why(f, "kv_cache[%u]: a %u-D tensor in an SGLang '%s' "
					  "registration: kvtierd copies SGLang's MHA pools ([token "
					  "slots, heads, head_dim], or [pages, page, heads, head_dim] "
					  "unified) and MLA pools ([pages, page, width] unified); "
					  "hybrid pools are not built yet", i, t->ndim,
					  g->kv_list_layout);
		}
		if (page > f->chunk) /* before page x row: that product stays in 64 bits */
			return refuse_why(f, "kv_cache[%u]: pages of %llu slots, more than the "
					  "segment's chunk of %u", i, (unsigned long long)page,
					  f->chunk);
		kind = "SGL-KV";
		bs = page;
		lay->planes_per_tensor = 1;
		*block_stride = page * t->shape[t->ndim - 2] * t->shape[t->ndim - 1] * isz;
		*plane_stride = 0;
		lay->replicated = 0;
	} else if (!strcmp(g->engine, "atom") && t->ndim != 3) {
		return refuse_why(f, "kv_cache[%u]: a %u-D tensor: kvtierd copies ATOM's MLA "
				  "latent caches, [blocks, block, width]", i, t->ndim);
	} else if (t->ndim == 5 && t->shape[0] == 2) {
		const char *hint = g->kv_layout[0] ? g->kv_layout : "HND";
		if (strcmp(hint, "HND") && strcmp(hint, "NHD"))
			return refuse_why(f, "layout_hints.kv_layout '%s': kvtierd copies vLLM's "
					  "per-layer HND or NHD caches", hint);
		kind = hint;
		bs = !strcmp(hint, "HND") ? t->shape[3] : t->shape[2];
		lay->planes_per_tensor = 2;
		*n_blocks = t->shape[1];
		*block_stride = t->shape[2] * t->shape[3] * t->shape[4] * isz;
		*plane_stride = t->shape[1] * *block_stride;
		lay->replicated = 0;
	} else if (t->ndim == 4) {
		/* vLLM's CPU attention (0.32): [blocks, heads, block, 2 x head_size],
		 * K and V side by side in a token's row (HND), or [blocks, block,
		 * heads, 2 x head_size] (NHD): one plane, a block contiguous */
		const char *hint = g->kv_layout[0] ? g->kv_layout : "HND";
		if (strcmp(hint, "HND") && strcmp(hint, "NHD"))
			return refuse_why(f, "layout_hints.kv_layout '%s': kvtierd copies vLLM's "
					  "per-layer HND or NHD caches", hint);
		kind = !strcmp(hint, "HND") ? "HND4" : "NHD4";
		bs = !strcmp(hint, "HND") ? t->shape[2] : t->shape[1];
		lay->planes_per_tensor = 1;
		*n_blocks = t->shape[0];
		*block_stride = t->shape[1] * t->shape[2] * t->shape[3] * isz;
		*plane_stride = 0;
		lay->replicated = 0;
	} else if (t->ndim == 3) {
		kind = "MLA";
		bs = t->shape[1];
		lay->planes_per_tensor = 1;
		*n_blocks = t->shape[0];
		*block_stride = t->shape[1] * t->shape[2] * isz;
		*plane_stride = 0;
		lay->replicated = 1;
	} else {
		char sh[96] = "";
		for (uint32_t d = 0, o = 0; d < t->ndim && o < sizeof(sh) - 24; d++)
			o += (uint32_t)snprintf(sh + o, sizeof(sh) - o, "%s%llu", d ? ", " : "",
					       (unsigned long long)t->shape[d]);
		return refuse_why(f, "kv_cache[%u]: a %u-D tensor [%s]: kvtierd copies vLLM's "
				  "per-layer [2, blocks, ., ., head_size], [blocks, ., ., 2 x "
				  "head_size] and MLA [blocks, block, head_size] caches", i, t->ndim,
				  sh);
	}
	if (!bs || !*n_blocks || *block_stride % bs)
		return refuse_why(f, "kv_cache[%u]: an empty shape, or rows not whole bytes a "
				  "token", i);
	if (bs > f->chunk) /* also keeps it in 32 bits: a block of 2^32 would be 0 */
		return refuse_why(f, "kv_cache[%u]: blocks of %llu tokens, more than the segment's "
				  "chunk of %u", i, (unsigned long long)bs, f->chunk);
	lay->bs = (uint32_t)bs;
	if (*block_stride / bs > (1u << 20))
		return refuse_why(f, "kv_cache[%u]: %llu bytes per token in a plane", i,
				  (unsigned long long)(*block_stride / bs));
	lay->bpt = (uint32_t)(*block_stride / bs);
	snprintf(lay->tag, sizeof(lay->tag), "%s/%s/%u/%u/%u", kind, t->dtype, lay->bs,
		 lay->bpt, (unsigned)(t->ndim >= 4 && strcmp(kind, "SGL-KV") ?
				      t->shape[t->ndim - 3] : 0));
	return 0;
}

/* The bytes from a tensor's storage start to its view's last element's
 * end: what the storage must hold (shapes and strides are bounded by the
 * decoder; 128 bits keep the products exact). */
static unsigned __int128 view_bytes(const struct lmc_tensor *t)
{
	unsigned __int128 span = t->storage_offset + 1;

	for (uint32_t d = 0; d < t->ndim; d++)
		span += (unsigned __int128)(t->shape[d] - 1) * t->stride[d];
	return span * lmc_dtype_size(t->dtype);
}

/* metadata.device_uuid (torch's str(props.uuid): 8-4-4-4-12 hex digits,
 * perhaps "GPU-" before them, as nvidia-smi writes it) as 16 bytes */
static int parse_uuid(const char *s, uint8_t out[16])
{
	int n = 0;

	if (!strncmp(s, "GPU-", 4))
		s += 4;
	for (; *s && n < 32; s++) {
		int v = *s >= '0' && *s <= '9' ? *s - '0' : *s >= 'a' && *s <= 'f' ? *s - 'a' + 10 :
			*s >= 'A' && *s <= 'F' ? *s - 'A' + 10 : *s == '-' ? -2 : -1;
		if (v == -1)
			return -1;
		if (v == -2)
			continue;
		out[n / 2] = (uint8_t)(n % 2 ? out[n / 2] | v : v << 4);
		n++;
	}
	return n == 32 && !*s ? 0 : -1;
}

/* The device a GPU descriptor names and its driver, its handle opened
 * (the drivers loaded at the first).  torch's "cuda" descriptors are the
 * same on ROCm, with HIP's handles inside: the device's UUID says whose
 * they are -- the driver that has a device of that UUID (cuda: the
 * driver's UUID; hsa: HIP's, see dma/src/hsa.c "IPC").  The ordinal, or
 * -1 (why set). */
static int gpu_of(lmc_front *f, const struct lmc_tensor *t, uint32_t i, int *be)
{
	static const char *const name[N_GPU_BACKENDS] = { "CUDA", "ROCm" };
	struct kvt_dma_config c;
	char why[N_GPU_BACKENDS][256];
	uint8_t u[16];
	int dev = -1, opened = 0;

	if (parse_uuid(t->device_uuid, u))
		return refuse_why(f, "kv_cache[%u]: device_uuid '%s' is not a device UUID", i,
				  t->device_uuid);
	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.flags = KVT_DMA_F_QUIET;
	c.max_inflight = 1; /* these handles open memory and events; ranks copy */
	for (*be = 0; *be < N_GPU_BACKENDS; ++*be) {
		c.backend = GPU_BACKENDS[*be];
		c.device = -1;
		if (!f->gpu_any[*be] && !f->gpu_fail[*be][0] &&
		    kvt_dma_open(&c, &f->gpu_any[*be]))
			snprintf(f->gpu_fail[*be], sizeof(f->gpu_fail[0]), "%s: %s", name[*be],
				 kvt_dma_last_error());
		if (!f->gpu_any[*be]) {
			snprintf(why[*be], sizeof(why[0]), "%s", f->gpu_fail[*be]);
			continue;
		}
		opened++;
		dev = kvt_dma_device_of_uuid(f->gpu_any[*be], u);
		if (dev >= 0)
			break;
		snprintf(why[*be], sizeof(why[0]), "%s", kvt_dma_last_error());
	}
	if (!opened)
		return refuse_why(f, "kv_cache[%u]: a GPU descriptor, and kvtierd cannot use a GPU "
				  "driver here (%s; %s)", i, why[0], why[1]);
	if (dev < 0)
		return refuse_why(f, "kv_cache[%u]: device %s: %s%s%s (kvtierd must see the "
				  "engine's GPUs: CUDA_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES)", i,
				  t->device_uuid, f->gpu_any[0] ? why[0] : "",
				  opened > 1 ? "; " : "", f->gpu_any[1] ? why[1] : "");
	if (dev >= MAX_GPUS)
		return refuse_why(f, "kv_cache[%u]: device %d: too many devices", i, dev);
	c.device = dev;
	if (!f->gpu[*be][dev] && kvt_dma_open(&c, &f->gpu[*be][dev]))
		return refuse_why(f, "kv_cache[%u]: opening device %d: %s", i, dev,
				  kvt_dma_last_error());
	return dev;
}

/* A cuda / cuda_raw descriptor: the engine's allocation opened here, the
 * view checked against what the driver says the allocation is; the
 * registration's fence (at its first tensor), which also waits for the
 * event torch shared the storage with, when it asks its users to. */
static int map_gpu_tensor(lmc_front *f, struct reg *r, const struct lmc_tensor *t, uint32_t i,
			  void **addr)
{
	const uint8_t *h = t->ipc;
	uint64_t base = 0, len = 0;
	kvt_dma *gd;
	int be = 0, dev = gpu_of(f, t, i, &be);

	if (dev < 0)
		return -1;
	if (r->gpu >= 0 && (dev != r->gpu || be != r->gpu_be))
		return refuse_why(f, "kv_cache[%u] is on %s device %d, kv_cache[0] on %s %d", i,
				  GPU_BACKENDS[be], dev, GPU_BACKENDS[r->gpu_be], r->gpu);
	r->gpu = dev;
	r->gpu_be = be;
	gd = f->gpu[be][dev];
	if (!r->fence && kvt_dma_fence_open(gd, &r->fence))
		return refuse_why(f, "a fence on device %d: %s", dev, kvt_dma_last_error());
	/* torch's storage handle: a version byte and 'c' (a cudaMalloc block)
	 * before the driver's 64 bytes; a bare 64 is the older form, and
	 * cuda_raw's */
	if (t->ipc_len == KVT_DMA_IPC_BYTES + 2 && h[1] == 'c' && h[0] >= 1 && h[0] <= 3)
		h += 2;
	else if (t->ipc_len == KVT_DMA_IPC_BYTES + 2 && h[1] == 'e')
		return refuse_why(f, "kv_cache[%u]: an expandable segment's handle "
				  "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): kvtierd opens "
				  "cudaMalloc'ed KV caches", i);
	else if (t->ipc_len != KVT_DMA_IPC_BYTES)
		return refuse_why(f, "kv_cache[%u]: a storage handle of %u bytes, not a CUDA IPC "
				  "handle", i, t->ipc_len);
	if (view_bytes(t) > t->ipc_bytes)
		return refuse_why(f, "kv_cache[%u]: the view ends past its storage (%llu bytes)", i,
				  (unsigned long long)t->ipc_bytes);
	if (t->ipc_event_len && t->ipc_event_len != KVT_DMA_IPC_BYTES)
		return refuse_why(f, "kv_cache[%u]: an event handle of %u bytes", i,
				  t->ipc_event_len);
	if (kvt_dma_ipc_mem_open(gd, h, &base, &len))
		return refuse_why(f, "kv_cache[%u]: opening the engine's memory: %s", i,
				  kvt_dma_last_error());
	r->ipc_base[r->n_ipc++] = base;
	if (t->ipc_offset > len || t->ipc_bytes > len - t->ipc_offset)
		return refuse_why(f, "kv_cache[%u]: bytes [%llu, +%llu) of an allocation of %llu",
				  i, (unsigned long long)t->ipc_offset,
				  (unsigned long long)t->ipc_bytes, (unsigned long long)len);
	if (t->ipc_event_len && kvt_dma_fence_wait(r->fence, t->ipc_event))
		return refuse_why(f, "kv_cache[%u]: its storage's event: %s", i,
				  kvt_dma_last_error());
	*addr = (void *)(uintptr_t)(base + t->ipc_offset);
	return 0;
}

static int map_tensor(lmc_front *f, struct reg *r, const struct lmc_tensor *t, uint32_t i,
		      void **addr)
{
	struct stat st;
	const char *name = t->shm_name;
	int fd;

	if (strcmp(t->type, "cpu_shm"))
		return map_gpu_tensor(f, r, t, i, addr);
	for (uint32_t m = 0; m < r->n_maps; m++)
		if (!strcmp(r->maps[m].name, name)) {
			if (r->maps[m].len != t->nbytes)
				return refuse_why(f, "kv_cache[%u]: shm '%s' given with two sizes",
						  i, name);
			*addr = r->maps[m].addr;
			goto view;
		}
	if (strncmp(name, SHM_PREFIX, strlen(SHM_PREFIX)) || strchr(name + 1, '/') ||
	    strlen(name) > 255)
		return refuse_why(f, "kv_cache[%u]: shm name '%s': kvtierd maps only LMCache's "
				  "(%s..., no other '/')", i, name, SHM_PREFIX);
	fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
	if (fd < 0)
		return refuse_why(f, "kv_cache[%u]: shm '%s': %s (kvtierd must run as the "
				  "engine's user, or root)", i, name, strerror(errno));
	if (!fstat(fd, &st) && st.st_uid != geteuid()) {
		/* The protocol names no user: a client could name another user's
		 * KV (and have it read into the tier, or written).  A root kvtierd
		 * would open any; so only its own user's memory is mapped. */
		close(fd);
		return refuse_why(f, "kv_cache[%u]: shm '%s' belongs to uid %u, kvtierd runs as uid "
				  "%u: run kvtierd as the engines' user", i, name,
				  (unsigned)st.st_uid, (unsigned)geteuid());
	}
	if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (uint64_t)st.st_size < t->nbytes ||
	    !t->nbytes) {
		close(fd);
		return refuse_why(f, "kv_cache[%u]: shm '%s' holds %lld bytes, the descriptor "
				  "claims %llu", i, name, (long long)st.st_size,
				  (unsigned long long)t->nbytes);
	}
	/* MAP_POPULATE: the page tables at registration, not as a first copy's
	 * faults (a 4 KiB fault per page halved the first stores' rate) */
	*addr = mmap(NULL, t->nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
	close(fd);
	if (*addr == MAP_FAILED)
		return refuse_why(f, "kv_cache[%u]: mapping shm '%s': %s", i, name, strerror(errno));
	snprintf(r->maps[r->n_maps].name, sizeof(r->maps[0].name), "%s", name);
	r->maps[r->n_maps].addr = *addr;
	r->maps[r->n_maps].len = t->nbytes;
	r->n_maps++;
view:
	/* the view's last byte inside the object */
	if (view_bytes(t) > t->nbytes)
		return refuse_why(f, "kv_cache[%u]: the view ends past shm '%s' (%llu bytes)", i,
				  name, (unsigned long long)t->nbytes);
	return 0;
}

static int do_register(lmc_front *f, const struct lmc_register *g)
{
	struct layout lay, l, side;
	uint64_t bstride = 0, nblocks = 0, pstride = 0, bs = 0, np = 0, nb = 0;
	uint64_t side_stride = 0, side_blocks = 0;
	uint32_t n0 = 0, n_side = 0, k0 = 0, k1 = 0;
	unsigned char in_side[LMC_MAX_LAYERS];
	struct reg *r = NULL;
	int slot = -1, ns;

	if (find_reg(f, g->instance_id) >= 0)
		return 0; /* a re-registration after a failed heartbeat */
	if (g->world != f->world)
		return refuse_why(f, "world_size %u: the segment is laid out for %u ranks "
				  "(kvtierd --world)", g->world, f->world);
	/* Three engines' registrations: vLLM's per-layer caches (no list
	 * layout, no page hint); SGLang's MHA pools, token-major, K layers
	 * then V layers ("k_v" with the page size in the hints, or "unified"
	 * page views), and its MLA pools ("unified" page views, 3-D); ATOM's
	 * MLA latent caches (no hints).  An SGLang pool read as vLLM's would
	 * be copied block-wrong, so the engine type and the hints decide
	 * together.  Beside an MLA latent, ATOM's and SGLang's index caches
	 * (DeepSeek V3.2's DSA) make a second group (below). */
	if (!strcmp(g->engine, "sglang")) {
		int kv = !strcmp(g->kv_list_layout, "k_v") && g->hint_tokens_per_block;
		int unified = !strcmp(g->kv_list_layout, "unified");
		if (!kv && !unified)
			return refuse_why(f, "SGLang registration with kv_list_layout '%s', "
					  "tokens_per_block %u: kvtierd copies SGLang's MHA pools "
					  "(K layers then V layers: \"k_v\" with a page size, or "
					  "\"unified\") and MLA pools (\"unified\")",
					  g->kv_list_layout, g->hint_tokens_per_block);
	} else if ((strcmp(g->engine, "vllm") && strcmp(g->engine, "atom")) ||
		   g->kv_list_layout[0] || g->hint_tokens_per_block) {
		return refuse_why(f, "engine '%s' (layout hints%s%s): kvtierd's LMCache front end "
				  "copies vLLM's KV caches, SGLang's MHA pools and ATOM's MLA "
				  "caches", g->engine, g->kv_list_layout[0] ? " kv_list_layout" : "",
				  g->hint_tokens_per_block ? " tokens_per_block" : "");
	}
	for (uint32_t i = 0; i < g->n_groups; i++)
		if (g->groups[i].sw_size_tokens >= 0 || g->groups[i].recurrent)
			return refuse_why(f, "engine_group_infos[%u]: a %s group (%s), not kept by "
					  "kvtierd's LMCache front end%s", i,
					  g->groups[i].recurrent ? "recurrent" : "sliding-window",
					  g->groups[i].recurrent ? "a state, not blocks a token" :
					  "its blocks before the window are the engine's null block",
					  g->groups[i].recurrent ? "" : HYBRID_OFF);
	if (g->n_tensors > LMC_MAX_LAYERS) /* the decoder's bound */
		return refuse_why(f, "%u KV cache tensors", g->n_tensors);
	/* Each tensor's layout.  Every tensor of group 0 has kv_cache[0]'s;
	 * beside an MLA latent (replicated) an engine may register one index
	 * cache layout more -- DeepSeek V3.2 / GLM-5's: vLLM's and ATOM's
	 * per-layer caches (vLLM's on fewer layers than the latent: GLM-5.2
	 * has 21 on 78), SGLang's DSA indexer pages after the latent's
	 * layers -- with the same block, kept as a group of its own whose
	 * block ids are the latent's. */
	memset(&lay, 0, sizeof(lay));
	memset(&side, 0, sizeof(side));
	for (uint32_t i = 0; i < g->n_tensors; i++) {
		memset(&l, 0, sizeof(l));
		if (tensor_layout(f, g, &g->tensors[i], i, &l, &bs, &nb, &np))
			return -1;
		in_side[i] = 0;
		if (!i) {
			lay = l;
			bstride = bs;
			nblocks = nb;
			pstride = np;
			n0 = 1;
		} else if (!strcmp(l.tag, lay.tag) && nb == nblocks) {
			n0++;
		} else if (lay.replicated && strcmp(l.tag, lay.tag) && l.bs == lay.bs &&
			   l.planes_per_tensor == 1 &&
			   (!n_side || (!strcmp(l.tag, side.tag) && nb == side_blocks))) {
			if (!n_side) {
				side = l;
				side_stride = bs;
				side_blocks = nb;
			}
			in_side[i] = 1;
			n_side++;
		} else {
			return refuse_why(f, "kv_cache[%u] differs from kv_cache[0] (%s, %llu blocks "
					  "vs %s, %llu)%s", i, l.tag, (unsigned long long)nb, lay.tag,
					  (unsigned long long)nblocks, n_side ?
					  ": a third layout beside the latent and its index cache" :
					  "");
		}
	}
	if (!strcmp(g->engine, "sglang") && !lay.replicated && g->n_tensors % 2)
		return refuse_why(f, "an SGLang MHA registration of %u tensors: kvtierd copies "
				  "every layer's K then every layer's V (an even count)",
				  g->n_tensors);
	/* The engine groups: one, or -- SGLang's unified connector -- the
	 * latent's kernel group and its index pages' (one engine group, the
	 * same block ids: checked at each copy). */
	if (g->n_groups > (n_side ? 2u : 1u))
		return refuse_why(f, "%u engine groups (a hybrid model): kvtierd's LMCache front "
				  "end keeps one group of layers (and an MLA latent's index "
				  "cache)%s", g->n_groups, HYBRID_OFF);
	for (uint32_t i = 0; i < g->n_groups; i++) {
		if (g->groups[i].tokens_per_block && g->groups[i].tokens_per_block != lay.bs)
			return refuse_why(f, "engine_group_infos[%u].tokens_per_block %u, the "
					  "tensors' block %u", i, g->groups[i].tokens_per_block,
					  lay.bs);
		if (g->n_groups == 2 && g->groups[i].n_layers != (i ? n_side : n0))
			return refuse_why(f, "engine_group_infos[%u] has %u layers, the registration "
					  "%u tensors of that layout", i, g->groups[i].n_layers,
					  i ? n_side : n0);
	}
	if (f->chunk % lay.bs)
		return refuse_why(f, "block size %u does not divide the segment's chunk of %u "
				  "tokens", lay.bs, f->chunk);
	np = (uint64_t)n0 * lay.planes_per_tensor;
	if (n_side) {
		lay.side_planes = n_side;
		lay.side_bpt = side.bpt;
		size_t o = strlen(lay.tag);
		snprintf(lay.tag + o, sizeof(lay.tag) - o, "+%s", side.tag);
	}
	{
		int fits = f->n_groups == (n_side ? 2u : 1u) && f->seg_groups[0].layers == np &&
			   f->seg_groups[0].bytes_per_token == lay.bpt &&
			   f->mode_replicated == lay.replicated &&
			   (!n_side || (f->seg_groups[1].layers == n_side &&
					f->seg_groups[1].bytes_per_token == side.bpt));
		char more[48] = "";
		if (n_side)
			snprintf(more, sizeof(more), " --group %u:%u", n_side, side.bpt);
		if (!fits)
			return refuse_why(f, "this engine's KV (%llu planes of %u bytes per token%s, "
					  "%s) is not the segment's layout; start kvtierd with --group "
					  "%llu:%u%s%s --world %u --chunk-tokens %u",
					  (unsigned long long)np, lay.bpt, n_side ?
					  " and its index cache's" : "", lay.tag,
					  (unsigned long long)np, lay.bpt, more,
					  lay.replicated ? " --replicated" : "", f->world, f->chunk);
	}
	ns = find_ns(f, g->model, g->world);
	if (ns >= 0 && strcmp(f->ns[ns].lay.tag, lay.tag))
		return refuse_why(f, "model '%s' was registered with another KV layout (%s, now "
				  "%s): one layout per model name and world", g->model,
				  f->ns[ns].lay.tag, lay.tag);
	for (int i = 0; i < MAX_REGS && slot < 0; i++)
		if (!f->regs[i].used)
			slot = i;
	if (slot < 0)
		return refuse_why(f, "%d KV caches are registered already", MAX_REGS);
	if (ns < 0) {
		for (int i = 0; i < MAX_NS && ns < 0; i++)
			if (!f->ns[i].used)
				ns = i;
		if (ns < 0)
			return refuse_why(f, "%d model names are in use", MAX_NS);
		f->ns[ns].used = 1;
		snprintf(f->ns[ns].model, sizeof(f->ns[ns].model), "%s", g->model);
		f->ns[ns].world = g->world;
		f->ns[ns].lay = lay;
	}
	r = &f->regs[slot];
	memset(r, 0, sizeof(*r));
	r->maps = calloc(g->n_tensors, sizeof(*r->maps));
	r->bases = calloc(np + n_side, sizeof(*r->bases));
	r->ipc_base = calloc(g->n_tensors, sizeof(*r->ipc_base));
	if (!r->maps || !r->bases || !r->ipc_base) {
		free(r->maps);
		free(r->bases);
		free(r->ipc_base);
		return refuse_why(f, "out of memory");
	}
	r->used = 1;
	r->gpu = -1;
	atomic_fetch_add(&f->n_clients, 1);
	for (uint32_t i = 0; i < g->n_tensors; i++) {
		const struct lmc_tensor *t = &g->tensors[i];
		void *a = NULL;
		if (map_tensor(f, r, t, i, &a)) {
			reg_close(f, r);
			return -1;
		}
		uint64_t base = (uint64_t)(uintptr_t)a + t->storage_offset * lmc_dtype_size(t->dtype);
		if (in_side[i]) {
			r->bases[np + k1++] = base;
			continue;
		}
		for (uint32_t p = 0; p < lay.planes_per_tensor; p++)
			r->bases[(uint64_t)k0 * lay.planes_per_tensor + p] = base + p * pstride;
		k0++;
	}
	r->iid = g->instance_id;
	r->peer = f->cur_peer;
	r->ns = ns;
	r->lay = lay;
	r->n_planes = (uint32_t)np;
	r->block_stride = bstride;
	r->n_blocks = nblocks;
	r->side_stride = side_stride;
	r->side_blocks = side_blocks;
	r->rank = -1;
	atomic_fetch_add(&f->n_regs, 1);
	told_forget(f, g->instance_id);
	flog(f, KVT_LOG_LEVEL_INFO, "registered %s's KV cache (instance %llu, model '%s', %s, "
	     "%u planes, %llu blocks%s)", g->engine, (unsigned long long)g->instance_id, g->model,
	     lay.tag, r->n_planes, (unsigned long long)nblocks,
	     n_side ? ", and its index cache" : "");
	return 0;
}

static void rank_log(void *arg, int level, const char *msg)
{
	flog(arg, level, "%s", msg);
}

/* The registration's kvtier rank handle, opened at its first copy. */
static int reg_rank(lmc_front *f, struct reg *r, uint32_t rank)
{
	struct kvt_group_desc gd[2];
	struct kvt_group_buffers gb[2];
	struct kvt_config c;
	uint32_t ng = r->lay.side_planes ? 2 : 1;
	int err = -EBUSY;

	if (r->t) {
		if ((uint32_t)r->rank != rank)
			return refuse_why(f, "worker_id %u: this KV cache stored or retrieved as "
					  "worker %d before", rank, r->rank);
		return 0;
	}
	if (rank >= f->world)
		return refuse_why(f, "worker_id %u: the segment has %u ranks", rank, f->world);
	gd[0].n_layers = r->n_planes;
	gd[0].bytes_per_token = r->lay.bpt;
	gd[0].tokens_per_block = r->lay.bs;
	gd[0].replicated = (uint32_t)r->lay.replicated;
	/* the index cache's group: the latent's block, replicated too */
	gd[1].n_layers = r->lay.side_planes;
	gd[1].bytes_per_token = r->lay.side_bpt;
	gd[1].tokens_per_block = r->lay.bs;
	gd[1].replicated = (uint32_t)r->lay.replicated;
	for (uint32_t inst = 0; inst < f->n_instances && err == -EBUSY; inst++) {
		memset(&c, 0, sizeof(c));
		c.size = sizeof(c);
		c.flags = KVT_F_NO_ENV | (f->cfg.group ? KVT_F_GROUP : 0);
		c.role = KVT_TIER_RANK;
		c.instance = (int32_t)inst;
		c.rank = (int32_t)rank;
		c.world = f->world;
		c.chunk_tokens = f->chunk;
		c.segment = f->segment;
		c.segment_dir = f->segment_dir[0] ? f->segment_dir : NULL;
		c.model = f->model;
		c.dma = r->gpu >= 0 ? GPU_BACKENDS[r->gpu_be] : "host";
		c.log = rank_log;
		c.log_arg = f;
		c.n_groups = ng;
		c.groups = gd;
		c.n_instances = f->n_instances;
		err = kvt_open(&c, &r->t);
	}
	if (err)
		return refuse_why(f, "attaching as rank %u: %s%s", rank, kvt_last_error(),
				  err == -EBUSY ? " (every instance's rank entry is taken: raise "
				  "kvtierd --instances)" : "");
	gb[0].layer_base = r->bases;
	gb[0].block_stride = r->block_stride;
	gb[0].n_blocks = r->n_blocks;
	gb[1].layer_base = r->bases + r->n_planes;
	gb[1].block_stride = r->side_stride;
	gb[1].n_blocks = r->side_blocks;
	err = kvt_register_kv(r->t, ng, gb);
	if (err) {
		refuse_why(f, "registering the KV cache with kvtier: %s", kvt_last_error());
		kvt_close(r->t);
		r->t = NULL;
		return -1;
	}
	r->rank = (int)rank;
	return 0;
}

/* ---- lookups ---- */

/* LMCache's read locks: a lookup locks its hits for num_kv_readers
 * retrieves.  A lease is released by kvtier when each of the segment's
 * world ranks has loaded from it, so over a world of one (the replicated
 * layout: every TP rank of an MLA engine reads the same chunks) the first
 * reader's load would release what the others still need, and a chunk
 * evicted before their retrieves would be a miss.  There, each further
 * reader gets a lease of its own, taken now over the same hits (they are
 * pinned by the first, so the look-up finds them all); a retrieve takes
 * the session's next.  Over a sharded world one lease serves every rank.
 * Capped: readers past MAX_READERS (and any a full lease table refuses)
 * look up at their retrieve, as a late rank does. */
#define MAX_READERS 64

static void lock_readers(lmc_front *f, struct sess *s)
{
	uint32_t want = s->readers < MAX_READERS ? s->readers : MAX_READERS;

	if (f->world != 1 || want < 2 || !s->lease || !s->hits)
		return;
	if (!s->more && !(s->more = calloc(MAX_READERS - 1, sizeof(*s->more))))
		return;
	while (s->n_more < want - 1) {
		kvt_lease_id l = 0;
		int hits = kvt_lookup(f->look, s->keys, s->hits, &l);
		if (l)
			atomic_fetch_add(&f->n_leases, 1);
		if (hits != (int)s->hits || !l) {
			if (hits < 0)
				flog(f, KVT_LOG_LEVEL_WARN, "read locks of request '%s': %s",
				     s->rid, kvt_last_error());
			lease_release(f, &l);
			return;
		}
		s->more[s->n_more++] = l;
	}
}

static void look(lmc_front *f, struct sess *s, uint64_t now)
{
	struct kvt_lookup_res res;
	int r;

	sess_unlock(f, s);
	memset(&res, 0, sizeof(res));
	res.size = sizeof(res);
	res.first_depth = 0;
	r = kvt_lookup_ex(f->look, s->keys, s->n_keys, KVT_LOOKUP_PROMOTE | KVT_LOOKUP_DEPTH, &res);
	if (r < 0) {
		flog(f, KVT_LOG_LEVEL_WARN, "lookup: %s", kvt_last_error());
		s->hits = 0;
		s->state = S_READY;
		return;
	}
	s->hits = res.hits;
	s->lease = res.lease;
	if (s->lease) {
		atomic_fetch_add(&f->n_leases, 1);
		s->t_lease = now;
	}
	if (res.pending && now < s->deadline) {
		lease_release(f, &s->lease); /* asked again when they are up */
		s->state = S_RUNNING;
		s->next_look = now + RELOOK_NS;
		return;
	}
	s->state = S_READY;
	lock_readers(f, s);
	atomic_fetch_add(&f->n_hit_chunks, s->hits);
}

static int do_lookup(lmc_front *f, const struct lmc_key *k)
{
	struct sess *s;
	uint64_t now = now_ns();
	uint32_t n;
	int ns;

	if (k->readers < 1)
		return refuse_why(f, "the key has no num_kv_readers: an LMCache client older than "
				  "0.5.6 (this protocol requires it)");
	s = sess_new(f, k->request_id);
	s->peer = f->cur_peer;
	s->t0 = now;
	s->hits = 0;
	s->readers = k->readers;
	s->state = S_READY;
	atomic_fetch_add(&f->n_lookups, 1);
	ns = find_ns(f, k->model, k->world);
	n = (uint32_t)((k->end < k->n_tokens ? k->end : k->n_tokens) / f->chunk);
	if (n > f->lease_cap)
		n = f->lease_cap;
	if (ns < 0 || k->world != f->world || !n)
		return 0; /* nothing registered under that name: 0 hits */
	s->keys = chunk_keys(f, ns, k, n);
	if (!s->keys)
		return -1;
	s->n_keys = n;
	s->deadline = now + PENDING_NS;
	look(f, s, now);
	return 0;
}

static void answer_waiters(lmc_front *f, uint64_t now)
{
	for (int i = 0; i < MAX_WAIT; i++) {
		struct waiter *w = &f->wait[i];
		struct sess *s;
		if (!w->used)
			continue;
		s = find_sess(f, w->rid);
		if (!s || s->state == S_TAKEN) {
			reply_uint(f, &w->rt, 0);
		} else if (s->state == S_READY) {
			reply_uint(f, &w->rt, s->hits);
			s->state = S_TAKEN;
		} else if (now >= w->deadline) {
			reply_nil(f, &w->rt);
		} else {
			continue;
		}
		w->used = 0;
	}
}

/* ---- copies ---- */

static int check_range(lmc_front *f, const struct lmc_key *k, const struct lmc_blocks *b,
		       const struct reg *r)
{
	uint64_t need, nb;

	if (k->worker < 0)
		return refuse_why(f, "a store or retrieve key without worker_id");
	if (k->world != f->world)
		return refuse_why(f, "world_size %u: the segment is laid out for %u ranks",
				  k->world, f->world);
	if (k->start % f->chunk || k->end % f->chunk || k->start > k->end ||
	    k->end > k->n_tokens)
		return refuse_why(f, "range [%llu, %llu) of %u tokens is not whole chunks of %u",
				  (unsigned long long)k->start, (unsigned long long)k->end,
				  k->n_tokens, f->chunk);
	/* one list; beside an index cache SGLang sends its kernel group's
	 * list too, which must be the latent's (one engine group) */
	if (b->n_groups != 1 && (b->n_groups != 2 || !r->lay.side_planes ||
				 b->n[1] != b->n[0] ||
				 memcmp(b->ids[1], b->ids[0], b->n[0] * sizeof(*b->ids[0]))))
		return refuse_why(f, "%u block id lists: the registration has one group%s",
				  b->n_groups, r->lay.side_planes ? " (the index cache's list "
				  "must be the latent's)" : "");
	need = (k->end - k->start) / r->lay.bs;
	if (b->n[0] < need)
		return 1; /* LMCache answers ok=false */
	nb = r->n_blocks;
	if (r->lay.side_planes && r->side_blocks < nb)
		nb = r->side_blocks;
	for (uint64_t i = 0; i < need; i++)
		if (b->ids[0][i] >= nb)
			return refuse_why(f, "block id %u: the KV cache has %llu blocks",
					  b->ids[0][i], (unsigned long long)nb);
	return 0;
}

static struct pend *pend_new(lmc_front *f, const struct route *rt, int reg, uint32_t n_ops,
			     const char *rid)
{
	for (int i = 0; i < MAX_PEND; i++) {
		struct pend *p = &f->pend[i];
		if (p->used)
			continue;
		memset(p, 0, sizeof(*p));
		p->ops = calloc(n_ops ? n_ops : 1, sizeof(*p->ops));
		if (!p->ops)
			return NULL;
		p->used = 1;
		snprintf(p->rid, sizeof(p->rid), "%s", rid);
		p->rt = *rt;
		p->reg = reg;
		p->ok = 1;
		f->regs[reg].busy++;
		return p;
	}
	return NULL;
}

static void pend_finish(lmc_front *f, struct pend *p)
{
	struct reg *r = &f->regs[p->reg];

	reply_handle(f, &p->rt, p->ok, r, p->timeline);
	if (p->release) {
		lease_release(f, &p->release);
	}
	free(p->ops);
	p->used = 0;
	if (--r->busy == 0 && r->dying)
		reg_close(f, r);
}

/* What a store and a retrieve check first: the registration, the range,
 * the rank handle.  1 when the request was answered here (an unknown
 * instance, a refusal, ok=false for short block lists, an empty range);
 * else 0 with *ri and the range's chunks [*c0, *c1). */
static int copy_begin(lmc_front *f, const struct route *rt, const struct lmc_req *q,
		      const char *what, int *ri, uint32_t *c0, uint32_t *c1)
{
	const struct lmc_key *k = &q->key;
	struct reg *r;
	int c;

	*ri = find_reg(f, q->instance_id);
	if (*ri < 0) {
		unsigned char b[32];
		flog(f, KVT_LOG_LEVEL_WARN, "%s of request '%s': instance %llu has no KV cache "
		     "registered (kvtierd restarted since, unmapped at its client's disconnect, "
		     "or never registered): ok=false", what, k->request_id,
		     (unsigned long long)q->instance_id);
		if (!strcmp(what, "retrieve"))
			atomic_fetch_add(&f->n_retrieve_misses, 1);
		reply(f, rt, b, lmc_enc_handle_ok(b, sizeof(b), "", 0, 0));
		return 1;
	}
	r = &f->regs[*ri];
	if ((c = check_range(f, k, &q->blocks, r)) < 0 || (!c && reg_rank(f, r, (uint32_t)k->worker))) {
		refuse(f, rt, what);
		return 1;
	}
	*c0 = (uint32_t)(k->start / f->chunk);
	*c1 = (uint32_t)(k->end / f->chunk);
	if (c > 0) {
		flog(f, KVT_LOG_LEVEL_WARN, "%s of request '%s': %u block ids for tokens [%llu, "
		     "%llu): ok=false", what, k->request_id, q->blocks.n[0],
		     (unsigned long long)k->start, (unsigned long long)k->end);
		if (!strcmp(what, "retrieve"))
			atomic_fetch_add(&f->n_retrieve_misses, 1);
	}
	if (c > 0 || *c0 == *c1) {
		reply_handle(f, rt, !c, r, q->event_len == TIMELINE_BYTES);
		return 1;
	}
	/* GPU: the copies start after the engine's work on the blocks -- its
	 * event (recorded on its stream before it asked) waited for on the
	 * fence's stream, the rank handle's copies ordered after that stream
	 * (kvt_order_after): a save copies what the forward pass wrote, a
	 * load writes blocks no kernel of the engine still reads */
	if (r->fence && q->event_len) { /* none: nothing new to order after */
		const uint8_t *ev = q->event;
		uint64_t off = q->event_len == TIMELINE_BYTES ? be64(ev + 65) : 0;
		int e = 0;
		if (q->event_len != KVT_DMA_IPC_BYTES && q->event_len != TIMELINE_BYTES)
			e = refuse_why(f, "event_ipc_handle of %u bytes: neither a CUDA IPC event "
				       "handle (%d) nor LMCache's timeline semaphore (%d)",
				       q->event_len, KVT_DMA_IPC_BYTES, TIMELINE_BYTES);
		else if (q->event_len == TIMELINE_BYTES &&
			 (ev[0] != 1 || off % 8 || off >= TIMELINE_WORDS * 8))
			e = refuse_why(f, "a timeline semaphore handle of version %u at offset "
				       "%llu (version 1, an 8-byte word of %d)", ev[0],
				       (unsigned long long)off, TIMELINE_WORDS);
		else if (q->event_len == TIMELINE_BYTES &&
			 kvt_dma_fence_wait_value(r->fence, ev + 1, off, be64(ev + 73)))
			e = refuse_why(f, "the engine's semaphore: %s", kvt_dma_last_error());
		else if (q->event_len == KVT_DMA_IPC_BYTES && kvt_dma_fence_wait(r->fence, ev))
			e = refuse_why(f, "the engine's event: %s", kvt_dma_last_error());
		else if (kvt_order_after(r->t, kvt_dma_fence_stream(r->fence)))
			e = refuse_why(f, "ordering the copies after the engine's event: %s",
				       kvt_last_error());
		if (e) {
			flog(f, KVT_LOG_LEVEL_WARN, "%s of request '%s': %s: ok=false", what,
			     k->request_id, f->why);
			reply_handle(f, rt, 0, r, q->event_len == TIMELINE_BYTES);
			return 1;
		}
	}
	return 0;
}

static void do_store(lmc_front *f, const struct route *rt, struct lmc_req *q)
{
	const struct lmc_key *k = &q->key;
	int ri;
	struct reg *r;
	struct pend *p;
	kvt_key *keys;
	uint32_t bpc, c0, c1;

	if (copy_begin(f, rt, q, "store", &ri, &c0, &c1))
		return;
	r = &f->regs[ri];
	bpc = f->chunk / r->lay.bs;
	keys = chunk_keys(f, r->ns, k, c1);
	p = keys ? pend_new(f, rt, ri, c1 - c0, k->request_id) : NULL;
	if (!p) {
		free(keys);
		if (keys)
			refuse_why(f, "%d copies are in flight", MAX_PEND);
		refuse(f, rt, "store");
		return;
	}
	p->timeline = q->event_len == TIMELINE_BYTES;
	/* runs of chunks that are not all null blocks (LMCache's null block 0) */
	for (uint32_t a = c0; a < c1;) {
		uint32_t e = a;
		/* table 0 for every group: an index cache's blocks are the
		 * latent's (kvt_save: a NULL table g > 0 is table 0) */
		const uint32_t *ids[2] = {NULL, NULL};
		while (e < c1) {
			int null = 1;
			for (uint32_t j = 0; j < bpc && null; j++)
				null = q->blocks.ids[0][(size_t)(e - c0) * bpc + j] == 0;
			if (null)
				break;
			e++;
		}
		if (e > a) {
			kvt_op op = 0;
			int n;
			ids[0] = &q->blocks.ids[0][(size_t)(a - c0) * bpc];
			n = kvt_save(r->t, keys + a, e - a, a, ids, &op);
			if (n < 0) {
				flog(f, KVT_LOG_LEVEL_WARN, "store of request '%s': %s", k->request_id,
				     kvt_last_error());
				p->ok = 0;
				break;
			}
			atomic_fetch_add(&f->n_stored, (uint64_t)n);
			if (op)
				p->ops[p->n_ops++] = op;
		}
		a = e + (e < c1); /* past the null chunk */
	}
	free(keys);
}

static void do_retrieve(lmc_front *f, const struct route *rt, struct lmc_req *q)
{
	const struct lmc_key *k = &q->key;
	int ri, r_;
	struct reg *r;
	struct sess *s;
	struct pend *p;
	kvt_key *keys;
	kvt_lease_id lease = 0, own = 0;
	uint32_t bpc, c0, c1, skip, *tab;
	kvt_op op = 0;
	const char *why;

	if (copy_begin(f, rt, q, "retrieve", &ri, &c0, &c1))
		return;
	r = &f->regs[ri];
	bpc = f->chunk / r->lay.bs;
	keys = chunk_keys(f, r->ns, k, c1);
	if (!keys) {
		refuse(f, rt, "retrieve");
		return;
	}
	s = find_sess(f, k->request_id);
	if (s && s->lease && s->hits >= c1 && s->n_keys >= c1 &&
	    !memcmp(&s->keys[c1 - 1], &keys[c1 - 1], sizeof(kvt_key)))
		lease = s->lease;
	why = !s ? "none" : !s->lease ? "no lease" : s->hits < c1 ? "fewer hits" :
	      lease ? "used" : "other keys";
	tab = malloc((size_t)c1 * bpc * sizeof(*tab));
	if (!tab) {
		free(keys);
		refuse_why(f, "out of memory");
		refuse(f, rt, "retrieve");
		return;
	}
	skip = (uint32_t)(q->skip_tokens / r->lay.bs);
	for (size_t i = 0; i < (size_t)c1 * bpc; i++)
		tab[i] = KVT_BLOCK_SKIP;
	for (size_t i = 0; i < (size_t)(c1 - c0) * bpc; i++)
		if (i >= skip)
			tab[(size_t)c0 * bpc + i] = q->blocks.ids[0][i];
	for (int attempt = 0; attempt < 2; attempt++) {
		const uint32_t *tabs[2] = {tab, NULL}; /* as in do_store */
		if (!lease) {
			int hits = kvt_lookup(f->look, keys, c1, &own);
			if (own)
				atomic_fetch_add(&f->n_leases, 1);
			if (hits < (int)c1) {
				if (hits < 0)
					flog(f, KVT_LOG_LEVEL_WARN, "retrieve of request '%s': %s",
					     k->request_id, kvt_last_error());
				flog(f, KVT_LOG_LEVEL_WARN, "retrieve of request '%s': %d of its %u "
				     "chunks in the tier (its lookup: %s): ok=false",
				     k->request_id, hits, c1, why);
				lease_release(f, &own);
				break;
			}
			lease = own;
		}
		r_ = kvt_load(r->t, lease, c1, tabs, &op);
		if (!r_) {
			if (lease != own && f->world == 1) {
				/* this reader's lock: released after its copies
				 * (kvtier has, once it loaded); the next reader's is
				 * the session's next (lock_readers) */
				own = lease;
				sess_next(s);
			}
			break;
		}
		if (lease != own && f->world == 1) { /* gone: the next reader's is not */
			lease_release(f, &s->lease);
			sess_next(s);
		}
		lease = 0; /* the session's lease went (-ESTALE): look up ourselves */
		why = "its lease released before the load";
		if (own || r_ != -ESTALE) {
			flog(f, KVT_LOG_LEVEL_WARN, "retrieve of request '%s': %s: ok=false",
			     k->request_id, kvt_last_error());
			lease_release(f, &own);
			break;
		}
	}
	free(tab);
	free(keys);
	if (!lease) {
		atomic_fetch_add(&f->n_retrieve_misses, 1);
		reply_handle(f, rt, 0, r, q->event_len == TIMELINE_BYTES);
		return;
	}
	p = pend_new(f, rt, ri, 1, k->request_id);
	if (!p) {
		/* the load runs on; wait for it here rather than answer early */
		kvt_wait(r->t, op, -1);
		lease_release(f, &own);
		reply_handle(f, rt, 1, r, q->event_len == TIMELINE_BYTES);
		return;
	}
	p->retrieve = 1;
	p->timeline = q->event_len == TIMELINE_BYTES;
	p->chunks = c1 - c0;
	p->release = own;
	if (op)
		p->ops[p->n_ops++] = op;
}

static void progress(lmc_front *f)
{
	for (int i = 0; i < MAX_PEND; i++) {
		struct pend *p = &f->pend[i];
		struct reg *r;
		if (!p->used)
			continue;
		r = &f->regs[p->reg];
		while (p->n_ops) {
			int e = kvt_poll(r->t, p->ops[p->n_ops - 1]);
			if (e == -EINPROGRESS)
				break;
			if (e) {
				flog(f, KVT_LOG_LEVEL_WARN, "%s of request '%s': a copy failed: %s%s",
				     p->retrieve ? "retrieve" : "store", p->rid, kvt_last_error(),
				     p->retrieve ? ": ok=false" : "");
				p->ok = 0;
			}
			p->n_ops--;
		}
		if (p->n_ops)
			continue;
		if (p->retrieve) {
			if (p->ok)
				atomic_fetch_add(&f->n_retrieved, p->chunks);
			else
				atomic_fetch_add(&f->n_retrieve_misses, 1);
		}
		pend_finish(f, p);
	}
}

/* ---- peers ---- */

static void peer_gone(lmc_front *f, int pi);

/* Does a client hold anything that its going away must release? */
static int peer_holds(const lmc_front *f, int pi)
{
	for (int i = 0; i < MAX_SESS; i++)
		if (f->sess[i].state != S_FREE && f->sess[i].peer == pi)
			return 1;
	for (int i = 0; i < MAX_REGS; i++)
		if (f->regs[i].used && f->regs[i].peer == pi)
			return 1;
	for (int i = 0; i < MAX_WAIT; i++)
		if (f->wait[i].used && ident_eq(&f->wait[i].rt.id, &f->peers[pi].id))
			return 1;
	return 0;
}

/* The client table exists only to release what a client holds when its
 * connection goes (drain_monitor).  So an entry is never what refuses a
 * client: one connection is one identity, and another identity's entry on
 * this message's fd is a connection already gone whose disconnect was not
 * seen (the monitor's events are drained before a message's fd is
 * recorded: its own went first, or was lost) -- released now (a message
 * whose fd libzmq does not say, -1, proves nothing); and with
 * the table full, an entry that holds nothing is taken over (its client,
 * if still there, gets a new one at its next message). */
static int peer_of(lmc_front *f, const struct ident *id, int fd)
{
	int free_ = -1, me = -1;
	for (int i = 0; i < MAX_PEERS; i++) {
		struct peer *p = &f->peers[i];
		if (p->used && ident_eq(&p->id, id)) {
			p->fd = fd;
			me = i;
		} else if (p->used && fd >= 0 && p->fd == fd) {
			flog(f, KVT_LOG_LEVEL_INFO, "a client's connection went unannounced "
			     "(another client on its descriptor %d)", fd);
			peer_gone(f, i);
		}
		if (!p->used && free_ < 0)
			free_ = i;
	}
	if (me >= 0)
		return me;
	for (int i = 0; i < MAX_PEERS && free_ < 0; i++)
		if (!peer_holds(f, i)) {
			memset(&f->peers[i], 0, sizeof(f->peers[i]));
			free_ = i;
		}
	if (free_ < 0)
		return -1;
	f->peers[free_].used = 1;
	f->peers[free_].id = *id;
	f->peers[free_].fd = fd;
	return free_;
}

static void peer_gone(lmc_front *f, int pi)
{
	uint32_t leases = 0, caches = 0;

	for (int i = 0; i < MAX_SESS; i++)
		if (f->sess[i].state != S_FREE && f->sess[i].peer == pi) {
			leases += (f->sess[i].lease != 0) + f->sess[i].n_more;
			sess_drop(f, &f->sess[i]);
		}
	for (int i = 0; i < MAX_REGS; i++) {
		struct reg *r = &f->regs[i];
		if (!r->used || r->peer != pi)
			continue;
		caches++;
		if (r->busy)
			r->dying = 1;
		else
			reg_close(f, r);
	}
	atomic_fetch_add(&f->n_disconnects, 1);
	if (leases || caches)
		flog(f, KVT_LOG_LEVEL_INFO, "a client went away: %u lookup lease(s) released, %u KV "
		     "cache(s) unmapped", leases, caches);
	for (int i = 0; i < MAX_WAIT; i++)
		if (f->wait[i].used && ident_eq(&f->wait[i].rt.id, &f->peers[pi].id))
			f->wait[i].used = 0;
	memset(&f->peers[pi], 0, sizeof(f->peers[pi]));
}

static void drain_monitor(lmc_front *f)
{
	for (;;) {
		unsigned char ev[6];
		char addr[256];
		int n = zmq_recv(f->mon, ev, sizeof(ev), ZMQ_DONTWAIT);
		if (n < 0)
			return;
		if (zmq_recv(f->mon, addr, sizeof(addr), ZMQ_DONTWAIT) < 0) {
			/* the event's second frame is always there */
		}
		if (n == 6) {
			uint16_t e;
			uint32_t fd;
			memcpy(&e, ev, 2);
			memcpy(&fd, ev + 2, 4);
			if (e == ZMQ_EVENT_DISCONNECTED)
				for (int i = 0; i < MAX_PEERS; i++)
					if (f->peers[i].used && f->peers[i].fd == (int)fd)
						peer_gone(f, i);
		}
	}
}

/* ---- requests ---- */

/* A worker's ping names its instance.  LMCache's client registers again
 * only on its heartbeat's unhealthy -> healthy edge, and its own server
 * answers every ping true: a worker whose registration the server lost
 * (kvtierd restarted within the heartbeat, its connection dropped and
 * came back under a new identity, its registration closed at that
 * disconnect) would have every store and retrieve answered ok=false for
 * ever.  So a ping from an instance with no registration is answered
 * false once -- the client skips its transfers until its next ping, which
 * is answered true, and its recovery callback registers the KV cache
 * again.  A scheduler's ping (no instance) is always true. */
static int ping_answer(lmc_front *f, const struct lmc_req *q)
{
	uint32_t w;

	if (q->instance_nil || find_reg(f, q->instance_id) >= 0)
		return 1;
	for (uint32_t i = 0; i < MAX_TOLD; i++)
		if (f->told_set[i] && f->told[i] == q->instance_id)
			return 1; /* told once: true until it registers (told_forget) */
	w = f->n_told++ % MAX_TOLD;
	f->told[w] = q->instance_id;
	f->told_set[w] = 1;
	flog(f, KVT_LOG_LEVEL_INFO, "ping from instance %llu, which has no KV cache registered "
	     "here (kvtierd restarted, or its connection came back): answered false once, so "
	     "that its client registers again", (unsigned long long)q->instance_id);
	return 0;
}

/* A registration of a told instance: the next time it goes, it is told
 * again.  (A client that never registers again -- SGLang's connectors
 * have no recovery callback -- is told once, then answered true.) */
static void told_forget(lmc_front *f, uint64_t iid)
{
	for (uint32_t i = 0; i < MAX_TOLD; i++)
		if (f->told_set[i] && f->told[i] == iid)
			f->told_set[i] = 0;
}

static void handle(lmc_front *f, const struct route *rt, const struct lmc_opname *op,
		   const void *const *pl, const size_t *pn, size_t n)
{
	struct lmc_req q;
	struct sess *s;
	int r;

	atomic_fetch_add(&f->n_requests, 1);
	if (f->cur_peer >= 0 && f->peers[f->cur_peer].foreign) {
		refuse_why(f, "%s", f->peers[f->cur_peer].reason);
		refuse(f, rt, op->name);
		return;
	}
	if (lmc_wire_arity(op->id) >= 0 ? n != (size_t)lmc_wire_arity(op->id) :
	    op->id == LMC_OP_UNKNOWN && op->name[0] == '#') {
		/* A frame count not 0.5.6's for the operation, or an operation
		 * number 0.5.6 does not have: another version's client.  It is
		 * refused now and at every later message (never half-served). */
		struct peer *p = f->cur_peer >= 0 ? &f->peers[f->cur_peer] : NULL;
		if (lmc_wire_arity(op->id) >= 0)
			refuse_why(f, "a client of another LMCache version: operation #%d came with "
				   "%zu payload frame(s); in LMCache 0.5.6's protocol #%d is %s and "
				   "takes %d%s", op->id, n, op->id, op->name, lmc_wire_arity(op->id),
				   lmc_old_op_name(op->id) ? lmc_old_op_name(op->id) : "");
		else
			refuse_why(f, "a client of another LMCache version: operation %s is not in "
				   "LMCache 0.5.6's protocol", op->name);
		if (p) {
			p->foreign = 1;
			snprintf(p->reason, sizeof(p->reason), "%s", f->why);
		}
		refuse(f, rt, op->name);
		return;
	}
	if (op->id >= LMC_OP_REGISTER_ENGINE_DRIVEN && op->id <= LMC_OP_COMMIT_RETRIEVE) {
		refuse_why(f, "'%s' is an engine-driven transfer; kvtierd does the copies itself "
			   "(lmcache_driven): set kv_connector_extra_config "
			   "lmcache.mp.mp_transfer_mode=lmcache_driven (or "
			   "LMCACHE_MP_TRANSFER_MODE=lmcache_driven)", op->name);
		refuse(f, rt, op->name);
		return;
	}
	if (lmc_arity(op->id) < 0) {
		refuse_why(f, "operation '%s' is not served", op->name);
		refuse(f, rt, op->name);
		return;
	}
	r = lmc_decode(op, pl, pn, n, &q, f->why, sizeof(f->why));
	if (r) {
		char why[sizeof(f->why)];
		snprintf(why, sizeof(why), "%s", f->why);
		if (n != (size_t)lmc_arity(op->id))
			refuse_why(f, "%s: a client of another LMCache version", why);
		else
			refuse_why(f, "%s", why);
		refuse(f, rt, op->name);
		return;
	}
	switch (op->id) {
	case LMC_OP_GET_CHUNK_SIZE:
		reply_uint(f, rt, f->chunk);
		break;
	case LMC_OP_GET_EXPERIMENTAL: {
		unsigned char b[8];
		reply(f, rt, b, lmc_enc_str_array(b, sizeof(b), NULL, 0));
		break;
	}
	case LMC_OP_NOOP: {
		unsigned char b[8];
		reply(f, rt, b, lmc_enc_str(b, sizeof(b), "OK"));
		break;
	}
	case LMC_OP_PING: {
		unsigned char b[4];
		reply(f, rt, b, lmc_enc_bool(b, sizeof(b), ping_answer(f, &q)));
		break;
	}
	case LMC_OP_REGISTER_KV_CACHE:
		if (do_register(f, &q.reg))
			refuse(f, rt, op->name);
		else
			reply_none(f, rt);
		break;
	case LMC_OP_UNREGISTER_KV_CACHE: {
		int ri = find_reg(f, q.instance_id);
		if (ri >= 0) {
			if (f->regs[ri].busy)
				f->regs[ri].dying = 1;
			else
				reg_close(f, &f->regs[ri]);
		}
		reply_none(f, rt);
		break;
	}
	case LMC_OP_LOOKUP:
		if (do_lookup(f, &q.key))
			refuse(f, rt, op->name);
		else
			reply_none(f, rt);
		break;
	case LMC_OP_QUERY_PREFETCH_STATUS:
		s = find_sess(f, q.request_id);
		if (s && s->state == S_RUNNING) {
			reply_nil(f, rt);
		} else if (s && s->state == S_READY) {
			reply_uint(f, rt, s->hits);
			s->state = S_TAKEN;
		} else {
			reply_uint(f, rt, 0);
		}
		break;
	case LMC_OP_WAIT_PREFETCH_STATUS: {
		int w = -1;
		for (int i = 0; i < MAX_WAIT && w < 0; i++)
			if (!f->wait[i].used)
				w = i;
		if (w < 0) {
			refuse_why(f, "%d waits are pending", MAX_WAIT);
			refuse(f, rt, op->name);
			break;
		}
		f->wait[w].used = 1;
		f->wait[w].rt = *rt;
		snprintf(f->wait[w].rid, sizeof(f->wait[w].rid), "%s", q.request_id);
		f->wait[w].deadline = now_ns() + (uint64_t)(q.timeout_s * 1e9);
		answer_waiters(f, now_ns());
		break;
	}
	case LMC_OP_FREE_LOOKUP_LOCKS:
		s = find_sess(f, q.key.request_id);
		if (s && s->lease && q.key.start < f->chunk &&
		    q.key.end / f->chunk >= s->hits)
			sess_unlock(f, s);
		reply_none(f, rt);
		break;
	case LMC_OP_END_SESSION:
		s = find_sess(f, q.request_id);
		if (s)
			sess_drop(f, s);
		reply_none(f, rt);
		break;
	case LMC_OP_CLEAR:
		/* Every (model, world) gets a new epoch: the chunks stored before are
		 * no longer any key's (they age out of the arena).  Not kept across a
		 * restart of kvtierd. */
		for (int i = 0; i < MAX_NS; i++)
			if (f->ns[i].used)
				f->ns[i].epoch++;
		for (int i = 0; i < MAX_SESS; i++)
			if (f->sess[i].state != S_FREE)
				sess_drop(f, &f->sess[i]);
		flog(f, KVT_LOG_LEVEL_INFO, "clear: earlier chunks are no longer served");
		reply_none(f, rt);
		break;
	case LMC_OP_REPORT_BLOCK_ALLOCATION:
		reply_none(f, rt);
		break;
	case LMC_OP_STORE:
		do_store(f, rt, &q);
		break;
	case LMC_OP_RETRIEVE:
		do_retrieve(f, rt, &q);
		break;
	default:
		break;
	}
	lmc_req_free(&q);
}

static int copy_small(struct small *s, zmq_msg_t *m)
{
	if (zmq_msg_size(m) > sizeof(s->b))
		return -1;
	s->n = (uint32_t)zmq_msg_size(m);
	memcpy(s->b, zmq_msg_data(m), s->n);
	return 0;
}

static void receive(lmc_front *f)
{
	zmq_msg_t m[MAX_FRAMES];
	size_t n = 0, more = 1;
	struct route rt;
	struct lmc_opname op;
	const void *pl[MAX_FRAMES];
	size_t pn[MAX_FRAMES];
	int fd = -1, pi, over = 0;

	while (more) {
		zmq_msg_t tmp, *x = n < MAX_FRAMES ? &m[n] : &tmp;
		size_t sz = sizeof(more);
		zmq_msg_init(x);
		if (zmq_msg_recv(x, f->sock, n ? 0 : ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(x);
			break;
		}
		if (n == 1) /* the identity frame is the socket's own: ask the first
			      * frame the peer sent */
			fd = zmq_msg_get(x, ZMQ_SRCFD);
		zmq_getsockopt(f->sock, ZMQ_RCVMORE, &more, &sz);
		if (x == &tmp) {
			zmq_msg_close(x);
			over = 1;
		} else {
			n++;
		}
	}
	if (n < 1)
		return;
	drain_monitor(f); /* before this message's fd is recorded: see the design comment */
	memset(&rt, 0, sizeof(rt));
	if (zmq_msg_size(&m[0]) > sizeof(rt.id.b))
		goto out;
	rt.id.n = (uint32_t)zmq_msg_size(&m[0]);
	memcpy(rt.id.b, zmq_msg_data(&m[0]), rt.id.n);
	pi = peer_of(f, &rt.id, fd);
	f->cur_peer = pi;
	if (n < 3 || copy_small(&rt.uid, &m[1]))
		goto out; /* not a request (a stream's ack has an empty op) */
	if (zmq_msg_size(&m[2]) == 0)
		goto out;
	if (copy_small(&rt.op, &m[2]) || lmc_decode_op(zmq_msg_data(&m[2]), zmq_msg_size(&m[2]), &op)) {
		atomic_fetch_add(&f->n_refused, 1);
		flog(f, KVT_LOG_LEVEL_WARN, "a request whose operation frame is not an int or a name");
		goto out;
	}
	if (pi < 0) {
		refuse_why(f, "%d clients are connected", MAX_PEERS);
		refuse(f, &rt, op.name);
		goto out;
	}
	if (over) {
		refuse_why(f, "more than %d frames", MAX_FRAMES);
		refuse(f, &rt, op.name);
		goto out;
	}
	for (size_t i = 3; i < n; i++) {
		pl[i - 3] = zmq_msg_data(&m[i]);
		pn[i - 3] = zmq_msg_size(&m[i]);
	}
	handle(f, &rt, &op, pl, pn, n - 3);
out:
	for (size_t i = 0; i < n; i++)
		zmq_msg_close(&m[i]);
}

static void sweep(lmc_front *f, uint64_t now)
{
	for (int i = 0; i < MAX_SESS; i++) {
		struct sess *s = &f->sess[i];
		if (s->state == S_FREE)
			continue;
		if (s->state == S_RUNNING && now >= s->next_look)
			look(f, s, now);
		if (s->lease && now - s->t_lease > LEASE_TTL_NS)
			sess_unlock(f, s);
		if (now - s->t0 > SESS_TTL_NS)
			sess_drop(f, s);
	}
}

static void *front_main(void *arg)
{
	lmc_front *f = arg;
	uint64_t last_sweep = 0;

	while (!atomic_load(&f->stop)) {
		zmq_pollitem_t it[2] = { { f->sock, 0, ZMQ_POLLIN, 0 }, { f->mon, 0, ZMQ_POLLIN, 0 } };
		int busy = 0, running = 0;
		uint64_t now;
		for (int i = 0; i < MAX_PEND && !busy; i++)
			busy = f->pend[i].used;
		for (int i = 0; i < MAX_WAIT && !running; i++)
			running = f->wait[i].used;
		zmq_poll(it, 2, busy ? 0 : running ? 5 : 50);
		if (it[1].revents & ZMQ_POLLIN)
			drain_monitor(f);
		for (int k = 0; k < 64 && (it[0].revents & ZMQ_POLLIN); k++) {
			int ev = 0;
			size_t sz = sizeof(ev);
			receive(f);
			zmq_getsockopt(f->sock, ZMQ_EVENTS, &ev, &sz);
			if (!(ev & ZMQ_POLLIN))
				break;
		}
		progress(f);
		now = now_ns();
		if (busy && !(it[0].revents & ZMQ_POLLIN))
			usleep(50);
		if (now - last_sweep > RELOOK_NS / 2) {
			sweep(f, now);
			last_sweep = now;
		}
		answer_waiters(f, now);
	}
	/* the copies in flight finish; every lease goes; every map goes */
	for (int i = 0; i < MAX_PEND; i++)
		if (f->pend[i].used) {
			struct pend *p = &f->pend[i];
			while (p->n_ops)
				kvt_wait(f->regs[p->reg].t, p->ops[--p->n_ops], -1);
			pend_finish(f, p);
		}
	for (int i = 0; i < MAX_SESS; i++)
		if (f->sess[i].state != S_FREE)
			sess_drop(f, &f->sess[i]);
	for (int i = 0; i < MAX_REGS; i++)
		if (f->regs[i].used)
			reg_close(f, &f->regs[i]);
	return NULL;
}

int lmc_start(const struct lmc_cfg *cfg, lmc_front **out, char *err, size_t err_len)
{
	lmc_front *f = calloc(1, sizeof(*f));
	struct kvt_config c;
	char ep[128];
	int r, one = 1, zero = 0;

	*out = NULL;
	if (!f) {
		snprintf(err, err_len, "out of memory");
		return -ENOMEM;
	}
	f->cfg = *cfg;
	snprintf(f->segment, sizeof(f->segment), "%s", cfg->segment);
	snprintf(f->segment_dir, sizeof(f->segment_dir), "%s", cfg->segment_dir ? cfg->segment_dir : "");
	snprintf(f->model, sizeof(f->model), "%s", cfg->model ? cfg->model : "");
	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.flags = KVT_F_NO_ENV | (cfg->group ? KVT_F_GROUP : 0);
	c.role = KVT_TIER_CLIENT;
	c.instance = -1;
	c.rank = -1;
	c.segment = f->segment;
	c.segment_dir = f->segment_dir[0] ? f->segment_dir : NULL;
	r = kvt_open(&c, &f->look);
	if (r) {
		snprintf(err, err_len, "attaching to segment '%s': %s", f->segment, kvt_last_error());
		free(f);
		return r;
	}
	{
		const struct kvt_geometry *g = kvt_seg_geometry(kvt__tier_seg(f->look));
		f->world = g->world;
		f->chunk = g->chunk_tokens;
		f->n_instances = g->n_instances;
		f->n_groups = g->n_groups;
		memcpy(f->seg_groups, g->groups, sizeof(f->seg_groups));
		f->mode_replicated = g->mode == KVT_MODE_REPLICATED;
		f->lease_cap = g->lease_max_chunks ? g->lease_max_chunks : 512;
	}
	f->ctx = zmq_ctx_new();
	f->sock = f->ctx ? zmq_socket(f->ctx, ZMQ_ROUTER) : NULL;
	if (!f->sock) {
		snprintf(err, err_len, "ZeroMQ: %s", zmq_strerror(zmq_errno()));
		r = -ENOMEM;
		goto fail;
	}
	zmq_setsockopt(f->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
	zmq_setsockopt(f->sock, ZMQ_LINGER, &zero, sizeof(zero));
	snprintf(ep, sizeof(ep), "tcp://%s:%u", cfg->addr, cfg->port);
	if (zmq_bind(f->sock, ep)) {
		snprintf(err, err_len, "binding %s: %s", ep, zmq_strerror(zmq_errno()));
		r = -zmq_errno();
		goto fail;
	}
	if (zmq_socket_monitor(f->sock, "inproc://kvtierd-lmcache-monitor", ZMQ_EVENT_DISCONNECTED) ||
	    !(f->mon = zmq_socket(f->ctx, ZMQ_PAIR)) ||
	    zmq_connect(f->mon, "inproc://kvtierd-lmcache-monitor")) {
		snprintf(err, err_len, "ZeroMQ's socket monitor: %s", zmq_strerror(zmq_errno()));
		r = -EIO;
		goto fail;
	}
	zmq_setsockopt(f->mon, ZMQ_LINGER, &zero, sizeof(zero));
	r = pthread_create(&f->thread, NULL, front_main, f);
	if (r) {
		snprintf(err, err_len, "starting its thread: %s", strerror(r));
		r = -r;
		goto fail;
	}
	*out = f;
	return 0;
fail:
	if (f->mon)
		zmq_close(f->mon);
	if (f->sock)
		zmq_close(f->sock);
	if (f->ctx)
		zmq_ctx_term(f->ctx);
	kvt_close(f->look);
	free(f);
	return r;
}

void lmc_stop(lmc_front *f)
{
	if (!f)
		return;
	atomic_store(&f->stop, 1);
	pthread_join(f->thread, NULL);
	zmq_socket_monitor(f->sock, NULL, 0);
	zmq_close(f->mon);
	zmq_close(f->sock);
	zmq_ctx_term(f->ctx);
	kvt_close(f->look);
	for (int b = 0; b < N_GPU_BACKENDS; b++) {
		for (int i = 0; i < MAX_GPUS; i++)
			kvt_dma_close(f->gpu[b][i]);
		kvt_dma_close(f->gpu_any[b]);
	}
	free(f);
}

void lmc_counts(lmc_front *f, struct lmc_counts *c)
{
	memset(c, 0, sizeof(*c));
	if (!f)
		return;
	c->requests = atomic_load(&f->n_requests);
	c->refused = atomic_load(&f->n_refused);
	c->registrations = atomic_load(&f->n_regs);
	c->lookups = atomic_load(&f->n_lookups);
	c->lookup_hit_chunks = atomic_load(&f->n_hit_chunks);
	c->stored_chunks = atomic_load(&f->n_stored);
	c->retrieved_chunks = atomic_load(&f->n_retrieved);
	c->retrieve_misses = atomic_load(&f->n_retrieve_misses);
	c->disconnects = atomic_load(&f->n_disconnects);
	c->clients = atomic_load(&f->n_clients);
	c->sessions = atomic_load(&f->n_sessions);
	c->leases = atomic_load(&f->n_leases);
}
