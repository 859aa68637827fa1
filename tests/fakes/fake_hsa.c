/* fake_hsa.c - a fake libhsa-runtime64.so.1 for CI without a GPU.
 *
 * Implements exactly the entry points kvtier's hsa backend uses, with real
 * semantics where it matters for correctness:
 *   - one CPU agent and FAKE_HSA_GPUS (default 2) GPU agents, each with a
 *     global pool (plus a non-global one, to be filtered out);
 *   - GPU memory lives at addresses the CPU cannot touch (a PROT_NONE
 *     window), so only copies through the runtime reach it;
 *   - hsa_amd_memory_lock_to_pool returns an agent pointer that differs
 *     from the host pointer; a copy given the host pointer of a locked range
 *     fails (as it would where the two differ on real hardware);
 *   - copies run on the fake's worker lanes (fake_common.h): one lane per
 *     SDMA engine for _on_engine, one per direction for the runtime's own
 *     choice (ROCr's host-to-device and device-to-host blits), in order
 *     within a lane and in no order among lanes (and after a random delay with
 *     FAKE_GPU_JITTER_US or "jitter_us"); each decrements its completion
 *     signal (or makes it negative on an injected error);
 *   - a GPU memory fault ("fault_copy": the k-th copy faults): it writes
 *     half its bytes, the process's queues stop (no copy completes or
 *     signals from then on), and the registered system event handlers
 *     are called with HSA_AMD_GPU_MEMORY_FAULT_EVENT on the runtime's
 *     thread; when none returns HSA_STATUS_SUCCESS the fake prints ROCr's
 *     message and aborts the process, as ROCr does (VMFaultHandler);
 *   - the ROCm 5.6 entry points (_on_engine, copy_engine_status, the SDMA
 *     engine count) exist unless built with FAKE_HSA_52 (ROCm 5.2: absent).
 *   - locks are charged to a pinning budget shared across processes when
 *     FAKE_HSA_LOCK_BUDGET and FAKE_HSA_LOCK_LEDGER are set (the KFD
 *     driver's one node-wide limit);
 * Injection and statistics through kvt_fake_hsa_ctl() / kvt_fake_hsa_stat(),
 * and FAKE_HSA_INIT_STATUS / FAKE_HSA_GPUS in the environment.
 */
#include "fake_common.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>

#include <hsa/hsa.h>
#include <hsa/hsa_ext_amd.h>

#define EXPORT __attribute__((visibility("default")))

#define CPU_AGENT   0x100u
#define GPU_AGENT   0x200u
#define CPU_POOL    0x300u
#define GPU_POOL    0x400u
#define GROUP_POOL  0x500u
#define MAX_GPUS    8
#define N_SDMA      2
#define SIG_MAGIC   0x5349474e414c5f5full
#define IPC_MAGIC   0x4b564950u /* hsa_amd_ipc_memory_t's first word */
#define F_IPC       0x2u        /* region flag: an attached IPC allocation */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static int n_gpus;

/* injection (counters: the k-th next call fails; 0 = off) */
static atomic_long fail_copy, neg_signal, fail_lock, fail_rect, fail_engine, fault_copy;
#define MAX_HANDLERS 64
/* system event handlers: ROCr keeps them until the runtime unloads and
 * offers no way to remove one; the fake keeps them for the process */
static struct { hsa_amd_system_event_callback_t cb; void *data; } handlers[MAX_HANDLERS];
static int n_handlers;
static atomic_long busy_engines; /* engines copy_engine_status reports busy */
static atomic_long st_faults;    /* GPU memory faults, for the process's life */
static atomic_long range_split;  /* device memory reported in pieces of this */
/* statistics */
static atomic_long st_copies, st_engine_copies, st_rect_copies, st_locks_total,
	st_max_lock_bytes, st_signals_live, st_engine_used[N_SDMA], st_bad_pointer;

EXPORT int kvt_fake_hsa_ctl(const char *key, long v)
{
	if (!strcmp(key, "fail_copy"))
		atomic_store(&fail_copy, v);
	else if (!strcmp(key, "neg_signal"))
		atomic_store(&neg_signal, v);
	else if (!strcmp(key, "fail_lock"))
		atomic_store(&fail_lock, v);
	else if (!strcmp(key, "fail_rect"))
		atomic_store(&fail_rect, v);
	else if (!strcmp(key, "fail_engine"))
		atomic_store(&fail_engine, v);
	else if (!strcmp(key, "busy_engines")) /* mask: reported busy (not idle) */
		atomic_store(&busy_engines, v);
	else if (!strcmp(key, "range_split"))
		atomic_store(&range_split, v);
	else if (!strcmp(key, "fault_copy"))
		atomic_store(&fault_copy, v);
	else if (!strcmp(key, "jitter_us"))
		fake_worker_jitter(v);
	else if (!strcmp(key, "hold"))
		fake_worker_hold((int)v);
	else if (!strcmp(key, "reset")) {
		atomic_store(&busy_engines, 0);
		atomic_store(&range_split, 0);
		atomic_store(&fail_copy, 0);
		atomic_store(&neg_signal, 0);
		atomic_store(&fail_lock, 0);
		atomic_store(&fail_rect, 0);
		atomic_store(&fail_engine, 0);
		atomic_store(&fault_copy, 0);
		fake_copy_resume();
		fake_worker_out_of_order(1);
		fake_worker_jitter(fake_env_long("FAKE_GPU_JITTER_US", 0));
		atomic_store(&st_copies, 0);
		atomic_store(&st_engine_copies, 0);
		atomic_store(&st_rect_copies, 0);
		atomic_store(&st_locks_total, 0);
		atomic_store(&st_max_lock_bytes, 0);
		atomic_store(&st_bad_pointer, 0);
		for (int i = 0; i < N_SDMA; i++)
			atomic_store(&st_engine_used[i], 0);
		fake_worker_hold(0);
	} else
		return -EINVAL;
	return 0;
}

EXPORT long kvt_fake_hsa_stat(const char *key)
{
	if (!strcmp(key, "copies"))
		return atomic_load(&st_copies);
	if (!strcmp(key, "out_of_order"))
		return fake_worker_out_of_order(0);
	if (!strcmp(key, "queues_dead"))
		return fake_copy_halted();
	if (!strcmp(key, "faults")) /* GPU memory faults so far (never reset) */
		return atomic_load(&st_faults);
	if (!strcmp(key, "engine_copies"))
		return atomic_load(&st_engine_copies);
	if (!strcmp(key, "engine0"))
		return atomic_load(&st_engine_used[0]);
	if (!strcmp(key, "engine1"))
		return atomic_load(&st_engine_used[1]);
	if (!strcmp(key, "rect_copies"))
		return atomic_load(&st_rect_copies);
	if (!strcmp(key, "locks_live"))
		return fake_region_count(FAKE_ALIAS);
	if (!strcmp(key, "locks_total"))
		return atomic_load(&st_locks_total);
	if (!strcmp(key, "max_lock_bytes"))
		return atomic_load(&st_max_lock_bytes);
	if (!strcmp(key, "allocs_live"))
		return fake_region_count(FAKE_DEV) + fake_region_count(FAKE_SYS);
	if (!strcmp(key, "signals_live"))
		return atomic_load(&st_signals_live);
	if (!strcmp(key, "bad_pointer"))
		return atomic_load(&st_bad_pointer);
	if (!strcmp(key, "init_count")) {
		long n;

		pthread_mutex_lock(&lock);
		n = init_count;
		pthread_mutex_unlock(&lock);
		return n;
	}
	return -1;
}

/* Decrements *c; true when it reached 0 now (this call is the k-th). */
static bool trip(atomic_long *c)
{
	long v = atomic_load(c);

	while (v > 0 && !atomic_compare_exchange_weak(c, &v, v - 1))
		;
	return v == 1;
}

static int inited(void)
{
	int n;

	pthread_mutex_lock(&lock);
	n = init_count;
	pthread_mutex_unlock(&lock);
	return n > 0;
}

static int gpu_of(hsa_agent_t a)
{
	if (a.handle >= GPU_AGENT && a.handle < GPU_AGENT + (uint64_t)n_gpus)
		return (int)(a.handle - GPU_AGENT);
	return -1;
}

static int is_cpu(hsa_agent_t a)
{
	return a.handle == CPU_AGENT;
}

/* ---- init ---------------------------------------------------------------- */

EXPORT hsa_status_t hsa_init(void)
{
	long st = fake_env_long("FAKE_HSA_INIT_STATUS", 0);

	if (st)
		return (hsa_status_t)st;
	pthread_mutex_lock(&lock);
	if (init_count++ == 0) {
		n_gpus = (int)fake_env_long("FAKE_HSA_GPUS", 2);
		if (n_gpus < 0 || n_gpus > MAX_GPUS)
			n_gpus = 2;
		fake_worker_start();
	}
	pthread_mutex_unlock(&lock);
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_shut_down(void)
{
	int last = 0;

	pthread_mutex_lock(&lock);
	if (init_count == 0) {
		pthread_mutex_unlock(&lock);
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	}
	last = --init_count == 0;
	pthread_mutex_unlock(&lock);
	if (last)
		fake_worker_stop();
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_status_string(hsa_status_t status, const char **str)
{
	switch ((int)status) {
	case HSA_STATUS_SUCCESS:
		*str = "HSA_STATUS_SUCCESS";
		break;
	case HSA_STATUS_ERROR_INVALID_ARGUMENT:
		*str = "HSA_STATUS_ERROR_INVALID_ARGUMENT: one of the actual arguments "
		       "does not meet a precondition stated in the documentation";
		break;
	case HSA_STATUS_ERROR_OUT_OF_RESOURCES:
		*str = "HSA_STATUS_ERROR_OUT_OF_RESOURCES: the runtime failed to allocate "
		       "the necessary resources";
		break;
	case HSA_STATUS_ERROR_NOT_INITIALIZED:
		*str = "HSA_STATUS_ERROR_NOT_INITIALIZED";
		break;
	case HSA_STATUS_ERROR_INVALID_AGENT:
		*str = "HSA_STATUS_ERROR_INVALID_AGENT";
		break;
	case HSA_STATUS_ERROR_INVALID_SIGNAL:
		*str = "HSA_STATUS_ERROR_INVALID_SIGNAL";
		break;
	default:
		*str = "HSA_STATUS_ERROR (fake)";
		break;
	}
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_system_get_info(hsa_system_info_t attribute, void *value)
{
	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (attribute != HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	*(uint64_t *)value = 1000000000u; /* 1 tick = 1 ns */
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_iterate_agents(hsa_status_t (*cb)(hsa_agent_t, void *), void *data)
{
	hsa_status_t st;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	/* GPUs first and the CPU last, as a reminder that order is not a contract */
	for (int i = 0; i < n_gpus; i++)
		if ((st = cb((hsa_agent_t){ GPU_AGENT + (uint64_t)i }, data)) != HSA_STATUS_SUCCESS)
			return st;
	return cb((hsa_agent_t){ CPU_AGENT }, data);
}

EXPORT hsa_status_t hsa_agent_get_info(hsa_agent_t agent, hsa_agent_info_t attribute,
				       void *value)
{
	int g = gpu_of(agent);

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (g < 0 && !is_cpu(agent))
		return HSA_STATUS_ERROR_INVALID_AGENT;
	switch ((unsigned)attribute) {
	case HSA_AGENT_INFO_DEVICE:
		*(hsa_device_type_t *)value = g >= 0 ? HSA_DEVICE_TYPE_GPU : HSA_DEVICE_TYPE_CPU;
		return HSA_STATUS_SUCCESS;
	case HSA_AGENT_INFO_NAME:
		memset(value, 0, 64);
		snprintf(value, 64, g >= 0 ? "fake-gfx942" : "fake-cpu");
		return HSA_STATUS_SUCCESS;
	case HSA_AMD_AGENT_INFO_UUID:
		/* "GPU-" and the unique id in 16 hex digits (21 bytes with the
		 * NUL); FAKE_HSA_UUID_XX: "GPU-XX", as agents without one say */
		memset(value, 0, 21);
		if (g < 0)
			snprintf(value, 21, "CPU-XX");
		else if (fake_env_long("FAKE_HSA_UUID_XX", 0))
			snprintf(value, 21, "GPU-XX");
		else
			snprintf(value, 21, "GPU-%016llx", 0x6b76746661b30000ull + (unsigned)g);
		return HSA_STATUS_SUCCESS;
	case HSA_AMD_AGENT_INFO_COMPUTE_UNIT_COUNT:
		if (g < 0)
			return HSA_STATUS_ERROR_INVALID_ARGUMENT;
		*(uint32_t *)value = 104; /* an MI210's */
		return HSA_STATUS_SUCCESS;
#ifndef FAKE_HSA_52
	case 0xA10A: /* HSA_AMD_AGENT_INFO_NUM_SDMA_ENG (ROCm 5.6+) */
		if (g < 0)
			return HSA_STATUS_ERROR_INVALID_ARGUMENT;
		*(uint32_t *)value = N_SDMA;
		return HSA_STATUS_SUCCESS;
#endif
	default:
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	}
}

/* ---- instruction sets ------------------------------------------------------ */

/* One ISA per GPU agent, named as ROCr names it: the triple, "--", the
 * target ID.  gfx90a (MI210/MI250) by default, a target the Debian
 * compiler knows, so that the copy kernel's tests compile real code for
 * it; FAKE_HSA_ISA names another (gfx942: one Debian's ROCm 5.2 predates). */
#define ISA_HANDLE 0x600u

static const char *isa_name(void)
{
	const char *t = getenv("FAKE_HSA_ISA");
	static __thread char name[96];

	snprintf(name, sizeof(name), "amdgcn-amd-amdhsa--%s",
		 t && *t ? t : "gfx90a:sramecc+:xnack-");
	return name;
}

EXPORT hsa_status_t hsa_agent_iterate_isas(hsa_agent_t agent,
					   hsa_status_t (*cb)(hsa_isa_t, void *), void *data)
{
	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (gpu_of(agent) < 0)
		return is_cpu(agent) ? HSA_STATUS_SUCCESS : HSA_STATUS_ERROR_INVALID_AGENT;
	return cb((hsa_isa_t){ ISA_HANDLE }, data);
}

EXPORT hsa_status_t hsa_isa_get_info_alt(hsa_isa_t isa, hsa_isa_info_t attribute, void *value)
{
	const char *n = isa_name();

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (isa.handle != ISA_HANDLE)
		return HSA_STATUS_ERROR_INVALID_ISA;
	switch (attribute) {
	case HSA_ISA_INFO_NAME_LENGTH: /* with the NUL, as ROCr counts */
		*(uint32_t *)value = (uint32_t)strlen(n) + 1;
		return HSA_STATUS_SUCCESS;
	case HSA_ISA_INFO_NAME:
		memcpy(value, n, strlen(n) + 1);
		return HSA_STATUS_SUCCESS;
	default:
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	}
}

/* ---- pools --------------------------------------------------------------- */

EXPORT hsa_status_t hsa_amd_agent_iterate_memory_pools(
	hsa_agent_t agent, hsa_status_t (*cb)(hsa_amd_memory_pool_t, void *), void *data)
{
	int g = gpu_of(agent);
	hsa_status_t st;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (g < 0 && !is_cpu(agent))
		return HSA_STATUS_ERROR_INVALID_AGENT;
	if (g >= 0) {
		st = cb((hsa_amd_memory_pool_t){ GROUP_POOL + (uint64_t)g }, data);
		if (st != HSA_STATUS_SUCCESS)
			return st;
		return cb((hsa_amd_memory_pool_t){ GPU_POOL + (uint64_t)g }, data);
	}
	return cb((hsa_amd_memory_pool_t){ CPU_POOL }, data);
}

EXPORT hsa_status_t hsa_amd_memory_pool_get_info(hsa_amd_memory_pool_t pool,
						 hsa_amd_memory_pool_info_t attribute,
						 void *value)
{
	uint64_t h = pool.handle;
	int group = h >= GROUP_POOL && h < GROUP_POOL + MAX_GPUS;
	int gpu = h >= GPU_POOL && h < GPU_POOL + MAX_GPUS;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!group && !gpu && h != CPU_POOL)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	switch (attribute) {
	case HSA_AMD_MEMORY_POOL_INFO_SEGMENT:
		*(hsa_amd_segment_t *)value = group ? HSA_AMD_SEGMENT_GROUP : HSA_AMD_SEGMENT_GLOBAL;
		return HSA_STATUS_SUCCESS;
	case HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS:
		if (group)
			return HSA_STATUS_ERROR_INVALID_ARGUMENT;
		*(uint32_t *)value = gpu ? HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED
					 : HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED |
					   HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_KERNARG_INIT;
		return HSA_STATUS_SUCCESS;
	case HSA_AMD_MEMORY_POOL_INFO_SIZE:
		*(size_t *)value = (size_t)64 << 30;
		return HSA_STATUS_SUCCESS;
	case HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED:
		*(bool *)value = !group;
		return HSA_STATUS_SUCCESS;
	default:
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	}
}

EXPORT hsa_status_t hsa_amd_memory_pool_allocate(hsa_amd_memory_pool_t pool, size_t size,
						 uint32_t flags, void **ptr)
{
	uint64_t h = pool.handle;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!size || !ptr || flags)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	if (h >= GPU_POOL && h < GPU_POOL + (uint64_t)n_gpus) {
		/* whole pages, so that an IPC export can put a memfd in their place */
		char *backing = mmap(NULL, FAKE_PAGES(size), PROT_READ | PROT_WRITE,
				     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		uint64_t dev;

		if (backing == MAP_FAILED)
			return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
		dev = fake_region_add(FAKE_DEV, size, backing, (int)(h - GPU_POOL), 0);
		if (!dev) {
			munmap(backing, FAKE_PAGES(size));
			return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
		}
		*ptr = (void *)(uintptr_t)dev;
		return HSA_STATUS_SUCCESS;
	}
	if (h == CPU_POOL) {
		char *p = aligned_alloc(4096, (size + 4095) & ~(size_t)4095);

		if (!p)
			return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
		if (fake_region_add_sys(p, size, -1)) {
			free(p);
			return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
		}
		*ptr = p;
		return HSA_STATUS_SUCCESS;
	}
	return HSA_STATUS_ERROR_INVALID_ARGUMENT; /* group pools are not allocatable */
}

EXPORT hsa_status_t hsa_amd_memory_pool_free(void *ptr)
{
	struct fake_region r;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (fake_region_find((uint64_t)(uintptr_t)ptr, 1, &r) || r.dev != (uint64_t)(uintptr_t)ptr ||
	    (r.kind != FAKE_DEV && r.kind != FAKE_SYS) || (r.flags & F_IPC))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	fake_region_del(r.dev, NULL);
	if (r.kind == FAKE_DEV) {
		munmap(r.host, FAKE_PAGES(r.len));
		fake_ipc_unexport(r.dev);
	} else {
		free(r.host);
	}
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_amd_agents_allow_access(uint32_t num_agents, const hsa_agent_t *agents,
						const uint32_t *flags, const void *ptr)
{
	struct fake_region r;

	(void)flags;
	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!num_agents || !agents || fake_region_find((uint64_t)(uintptr_t)ptr, 1, &r))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	for (uint32_t i = 0; i < num_agents; i++)
		if (gpu_of(agents[i]) < 0 && !is_cpu(agents[i]))
			return HSA_STATUS_ERROR_INVALID_AGENT;
	return HSA_STATUS_SUCCESS;
}

/* ---- locking --------------------------------------------------------------- */

/* The amdgpu KFD driver's pinning budget: one node-wide counter that
 * every process's locks are charged to, in full, and a lock past its
 * limit fails.  FAKE_HSA_LOCK_BUDGET (bytes) turns it on; the counter is
 * shared by every process that names the same FAKE_HSA_LOCK_LEDGER file
 * (8 bytes, mapped; a process's locks are released by its unlocks).
 * Returns 0, or -1 when charging `delta` would pass the limit. */
static int budget_charge(int64_t delta)
{
	static _Atomic int64_t *used;
	static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
	long limit = fake_env_long("FAKE_HSA_LOCK_BUDGET", 0);
	const char *path = getenv("FAKE_HSA_LOCK_LEDGER");

	if (limit <= 0 || !path || !*path)
		return 0;
	pthread_mutex_lock(&mu);
	if (!used) {
		int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
		if (fd >= 0 && ftruncate(fd, 8) == 0) {
			void *m = mmap(NULL, 8, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
			if (m != MAP_FAILED)
				used = m;
		}
		if (fd >= 0)
			close(fd);
	}
	pthread_mutex_unlock(&mu);
	if (!used)
		return 0;
	if (delta <= 0) {
		atomic_fetch_add(used, delta);
		return 0;
	}
	if (atomic_fetch_add(used, delta) + delta > limit) {
		atomic_fetch_sub(used, delta);
		return -1;
	}
	return 0;
}

EXPORT hsa_status_t hsa_amd_memory_lock_to_pool(void *host_ptr, size_t size,
						hsa_agent_t *agents, int num_agent,
						hsa_amd_memory_pool_t pool, uint32_t flags,
						void **agent_ptr)
{
	uint64_t dev;
	int owner = -1;
	long cur;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!host_ptr || !size || !agent_ptr || flags || (!agents) != (num_agent == 0))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	if (pool.handle != CPU_POOL)
		return (hsa_status_t)HSA_STATUS_ERROR_INVALID_MEMORY_POOL;
	for (int i = 0; i < num_agent; i++) {
		if (gpu_of(agents[i]) < 0)
			return HSA_STATUS_ERROR_INVALID_AGENT;
		owner = gpu_of(agents[i]);
	}
	if (trip(&fail_lock))
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	if (budget_charge((int64_t)size))
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES; /* the driver's pinning limit */
	dev = fake_region_add(FAKE_ALIAS, size, host_ptr, owner, 0);
	if (!dev) {
		budget_charge(-(int64_t)size);
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	}
	atomic_fetch_add(&st_locks_total, 1);
	cur = atomic_load(&st_max_lock_bytes);
	while ((long)size > cur && !atomic_compare_exchange_weak(&st_max_lock_bytes, &cur, (long)size))
		;
	*agent_ptr = (void *)(uintptr_t)dev;
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_amd_memory_unlock(void *host_ptr)
{
	struct fake_region r;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (fake_alias_of_host(host_ptr, 1, &r) || r.host != host_ptr)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT; /* real: undefined */
	fake_region_del(r.dev, NULL);
	budget_charge(-(int64_t)r.len);
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_amd_pointer_info(const void *ptr, hsa_amd_pointer_info_t *info,
					 void *(*alloc)(size_t), uint32_t *num_agents_accessible,
					 hsa_agent_t **accessible)
{
	struct fake_region r;

	(void)alloc;
	(void)num_agents_accessible;
	(void)accessible;
	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!ptr || !info || info->size < sizeof(*info))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	memset((char *)info + sizeof(info->size), 0, sizeof(*info) - sizeof(info->size));
	if (fake_region_find((uint64_t)(uintptr_t)ptr, 1, &r)) {
		info->type = HSA_EXT_POINTER_TYPE_UNKNOWN;
		return HSA_STATUS_SUCCESS;
	}
	info->type = r.kind == FAKE_ALIAS ? HSA_EXT_POINTER_TYPE_LOCKED : HSA_EXT_POINTER_TYPE_HSA;
	info->agentBaseAddress = (void *)(uintptr_t)r.dev;
	info->hostBaseAddress = r.kind == FAKE_DEV ? NULL : r.host;
	info->sizeInBytes = r.len;
	if (atomic_load(&range_split) && r.kind == FAKE_DEV) {
		/* device memory in back-to-back allocations of range_split bytes */
		uint64_t piece = (uint64_t)atomic_load(&range_split);
		uint64_t start = r.dev + ((uint64_t)(uintptr_t)ptr - r.dev) / piece * piece;
		info->agentBaseAddress = (void *)(uintptr_t)start;
		info->sizeInBytes = r.dev + r.len - start < piece ? r.dev + r.len - start : piece;
	}
	info->agentOwner.handle = r.kind == FAKE_DEV ? GPU_AGENT + (uint64_t)r.owner : CPU_AGENT;
	return HSA_STATUS_SUCCESS;
}

/* ---- signals -------------------------------------------------------------- */

/* Laid out as ROCr's amd_signal_t begins (kind, then the 64-bit value at
 * offset 8: the word SDMA polls and a GPU may write directly, as
 * hipStreamWriteValue64 does): v is read and written with atomics, under
 * m for the waiters' sake. */
struct fsig {
	int64_t kind;
	int64_t v;
	uint64_t magic;
	pthread_mutex_t m;
	pthread_cond_t c;
};
_Static_assert(offsetof(struct fsig, v) == 8, "amd_signal_t.value is at offset 8");

static struct fsig *sig_of(hsa_signal_t s)
{
	struct fsig *f = (struct fsig *)(uintptr_t)s.handle;

	return f && f->magic == SIG_MAGIC ? f : NULL;
}

EXPORT hsa_status_t hsa_signal_create(hsa_signal_value_t initial_value, uint32_t num_consumers,
				      const hsa_agent_t *consumers, hsa_signal_t *signal)
{
	struct fsig *f;
	pthread_condattr_t ca;

	(void)consumers;
	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!signal || (num_consumers && !consumers))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	/* 64-byte aligned, as ROCr's amd_signal_t (AMD_SIGNAL_ALIGN) */
	f = aligned_alloc(64, (sizeof(*f) + 63) & ~(size_t)63);
	if (!f)
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	memset(f, 0, sizeof(*f));
	f->magic = SIG_MAGIC;
	f->kind = 1; /* AMD_SIGNAL_KIND_USER */
	__atomic_store_n(&f->v, initial_value, __ATOMIC_RELEASE);
	pthread_mutex_init(&f->m, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&f->c, &ca);
	pthread_condattr_destroy(&ca);
	signal->handle = (uint64_t)(uintptr_t)f;
	atomic_fetch_add(&st_signals_live, 1);
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_signal_destroy(hsa_signal_t signal)
{
	struct fsig *f = sig_of(signal);

	if (!f)
		return HSA_STATUS_ERROR_INVALID_SIGNAL;
	f->magic = 0;
	pthread_mutex_destroy(&f->m);
	pthread_cond_destroy(&f->c);
	free(f);
	atomic_fetch_sub(&st_signals_live, 1);
	return HSA_STATUS_SUCCESS;
}

static void sig_update(struct fsig *f, int set, int64_t v)
{
	pthread_mutex_lock(&f->m);
	if (set)
		__atomic_store_n(&f->v, v, __ATOMIC_RELEASE);
	else
		__atomic_add_fetch(&f->v, v, __ATOMIC_ACQ_REL);
	pthread_cond_broadcast(&f->c);
	pthread_mutex_unlock(&f->m);
}

EXPORT void hsa_signal_store_screlease(hsa_signal_t signal, hsa_signal_value_t value)
{
	struct fsig *f = sig_of(signal);

	if (f)
		sig_update(f, 1, value);
	else
		abort(); /* the real runtime would crash too */
}

EXPORT void hsa_signal_add_screlease(hsa_signal_t signal, hsa_signal_value_t value)
{
	struct fsig *f = sig_of(signal);

	if (!f)
		abort();
	sig_update(f, 0, value);
}

EXPORT void hsa_signal_subtract_screlease(hsa_signal_t signal, hsa_signal_value_t value)
{
	struct fsig *f = sig_of(signal);

	if (!f)
		abort();
	sig_update(f, 0, -value);
}

EXPORT hsa_signal_value_t hsa_signal_load_scacquire(hsa_signal_t signal)
{
	struct fsig *f = sig_of(signal);
	int64_t v;

	if (!f)
		abort();
	pthread_mutex_lock(&f->m);
	v = __atomic_load_n(&f->v, __ATOMIC_ACQUIRE);
	pthread_mutex_unlock(&f->m);
	return v;
}

static int cond_met(int64_t v, hsa_signal_condition_t c, int64_t cmp)
{
	switch (c) {
	case HSA_SIGNAL_CONDITION_EQ:
		return v == cmp;
	case HSA_SIGNAL_CONDITION_NE:
		return v != cmp;
	case HSA_SIGNAL_CONDITION_LT:
		return v < cmp;
	case HSA_SIGNAL_CONDITION_GTE:
		return v >= cmp;
	}
	return 1;
}

EXPORT hsa_signal_value_t hsa_signal_wait_scacquire(hsa_signal_t signal,
						    hsa_signal_condition_t condition,
						    hsa_signal_value_t compare_value,
						    uint64_t timeout_hint,
						    hsa_wait_state_t wait_state_hint)
{
	struct fsig *f = sig_of(signal);
	struct timespec ts;
	int64_t v;

	(void)wait_state_hint;
	if (!f)
		abort();
	clock_gettime(CLOCK_MONOTONIC, &ts);
	if (timeout_hint != UINT64_MAX) {
		uint64_t ns = (uint64_t)ts.tv_nsec + timeout_hint % 1000000000u;

		ts.tv_sec += (time_t)(timeout_hint / 1000000000u + ns / 1000000000u);
		ts.tv_nsec = (long)(ns % 1000000000u);
	}
	pthread_mutex_lock(&f->m);
	while (!cond_met(__atomic_load_n(&f->v, __ATOMIC_ACQUIRE), condition, compare_value)) {
		if (timeout_hint == UINT64_MAX)
			pthread_cond_wait(&f->c, &f->m);
		else if (pthread_cond_timedwait(&f->c, &f->m, &ts))
			break; /* the hint expired: return the current value */
	}
	v = __atomic_load_n(&f->v, __ATOMIC_ACQUIRE);
	pthread_mutex_unlock(&f->m);
	return v;
}

/* ---- copies ---------------------------------------------------------------- */

struct ctask {
	char *dst;
	const char *src;
	uint64_t len, dpitch, spitch;
	uint32_t rows, slices;
	uint64_t dslice, sslice;
	struct fsig *sig;
	struct fsig *dep[4];   /* dependencies: the copy starts once each is 0 */
	uint32_t n_dep;
	int negative;
	int fault;
	uint64_t va;      /* the device address faulted on */
	int gpu;
};

/* The fault path of ROCr: handlers first, abort unless one took it. */
static void gpu_fault(struct ctask *t)
{
	hsa_amd_event_t ev;
	int claimed = 0, n;

	fake_copy_halt(t->gpu); /* KFD evicts the process's queues on that GPU, then reports */
	atomic_fetch_add(&st_faults, 1);
	memset(&ev, 0, sizeof(ev));
	ev.event_type = HSA_AMD_GPU_MEMORY_FAULT_EVENT;
	ev.memory_fault.agent.handle = GPU_AGENT + (uint64_t)(t->gpu < 0 ? 0 : t->gpu);
	ev.memory_fault.virtual_address = t->va;
	ev.memory_fault.fault_reason_mask = HSA_AMD_MEMORY_FAULT_PAGE_NOT_PRESENT;
	pthread_mutex_lock(&lock);
	n = n_handlers;
	pthread_mutex_unlock(&lock);
	for (int i = 0; i < n; i++)
		if (handlers[i].cb(&ev, handlers[i].data) == HSA_STATUS_SUCCESS)
			claimed = 1;
	if (!claimed) {
		fprintf(stderr, "fake hsa: Memory access fault by GPU node-%d on address %#llx. "
			"Reason: Page not present or supervisor privilege.\n", t->gpu + 1,
			(unsigned long long)t->va);
		abort();
	}
}

/* Validates dep_signals into t (at most 4, as the tests use): 0 or a status. */
static hsa_status_t take_deps(struct ctask *t, uint32_t n, const hsa_signal_t *deps)
{
	if (n > 4)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	for (uint32_t i = 0; i < n; i++)
		if (!(t->dep[i] = sig_of(deps[i])))
			return HSA_STATUS_ERROR_INVALID_SIGNAL;
	t->n_dep = n;
	return HSA_STATUS_SUCCESS;
}

static void run_copy(void *arg)
{
	struct ctask *t = arg;

	/* as an SDMA queue's poll packet: the queue waits here, reading the
	 * value word, until every dependency is 0 */
	for (uint32_t i = 0; i < t->n_dep; i++)
		while (__atomic_load_n(&t->dep[i]->v, __ATOMIC_ACQUIRE) != 0)
			usleep(200);

	if (t->fault) {
		if (fake_copy_begin(t->gpu)) {
			memcpy(t->dst, t->src, t->len / 2); /* torn: the fault hit midway */
			fake_copy_end(t->gpu);
			gpu_fault(t);
		}
		free(t);
		return;
	}
	if (!fake_copy_begin(t->gpu)) { /* a stopped queue runs nothing, signals nothing */
		free(t);
		return;
	}
	for (uint32_t z = 0; z < t->slices; z++)
		for (uint32_t r = 0; r < t->rows; r++)
			memcpy(t->dst + z * t->dslice + r * t->dpitch,
			       t->src + z * t->sslice + r * t->spitch, t->len);
	fake_copy_end(t->gpu);
	if (t->negative)
		sig_update(t->sig, 1, -1);
	else
		sig_update(t->sig, 0, -1);
	free(t);
}

/* Resolves one side of a copy and checks the agent named for it. */
static char *side(const void *p, uint64_t len, hsa_agent_t agent, const char *what)
{
	struct fake_region r;
	const char *why = "";
	char *h = fake_translate((uint64_t)(uintptr_t)p, len, &why);

	if (!h) {
		fprintf(stderr, "fake hsa: %s %p+%llu: %s\n", what, p, (unsigned long long)len, why);
		atomic_fetch_add(&st_bad_pointer, 1);
		return NULL;
	}
	fake_region_find((uint64_t)(uintptr_t)p, len, &r);
	if (r.kind == FAKE_DEV && gpu_of(agent) != r.owner) {
		fprintf(stderr, "fake hsa: %s is memory of GPU %d but agent %#llx was named\n",
			what, r.owner, (unsigned long long)agent.handle);
		return NULL;
	}
	if (r.kind != FAKE_DEV && gpu_of(agent) < 0 && !is_cpu(agent))
		return NULL;
	return h;
}

#define COMPUTE_LANE (N_SDMA + 2)

static hsa_status_t submit_copy(void *dst, hsa_agent_t dst_agent, const void *src,
				hsa_agent_t src_agent, size_t size, uint32_t n_dep,
				const hsa_signal_t *deps, hsa_signal_t completion, int lane)
{
	struct fsig *f = sig_of(completion);
	struct ctask *t;
	char *d, *s;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!f)
		return HSA_STATUS_ERROR_INVALID_SIGNAL;
	if ((gpu_of(dst_agent) < 0 && !is_cpu(dst_agent)) ||
	    (gpu_of(src_agent) < 0 && !is_cpu(src_agent)))
		return HSA_STATUS_ERROR_INVALID_AGENT;
	if (!dst || !src)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	if (size == 0)
		return HSA_STATUS_SUCCESS;
	if (gpu_of(dst_agent) < 0 && gpu_of(src_agent) < 0)
		return HSA_STATUS_ERROR_INVALID_AGENT; /* no GPU to copy with */
	d = side(dst, size, dst_agent, "dst");
	s = side(src, size, src_agent, "src");
	if (!d || !s)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	if (trip(&fail_copy))
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	t = calloc(1, sizeof(*t));
	if (!t)
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	*t = (struct ctask){ .dst = d, .src = s, .len = size, .rows = 1, .slices = 1,
			     .sig = f, .negative = trip(&neg_signal), .fault = trip(&fault_copy),
			     .gpu = gpu_of(dst_agent) >= 0 ? gpu_of(dst_agent) : gpu_of(src_agent),
			     .va = (uint64_t)(uintptr_t)(gpu_of(dst_agent) >= 0 ? dst : src) +
				   size / 2 };
	if (take_deps(t, n_dep, deps)) {
		free(t);
		return HSA_STATUS_ERROR_INVALID_SIGNAL;
	}
	if (lane != COMPUTE_LANE) /* a kernel's writes are not DMA copies */
		atomic_fetch_add(&st_copies, 1);
	if (lane < 0) /* ROCr's own choice: one blit queue per direction */
		lane = gpu_of(dst_agent) >= 0 ? N_SDMA + 1 : N_SDMA;
	fake_worker_push_lane(lane, run_copy, t);
	return HSA_STATUS_SUCCESS;
}

/* A kernel's writes (the fake HIP's fills and copy kernel): the copy on the
 * GPU's compute lane (COMPUTE_LANE), not an SDMA or blit one -- a kernel
 * does not queue behind copies, nor they behind it. */
EXPORT hsa_status_t kvt_fake_hsa_kernel_copy(void *dst, hsa_agent_t dst_agent, const void *src,
					     hsa_agent_t src_agent, size_t size,
					     hsa_signal_t completion_signal)
{
	return submit_copy(dst, dst_agent, src, src_agent, size, 0, NULL, completion_signal,
			   COMPUTE_LANE);
}

EXPORT hsa_status_t hsa_amd_memory_async_copy(void *dst, hsa_agent_t dst_agent, const void *src,
					      hsa_agent_t src_agent, size_t size,
					      uint32_t num_dep_signals,
					      const hsa_signal_t *dep_signals,
					      hsa_signal_t completion_signal)
{
	if (num_dep_signals && !dep_signals)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	return submit_copy(dst, dst_agent, src, src_agent, size, num_dep_signals, dep_signals,
			   completion_signal, -1);
}

#ifndef FAKE_HSA_52
EXPORT hsa_status_t hsa_amd_memory_async_copy_on_engine(void *dst, hsa_agent_t dst_agent,
							const void *src, hsa_agent_t src_agent,
							size_t size, uint32_t num_dep_signals,
							const hsa_signal_t *dep_signals,
							hsa_signal_t completion_signal,
							uint32_t engine_id, bool force_copy_on_sdma)
{
	hsa_status_t st;
	int e;

	(void)force_copy_on_sdma;
	if ((num_dep_signals && !dep_signals) || !engine_id || (engine_id & (engine_id - 1)))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT; /* exactly one bit */
	e = __builtin_ctz(engine_id);
	if (e >= N_SDMA)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	if (trip(&fail_engine))
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	st = submit_copy(dst, dst_agent, src, src_agent, size, num_dep_signals, dep_signals,
			 completion_signal, e);
	if (st == HSA_STATUS_SUCCESS) {
		atomic_fetch_add(&st_engine_copies, 1);
		atomic_fetch_add(&st_engine_used[e], 1);
	}
	return st;
}

EXPORT hsa_status_t hsa_amd_memory_copy_engine_status(hsa_agent_t dst_agent,
						      hsa_agent_t src_agent,
						      uint32_t *engine_ids_mask)
{
	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if ((gpu_of(dst_agent) < 0 && !is_cpu(dst_agent)) ||
	    (gpu_of(src_agent) < 0 && !is_cpu(src_agent)) || !engine_ids_mask)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	/* as ROCr: only the engines idle now; none idle is an error */
	*engine_ids_mask = ((1u << N_SDMA) - 1) & ~(uint32_t)atomic_load(&busy_engines);
	return *engine_ids_mask ? HSA_STATUS_SUCCESS : HSA_STATUS_ERROR_OUT_OF_RESOURCES;
}
#endif

EXPORT hsa_status_t hsa_amd_memory_async_copy_rect(
	const hsa_pitched_ptr_t *dst, const hsa_dim3_t *dst_offset, const hsa_pitched_ptr_t *src,
	const hsa_dim3_t *src_offset, const hsa_dim3_t *range, hsa_agent_t copy_agent,
	hsa_amd_copy_direction_t dir, uint32_t num_dep_signals, const hsa_signal_t *dep_signals,
	hsa_signal_t completion_signal)
{
	struct fsig *f = sig_of(completion_signal);
	struct fake_region rd, rs;
	struct ctask *t;
	uint64_t dext, sext;
	char *d, *s;
	const char *why = "";

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!f)
		return HSA_STATUS_ERROR_INVALID_SIGNAL;
	if (gpu_of(copy_agent) < 0)
		return HSA_STATUS_ERROR_INVALID_AGENT; /* CPU agents are not supported */
	if ((num_dep_signals && !dep_signals) || !range->x || !range->y || !range->z)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	if (atomic_load(&fail_rect))
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES; /* like "no SDMA" */
	/* ROCr's checks: DWORD alignment, the rect inside the pitches */
	if ((uintptr_t)dst->base % 4 || (uintptr_t)src->base % 4 || dst->pitch % 4 ||
	    src->pitch % 4 || dst->slice % 4 || src->slice % 4 ||
	    dst_offset->x + (uint64_t)range->x > dst->pitch ||
	    src_offset->x + (uint64_t)range->x > src->pitch ||
	    (src->slice && src_offset->y + (uint64_t)range->y > src->slice / src->pitch) ||
	    (dst->slice && dst_offset->y + (uint64_t)range->y > dst->slice / dst->pitch) ||
	    (range->z > 1 && (!src->slice || !dst->slice)) ||
	    src->pitch > (1u << 19) || dst->pitch > (1u << 19))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	dext = (dst_offset->z + range->z - 1ull) * dst->slice +
	       (dst_offset->y + range->y - 1ull) * dst->pitch + dst_offset->x + range->x;
	sext = (src_offset->z + range->z - 1ull) * src->slice +
	       (src_offset->y + range->y - 1ull) * src->pitch + src_offset->x + range->x;
	d = fake_translate((uint64_t)(uintptr_t)dst->base, dext, &why);
	if (d)
		s = fake_translate((uint64_t)(uintptr_t)src->base, sext, &why);
	if (!d || !s) {
		fprintf(stderr, "fake hsa: rect: %s\n", why);
		atomic_fetch_add(&st_bad_pointer, 1);
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	}
	fake_region_find((uint64_t)(uintptr_t)dst->base, dext, &rd);
	fake_region_find((uint64_t)(uintptr_t)src->base, sext, &rs);
	if ((dir == hsaDeviceToHost && (rs.kind != FAKE_DEV || rd.kind == FAKE_DEV)) ||
	    (dir == hsaHostToDevice && (rd.kind != FAKE_DEV || rs.kind == FAKE_DEV)) ||
	    (dir != hsaDeviceToHost && dir != hsaHostToDevice))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	if (trip(&fail_copy))
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	t = calloc(1, sizeof(*t));
	if (!t)
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	*t = (struct ctask){
		.dst = d + dst_offset->z * dst->slice + dst_offset->y * dst->pitch + dst_offset->x,
		.src = s + src_offset->z * src->slice + src_offset->y * src->pitch + src_offset->x,
		.len = range->x, .rows = range->y, .slices = range->z,
		.dpitch = dst->pitch, .spitch = src->pitch,
		.dslice = dst->slice, .sslice = src->slice,
		.sig = f, .negative = trip(&neg_signal), .fault = trip(&fault_copy),
		.gpu = gpu_of(copy_agent),
		.va = (uint64_t)(uintptr_t)(dir == hsaHostToDevice ? dst->base : src->base),
	};
	if (take_deps(t, num_dep_signals, dep_signals)) {
		free(t);
		return HSA_STATUS_ERROR_INVALID_SIGNAL;
	}
	atomic_fetch_add(&st_copies, 1);
	atomic_fetch_add(&st_rect_copies, 1);
	fake_worker_push_lane(dir == hsaHostToDevice ? N_SDMA + 1 : N_SDMA, run_copy, t);
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_amd_register_system_event_handler(hsa_amd_system_event_callback_t callback,
							  void *data)
{
	hsa_status_t st = HSA_STATUS_SUCCESS;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!callback)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	pthread_mutex_lock(&lock);
	if (n_handlers == MAX_HANDLERS)
		st = HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	else {
		handlers[n_handlers].cb = callback;
		handlers[n_handlers].data = data;
		n_handlers++;
	}
	pthread_mutex_unlock(&lock);
	return st;
}

/* ---- IPC memory ------------------------------------------------------------
 * As ROCr: hsa_amd_ipc_memory_create exports a whole allocation of this
 * process's GPU pool; hsa_amd_ipc_memory_attach in another process maps it
 * as device memory of the exporting GPU (refused in the exporting process,
 * and once the exporter is gone); detach unmaps it.  The handle's 32 bytes
 * name the exporter's pid and memfd (fake_ipc_export). */
struct ipc_wire {
	uint32_t magic;
	int32_t pid, fd, owner;
	uint64_t len;
};
_Static_assert(sizeof(struct ipc_wire) <= sizeof(hsa_amd_ipc_memory_t), "a handle's bytes");

EXPORT hsa_status_t hsa_amd_ipc_memory_create(void *ptr, size_t len, hsa_amd_ipc_memory_t *handle)
{
	struct ipc_wire w = { .magic = IPC_MAGIC, .pid = getpid() };
	struct fake_region r;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!handle || fake_region_find((uint64_t)(uintptr_t)ptr, 1, &r) ||
	    r.dev != (uint64_t)(uintptr_t)ptr || r.kind != FAKE_DEV || (r.flags & F_IPC) ||
	    !len || len > FAKE_PAGES(r.len))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	w.fd = fake_ipc_export(r.dev, r.host, r.len);
	if (w.fd < 0)
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	w.owner = r.owner;
	w.len = len;
	memset(handle, 0, sizeof(*handle));
	memcpy(handle, &w, sizeof(w));
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_amd_ipc_memory_attach(const hsa_amd_ipc_memory_t *handle, size_t len,
					      uint32_t num_agents, const hsa_agent_t *mapping_agents,
					      void **mapped_ptr)
{
	struct ipc_wire w;
	uint64_t dev;
	void *p;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (!handle || !mapped_ptr || (num_agents && !mapping_agents))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	for (uint32_t i = 0; i < num_agents; i++)
		if (gpu_of(mapping_agents[i]) < 0)
			return HSA_STATUS_ERROR_INVALID_AGENT;
	memcpy(&w, handle, sizeof(w));
	if (w.magic != IPC_MAGIC || w.len != len || w.owner < 0 || w.owner >= n_gpus)
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	if (fake_ipc_map(w.pid, w.fd, w.len, &p))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	dev = fake_region_add(FAKE_DEV, w.len, p, w.owner, F_IPC);
	if (!dev) {
		munmap(p, FAKE_PAGES(w.len));
		return HSA_STATUS_ERROR_OUT_OF_RESOURCES;
	}
	*mapped_ptr = (void *)(uintptr_t)dev;
	return HSA_STATUS_SUCCESS;
}

EXPORT hsa_status_t hsa_amd_ipc_memory_detach(void *mapped_ptr)
{
	struct fake_region r;

	if (!inited())
		return HSA_STATUS_ERROR_NOT_INITIALIZED;
	if (fake_region_find((uint64_t)(uintptr_t)mapped_ptr, 1, &r) ||
	    r.dev != (uint64_t)(uintptr_t)mapped_ptr || !(r.flags & F_IPC))
		return HSA_STATUS_ERROR_INVALID_ARGUMENT;
	fake_region_del(r.dev, NULL);
	munmap(r.host, FAKE_PAGES(r.len));
	return HSA_STATUS_SUCCESS;
}
