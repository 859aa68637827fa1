/* numa_bind.c - binding real memory on this machine's node 0: bind before
 * first touch, prefault, verify with move_pages; a node that does not exist
 * is a clear error, or a warning with --numa-fallback. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvt_numa.h"
#ifdef KVTIER_NUMA_HAVE_SEG
#include "kvt_core.h"
#endif

#define LEN (8u << 20)

struct logcap {
	int warns;
	char last_warn[1024];
};

static void capture(void *arg, int level, const char *msg)
{
	struct logcap *c = arg;

	if (level == KVT_NUMA_LOG_WARN) {
		c->warns++;
		snprintf(c->last_warn, sizeof(c->last_warn), "%s", msg);
	}
}

static struct kvt_numa_bind_opts opts(uint32_t flags, struct logcap *cap)
{
	struct kvt_numa_bind_opts o;

	memset(&o, 0, sizeof(o));
	o.size = sizeof(o);
	o.flags = flags;
	o.log = capture;
	o.log_arg = cap;
	return o;
}

static void *map_anon(void)
{
	void *p = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	assert_true(p != MAP_FAILED);
	return p;
}

/* Shared memory like the segment's: a shmem object mapped MAP_SHARED. */
static void *map_shared(void)
{
	int fd = memfd_create("kvt-bind-test", MFD_CLOEXEC);
	void *p;

	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, LEN), 0);
	p = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	assert_true(p != MAP_FAILED);
	return p;
}

static struct kvt_nodemask node(int n)
{
	struct kvt_nodemask m;

	kvt_nodemask_zero(&m);
	kvt_nodemask_set(&m, n);
	return m;
}

/* Every page counted is on the target node.  A page may read as absent
 * (a busy machine's compaction is migrating it: move_pages' query sees a
 * migration entry), never as misplaced; a prefault that did not happen
 * would leave them all absent. */
static void assert_placed(const struct kvt_numa_bind_report *rep, uint64_t pages)
{
	assert_int_equal(rep->pages, pages);
	assert_int_equal(rep->misplaced, 0);
	assert_int_equal(rep->on_target + rep->absent, rep->pages);
	assert_true(rep->absent <= rep->pages / 16);
}

static void t_bind_node0(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_bind_opts o = opts(0, &cap);
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask n0 = node(0);
	void *maps[2] = {map_anon(), map_shared()};

	(void)state;
	for (int i = 0; i < 2; i++) {
		assert_int_equal(kvt_numa_bind_region(maps[i], LEN, KVT_NUMA_BIND, &n0, &o, &rep), 0);
		assert_int_equal(rep.bound, 1);
		assert_int_equal(rep.bytes, LEN);
		assert_int_equal(rep.page_bytes, 4096);
		assert_placed(&rep, LEN / 4096);
		assert_int_equal(rep.first_bad_node, -1);
		assert_int_equal(rep.prefault, 1);   /* MADV_POPULATE_WRITE */
		assert_int_equal(cap.warns, 0);
		/* The memory is usable and zero. */
		assert_int_equal(((volatile char *)maps[i])[LEN - 1], 0);
		munmap(maps[i], LEN);
	}
}

static void t_bind_modes(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_bind_opts o = opts(0, &cap);
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask n0 = node(0);
	const uint32_t modes[] = {KVT_NUMA_PREFERRED, KVT_NUMA_INTERLEAVE, KVT_NUMA_NONE};

	(void)state;
	for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
		void *p = map_shared();

		assert_int_equal(kvt_numa_bind_region(p, LEN, modes[i], &n0, &o, &rep), 0);
		assert_int_equal(rep.bound, modes[i] != KVT_NUMA_NONE);
		assert_placed(&rep, LEN / 4096);
		munmap(p, LEN);
	}
	/* NONE needs no node set. */
	{
		void *p = map_anon();

		assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_NONE, NULL, &o, &rep), 0);
		assert_int_equal(rep.pages, LEN / 4096);
		munmap(p, LEN);
	}
}

static void t_no_prefault(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_bind_opts o = opts(KVT_NUMA_BIND_F_NO_PREFAULT, &cap);
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask n0 = node(0);
	void *p = map_shared();

	(void)state;
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &n0, &o, &rep), 0);
	assert_int_equal(rep.prefault, 0);
	assert_int_equal(rep.absent, LEN / 4096);   /* nothing touched yet */
	/* Touch one page: it lands on node 0 under the policy. */
	((volatile char *)p)[0] = 1;
	o.flags = KVT_NUMA_BIND_F_NO_PREFAULT;
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &n0, &o, &rep), 0);
	assert_int_equal(rep.on_target, 1);
	assert_int_equal(rep.absent, LEN / 4096 - 1);
	munmap(p, LEN);
}

static void t_missing_node(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_bind_opts o = opts(0, &cap);
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask bad = node(KVT_NUMA_MAX_NODES - 1);
	void *p = map_shared();

	(void)state;
	/* No machine has node 1023 with memory in our CI. */
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &bad, &o, &rep), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "node 1023"));
	assert_non_null(strstr(kvt_numa_last_error(), "Mems_allowed_list"));
	assert_int_equal(cap.warns, 0);

	/* --numa-fallback: a warning, the region unbound but usable. */
	o.flags = KVT_NUMA_F_FALLBACK;
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &bad, &o, &rep), 0);
	assert_int_equal(cap.warns, 1);
	assert_non_null(strstr(cap.last_warn, "node 1023"));
	assert_non_null(strstr(cap.last_warn, "--numa-fallback"));
	assert_int_equal(rep.bound, 0);
	assert_int_equal(rep.prefault, 1);
	assert_int_equal(rep.absent, 0);
	assert_int_equal(rep.misplaced, 0);
	munmap(p, LEN);
}

static void t_bad_args(void **state)
{
	struct logcap cap = {0};
	struct kvt_numa_bind_opts o = opts(0, &cap);
	struct kvt_nodemask n0 = node(0), empty;
	char *p = map_anon();

	(void)state;
	kvt_nodemask_zero(&empty);
	assert_int_equal(kvt_numa_bind_region(p + 1, 4096, KVT_NUMA_BIND, &n0, &o, NULL), -EINVAL);
	assert_int_equal(kvt_numa_bind_region(p, 100, KVT_NUMA_BIND, &n0, &o, NULL), -EINVAL);
	assert_int_equal(kvt_numa_bind_region(p, 0, KVT_NUMA_BIND, &n0, &o, NULL), -EINVAL);
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &empty, &o, NULL), -EINVAL);
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_LOCAL, &n0, &o, NULL), -EINVAL);
	o.flags = 0x8000;
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &n0, &o, NULL), -EINVAL);
	o.flags = 0;
	o.size = 8;
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &n0, &o, NULL), -EINVAL);
	/* A 2 MiB page size the mapping does not have: misaligned. */
	o.size = sizeof(o);
	o.page_bytes = 2u << 20;
	assert_int_equal(kvt_numa_bind_region(p + 4096, 2u << 20, KVT_NUMA_BIND, &n0, &o, NULL),
			 -EINVAL);
	/* NULL options are defaults. */
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &n0, NULL, NULL), 0);
	munmap(p, LEN);
}

#ifdef KVTIER_NUMA_HAVE_SEG
static void t_bind_segment(void **state)
{
	struct kvt_geometry g;
	struct kvt_seg_create_opts c;
	struct kvt_numa_topo *t = NULL;
	struct kvt_numa_request r;
	struct kvt_numa_plan plan;
	struct kvt_numa_bind_report rep;
	struct logcap cap = {0};
	struct kvt_numa_bind_opts o = opts(0, &cap);
	char name[64];
	kvt_seg *seg = NULL;
	int local = 0;

	(void)state;
	memset(&g, 0, sizeof(g));
	g.chunk_tokens = 16;
	g.world = 2;
	g.n_instances = 1;
	g.mode = KVT_MODE_SHARDED;
	g.n_groups = 1;
	g.groups[0].layers = 4;
	g.groups[0].bytes_per_token = 256;   /* 16 KiB per shard of a chunk */
	g.n_slots = 200;
	snprintf(name, sizeof(name), "kvt-numa-bind-%d", (int)getpid());
	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.name = name;
	c.geo = &g;
	c.flags = KVT_SEG_F_REPLACE;
	assert_int_equal(kvt_seg_create(&c, NULL, &seg), 0);

	assert_int_equal(kvt_numa_topo_read("/sys", &t), 0);
	memset(&r, 0, sizeof(r));
	r.size = sizeof(r);
	r.flags = KVT_NUMA_F_NO_ENV | KVT_NUMA_F_NO_POLICY;
	r.n_shards = kvt_seg_n_shards(seg);
	r.local_node = &local;
	r.log = capture;
	r.log_arg = &cap;
	assert_int_equal(kvt_numa_choose(t, &r, &plan), 0);
	assert_int_equal(kvt_numa_bind_segment(seg, &plan, &o, &rep), 0);
	assert_int_equal(rep.bound, 2);
	assert_true(rep.pages > 0);
	assert_placed(&rep, rep.pages);
	/* Every shard part is 2 MiB aligned, as binding needs. */
	for (uint32_t s = 0; s < 2; s++) {
		void *ptr;
		uint64_t len;

		assert_int_equal(kvt_seg_arena(seg, s, &ptr, &len), 0);
		assert_int_equal((uintptr_t)ptr % (2u << 20), 0);
		assert_int_equal(len % (2u << 20), 0);
	}
	/* A plan for another shard count is refused. */
	plan.n_shards = 1;
	assert_int_equal(kvt_numa_bind_segment(seg, &plan, &o, &rep), -EINVAL);
	kvt_seg_detach(seg);
	kvt_seg_unlink(name, NULL);
	kvt_numa_topo_free(t);
}
#endif

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(t_bind_node0),
		cmocka_unit_test(t_bind_modes),
		cmocka_unit_test(t_no_prefault),
		cmocka_unit_test(t_missing_node),
		cmocka_unit_test(t_bad_args),
#ifdef KVTIER_NUMA_HAVE_SEG
		cmocka_unit_test(t_bind_segment),
#endif
	};

#ifndef KVTIER_HAVE_NUMA
	{
		struct kvt_nodemask n0;
		void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
			       -1, 0);

		kvt_nodemask_zero(&n0);
		kvt_nodemask_set(&n0, 0);
		if (kvt_numa_bind_region(p, 4096, KVT_NUMA_BIND, &n0, NULL, NULL) != -ENOTSUP ||
		    !strstr(kvt_numa_last_error(), "NUMA support not built"))
			return 1;
		fprintf(stderr, "SKIP: built without libnuma; binding reports "
			"'NUMA support not built' as it should\n");
		return 77;
	}
#endif
	return cmocka_run_group_tests(tests, NULL, NULL);
}
