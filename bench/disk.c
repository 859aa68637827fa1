/* disk.c - kvtier-bench disk: the disk tier's demotion and promotion
 * bandwidth, against fio on the same file, block size and queue depth.
 *
 *   1. A segment of N chunks (world W shards of S bytes each) is filled
 *      with stamped chunks, and the disk engine (tier/disk/disk.c, the code
 *      kvtierd runs) demotes all of them: write GB/s = N x W x S over the
 *      time from the engine's first submission to its last record.
 *   2. A fresh segment of the same layout, the engine restarted on the
 *      same file (the records replayed, not timed), every chunk asked
 *      back through the request rings as lookups ask: read GB/s over the
 *      time until the last chunk is READY (reads, checksums, publication).
 *      Every promoted chunk is then checked word by word.
 *   3. fio (ioengine=io_uring, direct=1 unless the engine ran buffered) on
 *      the same file (the second half of its data area, so that it never
 *      overwrites what kvtier reads back): sequential writes right after
 *      kvtier's, reads right after kvtier's, block size S, the same queue
 *      depth, the same bytes; each read after a second's rest.  Its
 *      bandwidth is the device's ceiling; the ratio kvtier / fio is the
 *      figure (goal >= 0.9).  --repeat rounds, medians.
 * With --no-fio (or no fio installed) step 3 is skipped and said so.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvt_clock.h"
#include "kvt_core.h"
#include "kvt_disk.h"
#include "safe_kill.h"

struct dopts {
	const char *file;
	uint32_t chunks, world, depth, direct;
	uint64_t shard;
	int fio, json, keep;
	uint32_t repeat;
};

static uint64_t stamp_word(uint64_t key, uint32_t shard, uint64_t i)
{
	uint64_t z = key * 0x9e3779b97f4a7c15ULL ^ ((uint64_t)shard << 56) ^ (i << 8);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	return z ^ (z >> 31);
}

static kvt_key bkey(uint64_t i)
{
	kvt_key k = { i * 0x9e3779b97f4a7c15ULL + 1, 0x6b7674646973ULL };
	return k;
}

static double median(double *v, uint32_t n)
{
	for (uint32_t i = 1; i < n; i++)
		for (uint32_t j = i; j > 0 && v[j - 1] > v[j]; j--) {
			double t = v[j];
			v[j] = v[j - 1];
			v[j - 1] = t;
		}
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static int make_seg(const char *name, const struct dopts *o, uint32_t disk_chunks,
		    kvt_seg **out)
{
	struct kvt_geometry g;

	memset(&g, 0, sizeof(g));
	g.chunk_tokens = 256;
	g.world = o->world;
	g.n_instances = 1;
	g.mode = KVT_MODE_SHARDED;
	g.n_groups = 1;
	g.groups[0].layers = 8;
	g.groups[0].bytes_per_token = (uint32_t)(o->shard / (256 * 8));
	g.model_id.lo = 0x6469736b;
	g.n_slots = o->chunks;
	g.disk_chunks = disk_chunks;
	struct kvt_seg_create_opts c = { .size = sizeof(c), .name = name, .geo = &g,
					 .flags = KVT_SEG_F_REPLACE | KVT_SEG_F_PREFAULT };
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = name,
					 .role = KVT_ROLE_CLIENT };
	int r = kvt_seg_create(&c, &a, out);

	if (!r)
		r = kvt_seg_own(*out);
	if (r)
		fprintf(stderr, "kvtier-bench disk: segment: %s\n", kvt_core_last_error());
	return r;
}

static int fill(kvt_seg *s, uint32_t n)
{
	for (uint64_t i = 0; i < n; i++) {
		kvt_key k = bkey(i);
		for (uint32_t sh = 0; sh < kvt_seg_n_shards(s); sh++) {
			struct kvt_wref w;
			int r = kvt_write_begin(s, &k, 0, sh, &w);
			if (r) {
				fprintf(stderr, "kvtier-bench disk: fill: %s\n", kvt_core_last_error());
				return r < 0 ? r : -EIO;
			}
			uint64_t *q = kvt_slot_shard_ptr(s, w.slot, sh);
			for (uint64_t j = 0; j < kvt_seg_chunk_bytes(s) / 8; j++)
				q[j] = stamp_word(k.lo, sh, j);
			if (kvt_write_end(s, &w, 1) < 0)
				return -EIO;
		}
	}
	return 0;
}

/* Every chunk READY and stamped: the count of wrong ones. */
static uint64_t verify(kvt_seg *s, uint32_t n)
{
	uint64_t bad = 0;

	for (uint64_t i = 0; i < n; i++) {
		kvt_key k = bkey(i);
		uint64_t lease, gen;
		uint32_t slot;
		if (kvt_seg_lookup(s, &k, 1, &lease) != 1 ||
		    kvt_lease_slots(s, lease, &slot, &gen, 1) != 1) {
			bad++;
			continue;
		}
		for (uint32_t sh = 0; sh < kvt_seg_n_shards(s); sh++) {
			const uint64_t *q = kvt_slot_shard_ptr(s, slot, sh);
			for (uint64_t j = 0; j < kvt_seg_chunk_bytes(s) / 8; j++)
				if (q[j] != stamp_word(k.lo, sh, j)) {
					bad++;
					sh = kvt_seg_n_shards(s);
					break;
				}
		}
		kvt_lease_release(s, lease);
	}
	return bad;
}

static int engine(kvt_seg *s, const struct dopts *o, uint64_t bytes, kvt_disk **d)
{
	char err[512];
	struct kvt_disk_opts dop = { .size = sizeof(dop), .path = o->file, .bytes = bytes,
				     .direct = o->direct, .depth = o->depth, .reset = 1 };
	int r = kvt_disk_open(s, &dop, d, err, sizeof(err));

	if (r)
		fprintf(stderr, "kvtier-bench disk: %s\n", err);
	return r;
}

/* fio on the file's data area: bandwidth in bytes/s, or < 0. */
static double fio_run(const struct dopts *o, int write, int direct, uint64_t off, uint64_t bytes)
{
	char cmd[2048], *buf = NULL;
	size_t len = 0, cap = 0;
	double bw = -1;

	snprintf(cmd, sizeof(cmd), "fio --name=kvtier-%s --filename='%s' --rw=%s --bs=%" PRIu64
		 " --direct=%d --ioengine=io_uring --iodepth=%u --offset=%" PRIu64 " --size=%"
		 PRIu64 " --numjobs=1 --output-format=json 2>/dev/null", write ? "write" : "read",
		 o->file, write ? "write" : "read", o->shard, direct, o->depth, off, bytes);
	FILE *p = popen(cmd, "r");
	if (!p)
		return -1;
	for (;;) {
		if (len + 4096 > cap) {
			cap = cap ? cap * 2 : 65536;
			char *nb = realloc(buf, cap);
			if (!nb)
				break;
			buf = nb;
		}
		size_t got = fread(buf + len, 1, cap - len - 1, p);
		if (!got)
			break;
		len += got;
	}
	int st = pclose(p);
	if (buf && WIFEXITED(st) && WEXITSTATUS(st) == 0) {
		buf[len] = 0;
		/* fio may print notes before the JSON */
		char *j = strchr(buf, '{');
		struct json_object *root = j ? json_tokener_parse(j) : NULL, *jobs, *job, *dir, *b;
		if (root && json_object_object_get_ex(root, "jobs", &jobs) &&
		    json_object_array_length(jobs) > 0 &&
		    (job = json_object_array_get_idx(jobs, 0)) &&
		    json_object_object_get_ex(job, write ? "write" : "read", &dir) &&
		    json_object_object_get_ex(dir, "bw_bytes", &b))
			bw = json_object_get_double(b);
		if (root)
			json_object_put(root);
	}
	free(buf);
	return bw;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kvtier-bench disk [options]\n"
		"\n"
		"The disk tier's demotion (arena -> disk) and promotion (disk -> arena, checksums\n"
		"verified, chunks published) bandwidth through the engine kvtierd runs, and fio\n"
		"(io_uring, direct) on the same file, block size and depth as the ceiling.\n"
		"\n"
		"  --file PATH       the disk file (default kvtier-bench-disk.img here; formatted,\n"
		"                    removed at the end unless --keep)\n"
		"  --chunks N        chunks (default 512)\n"
		"  --world W         shards per chunk (default 4)\n"
		"  --shard-kib K     bytes of one shard: one I/O (default 1024)\n"
		"  --depth D         I/Os in flight (default 64)\n"
		"  --direct MODE     auto | on | off (default auto)\n"
		"  --repeat R        rounds, each kvtier write, read, then fio write, read;\n"
		"                    medians reported (default 3)\n"
		"  --no-fio          skip the fio ceiling\n"
		"  --keep            keep the file\n"
		"  --json            one JSON object\n");
}

int kvt_bench_disk(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "file", required_argument, NULL, 'f' }, { "chunks", required_argument, NULL, 'n' },
		{ "world", required_argument, NULL, 'w' }, { "shard-kib", required_argument, NULL, 's' },
		{ "depth", required_argument, NULL, 'd' }, { "direct", required_argument, NULL, 'D' },
		{ "no-fio", no_argument, NULL, 'F' }, { "keep", no_argument, NULL, 'k' },
		{ "json", no_argument, NULL, 'j' }, { "help", no_argument, NULL, 'h' },
		{ "repeat", required_argument, NULL, 'r' },
		{ NULL, 0, NULL, 0 } };
	struct dopts o = { .file = "kvtier-bench-disk.img", .chunks = 512, .world = 4,
			   .depth = 64, .shard = 1 << 20, .fio = 1, .repeat = 3 };
	char name[64];
	int c, rc = 1;
	unsigned long v;

	optind = 1;
	while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		switch (c) {
		case 'f': o.file = optarg; break;
		case 'n': o.chunks = (uint32_t)strtoul(optarg, NULL, 10); break;
		case 'w': o.world = (uint32_t)strtoul(optarg, NULL, 10); break;
		case 's':
			v = strtoul(optarg, NULL, 10);
			o.shard = (uint64_t)v << 10;
			break;
		case 'd': o.depth = (uint32_t)strtoul(optarg, NULL, 10); break;
		case 'D':
			if (kvt_disk_direct_parse(optarg, &o.direct)) {
				fprintf(stderr, "kvtier-bench disk: --direct %s: auto, on or off\n", optarg);
				return 2;
			}
			break;
		case 'F': o.fio = 0; break;
		case 'k': o.keep = 1; break;
		case 'j': o.json = 1; break;
		case 'r': o.repeat = (uint32_t)strtoul(optarg, NULL, 10); break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (!o.chunks || o.chunks > (1u << 20) || !o.world || o.world > 64 || !o.depth ||
	    o.depth > 4096 || o.shard < 16384 || o.shard % 16384 || o.shard > (256u << 20) ||
	    !o.repeat || o.repeat > 16) {
		fprintf(stderr, "kvtier-bench disk: chunks 1..2^20, world 1..64, depth 1..4096, "
			"--shard-kib a multiple of 16 (16..262144), --repeat 1..16\n");
		return 2;
	}
	snprintf(name, sizeof(name), "kvt-bench-disk-%d", (int)getpid());
	/* twice the chunks: kvtier's chunks in the first half of the data
	 * area, fio's in the second (each read then follows the other's write,
	 * and fio never overwrites what kvtier reads back) */
	uint64_t eb = o.shard * o.world, bytes = (4ULL << 20) + 2ULL * o.chunks * (eb + 64);
	uint64_t total = (uint64_t)o.chunks * eb;
	kvt_seg *s = NULL;
	kvt_disk *d = NULL;
	struct kvt_disk_info info;
	uint64_t plan = 0;
	char err[512];

	if (kvt_disk_plan(o.file, bytes, o.shard, o.world, &plan, err, sizeof(err))) {
		fprintf(stderr, "kvtier-bench disk: %s\n", err);
		return 2;
	}
	/* the file holds `plan` >= chunks chunks: the index holds them all */
	if (make_seg(name, &o, (uint32_t)plan, &s) || fill(s, o.chunks))
		goto out;
	int have_fio = o.fio && system("command -v fio >/dev/null 2>&1") == 0;
	double ws[16], rs[16], fws[16], frs[16];
	uint64_t bad = 0;
	for (uint32_t rep = 0; rep < o.repeat; rep++) {
		/* 1. demotion: a new file, every chunk of the filled segment */
		unlink(o.file);
		if (engine(s, &o, bytes, &d))
			goto out;
		kvt_disk_info(d, &info);
		uint64_t w0[KVT_C__COUNT], w[KVT_C__COUNT];
		kvt_counters_read(s, w0);
		uint64_t t0 = kvt__now_ns();
		int r = kvt_disk_drain(d, 1, 600LL * 1000000000LL);
		ws[rep] = (double)total / ((double)(kvt__now_ns() - t0) / 1e9);
		kvt_counters_read(s, w);
		if (r || w[KVT_C_DISK_WRITES] - w0[KVT_C_DISK_WRITES] != o.chunks) {
			fprintf(stderr, "kvtier-bench disk: demotion wrote %" PRIu64 " of %u chunks "
				"(%s)\n", w[KVT_C_DISK_WRITES] - w0[KVT_C_DISK_WRITES], o.chunks,
				r ? strerror(-r) : "drops");
			goto out;
		}
		kvt_disk_close(d);
		d = NULL;

		/* 2. promotion, after a restart on a fresh segment */
		kvt_seg *sr = NULL;
		char sname[64];
		snprintf(sname, sizeof(sname), "%.40s-r", name);
		if (make_seg(sname, &o, (uint32_t)plan, &sr))
			goto out;
		if (engine(sr, &o, bytes, &d)) {
			kvt_seg_detach(sr);
			kvt_seg_unlink(sname, NULL);
			goto out;
		}
		struct kvt_disk_info info2;
		kvt_disk_info(d, &info2);
		if (info2.replayed != o.chunks) {
			fprintf(stderr, "kvtier-bench disk: restart replayed %" PRIu64 " of %u "
				"chunks\n", info2.replayed, o.chunks);
			kvt_disk_close(d);
			d = NULL;
			kvt_seg_detach(sr);
			kvt_seg_unlink(sname, NULL);
			goto out;
		}
		/* 3a. fio's write, on the second half, while kvtier's data rests */
		fws[rep] = frs[rep] = -1;
		if (have_fio)
			fws[rep] = fio_run(&o, 1, (int)info.direct, info.data_off + total, total);
		sleep(1); /* both reads start after a second's rest */
		t0 = kvt__now_ns();
		uint32_t next = 0;
		uint64_t rd[KVT_C__COUNT];
		int ok = 1;
		for (;;) {
			while (next < o.chunks) {
				kvt_key k = bkey(next);
				struct kvt_disk_ref ref;
				if (!kvt_disk_find(sr, &k, &ref)) {
					fprintf(stderr, "kvtier-bench disk: chunk %u not on disk\n", next);
					ok = 0;
					break;
				}
				if (kvt_disk_request(sr, &ref))
					break; /* ring full: let the engine take some */
				next++;
			}
			kvt_disk_poll(d);
			kvt_counters_read(sr, rd);
			if (!ok || (rd[KVT_C_DISK_READS] + rd[KVT_C_DISK_CSUM_ERRORS] >= o.chunks &&
				    next == o.chunks))
				break;
			if (kvt__now_ns() - t0 > 600ULL * 1000000000ULL) {
				fprintf(stderr, "kvtier-bench disk: promotion timed out\n");
				ok = 0;
				break;
			}
			struct pollfd p = { .fd = kvt_disk_event_fd(d), .events = POLLIN };
			if (p.fd >= 0)
				poll(&p, 1, 1);
		}
		rs[rep] = (double)total / ((double)(kvt__now_ns() - t0) / 1e9);
		if (ok)
			bad += verify(sr, o.chunks) + rd[KVT_C_DISK_CSUM_ERRORS];
		kvt_disk_close(d);
		d = NULL;
		kvt_seg_detach(sr);
		kvt_seg_unlink(sname, NULL);
		if (!ok)
			goto out;

		/* 3b. fio's read of what it wrote */
		if (have_fio) {
			sleep(1);
			frs[rep] = fio_run(&o, 0, (int)info.direct, info.data_off + total, total);
		}
	}
	double kw = median(ws, o.repeat), kr = median(rs, o.repeat);
	double fw = median(fws, o.repeat), fr = median(frs, o.repeat);

	if (o.json) {
		printf("{\"bench\":\"disk\",\"chunks\":%u,\"world\":%u,\"shard_bytes\":%" PRIu64
		       ",\"depth\":%u,\"direct\":%s,\"fixed_buffers\":%s,\"bytes\":%" PRIu64
		       ",\"write_gbps\":%.3f,\"read_gbps\":%.3f,\"fio_write_gbps\":%.3f,"
		       "\"fio_read_gbps\":%.3f,\"write_ratio\":%.3f,\"read_ratio\":%.3f,"
		       "\"wrong_chunks\":%" PRIu64 "}\n", o.chunks, o.world, o.shard, o.depth,
		       info.direct ? "true" : "false", info.fixed_buffers ? "true" : "false", total,
		       kw / 1e9, kr / 1e9, fw / 1e9, fr / 1e9, fw > 0 ? kw / fw : 0,
		       fr > 0 ? kr / fr : 0, bad);
	} else {
		printf("kvtier-bench disk: %s, %u chunks x %u shards x %" PRIu64 " KiB = %.2f GiB, "
		       "depth %u, %s I/O, %s; medians of %u rounds\n", o.file, o.chunks, o.world,
		       o.shard >> 10,
		       (double)total / (double)(1ULL << 30), o.depth,
		       info.direct ? "direct" : "buffered (page cache!)",
		       info.fixed_buffers ? "fixed buffers" : "plain buffers", o.repeat);
		printf("  %-28s %10s %10s %8s\n", "", "kvtier", "fio", "ratio");
		if (have_fio) {
			printf("  %-28s %8.2f GB/s %6.2f GB/s %7.3f\n", "demotion (write)", kw / 1e9,
			       fw / 1e9, fw > 0 ? kw / fw : 0);
			printf("  %-28s %8.2f GB/s %6.2f GB/s %7.3f\n", "promotion (read + verify)",
			       kr / 1e9, fr / 1e9, fr > 0 ? kr / fr : 0);
		} else {
			printf("  %-28s %8.2f GB/s   (no fio: %s)\n", "demotion (write)", kw / 1e9,
			       o.fio ? "not installed" : "--no-fio");
			printf("  %-28s %8.2f GB/s\n", "promotion (read + verify)", kr / 1e9);
		}
		printf("  promoted chunks checked word by word: %u x %u rounds, wrong: %" PRIu64 "\n",
		       o.chunks, o.repeat, bad);
		double mac;
		if (!kvt_disk_mac_rate(o.shard * o.world, 0.3, &mac))
			printf("  chunk MAC (ChaCha20-Poly1305, the engine's one thread): %.1f GB/s on "
			       "%" PRIu64 " KiB chunks\n", mac / 1e9, o.shard * o.world >> 10);
		if (o.repeat > 1) {
			printf("  rounds (GB/s, sorted):");
			for (uint32_t i = 0; i < o.repeat; i++)
				printf(" w %.2f/%.2f r %.2f/%.2f%s", ws[i] / 1e9, fws[i] / 1e9, rs[i] / 1e9,
				       frs[i] / 1e9, i + 1 < o.repeat ? "," : "\n");
		}
		printf("  fio: ioengine=io_uring direct=%u rw=write/read bs=%" PRIu64 " iodepth=%u "
		       "on the same file (the second half of its data area)\n", info.direct,
		       o.shard, o.depth);
	}
	rc = bad ? 1 : 0;
out:
	kvt_disk_close(d);
	if (s)
		kvt_seg_detach(s);
	kvt_seg_unlink(name, NULL);
	if (!o.keep)
		unlink(o.file);
	return rc;
}

/* ---- kvtier-bench diskkill: the disk tier under kill -9 ----
 *
 * One segment (few slots, many more keys: eviction, demotion and promotion
 * never stop), the disk engine in a process of its own and C client
 * processes that look keys up, ask the disk for what it holds and save
 * what nobody has, all on a disk file.  Every hit is checked word for word
 * against its key's stamp (so every promoted chunk that is looked up is);
 * the parent kills the engine or a client at random (-9) and starts it
 * again, reaping as kvtierd would.  At the end, everything killed, reaped
 * and every READY chunk checked once more, kvt_check clean.  Exit 0 only
 * with 0 wrong words.
 */
struct kstats {
	_Atomic uint64_t verified, wrong, saved, asked, errors;
};

static uint64_t rnd(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

/* The wrong words of key i's chunk in slot x (all shards). */
static uint64_t chunk_wrong(kvt_seg *s, uint32_t x, uint64_t i)
{
	kvt_key k = bkey(i);
	uint64_t bad = 0;

	for (uint32_t sh = 0; sh < kvt_seg_n_shards(s); sh++) {
		const uint64_t *q = kvt_slot_shard_ptr(s, x, sh);
		for (uint64_t j = 0; j < kvt_seg_chunk_bytes(s) / 8; j++)
			bad += q[j] != stamp_word(k.lo, sh, j);
	}
	return bad;
}

/* Looks key i up: 1 (hit, checked), 0 (miss), < 0 error. */
static int kk_check(kvt_seg *s, uint64_t i, struct kstats *st)
{
	kvt_key k = bkey(i);
	uint64_t lease, gen;
	uint32_t x;
	int r = kvt_seg_lookup(s, &k, 1, &lease);

	if (r != 1)
		return r < 0 ? r : 0;
	if (kvt_lease_slots(s, lease, &x, &gen, 1) == 1) {
		uint64_t bad = chunk_wrong(s, x, i);
		if (bad && atomic_fetch_add(&st->wrong, bad) == 0)
			fprintf(stderr, "diskkill: key %" PRIu64 " in slot %u: %" PRIu64
				" wrong words\n", i, x, bad);
		atomic_fetch_add(&st->verified, 1);
	}
	kvt_lease_release(s, lease);
	return 1;
}

static int kk_client(const char *name, uint64_t keys, uint64_t seed, struct kstats *st)
{
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = name,
					 .role = KVT_ROLE_CLIENT };
	kvt_seg *s;

	if (kvt_seg_attach(&a, &s))
		return 3;
	for (;;) {
		uint64_t i = rnd(&seed) % keys;
		kvt_key k = bkey(i);
		struct kvt_disk_ref ref;
		int r = kk_check(s, i, st);
		if (r)
			continue;
		if (kvt_disk_online(s) && kvt_disk_find(s, &k, &ref) == 1) {
			if (kvt_disk_request(s, &ref) == 0)
				atomic_fetch_add(&st->asked, 1);
			continue;
		}
		for (uint32_t sh = 0; sh < kvt_seg_n_shards(s); sh++) {
			struct kvt_wref w;
			r = kvt_write_begin(s, &k, 0, sh, &w);
			if (r)
				break; /* being saved (skip), or no slot now */
			uint64_t *q = kvt_slot_shard_ptr(s, w.slot, sh);
			for (uint64_t j = 0; j < kvt_seg_chunk_bytes(s) / 8; j++)
				q[j] = stamp_word(k.lo, sh, j);
			if (kvt_write_end(s, &w, 1) > 0)
				atomic_fetch_add(&st->saved, 1);
		}
	}
}

static void kk_log(int level, const char *msg, void *arg)
{
	(void)arg;
	if (level > 0) /* the warnings; every restart's plan would flood */
		fprintf(stderr, "diskkill: engine: %s\n", msg);
}

static int kk_engine(const char *name, const char *file, uint64_t bytes, uint32_t depth)
{
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = name,
					 .role = KVT_ROLE_CLIENT };
	struct kvt_disk_opts dop = { .size = sizeof(dop), .path = file, .bytes = bytes,
				     .depth = depth, .log = kk_log };
	char err[512];
	kvt_seg *s;
	kvt_disk *d;

	/* the last engine's reads may still hold the segment for a while */
	if (kvt_seg_attach(&a, &s) || kvt_seg_own_wait(s, 30000)) {
		fprintf(stderr, "diskkill: engine: %s\n", kvt_core_last_error());
		return 3;
	}
	if (kvt_disk_open(s, &dop, &d, err, sizeof(err))) {
		fprintf(stderr, "diskkill: engine: %s\n", err);
		return 4;
	}
	for (;;)
		if (kvt_disk_poll(d) == 0) {
			struct pollfd p = { .fd = kvt_disk_event_fd(d), .events = POLLIN };
			(void)poll(&p, p.fd >= 0 ? 1 : 0, 1);
		}
}

static pid_t kk_spawn(int who, const char *name, const char *file, uint64_t bytes,
		      uint64_t keys, uint64_t seed, struct kstats *st)
{
	fflush(NULL);
	pid_t p = fork();
	if (p == 0)
		_exit(who < 0 ? kk_engine(name, file, bytes, 16)
			      : kk_client(name, keys, seed ^ ((uint64_t)who << 40) ^
					  (uint64_t)getpid(), st));
	return p;
}

static void kk_usage(FILE *f)
{
	fprintf(f,
		"usage: kvtier-bench diskkill [options]\n"
		"\n"
		"The disk tier under kill -9: an engine process and client processes on one\n"
		"segment and disk file, the engine or a client killed at random and restarted;\n"
		"every hit (promoted chunks among them) checked word for word.  Exit 0 only with\n"
		"0 wrong words and kvt_check clean.\n"
		"\n"
		"  --kills N       kills before the end (default 300)\n"
		"  --clients C     client processes (default 2)\n"
		"  --slots N       DRAM chunks (default 32)\n"
		"  --keys N        distinct chunks asked for (default 256)\n"
		"  --file PATH     the disk file (default kvtier-bench-diskkill.img here; removed)\n"
		"  --seed S        the run's seed (default: from the clock; printed)\n"
		"  --json          one JSON object\n");
}

int kvt_bench_diskkill(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "kills", required_argument, NULL, 'k' }, { "clients", required_argument, NULL, 'c' },
		{ "slots", required_argument, NULL, 's' }, { "keys", required_argument, NULL, 'n' },
		{ "file", required_argument, NULL, 'f' }, { "seed", required_argument, NULL, 'S' },
		{ "json", no_argument, NULL, 'j' }, { "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 } };
	uint64_t kills = 300, clients = 2, keys = 256, seed = kvt__now_ns() ^ (uint64_t)getpid();
	struct dopts o = { .file = "kvtier-bench-diskkill.img", .chunks = 32, .world = 2,
			   .depth = 16, .shard = 64 << 10 };
	int c, json = 0;
	char *end;

	optind = 1;
	while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		unsigned long long v = optarg ? strtoull(optarg, &end, 0) : 0;
		int bad = optarg && (!*optarg || *end);
		switch (c) {
		case 'k': kills = v; bad |= v < 1 || v > 10000000; break;
		case 'c': clients = v; bad |= v < 1 || v > 16; break;
		case 's': o.chunks = (uint32_t)v; bad |= v < 4 || v > 65536; break;
		case 'n': keys = v; bad |= v < 1 || v > 1000000; break;
		case 'f': o.file = optarg; bad = 0; break;
		case 'S': seed = v ? v : 1; break;
		case 'j': json = 1; break;
		case 'h': kk_usage(stdout); return 0;
		default: kk_usage(stderr); return 2;
		}
		if (bad) {
			const char *opt = "?";
			for (const struct option *x = lo; x->name; x++)
				if (x->val == c)
					opt = x->name;
			fprintf(stderr, "diskkill: --%s '%s': not a number in range\n", opt, optarg);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "diskkill: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	char name[64];
	snprintf(name, sizeof(name), "kvtier-bench-diskkill-%d", (int)getpid());
	/* a disk that holds about half the keys: it evicts too */
	uint64_t bytes = (keys / 2 + 1) * o.world * o.shard + (1u << 20), disk_chunks;
	char err[512];
	kvt_seg *s;
	unlink(o.file);
	if (kvt_disk_plan(o.file, bytes, o.shard, o.world, &disk_chunks, err, sizeof(err))) {
		fprintf(stderr, "diskkill: %s\n", err);
		return 1;
	}
	if (make_seg(name, &o, (uint32_t)disk_chunks, &s))
		return 1;
	kvt_seg_detach(s); /* gives ownership up: the engine process owns it */
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = name,
					 .role = KVT_ROLE_CLIENT };
	if (kvt_seg_attach(&a, &s)) {
		fprintf(stderr, "diskkill: %s\n", kvt_core_last_error());
		kvt_seg_unlink(name, NULL);
		return 1;
	}
	struct kstats *st = mmap(NULL, sizeof(*st), PROT_READ | PROT_WRITE,
				 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (st == MAP_FAILED)
		return 1;
	memset(st, 0, sizeof(*st));
	fprintf(stderr, "diskkill: %" PRIu64 " kills, %" PRIu64 " clients, %u slots, %" PRIu64
		" keys, seed %#" PRIx64 " (--seed to repeat)\n", kills, clients, o.chunks, keys,
		seed);
	pid_t pids[17];
	uint64_t ekills = 0, ckills = 0, rng = seed, t0 = kvt__now_ns();
	for (uint64_t w = 0; w <= clients; w++)
		pids[w] = kk_spawn(w == 0 ? -1 : (int)w, name, o.file, bytes, keys, seed, st);
	int rc = 0;
	for (uint64_t n = 0; n < kills && !rc; n++) {
		struct timespec ts = { 0, (long)(2000000 + rnd(&rng) % 28000000) };
		nanosleep(&ts, NULL);
		(void)kvt_seg_reap(s);
		uint64_t w = rnd(&rng) % 3 == 0 ? 0 : 1 + rnd(&rng) % clients;
		int wst;
		/* one that exited by itself (an error) ends the run */
		for (uint64_t x = 0; x <= clients; x++)
			if (waitpid(pids[x], &wst, WNOHANG) == pids[x]) {
				fprintf(stderr, "diskkill: %s %" PRIu64 " exited (status %d)\n",
					x ? "client" : "engine", x, wst);
				pids[x] = kk_spawn(x == 0 ? -1 : (int)x, name, o.file, bytes, keys,
						   seed + n, st);
				rc = 1;
			}
		kvt_kill_pid(pids[w], SIGKILL);
		(void)waitpid(pids[w], &wst, 0);
		if (w == 0)
			ekills++;
		else
			ckills++;
		pids[w] = kk_spawn(w == 0 ? -1 : (int)w, name, o.file, bytes, keys, seed + n, st);
	}
	for (uint64_t x = 0; x <= clients; x++) {
		kvt_kill_pid(pids[x], SIGKILL);
		(void)waitpid(pids[x], NULL, 0);
	}
	/* The dead engine's reads may hold its entry until they land. */
	for (int i = 0; i < 30000; i++) {
		struct kvt_disk_status ds;
		int r = kvt_seg_reap(s);
		if (r == 0 && kvt_seg_live_ranks(s) >= 0 && kvt_seg_owner(s) == 0 &&
		    kvt_disk_status_read(s, &ds) == 0)
			break;
		usleep(1000);
	}
	for (uint64_t i = 0; i < keys; i++)
		(void)kk_check(s, i, st);
	char msg[256];
	int chk = kvt_check(s, msg, sizeof(msg));
	uint64_t ctr[KVT_C__COUNT];
	kvt_counters_read(s, ctr);
	double secs = (double)(kvt__now_ns() - t0) / 1e9;
	if (json)
		printf("{\"kills\": %" PRIu64 ", \"engine_kills\": %" PRIu64 ", \"client_kills\": %"
		       PRIu64 ", \"seconds\": %.1f, \"seed\": %" PRIu64 ", \"verified\": %" PRIu64
		       ", \"wrong_words\": %" PRIu64 ", \"demoted\": %" PRIu64 ", \"promoted\": %"
		       PRIu64 ", \"asked\": %" PRIu64 ", \"checksum_errors\": %" PRIu64
		       ", \"write_drops\": %" PRIu64 ", \"check\": %s}\n", ekills + ckills, ekills,
		       ckills, secs, seed, (uint64_t)st->verified, (uint64_t)st->wrong,
		       ctr[KVT_C_DISK_WRITES], ctr[KVT_C_DISK_READS], (uint64_t)st->asked,
		       ctr[KVT_C_DISK_CSUM_ERRORS], ctr[KVT_C_DISK_WRITE_DROPS],
		       chk ? "false" : "true");
	else
		printf("kvtier-bench diskkill: %" PRIu64 " kills (%" PRIu64 " of the engine, %" PRIu64
		       " of clients) in %.1f s, seed %#" PRIx64 "\n"
		       "  %" PRIu64 " chunks demoted, %" PRIu64 " promoted (%" PRIu64 " asked), %" PRIu64
		       " saved by clients; %" PRIu64 " demotions dropped, %" PRIu64 " checksum misses\n"
		       "  %" PRIu64 " hits checked word for word: %" PRIu64 " wrong words; kvt_check %s\n",
		       ekills + ckills, ekills, ckills, secs, seed, ctr[KVT_C_DISK_WRITES],
		       ctr[KVT_C_DISK_READS], (uint64_t)st->asked, (uint64_t)st->saved,
		       ctr[KVT_C_DISK_WRITE_DROPS], ctr[KVT_C_DISK_CSUM_ERRORS],
		       (uint64_t)st->verified, (uint64_t)st->wrong, chk ? msg : "clean");
	if (st->wrong || chk)
		rc = 1;
	if (!ctr[KVT_C_DISK_READS] || !st->verified) {
		fprintf(stderr, "diskkill: nothing was promoted or checked: the run proves nothing\n");
		rc = 1;
	}
	kvt_seg_detach(s);
	kvt_seg_unlink(name, NULL);
	unlink(o.file);
	munmap(st, sizeof(*st));
	return rc;
}
