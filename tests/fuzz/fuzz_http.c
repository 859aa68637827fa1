/* fuzz_http.c - kvtierd's request handling (tier/daemon/http.c): the
 * front's end-of-headers scanner and pool choice on the raw bytes, and the
 * routing decision on the request those bytes make.  The scanner is
 * checked against a second formulation of the same rule (the earliest
 * "\n\n" or "\n\r\n" after the empty lines that may lead); the route
 * answers 0 (a page), 400, 404 or 405, and a page only for GET or HEAD of
 * a known path with no body.  The request is split here the simple way
 * (lines, "name: value"): libmicrohttpd's own parser is fuzzed upstream. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"

/* assert() goes with NDEBUG (RelWithDebInfo): these checks stay */
#define CHECK(c) \
	do { \
		if (!(c)) { \
			fprintf(stderr, "fuzz_http.c:%d: %s\n", __LINE__, #c); \
			abort(); \
		} \
	} while (0)

/* the rule again, with memmem */
static size_t head_end_ref(const char *p, size_t n)
{
	size_t s = 0, best = 0;

	while (s < n && (p[s] == '\r' || p[s] == '\n'))
		s++;
	const char *a = memmem(p + s, n - s, "\n\n", 2);
	const char *b = memmem(p + s, n - s, "\n\r\n", 3);
	if (a)
		best = (size_t)(a - p) + 2;
	if (b && (!best || (size_t)(b - p) + 3 < best))
		best = (size_t)(b - p) + 3;
	return best;
}

static char *trim(char *s)
{
	while (*s == ' ' || *s == '\t')
		s++;
	size_t n = strlen(s);
	while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r'))
		s[--n] = 0;
	return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *p = (const char *)data;
	size_t end = kvtd_http_head_end(p, size);

	CHECK(end == head_end_ref(p, size));
	CHECK(end <= size);
	if (end) {
		CHECK(end >= 2 && p[end - 1] == '\n');
		CHECK(p[end - 2] == '\n' || (end >= 3 && p[end - 2] == '\r' && p[end - 3] == '\n'));
	}
	int health = kvtd_http_head_is_health(p, size);
	CHECK(health == 0 || health == 1);
	CHECK(!health || memmem(p, size, "/healthcheck", 12));

	/* the request, split: "METHOD URL ..." then "name: value" lines */
	char *r = malloc(size + 1);
	if (!r)
		return 0;
	memcpy(r, data, size);
	r[size] = 0;
	char *line = r, *next;
	while (*line == '\r' || *line == '\n')
		line++;
	next = strchr(line, '\n');
	if (next)
		*next++ = 0;
	char *method = strtok(trim(line), " ");
	char *url = method ? strtok(NULL, " ") : NULL;
	if (url && strchr(url, '?'))
		*strchr(url, '?') = 0;      /* libmicrohttpd gives the path alone */
	int has_body = 0;
	while (next && *next && *next != '\r' && *next != '\n') {
		line = next;
		next = strchr(line, '\n');
		if (next)
			*next++ = 0;
		char *colon = strchr(line, ':');
		if (!colon)
			continue;
		*colon = 0;
		if (kvtd_http_header_has_body(trim(line), trim(colon + 1)))
			has_body = 1;
	}
	enum kvtd_page page = (enum kvtd_page)-1;
	unsigned code = kvtd_http_route(method, url, has_body, &page);
	int get = method && (!strcmp(method, "GET") || !strcmp(method, "HEAD"));
	CHECK(code == 0 || code == 400 || code == 404 || code == 405);
	CHECK((code == 405) == !get);
	CHECK(code != 400 || has_body);
	CHECK((code == 0) == (page != KVTD_PAGE_NONE));
	if (!code) {
		CHECK(get && !has_body);
		CHECK(page >= KVTD_PAGE_HEALTH && page <= KVTD_PAGE_SEGMENT);
	}
	/* the pool choice never sends a page request to the health pool */
	if (health && !code && end)
		CHECK(page == KVTD_PAGE_HEALTH || page == KVTD_PAGE_SEGMENT);
	free(r);
	return 0;
}
