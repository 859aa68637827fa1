/* trace.h - the request trace of kvtier-bench replay: one JSON object a
 * line with an array "hash_ids" of chunk ids and, optionally, its arrival
 * "timestamp" in ms from the trace's start (the Mooncake trace format),
 * read by json-c (bench/trace.c). */
#ifndef KVT_BENCH_TRACE_H
#define KVT_BENCH_TRACE_H

#include <stddef.h>
#include <stdint.h>

struct trace {
	uint32_t n_req;
	uint32_t *off;     /* n_req + 1: request r's chunks are ids[off[r] .. off[r+1]) */
	uint32_t *ids;     /* dense chunk indices */
	uint64_t n_chunks;
	uint64_t *raw;     /* dense index -> the trace's hash id */
	uint32_t n_ids;
	uint32_t max_len;  /* chunks of the longest request */
	uint32_t *ms;      /* n_req: request r's timestamp (0 where the line has none) */
};

/* Reads up to limit requests (0: all) of the file at path.  0, or a
 * negative errno after a message on stderr naming the line and why. */
int trace_load(const char *path, uint32_t limit, struct trace *t);

/* The same from memory (len bytes, lines split at '\n'): the fuzz target's
 * entry.  t is reset first; trace_free it after, whatever the result. */
int trace_parse(const char *buf, size_t len, uint32_t limit, struct trace *t);

void trace_free(struct trace *t);

/* Set: the readers print no message for a bad line (the fuzz target). */
extern int trace_quiet;

#endif
