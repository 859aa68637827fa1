/* sp_ctl.h - the test side of the schedule points (core/kvt_sp.h): pause a
 * worker exactly at a named step, run other operations, resume it; kill
 * it there; or delay workers at random points (preemption stress).
 *
 * The control block lives in a MAP_SHARED anonymous mapping made before
 * fork, so every process of a test sees it.  Workers are numbered
 * 0..SP_WORKERS-1: a process sets sp_me after fork (and may answer to a
 * second id, sp_alias, to carry two arms at once); a thread sets sp_tme.
 * Each worker has its own arm (point, action, hits to let pass), so
 * several can be paused at once at different points.
 *
 * Links with kvtier_core_sp (KVT_SCHEDULE_POINTS).
 */
#ifndef SP_CTL_H
#define SP_CTL_H

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvt_clock.h"
#include "kvt_mix.h"
#include "kvt_sp.h"
#include "safe_kill.h"

#ifndef KVT_SCHEDULE_POINTS
#error "sp_ctl.h needs core built with KVT_SCHEDULE_POINTS (link kvtier_core_sp)"
#endif

#define SP_WORKERS 32
enum { SP_NONE = 0, SP_PAUSE = 1, SP_KILL = 2 };

struct sp_arm {
	_Atomic int point;    /* -1: none */
	_Atomic int action;
	_Atomic int skip;     /* hits of the point to let pass first */
	_Atomic int arrived;  /* point + 1 where the worker waits, 0: not paused */
	_Atomic int resume;   /* bumped by the controller */
};

struct sp_ctl {
	struct sp_arm arm[SP_WORKERS];
	_Atomic uint64_t hits[KVT_SP__COUNT];
	_Atomic uint32_t delay_permille; /* preemption stress: chance of a delay */
	_Atomic uint32_t delay_max_us;
	_Atomic uint64_t delays;
};

static struct sp_ctl *sp_ctl;
static int sp_me = 0;                 /* this process's worker id */
static int sp_alias = -1;             /* a second id the process answers to */
static _Thread_local int sp_tme = -1; /* a thread's id, -1: use sp_me */
static _Thread_local uint64_t sp_rng;

static inline uint64_t sp_rand(void)
{
	if (!sp_rng)
		sp_rng = (uint64_t)getpid() * 0x9e3779b97f4a7c15ULL ^ (uint64_t)(uintptr_t)&sp_rng;
	return kvt__mix64(sp_rng += 0x9e3779b97f4a7c15ULL);
}

static inline void sp_sleep_us(uint64_t us)
{
	struct timespec ts = { (time_t)(us / 1000000), (long)(us % 1000000) * 1000 };

	nanosleep(&ts, NULL);
}

/* Acts on worker arm `a` if it is armed at `sp`. */
static void sp_act(struct sp_arm *a, enum kvt_sp sp)
{
	int p = (int)sp;

	if (atomic_load(&a->point) != p)
		return;
	if (atomic_load(&a->skip) > 0) {
		atomic_fetch_sub(&a->skip, 1);
		return;
	}
	if (!atomic_compare_exchange_strong(&a->point, &p, -1))
		return;
	if (atomic_load(&a->action) == SP_KILL)
		kill(getpid(), SIGKILL);
	int gen = atomic_load(&a->resume);
	atomic_store(&a->arrived, (int)sp + 1);
	while (atomic_load(&a->resume) == gen)
		sp_sleep_us(100);
	atomic_store(&a->arrived, 0);
}

static void sp_hook(enum kvt_sp sp, const struct kvt_seg *s, void *arg)
{
	struct sp_ctl *c = arg;
	int me = sp_tme >= 0 ? sp_tme : sp_me;
	(void)s;

	atomic_fetch_add_explicit(&c->hits[sp], 1, memory_order_relaxed);
	uint32_t pm = atomic_load_explicit(&c->delay_permille, memory_order_relaxed);
	if (pm && sp_rand() % 1000 < pm) {
		uint32_t max = atomic_load_explicit(&c->delay_max_us, memory_order_relaxed);
		uint64_t r = sp_rand();
		atomic_fetch_add_explicit(&c->delays, 1, memory_order_relaxed);
		if (r % 4 == 0 || !max)
			sched_yield();
		else
			sp_sleep_us(r % (max + 1));
	}
	if (me >= 0 && me < SP_WORKERS)
		sp_act(&c->arm[me], sp);
	if (sp_tme < 0 && sp_alias >= 0 && sp_alias < SP_WORKERS)
		sp_act(&c->arm[sp_alias], sp);
}

/* Maps the control block and installs the hook (before any fork). */
static inline struct sp_ctl *sp_init(void)
{
	void *p = mmap(NULL, sizeof(struct sp_ctl), PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED)
		return NULL;
	sp_ctl = p;
	for (int i = 0; i < SP_WORKERS; i++)
		atomic_store(&sp_ctl->arm[i].point, -1);
	kvt_sp_set_hook(sp_hook, sp_ctl);
	return sp_ctl;
}

/* Disarms every worker (no worker may be paused). */
static inline void sp_reset(void)
{
	for (int i = 0; i < SP_WORKERS; i++) {
		atomic_store(&sp_ctl->arm[i].point, -1);
		atomic_store(&sp_ctl->arm[i].arrived, 0);
	}
}

static inline void sp_fini(void)
{
	kvt_sp_set_hook(NULL, NULL);
	if (sp_ctl)
		munmap(sp_ctl, sizeof(*sp_ctl));
	sp_ctl = NULL;
}

/* Arms worker `who` to pause (or die) at its (skip+1)-th hit of `point`. */
static inline void sp_arm(int who, enum kvt_sp point, int action, int skip)
{
	struct sp_arm *a = &sp_ctl->arm[who];

	atomic_store(&a->action, action);
	atomic_store(&a->skip, skip);
	atomic_store(&a->point, (int)point);
}

static inline void sp_disarm(int who)
{
	atomic_store(&sp_ctl->arm[who].point, -1);
}

static inline uint64_t sp_now_ms(void)
{
	return kvt__now_ns() / 1000000;
}

/* Waits up to `ms` for worker `who` to pause at `point`: 0, or -1.  (A
 * bound on a wait that should end, never a timed assertion: the tests
 * assert what happened, not how fast.) */
static inline int sp_wait(int who, enum kvt_sp point, unsigned ms)
{
	uint64_t end = sp_now_ms() + ms;

	do {
		if (atomic_load(&sp_ctl->arm[who].arrived) == (int)point + 1)
			return 0;
		sp_sleep_us(100);
	} while (sp_now_ms() < end);
	return -1;
}

static inline void sp_resume(int who)
{
	atomic_fetch_add(&sp_ctl->arm[who].resume, 1);
}

/* Waits up to `ms` for a child; its wait status, or -1 (still running:
 * killed and reaped). */
static inline int sp_waitpid(pid_t pid, unsigned ms)
{
	uint64_t end = sp_now_ms() + ms;
	int status;

	do {
		pid_t r = waitpid(pid, &status, WNOHANG);
		if (r == pid)
			return status;
		if (r < 0 && errno != EINTR)
			return -2;
		sp_sleep_us(100);
	} while (sp_now_ms() < end);
	kvt_kill_pid(pid, SIGKILL);
	waitpid(pid, &status, 0);
	return -1;
}

static inline int sp_killed(int status)
{
	return status >= 0 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

static inline int sp_exit_code(int status)
{
	return status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

#endif /* SP_CTL_H */
