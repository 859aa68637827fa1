/* l3_redis.c - the L3 tier's Redis backend against real servers (Debian's
 * redis-server): a 3-master Redis Cluster on loopback ports made here
 * (redis-cli --cluster create), and a plain Redis with a password.
 *   - sealed objects put, found (EXISTS over a chunk's shards) and got
 *     back byte for byte; spread over the masters;
 *   - a forged object (a payload byte changed, the tag kept; another
 *     chunk's object under this key; another layout's) refused, an absent
 *     one a miss;
 *   - a reshard while the backend's slot map is stale: MOVED followed,
 *     every get still exact;
 *   - a master killed: its requests fail fast (never hang past the
 *     timeout), the others go on; restarted, it serves again;
 *   - a password and an ACL user from a file: the wrong one refused at
 *     open, named; the right one works on a plain (non-cluster) Redis;
 *   - a store at maxmemory: evicting (allkeys-lru) some chunks whole,
 *     some a shard short (misses), none wrong; refusing writes
 *     (noeviction): puts dropped, the store still up;
 *   - encrypted objects (--l3-encrypt): no payload in the clear in the
 *     store, decrypted exact on another node (which also takes a clear
 *     one), a flipped ciphertext bit or a header claiming "clear" refused;
 *     puts wait for staging, never dropped;
 *   - the lookups' channel (kvt_l3_chan.h): a node's asks over the socket
 *     beside its segment answered HERE (then READY, exact) or MISSING, a
 *     malformed ask ends only that connection.
 * Skipped (77) without redis-server / redis-cli.
 */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <poll.h>
#include <pthread.h>
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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <cmocka.h>

#include <hiredis/hiredis.h>
#include <xxhash.h>

#include "kvt_clock.h"
#include "kvt_l3.h"
#include "kvt_l3e.h"
#include "kvt_l3_chan.h"
#include "kvt_l3_client.h"
#include "kvt_l3_srv.h"
#include "kvt_disk.h"
#include "kvt_test.h"

#define N_CHUNKS 48
#define SHARDS   2
#define PAYLOAD  (64u << 10)
#define OBJ      (KVT_L3_HDR_SIZE + PAYLOAD + KVT_L3_TAG_SIZE)
#define FP       0x6b767469657221ull

static char dir[256];
static int port[3];
static pid_t pid[3];
static kvt_l3_sealer *sealer;

static int free_port(void)
{
	for (;;) {
		struct sockaddr_in a = { .sin_family = AF_INET };
		socklen_t n = sizeof(a);
		int s = socket(AF_INET, SOCK_STREAM, 0), p;

		a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof(a)) ||
		    getsockname(s, (struct sockaddr *)&a, &n))
			fail_msg("no loopback port");
		close(s);
		p = ntohs(a.sin_port);
		if (p + 10000 < 65536 && p > 1024) /* the cluster bus: port + 10000 */
			return p;
	}
}

static pid_t start_redis(int p, int cluster, const char *extra1, const char *extra2)
{
	char ps[16], conf[300];
	pid_t c;

	snprintf(ps, sizeof(ps), "%d", p);
	snprintf(conf, sizeof(conf), "nodes-%d.conf", p);
	c = fork();
	if (c == 0) {
		int fd = open("/dev/null", O_WRONLY);
		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
		if (cluster)
			execlp("redis-server", "redis-server", "--port", ps, "--bind", "127.0.0.1",
			       "--dir", dir, "--cluster-enabled", "yes", "--cluster-config-file",
			       conf, "--save", "", "--appendonly", "no",
			       "--cluster-node-timeout", "2000",
			       /* the other masters serve while one is down */
			       "--cluster-require-full-coverage", "no", (char *)NULL);
		else
			execlp("redis-server", "redis-server", "--port", ps, "--bind", "127.0.0.1",
			       "--dir", dir, "--save", "", "--appendonly", "no",
			       extra1 ? extra1 : "--loglevel", extra2 ? extra2 : "notice",
			       (char *)NULL);
		_exit(127);
	}
	return c;
}

static redisContext *connect_ok(int p)
{
	for (;;) { /* no time limit: the test's timeout */
		redisContext *c = redisConnect("127.0.0.1", p);
		if (c && !c->err) {
			redisReply *y = redisCommand(c, "PING");
			int ok = y && (y->type == REDIS_REPLY_STATUS ||
				       (y->type == REDIS_REPLY_ERROR && strstr(y->str, "NOAUTH")));
			if (y)
				freeReplyObject(y);
			if (ok)
				return c;
		}
		if (c)
			redisFree(c);
		usleep(20000);
	}
}

static void wait_cluster_ok(void)
{
	for (int i = 0; i < 3; i++) {
		redisContext *c = connect_ok(port[i]);
		for (;;) {
			redisReply *y = redisCommand(c, "CLUSTER INFO");
			int ok = y && y->type == REDIS_REPLY_STRING &&
				 strstr(y->str, "cluster_state:ok");
			if (y)
				freeReplyObject(y);
			if (ok)
				break;
			usleep(50000);
		}
		redisFree(c);
	}
}

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
	char cmd[1024];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(cmd, sizeof(cmd), fmt, ap);
	va_end(ap);
	return system(cmd);
}

static int group_setup(void **st)
{
	char keyf[300], err[256];

	(void)st;
	snprintf(dir, sizeof(dir), "/tmp/kvt-l3-redis-XXXXXX");
	if (!mkdtemp(dir))
		return -1;
	for (int i = 0; i < 3; i++) {
		port[i] = free_port();
		pid[i] = start_redis(port[i], 1, NULL, NULL);
	}
	for (int i = 0; i < 3; i++)
		redisFree(connect_ok(port[i]));
	if (sh("redis-cli --cluster create 127.0.0.1:%d 127.0.0.1:%d 127.0.0.1:%d --cluster-yes "
	       ">%s/create.log 2>&1", port[0], port[1], port[2], dir))
		return -1;
	wait_cluster_ok();
	snprintf(keyf, sizeof(keyf), "%s/fleet.key", dir);
	if (kvt_l3_seal_open(keyf, 1, &sealer, NULL, err, sizeof(err))) {
		fprintf(stderr, "seal: %s\n", err);
		return -1;
	}
	return 0;
}

static int group_teardown(void **st)
{
	(void)st;
	for (int i = 0; i < 3; i++)
		if (pid[i] > 0) {
			kill(pid[i], SIGKILL);
			waitpid(pid[i], NULL, 0);
		}
	kvt_l3_seal_close(sealer);
	sh("rm -rf %s", dir);
	return 0;
}

/* ---- objects ---- */

struct obj {
	uint8_t hdr[KVT_L3_HDR_SIZE], payload[PAYLOAD], tag[KVT_L3_TAG_SIZE];
	struct iovec iov[3];
	struct kvt_l3_req q;
};

static kvt_key key_of(int i)
{
	return (kvt_key){ 0x1000 + (uint64_t)i, 0xabc };
}

static uint8_t stamp(int chunk, int shard, uint64_t b)
{
	return (uint8_t)(chunk * 13 + shard * 101 + b % 241);
}

/* Seals chunk i, shard s into o (the object's pieces, as the arena's). */
static void make(struct obj *o, int i, int s)
{
	uint8_t *whole = malloc(OBJ);
	kvt_key k = key_of(i);

	assert_non_null(whole);
	for (uint64_t b = 0; b < PAYLOAD; b++)
		whole[KVT_L3_HDR_SIZE + b] = stamp(i, s, b);
	assert_int_equal(kvt_l3_seal(sealer, whole, FP, &k, (uint32_t)s, SHARDS, (uint32_t)i,
				     PAYLOAD), 0);
	memcpy(o->hdr, whole, KVT_L3_HDR_SIZE);
	memcpy(o->payload, whole + KVT_L3_HDR_SIZE, PAYLOAD);
	memcpy(o->tag, whole + KVT_L3_HDR_SIZE + PAYLOAD, KVT_L3_TAG_SIZE);
	free(whole);
}

static void req_init(struct obj *o, uint32_t op, int i, int s)
{
	kvt_key k = key_of(i);

	memset(&o->q, 0, sizeof(o->q));
	o->iov[0] = (struct iovec){ o->hdr, sizeof(o->hdr) };
	o->iov[1] = (struct iovec){ o->payload, sizeof(o->payload) };
	o->iov[2] = (struct iovec){ o->tag, sizeof(o->tag) };
	o->q.op = op;
	o->q.n_keys = 1;
	kvt_l3_key(o->q.key, FP, &k, (uint32_t)s);
	o->q.iov = o->iov;
	o->q.iovcnt = 3;
	o->q.tag = (uint64_t)i * SHARDS + (uint64_t)s;
}

/* Submits n requests (all), waits for every completion (the event fd). */
static void run(kvt_l3 *l, struct kvt_l3_req **qs, uint32_t n)
{
	uint32_t sent = 0, done = 0;

	while (done < n) {
		if (sent < n) {
			int k = kvt_l3_submit(l, qs + sent, n - sent);
			assert_true(k >= 0);
			sent += (uint32_t)k;
		}
		struct kvt_l3_req *got[64];
		int r = kvt_l3_reap(l, got, 64);
		assert_true(r >= 0);
		done += (uint32_t)r;
		if (!r)
			usleep(1000);
	}
}

/* The payload of a fetched object, checked: 0, or -EBADMSG. */
static int check(struct obj *o, int i, int s)
{
	uint8_t *whole = malloc(OBJ);
	kvt_key k = key_of(i);
	int r;

	assert_non_null(whole);
	memcpy(whole, o->hdr, KVT_L3_HDR_SIZE);
	memcpy(whole + KVT_L3_HDR_SIZE, o->payload, PAYLOAD);
	memcpy(whole + KVT_L3_HDR_SIZE + PAYLOAD, o->tag, KVT_L3_TAG_SIZE);
	r = kvt_l3_open_obj(sealer, whole, OBJ, FP, &k, (uint32_t)s, SHARDS, PAYLOAD);
	free(whole);
	if (!r)
		for (uint64_t b = 0; b < PAYLOAD; b++)
			if (o->payload[b] != stamp(i, s, b))
				fail_msg("chunk %d shard %d byte %llu differs", i, s,
					 (unsigned long long)b);
	return r;
}

static kvt_l3 *open_cluster(int seed)
{
	char url[64], err[256];
	struct kvt_l3_conf c = { .size = sizeof(c), .url = url, .timeout_ms = 1000 };
	kvt_l3 *l = NULL;

	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", port[seed]);
	if (kvt_l3_open(&c, &l, err, sizeof(err)))
		fail_msg("open %s: %s", url, err);
	return l;
}

static struct obj objs[N_CHUNKS * SHARDS];
static struct kvt_l3_req *qs[N_CHUNKS * SHARDS];

static void put_all(kvt_l3 *l)
{
	for (int i = 0; i < N_CHUNKS; i++)
		for (int s = 0; s < SHARDS; s++) {
			struct obj *o = &objs[i * SHARDS + s];
			make(o, i, s);
			req_init(o, KVT_L3_PUT, i, s);
			qs[i * SHARDS + s] = &o->q;
		}
	run(l, qs, N_CHUNKS * SHARDS);
	for (int j = 0; j < N_CHUNKS * SHARDS; j++)
		if (qs[j]->status)
			fail_msg("put %s: %d", qs[j]->key, qs[j]->status);
}

/* Gets every object; returns how many came back exact. */
static int get_all(kvt_l3 *l, int *failed)
{
	int ok = 0;

	*failed = 0;
	for (int j = 0; j < N_CHUNKS * SHARDS; j++) {
		memset(objs[j].payload, 0, PAYLOAD);
		req_init(&objs[j], KVT_L3_GET, j / SHARDS, j % SHARDS);
		qs[j] = &objs[j].q;
	}
	run(l, qs, N_CHUNKS * SHARDS);
	for (int j = 0; j < N_CHUNKS * SHARDS; j++) {
		if (qs[j]->status) {
			(*failed)++;
			continue;
		}
		assert_int_equal(check(&objs[j], j / SHARDS, j % SHARDS), 0);
		ok++;
	}
	return ok;
}

static void test_round_trip(void **st)
{
	struct kvt_l3_status s;
	kvt_l3 *l;
	int failed, spread = 0;

	(void)st;
	l = open_cluster(1);
	kvt_l3_status(l, &s);
	assert_non_null(strstr(s.describe, "redis cluster"));
	assert_int_equal(s.nodes, 3);
	put_all(l);
	/* every chunk present: one EXISTS over its shards' keys */
	{
		static char keys[N_CHUNKS][SHARDS][KVT_L3_KEY_MAX];
		static struct kvt_l3_req ex[N_CHUNKS + 1];
		struct kvt_l3_req *eq[N_CHUNKS + 1];
		for (int i = 0; i <= N_CHUNKS; i++) {
			kvt_key k = key_of(i);
			for (int sh = 0; sh < SHARDS && i < N_CHUNKS; sh++)
				kvt_l3_key(keys[i][sh], FP, &k, (uint32_t)sh);
			memset(&ex[i], 0, sizeof(ex[i]));
			ex[i].op = KVT_L3_EXISTS;
			ex[i].n_keys = SHARDS;
			ex[i].keys = (const char (*)[KVT_L3_KEY_MAX])keys[i < N_CHUNKS ? i : 0];
			eq[i] = &ex[i];
		}
		/* the last: a chunk never put (key N_CHUNKS) */
		static char absent[SHARDS][KVT_L3_KEY_MAX];
		kvt_key k = key_of(N_CHUNKS);
		for (int sh = 0; sh < SHARDS; sh++)
			kvt_l3_key(absent[sh], FP, &k, (uint32_t)sh);
		ex[N_CHUNKS].keys = (const char (*)[KVT_L3_KEY_MAX])absent;
		run(l, eq, N_CHUNKS + 1);
		for (int i = 0; i < N_CHUNKS; i++)
			assert_int_equal(ex[i].status, 0);
		assert_int_equal(ex[N_CHUNKS].status, -ENOENT);
	}
	assert_int_equal(get_all(l, &failed), N_CHUNKS * SHARDS);
	/* spread over the masters, a chunk's shards on one of them */
	for (int i = 0; i < 3; i++) {
		redisContext *c = connect_ok(port[i]);
		redisReply *y = redisCommand(c, "DBSIZE");
		assert_non_null(y);
		spread += y->integer > 0;
		assert_int_equal(y->integer % SHARDS, 0);
		freeReplyObject(y);
		redisFree(c);
	}
	assert_int_equal(spread, 3);
	kvt_l3_close(l);
}

/* Which master holds key. */
static int master_of(const char *key)
{
	for (int i = 0; i < 3; i++) {
		redisContext *c = connect_ok(port[i]);
		redisReply *y = redisCommand(c, "EXISTS %s", key);
		int has = y && y->type == REDIS_REPLY_INTEGER && y->integer == 1;
		if (y)
			freeReplyObject(y);
		redisFree(c);
		if (has)
			return i;
	}
	return -1;
}

static void raw_set(const char *key, const struct obj *o)
{
	int m = master_of(key);
	redisContext *c;
	redisReply *y;
	uint8_t *whole = malloc(OBJ);

	assert_non_null(whole);
	memcpy(whole, o->hdr, KVT_L3_HDR_SIZE);
	memcpy(whole + KVT_L3_HDR_SIZE, o->payload, PAYLOAD);
	memcpy(whole + KVT_L3_HDR_SIZE + PAYLOAD, o->tag, KVT_L3_TAG_SIZE);
	/* a new key: the master that takes it (the others answer MOVED) */
	for (int i = m >= 0 ? m : 0; i < 3; i++) {
		c = connect_ok(port[i]);
		y = redisCommand(c, "SET %s %b", key, whole, (size_t)OBJ);
		assert_non_null(y);
		int ok = y->type == REDIS_REPLY_STATUS;
		freeReplyObject(y);
		redisFree(c);
		if (ok)
			break;
		assert_true(m < 0 && i < 2);
	}
	free(whole);
}

/* One object fetched and checked: 0 exact, -EBADMSG refused, or the
 * request's status. */
static int get_check(kvt_l3 *l, int i, int s)
{
	static struct obj o;
	struct kvt_l3_req *q = &o.q;

	memset(o.payload, 0, PAYLOAD);
	req_init(&o, KVT_L3_GET, i, s);
	run(l, &q, 1);
	return o.q.status ? o.q.status : check(&o, i, s);
}

static void test_forged(void **st)
{
	static struct obj o;
	kvt_l3 *l;

	(void)st;
	l = open_cluster(0);
	put_all(l);
	assert_int_equal(get_check(l, 3, 1), 0);
	/* a payload byte changed, header and tag kept */
	make(&o, 3, 1);
	o.payload[777] ^= 0x40;
	req_init(&o, KVT_L3_PUT, 3, 1);
	raw_set(o.q.key, &o);
	assert_int_equal(get_check(l, 3, 1), -EBADMSG);
	/* a tag made up by someone without the key */
	make(&o, 6, 0);
	memset(o.tag, 0x5a, sizeof(o.tag));
	req_init(&o, KVT_L3_PUT, 6, 0);
	raw_set(o.q.key, &o);
	assert_int_equal(get_check(l, 6, 0), -EBADMSG);
	/* chunk 5's object (valid, sealed) stored under chunk 4's key */
	make(&o, 5, 0);
	{
		kvt_key k = key_of(4);
		char key4[KVT_L3_KEY_MAX];
		kvt_l3_key(key4, FP, &k, 0);
		raw_set(key4, &o);
	}
	assert_int_equal(get_check(l, 4, 0), -EBADMSG);
	/* another layout's reader: the fingerprint differs */
	{
		uint8_t *whole = malloc(OBJ);
		kvt_key k = key_of(7);
		assert_non_null(whole);
		make(&o, 7, 1);
		memcpy(whole, o.hdr, KVT_L3_HDR_SIZE);
		memcpy(whole + KVT_L3_HDR_SIZE, o.payload, PAYLOAD);
		memcpy(whole + KVT_L3_HDR_SIZE + PAYLOAD, o.tag, KVT_L3_TAG_SIZE);
		assert_int_equal(kvt_l3_open_obj(sealer, whole, OBJ, FP, &k, 1, SHARDS, PAYLOAD), 0);
		assert_int_equal(kvt_l3_open_obj(sealer, whole, OBJ, FP + 1, &k, 1, SHARDS,
						 PAYLOAD), -EBADMSG);
		assert_int_equal(kvt_l3_open_obj(sealer, whole, OBJ - 1, FP, &k, 1, SHARDS,
						 PAYLOAD), -EBADMSG);
		free(whole);
	}
	/* never put: a miss */
	assert_int_equal(get_check(l, N_CHUNKS + 3, 0), -ENOENT);
	kvt_l3_close(l);
}

static void node_id(int i, char out[64])
{
	redisContext *c = connect_ok(port[i]);
	redisReply *y = redisCommand(c, "CLUSTER MYID");

	assert_non_null(y);
	assert_int_equal(y->type, REDIS_REPLY_STRING);
	snprintf(out, 64, "%s", y->str);
	freeReplyObject(y);
	redisFree(c);
}

static void test_reshard(void **st)
{
	struct kvt_l3_status s;
	char from[64], to[64];
	kvt_l3 *l;
	int failed;

	(void)st;
	l = open_cluster(2);
	put_all(l);
	/* the backend's slot map goes stale: a third of node 0's slots move */
	node_id(0, from);
	node_id(1, to);
	assert_int_equal(sh("redis-cli --cluster reshard 127.0.0.1:%d --cluster-from %s "
			    "--cluster-to %s --cluster-slots 2000 --cluster-yes >%s/reshard.log "
			    "2>&1", port[0], from, to, dir), 0);
	wait_cluster_ok();
	assert_int_equal(get_all(l, &failed), N_CHUNKS * SHARDS);
	kvt_l3_status(l, &s);
	assert_true(s.redirects > 0); /* MOVED was followed */
	kvt_l3_close(l);
}

static void test_master_killed(void **st)
{
	struct kvt_l3_status s;
	kvt_l3 *l;
	int failed, ok;

	(void)st;
	l = open_cluster(0);
	put_all(l);
	kill(pid[2], SIGKILL);
	waitpid(pid[2], NULL, 0);
	pid[2] = 0;
	/* its requests fail (not hang: each ends within the timeout), the
	 * other masters' succeed */
	ok = get_all(l, &failed);
	assert_true(failed > 0);
	assert_true(ok > 0);
	assert_int_equal(ok + failed, N_CHUNKS * SHARDS);
	kvt_l3_status(l, &s);
	assert_true(s.errors > 0);
	assert_true(s.nodes_up < 3);
	/* back (empty: no persistence): a miss, then a put, then a hit */
	pid[2] = start_redis(port[2], 1, NULL, NULL);
	wait_cluster_ok();
	for (;;) { /* the backoff passes, the node is reconnected */
		ok = get_all(l, &failed);
		if (ok + failed == N_CHUNKS * SHARDS && ok == N_CHUNKS * SHARDS - failed &&
		    get_check(l, 0, 0) != -ENOTCONN)
			break;
		usleep(100000);
	}
	put_all(l);
	assert_int_equal(get_all(l, &failed), N_CHUNKS * SHARDS);
	kvt_l3_close(l);
}

static void write_file(const char *path, const char *text)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);

	assert_true(fd >= 0);
	assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
	close(fd);
}

static void test_auth(void **st)
{
	char url[64], err[256], auth[300];
	struct kvt_l3_conf c = { .size = sizeof(c), .url = url, .timeout_ms = 1000 };
	struct kvt_l3_status s;
	int p = free_port(), failed;
	pid_t r;
	kvt_l3 *l = NULL;

	(void)st;
	r = start_redis(p, 0, "--requirepass", "s3cret");
	redisFree(connect_ok(p));
	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", p);
	snprintf(auth, sizeof(auth), "%s/auth", dir);
	/* no credentials, the wrong password: refused at open, named */
	assert_int_equal(kvt_l3_open(&c, &l, err, sizeof(err)), -EACCES);
	assert_non_null(strstr(err, "NOAUTH"));
	write_file(auth, "wrong\n");
	c.auth_file = auth;
	assert_int_equal(kvt_l3_open(&c, &l, err, sizeof(err)), -EACCES);
	assert_non_null(strstr(err, "AUTH refused"));
	/* a file others can read is refused too */
	chmod(auth, 0644);
	assert_int_equal(kvt_l3_open(&c, &l, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "chmod 600"));
	chmod(auth, 0600);
	/* the right one: a plain Redis, every slot on it */
	write_file(auth, "s3cret\n");
	if (kvt_l3_open(&c, &l, err, sizeof(err)))
		fail_msg("open: %s", err);
	kvt_l3_status(l, &s);
	assert_non_null(strstr(s.describe, "one node"));
	put_all(l);
	assert_int_equal(get_all(l, &failed), N_CHUNKS * SHARDS);
	kvt_l3_close(l);
	/* an ACL user: "user password" */
	{
		redisContext *rc = connect_ok(p);
		redisReply *y = redisCommand(rc, "AUTH s3cret");
		freeReplyObject(y);
		y = redisCommand(rc, "ACL SETUSER kvt on >pw2 ~kvt:* +@all");
		assert_non_null(y);
		assert_int_equal(y->type, REDIS_REPLY_STATUS);
		freeReplyObject(y);
		redisFree(rc);
	}
	write_file(auth, "kvt nope\n");
	assert_int_equal(kvt_l3_open(&c, &l, err, sizeof(err)), -EACCES);
	assert_non_null(strstr(err, "as kvt"));
	write_file(auth, "kvt pw2\n");
	if (kvt_l3_open(&c, &l, err, sizeof(err)))
		fail_msg("open as kvt: %s", err);
	assert_int_equal(get_all(l, &failed), N_CHUNKS * SHARDS);
	kvt_l3_close(l);
	kill(r, SIGKILL);
	waitpid(r, NULL, 0);
}

/* ---- a store that answers what no Redis does ---- */

struct liar {
	int lfd, port;
	const char *reply; /* for every command but CLUSTER SLOTS */
	pthread_t th;
};

/* One connection: CLUSTER SLOTS answered as a plain Redis, anything else
 * with l->reply. */
static void *liar_main(void *arg)
{
	struct liar *l = arg;
	int c = accept(l->lfd, NULL, NULL);
	char buf[4096];
	ssize_t n;

	while (c >= 0 && (n = recv(c, buf, sizeof(buf) - 1, 0)) > 0) {
		buf[n] = 0;
		const char *a = strstr(buf, "CLUSTER") ? "-ERR This instance has cluster support "
							 "disabled\r\n" : l->reply;
		if (send(c, a, strlen(a), MSG_NOSIGNAL) < 0)
			break;
	}
	if (c >= 0)
		close(c);
	return NULL;
}

static void liar_start(struct liar *l, const char *reply)
{
	struct sockaddr_in a = { .sin_family = AF_INET };
	socklen_t len = sizeof(a);

	l->reply = reply;
	l->lfd = socket(AF_INET, SOCK_STREAM, 0);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	assert_int_equal(bind(l->lfd, (struct sockaddr *)&a, sizeof(a)), 0);
	assert_int_equal(listen(l->lfd, 4), 0);
	assert_int_equal(getsockname(l->lfd, (struct sockaddr *)&a, &len), 0);
	l->port = ntohs(a.sin_port);
	assert_int_equal(pthread_create(&l->th, NULL, liar_main, l), 0);
}

/* The backend reads a round's replies by hand: a malformed reply (a bulk
 * length that is not a number, a value whose CRLF is missing, an array,
 * one that is longer than asked) fails the request and drops the
 * connection -- never a success, never bytes beyond the pieces. */
static void test_malformed_replies(void **st)
{
	static const char *const replies[] = {
		"$4x\r\nabcd\r\n",             /* not a number (read lax: 4, a value) */
		"$4\r\nabcdXY",              /* no CRLF after the value */
		"*1\r\n$4\r\nabcd\r\n",     /* an array */
		"$8\r\nabcdefgh\r\n",        /* longer than the pieces */
		"$\r\n",                     /* no length */
	};
	(void)st;
	for (size_t k = 0; k < sizeof(replies) / sizeof(replies[0]); k++) {
		struct liar l;
		char url[64], err[256];
		uint8_t piece[4] = { 0x5a, 0x5a, 0x5a, 0x5a }, guard[4] = { 0x5a, 0x5a, 0x5a, 0x5a };
		struct iovec iov = { piece, sizeof(piece) };
		struct kvt_l3_conf c = { .size = sizeof(c), .url = url, .timeout_ms = 500 };
		struct kvt_l3_req q = { .op = KVT_L3_GET, .n_keys = 1, .iov = &iov, .iovcnt = 1 };
		struct kvt_l3_req *one[1] = { &q }, *done[1];
		kvt_l3 *b = NULL;
		int n = 0;

		liar_start(&l, replies[k]);
		snprintf(url, sizeof(url), "redis://127.0.0.1:%d", l.port);
		snprintf(q.key, sizeof(q.key), "kvt:{liar}:0");
		if (kvt_l3_open(&c, &b, err, sizeof(err)))
			fail_msg("open: %s", err);
		assert_int_equal(kvt_l3_submit(b, one, 1), 1);
		while (n < 1) {
			struct pollfd p = { .fd = kvt_l3_event_fd(b), .events = POLLIN };
			poll(&p, 1, 100);
			n += kvt_l3_reap(b, done, 1);
		}
		if (!q.status)
			fail_msg("reply %zu (%s) was taken as a value", k, replies[k]);
		if (k != 1) /* (the second's value fits, is read, and then refused) */
			assert_memory_equal(piece, guard, sizeof(guard));
		kvt_l3_close(b);
		close(l.lfd); /* the liar's accept or recv ends */
		pthread_join(l.th, NULL);
	}
}

/* ---- two nodes: the engine's protocol over two segments ---- */

#define NODE_CHUNKS 24

static uint8_t node_stamp(uint64_t i, uint32_t sh, uint64_t b)
{
	return (uint8_t)(i * 29 + sh * 7 + b % 239 + 1);
}

/* A node: its own segment (world 2: two shards per chunk), owned. */
static const char *node_model; /* the next node's model text (NULL: none) */

static kvt_seg *node_seg(const char *name)
{
	struct kvt_geometry g = kvt_test_geo(2, 64);
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = name,
					 .role = KVT_ROLE_CLIENT, .model = node_model };
	kvt_seg *sg;

	g.groups[0].bytes_per_token = 1024; /* 16 KiB shards */
	if (node_model) { /* its id as kvt_open makes it (tier/kvtier.c) */
		XXH128_hash_t h = XXH3_128bits(node_model, strlen(node_model));
		g.model_id.lo = h.low64;
		g.model_id.hi = h.high64;
	}
	sg = kvt_test_create(name, &g, &a);
	assert_int_equal(kvt_seg_own(sg), 0);
	return sg;
}

/* Nodes A and B: two owned segments named after the test (tag). */
static void two_nodes(const char *tag, char na[64], char nb[64], kvt_seg **a, kvt_seg **b)
{
	snprintf(na, 64, "t-l3%sa-%d", tag, (int)getpid());
	snprintf(nb, 64, "t-l3%sb-%d", tag, (int)getpid());
	*a = node_seg(na);
	*b = node_seg(nb);
}

static void two_nodes_close(const char *na, const char *nb, kvt_seg *a, kvt_seg *b)
{
	kvt_seg_detach(a);
	kvt_seg_detach(b);
	kvt_seg_unlink(na, NULL);
	kvt_seg_unlink(nb, NULL);
}

static uint32_t node_jobs; /* the engines' jobs (0: the default) */
static uint32_t node_encrypt;  /* the engines' --l3-encrypt */
static uint64_t node_stage;    /* ... and their staging's bytes (0: the default) */

/* A node's engine on the store at p (0: the cluster). */
static kvt_l3e *node_engine_at(kvt_seg *sg, uint32_t admit, void (*hook)(void *, uint32_t),
			       void *arg, int p)
{
	static char url[64], keyf[300];
	struct kvt_l3e_opts o = { .size = sizeof(o), .key_path = keyf, .create_key = 1,
				  .admit = admit, .jobs = node_jobs, .test_before_seal = hook,
				  .test_arg = arg, .encrypt = node_encrypt,
				  .stage_bytes = node_stage };
	char err[256];
	kvt_l3e *e = NULL;

	snprintf(url, sizeof(url), "redis://127.0.0.1:%d", p ? p : port[0]);
	snprintf(keyf, sizeof(keyf), "%s/fleet.key", dir); /* one key, both nodes */
	o.store = (struct kvt_l3_conf){ .size = sizeof(o.store), .url = url, .timeout_ms = 1000 };
	if (kvt_l3e_open(sg, &o, &e, err, sizeof(err)))
		fail_msg("l3 engine: %s", err);
	return e;
}

static kvt_l3e *node_engine_hooked(kvt_seg *sg, uint32_t admit,
				   void (*hook)(void *, uint32_t), void *arg)
{
	return node_engine_at(sg, admit, hook, arg, 0);
}

static kvt_l3e *node_engine(kvt_seg *sg, uint32_t admit)
{
	return node_engine_hooked(sg, admit, NULL, NULL);
}

/* The slot holding key in sg, or -1. */
static int slot_of(kvt_seg *sg, const kvt_key *k)
{
	for (uint32_t x = 0; x < kvt_seg_geometry(sg)->n_slots; x++) {
		kvt_key kk;
		uint32_t d, ref;
		uint64_t w;

		if (kvt_slot_ready(sg, x, &kk, &d, &ref, &w) && kk.lo == k->lo && kk.hi == k->hi)
			return (int)x;
	}
	return -1;
}

/* A rank of the node saving chunk k at depth (and stamp) i. */
static void node_save_at(kvt_seg *sg, const kvt_key *k, uint32_t i)
{
	uint64_t pay = kvt_seg_chunk_bytes(sg);

	for (uint32_t sh = 0; sh < 2; sh++) {
		struct kvt_wref w;
		assert_int_equal(kvt_write_begin(sg, k, i, sh, &w), 0);
		uint8_t *p = kvt_slot_shard_ptr(sg, w.slot, sh);
		for (uint64_t o = 0; o < pay; o++)
			p[o] = node_stamp(i, sh, o);
		assert_true(kvt_write_end(sg, &w, 1) >= 0);
	}
}

/* ... chunks keys[0..n) (depth = index), stamped. */
static void node_save(kvt_seg *sg, const kvt_key *keys, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++)
		node_save_at(sg, &keys[i], i);
}

/* Chunk k READY in sg with stamp i. */
static void node_check_one(kvt_seg *sg, const kvt_key *k, uint32_t i)
{
	uint64_t pay = kvt_seg_chunk_bytes(sg);
	int x = slot_of(sg, k);

	assert_true(x >= 0);
	for (uint32_t sh = 0; sh < 2; sh++) {
		const uint8_t *p = kvt_slot_shard_ptr(sg, (uint32_t)x, sh);
		for (uint64_t o = 0; o < pay; o++)
			if (p[o] != node_stamp(i, sh, o))
				fail_msg("chunk %u shard %u: another chunk's bytes or none at "
					 "byte %llu (%#x)", i, sh, (unsigned long long)o, p[o]);
	}
}

/* Every chunk of keys[0..n) READY in sg holds its stamp; returns how many
 * are READY (all of them when need_all). */
static uint32_t node_check(kvt_seg *sg, const kvt_key *keys, uint32_t n, int need_all)
{
	uint32_t ready = 0;

	for (uint32_t i = 0; i < n; i++) {
		if (slot_of(sg, &keys[i]) < 0 && !need_all)
			continue;
		node_check_one(sg, &keys[i], i);
		ready++;
	}
	return ready;
}

static void test_two_nodes(void **st)
{
	char na[64], nb[64];
	kvt_seg *a, *b;
	kvt_l3e *ea, *eb;
	struct kvt_l3e_info ia, ib;
	kvt_key keys[NODE_CHUNKS + 2];
	uint32_t depths[NODE_CHUNKS + 2];
	uint64_t lease;
	uint64_t pay;

	(void)st;
	two_nodes("", na, nb, &a, &b);
	pay = kvt_seg_chunk_bytes(a);
	/* node A: a prefix saved by its ranks, stamped */
	for (uint32_t i = 0; i < NODE_CHUNKS + 2; i++) {
		keys[i] = (kvt_key){ 0x77000 + i + (uint64_t)getpid() * 1000, 0x4242 };
		depths[i] = i;
	}
	node_save(a, keys, NODE_CHUNKS);
	/* A's engine puts them (admission all), ahead of eviction */
	ea = node_engine(a, KVT_ADMIT_ALL);
	assert_int_equal(kvt_l3e_drain(ea, 1, -1), 0);
	kvt_l3e_info(ea, &ia);
	assert_int_equal(ia.puts, NODE_CHUNKS);
	assert_int_equal(ia.put_drops, 0);
	/* ... once: a second scan puts nothing more */
	assert_int_equal(kvt_l3e_drain(ea, 1, -1), 0);
	kvt_l3e_info(ea, &ia);
	assert_int_equal(ia.puts, NODE_CHUNKS);
	/* a forged object for chunk NODE_CHUNKS (never saved): the right size
	 * and header, a tag made up without the fleet key -- refused */
	{
		uint64_t olen = KVT_L3_HDR_SIZE + pay + KVT_L3_TAG_SIZE;
		uint8_t *whole = calloc(1, olen);
		char key[KVT_L3_KEY_MAX];
		struct kvt_l3_hdr h = { .magic = KVT_L3_MAGIC, .version = 1, .n_shards = 2,
					.depth = NODE_CHUNKS, .payload = (uint32_t)pay };
		kvt_key fpk;
		assert_non_null(whole);
		kvt_seg_fingerprint(b, &fpk);
		h.fingerprint = fpk.lo ^ fpk.hi;
		h.key_lo = keys[NODE_CHUNKS].lo;
		h.key_hi = keys[NODE_CHUNKS].hi;
		for (uint32_t sh = 0; sh < 2; sh++) {
			h.shard = sh;
			memcpy(whole, &h, sizeof(h));
			memset(whole + KVT_L3_HDR_SIZE, 0x33, pay);
			memset(whole + KVT_L3_HDR_SIZE + pay, 0x44, KVT_L3_TAG_SIZE);
			kvt_l3_key(key, h.fingerprint, &keys[NODE_CHUNKS], sh);
			for (int i = 0; i < 3; i++) { /* the master that takes it */
				redisContext *c = connect_ok(port[i]);
				redisReply *y = redisCommand(c, "SET %s %b", key, whole, (size_t)olen);
				int ok = y && y->type == REDIS_REPLY_STATUS;
				if (y)
					freeReplyObject(y);
				redisFree(c);
				if (ok)
					break;
			}
		}
		free(whole);
	}
	/* node B never saw them: one fetch, and they are READY, exact */
	eb = node_engine(b, KVT_ADMIT_NONE);
	assert_int_equal(kvt_seg_lookup(b, keys, NODE_CHUNKS, &lease), 0);
	assert_int_equal(kvt_l3e_fetch(eb, keys, depths, NODE_CHUNKS + 2), NODE_CHUNKS + 2);
	assert_int_equal(kvt_l3e_drain(eb, 0, -1), 0);
	kvt_l3e_info(eb, &ib);
	assert_int_equal(ib.gets, NODE_CHUNKS);
	assert_int_equal(ib.misses, 1);          /* chunk NODE_CHUNKS + 1: absent */
	assert_int_equal(ib.refused, 1);          /* the forged one, by its tag */
	assert_int_equal(ib.get_drops, 0);
	assert_int_equal(kvt_seg_lookup(b, keys, NODE_CHUNKS + 2, &lease), NODE_CHUNKS);
	kvt_lease_release(b, lease);
	assert_int_equal(node_check(b, keys, NODE_CHUNKS, 1), NODE_CHUNKS);
	assert_true(slot_of(b, &keys[NODE_CHUNKS]) < 0); /* never published */
	/* the miss is remembered: asked again at once, no round trip */
	assert_int_equal(kvt_l3e_fetch(eb, &keys[NODE_CHUNKS + 1], &depths[NODE_CHUNKS + 1], 1), 0);
	kvt_l3e_info(eb, &ib);
	assert_int_equal(ib.negative_hits, 1);
	/* in DRAM now: a fetch asks nothing */
	assert_int_equal(kvt_l3e_fetch(eb, keys, depths, NODE_CHUNKS), 0);
	kvt_l3e_close(ea);
	kvt_l3e_close(eb);
	two_nodes_close(na, nb, a, b);
}

/* The raw object of (chunk key, shard) from whichever master has it (a
 * malloc'd copy; *len set), or NULL. */
static uint8_t *obj_get(uint64_t fp, const kvt_key *k, uint32_t sh, size_t *len)
{
	char key[KVT_L3_KEY_MAX];
	uint8_t *out = NULL;

	kvt_l3_key(key, fp, k, sh);
	for (int i = 0; i < 3 && !out; i++) {
		redisContext *c = connect_ok(port[i]);
		redisReply *y = redisCommand(c, "GET %s", key);
		if (y && y->type == REDIS_REPLY_STRING && (out = malloc(y->len))) {
			memcpy(out, y->str, y->len);
			*len = y->len;
		}
		if (y)
			freeReplyObject(y);
		redisFree(c);
	}
	return out;
}

static void obj_set(uint64_t fp, const kvt_key *k, uint32_t sh, const uint8_t *obj, size_t len)
{
	char key[KVT_L3_KEY_MAX];
	int ok = 0;

	kvt_l3_key(key, fp, k, sh);
	for (int i = 0; i < 3 && !ok; i++) {
		redisContext *c = connect_ok(port[i]);
		redisReply *y = redisCommand(c, "SET %s %b", key, obj, len);
		ok = y && y->type == REDIS_REPLY_STATUS;
		if (y)
			freeReplyObject(y);
		redisFree(c);
	}
	assert_true(ok);
}

/* --l3-encrypt: node A's engine encrypts (a staging of one chunk: its puts
 * wait for it, none is dropped); what the store holds is no payload in
 * the clear (the bytes match the chunk's at chance rate); node B decrypts
 * every one exact, and takes a clear object (a MAC-only node's) as well;
 * one flipped ciphertext bit, and a header rewritten to say "clear", are
 * refused, never published. */
static void test_encrypted(void **st)
{
	char na[64], nb[64];
	kvt_seg *a, *b;
	kvt_l3e *ea, *eb;
	struct kvt_l3e_info ia, ib;
	kvt_key keys[NODE_CHUNKS + 1], fpk;
	uint32_t depths[NODE_CHUNKS + 1];
	uint64_t lease, pay, fp;

	(void)st;
	two_nodes("enc", na, nb, &a, &b);
	pay = kvt_seg_chunk_bytes(a);
	kvt_seg_fingerprint(a, &fpk);
	fp = fpk.lo ^ fpk.hi;
	for (uint32_t i = 0; i < NODE_CHUNKS + 1; i++) {
		keys[i] = (kvt_key){ 0x3e000 + i + (uint64_t)getpid() * 1000, 0x6e63 };
		depths[i] = i;
	}
	node_save(a, keys, NODE_CHUNKS);
	node_encrypt = 1;
	node_stage = 2 * pay; /* one chunk's two shards */
	ea = node_engine(a, KVT_ADMIT_ALL);
	assert_int_equal(kvt_l3e_drain(ea, 1, -1), 0);
	kvt_l3e_info(ea, &ia);
	assert_int_equal(ia.puts, NODE_CHUNKS);
	assert_int_equal(ia.put_drops, 0);
	assert_int_equal(ia.stage_bytes, 2 * pay);
	assert_true(ia.put_waits > 0);
	kvt_l3e_close(ea);
	/* in the store: encrypted, nothing of the payload in the clear */
	for (uint32_t i = 0; i < NODE_CHUNKS; i++)
		for (uint32_t sh = 0; sh < 2; sh++) {
			size_t len = 0;
			uint8_t *o = obj_get(fp, &keys[i], sh, &len);
			struct kvt_l3_hdr h;
			uint64_t same = 0;

			assert_non_null(o);
			assert_int_equal(len, KVT_L3_HDR_SIZE + pay + KVT_L3_TAG_SIZE);
			memcpy(&h, o, sizeof(h));
			assert_int_equal(h.version, KVT_L3_ENCRYPTED);
			for (uint64_t x = 0; x < pay; x++)
				same += o[KVT_L3_HDR_SIZE + x] == node_stamp(i, sh, x);
			if (same > pay / 64) /* chance: 1 in 256 */
				fail_msg("chunk %u shard %u: %llu of %llu payload bytes in the clear",
					 i, sh, (unsigned long long)same, (unsigned long long)pay);
			free(o);
		}
	/* a clear object too: chunk NODE_CHUNKS put by a third node's
	 * MAC-only engine */
	{
		char nc[64];
		kvt_seg *c;

		snprintf(nc, 64, "t-l3encc-%d", (int)getpid());
		c = node_seg(nc);
		node_save_at(c, &keys[NODE_CHUNKS], NODE_CHUNKS);
		node_encrypt = 0;
		ea = node_engine(c, KVT_ADMIT_ALL);
		assert_int_equal(kvt_l3e_drain(ea, 1, -1), 0);
		kvt_l3e_info(ea, &ia);
		assert_int_equal(ia.puts, 1);
		kvt_l3e_close(ea);
		kvt_seg_detach(c);
		kvt_seg_unlink(nc, NULL);
	}
	/* forged: chunk 0's shard 1 one ciphertext bit flipped; chunk 1's
	 * shard 0 header says "clear" (the tag covers the header) */
	{
		size_t len = 0;
		uint8_t *o = obj_get(fp, &keys[0], 1, &len);
		assert_non_null(o);
		o[KVT_L3_HDR_SIZE + pay / 2] ^= 0x10;
		obj_set(fp, &keys[0], 1, o, len);
		free(o);
		o = obj_get(fp, &keys[1], 0, &len);
		assert_non_null(o);
		((struct kvt_l3_hdr *)o)->version = KVT_L3_CLEAR;
		obj_set(fp, &keys[1], 0, o, len);
		free(o);
	}
	/* node B (encrypting too) fetches everything */
	node_encrypt = 1;
	eb = node_engine(b, KVT_ADMIT_NONE);
	node_encrypt = 0;
	node_stage = 0;
	assert_int_equal(kvt_l3e_fetch(eb, keys, depths, NODE_CHUNKS + 1), NODE_CHUNKS + 1);
	assert_int_equal(kvt_l3e_drain(eb, 0, -1), 0);
	kvt_l3e_info(eb, &ib);
	assert_int_equal(ib.gets, NODE_CHUNKS - 1);
	assert_int_equal(ib.refused, 2);
	assert_true(slot_of(b, &keys[0]) < 0 && slot_of(b, &keys[1]) < 0); /* never published */
	assert_int_equal(kvt_seg_lookup(b, &keys[2], NODE_CHUNKS - 1, &lease), NODE_CHUNKS - 1);
	kvt_lease_release(b, lease);
	for (uint32_t i = 2; i <= NODE_CHUNKS; i++)
		node_check_one(b, &keys[i], i);
	kvt_l3e_close(eb);
	two_nodes_close(na, nb, a, b);
}

/* Two nodes whose model identities differ in one field -- each field the
 * vLLM connector and kvtierd put there in turn: B's engine never takes A's
 * objects (their store keys and sealed headers carry the layout
 * fingerprint, of which the model's id is part): no get, nothing READY.
 * The same identity on both: every chunk fetched (the check can pass). */
static void test_two_nodes_other_model(void **st)
{
	static const char *const base = "m;dtype=bfloat16;kv=bfloat16;layout=LBHNC;"
		"weights=00aa;config=00bb";
	static const char *const other[] = {
		"m2;dtype=bfloat16;kv=bfloat16;layout=LBHNC;weights=00aa;config=00bb",
		"m;dtype=float16;kv=float16;layout=LBHNC;weights=00aa;config=00bb",
		"m;dtype=bfloat16;kv=fp8_e4m3/ocp;layout=LBHNC;weights=00aa;config=00bb",
		"m;dtype=bfloat16;kv=fp8_e4m3/fnuz;layout=LBHNC;weights=00aa;config=00bb",
		"m;dtype=bfloat16;kv=bfloat16;layout=BLHNC;weights=00aa;config=00bb",
		"m;dtype=bfloat16;kv=bfloat16;layout=LBHNC;hashseed=1;weights=00aa;config=00bb",
		"m;dtype=bfloat16;kv=bfloat16;layout=LBHNC;weights=00ab;config=00bb",
		"m;dtype=bfloat16;kv=bfloat16;layout=LBHNC;weights=00aa;config=00bc",
		base, /* last: the same identity, every chunk a hit */
	};
	kvt_key keys[NODE_CHUNKS];
	uint32_t depths[NODE_CHUNKS];

	(void)st;
	for (uint32_t t = 0; t < sizeof(other) / sizeof(other[0]); t++) {
		char na[64], nb[64], tag[16];
		kvt_seg *a, *b;
		kvt_l3e *ea, *eb;
		struct kvt_l3e_info ib;
		uint64_t lease;
		uint32_t want = other[t] == base ? NODE_CHUNKS : 0;

		snprintf(tag, sizeof(tag), "om%u", t);
		snprintf(na, 64, "t-l3%sa-%d", tag, (int)getpid());
		snprintf(nb, 64, "t-l3%sb-%d", tag, (int)getpid());
		node_model = base;
		a = node_seg(na);
		node_model = other[t];
		b = node_seg(nb);
		node_model = NULL;
		for (uint32_t i = 0; i < NODE_CHUNKS; i++) {
			keys[i] = (kvt_key){ 0x99000 + i + (uint64_t)t * 100 +
					     (uint64_t)getpid() * 10000, 0x5151 };
			depths[i] = i;
		}
		node_save(a, keys, NODE_CHUNKS);
		ea = node_engine(a, KVT_ADMIT_ALL);
		assert_int_equal(kvt_l3e_drain(ea, 1, -1), 0);
		eb = node_engine(b, KVT_ADMIT_NONE);
		assert_int_equal(kvt_l3e_fetch(eb, keys, depths, NODE_CHUNKS), NODE_CHUNKS);
		assert_int_equal(kvt_l3e_drain(eb, 0, -1), 0);
		kvt_l3e_info(eb, &ib);
		if (ib.gets != want)
			fail_msg("model '%s' took %llu of the chunks of '%s'", other[t],
				 (unsigned long long)ib.gets, base);
		assert_int_equal(ib.misses, NODE_CHUNKS - want);
		assert_int_equal(ib.refused, 0);
		assert_int_equal(kvt_seg_lookup(b, keys, NODE_CHUNKS, &lease), want);
		if (want) {
			kvt_lease_release(b, lease);
			assert_int_equal(node_check(b, keys, NODE_CHUNKS, 1), NODE_CHUNKS);
		}
		kvt_l3e_close(ea);
		kvt_l3e_close(eb);
		two_nodes_close(na, nb, a, b);
	}
}

/* A raw asker: a socket connected to v's channel, for messages the client
 * library never sends. */
static int raw_asker(kvt_l3srv *v)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

	assert_true(fd >= 0);
	memcpy(sa.sun_path, kvt_l3srv_path(v), strlen(kvt_l3srv_path(v)) + 1);
	assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	return fd;
}

/* Node A with keys[0..n) saved and put to the store, node B's engine
 * (jobs: 0 for the default) and its channel open. */
static void chan_nodes(const char *tag, const kvt_key *keys, uint32_t n, uint32_t jobs,
		       char na[64], char nb[64], kvt_seg **a, kvt_seg **b, kvt_l3e **ea,
		       kvt_l3e **eb, kvt_l3srv **v)
{
	char err[256];

	two_nodes(tag, na, nb, a, b);
	node_save(*a, keys, n);
	*ea = node_engine(*a, KVT_ADMIT_ALL);
	assert_int_equal(kvt_l3e_drain(*ea, 1, -1), 0);
	node_jobs = jobs;
	*eb = node_engine(*b, KVT_ADMIT_NONE);
	node_jobs = 0;
	assert_int_equal(kvt_l3srv_open(*b, *eb, v, err, sizeof(err)), 0);
}

/* ...and their end (v: NULL when the test closed it) */
static void chan_nodes_close(char na[64], char nb[64], kvt_seg *a, kvt_seg *b, kvt_l3e *ea,
			     kvt_l3e *eb, kvt_l3srv *v)
{
	kvt_l3srv_close(v);
	kvt_l3e_close(ea);
	kvt_l3e_close(eb);
	two_nodes_close(na, nb, a, b);
}

/* Polls B's channel and engine (one thread drives both, as kvtierd) and
 * reads the answers into c, until no key of keys[0..n) is pending. */
static void channel_settle(kvt_l3srv *v, kvt_l3e *e, kvt_l3c *c, kvt_seg *sg,
			   const kvt_key *keys, uint32_t n)
{
	for (int round = 0; round < 20000; round++) {
		uint64_t now = kvt__now_ns();
		uint32_t waiting = 0;

		kvt_l3srv_service(v);
		kvt_l3e_poll(e);
		kvt_l3srv_flush(v);
		assert_int_equal(kvt__l3c_begin(c, sg, now), 1);
		for (uint32_t i = 0; i < n; i++)
			waiting += kvt__l3c_state(c, &keys[i], now) == KVT_L3C_PENDING ||
				   (kvt_seg_peek(sg, &keys[i], 1) == 1 && slot_of(sg, &keys[i]) < 0);
		if (!waiting)
			return;
		usleep(500);
	}
	fail_msg("the channel's answers did not come");
}

/* The lookups' channel, as kvt_lookup_ex drives it: node B asks over the
 * socket beside its segment for A's chunks, one it never had, and one
 * forged; the first are HERE and then READY with A's bytes, the others
 * MISSING (and remembered).  A malformed ask closes that connection only;
 * a client whose daemon went away has nothing pending. */
static void test_channel(void **st)
{
	char na[64], nb[64];
	kvt_seg *a, *b;
	kvt_l3e *ea, *eb;
	kvt_l3srv *v;
	kvt_l3c *c;
	struct kvt_l3srv_info si;
	kvt_key keys[NODE_CHUNKS + 1];
	uint64_t now;

	(void)st;
	for (uint32_t i = 0; i < NODE_CHUNKS + 1; i++)
		keys[i] = (kvt_key){ 0x99000 + i + (uint64_t)getpid() * 1000, 0x4343 };
	/* B with 4 jobs for 25 asks: the rest wait in the engine's queue, not
	 * answered missing */
	chan_nodes("c", keys, NODE_CHUNKS, 4, na, nb, &a, &b, &ea, &eb, &v);
	assert_non_null(strstr(kvt_l3srv_path(v), "kvtier-l3."));
	c = kvt__l3c_new();
	assert_non_null(c);
	now = kvt__now_ns();
	assert_int_equal(kvt__l3c_begin(c, b, now), 1); /* connected */
	for (uint32_t i = 0; i < NODE_CHUNKS + 1; i++) {
		assert_int_equal(kvt__l3c_state(c, &keys[i], now), KVT_L3C_NOT_ASKED);
		assert_int_equal(kvt__l3c_queue(c, &keys[i], i, now), 0);
		assert_int_equal(kvt__l3c_state(c, &keys[i], now), KVT_L3C_PENDING);
	}
	assert_int_equal(kvt__l3c_send(c, now), 0);
	{	/* taken: 4 in jobs, 21 queued, all in the set of asks in flight */
		struct kvt_l3e_info ib;

		for (int i = 0; i < 2000; i++) {
			kvt_l3srv_service(v);
			kvt_l3srv_info(v, &si);
			if (si.asks == NODE_CHUNKS + 1)
				break;
			usleep(500);
		}
		kvt_l3e_info(eb, &ib);
		assert_int_equal(ib.asking, NODE_CHUNKS + 1);
		assert_int_equal(ib.inflight, 4);
	}
	channel_settle(v, eb, c, b, keys, NODE_CHUNKS + 1);
	assert_int_equal(node_check(b, keys, NODE_CHUNKS, 1), NODE_CHUNKS);
	now = kvt__now_ns();
	for (uint32_t i = 0; i < NODE_CHUNKS; i++)
		assert_int_equal(kvt__l3c_state(c, &keys[i], now), KVT_L3C_NOT_ASKED);
	/* never saved anywhere: MISSING, believed for a while */
	assert_int_equal(kvt__l3c_state(c, &keys[NODE_CHUNKS], now), KVT_L3C_NOT_THERE);
	assert_true(slot_of(b, &keys[NODE_CHUNKS]) < 0);
	kvt_l3srv_info(v, &si);
	assert_int_equal(si.asks, NODE_CHUNKS + 1);
	assert_int_equal(si.answers, NODE_CHUNKS + 1);
	assert_int_equal(si.conns, 1);
	{	/* every ask ended: none left in the engine's set of asks */
		struct kvt_l3e_info ib;

		for (int i = 0; i < 2000; i++) {
			kvt_l3e_poll(eb);
			kvt_l3e_info(eb, &ib);
			if (!ib.asking && !ib.inflight)
				break;
			usleep(500);
		}
		assert_int_equal(ib.asking, 0);
	}
	/* asked again: answered at once from the negative cache */
	assert_int_equal(kvt__l3c_begin(c, b, now + 2000000000ull), 1);
	assert_int_equal(kvt__l3c_state(c, &keys[NODE_CHUNKS], now + 2000000000ull),
			 KVT_L3C_NOT_ASKED);
	assert_int_equal(kvt__l3c_queue(c, &keys[NODE_CHUNKS], NODE_CHUNKS, now), 0);
	assert_int_equal(kvt__l3c_send(c, now), 0);
	channel_settle(v, eb, c, b, &keys[NODE_CHUNKS], 1);
	assert_int_equal(kvt__l3c_state(c, &keys[NODE_CHUNKS], kvt__now_ns()),
			 KVT_L3C_NOT_THERE);
	/* a malformed ask (a count past its datagram): that connection ends,
	 * nothing asked; the well-formed client is untouched */
	{
		struct kvt_l3c_msg m = { .h = { .magic = KVT_L3C_MAGIC, .version = KVT_L3C_VERSION,
						.op = KVT_L3C_ASK, .n = 5 } };
		int fd = raw_asker(v);
		char buf[8];

		assert_int_equal(send(fd, &m, sizeof(m.h) + 2 * sizeof(m.it[0]), 0),
				 (ssize_t)(sizeof(m.h) + 2 * sizeof(m.it[0])));
		for (int i = 0; i < 200; i++) {
			kvt_l3srv_service(v);
			kvt_l3srv_info(v, &si);
			if (si.bad)
				break;
			usleep(1000);
		}
		assert_int_equal(si.bad, 1);
		assert_int_equal(si.asks, NODE_CHUNKS + 2);   /* nothing from it */
		assert_int_equal(recv(fd, buf, sizeof(buf), 0), 0); /* closed */
		close(fd);
		assert_int_equal(si.conns, 1);
	}
	/* the daemon goes away with an ask unanswered: not pending any more */
	now = kvt__now_ns();
	keys[0].hi ^= 0x1000; /* a key no one has */
	assert_int_equal(kvt__l3c_queue(c, &keys[0], 0, now), 0);
	assert_int_equal(kvt__l3c_send(c, now), 0);
	assert_int_equal(kvt__l3c_state(c, &keys[0], now), KVT_L3C_PENDING);
	kvt_l3srv_close(v);
	assert_int_equal(kvt__l3c_begin(c, b, now), 0);
	assert_int_equal(kvt__l3c_state(c, &keys[0], now), KVT_L3C_NOT_ASKED);
	kvt__l3c_free(c);
	chan_nodes_close(na, nb, a, b, ea, eb, NULL);
}

/* The depth an asker gives: the check's "any depth" (KVT_L3_ANY_DEPTH)
 * is a bad message (before, the get skipped the header's depth check and
 * published the chunk at that depth); a wrong depth is refused by the
 * header check and remembered missing for that depth only, so that the
 * right ask right after it is served (before, the negative cache, keyed by
 * the key alone, answered it missing for negative_ms). */
static void test_channel_depth(void **st)
{
	char na[64], nb[64];
	kvt_seg *a, *b;
	kvt_l3e *ea, *eb;
	kvt_l3srv *v;
	kvt_l3c *c;
	struct kvt_l3srv_info si;
	struct kvt_l3e_info ib;
	kvt_key keys[2];
	uint64_t now;

	(void)st;
	for (uint32_t i = 0; i < 2; i++)
		keys[i] = (kvt_key){ 0xd3000 + i + (uint64_t)getpid() * 1000, 0x4444 };
	chan_nodes("d", keys, 2, 0, na, nb, &a, &b, &ea, &eb, &v);
	/* the sentinel, from a raw asker: that connection ends, nothing asked */
	{
		struct kvt_l3c_msg m = { .h = { .magic = KVT_L3C_MAGIC, .version = KVT_L3C_VERSION,
						.op = KVT_L3C_ASK, .n = 1 } };
		int fd = raw_asker(v);

		m.it[0] = (struct kvt_l3c_item){ .lo = keys[0].lo, .hi = keys[0].hi,
						 .value = KVT_L3_ANY_DEPTH };
		assert_int_equal(send(fd, &m, sizeof(m.h) + sizeof(m.it[0]), 0),
				 (ssize_t)(sizeof(m.h) + sizeof(m.it[0])));
		for (int i = 0; i < 400; i++) {
			kvt_l3srv_service(v);
			kvt_l3e_poll(eb);
			kvt_l3srv_flush(v);
			usleep(1000);
		}
		kvt_l3srv_info(v, &si);
		assert_int_equal(si.bad, 1);
		assert_int_equal(si.asks, 0);
		close(fd);
	}
	assert_true(slot_of(b, &keys[0]) < 0);
	/* the engine itself refuses it too */
	assert_int_equal(kvt_l3e_ask(eb, &keys[0], KVT_L3_ANY_DEPTH), KVT_L3E_MISSING);
	/* a wrong depth: refused, not published */
	c = kvt__l3c_new();
	assert_non_null(c);
	now = kvt__now_ns();
	assert_int_equal(kvt__l3c_begin(c, b, now), 1);
	assert_int_equal(kvt__l3c_queue(c, &keys[1], 7, now), 0);
	assert_int_equal(kvt__l3c_send(c, now), 0);
	channel_settle(v, eb, c, b, &keys[1], 1);
	assert_true(slot_of(b, &keys[1]) < 0);
	kvt_l3e_info(eb, &ib);
	assert_int_equal(ib.refused, 1); /* shard 0 refused, the rest not checked */
	/* the right one at once, from another asker (this one believes the
	 * chunk missing for a while; the engine's negative cache still holds
	 * the wrong depth's miss): served, exact */
	kvt__l3c_free(c);
	c = kvt__l3c_new();
	assert_non_null(c);
	now = kvt__now_ns();
	assert_int_equal(kvt__l3c_begin(c, b, now), 1);
	assert_int_equal(kvt__l3c_state(c, &keys[1], now), KVT_L3C_NOT_ASKED);
	assert_int_equal(kvt__l3c_queue(c, &keys[1], 1, now), 0);
	assert_int_equal(kvt__l3c_send(c, now), 0);
	channel_settle(v, eb, c, b, &keys[1], 1);
	assert_int_equal(node_check(b, keys, 2, 0), 1);
	assert_true(slot_of(b, &keys[1]) >= 0);
	kvt__l3c_free(c);
	chan_nodes_close(na, nb, a, b, ea, eb, v);
}

/* One connection floods asks (1,024 at once, for chunks no one has, never
 * reading its answers) while another asks for chunks the store holds: the
 * flooder gets its share of the engine's queue and the routes, the rest
 * answered missing at once, and the other asker's chunks are all served.
 * (Before the share, the flood filled the queue and those asks were
 * answered missing: a recompute of chunks the store held.) */
static void test_channel_flood(void **st)
{
	char na[64], nb[64];
	kvt_seg *a, *b;
	kvt_l3e *ea, *eb;
	kvt_l3srv *v;
	kvt_l3c *c;
	struct kvt_l3srv_info si = { 0 };
	struct kvt_l3e_info ib;
	kvt_key keys[8];
	uint64_t now;
	int fd;

	(void)st;
	for (uint32_t i = 0; i < 8; i++)
		keys[i] = (kvt_key){ 0xf1000 + i + (uint64_t)getpid() * 1000, 0x4545 };
	chan_nodes("f", keys, 8, 2, na, nb, &a, &b, &ea, &eb, &v);
	/* both connected (and accepted) before the flood */
	fd = raw_asker(v);
	c = kvt__l3c_new();
	assert_non_null(c);
	now = kvt__now_ns();
	assert_int_equal(kvt__l3c_begin(c, b, now), 1);
	for (int i = 0; i < 200 && si.conns < 2; i++) {
		kvt_l3srv_service(v);
		kvt_l3srv_info(v, &si);
		usleep(1000);
	}
	assert_int_equal(si.conns, 2);
	for (uint32_t msg = 0; msg < 16; msg++) {
		struct kvt_l3c_msg m = { .h = { .magic = KVT_L3C_MAGIC, .version = KVT_L3C_VERSION,
						.op = KVT_L3C_ASK, .n = KVT_L3C_MAX } };

		for (uint32_t x = 0; x < KVT_L3C_MAX; x++)
			m.it[x] = (struct kvt_l3c_item){ .lo = 0xbad0000 + msg * KVT_L3C_MAX + x,
							 .hi = 0xf100d, .value = 0 };
		assert_int_equal(send(fd, &m, sizeof(m), 0), (ssize_t)sizeof(m));
	}
	for (int i = 0; i < 200; i++) {   /* the flood taken, the engine not polled */
		kvt_l3srv_service(v);
		kvt_l3srv_info(v, &si);
		if (si.asks == 16 * KVT_L3C_MAX)
			break;
		usleep(1000);
	}
	assert_int_equal(si.asks, 16 * KVT_L3C_MAX);
	assert_int_equal(si.over_share, 16 * KVT_L3C_MAX - KVT_L3E_QUEUE / 2);
	/* the other asker, while the flood's asks wait */
	for (uint32_t i = 0; i < 8; i++)
		assert_int_equal(kvt__l3c_queue(c, &keys[i], i, now), 0);
	assert_int_equal(kvt__l3c_send(c, now), 0);
	channel_settle(v, eb, c, b, keys, 8);
	assert_int_equal(node_check(b, keys, 8, 1), 8);
	kvt_l3e_info(eb, &ib);
	assert_int_equal(ib.ask_drops, 0);
	close(fd);
	kvt__l3c_free(c);
	chan_nodes_close(na, nb, a, b, ea, eb, v);
}

static long long redis_int(redisContext *c, const char *cmd)
{
	redisReply *y = redisCommand(c, cmd);
	long long v = -1;

	if (y && y->type == REDIS_REPLY_INTEGER)
		v = y->integer;
	if (y)
		freeReplyObject(y);
	return v;
}

static void redis_ok(redisContext *c, const char *cmd)
{
	redisReply *y = redisCommand(c, cmd);

	assert_non_null(y);
	if (y->type != REDIS_REPLY_STATUS)
		fail_msg("%s: %s", cmd, y->type == REDIS_REPLY_ERROR ? y->str : "not OK");
	freeReplyObject(y);
}

/* A store at maxmemory.  With allkeys-lru it evicts on its own (kvtier
 * never deletes): node B then finds some chunks whole, some with a shard
 * evicted (a miss: a chunk is there only when all its shards are), some
 * gone -- every one it publishes exact, none refused, none an error.
 * With noeviction the store refuses writes (OOM): puts are dropped and
 * counted, the store stays up, and gets go on. */
#define MM_SLICES 6
#define MM_SLICE  32
static void test_maxmemory(void **st)
{
	char na[64], nb[64];
	kvt_key keys[MM_SLICES * MM_SLICE];
	uint32_t depths[MM_SLICE];
	struct kvt_l3e_info ia, ib;
	redisContext *rc;
	uint32_t ready = 0;
	int p = free_port();
	pid_t r;
	kvt_seg *a, *b;
	kvt_l3e *ea, *eb;

	(void)st;
	r = start_redis(p, 0, "--maxmemory", "3mb");
	rc = connect_ok(p);
	redis_ok(rc, "CONFIG SET maxmemory-policy allkeys-lru");
	two_nodes("m", na, nb, &a, &b);
	for (uint32_t i = 0; i < MM_SLICES * MM_SLICE; i++)
		keys[i] = (kvt_key){ 0xaa000 + i + (uint64_t)getpid() * 1000, 0x6161 };
	for (uint32_t i = 0; i < MM_SLICE; i++)
		depths[i] = i;
	/* 192 chunks of two 16 KiB shards (6.3 MB) through a 3 MB store */
	ea = node_engine_at(a, KVT_ADMIT_ALL, NULL, NULL, p);
	for (uint32_t k = 0; k < MM_SLICES; k++) {
		node_save(a, keys + k * MM_SLICE, MM_SLICE);
		assert_int_equal(kvt_l3e_drain(ea, 1, -1), 0);
	}
	kvt_l3e_info(ea, &ia);
	assert_int_equal(ia.puts, MM_SLICES * MM_SLICE);
	assert_true(redis_int(rc, "DBSIZE") < MM_SLICES * MM_SLICE * 2); /* it evicted */
	eb = node_engine_at(b, KVT_ADMIT_NONE, NULL, NULL, p);
	for (uint32_t k = 0; k < MM_SLICES; k++) {
		assert_true(kvt_l3e_fetch(eb, keys + k * MM_SLICE, depths, MM_SLICE) > 0);
		assert_int_equal(kvt_l3e_drain(eb, 0, -1), 0);
		ready += node_check(b, keys + k * MM_SLICE, MM_SLICE, 0); /* exact, or absent */
	}
	kvt_l3e_info(eb, &ib);
	assert_true(ready > 0 && ready < MM_SLICES * MM_SLICE);
	assert_int_equal(ib.gets, ready);
	assert_int_equal(ib.misses, MM_SLICES * MM_SLICE - ready);
	assert_int_equal(ib.refused, 0);
	assert_int_equal(ib.get_drops, 0);
	assert_int_equal(ib.store.up, 1);
	/* noeviction: writes refused with OOM -- dropped puts, the store up */
	redis_ok(rc, "CONFIG SET maxmemory-policy noeviction");
	for (uint32_t i = 0; i < MM_SLICES * MM_SLICE; i++)
		keys[i].hi ^= 0x10000; /* new chunks */
	for (uint32_t k = 0; k < 2; k++) {
		node_save(a, keys + k * MM_SLICE, MM_SLICE);
		assert_int_equal(kvt_l3e_drain(ea, 1, -1), 0);
	}
	kvt_l3e_info(ea, &ia);
	assert_true(ia.put_drops > 0);
	assert_int_equal(ia.store.up, 1);
	kvt_l3e_close(ea);
	kvt_l3e_close(eb);
	redisFree(rc);
	kill(r, SIGKILL);
	waitpid(r, NULL, 0);
	two_nodes_close(na, nb, a, b);
}

/* A slot evicted while its put is in flight: the engine drops the put (its
 * life ended: the bytes sent may be another chunk's), never records it,
 * and whatever reached the store is exact or refused on the other node --
 * never served wrong.  Deterministic: the puts are submitted by one poll,
 * the slots are reused before the next one takes the completions. */
static void test_put_window(void **st)
{
	char na[64], nb[64];
	kvt_seg *a, *b;
	kvt_l3e *ea, *eb;
	struct kvt_l3e_info ia, ib;
	kvt_key keys[64], other;
	uint32_t depths[64];
	uint64_t pay;
	uint32_t inflight;

	(void)st;
	two_nodes("w", na, nb, &a, &b);
	pay = kvt_seg_chunk_bytes(a);
	for (uint32_t i = 0; i < 64; i++) {
		keys[i] = (kvt_key){ 0x99000 + i + (uint64_t)getpid() * 1000, 0x5151 };
		depths[i] = i;
	}
	node_save(a, keys, 64);
	ea = node_engine(a, KVT_ADMIT_ALL);
	assert_true(kvt_l3e_poll(ea) > 0); /* puts submitted, completions not taken */
	kvt_l3e_info(ea, &ia);
	inflight = ia.inflight;
	assert_true(inflight > 0);
	/* a rank (another process, as ranks are) saves 64 other chunks:
	 * every old slot gets a new life while the puts read them */
	pid_t c = fork();
	assert_true(c >= 0);
	if (c == 0) {
		kvt_seg *r = NULL;
		if (kvt_test_attach(na, KVT_ROLE_CLIENT, 0, 0, 0, &r))
			_exit(2);
		for (uint32_t i = 0; i < 64; i++) {
			other = (kvt_key){ 0xee000 + i + (uint64_t)getppid() * 1000, 0x5151 };
			for (uint32_t sh = 0; sh < 2; sh++) {
				struct kvt_wref w;
				if (kvt_write_begin(r, &other, 100 + i, sh, &w))
					_exit(3);
				memset(kvt_slot_shard_ptr(r, w.slot, sh), 0xcc, pay);
				if (kvt_write_end(r, &w, 1) < 0)
					_exit(4);
			}
		}
		kvt_seg_detach(r);
		_exit(0);
	}
	int status;
	assert_int_equal(waitpid(c, &status, 0), c);
	assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	assert_int_equal(kvt_l3e_drain(ea, 0, -1), 0);
	kvt_l3e_info(ea, &ia);
	assert_int_equal(ia.put_drops, inflight); /* every one of them voided */
	assert_int_equal(ia.puts, 0);
	/* node B: each old chunk exact, refused, or absent -- never wrong */
	eb = node_engine(b, KVT_ADMIT_NONE);
	assert_true(kvt_l3e_fetch(eb, keys, depths, 64) > 0);
	assert_int_equal(kvt_l3e_drain(eb, 0, -1), 0);
	kvt_l3e_info(eb, &ib);
	node_check(b, keys, 64, 0); /* exact, or not there */
	fprintf(stderr, "put window: %u puts voided; node B: %llu exact, %llu refused, "
		"%llu absent\n", inflight, (unsigned long long)ib.gets,
		(unsigned long long)ib.refused, (unsigned long long)ib.misses);
	kvt_l3e_close(ea);
	kvt_l3e_close(eb);
	two_nodes_close(na, nb, a, b);
}

/* The put's other window, between kvt_slot_ready and the seal: the slot
 * gets a new life (another key, other bytes) there -- deterministically,
 * from the engine's test hook.  Sealed as it stands, that would be a valid
 * object of the old key with the new key's bytes, which no check on
 * another node could refuse.  The life check after the seal drops it. */
struct window_arg {
	kvt_seg *s;
	int fired;
	uint64_t pay;
};

static void rewrite_all(void *arg, uint32_t slot)
{
	struct window_arg *wa = arg;

	(void)slot;
	if (wa->fired++)
		return;
	for (uint32_t i = 0; i < 64; i++) { /* every slot to a new life */
		kvt_key other = { 0xdd000 + i + (uint64_t)getpid() * 1000, 0x6161 };
		for (uint32_t sh = 0; sh < 2; sh++) {
			struct kvt_wref w;
			assert_int_equal(kvt_write_begin(wa->s, &other, 200 + i, sh, &w), 0);
			memset(kvt_slot_shard_ptr(wa->s, w.slot, sh), 0xab, wa->pay);
			assert_true(kvt_write_end(wa->s, &w, 1) >= 0);
		}
	}
}

static void test_seal_window(void **st)
{
	char na[64], nb[64];
	struct window_arg wa = { 0 };
	kvt_seg *a, *b;
	kvt_l3e *ea, *eb;
	struct kvt_l3e_info ia, ib;
	kvt_key keys[64];
	uint32_t depths[64];

	(void)st;
	two_nodes("s", na, nb, &a, &b);
	wa.s = a;
	wa.pay = kvt_seg_chunk_bytes(a);
	for (uint32_t i = 0; i < 64; i++) {
		keys[i] = (kvt_key){ 0xaa000 + i + (uint64_t)getpid() * 1000, 0x6161 };
		depths[i] = i;
	}
	node_save(a, keys, 64);
	ea = node_engine_hooked(a, KVT_ADMIT_ALL, rewrite_all, &wa);
	assert_int_equal(kvt_l3e_drain(ea, 1, -1), 0);
	assert_int_equal(wa.fired > 0, 1);
	kvt_l3e_info(ea, &ia);
	assert_true(ia.put_drops >= 1); /* the put whose slot changed under it */
	/* node B: whatever the store holds for the old keys is exact or
	 * refused, never the new key's bytes under an old key */
	eb = node_engine(b, KVT_ADMIT_NONE);
	for (uint32_t i = 0; i < 64; i += 32) {
		kvt_l3e_fetch(eb, keys + i, depths + i, 32);
		assert_int_equal(kvt_l3e_drain(eb, 0, -1), 0);
	}
	kvt_l3e_info(eb, &ib);
	node_check(b, keys, 64, 0); /* exact, or not there */
	fprintf(stderr, "seal window: %llu puts dropped; node B: %llu exact, %llu refused\n",
		(unsigned long long)ia.put_drops, (unsigned long long)ib.gets,
		(unsigned long long)ib.refused);
	kvt_l3e_close(ea);
	kvt_l3e_close(eb);
	two_nodes_close(na, nb, a, b);
}

int main(void)
{
	if (sh("command -v redis-server >/dev/null && command -v redis-cli >/dev/null")) {
		fprintf(stderr, "l3_redis: needs redis-server and redis-cli (Debian redis-server, "
			"redis-tools): skipped\n");
		return 77;
	}
	signal(SIGPIPE, SIG_IGN); /* hiredis' writes to a master the test killed */
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_round_trip),
		cmocka_unit_test(test_forged),
		cmocka_unit_test(test_malformed_replies),
		cmocka_unit_test(test_two_nodes),
		cmocka_unit_test(test_two_nodes_other_model),
		cmocka_unit_test(test_encrypted),
		cmocka_unit_test(test_channel),
		cmocka_unit_test(test_channel_depth),
		cmocka_unit_test(test_channel_flood),
		cmocka_unit_test(test_maxmemory),
		cmocka_unit_test(test_put_window),
		cmocka_unit_test(test_seal_window),
		cmocka_unit_test(test_reshard),
		cmocka_unit_test(test_master_killed),
		cmocka_unit_test(test_auth),
	};

	return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
