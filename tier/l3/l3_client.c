/* l3_client.c - a lookup's side of the L3 channel (kvt_l3_chan.h: the
 * protocol).  Per kvt_tier handle, used by its one thread at a time.
 *
 * Invariants:
 *  C1  never a wait: the connect, the send and every read are
 *      non-blocking; a listener that does not accept now is tried again a
 *      second later.
 *  C2  an ask is pending for at most KVT_L3C_ASK_NS without an answer,
 *      and not at all once the connection ended: a scheduler that bounds
 *      its own wait always converges, whatever the daemon does.
 *  C3  what the answers say never decides a byte: a hit is the segment's
 *      READY (published by kvtierd only after its checks); HERE only means
 *      "look in the segment", MISSING only "recompute".
 *  C4  a fork child does not share its parent's connection (answers would
 *      go to whichever reads first): the connection is the pid's.
 */
#include "kvt_l3_client.h"
#include "kvt_l3_chan.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define C_TABLE     1024         /* power of two; a collision forgets one */
#define C_MISSING_NS 1000000000ull /* a MISSING answer is believed this long */
#define C_RETRY_NS  1000000000ull  /* a connect that failed: tried again after */

enum { C_NONE = 0, C_ASKED, C_MISSING };

struct kvt_l3c {
	int fd;
	pid_t pid;
	ino_t ino;         /* the connection's socket (C4) */
	uint64_t next_try;
	struct { kvt_key k; uint64_t ns; uint32_t st; } t[C_TABLE];
	struct kvt_l3c_msg q;
	uint64_t asks, answers;
};

static uint32_t slot_of(const kvt_key *k)
{
	uint64_t h = (k->lo ^ (k->hi * 0x9e3779b97f4a7c15ull)) * 0xff51afd7ed558ccdull;

	return (uint32_t)(h >> 44) & (C_TABLE - 1);
}

kvt_l3c *kvt__l3c_new(void)
{
	kvt_l3c *c = calloc(1, sizeof(*c));

	if (c)
		c->fd = -1;
	return c;
}

/* Closes this handle's connection: our own, or a fork child's copy of
 * its parent's -- unless the child has reused that number for a file of
 * its own (C4). */
static void close_own(kvt_l3c *c)
{
	struct stat st;

	if (c->fd >= 0 && (c->pid == getpid() ||
			   (!fstat(c->fd, &st) && S_ISSOCK(st.st_mode) && st.st_ino == c->ino)))
		close(c->fd);
	c->fd = -1;
}

void kvt__l3c_free(kvt_l3c *c)
{
	if (!c)
		return;
	close_own(c);
	free(c);
}

/* The connection ended: nothing asked is pending any more (C2). */
static void drop(kvt_l3c *c, uint64_t now)
{
	close_own(c);
	c->next_try = now + C_RETRY_NS;
	for (uint32_t i = 0; i < C_TABLE; i++)
		if (c->t[i].st == C_ASKED)
			c->t[i].st = C_NONE;
}

/* A non-blocking connection to the segment's kvtierd L3 channel, or
 * -errno.  A unix connect completes at once or fails at once (EAGAIN: the
 * backlog is full) -- C1. */
static int chan_connect(kvt_seg *s)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct ucred cr;
	socklen_t cl = sizeof(cr);
	int fd, r;

	r = kvt_seg_side_path(s, KVT_L3C_NAME, a.sun_path, sizeof(a.sun_path));
	if (r)
		return r;
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	if (connect(fd, (struct sockaddr *)&a, sizeof(a)) ||
	    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl)) {
		r = -errno;
		close(fd);
		return r;
	}
	/* a name in a shared directory can be taken by anyone first: only
	 * root's, ours or the segment file's owner's (as the witness) */
	if (cr.uid != 0 && cr.uid != geteuid() && (long long)cr.uid != kvt_seg_file_uid(s)) {
		close(fd);
		return -EPERM;
	}
	return fd;
}

static void try_connect(kvt_l3c *c, kvt_seg *s, uint64_t now)
{
	struct stat st;
	int fd;

	c->next_try = now + C_RETRY_NS;
	fd = chan_connect(s);
	if (fd < 0)
		return;
	c->fd = fd;
	c->pid = getpid();
	if (!fstat(fd, &st))
		c->ino = st.st_ino;
}

int kvt__l3c_status(kvt_seg *s, struct kvt_l3c_status *out, int timeout_ms)
{
	struct kvt_l3c_hdr q = { .magic = KVT_L3C_MAGIC, .version = KVT_L3C_VERSION,
				 .op = KVT_L3C_STATUS };
	struct kvt_l3c_status_msg m;
	struct pollfd p;
	ssize_t n;
	int fd = chan_connect(s), r = -ETIMEDOUT;

	if (fd < 0)
		return fd;
	if (send(fd, &q, sizeof(q), MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof(q)) {
		r = -errno;
		goto out;
	}
	p = (struct pollfd){ .fd = fd, .events = POLLIN };
	if (poll(&p, 1, timeout_ms) != 1)
		goto out;
	n = recv(fd, &m, sizeof(m), MSG_DONTWAIT | MSG_TRUNC);
	if (n != (ssize_t)sizeof(m) || m.h.magic != KVT_L3C_MAGIC ||
	    m.h.version != KVT_L3C_VERSION || m.h.op != KVT_L3C_STATUS) {
		r = -EPROTO;
		goto out;
	}
	m.st.describe[sizeof(m.st.describe) - 1] = 0;
	*out = m.st;
	r = 0;
out:
	close(fd);
	return r;
}

static void take(kvt_l3c *c, const struct kvt_l3c_msg *m, ssize_t n, uint64_t now)
{
	if (n < 0 || !kvt_l3c_ok(m, (size_t)n, KVT_L3C_ANSWER))
		return; /* not an answer we know: ignored (C3) */
	for (uint32_t i = 0; i < m->h.n; i++) {
		kvt_key k = { .lo = m->it[i].lo, .hi = m->it[i].hi };
		uint32_t x = slot_of(&k);

		if (c->t[x].st != C_ASKED || c->t[x].k.lo != k.lo || c->t[x].k.hi != k.hi)
			continue;
		c->answers++;
		if (m->it[i].value == KVT_L3C_MISSING) {
			c->t[x].st = C_MISSING;
			c->t[x].ns = now;
		} else {
			c->t[x].st = C_NONE; /* HERE: the segment shows it now */
		}
	}
}

int kvt__l3c_begin(kvt_l3c *c, kvt_seg *s, uint64_t now)
{
	struct kvt_l3c_msg m;

	c->q.h.n = 0;
	if (c->fd >= 0 && c->pid != getpid()) { /* C4: the parent's, closed (kvtierd
						 * would not see the parent go) */
		drop(c, now);
		c->next_try = now;
	}
	if (c->fd < 0 && now >= c->next_try)
		try_connect(c, s, now);
	if (c->fd < 0)
		return 0;
	for (;;) {
		ssize_t n = recv(c->fd, &m, sizeof(m), MSG_DONTWAIT | MSG_TRUNC);

		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			break;
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) { /* the daemon is gone */
			drop(c, now);
			return 0;
		}
		take(c, &m, n, now);
	}
	return 1;
}

int kvt__l3c_state(kvt_l3c *c, const kvt_key *k, uint64_t now)
{
	uint32_t x = slot_of(k);

	if (c->t[x].k.lo != k->lo || c->t[x].k.hi != k->hi)
		return KVT_L3C_NOT_ASKED;
	if (c->t[x].st == C_ASKED && now - c->t[x].ns < KVT_L3C_ASK_NS)
		return KVT_L3C_PENDING;
	if (c->t[x].st == C_MISSING && now - c->t[x].ns < C_MISSING_NS)
		return KVT_L3C_NOT_THERE;
	return KVT_L3C_NOT_ASKED;
}

int kvt__l3c_queue(kvt_l3c *c, const kvt_key *k, uint32_t depth, uint64_t now)
{
	uint32_t x;

	if (c->fd < 0)
		return -ENOTCONN;
	if (c->q.h.n == KVT_L3C_MAX)
		return -ENOBUFS;
	x = slot_of(k);
	c->t[x].k = *k;
	c->t[x].st = C_ASKED;
	c->t[x].ns = now;
	c->q.it[c->q.h.n++] = (struct kvt_l3c_item){ .lo = k->lo, .hi = k->hi, .value = depth };
	return 0;
}

int kvt__l3c_send(kvt_l3c *c, uint64_t now)
{
	size_t len;
	ssize_t n;

	if (!c->q.h.n || c->fd < 0)
		return 0;
	c->q.h.magic = KVT_L3C_MAGIC;
	c->q.h.version = KVT_L3C_VERSION;
	c->q.h.op = KVT_L3C_ASK;
	c->q.h.reserved = 0;
	len = sizeof(c->q.h) + c->q.h.n * sizeof(c->q.it[0]);
	do
		n = send(c->fd, &c->q, len, MSG_DONTWAIT | MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	if (n == (ssize_t)len) {
		c->asks += c->q.h.n;
		c->q.h.n = 0;
		return 0;
	}
	/* not sent: not pending (C2); a full socket keeps the connection */
	int e = n < 0 ? errno : EIO;
	for (uint32_t i = 0; i < c->q.h.n; i++) {
		kvt_key k = { .lo = c->q.it[i].lo, .hi = c->q.it[i].hi };
		c->t[slot_of(&k)].st = C_NONE;
	}
	c->q.h.n = 0;
	if (e != EAGAIN && e != EWOULDBLOCK && e != ENOBUFS)
		drop(c, now);
	return -e;
}
