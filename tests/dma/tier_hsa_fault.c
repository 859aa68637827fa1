/* tier_hsa_fault.c - a GPU memory fault seen through the tier (issue 22,
 * "errors as the runtimes have them", AMD side).  On ROCr a fault stops
 * every queue of the process and goes to the system event handlers; when
 * none takes it the runtime prints it and aborts the process.  The fake
 * HSA runtime does both (fault_copy).  Checked here:
 *   - unclaimed (the default): the rank dies of SIGABRT mid-save, after
 *     kvtier's one-line report (where the address lies); the faulted
 *     chunk is never served, the reaper releases the dead rank's claims,
 *     and the next rank saves and loads the same chunks byte for byte;
 *   - claimed by another handler (an engine that handles faults itself):
 *     the process lives, the save fails with -EIO naming the fault, the
 *     backend is down for good (the next save is refused at once), no
 *     claim is left and nothing half-written is published.
 * Run with KVTIER_HSA_LIBRARY = the fake (ROCm 5.6 entry points).
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
#include <cmocka.h>

#include <hsa/hsa.h>
#include <hsa/hsa_ext_amd.h>

#include "kvt_dma.h"
#include "kvtier.h"

#define CHUNK 64
#define BLOCK 16
#define BPT 64
#define LAYERS 2
#define NBLOCKS 32
#define PAGE ((uint64_t)BLOCK * BPT)
#define N 3
#define BPC (CHUNK / BLOCK)

static void *lib;
static int (*fake_ctl)(const char *, long);
static char seg[64];

/* One GPU allocation for every layer, stamped, through a DMA handle of its
 * own (kept open: the memory lives as long as it does). */
struct dev {
	kvt_dma *d;
	uint64_t base[LAYERS];
};

static uint8_t stamp_of(uint32_t block, uint32_t layer, uint64_t b)
{
	return (uint8_t)(block * 7 + layer * 131 + b % 251);
}

static int dev_open(struct dev *v)
{
	struct kvt_dma_config c;
	uint64_t p;
	uint8_t *buf = malloc(PAGE);
	int r;

	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.backend = "hsa";
	c.device = 0;
	c.flags = KVT_DMA_F_QUIET;
	if (!buf || (r = kvt_dma_open(&c, &v->d)) != 0)
		return -1;
	if (kvt_dma_dev_alloc(v->d, LAYERS * NBLOCKS * PAGE, &p))
		return -1;
	for (uint32_t l = 0; l < LAYERS; l++) {
		v->base[l] = p + (uint64_t)l * NBLOCKS * PAGE;
		for (uint32_t b = 0; b < NBLOCKS; b++) {
			for (uint64_t i = 0; i < PAGE; i++)
				buf[i] = stamp_of(b, l, i);
			if (kvt_dma_dev_write(v->d, v->base[l] + b * PAGE, buf, PAGE))
				return -1;
		}
	}
	free(buf);
	return 0;
}

static struct kvt_group_desc group = { .n_layers = LAYERS, .bytes_per_token = BPT,
				       .tokens_per_block = BLOCK };

static struct kvt_config cfg(uint32_t role, int rank, uint32_t flags)
{
	struct kvt_config c = { .size = sizeof(c), .flags = flags, .role = role,
				.instance = 0, .rank = rank, .world = 1,
				.chunk_tokens = CHUNK, .segment = seg, .model = "hsa-fault",
				.groups = &group, .n_groups = 1, .n_slots = 16, .dma = "hsa" };
	return c;
}

static void keys_of(kvt_key *k)
{
	for (int i = 0; i < N; i++)
		k[i] = (kvt_key){ 3000 + (uint64_t)i, 55 };
}

/* A rank on the segment: its tier with the KV cache of v registered. */
static int rank_open(struct dev *v, kvt_tier **t)
{
	struct kvt_config c = cfg(KVT_TIER_CLIENT, 0, 0);
	struct kvt_group_buffers gb = { .layer_base = v->base, .block_stride = PAGE,
					.n_blocks = NBLOCKS };

	if (kvt_open(&c, t))
		return -1;
	return kvt_register_kv(*t, 1, &gb);
}

/* How many of the keys are served, each looked up alone. */
static int ready_of(kvt_tier *t, const kvt_key *keys)
{
	kvt_lease_id lease;
	int n = 0;

	for (int i = 0; i < N; i++)
		if (kvt_lookup(t, &keys[i], 1, &lease) == 1) {
			kvt_release(t, lease);
			n++;
		}
	return n;
}

static char *slurp(const char *path)
{
	static char buf[65536];
	int fd = open(path, O_RDONLY);
	ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;

	if (fd >= 0)
		close(fd);
	buf[n > 0 ? n : 0] = 0;
	return buf;
}

static void test_fault_aborts_the_rank(void **state)
{
	struct kvt_config oc = cfg(KVT_TIER_CLIENT, -1, KVT_F_CREATE | KVT_F_REPLACE);
	kvt_tier *owner = NULL, *t = NULL;
	struct kvt_stats st = { .size = sizeof(st) };
	char log[128];
	kvt_key keys[N];
	kvt_lease_id lease;
	kvt_op op;
	int status;
	pid_t pid;

	(void)state;
	keys_of(keys);
	/* the owner never registers a KV cache: no runtime in this process
	 * before the fork (its copy threads would not survive it) */
	assert_int_equal(kvt_open(&oc, &owner), 0);
	snprintf(log, sizeof(log), "/tmp/kvt-hsa-fault-%d.log", (int)getpid());
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		struct dev v;
		uint32_t table[N * BPC];
		const uint32_t *tabs[1] = { table };
		int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);

		if (fd < 0 || dup2(fd, 2) < 0)
			_exit(2);
		if (dev_open(&v) || rank_open(&v, &t)) {
			fprintf(stderr, "setup: %s\n", kvt_last_error());
			_exit(3);
		}
		for (uint32_t i = 0; i < N * BPC; i++)
			table[i] = i;
		/* chunk 1's first copy faults */
		fake_ctl("fault_copy", 1 + LAYERS);
		if (kvt_save(t, keys, N, 0, tabs, &op) != N)
			_exit(4);
		int r = kvt_wait(t, op, -1);
		/* the wait may end (-EIO: the fault is noted) before the
		 * runtime's thread aborts: the abort decides, not this exit */
		fprintf(stderr, "the save ended: wait %d: %s\n", r, kvt_last_error());
		sleep(120);
		_exit(5);
	}
	assert_int_equal(waitpid(pid, &status, 0), pid);
	const char *out = slurp(log);
	if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGABRT)
		fail_msg("the rank was to die of SIGABRT: status %#x, its stderr:\n%s", status, out);
	/* kvtier's report came before the runtime's abort, and says where */
	if (!strstr(out, "kvtier: hsa: GPU memory fault at") ||
	    !strstr(out, "inside the KV cache kvtier copies") ||
	    !strstr(out, "the HSA runtime ends the process now") ||
	    !strstr(out, "Memory access fault by GPU"))
		fail_msg("the rank's stderr lacks the fault report:\n%s", out);
	fprintf(stderr, "the rank's stderr:\n%s", out);
	unlink(log);
	/* the faulted chunk is never served (the others may have finished
	 * first: the next rank's load checks their bytes); the reaper frees
	 * what the dead rank held */
	assert_true(ready_of(owner, keys) < N);
	/* its exit witness lets go once the rank has wholly exited: soon
	 * after waitpid, not at once (no time limit: the test's timeout) */
	for (;;) {
		int reaped = kvt_reap(owner);
		assert_true(reaped >= 0);
		if (reaped)
			break;
		usleep(10000);
	}
	assert_int_equal(kvt_stats(owner, &st), 0);
	assert_int_equal(st.slots_filling, 0);
	assert_true(ready_of(owner, keys) < N);
	/* the next rank on the node saves them again and loads them exact */
	{
		struct dev v;
		uint32_t save_tab[N * BPC], load_tab[N * BPC];
		const uint32_t *stabs[1] = { save_tab }, *ltabs[1] = { load_tab };
		uint8_t *got = malloc(PAGE);
		int hit;

		assert_non_null(got);
		assert_int_equal(dev_open(&v), 0);
		assert_int_equal(rank_open(&v, &t), 0);
		for (uint32_t i = 0; i < N * BPC; i++) {
			save_tab[i] = i;
			load_tab[i] = NBLOCKS - 1 - i;
		}
		int n = kvt_save(t, keys, N, 0, stabs, &op);
		assert_true(n >= 0 && n <= N); /* chunk 0 and 2 may be there already */
		if (n)
			assert_int_equal(kvt_wait(t, op, -1), 0);
		hit = kvt_lookup(t, keys, N, &lease);
		assert_int_equal(hit, N);
		assert_int_equal(kvt_load(t, lease, N, ltabs, &op), 0);
		assert_int_equal(kvt_wait(t, op, -1), 0);
		for (uint32_t i = 0; i < N * BPC; i++)
			for (uint32_t l = 0; l < LAYERS; l++) {
				assert_int_equal(kvt_dma_dev_read(v.d, got, v.base[l] +
								  load_tab[i] * PAGE, PAGE), 0);
				for (uint64_t b = 0; b < PAGE; b++)
					if (got[b] != stamp_of(i, l, b))
						fail_msg("block %u layer %u byte %llu: %#x, not %#x",
							 i, l, (unsigned long long)b, got[b],
							 stamp_of(i, l, b));
			}
		free(got);
		kvt_close(t);
		kvt_dma_close(v.d);
	}
	kvt_close(owner);
	kvt_unlink(seg, NULL);
}

static int claims;
static hsa_status_t take_faults(const hsa_amd_event_t *ev, void *data)
{
	(void)data;
	if (ev->event_type != HSA_AMD_GPU_MEMORY_FAULT_EVENT)
		return HSA_STATUS_ERROR;
	claims++;
	return HSA_STATUS_SUCCESS;
}

static void test_fault_claimed_elsewhere(void **state)
{
	struct kvt_config oc = cfg(KVT_TIER_CLIENT, -1, KVT_F_CREATE | KVT_F_REPLACE);
	hsa_status_t (*reg)(hsa_amd_system_event_callback_t, void *);
	kvt_tier *owner = NULL, *t = NULL;
	struct kvt_stats st = { .size = sizeof(st) };
	uint32_t table[N * BPC];
	const uint32_t *tabs[1] = { table };
	kvt_key keys[N];
	struct dev v;
	kvt_op op;
	int n;

	(void)state;
	keys_of(keys);
	assert_int_equal(kvt_open(&oc, &owner), 0);
	assert_int_equal(dev_open(&v), 0);
	/* the engine's own handler, registered first, takes every fault */
	*(void **)&reg = dlsym(lib, "hsa_amd_register_system_event_handler");
	assert_non_null(reg);
	assert_int_equal(reg(take_faults, NULL), HSA_STATUS_SUCCESS);
	assert_int_equal(rank_open(&v, &t), 0);
	for (uint32_t i = 0; i < N * BPC; i++)
		table[i] = i;
	assert_int_equal(fake_ctl("fault_copy", 1 + LAYERS), 0);
	assert_int_equal(kvt_save(t, keys, N, 0, tabs, &op), N);
	assert_int_equal(kvt_wait(t, op, -1), -EIO);
	assert_int_equal(claims, 1);
	assert_non_null(strstr(kvt_last_error(), "GPU memory fault"));
	/* down for good: refused at once, naming the fault */
	keys[0].hi = 56;
	n = kvt_save(t, keys, 1, 0, tabs, &op);
	if (n > 0)
		n = kvt_wait(t, op, -1);
	assert_int_equal(n, -EIO);
	assert_non_null(strstr(kvt_last_error(), "GPU memory fault"));
	/* no claim left, the faulted chunk never published */
	assert_int_equal(kvt_stats(owner, &st), 0);
	assert_int_equal(st.slots_filling, 0);
	assert_true(st.slots_ready <= N - 1);
	keys[0].hi = 55;
	assert_true(ready_of(owner, keys) < N);
	kvt_close(t);
	kvt_dma_close(v.d);
	kvt_close(owner);
	kvt_unlink(seg, NULL);
	fake_ctl("reset", 0);
	/* with the copy kernel (the fake HIP in the process): a kernel the
	 * fault caught stays stopped -- the queues were reset above and the
	 * memory it walked is freed (FAKE_HIP_KERNEL_ROW_US keeps it walking
	 * until now) */
	if (getenv("KVTIER_HIP_LIBRARY")) {
		void *hip = dlopen(getenv("KVTIER_HIP_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
		void (*kernels_wait)(void) = NULL;

		if (hip)
			*(void **)&kernels_wait = dlsym(hip, "kvt_fake_hip_kernels_wait");
		if (kernels_wait)
			kernels_wait();
		if (hip)
			dlclose(hip);
	}
}

int main(void)
{
	const char *path = getenv("KVTIER_HSA_LIBRARY");

	/* the fake runtime only: a real one gives no way to make a copy fault */
	if (!path || !*path || !(lib = dlopen(path, RTLD_NOW)) ||
	    !(*(void **)&fake_ctl = dlsym(lib, "kvt_fake_hsa_ctl"))) {
		fprintf(stderr, "tier_hsa_fault: needs KVTIER_HSA_LIBRARY = kvtier's fake HSA "
			"runtime: skipped\n");
		return 77;
	}
	snprintf(seg, sizeof(seg), "t-hsafault-%d", (int)getpid());
	const struct CMUnitTest tests[] = {
		/* first: it forks, before this process started the runtime */
		cmocka_unit_test(test_fault_aborts_the_rank),
		cmocka_unit_test(test_fault_claimed_elsewhere),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
