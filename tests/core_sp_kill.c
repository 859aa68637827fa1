/* core_sp_kill.c - a process is killed at every schedule point (its first
 * hit, then its third), inside the write, lookup, lease, step, detach,
 * attach, reaper and pin-repair protocols alike; then the dead are reaped,
 * the segment must check clean, and the end-to-end cycle (save every
 * shard, look up, verify the bytes, load on every rank, re-attach every
 * role) must work.
 *
 * The scenario (worker 1) walks every protocol once, in an order that
 * makes each point's first hit a meaningful one: attach; save a chunk
 * shard by shard (allocation, index insert, join, commit); look it up and
 * load it on both ranks; release a lease; let one go stale; save past the
 * arena's size (evictions); abort a fresh write (doom); join a slot that
 * moves on under it (a helper aborts it while the joiner is paused); reap
 * a process that died between its pin and its ref (pin repair) and one
 * that died holding a claim; release a lease on a slot whose repairer died
 * after freezing it (the release adopts the repair); re-attach a rank
 * entry left by a dead holder (the attach reaps it); detach with a claim
 * still held.  Helpers are grandchildren (they die with the scenario);
 * the parent is a child subreaper, so none outlives an iteration.
 */
#include <sys/prctl.h>

#include "kvt_test.h"
#include "kvt_format.h"
#include "sp_ctl.h"

#define WORLD 2u
#define SLOTS 4u

static char NAME[64];

struct kshared {
	_Atomic int g_ready;
	_Atomic int done; /* the scenario reached its end */
};
static struct kshared *S;


static int save_all(kvt_seg *s, uint64_t key)
{
	int r = 0;

	for (uint32_t sh = 0; sh < WORLD && r >= 0; sh++)
		r = kvt_test_save_shard(s, key, sh);
	return r;
}

static int att(uint32_t role, uint32_t rank, kvt_seg **out)
{
	return kvt_test_attach(NAME, role, 0, rank, role == KVT_ROLE_RANK ? WORLD : 0, out);
}

/* ---- grandchildren ---- */

static pid_t gspawn(int id, int (*fn)(void *), void *arg)
{
	pid_t parent = getpid(), p = fork();

	if (p == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(99);
		sp_me = id;
		sp_alias = -1;
		_exit(fn(arg));
	}
	return p;
}

static int gwait(pid_t p)
{
	int st = sp_waitpid(p, 30000);

	return st;
}

static int g_lookup(void *arg) /* dies at PIN_DONE (armed by the scenario) */
{
	kvt_seg *c;
	kvt_key k = kvt_test_key((uint64_t)(uintptr_t)arg);
	uint64_t l;

	if (att(KVT_ROLE_CLIENT, 0, &c))
		return 10;
	return kvt_seg_lookup(c, &k, 1, &l) == 1 ? 0 : 11;
}

static int g_reap(void *arg) /* dies at REPAIR_FROZEN (armed) */
{
	kvt_seg *c;
	(void)arg;

	if (att(KVT_ROLE_CLIENT, 0, &c))
		return 10;
	return kvt_seg_reap(c) >= 0 ? 0 : 11;
}

static int g_claim_and_die(void *arg) /* as rank (uintptr): a claim, then death */
{
	kvt_seg *c;
	kvt_key k = kvt_test_key(50 + (uint64_t)(uintptr_t)arg);
	struct kvt_wref w;

	if (att(KVT_ROLE_RANK, (uint32_t)(uintptr_t)arg, &c))
		return 10;
	if (kvt_write_begin(c, &k, 0, (uint32_t)(uintptr_t)arg, &w))
		return 11;
	_exit(0);
}

/* Allocates key 8 (shard 0), waits for the scenario to pause in its join
 * of the same key, aborts (the slot moves on), resumes it. */
static int g_mover(void *arg)
{
	kvt_seg *c;
	kvt_key k = kvt_test_key(8);
	struct kvt_wref w;
	(void)arg;

	if (att(KVT_ROLE_CLIENT, 0, &c))
		return 10;
	if (kvt_write_begin(c, &k, 0, 0, &w))
		return 11;
	atomic_store(&S->g_ready, 1);
	if (sp_wait(6, KVT_SP_JOIN_FOUND, 30000))
		return 12;
	(void)kvt_write_end(c, &w, 0);
	sp_resume(6);
	kvt_seg_detach(c);
	return 0;
}

/* ---- the scenario ---- */

#define CHECK(cond, code) do { if (!(cond)) return (code); } while (0)

static int scenario(void *arg)
{
	kvt_seg *c, *r0;
	kvt_key k1 = kvt_test_key(1);
	struct kvt_wref w;
	uint64_t l;
	pid_t g;
	(void)arg;

	setpgid(0, 0);
	CHECK(att(KVT_ROLE_CLIENT, 0, &c) == 0, 20);
	/* a chunk shard by shard: allocation, insert, join, commit */
	CHECK(kvt_test_save_shard(c, 1, 0) == 0, 21);
	CHECK(kvt_test_save_shard(c, 1, 1) == 1, 22);
	/* lookup, a rank reading its slots, loads on both ranks (the last releases) */
	uint32_t slot;
	CHECK(kvt_seg_lookup(c, &k1, 1, &l) == 1, 23);
	CHECK(kvt_lease_slots(c, l, &slot, NULL, 1) == 1, 23);
	CHECK(kvt_lease_loaded(c, l, 0) == 0 && kvt_lease_loaded(c, l, 1) == 1, 24);
	/* an explicit release, a stale one */
	CHECK(kvt_seg_lookup(c, &k1, 1, &l) == 1 && kvt_lease_release(c, l) == 0, 25);
	CHECK(kvt_seg_lookup(c, &k1, 1, &l) == 1, 26);
	CHECK(kvt_seg_step(c, NULL, 0) == 0 && kvt_seg_step(c, NULL, 0) == 1, 27);
	/* past the arena: evictions */
	for (uint64_t i = 2; i < 2 + SLOTS + 1; i++)
		CHECK(save_all(c, i) == 1, 28);
	/* a fresh write aborted: doom and reclaim */
	kvt_key k7 = kvt_test_key(7);
	CHECK(kvt_write_begin(c, &k7, 0, 0, &w) == 0 && kvt_write_end(c, &w, 0) == 0, 29);
	/* a join whose slot moves on under it (g_mover) */
	atomic_store(&S->g_ready, 0);
	g = gspawn(5, g_mover, NULL);
	while (!atomic_load(&S->g_ready))
		sp_sleep_us(100);
	sp_alias = 6;
	sp_arm(6, KVT_SP_JOIN_FOUND, SP_PAUSE, 0);
	kvt_key k8 = kvt_test_key(8);
	int jr = kvt_write_begin(c, &k8, 0, 1, &w);
	sp_alias = -1;
	CHECK(sp_exit_code(gwait(g)) == 0, 30);
	if (jr == 0)
		kvt_write_end(c, &w, 0);
	/* reap one that died between its pin and its ref, and one that died
	 * holding a claim (as rank 1) */
	CHECK(save_all(c, 9) == 1, 31);
	sp_arm(2, KVT_SP_PIN_DONE, SP_KILL, 0);
	CHECK(sp_killed(gwait(gspawn(2, g_lookup, (void *)9))), 32);
	CHECK(sp_exit_code(gwait(gspawn(3, g_claim_and_die, (void *)1))) == 0, 33);
	CHECK(kvt_seg_reap(c) == 2, 34);
	/* a lease on a slot frozen by a repairer that died: its release
	 * adopts the repair */
	kvt_key k9 = kvt_test_key(9);
	CHECK(kvt_seg_lookup(c, &k9, 1, &l) == 1, 35);
	sp_arm(2, KVT_SP_PIN_DONE, SP_KILL, 0);
	CHECK(sp_killed(gwait(gspawn(2, g_lookup, (void *)9))), 36);
	sp_arm(3, KVT_SP_REPAIR_FROZEN, SP_KILL, 0);
	CHECK(sp_killed(gwait(gspawn(3, g_reap, NULL))), 37);
	CHECK(kvt_lease_release(c, l) == 0, 38);
	CHECK(kvt_seg_reap(c) == 2, 39);
	/* a rank entry left by a dead holder: attach reaps it */
	CHECK(sp_exit_code(gwait(gspawn(4, g_claim_and_die, (void *)0))) == 0, 40);
	CHECK(att(KVT_ROLE_RANK, 0, &r0) == 0, 41);
	CHECK(kvt_test_save_shard(r0, 20, 0) == 0, 42);
	kvt_seg_detach(r0);
	/* detach with a claim held */
	kvt_key k10 = kvt_test_key(10);
	CHECK(kvt_write_begin(c, &k10, 0, 0, &w) == 0, 43);
	kvt_seg_detach(c);
	atomic_store(&S->done, 1);
	return 0;
}

/* ---- the parent ---- */

/* Waits for the scenario (leader of its own group), then kills what it
 * left in the group, then reaps it.  The group is signalled while its
 * leader is still an unreaped zombie, so the group id cannot have been
 * reused by a stranger (safe_kill.h).  Returns the scenario's wait status,
 * or -1 when it had to be killed after ms. */
static int wait_and_reap_group(pid_t leader, int ms)
{
	int st, r = 0;

	if (kvt_wait_zombie(leader, ms)) {
		kvt_kill_pid(leader, SIGKILL);
		r = -1;
	}
	kvt_kill_group(leader, SIGKILL);
	if (waitpid(leader, &st, 0) != leader)
		st = -2;
	while (waitpid(-1, NULL, 0) > 0)
		;
	return r ? r : st;
}

/* Saves fresh keys on every shard, looks each up, checks the bytes, loads
 * it on every rank; attaches every role. */
static void e2e(kvt_seg *p, const char *after)
{
	for (uint64_t i = 100; i < 100 + 2 * SLOTS; i++) {
		kvt_key k = kvt_test_key(i);
		uint64_t l;
		uint32_t slot;
		if (save_all(p, i) != 1)
			fail_msg("after a kill at %s: saving key %llu: %s", after,
				 (unsigned long long)i, kvt_core_last_error());
		if (kvt_seg_lookup(p, &k, 1, &l) != 1)
			fail_msg("after a kill at %s: key %llu is not found", after,
				 (unsigned long long)i);
		assert_int_equal(kvt_lease_slots(p, l, &slot, NULL, 1), 1);
		for (uint32_t sh = 0; sh < WORLD; sh++)
			if (!kvt_test_stamped(p, slot, sh, &k))
				fail_msg("after a kill at %s: key %llu shard %u holds other bytes",
					 after, (unsigned long long)i, sh);
		assert_int_equal(kvt_lease_loaded(p, l, 0), 0);
		assert_int_equal(kvt_lease_loaded(p, l, 1), 1);
	}
	for (uint32_t role = KVT_ROLE_RANK; role <= KVT_ROLE_SCHEDULER; role++)
		for (uint32_t rk = 0; rk < (role == KVT_ROLE_RANK ? WORLD : 1); rk++) {
			kvt_seg *o;
			int r = att(role, rk, &o);
			if (r)
				fail_msg("after a kill at %s: attach role %u rank %u = %d: %s",
					 after, role, rk, r, kvt_core_last_error());
			kvt_seg_detach(o);
		}
}

static void check_clean(kvt_seg *p, const char *when, const char *sp)
{
	char msg[256];

	if (kvt_check(p, msg, sizeof(msg)))
		fail_msg("%s a kill at %s: kvt_check: %s", when, sp, msg);
}

static unsigned kills; /* iterations whose scenario died at its point */

static void run_one(int point, int skip)
{
	struct kvt_geometry g = kvt_test_geo(WORLD, SLOTS);
	kvt_seg *p;
	const char *name = kvt_sp_name(point);

	g.fill_timeout_ms = 10;
	g.n_leases = 16;
	p = kvt_test_create(NAME, &g, NULL);
	sp_reset();
	atomic_store(&S->done, 0);
	sp_arm(1, (enum kvt_sp)point, SP_KILL, skip);
	pid_t c = fork();
	assert_true(c >= 0);
	if (c == 0) {
		sp_me = 1;
		_exit(scenario(NULL));
	}
	(void)setpgid(c, c); /* as the child does: whichever runs first */
	int st = wait_and_reap_group(c, 120000);
	if (getenv("SPK_DEBUG"))
		fprintf(stderr, "%s/%d: status %d, hits %llu\n", name, skip, st,
			(unsigned long long)atomic_load(&sp_ctl->hits[point]));
	if (skip == 0 && !sp_killed(st))
		fail_msg("the scenario does not reach %s (wait status %d)", name, st);
	if (!sp_killed(st) && sp_exit_code(st) != 0)
		fail_msg("kill at hit %d of %s: the scenario failed at step %d", skip + 1, name,
			 sp_exit_code(st));
	kills += sp_killed(st);
	sp_reset();
	for (int i = 0; i < 10 && kvt_seg_reap(p) > 0; i++)
		;
	check_clean(p, "after", name);
	sp_sleep_us(20000); /* past the fill timeout of a half-saved chunk */
	e2e(p, name);
	check_clean(p, "after the cycle that followed", name);
	kvt_seg_detach(p);
	kvt_seg_unlink(NAME, NULL);
}

/* Points only a process stopped past a deadline reaches (core_sp's
 * test_stopped_*); a death there is a repairer's death, which pins.pml
 * covers with the bounded waits. */
static int stop_only(int point)
{
	return point == KVT_SP_REPAIR_GAVE_UP || point == KVT_SP_REPAIR_TAKEOVER;
}

static void test_kill_everywhere(void **st)
{
	(void)st;
	unsigned runs = 0;

	for (int point = 0; point < KVT_SP__COUNT; point++)
		for (int skip = 0; skip <= 2 && !stop_only(point); skip += 2) {
			run_one(point, skip);
			runs++;
		}
	/* coverage: every point was hit by some scenario */
	for (int point = 0; point < KVT_SP__COUNT; point++)
		if (!stop_only(point) && !atomic_load(&sp_ctl->hits[point]))
			fail_msg("no scenario passed %s", kvt_sp_name(point));
	fprintf(stderr, "%u runs, %u of them killed at their point (every one of the %d points "
		"at its first hit), each reaped, checked, cycled\n", runs, kills, KVT_SP__COUNT);
}

static int setup(void **st)
{
	(void)st;
	snprintf(NAME, sizeof(NAME), "t-spkill-%d", (int)getpid());
	if (!sp_init())
		return -1;
	S = mmap(NULL, sizeof(*S), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (S == MAP_FAILED)
		return -1;
	/* orphaned helpers become our children: none outlives an iteration */
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	return 0;
}

static int teardown(void **st)
{
	(void)st;
	kvt_seg_unlink(NAME, NULL);
	munmap(S, sizeof(*S));
	sp_fini();
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_kill_everywhere, setup, teardown),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
