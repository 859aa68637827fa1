/* core_preempt.c - the bounded preemption stress (preempt_engine.h): random
 * delays at every schedule point, slow and fast writers, many keys over
 * few slots, in processes and in threads, replicated and sharded.  0 wrong
 * bytes, 0 lost claims of live writers, kvt_check clean.
 *
 * Environment: KVTIER_PREEMPT_OPS (per worker, default 1500; 400 under
 * sanitizers), KVTIER_PREEMPT_SEED.  The long run is `kvtier-bench preempt`.
 */
#include "kvt_test.h"
#include "preempt_engine.h"
#include "sp_ctl.h"

#ifdef KVTIER_SANITIZED
#define DEF_OPS 400u
#else
#define DEF_OPS 1500u
#endif

static char NAME[64];

static int setup(void **st)
{
	(void)st;
	snprintf(NAME, sizeof(NAME), "t-preempt-%d", (int)getpid());
	if (!sp_init())
		return -1;
	atomic_store(&sp_ctl->delay_permille, 30);
	atomic_store(&sp_ctl->delay_max_us, 300);
	return 0;
}

static int teardown(void **st)
{
	(void)st;
	kvt_seg_unlink(NAME, NULL);
	sp_fini();
	return 0;
}

static void run(uint32_t world, int replicated, int threads, uint32_t workers)
{
	struct pe_cfg cfg = {
		.name = NAME, .world = world, .replicated = replicated, .slots = 4,
		.keys = 16, .workers = workers, .slow = workers / 2, .slow_us = 2000,
		.ops = se_env_u64("KVTIER_PREEMPT_OPS", DEF_OPS), .fill_ms = 2,
		.threads = threads,
		.seed = se_env_u64("KVTIER_PREEMPT_SEED", kvt__now_ns() ^ (uint64_t)getpid()),
	};
	struct pe_result res;
	char what[160];
	uint64_t d0 = atomic_load(&sp_ctl->delays);

	snprintf(what, sizeof(what), "preempt %s world %u, %u %s (%u slow), seed %#" PRIx64,
		 replicated ? "replicated" : "sharded", world, workers,
		 threads ? "threads" : "processes", cfg.slow, cfg.seed);
	assert_int_equal(pe_run(&cfg, &res), 0);
	pe_print(stderr, what, &res);
	fprintf(stderr, " delays injected at schedule points: %" PRIu64 "\n",
		(uint64_t)(atomic_load(&sp_ctl->delays) - d0));
	if (!pe_ok(&res))
		fail_msg("%s: the run broke an invariant (see above)", what);
	assert_true(res.tot[PE_VERIFIED] > 0);
	assert_true(res.tot[PE_MADE_READY] > 0);
	assert_true(res.counters[KVT_C_EVICTIONS] > 0);
}

static void test_replicated_processes(void **st) { (void)st; run(2, 1, 0, 8); }
static void test_sharded_processes(void **st) { (void)st; run(2, 0, 0, 8); }
static void test_replicated_threads(void **st) { (void)st; run(2, 1, 1, 6); }
static void test_sharded_threads(void **st) { (void)st; run(4, 0, 1, 8); }

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_replicated_processes, setup, teardown),
		cmocka_unit_test_setup_teardown(test_sharded_processes, setup, teardown),
		cmocka_unit_test_setup_teardown(test_replicated_threads, setup, teardown),
		cmocka_unit_test_setup_teardown(test_sharded_threads, setup, teardown),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
