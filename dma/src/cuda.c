/* cuda.c - the NVIDIA backend: CUDA driver API copies between the GPU's KV
 * pages and the registered arena, on a few streams.
 *
 * Runtime.  libcuda.so.1 is dlopen'ed (never linked) and every entry point
 * is resolved through cuGetProcAddress into the versioned PFN_* types of
 * cudaTypedefs.h, asking for exactly the version of the prototype we
 * compiled against -- the way NCCL and PyTorch avoid ABI drift across
 * drivers.  cuMemcpyBatchAsync (CUDA 12.8+) changed its prototype in 13.0
 * (the failIdx argument went away), so the version asked for follows the
 * version the driver reports.  No driver, cuInit failing or no device all
 * mean "unavailable".  The library is not unloaded at close: drivers do not
 * support being unloaded and reloaded in one process.
 *
 * Context.  The device's primary context -- the one the engine's CUDA
 * runtime (PyTorch) uses -- retained for the handle's life, pushed around
 * every call and popped after, so the calling thread's current context is
 * left as it was.
 *
 * Pointers.  The arena is registered per piece with cuMemHostRegister
 * (PORTABLE | DEVICEMAP) and copies use the device pointer that
 * cuMemHostGetDevicePointer returns for it: equal to the host pointer on
 * ordinary UVA systems, different where a visible device cannot use host
 * pointers, and valid in both cases.
 *
 * The copy kernel.  Plans of small pages (below kernel_below, 28 KiB by
 * default: where the copy engines' cost per descriptor dominates) go
 * through kvt_copy_pages (copy_kernel.c) instead: compiled to PTX for the
 * device by the NVRTC found at run time (nvrtc.c), loaded into the primary
 * context with cuModuleLoadData, launched on the ticket's stream with the
 * plan's copies as descriptors in the slot's pinned, device-mapped buffer
 * (rewritten only once the slot's ticket has completed), on at most
 * kernel_ctas thread blocks -- a bounded share of the SMs.  Its threads
 * read and write the arena through its DEVICEMAP registration.  Every
 * address a descriptor holds comes from the plan, checked against the
 * KV cache's allocations at bind (struct kvt_range) and the registered
 * pieces: a kernel fault, unlike a failed DMA, is sticky for the whole
 * context -- the engine's too.  No NVRTC, a target it cannot make or a
 * driver that rejects its PTX: DMA only, said in the log and the feature
 * line.  (The HIP twin: hsa.c, "The copy kernel", compiled by hiprtc.)
 *
 * Completion.  A ticket's copies go on one stream (slot modulo the number
 * of streams), followed by the slot's event; poll is cuEventQuery, wait
 * sleeps between queries (or cuEventSynchronize without a timeout).  If
 * issuing fails part way, the stream is synchronized before submit returns
 * -EIO, so a failed submit leaves nothing in flight.
 */
#include "dma_int.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>
#include <cudaTypedefs.h>

#define MAX_STREAMS 16

struct cu_fns {
	PFN_cuInit_v2000 init;
	PFN_cuDriverGetVersion_v2020 driver_version;
	PFN_cuDeviceGetCount_v2000 device_count;
	PFN_cuDeviceGet_v2000 device_get;
	PFN_cuDeviceGetAttribute_v2000 device_attr;
	PFN_cuDeviceGetName_v2000 device_name;
	PFN_cuDevicePrimaryCtxRetain_v7000 ctx_retain;
	PFN_cuDevicePrimaryCtxRelease_v11000 ctx_release;
	PFN_cuCtxPushCurrent_v4000 ctx_push;
	PFN_cuCtxPopCurrent_v4000 ctx_pop;
	PFN_cuStreamCreate_v2000 stream_create;
	PFN_cuStreamDestroy_v4000 stream_destroy;
	PFN_cuStreamSynchronize_v2000 stream_sync;
	PFN_cuEventCreate_v2000 event_create;
	PFN_cuEventDestroy_v4000 event_destroy;
	PFN_cuEventRecord_v2000 event_record;
	PFN_cuEventQuery_v2000 event_query;
	PFN_cuEventSynchronize_v2000 event_sync;
	PFN_cuStreamWaitEvent_v3020 stream_wait_event;
	PFN_cuMemHostRegister_v6050 host_register;
	PFN_cuMemHostUnregister_v4000 host_unregister;
	PFN_cuMemHostGetDevicePointer_v3020 host_dev_ptr;
	PFN_cuMemcpyAsync_v4000 memcpy_async;
	PFN_cuMemcpy2DAsync_v3020 memcpy_2d_async;
	PFN_cuMemAlloc_v3020 mem_alloc;
	PFN_cuMemFree_v3020 mem_free;
	PFN_cuMemAllocHost_v3020 alloc_host;
	PFN_cuMemFreeHost_v2000 free_host;
	PFN_cuMemHostAlloc_v2020 host_alloc;
	PFN_cuMemcpyHtoD_v3020 htod;
	PFN_cuMemcpyDtoH_v3020 dtoh;
	PFN_cuMemcpyHtoDAsync_v3020 htod_async;
	PFN_cuMemcpyDtoHAsync_v3020 dtoh_async;
	PFN_cuPointerGetAttribute_v4000 ptr_attr;
	PFN_cuGetErrorName_v6000 err_name;
	/* optional */
	PFN_cuMemcpyBatchAsync_v12080 batch_12080;
	PFN_cuMemcpyBatchAsync_v13000 batch_13000;
	PFN_cuModuleLoadData_v2000 module_load;      /* the copy kernel */
	PFN_cuModuleGetFunction_v2000 module_fn;
	PFN_cuModuleUnload_v2000 module_unload;
	PFN_cuLaunchKernel_v4000 launch;
	PFN_cuIpcOpenMemHandle_v11000 ipc_open_mem; /* another process's memory */
	PFN_cuIpcCloseMemHandle_v4010 ipc_close_mem;
	PFN_cuIpcOpenEventHandle_v4010 ipc_open_event;
	PFN_cuIpcGetEventHandle_v4010 ipc_get_event;
	PFN_cuDeviceGetUuid_v11040 device_uuid;
	PFN_cuIpcGetMemHandle_v4010 ipc_get_mem;    /* timeline semaphores */
	PFN_cuStreamWaitValue64_v11070 wait_value;
	PFN_cuStreamWriteValue64_v11070 write_value;
};

struct sym {
	const char *name;
	int version;   /* of the PFN prototype we hold */
	size_t off;
};

#define SYM(field, name, ver) { name, ver, offsetof(struct cu_fns, field) }
static const struct sym syms[] = {
	SYM(init, "cuInit", 2000),
	SYM(driver_version, "cuDriverGetVersion", 2020),
	SYM(device_count, "cuDeviceGetCount", 2000),
	SYM(device_get, "cuDeviceGet", 2000),
	SYM(device_attr, "cuDeviceGetAttribute", 2000),
	SYM(device_name, "cuDeviceGetName", 2000),
	SYM(ctx_retain, "cuDevicePrimaryCtxRetain", 7000),
	SYM(ctx_release, "cuDevicePrimaryCtxRelease", 11000),
	SYM(ctx_push, "cuCtxPushCurrent", 4000),
	SYM(ctx_pop, "cuCtxPopCurrent", 4000),
	SYM(stream_create, "cuStreamCreate", 2000),
	SYM(stream_destroy, "cuStreamDestroy", 4000),
	SYM(stream_sync, "cuStreamSynchronize", 2000),
	SYM(event_create, "cuEventCreate", 2000),
	SYM(event_destroy, "cuEventDestroy", 4000),
	SYM(event_record, "cuEventRecord", 2000),
	SYM(event_query, "cuEventQuery", 2000),
	SYM(event_sync, "cuEventSynchronize", 2000),
	SYM(stream_wait_event, "cuStreamWaitEvent", 3020),
	SYM(host_register, "cuMemHostRegister", 6050),
	SYM(host_unregister, "cuMemHostUnregister", 4000),
	SYM(host_dev_ptr, "cuMemHostGetDevicePointer", 3020),
	SYM(memcpy_async, "cuMemcpyAsync", 4000),
	SYM(memcpy_2d_async, "cuMemcpy2DAsync", 3020),
	SYM(mem_alloc, "cuMemAlloc", 3020),
	SYM(mem_free, "cuMemFree", 3020),
	SYM(alloc_host, "cuMemAllocHost", 3020),
	SYM(free_host, "cuMemFreeHost", 2000),
	SYM(host_alloc, "cuMemHostAlloc", 2020),
	SYM(htod, "cuMemcpyHtoD", 3020),
	SYM(dtoh, "cuMemcpyDtoH", 3020),
	SYM(htod_async, "cuMemcpyHtoDAsync", 3020),
	SYM(dtoh_async, "cuMemcpyDtoHAsync", 3020),
	SYM(ptr_attr, "cuPointerGetAttribute", 4000),
	SYM(err_name, "cuGetErrorName", 6000),
};

/* Per ticket slot: the event, scratch for a batch call, and the copy
 * kernel's descriptors (pinned, device-mapped: kd_dev). */
struct cu_slot {
	CUevent ev;
	CUdeviceptr *dsts, *srcs;
	size_t *sizes;
	uint32_t cap;
	struct kvt__kcopy *kd;
	CUdeviceptr kd_dev;
	uint32_t kcap;
};

struct cu_be {
	void *lib;
	struct cu_fns f;
	int driver;                 /* e.g. 13000 */
	int n_devices;

	int bound;
	CUdevice dev;
	CUcontext ctx;
	int ordinal;
	int max_pitch;
	int engines;
	uint32_t n_streams;
	CUstream streams[MAX_STREAMS];
	uint32_t n_slots;
	struct cu_slot *slots;
	int use_batch;
	CUresult lost;              /* a sticky error seen: the context is unusable */
	/* The engine's fence (cu_order_after): recorded on the engine's
	 * stream; each copy stream waits on its latest record once before
	 * its next copy.  Under fence_mu: a record and the waits that must
	 * see it. */
	pthread_mutex_t fence_mu;
	CUevent fence;
	uint32_t fence_gen;         /* records made; 0: none (written under
				     * fence_mu, read __atomic by cu_submit) */
	uint32_t stream_gen[MAX_STREAMS]; /* the record each stream waits behind
					   * (likewise) */
	/* the copy kernel: kfn NULL when copies are DMA only */
	CUmodule kmod;
	CUfunction kfn;
	uint64_t k_below;
	uint32_t k_ctas;
	char kwhat[200];            /* which NVRTC and target, or why none */
};

static const char *err_str(const struct cu_be *be, CUresult r)
{
	const char *s = NULL;

	if (be->f.err_name && be->f.err_name(r, &s) == CUDA_SUCCESS && s)
		return s;
	return "CUDA_ERROR_?";
}

static int cu_errno(CUresult r)
{
	switch (r) {
	case CUDA_SUCCESS:
		return 0;
	case CUDA_ERROR_OUT_OF_MEMORY:
		return -ENOMEM;
	case CUDA_ERROR_INVALID_VALUE:
		return -EINVAL;
	case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
		return -EEXIST;
	case CUDA_ERROR_NOT_PERMITTED:
		return -EPERM;
	case CUDA_ERROR_NOT_SUPPORTED:
		return -ENOTSUP;
	default:
		return -EIO;
	}
}

/* The errors after which, cuda.h says, "the process is in an inconsistent
 * state and any further CUDA work will return the same error": a fault in
 * some kernel or copy of the context -- the engine's own, or ours: the
 * context is the device's primary one, shared with PyTorch.  Nothing done
 * in the process can clear it.  Seen once, the backend is lost: every later
 * submit, poll and wait fails at once with -EIO saying so, instead of
 * being retried as if one chunk had failed. */
static int cu_sticky(CUresult r)
{
	/* By value, not by name, for the codes newer headers added: a build
	 * against an older toolkit still knows them (the driver it meets may
	 * be newer than its headers). */
	switch ((int)r) {
	case CUDA_ERROR_ILLEGAL_ADDRESS:
	case CUDA_ERROR_LAUNCH_TIMEOUT:
	case CUDA_ERROR_ASSERT:
	case CUDA_ERROR_HARDWARE_STACK_ERROR:
	case CUDA_ERROR_ILLEGAL_INSTRUCTION:
	case CUDA_ERROR_MISALIGNED_ADDRESS:
	case CUDA_ERROR_INVALID_ADDRESS_SPACE:
	case CUDA_ERROR_INVALID_PC:
	case CUDA_ERROR_LAUNCH_FAILED:
	case 226: /* CUDA_ERROR_CONTAINED: a contained hardware or kernel fault */
	case 721: /* CUDA_ERROR_TENSOR_MEMORY_LEAK: a kernel left tensor memory */
	case 810: /* CUDA_ERROR_MPS_CLIENT_TERMINATED: the MPS server ended us */
	case 911: /* CUDA_ERROR_EXTERNAL_DEVICE: an external device's error */
		return 1;
	default:
		return 0;
	}
}

static void cu_mark_lost(struct kvt_dma *d, CUresult r)
{
	struct cu_be *be = d->be;

	if (!cu_sticky(r) || be->lost)
		return;
	be->lost = r;
	kvt__dma_log(d, KVT_DMA_LOG_ERR, "cuda: the context is lost: %s (%d). This error "
		     "is sticky: every later call in this CUDA context fails, the engine's "
		     "own work included (it is the device's primary context); kvtier "
		     "makes no more copies in this process: restart it", err_str(be, r), (int)r);
}

static int cu_lost_err(const struct cu_be *be)
{
	return kvt__dma_err(-EIO, "cuda: the context was lost (%s, a sticky error): no copy "
			    "can run in this process any more; restart it", err_str(be, be->lost));
}

#define CU_FAIL(be, r, fmt, ...) \
	kvt__dma_err(cu_errno(r), "cuda: " fmt ": %s (%d)", ##__VA_ARGS__, \
		     err_str(be, r), (int)(r))

static int push(struct cu_be *be)
{
	CUresult r = be->f.ctx_push(be->ctx);

	return r ? CU_FAIL(be, r, "cuCtxPushCurrent") : 0;
}

static void pop(struct cu_be *be)
{
	CUcontext c;

	be->f.ctx_pop(&c);
}

/* ---- init / fini --------------------------------------------------------- */

static void unbind(struct cu_be *be)
{
	if (!be->bound)
		return;
	if (push(be) == 0) {
		for (uint32_t i = 0; i < be->n_slots; i++) {
			be->f.event_destroy(be->slots[i].ev);
			free(be->slots[i].dsts);
			free(be->slots[i].srcs);
			free(be->slots[i].sizes);
			if (be->slots[i].kd)
				be->f.free_host(be->slots[i].kd);
		}
		if (be->kmod)
			be->f.module_unload(be->kmod);
		for (uint32_t i = 0; i < be->n_streams; i++)
			be->f.stream_destroy(be->streams[i]);
		if (be->fence)
			be->f.event_destroy(be->fence);
		pop(be);
	}
	free(be->slots);
	be->slots = NULL;
	be->kmod = NULL;
	be->kfn = NULL;
	be->fence = NULL;
	be->fence_gen = 0;
	memset(be->stream_gen, 0, sizeof(be->stream_gen));
	be->n_slots = be->n_streams = 0;
	be->f.ctx_release(be->dev);
	be->bound = 0;
}

static void cu_fini(struct kvt_dma *d)
{
	struct cu_be *be = d->be;

	if (!be)
		return;
	unbind(be);
	pthread_mutex_destroy(&be->fence_mu);
	free(be);
	d->be = NULL;
}

/* The copy kernel for the bound device, in the pushed context: kfn set, or
 * kwhat saying why copies stay DMA only (logged, never an error). */
static void kernel_load(struct kvt_dma *d)
{
	struct cu_be *be = d->be;
	int major = 0, minor = 0, sms = 0;
	char *ptx = NULL, what[160] = "";
	CUresult r;

	be->k_below = d->cfg.kernel_below ? d->cfg.kernel_below : KVT_DMA_KERNEL_BELOW_DEFAULT;
	if (d->cfg.flags & KVT_DMA_F_NO_KERNEL) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: asked (KVT_DMA_F_NO_KERNEL)");
		return;
	}
	if (!be->f.module_load || !be->f.module_fn || !be->f.module_unload || !be->f.launch) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: the driver lacks the module API");
		goto dma_only;
	}
	if (be->f.device_attr(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, be->dev) ||
	    be->f.device_attr(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, be->dev) ||
	    be->f.device_attr(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, be->dev) ||
	    major <= 0 || sms <= 0) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: no compute capability");
		goto dma_only;
	}
	if (kvt__nvrtc_ptx(major * 10 + minor, &ptx, what, sizeof(what))) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: %s", what);
		goto dma_only;
	}
	r = be->f.module_load(&be->kmod, ptx);
	free(ptx);
	if (r) {
		be->kmod = NULL;
		snprintf(be->kwhat, sizeof(be->kwhat), "off: cuModuleLoadData of %s's PTX: %s (%d)",
			 what, err_str(be, r), (int)r);
		goto dma_only;
	}
	r = be->f.module_fn(&be->kfn, be->kmod, kvt__copy_kernel_name);
	if (r) {
		be->f.module_unload(be->kmod);
		be->kmod = NULL;
		be->kfn = NULL;
		snprintf(be->kwhat, sizeof(be->kwhat), "off: cuModuleGetFunction(%s): %s (%d)",
			 kvt__copy_kernel_name, err_str(be, r), (int)r);
		goto dma_only;
	}
	be->k_ctas = d->cfg.kernel_ctas ? d->cfg.kernel_ctas : (uint32_t)(sms / 8 ? sms / 8 : 1);
	snprintf(be->kwhat, sizeof(be->kwhat), "pages below %llu KiB (%s, %u of %d SMs)",
		 (unsigned long long)(be->k_below >> 10), what, be->k_ctas, sms);
	return;
dma_only:
	kvt__dma_log(d, KVT_DMA_LOG_INFO, "cuda: copy kernel %s: every copy by DMA "
		     "(small pages run slower)", be->kwhat);
}

static int set_device(struct kvt_dma *d, int ordinal)
{
	struct cu_be *be = d->be;
	char name[128] = "";
	uint32_t want = d->cfg.n_workers && !(d->cfg.flags & KVT_DMA_F_HOST_WORKERS) ?
			d->cfg.n_workers : 4;
	CUresult r;
	int rc;

	if (want > MAX_STREAMS)
		want = MAX_STREAMS;

	r = be->f.device_get(&be->dev, ordinal);
	if (r)
		return CU_FAIL(be, r, "cuDeviceGet(%d)", ordinal);
	r = be->f.ctx_retain(&be->ctx, be->dev);
	if (r)
		return CU_FAIL(be, r, "cuDevicePrimaryCtxRetain(%d)", ordinal);
	be->bound = 1;
	be->ordinal = ordinal;
	be->f.device_name(name, sizeof(name) - 1, be->dev);
	if (be->f.device_attr(&be->max_pitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, be->dev) ||
	    be->max_pitch <= 0)
		be->max_pitch = 0;
	if (be->f.device_attr(&be->engines, CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, be->dev))
		be->engines = 0;
	be->slots = calloc(d->cfg.max_inflight, sizeof(*be->slots));
	if (!be->slots) {
		unbind(be);
		return kvt__dma_err(-ENOMEM, "cuda: out of memory");
	}
	rc = push(be);
	if (rc) {
		unbind(be);
		return rc;
	}
	for (; be->n_streams < want; be->n_streams++) {
		r = be->f.stream_create(&be->streams[be->n_streams], CU_STREAM_NON_BLOCKING);
		if (r)
			break;
	}
	for (; !r && be->n_slots < d->cfg.max_inflight; be->n_slots++) {
		/* a wait without a deadline sleeps in the driver instead of
		 * spinning a core (the engine's other ranks need the CPUs) */
		r = be->f.event_create(&be->slots[be->n_slots].ev,
				       CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC);
		if (r)
			break;
	}
	if (!r)
		r = be->f.event_create(&be->fence, CU_EVENT_DISABLE_TIMING);
	if (!r)
		kernel_load(d);
	pop(be);
	if (r) {
		rc = CU_FAIL(be, r, "creating streams and events");
		unbind(be);
		return rc;
	}
	d->device = ordinal;
	be->use_batch = !(d->cfg.flags & KVT_DMA_F_NO_BATCH) &&
			(be->f.batch_13000 || be->f.batch_12080);
	snprintf(d->feature, sizeof(d->feature),
		 "%s (device %d of %d), driver %d.%d, %d copy engines, %u streams, "
		 "batch %s, 2-D %s, copy kernel %s", name, ordinal, be->n_devices,
		 be->driver / 1000, be->driver % 1000 / 10, be->engines, be->n_streams,
		 be->use_batch ? (be->f.batch_13000 ? "yes (13.0)" : "yes (12.8)") : "no",
		 be->max_pitch > 0 ? "yes" : "no", be->kwhat);
	return 0;
}

typedef CUresult (*gpa_v2_fn)(const char *, void **, int, cuuint64_t,
			      CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa_v1_fn)(const char *, void **, int, cuuint64_t);

static void *resolve(void *gpa, int v2, const char *name, int version)
{
	void *fn = NULL;
	CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SUCCESS;
	CUresult r;

	if (v2)
		r = ((gpa_v2_fn)gpa)(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &q);
	else
		r = ((gpa_v1_fn)gpa)(name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT);
	return r == CUDA_SUCCESS && q == CU_GET_PROC_ADDRESS_SUCCESS ? fn : NULL;
}

static int cu_init(struct kvt_dma *d, char *why, size_t why_len)
{
	const char *path = getenv("KVTIER_CUDA_LIBRARY");
	struct cu_be *be;
	void *gpa;
	int v2 = 1, rc;
	CUresult r;

	if (!path || !*path)
		path = "libcuda.so.1";
	be = calloc(1, sizeof(*be));
	if (!be)
		return kvt__fmt(-ENOMEM, why, why_len, "out of memory");
	pthread_mutex_init(&be->fence_mu, NULL);
	d->be = be;
	be->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
	if (!be->lib)
		be->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!be->lib) {
		kvt__fmt(-ENOENT, why, why_len, "%s", dlerror());
		cu_fini(d);
		return -ENOENT;
	}
	gpa = dlsym(be->lib, "cuGetProcAddress_v2"); /* CUDA 12.0+ */
	if (!gpa) {
		gpa = dlsym(be->lib, "cuGetProcAddress"); /* 11.3+ */
		v2 = 0;
	}
	if (!gpa) {
		kvt__fmt(-ENOENT, why, why_len, "%s: no cuGetProcAddress (driver older than "
			 "CUDA 11.3)", path);
		cu_fini(d);
		return -ENOENT;
	}
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		void *fn = resolve(gpa, v2, syms[i].name, syms[i].version);

		if (!fn) {
			kvt__fmt(-ENOENT, why, why_len, "%s: cuGetProcAddress(%s, %d) failed",
				 path, syms[i].name, syms[i].version);
			cu_fini(d);
			return -ENOENT;
		}
		memcpy((char *)&be->f + syms[i].off, &fn, sizeof(fn));
	}
	r = be->f.init(0);
	if (r) {
		kvt__fmt(-ENODEV, why, why_len, "cuInit failed: %s (%d)", err_str(be, r), (int)r);
		cu_fini(d);
		return -ENODEV;
	}
	if (be->f.driver_version(&be->driver))
		be->driver = 0;
	*(void **)&be->f.module_load = resolve(gpa, v2, "cuModuleLoadData", 2000);
	*(void **)&be->f.module_fn = resolve(gpa, v2, "cuModuleGetFunction", 2000);
	*(void **)&be->f.module_unload = resolve(gpa, v2, "cuModuleUnload", 2000);
	*(void **)&be->f.launch = resolve(gpa, v2, "cuLaunchKernel", 4000);
	*(void **)&be->f.ipc_open_mem = resolve(gpa, v2, "cuIpcOpenMemHandle", 11000);
	*(void **)&be->f.ipc_close_mem = resolve(gpa, v2, "cuIpcCloseMemHandle", 4010);
	*(void **)&be->f.ipc_open_event = resolve(gpa, v2, "cuIpcOpenEventHandle", 4010);
	*(void **)&be->f.ipc_get_event = resolve(gpa, v2, "cuIpcGetEventHandle", 4010);
	*(void **)&be->f.device_uuid = resolve(gpa, v2, "cuDeviceGetUuid", 11040);
	*(void **)&be->f.ipc_get_mem = resolve(gpa, v2, "cuIpcGetMemHandle", 4010);
	*(void **)&be->f.wait_value = resolve(gpa, v2, "cuStreamWaitValue64", 11070);
	*(void **)&be->f.write_value = resolve(gpa, v2, "cuStreamWriteValue64", 11070);
	if (be->driver >= 13000)
		be->f.batch_13000 = (PFN_cuMemcpyBatchAsync_v13000)
			resolve(gpa, v2, "cuMemcpyBatchAsync", 13000);
	else if (be->driver >= 12080)
		be->f.batch_12080 = (PFN_cuMemcpyBatchAsync_v12080)
			resolve(gpa, v2, "cuMemcpyBatchAsync", 12080);
	r = be->f.device_count(&be->n_devices);
	if (r || be->n_devices <= 0) {
		kvt__fmt(-ENODEV, why, why_len, "no CUDA device (%s)",
			 r ? err_str(be, r) : "count 0");
		cu_fini(d);
		return -ENODEV;
	}
	if (d->cfg.device >= 0) {
		if (d->cfg.device >= be->n_devices) {
			kvt__fmt(-ENODEV, why, why_len, "device %d: only %d CUDA devices",
				 (int)d->cfg.device, be->n_devices);
			cu_fini(d);
			return -ENODEV;
		}
		rc = set_device(d, d->cfg.device);
		if (rc) {
			kvt__fmt(rc, why, why_len, "%s", kvt_dma_last_error());
			cu_fini(d);
			return rc;
		}
	} else {
		snprintf(d->feature, sizeof(d->feature), "%d devices, driver %d.%d, device "
			 "unbound", be->n_devices, be->driver / 1000, be->driver % 1000 / 10);
	}
	return 0;
}

static int cu_bind(struct kvt_dma *d, const struct kvt_kv_layout *l)
{
	struct cu_be *be = d->be;
	CUdeviceptr seen_lo = 0, seen_hi = 0; /* device memory already walked */
	int ord = -1;

	for (uint32_t k = 0; k < l->n_groups; k++) {
		const struct kvt_kv_group *gr = &l->groups[k];

		for (uint32_t i = 0; i < gr->n_layers; i++) {
			CUdeviceptr p = (CUdeviceptr)gr->layer_base[i], start = 0;
			unsigned int type = 0;
			size_t size = 0;
			int o = -1;
			CUresult r;

			r = be->f.ptr_attr(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p);
			if (!r)
				r = be->f.ptr_attr(&o, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
			if (r || type != CU_MEMORYTYPE_DEVICE)
				return kvt__dma_err(-EINVAL, "cuda: group %u layer %u base %#llx "
						    "is not device memory (%s)", k, i,
						    (unsigned long long)p, r ? err_str(be, r) : "host");
			/* The layer's extent must be device memory of this device.
			 * One tensor may span several mappings (cuMemMap pieces:
			 * PyTorch's expandable segments, vLLM's sleep mode), each
			 * its own range: walk the ones that follow, once for all
			 * the layers inside what was walked already. */
			CUdeviceptr need = p + kvt__layer_extent(gr);
			if (!(p >= seen_lo && need <= seen_hi) &&
			    !be->f.ptr_attr(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p) &&
			    !be->f.ptr_attr(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p) && size) {
				CUdeviceptr end = start + size;
				int rr = kvt__dma_add_range(d, start, end);

				if (rr)
					return rr;
				while (end < need) {
					CUdeviceptr s2 = 0;
					size_t z2 = 0;
					unsigned int t2 = 0;
					int o2 = -1;
					if (be->f.ptr_attr(&t2, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, end) ||
					    t2 != CU_MEMORYTYPE_DEVICE ||
					    be->f.ptr_attr(&o2, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, end) ||
					    o2 != o ||
					    be->f.ptr_attr(&s2, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, end) ||
					    s2 != end ||
					    be->f.ptr_attr(&z2, CU_POINTER_ATTRIBUTE_RANGE_SIZE, end) || !z2)
						break;
					if ((rr = kvt__dma_add_range(d, end, end + z2)))
						return rr;
					end += z2;
				}
				if (end < need)
					return kvt__dma_err(-EINVAL, "cuda: group %u layer %u: n_blocks * "
							    "block_stride runs past its device memory "
							    "(%#llx + %llu; mapped up to %#llx)", k, i,
							    (unsigned long long)p,
							    (unsigned long long)kvt__layer_extent(gr),
							    (unsigned long long)end);
				seen_lo = start;
				seen_hi = end;
			}
			if (ord >= 0 && o != ord)
				return kvt__dma_err(-EINVAL, "cuda: the KV cache spans devices "
						    "%d and %d", ord, o);
			ord = o;
		}
	}
	if (be->bound && ord != be->ordinal)
		return kvt__dma_err(-EINVAL, "cuda: KV cache on device %d, handle bound to %d",
				    ord, be->ordinal);
	return be->bound ? 0 : set_device(d, ord);
}

static void cu_caps(const struct kvt_dma *d, struct kvt_plan_caps *c)
{
	const struct cu_be *be = d->be;

	if (!be->bound || be->max_pitch <= 0)
		return;
	c->max_rows = 1u << 20;
	c->pitch_align = 1;
	c->max_pitch = (uint64_t)be->max_pitch;
}

static int cu_mem_reg(struct kvt_dma *d, struct kvt_dma_piece *p)
{
	struct cu_be *be = d->be;
	CUdeviceptr dp = 0;
	CUresult r;
	int rc = push(be);

	if (rc)
		return rc;
	r = be->f.host_register(p->host, p->len, CU_MEMHOSTREGISTER_PORTABLE |
				CU_MEMHOSTREGISTER_DEVICEMAP);
	if (r) {
		pop(be);
		return CU_FAIL(be, r, "cuMemHostRegister(%p, %llu)", (void *)p->host,
			       (unsigned long long)p->len);
	}
	r = be->f.host_dev_ptr(&dp, p->host, 0);
	if (r) {
		be->f.host_unregister(p->host);
		pop(be);
		return CU_FAIL(be, r, "cuMemHostGetDevicePointer(%p)", (void *)p->host);
	}
	pop(be);
	p->dev = (uint64_t)dp;
	return 0;
}

static void cu_mem_unreg(struct kvt_dma *d, struct kvt_dma_piece *p)
{
	struct cu_be *be = d->be;
	CUresult r;

	if (push(be))
		return;
	r = be->f.host_unregister(p->host);
	pop(be);
	if (r)
		kvt__dma_log(d, KVT_DMA_LOG_ERR, "cuda: cuMemHostUnregister(%p): %s",
			     (void *)p->host, err_str(be, r));
}

static int grow(struct cu_slot *s, uint32_t n)
{
	CUdeviceptr *a, *b;
	size_t *c;

	if (n <= s->cap)
		return 0;
	a = realloc(s->dsts, n * sizeof(*a));
	if (a)
		s->dsts = a;
	b = realloc(s->srcs, n * sizeof(*b));
	if (b)
		s->srcs = b;
	c = realloc(s->sizes, n * sizeof(*c));
	if (c)
		s->sizes = c;
	if (!a || !b || !c)
		return -ENOMEM;
	s->cap = n;
	return 0;
}

/* The stream of a ticket: loads (H2D) and saves (D2H) on streams of their
 * own, so that a load -- the engine waits on it -- never queues behind a
 * save on one stream (a save of a long prompt's chunks can hold a stream
 * for milliseconds); round-robin within each half.  One stream: shared. */
static uint32_t stream_of_ticket(const struct cu_be *be, uint32_t slot, int d2h)
{
	uint32_t loads = be->n_streams / 2;

	if (!loads)
		return 0;
	return d2h ? loads + slot % (be->n_streams - loads) : slot % loads;
}

/* The plan's copies as the kernel's descriptors in the slot's buffer, and
 * the launch on st (in the pushed context).  The buffer is the slot's:
 * rewritten only when its ticket has completed. */
static CUresult kernel_submit(struct cu_be *be, struct cu_slot *s, const struct kvt_dma_job *j,
			      CUstream st, const char **what)
{
	unsigned int n = j->plan->n;
	CUresult r;

	if (n > s->kcap) {
		void *h = NULL;
		CUdeviceptr dp = 0;

		*what = "cuMemHostAlloc (the copy kernel's descriptors)";
		r = be->f.host_alloc(&h, (size_t)n * sizeof(*s->kd),
				     CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
		if (r)
			return r;
		r = be->f.host_dev_ptr(&dp, h, 0);
		if (r) {
			*what = "cuMemHostGetDevicePointer (the copy kernel's descriptors)";
			be->f.free_host(h);
			return r;
		}
		if (s->kd)
			be->f.free_host(s->kd);
		s->kd = h;
		s->kd_dev = dp;
		s->kcap = n;
	}
	kvt__kernel_descs(s->kd, j);
	void *args[2] = { &s->kd_dev, &n };

	*what = "cuLaunchKernel (the copy kernel)";
	return be->f.launch(be->kfn, n < be->k_ctas ? n : be->k_ctas, 1, 1, 256, 1, 1, 0, st,
			    args, NULL);
}

static int cu_submit(struct kvt_dma *d, uint32_t slot, const struct kvt_dma_job *j)
{
	struct cu_be *be = d->be;
	struct cu_slot *s = &be->slots[slot];
	const struct kvt_plan *p = j->plan;
	int d2h = j->dir == KVT_DMA_D2H;
	uint32_t si = stream_of_ticket(be, slot, d2h);
	CUstream st = be->streams[si];
	uint32_t n1 = 0;
	CUresult r = CUDA_SUCCESS;
	const char *what = "";
	int rc;

	if (be->lost)
		return cu_lost_err(be);
	for (uint32_t i = 0; i < p->n; i++)
		n1 += p->copies[i].rows == 1;
	if (be->use_batch && n1 >= 2 && grow(s, n1))
		return kvt__dma_err(-ENOMEM, "cuda: out of memory");
	rc = push(be);
	if (rc)
		return rc;
	/* behind the engine's work, when a fence was recorded since this
	 * stream last waited (cu_order_after); the lock only then: an engine
	 * that never orders its saves pays two loads per submit */
	uint32_t *sg = &be->stream_gen[si];
	uint32_t g = __atomic_load_n(&be->fence_gen, __ATOMIC_ACQUIRE);
	if (g && __atomic_load_n(sg, __ATOMIC_RELAXED) != g) {
		pthread_mutex_lock(&be->fence_mu);
		if (*sg != be->fence_gen) {
			what = "cuStreamWaitEvent";
			r = be->f.stream_wait_event(st, be->fence, 0);
			if (r == CUDA_SUCCESS)
				__atomic_store_n(sg, be->fence_gen, __ATOMIC_RELAXED);
		}
		pthread_mutex_unlock(&be->fence_mu);
	}
	if (r == CUDA_SUCCESS && be->kfn && kvt__kernel_plan(p, be->k_below)) {
		r = kernel_submit(be, s, j, st, &what);
		goto issued;
	}
	if (r == CUDA_SUCCESS && be->use_batch && n1 >= 2) {
		CUmemcpyAttributes attr;
		size_t idx = 0, fail_idx = 0;
		uint32_t k = 0;

		for (uint32_t i = 0; i < p->n; i++) {
			const struct kvt_copy *c = &p->copies[i];

			if (c->rows != 1)
				continue;
			s->dsts[k] = d2h ? j->host_dev + c->off : c->dev;
			s->srcs[k] = d2h ? c->dev : j->host_dev + c->off;
			s->sizes[k] = c->len;
			k++;
		}
		memset(&attr, 0, sizeof(attr));
		attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
		attr.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
		attr.srcLocHint.type = d2h ? CU_MEM_LOCATION_TYPE_DEVICE : CU_MEM_LOCATION_TYPE_HOST;
		attr.srcLocHint.id = d2h ? be->ordinal : 0;
		attr.dstLocHint.type = d2h ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
		attr.dstLocHint.id = d2h ? 0 : be->ordinal;
		what = "cuMemcpyBatchAsync";
		if (be->f.batch_13000)
			r = be->f.batch_13000(s->dsts, s->srcs, s->sizes, k, &attr, &idx, 1, st);
		else
			r = be->f.batch_12080(s->dsts, s->srcs, s->sizes, k, &attr, &idx, 1,
					      &fail_idx, st);
		n1 = 0; /* done */
	}
	for (uint32_t i = 0; i < p->n && r == CUDA_SUCCESS; i++) {
		const struct kvt_copy *c = &p->copies[i];
		CUdeviceptr host = j->host_dev + c->off;

		if (c->rows == 1) {
			if (!n1)
				continue;
			what = "cuMemcpyAsync";
			r = be->f.memcpy_async(d2h ? host : c->dev, d2h ? c->dev : host,
					       c->len, st);
		} else {
			CUDA_MEMCPY2D m;

			memset(&m, 0, sizeof(m));
			m.srcMemoryType = CU_MEMORYTYPE_UNIFIED;
			m.dstMemoryType = CU_MEMORYTYPE_UNIFIED;
			m.srcDevice = d2h ? c->dev : host;
			m.srcPitch = d2h ? c->dev_pitch : c->host_pitch;
			m.dstDevice = d2h ? host : c->dev;
			m.dstPitch = d2h ? c->host_pitch : c->dev_pitch;
			m.WidthInBytes = c->len;
			m.Height = c->rows;
			what = "cuMemcpy2DAsync";
			r = be->f.memcpy_2d_async(&m, st);
		}
	}
issued:
	if (r == CUDA_SUCCESS) {
		what = "cuEventRecord";
		r = be->f.event_record(s->ev, st);
	}
	if (r != CUDA_SUCCESS) {
		/* nothing may stay in flight after a failed submit */
		be->f.stream_sync(st);
		pop(be);
		cu_mark_lost(d, r);
		return kvt__dma_err(-EIO, "cuda: %s: %s (%d)%s", what, err_str(be, r), (int)r,
				    be->lost ? ": the context is lost (a sticky error)" : "");
	}
	pop(be);
	return 0;
}

/* The copies submitted from now on start after the work queued on the
 * engine's stream so far: a record of the fence on that stream, which
 * each copy stream waits on before its next copy (cu_submit).  One fence:
 * a later record supersedes an earlier one, and a copy waiting on the
 * later one waits for at least what it needed. */
static int cu_order_after(struct kvt_dma *d, uint64_t stream)
{
	struct cu_be *be = d->be;
	CUresult r;
	int rc;

	if (be->lost)
		return cu_lost_err(be);
	if (!be->bound)
		return kvt__dma_err(-EINVAL, "cuda: order_after before the KV cache was "
				    "registered");
	rc = push(be);
	if (rc)
		return rc;
	pthread_mutex_lock(&be->fence_mu);
	r = be->f.event_record(be->fence, (CUstream)(uintptr_t)stream);
	if (r == CUDA_SUCCESS) {
		uint32_t g = be->fence_gen + 1;
		__atomic_store_n(&be->fence_gen, g ? g : 1, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&be->fence_mu);
	pop(be);
	if (r != CUDA_SUCCESS) {
		cu_mark_lost(d, r);
		return kvt__dma_err(r == CUDA_ERROR_INVALID_HANDLE ? -EINVAL : -EIO,
				    "cuda: cuEventRecord on the engine's stream %#llx: %s (%d)",
				    (unsigned long long)stream, err_str(be, r), (int)r);
	}
	return 0;
}

static int ev_status(struct kvt_dma *d, CUresult r)
{
	struct cu_be *be = d->be;

	if (r == CUDA_SUCCESS)
		return 0;
	if (r == CUDA_ERROR_NOT_READY)
		return -EINPROGRESS;
	if (cu_sticky(r)) {
		cu_mark_lost(d, r);
		return -EIO;
	}
	kvt__dma_log(d, KVT_DMA_LOG_ERR, "cuda: copy failed: %s (%d)", err_str(be, r), (int)r);
	return -EIO;
}

static int cu_poll(struct kvt_dma *d, uint32_t slot)
{
	struct cu_be *be = d->be;
	CUresult r;

	if (be->lost) /* the context cannot report success for anything now */
		return cu_lost_err(be);
	if (push(be))
		return -EIO;
	r = be->f.event_query(be->slots[slot].ev);
	pop(be);
	return ev_status(d, r);
}

static int cu_wait(struct kvt_dma *d, uint32_t slot, uint64_t deadline)
{
	struct cu_be *be = d->be;
	uint64_t nap = 2000;
	CUresult r;

	if (be->lost)
		return cu_lost_err(be);
	if (push(be))
		return -EIO;
	if (deadline == UINT64_MAX) {
		r = be->f.event_sync(be->slots[slot].ev);
		pop(be);
		return ev_status(d, r);
	}
	while ((r = be->f.event_query(be->slots[slot].ev)) == CUDA_ERROR_NOT_READY) {
		uint64_t now = kvt__now_ns();
		struct timespec ts;

		if (now >= deadline)
			break;
		if (nap > deadline - now)
			nap = deadline - now;
		ts.tv_sec = 0;
		ts.tv_nsec = (long)nap;
		nanosleep(&ts, NULL);
		if (nap < 200000)
			nap *= 2;
	}
	pop(be);
	return r == CUDA_ERROR_NOT_READY ? -ETIMEDOUT : ev_status(d, r);
}

/* ---- device memory, ceiling --------------------------------------------- */

static int cu_dev_alloc(struct kvt_dma *d, uint64_t bytes, uint64_t *dev)
{
	struct cu_be *be = d->be;
	CUdeviceptr p = 0;
	CUresult r;
	int rc = push(be);

	if (rc)
		return rc;
	r = be->f.mem_alloc(&p, bytes);
	pop(be);
	if (r)
		return CU_FAIL(be, r, "cuMemAlloc(%llu)", (unsigned long long)bytes);
	*dev = (uint64_t)p;
	return 0;
}

static int cu_dev_free(struct kvt_dma *d, uint64_t dev)
{
	struct cu_be *be = d->be;
	CUresult r;
	int rc = push(be);

	if (rc)
		return rc;
	r = be->f.mem_free((CUdeviceptr)dev);
	pop(be);
	return r ? CU_FAIL(be, r, "cuMemFree") : 0;
}

static int cu_dev_write(struct kvt_dma *d, uint64_t dev, const void *src, uint64_t len)
{
	struct cu_be *be = d->be;
	CUresult r;
	int rc = push(be);

	if (rc)
		return rc;
	r = be->f.htod((CUdeviceptr)dev, src, len);
	pop(be);
	return r ? CU_FAIL(be, r, "cuMemcpyHtoD") : 0;
}

static int cu_dev_read(struct kvt_dma *d, void *dst, uint64_t dev, uint64_t len)
{
	struct cu_be *be = d->be;
	CUresult r;
	int rc = push(be);

	if (rc)
		return rc;
	r = be->f.dtoh(dst, (CUdeviceptr)dev, len);
	pop(be);
	return r ? CU_FAIL(be, r, "cuMemcpyDtoH") : 0;
}

/* cudaMemcpyAsync from cudaMallocHost memory, in driver terms. */
static int cu_ceiling(struct kvt_dma *d, enum kvt_dma_dir dir, uint64_t dev,
		      uint64_t bytes, uint64_t copy_bytes, uint32_t iters,
		      double *seconds)
{
	struct cu_be *be = d->be;
	CUstream st = be->streams[0];
	void *host = NULL;
	uint64_t t0;
	CUresult r;
	int rc = push(be);

	if (rc)
		return rc;
	r = be->f.alloc_host(&host, bytes);
	if (r) {
		pop(be);
		return CU_FAIL(be, r, "cuMemAllocHost(%llu)", (unsigned long long)bytes);
	}
	memset(host, 0x5a, bytes);
	t0 = kvt__now_ns();
	for (uint32_t it = 0; it < iters && !r; it++)
		for (uint64_t o = 0; o + copy_bytes <= bytes && !r; o += copy_bytes)
			r = dir == KVT_DMA_D2H
				? be->f.dtoh_async((char *)host + o, (CUdeviceptr)(dev + o),
						   copy_bytes, st)
				: be->f.htod_async((CUdeviceptr)(dev + o), (char *)host + o,
						   copy_bytes, st);
	if (be->f.stream_sync(st) && !r)
		r = CUDA_ERROR_UNKNOWN;
	*seconds = (kvt__now_ns() - t0) * 1e-9;
	be->f.free_host(host);
	pop(be);
	return r ? CU_FAIL(be, r, "ceiling copy") : 0;
}

/* ---- another process's memory and events ---------------------------------
 *
 * The engine's allocations are opened in the primary context (every cuda
 * handle of this process shares it), so an opened pointer is a valid layer
 * base for a rank handle's plans and copies.  A fence is two streams of
 * that context: `wait` collects the engine's events (cuStreamWaitEvent on
 * each imported record; the import is destroyed at once, which the
 * driver allows: the wait keeps what it needs), and a rank handle's
 * order_after records its own fence on it, so its copies start after the
 * engine's work.  `sig` waits for nothing: a record of the fence's
 * interprocess event there completes as soon as it is reached, and the
 * caller records it only once the copies it stands for have completed --
 * so an engine waiting on it never runs ahead of them, and a later record
 * (the event is reused) can only be later still. */

#define FENCE_SEM_OPEN 16 /* engines' semaphore allocations a fence keeps open */

struct cu_fence {
	struct kvt_dma_fence head; /* first */
	CUstream wait, sig;
	CUevent done;              /* CU_EVENT_INTERPROCESS */
	CUipcEventHandle done_h;
	/* timeline semaphores: the engines' allocations opened (with
	 * FENCE_SEM_OPEN open, the oldest is closed for a new one once the
	 * wait stream has run the waits that read it), and the fence's own
	 * word (slot 1 of KVT_DMA_SEM_BYTES; slot 0 is LMCache's probe slot)
	 * with its last value */
	struct { CUipcMemHandle h; CUdeviceptr base; size_t len; } sem[FENCE_SEM_OPEN];
	uint32_t n_sem, next_sem;
	CUdeviceptr own;
	CUipcMemHandle own_h;
	uint64_t own_seq;
};

/* A handle the driver will not open (forged, of this process, of a
 * process gone): the caller's; anything else, -EIO. */
static int ipc_errno(CUresult r)
{
	return r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_HANDLE ||
	       r == CUDA_ERROR_INVALID_CONTEXT ? -EINVAL : -EIO;
}

static int cu_need_ipc(struct kvt_dma *d, int need_bound)
{
	struct cu_be *be = d->be;

	if (!be->f.ipc_open_mem || !be->f.ipc_close_mem || !be->f.ipc_open_event ||
	    !be->f.ipc_get_event || !be->f.device_uuid)
		return kvt__dma_err(-ENOTSUP, "cuda: the driver has no IPC entry points");
	if (need_bound && !be->bound)
		return kvt__dma_err(-EINVAL, "cuda: IPC before a device was bound");
	if (be->lost)
		return cu_lost_err(be);
	return 0;
}

static int cu_uuid(struct kvt_dma *d, const uint8_t uuid[16])
{
	struct cu_be *be = d->be;
	int rc = cu_need_ipc(d, 0);

	for (int i = 0; !rc && i < be->n_devices; i++) {
		CUdevice dev;
		CUuuid u;

		if (!be->f.device_get(&dev, i) && !be->f.device_uuid(&u, dev) &&
		    !memcmp(u.bytes, uuid, 16))
			return i;
	}
	return rc ? rc : kvt__dma_err(-ENODEV, "cuda: no device here has that UUID (%d "
				      "devices visible)", be->n_devices);
}

static int cu_ipc_open(struct kvt_dma *d, const void *handle, uint64_t *base, uint64_t *len)
{
	struct cu_be *be = d->be;
	CUipcMemHandle h;
	CUdeviceptr p = 0, start = 0;
	size_t size = 0;
	CUresult r;
	int rc = cu_need_ipc(d, 1);

	if (rc || (rc = push(be)))
		return rc;
	memcpy(h.reserved, handle, sizeof(h.reserved));
	r = be->f.ipc_open_mem(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	if (!r)
		r = be->f.ptr_attr(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, p);
	if (!r)
		r = be->f.ptr_attr(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, p);
	if (!r && start != p) /* a handle names its allocation's base */
		r = CUDA_ERROR_INVALID_VALUE;
	if (r && p)
		be->f.ipc_close_mem(p);
	pop(be);
	if (r)
		return kvt__dma_err(ipc_errno(r), "cuda: cuIpcOpenMemHandle: %s (%d)",
				    err_str(be, r), (int)r);
	*base = (uint64_t)p;
	*len = (uint64_t)size;
	return 0;
}

static int cu_ipc_close(struct kvt_dma *d, uint64_t base)
{
	struct cu_be *be = d->be;
	CUresult r;
	int rc = cu_need_ipc(d, 1);

	if (rc == -EIO) /* lost: unmap all the same */
		rc = 0;
	if (rc || (rc = push(be)))
		return rc;
	r = be->f.ipc_close_mem((CUdeviceptr)base);
	pop(be);
	return r ? CU_FAIL(be, r, "cuIpcCloseMemHandle") : 0;
}

static void cu_fence_close(struct kvt_dma_fence *h)
{
	struct cu_fence *f = (struct cu_fence *)h;
	struct cu_be *be;

	if (!f)
		return;
	be = f->head.d->be;
	if (!push(be)) {
		if (f->wait)
			be->f.stream_destroy(f->wait); /* after its work, in the driver */
		if (f->sig)
			be->f.stream_destroy(f->sig);
		if (f->done)
			be->f.event_destroy(f->done);
		for (uint32_t i = 0; i < f->n_sem; i++)
			be->f.ipc_close_mem(f->sem[i].base);
		if (f->own)
			be->f.mem_free(f->own);
		pop(be);
	}
	free(f);
}

static int cu_fence_open(struct kvt_dma *d, struct kvt_dma_fence **out)
{
	struct cu_be *be = d->be;
	struct cu_fence *f;
	CUresult r;
	int rc = cu_need_ipc(d, 1);

	if (rc)
		return rc;
	f = calloc(1, sizeof(*f));
	if (!f)
		return kvt__dma_err(-ENOMEM, "cuda: out of memory");
	f->head.d = d;
	if ((rc = push(be))) {
		free(f);
		return rc;
	}
	r = be->f.stream_create(&f->wait, CU_STREAM_NON_BLOCKING);
	if (!r)
		r = be->f.stream_create(&f->sig, CU_STREAM_NON_BLOCKING);
	if (!r)
		r = be->f.event_create(&f->done, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
	if (!r)
		r = be->f.ipc_get_event(&f->done_h, f->done);
	pop(be);
	if (r) {
		rc = CU_FAIL(be, r, "creating a fence's streams and event");
		cu_fence_close(&f->head);
		return rc;
	}
	*out = &f->head;
	return 0;
}

static int cu_fence_wait(struct kvt_dma_fence *h, const void *handle)
{
	struct cu_fence *f = (struct cu_fence *)h;
	struct kvt_dma *d = f->head.d;
	struct cu_be *be = d->be;
	CUipcEventHandle eh;
	CUevent ev = NULL;
	CUresult r;
	int rc = cu_need_ipc(d, 1);

	if (rc || (rc = push(be)))
		return rc;
	memcpy(eh.reserved, handle, sizeof(eh.reserved));
	r = be->f.ipc_open_event(&ev, eh);
	if (!r) {
		r = be->f.stream_wait_event(f->wait, ev, 0);
		be->f.event_destroy(ev);
	}
	pop(be);
	if (r) {
		cu_mark_lost(d, r);
		return kvt__dma_err(ipc_errno(r), "cuda: the engine's IPC event: %s (%d)",
				    err_str(be, r), (int)r);
	}
	return 0;
}

static int cu_need_values(struct cu_be *be)
{
	if (!be->f.ipc_get_mem || !be->f.wait_value || !be->f.write_value)
		return kvt__dma_err(-ENOTSUP, "cuda: the driver has no stream memory operations "
				    "(cuStreamWaitValue64, CUDA 11.7+)");
	return 0;
}

static int cu_fence_wait_value(struct kvt_dma_fence *h, const void *mem, uint64_t off,
			       uint64_t value)
{
	struct cu_fence *f = (struct cu_fence *)h;
	struct kvt_dma *d = f->head.d;
	struct cu_be *be = d->be;
	CUdeviceptr base = 0;
	size_t len = 0;
	uint32_t i;
	CUresult r = CUDA_SUCCESS;
	int rc = cu_need_ipc(d, 1);

	if (rc || (rc = cu_need_values(be)) || (rc = push(be)))
		return rc;
	for (i = 0; i < f->n_sem && memcmp(f->sem[i].h.reserved, mem, KVT_DMA_IPC_BYTES); i++)
		;
	if (i == f->n_sem) { /* a new allocation: opened, kept with the fence */
		uint64_t b = 0, l = 0;

		pop(be);
		if ((rc = cu_ipc_open(d, mem, &b, &l)))
			return rc;
		if ((rc = push(be))) {
			cu_ipc_close(d, b);
			return rc;
		}
		if (f->n_sem == FENCE_SEM_OPEN) {
			/* the oldest goes: the waits queued on it run first */
			i = f->next_sem++ % FENCE_SEM_OPEN;
			r = be->f.stream_sync(f->wait);
			be->f.ipc_close_mem(f->sem[i].base);
		} else {
			i = f->n_sem++;
		}
		memcpy(f->sem[i].h.reserved, mem, KVT_DMA_IPC_BYTES);
		f->sem[i].base = (CUdeviceptr)b;
		f->sem[i].len = (size_t)l;
	}
	base = f->sem[i].base;
	len = f->sem[i].len;
	if (off % 8 || off > len || len - off < 8) {
		pop(be);
		return kvt__dma_err(-EINVAL, "cuda: a semaphore at offset %llu of an allocation "
				    "of %zu bytes", (unsigned long long)off, len);
	}
	if (!r)
		r = be->f.wait_value(f->wait, base + off, value, CU_STREAM_WAIT_VALUE_GEQ);
	pop(be);
	if (r) {
		cu_mark_lost(d, r);
		return CU_FAIL(be, r, "cuStreamWaitValue64 (the engine's semaphore)");
	}
	return 0;
}

static int cu_fence_signal_value(struct kvt_dma_fence *h, void *mem, uint64_t *off,
				 uint64_t *value)
{
	struct cu_fence *f = (struct cu_fence *)h;
	struct kvt_dma *d = f->head.d;
	struct cu_be *be = d->be;
	CUresult r = CUDA_SUCCESS;
	int rc = cu_need_ipc(d, 1);

	if (rc || (rc = cu_need_values(be)) || (rc = push(be)))
		return rc;
	if (!f->own) { /* its word, zero before the first value */
		static const uint64_t zero[2];

		r = be->f.mem_alloc(&f->own, KVT_DMA_SEM_BYTES);
		if (!r)
			r = be->f.htod(f->own, zero, sizeof(zero));
		if (!r)
			r = be->f.ipc_get_mem(&f->own_h, f->own);
		if (r && f->own) {
			be->f.mem_free(f->own);
			f->own = 0;
		}
	}
	if (!r)
		r = be->f.write_value(f->sig, f->own + 8, f->own_seq + 1,
				      CU_STREAM_WRITE_VALUE_DEFAULT);
	pop(be);
	if (r) {
		cu_mark_lost(d, r);
		return CU_FAIL(be, r, "the completion semaphore");
	}
	f->own_seq++;
	memcpy(mem, f->own_h.reserved, KVT_DMA_IPC_BYTES);
	*off = 8;
	*value = f->own_seq;
	return 0;
}

static uint64_t cu_fence_stream(const struct kvt_dma_fence *h)
{
	return (uint64_t)(uintptr_t)((const struct cu_fence *)h)->wait;
}

static int cu_fence_signal(struct kvt_dma_fence *h, void *handle)
{
	struct cu_fence *f = (struct cu_fence *)h;
	struct kvt_dma *d = f->head.d;
	struct cu_be *be = d->be;
	CUresult r;
	int rc = cu_need_ipc(d, 1);

	if (rc || (rc = push(be)))
		return rc;
	r = be->f.event_record(f->done, f->sig);
	pop(be);
	if (r) {
		cu_mark_lost(d, r);
		return CU_FAIL(be, r, "cuEventRecord (the completion event)");
	}
	memcpy(handle, f->done_h.reserved, KVT_DMA_IPC_BYTES);
	return 0;
}

const struct kvt_dma_ops kvt__dma_cuda_ops = {
	.name = "cuda",
	.init = cu_init,
	.fini = cu_fini,
	.bind = cu_bind,
	.caps = cu_caps,
	.mem_reg = cu_mem_reg,
	.mem_unreg = cu_mem_unreg,
	.submit = cu_submit,
	.order_after = cu_order_after,
	.uuid = cu_uuid,
	.ipc_open = cu_ipc_open,
	.ipc_close = cu_ipc_close,
	.fence_open = cu_fence_open,
	.fence_wait = cu_fence_wait,
	.fence_stream = cu_fence_stream,
	.fence_signal = cu_fence_signal,
	.fence_wait_value = cu_fence_wait_value,
	.fence_signal_value = cu_fence_signal_value,
	.fence_close = cu_fence_close,
	.poll = cu_poll,
	.wait = cu_wait,
	.dev_alloc = cu_dev_alloc,
	.dev_free = cu_dev_free,
	.dev_write = cu_dev_write,
	.dev_read = cu_dev_read,
	.ceiling = cu_ceiling,
};
