/* dma_hip.c - HIP device memory through the hsa backend: a KV cache in
 * hipMalloc'ed memory (what a ROCm engine's torch tensors are), saved to an
 * arena and loaded back into other blocks by kvtier's hsa backend, byte
 * exact, checked through HIP; the HIP ceiling (hipMemcpyAsync from
 * hipHostMalloc'ed and from hipHostRegister'ed memory, both directions);
 * a HIP runtime without a device.  Against the fakes (tests/fakes: HIP on
 * the fake HSA) in CI.
 *
 *   test_dma_hip        (KVTIER_HSA_LIBRARY, KVTIER_HIP_LIBRARY: the fakes)
 *   test_dma_hip real   Debian's libamdhip64 on a machine without a GPU:
 *                       -ENODEV "no AMD GPU", no crash; 77 when the
 *                       runtime is not installed or /dev/kfd exists.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "kvt_dma.h"
#include "kvt_mix.h"
#include "hip.h"

#define CHUNK_TOKENS 64
#define N_BLOCKS     64

struct fixture {
	kvt_hip *hip;
	kvt_dma *d;
	struct kvt_kv_layout l;
	uint64_t bases[8], dev[2], dev_len[2];
	char *arena;
	uint64_t shard;
	kvt_dma_mr *mr;
	struct kvt_plan plan;
};

static uint64_t rng = 0x1234567;

static uint64_t rnd(void)
{
	return kvt__mix64(rng += 0x9e3779b97f4a7c15ULL);
}

/* Two groups of different page shapes, as GLM-5.x has (MLA + indexer). */
static const struct { uint32_t layers, bpt, tpb; } shape[2] = { { 4, 64, 16 }, { 2, 32, 32 } };

static void setup_fixture(struct fixture *f)
{
	struct kvt_dma_config c = { .size = sizeof(c), .backend = "hsa", .device = 0,
				    .flags = KVT_DMA_F_QUIET, .max_inflight = 8 };
	uint32_t li = 0;

	memset(f, 0, sizeof(*f));
	if (kvt_hip_open(0, &f->hip))
		fail_msg("kvt_hip_open: %s", kvt_hip_last_error());
	if (kvt_dma_open(&c, &f->d))
		fail_msg("kvt_dma_open(hsa): %s", kvt_dma_last_error());
	f->l.chunk_tokens = CHUNK_TOKENS;
	f->l.n_groups = 2;
	for (uint32_t g = 0; g < 2; g++) {
		struct kvt_kv_group *gr = &f->l.groups[g];
		uint64_t page = (uint64_t)shape[g].tpb * shape[g].bpt, per = page * N_BLOCKS;
		char *fill;

		gr->n_layers = shape[g].layers;
		gr->bytes_per_token = shape[g].bpt;
		gr->tokens_per_block = shape[g].tpb;
		gr->block_stride = page;
		gr->n_blocks = N_BLOCKS;
		gr->layer_base = f->bases + li;
		f->dev_len[g] = per * gr->n_layers;
		assert_int_equal(kvt_hip_malloc(f->hip, f->dev_len[g], &f->dev[g]), 0);
		for (uint32_t l = 0; l < gr->n_layers; l++)
			f->bases[li + l] = f->dev[g] + l * per;
		li += gr->n_layers;
		fill = malloc(f->dev_len[g]);
		assert_non_null(fill);
		for (uint64_t i = 0; i < f->dev_len[g]; i++)
			fill[i] = (char)rnd();
		assert_int_equal(kvt_hip_write(f->hip, f->dev[g], fill, f->dev_len[g]), 0);
		free(fill);
	}
	/* hipMalloc'ed memory is HSA pool memory: the backend takes it as is */
	if (kvt_dma_kv_register(f->d, &f->l))
		fail_msg("kv_register of hipMalloc'ed memory: %s", kvt_dma_last_error());
	f->shard = kvt_kv_layout_shard_bytes(&f->l);
	f->arena = mmap(NULL, 4 * f->shard, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	assert_true(f->arena != MAP_FAILED);
	assert_int_equal(kvt_dma_mem_register(f->d, f->arena, 4 * f->shard, f->shard, &f->mr), 0);
	assert_int_equal(kvt_plan_init(&f->plan, kvt_kv_layout_max_copies(&f->l)), 0);
}

static void teardown_fixture(struct fixture *f)
{
	kvt_plan_fini(&f->plan);
	kvt_dma_mem_unregister(f->d, f->mr);
	munmap(f->arena, 4 * f->shard);
	kvt_dma_close(f->d);
	for (int g = 0; g < 2; g++)
		assert_int_equal(kvt_hip_free(f->hip, f->dev[g]), 0);
	kvt_hip_close(f->hip);
}

/* Distinct random blocks per group, from [lo, lo + N_BLOCKS / 2). */
static void pick(uint32_t tabs[2][8], uint32_t lo)
{
	for (uint32_t g = 0; g < 2; g++) {
		uint32_t nb = CHUNK_TOKENS / shape[g].tpb;
		for (uint32_t i = 0; i < nb; i++) {
			int dup;
			do {
				tabs[g][i] = lo + (uint32_t)(rnd() % (N_BLOCKS / 2));
				dup = 0;
				for (uint32_t j = 0; j < i; j++)
					dup |= tabs[g][j] == tabs[g][i];
			} while (dup);
		}
	}
}

static void copy(struct fixture *f, uint32_t tabs[2][8], char *sub, enum kvt_dma_dir dir)
{
	const uint32_t *bp[2] = { tabs[0], tabs[1] };
	kvt_dma_ticket t;

	assert_true(kvt_dma_plan_build(f->d, &f->plan, bp, CHUNK_TOKENS) >= 0);
	assert_int_equal(kvt_dma_submit(f->d, &f->plan, sub, dir, &t), 0);
	assert_int_equal(kvt_dma_wait(f->d, t, -1), 0);
}

/* Compares a sub-slot with the device pages of tabs, read through HIP. */
static void expect_pages(struct fixture *f, uint32_t tabs[2][8], const char *sub)
{
	uint64_t off = 0;
	char page[2048];

	for (uint32_t g = 0; g < 2; g++) {
		const struct kvt_kv_group *gr = &f->l.groups[g];
		uint64_t pg = (uint64_t)gr->tokens_per_block * gr->bytes_per_token;

		for (uint32_t ly = 0; ly < gr->n_layers; ly++)
			for (uint32_t i = 0; i < CHUNK_TOKENS / gr->tokens_per_block; i++) {
				uint64_t so = off + (uint64_t)ly * CHUNK_TOKENS * gr->bytes_per_token +
					      i * pg;
				assert_int_equal(kvt_hip_read(f->hip, page, gr->layer_base[ly] +
							      tabs[g][i] * gr->block_stride, pg), 0);
				if (memcmp(sub + so, page, pg))
					fail_msg("group %u layer %u block %u: the sub-slot and the "
						 "device page differ", g, ly, tabs[g][i]);
			}
		off += (uint64_t)gr->n_layers * CHUNK_TOKENS * gr->bytes_per_token;
	}
}

static void test_round_trip(void **st)
{
	(void)st;
	struct fixture f;

	setup_fixture(&f);
	for (int c = 0; c < 4; c++) {
		uint32_t save[2][8], load[2][8];
		char *sub = f.arena + c * f.shard;

		memset(sub, 0xa5, f.shard);
		pick(save, 0);
		copy(&f, save, sub, KVT_DMA_D2H);     /* HIP memory -> arena */
		expect_pages(&f, save, sub);
		pick(load, N_BLOCKS / 2);
		copy(&f, load, sub, KVT_DMA_H2D);     /* arena -> other HIP blocks */
		expect_pages(&f, load, sub);
	}
	teardown_fixture(&f);
}

/* Ordering on AMD: with HIP in the process, kvt_dma_order_after on the
 * engine's HIP stream has the stream release an HSA signal
 * (hipStreamWriteValue64) that the save's SDMA copies depend on -- no
 * synchronize on the host.  A HIP fill of the whole KV cache queued on the
 * engine's stream, the order, then a save at once: the sub-slot holds the
 * fill, every round.  The same save without the order is tried first and
 * what it copied is printed, not judged: on a GPU it shows the race the
 * order is for (the fill still running); the fakes rarely do. */
static void test_save_after_hip_write(void **st)
{
	(void)st;
	struct fixture f;
	uint32_t tabs[2][8];
	int stale_rounds = 0;

	setup_fixture(&f);
	pick(tabs, 0);
	for (int round = 1; round <= 8; round++) {
		char *sub = f.arena + (round % 4) * f.shard;
		uint64_t stale = 0;

		/* the race: saved at once, while the fill may still run */
		memset(sub, 0xa5, f.shard);
		for (int g = 0; g < 2; g++)
			assert_int_equal(kvt_hip_fill_async(f.hip, f.dev[g], 0x40 + round,
							    f.dev_len[g]), 0);
		copy(&f, tabs, sub, KVT_DMA_D2H);
		for (uint64_t i = 0; i < f.shard; i++)
			stale += (uint8_t)sub[i] != 0x40 + round;
		stale_rounds += stale != 0;
		assert_int_equal(kvt_hip_sync(f.hip), 0);
		/* the AMD path: the save ordered after the stream on the device */
		memset(sub, 0xa5, f.shard);
		for (int g = 0; g < 2; g++)
			assert_int_equal(kvt_hip_fill_async(f.hip, f.dev[g], 0x60 + round,
							    f.dev_len[g]), 0);
		assert_int_equal(kvt_dma_order_after(f.d, kvt_hip_stream(f.hip)), 0);
		copy(&f, tabs, sub, KVT_DMA_D2H);
		assert_int_equal(kvt_hip_sync(f.hip), 0);
		for (uint64_t i = 0; i < f.shard; i++)
			if ((uint8_t)sub[i] != 0x60 + round)
				fail_msg("round %d: byte %llu of the sub-slot is %#x, the fill "
					 "was %#x", round, (unsigned long long)i,
					 (uint8_t)sub[i], 0x60 + round);
	}
	printf("save after a HIP fill: without the order, %d of 8 saves copied bytes the "
	       "fill had not written yet; ordered after the HIP stream, 0 of 8\n", stale_rounds);
	teardown_fixture(&f);
}

static void test_ceiling(void **st)
{
	(void)st;
	struct fixture f;
	char check[4096];

	setup_fixture(&f);
	for (int kind = 0; kind < 2; kind++) {
		enum kvt_hip_pinned p = kind ? KVT_HIP_HOST_REGISTER : KVT_HIP_HOST_MALLOC;
		double s = 0;
		int differs = -1;

		assert_int_equal(kvt_hip_ceiling(f.hip, 1, f.dev[0], f.dev_len[0], 16u << 10, 2, p,
						 &s, &differs), 0);
		assert_true(s > 0);
		assert_int_equal(kvt_hip_ceiling(f.hip, 0, f.dev[0], f.dev_len[0], 16u << 10, 2, p,
						 &s, &differs), 0);
		/* the host-to-device copies really landed */
		assert_int_equal(kvt_hip_read(f.hip, check, f.dev[0] + 12345, sizeof(check)), 0);
		for (size_t i = 0; i < sizeof(check); i++)
			assert_int_equal((unsigned char)check[i], 0x5a);
		if (kind) /* the fake, like ROCm can, gives another device address */
			assert_int_equal(differs, 1);
	}
	double s;
	assert_int_equal(kvt_hip_ceiling(f.hip, 1, f.dev[0], 100, 4096, 1, KVT_HIP_HOST_MALLOC,
					 &s, NULL), -EINVAL);
	teardown_fixture(&f);
}

/* A runtime that sees no GPU: a clean -ENODEV, in a child (the fake reads
 * FAKE_HIP_DEVICES once per process: this test runs first). */
static void test_no_device(void **st)
{
	(void)st;
	pid_t p = fork();
	int status;

	if (p == 0) {
		kvt_hip *h;
		setenv("FAKE_HIP_DEVICES", "0", 1);
		int r = kvt_hip_open(0, &h);
		_exit(r == -ENODEV && !h && strstr(kvt_hip_last_error(), "no AMD GPU") ? 0 : 1);
	}
	assert_int_equal(waitpid(p, &status, 0), p);
	assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	/* and an unusable library path is a clear error */
	kvt_hip *h;
	char *was = getenv("KVTIER_HIP_LIBRARY") ? strdup(getenv("KVTIER_HIP_LIBRARY")) : NULL;
	setenv("KVTIER_HIP_LIBRARY", "/nonexistent/libamdhip64.so.5", 1);
	assert_int_equal(kvt_hip_open(0, &h), -ENOENT);
	assert_non_null(strstr(kvt_hip_last_error(), "KVTIER_HIP_LIBRARY"));
	setenv("KVTIER_HIP_LIBRARY", "", 1);
	assert_int_equal(kvt_hip_open(0, &h), -EINVAL);
	if (was)
		setenv("KVTIER_HIP_LIBRARY", was, 1);
	else
		unsetenv("KVTIER_HIP_LIBRARY");
	free(was);
}

static int real_runtime(void)
{
	kvt_hip *h = NULL;
	int r;

	unsetenv("KVTIER_HIP_LIBRARY");
	unsetenv("KVTIER_HSA_LIBRARY");
	if (access("/dev/kfd", F_OK) == 0) {
		printf("SKIP: /dev/kfd exists: this machine may have an AMD GPU\n");
		return 77;
	}
	r = kvt_hip_open(0, &h);
	printf("kvt_hip_open (the installed HIP runtime) = %d: %s\n", r, kvt_hip_last_error());
	if (r == -ENOENT && strstr(kvt_hip_last_error(), "not found")) {
		printf("SKIP: libamdhip64 is not installed\n");
		return 77;
	}
	if (r != -ENODEV || h || !strstr(kvt_hip_last_error(), "no AMD GPU")) {
		kvt_hip_close(h);
		return 1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_no_device), /* first: before this process opens HIP */
		cmocka_unit_test(test_round_trip),
		cmocka_unit_test(test_save_after_hip_write),
		cmocka_unit_test(test_ceiling),
	};

	if (argc > 1 && !strcmp(argv[1], "real"))
		return real_runtime();
	return cmocka_run_group_tests(tests, NULL, NULL);
}
