/* kvt_hash.h - chunk keys (key format 2), internal to tier/.
 *
 * The chain (kvt_hash_tokens in kvtier.h):
 *
 *   c[i]   = XXH3-128(tokens of chunk i, each a little-endian u32)
 *   key[i] = XXH3-128(key[i-1].lo, key[i-1].hi, c[i].lo, c[i].hi as
 *                     four little-endian u64: 32 bytes)
 *   key[-1] = XXH3-128(the 16 bytes of the layout fingerprint) or *parent
 *
 * Why two levels (format 1 was key[i] = XXH3-128(key[i-1] || tokens)): in
 * format 1 every chunk's hash starts from the previous chunk's result, so
 * the CPU runs the 128 hashes of a 32k-token prompt strictly one after the
 * other and pays each one's full latency; it ran at a third of XXH3's bulk
 * speed with AVX2.  In format 2 the content hashes c[i] depend on nothing
 * but their tokens (the CPU overlaps them, and they are read in place, no
 * copy), and only the 32-byte step is serial.  The prefix property is the
 * same: key[i] names chunk i and everything before it.  The key format is
 * part of the layout fingerprint (KVT_KEY_FORMAT in core), so processes
 * that compute keys differently never share a segment.
 */
#ifndef KVT_HASH_H
#define KVT_HASH_H

#include <stddef.h>
#include <stdint.h>

#include "kvt_core.h"

/* keys[0 .. n_chunks) from tokens[0 .. n_chunks * chunk_tokens), chained
 * from prev.  tokens and keys must not overlap. */
typedef void kvt__hash_chain_fn(const uint32_t *tokens, size_t chunk_tokens,
				size_t n_chunks, kvt_key prev, kvt_key *keys);

kvt__hash_chain_fn kvt__hash_chain_generic;
#ifdef KVTIER_HASH_AVX2
kvt__hash_chain_fn kvt__hash_chain_avx2;
#endif

/* The kernel this CPU runs best ("avx2" or "generic"); both give the same
 * keys (tests/tier_hash.c).  Thread-safe. */
kvt__hash_chain_fn *kvt__hash_chain(const char **name);

/* key[-1] when no parent is given. */
kvt_key kvt__hash_root(const kvt_key *fingerprint);

#endif
