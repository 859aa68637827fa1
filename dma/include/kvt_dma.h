/* kvt_dma.h - the DMA core of kvtier: KV layouts, copy plans, and the
 * backends (host, hsa, cuda) that move a chunk between an engine's device
 * KV cache and its sub-slot in the shared arena, with no staging copy.
 *
 * Internal API of kvtier (engines use tier/include/kvtier.h).  Depends on
 * libc, libdl and pthreads only; GPU runtimes are loaded with dlopen.
 *
 * Conventions (STYLE.md): every int function returns 0 or a count on
 * success and -errno on failure and never changes errno for the caller;
 * a failure leaves a description for the calling thread in
 * kvt_dma_last_error().  Objects come back through an out-pointer that is
 * set only on success.
 *
 * Typical use by one rank:
 *
 *	kvt_dma_open(&cfg, &d);                  backend from $KVTIER_DMA
 *	kvt_dma_kv_register(d, &layout);         once: geometry, device
 *	kvt_dma_mem_register(d, arena, len, shard_bytes, &mr);
 *	kvt_plan_init(&plan, kvt_kv_layout_max_copies(&layout));
 *	for each chunk:
 *		kvt_dma_plan_build(d, &plan, blocks, n_tokens);
 *		kvt_dma_submit(d, &plan, subslot, KVT_DMA_D2H, &t);   -EAGAIN: full
 *		... kvt_dma_wait(d, t, timeout)  == 0  ->  set the ready bit
 *		                                  <  0  ->  abort the write
 */
#ifndef KVT_DMA_H
#define KVT_DMA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVT_DMA_API_VERSION      1
#define KVT_DMA_MAX_GROUPS       8            /* = KVT_MAX_GROUPS of core */
#define KVT_DMA_INFLIGHT_DEFAULT 32           /* chunks in flight per rank */
#define KVT_DMA_INFLIGHT_MAX     4096         /* HSA caps interrupt signals here */
#define KVT_DMA_HSA_INFLIGHT_MAX 1024         /* hsa: a quarter of them; HIP's
						* streams and events need the rest */
#define KVT_DMA_PIECE_MAX        (64ULL << 30) /* largest single registration */

/* ---- KV layout --------------------------------------------------------
 *
 * What one rank registers once: one or more layer groups.  In group g,
 * layer l, the engine's block b (tokens_per_block tokens of
 * bytes_per_token bytes each, contiguous) lives at
 *
 *	layer_base[l] + b * block_stride          (a device address)
 *
 * so layer l's cache spans [layer_base[l], layer_base[l] + (n_blocks - 1) *
 * block_stride + tokens_per_block * bytes_per_token), which must lie in one
 * device allocation.
 * A chunk is chunk_tokens consecutive tokens, a whole number of blocks of
 * every group.  Its sub-slot in the arena is group-major, layer-major,
 * token-contiguous: for group g, layer l
 *
 *	offset(g, l) = sum over g' < g of (layers(g') * T * bpt(g'))
 *	             + l * T * bpt(g)                       (T = chunk_tokens)
 *
 * and token t of the chunk sits at offset(g, l) + t * bpt(g).  The
 * sub-slot's used size is T * sum(layers * bpt) (kvt_kv_layout_shard_bytes);
 * core's kvt_geometry_shard_bytes() rounds it up, and no plan touches the
 * rounding.
 *
 * Layouts of common engines: vLLM's flash-attention cache
 * [2, n_blocks, block, heads, dim] per layer is two "layers" (K and V) with
 * block_stride = page; FlashInfer's [n_blocks, 2, block, heads, dim] is K at
 * base and V at base + page, each with block_stride = 2 * page; an MLA
 * cache [n_blocks, block, 576] is one layer with block_stride = page.
 */

#define KVT_GROUP_F_REPLICATED 0x1u /* every rank holds the same bytes (MLA) */
#define KVT_GROUP_F_MASK       0x1u

struct kvt_kv_group {
	uint32_t n_layers;         /* >= 1 */
	uint32_t bytes_per_token;  /* per layer, for this rank, >= 1 */
	uint32_t tokens_per_block; /* engine block size (16..256), divides chunk_tokens */
	uint32_t flags;            /* KVT_GROUP_F_* (informational for the plan) */
	uint64_t block_stride;     /* bytes from block b to b+1 of one layer,
				    * >= tokens_per_block * bytes_per_token */
	uint64_t n_blocks;         /* blocks per layer in the device cache: block
				    * ids must be below it */
	const uint64_t *layer_base; /* n_layers device addresses; the dma handle
				    * copies them at kvt_dma_kv_register() */
};

struct kvt_kv_layout {
	uint32_t chunk_tokens;     /* tokens per chunk, >= 1 */
	uint32_t n_groups;         /* 1..KVT_DMA_MAX_GROUPS */
	struct kvt_kv_group groups[KVT_DMA_MAX_GROUPS];
};

/* Checks a layout: ranges, divisibility, overflow of every address and
 * offset the plans can form.  0 or -EINVAL with a sentence in msg (may be
 * NULL).  Pure. */
int kvt_kv_layout_check(const struct kvt_kv_layout *l, char *msg, size_t len);

/* chunk_tokens * sum(n_layers * bytes_per_token): the used bytes of one
 * sub-slot.  0 for an invalid layout.  Pure. */
uint64_t kvt_kv_layout_shard_bytes(const struct kvt_kv_layout *l);

/* offset(g, layer) in the sub-slot; UINT64_MAX when out of range.  Pure. */
uint64_t kvt_kv_layout_offset(const struct kvt_kv_layout *l, uint32_t g,
			      uint32_t layer);

/* The most copies one chunk's plan can need (every page separate): the
 * capacity to give kvt_plan_init().  0 for an invalid layout.  Pure. */
uint32_t kvt_kv_layout_max_copies(const struct kvt_kv_layout *l);

/* ---- copy plans -------------------------------------------------------
 *
 * A plan is the list of contiguous (or 2-D) copies between the device pages
 * of one chunk and its sub-slot.  It does not depend on the direction. */

struct kvt_copy {
	uint64_t dev;        /* device address of row 0 */
	uint64_t off;        /* sub-slot offset of row 0 */
	uint64_t len;        /* bytes per row */
	uint64_t dev_pitch;  /* bytes between rows on the device (rows > 1) */
	uint64_t host_pitch; /* bytes between rows in the sub-slot (rows > 1) */
	uint32_t rows;       /* 1: a plain contiguous copy */
	uint32_t group;      /* layer group it belongs to */
};

/* What the backend can do in one copy.  max_rows <= 1: 1-D copies only. */
/* A range of device memory that the runtime treats as one allocation
 * (cuPointerGetAttribute's RANGE_START/SIZE, hsa_amd_pointer_info's
 * agentBaseAddress/sizeInBytes): [start, end). */
struct kvt_range {
	uint64_t start, end;
};

struct kvt_plan_caps {
	uint32_t max_rows;    /* rows of one 2-D copy */
	uint32_t pitch_align; /* pitches, row length and both row-0 addresses
			       * must be multiples of it (power of two, >= 1) */
	uint64_t max_pitch;   /* largest pitch */
	/* The device allocations the layers lie in, sorted, disjoint (NULL:
	 * unknown, no constraint): a copy -- a 2-D copy's whole extent, rows
	 * and pitches included -- never runs from one into another, where a
	 * runtime may refuse it (one tensor per layer: each layer its own
	 * allocation, even when they sit at an even spacing). */
	const struct kvt_range *ranges;
	uint32_t n_ranges;
};

struct kvt_plan {
	struct kvt_copy *copies;
	uint32_t n;          /* copies in use */
	uint32_t cap;        /* copies allocated */
	uint64_t bytes;      /* payload bytes the copies move */
	uint64_t span;       /* 1 + the last sub-slot byte written/read (0 if none) */
	uint32_t n_tokens;   /* tokens the plan covers */
	uint32_t reserved;
	uint64_t skipped;    /* payload bytes of KVT_DMA_BLOCK_SKIP blocks, not moved */
};

/* A block id that stands for "no block": the plan has no copy for it, and
 * its pages of the sub-slot are neither read nor written.  For loads into
 * an engine's cache where a block of the chunk is not the engine's to write
 * (vLLM's null block outside a sliding window, or a block it computed
 * itself); never in a save (kvtier.c refuses it there). */
#define KVT_DMA_BLOCK_SKIP UINT32_MAX

/* Allocates room for cap copies (kvt_kv_layout_max_copies()).  0 or
 * -EINVAL / -ENOMEM.  The only allocation a plan ever makes. */
int kvt_plan_init(struct kvt_plan *p, uint32_t cap);
void kvt_plan_fini(struct kvt_plan *p);

/* Builds the plan of one chunk: the fewest copies it finds between the
 * pages of the blocks and the sub-slot.  blocks[g] lists the block ids of
 * group g for this chunk, ceil(n_tokens / tokens_per_block(g)) of them (the
 * same table may serve several groups).  n_tokens <= chunk_tokens; a
 * partial chunk copies only its tokens, 0 tokens gives an empty plan.
 * Adjacent blocks merge into one copy; with caps->max_rows > 1, regularly
 * spaced equal copies (strided blocks, or the same block across layers)
 * merge into 2-D copies.  caps NULL: 1-D only.  Every copy stays inside
 * [0, shard_bytes) of the sub-slot and inside its layer's cache.
 * A block id KVT_DMA_BLOCK_SKIP gets no copy (p->skipped counts its bytes).
 * Returns the number of copies, -EINVAL (bad layout or arguments), -ERANGE
 * (a block id >= n_blocks that is not KVT_DMA_BLOCK_SKIP), -ENOSPC (p->cap
 * too small).  Pure, no allocation. */
int kvt_plan_build(struct kvt_plan *p, const struct kvt_kv_layout *l,
		   const struct kvt_plan_caps *caps,
		   const uint32_t *const *blocks, uint32_t n_tokens);

/* Verifies a plan against a layout: every row inside the sub-slot's used
 * bytes and inside the group's device cache, no two rows of the sub-slot
 * overlapping, and the payload equal to n_tokens' bytes.  0 or -EUCLEAN
 * with a sentence in msg.  Pure (tests, debug builds). */
int kvt_plan_check(const struct kvt_plan *p, const struct kvt_kv_layout *l,
		   char *msg, size_t len);

/* ---- the DMA handle ----------------------------------------------------- */

typedef struct kvt_dma kvt_dma;
typedef struct kvt_dma_mr kvt_dma_mr;   /* a registered host range */
typedef uint64_t kvt_dma_ticket;        /* one submitted chunk; never 0 */

enum kvt_dma_dir {
	KVT_DMA_D2H = 0, /* save: device pages -> sub-slot */
	KVT_DMA_H2D = 1, /* load: sub-slot -> device pages */
};

enum kvt_dma_log_level { KVT_DMA_LOG_ERR = 0, KVT_DMA_LOG_INFO = 1, KVT_DMA_LOG_DEBUG = 2 };

#define KVT_DMA_F_NO_2D     0x1u /* never use 2-D copies */
#define KVT_DMA_F_NO_BATCH  0x2u /* cuda: no cuMemcpyBatchAsync */
#define KVT_DMA_F_NO_ENGINE 0x4u /* hsa: no _on_engine engine choice */
#define KVT_DMA_F_QUIET     0x8u /* default logger: errors only */
#define KVT_DMA_F_HOST_WORKERS 0x10u /* n_workers is for the host backend only:
				      * cuda keeps its default streams */
#define KVT_DMA_F_NO_KERNEL 0x20u /* cuda, hsa: DMA only, never the copy kernel */
#define KVT_DMA_F_MASK      0x3fu

/* cuda, hsa: plans whose pages (bytes per row, averaged over the plan) are
 * below this go through the copy kernel rather than the copy engines:
 * vLLM measured batched DMA at 5-7 GB/s below 24 KiB and 40-52 GB/s from
 * 28 KiB on an H100 (copy_kernel.c) */
#define KVT_DMA_KERNEL_BELOW_DEFAULT (28u << 10)

struct kvt_dma_config {
	size_t size;            /* sizeof(struct kvt_dma_config) */
	const char *backend;    /* "auto" | "hsa" | "cuda" | "host"; NULL: $KVTIER_DMA,
				 * else "auto" */
	int32_t device;         /* GPU ordinal; -1: the owner of the KV pointers */
	uint32_t max_inflight;  /* tickets; 0: KVT_DMA_INFLIGHT_DEFAULT */
	uint32_t n_workers;     /* host: copy threads (0: sized from the CPU
				 * budget, see node_ranks); cuda: streams (0: 4) */
	uint32_t flags;         /* KVT_DMA_F_* */
	uint64_t piece_max;     /* largest registration piece; 0: KVT_DMA_PIECE_MAX */
	uint32_t fault_nth;     /* testing, host backend: the nth submitted ticket
				 * (1-based) fails with -EIO; 0: never */
	uint32_t node_ranks;    /* host: rank processes on this node that share
				 * this process's CPUs (0: 1).  With n_workers 0,
				 * a rank's share is the CPUs it may run on
				 * (affinity mask, lowered to a cgroup v2 cpu.max
				 * quota) over node_ranks: share <= 2 -> 1 worker,
				 * else share - 1, at most 4 (the caller copies
				 * too while it waits) */
	/* Log sink; NULL: stderr ("kvtier dma: ..."), errors and info. */
	void (*log)(void *arg, int level, const char *msg);
	void *log_arg;
	/* cuda and hsa, the copy kernel (unless KVT_DMA_F_NO_KERNEL): plans
	 * with pages below kernel_below bytes (0: KVT_DMA_KERNEL_BELOW_DEFAULT)
	 * go through it, on at most kernel_ctas thread blocks / workgroups (0:
	 * an eighth of the device's SMs / CUs, at least 1) -- the share of the
	 * GPU it may take */
	uint64_t kernel_below;
	uint32_t kernel_ctas;
};

/* Opens a backend.  "auto" tries hsa, cuda, then host and takes the first
 * whose runtime loads and finds a device; it logs which one it took and why
 * each other one was skipped (also in kvt_dma_describe()).  A named backend
 * that is unavailable fails: -ENOENT (runtime library absent), -ENODEV
 * (runtime present, no usable device; hsa_init failing is this), -EINVAL
 * (bad config, unknown name), -ENOMEM.  The runtimes are found through
 * $KVTIER_HSA_LIBRARY / $KVTIER_CUDA_LIBRARY, else their sonames.  Blocks
 * (loads libraries, starts threads). */
int kvt_dma_open(const struct kvt_dma_config *c, kvt_dma **out);

/* Waits for every ticket in flight, unregisters every range, releases the
 * runtime.  NULL is ignored. */
void kvt_dma_close(kvt_dma *d);

/* kvt_dma_close with a deadline for the drain (timeout_ns < 0: none): 0
 * when closed; else the number of copies still running then, which are
 * abandoned -- logged, and the handle kept whole (registrations, streams)
 * until the process exits, because the device may still touch that
 * memory.  The caller must keep the memory too (the arena mapped, its
 * slots claimed). */
int kvt_dma_close_within(kvt_dma *d, int64_t timeout_ns);

/* "host", "hsa" or "cuda". */
const char *kvt_dma_backend(const kvt_dma *d);
/* One line: backend, device, optional features in use, backends skipped
 * and why.  Valid until close. */
const char *kvt_dma_describe(const kvt_dma *d);
/* Thread-local description of this thread's last failure. */
const char *kvt_dma_last_error(void);

/* Registers the rank's KV cache (once per handle): checks the layout
 * (kvt_kv_layout_check), copies it, and binds the handle to the device
 * that owns the pointers (GPU backends; every base must belong to the same
 * device, and to cfg->device if set).  0, -EINVAL (bad layout, pointers not
 * device memory or on several devices), -EALREADY (registered before),
 * -EIO (runtime error).  Blocks briefly. */
int kvt_dma_kv_register(kvt_dma *d, const struct kvt_kv_layout *l);
/* The registered layout (layer_base arrays owned by the handle), or NULL. */
const struct kvt_kv_layout *kvt_dma_kv_layout(const kvt_dma *d);

/* What this backend's copies can do (feeds kvt_plan_build). */
void kvt_dma_plan_caps(const kvt_dma *d, struct kvt_plan_caps *caps);
/* kvt_plan_build() with the registered layout and the backend's caps;
 * -EINVAL before kvt_dma_kv_register(). */
int kvt_dma_plan_build(const kvt_dma *d, struct kvt_plan *p,
		       const uint32_t *const *blocks, uint32_t n_tokens);

/* Registers (page-locks and maps for the device) the host range
 * [base, base + len) in pieces of at most cfg->piece_max bytes, each a
 * multiple of align (the sub-slot size, so that no sub-slot straddles two
 * pieces; 0 or 1: no alignment).  GPU backends need the device bound first
 * (kvt_dma_kv_register or cfg->device).  Each rank registers its own
 * mapping.  0, -EINVAL (bad arguments, overlaps a registered range, align
 * > piece_max), -ENOMEM / -EPERM / -EIO (runtime refused; nothing stays
 * registered).  Blocks: about 1-2 GB/s with 4 KiB pages.
 *
 * kvt_dma_mem_register_bg registers the first piece the same way and the
 * others on a thread of its own, in address order, each usable as soon as
 * it is registered: a submit into a piece not reached yet waits for it
 * (-EIO if the registration failed there, logged).  A rank holding a
 * large arena starts after one piece instead of all of them.
 * Unregistering or closing stops the thread after its current piece. */
int kvt_dma_mem_register_bg(kvt_dma *d, void *base, uint64_t len, uint64_t align,
			    kvt_dma_mr **out);
/* Bytes of a registration registered so far (all of it, once done). */
uint64_t kvt_dma_mem_ready(const kvt_dma_mr *mr);
int kvt_dma_mem_register(kvt_dma *d, void *base, uint64_t len, uint64_t align,
			 kvt_dma_mr **out);

/* Unregisters.  -EBUSY while a ticket on the range is in flight (nothing
 * changes), else 0. */
int kvt_dma_mem_unregister(kvt_dma *d, kvt_dma_mr *mr);

struct kvt_dma_mr_info {
	void *base;
	uint64_t len;
	uint64_t piece_bytes;  /* every piece but the last */
	uint32_t n_pieces;
	uint32_t ready_pieces; /* registered so far (kvt_dma_mem_register_bg) */
	uint32_t inflight;     /* tickets using it now */
	uint64_t register_ns;  /* time the registration took */
};
void kvt_dma_mr_info(const kvt_dma_mr *mr, struct kvt_dma_mr_info *info);

/* Submits a plan on the sub-slot that starts at host address `subslot`
 * (inside a registered range; the plan's span must lie in one piece).
 * The plan may be reused as soon as this returns.  Returns 0 with *t set,
 * -EAGAIN (max_inflight tickets in flight: wait for one and retry),
 * -EFAULT (sub-slot not registered or straddling two pieces), -EINVAL (bad
 * plan or direction), -EIO (the runtime refused the copies; nothing is in
 * flight).  Thread-safe.  May block briefly when the device queue is full. */
int kvt_dma_submit(kvt_dma *d, const struct kvt_plan *p, void *subslot,
		   enum kvt_dma_dir dir, kvt_dma_ticket *t);

/* Orders the copies submitted from now on after the work the engine has
 * queued on `stream` so far: a save submitted after this copies what the
 * engine's kernels wrote, not what they are still writing.  vLLM asks for
 * its saves once it has launched the forward pass, not once the pass has
 * finished, so a save on a GPU backend needs this (the vLLM connector
 * passes torch's current stream).  Per backend:
 *   cuda: `stream` is a CUstream of the bound device's context (0: the
 *         legacy default stream); an event recorded on it, which each copy
 *         stream waits on (cuStreamWaitEvent) before its next copy;
 *   host: 0, nothing to do (the copies read memory the caller wrote);
 *   hsa:  -ENOTSUP: HIP streams do not expose their HSA signals here;
 *         synchronize the engine's stream on the host before saving.
 * Loads need no counterpart while the caller waits for them on the host
 * before it launches the kernels that read the blocks.  0, -EINVAL (no
 * KV registered, a bad stream), -EIO (the runtime failed; for cuda, a
 * lost context). */
int kvt_dma_order_after(kvt_dma *d, uint64_t stream);

/* Polls a ticket: 0 (done, data in place; the ticket is consumed),
 * -EINPROGRESS, -EIO (a copy failed; consumed: never mark the chunk
 * ready), -ESTALE (not a live ticket).  Never blocks.  A ticket is consumed
 * by exactly one call that returns its final status. */
int kvt_dma_poll(kvt_dma *d, kvt_dma_ticket t);

/* Waits up to timeout_ns (< 0: forever) for a ticket: 0, -ETIMEDOUT (still
 * in flight, not consumed), -EIO, -ESTALE, as kvt_dma_poll(). */
int kvt_dma_wait(kvt_dma *d, kvt_dma_ticket t, int64_t timeout_ns);

/* Tickets in flight now. */
uint32_t kvt_dma_inflight(const kvt_dma *d);
uint32_t kvt_dma_max_inflight(const kvt_dma *d);

/* ---- another process's GPU memory and events ---------------------------------
 * For a server that copies between an engine process's KV cache and the
 * arena (kvtierd's LMCache front end): the engine exports its allocations
 * and events with the driver's IPC handles (cudaIpcMemHandle_t,
 * cudaIpcEventHandle_t: KVT_DMA_IPC_BYTES opaque bytes), the server opens
 * them in the bound device's primary context -- the one every cuda handle
 * of the process uses, so an opened pointer is good as a layer base of a
 * kvtier rank handle too.  hsa: HIP's handles (hipIpcMemHandle_t,
 * hipIpcEventHandle_t, the same 64 bytes), opened with the HIP runtime,
 * loaded at the first call; its devices' UUIDs are hipDeviceGetUuid's
 * (the agent's "GPU-" id as characters); no timeline semaphores.  host
 * answers -ENOTSUP.  Blocking, not thread-safe against kvt_dma_close. */
#define KVT_DMA_IPC_BYTES 64

/* The ordinal of the device whose UUID (cuDeviceGetUuid's 16 bytes; hsa:
 * hipDeviceGetUuid's) this is -- how an engine names its GPU across
 * processes whose CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES differ.  The handle need not be bound.  The ordinal,
 * -ENODEV (no such device here), -ENOTSUP. */
int kvt_dma_device_of_uuid(kvt_dma *d, const uint8_t uuid[16]);

/* Maps the allocation an IPC memory handle names (bound handle): *base its
 * first byte here, *len its size (the allocation's range, as the driver
 * reports it: check a descriptor's view against it).  The driver counts
 * openings of one handle: each needs its kvt_dma_ipc_mem_close.  0,
 * -EINVAL (not bound; a handle the driver refuses), -EIO, -ENOTSUP. */
int kvt_dma_ipc_mem_open(kvt_dma *d, const void *handle, uint64_t *base, uint64_t *len);
int kvt_dma_ipc_mem_close(kvt_dma *d, uint64_t base);

/* A fence: the server's side of an engine's events.  kvt_dma_fence_wait
 * imports an engine's event and makes the fence's stream wait for its
 * latest record (on the device: nothing blocks here); hand
 * kvt_dma_fence_stream to kvt_dma_order_after / kvt_order_after so that the
 * copies submitted next start after the engine's work.
 * kvt_dma_fence_signal records the fence's own interprocess event on a
 * stream that waits for nothing and writes its handle: call it once the
 * copies the engine must see have completed (kvt_dma_poll / kvt_poll said
 * so), and the engine's wait on that handle is ordered after them.  0 or
 * -EINVAL / -EIO / -ENOMEM / -ENOTSUP. */
typedef struct kvt_dma_fence kvt_dma_fence;
int kvt_dma_fence_open(kvt_dma *d, kvt_dma_fence **out);
int kvt_dma_fence_wait(kvt_dma_fence *f, const void *event_handle);
uint64_t kvt_dma_fence_stream(const kvt_dma_fence *f);
int kvt_dma_fence_signal(kvt_dma_fence *f, void *event_handle);

/* The same with timeline semaphores instead of events -- for engines whose
 * processes share no /dev/shm (containers without the host's IPC
 * namespace), where the driver's event handles do not resolve and its
 * memory handles do: a semaphore is a 64-bit word in device memory that
 * only grows.  fence_wait_value makes the fence's stream wait until the
 * word at `offset` of the allocation `mem_handle` names reaches `value`
 * (the allocation opened once and kept with the fence; offset checked
 * against its size).  fence_signal_value writes the fence's own next value
 * into its own word on the signal stream (the same promise as
 * fence_signal: call it once the copies completed) and says where: its
 * allocation's handle, the word's offset, the value. */
#define KVT_DMA_SEM_BYTES 32768 /* the fence's own semaphore allocation */
int kvt_dma_fence_wait_value(kvt_dma_fence *f, const void *mem_handle, uint64_t offset,
			     uint64_t value);
int kvt_dma_fence_signal_value(kvt_dma_fence *f, void *mem_handle, uint64_t *offset,
			       uint64_t *value);
/* Waits for the fence's streams, then frees it.  NULL is ignored. */
void kvt_dma_fence_close(kvt_dma_fence *f);

/* ---- device memory, for tests and benches ---------------------------------
 * Device memory of the bound device (host backend: ordinary memory):
 * hipMalloc/cudaMalloc-equivalent allocations (hsa_amd_memory_pool_allocate
 * on the GPU's pool, cuMemAlloc in the primary context). */
int kvt_dma_dev_alloc(kvt_dma *d, uint64_t bytes, uint64_t *dev);
int kvt_dma_dev_free(kvt_dma *d, uint64_t dev);
/* Synchronous copies between ordinary host memory and device memory. */
int kvt_dma_dev_write(kvt_dma *d, uint64_t dev, const void *src, uint64_t len);
int kvt_dma_dev_read(kvt_dma *d, void *dst, uint64_t dev, uint64_t len);

/* The platform's own copy ceiling, measured: `iters` rounds over `bytes`
 * of device memory at dev, in copies of `copy_bytes`, between it and a
 * buffer the runtime itself pinned (cuMemAllocHost / a CPU pool, copied
 * with cuMemcpy*Async / hsa_amd_memory_async_copy on one queue) -- for the
 * host backend, single-threaded memcpy to or from shared memory (faulted
 * in and warmed up first).  Sets *seconds.  0 or -errno.  Blocks. */
int kvt_dma_ceiling(kvt_dma *d, enum kvt_dma_dir dir, uint64_t dev,
		    uint64_t bytes, uint64_t copy_bytes, uint32_t iters,
		    double *seconds);

#ifdef __cplusplus
}
#endif
#endif /* KVT_DMA_H */
