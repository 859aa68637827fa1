/* bind.c - bind a region before first touch, fault it in, check where every
 * page landed.
 *
 * Why in this order: a policy set with mbind only steers pages faulted after
 * it, so it must come before anything touches the arena (kvt_seg_create
 * leaves the arena untouched unless KVT_SEG_F_PREFAULT).  The creator then
 * prefaults, in its own VMA under its own policy: that matters for hugetlbfs,
 * whose files keep no shared policy, so only the creator's faults decide the
 * node.  Finally move_pages(nodes = NULL) reports each page's node, and
 * get_mempolicy(MPOL_F_ADDR) that the policy really applies: a binding that
 * silently did nothing is the failure operators cannot see.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifdef KVTIER_HAVE_NUMA
#include <numaif.h>
#endif

#include "numa_internal.h"

#define VERIFY_BATCH 1024 /* move_pages entries per call: bounded stack use */

/* Page size of the mapping that holds addr (KernelPageSize in smaps). */
static uint64_t vma_page_bytes(const void *addr)
{
	uintptr_t a = (uintptr_t)addr;
	FILE *f = fopen("/proc/self/smaps", "re");
	char *line = NULL;
	size_t cap = 0;
	int inside = 0;
	uint64_t ps = 0;

	if (!f)
		return 0;
	while (getline(&line, &cap, f) > 0) {
		unsigned long lo, hi;
		unsigned long long kb;

		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
			inside = a >= lo && a < hi;
			continue;
		}
		if (inside && sscanf(line, "KernelPageSize: %llu kB", &kb) == 1) {
			ps = (uint64_t)kb * 1024;
			break;
		}
	}
	free(line);
	fclose(f);
	return ps;
}

#ifdef KVTIER_HAVE_NUMA
/* The nodes this process may allocate from (cpuset.mems), from
 * /proc/self/status.  -ENOENT when the line is missing. */
static int mems_allowed(struct kvt_nodemask *m, char *text, size_t len)
{
	FILE *f = fopen("/proc/self/status", "re");
	char *line = NULL;
	size_t cap = 0;
	int r = -ENOENT;

	if (!f)
		return -errno;
	while (getline(&line, &cap, f) > 0) {
		if (strncmp(line, "Mems_allowed_list:", 18))
			continue;
		char *v = line + 18;

		v += strspn(v, " \t");
		v[strcspn(v, "\n")] = '\0';
		snprintf(text, len, "%s", v);
		r = kvt_nodemask_parse(v, "Mems_allowed_list", m);
		break;
	}
	free(line);
	fclose(f);
	return r;
}

static int mpol_of(uint32_t mode, const struct kvt_nodemask *nodes)
{
	switch (mode) {
	case KVT_NUMA_BIND:
		return MPOL_BIND;
	case KVT_NUMA_INTERLEAVE:
		return MPOL_INTERLEAVE;
	case KVT_NUMA_PREFERRED:
		/* One node: MPOL_PREFERRED; several: MPOL_PREFERRED_MANY. */
		return kvt_nodemask_count(nodes) > 1 ? 5 : MPOL_PREFERRED;
	}
	return MPOL_DEFAULT;
}

static int do_mbind(void *addr, size_t len, uint32_t mode, const struct kvt_nodemask *nodes)
{
	/* The kernel drops the last bit of maxnode: pass bits + 1. */
	long r = mbind(addr, len, mpol_of(mode, nodes), (const unsigned long *)nodes->bits,
		       KVT_NUMA_MAX_NODES + 1, MPOL_MF_STRICT | MPOL_MF_MOVE);

	return r ? -errno : 0;
}

static int unbind(void *addr, size_t len)
{
	return mbind(addr, len, MPOL_DEFAULT, NULL, 0, 0) ? -errno : 0;
}
#endif

/* Faults the range in.  Returns 0 and sets *how, or -errno. */
static int prefault(void *addr, size_t len, uint64_t page, uint32_t *how)
{
	if (madvise(addr, len, MADV_POPULATE_WRITE) == 0) {
		*how = 1;
		return 0;
	}
	if (errno != EINVAL)
		return -errno;
	/* EINVAL: a kernel before 5.14.  Touching is only safe on normal
	 * pages: on hugetlb a page the pool cannot supply is SIGBUS, where
	 * madvise would have returned an error. */
	if (page > 4096)
		return -EINVAL;
	for (size_t off = 0; off < len; off += page) {
		volatile char *c = (volatile char *)addr + off;

		/* Creation time, nobody else attached: rewriting the byte we
		 * just read changes nothing. */
		*c = *c;
	}
	*how = 2;
	return 0;
}

#ifdef KVTIER_HAVE_NUMA
static int verify(void *addr, size_t len, uint64_t page, uint32_t mode,
		  const struct kvt_nodemask *nodes, struct kvt_numa_bind_report *rep)
{
	void *pages[VERIFY_BATCH];
	int status[VERIFY_BATCH];
	uint64_t n = len / page;

	for (uint64_t i = 0; i < n;) {
		unsigned long cnt = (unsigned long)(n - i < VERIFY_BATCH ? n - i : VERIFY_BATCH);

		for (unsigned long k = 0; k < cnt; k++) {
			pages[k] = (char *)addr + (i + k) * page;
			status[k] = -ENOENT;
		}
		if (move_pages(0, cnt, pages, NULL, status, 0) < 0) {
			int e = errno;

			return kvt__numa_err(-e, "move_pages (query): %s", strerror(e));
		}
		for (unsigned long k = 0; k < cnt; k++) {
			rep->pages++;
			if (status[k] < 0)
				rep->absent++;
			else if (mode == KVT_NUMA_NONE || kvt_nodemask_test(nodes, status[k]))
				rep->on_target++;
			else if (rep->misplaced++ == 0)
				rep->first_bad_node = status[k];
		}
		i += cnt;
	}
	return 0;
}

/* The policy the kernel holds for addr equals what we set. */
static int policy_applied(void *addr, uint32_t mode, const struct kvt_nodemask *nodes)
{
	struct kvt_nodemask m;
	int got = -1;

	kvt_nodemask_zero(&m);
	if (get_mempolicy(&got, (unsigned long *)m.bits, KVT_NUMA_MAX_NODES, addr,
			  MPOL_F_ADDR))
		return -errno;
	got &= ~KVT__MPOL_MODE_FLAGS;
	return got == mpol_of(mode, nodes) && kvt_nodemask_equal(&m, nodes) ? 0 : -EIO;
}
#endif

int kvt_numa_bind_region(void *addr, size_t len, uint32_t mode,
			 const struct kvt_nodemask *nodes,
			 const struct kvt_numa_bind_opts *o,
			 struct kvt_numa_bind_report *rep_out)
{
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask none, one;
	kvt_numa_log_fn log = NULL;
	void *log_arg = NULL;
	uint32_t flags = 0;
	uint64_t page = 0;
	char list[128] = "", allowed_txt[128] = "";
	int r, fallback;

	if (o) {
		if (o->size < sizeof(*o) || o->reserved)
			return kvt__numa_err(-EINVAL, "bind: options size/reserved wrong");
		flags = o->flags;
		page = o->page_bytes;
		log = o->log;
		log_arg = o->log_arg;
	}
	if (flags & ~KVT_NUMA_BIND_F_MASK)
		return kvt__numa_err(-EINVAL, "bind: unknown flags 0x%x",
				     flags & ~KVT_NUMA_BIND_F_MASK);
	fallback = !!(flags & KVT_NUMA_F_FALLBACK);
	if (!addr || !len || ((uintptr_t)addr & 4095) || (len & 4095))
		return kvt__numa_err(-EINVAL, "bind: region %p+%zu is not page aligned",
				     addr, len);
	if (mode > KVT_NUMA_INTERLEAVE)
		return kvt__numa_err(-EINVAL, "bind: mode %u cannot bind a region", mode);
	if (!nodes) {
		kvt_nodemask_zero(&none);
		nodes = &none;
	}
	if (mode != KVT_NUMA_NONE && kvt_nodemask_count(nodes) == 0)
		return kvt__numa_err(-EINVAL, "bind: empty node set");
	kvt_nodemask_format(nodes, list, sizeof(list));

	if (!page)
		page = vma_page_bytes(addr);
	if (!page)
		page = (uint64_t)sysconf(_SC_PAGESIZE);
	if (((uintptr_t)addr % page) || (len % page))
		return kvt__numa_err(-EINVAL, "bind: region %p+%zu is not aligned to its "
				     "%" PRIu64 "-byte pages", addr, len, page);

	memset(&rep, 0, sizeof(rep));
	rep.bytes = len;
	rep.page_bytes = page;
	rep.first_bad_node = -1;

#ifndef KVTIER_HAVE_NUMA
	if (mode != KVT_NUMA_NONE) {
		if (!fallback)
			return kvt__numa_err(-ENOTSUP, "NUMA support not built (libnuma-dev "
					     "was missing): cannot bind to node %s", list);
		kvt__numa_log(log, log_arg, KVT_NUMA_LOG_WARN, "NUMA support not built: "
			      "region left unbound instead of node %s (--numa-fallback)", list);
		mode = KVT_NUMA_NONE;
	}
	if (!(flags & KVT_NUMA_BIND_F_NO_PREFAULT)) {
		r = prefault(addr, len, page, &rep.prefault);
		if (r)
			return kvt__numa_err(r, "prefault of %zu bytes failed: %s", len,
					     strerror(-r));
	}
	(void)allowed_txt;
	(void)one;
	if (rep_out)
		*rep_out = rep;
	return 0;
#else
	if (mode != KVT_NUMA_NONE) {
		struct kvt_nodemask allowed;
		int bad = -1;

		/* mbind says only EINVAL for a node that does not exist, has no
		 * memory, or is outside the cpuset; name the node instead. */
		if (mems_allowed(&allowed, allowed_txt, sizeof(allowed_txt)) == 0)
			for (int n = kvt_nodemask_first(nodes); n >= 0 && bad < 0;
			     n = kvt_nodemask_next(nodes, n))
				if (!kvt_nodemask_test(&allowed, n))
					bad = n;
		if (bad >= 0) {
			r = kvt__numa_err(-EINVAL, "cannot bind to node %s: node %d is not one "
				"this process may allocate from (Mems_allowed_list: %s) - it "
				"does not exist, has no memory, or the cpuset excludes it",
				list, bad, allowed_txt);
		} else {
			r = do_mbind(addr, len, mode, nodes);
			if (r == -EINVAL && mode == KVT_NUMA_PREFERRED &&
			    kvt_nodemask_count(nodes) > 1) {
				/* MPOL_PREFERRED_MANY needs Linux 5.15. */
				kvt_nodemask_zero(&one);
				kvt_nodemask_set(&one, kvt_nodemask_first(nodes));
				kvt__numa_log(log, log_arg, KVT_NUMA_LOG_WARN,
					"this kernel has no MPOL_PREFERRED_MANY: preferring "
					"node %d only", kvt_nodemask_first(nodes));
				nodes = &one;
				r = do_mbind(addr, len, mode, nodes);
				kvt_nodemask_format(nodes, list, sizeof(list));
			}
			if (r == -EPERM)
				r = kvt__numa_err(r, "mbind(%s, node %s) refused: %s (moving pages "
					"that other processes map needs CAP_SYS_NICE)",
					kvt_numa_mode_name(mode), list, strerror(-r));
			else if (r == -EIO)
				r = kvt__numa_err(r, "mbind(%s, node %s): pages already faulted "
					"elsewhere could not be moved (bind before first touch)",
					kvt_numa_mode_name(mode), list);
			else if (r)
				r = kvt__numa_err(r, "mbind(%s, node %s) failed: %s",
					kvt_numa_mode_name(mode), list, strerror(-r));
		}
		if (r) {
			if (!fallback)
				return r;
			kvt__numa_log(log, log_arg, KVT_NUMA_LOG_WARN,
				      "%s; --numa-fallback: region left unbound",
				      kvt_numa_last_error());
			mode = KVT_NUMA_NONE;
		} else {
			rep.bound = 1;
		}
	}

	if (!(flags & KVT_NUMA_BIND_F_NO_PREFAULT)) {
		r = prefault(addr, len, page, &rep.prefault);
		if (r && rep.bound && fallback && (r == -ENOMEM || r == -EFAULT)) {
			kvt__numa_log(log, log_arg, KVT_NUMA_LOG_WARN,
				"node %s cannot hold %zu bytes (%s); --numa-fallback: "
				"unbinding and faulting in anywhere", list, len, strerror(-r));
			unbind(addr, len);
			rep.bound = 0;
			mode = KVT_NUMA_NONE;
			r = prefault(addr, len, page, &rep.prefault);
		}
		if (r)
			return kvt__numa_err(r == -EFAULT ? -ENOMEM : r,
				"prefault of %zu bytes%s%s failed: %s%s", len,
				mode != KVT_NUMA_NONE ? " on node " : "",
				mode != KVT_NUMA_NONE ? list : "", strerror(-r),
				page > 4096 ? " (is the huge page pool of that node large "
					      "enough?)" : "");
	}

	if (flags & KVT_NUMA_BIND_F_NO_VERIFY)
		goto out;
	if (rep.bound && policy_applied(addr, mode, nodes)) {
		r = kvt__numa_err(-EIO, "mbind(%s, node %s) returned 0 but the kernel does "
				  "not report that policy for the region",
				  kvt_numa_mode_name(mode), list);
		if (!fallback)
			return r;
		kvt__numa_log(log, log_arg, KVT_NUMA_LOG_WARN, "%s", kvt_numa_last_error());
	}
	r = verify(addr, len, page, mode, nodes, &rep);
	if (r)
		return r;
	if (rep.misplaced) {
		r = kvt__numa_err(-EIO, "%" PRIu64 " of %" PRIu64 " pages are not on node %s "
				  "(first on node %d)", rep.misplaced, rep.pages, list,
				  rep.first_bad_node);
		/* Only BIND promises the node; PREFERRED and INTERLEAVE may
		 * legitimately spill, and that is worth a warning. */
		if (mode == KVT_NUMA_BIND && !fallback)
			return r;
		kvt__numa_log(log, log_arg, KVT_NUMA_LOG_WARN, "%s", kvt_numa_last_error());
	}
out:
	if (rep_out)
		*rep_out = rep;
	return 0;
#endif
}
