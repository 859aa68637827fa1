/* core_crash.c - workers on one segment are SIGKILLed at random points, the
 * dead are reaped while the others go on, and then the segment must check
 * clean, hold no corrupted chunk, and keep working (stress_engine.h).
 *
 * Each trial forks world rank writers and a scheduler (the scheduler also
 * reaps now and then, so reapers die too), kills one or two of them after
 * a random delay (the delay only decides where the kill lands; nothing is
 * timed), reaps from the parent's own CLIENT handle, waits until every
 * survivor has made progress again, stops everyone, releases what is left
 * with two steps per instance, and checks.  One trial in eight leaves the
 * dead unreaped: the next trial's workers re-attach their entries (attach
 * reaps a dead holder) and the scheduler's or the parent's reaps do the
 * rest.  The segment is reused across trials.
 *
 * Environment: KVTIER_CRASH_TRIALS (default 200; 40 under TSan), KVTIER_CRASH_SEED.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "stress_engine.h"

#define WORLD    3u
#define SLOTS    96u
#define PROMPTS  48u
#define FILL_MS  10u  /* a dead rank's chunks never complete: reclaim them soon */
#define EXPIRE   24u
#define PROGRESS 8u   /* successful operations each survivor must make */
#define HANG_S   60u  /* a wait this long is a hang: fail instead */

struct cr_state {
	char name[KVT_NAME_MAX + 1];
	struct se_shared *sh;
	kvt_seg *seg;                     /* CLIENT, instance 0: reaps, checks */
	kvt_seg *inst[WORLD + 1];         /* CLIENT per instance, for its steps */
	pid_t pids[WORLD + 1];
	struct se_cfg cfg;
};

static int setup(void **state)
{
	struct cr_state *t = calloc(1, sizeof(*t));

	if (!t)
		return -1;
	snprintf(t->name, sizeof(t->name), "t-crash-%d", (int)getpid());
	t->sh = se_shared_map();
	if (!t->sh) {
		free(t);
		return -1;
	}
	*state = t;
	return 0;
}

/* Runs even when the test failed: ends the workers, removes the segment. */
static int teardown(void **state)
{
	struct cr_state *t = *state;

	for (uint32_t i = 0; i <= WORLD; i++)
		if (t->pids[i] > 0) {
			kill(t->pids[i], SIGKILL);
			waitpid(t->pids[i], NULL, 0);
		}
	for (uint32_t i = 1; i <= WORLD; i++)
		if (t->inst[i])
			kvt_seg_detach(t->inst[i]);
	if (t->seg)
		kvt_seg_detach(t->seg);
	kvt_seg_unlink(t->name, NULL);
	munmap(t->sh, sizeof(*t->sh));
	free(t);
	return 0;
}

static void check_clean(struct cr_state *t, uint32_t trial)
{
	char msg[256];
	struct kvt_occupancy o;
	int r = kvt_check(t->seg, msg, sizeof(msg));

	if (r)
		fail_msg("trial %u (seed %#" PRIx64 "): kvt_check: %s", trial, t->cfg.seed, msg);
	kvt_occupancy_read(t->seg, &o);
	if (o.pinned || o.leases_live)
		fail_msg("trial %u: %" PRIu64 " slots pinned, %" PRIu64 " leases live after "
			 "every lease was released", trial, o.pinned, o.leases_live);
}

/* Reaps as kvtierd would, returning what it reaped. */
static uint64_t reap(struct cr_state *t, uint32_t trial)
{
	int r = kvt_seg_reap(t->seg);

	if (r < 0)
		fail_msg("trial %u: kvt_seg_reap = %d: %s", trial, r, kvt_core_last_error());
	return (uint64_t)r;
}

/* Two steps of every instance with nothing live: every lease goes. */
static uint64_t release_all(struct cr_state *t)
{
	uint64_t n = 0;

	for (uint32_t i = 0; i <= WORLD; i++)
		for (int k = 0; k < 2; k++) {
			int r = kvt_seg_step(i ? t->inst[i] : t->seg, NULL, 0);
			assert_true(r >= 0);
			n += (uint64_t)r;
		}
	return n;
}

/* Waits for the workers in `mask` to exit, reaping now and then meanwhile
 * (a survivor may wait on a slot frozen by a reaper that was killed, until
 * someone reaps that one).  Fails on a hang or a bad exit. */
static uint64_t wait_exit(struct cr_state *t, uint32_t mask, uint32_t trial)
{
	uint64_t t0 = se_now_ns(), last = t0, reaped = 0;

	while (mask) {
		for (uint32_t i = 0; i <= WORLD; i++) {
			int ws = 0;
			pid_t p;

			if (!(mask & (1u << i)))
				continue;
			p = waitpid(t->pids[i], &ws, WNOHANG);
			if (p == 0)
				continue;
			assert_int_equal(p, t->pids[i]);
			t->pids[i] = 0;
			mask &= ~(1u << i);
			if (!WIFEXITED(ws) || WEXITSTATUS(ws) != SE_EXIT_OK) {
				se_print_msgs(t->sh, WORLD + 1);
				fail_msg("trial %u (seed %#" PRIx64 "): worker %u ended with %s %d",
					 trial, t->cfg.seed, i, WIFEXITED(ws) ? "status" : "signal",
					 WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws));
			}
		}
		if (!mask)
			break;
		if (se_now_ns() - last > 20000000ULL) {
			reaped += reap(t, trial);
			last = se_now_ns();
		}
		if (se_now_ns() - t0 > HANG_S * 1000000000ULL)
			fail_msg("trial %u (seed %#" PRIx64 "): workers %#x did not stop", trial,
				 t->cfg.seed, mask);
		usleep(200);
	}
	return reaped;
}

static void test_crash(void **state)
{
	struct cr_state *t = *state;
	struct kvt_geometry g = se_geometry(WORLD, SLOTS, FILL_MS);
	struct kvt_seg_create_opts c = {
		.size = sizeof(c), .name = t->name, .geo = &g, .flags = KVT_SEG_F_REPLACE };
	struct kvt_seg_attach_opts a = {
		.size = sizeof(a), .name = t->name, .role = KVT_ROLE_CLIENT };
	/* TSan cannot see across processes (this test's workers are
	 * processes) and runs them ~10x slower: it gets fewer trials, the
	 * normal and ASan builds the full 200. */
#if defined(__SANITIZE_THREAD__)
	uint32_t trials = (uint32_t)se_env_u64("KVTIER_CRASH_TRIALS", 40);
#else
	uint32_t trials = (uint32_t)se_env_u64("KVTIER_CRASH_TRIALS", 200);
#endif
	uint64_t tot[SE__N] = { 0 }, kills = 0, reaped = 0, deferred = 0, stale = 0;
	uint64_t rng, t0 = se_now_ns();
	struct se_stats pst;

	t->cfg = (struct se_cfg){
		.name = t->name, .world = WORLD, .n_prompts = PROMPTS, .expire_steps = EXPIRE,
		.crash = 1, .sched_reaps = 1,
		.seed = se_env_u64("KVTIER_CRASH_SEED", se_now_ns() ^ (uint64_t)getpid()),
	};
	rng = t->cfg.seed;
	fprintf(stderr, "crash %s: %u trials, %u ranks + scheduler, seed %#" PRIx64
		" (KVTIER_CRASH_SEED)\n", t->name, trials, WORLD, t->cfg.seed);
	if (kvt_seg_create(&c, &a, &t->seg))
		fail_msg("create: %s", kvt_core_last_error());
	for (uint32_t i = 1; i <= WORLD; i++) {
		a.instance = i;
		if (kvt_seg_attach(&a, &t->inst[i]))
			fail_msg("attach instance %u: %s", i, kvt_core_last_error());
	}
	memset(&pst, 0, sizeof(pst));

	for (uint32_t trial = 0; trial < trials; trial++) {
		uint32_t all = (1u << (WORLD + 1)) - 1, victims = 0;
		uint64_t snap[WORLD + 1], r = se_rand(&rng);
		int wait_attach = r % 10 < 7, defer = (r >> 8) % 8 == 0;
		uint32_t nv = (r >> 16) % 4 == 0 ? 2 : 1;

		memset(t->sh, 0, sizeof(*t->sh));
		for (uint32_t i = 0; i <= WORLD; i++) {
			t->pids[i] = se_fork_worker(&t->cfg, t->sh, i, t->cfg.seed + trial);
			assert_true(t->pids[i] > 0);
		}
		if (wait_attach) {
			uint64_t w0 = se_now_ns();
			while (atomic_load(&t->sh->attached) < (int)WORLD + 1) {
				if (se_now_ns() - w0 > HANG_S * 1000000000ULL) {
					se_print_msgs(t->sh, WORLD + 1);
					fail_msg("trial %u: workers did not attach", trial);
				}
				usleep(50);
			}
		}
		usleep((useconds_t)(se_rand(&rng) % 3000));

		while (__builtin_popcount(victims) < (int)nv)
			victims |= 1u << (se_rand(&rng) % (WORLD + 1));
		for (uint32_t i = 0; i <= WORLD; i++)
			if (victims & (1u << i)) {
				int ws = 0;
				kill(t->pids[i], SIGKILL);
				assert_int_equal(waitpid(t->pids[i], &ws, 0), t->pids[i]);
				t->pids[i] = 0;
				kills++;
				if (!WIFSIGNALED(ws)) {
					se_print_msgs(t->sh, WORLD + 1);
					fail_msg("trial %u: worker %u had exited with status %d before "
						 "the kill", trial, i, WEXITSTATUS(ws));
				}
			}

		if (!defer) {
			reaped += reap(t, trial);
			/* The survivors keep working after the reap. */
			for (uint32_t i = 0; i <= WORLD; i++)
				snap[i] = atomic_load(&t->sh->st[i].c[SE_PROGRESS]);
			for (uint32_t i = 0; i <= WORLD; i++) {
				uint64_t w0 = se_now_ns(), last = w0;
				if (victims & (1u << i))
					continue;
				while (atomic_load(&t->sh->st[i].c[SE_PROGRESS]) < snap[i] + PROGRESS) {
					if (se_now_ns() - last > 20000000ULL) {
						reaped += reap(t, trial);
						last = se_now_ns();
					}
					if (se_now_ns() - w0 > HANG_S * 1000000000ULL) {
						se_print_msgs(t->sh, WORLD + 1);
						fail_msg("trial %u (seed %#" PRIx64 "): survivor %u made no "
							 "progress after the reap", trial, t->cfg.seed, i);
					}
					usleep(100);
				}
			}
		} else {
			deferred++;
			usleep((useconds_t)(se_rand(&rng) % 1000));
		}

		atomic_store(&t->sh->stop, 1);
		reaped += wait_exit(t, all & ~victims, trial);
		se_sum(t->sh, WORLD + 1, tot);
		if (atomic_load(&t->sh->st[0].have_msg) || tot[SE_BAD] || tot[SE_ERRORS]) {
			se_print_msgs(t->sh, WORLD + 1);
			if (tot[SE_BAD] || tot[SE_ERRORS])
				fail_msg("trial %u (seed %#" PRIx64 "): %" PRIu64 " corrupted reads, %"
					 PRIu64 " errors", trial, t->cfg.seed, tot[SE_BAD], tot[SE_ERRORS]);
		}
		if (defer)
			continue; /* the next trial's attaches and reaps repair it */

		reaped += reap(t, trial);
		stale += release_all(t);
		check_clean(t, trial);
		/* No corrupted chunk is left to be served either. */
		se_verify_all(&t->cfg, t->seg, &pst);
		if (atomic_load(&pst.c[SE_BAD]) || atomic_load(&pst.c[SE_ERRORS]))
			fail_msg("trial %u (seed %#" PRIx64 "): parent read: %s", trial,
				 t->cfg.seed, pst.msg);
	}

	/* The last trial may have been deferred. */
	reaped += reap(t, trials);
	stale += release_all(t);
	check_clean(t, trials);
	se_verify_all(&t->cfg, t->seg, &pst);
	for (int k = 0; k < SE__N; k++)
		tot[k] += atomic_load(&pst.c[k]);
	se_print_stats("crash totals", tot);
	fprintf(stderr, "crash: %u trials in %.2f s: %" PRIu64 " kills, %" PRIu64
		" entries reaped by the parent (the scheduler reaped %" PRIu64 "), %" PRIu64
		" trials left to re-attach, %" PRIu64 " leases released by final steps\n",
		trials, (double)(se_now_ns() - t0) / 1e9, kills, reaped, tot[SE_REAPED],
		deferred, stale);
	assert_int_equal(tot[SE_BAD], 0);
	assert_int_equal(tot[SE_ERRORS], 0);
	if (trials >= 20) {
		assert_true(reaped + tot[SE_REAPED] > 0);
		assert_true(tot[SE_VERIFIED] > 0);
		assert_true(tot[SE_SAVED] > 0);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_crash, setup, teardown),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
