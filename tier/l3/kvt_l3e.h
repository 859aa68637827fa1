/* kvt_l3e.h - the L3 engine: kvtierd's side of the L3 tier (kvt_l3.h),
 * every protocol step that touches the segment.  One engine per segment,
 * in its owner (the handle must have a table entry: the claims of a get
 * are its); not thread-safe: one thread polls it, as the disk engine.
 *
 *   put (admission, ahead of eviction): the scan walks the slots from the
 *     CLOCK hand, where the next evictions come from; a READY chunk not
 *     already put (a bounded record of the keys this node put or found in
 *     the store) and admitted (all, or second-hit: hit in DRAM since it was
 *     saved, or asked for before) is sealed shard by shard -- header and
 *     tag over the sub-slot as it is -- and put from the sub-slot, without
 *     a pin (encrypting: the ciphertext into staging buffers, put from
 *     there; a put waits while the staging is full).  Two life checks (kvt_slot_same_life): after the seal, before
 *     the submit -- a life that ended between kvt_slot_ready and the seal
 *     would give another chunk's bytes a valid tag under this chunk's key,
 *     an object no check could refuse, so the put is not made; and at
 *     completion -- bytes that changed during the transfer no longer match
 *     the tag (a miss, never a wrong byte), and the put is not recorded.
 *   fetch (promotion): for chunks in neither DRAM nor the disk, one EXISTS
 *     over the chunk's shard keys (a chunk is there only when all its
 *     shards are); then one claim per shard (kvt_write_begin), a GET of
 *     each shard into its sub-slot, the check of every shard (tag, key,
 *     shard, layout, depth), and kvt_write_end(ok): the chunk is published
 *     only when every shard checked.  A miss is remembered (negative_ms),
 *     so a cold prefix costs one round trip, not one per lookup -- and so
 *     is every failure (a store error, no slot to land in, a rank
 *     writing the chunk, a refused object): a store that fails is not
 *     asked about that chunk again for negative_ms.
 *   jobs: puts and fetches share them; the put scan leaves a quarter to
 *     the asks (a put backlog must not turn lookups into misses), and an
 *     ask that finds none free waits in a queue (KVT_L3E_QUEUE) for the
 *     next, before the put scan -- a miss only when that queue is full.
 *     The asks in flight (queued or in a job) are a set by (key, depth):
 *     an ask of one already made joins it at the cost of a probe, not of
 *     a scan of the jobs and the queue.
 *   failure: every store error is a miss, counted; the engine never
 *     blocks and never fails the segment.  kvtierd killed with gets in
 *     flight: the claims die with its entry (the reaper frees them) and
 *     its socket reads die with it -- nothing is published half-written.
 */
#ifndef KVT_L3E_H
#define KVT_L3E_H

#include <stddef.h>
#include <stdint.h>

#include "kvt_core.h"
#include "kvt_l3.h"

typedef struct kvt_l3e kvt_l3e;

struct kvt_l3e_opts {
	size_t size;               /* sizeof(struct kvt_l3e_opts) */
	struct kvt_l3_conf store;  /* the store: URL, auth file, timeout */
	const char *key_path;      /* the fleet key (the same file on every node) */
	uint32_t create_key;       /* make it (32 random bytes, 0600) when missing */
	uint32_t admit;            /* enum kvt_disk_admit: all, second-hit, none */
	uint32_t jobs;             /* chunks in flight, 1..256; 0: 32 */
	uint32_t scan;             /* slots the put scan looks at per poll; 0: 1024 */
	uint32_t negative_ms;      /* how long a miss is remembered; 0: 2000 */
	void (*log)(int level, const char *msg, void *arg); /* NULL: stderr */
	void *log_arg;
	/* the answer to a kvt_l3e_ask that returned KVT_L3E_ASKED (and to
	 * every ask of the same key meanwhile): KVT_L3E_HERE once the chunk
	 * is claimed in DRAM (being got: lookups see it; a get that then
	 * fails is remembered as missing), KVT_L3E_MISSING when it is not in
	 * the store or the store failed.  Called from kvt_l3e_poll. */
	void (*answer)(void *arg, const kvt_key *key, int result);
	void *answer_arg;
	/* the payloads encrypted (ChaCha20-Poly1305 under the fleet key), not
	 * only authenticated: a put encrypts each shard into a staging buffer
	 * (stage_bytes of them, at least one chunk's: a put waits for room)
	 * and goes from there; a get decrypts in the claimed sub-slot.  Gets
	 * accept either kind of object. */
	uint32_t encrypt;
	uint64_t stage_bytes;      /* 0: 64 MiB (less when the put jobs need less) */
	/* testing: called between a put's kvt_slot_ready and its seal (the
	 * window the life check after the seal closes); NULL in production */
	void (*test_before_seal)(void *arg, uint32_t slot);
	void *test_arg;
};

struct kvt_l3e_info {
	uint64_t puts, put_bytes, put_drops, put_skips;
	uint64_t fetches, gets, get_bytes, misses, refused, get_drops, negative_hits;
	uint64_t ask_drops;        /* asks answered missing: the queue full */
	uint64_t put_waits;        /* put scans stopped: no staging free */
	uint64_t stage_bytes;      /* the staging's size (0: not encrypting) */
	uint32_t inflight;
	uint32_t asking;           /* asks in flight: queued or in a job */
	struct kvt_hist_snap put_ns, get_ns; /* put: sealed to stored; get:
					      * asked to published (core's buckets) */
	int key_created;           /* the fleet key file was made at open */
	struct kvt_l3_status store;
};

/* Opens the store (kvt_l3_open) and the fleet key; s must be owned by the
 * caller.  -errno with the message in err (the store's reasons, the key
 * file's rules). */
int kvt_l3e_open(kvt_seg *s, const struct kvt_l3e_opts *o, kvt_l3e **out, char *err,
		 size_t len);
/* One round: completions, the put scan.  Never waits.  The number of
 * things done (0: idle). */
int kvt_l3e_poll(kvt_l3e *e);
/* Asks that wait for a job at most (the channel shares them out among
 * its connections: kvt_l3_srv.h). */
#define KVT_L3E_QUEUE 1024u
/* kvt_l3e_ask's results and the answers' (opts.answer). */
enum { KVT_L3E_HERE = 1, KVT_L3E_ASKED = 2, KVT_L3E_MISSING = 3 };
/* Asks the store for one chunk at this depth, for a lookup: HERE (in DRAM
 * already, or being written), MISSING (remembered as not in the store, or
 * every job busy: recompute), or ASKED (a job asks the store, this one or
 * one already under way: the answer comes through opts.answer). */
int kvt_l3e_ask(kvt_l3e *e, const kvt_key *key, uint32_t depth);
/* Asks the store for these chunks (keys[i] at depth depths[i]): those not
 * in DRAM, not remembered as missing, not already asked.  Returns how many
 * were asked (the rest: no free job, or not needed). */
int kvt_l3e_fetch(kvt_l3e *e, const kvt_key *keys, const uint32_t *depths, uint32_t n);
/* Sets (or, with NULL, clears) opts.answer after open. */
void kvt_l3e_set_answer(kvt_l3e *e, void (*answer)(void *, const kvt_key *, int), void *arg);
/* Readable when the store completed something. */
int kvt_l3e_event_fd(const kvt_l3e *e);
/* Polls until nothing is in flight (and, with put_all, the scan found
 * nothing more to put), up to timeout_ns (< 0: no limit): 0, -ETIMEDOUT. */
int kvt_l3e_drain(kvt_l3e *e, int put_all, int64_t timeout_ns);
void kvt_l3e_info(kvt_l3e *e, struct kvt_l3e_info *out);
/* Drains (every request completes: claims released, nothing published
 * that was not checked) and closes.  NULL is ignored. */
void kvt_l3e_close(kvt_l3e *e);

#endif
