/* owner.c - the segment's owner (kvtierd), the drain word, latency
 * histograms and the read-only views of the rank table that tools use.
 *
 * Invariants.
 *   O1  At most one process owns a segment: ownership is an OFD write lock
 *       on byte KVT_OWNER_LOCK_OFF of the segment file, taken without
 *       waiting (kvt_seg_own).  The kernel drops it when the owner's last
 *       descriptor of that open file goes, so a dead owner never blocks
 *       the next one, in any PID namespace.
 *   O2  hdr->owner names the owner (pid) for messages only; it is written
 *       after the lock is taken and may be stale.  Who owns is decided by
 *       the lock (F_OFD_GETLK), never by the word.
 *   O3  hdr->drain != 0 refuses new attaches while its owner lives.  The
 *       word is written only by the lock holder; a drain left set by a
 *       dead owner is ignored (O1 decides), and the next owner clears it.
 *   O4  A histogram word, like a counter, has exactly one writer: the
 *       handle whose table entry owns the block (relaxed load + store).
 *       Readers sum racily; a snapshot may be torn between words, never
 *       within one.
 *
 * Acquire/release pairs.
 *   OW1 kvt_seg_own stores hdr->owner (release) after taking the lock;
 *       kvt_seg_owner's diagnostic read (acquire) pairs with it.
 *   OW2 kvt_seg_drain stores hdr->drain (release); kvt__drain_check reads
 *       it (acquire) before it probes the lock.
 * No new step of the slot, lease or rank protocols is here, hence no
 * schedule point: a drain races an attach harmlessly (an attach that read
 * drain == 0 just before the owner set it is one more attach the drain
 * waits for, as it waits for every live lease).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <time.h>
#include <string.h>
#include <unistd.h>

#include "kvt_format.h"

static void owner_lock_at(struct flock *fl, short type)
{
	memset(fl, 0, sizeof(*fl));
	fl->l_type = type;
	fl->l_whence = SEEK_SET;
	fl->l_start = (off_t)KVT_OWNER_LOCK_OFF;
	fl->l_len = 1;
}

/* 1 when another open file description holds the owner lock. */
static int owner_lock_held(const kvt_seg *s)
{
	struct flock fl;

	if (s->fd < 0)
		return 0;
	owner_lock_at(&fl, F_WRLCK);
	if (fcntl(s->fd, F_OFD_GETLK, &fl) != 0)
		return 0;
	return fl.l_type != F_UNLCK;
}

static int owner_pid_word(const kvt_seg *s)
{
	/* acquire: OW1 */
	uint64_t w = kat_load(&s->hdr->owner, KVT_ACQ);
	return KVT_OWNER_ST(w) == 1 ? KVT_OWNER_PID(w) : 0;
}

int kvt_seg_own(kvt_seg *s)
{
	struct flock fl;

	if (!s)
		return kvt__err(-EINVAL, "own: NULL handle");
	if (s->owns)
		return 0;
	if (s->fd < 0)
		return kvt__err(-EPERM, "own: this handle has no descriptor (inherited "
				"across fork()?)");
	owner_lock_at(&fl, F_WRLCK);
	if (fcntl(s->fd, F_OFD_SETLK, &fl) != 0) {
		int e = errno;
		if (e == EAGAIN || e == EACCES) {
			int pid = owner_pid_word(s);
			if (pid > 0)
				return kvt__err(-EBUSY, "segment '%s' is owned by a live process, "
						"pid %d (as its PID namespace numbers it)",
						s->name, pid);
			return kvt__err(-EBUSY, "segment '%s' is owned by a live process that "
					"has not written its pid yet", s->name);
		}
		return kvt__err(-e, "own '%s': F_OFD_SETLK: %s", s->name, strerror(e));
	}
	s->owns = 1;
	/* A drain left by a dead owner is void (O3). */
	kat_store(&s->hdr->drain, 0, KVT_REL);
	/* release: OW1 */
	kat_store(&s->hdr->owner, KVT_OWNER(1, s->pid), KVT_REL);
	return 0;
}

int kvt_seg_own_wait(kvt_seg *s, int ms)
{
	struct timespec tick = { 0, 10000000 };
	int r;

	for (int waited = 0;; waited += 10) {
		r = kvt_seg_own(s);
		if (r != -EBUSY || waited >= ms)
			break;
		/* A hint, never a verdict: the lock says who lives.  An owner
		 * whose pid this namespace sees is a live process: no point in
		 * waiting.  One it cannot see is dead with writes still in
		 * flight (its ring holds the lock until they land), or lives in
		 * another PID namespace: waited for, up to ms. */
		int pid = owner_pid_word(s);
		if (pid > 0 && (kill(pid, 0) == 0 || errno == EPERM))
			break;
		nanosleep(&tick, NULL);
	}
	if (r == -EBUSY && ms > 0) {
		char first[256];
		snprintf(first, sizeof(first), "%s", kvt_core_last_error());
		kvt__err(r, "%s (waited up to %d ms: a dead owner's I/O still in flight keeps "
			 "it owned until the device finished it)", first, ms);
	}
	return r;
}

int kvt_seg_owner(const kvt_seg *s)
{
	if (!s || s->fd < 0)
		return 0;
	if (s->owns)
		return s->pid;
	if (!owner_lock_held(s))
		return 0;
	int pid = owner_pid_word(s);
	return pid > 0 ? pid : 1;
}

int kvt_seg_drain(kvt_seg *s, int on)
{
	if (!s || !s->owns || s->fd < 0)
		return kvt__err(-EPERM, "drain: only the segment's owner drains it");
	/* release: OW2 */
	kat_store(&s->hdr->drain, on ? 1 : 0, KVT_REL);
	return 0;
}

int kvt_seg_draining(const kvt_seg *s)
{
	if (!s)
		return 0;
	/* acquire: OW2 */
	if (!kat_load(&s->hdr->drain, KVT_ACQ))
		return 0;
	return s->owns || owner_lock_held(s);
}

const char *kvt_seg_name(const kvt_seg *s)
{
	return s ? s->name : "";
}

int kvt__drain_check(const kvt_seg *s)
{
	/* acquire: OW2 */
	if (!kat_load(&s->hdr->drain, KVT_ACQ) || !owner_lock_held(s))
		return 0;
	return kvt__err(-ESHUTDOWN, "attach '%s': the segment is draining: its owner "
			"(kvtierd, pid %d) is stopping; attach after it has restarted",
			s->name, owner_pid_word(s));
}

/* ---- histograms ---- */

static const char *const hist_names[KVT_H__COUNT] = {
	[KVT_H_LOOKUP] = "lookup", [KVT_H_SAVE] = "save", [KVT_H_LOAD] = "load",
	[KVT_H_DISK_READ] = "disk_read", [KVT_H_DISK_WRITE] = "disk_write",
};

const char *kvt_hist_name(enum kvt_hist h)
{
	return (unsigned)h < KVT_H__COUNT ? hist_names[h] : "unknown";
}

uint64_t kvt_hist_bound_ns(uint32_t i)
{
	return i + 1 < KVT_HIST_BUCKETS ? 1000ULL << i : UINT64_MAX;
}

static uint32_t hist_bucket(uint64_t ns)
{
	uint64_t us = ns / 1000 + (ns % 1000 != 0);
	uint32_t b;

	if (us <= 1)
		return 0;
	b = 64u - (uint32_t)__builtin_clzll(us - 1); /* ceil(log2(us)) */
	return b < KVT_HIST_BUCKETS - 1 ? b : KVT_HIST_BUCKETS - 1;
}

static _Atomic uint64_t *hist_words(const kvt_seg *s, uint32_t block, uint32_t h)
{
	return kvt__ctr(s, block) + KVT_C__COUNT + (uint64_t)h * KVT_HIST_WORDS;
}

static void bump(_Atomic uint64_t *p, uint64_t v)
{
	/* O4: one writer per block */
	kat_store(p, kat_load(p, KVT_RLX) + v, KVT_RLX);
}

void kvt_hist_add(kvt_seg *s, enum kvt_hist h, uint64_t ns)
{
	if (!s || (unsigned)h >= KVT_H__COUNT)
		return;
	uint32_t block = s->entry != UINT32_MAX ? s->entry : s->d.n_entries;
	_Atomic uint64_t *w = hist_words(s, block, h);
	bump(&w[hist_bucket(ns)], 1);
	bump(&w[KVT_HIST_BUCKETS], 1);
	bump(&w[KVT_HIST_BUCKETS + 1], ns);
}

int kvt_hist_read(const kvt_seg *s, uint32_t entry, enum kvt_hist h,
		  struct kvt_hist_snap *out)
{
	uint32_t lo = 0, hi;

	if (!s || !out || (unsigned)h >= KVT_H__COUNT)
		return kvt__err(-EINVAL, "hist_read: bad argument");
	hi = s->d.n_entries;
	if (entry != UINT32_MAX) {
		if (entry > s->d.n_entries)
			return kvt__err(-EINVAL, "hist_read: entry %u of %u", entry,
					s->d.n_entries);
		lo = hi = entry;
	}
	memset(out, 0, sizeof(*out));
	for (uint32_t b = lo; b <= hi; b++) {
		_Atomic uint64_t *w = hist_words(s, b, h);
		for (uint32_t i = 0; i < KVT_HIST_BUCKETS; i++)
			out->bucket[i] += kat_load(&w[i], KVT_RLX); /* statistics */
		out->count += kat_load(&w[KVT_HIST_BUCKETS], KVT_RLX);
		out->sum_ns += kat_load(&w[KVT_HIST_BUCKETS + 1], KVT_RLX);
	}
	return 0;
}

/* ---- the rank table, read-only ---- */

uint32_t kvt_seg_n_entries(const kvt_seg *s)
{
	return s ? s->d.n_entries : 0;
}

int kvt_seg_entry_info(const kvt_seg *s, uint32_t e, struct kvt_entry_info *o)
{
	uint32_t per, n_inst;

	if (!s || !o || e >= s->d.n_entries)
		return kvt__err(-EINVAL, "entry_info: entry %u out of range", e);
	memset(o, 0, sizeof(*o));
	per = s->geo.world + 1;
	n_inst = s->geo.n_instances;
	/* acquire: R9 in ranks.c publishes the fields with the owner word */
	uint64_t w = kat_load(&s->ents[e].owner, KVT_ACQ);
	uint32_t st = KVT_OWNER_ST(w);
	if (st > KVT_ENT_REAPING)
		return kvt__err(-EUCLEAN, "rank table: entry %u has state %u", e, st);
	if (e < n_inst * per) {
		o->instance = e / per;
		o->rank = e % per == s->geo.world ? UINT32_MAX : e % per;
		o->role = o->rank == UINT32_MAX ? KVT_ROLE_SCHEDULER : KVT_ROLE_RANK;
	} else {
		uint32_t role = kat_load(&s->ents[e].role, KVT_RLX);
		o->role = role <= KVT_ROLE_CLIENT ? role : KVT_ROLE_CLIENT;
		o->instance = UINT32_MAX;
		o->rank = UINT32_MAX;
	}
	o->attach_gen = kat_load(&s->ents[e].attach_gen, KVT_RLX);
	if (st == KVT_ENT_EMPTY) {
		uint32_t left = kat_load(&s->ents[e].left, KVT_RLX);
		o->state = KVT_ENTRY_EMPTY;
		o->left = left <= KVT_LEFT_REPAIRED ? left : KVT_LEFT_UNKNOWN;
		return 0;
	}
	o->pid = KVT_OWNER_PID(w);
	o->heartbeat_ns = kat_load(&s->ents[e].heartbeat, KVT_RLX);
	o->start = kat_load(&s->ents[e].start, KVT_RLX);
	if (!kvt__entry_alive(s, e))
		o->state = KVT_ENTRY_DEAD;
	else
		o->state = st == KVT_ENT_ATTACHED ? KVT_ENTRY_ATTACHED : KVT_ENTRY_BUSY;
	return 0;
}

int kvt_seg_entry_counters(const kvt_seg *s, uint32_t e, uint64_t out[KVT_C__COUNT])
{
	if (!s || !out || e > s->d.n_entries)
		return kvt__err(-EINVAL, "entry_counters: entry %u out of range", e);
	_Atomic uint64_t *blk = kvt__ctr(s, e);
	for (int c = 0; c < KVT_C__COUNT; c++)
		out[c] = kat_load(&blk[c], KVT_RLX); /* statistics */
	return 0;
}

void kvt_seg_heartbeat(kvt_seg *s)
{
	if (s && s->entry != UINT32_MAX && !s->forked)
		kat_store(&s->ents[s->entry].heartbeat, kvt__now_ns(), KVT_RLX);
}
