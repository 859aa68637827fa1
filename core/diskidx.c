/* diskidx.c - the disk tier's index and request rings in the segment.
 *
 * The disk tier (tier/disk/disk.c, driven by kvtierd) keeps chunks evicted from
 * the arena in extents of a file.  What every process must see of it
 * lives here: which keys the disk holds (the index) and which ones lookups
 * want back (the rings).  The file itself, its records and checksums and
 * the I/O belong to the engine alone.
 *
 * One writer.  The index has exactly one writer, the disk engine, which
 * must own the segment (kvt_seg_own: an OFD lock the kernel drops when it
 * dies).  So the index needs no CAS: an entry is a seqlock of four words,
 * and readers never wait for the writer -- an entry found odd, or changed
 * between the two reads of its seq, is a miss, which is always a safe
 * answer (the engine dies with an entry odd: every lookup misses it until
 * the next engine starts, which rebuilds the whole index).
 *
 * Entry (32 B): seq, key_lo, key_hi, val = [extent gen 32][extent + 1 32];
 * val 0 = empty.  A key lives in one of two 8-way buckets (key.lo and a
 * mix of key.hi), at load factor <= 1/2 (segment.c sizes the buckets).
 *
 * Invariants:
 *  D1  only the owner writes entries, the status page and ring heads.
 *  D2  a reader returns (key, extent, egen) only if it read the same even
 *      seq before and after the three words: then no write overlapped the
 *      read, and the three come from one put.
 *  D3  an entry names an extent only after the engine's write of that
 *      extent completed (the engine puts after the completion); the engine
 *      deletes it before it reuses the extent.  A reader holding a stale
 *      ref is caught by the engine, which checks (pos, seq) again when it
 *      takes the request, and (extent, egen) against its own table.
 *  D4  a ring has one producer (the holder of its table entry) and one
 *      consumer (the engine); a cell is written only while tail - head <
 *      KVT_DRING_CELLS, and read only below tail.
 *
 * Acquire/release pairs:
 *  DW1 put/del: seq = odd (relaxed), then the key and val words with
 *      release stores, then seq = even (release).
 *  DR1 find: seq (acquire), the three words (acquire), seq again: the
 *      acquire loads of the words keep the second seq read after them,
 *      and a word written after DW1's odd seq brings that seq with it.
 *      (Acquire loads rather than fences: ThreadSanitizer models them; see
 *      slots.c.)
 *  RQ1 request: cell (relaxed), tail (release) -- take: tail (acquire),
 *      cells.  RQ2 take: head (release) -- request: head (acquire), so a
 *      cell is reused only after the engine read it.
 *  ON1 engine start: entries emptied, ring heads set, then online = 1
 *      (release); kvt_disk_online reads it (acquire).
 *
 * No schedule point: nothing here is a multi-step protocol between
 * writers; a reader preempted anywhere only misses (D2).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kvt_format.h"

static int need_disk(const kvt_seg *s)
{
	return s->disk ? 0 : kvt__err(-ENODEV, "disk: this segment has no disk tier "
				      "(created with 0 disk chunks)");
}

static int need_engine(const kvt_seg *s, const char *what)
{
	int r = need_disk(s);

	if (r)
		return r;
	if (!s->owns)
		return kvt__err(-EPERM, "disk %s: only the segment's owner drives the disk tier",
				what);
	return 0;
}

uint32_t kvt_disk_capacity(const kvt_seg *s)
{
	return s && s->disk ? s->geo.disk_chunks : 0;
}

static uint64_t n_dents(const kvt_seg *s)
{
	return (uint64_t)s->d.disk_buckets * KVT_DISK_WAYS;
}

static void disk_buckets(const kvt_seg *s, const kvt_key *k, uint32_t *b1, uint32_t *b2)
{
	*b1 = (uint32_t)k->lo & s->disk_mask;
	*b2 = (uint32_t)kvt__mix64(k->hi ^ 0x6469736bULL) & s->disk_mask;
	if (*b2 == *b1)
		*b2 = (*b1 + 1) & s->disk_mask;
}

int kvt_disk_online(const kvt_seg *s)
{
	if (!s || !s->disk)
		return 0;
	/* ON1 */
	if (kat_load(&s->disk->online, KVT_ACQ) != 1)
		return 0;
	uint64_t hb = kat_load(&s->disk->heartbeat_ns, KVT_RLX), now = kvt__now_ns();
	/* A heartbeat ahead of our clock (another time namespace) counts as
	 * fresh: the request rings time nothing out, a waiting lookup does. */
	return hb > now || now - hb < KVT_DISK_ONLINE_NS;
}

/* DR1: a consistent read of entry i, 1 when it holds a key. */
static int dent_read(const kvt_seg *s, uint64_t i, uint64_t *seq, kvt_key *k, uint64_t *val)
{
	struct kvt_dent *e = &s->dents[i];
	uint64_t s1 = kat_load(&e->seq, KVT_ACQ);

	if (s1 & 1)
		return 0;
	uint64_t v = kat_load(&e->val, KVT_ACQ);
	uint64_t lo = kat_load(&e->key_lo, KVT_ACQ);
	uint64_t hi = kat_load(&e->key_hi, KVT_ACQ);
	if (kat_load(&e->seq, KVT_RLX) != s1 || !v)
		return 0;
	/* Bounds: an extent beyond the capacity is a damaged entry. */
	if (KVT_DVAL_EXT(v) >= s->geo.disk_chunks)
		return 0;
	*seq = s1;
	k->lo = lo;
	k->hi = hi;
	*val = v;
	return 1;
}

int kvt_disk_find(const kvt_seg *s, const kvt_key *key, struct kvt_disk_ref *ref)
{
	uint32_t b[2];

	if (!s || !s->disk || !key)
		return 0;
	disk_buckets(s, key, &b[0], &b[1]);
	for (int j = 0; j < 2; j++)
		for (uint32_t w = 0; w < KVT_DISK_WAYS; w++) {
			uint64_t i = (uint64_t)b[j] * KVT_DISK_WAYS + w, seq, val;
			kvt_key k;
			if (!dent_read(s, i, &seq, &k, &val) || k.lo != key->lo || k.hi != key->hi)
				continue;
			if (ref) {
				ref->pos = (uint32_t)i;
				ref->seq = (uint32_t)seq;
				ref->extent = KVT_DVAL_EXT(val);
				ref->egen = KVT_DVAL_GEN(val);
			}
			return 1;
		}
	return 0;
}

static struct kvt_dring *ring(const kvt_seg *s, uint32_t i)
{
	return (struct kvt_dring *)((uint8_t *)s->drings + (uint64_t)i * s->ring_stride);
}

int kvt_disk_request(kvt_seg *s, const struct kvt_disk_ref *ref)
{
	int r;

	if ((r = need_disk(s)))
		return r;
	if ((r = kvt__need_entry(s, "disk request")))
		return r;
	if (!ref || ref->pos >= n_dents(s))
		return kvt__err(-EINVAL, "disk request: bad reference");
	struct kvt_dring *q = ring(s, s->entry);
	uint64_t t = kat_load(&q->tail, KVT_RLX);
	/* RQ2 */
	uint64_t h = kat_load(&q->head, KVT_ACQ);
	if (t - h >= KVT_DRING_CELLS) {
		kvt__count(s, KVT_C_PROMOTE_DROPS, 1);
		return kvt__err(-EAGAIN, "disk request: the ring is full (%u requests the disk "
				"engine has not taken)", KVT_DRING_CELLS);
	}
	kat_store(&q->cell[t % KVT_DRING_CELLS], KVT_DREQ(ref->pos, ref->seq), KVT_RLX);
	/* RQ1 */
	kat_store(&q->tail, t + 1, KVT_REL);
	kvt__count(s, KVT_C_PROMOTE_REQUESTS, 1);
	return 0;
}

int kvt_disk_take_requests(kvt_seg *s, struct kvt_disk_ref *refs, kvt_key *keys,
			   uint32_t max)
{
	uint32_t n = 0;

	if (need_engine(s, "requests") || !refs || !keys)
		return 0;
	for (uint32_t i = 0; i < s->d.disk_rings && n < max; i++) {
		struct kvt_dring *q = ring(s, i);
		/* RQ1 */
		uint64_t t = kat_load(&q->tail, KVT_ACQ);
		uint64_t h = kat_load(&q->head, KVT_RLX);
		if (t - h > KVT_DRING_CELLS)
			h = t - KVT_DRING_CELLS; /* a damaged tail: at most one ring's worth */
		for (; h != t && n < max; h++) {
			uint64_t c = kat_load(&q->cell[h % KVT_DRING_CELLS], KVT_RLX);
			uint32_t pos = (uint32_t)c - 1u, seq = (uint32_t)(c >> 32);
			uint64_t eseq, val;
			kvt_key k;
			if (!c || pos >= n_dents(s) || !dent_read(s, pos, &eseq, &k, &val) ||
			    (uint32_t)eseq != seq) {
				kvt__count(s, KVT_C_PROMOTE_DROPS, 1); /* stale: changed since */
				continue;
			}
			refs[n].pos = pos;
			refs[n].seq = seq;
			refs[n].extent = KVT_DVAL_EXT(val);
			refs[n].egen = KVT_DVAL_GEN(val);
			keys[n] = k;
			n++;
		}
		/* RQ2 */
		kat_store(&q->head, h, KVT_REL);
	}
	return (int)n;
}

/* DW1 */
static void dent_write(kvt_seg *s, uint64_t i, uint64_t lo, uint64_t hi, uint64_t val)
{
	struct kvt_dent *e = &s->dents[i];
	uint64_t q = kat_load(&e->seq, KVT_RLX);

	if (q & 1)
		q++; /* left odd by a dead engine */
	kat_store(&e->seq, q + 1, KVT_RLX);
	kat_store(&e->key_lo, lo, KVT_REL);
	kat_store(&e->key_hi, hi, KVT_REL);
	kat_store(&e->val, val, KVT_REL);
	kat_store(&e->seq, q + 2, KVT_REL);
}

int kvt_disk_put(kvt_seg *s, const kvt_key *key, uint32_t extent, uint32_t egen,
		 uint32_t *pos)
{
	uint32_t b[2];
	uint64_t empty = UINT64_MAX;
	int r;

	if ((r = need_engine(s, "put")))
		return r;
	if (!key || extent >= s->geo.disk_chunks)
		return kvt__err(-EINVAL, "disk put: bad key or extent %u (%u)", extent,
				s->geo.disk_chunks);
	disk_buckets(s, key, &b[0], &b[1]);
	for (int j = 0; j < 2; j++)
		for (uint32_t w = 0; w < KVT_DISK_WAYS; w++) {
			uint64_t i = (uint64_t)b[j] * KVT_DISK_WAYS + w;
			struct kvt_dent *e = &s->dents[i];
			uint64_t v = kat_load(&e->val, KVT_RLX);
			if (!v) {
				if (empty == UINT64_MAX)
					empty = i;
				continue;
			}
			if (kat_load(&e->key_lo, KVT_RLX) == key->lo &&
			    kat_load(&e->key_hi, KVT_RLX) == key->hi) {
				if (pos)
					*pos = (uint32_t)i;
				return -EEXIST;
			}
		}
	if (empty == UINT64_MAX)
		return kvt__err(-ENOSPC, "disk put: both buckets of the key are full");
	dent_write(s, empty, key->lo, key->hi, KVT_DVAL(extent, egen));
	if (pos)
		*pos = (uint32_t)empty;
	return 0;
}

void kvt_disk_del(kvt_seg *s, uint32_t pos)
{
	if (need_engine(s, "del") || pos >= n_dents(s))
		return;
	if (kat_load(&s->dents[pos].val, KVT_RLX))
		dent_write(s, pos, 0, 0, 0);
}

int kvt_disk_status_read(const kvt_seg *s, struct kvt_disk_status *o)
{
	if (!s || !o)
		return kvt__err(-EINVAL, "disk status: NULL argument");
	memset(o, 0, sizeof(*o));
	if (!s->disk)
		return kvt__err(-ENODEV, "disk: this segment has no disk tier");
	const struct kvt_disk_shm *d = s->disk;
	o->online = (uint64_t)kvt_disk_online(s);
	o->pid = kat_load(&d->pid, KVT_RLX);
	o->heartbeat_ns = kat_load(&d->heartbeat_ns, KVT_RLX);
	o->chunks = kat_load(&d->chunks, KVT_RLX);
	o->used = kat_load(&d->used, KVT_RLX);
	o->inflight = kat_load(&d->inflight, KVT_RLX);
	o->direct = kat_load(&d->direct, KVT_RLX);
	o->epoch = kat_load(&d->epoch, KVT_RLX);
	o->io_errors = kat_load(&d->io_errors, KVT_RLX);
	o->failed = kat_load(&d->failed, KVT_RLX);
	/* The path is the engine's to write; copy and terminate (bounds). */
	memcpy(o->path, (const char *)d->path, sizeof(o->path));
	o->path[sizeof(o->path) - 1] = 0;
	return 0;
}

void kvt_disk_engine_publish(kvt_seg *s, const struct kvt_disk_status *st)
{
	if (need_engine(s, "publish") || !st)
		return;
	struct kvt_disk_shm *d = s->disk;
	kat_store(&d->chunks, st->chunks, KVT_RLX);
	kat_store(&d->used, st->used, KVT_RLX);
	kat_store(&d->inflight, st->inflight, KVT_RLX);
	kat_store(&d->direct, st->direct, KVT_RLX);
	kat_store(&d->io_errors, st->io_errors, KVT_RLX);
	kat_store(&d->failed, st->failed, KVT_RLX);
	kat_store(&d->heartbeat_ns, kvt__now_ns(), KVT_RLX);
}

static void index_empty(kvt_seg *s)
{
	for (uint64_t i = 0; i < n_dents(s); i++)
		if (kat_load(&s->dents[i].val, KVT_RLX) || (kat_load(&s->dents[i].seq, KVT_RLX) & 1))
			dent_write(s, i, 0, 0, 0);
}

int kvt_disk_engine_start(kvt_seg *s, const struct kvt_disk_status *st)
{
	int r;

	if ((r = need_engine(s, "start")))
		return r;
	struct kvt_disk_shm *d = s->disk;
	kat_store(&d->online, 0, KVT_REL);
	index_empty(s);
	for (uint32_t i = 0; i < s->d.disk_rings; i++) {
		struct kvt_dring *q = ring(s, i);
		kat_store(&q->head, kat_load(&q->tail, KVT_ACQ), KVT_REL);
	}
	memset((char *)d->path, 0, sizeof(d->path));
	if (st)
		snprintf((char *)d->path, sizeof(d->path), "%s", st->path);
	kat_store(&d->pid, (uint64_t)getpid(), KVT_RLX);
	kat_fadd(&d->epoch, 1, KVT_RLX);
	kvt_disk_engine_publish(s, st);
	/* ON1 */
	kat_store(&d->online, 1, KVT_REL);
	return 0;
}

void kvt_disk_engine_stop(kvt_seg *s)
{
	if (need_engine(s, "stop"))
		return;
	kat_store(&s->disk->online, 0, KVT_REL);
	index_empty(s);
	kat_store(&s->disk->used, 0, KVT_RLX);
	kat_store(&s->disk->inflight, 0, KVT_RLX);
}

/* ---- arena views for the engine and waiting lookups ---- */

int kvt_seg_peek(kvt_seg *s, const kvt_key *keys, uint32_t n)
{
	uint32_t i;

	if (!s || (n && !keys))
		return kvt__err(-EINVAL, "peek: NULL argument");
	for (i = 0; i < n; i++) {
		uint64_t gen, st;
		uint32_t x;
		if (!kvt__index_find(s, &keys[i], &gen, &x, 1, &st))
			break;
	}
	return (int)i;
}

int kvt_slot_ready(const kvt_seg *s, uint32_t x, kvt_key *key, uint32_t *depth,
		   uint32_t *ref, uint64_t *wo)
{
	if (!s || x >= s->geo.n_slots)
		return 0;
	struct kvt_slot *sl = kvt__slot(s, x);
	/* Acquire: the READY CAS (R6) published the payload and the fields. */
	uint64_t w = kat_load(&sl->state, KVT_ACQ);
	if (KVT_ST(w) != KVT_S_READY)
		return 0;
	/* A12-like: acquire on the key words keeps the re-read after them. */
	key->lo = kat_load(&sl->key_lo, KVT_ACQ);
	key->hi = kat_load(&sl->key_hi, KVT_ACQ);
	if (depth)
		*depth = kat_load(&sl->depth, KVT_RLX);
	if (ref)
		*ref = kat_load(&sl->ref, KVT_RLX);
	uint64_t w2 = kat_load(&sl->state, KVT_ACQ);
	if (KVT_ST(w2) != KVT_S_READY || KVT_GEN(w2) != KVT_GEN(w))
		return 0;
	*wo = w;
	return 1;
}

int kvt_slot_same_life(const kvt_seg *s, uint32_t x, uint64_t w)
{
	if (!s || x >= s->geo.n_slots)
		return 0;
	/* Acquire: ordered after the reads of the payload (the checksum and
	 * the write's completion, which the caller observed before).  READY
	 * in the same life throughout: a life leaves READY only through
	 * EVICTING, and a new life has another gen (slots.c S2/S3). */
	uint64_t w2 = kat_load(&kvt__slot(s, x)->state, KVT_ACQ);
	return KVT_ST(w2) == KVT_S_READY && KVT_GEN(w2) == KVT_GEN(w);
}

uint64_t kvt_seg_clock_hand(const kvt_seg *s)
{
	return s ? kat_load(&s->hdr->clock_hand, KVT_RLX) : 0;
}
