/* kvt_format.h - the on-segment format (layout version 4) and the private
 * per-process handle.  Everything here is internal to core/.
 *
 * The segment, as mapped (offsets are from the start of the mapping; every
 * region starts on a 4 KiB boundary, the arena on a 2 MiB one, and the
 * whole size is a multiple of 2 MiB so that it can live on huge pages):
 *
 *   0      +------------------------------------------------------------+
 *          | header, page 0                                             |
 *          |   0    magic "KVTIER01"   (written last, release)          |
 *          |   8    version, hdr_size, total_size, page_size            |
 *          |   32   creator uid, pid, start time, creation time,        |
 *          |        eviction policy bits                                |
 *          |   64   geometry (struct kvt_geometry, 120 bytes)           |
 *          |   184  segment id (random at creation; tags lease ids)     |
 *          |   192  derived sizes: shard, slot meta, lease, shard part, |
 *          |        shards, entries, buckets, counter block             |
 *          |   256  layout fingerprint (128 bit)                        |
 *          |   272  regions[6] {off, size}                              |
 *          |   368  header checksum over bytes 8..367                   |
 *          |  2048  mutable words, one cache line each: clock hand,     |
 *          |        lease hint, per-instance step epochs, the owner     |
 *          |        (kvtierd) word, the drain word; the owner's lock is |
 *          |        an OFD lock on byte KVT_OWNER_LOCK_OFF (owner.c)     |
 *   4096   +------------------------------------------------------------+
 *          | rank table: n_entries x 64 B                               |
 *          |   instance i: world rank entries, then its scheduler;      |
 *          |   then KVT_MAX_CLIENTS client entries.  The first byte of  |
 *          |   entry e in the file carries e's liveness lock (ranks.c)  |
 *          +------------------------------------------------------------+
 *          | counters: (n_entries + 1) blocks of KVT_C__COUNT u64 and   |
 *          |   KVT_H__COUNT latency histograms of KVT_HIST_WORDS u64,   |
 *          |   each block padded to cache lines; the last block is for  |
 *          |   processes without an entry (observers)                   |
 *          +------------------------------------------------------------+
 *          | lease table: n_leases x (64 B header + loaded[world] u64   |
 *          |   + refs[max] u64)                                         |
 *          +------------------------------------------------------------+
 *          | index: n_buckets x 64 B (ctl word + 7 entries)             |
 *          +------------------------------------------------------------+
 *          | slot meta: n_slots x slot_meta_bytes                       |
 *          |   64 B of words + claim[n_shards] u64, padded to 64 B      |
 *          +------------------------------------------------------------+
 *          | disk tier (only with geometry.disk_chunks > 0): a status   |
 *          |   page, n_entries request rings, the disk index:           |
 *          |   disk_buckets x 8 entries of 32 B (diskidx.c)             |
 *          +------------------------------------------------------------+ 2 MiB
 *          | arena: n_shards parts of shard_part bytes (2 MiB aligned); |
 *          |   part s holds shard s of every slot: slot i at i x shard  |
 *          +------------------------------------------------------------+
 *
 * Nothing in the segment is a pointer: offsets only.  All of it is
 * derivable from the geometry, so attach recomputes the layout and compares
 * field by field (kvt__layout_compute / kvt__hdr_validate).
 */
#ifndef KVT_FORMAT_H
#define KVT_FORMAT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvt_atomic.h"
#include "kvt_clock.h"
#include "kvt_core.h"
#include "kvt_mix.h"
#include "kvt_sp.h"

/* "KVTIER01" as a little-endian u64 */
#define KVT_MAGIC          0x313052454954564bULL
/* Version 2: generation-tagged shard claims replace the writer/writing
 * pair, per-rank tagged loaded words and a tagged miss count in leases, a
 * segment id in the header (lease ids carry it), OFD-lock liveness. */
/* Version 3: the same tables; the fingerprint includes the key format
 * (KVT_KEY_FORMAT), so a version-2 segment's keys (format 1) would never
 * match: refused by name instead. */
/* Version 4: latency histograms in every counter block, the owner and
 * drain words in the header's mutable page (kvtierd). */
/* Version 5: the disk tier's region (geometry.disk_chunks: its index and
 * request rings) and its counters; the geometry grew to 128 bytes. */
#define KVT_LAYOUT_VERSION 5u
/* How tier/ derives chunk keys from tokens (tier/kvt_hash.h): 1 =
 * XXH3-128(parent || tokens), 2 = XXH3-128(parent || XXH3-128(tokens)). */
#define KVT_KEY_FORMAT     2u
#define KVT_POLICY_DEPTH_FIRST 0x1ULL /* eviction prefers deeper cold chunks */
#define KVT_POLICY_MASK        0x1ULL
#define KVT_CACHELINE      64u
#define KVT_PAGE           4096u
#define KVT_ARENA_ALIGN    (2u << 20)
#define KVT_HDR_MUTABLE    2048u
#define KVT_MODEL_TEXT     KVT_MODEL_TEXT_MAX

#define KVT_DEFAULT_LEASES       1024u
#define KVT_DEFAULT_LEASE_CHUNKS 512u
#define KVT_DEFAULT_FILL_MS      5000u

/* ---- geometry limits ---- */
#define KVT_MAX_SLOTS        (1u << 30)
#define KVT_MAX_LEASES       (1u << 20)
#define KVT_MAX_LEASE_CHUNKS 65536u
#define KVT_MAX_CHUNK_TOKENS (1u << 20)
#define KVT_MAX_LAYERS       4096u
#define KVT_MAX_BPT          (1u << 20)

enum kvt_region_id {
	KVT_R_RANKS, KVT_R_COUNTERS, KVT_R_LEASES, KVT_R_INDEX, KVT_R_SLOTS,
	KVT_R_DISK, KVT_R_ARENA, KVT_R__COUNT
};

struct kvt_region {
	uint64_t off;
	uint64_t size;
};

/* Sizes derived from the geometry; stored in the header and re-derived at
 * attach. */
struct kvt_derived {
	uint64_t shard_bytes;     /* one sub-slot, rounded */
	uint64_t slot_meta_bytes;
	uint64_t lease_bytes;
	uint64_t shard_part;      /* arena bytes of one shard, 2 MiB rounded */
	uint32_t n_shards;
	uint32_t n_entries;
	uint32_t n_buckets;       /* power of two */
	uint32_t counter_block;   /* bytes */
	uint32_t disk_buckets;    /* disk index buckets, power of two; 0 = none */
	uint32_t disk_rings;      /* request rings (= n_entries when a disk tier) */
	uint64_t pad[1];
};

struct kvt_hdr {
	kvt_a64  magic;                /*   0 */
	uint32_t version;              /*   8 */
	uint32_t hdr_size;             /*  12 */
	uint64_t total_size;           /*  16 */
	uint64_t page_size;            /*  24 */
	uint32_t creator_uid;          /*  32 */
	uint32_t creator_pid;          /*  36 */
	uint64_t creator_start;        /*  40 */
	uint64_t created_ns;           /*  48 */
	uint64_t policy;               /*  56: KVT_POLICY_* */
	struct kvt_geometry geo;       /*  64 */
	uint64_t seg_id;               /* 192: random, nonzero */
	struct kvt_derived d;          /* 200 */
	kvt_key  fingerprint;          /* 264 */
	struct kvt_region regions[KVT_R__COUNT]; /* 280 */
	uint64_t checksum;             /* 392 */
	/* The model's description as its creator gave it (kvt_config.model,
	 * kvtierd --model), NUL-padded: geometry.model_id is its hash.  For
	 * the messages only -- a mismatch names both sides, kvtier-stat shows
	 * it -- so it is not in the checksum (a version-5 segment made before
	 * it has zeros here: "not recorded"), and it is read bounded and
	 * printable (kvt_seg_model). */
	char     model[KVT_MODEL_TEXT]; /* 400 */
	uint8_t  pad1[KVT_HDR_MUTABLE - 400 - KVT_MODEL_TEXT];
	/* Mutable words, each on its own line: written by every process. */
	kvt_a64  clock_hand;           /* 2048 */
	uint8_t  pad2[KVT_CACHELINE - 8];
	kvt_a64  lease_hint;           /* 2112 */
	uint8_t  pad3[KVT_CACHELINE - 8];
	struct {
		kvt_a64 epoch;
		uint8_t pad[KVT_CACHELINE - 8];
	} step[KVT_MAX_INSTANCES];     /* 2176 */
	kvt_a64  owner;                /* 3200: KVT_OWNER(1, pid) of the process
					* that holds the owner lock; diagnostic */
	uint8_t  pad5[KVT_CACHELINE - 8];
	kvt_a64  drain;                /* 3264: nonzero while the owner drains */
	uint8_t  pad6[KVT_CACHELINE - 8];
	uint8_t  pad4[KVT_PAGE - 3328];
};
/* The byte of the segment file whose OFD write lock is the owner's token
 * (the owner word's line: no rank entry lock is in the header page). */
#define KVT_OWNER_LOCK_OFF 3200u

_Static_assert(sizeof(struct kvt_geometry) == 128, "geometry is frozen");
_Static_assert(sizeof(struct kvt_derived) == 64, "derived is frozen");
_Static_assert(offsetof(struct kvt_hdr, version) == 8, "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, geo) == 64, "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, seg_id) == 192, "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, d) == 200, "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, fingerprint) == 264, "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, regions) == 280, "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, checksum) == 392, "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, model) == 400, "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, clock_hand) == KVT_HDR_MUTABLE, "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, lease_hint) % KVT_CACHELINE == 0, "own line");
_Static_assert(offsetof(struct kvt_hdr, step) % KVT_CACHELINE == 0, "own line");
_Static_assert(offsetof(struct kvt_hdr, owner) == 2176 + KVT_MAX_INSTANCES * KVT_CACHELINE,
	       "hdr layout");
_Static_assert(offsetof(struct kvt_hdr, owner) == KVT_OWNER_LOCK_OFF, "owner lock byte");
_Static_assert(offsetof(struct kvt_hdr, drain) % KVT_CACHELINE == 0, "own line");
_Static_assert(sizeof(struct kvt_hdr) == KVT_PAGE, "header is one page");

/* ---- rank table ----
 * owner word: [63..40 unused][39..32 state][31..0 pid].  The pid is for
 * messages only: whether an entry's holder lives is decided by an OFD lock
 * on the entry's first byte in the segment file (ranks.c), which the kernel
 * drops when the holder dies, in whatever PID namespace. */
enum kvt_ent_state {
	KVT_ENT_EMPTY = 0, KVT_ENT_CLAIMING = 1, KVT_ENT_ATTACHED = 2,
	KVT_ENT_REAPING = 3,
};
#define KVT_OWNER(st, pid) (((uint64_t)(st) << 32) | (uint32_t)(pid))
#define KVT_OWNER_ST(w)    ((uint32_t)((w) >> 32) & 0xffu)
#define KVT_OWNER_PID(w)   ((int)(uint32_t)(w))

/* journal word: the one pin or unpin in progress for this entry, or the
 * pin repair a reaper owes for it.
 * [63..61 op][60 blocked][59..32 gen low 28 bits][31..0 slot + 1].
 * REPAIR is what a reaper turns a dead entry's PIN/UNPIN into before it
 * repairs that slot: nobody waits on a REPAIR (leases.c). */
enum kvt_jop { KVT_J_NONE = 0, KVT_J_PIN = 1, KVT_J_UNPIN = 2, KVT_J_REPAIR = 4 };
#define KVT_J(op, slot, gen) (((uint64_t)(op) << 61) | \
	(((uint64_t)(gen) & 0xfffffffULL) << 32) | ((uint64_t)(slot) + 1))
#define KVT_J_OP(w)      ((uint32_t)((w) >> 61))
#define KVT_J_BLOCKED    (1ULL << 60)
#define KVT_J_GEN(w)     (((w) >> 32) & 0xfffffffULL)
#define KVT_J_SLOT(w)    ((uint32_t)(w) - 1u)  /* valid when op != NONE */

struct kvt_ent {
	kvt_a64 owner;      /* state + pid; CAS only */
	kvt_a64 start;      /* process start time (clock ticks since boot) */
	kvt_a64 attach_gen; /* bumped at every attach */
	kvt_a64 heartbeat;  /* CLOCK_MONOTONIC ns, refreshed by kvt_seg_reap callers */
	kvt_a64 journal;
	kvt_a32 role;
	kvt_a32 instance;
	kvt_a32 rank;
	kvt_a32 left;       /* how the last holder left (enum kvt_left): written
			     * (relaxed) before the release that empties the
			     * entry, 0 at attach; a diagnostic only, no
			     * protocol step reads it */
	uint8_t pad[KVT_CACHELINE - 56];
};
_Static_assert(sizeof(struct kvt_ent) == KVT_CACHELINE, "entry is one line");

/* ---- slot meta ----
 * state word: [63..24 gen (40)][23..4 pins (20)][3 frozen][2..0 state].
 * In FILLING the pins field is [join version 9][allocator 11]: the
 * allocator (entry + 1) until its setup (fields, shard claim, index entry)
 * is done, then 0 -- written in the FREE -> FILLING CAS itself, so the
 * reaper knows a slot whose allocator died during setup -- and a version
 * that every joining writer bumps after its claim, so that a doom decided
 * before the join fails its CAS (slots.c).  In READY|FROZEN it holds the
 * freezer (entry + 1): a
 * pin repair recounts the pins anyway, and whoever meets a frozen slot
 * can tell whether its freezer still lives (leases.c). */
enum kvt_slot_state {
	KVT_S_FREE = 0, KVT_S_FILLING = 1, KVT_S_READY = 2, KVT_S_EVICTING = 3,
	KVT_S_DOOMED = 4, /* FILLING that will never be READY; reclaimed when
			   * no claim of its life is left */
};
#define KVT_ST(w)        ((uint32_t)(w) & 7u)
#define KVT_ST_FROZEN    (1ULL << 3)
#define KVT_PIN_ONE      (1ULL << 4)
#define KVT_PINS(w)      ((uint32_t)(((w) >> 4) & 0xfffffu))
#define KVT_PINS_MAX     0xfffffu
#define KVT_FILL_OWNER(w) (KVT_PINS(w) & 0x7ffu) /* in FILLING: allocator entry + 1, or 0 */
#define KVT_FILL_OWNER_MASK (0x7ffULL << 4)
#define KVT_JOIN_MASK    (0x1ffULL << 15)   /* in FILLING: the join version */
#define KVT_JOIN_ONE     (1ULL << 15)
#define KVT_FREEZER(w)   KVT_PINS(w)   /* in READY|FROZEN: freezer entry + 1 */
#define KVT_GEN(w)       ((w) >> 24)
#define KVT_GEN_MASK     0xffffffffffULL
#define KVT_SW(st, gen, pins) (((uint64_t)(gen) << 24) | \
	((uint64_t)(pins) << 4) | (uint64_t)(st))

/* claim word, one per shard: [63..56 0][55..16 slot gen (40)][15..0 entry + 1];
 * 0 = free.  A claim is live in life g when its entry is nonzero and its
 * gen is g; a claim of an older life is garbage that the next claimer
 * overwrites (slots.c). */
#define KVT_CLAIM(gen, e)   ((((uint64_t)(gen) & KVT_GEN_MASK) << 16) | \
			     (((uint64_t)(e) + 1) & 0xffffULL))
#define KVT_CLAIM_ENT(c)    ((uint32_t)(c) & 0xffffu)   /* entry + 1, 0 = none */
#define KVT_CLAIM_GEN(c)    (((c) >> 16) & KVT_GEN_MASK)

struct kvt_slot {
	kvt_a64 state;
	kvt_a64 ready;    /* shards written in this life (by claim holders) */
	kvt_a64 key_lo;
	kvt_a64 key_hi;
	kvt_a64 fill_ns;  /* CLOCK_MONOTONIC when allocated */
	kvt_a32 depth;    /* chunk index in its prompt */
	kvt_a32 ref;      /* CLOCK reference count 0..2 */
	kvt_a32 owner;    /* entry + 1 of the allocator (diagnostic) */
	kvt_a32 tag;      /* index tag of key */
	kvt_a64 recount;  /* gen28 + 1 of a life whose pin count a repair set
			   * pessimistically (it gave up waiting for a stopped
			   * process): recounted by the next kvt_seg_reap */
	kvt_a64 claim[];  /* n_shards claim words */
};
_Static_assert(sizeof(struct kvt_slot) == 64, "slot meta head is one line");

/* ---- leases ----
 * state word: [63..16 gen (48)][15..4 actor: entry + 1][3..0 state].  The
 * actor is whoever the state belongs to -- the builder while BUILDING and
 * ACTIVE, the releaser while RELEASING -- written in the same CAS as the
 * state, so a process that dies right after a transition is known.
 * Lease id (see kvt__lease_id): [63..44 segment tag][gen low][idx + 1],
 * the index taking as many bits as n_leases needs. */
enum kvt_lease_state {
	KVT_L_FREE = 0, KVT_L_BUILDING = 1, KVT_L_ACTIVE = 2, KVT_L_RELEASING = 3,
};
#define KVT_LW(st, gen, actor) ((((uint64_t)(gen) & 0xffffffffffffULL) << 16) | \
	(((uint64_t)(actor) & 0xfffu) << 4) | (uint64_t)(st))
#define KVT_LST(w)       ((uint32_t)(w) & 0xfu)
#define KVT_LACT(w)      ((uint32_t)((w) >> 4) & 0xfffu)
#define KVT_LGEN(w)      ((w) >> 16)
#define KVT_LID_TAG_BITS 20u
/* loaded word, one per rank: the lease life that rank loaded, as
 * gen << 1 | 1 (0 = never).  A mark of an older life is not this life's. */
#define KVT_LOADED(gen)  (((uint64_t)(gen) << 1) | 1u)
/* misses word: [63..32 lease gen low 32][31..0 consecutive missed steps] */
#define KVT_MISSES(gen, m) ((((uint64_t)(gen) & 0xffffffffULL) << 32) | (uint32_t)(m))
#define KVT_MISSES_GEN(w)  ((w) >> 32)
#define KVT_MISSES_N(w)    ((uint32_t)(w))
/* ref word: [63..32 slot gen low 32][31..0 slot + 1]; 0 = none. */
#define KVT_REF(slot, gen) ((((uint64_t)(gen) & 0xffffffffULL) << 32) | ((uint64_t)(slot) + 1))
#define KVT_REF_SLOT(r)    ((uint32_t)(r) - 1u)
#define KVT_REF_GEN(r)     ((r) >> 32)

struct kvt_lease {
	kvt_a64 state;
	kvt_a32 instance;
	kvt_a32 n_refs;
	kvt_a64 misses;    /* KVT_MISSES(gen, steps absent from the load set) */
	kvt_a64 last_step; /* the instance's step that last saw it (statistic) */
	uint8_t pad[KVT_CACHELINE - 32];
	kvt_a64 words[];   /* loaded[world], then refs[lease_max_chunks] */
};
_Static_assert(sizeof(struct kvt_lease) == KVT_CACHELINE, "lease head is one line");

/* ---- index ----
 * A bucket is one cache line: a control word and 7 entries.  A key has a
 * primary and a secondary bucket; inserts of a key are serialized through
 * its primary bucket's control word (see index.c).
 * entry: [63 tentative][62..48 gen low 15][47..32 tag or commit tag][31..0 slot + 1]
 * ctl:   [63..5 version][4 pending][3..0 position 0..13 of the pending entry] */
#define KVT_BUCKET_WAYS 7u
struct kvt_bucket {
	kvt_a64 ctl;
	kvt_a64 e[KVT_BUCKET_WAYS];
};
_Static_assert(sizeof(struct kvt_bucket) == KVT_CACHELINE, "bucket is one line");

#define KVT_E_TENT       (1ULL << 63)
#define KVT_E(slot, gen, tag, tent) ((tent ? KVT_E_TENT : 0) | \
	(((uint64_t)(gen) & 0x7fffULL) << 48) | (((uint64_t)(tag) & 0xffffULL) << 32) | \
	((uint64_t)(slot) + 1))
#define KVT_E_SLOT(e)    ((uint32_t)(e) - 1u)
#define KVT_E_GEN(e)     (((e) >> 48) & 0x7fffULL)
#define KVT_E_TAG(e)     ((uint32_t)((e) >> 32) & 0xffffu)
#define KVT_CTL_PENDING  (1ULL << 4)
#define KVT_CTL_POS(c)   ((uint32_t)(c) & 0xfu)
#define KVT_CTL_VER(c)   ((c) >> 5)
#define KVT_CTL(ver, pending, pos) (((uint64_t)(ver) << 5) | \
	((pending) ? KVT_CTL_PENDING : 0) | (uint64_t)(pos))

/* ---- the disk tier region (diskidx.c) ----
 * A status page written by the engine, n_entries request rings (SPSC:
 * the entry's holder produces, the engine consumes), then the index:
 * disk_buckets buckets of KVT_DISK_WAYS entries.  entry val:
 * [63..32 extent gen][31..0 extent + 1]; 0 = empty.  seq is the entry's
 * seqlock word: odd while the engine changes the entry. */
#define KVT_DISK_WAYS   8u
#define KVT_DRING_CELLS 512u /* a lookup's default lease_max_chunks */
#define KVT_DISK_ONLINE_NS 2000000000ULL
struct kvt_disk_shm {
	kvt_a64 online;
	kvt_a64 pid;
	kvt_a64 heartbeat_ns;
	kvt_a64 chunks;
	kvt_a64 used;
	kvt_a64 inflight;
	kvt_a64 direct;
	kvt_a64 epoch;
	char path[256];
	kvt_a64 io_errors; /* I/Os the device failed (after path: older pages read 0) */
	kvt_a64 failed;    /* 1: the engine took the disk offline for errors */
	uint8_t pad[KVT_PAGE - 64 - 256 - 16];
};
_Static_assert(sizeof(struct kvt_disk_shm) == KVT_PAGE, "disk status is one page");
struct kvt_dring {
	kvt_a64 tail;      /* producer: requests written */
	uint8_t pad1[KVT_CACHELINE - 8];
	kvt_a64 head;      /* engine: requests taken */
	uint8_t pad2[KVT_CACHELINE - 8];
	kvt_a64 cell[KVT_DRING_CELLS]; /* [63..32 seq][31..0 pos + 1] */
};
struct kvt_dent {
	kvt_a64 seq;
	kvt_a64 key_lo;
	kvt_a64 key_hi;
	kvt_a64 val;
};
#define KVT_DVAL(ext, egen) (((uint64_t)(egen) << 32) | ((uint64_t)(ext) + 1))
#define KVT_DVAL_EXT(v)     ((uint32_t)(v) - 1u)
#define KVT_DVAL_GEN(v)     ((uint32_t)((v) >> 32))
#define KVT_DREQ(pos, seq)  (((uint64_t)(seq) << 32) | ((uint64_t)(pos) + 1))

/* ---- the per-process handle ---- */
struct kvt_seg {
	uint8_t *base;
	uint64_t size;
	struct kvt_hdr *hdr;
	struct kvt_geometry geo;  /* validated copy */
	struct kvt_derived d;     /* validated copy */
	struct kvt_region r[KVT_R__COUNT];
	struct kvt_ent *ents;
	uint8_t *counters;
	uint8_t *leases;
	struct kvt_bucket *buckets;
	uint8_t *slots;
	uint8_t *arena;
	uint32_t role;
	uint32_t instance;
	uint32_t rank;
	uint32_t entry;           /* UINT32_MAX: none */
	uint64_t *my_counters;    /* this handle's counter block */
	uint64_t chunk_bytes;     /* unrounded shard payload */
	int pid;
	uint64_t start;
	uint32_t bucket_mask;
	uint32_t lease_scan;      /* private lease allocation cursor */
	uint32_t sweep_peek;      /* slots looked ahead for a deeper victim */
	int fd;                   /* the segment file, never mapped (the mapping
				   * is another open): holds our entry and owner
				   * locks, probes the others'; -1 after fork() */
	uint32_t reaping;         /* entry we hold locked to reap, or UINT32_MAX */
	uint32_t forked;          /* inherited across fork(): inert */
	uint32_t owns;            /* holds the owner lock (owner.c) */
	uint32_t leave_to_reaper; /* detach keeps the entry (kvt_seg_leave_to_reaper) */
	int witness_pid;          /* the exit witness (witness.c), 0: none */
	int witness_pidfd;        /* ... its pidfd, valid while witness_pid > 0 */
	int wsrv_fd;              /* kvtierd's witness (witness_srv.c): our
				   * connection, valid while wsrv_held */
	uint32_t wsrv_held;       /* ... kvtierd holds our lock description too */
	char wsrv_why[120];       /* ... why not, when it does not */
	uint32_t lid_tag;         /* lease ids: segment tag (20 bits, nonzero) */
	uint32_t lid_idx_bits;    /* ... bits of idx + 1 */
	uint64_t lid_gen_mask;    /* ... mask of the gen bits */
	struct kvt_disk_shm *disk;   /* NULL: no disk tier */
	struct kvt_dring *drings;
	struct kvt_dent *dents;
	uint32_t ring_stride;        /* bytes of one ring */
	uint32_t disk_mask;          /* disk_buckets - 1 */
	struct kvt_seg *next;     /* the process's handles (fork) */
	char name[KVT_NAME_MAX + 1];
};

static inline struct kvt_slot *kvt__slot(const kvt_seg *s, uint32_t i)
{
	return (struct kvt_slot *)(s->slots + (uint64_t)i * s->d.slot_meta_bytes);
}

static inline struct kvt_lease *kvt__lease(const kvt_seg *s, uint32_t i)
{
	return (struct kvt_lease *)(s->leases + (uint64_t)i * s->d.lease_bytes);
}

static inline kvt_a64 *kvt__lease_loaded(const kvt_seg *s, struct kvt_lease *l)
{
	(void)s;
	return l->words;
}

static inline kvt_a64 *kvt__lease_refs(const kvt_seg *s, struct kvt_lease *l)
{
	return l->words + s->geo.world;
}

/* Lease id of lease idx in life gen (the low bits of gen that fit). */
static inline uint64_t kvt__lease_id(const kvt_seg *s, uint32_t idx, uint64_t gen)
{
	return ((uint64_t)s->lid_tag << (64 - KVT_LID_TAG_BITS)) |
	       ((gen & s->lid_gen_mask) << s->lid_idx_bits) | ((uint64_t)idx + 1);
}

static inline kvt_a64 *kvt__journal(const kvt_seg *s)
{
	return &s->ents[s->entry].journal;
}

static inline _Atomic uint64_t *kvt__ctr(const kvt_seg *s, uint32_t block)
{
	return (_Atomic uint64_t *)(s->counters + (uint64_t)block * s->d.counter_block);
}

/* Words of a counter block: the counters, then the histograms. */
#define KVT_HIST_WORDS (KVT_HIST_BUCKETS + 2) /* buckets, count, sum_ns */
#define KVT_CTR_WORDS  (KVT_C__COUNT + KVT_H__COUNT * KVT_HIST_WORDS)

static inline void kvt__count(kvt_seg *s, enum kvt_counter c, uint64_t v)
{
	/* Relaxed load + store, no locked add: a block has exactly one writer
	 * (the handle that owns the table entry; observers never count), and
	 * readers sum the blocks racily. */
	_Atomic uint64_t *p = (_Atomic uint64_t *)&s->my_counters[c];
	kat_store(p, kat_load(p, KVT_RLX) + v, KVT_RLX);
}

static inline uint64_t kvt__full_mask(uint32_t n)
{
	return n >= 64 ? ~0ULL : ((1ULL << n) - 1);
}

/* ---- internal functions shared between core files ---- */
int kvt__err(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* witness.c: kill and wait for the handle's exit witness (detach); forget
 * it without a signal (a fork child's copy of the handle). */
void kvt__witness_stop(kvt_seg *s);
void kvt__witness_forget(kvt_seg *s);
/* witness_srv.c: the socket kvtierd's witness listens on, beside the
 * segment's file (kvtier-witness.<name>); 0 or -errno. */
int kvt__witness_sock_path(int seg_fd, const char *name, char *out, size_t len);
int kvt__side_path(int seg_fd, const char *prefix, const char *name, char *out, size_t len);
/* A rank's message to kvtierd's witness: one datagram; HOLD carries the
 * lock description and the rank's pidfd (SCM_RIGHTS). */
struct kvt_wmsg {
	uint32_t magic;           /* KVT_WMSG_MAGIC */
	uint16_t version;         /* 1 */
	uint16_t op;              /* KVT_WMSG_HOLD, KVT_WMSG_BYE */
	uint32_t entry;           /* the sender's table entry (for the log) */
	uint32_t pid;             /* the sender's pid, as it sees itself */
};
#define KVT_WMSG_MAGIC 0x5754564bu /* "KVTW" */
#define KVT_WMSG_HOLD  1
#define KVT_WMSG_BYE   2
uint64_t kvt__hash64(const void *p, size_t n, uint64_t seed);
int kvt__layout_compute(const struct kvt_geometry *g, struct kvt_derived *d,
			struct kvt_region r[KVT_R__COUNT], uint64_t *total);
void kvt__fingerprint(const struct kvt_geometry *g, kvt_key *out);
uint64_t kvt__hdr_checksum(const struct kvt_hdr *h);
int kvt__geometry_check(const struct kvt_geometry *g);

/* ranks.c */
#define KVT_CLAIM_WAIT       1u /* wait (briefly) for a live reaper or detach */
#define KVT_CLAIM_EMPTY_ONLY 2u /* only an EMPTY entry (no reaping on the way) */
int kvt__entry_claim(kvt_seg *s, uint32_t e, unsigned flags);
void kvt__entry_release(kvt_seg *s);
int kvt__entry_alive(const kvt_seg *s, uint32_t e);
int kvt__entry_held(const kvt_seg *s, uint32_t e);
int kvt__need_entry(const kvt_seg *s, const char *what);
uint32_t kvt__entry_index(const kvt_seg *s, uint32_t role, uint32_t instance,
			  uint32_t rank);
int kvt__reap_entry(kvt_seg *s, uint32_t e);

/* index.c */
int kvt__index_find(kvt_seg *s, const kvt_key *k, uint64_t *gen_out,
		    uint32_t *slot_out, int want_filling, uint64_t *state_out);
int kvt__index_insert(kvt_seg *s, const kvt_key *k, uint32_t slot, uint64_t gen,
		      uint32_t *existing, uint64_t *existing_gen);
void kvt__index_remove(kvt_seg *s, uint32_t slot, uint64_t gen);
void kvt__key_hash(const kvt_seg *s, const kvt_key *k, uint32_t *b1,
		   uint32_t *b2, uint32_t *tag);
int kvt__index_check(kvt_seg *s, char *msg, size_t len);
void kvt__index_help_all(kvt_seg *s);
void kvt__index_prefetch(const kvt_seg *s, const kvt_key *k);

/* slots.c */
void kvt__slot_reclaim(kvt_seg *s, uint32_t slot, uint64_t gen);
int kvt__slot_unpin(kvt_seg *s, uint32_t slot, uint64_t gen32);
/* 1 when entry held a claim of the slot's current life (dropped). */
int kvt__slot_writer_gone(kvt_seg *s, uint32_t slot, uint32_t entry);
int kvt__slot_abandon(kvt_seg *s, uint32_t slot, uint64_t gen, uint32_t dead_owner);
int kvt__slot_state_live(uint64_t w);
int kvt__claims_drained(const kvt_seg *s, struct kvt_slot *sl, uint64_t gen);

/* owner.c */
int kvt__drain_check(const kvt_seg *s);

/* leases.c */
void kvt__lease_finish_release(kvt_seg *s, uint32_t idx);
void kvt__pins_repair(kvt_seg *s, uint32_t slot, uint64_t gen28);
void kvt__pins_adopt(kvt_seg *s, uint32_t slot, uint64_t frozen_word);
/* How long a protocol step waits for another live process's next step
 * before it stops waiting (leases.c: a stopped process). */
#define KVT_LIVE_WAIT_NS 500000000ULL
/* Repairs again the slots a repair left flagged (kvt_seg_reap). */
void kvt__pins_recount(kvt_seg *s);

#endif /* KVT_FORMAT_H */
