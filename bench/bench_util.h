/* bench_util.h - small helpers shared by the kvtier-bench commands: a
 * monotonic clock, a seeded generator, and the guard that removes the
 * bench's own segment when the parent exits or is interrupted. */
#ifndef KVT_BENCH_UTIL_H
#define KVT_BENCH_UTIL_H

#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "kvt_core.h"

static inline uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* splitmix64: a reproducible stream from a seed. */
static inline uint64_t rnd(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
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

#endif
