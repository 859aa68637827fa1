/* kvt_mix.h - the 64-bit mix: splitmix64's finalizer, a bijection of
 * 64-bit words with full avalanche.  The index and the disk index place
 * keys by it (keys may be small integers: a trace's block ids), the
 * segment derives its ids and tags from it, and the bench's reproducible
 * streams step through it.  Part of the segment's format: the index's
 * bucket of a key is computed with it by every process, so it never
 * changes without KVT_LAYOUT_VERSION. */
#ifndef KVT_MIX_H
#define KVT_MIX_H

#include <stdint.h>

static inline uint64_t kvt__mix64(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebULL;
	x ^= x >> 31;
	return x;
}

#endif
