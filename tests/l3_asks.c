/* l3_asks.c - the L3 engine's set of asks in flight (tier/l3/kvt_l3_asks.h)
 * against a plain list: random adds and deletes at the set's fullest
 * (KVT_L3_ASKS_MAX pairs, many sharing a key or a home), every pair
 * findable while it is in, none after it left, the count right. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvt_l3_asks.h"

static struct kvt_l3_asks set;
static struct { kvt_key k; uint32_t depth; } ref[KVT_L3_ASKS_MAX];
static uint32_t n_ref;

static uint64_t rng = 0x5eed;

static uint64_t rnd(void)
{
	return kvt__mix64(rng += 0x9e3779b97f4a7c15ULL);
}

static int in_ref(const kvt_key *k, uint32_t depth)
{
	for (uint32_t i = 0; i < n_ref; i++)
		if (ref[i].k.lo == k->lo && ref[i].k.hi == k->hi && ref[i].depth == depth)
			return (int)i;
	return -1;
}

static void check_all(void)
{
	uint32_t place;

	assert_int_equal(set.n, n_ref);
	for (uint32_t i = 0; i < n_ref; i++)
		assert_true(kvt_l3_asks_find(&set, &ref[i].k, ref[i].depth, &place));
}

static void test_random_against_a_list(void **st)
{
	uint32_t place;

	(void)st;
	memset(&set, 0, sizeof(set));
	for (uint32_t op = 0; op < 200000; op++) {
		/* a small key space: the same key at several depths, and adds
		 * of pairs already in */
		kvt_key k = { rnd() % 2048, 7 };
		uint32_t depth = (uint32_t)(rnd() % 3);
		int at = in_ref(&k, depth);

		if (rnd() % 2 && n_ref < KVT_L3_ASKS_MAX) {
			kvt_l3_asks_add(&set, &k, depth);
			if (at < 0) {
				ref[n_ref].k = k;
				ref[n_ref++].depth = depth;
			}
		} else {
			kvt_l3_asks_del(&set, &k, depth);
			if (at >= 0)
				ref[at] = ref[--n_ref];
		}
		assert_int_equal(kvt_l3_asks_find(&set, &k, depth, &place),
				 in_ref(&k, depth) >= 0);
		if (op % 4096 == 0)
			check_all();
	}
	check_all();
	/* emptied: nothing left, every place free */
	while (n_ref) {
		n_ref--;
		kvt_l3_asks_del(&set, &ref[n_ref].k, ref[n_ref].depth);
	}
	assert_int_equal(set.n, 0);
	for (uint32_t i = 0; i <= KVT_L3_ASKS_MASK; i++)
		assert_int_equal(set.at[i].used, 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_random_against_a_list),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
