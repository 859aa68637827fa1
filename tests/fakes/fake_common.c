/* fake_common.c - device address window, region table, worker thread. */
#include "fake_common.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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
	int rc = -1;

	pthread_mutex_lock(&reg_lock);
	if (n_regions < MAX_REGIONS) {
		regions[n_regions++] = (struct fake_region){
			.dev = (uint64_t)(uintptr_t)host, .len = len, .host = host,
			.kind = FAKE_SYS, .owner = owner,
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
	struct task *next;
};

static pthread_mutex_t wk_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wk_cond = PTHREAD_COND_INITIALIZER;
static struct task *head, *tail;
static int wk_running, wk_stop, wk_hold;
static pthread_t wk_thread;

static void *worker(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&wk_lock);
	for (;;) {
		struct task *t;

		while (!wk_stop && (!head || wk_hold))
			pthread_cond_wait(&wk_cond, &wk_lock);
		if (!head && wk_stop)
			break;
		if (wk_hold && !wk_stop)
			continue;
		t = head;
		head = t->next;
		if (!head)
			tail = NULL;
		pthread_mutex_unlock(&wk_lock);
		t->fn(t->arg);
		free(t);
		pthread_mutex_lock(&wk_lock);
	}
	pthread_mutex_unlock(&wk_lock);
	return NULL;
}

void fake_worker_start(void)
{
	pthread_mutex_lock(&wk_lock);
	if (!wk_running) {
		wk_stop = 0;
		if (pthread_create(&wk_thread, NULL, worker, NULL) == 0)
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
	pthread_join(wk_thread, NULL);
	pthread_mutex_lock(&wk_lock);
	wk_running = 0;
	pthread_mutex_unlock(&wk_lock);
}

void fake_worker_push(fake_task_fn fn, void *arg)
{
	struct task *t = malloc(sizeof(*t));

	if (!t) {
		fn(arg); /* out of memory in a test fake: run inline */
		return;
	}
	t->fn = fn;
	t->arg = arg;
	t->next = NULL;
	pthread_mutex_lock(&wk_lock);
	if (tail)
		tail->next = t;
	else
		head = t;
	tail = t;
	pthread_cond_signal(&wk_cond);
	pthread_mutex_unlock(&wk_lock);
}

void fake_worker_hold(int hold)
{
	pthread_mutex_lock(&wk_lock);
	wk_hold = hold;
	pthread_cond_broadcast(&wk_cond);
	pthread_mutex_unlock(&wk_lock);
}

long fake_env_long(const char *name, long dflt)
{
	const char *v = getenv(name);

	return v && *v ? strtol(v, NULL, 0) : dflt;
}
