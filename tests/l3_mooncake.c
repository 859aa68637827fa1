/* l3_mooncake.c - the L3 tier's Mooncake Store backend (tier/l3/l3_mooncake.c
 * and its companion) against a real mooncake_master from Mooncake's wheel
 * ($KVTIER_MOONCAKE_PYTHON: the venv scripts/mooncake.sh makes), on a
 * loopback port made here.  Run in the normal, ASan+UBSan and TSan builds,
 * so the backend's thread and its channel run under the sanitizers.
 *   - sealed objects put from a memfd (the arena's stand-in),
 *     found (EXISTS over several keys), got back into it byte for byte;
 *   - encrypted objects put from a second region (the engine's staging,
 *     --l3-encrypt), got back as ciphertext and decrypted exact;
 *   - an object whose payload byte was changed (the tag kept) refused by
 *     the check; an absent one -ENOENT; a get into pieces of the wrong
 *     size -EMSGSIZE, nothing written past its pieces; a large piece outside
 *     the arena -EINVAL;
 *   - the master killed: requests fail at once (-ENOTCONN), the status goes
 *     down; restarted, the store is up again by itself and puts succeed;
 *   - bad URLs refused at open, named; a Python without the wheel refused
 *     at open, named.
 * Skipped (77) without $KVTIER_MOONCAKE_PYTHON.
 */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <cmocka.h>

#include "kvt_l3.h"
#include "kvt_test.h"

#define N       24
#define PAYLOAD (64u << 10)
#define FP      0x6d6f6f6e63616b65ull
#define MEM     ((size_t)2 * N * PAYLOAD)

static const char *py;
static char master_bin[4096], keyfile[256], dir[128];
static pid_t master = -1;
static int port, mfd = -1;
static uint8_t *mem;
static kvt_l3_sealer *seal;

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

static int port_open(int p)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)p) };
	int s = socket(AF_INET, SOCK_STREAM, 0), ok;

	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	ok = s >= 0 && !connect(s, (struct sockaddr *)&a, sizeof(a));
	if (s >= 0)
		close(s);
	return ok;
}

static void master_start(void)
{
	char rpc[32], metrics[32];

	snprintf(rpc, sizeof(rpc), "--rpc_port=%d", port);
	snprintf(metrics, sizeof(metrics), "--metrics_port=%d", free_port());
	master = fork();
	assert_true(master >= 0);
	if (master == 0) {
		int fd = open("/dev/null", O_WRONLY);
		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
		execl(master_bin, master_bin, rpc, metrics, "--http_metadata_server_host=127.0.0.1",
		      (char *)NULL);
		_exit(127);
	}
	while (!port_open(port)) { /* bounded by ctest's timeout */
		assert_int_equal(waitpid(master, NULL, WNOHANG), 0);
		usleep(20000);
	}
}

static void master_kill(void)
{
	if (master > 0) {
		kill(master, SIGKILL);
		waitpid(master, NULL, 0);
	}
	master = -1;
}

/* stage: a second region (the engine's staging of encrypted puts), or
 * NULL */
static kvt_l3 *open_store_staged(const void *stage, uint64_t stage_len, int stage_fd)
{
	char url[128], err[256];
	kvt_l3 *l = NULL;
	struct kvt_l3_conf c = { .size = sizeof(c), .url = url, .timeout_ms = 1000, .depth = 64,
				 .mem = mem, .mem_len = MEM, .mem_fd = mfd, .python = py,
				 .stage = stage, .stage_len = stage_len, .stage_fd = stage_fd };

	snprintf(url, sizeof(url), "mooncake://127.0.0.1:%d?segment=32M", port);
	if (kvt_l3_open(&c, &l, err, sizeof(err)))
		fail_msg("open %s: %s", url, err);
	return l;
}

static kvt_l3 *open_store(void)
{
	return open_store_staged(NULL, 0, -1);
}

struct obj {
	uint8_t hdr[KVT_L3_HDR_SIZE], tag[KVT_L3_TAG_SIZE];
	struct iovec iov[3];
	struct kvt_l3_req q;
	char keys[2][KVT_L3_KEY_MAX];
};

static struct obj objs[N];

static kvt_key key_of(int i)
{
	return (kvt_key){ 0x1000 + (uint64_t)i, (uint64_t)getpid() };
}

static uint8_t *src(int i) { return mem + (size_t)i * PAYLOAD; }
static uint8_t *dst(int i) { return mem + (size_t)(N + i) * PAYLOAD; }

static void req(struct obj *o, uint32_t op, int i, uint8_t *payload, size_t len)
{
	kvt_key k = key_of(i);

	memset(&o->q, 0, sizeof(o->q));
	o->iov[0] = (struct iovec){ o->hdr, sizeof(o->hdr) };
	o->iov[1] = (struct iovec){ payload, len };
	o->iov[2] = (struct iovec){ o->tag, sizeof(o->tag) };
	o->q.op = op;
	o->q.n_keys = 1;
	kvt_l3_key(o->q.key, FP, &k, 0);
	o->q.iov = o->iov;
	o->q.iovcnt = 3;
	o->q.tag = (uint64_t)i;
}

/* Submits them all and waits for every completion (the backend bounds
 * each: its deadline kills a companion that does not answer). */
static void run(kvt_l3 *l, struct kvt_l3_req **qs, uint32_t n)
{
	uint32_t sent = 0, done = 0;

	while (done < n) {
		if (sent < n) {
			int t = kvt_l3_submit(l, qs + sent, n - sent);
			assert_true(t >= 0);
			sent += (uint32_t)t;
		}
		struct kvt_l3_req *got[64];
		int r = kvt_l3_reap(l, got, 64);
		if (r > 0) {
			done += (uint32_t)r;
			continue;
		}
		struct pollfd p = { .fd = kvt_l3_event_fd(l), .events = POLLIN };
		poll(&p, 1, 50);
	}
}

static void put_all(kvt_l3 *l, int want_ok)
{
	struct kvt_l3_req *qs[N];

	for (int i = 0; i < N; i++) {
		kvt_key k = key_of(i);
		for (uint32_t b = 0; b < PAYLOAD; b++)
			src(i)[b] = (uint8_t)(b * 7 + (uint32_t)i * 131 + 1);
		assert_int_equal(kvt_l3_seal_pieces(seal, objs[i].hdr, src(i), objs[i].tag, FP, &k,
						    0, 1, (uint32_t)i, PAYLOAD), 0);
		req(&objs[i], KVT_L3_PUT, i, src(i), PAYLOAD);
		qs[i] = &objs[i].q;
	}
	run(l, qs, N);
	for (int i = 0; want_ok && i < N; i++)
		if (qs[i]->status)
			fail_msg("put %s: %d", qs[i]->key, qs[i]->status);
}

/* Gets every object into dst; the number that came back and checked. */
static int get_all(kvt_l3 *l, int *failed)
{
	struct kvt_l3_req *qs[N];
	int ok = 0;

	*failed = 0;
	memset(dst(0), 0, (size_t)N * PAYLOAD);
	for (int i = 0; i < N; i++) {
		req(&objs[i], KVT_L3_GET, i, dst(i), PAYLOAD);
		memset(objs[i].hdr, 0, sizeof(objs[i].hdr));
		qs[i] = &objs[i].q;
	}
	run(l, qs, N);
	for (int i = 0; i < N; i++) {
		kvt_key k = key_of(i);
		if (qs[i]->status) {
			(*failed)++;
			continue;
		}
		assert_int_equal(qs[i]->got, KVT_L3_HDR_SIZE + PAYLOAD + KVT_L3_TAG_SIZE);
		if (kvt_l3_check_pieces(seal, objs[i].hdr, dst(i), objs[i].tag, FP, &k, 0, 1,
					(uint32_t)i, PAYLOAD))
			continue;
		assert_memory_equal(dst(i), src(i), PAYLOAD);
		ok++;
	}
	return ok;
}

static void test_round_trip(void **st)
{
	struct kvt_l3_status s;
	kvt_l3 *l = open_store();
	int failed;

	(void)st;
	kvt_l3_status(l, &s);
	assert_true(s.up);
	assert_non_null(strstr(s.describe, "mooncake store: master 127.0.0.1:"));
	put_all(l, 1);
	assert_int_equal(get_all(l, &failed), N);
	assert_int_equal(failed, 0);

	/* EXISTS over several keys: all there, or one absent */
	struct obj *o = &objs[0];
	kvt_key k0 = key_of(0), kx = key_of(N + 7);
	kvt_l3_key(o->keys[0], FP, &k0, 0);
	kvt_l3_key(o->keys[1], FP, &k0, 0);
	memset(&o->q, 0, sizeof(o->q));
	o->q.op = KVT_L3_EXISTS;
	o->q.n_keys = 2;
	o->q.keys = (const char (*)[KVT_L3_KEY_MAX])o->keys;
	struct kvt_l3_req *q = &o->q;
	run(l, &q, 1);
	assert_int_equal(q->status, 0);
	kvt_l3_key(o->keys[1], FP, &kx, 0);
	run(l, &q, 1);
	assert_int_equal(q->status, -ENOENT);
	kvt_l3_close(l);
}

/* Encrypted objects put from a staging region of their own (as the engine
 * does with --l3-encrypt: the companion maps it as a third region), got
 * back into the "arena" and decrypted there: exact; and what the store
 * holds is not the payload. */
static void test_staged_encrypted(void **st)
{
	int sfd = memfd_create("kvt-l3mc-stage", MFD_CLOEXEC);
	uint8_t *stage;
	struct kvt_l3_req *qs[N];
	kvt_l3 *l;

	(void)st;
	assert_true(sfd >= 0);
	assert_int_equal(ftruncate(sfd, (off_t)N * PAYLOAD), 0);
	stage = mmap(NULL, (size_t)N * PAYLOAD, PROT_READ | PROT_WRITE, MAP_SHARED, sfd, 0);
	assert_true(stage != MAP_FAILED);
	l = open_store_staged(stage, (uint64_t)N * PAYLOAD, sfd);
	for (int i = 0; i < N; i++) {
		kvt_key k = key_of(N + 100 + i);
		uint8_t *ct = stage + (size_t)i * PAYLOAD;
		for (uint32_t b = 0; b < PAYLOAD; b++)
			src(i)[b] = (uint8_t)(b * 5 + (uint32_t)i * 37 + 3);
		assert_int_equal(kvt_l3_encrypt_pieces(seal, objs[i].hdr, src(i), ct, objs[i].tag,
						       FP, &k, 0, 1, (uint32_t)i, PAYLOAD), 0);
		assert_true(memcmp(ct, src(i), PAYLOAD) != 0);
		req(&objs[i], KVT_L3_PUT, N + 100 + i, ct, PAYLOAD);
		qs[i] = &objs[i].q;
	}
	run(l, qs, N);
	for (int i = 0; i < N; i++)
		assert_int_equal(qs[i]->status, 0);
	memset(dst(0), 0, (size_t)N * PAYLOAD);
	for (int i = 0; i < N; i++) {
		req(&objs[i], KVT_L3_GET, N + 100 + i, dst(i), PAYLOAD);
		memset(objs[i].hdr, 0, sizeof(objs[i].hdr));
		qs[i] = &objs[i].q;
	}
	run(l, qs, N);
	for (int i = 0; i < N; i++) {
		kvt_key k = key_of(N + 100 + i);
		assert_int_equal(qs[i]->status, 0);
		/* the ciphertext arrived, not the payload */
		assert_memory_equal(dst(i), stage + (size_t)i * PAYLOAD, PAYLOAD);
		assert_int_equal(kvt_l3_check_pieces(seal, objs[i].hdr, dst(i), objs[i].tag, FP, &k,
						     0, 1, (uint32_t)i, PAYLOAD), 0);
		assert_memory_equal(dst(i), src(i), PAYLOAD);
	}
	kvt_l3_close(l);
	munmap(stage, (size_t)N * PAYLOAD);
	close(sfd);
}

static void test_refused_and_bad_requests(void **st)
{
	kvt_l3 *l = open_store();
	struct kvt_l3_req *q;
	int failed;

	(void)st;
	put_all(l, 1);
	/* a forged object: one payload byte changed, the tag kept (the store
	 * is not asked what it holds: the check is kvtierd's) */
	kvt_key k = key_of(N + 1);
	req(&objs[0], KVT_L3_PUT, N + 1, src(0), PAYLOAD);
	assert_int_equal(kvt_l3_seal_pieces(seal, objs[0].hdr, src(0), objs[0].tag, FP, &k, 0, 1,
					    3, PAYLOAD), 0);
	src(0)[PAYLOAD / 2] ^= 0x10;
	q = &objs[0].q;
	run(l, &q, 1);
	assert_int_equal(q->status, 0);
	src(0)[PAYLOAD / 2] ^= 0x10;
	req(&objs[1], KVT_L3_GET, N + 1, dst(1), PAYLOAD);
	q = &objs[1].q;
	run(l, &q, 1);
	assert_int_equal(q->status, 0);
	assert_int_equal(kvt_l3_check_pieces(seal, objs[1].hdr, dst(1), objs[1].tag, FP, &k, 0, 1,
					     3, PAYLOAD), -EBADMSG);
	/* absent */
	req(&objs[2], KVT_L3_GET, N + 9, dst(2), PAYLOAD);
	q = &objs[2].q;
	run(l, &q, 1);
	assert_int_equal(q->status, -ENOENT);
	/* pieces smaller than the object (a master that says the object is
	 * larger than what the get allotted): a miss, and nothing written
	 * past them */
	memset(dst(3), 0x5a, PAYLOAD);
	req(&objs[3], KVT_L3_GET, 3, dst(3), PAYLOAD / 2);
	q = &objs[3].q;
	run(l, &q, 1);
	assert_int_equal(q->status, -EMSGSIZE);
	for (uint32_t b = PAYLOAD / 2; b < PAYLOAD; b++)
		if (dst(3)[b] != 0x5a)
			fail_msg("a get wrote %u bytes past its pieces", b - PAYLOAD / 2 + 1);
	/* a large piece outside the arena */
	static uint8_t outside[PAYLOAD];
	req(&objs[4], KVT_L3_GET, 4, outside, PAYLOAD);
	q = &objs[4].q;
	run(l, &q, 1);
	assert_int_equal(q->status, -EINVAL);
	/* and the rest still exact */
	assert_int_equal(get_all(l, &failed), N);
	kvt_l3_close(l);
}

static void test_master_killed(void **st)
{
	struct kvt_l3_status s;
	kvt_l3 *l = open_store();
	int failed;

	(void)st;
	put_all(l, 1);
	master_kill();
	/* every request fails (the RPC to the master: -ENOTCONN), none hangs */
	assert_int_equal(get_all(l, &failed), 0);
	assert_int_equal(failed, N);
	assert_int_equal(objs[0].q.status, -ENOTCONN);
	do { /* the probe's answer */
		usleep(50000);
		kvt_l3_status(l, &s);
	} while (s.up);
	assert_non_null(strstr(s.last_error, "does not answer"));
	/* a new master: empty (it kept nothing), and the companion mounts its
	 * segment there by itself; puts succeed again */
	master_start();
	do {
		usleep(100000);
		kvt_l3_status(l, &s);
	} while (!s.up);
	for (;;) {
		put_all(l, 0);
		int bad = 0;
		for (int i = 0; i < N; i++)
			bad += objs[i].q.status != 0;
		if (!bad)
			break;
		usleep(200000);
	}
	assert_int_equal(get_all(l, &failed), N);
	kvt_l3_close(l);
}

static void test_bad_open(void **st)
{
	static const char *const bad[][2] = {
		{ "mooncake://", "not mooncake://" },
		{ "mooncake://h:0", "bad master port" },
		{ "mooncake://h?protocol=udp", "tcp or rdma" },
		{ "mooncake://h?protocol=rdma", "needs device=" },
		{ "mooncake://h?segment=-1", "a size" },
		{ "mooncake://h?x", "not key=value" },
		{ "mooncake://h?bogus=1", "unknown parameter 'bogus'" },
		{ "mooncake://h/x", "not a master's" },
	};
	char err[256];
	kvt_l3 *l = NULL;

	(void)st;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct kvt_l3_conf c = { .size = sizeof(c), .url = bad[i][0], .mem = mem,
					 .mem_len = MEM, .mem_fd = mfd, .python = py };
		assert_int_equal(kvt_l3_open(&c, &l, err, sizeof(err)), -EINVAL);
		if (!strstr(err, bad[i][1]))
			fail_msg("%s: '%s' does not say '%s'", bad[i][0], err, bad[i][1]);
	}
	/* no memory to register */
	struct kvt_l3_conf c = { .size = sizeof(c), .url = "mooncake://127.0.0.1", .python = py };
	assert_int_equal(kvt_l3_open(&c, &l, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "needs the arena"));
	/* a Python without the wheel */
	char url[64];
	snprintf(url, sizeof(url), "mooncake://127.0.0.1:%d", port);
	struct kvt_l3_conf d = { .size = sizeof(d), .url = url, .mem = mem, .mem_len = MEM,
				 .mem_fd = mfd, .python = "/usr/bin/python3" };
	int rc = kvt_l3_open(&d, &l, err, sizeof(err));
	if (access("/usr/bin/python3", X_OK))
		return;
	assert_int_equal(rc, -ENOSYS);
	assert_non_null(strstr(err, "has no Mooncake"));
}

static int setup(void **st)
{
	char err[256];
	int created;

	(void)st;
	snprintf(dir, sizeof(dir), "/tmp/kvt-l3mc-XXXXXX");
	if (!mkdtemp(dir))
		return -1;
	snprintf(keyfile, sizeof(keyfile), "%s/fleet.key", dir);
	if (kvt_l3_seal_open(keyfile, 1, &seal, &created, err, sizeof(err)))
		return -1;
	mfd = memfd_create("kvt-l3mc", MFD_CLOEXEC);
	if (mfd < 0 || ftruncate(mfd, (off_t)MEM))
		return -1;
	mem = mmap(NULL, MEM, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
	if (mem == MAP_FAILED)
		return -1;
	port = free_port();
	master_start();
	return 0;
}

static int teardown(void **st)
{
	(void)st;
	master_kill();
	kvt_l3_seal_close(seal);
	unlink(keyfile);
	rmdir(dir);
	return 0;
}

int main(void)
{
	py = getenv("KVTIER_MOONCAKE_PYTHON");
	const char *slash = py ? strrchr(py, '/') : NULL;
	if (!slash) {
		fprintf(stderr, "skipped: KVTIER_MOONCAKE_PYTHON is not set (scripts/mooncake.sh)\n");
		return 77;
	}
	snprintf(master_bin, sizeof(master_bin), "%.*smooncake_master", (int)(slash - py + 1), py);
	if (access(py, X_OK) || access(master_bin, X_OK)) {
		fprintf(stderr, "skipped: no %s\n", master_bin);
		return 77;
	}
	signal(SIGPIPE, SIG_IGN);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_round_trip),
		cmocka_unit_test(test_staged_encrypted),
		cmocka_unit_test(test_refused_and_bad_requests),
		cmocka_unit_test(test_bad_open),
		cmocka_unit_test(test_master_killed),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
