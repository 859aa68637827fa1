/* fake_cuda.c - a fake libcuda.so.1 for CI without a GPU.
 *
 * Exports only cuGetProcAddress_v2 / cuGetProcAddress (and the test
 * controls): every other entry point is reachable only through them, with
 * the version semantics of the real driver (the highest version of a
 * symbol not above both the requested version and the driver's), so a
 * backend that asks for the wrong prototype version gets nothing.  Each
 * entry is checked at compile time against its PFN_* type.
 *
 * Semantics that matter for correctness:
 *   - FAKE_CUDA_DEVICES (default 2) devices, one primary context each;
 *     calls that need a current context fail without one;
 *   - device memory at addresses the CPU cannot touch;
 *   - cuMemHostRegister + cuMemHostGetDevicePointer give a device pointer
 *     different from the host pointer (as when a visible device cannot use
 *     host pointers); copies given the raw host pointer of a registered
 *     range fail, and so does a copy that runs past one registration
 *     (FAKE_CUDA_MAX_REGISTER caps one registration, like R580 drivers);
 *   - each stream is one lane of the fake's workers (fake_common.h): its
 *     copies and records run in order, streams in no order among
 *     themselves (a random delay per task with FAKE_GPU_JITTER_US or the
 *     "jitter_us" control); events complete when their stream reaches
 *     them and report an injected asynchronous error of the copies before
 *     them on the stream; a cuStreamWaitEvent waits for the record made
 *     before it, not for later ones;
 *   - IPC as the driver does it between processes: cuIpcGetMemHandle
 *     moves the allocation onto a memfd (same address, same bytes) and
 *     the handle names it (pid, fd); cuIpcOpenMemHandle in another
 *     process maps that memfd as device memory of its current context
 *     (refcounted per handle, as the driver does), never in the exporting
 *     process; CU_EVENT_INTERPROCESS events keep their state in a shared
 *     page (process-shared mutex and condition), so a record in one
 *     process completes a wait or synchronize in another.  An imported
 *     event may be destroyed while waits on it are queued (the driver
 *     allows it): the mapping stays until they ran;
 *   - cuStreamWaitValue64 (GEQ) / cuStreamWriteValue64 on device memory,
 *     run in stream order on the lane: with IPC memory, timeline
 *     semaphores across processes (LMCache's isolated-IPC events);
 *   - cuMemcpyBatchAsync in its 12.8 (failIdx) or 13.0 form by
 *     FAKE_CUDA_DRIVER_VERSION (default 13000), absent below 12.8; it
 *     rejects the NULL stream and attributes without a srcAccessOrder.
 */
#include "fake_common.h"

#include <errno.h>
#include <pthread.h>
#include <unistd.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cuda.h>
#include <cudaTypedefs.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8
#define CTX_MAGIC 0x4354584354584354ull
#define STREAM_MAGIC 0x53545245414d5f5full
#define EVENT_MAGIC 0x4556454e545f5f5full
#define IMPORT_MAGIC 0x494d504f52545f5full
#define IPC_MAGIC 0x4b5654464b495043ull /* the handles' first 8 bytes */
/* region flags of device memory */
#define FAKE_F_MMAP 0x1u /* backing mmap'ed (munmap at free) */
#define FAKE_F_IPC  0x2u /* an opened IPC handle: cuIpcCloseMemHandle frees it */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized, n_devices, driver_version;
static uint64_t max_register;

struct fctx {
	uint64_t magic;
	int dev;
	int refs; /* under lock */
};
static struct fctx ctxs[MAX_DEVICES];

static _Thread_local struct fctx *ctx_stack[16];
static _Thread_local int ctx_depth;

static atomic_long fail_copy, async_error, fail_register;
/* the code an injected copy fault returns, and then every call ("fault_code";
 * default CUDA_ERROR_ILLEGAL_ADDRESS): each of the driver's sticky errors */
static atomic_int fault_code = CUDA_ERROR_ILLEGAL_ADDRESS;
/* "hold_d2h": device-to-host copies wait before they copy, holding their
 * stream (its later work waits behind them, as on a real stream) */
static atomic_int hold_d2h;
/* A copy fault is sticky, as on a real context (CUDA_ERROR_ILLEGAL_ADDRESS
 * and its kind): once one happened, every later copy, record, query and
 * synchronize returns it -- for events that completed before it too.
 * Only "reset" clears it (a new process, for the real driver). */
static atomic_int lost;
static atomic_long range_split; /* device ranges reported in pieces of this */
#define NOT_LOST() do { int l_ = atomic_load(&lost); if (l_) return (CUresult)l_; } while (0)
static atomic_long st_copies, st_batch_calls, st_batch_copies, st_copy2d_calls,
	st_max_reg_bytes, st_streams_live, st_events_live, st_bad_pointer, st_regs_total,
	st_spin_syncs, st_kernel_launches, st_kernel_copies, st_modules_live;
static atomic_long kernel_fault; /* the nth launch of the copy kernel faults */
/* cuMemHostRegister calls after the first hold_register_after wait while
 * it stays set (0: none): a registration that is still running */
static atomic_long hold_register_after, st_register_calls;
static atomic_long st_hostallocs_live; /* cuMemHostAlloc'ed: aliases, not registrations */

static bool trip(atomic_long *c)
{
	long v = atomic_load(c);

	while (v > 0 && !atomic_compare_exchange_weak(c, &v, v - 1))
		;
	return v == 1;
}

EXPORT int kvt_fake_cuda_ctl(const char *key, long v)
{
	if (!strcmp(key, "fail_copy"))
		atomic_store(&fail_copy, v);
	else if (!strcmp(key, "async_error"))
		atomic_store(&async_error, v);
	else if (!strcmp(key, "fault_code"))
		atomic_store(&fault_code, (int)v);
	else if (!strcmp(key, "hold_d2h"))
		atomic_store(&hold_d2h, (int)v);
	else if (!strcmp(key, "fail_register"))
		atomic_store(&fail_register, v);
	else if (!strcmp(key, "hold"))
		fake_worker_hold((int)v);
	else if (!strcmp(key, "range_split"))
		atomic_store(&range_split, v);
	else if (!strcmp(key, "hold_register_after")) {
		atomic_store(&st_register_calls, 0);
		atomic_store(&hold_register_after, v);
	} else if (!strcmp(key, "kernel_fault"))
		atomic_store(&kernel_fault, v);
	else if (!strcmp(key, "jitter_us"))
		fake_worker_jitter(v);
	else if (!strcmp(key, "reset")) {
		atomic_store(&fail_copy, 0);
		atomic_store(&async_error, 0);
		atomic_store(&fault_code, CUDA_ERROR_ILLEGAL_ADDRESS);
		atomic_store(&hold_d2h, 0);
		atomic_store(&lost, 0);
		fake_copy_resume();
		atomic_store(&fail_register, 0);
		atomic_store(&st_copies, 0);
		atomic_store(&st_batch_calls, 0);
		atomic_store(&st_batch_copies, 0);
		atomic_store(&st_copy2d_calls, 0);
		atomic_store(&st_max_reg_bytes, 0);
		atomic_store(&st_bad_pointer, 0);
		atomic_store(&st_regs_total, 0);
		atomic_store(&st_spin_syncs, 0);
		atomic_store(&st_kernel_launches, 0);
		atomic_store(&st_kernel_copies, 0);
		atomic_store(&kernel_fault, 0);
		atomic_store(&hold_register_after, 0);
		atomic_store(&range_split, 0);
		fake_worker_hold(0);
		fake_worker_out_of_order(1);
		fake_worker_jitter(fake_env_long("FAKE_GPU_JITTER_US", 0));
	} else
		return -EINVAL;
	return 0;
}

EXPORT long kvt_fake_cuda_stat(const char *key)
{
	if (!strcmp(key, "copies"))
		return atomic_load(&st_copies);
	if (!strcmp(key, "out_of_order"))
		return fake_worker_out_of_order(0);
	if (!strcmp(key, "batch_calls"))
		return atomic_load(&st_batch_calls);
	if (!strcmp(key, "batch_copies"))
		return atomic_load(&st_batch_copies);
	if (!strcmp(key, "copy2d_calls"))
		return atomic_load(&st_copy2d_calls);
	if (!strcmp(key, "regs_live"))
		return fake_region_count(FAKE_ALIAS) - atomic_load(&st_hostallocs_live);
	if (!strcmp(key, "regs_total"))
		return atomic_load(&st_regs_total);
	if (!strcmp(key, "max_reg_bytes"))
		return atomic_load(&st_max_reg_bytes);
	if (!strcmp(key, "allocs_live"))
		return fake_region_count(FAKE_DEV) + fake_region_count(FAKE_SYS);
	if (!strcmp(key, "streams_live"))
		return atomic_load(&st_streams_live);
	if (!strcmp(key, "events_live"))
		return atomic_load(&st_events_live);
	if (!strcmp(key, "spin_syncs")) /* cuEventSynchronize on an event that
					 * the driver would spin on */
		return atomic_load(&st_spin_syncs);
	if (!strcmp(key, "bad_pointer"))
		return atomic_load(&st_bad_pointer);
	if (!strcmp(key, "kernel_launches"))
		return atomic_load(&st_kernel_launches);
	if (!strcmp(key, "kernel_copies")) /* descriptors the copy kernel ran */
		return atomic_load(&st_kernel_copies);
	if (!strcmp(key, "modules_live"))
		return atomic_load(&st_modules_live);
	if (!strcmp(key, "ctx_refs")) {
		long n = 0;

		pthread_mutex_lock(&lock);
		for (int i = 0; i < MAX_DEVICES; i++)
			n += ctxs[i].refs;
		pthread_mutex_unlock(&lock);
		return n;
	}
	return -1;
}

static struct fctx *current(void)
{
	return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL;
}

static int inited(void)
{
	int n;

	pthread_mutex_lock(&lock);
	n = initialized;
	pthread_mutex_unlock(&lock);
	return n;
}

#define NEED_INIT() do { if (!inited()) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define NEED_CTX() do { NEED_INIT(); if (!current()) return CUDA_ERROR_INVALID_CONTEXT; } while (0)

/* ---- init, devices, contexts ------------------------------------------- */

static CUresult f_cuInit(unsigned int flags)
{
	long err = fake_env_long("FAKE_CUDA_INIT_ERROR", 0);

	if (flags)
		return CUDA_ERROR_INVALID_VALUE;
	if (err)
		return (CUresult)err;
	pthread_mutex_lock(&lock);
	if (!initialized) {
		n_devices = (int)fake_env_long("FAKE_CUDA_DEVICES", 2);
		if (n_devices < 0 || n_devices > MAX_DEVICES)
			n_devices = 2;
		max_register = (uint64_t)fake_env_long("FAKE_CUDA_MAX_REGISTER", 64L << 30);
		for (int i = 0; i < MAX_DEVICES; i++)
			ctxs[i] = (struct fctx){ .magic = CTX_MAGIC, .dev = i };
		if (n_devices)
			initialized = 1;
		/* the driver's worker lives for the process, as a real driver's threads do */
		fake_worker_start();
	}
	pthread_mutex_unlock(&lock);
	return n_devices ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

static CUresult f_cuDriverGetVersion(int *v)
{
	if (!v)
		return CUDA_ERROR_INVALID_VALUE;
	*v = driver_version;
	return CUDA_SUCCESS;
}

static CUresult f_cuDeviceGetCount(int *n)
{
	NEED_INIT();
	*n = n_devices;
	return CUDA_SUCCESS;
}

static CUresult f_cuDeviceGet(CUdevice *d, int ordinal)
{
	NEED_INIT();
	if (ordinal < 0 || ordinal >= n_devices)
		return CUDA_ERROR_INVALID_DEVICE;
	*d = ordinal;
	return CUDA_SUCCESS;
}

static CUresult f_cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d)
{
	NEED_INIT();
	if (d < 0 || d >= n_devices)
		return CUDA_ERROR_INVALID_DEVICE;
	switch (a) {
	case CU_DEVICE_ATTRIBUTE_MAX_PITCH:
		*v = 2147483647;
		return CUDA_SUCCESS;
	case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT:
		*v = 2;
		return CUDA_SUCCESS;
	case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
		*v = 1;
		return CUDA_SUCCESS;
	case CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM:
		*v = 0;
		return CUDA_SUCCESS;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: /* an H200 */
		*v = 9;
		return CUDA_SUCCESS;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
		*v = 0;
		return CUDA_SUCCESS;
	case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
		*v = 132;
		return CUDA_SUCCESS;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
}

static CUresult f_cuDeviceGetName(char *name, int len, CUdevice d)
{
	NEED_INIT();
	if (d < 0 || d >= n_devices || !name || len <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	snprintf(name, (size_t)len, "Fake H200");
	return CUDA_SUCCESS;
}

static CUresult f_cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
	NEED_INIT();
	if (d < 0 || d >= n_devices)
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&lock);
	ctxs[d].refs++;
	pthread_mutex_unlock(&lock);
	*c = (CUcontext)&ctxs[d];
	return CUDA_SUCCESS;
}

static CUresult f_cuDevicePrimaryCtxRelease(CUdevice d)
{
	CUresult r = CUDA_SUCCESS;

	NEED_INIT();
	if (d < 0 || d >= n_devices)
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&lock);
	if (ctxs[d].refs > 0)
		ctxs[d].refs--;
	else
		r = CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_unlock(&lock);
	return r;
}

static CUresult f_cuCtxPushCurrent(CUcontext c)
{
	struct fctx *f = (struct fctx *)c;

	NEED_INIT();
	if (!f || f->magic != CTX_MAGIC || ctx_depth >= 16)
		return CUDA_ERROR_INVALID_CONTEXT;
	ctx_stack[ctx_depth++] = f;
	return CUDA_SUCCESS;
}

static CUresult f_cuCtxPopCurrent(CUcontext *c)
{
	NEED_INIT();
	if (!ctx_depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	ctx_depth--;
	if (c)
		*c = (CUcontext)ctx_stack[ctx_depth];
	return CUDA_SUCCESS;
}

/* ---- streams and events ------------------------------------------------- */

struct fstream {
	uint64_t magic;
	int lane;       /* its worker lane; 0 for the NULL and engine streams */
	CUresult err;   /* pending async error; touched by the worker only */
	int kernels;    /* fake kernels running on it (kernel_mu) */
};

/* Fake kernels (kvt_fake_cuda_kernel_write): device-memory writers that
 * run on their own thread, as the engine's compute does beside the copy
 * engines, and finish late.  Work queued on their stream after them (an
 * event record, a copy) waits for them, as a stream orders its work;
 * work on other streams does not, unless it waits on an event
 * (cuStreamWaitEvent).  So a save that does not order itself after the
 * engine's stream copies the bytes the kernel has not written yet. */
static pthread_mutex_t kernel_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t kernel_cv = PTHREAD_COND_INITIALIZER;
static int kernels_running;

static void stream_ready(struct fstream *s)
{
	if (!s)
		return;
	pthread_mutex_lock(&kernel_mu);
	while (s->kernels)
		pthread_cond_wait(&kernel_cv, &kernel_mu);
	pthread_mutex_unlock(&kernel_mu);
}

struct fevent {
	uint64_t magic;
	pthread_mutex_t m;
	pthread_cond_t c;
	int pending;    /* records not reached yet; under m */
	uint64_t issued, reached; /* records made, records reached; under m */
	CUresult status;
	unsigned flags;
	int fd;         /* CU_EVENT_INTERPROCESS: the memfd of its page (exporter) */
};

/* An imported event (cuIpcOpenEventHandle): the exporter's page mapped
 * here.  refs: the handle's, and one per queued wait or record on it. */
struct fimport {
	uint64_t magic;
	struct fevent *e;
	atomic_int refs;
};

static struct fstream *stream_of(CUstream s)
{
	struct fstream *f = (struct fstream *)s;

	return f && f->magic == STREAM_MAGIC ? f : NULL;
}

static int lane_of(const struct fstream *s)
{
	return s ? s->lane : 0;
}

static struct fevent *event_of(CUevent e)
{
	struct fevent *f = (struct fevent *)e;
	struct fimport *i = (struct fimport *)e;

	if (i && i->magic == IMPORT_MAGIC)
		f = i->e;
	return f && f->magic == EVENT_MAGIC ? f : NULL;
}

#define EVENT_PAGE 4096

/* The import behind a CUevent with a reference taken, or NULL. */
static struct fimport *import_get(CUevent e)
{
	struct fimport *i = (struct fimport *)e;

	if (!i || i->magic != IMPORT_MAGIC)
		return NULL;
	atomic_fetch_add(&i->refs, 1);
	return i;
}

static void import_put(struct fimport *i)
{
	if (!i || atomic_fetch_sub(&i->refs, 1) != 1)
		return;
	munmap(i->e, EVENT_PAGE);
	i->magic = 0;
	free(i);
	atomic_fetch_sub(&st_events_live, 1);
}

static CUresult f_cuStreamCreate(CUstream *s, unsigned int flags)
{
	struct fstream *f;

	NEED_CTX();
	if (!s || (flags & ~CU_STREAM_NON_BLOCKING))
		return CUDA_ERROR_INVALID_VALUE;
	f = calloc(1, sizeof(*f));
	if (!f)
		return CUDA_ERROR_OUT_OF_MEMORY;
	f->magic = STREAM_MAGIC;
	{
		static atomic_uint next_lane;
		f->lane = 1 + (int)(atomic_fetch_add(&next_lane, 1) % (FAKE_LANES - 1));
	}
	*s = (CUstream)f;
	atomic_fetch_add(&st_streams_live, 1);
	return CUDA_SUCCESS;
}

struct marker {
	struct fstream *s;
	struct fevent *e;     /* event to complete, or NULL */
	struct fimport *imp;  /* e's import, referenced while queued */
	pthread_mutex_t *m;   /* stream sync: flag to set */
	pthread_cond_t *c;
	int *done;
};

static void run_marker(void *arg)
{
	struct marker *k = arg;

	stream_ready(k->s);
	fake_copy_settled(0); /* a fault being torn down: after its error */
	if (k->e) {
		pthread_mutex_lock(&k->e->m);
		if (atomic_load(&lost))
			k->e->status = (CUresult)atomic_load(&lost);
		if (k->s && k->s->err) {
			k->e->status = k->s->err;
			k->s->err = CUDA_SUCCESS;
		}
		k->e->pending--;
		k->e->reached++;
		pthread_cond_broadcast(&k->e->c);
		pthread_mutex_unlock(&k->e->m);
	} else {
		pthread_mutex_lock(k->m);
		*k->done = 1;
		pthread_cond_broadcast(k->c);
		pthread_mutex_unlock(k->m);
	}
	import_put(k->imp);
	free(k);
}

static CUresult f_cuStreamSynchronize(CUstream s)
{
	pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
	pthread_cond_t c = PTHREAD_COND_INITIALIZER;
	struct marker *k;
	int done = 0;

	NEED_INIT();
	if (s && !stream_of(s))
		return CUDA_ERROR_INVALID_HANDLE;
	k = calloc(1, sizeof(*k));
	if (!k)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*k = (struct marker){ .s = stream_of(s), .m = &m, .c = &c, .done = &done };
	fake_worker_push_lane(lane_of(k->s), run_marker, k);
	pthread_mutex_lock(&m);
	while (!done)
		pthread_cond_wait(&c, &m);
	pthread_mutex_unlock(&m);
	if (!s) /* the legacy stream: the work of every stream before it */
		for (int l = 1; l < FAKE_LANES; l++) {
			k = calloc(1, sizeof(*k));
			if (!k)
				return CUDA_ERROR_OUT_OF_MEMORY;
			done = 0;
			*k = (struct marker){ .m = &m, .c = &c, .done = &done };
			fake_worker_push_lane(l, run_marker, k);
			pthread_mutex_lock(&m);
			while (!done)
				pthread_cond_wait(&c, &m);
			pthread_mutex_unlock(&m);
		}
	pthread_cond_destroy(&c);
	pthread_mutex_destroy(&m);
	NOT_LOST();
	return CUDA_SUCCESS;
}

static CUresult f_cuStreamDestroy(CUstream s)
{
	struct fstream *f = stream_of(s);

	NEED_INIT();
	if (!f)
		return CUDA_ERROR_INVALID_HANDLE;
	f_cuStreamSynchronize(s); /* the real driver defers; same effect here */
	f->magic = 0;
	free(f);
	atomic_fetch_sub(&st_streams_live, 1);
	return CUDA_SUCCESS;
}

static CUresult f_cuEventCreate(CUevent *e, unsigned int flags)
{
	struct fevent *f;

	NEED_CTX();
	if (!e || (flags & ~(unsigned)(CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC |
				      CU_EVENT_INTERPROCESS)))
		return CUDA_ERROR_INVALID_VALUE;
	if (flags & CU_EVENT_INTERPROCESS) {
		/* its state on a page of its own that other processes map */
		int fd;

		if (!(flags & CU_EVENT_DISABLE_TIMING))
			return CUDA_ERROR_INVALID_VALUE; /* as the driver asks */
		f = fake_shared_page(EVENT_PAGE, &fd, offsetof(struct fevent, m),
				     offsetof(struct fevent, c));
		if (!f)
			return CUDA_ERROR_OUT_OF_MEMORY;
		f->fd = fd;
	} else {
		f = calloc(1, sizeof(*f));
		if (!f)
			return CUDA_ERROR_OUT_OF_MEMORY;
		pthread_mutex_init(&f->m, NULL);
		pthread_cond_init(&f->c, NULL);
		f->fd = -1;
	}
	f->magic = EVENT_MAGIC;
	f->flags = flags;
	*e = (CUevent)f;
	atomic_fetch_add(&st_events_live, 1);
	return CUDA_SUCCESS;
}

static CUresult f_cuEventDestroy(CUevent e)
{
	struct fevent *f = event_of(e);
	struct fimport *imp = (struct fimport *)e;

	NEED_INIT();
	if (!f)
		return CUDA_ERROR_INVALID_HANDLE;
	if (imp->magic == IMPORT_MAGIC) { /* the mapping goes after its queued work */
		import_put(imp);
		return CUDA_SUCCESS;
	}
	pthread_mutex_lock(&f->m);
	while (f->pending) /* a record in flight still points at it */
		pthread_cond_wait(&f->c, &f->m);
	pthread_mutex_unlock(&f->m);
	if (f->fd >= 0) { /* importers keep their own mapping of the page */
		close(f->fd);
		munmap(f, EVENT_PAGE);
		atomic_fetch_sub(&st_events_live, 1);
		return CUDA_SUCCESS;
	}
	f->magic = 0;
	pthread_mutex_destroy(&f->m);
	pthread_cond_destroy(&f->c);
	free(f);
	atomic_fetch_sub(&st_events_live, 1);
	return CUDA_SUCCESS;
}

static CUresult f_cuEventRecord(CUevent e, CUstream s)
{
	struct fevent *f = event_of(e);
	struct marker *k;

	NEED_INIT();
	if (!f || (s && !stream_of(s)))
		return CUDA_ERROR_INVALID_HANDLE;
	NOT_LOST();
	k = calloc(1, sizeof(*k));
	if (!k)
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&f->m);
	f->pending++;
	f->issued++;
	f->status = CUDA_SUCCESS;
	pthread_mutex_unlock(&f->m);
	*k = (struct marker){ .s = stream_of(s), .e = f, .imp = import_get(e) };
	fake_worker_push_lane(lane_of(k->s), run_marker, k);
	return CUDA_SUCCESS;
}

static CUresult f_cuEventQuery(CUevent e)
{
	struct fevent *f = event_of(e);
	CUresult r;

	NEED_INIT();
	if (!f)
		return CUDA_ERROR_INVALID_HANDLE;
	pthread_mutex_lock(&f->m);
	r = f->pending ? CUDA_ERROR_NOT_READY : f->status;
	pthread_mutex_unlock(&f->m);
	NOT_LOST();
	return r;
}

static CUresult f_cuEventSynchronize(CUevent e)
{
	struct fevent *f = event_of(e);
	CUresult r;

	NEED_INIT();
	if (!f)
		return CUDA_ERROR_INVALID_HANDLE;
	/* the real driver busy-waits here unless the event was created with
	 * CU_EVENT_BLOCKING_SYNC (or the context with BLOCKING_SYNC) */
	if (!(f->flags & CU_EVENT_BLOCKING_SYNC))
		atomic_fetch_add(&st_spin_syncs, 1);
	pthread_mutex_lock(&f->m);
	while (f->pending)
		pthread_cond_wait(&f->c, &f->m);
	r = f->status;
	pthread_mutex_unlock(&f->m);
	NOT_LOST();
	return r;
}

struct waiter {
	struct fstream *s;
	struct fevent *e;
	struct fimport *imp;
	uint64_t target; /* the records made before the wait was queued */
};

/* The stream's later work waits for the event's record made before the
 * wait was queued (a later record does not count, as in the driver); that
 * record's marker ran on its own stream's lane after its kernels. */
static void run_wait(void *arg)
{
	struct waiter *w = arg;

	stream_ready(w->s);
	pthread_mutex_lock(&w->e->m);
	while (w->e->reached < w->target)
		pthread_cond_wait(&w->e->c, &w->e->m);
	pthread_mutex_unlock(&w->e->m);
	import_put(w->imp);
	free(w);
}

static CUresult f_cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags)
{
	struct fevent *f = event_of(e);
	struct waiter *w;

	NEED_INIT();
	if (!f || (s && !stream_of(s)))
		return CUDA_ERROR_INVALID_HANDLE;
	if (flags)
		return CUDA_ERROR_INVALID_VALUE;
	NOT_LOST();
	w = calloc(1, sizeof(*w));
	if (!w)
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&f->m);
	*w = (struct waiter){ .s = stream_of(s), .e = f, .imp = import_get(e),
			      .target = f->issued };
	pthread_mutex_unlock(&f->m);
	fake_worker_push_lane(lane_of(w->s), run_wait, w);
	return CUDA_SUCCESS;
}

/* ---- fake kernels: the engine's compute, for the ordering tests ---------- */

static char *resolve(uint64_t addr, uint64_t len, const char *what);

struct kernel {
	struct fstream *s;
	char *dst;
	int byte;
	uint64_t len;
	unsigned delay_us;
};

static void *run_kernel(void *arg)
{
	struct kernel *k = arg;

	usleep(k->delay_us);
	memset(k->dst, k->byte, k->len);
	pthread_mutex_lock(&kernel_mu);
	k->s->kernels--;
	kernels_running--;
	pthread_cond_broadcast(&kernel_cv);
	pthread_mutex_unlock(&kernel_mu);
	free(k);
	return NULL;
}

/* The engine's stream for the kernels (one, for the process's life; no
 * context needed). */
EXPORT CUstream kvt_fake_cuda_engine_stream(void)
{
	static struct fstream engine = { .magic = STREAM_MAGIC };

	return (CUstream)&engine;
}

/* Launches a kernel on s that fills [dst, dst + len) of device memory with
 * `byte` after delay_us, on its own thread.  0 or -errno. */
EXPORT int kvt_fake_cuda_kernel_write(CUstream s, uint64_t dst, int byte, uint64_t len,
				      unsigned delay_us)
{
	struct fstream *f = stream_of(s);
	struct kernel *k;
	char *d;
	pthread_t th;

	if (!f || !(d = resolve(dst, len, "kernel dst")))
		return -EINVAL;
	k = calloc(1, sizeof(*k));
	if (!k)
		return -ENOMEM;
	*k = (struct kernel){ .s = f, .dst = d, .byte = byte, .len = len, .delay_us = delay_us };
	pthread_mutex_lock(&kernel_mu);
	f->kernels++;
	kernels_running++;
	pthread_mutex_unlock(&kernel_mu);
	if (pthread_create(&th, NULL, run_kernel, k)) {
		pthread_mutex_lock(&kernel_mu);
		f->kernels--;
		kernels_running--;
		pthread_mutex_unlock(&kernel_mu);
		free(k);
		return -EAGAIN;
	}
	pthread_detach(th);
	return 0;
}

/* Waits until no fake kernel runs (a test's cleanup). */
EXPORT void kvt_fake_cuda_kernels_wait(void)
{
	pthread_mutex_lock(&kernel_mu);
	while (kernels_running)
		pthread_cond_wait(&kernel_cv, &kernel_mu);
	pthread_mutex_unlock(&kernel_mu);
}

/* Adopts [p, p + len) of the caller's memory as device memory of device 0
 * at its own address: a dry run's engine (bench/gpu/engine_check.py with
 * CPU torch tensors) hands the backend "device" tensors it writes itself.
 * 0 or -errno. */
EXPORT int kvt_fake_cuda_adopt(void *p, uint64_t len)
{
	if (!p || !len)
		return -EINVAL;
	return fake_region_add_at(FAKE_DEV, p, len, 0) ? -ENOSPC : 0;
}

/* ---- memory ------------------------------------------------------------------ */

static CUresult f_cuMemHostRegister(void *p, size_t bytes, unsigned int flags)
{
	struct fake_region r;
	uint64_t dev;
	long cur;

	NEED_CTX();
	if (!p || !bytes || (flags & ~(unsigned)(CU_MEMHOSTREGISTER_PORTABLE |
						  CU_MEMHOSTREGISTER_DEVICEMAP)))
		return CUDA_ERROR_INVALID_VALUE;
	{
		long n = atomic_fetch_add(&st_register_calls, 1) + 1;

		while (atomic_load(&hold_register_after) && n > atomic_load(&hold_register_after))
			usleep(500);
	}
	if (bytes > max_register)
		return CUDA_ERROR_INVALID_VALUE; /* what R580 does for huge ranges */
	for (uint64_t o = 0; o < bytes; o += 4096) /* any overlap */
		if (fake_alias_of_host((char *)p + o, 1, &r) == 0)
			return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
	if (fake_alias_of_host((char *)p + bytes - 1, 1, &r) == 0)
		return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
	if (trip(&fail_register))
		return CUDA_ERROR_OUT_OF_MEMORY;
	dev = fake_region_add(FAKE_ALIAS, bytes, p, current()->dev, flags);
	if (!dev)
		return CUDA_ERROR_OUT_OF_MEMORY;
	atomic_fetch_add(&st_regs_total, 1);
	cur = atomic_load(&st_max_reg_bytes);
	while ((long)bytes > cur && !atomic_compare_exchange_weak(&st_max_reg_bytes, &cur, (long)bytes))
		;
	return CUDA_SUCCESS;
}

static CUresult f_cuMemHostUnregister(void *p)
{
	struct fake_region r;

	NEED_CTX();
	if (fake_alias_of_host(p, 1, &r) || r.host != p)
		return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
	fake_region_del(r.dev, NULL);
	return CUDA_SUCCESS;
}

static CUresult f_cuMemHostGetDevicePointer(CUdeviceptr *dp, void *p, unsigned int flags)
{
	struct fake_region r;

	NEED_CTX();
	if (!dp || flags || fake_alias_of_host(p, 1, &r))
		return CUDA_ERROR_INVALID_VALUE;
	if (!(r.flags & CU_MEMHOSTREGISTER_DEVICEMAP))
		return CUDA_ERROR_INVALID_VALUE;
	*dp = (CUdeviceptr)(r.dev + (uint64_t)((char *)p - r.host));
	return CUDA_SUCCESS;
}


/* ---- IPC ------------------------------------------------------------------- */

/* What a fake handle (CUipcMemHandle / CUipcEventHandle, 64 bytes) holds:
 * the exporting process and its memfd, /proc/PID/fd/FD to the importer. */
struct ipc_wire {
	uint64_t magic;
	int32_t pid, fd;
	uint64_t len;
	int32_t owner, kind; /* device; 1 memory, 2 event */
};
_Static_assert(sizeof(struct ipc_wire) <= CU_IPC_HANDLE_SIZE, "a handle's bytes");

/* handles opened here */
#define MAX_IPC 256
static struct { int32_t pid, fd; uint64_t dev; int refs; } opened[MAX_IPC];

static int ipc_map(const struct ipc_wire *w, int kind, uint64_t min_len, void **out)
{
	static const CUresult why[] = { [FAKE_IPC_SELF] = CUDA_ERROR_INVALID_CONTEXT,
					[FAKE_IPC_GONE] = CUDA_ERROR_INVALID_HANDLE,
					[FAKE_IPC_NOMEM] = CUDA_ERROR_MAP_FAILED };
	int rc;

	if (w->magic != IPC_MAGIC || w->kind != kind || w->len < min_len)
		return CUDA_ERROR_INVALID_VALUE;
	rc = fake_ipc_map(w->pid, w->fd, w->len, out);
	return rc ? (int)why[rc] : CUDA_SUCCESS;
}

static CUresult f_cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr dp)
{
	struct ipc_wire w = { .magic = IPC_MAGIC, .pid = getpid(), .fd = -1, .kind = 1 };
	struct fake_region r;

	NEED_CTX();
	if (!h || fake_region_find(dp, 1, &r) || r.dev != dp || r.kind != FAKE_DEV ||
	    !(r.flags & FAKE_F_MMAP) || (r.flags & FAKE_F_IPC))
		return CUDA_ERROR_INVALID_VALUE;
	w.fd = fake_ipc_export(dp, r.host, r.len);
	if (w.fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	w.len = r.len;
	w.owner = r.owner;
	memset(h, 0, sizeof(*h));
	memcpy(h->reserved, &w, sizeof(w));
	return CUDA_SUCCESS;
}

static CUresult f_cuIpcOpenMemHandle(CUdeviceptr *dp, CUipcMemHandle h, unsigned int flags)
{
	struct ipc_wire w;
	uint64_t dev;
	void *p;
	int rc, free_i = -1;

	NEED_CTX();
	if (!dp || (flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(&w, h.reserved, sizeof(w));
	pthread_mutex_lock(&lock);
	for (int i = 0; i < MAX_IPC; i++) {
		if (opened[i].refs && opened[i].pid == w.pid && opened[i].fd == w.fd) {
			/* opened before by this context: the same pointer, a reference more */
			opened[i].refs++;
			*dp = (CUdeviceptr)opened[i].dev;
			pthread_mutex_unlock(&lock);
			return CUDA_SUCCESS;
		}
		if (!opened[i].refs && free_i < 0)
			free_i = i;
	}
	pthread_mutex_unlock(&lock);
	if (free_i < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	rc = ipc_map(&w, 1, 1, &p);
	if (rc)
		return (CUresult)rc;
	dev = fake_region_add(FAKE_DEV, w.len, p, current()->dev, FAKE_F_MMAP | FAKE_F_IPC);
	if (!dev) {
		munmap(p, FAKE_PAGES(w.len));
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	pthread_mutex_lock(&lock);
	opened[free_i].pid = w.pid;
	opened[free_i].fd = w.fd;
	opened[free_i].dev = dev;
	opened[free_i].refs = 1;
	pthread_mutex_unlock(&lock);
	*dp = (CUdeviceptr)dev;
	return CUDA_SUCCESS;
}

static CUresult f_cuIpcCloseMemHandle(CUdeviceptr dp)
{
	struct fake_region r;

	NEED_CTX();
	if (fake_region_find(dp, 1, &r) || r.dev != dp || !(r.flags & FAKE_F_IPC))
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	for (int i = 0; i < MAX_IPC; i++)
		if (opened[i].refs && opened[i].dev == dp && --opened[i].refs) {
			pthread_mutex_unlock(&lock);
			return CUDA_SUCCESS;
		}
	pthread_mutex_unlock(&lock);
	fake_region_del(dp, NULL);
	munmap(r.host, FAKE_PAGES(r.len));
	return CUDA_SUCCESS;
}

static CUresult f_cuIpcGetEventHandle(CUipcEventHandle *h, CUevent e)
{
	struct fevent *f = event_of(e);
	struct ipc_wire w = { .magic = IPC_MAGIC, .pid = getpid(), .len = EVENT_PAGE,
			      .kind = 2 };

	NEED_INIT();
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	if (!f || ((struct fimport *)e)->magic == IMPORT_MAGIC || f->fd < 0)
		return CUDA_ERROR_INVALID_HANDLE; /* not created INTERPROCESS here */
	w.fd = f->fd;
	memset(h, 0, sizeof(*h));
	memcpy(h->reserved, &w, sizeof(w));
	return CUDA_SUCCESS;
}

static CUresult f_cuIpcOpenEventHandle(CUevent *e, CUipcEventHandle h)
{
	struct ipc_wire w;
	struct fimport *i;
	void *p;
	int rc;

	NEED_CTX();
	if (!e)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(&w, h.reserved, sizeof(w));
	rc = ipc_map(&w, 2, EVENT_PAGE, &p);
	if (rc)
		return (CUresult)rc;
	if (((struct fevent *)p)->magic != EVENT_MAGIC) {
		munmap(p, EVENT_PAGE);
		return CUDA_ERROR_INVALID_HANDLE;
	}
	i = calloc(1, sizeof(*i));
	if (!i) {
		munmap(p, EVENT_PAGE);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	i->magic = IMPORT_MAGIC;
	i->e = p;
	atomic_init(&i->refs, 1);
	*e = (CUevent)i;
	atomic_fetch_add(&st_events_live, 1);
	return CUDA_SUCCESS;
}

/* ---- stream memory operations ---------------------------------------------- */

struct memop {
	struct fstream *s;
	volatile uint64_t *p;
	uint64_t value;
	int write;
};

static void run_memop(void *arg)
{
	struct memop *m = arg;

	stream_ready(m->s);
	if (m->write)
		__atomic_store_n(m->p, m->value, __ATOMIC_RELEASE);
	else /* GEQ, as the driver compares: (int64_t)(*addr - value) >= 0 */
		while ((int64_t)(__atomic_load_n(m->p, __ATOMIC_ACQUIRE) - m->value) < 0)
			usleep(100);
	free(m);
}

static CUresult memop(CUstream st, CUdeviceptr addr, cuuint64_t v, unsigned int flags, int write)
{
	struct fake_region r;
	struct memop *m;
	char *p;

	NEED_CTX();
	if ((st && !stream_of(st)))
		return CUDA_ERROR_INVALID_HANDLE;
	if (flags || addr % 8 || fake_region_find(addr, 8, &r) || r.kind != FAKE_DEV ||
	    !(p = resolve(addr, 8, write ? "cuStreamWriteValue64" : "cuStreamWaitValue64")))
		return CUDA_ERROR_INVALID_VALUE; /* GEQ / DEFAULT only, device memory */
	NOT_LOST();
	m = calloc(1, sizeof(*m));
	if (!m)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*m = (struct memop){ .s = stream_of(st), .p = (volatile uint64_t *)p, .value = v,
			     .write = write };
	fake_worker_push_lane(lane_of(m->s), run_memop, m);
	return CUDA_SUCCESS;
}

static CUresult f_cuStreamWaitValue64(CUstream st, CUdeviceptr addr, cuuint64_t v,
				      unsigned int flags)
{
	return memop(st, addr, v, flags, 0);
}

static CUresult f_cuStreamWriteValue64(CUstream st, CUdeviceptr addr, cuuint64_t v,
				       unsigned int flags)
{
	return memop(st, addr, v, flags, 1);
}

/* 16 bytes a device: "kvtier-fakegpu" and the ordinal */
static CUresult f_cuDeviceGetUuid(CUuuid *u, CUdevice d)
{
	NEED_INIT();
	if (!u || d < 0 || d >= n_devices)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(u->bytes, "kvtier-fakegpu", 14);
	u->bytes[14] = 0;
	u->bytes[15] = (char)d;
	return CUDA_SUCCESS;
}

static CUresult f_cuMemAlloc(CUdeviceptr *dp, size_t bytes)
{
	char *backing;
	uint64_t dev;

	NEED_CTX();
	if (!dp || !bytes || bytes > (1ull << 40))
		return CUDA_ERROR_INVALID_VALUE;
	/* whole pages, so that an export can put a memfd in their place */
	backing = mmap(NULL, FAKE_PAGES(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
		       -1, 0);
	if (backing == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	dev = fake_region_add(FAKE_DEV, bytes, backing, current()->dev, FAKE_F_MMAP);
	if (!dev) {
		munmap(backing, FAKE_PAGES(bytes));
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*dp = (CUdeviceptr)dev;
	return CUDA_SUCCESS;
}

static CUresult f_cuMemFree(CUdeviceptr dp)
{
	struct fake_region r;

	NEED_CTX();
	if (fake_region_find(dp, 1, &r) || r.dev != dp || r.kind != FAKE_DEV ||
	    (r.flags & FAKE_F_IPC))
		return CUDA_ERROR_INVALID_VALUE;
	fake_region_del(r.dev, NULL);
	if (r.flags & FAKE_F_MMAP) {
		munmap(r.host, FAKE_PAGES(r.len));
		fake_ipc_unexport(dp);
	} else {
		free(r.host);
	}
	return CUDA_SUCCESS;
}

static CUresult f_cuMemAllocHost(void **pp, size_t bytes)
{
	char *p;

	NEED_CTX();
	if (!pp || !bytes)
		return CUDA_ERROR_INVALID_VALUE;
	p = aligned_alloc(4096, (bytes + 4095) & ~(size_t)4095);
	if (!p)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (fake_region_add_sys(p, bytes, current()->dev)) {
		free(p);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*pp = p;
	return CUDA_SUCCESS;
}

/* cuMemHostAlloc: pinned host memory whose device view (DEVICEMAP) sits at
 * an address of its own, as on a system where the device cannot use host
 * pointers -- so a caller that skips cuMemHostGetDevicePointer fails here. */
#define FAKE_HOSTALLOC 0x80000000u

static CUresult f_cuMemHostAlloc(void **pp, size_t bytes, unsigned int flags)
{
	char *p;
	uint64_t dev;

	NEED_CTX();
	if (!pp || !bytes || (flags & ~(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
					 CU_MEMHOSTALLOC_WRITECOMBINED)))
		return CUDA_ERROR_INVALID_VALUE;
	p = aligned_alloc(4096, (bytes + 4095) & ~(size_t)4095);
	if (!p)
		return CUDA_ERROR_OUT_OF_MEMORY;
	dev = fake_region_add(FAKE_ALIAS, bytes, p, current()->dev,
			      (flags & CU_MEMHOSTALLOC_DEVICEMAP ? CU_MEMHOSTREGISTER_DEVICEMAP : 0) |
			      FAKE_HOSTALLOC);
	if (!dev) {
		free(p);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	atomic_fetch_add(&st_hostallocs_live, 1);
	*pp = p;
	return CUDA_SUCCESS;
}

static CUresult f_cuMemFreeHost(void *p)
{
	struct fake_region r;

	NEED_INIT();
	if (!fake_alias_of_host(p, 1, &r) && (r.flags & FAKE_HOSTALLOC) && r.host == p) {
		fake_region_del(r.dev, NULL);
		atomic_fetch_sub(&st_hostallocs_live, 1);
		free(p);
		return CUDA_SUCCESS;
	}
	if (fake_region_find((uint64_t)(uintptr_t)p, 1, &r) || r.kind != FAKE_SYS ||
	    r.host != p)
		return CUDA_ERROR_INVALID_VALUE;
	fake_region_del(r.dev, NULL);
	free(p);
	return CUDA_SUCCESS;
}

static CUresult f_cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p)
{
	struct fake_region r;

	NEED_INIT();
	if (!data || fake_region_find(p, 1, &r))
		return CUDA_ERROR_INVALID_VALUE;
	switch (a) {
	case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
		*(unsigned int *)data = r.kind == FAKE_DEV ? CU_MEMORYTYPE_DEVICE
							   : CU_MEMORYTYPE_HOST;
		return CUDA_SUCCESS;
	case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
		*(int *)data = r.owner;
		return CUDA_SUCCESS;
	case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
	case CU_POINTER_ATTRIBUTE_RANGE_SIZE: {
		/* range_split: device memory mapped in pieces of that many
		 * bytes (cuMemMap of several allocations into one reserved
		 * range, as PyTorch's expandable segments do): each piece is
		 * a range of its own */
		uint64_t piece = (uint64_t)atomic_load(&range_split), start = r.dev, len = r.len;
		if (piece && r.kind == FAKE_DEV) {
			start = r.dev + (p - r.dev) / piece * piece;
			len = r.dev + r.len - start < piece ? r.dev + r.len - start : piece;
		}
		if (a == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)
			*(CUdeviceptr *)data = (CUdeviceptr)start;
		else
			*(size_t *)data = len;
		return CUDA_SUCCESS;
	}
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
}

/* ---- copies ------------------------------------------------------------------ */

struct ctask {
	char *dst;
	const char *src;
	uint64_t len, dpitch, spitch;
	uint64_t rows;
	struct fstream *s;
	int error;
	int d2h;  /* device to host */
};

static void run_copy(void *arg)
{
	struct ctask *t = arg;

	stream_ready(t->s);
	while (t->d2h && atomic_load(&hold_d2h))
		usleep(500);
	if (t->error) {
		/* the context's channels stop (copies running elsewhere end
		 * first), then the error is there for every call to see, and
		 * only then do records report (fake_copy_settled) */
		fake_copy_halt(0);
		if (t->s)
			t->s->err = (CUresult)atomic_load(&fault_code);
		atomic_store(&lost, atomic_load(&fault_code));
		fake_copy_report(0);
	} else if (fake_copy_begin(0)) { /* one context: device 0's queues */
		for (uint64_t r = 0; r < t->rows; r++)
			memcpy(t->dst + r * t->dpitch, t->src + r * t->spitch, t->len);
		fake_copy_end(0);
	} /* else: the context is lost, the copy never runs */
	free(t);
}

static char *resolve(uint64_t addr, uint64_t len, const char *what)
{
	const char *why = "";
	char *h = fake_translate(addr, len, &why);

	if (!h) {
		fprintf(stderr, "fake cuda: %s %#llx+%llu: %s\n", what,
			(unsigned long long)addr, (unsigned long long)len, why);
		atomic_fetch_add(&st_bad_pointer, 1);
	}
	return h;
}

static int is_dev(uint64_t addr)
{
	struct fake_region r;

	return !fake_region_find(addr, 1, &r) && r.kind == FAKE_DEV;
}

static CUresult enqueue(char *d, const char *s, uint64_t len, uint64_t rows,
			uint64_t dpitch, uint64_t spitch, CUstream stream, int d2h)
{
	struct ctask *t;

	NOT_LOST();
	if (trip(&fail_copy))
		return CUDA_ERROR_INVALID_VALUE;
	t = calloc(1, sizeof(*t));
	if (!t)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*t = (struct ctask){ .dst = d, .src = s, .len = len, .rows = rows,
			     .dpitch = dpitch, .spitch = spitch,
			     .s = stream_of(stream), .error = trip(&async_error),
			     .d2h = d2h };
	atomic_fetch_add(&st_copies, 1);
	fake_worker_push_lane(lane_of(t->s), run_copy, t);
	return CUDA_SUCCESS;
}

static CUresult f_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream st)
{
	char *d, *s;

	NEED_CTX();
	if (st && !stream_of(st))
		return CUDA_ERROR_INVALID_HANDLE;
	if (!n)
		return CUDA_SUCCESS;
	d = resolve(dst, n, "dst");
	s = d ? resolve(src, n, "src") : NULL;
	if (!d || !s)
		return CUDA_ERROR_INVALID_VALUE;
	return enqueue(d, s, n, 1, 0, 0, st, is_dev(src) && !is_dev(dst));
}

static CUresult side_2d(CUmemorytype type, const void *hostp, CUdeviceptr devp,
			uint64_t x, uint64_t y, uint64_t pitch, uint64_t w, uint64_t h,
			const char *what, char **out)
{
	uint64_t base;

	if (type == CU_MEMORYTYPE_HOST)
		base = (uint64_t)(uintptr_t)hostp;
	else if (type == CU_MEMORYTYPE_DEVICE || type == CU_MEMORYTYPE_UNIFIED)
		base = devp;
	else
		return CUDA_ERROR_INVALID_VALUE;
	if (h > 1 && pitch < x + w)
		return CUDA_ERROR_INVALID_VALUE;
	if (pitch > 2147483647u)
		return CUDA_ERROR_INVALID_VALUE;
	*out = resolve(base + y * pitch + x, (h - 1) * pitch + w, what);
	return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult f_cuMemcpy2DAsync(const CUDA_MEMCPY2D *m, CUstream st)
{
	char *d = NULL, *s = NULL;
	CUresult r;

	NEED_CTX();
	if (!m || (st && !stream_of(st)))
		return CUDA_ERROR_INVALID_VALUE;
	if (!m->WidthInBytes || !m->Height)
		return CUDA_SUCCESS;
	r = side_2d(m->dstMemoryType, m->dstHost, m->dstDevice, m->dstXInBytes, m->dstY,
		    m->dstPitch, m->WidthInBytes, m->Height, "2D dst", &d);
	if (!r)
		r = side_2d(m->srcMemoryType, m->srcHost, m->srcDevice, m->srcXInBytes, m->srcY,
			    m->srcPitch, m->WidthInBytes, m->Height, "2D src", &s);
	if (r)
		return r;
	atomic_fetch_add(&st_copy2d_calls, 1);
	return enqueue(d, s, m->WidthInBytes, m->Height, m->dstPitch, m->srcPitch, st,
		       m->srcMemoryType != CU_MEMORYTYPE_HOST && is_dev(m->srcDevice) &&
		       (m->dstMemoryType == CU_MEMORYTYPE_HOST || !is_dev(m->dstDevice)));
}

static CUresult batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
		      CUmemcpyAttributes *attrs, size_t *attr_idxs, size_t num_attrs,
		      size_t *fail_idx, CUstream st)
{
	NEED_CTX();
	if (!st || !stream_of(st)) /* the legacy NULL stream is rejected */
		return CUDA_ERROR_INVALID_VALUE;
	if (!count || !dsts || !srcs || !sizes || !attrs || !attr_idxs || !num_attrs ||
	    num_attrs > count || attr_idxs[0] != 0)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < num_attrs; i++) {
		if (attrs[i].srcAccessOrder != CU_MEMCPY_SRC_ACCESS_ORDER_STREAM &&
		    attrs[i].srcAccessOrder != CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL &&
		    attrs[i].srcAccessOrder != CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
			return CUDA_ERROR_INVALID_VALUE;
		if (i && attr_idxs[i] <= attr_idxs[i - 1])
			return CUDA_ERROR_INVALID_VALUE;
	}
	atomic_fetch_add(&st_batch_calls, 1);
	for (size_t i = 0; i < count; i++) {
		char *d = resolve(dsts[i], sizes[i], "batch dst");
		char *s = d ? resolve(srcs[i], sizes[i], "batch src") : NULL;
		CUresult r = d && s ? enqueue(d, s, sizes[i], 1, 0, 0, st,
					      is_dev(srcs[i]) && !is_dev(dsts[i]))
				    : CUDA_ERROR_INVALID_VALUE;

		if (r) {
			if (fail_idx)
				*fail_idx = i;
			return r;
		}
		atomic_fetch_add(&st_batch_copies, 1);
	}
	if (fail_idx)
		*fail_idx = SIZE_MAX;
	return CUDA_SUCCESS;
}

static CUresult f_cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
					size_t count, CUmemcpyAttributes *attrs,
					size_t *attr_idxs, size_t num_attrs, CUstream st)
{
	return batch(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, NULL, st);
}

static CUresult f_cuMemcpyBatchAsync_v1(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
					size_t count, CUmemcpyAttributes *attrs,
					size_t *attr_idxs, size_t num_attrs, size_t *fail_idx,
					CUstream st)
{
	if (!fail_idx)
		return CUDA_ERROR_INVALID_VALUE;
	return batch(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, st);
}

/* Synchronous copies with ordinary (pageable) host memory. */
static CUresult f_cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n)
{
	struct fake_region r;
	char *d;

	NEED_CTX();
	d = resolve(dst, n, "HtoD dst");
	if (!d || fake_region_find(dst, n, &r) || r.kind != FAKE_DEV)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(d, src, n);
	return CUDA_SUCCESS;
}

static CUresult f_cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n)
{
	struct fake_region r;
	char *s;

	NEED_CTX();
	s = resolve(src, n, "DtoH src");
	if (!s || fake_region_find(src, n, &r) || r.kind != FAKE_DEV)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(dst, s, n);
	return CUDA_SUCCESS;
}

static CUresult f_cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream st)
{
	char *d, *s;

	NEED_CTX();
	d = resolve(dst, n, "HtoDAsync dst");
	s = d ? resolve((uint64_t)(uintptr_t)src, n, "HtoDAsync src") : NULL;
	if (!d || !s)
		return CUDA_ERROR_INVALID_VALUE;
	return enqueue(d, s, n, 1, 0, 0, st, 0);
}

static CUresult f_cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream st)
{
	char *d, *s;

	NEED_CTX();
	d = resolve((uint64_t)(uintptr_t)dst, n, "DtoHAsync dst");
	s = d ? resolve(src, n, "DtoHAsync src") : NULL;
	if (!d || !s)
		return CUDA_ERROR_INVALID_VALUE;
	return enqueue(d, s, n, 1, 0, 0, st, 1);
}

/* ---- modules: the copy kernel ------------------------------------------------- */

/* cuModuleLoadData takes PTX text only -- what kvtier loads -- and knows one
 * kernel: kvt_copy_pages (dma/src/copy_kernel.c) as NVRTC compiles it, an
 * entry of exactly two parameters, a .u64 (the descriptors) and a .u32
 * (their count).  Other images: CUDA_ERROR_INVALID_IMAGE; other names:
 * CUDA_ERROR_NOT_FOUND.  cuLaunchKernel runs the kernel's CPU twin on the
 * stream's lane, as a copy: the descriptors are read when it runs (the GPU
 * reads them then too), every row of each copied through the fake's
 * address map; an address outside it faults as a GPU would:
 * CUDA_ERROR_ILLEGAL_ADDRESS, sticky for the context. */
#define MODULE_MAGIC 0x4d4f44554c455f5full
#define FUNC_MAGIC 0x46554e435f5f5f5full

struct fmodule;

struct ffunc {
	uint64_t magic;
	struct fmodule *mod;
};

struct fmodule {
	uint64_t magic;
	struct ffunc copy; /* its one function, as long as it lives */
};

struct kcopy { /* copy_kernel.c's struct kvt_kcopy */
	uint64_t src, dst, len, rows, spitch, dpitch;
};

static CUresult f_cuModuleLoadData(CUmodule *m, const void *image)
{
	const char *p = image;
	struct fmodule *f;

	NEED_CTX();
	if (!m || !p)
		return CUDA_ERROR_INVALID_VALUE;
	if (!strstr(p, ".version") || !strstr(p, ".target") ||
	    !strstr(p, ".entry kvt_copy_pages(") ||
	    !strstr(p, ".param .u64 kvt_copy_pages_param_0") ||
	    !strstr(p, ".param .u32 kvt_copy_pages_param_1") ||
	    strstr(p, "kvt_copy_pages_param_2"))
		return CUDA_ERROR_INVALID_IMAGE;
	f = calloc(1, sizeof(*f));
	if (!f)
		return CUDA_ERROR_OUT_OF_MEMORY;
	f->magic = MODULE_MAGIC;
	atomic_fetch_add(&st_modules_live, 1);
	*m = (CUmodule)f;
	return CUDA_SUCCESS;
}

static CUresult f_cuModuleUnload(CUmodule m)
{
	struct fmodule *f = (struct fmodule *)m;

	NEED_CTX();
	if (!f || f->magic != MODULE_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	f->magic = 0;
	f->copy.magic = 0;
	free(f);
	atomic_fetch_sub(&st_modules_live, 1);
	return CUDA_SUCCESS;
}

static CUresult f_cuModuleGetFunction(CUfunction *fn, CUmodule m, const char *name)
{
	struct fmodule *f = (struct fmodule *)m;

	NEED_CTX();
	if (!f || f->magic != MODULE_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!fn || !name)
		return CUDA_ERROR_INVALID_VALUE;
	if (strcmp(name, "kvt_copy_pages"))
		return CUDA_ERROR_NOT_FOUND;
	f->copy = (struct ffunc){ .magic = FUNC_MAGIC, .mod = f };
	*fn = (CUfunction)&f->copy;
	return CUDA_SUCCESS;
}

struct ktask {
	uint64_t desc;
	unsigned int n;
	struct fstream *s;
	int fault;
};

/* The CPU twin of kvt_copy_pages. */
static void run_copy_kernel(void *arg)
{
	struct ktask *t = arg;
	const struct kcopy *kd;
	const char *why = "";
	int bad = t->fault, d2h = 0;

	stream_ready(t->s);
	kd = (const struct kcopy *)fake_translate(t->desc, (uint64_t)t->n * sizeof(*kd), &why);
	bad |= !kd;
	if (!bad)
		d2h = !is_dev(kd[0].dst);
	while (d2h && atomic_load(&hold_d2h))
		usleep(500);
	for (unsigned int i = 0; !bad && i < t->n; i++)
		for (uint64_t r = 0; r < kd[i].rows; r++)
			if (!fake_translate(kd[i].src + r * kd[i].spitch, kd[i].len, &why) ||
			    !fake_translate(kd[i].dst + r * kd[i].dpitch, kd[i].len, &why)) {
				fprintf(stderr, "fake cuda: copy kernel descriptor %u row %llu: %s\n",
					i, (unsigned long long)r, why);
				bad = 1;
				break;
			}
	if (bad) {
		/* a kernel's fault: the context is lost, as with a failed copy
		 * (an injected one with the code fault_code sets) */
		int code = t->fault ? atomic_load(&fault_code) : CUDA_ERROR_ILLEGAL_ADDRESS;

		fake_copy_halt(0);
		if (t->s)
			t->s->err = (CUresult)code;
		atomic_store(&lost, code);
		fake_copy_report(0);
	} else if (fake_copy_begin(0)) {
		for (unsigned int i = 0; i < t->n; i++)
			for (uint64_t r = 0; r < kd[i].rows; r++)
				memcpy(fake_translate(kd[i].dst + r * kd[i].dpitch, kd[i].len, &why),
				       fake_translate(kd[i].src + r * kd[i].spitch, kd[i].len, &why),
				       kd[i].len);
		atomic_fetch_add(&st_kernel_copies, t->n);
		fake_copy_end(0);
	}
	free(t);
}

static CUresult f_cuLaunchKernel(CUfunction fn, unsigned int gx, unsigned int gy,
				 unsigned int gz, unsigned int bx, unsigned int by,
				 unsigned int bz, unsigned int shmem, CUstream st, void **params,
				 void **extra)
{
	struct ffunc *k = (struct ffunc *)fn;
	struct ktask *t;

	NEED_CTX();
	NOT_LOST();
	if (!k || k->magic != FUNC_MAGIC || !k->mod || k->mod->magic != MODULE_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	if (st && !stream_of(st))
		return CUDA_ERROR_INVALID_HANDLE;
	if (!gx || gy != 1 || gz != 1 || !bx || bx > 1024 || by != 1 || bz != 1 ||
	    shmem > 48 * 1024 || !params || extra)
		return CUDA_ERROR_INVALID_VALUE;
	/* the copies' injections hold for the kernel that does their work */
	if (trip(&fail_copy))
		return CUDA_ERROR_INVALID_VALUE;
	/* (both counters count this launch) */
	bool kf = trip(&kernel_fault), ae = trip(&async_error);

	t = calloc(1, sizeof(*t));
	if (!t)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*t = (struct ktask){ .desc = *(uint64_t *)params[0], .n = *(unsigned int *)params[1],
			     .s = stream_of(st), .fault = kf || ae };
	atomic_fetch_add(&st_kernel_launches, 1);
	fake_worker_push_lane(lane_of(t->s), run_copy_kernel, t);
	return CUDA_SUCCESS;
}

static CUresult f_cuGetErrorName(CUresult r, const char **s)
{
	switch ((int)r) {
	case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
	case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
	case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
	case CUDA_ERROR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
	case CUDA_ERROR_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; break;
	case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
	case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
	case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
	case CUDA_ERROR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
	case CUDA_ERROR_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
	case CUDA_ERROR_NOT_READY: *s = "CUDA_ERROR_NOT_READY"; break;
	case CUDA_ERROR_MAP_FAILED: *s = "CUDA_ERROR_MAP_FAILED"; break;
	case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
	case CUDA_ERROR_CONTAINED: *s = "CUDA_ERROR_CONTAINED"; break;
	case CUDA_ERROR_TENSOR_MEMORY_LEAK: *s = "CUDA_ERROR_TENSOR_MEMORY_LEAK"; break;
	case CUDA_ERROR_MPS_CLIENT_TERMINATED: *s = "CUDA_ERROR_MPS_CLIENT_TERMINATED"; break;
	case CUDA_ERROR_EXTERNAL_DEVICE: *s = "CUDA_ERROR_EXTERNAL_DEVICE"; break;
	case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
		*s = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; break;
	case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
		*s = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"; break;
	default: *s = NULL; return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

/* ---- cuGetProcAddress ---------------------------------------------------- */

struct entry {
	const char *name;
	int version;
	void *fn;
};

#define E(sym, ver, fn)                                                              \
	{ sym, ver, (void *)fn }
#define CHECK(fn, pfn) \
	_Static_assert(__builtin_types_compatible_p(__typeof__(&fn), pfn), #fn " vs " #pfn)

CHECK(f_cuInit, PFN_cuInit_v2000);
CHECK(f_cuDriverGetVersion, PFN_cuDriverGetVersion_v2020);
CHECK(f_cuDeviceGetCount, PFN_cuDeviceGetCount_v2000);
CHECK(f_cuDeviceGet, PFN_cuDeviceGet_v2000);
CHECK(f_cuDeviceGetAttribute, PFN_cuDeviceGetAttribute_v2000);
CHECK(f_cuDeviceGetName, PFN_cuDeviceGetName_v2000);
CHECK(f_cuDevicePrimaryCtxRetain, PFN_cuDevicePrimaryCtxRetain_v7000);
CHECK(f_cuDevicePrimaryCtxRelease, PFN_cuDevicePrimaryCtxRelease_v11000);
CHECK(f_cuCtxPushCurrent, PFN_cuCtxPushCurrent_v4000);
CHECK(f_cuCtxPopCurrent, PFN_cuCtxPopCurrent_v4000);
CHECK(f_cuStreamCreate, PFN_cuStreamCreate_v2000);
CHECK(f_cuStreamDestroy, PFN_cuStreamDestroy_v4000);
CHECK(f_cuStreamSynchronize, PFN_cuStreamSynchronize_v2000);
CHECK(f_cuEventCreate, PFN_cuEventCreate_v2000);
CHECK(f_cuEventDestroy, PFN_cuEventDestroy_v4000);
CHECK(f_cuEventRecord, PFN_cuEventRecord_v2000);
CHECK(f_cuEventQuery, PFN_cuEventQuery_v2000);
CHECK(f_cuEventSynchronize, PFN_cuEventSynchronize_v2000);
CHECK(f_cuMemHostRegister, PFN_cuMemHostRegister_v6050);
CHECK(f_cuMemHostUnregister, PFN_cuMemHostUnregister_v4000);
CHECK(f_cuMemHostGetDevicePointer, PFN_cuMemHostGetDevicePointer_v3020);
CHECK(f_cuMemcpyAsync, PFN_cuMemcpyAsync_v4000);
CHECK(f_cuMemcpy2DAsync, PFN_cuMemcpy2DAsync_v3020);
CHECK(f_cuMemAlloc, PFN_cuMemAlloc_v3020);
CHECK(f_cuMemFree, PFN_cuMemFree_v3020);
CHECK(f_cuMemAllocHost, PFN_cuMemAllocHost_v3020);
CHECK(f_cuMemFreeHost, PFN_cuMemFreeHost_v2000);
CHECK(f_cuMemHostAlloc, PFN_cuMemHostAlloc_v2020);
CHECK(f_cuMemcpyHtoD, PFN_cuMemcpyHtoD_v3020);
CHECK(f_cuMemcpyDtoH, PFN_cuMemcpyDtoH_v3020);
CHECK(f_cuMemcpyHtoDAsync, PFN_cuMemcpyHtoDAsync_v3020);
CHECK(f_cuMemcpyDtoHAsync, PFN_cuMemcpyDtoHAsync_v3020);
CHECK(f_cuStreamWaitEvent, PFN_cuStreamWaitEvent_v3020);
CHECK(f_cuPointerGetAttribute, PFN_cuPointerGetAttribute_v4000);
CHECK(f_cuGetErrorName, PFN_cuGetErrorName_v6000);
CHECK(f_cuModuleLoadData, PFN_cuModuleLoadData_v2000);
CHECK(f_cuModuleUnload, PFN_cuModuleUnload_v2000);
CHECK(f_cuModuleGetFunction, PFN_cuModuleGetFunction_v2000);
CHECK(f_cuLaunchKernel, PFN_cuLaunchKernel_v4000);
CHECK(f_cuMemcpyBatchAsync_v1, PFN_cuMemcpyBatchAsync_v12080);
CHECK(f_cuMemcpyBatchAsync_v2, PFN_cuMemcpyBatchAsync_v13000);
CHECK(f_cuIpcGetMemHandle, PFN_cuIpcGetMemHandle_v4010);
CHECK(f_cuIpcOpenMemHandle, PFN_cuIpcOpenMemHandle_v11000);
CHECK(f_cuIpcCloseMemHandle, PFN_cuIpcCloseMemHandle_v4010);
CHECK(f_cuIpcGetEventHandle, PFN_cuIpcGetEventHandle_v4010);
CHECK(f_cuIpcOpenEventHandle, PFN_cuIpcOpenEventHandle_v4010);
CHECK(f_cuDeviceGetUuid, PFN_cuDeviceGetUuid_v11040);
CHECK(f_cuStreamWaitValue64, PFN_cuStreamWaitValue64_v11070);
CHECK(f_cuStreamWriteValue64, PFN_cuStreamWriteValue64_v11070);

static const struct entry table[] = {
	E("cuInit", 2000, f_cuInit),
	E("cuDriverGetVersion", 2020, f_cuDriverGetVersion),
	E("cuDeviceGetCount", 2000, f_cuDeviceGetCount),
	E("cuDeviceGet", 2000, f_cuDeviceGet),
	E("cuDeviceGetAttribute", 2000, f_cuDeviceGetAttribute),
	E("cuDeviceGetName", 2000, f_cuDeviceGetName),
	E("cuDevicePrimaryCtxRetain", 7000, f_cuDevicePrimaryCtxRetain),
	E("cuDevicePrimaryCtxRelease", 11000, f_cuDevicePrimaryCtxRelease),
	E("cuCtxPushCurrent", 4000, f_cuCtxPushCurrent),
	E("cuCtxPopCurrent", 4000, f_cuCtxPopCurrent),
	E("cuStreamCreate", 2000, f_cuStreamCreate),
	E("cuStreamDestroy", 4000, f_cuStreamDestroy),
	E("cuStreamSynchronize", 2000, f_cuStreamSynchronize),
	E("cuEventCreate", 2000, f_cuEventCreate),
	E("cuEventDestroy", 4000, f_cuEventDestroy),
	E("cuEventRecord", 2000, f_cuEventRecord),
	E("cuEventQuery", 2000, f_cuEventQuery),
	E("cuEventSynchronize", 2000, f_cuEventSynchronize),
	E("cuStreamWaitEvent", 3020, f_cuStreamWaitEvent),
	E("cuMemHostRegister", 6050, f_cuMemHostRegister),
	E("cuMemHostUnregister", 4000, f_cuMemHostUnregister),
	E("cuMemHostGetDevicePointer", 3020, f_cuMemHostGetDevicePointer),
	E("cuMemcpyAsync", 4000, f_cuMemcpyAsync),
	E("cuMemcpy2DAsync", 3020, f_cuMemcpy2DAsync),
	E("cuMemAlloc", 3020, f_cuMemAlloc),
	E("cuMemFree", 3020, f_cuMemFree),
	E("cuMemAllocHost", 3020, f_cuMemAllocHost),
	E("cuMemFreeHost", 2000, f_cuMemFreeHost),
	E("cuMemHostAlloc", 2020, f_cuMemHostAlloc),
	E("cuMemcpyHtoD", 3020, f_cuMemcpyHtoD),
	E("cuMemcpyDtoH", 3020, f_cuMemcpyDtoH),
	E("cuMemcpyHtoDAsync", 3020, f_cuMemcpyHtoDAsync),
	E("cuMemcpyDtoHAsync", 3020, f_cuMemcpyDtoHAsync),
	E("cuPointerGetAttribute", 4000, f_cuPointerGetAttribute),
	E("cuGetErrorName", 6000, f_cuGetErrorName),
	E("cuModuleLoadData", 2000, f_cuModuleLoadData),
	E("cuModuleUnload", 2000, f_cuModuleUnload),
	E("cuModuleGetFunction", 2000, f_cuModuleGetFunction),
	E("cuLaunchKernel", 4000, f_cuLaunchKernel),
	E("cuMemcpyBatchAsync", 12080, f_cuMemcpyBatchAsync_v1),
	E("cuMemcpyBatchAsync", 13000, f_cuMemcpyBatchAsync_v2),
	E("cuIpcGetMemHandle", 4010, f_cuIpcGetMemHandle),
	E("cuIpcOpenMemHandle", 11000, f_cuIpcOpenMemHandle),
	E("cuIpcCloseMemHandle", 4010, f_cuIpcCloseMemHandle),
	E("cuIpcGetEventHandle", 4010, f_cuIpcGetEventHandle),
	E("cuIpcOpenEventHandle", 4010, f_cuIpcOpenEventHandle),
	E("cuDeviceGetUuid", 11040, f_cuDeviceGetUuid),
	E("cuStreamWaitValue64", 11070, f_cuStreamWaitValue64),
	E("cuStreamWriteValue64", 11070, f_cuStreamWriteValue64),
};

static int driver(void)
{
	pthread_mutex_lock(&lock);
	if (!driver_version)
		driver_version = (int)fake_env_long("FAKE_CUDA_DRIVER_VERSION", 13000);
	pthread_mutex_unlock(&lock);
	return driver_version;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
				    cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
	const struct entry *best = NULL;
	int named = 0, limit = cuda_version < driver() ? cuda_version : driver();

	if (!symbol || !pfn || flags > CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
		if (strcmp(table[i].name, symbol))
			continue;
		named = 1;
		if (table[i].version <= limit && (!best || table[i].version > best->version))
			best = &table[i];
	}
	*pfn = best ? best->fn : NULL;
	if (status)
		*status = best ? CU_GET_PROC_ADDRESS_SUCCESS
			       : named ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
				       : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	return best ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

/* cuda.h maps cuGetProcAddress to _v2; the unversioned 11.3 symbol is
 * exported too, with its own prototype. */
#undef cuGetProcAddress
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
				 cuuint64_t flags)
{
	return cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, NULL);
}
