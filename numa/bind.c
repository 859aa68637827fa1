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
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
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

/* ---- prefault: in parallel, with progress ----
 *
 * Faulting a page in is the kernel zeroing it: one thread does 2-4 GiB/s,
 * so a 64 GiB shard took half a minute and a 512 GiB node minutes, while
 * systemd waited (kvtierd sends EXTEND_TIMEOUT_USEC meanwhile).  The range
 * is cut in pieces of PF_PIECE (whole pages) that threads take in turn
 * with MADV_POPULATE_WRITE; the pages land where the region's policy says
 * whichever CPU faults them (mbind came first), so the threads need no
 * placement of their own.  Threads: KVTIER_PREFAULT_THREADS, default the
 * online CPUs up to 16, never more than the pieces.  The calling thread
 * logs progress every 5 s and a summary line (bytes, time, GiB/s). */
#define PF_PIECE (256ull << 20)
#define PF_MAX_THREADS 64

struct pf_job {
	char *base;
	size_t len, step;
	atomic_size_t next, done;
	atomic_int err;
};

static void *pf_worker(void *arg)
{
	struct pf_job *j = arg;

	for (;;) {
		size_t off = atomic_fetch_add(&j->next, j->step);
		size_t n;

		if (off >= j->len || atomic_load(&j->err))
			break;
		n = j->len - off < j->step ? j->len - off : j->step;
		if (madvise(j->base + off, n, MADV_POPULATE_WRITE)) {
			int e = errno, zero = 0;
			atomic_compare_exchange_strong(&j->err, &zero, e);
			break;
		}
		atomic_fetch_add(&j->done, n);
	}
	return NULL;
}

static uint32_t pf_threads(size_t len, size_t step)
{
	const char *v = getenv("KVTIER_PREFAULT_THREADS");
	long cpus = sysconf(_SC_NPROCESSORS_ONLN), t = cpus > 16 ? 16 : cpus;
	size_t pieces = (len + step - 1) / step;

	if (v && *v) {
		char *end;
		long x = strtol(v, &end, 10);
		if (!*end && x >= 1 && x <= PF_MAX_THREADS)
			t = x;   /* kvt_open refuses a bad value (tier/config.c) */
	}
	if (t < 1)
		t = 1;
	return (uint32_t)((size_t)t < pieces ? (size_t)t : pieces);
}

static double pf_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* MADV_POPULATE_WRITE over [addr, addr+len) by threads: 0, or -errno
 * (-EINVAL before Linux 5.14, from the first piece). */
static int populate(void *addr, size_t len, uint64_t page, kvt_numa_log_fn log, void *log_arg)
{
	struct pf_job j = { .base = addr, .len = len };
	pthread_t tid[PF_MAX_THREADS];
	uint32_t n, started = 0;
	double t0 = pf_now(), last = t0;

	j.step = PF_PIECE < page ? page : PF_PIECE - PF_PIECE % page;
	atomic_init(&j.next, 0);
	atomic_init(&j.done, 0);
	atomic_init(&j.err, 0);
	n = pf_threads(len, j.step);
	for (uint32_t i = 0; n > 1 && i < n; i++)
		if (pthread_create(&tid[started], NULL, pf_worker, &j) == 0)
			started++;
	if (!started) {
		pf_worker(&j);   /* one thread, or none could start: this one */
	} else {
		/* the caller watches and reports; its share is the threads' */
		/* every piece is taken and ends done or failed: done reaches
		 * len, or err is set */
		while (!atomic_load(&j.err) && atomic_load(&j.done) < len) {
			struct timespec d = { 0, 100 * 1000 * 1000 };
			size_t done = atomic_load(&j.done);
			double t = pf_now();

			if (t - last >= 5.0) {
				kvt__numa_log(log, log_arg, KVT_NUMA_LOG_INFO, "prefault: %.1f of "
					      "%.1f GiB in %.0f s (%.2f GiB/s, %u threads)",
					      (double)done / (1 << 30), (double)len / (1 << 30), t - t0,
					      (double)done / (1 << 30) / (t - t0), started);
				last = t;
			}
			nanosleep(&d, NULL);
		}
		for (uint32_t i = 0; i < started; i++)
			pthread_join(tid[i], NULL);
	}
	if (atomic_load(&j.err))
		return -atomic_load(&j.err);
	if (len >= (1ull << 30)) {
		double t = pf_now() - t0;
		kvt__numa_log(log, log_arg, KVT_NUMA_LOG_INFO, "prefault: %.1f GiB in %.2f s "
			      "(%.2f GiB/s, %u thread%s)", (double)len / (1 << 30), t,
			      t > 0 ? (double)len / (1 << 30) / t : 0.0, started ? started : 1,
			      started > 1 ? "s" : "");
	}
	return 0;
}

/* Faults the range in.  Returns 0 and sets *how, or -errno. */
static int prefault(void *addr, size_t len, uint64_t page, uint32_t *how,
		    kvt_numa_log_fn log, void *log_arg)
{
	int r = populate(addr, len, page, log, log_arg);

	if (r == 0) {
		*how = 1;
		return 0;
	}
	if (r != -EINVAL)
		return r;
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
		r = prefault(addr, len, page, &rep.prefault, log, log_arg);
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
		r = prefault(addr, len, page, &rep.prefault, log, log_arg);
		if (r && rep.bound && fallback && (r == -ENOMEM || r == -EFAULT)) {
			kvt__numa_log(log, log_arg, KVT_NUMA_LOG_WARN,
				"node %s cannot hold %zu bytes (%s); --numa-fallback: "
				"unbinding and faulting in anywhere", list, len, strerror(-r));
			unbind(addr, len);
			rep.bound = 0;
			mode = KVT_NUMA_NONE;
			r = prefault(addr, len, page, &rep.prefault, log, log_arg);
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
