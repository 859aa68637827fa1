/* fake_common.h - what the fake GPU runtimes share: a device address space
 * the CPU cannot touch, a table of regions mapping device addresses to the
 * host memory behind them, and worker lanes (threads) that play the
 * copy engine.  Compiled into each fake separately (each has its own
 * globals; fakes may have globals, the library may not). */
#ifndef KVT_FAKE_COMMON_H
#define KVT_FAKE_COMMON_H

#include <stddef.h>
#include <stdint.h>

enum fake_kind {
	FAKE_DEV = 1,   /* device memory (backing: calloc) */
	FAKE_ALIAS = 2, /* device view of a locked/registered host range */
	FAKE_SYS = 3,   /* host memory the runtime pinned itself: its device
			 * address is its host address */
};

struct fake_region {
	uint64_t dev;    /* device address */
	uint64_t len;
	char *host;      /* host memory behind it */
	int kind;
	int owner;       /* device ordinal / agent index */
	uint32_t flags;  /* runtime-specific */
};

/* Device memory: addresses inside a reserved PROT_NONE window, so a CPU
 * access through a device address faults.  0 on failure. */
uint64_t fake_region_add(int kind, uint64_t len, char *host, int owner, uint32_t flags);
/* Registers host memory whose device address equals its host address. */
int fake_region_add_sys(char *host, uint64_t len, int owner);
/* host memory of the caller's as a region of that kind at its own address
 * (FAKE_SYS: system memory; FAKE_DEV: adopted as device memory) */
int fake_region_add_at(int kind, char *host, uint64_t len, int owner);
/* Removes the region starting at dev; 0 or -1. */
int fake_region_del(uint64_t dev, struct fake_region *out);
/* Region holding [addr, addr + len) entirely; 0 or -1 (absent, or the
 * range crosses the region's end). */
int fake_region_find(uint64_t addr, uint64_t len, struct fake_region *out);
/* Alias region whose host range contains [host, host + len); 0 or -1.
 * (Used to explain a wrong-pointer error.) */
int fake_alias_of_host(const char *host, uint64_t len, struct fake_region *out);
/* Live regions of a kind (0: all). */
int fake_region_count(int kind);
/* The host address behind a device range, or NULL (with why). */
char *fake_translate(uint64_t addr, uint64_t len, const char **why);

/* Workers ("copy engines", "streams"): FAKE_LANES in-order lanes, each
 * on its own thread, in no order among themselves. */
#define FAKE_LANES 8
typedef void (*fake_task_fn)(void *arg);
void fake_worker_start(void);
void fake_worker_stop(void);
void fake_worker_push_lane(int lane, fake_task_fn fn, void *arg);
void fake_worker_push(fake_task_fn fn, void *arg); /* lane 0 */
/* hold != 0: every lane finishes its current task and waits. */
void fake_worker_hold(int hold);
/* Each task starts after a random delay of up to max_us (0: none; the
 * start value is FAKE_GPU_JITTER_US). */
void fake_worker_jitter(long max_us);
/* Tasks that finished after one pushed later than them (reset: to 0). */
long fake_worker_out_of_order(int reset);

/* A fault stops the faulting device's queues before it is reported (the
 * KFD driver evicts the process's queues on that GPU, CUDA's channel
 * recovery tears down the context's): a copy of device dev runs between
 * fake_copy_begin (0: its queues are stopped, drop the copy) and
 * fake_copy_end; the faulting copy calls fake_copy_halt, outside a
 * begin/end pair, which returns once the device's copies running on other
 * lanes have finished, then makes the error visible and calls
 * fake_copy_report.  Work that reports completion (an event's record)
 * waits in fake_copy_settled until then, so nothing reports success for a
 * copy that was dropped.  "reset" resumes. */
int fake_copy_begin(int dev);
void fake_copy_end(int dev);
void fake_copy_halt(int dev);
void fake_copy_report(int dev);
void fake_copy_settled(int dev);
void fake_copy_resume(void);
int fake_copy_halted(void);

/* IPC between processes as the drivers do it.  An allocation's backing
 * (whole pages, mmap'ed) moves onto a memfd at the same address with the
 * same bytes at its first export (fake_ipc_export: the memfd, kept per
 * device address until fake_ipc_unexport at its free); another process
 * maps that memfd through /proc/PID/fd/FD (fake_ipc_map: 0, or
 * FAKE_IPC_SELF -- the exporting process itself, which the drivers refuse
 * --, FAKE_IPC_GONE -- no such process or memfd, or smaller than len --,
 * FAKE_IPC_NOMEM).  Unmapped with munmap(p, FAKE_PAGES(len)). */
#define FAKE_PAGES(n) (((uint64_t)(n) + 4095) & ~(uint64_t)4095)
enum { FAKE_IPC_SELF = 1, FAKE_IPC_GONE, FAKE_IPC_NOMEM };
int fake_ipc_export(uint64_t dev, char *host, uint64_t len);
void fake_ipc_unexport(uint64_t dev);
int fake_ipc_map(int32_t pid, int32_t fd, uint64_t len, void **out);
/* An interprocess event's state: a zeroed page on a memfd (*fd; other
 * processes map it with fake_ipc_map) holding a process-shared mutex and
 * condition at m and c (pointers into it).  The page, or NULL. */
#include <pthread.h>
void *fake_shared_page(uint64_t len, int *fd, size_t m_off, size_t c_off);
/* Environment helpers. */
long fake_env_long(const char *name, long dflt);

#endif
