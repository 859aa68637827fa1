/* numa_hugetlbfs.c - a real arena on 2 MiB huge pages: a hugetlbfs file
 * bound and verified, mapped by name from another process, a core segment
 * created there (sized in whole huge pages), and memfd_create(MFD_HUGETLB).
 * Exits 77 when no 2 MiB pages are reserved or no hugetlbfs is mounted
 * (numa/reserve-hugepages.sh sets both up where it may). */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvt_numa.h"
#ifdef KVTIER_NUMA_HAVE_SEG
#include "kvt_core.h"
#endif

#define HP (2ull << 20)

static struct kvt_hugetlbfs fs;
static uint64_t avail;        /* free - resv at start */
static int local_node;

static struct kvt_nodemask local_mask(void)
{
	struct kvt_nodemask m;

	kvt_nodemask_zero(&m);
	kvt_nodemask_set(&m, local_node);
	return m;
}

static int open_file(const char *tag, char *path, size_t len)
{
	int fd;

	snprintf(path, len, "%s/kvt-test-%s-%d", fs.dir, tag, (int)getpid());
	fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	assert_true(fd >= 0);
	return fd;
}

static void t_file_bind_verify(void **state)
{
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask m = local_mask();
	char path[512];
	int fd = open_file("bind", path, sizeof(path));
	void *p;

	(void)state;
	assert_int_equal(ftruncate(fd, 2 * HP), 0);
	p = mmap(NULL, 2 * HP, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	assert_true(p != MAP_FAILED);
	/* page_bytes 0: found from smaps, which says 2048 kB for this VMA. */
	assert_int_equal(kvt_numa_bind_region(p, 2 * HP, KVT_NUMA_BIND, &m, NULL, &rep), 0);
	assert_int_equal(rep.page_bytes, HP);
	assert_int_equal(rep.pages, 2);
	assert_int_equal(rep.on_target, 2);
	assert_int_equal(rep.misplaced, 0);
	assert_int_equal(rep.prefault, 1);
	munmap(p, 2 * HP);
	close(fd);
	unlink(path);
}

static void t_unaligned_size_refused(void **state)
{
	char path[512];
	int fd = open_file("align", path, sizeof(path));

	(void)state;
	/* hugetlbfs refuses a size that is not whole pages: why the segment
	 * size must be a multiple of 2 MiB. */
	assert_int_equal(ftruncate(fd, HP + 4096), -1);
	assert_int_equal(errno, EINVAL);
	assert_int_equal(ftruncate(fd, HP), 0);
	close(fd);
	unlink(path);
}

static void t_other_process_maps_by_name(void **state)
{
	struct kvt_nodemask m = local_mask();
	char path[512];
	int fd = open_file("share", path, sizeof(path)), st;
	volatile char *p;
	pid_t pid;

	(void)state;
	assert_int_equal(ftruncate(fd, HP), 0);
	p = mmap(NULL, HP, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	assert_true(p != MAP_FAILED);
	assert_int_equal(kvt_numa_bind_region((void *)p, HP, KVT_NUMA_BIND, &m, NULL, NULL), 0);
	memcpy((char *)p, "from the creator", 17);
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		/* Another rank: it knows only the name. */
		int cfd = open(path, O_RDWR | O_CLOEXEC);
		char *q = cfd < 0 ? MAP_FAILED :
			  mmap(NULL, HP, PROT_READ | PROT_WRITE, MAP_SHARED, cfd, 0);

		if (q == MAP_FAILED || strcmp(q, "from the creator"))
			_exit(1);
		memcpy(q + HP - 8, "reply", 6);
		_exit(0);
	}
	assert_int_equal(waitpid(pid, &st, 0), pid);
	assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	assert_string_equal((const char *)p + HP - 8, "reply");
	munmap((void *)p, HP);
	close(fd);
	unlink(path);
}

static void t_memfd_hugetlb(void **state)
{
	struct kvt_numa_bind_report rep;
	struct kvt_nodemask m = local_mask();
	int fd = memfd_create("kvt-hp", MFD_CLOEXEC | MFD_HUGETLB | (21 << 26) /* 2 MB */);
	void *p;

	(void)state;
	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, HP), 0);
	p = mmap(NULL, HP, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	assert_true(p != MAP_FAILED);
	assert_int_equal(kvt_numa_bind_region(p, HP, KVT_NUMA_BIND, &m, NULL, &rep), 0);
	assert_int_equal(rep.page_bytes, HP);
	assert_int_equal(rep.on_target, 1);
	munmap(p, HP);
	close(fd);
}

static void t_shm_open_cannot(void **state)
{
	char name[64];
	int fd;
	void *p;

	(void)state;
	/* The documented trap: a POSIX shm object cannot be mapped with
	 * MAP_HUGETLB. */
	snprintf(name, sizeof(name), "/kvt-test-hp-%d", (int)getpid());
	fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
	assert_true(fd >= 0);
	shm_unlink(name);
	assert_int_equal(ftruncate(fd, HP), 0);
	p = mmap(NULL, HP, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_HUGETLB, fd, 0);
	assert_true(p == MAP_FAILED);
	assert_int_equal(errno, EINVAL);
	close(fd);
}

static void t_choose_real(void **state)
{
	struct kvt_numa_topo *t = NULL;
	struct kvt_hp_request r;
	struct kvt_hp_choice c;

	(void)state;
	assert_int_equal(kvt_numa_topo_read("/sys", &t), 0);
	memset(&r, 0, sizeof(r));
	r.size = sizeof(r);
	r.seg_bytes = HP;
	assert_int_equal(kvt_hugepages_choose(t, NULL, &r, &c), 0);
	assert_int_equal(c.use, 1);
	assert_int_equal(c.page_bytes, HP);
	assert_string_equal(c.dir, fs.dir);
	kvt_numa_topo_free(t);
}

#ifdef KVTIER_NUMA_HAVE_SEG
static void t_core_segment(void **state)
{
	struct kvt_geometry g;
	struct kvt_seg_create_opts c;
	struct kvt_numa_topo *t = NULL;
	struct kvt_numa_request r;
	struct kvt_numa_plan plan;
	struct kvt_numa_bind_report rep;
	struct stat sb;
	char name[64], path[600];
	kvt_seg *seg = NULL;
	pid_t pid;
	int st;

	(void)state;
	memset(&g, 0, sizeof(g));
	g.chunk_tokens = 16;
	g.world = 2;
	g.n_instances = 1;
	g.mode = KVT_MODE_SHARDED;
	g.n_groups = 1;
	g.groups[0].layers = 2;
	g.groups[0].bytes_per_token = 128;
	g.n_slots = 64;           /* 4 KiB shards: 256 KiB per shard part */
	g.n_leases = 16;
	g.lease_max_chunks = 16;
	snprintf(name, sizeof(name), "kvt-numa-hp-%d", (int)getpid());
	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.name = name;
	c.dir = fs.dir;
	c.geo = &g;
	c.flags = KVT_SEG_F_REPLACE;
	st = kvt_seg_create(&c, NULL, &seg);
	if (st == -ENOMEM) {
		fprintf(stderr, "segment needs more huge pages than the %llu available\n",
			(unsigned long long)avail);
		skip();
	}
	assert_int_equal(st, 0);
	/* The core sizes a segment in whole 2 MiB pages (else ftruncate on
	 * hugetlbfs would have failed above). */
	assert_int_equal(kvt_seg_size(seg) % HP, 0);
	snprintf(path, sizeof(path), "%s/kvtier.%s", fs.dir, name);
	assert_int_equal(stat(path, &sb), 0);
	assert_int_equal((uint64_t)sb.st_size, kvt_seg_size(seg));

	assert_int_equal(kvt_numa_topo_read("/sys", &t), 0);
	memset(&r, 0, sizeof(r));
	r.size = sizeof(r);
	r.flags = KVT_NUMA_F_NO_ENV | KVT_NUMA_F_NO_POLICY;
	r.n_shards = kvt_seg_n_shards(seg);
	r.local_node = &local_node;
	assert_int_equal(kvt_numa_choose(t, &r, &plan), 0);
	assert_int_equal(kvt_numa_bind_segment(seg, &plan, NULL, &rep), 0);
	assert_int_equal(rep.page_bytes, HP);
	assert_int_equal(rep.on_target, rep.pages);
	assert_int_equal(rep.misplaced, 0);

	/* Another rank attaches by name from the same directory. */
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		struct kvt_seg_attach_opts a;
		kvt_seg *s2 = NULL;
		int ok;

		memset(&a, 0, sizeof(a));
		a.size = sizeof(a);
		a.name = name;
		a.dir = fs.dir;
		a.role = KVT_ROLE_OBSERVER;
		ok = kvt_seg_attach(&a, &s2) == 0 && kvt_seg_geometry(s2)->n_slots == 64;
		if (s2)
			kvt_seg_detach(s2);
		_exit(ok ? 0 : 1);
	}
	assert_int_equal(waitpid(pid, &st, 0), pid);
	assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	kvt_seg_detach(seg);
	assert_int_equal(kvt_seg_unlink(name, fs.dir), 0);
	kvt_numa_topo_free(t);
}
#endif

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(t_file_bind_verify),
		cmocka_unit_test(t_unaligned_size_refused),
		cmocka_unit_test(t_other_process_maps_by_name),
		cmocka_unit_test(t_memfd_hugetlb),
		cmocka_unit_test(t_shm_open_cannot),
		cmocka_unit_test(t_choose_real),
#ifdef KVTIER_NUMA_HAVE_SEG
		cmocka_unit_test(t_core_segment),
#endif
	};
	struct kvt_numa_topo *t = NULL;
	const struct kvt_numa_hp *hp;

#ifndef KVTIER_HAVE_NUMA
	fprintf(stderr, "SKIP: built without libnuma\n");
	return 77;
#endif
	if (kvt_numa_topo_read("/sys", &t)) {
		fprintf(stderr, "SKIP: cannot read /sys: %s\n", kvt_numa_last_error());
		return 77;
	}
	hp = kvt_numa_topo_hp(t, -1, HP);
	avail = hp && hp->free > hp->resv ? hp->free - hp->resv : 0;
	local_node = kvt_numa_topo_cpu_node(t, sched_getcpu());
	if (local_node < 0)
		local_node = t->nodes[0].id;
	/* Per node too: the local node must have some. */
	hp = kvt_numa_topo_hp(t, local_node, HP);
	if (hp && hp->free < avail)
		avail = hp->free;
	kvt_numa_topo_free(t);
	if (avail < 4) {
		fprintf(stderr, "SKIP: %llu free 2 MiB huge pages on node %d; needs 4 "
			"(numa/reserve-hugepages.sh, as root)\n", (unsigned long long)avail,
			local_node);
		return 77;
	}
	if (kvt_hugetlbfs_find(NULL, HP, 0, &fs)) {
		fprintf(stderr, "SKIP: %s (numa/reserve-hugepages.sh mounts one)\n",
			kvt_numa_last_error());
		return 77;
	}
	return cmocka_run_group_tests(tests, NULL, NULL);
}
