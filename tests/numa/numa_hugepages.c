/* numa_hugepages.c - the huge page decision on fake trees and mount tables:
 * hugetlbfs discovery, per-node pools, and the honest 4 KiB fallback. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fake_sysfs.h"
#include "kvt_numa.h"

#define MiB2 (2ull << 20)

static const char MOUNTS[] =
	"sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n"
	"tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n"
	"hugetlbfs /dev/hugepages1G hugetlbfs rw,relatime,pagesize=1024M 0 0\n"
	"none /mnt/huge\\040pages hugetlbfs rw,relatime,pagesize=2M 0 0\n";

struct logcap {
	int infos, warns;
	char last[1024];
};

static void capture(void *arg, int level, const char *msg)
{
	struct logcap *c = arg;

	if (level == KVT_NUMA_LOG_WARN)
		c->warns++;
	else
		c->infos++;
	snprintf(c->last, sizeof(c->last), "%s", msg);
}

static void t_find_mount(void **state)
{
	struct kvt_hugetlbfs fs;
	char *mounts = fake_file("mounts", MOUNTS);
	char *plain;

	(void)state;
	assert_int_equal(kvt_hugetlbfs_find(mounts, MiB2, MiB2, &fs), 0);
	assert_string_equal(fs.dir, "/mnt/huge pages");   /* \040 unescaped */
	assert_int_equal(fs.page_bytes, MiB2);
	assert_int_equal(kvt_hugetlbfs_find(mounts, 1ull << 30, MiB2, &fs), 0);
	assert_string_equal(fs.dir, "/dev/hugepages1G");
	assert_int_equal(kvt_hugetlbfs_find(mounts, 16ull << 30, MiB2, &fs), -ENOENT);
	assert_non_null(strstr(kvt_numa_last_error(), "no hugetlbfs mount"));
	fake_file_remove(mounts);

	/* A mount without pagesize= has the default huge page size. */
	plain = fake_file("mounts", "hugetlbfs /dev/hugepages hugetlbfs rw,relatime 0 0\n");
	assert_int_equal(kvt_hugetlbfs_find(plain, MiB2, MiB2, &fs), 0);
	assert_string_equal(fs.dir, "/dev/hugepages");
	assert_int_equal(kvt_hugetlbfs_find(plain, MiB2, 1ull << 30, &fs), -ENOENT);
	fake_file_remove(plain);

	assert_int_equal(kvt_hugetlbfs_find("/nonexistent/mounts", MiB2, MiB2, &fs), -ENOENT);
	assert_int_equal(kvt_hugetlbfs_find(NULL, 0, 0, &fs), -EINVAL);
}

static void t_want_parse(void **state)
{
	uint32_t w;

	(void)state;
	assert_int_equal(kvt_hp_want_parse("auto", "x", &w), 0);
	assert_int_equal(w, KVT_HP_AUTO);
	assert_int_equal(kvt_hp_want_parse("on", "x", &w), 0);
	assert_int_equal(w, KVT_HP_ON);
	assert_int_equal(kvt_hp_want_parse("off", "x", &w), 0);
	assert_int_equal(w, KVT_HP_OFF);
	/* only the documented words (0/1/yes/no were taken, undocumented) */
	for (const char *const *b = (const char *const[]){ "0", "1", "yes", "no", NULL }; *b; b++)
		assert_int_equal(kvt_hp_want_parse(*b, "KVTIER_HUGEPAGES", &w), -EINVAL);
	assert_int_equal(kvt_hp_want_parse("On", "KVTIER_HUGEPAGES", &w), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "KVTIER_HUGEPAGES='On'"));
	assert_int_equal(kvt_hp_want_parse("", "x", &w), -EINVAL);
}

struct fixture {
	char *root, *mounts;
	struct kvt_numa_topo *t;
};

/* Two nodes; pools as given; the mount table above. */
static void setup(struct fixture *f, uint64_t g_total, uint64_t g_free, uint64_t g_resv,
		  uint64_t n0_free, uint64_t n1_free)
{
	struct fake_machine m;

	fake_machine_sym(&m, 2, 0, 0, 0);
	m.hp2m_total = g_total;
	m.hp2m_free = g_free;
	m.hp2m_resv = g_resv;
	m.nodes[0].hp2m_total = n0_free;
	m.nodes[0].hp2m_free = n0_free;
	m.nodes[1].hp2m_total = n1_free;
	m.nodes[1].hp2m_free = n1_free;
	f->root = fake_sysfs_write(&m);
	f->mounts = fake_file("mounts", MOUNTS);
	f->t = NULL;
	assert_int_equal(kvt_numa_topo_read(f->root, &f->t), 0);
}

static void teardown(struct fixture *f)
{
	kvt_numa_topo_free(f->t);
	fake_sysfs_remove(f->root);
	fake_file_remove(f->mounts);
}

static struct kvt_hp_request hreq(uint32_t want, uint64_t seg, const char *mounts,
				  struct logcap *cap)
{
	struct kvt_hp_request r;

	memset(&r, 0, sizeof(r));
	r.size = sizeof(r);
	r.want = want;
	r.seg_bytes = seg;
	r.mounts = mounts;
	r.default_page_bytes = MiB2;
	r.log = capture;
	r.log_arg = cap;
	return r;
}

static struct kvt_numa_plan plan_on(const char *nodes, uint32_t shards)
{
	struct kvt_numa_plan p;

	memset(&p, 0, sizeof(p));
	p.n_shards = shards;
	for (uint32_t s = 0; s < shards; s++) {
		p.shard[s].mode = KVT_NUMA_BIND;
		assert_int_equal(kvt_nodemask_parse(nodes, "test", &p.shard[s].nodes), 0);
	}
	p.nodes = p.shard[0].nodes;
	return p;
}

static void t_none_reserved(void **state)
{
	struct fixture f;
	struct logcap cap = {0};
	struct kvt_hp_request r;
	struct kvt_hp_choice c;

	(void)state;
	setup(&f, 0, 0, 0, 0, 0);
	r = hreq(KVT_HP_AUTO, 64 * MiB2, f.mounts, &cap);
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), 0);
	assert_int_equal(c.use, 0);
	assert_int_equal(c.page_bytes, 4096);
	assert_int_equal(c.pages_needed, 64);
	assert_string_equal(c.dir, "");
	/* A warning that says what is missing and how to fix it. */
	assert_int_equal(cap.warns, 1);
	assert_non_null(strstr(cap.last, "4 KiB pages"));
	assert_non_null(strstr(cap.last, "no 2048 KiB huge pages are reserved"));
	assert_non_null(strstr(cap.last, "echo 64 > /sys/kernel/mm/hugepages/hugepages-2048kB"));
	/* hugepages=on: an error instead. */
	r.want = KVT_HP_ON;
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), -ENOMEM);
	assert_non_null(strstr(kvt_numa_last_error(), "huge pages required"));
	/* off: 4 KiB, no warning. */
	cap.warns = 0;
	r.want = KVT_HP_OFF;
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), 0);
	assert_int_equal(c.use, 0);
	assert_int_equal(cap.warns, 0);
	teardown(&f);
}

static void t_enough(void **state)
{
	struct fixture f;
	struct logcap cap = {0};
	struct kvt_hp_request r;
	struct kvt_hp_choice c;
	struct kvt_numa_plan p = plan_on("0", 1);

	(void)state;
	setup(&f, 128, 128, 0, 64, 64);
	r = hreq(KVT_HP_AUTO, 64 * MiB2, f.mounts, &cap);
	assert_int_equal(kvt_hugepages_choose(f.t, &p, &r, &c), 0);
	assert_int_equal(c.use, 1);
	assert_int_equal(c.page_bytes, MiB2);
	assert_int_equal(c.pages_needed, 64);
	assert_string_equal(c.dir, "/mnt/huge pages");
	assert_int_equal(cap.warns, 0);
	assert_int_equal(cap.infos, 1);
	assert_non_null(strstr(c.reason, "map it by name"));
	teardown(&f);
}

static void t_global_short(void **state)
{
	struct fixture f;
	struct logcap cap = {0};
	struct kvt_hp_request r;
	struct kvt_hp_choice c;

	(void)state;
	/* 100 free, but 50 promised to other mappings (resv): 50 available. */
	setup(&f, 100, 100, 50, 50, 50);
	r = hreq(KVT_HP_AUTO, 64 * MiB2, f.mounts, &cap);
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), 0);
	assert_int_equal(c.use, 0);
	assert_non_null(strstr(cap.last, "50 of the 2048 KiB huge pages are available"));
	teardown(&f);
}

static void t_node_short(void **state)
{
	struct fixture f;
	struct logcap cap = {0};
	struct kvt_hp_request r;
	struct kvt_hp_choice c;
	struct kvt_numa_plan on1 = plan_on("1", 1), split = plan_on("0", 2);

	(void)state;
	/* Enough in total, but all of it on node 0 and the arena bound to 1. */
	setup(&f, 128, 128, 0, 128, 0);
	r = hreq(KVT_HP_AUTO, 64 * MiB2, f.mounts, &cap);
	assert_int_equal(kvt_hugepages_choose(f.t, &on1, &r, &c), 0);
	assert_int_equal(c.use, 0);
	assert_non_null(strstr(cap.last, "node 1 has 0 free"));
	assert_non_null(strstr(cap.last, "/sys/devices/system/node/node1/hugepages"));
	/* Sharded over both nodes: node 1 still needs its half. */
	kvt_nodemask_zero(&split.shard[1].nodes);
	kvt_nodemask_set(&split.shard[1].nodes, 1);
	assert_int_equal(kvt_hugepages_choose(f.t, &split, &r, &c), 0);
	assert_int_equal(c.use, 0);
	teardown(&f);

	/* 32 + 32 on the two nodes holds a 64-page arena split over them. */
	setup(&f, 64, 64, 0, 32, 32);
	r.mounts = f.mounts;
	assert_int_equal(kvt_hugepages_choose(f.t, &split, &r, &c), 0);
	assert_int_equal(c.use, 1);
	teardown(&f);
}

static void t_no_mount(void **state)
{
	struct fixture f;
	struct logcap cap = {0};
	struct kvt_hp_request r;
	struct kvt_hp_choice c;
	char *nomount = fake_file("mounts", "tmpfs /dev/shm tmpfs rw 0 0\n");

	(void)state;
	setup(&f, 128, 128, 0, 64, 64);
	r = hreq(KVT_HP_AUTO, 64 * MiB2, nomount, &cap);
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), 0);
	assert_int_equal(c.use, 0);
	assert_non_null(strstr(cap.last, "mount -t hugetlbfs"));
	r.want = KVT_HP_ON;
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), -ENOENT);
	/* An explicit directory that is not hugetlbfs is refused. */
	r.want = KVT_HP_AUTO;
	r.dir = "/tmp";
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), 0);
	assert_int_equal(c.use, 0);
	assert_non_null(strstr(cap.last, "/tmp is not a hugetlbfs mount"));
	fake_file_remove(nomount);
	teardown(&f);
}

static void t_env_and_odd_sizes(void **state)
{
	struct fixture f;
	struct logcap cap = {0};
	struct kvt_hp_request r;
	struct kvt_hp_choice c;

	(void)state;
	setup(&f, 128, 128, 0, 64, 64);
	r = hreq(KVT_HP_ON, 64 * MiB2, f.mounts, &cap);
	r.flags = KVT_HP_F_ENV;
	setenv("KVTIER_HUGEPAGES", "off", 1);
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), 0);
	assert_int_equal(c.use, 0);
	setenv("KVTIER_HUGEPAGES", "sometimes", 1);
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "KVTIER_HUGEPAGES"));
	setenv("KVTIER_HUGEPAGES", "", 1);   /* set but empty: refused, not ignored */
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "set but empty"));
	unsetenv("KVTIER_HUGEPAGES");
	setenv("KVTIER_HUGETLBFS", "", 1);
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), -EINVAL);
	assert_non_null(strstr(kvt_numa_last_error(), "KVTIER_HUGETLBFS is set but empty"));
	setenv("KVTIER_HUGETLBFS", "/tmp", 1);
	r.want = KVT_HP_ON;
	assert_int_not_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), 0);
	assert_non_null(strstr(kvt_numa_last_error(), "KVTIER_HUGETLBFS=/tmp is not a hugetlbfs"));
	unsetenv("KVTIER_HUGETLBFS");
	r.want = KVT_HP_ON;
	unsetenv("KVTIER_HUGEPAGES");
	/* A size that is not a whole number of huge pages cannot be mapped. */
	r.flags = 0;
	r.want = KVT_HP_AUTO;
	r.seg_bytes = 64 * MiB2 + 4096;
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), 0);
	assert_int_equal(c.use, 0);
	assert_non_null(strstr(cap.last, "not a multiple"));
	/* Bad requests. */
	r.size = 0;
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), -EINVAL);
	r.size = sizeof(r);
	r.want = 7;
	assert_int_equal(kvt_hugepages_choose(f.t, NULL, &r, &c), -EINVAL);
	teardown(&f);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(t_find_mount),
		cmocka_unit_test(t_want_parse),
		cmocka_unit_test(t_none_reserved),
		cmocka_unit_test(t_enough),
		cmocka_unit_test(t_global_short),
		cmocka_unit_test(t_node_short),
		cmocka_unit_test(t_no_mount),
		cmocka_unit_test(t_env_and_odd_sizes),
	};

	unsetenv("KVTIER_HUGEPAGES");
	unsetenv("KVTIER_HUGETLBFS");
	return cmocka_run_group_tests(tests, NULL, NULL);
}
