/* http.c - kvtierd's HTTP side (http.h): /healthcheck, /healthcheck/segment,
 * /metrics and /status, answered by libmicrohttpd behind a front thread
 * that admits only whole requests.
 *
 * Why a front.  libmicrohttpd alone holds a connection from accept until
 * its request is whole, and its idle timeout is reset by every byte: 64
 * local clients that send one byte every 8 s held all 64 of its
 * connections forever, and no health probe got in (0 of 40 answered).  A
 * router or liveness probe then marks the node dead or restarts kvtierd.
 *
 * Design.
 *  * The front thread owns the listening socket (epoll).  An accepted
 *    connection is pending until its whole header block is in the socket
 *    buffer: at each arrival (edge-triggered) the front peeks (MSG_PEEK,
 *    nothing consumed) at most KVTD_HTTP_HEAD_MAX bytes and looks for the
 *    empty line that ends the headers (kvtd_http_head_end).  Then the
 *    socket goes to libmicrohttpd (MHD_add_connection), which reads and
 *    answers it at once: nothing it waits for is still on the wire.
 *  * A pending connection has a deadline for its whole header block
 *    (head_timeout_s, 5 s from accept; bytes do not extend it): past it, it
 *    is answered 408 and closed.  A header block not ended within 8 KiB is
 *    answered 431 and closed.  Before an answer the front reads what the
 *    client sent: a close with unread bytes is a reset that loses it.
 *  * The pending table has pending_max slots (256, fewer under a low fd
 *    limit).  When it is full the oldest pending connection is closed to
 *    make room: a new prober always gets in, and has the time the flooder
 *    needs to open pending_max connections to send its request (on
 *    loopback a probe's request is in the buffer as it connects).
 *  * Two libmicrohttpd daemons (no listening socket of their own, ITC so an
 *    added connection is seen at once): the health pool takes the
 *    requests whose request line names /healthcheck or
 *    /healthcheck/segment, the pages pool all others.  Each keeps its own
 *    connection limit (64) and timeout (10 s) as a second line of defence,
 *    so a client that asks for /status and never reads its answer holds a
 *    pages slot, never a health one.  Both pools answer every path: the
 *    split only chooses who waits for whom.
 *  * Every answer carries "Connection: close": a connection never idles in
 *    libmicrohttpd waiting for a second request (keep-alive would let a
 *    slow client hold a slot again).  A handed-over socket's send buffer is
 *    raised (SO_SNDBUF) so an answer goes to the kernel whole and the slot
 *    frees even when the client does not read.
 *  * A request that announces a body (a Content-Length other than 0, any
 *    Transfer-Encoding) is refused 400 on the access handler's first call:
 *    no page takes a body, and waiting for one would be another slow path.
 *    A method other than GET and HEAD gets 405 with Allow.
 *  * Threads: the front (the pending table, its counters: its own), two
 *    libmicrohttpd threads (the handler).  Pages are made one at a time
 *    (page_mu): the page function and the snapshot reads need not be
 *    reentrant.  kvtd_http_stop wakes the front through an eventfd, joins
 *    it, closes what it held, then stops libmicrohttpd.
 *  * What the front refused is counted and reported through the log
 *    callback at most once a minute: a flood is one line, not one a
 *    connection.
 *
 * Cost.  A slow client costs one syscall-sized peek per segment it sends
 * (at most 8 KiB copied), about what its send cost it; a pending
 * connection lives at most 5 s.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <microhttpd.h>

#include "kvt_clock.h"
#include "http.h"

#define PENDING_DEFAULT 256
#define HEAD_TIMEOUT_DEFAULT_S 5.0
#define MHD_LIMIT 64              /* connections per pool */
#define MHD_TIMEOUT_S 10
#define SNDBUF (1 << 20)
#define REPORT_NS (60ULL * 1000000000ULL)
#define LISTEN_PAUSE_NS (100ULL * 1000000ULL)

#define TAG_LISTEN (UINT64_MAX - 1)
#define TAG_STOP UINT64_MAX

enum { POOL_HEALTH, POOL_PAGES, POOL__COUNT };

struct pend {
	int fd;                   /* -1: a free slot */
	uint64_t born;            /* accept time, ns: the deadline and the oldest */
	struct sockaddr_in sa;
};

struct kvtd_http {
	struct kvtd_http_opts o;
	char addr[64];
	struct MHD_Daemon *mhd[POOL__COUNT];
	pthread_mutex_t page_mu;  /* one page at a time */
	int lfd, ep, stop_fd;
	pthread_t front;
	int front_started;
	uint64_t head_ns;
	/* the front thread's own from here on */
	struct pend *pend;
	uint32_t n_pend, pend_max;
	uint64_t next_due;        /* the earliest pending deadline; UINT64_MAX: none */
	uint64_t listen_off_until; /* 0: the listening socket is polled */
	uint64_t n_late, n_big, n_evicted, n_refused; /* since the last report */
	uint64_t last_report, next_report;
	char buf[KVTD_HTTP_HEAD_MAX];
};

/* ---- the pure parts ---- */

size_t kvtd_http_head_end(const char *p, size_t n)
{
	size_t i = 0;

	/* empty lines before the request line are skipped, as libmicrohttpd
	 * skips them: "\r\n\r\nGET" is not a whole request */
	while (i < n && (p[i] == '\r' || p[i] == '\n'))
		i++;
	for (; i < n; i++) {
		if (p[i] != '\n')
			continue;
		if (i + 1 < n && p[i + 1] == '\n')
			return i + 2;
		if (i + 2 < n && p[i + 1] == '\r' && p[i + 2] == '\n')
			return i + 3;
	}
	return 0;
}

int kvtd_http_head_is_health(const char *p, size_t n)
{
	static const char *const paths[] = { "/healthcheck", "/healthcheck/segment" };
	size_t i = 0, m;

	while (i < n && (p[i] == '\r' || p[i] == '\n'))
		i++;
	while (i < n && p[i] != ' ')      /* the method */
		i++;
	if (i >= n)
		return 0;
	i++;
	p += i;
	n -= i;
	for (m = 0; m < n && p[m] != ' ' && p[m] != '?' && p[m] != '\r' && p[m] != '\n'; m++)
		;
	for (size_t k = 0; k < sizeof(paths) / sizeof(paths[0]); k++)
		if (strlen(paths[k]) == m && !memcmp(p, paths[k], m))
			return 1;
	return 0;
}

int kvtd_http_header_has_body(const char *name, const char *value)
{
	if (!name)
		return 0;
	if (!strcasecmp(name, MHD_HTTP_HEADER_TRANSFER_ENCODING))
		return 1;
	if (strcasecmp(name, MHD_HTTP_HEADER_CONTENT_LENGTH))
		return 0;
	if (!value || !*value)
		return 1;                 /* not a length: refused, not guessed */
	return value[strspn(value, "0")] != 0;
}

unsigned kvtd_http_route(const char *method, const char *url, int has_body,
			 enum kvtd_page *page)
{
	static const struct {
		const char *url;
		enum kvtd_page page;
	} map[] = {
		{ "/healthcheck", KVTD_PAGE_HEALTH },
		{ "/healthcheck/segment", KVTD_PAGE_SEGMENT },
		{ "/metrics", KVTD_PAGE_METRICS },
		{ "/status", KVTD_PAGE_STATUS },
	};

	*page = KVTD_PAGE_NONE;
	if (!method || (strcmp(method, MHD_HTTP_METHOD_GET) && strcmp(method, MHD_HTTP_METHOD_HEAD)))
		return MHD_HTTP_METHOD_NOT_ALLOWED;
	if (has_body)
		return MHD_HTTP_BAD_REQUEST;
	for (size_t k = 0; url && k < sizeof(map) / sizeof(map[0]); k++)
		if (!strcmp(url, map[k].url)) {
			*page = map[k].page;
			return 0;
		}
	return MHD_HTTP_NOT_FOUND;
}

/* ---- the daemon's pages ---- */

unsigned kvtd_pages_render(void *arg, enum kvtd_page page, char **body, const char **type)
{
	const struct kvtd_pages *p = arg;
	struct kvtd_snap s;
	struct kvtd_ctx x;
	uint32_t wo[KVT_MAX_INSTANCES];
	unsigned code = MHD_HTTP_OK;

	*body = NULL;
	*type = "application/json";
	p->ctx(p->ctx_arg, &x, wo);
	if (page == KVTD_PAGE_SEGMENT) {
		int ok = !x.draining;
		if (asprintf(body, "{\"segment\":\"%s\",\"status\":\"%s\"}\n", p->segment,
			     ok ? "ok" : "draining") < 0)
			*body = NULL;
		return ok ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE;
	}
	if (kvtd_snap_read(p->obs, &s))
		return MHD_HTTP_INTERNAL_SERVER_ERROR;
	switch (page) {
	case KVTD_PAGE_HEALTH:
		code = kvtd_health(&s, &x, body) ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE;
		break;
	case KVTD_PAGE_METRICS:
		*body = kvtd_prometheus(&s, &x);
		*type = "text/plain; version=0.0.4; charset=utf-8";
		break;
	default:
		*body = kvtd_json(&s, &x, NULL);
		break;
	}
	kvtd_snap_free(&s);
	return code;
}

/* ---- libmicrohttpd's side: the access handler ---- */

static enum MHD_Result reply(struct MHD_Connection *c, unsigned code, char *body,
			     const char *type)
{
	struct MHD_Response *r;
	enum MHD_Result ret;

	if (!body) {
		static char oom[] = "out of memory\n";
		r = MHD_create_response_from_buffer(sizeof(oom) - 1, oom, MHD_RESPMEM_PERSISTENT);
		code = MHD_HTTP_INTERNAL_SERVER_ERROR;
		type = "text/plain";
	} else {
		r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
	}
	if (!r) {
		free(body);
		return MHD_NO;
	}
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
	MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
	/* one request a connection: no slot idles waiting for a second */
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
	if (code == MHD_HTTP_METHOD_NOT_ALLOWED)
		MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
	ret = MHD_queue_response(c, code, r);
	MHD_destroy_response(r);
	return ret;
}

static enum MHD_Result body_header(void *cls, enum MHD_ValueKind kind, const char *key,
				   const char *value)
{
	int *has_body = cls;

	(void)kind;
	if (kvtd_http_header_has_body(key, value))
		*has_body = 1;
	return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
				  const char *method, const char *version, const char *upload,
				  size_t *upload_size, void **state)
{
	static char answered;
	struct kvtd_http *h = cls;
	enum kvtd_page page;
	int has_body = 0;
	(void)version; (void)upload;

	/* Every request is answered on the first call, where upload_size is
	 * always 0: a body is refused by its headers, not by its bytes.  A
	 * later call (a body libmicrohttpd still reads) changes nothing. */
	if (*state == &answered) {
		*upload_size = 0;
		return MHD_YES;
	}
	*state = &answered;
	MHD_get_connection_values(conn, MHD_HEADER_KIND, body_header, &has_body);
	unsigned code = kvtd_http_route(method, url, has_body, &page);
	if (code == MHD_HTTP_METHOD_NOT_ALLOWED)
		return reply(conn, code, strdup("method not allowed\n"), "text/plain");
	if (code == MHD_HTTP_BAD_REQUEST)
		return reply(conn, code, strdup("no body expected\n"), "text/plain");
	if (code)
		return reply(conn, code, strdup("not found: try /healthcheck, /healthcheck/segment, "
						"/metrics, /status\n"), "text/plain");
	char *body;
	const char *type;
	pthread_mutex_lock(&h->page_mu);
	code = h->o.page(h->o.page_arg, page, &body, &type);
	pthread_mutex_unlock(&h->page_mu);
	return reply(conn, code, body, type);
}

/* ---- the front thread ---- */

static void front_log(struct kvtd_http *h, int level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void front_log(struct kvtd_http *h, int level, const char *fmt, ...)
{
	char m[512];
	va_list ap;

	if (!h->o.log)
		return;
	va_start(ap, fmt);
	vsnprintf(m, sizeof(m), fmt, ap);
	va_end(ap);
	h->o.log(level, m, h->o.log_arg);
}

static void pend_free(struct kvtd_http *h, uint32_t i)
{
	h->pend[i].fd = -1;
	h->n_pend--;
}

static void pend_close(struct kvtd_http *h, uint32_t i)
{
	close(h->pend[i].fd);    /* close takes it out of the epoll set */
	pend_free(h, i);
}

/* An answer of the front's own, then the close.  What the client sent is
 * read first (a close with unread bytes is a reset, which loses the
 * answer); the send never waits. */
static void pend_refuse(struct kvtd_http *h, uint32_t i, unsigned code)
{
	const char *why = code == 408 ? "Request Timeout" : "Request Header Fields Too Large";
	const char *body = code == 408 ? "the request's headers came too late\n"
				       : "the request's headers are over 8 KiB\n";
	char a[256];
	int fd = h->pend[i].fd;
	int n = snprintf(a, sizeof(a), "HTTP/1.1 %u %s\r\nContent-Type: text/plain\r\n"
			 "Content-Length: %zu\r\nConnection: close\r\n\r\n%s", code, why,
			 strlen(body), body);

	for (int k = 0; k < 4 && recv(fd, h->buf, sizeof(h->buf), MSG_DONTWAIT) > 0; k++)
		;
	if (n > 0 && (size_t)n < sizeof(a))
		(void)send(fd, a, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL);
	shutdown(fd, SHUT_WR);
	pend_close(h, i);
}

static void hand_over(struct kvtd_http *h, uint32_t i, size_t n)
{
	struct pend *p = &h->pend[i];
	int pool = kvtd_http_head_is_health(h->buf, n) ? POOL_HEALTH : POOL_PAGES;
	int sndbuf = SNDBUF;

	epoll_ctl(h->ep, EPOLL_CTL_DEL, p->fd, NULL);
	/* the answer goes to the kernel whole: the slot frees even when the
	 * client does not read (best effort: the kernel caps it) */
	setsockopt(p->fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
	/* closes the socket when it fails (at the pool's limit) */
	if (MHD_add_connection(h->mhd[pool], p->fd, (struct sockaddr *)&p->sa,
			       sizeof(p->sa)) != MHD_YES)
		h->n_refused++;
	pend_free(h, i);
}

static void pend_read(struct kvtd_http *h, uint64_t i, uint32_t events)
{
	if (i >= h->pend_max || h->pend[i].fd < 0)
		return;                   /* closed earlier in this batch */
	ssize_t n = recv(h->pend[i].fd, h->buf, sizeof(h->buf), MSG_PEEK | MSG_DONTWAIT);
	if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) &&
	    !(events & (EPOLLHUP | EPOLLERR)))
		return;
	if (n <= 0) {                     /* gone, or an error */
		pend_close(h, (uint32_t)i);
		return;
	}
	if (kvtd_http_head_end(h->buf, (size_t)n)) {
		hand_over(h, (uint32_t)i, (size_t)n);
	} else if (n >= KVTD_HTTP_HEAD_MAX) {
		h->n_big++;
		pend_refuse(h, (uint32_t)i, 431);
	} else if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) {
		pend_close(h, (uint32_t)i); /* shut its side with the request unended */
	}
}

static uint32_t pend_oldest(const struct kvtd_http *h)
{
	uint32_t best = UINT32_MAX;

	for (uint32_t i = 0; i < h->pend_max; i++)
		if (h->pend[i].fd >= 0 && (best == UINT32_MAX || h->pend[i].born < h->pend[best].born))
			best = i;
	return best;
}

static void listen_pause(struct kvtd_http *h, uint64_t now)
{
	struct epoll_event ev = { .events = 0, .data.u64 = TAG_LISTEN };

	epoll_ctl(h->ep, EPOLL_CTL_MOD, h->lfd, &ev);
	h->listen_off_until = now + LISTEN_PAUSE_NS;
}

static void accept_some(struct kvtd_http *h)
{
	for (int k = 0; k < 64; k++) {
		struct sockaddr_in sa;
		socklen_t len = sizeof(sa);
		int fd = accept4(h->lfd, (struct sockaddr *)&sa, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
				/* out of descriptors: the oldest pending one makes
				 * room, else the listening socket rests a moment
				 * (it would wake the loop at once, for nothing) */
				uint32_t o = pend_oldest(h);
				if (o != UINT32_MAX) {
					h->n_evicted++;
					pend_close(h, o);
					continue;
				}
				listen_pause(h, kvt__now_ns());
			}
			return;               /* EAGAIN: all taken */
		}
		if (h->n_pend == h->pend_max) {
			h->n_evicted++;
			pend_close(h, pend_oldest(h));
		}
		uint32_t i = 0;
		while (h->pend[i].fd >= 0)
			i++;
		struct epoll_event ev = { .events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.u64 = i };
		if (epoll_ctl(h->ep, EPOLL_CTL_ADD, fd, &ev)) {
			close(fd);
			continue;
		}
		h->pend[i] = (struct pend){ .fd = fd, .born = kvt__now_ns(), .sa = sa };
		h->n_pend++;
		if (h->pend[i].born + h->head_ns < h->next_due)
			h->next_due = h->pend[i].born + h->head_ns;
	}
}

static void expire(struct kvtd_http *h, uint64_t now)
{
	uint64_t next = UINT64_MAX;

	if (now < h->next_due)
		return;
	for (uint32_t i = 0; i < h->pend_max; i++) {
		if (h->pend[i].fd < 0)
			continue;
		uint64_t due = h->pend[i].born + h->head_ns;
		if (due <= now) {
			h->n_late++;
			pend_refuse(h, i, 408);
		} else if (due < next) {
			next = due;
		}
	}
	h->next_due = next;
}

static void report(struct kvtd_http *h, uint64_t now)
{
	char m[400] = "";
	int n = 0;

	if (!(h->n_late | h->n_big | h->n_evicted | h->n_refused) || now < h->next_report)
		return;
#define PART(v, ...) \
	if (v && n >= 0 && (size_t)n < sizeof(m)) \
		n += snprintf(m + n, sizeof(m) - (size_t)n, __VA_ARGS__)
	PART(h->n_late, "; %llu without whole headers in %.0f s (408)",
	     (unsigned long long)h->n_late, (double)h->head_ns / 1e9);
	PART(h->n_big, "; %llu with headers over %d KiB (431)", (unsigned long long)h->n_big,
	     KVTD_HTTP_HEAD_MAX / 1024);
	PART(h->n_evicted, "; %llu still without whole headers dropped for newer ones "
	     "(%u may wait)", (unsigned long long)h->n_evicted, h->pend_max);
	PART(h->n_refused, "; %llu refused by libmicrohttpd (%d per pool)",
	     (unsigned long long)h->n_refused, MHD_LIMIT);
#undef PART
	front_log(h, 1, "HTTP: connections closed in the last %.0f s%s (a slow or flooding "
		  "client on %s:%u?)", (double)(now - h->last_report) / 1e9, m,
		  h->addr, h->o.port);
	h->n_late = h->n_big = h->n_evicted = h->n_refused = 0;
	h->last_report = now;
	h->next_report = now + REPORT_NS;
}

static int wait_ms(const struct kvtd_http *h, uint64_t now)
{
	uint64_t due = h->next_due;

	if (h->listen_off_until && h->listen_off_until < due)
		due = h->listen_off_until;
	if ((h->n_late | h->n_big | h->n_evicted | h->n_refused) && h->next_report < due)
		due = h->next_report;
	if (due == UINT64_MAX)
		return -1;
	if (due <= now)
		return 0;
	uint64_t ms = (due - now + 999999) / 1000000;
	return ms > 60000 ? 60000 : (int)ms;
}

static void *front_main(void *arg)
{
	struct kvtd_http *h = arg;
	struct epoll_event ev[64];

	for (;;) {
		int n = epoll_wait(h->ep, ev, 64, wait_ms(h, kvt__now_ns()));
		if (n < 0) {
			if (errno == EINTR)
				continue;
			front_log(h, 1, "HTTP: epoll_wait: %s; the front stops", strerror(errno));
			return NULL;
		}
		for (int k = 0; k < n; k++) {
			uint64_t tag = ev[k].data.u64;
			if (tag == TAG_STOP)
				return NULL;
			if (tag == TAG_LISTEN)
				accept_some(h);
			else
				pend_read(h, tag, ev[k].events);
		}
		uint64_t now = kvt__now_ns();
		if (h->listen_off_until && now >= h->listen_off_until) {
			struct epoll_event le = { .events = EPOLLIN, .data.u64 = TAG_LISTEN };
			epoll_ctl(h->ep, EPOLL_CTL_MOD, h->lfd, &le);
			h->listen_off_until = 0;
		}
		expire(h, now);
		report(h, now);
	}
}

/* ---- start, stop ---- */

static uint32_t pending_max(uint32_t want)
{
	struct rlimit rl;

	if (!want)
		want = PENDING_DEFAULT;
	/* the pools' connections and the daemon's own descriptors first */
	if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur != RLIM_INFINITY) {
		rlim_t room = rl.rlim_cur > 2 * MHD_LIMIT + 64 ? rl.rlim_cur - 2 * MHD_LIMIT - 64 : 0;
		if (room < want)
			want = room < 8 ? 8 : (uint32_t)room;
	}
	return want;
}

int kvtd_http_start(const struct kvtd_http_opts *o, kvtd_http **out, char *err,
		    size_t errlen)
{
	struct kvtd_http *h;
	struct sockaddr_in sa;
	int r, one = 1;

	if (!o || o->size < sizeof(*o) || !o->addr || !o->page || !o->port ||
	    !(o->head_timeout_s >= 0 && o->head_timeout_s <= 3600)) {
		snprintf(err, errlen, "bad HTTP options");
		return -EINVAL;
	}
	memset(&sa, 0, sizeof(sa));
	sa.sin_family = AF_INET;
	sa.sin_port = htons(o->port);
	if (inet_pton(AF_INET, o->addr, &sa.sin_addr) != 1) {
		snprintf(err, errlen, "%s is not an IPv4 address", o->addr);
		return -EINVAL;
	}
	h = calloc(1, sizeof(*h));
	if (!h)
		goto out_oom;
	h->o = *o;
	snprintf(h->addr, sizeof(h->addr), "%s", o->addr);
	h->o.addr = h->addr;
	h->head_ns = (uint64_t)((o->head_timeout_s ? o->head_timeout_s
						    : HEAD_TIMEOUT_DEFAULT_S) * 1e9);
	h->pend_max = pending_max(o->pending_max);
	h->next_due = UINT64_MAX;
	h->lfd = h->ep = h->stop_fd = -1;
	h->pend = calloc(h->pend_max, sizeof(*h->pend));
	if (!h->pend) {
		free(h);
		goto out_oom;
	}
	for (uint32_t i = 0; i < h->pend_max; i++)
		h->pend[i].fd = -1;
	pthread_mutex_init(&h->page_mu, NULL);

	h->lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (h->lfd < 0) {
		r = -errno;
		snprintf(err, errlen, "socket: %s", strerror(-r));
		goto out_free;
	}
	setsockopt(h->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(h->lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(h->lfd, SOMAXCONN)) {
		r = -errno;
		if (r == -EADDRINUSE)
			snprintf(err, errlen, "cannot listen on %s:%u (in use? --http ADDR:PORT "
				 "picks another)", o->addr, o->port);
		else
			snprintf(err, errlen, "cannot listen on %s:%u: %s (--http ADDR:PORT)",
				 o->addr, o->port, strerror(-r));
		goto out_free;
	}
	h->ep = epoll_create1(EPOLL_CLOEXEC);
	h->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (h->ep < 0 || h->stop_fd < 0) {
		r = -errno;
		snprintf(err, errlen, "epoll: %s", strerror(-r));
		goto out_free;
	}
	struct epoll_event le = { .events = EPOLLIN, .data.u64 = TAG_LISTEN };
	struct epoll_event se = { .events = EPOLLIN, .data.u64 = TAG_STOP };
	if (epoll_ctl(h->ep, EPOLL_CTL_ADD, h->lfd, &le) ||
	    epoll_ctl(h->ep, EPOLL_CTL_ADD, h->stop_fd, &se)) {
		r = -errno;
		snprintf(err, errlen, "epoll_ctl: %s", strerror(-r));
		goto out_free;
	}
	for (int p = 0; p < POOL__COUNT; p++) {
		/* no listening socket: the front adds each connection; ITC so
		 * an added one is polled at once */
		h->mhd[p] = MHD_start_daemon(MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_NO_LISTEN_SOCKET |
					     MHD_USE_ITC | MHD_USE_ERROR_LOG,
					     0, NULL, NULL, on_request, h,
					     MHD_OPTION_CONNECTION_LIMIT, (unsigned)MHD_LIMIT,
					     MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)MHD_TIMEOUT_S,
					     MHD_OPTION_END);
		if (!h->mhd[p]) {
			r = -ENOMEM;
			snprintf(err, errlen, "libmicrohttpd did not start (its message is above)");
			goto out_mhd;
		}
	}
	h->last_report = kvt__now_ns();
	r = pthread_create(&h->front, NULL, front_main, h);
	if (r) {
		r = -r;
		snprintf(err, errlen, "the HTTP front thread: %s", strerror(-r));
		goto out_mhd;
	}
	h->front_started = 1;
	*out = h;
	return 0;

out_mhd:
	for (int p = 0; p < POOL__COUNT; p++)
		if (h->mhd[p])
			MHD_stop_daemon(h->mhd[p]);
out_free:
	if (h->stop_fd >= 0)
		close(h->stop_fd);
	if (h->ep >= 0)
		close(h->ep);
	if (h->lfd >= 0)
		close(h->lfd);
	pthread_mutex_destroy(&h->page_mu);
	free(h->pend);
	free(h);
	return r;
out_oom:
	snprintf(err, errlen, "HTTP: out of memory");
	return -ENOMEM;
}

void kvtd_http_stop(kvtd_http *h)
{
	uint64_t one = 1;

	if (!h)
		return;
	if (h->front_started) {
		ssize_t w = write(h->stop_fd, &one, sizeof(one));
		(void)w;                  /* an eventfd write of 1 does not fail */
		pthread_join(h->front, NULL);
	}
	for (uint32_t i = 0; i < h->pend_max; i++)
		if (h->pend[i].fd >= 0)
			close(h->pend[i].fd);
	close(h->lfd);
	close(h->ep);
	close(h->stop_fd);
	for (int p = 0; p < POOL__COUNT; p++)
		MHD_stop_daemon(h->mhd[p]);
	pthread_mutex_destroy(&h->page_mu);
	free(h->pend);
	free(h);
}
