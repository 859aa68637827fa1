/* topology.c - what the machine has, read from sysfs under one root.
 *
 * Every path is built from the root (KVTIER_SYSFS_ROOT or an argument), so
 * the tests describe 2-, 4- and 8-node machines with GPUs spread over the
 * sockets as small directory trees and run on a one-node VM.  Nothing here
 * calls a NUMA system call: the topology is what sysfs says, the kernel's
 * own view (allowed nodes, policy) is consulted only when binding.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "numa_internal.h"

#define PATH_LEN 1024

static int join(char *out, const char *a, const char *b, const char *c, const char *d)
{
	int n = snprintf(out, PATH_LEN, "%s/%s%s%s%s%s", a, b, c ? "/" : "", c ? c : "",
			 d ? "/" : "", d ? d : "");

	if (n < 0 || n >= PATH_LEN)
		return kvt__numa_err(-ENAMETOOLONG, "sysfs path too long under %s", a);
	return 0;
}

/* "Node 0 MemFree:  4009188 kB" -> bytes.  The key must be followed by ':'. */
static int meminfo_field(const char *text, const char *key, uint64_t *out)
{
	size_t kl = strlen(key);

	for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
		const char *k = p;
		unsigned long long v;
		char unit[8] = "";

		/* Per-node files prefix "Node N "; /proc/meminfo does not. */
		if (strncmp(k, "Node ", 5) == 0) {
			k += 5;
			while (*k >= '0' && *k <= '9')
				k++;
			while (*k == ' ')
				k++;
		}
		if (strncmp(k, key, kl) || k[kl] != ':')
			continue;
		if (sscanf(k + kl + 1, "%llu %7s", &v, unit) < 1)
			return -EINVAL;
		if (unit[0] && strcmp(unit, "kB"))
			return -EINVAL;
		*out = unit[0] ? (uint64_t)v * 1024 : (uint64_t)v;
		return 0;
	}
	return -ENOENT;
}

static int read_u64_file(const char *path, int base, uint64_t *out)
{
	char buf[64];
	int r = kvt__read_text(path, buf, sizeof(buf));

	if (r < 0)
		return r;
	return kvt__parse_u64(buf, base, out) ? -EIO : 0;
}

/* "hugepages-2048kB" -> 2 MiB */
static int hp_dir_size(const char *name, uint64_t *bytes)
{
	unsigned long long kb;
	char tail[4];

	if (sscanf(name, "hugepages-%llukB%3s", &kb, tail) != 1 || kb == 0)
		return -EINVAL;
	*bytes = (uint64_t)kb * 1024;
	return 0;
}

static int hp_cmp(const void *a, const void *b)
{
	const struct kvt_numa_hp *x = a, *y = b;

	return x->page_bytes < y->page_bytes ? -1 : x->page_bytes > y->page_bytes;
}

/* Reads the pools under dir (…/hugepages); a missing dir is no pools. */
static int read_pools(const char *dir, struct kvt_numa_hp *hp, uint32_t *n)
{
	char path[PATH_LEN];
	struct dirent *e;
	DIR *d = opendir(dir);
	int r = 0;

	*n = 0;
	if (!d)
		return 0;
	while ((e = readdir(d)) != NULL && *n < KVT_NUMA_MAX_HP) {
		struct kvt_numa_hp p;

		memset(&p, 0, sizeof(p));
		if (hp_dir_size(e->d_name, &p.page_bytes))
			continue;
		if ((r = join(path, dir, e->d_name, "nr_hugepages", NULL)) ||
		    (r = read_u64_file(path, 10, &p.total)) ||
		    (r = join(path, dir, e->d_name, "free_hugepages", NULL)) ||
		    (r = read_u64_file(path, 10, &p.free))) {
			r = kvt__numa_err(-EIO, "cannot read huge page pool %s/%s", dir, e->d_name);
			break;
		}
		/* resv exists only for the global pools. */
		if (join(path, dir, e->d_name, "resv_hugepages", NULL) == 0)
			(void)read_u64_file(path, 10, &p.resv);
		hp[(*n)++] = p;
	}
	closedir(d);
	qsort(hp, *n, sizeof(*hp), hp_cmp);
	return r;
}

static int node_cmp(const void *a, const void *b)
{
	const struct kvt_numa_node *x = a, *y = b;

	return (x->id > y->id) - (x->id < y->id);
}

static int gpu_cmp(const void *a, const void *b)
{
	return strcmp(((const struct kvt_numa_gpu *)a)->pci,
		      ((const struct kvt_numa_gpu *)b)->pci);
}

static int node_name(const char *s, int *id)
{
	long v = 0;

	if (strncmp(s, "node", 4) || !s[4])
		return -EINVAL;
	for (s += 4; *s; s++) {
		if (*s < '0' || *s > '9')
			return -EINVAL;
		v = v * 10 + (*s - '0');
		if (v >= KVT_NUMA_MAX_NODES)
			return -EINVAL;
	}
	*id = (int)v;
	return 0;
}

static int read_node(const char *root, int id, struct kvt_numa_node *nd)
{
	char dir[PATH_LEN], path[PATH_LEN], name[32], text[8192];
	int r;

	snprintf(name, sizeof(name), "node%d", id);
	if ((r = join(dir, root, "devices/system/node", name, NULL)))
		return r;
	nd->id = id;
	if ((r = join(path, dir, "meminfo", NULL, NULL)))
		return r;
	r = kvt__read_text(path, text, sizeof(text));
	if (r < 0)
		return kvt__numa_err(-EIO, "cannot read %s: %s", path, strerror(-r));
	if (meminfo_field(text, "MemTotal", &nd->mem_total) ||
	    meminfo_field(text, "MemFree", &nd->mem_free))
		return kvt__numa_err(-EIO, "%s: no MemTotal/MemFree line", path);

	if ((r = join(path, dir, "cpulist", NULL, NULL)))
		return r;
	r = kvt__read_text(path, text, sizeof(text));
	if (r < 0)
		text[0] = '\0';   /* no cpulist: a memory-only node */
	text[strcspn(text, "\n")] = '\0';
	if (kvt__cpulist_has(text, -1, &nd->n_cpus) < 0)
		return kvt__numa_err(-EIO, "%s: '%s' is not a CPU list", path, text);
	nd->cpulist = strdup(text);
	if (!nd->cpulist)
		return kvt__numa_err(-ENOMEM, "out of memory");

	if ((r = join(path, dir, "hugepages", NULL, NULL)))
		return r;
	return read_pools(path, nd->hp, &nd->n_hp);
}

/* A kernel without CONFIG_NUMA: one node with everything. */
static int read_flat(struct kvt_numa_topo *t)
{
	char text[8192];
	int r = kvt__read_text("/proc/meminfo", text, sizeof(text));
	struct kvt_numa_node *nd;

	if (r < 0)
		return kvt__numa_err(-ENOENT, "no NUMA nodes under %s and no /proc/meminfo",
				     t->root);
	nd = calloc(1, sizeof(*nd));
	if (!nd)
		return kvt__numa_err(-ENOMEM, "out of memory");
	t->nodes = nd;
	t->n_nodes = 1;
	if (meminfo_field(text, "MemTotal", &nd->mem_total) ||
	    meminfo_field(text, "MemFree", &nd->mem_free))
		return kvt__numa_err(-EIO, "/proc/meminfo: no MemTotal/MemFree line");
	r = kvt__read_text("/sys/devices/system/cpu/online", text, sizeof(text));
	if (r < 0)
		text[0] = '\0';
	text[strcspn(text, "\n")] = '\0';
	if (kvt__cpulist_has(text, -1, &nd->n_cpus) < 0)
		text[0] = '\0', nd->n_cpus = 0;
	nd->cpulist = strdup(text);
	return nd->cpulist ? 0 : kvt__numa_err(-ENOMEM, "out of memory");
}

static int read_nodes(struct kvt_numa_topo *t)
{
	char dir[PATH_LEN];
	struct dirent *e;
	uint32_t cap = 0;
	DIR *d;
	int r = 0, id;

	if ((r = join(dir, t->root, "devices/system/node", NULL, NULL)))
		return r;
	d = opendir(dir);
	if (!d) {
		if (strcmp(t->root, KVT__SYSFS_DEFAULT) == 0)
			return read_flat(t);
		return kvt__numa_err(-ENOENT, "no NUMA node directory %s", dir);
	}
	while ((e = readdir(d)) != NULL) {
		if (node_name(e->d_name, &id))
			continue;
		if (t->n_nodes == cap) {
			uint32_t ncap = cap ? cap * 2 : 8;
			void *p = realloc(t->nodes, ncap * sizeof(*t->nodes));

			if (!p) {
				r = kvt__numa_err(-ENOMEM, "out of memory");
				break;
			}
			t->nodes = p;
			cap = ncap;
		}
		memset(&t->nodes[t->n_nodes], 0, sizeof(t->nodes[0]));
		/* Counted before reading so that free() sees a failed node's
		 * partial allocations. */
		t->n_nodes++;
		r = read_node(t->root, id, &t->nodes[t->n_nodes - 1]);
		if (r)
			break;
	}
	closedir(d);
	if (r)
		return r;
	if (t->n_nodes == 0)
		return kvt__numa_err(-ENOENT, "no node* directory in %s", dir);
	qsort(t->nodes, t->n_nodes, sizeof(*t->nodes), node_cmp);
	return 0;
}

static int is_gpu(uint64_t vendor, uint64_t cls)
{
	uint32_t base_sub = (uint32_t)(cls >> 8);

	if (vendor != 0x10de && vendor != 0x1002)
		return 0;
	/* VGA, 3D controller (data-centre NVIDIA), display controller (older
	 * AMD Instinct such as MI100), processing accelerator (MI200/MI300).
	 * Audio and other functions of the same boards are not GPUs. */
	return base_sub == 0x0300 || base_sub == 0x0302 || base_sub == 0x0380 ||
	       base_sub == 0x1200;
}

static int read_gpus(struct kvt_numa_topo *t)
{
	char dir[PATH_LEN], path[PATH_LEN], buf[64];
	struct dirent *e;
	uint32_t cap = 0;
	DIR *d;
	int r = 0;

	if ((r = join(dir, t->root, "bus/pci/devices", NULL, NULL)))
		return r;
	d = opendir(dir);
	if (!d)
		return 0;  /* no PCI (containers, some VMs): no GPUs known */
	while ((e = readdir(d)) != NULL) {
		uint64_t vendor, cls;
		int64_t node = -1;
		struct kvt_numa_gpu *g;

		if (e->d_name[0] == '.' || strlen(e->d_name) >= sizeof(g->pci))
			continue;
		if (join(path, dir, e->d_name, "vendor", NULL) ||
		    read_u64_file(path, 16, &vendor) ||
		    join(path, dir, e->d_name, "class", NULL) ||
		    read_u64_file(path, 16, &cls))
			continue;
		if (!is_gpu(vendor, cls))
			continue;
		if (join(path, dir, e->d_name, "numa_node", NULL) == 0 &&
		    kvt__read_text(path, buf, sizeof(buf)) > 0) {
			long long v;
			char extra;

			if (sscanf(buf, "%lld %c", &v, &extra) == 1 && v >= -1 &&
			    v < KVT_NUMA_MAX_NODES)
				node = v;
		}
		if (t->n_gpus == cap) {
			uint32_t ncap = cap ? cap * 2 : 8;
			void *p;

			if (ncap > KVT_NUMA_MAX_GPUS)
				break;
			p = realloc(t->gpus, ncap * sizeof(*t->gpus));
			if (!p) {
				r = kvt__numa_err(-ENOMEM, "out of memory");
				break;
			}
			t->gpus = p;
			cap = ncap;
		}
		g = &t->gpus[t->n_gpus++];
		memset(g, 0, sizeof(*g));
		/* the length was checked above; a copy by length, so that no
		 * optimisation level's format-truncation analysis has to see it */
		memcpy(g->pci, e->d_name, strlen(e->d_name) + 1);
		for (char *c = g->pci; *c; c++)
			*c = (char)(*c >= 'A' && *c <= 'F' ? *c - 'A' + 'a' : *c);
		g->vendor = (uint16_t)vendor;
		g->pci_class = (uint32_t)cls;
		g->node = (int)node;
	}
	closedir(d);
	if (r)
		return r;
	if (t->n_gpus)  /* qsort(NULL, 0) is undefined */
		qsort(t->gpus, t->n_gpus, sizeof(*t->gpus), gpu_cmp);
	return 0;
}

void kvt_numa_topo_free(struct kvt_numa_topo *t)
{
	if (!t)
		return;
	for (uint32_t i = 0; i < t->n_nodes; i++)
		free(t->nodes[i].cpulist);
	free(t->nodes);
	free(t->gpus);
	free(t->root);
	free(t);
}

int kvt_numa_topo_read(const char *root, struct kvt_numa_topo **out)
{
	struct kvt_numa_topo *t;
	char path[PATH_LEN];
	int r, with_mem = 0, mem_node = -1, from_env;

	if (!out)
		return kvt__numa_err(-EINVAL, "kvt_numa_topo_read: out is NULL");
	t = calloc(1, sizeof(*t));
	if (!t)
		return kvt__numa_err(-ENOMEM, "out of memory");
	from_env = !(root && *root) && getenv("KVTIER_SYSFS_ROOT");
	if (from_env && !*kvt__sysfs_root(root)) {
		free(t);
		return kvt__numa_err(-EINVAL, "KVTIER_SYSFS_ROOT is set but empty: unset it "
				     "(the default is /sys) or name a sysfs copy");
	}
	t->root = strdup(kvt__sysfs_root(root));
	if (!t->root) {
		free(t);
		return kvt__numa_err(-ENOMEM, "out of memory");
	}
	if ((r = read_nodes(t)) || (r = read_gpus(t)) ||
	    (r = join(path, t->root, "kernel/mm/hugepages", NULL, NULL)) ||
	    (r = read_pools(path, t->hp, &t->n_hp))) {
		if (from_env) {
			char why[400];
			snprintf(why, sizeof(why), "%s", kvt_numa_last_error());
			r = kvt__numa_err(r, "KVTIER_SYSFS_ROOT=%.200s: %s", t->root, why);
		}
		kvt_numa_topo_free(t);
		return r;
	}
	for (uint32_t i = 0; i < t->n_nodes; i++)
		if (t->nodes[i].mem_total > 0)
			with_mem++, mem_node = t->nodes[i].id;
	/* numa_node -1 means "no affinity reported".  With one memory node
	 * there is only one answer; with several, it stays unknown. */
	if (with_mem == 1)
		for (uint32_t i = 0; i < t->n_gpus; i++)
			if (t->gpus[i].node < 0)
				t->gpus[i].node = mem_node;
	*out = t;
	return 0;
}

const struct kvt_numa_node *kvt_numa_topo_node(const struct kvt_numa_topo *t, int id)
{
	for (uint32_t i = 0; t && i < t->n_nodes; i++)
		if (t->nodes[i].id == id)
			return &t->nodes[i];
	return NULL;
}

int kvt_numa_topo_cpu_node(const struct kvt_numa_topo *t, int cpu)
{
	for (uint32_t i = 0; t && cpu >= 0 && i < t->n_nodes; i++)
		if (kvt__cpulist_has(t->nodes[i].cpulist, cpu, NULL) == 1)
			return t->nodes[i].id;
	return -ENOENT;
}

/* Splits "[dddd:]bb:dd.f" into numbers so that spellings compare equal. */
static int pci_parse(const char *s, unsigned *dom, unsigned *bus, unsigned *dev,
		     unsigned *fn)
{
	char extra;

	if (sscanf(s, "%x:%x:%x.%x%c", dom, bus, dev, fn, &extra) == 4)
		return 0;
	*dom = 0;
	if (sscanf(s, "%x:%x.%x%c", bus, dev, fn, &extra) == 3)
		return 0;
	return -EINVAL;
}

int kvt_numa_topo_gpu_find(const struct kvt_numa_topo *t, const char *pci)
{
	unsigned d, b, v, f;

	if (!t || !pci || pci_parse(pci, &d, &b, &v, &f))
		return kvt__numa_err(-EINVAL, "'%s' is not a PCI address (dddd:bb:dd.f)",
				     pci ? pci : "(null)");
	for (uint32_t i = 0; i < t->n_gpus; i++) {
		unsigned d2, b2, v2, f2;

		if (pci_parse(t->gpus[i].pci, &d2, &b2, &v2, &f2) == 0 &&
		    d == d2 && b == b2 && v == v2 && f == f2)
			return (int)i;
	}
	return kvt__numa_err(-ENOENT, "no GPU at PCI address %s under %s", pci, t->root);
}

const struct kvt_numa_hp *kvt_numa_topo_hp(const struct kvt_numa_topo *t, int node,
					   uint64_t page_bytes)
{
	const struct kvt_numa_hp *hp;
	uint32_t n;

	if (!t)
		return NULL;
	if (node < 0) {
		hp = t->hp;
		n = t->n_hp;
	} else {
		const struct kvt_numa_node *nd = kvt_numa_topo_node(t, node);

		if (!nd)
			return NULL;
		hp = nd->hp;
		n = nd->n_hp;
	}
	for (uint32_t i = 0; i < n; i++)
		if (hp[i].page_bytes == page_bytes)
			return &hp[i];
	return NULL;
}
