/* tier_cuda_lost.c - a sticky CUDA error seen through the tier (issue 22,
 * "errors as the runtimes have them"): a rank saving through the CUDA
 * backend (the fake driver, whose copy faults are sticky like the real
 * one's) hits a copy fault.  The tier must fail those chunks and release
 * their claims (nothing half-written is published, no slot stays
 * FILLING), say why on the next call ("the context was lost"), refuse
 * further copies at once, and leave the segment consistent for the other
 * processes.  Run with KVTIER_DMA=cuda and KVTIER_CUDA_LIBRARY = the fake.
 */
#include <dlfcn.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include <cuda.h>

#include "kvtier.h"

#define CHUNK 64
#define BLOCK 16
#define BPT 64
#define LAYERS 2
#define NBLOCKS 32
#define PAGE ((uint64_t)BLOCK * BPT)

static void *lib;
static int (*fake_ctl)(const char *, long);
static long (*stat_fn)(const char *);

static void *cu(const char *name)
{
	CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
	void *p = NULL;

	*(void **)&gpa = dlsym(lib, "cuGetProcAddress_v2");
	assert_non_null(gpa);
	assert_int_equal(gpa(name, &p, 13000, 0, NULL), CUDA_SUCCESS);
	assert_non_null(p);
	return p;
}

/* The fake device, its primary context current, one KV allocation. */
static void dev_setup(uint64_t *base)
{
	CUresult (*init)(unsigned), (*dev_get)(CUdevice *, int),
		(*retain)(CUcontext *, CUdevice), (*set)(CUcontext),
		(*alloc)(CUdeviceptr *, size_t);
	CUdevice dev;
	CUcontext ctx;

	assert_int_equal(fake_ctl("reset", 0), 0);
	*(void **)&init = cu("cuInit");
	*(void **)&dev_get = cu("cuDeviceGet");
	*(void **)&retain = cu("cuDevicePrimaryCtxRetain");
	*(void **)&set = cu("cuCtxPushCurrent");
	*(void **)&alloc = cu("cuMemAlloc");
	assert_int_equal(init(0), CUDA_SUCCESS);
	assert_int_equal(dev_get(&dev, 0), CUDA_SUCCESS);
	assert_int_equal(retain(&ctx, dev), CUDA_SUCCESS);
	assert_int_equal(set(ctx), CUDA_SUCCESS);
	{
		CUdeviceptr p; /* one allocation for every layer, as an engine's KV tensor */
		assert_int_equal(alloc(&p, LAYERS * NBLOCKS * PAGE), CUDA_SUCCESS);
		for (int l = 0; l < LAYERS; l++)
			base[l] = (uint64_t)p + (uint64_t)l * NBLOCKS * PAGE;
	}
}

/* This thread's children named kvtier-witness (/proc/.../children). */
static int witness_children(void)
{
	char path[96], comm[64];
	int n = 0, pid;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/self/task/%d/children", (int)gettid());
	f = fopen(path, "r");
	assert_non_null(f);
	while (fscanf(f, "%d", &pid) == 1) {
		snprintf(path, sizeof(path), "/proc/%d/comm", pid);
		FILE *c = fopen(path, "r");
		if (c && fgets(comm, sizeof(comm), c) && !strcmp(comm, "kvtier-witness\n"))
			n++;
		if (c)
			fclose(c);
	}
	fclose(f);
	return n;
}

static void test_sticky_error_through_the_tier(void **state)
{
	const char *path = getenv("KVTIER_CUDA_LIBRARY");
	char name[64];
	uint64_t base[LAYERS];
	uint32_t table[3 * (CHUNK / BLOCK)];
	const uint32_t *tabs[1] = { table };
	kvt_key keys[3];
	kvt_tier *t = NULL;
	kvt_op op;
	struct kvt_stats st = { .size = sizeof(st) };
	kvt_lease_id lease;
	int n;

	(void)state;
	(void)path;
	dev_setup(base);
	snprintf(name, sizeof(name), "t-cudalost-%d", (int)getpid());
	struct kvt_group_desc g = { .n_layers = LAYERS, .bytes_per_token = BPT,
				    .tokens_per_block = BLOCK };
	struct kvt_config c = { .size = sizeof(c), .flags = KVT_F_CREATE | KVT_F_REPLACE,
				.role = KVT_TIER_CLIENT, .instance = 0, .rank = 0, .world = 1,
				.chunk_tokens = CHUNK, .segment = name, .model = "cuda-lost",
				.groups = &g, .n_groups = 1, .n_slots = 16, .dma = "cuda" };
	assert_int_equal(kvt_open(&c, &t), 0);
	struct kvt_group_buffers gb = { .layer_base = base, .block_stride = PAGE,
					.n_blocks = NBLOCKS };
	assert_int_equal(kvt_register_kv(t, 1, &gb), 0);
	for (uint32_t i = 0; i < 3 * (CHUNK / BLOCK); i++)
		table[i] = 2 + i;
	for (int i = 0; i < 3; i++)
		keys[i] = (kvt_key){ 1000 + (uint64_t)i, 77 };

	/* a fault in the first copy (chunk 0's): its chunk fails, and the
	 * context is lost for every later copy.  Streams finish in no order
	 * (the fake's lanes, with a jitter): chunks 1 and 2 may complete, and
	 * be published, before chunk 0's fault, as on a real device -- a
	 * fake that finished every copy in order made them fail too. */
	assert_int_equal(fake_ctl("jitter_us", 200), 0);
	assert_int_equal(fake_ctl("async_error", 1), 0);
	n = kvt_save(t, keys, 3, 0, tabs, &op);
	assert_true(n == 3 || n < 0);
	if (n == 3)
		assert_int_equal(kvt_wait(t, op, -1), -EIO);
	/* the next save says why at once and claims nothing for long */
	keys[0].lo = 2000;
	n = kvt_save(t, keys, 1, 0, tabs, &op);
	if (n > 0)
		n = kvt_wait(t, op, -1);
	assert_int_equal(n, -EIO);
	assert_non_null(strstr(kvt_last_error(), "context was lost"));
	/* nothing published, no claim left behind, the segment consistent */
	assert_int_equal(kvt_stats(t, &st), 0);
	assert_int_equal(st.slots_filling, 0);
	assert_true(st.slots_ready <= 2); /* never the faulted chunk 0 */
	keys[0].lo = 1000;
	assert_int_equal(kvt_lookup(t, keys, 3, &lease), 0);
	assert_int_equal(kvt_lookup(t, keys, 1, &lease), 0);
	kvt_close(t);
	kvt_unlink(name, NULL);
	fake_ctl("reset", 0);
}

/* Copies finish in no order (the fake's streams are lanes with a jitter,
 * as on a device): a save of many chunks is complete only when every
 * ticket is, whichever finishes last, and what it published loads back
 * byte for byte.  Waiting on the newest ticket and taking the older ones
 * as done -- right on one in-order stream -- publishes chunks whose
 * copies are still running; this round trip catches it. */
enum { RT_N = 4, RT_BPC = CHUNK / BLOCK }; /* 2 * N * BPC <= NBLOCKS: loads never land on saved blocks */

/* A one-rank tier on the fake device's KV allocation (base), created
 * (KVT_F_CREATE): the segment's name into name; registered by the caller. */
static kvt_tier *fake_tier(char *name, size_t name_len, const char *model, uint64_t *base)
{
	static struct kvt_group_desc g = { .n_layers = LAYERS, .bytes_per_token = BPT,
					   .tokens_per_block = BLOCK };
	kvt_tier *t = NULL;

	dev_setup(base);
	snprintf(name, name_len, "t-%s-%d", model, (int)getpid());
	struct kvt_config c = { .size = sizeof(c), .flags = KVT_F_CREATE | KVT_F_REPLACE,
				.role = KVT_TIER_CLIENT, .instance = 0, .rank = 0, .world = 1,
				.chunk_tokens = CHUNK, .segment = name, .model = model,
				.groups = &g, .n_groups = 1, .n_slots = 32, .dma = "cuda" };
	assert_int_equal(kvt_open(&c, &t), 0);
	return t;
}

static void fake_register(kvt_tier *t, uint64_t *base)
{
	struct kvt_group_buffers gb = { .layer_base = base, .block_stride = PAGE,
					.n_blocks = NBLOCKS };

	assert_int_equal(kvt_register_kv(t, 1, &gb), 0);
}

/* One round: RT_N chunks of blocks 0.. stamped (round, block, layer),
 * saved, the blocks overwritten as an engine reuses them, the chunks
 * looked up and loaded into the last blocks, and compared byte for byte. */
static void stamped_round_trip(kvt_tier *t, const uint64_t *base, int round, uint64_t key_lo)
{
	uint32_t save_tab[RT_N * RT_BPC], load_tab[RT_N * RT_BPC];
	const uint32_t *stabs[1] = { save_tab }, *ltabs[1] = { load_tab };
	CUresult (*htod)(CUdeviceptr, const void *, size_t), (*dtoh)(void *, CUdeviceptr, size_t);
	uint8_t *stamp = malloc(PAGE), *got = malloc(PAGE);
	kvt_key keys[RT_N];
	kvt_lease_id lease;
	kvt_op op;

	assert_non_null(stamp);
	assert_non_null(got);
	*(void **)&htod = cu("cuMemcpyHtoD");
	*(void **)&dtoh = cu("cuMemcpyDtoH");
	for (uint32_t i = 0; i < RT_N * RT_BPC; i++) {
		save_tab[i] = i;
		load_tab[i] = NBLOCKS - 1 - i;
	}
	for (int i = 0; i < RT_N; i++)
		keys[i] = (kvt_key){ key_lo + (uint64_t)i, 99 + (uint64_t)round };
	/* the engine's blocks, stamped (round, block, layer) */
	for (uint32_t i = 0; i < RT_N * RT_BPC; i++)
		for (int l = 0; l < LAYERS; l++) {
			for (uint64_t b = 0; b < PAGE; b++)
				stamp[b] = (uint8_t)(round * 29 + i * 7 + (uint32_t)l * 131 + b % 251);
			assert_int_equal(htod(base[l] + i * PAGE, stamp, PAGE), CUDA_SUCCESS);
		}
	assert_int_equal(kvt_save(t, keys, RT_N, 0, stabs, &op), RT_N);
	assert_int_equal(kvt_wait(t, op, -1), 0);
	/* saved: the engine reuses its blocks at once */
	memset(stamp, 0xdd, PAGE);
	for (uint32_t i = 0; i < RT_N * RT_BPC; i++)
		for (int l = 0; l < LAYERS; l++)
			assert_int_equal(htod(base[l] + i * PAGE, stamp, PAGE), CUDA_SUCCESS);
	assert_int_equal(kvt_lookup(t, keys, RT_N, &lease), RT_N);
	assert_int_equal(kvt_load(t, lease, RT_N, ltabs, &op), 0);
	assert_int_equal(kvt_wait(t, op, -1), 0); /* the lease went with it */
	for (uint32_t i = 0; i < RT_N * RT_BPC; i++)
		for (int l = 0; l < LAYERS; l++) {
			for (uint64_t b = 0; b < PAGE; b++)
				stamp[b] = (uint8_t)(round * 29 + i * 7 + (uint32_t)l * 131 + b % 251);
			assert_int_equal(dtoh(got, base[l] + load_tab[i] * PAGE, PAGE), CUDA_SUCCESS);
			if (memcmp(got, stamp, PAGE))
				fail_msg("round %d: block %u layer %d loaded wrong bytes", round, i, l);
		}
	free(stamp);
	free(got);
}

static void test_out_of_order_through_the_tier(void **state)
{
	char name[64];
	uint64_t base[LAYERS];
	kvt_tier *t;

	(void)state;
	t = fake_tier(name, sizeof(name), "cudaooo", base);
	fake_register(t, base);
	assert_int_equal(fake_ctl("jitter_us", 500), 0);
	long ooo0 = stat_fn("out_of_order");
	for (int round = 0; round < 8; round++)
		stamped_round_trip(t, base, round, 5000);
	assert_true(stat_fn("out_of_order") > ooo0); /* the window was hit */
	kvt_close(t);
	kvt_unlink(name, NULL);
	fake_ctl("reset", 0);
}

/* A GPU backend starts the exit witness (core/witness.c) at registration,
 * and kvt_close stops it; KVTIER_WITNESS=off runs without, saying so; a
 * missing helper fails the registration, saying how to accept the risk. */
static void test_witness_through_the_tier(void **state)
{
	char name[64];
	uint64_t base[LAYERS];
	kvt_tier *t = NULL;
	const char *helper = getenv("KVTIER_WITNESS_HELPER");
	char keep[4096] = "";

	(void)state;
	if (helper)
		snprintf(keep, sizeof(keep), "%s", helper);
	dev_setup(base);
	snprintf(name, sizeof(name), "t-cudawit-%d", (int)getpid());
	struct kvt_group_desc g = { .n_layers = LAYERS, .bytes_per_token = BPT,
				    .tokens_per_block = BLOCK };
	struct kvt_config c = { .size = sizeof(c), .flags = KVT_F_CREATE | KVT_F_REPLACE,
				.role = KVT_TIER_CLIENT, .instance = 0, .rank = 0, .world = 1,
				.chunk_tokens = CHUNK, .segment = name, .model = "cuda-witness",
				.groups = &g, .n_groups = 1, .n_slots = 16, .dma = "cuda" };
	struct kvt_group_buffers gb = { .layer_base = base, .block_stride = PAGE,
					.n_blocks = NBLOCKS };

	assert_int_equal(witness_children(), 0);
	assert_int_equal(kvt_open(&c, &t), 0);
	assert_int_equal(witness_children(), 0);
	assert_int_equal(kvt_register_kv(t, 1, &gb), 0);
	assert_int_equal(witness_children(), 1);
	kvt_close(t);
	assert_int_equal(witness_children(), 0);

	setenv("KVTIER_WITNESS", "off", 1);
	assert_int_equal(kvt_open(&c, &t), 0);
	assert_int_equal(kvt_register_kv(t, 1, &gb), 0);
	assert_int_equal(witness_children(), 0);
	kvt_close(t);
	setenv("KVTIER_WITNESS", "sometimes", 1);
	assert_int_equal(kvt_open(&c, &t), -EINVAL);
	assert_non_null(strstr(kvt_last_error(), "KVTIER_WITNESS='sometimes'"));
	unsetenv("KVTIER_WITNESS");

	setenv("KVTIER_WITNESS_HELPER", "/nonexistent/kvtier-witness", 1);
	assert_int_equal(kvt_open(&c, &t), 0);
	assert_int_equal(kvt_register_kv(t, 1, &gb), -ENOENT);
	assert_non_null(strstr(kvt_last_error(), "KVTIER_WITNESS=off"));
	assert_int_equal(witness_children(), 0);
	if (keep[0])
		setenv("KVTIER_WITNESS_HELPER", keep, 1);
	else
		unsetenv("KVTIER_WITNESS_HELPER");
	/* the handle is as before the failed registration: it registers now */
	assert_int_equal(kvt_register_kv(t, 1, &gb), 0);
	assert_int_equal(witness_children(), 1);
	kvt_close(t);
	assert_int_equal(witness_children(), 0);
	kvt_unlink(name, NULL);
	fake_ctl("reset", 0);
}

/* The arena registered in the background (KVTIER_REGISTER, the default):
 * kvt_register_kv returns once the first piece is registered -- here with
 * the fake's registrations after the first held, which a registration of
 * the whole arena before returning waits on forever -- and chunks saved
 * and loaded while the other pieces are registered come back exact. */
static void test_register_in_background(void **state)
{
	char name[64];
	uint64_t base[LAYERS];
	kvt_tier *t;

	(void)state;
	setenv("KVTIER_REGISTER_PIECE", "8K", 1); /* a sub-slot a piece: 32 pieces */
	t = fake_tier(name, sizeof(name), "cudabgreg", base);
	unsetenv("KVTIER_REGISTER_PIECE");
	/* (a handle an earlier test abandoned keeps its registration) */
	long regs0 = stat_fn("regs_live");

	assert_int_equal(fake_ctl("hold_register_after", 1), 0);
	fake_register(t, base);                              /* returns */
	assert_int_equal(stat_fn("regs_live"), regs0 + 1);  /* the first piece */
	assert_int_equal(fake_ctl("hold_register_after", 0), 0);
	stamped_round_trip(t, base, 0, 7000);
	kvt_close(t);
	assert_int_equal(stat_fn("regs_live"), regs0);
	kvt_unlink(name, NULL);
	fake_ctl("reset", 0);
}

static char close_log[4096];

static void log_to(void *arg, int level, const char *msg)
{
	(void)arg;
	if (level == KVT_LOG_LEVEL_ERROR)
		snprintf(close_log + strlen(close_log), sizeof(close_log) - strlen(close_log),
			 "%s\n", msg);
}

/* A device that never finishes a save (the fake's copies held): kvt_close
 * waits KVTIER_CLOSE_TIMEOUT seconds at most, then abandons the handle --
 * it returns (before: it waited forever), says so as an error, and keeps
 * what the device may still write: the save's slot stays claimed (FILLING,
 * seen from another handle), the rank attached and the arena mapped; when
 * the copy lands, late, it lands in memory nothing else was given. */
static void test_close_is_bounded(void **state)
{
	char name[64];
	uint64_t base[LAYERS];
	uint32_t table[2 * (CHUNK / BLOCK)];
	const uint32_t *tabs[1] = { table };
	kvt_key keys[2] = { { 3000, 77 }, { 3001, 77 } };
	kvt_tier *t = NULL, *obs = NULL;
	struct kvt_stats st = { .size = sizeof(st) };
	kvt_op op;

	(void)state;
	dev_setup(base);
	snprintf(name, sizeof(name), "t-cudaclose-%d", (int)getpid());
	struct kvt_group_desc g = { .n_layers = LAYERS, .bytes_per_token = BPT,
				    .tokens_per_block = BLOCK };
	struct kvt_config c = { .size = sizeof(c), .flags = KVT_F_CREATE | KVT_F_REPLACE,
				.role = KVT_TIER_CLIENT, .instance = 0, .rank = 0, .world = 1,
				.chunk_tokens = CHUNK, .segment = name, .model = "cuda-close",
				.groups = &g, .n_groups = 1, .n_slots = 16, .dma = "cuda",
				.log = log_to };
	setenv("KVTIER_CLOSE_TIMEOUT", "1", 1);
	assert_int_equal(kvt_open(&c, &t), 0);
	unsetenv("KVTIER_CLOSE_TIMEOUT");
	struct kvt_group_buffers gb = { .layer_base = base, .block_stride = PAGE,
					.n_blocks = NBLOCKS };
	assert_int_equal(kvt_register_kv(t, 1, &gb), 0);
	for (uint32_t i = 0; i < 2 * (CHUNK / BLOCK); i++)
		table[i] = 2 + i;
	struct kvt_config oc = { .size = sizeof(oc), .role = KVT_TIER_CLIENT, .instance = 0,
				 .world = 1, .chunk_tokens = CHUNK, .segment = name,
				 .model = "cuda-close", .groups = &g, .n_groups = 1 };
	assert_int_equal(kvt_open(&oc, &obs), 0);

	assert_int_equal(fake_ctl("hold", 1), 0);   /* the device never finishes */
	assert_int_equal(kvt_save(t, keys, 2, 0, tabs, &op), 2);
	close_log[0] = 0;
	kvt_close(t);                                /* returns */
	assert_non_null(strstr(close_log, "close: 2 copies (2 saves) still running after 1 s"));
	assert_non_null(strstr(close_log, "Abandoned"));
	/* what the device may still write is nobody else's */
	assert_int_equal(kvt_stats(obs, &st), 0);
	assert_int_equal(st.slots_filling, 2);
	assert_int_equal(st.slots_ready, 0);
	/* the device finishes late: into the kept slots, nothing published */
	assert_int_equal(fake_ctl("hold", 0), 0);
	assert_int_equal(kvt_stats(obs, &st), 0);
	assert_int_equal(st.slots_ready, 0);
	kvt_close(obs);
	kvt_unlink(name, NULL);
	fake_ctl("reset", 0);
}

int main(void)
{
	const char *path = getenv("KVTIER_CUDA_LIBRARY");

	/* the fake driver only: a real one gives no way to make a copy fault */
	if (!path || !*path || !(lib = dlopen(path, RTLD_NOW)) ||
	    !(*(void **)&fake_ctl = dlsym(lib, "kvt_fake_cuda_ctl")) ||
	    !(*(void **)&stat_fn = dlsym(lib, "kvt_fake_cuda_stat"))) {
		fprintf(stderr, "tier_cuda_lost: needs KVTIER_CUDA_LIBRARY = kvtier's fake CUDA "
			"driver: skipped\n");
		return 77;
	}
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_sticky_error_through_the_tier),
		cmocka_unit_test(test_out_of_order_through_the_tier),
		cmocka_unit_test(test_witness_through_the_tier),
		cmocka_unit_test(test_close_is_bounded),
		cmocka_unit_test(test_register_in_background),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
