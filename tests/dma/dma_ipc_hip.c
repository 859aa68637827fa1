/* dma_ipc_hip.c - another process's GPU memory and events through the DMA
 * core's hsa backend (kvt_dma_device_of_uuid, kvt_dma_ipc_mem_*,
 * kvt_dma_fence_*): a ROCm engine's HIP handles, opened with the HIP
 * runtime ($KVTIER_HIP_LIBRARY: the fake HIP on the fake HSA runtime,
 * $KVTIER_HSA_LIBRARY, whose IPC crosses processes as ROCr's does).  An
 * exporter child allocates device memory on device 1, fills it, and
 * records an interprocess event behind a late kernel; the parent (the
 * server) opens both.  Without the fakes: 77. */
#define __HIP_PLATFORM_AMD__ 1
#include <hip/hip_runtime_api.h>

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

#include "kvt_dma.h"
#include "ipc_child.h"

#define LEN (3 * 4096 + 100)
#define LATE_US 300000

/* what the exporter sends: its memory's handles (the allocation's base and
 * a pointer a page in), its event's, its device's UUID */
struct exported {
	hipIpcMemHandle_t mem, inner;
	hipIpcEventHandle_t ev;
	hipUUID uuid;
};

static struct exported ex;

#define CK(x) do { if ((x) != hipSuccess) { fprintf(stderr, "%s\n", #x); _exit(4); } } while (0)
#define HIP(name) ((__typeof__(&name))dlsym(lib, #name))

/* The engine: device 1, LEN bytes of 0x11, an event recorded behind a
 * kernel that writes 0x77 over the first page late; it stays until told. */
static void exporter(void)
{
	void *lib = dlopen(getenv("KVTIER_HIP_LIBRARY"), RTLD_NOW | RTLD_LOCAL);
	int (*kernel_write)(hipStream_t, void *, int, size_t, unsigned);
	static char fill[LEN];
	hipStream_t s;
	hipEvent_t ev;
	void *p;

	if (!lib || !(*(void **)&kernel_write = dlsym(lib, "kvt_fake_hip_kernel_write")))
		_exit(3);
	memset(fill, 0x11, sizeof(fill));
	CK(HIP(hipSetDevice)(1));
	CK(HIP(hipDeviceGetUuid)(&ex.uuid, 1));
	CK(HIP(hipMalloc)(&p, LEN));
	CK(HIP(hipMemcpy)(p, fill, LEN, hipMemcpyHostToDevice));
	CK(HIP(hipIpcGetMemHandle)(&ex.mem, p));
	CK(HIP(hipIpcGetMemHandle)(&ex.inner, (char *)p + 4096));
	CK(HIP(hipStreamCreate)(&s));
	CK(HIP(hipEventCreateWithFlags)(&ev, hipEventInterprocess | hipEventDisableTiming));
	CK((hipError_t)kernel_write(s, p, 0x77, 4096, LATE_US));
	CK(HIP(hipEventRecord)(ev, s));
	CK(HIP(hipIpcGetEventHandle)(&ex.ev, ev));
	child_publish_and_wait(&ex, sizeof(ex));
	CK(HIP(hipStreamSynchronize)(s));
	_exit(0);
}

/* A second engine that dies before the event it sent fires (a kernel
 * still running): forked at setup, before this process starts a runtime
 * (a child forked from a process with the runtime's threads has none of
 * them); it sends its event's handle and waits to be killed. */
static int die_pipe[2] = { -1, -1 };
static pid_t dying = -1;
static hipIpcEventHandle_t dying_ev;

static void dying_engine(void)
{
	void *lib = dlopen(getenv("KVTIER_HIP_LIBRARY"), RTLD_NOW | RTLD_LOCAL);
	int (*kernel_write)(hipStream_t, void *, int, size_t, unsigned);
	hipIpcEventHandle_t h;
	hipStream_t s;
	hipEvent_t ev;
	void *p;

	if (!lib || !(*(void **)&kernel_write = dlsym(lib, "kvt_fake_hip_kernel_write")))
		_exit(3);
	CK(HIP(hipSetDevice)(1));
	CK(HIP(hipMalloc)(&p, 4096));
	CK(HIP(hipStreamCreate)(&s));
	CK(HIP(hipEventCreateWithFlags)(&ev, hipEventInterprocess | hipEventDisableTiming));
	CK((hipError_t)kernel_write(s, p, 0x77, 4096, 600u * 1000000u));
	CK(HIP(hipEventRecord)(ev, s));
	CK(HIP(hipIpcGetEventHandle)(&h, ev));
	if (write(die_pipe[1], &h, sizeof(h)) != (ssize_t)sizeof(h))
		_exit(5);
	for (;;)
		pause();
}

static int start_dying_engine(void)
{
	if (pipe(die_pipe))
		return -1;
	dying = fork();
	if (dying == 0)
		dying_engine();
	close(die_pipe[1]); /* its death: EOF here, never a hang */
	return dying < 0 || read(die_pipe[0], &dying_ev, sizeof(dying_ev)) !=
				    (ssize_t)sizeof(dying_ev) ? -1 : 0;
}

static int setup(void **state)
{
	(void)state;
	return child_start(exporter, &ex, sizeof(ex)) || start_dying_engine() ? -1 : 0;
}

static int teardown(void **state)
{
	(void)state;
	if (dying > 0) {
		kill(dying, SIGKILL);
		waitpid(dying, NULL, 0);
	}
	return child_stop();
}

/* The device an engine names by HIP's UUID: ordinal 1 here too (the
 * agent's "GPU-" id as characters); one this node does not have:
 * -ENODEV, said. */
static void test_device_of_uuid(void **state)
{
	kvt_dma *d = open_dma("hsa", -1);
	uint8_t other[16] = "0123456789abcdef";

	(void)state;
	assert_int_equal(kvt_dma_device_of_uuid(d, (const uint8_t *)ex.uuid.bytes), 1);
	assert_int_equal(kvt_dma_device_of_uuid(d, other), -ENODEV);
	assert_non_null(strstr(kvt_dma_last_error(), "no device here has that UUID"));
	kvt_dma_close(d);
}

/* Openings of one handle are counted here (one pointer, a close each);
 * a handle of a pointer inside its allocation opens at that pointer,
 * its length what is left of the allocation; a forged handle: -EINVAL. */
static void test_mem_open(void **state)
{
	kvt_dma *d = open_dma("hsa", 1);
	uint64_t base = 0, len = 0, base2 = 0, len2 = 0, in = 0, in_len = 0;
	uint8_t bad[64];
	static char buf[LEN];

	(void)state;
	assert_int_equal(kvt_dma_ipc_mem_open(d, ex.mem.reserved, &base, &len), 0);
	assert_int_equal(len, LEN);
	assert_int_equal(kvt_dma_ipc_mem_open(d, ex.mem.reserved, &base2, &len2), 0);
	assert_int_equal(base2, base);
	assert_int_equal(len2, LEN);
	/* past the late kernel's page: the exporter's 0x11 */
	assert_int_equal(kvt_dma_dev_read(d, buf, base + 4096, LEN - 4096), 0);
	for (size_t i = 0; i < LEN - 4096; i++)
		if (buf[i] != 0x11)
			fail_msg("byte %zu of the opened memory: %#x", i, buf[i]);
	assert_int_equal(kvt_dma_ipc_mem_open(d, ex.inner.reserved, &in, &in_len), 0);
	assert_int_equal(in_len, LEN - 4096);
	assert_int_equal(kvt_dma_dev_read(d, buf, in, 16), 0);
	assert_int_equal(buf[0], 0x11);
	assert_int_equal(kvt_dma_ipc_mem_close(d, in), 0);
	assert_int_equal(kvt_dma_ipc_mem_close(d, base), 0);
	assert_int_equal(kvt_dma_dev_read(d, buf, base + 4096, 16), 0); /* one opening left */
	assert_int_equal(kvt_dma_ipc_mem_close(d, base), 0);
	assert_int_equal(kvt_dma_ipc_mem_close(d, base), -EINVAL);
	memcpy(bad, ex.mem.reserved, sizeof(bad));
	bad[0] ^= 0xff;
	assert_int_equal(kvt_dma_ipc_mem_open(d, bad, &base, &len), -EINVAL);
	assert_non_null(strstr(kvt_dma_last_error(), "hipIpcOpenMemHandle"));
	kvt_dma_close(d);
}

/* A fence waits for the engine's event on the device (waiting is at once,
 * the kernel still running); its own event has a handle; a forged event
 * handle is refused and the fence stays usable; timeline semaphores are
 * CUDA's, refused by name. */
static void test_fence(void **state)
{
	kvt_dma *d = open_dma("hsa", 1);
	kvt_dma_fence *f = NULL;
	uint8_t h[64], bad[64];
	uint64_t off, value;

	(void)state;
	assert_int_equal(kvt_dma_fence_open(d, &f), 0);
	/* more waits than a fence keeps imports (32): the passed ones are
	 * reaped, the oldest waited for when none has passed yet */
	for (int i = 0; i < 40; i++)
		assert_int_equal(kvt_dma_fence_wait(f, ex.ev.reserved), 0);
	assert_true(kvt_dma_fence_stream(f) != 0);
	memcpy(bad, ex.ev.reserved, sizeof(bad));
	bad[0] ^= 0xff;
	assert_int_equal(kvt_dma_fence_wait(f, bad), -EINVAL);
	assert_int_equal(kvt_dma_fence_signal(f, h), 0);
	assert_int_equal(kvt_dma_fence_signal_value(f, h, &off, &value), -ENOTSUP);
	assert_non_null(strstr(kvt_dma_last_error(), "a ROCm engine sends HIP IPC events"));
	kvt_dma_fence_close(f); /* after the engine's kernel */
	kvt_dma_close(d);
}

static char logged[512];

static void keep_log(void *arg, int level, const char *msg)
{
	(void)arg;
	if (level == KVT_DMA_LOG_ERR)
		snprintf(logged, sizeof(logged), "%s", msg);
}

/* The fence's wait on the dying engine's event never ends once it is
 * gone; closing the fence does not wait for it for good -- it abandons
 * the wait, saying so. */
static void test_fence_engine_gone(void **state)
{
	struct kvt_dma_config c;
	kvt_dma *d = NULL;
	kvt_dma_fence *f = NULL;
	int st;

	(void)state;
	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.backend = "hsa";
	c.device = 1;
	c.log = keep_log;
	assert_int_equal(kvt_dma_open(&c, &d), 0);
	assert_int_equal(kvt_dma_fence_open(d, &f), 0);
	assert_int_equal(kvt_dma_fence_wait(f, dying_ev.reserved), 0);
	kill(dying, SIGKILL);
	waitpid(dying, &st, 0);
	dying = -1;
	kvt_dma_fence_close(f); /* returns: the wait is abandoned */
	assert_non_null(strstr(logged, "a fence abandoned: 1 of the engine's events never fired"));
	kvt_dma_close(d);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_device_of_uuid),
		cmocka_unit_test(test_mem_open),
		cmocka_unit_test(test_fence),
		cmocka_unit_test(test_fence_engine_gone),
	};
	const char *path = getenv("KVTIER_HIP_LIBRARY");
	void *l = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;

	if (!l || !dlsym(l, "kvt_fake_hip_kernel_write")) {
		printf("skip: no fake HIP ($KVTIER_HIP_LIBRARY)\n");
		return 77;
	}
	/* HIP stays loaded, and the HSA runtime (uninitialized: the exporter
	 * is forked later), as in a server that opened IPC handles (HIP is
	 * never unloaded): the runtime's handler list keeps each backend's
	 * fault note */
	if (!dlopen(getenv("KVTIER_HSA_LIBRARY"), RTLD_NOW | RTLD_LOCAL))
		return 1;
	return cmocka_run_group_tests(tests, setup, teardown);
}
