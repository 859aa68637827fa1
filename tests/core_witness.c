/* core_witness.c - the exit witness (core/witness.c): a killed rank's entry,
 * hence its claims, stays alive until the rank has wholly exited.
 *
 * The hazard it holds is a GPU driver's copy that lands after the kill,
 * until the driver's files are released in the rank's exit.  No GPU here:
 * the stand-in is what every such file shares with it, its place in the
 * exit.  The killed rank holds two files whose release is slow (tmpfs
 * memfds of 256 MiB, freed page by page when their last descriptor goes),
 * one opened before its lock descriptor and one after, so that whatever
 * order this kernel releases an exiting process's files in (task_work,
 * last-in-first-out since Linux 4.3), one of them is released after the lock's own
 * descriptor.  The test watches the entry from outside and checks, at the
 * first instant it reads dead, that the rank's pidfd already said "wholly
 * exited".  Without the witness (KVTIER_TEST_WITNESS=off, shown failing
 * once), the entry dies while the rank is still releasing its files.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include "kvt_test.h"
#include "kvt_format.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

static const char *NAME;
static pid_t kids[2]; /* killed by the teardown if an assertion failed */

static int setup(void **st) { (void)st; NAME = kvt_test_name("wit"); return 0; }

static int teardown(void **st)
{
	(void)st;
	for (int i = 0; i < 2; i++)
		if (kids[i] > 1) {
			kvt_kill_pid(kids[i], SIGKILL);
			(void)waitpid(kids[i], NULL, 0);
			kids[i] = 0;
		}
	(void)prctl(PR_SET_CHILD_SUBREAPER, 0);
	kvt_seg_unlink(NAME, NULL);
	return 0;
}

static int pidfd_of(pid_t pid)
{
	return (int)syscall(SYS_pidfd_open, pid, 0);
}

static int exited(int pidfd)
{
	struct pollfd p = { .fd = pidfd, .events = POLLIN };

	return poll(&p, 1, 0) == 1;
}

static int slow_file(void)
{
	int fd = memfd_create("kvt-slow-release", MFD_CLOEXEC);

	if (fd < 0 || fallocate(fd, 0, 0, 256ull << 20))
		_exit(90);
	return fd;
}

/* A rank in a child: attaches rank 0 of world 1, starts its witness
 * (unless KVTIER_TEST_WITNESS=off), claims shard 0 of key 7 (a FILLING
 * slot, as a GPU save in flight), says so through pfd, and waits. */
static pid_t rank_child(int *pfd, int slow)
{
	pid_t pid = fork();

	if (pid == 0) {
		kvt_seg *c = NULL;
		struct kvt_wref w;
		kvt_key k = kvt_test_key(7);
		const char *v = getenv("KVTIER_TEST_WITNESS");
		int wp, a = slow ? slow_file() : -1;
		close(pfd[0]);
		if (kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &c))
			_exit(1);
		if (!(v && !strcmp(v, "off")) && kvt_seg_witness(c)) {
			fprintf(stderr, "witness: %s\n", kvt_core_last_error());
			_exit(2);
		}
		if (kvt_write_begin(c, &k, 0, 0, &w))
			_exit(3);
		int b = slow ? slow_file() : -1;
		(void)a;
		(void)b;
		wp = kvt_seg_witness_pid(c);
		if (write(pfd[1], &wp, sizeof(wp)) != sizeof(wp))
			_exit(4);
		for (;;)
			pause();
	}
	return pid;
}

static void test_witness_holds_until_exit(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL);
	int pfd[2], wp = 0, status;
	uint64_t held_while_exiting = 0, polls = 0;

	assert_int_equal(pipe(pfd), 0);
	pid_t pid = rank_child(pfd, 1);
	assert_true(pid > 0);
	kids[0] = pid;
	close(pfd[1]);
	assert_int_equal(read(pfd[0], &wp, sizeof(wp)), sizeof(wp));
	close(pfd[0]);
	int pidfd = pidfd_of(pid);
	if (pidfd < 0) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP(); /* no pidfds (Linux < 5.3): no witness either */
	}
	assert_int_equal(kvt_seg_live_ranks(s), 1);
	kvt_kill_pid(pid, SIGKILL);
	/* The first instant the entry reads dead, the rank has wholly exited. */
	for (;;) {
		int live = kvt_seg_live_ranks(s);
		assert_true(live >= 0);
		polls++;
		if (!live)
			break;
		if (!exited(pidfd))
			held_while_exiting++;
	}
	int done = exited(pidfd);
	fprintf(stderr, "witness pid %d; %llu probes, %llu of them saw the entry alive while "
		"the rank was still exiting; rank wholly exited when the entry died: %s\n",
		wp, (unsigned long long)polls, (unsigned long long)held_while_exiting,
		done ? "yes" : "NO");
	assert_true(done);
	assert_int_equal(waitpid(pid, &status, 0), pid);
	kids[0] = 0;
	assert_true(WIFSIGNALED(status));
	/* and then the reaper drops the claim: key 7 can be saved afresh */
	assert_int_equal(kvt_seg_reap(s), 1);
	kvt_test_assert_check(s);
	kvt_seg *r = NULL;
	struct kvt_wref w;
	kvt_key k = kvt_test_key(7);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &r), 0);
	assert_int_equal(kvt_write_begin(r, &k, 0, 0, &w), 0);
	assert_int_equal(kvt_write_end(r, &w, 1), 1);
	kvt_test_assert_check(s);
	close(pidfd);
	kvt_seg_detach(r);
	kvt_seg_detach(s);
}

/* W1: a witness killed early changes nothing while its rank lives; the
 * rank's death is then found as without one. */
static void test_witness_killed_first(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r = NULL;
	int pfd[2], wp = 0;

	assert_int_equal(pipe(pfd), 0);
	pid_t pid = rank_child(pfd, 0);
	kids[0] = pid;
	close(pfd[1]);
	assert_int_equal(read(pfd[0], &wp, sizeof(wp)), sizeof(wp));
	close(pfd[0]);
	assert_true(wp > 1);
	int wfd = pidfd_of(wp);
	assert_true(wfd >= 0);
	assert_int_equal(syscall(SYS_pidfd_send_signal, wfd, SIGKILL, NULL, 0), 0);
	struct pollfd p = { .fd = wfd, .events = POLLIN };
	assert_int_equal(poll(&p, 1, -1), 1);
	close(wfd);
	assert_int_equal(kvt_seg_live_ranks(s), 1);
	assert_int_equal(kvt_seg_reap(s), 0);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &r), -EBUSY);
	kvt_kill_pid(pid, SIGKILL);
	assert_int_equal(waitpid(pid, NULL, 0), pid);
	kids[0] = 0;
	assert_int_equal(kvt_seg_reap(s), 1);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &r), 0);
	kvt_test_assert_check(s);
	kvt_seg_detach(r);
	kvt_seg_detach(s);
}

/* W4: a clean detach stops the witness at once; the rank attaches again
 * straight away; a second start is a no-op; an observer has none. */
static void test_witness_detach(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r = NULL, *o = NULL;

	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &r), 0);
	assert_int_equal(kvt_seg_witness_pid(r), 0);
	assert_int_equal(kvt_seg_witness(r), 0);
	int wp = kvt_seg_witness_pid(r);
	assert_true(wp > 1);
	assert_int_equal(kvt_seg_witness(r), 0);
	assert_int_equal(kvt_seg_witness_pid(r), wp);
	/* it is named for operators, in a session of its own */
	char path[64], comm[64] = "";
	snprintf(path, sizeof(path), "/proc/%d/comm", wp);
	FILE *f = fopen(path, "r");
	assert_non_null(f);
	assert_non_null(fgets(comm, sizeof(comm), f));
	fclose(f);
	assert_string_equal(comm, "kvtier-witness\n");
	assert_int_equal(getsid(wp), wp);
	int wfd = pidfd_of(wp);
	assert_true(wfd >= 0);
	assert_false(exited(wfd));
	kvt_seg_detach(r);
	assert_true(exited(wfd)); /* detach waited for it */
	close(wfd);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &r), 0);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o), 0);
	assert_int_equal(kvt_seg_witness(o), -EPERM);
	kvt_test_assert_check(s);
	kvt_seg_detach(o);
	kvt_seg_detach(r);
	kvt_seg_detach(s);
}

/* A rank with a witness that fork()s an idle child and is killed: the
 * child keeps neither the lock nor the witness (whose pidfd is its
 * parent's), so the dead rank is reaped while the child lives. */
static void test_witness_fork_child(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r = NULL;
	int pfd[2];
	pid_t gc = 0;

	assert_int_equal(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
	assert_int_equal(pipe(pfd), 0);
	pid_t pid = fork();
	if (pid == 0) {
		kvt_seg *c = NULL;
		close(pfd[0]);
		if (kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &c) || kvt_seg_witness(c))
			_exit(1);
		pid_t idle = fork();
		if (idle == 0) {
			pid_t me = getpid();
			/* the copy of the handle forgot the witness */
			if (kvt_seg_witness_pid(c) != 0)
				_exit(5);
			if (write(pfd[1], &me, sizeof(me)) != sizeof(me))
				_exit(3);
			for (;;)
				pause();
		}
		for (;;)
			pause();
	}
	kids[0] = pid;
	close(pfd[1]);
	assert_int_equal(read(pfd[0], &gc, sizeof(gc)), sizeof(gc));
	close(pfd[0]);
	assert_true(gc > 1);
	kids[1] = gc;
	int pidfd = pidfd_of(pid);
	assert_true(pidfd >= 0);
	kvt_kill_pid(pid, SIGKILL);
	while (kvt_seg_live_ranks(s) > 0)
		;
	assert_true(exited(pidfd));
	close(pidfd);
	assert_int_equal(waitpid(pid, NULL, 0), pid);
	kids[0] = 0;
	assert_int_equal(kill(gc, 0), 0); /* the child lives on */
	assert_int_equal(kvt_seg_reap(s), 1);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &r), 0);
	kvt_test_assert_check(s);
	kvt_kill_pid(gc, SIGKILL);
	assert_int_equal(waitpid(gc, NULL, 0), gc);
	kids[1] = 0;
	kvt_seg_detach(r);
	kvt_seg_detach(s);
}

/* A wrong helper is a clear error and leaves the handle as it was. */
static void test_witness_bad_helper(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r = NULL;
	char *keep = getenv("KVTIER_WITNESS_HELPER");
	char helper[4096];

	assert_non_null(keep);
	while (waitpid(-1, NULL, WNOHANG) > 0)
		; /* earlier tests' orphans (a killed rank's witness, reparented) */
	snprintf(helper, sizeof(helper), "%s", keep);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &r), 0);
	setenv("KVTIER_WITNESS_HELPER", "kvtier-witness", 1);
	assert_int_equal(kvt_seg_witness(r), -EINVAL);
	assert_non_null(strstr(kvt_core_last_error(), "absolute path"));
	setenv("KVTIER_WITNESS_HELPER", "/nonexistent/kvtier-witness", 1);
	assert_int_equal(kvt_seg_witness(r), -ENOENT);
	/* a program that exits without the handshake */
	setenv("KVTIER_WITNESS_HELPER", "/bin/true", 1);
	assert_int_equal(kvt_seg_witness(r), -ECHILD);
	assert_non_null(strstr(kvt_core_last_error(), "did not start"));
	assert_int_equal(kvt_seg_witness_pid(r), 0);
	assert_int_equal(waitpid(-1, NULL, WNOHANG), -1); /* nothing left behind */
	assert_int_equal(errno, ECHILD);
	setenv("KVTIER_WITNESS_HELPER", helper, 1);
	/* the helper run by hand refuses, saying what it is */
	char cmd[4200];
	snprintf(cmd, sizeof(cmd), "'%s' 3</dev/null 2>/dev/null", helper);
	int rc = system(cmd);
	assert_true(WIFEXITED(rc));
	assert_int_equal(WEXITSTATUS(rc), 2);
	assert_int_equal(kvt_seg_witness(r), 0);
	assert_true(kvt_seg_witness_pid(r) > 1);
	kvt_test_assert_check(s);
	kvt_seg_detach(r);
	kvt_seg_detach(s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_witness_holds_until_exit, setup, teardown),
		cmocka_unit_test_setup_teardown(test_witness_killed_first, setup, teardown),
		cmocka_unit_test_setup_teardown(test_witness_detach, setup, teardown),
		cmocka_unit_test_setup_teardown(test_witness_fork_child, setup, teardown),
		cmocka_unit_test_setup_teardown(test_witness_bad_helper, setup, teardown),
	};
	return kvt_test_result(cmocka_run_group_tests(tests, NULL, NULL));
}
