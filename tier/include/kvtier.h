/* kvtier.h - the engine-facing API of kvtier, a node-local shared-memory
 * KV-cache tier.  This header is the whole public API: libkvtier.so exports
 * exactly these functions (tier/libkvtier.map).
 *
 * Model.  One shared segment per node holds a chunk arena.  Every
 * tensor-parallel rank of an engine opens it as a RANK (it saves and loads
 * its own KV shard with GPU DMA), the engine's scheduler opens it as the
 * SCHEDULER of its instance (it looks chunks up and steps; it needs no GPU).
 * A chunk is `chunk_tokens` tokens; its key is a chained 128-bit hash of
 * the prefix (kvt_hash_tokens), so a key names the chunk and everything
 * before it.
 *
 *   scheduler: kvt_lookup(keys) -> hits + lease   (pins the hits)
 *              ... hand the lease id to the ranks with the request ...
 *              kvt_step(leases of this step)        (once per iteration)
 *   rank r:    kvt_load(lease, block tables) -> op; kvt_wait(op)
 *              kvt_save(keys, block tables) -> op;  kvt_poll(op) each step
 *
 * Conventions.  Every int function returns 0 or a count on success and a
 * negative errno on failure; it never sets errno.  kvt_strerror() turns a
 * code into a sentence; kvt_last_error() is the calling thread's message
 * for its last failure (it names the field, variable or value that was
 * wrong).  Objects come back through out-pointers set only on success.
 * Option structs start with their size; reserved fields must be zero and
 * unknown flag bits are rejected.
 *
 * Threads.  A kvt_tier handle may be used by one thread at a time (the
 * engine's rank thread or scheduler thread); use one handle per thread
 * otherwise.  kvt_strerror, kvt_last_error and kvt_hash_tokens are
 * thread-safe.  Nothing blocks except where a comment says so (open,
 * register, wait, close).
 */
#ifndef KVTIER_H
#define KVTIER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: kvt_lookup_ex (the disk tier's "ask again"), kvt_config.disk_chunks,
 * the disk fields of kvt_stats.  3: kvt_order_after.  4: the L3 tier in
 * kvt_lookup_ex (KVT_LOOKUP_DEPTH, kvt_lookup_res.first_depth).  5:
 * kvt_segment_model.  A caller
 * built against an earlier version keeps working unchanged: the library
 * speaks every one. */
#define KVT_API_VERSION 5

typedef struct kvt_tier kvt_tier;

#ifndef KVT_KEY_DEFINED
#define KVT_KEY_DEFINED
/* A 128-bit chunk key. */
typedef struct kvt_key {
	uint64_t lo, hi;
} kvt_key;
#endif

typedef uint64_t kvt_lease_id; /* 0: no lease */
typedef uint64_t kvt_op;       /* 0: nothing to wait for */

/* Roles (the values of core's enum kvt_role). */
#define KVT_TIER_RANK      1u
#define KVT_TIER_SCHEDULER 2u
#define KVT_TIER_CLIENT    3u /* tools and tests: may do what both do */

/* One layer group of the model's KV cache, as one rank holds it. */
struct kvt_group_desc {
	uint32_t n_layers;         /* >= 1 */
	uint32_t bytes_per_token;  /* per layer, per rank */
	uint32_t tokens_per_block; /* the engine's block size; divides chunk_tokens */
	uint32_t replicated;       /* 1: MLA-style, every rank holds the same bytes */
};

/* A block table entry that names no block: in kvt_load, that block of
 * the chunk is left as it is (see kvt_load).  Equal to the DMA core's
 * KVT_DMA_BLOCK_SKIP. */
#define KVT_BLOCK_SKIP UINT32_MAX

/* Flags of struct kvt_config. */
#define KVT_F_CREATE     0x01u /* create the segment (embedded owner) */
#define KVT_F_REPLACE    0x02u /* with CREATE: replace an existing segment */
#define KVT_F_NO_ENV     0x04u /* ignore KVTIER_* variables */
#define KVT_F_GROUP      0x08u /* with CREATE: mode 0660; to attach: accept a
				* group-writable segment (a world-writable one
				* is always refused) */
#define KVT_F_ANY_UID    0x10u /* attach to a segment of another uid */
#define KVT_F_PREFAULT   0x20u /* with CREATE: fault the arena in now */
#define KVT_F_MASK       0x3fu

/* Open options.  Zero means "from the environment (KVTIER_*), else the
 * default"; see the README's configuration table. */
struct kvt_config {
	size_t size;               /* sizeof(struct kvt_config) */
	uint32_t flags;            /* KVT_F_* */
	uint32_t role;             /* KVT_TIER_*; 0: $KVTIER_ROLE, else RANK */
	int32_t instance;          /* -1: $KVTIER_INSTANCE, else 0 */
	int32_t rank;              /* -1: $KVTIER_RANK (required for a rank) */
	uint32_t world;            /* 0: $KVTIER_WORLD (required for a rank) */
	uint32_t chunk_tokens;     /* 0: $KVTIER_CHUNK_TOKENS, else 256 */
	const char *segment;       /* NULL: $KVTIER_SEGMENT, else "kvtier" */
	const char *segment_dir;   /* NULL: $KVTIER_SEGMENT_DIR, else POSIX shm
				    * (/dev/shm) -- except that a creator that
				    * finds free huge pages puts the segment on
				    * their hugetlbfs mount, and an opener that
				    * does not find it in /dev/shm looks there */
	const char *model;         /* model identity (name, dtype...); enters
				    * the fingerprint; NULL: $KVTIER_MODEL, else "" */
	const char *dma;           /* NULL: $KVTIER_DMA, else "auto" */
	uint32_t max_inflight;     /* chunks per rank; 0: $KVTIER_MAX_INFLIGHT, else 32 */
	uint32_t n_groups;         /* 1..8 */
	const struct kvt_group_desc *groups;
	/* With KVT_F_CREATE: */
	uint32_t n_slots;          /* chunks; 0: from tier_bytes */
	uint32_t n_instances;      /* 0: $KVTIER_INSTANCES, else 1 */
	uint64_t tier_bytes;       /* 0: $KVTIER_TIER_GIB, else 1 GiB */
	uint64_t disk_chunks;      /* chunks the disk tier's index can hold
				    * (kvtierd sets it from its disk file);
				    * 0: no disk tier.  API version 2; a
				    * version-1 caller has 0 here */
	/* The library's own lines (placement, huge pages, the DMA backend,
	 * warnings), at the level $KVTIER_LOG_LEVEL lets through (default
	 * info): to log(log_arg, level, msg) -- KVT_LOG_LEVEL_* , msg one line
	 * without a newline, valid during the call -- instead of stderr
	 * ("kvtier: ...").  From kvt_open to kvt_close, on the caller's
	 * thread or the library's (copy threads, the witness).  NULL: stderr.
	 * (Was reserved[0..1]: an older caller has NULL here.) */
	void (*log)(void *log_arg, int level, const char *msg);
	void *log_arg;
	uint64_t reserved[1];      /* must be 0 */
};
enum { KVT_LOG_LEVEL_ERROR = 0, KVT_LOG_LEVEL_WARN = 1, KVT_LOG_LEVEL_INFO = 2,
       KVT_LOG_LEVEL_DEBUG = 3 };

/* Opens (and with KVT_F_CREATE creates) the tier; the handshake checks the
 * header against the library.  Returns 0, -EINVAL (a bad option or
 * variable: the message names it), -EPROTO (a corrupt or foreign
 * segment), -ESTALE (the segment holds another model or KV layout),
 * -EBUSY (this rank is attached by a live process), -ENOENT (no segment),
 * -ENOSPC (creating: the segment's memory could not be reserved -- the
 * filesystem's free space or the free huge pages are short; the message
 * gives both sizes), -EFBIG (creating: more than the filesystem or the
 * host could ever hold), -ENODEV/-ENOENT from the DMA backend (a rank with
 * no usable runtime), -ENOTSUP (header and library disagree on
 * KVT_API_VERSION).  Blocks (creating reserves and zero-fills the whole
 * segment). */
int kvt_open_v(const struct kvt_config *cfg, unsigned api_version, kvt_tier **out);
static inline int kvt_open(const struct kvt_config *cfg, kvt_tier **out)
{
	return kvt_open_v(cfg, KVT_API_VERSION, out);
}

/* Waits for this handle's operations, aborts unfinished saves, detaches.
 * NULL is ignored.  Blocks. */
void kvt_close(kvt_tier *t);

/* A rank's KV cache in device memory (host memory with the host backend),
 * per group: layer l's block b is at layer_base[l] + b * block_stride. */
struct kvt_group_buffers {
	const uint64_t *layer_base; /* n_layers addresses */
	uint64_t block_stride;      /* bytes */
	uint64_t n_blocks;          /* blocks per layer */
};

/* Registers the rank's KV cache (once) and the arena with its DMA backend.
 * 0, -EINVAL (shape does not match the groups given to open), -EALREADY,
 * -EPERM (a scheduler has no KV), backend errors.  Blocks (page-locking
 * the arena takes about 1 s per GB on 4 KiB pages). */
int kvt_register_kv(kvt_tier *t, uint32_t n_groups, const struct kvt_group_buffers *g);

/* Chunk keys of a token sequence (key format 2): key[i] = H(key[i-1] ||
 * H(tokens of chunk i)), key[-1] = H(layout fingerprint) (or *parent when
 * given), with XXH3-128 over little-endian bytes; the same tokens give the
 * same keys in every process, run and host.  Hashes the full chunks only
 * (the tail is recomputed by the engine).  Returns the number of keys
 * written (<= max_keys).  Runs at about XXH3's bulk speed (AVX2 where the
 * CPU has it).  Thread-safe. */
int kvt_hash_tokens(const kvt_tier *t, const uint32_t *tokens, size_t n_tokens,
		    const kvt_key *parent, kvt_key *keys, size_t max_keys);

/* Looks up a prompt's keys: the longest READY prefix, pinned under a new
 * lease.  Returns the number of hit chunks and *lease (0 when none), or
 * -ENOSPC (lease table full; nothing pinned).  Never blocks. */
int kvt_lookup(kvt_tier *t, const kvt_key *keys, uint32_t n, kvt_lease_id *lease);

/* A lookup that also reports the tiers below DRAM (API version 2; the
 * L3, version 4).
 *
 * The hits are the longest READY prefix, pinned under res->lease exactly
 * as kvt_lookup pins them.  res->pending counts the chunks right after
 * the hits that are not in DRAM yet but may be soon: the disk tier holds
 * them, they are being read back or got from the L3 (or were, and sit
 * behind a chunk that still is), or kvtierd's L3 was asked for them and
 * has not answered "missing" yet (for at most 2 s).  With
 * KVT_LOOKUP_PROMOTE the call asks kvtierd to read those chunks back into
 * the arena, from the disk or from the L3 store (over a unix socket beside
 * the segment, tier/l3/kvt_l3_chan.h), asynchronously; it never waits for
 * either.  The L3 is asked for a chunk at its prefix depth, so only by a
 * caller that says keys[0]'s depth: KVT_LOOKUP_DEPTH with
 * res->first_depth (0 for a prompt's keys from kvt_hash_tokens without a
 * parent).  Without it (a caller built against version 3 or earlier) the
 * lookup sees DRAM and the disk only, as before.  The scheduler then decides, per request: load the hits
 * now (pending chunks are recomputed), or release the lease and ask again
 * next step, when the promoted chunks are hits -- vLLM's "load
 * asynchronously / ask again" shape.  Asking again within ~200 ms does not
 * queue the same chunk twice.  A promotion can fail (a checksum mismatch,
 * no free slot): the chunk then stops being pending, so a scheduler that
 * asks again always converges; it should still bound its wait (a step
 * count or a deadline).  pending is 0 when the segment has neither a disk
 * tier nor an L3, or their engine is not running.  Returns res->hits, or -ENOSPC (lease table
 * full; nothing pinned, nothing asked), -EINVAL (NULL, bad flags or size).
 * Never blocks. */
#define KVT_LOOKUP_PROMOTE 0x1u
#define KVT_LOOKUP_DEPTH   0x2u  /* res->first_depth is keys[0]'s depth (in) */
#define KVT_LOOKUP_F_MASK  0x3u
struct kvt_lookup_res {
	size_t size;          /* sizeof(struct kvt_lookup_res) */
	kvt_lease_id lease;   /* the hits' lease, 0 when no hit */
	uint32_t hits;        /* READY chunks pinned under lease */
	uint32_t pending;     /* chunks after the hits coming from the disk or L3 */
	uint32_t requested;   /* of those, asked back by this call */
	uint32_t first_depth; /* in, with KVT_LOOKUP_DEPTH: keys[0]'s depth */
	uint64_t reserved[2];
};
int kvt_lookup_ex(kvt_tier *t, const kvt_key *keys, uint32_t n, uint32_t flags,
		  struct kvt_lookup_res *res);

/* Saves n chunks of this rank's KV: for chunk i, keys[i] at prefix depth
 * first_depth + i, from the blocks listed in tables[g][i * bpc(g) ..] where
 * bpc(g) = chunk_tokens / tokens_per_block(g) (tables[g] may be NULL for
 * g > 0: table 0 is used).  Chunks already saved or being saved are
 * skipped; chunks that find no space are dropped and counted.  Returns
 * the number of chunks it will write and *op (0 when none), -EINVAL (a
 * NULL op, keys or table), -EPERM (no KV registered).  Never blocks: what
 * does not fit in the in-flight window is queued and submitted by
 * kvt_poll/kvt_wait. */
int kvt_save(kvt_tier *t, const kvt_key *keys, uint32_t n, uint32_t first_depth,
	     const uint32_t *const *tables, kvt_op *op);

/* Orders the copies of the saves (and loads) that follow after the work
 * the engine has queued on `stream` so far: a save then copies what the
 * engine's kernels wrote, not what they are still writing, and a load
 * writes blocks no queued kernel still reads.  Call it before
 * kvt_save when the forward pass that writes the saved blocks may still
 * run (vLLM asks for its saves once it has launched the pass).  `stream`:
 * for the cuda backend a CUstream of the device's primary context, as
 * torch.cuda.current_stream().cuda_stream (0: the legacy default
 * stream); the host backend has nothing to order (0); the hsa backend
 * refuses (-ENOTSUP): synchronize the engine's stream on the host before
 * saving.  Saves queued by an earlier kvt_save and submitted later wait
 * too (for at least what they needed).  0, -EPERM (no KV registered),
 * -EINVAL (not a stream), -EIO (the runtime failed; the context may be
 * lost), -ENOTSUP. */
int kvt_order_after(kvt_tier *t, uint64_t stream);

/* Loads the first n chunks of a lease into the blocks of tables (as in
 * kvt_save).  A table entry KVT_BLOCK_SKIP leaves that block's tokens
 * where they are: nothing is written for them (a block the engine did not
 * give the request, such as vLLM's null block before a sliding window, or
 * one it computed itself); kvt_save refuses it (-EINVAL: chunks are saved
 * whole).  When every rank of the instance has loaded, the lease is
 * released.  Returns 0 and *op, -ESTALE (the lease is not live), -EINVAL
 * (n above the lease's hits, a NULL op or table, or not a lease id of this
 * segment: lease ids carry their segment's tag).  Never blocks (see
 * kvt_save). */
int kvt_load(kvt_tier *t, kvt_lease_id lease, uint32_t n,
	     const uint32_t *const *tables, kvt_op *op);

/* Progress and completion.  kvt_poll: 0 (done; the op is consumed),
 * -EINPROGRESS, or the op's error (-EIO: a copy failed; for a save the
 * chunk is not published, for a load the blocks are not valid; consumed).
 * kvt_wait: the same, waiting up to timeout_ns (< 0: forever; -ETIMEDOUT
 * leaves the op live).  -ESTALE: not a live op. */
int kvt_poll(kvt_tier *t, kvt_op op);
int kvt_wait(kvt_tier *t, kvt_op op, int64_t timeout_ns);

/* Releases a lease (request aborted).  0; -EALREADY when it was released
 * already (counted as a double unpin, nothing else changes); -EINVAL for
 * an id that is not a lease of this segment.  Never blocks: if a pin
 * repair froze one of its chunks, it waits only while the repairing
 * process lives, and finishes a dead one's repair itself. */
int kvt_release(kvt_tier *t, kvt_lease_id lease);

/* One scheduler iteration: `live` are the leases in this step's load set.
 * A lease of this instance absent for two consecutive steps is released
 * (counted as a stale unpin).  Returns how many were released; -EINVAL
 * when live is NULL and n is not 0.  Never blocks (see kvt_release). */
int kvt_step(kvt_tier *t, const kvt_lease_id *live, uint32_t n);

/* Reaps dead processes' state (their claims, pins, leases).  A process is
 * dead when the kernel dropped its entry's lock on the segment file: in
 * any PID namespace, whatever /proc shows.  Returns the number reaped.
 * May wait briefly for a live process to finish the step it is in. */
int kvt_reap(kvt_tier *t);

/* Counters (summed over every process of the segment) and occupancy. */
struct kvt_stats {
	size_t size;  /* sizeof(struct kvt_stats), set by the caller */
	uint64_t lookups, lookup_chunks, hit_chunks, hit_tokens;
	uint64_t saved_chunks, save_skips, save_nospc, loaded_chunks;
	uint64_t bytes_saved, bytes_loaded, evictions, stale_unpins;
	uint64_t double_unpins, reaped_ranks, dma_errors;
	uint64_t slots, slots_free, slots_filling, slots_ready, slots_pinned;
	uint64_t leases_live;
	uint64_t chunk_bytes; /* one rank's shard of one chunk */
	uint32_t chunk_tokens, world;
	/* API version 2 (a version-1 caller's smaller size gets the fields
	 * above only): the disk tier. */
	uint64_t disk_chunks, disk_used;       /* index capacity, chunks on disk */
	uint64_t disk_writes, disk_reads;      /* chunks demoted, promoted */
	uint64_t disk_bytes_written, disk_bytes_read;
	uint64_t disk_checksum_errors, disk_admit_rejects, disk_evictions;
	uint64_t promote_requests, promote_drops;
	uint32_t disk_online, reserved0;
};
/* Size of struct kvt_stats in API version 1. */
#define KVT_STATS_V1_SIZE 192
int kvt_stats(kvt_tier *t, struct kvt_stats *out);

/* Removes the segment `name`: <dir>/kvtier.<name> when dir is given, else
 * POSIX shm and, where it is not there, the hugetlbfs mounts a creator
 * puts segments on (as kvt_open looks for them).  Processes that have it
 * mapped keep working on their copy until they close.  0, -ENOENT (no such
 * segment), -EINVAL (a bad name or dir), -EISDIR (a directory is there: left
 * alone), another -errno (permission).  Needs no handle; blocks on no one. */
int kvt_unlink(const char *name, const char *dir);

/* The identity fields of a model's files for the model text
 * (kvt_config.model / KVTIER_MODEL), which enters the layout fingerprint:
 * "rev=COMMIT;config=HEX" for a config.json in a Hugging Face snapshot,
 * else "weights=HEX;config=HEX" (HEX: XXH3-128 of config.json's bytes; of
 * the weight files' names, sizes and mtimes).  The vLLM connector and
 * kvtierd --model-config both append it, so that engines and the daemon
 * agree on a model by its files, and a checkpoint rewritten in place is
 * another model.  The length written (without the NUL), or -errno
 * (-ENOENT: no such file; -ENOSPC: len too small).  Thread-safe. */
int kvt_model_files_id(const char *config_path, char *out, size_t len);

/* The layout fingerprint (seed of the key chain). */
void kvt_fingerprint(const kvt_tier *t, kvt_key *out);

/* The model text the segment's creator gave (its identity: the text whose
 * hash is in the fingerprint), into buf, NUL-terminated, bounded (at most
 * 1023 bytes) and with every byte outside printable ASCII as '?'; "" when
 * the segment did not record one.  For a process that attached without
 * describing the layout (n_groups 0) and must check whose segment it
 * joined.  The length written (without the NUL), or -EINVAL.  API
 * version 5. */
int kvt_segment_model(const kvt_tier *t, char *buf, size_t len);

/* A sentence for a negative errno code. */
const char *kvt_strerror(int err);
/* The calling thread's message for its last failure. */
const char *kvt_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* KVTIER_H */
