/* hash.c - chunk keys: the portable kernel and the choice of kernel.
 * The format is in kvt_hash.h. */
#include <stdatomic.h>

#define KVT_HASH_CHAIN_NAME kvt__hash_chain_generic
#include "hash_body.h"

kvt_key kvt__hash_root(const kvt_key *fingerprint)
{
	uint8_t b[16];
	XXH128_hash_t h;
	kvt_key k;

	kvt_hash_put64(b, fingerprint->lo);
	kvt_hash_put64(b + 8, fingerprint->hi);
	h = XXH3_128bits(b, sizeof(b));
	k.lo = h.low64;
	k.hi = h.high64;
	return k;
}

/* 0: not chosen yet, 1: generic, 2: avx2.  Relaxed: every thread computes
 * the same answer; the store only saves the next caller the work. */
static _Atomic int chosen;

kvt__hash_chain_fn *kvt__hash_chain(const char **name)
{
	int c = atomic_load_explicit(&chosen, memory_order_relaxed);

	if (!c) {
		c = 1;
#ifdef KVTIER_HASH_AVX2
		__builtin_cpu_init();
		if (__builtin_cpu_supports("avx2"))
			c = 2;
#endif
		atomic_store_explicit(&chosen, c, memory_order_relaxed);
	}
	if (name)
		*name = c == 2 ? "avx2" : "generic";
#ifdef KVTIER_HASH_AVX2
	if (c == 2)
		return kvt__hash_chain_avx2;
#endif
	return kvt__hash_chain_generic;
}
