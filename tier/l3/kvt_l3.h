/* kvt_l3.h - the L3 tier: chunks of the arena kept in an existing
 * distributed store (Redis Cluster first, Mooncake Store next), so that a
 * prefix computed on one node is a hit on every node.  Internal to
 * kvtier: kvtierd drives it, kvtier-bench measures it, tests exercise it.
 *
 * tier/l3/ owns the backend interface (this header, kvt_l3_int.h) and the
 * backends (l3_redis.c; l3_mooncake.c with its companion l3_mooncake.py),
 * their shared request lists and object seal (l3.c), the engine that
 * drives them in kvtierd (kvt_l3e.h, l3_engine.c) and both sides of the
 * lookups' channel (kvt_l3_chan.h: kvt_l3_srv.h, l3_srv.c in kvtierd;
 * kvt_l3_client.h, l3_client.c in libkvtier.so and kvtier-stat).  It may
 * call core/ and, of tier/disk/, the chunk MAC (kvt_disk_trust.h) and the
 * admission policies both tiers take (kvt_disk.h's enum kvt_disk_admit);
 * nothing of the library above it (kvtier.c, config.c, hash.c), of dma/
 * or numa/.
 *
 * Design.
 *   Who does what.  kvtierd keeps every protocol step, as for the disk
 *   tier (tier/disk/disk.c): it picks what to put (admission ahead of eviction,
 *   a READY slot read without a pin and the put kept only when the slot is
 *   still in the same life afterwards: kvt_slot_same_life), claims the
 *   slots a get lands in (kvt_write_begin, one per shard), verifies what
 *   arrived and publishes it (kvt_write_end).  A backend only moves bytes
 *   between sub-slots and the store: it never touches the segment.
 *   Interface.  Modelled on the disk engine and on LMCache's L2 adapters:
 *   submit (never blocks: -EAGAIN when the backend's queue is full) of
 *   put / get / exists requests that point into arena sub-slots; the
 *   backend completes them in any order, sets each one's status, and
 *   makes its event descriptor (an eventfd) readable; reap takes the
 *   completed ones.  close drains: every submitted request completes
 *   (with -ECANCELED if it could not run) before it returns, so no
 *   backend thread writes into a sub-slot after the caller let go of it.
 *   A second backend is one more struct kvt_l3_ops: the tier does not
 *   change.
 *   Objects.  One per (chunk, shard): each shard's put goes straight from
 *   its sub-slot, with no staging copy to join the shards, and a rank's
 *   shard is the unit the arena holds.  The store key carries a hash tag
 *   of the layout fingerprint and the 128-bit chunk key, so that all the
 *   shards of a chunk live on one master of a cluster: one multi-key
 *   EXISTS answers for the chunk, and a chunk is present only when all
 *   its shards are.  Each object is a header (struct kvt_l3_hdr: magic,
 *   layout fingerprint, key, shard, shard count, depth, payload length, a
 *   nonce) and the payload, and a tag: ChaCha20-Poly1305 over the header
 *   and the payload under the fleet's key (the same key file on every
 *   node).  A chunk of another model (another fingerprint), an object
 *   written by anyone without the key, a torn or truncated one: its tag
 *   fails, and it is a miss, never served.
 *   Confidentiality (kvtierd --l3-encrypt, off by default).  The same
 *   AEAD with the payload as its plaintext: the header says which
 *   (version KVT_L3_CLEAR or KVT_L3_ENCRYPTED, under the tag, so it
 *   cannot be rewritten), and every node reads both, so a fleet turns it
 *   on node by node.  A put encrypts from the sub-slot into a staging
 *   buffer of the engine's (the sub-slot is a live READY chunk: it is
 *   never written) and goes from there; a get decrypts in the claimed
 *   sub-slot, which is published only when the tag checked -- what a
 *   failed one leaves there is freed, never read.  Off by default because
 *   of its cost, measured (docs/BENCHMARKS.md, kvtier-bench l3 --seal):
 *   ChaCha20 runs at 6.5 GB/s on one core beside Poly1305's 12, so the
 *   engine's one thread seals at 4.1 GB/s instead of 12, under a warm
 *   Mooncake put (5.1 GB/s); on the 2-core machines the L3 is measured on,
 *   1 MiB puts fell from 0.62x of Mooncake's own client (MAC only) to
 *   0.50x.  Random 96-bit nonces: the fleet key should be replaced well
 *   before 2^32 objects (a repeated nonce would show the XOR of two
 *   payloads), as with the MAC alone (it would allow a forgery).
 *   Failure is a miss.  A backend reports -EIO, -ETIMEDOUT, -ENOTCONN,
 *   -ENOENT (absent), -ENOSPC (the store is full) per request; it is never
 *   an error to the engine, and kvtierd marks the L3 down (degraded) while
 *   requests fail and up again when they succeed.
 *   The store evicts on its own (Redis: maxmemory-policy allkeys-lru);
 *   kvtier never deletes.
 */
#ifndef KVT_L3_H
#define KVT_L3_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "kvt_core.h"

#define KVT_L3_MAX_SHARDS 64
#define KVT_L3_KEY_MAX    96   /* a store key's text, NUL included */

enum kvt_l3_op {
	KVT_L3_PUT = 1,    /* the object from iov[0..iovcnt): header, the
			    * sub-slot itself, tag (no staging copy) */
	KVT_L3_GET = 2,    /* into iov[0..iovcnt), filled in order; got: the
			    * object's length */
	KVT_L3_EXISTS = 3, /* n_keys keys: status 0 only when all exist */
};

struct kvt_l3_req {
	uint32_t op;
	uint32_t n_keys;           /* EXISTS: keys in keys[]; else 1 */
	char key[KVT_L3_KEY_MAX];  /* PUT, GET */
	const char (*keys)[KVT_L3_KEY_MAX]; /* EXISTS */
	const struct iovec *iov;   /* PUT: source; GET: destination */
	uint32_t iovcnt;           /* at most 8 */
	uint64_t tag;              /* the caller's */
	/* set by the backend at completion */
	int status;                /* 0, -ENOENT (absent), -EMSGSIZE (not the
				    * iov's size), -ENOSPC (store full), -EIO,
				    * -ETIMEDOUT, -ENOTCONN, -EACCES, -ECANCELED */
	uint64_t got;              /* GET: the object's length */
	uint64_t ns;               /* submit to completion */
	/* the backend's */
	struct kvt_l3_req *next;
	uint64_t t0;
	int32_t ask;               /* node an ASK redirect named, or -1 */
	uint32_t hops;             /* redirects followed */
};

struct kvt_l3_conf {
	size_t size;               /* sizeof(struct kvt_l3_conf) */
	const char *url;           /* redis://HOST:PORT[,HOST:PORT...], or
				    * mooncake://MASTER[:PORT][?k=v&...] */
	const char *auth_file;     /* "password" or "user password"; NULL: none */
	uint32_t timeout_ms;       /* connect and per-command; 0: 1000 */
	uint32_t depth;            /* requests queued at most; 0: 256 */
	void (*log)(int level, const char *msg, void *arg); /* NULL: stderr */
	void *log_arg;
	/* The memory the payload pieces lie in, for a backend whose transport
	 * moves bytes straight from and to registered memory (mooncake: its
	 * companion maps mem_fd from mem_off and registers mem_len bytes).
	 * NULL: none (redis needs none; mooncake then refuses to open).  A
	 * piece outside it goes through the backend's own small buffer, so it
	 * must be small (headers and tags: at most 256 bytes a request). */
	const void *mem;
	uint64_t mem_len, mem_off;
	int mem_fd;                /* the file mem is mapped from (at mem_off) */
	const char *python;        /* mooncake: the Python with the wheel; NULL:
				    * $KVTIER_MOONCAKE_PYTHON, else python3 */
	/* A second such region, or NULL: the engine's staging of encrypted
	 * puts (a memfd of its own; stage_fd read only when stage is set). */
	const void *stage;
	uint64_t stage_len;
	int stage_fd;
};

struct kvt_l3_status {
	int up;                    /* the last round trip succeeded */
	uint32_t nodes, nodes_up;  /* masters known, reachable */
	uint64_t round_trips, errors, redirects, reconnects;
	char last_error[256];
	char describe[256];        /* "redis cluster: 3 masters (127.0.0.1:7000, ...)" */
};

typedef struct kvt_l3 kvt_l3;

/* Opens the backend the URL names (its scheme), checking the store is
 * reachable and the credentials work: -EINVAL (a bad URL or auth file,
 * named), -EACCES (the store refused the credentials), -ECONNREFUSED /
 * -ETIMEDOUT (no node answered), -ENOSYS (built without that backend).
 * The message is in err.  Blocks (connects). */
int kvt_l3_open(const struct kvt_l3_conf *c, kvt_l3 **out, char *err, size_t len);
/* Queues n requests; never blocks.  Returns how many were taken (0..n;
 * fewer when the queue is full), or -errno. */
int kvt_l3_submit(kvt_l3 *l, struct kvt_l3_req *const *reqs, uint32_t n);
/* Takes up to max completed requests; returns how many. */
int kvt_l3_reap(kvt_l3 *l, struct kvt_l3_req **done, uint32_t max);
/* Readable when a request completed (an eventfd; reap clears it). */
int kvt_l3_event_fd(const kvt_l3 *l);
void kvt_l3_status(kvt_l3 *l, struct kvt_l3_status *out);
/* Runs every queued request to its completion (each bounded by the
 * timeouts) and closes: no backend thread touches a request's pieces
 * after it returns.  NULL is ignored. */
void kvt_l3_close(kvt_l3 *l);

/* ---- objects ---- */

#define KVT_L3_MAGIC    0x314c33544b56ull /* "KVT3L1" */
#define KVT_L3_HDR_SIZE 64
#define KVT_L3_TAG_SIZE 16
#define KVT_L3_CLEAR     1 /* the payload in the clear, under the tag */
#define KVT_L3_ENCRYPTED 2 /* the payload encrypted (ChaCha20-Poly1305) */

struct kvt_l3_hdr {
	uint64_t magic;
	uint64_t fingerprint;      /* the layout's */
	uint64_t key_lo, key_hi;
	uint32_t shard, n_shards;
	uint32_t depth, version;   /* KVT_L3_CLEAR or KVT_L3_ENCRYPTED */
	uint32_t payload;          /* bytes after the header (one sub-slot) */
	uint8_t nonce[12];
};

/* The store key of (fingerprint, chunk key, shard). */
void kvt_l3_key(char out[KVT_L3_KEY_MAX], uint64_t fingerprint, const kvt_key *k,
		uint32_t shard);

typedef struct kvt_l3_sealer kvt_l3_sealer;
/* The fleet key (32 bytes) from a key file (the disk tier's file rules:
 * this euid's, no access for others), made when missing and create. */
int kvt_l3_seal_open(const char *key_path, int create, kvt_l3_sealer **out, int *created,
		     char *err, size_t len);
void kvt_l3_seal_close(kvt_l3_sealer *s);
/* The same over pieces: the header (hdr, 64 bytes) and the tag (16) for a
 * payload left where it is (an arena sub-slot); and the check of such an
 * object, also requiring the header's depth (the chunk's position), unless
 * depth is KVT_L3_ANY_DEPTH (kvt_l3_open_obj, the bench's reads): a value
 * no asker may pass (the channel refuses it, kvt_l3e_ask answers it
 * missing), else a get published at whatever depth the object says.  The
 * MAC is computed over the payload's bytes as they are now: a payload
 * that changes before the put completes makes an object that fails. */
#define KVT_L3_ANY_DEPTH UINT32_MAX
int kvt_l3_seal_pieces(kvt_l3_sealer *s, uint8_t hdr[KVT_L3_HDR_SIZE], const void *payload,
		       uint8_t tag[KVT_L3_TAG_SIZE], uint64_t fingerprint, const kvt_key *k,
		       uint32_t shard, uint32_t n_shards, uint32_t depth, uint64_t len);
/* The same, encrypting: the payload's ciphertext written to ct (not the
 * payload's place: a put's sub-slot is a live chunk), the header's
 * version KVT_L3_ENCRYPTED, the tag over the header and the ciphertext. */
int kvt_l3_encrypt_pieces(kvt_l3_sealer *s, uint8_t hdr[KVT_L3_HDR_SIZE], const void *payload,
			  void *ct, uint8_t tag[KVT_L3_TAG_SIZE], uint64_t fingerprint,
			  const kvt_key *k, uint32_t shard, uint32_t n_shards, uint32_t depth,
			  uint64_t len);
/* Either version is accepted (both are the fleet key's: a node with
 * encryption off reads a node's with it on, and the other way): an
 * encrypted payload is decrypted in place, and on -EBADMSG what is there
 * is garbage, never to be published. */
int kvt_l3_check_pieces(kvt_l3_sealer *s, const uint8_t hdr[KVT_L3_HDR_SIZE], void *payload,
			const uint8_t tag[KVT_L3_TAG_SIZE], uint64_t fingerprint,
			const kvt_key *k, uint32_t shard, uint32_t n_shards, uint32_t depth,
			uint64_t len);

/* Writes the header before payload (obj[0..64)) and the tag after it
 * (obj[64 + payload .. + 16)): the object is obj[0 .. 80 + payload). */
int kvt_l3_seal(kvt_l3_sealer *s, uint8_t *obj, uint64_t fingerprint, const kvt_key *k,
		uint32_t shard, uint32_t n_shards, uint32_t depth, uint64_t payload);
/* Checks an object of len bytes against what it must be: 0, or -EBADMSG
 * (tag, magic, length, or a field that is not the expected one). */
int kvt_l3_open_obj(kvt_l3_sealer *s, uint8_t *obj, uint64_t len, uint64_t fingerprint,
		    const kvt_key *k, uint32_t shard, uint32_t n_shards, uint64_t payload);

#endif
