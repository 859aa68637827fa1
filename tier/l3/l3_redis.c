/* l3_redis.c - the L3 tier's Redis backend: Redis Cluster (or one plain
 * Redis) through Debian's hiredis, behind kvt_l3.h.
 *
 * One thread per backend does the network I/O; submit and reap only take
 * the queue's lock, so kvtierd's loop never waits for the store.  A round
 * takes up to BATCH queued requests, routes each (CRC16 of the key's hash
 * tag, the cluster's slot map), and per master pipelines them on its one
 * connection: all the commands written, then the replies read in order.
 *   PUT is written as RESP by hand, the value with writev straight from
 *   the caller's pieces (header, the arena's sub-slot, tag): hiredis would
 *   copy the value into its own buffer first.  A round's replies are read
 *   by hand (rd_*, a RESP subset: status, error, integer, bulk), a GET's
 *   value straight from the socket into the pieces; hiredis' reader serves
 *   only the one-command exchanges outside rounds (AUTH, CLUSTER SLOTS,
 *   the probe), so it never holds a round's bytes.  The timeout is the
 *   socket's, per read: a server that trickles a reply byte by byte can
 *   hold the I/O thread longer than timeout_ms (left as it is).
 *   Cluster: the slot map from CLUSTER SLOTS (on open, and again after a
 *   MOVED or a node lost); MOVED retries at the named master and updates
 *   the slot, ASK retries there once behind ASKING; at most MAX_HOPS
 *   redirects per request.  A plain Redis (cluster support disabled) is one
 *   node for every slot.
 *   Failure: a connection error fails the node's requests of the round
 *   (-ENOTCONN; a command that timed out, -ETIMEDOUT), marks the node down,
 *   and reconnects only after a backoff (50 ms doubling to 2 s), so a dead
 *   master costs a request nothing but an immediate -ENOTCONN meanwhile.
 *   OOM from a store at maxmemory without eviction: -ENOSPC.  NOAUTH,
 *   WRONGPASS, NOPERM: -EACCES, named.
 *   Credentials come from a file (never the command line): one line,
 *   "password" or "user password" (an ACL user).
 * Thread safety: the queue, the done list and the status under `mu`; the
 * nodes, the slot map and the connections belong to the I/O thread after
 * open (the node count and each node's `up` are also read by status():
 * __atomic, release/acquire on the count).
 */
#include "kvt_clock.h"
#include "kvt_l3_int.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <hiredis/hiredis.h>

#define MAX_NODES   64
#define N_SLOTS     16384
#define BATCH       64
#define MAX_HOPS    5
#define BACKOFF_MIN 50
#define BACKOFF_MAX 2000

/* A round's replies, read by hand (rd_*): a GET's value straight into the
 * caller's pieces, not through hiredis' reader (16 KiB reads into a
 * buffer that grows to the value, a reply object with a copy of it, and
 * the copy out: three copies of every value).  What is left in it is
 * never a reply: a round reads exactly its own. */
#define RD_BUF (64u << 10)
struct rdbuf {
	char b[RD_BUF];
	size_t pos, len;
};

struct rnode {
	char host[64];
	int port;
	redisContext *c;
	struct rdbuf *rd;    /* allocated at the first round */
	uint64_t retry_ns;   /* not before: down, backing off */
	uint32_t backoff_ms;
	int up;
};

struct rl3 {
	struct kvt_l3_conf conf;
	char user[128], pass[256];
	int have_auth;
	struct timeval tv;

	struct rnode nodes[MAX_NODES];
	uint32_t n_nodes;
	uint32_t n_seeds;          /* nodes[0..n_seeds): the URL's */
	int cluster;
	int known;                 /* the map was read once (cluster or not) */
	uint16_t slot[N_SLOTS];    /* node of each slot (cluster) */
	int map_stale;

	pthread_t th;
	int th_live;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	struct kvt_l3_list q, d;    /* submitted; done */
	int stop;
	int efd;
	struct kvt_l3_status st;   /* under mu */
};

static void set_error(struct rl3 *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(struct rl3 *r, const char *fmt, ...)
{
	va_list ap;

	pthread_mutex_lock(&r->mu);
	va_start(ap, fmt);
	vsnprintf(r->st.last_error, sizeof(r->st.last_error), fmt, ap);
	va_end(ap);
	r->st.errors++;
	pthread_mutex_unlock(&r->mu);
}

/* The store is up when every master known is connected (or has not been
 * needed since it came back): a store with a master down is "down" --
 * degraded -- until that master answers again.  An error reply (a full
 * store, a refused command) says nothing about reachability. */
static void up_update(struct rl3 *r)
{
	int up = r->n_nodes > 0;

	for (uint32_t i = 0; i < r->n_nodes; i++)
		if (!r->nodes[i].c && r->nodes[i].retry_ns)
			up = 0; /* dropped, not reconnected yet */
	pthread_mutex_lock(&r->mu);
	r->st.up = up;
	pthread_mutex_unlock(&r->mu);
}

/* ---- routing ---- */

/* CRC16-CCITT (XMODEM), as Redis Cluster hashes keys. */
static uint16_t crc16(const char *p, size_t n)
{
	uint16_t crc = 0;

	for (size_t i = 0; i < n; i++) {
		crc ^= (uint16_t)((uint8_t)p[i] << 8);
		for (int b = 0; b < 8; b++)
			crc = crc & 0x8000 ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
	}
	return crc;
}

/* The key's slot: of its hash tag ({...}, non-empty) when it has one. */
static uint32_t key_slot(const char *k)
{
	const char *o = strchr(k, '{'), *c = o ? strchr(o + 1, '}') : NULL;

	if (o && c && c > o + 1)
		return crc16(o + 1, (size_t)(c - o - 1)) % N_SLOTS;
	return crc16(k, strlen(k)) % N_SLOTS;
}

static int node_find(struct rl3 *r, const char *host, int port, int add)
{
	for (uint32_t i = 0; i < r->n_nodes; i++)
		if (r->nodes[i].port == port && !strcmp(r->nodes[i].host, host))
			return (int)i;
	if (!add || r->n_nodes == MAX_NODES || strlen(host) >= sizeof(r->nodes[0].host))
		return -1;
	struct rnode *n = &r->nodes[r->n_nodes];
	memset(n, 0, sizeof(*n));
	snprintf(n->host, sizeof(n->host), "%s", host);
	n->port = port;
	/* release: status() reads the count without the thread's help */
	__atomic_store_n(&r->n_nodes, r->n_nodes + 1, __ATOMIC_RELEASE);
	return (int)r->n_nodes - 1;
}

/* ---- connections ---- */

static void node_drop(struct rl3 *r, struct rnode *n, const char *why_in)
{
	char why[160];

	snprintf(why, sizeof(why), "%s", why_in); /* often the context's errstr */
	if (n->c) {
		redisFree(n->c);
		n->c = NULL;
	}
	if (n->rd)
		n->rd->pos = n->rd->len = 0;
	__atomic_store_n(&n->up, 0, __ATOMIC_RELAXED);
	n->backoff_ms = n->backoff_ms ? n->backoff_ms * 2 : BACKOFF_MIN;
	if (n->backoff_ms > BACKOFF_MAX)
		n->backoff_ms = BACKOFF_MAX;
	n->retry_ns = kvt__now_ns() + (uint64_t)n->backoff_ms * 1000000ull;
	set_error(r, "%s:%d: %s", n->host, n->port, why);
	r->map_stale = 1;
	pthread_mutex_lock(&r->mu);
	r->st.up = 0;
	pthread_mutex_unlock(&r->mu);
}

static int reply_errno(const redisReply *y)
{
	if (!y)
		return -EIO;
	if (y->type != REDIS_REPLY_ERROR)
		return 0;
	if (!strncmp(y->str, "NOAUTH", 6) || !strncmp(y->str, "WRONGPASS", 9) ||
	    !strncmp(y->str, "NOPERM", 6) || !strncmp(y->str, "ERR invalid password", 20) ||
	    strstr(y->str, "AUTH <password> called without any password"))
		return -EACCES;
	if (!strncmp(y->str, "OOM", 3))
		return -ENOSPC;
	return -EIO;
}

/* Connects and authenticates n: 0, or -errno with the reason in msg. */
static int node_connect(struct rl3 *r, struct rnode *n, char *msg, size_t len)
{
	redisReply *y;
	int rc = 0;

	if (n->c)
		return 0;
	n->c = redisConnectWithTimeout(n->host, n->port, r->tv);
	if (!n->c || n->c->err) {
		rc = n->c && n->c->err == REDIS_ERR_IO && errno == ECONNREFUSED ? -ECONNREFUSED :
		     n->c && n->c->err == REDIS_ERR_IO && errno == ETIMEDOUT ? -ETIMEDOUT : -ENOTCONN;
		snprintf(msg, len, "%s:%d: connect: %s", n->host, n->port,
			 n->c ? n->c->errstr : "out of memory");
		if (n->c)
			redisFree(n->c);
		n->c = NULL;
		return rc;
	}
	redisSetTimeout(n->c, r->tv);
	if (r->have_auth) {
		y = r->user[0] ? redisCommand(n->c, "AUTH %s %s", r->user, r->pass)
			       : redisCommand(n->c, "AUTH %s", r->pass);
		rc = y ? reply_errno(y) : -ENOTCONN;
		if (rc)
			snprintf(msg, len, "%s:%d: AUTH%s%s refused: %s", n->host, n->port,
				 r->user[0] ? " as " : "", r->user, y ? y->str : n->c->errstr);
		if (y)
			freeReplyObject(y);
		if (rc) {
			redisFree(n->c);
			n->c = NULL;
			return rc == -EIO ? -EACCES : rc;
		}
	}
	__atomic_store_n(&n->up, 1, __ATOMIC_RELAXED);
	n->backoff_ms = 0;
	n->retry_ns = 0;
	return 0;
}

/* The slot map from any reachable node: 0, -ENOTCONN (none answered), or
 * the first refusal (-EACCES).  A node without cluster support makes a
 * plain Redis of node 0. */
static int map_refresh(struct rl3 *r, char *msg, size_t len)
{
	int first_err = -ENOTCONN;

	for (uint32_t i = 0; i < r->n_nodes; i++) {
		struct rnode *n = &r->nodes[i];
		redisReply *y;
		int rc;

		if (!n->c && kvt__now_ns() < n->retry_ns)
			continue;
		rc = node_connect(r, n, msg, len);
		if (rc) {
			if (rc == -EACCES)
				return rc;
			n->retry_ns = kvt__now_ns() + BACKOFF_MIN * 1000000ull;
			first_err = first_err == -ENOTCONN ? rc : first_err;
			continue;
		}
		y = redisCommand(n->c, "CLUSTER SLOTS");
		if (!y) {
			node_drop(r, n, n->c->errstr);
			continue;
		}
		if (y->type == REDIS_REPLY_ERROR && strstr(y->str, "cluster support disabled")) {
			freeReplyObject(y);
			r->cluster = 0;
			if (i != 0) { /* this one is the store: make it node 0 */
				struct rnode t = r->nodes[0];
				r->nodes[0] = *n;
				*n = t;
			}
			r->map_stale = 0;
			r->known = 1;
			return 0;
		}
		if (y->type != REDIS_REPLY_ARRAY) {
			snprintf(msg, len, "%s:%d: CLUSTER SLOTS: %s", n->host, n->port,
				 y->type == REDIS_REPLY_ERROR ? y->str : "not an array");
			rc = reply_errno(y);
			freeReplyObject(y);
			if (rc == -EACCES)
				return rc;
			continue;
		}
		int covered = 0;
		for (size_t k = 0; k < y->elements; k++) {
			redisReply *e = y->element[k];
			if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
			    e->element[0]->type != REDIS_REPLY_INTEGER ||
			    e->element[1]->type != REDIS_REPLY_INTEGER ||
			    e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
			    e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
			    e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
				continue;
			long long a = e->element[0]->integer, b = e->element[1]->integer;
			const char *host = e->element[2]->element[0]->str;
			int port = (int)e->element[2]->element[1]->integer;
			/* a node that reports "" for itself: the address we used */
			int ni = node_find(r, host[0] ? host : n->host, port, 1);
			if (ni < 0 || a < 0 || b >= N_SLOTS || a > b)
				continue;
			for (long long s = a; s <= b; s++)
				r->slot[s] = (uint16_t)ni;
			covered += (int)(b - a + 1);
		}
		freeReplyObject(y);
		r->cluster = 1;
		r->known = 1;
		r->map_stale = covered != N_SLOTS;
		return 0;
	}
	return first_err;
}

/* ---- requests ---- */

/* A request done: on the done list; the event descriptor is written once
 * per round (round_run), not per request. */
static void complete(struct rl3 *r, struct kvt_l3_req *q, int status)
{
	q->status = status;
	q->ns = kvt__now_ns() - q->t0;
	pthread_mutex_lock(&r->mu);
	kvt__l3_list_add(&r->d, q);
	pthread_mutex_unlock(&r->mu);
}

static void wake(struct rl3 *r)
{
	uint64_t one = 1;

	(void)!write(r->efd, &one, sizeof(one));
}

static uint64_t iov_len(const struct kvt_l3_req *q)
{
	uint64_t n = 0;

	for (uint32_t i = 0; i < q->iovcnt; i++)
		n += q->iov[i].iov_len;
	return n;
}

/* hiredis's output buffer onto the socket (before a raw write). */
static int flush(redisContext *c)
{
	int done = 0;

	while (!done)
		if (redisBufferWrite(c, &done) == REDIS_ERR)
			return -1;
	return 0;
}

/* sendmsg, not writev: MSG_NOSIGNAL, so a store gone away is EPIPE, not
 * SIGPIPE in the engine's process. */
static int write_all(int fd, struct iovec *v, int n)
{
	while (n > 0) {
		struct msghdr m = { .msg_iov = v, .msg_iovlen = (size_t)n };
		ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);

		if (w < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		while (n > 0 && (size_t)w >= v->iov_len) {
			w -= (ssize_t)v->iov_len;
			v++;
			n--;
		}
		if (n > 0) {
			v->iov_base = (char *)v->iov_base + w;
			v->iov_len -= (size_t)w;
		}
	}
	return 0;
}

/* Writes one request's command (behind ASKING for an ASK retry). */
static int send_req(redisContext *c, struct kvt_l3_req *q)
{
	if (q->ask >= 0 && redisAppendCommand(c, "ASKING") != REDIS_OK)
		return -1;
	if (q->op == KVT_L3_GET)
		return redisAppendCommand(c, "GET %s", q->key) == REDIS_OK ? 0 : -1;
	if (q->op == KVT_L3_EXISTS) {
		const char *argv[1 + 64];
		uint32_t n = q->n_keys > 64 ? 64 : q->n_keys;

		argv[0] = "EXISTS";
		for (uint32_t i = 0; i < n; i++)
			argv[1 + i] = q->keys[i];
		return redisAppendCommandArgv(c, (int)n + 1, argv, NULL) == REDIS_OK ? 0 : -1;
	}
	/* PUT: RESP by hand, the value from the caller's pieces */
	char head[KVT_L3_KEY_MAX + 64];
	struct iovec v[2 + 8];
	size_t kl = strlen(q->key);
	int n = 0;

	if (flush(c))
		return -1;
	v[n].iov_base = head;
	v[n++].iov_len = (size_t)snprintf(head, sizeof(head), "*3\r\n$3\r\nSET\r\n$%zu\r\n%s\r\n"
					  "$%llu\r\n", kl, q->key,
					  (unsigned long long)iov_len(q));
	for (uint32_t i = 0; i < q->iovcnt && i < 8; i++)
		v[n++] = q->iov[i];
	v[n].iov_base = (void *)"\r\n";
	v[n++].iov_len = 2;
	return write_all(c->fd, v, n);
}

/* More bytes from the socket (the context's timeout applies): > 0, or
 * -ETIMEDOUT / -ENOTCONN (the connection ended or failed). */
static int rd_fill(int fd, struct rdbuf *d)
{
	ssize_t k;

	if (d->pos && d->pos == d->len)
		d->pos = d->len = 0;
	if (d->len == sizeof(d->b)) { /* a line longer than the buffer */
		if (!d->pos)
			return -EPROTO;
		memmove(d->b, d->b + d->pos, d->len - d->pos);
		d->len -= d->pos;
		d->pos = 0;
	}
	do
		k = recv(fd, d->b + d->len, sizeof(d->b) - d->len, 0);
	while (k < 0 && errno == EINTR);
	if (k > 0) {
		d->len += (size_t)k;
		return (int)k;
	}
	return k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ETIMEDOUT) ?
	       -ETIMEDOUT : -ENOTCONN;
}

/* One reply line (type byte and text, the CRLF cut) into out: its length
 * or -errno. */
static int rd_line(int fd, struct rdbuf *d, char *out, size_t max)
{
	for (;;) {
		char *e = d->len > d->pos ? memchr(d->b + d->pos, '\n', d->len - d->pos) : NULL;
		if (e) {
			size_t n = (size_t)(e - (d->b + d->pos));
			if (!n || e[-1] != '\r')
				return -EPROTO;
			n--;
			if (n >= max)
				n = max - 1; /* an error's text: kept short */
			memcpy(out, d->b + d->pos, n);
			out[n] = 0;
			d->pos = (size_t)(e - d->b) + 1;
			return (int)n;
		}
		int r = rd_fill(fd, d);
		if (r < 0)
			return r;
	}
}

/* n bytes of a value into v[0..cnt) (NULL: skipped): what the buffer
 * holds first, the rest read straight into the pieces; 0 or -errno. */
static int rd_value(int fd, struct rdbuf *d, const struct iovec *v, uint32_t cnt, uint64_t n)
{
	struct iovec w[9];
	uint32_t k = 0;
	size_t off = 0; /* into v[k] */

	while (n) {
		size_t have = d->len - d->pos;
		if (have) { /* buffered bytes first */
			size_t t = have < n ? have : (size_t)n;
			if (v) {
				size_t done = 0;
				while (done < t && k < cnt) {
					size_t room = v[k].iov_len - off, c = t - done < room ? t - done : room;
					memcpy((char *)v[k].iov_base + off, d->b + d->pos + done, c);
					done += c;
					off += c;
					if (off == v[k].iov_len) {
						k++;
						off = 0;
					}
				}
			}
			d->pos += t;
			n -= t;
			continue;
		}
		if (!v || n < 4096) { /* small or skipped: through the buffer */
			int r = rd_fill(fd, d);
			if (r < 0)
				return r;
			continue;
		}
		/* the rest of the pieces, with one read */
		uint32_t m = 0;
		uint64_t left = n;
		for (uint32_t i = k; i < cnt && m < 9 && left; i++) {
			size_t o = i == k ? off : 0, l = v[i].iov_len - o;
			if (l > left)
				l = (size_t)left;
			w[m++] = (struct iovec){ (char *)v[i].iov_base + o, l };
			left -= l;
		}
		ssize_t got;
		do
			got = readv(fd, w, (int)m);
		while (got < 0 && errno == EINTR);
		if (got <= 0)
			return got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK ||
					   errno == ETIMEDOUT) ? -ETIMEDOUT : -ENOTCONN;
		n -= (uint64_t)got;
		while (got > 0) {
			size_t room = v[k].iov_len - off, c = (size_t)got < room ? (size_t)got : room;
			got -= (ssize_t)c;
			off += c;
			if (off == v[k].iov_len) {
				k++;
				off = 0;
			}
		}
	}
	return 0;
}

/* A reply line's number: digits, an optional '-', nothing else. */
static int rd_number(const char *p, long long *out)
{
	char *end;

	errno = 0;
	*out = strtoll(p, &end, 10);
	return end == p || *end || errno ? -EPROTO : 0;
}

/* One reply, read by hand, as take_reply sees it (y: a hiredis reply on
 * the stack, its text in buf); a GET's value is already in its pieces
 * then (*in_place).  0 or -errno (the stream is lost: drop the node). */
static int rd_reply(int fd, struct rdbuf *d, struct kvt_l3_req *q, redisReply *y, char *buf,
		    size_t max, int *in_place)
{
	int n = rd_line(fd, d, buf, max), r;

	*in_place = 0;
	memset(y, 0, sizeof(*y));
	if (n < 1)
		return n < 0 ? n : -EPROTO;
	y->str = buf + 1;
	y->len = (size_t)n - 1;
	switch (buf[0]) {
	case '+': y->type = REDIS_REPLY_STATUS; return 0;
	case '-': y->type = REDIS_REPLY_ERROR; return 0;
	case ':':
		y->type = REDIS_REPLY_INTEGER;
		return rd_number(buf + 1, &y->integer);
	case '$': {
		long long len;
		char crlf[2];
		if (rd_number(buf + 1, &len) || len < -1)
			return -EPROTO;
		if (len == -1) {
			y->type = REDIS_REPLY_NIL;
			return 0;
		}
		y->type = REDIS_REPLY_STRING;
		y->len = (size_t)len;
		int fits = q && q->op == KVT_L3_GET && (uint64_t)len == iov_len(q);
		r = rd_value(fd, d, fits ? q->iov : NULL, fits ? q->iovcnt : 0, (uint64_t)len);
		if (!r) {
			struct iovec c = { crlf, 2 };
			r = rd_value(fd, d, &c, 1, 2);
		}
		if (r)
			return r;
		if (crlf[0] != '\r' || crlf[1] != '\n')
			return -EPROTO;
		*in_place = fits;
		y->str = NULL;
		return 0;
	}
	default: /* arrays, and anything else: not a reply of ours */
		return -EPROTO;
	}
}

/* What one reply means for its request: 0.. a status, or 1 (redirected:
 * requeued by the caller). */
static int take_reply(struct rl3 *r, struct kvt_l3_req *q, redisReply *y, int in_place)
{
	if (y->type == REDIS_REPLY_ERROR &&
	    (!strncmp(y->str, "MOVED ", 6) || !strncmp(y->str, "ASK ", 4))) {
		int ask = y->str[0] == 'A';
		unsigned slot;
		char host[64];
		int port;
		const char *addr = strchr(y->str + (ask ? 4 : 6), ' ');
		const char *colon = addr ? strrchr(addr, ':') : NULL;

		if (!addr || !colon || sscanf(y->str + (ask ? 4 : 6), "%u", &slot) != 1 ||
		    (size_t)(colon - addr - 1) >= sizeof(host) || slot >= N_SLOTS ||
		    q->hops >= MAX_HOPS)
			return -EIO;
		memcpy(host, addr + 1, (size_t)(colon - addr - 1));
		host[colon - addr - 1] = 0;
		port = atoi(colon + 1);
		int ni = node_find(r, host, port, 1);
		if (ni < 0)
			return -EIO;
		q->hops++;
		pthread_mutex_lock(&r->mu);
		r->st.redirects++;
		pthread_mutex_unlock(&r->mu);
		if (ask) {
			q->ask = ni;
		} else {
			r->slot[slot] = (uint16_t)ni;
			r->map_stale = 1; /* a reshard: the rest of the map may move too */
			q->ask = -1;
		}
		return 1;
	}
	if (y->type == REDIS_REPLY_ERROR) {
		int e = reply_errno(y);

		set_error(r, "%s: %s", q->key, y->str);
		return e ? e : -EIO;
	}
	switch (q->op) {
	case KVT_L3_PUT:
		return y->type == REDIS_REPLY_STATUS ? 0 : -EIO;
	case KVT_L3_EXISTS:
		return y->type == REDIS_REPLY_INTEGER && y->integer == (long long)q->n_keys ? 0
											  : -ENOENT;
	case KVT_L3_GET: {
		if (y->type == REDIS_REPLY_NIL)
			return -ENOENT;
		if (y->type != REDIS_REPLY_STRING)
			return -EIO;
		q->got = (uint64_t)y->len;
		if (q->got != iov_len(q))
			return -EMSGSIZE;
		/* a value of the right length was read into the pieces */
		return in_place ? 0 : -EIO;
	}
	default:
		return -EINVAL;
	}
}

static int node_of(struct rl3 *r, const struct kvt_l3_req *q)
{
	if (q->ask >= 0)
		return q->ask;
	if (!r->cluster)
		return 0;
	return r->slot[key_slot(q->op == KVT_L3_EXISTS ? q->keys[0] : q->key)];
}

/* One node's share of a round: pipelined.  Redirected requests go to
 * *again. */
static void node_round(struct rl3 *r, struct rnode *n, struct kvt_l3_req **list, uint32_t cnt,
		       struct kvt_l3_req **again)
{
	char msg[256];
	uint32_t sent = 0;

	if (!n->c && kvt__now_ns() < n->retry_ns) {
		for (uint32_t i = 0; i < cnt; i++)
			complete(r, list[i], -ENOTCONN);
		return;
	}
	if (node_connect(r, n, msg, sizeof(msg))) {
		node_drop(r, n, msg);
		for (uint32_t i = 0; i < cnt; i++)
			complete(r, list[i], -ENOTCONN);
		return;
	}
	for (; sent < cnt; sent++)
		if (send_req(n->c, list[sent]))
			break;
	if (sent < cnt || flush(n->c)) {
		/* What reached the server is unknown (hiredis' buffer half
		 * written, a SET cut in its value): the stream cannot be
		 * matched to replies any more.  Drop it; the round fails. */
		node_drop(r, n, n->c->err ? n->c->errstr : "send failed");
		for (uint32_t i = 0; i < cnt; i++)
			complete(r, list[i], -ENOTCONN);
		return;
	}
	if (!n->rd && !(n->rd = calloc(1, sizeof(*n->rd)))) {
		node_drop(r, n, "out of memory");
		for (uint32_t i = 0; i < cnt; i++)
			complete(r, list[i], -ENOMEM);
		return;
	}
	for (uint32_t i = 0; i < cnt; i++) {
		redisReply y;
		char line[256];
		int st, in_place;

		if (!n->c) { /* dropped by an earlier reply's error */
			complete(r, list[i], -ENOTCONN);
			continue;
		}
		if (list[i]->ask >= 0) { /* ASKING's +OK first */
			st = rd_reply(n->c->fd, n->rd, NULL, &y, line, sizeof(line), &in_place);
			if (st) {
				node_drop(r, n, st == -ETIMEDOUT ? "reply timed out" :
					  st == -EPROTO ? "a reply kvtier does not read" : "connection lost");
				complete(r, list[i], st == -ETIMEDOUT ? -ETIMEDOUT : -ENOTCONN);
				continue;
			}
			list[i]->ask = -1;
		}
		st = rd_reply(n->c->fd, n->rd, list[i], &y, line, sizeof(line), &in_place);
		if (st) {
			/* the stream cannot be matched to requests any more */
			node_drop(r, n, st == -ETIMEDOUT ? "reply timed out" :
				  st == -EPROTO ? "a reply kvtier does not read" : "connection lost");
			complete(r, list[i], st == -ETIMEDOUT ? -ETIMEDOUT : -ENOTCONN);
			continue;
		}
		st = take_reply(r, list[i], &y, in_place);
		pthread_mutex_lock(&r->mu);
		r->st.round_trips++;
		pthread_mutex_unlock(&r->mu);
		if (st == 1) {
			list[i]->next = *again;
			*again = list[i];
		} else {
			complete(r, list[i], st);
		}
	}
}

static void describe_set(struct rl3 *r)
{
	char d[sizeof(r->st.describe)];

	snprintf(d, sizeof(d), "redis %s: %u node%s (%s:%d%s)",
		 r->cluster ? "cluster" : "(one node)", r->n_nodes, r->n_nodes == 1 ? "" : "s",
		 r->nodes[0].host, r->nodes[0].port, r->n_nodes > 1 ? ", ..." : "");
	pthread_mutex_lock(&r->mu);
	memcpy(r->st.describe, d, sizeof(d));
	pthread_mutex_unlock(&r->mu);
}

static void round_run(struct rl3 *r, struct kvt_l3_req *batch)
{
	struct kvt_l3_req *per[MAX_NODES][BATCH];
	uint32_t cnt[MAX_NODES] = { 0 };
	char msg[256];

	while (batch) {
		struct kvt_l3_req *again = NULL;

		if (((r->map_stale && r->cluster) || !r->known) &&
		    map_refresh(r, msg, sizeof(msg)) == -EACCES)
			set_error(r, "%s", msg);
		if (r->known && !r->st.describe[0])
			describe_set(r);
		if (!r->known) { /* no node answered yet: the round fails */
			for (struct kvt_l3_req *q = batch, *nx; q; q = nx) {
				nx = q->next;
				complete(r, q, -ENOTCONN);
			}
			break;
		}
		memset(cnt, 0, sizeof(cnt));
		for (struct kvt_l3_req *q = batch, *nx; q; q = nx) {
			nx = q->next;
			int ni = node_of(r, q);
			if (ni < 0 || (uint32_t)ni >= r->n_nodes || cnt[ni] == BATCH) {
				complete(r, q, -EIO);
				continue;
			}
			per[ni][cnt[ni]++] = q;
		}
		for (uint32_t i = 0; i < r->n_nodes; i++)
			if (cnt[i]) {
				node_round(r, &r->nodes[i], per[i], cnt[i], &again);
				wake(r); /* this master's completions, before the next one's */
			}
		batch = again;
	}
	up_update(r);
	wake(r);
}

/* With nothing queued, a store that is down is tried again by the thread
 * itself once each node's backoff passed: a failed request is not retried
 * (a put is voided, a get a miss), so without this the store's return
 * would be noticed only by the next request that happened to come after
 * the backoff -- or never.  The thread's own nodes; called unlocked. */
static void probe(struct rl3 *r)
{
	char msg[256];
	uint64_t now = kvt__now_ns();

	if (!r->known) {
		if (map_refresh(r, msg, sizeof(msg)) == 0)
			describe_set(r);
	} else {
		for (uint32_t i = 0; i < r->n_nodes; i++) {
			struct rnode *n = &r->nodes[i];
			if (n->c || !n->retry_ns || now < n->retry_ns)
				continue;
			if (node_connect(r, n, msg, sizeof(msg)))
				node_drop(r, n, msg);
			else if (r->cluster)
				r->map_stale = 1; /* back: the map may have moved meanwhile */
		}
	}
	up_update(r);
}

static void *io_thread(void *arg)
{
	struct rl3 *r = arg;

	pthread_mutex_lock(&r->mu);
	for (;;) {
		while (!r->q.head && !r->stop) {
			if (r->st.up) {
				pthread_cond_wait(&r->cv, &r->mu);
				continue;
			}
			struct timespec ts;
			clock_gettime(CLOCK_REALTIME, &ts);
			ts.tv_nsec += BACKOFF_MIN * 1000000L;
			if (ts.tv_nsec >= 1000000000L) {
				ts.tv_sec++;
				ts.tv_nsec -= 1000000000L;
			}
			if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) == ETIMEDOUT && !r->q.head &&
			    !r->stop) {
				pthread_mutex_unlock(&r->mu);
				probe(r);
				pthread_mutex_lock(&r->mu);
			}
		}
		if (!r->q.head)
			break;
		struct kvt_l3_req *b = kvt__l3_list_pop(&r->q), *t = b;
		for (uint32_t n = 1; r->q.head && n < BATCH; n++)
			t = t->next = kvt__l3_list_pop(&r->q);
		pthread_mutex_unlock(&r->mu);
		round_run(r, b);
		pthread_mutex_lock(&r->mu);
	}
	pthread_mutex_unlock(&r->mu);
	return NULL;
}

/* ---- the ops ---- */

static int auth_load(struct rl3 *r, const char *path, char *err, size_t len)
{
	char buf[512], *nl, *sp;
	struct stat st;
	ssize_t n;
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);

	if (fd < 0)
		return snprintf(err, len, "auth file %s: %s", path, strerror(errno)), -EINVAL;
	if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (st.st_mode & 077)) {
		close(fd);
		return snprintf(err, len, "auth file %s: must be a regular file with no access "
				"for others (chmod 600)", path), -EINVAL;
	}
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return snprintf(err, len, "auth file %s: empty", path), -EINVAL;
	buf[n] = 0;
	if ((nl = strpbrk(buf, "\r\n")))
		*nl = 0;
	sp = strchr(buf, ' ');
	if (sp) {
		*sp = 0;
		if (strlen(buf) >= sizeof(r->user) || strlen(sp + 1) >= sizeof(r->pass) || !sp[1])
			return snprintf(err, len, "auth file %s: \"user password\" too long or "
					"incomplete", path), -EINVAL;
		/* lengths checked above */
		memcpy(r->user, buf, strlen(buf) + 1);
		memcpy(r->pass, sp + 1, strlen(sp + 1) + 1);
	} else {
		if (!buf[0] || strlen(buf) >= sizeof(r->pass))
			return snprintf(err, len, "auth file %s: no password on its first line",
					path), -EINVAL;
		memcpy(r->pass, buf, strlen(buf) + 1);  /* length checked above */
	}
	r->have_auth = 1;
	return 0;
}

/* redis://HOST:PORT[,HOST:PORT...] */
static int url_parse(struct rl3 *r, const char *url, char *err, size_t len)
{
	char buf[1024], *save = NULL;

	if (strncmp(url, "redis://", 8) || strlen(url + 8) >= sizeof(buf) || !url[8])
		return snprintf(err, len, "l3 %s: not redis://HOST:PORT[,HOST:PORT...]", url),
		       -EINVAL;
	snprintf(buf, sizeof(buf), "%s", url + 8);
	for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		char *c = strrchr(t, ':'), *end;
		long port;

		if (!c || c == t)
			return snprintf(err, len, "l3 %s: '%s' is not HOST:PORT", url, t), -EINVAL;
		*c = 0;
		port = strtol(c + 1, &end, 10);
		if (*end || port <= 0 || port > 65535 || node_find(r, t, (int)port, 1) < 0)
			return snprintf(err, len, "l3 %s: bad node '%s:%s'", url, t, c + 1), -EINVAL;
	}
	r->n_seeds = r->n_nodes;
	return 0;
}

static void rl3_close(void *be);

static int rl3_open(const struct kvt_l3_conf *c, void **out, char *err, size_t len)
{
	struct rl3 *r = calloc(1, sizeof(*r));
	int rc;

	if (!r)
		return snprintf(err, len, "out of memory"), -ENOMEM;
	r->conf = *c;
	r->efd = -1;
	pthread_mutex_init(&r->mu, NULL);
	pthread_cond_init(&r->cv, NULL);
	uint32_t ms = c->timeout_ms ? c->timeout_ms : 1000;
	r->tv.tv_sec = ms / 1000;
	r->tv.tv_usec = (ms % 1000) * 1000;
	if (!c->depth)
		r->conf.depth = 256;
	if ((rc = url_parse(r, c->url, err, len)) ||
	    (c->auth_file && (rc = auth_load(r, c->auth_file, err, len))))
		goto fail;
	r->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (r->efd < 0) {
		rc = -errno;
		snprintf(err, len, "eventfd: %s", strerror(errno));
		goto fail;
	}
	rc = map_refresh(r, err, len);
	if (rc == -EACCES || rc == -EINVAL)
		goto fail; /* credentials: named at start, never retried */
	if (rc) {
		/* no node answers now: start down, the thread retries (a store
		 * that is away is a miss, not a reason for the node not to run) */
		snprintf(r->st.last_error, sizeof(r->st.last_error), "%s%sno node of %s answered",
			 err, err[0] ? "; " : "", c->url);
		r->st.describe[0] = 0; /* set by the thread once a node answers */
		err[0] = 0;
		r->st.up = 0;
	} else {
		describe_set(r);
		r->st.up = 1;
	}
	if (pthread_create(&r->th, NULL, io_thread, r)) {
		rc = -EAGAIN;
		snprintf(err, len, "cannot start the L3 thread");
		goto fail;
	}
	r->th_live = 1;
	*out = r;
	return 0;
fail:
	rl3_close(r);
	return rc;
}

static int rl3_submit(void *be, struct kvt_l3_req *const *reqs, uint32_t n)
{
	struct rl3 *r = be;
	uint32_t i = 0;

	pthread_mutex_lock(&r->mu);
	if (!r->stop)
		i = kvt__l3_enqueue(&r->q, reqs, n, r->conf.depth, kvt__now_ns());
	pthread_cond_signal(&r->cv);
	pthread_mutex_unlock(&r->mu);
	return (int)i;
}

static int rl3_reap(void *be, struct kvt_l3_req **done, uint32_t max)
{
	struct rl3 *r = be;
	uint64_t v;
	uint32_t n = 0;

	(void)!read(r->efd, &v, sizeof(v));
	pthread_mutex_lock(&r->mu);
	n = kvt__l3_take_done(&r->d, done, max, r->efd);
	pthread_mutex_unlock(&r->mu);
	return (int)n;
}

static int rl3_event_fd(const void *be)
{
	return ((const struct rl3 *)be)->efd;
}

static void rl3_status(void *be, struct kvt_l3_status *out)
{
	struct rl3 *r = be;

	pthread_mutex_lock(&r->mu);
	*out = r->st;
	pthread_mutex_unlock(&r->mu);
	/* the node table is the thread's: counts for a gauge, read as they are */
	out->nodes = __atomic_load_n(&r->n_nodes, __ATOMIC_ACQUIRE);
	out->nodes_up = 0;
	for (uint32_t i = 0; i < out->nodes; i++)
		out->nodes_up += __atomic_load_n(&r->nodes[i].up, __ATOMIC_RELAXED) != 0;
}

static void rl3_close(void *be)
{
	struct rl3 *r = be;

	if (!r)
		return;
	if (r->th_live) {
		/* the thread finishes what is queued (each request completes,
		 * bounded by the timeouts), then exits */
		pthread_mutex_lock(&r->mu);
		r->stop = 1;
		pthread_cond_signal(&r->cv);
		pthread_mutex_unlock(&r->mu);
		pthread_join(r->th, NULL);
	}
	for (uint32_t i = 0; i < r->n_nodes; i++) {
		if (r->nodes[i].c)
			redisFree(r->nodes[i].c);
		free(r->nodes[i].rd);
	}
	if (r->efd >= 0)
		close(r->efd);
	explicit_bzero(r->pass, sizeof(r->pass));
	pthread_mutex_destroy(&r->mu);
	pthread_cond_destroy(&r->cv);
	free(r);
}

const struct kvt_l3_ops kvt__l3_redis_ops = {
	.scheme = "redis://",
	.open = rl3_open,
	.submit = rl3_submit,
	.reap = rl3_reap,
	.event_fd = rl3_event_fd,
	.status = rl3_status,
	.close = rl3_close,
};
