/* core_leases: prefix lookups, lease slots, loaded masks, release/double release, step sweep, limits, reaper and pin repair. */
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>

#include "kvt_test.h"
#include "kvt_format.h"

static const char *NAME;

static int setup(void **st) { (void)st; NAME = kvt_test_name("leases"); return 0; }
static int teardown(void **st) { (void)st; kvt_seg_unlink(NAME, NULL); return 0; }

static int look(kvt_seg *s, uint64_t first, uint32_t n, uint64_t *lease)
{
	kvt_key k[128];

	for (uint32_t i = 0; i < n; i++)
		k[i] = kvt_test_key(first + i);
	return kvt_seg_lookup(s, k, n, lease);
}

static uint32_t pins_total(kvt_seg *s)
{
	struct kvt_occupancy o;

	kvt_occupancy_read(s, &o);
	return (uint32_t)o.pinned;
}

static void test_prefix(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 32);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	uint64_t lease = 77;
	uint32_t slots[8];
	uint64_t gens[8];

	assert_int_equal(look(s, 0, 5, &lease), 0); /* empty tier */
	assert_int_equal(lease, 0);
	for (uint64_t i = 0; i < 5; i++)
		if (i != 3)
			assert_int_equal(kvt_test_save_all(s, i, (uint32_t)i), 1);
	assert_int_equal(look(s, 0, 5, &lease), 3); /* stops at the first miss */
	assert_int_not_equal(lease, 0);
	assert_int_equal(kvt_lease_slots(s, lease, slots, gens, 8), 3);
	for (int i = 0; i < 3; i++) {
		uint8_t *p = kvt_slot_shard_ptr(s, slots[i], 1);
		assert_int_equal(p[0], i); /* the bytes saved for key i */
	}
	assert_int_equal(pins_total(s), 3);
	assert_int_equal(kvt_test_counter(s, KVT_C_HIT_CHUNKS), 3);
	assert_int_equal(kvt_test_counter(s, KVT_C_HIT_TOKENS), 3 * 16);
	assert_int_equal(kvt_test_counter(s, KVT_C_LOOKUPS), 2);
	assert_int_equal(kvt_test_counter(s, KVT_C_LOOKUP_CHUNKS), 10);
	kvt_test_assert_check(s);
	assert_int_equal(kvt_lease_release(s, lease), 0);
	assert_int_equal(pins_total(s), 0);
	assert_int_equal(kvt_lease_slots(s, lease, slots, gens, 8), -ESTALE);
	assert_int_equal(kvt_lease_slots(s, 0, slots, gens, 8), -EINVAL);
	assert_int_equal(kvt_lease_slots(s, 1000, slots, gens, 8), -EINVAL);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

static void test_loaded_and_double_release(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(4, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	uint64_t lease;

	for (uint64_t i = 0; i < 4; i++)
		assert_int_equal(kvt_test_save_all(s, i, 0), 1);
	assert_int_equal(look(s, 0, 4, &lease), 4);
	for (uint32_t r = 0; r < 3; r++) {
		assert_int_equal(kvt_lease_loaded(s, lease, r), 0);
		assert_int_equal(kvt_lease_loaded(s, lease, r), 0); /* idempotent */
		assert_int_equal(pins_total(s), 4);
	}
	assert_int_equal(kvt_lease_loaded(s, lease, 4), -EINVAL);
	assert_int_equal(kvt_lease_loaded(s, lease, 3), 1); /* all ranks: released */
	assert_int_equal(pins_total(s), 0);
	assert_int_equal(kvt_test_counter(s, KVT_C_LOADED_CHUNKS), 16);
	assert_int_equal(kvt_lease_loaded(s, lease, 3), -ESTALE);
	/* a second release is counted and changes nothing else */
	assert_int_equal(kvt_lease_release(s, lease), -EALREADY);
	assert_int_equal(kvt_test_counter(s, KVT_C_DOUBLE_UNPINS), 1);
	uint64_t l2;
	assert_int_equal(look(s, 0, 2, &l2), 2);
	assert_int_equal(kvt_lease_release(s, lease), -EALREADY); /* stale id, maybe reused slot */
	assert_int_equal(pins_total(s), 2);
	assert_int_equal(kvt_test_counter(s, KVT_C_DOUBLE_UNPINS), 2);
	assert_int_equal(kvt_lease_release(s, l2), 0);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

static void test_step(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *sched;
	uint64_t a, b;

	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_SCHEDULER, 0, 0, 1, &sched), 0);
	for (uint64_t i = 0; i < 4; i++)
		assert_int_equal(kvt_test_save_all(s, i, 0), 1);
	assert_int_equal(look(sched, 0, 2, &a), 2);
	assert_int_equal(look(sched, 2, 2, &b), 2);
	assert_int_equal(kvt_seg_step(sched, &a, 1), 0);  /* b absent once */
	assert_int_equal(pins_total(s), 4);
	assert_int_equal(kvt_seg_step(sched, &a, 1), 1);  /* b absent twice: released */
	assert_int_equal(pins_total(s), 2);
	assert_int_equal(kvt_test_counter(s, KVT_C_STALE_UNPINS), 1);
	assert_int_equal(kvt_seg_step(sched, NULL, 0), 0);
	assert_int_equal(kvt_seg_step(sched, &a, 1), 0);  /* back in the set: count restarts */
	assert_int_equal(kvt_seg_step(sched, NULL, 0), 0);
	assert_int_equal(kvt_seg_step(sched, NULL, 0), 1);
	assert_int_equal(pins_total(s), 0);
	assert_int_equal(kvt_lease_release(sched, a), -EALREADY);
	kvt_test_assert_check(s);
	kvt_seg_detach(sched);
	kvt_seg_detach(s);
}

static void test_limits(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 128);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	uint64_t leases[64], l;

	for (uint64_t i = 0; i < 100; i++)
		assert_int_equal(kvt_test_save_all(s, i, 0), 1);
	assert_int_equal(look(s, 0, 100, &l), 64); /* lease_max_chunks */
	assert_int_equal(kvt_lease_release(s, l), 0);
	for (int i = 0; i < 64; i++)
		assert_int_equal(look(s, 0, 1, &leases[i]), 1);
	assert_int_equal(look(s, 0, 1, &l), -ENOSPC);
	assert_int_equal(kvt_test_counter(s, KVT_C_LEASES_FULL), 1);
	for (int i = 0; i < 64; i++)
		assert_int_equal(kvt_lease_release(s, leases[i]), 0);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

/* A child attaches with `role`, takes a lease over keys 0..3, and dies. */
static void die_with_lease(uint32_t role, uint32_t rank)
{
	pid_t pid = fork();
	int status;

	if (pid == 0) {
		kvt_seg *c;
		uint64_t l;
		if (kvt_test_attach(NAME, role, 0, rank, 2, &c))
			_exit(1);
		if (look(c, 0, 4, &l) != 4)
			_exit(2);
		if (role == KVT_ROLE_RANK && kvt_lease_loaded(c, l, 1 - rank) != 0)
			_exit(3);
		_exit(0);
	}
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_int_equal(WEXITSTATUS(status), 0);
}

static struct kvt_reaped last_reaped;
static int n_reaped;

static void on_reaped(void *arg, const struct kvt_reaped *r)
{
	(void)arg;
	last_reaped = *r;
	n_reaped++;
}

static void test_reap_leases(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	uint64_t keep;

	for (uint64_t i = 0; i < 4; i++)
		assert_int_equal(kvt_test_save_all(s, i, 0), 1);
	assert_int_equal(look(s, 0, 4, &keep), 4); /* a live lease of a live process */
	/* the scheduler dies: its leases are released */
	die_with_lease(KVT_ROLE_SCHEDULER, 0);
	assert_int_equal(pins_total(s), 4);
	n_reaped = 0;
	assert_int_equal(kvt_seg_reap_report(s, on_reaped, NULL), 1);
	assert_int_equal(n_reaped, 1); /* told what it left: its lease */
	assert_int_equal(last_reaped.role, KVT_ROLE_SCHEDULER);
	assert_int_equal(last_reaped.leases, 1);
	assert_int_equal(last_reaped.slots + last_reaped.in_op, 0);
	assert_true(last_reaped.pid > 0);
	struct kvt_entry_info in;
	assert_int_equal(kvt_seg_entry_info(s, last_reaped.entry, &in), 0);
	assert_int_equal(in.state, KVT_ENTRY_EMPTY);
	assert_int_equal(in.left, KVT_LEFT_REPAIRED);
	assert_int_equal(pins_total(s), 4);
	kvt_test_assert_check(s);
	/* a rank dies: leases still waiting for its load are released */
	die_with_lease(KVT_ROLE_RANK, 0);
	n_reaped = 0;
	assert_int_equal(kvt_seg_reap_report(s, on_reaped, NULL), 1);
	assert_int_equal(n_reaped, 1);
	assert_int_equal(last_reaped.role, KVT_ROLE_RANK);
	assert_int_equal(last_reaped.rank, 0);
	assert_int_equal(last_reaped.leases, 2); /* its own, and `keep` */
	assert_int_equal(kvt_seg_reap(s), 0);
	assert_int_equal(kvt_test_counter(s, KVT_C_REAPED_RANKS), 2);
	/* `keep` also waited for rank 0's load: it went with it */
	assert_int_equal(pins_total(s), 0);
	kvt_test_assert_check(s);
	assert_int_equal(kvt_lease_release(s, keep), -EALREADY);
	kvt_test_assert_check(s);

	/* one that exits holding nothing is told as such, and a detach as one */
	pid_t pid = fork();
	int status;
	if (pid == 0) {
		kvt_seg *c;
		_exit(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 1, 2, &c) ? 1 : 0);
	}
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_int_equal(WEXITSTATUS(status), 0);
	n_reaped = 0;
	assert_int_equal(kvt_seg_reap_report(s, on_reaped, NULL), 1);
	assert_int_equal(last_reaped.pid, pid);
	assert_int_equal(last_reaped.leases + last_reaped.slots + last_reaped.in_op, 0);
	assert_int_equal(kvt_seg_entry_info(s, last_reaped.entry, &in), 0);
	assert_int_equal(in.left, KVT_LEFT_REAPED);
	kvt_seg *c;
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 1, 2, &c), 0);
	uint32_t e = kvt_seg_entry(c);
	assert_int_equal(kvt_seg_entry_info(s, e, &in), 0);
	assert_int_equal(in.state, KVT_ENTRY_ATTACHED);
	assert_int_equal(in.left, KVT_LEFT_UNKNOWN);
	kvt_seg_detach(c);
	assert_int_equal(kvt_seg_entry_info(s, e, &in), 0);
	assert_int_equal(in.left, KVT_LEFT_DETACHED);
	kvt_seg_detach(s);
}

/* White box: a process died between the two stores of a pin or an unpin.
 * The reaper must leave pins equal to lease references. */
static void test_pin_repair(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *c;
	uint64_t lease;
	uint32_t slot;
	uint64_t gen;

	for (uint64_t i = 0; i < 2; i++)
		assert_int_equal(kvt_test_save_all(s, i, 0), 1);
	assert_int_equal(look(s, 0, 1, &lease), 1);
	assert_int_equal(kvt_lease_slots(s, lease, &slot, &gen, 1), 1);

	for (int scenario = 0; scenario < 2; scenario++) {
		pid_t pid = fork();
		int status;
		if (pid == 0) {
			if (kvt_test_attach(NAME, KVT_ROLE_CLIENT, 0, 0, 0, &c))
				_exit(1);
			struct kvt_slot *sl = kvt__slot(c, slot);
			uint64_t w = kat_load(&sl->state, KVT_RLX);
			if (scenario == 0) {
				/* pinned, died before recording the ref */
				kat_store(&c->ents[c->entry].journal, KVT_J(KVT_J_PIN, slot, KVT_GEN(w)), KVT_REL);
				kat_store(&sl->state, w + KVT_PIN_ONE, KVT_REL);
			} else {
				/* releasing `lease`: unpinned, died before clearing the ref */
				uint32_t idx = (uint32_t)lease - 1;
				struct kvt_lease *l = kvt__lease(c, idx);
				uint64_t lw = kat_load(&l->state, KVT_RLX);
				kat_store(&l->state, KVT_LW(KVT_L_RELEASING, KVT_LGEN(lw), c->entry + 1),
					  KVT_REL);
				kat_store(&c->ents[c->entry].journal, KVT_J(KVT_J_UNPIN, slot, KVT_GEN(w)), KVT_REL);
				kat_store(&sl->state, w - KVT_PIN_ONE, KVT_REL);
			}
			_exit(0);
		}
		assert_int_equal(waitpid(pid, &status, 0), pid);
		assert_int_equal(WEXITSTATUS(status), 0);
		char msg[256];
		assert_int_not_equal(kvt_check(s, msg, sizeof(msg)), 0); /* broken before reaping */
		assert_int_equal(kvt_seg_reap(s), 1);
		kvt_test_assert_check(s);
		assert_int_equal(pins_total(s), scenario == 0 ? 1 : 0);
	}
	/* the interrupted release was finished by the reaper */
	assert_int_equal(kvt_lease_release(s, lease), -EALREADY);
	assert_int_equal(kvt_test_save_all(s, 5, 0), 1);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

/* White box: a process died right after a state transition that names it
 * (the actor written in the same CAS): a lease it was releasing (B) or
 * building (C), a slot it was setting up (D), an index insert it had
 * committed but not finalized (G).  The reaper must clean each up. */
static void test_dead_mid_transition(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	uint64_t lease;

	for (uint64_t i = 0; i < 2; i++)
		assert_int_equal(kvt_test_save_all(s, i, 0), 1);
	assert_int_equal(look(s, 0, 2, &lease), 2);
	for (int scenario = 0; scenario < 4; scenario++) {
		pid_t pid = fork();
		int status;
		if (pid == 0) {
			kvt_seg *c;
			if (kvt_test_attach(NAME, KVT_ROLE_CLIENT, 0, 0, 0, &c))
				_exit(1);
			uint32_t me = c->entry + 1;
			if (scenario == 0) {        /* B: RELEASING, nothing unpinned */
				struct kvt_lease *l = kvt__lease(c, (uint32_t)lease - 1);
				uint64_t w = kat_load(&l->state, KVT_RLX);
				kat_store(&l->state, KVT_LW(KVT_L_RELEASING, KVT_LGEN(w), me), KVT_REL);
			} else if (scenario == 1) { /* C: BUILDING, nothing recorded */
				struct kvt_lease *l = kvt__lease(c, 7);
				uint64_t w = kat_load(&l->state, KVT_RLX);
				if (KVT_LST(w) != KVT_L_FREE)
					_exit(2);
				kat_store(&l->state, KVT_LW(KVT_L_BUILDING, KVT_LGEN(w), me), KVT_REL);
			} else if (scenario == 2) { /* D: FREE -> FILLING|owner, no setup */
				for (uint32_t x = 0; x < 16; x++) {
					struct kvt_slot *sl = kvt__slot(c, x);
					uint64_t w = kat_load(&sl->state, KVT_RLX);
					if (KVT_ST(w) == KVT_S_FREE) {
						kat_store(&sl->state, KVT_SW(KVT_S_FILLING, KVT_GEN(w), me), KVT_REL);
						break;
					}
				}
			} else {                    /* G: commit without finalize */
				kvt_key k = kvt_test_key(9);
				struct kvt_wref w;
				if (kvt_write_begin(c, &k, 0, 0, &w))
					_exit(3);
				uint32_t b1, b2, tag;
				kvt__key_hash(c, &k, &b1, &b2, &tag);
				/* turn its final entry back into a committed, pending one */
				for (uint32_t p = 0; p < KVT_BUCKET_WAYS; p++) {
					uint64_t e = kat_load(&c->buckets[b1].e[p], KVT_RLX);
					if (e && KVT_E_SLOT(e) == w.slot) {
						uint64_t ver = (kat_load(&c->buckets[b1].ctl, KVT_RLX) >> 37) + 1;
						uint64_t t = KVT_E_TENT | (e & ~(0xffffULL << 32)) |
							     ((ver & 0xffff) << 32);
						kat_store(&c->buckets[b1].e[p], t, KVT_REL);
						kat_store(&c->buckets[b1].ctl, (ver << 37) | (1ULL << 36) |
							  ((uint64_t)p << 32) | (w.slot + 1), KVT_REL);
						break;
					}
				}
			}
			_exit(0);
		}
		assert_int_equal(waitpid(pid, &status, 0), pid);
		assert_int_equal(WEXITSTATUS(status), 0);
		char msg[256];
		assert_int_not_equal(kvt_check(s, msg, sizeof(msg)), 0);
		assert_int_equal(kvt_seg_reap(s), 1);
		kvt_test_assert_check(s);
	}
	assert_int_equal(pins_total(s), 0);
	assert_int_equal(kvt_lease_release(s, lease), -EALREADY);
	for (uint64_t i = 20; i < 40; i++) /* everything still allocatable */
		assert_int_equal(kvt_test_save_all(s, i, 0), 1);
	kvt_test_assert_check(s);
	kvt_seg_detach(s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_prefix, setup, teardown),
		cmocka_unit_test_setup_teardown(test_loaded_and_double_release, setup, teardown),
		cmocka_unit_test_setup_teardown(test_step, setup, teardown),
		cmocka_unit_test_setup_teardown(test_limits, setup, teardown),
		cmocka_unit_test_setup_teardown(test_reap_leases, setup, teardown),
		cmocka_unit_test_setup_teardown(test_pin_repair, setup, teardown),
		cmocka_unit_test_setup_teardown(test_dead_mid_transition, setup, teardown),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
