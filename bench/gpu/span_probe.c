/* span_probe.c - does the CUDA driver take a copy whose rows lie in separate
 * cuMemAlloc allocations placed back to back?  (bench/gpu/check.sh)
 *
 * The DMA plan keeps every copy inside one device allocation (struct
 * kvt_range: a 2-D copy is split where its rows leave one), because a
 * tensor that PyTorch's expandable segments or vLLM's sleep mode map in
 * pieces has its layers in separate allocations that may sit back to back.
 * This asks the real driver what it does with the copies the plan now
 * avoids:
 *
 *   2d     cuMemcpy2D, device to host: row 0 in allocation A, row 1 in the
 *          allocation B that starts where A ends (pitch = A's size);
 *   1d     cuMemcpyDtoH of 8 KiB straddling A's end and B's start.
 *
 * For each: "accepted, bytes right", "accepted, bytes WRONG" or "refused
 * (CUDA_ERROR_...)".  Exit 0 when it could ask (whatever the driver said),
 * 2 when no adjacent pair turned up among its allocations, 1 on an error
 * of its own.  KVTIER_CUDA_LIBRARY: the driver to load (a dry run: the fake).
 */
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_ALLOC 64
#define ALLOC (2u << 20)  /* the driver's allocation granularity */
#define ROW 4096u

static CUresult (*p_init)(unsigned);
static CUresult (*p_dev_get)(CUdevice *, int);
static CUresult (*p_retain)(CUcontext *, CUdevice);
static CUresult (*p_push)(CUcontext);
static CUresult (*p_alloc)(CUdeviceptr *, size_t);
static CUresult (*p_free)(CUdeviceptr);
static CUresult (*p_htod)(CUdeviceptr, const void *, size_t);
static CUresult (*p_2d)(const CUDA_MEMCPY2D *, CUstream);
static CUresult (*p_sync)(CUstream);
static CUresult (*p_dtoh)(void *, CUdeviceptr, size_t);
static CUresult (*p_name)(CUresult, const char **);
static CUresult (*p_gpa)(const char *, void **, int, cuuint64_t,
			 CUdriverProcAddressQueryResult *);

static const char *ename(CUresult r)
{
	const char *s = NULL;

	if (!p_name || p_name(r, &s) || !s)
		return "CUDA_ERROR_?";
	return s;
}

/* name's entry point as CUDA 12.0 defined it (the backend's way: every
 * driver from 12.0 has cuGetProcAddress_v2) */
static int sym(void *slot, const char *name)
{
	if (p_gpa(name, (void **)slot, 12000, 0, NULL) || !*(void **)slot) {
		fprintf(stderr, "span_probe: %s missing from the driver\n", name);
		return -1;
	}
	return 0;
}

/* "accepted, bytes right|WRONG" or "refused (...)", for the bytes of a
 * copy of the boundary: the first `na` bytes from A (0xa1), the rest from
 * B (0xb2). */
static void verdict(const char *what, CUresult r, const unsigned char *got, size_t len,
		    size_t na)
{
	size_t bad = 0;

	if (r) {
		printf("%s: refused (%s)\n", what, ename(r));
		return;
	}
	for (size_t i = 0; i < len; i++)
		bad += got[i] != (i < na ? 0xa1 : 0xb2);
	printf("%s: accepted, bytes %s\n", what, bad ? "WRONG" : "right");
}

int main(void)
{
	const char *path = getenv("KVTIER_CUDA_LIBRARY");
	CUdeviceptr d[N_ALLOC] = { 0 }, a = 0, b = 0;
	unsigned char *host;
	CUcontext ctx;
	CUdevice dev;
	CUresult r;
	void *lib;
	int n = 0;

	lib = dlopen(path && *path ? path : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		fprintf(stderr, "span_probe: %s\n", dlerror());
		return 1;
	}
	*(void **)&p_gpa = dlsym(lib, "cuGetProcAddress_v2");
	if (!p_gpa) {
		fprintf(stderr, "span_probe: no cuGetProcAddress_v2 (a driver older than 12.0)\n");
		return 1;
	}
	if (sym(&p_init, "cuInit") || sym(&p_dev_get, "cuDeviceGet") ||
	    sym(&p_retain, "cuDevicePrimaryCtxRetain") || sym(&p_push, "cuCtxPushCurrent") ||
	    sym(&p_alloc, "cuMemAlloc") || sym(&p_free, "cuMemFree") ||
	    sym(&p_htod, "cuMemcpyHtoD") || sym(&p_2d, "cuMemcpy2DAsync") ||
	    sym(&p_sync, "cuStreamSynchronize") || sym(&p_dtoh, "cuMemcpyDtoH") ||
	    sym(&p_name, "cuGetErrorName"))
		return 1;
	if ((r = p_init(0)) || (r = p_dev_get(&dev, 0)) || (r = p_retain(&ctx, dev)) ||
	    (r = p_push(ctx))) {
		fprintf(stderr, "span_probe: no context on device 0: %s\n", ename(r));
		return 1;
	}
	for (n = 0; n < N_ALLOC; n++)
		if (p_alloc(&d[n], ALLOC))
			break;
	for (int i = 0; i < n && !a; i++)
		for (int j = 0; j < n; j++)
			if (d[j] == d[i] + ALLOC) {
				a = d[i];
				b = d[j];
				break;
			}
	if (!a) {
		printf("no two of %d allocations of %u bytes lie back to back: not asked\n", n,
		       ALLOC);
		for (int i = 0; i < n; i++)
			p_free(d[i]);
		return 2;
	}
	printf("allocations %#llx and %#llx lie back to back (%u bytes each)\n",
	       (unsigned long long)a, (unsigned long long)b, ALLOC);
	host = malloc(ALLOC);
	if (!host) {
		fprintf(stderr, "span_probe: out of memory\n");
		return 1;
	}
	memset(host, 0xa1, ALLOC);
	r = p_htod(a, host, ALLOC);
	memset(host, 0xb2, ALLOC);
	if (r || p_htod(b, host, ALLOC)) {
		fprintf(stderr, "span_probe: setting the allocations up failed\n");
		return 1;
	}
	/* 2d: one row at the end of A, the next at the end of B */
	CUDA_MEMCPY2D m = {
		.srcMemoryType = CU_MEMORYTYPE_DEVICE, .srcDevice = a + ALLOC - ROW,
		.srcPitch = ALLOC, .dstMemoryType = CU_MEMORYTYPE_HOST, .dstHost = host,
		.dstPitch = ROW, .WidthInBytes = ROW, .Height = 2,
	};
	memset(host, 0, 2 * ROW);
	r = p_2d(&m, NULL);
	if (!r)
		r = p_sync(NULL);
	verdict("2d: rows in two back-to-back allocations", r, host, 2 * ROW, ROW);
	memset(host, 0, 2 * ROW);
	r = p_dtoh(host, a + ALLOC - ROW, 2 * ROW);
	verdict("1d: one copy across the two allocations", r, host, 2 * ROW, ROW);
	for (int i = 0; i < n; i++)
		p_free(d[i]);
	free(host);
	return 0;
}
