/* ranks.c - the rank table, liveness, and the reaper.
 *
 * Entry states (owner word [state 8][pid 32], CAS only; the pid is for
 * messages):
 *
 *   EMPTY --attach--> CLAIMING --fields written--> ATTACHED --detach--> EMPTY
 *                         |                            |
 *                         +---- holder found dead -----+--> REAPING --> EMPTY
 *
 * Liveness is what the kernel vouches for.  Entry e's token is an OFD
 * write lock (F_OFD_SETLK) on the first byte of entry e's line of the rank
 * table, in the segment file: whoever holds the entry -- its attached process, a process
 * attaching to it, or a reaper reaping it -- holds that lock, taken
 * without waiting.  The kernel drops it when the holder's last descriptor
 * of that open file goes, i.e. when the process dies, whatever its PID
 * namespace and whatever pid is reused later.  A prober asks with
 * F_OFD_GETLK on its own descriptor of the file: no /proc read, no new
 * descriptor (a reaper at its file-descriptor limit still sees the
 * truth), no pid comparison.  Its own locks an OFD never sees, so a
 * handle treats its own entry as alive and the entry it is reaping as
 * dead (kvt__entry_alive).  Layout 1 decided liveness by reading
 * /proc/PID/stat: any open failure (EMFILE, hidepid, a holder in another
 * PID namespace) reaped a live process, and pid reuse kept a dead
 * CLAIMING/REAPING entry alive for ever.
 *
 * fork: a child inherits the open file description, hence the lock.  The
 * atfork child handler (segment.c) closes every handle's descriptor in the
 * child and makes the handle inert there, so a dead parent's entries do
 * not stay alive through a child that never attached them.  The locked
 * description is never mapped (the mapping is a second open, map_path in
 * segment.c): a mapping keeps its file alive in every child that inherits
 * it, and with it any lock on that file (test_fork_child_keeps_no_lock).
 *
 * Attach takes entry e's lock first; holding it, it owns the entry, and
 * whatever the owner word says (ATTACHED, CLAIMING or REAPING of a dead
 * process) is left from the dead: it reaps that, then claims.  A lock held
 * by someone else means a live holder (-EBUSY), or a live reaper or a
 * detach in its last step (waited for, briefly).  A reaper takes a dead
 * entry's lock the same way, so one process reaps an entry at a time and a
 * reaper that dies mid-reap releases it to the next, who redoes every
 * step (each is idempotent): repair the pins named by the dead entry's
 * journal (first turned into a REPAIR that nobody waits on, see leases.c),
 * drop its shard claims (abandoning the FILLING slots no live writer is
 * left on), abandon the slots it was setting up, repair the slots it left
 * frozen, finish
 * evictions left half done, release the leases it built, was releasing,
 * or that wait for its load, and finish index inserts left pending.
 *
 * How the last holder left (the entry's `left` word, kvt_left): DETACHED,
 * written by the detach, or REAPED / REPAIRED, written by the reaper from
 * what it found to repair (kvt_seg_reap_report) -- each before the release
 * store of EMPTY (R10, R11), so a reader that acquires EMPTY reads it; 0
 * at attach.  A diagnostic for the owner's log (a process killed between
 * its last operation and its detach left nothing: that is not a failure);
 * no protocol step reads it.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvt_format.h"

uint32_t kvt__entry_index(const kvt_seg *s, uint32_t role, uint32_t instance,
			  uint32_t rank)
{
	uint32_t per = s->geo.world + 1;

	return role == KVT_ROLE_SCHEDULER ? instance * per + s->geo.world
					  : instance * per + rank;
}

int kvt__need_entry(const kvt_seg *s, const char *what)
{
	if (!s)
		return kvt__err(-EINVAL, "%s: NULL handle", what);
	if (s->entry != UINT32_MAX)
		return 0;
	if (s->forked)
		return kvt__err(-EPERM, "%s: this handle was inherited across fork(); "
				"attach again in this process", what);
	return kvt__err(-EPERM, "%s: an observer handle has no table entry", what);
}

static void lock_at(struct flock *fl, const kvt_seg *s, uint32_t e, short type)
{
	memset(fl, 0, sizeof(*fl));
	fl->l_type = type;
	fl->l_whence = SEEK_SET;
	fl->l_start = (off_t)(s->r[KVT_R_RANKS].off + (uint64_t)e * sizeof(struct kvt_ent));
	fl->l_len = 1;
}

/* Takes entry e's lock without waiting: 0, -EAGAIN (someone holds it), or
 * another -errno. */
static int ent_lock(kvt_seg *s, uint32_t e)
{
	struct flock fl;

	if (s->fd < 0)
		return kvt__err(-EBADF, "entry %u: this handle has no descriptor", e);
	lock_at(&fl, s, e, F_WRLCK);
	if (fcntl(s->fd, F_OFD_SETLK, &fl) == 0)
		return 0;
	if (errno == EAGAIN || errno == EACCES)
		return -EAGAIN;
	return kvt__err(-errno, "entry %u: F_OFD_SETLK: %s", e, strerror(errno));
}

static void ent_unlock(kvt_seg *s, uint32_t e)
{
	struct flock fl;

	lock_at(&fl, s, e, F_UNLCK);
	(void)fcntl(s->fd, F_OFD_SETLK, &fl);
}

int kvt__entry_held(const kvt_seg *s, uint32_t e)
{
	struct flock fl;

	if (s->fd < 0)
		return 1; /* cannot tell: never take anyone for dead */
	lock_at(&fl, s, e, F_WRLCK);
	if (fcntl(s->fd, F_OFD_GETLK, &fl) != 0)
		return 1; /* idem */
	return fl.l_type != F_UNLCK;
}

int kvt__entry_alive(const kvt_seg *s, uint32_t e)
{
	if (e >= s->d.n_entries)
		return 0;
	if (e == s->entry)
		return 1;
	if (e == s->reaping)
		return 0; /* we hold its lock because its holder is dead */
	return kvt__entry_held(s, e);
}

static void entry_reap_locked(kvt_seg *s, uint32_t e, uint32_t acting,
			      struct kvt_reaped *rep);

static void pause_briefly(unsigned tries)
{
	if (tries < 64) {
		sched_yield();
	} else {
		struct timespec ts = { 0, 200000 };
		nanosleep(&ts, NULL);
	}
}

int kvt__entry_claim(kvt_seg *s, uint32_t e, unsigned flags)
{
	int wait = !!(flags & KVT_CLAIM_WAIT);
	struct kvt_ent *ent = &s->ents[e];
	uint64_t deadline = 0;
	int r;

	for (unsigned tries = 0;; tries++) {
		r = ent_lock(s, e);
		if (r == 0)
			break;
		if (r != -EAGAIN)
			return r;
		uint64_t w = kat_load(&ent->owner, KVT_ACQ);
		uint32_t st = KVT_OWNER_ST(w);
		if (!wait || st == KVT_ENT_ATTACHED || st == KVT_ENT_CLAIMING)
			return kvt__err(-EBUSY, "entry %u is held by a live process (pid %d, "
					"as its own namespace numbers it)", e, KVT_OWNER_PID(w));
		/* EMPTY: a detach between its last store and its unlock;
		 * REAPING: a live reaper on it.  Both end soon. */
		uint64_t now = kvt__now_ns();
		if (!deadline)
			deadline = now + 5000000000ULL;
		if (now > deadline)
			return kvt__err(-EBUSY, "entry %u: a live process (pid %d) has been %s "
					"it for 5 s", e, KVT_OWNER_PID(w),
					st == KVT_ENT_REAPING ? "reaping" : "releasing");
		pause_briefly(tries);
	}
	/* We hold the lock: nobody else can act on the entry. */
	KVT_SP(CLAIM_LOCKED, s);
	uint64_t w = kat_load(&ent->owner, KVT_ACQ);
	if (KVT_OWNER_ST(w) > KVT_ENT_REAPING) {
		ent_unlock(s, e);
		return kvt__err(-EUCLEAN, "rank table: entry %u has state %u", e,
				KVT_OWNER_ST(w));
	}
	if (KVT_OWNER_ST(w) != KVT_ENT_EMPTY && (flags & KVT_CLAIM_EMPTY_ONLY)) {
		ent_unlock(s, e);
		return -EBUSY;
	}
	if (KVT_OWNER_ST(w) != KVT_ENT_EMPTY) {
		/* Left by a dead holder or a dead reaper: reap it as its
		 * next holder (we borrow its journal; the lock makes it ours). */
		struct kvt_reaped rep;

		kat_store(&ent->owner, KVT_OWNER(KVT_ENT_REAPING, s->pid), KVT_REL);
		entry_reap_locked(s, e, e, &rep);
	}
	kat_store(&ent->owner, KVT_OWNER(KVT_ENT_CLAIMING, s->pid), KVT_REL);
	kat_store(&ent->start, s->start, KVT_RLX);
	kat_store(&ent->role, s->role, KVT_RLX);
	kat_store(&ent->instance, s->instance, KVT_RLX);
	kat_store(&ent->rank, s->rank, KVT_RLX);
	kat_store(&ent->journal, 0, KVT_RLX);
	kat_store(&ent->left, KVT_LEFT_UNKNOWN, KVT_RLX);
	kat_store(&ent->heartbeat, kvt__now_ns(), KVT_RLX);
	kat_fadd(&ent->attach_gen, 1, KVT_RLX);
	/* R9: publishes the fields above to readers of the owner word (acq). */
	kat_store(&ent->owner, KVT_OWNER(KVT_ENT_ATTACHED, s->pid), KVT_REL);
	s->entry = e;
	s->my_counters = (uint64_t *)kvt__ctr(s, e);
	return 0;
}

void kvt__entry_release(kvt_seg *s)
{
	uint32_t e = s->entry;

	/* Claims this handle still holds are aborted: their data never
	 * completed.  Leases stay; they belong to the instance. */
	for (uint32_t x = 0; x < s->geo.n_slots; x++) {
		uint64_t w = kat_load(&kvt__slot(s, x)->state, KVT_RLX);
		if (KVT_ST(w) != KVT_S_FREE)
			kvt__slot_writer_gone(s, x, e);
	}
	kat_store(&s->ents[e].journal, 0, KVT_REL);
	KVT_SP(DETACH_ABORTED, s);
	kat_store(&s->ents[e].left, KVT_LEFT_DETACHED, KVT_RLX);
	/* R10: everything we did is visible before the entry can be reused;
	 * then the lock goes (a waiting attacher retries on EMPTY). */
	kat_store(&s->ents[e].owner, KVT_OWNER(KVT_ENT_EMPTY, 0), KVT_REL);
	ent_unlock(s, e);
	s->entry = UINT32_MAX;
	s->my_counters = (uint64_t *)kvt__ctr(s, s->d.n_entries);
}

/* The caller holds entry e's lock, the entry is REAPING.  `acting` is the
 * entry whose journal our own pins and unpins use: the caller's own, or e
 * itself for a process re-attaching to it. */
static void entry_reap_locked(kvt_seg *s, uint32_t e, uint32_t acting,
			      struct kvt_reaped *rep)
{
	struct kvt_ent *ent = &s->ents[e];
	uint64_t j = kat_load(&ent->journal, KVT_ACQ);
	uint32_t role = kat_load(&ent->role, KVT_RLX);
	uint32_t inst = kat_load(&ent->instance, KVT_RLX);
	uint32_t rank = kat_load(&ent->rank, KVT_RLX);
	uint32_t me = s->entry, was_reaping = s->reaping;

	*rep = (struct kvt_reaped){ .entry = e, .role = role, .instance = inst, .rank = rank };
	s->entry = acting;
	s->reaping = acting == e ? UINT32_MAX : e;
	KVT_SP(REAP_LOCKED, s);
	switch (KVT_J_OP(j)) {
	case KVT_J_PIN:
	case KVT_J_UNPIN:
	case KVT_J_REPAIR: {
		uint32_t x = KVT_J_SLOT(j);
		uint64_t g = KVT_J_GEN(j);
		/* Nobody waits on a REPAIR: a repairer that waits for this
		 * entry (alive to others while we hold its lock) would wait
		 * for ever on a dead op otherwise. */
		kat_store(&ent->journal, KVT_J(KVT_J_REPAIR, x, g), KVT_REL);
		kvt__pins_repair(s, x, g);
		rep->in_op = 1;
		break;
	}
	default:
		break;
	}
	kat_store(&ent->journal, 0, KVT_REL);

	for (uint32_t x = 0; x < s->geo.n_slots; x++) {
		struct kvt_slot *sl = kvt__slot(s, x);
		uint64_t w = kat_load(&sl->state, KVT_ACQ);
		switch (KVT_ST(w)) {
		case KVT_S_FILLING: {
			int had = kvt__slot_writer_gone(s, x, e);
			if (KVT_FILL_OWNER(w) == e + 1) { /* died setting it up */
				kvt__slot_abandon(s, x, KVT_GEN(w), e + 1);
				had = 1;
			}
			rep->slots += (uint32_t)had; /* a slot counts once */
			break;
		}
		case KVT_S_DOOMED:
		case KVT_S_EVICTING:
			rep->slots += (uint32_t)kvt__slot_writer_gone(s, x, e);
			kvt__slot_reclaim(s, x, KVT_GEN(w)); /* finish what is left */
			break;
		case KVT_S_READY: {
			/* It died in kvt_write_end between the READY CAS and its
			 * claim drop: only the claim is left to drop. */
			int had = kvt__slot_writer_gone(s, x, e);
			if ((w & KVT_ST_FROZEN) && KVT_FREEZER(w) == e + 1) {
				kvt__pins_repair(s, x, KVT_GEN(w) & 0xfffffffULL);
				had = 1;
			}
			rep->slots += (uint32_t)had;
			break;
		}
		default:
			break;
		}
	}
	KVT_SP(REAP_SLOTS, s);

	for (uint32_t i = 0; i < s->geo.n_leases; i++) {
		struct kvt_lease *l = kvt__lease(s, i);
		uint64_t w = kat_load(&l->state, KVT_ACQ);
		uint32_t st = KVT_LST(w);
		int release = 0;

		if (st == KVT_L_FREE)
			continue;
		if (KVT_LACT(w) == e + 1)
			release = 1; /* it built it (BUILDING, ACTIVE) or was releasing it */
		else if (st == KVT_L_ACTIVE && role == KVT_ROLE_RANK && rank < s->geo.world &&
			 kat_load(&l->instance, KVT_RLX) == inst &&
			 kat_load(&kvt__lease_loaded(s, l)[rank], KVT_ACQ) !=
				 KVT_LOADED(KVT_LGEN(w)))
			release = 1; /* it would wait for ever for this rank */
		/* Take the lease over as its releaser, in one CAS. */
		if (release &&
		    kat_cas(&l->state, &w, KVT_LW(KVT_L_RELEASING, KVT_LGEN(w), s->entry + 1),
			    KVT_AR)) {
			kvt__lease_finish_release(s, i);
			rep->leases++;
		}
	}
	/* An insert it committed but did not finalize. */
	kvt__index_help_all(s);
	KVT_SP(REAP_DONE, s);
	kvt__count(s, KVT_C_REAPED_RANKS, 1);
	s->entry = me;
	s->reaping = was_reaping;
	kat_store(&ent->left, rep->in_op || rep->slots || rep->leases ? KVT_LEFT_REPAIRED
								   : KVT_LEFT_REAPED, KVT_RLX);
	/* R11: the repairs are visible before the entry is reused. */
	kat_store(&ent->journal, 0, KVT_REL);
	kat_store(&ent->owner, KVT_OWNER(KVT_ENT_EMPTY, 0), KVT_REL);
}

int kvt_seg_live_ranks(const kvt_seg *s)
{
	uint32_t per, n = 0, end;

	if (!s)
		return kvt__err(-EINVAL, "live_ranks: NULL handle");
	per = s->geo.world + 1;
	end = s->geo.n_instances * per;
	if (end > s->d.n_entries)
		end = s->d.n_entries;
	for (uint32_t e = 0; e < end; e++) {
		/* acquire: pairs with the release that published the entry */
		uint64_t w = kat_load(&s->ents[e].owner, KVT_ACQ);
		if (e % per == s->geo.world || KVT_OWNER_ST(w) == KVT_ENT_EMPTY ||
		    KVT_OWNER_ST(w) > KVT_ENT_REAPING)
			continue;
		n += kvt__entry_alive(s, e) ? 1 : 0;
	}
	return (int)n;
}

int kvt_seg_reap(kvt_seg *s)
{
	return kvt_seg_reap_report(s, NULL, NULL);
}

int kvt_seg_reap_report(kvt_seg *s, void (*cb)(void *arg, const struct kvt_reaped *r),
			void *arg)
{
	int reaped = 0, r;

	if ((r = kvt__need_entry(s, "reap")))
		return r;
	kat_store(&s->ents[s->entry].heartbeat, kvt__now_ns(), KVT_RLX);
	for (uint32_t e = 0; e < s->d.n_entries; e++) {
		uint64_t w = kat_load(&s->ents[e].owner, KVT_ACQ);
		if (e == s->entry || KVT_OWNER_ST(w) == KVT_ENT_EMPTY)
			continue;
		if (KVT_OWNER_ST(w) > KVT_ENT_REAPING)
			continue; /* corrupt: kvt_check reports it */
		if (ent_lock(s, e))
			continue; /* its holder (or another reaper) lives */
		w = kat_load(&s->ents[e].owner, KVT_ACQ);
		if (KVT_OWNER_ST(w) != KVT_ENT_EMPTY && KVT_OWNER_ST(w) <= KVT_ENT_REAPING) {
			struct kvt_reaped rep;
			/* REAPING: the pid is a dead reaper's, not the holder's */
			int pid = KVT_OWNER_ST(w) == KVT_ENT_REAPING ? 0 : KVT_OWNER_PID(w);

			kat_store(&s->ents[e].owner, KVT_OWNER(KVT_ENT_REAPING, s->pid), KVT_REL);
			entry_reap_locked(s, e, s->entry, &rep);
			rep.pid = pid;
			if (cb)
				cb(arg, &rep);
			reaped++;
		}
		ent_unlock(s, e);
	}
	/* Pin counts a repair set pessimistically (a stopped process was
	 * between its stores): counted again, exactly once it has moved. */
	kvt__pins_recount(s);
	return reaped;
}
