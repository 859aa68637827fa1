/* fake_sysfs.c - see fake_sysfs.h. */
#include <errno.h>
#include <stdarg.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fake_sysfs.h"

static void die(const char *what, const char *path)
{
	fprintf(stderr, "fake_sysfs: %s %s: %s\n", what, path, strerror(errno));
	abort();
}

static void mkdirs(const char *path)
{
	char buf[1024];

	snprintf(buf, sizeof(buf), "%s", path);
	for (char *p = buf + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(buf, 0755) && errno != EEXIST)
			die("mkdir", buf);
		*p = '/';
	}
	if (mkdir(buf, 0755) && errno != EEXIST)
		die("mkdir", buf);
}

static void put(const char *dir, const char *name, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void put(const char *dir, const char *name, const char *fmt, ...)
{
	char path[1024];
	va_list ap;
	FILE *f;

	mkdirs(dir);
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(path, "w");
	if (!f)
		die("create", path);
	va_start(ap, fmt);
	vfprintf(f, fmt, ap);
	va_end(ap);
	fclose(f);
}

void fake_pci_add(struct fake_machine *m, int bus, int fn_or_dev, uint16_t vendor,
		  uint32_t cls, int node)
{
	struct fake_pci *p;

	if (bus > 0xff || m->n_pci >= 64 || fn_or_dev > 0x1f)
		abort(); /* a test asked for more than the tree can hold */
	p = &m->pci[m->n_pci++];

	/* fn_or_dev < 2: function of device 0; else device number, function 0. */
	if (fn_or_dev < 2)
		snprintf(p->addr, sizeof(p->addr), "0000:%02x:00.%d", bus, fn_or_dev);
	else
		snprintf(p->addr, sizeof(p->addr), "0000:%02x:%02x.0", bus, fn_or_dev);
	p->vendor = vendor;
	p->cls = cls;
	p->node = node;
}

void fake_machine_sym(struct fake_machine *m, int n_nodes, int gpus_per_node,
		      uint16_t vendor, uint32_t cls)
{
	if (n_nodes < 1 || n_nodes > 8 || gpus_per_node > 6)
		abort();
	memset(m, 0, sizeof(*m));
	m->n_nodes = n_nodes;
	for (int i = 0; i < n_nodes; i++) {
		m->nodes[i] = (struct fake_node){
			.id = i, .total_kb = 256ull << 20, .free_kb = 200ull << 20,
		};
		snprintf(m->nodes[i].cpulist, sizeof(m->nodes[i].cpulist), "%d-%d,%d-%d",
			 i * 8, i * 8 + 7, 64 + i * 8, 64 + i * 8 + 7);
	}
	for (int i = 0; i < n_nodes; i++) {
		for (int g = 0; g < gpus_per_node; g++) {
			/* Buses grow with the socket, as on real boards. */
			int bus = 0x10 + i * 0x1c + g * 0x04;

			fake_pci_add(m, bus, 0, vendor, cls, i);
			/* The board's audio / other function: not a GPU. */
			fake_pci_add(m, bus, 1, vendor, 0x040300, i);
		}
		/* A NIC per socket. */
		fake_pci_add(m, 0x10 + i * 0x1c + 0x18, 0, 0x15b3, 0x020000, i);
	}
	/* An Intel iGPU: VGA class, wrong vendor. */
	fake_pci_add(m, 0x00, 2, 0x8086, 0x030000, 0);
}

char *fake_sysfs_write(const struct fake_machine *m)
{
	char tmpl[] = "/tmp/kvt-fake-sysfs-XXXXXX";
	char *root = mkdtemp(tmpl) ? strdup(tmpl) : NULL;
	char dir[1024];

	if (!root)
		die("mkdtemp", tmpl);
	for (int i = 0; i < m->n_nodes; i++) {
		const struct fake_node *n = &m->nodes[i];

		snprintf(dir, sizeof(dir), "%s/devices/system/node/node%d", root, n->id);
		put(dir, "meminfo",
		    "Node %d MemTotal:       %llu kB\n"
		    "Node %d MemFree:        %llu kB\n"
		    "Node %d MemUsed:        %llu kB\n"
		    "Node %d HugePages_Total:  %llu\n",
		    n->id, (unsigned long long)n->total_kb, n->id,
		    (unsigned long long)n->free_kb, n->id,
		    (unsigned long long)(n->total_kb - n->free_kb), n->id,
		    (unsigned long long)n->hp2m_total);
		if (!n->no_cpulist)
			put(dir, "cpulist", "%s\n", n->cpulist);
		snprintf(dir, sizeof(dir),
			 "%s/devices/system/node/node%d/hugepages/hugepages-2048kB", root, n->id);
		put(dir, "nr_hugepages", "%llu\n", (unsigned long long)n->hp2m_total);
		put(dir, "free_hugepages", "%llu\n", (unsigned long long)n->hp2m_free);
		put(dir, "surplus_hugepages", "0\n");
		snprintf(dir, sizeof(dir),
			 "%s/devices/system/node/node%d/hugepages/hugepages-1048576kB", root, n->id);
		put(dir, "nr_hugepages", "0\n");
		put(dir, "free_hugepages", "0\n");
	}
	/* Files the reader must ignore. */
	snprintf(dir, sizeof(dir), "%s/devices/system/node", root);
	put(dir, "online", "0-%d\n", m->n_nodes - 1);
	put(dir, "possible", "0-%d\n", m->n_nodes - 1);
	for (int i = 0; i < m->n_pci; i++) {
		const struct fake_pci *p = &m->pci[i];

		snprintf(dir, sizeof(dir), "%s/bus/pci/devices/%s", root, p->addr);
		put(dir, "vendor", "0x%04x\n", p->vendor);
		put(dir, "class", "0x%06x\n", p->cls);
		put(dir, "numa_node", "%d\n", p->node);
	}
	if (!m->no_hp_dir) {
		snprintf(dir, sizeof(dir), "%s/kernel/mm/hugepages/hugepages-2048kB", root);
		put(dir, "nr_hugepages", "%llu\n", (unsigned long long)m->hp2m_total);
		put(dir, "free_hugepages", "%llu\n", (unsigned long long)m->hp2m_free);
		put(dir, "resv_hugepages", "%llu\n", (unsigned long long)m->hp2m_resv);
		put(dir, "surplus_hugepages", "0\n");
	}
	return root;
}

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st; (void)flag; (void)ftw;
	return remove(path);
}

void fake_sysfs_remove(char *root)
{
	if (!root)
		return;
	/* Only ever our own mkdtemp directories. */
	if (strncmp(root, "/tmp/kvt-fake-", 14) == 0)
		nftw(root, rm_one, 16, FTW_DEPTH | FTW_PHYS);
	free(root);
}

char *fake_file(const char *name, const char *text)
{
	char tmpl[] = "/tmp/kvt-fake-file-XXXXXX";
	char path[1024];

	if (!mkdtemp(tmpl))
		die("mkdtemp", tmpl);
	put(tmpl, name, "%s", text);
	snprintf(path, sizeof(path), "%s/%s", tmpl, name);
	return strdup(path);
}

void fake_file_remove(char *path)
{
	char *slash;

	if (!path)
		return;
	slash = strrchr(path, '/');
	unlink(path);
	if (slash) {
		*slash = '\0';
		if (strncmp(path, "/tmp/kvt-fake-", 14) == 0)
			rmdir(path);
	}
	free(path);
}
