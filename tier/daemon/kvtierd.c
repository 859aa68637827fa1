/* kvtierd - the node's KV tier service: creates and owns the segment,
 * reaps dead processes continuously, serves /healthcheck, /metrics and
 * /status on loopback, drains on SIGTERM.
 *
 * Design.
 *  * Creation goes through kvt_open (KVT_F_CREATE), the path an embedded
 *    owner takes: NUMA placement, huge pages, reservation and pre-faulting
 *    are the library's, so the daemon and an engine that creates its own
 *    segment make the same segment from the same settings.  The daemon
 *    then takes the owner lock (core/owner.c: an OFD lock the kernel drops
 *    when the daemon dies) and locks the arena in memory.
 *  * Settings: flags, then the config file (--config: `key = value` lines,
 *    the long option names), then KVTIER_* variables (read by kvt_open for
 *    what no flag set), then defaults.  A value is checked as strictly as
 *    kvt_open checks the variables; a bad one stops the start with its name.
 *  * Warm restart: a segment already there is attached (its READY chunks
 *    are kept) when its layout fingerprint, slots and instances are the
 *    ones asked for; otherwise the start is refused with the difference,
 *    and only --recreate replaces it.  A live owner is never replaced: a
 *    second kvtierd on the name is refused with the first one's pid.
 *  * Threads.  The main thread owns the client handle (reaping,
 *    draining, signals through a signalfd); the HTTP side (http.c: a
 *    front thread that admits whole requests, libmicrohttpd's threads
 *    behind it) answers from an observer handle of its own (no table
 *    entry: a request never changes the segment).  They share the drain
 *    flag (atomic) and the write-only verdicts (a mutex).
 *  * Health: 200 when every expected rank of every expected instance is
 *    attached and alive and the daemon is not draining; else 503 with the
 *    JSON list of what is missing or dead.  /healthcheck/segment is 200 as
 *    soon as the segment is up and accepting attaches: what a launcher
 *    waits for before it starts the workers (whose attaches make
 *    /healthcheck 200).  With systemd, Type=notify: READY=1 is sent at
 *    that same point.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <linux/magic.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/statfs.h>
#include <sys/un.h>
#ifdef KVTIER_HAVE_NUMA
#include <numaif.h>
#endif

#include "kvt_clock.h"
#include "kvtier.h"
#include "kvt_core.h"
#include "kvt_numa.h"
#include "kvt_size.h"
#include "kvt_tier_int.h"
#include "kvt_config.h"
#include "kvt_disk.h"
#ifdef KVTIERD_L3
#include "kvt_l3e.h"
#include "kvt_l3_srv.h"
#endif
#include "http.h"
#ifdef KVTIERD_LMC
#include "lmc.h"
#endif
#include "options.h"
#include "snap.h"

#ifndef KVTIER_VERSION
#define KVTIER_VERSION "0"
#endif
#define MAX_HISTORY 1200


static struct {
	FILE *log;
	const char *log_path;
	kvt_tier *tier;
	kvt_seg *seg;            /* the tier's; main thread */
	kvt_seg *obs;            /* observer; HTTP thread */
	kvt_disk *disk;          /* the disk tier's engine; main thread */
#ifdef KVTIERD_L3
	kvt_l3e *l3;             /* the L3 tier's engine; main thread */
	kvt_l3srv *l3srv;        /* lookups' asks for L3 chunks; main thread */
#endif
	kvt_wsrv *wsrv;          /* the exit witness's holds; main thread */
#ifdef KVTIERD_LMC
	lmc_front *lmc;          /* the LMCache front end; its own thread */
#endif
	kvtd_http *http;
	struct kvtd_pages pages; /* what the HTTP side reads */
	struct kvtd_ctx ctx;
	int exit_code;           /* segment_start's verdict, when not 1 */
	pthread_mutex_t mu;      /* write_only: KVTD_V_* bits */
	uint32_t write_only[KVT_MAX_INSTANCES];
	atomic_int draining;
	char model[KVT_MODEL_TEXT_MAX];
	char name[80];
	char dir[PATH_MAX];
} D = { .mu = PTHREAD_MUTEX_INITIALIZER };

/* ---- logging ---- */

static void logf_(const char *level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void logf_(const char *level, const char *fmt, ...)
{
	char ts[40];
	struct timespec now;
	struct tm tm;
	va_list ap;
	FILE *f = D.log ? D.log : stderr;

	clock_gettime(CLOCK_REALTIME, &now);
	gmtime_r(&now.tv_sec, &tm);
	strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%S", &tm);
	fprintf(f, "%s.%03ldZ kvtierd[%d] %s: ", ts, now.tv_nsec / 1000000, (int)getpid(), level);
	va_start(ap, fmt);
	vfprintf(f, fmt, ap);
	va_end(ap);
	fputc('\n', f);
	fflush(f);
}
#define LOG_INFO(...) logf_("info", __VA_ARGS__)
#define LOG_WARN(...) logf_("warning", __VA_ARGS__)
#define LOG_ERR(...)  logf_("error", __VA_ARGS__)

/* The log file takes stderr too, so the library's own messages (placement,
 * huge pages) land in it.  Called at start and on SIGHUP (logrotate). */
static int log_open(void)
{
	if (!D.log_path)
		return 0;
	int fd = open(D.log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
	if (fd < 0) {
		LOG_ERR("--log %s: %s", D.log_path, strerror(errno));
		return -errno;
	}
	if (dup2(fd, STDERR_FILENO) < 0) {
		int e = errno;
		close(fd);
		return -e;
	}
	close(fd);
	if (D.log != stderr) { /* the first open, before any thread: a reopen
				 * (SIGHUP) changes what the HTTP threads read */
		D.log = stderr;
		setvbuf(stderr, NULL, _IOLBF, 0);
	}
	return 0;
}

/* ---- a truncated segment ----
 *
 * Any process of the service's uid can truncate the segment file under
 * its mappings (`truncate`, a tool that "cleans" /dev/shm); every access
 * past the new end then raises SIGBUS, which killed the daemon silently
 * (exit 135) and with it its clients' view.  What the kernel offers
 * against it, and why it is not more:
 *   - seals (F_SEAL_SHRINK) exist only for memfd files; a named tmpfs or
 *     hugetlbfs file carries F_SEAL_SEAL from birth, so a segment that
 *     engines find by name cannot be sealed (a memfd would have to be
 *     passed to every engine over a socket: another design);
 *   - no mapping flag (MAP_POPULATE, mlock, MAP_LOCKED) keeps truncated
 *     pages: truncation unmaps them from every mapping;
 *   - mode 0600 and the uid checks (SECURITY.md) keep other users out, not
 *     the service's own uid.
 * So the daemon defends what it can: its loop checks the file's size every
 * reap tick and, when it shrank, logs it and exits 4 without touching the
 * segment again (an exit, not a drain: every further access may fault);
 * a SIGBUS inside a segment mapping before that check sees it (any
 * thread) writes the same message and exits 4 too.  A SIGBUS elsewhere
 * keeps its default action.  Engines attached to a truncated segment fault
 * as well: the library installs no signal handler in a host process. */
#define EXIT_TRUNCATED 4
/* A segment of another layout or model is at the name and --recreate was
 * not given: a restart cannot help (the unit's RestartPreventExitStatus). */
#define EXIT_INCOMPATIBLE 6
static struct {
	uintptr_t lo[2], hi[2];
	char msg[512];
	size_t len;
	uint64_t size;
	int fd;
} G = { .fd = -1 };

static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
	uintptr_t a = (uintptr_t)si->si_addr;

	(void)uc;
	for (int i = 0; i < 2; i++)
		if (a >= G.lo[i] && a < G.hi[i]) {
			ssize_t w = write(STDERR_FILENO, G.msg, G.len);
			(void)w;
			_exit(EXIT_TRUNCATED);
		}
	/* not the segment's: the default action when the access is retried */
	signal(sig, SIG_DFL);
}

static void guard_install(kvt_seg *a, kvt_seg *b)
{
	static uint8_t alt[65536];
	stack_t ss = { .ss_sp = alt, .ss_size = sizeof(alt) };
	struct sigaction sa;

	G.lo[0] = (uintptr_t)kvt_seg_base(a);
	G.hi[0] = G.lo[0] + kvt_seg_size(a);
	G.lo[1] = (uintptr_t)kvt_seg_base(b);
	G.hi[1] = G.lo[1] + kvt_seg_size(b);
	G.size = kvt_seg_size(a);
	G.fd = kvt_seg_lock_fd(a);
	G.len = (size_t)snprintf(G.msg, sizeof(G.msg),
				 "kvtierd[%d] error: segment '%s': its file was truncated under "
				 "the daemon (by a process of this uid: truncate, a /dev/shm "
				 "cleaner); exiting %d without touching it again. Engines "
				 "attached to it fault too: stop them, remove the segment and "
				 "start kvtierd again\n", (int)getpid(), D.name, EXIT_TRUNCATED);
	if (G.len >= sizeof(G.msg))
		G.len = sizeof(G.msg) - 1;
	(void)sigaltstack(&ss, NULL);
	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = on_sigbus;
	sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
	sigemptyset(&sa.sa_mask);
	(void)sigaction(SIGBUS, &sa, NULL);
}

/* The loop's check: the file shorter than the mapping -> exit 4 now. */
static void guard_check(void)
{
	struct stat st;

	if (G.fd < 0 || fstat(G.fd, &st) != 0 || (uint64_t)st.st_size >= G.size)
		return;
	LOG_ERR("segment '%s': its file is %lld bytes, the segment %llu: it was truncated "
		"under the daemon (by a process of this uid: truncate, a /dev/shm cleaner); "
		"exiting %d without touching it again. Engines attached to it fault too: "
		"stop them, remove the segment and start kvtierd again", D.name,
		(long long)st.st_size, (unsigned long long)G.size, EXIT_TRUNCATED);
	_exit(EXIT_TRUNCATED);
}

/* ---- layout ---- */

/* --model-config: the groups, world and capacity from the sizing rules. */
static int layout_from_model(struct opts *o)
{
	struct kvt_model m;
	struct kvt_size_req rq;
	struct kvt_size_plan p;
	uint32_t dt = KVT_DTYPE_AUTO;
	int r;

	r = kvt_model_load(o->model_config, &m);
	if (r) {
		fprintf(stderr, "kvtierd: --model-config %s: %s\n", o->model_config,
			kvt_numa_last_error());
		return r;
	}
	if (o->kv_dtype && kvt_dtype_parse(o->kv_dtype, &dt)) {
		fprintf(stderr, "kvtierd: --kv-dtype: %s\n", kvt_numa_last_error());
		return -EINVAL;
	}
	if (m.dsv4) {
		/* kvtier.vllm's groups follow the KV cache groups vLLM's
		 * allocator forms (their split and order are vLLM's): the
		 * connector logs the flags that make its segment */
		fprintf(stderr, "kvtierd: --model-config %s: DeepSeek V4's layout is the KV "
			"cache groups vLLM forms; start kvtierd with the --group flags the "
			"connector logs (\"the same segment from kvtierd\", rank 0), with "
			"--model-config for the identity; kvtier-size sizes it\n",
			o->model_config);
		return -ENOTSUP;
	}
	memset(&rq, 0, sizeof(rq));
	rq.size = sizeof(rq);
	rq.model = &m;
	rq.kv_dtype = dt;
	rq.tp = o->tp ? o->tp : 1;
	rq.pp = o->pp ? o->pp : 1;
	rq.chunk_tokens = o->chunk_tokens ? o->chunk_tokens : o->vllm_block ? o->vllm_block : 256;
	if (o->vllm_block && rq.chunk_tokens % o->vllm_block) {
		fprintf(stderr, "kvtierd: --chunk-tokens %u is not a multiple of --vllm-block-size %u\n",
			rq.chunk_tokens, o->vllm_block);
		return -EINVAL;
	}
	rq.layout = o->replicated ? KVT_SIZE_REPLICATED : KVT_SIZE_LAYOUT_AUTO;
	rq.tier_bytes = o->tier_bytes;
	rq.tokens = o->tokens;
	if (!o->tier_bytes && !o->tokens && !o->slots) {
		/* as strictly as kvt_open reads it (tier/config.c), named */
		const char *g = getenv("KVTIER_TIER_GIB");
		char gerr[160];
		rq.tier_bytes = 1ULL << 30;
		if (g && kvt_parse_gib("KVTIER_TIER_GIB", g, &rq.tier_bytes, gerr, sizeof(gerr))) {
			fprintf(stderr, "kvtierd: %s\n", gerr);
			return -EINVAL;
		}
	}
	if (o->slots)
		rq.tokens = (uint64_t)o->slots * rq.chunk_tokens;
	r = kvt_size_compute(&rq, &p);
	if (r) {
		fprintf(stderr, "kvtierd: sizing %s: %s\n", o->model_config, kvt_numa_last_error());
		return r;
	}
	if (o->world && o->world != p.world) {
		fprintf(stderr, "kvtierd: --world %u, but --tp x --pp is %u\n", o->world, p.world);
		return -EINVAL;
	}
	o->world = p.world;
	o->chunk_tokens = p.chunk_tokens;
	o->n_groups = p.n_groups;
	for (uint32_t i = 0; i < p.n_groups; i++) {
		o->groups[i].n_layers = p.groups[i].layers;
		o->groups[i].bytes_per_token = p.groups[i].bytes_per_token;
		if (o->vllm_block) {
			/* kvtier.vllm registers each layer's block as its two
			 * halves (the one form every backend's tensors fit): the
			 * same bytes, described as twice the layers of half the
			 * bytes -- so the fingerprints agree */
			if (p.groups[i].bytes_per_token % 2) {
				fprintf(stderr, "kvtierd: --vllm-block-size: %u bytes per token do not "
					"split in halves\n", p.groups[i].bytes_per_token);
				return -EINVAL;
			}
			o->groups[i].n_layers = 2 * p.groups[i].layers;
			o->groups[i].bytes_per_token = p.groups[i].bytes_per_token / 2;
		}
	}
	o->replicated = p.layout == KVT_SIZE_REPLICATED;
	if (p.n_slots > (1u << 30)) {
		fprintf(stderr, "kvtierd: the plan has %llu chunks; a segment holds at most 2^30\n",
			(unsigned long long)p.n_slots);
		return -EINVAL;
	}
	o->slots = (uint32_t)p.n_slots;
	o->tier_bytes = 0;
	o->tokens = 0;
	LOG_INFO("sized from %s (%s): %u layers in %u group(s), %llu bytes per token per rank, "
		 "%s layout, world %u, %llu chunks = %llu tokens", o->model_config, m.arch,
		 m.layers, p.n_groups, (unsigned long long)p.token_bytes_rank,
		 o->replicated ? "replicated" : "sharded", p.world, (unsigned long long)p.n_slots,
		 (unsigned long long)p.tokens);
	return 0;
}

/* --model-config: the model identity's file fields (kvt_model_files_id,
 * the call the vLLM connector makes on the config.json vLLM read) after
 * --model's text, so that the daemon's segment and the engines' agree on
 * the model by its files.  A --model that has them already (copied whole
 * from an engine's log) must have these. */
static int model_identity(struct opts *o)
{
	static char id[1024];
	char files[256];
	const char *base = o->model ? o->model : getenv("KVTIER_MODEL");
	int r = kvt_model_files_id(o->model_config, files, sizeof(files));
	size_t bl, fl;

	if (r < 0) {
		fprintf(stderr, "kvtierd: --model-config: %s\n", kvt_last_error());
		return r;
	}
	base = base ? base : "";
	bl = strlen(base);
	fl = strlen(files);
	if (strstr(base, ";config=") || strstr(base, ";weights=") || strstr(base, ";rev=")) {
		if (bl < fl + 1 || base[bl - fl - 1] != ';' || strcmp(base + bl - fl, files)) {
			fprintf(stderr, "kvtierd: --model '%s' names other model files than "
				"--model-config %s ('%s')\n", base, o->model_config, files);
			return -EINVAL;
		}
		o->model = base;
		return 0;
	}
	if (bl + 1 + fl >= sizeof(id)) {
		fprintf(stderr, "kvtierd: --model and the model files' fields exceed %zu bytes\n",
			sizeof(id) - 1);
		return -EINVAL;
	}
	snprintf(id, sizeof(id), "%s;%s", base, files);
	o->model = id;
	return 0;
}

/* The library's own lines (placement, huge pages, the prefault's
 * progress) as the daemon's: timestamped, with their level. */
static void lib_log(void *arg, int level, const char *msg)
{
	(void)arg;
	logf_(level <= KVT_LOG_LEVEL_ERROR ? "error" : level == KVT_LOG_LEVEL_WARN ? "warning" :
	      "info", "kvtier: %s", msg);
}

static void config_fill(const struct opts *o, struct kvt_config *c, uint32_t flags)
{
	static struct kvt_group_desc groups[8];

	memset(c, 0, sizeof(*c));
	c->size = sizeof(*c);
	c->log = lib_log;
	c->flags = flags | (o->group ? KVT_F_GROUP : 0);
	c->role = KVT_TIER_CLIENT;
	c->instance = -1;
	c->rank = -1;
	c->world = o->world;
	c->chunk_tokens = o->chunk_tokens;
	c->segment = o->segment;
	c->segment_dir = o->segment_dir;
	c->model = o->model;
	c->n_instances = o->instances;
	c->n_slots = o->slots;
	c->tier_bytes = o->tier_bytes;
	if (flags & KVT_F_CREATE)
		c->disk_chunks = o->disk_chunks;
	c->n_groups = o->n_groups;
	for (uint32_t i = 0; i < o->n_groups; i++) {
		groups[i] = o->groups[i];
		groups[i].replicated = (uint32_t)o->replicated;
		groups[i].tokens_per_block = 1; /* not part of the segment: any divisor */
	}
	c->groups = groups;
}

/* ---- creation or warm attach ---- */

static uint64_t wall_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* The geometry's layout part, as kvt_open derives it from the options. */
static void layout_geometry(const struct opts *o, const struct kvt_tier_env *env,
			    struct kvt_geometry *gp)
{
	struct kvt_geometry g;

	memset(&g, 0, sizeof(g));
	g.chunk_tokens = env->chunk_tokens;
	g.world = env->world;
	g.n_instances = 1;
	g.n_groups = o->n_groups;
	g.mode = o->replicated ? KVT_MODE_REPLICATED : KVT_MODE_SHARDED;
	for (uint32_t i = 0; i < o->n_groups; i++) {
		g.groups[i].layers = o->groups[i].n_layers;
		g.groups[i].bytes_per_token = o->groups[i].bytes_per_token;
	}
	*gp = g;
}

/* Slots the options ask for, as kvt_open derives them (tier bytes over
 * one chunk of every shard). */
static uint64_t wanted_slots(const struct opts *o, const struct kvt_tier_env *env)
{
	struct kvt_geometry g;

	if (o->slots)
		return o->slots;
	layout_geometry(o, env, &g);
	uint64_t per = kvt_geometry_shard_bytes(&g) * (o->replicated ? 1 : env->world);
	return per ? env->tier_bytes / per : 0;
}

/* The disk file's chunks: the disk index the segment needs. */
static int disk_plan(struct opts *o, const struct kvt_tier_env *env)
{
	struct kvt_geometry g;
	char err[512];

	layout_geometry(o, env, &g);
	int r = kvt_disk_plan(o->disk_path, o->disk_bytes,
			      kvt_geometry_shard_bytes(&g), o->replicated ? 1 : env->world,
			      &o->disk_chunks, err, sizeof(err));
	if (r)
		LOG_ERR("%s", err);
	return r;
}

static void disk_log(int level, const char *msg, void *arg)
{
	(void)arg;
	if (level)
		LOG_WARN("disk tier: %s", msg);
	else
		LOG_INFO("disk tier: %s", msg);
}

#ifdef KVTIERD_L3
static void l3_log(int level, const char *msg, void *arg)
{
	(void)arg;
	if (level)
		LOG_WARN("l3: %s", msg);
	else
		LOG_INFO("l3: %s", msg);
}

/* One round of the L3 engine, its figures copied for the HTTP side, and a
 * line when the store goes down or comes back. */
static int l3_round(void)
{
	struct kvt_l3e_info in;
	struct kvt_l3c_status st;
	int n;

	static uint64_t next_copy;

	if (!D.l3)
		return 0;
	n = kvt_l3srv_service(D.l3srv); /* asks: EXISTS submitted */
	n += kvt_l3e_poll(D.l3);        /* completions: answers gathered */
	kvt_l3srv_flush(D.l3srv);
	/* the figures for the HTTP side: after work, else every 100 ms (the
	 * loop turns every 1-5 ms; the copy takes two locks) */
	if (!n && kvt__now_ns() < next_copy)
		return 0;
	next_copy = kvt__now_ns() + 100000000ull;
	kvt_l3_figures(D.l3, D.l3srv, &st);
	if ((int)st.up != (int)D.ctx.l3.up) {
		kvt_l3e_info(D.l3, &in);
		if (st.up)
			LOG_INFO("l3: the store answers again (%s)", st.describe);
		else
			LOG_WARN("l3: the store does not answer: %s; lookups go on from DRAM and "
				 "disk, the L3 is retried", in.store.last_error);
	}
	pthread_mutex_lock(&D.mu); /* http_ctx copies it under D.mu */
	if (!st.describe[0]) /* the store not reached yet: what it was given */
		memcpy(st.describe, D.ctx.l3.describe, sizeof(st.describe));
	D.ctx.l3 = st;
	pthread_mutex_unlock(&D.mu);
	return n;
}
#endif

static int owned_refusal(const char *name, int pid)
{
	LOG_ERR("segment '%s' is owned by a live kvtierd (pid %d, as its PID namespace numbers "
		"it): one daemon per segment; stop it first", name, pid);
	return -EBUSY;
}

/* ---- the segment's name: squatting ----
 *
 * The segment is `kvtier.<name>` in its directory.  In a directory where
 * other users can create names -- /dev/shm, mode 1777, the default -- any
 * of them can take the name first (a file, a link, a directory, a segment
 * of their own): attaches refuse it (owner rules, SECURITY.md), but the
 * daemon cannot remove it either (the sticky bit), so it could only fail,
 * and under systemd restart and fail again.  The cure is a directory only
 * the service's uid can create names in: the packaged unit uses
 * /dev/shm/kvtier (0750, kvtier:kvtier, made at boot by its tmpfiles.d
 * entry, before any user can log in; engines are given the same
 * KVTIER_SEGMENT_DIR).  There a squat cannot happen, and what is at the
 * name is ours to replace.  So: in a directory open to others kvtierd
 * warns at start and, on a squat, exits 5 (RestartPreventExitStatus in the
 * unit: restarting cannot help) naming the owner and the cure; in a
 * directory of its own, --recreate removes whatever is at the name. */
#define EXIT_SQUATTED 5

/* 1 when users other than this uid (and root) can create names in dir. */
static int dir_open_to_others(const struct stat *st)
{
	if (st->st_mode & S_IWOTH)
		return 1;
	if ((st->st_mode & S_IWGRP) && st->st_gid != getegid())
		return 1;
	return st->st_uid != geteuid() && st->st_uid != 0;
}

static int segment_name_check(const struct opts *o, const struct kvt_tier_env *env)
{
	const char *dir = env->segment_dir[0] ? env->segment_dir : "/dev/shm";
	char path[PATH_MAX + 80];
	struct stat ds, st;

	if (stat(dir, &ds) || !S_ISDIR(ds.st_mode))
		return 0; /* kvt_open says what is wrong with it */
	int open_dir = dir_open_to_others(&ds);
	snprintf(path, sizeof(path), "%s/kvtier.%s", dir, env->segment);
	if (lstat(path, &st)) {
		if (open_dir)
			LOG_WARN("segment directory %s: other users can create names in it (mode "
				 "%04o, owner uid %u), so one could take the name kvtier.%s before a "
				 "restart; run the service with a directory of its own "
				 "(KVTIER_SEGMENT_DIR=/dev/shm/kvtier: README, \"Segment directory\")",
				 dir, (unsigned)(ds.st_mode & 07777), (unsigned)ds.st_uid,
				 env->segment);
		return 0;
	}
	int foreign = st.st_uid != geteuid() || !S_ISREG(st.st_mode);
	if (!foreign)
		return 0;
	const char *what = S_ISLNK(st.st_mode) ? "a symbolic link" : S_ISDIR(st.st_mode) ?
			   "a directory" : S_ISREG(st.st_mode) ? "a file" : "a special file";
	if (open_dir && st.st_uid != geteuid()) {
		LOG_ERR("segment name taken: %s is %s of uid %u, not this service's (uid %u), in "
			"%s, where every user can create names and kvtierd cannot remove it; "
			"remove it as root, and run the service with a segment directory of its "
			"own (KVTIER_SEGMENT_DIR=/dev/shm/kvtier: README, \"Segment directory\"), "
			"where this cannot happen", path, what, (unsigned)st.st_uid,
			(unsigned)geteuid(), dir);
		return EXIT_SQUATTED;
	}
	if (!o->recreate) {
		LOG_ERR("%s is %s%s, not a segment: start with --recreate to remove it", path, what,
			st.st_uid != geteuid() ? " of another uid" : "");
		return 1;
	}
	/* Our directory: whatever is at the name goes. */
	if ((S_ISDIR(st.st_mode) ? rmdir(path) : unlink(path)) && errno != ENOENT) {
		LOG_ERR("--recreate: removing %s (%s): %s", path, what, strerror(errno));
		return 1;
	}
	LOG_WARN("--recreate: removed %s (%s) at the segment's name", path, what);
	return 0;
}

/* Opens what is there with the layout asked (the fingerprint is checked by
 * kvt_open), or creates it.  Sets D.tier. */
static int segment_start(const struct opts *o, const struct kvt_tier_env *env, int *warm)
{
	struct kvt_config c;
	uint64_t want = wanted_slots(o, env);
	int r, tries = 0;

again:
	*warm = 0;
	config_fill(o, &c, 0);
	r = kvt_open(&c, &D.tier);
	if (r == 0) {
		kvt_seg *s = kvt__tier_seg(D.tier);
		const struct kvt_geometry *g = kvt_seg_geometry(s);
		int pid = kvt_seg_owner(s);
		if (pid) {
			kvt_close(D.tier);
			D.tier = NULL;
			return owned_refusal(env->segment, pid);
		}
		char why[200] = "";
		if (g->n_instances != env->n_instances)
			snprintf(why, sizeof(why), "instances: the segment has %u, %u asked",
				 g->n_instances, env->n_instances);
		else if (want && g->n_slots != want)
			snprintf(why, sizeof(why), "capacity: the segment has %u slots, %llu asked",
				 g->n_slots, (unsigned long long)want);
		else if (o->disk_chunks > g->disk_chunks)
			snprintf(why, sizeof(why), "disk tier: the segment's disk index holds %u "
				 "chunks, the disk %llu", g->disk_chunks,
				 (unsigned long long)o->disk_chunks);
		if (!why[0]) {
			*warm = 1;
			return 0;
		}
		kvt_close(D.tier);
		D.tier = NULL;
		if (!o->recreate) {
			LOG_ERR("segment '%s' exists with another geometry (%s); start with "
				"--recreate to replace it (its chunks are lost)", env->segment, why);
			D.exit_code = EXIT_INCOMPATIBLE;
			return -ESTALE;
		}
		LOG_WARN("segment '%s': %s; --recreate: replacing it", env->segment, why);
	} else if (r == -ESTALE || r == -EPROTO || r == -EINVAL) {
		char why[400];
		snprintf(why, sizeof(why), "%s", kvt_last_error());
		if (r == -EINVAL && strstr(why, "KVTIER_")) {
			LOG_ERR("%s", why);
			D.exit_code = 2;
			return r; /* a bad variable, not a bad segment */
		}
		/* Is an owner alive on it?  Ask without the layout. */
		kvt_tier *t;
		memset(&c, 0, sizeof(c));
		c.size = sizeof(c);
		c.role = KVT_TIER_CLIENT;
		c.instance = -1;
		c.rank = -1;
		c.segment = o->segment;
		c.segment_dir = o->segment_dir;
		c.flags = o->group ? KVT_F_GROUP : 0;
		if (kvt_open(&c, &t) == 0) {
			int pid = kvt_seg_owner(kvt__tier_seg(t));
			kvt_close(t);
			if (pid)
				return owned_refusal(env->segment, pid);
		}
		if (!o->recreate) {
			LOG_ERR("segment '%s' is not compatible: %s; start with --recreate to replace "
				"it (its chunks are lost)", env->segment, why);
			D.exit_code = EXIT_INCOMPATIBLE;
			return r;
		}
		LOG_WARN("segment '%s' is not compatible (%s); --recreate: replacing it",
			 env->segment, why);
	} else if (r != -ENOENT) {
		LOG_ERR("segment '%s': %s", env->segment, kvt_last_error());
		return r;
	}
	if (o->recreate) {
		int u = kvt_unlink(env->segment, env->segment_dir[0] ? env->segment_dir : NULL);
		if (u && u != -ENOENT) {
			LOG_ERR("--recreate: removing '%s': %s", env->segment, kvt_last_error());
			return u;
		}
	}
	config_fill(o, &c, KVT_F_CREATE | KVT_F_PREFAULT);
	uint64_t t0 = kvt__now_ns();
	r = kvt_open(&c, &D.tier);
	if (r == -EEXIST && tries++ < 3)
		goto again; /* another daemon created it meanwhile: its owner check decides */
	if (r) {
		LOG_ERR("creating segment '%s': %s", env->segment, kvt_last_error());
		return r;
	}
	LOG_INFO("created segment '%s' in %.2f s", env->segment, (double)(kvt__now_ns() - t0) / 1e9);
	return 0;
}

static void log_plan(const struct kvt_tier_env *env, int warm)
{
	kvt_seg *s = D.seg;
	const struct kvt_geometry *g = kvt_seg_geometry(s);
	const char *dir = kvt__tier_segment_dir(D.tier);
	struct statfs sf;
	struct kvt_occupancy occ;
	uint64_t page = 4096;

	if (dir && statfs(dir, &sf) == 0 && (unsigned long)sf.f_type == HUGETLBFS_MAGIC)
		page = (uint64_t)sf.f_bsize;
	kvt_occupancy_read(s, &occ);
	LOG_INFO("segment '%s' at %s%s%s: %llu bytes, %s pages; world %u x %u instance(s), %s, "
		 "%u tokens/chunk, %u slots of %llu bytes per shard, %u leases; model '%s'%s",
		 env->segment, dir ? dir : "/dev/shm", "/kvtier.", env->segment,
		 (unsigned long long)kvt_seg_size(s),
		 page >= (1ULL << 30) ? "1 GiB" : page >= (2ULL << 20) ? "2 MiB" : "4 KiB",
		 g->world, g->n_instances, g->mode == KVT_MODE_REPLICATED ? "replicated" : "sharded",
		 g->chunk_tokens, g->n_slots, (unsigned long long)kvt_seg_shard_bytes(s), g->n_leases,
		 env->model, warm ? "" : " (new)");
	if (warm)
		LOG_INFO("warm restart: attached the existing segment; %llu READY chunks kept",
			 (unsigned long long)occ.ready);
#ifdef KVTIER_HAVE_NUMA
	for (uint32_t sh = 0; sh < kvt_seg_n_shards(s); sh++) {
		void *p;
		uint64_t len;
		int node = -1;
		if (kvt_seg_arena(s, sh, &p, &len) == 0 &&
		    get_mempolicy(&node, NULL, 0, p, MPOL_F_NODE | MPOL_F_ADDR) == 0)
			LOG_INFO("arena shard %u: %llu bytes, first page on NUMA node %d", sh,
				 (unsigned long long)len, node);
	}
#endif
}

static int lock_arena(const struct opts *o)
{
	void *p;
	uint64_t len;

	if (o->no_lock) {
		LOG_INFO("--no-lock: the arena is not locked in memory");
		return 0;
	}
	if (kvt_seg_arena(D.seg, UINT32_MAX, &p, &len))
		return -EINVAL;
	uint64_t t0 = kvt__now_ns();
	if (mlock(p, len)) {
		int e = errno;
		LOG_ERR("mlock of the arena (%llu bytes): %s (raise RLIMIT_MEMLOCK -- the systemd "
			"unit sets LimitMEMLOCK=infinity -- or start with --no-lock)",
			(unsigned long long)len, strerror(e));
		return -e;
	}
	LOG_INFO("arena locked in memory: %llu bytes in %.2f s", (unsigned long long)len,
		 (double)(kvt__now_ns() - t0) / 1e9);
	return 0;
}

/* ---- systemd notification (Type=notify), without libsystemd ---- */

static void sd_notify_(const char *msg)
{
	const char *path = getenv("NOTIFY_SOCKET");
	struct sockaddr_un sa;
	int fd;

	if (!path || (path[0] != '/' && path[0] != '@') || strlen(path) >= sizeof(sa.sun_path))
		return;
	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	memcpy(sa.sun_path, path, strlen(path));
	if (sa.sun_path[0] == '@')
		sa.sun_path[0] = 0;
	fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return;
	(void)sendto(fd, msg, strlen(msg), MSG_NOSIGNAL, (struct sockaddr *)&sa,
		     (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(path)));
	close(fd);
}

/* While the segment is made (prefaulting a large arena takes minutes) and
 * locked, systemd hears that the start goes on: EXTEND_TIMEOUT_USEC of 60 s
 * every 20 s, with a STATUS= line, so TimeoutStartSec (90 s by default)
 * bounds a start that hangs, not one that works.  The arena's progress
 * (bytes, GiB/s) is in the log, from the library's prefault. */
static struct {
	pthread_t tid;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int on, stop;
	char status[160];
} EXT = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };

static void *extend_main(void *arg)
{
	char msg[256];

	(void)arg;
	pthread_mutex_lock(&EXT.mu);
	while (!EXT.stop) {
		struct timespec until;

		snprintf(msg, sizeof(msg), "EXTEND_TIMEOUT_USEC=60000000\nSTATUS=%s", EXT.status);
		sd_notify_(msg);
		clock_gettime(CLOCK_REALTIME, &until);
		until.tv_sec += 20;
		while (!EXT.stop && pthread_cond_timedwait(&EXT.cv, &EXT.mu, &until) != ETIMEDOUT)
			;
	}
	pthread_mutex_unlock(&EXT.mu);
	return NULL;
}

static void extend_start(const char *status)
{
	if (!getenv("NOTIFY_SOCKET"))
		return;
	snprintf(EXT.status, sizeof(EXT.status), "%s", status);
	EXT.stop = 0;
	EXT.on = pthread_create(&EXT.tid, NULL, extend_main, NULL) == 0;
}

static void extend_stop(void)
{
	if (!EXT.on)
		return;
	pthread_mutex_lock(&EXT.mu);
	EXT.stop = 1;
	pthread_cond_signal(&EXT.cv);
	pthread_mutex_unlock(&EXT.mu);
	pthread_join(EXT.tid, NULL);
	EXT.on = 0;
}

/* ---- the exit witness's holds (core/witness_srv.c) ---- */

static void witness_service(void)
{
	uint32_t held;
	uint64_t ex, byes, refused;

	kvt_wsrv_service(D.wsrv);
	kvt_wsrv_counts(D.wsrv, &held, &ex, &byes, &refused);
	pthread_mutex_lock(&D.mu);
	if (refused > D.ctx.witness_refused)
		LOG_WARN("exit witness: %llu hold request(s) refused (not this segment's "
			 "file, not the sender's pidfd, or more ranks than entries)",
			 (unsigned long long)(refused - D.ctx.witness_refused));
	D.ctx.witness_ranks = held;
	D.ctx.witness_exited = ex;
	D.ctx.witness_byes = byes;
	D.ctx.witness_refused = refused;
	pthread_mutex_unlock(&D.mu);
}

/* ---- HTTP (http.c) ---- */

/* The daemon's view for a page, on the HTTP threads: D.ctx is set before
 * they start, but for the witness's counts, which like the verdicts are
 * under D.mu; the drain flag is atomic. */
static void http_ctx(void *arg, struct kvtd_ctx *x, uint32_t wo[KVT_MAX_INSTANCES])
{
	(void)arg;
	pthread_mutex_lock(&D.mu);
	*x = D.ctx;
	x->draining = atomic_load(&D.draining);
	memcpy(wo, D.write_only, sizeof(D.write_only));
#ifdef KVTIERD_LMC
	if (D.lmc) { /* (set to NULL under D.mu before it stops) */
		struct lmc_counts lc;
		lmc_counts(D.lmc, &lc);
		x->lmc = (struct kvtd_lmc){ lc.requests, lc.refused, lc.registrations, lc.lookups,
					    lc.lookup_hit_chunks, lc.stored_chunks,
					    lc.retrieved_chunks, lc.retrieve_misses, lc.disconnects,
					    lc.clients, lc.sessions, lc.leases };
	}
#endif
	pthread_mutex_unlock(&D.mu);
	x->write_only_window = wo;
}

#ifdef KVTIERD_LMC
static void lmc_log(int level, const char *msg, void *arg)
{
	(void)arg;
	logf_(level <= KVT_LOG_LEVEL_ERROR ? "error" : level == KVT_LOG_LEVEL_WARN ? "warning" :
	      "info", "lmcache: %s", msg);
}
#endif

static void http_log(int level, const char *msg, void *arg)
{
	(void)arg;
	if (level)
		LOG_WARN("%s", msg);
	else
		LOG_INFO("%s", msg);
}

static int http_start(const struct opts *o)
{
	char err[256];

	D.pages = (struct kvtd_pages){ .obs = D.obs, .segment = D.name, .ctx = http_ctx };
	struct kvtd_http_opts h = {
		.size = sizeof(h), .addr = o->http_addr, .port = o->http_port,
		.page = kvtd_pages_render, .page_arg = &D.pages, .log = http_log };
	int r = kvtd_http_start(&h, &D.http, err, sizeof(err));
	if (r) {
		LOG_ERR("HTTP: %s", err);
		return r;
	}
	LOG_INFO("HTTP on http://%s:%u (/healthcheck /healthcheck/segment /metrics /status)",
		 o->http_addr, o->http_port);
	return 0;
}

/* ---- the main loop: reaping, write-only watch, signals ---- */

struct sample {
	uint64_t t;
	struct kvtd_isample in[KVT_MAX_INSTANCES];
};

static struct sample hist[MAX_HISTORY];
static uint32_t hist_n, hist_head;

static void watch_write_only(const struct opts *o)
{
	struct kvtd_snap s;
	uint32_t wo[KVT_MAX_INSTANCES] = { 0 };
	static uint32_t warned[KVT_MAX_INSTANCES];

	if (kvtd_snap_read(D.seg, &s))
		return;
	struct sample *n = &hist[hist_head];
	uint32_t us[KVT_MAX_INSTANCES];
	static uint32_t warned_us[KVT_MAX_INSTANCES];

	n->t = s.mono_ns;
	kvtd_isample(&s, n->in);
	hist_head = (hist_head + 1) % MAX_HISTORY;
	if (hist_n < MAX_HISTORY)
		hist_n++;
	/* the newest sample at least a window old */
	const struct sample *old = NULL;
	uint64_t win = (uint64_t)(o->write_only_window_s * 1e9);
	for (uint32_t k = 1; k <= hist_n; k++) {
		const struct sample *c = &hist[(hist_head + MAX_HISTORY - k) % MAX_HISTORY];
		if (s.mono_ns - c->t >= win) {
			old = c;
			break;
		}
	}
	/* unshared: over the window once there is one (an alarm that clears
	 * when sharing resumes), since creation before */
	kvtd_unshared(&s, old ? old->in : NULL, us);
	for (uint32_t i = 0; i < s.geo.n_instances && i < KVT_MAX_INSTANCES; i++) {
		wo[i] = s.inst[i].write_only;
		if (old && n->in[i].saved > old->in[i].saved &&
		    n->in[i].lookups == old->in[i].lookups)
			wo[i] = 1;
		/* The LMCache front end's ranks load what its own client handle
		 * looked up: no instance's scheduler does, by design */
		if (D.ctx.lmcache_form)
			wo[i] = us[i] = 0;
		if (us[i] && !warned_us[i])
			LOG_WARN("instance %u is unshared: it looked up %llu chunks while the other "
				 "instances saved, and found none of theirs (%llu hits in all): do "
				 "the engines compute the same keys for the same prompts "
				 "(PYTHONHASHSEED, a cache salt, LoRA), and do their prompts overlap?",
				 i, (unsigned long long)s.inst[i].lookup_chunks,
				 (unsigned long long)s.inst[i].hit_chunks);
		else if (!us[i] && warned_us[i])
			LOG_INFO("instance %u shares again (hits on other instances' chunks)", i);
		warned_us[i] = us[i];
		if (wo[i] && !warned[i])
			LOG_WARN("instance %u is write-only: its ranks saved %llu chunk shards and its "
				 "scheduler made %llu lookups%s; nothing saved is read back (is its "
				 "scheduler opened on segment '%s' as instance %u?)", i,
				 (unsigned long long)s.inst[i].saved_chunks,
				 (unsigned long long)s.inst[i].lookups,
				 old && s.inst[i].lookups ? " (none in the window)" : "", D.name, i);
		else if (!wo[i] && warned[i])
			LOG_INFO("instance %u is read again (lookups resumed)", i);
		warned[i] = wo[i];
		wo[i] = (wo[i] ? KVTD_V_WRITE_ONLY : 0) | (us[i] ? KVTD_V_UNSHARED : 0);
	}
	pthread_mutex_lock(&D.mu);
	memcpy(D.write_only, wo, sizeof(wo));
	pthread_mutex_unlock(&D.mu);
	kvtd_snap_free(&s);
}

/* Who an entry is, for a log line: "rank 2 of instance 0", "scheduler of
 * instance 0", "client entry 40". */
static const char *who(char *b, size_t n, uint32_t e, uint32_t role, uint32_t inst,
		       uint32_t rank)
{
	if (role == KVT_ROLE_RANK)
		snprintf(b, n, "rank %u of instance %u", rank, inst);
	else if (role == KVT_ROLE_SCHEDULER)
		snprintf(b, n, "scheduler of instance %u", inst);
	else
		snprintf(b, n, "client entry %u", e);
	return b;
}

/* The entries as the last look saw them: attaches and leavings are logged
 * once, each as what it was (a detach, an exit that left nothing, a death
 * repaired). */
static struct went {
	uint64_t gen;
	uint32_t state;
	int pid;
} *W;
static uint32_t W_n;

static void reaped_cb(void *arg, const struct kvt_reaped *r)
{
	char b[64];

	(void)arg;
	who(b, sizeof(b), r->entry, r->role, r->instance, r->rank);
	if (!r->in_op && !r->slots && !r->leases)
		LOG_INFO("%s (pid %d) exited without detaching; it held nothing, nothing to "
			 "repair", b, r->pid);
	else
		LOG_WARN("%s (pid %d) died: repaired %s%u slot(s) it was writing or evicting, "
			 "released %u lease(s)", b, r->pid,
			 r->in_op ? "the pin it was changing, " : "", r->slots, r->leases);
	if (r->entry < W_n)
		W[r->entry].state = KVT_ENTRY_EMPTY; /* logged here, not by watch_entries */
}

static void watch_entries(void)
{
	uint32_t n = kvt_seg_n_entries(D.seg);
	struct kvt_entry_info in;
	char b[64];

	if (!W) {
		W = calloc(n, sizeof(*W)); /* all EMPTY (0): the first look logs who is on */
		if (!W)
			return;
		W_n = n;
	}
	for (uint32_t e = 0; e < n && e < W_n; e++) {
		if (e == kvt_seg_entry(D.seg) || kvt_seg_entry_info(D.seg, e, &in) ||
		    in.state == KVT_ENTRY_DEAD)
			continue; /* a dead one: reap_once logs it */
		int live = in.state != KVT_ENTRY_EMPTY;
		int was = W[e].state != KVT_ENTRY_EMPTY;
		if (was && (!live || in.attach_gen != W[e].gen)) {
			who(b, sizeof(b), e, in.role, in.instance, in.rank);
			if (in.attach_gen != W[e].gen)
				LOG_INFO("%s (pid %d) left; pid %d holds it now", b, W[e].pid, in.pid);
			else if (in.left == KVT_LEFT_DETACHED)
				LOG_INFO("%s (pid %d) detached", b, W[e].pid);
			else if (in.left == KVT_LEFT_REAPED)
				LOG_INFO("%s (pid %d) exited without detaching; another process "
					 "reaped it, nothing to repair", b, W[e].pid);
			else if (in.left == KVT_LEFT_REPAIRED)
				LOG_WARN("%s (pid %d) died; another process repaired what it left",
					 b, W[e].pid);
			else
				LOG_INFO("%s (pid %d) left", b, W[e].pid);
		}
		if (live && (!was || in.attach_gen != W[e].gen)) {
			who(b, sizeof(b), e, in.role, in.instance, in.rank);
			LOG_INFO("%s attached (pid %d)", b, in.pid);
		}
		W[e].state = in.state;
		W[e].gen = in.attach_gen;
		W[e].pid = in.pid;
	}
}

static void reap_once(void)
{
	int r = kvt_seg_reap_report(D.seg, reaped_cb, NULL);
	if (r < 0)
		LOG_ERR("reap: %s", kvt_core_last_error());
	watch_entries();
}

static int drain(const struct opts *o, int sfd)
{
	struct kvt_occupancy occ;
	uint64_t deadline = kvt__now_ns() + (uint64_t)(o->drain_timeout_s * 1e9);

	atomic_store(&D.draining, 1);
	kvt_seg_drain(D.seg, 1);
	kvt_occupancy_read(D.seg, &occ);
	LOG_INFO("draining: new attaches refused; %llu live lease(s), waiting up to %.0f s",
		 (unsigned long long)occ.leases_live, o->drain_timeout_s);
	for (;;) {
		reap_once();
		kvt_occupancy_read(D.seg, &occ);
		if (!occ.leases_live) {
			LOG_INFO("drained: no live lease");
			return 0;
		}
		if (kvt__now_ns() >= deadline) {
			LOG_WARN("drain timeout: %llu lease(s) still live; exiting anyway (their "
				 "holders keep them)", (unsigned long long)occ.leases_live);
			return 1;
		}
		struct pollfd p = { .fd = sfd, .events = POLLIN };
		if (D.disk)
			kvt_disk_poll(D.disk); /* promotions for the leases still live */
		if (poll(&p, 1, D.disk ? 5 : 50) > 0) {
			struct signalfd_siginfo si;
			if (read(sfd, &si, sizeof(si)) == sizeof(si) && si.ssi_signo == SIGINT) {
				LOG_WARN("second interrupt: exiting without waiting");
				return 1;
			}
		}
	}
}

int main(int argc, char **argv)
{
	struct opts o;
	struct kvt_tier_env env;
	struct kvt_config c;
	char err[512];
	sigset_t set;
	int warm, r, sfd;

	if (kvtd_opts_parse(&o, argc, argv)) {
		fprintf(stderr, "kvtierd: see kvtierd --help\n");
		return 2;
	}
	D.log_path = o.log_path;
	if (log_open())
		return 1;
	/* Settings kvt_open takes from the environment only. */
	if (o.numa_nodes)
		setenv("KVTIER_NUMA_NODES", o.numa_nodes, 1);
	if (o.hugepages)
		setenv("KVTIER_HUGEPAGES", o.hugepages, 1);
	if (!getenv("KVTIER_LOG_LEVEL"))
		setenv("KVTIER_LOG_LEVEL", "info", 1); /* the library's placement lines */
	if (o.model_config && !o.n_groups && layout_from_model(&o))
		return 2;
	if (o.model_config && model_identity(&o))
		return 2;
	config_fill(&o, &c, KVT_F_CREATE);
	r = kvt_tier_env_resolve(&c, &env, err, sizeof(err));
	if (r) {
		LOG_ERR("%s", err);
		return 2;
	}
	if (!env.world) {
		LOG_ERR("the world size is needed: --world N (or KVTIER_WORLD, or --tp with "
			"--model-config)");
		return 2;
	}
	snprintf(D.name, sizeof(D.name), "%s", env.segment);
	snprintf(D.model, sizeof(D.model), "%s", env.model);
	if (o.disk_path && disk_plan(&o, &env))
		return 2;

	/* Signals go to the signalfd; blocked before any thread starts so
	 * the HTTP threads inherit the mask. */
	sigemptyset(&set);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGHUP);
	sigaddset(&set, SIGPIPE);
	pthread_sigmask(SIG_BLOCK, &set, NULL);
	sfd = signalfd(-1, &set, SFD_CLOEXEC);
	if (sfd < 0) {
		LOG_ERR("signalfd: %s", strerror(errno));
		return 1;
	}

	r = segment_name_check(&o, &env);
	if (r)
		return r;
	{
		char st[160];
		snprintf(st, sizeof(st), "making segment '%.64s' (the arena is faulted in: "
			 "progress in the log)", env.segment);
		extend_start(st);
	}
	r = segment_start(&o, &env, &warm);
	if (r) {
		extend_stop();
		kvt_close(D.tier);
		return r == -EBUSY ? 3 : D.exit_code ? D.exit_code : 1;
	}
	D.seg = kvt__tier_seg(D.tier);
	/* a killed predecessor stays the owner until its last disk read
	 * landed (kvt_seg_lock_fd): wait for that, not for a live one */
	r = kvt_seg_own_wait(D.seg, 30000);
	if (r) {
		LOG_ERR("%s", kvt_core_last_error());
		kvt_close(D.tier);
		return 3;
	}
	if (kvt__tier_segment_dir(D.tier))
		snprintf(D.dir, sizeof(D.dir), "%s", kvt__tier_segment_dir(D.tier));
	log_plan(&env, warm);
	r = lock_arena(&o);
	extend_stop();
	if (r) {
		kvt_close(D.tier);
		return 1;
	}
	if (o.disk_path) {
		struct kvt_disk_opts dop = {
			.size = sizeof(dop), .path = o.disk_path, .bytes = o.disk_bytes,
			.direct = o.disk_direct, .admit = o.disk_admit, .depth = o.disk_depth,
			.reset = (uint32_t)o.disk_reset, .log = disk_log,
			.key_path = o.disk_key };
		r = kvt_disk_open(D.seg, &dop, &D.disk, err, sizeof(err));
		if (r) {
			LOG_ERR("%s", err);
			kvt_close(D.tier);
			return 1;
		}
	}
	if (o.l3_url) {
#ifdef KVTIERD_L3
		struct kvt_l3e_opts lo = {
			.size = sizeof(lo), .key_path = o.l3_key, .create_key = 1,
			.admit = o.l3_admit, .negative_ms = o.l3_negative_ms, .log = l3_log,
			.encrypt = (uint32_t)o.l3_encrypt };
		struct kvt_l3e_info in;
		lo.store = (struct kvt_l3_conf){ .size = sizeof(lo.store), .url = o.l3_url,
						 .auth_file = o.l3_auth, .python = o.l3_python,
						 .timeout_ms = o.l3_timeout_ms, .log = l3_log };
		r = kvt_l3e_open(D.seg, &lo, &D.l3, err, sizeof(err));
		if (r) {
			LOG_ERR("l3 %s: %s", o.l3_url, err);
			if (D.disk)
				kvt_disk_close(D.disk);
			kvt_close(D.tier);
			return 1;
		}
		kvt_l3e_info(D.l3, &in);
		kvt_l3_figures(D.l3, NULL, &D.ctx.l3);
		D.ctx.l3_on = 1;
		/* not fatal, as the witness's: the puts go on, the lookups of
		 * this node just never ask (a name squatted in a shared
		 * directory: SECURITY.md, "The segment's name") */
		if (kvt_l3srv_open(D.seg, D.l3, &D.l3srv, err, sizeof(err)))
			LOG_WARN("l3: the lookups' channel: %s; this node puts into the L3 but its "
				 "lookups do not get from it", err);
		else
			LOG_INFO("l3: lookups ask at %s", kvt_l3srv_path(D.l3srv));
		if (in.key_created)
			LOG_WARN("l3: made a new fleet key at %s: copy this file to every other "
				 "node (a node with another key refuses these objects, and its "
				 "own are refused here)", o.l3_key);
		char how[96] = "objects authenticated, in the clear";
		if (o.l3_encrypt)
			snprintf(how, sizeof(how), "objects encrypted (staging %llu MiB)",
				 (unsigned long long)(in.stage_bytes >> 20));
		if (in.store.up)
			LOG_INFO("l3 tier: %s, admission %s, fleet key %s, %s", in.store.describe,
				 kvt_disk_admit_name(o.l3_admit), o.l3_key, how);
		else
			LOG_WARN("l3 tier: %s does not answer yet (%s); starting without it, it is "
				 "retried", o.l3_url, in.store.last_error);
#else
		LOG_ERR("--l3 %s: kvtierd was built without the L3 tier (liburing-dev, "
			"libhiredis-dev)", o.l3_url);
		kvt_close(D.tier);
		return 1;
#endif
	}
	{
		struct kvt_seg_attach_opts a = {
			.size = sizeof(a), .name = D.name, .dir = D.dir[0] ? D.dir : NULL,
			.role = KVT_ROLE_OBSERVER, .flags = o.group ? KVT_SEG_F_GROUP : 0 };
		r = kvt_seg_attach(&a, &D.obs);
		if (r) {
			LOG_ERR("observer handle: %s", kvt_core_last_error());
#ifdef KVTIERD_L3
			kvt_l3srv_close(D.l3srv); /* its socket file with it */
			kvt_l3e_close(D.l3);
#endif
			kvt_close(D.tier);
			return 1;
		}
	}
	const struct kvt_geometry *g = kvt_seg_geometry(D.seg);
	D.ctx.version = KVTIER_VERSION;
	D.ctx.model = D.model;
	D.ctx.expect_instances = o.expect_instances < 0 ? g->n_instances
						       : (uint32_t)o.expect_instances;
	D.ctx.expect_schedulers = (uint32_t)o.expect_schedulers;
	D.ctx.start_wall_ns = wall_ns();
	if (D.ctx.expect_instances > g->n_instances) {
		LOG_ERR("--expect-instances %u: the segment has %u instances",
			D.ctx.expect_instances, g->n_instances);
		return 2;
	}
	/* The exit witness's second holder (core/witness_srv.c): a rank on a
	 * GPU backend hands us its lock description, so that a kill of its
	 * whole cgroup still keeps its claims until it wholly exited.  Not
	 * fatal: without it each rank's own witness holds. */
	r = kvt_wsrv_open(D.seg, kvt_seg_n_entries(D.seg), &D.wsrv);
	if (r)
		LOG_WARN("exit witness: %s; ranks keep their own witnesses, but a kill of a "
			 "rank's whole cgroup is not covered (docs/FAULTS.md)",
			 kvt_core_last_error());
	else
		LOG_INFO("exit witness: holding ranks' locks until they exit, at %s",
			 kvt_wsrv_path(D.wsrv));
	D.ctx.witness_up = D.wsrv != NULL;
#ifdef KVTIERD_LMC
	if (o.lmcache_port) {
		struct lmc_cfg lc = {
			.addr = o.lmcache_host[0] ? o.lmcache_host : "127.0.0.1",
			.port = o.lmcache_port, .segment = D.name, .segment_dir = D.dir,
			.model = D.model, .group = o.group, .log = lmc_log };
		lmc_front *lf = NULL;
		r = lmc_start(&lc, &lf, err, sizeof(err));
		pthread_mutex_lock(&D.mu);
		D.lmc = lf;
		pthread_mutex_unlock(&D.mu);
		if (r) {
			LOG_ERR("--lmcache-port %u: %s", o.lmcache_port, err);
			kvt_seg_detach(D.obs);
			kvt_close(D.tier);
			return 1;
		}
		D.ctx.lmcache_form = 1;
		D.ctx.lmcache_up = 1;
		LOG_INFO("LMCache front end: tcp://%s:%u (%s, lmcache_driven transfers)", lc.addr,
			 lc.port, "LMCache 0.5.6 multiprocess protocol");
	}
#endif
	if (!o.no_http && http_start(&o)) {
		kvt_seg_detach(D.obs);
		kvt_close(D.tier);
		return 1;
	}
	guard_install(D.seg, D.obs);
	LOG_INFO("up: owner of '%s'; /healthcheck wants %u instance(s) x %u rank(s)%s", D.name,
		 D.ctx.expect_instances, g->world, o.expect_schedulers ? " and their schedulers" : "");
	sd_notify_("READY=1\nSTATUS=serving segment");

	uint64_t next_watch = 0, next_reap = 0, last_work = 0;
	int rc = 0;
	for (;;) {
		/* With a disk tier the loop turns every few milliseconds
		 * (promotion requests arrive in the segment, with no wake-up)
		 * and at every I/O completion. */
		struct pollfd p[5] = { { .fd = sfd, .events = POLLIN },
				       { .fd = kvt_wsrv_fd(D.wsrv), .events = POLLIN },
				       { .fd = D.disk ? kvt_disk_event_fd(D.disk) : -1,
					 .events = POLLIN },
				       { .fd = -1, .events = POLLIN },
				       { .fd = -1, .events = POLLIN } };
		int busy = D.disk ? kvt_disk_poll(D.disk) : 0, tiers = D.disk != NULL;
#ifdef KVTIERD_L3
		if (D.l3) {
			p[3].fd = kvt_l3e_event_fd(D.l3);
			p[4].fd = kvt_l3srv_fd(D.l3srv);
			busy += l3_round();
			tiers = 1;
		}
#endif
		if (busy)
			last_work = kvt__now_ns();
		/* 1 ms while a tier below DRAM has had work in the last 100 ms,
		 * 5 ms when it is idle (a first request waits at most that long;
		 * idle, the loop cost 1.4% of a core on the CI VM) */
		int tick = kvt__now_ns() - last_work < 100000000ULL ? 1 : 5;
		int n = poll(p, 5, tiers ? (busy ? 0 : tick) : (int)(o.reap_interval_s * 1000));
		if (n > 0 && p[1].revents)
			witness_service();
		if (n > 0 && (p[0].revents & POLLIN)) {
			struct signalfd_siginfo si;
			if (read(sfd, &si, sizeof(si)) != sizeof(si))
				continue;
			if (si.ssi_signo == SIGHUP) {
				log_open();
				LOG_INFO("SIGHUP: log reopened");
				continue;
			}
			if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
				LOG_INFO("%s: stopping", si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
				sd_notify_("STOPPING=1");
#ifdef KVTIERD_LMC
				/* its copies finish, its leases go: before the drain waits
				 * for leases */
				lmc_front *lf;
				pthread_mutex_lock(&D.mu);
				D.ctx.lmcache_up = 0;
				lf = D.lmc;
				D.lmc = NULL;
				pthread_mutex_unlock(&D.mu);
				lmc_stop(lf);
#endif
				drain(&o, sfd); /* a drain timeout is logged; the exit stays 0 */
				break;
			}
			continue;
		}
		if (kvt__now_ns() < next_reap)
			continue;
		next_reap = kvt__now_ns() + (uint64_t)(o.reap_interval_s * 1e9);
		guard_check();
		reap_once();
		if (kvt__now_ns() >= next_watch) {
			watch_write_only(&o);
			next_watch = kvt__now_ns() + 1000000000ULL;
		}
	}
	kvtd_http_stop(D.http);
#ifdef KVTIERD_LMC
	lmc_stop(D.lmc); /* (after SIGTERM it stopped before the drain) */
	D.lmc = NULL;
#endif
	/* A rank killed but not yet exited loses this hold here (its own
	 * witness may still hold); the drain above let live ranks detach. */
	kvt_wsrv_close(D.wsrv);
	D.wsrv = NULL;
#ifdef KVTIERD_L3
	if (D.l3) {
		kvt_l3srv_close(D.l3srv); /* askers see the end: nothing pending */
		D.l3srv = NULL;
		kvt_l3e_close(D.l3); /* every request completed: claims released */
		D.l3 = NULL;
		LOG_INFO("l3 tier closed");
	}
#endif
	if (D.disk) {
		kvt_disk_close(D.disk); /* its I/O finished, its records written */
		D.disk = NULL;
		LOG_INFO("disk tier closed");
	}
	kvt_seg_detach(D.obs);
	if (o.unlink_at_exit) {
		r = kvt_unlink(D.name, D.dir[0] ? D.dir : NULL);
		if (r)
			LOG_ERR("--unlink '%s': %s", D.name, kvt_last_error());
		else
			LOG_INFO("segment '%s' removed (--unlink)", D.name);
	} else {
		kvt_seg_drain(D.seg, 0);
		LOG_INFO("segment '%s' stays for the next start (warm restart)", D.name);
	}
	kvt_close(D.tier);
	LOG_INFO("stopped");
	return rc;
}
