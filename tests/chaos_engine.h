/* chaos_engine.h - kill -9 trials over a running multi-process workload
 * (stress_engine.h), shared by the CTest test_core_crash (200 trials) and
 * `kvtier-bench chaos` (the long run, figures in docs/BENCHMARKS.md).
 *
 * Each trial forks `world` rank writers and a scheduler (the scheduler
 * also reaps now and then, so reapers die too), kills one or two of them
 * after a random delay (the delay only decides where the kill lands;
 * nothing is timed), reaps from the parent's own CLIENT handle as kvtierd
 * would, waits until every survivor has made progress again, stops
 * everyone, releases what is left with two steps per instance, and checks:
 * kvt_check clean, no slot pinned and no lease live, and every READY chunk
 * read back against its stamp (se_verify_all).  One trial in eight leaves
 * the dead unreaped: the next trial's workers re-attach their entries
 * (attach reaps a dead holder) and the scheduler's or the parent's reaps
 * do the rest.  The segment is reused across trials.
 *
 * A failure stops the run with a message in res->msg (the trial and the
 * seed that reproduce it); nothing here calls cmocka.
 */
#ifndef CHAOS_ENGINE_H
#define CHAOS_ENGINE_H

#include "stress_engine.h"

#define CH_MAX_WORLD SE_MAX_WORLD
#define CH_PROGRESS  8u   /* successful operations each survivor must make */
#define CH_HANG_S    60u  /* a wait this long is a hang: fail instead */

struct chaos_opts {
	const char *name;     /* segment name */
	uint32_t world;       /* rank processes (+ 1 scheduler) */
	uint32_t slots;
	uint32_t prompts;
	uint32_t fill_ms;     /* a dead rank's chunks never complete: reclaim soon */
	uint32_t expire;      /* steps before the scheduler drops a published lease */
	uint32_t trials;
	uint64_t seed;
	int quiet;            /* no progress lines */
};

struct chaos_result {
	uint64_t tot[SE__N];  /* the workers' and the parent's counters */
	uint64_t kills, reaped, deferred, stale, trials_done;
	uint64_t ns;
	char msg[640];        /* why it failed */
};

struct chaos_state {
	const struct chaos_opts *o;
	struct chaos_result *res;
	struct se_shared *sh;
	kvt_seg *seg;                          /* CLIENT, instance 0: reaps, checks */
	kvt_seg *inst[CH_MAX_WORLD + 1];       /* CLIENT per instance, for its steps */
	pid_t pids[CH_MAX_WORLD + 1];
	struct se_cfg cfg;
};

#define CH_FAIL(t, ...) do {                                                     \
		snprintf((t)->res->msg, sizeof((t)->res->msg), __VA_ARGS__);     \
		return -1;                                                       \
	} while (0)

static inline int ch_check_clean(struct chaos_state *t, uint32_t trial)
{
	char msg[256];
	struct kvt_occupancy o;

	if (kvt_check(t->seg, msg, sizeof(msg)))
		CH_FAIL(t, "trial %u (seed %#" PRIx64 "): kvt_check: %s", trial, t->cfg.seed, msg);
	kvt_occupancy_read(t->seg, &o);
	if (o.pinned || o.leases_live)
		CH_FAIL(t, "trial %u (seed %#" PRIx64 "): %" PRIu64 " slots pinned, %" PRIu64
			" leases live after every lease was released", trial, t->cfg.seed,
			o.pinned, o.leases_live);
	return 0;
}

/* Reaps as kvtierd would. */
static inline int ch_reap(struct chaos_state *t, uint32_t trial)
{
	int r = kvt_seg_reap(t->seg);

	if (r < 0)
		CH_FAIL(t, "trial %u: kvt_seg_reap = %d: %s", trial, r, kvt_core_last_error());
	t->res->reaped += (uint64_t)r;
	return 0;
}

/* Two steps of every instance with nothing live: every lease goes. */
static inline int ch_release_all(struct chaos_state *t)
{
	for (uint32_t i = 0; i <= t->o->world; i++)
		for (int k = 0; k < 2; k++) {
			int r = kvt_seg_step(i ? t->inst[i] : t->seg, NULL, 0);
			if (r < 0)
				CH_FAIL(t, "kvt_seg_step: %s", kvt_core_last_error());
			t->res->stale += (uint64_t)r;
		}
	return 0;
}

/* Waits for the workers in `mask` to exit, reaping now and then meanwhile
 * (a survivor may wait on a slot frozen by a reaper that was killed, until
 * someone reaps that one).  Fails on a hang or a bad exit. */
static inline int ch_wait_exit(struct chaos_state *t, uint32_t mask, uint32_t trial)
{
	uint64_t t0 = kvt__now_ns(), last = t0;
	uint32_t world = t->o->world;

	while (mask) {
		for (uint32_t i = 0; i <= world; i++) {
			int ws = 0;
			pid_t p;

			if (!(mask & (1u << i)))
				continue;
			p = waitpid(t->pids[i], &ws, WNOHANG);
			if (p == 0)
				continue;
			if (p != t->pids[i])
				CH_FAIL(t, "trial %u: waitpid: %s", trial, strerror(errno));
			t->pids[i] = 0;
			mask &= ~(1u << i);
			if (!WIFEXITED(ws) || WEXITSTATUS(ws) != SE_EXIT_OK) {
				se_print_msgs(t->sh, world + 1);
				CH_FAIL(t, "trial %u (seed %#" PRIx64 "): worker %u ended with %s %d",
					trial, t->cfg.seed, i, WIFEXITED(ws) ? "status" : "signal",
					WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws));
			}
		}
		if (!mask)
			break;
		if (kvt__now_ns() - last > 20000000ULL) {
			if (ch_reap(t, trial))
				return -1;
			last = kvt__now_ns();
		}
		if (kvt__now_ns() - t0 > CH_HANG_S * 1000000000ULL)
			CH_FAIL(t, "trial %u (seed %#" PRIx64 "): workers %#x did not stop", trial,
				t->cfg.seed, mask);
		usleep(200);
	}
	return 0;
}

/* Kills every worker still running and reaps their pids (teardown). */
static inline void ch_kill_all(struct chaos_state *t)
{
	for (uint32_t i = 0; i <= t->o->world; i++)
		if (t->pids[i] > 0) {
			kvt_kill_pid(t->pids[i], SIGKILL);
			waitpid(t->pids[i], NULL, 0);
			t->pids[i] = 0;
		}
}

static inline int ch_trial(struct chaos_state *t, uint32_t trial, uint64_t *rng,
			   struct se_stats *pst)
{
	uint32_t world = t->o->world, all = (1u << (world + 1)) - 1, victims = 0;
	uint64_t snap[CH_MAX_WORLD + 1], tot[SE__N] = { 0 }, r = se_rand(rng);
	int wait_attach = r % 10 < 7, defer = (r >> 8) % 8 == 0;
	uint32_t nv = (r >> 16) % 4 == 0 ? 2 : 1;

	memset(t->sh, 0, sizeof(*t->sh));
	for (uint32_t i = 0; i <= world; i++) {
		t->pids[i] = se_fork_worker(&t->cfg, t->sh, i, t->cfg.seed + trial);
		if (t->pids[i] <= 0)
			CH_FAIL(t, "trial %u: fork: %s", trial, strerror(errno));
	}
	if (wait_attach) {
		uint64_t w0 = kvt__now_ns();
		while (atomic_load(&t->sh->attached) < (int)world + 1) {
			if (kvt__now_ns() - w0 > CH_HANG_S * 1000000000ULL) {
				se_print_msgs(t->sh, world + 1);
				CH_FAIL(t, "trial %u: workers did not attach", trial);
			}
			usleep(50);
		}
	}
	usleep((useconds_t)(se_rand(rng) % 3000));

	while (__builtin_popcount(victims) < (int)nv)
		victims |= 1u << (se_rand(rng) % (world + 1));
	for (uint32_t i = 0; i <= world; i++)
		if (victims & (1u << i)) {
			int ws = 0;
			kvt_kill_pid(t->pids[i], SIGKILL);
			if (waitpid(t->pids[i], &ws, 0) != t->pids[i])
				CH_FAIL(t, "trial %u: waitpid: %s", trial, strerror(errno));
			t->pids[i] = 0;
			t->res->kills++;
			if (!WIFSIGNALED(ws)) {
				se_print_msgs(t->sh, world + 1);
				CH_FAIL(t, "trial %u: worker %u had exited with status %d before "
					"the kill", trial, i, WEXITSTATUS(ws));
			}
		}

	if (!defer) {
		if (ch_reap(t, trial))
			return -1;
		/* The survivors keep working after the reap. */
		for (uint32_t i = 0; i <= world; i++)
			snap[i] = atomic_load(&t->sh->st[i].c[SE_PROGRESS]);
		for (uint32_t i = 0; i <= world; i++) {
			uint64_t w0 = kvt__now_ns(), last = w0;
			if (victims & (1u << i))
				continue;
			while (atomic_load(&t->sh->st[i].c[SE_PROGRESS]) < snap[i] + CH_PROGRESS) {
				if (kvt__now_ns() - last > 20000000ULL) {
					if (ch_reap(t, trial))
						return -1;
					last = kvt__now_ns();
				}
				if (kvt__now_ns() - w0 > CH_HANG_S * 1000000000ULL) {
					se_print_msgs(t->sh, world + 1);
					CH_FAIL(t, "trial %u (seed %#" PRIx64 "): survivor %u made no "
						"progress after the reap", trial, t->cfg.seed, i);
				}
				usleep(100);
			}
		}
	} else {
		t->res->deferred++;
		usleep((useconds_t)(se_rand(rng) % 1000));
	}

	atomic_store(&t->sh->stop, 1);
	if (ch_wait_exit(t, all & ~victims, trial))
		return -1;
	se_sum(t->sh, world + 1, tot);
	for (int k = 0; k < SE__N; k++)
		t->res->tot[k] += tot[k];
	if (atomic_load(&t->sh->st[0].have_msg) || tot[SE_BAD] || tot[SE_ERRORS]) {
		se_print_msgs(t->sh, world + 1);
		if (tot[SE_BAD] || tot[SE_ERRORS])
			CH_FAIL(t, "trial %u (seed %#" PRIx64 "): %" PRIu64 " corrupted reads, %"
				PRIu64 " errors", trial, t->cfg.seed, tot[SE_BAD], tot[SE_ERRORS]);
	}
	if (defer)
		return 0; /* the next trial's attaches and reaps repair it */

	if (ch_reap(t, trial) || ch_release_all(t) || ch_check_clean(t, trial))
		return -1;
	/* No corrupted chunk is left to be served either. */
	se_verify_all(&t->cfg, t->seg, pst);
	if (atomic_load(&pst->c[SE_BAD]) || atomic_load(&pst->c[SE_ERRORS]))
		CH_FAIL(t, "trial %u (seed %#" PRIx64 "): parent read: %s", trial, t->cfg.seed,
			pst->msg);
	return 0;
}

/* The whole run: creates the segment, runs o->trials trials, and checks
 * once more at the end.  0, or -1 with res->msg; the segment is removed
 * either way. */
static inline int chaos_run(const struct chaos_opts *o, struct chaos_result *res)
{
	struct chaos_state st, *t = &st;
	struct kvt_geometry g;
	struct kvt_seg_create_opts c;
	struct kvt_seg_attach_opts a;
	struct se_stats pst;
	uint64_t rng, t0 = kvt__now_ns();
	int rc = -1;

	memset(res, 0, sizeof(*res));
	memset(&st, 0, sizeof(st));
	t->o = o;
	t->res = res;
	if (o->world < 1 || o->world > CH_MAX_WORLD) {
		snprintf(res->msg, sizeof(res->msg), "world %u: 1..%u", o->world, CH_MAX_WORLD);
		return -1;
	}
	t->sh = se_shared_map();
	if (!t->sh) {
		snprintf(res->msg, sizeof(res->msg), "shared map: %s", strerror(errno));
		return -1;
	}
	g = se_geometry(o->world, o->slots, o->fill_ms);
	c = (struct kvt_seg_create_opts){ .size = sizeof(c), .name = o->name, .geo = &g,
					  .flags = KVT_SEG_F_REPLACE };
	a = (struct kvt_seg_attach_opts){ .size = sizeof(a), .name = o->name,
					  .role = KVT_ROLE_CLIENT };
	t->cfg = (struct se_cfg){
		.name = o->name, .world = o->world, .n_prompts = o->prompts,
		.expire_steps = o->expire, .crash = 1, .sched_reaps = 1, .seed = o->seed,
	};
	rng = o->seed;
	if (kvt_seg_create(&c, &a, &t->seg)) {
		snprintf(res->msg, sizeof(res->msg), "create: %s", kvt_core_last_error());
		goto out;
	}
	for (uint32_t i = 1; i <= o->world; i++) {
		a.instance = i;
		if (kvt_seg_attach(&a, &t->inst[i])) {
			snprintf(res->msg, sizeof(res->msg), "attach instance %u: %s", i,
				 kvt_core_last_error());
			goto out;
		}
	}
	memset(&pst, 0, sizeof(pst));
	for (uint32_t trial = 0; trial < o->trials; trial++) {
		if (ch_trial(t, trial, &rng, &pst))
			goto out;
		res->trials_done++;
		if (!o->quiet && (trial + 1) % 100 == 0)
			fprintf(stderr, "chaos: %u trials, %" PRIu64 " kills, %" PRIu64 " chunks "
				"verified, 0 corrupted\n", trial + 1, res->kills,
				res->tot[SE_VERIFIED] + atomic_load(&pst.c[SE_VERIFIED]));
	}
	/* The last trial may have been deferred. */
	if (ch_reap(t, o->trials) || ch_release_all(t) || ch_check_clean(t, o->trials))
		goto out;
	se_verify_all(&t->cfg, t->seg, &pst);
	for (int k = 0; k < SE__N; k++)
		res->tot[k] += atomic_load(&pst.c[k]);
	if (res->tot[SE_BAD] || res->tot[SE_ERRORS]) {
		snprintf(res->msg, sizeof(res->msg), "%" PRIu64 " corrupted reads, %" PRIu64
			 " errors: %s", res->tot[SE_BAD], res->tot[SE_ERRORS], pst.msg);
		goto out;
	}
	rc = 0;
out:
	ch_kill_all(t);
	for (uint32_t i = 1; i <= o->world; i++)
		if (t->inst[i])
			kvt_seg_detach(t->inst[i]);
	if (t->seg)
		kvt_seg_detach(t->seg);
	kvt_seg_unlink(o->name, NULL);
	munmap(t->sh, sizeof(*t->sh));
	res->ns = kvt__now_ns() - t0;
	return rc;
}

#endif
