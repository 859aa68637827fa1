/* fake_common.c - device address window, region table, worker thread. */
#include "fake_common.h"

#define _GNU_SOURCE 1 /* memfd_create */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define WINDOW_BYTES (64ULL << 30)
#define GAP          (64ULL << 10) /* unmapped gap after every region */
#define MAX_REGIONS  4096

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static char *window;
static uint64_t window_used;
static struct fake_region regions[MAX_REGIONS];
static int n_regions;

uint64_t fake_region_add(int kind, uint64_t len, char *host, int owner, uint32_t flags)
{
	uint64_t dev = 0, span = (len + GAP + 4095) & ~4095ULL;

	pthread_mutex_lock(&reg_lock);
	if (!window) {
		void *w = mmap(NULL, WINDOW_BYTES, PROT_NONE,
			       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);

		if (w == MAP_FAILED) {
			pthread_mutex_unlock(&reg_lock);
			return 0;
		}
		window = w;
	}
	if (n_regions < MAX_REGIONS && window_used + span <= WINDOW_BYTES) {
		dev = (uint64_t)(uintptr_t)window + window_used;
		window_used += span; /* never reused: a stale address stays invalid */
		regions[n_regions++] = (struct fake_region){
			.dev = dev, .len = len, .host = host, .kind = kind,
			.owner = owner, .flags = flags,
		};
	}
	pthread_mutex_unlock(&reg_lock);
	return dev;
}

int fake_region_add_sys(char *host, uint64_t len, int owner)
{
	return fake_region_add_at(FAKE_SYS, host, len, owner);
}

int fake_region_add_at(int kind, char *host, uint64_t len, int owner)
{
	uint64_t lo = (uint64_t)(uintptr_t)host;
	int rc = -1;

	pthread_mutex_lock(&reg_lock);
	/* memory the caller freed and reused: its earlier regions of this
	 * kind at their own addresses go */
	for (int i = 0; i < n_regions; i++) {
		const struct fake_region *r = &regions[i];

		if (r->kind == kind && r->dev == (uint64_t)(uintptr_t)r->host &&
		    r->dev < lo + len && lo < r->dev + r->len)
			regions[i--] = regions[--n_regions];
	}
	if (n_regions < MAX_REGIONS) {
		regions[n_regions++] = (struct fake_region){
			.dev = (uint64_t)(uintptr_t)host, .len = len, .host = host,
			.kind = kind, .owner = owner,
		};
		rc = 0;
	}
	pthread_mutex_unlock(&reg_lock);
	return rc;
}

int fake_region_del(uint64_t dev, struct fake_region *out)
{
	int rc = -1;

	pthread_mutex_lock(&reg_lock);
	for (int i = 0; i < n_regions; i++)
		if (regions[i].dev == dev) {
			if (out)
				*out = regions[i];
			regions[i] = regions[--n_regions];
			rc = 0;
			break;
		}
	pthread_mutex_unlock(&reg_lock);
	return rc;
}

int fake_region_find(uint64_t addr, uint64_t len, struct fake_region *out)
{
	int rc = -1;

	pthread_mutex_lock(&reg_lock);
	for (int i = 0; i < n_regions; i++) {
		const struct fake_region *r = &regions[i];

		if (addr >= r->dev && addr < r->dev + r->len) {
			if (len <= r->dev + r->len - addr) {
				if (out)
					*out = *r;
				rc = 0;
			}
			break;
		}
	}
	pthread_mutex_unlock(&reg_lock);
	return rc;
}

int fake_alias_of_host(const char *host, uint64_t len, struct fake_region *out)
{
	int rc = -1;

	pthread_mutex_lock(&reg_lock);
	for (int i = 0; i < n_regions; i++) {
		const struct fake_region *r = &regions[i];

		if (r->kind == FAKE_ALIAS && host >= r->host && host < r->host + r->len &&
		    len <= (uint64_t)(r->host + r->len - host)) {
			if (out)
				*out = *r;
			rc = 0;
			break;
		}
	}
	pthread_mutex_unlock(&reg_lock);
	return rc;
}

int fake_region_count(int kind)
{
	int n = 0;

	pthread_mutex_lock(&reg_lock);
	for (int i = 0; i < n_regions; i++)
		n += !kind || regions[i].kind == kind;
	pthread_mutex_unlock(&reg_lock);
	return n;
}

char *fake_translate(uint64_t addr, uint64_t len, const char **why)
{
	struct fake_region r;

	if (fake_region_find(addr, len, &r) == 0)
		return r.host + (addr - r.dev);
	if (fake_alias_of_host((const char *)(uintptr_t)addr, len, NULL) == 0)
		*why = "a host pointer of a locked/registered range was used where the "
		       "device pointer the runtime returned is required";
	else if (fake_region_find(addr, 1, NULL) == 0)
		*why = "the range runs past the end of its allocation";
	else
		*why = "the address is not device-accessible memory";
	return NULL;
}

/* ---- worker ------------------------------------------------------------- */

struct task {
	fake_task_fn fn;
	void *arg;
	uint64_t seq;      /* push order, over every lane */
	struct task *next;
};

/* Lanes: each an in-order queue with its own thread, as a stream or a
 * copy engine is.  Lanes finish in no order among themselves, and with a
 * jitter each task starts after a random delay of up to that many us, so
 * work on two lanes completes out of submission order (real engines and
 * streams do; one in-order worker made every ticket finish in order). */
struct lane {
	pthread_t thread;
	struct task *head, *tail;
	unsigned seed;
};

static pthread_mutex_t wk_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wk_cond = PTHREAD_COND_INITIALIZER;
static struct lane lanes[FAKE_LANES];
static int wk_running, wk_stop, wk_hold;
static long wk_jitter_us;
static uint64_t wk_seq, wk_done_max, wk_out_of_order;

static void *worker(void *arg)
{
	struct lane *l = arg;

	pthread_mutex_lock(&wk_lock);
	for (;;) {
		struct task *t;
		long jitter;

		while (!wk_stop && (!l->head || wk_hold))
			pthread_cond_wait(&wk_cond, &wk_lock);
		if (!l->head && wk_stop)
			break;
		if (wk_hold && !wk_stop)
			continue;
		t = l->head;
		l->head = t->next;
		if (!l->head)
			l->tail = NULL;
		jitter = wk_jitter_us;
		pthread_mutex_unlock(&wk_lock);
		if (jitter > 0)
			usleep((useconds_t)(rand_r(&l->seed) % (unsigned long)jitter));
		t->fn(t->arg);
		pthread_mutex_lock(&wk_lock);
		if (t->seq < wk_done_max)
			wk_out_of_order++; /* something pushed later finished first */
		else
			wk_done_max = t->seq;
		free(t);
	}
	pthread_mutex_unlock(&wk_lock);
	return NULL;
}

void fake_worker_start(void)
{
	pthread_mutex_lock(&wk_lock);
	if (!wk_running) {
		wk_stop = 0;
		wk_jitter_us = fake_env_long("FAKE_GPU_JITTER_US", 0);
		for (int i = 0; i < FAKE_LANES; i++) {
			lanes[i].seed = 0x9e3779b9u * (unsigned)(i + 1) ^ (unsigned)getpid();
			if (pthread_create(&lanes[i].thread, NULL, worker, &lanes[i])) {
				wk_stop = 1;
				pthread_cond_broadcast(&wk_cond);
				pthread_mutex_unlock(&wk_lock);
				while (i-- > 0)
					pthread_join(lanes[i].thread, NULL);
				return;
			}
		}
		wk_running = 1;
	}
	pthread_mutex_unlock(&wk_lock);
}

void fake_worker_stop(void)
{
	pthread_mutex_lock(&wk_lock);
	if (!wk_running) {
		pthread_mutex_unlock(&wk_lock);
		return;
	}
	wk_stop = 1;
	wk_hold = 0;
	pthread_cond_broadcast(&wk_cond);
	pthread_mutex_unlock(&wk_lock);
	for (int i = 0; i < FAKE_LANES; i++)
		pthread_join(lanes[i].thread, NULL);
	pthread_mutex_lock(&wk_lock);
	wk_running = 0;
	pthread_mutex_unlock(&wk_lock);
}

void fake_worker_push_lane(int lane, fake_task_fn fn, void *arg)
{
	struct task *t = malloc(sizeof(*t));
	struct lane *l = &lanes[(unsigned)lane % FAKE_LANES];

	if (!t) {
		fn(arg); /* out of memory in a test fake: run inline */
		return;
	}
	t->fn = fn;
	t->arg = arg;
	t->next = NULL;
	pthread_mutex_lock(&wk_lock);
	t->seq = ++wk_seq;
	if (l->tail)
		l->tail->next = t;
	else
		l->head = t;
	l->tail = t;
	pthread_cond_broadcast(&wk_cond);
	pthread_mutex_unlock(&wk_lock);
}

void fake_worker_push(fake_task_fn fn, void *arg)
{
	fake_worker_push_lane(0, fn, arg);
}

void fake_worker_hold(int hold)
{
	pthread_mutex_lock(&wk_lock);
	wk_hold = hold;
	pthread_cond_broadcast(&wk_cond);
	pthread_mutex_unlock(&wk_lock);
}

void fake_worker_jitter(long max_us)
{
	pthread_mutex_lock(&wk_lock);
	wk_jitter_us = max_us;
	pthread_mutex_unlock(&wk_lock);
}

long fake_worker_out_of_order(int reset)
{
	long n;

	pthread_mutex_lock(&wk_lock);
	n = (long)wk_out_of_order;
	if (reset)
		wk_out_of_order = 0;
	pthread_mutex_unlock(&wk_lock);
	return n;
}

/* Copies against a stop of a device's queues (a fault), per device. */
#define CP_DEVS 64
static pthread_mutex_t cp_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cp_cond = PTHREAD_COND_INITIALIZER;
static int cp_running[CP_DEVS];
static uint64_t cp_halted, cp_reported; /* device bits */

static uint64_t dev_bit(int dev)
{
	return 1ull << ((unsigned)dev % CP_DEVS);
}

int fake_copy_begin(int dev)
{
	int ok;

	pthread_mutex_lock(&cp_lock);
	ok = !(cp_halted & dev_bit(dev));
	cp_running[(unsigned)dev % CP_DEVS] += ok;
	pthread_mutex_unlock(&cp_lock);
	return ok;
}

void fake_copy_end(int dev)
{
	pthread_mutex_lock(&cp_lock);
	cp_running[(unsigned)dev % CP_DEVS]--;
	pthread_cond_broadcast(&cp_cond);
	pthread_mutex_unlock(&cp_lock);
}

void fake_copy_halt(int dev)
{
	pthread_mutex_lock(&cp_lock);
	cp_halted |= dev_bit(dev);
	while (cp_running[(unsigned)dev % CP_DEVS])
		pthread_cond_wait(&cp_cond, &cp_lock);
	pthread_mutex_unlock(&cp_lock);
}

void fake_copy_report(int dev)
{
	pthread_mutex_lock(&cp_lock);
	cp_reported |= dev_bit(dev);
	pthread_cond_broadcast(&cp_cond);
	pthread_mutex_unlock(&cp_lock);
}

void fake_copy_settled(int dev)
{
	pthread_mutex_lock(&cp_lock);
	while ((cp_halted & dev_bit(dev)) && !(cp_reported & dev_bit(dev)))
		pthread_cond_wait(&cp_cond, &cp_lock);
	pthread_mutex_unlock(&cp_lock);
}

void fake_copy_resume(void)
{
	pthread_mutex_lock(&cp_lock);
	cp_halted = cp_reported = 0;
	pthread_cond_broadcast(&cp_cond);
	pthread_mutex_unlock(&cp_lock);
}

int fake_copy_halted(void)
{
	int h;

	pthread_mutex_lock(&cp_lock);
	h = cp_halted != 0;
	pthread_mutex_unlock(&cp_lock);
	return h;
}

long fake_env_long(const char *name, long dflt)
{
	const char *v = getenv(name);

	return v && *v ? strtol(v, NULL, 0) : dflt;
}

/* ---- IPC ------------------------------------------------------------------- */

#define MAX_IPC 256
static struct { uint64_t dev; int fd; } exported[MAX_IPC];

int fake_ipc_export(uint64_t dev, char *host, uint64_t len)
{
	int fd = -1, free_i = -1;

	pthread_mutex_lock(&reg_lock);
	for (int i = 0; i < MAX_IPC; i++) {
		if (exported[i].dev == dev)
			fd = exported[i].fd;
		if (!exported[i].dev && free_i < 0)
			free_i = i;
	}
	if (fd < 0 && free_i >= 0) {
		/* the allocation moves onto a memfd: same address, same bytes
		 * (copies into it must not run meanwhile; an engine exports
		 * its KV cache before it uses it) */
		fd = memfd_create("fake-gpu-ipc", MFD_CLOEXEC);
		if (fd >= 0 && (ftruncate(fd, (off_t)FAKE_PAGES(len)) ||
				pwrite(fd, host, len, 0) != (ssize_t)len ||
				mmap(host, FAKE_PAGES(len), PROT_READ | PROT_WRITE,
				     MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED)) {
			close(fd);
			fd = -1;
		}
		if (fd >= 0) {
			exported[free_i].dev = dev;
			exported[free_i].fd = fd;
		}
	}
	pthread_mutex_unlock(&reg_lock);
	return fd;
}

void fake_ipc_unexport(uint64_t dev)
{
	pthread_mutex_lock(&reg_lock);
	for (int i = 0; i < MAX_IPC; i++)
		if (exported[i].dev == dev) {
			close(exported[i].fd);
			exported[i].dev = 0;
		}
	pthread_mutex_unlock(&reg_lock);
}

int fake_ipc_map(int32_t pid, int32_t fd, uint64_t len, void **out)
{
	char path[64];
	struct stat st;
	void *p;
	int f;

	if (pid == getpid()) /* the drivers open handles of other processes only */
		return FAKE_IPC_SELF;
	snprintf(path, sizeof(path), "/proc/%d/fd/%d", pid, fd);
	f = open(path, O_RDWR | O_CLOEXEC);
	if (f < 0)
		return FAKE_IPC_GONE;
	if (fstat(f, &st) || (uint64_t)st.st_size < FAKE_PAGES(len)) {
		close(f);
		return FAKE_IPC_GONE;
	}
	p = mmap(NULL, FAKE_PAGES(len), PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
	close(f);
	if (p == MAP_FAILED)
		return FAKE_IPC_NOMEM;
	*out = p;
	return 0;
}

void *fake_shared_page(uint64_t len, int *fd, size_t m_off, size_t c_off)
{
	pthread_mutexattr_t ma;
	pthread_condattr_t ca;
	char *p;

	*fd = memfd_create("fake-gpu-event", MFD_CLOEXEC);
	if (*fd < 0)
		return NULL;
	if (ftruncate(*fd, (off_t)len) ||
	    (p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0)) == MAP_FAILED) {
		close(*fd);
		*fd = -1;
		return NULL;
	}
	pthread_mutexattr_init(&ma);
	pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
	pthread_condattr_init(&ca);
	pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
	pthread_mutex_init((pthread_mutex_t *)(p + m_off), &ma);
	pthread_cond_init((pthread_cond_t *)(p + c_off), &ca);
	pthread_mutexattr_destroy(&ma);
	pthread_condattr_destroy(&ca);
	return p;
}
