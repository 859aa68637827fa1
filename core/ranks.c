/* ranks.c - the rank table, liveness, and the reaper.
 *
 * Entry states (owner word [state 8][pid 32], CAS only):
 *
 *   EMPTY --attach--> CLAIMING --fields written--> ATTACHED --detach--> EMPTY
 *                         |                            |
 *                         +---- process found dead ----+--> REAPING --> EMPTY
 *
 * Liveness of an ATTACHED entry is (pid, process start time): a pid that was
 * reused by another process has another start time, so it reads as dead.
 * A second live attach of the same (instance, rank) is refused (-EBUSY);
 * an attach that finds the previous holder dead reaps it first.
 *
 * The reaper moves a dead entry to REAPING|own pid with a CAS, so one
 * process reaps it at a time; if the reaper dies too, the next one finds
 * REAPING with a dead pid and takes it over.  Every reap step is
 * idempotent: repair the pins named by the dead entry's journal, release
 * its shard claims (dooming those slots) and the slots it was setting up,
 * finish evictions left half done, release the leases it built, was
 * releasing, or that wait for its load, and finish index inserts left
 * pending.
 */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "kvt_format.h"

uint32_t kvt__entry_index(const kvt_seg *s, uint32_t role, uint32_t instance,
			  uint32_t rank)
{
	uint32_t per = s->geo.world + 1;

	return role == KVT_ROLE_SCHEDULER ? instance * per + s->geo.world
					  : instance * per + rank;
}

static int pid_exists(int pid)
{
	return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM);
}

int kvt__entry_alive(const kvt_seg *s, uint32_t e)
{
	uint64_t w = kat_load(&s->ents[e].owner, KVT_ACQ);
	int pid = KVT_OWNER_PID(w);

	switch (KVT_OWNER_ST(w)) {
	case KVT_ENT_ATTACHED: {
		uint64_t st = kat_load(&s->ents[e].start, KVT_RLX);
		return pid == s->pid ? st == s->start : kvt_proc_start_time(pid) == st;
	}
	case KVT_ENT_CLAIMING:
	case KVT_ENT_REAPING:
		return pid == s->pid || pid_exists(pid);
	default:
		return 0;
	}
}

static void entry_reap_locked(kvt_seg *s, uint32_t e);

int kvt__entry_claim(kvt_seg *s, uint32_t e)
{
	struct kvt_ent *ent = &s->ents[e];

	for (unsigned tries = 0; tries < 100000; tries++) {
		uint64_t w = kat_load(&ent->owner, KVT_ACQ);

		switch (KVT_OWNER_ST(w)) {
		case KVT_ENT_EMPTY:
			if (!kat_cas(&ent->owner, &w, KVT_OWNER(KVT_ENT_CLAIMING, s->pid), KVT_AR))
				continue;
			kat_store(&ent->start, s->start, KVT_RLX);
			kat_store(&ent->role, s->role, KVT_RLX);
			kat_store(&ent->instance, s->instance, KVT_RLX);
			kat_store(&ent->rank, s->rank, KVT_RLX);
			kat_store(&ent->journal, 0, KVT_RLX);
			kat_store(&ent->heartbeat, kvt__now_ns(), KVT_RLX);
			kat_fadd(&ent->attach_gen, 1, KVT_RLX);
			/* R9: publishes the fields above to liveness checks (acq). */
			kat_store(&ent->owner, KVT_OWNER(KVT_ENT_ATTACHED, s->pid), KVT_REL);
			s->entry = e;
			s->my_counters = (uint64_t *)kvt__ctr(s, e);
			return 0;
		case KVT_ENT_ATTACHED:
		case KVT_ENT_CLAIMING:
			if (kvt__entry_alive(s, e))
				return -EBUSY;
			__attribute__((fallthrough)); /* the holder is dead */
		case KVT_ENT_REAPING:
			if (KVT_OWNER_ST(w) == KVT_ENT_REAPING && kvt__entry_alive(s, e)) {
				sched_yield(); /* a live reaper is on it */
				continue;
			}
			if (kat_cas(&ent->owner, &w, KVT_OWNER(KVT_ENT_REAPING, s->pid), KVT_AR))
				entry_reap_locked(s, e);
			continue;
		default:
			return kvt__err(-EUCLEAN, "rank table: entry %u has state %u", e,
					KVT_OWNER_ST(w));
		}
	}
	return -EAGAIN;
}

void kvt__entry_release(kvt_seg *s)
{
	uint32_t e = s->entry;

	/* Claims this handle still holds are aborted: their data never
	 * completed.  Leases stay; they belong to the instance. */
	for (uint32_t x = 0; x < s->geo.n_slots; x++) {
		uint64_t w = kat_load(&kvt__slot(s, x)->state, KVT_RLX);
		if (KVT_ST(w) == KVT_S_FILLING || KVT_ST(w) == KVT_S_DOOMED)
			kvt__slot_writer_gone(s, x, e);
	}
	kat_store(&s->ents[e].journal, 0, KVT_REL);
	/* R10: everything we did is visible before the entry can be reused. */
	kat_store(&s->ents[e].owner, KVT_OWNER(KVT_ENT_EMPTY, 0), KVT_REL);
	s->entry = UINT32_MAX;
}

/* The caller holds entry e in REAPING.  We act with our own entry (for our
 * journal), so the reaper must be attached with one. */
static void entry_reap_locked(kvt_seg *s, uint32_t e)
{
	struct kvt_ent *ent = &s->ents[e];
	uint64_t j = kat_load(&ent->journal, KVT_ACQ);
	uint32_t role = kat_load(&ent->role, KVT_RLX);
	uint32_t inst = kat_load(&ent->instance, KVT_RLX);
	uint32_t rank = kat_load(&ent->rank, KVT_RLX);
	uint32_t me = s->entry;

	if (me == UINT32_MAX || me == e) {
		/* A handle re-claiming its own dead entry has no other entry
		 * for its journal: borrow the dead one (nobody else uses it). */
		s->entry = e;
	}
	switch (KVT_J_OP(j)) {
	case KVT_J_PIN:
	case KVT_J_UNPIN:
	case KVT_J_FREEZE:
		kvt__pins_repair(s, KVT_J_SLOT(j), KVT_J_GEN(j));
		break;
	default:
		break;
	}
	kat_store(&ent->journal, 0, KVT_REL);

	for (uint32_t x = 0; x < s->geo.n_slots; x++) {
		uint64_t w = kat_load(&kvt__slot(s, x)->state, KVT_ACQ);
		switch (KVT_ST(w)) {
		case KVT_S_FILLING:
		case KVT_S_DOOMED:
			kvt__slot_writer_gone(s, x, e);
			if (KVT_ST(w) == KVT_S_FILLING && KVT_FILL_OWNER(w) == e + 1)
				kvt__slot_doom(s, x, KVT_GEN(w)); /* died setting it up */
			else if (KVT_ST(w) == KVT_S_DOOMED)
				kvt__slot_reclaim(s, x);
			break;
		case KVT_S_EVICTING:
			kvt__slot_reclaim(s, x);
			break;
		case KVT_S_READY:
			/* It died in kvt_write_end between the READY CAS and
			 * its shard release: the chunk is complete, only the
			 * claim (writer field, writing bit) is left to drop. */
			if (kat_load(&kvt__slot(s, x)->writing, KVT_ACQ))
				kvt__slot_writer_gone(s, x, e);
			break;
		default:
			break;
		}
	}

	for (uint32_t i = 0; i < s->geo.n_leases; i++) {
		struct kvt_lease *l = kvt__lease(s, i);
		uint64_t w = kat_load(&l->state, KVT_ACQ);
		uint32_t st = KVT_LST(w);
		int release = 0;

		if (st == KVT_L_FREE)
			continue;
		if (KVT_LACT(w) == e + 1)
			release = 1; /* it built it (BUILDING, ACTIVE) or was releasing it */
		else if (st == KVT_L_ACTIVE && role == KVT_ROLE_RANK &&
			 kat_load(&l->instance, KVT_RLX) == inst &&
			 rank < 64 && !(kat_load(&l->loaded, KVT_ACQ) & (1ULL << rank)))
			release = 1; /* it would wait forever for this rank */
		/* Take the lease over as its releaser, in one CAS. */
		if (release &&
		    kat_cas(&l->state, &w, KVT_LW(KVT_L_RELEASING, KVT_LGEN(w), s->entry + 1),
			    KVT_AR))
			kvt__lease_finish_release(s, i);
	}
	/* An insert it committed but did not finalize. */
	kvt__index_help_all(s);
	kvt__count(s, KVT_C_REAPED_RANKS, 1);
	s->entry = me;
	/* R11: the repairs are visible before the entry is reused. */
	kat_store(&ent->owner, KVT_OWNER(KVT_ENT_EMPTY, 0), KVT_REL);
}

int kvt_seg_reap(kvt_seg *s)
{
	int reaped = 0;

	if (s->entry == UINT32_MAX)
		return kvt__err(-EPERM, "reap: an observer handle cannot reap");
	kat_store(&s->ents[s->entry].heartbeat, kvt__now_ns(), KVT_RLX);
	for (uint32_t e = 0; e < s->d.n_entries; e++) {
		uint64_t w = kat_load(&s->ents[e].owner, KVT_ACQ);
		if (e == s->entry || KVT_OWNER_ST(w) == KVT_ENT_EMPTY)
			continue;
		if (KVT_OWNER_ST(w) > KVT_ENT_REAPING)
			continue; /* corrupt: kvt_check reports it */
		if (kvt__entry_alive(s, e))
			continue;
		if (kat_cas(&s->ents[e].owner, &w, KVT_OWNER(KVT_ENT_REAPING, s->pid), KVT_AR)) {
			entry_reap_locked(s, e);
			reaped++;
		}
	}
	return reaped;
}
