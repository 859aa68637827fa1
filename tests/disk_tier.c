/* disk_tier.c - the disk tier: demotion, eviction, promotion byte for
 * byte, restart, checksums, a full disk, the buffered fallback, bad
 * configurations, admission policies, a kill -9 of the engine during its
 * writes, and kvt_lookup_ex's "ask again".
 *
 * Files go in the working directory (CTest runs in the build tree: a real
 * file system) and, for the buffered fallback, in /dev/shm.  A test that
 * needs O_DIRECT where the working directory has none, or io_uring where
 * the kernel refuses it, exits 77.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <time.h>
#include <xxhash.h>

#include "kvt_test.h"
#include "kvt_disk.h"
#include "kvtier.h"
#include "kvt_tier_int.h"

static char seg_name[64], file_path[256], shm_path[256], key_path[256];

/* 16 tokens x 256 B x 1 layer = 4 KiB shards (O_DIRECT-sized), world 2. */
static struct kvt_geometry geo(uint32_t slots, uint32_t disk, uint32_t bpt)
{
	struct kvt_geometry g = kvt_test_geo(2, slots);

	g.groups[0].bytes_per_token = bpt;
	g.disk_chunks = disk;
	return g;
}

static kvt_seg *make_seg(uint32_t slots, uint32_t disk, uint32_t bpt, int own)
{
	struct kvt_geometry g = geo(slots, disk, bpt);
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = seg_name,
					 .role = KVT_ROLE_CLIENT };
	kvt_seg *s = kvt_test_create(seg_name, &g, &a);

	if (own)
		assert_int_equal(kvt_seg_own(s), 0);
	return s;
}

static int engine(kvt_seg *s, const char *path, uint64_t bytes, uint32_t direct,
		  uint32_t admit, kvt_disk **d, char *err, size_t len)
{
	struct kvt_disk_opts o = { .size = sizeof(o), .path = path, .bytes = bytes,
				   .direct = direct, .admit = admit, .depth = 32 };
	return kvt_disk_open(s, &o, d, err, len);
}

static int uring_refused(int r, const char *err)
{
	return (r == -ENOSYS || r == -EPERM) && strstr(err, "io_uring");
}

/* Opens an engine or skips the test when the host lacks io_uring. */
static kvt_disk *engine_or_skip(kvt_seg *s, const char *path, uint64_t bytes,
				uint32_t direct, uint32_t admit)
{
	char err[512];
	kvt_disk *d = NULL;
	int r = engine(s, path, bytes, direct, admit, &d, err, sizeof(err));

	if (uring_refused(r, err)) {
		fprintf(stderr, "skip: %s\n", err);
		return NULL;
	}
	if (r)
		fprintf(stderr, "kvt_disk_open: %d %s\n", r, err);
	assert_int_equal(r, 0);
	return d;
}

/* Saves keys [from, to) stamped on every shard. */
static void save_range(kvt_seg *s, uint64_t from, uint64_t to)
{
	for (uint64_t i = from; i < to; i++) {
		kvt_key k = kvt_test_key(i);
		for (uint32_t sh = 0; sh < kvt_seg_n_shards(s); sh++) {
			struct kvt_wref w;
			int r = kvt_write_begin(s, &k, (uint32_t)(i % 7), sh, &w);
			if (r == KVT_SKIP)
				continue;
			assert_int_equal(r, 0);
			kvt_test_stamp(s, w.slot, sh, &k);
			assert_true(kvt_write_end(s, &w, 1) >= 0);
		}
	}
}

static int in_dram(kvt_seg *s, uint64_t i)
{
	kvt_key k = kvt_test_key(i);

	return kvt_seg_peek(s, &k, 1) == 1;
}

/* Pins key i and checks every shard byte for byte: 1 exact, 0 absent. */
static int dram_exact(kvt_seg *s, uint64_t i)
{
	kvt_key k = kvt_test_key(i);
	uint64_t lease;
	uint32_t slot;
	uint64_t gen;
	int r = kvt_seg_lookup(s, &k, 1, &lease);

	assert_true(r >= 0);
	if (r == 0)
		return 0;
	assert_int_equal(kvt_lease_slots(s, lease, &slot, &gen, 1), 1);
	for (uint32_t sh = 0; sh < kvt_seg_n_shards(s); sh++)
		assert_true(kvt_test_stamped(s, slot, sh, &k));
	assert_int_equal(kvt_lease_release(s, lease), 0);
	return 1;
}

static void request(kvt_seg *s, uint64_t i)
{
	kvt_key k = kvt_test_key(i);
	struct kvt_disk_ref ref;

	assert_int_equal(kvt_disk_find(s, &k, &ref), 1);
	assert_int_equal(kvt_disk_request(s, &ref), 0);
}

static int on_disk(kvt_seg *s, uint64_t i)
{
	kvt_key k = kvt_test_key(i);

	return kvt_disk_find(s, &k, NULL);
}

static void drain(kvt_disk *d, int all)
{
	assert_int_equal(kvt_disk_drain(d, all, 30LL * 1000000000LL), 0);
}

/* Asks keys [from, to) back (each on disk, none in DRAM), lets the engine
 * read them, and checks every one byte for byte. */
static void promote_check(kvt_seg *s, kvt_disk *d, uint64_t from, uint64_t to)
{
	for (uint64_t i = from; i < to; i++) {
		assert_false(in_dram(s, i));
		assert_true(on_disk(s, i));
		request(s, i);
	}
	drain(d, 0);
	for (uint64_t i = from; i < to; i++)
		assert_int_equal(dram_exact(s, i), 1);
}

static int setup(void **state)
{
	(void)state;
	snprintf(seg_name, sizeof(seg_name), "%s", kvt_test_name("disk"));
	snprintf(file_path, sizeof(file_path), "kvtier-disk-test-%d.img", (int)getpid());
	snprintf(shm_path, sizeof(shm_path), "/dev/shm/kvtier-disk-test-%d.img", (int)getpid());
	snprintf(key_path, sizeof(key_path), "kvtier-disk-test-%d.blk.key", (int)getpid());
	unlink(file_path);
	unlink(shm_path);
	return 0;
}

static int teardown(void **state)
{
	(void)state;
	kvt_seg_unlink(seg_name, NULL);
	kvt_unlink(seg_name, NULL); /* kvt_open's: it may be on a hugetlbfs mount */
	unlink(file_path);
	unlink(shm_path);
	unlink(key_path);
	for (int i = 0; i < 2; i++) {
		char k[300];
		snprintf(k, sizeof(k), "%s.key", i ? shm_path : file_path);
		unlink(k);
	}
	return 0;
}

/* Demote 32 chunks, evict them from DRAM, promote them back: the bytes
 * are the bytes saved; then a restart (a new segment, the same file)
 * replays the records and serves them again. */
static void test_round_trip_and_restart(void **state)
{
	(void)state;
	kvt_seg *s = make_seg(48, 1024, 256, 1);
	kvt_disk *d = engine_or_skip(s, file_path, 8u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL);
	struct kvt_disk_info info;

	if (!d) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	kvt_disk_info(d, &info);
	if (!info.direct) {
		fprintf(stderr, "skip: no O_DIRECT in the working directory\n");
		kvt_disk_close(d);
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	assert_true(kvt_disk_online(s));
	save_range(s, 0, 32);
	drain(d, 1);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_WRITES), 32);
	for (uint64_t i = 0; i < 32; i++)
		assert_true(on_disk(s, i));
	/* Fillers push every demoted chunk out of the 48 slots. */
	save_range(s, 1000, 1048);
	promote_check(s, d, 0, 32);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_READS), 32);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_CSUM_ERRORS), 0);
	uint64_t bytes = 32ULL * 2 * kvt_seg_chunk_bytes(s);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_BYTES_READ), bytes);
	struct kvt_hist_snap h;
	assert_int_equal(kvt_hist_read(s, UINT32_MAX, KVT_H_DISK_READ, &h), 0);
	assert_int_equal(h.count, 32);
	kvt_test_assert_check(s);
	drain(d, 1);
	kvt_disk_info(d, &info);
	uint64_t used = info.used;
	assert_true(used >= 32);
	kvt_disk_close(d);
	assert_false(kvt_disk_online(s));
	assert_false(on_disk(s, 0)); /* offline: the index is emptied */
	kvt_seg_detach(s);

	/* Restart: a new segment, the same file. */
	s = make_seg(48, 1024, 256, 1);
	d = engine_or_skip(s, file_path, 8u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL);
	kvt_disk_info(d, &info);
	assert_int_equal(info.replayed, used);
	promote_check(s, d, 0, 32);
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

/* A corrupted extent is counted, dropped, and never served. */
static void test_checksum_mismatch(void **state)
{
	(void)state;
	kvt_seg *s = make_seg(16, 1024, 256, 1);
	kvt_disk *d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_OFF, KVT_ADMIT_ALL);
	struct kvt_disk_info info;
	struct kvt_disk_ref ref;

	if (!d) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	save_range(s, 0, 4);
	drain(d, 1);
	save_range(s, 100, 116); /* evict them */
	kvt_key k = kvt_test_key(2);
	assert_int_equal(kvt_disk_find(s, &k, &ref), 1);
	kvt_disk_info(d, &info);
	int fd = open(file_path, O_RDWR);
	assert_true(fd >= 0);
	uint64_t garbage = 0xbadbadbadULL;
	/* one word in the second shard of the extent */
	assert_int_equal(pwrite(fd, &garbage, 8, (off_t)(info.data_off +
		ref.extent * info.extent_bytes + info.shard_bytes + 24)), 8);
	fsync(fd);
	close(fd);
	for (uint64_t i = 0; i < 4; i++)
		request(s, i);
	drain(d, 0);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_CSUM_ERRORS), 1);
	assert_false(in_dram(s, 2));
	assert_false(on_disk(s, 2));
	for (uint64_t i = 0; i < 4; i++)
		if (i != 2)
			assert_int_equal(dram_exact(s, i), 1);
	kvt_test_assert_check(s);
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

/* ---- the attacker: forged chunks, foreign files, links, keys ---- */

/* The record table as an attacker sees it: 128-byte records from byte
 * 4096, the key at 8 and 16, the record's own plain checksum (XXH3-64 of
 * the 120 bytes before it) at 120. */
#define T_REC_OFF(e) (4096 + (off_t)(e) * 128)

static void rec_rewrite(int fd, uint32_t e, const kvt_key *claim, int new_tag)
{
	uint8_t rec[128];

	assert_int_equal(pread(fd, rec, 128, T_REC_OFF(e)), 128);
	if (claim) {
		memcpy(rec + 8, &claim->lo, 8);
		memcpy(rec + 16, &claim->hi, 8);
	}
	if (new_tag) /* a nonce and tag of the forger's choosing */
		for (int i = 40; i < 72; i++)
			rec[i] = (uint8_t)(i * 37 + 11);
	uint64_t c = XXH3_64bits(rec, 120);
	memcpy(rec + 120, &c, 8);
	assert_int_equal(pwrite(fd, rec, 128, T_REC_OFF(e)), 128);
}

/* Chunks whose bytes or records were rewritten by someone who recomputed
 * every plain checksum are never served: the MAC binds the payload to the
 * key, the depth and the layout under a key the forger cannot read.
 * Three forgeries, then a restart (the records replayed from the file):
 *   key 2: its extent overwritten with other bytes, the record's nonce and
 *          tag replaced, the record's checksum recomputed;
 *   key 3: its extent overwritten with key 4's extent (genuine bytes of
 *          the tier, under the wrong key);
 *   key 5's record rewritten to claim key 99 (checksum recomputed).
 * Each is a counted miss; keys 0, 1, 4, 6, 7 come back exact. */
static void test_forged_chunks_refused(void **state)
{
	(void)state;
	kvt_seg *s = make_seg(16, 1024, 256, 1);
	kvt_disk *d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_OFF, KVT_ADMIT_ALL);
	struct kvt_disk_info info;
	struct kvt_disk_ref r2, r3, r4, r5;

	if (!d) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	save_range(s, 0, 8);
	drain(d, 1);
	kvt_key k2 = kvt_test_key(2), k3 = kvt_test_key(3), k4 = kvt_test_key(4);
	kvt_key k5 = kvt_test_key(5), k99 = kvt_test_key(99);
	assert_int_equal(kvt_disk_find(s, &k2, &r2), 1);
	assert_int_equal(kvt_disk_find(s, &k3, &r3), 1);
	assert_int_equal(kvt_disk_find(s, &k4, &r4), 1);
	assert_int_equal(kvt_disk_find(s, &k5, &r5), 1);
	kvt_disk_info(d, &info);
	kvt_disk_close(d);
	kvt_seg_detach(s);

	int fd = open(file_path, O_RDWR);
	assert_true(fd >= 0);
	size_t eb = info.extent_bytes;
	uint8_t *buf = malloc(eb);
	assert_non_null(buf);
	memset(buf, 0x5a, eb);
	assert_int_equal(pwrite(fd, buf, eb, (off_t)(info.data_off + r2.extent * eb)), (ssize_t)eb);
	rec_rewrite(fd, r2.extent, NULL, 1);
	assert_int_equal(pread(fd, buf, eb, (off_t)(info.data_off + r4.extent * eb)), (ssize_t)eb);
	assert_int_equal(pwrite(fd, buf, eb, (off_t)(info.data_off + r3.extent * eb)), (ssize_t)eb);
	rec_rewrite(fd, r5.extent, &k99, 0);
	free(buf);
	fsync(fd);
	close(fd);

	s = make_seg(16, 1024, 256, 1);
	d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_OFF, KVT_ADMIT_NONE);
	kvt_disk_info(d, &info);
	assert_int_equal(info.replayed, 8); /* the records all look fine */
	assert_true(on_disk(s, 99));
	assert_false(on_disk(s, 5));
	for (uint64_t i = 0; i < 8; i++)
		if (i != 5)
			request(s, i);
	request(s, 99);
	drain(d, 0);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_CSUM_ERRORS), 3);
	assert_false(in_dram(s, 2));
	assert_false(in_dram(s, 3));
	assert_false(in_dram(s, 99));
	assert_false(on_disk(s, 2));
	assert_false(on_disk(s, 3));
	assert_false(on_disk(s, 99));
	for (uint64_t i = 0; i < 8; i++)
		if (i != 2 && i != 3 && i != 5)
			assert_int_equal(dram_exact(s, i), 1);
	kvt_test_assert_check(s);
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

static int open_err(kvt_seg *s, const char *path, int reset, char *err, size_t len)
{
	kvt_disk *d = NULL;
	struct kvt_disk_opts o = { .size = sizeof(o), .path = path, .bytes = 4u << 20,
				   .reset = (uint32_t)reset };
	int r = kvt_disk_open(s, &o, &d, err, len);

	if (!r)
		kvt_disk_close(d);
	return r;
}

static off_t file_bytes(const char *path)
{
	struct stat st;

	return lstat(path, &st) ? -1 : st.st_size;
}

/* The disk file's rules: a file that is not ours alone, a link, a FIFO, a
 * directory, /dev/null are refused -- with reset too -- and left as they
 * were; a file the engine makes is 0600 whatever the umask. */
static void test_disk_file_rules(void **state)
{
	(void)state;
	char err[512], other[300], keyf[300];
	kvt_seg *s = make_seg(16, 1024, 256, 1);
	int fd, r;

	snprintf(other, sizeof(other), "%s.victim", file_path);
	snprintf(keyf, sizeof(keyf), "%s.key", file_path);
	/* made by the engine: 0600 under umask 0 */
	mode_t um = umask(0);
	r = open_err(s, file_path, 0, err, sizeof(err));
	umask(um);
	if (uring_refused(r, err)) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	assert_int_equal(r, 0);
	struct stat st;
	assert_int_equal(stat(file_path, &st), 0);
	assert_int_equal(st.st_mode & 0777, 0600);
	assert_int_equal(stat(keyf, &st), 0);
	assert_int_equal(st.st_mode & 0777, 0600);
	assert_int_equal(st.st_size, 32);

	/* widened after the fact: refused, for reading and for writing */
	static const mode_t bad[] = { 0666, 0644, 0640, 0602 };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		assert_int_equal(chmod(file_path, bad[i]), 0);
		r = open_err(s, file_path, 1, err, sizeof(err));
		assert_int_equal(r, -EPERM);
		assert_non_null(strstr(err, "chmod 600"));
		uint64_t chunks;
		assert_int_equal(kvt_disk_plan(file_path, 0, 8192, 1, &chunks, err, sizeof(err)),
				 -EPERM);
	}
	assert_int_equal(chmod(file_path, 0600), 0);
	/* the key file too */
	assert_int_equal(chmod(keyf, 0644), 0);
	r = open_err(s, file_path, 0, err, sizeof(err));
	assert_int_equal(r, -EPERM);
	assert_non_null(strstr(err, "disk key"));
	assert_int_equal(chmod(keyf, 0600), 0);
	assert_int_equal(open_err(s, file_path, 0, err, sizeof(err)), 0);

	/* a hard link: another name for the bytes */
	assert_int_equal(link(file_path, other), 0);
	assert_int_equal(open_err(s, file_path, 0, err, sizeof(err)), -EMLINK);
	assert_int_equal(unlink(other), 0);

	/* a symbolic link to a victim file: refused, the victim untouched,
	 * with reset too */
	fd = open(other, O_RDWR | O_CREAT | O_TRUNC, 0600);
	assert_true(fd >= 0);
	assert_int_equal(write(fd, "precious", 8), 8);
	close(fd);
	char lnk[300];
	snprintf(lnk, sizeof(lnk), "%s.lnk", file_path);
	unlink(lnk);
	assert_int_equal(symlink(other, lnk), 0);
	for (int reset = 0; reset < 2; reset++) {
		r = open_err(s, lnk, reset, err, sizeof(err));
		assert_int_equal(r, -ELOOP);
		assert_non_null(strstr(err, "symbolic link"));
	}
	assert_int_equal(file_bytes(other), 8);
	unlink(lnk);
	/* a key file that is a link: refused as well */
	char keyl[320];
	snprintf(keyl, sizeof(keyl), "%s.key", lnk);
	unlink(keyl);
	assert_int_equal(symlink(keyf, keyl), 0);
	r = open_err(s, lnk, 0, err, sizeof(err));
	assert_int_equal(r, -ELOOP);
	unlink(keyl);
	unlink(lnk);

	/* a FIFO: refused at once (neither the plan nor the open waits for a
	 * writer), as are a directory and a character device */
	unlink(other);
	assert_int_equal(mkfifo(other, 0600), 0);
	uint64_t chunks;
	r = kvt_disk_plan(other, 0, 8192, 1, &chunks, err, sizeof(err));
	assert_int_equal(r, -EINVAL);
	assert_non_null(strstr(err, "FIFO"));
	assert_int_equal(open_err(s, other, 1, err, sizeof(err)), -EINVAL);
	unlink(other);
	assert_int_equal(mkdir(other, 0700), 0);
	assert_int_equal(kvt_disk_plan(other, 0, 8192, 1, &chunks, err, sizeof(err)), -EISDIR);
	assert_non_null(strstr(err, "directory"));
	assert_true(open_err(s, other, 1, err, sizeof(err)) == -EISDIR);
	rmdir(other);
	assert_int_equal(kvt_disk_plan("/dev/null", 0, 8192, 1, &chunks, err, sizeof(err)),
			 -EINVAL);
	assert_non_null(strstr(err, "/dev/null"));

	/* one byte short: named as truncated, not as a damaged header */
	struct kvt_disk_info info;
	kvt_disk *d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_OFF, KVT_ADMIT_ALL);
	kvt_disk_info(d, &info);
	kvt_disk_close(d);
	assert_int_equal(truncate(file_path, (off_t)info.file_bytes - 1), 0);
	r = open_err(s, file_path, 0, err, sizeof(err));
	assert_int_equal(r, -ESTALE);
	assert_non_null(strstr(err, "truncated"));
	kvt_seg_detach(s);
}

/* The MAC key: a disk without its key, or with another, is refused (its
 * chunks could not be verified) until reset formats it. */
static void test_disk_key(void **state)
{
	(void)state;
	char err[512], keyf[300];
	kvt_seg *s = make_seg(16, 1024, 256, 1);
	kvt_disk *d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_OFF, KVT_ADMIT_ALL);

	if (!d) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	snprintf(keyf, sizeof(keyf), "%s.key", file_path);
	save_range(s, 0, 4);
	drain(d, 1);
	kvt_disk_close(d);
	/* missing */
	char saved[320];
	snprintf(saved, sizeof(saved), "%s.saved", keyf);
	assert_int_equal(rename(keyf, saved), 0);
	assert_int_equal(open_err(s, file_path, 0, err, sizeof(err)), -ENOKEY);
	assert_non_null(strstr(err, "missing"));
	assert_int_equal(file_bytes(keyf), -1); /* not made behind the operator's back */
	/* another key */
	int fd = open(keyf, O_WRONLY | O_CREAT | O_EXCL, 0600);
	assert_true(fd >= 0);
	uint8_t k[32];
	memset(k, 7, sizeof(k));
	assert_int_equal(write(fd, k, sizeof(k)), 32);
	close(fd);
	assert_int_equal(open_err(s, file_path, 0, err, sizeof(err)), -EKEYREJECTED);
	assert_non_null(strstr(err, "another MAC key"));
	/* not a key */
	assert_int_equal(truncate(keyf, 31), 0);
	assert_int_equal(open_err(s, file_path, 0, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "31 bytes"));
	/* the right one back: the chunks are there */
	assert_int_equal(rename(saved, keyf), 0);
	kvt_seg_detach(s);
	s = make_seg(16, 1024, 256, 1);
	d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_OFF, KVT_ADMIT_ALL);
	struct kvt_disk_info info;
	kvt_disk_info(d, &info);
	assert_int_equal(info.replayed, 4);
	kvt_disk_close(d);
	/* reset with the key gone: a new key, an empty disk */
	unlink(keyf);
	assert_int_equal(open_err(s, file_path, 1, err, sizeof(err)), 0);
	assert_int_equal(file_bytes(keyf), 32);
	d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_OFF, KVT_ADMIT_ALL);
	kvt_disk_info(d, &info);
	assert_int_equal(info.replayed, 0);
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

/* Another uid on the node (nobody, 65534) as the attacker: a disk file it
 * planted in a shared directory is refused, and it cannot read the disk
 * file or the key the engine made.  Needs root (setresuid); else 77. */
static void test_other_uid(void **state)
{
	(void)state;
	char dir[300], path[400], key[420], err[512];

	if (geteuid() != 0) {
		fprintf(stderr, "skip: needs root to act as another uid\n");
		KVT_TEST_SKIP();
	}
	snprintf(dir, sizeof(dir), "kvtier-disk-shared-%d", (int)getpid());
	assert_int_equal(mkdir(dir, 0700), 0);
	assert_int_equal(chmod(dir, 01777), 0);
	snprintf(path, sizeof(path), "%s/disk.img", dir);
	snprintf(key, sizeof(key), "%s/disk.img.key", dir);
	/* the attacker plants the file first, world-writable */
	pid_t p = fork();
	assert_true(p >= 0);
	if (p == 0) {
		if (setresgid(65534, 65534, 65534) || setresuid(65534, 65534, 65534))
			_exit(2);
		umask(0);
		int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0666);
		_exit(fd >= 0 && ftruncate(fd, 4u << 20) == 0 ? 0 : 3);
	}
	int stt;
	assert_int_equal(waitpid(p, &stt, 0), p);
	assert_true(WIFEXITED(stt) && WEXITSTATUS(stt) == 0);
	kvt_seg *s = make_seg(16, 1024, 256, 1);
	int r = open_err(s, path, 1, err, sizeof(err));
	if (uring_refused(r, err)) {
		kvt_seg_detach(s);
		unlink(path);
		rmdir(dir);
		KVT_TEST_SKIP();
	}
	assert_int_equal(r, -EPERM);
	assert_non_null(strstr(err, "owned by uid 65534"));
	assert_int_equal(file_bytes(path), 4u << 20); /* not formatted, not truncated */
	assert_int_equal(unlink(path), 0);
	/* made by the engine: the attacker can read neither file */
	kvt_disk *d = engine_or_skip(s, path, 4u << 20, KVT_DIRECT_OFF, KVT_ADMIT_ALL);
	save_range(s, 0, 2);
	drain(d, 1);
	kvt_disk_close(d);
	p = fork();
	assert_true(p >= 0);
	if (p == 0) {
		if (setresgid(65534, 65534, 65534) || setresuid(65534, 65534, 65534))
			_exit(2);
		int a = open(path, O_RDONLY), b = open(key, O_RDONLY);
		_exit(a < 0 && errno == EACCES && b < 0 ? 0 : 4);
	}
	assert_int_equal(waitpid(p, &stt, 0), p);
	assert_true(WIFEXITED(stt) && WEXITSTATUS(stt) == 0);
	kvt_seg_detach(s);
	unlink(key);
	unlink(path);
	rmdir(dir);
}

/* A disk of 8 chunks takes 40: it evicts from itself, never fails. */
static void test_full_disk(void **state)
{
	(void)state;
	kvt_seg *s = make_seg(64, 1024, 256, 1);
	uint64_t chunks = 0;
	char err[256];
	uint64_t eb = 2 * kvt_seg_shard_bytes(s);
	/* the smallest file of 8 chunks */
	uint64_t bytes = (1u << 20) + 8 * eb;

	assert_int_equal(kvt_disk_plan(file_path, bytes, kvt_seg_shard_bytes(s), 2, &chunks,
				       err, sizeof(err)), 0);
	assert_int_equal(chunks, 8);
	kvt_disk *d = engine_or_skip(s, file_path, bytes, KVT_DIRECT_AUTO, KVT_ADMIT_ALL);
	if (!d) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	for (uint64_t b = 0; b < 5; b++) {
		save_range(s, b * 8, b * 8 + 8);
		drain(d, 1);
	}
	struct kvt_disk_info info;
	kvt_disk_info(d, &info);
	assert_int_equal(info.chunks, 8);
	assert_int_equal(info.used, 8);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_WRITES), 40);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_EVICTIONS), 32);
	uint32_t found = 0;
	for (uint64_t i = 0; i < 40; i++)
		found += (uint32_t)on_disk(s, i);
	assert_int_equal(found, 8);
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

/* tmpfs: buffered with a warning under direct=auto, a refusal naming the
 * path under direct=on; the round trip works buffered. */
static void test_tmpfs_buffered(void **state)
{
	(void)state;
	kvt_seg *s = make_seg(16, 1024, 256, 1);
	char err[512];
	kvt_disk *d = NULL;
	int r = engine(s, shm_path, 4u << 20, KVT_DIRECT_ON, KVT_ADMIT_ALL, &d, err, sizeof(err));

	if (uring_refused(r, err)) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	assert_int_equal(r, -EOPNOTSUPP);
	assert_non_null(strstr(err, shm_path));
	assert_non_null(strstr(err, "tmpfs"));
	d = engine_or_skip(s, shm_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL);
	struct kvt_disk_info info;
	kvt_disk_info(d, &info);
	assert_int_equal(info.direct, 0);
	save_range(s, 0, 8);
	drain(d, 1);
	save_range(s, 100, 116);
	promote_check(s, d, 0, 8);
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

/* Bad configurations are refused with a message naming what is wrong,
 * and nothing on disk is lost. */
static void test_bad_config(void **state)
{
	(void)state;
	char err[512];
	kvt_disk *d = NULL;
	int r;

	/* no disk index in the segment */
	kvt_seg *s = make_seg(16, 0, 256, 1);
	r = engine(s, file_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL, &d, err, sizeof(err));
	assert_int_equal(r, -ENODEV);
	assert_non_null(strstr(err, "no disk index"));
	kvt_seg_detach(s);

	/* not the owner */
	s = make_seg(16, 1024, 256, 0);
	r = engine(s, file_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL, &d, err, sizeof(err));
	assert_int_equal(r, -EPERM);
	assert_int_equal(kvt_seg_own(s), 0);

	/* too small */
	r = engine(s, file_path, 64u << 10, KVT_DIRECT_AUTO, KVT_ADMIT_ALL, &d, err, sizeof(err));
	if (uring_refused(r, err)) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	assert_int_equal(r, -ENOSPC);
	assert_non_null(strstr(err, file_path));
	assert_non_null(strstr(err, "too small"));
	unlink(file_path);

	/* a file that is something else is not overwritten */
	int fd = open(file_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	assert_true(fd >= 0);
	assert_int_equal(write(fd, "precious data", 13), 13);
	close(fd);
	r = engine(s, file_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL, &d, err, sizeof(err));
	assert_int_equal(r, -EINVAL);
	assert_non_null(strstr(err, "not a kvtier disk file"));
	struct stat st;
	assert_int_equal(stat(file_path, &st), 0);
	assert_int_equal(st.st_size, 13);
	unlink(file_path);

	/* ... but a file of zeros (an operator's fallocate) is taken */
	fd = open(file_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	assert_true(fd >= 0);
	assert_int_equal(posix_fallocate(fd, 0, 4u << 20), 0);
	close(fd);
	assert_int_equal(engine(s, file_path, 0, KVT_DIRECT_AUTO, KVT_ADMIT_ALL, &d, err,
				sizeof(err)), 0);
	kvt_disk_close(d);
	unlink(file_path);

	/* a disk file of another layout: refused, then formatted on reset */
	kvt_seg_detach(s);
	s = make_seg(16, 1024, 512, 1); /* 8 KiB shards */
	d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL);
	kvt_disk_close(d);
	kvt_seg_detach(s);
	s = make_seg(16, 1024, 256, 1);
	r = engine(s, file_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL, &d, err, sizeof(err));
	assert_int_equal(r, -ESTALE);
	assert_non_null(strstr(err, "another model or KV layout"));
	struct kvt_disk_opts o = { .size = sizeof(o), .path = file_path, .bytes = 4u << 20,
				   .reset = 1 };
	assert_int_equal(kvt_disk_open(s, &o, &d, err, sizeof(err)), 0);
	kvt_disk_close(d);

	/* a size that differs from the file's */
	r = engine(s, file_path, 6u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL, &d, err, sizeof(err));
	assert_int_equal(r, -ESTALE);
	assert_non_null(strstr(err, "asked"));

	/* a disk larger than the segment's index */
	unlink(file_path);
	r = engine(s, file_path, 64u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL, &d, err, sizeof(err));
	assert_int_equal(r, -ENOSPC);
	assert_non_null(strstr(err, "disk index"));
	unlink(file_path);

	/* read-only: an immutable file (root ignores modes), else mode 0400 */
	fd = open(file_path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	assert_true(fd >= 0);
	int ro = 0;
	if (geteuid() == 0) {
		int fl = 0;
		if (ioctl(fd, FS_IOC_GETFLAGS, &fl) == 0) {
			fl |= FS_IMMUTABLE_FL;
			ro = ioctl(fd, FS_IOC_SETFLAGS, &fl) == 0;
		}
	} else {
		ro = fchmod(fd, 0400) == 0;
	}
	close(fd);
	if (ro) {
		r = engine(s, file_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL, &d, err,
			   sizeof(err));
		if (geteuid() == 0) {
			fd = open(file_path, O_RDONLY);
			int fl = 0;
			if (fd >= 0 && ioctl(fd, FS_IOC_GETFLAGS, &fl) == 0) {
				fl &= ~FS_IMMUTABLE_FL;
				ioctl(fd, FS_IOC_SETFLAGS, &fl);
			}
			if (fd >= 0)
				close(fd);
		}
		assert_true(r == -EACCES || r == -EPERM || r == -EROFS);
		assert_non_null(strstr(err, file_path));
		assert_non_null(strstr(err, "read-only"));
	} else {
		fprintf(stderr, "note: no read-only file could be made here; case not run\n");
	}
	unlink(file_path);
	kvt_seg_detach(s);
}

/* Admission: second-hit writes only chunks hit (or seen before); none
 * writes nothing but still serves what is there. */
static void test_admission(void **state)
{
	(void)state;
	kvt_seg *s = make_seg(64, 1024, 256, 1);
	kvt_disk *d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_AUTO,
				     KVT_ADMIT_SECOND_HIT);

	if (!d) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	save_range(s, 0, 8);
	drain(d, 1);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_WRITES), 0);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_ADMIT_REJECTS), 8);
	/* hit keys 0..3 */
	for (uint64_t i = 0; i < 4; i++)
		assert_int_equal(dram_exact(s, i), 1);
	drain(d, 1);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_WRITES), 4);
	for (uint64_t i = 0; i < 8; i++)
		assert_int_equal(on_disk(s, i), i < 4);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_ADMIT_REJECTS), 8); /* once per life */
	kvt_disk_close(d);

	d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_NONE);
	save_range(s, 200, 208);
	drain(d, 1);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_WRITES), 4);
	assert_true(on_disk(s, 0)); /* replayed, still served */
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

/* kill -9 of the engine while it writes: after a restart every chunk it
 * serves is byte-exact; torn ones are checksum misses. */
static void test_kill9_during_writes(void **state)
{
	(void)state;
	const uint32_t rounds = 12, per = 40;
	uint64_t seed = (uint64_t)time(NULL) ^ (uint64_t)getpid();
	kvt_seg *s;

	{
		/* io_uring at all? (the child would only die of it) */
		kvt_seg *t = make_seg(16, 1024, 256, 1);
		kvt_disk *d = engine_or_skip(t, file_path, 4u << 20, KVT_DIRECT_AUTO,
					     KVT_ADMIT_ALL);
		if (!d) {
			kvt_seg_detach(t);
			KVT_TEST_SKIP();
		}
		kvt_disk_close(d);
		kvt_seg_detach(t);
		unlink(file_path);
	}
	s = make_seg(512, 1024, 4096, 0); /* 64 KiB shards */
	for (uint32_t round = 0; round < rounds; round++) {
		save_range(s, (uint64_t)round * per, (uint64_t)(round + 1) * per);
		pid_t pid = fork();
		assert_true(pid >= 0);
		if (pid == 0) {
			kvt_seg *c;
			/* the last round's engine is dead, its ring's teardown
			 * may not be over: own once it is */
			if (kvt_test_attach(seg_name, KVT_ROLE_CLIENT, 0, 0, 0, &c) ||
			    kvt_seg_own_wait(c, 30000))
				_exit(3);
			struct kvt_disk_opts o = { .size = sizeof(o), .path = file_path,
						   .bytes = 96u << 20, .depth = 16 };
			kvt_disk *d;
			char err[256];
			if (kvt_disk_open(c, &o, &d, err, sizeof(err))) {
				fprintf(stderr, "child: %s\n", err);
				_exit(4);
			}
			for (;;)
				kvt_disk_poll(d);
		}
		/* Kill it while it writes: once its first write of this round
		 * completed, after 0..3 ms more. */
		uint64_t before = kvt_test_counter(s, KVT_C_DISK_WRITES);
		struct timespec tick = { 0, 100000 };
		for (int k = 0; k < 100000 && kvt_test_counter(s, KVT_C_DISK_WRITES) == before; k++)
			nanosleep(&tick, NULL);
		seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
		struct timespec ts = { 0, (long)((seed >> 33) % 3000000) };
		nanosleep(&ts, NULL);
		kvt_kill_pid(pid, SIGKILL);
		int st;
		assert_int_equal(waitpid(pid, &st, 0), pid);
		assert_true(WIFSIGNALED(st));
		kvt_seg_reap(s);
	}
	uint64_t written = kvt_test_counter(s, KVT_C_DISK_WRITES);
	kvt_seg_detach(s);

	/* Restart on a fresh segment: promote everything the records name. */
	s = make_seg(512, 1024, 4096, 1);
	kvt_disk *d = engine_or_skip(s, file_path, 96u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_NONE);
	struct kvt_disk_info info;
	kvt_disk_info(d, &info);
	fprintf(stderr, "kill -9 x %u: %llu chunks written, %llu replayed\n", rounds,
		(unsigned long long)written, (unsigned long long)info.replayed);
	uint32_t asked = 0, served = 0;
	for (uint64_t i = 0; i < (uint64_t)rounds * per; i++)
		if (on_disk(s, i)) {
			request(s, i);
			asked++;
			if (asked % 64 == 0)
				drain(d, 0);
		}
	drain(d, 0);
	for (uint64_t i = 0; i < (uint64_t)rounds * per; i++)
		served += (uint32_t)dram_exact(s, i); /* asserts every byte */
	uint64_t bad = kvt_test_counter(s, KVT_C_DISK_CSUM_ERRORS);
	fprintf(stderr, "restart: %u asked, %u served byte-exact, %llu checksum misses\n", asked,
		served, (unsigned long long)bad);
	assert_int_equal(asked, info.replayed);
	assert_int_equal(served + bad, asked);
	assert_true(served > 0);
	assert_true(written >= rounds);
	kvt_test_assert_check(s);
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

/* The race of demotion without a pin, made deterministic: the engine
 * submits chunk A's write (one poll: submitted, not reaped), then A's slot
 * is evicted and refilled with chunk B before the completion is seen.  The
 * write is dropped, A is never published (what reached the disk may mix A
 * and B), and B is demoted and read back exact. */
static void test_evicted_during_write(void **state)
{
	(void)state;
	kvt_seg *s = make_seg(1, 1024, 256, 1); /* one slot */
	kvt_disk *d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL);

	if (!d) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	save_range(s, 7, 8);           /* A */
	assert_true(kvt_disk_poll(d) > 0); /* A's write submitted */
	struct kvt_disk_info info;
	kvt_disk_info(d, &info);
	assert_true(info.inflight > 0);
	save_range(s, 9, 10);          /* B takes A's slot */
	assert_false(in_dram(s, 7));
	assert_true(in_dram(s, 9));
	drain(d, 1);
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_WRITE_DROPS), 1);
	assert_false(on_disk(s, 7));
	assert_true(on_disk(s, 9));
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_WRITES), 1);
	/* B back from disk, byte for byte (A leaves the slot free) */
	save_range(s, 7, 8);
	promote_check(s, d, 9, 10);
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

/* ---- a slow block device: a loop device throttled by blkio ----
 *
 * Root, a free loop device and the cgroup-v1 blkio throttle are needed
 * (else the test skips): reads of the device by a process in the cgroup
 * run at THROTTLE_BPS, so a promotion read stays in flight for seconds,
 * long after its submitter was killed. */
#define THROTTLE_BPS 32768 /* a 128 KiB chunk: ~4 s in flight */
#define FAIL_AFTER_TEST 16 /* tier/disk/disk.c's FAIL_AFTER */
static char loop_dev[128], loop_img[256], blk_cg[128];

static void slow_device_teardown(void)
{
	char cmd[512];

	if (loop_dev[0]) {
		snprintf(cmd, sizeof(cmd), "losetup -d %s 2>/dev/null", loop_dev);
		if (system(cmd)) {
			/* best effort */
		}
		loop_dev[0] = 0;
	}
	if (loop_img[0])
		unlink(loop_img);
	loop_img[0] = 0;
	if (blk_cg[0])
		(void)rmdir(blk_cg);
	blk_cg[0] = 0;
}

static int write_file(const char *path, const char *text)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	ssize_t n = fd < 0 ? -1 : write(fd, text, strlen(text));

	if (fd >= 0)
		close(fd);
	return n == (ssize_t)strlen(text) ? 0 : -1;
}

/* Makes the device (and, with throttle, the cgroup); 0, or -1 (skip: why
 * on stderr).  direct_io: the loop device reads its backing file with
 * O_DIRECT, and a read past the file's end then fails with EIO. */
static int loop_device(uint64_t bytes, int throttle, int direct_io)
{
	char cmd[512], line[128], path[256];
	struct stat st;
	FILE *p;

	if (geteuid() != 0 || access("/dev/loop-control", W_OK) ||
	    access("/sys/fs/cgroup/blkio/cgroup.procs", W_OK)) {
		fprintf(stderr, "skip: needs root, loop devices and the blkio cgroup (v1)\n");
		return -1;
	}
	snprintf(loop_img, sizeof(loop_img), "kvtier-disk-loop-%d.img", (int)getpid());
	int fd = open(loop_img, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0 || ftruncate(fd, (off_t)bytes)) {
		fprintf(stderr, "skip: %s: %s\n", loop_img, strerror(errno));
		if (fd >= 0)
			close(fd);
		return -1;
	}
	close(fd);
	snprintf(cmd, sizeof(cmd), "losetup -f --show %s %s 2>&1",
		 direct_io ? "--direct-io=on" : "", loop_img);
	p = popen(cmd, "r");
	if (!p || !fgets(line, sizeof(line), p) || strncmp(line, "/dev/loop", 9)) {
		fprintf(stderr, "skip: losetup: %s\n", p ? line : strerror(errno));
		if (p)
			pclose(p);
		return -1;
	}
	pclose(p);
	line[strcspn(line, "\n")] = 0;
	snprintf(loop_dev, sizeof(loop_dev), "%s", line);
	if (stat(loop_dev, &st) || !S_ISBLK(st.st_mode))
		return -1;
	if (!throttle)
		return 0;
	snprintf(blk_cg, sizeof(blk_cg), "/sys/fs/cgroup/blkio/kvtier-test-%d", (int)getpid());
	if (mkdir(blk_cg, 0755) && errno != EEXIST)
		return -1;
	snprintf(path, sizeof(path), "%s/blkio.throttle.read_bps_device", blk_cg);
	snprintf(line, sizeof(line), "%u:%u %u", major(st.st_rdev), minor(st.st_rdev),
		 THROTTLE_BPS);
	if (write_file(path, line)) {
		fprintf(stderr, "skip: %s: %s\n", path, strerror(errno));
		return -1;
	}
	return 0;
}

static int slow_device(uint64_t bytes) { return loop_device(bytes, 1, 0); }

/* An engine killed with a promotion read in flight into a claimed slot:
 * the claim -- its entry -- lives until the read landed, so the slot is
 * never handed to another key under it.  Deterministic: the device is
 * throttled, so the read is still queued when the kill comes, for ~4 s.
 * The decisive checks: right after the kill the dead engine's entry is
 * not reaped (its ring holds the lock descriptor, kvt_seg_lock_fd), and
 * once it is, every chunk then saved into the slot is byte-exact.  Before
 * the ring held the descriptor, the reaper freed the slot at once, the
 * next key was saved into it, and the old read overwrote it: served as
 * that key's bytes. */
static pid_t slow_engine;

static int teardown_slow(void **state)
{
	if (slow_engine > 1) {
		kvt_kill_pid(slow_engine, SIGKILL);
		(void)waitpid(slow_engine, NULL, 0);
	}
	slow_engine = 0;
	slow_device_teardown();
	return teardown(state);
}

/* Demotes A (key 7) on the slow device through an in-process engine, and
 * lets B (key 9) take the one slot; returns the segment (no owner left). */
static kvt_seg *slow_setup(struct kvt_disk_opts *o)
{
	char err[512];
	kvt_seg *s = make_seg(1, 1024, 4096, 0), *t;
	kvt_disk *d;

	assert_int_equal(kvt_test_attach(seg_name, KVT_ROLE_CLIENT, 0, 0, 0, &t), 0);
	assert_int_equal(kvt_seg_own(t), 0);
	*o = (struct kvt_disk_opts){ .size = sizeof(*o), .path = loop_dev, .key_path = key_path,
				     .direct = KVT_DIRECT_ON, .admit = KVT_ADMIT_ALL, .depth = 8 };
	int r = kvt_disk_open(t, o, &d, err, sizeof(err));
	if (uring_refused(r, err)) {
		kvt_seg_detach(t);
		kvt_seg_detach(s);
		return NULL;
	}
	if (r)
		fprintf(stderr, "kvt_disk_open: %s\n", err);
	assert_int_equal(r, 0); /* a block device gets O_DIRECT (not taken for tmpfs) */
	save_range(s, 7, 8);     /* A, demoted */
	drain(d, 1);
	assert_true(on_disk(s, 7));
	save_range(s, 9, 10);    /* B takes A's slot */
	assert_false(in_dram(s, 7));
	kvt_disk_close(d);
	kvt_seg_detach(t);       /* no owner now */
	o->admit = KVT_ADMIT_NONE;
	return s;
}

/* Child side: joins the throttled cgroup, owns, opens the engine. */
static kvt_disk *slow_child_engine(struct kvt_disk_opts *o, kvt_seg **c)
{
	char procs[256], err[512];
	kvt_disk *d;

	snprintf(procs, sizeof(procs), "%s/cgroup.procs", blk_cg);
	if (write_file(procs, "0"))
		_exit(2);
	if (kvt_test_attach(seg_name, KVT_ROLE_CLIENT, 0, 0, 0, c) || kvt_seg_own_wait(*c, 30000))
		_exit(3);
	if (kvt_disk_open(*c, o, &d, err, sizeof(err))) {
		fprintf(stderr, "child: %s\n", err);
		_exit(4);
	}
	return d;
}

/* Parent side: asks for A and waits for its read to be in flight. */
static void slow_wait_inflight(kvt_seg *s)
{
	struct kvt_disk_status ds;

	assert_true(on_disk(s, 7)); /* replayed */
	request(s, 7);
	for (int i = 0; i < 30000; i++) {
		assert_int_equal(kvt_disk_status_read(s, &ds), 0);
		if (ds.inflight > 0)
			break;
		usleep(1000);
	}
	assert_true(ds.inflight > 0);
	assert_false(in_dram(s, 9)); /* B was evicted for it */
}

/* The slot of the read in flight is not to be had, by key 11 or anyone;
 * once the device finished, the entry is reaped and key 11 saved exact. */
static void slow_check_claim_outlives_read(kvt_seg *s)
{
	kvt_key k11 = kvt_test_key(11);
	struct kvt_wref w;
	int r = kvt_write_begin(s, &k11, 0, 0, &w);

	if (r >= 0)
		fail_msg("a slot was handed to key 11 under an in-flight read into it "
			 "(kvt_write_begin %d, slot %u)", r, w.slot);
	assert_false(in_dram(s, 11));
	int reaped = 0;
	for (int i = 0; i < 60000 && !reaped; i++) {
		reaped = kvt_seg_reap(s);
		assert_true(reaped >= 0);
		if (!reaped)
			usleep(1000);
	}
	assert_int_equal(reaped, 1);
	kvt_test_assert_check(s);
	save_range(s, 11, 12);
	assert_int_equal(dram_exact(s, 11), 1);
}

/* The slow device and the segment of slow_setup, or the test skips. */
static kvt_seg *slow_begin(struct kvt_disk_opts *o)
{
	if (slow_device(16u << 20))
		KVT_TEST_SKIP();
	/* one slot, 2 x 64 KiB shards: a chunk's read takes ~4 s throttled */
	kvt_seg *s = slow_setup(o);
	if (!s)
		KVT_TEST_SKIP();
	return s;
}

static void test_kill_with_read_in_flight(void **state)
{
	(void)state;
	struct kvt_disk_opts o;
	int pfd[2], st;
	char c;
	kvt_seg *s = slow_begin(&o);

	assert_int_equal(pipe(pfd), 0);
	slow_engine = fork();
	assert_true(slow_engine >= 0);
	if (slow_engine == 0) {
		kvt_seg *h;
		close(pfd[0]);
		kvt_disk *d = slow_child_engine(&o, &h);
		if (write(pfd[1], "r", 1) != 1)
			_exit(5);
		for (;;)
			kvt_disk_poll(d);
	}
	close(pfd[1]);
	assert_int_equal(read(pfd[0], &c, 1), 1);
	close(pfd[0]);
	slow_wait_inflight(s);
	kvt_kill_pid(slow_engine, SIGKILL);
	assert_int_equal(waitpid(slow_engine, &st, 0), slow_engine);
	slow_engine = 0;
	/* Dead, its read queued at the device: its entry, and the claim on
	 * the slot, must stay. */
	assert_int_equal(kvt_seg_reap(s), 0);
	slow_check_claim_outlives_read(s);
	kvt_seg_detach(s);
}

/* The same read outlives a close that gave up waiting for it (a hung
 * device, close_wait_ms): the engine's process lives on, its handle
 * detached, and still the claim stays until the read landed.  Before,
 * the detach released the entry and aborted the claim at once. */
static void test_close_timeout_leaves_claims(void **state)
{
	(void)state;
	struct kvt_disk_opts o;
	int pfd[2], back[2];
	char c;
	kvt_seg *s = slow_begin(&o);

	assert_int_equal(pipe(pfd), 0);
	assert_int_equal(pipe(back), 0);
	slow_engine = fork();
	assert_true(slow_engine >= 0);
	if (slow_engine == 0) {
		kvt_seg *h;
		close(pfd[0]);
		close(back[1]);
		o.close_wait_ms = 50;
		kvt_disk *d = slow_child_engine(&o, &h);
		if (write(pfd[1], "r", 1) != 1)
			_exit(5);
		struct kvt_disk_status ds;
		do {
			kvt_disk_poll(d);
			kvt_disk_status_read(h, &ds);
		} while (!ds.inflight);
		kvt_disk_close(d); /* gives up after 50 ms */
		kvt_seg_detach(h);
		if (write(pfd[1], "c", 1) != 1)
			_exit(6);
		if (read(back[0], &c, 1) < 0) /* lives until told */
			_exit(7);
		_exit(0);
	}
	close(pfd[1]);
	close(back[0]);
	assert_int_equal(read(pfd[0], &c, 1), 1);
	request(s, 7);
	assert_int_equal(read(pfd[0], &c, 1), 1);
	assert_int_equal(c, 'c');
	close(pfd[0]);
	assert_false(in_dram(s, 9));
	slow_check_claim_outlives_read(s);
	close(back[1]);
	int st;
	assert_int_equal(waitpid(slow_engine, &st, 0), slow_engine);
	slow_engine = 0;
	assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	kvt_seg_detach(s);
}

/* A device that fails reads: the extents past the end of a direct-I/O loop
 * device's shrunk backing file fail with EIO.  Each failed read drops its
 * chunk (not pending again: the request is answered), every failure is
 * counted, FAIL_AFTER in a row take the disk offline (the status says so)
 * and DRAM keeps serving; the chunks the device can still read were served
 * exact.  Before, the extents stayed in the index, re-asked for ever, with
 * one log line and no count. */
static void test_failing_disk(void **state)
{
	(void)state;
	struct kvt_disk_info info;
	struct kvt_disk_status ds;
	char err[512];

	if (loop_device(16u << 20, 0, 1))
		KVT_TEST_SKIP();
	kvt_seg *s = make_seg(64, 1024, 256, 1);
	struct kvt_disk_opts o = { .size = sizeof(o), .path = loop_dev, .key_path = key_path,
				   .direct = KVT_DIRECT_ON,
				   .admit = KVT_ADMIT_ALL, .depth = 8,
				   .bytes = 4u << 20 };
	kvt_disk *d;
	int r = kvt_disk_open(s, &o, &d, err, sizeof(err));
	if (uring_refused(r, err)) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	if (r)
		fprintf(stderr, "kvt_disk_open: %s\n", err);
	assert_int_equal(r, 0);
	save_range(s, 0, 60);
	drain(d, 1);
	kvt_disk_info(d, &info);
	assert_int_equal(info.used, 60);
	kvt_disk_close(d);
	kvt_seg_detach(s);
	/* The device now fails every extent after the fourth. */
	uint64_t keep = info.data_off + 4 * info.extent_bytes;
	assert_int_equal(truncate(loop_img, (off_t)keep), 0);

	s = make_seg(64, 1024, 256, 1);
	o.admit = KVT_ADMIT_NONE;
	assert_int_equal(kvt_disk_open(s, &o, &d, err, sizeof(err)), 0);
	kvt_disk_info(d, &info);
	assert_int_equal(info.replayed, 60);
	uint32_t good = 0, bad = 0;
	int good_key[60];
	for (uint64_t i = 0; i < 60; i++) {
		kvt_key k = kvt_test_key(i);
		struct kvt_disk_ref ref;
		assert_int_equal(kvt_disk_find(s, &k, &ref), 1);
		good_key[i] = (uint64_t)ref.extent < 4;
		good += (uint32_t)good_key[i];
	}
	bad = 60 - good;
	assert_true(bad >= FAIL_AFTER_TEST);
	/* the readable ones: served exact */
	for (uint64_t i = 0; i < 60; i++)
		if (good_key[i])
			request(s, i);
	drain(d, 0);
	for (uint64_t i = 0; i < 60; i++)
		if (good_key[i])
			assert_int_equal(dram_exact(s, i), 1);
	/* the others: each read fails */
	for (uint64_t i = 0; i < 60; i++)
		if (!good_key[i])
			request(s, i);
	drain(d, 0);
	assert_int_equal(kvt_disk_status_read(s, &ds), 0);
	fprintf(stderr, "failing disk: %u readable, %u not; %llu I/O errors, failed %llu\n",
		good, bad, (unsigned long long)ds.io_errors, (unsigned long long)ds.failed);
	assert_true(ds.io_errors >= FAIL_AFTER_TEST);
	assert_int_equal(ds.failed, 1);
	assert_false(kvt_disk_online(s));   /* lookups no longer ask */
	for (uint64_t i = 0; i < 60; i++) {
		assert_false(on_disk(s, i));    /* nothing pending for ever */
		assert_int_equal(in_dram(s, i), good_key[i]);
	}
	assert_int_equal(kvt_test_counter(s, KVT_C_DISK_CSUM_ERRORS), 0);
	/* DRAM keeps serving */
	save_range(s, 500, 510);
	for (uint64_t i = 500; i < 510; i++)
		assert_int_equal(dram_exact(s, i), 1);
	kvt_test_assert_check(s);
	kvt_disk_close(d);
	kvt_seg_detach(s);

	/* A device that cannot even read its header: the message says I/O. */
	assert_int_equal(truncate(loop_img, 0), 0);
	s = make_seg(64, 1024, 256, 1);
	r = kvt_disk_open(s, &o, &d, err, sizeof(err));
	fprintf(stderr, "unreadable device: %d %s\n", r, err);
	assert_int_equal(r, -EIO);
	assert_non_null(strstr(err, "Input/output error"));
	kvt_seg_detach(s);
}

/* One engine per disk file: a second engine (another process, its own
 * segment) is refused, naming the first's pid, with reset too, and the
 * first engine's chunks stay intact.  Before, both were accepted and
 * reset formatted the file under the first. */
static void test_one_engine_per_file(void **state)
{
	(void)state;
	kvt_seg *s = make_seg(48, 1024, 256, 1);
	kvt_disk *d = engine_or_skip(s, file_path, 8u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL);
	int st;

	if (!d) {
		kvt_seg_detach(s);
		KVT_TEST_SKIP();
	}
	save_range(s, 0, 8);
	drain(d, 1);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		char name[96], err[512], want[32];
		snprintf(name, sizeof(name), "%s-second", seg_name);
		struct kvt_geometry g = geo(48, 1024, 256);
		struct kvt_seg_create_opts co = { .size = sizeof(co), .name = name,
						  .geo = &g, .flags = KVT_SEG_F_REPLACE };
		struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = name,
						 .role = KVT_ROLE_CLIENT };
		kvt_seg *t;
		kvt_disk *e;
		if (kvt_seg_create(&co, &a, &t) || kvt_seg_own(t))
			_exit(2);
		snprintf(want, sizeof(want), "pid %d", (int)getppid());
		struct kvt_disk_opts o = { .size = sizeof(o), .path = file_path };
		int r = kvt_disk_open(t, &o, &e, err, sizeof(err));
		int ok = r == -EBUSY && strstr(err, want) && strstr(err, "in use");
		if (!ok)
			fprintf(stderr, "second engine: %d %s\n", r, err);
		o.reset = 1;
		o.bytes = 8u << 20;
		r = kvt_disk_open(t, &o, &e, err, sizeof(err));
		ok = ok && r == -EBUSY;
		if (r != -EBUSY)
			fprintf(stderr, "second engine, reset: %d %s\n", r, err);
		kvt_seg_detach(t);
		kvt_seg_unlink(name, NULL);
		_exit(ok ? 0 : 1);
	}
	assert_int_equal(waitpid(pid, &st, 0), pid);
	assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	save_range(s, 1000, 1048); /* push 0..7 out of DRAM */
	promote_check(s, d, 0, 8);
	kvt_disk_close(d);
	kvt_seg_detach(s);
}

/* kvt_lookup_ex: hits, then the disk chunks pending; asked again after
 * the engine promoted them, they are hits. */
static void test_lookup_ex_ask_again(void **state)
{
	(void)state;
	struct kvt_group_desc gd = { .n_layers = 1, .bytes_per_token = 256,
				     .tokens_per_block = 16 };
	struct kvt_config c = {
		.size = sizeof(c), .flags = KVT_F_CREATE | KVT_F_REPLACE | KVT_F_NO_ENV,
		.role = KVT_TIER_CLIENT, .instance = 0, .rank = -1, .world = 2,
		.chunk_tokens = 16, .segment = seg_name, .model = "disk-test", .dma = "host",
		.n_groups = 1, .groups = &gd, .n_slots = 24, .disk_chunks = 1024 };
	kvt_tier *t;
	int r = kvt_open(&c, &t);

	if (r)
		fprintf(stderr, "open: %s\n", kvt_last_error());
	assert_int_equal(r, 0);
	kvt_seg *s = kvt__tier_seg(t);
	assert_int_equal(kvt_seg_own(s), 0);
	kvt_disk *d = engine_or_skip(s, file_path, 4u << 20, KVT_DIRECT_AUTO, KVT_ADMIT_ALL);
	if (!d) {
		kvt_close(t);
		KVT_TEST_SKIP();
	}
	kvt_key keys[12];
	for (uint64_t i = 0; i < 12; i++)
		keys[i] = kvt_test_key(i);
	save_range(s, 0, 12);
	drain(d, 1);
	save_range(s, 500, 524); /* 4..11 (and more) leave DRAM */
	/* keep 0..3 in DRAM */
	save_range(s, 0, 4);
	struct kvt_lookup_res res = { .size = sizeof(res) };
	r = kvt_lookup_ex(t, keys, 12, 0, &res);
	assert_true(r >= 0);
	uint32_t h0 = res.hits;
	assert_int_equal(res.hits + res.pending, 12);
	assert_int_equal(res.requested, 0);
	if (res.lease)
		assert_int_equal(kvt_release(t, res.lease), 0);
	r = kvt_lookup_ex(t, keys, 12, KVT_LOOKUP_PROMOTE, &res);
	assert_int_equal(res.requested, res.pending);
	assert_true(res.pending > 0);
	if (res.lease)
		assert_int_equal(kvt_release(t, res.lease), 0);
	/* asking again at once queues nothing twice */
	r = kvt_lookup_ex(t, keys, 12, KVT_LOOKUP_PROMOTE, &res);
	assert_int_equal(res.requested, 0);
	if (res.lease)
		assert_int_equal(kvt_release(t, res.lease), 0);
	drain(d, 0);
	r = kvt_lookup_ex(t, keys, 12, KVT_LOOKUP_PROMOTE, &res);
	assert_int_equal(r, 12);
	assert_int_equal(res.hits, 12);
	assert_int_equal(res.pending, 0);
	assert_true(h0 < 12);
	uint32_t slots[12];
	uint64_t gens[12];
	assert_int_equal(kvt_lease_slots(s, res.lease, slots, gens, 12), 12);
	for (uint32_t i = 0; i < 12; i++)
		for (uint32_t sh = 0; sh < 2; sh++)
			assert_true(kvt_test_stamped(s, slots[i], sh, &keys[i]));
	assert_int_equal(kvt_release(t, res.lease), 0);
	struct kvt_stats st = { .size = sizeof(st) };
	assert_int_equal(kvt_stats(t, &st), 0);
	assert_int_equal(st.disk_online, 1);
	assert_true(st.disk_reads >= 12 - h0);
	assert_true(st.promote_requests >= 12 - h0);
	struct kvt_stats v1 = { .size = KVT_STATS_V1_SIZE };
	assert_int_equal(kvt_stats(t, (struct kvt_stats *)&v1), 0);
	/* bad flags; a first depth that overflows with the keys */
	assert_int_equal(kvt_lookup_ex(t, keys, 12, 0x80, &res), -EINVAL);
	res.first_depth = UINT32_MAX - 3;
	assert_int_equal(kvt_lookup_ex(t, keys, 12, KVT_LOOKUP_DEPTH, &res), -EINVAL);
	kvt_disk_close(d);
	/* engine offline: nothing pending */
	r = kvt_lookup_ex(t, keys + 12 - 1, 1, KVT_LOOKUP_PROMOTE, &res);
	assert_int_equal(res.pending, 0);
	if (res.lease)
		kvt_release(t, res.lease);
	kvt_close(t);
}

int main(int argc, char **argv)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_round_trip_and_restart, setup, teardown),
		cmocka_unit_test_setup_teardown(test_checksum_mismatch, setup, teardown),
		cmocka_unit_test_setup_teardown(test_forged_chunks_refused, setup, teardown),
		cmocka_unit_test_setup_teardown(test_disk_file_rules, setup, teardown),
		cmocka_unit_test_setup_teardown(test_disk_key, setup, teardown),
		cmocka_unit_test_setup_teardown(test_other_uid, setup, teardown),
		cmocka_unit_test_setup_teardown(test_full_disk, setup, teardown),
		cmocka_unit_test_setup_teardown(test_tmpfs_buffered, setup, teardown),
		cmocka_unit_test_setup_teardown(test_bad_config, setup, teardown),
		cmocka_unit_test_setup_teardown(test_admission, setup, teardown),
		cmocka_unit_test_setup_teardown(test_kill9_during_writes, setup, teardown),
		cmocka_unit_test_setup_teardown(test_kill_with_read_in_flight, setup, teardown_slow),
		cmocka_unit_test_setup_teardown(test_close_timeout_leaves_claims, setup, teardown_slow),
		cmocka_unit_test_setup_teardown(test_one_engine_per_file, setup, teardown),
		cmocka_unit_test_setup_teardown(test_failing_disk, setup, teardown_slow),
		cmocka_unit_test_setup_teardown(test_evicted_during_write, setup, teardown),
		cmocka_unit_test_setup_teardown(test_lookup_ex_ask_again, setup, teardown),
	};

	char err[256];
	uint64_t n;
	if (kvt_disk_plan("probe", 1u << 30, 4096, 1, &n, err, sizeof(err)) == -ENOSYS) {
		fprintf(stderr, "skip: %s\n", err); /* a build without liburing */
		return 77;
	}
	kvt_test_select(argc, argv, NULL);
	return kvt_test_result(cmocka_run_group_tests(tests, NULL, NULL));
}
