/* hip.h - the HIP runtime (libamdhip64), loaded at run time, for what the
 * bench needs on an AMD GPU: the engine's kind of device memory (hipMalloc:
 * what a ROCm torch tensor is), and the engine's own pinned copy as the
 * ceiling (hipMemcpyAsync from hipHostMalloc'ed or hipHostRegister'ed host
 * memory).  kvtier itself never links HIP: its hsa backend copies HIP
 * device pointers directly (they are HSA pool memory on ROCm).
 *
 * The library: $KVTIER_HIP_LIBRARY, else libamdhip64.so.6, .so.5, .so.
 * Every function returns 0 or -errno and leaves a message for
 * kvt_hip_last_error(); a runtime without a device is -ENODEV ("no AMD
 * GPU"), not a crash.  One handle per process, used by one thread.
 */
#ifndef KVT_BENCH_HIP_H
#define KVT_BENCH_HIP_H

#include <stdint.h>

typedef struct kvt_hip kvt_hip;

/* Which host memory the ceiling copies from. */
enum kvt_hip_pinned {
	KVT_HIP_HOST_MALLOC = 0, /* hipHostMalloc: memory the runtime pinned */
	KVT_HIP_HOST_REGISTER,   /* malloc + hipHostRegister, as an engine
				  * registers its own buffers */
};

int kvt_hip_open(int device, kvt_hip **out);
void kvt_hip_close(kvt_hip *h);
const char *kvt_hip_last_error(void);
/* "HIP 5.2.21153, device 0: <name>, 2 devices" */
const char *kvt_hip_describe(const kvt_hip *h);

int kvt_hip_malloc(kvt_hip *h, uint64_t bytes, uint64_t *dev);
int kvt_hip_free(kvt_hip *h, uint64_t dev);
int kvt_hip_write(kvt_hip *h, uint64_t dev, const void *src, uint64_t len);
int kvt_hip_read(kvt_hip *h, void *dst, uint64_t dev, uint64_t len);

/* The engine's side of an ordering check: fills [dev, dev + len) with
 * `byte` on the handle's stream (hipMemsetAsync: a kernel, queued, done
 * later), and waits for everything queued on that stream. */
int kvt_hip_fill_async(kvt_hip *h, uint64_t dev, int byte, uint64_t len);
int kvt_hip_sync(kvt_hip *h);
/* The handle's stream, as a number (what kvt_dma_order_after takes). */
uint64_t kvt_hip_stream(const kvt_hip *h);

/* The ceiling: `iters` rounds of copy_bytes-sized hipMemcpyAsync over
 * [dev, dev + bytes) on one stream, direction d2h (1) or h2d (0), from host
 * memory of kind `pinned`; *seconds is the wall time to the stream's end.
 * *devptr_differs (may be NULL) tells, for hipHostRegister, whether the
 * runtime's device address of the range differed from its host address
 * (hipHostGetDevicePointer; copies are given the host address, as
 * hipMemcpyAsync expects). */
int kvt_hip_ceiling(kvt_hip *h, int d2h, uint64_t dev, uint64_t bytes, uint64_t copy_bytes,
		    uint32_t iters, enum kvt_hip_pinned pinned, double *seconds,
		    int *devptr_differs);

#endif
