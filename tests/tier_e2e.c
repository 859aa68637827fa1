/* tier_e2e: the engine API end to end in separate processes (one scheduler, 4 ranks, host DMA): save, lookup, load, leases, faults, misconfiguration, GLM-5.x layout. */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "kvtier.h"

#define WORLD 4
#define CHUNK 64        /* tokens per chunk */
#define BLOCK 16        /* engine block size */
#define LAYERS 2        /* model layers: K and V each -> 4 "layers" */
#define HEADS 2         /* KV heads per rank */
#define HDIM 16         /* head dim, bf16 */
#define NBLOCKS 64
#define NCHUNKS 6

static char NAME[64];

/* Per layer: [num_blocks, block_size, heads, head_dim] of 2-byte values. */
#define BPT (HEADS * HDIM * 2)
#define PAGE ((uint64_t)BLOCK * BPT)

struct kv {
	uint8_t *layer[2 * LAYERS];
	uint64_t base[2 * LAYERS];
};

static struct kv kv_alloc(void)
{
	struct kv k;

	for (int l = 0; l < 2 * LAYERS; l++) {
		k.layer[l] = calloc(NBLOCKS, PAGE);
		k.base[l] = (uint64_t)(uintptr_t)k.layer[l];
	}
	return k;
}

static uint8_t pattern(uint32_t rank, uint32_t chunk, uint32_t layer, uint64_t byte)
{
	return (uint8_t)(rank * 131 + chunk * 31 + layer * 7 + byte * 13 + 1);
}

static const struct kvt_group_desc groups_sharded[1] = {
	{ .n_layers = 2 * LAYERS, .bytes_per_token = BPT, .tokens_per_block = BLOCK },
};

static const struct kvt_group_desc groups_mla[1] = {
	{ .n_layers = 2 * LAYERS, .bytes_per_token = BPT, .tokens_per_block = BLOCK,
	  .replicated = 1 },
};

static struct kvt_config base_cfg(uint32_t role, int rank, uint32_t flags)
{
	struct kvt_config c;

	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.flags = flags | KVT_F_NO_ENV;
	c.role = role;
	c.instance = 0;
	c.rank = rank;
	c.world = WORLD;
	c.chunk_tokens = CHUNK;
	c.segment = NAME;
	c.model = "test-model-bf16";
	c.dma = "host";
	c.n_groups = 1;
	c.groups = groups_sharded;
	c.n_slots = 64;
	return c;
}

static kvt_tier *open_ok(const struct kvt_config *c)
{
	kvt_tier *t = NULL;
	int r = kvt_open(c, &t);

	if (r)
		fail_msg("kvt_open: %d %s", r, kvt_last_error());
	return t;
}

/* Shared state between the test (scheduler) and its rank processes. */
struct shared {
	volatile int phase;           /* commands, see rank_main */
	volatile int acks[WORLD];
	volatile int fail[WORLD];
	volatile uint64_t lease;
	volatile int nload;
	kvt_key keys[NCHUNKS];
};
static struct shared *sh;

static void wait_acks(int phase, int nranks)
{
	for (int spins = 0; spins < 200000; spins++) {
		int ok = 1;
		for (int r = 0; r < nranks; r++)
			ok &= sh->acks[r] >= phase;
		if (ok)
			return;
		usleep(100);
	}
	fail_msg("ranks did not reach phase %d", phase);
}

/* Rank process: phase 1 save (if its bit is in save_mask), phase 2 load
 * lease into fresh blocks and verify, phase 3 exit. */
static int save_mask;

#define MODE_REPLICATED 0x1000u

static void rank_main(uint32_t rank, uint32_t flags)
{
	struct kvt_config c = base_cfg(KVT_TIER_RANK, (int)rank, 0);
	if (flags & MODE_REPLICATED)
		c.groups = groups_mla;
	kvt_tier *t = NULL;
	struct kv k = kv_alloc();
	uint32_t table[NCHUNKS * (CHUNK / BLOCK)], fresh[NCHUNKS * (CHUNK / BLOCK)];
	const uint32_t *tabs[1];
	int seen = 0;

	prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed test */
	if (kvt_open(&c, &t) || !t) {
		sh->fail[rank] = 100;
		_exit(1);
	}
	struct kvt_group_buffers gb = { .layer_base = k.base, .block_stride = PAGE, .n_blocks = NBLOCKS };
	if (kvt_register_kv(t, 1, &gb)) {
		sh->fail[rank] = 101;
		_exit(1);
	}
	/* the engine's prompt lives in blocks 10.., scattered: chunk i uses
	 * blocks 10 + 2*j (every other block) */
	for (uint32_t i = 0; i < NCHUNKS * (CHUNK / BLOCK); i++) {
		table[i] = 10 + 2 * i < NBLOCKS ? 10 + 2 * i : i;
		fresh[i] = NBLOCKS - 1 - i;
	}
	for (uint32_t l = 0; l < 2 * LAYERS; l++)
		for (uint32_t i = 0; i < NCHUNKS * (CHUNK / BLOCK); i++)
			for (uint64_t b = 0; b < PAGE; b++)
				k.layer[l][table[i] * PAGE + b] = pattern(rank, i, l, b);
	for (;;) {
		int ph = sh->phase;
		if (ph == seen) {
			usleep(100);
			continue;
		}
		seen = ph;
		if (ph == 1 && (save_mask & (1 << rank))) {
			kvt_op op;
			tabs[0] = table;
			int n = kvt_save(t, (const kvt_key *)sh->keys, NCHUNKS, 0, tabs, &op);
			if (n < 0 || (n && kvt_wait(t, op, -1)))
				sh->fail[rank] = 1;
		} else if (ph == 2) {
			kvt_op op;
			tabs[0] = fresh;
			uint32_t src = (flags & MODE_REPLICATED) ? 0 : rank; /* replicated: rank 0's bytes */
			int r = kvt_load(t, sh->lease, (uint32_t)sh->nload, tabs, &op);
			if (r || kvt_wait(t, op, -1)) {
				sh->fail[rank] = 2;
			} else {
				for (uint32_t l = 0; l < 2 * LAYERS; l++)
					for (uint32_t i = 0; i < (uint32_t)sh->nload * (CHUNK / BLOCK); i++)
						for (uint64_t b = 0; b < PAGE; b++)
							if (k.layer[l][fresh[i] * PAGE + b] !=
							    pattern(src, i, l, b))
								sh->fail[rank] = 3;
			}
		} else if (ph == 3) {
			sh->acks[rank] = ph;
			kvt_close(t);
			_exit(0);
		}
		sh->acks[rank] = ph;
	}
}

static pid_t pids[WORLD];

static void start_ranks(uint32_t flags)
{
	sh->phase = 0;
	memset((void *)sh->acks, 0, sizeof(sh->acks));
	memset((void *)sh->fail, 0, sizeof(sh->fail));
	for (uint32_t r = 0; r < WORLD; r++) {
		pids[r] = fork();
		if (pids[r] == 0)
			rank_main(r, flags);
	}
}

static void stop_ranks(void)
{
	sh->phase = 3;
	for (int r = 0; r < WORLD; r++) {
		int st;
		assert_int_equal(waitpid(pids[r], &st, 0), pids[r]);
		assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
		assert_int_equal(sh->fail[r], 0);
	}
}

static int setup(void **st)
{
	(void)st;
	snprintf(NAME, sizeof(NAME), "t-e2e-%d", (int)getpid());
	sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	return sh == MAP_FAILED;
}

static int teardown(void **st)
{
	(void)st;
	char path[128];
	/* the creator puts the segment on huge pages when it finds them */
	for (int i = 0; i < 2; i++) { /* and test_bad_arguments' second segment */
		snprintf(path, sizeof(path), "/dev/shm/kvtier.%s%s", NAME, i ? "-b" : "");
		unlink(path);
		snprintf(path, sizeof(path), "/dev/hugepages/kvtier.%s%s", NAME, i ? "-b" : "");
		unlink(path);
	}
	munmap((void *)sh, sizeof(*sh));
	return 0;
}

static void make_keys(kvt_tier *t)
{
	uint32_t tokens[NCHUNKS * CHUNK + 5];

	for (uint32_t i = 0; i < NCHUNKS * CHUNK + 5; i++)
		tokens[i] = i * 7 + 3;
	assert_int_equal(kvt_hash_tokens(t, tokens, NCHUNKS * CHUNK + 5, NULL,
					 (kvt_key *)sh->keys, NCHUNKS), NCHUNKS);
}

static void test_cycle(void **st)
{
	(void)st;
	struct kvt_config c = base_cfg(KVT_TIER_CLIENT, -1, KVT_F_CREATE | KVT_F_REPLACE);
	kvt_tier *owner = open_ok(&c), *sched;
	kvt_lease_id lease;
	struct kvt_stats s = { .size = sizeof(s) };

	c = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
	sched = open_ok(&c);
	save_mask = 0x7; /* ranks 0..2 save first */
	start_ranks(0);
	make_keys(sched);
	/* empty tier */
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, NCHUNKS, &lease), 0);
	assert_int_equal(lease, 0);
	sh->phase = 1;
	wait_acks(1, WORLD);
	/* three of four shards: never visible */
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, NCHUNKS, &lease), 0);
	save_mask = 0xf; /* (inherited only by new forks: rank 3 saves in a second round) */
	stop_ranks();
	save_mask = 0x8;
	start_ranks(0);
	sh->phase = 1;
	wait_acks(1, WORLD);
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, NCHUNKS, &lease), NCHUNKS);
	assert_int_not_equal(lease, 0);
	/* a prefix of the lease can be loaded too; here all of it */
	sh->lease = lease;
	sh->nload = NCHUNKS;
	sh->phase = 2;
	wait_acks(2, WORLD);
	for (int r = 0; r < WORLD; r++)
		assert_int_equal(sh->fail[r], 0);
	/* every rank loaded: the lease released its pins */
	assert_int_equal(kvt_stats(sched, &s), 0);
	assert_int_equal(s.slots_pinned, 0);
	assert_int_equal(s.leases_live, 0);
	assert_int_equal(s.saved_chunks, WORLD * NCHUNKS);
	assert_int_equal(s.loaded_chunks, WORLD * NCHUNKS);
	assert_int_equal(s.bytes_loaded, (uint64_t)WORLD * NCHUNKS * CHUNK * BPT * 2 * LAYERS);
	assert_int_equal(kvt_release(sched, lease), -EALREADY);
	stop_ranks();
	/* saving again is deduplicated */
	kvt_close(sched);
	kvt_close(owner);
}

static void test_leases(void **st)
{
	(void)st;
	struct kvt_config c = base_cfg(KVT_TIER_CLIENT, -1, KVT_F_CREATE | KVT_F_REPLACE);
	kvt_tier *owner = open_ok(&c), *sched;
	kvt_lease_id a, b, d;
	struct kvt_stats s = { .size = sizeof(s) };

	c = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
	sched = open_ok(&c);
	save_mask = 0xf;
	start_ranks(0);
	make_keys(sched);
	sh->phase = 1;
	wait_acks(1, WORLD);
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, NCHUNKS, &a), NCHUNKS);
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, 2, &b), 2);
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, 1, &d), 1);
	/* abort -> release; twice -> counted, nothing else */
	assert_int_equal(kvt_release(sched, a), 0);
	assert_int_equal(kvt_release(sched, a), -EALREADY);
	assert_int_equal(kvt_stats(sched, &s), 0);
	assert_int_equal(s.double_unpins, 1);
	assert_int_equal(s.slots_pinned, 2);
	/* d is in every step's load set, b in none: b goes after two steps */
	assert_int_equal(kvt_step(sched, &d, 1), 0);
	assert_int_equal(kvt_step(sched, &d, 1), 1);
	assert_int_equal(kvt_stats(sched, &s), 0);
	assert_int_equal(s.stale_unpins, 1);
	assert_int_equal(s.leases_live, 1);
	/* the ranks load d: released when all four did */
	sh->lease = d;
	sh->nload = 1;
	sh->phase = 2;
	wait_acks(2, WORLD);
	assert_int_equal(kvt_stats(sched, &s), 0);
	assert_int_equal(s.leases_live, 0);
	assert_int_equal(s.slots_pinned, 0);
	stop_ranks();
	kvt_close(sched);
	kvt_close(owner);
}

static void test_replicated(void **st)
{
	(void)st;
	struct kvt_config c = base_cfg(KVT_TIER_CLIENT, -1, KVT_F_CREATE | KVT_F_REPLACE);
	c.groups = groups_mla;
	kvt_tier *owner = open_ok(&c), *sched;
	kvt_lease_id lease;

	c = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
	c.groups = groups_mla;
	sched = open_ok(&c);
	save_mask = 0x1; /* one rank's save suffices */
	start_ranks(MODE_REPLICATED);
	make_keys(sched);
	sh->phase = 1;
	wait_acks(1, WORLD);
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, NCHUNKS, &lease), NCHUNKS);
	sh->lease = lease;
	sh->nload = NCHUNKS;
	sh->phase = 2;
	wait_acks(2, WORLD);
	stop_ranks();
	struct kvt_stats s = { .size = sizeof(s) };
	assert_int_equal(kvt_stats(sched, &s), 0);
	assert_int_equal(s.saved_chunks, NCHUNKS);
	assert_int_equal(s.leases_live, 0);
	kvt_close(sched);
	kvt_close(owner);
}

static void test_rank_killed_mid_save(void **st)
{
	(void)st;
	struct kvt_config c = base_cfg(KVT_TIER_CLIENT, -1, KVT_F_CREATE | KVT_F_REPLACE);
	kvt_tier *owner = open_ok(&c), *sched;
	kvt_lease_id lease;
	pid_t pid;
	int status;

	c = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
	sched = open_ok(&c);
	make_keys(sched);
	/* rank 2 claims every chunk and dies before its copies complete */
	pid = fork();
	if (pid == 0) {
		struct kvt_config rc = base_cfg(KVT_TIER_RANK, 2, 0);
		rc.max_inflight = 1;
		kvt_tier *t = NULL;
		struct kv k = kv_alloc();
		uint32_t table[NCHUNKS * (CHUNK / BLOCK)];
		const uint32_t *tabs[1] = { table };
		kvt_op op;
		for (uint32_t i = 0; i < NCHUNKS * (CHUNK / BLOCK); i++)
			table[i] = i;
		if (kvt_open(&rc, &t))
			_exit(1);
		struct kvt_group_buffers gb = { .layer_base = k.base, .block_stride = PAGE, .n_blocks = NBLOCKS };
		if (kvt_register_kv(t, 1, &gb))
			_exit(2);
		int n = kvt_save(t, (const kvt_key *)sh->keys, NCHUNKS, 0, tabs, &op);
		if (n != NCHUNKS) {
			fprintf(stderr, "save: %d %s\n", n, kvt_last_error());
			_exit(3);
		}
		raise(SIGKILL);
	}
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFSIGNALED(status));
	/* its chunks are never served */
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, NCHUNKS, &lease), 0);
	struct kvt_stats s = { .size = sizeof(s) };
	assert_int_equal(kvt_stats(sched, &s), 0);
	assert_int_equal(s.slots_filling, NCHUNKS);
	/* the reaper frees what it left */
	assert_int_equal(kvt_reap(sched), 1);
	assert_int_equal(kvt_stats(sched, &s), 0);
	assert_int_equal(s.reaped_ranks, 1);
	assert_int_equal(s.slots_filling, 0);
	assert_int_equal(s.slots_free, s.slots);
	/* the other ranks carry on; without rank 2's shard nothing is visible */
	save_mask = 0xb;
	start_ranks(0);
	sh->phase = 1;
	wait_acks(1, WORLD);
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, NCHUNKS, &lease), 0);
	stop_ranks();
	/* the survivors carry on: a full save now publishes every chunk */
	save_mask = 0xf;
	start_ranks(0);
	sh->phase = 1;
	wait_acks(1, WORLD);
	assert_int_equal(kvt_lookup(sched, (const kvt_key *)sh->keys, NCHUNKS, &lease), NCHUNKS);
	sh->lease = lease;
	sh->nload = NCHUNKS;
	sh->phase = 2;
	wait_acks(2, WORLD);
	stop_ranks();
	kvt_close(sched);
	kvt_close(owner);
}

static void expect_open_error(struct kvt_config *c, int err, const char *what)
{
	kvt_tier *t = NULL;
	int r = kvt_open(c, &t);

	if (r != err || !strstr(kvt_last_error(), what))
		fail_msg("open: expected %d naming '%s', got %d '%s'", err, what, r, kvt_last_error());
	assert_null(t);
}

static void test_misconfigured(void **st)
{
	(void)st;
	struct kvt_config c = base_cfg(KVT_TIER_CLIENT, -1, KVT_F_CREATE | KVT_F_REPLACE);
	kvt_tier *owner = open_ok(&c);

	c = base_cfg(KVT_TIER_RANK, 0, 0);
	c.world = 1; /* a rank that thinks world=1 */
	expect_open_error(&c, -EINVAL, "world");
	c = base_cfg(KVT_TIER_RANK, 4, 0);
	expect_open_error(&c, -EINVAL, "KVTIER_RANK");
	c = base_cfg(KVT_TIER_RANK, 0, 0);
	static const struct kvt_group_desc other[1] = {
		{ .n_layers = 2 * LAYERS, .bytes_per_token = BPT * 2, .tokens_per_block = BLOCK } };
	c.groups = other; /* another model's layout */
	expect_open_error(&c, -ESTALE, "fingerprint");
	c = base_cfg(KVT_TIER_RANK, 0, 0);
	c.model = "another-model";
	expect_open_error(&c, -ESTALE, "fingerprint");
	{
		/* a scheduler that does not describe the layout attaches and
		 * reads whose segment it joined (kvt_segment_model) */
		kvt_tier *s = NULL;
		char buf[64];

		c = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
		c.n_groups = 0;
		c.groups = NULL;
		c.model = "another-model";
		assert_int_equal(kvt_open(&c, &s), 0);
		assert_int_equal(kvt_segment_model(s, buf, sizeof(buf)),
				 (int)strlen("test-model-bf16"));
		assert_string_equal(buf, "test-model-bf16");
		assert_int_equal(kvt_segment_model(s, buf, 5), 4); /* bounded */
		assert_int_equal(kvt_segment_model(NULL, buf, sizeof(buf)), -EINVAL);
		kvt_close(s);
	}
	c = base_cfg(KVT_TIER_RANK, 0, 0);
	c.chunk_tokens = 32;
	expect_open_error(&c, -ESTALE, "fingerprint");
	c = base_cfg(KVT_TIER_RANK, 0, 0);
	c.segment = "../etc/passwd";
	expect_open_error(&c, -EINVAL, "segment");
	c = base_cfg(KVT_TIER_RANK, 0, 0);
	c.n_groups = 0;
	expect_open_error(&c, -EINVAL, "groups");
	/* environment: strictly validated, named */
	c = base_cfg(KVT_TIER_RANK, -1, 0);
	c.flags &= ~KVT_F_NO_ENV;
	c.world = 0;
	c.dma = NULL;         /* fields left zero come from the environment */
	c.chunk_tokens = 0;
	setenv("KVTIER_CHUNK_TOKENS", "64", 1);
	setenv("KVTIER_RANK", "1", 1);
	setenv("KVTIER_WORLD", "4x", 1);
	expect_open_error(&c, -EINVAL, "KVTIER_WORLD");
	setenv("KVTIER_WORLD", "4", 1);
	setenv("KVTIER_DMA", "gpu", 1);
	expect_open_error(&c, -EINVAL, "KVTIER_DMA");
	setenv("KVTIER_DMA", "host", 1);
	setenv("KVTIER_CHUNK_TOKENS", "-64", 1);
	expect_open_error(&c, -EINVAL, "KVTIER_CHUNK_TOKENS");
	setenv("KVTIER_CHUNK_TOKENS", "64", 1);
	setenv("KVTIER_MAX_INFLIGHT", "0", 1);
	expect_open_error(&c, -EINVAL, "KVTIER_MAX_INFLIGHT");
	unsetenv("KVTIER_MAX_INFLIGHT");
	setenv("KVTIER_NUMA_NODES", "0,,1", 1);
	expect_open_error(&c, -EINVAL, "KVTIER_NUMA_NODES");
	unsetenv("KVTIER_NUMA_NODES");
	setenv("KVTIER_ROLE", "ranker", 1);
	c.role = 0;
	expect_open_error(&c, -EINVAL, "KVTIER_ROLE");
	setenv("KVTIER_ROLE", "rank", 1);
	kvt_tier *t = open_ok(&c); /* all from the environment */
	kvt_close(t);
	unsetenv("KVTIER_DMA");
	unsetenv("KVTIER_ROLE");
	unsetenv("KVTIER_RANK");
	unsetenv("KVTIER_WORLD");
	unsetenv("KVTIER_CHUNK_TOKENS");
	/* a scheduler cannot save; nothing registered cannot save */
	c = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
	t = open_ok(&c);
	struct kvt_group_buffers gb = { 0 };
	assert_int_equal(kvt_register_kv(t, 1, &gb), -EPERM);
	kvt_op op;
	const uint32_t *tabs[1] = { NULL };
	assert_int_equal(kvt_save(t, (const kvt_key *)sh->keys, 1, 0, tabs, &op), -EPERM);
	kvt_close(t);
	/* the version handshake */
	c = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
	assert_int_equal(kvt_open_v(&c, KVT_API_VERSION + 1, &t), -ENOTSUP);
	c.flags |= 0x80000000u;
	expect_open_error(&c, -EINVAL, "flags");
	c = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
	c.size = 8;
	expect_open_error(&c, -EINVAL, "size");
	assert_non_null(kvt_strerror(-ESTALE));
	kvt_close(owner);
}

/* Bad arguments get a clear error, never a crash: NULL ops and live sets
 * (issue 9, finding 10), a lease id of another segment (finding 9), tier
 * sizes no segment can hold (finding 8). */
static void test_bad_arguments(void **st)
{
	(void)st;
	struct kvt_config c = base_cfg(KVT_TIER_CLIENT, 0, KVT_F_CREATE | KVT_F_REPLACE);
	c.groups = groups_mla; /* one rank's save makes a chunk */
	kvt_tier *t = open_ok(&c), *u;
	struct kv kv = kv_alloc();
	struct kvt_group_buffers gb = { kv.base, PAGE, NBLOCKS };
	uint32_t table[CHUNK / BLOCK];
	const uint32_t *tabs[1] = { table };
	kvt_key keys[2];
	uint32_t tokens[2 * CHUNK];
	kvt_lease_id lease, other;
	kvt_op op;

	for (uint32_t i = 0; i < 2 * CHUNK; i++)
		tokens[i] = i * 7 + 1;
	for (uint32_t i = 0; i < CHUNK / BLOCK; i++)
		table[i] = i;
	assert_int_equal(kvt_register_kv(t, 1, &gb), 0);
	assert_int_equal(kvt_hash_tokens(t, tokens, 2 * CHUNK, NULL, keys, 2), 2);
	/* NULL op: refused, nothing claimed or leaked */
	assert_int_equal(kvt_save(t, keys, 1, 0, tabs, NULL), -EINVAL);
	assert_non_null(strstr(kvt_last_error(), "op is NULL"));
	assert_int_equal(kvt_save(t, keys, 1, 0, tabs, &op), 1);
	assert_int_equal(kvt_wait(t, op, -1), 0);
	assert_int_equal(kvt_lookup(t, keys, 1, &lease), 1);
	assert_int_equal(kvt_load(t, lease, 1, tabs, NULL), -EINVAL);
	assert_int_equal(kvt_step(t, NULL, 3), -EINVAL);
	assert_non_null(strstr(kvt_last_error(), "live is NULL"));
	assert_int_equal(kvt_step(t, NULL, 0), 0);
	assert_int_equal(kvt_lookup(t, NULL, 1, &lease), -EINVAL);
	assert_int_equal(kvt_lookup(NULL, keys, 1, &lease), -EINVAL);
	assert_int_equal(kvt_save(NULL, keys, 1, 0, tabs, &op), -EINVAL);
	assert_int_equal(kvt_release(NULL, lease), -EINVAL);
	assert_int_equal(kvt_step(NULL, NULL, 0), -EINVAL);
	assert_int_equal(kvt_poll(NULL, op), -EINVAL);
	assert_int_equal(kvt_stats(NULL, NULL), -EINVAL);
	assert_int_equal(kvt_hash_tokens(NULL, tokens, CHUNK, NULL, keys, 1), -EINVAL);
	/* a lease of another segment: refused, this one's untouched */
	char other_name[80];
	snprintf(other_name, sizeof(other_name), "%s-b", NAME);
	struct kvt_config c2 = base_cfg(KVT_TIER_CLIENT, 0, KVT_F_CREATE | KVT_F_REPLACE);
	c2.segment = other_name;
	c2.groups = groups_mla;
	u = open_ok(&c2);
	assert_int_equal(kvt_register_kv(u, 1, &gb), 0);
	assert_int_equal(kvt_save(u, keys, 1, 0, tabs, &op), 1);
	assert_int_equal(kvt_wait(u, op, -1), 0);
	assert_int_equal(kvt_lookup(u, keys, 1, &other), 1);
	assert_int_equal(kvt_release(t, other), -EINVAL);
	assert_int_equal(kvt_load(t, other, 1, tabs, &op), -EINVAL);
	assert_int_equal(kvt_release(u, other), 0);
	assert_int_equal(kvt_release(t, lease), 0);
	kvt_close(u);
	kvt_close(t);
	/* sizes no segment can hold: refused with the reason, not clamped */
	c = base_cfg(KVT_TIER_CLIENT, 0, KVT_F_CREATE | KVT_F_REPLACE);
	c.n_slots = 0;
	c.tier_bytes = UINT64_MAX;
	expect_open_error(&c, -EINVAL, "2^30 chunks");
	c.tier_bytes = 1ULL << 46; /* 64 TiB: 2^30 chunks of 64 KiB; no host holds it */
	kvt_tier *big = NULL;
	int r = kvt_open(&c, &big);
	assert_int_equal(r, -EFBIG);
	assert_non_null(strstr(kvt_last_error(), "more than"));
	for (int l = 0; l < 2 * LAYERS; l++)
		free(kv.layer[l]);
}

/* Issue 14's edges: every one refused (or warned about) with a message
 * that names the field, the variable or the path. */
static void test_messages(void **st)
{
	(void)st;
	struct kvt_config c = base_cfg(KVT_TIER_CLIENT, 0, KVT_F_CREATE | KVT_F_REPLACE);
	c.groups = groups_mla;
	c.segment_dir = "/dev/shm"; /* its mode is changed below */
	kvt_tier *t = open_ok(&c), *u = NULL;
	struct kv kv = kv_alloc();
	struct kvt_group_buffers gb = { kv.base, PAGE, NBLOCKS };
	uint32_t table[CHUNK / BLOCK], tokens[CHUNK];
	const uint32_t *tabs[1] = { table };
	char path[160];
	kvt_key key;
	kvt_op op;

	/* register_kv(t, 1, NULL): the NULL named, not a count */
	assert_int_equal(kvt_register_kv(t, 1, NULL), -EINVAL);
	assert_non_null(strstr(kvt_last_error(), "group buffers are NULL"));
	assert_int_equal(kvt_register_kv(t, 1, &gb), 0);
	/* a block id beyond the KV cache: the planner's reason reaches wait */
	for (uint32_t i = 0; i < CHUNK; i++)
		tokens[i] = i * 3 + 11;
	assert_int_equal(kvt_hash_tokens(t, tokens, CHUNK, NULL, &key, 1), 1);
	for (uint32_t i = 0; i < CHUNK / BLOCK; i++)
		table[i] = i;
	table[2] = NBLOCKS + 5;
	assert_int_equal(kvt_save(t, &key, 1, 0, tabs, &op), 1);
	assert_int_equal(kvt_wait(t, op, -1), -ERANGE);
	assert_non_null(strstr(kvt_last_error(), "block id 69 (entry 2"));
	assert_non_null(strstr(kvt_strerror(-ERANGE), "block id"));
	/* codes the library returns have words */
	const int codes[] = { -ELOOP, -EACCES, -EEXIST, -ENOTDIR, -EISDIR, -EFBIG, -ENAMETOOLONG };
	for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++)
		assert_null(strstr(kvt_strerror(codes[i]), "unknown"));
	kvt_close(t);

	/* a segment others may write is refused: world-writable always,
	 * group-writable unless group access is asked for */
	snprintf(path, sizeof(path), "/dev/shm/kvtier.%s", NAME);
	{
		struct kvt_config a = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
		a.segment_dir = "/dev/shm";
		a.groups = groups_mla;
		assert_int_equal(chmod(path, 0666), 0);
		expect_open_error(&a, -EACCES, "world-writable (mode 0666)");
		assert_non_null(strstr(kvt_last_error(), path)); /* the whole path */
		assert_int_equal(chmod(path, 0660), 0);
		expect_open_error(&a, -EACCES, "group-writable");
		a.flags |= KVT_F_GROUP;
		assert_int_equal(kvt_open(&a, &u), 0);
		kvt_close(u);
		assert_int_equal(chmod(path, 0600), 0);
	}

	/* KVTIER_SEGMENT_DIR: named with the path when it is not a directory;
	 * huge pages asked for on a dir that cannot give them: refused */
	c = base_cfg(KVT_TIER_CLIENT, 0, KVT_F_CREATE | KVT_F_REPLACE);
	c.flags &= ~KVT_F_NO_ENV;
	c.groups = groups_mla;
	setenv("KVTIER_SEGMENT_DIR", "/nonexistent-kvtier-dir", 1);
	expect_open_error(&c, -ENOENT, "KVTIER_SEGMENT_DIR=/nonexistent-kvtier-dir");
	setenv("KVTIER_SEGMENT_DIR", "/etc/hostname", 1);
	expect_open_error(&c, -ENOTDIR, "KVTIER_SEGMENT_DIR=/etc/hostname: not a directory");
	setenv("KVTIER_SEGMENT_DIR", "/dev/shm", 1);
	setenv("KVTIER_HUGEPAGES", "on", 1);
	expect_open_error(&c, -EINVAL, "is not a hugetlbfs mount");
	setenv("KVTIER_HUGEPAGES", "1", 1); /* not a word it takes, dir or not */
	expect_open_error(&c, -EINVAL, "KVTIER_HUGEPAGES='1': expected auto, on or off");
	unsetenv("KVTIER_HUGEPAGES");
	unsetenv("KVTIER_SEGMENT_DIR");
	/* set but empty: refused, never a silent default */
	setenv("KVTIER_CUDA_LIBRARY", "", 1);
	c = base_cfg(KVT_TIER_CLIENT, 0, KVT_F_CREATE | KVT_F_REPLACE);
	c.groups = groups_mla;
	c.dma = "auto"; /* a backend that would read it */
	t = open_ok(&c);
	assert_int_equal(kvt_register_kv(t, 1, &gb), -EINVAL);
	assert_non_null(strstr(kvt_last_error(), "KVTIER_CUDA_LIBRARY is set but empty"));
	kvt_close(t);
	c.dma = "host"; /* the host backend never reads it: not its business */
	t = open_ok(&c);
	assert_int_equal(kvt_register_kv(t, 1, &gb), 0);
	kvt_close(t);
	unsetenv("KVTIER_CUDA_LIBRARY");
	for (int l = 0; l < 2 * LAYERS; l++)
		free(kv.layer[l]);
}

/* kvt_unlink: by name, wherever kvt_open put the segment (huge pages when
 * free, else /dev/shm), a bad name refused, a directory left alone. */
static void test_unlink(void **st)
{
	(void)st;
	struct kvt_config c = base_cfg(KVT_TIER_CLIENT, 0, KVT_F_CREATE | KVT_F_REPLACE);
	kvt_tier *t = open_ok(&c), *u = NULL;
	char dir[160];

	/* removed while mapped: the handle keeps working on its copy */
	assert_int_equal(kvt_unlink(NAME, NULL), 0);
	assert_int_equal(kvt_step(t, NULL, 0), 0);
	kvt_close(t);
	c = base_cfg(KVT_TIER_SCHEDULER, -1, 0);
	assert_int_equal(kvt_open(&c, &u), -ENOENT);
	assert_int_equal(kvt_unlink(NAME, NULL), -ENOENT);
	assert_non_null(strstr(kvt_last_error(), NAME));
	assert_int_equal(kvt_unlink("a/b", NULL), -EINVAL);
	assert_int_equal(kvt_unlink(NULL, NULL), -EINVAL);
	assert_int_equal(kvt_unlink(NAME, "relative"), -EINVAL);
	/* in a given directory */
	c = base_cfg(KVT_TIER_CLIENT, 0, KVT_F_CREATE | KVT_F_REPLACE);
	c.segment_dir = "/dev/shm";
	t = open_ok(&c);
	kvt_close(t);
	assert_int_equal(kvt_unlink(NAME, "/dev/shm"), 0);
	/* something that is not a segment file: left alone */
	snprintf(dir, sizeof(dir), "/dev/shm/kvtier.%s", NAME);
	assert_int_equal(mkdir(dir, 0700), 0);
	assert_int_equal(kvt_unlink(NAME, NULL), -EISDIR);
	assert_int_equal(access(dir, F_OK), 0);
	rmdir(dir);
}

static void test_glm_layout(void **st)
{
	(void)st;
	/* GLM-5.x: 78 MLA caches of 576 B/token and 21 indexer caches of
	 * 132 B/token (fp8), both replicated: 47,700 B/token. */
	static const struct kvt_group_desc glm[2] = {
		{ .n_layers = 78, .bytes_per_token = 576, .tokens_per_block = 64, .replicated = 1 },
		{ .n_layers = 21, .bytes_per_token = 132, .tokens_per_block = 64, .replicated = 1 } };
	struct kvt_config c;
	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.flags = KVT_F_NO_ENV | KVT_F_CREATE | KVT_F_REPLACE;
	c.role = KVT_TIER_RANK;
	c.rank = 0;
	c.instance = 0;
	c.world = 2;
	c.chunk_tokens = 64;
	c.segment = NAME;
	c.model = "glm-5";
	c.dma = "host";
	c.n_groups = 2;
	c.groups = glm;
	c.n_slots = 8;
	kvt_tier *t = open_ok(&c);
	c.flags = KVT_F_NO_ENV;
	c.rank = 1;
	kvt_tier *t1 = open_ok(&c);
	const uint32_t nb = 8;
	uint64_t base0[78], base1[21];
	uint8_t *mem[99];
	for (int l = 0; l < 99; l++) {
		uint32_t bpt = l < 78 ? 576 : 132;
		mem[l] = malloc((size_t)nb * 64 * bpt);
		for (size_t b = 0; b < (size_t)nb * 64 * bpt; b++)
			mem[l][b] = (uint8_t)(b * 7 + (size_t)l * 3);
		if (l < 78)
			base0[l] = (uint64_t)(uintptr_t)mem[l];
		else
			base1[l - 78] = (uint64_t)(uintptr_t)mem[l];
	}
	struct kvt_group_buffers gb[2] = {
		{ .layer_base = base0, .block_stride = 64 * 576, .n_blocks = nb },
		{ .layer_base = base1, .block_stride = 64 * 132, .n_blocks = nb } };
	int r = kvt_register_kv(t, 2, gb);
	if (r)
		fail_msg("register: %s", kvt_last_error());
	struct kvt_stats s = { .size = sizeof(s) };
	assert_int_equal(kvt_stats(t, &s), 0);
	assert_int_equal(s.chunk_bytes, 64 * 47700); /* 3,052,800 bytes per chunk */
	uint32_t tokens[128];
	for (int i = 0; i < 128; i++)
		tokens[i] = (uint32_t)i;
	kvt_key keys[2];
	assert_int_equal(kvt_hash_tokens(t, tokens, 128, NULL, keys, 2), 2);
	uint32_t tab[2] = { 3, 5 };
	const uint32_t *tabs[2] = { tab, NULL };
	kvt_op op;
	assert_int_equal(kvt_save(t, keys, 2, 0, tabs, &op), 2);
	assert_int_equal(kvt_wait(t, op, -1), 0);
	kvt_lease_id lease;
	assert_int_equal(kvt_lookup(t, keys, 2, &lease), 2);
	/* load into blocks 0 and 7 of a fresh copy held by "rank 1" */
	uint64_t fb0[78], fb1[21];
	uint8_t *fresh[99];
	for (int l = 0; l < 99; l++) {
		uint32_t bpt = l < 78 ? 576 : 132;
		fresh[l] = calloc((size_t)nb * 64, bpt);
		if (l < 78)
			fb0[l] = (uint64_t)(uintptr_t)fresh[l];
		else
			fb1[l - 78] = (uint64_t)(uintptr_t)fresh[l];
	}
	struct kvt_group_buffers fg[2] = {
		{ .layer_base = fb0, .block_stride = 64 * 576, .n_blocks = nb },
		{ .layer_base = fb1, .block_stride = 64 * 132, .n_blocks = nb } };
	assert_int_equal(kvt_register_kv(t1, 2, fg), 0);
	uint32_t ftab[2] = { 0, 7 };
	const uint32_t *ftabs[2] = { ftab, NULL };
	assert_int_equal(kvt_load(t1, lease, 2, ftabs, &op), 0);
	assert_int_equal(kvt_wait(t1, op, -1), 0);
	for (int l = 0; l < 99; l++) {
		size_t page = 64 * (size_t)(l < 78 ? 576 : 132);
		assert_memory_equal(fresh[l] + 0 * page, mem[l] + 3 * page, page);
		assert_memory_equal(fresh[l] + 7 * page, mem[l] + 5 * page, page);
	}
	/* rank 0 has not loaded: the lease still pins both chunks */
	assert_int_equal(kvt_stats(t, &s), 0);
	assert_int_equal(s.slots_pinned, 2);
	assert_int_equal(kvt_release(t, lease), 0);
	kvt_close(t1);
	kvt_close(t);
	for (int l = 0; l < 99; l++) {
		free(mem[l]);
		free(fresh[l]);
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_cycle, setup, teardown),
		cmocka_unit_test_setup_teardown(test_leases, setup, teardown),
		cmocka_unit_test_setup_teardown(test_replicated, setup, teardown),
		cmocka_unit_test_setup_teardown(test_rank_killed_mid_save, setup, teardown),
		cmocka_unit_test_setup_teardown(test_misconfigured, setup, teardown),
		cmocka_unit_test_setup_teardown(test_glm_layout, setup, teardown),
		cmocka_unit_test_setup_teardown(test_messages, setup, teardown),
		cmocka_unit_test_setup_teardown(test_unlink, setup, teardown),
		cmocka_unit_test_setup_teardown(test_bad_arguments, setup, teardown),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
