/* copy_kernel.c - the copy kernel's source: a gather/scatter between the
 * engine's KV pages and the arena's registered (device-mapped) pages, for
 * pages too small for the copy engines to run well.
 *
 * Why a kernel.  A DMA copy costs the copy engine a fixed setup per
 * descriptor: vLLM measured cuMemcpyBatchAsync host->GPU on an H100 at
 * 5-7 GB/s for 4-24 KiB pieces and 40-52 GB/s only from 28-64 KiB (vLLM PR
 * #42212), and its own offloading connector copies blocks under 28 KiB
 * with a gather kernel.  A kernel's threads read and write the pinned
 * arena directly over PCIe (the arena is registered with DEVICEMAP), many
 * small pages at once, at the cost of a few SMs.
 *
 * The source is compiled at run time -- NVRTC from the engine's CUDA
 * (nvrtc.c, for cuda.c), hiprtc from the node's ROCm (hiprtc.c, for
 * hsa.c) -- so no toolkit is needed where kvtier is built, and the code is
 * made for the device it runs on: plain CUDA C that both compilers take.
 * It is compiled in CI by the real NVRTC and the real hiprtc (tests/dma),
 * so a syntax or parameter error fails there; the fake libcuda and the
 * fake HIP run a CPU version of it with the same arguments
 * (tests/fakes/fake_cuda.c, fake_hip.c), which must stay the kernel's
 * exact meaning.
 *
 * Arguments: an array of n descriptors (struct below, 48 bytes, device-
 * readable pinned host memory), each `rows` rows of `len` bytes, row r
 * from src + r * spitch to dst + r * dpitch.  One thread block per
 * descriptor at a time (blocks stride over the array: the launch bounds
 * how many SMs it takes); 16-byte loads and stores when the addresses and
 * length allow, bytes otherwise.
 */
#include "dma_int.h"

const char kvt__copy_kernel_name[] = "kvt_copy_pages";

const char kvt__copy_kernel_src[] =
	"struct kvt_kcopy {\n"
	"	unsigned long long src, dst, len, rows, spitch, dpitch;\n"
	"};\n"
	"\n"
	"extern \"C\" __global__ void kvt_copy_pages(const struct kvt_kcopy *cp, unsigned int n)\n"
	"{\n"
	"	for (unsigned int i = blockIdx.x; i < n; i += gridDim.x) {\n"
	"		const struct kvt_kcopy c = cp[i];\n"
	"		for (unsigned long long r = 0; r < c.rows; r++) {\n"
	"			const char *s = (const char *)(c.src + r * c.spitch);\n"
	"			char *d = (char *)(c.dst + r * c.dpitch);\n"
	"			if ((((unsigned long long)s | (unsigned long long)d | c.len) & 15) == 0) {\n"
	"				const uint4 *s4 = (const uint4 *)s;\n"
	"				uint4 *d4 = (uint4 *)d;\n"
	"				for (unsigned long long j = threadIdx.x; j < c.len / 16;\n"
	"				     j += blockDim.x)\n"
	"					d4[j] = s4[j];\n"
	"			} else {\n"
	"				for (unsigned long long j = threadIdx.x; j < c.len; j += blockDim.x)\n"
	"					d[j] = s[j];\n"
	"			}\n"
	"		}\n"
	"	}\n"
	"}\n";

int kvt__kernel_plan(const struct kvt_plan *p, uint64_t below)
{
	uint64_t bytes = 0, rows = 0;

	if (!p->n)
		return 0;
	for (uint32_t i = 0; i < p->n; i++) {
		bytes += p->copies[i].len * p->copies[i].rows;
		rows += p->copies[i].rows;
	}
	return bytes < below * rows;
}

void kvt__kernel_descs(struct kvt__kcopy *kd, const struct kvt_dma_job *j)
{
	const struct kvt_plan *p = j->plan;
	int d2h = j->dir == KVT_DMA_D2H;

	for (uint32_t i = 0; i < p->n; i++) {
		const struct kvt_copy *c = &p->copies[i];
		uint64_t host = j->host_dev + c->off;

		kd[i] = (struct kvt__kcopy){
			.src = d2h ? c->dev : host, .dst = d2h ? host : c->dev,
			.len = c->len, .rows = c->rows,
			.spitch = d2h ? c->dev_pitch : c->host_pitch,
			.dpitch = d2h ? c->host_pitch : c->dev_pitch,
		};
	}
}
