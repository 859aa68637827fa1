/* core_owner: the segment's owner lock, the drain word, latency histograms
 * and the read-only views of the rank table (core/owner.c). */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include "kvt_test.h"
#include "kvt_format.h"

static const char *NAME;

static int setup(void **st) { (void)st; NAME = kvt_test_name("owner"); return 0; }
static int teardown(void **st) { (void)st; kvt_seg_unlink(NAME, NULL); return 0; }

/* A child process that owns the segment and waits on a pipe; killed by
 * the caller.  Returns its pid once it owns. */
static pid_t owner_child(int *wfd)
{
	int go[2], ready[2];
	char c;

	assert_int_equal(pipe(go), 0);
	assert_int_equal(pipe(ready), 0);
	pid_t pid = fork();
	if (pid == 0) {
		kvt_seg *s;
		close(go[1]);
		close(ready[0]);
		if (kvt_test_attach(NAME, KVT_ROLE_CLIENT, 0, 0, 0, &s) || kvt_seg_own(s))
			_exit(1);
		if (write(ready[1], "x", 1) != 1)
			_exit(2);
		if (read(go[0], &c, 1) == 1 && c == 'd')
			kvt_seg_drain(s, 1);
		pause();
		_exit(0);
	}
	close(go[0]);
	close(ready[1]);
	assert_int_equal(read(ready[0], &c, 1), 1);
	*wfd = go[1];
	close(ready[0]);
	return pid;
}

static void test_own_exclusive(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 8);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	kvt_seg *t;
	int status, wfd;

	assert_int_equal(kvt_seg_owner(s), 0);
	pid_t pid = owner_child(&wfd);
	assert_int_equal(kvt_seg_owner(s), pid);
	/* a second owner is refused, naming the first */
	assert_int_equal(kvt_seg_own(s), -EBUSY);
	char want[32];
	snprintf(want, sizeof(want), "pid %d", (int)pid);
	assert_non_null(strstr(kvt_core_last_error(), want));
	/* a drain by the live owner refuses attaches, observers excepted */
	assert_int_equal(write(wfd, "d", 1), 1);
	for (int i = 0; i < 2000 && !kat_load(&((struct kvt_hdr *)kvt_seg_base(s))->drain,
					      KVT_ACQ); i++)
		usleep(1000);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 1, 2, &t), -ESHUTDOWN);
	assert_non_null(strstr(kvt_core_last_error(), "draining"));
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &t), 0);
	kvt_seg_detach(t);
	/* the owner dies mid-drain: its drain is void, the next owner takes over */
	kvt_kill_pid(pid, SIGKILL);
	assert_int_equal(waitpid(pid, &status, 0), pid);
	close(wfd);
	assert_int_equal(kvt_seg_owner(s), 0);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 1, 2, &t), 0);
	kvt_seg_detach(t);
	assert_int_equal(kvt_seg_own(s), 0);
	assert_int_equal(kvt_seg_own(s), 0); /* idempotent */
	assert_int_equal(kvt_seg_owner(s), getpid());
	assert_int_equal(kvt_seg_drain(s, 1), 0);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_SCHEDULER, 0, 0, 2, &t), -ESHUTDOWN);
	assert_int_equal(kvt_seg_drain(s, 0), 0);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_SCHEDULER, 0, 0, 2, &t), 0);
	/* only the owner drains */
	assert_int_equal(kvt_seg_drain(t, 1), -EPERM);
	kvt_seg_detach(t);
	kvt_seg_detach(s);
}

static void test_histograms(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 8);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r0;
	struct kvt_hist_snap h;

	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 2, &r0), 0);
	/* bounds: 1 us x 2^i, the last is +Inf */
	assert_int_equal(kvt_hist_bound_ns(0), 1000);
	assert_int_equal(kvt_hist_bound_ns(3), 8000);
	assert_true(kvt_hist_bound_ns(KVT_HIST_BUCKETS - 1) == UINT64_MAX);
	kvt_hist_add(r0, KVT_H_SAVE, 1);          /* <= 1 us */
	kvt_hist_add(r0, KVT_H_SAVE, 1000);       /* <= 1 us */
	kvt_hist_add(r0, KVT_H_SAVE, 1001);       /* <= 2 us */
	kvt_hist_add(r0, KVT_H_SAVE, 8000);       /* <= 8 us */
	kvt_hist_add(s, KVT_H_SAVE, 100ULL * 1000 * 1000 * 1000); /* +Inf */
	kvt_hist_add(s, KVT_H_LOOKUP, 3000);      /* <= 4 us */
	assert_int_equal(kvt_hist_read(s, UINT32_MAX, KVT_H_SAVE, &h), 0);
	assert_int_equal(h.count, 5);
	assert_int_equal(h.bucket[0], 2);
	assert_int_equal(h.bucket[1], 1);
	assert_int_equal(h.bucket[3], 1);
	assert_int_equal(h.bucket[KVT_HIST_BUCKETS - 1], 1);
	assert_true(h.sum_ns == 1 + 1000 + 1001 + 8000 + 100ULL * 1000 * 1000 * 1000);
	/* per block: the rank's own */
	assert_int_equal(kvt_hist_read(s, kvt_seg_entry(r0), KVT_H_SAVE, &h), 0);
	assert_int_equal(h.count, 4);
	assert_int_equal(kvt_hist_read(s, UINT32_MAX, KVT_H_LOOKUP, &h), 0);
	assert_int_equal(h.count, 1);
	assert_int_equal(h.bucket[2], 1);
	/* counters are untouched by histograms */
	assert_int_equal(kvt_test_counter(s, KVT_C_LOOKUPS), 0);
	assert_int_equal(kvt_hist_read(s, kvt_seg_n_entries(s) + 1, KVT_H_SAVE, &h), -EINVAL);
	assert_int_equal(kvt_hist_read(s, 0, KVT_H__COUNT, &h), -EINVAL);
	assert_string_equal(kvt_hist_name(KVT_H_LOAD), "load");
	kvt_seg_detach(r0);
	kvt_seg_detach(s);
}

static void test_entry_info(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 8);
	g.n_instances = 2;
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r1;
	struct kvt_entry_info in;
	uint64_t c[KVT_C__COUNT];
	int status;

	assert_int_equal(kvt_seg_n_entries(s), 2 * 3 + KVT_MAX_CLIENTS);
	/* instance 1, rank 1 is entry 4; instance 1's scheduler entry 5 */
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 1, 1, 2, &r1), 0);
	assert_int_equal(kvt_seg_entry(r1), 4);
	assert_int_equal(kvt_seg_entry_info(s, 4, &in), 0);
	assert_int_equal(in.role, KVT_ROLE_RANK);
	assert_int_equal(in.instance, 1);
	assert_int_equal(in.rank, 1);
	assert_int_equal(in.state, KVT_ENTRY_ATTACHED);
	assert_int_equal(in.pid, getpid());
	assert_true(in.heartbeat_ns > 0);
	uint64_t hb = in.heartbeat_ns, gen = in.attach_gen;
	usleep(2000);
	kvt_seg_heartbeat(r1);
	assert_int_equal(kvt_seg_entry_info(s, 4, &in), 0);
	assert_true(in.heartbeat_ns > hb);
	assert_int_equal(kvt_seg_entry_info(s, 5, &in), 0);
	assert_int_equal(in.role, KVT_ROLE_SCHEDULER);
	assert_int_equal(in.rank, UINT32_MAX);
	assert_int_equal(in.state, KVT_ENTRY_EMPTY);
	/* the creator is a client */
	assert_int_equal(kvt_seg_entry_info(s, kvt_seg_entry(s), &in), 0);
	assert_int_equal(in.role, KVT_ROLE_CLIENT);
	assert_int_equal(in.state, KVT_ENTRY_ATTACHED);
	/* per-entry counters: a save of r1 is counted in its block only */
	assert_int_equal(kvt_test_save_shard(r1, 7, 1), 0);
	assert_int_equal(kvt_seg_entry_counters(s, 4, c), 0);
	assert_int_equal(c[KVT_C_SAVED_CHUNKS], 1);
	assert_int_equal(kvt_seg_entry_counters(s, kvt_seg_entry(s), c), 0);
	assert_int_equal(c[KVT_C_SAVED_CHUNKS], 0);
	kvt_seg_detach(r1);
	/* a dead holder shows DEAD until reaped; the attach count stays */
	pid_t pid = fork();
	if (pid == 0) {
		kvt_seg *x;
		_exit(kvt_test_attach(NAME, KVT_ROLE_RANK, 1, 1, 2, &x) ? 1 : 0);
	}
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_int_equal(WEXITSTATUS(status), 0);
	assert_int_equal(kvt_seg_entry_info(s, 4, &in), 0);
	assert_int_equal(in.state, KVT_ENTRY_DEAD);
	assert_int_equal(in.pid, pid);
	assert_int_equal(in.attach_gen, gen + 1);
	assert_int_equal(kvt_seg_reap(s), 1);
	assert_int_equal(kvt_seg_entry_info(s, 4, &in), 0);
	assert_int_equal(in.state, KVT_ENTRY_EMPTY);
	assert_int_equal(kvt_seg_entry_info(s, kvt_seg_n_entries(s), &in), -EINVAL);
	assert_int_equal(kvt_seg_entry_counters(s, kvt_seg_n_entries(s), c), 0);
	assert_int_equal(kvt_seg_entry_counters(s, kvt_seg_n_entries(s) + 1, c), -EINVAL);
	/* a corrupt state word is reported, not interpreted */
	struct kvt_ent *ents = (struct kvt_ent *)((uint8_t *)kvt_seg_base(s) + 4096);
	kat_store(&ents[3].owner, KVT_OWNER(9, 1), KVT_RLX);
	assert_int_equal(kvt_seg_entry_info(s, 3, &in), -EUCLEAN);
	kat_store(&ents[3].owner, 0, KVT_RLX);
	kvt_seg_detach(s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_own_exclusive, setup, teardown),
		cmocka_unit_test_setup_teardown(test_histograms, setup, teardown),
		cmocka_unit_test_setup_teardown(test_entry_info, setup, teardown),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
