/* kvt_core.h - the shared segment: format, index, slots, pins, leases,
 * eviction, rank table, counters.  Internal API of kvtier (engines use
 * tier/include/kvtier.h); depends on libc and pthreads only.
 *
 * Conventions (STYLE.md): every int function returns 0 or a count on
 * success and -errno on failure, never touches errno's value for the
 * caller, and sets the calling thread's last-error message on failure
 * (kvt_core_last_error()).  Handles are per process (or per thread: two
 * handles in one process are independent attachments).  Unless said
 * otherwise a function is lock-free, never blocks, and may be called from
 * any thread that owns the handle; one handle must not be used by two
 * threads at once.
 */
#ifndef KVT_CORE_H
#define KVT_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVT_NAME_MAX       64   /* segment name: [A-Za-z0-9._-]{1,64}, not ".." */
#define KVT_MAX_WORLD      64   /* shard masks are 64-bit */
#define KVT_MAX_GROUPS     8
#define KVT_MAX_INSTANCES  16
#define KVT_MAX_CLIENTS    32   /* table entries for tools, benches, tests */

typedef struct kvt_seg kvt_seg;

/* A 128-bit chunk key.  Keys are chained prefix hashes: equal keys mean
 * equal chunk *and* equal prefix.  (Also defined, identically, by kvtier.h.) */
#ifndef KVT_KEY_DEFINED
#define KVT_KEY_DEFINED
typedef struct kvt_key {
	uint64_t lo, hi;
} kvt_key;
#endif

enum kvt_mode {
	KVT_MODE_SHARDED    = 0, /* each rank holds different heads: world shards */
	KVT_MODE_REPLICATED = 1, /* MLA / DP attention: one shared shard */
};

struct kvt_layer_group {
	uint32_t layers;          /* layers in the group */
	uint32_t bytes_per_token; /* per layer, for one rank */
};

/* Geometry, fixed when the segment is created. */
struct kvt_geometry {
	uint32_t chunk_tokens;     /* tokens per chunk, >= 1 */
	uint32_t world;            /* shards of one model replica, 1..64 */
	uint32_t n_instances;      /* engine instances sharing it, 1..16 */
	uint32_t mode;             /* enum kvt_mode */
	uint32_t n_groups;         /* 1..KVT_MAX_GROUPS */
	struct kvt_layer_group groups[KVT_MAX_GROUPS];
	kvt_key model_id;          /* caller's model identity (enters the fingerprint) */
	uint32_t n_slots;          /* chunks the arena holds, 1..2^30 */
	uint32_t n_leases;         /* concurrent lookups, 0 = default (1024) */
	uint32_t lease_max_chunks; /* chunks one lookup can pin, 0 = default (512) */
	uint32_t fill_timeout_ms;  /* a FILLING slot that no writer holds (some
				    * rank never saved its shard) is reclaimed
				    * after this; 0 = default (5000): ranks of
				    * one engine save a chunk in the same step */
	uint32_t disk_chunks;      /* chunks the disk tier's index holds (the
				    * disk engine's file, see kvt_disk_*); 0 =
				    * no disk tier.  Capacity: not part of the
				    * fingerprint */
	uint32_t reserved0;        /* must be 0 */
};

/* Bytes of one shard of one chunk (what one rank writes), as stored:
 * rounded up to 64 bytes, or to 4096 when it is at least 4096. */
uint64_t kvt_geometry_shard_bytes(const struct kvt_geometry *g);

/* Segment flags. */
#define KVT_SEG_F_GROUP     0x1u /* create: mode 0660 instead of 0600; attach:
				   * accept a group-writable segment */
#define KVT_SEG_F_REPLACE   0x2u /* create: remove an existing segment first */
#define KVT_SEG_F_PREFAULT  0x4u /* create: fault the arena in now */
#define KVT_SEG_F_ANY_UID   0x8u /* attach: accept a segment of another uid */
#define KVT_SEG_F_DEPTH_FIRST 0x10u /* create: eviction prefers deeper cold
				     * chunks (prefix-aware; see slots.c) */
#define KVT_SEG_F_MASK      0x1fu

enum kvt_role {
	KVT_ROLE_OBSERVER  = 0, /* read-only: stats, check; no table entry */
	KVT_ROLE_RANK      = 1, /* (instance, rank): saves its shard, loads */
	KVT_ROLE_SCHEDULER = 2, /* one per instance: lookup, step, release */
	KVT_ROLE_CLIENT    = 3, /* tools, benches, tests: may do everything */
};

struct kvt_seg_attach_opts {
	size_t size;            /* sizeof(struct kvt_seg_attach_opts) */
	const char *name;       /* segment name */
	const char *dir;        /* NULL: POSIX shm; else a directory (hugetlbfs) */
	uint32_t role;          /* enum kvt_role */
	uint32_t instance;      /* RANK and SCHEDULER */
	uint32_t rank;          /* RANK */
	uint32_t world;         /* expected world size; 0 = any (required for RANK) */
	uint32_t flags;         /* KVT_SEG_F_ANY_UID */
	const kvt_key *fingerprint; /* expected layout fingerprint, NULL = any */
	const struct kvt_geometry *geo; /* the layout behind fingerprint (NULL:
				     * unknown): a mismatch then names the
				     * fields that differ */
	const char *model;      /* the model's description behind geo's model_id
				 * (NULL: unknown): kept in a segment this
				 * process creates (past KVT_MODEL_TEXT - 1
				 * bytes, cut), named beside the segment's in a
				 * mismatch */
};

struct kvt_seg_create_opts {
	size_t size;            /* sizeof(struct kvt_seg_create_opts) */
	const char *name;
	const char *dir;        /* NULL: POSIX shm; else a directory (hugetlbfs) */
	const struct kvt_geometry *geo;
	uint32_t flags;         /* KVT_SEG_F_GROUP | _REPLACE | _PREFAULT */
	uint32_t reserved;      /* must be 0 */
	/* Optional: called once the object is sized and mapped, before its
	 * arena is reserved and before any other process can attach.  The
	 * handle has no table entry yet; kvt_seg_arena() and the accessors
	 * work.  NUMA binding goes here, so that the pages are placed where
	 * the binding says when they are reserved (and may be pre-faulted
	 * here, through the bound mapping).  A negative return fails the
	 * creation with that code; nothing is left behind. */
	int (*prepare)(kvt_seg *s, void *arg);
	void *prepare_arg;
};

/* Bytes of the whole segment a geometry makes (defaults applied); 0 when
 * the geometry is invalid. */
uint64_t kvt_geometry_segment_bytes(const struct kvt_geometry *g);

/* The layout fingerprint a segment of this geometry carries (a hash of
 * chunk_tokens, world, mode, groups and model_id). */
void kvt_geometry_fingerprint(const struct kvt_geometry *g, kvt_key *out);

/* Validates a segment name: [A-Za-z0-9._-], 1..64 chars, not "." or "..".
 * Returns 0 or -EINVAL. */
int kvt_seg_name_valid(const char *name);

/* Creates the segment and attaches to it as described by *a (NULL: as a
 * client).  Its memory is reserved before anyone can attach: on tmpfs (and
 * other filesystems) with fallocate, the arena after `prepare`; on
 * hugetlbfs by the creator's mapping, which reserves the huge pages.  So a
 * segment that does not fit fails here with -ENOSPC and a message with
 * both sizes, and no process ever faults on an unbacked page of it.
 * -EEXIST when it exists (unless KVT_SEG_F_REPLACE), -EINVAL for a bad name
 * or geometry, -EFBIG when it exceeds what the filesystem could ever hold,
 * -ENOSPC when its free space or free huge pages are short, -errno of
 * shm_open/ftruncate/mmap/fallocate otherwise.  On failure nothing is left
 * behind.  Blocks (system calls; reserving zero-fills the memory). */
int kvt_seg_create(const struct kvt_seg_create_opts *c,
		   const struct kvt_seg_attach_opts *a, kvt_seg **out);

/* Attaches to an existing segment.  Validates every header field before use:
 * -ENOENT (no segment), -EPROTO (bad magic / version / layout / checksum),
 * -EINVAL (field out of range, world or rank mismatch), -EPERM (another
 * uid), -EBUSY (the (instance, rank) is attached by a live process),
 * -ESTALE (fingerprint differs).  The message names the field.  A dead
 * previous holder of the same entry is reaped first. */
int kvt_seg_attach(const struct kvt_seg_attach_opts *a, kvt_seg **out);

/* Releases the table entry (its leases stay; its shard claims are
 * aborted), drops its liveness lock and unmaps.  Always succeeds for a
 * valid handle.  A handle inherited across fork() is inert in the child:
 * every call that needs the table entry fails with -EPERM there, and its
 * detach only unmaps (the entry stays the parent's). */
int kvt_seg_detach(kvt_seg *s);

/* Writes into the arena that outlive a process.  A DMA or an I/O started
 * on a claim's behalf may still land after its submitter died or gave up
 * (an io_uring read completes after the process is gone; the ring's
 * teardown is asynchronous).  The handle's liveness token -- its entry and
 * owner locks -- lives on one open file description, returned here (-1
 * for an inherited handle): a process that registers it with something
 * the kernel keeps referenced until its last write landed (io_uring's
 * registered files: the ring drops them only after every request
 * finished) keeps its entry alive, hence its claims, exactly that long.
 * Never close it, never map it, never I/O through it. */
int kvt_seg_lock_fd(const kvt_seg *s);

/* The exit witness (witness.c): a GPU copy may still land in the arena
 * after its rank was killed, until the driver tore the rank's context
 * down in the rank's exit.  This spawns kvtier-witness, a process that
 * holds the handle's lock description until the rank has wholly exited
 * (its pidfd polls readable: every file released, the driver's too), so
 * the entry and its claims outlive every such copy.  Idempotent; a clean
 * detach stops it.  0, or -errno with the reason: -ENOENT no helper (it
 * is looked for at $KVTIER_WITNESS_HELPER, next to the library, then where
 * it is installed), -ENOSYS no pidfds (Linux < 5.3), -ECHILD the helper
 * did not start.  The rank and its witness killed together (a whole
 * cgroup at once) is covered by kvtierd's hold, when it runs
 * (kvt_seg_witness_daemon). */
int kvt_seg_witness(kvt_seg *s);
/* The witness's pid (tests, status), 0 when none. */
int kvt_seg_witness_pid(const kvt_seg *s);
/* A witness for another process that can write into the arena through
 * fd's description -- kvtierd's Mooncake companion, whose RDMA transfers
 * the NIC may still land after its threads died, until its verbs device
 * is released in its exit (tier/l3/l3_mooncake.c): holds fd's open file
 * description (the handle's lock, kvt_seg_lock_fd) until the process of
 * pidfd has wholly exited (the helper looked for as by kvt_seg_witness).
 * 0 with *pid and *wpidfd (the witness's pidfd) set; the caller waits for
 * it once the process exited.  -errno with the reason
 * (kvt_core_last_error). */
int kvt_witness_for(int fd, int pidfd, const char *name, int *pid, int *wpidfd);
/* Whether kvtierd holds the lock description too (witness_srv.c): the
 * witness also asks the segment's kvtierd, when one listens beside the
 * segment's file, to hold it until this process has wholly exited, which
 * covers a kill of the rank's whole cgroup.  1: it does; 0: it does not,
 * with the reason in why (no daemon, it refused, no answer). */
int kvt_seg_witness_daemon(const kvt_seg *s, char *why, size_t len);

/* The path of a file beside the segment's own (the directory its file is
 * in, as this process opened it): prefix + the segment's name, e.g.
 * "kvtier-l3." for the L3 channel.  A socket there is seen by every
 * process that sees the segment, whatever its PID or network namespace.
 * 0, -EINVAL (a prefix with '/'), -ENOENT (the file was unlinked),
 * -ENAMETOOLONG. */
int kvt_seg_side_path(const kvt_seg *s, const char *prefix, char *out, size_t len);
/* The uid owning the segment's file, -1 when it cannot be read. */
long long kvt_seg_file_uid(const kvt_seg *s);
/* Listens there (the caller owns the segment): a non-blocking
 * SOCK_SEQPACKET socket with the segment file's permissions, a dead
 * predecessor's file replaced.  The descriptor, the path in path; or
 * -errno with kvt_core_last_error(). */
int kvt_seg_side_listen(const kvt_seg *s, const char *prefix, char *path, size_t len);

/* kvtierd's side of the witness (witness_srv.c): a unix socket beside the
 * segment's file on which ranks hand it their lock description and pidfd.
 * Opened by the segment's owner; `max` ranks at most at once.  Poll
 * kvt_wsrv_fd for POLLIN and call kvt_wsrv_service, which never blocks. */
typedef struct kvt_wsrv kvt_wsrv;
int kvt_wsrv_open(const kvt_seg *owner, uint32_t max, kvt_wsrv **out);
int kvt_wsrv_fd(const kvt_wsrv *w);
const char *kvt_wsrv_path(const kvt_wsrv *w);
int kvt_wsrv_service(kvt_wsrv *w);
/* held: ranks held now (a dead one until it wholly exited); exited: holds
 * ended by the rank's exit; byes: by its clean detach; refused: bad
 * requests and requests past max. */
void kvt_wsrv_counts(const kvt_wsrv *w, uint32_t *held, uint64_t *exited,
		     uint64_t *byes, uint64_t *refused);
/* Closes every hold and removes the socket. */
void kvt_wsrv_close(kvt_wsrv *w);

/* Marks the handle so that its detach leaves its entry to the reaper: the
 * claims, pins and leases stay as they are, the lock is not released but
 * only our descriptor of it closed; the entry dies when the last holder of
 * that description (a ring with I/O in flight) lets go, and is reaped
 * then.  For a caller that gave up waiting for writes into claimed
 * sub-slots (kvt_disk_close on a time-out). */
void kvt_seg_leave_to_reaper(kvt_seg *s);

/* Removes the name (mappings stay valid).  0, -ENOENT, -EINVAL. */
int kvt_seg_unlink(const char *name, const char *dir);

/* Thread-local description of the last failure in this thread. */
const char *kvt_core_last_error(void);

/* Accessors. */
const struct kvt_geometry *kvt_seg_geometry(const kvt_seg *s);
void kvt_seg_fingerprint(const kvt_seg *s, kvt_key *out);
uint64_t kvt_seg_shard_bytes(const kvt_seg *s);
/* chunk_tokens x sum(layers x bytes_per_token): the payload of one shard. */
uint64_t kvt_seg_chunk_bytes(const kvt_seg *s);
uint32_t kvt_seg_n_shards(const kvt_seg *s); /* world (sharded) or 1 */
uint32_t kvt_seg_entry(const kvt_seg *s);    /* own table entry, UINT32_MAX if none */
void *kvt_seg_base(const kvt_seg *s);
uint64_t kvt_seg_size(const kvt_seg *s);
/* The arena, or the part of it that holds one shard's sub-slots (rank-major,
 * each part 2 MiB aligned).  shard = UINT32_MAX: the whole arena. */
int kvt_seg_arena(const kvt_seg *s, uint32_t shard, void **ptr, uint64_t *len);
/* Address of sub-slot (slot, shard); NULL when out of range. */
void *kvt_slot_shard_ptr(const kvt_seg *s, uint32_t slot, uint32_t shard);

/* ---- saving (writers) ------------------------------------------------ */

struct kvt_wref {
	uint32_t slot;
	uint32_t shard;
	uint64_t gen;
};

#define KVT_SKIP 1 /* returned by kvt_write_begin: nothing to write */

/* Finds or allocates the slot for key and claims the caller's shard.
 * Returns 0 with *w set: write the shard at kvt_slot_shard_ptr(), then call
 * kvt_write_end().  KVT_SKIP: the shard is ready or being written (dedupe).
 * -ENOSPC: nothing could be evicted (never waits).  -EINVAL: bad shard.
 * -EPERM: the handle has no table entry.  Lock-free, never blocks. */
int kvt_write_begin(kvt_seg *s, const kvt_key *key, uint32_t depth,
		    uint32_t shard, struct kvt_wref *w);

/* Ends a write.  ok != 0: the shard's data is complete; sets its ready bit
 * and publishes the chunk when the mask is full.  ok == 0: aborts the
 * claim.  Returns 0, 1 when this call made the chunk READY, -ESTALE when the
 * slot was reclaimed meanwhile (the data was dropped). */
int kvt_write_end(kvt_seg *s, const struct kvt_wref *w, int ok);

/* ---- lookups and leases ------------------------------------------------ */

/* Walks keys in order, stops at the first absent or not-READY key, pins
 * every hit and records the pins in a new lease.  Returns the number of hit
 * chunks (>= 0) and *lease (0 when no hit), or -ENOSPC (lease table full;
 * nothing pinned), -EPERM (no table entry).  At most lease_max_chunks hits
 * are taken.  Lock-free, never blocks. */
int kvt_seg_lookup(kvt_seg *s, const kvt_key *keys, uint32_t n, uint64_t *lease);

/* Lease ids carry a tag of their segment (from its random id), the lease
 * index and the low bits of the lease's generation: every function below
 * returns -EINVAL for an id that is not a lease of this segment. */

/* The slots (and generations) a lease pinned, in key order.  Returns the
 * count, -ESTALE if the lease id is not live. */
int kvt_lease_slots(kvt_seg *s, uint64_t lease, uint32_t *slots,
		    uint64_t *gens, uint32_t max);

/* Rank `rank` of the lease's instance finished loading: sets its loaded
 * bit; when every rank of the world has loaded, releases the lease.
 * Returns 0, 1 when this call released it, -ESTALE (not live). */
int kvt_lease_loaded(kvt_seg *s, uint64_t lease, uint32_t rank);

/* Releases explicitly (abort).  Returns 0; a lease that is no longer live
 * is counted as a double unpin and returns -EALREADY, changing nothing.
 * Waits only while a live process repairs one of its slots' pins (a dead
 * repairer's repair it finishes itself). */
int kvt_lease_release(kvt_seg *s, uint64_t lease);

/* One scheduler step for the handle's instance: leases of the instance
 * absent from `live` for two consecutive steps are released and counted as
 * stale unpins.  Returns how many were released, -EINVAL when live is NULL
 * with n > 0. */
int kvt_seg_step(kvt_seg *s, const uint64_t *live, uint32_t n);

/* ---- liveness and repair ------------------------------------------------ */

/* Reaps every table entry whose holder is dead (its liveness lock is free:
 * the kernel's word, not a guess from /proc, in any PID namespace): fixes
 * pins left ambiguous by an interrupted pin/unpin or pin repair, drops its
 * shard claims and reclaims slots it left FILLING, releases its leases
 * (and those of its instance still waiting for its load).  Returns the
 * number of entries reaped.  Callable by any attached process; may wait
 * briefly (yield) for a live process to finish the one two-store step it
 * is in on a slot being repaired, never for a dead one. */
int kvt_seg_reap(kvt_seg *s);

/* How an entry's last holder left it (kvt_entry_info.left). */
enum kvt_left {
	KVT_LEFT_UNKNOWN = 0,  /* attached, never held, or an older library */
	KVT_LEFT_DETACHED = 1, /* its holder detached */
	KVT_LEFT_REAPED = 2,   /* died holding nothing: reaped, nothing repaired */
	KVT_LEFT_REPAIRED = 3, /* died mid-operation: a reaper repaired it */
};

/* What one reaped entry left behind (kvt_seg_reap_report).  All zero: it
 * died holding nothing -- an exit without a detach, with nothing to repair
 * (a process its parent killed at shutdown between its last operation and
 * its detach). */
struct kvt_reaped {
	uint32_t entry, role, instance, rank; /* as kvt_entry_info has them */
	int pid;         /* 0: unknown (a reaper of it died mid-reap) */
	uint32_t in_op;  /* 1: it died inside a pin, unpin or pin repair */
	uint32_t slots;  /* slots it was writing, evicting or repairing */
	uint32_t leases; /* leases released for it (its own, and its
			  * instance's that waited for its load) */
};
/* kvt_seg_reap, calling cb (when not NULL) once per reaped entry, after its
 * repair and before the entry is reused. */
int kvt_seg_reap_report(kvt_seg *s, void (*cb)(void *arg, const struct kvt_reaped *r),
			void *arg);

/* Rank processes attached to the segment and alive (every instance; the
 * callers' own entry included; schedulers and clients not counted): what
 * shares the node's CPUs with this process.  A snapshot; -EINVAL. */
int kvt_seg_live_ranks(const kvt_seg *s);

/* Checks the invariants (slots conserved, index <-> slot agreement, at most
 * one live slot per key, pin counts equal to live lease references, masks
 * in range).  Meaningful on a quiescent segment.  0, or -EUCLEAN with a
 * description in msg. */
int kvt_check(kvt_seg *s, char *msg, size_t len);

/* ---- counters -------------------------------------------------------- */

enum kvt_counter {
	KVT_C_LOOKUPS, KVT_C_LOOKUP_CHUNKS, KVT_C_HIT_CHUNKS, KVT_C_HIT_TOKENS,
	KVT_C_SAVED_CHUNKS, KVT_C_SAVE_SKIPS, KVT_C_SAVE_NOSPC,
	KVT_C_LOADED_CHUNKS, KVT_C_BYTES_SAVED, KVT_C_BYTES_LOADED,
	KVT_C_EVICTIONS, KVT_C_STALE_UNPINS, KVT_C_DOUBLE_UNPINS,
	KVT_C_REAPED_RANKS, KVT_C_FILL_ABORTS, KVT_C_FILL_TIMEOUTS,
	KVT_C_LEASES_FULL, KVT_C_INDEX_FULL, KVT_C_DISK_WRITES, KVT_C_DISK_READS,
	KVT_C_DMA_ERRORS,
	KVT_C_LOST_CLAIMS,  /* write_end found its claim gone: must stay 0 */
	KVT_C_PIN_REPAIRS,  /* pin counts recounted after a death */
	KVT_C_ADOPTED,      /* half-done steps of dead processes finished by a waiter */
	/* The disk tier (counted by the disk engine, requests by lookups). */
	KVT_C_DISK_BYTES_WRITTEN, KVT_C_DISK_BYTES_READ,
	KVT_C_DISK_ADMIT_REJECTS, /* READY chunks the admission policy kept off the disk */
	KVT_C_DISK_CSUM_ERRORS,   /* reads whose checksum did not match: a miss, never served */
	KVT_C_DISK_EVICTIONS,     /* chunks dropped from a full disk */
	KVT_C_DISK_WRITE_DROPS,   /* demotions abandoned: the slot changed under the write, or an I/O error */
	KVT_C_PROMOTE_REQUESTS,   /* disk chunks lookups asked back */
	KVT_C_PROMOTE_DROPS,      /* promotions not done: ring full, no slot, stale request */
	/* Chunks a lookup hit that a rank of another instance saved (the
	 * slot's allocator, read when pinned: a statistic).  An instance that
	 * looks up while others save and never hits one of theirs computes
	 * other keys, or serves other prompts: kvtierd's "unshared" alarm. */
	KVT_C_SHARED_HITS,
	KVT_C__COUNT
};
const char *kvt_counter_name(enum kvt_counter c);
/* Adds to a counter of the handle's block (relaxed; other layers use it
 * for bytes saved/loaded, disk traffic). */
void kvt_counter_add(kvt_seg *s, enum kvt_counter c, uint64_t v);
/* Sums every block. */
void kvt_counters_read(const kvt_seg *s, uint64_t out[KVT_C__COUNT]);

/* Occupancy snapshot (for stat tools; racy by nature). */
struct kvt_occupancy {
	uint64_t free, filling, ready, evicting, pinned, leases_live, ranks_live;
};
void kvt_occupancy_read(const kvt_seg *s, struct kvt_occupancy *o);

/* ---- latency histograms ------------------------------------------------
 * Every counter block holds one histogram per kind: bucket i < 25 counts
 * latencies <= 1 us x 2^i (1 us .. 16.8 s), bucket 25 the rest; with their
 * count and sum in ns.  Each process counts into its own block (relaxed,
 * one writer), readers sum them: a daemon sees every process's latencies
 * without a message. */
enum kvt_hist {
	KVT_H_LOOKUP, KVT_H_SAVE, KVT_H_LOAD, KVT_H_DISK_READ, KVT_H_DISK_WRITE,
	KVT_H__COUNT
};
#define KVT_HIST_BUCKETS 26
struct kvt_hist_snap {
	uint64_t bucket[KVT_HIST_BUCKETS]; /* not cumulative */
	uint64_t count, sum_ns;
};
const char *kvt_hist_name(enum kvt_hist h);
/* Upper bound of bucket i in ns; UINT64_MAX for the last. */
uint64_t kvt_hist_bound_ns(uint32_t i);
/* Counts one latency into the handle's block (an observer's go to the
 * shared observer block, which races; observers do not time anything). */
void kvt_hist_add(kvt_seg *s, enum kvt_hist h, uint64_t ns);
/* Sums block `entry` (UINT32_MAX: every block).  0, -EINVAL. */
int kvt_hist_read(const kvt_seg *s, uint32_t entry, enum kvt_hist h,
		  struct kvt_hist_snap *out);

/* ---- the rank table, read by tools ------------------------------------ */

/* Table entries: instance i's ranks are i x (world + 1) + r, its scheduler
 * i x (world + 1) + world; then KVT_MAX_CLIENTS client entries. */
uint32_t kvt_seg_n_entries(const kvt_seg *s);

enum kvt_entry_state {
	KVT_ENTRY_EMPTY = 0, KVT_ENTRY_ATTACHED = 1, /* and alive */
	KVT_ENTRY_DEAD = 2,     /* left by a dead process: the reaper frees it */
	KVT_ENTRY_BUSY = 3,     /* being attached, detached or reaped now */
};
struct kvt_entry_info {
	uint32_t role;          /* enum kvt_role, by position (clients: as stored) */
	uint32_t instance, rank;/* rank: UINT32_MAX for schedulers and clients */
	uint32_t state;         /* enum kvt_entry_state */
	int pid;                /* as the holder's PID namespace numbers it; 0 */
	uint32_t left;          /* EMPTY: how its last holder left (kvt_left) */
	uint64_t attach_gen;    /* attaches of this entry since creation */
	uint64_t heartbeat_ns;  /* CLOCK_MONOTONIC of the holder's last sign */
	uint64_t start;         /* the holder's start time (/proc/PID/stat field
				 * 22 as its namespace saw it; 0 unknown) */
};
/* A snapshot of entry e (liveness from its lock, as the reaper decides it).
 * 0, -EINVAL (e out of range), -EUCLEAN (a state word out of range). */
int kvt_seg_entry_info(const kvt_seg *s, uint32_t e, struct kvt_entry_info *out);
/* Counters of block e alone (e == n_entries: the observers' block). */
int kvt_seg_entry_counters(const kvt_seg *s, uint32_t e, uint64_t out[KVT_C__COUNT]);
/* Refreshes the handle's heartbeat (a relaxed store; kvt_seg_reap does it
 * too).  Tools show its age; liveness never depends on it. */
void kvt_seg_heartbeat(kvt_seg *s);

/* ---- the owner (kvtierd) -----------------------------------------------
 * At most one process owns a segment: it holds an OFD lock on the owner
 * word's byte of the segment file, dropped by the kernel when it dies.
 * While the owner drains, attaches (other than observers) fail with
 * -ESHUTDOWN; a drain flag left by a dead owner is ignored. */
/* Takes ownership: 0, -EBUSY (a live process owns it: the message names
 * its pid), -EPERM (no descriptor: an inherited handle). */
int kvt_seg_own(kvt_seg *s);
/* kvt_seg_own, retried for up to ms while the owner's pid is not one this
 * process can see: a dead owner whose ring or driver still holds its lock
 * descriptor (kvt_seg_lock_fd) stays the owner until its last write into
 * the arena landed -- usually milliseconds, the device's latency at most.
 * An owner this namespace sees alive fails at once (-EBUSY). */
int kvt_seg_own_wait(kvt_seg *s, int ms);
/* The owner's pid (1..) when a live process owns the segment, else 0.
 * The caller's own ownership counts. */
int kvt_seg_owner(const kvt_seg *s);
/* Owner only: on != 0 refuses new attaches, 0 accepts them again.
 * 0, -EPERM (not the owner). */
int kvt_seg_drain(kvt_seg *s, int on);
/* 1 while a live owner drains the segment. */
int kvt_seg_draining(const kvt_seg *s);
/* The name the handle attached by. */
const char *kvt_seg_name(const kvt_seg *s);
#define KVT_MODEL_TEXT_MAX 1024 /* the longest kept, with its NUL */
/* The model's description the segment's creator gave, into buf (len >= 1),
 * bounded and with every byte outside printable ASCII as '?'; "" when it
 * was not recorded.  Returns buf. */
char *kvt_seg_model(const kvt_seg *s, char *buf, size_t len);

/* ---- the disk tier's index ------------------------------------------
 * A segment created with geometry.disk_chunks > 0 holds the disk tier's
 * index (key -> extent of the disk file, with the extent's generation),
 * written by one process only, the disk engine, which must own the
 * segment (kvt_seg_own), and read by every lookup; and one request ring
 * per table entry, through which lookups ask the engine to read chunks
 * back into the arena (promotion).  The file, its records, checksums and
 * the I/O are the engine's (tier/disk/kvt_disk.h); core only holds what every
 * process must see.  See diskidx.c for the protocol. */
struct kvt_disk_ref {
	uint32_t pos;    /* index entry */
	uint32_t seq;    /* its sequence word when read (low 32 bits) */
	uint32_t extent; /* extent of the disk file */
	uint32_t egen;   /* the extent's generation */
};
/* The engine's published state. */
struct kvt_disk_status {
	uint64_t online;       /* 1 while an engine runs (with a fresh heartbeat) */
	uint64_t pid;          /* the engine's pid (diagnostic) */
	uint64_t heartbeat_ns; /* CLOCK_MONOTONIC of its last loop */
	uint64_t chunks;       /* extents of its file */
	uint64_t used;         /* extents holding a chunk */
	uint64_t inflight;     /* I/Os submitted, not completed (queue depth) */
	uint64_t direct;       /* 1: O_DIRECT, 0: buffered */
	uint64_t epoch;        /* engine starts on this segment */
	char path[256];        /* the file or device (diagnostic) */
	uint64_t io_errors;    /* data and record I/Os the device failed */
	uint64_t failed;       /* 1: taken offline after errors (DRAM only) */
};
/* Index entries the segment holds; 0: no disk tier. */
uint32_t kvt_disk_capacity(const kvt_seg *s);
/* 1 while an engine is online: its state says so and its heartbeat is at
 * most 2 s old (a dead engine's index is not offered to lookups). */
int kvt_disk_online(const kvt_seg *s);
/* Finds key in the disk index: 1 (and *ref), 0 (absent, or being changed
 * right now: a miss is always safe).  Lock-free, never blocks. */
int kvt_disk_find(const kvt_seg *s, const kvt_key *key, struct kvt_disk_ref *ref);
/* Asks the engine to read ref's chunk back (through the handle's own
 * ring).  0, -EAGAIN (ring full: counted as a promotion drop), -EPERM (no
 * table entry), -ENODEV (no disk tier in this segment). */
int kvt_disk_request(kvt_seg *s, const struct kvt_disk_ref *ref);
int kvt_disk_status_read(const kvt_seg *s, struct kvt_disk_status *out);

/* Engine side: each needs the owner (-EPERM otherwise). */
/* Empties the index and the rings (engine start); publishes online. */
int kvt_disk_engine_start(kvt_seg *s, const struct kvt_disk_status *st);
/* Publishes the gauges and the heartbeat (online stays as it is). */
void kvt_disk_engine_publish(kvt_seg *s, const struct kvt_disk_status *st);
/* Offline: lookups stop offering disk chunks; the index is emptied. */
void kvt_disk_engine_stop(kvt_seg *s);
/* Inserts key -> (extent, egen): 0 and *pos, -EEXIST (key there: *pos),
 * -ENOSPC (both buckets full). */
int kvt_disk_put(kvt_seg *s, const kvt_key *key, uint32_t extent, uint32_t egen,
		 uint32_t *pos);
/* Removes entry pos (no-op when empty). */
void kvt_disk_del(kvt_seg *s, uint32_t pos);
/* Takes up to max requests from the rings: each is checked against the
 * index (stale ones are dropped and counted) and comes back as a ref with
 * its key.  Returns the count. */
int kvt_disk_take_requests(kvt_seg *s, struct kvt_disk_ref *refs, kvt_key *keys,
			   uint32_t max);

/* Keys present in DRAM (READY or being filled), from keys[0] on, without
 * pinning or counting anything: what a lookup that waits for promotions
 * will find next.  Lock-free. */
int kvt_seg_peek(kvt_seg *s, const kvt_key *keys, uint32_t n);
/* The slot's key and life, for the disk engine's demotion scan: 1 when the
 * slot is READY (its state word in *w), else 0. */
int kvt_slot_ready(const kvt_seg *s, uint32_t slot, kvt_key *key, uint32_t *depth,
		   uint32_t *ref, uint64_t *w);
/* Whether slot is still READY in the life of state word w (the data read
 * since kvt_slot_ready was stable). */
int kvt_slot_same_life(const kvt_seg *s, uint32_t slot, uint64_t w);
/* The CLOCK hand (a monotonic counter: slot = hand mod n_slots). */
uint64_t kvt_seg_clock_hand(const kvt_seg *s);

/* A process's start time (clock ticks since boot), 0 when /proc does not
 * show it.  Diagnostics only: liveness never depends on it. */
uint64_t kvt_proc_start_time(int pid);

#ifdef __cplusplus
}
#endif
#endif /* KVT_CORE_H */
