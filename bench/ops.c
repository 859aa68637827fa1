/* ops.c - kvtier-bench ops: what the segment's metadata operations cost per
 * chunk.
 *
 * Creates its own segment (default name kvtier-bench-<pid>, removed at
 * exit), by default world 1 with 131072 slots of 8 KiB (1 GiB, over 10^5
 * chunks), fills every slot with a READY chunk, then measures:
 *
 *   save, new chunk      kvt_write_begin + kvt_write_end of a key not yet
 *                        stored, into a free slot (the fill itself, after
 *                        its first eighth, which faults the metadata pages
 *                        in and is not timed);
 *   save, dedupe skip    kvt_write_begin of a key already stored;
 *   lookup+pin+release   kvt_seg_lookup of N consecutive stored keys (pins
 *                        each, records a lease) + kvt_lease_release, per
 *                        chunk, in 1 and 2 processes at once, each with its
 *                        own CLIENT handle (aggregate chunks/s too);
 *   save, evicting       kvt_write_begin + kvt_write_end of new keys into a
 *                        full arena: each one evicts a chunk (CLOCK sweep).
 *
 * Only metadata is measured: the payload bytes are neither written nor
 * read (that is `kvtier-bench bandwidth`).  Times are CLOCK_MONOTONIC; a
 * process measures its own loop, after a warm-up that maps in the pages.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvt_core.h"
#include "bench_util.h"

#define TARGET_NS   100.0 /* lookup+pin+release, per chunk, one process */
#define MAX_PROCS   8
#define MAX_CPL     4096
#define KEY_HI      0x6b76746965726f70ULL

struct opts {
	char name[KVT_NAME_MAX + 1];
	uint32_t slots;
	uint64_t chunk_bytes;
	uint32_t procs[MAX_PROCS];
	uint32_t n_procs;
	uint32_t cpl;       /* chunks per lookup */
	double seconds;     /* per lookup measurement */
	uint64_t iters;     /* lookups per process, instead of seconds */
	int json;
};

/* One process's result, in memory shared with the parent. */
struct child_res {
	_Atomic int ready;
	uint64_t chunks, ns, lookups, errors;
	char err[160];
};

struct shared {
	_Atomic int go;
	struct child_res c[MAX_PROCS];
};

struct row {
	const char *op;
	uint32_t procs;
	uint64_t chunks;          /* all processes */
	double ns_per_chunk[MAX_PROCS];
	double agg_per_s;         /* chunks per second, all processes */
};


static void usage(FILE *f)
{
	fprintf(f,
		"usage: kvtier-bench ops [options]\n"
		"  --slots N              chunks the arena holds (default 131072)\n"
		"  --chunk-bytes B        bytes of one chunk, a multiple of 16 (default 8192)\n"
		"  --procs LIST           process counts to measure lookups with (default 1,2)\n"
		"  --chunks-per-lookup N  keys per kvt_seg_lookup (default 16)\n"
		"  --seconds S            length of each lookup measurement (default 2)\n"
		"  --iters N              lookups per process instead of --seconds\n"
		"  --name NAME            segment name (default kvtier-bench-<pid>)\n"
		"  --json                 one JSON object instead of the table\n");
}

static int parse_procs(const char *s, struct opts *o)
{
	char buf[128], *save = NULL, *tok;

	snprintf(buf, sizeof(buf), "%s", s);
	o->n_procs = 0;
	for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		char *end;
		unsigned long v = strtoul(tok, &end, 10);
		if (*end || v < 1 || v > MAX_PROCS || o->n_procs == MAX_PROCS)
			return -1;
		o->procs[o->n_procs++] = (uint32_t)v;
	}
	return o->n_procs ? 0 : -1;
}

static int parse(int argc, char **argv, struct opts *o)
{
	static const struct option lo[] = {
		{ "slots", required_argument, NULL, 's' },
		{ "chunk-bytes", required_argument, NULL, 'b' },
		{ "procs", required_argument, NULL, 'p' },
		{ "chunks-per-lookup", required_argument, NULL, 'c' },
		{ "seconds", required_argument, NULL, 't' },
		{ "iters", required_argument, NULL, 'i' },
		{ "name", required_argument, NULL, 'n' },
		{ "json", no_argument, NULL, 'j' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int c;

	*o = (struct opts){ .slots = 131072, .chunk_bytes = 8192, .procs = { 1, 2 },
			    .n_procs = 2, .cpl = 16, .seconds = 2.0 };
	snprintf(o->name, sizeof(o->name), "kvtier-bench-%d", (int)getpid());
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		char *end = NULL;
		switch (c) {
		case 's': o->slots = (uint32_t)strtoul(optarg, &end, 0); break;
		case 'b': o->chunk_bytes = strtoull(optarg, &end, 0); break;
		case 'p':
			if (parse_procs(optarg, o)) {
				fprintf(stderr, "ops: --procs takes a list of 1..%d\n", MAX_PROCS);
				return 2;
			}
			break;
		case 'c': o->cpl = (uint32_t)strtoul(optarg, &end, 0); break;
		case 't': o->seconds = strtod(optarg, &end); break;
		case 'i': o->iters = strtoull(optarg, &end, 0); break;
		case 'n': snprintf(o->name, sizeof(o->name), "%s", optarg); break;
		case 'j': o->json = 1; break;
		case 'h': usage(stdout); return 1;
		default: usage(stderr); return 2;
		}
		if (end && *end) {
			fprintf(stderr, "ops: bad number '%s'\n", optarg);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "ops: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	if (o->chunk_bytes < 16 || o->chunk_bytes % 16 || o->chunk_bytes / 16 > (1u << 20)) {
		fprintf(stderr, "ops: --chunk-bytes must be a multiple of 16, at most 16 MiB\n");
		return 2;
	}
	if (o->cpl < 1 || o->cpl > MAX_CPL || o->cpl > o->slots) {
		fprintf(stderr, "ops: --chunks-per-lookup must be 1..%d and at most --slots\n",
			MAX_CPL);
		return 2;
	}
	if (o->slots < 2 || o->seconds <= 0) {
		fprintf(stderr, "ops: --slots must be >= 2 and --seconds > 0\n");
		return 2;
	}
	return 0;
}

static kvt_key key_of(uint64_t i)
{
	kvt_key k = { i, KEY_HI };
	return k;
}

/* Saves keys [from, to) through s; returns the ns it took, or 0 and a
 * message on a result other than `expect`. */
static uint64_t save_range(kvt_seg *s, uint64_t from, uint64_t to, int expect)
{
	uint64_t t0 = kvt__now_ns();

	for (uint64_t i = from; i < to; i++) {
		kvt_key k = key_of(i);
		struct kvt_wref w;
		int r = kvt_write_begin(s, &k, (uint32_t)(i % 64), 0, &w);
		if (r != expect) {
			fprintf(stderr, "ops: write_begin of key %" PRIu64 " = %d (%s), expected %d\n",
				i, r, kvt_core_last_error(), expect);
			return 0;
		}
		if (r == 0 && (r = kvt_write_end(s, &w, 1)) != 1) {
			fprintf(stderr, "ops: write_end of key %" PRIu64 " = %d (%s)\n", i, r,
				kvt_core_last_error());
			return 0;
		}
	}
	return kvt__now_ns() - t0;
}

/* One lookup+pin+release; returns the chunks hit (all of them, or error). */
static int lookup_release(kvt_seg *s, const struct opts *o, uint64_t *rng, kvt_key *keys)
{
	uint64_t start = rnd(rng) % (o->slots - o->cpl + 1), lease = 0;
	int hits;

	for (uint32_t i = 0; i < o->cpl; i++) {
		keys[i].lo = start + i;
		keys[i].hi = KEY_HI;
	}
	hits = kvt_seg_lookup(s, keys, o->cpl, &lease);
	if (hits > 0 && kvt_lease_release(s, lease) != 0)
		return -EUCLEAN;
	return hits;
}

static void child_run(const struct opts *o, struct shared *sh, uint32_t id)
{
	struct child_res *cr = &sh->c[id];
	struct kvt_seg_attach_opts a = {
		.size = sizeof(a), .name = o->name, .role = KVT_ROLE_CLIENT };
	kvt_key keys[MAX_CPL];
	uint64_t rng = 0x5eed0000ULL + id * 7919, n = 0, t0, t1, warm;
	kvt_seg *s;
	int r;

	if ((r = kvt_seg_attach(&a, &s)) != 0) {
		snprintf(cr->err, sizeof(cr->err), "attach: %s", kvt_core_last_error());
		cr->errors = 1;
		atomic_store(&cr->ready, 1);
		return;
	}
	/* Warm-up: map the index, slot and lease pages into this process
	 * (every key once, in order), then run a while. */
	for (uint64_t k0 = 0; k0 + o->cpl <= o->slots; k0 += o->cpl) {
		uint64_t lease = 0;
		for (uint32_t i = 0; i < o->cpl; i++)
			keys[i] = key_of(k0 + i);
		if (kvt_seg_lookup(s, keys, o->cpl, &lease) > 0)
			kvt_lease_release(s, lease);
	}
	for (uint32_t i = 0; i < 1024; i++)
		(void)lookup_release(s, o, &rng, keys); /* the whole lease table */
	warm = kvt__now_ns() + 100000000ULL;
	while (kvt__now_ns() < warm)
		for (int k = 0; k < 64; k++)
			(void)lookup_release(s, o, &rng, keys);
	atomic_store(&cr->ready, 1);
	while (!atomic_load(&sh->go))
		;
	t0 = kvt__now_ns();
	t1 = t0 + (uint64_t)(o->seconds * 1e9);
	for (;;) {
		for (int k = 0; k < 64; k++) {
			r = lookup_release(s, o, &rng, keys);
			if (r != (int)o->cpl) {
				if (!cr->errors)
					snprintf(cr->err, sizeof(cr->err), "lookup hit %d of %u: %s",
						 r, o->cpl, kvt_core_last_error());
				cr->errors++;
			}
			n++;
		}
		if (o->iters ? n >= o->iters : kvt__now_ns() >= t1)
			break;
	}
	cr->ns = kvt__now_ns() - t0;
	cr->lookups = n;
	cr->chunks = n * o->cpl;
	kvt_seg_detach(s);
}

/* Runs the lookup measurement in `procs` processes at once. */
static int measure_lookups(const struct opts *o, struct shared *sh, uint32_t procs,
			   struct row *row)
{
	pid_t pid[MAX_PROCS];
	uint64_t max_ns = 0;
	int bad = 0;

	memset(sh, 0, sizeof(*sh));
	for (uint32_t i = 0; i < procs; i++) {
		pid[i] = fork();
		if (pid[i] < 0) {
			perror("ops: fork");
			return -1;
		}
		if (pid[i] == 0) {
			signal(SIGINT, SIG_DFL);
			signal(SIGTERM, SIG_DFL);
			child_run(o, sh, i);
			_exit(0);
		}
	}
	for (uint32_t i = 0; i < procs; i++)
		while (!atomic_load(&sh->c[i].ready))
			usleep(1000);
	atomic_store(&sh->go, 1);
	for (uint32_t i = 0; i < procs; i++) {
		int ws = 0;
		waitpid(pid[i], &ws, 0);
		if (!WIFEXITED(ws) || WEXITSTATUS(ws)) {
			fprintf(stderr, "ops: lookup process %u failed\n", i);
			bad = 1;
		}
	}
	memset(row, 0, sizeof(*row));
	row->op = "lookup+pin+release";
	row->procs = procs;
	for (uint32_t i = 0; i < procs; i++) {
		struct child_res *cr = &sh->c[i];
		if (cr->errors) {
			fprintf(stderr, "ops: process %u: %" PRIu64 " failed lookups: %s\n", i,
				cr->errors, cr->err);
			bad = 1;
		}
		row->chunks += cr->chunks;
		row->ns_per_chunk[i] = cr->chunks ? (double)cr->ns / (double)cr->chunks : 0;
		if (cr->ns > max_ns)
			max_ns = cr->ns;
	}
	row->agg_per_s = max_ns ? (double)row->chunks * 1e9 / (double)max_ns : 0;
	return bad ? -1 : 0;
}

static void single_row(struct row *row, const char *op, uint64_t chunks, uint64_t ns)
{
	memset(row, 0, sizeof(*row));
	row->op = op;
	row->procs = 1;
	row->chunks = chunks;
	row->ns_per_chunk[0] = (double)ns / (double)chunks;
	row->agg_per_s = (double)chunks * 1e9 / (double)ns;
}

static void print_table(const struct opts *o, const struct row *rows, int n, uint64_t seg_bytes,
			uint64_t shard_bytes)
{
	printf("kvtier-bench ops: segment '%s', %.2f GiB, %u slots x %" PRIu64
	       " B (world 1), %u chunks per lookup, %s\n", o->name,
	       (double)seg_bytes / (1u << 30), o->slots, shard_bytes, o->cpl,
	       o->iters ? "fixed iterations" : "timed runs");
	printf("%-20s %5s %12s  %-24s %14s\n", "operation", "procs", "chunks",
	       "ns/chunk (each process)", "Mchunks/s (all)");
	for (int i = 0; i < n; i++) {
		char per[64] = "";
		size_t len = 0;
		for (uint32_t p = 0; p < rows[i].procs && len < sizeof(per); p++)
			len += (size_t)snprintf(per + len, sizeof(per) - len, "%s%.1f",
						p ? " / " : "", rows[i].ns_per_chunk[p]);
		printf("%-20s %5u %12" PRIu64 "  %-24s %14.2f\n", rows[i].op, rows[i].procs,
		       rows[i].chunks, per, rows[i].agg_per_s / 1e6);
	}
}

static void print_json(const struct opts *o, const struct row *rows, int n, uint64_t seg_bytes,
		       uint64_t shard_bytes, double one, int met)
{
	printf("{\"bench\":\"ops\",\"segment\":{\"name\":\"%s\",\"bytes\":%" PRIu64
	       ",\"slots\":%u,\"chunk_bytes\":%" PRIu64 ",\"world\":1},\"chunks_per_lookup\":%u,"
	       "\"results\":[", o->name, seg_bytes, o->slots, shard_bytes, o->cpl);
	for (int i = 0; i < n; i++) {
		printf("%s{\"op\":\"%s\",\"procs\":%u,\"chunks\":%" PRIu64 ",\"ns_per_chunk\":[",
		       i ? "," : "", rows[i].op, rows[i].procs, rows[i].chunks);
		for (uint32_t p = 0; p < rows[i].procs; p++)
			printf("%s%.2f", p ? "," : "", rows[i].ns_per_chunk[p]);
		printf("],\"chunks_per_s\":%.0f}", rows[i].agg_per_s);
	}
	printf("],\"target_ns_per_chunk\":%.0f,\"lookup_ns_per_chunk_1proc\":%.2f,"
	       "\"target_met\":%s}\n", TARGET_NS, one, met ? "true" : "false");
}

int kvt_bench_ops(int argc, char **argv)
{
	struct kvt_geometry g;
	struct kvt_seg_create_opts c;
	struct opts o;
	struct shared *sh;
	struct row rows[4 + MAX_PROCS];
	kvt_seg *s = NULL;
	uint64_t ns, nev, warm;
	double one = -1;
	int n = 0, r, rc = 0;

	r = parse(argc, argv, &o);
	if (r)
		return r == 1 ? 0 : r;
	memset(&g, 0, sizeof(g));
	g.chunk_tokens = 16;
	g.world = 1;
	g.n_instances = 1;
	g.mode = KVT_MODE_SHARDED;
	g.n_groups = 1;
	g.groups[0].layers = 1;
	g.groups[0].bytes_per_token = (uint32_t)(o.chunk_bytes / 16);
	g.model_id.lo = 0xbe9c4;
	g.n_slots = o.slots;
	g.lease_max_chunks = o.cpl > 512 ? o.cpl : 0;
	c = (struct kvt_seg_create_opts){ .size = sizeof(c), .name = o.name, .geo = &g,
					  .flags = KVT_SEG_F_REPLACE };
	seg_guard_install();
	snprintf(seg_name, sizeof(seg_name), "%s", o.name);
	if ((r = kvt_seg_create(&c, NULL, &s)) != 0) {
		fprintf(stderr, "ops: create: %s\n", kvt_core_last_error());
		seg_name[0] = 0;
		return 1;
	}
	if (kvt_seg_size(s) < (1ULL << 30) || o.slots < 100000)
		fprintf(stderr, "ops: note: a segment under 1 GiB or 100,000 chunks is smaller "
			"than the reference run\n");
	sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED) {
		perror("ops: mmap");
		kvt_seg_detach(s);
		return 1;
	}

	/* Fill: every slot READY, no eviction.  The first sweep of the CLOCK
	 * hand faults the slot and index pages in; that part is not timed. */
	warm = o.slots / 8;
	if (!save_range(s, 0, warm, 0) || !(ns = save_range(s, warm, o.slots, 0)))
		goto fail;
	single_row(&rows[n++], "save, new chunk", o.slots - warm, ns);
	if (!(ns = save_range(s, 0, o.slots, KVT_SKIP)))
		goto fail;
	single_row(&rows[n++], "save, dedupe skip", o.slots, ns);

	for (uint32_t i = 0; i < o.n_procs; i++) {
		if (measure_lookups(&o, sh, o.procs[i], &rows[n]) != 0)
			goto fail;
		if (o.procs[i] == 1)
			one = rows[n].ns_per_chunk[0];
		n++;
	}

	/* New keys into the full arena: each save evicts one chunk. */
	nev = o.slots / 2 ? o.slots / 2 : 1;
	if (!(ns = save_range(s, o.slots, o.slots + nev, 0)))
		goto fail;
	single_row(&rows[n++], "save, evicting", nev, ns);

	if (o.json) {
		print_json(&o, rows, n, kvt_seg_size(s), kvt_seg_shard_bytes(s), one,
			   one >= 0 && one <= TARGET_NS);
	} else {
		print_table(&o, rows, n, kvt_seg_size(s), kvt_seg_shard_bytes(s));
		if (one >= 0)
			printf("lookup+pin+release, 1 process: %.1f ns/chunk; target <= %.0f ns: %s\n",
			       one, TARGET_NS, one <= TARGET_NS ? "met" : "MISSED");
	}
	goto out;
fail:
	rc = 1;
out:
	munmap(sh, sizeof(*sh));
	kvt_seg_detach(s);
	cleanup();
	seg_name[0] = 0;
	return rc;
}
