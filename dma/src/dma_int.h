/* dma_int.h - internals shared by the DMA core (dma.c) and its backends.
 * Not installed; nothing outside dma/ includes it. */
#ifndef KVT_DMA_INT_H
#define KVT_DMA_INT_H

#include "kvt_clock.h"
#include "kvt_dma.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <time.h>

/* ---- small helpers ------------------------------------------------------ */

static inline int kvt__mul_overflow(uint64_t a, uint64_t b, uint64_t *r)
{
	return __builtin_mul_overflow(a, b, r);
}

static inline int kvt__add_overflow(uint64_t a, uint64_t b, uint64_t *r)
{
	return __builtin_add_overflow(a, b, r);
}

/* Bytes of one layer's cache from its base (layout checked). */
static inline uint64_t kvt__layer_extent(const struct kvt_kv_group *g)
{
	return (g->n_blocks - 1) * g->block_stride +
	       (uint64_t)g->tokens_per_block * g->bytes_per_token;
}

/* snprintf into msg (when msg && len); returns rc, for
 * `return kvt__fmt(rc, msg, len, ...)`. */
__attribute__((format(printf, 4, 5)))
int kvt__fmt(int rc, char *msg, size_t len, const char *fmt, ...);

/* Sets this thread's kvt_dma_last_error() text; returns rc. */
__attribute__((format(printf, 2, 3)))
int kvt__dma_err(int rc, const char *fmt, ...);

/* Logs through the handle's sink. */
struct kvt_dma;
__attribute__((format(printf, 3, 4)))
void kvt__dma_log(const struct kvt_dma *d, int level, const char *fmt, ...);

/* Absolute deadline for a relative timeout (< 0: none -> UINT64_MAX). */
static inline uint64_t kvt__deadline(int64_t timeout_ns)
{
	return timeout_ns < 0 ? UINT64_MAX : kvt__now_ns() + (uint64_t)timeout_ns;
}

/* ---- registrations ------------------------------------------------------ */

struct kvt_dma_piece {
	char *host;       /* CPU address */
	uint64_t len;
	uint64_t dev;     /* address of host[0] for the device's copies */
	void *handle;     /* backend's */
};

struct kvt_dma_mr {
	struct kvt_dma_mr *next;
	struct kvt_dma *d;
	char *base;
	uint64_t len;
	uint64_t piece_bytes;
	uint32_t n_pieces;
	uint32_t inflight;          /* tickets using it; under kvt_dma.lock */
	uint64_t register_ns;
	/* Pieces [0, ready) are registered (under kvt_dma.lock; waiters on
	 * kvt_dma.reg_cv).  In the background (kvt_dma_mem_register_bg) the
	 * thread bg registers the rest in address order until bg_stop or a
	 * failure (bg_err, bg_why); a submit into a later piece waits. */
	uint32_t ready;
	int bg_live, bg_stop, bg_err;
	pthread_t bg;
	char bg_why[200];
	struct kvt_dma_piece pieces[]; /* n_pieces */
};

/* ---- tickets ------------------------------------------------------------ */

enum { KVT__JOB_FREE = 0, KVT__JOB_BUSY = 1 };

/* What a backend's submit gets: the plan (valid only during the call), the
 * sub-slot's CPU address and its device-visible address. */
struct kvt_dma_job {
	const struct kvt_plan *plan;
	char *host;
	uint64_t host_dev;
	enum kvt_dma_dir dir;
	int fault;                   /* testing: fail this ticket (fault_nth) */
};

struct kvt_dma_slot {
	uint32_t gen;
	uint32_t state;             /* KVT__JOB_* under kvt_dma.lock */
	struct kvt_dma_mr *mr;
};

/* ---- backends (STYLE.md: one ops table each, designated initializers) ---- */

struct kvt_dma_ops {
	const char *name;
	/* Loads the runtime and finds devices.  -ENOENT (runtime absent),
	 * -ENODEV (no device / init failed) with the reason in why. */
	int (*init)(struct kvt_dma *d, char *why, size_t why_len);
	void (*fini)(struct kvt_dma *d);
	/* Binds the device owning the layout's pointers (or d->device). */
	int (*bind)(struct kvt_dma *d, const struct kvt_kv_layout *l);
	void (*caps)(const struct kvt_dma *d, struct kvt_plan_caps *c);
	int (*mem_reg)(struct kvt_dma *d, struct kvt_dma_piece *p);
	void (*mem_unreg)(struct kvt_dma *d, struct kvt_dma_piece *p);
	/* Starts the copies of job on ticket slot `slot` (exclusively owned
	 * until poll/wait report a final status).  0 or -errno (nothing in
	 * flight then). */
	int (*submit)(struct kvt_dma *d, uint32_t slot, const struct kvt_dma_job *j);
	/* Later submits start after the work queued on the engine's stream
	 * `stream` so far (kvt_dma_order_after).  NULL: the backend's copies
	 * need no such order (host: the caller's data is written when it
	 * submits). */
	int (*order_after)(struct kvt_dma *d, uint64_t stream);
	/* 0 done, -EINPROGRESS, -EIO; a final status may be reported again. */
	int (*poll)(struct kvt_dma *d, uint32_t slot);
	/* 0, -ETIMEDOUT, -EIO. */
	int (*wait)(struct kvt_dma *d, uint32_t slot, uint64_t deadline_ns);
	/* Another process's memory and events (kvt_dma_ipc_*, kvt_dma_fence_*);
	 * NULL: -ENOTSUP. */
	int (*uuid)(struct kvt_dma *d, const uint8_t uuid[16]);
	int (*ipc_open)(struct kvt_dma *d, const void *handle, uint64_t *base, uint64_t *len);
	int (*ipc_close)(struct kvt_dma *d, uint64_t base);
	int (*fence_open)(struct kvt_dma *d, struct kvt_dma_fence **out);
	int (*fence_wait)(struct kvt_dma_fence *f, const void *handle);
	uint64_t (*fence_stream)(const struct kvt_dma_fence *f);
	int (*fence_signal)(struct kvt_dma_fence *f, void *handle);
	int (*fence_wait_value)(struct kvt_dma_fence *f, const void *mem, uint64_t off,
				uint64_t value);
	int (*fence_signal_value)(struct kvt_dma_fence *f, void *mem, uint64_t *off,
				  uint64_t *value);
	void (*fence_close)(struct kvt_dma_fence *f);
	int (*dev_alloc)(struct kvt_dma *d, uint64_t bytes, uint64_t *dev);
	int (*dev_free)(struct kvt_dma *d, uint64_t dev);
	int (*dev_write)(struct kvt_dma *d, uint64_t dev, const void *src, uint64_t len);
	int (*dev_read)(struct kvt_dma *d, void *dst, uint64_t dev, uint64_t len);
	int (*ceiling)(struct kvt_dma *d, enum kvt_dma_dir dir, uint64_t dev,
		       uint64_t bytes, uint64_t copy_bytes, uint32_t iters,
		       double *seconds);
};

/* A fence's common head: the backend's fence starts with it. */
struct kvt_dma_fence {
	struct kvt_dma *d;
};

extern const struct kvt_dma_ops kvt__dma_host_ops;
#ifdef KVTIER_HAVE_HSA
extern const struct kvt_dma_ops kvt__dma_hsa_ops;
#endif
#ifdef KVTIER_HAVE_CUDA
extern const struct kvt_dma_ops kvt__dma_cuda_ops;
#endif

struct kvt_dma {
	const struct kvt_dma_ops *ops;
	void *be;                    /* backend state */
	struct kvt_dma_config cfg;   /* defaults filled in */
	int32_t device;              /* bound GPU ordinal, -1 while unbound */

	pthread_mutex_t lock;        /* slots, mrs, inflight, mr->ready */
	pthread_cond_t reg_cv;       /* a background registration moved */
	struct kvt_dma_slot *slots;  /* cfg.max_inflight */
	uint32_t inflight;
	uint32_t next_slot;          /* round-robin start of the free search */
	uint64_t submits;            /* tickets ever submitted (fault_nth) */
	struct kvt_dma_mr *mrs;

	int have_layout;
	struct kvt_kv_layout layout; /* layer_base -> bases */
	uint64_t *bases;
	/* The device allocations the layers lie in, as bind found them
	 * (kvt__dma_add_range), sorted and disjoint: the plans keep each copy
	 * inside one (kvt_plan_caps.ranges). */
	struct kvt_range *ranges;
	uint32_t n_ranges, cap_ranges;

	char describe[1024];
	char skipped[512];           /* backends auto skipped, and why */
	char feature[448];           /* the backend's part of describe */
};

/* Notes that device bytes [start, end) are one allocation of the runtime
 * (bind).  0 or -ENOMEM. */
int kvt__dma_add_range(struct kvt_dma *d, uint64_t start, uint64_t end);

/* Non-temporal copy for large blocks (x86-64: SSE2 streaming stores;
 * elsewhere memcpy). */
void kvt__copy_nt(void *dst, const void *src, size_t n);

/* ---- the copy kernel (copy_kernel.c, nvrtc.c, hiprtc.c) -------------------- */

/* One descriptor of kvt_copy_pages: rows rows of len bytes, row r from
 * src + r * spitch to dst + r * dpitch (device-visible addresses).  The
 * kernel source's struct kvt_kcopy, field for field. */
struct kvt__kcopy {
	uint64_t src, dst, len, rows, spitch, dpitch;
};

extern const char kvt__copy_kernel_src[];
extern const char kvt__copy_kernel_name[];

/* Whether a plan goes through the copy kernel: its pages, averaged over
 * its rows, below `below` bytes. */
int kvt__kernel_plan(const struct kvt_plan *p, uint64_t below);
/* The job's copies as the kernel's descriptors (kd: p->n of them). */
void kvt__kernel_descs(struct kvt__kcopy *kd, const struct kvt_dma_job *j);

/* The kernel compiled to PTX for a device of compute capability cc (major
 * * 10 + minor) by the NVRTC found at run time: 0 and *ptx (malloc'ed,
 * NUL-terminated), what saying which NVRTC and target; or -errno, what
 * saying why not. */
int kvt__nvrtc_ptx(int cc, char **ptx, char *what, size_t what_len);

/* The kernel compiled by HIP's hiprtc (found at run time; hip_lib is the
 * HIP runtime's handle, which carries hiprtc in ROCm 5) for target, an
 * agent's target ID (gfx942:sramecc+:xnack-), hip_version as
 * hipRuntimeGetVersion gives it: 0 and *code, *len (a code object kept for
 * the process: not to be freed), what saying which hiprtc and target; or
 * -errno, what saying why not. */
int kvt__hiprtc_code(const char *target, int hip_version, void *hip_lib, const char **code,
		     size_t *len, char *what, size_t what_len);

#endif /* KVT_DMA_INT_H */
