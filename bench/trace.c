/* trace.c - reads kvtier-bench replay's trace (trace.h): json-c, strict,
 * the whole line one object; chunk ids mapped to dense indices. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <json-c/json.h>

#include "kvt_mix.h"
#include "trace.h"

#define NONE UINT32_MAX

int trace_quiet;

/* ---- the trace ---------------------------------------------------------- */


/* Open-addressing map raw id -> dense index (ids are arbitrary u64). */
struct idmap {
	uint64_t *keys;
	uint32_t *vals;
	uint64_t cap;      /* power of two */
};

static int idmap_grow(struct idmap *m)
{
	uint64_t ncap = m->cap ? m->cap * 2 : 1u << 16;
	uint64_t *nk = malloc(ncap * sizeof(*nk));
	uint32_t *nv = malloc(ncap * sizeof(*nv));

	if (!nk || !nv) {
		free(nk);
		free(nv);
		return -ENOMEM;
	}
	for (uint64_t i = 0; i < ncap; i++)
		nv[i] = NONE;
	for (uint64_t i = 0; i < m->cap; i++) {
		if (m->vals[i] == NONE)
			continue;
		uint64_t h = kvt__mix64(m->keys[i]) & (ncap - 1);
		while (nv[h] != NONE)
			h = (h + 1) & (ncap - 1);
		nk[h] = m->keys[i];
		nv[h] = m->vals[i];
	}
	free(m->keys);
	free(m->vals);
	m->keys = nk;
	m->vals = nv;
	m->cap = ncap;
	return 0;
}

/* The dense index of raw, assigning the next one (*n) when new. */
static int idmap_get(struct idmap *m, uint64_t raw, uint32_t *n, uint32_t *out)
{
	if ((uint64_t)*n * 2 >= m->cap && idmap_grow(m))
		return -ENOMEM;
	uint64_t h = kvt__mix64(raw) & (m->cap - 1);
	while (m->vals[h] != NONE) {
		if (m->keys[h] == raw) {
			*out = m->vals[h];
			return 0;
		}
		h = (h + 1) & (m->cap - 1);
	}
	if (*n == NONE)
		return -EOVERFLOW;
	m->keys[h] = raw;
	m->vals[h] = *n;
	*out = (*n)++;
	return 1;
}

static int grow(void **p, uint64_t *cap, uint64_t need, size_t elem)
{
	if (need <= *cap)
		return 0;
	uint64_t n = *cap ? *cap : 1024;
	while (n < need)
		n *= 2;
	void *q = realloc(*p, n * elem);
	if (!q)
		return -ENOMEM;
	*p = q;
	*cap = n;
	return 0;
}

struct parse {
	struct trace *t;
	struct idmap map;
	uint64_t cap_ids, cap_off, cap_raw, cap_ms;
	struct json_tokener *tok;
};

/* Parses one line: a JSON object (read by json-c, strict, the whole line)
 * with an array of non-negative integers "hash_ids" and, if present, a
 * "timestamp" that is a non-negative integer (ms; below 2^32); appends it
 * as a request.  Other keys are ignored, whatever their values. */
static int parse_line(struct parse *ps, const char *line, size_t len, unsigned long lineno)
{
	struct trace *t = ps->t;
	uint64_t start = t->n_chunks;
	json_object *root = NULL, *ids, *ts;
	enum json_tokener_error jerr;
	uint32_t ms = 0;
	const char *why = NULL;
	int r;
	size_t end, n;

	for (end = 0; end < len && strchr(" \t\r\n", line[end]) && line[end]; end++)
		;
	if (end == len)
		return 0; /* blank line */
	if (memchr(line, '\0', len)) {
		why = "a NUL byte in the line";
		goto bad;
	}
	if (len > INT32_MAX) {
		why = "a line over 2 GiB";
		goto bad;
	}
	json_tokener_reset(ps->tok);
	root = json_tokener_parse_ex(ps->tok, line, (int)len);
	jerr = json_tokener_get_error(ps->tok);
	if (jerr != json_tokener_success) {
		why = jerr == json_tokener_continue ? "the JSON value does not end on this line"
						    : json_tokener_error_desc(jerr);
		goto bad;
	}
	if (!root) { /* the line is `null` */
		why = "not a JSON object";
		goto bad;
	}
	for (end = json_tokener_get_parse_end(ps->tok); end < len; end++)
		if (!strchr(" \t\r\n", line[end])) {
			why = "bytes after the JSON object";
			goto bad;
		}
	if (!json_object_is_type(root, json_type_object)) {
		why = "not a JSON object";
		goto bad;
	}
	if (!json_object_object_get_ex(root, "hash_ids", &ids) ||
	    !json_object_is_type(ids, json_type_array)) {
		if (!trace_quiet)
			fprintf(stderr, "kvtier-bench replay: line %lu: no \"hash_ids\" array\n",
				lineno);
		json_object_put(root);
		return -EINVAL;
	}
	if (json_object_object_get_ex(root, "timestamp", &ts)) {
		if (!json_object_is_type(ts, json_type_int) || json_object_get_int64(ts) < 0 ||
		    json_object_get_uint64(ts) > UINT32_MAX) {
			why = "timestamp is not a non-negative integer of ms below 2^32";
			goto bad;
		}
		ms = (uint32_t)json_object_get_uint64(ts);
	}
	n = json_object_array_length(ids);
	for (size_t i = 0; i < n; i++) {
		json_object *e = json_object_array_get_idx(ids, i);
		uint64_t raw;
		uint32_t dense;

		if (!json_object_is_type(e, json_type_int) || json_object_get_int64(e) < 0) {
			why = "hash_ids holds something other than a non-negative integer";
			goto bad;
		}
		raw = json_object_get_uint64(e);
		if (raw == UINT64_MAX) {
			/* json-c clamps larger numbers to this: two different
			 * ids would be one chunk */
			why = "a hash id of 2^64 - 1 or more";
			goto bad;
		}
		r = idmap_get(&ps->map, raw, &t->n_ids, &dense);
		if (r < 0)
			goto fail;
		if (r == 1) {
			if (grow((void **)&t->raw, &ps->cap_raw, t->n_ids, sizeof(*t->raw))) {
				r = -ENOMEM;
				goto fail;
			}
			t->raw[dense] = raw;
		}
		if (grow((void **)&t->ids, &ps->cap_ids, t->n_chunks + 1, sizeof(*t->ids))) {
			r = -ENOMEM;
			goto fail;
		}
		t->ids[t->n_chunks++] = dense;
		continue;
fail:
		t->n_chunks = start;
		json_object_put(root);
		if (!trace_quiet)
			fprintf(stderr, "kvtier-bench replay: line %lu: %s\n", lineno,
				r == -ENOMEM ? "out of memory" : "more than 2^32 distinct ids");
		return r;
	}
	json_object_put(root);
	if (t->n_chunks - start > UINT32_MAX || t->n_chunks > UINT32_MAX ||
	    grow((void **)&t->off, &ps->cap_off, (uint64_t)t->n_req + 2, sizeof(*t->off)) ||
	    grow((void **)&t->ms, &ps->cap_ms, (uint64_t)t->n_req + 1, sizeof(*t->ms))) {
		r = t->n_chunks > UINT32_MAX ? -EOVERFLOW : -ENOMEM;
		t->n_chunks = start;
		if (!trace_quiet)
			fprintf(stderr, "kvtier-bench replay: line %lu: %s\n", lineno,
				r == -ENOMEM ? "out of memory" : "more than 2^32 chunks in all");
		return r;
	}
	t->off[t->n_req] = (uint32_t)start;
	t->ms[t->n_req] = ms;
	t->off[++t->n_req] = (uint32_t)t->n_chunks;
	if (t->n_chunks - start > t->max_len)
		t->max_len = (uint32_t)(t->n_chunks - start);
	return 0;
bad:
	t->n_chunks = start;
	if (root)
		json_object_put(root);
	if (!trace_quiet)
		fprintf(stderr, "kvtier-bench replay: line %lu: not a trace record (%s): "
			"expected {\"hash_ids\": [ids...], ...}\n", lineno, why);
	return -EINVAL;
}

int trace_load(const char *path, uint32_t limit, struct trace *t)
{
	struct parse ps = { .t = t };
	FILE *f = fopen(path, "r");
	char *line = NULL;
	size_t cap = 0;
	ssize_t len;
	unsigned long lineno = 0;
	int r = 0;

	memset(t, 0, sizeof(*t));
	if (!f) {
		r = -errno;
		fprintf(stderr, "kvtier-bench replay: %s: %s\n", path, strerror(-r));
		return r;
	}
	ps.tok = json_tokener_new();
	if (!ps.tok) {
		fclose(f);
		return -ENOMEM;
	}
	json_tokener_set_flags(ps.tok, JSON_TOKENER_STRICT);
	if (grow((void **)&t->off, &ps.cap_off, 2, sizeof(*t->off))) {
		json_tokener_free(ps.tok);
		fclose(f);
		return -ENOMEM;
	}
	t->off[0] = 0;
	while ((!limit || t->n_req < limit) && (len = getline(&line, &cap, f)) >= 0) {
		r = parse_line(&ps, line, (size_t)len, ++lineno);
		if (r)
			break;
	}
	json_tokener_free(ps.tok);
	free(line);
	free(ps.map.keys);
	free(ps.map.vals);
	fclose(f);
	if (!r && !t->n_req) {
		fprintf(stderr, "kvtier-bench replay: %s: no requests\n", path);
		r = -EINVAL;
	}
	return r;
}

void trace_free(struct trace *t)
{
	free(t->off);
	free(t->ids);
	free(t->raw);
	free(t->ms);
}

int trace_parse(const char *buf, size_t len, uint32_t limit, struct trace *t)
{
	struct parse ps = { .t = t };
	unsigned long lineno = 0;
	size_t at = 0;
	int r = 0;

	memset(t, 0, sizeof(*t));
	ps.tok = json_tokener_new();
	if (!ps.tok)
		return -ENOMEM;
	json_tokener_set_flags(ps.tok, JSON_TOKENER_STRICT);
	if (grow((void **)&t->off, &ps.cap_off, 2, sizeof(*t->off))) {
		json_tokener_free(ps.tok);
		return -ENOMEM;
	}
	t->off[0] = 0;
	while (at < len && (!limit || t->n_req < limit)) {
		const char *nl = memchr(buf + at, '\n', len - at);
		size_t n = nl ? (size_t)(nl - (buf + at)) + 1 : len - at;
		r = parse_line(&ps, buf + at, n, ++lineno);
		if (r)
			break;
		at += n;
	}
	json_tokener_free(ps.tok);
	free(ps.map.keys);
	free(ps.map.vals);
	return r;
}
