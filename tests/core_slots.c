/* core_slots: the slot state machine, dedupe, the index, eviction (CLOCK, depth preference, pins, FILLING), fill timeout. */
#include <errno.h>
#include <time.h>

#include "kvt_test.h"
#include "kvt_format.h"

static const char *NAME;

static int setup(void **st) { (void)st; NAME = kvt_test_name("slots"); return 0; }
static int teardown(void **st) { (void)st; kvt_seg_unlink(NAME, NULL); return 0; }

static int hits(kvt_seg *s, uint64_t first, uint32_t n, uint64_t *lease)
{
	kvt_key k[64];
	uint64_t l = 0;
	int r;

	for (uint32_t i = 0; i < n; i++)
		k[i] = kvt_test_key(first + i);
	r = kvt_seg_lookup(s, k, n, &l);
	if (lease)
		*lease = l;
	else if (l)
		assert_int_equal(kvt_lease_release(s, l), 0);
	return r;
}

static void test_sharded_visibility(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(4, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r[4];
	kvt_key k = kvt_test_key(1);
	struct kvt_wref w[4];

	for (int i = 0; i < 4; i++)
		assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, (uint32_t)i, 4, &r[i]), 0);
	for (int i = 0; i < 4; i++) {
		assert_int_equal(kvt_write_begin(r[i], &k, 0, (uint32_t)i, &w[i]), 0);
		assert_int_equal(w[i].slot, w[0].slot); /* one slot for the key */
	}
	/* a shard being written is not written twice */
	struct kvt_wref w2;
	assert_int_equal(kvt_write_begin(r[2], &k, 0, 2, &w2), KVT_SKIP);
	for (int i = 0; i < 3; i++) {
		assert_int_equal(kvt_write_end(r[i], &w[i], 1), 0);
		assert_int_equal(hits(s, 1, 1, NULL), 0); /* not visible yet */
	}
	assert_int_equal(kvt_write_end(r[3], &w[3], 1), 1);
	assert_int_equal(hits(s, 1, 1, NULL), 1);
	/* ready shards are skipped (dedupe) */
	assert_int_equal(kvt_write_begin(r[0], &k, 0, 0, &w2), KVT_SKIP);
	assert_int_equal(kvt_test_counter(s, KVT_C_SAVE_SKIPS), 2);
	assert_int_equal(kvt_test_counter(s, KVT_C_SAVED_CHUNKS), 4);
	assert_int_equal(kvt_test_counter(s, KVT_C_BYTES_SAVED), 4 * 256);
	/* a write reference that is not ours is refused */
	assert_int_equal(kvt_write_end(r[0], &w[1], 1), -EINVAL);
	w2 = w[0]; w2.slot = 9999;
	assert_int_equal(kvt_write_end(r[0], &w2, 1), -EINVAL);
	assert_int_equal(kvt_write_begin(r[0], &k, 0, 4, &w2), -EINVAL);
	kvt_test_assert_check(s);
	for (int i = 0; i < 4; i++)
		kvt_seg_detach(r[i]);
	kvt_seg_detach(s);
}

static void test_replicated(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(4, 16);
	g.mode = KVT_MODE_REPLICATED;
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r2;
	kvt_key k = kvt_test_key(3);
	struct kvt_wref w;

	assert_int_equal(kvt_seg_n_shards(s), 1);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 2, 4, &r2), 0);
	/* one rank's write makes it ready; the others skip */
	assert_int_equal(kvt_write_begin(r2, &k, 0, 0, &w), 0);
	assert_int_equal(kvt_write_begin(s, &k, 0, 0, &w), KVT_SKIP);
	assert_int_equal(kvt_write_end(r2, &w, 1), 1);
	assert_int_equal(kvt_write_begin(s, &k, 0, 0, &w), KVT_SKIP);
	assert_int_equal(kvt_write_begin(s, &k, 0, 1, &w), -EINVAL);
	/* every rank loads: the lease waits for all four */
	uint64_t lease;
	assert_int_equal(hits(s, 3, 1, &lease), 1);
	for (uint32_t i = 0; i < 3; i++)
		assert_int_equal(kvt_lease_loaded(s, lease, i), 0);
	assert_int_equal(kvt_lease_loaded(s, lease, 3), 1);
	kvt_test_assert_check(s);
	kvt_seg_detach(r2);
	kvt_seg_detach(s);
}

static void test_abort(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 8);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	kvt_key k = kvt_test_key(9);
	struct kvt_wref w, w1;
	struct kvt_occupancy o;

	assert_int_equal(kvt_write_begin(s, &k, 0, 0, &w), 0);
	assert_int_equal(kvt_write_end(s, &w, 0), 0);
	kvt_occupancy_read(s, &o);
	assert_int_equal(o.free, 8); /* nothing written: back to FREE */
	/* partly written, then one shard aborts: the slot waits for it */
	assert_int_equal(kvt_write_begin(s, &k, 0, 0, &w), 0);
	assert_int_equal(kvt_write_begin(s, &k, 0, 1, &w1), 0);
	assert_int_equal(kvt_write_end(s, &w, 1), 0);
	assert_int_equal(kvt_write_end(s, &w1, 0), 0);
	kvt_occupancy_read(s, &o);
	assert_int_equal(o.filling, 1);
	assert_int_equal(kvt_write_begin(s, &k, 0, 1, &w1), 0);
	assert_int_equal(kvt_write_end(s, &w1, 1), 1);
	assert_int_equal(kvt_test_counter(s, KVT_C_FILL_ABORTS), 2);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

static void test_index_many(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 1024);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	uint32_t saved = 0;

	for (uint64_t i = 0; i < 1024; i++) {
		int r = kvt_test_save_all(s, i, 0);
		assert_true(r == 1 || r == -ENOSPC); /* -ENOSPC only if buckets overflow */
		saved += r == 1;
	}
	assert_true(saved >= 1000);
	assert_int_equal(kvt_test_counter(s, KVT_C_EVICTIONS), 0);
	for (uint64_t i = 0; i < 1024; i++) {
		kvt_key k = kvt_test_key(i);
		k.hi ^= 1; /* same lo, other hi: another key */
		uint64_t l;
		assert_int_equal(kvt_seg_lookup(s, &k, 1, &l), 0);
	}
	uint32_t found = 0;
	for (uint64_t i = 0; i < 1024; i++)
		found += (uint32_t)hits(s, i, 1, NULL);
	assert_int_equal(found, saved);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

static void test_eviction(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 8);
	struct kvt_seg_create_opts c = { .size = sizeof(c), .name = NAME, .geo = &g,
		.flags = KVT_SEG_F_REPLACE | KVT_SEG_F_DEPTH_FIRST };
	kvt_seg *s = NULL;
	uint64_t lease;

	assert_int_equal(kvt_seg_create(&c, NULL, &s), 0);
	for (uint32_t i = 0; i < 8; i++)
		assert_int_equal(kvt_test_save_all(s, i, i), 1);
	/* all cold, depth-first policy: the deepest chunk goes first */
	assert_int_equal(kvt_test_save_all(s, 100, 0), 1);
	assert_int_equal(kvt_test_counter(s, KVT_C_EVICTIONS), 1);
	assert_int_equal(hits(s, 7, 1, NULL), 0);
	assert_int_equal(hits(s, 0, 7, NULL), 7);
	assert_int_equal(hits(s, 100, 1, NULL), 1);
	/* pinned chunks are never evicted: pin everything, then save */
	assert_int_equal(hits(s, 0, 7, &lease), 7);
	uint64_t l2;
	assert_int_equal(hits(s, 100, 1, &l2), 1);
	assert_int_equal(kvt_test_save_all(s, 200, 0), -ENOSPC);
	assert_int_equal(kvt_test_counter(s, KVT_C_SAVE_NOSPC), 1);
	assert_int_equal(hits(s, 0, 7, NULL), 7); /* all still there */
	kvt_test_assert_check(s);
	assert_int_equal(kvt_lease_release(s, l2), 0);
	assert_int_equal(kvt_test_save_all(s, 200, 0), 1);
	assert_int_equal(hits(s, 100, 1, NULL), 0);
	assert_int_equal(kvt_lease_release(s, lease), 0);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

static void test_filling_not_evicted(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 4);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	struct kvt_wref w[4], x;

	for (uint64_t i = 0; i < 4; i++) {
		kvt_key k = kvt_test_key(i);
		assert_int_equal(kvt_write_begin(s, &k, 0, 0, &w[i]), 0);
	}
	kvt_key k = kvt_test_key(50);
	assert_int_equal(kvt_write_begin(s, &k, 0, 0, &x), -ENOSPC);
	for (int i = 0; i < 4; i++)
		assert_int_equal(kvt_write_end(s, &w[i], 0), 0);
	assert_int_equal(kvt_write_begin(s, &k, 0, 0, &x), 0);
	assert_int_equal(kvt_write_end(s, &x, 0), 0);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

static void test_fill_timeout(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 2);
	g.fill_timeout_ms = 1;
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	struct kvt_wref w;
	kvt_key k = kvt_test_key(1);
	struct timespec ts = { 0, 20 * 1000 * 1000 };

	/* shard 0 written, shard 1 never comes: abandoned FILLING */
	assert_int_equal(kvt_write_begin(s, &k, 0, 0, &w), 0);
	assert_int_equal(kvt_write_end(s, &w, 1), 0);
	nanosleep(&ts, NULL);
	assert_int_equal(kvt_test_save_all(s, 2, 0), 1);
	assert_int_equal(kvt_test_save_all(s, 3, 0), 1); /* needs the abandoned slot */
	assert_int_equal(kvt_test_counter(s, KVT_C_FILL_TIMEOUTS), 1);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

static void test_hit_protects(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 4);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);

	for (uint32_t i = 0; i < 4; i++)
		assert_int_equal(kvt_test_save_all(s, i, 0), 1);
	/* chunk 2 is hit: it survives the next evictions */
	assert_int_equal(hits(s, 2, 1, NULL), 1);
	assert_int_equal(kvt_test_save_all(s, 10, 0), 1);
	assert_int_equal(kvt_test_save_all(s, 11, 0), 1);
	assert_int_equal(hits(s, 2, 1, NULL), 1);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

/* The default policy is the plain CLOCK: the hand's order, hits protect. */
static void test_clock_order(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 8);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);

	for (uint32_t i = 0; i < 8; i++)
		assert_int_equal(kvt_test_save_all(s, i, 7 - i), 1);
	/* chunk 0 is hit twice: it survives while the others go in turn */
	assert_int_equal(hits(s, 0, 1, NULL), 1);
	for (uint32_t i = 0; i < 4; i++)
		assert_int_equal(kvt_test_save_all(s, 100 + i, 0), 1);
	assert_int_equal(hits(s, 0, 1, NULL), 1);
	assert_int_equal(kvt_test_counter(s, KVT_C_EVICTIONS), 4);
	uint32_t left = 0;
	for (uint32_t i = 1; i < 8; i++)
		left += (uint32_t)hits(s, i, 1, NULL);
	assert_int_equal(left, 3);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_sharded_visibility, setup, teardown),
		cmocka_unit_test_setup_teardown(test_replicated, setup, teardown),
		cmocka_unit_test_setup_teardown(test_abort, setup, teardown),
		cmocka_unit_test_setup_teardown(test_index_many, setup, teardown),
		cmocka_unit_test_setup_teardown(test_eviction, setup, teardown),
		cmocka_unit_test_setup_teardown(test_clock_order, setup, teardown),
		cmocka_unit_test_setup_teardown(test_filling_not_evicted, setup, teardown),
		cmocka_unit_test_setup_teardown(test_fill_timeout, setup, teardown),
		cmocka_unit_test_setup_teardown(test_hit_protects, setup, teardown),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
