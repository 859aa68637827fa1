/* core_segment: create/attach/detach/unlink, names, header validation field by field, identity checks. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "kvt_test.h"
#include "kvt_format.h"

static const char *NAME;

static int setup(void **st) { (void)st; NAME = kvt_test_name("seg"); return 0; }
static int teardown(void **st) { (void)st; kvt_seg_unlink(NAME, NULL); return 0; }

static void test_names(void **st)
{
	(void)st;
	const char *bad[] = { "", "a/b", "..", ".", "a b", "x\n", "/abs",
		"0123456789012345678901234567890123456789012345678901234567890123456789" };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		assert_int_equal(kvt_seg_name_valid(bad[i]), -EINVAL);
		assert_non_null(strstr(kvt_core_last_error(), "name"));
	}
	assert_int_equal(kvt_seg_name_valid("llama-3.1_8b.tp4"), 0);
	assert_int_equal(kvt_seg_name_valid(NULL), -EINVAL);
	/* a bad name never reaches the file system */
	struct kvt_geometry g = kvt_test_geo(1, 8);
	struct kvt_seg_create_opts c = { .size = sizeof(c), .name = "../etc", .geo = &g };
	kvt_seg *s = NULL;
	assert_int_equal(kvt_seg_create(&c, NULL, &s), -EINVAL);
	assert_null(s);
	assert_int_equal(kvt_seg_unlink("a/b", NULL), -EINVAL);
}

static void test_create_attach(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(4, 32);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *o = NULL;
	kvt_key fp1, fp2;

	assert_int_equal(kvt_seg_n_shards(s), 4);
	assert_int_equal(kvt_seg_shard_bytes(s), 256);
	assert_int_equal(kvt_geometry_shard_bytes(&g), 256);
	assert_int_not_equal(kvt_seg_entry(s), UINT32_MAX);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o), 0);
	assert_int_equal(kvt_seg_entry(o), UINT32_MAX);
	assert_int_equal(kvt_seg_geometry(o)->n_slots, 32);
	assert_int_equal(kvt_seg_geometry(o)->n_leases, 64);
	assert_int_equal(kvt_seg_geometry(o)->fill_timeout_ms, 5000); /* default */
	kvt_seg_fingerprint(s, &fp1);
	kvt_seg_fingerprint(o, &fp2);
	assert_memory_equal(&fp1, &fp2, sizeof(fp1));
	/* the arena: 2 MiB aligned per shard, sub-slots inside it */
	void *p; uint64_t len;
	assert_int_equal(kvt_seg_arena(s, 1, &p, &len), 0);
	assert_int_equal((uintptr_t)p % (2u << 20), 0);
	assert_ptr_equal(kvt_slot_shard_ptr(s, 0, 1), p);
	assert_ptr_equal((uint8_t *)kvt_slot_shard_ptr(s, 3, 1), (uint8_t *)p + 3 * 256);
	assert_null(kvt_slot_shard_ptr(s, 32, 0));
	assert_null(kvt_slot_shard_ptr(s, 0, 4));
	assert_int_equal(kvt_seg_arena(s, 4, &p, &len), -EINVAL);
	/* an observer cannot write or pin */
	struct kvt_wref w;
	kvt_key k = kvt_test_key(1);
	uint64_t lease;
	assert_int_equal(kvt_write_begin(o, &k, 0, 0, &w), -EPERM);
	assert_int_equal(kvt_seg_lookup(o, &k, 1, &lease), -EPERM);
	/* mode 0600 by default */
	char path[128];
	struct stat sb;
	snprintf(path, sizeof(path), "/dev/shm/kvtier.%s", NAME);
	assert_int_equal(stat(path, &sb), 0);
	assert_int_equal(sb.st_mode & 0777, 0600);
	assert_int_equal(sb.st_size % (2u << 20), 0);
	/* creating it again fails, and loses nothing */
	struct kvt_seg_create_opts c = { .size = sizeof(c), .name = NAME, .geo = &g };
	kvt_seg *s2 = NULL;
	assert_int_equal(kvt_seg_create(&c, NULL, &s2), -EEXIST);
	assert_int_equal(kvt_seg_detach(o), 0);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o), 0);
	kvt_seg_detach(o);
	kvt_seg_detach(s);
	assert_int_equal(kvt_seg_unlink(NAME, NULL), 0);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o), -ENOENT);
	assert_int_equal(kvt_seg_unlink(NAME, NULL), -ENOENT);
}

static void test_options(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 8);
	struct kvt_seg_create_opts c = { .size = sizeof(c), .name = NAME, .geo = &g,
		.flags = 0x100 };
	kvt_seg *s = NULL;

	assert_int_equal(kvt_seg_create(&c, NULL, &s), -EINVAL);
	assert_non_null(strstr(kvt_core_last_error(), "unknown flags"));
	c.flags = 0;
	c.size = 8;
	assert_int_equal(kvt_seg_create(&c, NULL, &s), -EINVAL);
	c.size = sizeof(c);
	c.reserved = 1;
	assert_int_equal(kvt_seg_create(&c, NULL, &s), -EINVAL);
	c.reserved = 0;
	g.world = 65;
	assert_int_equal(kvt_seg_create(&c, NULL, &s), -EINVAL);
	assert_non_null(strstr(kvt_core_last_error(), "world"));
	g.world = 1;
	g.groups[3].layers = 2;
	assert_int_equal(kvt_seg_create(&c, NULL, &s), -EINVAL);
	g.groups[3].layers = 0;
	g.n_slots = 0;
	assert_int_equal(kvt_seg_create(&c, NULL, &s), -EINVAL);
	assert_non_null(strstr(kvt_core_last_error(), "n_slots"));
	g.n_slots = 8;
	/* group access is opt-in */
	c.flags = KVT_SEG_F_GROUP | KVT_SEG_F_REPLACE;
	assert_int_equal(kvt_seg_create(&c, NULL, &s), 0);
	char path[128];
	struct stat sb;
	snprintf(path, sizeof(path), "/dev/shm/kvtier.%s", NAME);
	assert_int_equal(stat(path, &sb), 0);
	assert_int_equal(sb.st_mode & 0777, 0660);
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = NAME, .flags = 0x40 };
	kvt_seg *o = NULL;
	assert_int_equal(kvt_seg_attach(&a, &o), -EINVAL);
	a.flags = 0;
	a.role = 9;
	assert_int_equal(kvt_seg_attach(&a, &o), -EINVAL);
	kvt_seg_detach(s);
}

static void test_dir(void **st)
{
	(void)st;
	char dir[] = "/tmp/kvt-dir-XXXXXX", path[128];
	struct kvt_geometry g = kvt_test_geo(2, 8);
	struct kvt_seg_create_opts c = { .size = sizeof(c), .name = NAME, .dir = dir, .geo = &g };
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = NAME, .dir = dir,
		.role = KVT_ROLE_RANK, .rank = 1, .world = 2 };
	kvt_seg *s = NULL, *r = NULL;

	assert_non_null(mkdtemp(dir));
	assert_int_equal(kvt_seg_create(&c, NULL, &s), 0);
	snprintf(path, sizeof(path), "%s/kvtier.%s", dir, NAME);
	assert_int_equal(access(path, F_OK), 0);
	assert_int_equal(kvt_seg_attach(&a, &r), 0);
	assert_int_equal(kvt_test_save_all(r, 7, 0), 1);
	kvt_seg_detach(r);
	kvt_seg_detach(s);
	assert_int_equal(kvt_seg_unlink(NAME, dir), 0);
	assert_int_equal(rmdir(dir), 0);
}

struct field {
	const char *what;   /* expected in the message */
	size_t off, width;
	uint64_t value;     /* written (xor when xor != 0) */
	int xor;
};

#define F(name, member, w, v, x) { name, offsetof(struct kvt_hdr, member), w, v, x }
static const struct field fields[] = {
	F("magic", magic, 8, 0, 0),
	F("version", version, 4, KVT_LAYOUT_VERSION + 1, 0),
	F("made by an older kvtier", version, 4, KVT_LAYOUT_VERSION - 1, 0),
	F("seg_id", seg_id, 8, 0, 0),
	F("hdr_size", hdr_size, 4, 100, 0),
	F("total_size", total_size, 8, 1ULL << 21, 0),
	F("page_size", page_size, 8, 3000, 0),
	F("creator_uid", creator_uid, 4, 4242, 0),
	F("creator_pid", creator_pid, 4, 0, 0),
	F("creator_start", creator_start, 8, 0, 0),
	F("created_ns", created_ns, 8, 0, 0),
	F("policy", policy, 8, 2, 0),
	F("chunk_tokens", geo.chunk_tokens, 4, 0, 0),
	F("world", geo.world, 4, 65, 0),
	F("n_instances", geo.n_instances, 4, 0, 0),
	F("mode", geo.mode, 4, 7, 0),
	F("n_groups", geo.n_groups, 4, 9, 0),
	F("groups.layers", geo.groups[0].layers, 4, 0, 0),
	F("groups.bytes_per_token", geo.groups[0].bytes_per_token, 4, 0, 0),
	F("groups", geo.groups[5].layers, 4, 1, 0),
	F("n_slots", geo.n_slots, 4, 0, 0),
	F("n_leases", geo.n_leases, 4, 0, 0),
	F("lease_max_chunks", geo.lease_max_chunks, 4, 1u << 20, 0),
	F("fill_timeout_ms", geo.fill_timeout_ms, 4, 0, 0),
	F("fingerprint", geo.model_id.lo, 8, 1, 1),
	F("derived.shard_bytes", d.shard_bytes, 8, 1, 1),
	F("derived.slot_meta_bytes", d.slot_meta_bytes, 8, 64, 1),
	F("derived.lease_bytes", d.lease_bytes, 8, 8, 1),
	F("derived.shard_part", d.shard_part, 8, 1, 1),
	F("derived.n_shards", d.n_shards, 4, 1, 1),
	F("derived.n_entries", d.n_entries, 4, 1, 1),
	F("derived.n_buckets", d.n_buckets, 4, 1, 1),
	F("derived.counter_block", d.counter_block, 4, 64, 1),
	F("fingerprint", fingerprint.lo, 8, 1, 1),
	F("fingerprint", fingerprint.hi, 8, 1, 1),
	F("regions[ranks].off", regions[0].off, 8, 4096, 1),
	F("regions[counters].size", regions[1].size, 8, 8, 1),
	F("regions[leases].off", regions[2].off, 8, 4096, 1),
	F("regions[index].size", regions[3].size, 8, 64, 1),
	F("regions[slots].off", regions[4].off, 8, 4096, 1),
	F("regions[disk].off", regions[5].off, 8, 4096, 1),
	F("regions[arena].off", regions[6].off, 8, 1ULL << 40, 1),
	F("regions[arena].size", regions[6].size, 8, 1ULL << 40, 1),
	F("checksum", checksum, 8, 1, 1),
	F("n_slots", geo.n_slots, 4, 1u << 31, 0),
};

static void poke(uint8_t *p, size_t width, uint64_t v, int xor)
{
	if (width == 8) {
		uint64_t o; memcpy(&o, p, 8); o = xor ? o ^ v : v; memcpy(p, &o, 8);
	} else {
		uint32_t o; memcpy(&o, p, 4); o = xor ? o ^ (uint32_t)v : (uint32_t)v; memcpy(p, &o, 4);
	}
}

static void test_header_fields(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(4, 32);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *o = NULL;
	uint8_t *h = kvt_seg_base(s), saved[4096];

	memcpy(saved, h, sizeof(saved));
	for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
		const struct field *f = &fields[i];
		poke(h + f->off, f->width, f->value, f->xor);
		int r = kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o);
		if (r == 0 || !strstr(kvt_core_last_error(), f->what))
			fail_msg("corrupting %s: attach returned %d, message '%s'", f->what, r,
				 kvt_core_last_error());
		assert_true(r == -EPROTO || r == -EINVAL);
		memcpy(h, saved, sizeof(saved));
		/* restored: attaches again */
		assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o), 0);
		kvt_seg_detach(o);
	}
	kvt_seg_detach(s);
}

static void test_truncated_and_foreign(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(1, 8);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *o = NULL;
	char path[128];

	kvt_seg_detach(s);
	snprintf(path, sizeof(path), "/dev/shm/kvtier.%s", NAME);
	/* shorter than its header says */
	assert_int_equal(truncate(path, 1 << 20), 0);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o), -EPROTO);
	assert_non_null(strstr(kvt_core_last_error(), "total_size"));
	assert_int_equal(truncate(path, 100), 0);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o), -EPROTO);
	/* not a kvtier segment at all */
	s = kvt_test_create(NAME, &g, NULL);
	kvt_seg_detach(s);
	int fd = open(path, O_RDWR);
	assert_true(fd >= 0);
	assert_int_equal(pwrite(fd, "garbage!", 8, 0), 8);
	close(fd);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o), -EPROTO);
	assert_non_null(strstr(kvt_core_last_error(), "magic"));
	/* a symbolic link at the segment's path (to a real segment) and a
	 * FIFO: refused, never followed or opened for reading */
	{
		char link[160], lname[80];
		snprintf(lname, sizeof(lname), "%s-ln", NAME);
		snprintf(link, sizeof(link), "/dev/shm/kvtier.%s", lname);
		s = kvt_test_create(NAME, &g, NULL);
		kvt_seg_detach(s);
		unlink(link);
		assert_int_equal(symlink(path, link), 0);
		assert_int_equal(kvt_test_attach(lname, KVT_ROLE_OBSERVER, 0, 0, 0, &o), -ELOOP);
		unlink(link);
		assert_int_equal(mkfifo(link, 0600), 0);
		assert_int_equal(kvt_test_attach(lname, KVT_ROLE_OBSERVER, 0, 0, 0, &o), -EINVAL);
		assert_non_null(strstr(kvt_core_last_error(), "not a regular file"));
		unlink(link);
	}
	/* owned by another uid: refused unless asked; then the header's
	 * creator uid no longer matches the owner, which is named */
	s = kvt_test_create(NAME, &g, NULL);
	kvt_seg_detach(s);
	if (geteuid() == 0) {
		assert_int_equal(chown(path, 4242, 4242), 0);
		assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_OBSERVER, 0, 0, 0, &o), -EPERM);
		assert_non_null(strstr(kvt_core_last_error(), "uid"));
		struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = NAME,
			.flags = KVT_SEG_F_ANY_UID };
		assert_int_equal(kvt_seg_attach(&a, &o), -EPROTO);
		assert_non_null(strstr(kvt_core_last_error(), "creator_uid"));
	}
}

/* The model's description: kept in the header by its creator, named
 * beside this process's when the model ids differ, read bounded and
 * printable (a header byte rewritten outside printable ASCII shows as
 * '?', and the attach is not refused for it: the text is for messages). */
static void test_model_text(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 16), m;
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = NAME,
		.role = KVT_ROLE_SCHEDULER, .model = "name=llama;kv=fp8_e4m3;config=ab" };
	kvt_seg *s = kvt_test_create(NAME, &g, &a), *r = NULL;
	char buf[KVT_MODEL_TEXT_MAX], small[8];
	kvt_key fp;

	assert_string_equal(kvt_seg_model(s, buf, sizeof(buf)), "name=llama;kv=fp8_e4m3;config=ab");
	assert_string_equal(kvt_seg_model(s, small, sizeof(small)), "name=ll");
	m = g;
	m.model_id.hi ^= 1;
	kvt_geometry_fingerprint(&m, &fp);
	struct kvt_seg_attach_opts b = { .size = sizeof(b), .name = NAME,
		.role = KVT_ROLE_RANK, .rank = 0, .world = 2, .fingerprint = &fp, .geo = &m,
		.model = "name=llama;kv=fp8_e5m2;layout=LBHNC;config=ab" };
	/* each field that differs named, with both values */
	assert_int_equal(kvt_seg_attach(&b, &r), -ESTALE);
	assert_non_null(strstr(kvt_core_last_error(), "; model kv: the segment's 'fp8_e4m3', "
			       "this process's 'fp8_e5m2'; model layout: the segment's '(none)', "
			       "this process's 'LBHNC' ("));
	assert_null(strstr(kvt_core_last_error(), "model config"));
	assert_null(strstr(kvt_core_last_error(), "model name"));
	/* the same fields in another order: the two texts whole */
	b.model = "name=llama;config=ab;kv=fp8_e4m3";
	assert_int_equal(kvt_seg_attach(&b, &r), -ESTALE);
	assert_non_null(strstr(kvt_core_last_error(), "model: the segment's 'name=llama;"
			       "kv=fp8_e4m3;config=ab', this process's 'name=llama;config=ab;"
			       "kv=fp8_e4m3'"));
	b.model = "name=llama;kv=fp8_e5m2;layout=LBHNC;config=ab";
	((char *)kvt_seg_base(s))[400 + 5] = '\n';
	assert_string_equal(kvt_seg_model(s, buf, sizeof(buf)), "name=?lama;kv=fp8_e4m3;config=ab");
	kvt_seg_fingerprint(s, &fp);
	b.geo = NULL;
	assert_int_equal(kvt_seg_attach(&b, &r), 0);
	kvt_seg_detach(r);
	kvt_seg_detach(s);
}

static void test_identity(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(4, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r = NULL, *r2 = NULL;
	kvt_key fp, other = { 1, 2 };

	/* wrong world: loud and early */
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 1, &r), -EINVAL);
	assert_non_null(strstr(kvt_core_last_error(), "world=1"));
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 8, &r), -EINVAL);
	/* a rank must say its world */
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 0, 0, &r), -EINVAL);
	/* rank and instance out of range */
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 4, 4, &r), -EINVAL);
	assert_non_null(strstr(kvt_core_last_error(), "rank"));
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 1, 0, 4, &r), -EINVAL);
	assert_non_null(strstr(kvt_core_last_error(), "instance"));
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_SCHEDULER, 3, 0, 0, &r), -EINVAL);
	/* another model */
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = NAME,
		.role = KVT_ROLE_RANK, .rank = 0, .world = 4, .fingerprint = &other };
	assert_int_equal(kvt_seg_attach(&a, &r), -ESTALE);
	assert_non_null(strstr(kvt_core_last_error(), "fingerprint"));
	/* ...with the layout behind it: the message names what differs */
	{
		struct kvt_geometry m = g;

		m.chunk_tokens = g.chunk_tokens * 2;
		m.groups[0].bytes_per_token++;
		m.model_id.lo ^= 1;
		kvt_geometry_fingerprint(&m, &other);
		a.geo = &m;
		assert_int_equal(kvt_seg_attach(&a, &r), -ESTALE);
		assert_non_null(strstr(kvt_core_last_error(), "chunk_tokens: the segment's"));
		assert_non_null(strstr(kvt_core_last_error(), "group 0 bytes per token"));
		/* the segment's model was not given at its creation: "not
		 * recorded"; this process's named */
		assert_non_null(strstr(kvt_core_last_error(), "model: another model's (the "
				       "segment's description was not recorded"));
		assert_non_null(strstr(kvt_core_last_error(), "this process's '(not given)'"));
		assert_null(strstr(kvt_core_last_error(), "world:"));
		assert_null(strstr(kvt_core_last_error(), "layers:"));
		a.geo = NULL;
	}
	kvt_seg_fingerprint(s, &fp);
	a.fingerprint = &fp;
	assert_int_equal(kvt_seg_attach(&a, &r), 0);
	/* a second live attach of the same rank */
	assert_int_equal(kvt_seg_attach(&a, &r2), -EBUSY);
	assert_non_null(strstr(kvt_core_last_error(), "live process"));
	/* a different rank and the scheduler are fine; live ranks count
	 * rank entries only (what shares the node's CPUs for copies) */
	assert_int_equal(kvt_seg_live_ranks(s), 1);
	a.rank = 1;
	assert_int_equal(kvt_seg_attach(&a, &r2), 0);
	assert_int_equal(kvt_seg_live_ranks(s), 2);
	assert_int_equal(kvt_seg_live_ranks(r), 2);
	kvt_seg_detach(r2);
	assert_int_equal(kvt_seg_live_ranks(s), 1);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_SCHEDULER, 0, 0, 4, &r2), 0);
	assert_int_equal(kvt_seg_live_ranks(s), 1);
	assert_int_equal(kvt_seg_live_ranks(NULL), -EINVAL);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_SCHEDULER, 0, 0, 4, &s), -EBUSY);
	kvt_seg_detach(r2);
	/* after detach, the rank can attach again */
	kvt_seg_detach(r);
	a.rank = 0;
	assert_int_equal(kvt_seg_attach(&a, &r), 0);
	kvt_seg_detach(r);
	kvt_seg_detach(s);
}

static void test_dead_rank_reattach(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r = NULL;
	pid_t pid = fork();
	int status;

	if (pid == 0) {
		kvt_seg *c = NULL;
		struct kvt_wref w;
		kvt_key k = kvt_test_key(5);
		if (kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 1, 2, &c))
			_exit(1);
		/* dies holding a claim on shard 1 of key 5 */
		if (kvt_write_begin(c, &k, 0, 1, &w))
			_exit(2);
		_exit(0);
	}
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_int_equal(WEXITSTATUS(status), 0);
	/* the dead holder is reaped by the new attach */
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 1, 2, &r), 0);
	assert_int_equal(kvt_test_counter(s, KVT_C_REAPED_RANKS), 1);
	kvt_test_assert_check(s);
	/* and the chunk it left can be saved afresh */
	kvt_key k = kvt_test_key(5);
	struct kvt_wref w;
	assert_int_equal(kvt_write_begin(r, &k, 0, 1, &w), 0);
	assert_int_equal(kvt_write_end(r, &w, 1), 0);
	assert_int_equal(kvt_write_begin(s, &k, 0, 0, &w), 0);
	assert_int_equal(kvt_write_end(s, &w, 1), 1);
	kvt_test_assert_check(s);
	kvt_seg_detach(r);
	kvt_seg_detach(s);
}

/* A rank that fork()s an idle child and is killed: the child, which keeps
 * the inherited mapping, keeps none of its parent's liveness.  The dead
 * rank is reaped (its claim dropped), its rank attachable again, its
 * ownership takeable, all while the child lives.  Until the locks moved to
 * a descriptor that is never mapped, the child's mapping kept the locked
 * open file alive: reap found nobody dead, the attach got -EBUSY. */
static pid_t fork_pids[2]; /* killed by the teardown if an assertion failed */

static int teardown_fork(void **st)
{
	for (int i = 0; i < 2; i++)
		if (fork_pids[i] > 1) {
			kvt_kill_pid(fork_pids[i], SIGKILL);
			(void)waitpid(fork_pids[i], NULL, 0);
			fork_pids[i] = 0;
		}
	(void)prctl(PR_SET_CHILD_SUBREAPER, 0);
	return teardown(st);
}

static void test_fork_child_keeps_no_lock(void **st)
{
	(void)st;
	struct kvt_geometry g = kvt_test_geo(2, 16);
	kvt_seg *s = kvt_test_create(NAME, &g, NULL), *r = NULL;
	int pfd[2], status;
	pid_t grandchild = 0;

	/* the orphaned grandchild is reparented to us, so we can reap it */
	assert_int_equal(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
	assert_int_equal(pipe(pfd), 0);
	pid_t pid = fork();
	if (pid == 0) {
		kvt_seg *c = NULL;
		struct kvt_wref w;
		kvt_key k = kvt_test_key(5);
		close(pfd[0]);
		if (kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 1, 2, &c) || kvt_seg_own(c))
			_exit(1);
		if (kvt_write_begin(c, &k, 0, 1, &w))
			_exit(2);
		pid_t idle = fork();
		if (idle == 0) {
			/* says so itself: by now fork's child handler has
			 * closed its copy of the lock descriptor */
			pid_t me = getpid();
			if (write(pfd[1], &me, sizeof(me)) != sizeof(me))
				_exit(3);
			for (;;)
				pause();
		}
		if (idle < 0)
			_exit(3);
		for (;;)
			pause();
	}
	fork_pids[0] = pid;
	close(pfd[1]);
	assert_int_equal(read(pfd[0], &grandchild, sizeof(grandchild)), sizeof(grandchild));
	close(pfd[0]);
	assert_true(grandchild > 1);
	fork_pids[1] = grandchild;
	assert_int_equal(kvt_seg_owner(s), pid);
	assert_int_equal(kvt_seg_reap(s), 0); /* alive: nothing to reap */
	kvt_kill_pid(pid, SIGKILL);
	assert_int_equal(waitpid(pid, &status, 0), pid);
	fork_pids[0] = 0;
	assert_int_equal(kill(grandchild, 0), 0); /* the child lives on */
	assert_int_equal(kvt_seg_owner(s), 0);
	assert_int_equal(kvt_seg_reap(s), 1);
	assert_int_equal(kvt_test_attach(NAME, KVT_ROLE_RANK, 0, 1, 2, &r), 0);
	assert_int_equal(kvt_seg_own(s), 0);
	kvt_test_assert_check(s);
	kvt_kill_pid(grandchild, SIGKILL);
	assert_int_equal(waitpid(grandchild, &status, 0), grandchild);
	fork_pids[1] = 0;
	kvt_seg_detach(r);
	kvt_seg_detach(s);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_names, setup, teardown),
		cmocka_unit_test_setup_teardown(test_create_attach, setup, teardown),
		cmocka_unit_test_setup_teardown(test_options, setup, teardown),
		cmocka_unit_test_setup_teardown(test_dir, setup, teardown),
		cmocka_unit_test_setup_teardown(test_header_fields, setup, teardown),
		cmocka_unit_test_setup_teardown(test_model_text, setup, teardown),
		cmocka_unit_test_setup_teardown(test_truncated_and_foreign, setup, teardown),
		cmocka_unit_test_setup_teardown(test_identity, setup, teardown),
		cmocka_unit_test_setup_teardown(test_dead_rank_reattach, setup, teardown),
		cmocka_unit_test_setup_teardown(test_fork_child_keeps_no_lock, setup, teardown_fork),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
