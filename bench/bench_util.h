/* bench_util.h - small helpers shared by the kvtier-bench commands: a
 * monotonic clock, a seeded generator, and the guard that removes the
 * bench's own segment when the parent exits or is interrupted. */
#ifndef KVT_BENCH_UTIL_H
#define KVT_BENCH_UTIL_H

#include <signal.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "kvt_clock.h"
#include "kvt_core.h"
#include "kvt_mix.h"

/* splitmix64: a reproducible stream from a seed. */
static inline uint64_t rnd(uint64_t *s)
{
	return kvt__mix64(*s += 0x9e3779b97f4a7c15ULL);
}

/* The segment the bench created (empty: none) and its directory (NULL:
 * /dev/shm), removed by the parent only: forked workers exit through
 * atexit too. */
static char seg_name[KVT_NAME_MAX + 1];
static const char *seg_dir;
static pid_t parent_pid;

static inline void cleanup(void)
{
	if (seg_name[0] && getpid() == parent_pid)
		kvt_seg_unlink(seg_name, seg_dir);
}

static inline void on_signal(int sig)
{
	cleanup();
	signal(sig, SIG_DFL);
	raise(sig);
}

/* Installs the guard in the parent. */
static inline void seg_guard_install(void)
{
	parent_pid = getpid();
	atexit(cleanup);
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
}

/* 4G, 512M, 64K, or bytes: the largest unit that divides b. */
static inline const char *human(uint64_t b, char *buf, size_t len)
{
	if (b >= (1ULL << 30) && !(b % (1ULL << 30)))
		snprintf(buf, len, "%lluG", (unsigned long long)(b >> 30));
	else if (b >= (1ULL << 20) && !(b % (1ULL << 20)))
		snprintf(buf, len, "%lluM", (unsigned long long)(b >> 20));
	else if (b >= 1024 && !(b % 1024))
		snprintf(buf, len, "%lluK", (unsigned long long)(b >> 10));
	else
		snprintf(buf, len, "%llu", (unsigned long long)b);
	return buf;
}

/* "64K", "1.5G", "4MiB", "100": bytes; 0, or -1 for anything else. */
static inline int parse_size(const char *s, uint64_t *out)
{
	char *end;
	double v = strtod(s, &end);

	if (end == s || v <= 0)
		return -1;
	switch (*end) {
	case 'k': case 'K': v *= 1024; end++; break;
	case 'm': case 'M': v *= 1024 * 1024; end++; break;
	case 'g': case 'G': v *= 1024.0 * 1024 * 1024; end++; break;
	default: break;
	}
	if (*end == 'i' || *end == 'B')
		end += (*end == 'i') + (end[*end == 'i'] == 'B');
	if (*end)
		return -1;
	*out = (uint64_t)v;
	return 0;
}

#endif
