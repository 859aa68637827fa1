/* index.c - the lock-free key -> slot index.
 *
 * Shape: n_buckets (a power of two) cache-line buckets, each a control word
 * and 7 entries, at most 1/4 full (n_buckets x 7 >= 4 x n_slots).  A key
 * hashes to a primary bucket b1 and a secondary b2 and goes to the emptier
 * of the two (two choices keep the fullest bucket near the mean, so a key
 * whose 14 ways are all taken is vanishingly rare; it is counted as
 * index_full and its save fails with -ENOSPC).  A lookup reads at most
 * those two lines (plus the slot's meta line to compare the full 128-bit
 * key).
 *
 * Entry word: [tentative][gen low 15][tag 16][slot + 1].  0 is empty.
 *
 * Invariant I1: at most one live (FILLING or READY) slot per key is
 *   reachable through a final entry.
 * Invariant I2: a lookup never returns a slot whose key or generation
 *   differs from what it matched (find re-reads the state word after the
 *   key compare; the key loads are acquire (A12), paired with the
 *   allocator's release stores of the key (R12, slots.c) -- the seqlock
 *   rule: a key load must not be satisfied from a newer life than the
 *   re-read state shows, which relaxed key loads before an acquire re-read
 *   do not forbid in C11 or on aarch64; pins CAS on the full state word,
 *   generation included).
 *
 * Acquire/release pairs: R12/A12 (a slot's key, slots.c), R1/A1 (a final
 * entry), R2/A3 (the commit and clear of ctl), A3b (the helper's re-read
 * of ctl after the entry, index_help).
 *
 * Inserts of a key are serialized through its primary bucket's control
 * word, without a lock:
 *
 *   1. c = ctl(b1); if c is pending, help finish that insert first.
 *   2. scan b1, b2: a final entry whose slot is live for the key -> use it.
 *   3. claim an empty entry with CAS as TENTATIVE, stamped with the
 *      version this insert will commit (c.version + 1, low 16 bits).
 *   4. commit: CAS ctl c -> (version + 1, pending, position, slot).  If it
 *      fails, another insert for a key of this primary committed since
 *      step 1, so our scan may be stale: undo the tentative entry and
 *      start over.  If it succeeds, no other insert for this key can have
 *      committed between our scan and our commit (all go through this
 *      word), which gives I1.
 *   5. finalize: CAS the entry TENTATIVE -> final and clear the pending
 *      bit.  Anyone who finds the pending bit does steps 5 itself (help),
 *      so a process that dies after its commit blocks nobody; the helper
 *      identifies the entry by (position, slot, version stamp) and checks
 *      ctl again after reading it, so a stale helper finalizes another
 *      insert's entry only across a wrap of the 16-bit stamp together with
 *      one of the slot's 15-bit generation, stalled between two
 *      instructions (INDEX_HELP_CAS); that insert then repairs the entry
 *      itself (step 4's undo, or its tag after step 5; see index_help).
 *
 * Lookups ignore tentative entries (their slots are FILLING anyway).
 * Removal is a CAS of the entry back to 0 by the process that holds the
 * slot in EVICTING (or a helper completing that eviction); it needs no
 * serialization because removing can never create a duplicate.  A process
 * that dies between steps 3 and 4 leaves a tentative entry that no ctl
 * points to: the slot it names is FILLING with the dead process as its
 * allocator (in the state word), so the reaper dooms and reclaims the slot, and reclaiming removes
 * every entry naming (slot, generation).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvt_format.h"

#define CTL_PEND(ver, pos, slot) (((uint64_t)(ver) << 37) | (1ULL << 36) | \
	((uint64_t)(pos) << 32) | ((uint64_t)(slot) + 1))
#define CTL_VER(c)     ((c) >> 37)
#define CTL_IS_PEND(c) (((c) >> 36) & 1u)
#define CTL_POS(c)     ((uint32_t)((c) >> 32) & 0xfu)
#define CTL_SLOT(c)    ((uint32_t)(c) - 1u)
#define CTL_IDLE(ver)  ((uint64_t)(ver) << 37)
#define VTAG(ver)      ((uint32_t)(ver) & 0xffffu)

void kvt__key_hash(const kvt_seg *s, const kvt_key *k, uint32_t *b1,
		   uint32_t *b2, uint32_t *tag)
{
	/* Keys may be small integers (a trace's block ids): mix both halves. */
	uint64_t h = kvt__mix64(k->lo ^ kvt__mix64(k->hi ^ 0x9e3779b97f4a7c15ULL));
	uint64_t h2 = kvt__mix64(h);

	*b1 = (uint32_t)h & s->bucket_mask;
	*b2 = (uint32_t)(h2 >> 17) & s->bucket_mask;
	if (*b2 == *b1)
		*b2 = *b1 ^ 1u;
	*tag = (uint32_t)(h >> 48);
}

static void index_help(kvt_seg *s, uint32_t b1, uint64_t c);

void kvt__index_prefetch(const kvt_seg *s, const kvt_key *k)
{
	uint32_t b1, b2, tag;

	kvt__key_hash(s, k, &b1, &b2, &tag);
	__builtin_prefetch(&s->buckets[b1], 0, 3);
	__builtin_prefetch(&s->buckets[b2], 0, 3); /* half the keys live there */
}

/* Finishes every insert left pending (the reaper: its inserter died
 * between commit and finalize; anyone inserting there would help too). */
void kvt__index_help_all(kvt_seg *s)
{
	for (uint32_t b = 0; b < s->d.n_buckets; b++) {
		uint64_t c = kat_load(&s->buckets[b].ctl, KVT_ACQ);
		if (c & (1ULL << 36))
			index_help(s, b, c);
	}
}

static kvt_a64 *entry_at(kvt_seg *s, uint32_t b1, uint32_t b2, uint32_t pos)
{
	return pos < KVT_BUCKET_WAYS ? &s->buckets[b1].e[pos]
				     : &s->buckets[b2].e[pos - KVT_BUCKET_WAYS];
}

static int key_eq(const struct kvt_slot *sl, const kvt_key *k)
{
	/* A12: acquire, pairs with the allocator's R12 (slots.c); the caller
	 * re-reads the state after this (the seqlock rule). */
	return kat_load(&sl->key_lo, KVT_ACQ) == k->lo &&
	       kat_load(&sl->key_hi, KVT_ACQ) == k->hi;
}

int kvt__slot_state_live(uint64_t w)
{
	return KVT_ST(w) == KVT_S_FILLING || KVT_ST(w) == KVT_S_READY;
}

int kvt__index_find(kvt_seg *s, const kvt_key *k, uint64_t *gen_out,
		    uint32_t *slot_out, int want_filling, uint64_t *state_out)
{
	uint32_t b1, b2, t;

	kvt__key_hash(s, k, &b1, &b2, &t);
	for (uint32_t pos = 0; pos < 2 * KVT_BUCKET_WAYS; pos++) {
		/* A1: acquire pairs with the release CAS that published the
		 * entry (insert step 3/5): the slot's key and depth, written
		 * before, are visible. */
		uint64_t e = kat_load(entry_at(s, b1, b2, pos), KVT_ACQ);
		uint32_t x;
		uint64_t w, w2;

		if (!e || (e & KVT_E_TENT) || KVT_E_TAG(e) != t)
			continue;
		x = KVT_E_SLOT(e);
		if (x >= s->geo.n_slots)
			continue; /* corrupt entry: never dereference it */
		struct kvt_slot *sl = kvt__slot(s, x);
		/* A2: acquire pairs with the release that made the slot READY
		 * (kvt_write_end): the payload of every shard is visible. */
		w = kat_load(&sl->state, KVT_ACQ);
		if ((KVT_GEN(w) & 0x7fffULL) != KVT_E_GEN(e))
			continue;
		if (!(KVT_ST(w) == KVT_S_READY ||
		      (want_filling && KVT_ST(w) == KVT_S_FILLING)))
			continue;
		if (!key_eq(sl, k))
			continue;
		KVT_SP(FIND_KEYREAD, s);
		/* The key we compared belongs to generation KVT_GEN(w) only
		 * if the generation did not move meanwhile: if key_eq's
		 * acquire loads (A12) saw a newer life's key, this load sees
		 * that life's state word. */
		w2 = kat_load(&sl->state, KVT_RLX);
		if (KVT_GEN(w2) != KVT_GEN(w))
			continue;
		*slot_out = x;
		*gen_out = KVT_GEN(w);
		if (state_out)
			*state_out = w;
		return 1;
	}
	return 0;
}

/* Step 5, for whoever finds ctl pending. */
static void index_help(kvt_seg *s, uint32_t b1, uint64_t c)
{
	uint32_t pos = CTL_POS(c), x = CTL_SLOT(c);

	KVT_SP(INDEX_HELP, s);
	if (pos < 2 * KVT_BUCKET_WAYS && x < s->geo.n_slots) {
		struct kvt_slot *sl = kvt__slot(s, x);
		kvt_key k = { kat_load(&sl->key_lo, KVT_RLX), kat_load(&sl->key_hi, KVT_RLX) };
		uint32_t kb1, kb2, tag;
		kvt__key_hash(s, &k, &kb1, &kb2, &tag);
		/* If the slot was reused meanwhile, the key (hence kb2) is
		 * another's and the exact-match test below fails: harmless. */
		kvt_a64 *ep = entry_at(s, b1, kb2, pos);
		uint64_t e = kat_load(ep, KVT_ACQ);
		/* The stamp is the version's low 16 bits: a helper stalled
		 * since it read c, for 65,536 inserts on this bucket, could
		 * find a later insert's tentative entry with the same position,
		 * slot and stamp, perhaps not yet committed.  So ctl must still
		 * be c (all 27 version bits) after the entry was read (A3b,
		 * acquire: ordered after the entry's load).  What remains is a
		 * stall between this re-read and the CAS below (schedule point
		 * INDEX_HELP_CAS), which compares the whole entry word: the
		 * insert would have to finish and 65,536 x k later inserts to
		 * put back the same word -- same stamp, position, slot, and
		 * the slot's generation's low 15 bits (32,768 x k reuses of
		 * that slot).  Then this CAS finalizes that later insert I's
		 * entry, early and with the tag of the key read above (the
		 * older life's).  No wrong byte follows (finders compare the
		 * key and the generation), and I repairs both outcomes
		 * itself: if its commit fails, its undo removes the final
		 * entry that names its slot and generation (nobody else can
		 * have made one: the slot is its FILLING slot); if its commit
		 * succeeds, it rewrites the entry with its key's tag.  So the
		 * wrap leaves no garbage way; test_index_stamp_wrap (core_sp.c)
		 * replays it.  (Layout 5 checked the stamp only.) */
		if ((e & KVT_E_TENT) && KVT_E_SLOT(e) == x &&
		    KVT_E_TAG(e) == VTAG(CTL_VER(c)) && kb1 == b1 &&
		    kat_load(&s->buckets[b1].ctl, KVT_ACQ) == c) {
			uint64_t fin = (e & ~(KVT_E_TENT | (0xffffULL << 32))) |
				       ((uint64_t)tag << 32);
			KVT_SP(INDEX_HELP_CAS, s);
			/* R1: release publishes the entry to finders (A1). */
			kat_cas(ep, &e, fin, KVT_AR);
		}
	}
	/* Clear pending; failure means someone else already did. */
	kat_cas(&s->buckets[b1].ctl, &c, CTL_IDLE(CTL_VER(c)), KVT_AR);
}

int kvt__index_insert(kvt_seg *s, const kvt_key *k, uint32_t slot, uint64_t gen,
		      uint32_t *existing, uint64_t *existing_gen)
{
	uint32_t b1, b2, tag;

	kvt__key_hash(s, k, &b1, &b2, &tag);
	for (int tries = 0; tries < 100000; tries++) {
		kvt_a64 *ctl = &s->buckets[b1].ctl;
		/* A3: acquire pairs with the commit/clear CAS of other inserts
		 * (R2/R1), so the scan below sees the entries they committed. */
		uint64_t c = kat_load(ctl, KVT_ACQ), e0 = 0, tent;
		uint32_t pos;

		if (CTL_IS_PEND(c)) {
			index_help(s, b1, c);
			continue;
		}
		if (kvt__index_find(s, k, existing_gen, existing, 1, NULL))
			return 1;
		/* Two choices: the emptier bucket (b1 on a tie), its first
		 * free way.  Relaxed: a stale view only picks a worse way; the
		 * CAS below decides. */
		uint32_t free1 = 0, free2 = 0, first1 = KVT_BUCKET_WAYS, first2 = KVT_BUCKET_WAYS;
		for (uint32_t w = 0; w < KVT_BUCKET_WAYS; w++) {
			if (kat_load(&s->buckets[b1].e[w], KVT_RLX) == 0 && free1++ == 0)
				first1 = w;
			if (kat_load(&s->buckets[b2].e[w], KVT_RLX) == 0 && free2++ == 0)
				first2 = w;
		}
		if (!free1 && !free2)
			return -ENOSPC;
		pos = free1 >= free2 ? first1 : KVT_BUCKET_WAYS + first2;
		tent = KVT_E(slot, gen, VTAG(CTL_VER(c) + 1), 1);
		/* Release: the slot's key, written before, is visible to a
		 * helper that reads this entry. */
		if (!kat_cas(entry_at(s, b1, b2, pos), &e0, tent, KVT_AR))
			continue;
		KVT_SP(INDEX_TENTATIVE, s);
		/* R2: the commit point (see the essay above). */
		if (!kat_cas(ctl, &c, CTL_PEND(CTL_VER(c) + 1, pos, slot), KVT_AR)) {
			kvt_a64 *ep = entry_at(s, b1, b2, pos);
			uint64_t t = tent;
			/* Undo.  A helper stalled across a stamp wrap may have
			 * finalized this entry (see index_help): a final entry
			 * naming our FILLING slot and generation is ours, and
			 * uncommitted: it goes too. */
			if (!kat_cas(ep, &t, 0, KVT_AR) && !(t & KVT_E_TENT) &&
			    KVT_E_SLOT(t) == slot && KVT_E_GEN(t) == (gen & 0x7fffULL))
				kat_cas(ep, &t, 0, KVT_AR);
			continue;
		}
		KVT_SP(INDEX_COMMITTED, s);
		index_help(s, b1, CTL_PEND(CTL_VER(c) + 1, pos, slot));
		{
			/* After a stamp wrap our entry may have been finalized
			 * by a stale helper with the tag of the key it had read
			 * (index_help): give it our key's. */
			kvt_a64 *ep = entry_at(s, b1, b2, pos);
			uint64_t e = kat_load(ep, KVT_ACQ), want = KVT_E(slot, gen, tag, 0);
			if (e != want && !(e & KVT_E_TENT) && KVT_E_SLOT(e) == slot &&
			    KVT_E_GEN(e) == (gen & 0x7fffULL))
				kat_cas(ep, &e, want, KVT_AR);
		}
		return 0;
	}
	return -EAGAIN;
}

void kvt__index_remove(kvt_seg *s, uint32_t slot, uint64_t gen)
{
	struct kvt_slot *sl = kvt__slot(s, slot);
	kvt_key k = { kat_load(&sl->key_lo, KVT_RLX), kat_load(&sl->key_hi, KVT_RLX) };
	uint32_t b1, b2, tag;
	int found;

	kvt__key_hash(s, &k, &b1, &b2, &tag);
	do {
		found = 0;
		for (uint32_t pos = 0; pos < 2 * KVT_BUCKET_WAYS; pos++) {
			kvt_a64 *ep = entry_at(s, b1, b2, pos);
			uint64_t e = kat_load(ep, KVT_ACQ);
			if (e && KVT_E_SLOT(e) == slot && KVT_E_GEN(e) == (gen & 0x7fffULL)) {
				found = 1;
				kat_cas(ep, &e, 0, KVT_AR);
			}
		}
	} while (found);
}

static int key_cmp(const void *a, const void *b)
{
	const uint64_t *x = a, *y = b;

	if (x[1] != y[1])
		return x[1] < y[1] ? -1 : 1;
	if (x[0] != y[0])
		return x[0] < y[0] ? -1 : 1;
	return 0;
}

#define CHECK_FAIL(...) do { snprintf(msg, len, __VA_ARGS__); rc = -EUCLEAN; goto out; } while (0)

int kvt__index_check(kvt_seg *s, char *msg, size_t len)
{
	uint32_t n = s->geo.n_slots, *refs = calloc(n, sizeof(uint32_t));
	uint64_t (*keys)[2] = calloc(n, sizeof(*keys));
	uint32_t nk = 0;
	int rc = 0;

	if (!refs || !keys) {
		free(refs);
		free(keys);
		return -ENOMEM;
	}
	for (uint32_t b = 0; b < s->d.n_buckets; b++) {
		uint64_t c = kat_load(&s->buckets[b].ctl, KVT_ACQ);
		if (CTL_IS_PEND(c))
			CHECK_FAIL("index: bucket %u has an unfinished insert", b);
		for (uint32_t w = 0; w < KVT_BUCKET_WAYS; w++) {
			uint64_t e = kat_load(&s->buckets[b].e[w], KVT_ACQ);
			if (!e)
				continue;
			if (e & KVT_E_TENT)
				CHECK_FAIL("index: bucket %u way %u is tentative", b, w);
			uint32_t x = KVT_E_SLOT(e);
			if (x >= n)
				CHECK_FAIL("index: bucket %u way %u names slot %u of %u", b, w, x, n);
			struct kvt_slot *sl = kvt__slot(s, x);
			uint64_t st = kat_load(&sl->state, KVT_ACQ);
			if (!kvt__slot_state_live(st) || (KVT_GEN(st) & 0x7fff) != KVT_E_GEN(e))
				CHECK_FAIL("index: bucket %u way %u names slot %u which is not "
					   "live (state %u)", b, w, x, KVT_ST(st));
			kvt_key k = { kat_load(&sl->key_lo, KVT_RLX), kat_load(&sl->key_hi, KVT_RLX) };
			uint32_t b1, b2, tag;
			kvt__key_hash(s, &k, &b1, &b2, &tag);
			if ((b != b1 && b != b2) || tag != KVT_E_TAG(e))
				CHECK_FAIL("index: slot %u is filed under bucket %u, its key "
					   "belongs in %u or %u", x, b, b1, b2);
			refs[x]++;
		}
	}
	for (uint32_t x = 0; x < n; x++) {
		struct kvt_slot *sl = kvt__slot(s, x);
		uint64_t st = kat_load(&sl->state, KVT_ACQ);
		if (kvt__slot_state_live(st)) {
			if (refs[x] != 1)
				CHECK_FAIL("index: live slot %u has %u index entries", x, refs[x]);
			keys[nk][0] = kat_load(&sl->key_lo, KVT_RLX);
			keys[nk][1] = kat_load(&sl->key_hi, KVT_RLX);
			nk++;
		}
	}
	qsort(keys, nk, sizeof(*keys), key_cmp);
	for (uint32_t i = 1; i < nk; i++)
		if (!key_cmp(keys[i - 1], keys[i]))
			CHECK_FAIL("index: two live slots hold key %016llx%016llx",
				   (unsigned long long)keys[i][1], (unsigned long long)keys[i][0]);
out:
	free(refs);
	free(keys);
	return rc;
}
