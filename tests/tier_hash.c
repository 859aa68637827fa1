/* tier_hash.c - chunk keys (key format 2, tier/kvt_hash.h).
 *
 * The keys are checked against the format's definition written out here
 * with the shared libxxhash's own XXH3_128bits (not the inlined copies the
 * kernels use), on every chunk size the tier accepts up to 4096 tokens;
 * the AVX2 kernel (when built and the CPU has it) gives the same keys as
 * the portable one; kvt_hash_tokens over a real tier chains from the
 * fingerprint, continues from a parent, hashes full chunks only, and
 * honours max_keys.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>
#include <xxhash.h>

#include "kvtier.h"
#include "kvt_hash.h"

static void put64(uint8_t *p, uint64_t v)
{
	for (int b = 0; b < 8; b++)
		p[b] = (uint8_t)(v >> (8 * b));
}

/* The format, as kvt_hash.h defines it, byte by byte. */
static void reference(const uint32_t *tokens, size_t ct, size_t n, kvt_key prev, kvt_key *keys)
{
	uint8_t *buf = malloc(ct * 4 + 1);

	assert_non_null(buf);
	for (size_t i = 0; i < n; i++) {
		uint8_t step[32];
		for (size_t k = 0; k < ct; k++) {
			uint32_t v = tokens[i * ct + k];
			buf[4 * k] = (uint8_t)v;
			buf[4 * k + 1] = (uint8_t)(v >> 8);
			buf[4 * k + 2] = (uint8_t)(v >> 16);
			buf[4 * k + 3] = (uint8_t)(v >> 24);
		}
		XXH128_hash_t c = XXH3_128bits(buf, ct * 4);
		put64(step, prev.lo);
		put64(step + 8, prev.hi);
		put64(step + 16, c.low64);
		put64(step + 24, c.high64);
		XXH128_hash_t h = XXH3_128bits(step, 32);
		prev.lo = h.low64;
		prev.hi = h.high64;
		keys[i] = prev;
	}
	free(buf);
}

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (uint32_t)rng;
}

static void check_kernel(kvt__hash_chain_fn *fn, const char *name)
{
	/* Chunk sizes on both sides of XXH3's length classes (16, 128, 240
	 * bytes, its 1 KiB block) and large ones. */
	static const size_t cts[] = { 1, 3, 4, 16, 32, 60, 61, 64, 128, 255, 256, 257,
				      512, 1024, 4096 };
	for (size_t c = 0; c < sizeof(cts) / sizeof(cts[0]); c++) {
		size_t ct = cts[c], n = ct >= 1024 ? 5 : 37;
		uint32_t *tok = malloc(ct * n * sizeof(*tok));
		kvt_key *a = calloc(n, sizeof(*a)), *b = calloc(n, sizeof(*b));
		kvt_key prev = { rnd() | (uint64_t)rnd() << 32, rnd() | (uint64_t)rnd() << 32 };

		assert_non_null(tok);
		for (size_t i = 0; i < ct * n; i++)
			tok[i] = rnd();
		tok[0] = 0xFFFFFFFFu; /* the widest token id */
		reference(tok, ct, n, prev, a);
		fn(tok, ct, n, prev, b);
		for (size_t i = 0; i < n; i++)
			if (a[i].lo != b[i].lo || a[i].hi != b[i].hi)
				fail_msg("%s kernel, chunk_tokens %zu: key %zu differs from the "
					 "format's definition", name, ct, i);
		/* a prefix of the chain is the chain of the prefix, and a
		 * continuation from key[k-1] gives keys[k..] */
		fn(tok + 2 * ct, ct, n - 2, b[1], a);
		assert_memory_equal(a, b + 2, (n - 2) * sizeof(*a));
		free(tok);
		free(a);
		free(b);
	}
}

static void test_generic_kernel(void **st)
{
	(void)st;
	check_kernel(kvt__hash_chain_generic, "generic");
}

static void test_avx2_kernel(void **st)
{
	(void)st;
#ifdef KVTIER_HASH_AVX2
	const char *name;
	__builtin_cpu_init();
	if (!__builtin_cpu_supports("avx2"))
		skip();
	check_kernel(kvt__hash_chain_avx2, "avx2");
	assert_ptr_equal(kvt__hash_chain(&name), kvt__hash_chain_avx2);
	assert_string_equal(name, "avx2");
#else
	skip();
#endif
}

/* A known answer: pins the format itself (a change of it must change
 * KVT_KEY_FORMAT and this test). */
static void test_known_answer(void **st)
{
	(void)st;
	uint32_t tok[2 * 16];
	kvt_key k[2], root = { 0x0123456789abcdefULL, 0xfedcba9876543210ULL };

	for (uint32_t i = 0; i < 32; i++)
		tok[i] = i * 2654435761u;
	kvt__hash_chain(NULL)(tok, 16, 2, kvt__hash_root(&root), k);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	{	/* key[-1]: the fingerprint's 16 bytes, lo first, little-endian */
		kvt_key r = kvt__hash_root(&root);
		XXH128_hash_t h = XXH3_128bits(&root, sizeof(root));
		assert_true(r.lo == h.low64 && r.hi == h.high64);
	}
#endif
	assert_true(k[1].hi == 0x48cb2b541c876646ULL && k[1].lo == 0x61e30d06f513060cULL);
}

static kvt_tier *open_client(const char *name, uint32_t ct)
{
	static const struct kvt_group_desc g = { .n_layers = 2, .bytes_per_token = 64,
						 .tokens_per_block = 16 };
	struct kvt_config c;
	kvt_tier *t = NULL;

	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.flags = KVT_F_NO_ENV | KVT_F_CREATE | KVT_F_REPLACE;
	c.role = KVT_TIER_CLIENT;
	c.world = 1;
	c.chunk_tokens = ct;
	c.segment = name;
	c.model = "hash-test";
	c.dma = "host";
	c.n_groups = 1;
	c.groups = &g;
	c.n_slots = 8;
	c.segment_dir = "/dev/shm"; /* 4 KiB pages: nothing here needs more */
	if (kvt_open(&c, &t))
		fail_msg("kvt_open: %s", kvt_last_error());
	return t;
}

static void test_tier_keys(void **st)
{
	(void)st;
	char name[64];
	enum { CT = 64, N = 9 };
	uint32_t tok[CT * N + 7];
	kvt_key fp, k[N], ref[N], two[N];
	kvt_tier *t;

	snprintf(name, sizeof(name), "t-hash-%d", (int)getpid());
	t = open_client(name, CT);
	for (size_t i = 0; i < sizeof(tok) / sizeof(tok[0]); i++)
		tok[i] = rnd();
	kvt_fingerprint(t, &fp);
	reference(tok, CT, N, kvt__hash_root(&fp), ref);
	/* the tail of 7 tokens is not hashed */
	assert_int_equal(kvt_hash_tokens(t, tok, CT * N + 7, NULL, k, N + 1), N);
	assert_memory_equal(k, ref, sizeof(k));
	/* max_keys bounds the output */
	memset(two, 0, sizeof(two));
	assert_int_equal(kvt_hash_tokens(t, tok, CT * N, NULL, two, 2), 2);
	assert_memory_equal(two, ref, 2 * sizeof(*two));
	assert_true(two[2].lo == 0 && two[2].hi == 0);
	/* parent: continues the chain */
	assert_int_equal(kvt_hash_tokens(t, tok + 3 * CT, CT * (N - 3), &k[2], two, N), N - 3);
	assert_memory_equal(two, ref + 3, (N - 3) * sizeof(*two));
	/* fewer tokens than a chunk: 0 keys, arguments not even read */
	assert_int_equal(kvt_hash_tokens(t, NULL, CT - 1, NULL, NULL, 0), 0);
	assert_int_equal(kvt_hash_tokens(t, NULL, CT, NULL, k, 1), -EINVAL);
	kvt_close(t);
	assert_int_equal(kvt_seg_unlink(name, "/dev/shm"), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_generic_kernel),
		cmocka_unit_test(test_avx2_kernel),
		cmocka_unit_test(test_known_answer),
		cmocka_unit_test(test_tier_keys),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
