/* core_crash.c - workers on one segment are SIGKILLed at random points, the
 * dead are reaped while the others go on, and then the segment must check
 * clean, hold no corrupted chunk, and keep working: the trials of
 * chaos_engine.h (on stress_engine.h), 200 of them here; `kvtier-bench
 * chaos` runs the same trials by the thousand.
 *
 * Environment: KVTIER_CRASH_TRIALS (default 200; 40 under TSan), KVTIER_CRASH_SEED.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "chaos_engine.h"

#define WORLD    3u
#define SLOTS    96u
#define PROMPTS  48u
#define FILL_MS  10u  /* a dead rank's chunks never complete: reclaim them soon */
#define EXPIRE   24u

static void test_crash(void **state)
{
	(void)state;
	char name[KVT_NAME_MAX + 1];
	struct chaos_result res;
	/* TSan cannot see across processes (this test's workers are
	 * processes) and runs them ~10x slower: it gets fewer trials, the
	 * normal and ASan builds the full 200. */
#if defined(__SANITIZE_THREAD__)
	uint32_t trials = (uint32_t)se_env_u64("KVTIER_CRASH_TRIALS", 40);
#else
	uint32_t trials = (uint32_t)se_env_u64("KVTIER_CRASH_TRIALS", 200);
#endif
	struct chaos_opts o = {
		.name = name, .world = WORLD, .slots = SLOTS, .prompts = PROMPTS,
		.fill_ms = FILL_MS, .expire = EXPIRE, .trials = trials, .quiet = 1,
		.seed = se_env_u64("KVTIER_CRASH_SEED", kvt__now_ns() ^ (uint64_t)getpid()),
	};

	snprintf(name, sizeof(name), "t-crash-%d", (int)getpid());
	fprintf(stderr, "crash %s: %u trials, %u ranks + scheduler, seed %#" PRIx64
		" (KVTIER_CRASH_SEED)\n", name, trials, WORLD, o.seed);
	if (chaos_run(&o, &res))
		fail_msg("%s", res.msg);
	se_print_stats("crash totals", res.tot);
	fprintf(stderr, "crash: %u trials in %.2f s: %" PRIu64 " kills, %" PRIu64
		" entries reaped by the parent (the scheduler reaped %" PRIu64 "), %" PRIu64
		" trials left to re-attach, %" PRIu64 " leases released by final steps\n",
		trials, (double)res.ns / 1e9, res.kills, res.reaped, res.tot[SE_REAPED],
		res.deferred, res.stale);
	assert_int_equal(res.tot[SE_BAD], 0);
	assert_int_equal(res.tot[SE_ERRORS], 0);
	if (trials >= 20) {
		assert_true(res.reaped + res.tot[SE_REAPED] > 0);
		assert_true(res.tot[SE_VERIFIED] > 0);
		assert_true(res.tot[SE_SAVED] > 0);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_crash),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
