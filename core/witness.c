/* witness.c - the exit witness: a rank's liveness outlives its process
 * until the process has wholly exited, so that a GPU copy its driver
 * still runs after the kill cannot land in a slot the reaper gave away.
 *
 * The hazard (DESIGN.md, "What outlives a process"; dma/src/dma.c).  A
 * rank's claims live as long as its entry lock (ranks.c), an OFD lock on
 * an open file description that the kernel drops at the description's
 * last release.  A killed rank releases its files in exit_files, one by
 * one, in an order set by descriptor numbers and by the kernel's version
 * (each last fput of the exit queues a task_work, and task_work has run
 * last-in-first-out since Linux 4.3, "task_work: remove fifo ordering
 * guarantee"; the table is walked by ascending descriptor).
 * A GPU save (D2H) in flight at the kill stops only when the driver tears
 * the context down: NVIDIA in the release of the process's /dev/nvidia*
 * files, AMD when the process's address space goes (the HMM notifier on
 * the locked range evicts the KFD queues) or later.  So the entry lock may
 * go first, the reaper free the slot, another key's save fill it, and the
 * dead rank's late copy land in it: a wrong byte, READY.
 *
 * The mechanism.  A rank whose copies the kernel does not stop with its
 * threads (a GPU backend: tier/kvtier.c starts it in kvt_register_kv)
 * spawns a witness, a small process (kvtier-witness, witness_main.c) that
 * holds a second reference to the lock's open file description and a
 * pidfd of the rank, and exits when the pidfd says the rank has exited.
 * The lock then survives the rank's own release of it, and goes only
 * when the witness exits.  The kernel's order makes that safe, no timing
 * involved: a pidfd polls readable only once the thread group has exited
 * (every thread past exit_notify), which comes after exit_files and after
 * exit_task_work, i.e. after every file of the rank was released (the
 * driver's included) and after its address space went (exit_mm precedes
 * both).  The witness is its own process, not a thread and not sharing the
 * rank's memory: the OOM killer, which also kills every process sharing
 * the victim's mm, leaves it alone, and it costs the rank nothing (spawned
 * with posix_spawn: no copy of the rank's page tables, no copy-on-write
 * after).  It runs in its own session with every signal blocked, so a
 * terminal's ^C or a stray SIGTERM to the engine's group does not end it;
 * only SIGKILL does.
 *
 * Invariants:
 *  W1  while a rank with a witness lives, its lock is held by its own
 *      descriptor; a witness that dies early (killed) changes nothing
 *      until the rank dies, and then the rank's own release is the last,
 *      as without a witness -- never earlier.
 *  W2  the witness exits only on its pidfd's POLLIN (or when killed): so
 *      if it is not killed, the lock goes after the rank wholly exited.
 *  W3  the witness holds nothing else: no mapping of the segment (its own
 *      mm after exec), no descriptor but the lock's description, the
 *      rank's pidfd and, until it said so, its handshake pipe.
 *  W4  a clean detach kills the witness and waits for it (pidfd, never a
 *      pid that could be reused), after the entry is released; a fork
 *      child's copy of the handle forgets the witness (segment.c).
 *
 * What it does not cover alone: the rank and its witness killed together
 * -- a kill of the whole cgroup (systemd's KillMode=control-group,
 * `docker kill`, memory.oom.group).  Then the lock's last release would
 * be the rank's own again, in its exit's order.  So the witness also
 * hands the same hold to the segment's kvtierd, which runs in a cgroup
 * of its own (witness_srv.c, daemon_hold below); what is left open
 * (kvtierd in the engine's cgroup, or not running) is in docs/FAULTS.md.
 *
 * Acquire/release pairs: none in shared memory; the ordering is the
 * kernel's (exit_files, then exit_notify, then the pidfd's POLLIN).
 * Schedule points: none; the test (tests/core_witness.c) kills the rank
 * with slow-to-release files on both sides of its lock descriptor and
 * checks, at the first instant the entry reads dead, that the rank had
 * wholly exited.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvt_format.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#ifndef P_PIDFD
#define P_PIDFD 3
#endif

#define WITNESS_NAME "kvtier-witness"
#ifdef KVT_WITNESS_INSTALLED
#define KVT_W_INST KVT_WITNESS_INSTALLED
#else
#define KVT_W_INST "(no install path built in)"
#endif

static int exec_file(const char *p)
{
	struct stat st;

	return stat(p, &st) == 0 && S_ISREG(st.st_mode) && access(p, X_OK) == 0;
}

/* The helper: $KVTIER_WITNESS_HELPER (absolute), else beside the object
 * this code is in (libkvtier.so in a build tree; for a program linking core
 * statically, whose dladdr names no absolute path, the program itself:
 * /proc/self/exe), or one directory up (kvtierd in build/tier/daemon, the
 * helper in build/tier), else where an install put it relative to that
 * object (PREFIX/lib/libkvtier.so or PREFIX/lib/<multiarch>/libkvtier.so,
 * PREFIX/sbin/kvtierd, and PREFIX/libexec/kvtier/), else the install path
 * built in.  0, or -errno with the message. */
static int helper_path(char *out, size_t len)
{
	static const char *const rel[] = { "", "../", "../libexec/kvtier/",
					   "../../libexec/kvtier/" };
	const char *v = getenv("KVTIER_WITNESS_HELPER");
	char dir[3072] = "", exe[3072];
	const char *obj = NULL;
	Dl_info di;

	if (v) {
		if (v[0] != '/')
			return kvt__err(-EINVAL, "KVTIER_WITNESS_HELPER='%.200s': expected an "
					"absolute path to " WITNESS_NAME, v);
		if (!exec_file(v))
			return kvt__err(-ENOENT, "KVTIER_WITNESS_HELPER='%.200s': not an "
					"executable file", v);
		snprintf(out, len, "%s", v);
		return 0;
	}
	if (dladdr((void *)helper_path, &di) && di.dli_fname && di.dli_fname[0] == '/') {
		obj = di.dli_fname;
	} else {
		ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
		if (n > 0) {
			exe[n] = 0;
			obj = exe;
		}
	}
	if (obj && obj[0] == '/') {
		const char *slash = strrchr(obj, '/');
		snprintf(dir, sizeof(dir), "%.*s", (int)(slash - obj), obj);
		for (size_t i = 0; i < sizeof(rel) / sizeof(rel[0]); i++) {
			snprintf(out, len, "%s/%s" WITNESS_NAME, dir, rel[i]);
			if (exec_file(out))
				return 0;
		}
	}
#ifdef KVT_WITNESS_INSTALLED
	snprintf(out, len, "%s", KVT_WITNESS_INSTALLED);
	if (exec_file(out))
		return 0;
#endif
	return kvt__err(-ENOENT, "witness: " WITNESS_NAME " not found (looked at "
			"$KVTIER_WITNESS_HELPER, in %.300s, its parent and its ../libexec/kvtier, "
			"../../libexec/kvtier, and at " KVT_W_INST "); it is built and "
			"installed with libkvtier", dir[0] ? dir : "the library's directory");
}

static void close_keep_errno(int fd)
{
	int e = errno;

	if (fd >= 0)
		close(fd);
	errno = e;
}

/* kvtierd's hold (witness_srv.c): HOLD with our lock description and
 * pidfd; kept open until detach.  Never fails the witness: without it the
 * rank's own witness holds, as before (D4 there). */
static void daemon_hold(kvt_seg *s, int pidfd)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct timeval tv = { .tv_sec = 5 };
	struct kvt_wmsg m = { .magic = KVT_WMSG_MAGIC, .version = 1, .op = KVT_WMSG_HOLD,
			      .entry = s->entry, .pid = (uint32_t)getpid() };
	union {
		char buf[CMSG_SPACE(sizeof(int) * 2)];
		struct cmsghdr align;
	} u;
	struct iovec iov = { .iov_base = &m, .iov_len = sizeof(m) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf) };
	struct cmsghdr *c;
	int fds[2] = { s->fd, pidfd }, fd, r;
	char ans[160] = "";
	ssize_t n;

	s->wsrv_held = 0;
	r = kvt__witness_sock_path(s->fd, s->name, a.sun_path, sizeof(a.sun_path));
	if (r) {
		snprintf(s->wsrv_why, sizeof(s->wsrv_why), "no socket path: %s", strerror(-r));
		return;
	}
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		snprintf(s->wsrv_why, sizeof(s->wsrv_why), "socket: %s", strerror(errno));
		return;
	}
	(void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	(void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	if (connect(fd, (struct sockaddr *)&a, sizeof(a))) {
		snprintf(s->wsrv_why, sizeof(s->wsrv_why), "%s",
			 errno == ENOENT || errno == ECONNREFUSED ?
			 "no kvtierd listens for this segment" : strerror(errno));
		close(fd);
		return;
	}
	/* Our lock description goes only to a listener of the segment's
	 * owner, ours or root: a name in a shared directory (/dev/shm) can be
	 * taken by anyone before kvtierd binds it. */
	{
		struct ucred cr;
		struct stat st;
		socklen_t cl = sizeof(cr);

		if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) || fstat(s->fd, &st) ||
		    (cr.uid != 0 && cr.uid != geteuid() && cr.uid != st.st_uid)) {
			snprintf(s->wsrv_why, sizeof(s->wsrv_why), "the listener is uid %u, "
				 "not the segment's owner: not trusted", (unsigned)cr.uid);
			close(fd);
			return;
		}
	}
	memset(u.buf, 0, sizeof(u.buf));
	c = CMSG_FIRSTHDR(&mh);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(fds));
	memcpy(CMSG_DATA(c), fds, sizeof(fds));
	do
		n = sendmsg(fd, &mh, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	if (n == (ssize_t)sizeof(m)) {
		/* one deadline for the answer, whatever signals come (D4) */
		uint64_t end = kvt__now_ns() + 5000000000ull, now;
		struct pollfd p = { .fd = fd, .events = POLLIN };

		n = -1;
		errno = ETIMEDOUT;
		while ((now = kvt__now_ns()) < end) {
			int k = poll(&p, 1, (int)((end - now) / 1000000 + 1));
			if (k < 0 && errno != EINTR)
				break;
			if (k > 0) {
				n = recv(fd, ans, sizeof(ans) - 1, MSG_DONTWAIT);
				break;
			}
		}
		if (n < 0 && errno == EAGAIN)
			errno = ETIMEDOUT;
	} else {
		n = -1;
	}
	if (n >= 1 && ans[0] == 'h') {
		s->wsrv_fd = fd;
		s->wsrv_held = 1;
		s->wsrv_why[0] = 0;
		return;
	}
	if (n >= 1 && ans[0] == 'e')
		snprintf(s->wsrv_why, sizeof(s->wsrv_why), "kvtierd refused: %.100s", ans + 1);
	else
		snprintf(s->wsrv_why, sizeof(s->wsrv_why), "kvtierd did not answer%s%s",
			 n < 0 ? ": " : "", n < 0 ? strerror(errno) : "");
	close(fd);
}

static void daemon_bye(kvt_seg *s, int say)
{
	struct kvt_wmsg m = { .magic = KVT_WMSG_MAGIC, .version = 1, .op = KVT_WMSG_BYE,
			      .entry = s->entry, .pid = (uint32_t)getpid() };

	if (!s->wsrv_held)
		return;
	if (say)
		(void)send(s->wsrv_fd, &m, sizeof(m), MSG_NOSIGNAL | MSG_DONTWAIT);
	close(s->wsrv_fd);
	s->wsrv_fd = -1;
	s->wsrv_held = 0;
}

int kvt_seg_witness_daemon(const kvt_seg *s, char *why, size_t len)
{
	if (!s)
		return 0;
	if (why && len)
		snprintf(why, len, "%s", s->wsrv_held ? "" : s->witness_pid > 0 ?
			 s->wsrv_why : "no witness");
	return s->wsrv_held ? 1 : 0;
}

/* Spawns the helper at path holding the description of lk until the
 * process of target (a pidfd) has wholly exited, both descriptors >= 6
 * (the dup2 to 3, 4 and 5 cannot clobber one another); waits for its
 * handshake.  0 with *pid_out and *wfd_out (its pidfd), or -errno with the
 * message. */
static int witness_spawn(const char *path, const char *name, int lk, int target,
			 pid_t *pid_out, int *wfd_out)
{
	char *argv[3];
	char *envp[1] = { NULL };
	posix_spawn_file_actions_t fa;
	posix_spawnattr_t at;
	sigset_t all;
	int pp[2] = { -1, -1 }, wfd = -1, r;
	pid_t pid = 0;
	char ok = 0;
	ssize_t n;

	if (pipe2(pp, O_CLOEXEC))
		return kvt__err(-errno, "witness: descriptors: %s", strerror(errno));
	r = fcntl(pp[1], F_DUPFD_CLOEXEC, 6);
	close_keep_errno(pp[1]);
	pp[1] = r;
	if (pp[1] < 0) {
		r = kvt__err(-errno, "witness: descriptors: %s", strerror(errno));
		goto out;
	}
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
	posix_spawn_file_actions_adddup2(&fa, lk, 3);
	posix_spawn_file_actions_adddup2(&fa, target, 4);
	posix_spawn_file_actions_adddup2(&fa, pp[1], 5);
	posix_spawnattr_init(&at);
	sigfillset(&all);
	posix_spawnattr_setsigmask(&at, &all);
	posix_spawnattr_setsigdefault(&at, &all);
	posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF |
				 POSIX_SPAWN_SETSID);
	argv[0] = (char *)WITNESS_NAME;
	argv[1] = (char *)name;
	argv[2] = NULL;
	r = posix_spawn(&pid, path, &fa, &at, argv, envp);
	posix_spawn_file_actions_destroy(&fa);
	posix_spawnattr_destroy(&at);
	if (r) {
		r = kvt__err(-r, "witness: spawning %.300s: %s", path, strerror(r));
		goto out;
	}
	wfd = (int)syscall(SYS_pidfd_open, pid, 0);
	close(pp[1]);
	pp[1] = -1;
	/* The handshake: one byte once it checked what it holds; EOF if it
	 * exited instead (a wrong helper, a bad descriptor). */
	do
		n = read(pp[0], &ok, 1);
	while (n < 0 && errno == EINTR);
	if (n != 1 || ok != 'w' || wfd < 0) {
		r = kvt__err(-ECHILD, "witness: %.300s did not start as the exit witness%s",
			     path, wfd < 0 ? " (pidfd_open failed)" : "");
		if (wfd >= 0) {
			siginfo_t si;
			(void)syscall(SYS_pidfd_send_signal, wfd, SIGKILL, NULL, 0);
			while (waitid((idtype_t)P_PIDFD, (id_t)wfd, &si, WEXITED) < 0 &&
			       errno == EINTR)
				;
			close(wfd);
		} else {
			while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
				;
		}
		goto out;
	}
	*pid_out = pid;
	*wfd_out = wfd;
	r = 0;
out:
	close_keep_errno(pp[0]);
	close_keep_errno(pp[1]);
	return r;
}

int kvt_seg_witness(kvt_seg *s)
{
	char path[4096];
	int self = -1, lk = -1, wfd = -1, r;
	pid_t pid = 0;

	if ((r = kvt__need_entry(s, "witness")))
		return r;
	if (s->witness_pid > 0)
		return 0;
	if ((r = helper_path(path, sizeof(path))))
		return r;
	/* Our own pidfd, and the lock's description, both at numbers >= 6 so
	 * that the dup2 to 3, 4 and 5 cannot clobber one another. */
	self = (int)syscall(SYS_pidfd_open, getpid(), 0);
	if (self < 0)
		return kvt__err(-errno, "witness: pidfd_open: %s (the exit witness needs "
				"Linux 5.3 or later)", strerror(errno));
	r = fcntl(self, F_DUPFD_CLOEXEC, 6);
	close_keep_errno(self);
	self = r;
	lk = fcntl(s->fd, F_DUPFD_CLOEXEC, 6);
	if (self < 0 || lk < 0) {
		r = kvt__err(-errno, "witness: descriptors: %s", strerror(errno));
		goto out;
	}
	if ((r = witness_spawn(path, s->name, lk, self, &pid, &wfd)))
		goto out;
	s->witness_pid = pid;
	s->witness_pidfd = wfd;
	daemon_hold(s, self);
	r = 0;
out:
	close_keep_errno(self);
	close_keep_errno(lk);
	return r;
}

int kvt_witness_for(int fd, int pidfd, const char *name, int *pid, int *wpidfd)
{
	pid_t p = 0;
	char path[4096];
	int lk = -1, target = -1, r;

	if ((r = helper_path(path, sizeof(path))))
		return r;
	lk = fcntl(fd, F_DUPFD_CLOEXEC, 6);
	target = fcntl(pidfd, F_DUPFD_CLOEXEC, 6);
	if (lk < 0 || target < 0)
		r = kvt__err(-errno, "witness: descriptors: %s", strerror(errno));
	else
		r = witness_spawn(path, name, lk, target, &p, wpidfd);
	if (!r)
		*pid = (int)p;
	close_keep_errno(lk);
	close_keep_errno(target);
	return r;
}

int kvt_seg_witness_pid(const kvt_seg *s)
{
	return s && s->witness_pid > 0 ? s->witness_pid : 0;
}

void kvt__witness_stop(kvt_seg *s)
{
	siginfo_t si;

	if (!s)
		return;
	/* after the entry's release (D1 in witness_srv.c); an entry left to
	 * the reaper was not released: no BYE, kvtierd holds it until this
	 * process exits */
	daemon_bye(s, !s->leave_to_reaper);
	if (s->witness_pid <= 0)
		return;
	(void)syscall(SYS_pidfd_send_signal, s->witness_pidfd, SIGKILL, NULL, 0);
	/* By the pidfd: the pid may have been reaped by someone else (an
	 * engine's waitpid(-1)) and reused; ECHILD then, and it is gone. */
	while (waitid((idtype_t)P_PIDFD, (id_t)s->witness_pidfd, &si, WEXITED) < 0 &&
	       errno == EINTR)
		;
	close(s->witness_pidfd);
	s->witness_pidfd = -1;
	s->witness_pid = 0;
}

void kvt__witness_forget(kvt_seg *s)
{
	daemon_bye(s, 0);
	if (s->witness_pid > 0)
		close(s->witness_pidfd);
	s->witness_pidfd = -1;
	s->witness_pid = 0;
}
