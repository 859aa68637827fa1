/* numa_topology.c - reading nodes, CPUs, memory, GPUs and huge page pools
 * from fake sysfs trees of 1, 2, 4 and 8 nodes (and from the real /sys). */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "fake_sysfs.h"
#include "kvt_numa.h"

static struct kvt_numa_topo *read_machine(const struct fake_machine *m, char **root)
{
	struct kvt_numa_topo *t = NULL;

	*root = fake_sysfs_write(m);
	assert_int_equal(kvt_numa_topo_read(*root, &t), 0);
	assert_non_null(t);
	return t;
}

static void t_one_node(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t;
	char *root;

	(void)state;
	fake_machine_sym(&m, 1, 0, 0, 0);
	t = read_machine(&m, &root);
	assert_int_equal(t->n_nodes, 1);
	assert_int_equal(t->nodes[0].id, 0);
	assert_int_equal(t->nodes[0].mem_total, 256ull << 30);
	assert_int_equal(t->nodes[0].mem_free, 200ull << 30);
	assert_int_equal(t->nodes[0].n_cpus, 16);
	assert_string_equal(t->nodes[0].cpulist, "0-7,64-71");
	assert_int_equal(t->n_gpus, 0);  /* the iGPU is Intel: not ours */
	assert_string_equal(t->root, root);
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
}

static void t_two_nodes_nvidia(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t;
	char *root;

	(void)state;
	fake_machine_sym(&m, 2, 4, 0x10de, 0x030200);
	t = read_machine(&m, &root);
	assert_int_equal(t->n_nodes, 2);
	assert_int_equal(t->n_gpus, 8);   /* audio functions and NICs excluded */
	for (uint32_t i = 0; i < t->n_gpus; i++) {
		assert_int_equal(t->gpus[i].vendor, 0x10de);
		assert_int_equal(t->gpus[i].pci_class, 0x030200);
		/* Sorted by PCI address: the first four on socket 0. */
		assert_int_equal(t->gpus[i].node, (int)i / 4);
		if (i)
			assert_true(strcmp(t->gpus[i - 1].pci, t->gpus[i].pci) < 0);
	}
	assert_string_equal(t->gpus[0].pci, "0000:10:00.0");
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
}

static void t_four_nodes_amd(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t;
	char *root;

	(void)state;
	/* MI300X: "processing accelerator" 0x1200xx, vendor AMD. */
	fake_machine_sym(&m, 4, 2, 0x1002, 0x120000);
	/* An older Instinct (MI100) is a display controller, 0x0380. */
	fake_pci_add(&m, 0xf0, 0, 0x1002, 0x038000, 3);
	/* An AMD (0x1022, not 0x1002) host bridge: not a GPU. */
	fake_pci_add(&m, 0x00, 3, 0x1022, 0x060000, 0);
	t = read_machine(&m, &root);
	assert_int_equal(t->n_nodes, 4);
	assert_int_equal(t->n_gpus, 9);
	for (uint32_t i = 0; i < 8; i++)
		assert_int_equal(t->gpus[i].node, (int)i / 2);
	assert_string_equal(t->gpus[8].pci, "0000:f0:00.0");
	assert_int_equal(t->gpus[8].pci_class, 0x038000);
	assert_int_equal(t->gpus[8].node, 3);
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
}

static void t_eight_nodes(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t;
	char *root;

	(void)state;
	fake_machine_sym(&m, 8, 1, 0x10de, 0x030200);
	t = read_machine(&m, &root);
	assert_int_equal(t->n_nodes, 8);
	assert_int_equal(t->n_gpus, 8);
	for (int i = 0; i < 8; i++) {
		assert_int_equal(t->nodes[i].id, i);
		assert_int_equal(t->gpus[i].node, i);
		assert_int_equal(kvt_numa_topo_cpu_node(t, i * 8 + 3), i);
		assert_int_equal(kvt_numa_topo_cpu_node(t, 64 + i * 8), i);
	}
	assert_int_equal(kvt_numa_topo_cpu_node(t, 200), -ENOENT);
	assert_null(kvt_numa_topo_node(t, 8));
	assert_non_null(kvt_numa_topo_node(t, 7));
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
}

static void t_sparse_node_ids(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t;
	char *root;

	(void)state;
	/* Node ids need not be dense (offline sockets, CXL nodes); node 10
	 * sorts after node 2, not between 1 and 2. */
	fake_machine_sym(&m, 3, 0, 0, 0);
	m.nodes[1].id = 2;
	m.nodes[2].id = 10;
	m.nodes[2].total_kb = 0;   /* memory-less */
	m.nodes[2].free_kb = 0;
	m.nodes[2].no_cpulist = 1;
	t = read_machine(&m, &root);
	assert_int_equal(t->n_nodes, 3);
	assert_int_equal(t->nodes[0].id, 0);
	assert_int_equal(t->nodes[1].id, 2);
	assert_int_equal(t->nodes[2].id, 10);
	assert_int_equal(t->nodes[2].mem_total, 0);
	assert_int_equal(t->nodes[2].n_cpus, 0);
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
}

static void t_numa_node_unknown(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t;
	char *root;

	(void)state;
	/* One memory node: -1 can only mean that node. */
	fake_machine_sym(&m, 1, 2, 0x10de, 0x030000);
	m.pci[0].node = -1;
	t = read_machine(&m, &root);
	assert_int_equal(t->n_gpus, 2);
	assert_int_equal(t->gpus[0].node, 0);
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);

	/* Two: -1 stays unknown. */
	fake_machine_sym(&m, 2, 1, 0x10de, 0x030200);
	m.pci[0].node = -1;
	t = read_machine(&m, &root);
	assert_int_equal(t->gpus[0].node, -1);
	assert_int_equal(t->gpus[1].node, 1);
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
}

static void t_gpu_find(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t;
	char *root;

	(void)state;
	fake_machine_sym(&m, 2, 2, 0x10de, 0x030200);
	t = read_machine(&m, &root);
	/* CUDA spells it "00000000:2C:00.0"-like or upper case; HSA gives
	 * bus:dev.fn; all name the same device. */
	assert_int_equal(kvt_numa_topo_gpu_find(t, "0000:2c:00.0"), 2);
	assert_int_equal(kvt_numa_topo_gpu_find(t, "0000:2C:00.0"), 2);
	assert_int_equal(kvt_numa_topo_gpu_find(t, "00000000:2C:00.0"), 2);
	assert_int_equal(kvt_numa_topo_gpu_find(t, "2c:00.0"), 2);
	assert_int_equal(kvt_numa_topo_gpu_find(t, "0000:2c:00.1"), -ENOENT);
	assert_int_equal(kvt_numa_topo_gpu_find(t, "gpu0"), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "gpu0"));
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
}

static void t_hugepage_pools(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t;
	const struct kvt_numa_hp *hp;
	char *root;

	(void)state;
	fake_machine_sym(&m, 2, 0, 0, 0);
	m.hp2m_total = 100;
	m.hp2m_free = 90;
	m.hp2m_resv = 5;
	m.nodes[0].hp2m_total = 60;
	m.nodes[0].hp2m_free = 55;
	m.nodes[1].hp2m_total = 40;
	m.nodes[1].hp2m_free = 35;
	t = read_machine(&m, &root);
	hp = kvt_numa_topo_hp(t, -1, 2u << 20);
	assert_non_null(hp);
	assert_int_equal(hp->total, 100);
	assert_int_equal(hp->free, 90);
	assert_int_equal(hp->resv, 5);
	hp = kvt_numa_topo_hp(t, 1, 2u << 20);
	assert_non_null(hp);
	assert_int_equal(hp->total, 40);
	assert_int_equal(hp->free, 35);
	hp = kvt_numa_topo_hp(t, 0, 1u << 30);
	assert_non_null(hp);           /* the 1 GiB pool exists, empty */
	assert_int_equal(hp->total, 0);
	assert_int_equal(t->nodes[0].n_hp, 2);
	assert_int_equal(t->nodes[0].hp[0].page_bytes, 2u << 20); /* sorted by size */
	assert_null(kvt_numa_topo_hp(t, 5, 2u << 20));
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
}

static void t_env_root(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t = NULL;
	char *root;

	(void)state;
	fake_machine_sym(&m, 4, 1, 0x10de, 0x030200);
	root = fake_sysfs_write(&m);
	setenv("KVTIER_SYSFS_ROOT", root, 1);
	assert_int_equal(kvt_numa_topo_read(NULL, &t), 0);
	unsetenv("KVTIER_SYSFS_ROOT");
	assert_int_equal(t->n_nodes, 4);
	assert_string_equal(t->root, root);
	kvt_numa_topo_free(t);
	fake_sysfs_remove(root);
	/* set but empty: refused, not the real /sys in silence */
	setenv("KVTIER_SYSFS_ROOT", "", 1);
	assert_int_equal(kvt_numa_topo_read(NULL, &t), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "KVTIER_SYSFS_ROOT is set but empty"));
	/* a root that is no sysfs: the variable and the path are named */
	setenv("KVTIER_SYSFS_ROOT", "/nonexistent-sysfs", 1);
	assert_true(kvt_numa_topo_read(NULL, &t) < 0);
	assert_non_null(strstr(kvt_numa_last_error(), "KVTIER_SYSFS_ROOT=/nonexistent-sysfs: "));
	unsetenv("KVTIER_SYSFS_ROOT");
}

static void t_broken_trees(void **state)
{
	struct fake_machine m;
	struct kvt_numa_topo *t = NULL;
	char *root, path[1024];
	FILE *f;

	(void)state;
	assert_int_equal(kvt_numa_topo_read("/nonexistent-kvtier-root", &t), -ENOENT);
	assert_null(t);
	assert_non_null(strstr(kvt_numa_last_error(), "/nonexistent-kvtier-root"));

	fake_machine_sym(&m, 2, 0, 0, 0);
	root = fake_sysfs_write(&m);
	snprintf(path, sizeof(path), "%s/devices/system/node/node1/meminfo", root);
	f = fopen(path, "w");
	assert_non_null(f);
	fputs("Node 1 nonsense\n", f);
	fclose(f);
	assert_int_equal(kvt_numa_topo_read(root, &t), -EIO);
	assert_null(t);
	assert_non_null(strstr(kvt_numa_last_error(), "node1/meminfo"));

	snprintf(path, sizeof(path), "%s/devices/system/node/node1/meminfo", root);
	f = fopen(path, "w");
	fputs("Node 1 MemTotal: 100 kB\nNode 1 MemFree: 50 kB\n", f);
	fclose(f);
	snprintf(path, sizeof(path), "%s/devices/system/node/node1/cpulist", root);
	f = fopen(path, "w");
	fputs("0-3,x\n", f);
	fclose(f);
	assert_int_equal(kvt_numa_topo_read(root, &t), -EIO);
	assert_non_null(strstr(kvt_numa_last_error(), "cpulist"));
	fake_sysfs_remove(root);

	assert_int_equal(kvt_numa_topo_read(NULL, NULL), -EINVAL);
}

static void t_real_sys(void **state)
{
	struct kvt_numa_topo *t = NULL;

	(void)state;
	/* Whatever this machine is, it has a node with memory and the CPU we
	 * run on belongs to some node. */
	unsetenv("KVTIER_SYSFS_ROOT");
	assert_int_equal(kvt_numa_topo_read(NULL, &t), 0);
	assert_true(t->n_nodes >= 1);
	assert_true(t->nodes[0].mem_total > 0);
	assert_true(kvt_numa_topo_cpu_node(t, 0) >= 0);
	kvt_numa_topo_free(t);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(t_one_node),
		cmocka_unit_test(t_two_nodes_nvidia),
		cmocka_unit_test(t_four_nodes_amd),
		cmocka_unit_test(t_eight_nodes),
		cmocka_unit_test(t_sparse_node_ids),
		cmocka_unit_test(t_numa_node_unknown),
		cmocka_unit_test(t_gpu_find),
		cmocka_unit_test(t_hugepage_pools),
		cmocka_unit_test(t_env_root),
		cmocka_unit_test(t_broken_trees),
		cmocka_unit_test(t_real_sys),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
