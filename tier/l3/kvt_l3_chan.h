/* kvt_l3_chan.h - the L3 channel: how a lookup asks kvtierd for chunks
 * that are in neither DRAM nor the local disk, and learns the answer.
 *
 * Why a socket and not the segment.  The disk tier's promotions travel in
 * the segment (kvt_disk_request: a ring of index references), because the
 * disk index is there and names every chunk it holds.  The L3 has no such
 * index -- whether the store holds a chunk is known only after a round
 * trip -- so a lookup needs an answer ("claimed, wait" or "missing,
 * recompute"), not just a fire-and-forget request, and a new ring with
 * answers would be a new shared-memory protocol with its own model.  A
 * unix socket gives the answer path, tells kvtierd when an asker is gone,
 * and needs no step in the segment: the only shared state stays the
 * claims (kvt_write_begin) that make a chunk being got visible to every
 * lookup, as for a rank's save.
 *
 * The channel.  kvtierd, with an L3, listens on a SOCK_SEQPACKET socket
 * beside the segment's file named kvtier-l3.<segment> (the witness's
 * kvtier-witness.<segment> is its neighbour), with the segment file's
 * permissions.  kvt_lookup_ex(PROMOTE) connects lazily (at most once a
 * second while no one listens), and only to a listener whose uid is root,
 * its own or the segment file's owner.  Each message is one datagram: a
 * header and up to KVT_L3C_MAX items.
 *
 *   ASK     rank -> kvtierd  items: key, depth
 *   STATUS  either way       asked with no items (kvtier-stat); answered
 *                            with struct kvt_l3c_status: the L3's figures
 *                            for a view that reads the segment, not HTTP
 *   ANSWER  kvtierd -> rank  items: key, result (KVT_L3C_HERE: claimed in
 *                            DRAM, the lookups see it pending until it is
 *                            READY; KVT_L3C_MISSING: recompute)
 *
 * Never a wait, never a wrong byte.  The rank sends and reads with
 * MSG_DONTWAIT only; an ask with no answer counts as pending for at most
 * KVT_L3C_ASK_NS and is then asked again, and a daemon that is gone (the
 * connection ends) turns every outstanding ask into "not pending".  The
 * answers only steer how long a scheduler waits: what a lookup hits is
 * what the segment says, and the daemon publishes a got chunk only after
 * every shard's authenticated check.  A forged answer can make a rank
 * wait (bounded) or recompute, nothing else; kvtierd checks every field
 * of an ASK and asks the store only through kvt_l3e_ask.
 */
#ifndef KVT_L3_CHAN_H
#define KVT_L3_CHAN_H

#include <stddef.h>
#include <stdint.h>

#define KVT_L3C_NAME    "kvtier-l3."
#define KVT_L3C_MAGIC   0x6c33766bu /* "kv3l" */
#define KVT_L3C_VERSION 1
#define KVT_L3C_MAX     64          /* items per message */
#define KVT_L3C_ASK_NS  2000000000ull /* an unanswered ask is pending this long */

enum { KVT_L3C_ASK = 1, KVT_L3C_ANSWER = 2, KVT_L3C_STATUS = 3 };
/* ANSWER results: the values of kvt_l3e.h's KVT_L3E_HERE / _MISSING */
enum { KVT_L3C_HERE = 1, KVT_L3C_MISSING = 3 };

struct kvt_l3c_hdr {
	uint32_t magic;
	uint16_t version, op;
	uint32_t n, reserved;
};

struct kvt_l3c_item {
	uint64_t lo, hi;       /* the chunk key */
	uint32_t value;        /* ASK: the depth; ANSWER: the result */
	uint32_t reserved;
};

/* The L3's figures: kvtierd's one account of them, for /metrics, /status,
 * /healthcheck and (over STATUS) kvtier-stat. */
struct kvt_l3c_status {
	uint32_t up, nodes, nodes_up, inflight, askers, reserved;
	uint64_t puts, put_bytes, put_drops, gets, get_bytes, get_drops;
	uint64_t misses, refused, negative_hits, errors, redirects, asks;
	uint64_t round_trips, fetches;
	uint64_t put_ns[26], get_ns[26];  /* core's histogram buckets (kvt_hist) */
	uint64_t put_ns_sum, get_ns_sum;
	char describe[160];    /* NUL-terminated */
};

struct kvt_l3c_status_msg {
	struct kvt_l3c_hdr h;
	struct kvt_l3c_status st;
};

struct kvt_l3c_msg {
	struct kvt_l3c_hdr h;
	struct kvt_l3c_item it[KVT_L3C_MAX];
};

/* Whether a datagram of len bytes is a well-formed message of op (ASK or
 * ANSWER; STATUS has its own shapes): every field checked, the count
 * against the length, before anything in it is used. */
static inline int kvt_l3c_ok(const struct kvt_l3c_msg *m, size_t len, uint16_t op)
{
	if (len < sizeof(m->h) || m->h.magic != KVT_L3C_MAGIC ||
	    m->h.version != KVT_L3C_VERSION || m->h.op != op || m->h.reserved ||
	    m->h.n > KVT_L3C_MAX || len != sizeof(m->h) + (size_t)m->h.n * sizeof(m->it[0]))
		return 0;
	for (uint32_t i = 0; i < m->h.n; i++)
		if (m->it[i].reserved)
			return 0;
	return 1;
}

#endif
