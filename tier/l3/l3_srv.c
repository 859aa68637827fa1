/* l3_srv.c - kvtierd's side of the L3 channel (kvt_l3_chan.h: the
 * protocol and why it is a socket).
 *
 * Invariants:
 *  S1  nothing a peer sends keeps kvtierd's loop: every socket is
 *      non-blocking, a call serves one batch of epoll events and at most
 *      S_MSGS messages per connection, an answer that does not fit in a
 *      peer's socket buffer is dropped (the rank's ask then times out,
 *      KVT_L3C_ASK_NS, and it asks again).
 *  S2  every field of an ASK is checked (magic, version, op, the reserved
 *      words, the count against the datagram's real length: MSG_TRUNC); a
 *      bad message ends that connection.  The store is asked only through
 *      kvt_l3e_ask, which holds the engine's limits (jobs, its queue, the
 *      negative cache).  A depth is the asker's word: a wrong one costs
 *      a get whose object the header check refuses (a miss, counted and
 *      remembered for that depth only, so that it cannot hide the right
 *      ask's answer), never a wrong byte.  The check's "any depth"
 *      (KVT_L3_ANY_DEPTH) is no depth an asker may send: a message with it
 *      is bad.
 *  S3  bounded: S_CONNS connections (a scheduler and its ranks per
 *      instance), one past them closed unanswered; S_ROUTES keys waiting
 *      for an answer, an ask that finds no room answered MISSING at once.
 *      Shared: a connection holds at most its share of the routes, the
 *      engine's queue (KVT_L3E_QUEUE) over the connections open now, and
 *      an ask past it is answered MISSING before the engine sees it; every
 *      ask the engine queues for it holds a route, so no asker fills the
 *      queue or the routes and starves the others (a connection already
 *      over a share that shrank keeps what it holds until answered).
 *      A listener kvtierd cannot accept from (no descriptors left) is
 *      taken out of the epoll set for a second: level-triggered, it would
 *      wake the loop without end.
 *
 * Acquire/release pairs: none (no shared memory here; the claims are the
 * engine's, through core).  Schedule points: none; a step that matters
 * for bytes is the engine's.
 */
#include "kvt_clock.h"
#include "kvt_l3_srv.h"
#include "kvt_l3_chan.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define S_CONNS   64
#define S_ROUTES  4096   /* power of two */
#define S_PROBE   8
#define S_MSGS    16
#define S_ROUTE_NS 10000000000ull /* a route no answer came for: freed */

_Static_assert((int)KVT_L3C_HERE == (int)KVT_L3E_HERE && (int)KVT_L3C_MISSING == (int)KVT_L3E_MISSING,
	       "the channel's results are the engine's");

struct conn {
	int fd;            /* -1: free */
	uint32_t n_out;
	uint32_t routes;   /* routes with its bit: S3's share */
	struct kvt_l3c_msg out;
};

struct route {
	kvt_key k;
	uint64_t mask;     /* 0: free */
	uint64_t ns;
};

struct kvt_l3srv {
	int lfd, ep;
	kvt_l3e *e;
	struct conn c[S_CONNS];
	struct route rt[S_ROUTES];
	struct kvt_l3srv_info info;
	uint64_t paused_until;     /* S3: the listener out of the set until */
	char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
};

static uint32_t route_hash(const kvt_key *k)
{
	uint64_t h = (k->lo ^ (k->hi * 0x9e3779b97f4a7c15ull)) * 0xff51afd7ed558ccdull;

	return (uint32_t)(h >> 40) & (S_ROUTES - 1);
}

static void conn_close(kvt_l3srv *v, uint32_t i)
{
	struct conn *c = &v->c[i];

	if (c->fd < 0)
		return;
	(void)epoll_ctl(v->ep, EPOLL_CTL_DEL, c->fd, NULL);
	close(c->fd);
	c->fd = -1;
	c->n_out = 0;
	/* its routes: the bit, so that a newcomer in this slot is not sent
	 * another's answers */
	for (uint32_t r = 0; r < S_ROUTES; r++)
		v->rt[r].mask &= ~(1ull << i);
	c->routes = 0;
	v->info.conns--;
}

static void conn_flush(kvt_l3srv *v, uint32_t i)
{
	struct conn *c = &v->c[i];
	size_t len;
	ssize_t n;

	if (c->fd < 0 || !c->n_out)
		return;
	c->out.h = (struct kvt_l3c_hdr){ .magic = KVT_L3C_MAGIC, .version = KVT_L3C_VERSION,
					 .op = KVT_L3C_ANSWER, .n = c->n_out };
	len = sizeof(c->out.h) + c->n_out * sizeof(c->out.it[0]);
	do
		n = send(c->fd, &c->out, len, MSG_DONTWAIT | MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	if (n == (ssize_t)len) {
		v->info.answers += c->n_out;
	} else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS)) {
		v->info.answers_dropped += c->n_out; /* S1: the rank asks again */
	} else {
		c->n_out = 0;
		conn_close(v, i);
		return;
	}
	c->n_out = 0;
}

static void conn_answer(kvt_l3srv *v, uint32_t i, const kvt_key *k, int result)
{
	struct conn *c = &v->c[i];

	if (c->fd < 0)
		return;
	if (c->n_out == KVT_L3C_MAX)
		conn_flush(v, i);
	if (c->fd < 0)
		return;
	c->out.it[c->n_out++] = (struct kvt_l3c_item){ .lo = k->lo, .hi = k->hi,
						       .value = (uint32_t)result };
}

/* A route's connections let go of it (answered, or taken over); its mask
 * is returned. */
static uint64_t route_free(kvt_l3srv *v, struct route *r)
{
	uint64_t mask = r->mask;

	for (uint64_t m = mask; m; m &= m - 1)
		v->c[__builtin_ctzll(m)].routes--;
	r->mask = 0;
	return mask;
}

/* The engine's answer for a key some connections asked for. */
static void on_answer(void *arg, const kvt_key *k, int result)
{
	kvt_l3srv *v = arg;
	uint32_t h = route_hash(k);

	for (uint32_t p = 0; p < S_PROBE; p++) {
		struct route *r = &v->rt[(h + p) & (S_ROUTES - 1)];

		if (!r->mask || r->k.lo != k->lo || r->k.hi != k->hi)
			continue;
		uint64_t mask = route_free(v, r);
		for (uint64_t m = mask; m; m &= m - 1)
			conn_answer(v, (uint32_t)__builtin_ctzll(m), k, result);
		return;
	}
}

/* Remembers that connection i waits for k's answer; 0, or -ENOSPC. */
static int route_add(kvt_l3srv *v, uint32_t i, const kvt_key *k, uint64_t now)
{
	uint32_t h = route_hash(k);
	struct route *room = NULL;

	for (uint32_t p = 0; p < S_PROBE; p++) {
		struct route *r = &v->rt[(h + p) & (S_ROUTES - 1)];

		if (r->mask && r->k.lo == k->lo && r->k.hi == k->hi) {
			if (!(r->mask & (1ull << i)))
				v->c[i].routes++;
			r->mask |= 1ull << i;
			r->ns = now; /* still wanted: not taken over */
			return 0;
		}
		if (!room && (!r->mask || now - r->ns > S_ROUTE_NS))
			room = r;
	}
	if (!room)
		return -ENOSPC;
	route_free(v, room); /* no answer came in S_ROUTE_NS: taken over */
	room->k = *k;
	room->mask = 1ull << i;
	room->ns = now;
	v->c[i].routes++;
	return 0;
}

/* S2: an ask's depths, before any is asked: 0, or -EINVAL. */
static int ask_depths_ok(const struct kvt_l3c_msg *m)
{
	for (uint32_t x = 0; x < m->h.n; x++)
		if (m->it[x].value == KVT_L3_ANY_DEPTH)
			return -EINVAL;
	return 0;
}

static void on_ask(kvt_l3srv *v, uint32_t i, const struct kvt_l3c_msg *m, size_t len)
{
	uint64_t now = kvt__now_ns();
	uint32_t share = KVT_L3E_QUEUE / v->info.conns; /* S3; conns >= 1: this one */

	for (uint32_t x = 0; x < m->h.n; x++) {
		kvt_key k = { .lo = m->it[x].lo, .hi = m->it[x].hi };
		int r;

		v->info.asks++;
		if (v->c[i].routes >= share) {
			v->info.over_share++;
			conn_answer(v, i, &k, KVT_L3E_MISSING);
			continue;
		}
		r = kvt_l3e_ask(v->e, &k, m->it[x].value);
		if (r == KVT_L3E_ASKED && route_add(v, i, &k, now)) {
			r = KVT_L3E_MISSING;
			v->info.routes_full++;
		}
		if (r != KVT_L3E_ASKED)
			conn_answer(v, i, &k, r);
	}
	(void)len;
}

_Static_assert(sizeof(((struct kvt_l3c_status *)0)->put_ns) ==
	       sizeof(((struct kvt_hist_snap *)0)->bucket), "core's histogram buckets");

void kvt_l3_figures(kvt_l3e *e, const kvt_l3srv *v, struct kvt_l3c_status *st)
{
	struct kvt_l3e_info in;

	kvt_l3e_info(e, &in);
	*st = (struct kvt_l3c_status){
		.up = (uint32_t)in.store.up, .nodes = in.store.nodes,
		.nodes_up = in.store.nodes_up, .inflight = in.inflight,
		.askers = v ? v->info.conns : 0,
		.puts = in.puts, .put_bytes = in.put_bytes, .put_drops = in.put_drops,
		.gets = in.gets, .get_bytes = in.get_bytes, .get_drops = in.get_drops,
		.misses = in.misses, .refused = in.refused, .negative_hits = in.negative_hits,
		.errors = in.store.errors, .redirects = in.store.redirects,
		.asks = v ? v->info.asks : 0, .round_trips = in.store.round_trips,
		.fetches = in.fetches, .put_ns_sum = in.put_ns.sum_ns,
		.get_ns_sum = in.get_ns.sum_ns };
	memcpy(st->put_ns, in.put_ns.bucket, sizeof(st->put_ns));
	memcpy(st->get_ns, in.get_ns.bucket, sizeof(st->get_ns));
	snprintf(st->describe, sizeof(st->describe), "%.159s", in.store.describe);
}

static void on_status(kvt_l3srv *v, uint32_t i)
{
	struct kvt_l3c_status_msg m = { .h = { .magic = KVT_L3C_MAGIC,
					       .version = KVT_L3C_VERSION,
					       .op = KVT_L3C_STATUS } };

	kvt_l3_figures(v->e, v, &m.st);
	/* S1: dropped when it does not fit, the viewer shows no L3 line */
	(void)send(v->c[i].fd, &m, sizeof(m), MSG_DONTWAIT | MSG_NOSIGNAL);
}

static void on_conn(kvt_l3srv *v, uint32_t i)
{
	struct kvt_l3c_msg m;

	for (int k = 0; k < S_MSGS && v->c[i].fd >= 0; k++) {
		/* MSG_TRUNC: the datagram's real length, so a longer one than
		 * any message is refused, not read as its first bytes */
		ssize_t n = recv(v->c[i].fd, &m, sizeof(m), MSG_DONTWAIT | MSG_TRUNC);

		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
			break;
		if (n <= 0) { /* the asker is gone (or ECONNRESET) */
			conn_close(v, i);
			return;
		}
		if (kvt_l3c_ok(&m, (size_t)n, KVT_L3C_STATUS) && !m.h.n) {
			on_status(v, i);
			continue;
		}
		/* S2: every field, before anything is used */
		if (!kvt_l3c_ok(&m, (size_t)n, KVT_L3C_ASK) || ask_depths_ok(&m)) {
			v->info.bad++;
			conn_close(v, i);
			return;
		}
		on_ask(v, i, &m, (size_t)n);
	}
	conn_flush(v, i);
}

static void on_listen(kvt_l3srv *v)
{
	for (;;) {
		int fd = accept4(v->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		uint32_t i;

		if (fd < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
			    errno == ENOMEM) {
				(void)epoll_ctl(v->ep, EPOLL_CTL_DEL, v->lfd, NULL);
				v->paused_until = kvt__now_ns() + 1000000000ull;
			}
			return;
		}
		for (i = 0; i < S_CONNS && v->c[i].fd >= 0; i++)
			;
		if (i == S_CONNS) { /* S3 */
			close(fd);
			v->info.refused++;
			continue;
		}
		struct epoll_event ev = { .events = EPOLLIN, .data.u32 = i + 1 };
		if (epoll_ctl(v->ep, EPOLL_CTL_ADD, fd, &ev)) {
			close(fd);
			continue;
		}
		v->c[i].fd = fd;
		v->c[i].n_out = 0;
		v->info.conns++;
	}
}

int kvt_l3srv_open(kvt_seg *s, kvt_l3e *e, kvt_l3srv **out, char *err, size_t len)
{
	struct epoll_event ev = { .events = EPOLLIN, .data.u32 = 0 };
	kvt_l3srv *v;
	int r;

	*out = NULL;
	v = calloc(1, sizeof(*v));
	if (!v) {
		snprintf(err, len, "out of memory");
		return -ENOMEM;
	}
	v->e = e;
	v->lfd = v->ep = -1;
	for (uint32_t i = 0; i < S_CONNS; i++)
		v->c[i].fd = -1;
	v->ep = epoll_create1(EPOLL_CLOEXEC);
	if (v->ep < 0) {
		r = -errno;
		snprintf(err, len, "epoll: %s", strerror(errno));
		goto fail;
	}
	r = v->lfd = kvt_seg_side_listen(s, KVT_L3C_NAME, v->path, sizeof(v->path));
	if (r < 0) {
		snprintf(err, len, "%s", kvt_core_last_error());
		goto fail;
	}
	if (epoll_ctl(v->ep, EPOLL_CTL_ADD, v->lfd, &ev)) {
		r = -errno;
		snprintf(err, len, "epoll: %s", strerror(errno));
		goto fail;
	}
	kvt_l3e_set_answer(e, on_answer, v);
	*out = v;
	return 0;
fail:
	if (v->lfd >= 0) {
		close(v->lfd);
		(void)unlink(v->path);
	}
	if (v->ep >= 0)
		close(v->ep);
	free(v);
	return r;
}

int kvt_l3srv_fd(const kvt_l3srv *v)
{
	return v ? v->ep : -1;
}

const char *kvt_l3srv_path(const kvt_l3srv *v)
{
	return v ? v->path : "";
}

int kvt_l3srv_service(kvt_l3srv *v)
{
	struct epoll_event ev[32];
	int n;

	if (!v)
		return 0;
	if (v->paused_until && kvt__now_ns() >= v->paused_until) {
		struct epoll_event le = { .events = EPOLLIN, .data.u32 = 0 };

		if (!epoll_ctl(v->ep, EPOLL_CTL_ADD, v->lfd, &le))
			v->paused_until = 0;
	}
	n = epoll_wait(v->ep, ev, 32, 0);
	for (int k = 0; k < n; k++) {
		if (!ev[k].data.u32)
			on_listen(v);
		else if (ev[k].data.u32 <= S_CONNS)
			on_conn(v, ev[k].data.u32 - 1);
	}
	return n > 0 ? n : 0;
}

void kvt_l3srv_flush(kvt_l3srv *v)
{
	if (!v)
		return;
	for (uint32_t i = 0; i < S_CONNS; i++)
		conn_flush(v, i);
}

void kvt_l3srv_info(const kvt_l3srv *v, struct kvt_l3srv_info *out)
{
	memset(out, 0, sizeof(*out));
	if (v)
		*out = v->info;
}

void kvt_l3srv_close(kvt_l3srv *v)
{
	if (!v)
		return;
	kvt_l3e_set_answer(v->e, NULL, NULL);
	for (uint32_t i = 0; i < S_CONNS; i++)
		conn_close(v, i);
	(void)unlink(v->path);
	close(v->lfd);
	close(v->ep);
	free(v);
}
