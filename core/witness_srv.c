/* witness_srv.c - the daemon's exit witness: kvtierd holds each rank's lock
 * description too, so that a kill of the rank's whole cgroup (the rank
 * and its own kvtier-witness at once) still leaves the rank's entry alive
 * until the rank has wholly exited.
 *
 * Why a second holder (witness.c has the hazard and the first holder).
 * kvtier-witness lives in the rank's cgroup: a systemd stop that ends in
 * SIGKILL to the unit's cgroup, `docker kill`, or memory.oom.group kills
 * it with the rank, and the lock's last release is the rank's own again.
 * kvtierd runs in a cgroup of its own (its own unit or container), so it
 * survives what kills an engine's, and it already watches every rank.
 *
 * The protocol.  kvtierd, once it owns the segment, listens on a unix
 * SOCK_SEQPACKET socket beside the segment's file, named
 * kvtier-witness.<segment> (a segment's file is kvtier.<name>, so the two
 * never collide), with the segment file's permissions.  A rank, when it
 * starts its witness (kvt_seg_witness), connects and sends one HOLD
 * message carrying two descriptors (SCM_RIGHTS): its lock description and
 * its own pidfd.  kvtierd checks them -- the first is the segment's own
 * file (same device and inode as its own), the second a pidfd of the peer
 * (SO_PEERCRED's pid, as /proc shows the pidfd's) -- and answers 'h', or
 * 'e' with the reason.  The connection stays open for the attachment's
 * life.  A clean detach sends BYE after its entry was released; kvtierd
 * then closes both descriptors.  An end of the connection without BYE is
 * a death (or a fork child's close: the parent's copy keeps it open):
 * kvtierd keeps holding until the pidfd polls readable, and only then
 * closes them.
 *
 * Invariants:
 *  D1  kvtierd closes a held lock description only after the rank's BYE
 *      (sent after the rank released its entry itself) or after the
 *      rank's pidfd polled readable (the thread group exited: after
 *      exit_files and exit_task_work, witness.c) -- never on the socket's
 *      end alone, which comes in the rank's exit_files.
 *  D2  it holds nothing but what it checked: the segment file it owns
 *      (by cached attributes: a FUSE file cannot make it wait), and the
 *      kernel's pidfd of the peer (SO_PEERPIDFD, Linux 6.5, whatever PID
 *      namespace the rank is in), else the pidfd the rank sent when its
 *      pid is the peer's as this namespace sees it (so on older kernels a
 *      rank invisible to kvtierd's PID namespace is refused, with why).
 *      The rank, for its part, sends its lock only to a listener whose
 *      uid is root, its own or the segment file's owner (a name in
 *      /dev/shm can be taken by anyone first).
 *  D3  bounded: at most `max` ranks held at once (the segment's entries),
 *      a HOLD past it refused with the reason, and W_SPARE connections
 *      more; one past those is closed unanswered.  Nothing a peer sends
 *      keeps the daemon's loop: every socket is non-blocking, each message
 *      is one datagram, a call serves one batch of events, and a listener
 *      it cannot accept from (no descriptors left) is paused until a slot
 *      frees.  A receive error (a peer that closed with its answer
 *      unread: ECONNRESET) is an end of that connection, and carries no
 *      descriptors, whatever the control buffer held.
 *  D4  the rank never waits on kvtierd for longer than its timeouts
 *      (connect and answer): a daemon that does not answer is a daemon
 *      that does not hold, and the rank's own witness still does.
 *
 * Left as they are: idle connections can fill the W_SPARE room (a rank
 * then gets "did not answer" and keeps its own witness); a same-uid peer
 * can make a close() of a descriptor it sent slow (it could also just
 * write the segment); a kvtierd restarted while ranks live holds nothing
 * for them (they asked the one before).
 *
 * Acquire/release pairs: none in shared memory; the ordering is the
 * kernel's, as in witness.c.  Schedule points: none; tests/core_witness.c
 * kills a rank and its witness together while a server holds, with files
 * slow to release on both sides of the lock descriptor, and checks that
 * the entry reads dead only after the rank wholly exited (and fails
 * without the server).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include "kvt_format.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

#define W_NAME "kvtier-witness."
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
/* connections that have not said HOLD yet, beyond the `max` holds: room
 * to answer a request past max with its reason (a unix socket closed with
 * the peer's request unread resets the peer instead of answering) */
#define W_SPARE 8

/* One held rank (or a connection that has not said HOLD yet). */
struct held {
	int conn;      /* -1: ended (the rank died; waiting for pidfd) */
	int lockfd;    /* -1: not holding yet */
	int pidfd;
	uint32_t used;
};

struct kvt_wsrv {
	int lfd, ep;
	dev_t dev;
	ino_t ino;
	uint32_t max, n_slots, n_held;
	int paused;    /* accept failed for want of descriptors: not listening
			* until a slot frees (a level-triggered listener that
			* cannot be accepted from would wake the loop forever) */
	uint64_t exited, byes, refused;
	struct held *h;
	char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
};

/* epoll data: what, and which slot */
enum { EV_LISTEN = 1, EV_CONN = 2, EV_PIDFD = 3 };
#define EV(kind, i) (((uint64_t)(kind) << 32) | (uint32_t)(i))

int kvt__witness_sock_path(int seg_fd, const char *name, char *out, size_t len)
{
	return kvt__side_path(seg_fd, W_NAME, name, out, len);
}

int kvt__side_path(int seg_fd, const char *prefix, const char *name, char *out, size_t len)
{
	char link[64], p[4096];
	ssize_t n;
	char *slash;
	int r;

	snprintf(link, sizeof(link), "/proc/self/fd/%d", seg_fd);
	n = readlink(link, p, sizeof(p) - 1);
	if (n <= 0)
		return -errno ? -errno : -ENOENT;
	p[n] = 0;
	if (n > 10 && !strcmp(p + n - 10, " (deleted)"))
		return -ENOENT;
	slash = strrchr(p, '/');
	if (!slash)
		return -ENOENT;
	*slash = 0;
	r = snprintf(out, len, "%s/%s%s", p, prefix, name);
	if (r < 0 || (size_t)r >= len)
		return -ENAMETOOLONG;
	return 0;
}

static void ep_add(struct kvt_wsrv *w, int fd, uint64_t data)
{
	struct epoll_event ev = { .events = EPOLLIN, .data.u64 = data };

	(void)epoll_ctl(w->ep, EPOLL_CTL_ADD, fd, &ev);
}

static void close_fd(struct kvt_wsrv *w, int *fd)
{
	if (*fd >= 0) {
		(void)epoll_ctl(w->ep, EPOLL_CTL_DEL, *fd, NULL);
		close(*fd);
		*fd = -1;
	}
}

static void slot_free(struct kvt_wsrv *w, struct held *h)
{
	if (h->lockfd >= 0)
		w->n_held--;
	close_fd(w, &h->conn);
	close_fd(w, &h->lockfd);
	close_fd(w, &h->pidfd);
	h->used = 0;
	if (w->paused) {
		struct epoll_event ev = { .events = EPOLLIN, .data.u64 = EV(EV_LISTEN, 0) };

		if (!epoll_ctl(w->ep, EPOLL_CTL_MOD, w->lfd, &ev))
			w->paused = 0;
	}
}

int kvt_wsrv_open(const kvt_seg *s, uint32_t max, kvt_wsrv **out)
{
	struct kvt_wsrv *w;
	struct stat st;
	int r;

	*out = NULL;
	if (!s || s->fd < 0 || !max)
		return kvt__err(-EINVAL, "witness server: no segment");
	if (fstat(s->fd, &st))
		return kvt__err(-errno, "witness server: fstat: %s", strerror(errno));
	w = calloc(1, sizeof(*w));
	if (!w || !(w->h = calloc(max + W_SPARE, sizeof(*w->h)))) {
		free(w);
		return kvt__err(-ENOMEM, "witness server: out of memory");
	}
	w->lfd = w->ep = -1;
	w->max = max;
	w->n_slots = max + W_SPARE;
	w->dev = st.st_dev;
	w->ino = st.st_ino;
	w->ep = epoll_create1(EPOLL_CLOEXEC);
	if (w->ep < 0) {
		r = kvt__err(-errno, "witness server: epoll: %s", strerror(errno));
		goto fail;
	}
	r = w->lfd = kvt_seg_side_listen(s, W_NAME, w->path, sizeof(w->path));
	if (r < 0) {
		r = kvt__err(r, "witness server: %s", kvt_core_last_error());
		goto fail;
	}
	ep_add(w, w->lfd, EV(EV_LISTEN, 0));
	*out = w;
	return 0;
fail:
	if (w->lfd >= 0)
		close(w->lfd);
	if (w->ep >= 0)
		close(w->ep);
	free(w->h);
	free(w);
	return r;
}

int kvt_seg_side_path(const kvt_seg *s, const char *prefix, char *out, size_t len)
{
	if (!s || s->fd < 0 || !prefix || !out || !len || strchr(prefix, '/'))
		return -EINVAL;
	return kvt__side_path(s->fd, prefix, s->name, out, len);
}

long long kvt_seg_file_uid(const kvt_seg *s)
{
	struct stat st;

	if (!s || s->fd < 0 || fstat(s->fd, &st))
		return -1;
	return (long long)st.st_uid;
}

int kvt_seg_side_listen(const kvt_seg *s, const char *prefix, char *path, size_t len)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct stat st;
	int fd, r;

	r = kvt_seg_side_path(s, prefix, path, len);
	if (!r && strlen(path) >= sizeof(a.sun_path))
		r = -ENAMETOOLONG;
	if (r)
		return kvt__err(r, "no socket path beside the segment's file: %s", strerror(-r));
	if (fstat(s->fd, &st))
		return kvt__err(-errno, "fstat of the segment: %s", strerror(errno));
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return kvt__err(-errno, "socket: %s", strerror(errno));
	memcpy(a.sun_path, path, strlen(path) + 1);
	/* The caller owns the segment (one owner at a time, owner.c): a
	 * socket file there is a dead predecessor's. */
	(void)unlink(path);
	if (bind(fd, (struct sockaddr *)&a, sizeof(a)) || chmod(path, st.st_mode & 0666) ||
	    listen(fd, 64)) {
		r = kvt__err(-errno, "%s: %s", path, strerror(errno));
		(void)unlink(path);
		close(fd);
		return r;
	}
	return fd;
}

int kvt_wsrv_fd(const kvt_wsrv *w)
{
	return w ? w->ep : -1;
}

const char *kvt_wsrv_path(const kvt_wsrv *w)
{
	return w ? w->path : "";
}

void kvt_wsrv_counts(const kvt_wsrv *w, uint32_t *held, uint64_t *exited,
		     uint64_t *byes, uint64_t *refused)
{
	*held = w ? w->n_held : 0;
	*exited = w ? w->exited : 0;
	*byes = w ? w->byes : 0;
	*refused = w ? w->refused : 0;
}

static void answer(int fd, const char *msg)
{
	(void)send(fd, msg, strlen(msg) + 1, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* Refuses a request with its reason.  A holding connection loses only
 * the connection: its hold ends as any other (D1). */
static void refuse(struct kvt_wsrv *w, struct held *h, const char *why)
{
	char m[200];

	snprintf(m, sizeof(m), "e%s", why);
	answer(h->conn, m);
	w->refused++;
	if (h->lockfd >= 0)
		close_fd(w, &h->conn);
	else
		slot_free(w, h);
}

/* The pid a pidfd refers to, as /proc shows it to us; 0 unknown. */
static int pidfd_pid(int fd)
{
	char p[64], buf[512];
	int f, pid = 0;
	ssize_t n;
	const char *at;

	snprintf(p, sizeof(p), "/proc/self/fd/%d", fd);
	n = readlink(p, buf, sizeof(buf) - 1);
	if (n < 0)
		return -1;
	buf[n] = 0;
	if (strcmp(buf, "anon_inode:[pidfd]"))
		return -1;
	snprintf(p, sizeof(p), "/proc/self/fdinfo/%d", fd);
	f = open(p, O_RDONLY | O_CLOEXEC);
	if (f < 0)
		return 0;
	n = read(f, buf, sizeof(buf) - 1);
	close(f);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	at = strstr(buf, "\nPid:");
	if (at)
		pid = atoi(at + 5);
	return pid;
}

static void on_hold(struct kvt_wsrv *w, struct held *h, const int *fds, int nfds)
{
	struct ucred cr;
	socklen_t cl = sizeof(cr), pl = sizeof(int);
	struct statx sx;
	struct epoll_event ev = { .events = EPOLLIN };
	int pidfd = -1, pid;

	if (w->n_held >= w->max || nfds != 2) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		refuse(w, h, nfds != 2 ? "HOLD carries two descriptors" :
		       "kvtierd holds as many ranks as the segment has entries");
		return;
	}
	/* cached attributes only: a file on a FUSE mount must not make the
	 * daemon wait on its server */
	if (statx(fds[0], "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_INO, &sx) ||
	    makedev(sx.stx_dev_major, sx.stx_dev_minor) != w->dev || sx.stx_ino != w->ino) {
		close(fds[0]);
		close(fds[1]);
		refuse(w, h, "the descriptor is not this segment's file");
		return;
	}
	/* The rank's pidfd: the kernel's own for the peer where it has one
	 * (SO_PEERPIDFD, Linux 6.5; in any PID namespace), else the one it
	 * sent, which must be the peer's as this namespace sees it (D2). */
	if (!getsockopt(h->conn, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &pl) && pidfd >= 0) {
		close(fds[1]);
	} else {
		pid = pidfd_pid(fds[1]);
		if (getsockopt(h->conn, SOL_SOCKET, SO_PEERCRED, &cr, &cl) || pid <= 0 ||
		    pid != cr.pid) {
			close(fds[0]);
			close(fds[1]);
			refuse(w, h, "the pidfd is not the sender's (or the sender is not "
			       "visible in kvtierd's PID namespace: run kvtierd in the host's)");
			return;
		}
		pidfd = fds[1];
	}
	ev.data.u64 = EV(EV_PIDFD, h - w->h);
	if (epoll_ctl(w->ep, EPOLL_CTL_ADD, pidfd, &ev)) {
		close(fds[0]);
		close(pidfd);
		refuse(w, h, "kvtierd cannot watch the pidfd");
		return;
	}
	h->lockfd = fds[0];
	h->pidfd = pidfd;
	w->n_held++;
	answer(h->conn, "h");
}

static void on_conn(struct kvt_wsrv *w, struct held *h)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * 4)];
		struct cmsghdr align;
	} u;
	struct kvt_wmsg m;
	struct iovec iov = { .iov_base = &m, .iov_len = sizeof(m) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf) };
	int fds[4], nfds = 0;
	ssize_t n;

	memset(&m, 0, sizeof(m));
	memset(u.buf, 0, sizeof(u.buf));
	n = recvmsg(h->conn, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n < 0)
		mh.msg_controllen = 0; /* an error (ECONNRESET): no descriptors came,
					* whatever the kernel left in msg_controllen */
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			for (size_t i = 0; i < k; i++) {
				int fd;
				memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
				if (nfds < 4)
					fds[nfds++] = fd;
				else
					close(fd);
			}
		}
	if (n <= 0) {
		/* The end of the connection (or an error on it).  Holding:
		 * the rank died, or a fork child closed its copy -- keep
		 * holding until the pidfd says it exited (D1). */
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		if (h->lockfd >= 0)
			close_fd(w, &h->conn);
		else
			slot_free(w, h);
		return;
	}
	if ((size_t)n != sizeof(m) || m.magic != KVT_WMSG_MAGIC || m.version != 1 ||
	    (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		refuse(w, h, "not a kvtier witness message (version 1)");
		return;
	}
	if (m.op == KVT_WMSG_HOLD && h->lockfd < 0) {
		on_hold(w, h, fds, nfds);
		return;
	}
	for (int i = 0; i < nfds; i++)
		close(fds[i]);
	if (m.op == KVT_WMSG_BYE && h->lockfd >= 0) {
		/* the rank released its entry itself (D1) */
		w->byes++;
		slot_free(w, h);
		return;
	}
	refuse(w, h, "unexpected message");
}

static void on_listen(struct kvt_wsrv *w)
{
	for (int k = 0; k < 64; k++) { /* a bounded turn: the daemon has a loop to run */
		int c = accept4(w->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		uint32_t i;

		if (c < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
			    errno == ENOMEM) {
				struct epoll_event ev = { .events = 0,
							  .data.u64 = EV(EV_LISTEN, 0) };
				if (!epoll_ctl(w->ep, EPOLL_CTL_MOD, w->lfd, &ev))
					w->paused = 1;
			}
			return;
		}
		for (i = 0; i < w->n_slots && w->h[i].used; i++)
			;
		if (i == w->n_slots) {
			/* idle connections fill the spare room: this one is
			 * closed unanswered (the rank: "did not answer") */
			w->refused++;
			close(c);
			continue;
		}
		w->h[i] = (struct held){ .conn = c, .lockfd = -1, .pidfd = -1, .used = 1 };
		ep_add(w, c, EV(EV_CONN, i));
	}
}

int kvt_wsrv_service(kvt_wsrv *w)
{
	struct epoll_event ev[32];
	int n, done = 0;

	if (!w)
		return 0;
	/* one batch per call: whatever a peer does, the daemon's loop turns */
	if ((n = epoll_wait(w->ep, ev, 32, 0)) > 0) {
		for (int i = 0; i < n; i++) {
			uint32_t kind = (uint32_t)(ev[i].data.u64 >> 32);
			uint32_t x = (uint32_t)ev[i].data.u64;
			struct held *h = x < w->n_slots ? &w->h[x] : NULL;

			if (kind == EV_LISTEN) {
				on_listen(w);
			} else if (kind == EV_CONN && h && h->used && h->conn >= 0) {
				on_conn(w, h);
			} else if (kind == EV_PIDFD && h && h->used && h->pidfd >= 0) {
				/* the rank wholly exited: its lock goes now (D1) */
				w->exited++;
				slot_free(w, h);
			}
			done++;
		}
	}
	return done;
}

void kvt_wsrv_close(kvt_wsrv *w)
{
	if (!w)
		return;
	for (uint32_t i = 0; i < w->n_slots; i++)
		if (w->h[i].used)
			slot_free(w, &w->h[i]);
	(void)unlink(w->path);
	close(w->lfd);
	close(w->ep);
	free(w->h);
	free(w);
}
