/* numa_bind_2node.c - binding across two real NUMA nodes: a region bound to
 * the second node lands there, a sharded arena's parts land on their own
 * nodes, and a membind policy is followed.  Exits 77 on a machine with fewer
 * than two nodes with memory this process may use. */
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

#define LEN (16u << 20)

static int node_a = -1, node_b = -1;

static struct kvt_nodemask node(int n)
{
	struct kvt_nodemask m;

	kvt_nodemask_zero(&m);
	kvt_nodemask_set(&m, n);
	return m;
}

static void *map_shared(size_t len)
{
	int fd = memfd_create("kvt-bind2-test", MFD_CLOEXEC);
	void *p;

	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, (off_t)len), 0);
	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	assert_true(p != MAP_FAILED);
	return p;
}

static void t_bind_second_node(void **state)
{
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask nb = node(node_b);
	void *p = map_shared(LEN);

	(void)state;
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &nb, NULL, &rep), 0);
	assert_int_equal(rep.on_target, LEN / 4096);
	assert_int_equal(rep.misplaced, 0);
	munmap(p, LEN);
}

static void t_sharded_parts(void **state)
{
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask na = node(node_a), nb = node(node_b), both = na;
	char *p = map_shared(2 * LEN);

	(void)state;
	kvt_nodemask_set(&both, node_b);
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &na, NULL, &rep), 0);
	assert_int_equal(rep.on_target, LEN / 4096);
	assert_int_equal(kvt_numa_bind_region(p + LEN, LEN, KVT_NUMA_BIND, &nb, NULL, &rep), 0);
	assert_int_equal(rep.on_target, LEN / 4096);
	/* The second bind did not disturb the first part. */
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &na,
					      &(struct kvt_numa_bind_opts){
						.size = sizeof(struct kvt_numa_bind_opts),
						.flags = KVT_NUMA_BIND_F_NO_PREFAULT}, &rep), 0);
	assert_int_equal(rep.on_target, LEN / 4096);
	munmap(p, 2 * LEN);

	/* Interleaved over both: pages on both nodes, none elsewhere. */
	p = map_shared(LEN);
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_INTERLEAVE, &both, NULL, &rep), 0);
	assert_int_equal(rep.on_target, LEN / 4096);
	munmap(p, LEN);
}

static void t_fixed_then_rebind_moves(void **state)
{
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask na = node(node_a), nb = node(node_b);
	void *p = map_shared(LEN);

	(void)state;
	/* Touched on node a first; binding to b moves the pages (MPOL_MF_MOVE)
	 * or, failing that, reports them. */
	assert_int_equal(kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &na, NULL, &rep), 0);
	if (kvt_numa_bind_region(p, LEN, KVT_NUMA_BIND, &nb, NULL, &rep) == 0)
		assert_int_equal(rep.on_target, LEN / 4096);
	else
		assert_non_null(strstr(kvt_numa_last_error(), "node"));
	munmap(p, LEN);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(t_bind_second_node),
		cmocka_unit_test(t_sharded_parts),
		cmocka_unit_test(t_fixed_then_rebind_moves),
	};
	struct kvt_numa_topo *t = NULL;

#ifndef KVTIER_HAVE_NUMA
	fprintf(stderr, "SKIP: built without libnuma\n");
	return 77;
#endif
	if (kvt_numa_topo_read("/sys", &t) == 0) {
		for (uint32_t i = 0; i < t->n_nodes; i++) {
			/* Enough free memory for the test, on a node we may use:
			 * a test bind tells us. */
			struct kvt_nodemask m = node(t->nodes[i].id);
			void *p;

			if (t->nodes[i].mem_free < 4 * (uint64_t)LEN)
				continue;
			p = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
				 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			if (p != MAP_FAILED &&
			    kvt_numa_bind_region(p, 4096, KVT_NUMA_BIND, &m, NULL, NULL) == 0) {
				if (node_a < 0)
					node_a = t->nodes[i].id;
				else if (node_b < 0)
					node_b = t->nodes[i].id;
			}
			if (p != MAP_FAILED)
				munmap(p, 4096);
		}
		kvt_numa_topo_free(t);
	}
	if (node_b < 0) {
		fprintf(stderr, "SKIP: needs two NUMA nodes with memory (this machine has %s)\n",
			node_a < 0 ? "none usable" : "one");
		return 77;
	}
	return cmocka_run_group_tests(tests, NULL, NULL);
}
