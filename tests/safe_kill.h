/* safe_kill.h - signals from tests and benches that can only reach what
 * the caller made.
 *
 * kill(0, sig) signals the caller's whole process group and kill(-1, sig)
 * every process it may signal: ctest, the test script and CI with it.  A
 * pid read from shared memory before its writer stored it is 0; a pid kept
 * after its process was reaped may name a stranger (pid_max is 32,768 on
 * small machines and a suite forks thousands).  So:
 *
 *   kvt_kill_pid    refuses pid <= 1 (abort: a loud failure of this test,
 *                   never a signal to a group), and is for a child not yet
 *                   reaped or a process the caller knows is alive;
 *   kvt_kill_group  signals the group led by an unreaped child: while the
 *                   leader is a zombie its pid, and so the group id, cannot
 *                   be reused (kvt_wait_zombie waits for that state
 *                   without reaping).
 *
 * Header-only, no cmocka: bench/ uses it too.
 */
#ifndef KVT_SAFE_KILL_H
#define KVT_SAFE_KILL_H

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>

static inline void kvt_kill_pid(pid_t pid, int sig)
{
	if (pid <= 1) {
		fprintf(stderr, "kvt_kill_pid: refusing to signal pid %d (a group or "
			"init, not a process of this test)\n", (int)pid);
		abort();
	}
	(void)kill(pid, sig);
}

static inline void kvt_kill_group(pid_t leader, int sig)
{
	if (leader <= 1) {
		fprintf(stderr, "kvt_kill_group: refusing to signal group %d\n", (int)leader);
		abort();
	}
	(void)kill(-leader, sig);
}

/* Waits up to ms for child pid to exit, leaving it a zombie (not reaped):
 * 0 once it has exited, -1 on time-out or error. */
static inline int kvt_wait_zombie(pid_t pid, int ms)
{
	struct timespec tick = { 0, 1000000 };

	for (int i = 0; i <= ms; i++) {
		siginfo_t si;

		memset(&si, 0, sizeof(si));
		if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0) {
			if (si.si_pid == pid)
				return 0;
		} else if (errno != EINTR) {
			return -1;
		}
		nanosleep(&tick, NULL);
	}
	return -1;
}

#endif
