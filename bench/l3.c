/* l3.c - kvtier-bench l3: put and get GB/s through the L3 backend (one
 * connection per master, `depth` requests in flight, objects sent from
 * their pieces as the engine sends them from the arena, sealed and
 * checked on the bench's thread as the engine does on its one thread:
 * --seal mac, kvtierd's default; encrypt, --l3-encrypt's; none, the
 * transport alone) beside the store's own client on the same store,
 * value size and depth, in the same run:
 *   redis: redis-benchmark (one client: -c 1 -P depth).  Goal: >= 0.8 x.
 *   mooncake: Mooncake's Python client, batch_put_from / batch_get_into
 *     of `depth` objects per call from one registered buffer, as a
 *     process of its own on a master of its own (one client, one segment:
 *     the same placement as kvtier's companion).  Goal: >= 0.9 x.
 *
 *   kvtier-bench l3 [--url redis://HOST:PORT[,...] | mooncake://MASTER[?...]]
 *                   [--store redis|mooncake] [--python PATH] [--auth-file F]
 *                   [--value-size SIZE] [--depth N] [--requests N]
 *
 * Without --url it starts a store of its own on free loopback ports -- a
 * plain redis-server (no persistence), or with --store mooncake a
 * mooncake_master (the one beside --python, $KVTIER_MOONCAKE_PYTHON) --
 * and stops it at the end.  A mooncake run puts each key once (the store
 * answers a put of a key it has without moving its bytes) into a segment
 * of requests x value size, and reads them back. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <getopt.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "bench_util.h"
#include "kvt_l3.h"

static int free_port(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t n = sizeof(a);
	int s = socket(AF_INET, SOCK_STREAM, 0), p = -1;

	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (s >= 0 && !bind(s, (struct sockaddr *)&a, sizeof(a)) &&
	    !getsockname(s, (struct sockaddr *)&a, &n))
		p = ntohs(a.sin_port);
	if (s >= 0)
		close(s);
	return p;
}

/* A redis-server of the bench's own on a free loopback port (no
 * persistence, no output): its pid, or -1; *port set. */
pid_t kvt_bench_redis_start(int *port);
pid_t kvt_bench_redis_start(int *port)
{
	char ps[16];
	pid_t server;

	*port = free_port();
	if (*port < 0)
		return -1;
	snprintf(ps, sizeof(ps), "%d", *port);
	server = fork();
	if (server == 0) {
		int fd = open("/dev/null", O_WRONLY);
		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
		execlp("redis-server", "redis-server", "--port", ps, "--bind", "127.0.0.1",
		       "--save", "", "--appendonly", "no", "--loglevel", "warning", (char *)NULL);
		_exit(127);
	}
	return server;
}

/* A mooncake_master of the bench's own on free loopback ports: its pid,
 * or -1; *port (RPC) and *admin (HTTP: /get_all_keys) set. */
pid_t kvt_bench_mooncake_start(const char *python, int *port, int *admin);
pid_t kvt_bench_mooncake_start(const char *python, int *port, int *admin)
{
	char bin[4096], rpc[32], metrics[32];
	const char *slash = strrchr(python, '/');
	pid_t pid;

	if (!slash)
		return -1;
	snprintf(bin, sizeof(bin), "%.*smooncake_master", (int)(slash - python + 1), python);
	*port = free_port();
	int mport = free_port();
	*admin = mport;
	if (*port < 0 || mport < 0 || access(bin, X_OK))
		return -1;
	snprintf(rpc, sizeof(rpc), "--rpc_port=%d", *port);
	snprintf(metrics, sizeof(metrics), "--metrics_port=%d", mport);
	pid = fork();
	if (pid == 0) {
		int fd = open("/dev/null", O_WRONLY);
		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
		execl(bin, bin, rpc, metrics, "--http_metadata_server_host=127.0.0.1",
		      (char *)NULL);
		_exit(127);
	}
	for (int i = 0; pid > 0 && i < 500; i++) { /* up when its port answers */
		struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)*port) };
		int s = socket(AF_INET, SOCK_STREAM, 0), ok;
		a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		ok = s >= 0 && !connect(s, (struct sockaddr *)&a, sizeof(a));
		if (s >= 0)
			close(s);
		if (ok)
			break;
		usleep(20000);
	}
	return pid;
}

/* Mooncake's own client on the same objects: one process, a segment of its
 * own, `depth` keys per batch call from one registered buffer. */
static const char mooncake_ref[] =
	"import ctypes, mmap, os, sys, time\n"
	"from mooncake.store import MooncakeDistributedStore as S\n"
	"master, size, n, depth, seg = sys.argv[1], *map(int, sys.argv[2:6])\n"
	"s = S()\n"
	"assert s.setup('127.0.0.1', 'P2PHANDSHAKE', seg, 16 << 20, 'tcp', '', master) == 0\n"
	"buf = mmap.mmap(-1, 64 * size)\n"
	"for i in range(64): buf[i * size:(i + 1) * size] = bytes([(i * 131 + 7) & 255]) * size\n"
	"base = ctypes.addressof(ctypes.c_char.from_buffer(buf))\n"
	"assert s.register_buffer(base, 64 * size) == 0\n"
	"keys = ['ref:%d' % i for i in range(n)]\n"
	"ptrs = [base + (i % 64) * size for i in range(n)]\n"
	"def run(f, keys):\n"
	"    t, err = time.perf_counter(), 0\n"
	"    for i in range(0, n, depth):\n"
	"        r = f(keys[i:i + depth], ptrs[i:i + depth], [size] * len(keys[i:i + depth]))\n"
	"        err += sum(1 for x in r if x < 0)\n"
	"    return n * size / (time.perf_counter() - t) / 1e9, err\n"
	"run(s.batch_put_from, ['warm:%d' % i for i in range(n)])\n"
	"assert s.remove_by_regex('^warm:', True) >= 0\n"
	"p, pe = run(s.batch_put_from, keys)\n"
	"g, ge = run(s.batch_get_into, keys)\n"
	"print('%f %f %d' % (p, g, pe + ge), flush=True)\n"
	"os._exit(0)\n";

/* The warm-up's objects removed, and only those (the master may be a
 * --url of the fleet's): keys of salt WARM_SALT.  0, or -1. */
#define BENCH_FP  0x62656e6368ull
#define WARM_SALT 0x3a3aull
static int mooncake_remove_warm(const char *python, const char *master)
{
	char cmd[2048];

	snprintf(cmd, sizeof(cmd), "MC_LOG_LEVEL=ERROR GLOG_minloglevel=2 '%s' -c \""
		 "import sys\nfrom mooncake.store import MooncakeDistributedStore as S\n"
		 "s = S()\nassert s.setup('127.0.0.1', 'P2PHANDSHAKE', 0, 16 << 20, 'tcp', '', "
		 "sys.argv[1]) == 0\nassert s.remove_by_regex(sys.argv[2], True) >= 0\n\" "
		 "%s '^kvt:[{]%016llx%016llx' >/dev/null 2>&1", python, master,
		 (unsigned long long)BENCH_FP, (unsigned long long)WARM_SALT);
	return system(cmd) == 0 ? 0 : -1;
}

/* The reference's put and get GB/s (< 0: it did not run). */
static void mooncake_bench(const char *python, const char *master, uint64_t size, uint32_t n,
			   uint32_t depth, double *put, double *get, int *errors)
{
	char cmd[8192];
	FILE *f;

	*put = *get = -1;
	*errors = 0;
	snprintf(cmd, sizeof(cmd), "MC_LOG_LEVEL=ERROR GLOG_minloglevel=2 '%s' -c \"%s\" %s "
		 "%llu %u %u %llu 2>/dev/null", python, mooncake_ref, master,
		 (unsigned long long)size, n, depth, (unsigned long long)(n + 64) * size * 5 / 4);
	f = popen(cmd, "r");
	if (!f)
		return;
	if (fscanf(f, "%lf %lf %d", put, get, errors) != 3)
		*put = *get = -1;
	pclose(f);
}

struct item {
	uint8_t hdr[KVT_L3_HDR_SIZE], tag[KVT_L3_TAG_SIZE];
	struct iovec iov[3];
	struct kvt_l3_req q;
	uint32_t buf;              /* its buffer of bufs[] (UINT32_MAX: none) */
};

/* What kvtierd's L3 engine does to an object on its thread, done here on
 * the bench's own: SEAL_MAC seals a put over the value where it lies and
 * checks a get (kvt_l3_seal_pieces, kvt_l3_check_pieces); SEAL_ENCRYPT
 * encrypts a put into a buffer of its own (the engine's staging) and
 * decrypts a get where it landed; SEAL_NONE moves the bytes only (the
 * transport's figure, not a path kvtierd has). */
enum { SEAL_NONE, SEAL_MAC, SEAL_ENCRYPT };

struct runner {
	kvt_l3 *l;
	kvt_l3_sealer *sealer;     /* NULL: SEAL_NONE */
	int mode;
	uint8_t *vals;             /* 64 values */
	uint8_t *bufs;             /* depth buffers: encrypted puts, checked gets */
	uint32_t *free, n_free;
};

/* n requests of op, depth in flight: GB/s of values, or < 0.  errors:
 * failed requests and (gets) objects whose check failed. */
static double run(struct runner *R, struct item *it, uint32_t n, uint32_t op, uint64_t size,
		  uint32_t depth, uint64_t salt, int *errors)
{
	uint32_t next = 0, done = 0, inflight = 0;
	uint64_t t0 = kvt__now_ns();

	*errors = 0;
	while (done < n) {
		struct kvt_l3_req *batch[1];
		uint32_t nb = 0;

		/* each free place as soon as its object is sealed, as the engine
		 * submits a chunk's as soon as they are: the store moves one
		 * while the next is sealed */
		while (next < n && inflight < depth) {
			uint32_t id = next;
			struct item *x = &it[id];
			struct kvt_l3_req *q = &x->q;
			kvt_key k = { id, salt };
			uint8_t *v = R->vals + (uint64_t)(id % 64) * size;

			memset(q, 0, sizeof(*q));
			x->buf = UINT32_MAX;
			if (R->mode == SEAL_ENCRYPT || (R->mode == SEAL_MAC && op == KVT_L3_GET)) {
				x->buf = R->free[--R->n_free]; /* depth of them: one each */
				if (op == KVT_L3_PUT) {
					uint8_t *ct = R->bufs + (uint64_t)x->buf * size;
					if (kvt_l3_encrypt_pieces(R->sealer, x->hdr, v, ct, x->tag,
								  BENCH_FP, &k, 0, 1, 0, size))
						(*errors)++;
					v = ct;
				} else {
					v = R->bufs + (uint64_t)x->buf * size;
				}
			} else if (R->mode == SEAL_MAC && op == KVT_L3_PUT &&
				   kvt_l3_seal_pieces(R->sealer, x->hdr, v, x->tag, BENCH_FP, &k,
						      0, 1, 0, size)) {
				(*errors)++;
			}
			x->iov[0] = (struct iovec){ x->hdr, sizeof(x->hdr) };
			x->iov[1] = (struct iovec){ v, (size_t)size };
			x->iov[2] = (struct iovec){ x->tag, sizeof(x->tag) };
			q->op = op;
			q->n_keys = 1;
			q->tag = id;
			kvt_l3_key(q->key, BENCH_FP, &k, 0);
			q->iov = x->iov;
			q->iovcnt = 3;
			batch[0] = q;
			nb = kvt_l3_submit(R->l, batch, 1) == 1;
			if (!nb) { /* the queue full: taken again after a reap */
				if (x->buf != UINT32_MAX)
					R->free[R->n_free++] = x->buf;
				break;
			}
			next++;
			inflight++;
		}
		/* a few at a time: a reaped place is filled again before the
		 * next ones are checked */
		struct kvt_l3_req *got[4];
		int r = kvt_l3_reap(R->l, got, 4);
		for (int i = 0; i < r; i++) {
			struct item *x = &it[got[i]->tag];
			kvt_key k = { got[i]->tag, salt };

			*errors += got[i]->status != 0;
			if (!got[i]->status && op == KVT_L3_GET && R->mode != SEAL_NONE &&
			    kvt_l3_check_pieces(R->sealer, x->hdr, x->iov[1].iov_base, x->tag,
						BENCH_FP, &k, 0, 1, KVT_L3_ANY_DEPTH, size))
				(*errors)++;
			if (x->buf != UINT32_MAX)
				R->free[R->n_free++] = x->buf;
		}
		if (r > 0) {
			done += (uint32_t)r;
			inflight -= (uint32_t)r;
		} else {
			struct pollfd p = { .fd = kvt_l3_event_fd(R->l), .events = POLLIN };
			poll(&p, 1, 10); /* as kvtierd's loop waits */
		}
	}
	return (double)n * (double)size / ((double)(kvt__now_ns() - t0) * 1e-9) / 1e9;
}

/* redis-benchmark's requests/s for test (set or get), or < 0. */
static double redis_bench(const char *host, int port, int cluster, const char *test,
			  uint64_t size, uint32_t depth, uint32_t n)
{
	char cmd[512], line[512];
	double rps = -1;
	FILE *f;

	snprintf(cmd, sizeof(cmd), "redis-benchmark -h %s -p %d %s -t %s -n %u -d %llu -P %u "
		 "-c 1 --csv 2>/dev/null", host, port, cluster ? "--cluster" : "", test, n,
		 (unsigned long long)size, depth);
	f = popen(cmd, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		char name[64];
		double v;
		/* "SET","12345.67",... */
		if (sscanf(line, "\"%63[^\"]\",\"%lf\"", name, &v) == 2 &&
		    !strncasecmp(name, test, strlen(test)))
			rps = v;
	}
	pclose(f);
	return rps;
}

int kvt_bench_l3(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "url", required_argument, NULL, 'u' },
		{ "auth-file", required_argument, NULL, 'a' },
		{ "value-size", required_argument, NULL, 's' },
		{ "depth", required_argument, NULL, 'd' },
		{ "requests", required_argument, NULL, 'n' },
		{ "store", required_argument, NULL, 'S' },
		{ "python", required_argument, NULL, 'P' },
		{ "seal", required_argument, NULL, 'e' },
		{ "help", no_argument, NULL, 'h' },
		{ 0, 0, 0, 0 },
	};
	const char *url = NULL, *auth = NULL, *store = "redis", *python = NULL;
	uint64_t size = 1u << 20;
	uint32_t depth = 16, n = 512;
	char own_url[128], err[256], host[64] = "127.0.0.1", b[32], master[300] = "";
	pid_t server = 0;
	int opt, port = 0, admin = 0, cluster = 0, mooncake = 0, memfd = -1, seal = SEAL_MAC;
	static const char *const seal_names[] = { "none", "mac", "encrypt" };
	char keydir[] = "/tmp/kvtier-bench-l3-XXXXXX", keyfile[64] = "";
	struct runner R = { 0 };
	uint64_t mem_len = 0;

	uint8_t *vals = NULL;
	struct item *it = NULL;
	kvt_l3 *l = NULL;
	int rc = -1;

	while ((opt = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		char *end = NULL;
		switch (opt) {
		case 'u': url = optarg; break;
		case 'a': auth = optarg; break;
		case 's':
			if (parse_size(optarg, &size) || size < 64 || size > (512u << 20))
				goto usage;
			break;
		case 'd':
			depth = (uint32_t)strtoul(optarg, &end, 10);
			if (*end || !depth || depth > 256)
				goto usage;
			break;
		case 'n':
			n = (uint32_t)strtoul(optarg, &end, 10);
			if (*end || !n)
				goto usage;
			break;
		case 'S':
			if (strcmp(optarg, "redis") && strcmp(optarg, "mooncake"))
				goto usage;
			store = optarg;
			break;
		case 'P': python = optarg; break;
		case 'e':
			for (seal = 0; seal < 3 && strcmp(optarg, seal_names[seal]); seal++)
				;
			if (seal == 3)
				goto usage;
			break;
		case 'h':
		default:
		usage:
			fprintf(opt == 'h' ? stdout : stderr,
				"usage: kvtier-bench l3 [--url redis://HOST:PORT[,...] | "
				"mooncake://MASTER[:PORT][?...]]\n"
				"                       [--store redis|mooncake] [--python PATH] "
				"[--auth-file F]\n"
				"                       [--value-size SIZE (1M)] [--depth N (16)] "
				"[--requests N (512)]\n"
				"                       [--seal mac|encrypt|none (mac)]\n"
				"  without --url: a store of its own on loopback ports (redis-server, or\n"
				"  mooncake_master beside --python, default $KVTIER_MOONCAKE_PYTHON)\n"
				"  --seal: what kvtierd does to each object on its thread, here on the\n"
				"  bench's: mac (kvtierd's default: sealed and checked in place), encrypt\n"
				"  (--l3-encrypt: the put into a buffer of its own, the get decrypted where\n"
				"  it landed), none (the transport alone)\n");
			return opt == 'h' ? 0 : 2;
		}
	}
	if (!python)
		python = getenv("KVTIER_MOONCAKE_PYTHON");
	if (!python || !*python)
		python = "python3";
	mooncake = url ? !strncmp(url, "mooncake://", 11) : !strcmp(store, "mooncake");
	if (mooncake && !url) {
		server = kvt_bench_mooncake_start(python, &port, &admin);
		if (server < 0) {
			fprintf(stderr, "kvtier-bench l3: no mooncake_master beside %s "
				"(scripts/mooncake.sh VENV; --python VENV/bin/python)\n", python);
			return 2;
		}
		snprintf(master, sizeof(master), "127.0.0.1:%d", port);
		snprintf(own_url, sizeof(own_url), "mooncake://127.0.0.1:%d?segment=%llu", port,
			 (unsigned long long)(n + 64) * size * 5 / 4);
		url = own_url;
	} else if (mooncake) {
		if (sscanf(url, "mooncake://%299[^?/]", master) != 1) {
			fprintf(stderr, "kvtier-bench l3: %s: not mooncake://MASTER[:PORT]\n", url);
			return 2;
		}
		if (!strchr(master, ':'))
			strcat(master, ":50051");
	} else if (!url) {
		server = kvt_bench_redis_start(&port);
		snprintf(own_url, sizeof(own_url), "redis://127.0.0.1:%d", port);
		url = own_url;
	} else if (sscanf(url, "redis://%63[^:]:%d", host, &port) != 2) {
		fprintf(stderr, "kvtier-bench l3: %s: not redis://HOST:PORT\n", url);
		return 2;
	}
	/* the values, and a buffer per request in flight (encrypted puts,
	 * checked gets), in memory a backend can map (mooncake's companion
	 * maps this file), as kvtierd's arena and staging are */
	mem_len = (64 + (uint64_t)depth) * size;
	memfd = memfd_create("kvtier-bench-l3", MFD_CLOEXEC);
	if (memfd < 0 || ftruncate(memfd, (off_t)mem_len) ||
	    (vals = mmap(NULL, mem_len, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0)) ==
		    MAP_FAILED) {
		fprintf(stderr, "kvtier-bench l3: its values: %s\n", strerror(errno));
		vals = NULL;
		goto out;
	}
	R.mode = seal;
	R.vals = vals;
	R.bufs = vals + 64 * size;
	R.free = calloc(depth, sizeof(*R.free));
	for (uint32_t i = 0; R.free && i < depth; i++)
		R.free[R.n_free++] = i;
	if (seal != SEAL_NONE) { /* a key of the run's own, removed at the end */
		if (!mkdtemp(keydir)) {
			fprintf(stderr, "kvtier-bench l3: %s: %s\n", keydir, strerror(errno));
			goto out;
		}
		snprintf(keyfile, sizeof(keyfile), "%s/key", keydir);
		if (kvt_l3_seal_open(keyfile, 1, &R.sealer, NULL, err, sizeof(err))) {
			fprintf(stderr, "kvtier-bench l3: %s\n", err);
			goto out;
		}
	}
	struct kvt_l3_conf c = { .size = sizeof(c), .url = url, .auth_file = auth,
				 .timeout_ms = 5000, .depth = depth, .mem = vals,
				 .mem_len = mem_len, .mem_fd = memfd, .python = python };
	for (int tries = 0; tries < 200; tries++) { /* our server starting */
		rc = kvt_l3_open(&c, &l, err, sizeof(err));
		if (!rc || url != own_url)
			break;
		usleep(20000);
	}
	if (rc) {
		fprintf(stderr, "kvtier-bench l3: %s\n", err);
		goto out;
	}
	/* the backend opens with the store down (and retries it): measure
	 * only once it answers, or every request of the run is a failure */
	struct kvt_l3_status st;
	kvt_l3_status(l, &st);
	for (int tries = 0; !st.up && tries < 500; tries++) {
		usleep(20000);
		kvt_l3_status(l, &st);
	}
	if (!st.up) {
		fprintf(stderr, "kvtier-bench l3: %s does not answer: %s\n", url, st.last_error);
		rc = -1;
		goto out;
	}
	cluster = strstr(st.describe, "cluster") != NULL;
	it = calloc(n, sizeof(*it));
	R.l = l;
	if (!it || !R.free) {
		fprintf(stderr, "kvtier-bench l3: out of memory\n");
		goto out;
	}
	for (uint64_t i = 0; i < 64 * size; i++)
		vals[i] = (uint8_t)(i * 131 + 7);
	int e_put, e_get, e_ref = 0;
	/* An untimed pass first: what is compared is kvtier's cost over the
	 * store's, not the store faulting in the memory of its first n values.
	 * redis: the timed pass overwrites keys that exist, as
	 * redis-benchmark's SET rewrites its one key (the first pass of 1,024
	 * x 4 MiB ran at a fifth of the speed of the next ones).  mooncake: a
	 * put of a key the store has moves no bytes, so the warm-up puts other
	 * keys, which the master then removes (those keys only), and the timed pass puts fresh
	 * keys into the segment's memory the warm-up faulted in (the
	 * reference does the same: its first pass of 1,024 x 1 MiB ran at
	 * 1.9 GB/s, the next ones 5.1-5.3). */
	uint64_t vsize = size - KVT_L3_HDR_SIZE - KVT_L3_TAG_SIZE;
	(void)run(&R, it, n, KVT_L3_PUT, vsize, depth, mooncake ? WARM_SALT : 0xbe1c, &e_put);
	if (mooncake && mooncake_remove_warm(python, master)) {
		fprintf(stderr, "kvtier-bench l3: the warm-up's objects could not be removed\n");
		rc = -1;
		goto out;
	}
	double put = run(&R, it, n, KVT_L3_PUT, vsize, depth, 0xbe1c, &e_put);
	double get = run(&R, it, n, KVT_L3_GET, vsize, depth, 0xbe1c, &e_get);
	double rsb, rgb;
	const char *ref = mooncake ? "mooncake python" : "redis-benchmark";
	if (mooncake) {
		/* the reference on a master of its own, as kvtier's side had
		 * (with --url: the same master, once the companion left) */
		kvt_l3_close(l);
		l = NULL;
		if (server > 0) {
			kill(server, SIGTERM);
			waitpid(server, NULL, 0);
			server = kvt_bench_mooncake_start(python, &port, &admin);
			snprintf(master, sizeof(master), "127.0.0.1:%d", port);
		}
		mooncake_bench(python, master, size, n, depth, &rsb, &rgb, &e_ref);
	} else {
		double rs = redis_bench(host, port, cluster, "set", size, depth, n);
		double rg = redis_bench(host, port, cluster, "get", size, depth, n);
		rsb = rs > 0 ? rs * (double)size / 1e9 : -1;
		rgb = rg > 0 ? rg * (double)size / 1e9 : -1;
	}
	printf("kvtier-bench l3: %s, values of %s, %u in flight, %u requests, seal %s\n",
	       st.describe, human(size, b, sizeof(b)), depth, n, seal_names[seal]);
	printf("  %-4s %10s %16s %7s %7s\n", "op", "kvtier GB/s", ref, "ratio", "errors");
	printf("  %-4s %10.3f %16.3f %7.2f %7d\n", "put", put, rsb, rsb > 0 ? put / rsb : 0, e_put);
	printf("  %-4s %10.3f %16.3f %7.2f %7d\n", "get", get, rgb, rgb > 0 ? get / rgb : 0, e_get);
	if ((rsb < 0 || rgb < 0) && !mooncake)
		printf("  (redis-benchmark did not run: apt-get install redis-tools)\n");
	if ((rsb < 0 || rgb < 0) && mooncake)
		printf("  (Mooncake's client did not run: %s has no mooncake.store?)\n", python);
	if (e_ref)
		printf("  (Mooncake's own client had %d errors)\n", e_ref);
	rc = e_put || e_get;
out:
	free(it);
	kvt_l3_close(l);
	kvt_l3_seal_close(R.sealer);
	free(R.free);
	if (keyfile[0])
		unlink(keyfile);
	if (keyfile[0] || strcmp(keydir, "/tmp/kvtier-bench-l3-XXXXXX"))
		rmdir(keydir);
	if (vals)
		munmap(vals, mem_len);
	if (memfd >= 0)
		close(memfd);
	if (server > 0) {
		kill(server, SIGTERM);
		waitpid(server, NULL, 0);
	}
	return rc ? 1 : 0;
}
