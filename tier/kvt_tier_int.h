/* kvt_tier_int.h - what tier/daemon (kvtierd, kvtier-stat) needs of a
 * kvt_tier beyond kvtier.h.  Internal: linked from kvtier_tier, never
 * exported by libkvtier.so (libkvtier.map). */
#ifndef KVT_TIER_INT_H
#define KVT_TIER_INT_H

#include "kvtier.h"
#include "kvt_core.h"

/* The handle's core segment (owned by the tier: do not detach it). */
kvt_seg *kvt__tier_seg(const kvt_tier *t);
/* The directory the segment is in (a hugetlbfs mount, or the one given),
 * NULL for POSIX shm. */
const char *kvt__tier_segment_dir(const kvt_tier *t);

/* Sets the calling thread's kvt_last_error message; returns code. */
int kvt__tier_err(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
