/* leases.c - lookups, pins, leases, the step sweep, and pin repair.
 *
 * Lease states (state word [gen 48][actor 12][state 4], CAS only; the actor
 * is the builder in BUILDING and ACTIVE, the releaser in RELEASING):
 *
 *   FREE --lookup--> BUILDING --pins recorded--> ACTIVE --release--> RELEASING
 *    ^                                                                   |
 *    +--------------------- every ref unpinned, gen + 1 ------------------+
 *
 * A lease id carries a tag of the segment (from the random segment id in
 * the header), the lease index and the low bits of its generation, so an
 * id of another segment is refused (-EINVAL) and a stale id (released,
 * maybe reused) is recognised: releasing it again is counted as a double
 * unpin and changes nothing.  A lease is released exactly once, by
 * whoever wins the CAS ACTIVE -> RELEASING: the last rank to load, an
 * explicit release, the step sweep (absent from the load set for two
 * consecutive steps), or the reaper (its builder died, or a rank it waits
 * for died).
 *
 * Words that others change after reading the state (L1).  A lease can be
 * released and reused between a process's read of its state and its next
 * store, so nothing may be written on a lease by a plain check-then-write:
 *   - a rank's "loaded" mark is its own word loaded[rank] = LOADED(gen),
 *     tagged with the life it loaded; a mark of another life is not this
 *     life's, and a loader that finds the lease moved on after its mark
 *     puts the word back (Layout 1 had one mask, and a stale bit could
 *     complete a reused lease's mask: released before its last rank had
 *     loaded);
 *   - the miss count is [gen low 32 | count], changed only by a CAS that
 *     requires the tag of the life the stepper read (a stale stepper's
 *     count could break the two-step rule of a reused lease);
 *   - every release is a CAS on the full state word.
 *
 * Pins and crashes.  A pin (slot CAS) and its record in the lease (a ref
 * word) are two stores; a process can die between them.  To make that
 * repairable exactly, each process journals the one pin/unpin it is doing
 * in its rank-table entry:
 *
 *   pin:   journal PIN(x,g); n_refs = i+1; CAS pins+1; ref[i] = (x,g); journal 0
 *   unpin: journal UNPIN(x,g); CAS pins-1; ref[i] = 0; journal 0
 *
 * Pin repair (kvt__pins_repair) fixes slot x's count after a death: it
 * FREEZES x (a flag in the state word that makes new pins fail and new
 * unpins wait; the freezer's entry is written in the pins field of the
 * frozen word), waits until no live process is between the two stores on
 * x (journal on x, not BLOCKED, its entry lock held), counts the refs to
 * (x, g) in every lease, and sets pins to that count as it unfreezes.
 * Every pin is then matched by exactly one ref again; a dead process's
 * lease is released afterwards through its refs.
 *
 * Who waits for whom (P1: no cycle, no wait on the dead):
 *   - a repairer waits for live processes between their two stores, which
 *     wait for nothing: a pinner that meets a frozen slot fails its pin, an
 *     unpinner marks its journal BLOCKED before it waits;
 *   - an unpinner that meets a frozen slot waits only for a live freezer;
 *     a dead freezer's repair it adopts and finishes itself (the repair is
 *     idempotent), so kvt_release, kvt_step, load completion and a
 *     reaper's own lease releases never spin on a dead process;
 *   - a reaper first turns the dead entry's PIN/UNPIN journal into REPAIR,
 *     which nobody waits on (it holds that entry's lock, so the entry looks
 *     alive to others until it is reaped); it then repairs, and only its
 *     own live operations journal PIN/UNPIN.
 * Stopped processes (P2: every wait on a live process is bounded).  "No
 * wait on the dead" is not "no wait on the stopped": a live process
 * stopped between its two stores (SIGSTOP, a debugger, the cgroup
 * freezer) made a repairer wait in repair_body, and a freezer stopped
 * mid-repair made every unpin of the slot wait, for as long as the stop
 * (layout 5).  Now each such wait lasts at most KVT_LIVE_WAIT_NS:
 *   - a repairer past its deadline counts the process it waits for
 *     pessimistically: a PIN journal of this life as a pin that happened
 *     (its CAS may have landed before the freeze, its ref not yet
 *     written), an UNPIN's ref as a pin still held.  The count is then
 *     never below the truth (a pin too few would let the slot be evicted
 *     under a reader: -DOPTIMISTIC in pins.pml finds that), at worst one
 *     too many per process given up on: a slot that cannot be evicted for
 *     a while.  The slot is flagged (recount = its life) and every
 *     kvt_seg_reap repairs flagged slots again, exactly once the process
 *     has moved on (kvt__pins_recount); kvt_check accepts extra pins only
 *     on a flagged slot.  The dead entry's reap goes on: its journaled
 *     step is REPAIR, which the count never includes, so releasing its
 *     leases through their refs stays exact;
 *   - a waiter past its deadline (an unpinner, a would-be repairer) takes
 *     a live freezer's word over by CAS, as it adopts a dead one's, and
 *     repairs itself.  Every write of a freezer is a CAS from its own
 *     frozen word, so a freezer that resumes finds its repair void.
 * Schedule points REPAIR_GAVE_UP and REPAIR_TAKEOVER; pins.pml -DSTOPS
 * checks it (and -DNO_BOUND, layout 5's waits, deadlocks); kvtierd also
 * reports a stopped rank (kvtier_rank_stopped).
 *
 * Liveness is the entry lock (ranks.c): an entry reaped by a live process
 * (a re-attaching rank that borrows the dead entry's journal) is alive,
 * so a concurrent repair waits for its unpins instead of counting a ref
 * whose unpin already happened (Layout 1 skipped such entries: a
 * permanent extra pin).
 *
 * Orderings: the BUILDING -> ACTIVE CAS is a release (R7) that publishes
 * the refs to ranks, which read the state with acquire (A7) before reading
 * refs; kvt_lease_slots reads n_refs and the refs with acquire (A13),
 * paired with the builder's release stores of them (R13), before it
 * re-reads the state: a reader that saw a newer life's refs sees that
 * life's state word and rejects them (the seqlock rule; see slots.c on
 * why acquire/release rather than fences).  The same re-read (A7', after
 * A13) decides what a zero or out-of-range ref or count means: a release
 * cleared it under the reader (-ESTALE), or, in the life the reader saw,
 * corruption (-EUCLEAN).  Before, a ref cleared by a concurrent release
 * (a reaper's, for a dead rank's pending load) was reported corrupt:
 * test_slots_vs_release (core_sp.c, schedule point SLOTS_COUNTED).
 * Journal stores are releases read with acquire by the repairer (A8); for
 * a pin or unpin whose CAS came before the freeze, the freeze CAS reads
 * (through the slot word's modification order) a value that its CAS
 * released, so the repairer sees its journal (or the later 0, and then
 * its ref store).  Loaded marks and the full check are seq_cst (a Dekker
 * pair between the last two ranks: at least one sees the mask full).
 */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "kvt_format.h"

static int lease_decode(const kvt_seg *s, uint64_t id, uint32_t *idx, uint64_t *gen_lo)
{
	uint64_t i = id & ((1ULL << s->lid_idx_bits) - 1);

	if ((id >> (64 - KVT_LID_TAG_BITS)) != s->lid_tag)
		return kvt__err(-EINVAL, "lease id %#llx is not a lease of segment '%s'%s",
				(unsigned long long)id, s->name,
				id ? " (another segment's, or not a lease id)" : "");
	if (i == 0 || i > s->geo.n_leases)
		return kvt__err(-EINVAL, "lease id %#llx: lease %llu out of range (%u leases)",
				(unsigned long long)id, (unsigned long long)i, s->geo.n_leases);
	*idx = (uint32_t)i - 1;
	*gen_lo = (id >> s->lid_idx_bits) & s->lid_gen_mask;
	return 0;
}

static int lease_live(const kvt_seg *s, uint64_t w, uint64_t gen_lo)
{
	return KVT_LST(w) == KVT_L_ACTIVE && (KVT_LGEN(w) & s->lid_gen_mask) == gen_lo;
}

static int lease_alloc(kvt_seg *s, uint32_t *idx, uint64_t *gen)
{
	uint32_t n = s->geo.n_leases;
	/* Relaxed: the hint spreads processes over the table; CAS decides. */
	uint32_t start = (uint32_t)kat_fadd(&s->hdr->lease_hint, 1, KVT_RLX);

	for (uint32_t k = 0; k < n; k++) {
		uint32_t i = (start + k) % n;
		struct kvt_lease *l = kvt__lease(s, i);
		uint64_t w = kat_load(&l->state, KVT_RLX);

		if (KVT_LST(w) != KVT_L_FREE)
			continue;
		/* A6: acquire pairs with the release that freed it (R8). */
		if (!kat_cas(&l->state, &w, KVT_LW(KVT_L_BUILDING, KVT_LGEN(w), s->entry + 1),
			     KVT_AR))
			continue;
		KVT_SP(LEASE_BUILDING, s);
		kat_store(&l->instance, s->instance, KVT_RLX);
		kat_store(&l->n_refs, 0, KVT_RLX);
		kat_store(&l->misses, KVT_MISSES(KVT_LGEN(w), 0), KVT_RLX);
		kat_store(&l->last_step, kat_load(&s->hdr->step[s->instance].epoch, KVT_RLX),
			  KVT_RLX);
		*idx = i;
		*gen = KVT_LGEN(w);
		return 0;
	}
	return -ENOSPC;
}

/* Pins a READY slot of generation gen; journaled by the caller. */
static int slot_pin(struct kvt_slot *sl, uint64_t gen)
{
	uint64_t w = kat_load(&sl->state, KVT_RLX);

	for (;;) {
		if (KVT_ST(w) != KVT_S_READY || KVT_GEN(w) != gen ||
		    (w & KVT_ST_FROZEN) || KVT_PINS(w) >= KVT_PINS_MAX)
			return -EAGAIN;
		/* Acquire: the payload (published by R6) stays visible to the
		 * loads that follow; release: our journal store is before it
		 * (a repairer's freeze that reads this value sees the journal). */
		if (kat_cas(&sl->state, &w, w + KVT_PIN_ONE, KVT_AR))
			return 0;
	}
}

/* 1 when a pinned slot was allocated by a rank of another instance than
 * the caller's.  Statistic only (KVT_C_SHARED_HITS): the slot's owner is a
 * diagnostic word, and its entry may have been taken over since; both read
 * relaxed and bounds-checked. */
static uint32_t hit_is_shared(const kvt_seg *s, struct kvt_slot *sl)
{
	uint32_t o = kat_load(&sl->owner, KVT_RLX);
	struct kvt_ent *e;

	if (!o || o > s->d.n_entries)
		return 0;
	e = &s->ents[o - 1];
	return kat_load(&e->role, KVT_RLX) == KVT_ROLE_RANK &&
	       kat_load(&e->instance, KVT_RLX) != s->instance;
}

int kvt_seg_lookup(kvt_seg *s, const kvt_key *keys, uint32_t n, uint64_t *lease)
{
	struct kvt_lease *l = NULL;
	kvt_a64 *refs = NULL;
	uint32_t idx = 0, hits = 0, shared = 0, x;
	uint64_t lgen = 0, gen;
	int r;

	if (!lease || (n && !keys))
		return kvt__err(-EINVAL, "lookup: NULL argument");
	*lease = 0;
	if ((r = kvt__need_entry(s, "lookup")))
		return r;
	kvt__count(s, KVT_C_LOOKUPS, 1);
	kvt__count(s, KVT_C_LOOKUP_CHUNKS, n);
	/* The buckets of a prompt's keys are independent cache misses: start
	 * them all before walking the prefix (they are one dependent miss
	 * each otherwise). */
	for (uint32_t i = 0; i < n && i < 64; i++)
		kvt__index_prefetch(s, &keys[i]);
	for (uint32_t i = 0; i < n; i++) {
		if (!kvt__index_find(s, &keys[i], &gen, &x, 0, NULL))
			break;
		if (!l) {
			if (lease_alloc(s, &idx, &lgen)) {
				kvt__count(s, KVT_C_LEASES_FULL, 1);
				return kvt__err(-ENOSPC, "lookup: all %u leases are in use",
						s->geo.n_leases);
			}
			l = kvt__lease(s, idx);
			refs = kvt__lease_refs(s, l);
		}
		if (hits == s->geo.lease_max_chunks)
			break;
		struct kvt_slot *sl = kvt__slot(s, x);
		kat_store(&l->n_refs, hits + 1, KVT_REL); /* R13 */
		kat_store(kvt__journal(s), KVT_J(KVT_J_PIN, x, gen), KVT_REL);
		KVT_SP(PIN_JOURNALED, s);
		if (slot_pin(sl, gen)) {
			kat_store(kvt__journal(s), 0, KVT_REL);
			kat_store(&l->n_refs, hits, KVT_RLX);
			break;
		}
		KVT_SP(PIN_DONE, s);
		kat_store(&refs[hits], KVT_REF(x, gen), KVT_REL); /* R13 */
		kat_store(kvt__journal(s), 0, KVT_REL);
		/* A hit protects the chunk for one more sweep (relaxed: heuristic). */
		kat_store(&sl->ref, 2, KVT_RLX);
		shared += hit_is_shared(s, sl);
		hits++;
	}
	if (l) {
		uint64_t w = KVT_LW(KVT_L_BUILDING, lgen, s->entry + 1);
		if (hits) {
			/* R7: publishes refs and n_refs (A7).  The builder stays the
			 * actor: its death releases the lease (reaper). */
			kat_cas(&l->state, &w, KVT_LW(KVT_L_ACTIVE, lgen, s->entry + 1), KVT_AR);
			*lease = kvt__lease_id(s, idx, lgen);
		} else {
			/* R8 */
			kat_cas(&l->state, &w, KVT_LW(KVT_L_FREE, lgen + 1, 0), KVT_AR);
		}
	}
	kvt__count(s, KVT_C_HIT_CHUNKS, hits);
	kvt__count(s, KVT_C_HIT_TOKENS, (uint64_t)hits * s->geo.chunk_tokens);
	if (shared)
		kvt__count(s, KVT_C_SHARED_HITS, shared);
	return (int)hits;
}

int kvt_lease_slots(kvt_seg *s, uint64_t lease, uint32_t *slots, uint64_t *gens,
		    uint32_t max)
{
	uint32_t idx = 0, n;
	uint64_t gen_lo = 0, w;
	struct kvt_lease *l;
	kvt_a64 *refs;
	int r = lease_decode(s, lease, &idx, &gen_lo);

	if (r)
		return r;
	if (max && !slots && !gens)
		max = 0;
	l = kvt__lease(s, idx);
	refs = kvt__lease_refs(s, l);
	w = kat_load(&l->state, KVT_ACQ); /* A7 */
	if (!lease_live(s, w, gen_lo))
		return kvt__err(-ESTALE, "lease %#llx is not live", (unsigned long long)lease);
	n = kat_load(&l->n_refs, KVT_ACQ); /* A13 */
	KVT_SP(SLOTS_COUNTED, s);
	/* A release (the owner's, a reaper's for a dead rank, the stale
	 * sweep) clears the refs and the count while we read them: a lease
	 * gone, not a corrupt one.  Only what is bad in a lease still in the
	 * life we read is corrupt (A7' below re-reads the state). */
	if (n > s->geo.lease_max_chunks) {
		if (kat_load(&l->state, KVT_ACQ) != w) /* A7' */
			return kvt__err(-ESTALE, "lease %#llx was released meanwhile",
					(unsigned long long)lease);
		return kvt__err(-EUCLEAN, "lease %#llx: n_refs %u out of range",
				(unsigned long long)lease, n);
	}
	for (uint32_t i = 0; i < n && i < max; i++) {
		uint64_t ref = kat_load(&refs[i], KVT_ACQ); /* A13 */
		uint32_t x = KVT_REF_SLOT(ref);
		if (!ref || x >= s->geo.n_slots) {
			if (kat_load(&l->state, KVT_ACQ) != w) /* A7' */
				return kvt__err(-ESTALE, "lease %#llx was released meanwhile",
						(unsigned long long)lease);
			return kvt__err(-EUCLEAN, "lease %#llx: ref %u is corrupt",
					(unsigned long long)lease, i);
		}
		if (slots)
			slots[i] = x;
		if (gens)
			gens[i] = KVT_REF_GEN(ref);
	}
	/* The refs we copied belong to this lease only if it is still live
	 * (after A13, this load sees the life of any ref we read). */
	if (kat_load(&l->state, KVT_RLX) != w)
		return kvt__err(-ESTALE, "lease %#llx was released meanwhile",
				(unsigned long long)lease);
	return (int)(n < max ? n : max);
}

void kvt__lease_finish_release(kvt_seg *s, uint32_t idx)
{
	struct kvt_lease *l = kvt__lease(s, idx);
	kvt_a64 *refs = kvt__lease_refs(s, l);
	uint64_t w = kat_load(&l->state, KVT_ACQ);
	uint32_t n = kat_load(&l->n_refs, KVT_RLX);

	if (KVT_LST(w) != KVT_L_RELEASING)
		return;
	if (n > s->geo.lease_max_chunks)
		n = s->geo.lease_max_chunks; /* corrupt count: release what exists */
	for (uint32_t i = 0; i < n; i++) {
		uint64_t ref = kat_load(&refs[i], KVT_ACQ);
		uint32_t x = KVT_REF_SLOT(ref);
		if (!ref)
			continue;
		if (x < s->geo.n_slots) {
			kat_store(kvt__journal(s), KVT_J(KVT_J_UNPIN, x, KVT_REF_GEN(ref)), KVT_REL);
			KVT_SP(UNPIN_JOURNALED, s);
			if (kvt__slot_unpin(s, x, KVT_REF_GEN(ref)) == 0)
				KVT_SP(UNPIN_DONE, s);
		}
		kat_store(&refs[i], 0, KVT_REL);
		kat_store(kvt__journal(s), 0, KVT_REL);
	}
	kat_store(&l->n_refs, 0, KVT_RLX);
	/* R8: pairs with A6; everything above is done before reuse. */
	kat_cas(&l->state, &w, KVT_LW(KVT_L_FREE, KVT_LGEN(w) + 1, 0), KVT_AR);
}

/* ACTIVE (or BUILDING, for the reaper) -> RELEASING, then finish. */
static int lease_release_idx(kvt_seg *s, uint32_t idx, uint64_t expect)
{
	struct kvt_lease *l = kvt__lease(s, idx);
	uint64_t w = expect;

	if (!kat_cas(&l->state, &w, KVT_LW(KVT_L_RELEASING, KVT_LGEN(expect), s->entry + 1),
		     KVT_AR))
		return -EALREADY;
	KVT_SP(RELEASE_CLAIMED, s);
	kvt__lease_finish_release(s, idx);
	return 0;
}

int kvt_lease_release(kvt_seg *s, uint64_t lease)
{
	uint32_t idx = 0;
	uint64_t gen_lo = 0, w;
	int r;

	if ((r = kvt__need_entry(s, "release")))
		return r;
	if ((r = lease_decode(s, lease, &idx, &gen_lo)))
		return r;
	w = kat_load(&kvt__lease(s, idx)->state, KVT_ACQ);
	if (lease_live(s, w, gen_lo) && lease_release_idx(s, idx, w) == 0)
		return 0;
	kvt__count(s, KVT_C_DOUBLE_UNPINS, 1);
	return kvt__err(-EALREADY, "lease %#llx was already released",
			(unsigned long long)lease);
}

int kvt_lease_loaded(kvt_seg *s, uint64_t lease, uint32_t rank)
{
	uint32_t idx = 0;
	uint64_t gen_lo = 0, w, mark, prev;
	struct kvt_lease *l;
	kvt_a64 *ld;
	int r;

	if ((r = kvt__need_entry(s, "loaded")))
		return r;
	if (rank >= s->geo.world)
		return kvt__err(-EINVAL, "loaded: rank %u out of range for world=%u",
				rank, s->geo.world);
	if ((r = lease_decode(s, lease, &idx, &gen_lo)))
		return r;
	l = kvt__lease(s, idx);
	ld = kvt__lease_loaded(s, l);
	w = kat_load(&l->state, KVT_ACQ);
	if (!lease_live(s, w, gen_lo))
		return kvt__err(-ESTALE, "lease %#llx is not live", (unsigned long long)lease);
	/* The lease was live after the caller's loads ended: they read pinned
	 * chunks.  What follows only records it (L1). */
	KVT_SP(LOADED_CHECKED, s);
	mark = KVT_LOADED(KVT_LGEN(w));
	/* Seq_cst (release included): every rank's loads are done before
	 * whoever sees the full set releases the pins (R4 then carries it to
	 * the evictor). */
	prev = kat_xchg(&ld[rank], mark, KVT_SC);
	KVT_SP(LOADED_MARKED, s);
	if (KVT_LGEN(kat_load(&l->state, KVT_SC)) != KVT_LGEN(w)) {
		/* Released and reused since our check: the mark is not the new
		 * life's; put the word back unless its own rank wrote it. */
		uint64_t m = mark;
		if (prev != mark)
			kat_cas(&ld[rank], &m, prev, KVT_RLX);
		return 0;
	}
	if (prev == mark)
		return 0; /* this rank had loaded already */
	kvt__count(s, KVT_C_LOADED_CHUNKS, kat_load(&l->n_refs, KVT_RLX));
	for (uint32_t q = 0; q < s->geo.world; q++)
		if (kat_load(&ld[q], KVT_SC) != mark)
			return 0;
	return lease_release_idx(s, idx, w) == 0 ? 1 : 0;
}

static int u64_cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

int kvt_seg_step(kvt_seg *s, const uint64_t *live, uint32_t n)
{
	uint64_t *set = NULL;
	int released = 0, r;

	if ((r = kvt__need_entry(s, "step")))
		return r;
	if (n && !live)
		return kvt__err(-EINVAL, "step: live is NULL but n = %u", n);
	if (n) {
		set = malloc(n * sizeof(*set));
		if (!set)
			return kvt__err(-ENOMEM, "step: out of memory");
		memcpy(set, live, n * sizeof(*set));
		qsort(set, n, sizeof(*set), u64_cmp);
	}
	/* Relaxed: the epoch only stamps leases for the stat view. */
	uint64_t epoch = kat_fadd(&s->hdr->step[s->instance].epoch, 1, KVT_RLX) + 1;
	for (uint32_t i = 0; i < s->geo.n_leases; i++) {
		struct kvt_lease *l = kvt__lease(s, i);
		uint64_t w = kat_load(&l->state, KVT_ACQ);
		if (KVT_LST(w) != KVT_L_ACTIVE ||
		    kat_load(&l->instance, KVT_RLX) != s->instance)
			continue;
		uint64_t id = kvt__lease_id(s, i, KVT_LGEN(w));
		uint64_t tag = KVT_LGEN(w) & 0xffffffffULL, m = kat_load(&l->misses, KVT_RLX);
		if (set && bsearch(&id, set, n, sizeof(*set), u64_cmp)) {
			/* Relaxed: the word carries its life's tag; a CAS that
			 * finds another tag changes nothing (L1). */
			if (KVT_MISSES_GEN(m) == tag && KVT_MISSES_N(m))
				kat_cas(&l->misses, &m, KVT_MISSES(tag, 0), KVT_RLX);
			kat_store(&l->last_step, epoch, KVT_RLX);
			continue;
		}
		KVT_SP(STEP_CHECKED, s);
		uint32_t missed = 0;
		for (;;) {
			if (KVT_MISSES_GEN(m) != tag)
				break; /* released and reused since we read it */
			missed = KVT_MISSES_N(m) + 1;
			if (kat_cas(&l->misses, &m, KVT_MISSES(tag, missed), KVT_RLX))
				break;
			missed = 0;
		}
		if (missed >= 2 && lease_release_idx(s, i, w) == 0) {
			kvt__count(s, KVT_C_STALE_UNPINS, 1);
			released++;
		}
	}
	free(set);
	return released;
}

/* ---- pin repair ---- */

static uint64_t frozen_word(const kvt_seg *s, uint64_t gen)
{
	return KVT_SW(KVT_S_READY, gen, s->entry + 1) | KVT_ST_FROZEN;
}

/* Waits for the live processes between their two stores on slot x,
 * counts the refs and unfreezes with that count.  `mine` is the frozen
 * word we own.
 *
 * The wait is bounded (KVT_LIVE_WAIT_NS for the whole repair): a process
 * still between its stores then is stopped (SIGSTOP, the cgroup freezer)
 * or very slow, and its step is counted pessimistically -- a PIN journal
 * of this life as a pin that happened (its CAS may have landed, its ref
 * not yet written), an UNPIN's ref as still pinned (it is counted).
 * Either way the count is at least the true one: a pin too many is a
 * slot that cannot be evicted until the next recount (never a wrong
 * byte), a pin too few would be an eviction under a reader.  The slot is
 * then flagged (recount) and kvt_seg_reap repairs it again.  Returns 1
 * when it gave up on someone, 0 for an exact count. */
static int repair_body(kvt_seg *s, uint32_t x, uint64_t mine)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t count = 0, w = mine, ref = KVT_REF(x, KVT_GEN(mine));
	uint64_t g28 = KVT_GEN(mine) & 0xfffffffULL, deadline = kvt__now_ns() + KVT_LIVE_WAIT_NS;
	int gave_up = 0;

	KVT_SP(REPAIR_FROZEN, s);
	/* A8: acquire loads of the journals, see the essay. */
	for (uint32_t e = 0; e < s->d.n_entries; e++) {
		if (e == s->entry || e == s->reaping)
			continue;
		for (unsigned spins = 0;; spins++) {
			uint64_t j = kat_load(&s->ents[e].journal, KVT_SC);
			uint32_t op = KVT_J_OP(j);
			if ((op != KVT_J_PIN && op != KVT_J_UNPIN) || KVT_J_SLOT(j) != x ||
			    (j & KVT_J_BLOCKED))
				break;
			if ((spins & 1023) == 0 && !kvt__entry_alive(s, e))
				break; /* dead: its outcome is what the count says */
			if ((spins & 1023) == 1023 && kvt__now_ns() > deadline) {
				KVT_SP(REPAIR_GAVE_UP, s);
				gave_up = 1;
				if (op == KVT_J_PIN && KVT_J_GEN(j) == g28)
					count++;
				break;
			}
			sched_yield();
		}
	}
	for (uint32_t i = 0; i < s->geo.n_leases; i++) {
		struct kvt_lease *l = kvt__lease(s, i);
		uint64_t lw = kat_load(&l->state, KVT_ACQ);
		if (KVT_LST(lw) == KVT_L_FREE)
			continue;
		kvt_a64 *refs = kvt__lease_refs(s, l);
		uint32_t n = kat_load(&l->n_refs, KVT_ACQ);
		if (n > s->geo.lease_max_chunks)
			n = s->geo.lease_max_chunks;
		for (uint32_t k = 0; k < n; k++)
			if (kat_load(&refs[k], KVT_ACQ) == ref)
				count++;
	}
	if (count > KVT_PINS_MAX)
		count = KVT_PINS_MAX;
	KVT_SP(REPAIR_COUNTED, s);
	/* The flag before the count it describes (the CAS below is SC). */
	uint64_t flag = kat_load(&sl->recount, KVT_RLX);
	if (gave_up)
		kat_store(&sl->recount, g28 + 1, KVT_RLX);
	/* Only we change a word frozen by us (pins fail, unpins wait, a
	 * waiter past its deadline takes the word over by CAS, after which
	 * this CAS fails and our count is void). */
	if (kat_cas(&sl->state, &w, KVT_SW(KVT_S_READY, KVT_GEN(mine), count), KVT_SC)) {
		kvt__count(s, KVT_C_PIN_REPAIRS, 1);
		/* exact now: clear a flag of this life, unless a repair that
		 * gave up set it again meanwhile */
		if (!gave_up && flag == g28 + 1)
			kat_cas(&sl->recount, &flag, 0, KVT_RLX);
	}
	return gave_up;
}

void kvt__pins_recount(kvt_seg *s)
{
	for (uint32_t x = 0; x < s->geo.n_slots; x++) {
		struct kvt_slot *sl = kvt__slot(s, x);
		uint64_t f = kat_load(&sl->recount, KVT_RLX);
		if (!f)
			continue;
		uint64_t w = kat_load(&sl->state, KVT_ACQ);
		if (KVT_ST(w) != KVT_S_READY || (KVT_GEN(w) & 0xfffffffULL) + 1 != f) {
			kat_cas(&sl->recount, &f, 0, KVT_RLX); /* another life now */
			continue;
		}
		kvt__pins_repair(s, x, f - 1);
	}
}

void kvt__pins_adopt(kvt_seg *s, uint32_t x, uint64_t w)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t mine = frozen_word(s, KVT_GEN(w));

	if (!(w & KVT_ST_FROZEN) || KVT_ST(w) != KVT_S_READY)
		return;
	if (w != mine && !kat_cas(&sl->state, &w, mine, KVT_SC))
		return; /* it moved on: the caller looks again */
	kvt__count(s, KVT_C_ADOPTED, 1);
	(void)repair_body(s, x, mine);
}

void kvt__pins_repair(kvt_seg *s, uint32_t x, uint64_t gen28)
{
	struct kvt_slot *sl;
	uint64_t w;

	if (x >= s->geo.n_slots || s->entry == UINT32_MAX)
		return;
	sl = kvt__slot(s, x);
	w = kat_load(&sl->state, KVT_ACQ);
	uint64_t deadline = 0;
	for (unsigned spins = 0;; spins++) {
		if (KVT_ST(w) != KVT_S_READY || (KVT_GEN(w) & 0xfffffffULL) != gen28)
			return; /* pins exist only in READY; another life now */
		uint64_t mine = frozen_word(s, KVT_GEN(w));
		if (w & KVT_ST_FROZEN) {
			uint32_t f = KVT_FREEZER(w);
			if (w != mine && f && f - 1 != s->reaping && kvt__entry_alive(s, f - 1)) {
				/* A live repairer is on it and waits for no one
				 * who waits for us (P1): let it finish, then
				 * repair again (idempotent) -- for a while: a
				 * repairer stopped mid-repair (SIGSTOP) has its
				 * repair taken over (its own last CAS then
				 * fails), repair_body's bound applies to ours. */
				if (!deadline)
					deadline = kvt__now_ns() + KVT_LIVE_WAIT_NS;
				if ((spins & 255) != 255 || kvt__now_ns() < deadline) {
					if (spins > 64)
						sched_yield();
					w = kat_load(&sl->state, KVT_ACQ);
					continue;
				}
				KVT_SP(REPAIR_TAKEOVER, s);
			}
			if (w != mine)
				kvt__count(s, KVT_C_ADOPTED, 1);
		}
		if (w == mine || kat_cas(&sl->state, &w, mine, KVT_SC)) {
			(void)repair_body(s, x, mine);
			return;
		}
	}
}
