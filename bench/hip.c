/* hip.c - the HIP runtime for the bench (hip.h): dlopen'ed, prototypes
 * checked against Debian's hip/hip_runtime_api.h (libamdhip64-dev).  Built
 * without that header, every call says so (-ENOTSUP).
 */
#include "kvt_clock.h"
#include "hip.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static _Thread_local char hip_err[256];

static int herr(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int herr(int code, const char *fmt, ...)
{
	char tmp[sizeof(hip_err)];
	va_list ap;

	/* Through a copy: an argument may be this very buffer (a message
	 * that wraps the previous one); vsnprintf onto itself garbles it. */
	va_start(ap, fmt);
	vsnprintf(tmp, sizeof(tmp), fmt, ap);
	va_end(ap);
	memcpy(hip_err, tmp, sizeof(tmp));
	return code;
}

const char *kvt_hip_last_error(void)
{
	return hip_err[0] ? hip_err : "no error";
}

#ifndef KVTIER_HAVE_HIP

int kvt_hip_open(int device, kvt_hip **out)
{
	(void)device;
	*out = NULL;
	return herr(-ENOTSUP, "hip: kvtier-bench was built without the HIP headers "
		    "(install libamdhip64-dev and rebuild)");
}
void kvt_hip_close(kvt_hip *h) { (void)h; }
const char *kvt_hip_describe(const kvt_hip *h) { (void)h; return "HIP: not built"; }
int kvt_hip_malloc(kvt_hip *h, uint64_t b, uint64_t *d) { (void)h; (void)b; (void)d; return -ENOTSUP; }
int kvt_hip_free(kvt_hip *h, uint64_t d) { (void)h; (void)d; return -ENOTSUP; }
int kvt_hip_write(kvt_hip *h, uint64_t d, const void *s, uint64_t l)
{ (void)h; (void)d; (void)s; (void)l; return -ENOTSUP; }
int kvt_hip_read(kvt_hip *h, void *d, uint64_t s, uint64_t l)
{ (void)h; (void)d; (void)s; (void)l; return -ENOTSUP; }
int kvt_hip_fill_async(kvt_hip *h, uint64_t d, int b, uint64_t l)
{ (void)h; (void)d; (void)b; (void)l; return -ENOTSUP; }
int kvt_hip_sync(kvt_hip *h) { (void)h; return -ENOTSUP; }
uint64_t kvt_hip_stream(const kvt_hip *h) { (void)h; return 0; }
int kvt_hip_ceiling(kvt_hip *h, int d2h, uint64_t dev, uint64_t bytes, uint64_t cb,
		    uint32_t iters, enum kvt_hip_pinned p, double *s, int *differs)
{
	(void)h; (void)d2h; (void)dev; (void)bytes; (void)cb; (void)iters; (void)p;
	(void)s; (void)differs;
	return -ENOTSUP;
}

#else

#define __HIP_PLATFORM_AMD__ 1
#include <hip/hip_runtime_api.h>

struct hip_fns {
	__typeof__(&hipGetDeviceCount) get_device_count;
	__typeof__(&hipSetDevice) set_device;
	__typeof__(&hipDeviceGetName) device_get_name;
	__typeof__(&hipRuntimeGetVersion) runtime_version;
	__typeof__(&hipGetErrorString) error_string;
	__typeof__(&hipMalloc) malloc;
	__typeof__(&hipFree) free;
	__typeof__(&hipMemcpy) memcpy;
	__typeof__(&hipMemcpyAsync) memcpy_async;
	__typeof__(&hipHostMalloc) host_malloc;
	__typeof__(&hipHostFree) host_free;
	__typeof__(&hipHostRegister) host_register;
	__typeof__(&hipHostUnregister) host_unregister;
	__typeof__(&hipHostGetDevicePointer) host_device_pointer;
	__typeof__(&hipStreamCreate) stream_create;
	__typeof__(&hipStreamDestroy) stream_destroy;
	__typeof__(&hipStreamSynchronize) stream_sync;
	__typeof__(&hipDeviceSynchronize) device_sync;
	__typeof__(&hipMemsetAsync) memset_async;
};

struct kvt_hip {
	void *lib;
	struct hip_fns f;
	int device, n_devices, version;
	hipStream_t stream;
	char describe[256];
};

static const struct { const char *name; size_t off; } syms[] = {
#define S(field, name) { name, offsetof(struct hip_fns, field) }
	S(get_device_count, "hipGetDeviceCount"), S(set_device, "hipSetDevice"),
	S(device_get_name, "hipDeviceGetName"), S(runtime_version, "hipRuntimeGetVersion"),
	S(error_string, "hipGetErrorString"), S(malloc, "hipMalloc"), S(free, "hipFree"),
	S(memcpy, "hipMemcpy"), S(memcpy_async, "hipMemcpyAsync"),
	S(host_malloc, "hipHostMalloc"), S(host_free, "hipHostFree"),
	S(host_register, "hipHostRegister"), S(host_unregister, "hipHostUnregister"),
	S(host_device_pointer, "hipHostGetDevicePointer"),
	S(stream_create, "hipStreamCreate"), S(stream_destroy, "hipStreamDestroy"),
	S(stream_sync, "hipStreamSynchronize"), S(device_sync, "hipDeviceSynchronize"),
	S(memset_async, "hipMemsetAsync"),
#undef S
};

static int code_of(hipError_t e)
{
	switch (e) {
	case hipErrorNoDevice: case hipErrorInvalidDevice: return -ENODEV;
	case hipErrorOutOfMemory: return -ENOMEM;
	case hipErrorInvalidValue: return -EINVAL;
	default: return -EIO;
	}
}

#define HFAIL(h, e, ...) hfail((h), (e), __VA_ARGS__)
static int hfail(kvt_hip *h, hipError_t e, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int hfail(kvt_hip *h, hipError_t e, const char *fmt, ...)
{
	char what[160];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	return herr(code_of(e), "hip: %s: %s (%d)", what,
		    h && h->f.error_string ? h->f.error_string(e) : "?", (int)e);
}

int kvt_hip_open(int device, kvt_hip **out)
{
	static const char *const names[] = {
		"libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so" };
	const char *env = getenv("KVTIER_HIP_LIBRARY");
	kvt_hip *h;
	hipError_t e;

	*out = NULL;
	if (env && !*env)
		return herr(-EINVAL, "KVTIER_HIP_LIBRARY is empty: unset it, or name the library");
	h = calloc(1, sizeof(*h));
	if (!h)
		return herr(-ENOMEM, "hip: out of memory");
	if (env) {
		h->lib = dlopen(env, RTLD_NOW | RTLD_LOCAL);
		if (!h->lib) {
			free(h);
			return herr(-ENOENT, "hip: KVTIER_HIP_LIBRARY=%s: %s", env, dlerror());
		}
	} else {
		for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !h->lib; i++)
			h->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
		if (!h->lib) {
			free(h);
			return herr(-ENOENT, "hip: libamdhip64 not found (install ROCm's HIP "
				    "runtime, or set KVTIER_HIP_LIBRARY)");
		}
	}
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		void *p = dlsym(h->lib, syms[i].name);
		if (!p) {
			herr(-ENOENT, "hip: %s has no %s", env ? env : "libamdhip64", syms[i].name);
			dlclose(h->lib);
			free(h);
			return -ENOENT;
		}
		memcpy((char *)&h->f + syms[i].off, &p, sizeof(p));
	}
	h->device = device;
	e = h->f.get_device_count(&h->n_devices);
	if (e || h->n_devices <= 0) {
		int r = e && e != hipErrorNoDevice
			? hfail(h, e, "hipGetDeviceCount")
			: herr(-ENODEV, "hip: no AMD GPU found (hipGetDeviceCount: %s): is "
			       "/dev/kfd there, and the amdgpu driver loaded?",
			       e ? h->f.error_string(e) : "0 devices");
		dlclose(h->lib);
		free(h);
		return r;
	}
	if (device < 0 || device >= h->n_devices) {
		herr(-ENODEV, "hip: device %d, the runtime sees %d", device, h->n_devices);
		dlclose(h->lib);
		free(h);
		return -ENODEV;
	}
	if ((e = h->f.set_device(device)) || (e = h->f.stream_create(&h->stream))) {
		int r = hfail(h, e, "hipSetDevice(%d) / hipStreamCreate", device);
		dlclose(h->lib);
		free(h);
		return r;
	}
	char name[128] = "?";
	(void)h->f.device_get_name(name, sizeof(name), device);
	(void)h->f.runtime_version(&h->version);
	snprintf(h->describe, sizeof(h->describe), "HIP runtime %d, device %d of %d: %s",
		 h->version, device, h->n_devices, name);
	*out = h;
	return 0;
}

void kvt_hip_close(kvt_hip *h)
{
	if (!h)
		return;
	if (h->stream)
		h->f.stream_destroy(h->stream);
	dlclose(h->lib);
	free(h);
}

const char *kvt_hip_describe(const kvt_hip *h)
{
	return h ? h->describe : "HIP: not open";
}

int kvt_hip_malloc(kvt_hip *h, uint64_t bytes, uint64_t *dev)
{
	void *p = NULL;
	hipError_t e = h->f.malloc(&p, bytes);

	if (e)
		return HFAIL(h, e, "hipMalloc(%llu)", (unsigned long long)bytes);
	*dev = (uint64_t)(uintptr_t)p;
	return 0;
}

int kvt_hip_free(kvt_hip *h, uint64_t dev)
{
	hipError_t e = h->f.free((void *)(uintptr_t)dev);

	return e ? HFAIL(h, e, "hipFree") : 0;
}

int kvt_hip_write(kvt_hip *h, uint64_t dev, const void *src, uint64_t len)
{
	hipError_t e = h->f.memcpy((void *)(uintptr_t)dev, src, len, hipMemcpyHostToDevice);

	return e ? HFAIL(h, e, "hipMemcpy H2D %llu", (unsigned long long)len) : 0;
}

int kvt_hip_read(kvt_hip *h, void *dst, uint64_t dev, uint64_t len)
{
	hipError_t e = h->f.memcpy(dst, (const void *)(uintptr_t)dev, len, hipMemcpyDeviceToHost);

	return e ? HFAIL(h, e, "hipMemcpy D2H %llu", (unsigned long long)len) : 0;
}

int kvt_hip_fill_async(kvt_hip *h, uint64_t dev, int byte, uint64_t len)
{
	hipError_t e = h->f.memset_async((void *)(uintptr_t)dev, byte, len, h->stream);

	return e ? HFAIL(h, e, "hipMemsetAsync %llu", (unsigned long long)len) : 0;
}

int kvt_hip_sync(kvt_hip *h)
{
	hipError_t e = h->f.stream_sync(h->stream);

	return e ? HFAIL(h, e, "hipStreamSynchronize") : 0;
}

uint64_t kvt_hip_stream(const kvt_hip *h)
{
	return (uint64_t)(uintptr_t)h->stream;
}

int kvt_hip_ceiling(kvt_hip *h, int d2h, uint64_t dev, uint64_t bytes, uint64_t copy_bytes,
		    uint32_t iters, enum kvt_hip_pinned pinned, double *seconds,
		    int *devptr_differs)
{
	void *host = NULL, *alias = NULL;
	hipError_t e;
	uint64_t t0;

	if (!copy_bytes || bytes < copy_bytes)
		return herr(-EINVAL, "hip: ceiling of %llu bytes in %llu-byte copies",
			    (unsigned long long)bytes, (unsigned long long)copy_bytes);
	if (pinned == KVT_HIP_HOST_MALLOC) {
		if ((e = h->f.host_malloc(&host, bytes, hipHostMallocDefault)))
			return HFAIL(h, e, "hipHostMalloc(%llu)", (unsigned long long)bytes);
	} else {
		if (posix_memalign(&host, 2u << 20, bytes))
			return herr(-ENOMEM, "hip: out of memory (%llu bytes)",
				    (unsigned long long)bytes);
		if ((e = h->f.host_register(host, bytes, hipHostRegisterMapped))) {
			free(host);
			return HFAIL(h, e, "hipHostRegister(%llu)", (unsigned long long)bytes);
		}
		/* On ROCm the GPU's address of a registered range can differ
		 * from its host address; kernels need the former.  Async
		 * copies take the host address (the runtime translates). */
		if ((e = h->f.host_device_pointer(&alias, host, 0)) == hipSuccess && devptr_differs)
			*devptr_differs = alias != host;
	}
	memset(host, 0x5a, bytes);
	e = hipSuccess;
	t0 = kvt__now_ns();
	for (uint32_t it = 0; it < iters && !e; it++)
		for (uint64_t o = 0; o + copy_bytes <= bytes && !e; o += copy_bytes)
			e = d2h ? h->f.memcpy_async((char *)host + o, (void *)(uintptr_t)(dev + o),
						    copy_bytes, hipMemcpyDeviceToHost, h->stream)
				: h->f.memcpy_async((void *)(uintptr_t)(dev + o), (char *)host + o,
						    copy_bytes, hipMemcpyHostToDevice, h->stream);
	hipError_t es = h->f.stream_sync(h->stream);
	*seconds = (kvt__now_ns() - t0) * 1e-9;
	if (pinned == KVT_HIP_HOST_MALLOC) {
		h->f.host_free(host);
	} else {
		h->f.host_unregister(host);
		free(host);
	}
	if (e || es)
		return HFAIL(h, e ? e : es, "ceiling hipMemcpyAsync %s",
			     d2h ? "device to host" : "host to device");
	return 0;
}

#endif /* KVTIER_HAVE_HIP */
