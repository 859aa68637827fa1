/* hsa.c - the AMD backend: ROCr (HSA) async copies between the GPU's KV
 * pages and the page-locked arena, on SDMA engines; small pages through a
 * copy kernel of our own, compiled by the node's hiprtc and launched
 * through HIP (see "The copy kernel", at the end).
 *
 * Runtime.  libhsa-runtime64.so.1 is dlopen'ed, RTLD_NOLOAD first so that
 * an engine's HIP runtime instance is reused (hsa_init is reference counted;
 * fini balances it with hsa_shut_down).  hsa_init failing -- no /dev/kfd
 * gives 0x1008 -- means "unavailable", reported with the status.  The ROCm
 * 5.6+ entry points (_on_engine, copy_engine_status, preferred engine) and
 * the provisional _rect are optional: looked up with dlsym, with local
 * prototypes, since Debian ships 5.2.3 headers.
 *
 * Pointers.  The arena is locked per piece with hsa_amd_memory_lock_to_pool
 * for the bound GPU only (mapping it into every GPU's page tables would
 * multiply the registration time) on the first CPU agent's global pool.
 * Copies use the agent pointer the lock returned, never the host address:
 * they differ on some systems, and the runtime only knows the former.
 *
 * Completion.  One signal per ticket slot, created at init and reused
 * (interrupt signals are capped at 4096 per process, HIP's included: at
 * most KVT_DMA_HSA_INFLIGHT_MAX slots here): set to the number of
 * copy operations, each completion decrements it, a negative value is an
 * error.  If issuing fails part way, the operations never issued are
 * subtracted and the issued ones are waited for before submit returns
 * -EIO, so a failed submit leaves nothing in flight.
 *
 * Engines.  With _on_engine, copies of one ticket go to one SDMA engine.
 * The candidates per direction are fixed at bind: the agent's NUM_SDMA_ENG
 * engines, narrowed to the preferred ones when the runtime names some, or
 * else to what copy_engine_status reports.  Which of them a ticket uses is
 * asked per submission: ROCr's copy_engine_status reports only the engines
 * idle at that instant (OUT_OF_RESOURCES when none is), so a snapshot at
 * bind dropped for good an engine that HIP's copies kept busy then.  Each
 * ticket rotates over the candidates idle now, or over all of them when
 * none is (a busy engine queues the copy).  The wrong engine costs ~15% on
 * MI300, so an engine that refuses a copy is dropped for good (logged),
 * falling back to
 * the runtime's own choice.
 *
 * Faults.  A GPU memory fault (a copy or a kernel touching an unmapped or
 * read-only page, an ECC error) stops every queue of the process in the
 * KFD driver, HIP's and ours, and ROCr then calls the system event
 * handlers; when none returns HSA_STATUS_SUCCESS it prints the fault and
 * aborts the process (runtime.cpp, VMFaultHandler).  kvtier registers one
 * handler per open backend (hsa_amd_register_system_event_handler; ROCr
 * has no way to unregister one, so the small note it points at is not
 * freed: closing the backend only marks it closed, and a closed note
 * answers "not mine" -- unless the runtime itself was unloaded with the
 * backend, its handler list gone).  The handler, on ROCr's event thread:
 *   - only for a fault on the GPU the backend is bound to (KFD stops the
 *     faulting device's queues; another GPU's copies go on, and a backend
 *     there must not let go of sub-slots they still write), and only the
 *     first: records it in the note (seen: CAS 0 -> 1, va and reason, 2
 *     with release / acquire in hsa_dead and fault_err), so every later
 *     submit, poll and wait of this backend fails at once with -EIO naming
 *     the fault -- the copies it had in flight will never complete, and
 *     none of them may publish a chunk.  A hardware exception (a hang or
 *     reset, HSA_AMD_GPU_HW_EXCEPTION_EVENT on ROCm 6+) is taken the same
 *     way;
 *   - writes one line to stderr saying where the address lies (kvtier's
 *     arena, the KV cache, neither) and what happens next -- with write(2),
 *     since the process is about to end and a logger callback may not be
 *     safe to call from the runtime's thread;
 *   - returns HSA_STATUS_ERROR: kvtier never claims the fault.  Its queues
 *     are gone and so are the engine's; keeping the process alive is the
 *     engine's choice (its own handler), not a copy tier's.  When the
 *     runtime aborts, the rank's death is what the segment already handles
 *     (exit witness, reaper): its claims are released, nothing it was
 *     writing is served.  When another handler takes the fault, the tier
 *     reports the backend down through its normal error path.
 * Waits with no deadline wait in slices (FAULT_SLICE_NS) so that a fault
 * noted meanwhile ends them.
 *
 * Ordering after the engine's stream (hsa_order_after), on the device: the
 * engine's HIP stream ends in a hipStreamWriteValue64 of 0 into the value
 * of an HSA signal armed at 1 (amd_signal_t.value, the word SDMA's poll
 * packets and AQL barriers read), and every copy submitted afterwards has
 * that signal as its dependency (dep_signals): it starts once the stream
 * got there.  No host stall.  A ring of FENCES signals, one per order: a
 * single re-armed signal would let an earlier, still queued write of 0
 * release copies that must wait for the later point.  A ring entry is
 * re-armed only once the stream wrote its 0; a copy that had it as its
 * dependency and has not started yet then waits for the newer point --
 * later, never earlier.  HIP's hipStreamWriteValue64 is looked up in the
 * HIP runtime already in the process (RTLD_NOLOAD; $KVTIER_HIP_LIBRARY
 * first): none there, and the engine's stream is not a HIP one, so
 * order_after refuses (-ENOTSUP) and the caller synchronizes on the host.
 * With the copy kernel loaded, order_after also records a HIP event on the
 * engine's stream that the kernel's streams wait on (see "The copy
 * kernel").
 *
 * Known limit: a negative signal ends the ticket with -EIO at once; other
 * copies of the same ticket may still be running (HSA gives no per-copy
 * status on a shared signal).  In ROCr a copy error is a queue error that
 * also stops the queue, so this is reported, not repaired.
 */
#include "dma_int.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <hsa/amd_hsa_signal.h>
#include <hsa/hsa.h>
#include <hsa/hsa_ext_amd.h>

#define MAX_GPUS 64
#define AGENT_INFO_NUM_SDMA_ENG      0xA10A /* ROCm 5.6+ */
#define AGENT_INFO_NUM_SDMA_XGMI_ENG 0xA10B
#define RECT_MAX_PITCH (1u << 19)           /* SDMA rect packet, safe for any element size */
#define RECT_MAX_ROWS  (1u << 14)
#define FAULT_SLICE_NS 10000000ull         /* a deadline-less wait rechecks faults */
#define FAULT_MAGIC    0x6b7674686661756cull
#define FENCES         16                  /* order_after's signals (see "Ordering") */
#define FENCE_IMPORTS  32                  /* engine events a fence keeps imported ("IPC") */
#define FENCE_CLOSE_GRACE_NS 200000000ull  /* a closing fence's wait for them */

/* ROCm 5.6+ prototypes (engine_id is one bit of hsa_amd_sdma_engine_id_t). */
typedef hsa_status_t (*copy_on_engine_fn)(void *dst, hsa_agent_t dst_agent,
					  const void *src, hsa_agent_t src_agent,
					  size_t size, uint32_t num_dep_signals,
					  const hsa_signal_t *dep_signals,
					  hsa_signal_t completion_signal,
					  uint32_t engine_id, bool force_copy_on_sdma);
typedef hsa_status_t (*engine_status_fn)(hsa_agent_t dst_agent, hsa_agent_t src_agent,
					 uint32_t *engine_ids_mask);

struct hsa_fns {
	__typeof__(&hsa_init) init;
	__typeof__(&hsa_shut_down) shut_down;
	__typeof__(&hsa_status_string) status_string;
	__typeof__(&hsa_system_get_info) system_get_info;
	__typeof__(&hsa_iterate_agents) iterate_agents;
	__typeof__(&hsa_agent_get_info) agent_get_info;
	__typeof__(&hsa_amd_agent_iterate_memory_pools) iterate_pools;
	__typeof__(&hsa_amd_memory_pool_get_info) pool_get_info;
	__typeof__(&hsa_amd_memory_pool_allocate) pool_allocate;
	__typeof__(&hsa_amd_memory_pool_free) pool_free;
	__typeof__(&hsa_amd_agents_allow_access) allow_access;
	__typeof__(&hsa_amd_memory_lock_to_pool) lock_to_pool;
	__typeof__(&hsa_amd_memory_unlock) unlock;
	__typeof__(&hsa_amd_memory_async_copy) async_copy;
	__typeof__(&hsa_amd_pointer_info) pointer_info;
	__typeof__(&hsa_signal_create) signal_create;
	__typeof__(&hsa_signal_destroy) signal_destroy;
	__typeof__(&hsa_signal_store_screlease) signal_store;
	__typeof__(&hsa_signal_load_scacquire) signal_load;
	__typeof__(&hsa_signal_add_screlease) signal_add;
	__typeof__(&hsa_signal_subtract_screlease) signal_subtract;
	__typeof__(&hsa_signal_wait_scacquire) signal_wait;
	/* optional */
	__typeof__(&hsa_amd_memory_async_copy_rect) copy_rect;
	copy_on_engine_fn copy_on_engine;
	engine_status_fn engine_status;
	engine_status_fn preferred_engine;
	__typeof__(&hsa_amd_register_system_event_handler) register_event_handler;
	__typeof__(&hsa_agent_iterate_isas) iterate_isas;     /* the copy kernel's target */
	__typeof__(&hsa_isa_get_info_alt) isa_info;
};

/* What the fault handler shares with the backend (see "Faults"): owned by
 * the runtime's handler list once registered, never freed.  The ranges are
 * written before any copy is issued and only read to word the report. */
struct hsa_fault {
	uint64_t magic;
	int closed;                 /* __atomic: the backend is gone */
	int seen;                   /* __atomic: 0, 1 (being noted), 2 (noted:
				     * va and reason written, release) */
	uint64_t va;                /* written before `seen` */
	uint32_t reason;
	uint64_t gpu_handle;        /* the bound GPU agent; 0 before bind */
	uint64_t kv_lo, kv_hi;      /* the KV cache's device span */
	uint64_t arena_lo, arena_hi;/* the locked arena's agent-pointer span */
	int gpu;                    /* the bound GPU's index */
};

struct sym {
	const char *name;
	size_t off;
	int required;
};

#define SYM(field, name, req) { name, offsetof(struct hsa_fns, field), req }
static const struct sym syms[] = {
	SYM(init, "hsa_init", 1),
	SYM(shut_down, "hsa_shut_down", 1),
	SYM(status_string, "hsa_status_string", 1),
	SYM(system_get_info, "hsa_system_get_info", 1),
	SYM(iterate_agents, "hsa_iterate_agents", 1),
	SYM(agent_get_info, "hsa_agent_get_info", 1),
	SYM(iterate_pools, "hsa_amd_agent_iterate_memory_pools", 1),
	SYM(pool_get_info, "hsa_amd_memory_pool_get_info", 1),
	SYM(pool_allocate, "hsa_amd_memory_pool_allocate", 1),
	SYM(pool_free, "hsa_amd_memory_pool_free", 1),
	SYM(allow_access, "hsa_amd_agents_allow_access", 1),
	SYM(lock_to_pool, "hsa_amd_memory_lock_to_pool", 1),
	SYM(unlock, "hsa_amd_memory_unlock", 1),
	SYM(async_copy, "hsa_amd_memory_async_copy", 1),
	SYM(pointer_info, "hsa_amd_pointer_info", 1),
	SYM(signal_create, "hsa_signal_create", 1),
	SYM(signal_destroy, "hsa_signal_destroy", 1),
	SYM(signal_store, "hsa_signal_store_screlease", 1),
	SYM(signal_load, "hsa_signal_load_scacquire", 1),
	SYM(signal_add, "hsa_signal_add_screlease", 1),
	SYM(signal_subtract, "hsa_signal_subtract_screlease", 1),
	SYM(signal_wait, "hsa_signal_wait_scacquire", 1),
	SYM(copy_rect, "hsa_amd_memory_async_copy_rect", 0),
	SYM(copy_on_engine, "hsa_amd_memory_async_copy_on_engine", 0),
	SYM(engine_status, "hsa_amd_memory_copy_engine_status", 0),
	SYM(preferred_engine, "hsa_amd_memory_get_preferred_copy_engine", 0),
	SYM(register_event_handler, "hsa_amd_register_system_event_handler", 0),
	SYM(iterate_isas, "hsa_agent_iterate_isas", 0),
	SYM(isa_info, "hsa_isa_get_info_alt", 0),
};

/* HIP, for IPC (see "IPC") */
typedef struct { char b[KVT_DMA_IPC_BYTES]; } hip_handle; /* by value, as HIP's */

struct hip_fns {
	void *lib;
	const char *(*err_str)(int e);
	int (*device_count)(int *n);
	int (*set_device)(int dev);
	int (*device_uuid)(uint8_t *uuid16, int dev);
	int (*ipc_open_mem)(void **p, hip_handle h, unsigned int flags);
	int (*ipc_close_mem)(void *p);
	int (*mem_range)(void **base, size_t *size, void *p);
	int (*ipc_open_event)(void **ev, hip_handle h);
	int (*ipc_get_event)(hip_handle *h, void *ev);
	int (*event_create)(void **ev, unsigned int flags);
	int (*event_record)(void *ev, void *stream);
	int (*event_destroy)(void *ev);
	int (*stream_create)(void **s, unsigned int flags);
	int (*stream_wait_event)(void *s, void *ev, unsigned int flags);
	int (*event_query)(void *ev);
	int (*stream_destroy)(void *s);
	int (*write_value64)(void *stream, void *ptr, uint64_t value, unsigned int flags);
	/* optional: the copy kernel (see "The copy kernel") */
	int (*get_device)(int *dev);
	int (*runtime_version)(int *v);
	int (*module_load)(void **mod, const void *image);
	int (*module_fn)(void **fn, void *mod, const char *name);
	int (*module_unload)(void *mod);
	int (*launch)(void *fn, unsigned int gx, unsigned int gy, unsigned int gz,
		      unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
		      void *stream, void **params, void **extra);
	int (*stream_sync)(void *s);
};

/* the copy kernel's per ticket slot: its completion event (made at the
 * slot's first kernel ticket), its descriptors (CPU pool memory the GPU
 * reads), and whether the slot's ticket went through the kernel */
struct hsa_kslot {
	void *ev;
	struct kvt__kcopy *kd;
	uint32_t kcap;
	int on;
};

struct hsa_be {
	void *lib;
	char *path;                 /* the library's, as loaded */
	int reused;                 /* the library was loaded before us */
	int inited;                 /* hsa_init succeeded: shut down at fini */
	struct hsa_fns f;
	uint64_t freq;              /* signal wait ticks per second */

	hsa_agent_t cpu;
	hsa_amd_memory_pool_t cpu_pool;
	uint32_t n_gpus;
	hsa_agent_t gpus[MAX_GPUS];
	hsa_amd_memory_pool_t gpu_pool[MAX_GPUS];
	int have_gpu_pool[MAX_GPUS];
	int have_cpu;

	int g;                      /* bound GPU index, -1 */
	uint32_t n_sdma;            /* 0: unknown */
	uint32_t mask[2];           /* candidate engines per direction; 0: the
				     * runtime's choice.  read/written with
				     * __atomic (dropped on error) */
	int use_rect;               /* __atomic */
	uint32_t rr;                /* __atomic: engine rotation */

	hsa_signal_t *sig;          /* one per ticket slot */
	uint32_t n_sig;
	pthread_mutex_t aux_lock;   /* aux signal: synchronous helpers */
	hsa_signal_t aux;
	int have_aux;
	struct hsa_fault *fault;    /* registered with the runtime, or NULL */
	/* ordering after the engine's stream (see "Ordering"): fence[0,
	 * n_fence) created under fence_mu; fence_cur the current one + 1
	 * (0: none yet), release in order_after, acquire in submit */
	pthread_mutex_t fence_mu;
	hsa_signal_t fence[FENCES];
	uint32_t n_fence;
	uint32_t fence_cur;
	int (*write_value64)(void *stream, void *ptr, uint64_t value, unsigned int flags);
	/* another process's memory and events (see "IPC"): HIP, loaded at
	 * the first use; the HIP ordinal of the bound GPU; the handles
	 * opened here, with their openings counted */
	struct hip_fns *hip;
	int hip_dev;
	struct hip_ipc { char h[KVT_DMA_IPC_BYTES]; uint64_t base, len; uint32_t refs; } *ipc;
	uint32_t n_ipc, cap_ipc;
	/* the copy kernel (see "The copy kernel"): kfn NULL when copies are
	 * DMA only.  kfence: order_after's record on the engine's stream,
	 * kfence_gen the records made (written under fence_mu, read __atomic
	 * by submit), kstream_gen the record each kernel stream waits behind */
	void *kmod, *kfn;
	void *kstream[2];           /* by direction: a load never queues behind a save */
	void *kfence;
	uint32_t kfence_gen, kstream_gen[2];
	struct hsa_kslot *ks;       /* one per ticket slot */
	uint64_t k_below;
	uint32_t k_ctas;
	char kwhat[200];            /* which hiprtc and target, or why none */
};

/* the copy kernel (see "The copy kernel") */
static void kernel_load(struct kvt_dma *d);
static void kernel_free(struct hsa_be *be);
static int kernel_submit(struct kvt_dma *d, uint32_t slot, const struct kvt_dma_job *j);
static int kernel_poll(struct hsa_be *be, uint32_t slot);
static int kernel_wait(struct hsa_be *be, uint32_t slot, uint64_t deadline);
static int kernel_order(struct hsa_be *be, uint64_t stream);

static const char *st_str(const struct hsa_be *be, hsa_status_t st)
{
	const char *s = NULL;

	if (be->f.status_string && be->f.status_string(st, &s) == HSA_STATUS_SUCCESS && s)
		return s;
	return "unknown status";
}

static int st_errno(hsa_status_t st)
{
	switch (st) {
	case HSA_STATUS_SUCCESS:
		return 0;
	case HSA_STATUS_ERROR_OUT_OF_RESOURCES:
		return -ENOMEM;
	case HSA_STATUS_ERROR_INVALID_ARGUMENT:
	case HSA_STATUS_ERROR_INVALID_AGENT:
	case HSA_STATUS_ERROR_INVALID_SIGNAL:
		return -EINVAL;
	default:
		return -EIO;
	}
}

/* ---- faults (see "Faults") ------------------------------------------------ */

static const char *fault_reason(uint32_t m)
{
	if (m & HSA_AMD_MEMORY_FAULT_PAGE_NOT_PRESENT)
		return "page not present";
	if (m & HSA_AMD_MEMORY_FAULT_READ_ONLY)
		return "write to a read-only page";
	if (m & HSA_AMD_MEMORY_FAULT_NX)
		return "execute on a no-execute page";
	if (m & HSA_AMD_MEMORY_FAULT_HOST_ONLY)
		return "GPU access to a host-only page";
	if (m & HSA_AMD_MEMORY_FAULT_DRAMECC)
		return "DRAM ECC error";
	if (m & HSA_AMD_MEMORY_FAULT_SRAMECC)
		return "SRAM ECC error";
	if (m & HSA_AMD_MEMORY_FAULT_HANG)
		return "GPU hang";
	return "reason unknown";
}

#define HW_EXCEPTION_EVENT 1 /* HSA_AMD_GPU_HW_EXCEPTION_EVENT (ROCm 6+: a GPU
			      * hang or reset); its info starts with the agent */

/* ROCr's event thread, once per fault.  Touches the note only.  A fault
 * stops the queues of the GPU it happened on (KFD evicts the process's
 * queues on that device): a backend bound to another GPU keeps copying,
 * and is not marked.  The first fault is the one recorded: seen 0 -> 1
 * (CAS), va and reason written, then 2 (release; fault_err reads them
 * only at 2). */
static hsa_status_t on_system_event(const hsa_amd_event_t *ev, void *data)
{
	struct hsa_fault *f = data;
	uint64_t gpu, va = 0;
	uint32_t reason = HSA_AMD_MEMORY_FAULT_HANG;
	const char *where;
	char line[640];
	int n, zero = 0;

	if (!f || f->magic != FAULT_MAGIC || !ev ||
	    (ev->event_type != HSA_AMD_GPU_MEMORY_FAULT_EVENT &&
	     (int)ev->event_type != HW_EXCEPTION_EVENT) ||
	    __atomic_load_n(&f->closed, __ATOMIC_ACQUIRE))
		return HSA_STATUS_ERROR;
	gpu = __atomic_load_n(&f->gpu_handle, __ATOMIC_RELAXED);
	/* the agent is the union's first member in both events */
	if (ev->memory_fault.agent.handle != gpu || !gpu)
		return HSA_STATUS_ERROR; /* another GPU's queues; or unbound: no copies */
	if (ev->event_type == HSA_AMD_GPU_MEMORY_FAULT_EVENT) {
		va = ev->memory_fault.virtual_address;
		reason = ev->memory_fault.fault_reason_mask;
	}
	if (!__atomic_compare_exchange_n(&f->seen, &zero, 1, 0, __ATOMIC_ACQ_REL,
					 __ATOMIC_ACQUIRE))
		return HSA_STATUS_ERROR; /* noted already */
	f->va = va;
	f->reason = reason;
	__atomic_store_n(&f->seen, 2, __ATOMIC_RELEASE);
	where = ev->event_type != HSA_AMD_GPU_MEMORY_FAULT_EVENT ? "a hang or reset" :
		va >= __atomic_load_n(&f->kv_lo, __ATOMIC_RELAXED) &&
		va < __atomic_load_n(&f->kv_hi, __ATOMIC_RELAXED) ?
		"inside the KV cache kvtier copies" :
		va >= __atomic_load_n(&f->arena_lo, __ATOMIC_RELAXED) &&
		va < __atomic_load_n(&f->arena_hi, __ATOMIC_RELAXED) ?
		"inside kvtier's locked arena" : "outside what kvtier copies (the engine's own work?)";
	n = snprintf(line, sizeof(line), "kvtier: hsa: GPU %s at %#llx (%s), %s, on the GPU this "
		     "rank copies with: the driver stopped its queues in this process; kvtier "
		     "makes no more copies here and publishes none that was in flight. Unless "
		     "another handler takes the fault, the HSA runtime ends the process now, and "
		     "the segment releases this rank's claims once it is gone\n",
		     ev->event_type == HSA_AMD_GPU_MEMORY_FAULT_EVENT ? "memory fault" :
		     "hardware exception", (unsigned long long)va, fault_reason(reason), where);
	if (n > 0)
		(void)!write(2, line, (size_t)n < sizeof(line) ? (size_t)n : sizeof(line) - 1);
	return HSA_STATUS_ERROR; /* never claimed: the runtime's default stands */
}

static int hsa_dead(const struct hsa_be *be)
{
	return be->fault && __atomic_load_n(&be->fault->seen, __ATOMIC_ACQUIRE);
}

static int fault_err(const struct hsa_be *be)
{
	if (__atomic_load_n(&be->fault->seen, __ATOMIC_ACQUIRE) != 2)
		return kvt__dma_err(-EIO, "hsa: a GPU fault stopped this process's queues on "
				    "this GPU: no copy can complete here any more; restart it");
	return kvt__dma_err(-EIO, "hsa: a GPU memory fault at %#llx (%s) stopped this "
			    "process's GPU queues: no copy can complete in this process any "
			    "more, the copies in flight failed; restart it",
			    (unsigned long long)be->fault->va, fault_reason(be->fault->reason));
}

static void fault_register(struct kvt_dma *d)
{
	struct hsa_be *be = d->be;
	struct hsa_fault *f;
	hsa_status_t st;

	if (!be->f.register_event_handler)
		return;
	f = calloc(1, sizeof(*f));
	if (!f)
		return;
	f->magic = FAULT_MAGIC;
	f->gpu = -1;
	st = be->f.register_event_handler(on_system_event, f);
	if (st != HSA_STATUS_SUCCESS) {
		free(f);
		kvt__dma_log(d, KVT_DMA_LOG_ERR, "hsa: no GPU fault handler (%s; runtimes "
			     "before ROCm 6 take one handler per process): a GPU fault ends the "
			     "process without kvtier's report", st_str(be, st));
		return;
	}
	be->fault = f;
}

/* ---- discovery ---------------------------------------------------------- */

struct pool_pick {
	struct hsa_be *be;
	hsa_amd_memory_pool_t pool;
	uint32_t want;              /* a GLOBAL_FLAGS bit to prefer */
	int found, found_wanted;
};

static hsa_status_t pool_cb(hsa_amd_memory_pool_t pool, void *arg)
{
	struct pool_pick *pp = arg;
	hsa_amd_segment_t seg;
	uint32_t flags = 0;
	bool alloc_ok = false;

	if (pp->be->f.pool_get_info(pool, HSA_AMD_MEMORY_POOL_INFO_SEGMENT, &seg) ||
	    seg != HSA_AMD_SEGMENT_GLOBAL)
		return HSA_STATUS_SUCCESS;
	if (pp->be->f.pool_get_info(pool, HSA_AMD_MEMORY_POOL_INFO_GLOBAL_FLAGS, &flags))
		return HSA_STATUS_SUCCESS;
	if (pp->be->f.pool_get_info(pool, HSA_AMD_MEMORY_POOL_INFO_RUNTIME_ALLOC_ALLOWED,
				    &alloc_ok) || !alloc_ok)
		return HSA_STATUS_SUCCESS;
	if (!pp->found_wanted && (flags & pp->want)) {
		pp->pool = pool;
		pp->found = pp->found_wanted = 1;
	} else if (!pp->found) {
		pp->pool = pool;
		pp->found = 1;
	}
	return HSA_STATUS_SUCCESS;
}

static hsa_status_t agent_cb(hsa_agent_t a, void *arg)
{
	struct hsa_be *be = arg;
	hsa_device_type_t type;
	struct pool_pick pp = { .be = be };

	if (be->f.agent_get_info(a, HSA_AGENT_INFO_DEVICE, &type))
		return HSA_STATUS_SUCCESS;
	if (type == HSA_DEVICE_TYPE_CPU && !be->have_cpu) {
		pp.want = HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_FINE_GRAINED;
		be->f.iterate_pools(a, pool_cb, &pp);
		if (pp.found) {
			be->cpu = a;
			be->cpu_pool = pp.pool;
			be->have_cpu = 1;
		}
	} else if (type == HSA_DEVICE_TYPE_GPU && be->n_gpus < MAX_GPUS) {
		pp.want = HSA_AMD_MEMORY_POOL_GLOBAL_FLAG_COARSE_GRAINED;
		be->f.iterate_pools(a, pool_cb, &pp);
		be->gpus[be->n_gpus] = a;
		be->gpu_pool[be->n_gpus] = pp.pool;
		be->have_gpu_pool[be->n_gpus] = pp.found;
		be->n_gpus++;
	}
	return HSA_STATUS_SUCCESS;
}

static void be_free(struct kvt_dma *d)
{
	struct hsa_be *be = d->be;

	if (!be)
		return;
	if (be->fault) /* stays registered with the runtime: closed, not freed */
		__atomic_store_n(&be->fault->closed, 1, __ATOMIC_RELEASE);
	kernel_free(be);
	if (be->hip && be->n_ipc)
		be->hip->set_device(be->hip_dev);
	for (uint32_t i = 0; be->hip && i < be->n_ipc; i++)
		be->hip->ipc_close_mem((void *)(uintptr_t)be->ipc[i].base);
	free(be->ipc);
	free(be->hip); /* its library stays loaded: HIP is never unloaded */
	for (uint32_t i = 0; i < be->n_sig; i++)
		be->f.signal_destroy(be->sig[i]);
	for (uint32_t i = 0; i < be->n_fence; i++)
		be->f.signal_destroy(be->fence[i]);
	pthread_mutex_destroy(&be->fence_mu);
	if (be->have_aux)
		be->f.signal_destroy(be->aux);
	free(be->sig);
	if (be->inited)
		be->f.shut_down();
	/* A library loaded by us is unloaded; the engine's instance stays.
	 * Unloaded for good (nothing else holds it: no HIP loaded it too),
	 * the runtime took its handler list, and with it the fault note's
	 * only reference: the note goes. */
	if (be->lib && !be->reused) {
		void *still;

		dlclose(be->lib);
		still = be->path ? dlopen(be->path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD) : NULL;
		if (still)
			dlclose(still);
		else if (be->path) /* (no path: cannot tell; the note stays) */
			free(be->fault);
	}
	free(be->path);
	pthread_mutex_destroy(&be->aux_lock);
	free(be);
	d->be = NULL;
}

static void hsa_fini(struct kvt_dma *d)
{
	be_free(d);
}

/* The candidate engines of a direction (fixed at bind; see "Engines"). */
static uint32_t pick_engines(struct hsa_be *be, hsa_agent_t dst, hsa_agent_t src)
{
	uint32_t mask = 0, pref = 0, all;

	if (!be->f.copy_on_engine || !be->f.engine_status)
		return 0;
	all = be->n_sdma && be->n_sdma < 32 ? (1u << be->n_sdma) - 1 : 0;
	if (!all) {
		/* NUM_SDMA_ENG unknown: what the runtime reports now */
		if (be->f.engine_status(dst, src, &mask) != HSA_STATUS_SUCCESS)
			return 0;
		all = mask;
	}
	if (be->f.preferred_engine &&
	    be->f.preferred_engine(dst, src, &pref) == HSA_STATUS_SUCCESS && (all & pref))
		all &= pref;
	return all;
}

/* The engine of one ticket: the k-th of the candidates idle now (all of
 * them when none is), k rotating. */
static uint32_t ticket_engine(struct hsa_be *be, uint32_t cand, hsa_agent_t dst,
			      hsa_agent_t src)
{
	uint32_t idle = 0, use, k, e;

	if (be->f.engine_status(dst, src, &idle) == HSA_STATUS_SUCCESS && (idle & cand))
		use = idle & cand;
	else
		use = cand;
	k = __atomic_fetch_add(&be->rr, 1, __ATOMIC_RELAXED) % (uint32_t)__builtin_popcount(use);
	e = use;
	while (k--)
		e &= e - 1;
	return e & -e; /* the k-th set bit */
}

static void describe_gpu(struct kvt_dma *d)
{
	struct hsa_be *be = d->be;
	char name[64] = "";

	be->f.agent_get_info(be->gpus[be->g], HSA_AGENT_INFO_NAME, name);
	name[sizeof(name) - 1] = 0;
	snprintf(d->feature, sizeof(d->feature),
		 "%s (GPU %d of %u), %u SDMA engines, engines d2h 0x%x h2d 0x%x%s, "
		 "rect %s, runtime %s, copy kernel %s", name, be->g, be->n_gpus, be->n_sdma,
		 be->mask[KVT_DMA_D2H], be->mask[KVT_DMA_H2D],
		 be->f.copy_on_engine ? "" : " (no _on_engine)",
		 be->use_rect ? "yes" : "no", be->reused ? "reused" : "loaded", be->kwhat);
}

static void set_gpu(struct kvt_dma *d, int g)
{
	struct hsa_be *be = d->be;
	uint32_t n = 0;

	be->g = g;
	d->device = g;
	if (be->f.agent_get_info(be->gpus[g], (hsa_agent_info_t)AGENT_INFO_NUM_SDMA_ENG,
				 &n) == HSA_STATUS_SUCCESS)
		be->n_sdma = n;
	if (!(d->cfg.flags & KVT_DMA_F_NO_ENGINE)) {
		be->mask[KVT_DMA_D2H] = pick_engines(be, be->cpu, be->gpus[g]);
		be->mask[KVT_DMA_H2D] = pick_engines(be, be->gpus[g], be->cpu);
	}
	kernel_load(d);
	describe_gpu(d);
}

static int hsa_init_be(struct kvt_dma *d, char *why, size_t why_len)
{
	const char *path = getenv("KVTIER_HSA_LIBRARY");
	const char *sdma = getenv("HSA_ENABLE_SDMA");
	struct hsa_be *be;
	hsa_status_t st;

	if (!path || !*path)
		path = "libhsa-runtime64.so.1";
	be = calloc(1, sizeof(*be));
	if (!be)
		return kvt__fmt(-ENOMEM, why, why_len, "out of memory");
	pthread_mutex_init(&be->aux_lock, NULL);
	pthread_mutex_init(&be->fence_mu, NULL);
	be->g = -1;
	d->be = be;
	be->path = strdup(path);
	be->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
	be->reused = be->lib != NULL;
	if (!be->lib)
		be->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!be->lib) {
		kvt__fmt(-ENOENT, why, why_len, "%s", dlerror());
		be_free(d);
		return -ENOENT;
	}
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		void *fn = dlsym(be->lib, syms[i].name);

		if (!fn && syms[i].required) {
			kvt__fmt(-ENOENT, why, why_len, "%s: no symbol %s", path, syms[i].name);
			be_free(d);
			return -ENOENT;
		}
		memcpy((char *)&be->f + syms[i].off, &fn, sizeof(fn));
	}
	st = be->f.init();
	if (st != HSA_STATUS_SUCCESS) {
		/* ROCr reports a machine without an AMD GPU as
		 * OUT_OF_RESOURCES: say what the operator must look at */
		const char *kfd = "/dev/kfd";
		kvt__fmt(-ENODEV, why, why_len, "%s (hsa_init: status 0x%x, %.120s)",
			 access(kfd, F_OK) ? "no AMD GPU found: /dev/kfd does not exist (no "
			 "amdgpu driver loaded, or the device not passed into this container)" :
			 access(kfd, R_OK | W_OK) ? "/dev/kfd is not accessible to this user "
			 "(add it to the render and video groups)" :
			 "hsa_init failed although /dev/kfd is there (is a GPU visible: "
			 "ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES?)",
			 (unsigned)st, st_str(be, st));
		be_free(d);
		return -ENODEV;
	}
	be->inited = 1;
	fault_register(d);
	be->f.iterate_agents(agent_cb, be);
	if (!be->n_gpus || !be->have_cpu) {
		kvt__fmt(-ENODEV, why, why_len, "%s", !be->n_gpus ? "no GPU agent" :
			 "no CPU agent with a global memory pool");
		be_free(d);
		return -ENODEV;
	}
	if (be->f.system_get_info(HSA_SYSTEM_INFO_TIMESTAMP_FREQUENCY, &be->freq) ||
	    !be->freq)
		be->freq = 1000000000u;
	be->use_rect = be->f.copy_rect && !(d->cfg.flags & KVT_DMA_F_NO_2D);
	if (sdma && !strcmp(sdma, "0")) {
		be->use_rect = 0;
		kvt__dma_log(d, KVT_DMA_LOG_INFO, "hsa: HSA_ENABLE_SDMA=0: copies run as "
			     "shader kernels that compete with the model; no rect copies");
	}
	/* Each ticket's signal is an interrupt signal, one of the process's
	 * KFD events (KFD_SIGNAL_EVENT_LIMIT, 4096 per process), which HIP's
	 * own streams and events use too: past them signals silently stop
	 * being interrupt-driven.  Leave HIP three quarters. */
	if (d->cfg.max_inflight > KVT_DMA_HSA_INFLIGHT_MAX) {
		kvt__dma_log(d, KVT_DMA_LOG_ERR, "hsa: max_inflight %u lowered to %u: each "
			     "ticket holds one of the process's 4096 interrupt events, which "
			     "HIP's own streams and events need too", d->cfg.max_inflight,
			     KVT_DMA_HSA_INFLIGHT_MAX);
		d->cfg.max_inflight = KVT_DMA_HSA_INFLIGHT_MAX;
	}
	be->sig = calloc(d->cfg.max_inflight, sizeof(*be->sig));
	if (!be->sig) {
		be_free(d);
		return kvt__fmt(-ENOMEM, why, why_len, "out of memory");
	}
	for (; be->n_sig < d->cfg.max_inflight; be->n_sig++) {
		st = be->f.signal_create(0, 0, NULL, &be->sig[be->n_sig]);
		if (st) {
			kvt__fmt(-ENOMEM, why, why_len, "hsa_signal_create: %s", st_str(be, st));
			be_free(d);
			return -ENOMEM;
		}
	}
	if (be->f.signal_create(0, 0, NULL, &be->aux) == HSA_STATUS_SUCCESS)
		be->have_aux = 1;
	if (d->cfg.device >= 0) {
		if ((uint32_t)d->cfg.device >= be->n_gpus) {
			kvt__fmt(-ENODEV, why, why_len, "device %d: only %u GPU agents",
				 (int)d->cfg.device, be->n_gpus);
			be_free(d);
			return -ENODEV;
		}
		set_gpu(d, d->cfg.device);
	} else {
		snprintf(d->feature, sizeof(d->feature), "%u GPU agents, device unbound, "
			 "runtime %s", be->n_gpus, be->reused ? "reused" : "loaded");
	}
	return 0;
}

static int gpu_index(const struct hsa_be *be, hsa_agent_t a)
{
	for (uint32_t i = 0; i < be->n_gpus; i++)
		if (be->gpus[i].handle == a.handle)
			return (int)i;
	return -1;
}

static int hsa_bind(struct kvt_dma *d, const struct kvt_kv_layout *l)
{
	struct hsa_be *be = d->be;
	uint64_t kv_lo = 0, kv_hi = 0;
	int g = -1;

	for (uint32_t k = 0; k < l->n_groups; k++) {
		const struct kvt_kv_group *gr = &l->groups[k];

		for (uint32_t i = 0; i < gr->n_layers; i++) {
			hsa_amd_pointer_info_t info;
			hsa_status_t st;
			int gi;

			memset(&info, 0, sizeof(info));
			info.size = sizeof(info);
			st = be->f.pointer_info((void *)(uintptr_t)gr->layer_base[i], &info,
						NULL, NULL, NULL);
			if (st)
				return kvt__dma_err(st_errno(st), "hsa: pointer_info(group %u "
						    "layer %u): %s", k, i, st_str(be, st));
			gi = gpu_index(be, info.agentOwner);
			if ((info.type != HSA_EXT_POINTER_TYPE_HSA &&
			     info.type != HSA_EXT_POINTER_TYPE_IPC) || gi < 0)
				return kvt__dma_err(-EINVAL, "hsa: group %u layer %u base %#llx "
						    "is not GPU memory", k, i,
						    (unsigned long long)gr->layer_base[i]);
			/* The layer's extent must be this GPU's memory; a tensor
			 * may span several allocations mapped back to back (as
			 * cuda.c's bind): walk the ones that follow. */
			uint64_t end = (uintptr_t)info.agentBaseAddress + info.sizeInBytes;
			uint64_t need = gr->layer_base[i] + kvt__layer_extent(gr);
			int rr = kvt__dma_add_range(d, (uintptr_t)info.agentBaseAddress, end);

			if (rr)
				return rr;
			while (info.sizeInBytes && end < need) {
				hsa_amd_pointer_info_t nx;

				memset(&nx, 0, sizeof(nx));
				nx.size = sizeof(nx);
				if (be->f.pointer_info((void *)(uintptr_t)end, &nx, NULL, NULL,
						       NULL) ||
				    (nx.type != HSA_EXT_POINTER_TYPE_HSA &&
				     nx.type != HSA_EXT_POINTER_TYPE_IPC) ||
				    nx.agentOwner.handle != info.agentOwner.handle ||
				    (uintptr_t)nx.agentBaseAddress != end || !nx.sizeInBytes)
					break;
				if ((rr = kvt__dma_add_range(d, end, end + nx.sizeInBytes)))
					return rr;
				end += nx.sizeInBytes;
			}
			if (info.sizeInBytes && end < need)
				return kvt__dma_err(-EINVAL, "hsa: group %u layer %u: n_blocks * "
						    "block_stride runs past its device memory "
						    "(%#llx + %llu; mapped up to %#llx)", k, i,
						    (unsigned long long)gr->layer_base[i],
						    (unsigned long long)kvt__layer_extent(gr),
						    (unsigned long long)end);
			if (g >= 0 && gi != g)
				return kvt__dma_err(-EINVAL, "hsa: the KV cache spans GPUs %d "
						    "and %d", g, gi);
			g = gi;
			if (!kv_hi || gr->layer_base[i] < kv_lo)
				kv_lo = gr->layer_base[i];
			if (need > kv_hi)
				kv_hi = need;
		}
	}
	if (be->g >= 0 && g != be->g)
		return kvt__dma_err(-EINVAL, "hsa: KV cache on GPU %d, handle bound to %d",
				    g, be->g);
	if (be->g < 0)
		set_gpu(d, g);
	if (be->fault) { /* for the report only: relaxed */
		__atomic_store_n(&be->fault->kv_lo, kv_lo, __ATOMIC_RELAXED);
		__atomic_store_n(&be->fault->kv_hi, kv_hi, __ATOMIC_RELAXED);
		__atomic_store_n(&be->fault->gpu_handle, be->gpus[be->g].handle, __ATOMIC_RELAXED);
	}
	return 0;
}

static void hsa_caps(const struct kvt_dma *d, struct kvt_plan_caps *c)
{
	const struct hsa_be *be = d->be;

	if (!__atomic_load_n(&be->use_rect, __ATOMIC_RELAXED))
		return;
	c->max_rows = RECT_MAX_ROWS;
	c->pitch_align = 4;
	c->max_pitch = RECT_MAX_PITCH;
}

static int hsa_mem_reg(struct kvt_dma *d, struct kvt_dma_piece *p)
{
	struct hsa_be *be = d->be;
	hsa_agent_t gpu = be->gpus[be->g];
	void *agent_ptr = NULL;
	hsa_status_t st;

	st = be->f.lock_to_pool(p->host, p->len, &gpu, 1, be->cpu_pool, 0, &agent_ptr);
	if (st != HSA_STATUS_SUCCESS || !agent_ptr)
		return kvt__dma_err(st ? st_errno(st) : -EIO, "hsa: lock_to_pool(%p, %llu): "
				    "status 0x%x (%s)%s", (void *)p->host,
				    (unsigned long long)p->len, (unsigned)st, st_str(be, st),
				    st == HSA_STATUS_ERROR_OUT_OF_RESOURCES ?
				    "; the amdgpu driver's pinning budget (one limit for the "
				    "node, about RAM - RAM/64 - 1 GiB, every rank's and the "
				    "engine's locks counted) is likely spent: kvtier-size "
				    "--gpu amd checks a plan against it, "
				    "amdgpu.no_system_mem_limit=1 lifts it" : "");
	p->dev = (uint64_t)(uintptr_t)agent_ptr;
	if (be->fault) {
		struct hsa_fault *f = be->fault;
		uint64_t lo = __atomic_load_n(&f->arena_lo, __ATOMIC_RELAXED);
		uint64_t hi = __atomic_load_n(&f->arena_hi, __ATOMIC_RELAXED);

		if (!hi || p->dev < lo)
			__atomic_store_n(&f->arena_lo, p->dev, __ATOMIC_RELAXED);
		if (p->dev + p->len > hi)
			__atomic_store_n(&f->arena_hi, p->dev + p->len, __ATOMIC_RELAXED);
	}
	return 0;
}

static void hsa_mem_unreg(struct kvt_dma *d, struct kvt_dma_piece *p)
{
	struct hsa_be *be = d->be;
	hsa_status_t st = be->f.unlock(p->host);

	if (st)
		kvt__dma_log(d, KVT_DMA_LOG_ERR, "hsa: unlock(%p): %s", (void *)p->host,
			     st_str(be, st));
}

/* One linear copy; drops the engine choice for good if it is refused. */
static hsa_status_t copy1(struct kvt_dma *d, int dir, uint32_t engine, void *dst,
			  hsa_agent_t dst_agent, const void *src, hsa_agent_t src_agent,
			  size_t len, uint32_t n_dep, const hsa_signal_t *dep, hsa_signal_t sig)
{
	struct hsa_be *be = d->be;
	hsa_status_t st;

	if (engine) {
		st = be->f.copy_on_engine(dst, dst_agent, src, src_agent, len, n_dep, dep, sig,
					  engine, false);
		if (st == HSA_STATUS_SUCCESS)
			return st;
		if (__atomic_exchange_n(&be->mask[dir], 0, __ATOMIC_RELAXED))
			kvt__dma_log(d, KVT_DMA_LOG_INFO, "hsa: engine 0x%x refused a copy "
				     "(%s); using the runtime's engine choice", engine,
				     st_str(be, st));
	}
	return be->f.async_copy(dst, dst_agent, src, src_agent, len, n_dep, dep, sig);
}

static int sig_wait(struct hsa_be *be, hsa_signal_t sig, uint64_t deadline);

static int hsa_submit(struct kvt_dma *d, uint32_t slot, const struct kvt_dma_job *j)
{
	struct hsa_be *be = d->be;
	const struct kvt_plan *p = j->plan;
	hsa_signal_t sig = be->sig[slot];
	hsa_agent_t gpu = be->gpus[be->g], cpu = be->cpu;
	int d2h = j->dir == KVT_DMA_D2H;
	int rect = __atomic_load_n(&be->use_rect, __ATOMIC_RELAXED);
	uint32_t mask = __atomic_load_n(&be->mask[j->dir], __ATOMIC_RELAXED);
	uint32_t engine = 0;
	int64_t count = 0, issued = 0;
	hsa_status_t st = HSA_STATUS_SUCCESS;
	/* behind the engine's stream as of the last order_after */
	uint32_t fc = __atomic_load_n(&be->fence_cur, __ATOMIC_ACQUIRE), n_dep = fc ? 1 : 0;
	const hsa_signal_t *dep = fc ? &be->fence[fc - 1] : NULL;

	if (hsa_dead(be))
		return fault_err(be);
	if (be->kfn && kvt__kernel_plan(p, be->k_below))
		return kernel_submit(d, slot, j);
	if (be->ks)
		be->ks[slot].on = 0;
	for (uint32_t i = 0; i < p->n; i++)
		count += p->copies[i].rows > 1 && rect ? 1 : p->copies[i].rows;
	be->f.signal_store(sig, count);
	if (!count)
		return 0;
	if (mask)
		engine = d2h ? ticket_engine(be, mask, cpu, gpu) : ticket_engine(be, mask, gpu, cpu);
	for (uint32_t i = 0; i < p->n; i++) {
		const struct kvt_copy *c = &p->copies[i];
		uint64_t host = j->host_dev + c->off;

		if (c->rows > 1 && rect) {
			hsa_pitched_ptr_t dp = { (void *)(uintptr_t)c->dev, c->dev_pitch,
						 c->dev_pitch * c->rows };
			hsa_pitched_ptr_t hp = { (void *)(uintptr_t)host, c->host_pitch,
						 c->host_pitch * c->rows };
			hsa_dim3_t zero = { 0, 0, 0 };
			hsa_dim3_t range = { (uint32_t)c->len, c->rows, 1 };

			st = be->f.copy_rect(d2h ? &hp : &dp, &zero, d2h ? &dp : &hp, &zero,
					     &range, gpu, d2h ? hsaDeviceToHost : hsaHostToDevice,
					     n_dep, dep, sig);
			if (st == HSA_STATUS_SUCCESS) {
				issued++;
				continue;
			}
			/* Refused (no SDMA, limits): do this copy's rows one by
			 * one, and no rect from now on.  The signal still counts
			 * this copy once, so it cannot reach 0 meanwhile. */
			if (__atomic_exchange_n(&be->use_rect, 0, __ATOMIC_RELAXED))
				kvt__dma_log(d, KVT_DMA_LOG_INFO, "hsa: rect copy refused (%s); "
					     "using linear copies", st_str(be, st));
			be->f.signal_add(sig, (hsa_signal_value_t)c->rows - 1);
			count += c->rows - 1;
		}
		for (uint32_t r = 0; r < c->rows; r++) {
			void *dv = (void *)(uintptr_t)(c->dev + (uint64_t)r * c->dev_pitch);
			void *hv = (void *)(uintptr_t)(host + (uint64_t)r * c->host_pitch);

			st = d2h ? copy1(d, j->dir, engine, hv, cpu, dv, gpu, c->len, n_dep, dep, sig)
				 : copy1(d, j->dir, engine, dv, gpu, hv, cpu, c->len, n_dep, dep, sig);
			if (st != HSA_STATUS_SUCCESS)
				goto fail;
			issued++;
		}
	}
	return 0;

fail:
	/* Let the signal reach 0 when the issued copies land, and wait for
	 * them: a failed submit leaves nothing in flight. */
	be->f.signal_subtract(sig, count - issued);
	if (sig_wait(be, sig, UINT64_MAX) == -EIO && hsa_dead(be))
		return fault_err(be);
	return kvt__dma_err(-EIO, "hsa: async copy refused after %lld of %lld: status 0x%x (%s)",
			    (long long)issued, (long long)count, (unsigned)st, st_str(be, st));
}

/* hipStreamWriteValue64 of the HIP runtime already in the process. */
static int hip_lookup(struct hsa_be *be)
{
	static const char *const names[] = { "libamdhip64.so.7", "libamdhip64.so.6",
					     "libamdhip64.so.5", "libamdhip64.so" };
	const char *path = getenv("KVTIER_HIP_LIBRARY");
	void *h = NULL;

	if (be->write_value64)
		return 0;
	if (be->hip && be->hip->write_value64) {
		be->write_value64 = be->hip->write_value64;
		return 0;
	}
	if (path && *path)
		h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
	for (size_t i = 0; !h && i < sizeof(names) / sizeof(names[0]); i++)
		h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
	if (h)
		*(void **)&be->write_value64 = dlsym(h, "hipStreamWriteValue64");
	return be->write_value64 ? 0 : -ENOENT;
}

/* Copies submitted from now on start after the work queued so far on the
 * engine's HIP stream (see "Ordering"). */
static int hsa_order_after(struct kvt_dma *d, uint64_t stream)
{
	struct hsa_be *be = d->be;
	hsa_signal_t sig;
	uint32_t next;
	int e;

	if (hsa_dead(be))
		return fault_err(be);
	if (hip_lookup(be))
		return kvt__dma_err(-ENOTSUP, "hsa: no ordering after the engine's stream "
				    "without a HIP runtime in the process (hipStreamWriteValue64); "
				    "synchronize it on the host before saving");
	pthread_mutex_lock(&be->fence_mu);
	next = be->fence_cur % FENCES;
	if (next >= be->n_fence) {
		hsa_status_t st = be->f.signal_create(0, 0, NULL, &be->fence[next]);

		if (st) {
			pthread_mutex_unlock(&be->fence_mu);
			return kvt__dma_err(st_errno(st), "hsa: order_after: signal_create: %s",
					    st_str(be, st));
		}
		be->n_fence = next + 1;
	}
	sig = be->fence[next];
	/* its last order must have been reached (its 0 written): only then
	 * can it stand for a new point; FENCES orders still queued on the
	 * stream wait here for the oldest */
	for (uint64_t nap = 20000, t0 = kvt__now_ns(); be->f.signal_load(sig) != 0;) {
		struct timespec ts = { 0, (long)nap };

		if (hsa_dead(be)) {
			pthread_mutex_unlock(&be->fence_mu);
			return fault_err(be);
		}
		if (kvt__now_ns() - t0 > 60ull * 1000000000u) {
			pthread_mutex_unlock(&be->fence_mu);
			return kvt__dma_err(-EIO, "hsa: order_after: the engine's stream has not "
					    "reached the order given %u orders ago in 60 s (a hung "
					    "device?)", FENCES);
		}
		nanosleep(&ts, NULL);
		if (nap < 1000000)
			nap *= 2;
	}
	be->f.signal_store(sig, 1);
	/* (by offset: no access through the handle as an amd_signal_t) */
	e = be->write_value64((void *)(uintptr_t)stream,
			      (char *)(uintptr_t)sig.handle + offsetof(amd_signal_t, value), 0, 0);
	if (e) {
		be->f.signal_store(sig, 0);
		pthread_mutex_unlock(&be->fence_mu);
		return kvt__dma_err(-EINVAL, "hsa: hipStreamWriteValue64 on the engine's stream "
				    "%#llx failed (hipError %d)", (unsigned long long)stream, e);
	}
	__atomic_store_n(&be->fence_cur, next + 1, __ATOMIC_RELEASE);
	e = kernel_order(be, stream);
	pthread_mutex_unlock(&be->fence_mu);
	return e;
}

static int sig_status(hsa_signal_value_t v)
{
	return v > 0 ? -EINPROGRESS : v == 0 ? 0 : -EIO;
}

static int hsa_poll(struct kvt_dma *d, uint32_t slot)
{
	struct hsa_be *be = d->be;

	/* after a fault even a finished ticket is refused: the engine is
	 * told once, by every ticket, that this process copies no more */
	if (hsa_dead(be))
		return fault_err(be);
	if (be->ks && be->ks[slot].on)
		return kernel_poll(be, slot);
	return sig_status(be->f.signal_load(be->sig[slot]));
}

/* Waits in slices of at most FAULT_SLICE_NS: a fault noted meanwhile (the
 * ticket's copies will never complete) ends the wait with -EIO. */
static int sig_wait(struct hsa_be *be, hsa_signal_t sig, uint64_t deadline)
{
	for (;;) {
		uint64_t now = kvt__now_ns(), left, hint;
		hsa_signal_value_t v;

		if (hsa_dead(be))
			return fault_err(be);
		left = deadline > now ? deadline - now : 0;
		if (left > FAULT_SLICE_NS && be->fault)
			left = FAULT_SLICE_NS;
		hint = deadline == UINT64_MAX && !be->fault ? UINT64_MAX :
			(uint64_t)((double)left * (double)be->freq / 1e9);
		v = be->f.signal_wait(sig, HSA_SIGNAL_CONDITION_LT, 1, hint,
				      HSA_WAIT_STATE_BLOCKED);
		if (v < 1)
			return sig_status(v);
		if (deadline != UINT64_MAX && kvt__now_ns() >= deadline)
			return -ETIMEDOUT;
	}
}

static int hsa_wait(struct kvt_dma *d, uint32_t slot, uint64_t deadline)
{
	struct hsa_be *be = d->be;

	if (be->ks && be->ks[slot].on)
		return kernel_wait(be, slot, deadline);
	return sig_wait(be, be->sig[slot], deadline);
}

/* ---- device memory, staging, ceiling ------------------------------------ */

static int hsa_dev_alloc(struct kvt_dma *d, uint64_t bytes, uint64_t *dev)
{
	struct hsa_be *be = d->be;
	void *p = NULL;
	hsa_status_t st;

	if (!be->have_gpu_pool[be->g])
		return kvt__dma_err(-ENOTSUP, "hsa: GPU %d has no allocatable pool", be->g);
	st = be->f.pool_allocate(be->gpu_pool[be->g], bytes, 0, &p);
	if (st)
		return kvt__dma_err(st_errno(st), "hsa: pool_allocate(%llu): %s",
				    (unsigned long long)bytes, st_str(be, st));
	*dev = (uint64_t)(uintptr_t)p;
	return 0;
}

static int hsa_dev_free(struct kvt_dma *d, uint64_t dev)
{
	struct hsa_be *be = d->be;
	hsa_status_t st = be->f.pool_free((void *)(uintptr_t)dev);

	return st ? kvt__dma_err(st_errno(st), "hsa: pool_free: %s", st_str(be, st)) : 0;
}

/* Pinned host memory of the runtime's own (CPU pool), visible to the GPU. */
static int staging_alloc(struct hsa_be *be, uint64_t bytes, void **out)
{
	hsa_agent_t gpu = be->gpus[be->g];
	hsa_status_t st = be->f.pool_allocate(be->cpu_pool, bytes, 0, out);

	if (st)
		return kvt__dma_err(st_errno(st), "hsa: staging allocate(%llu): %s",
				    (unsigned long long)bytes, st_str(be, st));
	st = be->f.allow_access(1, &gpu, NULL, *out);
	if (st) {
		be->f.pool_free(*out);
		return kvt__dma_err(st_errno(st), "hsa: allow_access: %s", st_str(be, st));
	}
	return 0;
}

#define STAGE (64ULL << 20)

static int dev_xfer(struct kvt_dma *d, int to_dev, uint64_t dev, char *host, uint64_t len)
{
	struct hsa_be *be = d->be;
	hsa_agent_t gpu = be->gpus[be->g];
	uint64_t n = len < STAGE ? len : STAGE;
	void *stage;
	int rc;

	if (!be->have_aux)
		return kvt__dma_err(-ENOMEM, "hsa: no helper signal");
	rc = staging_alloc(be, n ? n : 1, &stage);
	if (rc)
		return rc;
	pthread_mutex_lock(&be->aux_lock);
	for (uint64_t o = 0; o < len && !rc; o += n) {
		uint64_t k = len - o < n ? len - o : n;
		void *dv = (void *)(uintptr_t)(dev + o);
		hsa_status_t st;

		if (to_dev)
			memcpy(stage, host + o, k);
		be->f.signal_store(be->aux, 1);
		st = to_dev ? be->f.async_copy(dv, gpu, stage, be->cpu, k, 0, NULL, be->aux)
			    : be->f.async_copy(stage, be->cpu, dv, gpu, k, 0, NULL, be->aux);
		if (st)
			rc = kvt__dma_err(st_errno(st), "hsa: copy: %s", st_str(be, st));
		else if ((rc = sig_wait(be, be->aux, UINT64_MAX)) != 0)
			kvt__dma_err(rc, "hsa: copy failed");
		else if (!to_dev)
			memcpy(host + o, stage, k);
	}
	pthread_mutex_unlock(&be->aux_lock);
	be->f.pool_free(stage);
	return rc;
}

static int hsa_dev_write(struct kvt_dma *d, uint64_t dev, const void *src, uint64_t len)
{
	return dev_xfer(d, 1, dev, (char *)(uintptr_t)src, len);
}

static int hsa_dev_read(struct kvt_dma *d, void *dst, uint64_t dev, uint64_t len)
{
	return dev_xfer(d, 0, dev, dst, len);
}

static int hsa_ceiling(struct kvt_dma *d, enum kvt_dma_dir dir, uint64_t dev,
		       uint64_t bytes, uint64_t copy_bytes, uint32_t iters,
		       double *seconds)
{
	struct hsa_be *be = d->be;
	hsa_agent_t gpu = be->gpus[be->g];
	uint64_t n = bytes / copy_bytes, t0;
	char *stage;
	int rc;

	if (!be->have_aux)
		return kvt__dma_err(-ENOMEM, "hsa: no helper signal");
	rc = staging_alloc(be, bytes, (void **)&stage);
	if (rc)
		return rc;
	memset(stage, 0x5a, bytes);
	pthread_mutex_lock(&be->aux_lock);
	t0 = kvt__now_ns();
	for (uint32_t it = 0; it < iters && !rc; it++) {
		be->f.signal_store(be->aux, (hsa_signal_value_t)n);
		for (uint64_t i = 0; i < n; i++) {
			void *dv = (void *)(uintptr_t)(dev + i * copy_bytes);
			void *hv = stage + i * copy_bytes;
			hsa_status_t st = dir == KVT_DMA_D2H
				? be->f.async_copy(hv, be->cpu, dv, gpu, copy_bytes, 0, NULL, be->aux)
				: be->f.async_copy(dv, gpu, hv, be->cpu, copy_bytes, 0, NULL, be->aux);

			if (st) {
				be->f.signal_subtract(be->aux, (hsa_signal_value_t)(n - i));
				rc = kvt__dma_err(st_errno(st), "hsa: copy: %s", st_str(be, st));
				break;
			}
		}
		if (sig_wait(be, be->aux, UINT64_MAX) && !rc)
			rc = kvt__dma_err(-EIO, "hsa: ceiling copy failed");
	}
	*seconds = (kvt__now_ns() - t0) * 1e-9;
	pthread_mutex_unlock(&be->aux_lock);
	be->f.pool_free(stage);
	return rc;
}

/* ---- another process's memory and events (IPC) ------------------------------
 *
 * A ROCm engine's LMCache client sends what torch's ROCm build makes --
 * the same "cuda" descriptors as on NVIDIA, with HIP's handles inside:
 * hipIpcMemHandle_t / hipIpcEventHandle_t, 64 bytes each.  Their layout
 * is the HIP runtime's own (ROCr's IPC handle plus HIP's size and offset;
 * the events' a shared-memory name), so they are opened with HIP itself:
 * libamdhip64 ($KVTIER_HIP_LIBRARY first) is loaded at the first IPC call
 * and kept (HIP is not made to be unloaded).  HIP runs on the ROCr
 * instance this backend uses (one per process), so an opened pointer is
 * device memory that the SDMA copies here take as they are.
 *
 * Devices.  The engine names its GPU by torch's props.uuid, which on ROCm
 * is hipDeviceGetUuid: the characters after "GPU-" of the agent's
 * HSA_AMD_AGENT_INFO_UUID (16 hex digits), as bytes -- compared here with
 * the agents' own UUIDs, without HIP.  Agents without a unique id all say
 * "GPU-XX": several agents matching is refused, never guessed.  HIP's
 * ordinal of the bound agent (HIP_VISIBLE_DEVICES may hide some) is the
 * HIP device whose UUID is the agent's; HIP's current device is set to it
 * before each call (it is per thread).
 *
 * Memory.  An allocation's openings are counted here: a registration
 * opens one cudaMalloc block once per layer, and HIP's own behaviour on a
 * second open of a handle differs between releases.  The open's flag is
 * hipIpcMemLazyEnablePeerAccess, whose value HIP changed (ROCm 6: 1; 5.x:
 * 0, and each release refuses the other's): 1 is tried, then 0.  The
 * range is HIP's hipMemGetAddressRange of the opened pointer: *len is the
 * bytes from it to the allocation's end (a handle may name a pointer
 * inside its block).
 *
 * Fences.  As cuda.c's: two HIP streams; `wait` waits for the engine's
 * imported events (hipStreamWaitEvent), and a rank handle's order_after
 * writes its fence signal's 0 on that stream (hsa_order_after:
 * hipStreamWriteValue64 of the HIP loaded here), so the SDMA copies start
 * after the engine's work.  `sig` waits for nothing: the fence's
 * interprocess event is recorded there once the copies completed.
 * An import is kept until the wait stream is past its wait (HIP's IPC
 * event wait reads the exporter's shared page, which destroying the
 * import unmaps): a marker event recorded behind each wait says when;
 * at most FENCE_IMPORTS are kept, the passed ones reaped at each wait
 * (more in flight: the oldest is waited for here).  Known limits, by ROCm
 * release: where HIP waits for an IPC event on the host (a marker and a
 * host callback), hipStreamWaitEvent returns only once the engine's event
 * fired -- kvtierd's thread waits there; and an engine that dies before
 * its event fires leaves the wait stream blocked for good: fence_close
 * gives the waits FENCE_CLOSE_GRACE_NS, then abandons the streams
 * (logged) rather than hold kvtierd's thread on them.
 * LMCache's timeline semaphores are CUDA's (cuda-python): refused by
 * name. */
#define HIP_EVENT_DISABLE_TIMING 0x2
#define HIP_EVENT_INTERPROCESS   0x4
#define HIP_STREAM_NON_BLOCKING  0x1

static const char *hip_str(const struct hsa_be *be, int e)
{
	const char *s = be->hip && be->hip->err_str ? be->hip->err_str(e) : NULL;

	return s ? s : "unknown hipError";
}

/* A handle the runtime will not open (forged, of this process, of a
 * process gone): the caller's; anything else, -EIO. */
static int hip_errno(int e)
{
	return e == 1 /* InvalidValue */ || e == 17 /* InvalidDevicePointer */ ||
	       e == 201 /* InvalidContext */ || e == 205 /* MapFailed */ ||
	       e == 400 /* InvalidHandle */ ? -EINVAL : -EIO;
}

/* The agent's UUID as HIP gives it (see "Devices"); -1 without one. */
static int agent_uuid(struct hsa_be *be, uint32_t g, uint8_t out[16])
{
	char s[32] = { 0 };

	if (be->f.agent_get_info(be->gpus[g], (hsa_agent_info_t)HSA_AMD_AGENT_INFO_UUID, s) ||
	    strncmp(s, "GPU-", 4))
		return -1;
	memset(out, 0, 16);
	memcpy(out, s + 4, strnlen(s + 4, 16));
	return 0;
}

static int hsa_uuid(struct kvt_dma *d, const uint8_t uuid[16])
{
	struct hsa_be *be = d->be;
	int found = -1, n = 0;

	for (uint32_t g = 0; g < be->n_gpus; g++) {
		uint8_t u[16];

		if (!agent_uuid(be, g, u) && !memcmp(u, uuid, 16)) {
			found = (int)g;
			n++;
		}
	}
	if (n > 1)
		return kvt__dma_err(-ENODEV, "hsa: %d GPUs here have that UUID (agents without a "
				    "unique id all say GPU-XX): cannot tell which is the engine's", n);
	return n ? found : kvt__dma_err(-ENODEV, "hsa: no device here has that UUID (%u GPU "
					"agents)", be->n_gpus);
}

static int hip_load(struct kvt_dma *d)
{
	static const char *const names[] = { "libamdhip64.so.7", "libamdhip64.so.6",
					     "libamdhip64.so.5", "libamdhip64.so" };
	struct hsa_be *be = d->be;
	const char *path = getenv("KVTIER_HIP_LIBRARY");
	struct hip_fns *h;
	uint8_t want[16];
	int n = 0, match = 0, e;

	if (be->hip)
		return 0;
	if (be->g < 0)
		return kvt__dma_err(-EINVAL, "hsa: IPC before a device was bound");
	h = calloc(1, sizeof(*h));
	if (!h)
		return kvt__dma_err(-ENOMEM, "hsa: out of memory");
	if (path && *path)
		h->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	for (size_t i = 0; !h->lib && i < sizeof(names) / sizeof(names[0]); i++)
		h->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
	if (!h->lib) {
		free(h);
		return kvt__dma_err(-ENOTSUP, "hsa: no HIP runtime (libamdhip64) here, which "
				    "another process's GPU memory and the copy kernel need");
	}
#define HIPSYM(field, name) (*(void **)&h->field = dlsym(h->lib, name))
	HIPSYM(err_str, "hipGetErrorString");
	HIPSYM(write_value64, "hipStreamWriteValue64");
	HIPSYM(get_device, "hipGetDevice");
	HIPSYM(runtime_version, "hipRuntimeGetVersion");
	HIPSYM(module_load, "hipModuleLoadData");
	HIPSYM(module_fn, "hipModuleGetFunction");
	HIPSYM(module_unload, "hipModuleUnload");
	HIPSYM(launch, "hipModuleLaunchKernel");
	HIPSYM(stream_sync, "hipStreamSynchronize");
	if (!HIPSYM(device_count, "hipGetDeviceCount") || !HIPSYM(set_device, "hipSetDevice") ||
	    !HIPSYM(device_uuid, "hipDeviceGetUuid") ||
	    !HIPSYM(ipc_open_mem, "hipIpcOpenMemHandle") ||
	    !HIPSYM(ipc_close_mem, "hipIpcCloseMemHandle") ||
	    !HIPSYM(mem_range, "hipMemGetAddressRange") ||
	    !HIPSYM(ipc_open_event, "hipIpcOpenEventHandle") ||
	    !HIPSYM(ipc_get_event, "hipIpcGetEventHandle") ||
	    !HIPSYM(event_create, "hipEventCreateWithFlags") ||
	    !HIPSYM(event_record, "hipEventRecord") || !HIPSYM(event_destroy, "hipEventDestroy") ||
	    !HIPSYM(stream_create, "hipStreamCreateWithFlags") ||
	    !HIPSYM(stream_wait_event, "hipStreamWaitEvent") ||
	    !HIPSYM(event_query, "hipEventQuery") ||
	    !HIPSYM(stream_destroy, "hipStreamDestroy")) {
		free(h); /* the library stays: HIP is never unloaded */
		return kvt__dma_err(-ENOTSUP, "hsa: the HIP runtime here has no IPC entry points");
	}
#undef HIPSYM
	/* HIP's ordinal of the bound agent (see "Devices") */
	if (agent_uuid(be, (uint32_t)be->g, want)) {
		free(h);
		return kvt__dma_err(-ENODEV, "hsa: GPU agent %d reports no UUID", be->g);
	}
	e = h->device_count(&n);
	if (e) {
		kvt__dma_err(-ENODEV, "hsa: hipGetDeviceCount: %s (%d)",
			     h->err_str ? h->err_str(e) : "?", e);
		free(h);
		return -ENODEV;
	}
	for (int i = 0; i < n; i++) {
		uint8_t u[16];

		if (!h->device_uuid(u, i) && !memcmp(u, want, 16)) {
			be->hip_dev = i;
			match++;
		}
	}
	if (match != 1) {
		free(h);
		return kvt__dma_err(-ENODEV, "hsa: %s HIP device has GPU agent %d's UUID (%d HIP "
				    "devices; HIP_VISIBLE_DEVICES must not hide it)",
				    match ? "more than one" : "no", be->g, n);
	}
	be->hip = h;
	return 0;
}

/* HIP loaded, and this thread's current device the bound GPU (set only
 * when it is another: kvtierd's thread serving one GPU sets it once) */
static int hip_ready(struct kvt_dma *d)
{
	struct hsa_be *be = d->be;
	int e, cur = -1, rc = hsa_dead(be) ? fault_err(be) : hip_load(d);

	if (rc)
		return rc;
	if (be->hip->get_device && !be->hip->get_device(&cur) && cur == be->hip_dev)
		return 0;
	e = be->hip->set_device(be->hip_dev);
	return e ? kvt__dma_err(-EIO, "hsa: hipSetDevice(%d): %s", be->hip_dev, hip_str(be, e))
		 : 0;
}

static int hsa_ipc_open(struct kvt_dma *d, const void *handle, uint64_t *base, uint64_t *len)
{
	struct hsa_be *be = d->be;
	struct hip_ipc *n;
	hip_handle h;
	void *p = NULL, *start = NULL;
	size_t size = 0;
	int e, rc = hip_ready(d);

	if (rc)
		return rc;
	for (uint32_t i = 0; i < be->n_ipc; i++)
		if (!memcmp(be->ipc[i].h, handle, KVT_DMA_IPC_BYTES)) {
			be->ipc[i].refs++;
			*base = be->ipc[i].base;
			*len = be->ipc[i].len;
			return 0;
		}
	if (be->n_ipc == be->cap_ipc) {
		uint32_t cap = be->cap_ipc ? 2 * be->cap_ipc : 64;

		n = realloc(be->ipc, cap * sizeof(*n));
		if (!n)
			return kvt__dma_err(-ENOMEM, "hsa: out of memory");
		be->ipc = n;
		be->cap_ipc = cap;
	}
	memcpy(h.b, handle, sizeof(h.b));
	e = be->hip->ipc_open_mem(&p, h, 1); /* hipIpcMemLazyEnablePeerAccess (see "Memory") */
	if (e == 1 /* InvalidValue */)
		e = be->hip->ipc_open_mem(&p, h, 0);
	if (e)
		return kvt__dma_err(hip_errno(e), "hsa: hipIpcOpenMemHandle: %s (%d)",
				    hip_str(be, e), e);
	e = be->hip->mem_range(&start, &size, p);
	if (e || (char *)p < (char *)start || (char *)p >= (char *)start + size) {
		be->hip->ipc_close_mem(p);
		return e ? kvt__dma_err(-EIO, "hsa: hipMemGetAddressRange of an opened handle: "
					"%s (%d)", hip_str(be, e), e)
			 : kvt__dma_err(-EIO, "hsa: HIP opened a handle at %p, outside the "
					"allocation it reports (%p, %zu bytes)", p, start, size);
	}
	n = &be->ipc[be->n_ipc++];
	memcpy(n->h, handle, KVT_DMA_IPC_BYTES);
	n->base = *base = (uint64_t)(uintptr_t)p;
	n->len = *len = (uint64_t)((char *)start + size - (char *)p);
	n->refs = 1;
	return 0;
}

static int hsa_ipc_close(struct kvt_dma *d, uint64_t base)
{
	struct hsa_be *be = d->be;
	int e;

	for (uint32_t i = 0; be->hip && i < be->n_ipc; i++) {
		if (be->ipc[i].base != base)
			continue;
		if (--be->ipc[i].refs)
			return 0;
		be->ipc[i] = be->ipc[--be->n_ipc];
		be->hip->set_device(be->hip_dev);
		e = be->hip->ipc_close_mem((void *)(uintptr_t)base);
		return e ? kvt__dma_err(-EIO, "hsa: hipIpcCloseMemHandle: %s", hip_str(be, e)) : 0;
	}
	return kvt__dma_err(-EINVAL, "hsa: %#llx is not an opened IPC allocation",
			    (unsigned long long)base);
}

struct hsa_fence {
	struct kvt_dma_fence head; /* first */
	void *wait, *sig;          /* hipStream_t */
	void *done;                /* hipEvent_t, interprocess */
	hip_handle done_h;
	/* the engine's events imported, each with the marker recorded on
	 * `wait` behind its wait (see "Fences"), oldest first */
	struct { void *ev, *passed; } imp[FENCE_IMPORTS];
	uint32_t n_imp;
};

/* hipEventQuery of a marker until the deadline (kvt__now_ns): 0 once it
 * completed, else HIP's error (600: hipErrorNotReady, still waiting). */
static int passed_by(struct hsa_be *be, void *marker, uint64_t deadline)
{
	int e;

	while ((e = be->hip->event_query(marker)) == 600 && kvt__now_ns() < deadline) {
		struct timespec ts = { 0, 1000000 };

		nanosleep(&ts, NULL);
	}
	return e;
}

/* The imports whose waits the stream has passed go, oldest first, waiting
 * up to grace_ns for them; -EBUSY while some remain. */
static int fence_reap(struct hsa_fence *f, uint64_t grace_ns)
{
	struct hsa_be *be = f->head.d->be;
	uint64_t deadline = kvt__now_ns() + grace_ns;
	uint32_t k = 0;

	for (; k < f->n_imp; k++) {
		if (passed_by(be, f->imp[k].passed, deadline))
			break;
		be->hip->event_destroy(f->imp[k].ev);
		be->hip->event_destroy(f->imp[k].passed);
	}
	memmove(f->imp, f->imp + k, (f->n_imp - k) * sizeof(f->imp[0]));
	f->n_imp -= k;
	return f->n_imp ? -EBUSY : 0;
}

static void hsa_fence_close(struct kvt_dma_fence *hd)
{
	struct hsa_fence *f = (struct hsa_fence *)hd;
	struct hsa_be *be;

	if (!f)
		return;
	be = f->head.d->be;
	if (be->hip) {
		be->hip->set_device(be->hip_dev);
		if (f->n_imp && fence_reap(f, FENCE_CLOSE_GRACE_NS)) {
			/* an engine's event that never fired (the engine died
			 * first): its wait never ends, and destroying the wait
			 * stream would wait on it too.  That stream and the
			 * imports its waits read are left to the runtime; the
			 * markers (plain events) go. */
			kvt__dma_log(f->head.d, KVT_DMA_LOG_ERR, "hsa: a fence abandoned: %u of the "
				     "engine's events never fired (the engine gone?); its wait "
				     "stream and imports are left to the runtime", f->n_imp);
			for (uint32_t i = 0; i < f->n_imp; i++)
				be->hip->event_destroy(f->imp[i].passed);
		} else if (f->wait) { /* after its work, in the runtime */
			be->hip->stream_destroy(f->wait);
		}
		if (f->sig)
			be->hip->stream_destroy(f->sig);
		if (f->done)
			be->hip->event_destroy(f->done);
	}
	free(f);
}

static int hsa_fence_open(struct kvt_dma *d, struct kvt_dma_fence **out)
{
	struct hsa_be *be = d->be;
	struct hsa_fence *f;
	int e, rc = hip_ready(d);

	if (rc)
		return rc;
	f = calloc(1, sizeof(*f));
	if (!f)
		return kvt__dma_err(-ENOMEM, "hsa: out of memory");
	f->head.d = d;
	e = be->hip->stream_create(&f->wait, HIP_STREAM_NON_BLOCKING);
	if (!e)
		e = be->hip->stream_create(&f->sig, HIP_STREAM_NON_BLOCKING);
	if (!e)
		e = be->hip->event_create(&f->done, HIP_EVENT_DISABLE_TIMING |
					  HIP_EVENT_INTERPROCESS);
	if (!e)
		e = be->hip->ipc_get_event(&f->done_h, f->done);
	if (e) {
		hsa_fence_close(&f->head);
		return kvt__dma_err(-EIO, "hsa: a fence's HIP streams and event: %s (%d)",
				    hip_str(be, e), e);
	}
	*out = &f->head;
	return 0;
}

static int hsa_fence_wait(struct kvt_dma_fence *hd, const void *handle)
{
	struct hsa_fence *f = (struct hsa_fence *)hd;
	struct hsa_be *be = f->head.d->be;
	hip_handle h;
	void *ev = NULL, *passed = NULL;
	int e, rc = hip_ready(f->head.d);

	if (rc)
		return rc;
	if (fence_reap(f, 0) && f->n_imp == FENCE_IMPORTS) {
		/* the oldest waited for: a slot for this one */
		if (passed_by(be, f->imp[0].passed, kvt__now_ns() + 60ull * 1000000000u))
			return kvt__dma_err(-EIO, "hsa: the engine's event of %u requests ago "
					    "has not fired in 60 s", FENCE_IMPORTS);
		fence_reap(f, 0);
	}
	memcpy(h.b, handle, sizeof(h.b));
	e = be->hip->ipc_open_event(&ev, h);
	if (e)
		return kvt__dma_err(hip_errno(e), "hsa: the engine's IPC event: %s (%d)",
				    hip_str(be, e), e);
	e = be->hip->stream_wait_event(f->wait, ev, 0);
	if (e) { /* nothing queued on it */
		be->hip->event_destroy(ev);
		return kvt__dma_err(-EIO, "hsa: hipStreamWaitEvent (the engine's IPC event): "
				    "%s (%d)", hip_str(be, e), e);
	}
	e = be->hip->event_create(&passed, HIP_EVENT_DISABLE_TIMING);
	if (!e)
		e = be->hip->event_record(passed, f->wait);
	if (e) {
		/* the wait may be queued: the import stays, as a leak, rather
		 * than be unmapped under it */
		if (passed)
			be->hip->event_destroy(passed);
		return kvt__dma_err(-EIO, "hsa: waiting on the engine's IPC event: %s (%d)",
				    hip_str(be, e), e);
	}
	f->imp[f->n_imp].ev = ev;
	f->imp[f->n_imp++].passed = passed;
	return 0;
}

static uint64_t hsa_fence_stream(const struct kvt_dma_fence *hd)
{
	return (uint64_t)(uintptr_t)((const struct hsa_fence *)hd)->wait;
}

static int hsa_fence_signal(struct kvt_dma_fence *hd, void *handle)
{
	struct hsa_fence *f = (struct hsa_fence *)hd;
	struct hsa_be *be = f->head.d->be;
	int e, rc = hip_ready(f->head.d);

	if (rc)
		return rc;
	e = be->hip->event_record(f->done, f->sig);
	if (e)
		return kvt__dma_err(-EIO, "hsa: hipEventRecord (the completion event): %s",
				    hip_str(be, e));
	memcpy(handle, f->done_h.b, KVT_DMA_IPC_BYTES);
	return 0;
}

static int hsa_no_values(void)
{
	return kvt__dma_err(-ENOTSUP, "hsa: timeline semaphores are LMCache's CUDA events "
			    "(cuda-python); a ROCm engine sends HIP IPC events");
}

static int hsa_fence_wait_value(struct kvt_dma_fence *f, const void *mem, uint64_t off,
				uint64_t value)
{
	(void)f, (void)mem, (void)off, (void)value;
	return hsa_no_values();
}

static int hsa_fence_signal_value(struct kvt_dma_fence *f, void *mem, uint64_t *off,
				  uint64_t *value)
{
	(void)f, (void)mem, (void)off, (void)value;
	return hsa_no_values();
}

/* ---- the copy kernel ---------------------------------------------------------
 *
 * Plans of small pages (below k_below, 28 KiB by default: where the copy
 * engines' cost per descriptor dominates; an SDMA copy has a fixed setup
 * per command as a CUDA copy engine has) go through kvt_copy_pages
 * (copy_kernel.c), as on the cuda backend: compiled for the bound agent's
 * target ID by the node's hiprtc at first use (hiprtc.c), loaded with
 * hipModuleLoadData into the HIP runtime on this process's ROCr (loaded
 * here where the engine has not: hip_load), launched with
 * hipModuleLaunchKernel on one of two HIP streams of our own -- one per
 * direction, so a load never queues behind a save -- on at most k_ctas
 * workgroups (an eighth of the CUs by default: a bounded share of the
 * GPU).  The descriptors lie in the slot's buffer of CPU pool memory the
 * GPU may read (rewritten only once the slot's ticket completed); the
 * kernel's threads read and write the arena through its lock, at the
 * agent pointers the SDMA copies use, and the KV cache directly.  Every
 * address comes from the plan, checked at bind against the KV cache's
 * allocations and the registered pieces: a kernel's memory fault stops
 * every queue of the process (see "Faults"), as an SDMA copy's does.
 *
 * Completion: a HIP event recorded behind the launch; poll is
 * hipEventQuery, a wait sleeps between queries (20 us, doubling to 1 ms),
 * rechecking faults and its deadline.  Ordering: order_after records an
 * event on the engine's stream as well as writing its fence signal (see
 * "Ordering"), and a kernel stream waits on the latest record
 * (hipStreamWaitEvent, on the device) before its next launch, as cuda.c's
 * copy streams do.  HIP's current device is per thread: it is set to the
 * bound GPU around these calls and put back (the engine's thread calls
 * them).  No HIP, no module API, no hiprtc, a target it predates or a code
 * object HIP refuses: DMA only, said in the log and the feature line. */
#define HIP_ERROR_NOT_READY 600

static int hip_on(struct hsa_be *be, int *old)
{
	int e;

	*old = -1;
	if (be->hip->get_device && be->hip->get_device(old))
		*old = -1;
	e = *old == be->hip_dev ? 0 : be->hip->set_device(be->hip_dev);
	return e ? kvt__dma_err(-EIO, "hsa: hipSetDevice(%d): %s", be->hip_dev, hip_str(be, e))
		 : 0;
}

static void hip_off(struct hsa_be *be, int old)
{
	if (old >= 0 && old != be->hip_dev)
		be->hip->set_device(old);
}

/* The bound agent's target ID (gfx942:sramecc+:xnack-), from its first ISA. */
static hsa_status_t isa_cb(hsa_isa_t isa, void *data)
{
	struct { struct hsa_be *be; char *out; } *a = data;
	hsa_status_t (*info)(hsa_isa_t, hsa_isa_info_t, void *) = a->be->f.isa_info;
	uint32_t n = 0;
	char name[160] = "";
	const char *t;

	if (info(isa, HSA_ISA_INFO_NAME_LENGTH, &n) || !n || n >= sizeof(name) ||
	    info(isa, HSA_ISA_INFO_NAME, name))
		return HSA_STATUS_SUCCESS;
	name[n] = 0;
	t = strstr(name, "--");
	snprintf(a->out, 96, "%s", t ? t + 2 : name);
	return HSA_STATUS_INFO_BREAK;
}

static void kernel_load(struct kvt_dma *d)
{
	struct hsa_be *be = d->be;
	struct { struct hsa_be *be; char *out; } isa_arg;
	char target[96] = "", what[160] = "";
	const char *code = NULL;
	uint32_t cus = 0;
	size_t len = 0;
	int ver = 0, old, e;

	be->k_below = d->cfg.kernel_below ? d->cfg.kernel_below : KVT_DMA_KERNEL_BELOW_DEFAULT;
	if (d->cfg.flags & KVT_DMA_F_NO_KERNEL) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: asked (KVT_DMA_F_NO_KERNEL)");
		return;
	}
	if (!be->f.iterate_isas || !be->f.isa_info) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: the HSA runtime lists no ISAs");
		goto dma_only;
	}
	isa_arg.be = be;
	isa_arg.out = target;
	be->f.iterate_isas(be->gpus[be->g], isa_cb, &isa_arg);
	if (!*target) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: GPU %d names no ISA", be->g);
		goto dma_only;
	}
	if (hip_load(d)) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: %s", kvt_dma_last_error());
		goto dma_only;
	}
	if (!be->hip->module_load || !be->hip->module_fn || !be->hip->module_unload ||
	    !be->hip->launch || !be->hip->stream_sync) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: the HIP runtime lacks the module API");
		goto dma_only;
	}
	if (be->hip->runtime_version && be->hip->runtime_version(&ver))
		ver = 0;
	if (kvt__hiprtc_code(target, ver, be->hip->lib, &code, &len, what, sizeof(what))) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: %s", what);
		goto dma_only;
	}
	if (hip_on(be, &old)) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: %s", kvt_dma_last_error());
		goto dma_only;
	}
	e = be->hip->module_load(&be->kmod, code);
	if (e) {
		be->kmod = NULL;
		snprintf(be->kwhat, sizeof(be->kwhat), "off: hipModuleLoadData of %s's code object: "
			 "%s (%d)", what, hip_str(be, e), e);
	} else if ((e = be->hip->module_fn(&be->kfn, be->kmod, kvt__copy_kernel_name))) {
		snprintf(be->kwhat, sizeof(be->kwhat), "off: hipModuleGetFunction(%s): %s (%d)",
			 kvt__copy_kernel_name, hip_str(be, e), e);
	} else {
		for (int i = 0; !e && i < 2; i++)
			e = be->hip->stream_create(&be->kstream[i], HIP_STREAM_NON_BLOCKING);
		if (!e)
			e = be->hip->event_create(&be->kfence, HIP_EVENT_DISABLE_TIMING);
		if (!e && !(be->ks = calloc(d->cfg.max_inflight, sizeof(*be->ks))))
			e = 2; /* hipErrorOutOfMemory */
		if (e)
			snprintf(be->kwhat, sizeof(be->kwhat), "off: creating the copy kernel's "
				 "streams and events: %s (%d)", hip_str(be, e), e);
	}
	hip_off(be, old);
	if (e) {
		be->kfn = NULL;
		goto dma_only;
	}
	if (be->f.agent_get_info(be->gpus[be->g],
				 (hsa_agent_info_t)HSA_AMD_AGENT_INFO_COMPUTE_UNIT_COUNT, &cus) ||
	    !cus)
		cus = 8;
	be->k_ctas = d->cfg.kernel_ctas ? d->cfg.kernel_ctas : (cus / 8 ? cus / 8 : 1);
	snprintf(be->kwhat, sizeof(be->kwhat), "pages below %llu KiB (%s, %u of %u CUs)",
		 (unsigned long long)(be->k_below >> 10), what, be->k_ctas, cus);
	return;
dma_only:
	kvt__dma_log(d, KVT_DMA_LOG_INFO, "hsa: copy kernel %s: every copy by DMA (small pages "
		     "run slower)", be->kwhat);
}

/* What closed backends left to the process after a GPU fault (kernel_free):
 * HIP's module, events and streams of kernels that never complete. */
static struct kernel_kept {
	void *kmod, *kfence, *kstream[2];
	struct hsa_kslot *ks;
	struct kernel_kept *next;
} *kept_after_fault;
static pthread_mutex_t kept_mu = PTHREAD_MUTEX_INITIALIZER;

/* What kernel_load made (before the HSA runtime goes: the descriptors are
 * its memory).  Tickets have completed: the core drained them (a handle
 * with copies still running at close is abandoned, never freed). */
static void kernel_free(struct hsa_be *be)
{
	int old = -1;

	if (!be->hip || (!be->kmod && !be->kstream[0] && !be->ks))
		return;
	if (hsa_dead(be)) {
		/* the device's queues are gone: a kernel queued there never
		 * completes, and a stream's synchronize would wait for it for
		 * good -- what HIP holds stays with the process, kept here */
		struct kernel_kept *k = malloc(sizeof(*k));

		if (k) {
			*k = (struct kernel_kept){ be->kmod, be->kfence,
						   { be->kstream[0], be->kstream[1] }, be->ks, NULL };
			pthread_mutex_lock(&kept_mu);
			k->next = kept_after_fault;
			kept_after_fault = k;
			pthread_mutex_unlock(&kept_mu);
		}
		be->ks = NULL;
		return;
	}
	hip_on(be, &old);
	for (int i = 0; i < 2; i++)
		if (be->kstream[i]) {
			be->hip->stream_sync(be->kstream[i]);
			be->hip->stream_destroy(be->kstream[i]);
		}
	for (uint32_t i = 0; be->ks && i < be->n_sig; i++) {
		if (be->ks[i].ev)
			be->hip->event_destroy(be->ks[i].ev);
		if (be->ks[i].kd)
			be->f.pool_free(be->ks[i].kd);
	}
	if (be->kfence)
		be->hip->event_destroy(be->kfence);
	if (be->kmod)
		be->hip->module_unload(be->kmod);
	hip_off(be, old);
	free(be->ks);
	be->ks = NULL;
	be->kmod = be->kfn = be->kfence = NULL;
}

static int kernel_submit(struct kvt_dma *d, uint32_t slot, const struct kvt_dma_job *j)
{
	struct hsa_be *be = d->be;
	struct hsa_kslot *s = &be->ks[slot];
	const struct kvt_plan *p = j->plan;
	int d2h = j->dir == KVT_DMA_D2H, old, e = 0;
	void *st = be->kstream[d2h];
	uint32_t *sg = &be->kstream_gen[d2h], g;
	unsigned int n = p->n;
	const char *what = "";
	int rc = hip_on(be, &old);

	if (rc)
		return rc;
	s->on = 0;
	if (!s->ev && (e = be->hip->event_create(&s->ev, HIP_EVENT_DISABLE_TIMING))) {
		s->ev = NULL;
		what = "hipEventCreateWithFlags (a ticket's)";
		goto out;
	}
	if (n > s->kcap) {
		void *buf = NULL;
		hsa_agent_t gpu = be->gpus[be->g];
		hsa_status_t hs = be->f.pool_allocate(be->cpu_pool, (size_t)n * sizeof(*s->kd), 0,
						      &buf);

		if (!hs && (hs = be->f.allow_access(1, &gpu, NULL, buf)))
			be->f.pool_free(buf);
		if (hs) {
			hip_off(be, old);
			return kvt__dma_err(st_errno(hs), "hsa: the copy kernel's descriptors "
					    "(%u): %s", n, st_str(be, hs));
		}
		if (s->kd)
			be->f.pool_free(s->kd);
		s->kd = buf;
		s->kcap = n;
	}
	kvt__kernel_descs(s->kd, j);
	/* behind the engine's work, when order_after recorded since this
	 * stream last waited (the lock only then) */
	g = __atomic_load_n(&be->kfence_gen, __ATOMIC_ACQUIRE);
	if (g && __atomic_load_n(sg, __ATOMIC_RELAXED) != g) {
		pthread_mutex_lock(&be->fence_mu);
		if (*sg != be->kfence_gen) {
			e = be->hip->stream_wait_event(st, be->kfence, 0);
			if (!e)
				__atomic_store_n(sg, be->kfence_gen, __ATOMIC_RELAXED);
		}
		pthread_mutex_unlock(&be->fence_mu);
		if (e) {
			what = "hipStreamWaitEvent (behind the engine's stream)";
			goto out;
		}
	}
	{
		uint64_t kd = (uint64_t)(uintptr_t)s->kd; /* CPU pool memory: the same
							   * address on the GPU */
		void *args[2] = { &kd, &n };

		e = be->hip->launch(be->kfn, n < be->k_ctas ? n : be->k_ctas, 1, 1, 256, 1, 1, 0,
				    st, args, NULL);
		if (e) {
			what = "hipModuleLaunchKernel (the copy kernel)";
			goto out;
		}
	}
	e = be->hip->event_record(s->ev, st);
	if (e) {
		/* the kernel is queued: nothing may stay in flight */
		what = "hipEventRecord (a ticket's)";
		be->hip->stream_sync(st);
		goto out;
	}
	s->on = 1;
out:
	hip_off(be, old);
	if (e)
		return kvt__dma_err(e == 2 ? -ENOMEM : -EIO, "hsa: %s: %s (%d)", what,
				    hip_str(be, e), e);
	return 0;
}

static int kernel_poll(struct hsa_be *be, uint32_t slot)
{
	int e;

	if (hsa_dead(be))
		return fault_err(be);
	e = be->hip->event_query(be->ks[slot].ev);
	if (e == HIP_ERROR_NOT_READY)
		return -EINPROGRESS;
	return e ? kvt__dma_err(-EIO, "hsa: the copy kernel's ticket: %s (%d)", hip_str(be, e),
				e)
		 : 0;
}

static int kernel_wait(struct hsa_be *be, uint32_t slot, uint64_t deadline)
{
	for (uint64_t nap = 20000;;) {
		struct timespec ts = { 0, (long)nap };
		int rc = kernel_poll(be, slot);

		if (rc != -EINPROGRESS)
			return rc;
		if (deadline != UINT64_MAX && kvt__now_ns() >= deadline)
			return -ETIMEDOUT;
		nanosleep(&ts, NULL);
		if (nap < 1000000)
			nap *= 2;
	}
}

/* order_after's record for the kernel streams, under fence_mu (see "The
 * copy kernel"). */
static int kernel_order(struct hsa_be *be, uint64_t stream)
{
	int e;

	if (!be->kfn)
		return 0;
	e = be->hip->event_record(be->kfence, (void *)(uintptr_t)stream);
	if (e)
		return kvt__dma_err(-EINVAL, "hsa: hipEventRecord on the engine's stream %#llx: "
				    "%s (%d)", (unsigned long long)stream, hip_str(be, e), e);
	__atomic_store_n(&be->kfence_gen, be->kfence_gen + 1, __ATOMIC_RELEASE);
	return 0;
}

const struct kvt_dma_ops kvt__dma_hsa_ops = {
	.order_after = hsa_order_after,
	.uuid = hsa_uuid,
	.ipc_open = hsa_ipc_open,
	.ipc_close = hsa_ipc_close,
	.fence_open = hsa_fence_open,
	.fence_wait = hsa_fence_wait,
	.fence_stream = hsa_fence_stream,
	.fence_signal = hsa_fence_signal,
	.fence_wait_value = hsa_fence_wait_value,
	.fence_signal_value = hsa_fence_signal_value,
	.fence_close = hsa_fence_close,
	.name = "hsa",
	.init = hsa_init_be,
	.fini = hsa_fini,
	.bind = hsa_bind,
	.caps = hsa_caps,
	.mem_reg = hsa_mem_reg,
	.mem_unreg = hsa_mem_unreg,
	.submit = hsa_submit,
	.poll = hsa_poll,
	.wait = hsa_wait,
	.dev_alloc = hsa_dev_alloc,
	.dev_free = hsa_dev_free,
	.dev_write = hsa_dev_write,
	.dev_read = hsa_dev_read,
	.ceiling = hsa_ceiling,
};
