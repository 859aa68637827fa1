/* numa_internal.h - helpers shared by the numa/ sources; not installed. */
#ifndef KVT_NUMA_INTERNAL_H
#define KVT_NUMA_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "kvt_numa.h"

#define KVT__SYSFS_DEFAULT "/sys"

/* Flags the kernel ORs into a policy mode (MPOL_F_STATIC_NODES,
 * _RELATIVE_NODES, _NUMA_BALANCING; linux/mempolicy.h, which numaif.h does
 * not include).  They do not change where pages go for our purpose. */
#define KVT__MPOL_MODE_FLAGS ((1 << 15) | (1 << 14) | (1 << 13))

/* Sets the thread's last-error message and returns code (a -errno). */
int kvt__numa_err(int code, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

/* Sends one formatted line to fn (NULL: stderr with a prefix). */
void kvt__numa_log(kvt_numa_log_fn fn, void *arg, int level, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

/* Reads a whole small file into buf (terminated; a trailing newline is
 * kept).  Returns the length or -errno. */
int kvt__read_text(const char *path, char *buf, size_t len);

/* Parses a decimal (base 10) or hex ("0x..", base 16) unsigned number that
 * fills the whole of s except trailing white space.  0 or -EINVAL. */
int kvt__parse_u64(const char *s, int base, uint64_t *out);

/* A CPU list ("0-3,8") holds cpu?  Returns 1, 0, or -EINVAL when the list
 * does not parse.  *count (may be NULL) receives the number of CPUs. */
int kvt__cpulist_has(const char *list, int cpu, uint32_t *count);

/* The sysfs root: root, else $KVTIER_SYSFS_ROOT, else "/sys". */
const char *kvt__sysfs_root(const char *root);

#endif
