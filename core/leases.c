/* leases.c - lookups, pins, leases, the step sweep, and pin repair.
 *
 * Lease states (state word [gen 48][actor 12][state 4], CAS only; the actor
 * is the builder in BUILDING and ACTIVE, the releaser in RELEASING):
 *
 *   FREE --lookup--> BUILDING --pins recorded--> ACTIVE --release--> RELEASING
 *    ^                                                                   |
 *    +--------------------- every ref unpinned, gen + 1 ------------------+
 *
 * A lease id carries the low 32 bits of the generation, so a stale id
 * (released, maybe reused) is recognised: releasing it again is counted as
 * a double unpin and changes nothing.  A lease is released exactly once,
 * by whoever wins the CAS ACTIVE -> RELEASING: the last rank to load, an
 * explicit release, the step sweep (absent from the load set for two
 * consecutive steps), or the reaper (its builder died, or a rank it waits
 * for died).
 *
 * Pins and crashes.  A pin (slot CAS) and its record in the lease (a ref
 * word) are two stores; a process can die between them.  To make that
 * repairable exactly, each process journals the one pin/unpin it is doing
 * in its rank-table entry:
 *
 *   pin:   journal PIN(x,g); n_refs = i+1; CAS pins+1; ref[i] = (x,g); journal 0
 *   unpin: journal UNPIN(x,g); CAS pins-1; ref[i] = 0; journal 0
 *
 * The reaper, finding a dead entry whose journal names slot x, repairs x's
 * pin count (kvt__pins_repair): it FREEZES x (a flag in the state word
 * that makes new pins fail and new unpins wait), waits until no live
 * process is between the two stores on x (journal on x and not BLOCKED),
 * counts the refs to (x, g) in every lease, and sets pins to that count as
 * it unfreezes.  Every pin is then matched by exactly one ref again; the
 * dead process's lease is released afterwards through its refs.  The
 * freeze is itself journaled (FREEZE), so a reaper that dies while
 * holding it is repaired by the next one (the repair is idempotent).
 *
 * Orderings: the BUILDING -> ACTIVE CAS is a release (R7) that publishes
 * the refs to ranks, which read the state with acquire (A7) before reading
 * refs.  Journal stores are releases read with acquire by the reaper (A8).
 */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "kvt_format.h"

static kvt_a64 *my_journal(kvt_seg *s)
{
	return &s->ents[s->entry].journal;
}

static int lease_decode(const kvt_seg *s, uint64_t id, uint32_t *idx, uint64_t *gen32)
{
	uint32_t i = (uint32_t)id;

	if (i == 0 || i > s->geo.n_leases)
		return kvt__err(-EINVAL, "lease id %#llx is not a lease of this segment",
				(unsigned long long)id);
	*idx = i - 1;
	*gen32 = id >> 32;
	return 0;
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
		kat_store(&l->instance, s->instance, KVT_RLX);
		kat_store(&l->n_refs, 0, KVT_RLX);
		kat_store(&l->loaded, 0, KVT_RLX);
		kat_store(&l->misses, 0, KVT_RLX);
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
		 * loads that follow; the pin itself needs no release. */
		if (kat_cas(&sl->state, &w, w + KVT_PIN_ONE, KVT_AR))
			return 0;
	}
}

int kvt_seg_lookup(kvt_seg *s, const kvt_key *keys, uint32_t n, uint64_t *lease)
{
	struct kvt_lease *l = NULL;
	uint32_t idx = 0, hits = 0, x;
	uint64_t lgen = 0, gen;

	*lease = 0;
	if (s->entry == UINT32_MAX)
		return kvt__err(-EPERM, "lookup: an observer handle cannot pin");
	kvt__count(s, KVT_C_LOOKUPS, 1);
	kvt__count(s, KVT_C_LOOKUP_CHUNKS, n);
	/* The buckets of a prompt's keys are independent cache misses: start
	 * them all before walking the prefix (they are one dependent miss
	 * each otherwise). */
	for (uint32_t i = 0; i < n && i < 64; i++)
		kvt__index_prefetch(s, &keys[i]);
	for (uint32_t i = 0; i < n; i++) {
		if (!kvt__index_find(s, &keys[i], &gen, &x, 0))
			break;
		if (!l) {
			if (lease_alloc(s, &idx, &lgen)) {
				kvt__count(s, KVT_C_LEASES_FULL, 1);
				return kvt__err(-ENOSPC, "lookup: all %u leases are in use",
						s->geo.n_leases);
			}
			l = kvt__lease(s, idx);
		}
		if (hits == s->geo.lease_max_chunks)
			break;
		struct kvt_slot *sl = kvt__slot(s, x);
		kat_store(&l->n_refs, hits + 1, KVT_RLX);
		kat_store(my_journal(s), KVT_J(KVT_J_PIN, x, gen), KVT_REL);
		if (slot_pin(sl, gen)) {
			kat_store(my_journal(s), 0, KVT_REL);
			kat_store(&l->n_refs, hits, KVT_RLX);
			break;
		}
		kat_store(&l->refs[hits], KVT_REF(x, gen), KVT_RLX);
		kat_store(my_journal(s), 0, KVT_REL);
		/* A hit protects the chunk for one more sweep (relaxed: heuristic). */
		kat_store(&sl->ref, 2, KVT_RLX);
		hits++;
	}
	if (l) {
		uint64_t w = KVT_LW(KVT_L_BUILDING, lgen, s->entry + 1);
		if (hits) {
			/* R7: publishes refs and n_refs (A7).  The builder stays the
			 * actor: its death releases the lease (reaper). */
			kat_cas(&l->state, &w, KVT_LW(KVT_L_ACTIVE, lgen, s->entry + 1), KVT_AR);
			*lease = KVT_LEASE_ID(idx, lgen);
		} else {
			/* R8 */
			kat_cas(&l->state, &w, KVT_LW(KVT_L_FREE, lgen + 1, 0), KVT_AR);
		}
	}
	kvt__count(s, KVT_C_HIT_CHUNKS, hits);
	kvt__count(s, KVT_C_HIT_TOKENS, (uint64_t)hits * s->geo.chunk_tokens);
	return (int)hits;
}

int kvt_lease_slots(kvt_seg *s, uint64_t lease, uint32_t *slots, uint64_t *gens,
		    uint32_t max)
{
	uint32_t idx = 0, n;
	uint64_t gen32 = 0, w;
	struct kvt_lease *l;
	int r = lease_decode(s, lease, &idx, &gen32);

	if (r)
		return r;
	l = kvt__lease(s, idx);
	w = kat_load(&l->state, KVT_ACQ); /* A7 */
	if (KVT_LST(w) != KVT_L_ACTIVE || (KVT_LGEN(w) & 0xffffffffULL) != gen32)
		return kvt__err(-ESTALE, "lease %#llx is not live", (unsigned long long)lease);
	n = kat_load(&l->n_refs, KVT_RLX);
	if (n > s->geo.lease_max_chunks)
		return kvt__err(-EUCLEAN, "lease %#llx: n_refs %u out of range",
				(unsigned long long)lease, n);
	for (uint32_t i = 0; i < n && i < max; i++) {
		uint64_t ref = kat_load(&l->refs[i], KVT_RLX);
		uint32_t x = KVT_REF_SLOT(ref);
		if (!ref || x >= s->geo.n_slots)
			return kvt__err(-EUCLEAN, "lease %#llx: ref %u is corrupt",
					(unsigned long long)lease, i);
		if (slots)
			slots[i] = x;
		if (gens)
			gens[i] = KVT_REF_GEN(ref);
	}
	/* The refs we copied belong to this lease only if it is still live. */
	if (kat_load(&l->state, KVT_ACQ) != w)
		return kvt__err(-ESTALE, "lease %#llx was released meanwhile",
				(unsigned long long)lease);
	return (int)(n < max ? n : max);
}

void kvt__lease_finish_release(kvt_seg *s, uint32_t idx)
{
	struct kvt_lease *l = kvt__lease(s, idx);
	uint64_t w = kat_load(&l->state, KVT_ACQ);
	uint32_t n = kat_load(&l->n_refs, KVT_RLX);

	if (KVT_LST(w) != KVT_L_RELEASING)
		return;
	if (n > s->geo.lease_max_chunks)
		n = s->geo.lease_max_chunks; /* corrupt count: release what exists */
	for (uint32_t i = 0; i < n; i++) {
		uint64_t ref = kat_load(&l->refs[i], KVT_ACQ);
		uint32_t x = KVT_REF_SLOT(ref);
		if (!ref)
			continue;
		if (x < s->geo.n_slots) {
			kat_store(my_journal(s), KVT_J(KVT_J_UNPIN, x, KVT_REF_GEN(ref)), KVT_REL);
			(void)kvt__slot_unpin(s, x, KVT_REF_GEN(ref));
		}
		kat_store(&l->refs[i], 0, KVT_REL);
		kat_store(my_journal(s), 0, KVT_REL);
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
	kvt__lease_finish_release(s, idx);
	return 0;
}

static int lease_release_id(kvt_seg *s, uint64_t lease, int count_double)
{
	uint32_t idx = 0;
	uint64_t gen32 = 0, w;
	int r = lease_decode(s, lease, &idx, &gen32);

	if (r)
		return r;
	w = kat_load(&kvt__lease(s, idx)->state, KVT_ACQ);
	if (KVT_LST(w) == KVT_L_ACTIVE && (KVT_LGEN(w) & 0xffffffffULL) == gen32 &&
	    lease_release_idx(s, idx, w) == 0)
		return 0;
	if (count_double)
		kvt__count(s, KVT_C_DOUBLE_UNPINS, 1);
	return kvt__err(-EALREADY, "lease %#llx was already released",
			(unsigned long long)lease);
}

int kvt_lease_release(kvt_seg *s, uint64_t lease)
{
	if (s->entry == UINT32_MAX)
		return kvt__err(-EPERM, "release: an observer handle cannot unpin");
	return lease_release_id(s, lease, 1);
}

int kvt_lease_loaded(kvt_seg *s, uint64_t lease, uint32_t rank)
{
	uint32_t idx = 0;
	uint64_t gen32 = 0, w, bit, prev, full;
	struct kvt_lease *l;
	int r;

	if (s->entry == UINT32_MAX)
		return kvt__err(-EPERM, "loaded: an observer handle cannot load");
	if (rank >= s->geo.world)
		return kvt__err(-EINVAL, "loaded: rank %u out of range for world=%u",
				rank, s->geo.world);
	r = lease_decode(s, lease, &idx, &gen32);
	if (r)
		return r;
	l = kvt__lease(s, idx);
	w = kat_load(&l->state, KVT_ACQ);
	if (KVT_LST(w) != KVT_L_ACTIVE || (KVT_LGEN(w) & 0xffffffffULL) != gen32)
		return kvt__err(-ESTALE, "lease %#llx is not live", (unsigned long long)lease);
	bit = 1ULL << rank;
	full = kvt__full_mask(s->geo.world);
	/* Acq_rel: every rank's loads are done before whoever sees the full
	 * mask releases the pins (R4 then carries it to the evictor). */
	prev = kat_or(&l->loaded, bit, KVT_AR);
	if (!(prev & bit))
		kvt__count(s, KVT_C_LOADED_CHUNKS, kat_load(&l->n_refs, KVT_RLX));
	if ((prev | bit) == full && !(prev & bit))
		return lease_release_idx(s, idx, w) == 0 ? 1 : 0;
	return 0;
}

static int u64_cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

int kvt_seg_step(kvt_seg *s, const uint64_t *live, uint32_t n)
{
	uint64_t *set = NULL;
	int released = 0;

	if (s->entry == UINT32_MAX)
		return kvt__err(-EPERM, "step: an observer handle cannot step");
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
		uint64_t id = KVT_LEASE_ID(i, KVT_LGEN(w));
		if (set && bsearch(&id, set, n, sizeof(*set), u64_cmp)) {
			kat_store(&l->misses, 0, KVT_RLX);
			kat_store(&l->last_step, epoch, KVT_RLX);
			continue;
		}
		/* Relaxed: one scheduler steps an instance; a racing step by a
		 * second one only releases a stale lease one step early. */
		uint32_t m = kat_load(&l->misses, KVT_RLX) + 1;
		kat_store(&l->misses, m, KVT_RLX);
		if (m >= 2 && lease_release_idx(s, i, w) == 0) {
			kvt__count(s, KVT_C_STALE_UNPINS, 1);
			released++;
		}
	}
	free(set);
	return released;
}

void kvt__pins_repair(kvt_seg *s, uint32_t x, uint64_t gen28)
{
	struct kvt_slot *sl;
	uint64_t w, count = 0;

	if (x >= s->geo.n_slots)
		return;
	sl = kvt__slot(s, x);
	w = kat_load(&sl->state, KVT_ACQ);
	for (;;) {
		if (KVT_ST(w) != KVT_S_READY || (KVT_GEN(w) & 0xfffffffULL) != gen28)
			return; /* pins exist only in READY; another life now */
		kat_store(my_journal(s), KVT_J(KVT_J_FREEZE, x, KVT_GEN(w)), KVT_REL);
		if (w & KVT_ST_FROZEN)
			break; /* a dead reaper's freeze: adopt it */
		if (kat_cas(&sl->state, &w, w | KVT_ST_FROZEN, KVT_SC)) {
			w |= KVT_ST_FROZEN;
			break;
		}
	}
	/* Wait for live processes between their two stores on x (A8). */
	for (uint32_t e = 0; e < s->d.n_entries; e++) {
		if (e == s->entry)
			continue;
		for (unsigned spins = 0;; spins++) {
			uint64_t j = kat_load(&s->ents[e].journal, KVT_SC);
			uint32_t op = KVT_J_OP(j);
			if ((op != KVT_J_PIN && op != KVT_J_UNPIN) || KVT_J_SLOT(j) != x ||
			    (j & KVT_J_BLOCKED))
				break;
			/* An entry being reaped belongs to a dead process. */
			uint32_t ost = KVT_OWNER_ST(kat_load(&s->ents[e].owner, KVT_ACQ));
			if (ost != KVT_ENT_ATTACHED && ost != KVT_ENT_CLAIMING)
				break;
			if ((spins & 1023) == 1023 && !kvt__entry_alive(s, e))
				break; /* dead: its outcome is what the count says */
			sched_yield();
		}
	}
	for (uint32_t i = 0; i < s->geo.n_leases; i++) {
		struct kvt_lease *l = kvt__lease(s, i);
		uint64_t lw = kat_load(&l->state, KVT_ACQ);
		if (KVT_LST(lw) == KVT_L_FREE)
			continue;
		uint32_t n = kat_load(&l->n_refs, KVT_ACQ);
		if (n > s->geo.lease_max_chunks)
			n = s->geo.lease_max_chunks;
		for (uint32_t k = 0; k < n; k++)
			if (kat_load(&l->refs[k], KVT_ACQ) == KVT_REF(x, KVT_GEN(w)))
				count++;
	}
	if (count > KVT_PINS_MAX)
		count = KVT_PINS_MAX;
	/* Only we change a frozen word (pins and unpins wait or fail). */
	for (;;) {
		uint64_t nw = KVT_SW(KVT_S_READY, KVT_GEN(w), count);
		if (kat_cas(&sl->state, &w, nw, KVT_SC))
			break;
		if (!(w & KVT_ST_FROZEN))
			break; /* a concurrent adopter finished it */
	}
	kat_store(my_journal(s), 0, KVT_REL);
}
