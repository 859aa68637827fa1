/* fake_hip.c - a fake libamdhip64 for CI without a GPU, built on the HSA
 * runtime the way the real HIP is built on ROCr: it dlopens
 * libhsa-runtime64 ($KVTIER_HSA_LIBRARY in the tests: the fake HSA, the
 * same instance kvtier's hsa backend loaded) and implements, through the
 * public HSA API only, the entry points kvtier-bench uses:
 *   - hipMalloc / hipFree: the GPU's global pool (so the memory is the
 *     fake HSA's device memory: the CPU cannot touch it, hsa_amd_pointer_info
 *     knows it, and the hsa backend copies it);
 *   - hipHostMalloc / hipHostFree: the CPU pool, made accessible to the GPUs
 *     (its device address is its host address);
 *   - hipHostRegister / hipHostGetDevicePointer / hipHostUnregister: locked
 *     to the CPU pool; the device pointer differs from the host pointer, as
 *     it can on ROCm; async copies take the host pointer and translate it;
 *   - hipMemcpy / hipMemcpyAsync / hipMemsetAsync on streams whose work
 *     completes in any order (the fake HSA's lanes; nothing here needs
 *     HIP's in-stream order), hipStreamSynchronize, hipDeviceSynchronize;
 *     plain (unpinned) host memory goes through a staging buffer, as
 *     HIP's own path does.
 *   - IPC as HIP does it on ROCr: hipIpcGetMemHandle / hipIpcOpenMemHandle
 *     / hipIpcCloseMemHandle over the HSA runtime's hsa_amd_ipc_memory_*
 *     (the handle: ROCr's 32 bytes, then the allocation's size and the
 *     pointer's offset in it), hipMemGetAddressRange; hipDeviceGetUuid
 *     from the agent's HSA_AMD_AGENT_INFO_UUID as ROCm's HIP derives it
 *     (the characters after "GPU-");
 *   - events: hipEventRecord completes when the work queued on its stream
 *     before it has run (its thread waits for the stream's signal to
 *     fall to 0, so work queued after it delays it too: later, never
 *     earlier),
 *     hipStreamWaitEvent holds the stream's later work until the record
 *     made before the wait completes; hipEventInterprocess events keep
 *     their state on a shared page (process-shared mutex and condition),
 *     so a record in one process completes a wait in another; an
 *     imported event destroyed while waits on it are queued aborts the
 *     process (HIP unmaps the page they read);
 *   - kvt_fake_hip_kernel_write: a forward pass writing device memory
 *     late, on a stream;
 *   - modules (hipModuleLoadData, hipModuleGetFunction, hipModuleUnload,
 *     hipModuleLaunchKernel) for kvtier's copy kernel alone: the code
 *     object must be the real compiler's for the agent's target, its one
 *     kernel kvt_copy_pages with exactly the two parameters the CPU twin
 *     takes; the launch runs the twin on the stream (see "Modules").
 * FAKE_HIP_DEVICES=0 in the environment: hipGetDeviceCount says
 * hipErrorNoDevice (a machine without a GPU).
 */
#define __HIP_PLATFORM_AMD__ 1
#include <hip/hip_runtime_api.h>

#include "fake_common.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <elf.h>
#include <sys/mman.h>

#include <hsa/hsa.h>
#include <hsa/hsa_ext_amd.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_GPUS 8
#define MAX_REG  64

static struct {
	__typeof__(&hsa_init) init;
	__typeof__(&hsa_iterate_agents) iterate_agents;
	__typeof__(&hsa_agent_get_info) agent_get_info;
	__typeof__(&hsa_amd_agent_iterate_memory_pools) iterate_pools;
	__typeof__(&hsa_amd_memory_pool_get_info) pool_get_info;
	__typeof__(&hsa_amd_memory_pool_allocate) pool_allocate;
	__typeof__(&hsa_amd_memory_pool_free) pool_free;
	__typeof__(&hsa_amd_agents_allow_access) allow_access;
	__typeof__(&hsa_amd_memory_lock_to_pool) lock_to_pool;
	__typeof__(&hsa_amd_memory_unlock) unlock;
	__typeof__(&hsa_amd_memory_async_copy) async_copy;
	__typeof__(&hsa_amd_pointer_info) pointer_info;
	__typeof__(&hsa_signal_create) signal_create;
	__typeof__(&hsa_signal_destroy) signal_destroy;
	__typeof__(&hsa_signal_add_screlease) signal_add;
	__typeof__(&hsa_signal_subtract_screlease) signal_subtract;
	__typeof__(&hsa_signal_wait_scacquire) signal_wait;
	__typeof__(&hsa_signal_load_scacquire) signal_load;
	__typeof__(&hsa_agent_iterate_isas) iterate_isas;
	__typeof__(&hsa_isa_get_info_alt) isa_get_info;
	__typeof__(&hsa_amd_ipc_memory_create) ipc_create;
	__typeof__(&hsa_amd_ipc_memory_attach) ipc_attach;
	__typeof__(&hsa_amd_ipc_memory_detach) ipc_detach;
	/* the fake HSA's compute lane, for fills (optional) */
	hsa_status_t (*kernel_copy)(void *, hsa_agent_t, const void *, hsa_agent_t, size_t,
				    hsa_signal_t);
	long (*hsa_stat)(const char *); /* its "queues_dead" (optional) */
} F;

static pthread_once_t once = PTHREAD_ONCE_INIT;
static hipError_t init_err = hipSuccess;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static hsa_agent_t cpu, gpus[MAX_GPUS];
static hsa_amd_memory_pool_t cpu_pool, gpu_pool[MAX_GPUS];
static int n_gpus, have_cpu_pool;
static __thread int cur; /* the current device: HIP's is per thread */

/* registered host ranges: host -> the runtime's device pointer */
static struct { char *host; void *dev; size_t len; } regs[MAX_REG];

/* a stream: one signal counting the copies in flight (they complete in
 * any order, on the fake HSA's lanes; a synchronize waits for all), and
 * the staging buffers and threads of its fills, freed and joined at the
 * synchronize: no fill thread outlives it, so none runs in a library the
 * process unloaded after it */
#define MAX_FILLS 64
struct op_thread {
	pthread_t th;
	void *stage;             /* freed when joined */
	void *(*fn)(void *);
	void *arg;
	atomic_int done;
};

struct ihipStream_t {
	hsa_signal_t sig;
	atomic_long kernels;     /* copy kernels queued, not finished ("Modules") */
	struct op_thread *th[MAX_FILLS];
	int n_fills;
	pthread_mutex_t mu;      /* th, n_fills: HIP's calls are thread safe */
	struct ihipStream_t *next; /* the streams alive (streams_mu) */
};
static struct ihipStream_t null_stream = { .mu = PTHREAD_MUTEX_INITIALIZER };
/* every stream alive, for the exit's joins (fini) */
static pthread_mutex_t streams_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ihipStream_t *streams = &null_stream;

static hsa_status_t pool_cb(hsa_amd_memory_pool_t p, void *data)
{
	hsa_amd_memory_pool_t *out = data;
	hsa_amd_segment_t seg;
	bool alloc = false;

	if (F.pool_get_info(p, HSA_AMD_MEMORY_POOL_INFO_SEGMENT, &seg) || seg != HSA_AMD_SEGMENT_GLOBAL)
		return HSA_STATUS_SUCCESS;
	if (F.pool_get_info(p, HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED, &alloc) || !alloc)
		return HSA_STATUS_SUCCESS;
	*out = p;
	return HSA_STATUS_INFO_BREAK;
}

static hsa_status_t agent_cb(hsa_agent_t a, void *data)
{
	hsa_device_type_t t;
	(void)data;

	if (F.agent_get_info(a, HSA_AGENT_INFO_DEVICE, &t))
		return HSA_STATUS_SUCCESS;
	if (t == HSA_DEVICE_TYPE_CPU && !have_cpu_pool) {
		cpu = a;
		have_cpu_pool = F.iterate_pools(a, pool_cb, &cpu_pool) == HSA_STATUS_INFO_BREAK;
	} else if (t == HSA_DEVICE_TYPE_GPU && n_gpus < MAX_GPUS) {
		if (F.iterate_pools(a, pool_cb, &gpu_pool[n_gpus]) == HSA_STATUS_INFO_BREAK)
			gpus[n_gpus++] = a;
	}
	return HSA_STATUS_SUCCESS;
}

static void init_once(void)
{
	const char *path = getenv("KVTIER_HSA_LIBRARY");
	void *h = dlopen(path && *path ? path : "libhsa-runtime64.so.1", RTLD_NOW | RTLD_LOCAL);
	const char *dev = getenv("FAKE_HIP_DEVICES");

	if (!h) {
		init_err = hipErrorInitializationError;
		return;
	}
#define L(f, n) if (!(*(void **)&F.f = dlsym(h, n))) { init_err = hipErrorInitializationError; return; }
	L(init, "hsa_init") L(iterate_agents, "hsa_iterate_agents")
	L(agent_get_info, "hsa_agent_get_info") L(iterate_pools, "hsa_amd_agent_iterate_memory_pools")
	L(pool_get_info, "hsa_amd_memory_pool_get_info")
	L(pool_allocate, "hsa_amd_memory_pool_allocate") L(pool_free, "hsa_amd_memory_pool_free")
	L(allow_access, "hsa_amd_agents_allow_access") L(lock_to_pool, "hsa_amd_memory_lock_to_pool")
	L(unlock, "hsa_amd_memory_unlock") L(async_copy, "hsa_amd_memory_async_copy")
	L(pointer_info, "hsa_amd_pointer_info")
	L(signal_create, "hsa_signal_create") L(signal_destroy, "hsa_signal_destroy")
	L(signal_add, "hsa_signal_add_screlease") L(signal_subtract, "hsa_signal_subtract_screlease")
	L(signal_wait, "hsa_signal_wait_scacquire") L(signal_load, "hsa_signal_load_scacquire")
	L(iterate_isas, "hsa_agent_iterate_isas") L(isa_get_info, "hsa_isa_get_info_alt")
	L(ipc_create, "hsa_amd_ipc_memory_create") L(ipc_attach, "hsa_amd_ipc_memory_attach")
	L(ipc_detach, "hsa_amd_ipc_memory_detach")
#undef L
	*(void **)&F.kernel_copy = dlsym(h, "kvt_fake_hsa_kernel_copy");
	*(void **)&F.hsa_stat = dlsym(h, "kvt_fake_hsa_stat");
	if (F.init() || F.iterate_agents(agent_cb, NULL) || !have_cpu_pool) {
		init_err = hipErrorInitializationError;
		return;
	}
	if (dev && atoi(dev) == 0)
		n_gpus = 0;
	if (F.signal_create(0, 0, NULL, &null_stream.sig))
		init_err = hipErrorInitializationError;
}

/* The runtime's own resources go with the library (LeakSanitizer), and
 * the finished threads of streams never synchronized -- those of a DMA
 * handle its process abandoned (kvt_dma_close_within) -- are joined
 * (ThreadSanitizer's thread leaks). */
__attribute__((destructor)) static void fini(void)
{
	pthread_mutex_lock(&streams_mu);
	for (struct ihipStream_t *st = streams; st; st = st->next) {
		int k = 0;

		pthread_mutex_lock(&st->mu);
		for (int i = 0; i < st->n_fills; i++) {
			struct op_thread *t = st->th[i];

			if (!atomic_load(&t->done) || t->stage) { /* (a stage is the
								    * runtime's memory) */
				st->th[k++] = t;
				continue;
			}
			pthread_join(t->th, NULL);
			free(t);
		}
		st->n_fills = k;
		pthread_mutex_unlock(&st->mu);
	}
	pthread_mutex_unlock(&streams_mu);
	if (null_stream.sig.handle && F.signal_destroy)
		F.signal_destroy(null_stream.sig);
	null_stream.sig.handle = 0;
}

static hipError_t ready(void)
{
	pthread_once(&once, init_once);
	return init_err;
}

EXPORT const char *hipGetErrorString(hipError_t e)
{
	switch (e) {
	case hipSuccess: return "hipSuccess (fake)";
	case hipErrorNoDevice: return "hipErrorNoDevice (fake)";
	case hipErrorInvalidValue: return "hipErrorInvalidValue (fake)";
	case hipErrorOutOfMemory: return "hipErrorOutOfMemory (fake)";
	case hipErrorInvalidDevice: return "hipErrorInvalidDevice (fake)";
	case hipErrorInvalidImage: return "hipErrorInvalidImage (fake)";
	case hipErrorNoBinaryForGpu: return "hipErrorNoBinaryForGpu (fake)";
	case hipErrorNotFound: return "hipErrorNotFound (fake)";
	case hipErrorNotReady: return "hipErrorNotReady (fake)";
	default: return "hip error (fake)";
	}
}

EXPORT hipError_t hipGetDeviceCount(int *count)
{
	hipError_t e = ready();

	*count = 0;
	if (e)
		return e;
	*count = n_gpus;
	return n_gpus ? hipSuccess : hipErrorNoDevice;
}

EXPORT hipError_t hipSetDevice(int d)
{
	hipError_t e = ready();

	if (e)
		return e;
	if (d < 0 || d >= n_gpus)
		return hipErrorInvalidDevice;
	cur = d;
	return hipSuccess;
}

EXPORT hipError_t hipGetDevice(int *d)
{
	hipError_t e = ready();

	if (e)
		return e;
	if (!d)
		return hipErrorInvalidValue;
	*d = cur;
	return hipSuccess;
}

EXPORT hipError_t hipDeviceGetName(char *name, int len, hipDevice_t d)
{
	if (ready() || d < 0 || d >= n_gpus || len <= 0)
		return hipErrorInvalidDevice;
	snprintf(name, (size_t)len, "fake AMD GPU %d (HIP on the fake HSA)", (int)d);
	return hipSuccess;
}

EXPORT hipError_t hipRuntimeGetVersion(int *v)
{
	*v = 50221153; /* as ROCm 5.2.3's HIP reports itself */
	return hipSuccess;
}

EXPORT hipError_t hipMalloc(void **p, size_t n)
{
	hipError_t e = ready();

	if (e)
		return e;
	if (!n_gpus)
		return hipErrorNoDevice;
	return F.pool_allocate(gpu_pool[cur], n, 0, p) ? hipErrorOutOfMemory : hipSuccess;
}

EXPORT hipError_t hipFree(void *p)
{
	if (!p)
		return hipSuccess;
	return F.pool_free(p) ? hipErrorInvalidValue : hipSuccess;
}

EXPORT hipError_t hipHostMalloc(void **p, size_t n, unsigned int flags)
{
	hipError_t e = ready();
	(void)flags;

	if (e)
		return e;
	if (F.pool_allocate(cpu_pool, n, 0, p))
		return hipErrorOutOfMemory;
	if (n_gpus && F.allow_access((uint32_t)n_gpus, gpus, NULL, *p)) {
		F.pool_free(*p);
		return hipErrorOutOfMemory;
	}
	return hipSuccess;
}

EXPORT hipError_t hipHostFree(void *p)
{
	return hipFree(p);
}

EXPORT hipError_t hipHostRegister(void *host, size_t n, unsigned int flags)
{
	hipError_t e = ready();
	void *dev = NULL;
	(void)flags;

	if (e)
		return e;
	pthread_mutex_lock(&lock);
	for (int i = 0; i < MAX_REG; i++) {
		if (regs[i].host)
			continue;
		if (F.lock_to_pool(host, n, gpus, (int)n_gpus, cpu_pool, 0, &dev)) {
			pthread_mutex_unlock(&lock);
			return hipErrorOutOfMemory;
		}
		regs[i].host = host;
		regs[i].dev = dev;
		regs[i].len = n;
		pthread_mutex_unlock(&lock);
		return hipSuccess;
	}
	pthread_mutex_unlock(&lock);
	return hipErrorOutOfMemory;
}

EXPORT hipError_t hipHostUnregister(void *host)
{
	pthread_mutex_lock(&lock);
	for (int i = 0; i < MAX_REG; i++)
		if (regs[i].host == host) {
			F.unlock(host);
			regs[i].host = NULL;
			pthread_mutex_unlock(&lock);
			return hipSuccess;
		}
	pthread_mutex_unlock(&lock);
	return hipErrorInvalidValue;
}

/* The device view of a registered host address, or NULL. */
static void *registered(const void *host, size_t n)
{
	void *r = NULL;

	pthread_mutex_lock(&lock);
	for (int i = 0; i < MAX_REG; i++)
		if (regs[i].host && (const char *)host >= regs[i].host &&
		    (const char *)host + n <= regs[i].host + regs[i].len)
			r = (char *)regs[i].dev + ((const char *)host - regs[i].host);
	pthread_mutex_unlock(&lock);
	return r;
}

EXPORT hipError_t hipHostGetDevicePointer(void **dev, void *host, unsigned int flags)
{
	void *r = registered(host, 1);
	(void)flags;

	if (!r) {
		hsa_amd_pointer_info_t info = { .size = sizeof(info) };
		if (F.pointer_info(host, &info, NULL, NULL, NULL) ||
		    info.type == HSA_EXT_POINTER_TYPE_UNKNOWN)
			return hipErrorInvalidValue;
		r = host; /* hipHostMalloc'ed: one address */
	}
	*dev = r;
	return hipSuccess;
}

EXPORT hipError_t hipStreamCreate(hipStream_t *s)
{
	hipError_t e = ready();
	struct ihipStream_t *st;

	if (e)
		return e;
	st = calloc(1, sizeof(*st));
	if (!st || F.signal_create(0, 0, NULL, &st->sig)) {
		free(st);
		return hipErrorOutOfMemory;
	}
	pthread_mutex_init(&st->mu, NULL);
	pthread_mutex_lock(&streams_mu);
	st->next = streams;
	streams = st;
	pthread_mutex_unlock(&streams_mu);
	*s = st;
	return hipSuccess;
}

/* the stream's threads joined (under its mu) */
static void join_all(struct ihipStream_t *st)
{
	while (st->n_fills) {
		struct op_thread *t = st->th[--st->n_fills];

		pthread_join(t->th, NULL);
		hipHostFree(t->stage);
		free(t);
	}
}

EXPORT hipError_t hipStreamSynchronize(hipStream_t s)
{
	struct ihipStream_t *st = s ? s : &null_stream;
	hsa_signal_value_t v = F.signal_wait(st->sig, HSA_SIGNAL_CONDITION_LT, 1, UINT64_MAX,
					     HSA_WAIT_STATE_BLOCKED);

	pthread_mutex_lock(&st->mu);
	join_all(st);
	pthread_mutex_unlock(&st->mu);
	return v < 0 ? hipErrorUnknown : hipSuccess;
}

EXPORT hipError_t hipStreamDestroy(hipStream_t s)
{
	if (!s)
		return hipErrorInvalidValue;
	hipStreamSynchronize(s);
	pthread_mutex_lock(&streams_mu);
	for (struct ihipStream_t **pp = &streams; *pp; pp = &(*pp)->next)
		if (*pp == s) {
			*pp = s->next;
			break;
		}
	pthread_mutex_unlock(&streams_mu);
	F.signal_destroy(s->sig);
	pthread_mutex_destroy(&s->mu);
	free(s);
	return hipSuccess;
}

EXPORT hipError_t hipDeviceSynchronize(void)
{
	return ready() ? init_err : hipStreamSynchronize(NULL);
}

/* An address and agent the runtime can copy with: device memory and
 * hipHostMalloc'ed memory as they are, registered host memory through its
 * device pointer; NULL for plain host memory. */
static void *copyable(const void *p, size_t n, hsa_agent_t *agent)
{
	hsa_amd_pointer_info_t info = { .size = sizeof(info) };
	void *r = registered(p, n);

	if (r) {
		*agent = cpu;
		return r;
	}
	if (F.pointer_info(p, &info, NULL, NULL, NULL) || info.type == HSA_EXT_POINTER_TYPE_UNKNOWN)
		return NULL;
	*agent = info.agentOwner.handle ? info.agentOwner : cpu;
	return (void *)p;
}

static hipError_t copy(void *dst, const void *src, size_t n, struct ihipStream_t *st)
{
	hsa_agent_t da, sa;
	void *d = copyable(dst, n, &da), *s = copyable(src, n, &sa);

	if (!d || !s)
		return hipErrorInvalidValue; /* the caller stages plain host memory */
	F.signal_add(st->sig, 1);
	if (F.async_copy(d, da, s, sa, n, 0, NULL, st->sig)) {
		F.signal_subtract(st->sig, 1);
		return hipErrorInvalidValue;
	}
	return hipSuccess;
}

EXPORT hipError_t hipMemcpyAsync(void *dst, const void *src, size_t n, hipMemcpyKind kind,
				 hipStream_t s)
{
	hipError_t e = ready();
	(void)kind;

	return e ? e : copy(dst, src, n, s ? s : &null_stream);
}

/* A fill is a kernel on the stream: it lands late, after FAKE_HIP_FILL_US
 * (default 20 ms; a GPU fills hundreds of MB in milliseconds), from its
 * own thread, as a copy from a staging buffer of the byte.  The stream's
 * signal counts it from the call, so a synchronize waits for it; a copy
 * on another queue that does not wait reads the bytes before it. */
static long fake_env_long_hip(const char *name, long dflt)
{
	const char *v = getenv(name);

	return v && *v ? strtol(v, NULL, 0) : dflt;
}

struct fill {
	void *dst, *stage;
	hsa_agent_t agent;
	size_t n;
	struct ihipStream_t *st;
	unsigned delay_us;
};

static void *run_fill(void *arg)
{
	struct fill *fl = arg;

	usleep(fl->delay_us);
	/* a kernel: on the GPU's compute lane where the fake HSA has one */
	if (F.kernel_copy ? F.kernel_copy(fl->dst, fl->agent, fl->stage, cpu, fl->n, fl->st->sig)
			  : F.async_copy(fl->dst, fl->agent, fl->stage, cpu, fl->n, 0, NULL,
					 fl->st->sig))
		F.signal_subtract(fl->st->sig, 1);
	free(fl);
	return NULL;
}

/* A thread doing a piece of the stream's work, joined at its synchronize
 * or, finished, when the stream's table is full (its staging buffer, if
 * any, freed then; none finished: the stream is synchronized).  counted:
 * the work holds the stream's later work (its signal counts it from here;
 * the thread subtracts it). */
static void *op_run(void *arg)
{
	struct op_thread *t = arg;
	void *r = t->fn(t->arg);

	atomic_store(&t->done, 1);
	return r;
}

static hipError_t stream_thread(struct ihipStream_t *st, void *(*fn)(void *), void *arg,
				void *stage, int counted)
{
	struct op_thread *t;
	int k = 0;

	pthread_mutex_lock(&st->mu);
	for (int i = 0; st->n_fills == MAX_FILLS && i < st->n_fills; i++) {
		t = st->th[i];
		if (!atomic_load(&t->done)) {
			st->th[k++] = t;
			continue;
		}
		pthread_join(t->th, NULL);
		hipHostFree(t->stage);
		free(t);
	}
	if (st->n_fills == MAX_FILLS)
		st->n_fills = k;
	if (st->n_fills == MAX_FILLS) { /* none finished: the stream drained */
		F.signal_wait(st->sig, HSA_SIGNAL_CONDITION_LT, 1, UINT64_MAX,
			      HSA_WAIT_STATE_BLOCKED);
		join_all(st);
	}
	t = calloc(1, sizeof(*t));
	if (!t) {
		pthread_mutex_unlock(&st->mu);
		return hipErrorOutOfMemory;
	}
	*t = (struct op_thread){ .stage = stage, .fn = fn, .arg = arg };
	if (counted)
		F.signal_add(st->sig, 1);
	if (pthread_create(&t->th, NULL, op_run, t)) {
		if (counted)
			F.signal_subtract(st->sig, 1);
		free(t);
		pthread_mutex_unlock(&st->mu);
		return hipErrorOutOfMemory;
	}
	st->th[st->n_fills++] = t;
	pthread_mutex_unlock(&st->mu);
	return hipSuccess;
}

static hipError_t fill_async(void *dst, int value, size_t n, struct ihipStream_t *st,
			     unsigned delay_us)
{
	hipError_t e = ready();
	struct fill *fl;
	void *d, *stage = NULL;

	if (e)
		return e;
	fl = calloc(1, sizeof(*fl));
	if (!fl)
		return hipErrorOutOfMemory;
	d = copyable(dst, n, &fl->agent);
	if (!d || (e = hipHostMalloc(&stage, n, 0))) {
		free(fl);
		return d ? e : hipErrorInvalidValue;
	}
	memset(stage, value, n);
	*fl = (struct fill){ .dst = d, .stage = stage, .agent = fl->agent, .n = n, .st = st,
			     .delay_us = delay_us };
	if ((e = stream_thread(st, run_fill, fl, stage, 1))) {
		hipHostFree(stage);
		free(fl);
	}
	return e;
}

EXPORT hipError_t hipMemsetAsync(void *dst, int value, size_t n, hipStream_t s)
{
	return fill_async(dst, value, n, s ? s : &null_stream,
			  (unsigned)fake_env_long_hip("FAKE_HIP_FILL_US", 20000));
}

/* A forward pass writing n bytes of `byte` at dev, delay_us late, on the
 * stream (tests/lmcache's engines). */
EXPORT int kvt_fake_hip_kernel_write(hipStream_t s, void *dev, int byte, size_t n,
				     unsigned delay_us)
{
	return (int)fill_async(dev, byte, n, s ? s : &null_stream, delay_us);
}

/* hipStreamWriteValue64: the value lands in ptr once the work queued on the
 * stream before it has run -- as the GPU's write packet does -- from a
 * thread that waits for the stream's signal to fall to 0, then stores it;
 * joined at the synchronize, with the fills. */
struct write_value {
	struct ihipStream_t *st;
	int64_t *ptr;
	int64_t value;
};

static void *run_write_value(void *arg)
{
	struct write_value *w = arg;

	F.signal_wait(w->st->sig, HSA_SIGNAL_CONDITION_LT, 1, UINT64_MAX, HSA_WAIT_STATE_BLOCKED);
	__atomic_store_n(w->ptr, w->value, __ATOMIC_RELEASE);
	free(w);
	return NULL;
}

EXPORT hipError_t hipStreamWriteValue64(hipStream_t s, void *ptr, uint64_t value,
					unsigned int flags)
{
	struct ihipStream_t *st = s ? s : &null_stream;
	hipError_t e = ready();
	struct write_value *w;

	if (e)
		return e;
	if (!ptr || (uintptr_t)ptr % 8 || flags)
		return hipErrorInvalidValue;
	w = malloc(sizeof(*w));
	if (!w)
		return hipErrorOutOfMemory;
	*w = (struct write_value){ .st = st, .ptr = ptr, .value = (int64_t)value };
	if ((e = stream_thread(st, run_write_value, w, NULL, 0)))
		free(w);
	return e;
}

EXPORT hipError_t hipMemcpy(void *dst, const void *src, size_t n, hipMemcpyKind kind)
{
	hsa_agent_t a;
	hipError_t e = ready();
	void *stage = NULL;
	int to_dev = kind == hipMemcpyHostToDevice;

	if (e)
		return e;
	if ((to_dev && !copyable(src, n, &a)) || (kind == hipMemcpyDeviceToHost && !copyable(dst, n, &a))) {
		/* plain host memory: through pinned staging, as HIP does */
		if ((e = hipHostMalloc(&stage, n, 0)))
			return e;
		if (to_dev)
			memcpy(stage, src, n);
		e = copy(to_dev ? dst : stage, to_dev ? stage : src, n, &null_stream);
		if (!e)
			e = hipStreamSynchronize(NULL);
		if (!e && !to_dev)
			memcpy(dst, stage, n);
		hipHostFree(stage);
		return e;
	}
	e = copy(dst, src, n, &null_stream);
	return e ? e : hipStreamSynchronize(NULL);
}

EXPORT hipError_t hipStreamCreateWithFlags(hipStream_t *s, unsigned int flags)
{
	if (flags & ~(unsigned)hipStreamNonBlocking)
		return hipErrorInvalidValue;
	return hipStreamCreate(s);
}

/* ---- devices and IPC memory ------------------------------------------------ */

EXPORT hipError_t hipDeviceGetUuid(hipUUID *uuid, hipDevice_t d)
{
	char s[32] = { 0 };

	if (ready() || d < 0 || d >= n_gpus)
		return hipErrorInvalidDevice;
	if (!uuid)
		return hipErrorInvalidValue;
	if (F.agent_get_info(gpus[d], (hsa_agent_info_t)HSA_AMD_AGENT_INFO_UUID, s) ||
	    strncmp(s, "GPU-", 4))
		return hipErrorInvalidDevice;
	memset(uuid->bytes, 0, sizeof(uuid->bytes));
	memcpy(uuid->bytes, s + 4, strnlen(s + 4, sizeof(uuid->bytes)));
	return hipSuccess;
}

EXPORT hipError_t hipMemGetAddressRange(hipDeviceptr_t *base, size_t *size, hipDeviceptr_t p)
{
	hsa_amd_pointer_info_t info = { .size = sizeof(info) };
	hipError_t e = ready();

	if (e)
		return e;
	if (F.pointer_info(p, &info, NULL, NULL, NULL) || info.type == HSA_EXT_POINTER_TYPE_UNKNOWN)
		return hipErrorNotFound;
	if (base)
		*base = info.agentBaseAddress;
	if (size)
		*size = info.sizeInBytes;
	return hipSuccess;
}

/* What HIP puts in a hipIpcMemHandle_t (its layout, not ours to rely on
 * elsewhere): ROCr's handle, the allocation's size, the pointer's offset */
struct ipc_mem_wire {
	hsa_amd_ipc_memory_t h;
	uint64_t size, offset;
};
_Static_assert(sizeof(struct ipc_mem_wire) <= sizeof(hipIpcMemHandle_t), "a handle's bytes");

EXPORT hipError_t hipIpcGetMemHandle(hipIpcMemHandle_t *handle, void *p)
{
	hsa_amd_pointer_info_t info = { .size = sizeof(info) };
	struct ipc_mem_wire w;
	hipError_t e = ready();

	if (e)
		return e;
	if (!handle || F.pointer_info(p, &info, NULL, NULL, NULL) ||
	    info.type != HSA_EXT_POINTER_TYPE_HSA || !info.agentOwner.handle)
		return hipErrorInvalidValue;
	memset(&w, 0, sizeof(w));
	if (F.ipc_create(info.agentBaseAddress, info.sizeInBytes, &w.h))
		return hipErrorInvalidValue;
	w.size = info.sizeInBytes;
	w.offset = (uint64_t)((char *)p - (char *)info.agentBaseAddress);
	memset(handle, 0, sizeof(*handle));
	memcpy(handle->reserved, &w, sizeof(w));
	return hipSuccess;
}

EXPORT hipError_t hipIpcOpenMemHandle(void **p, hipIpcMemHandle_t handle, unsigned int flags)
{
	struct ipc_mem_wire w;
	void *base = NULL;
	hipError_t e = ready();

	if (e)
		return e;
	if (!p || flags != 1 /* hipIpcMemLazyEnablePeerAccess, ROCm 6 */ || !n_gpus)
		return hipErrorInvalidValue;
	memcpy(&w, handle.reserved, sizeof(w));
	if (w.offset >= w.size || F.ipc_attach(&w.h, w.size, 1, &gpus[cur], &base))
		return hipErrorInvalidHandle;
	*p = (char *)base + w.offset;
	return hipSuccess;
}

EXPORT hipError_t hipIpcCloseMemHandle(void *p)
{
	hsa_amd_pointer_info_t info = { .size = sizeof(info) };

	if (ready() || F.pointer_info(p, &info, NULL, NULL, NULL))
		return hipErrorInvalidValue;
	return F.ipc_detach(info.agentBaseAddress) ? hipErrorInvalidValue : hipSuccess;
}

/* ---- events ---------------------------------------------------------------- */

#define EVENT_MAGIC 0x4b56544849504556ull
#define EVENT_PAGE  4096
#define IPC_EVENT_MAGIC 0x4b56545048495045ull

/* an event's state: on a page of its own, shared, for an interprocess one */
struct event_state {
	uint64_t magic;
	pthread_mutex_t m;
	pthread_cond_t c;
	uint64_t issued, reached; /* records made, the latest record reached */
};

/* refs: the handle's, and one per queued record or wait */
struct ihipEvent_t {
	uint64_t magic;
	struct event_state *s;
	int fd;       /* an interprocess event's memfd (its exporter), or -1 */
	int imported; /* s maps another process's page */
	atomic_int refs;
};

struct ipc_event_wire {
	uint64_t magic;
	int32_t pid, fd;
};
_Static_assert(sizeof(struct ipc_event_wire) <= sizeof(hipIpcEventHandle_t), "a handle's bytes");

static struct ihipEvent_t *event_ref(hipEvent_t e)
{
	if (!e || e->magic != EVENT_MAGIC)
		return NULL;
	atomic_fetch_add(&e->refs, 1);
	return e;
}

static void event_put(struct ihipEvent_t *e)
{
	if (atomic_fetch_sub(&e->refs, 1) != 1)
		return;
	e->magic = 0;
	if (e->imported || e->fd >= 0) { /* importers keep their own mapping */
		if (e->fd >= 0)
			close(e->fd);
		munmap(e->s, EVENT_PAGE);
	} else {
		pthread_mutex_destroy(&e->s->m);
		pthread_cond_destroy(&e->s->c);
		free(e->s);
	}
	free(e);
}

EXPORT hipError_t hipEventCreateWithFlags(hipEvent_t *out, unsigned flags)
{
	struct ihipEvent_t *e;
	hipError_t r = ready();

	if (r)
		return r;
	if (!out || (flags & ~(unsigned)(hipEventDisableTiming | hipEventInterprocess |
					 hipEventBlockingSync)))
		return hipErrorInvalidValue;
	if ((flags & hipEventInterprocess) && !(flags & hipEventDisableTiming))
		return hipErrorInvalidValue; /* as HIP asks */
	e = calloc(1, sizeof(*e));
	if (!e)
		return hipErrorOutOfMemory;
	e->fd = -1;
	if (flags & hipEventInterprocess) {
		e->s = fake_shared_page(EVENT_PAGE, &e->fd, offsetof(struct event_state, m),
					offsetof(struct event_state, c));
		if (!e->s) {
			free(e);
			return hipErrorOutOfMemory;
		}
	} else {
		e->s = calloc(1, sizeof(*e->s));
		if (!e->s) {
			free(e);
			return hipErrorOutOfMemory;
		}
		pthread_mutex_init(&e->s->m, NULL);
		pthread_cond_init(&e->s->c, NULL);
	}
	e->s->magic = IPC_EVENT_MAGIC;
	e->magic = EVENT_MAGIC;
	atomic_init(&e->refs, 1);
	*out = e;
	return hipSuccess;
}

EXPORT hipError_t hipEventCreate(hipEvent_t *out)
{
	return hipEventCreateWithFlags(out, 0);
}

EXPORT hipError_t hipEventDestroy(hipEvent_t e)
{
	if (!e || e->magic != EVENT_MAGIC)
		return hipErrorInvalidHandle;
	if (e->imported && atomic_load(&e->refs) > 1) {
		/* HIP's IPC event wait reads the exporter's shared page, which
		 * destroying the import unmaps: as a crash would say it */
		fprintf(stderr, "fake HIP: an imported IPC event destroyed with %d wait(s) still "
			"queued on it (HIP unmaps its page under them)\n",
			atomic_load(&e->refs) - 1);
		abort();
	}
	event_put(e); /* after the records and waits queued on it */
	return hipSuccess;
}

struct event_op {
	struct ihipStream_t *st;
	struct ihipEvent_t *e;
	uint64_t target;
};

/* a record: reached once the stream's work before it has run */
static void *run_record(void *arg)
{
	struct event_op *op = arg;
	struct event_state *s = op->e->s;

	F.signal_wait(op->st->sig, HSA_SIGNAL_CONDITION_LT, 1, UINT64_MAX, HSA_WAIT_STATE_BLOCKED);
	pthread_mutex_lock(&s->m);
	if (s->reached < op->target)
		s->reached = op->target;
	pthread_cond_broadcast(&s->c);
	pthread_mutex_unlock(&s->m);
	event_put(op->e);
	free(op);
	return NULL;
}

EXPORT hipError_t hipEventRecord(hipEvent_t ev, hipStream_t s)
{
	struct ihipStream_t *st = s ? s : &null_stream;
	struct event_op *op;
	hipError_t r = ready();

	if (r)
		return r;
	if (!ev || ev->magic != EVENT_MAGIC || ev->imported)
		return hipErrorInvalidHandle; /* an import is only waited on */
	op = malloc(sizeof(*op));
	if (!op)
		return hipErrorOutOfMemory;
	pthread_mutex_lock(&ev->s->m);
	op->target = ++ev->s->issued;
	pthread_mutex_unlock(&ev->s->m);
	op->st = st;
	op->e = event_ref(ev);
	if ((r = stream_thread(st, run_record, op, NULL, 0))) {
		/* never to be reached: the waits on it must not wait for it */
		pthread_mutex_lock(&ev->s->m);
		if (ev->s->reached < op->target)
			ev->s->reached = op->target;
		pthread_cond_broadcast(&ev->s->c);
		pthread_mutex_unlock(&ev->s->m);
		event_put(op->e);
		free(op);
	}
	return r;
}

static void event_wait(struct event_state *s, uint64_t target)
{
	pthread_mutex_lock(&s->m);
	while (s->reached < target)
		pthread_cond_wait(&s->c, &s->m);
	pthread_mutex_unlock(&s->m);
}

EXPORT hipError_t hipEventSynchronize(hipEvent_t e)
{
	uint64_t target;

	if (!e || e->magic != EVENT_MAGIC)
		return hipErrorInvalidHandle;
	pthread_mutex_lock(&e->s->m);
	target = e->s->issued;
	pthread_mutex_unlock(&e->s->m);
	event_wait(e->s, target);
	return hipSuccess;
}

EXPORT hipError_t hipEventQuery(hipEvent_t e)
{
	hipError_t r;

	if (!e || e->magic != EVENT_MAGIC)
		return hipErrorInvalidHandle;
	pthread_mutex_lock(&e->s->m);
	r = e->s->reached >= e->s->issued ? hipSuccess : hipErrorNotReady;
	pthread_mutex_unlock(&e->s->m);
	return r;
}

/* a wait: the stream's later work held until the record made before it */
static void *run_wait(void *arg)
{
	struct event_op *op = arg;

	event_wait(op->e->s, op->target);
	F.signal_subtract(op->st->sig, 1);
	event_put(op->e);
	free(op);
	return NULL;
}

EXPORT hipError_t hipStreamWaitEvent(hipStream_t s, hipEvent_t ev, unsigned int flags)
{
	struct ihipStream_t *st = s ? s : &null_stream;
	struct event_op *op;
	hipError_t r = ready();

	if (r)
		return r;
	if (!ev || ev->magic != EVENT_MAGIC || flags)
		return hipErrorInvalidHandle;
	op = malloc(sizeof(*op));
	if (!op)
		return hipErrorOutOfMemory;
	pthread_mutex_lock(&ev->s->m);
	op->target = ev->s->issued;
	pthread_mutex_unlock(&ev->s->m);
	op->st = st;
	op->e = event_ref(ev);
	if ((r = stream_thread(st, run_wait, op, NULL, 1))) {
		event_put(op->e);
		free(op);
	}
	return r;
}

EXPORT hipError_t hipIpcGetEventHandle(hipIpcEventHandle_t *h, hipEvent_t e)
{
	struct ipc_event_wire w = { .magic = IPC_EVENT_MAGIC, .pid = getpid() };

	if (!h)
		return hipErrorInvalidValue;
	if (!e || e->magic != EVENT_MAGIC || e->imported || e->fd < 0)
		return hipErrorInvalidHandle; /* not created interprocess here */
	w.fd = e->fd;
	memset(h, 0, sizeof(*h));
	memcpy(h->reserved, &w, sizeof(w));
	return hipSuccess;
}

EXPORT hipError_t hipIpcOpenEventHandle(hipEvent_t *out, hipIpcEventHandle_t h)
{
	struct ipc_event_wire w;
	struct ihipEvent_t *e;
	void *p;
	hipError_t r = ready();

	if (r)
		return r;
	if (!out)
		return hipErrorInvalidValue;
	memcpy(&w, h.reserved, sizeof(w));
	if (w.magic != IPC_EVENT_MAGIC)
		return hipErrorInvalidValue;
	switch (fake_ipc_map(w.pid, w.fd, EVENT_PAGE, &p)) {
	case 0:
		break;
	case FAKE_IPC_SELF:
		return hipErrorInvalidContext;
	case FAKE_IPC_GONE:
		return hipErrorInvalidHandle;
	default:
		return hipErrorMapFailed;
	}
	if (((struct event_state *)p)->magic != IPC_EVENT_MAGIC || !(e = calloc(1, sizeof(*e)))) {
		munmap(p, EVENT_PAGE);
		return hipErrorInvalidHandle;
	}
	e->s = p;
	e->fd = -1;
	e->imported = 1;
	e->magic = EVENT_MAGIC;
	atomic_init(&e->refs, 1);
	*out = e;
	return hipSuccess;
}

/* ---- modules: kvtier's copy kernel ------------------------------------------
 *
 * hipModuleLoadData takes what hiprtc made: an AMDGPU ELF code object
 * (EM_AMDGPU, the HSA OS ABI) whose NT_AMDGPU_METADATA note (msgpack)
 * names its target and kernels.  It is accepted only for the agents'
 * processor (hipErrorNoBinaryForGpu otherwise, as HIP refuses a code
 * object for another GPU) and knows one kernel: kvt_copy_pages
 * (dma/src/copy_kernel.c) with exactly a global buffer of 8 bytes and a
 * 4-byte value as its parameters, the hidden ones aside; anything else is
 * hipErrorInvalidImage, or hipErrorNotFound at hipModuleGetFunction.
 *
 * hipModuleLaunchKernel reads the two arguments at the call (as HIP copies
 * kernel arguments) and runs the kernel's CPU twin on the stream: after the
 * work queued before it (its thread waits for the stream's other work,
 * kernels aside, to drain: later, never earlier), and holding the work
 * queued after it (counted on the stream's signal).  The twin walks the
 * descriptors -- which must lie in memory the GPU reads (a pool
 * allocation or a lock) -- and moves each row as a kernel's writes through
 * the fake HSA (its compute lane: the addresses checked, faults injected
 * there as for any copy).  A descriptor the runtime refuses is a GPU
 * memory fault: the process aborts, as ROCr aborts one nobody claims.
 * Once a fault stopped the process's queues, a running kernel stops
 * where it is and never completes (it touches no more memory). */
#define MODULE_MAGIC 0x4b56544d4f44554cull
#define FN_MAGIC     0x4b5654464e434f50ull

struct ihipModuleSymbol_t {
	uint64_t magic;
	struct ihipModule_t *mod;
};

struct ihipModule_t {
	uint64_t magic;
	struct ihipModuleSymbol_t fn;
};

static atomic_long st_kernel_launches, st_kernel_copies, st_modules_live;
static atomic_long kernels_live; /* launched, neither finished nor stopped */

/* Waits until every kernel launched has finished or stopped (a test's end:
 * none then runs on in memory the test freed). */
EXPORT void kvt_fake_hip_kernels_wait(void)
{
	while (atomic_load(&kernels_live) > 0)
		usleep(1000);
}

/* tests: "kernel_launches", "kernel_copies" (descriptors run), "modules_live" */
EXPORT long kvt_fake_hip_stat(const char *key)
{
	if (!strcmp(key, "kernel_launches"))
		return atomic_load(&st_kernel_launches);
	if (!strcmp(key, "kernel_copies"))
		return atomic_load(&st_kernel_copies);
	if (!strcmp(key, "modules_live"))
		return atomic_load(&st_modules_live);
	return -1;
}

/* A small msgpack reader, enough for the metadata note. */
struct mp {
	const uint8_t *p, *end;
};

enum { MP_BAD, MP_SCALAR, MP_STR, MP_ARRAY, MP_MAP };

struct mpv {
	int kind;
	uint64_t n;          /* an int's value, a string's length, a container's count */
	const char *s;
};

static uint64_t mp_be(const uint8_t *p, int n)
{
	uint64_t v = 0;

	for (int i = 0; i < n; i++)
		v = v << 8 | p[i];
	return v;
}

static int mp_need(struct mp *m, uint64_t n)
{
	return (uint64_t)(m->end - m->p) >= n;
}

static struct mpv mp_next(struct mp *m)
{
	struct mpv v = { MP_BAD, 0, NULL };
	uint8_t b;
	int w = 0;

	if (!mp_need(m, 1))
		return v;
	b = *m->p++;
	if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
		v.kind = MP_SCALAR;
		v.n = b <= 0x7f ? b : 0;
		return v;
	}
	if ((b & 0xe0) == 0xa0 || b == 0xd9 || b == 0xda || b == 0xdb || b == 0xc4 ||
	    b == 0xc5 || b == 0xc6) {
		w = (b & 0xe0) == 0xa0 ? 0 : b == 0xd9 || b == 0xc4 ? 1 : b == 0xda || b == 0xc5 ? 2 : 4;
		if (!mp_need(m, (uint64_t)w))
			return v;
		v.n = w ? mp_be(m->p, w) : (uint64_t)(b & 0x1f);
		m->p += w;
		if (!mp_need(m, v.n))
			return v;
		v.s = (const char *)m->p;
		m->p += v.n;
		v.kind = MP_STR;
		return v;
	}
	if ((b & 0xf0) == 0x90 || (b & 0xf0) == 0x80) {
		v.kind = (b & 0xf0) == 0x90 ? MP_ARRAY : MP_MAP;
		v.n = b & 0x0f;
		return v;
	}
	if (b == 0xdc || b == 0xdd || b == 0xde || b == 0xdf) {
		w = b == 0xdc || b == 0xde ? 2 : 4;
		if (!mp_need(m, (uint64_t)w))
			return v;
		v.kind = b <= 0xdd ? MP_ARRAY : MP_MAP;
		v.n = mp_be(m->p, w);
		m->p += w;
		return v;
	}
	if (b >= 0xcc && b <= 0xd3) { /* unsigned and signed ints */
		w = 1 << ((b - 0xcc) & 3);
		if (!mp_need(m, (uint64_t)w))
			return v;
		v.n = mp_be(m->p, w);
		m->p += w;
		v.kind = MP_SCALAR;
		return v;
	}
	if (b == 0xca || b == 0xcb) {
		w = b == 0xca ? 4 : 8;
		if (!mp_need(m, (uint64_t)w))
			return v;
		m->p += w;
		v.kind = MP_SCALAR;
	}
	return v;
}

static int mp_skip(struct mp *m, int depth)
{
	struct mpv v = mp_next(m);

	if (v.kind == MP_BAD || depth > 16)
		return -1;
	if (v.kind == MP_ARRAY || v.kind == MP_MAP)
		for (uint64_t i = 0; i < v.n * (v.kind == MP_MAP ? 2 : 1); i++)
			if (mp_skip(m, depth + 1))
				return -1;
	return 0;
}

static int mp_is(struct mpv k, const char *s)
{
	return k.kind == MP_STR && k.n == strlen(s) && !memcmp(k.s, s, k.n);
}

/* One kernel's map: its name kvt_copy_pages and its explicit parameters
 * exactly (global_buffer, 8), (by_value, 4)?  1 yes, 0 another kernel,
 * -1 malformed. */
static int kernel_is_ours(struct mp *m, uint64_t n_keys, int *args_ok)
{
	int ours = 0;

	for (uint64_t k = 0; k < n_keys; k++) {
		struct mpv key = mp_next(m);

		if (key.kind != MP_STR)
			return -1;
		if (mp_is(key, ".name")) {
			struct mpv v = mp_next(m);

			if (v.kind != MP_STR)
				return -1;
			ours = mp_is(v, "kvt_copy_pages");
		} else if (mp_is(key, ".args")) {
			struct mpv a = mp_next(m);
			int seen = 0, ok = 1;

			if (a.kind != MP_ARRAY)
				return -1;
			for (uint64_t i = 0; i < a.n; i++) {
				struct mpv am = mp_next(m);
				uint64_t size = 0;
				char kind[32] = "";

				if (am.kind != MP_MAP)
					return -1;
				for (uint64_t j = 0; j < am.n; j++) {
					struct mpv ak = mp_next(m), av;

					if (ak.kind != MP_STR)
						return -1;
					if (mp_is(ak, ".size") || mp_is(ak, ".value_kind")) {
						av = mp_next(m);
						if (mp_is(ak, ".size") && av.kind == MP_SCALAR)
							size = av.n;
						else if (av.kind == MP_STR)
							snprintf(kind, sizeof(kind), "%.*s",
								 (int)av.n, av.s);
					} else if (mp_skip(m, 0)) {
						return -1;
					}
				}
				if (!strncmp(kind, "hidden_", 7))
					continue;
				ok &= seen == 0 ? !strcmp(kind, "global_buffer") && size == 8
					: seen == 1 ? !strcmp(kind, "by_value") && size == 4 : 0;
				seen++;
			}
			*args_ok = ok && seen == 2;
		} else if (mp_skip(m, 0)) {
			return -1;
		}
	}
	return ours;
}

/* The metadata: 0 and *args_ok, target written; -1 malformed or no
 * kvt_copy_pages. */
static int read_metadata(const uint8_t *p, size_t n, int *args_ok, char *target, size_t tlen)
{
	struct mp m = { p, p + n };
	struct mpv top = mp_next(&m);
	int found = 0;

	if (top.kind != MP_MAP)
		return -1;
	for (uint64_t k = 0; k < top.n; k++) {
		struct mpv key = mp_next(&m);

		if (mp_is(key, "amdhsa.target")) {
			struct mpv v = mp_next(&m);

			if (v.kind != MP_STR)
				return -1;
			snprintf(target, tlen, "%.*s", (int)v.n, v.s);
		} else if (mp_is(key, "amdhsa.kernels")) {
			struct mpv a = mp_next(&m);

			if (a.kind != MP_ARRAY)
				return -1;
			for (uint64_t i = 0; i < a.n; i++) {
				struct mpv km = mp_next(&m);
				int ok = 0, r;

				if (km.kind != MP_MAP || (r = kernel_is_ours(&m, km.n, &ok)) < 0)
					return -1;
				if (r) {
					found = 1;
					*args_ok = ok;
				}
			}
		} else if (key.kind != MP_STR || mp_skip(&m, 0)) {
			return -1;
		}
	}
	return found ? 0 : -1;
}

/* The code object's metadata note; NULL when it is not one. */
static const uint8_t *metadata_note(const uint8_t *img, size_t *len)
{
	const Elf64_Ehdr *eh = (const Elf64_Ehdr *)img;

	if (memcmp(eh->e_ident, ELFMAG, SELFMAG) || eh->e_ident[EI_CLASS] != ELFCLASS64 ||
	    eh->e_machine != 224 /* EM_AMDGPU */ || eh->e_ident[EI_OSABI] != 64 /* AMDGPU_HSA */ ||
	    eh->e_shentsize != sizeof(Elf64_Shdr) || eh->e_shnum > 256)
		return NULL;
	for (int i = 0; i < eh->e_shnum; i++) {
		const Elf64_Shdr *sh = (const Elf64_Shdr *)(img + eh->e_shoff) + i;
		const uint8_t *q = img + sh->sh_offset, *end = q + sh->sh_size;

		if (sh->sh_type != SHT_NOTE || sh->sh_size > (1u << 20))
			continue;
		while (q + 12 <= end) {
			uint32_t namesz, descsz, type;

			memcpy(&namesz, q, 4);
			memcpy(&descsz, q + 4, 4);
			memcpy(&type, q + 8, 4);
			q += 12;
			if (namesz > 64 || descsz > (uint64_t)(end - q))
				return NULL;
			if (type == 32 /* NT_AMDGPU_METADATA */ && namesz == 7 &&
			    !memcmp(q, "AMDGPU", 7)) {
				*len = descsz;
				return q + ((namesz + 3) & ~3u);
			}
			q += ((namesz + 3) & ~3u) + ((descsz + 3) & ~3u);
		}
	}
	return NULL;
}

/* the agents' processor ("gfx90a"), from their ISA's name */
static hsa_status_t isa_cb(hsa_isa_t isa, void *data)
{
	uint32_t n = 0;
	char name[128] = "";

	if (F.isa_get_info(isa, HSA_ISA_INFO_NAME_LENGTH, &n) || !n || n > sizeof(name) ||
	    F.isa_get_info(isa, HSA_ISA_INFO_NAME, name))
		return HSA_STATUS_ERROR;
	snprintf(data, 64, "%s", name);
	return HSA_STATUS_INFO_BREAK;
}

static void processor_of(const char *triple_target, char *out, size_t len)
{
	const char *t = strstr(triple_target, "--");

	snprintf(out, len, "%s", t ? t + 2 : triple_target);
	out[strcspn(out, ":")] = 0;
}

EXPORT hipError_t hipModuleLoadData(hipModule_t *out, const void *image)
{
	char target[128] = "", want[64] = "", isa[64] = "", have[64] = "";
	const uint8_t *note;
	struct ihipModule_t *m;
	size_t len = 0;
	int args_ok = 0;
	hipError_t e = ready();

	if (e)
		return e;
	if (!out || !image)
		return hipErrorInvalidValue;
	if (!(note = metadata_note(image, &len)) ||
	    read_metadata(note, len, &args_ok, target, sizeof(target))) {
		fprintf(stderr, "fake HIP: hipModuleLoadData: not an AMDGPU code object with "
			"kvt_copy_pages in its metadata\n");
		return hipErrorInvalidImage;
	}
	if (!args_ok) {
		fprintf(stderr, "fake HIP: kvt_copy_pages does not take (const kvt_kcopy *, "
			"unsigned int): its CPU twin would read other arguments\n");
		return hipErrorInvalidImage;
	}
	if (n_gpus)
		F.iterate_isas(gpus[cur], isa_cb, isa);
	processor_of(target, have, sizeof(have));
	processor_of(isa, want, sizeof(want));
	if (!*want || strcmp(have, want)) {
		fprintf(stderr, "fake HIP: a code object for %s, the device is %s\n", target, isa);
		return hipErrorNoBinaryForGpu;
	}
	m = calloc(1, sizeof(*m));
	if (!m)
		return hipErrorOutOfMemory;
	m->magic = MODULE_MAGIC;
	m->fn = (struct ihipModuleSymbol_t){ FN_MAGIC, m };
	atomic_fetch_add(&st_modules_live, 1);
	*out = m;
	return hipSuccess;
}

EXPORT hipError_t hipModuleGetFunction(hipFunction_t *f, hipModule_t m, const char *name)
{
	if (!f || !name)
		return hipErrorInvalidValue;
	if (!m || m->magic != MODULE_MAGIC)
		return hipErrorInvalidResourceHandle;
	if (strcmp(name, "kvt_copy_pages"))
		return hipErrorNotFound;
	*f = &m->fn;
	return hipSuccess;
}

EXPORT hipError_t hipModuleUnload(hipModule_t m)
{
	if (!m || m->magic != MODULE_MAGIC)
		return hipErrorInvalidResourceHandle;
	m->magic = 0;
	m->fn.magic = 0;
	free(m);
	atomic_fetch_sub(&st_modules_live, 1);
	return hipSuccess;
}

struct kcopy { /* copy_kernel.c's struct kvt_kcopy */
	uint64_t src, dst, len, rows, spitch, dpitch;
};

struct klaunch {
	struct ihipStream_t *st;
	uint64_t cp;
	uint32_t n;
	long faults;     /* the fake HSA's faults at the launch */
};

/* The agent a kernel's access to p goes through, and where the CPU reads
 * it; 0 and NULL for memory the GPU cannot reach. */
static int kernel_side(uint64_t p, hsa_agent_t *agent, char **host)
{
	hsa_amd_pointer_info_t info = { .size = sizeof(info) };

	if (F.pointer_info((void *)(uintptr_t)p, &info, NULL, NULL, NULL) ||
	    info.type == HSA_EXT_POINTER_TYPE_UNKNOWN)
		return -1;
	*agent = info.agentOwner.handle && info.type == HSA_EXT_POINTER_TYPE_HSA &&
		 !info.hostBaseAddress ? info.agentOwner : cpu;
	if (host)
		*host = info.hostBaseAddress ? (char *)info.hostBaseAddress +
					       (p - (uint64_t)(uintptr_t)info.agentBaseAddress)
					     : NULL;
	return 0;
}

static void *kernel_fault(uint64_t va, const char *what)
{
	fprintf(stderr, "fake HIP: Memory access fault by GPU on address %#llx (the copy "
		"kernel's %s). Reason: Page not present or supervisor privilege.\n",
		(unsigned long long)va, what);
	abort();
}

/* A GPU memory fault stopped the process's queues (the fake HSA's) since
 * the kernel was launched: a kernel running then stops where it is and
 * never completes -- even when a test resets the fake's queues after, as
 * a process's queues never restart. */
static long faults(void)
{
	return F.hsa_stat ? F.hsa_stat("faults") : 0;
}

static int fault_since(const struct klaunch *k)
{
	return faults() != k->faults;
}

/* the row signals of kernels the fault stopped: rows still queued on the
 * fake HSA's lanes hold them (kept, reachable) */
#define STOPPED_MAX 64
static hsa_signal_t stopped[STOPPED_MAX];
static atomic_int n_stopped;

static void *kernel_stopped(struct klaunch *k, hsa_signal_t done)
{
	int i = atomic_fetch_add(&n_stopped, 1);

	if (i < STOPPED_MAX)
		stopped[i] = done;
	free(k);
	atomic_fetch_sub(&kernels_live, 1);
	return NULL; /* the stream's count stays: it never completes */
}

static void *run_kernel(void *arg)
{
	struct klaunch *k = arg;
	struct ihipStream_t *st = k->st;
	hsa_signal_t done;
	hsa_agent_t a;
	char *cps = NULL;
	/* a schedule point: each row this late (FAKE_HIP_KERNEL_ROW_US), so a
	 * fault elsewhere lands while the kernel runs and the process goes on
	 * (test_tier_hsa_fault_kernel) */
	unsigned row_us = (unsigned)fake_env_long_hip("FAKE_HIP_KERNEL_ROW_US", 0);

	/* after the stream's earlier work: what it counts, less its kernels */
	while (F.signal_load(st->sig) > atomic_load(&st->kernels))
		usleep(50);
	if (F.signal_create(0, 0, NULL, &done))
		abort();
	if (fault_since(k))
		return kernel_stopped(k, done);
	if (k->n && (kernel_side(k->cp, &a, &cps) || !cps))
		return fault_since(k) ? kernel_stopped(k, done) : kernel_fault(k->cp, "descriptors");
	for (uint32_t i = 0; i < k->n; i++) {
		struct kcopy c;

		memcpy(&c, cps + (size_t)i * sizeof(c), sizeof(c));
		for (uint64_t r = 0; r < c.rows; r++) {
			uint64_t s = c.src + r * c.spitch, d = c.dst + r * c.dpitch;
			hsa_agent_t sa, da;

			/* (memory gone after a fault stopped the queues -- the
			 * process freed it since -- is no fault of this kernel:
			 * it stopped then; checked again after a refusal) */
			if (row_us)
				usleep(row_us);
			if (fault_since(k))
				return kernel_stopped(k, done);
			if (kernel_side(s, &sa, NULL))
				return fault_since(k) ? kernel_stopped(k, done)
						     : kernel_fault(s, "source row");
			if (kernel_side(d, &da, NULL))
				return fault_since(k) ? kernel_stopped(k, done)
						     : kernel_fault(d, "destination row");
			F.signal_add(done, 1);
			if (F.kernel_copy((void *)(uintptr_t)d, da, (void *)(uintptr_t)s, sa, c.len,
					  done))
				return fault_since(k) ? kernel_stopped(k, done)
						     : kernel_fault(d, "row (refused by the runtime)");
		}
	}
	while (F.signal_load(done) > 0) { /* (rows on a stopped queue never land) */
		if (fault_since(k))
			return kernel_stopped(k, done);
		usleep(50);
	}
	F.signal_destroy(done);
	atomic_fetch_add(&st_kernel_copies, (long)k->n);
	F.signal_subtract(st->sig, 1);
	atomic_fetch_sub(&st->kernels, 1);
	free(k);
	atomic_fetch_sub(&kernels_live, 1);
	return NULL;
}

EXPORT hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int gx, unsigned int gy,
					unsigned int gz, unsigned int bx, unsigned int by,
					unsigned int bz, unsigned int shared, hipStream_t s,
					void **params, void **extra)
{
	struct ihipStream_t *st = s ? s : &null_stream;
	struct klaunch *k;
	hipError_t e = ready();

	if (e)
		return e;
	if (!f || f->magic != FN_MAGIC)
		return hipErrorInvalidResourceHandle;
	if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024 || shared ||
	    !params || extra || !params[0] || !params[1])
		return hipErrorInvalidValue;
	k = calloc(1, sizeof(*k));
	if (!k)
		return hipErrorOutOfMemory;
	k->st = st;
	k->faults = faults();
	memcpy(&k->cp, params[0], sizeof(k->cp));
	memcpy(&k->n, params[1], sizeof(k->n));
	atomic_fetch_add(&st_kernel_launches, 1);
	atomic_fetch_add(&st->kernels, 1);
	atomic_fetch_add(&kernels_live, 1);
	if ((e = stream_thread(st, run_kernel, k, NULL, 1))) {
		atomic_fetch_sub(&st->kernels, 1);
		atomic_fetch_sub(&kernels_live, 1);
		free(k);
	}
	return e;
}
