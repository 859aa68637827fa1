/* numa_size_cli.c - kvtier-size as an operator runs it: exit 0 with the plan
 * when it fits, 1 with the numbers and the largest tier when it does not, 2
 * for bad usage or a config it cannot size; sysfs read from a fake 2-node
 * tree through KVTIER_SYSFS_ROOT. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "fake_sysfs.h"

struct out {
	int rc;
	char so[16384], se[4096];
};

static void slurp(int fd, char *buf, size_t len)
{
	ssize_t n;

	lseek(fd, 0, SEEK_SET);
	n = read(fd, buf, len - 1);
	buf[n > 0 ? n : 0] = '\0';
	close(fd);
}

/* Runs kvtier-size with args (NULL-terminated); sysfs_root NULL: the real
 * one.  The config names are relative to the test data directory when
 * they start with '@'. */
static struct out *run(const char *sysfs_root, ...)
{
	static struct out o;
	char *argv[32], paths[8][512];
	int np = 0, n = 0, fo, fe, st;
	va_list ap;
	pid_t pid;

	argv[n++] = (char *)KVT_SIZE_BIN;
	va_start(ap, sysfs_root);
	for (char *a; (a = va_arg(ap, char *)) != NULL && n < 30;) {
		if (a[0] == '@') {
			snprintf(paths[np], sizeof(paths[np]), "%s/%s", KVT_TEST_DATA, a + 1);
			a = paths[np++];
		}
		argv[n++] = a;
	}
	va_end(ap);
	argv[n] = NULL;
	fo = memfd_create("out", 0);
	fe = memfd_create("err", 0);
	assert_true(fo >= 0 && fe >= 0);
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		dup2(fo, 1);
		dup2(fe, 2);
		if (sysfs_root)
			setenv("KVTIER_SYSFS_ROOT", sysfs_root, 1);
		else
			unsetenv("KVTIER_SYSFS_ROOT");
		unsetenv("KVTIER_NUMA_NODES");
		execv(argv[0], argv);
		_exit(127);
	}
	assert_int_equal(waitpid(pid, &st, 0), pid);
	assert_true(WIFEXITED(st));
	o.rc = WEXITSTATUS(st);
	slurp(fo, o.so, sizeof(o.so));
	slurp(fe, o.se, sizeof(o.se));
	return &o;
}

static void has(const char *text, const char *want)
{
	if (!strstr(text, want))
		fail_msg("output lacks '%s':\n%s", want, text);
}

static void hasnt(const char *text, const char *not)
{
	if (strstr(text, not))
		fail_msg("output has '%s':\n%s", not, text);
}

static void t_llama_fits(void **state)
{
	struct out *o;

	(void)state;
	o = run(NULL, "--tier-gib", "1", "--node-free-gib", "64", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "131,072");
	has(o->so, "32 chunks = 8,192 tokens");
	has(o->so, ": fits");
	o = run(NULL, "--tp", "4", "--tier-gib", "1", "--node-free-gib", "64",
		"@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "32,768");
	has(o->so, "each rank holds 2 of 8 KV heads");
}

/* AMD's pinning budget: each rank locks its shard, against RAM - RAM/64 -
 * 1 GiB for the node: the replicated layout locks the arena once per
 * rank, the sharded one once in all, each instance again. */
static void t_amd_pinning(void **state)
{
	struct out *o;

	(void)state;
	o = run(NULL, "--gpu", "amd", "--ram-gib", "2048", "--tp", "8", "--tier-gib", "64",
		"--node-free-gib", "2000", "@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "1 instance x 8 ranks x 63.98 GiB locked = 511.88 GiB");
	has(o->so, "replicated, the whole arena each");
	has(o->so, "limit 2015.00 GiB (RAM 2048.00 GiB - 1/64 - 1 GiB)");
	has(o->so, "shared with the engine's own pinned memory: fits");
	/* fits in memory, not in the budget: 1, with the largest tier within */
	o = run(NULL, "--gpu", "amd", "--ram-gib", "2048", "--tp", "8", "--tier-gib", "256",
		"--node-free-gib", "2000", "@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 1);
	has(o->so, "check       F + 1 x tier");
	has(o->so, ": fits\n");
	has(o->so, "EXCEEDS IT");
	has(o->so, "OUT_OF_RESOURCES");
	has(o->so, "largest tier within it: 251.88 GiB per rank");
	/* sharded: the ranks lock the arena once between them; a second
	 * instance locks it again */
	o = run(NULL, "--gpu", "amd", "--ram-gib", "2048", "--tp", "4", "--tier-gib", "256",
		"--node-free-gib", "2000", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "1 instance x 4 ranks x 256.00 GiB locked = 1024.00 GiB (each rank locks "
		"its shard)");
	o = run(NULL, "--gpu", "amd", "--ram-gib", "2048", "--tp", "4", "--tier-gib", "256",
		"--instances", "2", "--node-free-gib", "2000", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 1);
	has(o->so, "2 instances x 4 ranks x 256.00 GiB locked = 2048.00 GiB");
	/* small RAM: the limit is halved instead (below 2 GiB) */
	o = run(NULL, "--json", "--gpu", "amd", "--ram-gib", "1", "--tier-gib", "0.25",
		"--node-free-gib", "64", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "\"amd_pinning\"");
	has(o->so, "\"limit_bytes\": 528482304"); /* (1 GiB - 1 GiB/64) / 2 */
	/* NVIDIA, none: no budget line */
	o = run(NULL, "--gpu", "nvidia", "--tp", "8", "--tier-gib", "256",
		"--node-free-gib", "2000", "@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 0);
	assert_null(strstr(o->so, "amd pinning"));
	o = run(NULL, "--gpu", "rocm", "@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 2);
	has(o->se, "--gpu 'rocm': expected auto, amd, nvidia or none");
	o = run(NULL, "--gpu", "amd", "--instances", "0", "@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 2);
}

static void t_json(void **state)
{
	struct out *o;

	(void)state;
	o = run(NULL, "--json", "--tp", "4", "--tier-gib", "2", "--fixed-gib", "8",
		"--node-free-gib", "64", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "\"bytes_per_token_rank\": 32768");
	has(o->so, "\"bytes_per_token_all\": 131072");
	has(o->so, "\"shards\": 4");
	has(o->so, "\"fits\": true");
	has(o->so, "\"layout\": \"sharded\"");
}

static void t_deepseek_no_fit(void **state)
{
	struct out *o;

	(void)state;
	o = run(NULL, "--tp", "8", "--tier-gib", "64", "--fixed-gib", "100",
		"--node-free-gib", "120", "@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 1);
	has(o->so, "70,272");
	has(o->so, "replicated layout");
	has(o->so, "DOES NOT FIT");
	has(o->so, "largest     tier that fits: 19.");  /* 120 - 100 - metadata */
	has(o->so, "saved against 8 private per-rank tiers");
	/* The same with room: 0. */
	o = run(NULL, "--tp", "8", "--tier-gib", "64", "--fixed-gib", "100",
		"--node-free-gib", "200", "@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 0);
	/* F alone too big: 1, and no tier fits. */
	o = run(NULL, "--tp", "8", "--fixed-gib", "300", "--node-free-gib", "200",
		"@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 1);
	has(o->so, "tier that fits: none");
}

static void t_glm_fp8(void **state)
{
	struct out *o;

	(void)state;
	o = run(NULL, "--kv-dtype", "fp8", "--tp", "8", "--tokens", "1000000",
		"--node-free-gib", "512", "--numa-nodes", "0,1", "@glm-5-like.json", NULL);
	assert_int_equal(o->rc, 0);
	/* fp8_ds_mla: 78 x 656 + 21 x 132 = 53,940 (numa_sizing.c) */
	has(o->so, "53,940");
	has(o->so, "78 layers x 656 B + 21 indexer layers x 132 B");
	has(o->so, "3,907 chunks");
}

static void t_errors(void **state)
{
	static const char *const bad_configs[] = {
		"@malformed-truncated.json", "@unknown-mamba.json", "@not-a-model.json",
		"@wrong-type.json", "@hybrid-linear.json", "@no-such-file.json",
	};
	struct out *o;

	(void)state;
	for (size_t i = 0; i < sizeof(bad_configs) / sizeof(bad_configs[0]); i++) {
		o = run(NULL, "--node-free-gib", "64", bad_configs[i], NULL);
		assert_int_equal(o->rc, 2);
		has(o->se, "kvtier-size: ");
		assert_string_equal(o->so, "");
	}
	o = run(NULL, "--node-free-gib", "64", "@malformed-truncated.json", NULL);
	has(o->se, "not valid JSON");

	/* Usage. */
	o = run(NULL, "--tp", "0", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	has(o->se, "--tp '0'");
	o = run(NULL, "--tp", "4x", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	o = run(NULL, "--kv-dtype", "int3", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	o = run(NULL, "--tier-gib", "1", "--tokens", "5", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	o = run(NULL, "--tier-gib", "-1", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	/* 2^64 - 1 tokens wrapped to a 0-chunk plan that "fits" (exit 1) */
	o = run(NULL, "--tokens", "18446744073709551615", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	has(o->se, "more than 2^50 tokens");
	o = run(NULL, "--tokens", "1125899906842624", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	has(o->se, "at most 2^30");
	o = run(NULL, "--numa-nodes", "0;1", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	has(o->se, "--numa-nodes='0;1'");
	o = run(NULL, "--bogus", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	o = run(NULL, NULL);
	assert_int_equal(o->rc, 2);
	o = run(NULL, "--tp", "3", "--node-free-gib", "64", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	has(o->se, "TP 3 does not divide the 8 KV heads");
	o = run(NULL, "--help", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "usage: kvtier-size");
}

static void t_fake_two_nodes(void **state)
{
	struct fake_machine m;
	struct out *o;
	char *root;

	(void)state;
	/* 8 GPUs over two sockets, 200 GiB free each: TP8 sharded puts four
	 * shards on each node, F is split between them. */
	fake_machine_sym(&m, 2, 4, 0x10de, 0x030200);
	root = fake_sysfs_write(&m);
	o = run(root, "--tp", "8", "--tier-gib", "20", "--fixed-gib", "64",
		"@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "gpu-local");
	has(o->so, "0-3 on node 0");
	has(o->so, "4-7 on node 1");
	has(o->so, "\n0         32.00 GiB");
	has(o->so, "\n1         32.00 GiB");
	/* 4 x 48 GiB per node + 32 GiB > 200 GiB: no fit, largest reported. */
	o = run(root, "--tp", "8", "--tier-gib", "48", "--fixed-gib", "64",
		"@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 1);
	has(o->so, "DOES NOT FIT");
	has(o->so, "tier that fits: 42.00 GiB per rank = 10,751 chunks");  /* (200 - 32) / 4 less metadata */
	/* Explicit node 1 only: all eight shards there. */
	o = run(root, "--tp", "8", "--tier-gib", "20", "--numa-nodes", "1",
		"@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "arena on node 1");
	/* A node that does not exist is an error. */
	o = run(root, "--numa-nodes", "4", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 2);
	has(o->se, "node 4 does not exist");
	fake_sysfs_remove(root);
}

static void t_fake_hugepages(void **state)
{
	struct fake_machine m;
	struct out *o;
	char *root;

	(void)state;
	/* 64 GiB of 2 MiB pages reserved on node 0: the segment goes there. */
	fake_machine_sym(&m, 1, 1, 0x1002, 0x120000);
	m.hp2m_total = m.hp2m_free = m.nodes[0].hp2m_total = m.nodes[0].hp2m_free = 32768;
	root = fake_sysfs_write(&m);
	o = run(root, "--tier-gib", "32", "--fixed-gib", "150", "@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "2 MiB huge pages for the segment");
	/* Too small a pool: like kvtier, fall back to 4 KiB pages, and say so. */
	o = run(root, "--tier-gib", "100", "--fixed-gib", "10", "@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "falls back to 4 KiB pages");
	o = run(root, "--hugepages", "on", "--tier-gib", "100", "--fixed-gib", "10",
		"@deepseek-v3.json", NULL);
	assert_int_equal(o->rc, 1);
	fake_sysfs_remove(root);

	/* A small pool reserved (32 pages, 64 MiB) beside plenty of memory:
	 * the largest tier is what the node can still give on 4 KiB pages,
	 * not what the pool holds -- sized, and beside a segment that fits
	 * the pool; --hugepages off says the same. */
	fake_machine_sym(&m, 1, 1, 0x1002, 0x120000);
	m.hp2m_total = m.hp2m_free = m.nodes[0].hp2m_total = m.nodes[0].hp2m_free = 32;
	root = fake_sysfs_write(&m);
	o = run(root, "--tp", "1", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, "falls back to 4 KiB pages");
	hasnt(o->so, "tier that fits: 0.0");
	{
		const char *l = strstr(o->so, "tier that fits: ");
		double gb = l ? strtod(l + 16, NULL) : 0;
		if (gb < 100)
			fail_msg("largest tier %.2f GiB with a 32-page pool:\n%s", gb, o->so);
	}
	char *sized = strdup(strstr(o->so, "tier that fits: "));
	o = run(root, "--tp", "1", "--tokens", "256", "@llama-3.1-8b.json", NULL);
	if (o->rc) fail_msg("rc %d: %s", o->rc, o->se);
	has(o->so, "2 MiB huge pages for the segment");
	has(o->so, "(on 4 KiB pages: more than the huge page pool holds)");
	o = run(root, "--tp", "1", "--hugepages", "off", "@llama-3.1-8b.json", NULL);
	assert_int_equal(o->rc, 0);
	has(o->so, strtok(sized, "\n"));
	free(sized);
	fake_sysfs_remove(root);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(t_llama_fits),
		cmocka_unit_test(t_json),
		cmocka_unit_test(t_amd_pinning),
		cmocka_unit_test(t_deepseek_no_fit),
		cmocka_unit_test(t_glm_fp8),
		cmocka_unit_test(t_errors),
		cmocka_unit_test(t_fake_two_nodes),
		cmocka_unit_test(t_fake_hugepages),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
