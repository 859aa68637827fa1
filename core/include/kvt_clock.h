/* kvt_clock.h - the clock kvtier times with: CLOCK_MONOTONIC in
 * nanoseconds.  Deadlines, heartbeats, leases' ages and every measured
 * figure use it, in every part (core, dma, tier, daemon, bench, tests),
 * so that a time read by one part means the same to another: it never
 * jumps with the wall clock, and it is the same clock in every process of
 * the node (the segment's heartbeats and fill times are compared across
 * processes).  Inline: it sits on paths that run per chunk. */
#ifndef KVT_CLOCK_H
#define KVT_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t kvt__now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

#endif
