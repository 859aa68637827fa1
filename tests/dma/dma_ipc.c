/* dma_ipc.c - another process's GPU memory and events through the DMA core
 * (kvt_dma_device_of_uuid, kvt_dma_ipc_mem_*, kvt_dma_fence_*), against the
 * fake libcuda ($KVTIER_CUDA_LIBRARY), whose IPC crosses processes as the
 * driver's does.  An exporter child allocates device memory on device 1,
 * fills it, and records an interprocess event behind a late kernel (the
 * engine's forward pass); the parent (the server) opens both.  The host
 * backend refuses every call by name.  Without the fake: 77. */
#include <dlfcn.h>
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "kvt_dma.h"
#include "ipc_child.h"

#define LEN (3 * 4096 + 100)
#define LATE_US 300000

/* what the exporter sends: its memory's handle, its event's, its UUID */
struct exported {
	uint8_t mem[64], ev[64], uuid[16];
	uint64_t len;
};

static void *lib;
static struct exported ex;

static void *sym(const char *name, int version)
{
	CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
		(CUresult (*)(const char *, void **, int, cuuint64_t,
			      CUdriverProcAddressQueryResult *))dlsym(lib, "cuGetProcAddress_v2");
	void *p = NULL;

	if (!gpa || gpa(name, &p, 13000, 0, NULL) || !p) {
		fprintf(stderr, "no %s\n", name);
		_exit(3);
	}
	return p;
}

#define CK(x) do { if ((x) != CUDA_SUCCESS) { fprintf(stderr, "%s\n", #x); _exit(4); } } while (0)

/* The engine: device 1, LEN bytes of 0x11, an event recorded behind a
 * kernel that writes 0x77 over the first page late; it stays until told. */
static void exporter(void)
{
	CUdevice dev;
	CUcontext ctx;
	CUdeviceptr p;
	CUevent e;
	CUuuid u;
	CUipcMemHandle mh;
	CUipcEventHandle eh;
	static char buf[LEN];
	CUstream (*engine)(void) = (CUstream (*)(void))dlsym(lib, "kvt_fake_cuda_engine_stream");
	int (*kwrite)(CUstream, uint64_t, int, uint64_t, unsigned) =
		(int (*)(CUstream, uint64_t, int, uint64_t, unsigned))
			dlsym(lib, "kvt_fake_cuda_kernel_write");

	CK(((PFN_cuInit_v2000)sym("cuInit", 2000))(0));
	CK(((PFN_cuDeviceGet_v2000)sym("cuDeviceGet", 2000))(&dev, 1));
	CK(((PFN_cuDevicePrimaryCtxRetain_v7000)sym("cuDevicePrimaryCtxRetain", 7000))(&ctx, dev));
	CK(((PFN_cuCtxPushCurrent_v4000)sym("cuCtxPushCurrent", 4000))(ctx));
	CK(((PFN_cuMemAlloc_v3020)sym("cuMemAlloc", 3020))(&p, LEN));
	memset(buf, 0x11, sizeof(buf));
	CK(((PFN_cuMemcpyHtoD_v3020)sym("cuMemcpyHtoD", 3020))(p, buf, LEN));
	CK(((PFN_cuIpcGetMemHandle_v4010)sym("cuIpcGetMemHandle", 4010))(&mh, p));
	CK(((PFN_cuDeviceGetUuid_v11040)sym("cuDeviceGetUuid", 11040))(&u, dev));
	CK(((PFN_cuEventCreate_v2000)sym("cuEventCreate", 2000))(
		&e, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
	if (!engine || !kwrite || kwrite(engine(), p, 0x77, 4096, LATE_US))
		_exit(5);
	CK(((PFN_cuEventRecord_v2000)sym("cuEventRecord", 2000))(e, engine()));
	CK(((PFN_cuIpcGetEventHandle_v4010)sym("cuIpcGetEventHandle", 4010))(&eh, e));
	memcpy(ex.mem, mh.reserved, 64);
	memcpy(ex.ev, eh.reserved, 64);
	memcpy(ex.uuid, u.bytes, 16);
	ex.len = LEN;
	child_publish_and_wait(&ex, sizeof(ex));
	_exit(0);
}

static int setup(void **state)
{
	const char *path = getenv("KVTIER_CUDA_LIBRARY");

	(void)state;
	if (!path || !(lib = dlopen(path, RTLD_NOW | RTLD_LOCAL)) ||
	    !dlsym(lib, "kvt_fake_cuda_engine_stream"))
		return -1;
	return child_start(exporter, &ex, sizeof(ex));
}

static int teardown(void **state)
{
	(void)state;
	return child_stop();
}

/* The device an engine names by UUID: ordinal 1 here too; one this node
 * does not have: -ENODEV, said. */
static void test_device_of_uuid(void **state)
{
	kvt_dma *d = open_dma("cuda", -1);
	uint8_t other[16] = { 1, 2, 3 };

	(void)state;
	assert_int_equal(kvt_dma_device_of_uuid(d, ex.uuid), 1);
	assert_int_equal(kvt_dma_device_of_uuid(d, other), -ENODEV);
	assert_non_null(strstr(kvt_dma_last_error(), "UUID"));
	kvt_dma_close(d);
}

/* The engine's allocation opened here: its size, its bytes; a second
 * opening is the same mapping (the driver counts them), closed twice; a
 * forged handle refused, nothing mapped. */
static void test_mem_open(void **state)
{
	kvt_dma *d = open_dma("cuda", 1);
	uint64_t base = 0, len = 0, base2 = 0, len2 = 0;
	uint8_t bad[64];
	static char buf[LEN];

	(void)state;
	assert_int_equal(kvt_dma_ipc_mem_open(d, ex.mem, &base, &len), 0);
	assert_int_equal(len, LEN);
	assert_int_equal(kvt_dma_ipc_mem_open(d, ex.mem, &base2, &len2), 0);
	assert_int_equal(base2, base);
	/* past the late kernel's page: the exporter's 0x11 */
	assert_int_equal(kvt_dma_dev_read(d, buf, base + 4096, LEN - 4096), 0);
	for (size_t i = 0; i < LEN - 4096; i++)
		if (buf[i] != 0x11)
			fail_msg("byte %zu of the opened memory: %#x", i, buf[i]);
	assert_int_equal(kvt_dma_ipc_mem_close(d, base), 0);
	assert_int_equal(kvt_dma_dev_read(d, buf, base + 4096, 16), 0); /* one opening left */
	assert_int_equal(kvt_dma_ipc_mem_close(d, base), 0);
	memcpy(bad, ex.mem, sizeof(bad));
	bad[0] ^= 0xff;
	assert_int_equal(kvt_dma_ipc_mem_open(d, bad, &base, &len), -EINVAL);
	assert_non_null(strstr(kvt_dma_last_error(), "cuIpcOpenMemHandle"));
	kvt_dma_close(d);
}

/* A fence waits for the engine's event on the device, not here: waiting is
 * at once; the fence's own event has a handle; a forged event handle is
 * refused and the fence stays usable. */
static void test_fence(void **state)
{
	kvt_dma *d = open_dma("cuda", 1);
	kvt_dma_fence *f = NULL;
	uint8_t h[KVT_DMA_IPC_BYTES], h2[KVT_DMA_IPC_BYTES], bad[64];

	(void)state;
	assert_int_equal(kvt_dma_fence_open(d, &f), 0);
	assert_true(kvt_dma_fence_stream(f) != 0);
	assert_int_equal(kvt_dma_fence_wait(f, ex.ev), 0);
	assert_int_equal(kvt_dma_fence_signal(f, h), 0);
	assert_int_equal(kvt_dma_fence_signal(f, h2), 0);
	assert_memory_equal(h, h2, sizeof(h)); /* one event, recorded again */
	memcpy(bad, ex.ev, sizeof(bad));
	bad[0] ^= 0xff;
	assert_int_equal(kvt_dma_fence_wait(f, bad), -EINVAL);
	assert_int_equal(kvt_dma_fence_wait(f, ex.ev), 0);
	kvt_dma_fence_close(f); /* waits for the late kernel's event */
	kvt_dma_close(d);
}

/* Timeline semaphores: a wait on a word of the engine's allocation (its
 * bytes past the late kernel's page are 0x11...: reached), a word past its
 * end refused (-EINVAL, said), an unaligned one too; the fence's own word
 * grows by one a signal, at one place. */
static void test_fence_values(void **state)
{
	kvt_dma *d = open_dma("cuda", 1);
	kvt_dma_fence *f = NULL;
	uint8_t h[KVT_DMA_IPC_BYTES], h2[KVT_DMA_IPC_BYTES];
	uint64_t off = 0, v = 0, off2 = 0, v2 = 0;

	(void)state;
	assert_int_equal(kvt_dma_fence_open(d, &f), 0);
	assert_int_equal(kvt_dma_fence_wait_value(f, ex.mem, 4096, 1), 0);
	assert_int_equal(kvt_dma_fence_wait_value(f, ex.mem, LEN - 4, 1), -EINVAL);
	assert_non_null(strstr(kvt_dma_last_error(), "of an allocation of"));
	assert_int_equal(kvt_dma_fence_wait_value(f, ex.mem, 4100, 1), -EINVAL);
	assert_int_equal(kvt_dma_fence_signal_value(f, h, &off, &v), 0);
	assert_int_equal(kvt_dma_fence_signal_value(f, h2, &off2, &v2), 0);
	assert_memory_equal(h, h2, sizeof(h));
	assert_int_equal(off, 8);
	assert_int_equal(off2, 8);
	assert_int_equal(v2, v + 1);
	kvt_dma_fence_close(f);
	kvt_dma_close(d);
}

/* The host backend has no GPU IPC: every call refused, by name. */
static void test_host_refuses(void **state)
{
	struct kvt_dma_config c;
	kvt_dma *d = NULL;
	kvt_dma_fence *f = NULL;
	uint64_t base, len;

	(void)state;
	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.backend = "host";
	c.flags = KVT_DMA_F_QUIET;
	assert_int_equal(kvt_dma_open(&c, &d), 0);
	assert_int_equal(kvt_dma_device_of_uuid(d, ex.uuid), -ENOTSUP);
	assert_int_equal(kvt_dma_ipc_mem_open(d, ex.mem, &base, &len), -ENOTSUP);
	assert_int_equal(kvt_dma_fence_open(d, &f), -ENOTSUP);
	assert_non_null(strstr(kvt_dma_last_error(), "host: no GPU IPC"));
	assert_null(f);
	kvt_dma_close(d);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_device_of_uuid),
		cmocka_unit_test(test_mem_open),
		cmocka_unit_test(test_fence),
		cmocka_unit_test(test_fence_values),
		cmocka_unit_test(test_host_refuses),
	};
	const char *path = getenv("KVTIER_CUDA_LIBRARY");
	void *l = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;

	if (!l || !dlsym(l, "kvt_fake_cuda_engine_stream")) {
		printf("skip: no fake libcuda ($KVTIER_CUDA_LIBRARY)\n");
		return 77;
	}
	dlclose(l);
	return cmocka_run_group_tests(tests, setup, teardown);
}
