/* l3_mooncake.c - the L3 tier's Mooncake Store backend, behind kvt_l3.h.
 *
 *   mooncake://MASTER[:PORT][?metadata=URL|P2PHANDSHAKE&protocol=tcp|rdma
 *              &device=DEV[,DEV...]&host=ADDR&segment=SIZE]
 *
 * Where it runs.  Mooncake ships its store client as a Python extension
 * (the mooncake-transfer-engine wheels); the shared library under it
 * exports C++ symbols of no stable ABI and no C API.  Linking kvtierd to
 * them would tie the daemon to one wheel's build, its C++ runtime and its
 * bundled libraries, and put the transfer engine's threads and allocator
 * in the process that owns the segment.  So the client runs in a companion
 * process (l3_mooncake.py, `kvtier-l3-mooncake`) that this backend spawns
 * and drives over a socketpair, one datagram per request, and the bytes
 * do not pass through the channel: the companion maps the arena itself,
 * so a put reads the sub-slot where it lies and a get lands in it
 * (Mooncake's batch_put_from / batch_get_into over three pieces: header,
 * sub-slot, tag; the header and the tag, 80 bytes, through a small buffer
 * both processes map).  Every protocol step stays in kvtierd, as for Redis
 * (kvt_l3e.h): the claims, the life checks, the seal and its check, the
 * publication.  The companion only moves bytes between the arena and the
 * store.
 *
 * What the store's network reaches.  Mooncake's transfer engine serves
 * any peer's READ or WRITE inside a buffer registered with it, with no
 * credential: over TCP its transport publishes every registered buffer in
 * the node's segment descriptor (it ignores register_buffer's
 * remote_accessible=false), over RDMA a region registered for remote
 * access grants the same through its key.  Layout 1 registered the whole
 * arena and the side buffer: any host reaching the companion's transfer
 * port could rewrite every chunk the node's engines load (DRAM hits are
 * not re-checked) and read every prompt's KV.  Now nothing of kvtierd's is
 * registered over TCP -- the transport's own puts and gets read and write
 * unregistered memory as well (its server checks only the addresses peers
 * ask for) -- and over RDMA, where the NIC needs them registered, the
 * companion registers them for local access only, which Mooncake honours
 * from 0.3.13 (kvcache-ai/Mooncake#3151); an older wheel is refused with
 * protocol=rdma.  A staging area (a bounded registered buffer, copied to
 * and from the arena) or a registration per request were the other ways:
 * the first costs a copy per object (a second one on a get: Mooncake's
 * own local path copies once), the second a metadata update per request
 * that peers then see; this one costs nothing -- the same zero-copy path,
 * measured the same (docs/BENCHMARKS.md) -- and exposes less than either:
 * no byte of the arena, not even an in-flight get's sub-slot
 * (tests/daemon/test_l3_mooncake.py, test_l3_mooncake_network_peer: a
 * plain TransferEngine's writes and reads at the arena, READY chunks and a
 * held get's sub-slot, all refused).  What stays reachable is the store's
 * own memory -- the segment= this node gives the store, and Mooncake's
 * local buffer -- which holds objects sealed under the fleet key: a peer
 * that rewrites one causes a miss.  What the master directs: a put reads
 * only the pieces its request names (the object), and a get writes only
 * into its pieces (header and tag in the side slot, the payload in the
 * claimed sub-slot); an object larger than them is refused by Mooncake's
 * client (-EMSGSIZE, tests/l3_mooncake.c).  An encrypted put's payload
 * lies in the engine's staging (kvt_l3_conf.stage), a memfd the companion
 * maps as its third region and registers as it does the arena: never
 * over TCP, local-only over RDMA.
 *
 * What a companion may write, and when.  A get's bytes land in a sub-slot
 * that kvtierd claimed; the claim is released (kvt_write_end) once the
 * request completes here.  So a request completes only when the companion
 * can no longer write into it: when it answered, or when it is dead and
 * reaped (waitpid) -- never on a timeout alone.  A request that has no
 * answer within the deadline (10 x timeout_ms + 5 s) kills the companion
 * (SIGKILL, then waitpid), and only then fails with every other request
 * in flight; the thread starts a new companion after a backoff.  The
 * companion holds the segment's own file description (conf.mem_fd, the
 * handle's liveness token, kvt_seg_lock_fd) through its mapping of the
 * arena, so if kvtierd dies first its entry -- hence its claims -- stays
 * live until the companion too has exited (PR_SET_PDEATHSIG kills it, and
 * a closed channel ends it): the reaper frees nothing a companion can
 * still write.  A TCP transfer's writes are the companion's own recv()s,
 * over before its threads exit.  With RDMA the NIC may still land a write
 * after them, until the verbs device is released in the companion's exit
 * -- which may come after its mapping's hold on the description went
 * (exit_mm precedes exit_files).  So each companion gets an exit witness
 * (core/witness.c, kvt_witness_for: the GPU ranks' mechanism), which
 * holds the description until the companion's pidfd says it has wholly
 * exited; with protocol=rdma a companion without one is not run.
 *
 * Failure is a miss.  Mooncake's codes map to kvt_l3.h's: OBJECT_NOT_FOUND
 * -ENOENT, NO_AVAILABLE_HANDLE (store full) -ENOSPC, a size mismatch
 * -EMSGSIZE, RPC errors (the master away) -ENOTCONN, the rest -EIO; a
 * companion that died or was killed fails its requests -ENOTCONN or
 * -ETIMEDOUT.  Mooncake's own leases (a get's object is kept from
 * eviction for default_kv_lease_ttl) are the store's business: a get that
 * outlives its lease may read an object being replaced, which fails the
 * tag check in kvtierd -- a miss, never a wrong byte.  kvtier never
 * removes objects; the master evicts when its pool fills.
 *
 * Thread safety: the queue, the in-flight table, the done list and the
 * status under `mu`.  The companion (pid, pidfd, socket) belongs to the
 * thread after open.  No shared-memory protocol: the side buffer is
 * written by one side at a time (before the send by us, before the answer
 * by the companion; the socket orders them).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kvt_clock.h"
#include "kvt_l3_int.h"
#include "kvt_log.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>

extern char **environ;

/* ---- the channel (l3_mooncake.py has the same layouts) ---- */

#define MC_MAGIC   0x6b636d6bu /* "kmck" */
#define MC_VERSION 1
enum { MC_HELLO = 1, MC_REQ = 2, MC_DONE = 3 };
#define MC_PIECES  8
#define MC_SIDE    256         /* small-piece bytes per request */
#define MC_DONE_MAX 64
#define MC_PROBE_OP 0          /* a request with no key: is the master there */

struct mc_piece {
	uint64_t off, len;         /* in the region `side` names */
	uint32_t side, pad;        /* MC_IN_* */
};
enum { MC_IN_MEM = 0, MC_IN_SIDE = 1, MC_IN_STAGE = 2 }; /* the arena, the
			    * request's side slot, the engine's staging */

struct mc_req {
	uint32_t magic;
	uint16_t version, kind;
	uint32_t slot, gen;
	uint16_t op, n_pieces;
	uint32_t n_keys;
	struct mc_piece p[MC_PIECES];
	char keys[64][KVT_L3_KEY_MAX];
};

struct mc_done_item {
	uint32_t slot, gen;
	int32_t status;
	uint32_t pad;
	uint64_t got;
};

struct mc_done {
	uint32_t magic;
	uint16_t version, kind;
	uint32_t n, pad;
	struct mc_done_item it[MC_DONE_MAX];
};

struct mc_hello {
	uint32_t magic;
	uint16_t version, kind;
	int32_t status;
	uint32_t pad;
	char text[256];
};

_Static_assert(sizeof(struct mc_piece) == 24, "mc_piece");
_Static_assert(offsetof(struct mc_req, p) == 24, "mc_req header");
_Static_assert(sizeof(struct mc_done_item) == 24, "mc_done_item");
_Static_assert(offsetof(struct mc_done, it) == 16, "mc_done header");
_Static_assert(sizeof(struct mc_hello) == 272, "mc_hello");

/* ---- the backend ---- */

#define BACKOFF_MIN 100
#define BACKOFF_MAX 5000
#define PROBE_NS    1000000000ull

enum { C_NONE = 0, C_STARTING = 1, C_UP = 2 };

struct flight {
	struct kvt_l3_req *q;      /* NULL: free */
	uint32_t gen;
	uint64_t deadline;
	struct mc_piece p[MC_PIECES];
};

struct ml3 {
	struct kvt_l3_conf conf;
	char master[300], metadata[300], device[256], host[300];
	const char *protocol;	/* a literal: "tcp" or "rdma", never a copy of the URL's */
	uint64_t segment;
	char python[PATH_MAX], script[PATH_MAX];
	uint64_t deadline_ns, hello_ns;

	/* the companion: the thread's after open */
	int child;                 /* C_* */
	pid_t pid;
	int pidfd, sock;
	int wpid, wpidfd;          /* its exit witness */
	int witness_said;
	uint64_t started, retry_ns, last_probe;
	uint32_t backoff_ms;
	int probe_out;

	int side_fd;
	uint8_t *side;             /* depth + 1 slots of MC_SIDE */

	pthread_t th;
	int th_live;
	pthread_mutex_t mu;
	struct kvt_l3_list q, d;    /* submitted, not sent yet; done */
	uint32_t flying;
	struct flight *fl;         /* depth + 1: the last is the probe's */
	uint32_t *free_slots, n_free;
	int stop;
	int efd, wake;
	int done_new;              /* completed since the last notify_locked */
	struct kvt_l3_status st;   /* under mu */
};

static void say(struct ml3 *m, int level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void say(struct ml3 *m, int level, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	kvt__vlog(m->conf.log, m->conf.log_arg, "l3", level, fmt, ap);
	va_end(ap);
}

/* under mu */
static void set_error_locked(struct ml3 *m, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
static void set_error_locked(struct ml3 *m, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(m->st.last_error, sizeof(m->st.last_error), fmt, ap);
	va_end(ap);
}

/* under mu */
static void complete_locked(struct ml3 *m, struct kvt_l3_req *q, int status)
{
	q->status = status;
	q->ns = kvt__now_ns() - q->t0;
	if (status && status != -ENOENT)
		m->st.errors++;
	kvt__l3_list_add(&m->d, q);
	m->done_new = 1;
}

/* Makes reap's descriptor readable once for what completed since the last
 * call (under mu), not once per request. */
static void notify_locked(struct ml3 *m)
{
	if (m->done_new)
		(void)!write(m->efd, &(uint64_t){ 1 }, sizeof(uint64_t));
	m->done_new = 0;
}

/* ---- the URL ---- */

static int parse_size(const char *v, uint64_t *out)
{
	char *end;
	unsigned long long n;

	errno = 0;
	n = strtoull(v, &end, 10);
	if (errno || end == v)
		return -1;
	switch (*end) {
	case 'K': case 'k': n <<= 10; end++; break;
	case 'M': case 'm': n <<= 20; end++; break;
	case 'G': case 'g': n <<= 30; end++; break;
	case 'T': case 't': n <<= 40; end++; break;
	default: break;
	}
	if (*end == 'i' && end[-1] != 0)
		end++;
	if (*end == 'B' || *end == 'b')
		end++;
	if (*end)
		return -1;
	*out = n;
	return 0;
}

static int value_ok(const char *v, size_t max)
{
	size_t n = strlen(v);

	if (!n || n >= max)
		return 0;
	for (size_t i = 0; i < n; i++)
		if ((unsigned char)v[i] <= ' ' || v[i] == 0x7f || v[i] == '&')
			return 0;
	return 1;
}

/* mooncake://MASTER[:PORT][?k=v&...]: every field checked, named */
static int url_parse(struct ml3 *m, const char *url, char *err, size_t len)
{
	char buf[1024], *q, *save = NULL;

	if (strncmp(url, "mooncake://", 11) || !url[11] || strlen(url) >= sizeof(buf))
		return snprintf(err, len, "l3 %s: not mooncake://MASTER[:PORT][?metadata=...&"
				"protocol=tcp|rdma&device=...&host=...&segment=SIZE]", url),
		       -EINVAL;
	snprintf(buf, sizeof(buf), "%s", url + 11);
	q = strchr(buf, '?');
	if (q)
		*q++ = 0;
	if (!value_ok(buf, 256) || strchr(buf, '/'))
		return snprintf(err, len, "l3 %s: '%s' is not a master's HOST[:PORT]", url, buf),
		       -EINVAL;
	char *c = strrchr(buf, ':');
	if (c && !strchr(c, ']')) {
		char *end;
		long port = strtol(c + 1, &end, 10);
		if (*end || port <= 0 || port > 65535)
			return snprintf(err, len, "l3 %s: bad master port '%s'", url, c + 1),
			       -EINVAL;
		snprintf(m->master, sizeof(m->master), "%.255s", buf);
	} else {
		snprintf(m->master, sizeof(m->master), "%.255s:50051", buf); /* the master's default */
	}
	snprintf(m->metadata, sizeof(m->metadata), "P2PHANDSHAKE");
	m->protocol = "tcp";
	m->segment = 1ull << 30;
	for (char *t = q ? strtok_r(q, "&", &save) : NULL; t; t = strtok_r(NULL, "&", &save)) {
		char *v = strchr(t, '=');
		if (!v || !value_ok(v + 1, 256))
			return snprintf(err, len, "l3 %s: '%s' is not key=value", url, t), -EINVAL;
		*v++ = 0;
		if (!strcmp(t, "metadata")) {
			snprintf(m->metadata, sizeof(m->metadata), "%s", v);
		} else if (!strcmp(t, "protocol")) {
			const char *p = !strcmp(v, "tcp") ? "tcp" : !strcmp(v, "rdma") ? "rdma" : NULL;
			if (!p)
				return snprintf(err, len, "l3 %s: protocol=%s: tcp or rdma", url, v),
				       -EINVAL;
			m->protocol = p;
		} else if (!strcmp(t, "device")) {
			snprintf(m->device, sizeof(m->device), "%s", v);
		} else if (!strcmp(t, "host")) {
			snprintf(m->host, sizeof(m->host), "%s", v);
		} else if (!strcmp(t, "segment")) {
			if (parse_size(v, &m->segment) || m->segment > (1ull << 46))
				return snprintf(err, len, "l3 %s: segment=%s: a size (0, 512M, 64G)",
						url, v), -EINVAL;
		} else {
			return snprintf(err, len, "l3 %s: unknown parameter '%s' (metadata, "
					"protocol, device, host, segment)", url, t), -EINVAL;
		}
	}
	if (!strcmp(m->protocol, "rdma") && !m->device[0])
		return snprintf(err, len, "l3 %s: protocol=rdma needs device=DEV (an RDMA NIC, "
				"as ibv_devices names it)", url), -EINVAL;
	return 0;
}

/* The companion script: $KVTIER_MOONCAKE_HELPER, beside the executable,
 * in ../libexec/kvtier from it (kvtierd in PREFIX/sbin, wherever PREFIX
 * is), the configured install's libexec, the source tree's. */
static int script_find(struct ml3 *m, char *err, size_t len)
{
	const char *env = getenv("KVTIER_MOONCAKE_HELPER");
	char exe[PATH_MAX], *slash;
	ssize_t n;

	if (env && *env) {
		if (access(env, R_OK))
			return snprintf(err, len, "KVTIER_MOONCAKE_HELPER=%s: %s", env,
					strerror(errno)), -EINVAL;
		snprintf(m->script, sizeof(m->script), "%s", env);
		return 0;
	}
	n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	if (n > 0) {
		exe[n] = 0;
		slash = strrchr(exe, '/');
		static const char *const rel[] = { "kvtier-l3-mooncake",
						   "../libexec/kvtier/kvtier-l3-mooncake" };
		for (size_t i = 0; slash && i < 2; i++) {
			if ((size_t)(slash - exe) + 48 >= sizeof(exe))
				break;
			strcpy(slash + 1, rel[i]);
			if (!access(exe, R_OK)) {
				snprintf(m->script, sizeof(m->script), "%s", exe);
				return 0;
			}
		}
	}
#ifdef KVT_MC_LIBEXEC
	if (!access(KVT_MC_LIBEXEC, R_OK)) {
		snprintf(m->script, sizeof(m->script), "%s", KVT_MC_LIBEXEC);
		return 0;
	}
#endif
#ifdef KVT_MC_SOURCE
	if (!access(KVT_MC_SOURCE, R_OK)) {
		snprintf(m->script, sizeof(m->script), "%s", KVT_MC_SOURCE);
		return 0;
	}
#endif
	return snprintf(err, len, "l3 mooncake: the companion kvtier-l3-mooncake is not "
			"installed beside this program (set KVTIER_MOONCAKE_HELPER)"), -ENOENT;
}

/* ---- the companion ---- */

static int fd_high(int fd)
{
	return fcntl(fd, F_DUPFD_CLOEXEC, 10);
}

/* Starts a companion (C_STARTING): its hello comes on the socket. */
static int child_spawn(struct ml3 *m, char *err, size_t len)
{
	int sv[2] = { -1, -1 }, a = -1, b = -1, c = -1, d = -1, rc;
	char off[32], mlen[32], slen[32], stlen[32], seg[32], ppid[32], tmo[32];
	posix_spawn_file_actions_t fa;
	posix_spawnattr_t at;
	sigset_t none, all;
	/* Mooncake logs a line per request at INFO: warnings and up */
	char *argv[32], *envp[1024], glog[] = "GLOG_minloglevel=1", mclog[] = "MC_LOG_LEVEL=WARNING",
	     unbuf[] = "PYTHONUNBUFFERED=1";
	size_t ne = 0;
	int has_glog = 0, has_mclog = 0;

	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv))
		return snprintf(err, len, "socketpair: %s", strerror(errno)), -errno;
	a = fd_high(sv[1]);
	b = fd_high(m->conf.mem_fd);
	c = fd_high(m->side_fd);
	if (m->conf.stage)
		d = fd_high(m->conf.stage_fd);
	if (a < 0 || b < 0 || c < 0 || (m->conf.stage && d < 0)) {
		rc = -errno;
		snprintf(err, len, "dup: %s", strerror(errno));
		goto out;
	}
	snprintf(off, sizeof(off), "%llu", (unsigned long long)m->conf.mem_off);
	snprintf(mlen, sizeof(mlen), "%llu", (unsigned long long)m->conf.mem_len);
	snprintf(slen, sizeof(slen), "%llu", (unsigned long long)(m->conf.depth + 1) * MC_SIDE);
	snprintf(stlen, sizeof(stlen), "%llu",
		 (unsigned long long)(m->conf.stage ? m->conf.stage_len : 0));
	snprintf(seg, sizeof(seg), "%llu", (unsigned long long)m->segment);
	snprintf(ppid, sizeof(ppid), "%d", (int)getpid());
	snprintf(tmo, sizeof(tmo), "%u", m->conf.timeout_ms);
	size_t i = 0;
	argv[i++] = m->python;
	argv[i++] = m->script;
	argv[i++] = (char *)"--master"; argv[i++] = m->master;
	argv[i++] = (char *)"--metadata"; argv[i++] = m->metadata;
	argv[i++] = (char *)"--protocol"; argv[i++] = (char *)m->protocol;
	argv[i++] = (char *)"--device"; argv[i++] = m->device;
	argv[i++] = (char *)"--host"; argv[i++] = m->host;
	argv[i++] = (char *)"--segment"; argv[i++] = seg;
	argv[i++] = (char *)"--mem-off"; argv[i++] = off;
	argv[i++] = (char *)"--mem-len"; argv[i++] = mlen;
	argv[i++] = (char *)"--side-len"; argv[i++] = slen;
	argv[i++] = (char *)"--stage-len"; argv[i++] = stlen;
	argv[i++] = (char *)"--ppid"; argv[i++] = ppid;
	argv[i++] = (char *)"--timeout-ms"; argv[i++] = tmo;
	argv[i] = NULL;
	for (char **e = environ; e && *e && ne < 1019; e++) {
		has_glog |= !strncmp(*e, "GLOG_minloglevel=", 17);
		has_mclog |= !strncmp(*e, "MC_LOG_LEVEL=", 13);
		envp[ne++] = *e;
	}
	if (!has_glog)
		envp[ne++] = glog;
	if (!has_mclog)
		envp[ne++] = mclog;
	envp[ne++] = unbuf;
	envp[ne] = NULL;

	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, a, 3);
	posix_spawn_file_actions_adddup2(&fa, b, 4);
	posix_spawn_file_actions_adddup2(&fa, c, 5);
	if (d >= 0)
		posix_spawn_file_actions_adddup2(&fa, d, 6);
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	posix_spawnattr_init(&at);
	sigemptyset(&none);
	sigfillset(&all);
	posix_spawnattr_setsigmask(&at, &none);
	posix_spawnattr_setsigdefault(&at, &all);
	posix_spawnattr_setpgroup(&at, 0); /* a terminal's ^C reaches kvtierd, which closes it */
	posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF |
				      POSIX_SPAWN_SETPGROUP);
	rc = -posix_spawnp(&m->pid, m->python, &fa, &at, argv, envp);
	posix_spawn_file_actions_destroy(&fa);
	posix_spawnattr_destroy(&at);
	if (rc) {
		snprintf(err, len, "l3 mooncake: cannot run %s: %s", m->python, strerror(-rc));
		goto out;
	}
	m->pidfd = (int)syscall(SYS_pidfd_open, m->pid, 0);
	m->sock = sv[0];
	sv[0] = -1;
	/* its exit witness: holds the segment's description until the
	 * companion has wholly exited (its verbs device released: an RDMA
	 * write the NIC still lands after its threads died stays inside the
	 * claims' life) -- required with RDMA; over TCP every write is the
	 * companion's own recv(), over before its threads end */
	if (m->pidfd < 0 || kvt_witness_for(m->conf.mem_fd, m->pidfd, "l3-mooncake", &m->wpid,
					    &m->wpidfd)) {
		const char *why = m->pidfd < 0 ? "pidfd_open failed" : kvt_core_last_error();
		m->wpid = m->wpidfd = -1;
		if (!strcmp(m->protocol, "rdma")) {
			snprintf(err, len, "l3 mooncake: no exit witness for the companion (%.200s): "
				 "refused with protocol=rdma", why);
			kill(m->pid, SIGKILL);
			while (waitpid(m->pid, NULL, 0) < 0 && errno == EINTR)
				;
			if (m->pidfd >= 0)
				close(m->pidfd);
			close(m->sock);
			m->pid = -1;
			m->pidfd = m->sock = -1;
			rc = -ENOENT;
			goto out;
		}
		if (!m->witness_said++)
			say(m, 1, "the mooncake companion runs without its exit witness (%.200s); "
				  "over TCP it needs none", why);
	}
	m->child = C_STARTING;
	m->started = kvt__now_ns();
	m->probe_out = 0;
	rc = 0;
out:
	for (int *f = (int[]){ sv[0], sv[1], a, b, c, d }, k = 0; k < 6; k++)
		if (f[k] >= 0)
			close(f[k]);
	return rc;
}

/* Kills the companion and waits until it has exited: nothing it ran can
 * write into a sub-slot after this returns.  Then fails every request in
 * flight with status.  Thread (or close) only; takes mu. */
static void child_end(struct ml3 *m, int status, const char *why)
{
	int ws = 0;

	if (m->pid > 0) {
		kill(m->pid, SIGKILL); /* our unreaped child: the pid is not reused */
		while (waitpid(m->pid, &ws, 0) < 0 && errno == EINTR)
			;
	}
	if (m->wpid > 0) { /* it leaves once the companion wholly exited */
		while (waitpid(m->wpid, NULL, 0) < 0 && errno == EINTR)
			;
		close(m->wpidfd);
	}
	m->wpid = m->wpidfd = -1;
	if (m->pidfd >= 0)
		close(m->pidfd);
	if (m->sock >= 0)
		close(m->sock);
	m->pid = -1;
	m->pidfd = m->sock = -1;
	pthread_mutex_lock(&m->mu);
	int was_up = m->child == C_UP;
	m->child = C_NONE;
	m->st.up = 0;
	if (why)
		set_error_locked(m, "the mooncake companion %s", why);
	for (uint32_t s = 0; s <= m->conf.depth; s++) {
		struct flight *f = &m->fl[s];
		if (!f->q)
			continue;
		if (s < m->conf.depth) {
			complete_locked(m, f->q, status);
			m->free_slots[m->n_free++] = s;
			m->flying--;
		}
		f->q = NULL;
	}
	m->probe_out = 0;
	notify_locked(m);
	pthread_mutex_unlock(&m->mu);
	if (why && (was_up || m->backoff_ms <= BACKOFF_MIN))
		say(m, 1, "the mooncake companion %s; the L3 is a miss until a new one "
			  "answers", why);
	m->retry_ns = kvt__now_ns() + (uint64_t)m->backoff_ms * 1000000ull;
	m->backoff_ms = m->backoff_ms * 2 > BACKOFF_MAX ? BACKOFF_MAX : m->backoff_ms * 2;
}

/* The hello: the store set up (0, the description) or not (why). */
static int child_hello(struct ml3 *m, char *err, size_t len)
{
	struct mc_hello h;
	ssize_t n = recv(m->sock, &h, sizeof(h), MSG_DONTWAIT);

	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return -EAGAIN;
	if (n != (ssize_t)sizeof(h) || h.magic != MC_MAGIC || h.version != MC_VERSION ||
	    h.kind != MC_HELLO)
		return snprintf(err, len, "exited before it said hello (its stderr has why)"),
		       -EPROTO;
	h.text[sizeof(h.text) - 1] = 0;
	if (h.status) {
		snprintf(err, len, "%s", h.text);
		return h.status < 0 ? h.status : -EIO;
	}
	pthread_mutex_lock(&m->mu);
	snprintf(m->st.describe, sizeof(m->st.describe), "%s", h.text);
	m->child = C_UP;
	m->st.up = 1;
	m->st.reconnects += m->started != 0;
	pthread_mutex_unlock(&m->mu);
	m->backoff_ms = BACKOFF_MIN;
	m->last_probe = kvt__now_ns();
	return 0;
}

/* One request as a datagram: pieces in the arena by offset, the others
 * copied into the request's side slot (a put's; a get's are copied out at
 * its completion).  -EINVAL: a piece outside both. */
static int req_build(struct ml3 *m, struct kvt_l3_req *q, uint32_t slot, struct flight *f,
		     struct mc_req *r, size_t *out_len)
{
	const uint8_t *lo = m->conf.mem, *hi = lo + m->conf.mem_len;
	const uint8_t *slo = m->conf.stage, *shi = slo ? slo + m->conf.stage_len : NULL;
	uint64_t side = 0;

	memset(r, 0, offsetof(struct mc_req, keys));
	r->magic = MC_MAGIC;
	r->version = MC_VERSION;
	r->kind = MC_REQ;
	r->slot = slot;
	r->gen = f->gen;
	r->op = (uint16_t)q->op;
	if (q->op == KVT_L3_EXISTS) {
		r->n_keys = q->n_keys;
		memcpy(r->keys, q->keys, (size_t)q->n_keys * KVT_L3_KEY_MAX);
	} else {
		r->n_keys = 1;
		memcpy(r->keys[0], q->key, KVT_L3_KEY_MAX);
		r->n_pieces = (uint16_t)q->iovcnt;
		for (uint32_t i = 0; i < q->iovcnt; i++) {
			const uint8_t *p = q->iov[i].iov_base;
			uint64_t n = q->iov[i].iov_len;

			if (p >= lo && p <= hi && n <= (uint64_t)(hi - p)) {
				r->p[i] = (struct mc_piece){ (uint64_t)(p - lo), n, MC_IN_MEM, 0 };
			} else if (slo && p >= slo && p <= shi && n <= (uint64_t)(shi - p)) {
				r->p[i] = (struct mc_piece){ (uint64_t)(p - slo), n, MC_IN_STAGE, 0 };
			} else if (side + n <= MC_SIDE) {
				r->p[i] = (struct mc_piece){ (uint64_t)slot * MC_SIDE + side, n,
							     MC_IN_SIDE, 0 };
				if (q->op == KVT_L3_PUT)
					memcpy(m->side + (uint64_t)slot * MC_SIDE + side, p, n);
				side += n;
			} else {
				return -EINVAL;
			}
		}
		memcpy(f->p, r->p, sizeof(f->p));
	}
	for (uint32_t i = 0; i < r->n_keys; i++)
		r->keys[i][KVT_L3_KEY_MAX - 1] = 0;
	*out_len = offsetof(struct mc_req, keys) + (size_t)r->n_keys * KVT_L3_KEY_MAX;
	return 0;
}

/* Sends what is queued while the companion is up; fails it while there is
 * none (a miss at once, as a dead Redis node's).  Thread only. */
static void send_queued(struct ml3 *m)
{
	static __thread struct mc_req r;

	pthread_mutex_lock(&m->mu);
	while (m->q.head) {
		struct kvt_l3_req *q = m->q.head;
		size_t n = 0;

		if (m->child != C_UP) {
			complete_locked(m, kvt__l3_list_pop(&m->q), -ENOTCONN);
			continue;
		}
		if (!m->n_free)
			break;
		uint32_t slot = m->free_slots[m->n_free - 1];
		struct flight *f = &m->fl[slot];
		f->gen++;
		int rc = req_build(m, q, slot, f, &r, &n);
		if (rc) {
			complete_locked(m, kvt__l3_list_pop(&m->q), rc);
			continue;
		}
		if (send(m->sock, &r, n, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)n)
			break; /* full (the companion is behind) or gone: the poll says */
		m->n_free--;
		f->q = kvt__l3_list_pop(&m->q);
		f->deadline = kvt__now_ns() + m->deadline_ns;
		m->flying++;
	}
	notify_locked(m);
	pthread_mutex_unlock(&m->mu);
}

static void probe_send(struct ml3 *m)
{
	struct mc_req r;
	uint32_t slot = m->conf.depth;

	memset(&r, 0, offsetof(struct mc_req, keys));
	r.magic = MC_MAGIC;
	r.version = MC_VERSION;
	r.kind = MC_REQ;
	r.slot = slot;
	r.gen = ++m->fl[slot].gen;
	r.op = MC_PROBE_OP;
	if (send(m->sock, &r, offsetof(struct mc_req, keys), MSG_DONTWAIT | MSG_NOSIGNAL) > 0) {
		m->probe_out = 1;
		m->fl[slot].deadline = kvt__now_ns() + m->deadline_ns;
	}
	m->last_probe = kvt__now_ns();
}

/* Reads the answers: 0, or -EPIPE (the companion is gone or spoke
 * nonsense: it is ended). */
static int read_done(struct ml3 *m)
{
	static __thread struct mc_done d;

	for (;;) {
		ssize_t n = recv(m->sock, &d, sizeof(d), MSG_DONTWAIT);
		if (n < 0)
			return errno == EAGAIN || errno == EINTR ? 0 : -EPIPE;
		if (n == 0)
			return -EPIPE;
		if ((size_t)n < offsetof(struct mc_done, it) || d.magic != MC_MAGIC ||
		    d.version != MC_VERSION || d.kind != MC_DONE || d.n > MC_DONE_MAX ||
		    (size_t)n != offsetof(struct mc_done, it) + d.n * sizeof(d.it[0]))
			return -EPIPE;
		pthread_mutex_lock(&m->mu);
		m->st.round_trips++;
		for (uint32_t i = 0; i < d.n; i++) {
			const struct mc_done_item *it = &d.it[i];
			struct flight *f;

			if (it->slot > m->conf.depth || m->fl[it->slot].gen != it->gen)
				continue; /* not ours (checked: the slot indexes our table) */
			f = &m->fl[it->slot];
			if (it->slot == m->conf.depth) { /* the probe */
				m->probe_out = 0;
				m->st.up = !it->status;
				if (it->status)
					set_error_locked(m, "the master %s does not answer (%d)",
							 m->master, it->status);
				continue;
			}
			if (!f->q)
				continue;
			struct kvt_l3_req *q = f->q;
			int status = it->status > 0 || it->status < -4095 ? -EIO : it->status;
			if (!status && q->op == KVT_L3_GET) {
				q->got = it->got;
				for (uint32_t k = 0; k < q->iovcnt; k++)
					if (f->p[k].side == MC_IN_SIDE)
						memcpy(q->iov[k].iov_base, m->side + f->p[k].off,
						       f->p[k].len);
			}
			/* the store answering at all is the store up; what failed
			 * with the master away is the status's */
			if (status == -ENOTCONN) {
				m->st.up = 0;
				set_error_locked(m, "the master %s does not answer", m->master);
			} else {
				m->st.up = 1;
			}
			f->q = NULL;
			m->free_slots[m->n_free++] = it->slot;
			m->flying--;
			complete_locked(m, q, status);
		}
		notify_locked(m);
		pthread_mutex_unlock(&m->mu);
	}
}

static void *mc_thread(void *arg)
{
	struct ml3 *m = arg;
	char why[320];

	for (;;) {
		uint64_t now = kvt__now_ns();

		pthread_mutex_lock(&m->mu);
		int stop = m->stop, idle = !m->q.head && !m->flying;
		pthread_mutex_unlock(&m->mu);
		if (stop && idle)
			break;
		if (m->child == C_NONE && !stop && now >= m->retry_ns) {
			char err[256];
			if (child_spawn(m, err, sizeof(err))) {
				pthread_mutex_lock(&m->mu);
				set_error_locked(m, "%s", err);
				pthread_mutex_unlock(&m->mu);
				child_end(m, -ENOTCONN, NULL);
			}
		}
		send_queued(m);
		struct pollfd p[3] = {
			{ .fd = m->wake, .events = POLLIN },
			{ .fd = m->sock, .events = POLLIN },
			{ .fd = m->pidfd, .events = POLLIN },
		};
		int tmo = m->child == C_NONE ? 50 : 100;
		if (poll(p, 3, tmo) < 0 && errno != EINTR)
			usleep(10000);
		if (p[0].revents)
			(void)!read(m->wake, &(uint64_t){ 0 }, sizeof(uint64_t));
		if (m->child == C_NONE)
			continue;
		now = kvt__now_ns();
		if (m->child == C_STARTING) {
			char err[256] = "";
			int rc = p[1].revents ? child_hello(m, err, sizeof(err)) : -EAGAIN;
			if (rc == -EAGAIN && !p[2].revents && now - m->started < m->hello_ns)
				continue;
			if (rc == -EAGAIN)
				snprintf(err, sizeof(err), p[2].revents ? "exited at its start (its "
					 "stderr has why)" : "did not set up in time");
			if (rc) {
				snprintf(why, sizeof(why), "did not start: %s", err);
				child_end(m, -ENOTCONN, why);
			} else {
				say(m, 0, "%s", m->st.describe);
			}
			continue;
		}
		int gone = read_done(m) || (p[2].revents & POLLIN) ||
			   (p[1].revents & (POLLHUP | POLLERR));
		if (gone) {
			child_end(m, -ENOTCONN, "exited");
			continue;
		}
		/* the deadline: kill, wait, then fail (never a write after) */
		pthread_mutex_lock(&m->mu);
		int late = 0;
		for (uint32_t s = 0; s <= m->conf.depth && !late; s++)
			late = (m->fl[s].q || (s == m->conf.depth && m->probe_out)) &&
			       now > m->fl[s].deadline;
		int flying = m->flying;
		pthread_mutex_unlock(&m->mu);
		if (late) {
			snprintf(why, sizeof(why), "did not answer within %llu ms: killed",
				 (unsigned long long)(m->deadline_ns / 1000000));
			child_end(m, -ETIMEDOUT, why);
			continue;
		}
		if (!flying && !m->probe_out && now - m->last_probe > PROBE_NS)
			probe_send(m);
	}
	if (m->child != C_NONE) {
		/* the channel closed: the companion exits on its own; then it is
		 * reaped (child_end kills only one that lingers) */
		shutdown(m->sock, SHUT_RDWR);
		struct pollfd p = { .fd = m->pidfd, .events = POLLIN };
		if (m->pidfd >= 0)
			poll(&p, 1, 3000);
		child_end(m, -ECANCELED, NULL);
	}
	return NULL;
}

/* ---- the ops ---- */

static void ml3_close(void *be);

static int ml3_open(const struct kvt_l3_conf *c, void **out, char *err, size_t len)
{
	struct ml3 *m = calloc(1, sizeof(*m));
	const char *py;
	int rc;

	if (!m)
		return snprintf(err, len, "out of memory"), -ENOMEM;
	m->conf = *c;
	m->efd = m->wake = m->side_fd = m->pidfd = m->sock = -1;
	m->pid = m->wpid = m->wpidfd = -1;
	m->backoff_ms = BACKOFF_MIN;
	pthread_mutex_init(&m->mu, NULL);
	if (!m->conf.timeout_ms)
		m->conf.timeout_ms = 1000;
	if (!m->conf.depth)
		m->conf.depth = 256;
	m->deadline_ns = (uint64_t)m->conf.timeout_ms * 10000000ull + 5000000000ull;
	m->hello_ns = (uint64_t)m->conf.timeout_ms * 30000000ull + 10000000000ull;
	if ((rc = url_parse(m, c->url, err, len)))
		goto fail;
	if (!c->mem || !c->mem_len) {
		rc = -EINVAL;
		snprintf(err, len, "l3 %s: the mooncake backend needs the arena to register "
			 "(kvt_l3_conf.mem)", c->url);
		goto fail;
	}
	py = c->python ? c->python : getenv("KVTIER_MOONCAKE_PYTHON");
	snprintf(m->python, sizeof(m->python), "%s", py && *py ? py : "python3");
	if ((rc = script_find(m, err, len)))
		goto fail;
	m->fl = calloc(m->conf.depth + 1, sizeof(*m->fl));
	m->free_slots = calloc(m->conf.depth, sizeof(*m->free_slots));
	if (!m->fl || !m->free_slots) {
		rc = -ENOMEM;
		snprintf(err, len, "out of memory");
		goto fail;
	}
	for (uint32_t s = m->conf.depth; s-- > 0;)
		m->free_slots[m->n_free++] = s;
	size_t side_len = (size_t)(m->conf.depth + 1) * MC_SIDE;
	m->side_fd = memfd_create("kvtier-l3-side", MFD_CLOEXEC);
	if (m->side_fd < 0 || ftruncate(m->side_fd, (off_t)side_len) ||
	    (m->side = mmap(NULL, side_len, PROT_READ | PROT_WRITE, MAP_SHARED, m->side_fd, 0)) ==
		    MAP_FAILED) {
		rc = -errno;
		m->side = NULL;
		snprintf(err, len, "l3 mooncake: its side buffer: %s", strerror(errno));
		goto fail;
	}
	m->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	m->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (m->efd < 0 || m->wake < 0) {
		rc = -errno;
		snprintf(err, len, "eventfd: %s", strerror(errno));
		goto fail;
	}
	snprintf(m->st.describe, sizeof(m->st.describe), "mooncake store (master %.200s)",
		 m->master);
	m->st.nodes = 1;
	/* the first companion now: a Python without the wheel, or a store
	 * that refuses the setup, is named at start.  A master that is away
	 * is not a reason for the node not to run: it starts down, retried. */
	if ((rc = child_spawn(m, err, len)))
		goto fail;
	uint64_t t0 = kvt__now_ns();
	for (;;) {
		struct pollfd p[2] = { { .fd = m->sock, .events = POLLIN },
				       { .fd = m->pidfd, .events = POLLIN } };
		uint64_t wait_ns = 5000000000ull + (uint64_t)m->conf.timeout_ms * 1000000ull;
		if (kvt__now_ns() - t0 > wait_ns) {
			/* still setting up (a master that does not answer): the
			 * thread waits for its hello */
			snprintf(m->st.last_error, sizeof(m->st.last_error), "the master %.200s has "
				 "not answered yet", m->master);
			break;
		}
		if (poll(p, 2, 100) <= 0)
			continue;
		rc = p[0].revents ? child_hello(m, err, len) : -EAGAIN;
		if (!rc)
			break;
		if (rc == -EAGAIN && !p[1].revents)
			continue;
		if (rc == -EAGAIN)
			snprintf(err, len, "exited at its start (its stderr has why)");
		char why[300];
		snprintf(why, sizeof(why), "%.250s", err);
		child_end(m, -ENOTCONN, NULL);
		if (rc == -ENOSYS || rc == -EINVAL || rc == -EPROTO || rc == -EAGAIN) {
			/* not a store away: the installation or the URL */
			snprintf(err, len, "l3 %s: the companion (%s %s): %.250s", c->url,
				 m->python, m->script, why);
			rc = rc == -EAGAIN ? -ENOSYS : rc;
			goto fail;
		}
		snprintf(m->st.last_error, sizeof(m->st.last_error), "%.250s", why);
		err[0] = 0;
		break;
	}
	if (pthread_create(&m->th, NULL, mc_thread, m)) {
		rc = -EAGAIN;
		snprintf(err, len, "cannot start the L3 thread");
		goto fail;
	}
	m->th_live = 1;
	*out = m;
	return 0;
fail:
	ml3_close(m);
	return rc;
}

static int ml3_submit(void *be, struct kvt_l3_req *const *reqs, uint32_t n)
{
	struct ml3 *m = be;
	uint32_t i = 0;

	pthread_mutex_lock(&m->mu);
	if (!m->stop) /* room: what is queued and in flight, at most depth */
		i = kvt__l3_enqueue(&m->q, reqs, n, m->conf.depth - m->flying, kvt__now_ns());
	pthread_mutex_unlock(&m->mu);
	(void)!write(m->wake, &(uint64_t){ 1 }, sizeof(uint64_t));
	return (int)i;
}

static int ml3_reap(void *be, struct kvt_l3_req **done, uint32_t max)
{
	struct ml3 *m = be;
	uint64_t v;
	uint32_t n = 0;

	(void)!read(m->efd, &v, sizeof(v));
	pthread_mutex_lock(&m->mu);
	n = kvt__l3_take_done(&m->d, done, max, m->efd);
	pthread_mutex_unlock(&m->mu);
	return (int)n;
}

static int ml3_event_fd(const void *be)
{
	return ((const struct ml3 *)be)->efd;
}

static void ml3_status(void *be, struct kvt_l3_status *out)
{
	struct ml3 *m = be;

	pthread_mutex_lock(&m->mu);
	*out = m->st;
	pthread_mutex_unlock(&m->mu);
	out->nodes_up = out->up; /* one master */
}

static void ml3_close(void *be)
{
	struct ml3 *m = be;

	if (!m)
		return;
	if (m->th_live) {
		/* the thread sends and completes what is queued, closes the
		 * channel and reaps the companion */
		pthread_mutex_lock(&m->mu);
		m->stop = 1;
		pthread_mutex_unlock(&m->mu);
		(void)!write(m->wake, &(uint64_t){ 1 }, sizeof(uint64_t));
		pthread_join(m->th, NULL);
	} else if (m->child != C_NONE) {
		child_end(m, -ECANCELED, NULL);
	}
	if (m->side)
		munmap(m->side, (size_t)(m->conf.depth + 1) * MC_SIDE);
	for (int *f = (int[]){ m->side_fd, m->efd, m->wake }, k = 0; k < 3; k++)
		if (f[k] >= 0)
			close(f[k]);
	free(m->fl);
	free(m->free_slots);
	pthread_mutex_destroy(&m->mu);
	free(m);
}

const struct kvt_l3_ops kvt__l3_mooncake_ops = {
	.scheme = "mooncake://",
	.open = ml3_open,
	.submit = ml3_submit,
	.reap = ml3_reap,
	.event_fd = ml3_event_fd,
	.status = ml3_status,
	.close = ml3_close,
};
