/* hugepages.c - should the segment live on huge pages, and where.
 *
 * GPU registration of host memory (cuMemHostRegister, hsa lock) is about
 * 2.5x faster on huge pages, and a TLB miss per 4 KiB matters when the copy
 * engines stream hundreds of GB.  But huge pages exist only where an
 * operator reserved them, per node, and only two kinds of object share them
 * between processes: a file on a hugetlbfs mount (opened by path, which is
 * what kvt_seg_create(.dir) does) and memfd_create(MFD_HUGETLB) (its fd must
 * be passed to every rank).  shm_open + MAP_HUGETLB fails with EINVAL.
 * With no pages reserved, mmap of a hugetlbfs file fails with ENOMEM after
 * ftruncate succeeded, so we check the pools first and say what is missing.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/magic.h>
#include <sys/statfs.h>

#include "numa_internal.h"

int kvt_hp_want_parse(const char *s, const char *what, uint32_t *out)
{
	if (!what)
		what = "hugepages";
	if (!s || !out)
		return kvt__numa_err(-EINVAL, "%s: no value", what);
	if (!strcmp(s, "auto"))
		*out = KVT_HP_AUTO;
	else if (!strcmp(s, "on"))
		*out = KVT_HP_ON;
	else if (!strcmp(s, "off"))
		*out = KVT_HP_OFF;
	else  /* exactly the documented words: no 0/1/yes/no, no empty */
		return kvt__numa_err(-EINVAL, "%s='%.40s': expected auto, on or off%s", what, s,
				     *s ? "" : " (set but empty: unset it for auto)");
	return 0;
}

/* "2M", "1G", "2048k" or a byte count, as hugetlbfs prints pagesize=. */
static int parse_size(const char *s, uint64_t *out)
{
	char *end;
	unsigned long long v = strtoull(s, &end, 10);

	if (end == s)
		return -EINVAL;
	switch (*end) {
	case 'k': case 'K': v <<= 10; end++; break;
	case 'm': case 'M': v <<= 20; end++; break;
	case 'g': case 'G': v <<= 30; end++; break;
	}
	if (*end && *end != ',')
		return -EINVAL;
	*out = v;
	return 0;
}

/* Undoes the octal escapes of /proc/mounts ("\040" for a space). */
static void unescape(char *s)
{
	char *w = s;

	for (char *r = s; *r; r++) {
		if (r[0] == '\\' && r[1] >= '0' && r[1] <= '3' && r[2] >= '0' && r[2] <= '7' &&
		    r[3] >= '0' && r[3] <= '7') {
			*w++ = (char)((r[1] - '0') * 64 + (r[2] - '0') * 8 + (r[3] - '0'));
			r += 3;
		} else {
			*w++ = *r;
		}
	}
	*w = '\0';
}

static uint64_t default_hp_bytes(void)
{
	char text[8192];
	const char *p;
	unsigned long long kb;

	if (kvt__read_text("/proc/meminfo", text, sizeof(text)) > 0 &&
	    (p = strstr(text, "Hugepagesize:")) && sscanf(p, "Hugepagesize: %llu kB", &kb) == 1)
		return (uint64_t)kb * 1024;
	return 2u << 20;
}

int kvt_hugetlbfs_find(const char *mounts, uint64_t page_bytes,
		       uint64_t default_page_bytes, struct kvt_hugetlbfs *out)
{
	const char *path = mounts ? mounts : "/proc/mounts";
	FILE *f;
	char *line = NULL;
	size_t cap = 0;
	int r = -ENOENT;

	if (!out || !page_bytes)
		return kvt__numa_err(-EINVAL, "kvt_hugetlbfs_find: bad arguments");
	f = fopen(path, "re");
	if (!f) {
		r = -errno;
		return kvt__numa_err(r, "cannot read %s: %s", path, strerror(-r));
	}
	if (!default_page_bytes)
		default_page_bytes = default_hp_bytes();
	while (getline(&line, &cap, f) > 0) {
		char dev[256], dir[1024], type[64], opts[1024];
		uint64_t ps = default_page_bytes;
		const char *o;

		if (sscanf(line, "%255s %1023s %63s %1023s", dev, dir, type, opts) != 4 ||
		    strcmp(type, "hugetlbfs"))
			continue;
		/* pagesize= is the option; "page_size" is not a thing. */
		for (o = opts; o; o = strchr(o, ',') ? strchr(o, ',') + 1 : NULL)
			if (!strncmp(o, "pagesize=", 9) && parse_size(o + 9, &ps))
				ps = 0;
		if (ps != page_bytes)
			continue;
		unescape(dir);
		if (strlen(dir) >= sizeof(out->dir))
			continue;
		memcpy(out->dir, dir, strlen(dir) + 1);  /* length checked above */
		out->page_bytes = ps;
		r = 0;
		break;
	}
	free(line);
	fclose(f);
	if (r)
		return kvt__numa_err(r, "no hugetlbfs mount with %" PRIu64 " KiB pages in %s",
				     page_bytes >> 10, path);
	return 0;
}

/* Bytes of the arena each node must hold under the plan: a shard bound to
 * several nodes is split evenly.  Metadata (a few MiB) goes with shard 0. */
static void node_shares(const struct kvt_numa_plan *p, uint64_t seg_bytes,
			int *ids, uint64_t *bytes, uint32_t *n)
{
	uint64_t per_shard = seg_bytes / p->n_shards;

	*n = 0;
	for (uint32_t s = 0; s < p->n_shards; s++) {
		const struct kvt_nodemask *m = &p->shard[s].nodes;
		int cnt = kvt_nodemask_count(m);

		for (int nd = kvt_nodemask_first(m); nd >= 0; nd = kvt_nodemask_next(m, nd)) {
			uint32_t i;

			for (i = 0; i < *n && ids[i] != nd; i++)
				;
			if (i == *n) {
				if (*n == KVT_NUMA_MAX_SHARDS)
					return;
				ids[i] = nd;
				bytes[i] = 0;
				(*n)++;
			}
			bytes[i] += (per_shard + (uint64_t)cnt - 1) / (uint64_t)cnt;
		}
	}
}

int kvt_hugepages_choose(const struct kvt_numa_topo *t, const struct kvt_numa_plan *plan,
			 const struct kvt_hp_request *r, struct kvt_hp_choice *out)
{
	struct kvt_hp_choice c;
	struct kvt_hugetlbfs fs;
	const struct kvt_numa_hp *g;
	uint64_t page, avail;
	uint32_t want;
	const char *dir, *env;
	char msg[400] = "";
	int rc;

	if (!t || !r || !out)
		return kvt__numa_err(-EINVAL, "kvt_hugepages_choose: NULL argument");
	if (r->size < sizeof(*r) || (r->flags & ~KVT_HP_F_MASK) || r->want > KVT_HP_OFF)
		return kvt__numa_err(-EINVAL, "kvt_hugepages_choose: bad request");
	want = r->want;
	if ((r->flags & KVT_HP_F_ENV) && (env = getenv("KVTIER_HUGEPAGES"))) {
		rc = kvt_hp_want_parse(env, "KVTIER_HUGEPAGES", &want);
		if (rc)
			return rc;
	}
	page = r->page_bytes ? r->page_bytes : (2u << 20);
	memset(&c, 0, sizeof(c));
	c.page_bytes = 4096;
	c.pages_needed = (r->seg_bytes + page - 1) / page;

	if (want == KVT_HP_OFF) {
		snprintf(c.reason, sizeof(c.reason), "huge pages off: segment on 4 KiB pages");
		goto decided;
	}
	if (r->seg_bytes % page) {
		snprintf(msg, sizeof(msg), "the segment size %" PRIu64 " is not a multiple of "
			 "the %" PRIu64 " KiB huge page", r->seg_bytes, page >> 10);
		rc = -EINVAL;
		goto unavailable;
	}

	/* The pool: globally, pages not yet promised to a mapping. */
	g = kvt_numa_topo_hp(t, -1, page);
	avail = g ? (g->free > g->resv ? g->free - g->resv : 0) : 0;
	if (!g || g->total == 0) {
		snprintf(msg, sizeof(msg), "no %" PRIu64 " KiB huge pages are reserved "
			 "(need %" PRIu64 "; reserve with: echo %" PRIu64 " > "
			 "/sys/kernel/mm/hugepages/hugepages-%" PRIu64 "kB/nr_hugepages)",
			 page >> 10, c.pages_needed, c.pages_needed, page >> 10);
		rc = -ENOMEM;
		goto unavailable;
	}
	if (avail < c.pages_needed) {
		snprintf(msg, sizeof(msg), "%" PRIu64 " of the %" PRIu64 " KiB huge pages are "
			 "available, the segment needs %" PRIu64, avail, page >> 10,
			 c.pages_needed);
		rc = -ENOMEM;
		goto unavailable;
	}
	/* Per node: a bound shard can only take its node's pages. */
	if (plan && plan->n_shards >= 1 && plan->n_shards <= KVT_NUMA_MAX_SHARDS) {
		int ids[KVT_NUMA_MAX_SHARDS];
		uint64_t bytes[KVT_NUMA_MAX_SHARDS];
		uint32_t n;

		node_shares(plan, r->seg_bytes, ids, bytes, &n);
		for (uint32_t i = 0; i < n; i++) {
			const struct kvt_numa_hp *h = kvt_numa_topo_hp(t, ids[i], page);
			uint64_t need = (bytes[i] + page - 1) / page;
			uint64_t have = h ? h->free : 0;

			if (have >= need || plan->shard[0].mode == KVT_NUMA_PREFERRED)
				continue;
			snprintf(msg, sizeof(msg), "node %d has %" PRIu64 " free %" PRIu64 " KiB "
				 "huge pages, its part of the segment needs %" PRIu64 " (reserve "
				 "with: echo %" PRIu64 " > /sys/devices/system/node/node%d/"
				 "hugepages/hugepages-%" PRIu64 "kB/nr_hugepages)", ids[i], have,
				 page >> 10, need, need + (h ? h->total - have : 0), ids[i],
				 page >> 10);
			rc = -ENOMEM;
			goto unavailable;
		}
	}

	/* Where: an explicit directory must really be hugetlbfs. */
	dir = r->dir;
	env = NULL;
	if (!dir && (env = getenv("KVTIER_HUGETLBFS"))) {
		if (!*env)
			return kvt__numa_err(-EINVAL, "KVTIER_HUGETLBFS is set but empty: unset "
					     "it, or name a hugetlbfs mount");
		dir = env;
	}
	if (dir) {
		struct statfs sf;

		if (statfs(dir, &sf) || (unsigned long)sf.f_type != HUGETLBFS_MAGIC ||
		    (uint64_t)sf.f_bsize != page) {
			snprintf(msg, sizeof(msg), "%s%s%s is not a hugetlbfs mount with %" PRIu64
				 " KiB pages", env ? "KVTIER_HUGETLBFS" : "",
				 env ? "=" : "", dir, page >> 10);
			rc = -ENOENT;
			goto unavailable;
		}
		snprintf(fs.dir, sizeof(fs.dir), "%s", dir);
	} else if (kvt_hugetlbfs_find(r->mounts, page, r->default_page_bytes, &fs)) {
		snprintf(msg, sizeof(msg), "%s (mount one: mount -t hugetlbfs -o pagesize=%s "
			 "none /dev/hugepages)", kvt_numa_last_error(),
			 page == (1u << 30) ? "1G" : "2M");
		rc = -ENOENT;
		goto unavailable;
	}
	c.use = 1;
	c.page_bytes = page;
	snprintf(c.dir, sizeof(c.dir), "%s", fs.dir);
	snprintf(c.reason, sizeof(c.reason), "segment on %" PRIu64 " KiB huge pages in %s "
		 "(%" PRIu64 " pages of %" PRIu64 " available); ranks map it by name there",
		 page >> 10, c.dir, c.pages_needed, avail);
	goto decided;

unavailable:
	if (want == KVT_HP_ON)
		return kvt__numa_err(rc, "huge pages required (hugepages=on) but %s", msg);
	c.use = 0;
	c.page_bytes = 4096;
	snprintf(c.reason, sizeof(c.reason), "segment on 4 KiB pages: %s; GPU registration "
		 "of the arena will be slower", msg);
	kvt__numa_log(r->log, r->log_arg, KVT_NUMA_LOG_WARN, "%s", c.reason);
	*out = c;
	return 0;
decided:
	kvt__numa_log(r->log, r->log_arg, KVT_NUMA_LOG_INFO, "%s", c.reason);
	*out = c;
	return 0;
}
