/* kvt_l3_asks.h - the L3 engine's asks in flight (l3_engine.c): the
 * (key, depth) pairs queued or in an EXISTS or GET job, so that an ask of
 * one already made joins it at the cost of a probe, not of a scan of the
 * jobs and the queue (a peer flooding asks would make every ask pay it).
 *
 * Open addressing with linear probing; deletion by backward shift, so
 * there are no tombstones and a probe ends at the first free place.  At
 * most KVT_L3_ASKS_MAX pairs (256 jobs and the 1,024-ask queue): under a
 * third of the places, so probes stay short and one always ends.  Private
 * memory of kvtierd's loop thread: no atomics.
 */
#ifndef KVT_L3_ASKS_H
#define KVT_L3_ASKS_H

#include <stdint.h>

#include "kvt_core.h"
#include "kvt_mix.h"

#define KVT_L3_ASKS_BITS 12
#define KVT_L3_ASKS_MASK ((1u << KVT_L3_ASKS_BITS) - 1)
#define KVT_L3_ASKS_MAX  1280u

struct kvt_l3_asks {
	struct { kvt_key k; uint32_t depth, used; } at[1u << KVT_L3_ASKS_BITS];
	uint32_t n;
};

static inline uint32_t kvt_l3_asks_home(const kvt_key *k, uint32_t depth)
{
	return (uint32_t)(kvt__mix64(k->lo ^ kvt__mix64(k->hi ^ ((uint64_t)depth << 32))) >>
			  (64 - KVT_L3_ASKS_BITS));
}

/* 1 and its place when (k, depth) is in the set, else 0 and a free place */
static inline int kvt_l3_asks_find(const struct kvt_l3_asks *a, const kvt_key *k,
				   uint32_t depth, uint32_t *place)
{
	for (uint32_t i = kvt_l3_asks_home(k, depth);; i = (i + 1) & KVT_L3_ASKS_MASK) {
		*place = i;
		if (!a->at[i].used)
			return 0;
		if (a->at[i].k.lo == k->lo && a->at[i].k.hi == k->hi && a->at[i].depth == depth)
			return 1;
	}
}

static inline void kvt_l3_asks_add(struct kvt_l3_asks *a, const kvt_key *k, uint32_t depth)
{
	uint32_t i;

	if (kvt_l3_asks_find(a, k, depth, &i))
		return;
	a->at[i].k = *k;
	a->at[i].depth = depth;
	a->at[i].used = 1;
	a->n++;
}

static inline void kvt_l3_asks_del(struct kvt_l3_asks *a, const kvt_key *k, uint32_t depth)
{
	uint32_t i;

	if (!kvt_l3_asks_find(a, k, depth, &i))
		return;
	/* each pair after the hole in its run moves into it when its home
	 * is not inside (hole, its place]: every pair stays reachable */
	for (uint32_t j = (i + 1) & KVT_L3_ASKS_MASK; a->at[j].used;
	     j = (j + 1) & KVT_L3_ASKS_MASK) {
		uint32_t h = kvt_l3_asks_home(&a->at[j].k, a->at[j].depth);

		if (((j - h) & KVT_L3_ASKS_MASK) >= ((j - i) & KVT_L3_ASKS_MASK)) {
			a->at[i] = a->at[j];
			i = j;
		}
	}
	a->at[i].used = 0;
	a->n--;
}

#endif
