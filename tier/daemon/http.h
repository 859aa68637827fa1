/* http.h - kvtierd's HTTP side: a front thread that owns the listening
 * socket and admits a connection only once its whole header block is in
 * the socket buffer, and libmicrohttpd behind it (http.c has the design).
 *
 * The bodies are not made here: a page function (struct kvtd_http_opts)
 * makes them; kvtd_pages_render is the daemon's, from a snapshot of the
 * segment (snap.h).  The pure parts (the end-of-headers scanner, the
 * routing decision) are exported for the fuzz target (tests/fuzz).
 */
#ifndef KVTD_HTTP_H
#define KVTD_HTTP_H

#include <stddef.h>
#include <stdint.h>

#include "kvt_core.h"
#include "snap.h"

enum kvtd_page {
	KVTD_PAGE_NONE = 0,
	KVTD_PAGE_HEALTH,          /* /healthcheck */
	KVTD_PAGE_METRICS,         /* /metrics */
	KVTD_PAGE_STATUS,          /* /status */
	KVTD_PAGE_SEGMENT,         /* /healthcheck/segment */
};

/* Makes a page: returns its HTTP status and sets *body (malloc'd, taken by
 * the caller; NULL: out of memory, answered 500) and *type.  Called on
 * libmicrohttpd's threads, one call at a time (http.c serializes them);
 * must not block for long: the health probes wait behind it. */
typedef unsigned (*kvtd_page_fn)(void *arg, enum kvtd_page page, char **body,
				 const char **type);

struct kvtd_http_opts {
	size_t size;               /* sizeof(struct kvtd_http_opts) */
	const char *addr;          /* IPv4 address to listen on */
	uint16_t port;
	kvtd_page_fn page;
	void *page_arg;
	/* what the front saw (slow or oversized requests, evictions), at most
	 * once a minute; level 1: a warning.  Called on the front thread.
	 * NULL: not reported. */
	void (*log)(int level, const char *msg, void *arg);
	void *log_arg;
	double head_timeout_s;     /* the header block's deadline; 0: 5 s */
	uint32_t pending_max;      /* connections waiting for their headers;
				    * 0: 256 (fewer under a low fd limit) */
};

typedef struct kvtd_http kvtd_http;

/* Binds addr:port, starts libmicrohttpd and the front thread.  Returns 0
 * and sets *out, or -errno with a sentence in err: -EADDRINUSE when the
 * port is taken, -EADDRNOTAVAIL when addr is not this host's, -EINVAL for
 * a bad option, -ENOMEM, or what socket(), epoll or libmicrohttpd said. */
int kvtd_http_start(const struct kvtd_http_opts *o, kvtd_http **out, char *err,
		    size_t errlen);

/* Stops the front thread (joined), closes the listening socket and every
 * pending connection, then stops libmicrohttpd (its connections closed,
 * its threads joined).  NULL is a no-op.  Blocks until all of that is done
 * (at most one page being made). */
void kvtd_http_stop(kvtd_http *h);

/* ---- the daemon's pages ---- */

struct kvtd_pages {
	kvt_seg *obs;              /* an observer handle for the snapshots */
	const char *segment;       /* the segment's name, for /healthcheck/segment */
	/* the daemon's view at this instant; wo is the write-only verdicts'
	 * storage that x->write_only_window may point to.  Called on
	 * libmicrohttpd's threads: the daemon locks what it shares. */
	void (*ctx)(void *arg, struct kvtd_ctx *x, uint32_t wo[KVT_MAX_INSTANCES]);
	void *ctx_arg;
};

/* A kvtd_page_fn; arg is a struct kvtd_pages. */
unsigned kvtd_pages_render(void *arg, enum kvtd_page page, char **body, const char **type);

/* ---- the pure parts (the fuzz target calls them) ---- */

#define KVTD_HTTP_HEAD_MAX 8192    /* the header block's end must be in these */

/* The end of a request's header block in the n bytes at p: the offset
 * just past the empty line that ends it ("\r\n\r\n", or "\n\n", or a mix),
 * not counting the empty lines a client may send before its request line
 * (libmicrohttpd skips those too); 0 while it is not there. */
size_t kvtd_http_head_end(const char *p, size_t n);

/* 1 when the request line in the n bytes at p asks for /healthcheck or
 * /healthcheck/segment (a query string allowed): such a request is given
 * to the health pool (http.c).  Any bytes; 0 for anything else. */
int kvtd_http_head_is_health(const char *p, size_t n);

/* 1 when a request header (name, value) announces a body: any
 * Transfer-Encoding, a Content-Length other than 0. */
int kvtd_http_header_has_body(const char *name, const char *value);

/* What a request gets before any page is made: 0 with *page set (make that
 * page), or the status to refuse it with: 405 (a method other than GET and
 * HEAD), 400 (a body: has_body), 404 (no such page). */
unsigned kvtd_http_route(const char *method, const char *url, int has_body,
			 enum kvtd_page *page);

#endif
