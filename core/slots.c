/* slots.c - slot states, writers, allocation and the CLOCK sweep.
 *
 * State word (one 64-bit CAS): [gen 40][pins 20][frozen][state 3].
 *
 *   FREE --alloc--> FILLING --all shards ready--> READY --claim--> EVICTING
 *    ^                 |                            | pins == 0       |
 *    |                 | writer died, aborted or    +- pin/unpin      |
 *    |                 | abandoned (fill timeout)                     |
 *    |                 v                                              |
 *    |              DOOMED --writing mask drained--> EVICTING --------+
 *    +--------------------------- index entry removed, gen + 1 -------+
 *
 * Invariants:
 *  S1  pins > 0 only in READY; a pin is CAS(READY|g|p -> READY|g|p+1) and
 *      the evictor's claim is CAS(READY|g|0 -> EVICTING|g), so a pinned
 *      slot is never evicted and an evicted slot is never pinned.
 *  S2  a slot with a writing bit set is never reclaimed: only DOOMED slots
 *      with writing == 0 move to EVICTING, and DOOMED is final (a DOOMED
 *      slot never becomes READY).  So no DMA can land in a reused slot.
 *  S3  EVICTING is final too: completing it (remove the index entries
 *      naming (slot, gen), then CAS EVICTING|g -> FREE|g+1) is idempotent,
 *      so any process may finish an eviction whose evictor died.  Fields
 *      are reset by the next allocator, never by the evictor, so a slow
 *      helper cannot clobber a reused slot.
 *  S4  a shard is claimed by CAS(writer[s]: 0 -> entry+1), then the writing
 *      bit is set; it is released in the opposite order.  The writer field
 *      is what the reaper matches against a dead entry.
 *
 * The Dekker pair: a joining writer sets its writing bit (seq_cst) and
 * then reads the state (seq_cst); whoever dooms a slot CASes the state
 * (seq_cst) and then reads the writing mask (seq_cst).  At least one of
 * them sees the other: either the writer sees DOOMED and backs out, or the
 * doomer sees the bit and leaves the reclaim to that writer, who finds
 * DOOMED at its write_end and, being last out, reclaims.
 *
 * Process death: a dead writer's bits are cleared by the reaper (which
 * dooms the slot); a death during an allocation's setup (between the
 * FREE -> FILLING CAS, which writes the allocator into the state word, and
 * the end of kvt_write_begin, which clears it) is found by the reaper
 * through that field; a slot whose writers all left without completing the
 * mask is doomed by the CLOCK sweep after fill_timeout_ms.
 */
#include <errno.h>
#include <sched.h>
#include <string.h>

#include "kvt_format.h"


static kvt_a64 *my_journal(kvt_seg *s)
{
	return &s->ents[s->entry].journal;
}

/* Completes an eviction (S3) or reclaims a drained DOOMED slot. */
void kvt__slot_reclaim(kvt_seg *s, uint32_t x)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t w = kat_load(&sl->state, KVT_SC);

	if (KVT_ST(w) == KVT_S_DOOMED) {
		/* Seq_cst read of the mask: the Dekker partner of a joining
		 * writer's fetch_or (see the essay). */
		if (kat_load(&sl->writing, KVT_SC) != 0)
			return;
		if (!kat_cas(&sl->state, &w, KVT_SW(KVT_S_EVICTING, KVT_GEN(w), 0), KVT_SC))
			return; /* someone else moved it on */
		w = KVT_SW(KVT_S_EVICTING, KVT_GEN(w), 0);
	}
	if (KVT_ST(w) != KVT_S_EVICTING)
		return;
	kvt__index_remove(s, x, KVT_GEN(w));
	/* R3: release pairs with the allocator's acquire CAS on FREE (A4):
	 * the index removal is done before the slot can be reused. */
	kat_cas(&sl->state, &w, KVT_SW(KVT_S_FREE, (KVT_GEN(w) + 1) & KVT_GEN_MASK, 0), KVT_AR);
}

/* Moves FILLING|gen to DOOMED and reclaims it if no writer is left. */
void kvt__slot_doom(kvt_seg *s, uint32_t x, uint64_t gen)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t w = kat_load(&sl->state, KVT_SC);

	while (KVT_ST(w) == KVT_S_FILLING && KVT_GEN(w) == gen) {
		if (kat_cas(&sl->state, &w, KVT_SW(KVT_S_DOOMED, gen, 0), KVT_SC))
			break;
	}
	kvt__slot_reclaim(s, x);
}

/* Releases shard `shard` of slot x held by entry e (S4 order). */
static void shard_release(kvt_seg *s, uint32_t x, uint32_t shard, uint32_t e)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint16_t me = (uint16_t)(e + 1);

	kat_cas(&sl->writer[shard], &me, 0, KVT_AR);
	/* Release: our payload writes (on commit) or nothing (abort) come
	 * before the bit disappears; seq_cst for the Dekker pair. */
	kat_and(&sl->writing, ~(1ULL << shard), KVT_SC);
}

void kvt__slot_writer_gone(kvt_seg *s, uint32_t x, uint32_t e)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t w = kat_load(&sl->state, KVT_SC);
	int had = 0;

	for (uint32_t sh = 0; sh < s->d.n_shards; sh++) {
		if (kat_load(&sl->writer[sh], KVT_ACQ) == (uint16_t)(e + 1)) {
			shard_release(s, x, sh, e);
			had = 1;
		}
	}
	if (had && (KVT_ST(w) == KVT_S_FILLING || KVT_ST(w) == KVT_S_DOOMED)) {
		kvt__count(s, KVT_C_FILL_ABORTS, 1);
		kvt__slot_doom(s, x, KVT_GEN(w));
	}
}

int kvt__slot_unpin(kvt_seg *s, uint32_t x, uint64_t gen32)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t w = kat_load(&sl->state, KVT_RLX);
	int spins = 0;

	for (;;) {
		if ((KVT_GEN(w) & 0xffffffffULL) != gen32 || KVT_ST(w) != KVT_S_READY)
			return -ESTALE;
		if (w & KVT_ST_FROZEN) {
			/* A reaper is recounting this slot's pins: tell it we have
			 * not unpinned yet, and wait (see leases.c). */
			if (s->entry != UINT32_MAX)
				kat_or(my_journal(s), KVT_J_BLOCKED, KVT_SC);
			if (++spins > 64)
				sched_yield();
			w = kat_load(&sl->state, KVT_ACQ);
			continue;
		}
		if (s->entry != UINT32_MAX && spins)
			kat_and(my_journal(s), ~KVT_J_BLOCKED, KVT_SC);
		if (KVT_PINS(w) == 0)
			return -EUCLEAN;
		/* R4: release orders our reads of the payload (a load) before
		 * the eviction that may follow (the evictor's CAS is acq). */
		if (kat_cas(&sl->state, &w, w - KVT_PIN_ONE, KVT_AR))
			return 0;
	}
}

/* Cold = READY, unpinned, not frozen, no reference left. */
static int slot_cold(const struct kvt_slot *sl, uint64_t w)
{
	return KVT_ST(w) == KVT_S_READY && !KVT_PINS(w) && !(w & KVT_ST_FROZEN) &&
	       kat_load(&sl->ref, KVT_RLX) == 0;
}

/* Takes a FREE slot for us: FREE|g -> FILLING|g|owner = us. */
static int slot_take(kvt_seg *s, uint32_t x, uint64_t w, uint32_t *xo, uint64_t *geno)
{
	struct kvt_slot *sl = kvt__slot(s, x);

	/* A4: acquire pairs with R3: the previous life of the slot is over
	 * before we write its fields. */
	if (KVT_ST(w) != KVT_S_FREE ||
	    !kat_cas(&sl->state, &w, KVT_SW(KVT_S_FILLING, KVT_GEN(w), s->entry + 1), KVT_AR))
		return 0;
	*xo = x;
	*geno = KVT_GEN(w);
	return 1;
}

/* CLOCK sweep, one slot per step of the shared hand (the classic policy:
 * only the slots the hand passes lose a reference, so a chunk hit since
 * the last pass survives the next one -- two reference levels give it two).
 *
 * Prefix-depth preference (segments created with KVT_SEG_F_DEPTH_FIRST):
 * at a cold chunk, the next 8 slots are looked at without aging them, and
 * the deepest cold chunk among them goes (evicting chunk i makes i+1..
 * unreachable, so the tail should lose least).  It is off by default
 * because it loses on real traffic: on the Mooncake conversation trace
 * (kvtier-bench replay) the plain CLOCK hits 8.85% / 26.95% of asked
 * chunks at 4096 / 16384 slots, the depth-first one 7.47% / 23.44% (LRU:
 * 8.79% / 26.56%).  A chunk's prefix is always at least as hot as the
 * chunk (every hit on i hits 0..i-1), so CLOCK already keeps heads; the
 * preference mostly gives shallow cold chunks an extra lap.
 *
 * Returns a slot moved FREE -> FILLING|owner = us, or -ENOSPC after three
 * full turns (two reference levels) found nothing. */
static int slot_alloc(kvt_seg *s, uint32_t *xo, uint64_t *geno)
{
	uint32_t n = s->geo.n_slots;
	uint64_t budget = 3ULL * n + 1, now = 0;
	uint64_t timeout_ns = (uint64_t)s->geo.fill_timeout_ms * 1000000ULL;

	while (budget--) {
		/* Relaxed: the hand is only a cursor; slots are claimed by CAS. */
		uint64_t h = kat_fadd(&s->hdr->clock_hand, 1, KVT_RLX);
		uint32_t x = (uint32_t)(h % n);
		struct kvt_slot *sl = kvt__slot(s, x);
		uint64_t w = kat_load(&sl->state, KVT_ACQ);

		switch (KVT_ST(w)) {
		case KVT_S_EVICTING:
		case KVT_S_DOOMED:
			kvt__slot_reclaim(s, x);
			w = kat_load(&sl->state, KVT_ACQ);
			if (slot_take(s, x, w, xo, geno))
				return 0;
			break;
		case KVT_S_FREE:
			if (slot_take(s, x, w, xo, geno))
				return 0;
			break;
		case KVT_S_FILLING:
			if (KVT_FILL_OWNER(w) || kat_load(&sl->writing, KVT_SC) != 0 ||
			    (w & KVT_ST_FROZEN))
				break; /* being set up, or being written */
			if (!now)
				now = kvt__now_ns();
			if (now - kat_load(&sl->fill_ns, KVT_RLX) > timeout_ns &&
			    kat_load(&sl->fill_ns, KVT_RLX) < now) {
				kvt__count(s, KVT_C_FILL_TIMEOUTS, 1);
				kvt__slot_doom(s, x, KVT_GEN(w));
			}
			break;
		case KVT_S_READY: {
			if (KVT_PINS(w) || (w & KVT_ST_FROZEN))
				break;
			/* Relaxed: reference counts are a heuristic; a lost
			 * update only changes which chunk goes first. */
			uint32_t ref = kat_load(&sl->ref, KVT_RLX);
			if (ref) {
				kat_store(&sl->ref, ref - 1, KVT_RLX);
				break;
			}
			uint32_t best = x, best_depth = kat_load(&sl->depth, KVT_RLX);
			uint64_t best_w = w;
			for (uint32_t k = 1; k <= s->sweep_peek && k < n; k++) {
				uint32_t y = (uint32_t)((h + k) % n);
				struct kvt_slot *sy = kvt__slot(s, y);
				uint64_t wy = kat_load(&sy->state, KVT_ACQ);
				uint32_t d = kat_load(&sy->depth, KVT_RLX);
				if (slot_cold(sy, wy) && d > best_depth) {
					best = y;
					best_depth = d;
					best_w = wy;
				}
			}
			struct kvt_slot *sb = kvt__slot(s, best);
			/* A5: acquire pairs with the unpinners' R4. */
			if (kat_cas(&sb->state, &best_w, KVT_SW(KVT_S_EVICTING, KVT_GEN(best_w), 0),
				    KVT_AR)) {
				kvt__count(s, KVT_C_EVICTIONS, 1);
				kvt__slot_reclaim(s, best);
				if (slot_take(s, best, kat_load(&sb->state, KVT_ACQ), xo, geno))
					return 0;
			}
			break;
		}
		default:
			break;
		}
	}
	return -ENOSPC;
}

/* Claims shard `shard` of a live slot found in the index.  0: claimed;
 * KVT_SKIP: ready or being written; -EAGAIN: the slot moved on. */
static int shard_join(kvt_seg *s, uint32_t x, uint64_t gen, uint32_t shard)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t bit = 1ULL << shard, w;
	uint16_t zero = 0;

	if (kat_load(&sl->ready, KVT_ACQ) & bit)
		return KVT_SKIP;
	if (!kat_cas(&sl->writer[shard], &zero, (uint16_t)(s->entry + 1), KVT_AR))
		return KVT_SKIP; /* someone is writing this shard */
	kat_or(&sl->writing, bit, KVT_SC);
	w = kat_load(&sl->state, KVT_SC); /* Dekker partner of slot_doom */
	if (KVT_ST(w) != KVT_S_FILLING || KVT_GEN(w) != gen) {
		shard_release(s, x, shard, s->entry);
		kvt__slot_reclaim(s, x);
		return KVT_ST(w) == KVT_S_READY && KVT_GEN(w) == gen ? KVT_SKIP : -EAGAIN;
	}
	if (kat_load(&sl->ready, KVT_ACQ) & bit) {
		shard_release(s, x, shard, s->entry);
		return KVT_SKIP;
	}
	return 0;
}

int kvt_write_begin(kvt_seg *s, const kvt_key *key, uint32_t depth,
		    uint32_t shard, struct kvt_wref *wr)
{
	uint32_t b1, b2, tag, x;
	uint64_t gen;
	int r;

	if (s->entry == UINT32_MAX)
		return kvt__err(-EPERM, "write: an observer handle cannot write");
	if (shard >= s->d.n_shards)
		return kvt__err(-EINVAL, "write: shard %u out of range (%u shards)",
				shard, s->d.n_shards);
	kvt__key_hash(s, key, &b1, &b2, &tag);
	for (int tries = 0; tries < 1000; tries++) {
		if (kvt__index_find(s, key, &gen, &x, 1)) {
			r = shard_join(s, x, gen, shard);
			if (r == -EAGAIN)
				continue;
			if (r == KVT_SKIP) {
				kvt__count(s, KVT_C_SAVE_SKIPS, 1);
				return KVT_SKIP;
			}
			goto claimed;
		}
		r = slot_alloc(s, &x, &gen);
		if (r) {
			kvt__count(s, KVT_C_SAVE_NOSPC, 1);
			return kvt__err(-ENOSPC, "write: no slot can be freed (all pinned or "
					"being written)");
		}
		struct kvt_slot *sl = kvt__slot(s, x);
		/* Fields of the new life (S3: only the allocator resets them). */
		kat_store(&sl->key_lo, key->lo, KVT_RLX);
		kat_store(&sl->key_hi, key->hi, KVT_RLX);
		kat_store(&sl->depth, depth, KVT_RLX);
		kat_store(&sl->tag, tag, KVT_RLX);
		kat_store(&sl->owner, s->entry + 1, KVT_RLX);
		kat_store(&sl->fill_ns, kvt__now_ns(), KVT_RLX);
		kat_store(&sl->ref, 1, KVT_RLX);
		kat_store(&sl->ready, 0, KVT_RLX);
		for (uint32_t i = 0; i < s->d.n_shards; i++)
			kat_store(&sl->writer[i], 0, KVT_RLX);
		kat_store(&sl->writer[shard], (uint16_t)(s->entry + 1), KVT_RLX);
		kat_store(&sl->writing, 1ULL << shard, KVT_SC);

		uint32_t ex;
		uint64_t exgen;
		/* The entry CAS inside is a release: the fields above are
		 * visible to whoever finds the entry (A1). */
		r = kvt__index_insert(s, key, x, gen, &ex, &exgen);
		if (r == 0) {
			/* Setup done: from here the reaper finds us through
			 * writer[], like any writer. */
			uint64_t w = KVT_SW(KVT_S_FILLING, gen, s->entry + 1);
			kat_cas(&sl->state, &w, KVT_SW(KVT_S_FILLING, gen, 0), KVT_AR);
			goto claimed;
		}
		/* Lost the race for the key (r == 1) or the index is full:
		 * the slot was never visible, so it goes straight back. */
		kat_store(&sl->writer[shard], 0, KVT_RLX);
		kat_store(&sl->writing, 0, KVT_SC);
		uint64_t w = KVT_SW(KVT_S_FILLING, gen, s->entry + 1);
		kat_cas(&sl->state, &w, KVT_SW(KVT_S_FREE, (gen + 1) & KVT_GEN_MASK, 0), KVT_AR);
		if (r < 0) {
			kvt__count(s, KVT_C_INDEX_FULL, 1);
			kvt__count(s, KVT_C_SAVE_NOSPC, 1);
			return kvt__err(-ENOSPC, "write: the index buckets of this key are full");
		}
	}
	return kvt__err(-EAGAIN, "write: contention did not settle");
claimed:
	wr->slot = x;
	wr->shard = shard;
	wr->gen = gen;
	return 0;
}

int kvt_write_end(kvt_seg *s, const struct kvt_wref *wr, int ok)
{
	struct kvt_slot *sl;
	uint64_t bit, full, prev, w;
	int ret = 0;

	if (s->entry == UINT32_MAX || wr->slot >= s->geo.n_slots ||
	    wr->shard >= s->d.n_shards)
		return kvt__err(-EINVAL, "write_end: bad write reference");
	sl = kvt__slot(s, wr->slot);
	if (kat_load(&sl->writer[wr->shard], KVT_ACQ) != (uint16_t)(s->entry + 1))
		return kvt__err(-EINVAL, "write_end: slot %u shard %u is not claimed by "
				"this handle", wr->slot, wr->shard);
	bit = 1ULL << wr->shard;
	full = kvt__full_mask(s->d.n_shards);
	w = kat_load(&sl->state, KVT_ACQ);
	if (ok && KVT_ST(w) == KVT_S_FILLING && KVT_GEN(w) == wr->gen) {
		/* R5: release publishes our shard's payload; acquire takes the
		 * other writers' (their R5), so whoever completes the mask
		 * publishes all shards with the READY CAS below. */
		prev = kat_or(&sl->ready, bit, KVT_AR);
		if ((prev | bit) == full && !(prev & bit)) {
			/* R6: pairs with A2 in the index lookup. */
			if (kat_cas(&sl->state, &w, KVT_SW(KVT_S_READY, wr->gen, 0), KVT_AR))
				ret = 1;
			else
				ret = -ESTALE;
		}
		if (ret >= 0) {
			kvt__count(s, KVT_C_SAVED_CHUNKS, 1);
			kvt__count(s, KVT_C_BYTES_SAVED, s->chunk_bytes);
		}
	} else if (ok) {
		ret = -ESTALE;
	} else {
		kvt__count(s, KVT_C_FILL_ABORTS, 1);
	}
	shard_release(s, wr->slot, wr->shard, s->entry);
	w = kat_load(&sl->state, KVT_SC);
	if (KVT_GEN(w) == wr->gen) {
		if (KVT_ST(w) == KVT_S_FILLING && (!ok || ret < 0) &&
		    kat_load(&sl->ready, KVT_ACQ) == 0 && kat_load(&sl->writing, KVT_SC) == 0)
			kvt__slot_doom(s, wr->slot, wr->gen); /* nothing of it was written */
		else if (KVT_ST(w) == KVT_S_DOOMED)
			kvt__slot_reclaim(s, wr->slot);  /* last one out */
	}
	if (ret == -ESTALE)
		return kvt__err(-ESTALE, "write_end: slot %u was reclaimed while being "
				"written (a writer died or it timed out)", wr->slot);
	return ret;
}
