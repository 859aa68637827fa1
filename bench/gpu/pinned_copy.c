/* pinned_copy.c - the reference the GPU numbers are judged against, with
 * the CUDA runtime exactly as an engine uses it: cudaMalloc'ed device
 * memory, cudaMallocHost'ed (pinned) host memory, cudaMemcpyAsync on one
 * stream.  For each copy size, copies back to back over a 256 MiB buffer
 * until at least 4 GiB moved, per direction; prints GB/s.  Independent of
 * kvtier (its own build, libcudart), so it cross-checks the ceiling that
 * `kvtier-bench bandwidth` measures through the driver API.
 *
 *   pinned_copy [device] [sizes...]      sizes like 65536 or 64K (default:
 *                                        64K 256K 1M 4M 16M)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#define BUF (256ull << 20)

#define CK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
	fprintf(stderr, "pinned_copy: %s: %s\n", #call, cudaGetErrorString(e_)); \
	exit(1); } } while (0)

static size_t parse(const char *s)
{
	char *end;
	double v = strtod(s, &end);

	if (*end == 'K' || *end == 'k')
		v *= 1024;
	else if (*end == 'M' || *end == 'm')
		v *= 1024 * 1024;
	return (size_t)v;
}

static double run(int h2d, void *dev, void *host, size_t size, cudaStream_t st,
		  cudaEvent_t a, cudaEvent_t b)
{
	size_t per = BUF / size * size, moved = 0;
	float ms = 0;

	/* warm-up pass */
	for (size_t o = 0; o + size <= per; o += size)
		CK(cudaMemcpyAsync(h2d ? (char *)dev + o : (char *)host + o,
				   h2d ? (char *)host + o : (char *)dev + o, size,
				   h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, st));
	CK(cudaEventRecord(a, st));
	while (moved < (4ull << 30)) {
		for (size_t o = 0; o + size <= per; o += size)
			CK(cudaMemcpyAsync(h2d ? (char *)dev + o : (char *)host + o,
					   h2d ? (char *)host + o : (char *)dev + o, size,
					   h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, st));
		moved += per;
	}
	CK(cudaEventRecord(b, st));
	CK(cudaEventSynchronize(b));
	CK(cudaEventElapsedTime(&ms, a, b));
	return moved / (ms * 1e-3) / 1e9;
}

int main(int argc, char **argv)
{
	static const char *dflt[] = { "64K", "256K", "1M", "4M", "16M" };
	const char **sizes = dflt;
	int n = 5, dev_id = argc > 1 ? atoi(argv[1]) : 0;
	struct cudaDeviceProp prop;
	cudaStream_t st;
	cudaEvent_t a, b;
	void *dev, *host;

	if (argc > 2) {
		sizes = (const char **)argv + 2;
		n = argc - 2;
	}
	CK(cudaSetDevice(dev_id));
	CK(cudaGetDeviceProperties(&prop, dev_id));
	CK(cudaMalloc(&dev, BUF));
	CK(cudaMallocHost(&host, BUF));
	memset(host, 0x5a, BUF);
	CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
	CK(cudaEventCreate(&a));
	CK(cudaEventCreate(&b));
	printf("cudaMemcpyAsync, pinned host memory, one stream, device %d (%s)\n", dev_id,
	       prop.name);
	printf("%10s %10s %10s\n", "bytes", "D2H GB/s", "H2D GB/s");
	for (int i = 0; i < n; i++) {
		size_t size = parse(sizes[i]);

		if (!size || size > BUF) {
			fprintf(stderr, "pinned_copy: bad size %s\n", sizes[i]);
			return 2;
		}
		printf("%10zu %10.2f %10.2f\n", size, run(0, dev, host, size, st, a, b),
		       run(1, dev, host, size, st, a, b));
	}
	CK(cudaFreeHost(host));
	CK(cudaFree(dev));
	return 0;
}
