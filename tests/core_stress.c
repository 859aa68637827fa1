/* core_stress.c - N processes (and, for TSan, N threads) hammer one segment:
 * saves, lookups, pins, loads, releases, steps and eviction through a small
 * arena, every pinned read checked against its stamp (stress_engine.h).
 *
 * Environment: KVTIER_STRESS_OPS (operations per rank process, default
 * 100000), KVTIER_STRESS_THREAD_OPS (per rank thread, default 50000),
 * KVTIER_STRESS_SEED.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <pthread.h>
#include <cmocka.h>

#include "stress_engine.h"

#define WORLD     4u
#define SLOTS     96u /* 512 keys over a 96-slot arena: eviction all the time */
#define PROMPTS   64u
#define FILL_MS   10u  /* partial chunks (a rank met -ENOSPC) are reclaimed */
#define EXPIRE    24u  /* steps before the scheduler drops a published lease */

/* The same in every build: with sanitizers both variants still take only a
 * few seconds on two cores. */
#define DEF_OPS        100000u
#define DEF_THREAD_OPS 50000u

struct st_state {
	char name[KVT_NAME_MAX + 1];
	struct se_shared *sh;
	kvt_seg *seg;
	pid_t pids[SE_MAX_WORLD + 1];
	struct se_cfg cfg;
};

static int setup(void **state)
{
	static unsigned n;
	struct st_state *t = calloc(1, sizeof(*t));

	if (!t)
		return -1;
	snprintf(t->name, sizeof(t->name), "t-stress-%d-%u", (int)getpid(), n++);
	t->sh = se_shared_map();
	if (!t->sh) {
		free(t);
		return -1;
	}
	*state = t;
	return 0;
}

/* Runs even when the test failed: stops the workers, removes the segment. */
static int teardown(void **state)
{
	struct st_state *t = *state;

	for (uint32_t i = 0; i <= SE_MAX_WORLD; i++)
		if (t->pids[i] > 0) {
			kvt_kill_pid(t->pids[i], SIGKILL);
			waitpid(t->pids[i], NULL, 0);
		}
	if (t->seg)
		kvt_seg_detach(t->seg);
	kvt_seg_unlink(t->name, NULL);
	munmap(t->sh, sizeof(*t->sh));
	free(t);
	return 0;
}

static void start(struct st_state *t, uint64_t ops)
{
	struct kvt_geometry g = se_geometry(WORLD, SLOTS, FILL_MS);
	struct kvt_seg_create_opts c = {
		.size = sizeof(c), .name = t->name, .geo = &g, .flags = KVT_SEG_F_REPLACE };
	struct kvt_seg_attach_opts a = {
		.size = sizeof(a), .role = KVT_ROLE_CLIENT, .instance = 0 };
	int r;

	t->cfg = (struct se_cfg){
		.name = t->name, .world = WORLD, .n_prompts = PROMPTS,
		.ops = ops, .expire_steps = EXPIRE,
		.seed = se_env_u64("KVTIER_STRESS_SEED", kvt__now_ns() ^ (uint64_t)getpid()),
	};
	fprintf(stderr, "stress %s: %u ranks x %" PRIu64 " ops + scheduler, seed %#" PRIx64
		" (KVTIER_STRESS_SEED)\n", t->name, WORLD, ops, t->cfg.seed);
	r = kvt_seg_create(&c, &a, &t->seg);
	if (r)
		fprintf(stderr, "create: %s\n", kvt_core_last_error());
	assert_int_equal(r, 0);
}

static void assert_check(kvt_seg *s)
{
	char msg[256];
	int r = kvt_check(s, msg, sizeof(msg));

	if (r)
		fprintf(stderr, "kvt_check: %s\n", msg);
	assert_int_equal(r, 0);
}

/* The checks shared by both variants, once every worker has stopped. */
static void finish(struct st_state *t, const int *status)
{
	uint32_t workers = WORLD + 1;
	uint64_t tot[SE__N] = { 0 }, v[KVT_C__COUNT];
	struct se_stats pst;
	struct kvt_occupancy o;

	se_print_msgs(t->sh, workers);
	se_sum(t->sh, workers, tot);
	for (uint32_t i = 0; i < workers; i++)
		assert_int_equal(status[i], SE_EXIT_OK);
	assert_int_equal(tot[SE_BAD], 0);
	assert_int_equal(tot[SE_ERRORS], 0);

	/* Quiescent, leases still held: pins equal lease references. */
	assert_check(t->seg);

	/* Every READY chunk, read once more by a process that did not write it. */
	memset(&pst, 0, sizeof(pst));
	se_verify_all(&t->cfg, t->seg, &pst);
	if (atomic_load(&pst.have_msg))
		fprintf(stderr, "parent: %s\n", pst.msg);
	assert_int_equal(atomic_load(&pst.c[SE_BAD]), 0);
	assert_int_equal(atomic_load(&pst.c[SE_ERRORS]), 0);

	/* Two steps of every instance with nothing live release every lease. */
	for (uint32_t inst = 0; inst <= WORLD; inst++) {
		struct kvt_seg_attach_opts a = {
			.size = sizeof(a), .name = t->name, .role = KVT_ROLE_CLIENT,
			.instance = inst };
		kvt_seg *h = t->seg;
		if (inst && kvt_seg_attach(&a, &h) != 0)
			fail_msg("attach for instance %u: %s", inst, kvt_core_last_error());
		for (int k = 0; k < 2; k++) {
			int r = kvt_seg_step(h, NULL, 0);
			assert_true(r >= 0);
			atomic_fetch_add(&pst.c[SE_STALE], (uint64_t)r);
		}
		if (inst)
			kvt_seg_detach(h);
	}
	for (int c = 0; c < SE__N; c++)
		tot[c] += atomic_load(&pst.c[c]);
	se_print_stats("stress totals", tot);

	/* No pin outlives its lease; slots are conserved. */
	assert_check(t->seg);
	kvt_occupancy_read(t->seg, &o);
	fprintf(stderr, "occupancy: free %" PRIu64 " filling %" PRIu64 " ready %" PRIu64
		" evicting %" PRIu64 " pinned %" PRIu64 " leases %" PRIu64 "\n", o.free,
		o.filling, o.ready, o.evicting, o.pinned, o.leases_live);
	assert_int_equal(o.pinned, 0);
	assert_int_equal(o.leases_live, 0);
	assert_int_equal(o.evicting, 0);
	assert_int_equal(o.free + o.filling + o.ready, SLOTS);

	/* The segment's counters agree with what the workers saw. */
	kvt_counters_read(t->seg, v);
	for (int c = 0; c < KVT_C__COUNT; c++)
		fprintf(stderr, "%s %s=%" PRIu64, c % 6 ? "" : "\n ", kvt_counter_name(c), v[c]);
	fprintf(stderr, "\n");
	assert_int_equal(v[KVT_C_LOOKUPS], tot[SE_LOOKUPS]);
	assert_int_equal(v[KVT_C_HIT_CHUNKS], tot[SE_HITS]);
	assert_int_equal(v[KVT_C_SAVED_CHUNKS], tot[SE_SAVED]);
	assert_int_equal(v[KVT_C_SAVE_SKIPS], tot[SE_WRITE_SKIP]);
	assert_int_equal(v[KVT_C_SAVE_NOSPC], tot[SE_WRITE_NOSPC]);
	assert_int_equal(v[KVT_C_LEASES_FULL], tot[SE_LOOKUP_NOSPC]);
	assert_int_equal(v[KVT_C_DOUBLE_UNPINS], tot[SE_EALREADY]);
	assert_int_equal(tot[SE_EALREADY], tot[SE_DOUBLE]);
	assert_int_equal(v[KVT_C_STALE_UNPINS], tot[SE_STALE]);
	assert_true(v[KVT_C_FILL_ABORTS] >= tot[SE_WRITE_ABORTS]);
	assert_int_equal(v[KVT_C_REAPED_RANKS], 0);
	/* ... and, in a run of the default length, every path was taken. */
	if (t->cfg.ops < 20000)
		return;
	assert_true(tot[SE_SAVED] > 0);
	assert_true(tot[SE_MADE_READY] > 0);
	assert_true(tot[SE_HITS] > 0);
	assert_true(tot[SE_VERIFIED] > 0);
	assert_true(v[KVT_C_EVICTIONS] > 0);
	assert_true(tot[SE_DOUBLE] > 0);
	assert_true(tot[SE_STALE] > 0);
	assert_true(tot[SE_LOAD_RELEASED] > 0);
	assert_true(tot[SE_BOX_LOADS] > 0);
}

static void test_stress_processes(void **state)
{
	struct st_state *t = *state;
	int status[SE_MAX_WORLD + 1] = { 0 };
	uint64_t t0;

	start(t, se_env_u64("KVTIER_STRESS_OPS", DEF_OPS));
	t0 = kvt__now_ns();
	for (uint32_t i = 0; i <= WORLD; i++) {
		t->pids[i] = se_fork_worker(&t->cfg, t->sh, i, t->cfg.seed);
		assert_true(t->pids[i] > 0);
	}
	/* The ranks run their operations; then the scheduler is stopped. */
	for (uint32_t i = 0; i <= WORLD; i++) {
		int ws = 0;
		if (i == WORLD)
			atomic_store(&t->sh->stop, 1);
		assert_int_equal(waitpid(t->pids[i], &ws, 0), t->pids[i]);
		t->pids[i] = 0;
		status[i] = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
	}
	fprintf(stderr, "processes done in %.2f s\n", (double)(kvt__now_ns() - t0) / 1e9);
	finish(t, status);
}

struct thr {
	struct st_state *t;
	uint32_t id;
	int status;
	pthread_t th;
};

static void *thr_main(void *arg)
{
	struct thr *x = arg;

	x->status = se_worker_run(&x->t->cfg, x->t->sh, x->id, x->t->cfg.seed, x->t->seg);
	return NULL;
}

/* The same in threads, all on the creator's mapping, so that TSan sees the
 * orderings (it cannot see across processes, nor across two mappings). */
static void test_stress_threads(void **state)
{
	struct st_state *t = *state;
	struct thr x[SE_MAX_WORLD + 1];
	int status[SE_MAX_WORLD + 1] = { 0 };
	uint64_t t0;

	start(t, se_env_u64("KVTIER_STRESS_THREAD_OPS", DEF_THREAD_OPS));
	t0 = kvt__now_ns();
	for (uint32_t i = 0; i <= WORLD; i++) {
		x[i] = (struct thr){ .t = t, .id = i };
		assert_int_equal(pthread_create(&x[i].th, NULL, thr_main, &x[i]), 0);
	}
	for (uint32_t i = 0; i <= WORLD; i++) {
		if (i == WORLD)
			atomic_store(&t->sh->stop, 1);
		assert_int_equal(pthread_join(x[i].th, NULL), 0);
		status[i] = x[i].status;
	}
	fprintf(stderr, "threads done in %.2f s\n", (double)(kvt__now_ns() - t0) / 1e9);
	finish(t, status);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_stress_processes, setup, teardown),
		cmocka_unit_test_setup_teardown(test_stress_threads, setup, teardown),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
