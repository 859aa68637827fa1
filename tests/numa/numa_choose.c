/* numa_choose.c - the placement choice: strict node lists, the order
 * explicit > process policy > GPU-local > local, and per-shard nodes, on
 * fake 1-, 2-, 4- and 8-node machines. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#ifdef KVTIER_HAVE_NUMA
#include <numaif.h>
#endif

#include "fake_sysfs.h"
#include "kvt_numa.h"

struct logcap {
	int infos, warns;
	char last_info[1024], last_warn[1024];
};

static void capture(void *arg, int level, const char *msg)
{
	struct logcap *c = arg;

	if (level == KVT_NUMA_LOG_WARN) {
		c->warns++;
		snprintf(c->last_warn, sizeof(c->last_warn), "%s", msg);
	} else {
		c->infos++;
		snprintf(c->last_info, sizeof(c->last_info), "%s", msg);
	}
}


static void mask_is(const struct kvt_nodemask *m, const char *want)
{
	char buf[256];

	kvt_nodemask_format(m, buf, sizeof(buf));
	assert_string_equal(buf, want);
}

/* A request with no environment, a given policy (NULL: none), local node 0. */
static struct kvt_numa_request req_base(uint32_t shards, const struct kvt_numa_policy *pol,
					const int *local, struct logcap *cap)
{
	static const struct kvt_numa_policy none = {.mode = KVT_NUMA_NONE};
	struct kvt_numa_request r;

	memset(&r, 0, sizeof(r));
	r.size = sizeof(r);
	r.flags = KVT_NUMA_F_NO_ENV;
	r.n_shards = shards;
	r.policy = pol ? pol : &none;
	r.local_node = local;
	r.log = capture;
	r.log_arg = cap;
	return r;
}

static struct kvt_numa_topo *machine(int nodes, int gpus_per_node, char **root)
{
	struct fake_machine m;
	struct kvt_numa_topo *t = NULL;

	fake_machine_sym(&m, nodes, gpus_per_node, 0x10de, 0x030200);
	*root = fake_sysfs_write(&m);
	assert_int_equal(kvt_numa_topo_read(*root, &t), 0);
	return t;
}

static void done(struct kvt_numa_topo *t, char *root)
{
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
}

/* ---- node lists ---------------------------------------------------------- */

static void t_parse_valid(void **state)
{
	static const struct { const char *in, *out; } ok[] = {
		{"0", "0"}, {"1", "1"}, {"0,1", "0-1"}, {"0-3", "0-3"},
		{"0-1,4-5", "0-1,4-5"}, {"7,3", "3,7"}, {"2,2", "2"}, {"5-5", "5"},
		{"0,2,4,6", "0,2,4,6"}, {"1023", "1023"}, {"0-2,1-3", "0-3"},
	};
	struct kvt_nodemask m;

	(void)state;
	for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
		assert_int_equal(kvt_nodemask_parse(ok[i].in, "KVTIER_NUMA_NODES", &m), 0);
		mask_is(&m, ok[i].out);
	}
	assert_int_equal(kvt_nodemask_parse("0-3", NULL, &m), 0);
	assert_int_equal(kvt_nodemask_count(&m), 4);
	assert_int_equal(kvt_nodemask_first(&m), 0);
	assert_int_equal(kvt_nodemask_next(&m, 3), -1);
}

static void t_parse_strict(void **state)
{
	static const char *const bad[] = {
		"", " 0", "0 ", "0,", ",0", "0,,1", "a", "0-", "-1", "3-1", "0 1", "0;1",
		"1024", "+1", "0x1", "1.0", "0--1", "0-1-2", "node0", "all", "0,1\n",
	};
	struct kvt_nodemask m;

	(void)state;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		kvt_nodemask_zero(&m);
		assert_int_equal(kvt_nodemask_parse(bad[i], "KVTIER_NUMA_NODES", &m), -EINVAL);
		/* The error names the variable, so the operator knows where to look. */
		assert_non_null(strstr(kvt_numa_last_error(), "KVTIER_NUMA_NODES"));
		assert_int_equal(kvt_nodemask_count(&m), 0);
	}
	assert_int_equal(kvt_nodemask_parse(NULL, "x", &m), -EINVAL);
}

static void t_format_truncates(void **state)
{
	struct kvt_nodemask m;
	char small[4];

	(void)state;
	assert_int_equal(kvt_nodemask_parse("0,2,4,6,8", "t", &m), 0);
	assert_int_equal(kvt_nodemask_format(&m, small, sizeof(small)), 9);
	assert_true(strlen(small) < sizeof(small));
	kvt_nodemask_zero(&m);
	assert_int_equal(kvt_nodemask_set(&m, 1024), -EINVAL);
	assert_int_equal(kvt_nodemask_set(&m, -1), -EINVAL);
	assert_int_equal(kvt_nodemask_format(&m, small, sizeof(small)), 0);
	assert_string_equal(small, "");
}

static void t_env_invalid(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	t = machine(2, 1, &root);
	r = req_base(1, NULL, &local, &cap);
	r.flags = KVT_NUMA_F_FALLBACK;    /* even with fallback: a typo is an error */
	setenv("KVTIER_NUMA_NODES", "0;1", 1);
	assert_int_equal(kvt_numa_choose(t, &r, &p), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "KVTIER_NUMA_NODES='0;1'"));
	setenv("KVTIER_NUMA_NODES", "1", 1);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_EXPLICIT);
	mask_is(&p.nodes, "1");
	assert_non_null(strstr(p.reason, "KVTIER_NUMA_NODES=1"));
	/* Set but empty: as if unset. */
	setenv("KVTIER_NUMA_NODES", "", 1);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_not_equal(p.source, KVT_NUMA_SRC_EXPLICIT);
	/* NO_ENV ignores it. */
	setenv("KVTIER_NUMA_NODES", "1", 1);
	r.flags = KVT_NUMA_F_NO_ENV;
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_not_equal(p.source, KVT_NUMA_SRC_EXPLICIT);
	unsetenv("KVTIER_NUMA_NODES");
	done(t, root);
}

/* ---- the order of choice ------------------------------------------------- */

static void t_explicit_beats_policy(void **state)
{
	struct kvt_numa_policy pol = {.mode = KVT_NUMA_BIND};
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	t = machine(2, 4, &root);
	kvt_nodemask_set(&pol.nodes, 1);
	r = req_base(1, &pol, &local, &cap);
	r.nodes = "0";
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_EXPLICIT);
	mask_is(&p.nodes, "0");
	assert_int_equal(p.shard[0].mode, KVT_NUMA_BIND);
	mask_is(&p.shard[0].nodes, "0");
	assert_non_null(strstr(p.reason, "--numa-nodes=0"));
	/* The choice and its reason are logged. */
	assert_int_equal(cap.infos, 1);
	assert_string_equal(cap.last_info, p.reason);
	done(t, root);
}

static void t_policy_beats_gpu(void **state)
{
	struct kvt_numa_policy pol = {.mode = KVT_NUMA_BIND};
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	/* GPUs on both sockets, but numactl --membind=1 started the process. */
	t = machine(2, 4, &root);
	kvt_nodemask_set(&pol.nodes, 1);
	r = req_base(8, &pol, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_POLICY);
	mask_is(&p.nodes, "1");
	for (int s = 0; s < 8; s++) {
		/* membind is a promise: every shard on node 1, even those
		 * whose GPU sits on node 0. */
		assert_int_equal(p.shard[s].mode, KVT_NUMA_BIND);
		mask_is(&p.shard[s].nodes, "1");
	}
	assert_non_null(strstr(p.reason, "numactl --membind=1"));
	done(t, root);
}

static void t_policy_interleave_kept(void **state)
{
	struct kvt_numa_policy pol = {.mode = KVT_NUMA_INTERLEAVE};
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	t = machine(4, 2, &root);
	kvt_nodemask_set(&pol.nodes, 0);
	kvt_nodemask_set(&pol.nodes, 1);
	r = req_base(8, &pol, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_POLICY);
	for (int s = 0; s < 8; s++) {
		assert_int_equal(p.shard[s].mode, KVT_NUMA_INTERLEAVE);
		mask_is(&p.shard[s].nodes, "0-1");
	}
	assert_non_null(strstr(p.reason, "--interleave=0-1"));
	done(t, root);
}

static void t_policy_preferred_narrows(void **state)
{
	struct kvt_numa_policy pol = {.mode = KVT_NUMA_PREFERRED};
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	/* 4 nodes, 2 GPUs each; preferred 0-1: ranks 0-3 (GPUs on nodes 0
	 * and 1) keep their own node; ranks 4-7 (nodes 2, 3) get the set. */
	t = machine(4, 2, &root);
	kvt_nodemask_set(&pol.nodes, 0);
	kvt_nodemask_set(&pol.nodes, 1);
	r = req_base(8, &pol, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_POLICY);
	mask_is(&p.shard[0].nodes, "0");
	mask_is(&p.shard[1].nodes, "0");
	mask_is(&p.shard[2].nodes, "1");
	mask_is(&p.shard[3].nodes, "1");
	for (int s = 4; s < 8; s++)
		mask_is(&p.shard[s].nodes, "0-1");
	for (int s = 0; s < 8; s++)
		assert_int_equal(p.shard[s].mode, KVT_NUMA_PREFERRED);
	done(t, root);
}

static void t_policy_on_memless_node_ignored(void **state)
{
	struct kvt_numa_policy pol = {.mode = KVT_NUMA_BIND};
	struct fake_machine m;
	struct logcap cap = {0};
	struct kvt_numa_topo *t = NULL;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	fake_machine_sym(&m, 2, 1, 0x10de, 0x030200);
	m.nodes[1].total_kb = m.nodes[1].free_kb = 0;
	root = fake_sysfs_write(&m);
	assert_int_equal(kvt_numa_topo_read(root, &t), 0);
	kvt_nodemask_set(&pol.nodes, 1);
	r = req_base(1, &pol, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	/* Nothing usable in the policy: on to the GPUs (GPU 1's node has no
	 * memory either, so only GPU 0 counts). */
	assert_int_equal(p.source, KVT_NUMA_SRC_GPU);
	mask_is(&p.nodes, "0");
	done(t, root);
}

static void t_gpu_local_two_nodes(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 1;

	(void)state;
	t = machine(2, 4, &root);
	r = req_base(8, NULL, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_GPU);
	mask_is(&p.nodes, "0-1");
	for (int s = 0; s < 8; s++) {
		assert_int_equal(p.shard[s].mode, KVT_NUMA_BIND);
		mask_is(&p.shard[s].nodes, s < 4 ? "0" : "1");
	}
	assert_non_null(strstr(p.reason, "gpu-local"));
	assert_non_null(strstr(p.reason, "0-3 on node 0"));
	assert_non_null(strstr(p.reason, "4-7 on node 1"));
	done(t, root);
}

static void t_gpu_local_one_node(void **state)
{
	struct fake_machine m;
	struct logcap cap = {0};
	struct kvt_numa_topo *t = NULL;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	/* One node, firmware without PCI affinity (numa_node -1): the GPUs are
	 * on that node, and the arena is bound there. */
	fake_machine_sym(&m, 1, 2, 0x1002, 0x120000);
	for (int i = 0; i < m.n_pci; i++)
		m.pci[i].node = -1;
	root = fake_sysfs_write(&m);
	assert_int_equal(kvt_numa_topo_read(root, &t), 0);
	r = req_base(2, NULL, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_GPU);
	mask_is(&p.nodes, "0");
	mask_is(&p.shard[0].nodes, "0");
	mask_is(&p.shard[1].nodes, "0");
	assert_int_equal(p.shard[1].mode, KVT_NUMA_BIND);
	done(t, root);
}

static void t_gpu_local_four_and_eight(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root, want[8];
	int local = 0;

	(void)state;
	t = machine(4, 2, &root);
	r = req_base(8, NULL, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_GPU);
	mask_is(&p.nodes, "0-3");
	for (int s = 0; s < 8; s++) {
		snprintf(want, sizeof(want), "%d", s / 2);
		mask_is(&p.shard[s].nodes, want);
	}
	done(t, root);

	t = machine(8, 1, &root);
	r = req_base(8, NULL, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	mask_is(&p.nodes, "0-7");
	for (int s = 0; s < 8; s++) {
		snprintf(want, sizeof(want), "%d", s);
		mask_is(&p.shard[s].nodes, want);
	}
	done(t, root);
}

static void t_gpu_rank_map(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;
	/* A TP4 engine on the second socket's GPUs (CUDA_VISIBLE_DEVICES=4-7). */
	const int gpus[4] = {4, 5, 6, 7};
	const int unknown[4] = {-1, -1, -1, -1};

	(void)state;
	t = machine(2, 4, &root);
	r = req_base(4, NULL, &local, &cap);
	r.rank_gpu = gpus;
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_GPU);
	mask_is(&p.nodes, "1");
	for (int s = 0; s < 4; s++)
		mask_is(&p.shard[s].nodes, "1");
	/* GPUs not known at all: the local node. */
	r.rank_gpu = unknown;
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_LOCAL);
	mask_is(&p.nodes, "0");
	done(t, root);
}

static void t_replicated(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;
	const int on_node1[8] = {4, 5, 6, 7, 4, 5, 6, 7};

	(void)state;
	/* MLA over all 8 GPUs of two sockets: one shard every rank reads, so
	 * interleaved between the sockets rather than all on one. */
	t = machine(2, 4, &root);
	r = req_base(1, NULL, &local, &cap);
	r.n_ranks = 8;
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_GPU);
	assert_int_equal(p.n_shards, 1);
	mask_is(&p.shard[0].nodes, "0-1");
	assert_int_equal(p.shard[0].mode, KVT_NUMA_INTERLEAVE);
	assert_non_null(strstr(p.reason, "1 shard, interleave"));
	/* All ranks on one socket: bound there. */
	r.rank_gpu = on_node1;
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	mask_is(&p.shard[0].nodes, "1");
	assert_int_equal(p.shard[0].mode, KVT_NUMA_BIND);
	/* Explicit two nodes: interleaved too. */
	r.nodes = "0-1";
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_EXPLICIT);
	assert_int_equal(p.shard[0].mode, KVT_NUMA_INTERLEAVE);
	done(t, root);
}

static void t_multi_instance(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	/* Two TP4 instances, one per socket: shard s is written by rank s of
	 * each, on both sockets. */
	t = machine(2, 4, &root);
	r = req_base(4, NULL, &local, &cap);
	r.n_ranks = 8;
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	for (int s = 0; s < 4; s++) {
		mask_is(&p.shard[s].nodes, "0-1");
		assert_int_equal(p.shard[s].mode, KVT_NUMA_INTERLEAVE);
	}
	done(t, root);
}

static void t_explicit_sharded(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	t = machine(2, 4, &root);
	r = req_base(8, NULL, &local, &cap);
	/* Both sockets named: each shard still goes to its GPU's node. */
	r.nodes = "0,1";
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_EXPLICIT);
	for (int s = 0; s < 8; s++)
		mask_is(&p.shard[s].nodes, s < 4 ? "0" : "1");
	/* One socket named: the operator wins over GPU locality. */
	r.nodes = "1";
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	for (int s = 0; s < 8; s++) {
		mask_is(&p.shard[s].nodes, "1");
		assert_int_equal(p.shard[s].mode, KVT_NUMA_BIND);
	}
	done(t, root);
}

static void t_explicit_bad_node(void **state)
{
	struct fake_machine m;
	struct logcap cap = {0};
	struct kvt_numa_topo *t = NULL;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	t = machine(2, 4, &root);
	r = req_base(8, NULL, &local, &cap);
	r.nodes = "0,5";
	assert_int_equal(kvt_numa_choose(t, &r, &p), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "node 5 does not exist"));
	assert_non_null(strstr(kvt_numa_last_error(), "nodes with memory: 0-1"));
	/* --numa-fallback: a warning, then the next step (GPU-local). */
	r.flags |= KVT_NUMA_F_FALLBACK;
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(cap.warns, 1);
	assert_non_null(strstr(cap.last_warn, "node 5 does not exist"));
	assert_non_null(strstr(cap.last_warn, "--numa-fallback"));
	assert_int_equal(p.source, KVT_NUMA_SRC_GPU);
	assert_int_equal(p.flags & KVT_NUMA_F_FALLBACK, KVT_NUMA_F_FALLBACK);
	done(t, root);

	/* A CPU-only node without memory cannot hold the arena. */
	fake_machine_sym(&m, 2, 0, 0, 0);
	m.nodes[1].total_kb = m.nodes[1].free_kb = 0;
	root = fake_sysfs_write(&m);
	assert_int_equal(kvt_numa_topo_read(root, &t), 0);
	r = req_base(1, NULL, &local, &cap);
	r.nodes = "1";
	assert_int_equal(kvt_numa_choose(t, &r, &p), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "node 1 has no memory"));
	done(t, root);
}

static void t_local(void **state)
{
	struct fake_machine m;
	struct logcap cap = {0};
	struct kvt_numa_topo *t = NULL;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 2;

	(void)state;
	t = machine(4, 0, &root);
	r = req_base(4, NULL, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_LOCAL);
	mask_is(&p.nodes, "2");
	for (int s = 0; s < 4; s++) {
		mask_is(&p.shard[s].nodes, "2");
		assert_int_equal(p.shard[s].mode, KVT_NUMA_BIND);
	}
	assert_non_null(strstr(p.reason, "local node 2"));
	done(t, root);

	/* Running on a memory-less node: the first node with memory, said so. */
	fake_machine_sym(&m, 3, 0, 0, 0);
	m.nodes[0].total_kb = m.nodes[0].free_kb = 0;
	root = fake_sysfs_write(&m);
	assert_int_equal(kvt_numa_topo_read(root, &t), 0);
	local = 0;
	r = req_base(1, NULL, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	mask_is(&p.nodes, "1");
	assert_non_null(strstr(p.reason, "first node with memory"));
	done(t, root);

	/* Detected from the CPU we run on: real CPUs 0-7 are node 0 here. */
	t = machine(2, 0, &root);
	r = req_base(1, NULL, NULL, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_LOCAL);
	assert_int_equal(kvt_nodemask_count(&p.nodes), 1);
	done(t, root);
}

static void t_bad_requests(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	t = machine(1, 0, &root);
	r = req_base(0, NULL, &local, &cap);
	assert_int_equal(kvt_numa_choose(t, &r, &p), -EINVAL);
	r.n_shards = 65;
	assert_int_equal(kvt_numa_choose(t, &r, &p), -EINVAL);
	r.n_shards = 4;
	r.n_ranks = 2;
	assert_int_equal(kvt_numa_choose(t, &r, &p), -EINVAL);
	r.n_ranks = 0;
	r.flags = 0x100;
	assert_int_equal(kvt_numa_choose(t, &r, &p), -EINVAL);
	r.flags = KVT_NUMA_F_NO_ENV;
	r.size = sizeof(r) - 8;
	assert_int_equal(kvt_numa_choose(t, &r, &p), -EINVAL);
	r.size = sizeof(r);
	r.reserved = 1;
	assert_int_equal(kvt_numa_choose(t, &r, &p), -EINVAL);
	assert_int_equal(kvt_numa_choose(NULL, &r, &p), -EINVAL);
	done(t, root);
}

static void t_real_policy(void **state)
{
#ifdef KVTIER_HAVE_NUMA
	struct kvt_numa_policy pol;
	pid_t pid;
	int st;

	(void)state;
	assert_int_equal(kvt_numa_policy_read(&pol), 0);
	assert_int_equal(pol.mode, KVT_NUMA_NONE);
	/* In a child, as `numactl --membind=0` would start it. */
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		struct kvt_numa_topo *t = NULL;
		struct kvt_numa_request r;
		struct kvt_numa_plan p;
		struct logcap cap = {0};
		unsigned long mask = 1;
		int ok;

		if (set_mempolicy(MPOL_BIND, &mask, 65))
			_exit(2);
		ok = kvt_numa_policy_read(&pol) == 0 && pol.mode == KVT_NUMA_BIND &&
		     kvt_nodemask_test(&pol.nodes, 0) && kvt_nodemask_count(&pol.nodes) == 1;
		/* The real chooser reads it itself (policy NULL). */
		ok = ok && kvt_numa_topo_read("/sys", &t) == 0;
		memset(&r, 0, sizeof(r));
		r.size = sizeof(r);
		r.flags = KVT_NUMA_F_NO_ENV;
		r.n_shards = 2;
		r.log = capture;
		r.log_arg = &cap;
		ok = ok && kvt_numa_choose(t, &r, &p) == 0 && p.source == KVT_NUMA_SRC_POLICY &&
		     strstr(p.reason, "--membind=0") != NULL;
		kvt_numa_topo_free(t);
		_exit(ok ? 0 : 1);
	}
	assert_int_equal(waitpid(pid, &st, 0), pid);
	assert_true(WIFEXITED(st));
	assert_int_equal(WEXITSTATUS(st), 0);
#else
	struct kvt_numa_policy pol;

	(void)state;
	assert_int_equal(kvt_numa_policy_read(&pol), -ENOTSUP);
	assert_non_null(strstr(kvt_numa_last_error(), "NUMA support not built"));
#endif
}

static void t_default_log(void **state)
{
	struct kvt_numa_topo *t;
	struct kvt_numa_request r;
	struct kvt_numa_plan p;
	char *root;
	int local = 0;

	(void)state;
	/* No log callback: the reason goes to stderr, nothing crashes. */
	t = machine(2, 1, &root);
	r = req_base(2, NULL, &local, NULL);
	r.log = NULL;
	assert_int_equal(kvt_numa_choose(t, &r, &p), 0);
	assert_int_equal(p.source, KVT_NUMA_SRC_GPU);
	done(t, root);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(t_parse_valid),
		cmocka_unit_test(t_parse_strict),
		cmocka_unit_test(t_format_truncates),
		cmocka_unit_test(t_env_invalid),
		cmocka_unit_test(t_explicit_beats_policy),
		cmocka_unit_test(t_policy_beats_gpu),
		cmocka_unit_test(t_policy_interleave_kept),
		cmocka_unit_test(t_policy_preferred_narrows),
		cmocka_unit_test(t_policy_on_memless_node_ignored),
		cmocka_unit_test(t_gpu_local_two_nodes),
		cmocka_unit_test(t_gpu_local_one_node),
		cmocka_unit_test(t_gpu_local_four_and_eight),
		cmocka_unit_test(t_gpu_rank_map),
		cmocka_unit_test(t_replicated),
		cmocka_unit_test(t_multi_instance),
		cmocka_unit_test(t_explicit_sharded),
		cmocka_unit_test(t_explicit_bad_node),
		cmocka_unit_test(t_local),
		cmocka_unit_test(t_bad_requests),
		cmocka_unit_test(t_real_policy),
		cmocka_unit_test(t_default_log),
	};

	unsetenv("KVTIER_NUMA_NODES");
	return cmocka_run_group_tests(tests, NULL, NULL);
}
