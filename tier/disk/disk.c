/* disk.c - the disk tier's engine (kvt_disk.h).
 *
 * The file:
 *
 *   0          superblock (4 KiB): magic, version, layout (fingerprint,
 *              shards, shard and payload bytes), chunks, offsets, the MAC
 *              key's check tag, checksum
 *   4096       record table: one 128 B record per extent (key, depth,
 *              extent generation, write sequence, the chunk's MAC nonce
 *              and tag, the record's own checksum), in 4 KiB blocks
 *   data_off   extents: extent e at data_off + e x extent_bytes holds one
 *              chunk, shard s at + s x shard_bytes (1 MiB aligned)
 *
 * Demotion (arena -> disk) runs ahead of eviction: the scan starts at the
 * CLOCK hand, where the next evictions happen, and walks one lap of the
 * arena; a READY chunk not on disk that the admission policy takes is
 * written from its arena slot (fixed buffers: no copy), with no pin: the
 * slot's life is checked again when the write completed, and a chunk
 * evicted meanwhile is dropped (a torn copy is never published).  So
 * eviction never waits for the disk and the disk never holds a slot.
 *
 * Visibility and crashes.  A chunk enters the segment's index (where
 * lookups see it) only after its write completed and its slot was found
 * in the same life; its record is written after that.  Every read back is
 * verified against the record's tag (a MAC under a key only the tier's uid
 * can read, over the layout, the key, the depth and the payload:
 * disk_trust.c): a mismatch is counted and is a miss, never served.  So a
 * kill -9 or a power cut at any point leaves at worst records that point
 * at data that is not theirs, which fail the MAC -- and so does anything
 * another user managed to write into the file (its rules keep them out:
 * disk_trust.c), whatever checksums they recomputed; no fsync is needed
 * for correctness, and none is on the data path.  At start the record
 * table is replayed into the index (the newest record of a key wins); a
 * chunk is verified when it is first read, as every read is.
 *
 * Promotion (disk -> arena): lookups put requests in their rings
 * (kvt_lookup_ex); the engine takes them, allocates the slot and claims
 * every shard through the normal write protocol (kvt_write_begin), reads
 * the extent into the claimed sub-slots, verifies and publishes the chunk
 * READY with kvt_write_end -- the protocol the ranks use, so nothing in
 * core's state machine changed.  An extent being read is not evicted from
 * the disk.
 *
 * A full disk evicts: a CLOCK over extents (a promotion request sets the
 * extent's reference), never an error to the engine.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <liburing.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "kvt_clock.h"
#include "kvt_disk.h"
#include "kvt_log.h"
#include "kvt_disk_trust.h"

#define DISK_MAGIC   "KVTDISK1"
/* 2: chunks carry a MAC (128-byte records, the key check in the
 * superblock); version 1 files are refused with their version named. */
#define DISK_VERSION 2u
#define SB_BYTES     4096u
#define META_BLOCK   4096u
#define REC_BYTES    128u
#define REC_PER_BLK  (META_BLOCK / REC_BYTES)
#define DATA_ALIGN   (1u << 20)
#define DIO_ALIGN    4096u
#define PIECE_MAX    (1ULL << 30)
#define GHOST_N      65536u
#ifndef RAMFS_MAGIC
#define RAMFS_MAGIC  0x858458f6
#endif

struct dsuper {
	char magic[8];
	uint32_t version, sb_bytes;
	uint64_t bytes;          /* file bytes the layout uses */
	uint64_t chunks;
	uint64_t extent_bytes;
	uint64_t shard_bytes;
	uint64_t payload;        /* unrounded bytes of one shard */
	uint32_t n_shards, pad0;
	uint64_t meta_off, data_off;
	kvt_key fingerprint;
	uint64_t created_ns;
	uint8_t key_nonce[KVT_MAC_NONCE_BYTES]; /* the key check: the tag of */
	uint8_t key_tag[KVT_MAC_TAG_BYTES];     /* KEY_CHECK_LABEL + fingerprint */
	uint32_t pad1;
	uint64_t csum;           /* XXH3-64 of the bytes before it */
};

#define REC_VALID 0x1u
#define REC_MAGIC 0x4b565452u /* "RTVK" */
struct drec {
	uint32_t magic, flags;
	uint64_t key_lo, key_hi;
	uint32_t depth, egen;
	uint64_t seq;            /* write sequence: the newest record of a key wins */
	uint8_t nonce[KVT_MAC_NONCE_BYTES]; /* the chunk's MAC (chunk_tag) */
	uint32_t pad0;
	uint8_t tag[KVT_MAC_TAG_BYTES];
	uint8_t pad[48];
	uint64_t rcsum;          /* XXH3-64 of the 120 bytes before it */
};
_Static_assert(sizeof(struct drec) == REC_BYTES, "record is 128 bytes");
_Static_assert(sizeof(struct dsuper) <= SB_BYTES, "superblock fits its block");

/* Per extent, in memory only. */
struct dext {
	uint32_t pos;    /* index entry while published */
	uint16_t busy;   /* I/Os using it (a read back, a write) */
	uint8_t ref;     /* disk CLOCK reference */
	uint8_t used;    /* holds a published chunk */
	uint32_t egen;
	uint32_t free_next;
};

enum job_kind { J_FREE = 0, J_DEMOTE, J_PROMOTE, J_META };

struct job {
	uint32_t kind;
	uint32_t left;       /* I/Os outstanding */
	int err;
	uint32_t slot, extent, depth, block;
	uint64_t w;          /* demote: the slot's state word at the scan */
	uint8_t nonce[KVT_MAC_NONCE_BYTES];
	uint8_t tag[KVT_MAC_TAG_BYTES];
	uint64_t t0;
	kvt_key key;
	struct kvt_disk_ref ref;
	struct kvt_wref *wr; /* promote: n_shards claims */
};

struct kvt_disk {
	kvt_seg *s;
	struct kvt_disk_opts o;
	char path[256];
	char key_path[256];
	int fd, efd;
	int direct, fixed;
	struct io_uring ring;
	int ring_ok;
	struct dsuper sb;
	uint64_t n;            /* extents */
	uint64_t shard_bytes, payload, extent_bytes;
	uint32_t n_shards, n_slots;
	struct drec *rec;      /* n_blocks x 4 KiB, aligned */
	uint64_t n_blocks;
	uint8_t *dirty, *blk_busy;
	uint64_t n_dirty, meta_cursor;
	struct dext *ext;
	uint64_t free_head, free_tail, n_free;  /* FIFO of free extents, via free_next */
	uint64_t disk_hand;
	uint64_t used;
	uint64_t seq;
	struct job *jobs;
	uint32_t n_jobs, jobs_live;
	uint32_t inflight;     /* I/Os submitted, not completed */
	uint64_t io_errors;    /* data and record I/Os the device failed */
	uint32_t err_run;      /* ... in a row, without a success between */
	int failed;            /* taken offline for errors: DRAM only */
	uint32_t queued;       /* SQEs prepared, not submitted */
	uint64_t cursor;       /* demotion scan, in CLOCK-hand units */
	uint64_t lap_idle;     /* slots scanned since the scan last started a write */
	uint64_t idle_hand, idle_ns; /* the hand and time when a lap found nothing */
	uint32_t *seen;        /* per slot: low gen + 1 of the life handled */
	uint8_t *rejected;     /* per slot: that life was refused admission */
	uint64_t *ghost;       /* second-hit: keys seen before */
	/* fixed buffers: buffer index of (shard, piece) */
	uint64_t piece;        /* bytes of one piece (a multiple of shard_bytes) */
	uint32_t pieces_per_part;
	uint8_t *arena_part[KVT_MAX_WORLD];
	uint64_t replayed;
	uint64_t last_publish, last_meta;
	int closing;
	kvt_mac *mac;
	uint64_t mac_errors;   /* tags the MAC could not compute (libcrypto failed) */
};

static uint64_t round_up(uint64_t x, uint64_t a)
{
	return (x + a - 1) / a * a;
}


static void dlog(const kvt_disk *d, int level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void dlog(const kvt_disk *d, int level, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	kvt__vlog(d->o.log, d->o.log_arg, "disk", level, fmt, ap);
	va_end(ap);
}

/* ---- layout ---- */

static uint64_t data_off_for(uint64_t chunks)
{
	return round_up(SB_BYTES + round_up(chunks * sizeof(struct drec), META_BLOCK), DATA_ALIGN);
}

static uint64_t chunks_for(uint64_t bytes, uint64_t extent_bytes)
{
	if (!extent_bytes || bytes < DATA_ALIGN + extent_bytes)
		return 0;
	uint64_t n = (bytes - DATA_ALIGN) / (extent_bytes + sizeof(struct drec));
	while (n && data_off_for(n) + n * extent_bytes > bytes)
		n--;
	while (data_off_for(n + 1) + (n + 1) * extent_bytes <= bytes)
		n++;
	return n > (1u << 30) ? (1u << 30) : n;
}

static uint64_t sb_csum(const struct dsuper *sb)
{
	return XXH3_64bits(sb, offsetof(struct dsuper, csum));
}

static uint64_t rec_csum(const struct drec *r)
{
	return XXH3_64bits(r, offsetof(struct drec, rcsum));
}

enum { SB_NONE = 0, SB_OK, SB_VERSION, SB_DAMAGED };

/* SB_OK: a superblock of this version, checksum right; SB_VERSION: a
 * kvtier disk of another version (sb->version); SB_DAMAGED: this
 * version's magic with a wrong checksum; SB_NONE: not a kvtier disk. */
static int read_super(int fd, struct dsuper *sb)
{
	void *buf;
	int r = SB_NONE;

	if (posix_memalign(&buf, DIO_ALIGN, SB_BYTES))
		return SB_NONE;
	if (pread(fd, buf, SB_BYTES, 0) == (ssize_t)SB_BYTES) {
		memcpy(sb, buf, sizeof(*sb));
		if (!memcmp(sb->magic, DISK_MAGIC, 8))
			r = sb->version != DISK_VERSION ? SB_VERSION :
			    sb->csum == sb_csum(sb) ? SB_OK : SB_DAMAGED;
	}
	free(buf);
	return r;
}

/* The file's size: a block device's, else st_size. */
static int file_size(int fd, const struct stat *st, uint64_t *out)
{
	if (S_ISBLK(st->st_mode))
		return ioctl(fd, BLKGETSIZE64, out) ? -errno : 0;
	*out = (uint64_t)st->st_size;
	return 0;
}

int kvt_disk_plan(const char *path, uint64_t bytes, uint64_t shard_bytes, uint32_t n_shards,
		  uint64_t *chunks, char *err, size_t len)
{
	uint64_t eb = shard_bytes * n_shards;

	if (!path || !*path)
		return kvt_disk_eset(err, len, -EINVAL, "disk: no path");
	if (!bytes) {
		struct stat st;
		struct dsuper sb;
		/* the file rules first: a FIFO is refused, not waited on */
		int fd = kvt_disk_file_open("disk", path, 0, 0, NULL, &st, err, len);
		if (fd == -ENOENT)
			return kvt_disk_eset(err, len, fd, "disk %s: no such file (give a size to create it)",
				    path);
		if (fd < 0)
			return fd;
		if (file_size(fd, &st, &bytes)) {
			int e = -errno;
			close(fd);
			return kvt_disk_eset(err, len, e, "disk %s: %s", path, strerror(-e));
		}
		if (read_super(fd, &sb) == SB_OK && sb.extent_bytes == eb)
			bytes = sb.bytes;
		close(fd);
	}
	*chunks = chunks_for(bytes, eb);
	if (*chunks < 1)
		return kvt_disk_eset(err, len, -ENOSPC, "disk %s: %llu bytes hold no chunk of %llu bytes "
			    "(%u shard(s) of %llu) with the record table: give it at least "
			    "%llu bytes", path, (unsigned long long)bytes, (unsigned long long)eb,
			    n_shards, (unsigned long long)shard_bytes,
			    (unsigned long long)(data_off_for(1) + eb));
	return 0;
}

/* ---- extents ---- */

static void free_push(kvt_disk *d, uint32_t e)
{
	d->ext[e].free_next = UINT32_MAX;
	if (d->n_free)
		d->ext[d->free_tail].free_next = e;
	else
		d->free_head = e;
	d->free_tail = e;
	d->n_free++;
}

static void mark_dirty(kvt_disk *d, uint32_t e)
{
	uint64_t b = e / REC_PER_BLK;

	if (!d->dirty[b]) {
		d->dirty[b] = 1;
		d->n_dirty++;
	}
}

/* Forgets extent e's chunk: out of the index, record invalid. */
static void extent_drop(kvt_disk *d, uint32_t e)
{
	struct dext *x = &d->ext[e];

	if (x->used) {
		kvt_disk_del(d->s, x->pos);
		x->used = 0;
		d->used--;
	}
	memset(&d->rec[e], 0, sizeof(d->rec[e]));
	mark_dirty(d, e);
}

/* A free extent, evicting from the disk when it is full: UINT32_MAX when
 * every extent is busy. */
static uint32_t extent_alloc(kvt_disk *d)
{
	if (d->n_free) {
		uint32_t e = (uint32_t)d->free_head;
		d->free_head = d->ext[e].free_next;
		d->n_free--;
		return e;
	}
	for (uint64_t k = 0; k < 2 * d->n + 1; k++) {
		uint32_t e = (uint32_t)(d->disk_hand++ % d->n);
		struct dext *x = &d->ext[e];
		if (x->busy)
			continue;
		if (x->ref) {
			x->ref = 0;
			continue;
		}
		if (x->used) {
			extent_drop(d, e);
			kvt_counter_add(d->s, KVT_C_DISK_EVICTIONS, 1);
		}
		return e;
	}
	return UINT32_MAX;
}

/* ---- the chunk MAC (disk_trust.c) ---- */

/* What a tag is bound to besides the payload: a chunk verifies only under
 * its own key and depth, in this layout. */
struct mac_head {
	char label[8];
	kvt_key fingerprint, key;
	uint32_t depth, n_shards;
	uint64_t payload, shard_bytes;
};

static int chunk_tag(kvt_disk *d, uint32_t slot, const kvt_key *k, uint32_t depth,
		     const uint8_t nonce[KVT_MAC_NONCE_BYTES], uint8_t tag[KVT_MAC_TAG_BYTES])
{
	struct mac_head h;
	int r;

	memset(&h, 0, sizeof(h));
	memcpy(h.label, "KVTCHUNK", 8);
	h.fingerprint = d->sb.fingerprint;
	h.key = *k;
	h.depth = depth;
	h.n_shards = d->n_shards;
	h.payload = d->payload;
	h.shard_bytes = d->shard_bytes;
	r = kvt_mac_begin(d->mac, nonce);
	if (!r)
		r = kvt_mac_update(d->mac, &h, sizeof(h));
	for (uint32_t sh = 0; !r && sh < d->n_shards; sh++)
		r = kvt_mac_update(d->mac, kvt_slot_shard_ptr(d->s, slot, sh), d->payload);
	if (!r)
		r = kvt_mac_final(d->mac, tag);
	if (r)
		d->mac_errors++;
	return r;
}

/* The superblock's key check: the tag of a label and the file's identity
 * under the key, so that another key (or none) is told at open. */
static int key_check_tag(kvt_disk *d, const struct dsuper *sb, uint8_t tag[KVT_MAC_TAG_BYTES])
{
	int r = kvt_mac_begin(d->mac, sb->key_nonce);

	if (!r)
		r = kvt_mac_update(d->mac, "KVTKEYCK", 8);
	if (!r)
		r = kvt_mac_update(d->mac, &sb->fingerprint, sizeof(sb->fingerprint));
	if (!r)
		r = kvt_mac_update(d->mac, &sb->created_ns, sizeof(sb->created_ns));
	if (!r)
		r = kvt_mac_final(d->mac, tag);
	return r;
}

/* ---- submission ---- */

/* Hands the queued SQEs to the kernel.  What it did not take (a partial
 * submit) stays counted, so that the next round submits it. */
static void submit(kvt_disk *d)
{
	if (d->queued && io_uring_submit(&d->ring) >= 0)
		d->queued = io_uring_sq_ready(&d->ring);
}

static struct io_uring_sqe *sqe_get(kvt_disk *d)
{
	struct io_uring_sqe *q = io_uring_get_sqe(&d->ring);

	if (!q) {
		submit(d);
		q = io_uring_get_sqe(&d->ring);
	}
	return q;
}

static int buf_index(const kvt_disk *d, uint32_t slot, uint32_t shard)
{
	uint64_t off = (uint64_t)slot * d->shard_bytes;

	return (int)(shard * d->pieces_per_part + off / d->piece);
}

/* Queues one shard's I/O of job j: 0, or -EBUSY (no SQE). */
static int queue_io(kvt_disk *d, uint32_t j, int write, uint32_t slot, uint32_t shard,
		    uint32_t extent)
{
	struct io_uring_sqe *q = sqe_get(d);
	void *p = kvt_slot_shard_ptr(d->s, slot, shard);
	uint64_t off = d->sb.data_off + (uint64_t)extent * d->extent_bytes +
		       (uint64_t)shard * d->shard_bytes;
	int fd = 0; /* the disk file: registered file 0 (ring_setup) */
	unsigned len = (unsigned)(d->direct ? d->shard_bytes : d->payload);

	if (!q)
		return -EBUSY;
	if (d->fixed) {
		if (write)
			io_uring_prep_write_fixed(q, fd, p, len, off, buf_index(d, slot, shard));
		else
			io_uring_prep_read_fixed(q, fd, p, len, off, buf_index(d, slot, shard));
	} else if (write) {
		io_uring_prep_write(q, fd, p, len, off);
	} else {
		io_uring_prep_read(q, fd, p, len, off);
	}
	q->flags |= IOSQE_FIXED_FILE;
	io_uring_sqe_set_data64(q, ((uint64_t)j << 32) | len);
	d->queued++;
	d->inflight++;
	d->jobs[j].left++;
	return 0;
}

static uint32_t job_get(kvt_disk *d, uint32_t kind)
{
	for (uint32_t j = 0; j < d->n_jobs; j++)
		if (d->jobs[j].kind == J_FREE) {
			struct job *b = &d->jobs[j];
			struct kvt_wref *wr = b->wr;
			memset(b, 0, sizeof(*b));
			b->wr = wr;
			b->kind = kind;
			d->jobs_live++;
			return j;
		}
	return UINT32_MAX;
}

static void job_put(kvt_disk *d, uint32_t j)
{
	d->jobs[j].kind = J_FREE;
	d->jobs_live--;
}

/* Room for one more chunk's I/O. */
static int io_room(const kvt_disk *d)
{
	return d->inflight == 0 || d->inflight + d->n_shards <= d->o.depth;
}

/* ---- a failing device ----
 *
 * An extent whose read fails is dropped from the index (a miss from then
 * on, never asked again); a failed write is never published.  Every
 * failure is counted (the status page: kvtier_disk_io_errors_total).
 * FAIL_AFTER failures in a row with no data I/O succeeding between (a
 * record write that succeeds says little about the data extents) take
 * the disk offline: the index is emptied (lookups stop asking), no new I/O starts,
 * what is in flight is still reaped (its claims end properly), and the
 * node serves DRAM; /healthcheck says "degraded", kvtier_disk_failed is 1.
 * A restart of kvtierd tries the device again. */
#define FAIL_AFTER 16
#define LOG_ERRORS 8

static void io_ok(kvt_disk *d) { d->err_run = 0; }

static void io_error(kvt_disk *d, const char *what, int err)
{
	d->io_errors++;
	d->err_run++;
	if (d->io_errors <= LOG_ERRORS)
		dlog(d, 1, "%s: %s failed: %s%s", d->path, what, strerror(-err),
		     d->io_errors == LOG_ERRORS ? " (further errors are counted, not logged: "
		     "kvtier_disk_io_errors_total)" : "");
	if (d->err_run >= FAIL_AFTER && !d->failed) {
		d->failed = 1;
		dlog(d, 1, "%s: %u I/O errors in a row (%llu in all): the disk tier is taken "
		     "offline, the node serves from DRAM; check the device, then restart kvtierd",
		     d->path, d->err_run, (unsigned long long)d->io_errors);
		kvt_disk_engine_stop(d->s);
	}
}

/* ---- demotion ---- */

/* The ghost table: a direct-mapped set of keys seen (and refused) before,
 * by a hash of the whole key (keys are hashes, but not every caller's). */
static uint64_t ghost_hash(const kvt_key *k)
{
	return XXH3_64bits(k, sizeof(*k)) | 1;
}

static int ghost_has(kvt_disk *d, const kvt_key *k)
{
	uint64_t h = ghost_hash(k);

	return d->ghost[(h >> 1) % GHOST_N] == h;
}

static void ghost_add(kvt_disk *d, const kvt_key *k)
{
	uint64_t h = ghost_hash(k);

	d->ghost[(h >> 1) % GHOST_N] = h;
}

/* Starts a demotion of slot x (READY in life w) to a free extent:
 * 1 started, 0 not now (no extent, no SQE), -1 nothing to do. */
static int demote_start(kvt_disk *d, uint32_t x, const kvt_key *k, uint32_t depth, uint64_t w)
{
	uint32_t e = extent_alloc(d), j;

	if (e == UINT32_MAX)
		return 0;
	j = job_get(d, J_DEMOTE);
	if (j == UINT32_MAX) {
		free_push(d, e);
		return 0;
	}
	struct job *b = &d->jobs[j];
	b->slot = x;
	b->w = w;
	b->extent = e;
	b->key = *k;
	b->depth = depth;
	/* The tag of what the write will carry: the slot is READY, so its
	 * payload does not change in this life (checked at the end). */
	if (kvt_mac_nonce(b->nonce) || chunk_tag(d, x, k, depth, b->nonce, b->tag)) {
		free_push(d, e);
		job_put(d, j);
		kvt_counter_add(d->s, KVT_C_DISK_WRITE_DROPS, 1);
		return -1;
	}
	b->t0 = kvt__now_ns();
	d->ext[e].busy++;
	for (uint32_t sh = 0; sh < d->n_shards; sh++)
		if (queue_io(d, j, 1, x, sh, e)) {
			b->err = -EBUSY;
			break;
		}
	if (!b->left) {
		d->ext[e].busy--;
		free_push(d, e);
		job_put(d, j);
		return 0;
	}
	/* the chunk's I/Os go to the kernel now: the next chunk's MAC
	 * (CPU) overlaps them instead of delaying them to the round's end */
	submit(d);
	return 1;
}

static void demote_done(kvt_disk *d, uint32_t j)
{
	struct job *b = &d->jobs[j];
	struct dext *x = &d->ext[b->extent];
	uint32_t pos;

	x->busy--;
	if (!b->err)
		io_ok(d);
	if (b->err || !kvt_slot_same_life(d->s, b->slot, b->w)) {
		/* An I/O error, or the slot was evicted during the write:
		 * what reached the disk may be torn.  Never published. */
		kvt_counter_add(d->s, KVT_C_DISK_WRITE_DROPS, 1);
		if (b->err && b->err != -EBUSY)
			io_error(d, "write (the chunk is dropped, not published)", b->err);
		else if (!b->err)
			io_ok(d);
		free_push(d, b->extent);
		job_put(d, j);
		return;
	}
	x->egen++;
	int r = kvt_disk_put(d->s, &b->key, b->extent, x->egen, &pos);
	if (r) {
		kvt_counter_add(d->s, KVT_C_DISK_WRITE_DROPS, 1);
		free_push(d, b->extent);
		job_put(d, j);
		return;
	}
	struct drec *rc = &d->rec[b->extent];
	memset(rc, 0, sizeof(*rc));
	rc->magic = REC_MAGIC;
	rc->flags = REC_VALID;
	rc->key_lo = b->key.lo;
	rc->key_hi = b->key.hi;
	rc->depth = b->depth;
	rc->egen = x->egen;
	memcpy(rc->nonce, b->nonce, sizeof(rc->nonce));
	memcpy(rc->tag, b->tag, sizeof(rc->tag));
	rc->seq = ++d->seq;
	rc->rcsum = rec_csum(rc);
	mark_dirty(d, b->extent);
	x->pos = pos;
	x->used = 1;
	x->ref = 0;
	d->used++;
	kvt_counter_add(d->s, KVT_C_DISK_WRITES, 1);
	kvt_counter_add(d->s, KVT_C_DISK_BYTES_WRITTEN, d->payload * d->n_shards);
	kvt_hist_add(d->s, KVT_H_DISK_WRITE, kvt__now_ns() - b->t0);
	job_put(d, j);
}

/* Looks at slot x for demotion: 1 started, 0 stop scanning, -1 next. */
static int demote_consider(kvt_disk *d, uint32_t x)
{
	kvt_key k;
	uint32_t depth, ref;
	uint64_t w;

	if (!kvt_slot_ready(d->s, x, &k, &depth, &ref, &w))
		return -1;
	uint32_t g = (uint32_t)(w >> 24) + 1;
	if (!g)
		g = 1;
	if (d->seen[x] == g && !d->rejected[x])
		return -1;
	if (kvt_disk_find(d->s, &k, NULL)) {
		d->seen[x] = g;
		d->rejected[x] = 0;
		return -1;
	}
	/* second-hit: hit in DRAM since it was saved (the CLOCK reference a
	 * lookup sets), or a new life of a key refused before (it was
	 * evicted and came back: asked for twice). */
	if (d->o.admit == KVT_ADMIT_SECOND_HIT && ref < 2 &&
	    (d->seen[x] == g || !ghost_has(d, &k))) {
		if (d->seen[x] != g) {
			kvt_counter_add(d->s, KVT_C_DISK_ADMIT_REJECTS, 1);
			ghost_add(d, &k);
		}
		d->seen[x] = g;
		d->rejected[x] = 1;
		return -1;
	}
	int r = demote_start(d, x, &k, depth, w);
	if (r == 1) {
		d->seen[x] = g;
		d->rejected[x] = 0;
	}
	return r;
}

static int demote_scan(kvt_disk *d)
{
	uint64_t h = kvt_seg_clock_hand(d->s), n = d->n_slots;
	int started = 0;

	if (d->o.admit == KVT_ADMIT_NONE)
		return 0;
	/* A lap that started nothing, and no slot allocated since: nothing
	 * new can be READY.  Look again after 100 ms (a chunk refused by
	 * second-hit may have been hit since). */
	uint64_t now = kvt__now_ns();
	if (d->lap_idle >= n) {
		if (h == d->idle_hand && now - d->idle_ns < 100000000ULL)
			return 0;
		d->lap_idle = 0;
	}
	if (d->cursor < h || d->cursor >= h + n)
		d->cursor = h; /* behind the hand, or a lap done: start at the hand */
	for (uint32_t k = 0; k < d->o.scan && d->cursor < h + n; k++) {
		if (!io_room(d) || d->jobs_live >= d->n_jobs)
			break;
		int r = demote_consider(d, (uint32_t)(d->cursor % n));
		if (r == 0)
			break;
		d->cursor++;
		if (r == 1) {
			started++;
			d->lap_idle = 0;
		} else if (++d->lap_idle == n) {
			d->idle_hand = h; /* a lap with nothing to write */
			d->idle_ns = now;
		}
	}
	return started;
}

/* ---- promotion ---- */

static void promote_abort(kvt_disk *d, struct job *b, uint32_t claimed)
{
	for (uint32_t sh = 0; sh < claimed; sh++)
		kvt_write_end(d->s, &b->wr[sh], 0);
}

static int promote_start(kvt_disk *d, const struct kvt_disk_ref *ref, const kvt_key *k)
{
	uint32_t e = ref->extent, j, sh;
	struct drec *rc;

	if (e >= d->n || !d->ext[e].used || d->ext[e].egen != ref->egen ||
	    d->ext[e].pos != ref->pos) {
		kvt_counter_add(d->s, KVT_C_PROMOTE_DROPS, 1);
		return 0;
	}
	rc = &d->rec[e];
	if (rc->key_lo != k->lo || rc->key_hi != k->hi) {
		kvt_counter_add(d->s, KVT_C_PROMOTE_DROPS, 1);
		return 0;
	}
	d->ext[e].ref = 1;
	/* In DRAM already (READY, or a rank saving it right now): nothing to
	 * do.  Checked first, so that the engine does not join a rank's fill
	 * of the chunk (between this check and the claims below a rank can
	 * still start one; then both step aside from one shard each at worst
	 * and the fill timeout reclaims the slot: a lost save, never wrong
	 * bytes). */
	if (kvt_seg_peek(d->s, k, 1) == 1)
		return 0;
	j = job_get(d, J_PROMOTE);
	if (j == UINT32_MAX)
		return -1;
	struct job *b = &d->jobs[j];
	b->extent = e;
	b->key = *k;
	b->ref = *ref;
	b->depth = rc->depth;
	memcpy(b->nonce, rc->nonce, sizeof(b->nonce));
	memcpy(b->tag, rc->tag, sizeof(b->tag));
	b->t0 = kvt__now_ns();
	for (sh = 0; sh < d->n_shards; sh++) {
		int r = kvt_write_begin(d->s, k, rc->depth, sh, &b->wr[sh]);
		if (r == KVT_SKIP && sh == 0) {
			job_put(d, j); /* in DRAM already, or being saved */
			return 0;
		}
		if (r) {
			/* no slot (-ENOSPC), or a rank writes a shard of it
			 * right now: let the save have it */
			promote_abort(d, b, sh);
			kvt_counter_add(d->s, KVT_C_PROMOTE_DROPS, 1);
			job_put(d, j);
			return 0;
		}
	}
	b->slot = b->wr[0].slot;
	d->ext[e].busy++;
	for (sh = 0; sh < d->n_shards; sh++)
		if (queue_io(d, j, 0, b->slot, sh, e)) {
			b->err = -EBUSY;
			break;
		}
	if (!b->left) {
		d->ext[e].busy--;
		promote_abort(d, b, d->n_shards);
		job_put(d, j);
		return -1;
	}
	submit(d);
	return 1;
}

static void promote_done(kvt_disk *d, uint32_t j)
{
	struct job *b = &d->jobs[j];
	struct dext *x = &d->ext[b->extent];
	int ok = 0;

	x->busy--;
	if (!b->err) {
		uint8_t tag[KVT_MAC_TAG_BYTES];
		ok = !chunk_tag(d, b->slot, &b->key, b->depth, b->nonce, tag) &&
		     kvt_mac_equal(tag, b->tag);
		if (!ok) {
			kvt_counter_add(d->s, KVT_C_DISK_CSUM_ERRORS, 1);
			dlog(d, 1, "%s: extent %u: MAC mismatch (key %016llx%016llx: torn, "
			     "damaged or not written by this tier): a miss, the chunk is "
			     "dropped from the disk", d->path, b->extent,
			     (unsigned long long)b->key.hi, (unsigned long long)b->key.lo);
			if (x->used && x->pos == b->ref.pos && x->egen == b->ref.egen) {
				extent_drop(d, b->extent);
				free_push(d, b->extent);
			}
		}
	} else if (b->err != -EBUSY) {
		/* The device could not read it: drop it, so that it is a plain
		 * miss from now on instead of a request asked again forever. */
		char what[64];
		snprintf(what, sizeof(what), "read of extent %u", b->extent);
		io_error(d, what, b->err);
		if (x->used && x->pos == b->ref.pos && x->egen == b->ref.egen) {
			extent_drop(d, b->extent);
			free_push(d, b->extent);
		}
	}
	if (!b->err)
		io_ok(d);
	for (uint32_t sh = 0; sh < d->n_shards; sh++)
		kvt_write_end(d->s, &b->wr[sh], ok);
	if (ok) {
		kvt_counter_add(d->s, KVT_C_DISK_READS, 1);
		kvt_counter_add(d->s, KVT_C_DISK_BYTES_READ, d->payload * d->n_shards);
		kvt_hist_add(d->s, KVT_H_DISK_READ, kvt__now_ns() - b->t0);
	} else {
		kvt_counter_add(d->s, KVT_C_PROMOTE_DROPS, 1);
	}
	job_put(d, j);
}

static int promote_requests(kvt_disk *d)
{
	struct kvt_disk_ref refs[64];
	kvt_key keys[64];
	int started = 0;

	while (io_room(d) && d->jobs_live < d->n_jobs) {
		/* take only what fits: each promotion is n_shards reads, and
		 * the I/Os in flight stay within the depth (the completion
		 * ring is sized by it) */
		uint32_t room = d->n_jobs - d->jobs_live;
		uint32_t fit = (d->o.depth - d->inflight) / d->n_shards;
		if (!fit)
			fit = 1; /* io_room: nothing in flight */
		if (room > fit)
			room = fit;
		int n = kvt_disk_take_requests(d->s, refs, keys, room < 64 ? room : 64);
		if (n <= 0)
			break;
		for (int i = 0; i < n; i++) {
			int r = promote_start(d, &refs[i], &keys[i]);
			if (r < 0)
				kvt_counter_add(d->s, KVT_C_PROMOTE_DROPS, 1);
			else
				started += r;
		}
	}
	return started;
}

/* ---- records ---- */

/* Records go out at most every META_MS while data I/O is in flight (a
 * block holds 64 records: rewriting it at every completion would put a
 * small write between every two large ones), at once when the data I/O
 * is idle.  A crash loses at most the chunks of the last META_MS: never
 * served wrong, only missing. */
#define META_MS 5
static int meta_flush(kvt_disk *d)
{
	int started = 0;
	uint64_t now = kvt__now_ns();

	if (!d->n_dirty || (d->inflight && now - d->last_meta < META_MS * 1000000ULL &&
			    !d->closing))
		return 0;
	d->last_meta = now;
	for (uint64_t k = 0; k < d->n_blocks && d->n_dirty && d->inflight < d->o.depth; k++) {
		uint64_t b = d->meta_cursor++ % d->n_blocks;
		if (!d->dirty[b] || d->blk_busy[b])
			continue;
		uint32_t j = job_get(d, J_META);
		if (j == UINT32_MAX)
			break;
		struct io_uring_sqe *q = sqe_get(d);
		if (!q) {
			job_put(d, j);
			break;
		}
		int fd = 0; /* registered file 0 */
		io_uring_prep_write(q, fd, (uint8_t *)d->rec + b * META_BLOCK, META_BLOCK,
				    d->sb.meta_off + b * META_BLOCK);
		q->flags |= IOSQE_FIXED_FILE;
		io_uring_sqe_set_data64(q, ((uint64_t)j << 32) | META_BLOCK);
		d->jobs[j].block = (uint32_t)b;
		d->jobs[j].left = 1;
		d->queued++;
		d->inflight++;
		d->dirty[b] = 0;
		d->n_dirty--;
		d->blk_busy[b] = 1;
		started++;
	}
	return started;
}

/* ---- completions ---- */

static int reap(kvt_disk *d)
{
	struct io_uring_cqe *cqes[64];
	int done = 0;

	for (;;) {
		unsigned n = io_uring_peek_batch_cqe(&d->ring, cqes, 64);
		if (!n)
			break;
		for (unsigned i = 0; i < n; i++) {
			uint64_t ud = io_uring_cqe_get_data64(cqes[i]);
			uint32_t j = (uint32_t)(ud >> 32), want = (uint32_t)ud;
			int res = cqes[i]->res;
			if (j >= d->n_jobs || d->jobs[j].kind == J_FREE)
				continue;
			struct job *b = &d->jobs[j];
			if (res < 0 && !b->err)
				b->err = res;
			else if (res >= 0 && (uint32_t)res != want && !b->err)
				b->err = -EIO; /* short: past the end, or a device error */
			d->inflight--;
			if (--b->left)
				continue;
			done++;
			switch (b->kind) {
			case J_DEMOTE: demote_done(d, j); break;
			case J_PROMOTE: promote_done(d, j); break;
			case J_META:
				d->blk_busy[b->block] = 0;
				if (b->err && b->err != -EBUSY) {
					mark_dirty(d, b->block * REC_PER_BLK);
					io_error(d, "record write", b->err);
				}
				job_put(d, j);
				break;
			}
		}
		io_uring_cq_advance(&d->ring, n);
	}
	return done;
}

static void publish(kvt_disk *d)
{
	struct kvt_disk_status st;

	memset(&st, 0, sizeof(st));
	st.chunks = d->n;
	st.used = d->used;
	st.inflight = d->inflight;
	st.direct = (uint64_t)d->direct;
	st.io_errors = d->io_errors;
	st.failed = (uint64_t)d->failed;
	kvt_disk_engine_publish(d->s, &st);
}

int kvt_disk_poll(kvt_disk *d)
{
	int work = 0;
	uint64_t v;

	if (!d)
		return -EINVAL;
	if (d->efd >= 0)
		while (read(d->efd, &v, sizeof(v)) == (ssize_t)sizeof(v))
			;
	work += reap(d);
	if (d->failed) {
		/* offline: what is in flight is reaped (above), nothing new
		 * (lookups no longer ask: the engine is published offline) */
		goto out;
	}
	/* Records first: they are small, and a chunk's record lagging its
	 * data is a chunk lost at a crash. */
	work += meta_flush(d);
	work += promote_requests(d);
	work += demote_scan(d);
	submit(d);
out:;
	uint64_t now = kvt__now_ns();
	if (work || now - d->last_publish > 50000000ULL) {
		publish(d);
		d->last_publish = now;
	}
	return work;
}

int kvt_disk_event_fd(const kvt_disk *d)
{
	return d ? d->efd : -1;
}

int kvt_disk_drain(kvt_disk *d, int demote_all, int64_t timeout_ns)
{
	uint64_t t0 = kvt__now_ns();

	if (!d)
		return -EINVAL;
	if (demote_all)
		d->lap_idle = 0;
	for (;;) {
		int w = kvt_disk_poll(d);
		if (w < 0)
			return w;
		if (d->failed && !d->inflight && !d->jobs_live)
			return 0; /* offline: its records are not written any more */
		if (!d->inflight && !d->n_dirty && !d->jobs_live && !d->queued &&
		    (!demote_all || d->o.admit == KVT_ADMIT_NONE || d->lap_idle >= d->n_slots))
			return 0;
		if (timeout_ns >= 0 && kvt__now_ns() - t0 > (uint64_t)timeout_ns)
			return -ETIMEDOUT;
		if (d->inflight) {
			struct io_uring_cqe *c;
			struct __kernel_timespec ts = { 0, 1000000 };
			io_uring_wait_cqe_timeout(&d->ring, &c, &ts);
		}
	}
}

/* ---- open and close ---- */

static void disk_lock_at(struct flock *fl, short type, off_t byte)
{
	memset(fl, 0, sizeof(*fl));
	fl->l_type = type;
	fl->l_whence = SEEK_SET;
	fl->l_start = byte;
	fl->l_len = 1;
}

/* One engine per disk file, before anything is read or formatted.
 *
 * The guarantee is an OFD write lock on byte 0 of d->fd.  d->fd is also
 * registered with the ring (ring_setup), so the lock outlives a dead
 * engine for as long as its writes to the file can still land: a new
 * engine (or --disk-reset) cannot start on the file under them.  An OFD
 * lock has no pid, so a classic process lock on byte 1 carries the
 * holder's name (F_GETLK reports its pid); it goes with the process, so a
 * conflict on byte 0 with nobody on byte 1 is a dead engine's I/O still in
 * flight (or its ring's teardown, which the kernel finishes asynchronously,
 * a few ms after a kill): waited for, up to LOCK_WAIT_MS.  d->fd is the
 * only descriptor of the file this process keeps open (a close of any
 * other would drop the process lock); a clean close unlocks explicitly
 * (close_file). */
#define LOCK_WAIT_MS 10000
static int lock_file(kvt_disk *d, char *err, size_t len)
{
	struct flock fl;

	for (int waited = 0;; waited += 10) {
		disk_lock_at(&fl, F_WRLCK, 0);
		if (fcntl(d->fd, F_OFD_SETLK, &fl) == 0)
			break;
		int e = errno;
		if (e != EAGAIN && e != EACCES)
			return kvt_disk_eset(err, len, -e, "disk %s: F_OFD_SETLK: %s", d->o.path, strerror(e));
		disk_lock_at(&fl, F_WRLCK, 1);
		if (fcntl(d->fd, F_GETLK, &fl) == 0 && fl.l_type != F_UNLCK && fl.l_pid > 0)
			return kvt_disk_eset(err, len, -EBUSY, "disk %s is in use by another disk engine "
				    "(pid %d; one engine per disk file)", d->o.path, (int)fl.l_pid);
		if (waited >= LOCK_WAIT_MS)
			return kvt_disk_eset(err, len, -EBUSY, "disk %s is in use: a disk engine that died "
				    "still has I/O in flight on it after %d s (a slow or hung "
				    "device), or another engine of this process holds it; start "
				    "again once the device has finished", d->o.path,
				    LOCK_WAIT_MS / 1000);
		struct timespec ts = { 0, 10000000 };
		nanosleep(&ts, NULL);
	}
	disk_lock_at(&fl, F_WRLCK, 1);
	(void)fcntl(d->fd, F_SETLK, &fl); /* the name only: best effort */
	return 0;
}

static int open_file(kvt_disk *d, char *err, size_t len)
{
	const struct kvt_disk_opts *o = &d->o;
	struct statfs sf;
	struct stat st;
	int fd, r;

	/* The file rules (disk_trust.c): no link, no FIFO, ours alone. */
	fd = kvt_disk_file_open("disk", o->path, 1, 1, NULL, &st, err, len);
	if (fd < 0)
		return fd;
	if (fstatfs(fd, &sf)) {
		int e = -errno;
		close(fd);
		return kvt_disk_eset(err, len, e, "disk %s: %s", o->path, strerror(-e));
	}
	d->fd = fd;
	if ((r = kvt_disk_key_path(o->path, &st, o->key_path, d->key_path, sizeof(d->key_path),
				   err, len)))
		return r;
	/* O_DIRECT: refused by the open (EINVAL) on file systems without it;
	 * on tmpfs and ramfs, which recent kernels let open it, there is no
	 * device behind the page cache: direct I/O there is a copy through
	 * the same memory, so it counts as refused too. */
	const char *why = NULL;
	/* A block device's node lives on devtmpfs, whose f_type is tmpfs's:
	 * the file system test is for regular files only. */
	if (S_ISREG(st.st_mode) && ((unsigned long)sf.f_type == TMPFS_MAGIC ||
				    (unsigned long)sf.f_type == RAMFS_MAGIC))
		why = "a memory file system (tmpfs) has no O_DIRECT";
	else if (d->shard_bytes % DIO_ALIGN)
		why = "a chunk shard is not a multiple of 4096 bytes, which O_DIRECT needs";
	if (!why && o->direct != KVT_DIRECT_OFF) {
		/* on the descriptor checked above: a second open of the path
		 * could meet another file */
		int fl = fcntl(fd, F_GETFL);
		if (fl < 0 || fcntl(fd, F_SETFL, fl | O_DIRECT))
			why = errno == EINVAL ? "the file system refuses O_DIRECT" : strerror(errno);
		else
			d->direct = 1;
	}
	if (!d->direct && o->direct == KVT_DIRECT_ON)
		return kvt_disk_eset(err, len, -EOPNOTSUPP, "disk %s: direct I/O was forced (direct=on) "
			    "but %s; use direct=auto or off, or a path on an NVMe file system",
			    o->path, why ? why : "it is off");
	if (!d->direct && o->direct == KVT_DIRECT_AUTO)
		dlog(d, 1, "%s: buffered I/O through the page cache: %s", o->path, why);
	return lock_file(d, err, len);
}

/* The MAC key (disk_trust.c): read, checked against the superblock's key
 * check, or made when the disk is formatted.  A disk whose key is missing
 * or another is refused unless reset, which formats it (*fresh). */
static int key_setup(kvt_disk *d, int *fresh, char *err, size_t len)
{
	const struct kvt_disk_opts *o = &d->o;
	uint8_t key[KVT_MAC_KEY_BYTES], tag[KVT_MAC_TAG_BYTES];
	int created, r;

	r = kvt_disk_key_load(d->key_path, 0, key, &created, err, len);
	if (r == -ENOKEY && !*fresh && !o->reset)
		return kvt_disk_eset(err, len, -ENOKEY, "disk %s was formatted with a MAC key in %s, which "
			    "is missing: its chunks cannot be verified; restore the key file, or "
			    "format the disk with reset (kvtierd --disk-reset; its chunks are "
			    "lost)", o->path, d->key_path);
	if (r == -ENOKEY) {
		r = kvt_disk_key_load(d->key_path, 1, key, &created, err, len);
		if (!r) {
			dlog(d, 0, "%s: a new MAC key in %s", o->path, d->key_path);
			*fresh = 1; /* chunks under an old key could not be verified */
		}
	}
	if (r)
		return r;
	d->mac = kvt_mac_new(key);
	kvt_mac_wipe(key, sizeof(key));
	if (!d->mac)
		return kvt_disk_eset(err, len, -ENOMEM, "disk: the MAC (libcrypto's ChaCha20-Poly1305) "
			    "could not be set up");
	if (*fresh)
		return 0;
	if (key_check_tag(d, &d->sb, tag))
		return kvt_disk_eset(err, len, -EIO, "disk %s: the key check could not be computed "
			    "(libcrypto)", o->path);
	if (kvt_mac_equal(tag, d->sb.key_tag))
		return 0;
	if (!o->reset)
		return kvt_disk_eset(err, len, -EKEYREJECTED, "disk %s was formatted with another MAC key "
			    "than the one in %s: its chunks cannot be verified; give the key it "
			    "was made with (disk-key), or format it with reset (kvtierd "
			    "--disk-reset; its chunks are lost)", o->path, d->key_path);
	dlog(d, 1, "%s was formatted with another MAC key: reset: formatting it", o->path);
	*fresh = 1;
	return 0;
}

/* Reads or formats the superblock and the record table. */
static int file_layout(kvt_disk *d, char *err, size_t len)
{
	const struct kvt_disk_opts *o = &d->o;
	struct stat st;
	uint64_t have;
	kvt_key fp;
	int fresh, r;

	kvt_seg_fingerprint(d->s, &fp);
	if (fstat(d->fd, &st) || file_size(d->fd, &st, &have))
		return kvt_disk_eset(err, len, -errno, "disk %s: %s", o->path, strerror(errno));
	int sbr = read_super(d->fd, &d->sb);
	fresh = sbr == SB_NONE;
	if (!fresh) {
		const struct dsuper *sb = &d->sb;
		char why[200] = "";
		if (sbr == SB_VERSION)
			snprintf(why, sizeof(why), "format version %u (this kvtier writes version "
				 "%u%s)", sb->version, DISK_VERSION, sb->version < 2 ?
				 ": version 1 chunks carry no MAC and cannot be verified" : "");
		else if (sbr == SB_DAMAGED)
			snprintf(why, sizeof(why), "a damaged superblock (its checksum is wrong)");
		else if (sb->fingerprint.lo != fp.lo || sb->fingerprint.hi != fp.hi ||
			 sb->n_shards != d->n_shards || sb->shard_bytes != d->shard_bytes ||
			 sb->payload != d->payload)
			snprintf(why, sizeof(why), "another model or KV layout (fingerprint "
				 "%016llx, the segment's %016llx; %u x %llu-byte shards, the "
				 "segment's %u x %llu)", (unsigned long long)sb->fingerprint.lo,
				 (unsigned long long)fp.lo, sb->n_shards,
				 (unsigned long long)sb->shard_bytes, d->n_shards,
				 (unsigned long long)d->shard_bytes);
		else if (o->bytes && sb->bytes != o->bytes)
			snprintf(why, sizeof(why), "a size of %llu bytes, %llu asked",
				 (unsigned long long)sb->bytes, (unsigned long long)o->bytes);
		else if (sb->bytes > have)
			snprintf(why, sizeof(why), "%llu bytes where its header says %llu: the "
				 "file was truncated (or the device shrank)",
				 (unsigned long long)have, (unsigned long long)sb->bytes);
		else if (sb->chunks != chunks_for(sb->bytes, d->extent_bytes) ||
			 sb->data_off != data_off_for(sb->chunks) || sb->meta_off != SB_BYTES)
			snprintf(why, sizeof(why), "a damaged header (size or offsets)");
		if (why[0]) {
			if (!o->reset)
				return kvt_disk_eset(err, len, -ESTALE, "disk %s holds %s: format it with "
					    "reset (kvtierd --disk-reset; its chunks are lost)",
					    o->path, why);
			dlog(d, 1, "%s holds %s: reset: formatting it", o->path, why);
			fresh = 1;
		}
	} else if (have && !o->reset) {
		/* Something that is not ours, and not empty: refuse to
		 * overwrite it unless told.  (An aligned buffer: the
		 * descriptor may be O_DIRECT.) */
		uint8_t *probe;
		if (posix_memalign((void **)&probe, DIO_ALIGN, DIO_ALIGN))
			return kvt_disk_eset(err, len, -ENOMEM, "disk: out of memory");
		ssize_t got = pread(d->fd, probe, DIO_ALIGN, 0);
		int zero = got > 0 || (got == 0 && have == 0);
		for (ssize_t i = 0; i < got && zero; i++)
			zero = !probe[i];
		free(probe);
		if (got < 0)
			return kvt_disk_eset(err, len, -errno, "disk %s: reading its first block: %s",
				    o->path, strerror(errno));
		if (!zero && S_ISBLK(st.st_mode))
			return kvt_disk_eset(err, len, -EINVAL, "disk %s is a block device with data that "
				    "is not a kvtier disk tier: format it with reset (kvtierd "
				    "--disk-reset)", o->path);
		if (!zero)
			return kvt_disk_eset(err, len, -EINVAL, "disk %s is not a kvtier disk file (%llu "
				    "bytes of something else): remove it, or format it with reset "
				    "(kvtierd --disk-reset)", o->path, (unsigned long long)have);
	}
	if ((r = key_setup(d, &fresh, err, len)))
		return r;
	if (fresh) {
		uint64_t bytes = o->bytes ? o->bytes : have;
		if (!bytes)
			return kvt_disk_eset(err, len, -EINVAL, "disk %s is empty: give its size", o->path);
		if (S_ISBLK(st.st_mode) && bytes > have)
			return kvt_disk_eset(err, len, -ENOSPC, "disk %s: the device has %llu bytes, %llu "
				    "asked", o->path, (unsigned long long)have,
				    (unsigned long long)bytes);
		uint64_t n = chunks_for(bytes, d->extent_bytes);
		if (n < 1)
			return kvt_disk_eset(err, len, -ENOSPC, "disk %s: %llu bytes are too small: they "
				    "hold no chunk of %llu bytes with the record table (at least "
				    "%llu bytes)", o->path, (unsigned long long)bytes,
				    (unsigned long long)d->extent_bytes,
				    (unsigned long long)(data_off_for(1) + d->extent_bytes));
		if (S_ISREG(st.st_mode)) {
			/* Formatting: whatever was there goes (a fresh file, or
			 * reset asked for). */
			if (ftruncate(d->fd, 0))
				return kvt_disk_eset(err, len, -errno, "disk %s: %s", o->path, strerror(errno));
			r = posix_fallocate(d->fd, 0, (off_t)bytes);
			if (r == EOPNOTSUPP || r == EINVAL)
				r = ftruncate(d->fd, (off_t)bytes) ? errno : 0;
			if (r) {
				if (ftruncate(d->fd, 0)) {
					/* best effort: leave no half-sized file */
				}
				return kvt_disk_eset(err, len, -r, "disk %s: allocating %llu bytes: %s%s",
					    o->path, (unsigned long long)bytes, strerror(r),
					    r == ENOSPC ? " (the file system is short of room)" : "");
			}
		}
		memset(&d->sb, 0, sizeof(d->sb));
		memcpy(d->sb.magic, DISK_MAGIC, 8);
		d->sb.version = DISK_VERSION;
		d->sb.sb_bytes = SB_BYTES;
		d->sb.bytes = bytes;
		d->sb.chunks = n;
		d->sb.extent_bytes = d->extent_bytes;
		d->sb.shard_bytes = d->shard_bytes;
		d->sb.payload = d->payload;
		d->sb.n_shards = d->n_shards;
		d->sb.meta_off = SB_BYTES;
		d->sb.data_off = data_off_for(n);
		d->sb.fingerprint = fp;
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		d->sb.created_ns = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
		if (kvt_mac_nonce(d->sb.key_nonce) || key_check_tag(d, &d->sb, d->sb.key_tag))
			return kvt_disk_eset(err, len, -EIO, "disk %s: the key check could not be computed "
				    "(libcrypto)", o->path);
		d->sb.csum = sb_csum(&d->sb);
	}
	d->n = d->sb.chunks;
	if (d->n > kvt_disk_capacity(d->s))
		return kvt_disk_eset(err, len, -ENOSPC, "disk %s holds %llu chunks, the segment's disk "
			    "index %u: recreate the segment for this disk", o->path,
			    (unsigned long long)d->n, kvt_disk_capacity(d->s));
	d->n_blocks = (d->n + REC_PER_BLK - 1) / REC_PER_BLK;
	if (posix_memalign((void **)&d->rec, DIO_ALIGN, d->n_blocks * META_BLOCK))
		return kvt_disk_eset(err, len, -ENOMEM, "disk: out of memory");
	memset(d->rec, 0, d->n_blocks * META_BLOCK);
	if (fresh) {
		/* Superblock and an empty record table, synchronously. */
		void *sbuf;
		if (posix_memalign(&sbuf, DIO_ALIGN, SB_BYTES))
			return kvt_disk_eset(err, len, -ENOMEM, "disk: out of memory");
		memset(sbuf, 0, SB_BYTES);
		memcpy(sbuf, &d->sb, sizeof(d->sb));
		ssize_t w = pwrite(d->fd, sbuf, SB_BYTES, 0);
		free(sbuf);
		for (uint64_t off = 0; w == SB_BYTES && off < d->n_blocks * META_BLOCK;) {
			uint64_t piece = d->n_blocks * META_BLOCK - off;
			if (piece > (1u << 20))
				piece = 1u << 20;
			if (pwrite(d->fd, (uint8_t *)d->rec + off, piece, SB_BYTES + off) !=
			    (ssize_t)piece)
				w = -1;
			off += piece;
		}
		if (w != SB_BYTES || fdatasync(d->fd))
			return kvt_disk_eset(err, len, -errno ? -errno : -EIO, "disk %s: formatting: %s",
				    o->path, strerror(errno ? errno : EIO));
		dlog(d, 0, "%s: formatted: %llu chunks of %llu bytes", o->path,
		     (unsigned long long)d->n, (unsigned long long)d->extent_bytes);
		return 0;
	}
	for (uint64_t off = 0; off < d->n_blocks * META_BLOCK;) {
		uint64_t piece = d->n_blocks * META_BLOCK - off;
		if (piece > (1u << 20))
			piece = 1u << 20;
		ssize_t got = pread(d->fd, (uint8_t *)d->rec + off, piece, SB_BYTES + off);
		if (got != (ssize_t)piece)
			return kvt_disk_eset(err, len, got < 0 ? -errno : -EIO, "disk %s: reading the "
				    "record table: %s", o->path, got < 0 ? strerror(errno) : "short");
		off += piece;
	}
	return 0;
}

/* Replays the record table into the index; the rest goes free. */
static void replay(kvt_disk *d)
{
	uint64_t bad = 0;

	for (uint64_t e = 0; e < d->n; e++) {
		struct drec *rc = &d->rec[e];
		if (rc->magic != REC_MAGIC || !(rc->flags & REC_VALID) || rc->rcsum != rec_csum(rc)) {
			if (rc->magic || rc->flags)
				bad++;
			memset(rc, 0, sizeof(*rc));
			continue;
		}
		kvt_key k = { rc->key_lo, rc->key_hi };
		uint32_t pos;
		if (rc->seq > d->seq)
			d->seq = rc->seq;
		d->ext[e].egen = rc->egen;
		int r = kvt_disk_put(d->s, &k, (uint32_t)e, rc->egen, &pos);
		if (r == -EEXIST) {
			/* Two records of one key: the newer one wins. */
			struct kvt_disk_ref old;
			if (kvt_disk_find(d->s, &k, &old) && d->rec[old.extent].seq < rc->seq) {
				uint32_t oe = old.extent;
				d->ext[oe].used = 0;
				d->used--;
				kvt_disk_del(d->s, old.pos);
				memset(&d->rec[oe], 0, sizeof(d->rec[oe]));
				mark_dirty(d, oe);
				r = kvt_disk_put(d->s, &k, (uint32_t)e, rc->egen, &pos);
			}
		}
		if (r) {
			memset(rc, 0, sizeof(*rc));
			mark_dirty(d, (uint32_t)e);
			continue;
		}
		d->ext[e].pos = pos;
		d->ext[e].used = 1;
		d->used++;
	}
	for (uint64_t e = 0; e < d->n; e++)
		if (!d->ext[e].used)
			free_push(d, (uint32_t)e);
	d->replayed = d->used;
	if (bad)
		dlog(d, 1, "%s: %llu damaged record(s) ignored", d->path, (unsigned long long)bad);
}

static int ring_setup(kvt_disk *d, char *err, size_t len)
{
	struct io_uring_params p;
	int r;

	memset(&p, 0, sizeof(p));
	r = io_uring_queue_init_params(d->o.depth, &d->ring, &p);
	if (r < 0)
		return kvt_disk_eset(err, len, r, "disk %s: io_uring refused: %s%s", d->o.path, strerror(-r),
			    r == -ENOSYS || r == -EPERM ? " (a seccomp profile or "
			    "kernel.io_uring_disabled forbids it, or the kernel is too old): the "
			    "disk tier needs io_uring" : "");
	d->ring_ok = 1;
	/* Registered files: the disk file (index 0, every I/O goes through
	 * it) and the segment handle's lock descriptor (index 1, never used
	 * for I/O).  The ring holds both until its last request finished, even
	 * after this process died: so the engine's entry -- hence its shard
	 * claims on the sub-slots being read into -- and its lock on the disk
	 * file live exactly as long as a read or a write can still land
	 * (kvt_seg_lock_fd).  Without it, a kill -9 with a read in flight let
	 * the reaper hand the claimed slot to another key before the read
	 * wrote it: served as the other key's bytes. */
	int files[2] = { d->fd, kvt_seg_lock_fd(d->s) };
	if (files[1] < 0)
		return kvt_disk_eset(err, len, -EBADF, "disk %s: the segment handle has no lock descriptor "
			    "(a handle inherited across fork?)", d->o.path);
	r = io_uring_register_files(&d->ring, files, 2);
	if (r < 0)
		return kvt_disk_eset(err, len, r, "disk %s: io_uring refused to register its files (%s): "
			    "the engine's claims could not outlive its reads", d->o.path,
			    strerror(-r));
	/* The arena as fixed buffers: per shard part, pieces of at most 1 GiB
	 * cut at sub-slot boundaries (a sub-slot never straddles two). */
	uint64_t per = PIECE_MAX / d->shard_bytes;
	if (per) {
		uint64_t part = (uint64_t)d->n_slots * d->shard_bytes;
		d->piece = per * d->shard_bytes;
		d->pieces_per_part = (uint32_t)((part + d->piece - 1) / d->piece);
		uint64_t nb = (uint64_t)d->pieces_per_part * d->n_shards;
		struct iovec *iov = nb <= 16384 ? calloc(nb, sizeof(*iov)) : NULL;
		if (iov) {
			for (uint32_t sh = 0; sh < d->n_shards; sh++) {
				uint8_t *base = kvt_slot_shard_ptr(d->s, 0, sh);
				for (uint32_t k = 0; k < d->pieces_per_part; k++) {
					uint64_t off = (uint64_t)k * d->piece;
					struct iovec *v = &iov[sh * d->pieces_per_part + k];
					v->iov_base = base + off;
					v->iov_len = part - off < d->piece ? part - off : d->piece;
				}
			}
			r = io_uring_register_buffers(&d->ring, iov, (unsigned)nb);
			free(iov);
			if (r == 0)
				d->fixed = 1;
			else
				dlog(d, 1, "%s: the arena could not be registered with io_uring "
				     "(%s): plain reads and writes instead of fixed buffers%s",
				     d->o.path, strerror(-r), r == -ENOMEM ? " (raise the memlock "
				     "limit)" : "");
		}
	}
	d->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (d->efd >= 0 && io_uring_register_eventfd(&d->ring, d->efd)) {
		close(d->efd);
		d->efd = -1;
	}
	return 0;
}

int kvt_disk_open(kvt_seg *s, const struct kvt_disk_opts *o, kvt_disk **out,
		  char *err, size_t len)
{
	kvt_disk *d;
	int r;

	if (!s || !o || !out || o->size < sizeof(*o) || !o->path || !*o->path)
		return kvt_disk_eset(err, len, -EINVAL, "disk: bad options (no path?)");
	if (!kvt_disk_capacity(s))
		return kvt_disk_eset(err, len, -ENODEV, "disk %s: the segment '%s' has no disk index (it "
			    "was made without a disk tier): recreate it with one", o->path,
			    kvt_seg_name(s));
	if (o->direct > KVT_DIRECT_OFF || o->admit > KVT_ADMIT_NONE || o->depth > 4096 ||
	    o->close_wait_ms > 3600000)
		return kvt_disk_eset(err, len, -EINVAL, "disk: bad option (direct %u, admit %u, depth %u)",
			    o->direct, o->admit, o->depth);
	if (strlen(o->path) >= sizeof(d->path))
		return kvt_disk_eset(err, len, -ENAMETOOLONG, "disk: path longer than %zu bytes",
			    sizeof(d->path) - 1);
	if (kvt_seg_owner(s) != getpid())
		return kvt_disk_eset(err, len, -EPERM, "disk: the engine runs in the segment's owner "
			    "(kvt_seg_own)");
	d = calloc(1, sizeof(*d));
	if (!d)
		return kvt_disk_eset(err, len, -ENOMEM, "disk: out of memory");
	d->s = s;
	d->o = *o;
	if (!d->o.depth)
		d->o.depth = 64;
	if (!d->o.scan)
		d->o.scan = 4096;
	d->fd = d->efd = -1;
	snprintf(d->path, sizeof(d->path), "%s", o->path);
	d->n_shards = kvt_seg_n_shards(s);
	d->shard_bytes = kvt_seg_shard_bytes(s);
	d->payload = kvt_seg_chunk_bytes(s);
	d->extent_bytes = d->shard_bytes * d->n_shards;
	d->n_slots = kvt_seg_geometry(s)->n_slots;
	if ((r = open_file(d, err, len)) || (r = file_layout(d, err, len)))
		goto fail;
	d->ext = calloc(d->n, sizeof(*d->ext));
	d->dirty = calloc(d->n_blocks, 1);
	d->blk_busy = calloc(d->n_blocks, 1);
	d->seen = calloc(d->n_slots, sizeof(*d->seen));
	d->rejected = calloc(d->n_slots, 1);
	d->ghost = calloc(GHOST_N, sizeof(*d->ghost));
	d->n_jobs = d->o.depth;
	d->jobs = calloc(d->n_jobs, sizeof(*d->jobs));
	if (!d->ext || !d->dirty || !d->blk_busy || !d->seen || !d->rejected || !d->ghost ||
	    !d->jobs) {
		r = kvt_disk_eset(err, len, -ENOMEM, "disk: out of memory");
		goto fail;
	}
	for (uint32_t j = 0; j < d->n_jobs; j++) {
		d->jobs[j].wr = calloc(d->n_shards, sizeof(struct kvt_wref));
		if (!d->jobs[j].wr) {
			r = kvt_disk_eset(err, len, -ENOMEM, "disk: out of memory");
			goto fail;
		}
	}
	if ((r = ring_setup(d, err, len)))
		goto fail;
	struct kvt_disk_status st;
	memset(&st, 0, sizeof(st));
	st.chunks = d->n;
	st.direct = (uint64_t)d->direct;
	snprintf(st.path, sizeof(st.path), "%s", d->path);
	r = kvt_disk_engine_start(s, &st);
	if (r) {
		kvt_disk_eset(err, len, r, "disk: %s", kvt_core_last_error());
		goto fail;
	}
	replay(d);
	d->cursor = kvt_seg_clock_hand(s);
	publish(d);
	dlog(d, 0, "%s: %llu chunks of %llu bytes (%.1f GiB), %llu replayed; %s I/O, %s, depth "
	     "%u, admission %s", d->path, (unsigned long long)d->n,
	     (unsigned long long)d->extent_bytes,
	     (double)(d->n * d->extent_bytes) / (double)(1ULL << 30),
	     (unsigned long long)d->replayed, d->direct ? "direct" : "buffered",
	     d->fixed ? "fixed buffers" : "plain buffers", d->o.depth,
	     kvt_disk_admit_name(d->o.admit));
	*out = d;
	return 0;
fail:
	kvt_disk_close(d);
	return r;
}

void kvt_disk_info(const kvt_disk *d, struct kvt_disk_info *o)
{
	memset(o, 0, sizeof(*o));
	if (!d)
		return;
	o->chunks = d->n;
	o->used = d->used;
	o->inflight = d->inflight;
	o->extent_bytes = d->extent_bytes;
	o->file_bytes = d->sb.bytes;
	o->direct = (uint32_t)d->direct;
	o->fixed_buffers = (uint32_t)d->fixed;
	o->admit = d->o.admit;
	o->depth = d->o.depth;
	o->replayed = d->replayed;
	o->data_off = d->sb.data_off;
	o->shard_bytes = d->shard_bytes;
}

void kvt_disk_close(kvt_disk *d)
{
	if (!d)
		return;
	if (d->ring_ok) {
		/* Finish what is in flight (their slots and claims), then the
		 * records; no new work is taken.  A read still in flight after
		 * the timeout keeps its claims: the kernel may still write into
		 * those sub-slots, so they must not be handed to a new life; the
		 * reaper drops them once this process is gone. */
		uint32_t admit = d->o.admit;
		d->o.admit = KVT_ADMIT_NONE;
		d->closing = 1;
		uint64_t t0 = kvt__now_ns();
		uint64_t wait_ns = (d->o.close_wait_ms ? d->o.close_wait_ms : 30000) * 1000000ULL;
		while ((d->inflight || (d->n_dirty && !d->failed)) && kvt__now_ns() - t0 < wait_ns) {
			reap(d);
			meta_flush(d);
			submit(d);
			if (d->inflight) {
				struct io_uring_cqe *c;
				struct __kernel_timespec ts = { 0, 10000000 };
				io_uring_wait_cqe_timeout(&d->ring, &c, &ts);
			}
		}
		d->o.admit = admit;
		if (d->fd >= 0)
			fdatasync(d->fd);
		if (kvt_seg_owner(d->s) == getpid())
			kvt_disk_engine_stop(d->s);
		if (d->inflight) {
			/* The ring, closed below, keeps the lock descriptor until
			 * these finished; the handle's detach must not release
			 * the entry under them either. */
			dlog(d, 1, "%s: %u I/O(s) still in flight after %.1f s (a hung device?): "
			     "their claims are left to the reaper, which takes them once the "
			     "device has finished them", d->path, (unsigned)d->inflight,
			     (double)wait_ns / 1e9);
			kvt_seg_leave_to_reaper(d->s);
		} else {
			/* Drained: let go of the registered files now rather than
			 * when the kernel's asynchronous teardown of the ring gets
			 * to them, and unlock the disk file explicitly (below), so
			 * that an engine opened right after this close finds the
			 * file free. */
			(void)io_uring_unregister_files(&d->ring);
		}
		io_uring_queue_exit(&d->ring);
		if (!d->inflight && d->fd >= 0) {
			struct flock fl;
			disk_lock_at(&fl, F_UNLCK, 0);
			(void)fcntl(d->fd, F_OFD_SETLK, &fl);
		}
	}
	if (d->jobs)
		for (uint32_t j = 0; j < d->n_jobs; j++)
			free(d->jobs[j].wr);
	free(d->jobs);
	free(d->ext);
	free(d->dirty);
	free(d->blk_busy);
	free(d->seen);
	free(d->rejected);
	free(d->ghost);
	free(d->rec);
	kvt_mac_free(d->mac);
	if (d->efd >= 0)
		close(d->efd);
	if (d->fd >= 0)
		close(d->fd);
	free(d);
}
