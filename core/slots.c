/* slots.c - slot states, shard claims, allocation and the CLOCK sweep.
 *
 * State word (one 64-bit CAS): [gen 40][pins 20][frozen][state 3].
 *
 *   FREE --alloc--> FILLING --all shards ready--> READY --claim--> EVICTING
 *    ^                 |                            | pins == 0       |
 *    |                 | writer died, aborted or    +- pin/unpin      |
 *    |                 | abandoned (fill timeout)                     |
 *    |                 v                                              |
 *    |              DOOMED --no claim of this life--> EVICTING -------+
 *    +----------- no claim of this life, index entries removed, gen + 1
 *
 * Shard claims.  A writer claims shard s of slot x in life g by CAS of the
 * claim word claim[s]: (anything not live in g) -> CLAIM(g, entry).  The
 * claim is live in life g only; a claim word of an older life is garbage
 * that the next claimer overwrites, and a writer of an older life can only
 * ever CAS its own exact word (gen included) back to 0.  So no process can
 * clear or take over a claim of a life it does not belong to.
 *
 * (Layout 1 had a writer field per shard and one writing mask per slot,
 * neither tagged with the life: a writer preempted between its READY CAS
 * and its release, or in a join's back-out, cleared the mask bit of the
 * next life's writer of the same shard, and a slot was then reclaimed
 * under that writer's copy, which landed in the next chunk.  The Promela
 * model tests/model/slot.pml shows it with -DLAYOUT1.)
 *
 * Invariants:
 *  S1  pins > 0 only in READY; a pin is CAS(READY|g|p -> READY|g|p+1) and
 *      the evictor's claim is CAS(READY|g|0 -> EVICTING|g), so a pinned
 *      slot is never evicted and an evicted slot is never pinned.
 *  S2  a slot leaves life g (EVICTING|g -> FREE|g+1) only after a scan
 *      found no live claim of life g, made after the slot was DOOMED or
 *      EVICTING; a claim made after that scan sees DOOMED/EVICTING/another
 *      life in its re-check and writes nothing (the Dekker pair below).  A
 *      writer holding a claim therefore always writes into the life it
 *      claimed: no copy lands in a reused slot.  DOOMED is final (it never
 *      becomes READY) and so is EVICTING.
 *  S3  completing an eviction (remove the index entries naming (slot, gen),
 *      then CAS EVICTING|g -> FREE|g+1) is idempotent, so any process may
 *      finish one whose evictor died or whose last writer left.  Fields are
 *      reset by the next allocator, never by the evictor.
 *  S4  the ready mask is written only by holders of a live claim (their
 *      own bit) and reset by the allocator before the slot is published; a
 *      chunk is READY exactly when every shard's bit is set in its life.
 *  S5  no slot is doomed while a writer's copy into it is in flight (a
 *      claim made after the abandon decision backs out; see (b)).
 *
 * The Dekker pairs.  (a) Reclaim: a joining writer CASes its claim
 * (seq_cst) and then CASes the state (seq_cst, below); whoever evicts or
 * reclaims CASes the state (seq_cst) and then reads every claim (seq_cst).
 * At least one sees the other: either the writer finds DOOMED/EVICTING and
 * backs out, or the reclaimer sees the claim and leaves the reclaim to
 * that writer, who finds DOOMED/EVICTING when it drops its claim and,
 * being last out, reclaims.  Two last-out writers may both try; the CASes
 * decide.  (b) Doom (S5): a FILLING slot is doomed -- abandoned: a writer
 * aborted with nothing written, the fill timeout, a dead writer -- only by
 * kvt__slot_abandon, which reads the state word, scans the claims, and
 * CASes the word it read to DOOMED; a joiner, after its claim, bumps the
 * join version in that word (its CAS doubles as its re-check of the
 * state).  Whichever CAS comes second fails: a join after the scan makes
 * the doom fail, a doom first makes the join back out before any copy.
 * So a slot is never doomed under a live writer's copy, and write_end
 * never returns -ESTALE unless the segment is damaged (layout 1 dooms
 * could race a joiner: its copy was thrown away, safely, but for
 * nothing).
 *
 * Orderings: R3 (EVICTING -> FREE, release) pairs with A4 (the allocator's
 * FREE -> FILLING, acquire).  The allocator then writes the key of the new
 * life with release stores (R12), read with acquire loads by the index's
 * finders (A12, index.c) before they re-read the state: a finder that saw
 * the new life's key then sees the new life's state word, and rejects what
 * it read.  That is the seqlock rule of C11 (layout 1 used relaxed key
 * loads before an acquire re-read, which C11 and aarch64 allow to be
 * satisfied from a newer life); acquire/release on the two key words
 * rather than fences because ThreadSanitizer models them (it refuses
 * atomic_thread_fence) and x86 pays nothing for either.  R5/R6: the ready
 * bits and the READY CAS publish the payload to lookups (A2 in index.c).
 *
 * Process death: a dead writer's claims are dropped by the reaper (which
 * abandons a FILLING slot it held if no live writer is left on it, and
 * reclaims a DOOMED/EVICTING one); a death during an allocation's setup
 * (between the FREE -> FILLING CAS, which writes the allocator into the
 * state word, and the end of kvt_write_begin, which clears it) is found by
 * the reaper through that field; a slot whose writers all left without
 * completing the mask is doomed by the CLOCK sweep after fill_timeout_ms.  Whether a writer is
 * dead is its entry's liveness lock (ranks.c), never a pid.
 */
#include <errno.h>
#include <sched.h>
#include <string.h>

#include "kvt_format.h"

static int claim_live(uint64_t c, uint64_t gen)
{
	return KVT_CLAIM_ENT(c) != 0 && KVT_CLAIM_GEN(c) == (gen & KVT_GEN_MASK);
}

int kvt__claims_drained(const kvt_seg *s, struct kvt_slot *sl, uint64_t gen)
{
	/* Seq_cst: the reclaimer's half of the Dekker pair. */
	for (uint32_t sh = 0; sh < s->d.n_shards; sh++)
		if (claim_live(kat_load(&sl->claim[sh], KVT_SC), gen))
			return 0;
	return 1;
}

/* Whether claim c belongs to a life after gen (modulo 2^40): the slot has
 * moved on, and a writer of life gen must not touch the word. */
static int claim_newer(uint64_t c, uint64_t gen)
{
	uint64_t d = (KVT_CLAIM_GEN(c) - gen) & KVT_GEN_MASK;

	return c != 0 && d != 0 && d < (KVT_GEN_MASK >> 1);
}

/* Claims shard sh of sl in life gen for our entry: 0; KVT_SKIP when a live
 * claim of that life holds it; -EAGAIN when the word belongs to a later
 * life (we are a stale writer: the slot moved on).  Only free words and
 * older lives' garbage are overwritten, so a stale writer can never take
 * over -- and later drop -- the claim of a newer life's writer. */
static int claim_take(kvt_seg *s, struct kvt_slot *sl, uint32_t sh, uint64_t gen)
{
	uint64_t c = kat_load(&sl->claim[sh], KVT_RLX);
	uint64_t mine = KVT_CLAIM(gen, s->entry);

	for (;;) {
		if (claim_live(c, gen))
			return KVT_SKIP;
		if (claim_newer(c, gen))
			return -EAGAIN;
		/* Seq_cst: the writer's half of the Dekker pair. */
		if (kat_cas(&sl->claim[sh], &c, mine, KVT_SC))
			return 0;
	}
}

/* Gives back our claim of life gen.  Seq_cst (release included): our
 * payload writes come before the claim disappears, and a reclaimer's
 * seq_cst scan that sees it gone sees them. */
static int claim_drop(kvt_seg *s, struct kvt_slot *sl, uint32_t sh, uint64_t gen)
{
	uint64_t c = KVT_CLAIM(gen, s->entry);

	return kat_cas(&sl->claim[sh], &c, 0, KVT_SC);
}

/* Moves DOOMED|gen on to EVICTING and completes EVICTING|gen (S3), each
 * step only once no claim of life gen is left (S2). */
void kvt__slot_reclaim(kvt_seg *s, uint32_t x, uint64_t gen)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t w = kat_load(&sl->state, KVT_SC);

	if (KVT_GEN(w) != (gen & KVT_GEN_MASK))
		return;
	if (KVT_ST(w) == KVT_S_DOOMED) {
		if (!kvt__claims_drained(s, sl, gen))
			return; /* the last writer out reclaims */
		KVT_SP(RECLAIM_DRAINED, s);
		if (!kat_cas(&sl->state, &w, KVT_SW(KVT_S_EVICTING, KVT_GEN(w), 0), KVT_SC))
			return; /* someone else moved it on */
		w = KVT_SW(KVT_S_EVICTING, KVT_GEN(w), 0);
	}
	if (KVT_ST(w) != KVT_S_EVICTING)
		return;
	/* An evicted READY chunk may still have the writer that completed it
	 * between its READY CAS and its claim drop. */
	if (!kvt__claims_drained(s, sl, gen))
		return;
	KVT_SP(RECLAIM_DRAINED, s);
	kvt__index_remove(s, x, KVT_GEN(w));
	KVT_SP(RECLAIM_UNINDEXED, s);
	/* R3: release pairs with the allocator's acquire CAS on FREE (A4):
	 * the index removal is done before the slot can be reused. */
	kat_cas(&sl->state, &w, KVT_SW(KVT_S_FREE, (KVT_GEN(w) + 1) & KVT_GEN_MASK, 0), KVT_AR);
}

/* Dooms FILLING|gen when no claim of that life is left (S5, Dekker pair
 * (b)) and reclaims it.  `dead_owner` (entry + 1, or 0): the allocator
 * that died during setup; its mark is cleared first, so that the sweeper
 * can take the slot later if writers remain.  A slot still being set up
 * by a live allocator, or still claimed, is left alone.  Returns 1 when
 * it doomed the slot. */
int kvt__slot_abandon(kvt_seg *s, uint32_t x, uint64_t gen, uint32_t dead_owner)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t w = kat_load(&sl->state, KVT_SC);

	while (KVT_ST(w) == KVT_S_FILLING && KVT_GEN(w) == gen) {
		if (dead_owner && KVT_FILL_OWNER(w) == dead_owner) {
			kat_cas(&sl->state, &w, w & ~KVT_FILL_OWNER_MASK, KVT_SC);
			continue;
		}
		if (KVT_FILL_OWNER(w) || !kvt__claims_drained(s, sl, gen))
			return 0;
		/* Seq_cst: the doomer's half of the pair; fails if a writer
		 * joined since we read w. */
		if (kat_cas(&sl->state, &w, KVT_SW(KVT_S_DOOMED, gen, 0), KVT_SC)) {
			KVT_SP(DOOMED, s);
			kvt__slot_reclaim(s, x, gen);
			return 1;
		}
	}
	return 0;
}

/* Drops every claim entry e holds on slot x (the reaper, for a dead e; a
 * detaching handle, for itself) and moves the slot on. */
int kvt__slot_writer_gone(kvt_seg *s, uint32_t x, uint32_t e)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t w = kat_load(&sl->state, KVT_SC);
	int had = 0;

	for (uint32_t sh = 0; sh < s->d.n_shards; sh++) {
		uint64_t c = kat_load(&sl->claim[sh], KVT_ACQ);
		if (KVT_CLAIM_ENT(c) != e + 1)
			continue;
		/* An exact-word CAS: a claim of any life that e holds (an older
		 * life's is garbage, collected here). */
		if (kat_cas(&sl->claim[sh], &c, 0, KVT_SC) && KVT_CLAIM_GEN(c) == KVT_GEN(w))
			had = 1;
	}
	if (!had)
		return 0;
	if (KVT_ST(w) == KVT_S_FILLING) {
		/* Its shard will not come from it; live co-writers keep the
		 * slot (it completes if the shard is written again, else the
		 * fill timeout takes it). */
		kvt__count(s, KVT_C_FILL_ABORTS, 1);
		kvt__slot_abandon(s, x, KVT_GEN(w), 0);
	} else if (KVT_ST(w) == KVT_S_DOOMED || KVT_ST(w) == KVT_S_EVICTING) {
		kvt__slot_reclaim(s, x, KVT_GEN(w));
	}
	return 1;
}

int kvt__slot_unpin(kvt_seg *s, uint32_t x, uint64_t gen32)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t w = kat_load(&sl->state, KVT_RLX), deadline = 0;
	unsigned spins = 0;
	int blocked = 0;

	for (;;) {
		if ((KVT_GEN(w) & 0xffffffffULL) != gen32 || KVT_ST(w) != KVT_S_READY)
			return -ESTALE;
		if (w & KVT_ST_FROZEN) {
			/* A pin repair recounts this slot's pins: tell it we have
			 * not unpinned yet (so it does not wait for us), then
			 * wait for a live freezer or finish a dead one's repair
			 * ourselves (leases.c). */
			if (!blocked) {
				kat_or(kvt__journal(s), KVT_J_BLOCKED, KVT_SC);
				blocked = 1;
				KVT_SP(UNPIN_FROZEN, s);
			}
			uint32_t f = KVT_FREEZER(w);
			if (!deadline)
				deadline = kvt__now_ns() + KVT_LIVE_WAIT_NS;
			/* a dead freezer's repair adopted at once; a live one's
			 * past the deadline (stopped mid-repair: its own last
			 * CAS then fails) */
			if ((spins++ & 63) == 0 &&
			    (f == 0 || f - 1 == s->entry || !kvt__entry_alive(s, f - 1) ||
			     kvt__now_ns() > deadline)) {
				kvt__pins_adopt(s, x, w);
			} else if (spins > 64) {
				sched_yield();
			} else {
				kat_relax();
			}
			w = kat_load(&sl->state, KVT_ACQ);
			continue;
		}
		if (blocked) {
			kat_and(kvt__journal(s), ~KVT_J_BLOCKED, KVT_SC);
			blocked = 0;
		}
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
	KVT_SP(ALLOC_TAKEN, s);
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
			kvt__slot_reclaim(s, x, KVT_GEN(w));
			w = kat_load(&sl->state, KVT_ACQ);
			if (slot_take(s, x, w, xo, geno))
				return 0;
			break;
		case KVT_S_FREE:
			if (slot_take(s, x, w, xo, geno))
				return 0;
			break;
		case KVT_S_FILLING:
			if (KVT_FILL_OWNER(w) || (w & KVT_ST_FROZEN) ||
			    !kvt__claims_drained(s, sl, KVT_GEN(w)))
				break; /* being set up, or being written */
			if (!now)
				now = kvt__now_ns();
			if (now - kat_load(&sl->fill_ns, KVT_RLX) > timeout_ns &&
			    kat_load(&sl->fill_ns, KVT_RLX) < now &&
			    kvt__slot_abandon(s, x, KVT_GEN(w), 0))
				kvt__count(s, KVT_C_FILL_TIMEOUTS, 1);
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
			/* A5: acquire pairs with the unpinners' R4; seq_cst for
			 * the Dekker pair with a writer still holding a claim. */
			if (kat_cas(&sb->state, &best_w, KVT_SW(KVT_S_EVICTING, KVT_GEN(best_w), 0),
				    KVT_SC)) {
				kvt__count(s, KVT_C_EVICTIONS, 1);
				KVT_SP(EVICT_CLAIMED, s);
				kvt__slot_reclaim(s, best, KVT_GEN(best_w));
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

/* Claims shard `shard` of a FILLING slot found in the index in life gen.
 * 0: claimed; KVT_SKIP: ready or being written; -EAGAIN: the slot moved
 * on. */
static int shard_join(kvt_seg *s, uint32_t x, uint64_t gen, uint32_t shard)
{
	struct kvt_slot *sl = kvt__slot(s, x);
	uint64_t w;
	int r;

	KVT_SP(JOIN_FOUND, s);
	r = claim_take(s, sl, shard, gen);
	if (r)
		return r; /* someone is writing this shard, or the slot moved on */
	KVT_SP(JOIN_CLAIMED, s);
	/* The re-check is a CAS that bumps the join version: the Dekker
	 * partner of reclaim (a) and of abandon (b), see the essay. */
	w = kat_load(&sl->state, KVT_SC);
	for (;;) {
		if (KVT_ST(w) != KVT_S_FILLING || KVT_GEN(w) != gen) {
			KVT_SP(JOIN_BACKOUT, s);
			claim_drop(s, sl, shard, gen);
			kvt__slot_reclaim(s, x, gen); /* we may be the last one out */
			return KVT_ST(w) == KVT_S_READY && KVT_GEN(w) == gen ? KVT_SKIP : -EAGAIN;
		}
		uint64_t nw = (w & ~KVT_JOIN_MASK) | ((w + KVT_JOIN_ONE) & KVT_JOIN_MASK);
		if (kat_cas(&sl->state, &w, nw, KVT_SC))
			break;
	}
	/* Our claim holds the life: this ready mask is life gen's. */
	if (kat_load(&sl->ready, KVT_ACQ) & (1ULL << shard)) {
		claim_drop(s, sl, shard, gen);
		/* The chunk may have become READY and been evicted while we
		 * held the claim: then we are the last one out. */
		kvt__slot_reclaim(s, x, gen);
		return KVT_SKIP;
	}
	return 0;
}

int kvt_write_begin(kvt_seg *s, const kvt_key *key, uint32_t depth,
		    uint32_t shard, struct kvt_wref *wr)
{
	uint32_t b1, b2, tag, x;
	uint64_t gen, st;
	int r;

	if ((r = kvt__need_entry(s, "write")))
		return r;
	if (!key || !wr)
		return kvt__err(-EINVAL, "write: NULL argument");
	if (shard >= s->d.n_shards)
		return kvt__err(-EINVAL, "write: shard %u out of range (%u shards)",
				shard, s->d.n_shards);
	kvt__key_hash(s, key, &b1, &b2, &tag);
	for (int tries = 0; tries < 1000; tries++) {
		if (kvt__index_find(s, key, &gen, &x, 1, &st)) {
			r = KVT_ST(st) == KVT_S_READY ? KVT_SKIP : shard_join(s, x, gen, shard);
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
		/* Fields of the new life (S3: only the allocator resets them).
		 * R12: release, so that a finder that reads this key (A12) then
		 * sees our state word (the seqlock rule, see the essay). */
		kat_store(&sl->key_lo, key->lo, KVT_REL);
		kat_store(&sl->key_hi, key->hi, KVT_REL);
		kat_store(&sl->depth, depth, KVT_RLX);
		kat_store(&sl->tag, tag, KVT_RLX);
		kat_store(&sl->owner, s->entry + 1, KVT_RLX);
		kat_store(&sl->fill_ns, kvt__now_ns(), KVT_RLX);
		kat_store(&sl->ref, 1, KVT_RLX);
		kat_store(&sl->ready, 0, KVT_RLX);
		/* No writer of this life can claim before the index entry
		 * exists.  A stale writer of an older life may CAS this word
		 * (an older life's garbage) just before our store, which then
		 * overwrites it: its re-check sees our life and it backs out;
		 * after our store it sees a newer life's claim and leaves it.
		 * The other shards' words may hold older lives' garbage. */
		kat_store(&sl->claim[shard], KVT_CLAIM(gen, s->entry), KVT_SC);
		KVT_SP(ALLOC_SETUP, s);

		uint32_t ex;
		uint64_t exgen;
		/* The entry CAS inside is a release: the fields above are
		 * visible to whoever finds the entry (A1). */
		r = kvt__index_insert(s, key, x, gen, &ex, &exgen);
		if (r == 0) {
			KVT_SP(ALLOC_INSERTED, s);
			/* Setup done: from here the reaper finds us through our
			 * claim, like any writer.  Joiners may have bumped the
			 * join version already: clear our mark only. */
			uint64_t w = kat_load(&sl->state, KVT_ACQ);
			while (KVT_ST(w) == KVT_S_FILLING && KVT_GEN(w) == gen &&
			       KVT_FILL_OWNER(w) == s->entry + 1 &&
			       !kat_cas(&sl->state, &w, w & ~KVT_FILL_OWNER_MASK, KVT_AR))
				;
			goto claimed;
		}
		/* Lost the race for the key (r == 1) or the index is full:
		 * the slot was never visible, so it goes straight back. */
		kat_store(&sl->claim[shard], 0, KVT_RLX);
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
	int r, ret = 0;

	if ((r = kvt__need_entry(s, "write_end")))
		return r;
	if (!wr || wr->slot >= s->geo.n_slots || wr->shard >= s->d.n_shards)
		return kvt__err(-EINVAL, "write_end: bad write reference");
	sl = kvt__slot(s, wr->slot);
	if (kat_load(&sl->claim[wr->shard], KVT_ACQ) != KVT_CLAIM(wr->gen, s->entry)) {
		/* Our claim holds until we drop it; only a reaper that took us
		 * for dead, or a reference we never got, ends here. */
		kvt__count(s, KVT_C_LOST_CLAIMS, 1);
		return kvt__err(-EINVAL, "write_end: slot %u shard %u is not claimed by "
				"this handle in generation %llu", wr->slot, wr->shard,
				(unsigned long long)wr->gen);
	}
	bit = 1ULL << wr->shard;
	full = kvt__full_mask(s->d.n_shards);
	w = kat_load(&sl->state, KVT_ACQ);
	if (ok && KVT_ST(w) == KVT_S_FILLING && KVT_GEN(w) == wr->gen) {
		/* R5: release publishes our shard's payload; acquire takes the
		 * other writers' (their R5), so whoever completes the mask
		 * publishes all shards with the READY CAS below. */
		prev = kat_or(&sl->ready, bit, KVT_AR);
		KVT_SP(WEND_READY_BIT, s);
		if ((prev | bit) == full && !(prev & bit)) {
			ret = -ESTALE;
			while (KVT_ST(w) == KVT_S_FILLING && KVT_GEN(w) == wr->gen) {
				/* R6: pairs with A2 in the index lookup. */
				if (kat_cas(&sl->state, &w, KVT_SW(KVT_S_READY, wr->gen, 0),
					    KVT_AR)) {
					ret = 1;
					KVT_SP(WEND_READY, s);
					break;
				}
			}
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
	claim_drop(s, sl, wr->shard, wr->gen);
	KVT_SP(WEND_DROPPED, s);
	w = kat_load(&sl->state, KVT_SC);
	if (KVT_GEN(w) == wr->gen) {
		if (KVT_ST(w) == KVT_S_FILLING && (!ok || ret < 0) &&
		    kat_load(&sl->ready, KVT_ACQ) == 0)
			kvt__slot_abandon(s, wr->slot, wr->gen, 0); /* nothing of it was written */
		else if (KVT_ST(w) == KVT_S_DOOMED || KVT_ST(w) == KVT_S_EVICTING)
			kvt__slot_reclaim(s, wr->slot, wr->gen); /* last one out */
	}
	if (ret == -ESTALE)
		return kvt__err(-ESTALE, "write_end: slot %u was doomed while being written "
				"(the segment was changed behind the protocol)", wr->slot);
	return ret;
}
