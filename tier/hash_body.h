/* hash_body.h - the key chain's loop (see kvt_hash.h), compiled once per
 * instruction set: the includer defines XXH_INLINE_ALL, any -m flags, and
 * KVT_HASH_CHAIN_NAME.  XXH3 is inlined so that the vector width is the
 * including file's, not the shared library's baseline (SSE2 on Debian). */
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvt_hash.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define KVT_HASH_BE 1
#else
#define KVT_HASH_BE 0
#endif

static inline void kvt_hash_put64(uint8_t *p, uint64_t v)
{
	for (int b = 0; b < 8; b++)
		p[b] = (uint8_t)(v >> (8 * b));
}

void KVT_HASH_CHAIN_NAME(const uint32_t *tokens, size_t chunk_tokens, size_t n_chunks,
			 kvt_key prev, kvt_key *keys)
{
	size_t tb = chunk_tokens * sizeof(uint32_t);

	for (size_t i = 0; i < n_chunks; i++) {
		const uint32_t *tk = tokens + i * chunk_tokens;
		uint8_t step[32];
		XXH128_hash_t c, h;

		if (KVT_HASH_BE) {
			/* The bytes hashed are little-endian u32s on every
			 * host; a big-endian one swaps through a small buffer. */
			XXH3_state_t st;
			uint32_t sw[256];

			XXH3_128bits_reset(&st);
			for (size_t k = 0; k < chunk_tokens; k += 256) {
				size_t m = chunk_tokens - k < 256 ? chunk_tokens - k : 256;
				for (size_t j = 0; j < m; j++)
					sw[j] = __builtin_bswap32(tk[k + j]);
				XXH3_128bits_update(&st, sw, m * sizeof(uint32_t));
			}
			c = XXH3_128bits_digest(&st);
		} else {
			c = XXH3_128bits(tk, tb);
		}
		kvt_hash_put64(step, prev.lo);
		kvt_hash_put64(step + 8, prev.hi);
		kvt_hash_put64(step + 16, c.low64);
		kvt_hash_put64(step + 24, c.high64);
		h = XXH3_128bits(step, sizeof(step));
		prev.lo = h.low64;
		prev.hi = h.high64;
		keys[i] = prev;
	}
}
