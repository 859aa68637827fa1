/* kvt_numa.h - where the arena lives: NUMA topology, the placement choice,
 * binding and verification, and huge pages.  Internal API of kvtier (the
 * engine-facing header is tier/include/kvtier.h); used by tier/ and by the
 * operator tools.
 *
 * Conventions (STYLE.md): every int function returns 0 (or a count) on
 * success and -errno on failure, never changes errno for the caller, and on
 * failure leaves a sentence in the calling thread's last-error buffer
 * (kvt_numa_last_error()).  Nothing here keeps global state: a topology is a
 * value read once and passed around, a placement is a value computed from it.
 * So every function is thread-safe (a topology may be shared read-only);
 * those that read files or make system calls say that they block.
 *
 * The three steps, and why they are separate:
 *
 *   topo = kvt_numa_topo_read(root)        what the machine has (sysfs).  All
 *                                           reads go through one root, so the
 *                                           tests build 2-, 4- and 8-node
 *                                           machines in a temporary directory.
 *   plan = kvt_numa_choose(topo, request)  where each shard of the arena goes,
 *                                           and a sentence saying why.  Pure
 *                                           apart from reading the environment
 *                                           and this thread's memory policy,
 *                                           both of which a request can supply.
 *   kvt_numa_bind_region / _segment         mbind before first touch, prefault,
 *                                           then ask the kernel where every
 *                                           page landed.
 *
 * Without libnuma (KVTIER_HAVE_NUMA undefined) the topology, the chooser and
 * the huge page logic still work; binding and reading the memory policy
 * return -ENOTSUP with "NUMA support not built".
 */
#ifndef KVT_NUMA_H
#define KVT_NUMA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVT_NUMA_MAX_NODES  1024 /* Linux MAX_NUMNODES with NODES_SHIFT=10 */
#define KVT_NUMA_MAX_SHARDS 64   /* = KVT_MAX_WORLD */
#define KVT_NUMA_MAX_INSTANCES 16 /* = KVT_MAX_INSTANCES */
#define KVT_NUMA_MAX_GPUS   256
#define KVT_NUMA_MAX_HP     4    /* huge page sizes tracked (2 MiB, 1 GiB, ...) */

/* Thread-local description of the last failure in this thread. */
const char *kvt_numa_last_error(void);

/* ---- node sets ----------------------------------------------------------- */

struct kvt_nodemask {
	uint64_t bits[KVT_NUMA_MAX_NODES / 64];
};

void kvt_nodemask_zero(struct kvt_nodemask *m);
/* Sets node n; -EINVAL when n is outside 0..KVT_NUMA_MAX_NODES-1. */
int kvt_nodemask_set(struct kvt_nodemask *m, int n);
int kvt_nodemask_test(const struct kvt_nodemask *m, int n);
int kvt_nodemask_count(const struct kvt_nodemask *m);
/* Lowest node in the set, or -1 when empty. */
int kvt_nodemask_first(const struct kvt_nodemask *m);
/* Next node after n, or -1. */
int kvt_nodemask_next(const struct kvt_nodemask *m, int n);
int kvt_nodemask_equal(const struct kvt_nodemask *a, const struct kvt_nodemask *b);

/* Parses a node list the way numactl writes one: "1", "0,2", "0-3",
 * "0-1,4-5".  Strict: decimal numbers only, ranges ascending, no empty
 * element, no space, no sign, nodes below KVT_NUMA_MAX_NODES, at least one
 * node.  `what` names where the text came from (e.g. "KVTIER_NUMA_NODES")
 * and is quoted in the error.  Returns 0 or -EINVAL. */
int kvt_nodemask_parse(const char *s, const char *what, struct kvt_nodemask *out);

/* Writes the set as a compact list ("0-1,4").  Returns the length that was
 * needed (like snprintf); the output is always terminated when len > 0. */
int kvt_nodemask_format(const struct kvt_nodemask *m, char *buf, size_t len);

/* ---- topology ------------------------------------------------------------ */

/* One huge page pool. */
struct kvt_numa_hp {
	uint64_t page_bytes;  /* 2 MiB, 1 GiB, ... */
	uint64_t total;       /* nr_hugepages */
	uint64_t free;        /* free_hugepages */
	uint64_t resv;        /* resv_hugepages: promised to mappings, not yet
			       * faulted (global pools only; 0 per node) */
};

struct kvt_numa_node {
	int id;
	uint64_t mem_total;   /* bytes, nodeN/meminfo MemTotal */
	uint64_t mem_free;    /* bytes, nodeN/meminfo MemFree */
	uint32_t n_cpus;      /* CPUs in nodeN/cpulist (0 for a memory-only node) */
	uint32_t n_hp;
	struct kvt_numa_hp hp[KVT_NUMA_MAX_HP];
	char *cpulist;        /* nodeN/cpulist as read, e.g. "0-31,64-95" */
};

/* A GPU: a PCI function of NVIDIA (0x10de) or AMD (0x1002) whose class is
 * VGA (0x0300), 3D (0x0302), display (0x0380, older Instinct boards) or
 * processing accelerator (0x1200, MI200/MI300). */
struct kvt_numa_gpu {
	char pci[16];         /* "0000:3b:00.0", lower case, as in sysfs */
	uint16_t vendor;
	uint32_t pci_class;   /* 24 bits, e.g. 0x030200 */
	int node;             /* PCI numa_node; -1 when the firmware gives none
			       * (on a one-node machine it is set to that node) */
};

struct kvt_numa_topo {
	char *root;           /* the sysfs root it was read from */
	uint32_t n_nodes;     /* nodes found, sorted by id */
	struct kvt_numa_node *nodes;
	uint32_t n_gpus;      /* sorted by PCI address: the order of
			       * CUDA_DEVICE_ORDER=PCI_BUS_ID and of ROCm */
	struct kvt_numa_gpu *gpus;
	uint32_t n_hp;        /* global pools, kernel/mm/hugepages */
	struct kvt_numa_hp hp[KVT_NUMA_MAX_HP];
};

/* Reads the topology under root (NULL: $KVTIER_SYSFS_ROOT, else "/sys"):
 * devices/system/node/nodeN/{meminfo,cpulist,hugepages/},
 * bus/pci/devices/D/{class,vendor,numa_node}, kernel/mm/hugepages/.
 * A kernel built without NUMA has no node directories: read from the real
 * "/sys", that machine is one node 0 sized from /proc/meminfo.
 * Returns 0 and *out (free with kvt_numa_topo_free), -ENOENT (no node
 * found), -EIO (a file that exists but does not parse; the message names
 * it), -ENOMEM.  Blocks (file reads). */
int kvt_numa_topo_read(const char *root, struct kvt_numa_topo **out);
void kvt_numa_topo_free(struct kvt_numa_topo *t);

/* The node with this id, or NULL. */
const struct kvt_numa_node *kvt_numa_topo_node(const struct kvt_numa_topo *t, int id);
/* The node whose cpulist holds cpu, or -ENOENT. */
int kvt_numa_topo_cpu_node(const struct kvt_numa_topo *t, int cpu);
/* Index in t->gpus of the GPU with this PCI address ("0000:3B:00.0",
 * "3b:00.0", any case; CUDA and HSA spell them differently), or -ENOENT. */
int kvt_numa_topo_gpu_find(const struct kvt_numa_topo *t, const char *pci);
/* The pool of this page size on a node (node < 0: the global pool), or NULL. */
const struct kvt_numa_hp *kvt_numa_topo_hp(const struct kvt_numa_topo *t, int node,
					   uint64_t page_bytes);

/* ---- memory policy ------------------------------------------------------- */

enum kvt_numa_mode {
	KVT_NUMA_NONE       = 0, /* no binding: first touch decides */
	KVT_NUMA_BIND       = 1, /* MPOL_BIND: only these nodes */
	KVT_NUMA_PREFERRED  = 2, /* MPOL_PREFERRED(_MANY): these first */
	KVT_NUMA_INTERLEAVE = 3, /* MPOL_INTERLEAVE: round robin over them */
	KVT_NUMA_LOCAL      = 4, /* MPOL_LOCAL (as a process policy only) */
};
const char *kvt_numa_mode_name(uint32_t mode);

struct kvt_numa_policy {
	uint32_t mode;               /* enum kvt_numa_mode */
	struct kvt_nodemask nodes;
};

/* This thread's memory policy (get_mempolicy), i.e. what numactl
 * --membind/--preferred/--interleave/--localalloc set for the process.
 * MPOL_DEFAULT reads as KVT_NUMA_NONE; MPOL_WEIGHTED_INTERLEAVE as
 * INTERLEAVE.  Returns 0, -ENOTSUP without libnuma, -errno of
 * get_mempolicy. */
int kvt_numa_policy_read(struct kvt_numa_policy *out);

/* ---- the placement choice ------------------------------------------------ */

enum kvt_numa_source {
	KVT_NUMA_SRC_EXPLICIT = 1, /* --numa-nodes / KVTIER_NUMA_NODES */
	KVT_NUMA_SRC_POLICY   = 2, /* the creating process's memory policy */
	KVT_NUMA_SRC_GPU      = 3, /* the nodes local to the ranks' GPUs */
	KVT_NUMA_SRC_LOCAL    = 4, /* the node this process runs on */
};
const char *kvt_numa_source_name(uint32_t src);

#define KVT_NUMA_F_FALLBACK  0x1u /* a node that cannot be used, or a binding
				   * that fails, is a warning, not an error
				   * (--numa-fallback) */
#define KVT_NUMA_F_NO_ENV    0x2u /* ignore KVTIER_NUMA_NODES */
#define KVT_NUMA_F_NO_POLICY 0x4u /* ignore this thread's memory policy */
#define KVT_NUMA_F_MASK      0x7u

enum { KVT_NUMA_LOG_INFO = 0, KVT_NUMA_LOG_WARN = 1 };
/* Receives the choice and its reason, and warnings.  NULL: stderr, each
 * line prefixed "kvtier: numa: ". */
typedef void (*kvt_numa_log_fn)(void *arg, int level, const char *msg);

struct kvt_numa_request {
	size_t size;              /* sizeof(struct kvt_numa_request) */
	uint32_t flags;           /* KVT_NUMA_F_* */
	uint32_t n_shards;        /* 1..64: world (sharded) or 1 (replicated) */
	uint32_t n_ranks;         /* ranks using the arena; rank r writes shard
				   * r % n_shards (instances follow each other).
				   * 0: n_shards */
	uint32_t reserved;        /* must be 0 */
	const int *rank_gpu;      /* n_ranks indexes into topo->gpus (-1:
				   * unknown); NULL: rank r uses GPU r */
	const char *nodes;        /* explicit node list; NULL: $KVTIER_NUMA_NODES
				   * unless KVT_NUMA_F_NO_ENV */
	const struct kvt_numa_policy *policy; /* NULL: read this thread's */
	const int *local_node;    /* NULL: the node of the CPU this runs on */
	kvt_numa_log_fn log;
	void *log_arg;
};

struct kvt_numa_shard_place {
	uint32_t mode;              /* enum kvt_numa_mode */
	struct kvt_nodemask nodes;
};

struct kvt_numa_plan {
	uint32_t source;            /* enum kvt_numa_source */
	uint32_t flags;             /* the request's flags (binding honours FALLBACK) */
	uint32_t n_shards;
	uint32_t reserved;
	struct kvt_nodemask nodes;  /* every node the arena may use */
	struct kvt_numa_shard_place shard[KVT_NUMA_MAX_SHARDS];
	char reason[640];           /* one line: the choice and why */
};

/* Chooses where the arena goes, in this order:
 *   1. explicit nodes (req->nodes, else $KVTIER_NUMA_NODES): every node must
 *      exist and have memory (else -EINVAL naming the node, or, with
 *      KVT_NUMA_F_FALLBACK, a warning and the next step);
 *   2. this thread's memory policy (numactl --membind/--preferred/
 *      --interleave): the arena follows it ("membind-aware");
 *   3. the nodes local to the ranks' GPUs;
 *   4. the node this process runs on.
 * Sharded (n_shards > 1): each shard is bound to the node(s) of the GPUs of
 * the ranks that write it, narrowed to the chosen set when they lie in it
 * (under BIND or PREFERRED); a shard whose GPUs are unknown or outside the
 * set, and a replicated arena, use the whole set: bound to it when it is one
 * node, interleaved over it when it is several (every rank reads all of a
 * replicated arena, so no socket should hold all of it).  An interleaving
 * policy is kept as it is.  The choice and its reason are logged (INFO) and
 * left in out->reason.  Returns 0, -EINVAL (bad request, bad node list,
 * unusable explicit node), -ENOENT (a topology without a node with memory).
 * Does not block apart from get_mempolicy. */
int kvt_numa_choose(const struct kvt_numa_topo *t, const struct kvt_numa_request *r,
		    struct kvt_numa_plan *out);

/* ---- binding --------------------------------------------------------------- */

#define KVT_NUMA_BIND_F_NO_PREFAULT 0x10u /* bind only; pages fault later */
#define KVT_NUMA_BIND_F_NO_VERIFY   0x20u /* skip the move_pages check */
#define KVT_NUMA_BIND_F_MASK        (KVT_NUMA_F_FALLBACK | 0x30u)

struct kvt_numa_bind_opts {
	size_t size;              /* sizeof(struct kvt_numa_bind_opts) */
	uint32_t flags;           /* KVT_NUMA_F_FALLBACK | KVT_NUMA_BIND_F_* */
	uint32_t reserved;        /* must be 0 */
	uint64_t page_bytes;      /* page size of the mapping; 0: read it from
				   * /proc/self/smaps (KernelPageSize) */
	kvt_numa_log_fn log;
	void *log_arg;
};

struct kvt_numa_bind_report {
	uint64_t bytes;           /* bytes bound */
	uint64_t page_bytes;
	uint64_t pages;           /* pages whose node was asked */
	uint64_t on_target;       /* on one of the intended nodes */
	uint64_t misplaced;       /* on another node */
	uint64_t absent;          /* not faulted in (or not countable) */
	int first_bad_node;       /* node of the first misplaced page, -1 */
	uint32_t bound;           /* regions bound; 0 when a fallback left the
				   * memory unbound */
	uint32_t prefault;        /* 0 none, 1 MADV_POPULATE_WRITE, 2 touched */
	uint32_t reserved;
};

/* Binds [addr, addr+len) (page aligned) to nodes with mode (BIND,
 * PREFERRED, INTERLEAVE; NONE binds nothing and only prefaults/verifies),
 * before first touch; then prefaults it (MADV_POPULATE_WRITE; touching each
 * page only on kernels without it, never on hugetlb where a missing page
 * would be SIGBUS); then asks the kernel (move_pages) where each page is.
 * Nodes outside this process's allowed set (cpuset.mems, Mems_allowed) are
 * refused before mbind, naming them.  Returns 0 with *rep filled (rep may be
 * NULL); -EINVAL (bad arguments, node not allowed or without memory),
 * -EPERM (mbind refused), -ENOMEM (the node has no free (huge) pages), -EIO
 * (BIND and some page is elsewhere), -ENOTSUP (built without libnuma).  With
 * KVT_NUMA_F_FALLBACK a failed mbind is a warning and the region stays
 * unbound (rep->bound 0), and misplaced pages are a warning.  Blocks (page
 * faults: seconds for tens of GB). */
int kvt_numa_bind_region(void *addr, size_t len, uint32_t mode,
			 const struct kvt_nodemask *nodes,
			 const struct kvt_numa_bind_opts *o,
			 struct kvt_numa_bind_report *rep);

struct kvt_seg;
/* Binds each shard's part of the segment's arena as the plan says
 * (kvt_seg_arena(seg, shard)) and returns the summed report.  Call it right
 * after kvt_seg_create without KVT_SEG_F_PREFAULT: the arena has not been
 * touched yet.  plan->n_shards must equal kvt_seg_n_shards(seg) (-EINVAL).
 * Only in builds where kvtier_core exists (numa/seg_bind.c). */
int kvt_numa_bind_segment(struct kvt_seg *seg, const struct kvt_numa_plan *plan,
			  const struct kvt_numa_bind_opts *o,
			  struct kvt_numa_bind_report *rep);

/* ---- huge pages ------------------------------------------------------------ */

/* A hugetlbfs mount: the directory a segment is created in with
 * kvt_seg_create(.dir = dir), so every rank maps it by name, as the file
 * <dir>/kvtier.<name>.  (memfd_create(MFD_HUGETLB) works as well but needs
 * the fd passed to every rank over a Unix socket; shm_open + MAP_HUGETLB
 * does not work at all.) */
struct kvt_hugetlbfs {
	char dir[256];
	uint64_t page_bytes;
};

/* Finds a hugetlbfs mount of page size page_bytes in a mounts table
 * (NULL: /proc/mounts).  A mount without pagesize= has the default size,
 * default_page_bytes (0: Hugepagesize of /proc/meminfo, else 2 MiB).
 * Returns 0, -ENOENT (none), -errno reading the table. */
int kvt_hugetlbfs_find(const char *mounts, uint64_t page_bytes,
		       uint64_t default_page_bytes, struct kvt_hugetlbfs *out);

enum kvt_hp_want {
	KVT_HP_AUTO = 0, /* huge pages when reserved and mounted, else 4 KiB + warning */
	KVT_HP_ON   = 1, /* huge pages or an error */
	KVT_HP_OFF  = 2, /* 4 KiB pages */
};
/* Parses "auto" | "on" | "off" ("1"/"0", "yes"/"no" too) strictly; `what`
 * names the source in the error.  0 or -EINVAL. */
int kvt_hp_want_parse(const char *s, const char *what, uint32_t *out);

struct kvt_hp_request {
	size_t size;              /* sizeof(struct kvt_hp_request) */
	uint32_t want;            /* enum kvt_hp_want; see also KVT_HP_F_ENV */
	uint32_t flags;           /* KVT_HP_F_* */
	uint64_t page_bytes;      /* 0: 2 MiB */
	uint64_t seg_bytes;       /* the whole segment */
	const char *dir;          /* a hugetlbfs directory to use; NULL:
				   * $KVTIER_HUGETLBFS, else from mounts */
	const char *mounts;       /* mounts table; NULL: /proc/mounts */
	uint64_t default_page_bytes; /* see kvt_hugetlbfs_find */
	kvt_numa_log_fn log;
	void *log_arg;
};
#define KVT_HP_F_ENV  0x1u /* $KVTIER_HUGEPAGES (auto|on|off) overrides want */
#define KVT_HP_F_MASK 0x1u

struct kvt_hp_choice {
	uint32_t use;             /* 1: create the segment in dir */
	uint32_t reserved;
	uint64_t page_bytes;      /* huge page size, or 4096 */
	uint64_t pages_needed;    /* huge pages the segment takes */
	char dir[256];            /* hugetlbfs mount ("" with use 0) */
	char reason[512];
};

/* Decides whether the segment goes on huge pages.  Needs a hugetlbfs mount
 * of that page size and enough free pages: globally (free - resv) and, when
 * a plan is given, on each node it binds to (its share of the arena; a shard
 * over several nodes is split evenly).  AUTO without them: use 0, a WARN
 * saying what is missing and how to reserve pages, return 0.  ON without
 * them: -ENOMEM (pages) or -ENOENT (mount).  OFF: use 0, no warning.  The
 * decision is logged.  Returns 0 or -errno. */
int kvt_hugepages_choose(const struct kvt_numa_topo *t, const struct kvt_numa_plan *plan,
			 const struct kvt_hp_request *r, struct kvt_hp_choice *out);

#ifdef __cplusplus
}
#endif
#endif /* KVT_NUMA_H */
