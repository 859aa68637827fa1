/* check.c - the invariant checker (ck_ring_valid-style), for tests and the
 * operator's stat tool.  It reads a quiescent segment: with operations in
 * flight it can report transient states (a FILLING slot with a live
 * writer is fine; a BUILDING lease is not).
 *
 * Checked:
 *   C1 slots conserved: every slot FREE, FILLING or READY (no EVICTING or
 *      DOOMED left behind); no slot FROZEN (and a frozen slot's freezer is
 *      named, alive or dead); ready masks within the shard count; READY
 *      slots with a full ready mask and no live claim; every live claim of
 *      a slot's current life names a live entry (a claim of a dead writer
 *      is one the reaper has not dropped yet); no FILLING slot still
 *      naming its allocator;
 *   C2 index <-> slots: every entry names a live slot of its generation
 *      under the right bucket and tag; every live slot has exactly one
 *      entry; no key has two live slots (kvt__index_check);
 *   C3 pins: every READY slot's pin count equals the number of refs to
 *      (slot, gen) in ACTIVE leases (an extra pin that no lease references
 *      makes a slot unevictable for ever; a missing one lets it go while a
 *      lease still reads it); every ref of an ACTIVE lease names a READY
 *      slot of that generation; no lease BUILDING or RELEASING;
 *   C4 rank table: every non-EMPTY entry has a live holder (ATTACHED or
 *      CLAIMING left by a dead process, REAPING left by a dead reaper are
 *      reported), no journal left open.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvt_format.h"

#define FAIL(...) do { snprintf(msg, len, __VA_ARGS__); rc = -EUCLEAN; goto out; } while (0)

static const char *ent_state_name(uint32_t st)
{
	static const char *const n[] = { "EMPTY", "CLAIMING", "ATTACHED", "REAPING" };

	return st < 4 ? n[st] : "?";
}

int kvt_check(kvt_seg *s, char *msg, size_t len)
{
	uint32_t n = s->geo.n_slots;
	uint64_t full = kvt__full_mask(s->d.n_shards);
	uint32_t *pins = calloc(n, sizeof(uint32_t));
	char dummy[8];
	int rc = 0;

	if (!msg || !len) {
		msg = dummy;
		len = sizeof(dummy);
	}
	msg[0] = 0;
	if (!pins)
		return -ENOMEM;
	/* C4 */
	for (uint32_t e = 0; e < s->d.n_entries; e++) {
		uint64_t w = kat_load(&s->ents[e].owner, KVT_ACQ);
		uint32_t st = KVT_OWNER_ST(w);
		if (st > KVT_ENT_REAPING)
			FAIL("ranks: entry %u has unknown state %u", e, st);
		if (st == KVT_ENT_EMPTY)
			continue;
		if (!kvt__entry_alive(s, e))
			FAIL("ranks: entry %u (%s, pid %d) has no live holder and is not reaped%s",
			     e, ent_state_name(st), KVT_OWNER_PID(w),
			     st == KVT_ENT_REAPING ? " (its reaper died)" : "");
		if (kat_load(&s->ents[e].journal, KVT_ACQ) != 0)
			FAIL("ranks: entry %u has an open journal %#llx", e,
			     (unsigned long long)kat_load(&s->ents[e].journal, KVT_ACQ));
	}
	/* C1 */
	for (uint32_t x = 0; x < n; x++) {
		struct kvt_slot *sl = kvt__slot(s, x);
		uint64_t w = kat_load(&sl->state, KVT_ACQ);
		uint64_t rd = kat_load(&sl->ready, KVT_ACQ);
		uint32_t st = KVT_ST(w);

		if (w & KVT_ST_FROZEN) {
			uint32_t f = KVT_FREEZER(w);
			FAIL("slots: slot %u is frozen by entry %d (%s)", x, (int)f - 1,
			     f && kvt__entry_alive(s, f - 1) ? "alive: a repair in progress"
							     : "dead: a repair left half done");
		}
		if (st != KVT_S_FREE && st != KVT_S_FILLING && st != KVT_S_READY)
			FAIL("slots: slot %u left in state %u", x, st);
		if (st == KVT_S_FILLING && KVT_FILL_OWNER(w))
			FAIL("slots: slot %u is still being set up by entry %u", x,
			     KVT_FILL_OWNER(w) - 1);
		if (KVT_PINS(w) && st != KVT_S_READY && st != KVT_S_FILLING)
			FAIL("slots: slot %u has %u pins in state %u", x, KVT_PINS(w), st);
		if (st == KVT_S_FREE)
			continue;
		if (rd & ~full)
			FAIL("slots: slot %u ready mask %#llx exceeds %u shards", x,
			     (unsigned long long)rd, s->d.n_shards);
		if (st == KVT_S_READY && rd != full)
			FAIL("slots: READY slot %u has ready mask %#llx", x, (unsigned long long)rd);
		for (uint32_t sh = 0; sh < s->d.n_shards; sh++) {
			uint64_t c = kat_load(&sl->claim[sh], KVT_ACQ);
			uint32_t who = KVT_CLAIM_ENT(c);
			if (!who || KVT_CLAIM_GEN(c) != KVT_GEN(w))
				continue; /* free, or an older life's garbage */
			if (who > s->d.n_entries || !kvt__entry_alive(s, who - 1))
				FAIL("slots: slot %u shard %u is claimed by dead entry %u (a writer "
				     "died and was not reaped)", x, sh, who - 1);
			if (st == KVT_S_READY)
				FAIL("slots: READY slot %u shard %u is still claimed by entry %u",
				     x, sh, who - 1);
		}
	}
	/* C2 */
	rc = kvt__index_check(s, msg, len);
	if (rc)
		goto out;
	/* C3 */
	for (uint32_t i = 0; i < s->geo.n_leases; i++) {
		struct kvt_lease *l = kvt__lease(s, i);
		kvt_a64 *refs = kvt__lease_refs(s, l);
		uint64_t w = kat_load(&l->state, KVT_ACQ);
		uint32_t st = KVT_LST(w), nr;

		if (st == KVT_L_FREE)
			continue;
		if (st != KVT_L_ACTIVE)
			FAIL("leases: lease %u left in state %u by entry %d", i, st,
			     (int)KVT_LACT(w) - 1);
		nr = kat_load(&l->n_refs, KVT_ACQ);
		if (nr == 0 || nr > s->geo.lease_max_chunks)
			FAIL("leases: lease %u has %u refs", i, nr);
		for (uint32_t k = 0; k < nr; k++) {
			uint64_t ref = kat_load(&refs[k], KVT_ACQ);
			uint32_t x = KVT_REF_SLOT(ref);
			if (!ref || x >= n)
				FAIL("leases: lease %u ref %u is %#llx", i, k, (unsigned long long)ref);
			uint64_t sw = kat_load(&kvt__slot(s, x)->state, KVT_ACQ);
			if (KVT_ST(sw) != KVT_S_READY ||
			    (KVT_GEN(sw) & 0xffffffffULL) != KVT_REF_GEN(ref))
				FAIL("leases: lease %u pins slot %u gen %llu which is not READY "
				     "in that generation", i, x, (unsigned long long)KVT_REF_GEN(ref));
			pins[x]++;
		}
	}
	for (uint32_t x = 0; x < n; x++) {
		uint64_t w = kat_load(&kvt__slot(s, x)->state, KVT_ACQ);
		/* (a FILLING word's pins field is its allocator and join version) */
		uint32_t p = KVT_ST(w) == KVT_S_READY ? KVT_PINS(w) : 0;
		/* more pins than refs in a life a repair flagged for a recount
		 * (it gave up on a stopped process): known, and being healed */
		uint64_t f = kat_load(&kvt__slot(s, x)->recount, KVT_RLX);
		if (p > pins[x] && f && f == (KVT_GEN(w) & 0xfffffffULL) + 1)
			continue;
		if (p != pins[x])
			FAIL("pins: slot %u has %u pins but %u lease references%s", x,
			     p, pins[x], p > pins[x] ?
			     " (a pin no lease will ever release)" :
			     " (a lease reads a slot that may be evicted)");
	}
out:
	free(pins);
	return rc;
}
