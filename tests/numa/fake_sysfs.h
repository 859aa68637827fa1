/* fake_sysfs.h - builds fake sysfs trees (nodes, PCI GPUs, huge page pools)
 * in a temporary directory, so placement is tested for 1-, 2-, 4- and
 * 8-node machines on any host. */
#ifndef KVT_FAKE_SYSFS_H
#define KVT_FAKE_SYSFS_H

#include <stdint.h>

struct fake_node {
	int id;
	uint64_t total_kb, free_kb;   /* meminfo; total 0: a node without memory */
	char cpulist[64];             /* "" : an empty cpulist (memory-only node) */
	int no_cpulist;               /* no cpulist file at all */
	uint64_t hp2m_total, hp2m_free;
};

struct fake_pci {
	char addr[32];                /* "0000:3b:00.0" */
	uint16_t vendor;
	uint32_t cls;
	int node;                     /* numa_node file content */
};

struct fake_machine {
	int n_nodes;
	struct fake_node nodes[16];
	int n_pci;
	struct fake_pci pci[64];
	uint64_t hp2m_total, hp2m_free, hp2m_resv; /* global pool */
	int no_hp_dir;                /* no kernel/mm/hugepages at all */
};

/* Adds a PCI function at 0000:bus:00.fn (fn_or_dev 0/1) or 0000:bus:dev.0. */
void fake_pci_add(struct fake_machine *m, int bus, int fn_or_dev, uint16_t vendor,
		  uint32_t cls, int node);

/* A symmetric machine: n nodes, each 8 CPUs and 256 GiB (200 GiB free),
 * gpus_per_node GPUs of that vendor/class on each node, plus a NIC, an
 * audio function of each GPU and an Intel iGPU that must not count. */
void fake_machine_sym(struct fake_machine *m, int n_nodes, int gpus_per_node,
		      uint16_t vendor, uint32_t cls);

/* Writes the tree; returns a malloc'd root path (abort on failure). */
char *fake_sysfs_write(const struct fake_machine *m);
/* Removes the tree and frees the path. */
void fake_sysfs_remove(char *root);

/* Writes text to a new file under a fresh temporary directory; returns the
 * file path (malloc'd).  fake_file_remove deletes file and directory. */
char *fake_file(const char *name, const char *text);
void fake_file_remove(char *path);

#endif
