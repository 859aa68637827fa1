/* host.c - the host backend: "device" memory is ordinary memory and a
 * small pool of worker threads does the copies.  The reference for
 * correctness, and the backend for CPU engines.
 *
 * Each ticket's plan is expanded at submit into units of about 128 KiB
 * (large copies split, 2-D copies cut into row bands; a row is never split)
 * held in the ticket's own array, which grows only when a larger plan
 * arrives: no allocation per copy, and the caller may reuse its plan at
 * once.  Threads take batches of units (>= 64 KiB) from the oldest ticket
 * that has unclaimed ones, so even a 256 KiB chunk is copied by two
 * threads at depth 1 (1 MiB units left that to one thread: 0.5-0.7x
 * memcpy), one big chunk is spread over every worker, and many small chunks
 * queue in order; a thread waiting for a ticket copies that ticket's
 * unclaimed units itself rather than sleeping, and when its own are all
 * claimed by others it copies the oldest other ticket's, so the caller is
 * one more copying thread instead of a sleeper that needs a wake-up.  Large
 * rows are copied with non-temporal stores: the destination is not read
 * again soon by this thread, and streaming it past the cache keeps a copy
 * near the memory bandwidth.
 *
 * Hand-offs: a wake-up is a futex system call and a context switch (tens
 * of microseconds on a paravirtualized VM), as much as copying a 256 KiB
 * chunk.  So a worker that runs out of work polls the queue for SPIN_NS
 * before it sleeps (it still counts as awake, and submit wakes a worker
 * only when none is), and a waiter polls its ticket for SPIN_NS before it
 * sleeps.  Polling yields the CPU every few hundred nanoseconds
 * (sched_yield), so where threads outnumber CPUs a poller gives way to a
 * thread that copies.  In a stream of chunks neither ever sleeps; an idle
 * backend costs nothing after SPIN_NS.  Workers by default: the rank's
 * share of the CPUs (cpu_share: the cgroup's cpuset and quota, divided by
 * the ranks on the node, config.node_ranks, at most the affinity mask)
 * minus 1, 1 to 4, as the caller copies too.
 */
#include "dma_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

#define UNIT_BYTES  (128u << 10) /* split copies into units of about this */
#define BATCH_BYTES (64u << 10)  /* a thread claims at least this much */
#define NT_MIN      (32u << 10)  /* rows this long use streaming stores */
#define SPIN_NS     20000u   /* poll this long before sleeping: one 128 KiB
				* unit of scattered pages at ~8 GB/s; 0 lost
				* 10-15 %, 10 to 50 us measured alike */

struct unit {
	char *dst;
	const char *src;
	uint64_t len;
	uint64_t dpitch, spitch;
	uint32_t rows;
};

enum { J_IDLE, J_RUNNING, J_OK, J_ERR };

struct hjob {
	struct unit *units;
	uint32_t n_units, cap_units;
	uint32_t next;         /* first unclaimed unit; under be->lock */
	uint32_t done;         /* units finished; under be->lock */
	int fault;
	int state;             /* J_*; stored under be->lock (release), loaded
				* with acquire, also without the lock by a
				* polling waiter: J_OK/J_ERR seen means every
				* copy of the ticket happened before */
	struct hjob *qnext;
};

struct host_be {
	pthread_mutex_t lock;
	pthread_cond_t work;   /* a ticket was queued, or stop */
	pthread_cond_t done;   /* a ticket finished */
	struct hjob *jobs;     /* cfg.max_inflight */
	struct hjob *qhead, *qtail;
	int queued;            /* qhead != NULL; written under lock, polled
				* without it by spinning workers (relaxed:
				* a hint, rechecked under the lock) */
	pthread_t *threads;
	uint32_t n_threads;
	uint32_t active;       /* workers not asleep; under lock */
	int stop;
};

void kvt__copy_nt(void *dst, const void *src, size_t n)
{
#if defined(__x86_64__)
	char *d = dst;
	const char *s = src;
	size_t head = (16 - ((uintptr_t)d & 15)) & 15;

	if (n < 256) {
		memcpy(d, s, n);
		return;
	}
	memcpy(d, s, head);
	d += head;
	s += head;
	n -= head;
	while (n >= 64) {
		__m128i a = _mm_loadu_si128((const __m128i *)s);
		__m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
		__m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
		__m128i e = _mm_loadu_si128((const __m128i *)(s + 48));

		_mm_stream_si128((__m128i *)d, a);
		_mm_stream_si128((__m128i *)(d + 16), b);
		_mm_stream_si128((__m128i *)(d + 32), c);
		_mm_stream_si128((__m128i *)(d + 48), e);
		d += 64;
		s += 64;
		n -= 64;
	}
	memcpy(d, s, n);
	/* Streaming stores are weakly ordered: fence before the completion
	 * is published (the release in the lock that follows is not enough
	 * on its own for non-temporal stores). */
	_mm_sfence();
#else
	memcpy(dst, src, n);
#endif
}

static void unit_copy(const struct unit *u)
{
	for (uint32_t r = 0; r < u->rows; r++) {
		char *d = u->dst + (uint64_t)r * u->dpitch;
		const char *s = u->src + (uint64_t)r * u->spitch;

		if (u->len >= NT_MIN)
			kvt__copy_nt(d, s, u->len);
		else
			memcpy(d, s, u->len);
	}
}

/* The test fault (fault_nth): the copy fails having written junk, as a
 * DMA that faults part way leaves its destination -- nobody may read it.
 * 0x47 bytes are large finite numbers in bf16 and fp16 (~5e4), so KV read
 * from them changes a model's output (a skipped copy left KV that often
 * did not). */
static void unit_junk(const struct unit *u)
{
	for (uint32_t r = 0; r < u->rows; r++)
		memset(u->dst + (uint64_t)r * u->dpitch, 0x47, u->len);
}

/* Claims a batch of j's units, copies them and accounts for them.  Called
 * and returns with be->lock held; drops it while copying. */
static void run_batch(struct host_be *be, struct hjob *j)
{
	uint32_t first, end;
	uint64_t bytes = 0;

	first = end = j->next;
	while (end < j->n_units && bytes < BATCH_BYTES) {
		bytes += j->units[end].len * j->units[end].rows;
		end++;
	}
	j->next = end;
	if (end == j->n_units) { /* fully claimed: off the queue */
		struct hjob **pp = &be->qhead, *prev = NULL;

		while (*pp && *pp != j) {
			prev = *pp;
			pp = &(*pp)->qnext;
		}
		if (*pp) {
			*pp = j->qnext;
			if (be->qtail == j)
				be->qtail = prev;
		}
		__atomic_store_n(&be->queued, be->qhead != NULL, __ATOMIC_RELAXED);
	}
	pthread_mutex_unlock(&be->lock);

	for (uint32_t i = first; i < end; i++)
		if (!j->fault)
			unit_copy(&j->units[i]);
		else
			unit_junk(&j->units[i]);

	pthread_mutex_lock(&be->lock);
	j->done += end - first;
	if (j->done == j->n_units) {
		/* pairs with the acquire in job_status(): every copy of the
		 * ticket happened before (each copier's unlock, then our lock) */
		__atomic_store_n(&j->state, j->fault ? J_ERR : J_OK, __ATOMIC_RELEASE);
		pthread_cond_broadcast(&be->done);
	}
}

static int job_status(const struct hjob *j)
{
	int st = __atomic_load_n(&j->state, __ATOMIC_ACQUIRE);

	return st == J_OK ? 0 : st == J_ERR ? -EIO : -EINPROGRESS;
}

/* Polls, without the lock, until work is queued, the backend stops, the
 * ticket j (NULL: none) has ended, SPIN_NS pass, or the deadline (ns,
 * CLOCK_MONOTONIC) is reached.  Nothing is decided on what it sees: the
 * callers recheck under the lock. */
static void spin(const struct host_be *be, const struct hjob *j, uint64_t deadline)
{
	uint64_t end = kvt__now_ns() + SPIN_NS;

	if (deadline < end)
		end = deadline;
	for (uint32_t i = 1;; i++) {
		if (__atomic_load_n(&be->queued, __ATOMIC_RELAXED) ||
		    __atomic_load_n(&be->stop, __ATOMIC_RELAXED) ||
		    (j && job_status(j) != -EINPROGRESS))
			return;
		cpu_relax();
		if (!(i & 63)) {
			if (kvt__now_ns() >= end)
				return;
			sched_yield();
		}
	}
}

static void *worker(void *arg)
{
	struct host_be *be = arg;

	pthread_mutex_lock(&be->lock);
	be->active++;
	for (;;) {
		while (!be->stop && !be->qhead) {
			/* poll a while, still counted awake, before sleeping */
			pthread_mutex_unlock(&be->lock);
			spin(be, NULL, UINT64_MAX);
			pthread_mutex_lock(&be->lock);
			if (be->stop || be->qhead)
				break;
			be->active--;
			pthread_cond_wait(&be->work, &be->lock);
			be->active++;
		}
		if (be->stop)
			break;
		run_batch(be, be->qhead);
	}
	be->active--;
	pthread_mutex_unlock(&be->lock);
	return NULL;
}

static void host_stop(struct host_be *be)
{
	pthread_mutex_lock(&be->lock);
	__atomic_store_n(&be->stop, 1, __ATOMIC_RELAXED);
	pthread_cond_broadcast(&be->work);
	pthread_mutex_unlock(&be->lock);
	for (uint32_t i = 0; i < be->n_threads; i++)
		pthread_join(be->threads[i], NULL);
}

static void host_fini(struct kvt_dma *d)
{
	struct host_be *be = d->be;

	if (!be)
		return;
	host_stop(be);
	for (uint32_t i = 0; i < d->cfg.max_inflight; i++)
		free(be->jobs[i].units);
	free(be->jobs);
	free(be->threads);
	pthread_cond_destroy(&be->work);
	pthread_cond_destroy(&be->done);
	pthread_mutex_destroy(&be->lock);
	free(be);
	d->be = NULL;
}

/* This process's cgroup v2 directory under /sys/fs/cgroup ("" for the
 * root); 0, or -1 when there is no cgroup v2 line. */
static int cgroup_dir(char *out, size_t len)
{
	char line[512] = "", *nl;
	FILE *f = fopen("/proc/self/cgroup", "re");
	int found = 0;

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, "0::", 3)) {
			found = 1;
			break;
		}
	fclose(f);
	if (!found)
		return -1;
	if ((nl = strchr(line, '\n')))
		*nl = 0;
	snprintf(out, len, "%s", strcmp(line + 3, "/") ? line + 3 : "");
	return 0;
}

/* The tightest cgroup v2 cpu.max quota on the way from this process's
 * cgroup to the root, in CPUs rounded up (0: none, or none readable):
 * a pod's or a slice's quota sits on an ancestor. */
static uint32_t cgroup_quota_cpus(const char *dir)
{
	char d[600], path[640];
	uint32_t best = 0;

	snprintf(d, sizeof(d), "%s", dir);
	for (;;) {
		unsigned long long quota, period;
		FILE *f;
		char *slash;

		snprintf(path, sizeof(path), "/sys/fs/cgroup%s/cpu.max", d);
		if ((f = fopen(path, "re"))) {
			if (fscanf(f, "%llu %llu", &quota, &period) == 2 && period && quota) {
				uint32_t n = (uint32_t)((quota + period - 1) / period);
				if (!best || n < best)
					best = n;
			}
			fclose(f);
		}
		if (!d[0])
			break;
		slash = strrchr(d, '/');
		if (!slash)
			break;
		*slash = 0;
	}
	return best;
}

/* CPUs in the cgroup's cpuset.cpus.effective ("0-3,8"): what the ranks of
 * this cgroup share (0: unreadable). */
static uint32_t cgroup_cpuset_cpus(const char *dir)
{
	char path[640], buf[4096];
	uint32_t n = 0;
	FILE *f;

	snprintf(path, sizeof(path), "/sys/fs/cgroup%s/cpuset.cpus.effective", dir);
	if (!(f = fopen(path, "re")))
		return 0;
	if (fgets(buf, sizeof(buf), f)) {
		for (char *p = buf; *p && *p != '\n';) {
			char *end;
			unsigned long lo = strtoul(p, &end, 10), hi = lo;
			if (end == p)
				break;
			if (*end == '-')
				hi = strtoul(end + 1, &end, 10);
			if (hi >= lo && hi - lo < 65536)
				n += (uint32_t)(hi - lo + 1);
			p = *end == ',' ? end + 1 : end;
			if (*p != 0 && *p != '\n' && !(*p >= '0' && *p <= '9'))
				break;
		}
	}
	fclose(f);
	return n;
}

/* A rank's CPU share: the CPUs the node's ranks share (the cgroup's
 * cpuset, else the online CPUs; lowered to the cgroup quota) divided by
 * the ranks, but never more than this process may run on (its affinity
 * mask).  Ranks pinned to disjoint CPUs (8 ranks on 12 CPUs each of 96)
 * get their 12; ranks sharing a 16-CPU pod get 2 each. */
static uint32_t cpu_share(uint32_t ranks, uint32_t *cpus_out)
{
	cpu_set_t set;
	char dir[600];
	long online = sysconf(_SC_NPROCESSORS_ONLN);
	uint32_t pool = online > 0 ? (uint32_t)online : 1, mine = pool, q = 0, c, share;

	if (!sched_getaffinity(0, sizeof(set), &set) && CPU_COUNT(&set) > 0)
		mine = (uint32_t)CPU_COUNT(&set);
	if (cgroup_dir(dir, sizeof(dir)) == 0) {
		c = cgroup_cpuset_cpus(dir);
		if (c && c < pool)
			pool = c;
		q = cgroup_quota_cpus(dir);
		if (q && q < pool)
			pool = q;
	}
	share = pool / ranks ? pool / ranks : 1;
	if (mine < share)
		share = mine;
	*cpus_out = q && q < mine ? q : mine;
	return share;
}

static int host_init(struct kvt_dma *d, char *why, size_t why_len)
{
	struct host_be *be;
	pthread_condattr_t ca;
	uint32_t n = d->cfg.n_workers, cpus;
	uint32_t ranks = d->cfg.node_ranks ? d->cfg.node_ranks : 1;
	uint32_t share = cpu_share(ranks, &cpus);

	/* The caller copies too (a waiter takes queued work), so share - 1
	 * workers keep every CPU of the rank's share copying without a
	 * thread more: on 2 CPUs a second worker only took CPU time from the
	 * one copying (measured).  Below 3 CPUs a share gets one worker and
	 * the waiting caller still copies: with two ranks on 2 CPUs, a caller
	 * that waited without copying (one copying thread per rank) lost
	 * 10-40 % at depth 1 and gained nothing deeper (docs/BENCHMARKS.md):
	 * its copying saves the hand-off to the worker. */
	if (!n)
		n = share <= 2 ? 1 : share > 5 ? 4 : share - 1;
	if (n > 64)
		return kvt__fmt(-EINVAL, why, why_len, "n_workers %u > 64", n);
	be = calloc(1, sizeof(*be));
	if (!be)
		return kvt__fmt(-ENOMEM, why, why_len, "out of memory");
	be->jobs = calloc(d->cfg.max_inflight, sizeof(*be->jobs));
	be->threads = calloc(n, sizeof(*be->threads));
	if (!be->jobs || !be->threads) {
		free(be->jobs);
		free(be->threads);
		free(be);
		return kvt__fmt(-ENOMEM, why, why_len, "out of memory");
	}
	pthread_mutex_init(&be->lock, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&be->work, NULL);
	pthread_cond_init(&be->done, &ca);
	pthread_condattr_destroy(&ca);
	d->be = be;
	for (uint32_t i = 0; i < n; i++) {
		if (pthread_create(&be->threads[i], NULL, worker, be)) {
			host_fini(d);
			return kvt__fmt(-EAGAIN, why, why_len, "cannot start worker threads");
		}
		be->n_threads++;
	}
	snprintf(d->feature, sizeof(d->feature), "%u copy thread%s (%u CPU%s, %u rank%s)", n,
		 n == 1 ? "" : "s", cpus, cpus == 1 ? "" : "s", ranks, ranks == 1 ? "" : "s");
	return 0;
}

static int host_bind(struct kvt_dma *d, const struct kvt_kv_layout *l)
{
	(void)l;
	if (d->device < 0)
		d->device = 0;
	return 0;
}

static void host_caps(const struct kvt_dma *d, struct kvt_plan_caps *c)
{
	(void)d;
	c->max_rows = 1u << 20;
	c->pitch_align = 1;
	c->max_pitch = UINT64_MAX >> 2;
}

static int host_mem_reg(struct kvt_dma *d, struct kvt_dma_piece *p)
{
	(void)d;
	p->dev = (uint64_t)(uintptr_t)p->host;
	return 0;
}

static void host_mem_unreg(struct kvt_dma *d, struct kvt_dma_piece *p)
{
	(void)d;
	(void)p;
}

/* Units a plan expands to (upper bound). */
static uint64_t units_needed(const struct kvt_plan *p)
{
	uint64_t n = 0;

	for (uint32_t i = 0; i < p->n; i++) {
		const struct kvt_copy *c = &p->copies[i];

		if (c->rows == 1)
			n += (c->len + UNIT_BYTES - 1) / UNIT_BYTES;
		else
			n += c->rows;
	}
	return n;
}

static int host_submit(struct kvt_dma *d, uint32_t slot, const struct kvt_dma_job *job)
{
	struct host_be *be = d->be;
	struct hjob *j = &be->jobs[slot];
	const struct kvt_plan *p = job->plan;
	uint64_t need = units_needed(p);
	uint64_t bytes = 0;
	uint32_t n = 0;

	if (need > UINT32_MAX)
		return kvt__dma_err(-EINVAL, "host: plan too large");
	if (need > j->cap_units) {
		struct unit *u = realloc(j->units, need * sizeof(*u));

		if (!u)
			return kvt__dma_err(-ENOMEM, "host: out of memory");
		j->units = u;
		j->cap_units = (uint32_t)need;
	}
	for (uint32_t i = 0; i < p->n; i++) {
		const struct kvt_copy *c = &p->copies[i];
		char *dev = (char *)(uintptr_t)c->dev;
		char *host = job->host + c->off;
		struct unit u = {
			.dst = job->dir == KVT_DMA_D2H ? host : dev,
			.src = job->dir == KVT_DMA_D2H ? dev : host,
			.len = c->len,
			.dpitch = job->dir == KVT_DMA_D2H ? c->host_pitch : c->dev_pitch,
			.spitch = job->dir == KVT_DMA_D2H ? c->dev_pitch : c->host_pitch,
			.rows = c->rows,
		};

		if (c->rows > 1) {
			uint32_t band = c->len >= UNIT_BYTES ? 1 : (uint32_t)(UNIT_BYTES / c->len);

			for (uint32_t r = 0; r < c->rows; r += band) {
				struct unit b = u;

				b.dst += (uint64_t)r * u.dpitch;
				b.src += (uint64_t)r * u.spitch;
				b.rows = c->rows - r < band ? c->rows - r : band;
				j->units[n++] = b;
			}
			continue;
		}
		for (uint64_t o = 0; o < c->len; o += UNIT_BYTES) {
			struct unit b = u;

			b.dst += o;
			b.src += o;
			b.len = c->len - o < UNIT_BYTES ? c->len - o : UNIT_BYTES;
			/* keep the tail from being a sliver */
			if (c->len - o - b.len < UNIT_BYTES / 4) {
				b.len = c->len - o;
				o = c->len;
			}
			j->units[n++] = b;
		}
	}

	for (uint32_t i = 0; i < p->n; i++)
		bytes += p->copies[i].len * p->copies[i].rows;
	pthread_mutex_lock(&be->lock);
	j->n_units = n;
	j->next = 0;
	j->done = 0;
	j->fault = job->fault;
	j->qnext = NULL;
	if (n == 0) {
		__atomic_store_n(&j->state, j->fault ? J_ERR : J_OK, __ATOMIC_RELEASE);
	} else {
		__atomic_store_n(&j->state, J_RUNNING, __ATOMIC_RELAXED);
		if (be->qtail)
			be->qtail->qnext = j;
		else
			be->qhead = j;
		be->qtail = j;
		__atomic_store_n(&be->queued, 1, __ATOMIC_RELAXED);
		/* Wake a worker only when none is awake (an awake one drains the
		 * queue before sleeping), and a second one for a chunk big enough
		 * to split: a wake-up is a system call and a context switch,
		 * which cost as much as copying a small chunk. */
		if (be->active == 0 ||
		    (be->active < be->n_threads && bytes >= 2 * BATCH_BYTES))
			pthread_cond_signal(&be->work);
	}
	pthread_mutex_unlock(&be->lock);
	return 0;
}

static int host_poll(struct kvt_dma *d, uint32_t slot)
{
	struct host_be *be = d->be;
	int rc;

	pthread_mutex_lock(&be->lock);
	rc = job_status(&be->jobs[slot]);
	pthread_mutex_unlock(&be->lock);
	return rc;
}

static int host_wait(struct kvt_dma *d, uint32_t slot, uint64_t deadline)
{
	struct host_be *be = d->be;
	struct hjob *j = &be->jobs[slot];
	struct timespec ts = {
		.tv_sec = (time_t)(deadline / 1000000000u),
		.tv_nsec = (long)(deadline % 1000000000u),
	};
	int rc;

	pthread_mutex_lock(&be->lock);
	while ((rc = job_status(j)) == -EINPROGRESS) {
		/* A waiter copies its own ticket's unclaimed units instead of
		 * sleeping: at low depth that saves two thread hand-offs per
		 * chunk, which cost more than copying a small chunk.  With its
		 * own all claimed, it copies the oldest queued ticket's (one
		 * batch, so it returns at most a batch late). */
		if (j->next < j->n_units) {
			run_batch(be, j);
			continue;
		}
		if (be->qhead && kvt__now_ns() < deadline) {
			run_batch(be, be->qhead);
			continue;
		}
		/* poll a while before sleeping: the last batches are running */
		pthread_mutex_unlock(&be->lock);
		spin(be, j, deadline);
		pthread_mutex_lock(&be->lock);
		if (job_status(j) != -EINPROGRESS || (be->qhead && kvt__now_ns() < deadline))
			continue;
		if (deadline == UINT64_MAX)
			pthread_cond_wait(&be->done, &be->lock);
		else if (pthread_cond_timedwait(&be->done, &be->lock, &ts) == ETIMEDOUT) {
			rc = job_status(j);
			if (rc == -EINPROGRESS)
				rc = -ETIMEDOUT;
			break;
		}
	}
	pthread_mutex_unlock(&be->lock);
	return rc;
}

/* "Device" memory of the host backend: what a CPU engine's KV cache is,
 * a large ordinary allocation.  From 2 MiB up it is 2 MiB aligned and
 * asks for transparent huge pages (MADV_HUGEPAGE; a hint, harmless where
 * THP is off), as a KV cache of that size should be: scattered 4 KiB-page
 * KV blocks cost a TLB miss each, and on some VMs pages idle for a few
 * seconds are slow to touch again unless they are huge. */
static int host_dev_alloc(struct kvt_dma *d, uint64_t bytes, uint64_t *dev)
{
	uint64_t align = bytes >= (2u << 20) ? 2u << 20 : 4096;
	void *p;

	(void)d;
	if (bytes > SIZE_MAX - align)
		return kvt__dma_err(-ENOMEM, "host: allocation too large");
	bytes = (bytes + align - 1) & ~(align - 1);
	p = aligned_alloc(align, bytes);
	if (!p)
		return kvt__dma_err(-ENOMEM, "host: out of memory (%llu bytes)",
				    (unsigned long long)bytes);
#ifdef MADV_HUGEPAGE
	if (align > 4096)
		(void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
	*dev = (uint64_t)(uintptr_t)p;
	return 0;
}

static int host_dev_free(struct kvt_dma *d, uint64_t dev)
{
	(void)d;
	free((void *)(uintptr_t)dev);
	return 0;
}

static int host_dev_write(struct kvt_dma *d, uint64_t dev, const void *src, uint64_t len)
{
	(void)d;
	memcpy((void *)(uintptr_t)dev, src, len);
	return 0;
}

static int host_dev_read(struct kvt_dma *d, void *dst, uint64_t dev, uint64_t len)
{
	(void)d;
	memcpy(dst, (const void *)(uintptr_t)dev, len);
	return 0;
}

static int host_ceiling(struct kvt_dma *d, enum kvt_dma_dir dir, uint64_t dev,
			uint64_t bytes, uint64_t copy_bytes, uint32_t iters,
			double *seconds)
{
	/* shared memory, like the arena (same page size, same faults) */
	char *buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	char *devp = (char *)(uintptr_t)dev;
	uint64_t t0;

	(void)d;
	if (buf == MAP_FAILED)
		return kvt__dma_err(-ENOMEM, "host: out of memory");
	/* Fault in and warm up outside the timing: on some VMs memory stays
	 * slow after its first touch until it is written again (seen: 2.5 vs
	 * 18 GB/s), which would make the ceiling a measure of that. */
	memset(buf, 0x5a, bytes);
	for (uint64_t o = 0; o + copy_bytes <= bytes; o += copy_bytes) {
		if (dir == KVT_DMA_D2H)
			memcpy(buf + o, devp + o, copy_bytes);
		else
			memcpy(devp + o, buf + o, copy_bytes);
	}
	t0 = kvt__now_ns();
	for (uint32_t it = 0; it < iters; it++)
		for (uint64_t o = 0; o + copy_bytes <= bytes; o += copy_bytes) {
			if (dir == KVT_DMA_D2H)
				memcpy(buf + o, devp + o, copy_bytes);
			else
				memcpy(devp + o, buf + o, copy_bytes);
		}
	*seconds = (kvt__now_ns() - t0) * 1e-9;
	munmap(buf, bytes);
	return 0;
}

const struct kvt_dma_ops kvt__dma_host_ops = {
	.name = "host",
	.init = host_init,
	.fini = host_fini,
	.bind = host_bind,
	.caps = host_caps,
	.mem_reg = host_mem_reg,
	.mem_unreg = host_mem_unreg,
	.submit = host_submit,
	.poll = host_poll,
	.wait = host_wait,
	.dev_alloc = host_dev_alloc,
	.dev_free = host_dev_free,
	.dev_write = host_dev_write,
	.dev_read = host_dev_read,
	.ceiling = host_ceiling,
};
