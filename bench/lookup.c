/* lookup.c - kvtier-bench lookup: what a scheduler pays per new request,
 * in C and through the Python binding, against XXH3 and an LMCache-style
 * Python lookup.
 *
 * Creates its own segment (kvtier-bench-lookup-<pid>, removed at exit):
 * world 1, chunk_tokens 256 by default, chunks of 4 KiB (one group, one
 * layer, 16 bytes per token: the payload size does not enter a lookup).
 * For each prompt length (1k, 8k, 32k, 128k tokens) it saves every chunk
 * of a "hit" prompt through the real API (host backend), then times, in
 * this process:
 *
 *   hash          kvt_hash_tokens over the prompt, beside XXH3-128 over the
 *                 same buffer in one call: libxxhash's XXH3_128bits (its
 *                 baseline build, SSE2 on x86-64) and, on x86-64, its
 *                 XXH3_128bits_dispatch (the widest vectors the CPU has):
 *                 the ceiling, and the ratio ceiling / ours;
 *   hash+lookup   kvt_hash_tokens + kvt_lookup + kvt_release, on the hit
 *                 prompt (every chunk pinned and unpinned) and on a miss
 *                 prompt (no chunk stored);
 *
 * then runs bench/lookup.py (Debian's python3 and numpy, the source
 * tree's binding, this build's libkvtier.so) for the same prompts through
 * the binding and, when python3-zmq and python3-msgpack are installed, the
 * LMCache-style reference, and prints them beside the C figures with the
 * issue's goal for the binding: within 1.5x the C figure plus 10 us.
 *
 * Timing: CLOCK_MONOTONIC; each figure is the median over --batches
 * batches of at least 2 ms each, the batches of the figures compared in
 * one table interleaved.  The C figures are measured before and after the
 * Python run and the lower kept (on a shared machine the other process's
 * figures may have run in a slower or a faster stretch; the lower C figure
 * makes the binding's goal the stricter).  No figure here is asserted
 * anywhere.
 */
#include <link.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>
#define HAVE_XXH_DISPATCH 1
#endif

#include "kvtier.h"
#include "bench_util.h"

#define MAX_LENS 8

#ifndef KVTIER_BENCH_LOOKUP_PY
#define KVTIER_BENCH_LOOKUP_PY "bench/lookup.py"
#endif
#ifndef KVTIER_BENCH_PYTHONPATH
#define KVTIER_BENCH_PYTHONPATH "bindings/python"
#endif

struct opts {
	uint32_t chunk_tokens;
	uint32_t lens[MAX_LENS];
	uint32_t n_lens;
	uint32_t batches;
	const char *python;   /* "none": C only */
	const char *script;
	int zmq;
};

struct crow {
	uint32_t tokens;
	double hash_us, xxh_us, xxh_disp_us;
	double hit_us, miss_us;   /* hash + lookup + release */
	uint32_t hits;
};

/* "py FORM TOKENS KIND US HITS" lines of lookup.py */
struct pyrow {
	char form[16];
	uint32_t tokens;
	int miss;
	double us;
	uint32_t hits;
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kvtier-bench lookup [options]\n"
		"  --chunk-tokens N   tokens per chunk (default 256)\n"
		"  --lengths LIST     prompt lengths in tokens (default 1024,8192,32768,131072)\n"
		"  --batches N        batches per figure, the median is printed (default 21)\n"
		"  --python PATH      the Python that runs bench/lookup.py (default\n"
		"                     /usr/bin/python3); 'none': the C figures only\n"
		"  --script PATH      lookup.py (default: the source tree's)\n"
		"  --no-zmq           skip the LMCache-style ZeroMQ reference\n");
}

static int parse(int argc, char **argv, struct opts *o)
{
	static const struct option lo[] = {
		{ "chunk-tokens", required_argument, NULL, 'c' },
		{ "lengths", required_argument, NULL, 'l' },
		{ "batches", required_argument, NULL, 'b' },
		{ "python", required_argument, NULL, 'p' },
		{ "script", required_argument, NULL, 's' },
		{ "no-zmq", no_argument, NULL, 'z' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	int c;

	*o = (struct opts){ .chunk_tokens = 256, .lens = { 1024, 8192, 32768, 131072 },
			    .n_lens = 4, .batches = 21, .python = "/usr/bin/python3",
			    .script = KVTIER_BENCH_LOOKUP_PY, .zmq = 1 };
	optind = 1;
	while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		char *end = NULL, buf[256], *save = NULL, *tok;
		switch (c) {
		case 'c': o->chunk_tokens = (uint32_t)strtoul(optarg, &end, 0); break;
		case 'b': o->batches = (uint32_t)strtoul(optarg, &end, 0); break;
		case 'p': o->python = optarg; break;
		case 's': o->script = optarg; break;
		case 'z': o->zmq = 0; break;
		case 'l':
			snprintf(buf, sizeof(buf), "%s", optarg);
			o->n_lens = 0;
			for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
				unsigned long v = strtoul(tok, &end, 10);
				if (*end || !v || v > (1u << 24) || o->n_lens == MAX_LENS) {
					fprintf(stderr, "lookup: --lengths takes up to %d lengths "
						"of 1..16777216 tokens\n", MAX_LENS);
					return 2;
				}
				o->lens[o->n_lens++] = (uint32_t)v;
			}
			end = NULL;
			if (!o->n_lens) {
				fprintf(stderr, "lookup: --lengths is empty\n");
				return 2;
			}
			break;
		case 'h': usage(stdout); return 1;
		default: usage(stderr); return 2;
		}
		if (end && *end) {
			fprintf(stderr, "lookup: bad number '%s'\n", optarg);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "lookup: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	if (o->chunk_tokens < 16 || o->chunk_tokens % 16 || o->chunk_tokens > 65536) {
		fprintf(stderr, "lookup: --chunk-tokens must be a multiple of 16 in 16..65536\n");
		return 2;
	}
	if (o->batches < 1 || o->batches > 1000) {
		fprintf(stderr, "lookup: --batches must be 1..1000\n");
		return 2;
	}
	return 0;
}

/* The prompt lookup.py builds too (tokens_of there). */
static void make_tokens(uint32_t *t, uint32_t n, int miss)
{
	uint64_t salt = (uint64_t)n * 40503u + (miss ? 0x5BD1E995u : 0);

	for (uint32_t i = 0; i < n; i++)
		t[i] = (uint32_t)((((uint64_t)i + 1) * 2654435761u + salt) & 0xFFFFFFFFu) % 151936u;
}

static void sort_d(double *v, uint32_t n)
{
	for (uint32_t i = 1; i < n; i++) /* insertion sort: at most 1000 */
		for (uint32_t j = i; j > 0 && v[j] < v[j - 1]; j--) {
			double x = v[j];
			v[j] = v[j - 1];
			v[j - 1] = x;
		}
}

/* The median microseconds of each of fns[0..n) over batches of >= 2 ms,
 * the functions' batches interleaved (a, b, c, a, b, c, ...) so that a
 * slow stretch of a shared machine falls on all of them alike. */
static void median_us(void (*const *fns)(void *), uint32_t n_fns, void *arg,
		      uint32_t batches, double *out)
{
	static double per[8][1000];
	uint64_t iters[8];

	for (uint32_t f = 0; f < n_fns; f++) {
		uint64_t n = 1;
		for (;;) {
			uint64_t t0 = kvt__now_ns();
			for (uint64_t i = 0; i < n; i++)
				fns[f](arg);
			if (kvt__now_ns() - t0 >= 2000000 || n >= (1u << 20))
				break;
			n *= 2;
		}
		iters[f] = n;
	}
	for (uint32_t b = 0; b < batches; b++)
		for (uint32_t f = 0; f < n_fns; f++) {
			uint64_t t0 = kvt__now_ns();
			for (uint64_t i = 0; i < iters[f]; i++)
				fns[f](arg);
			per[f][b] = (double)(kvt__now_ns() - t0) / (double)iters[f] / 1000.0;
		}
	for (uint32_t f = 0; f < n_fns; f++) {
		sort_d(per[f], batches);
		out[f] = per[f][batches / 2];
	}
}

struct job {
	kvt_tier *t;
	const uint32_t *tokens;
	uint32_t n;
	kvt_key *keys;
	uint32_t n_keys;
	volatile uint64_t sink;
	int err;
};

static void do_hash(void *a)
{
	struct job *j = a;
	if (kvt_hash_tokens(j->t, j->tokens, j->n, NULL, j->keys, j->n_keys) != (int)j->n_keys)
		j->err = 1;
}

static void do_xxh(void *a)
{
	struct job *j = a;
	j->sink += XXH3_128bits(j->tokens, (size_t)j->n * 4).low64;
}

#ifdef HAVE_XXH_DISPATCH
static void do_xxh_disp(void *a)
{
	struct job *j = a;
	j->sink += XXH3_128bits_dispatch(j->tokens, (size_t)j->n * 4).low64;
}
#endif

static void do_hash_lookup(void *a)
{
	struct job *j = a;
	kvt_lease_id lease;
	int h;

	do_hash(a);
	h = kvt_lookup(j->t, j->keys, j->n_keys, &lease);
	if (h < 0)
		j->err = 1;
	else if (lease && kvt_release(j->t, lease) != 0)
		j->err = 1;
	j->sink += (uint64_t)h;
}

static uint8_t *kv; /* the rank's "KV cache": freed after kvt_close */

static kvt_tier *open_bench(const struct opts *o, const char *name, uint32_t n_slots,
			    uint32_t **table, uint32_t *max_chunks)
{
	static struct kvt_group_desc g = { .n_layers = 1, .bytes_per_token = 16,
					   .tokens_per_block = 16 };
	struct kvt_config c;
	struct kvt_group_buffers b;
	uint64_t base;
	uint32_t bpc = o->chunk_tokens / 16, n_blocks = 4 * bpc;
	kvt_tier *t = NULL;

	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.flags = KVT_F_NO_ENV | KVT_F_CREATE | KVT_F_REPLACE;
	c.role = KVT_TIER_RANK;
	c.rank = 0;
	c.world = 1;
	c.chunk_tokens = o->chunk_tokens;
	c.segment = name;
	c.segment_dir = "/dev/shm";
	c.model = "kvtier-bench-lookup";
	c.dma = "host";
	c.n_groups = 1;
	c.groups = &g;
	c.n_slots = n_slots;
	if (kvt_open(&c, &t)) {
		fprintf(stderr, "lookup: kvt_open: %s\n", kvt_last_error());
		return NULL;
	}
	kv = calloc(n_blocks, (size_t)16 * 16);
	*table = malloc((size_t)*max_chunks * bpc * sizeof(uint32_t));
	if (!kv || !*table) {
		fprintf(stderr, "lookup: out of memory\n");
		kvt_close(t);
		return NULL;
	}
	for (uint64_t i = 0; i < (uint64_t)*max_chunks * bpc; i++)
		(*table)[i] = (uint32_t)(i % n_blocks);
	base = (uint64_t)(uintptr_t)kv;
	b = (struct kvt_group_buffers){ .layer_base = &base, .block_stride = 16 * 16,
					.n_blocks = n_blocks };
	if (kvt_register_kv(t, 1, &b)) {
		fprintf(stderr, "lookup: kvt_register_kv: %s\n", kvt_last_error());
		kvt_close(t);
		return NULL;
	}
	return t;
}

/* Saves every chunk of keys (n of them), in pieces the window takes. */
static int save_all(kvt_tier *t, const kvt_key *keys, uint32_t n, const uint32_t *table)
{
	const uint32_t *tabs[1] = { table };
	kvt_op op;
	int r = kvt_save(t, keys, n, 0, tabs, &op);

	if (r < 0) {
		fprintf(stderr, "lookup: kvt_save: %s\n", kvt_last_error());
		return -1;
	}
	if (op && (r = kvt_wait(t, op, -1)) != 0) {
		fprintf(stderr, "lookup: kvt_wait: %s\n", kvt_strerror(r));
		return -1;
	}
	return 0;
}

/* The path of the libkvtier.so this process runs (lookup.py loads the
 * same one). */
static int find_libkvtier(struct dl_phdr_info *info, size_t size, void *arg)
{
	const char *b = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;

	(void)size;
	if (b && !strncmp(b + 1, "libkvtier.so", 12)) {
		snprintf(arg, 4096, "%s", info->dlpi_name);
		return 1;
	}
	return 0;
}

/* Runs lookup.py; fills rows, returns how many (or -1). */
static int run_python(const struct opts *o, const char *name, struct pyrow *rows, int max)
{
	char lens[128] = "", cmd[256], libpath[4096] = "";
	int fds[2], n = 0, len = 0, status;
	FILE *f;
	pid_t pid;

	for (uint32_t i = 0; i < o->n_lens; i++)
		len += snprintf(lens + len, sizeof(lens) - (size_t)len, "%s%u", i ? "," : "",
				o->lens[i]);
	dl_iterate_phdr(find_libkvtier, libpath);
	if (access(o->script, R_OK)) {
		fprintf(stderr, "lookup: %s: %s (--script names lookup.py)\n", o->script,
			strerror(errno));
		return -1;
	}
	if (pipe(fds))
		return -1;
	fflush(stdout);
	pid = fork();
	if (pid < 0)
		return -1;
	if (pid == 0) {
		char bat[16], ct[16];
		const char *pp = getenv("PYTHONPATH");
		char ppath[8192];

		snprintf(ppath, sizeof(ppath), "%s%s%s", KVTIER_BENCH_PYTHONPATH,
			 pp && *pp ? ":" : "", pp && *pp ? pp : "");
		setenv("PYTHONPATH", ppath, 1);
		if (libpath[0])
			setenv("KVTIER_LIBRARY", libpath, 1);
		snprintf(ct, sizeof(ct), "%u", o->chunk_tokens);
		setenv("KVTIER_BENCH_CHUNK_TOKENS", ct, 1);
		snprintf(bat, sizeof(bat), "%u", o->batches);
		dup2(fds[1], 1);
		close(fds[0]);
		close(fds[1]);
		execl(o->python, o->python, o->script, "--segment", name, "--segment-dir",
		      "/dev/shm", "--lengths", lens, "--batches", bat, "--zmq",
		      o->zmq ? "auto" : "none", (char *)NULL);
		fprintf(stderr, "lookup: %s: %s\n", o->python, strerror(errno));
		_exit(127);
	}
	close(fds[1]);
	f = fdopen(fds[0], "r");
	while (f && fgets(cmd, sizeof(cmd), f)) {
		struct pyrow r;
		char kind[8];
		if (!strncmp(cmd, "note ", 5)) {
			printf("%s", cmd);
			continue;
		}
		if (n < max && sscanf(cmd, "py %15s %u %7s %lf %u", r.form, &r.tokens, kind, &r.us,
				      &r.hits) == 5) {
			r.miss = !strcmp(kind, "miss");
			rows[n++] = r;
		}
	}
	if (f)
		fclose(f);
	waitpid(pid, &status, 0);
	if (!WIFEXITED(status) || WEXITSTATUS(status)) {
		fprintf(stderr, "lookup: %s %s failed (status %d)\n", o->python, o->script, status);
		return n ? n : -1;
	}
	return n;
}

static const struct pyrow *find(const struct pyrow *rows, int n, const char *form,
				uint32_t tokens, int miss)
{
	for (int i = 0; i < n; i++)
		if (!strcmp(rows[i].form, form) && rows[i].tokens == tokens && rows[i].miss == miss)
			return &rows[i];
	return NULL;
}

static double keep_min(int again, double old, double v)
{
	return again && old < v ? old : v;
}

/* One row's C figures (again: a second pass, each figure kept at the
 * lower of the two).  The row's hit prompt is saved already. */
static int measure_c(const struct opts *o, kvt_tier *t, uint32_t *tokens, kvt_key *keys,
		     struct crow *c, int again)
{
	void (*const fns[])(void *) = { do_hash, do_xxh, do_hash_lookup,
#ifdef HAVE_XXH_DISPATCH
					do_xxh_disp,
#endif
	};
	const uint32_t n_fns = sizeof(fns) / sizeof(fns[0]);
	struct job j = { .t = t, .tokens = tokens, .n = c->tokens, .keys = keys,
			 .n_keys = c->tokens / o->chunk_tokens };
	double m[4] = { 0, 0, 0, 0 }, miss;
	kvt_lease_id l;
	int h;

	make_tokens(tokens, c->tokens, 0);
	median_us(fns, n_fns, &j, o->batches, m);
	c->hash_us = keep_min(again, c->hash_us, m[0]);
	c->xxh_us = keep_min(again, c->xxh_us, m[1]);
	c->hit_us = keep_min(again, c->hit_us, m[2]);
	c->xxh_disp_us = keep_min(again, c->xxh_disp_us, m[3]);
	do_hash(&j);
	h = kvt_lookup(t, keys, j.n_keys, &l);
	c->hits = h < 0 ? 0 : (uint32_t)h;
	if (h > 0)
		kvt_release(t, l);
	make_tokens(tokens, c->tokens, 1);
	median_us(fns + 2, 1, &j, o->batches, &miss);
	c->miss_us = keep_min(again, c->miss_us, miss);
	if (j.err) {
		fprintf(stderr, "lookup: a call failed: %s\n", kvt_last_error());
		return -1;
	}
	return 0;
}

static void print_us(const struct pyrow *r)
{
	if (r)
		printf(" %9.1f", r->us);
	else
		printf(" %9s", "-");
}

int kvt_bench_lookup(int argc, char **argv)
{
	struct opts o;
	struct crow rows[MAX_LENS];
	struct pyrow py[MAX_LENS * 2 * 4];
	uint32_t max_chunks = 0, total_chunks = 0, *table = NULL, *tokens;
	uint32_t max_tokens = 0;
	kvt_key *keys;
	kvt_tier *t;
	int r = parse(argc, argv, &o), n_py = 0, rc = 0;

	memset(rows, 0, sizeof(rows));
	const char *kernel;

	if (r)
		return r == 1 ? 0 : r;
	for (uint32_t i = 0; i < o.n_lens; i++) {
		uint32_t ch = o.lens[i] / o.chunk_tokens;
		if (ch > max_chunks)
			max_chunks = ch;
		if (o.lens[i] > max_tokens)
			max_tokens = o.lens[i];
		total_chunks += ch;
	}
	if (!max_chunks) {
		fprintf(stderr, "lookup: every prompt is shorter than one chunk\n");
		return 2;
	}
	snprintf(seg_name, sizeof(seg_name), "kvtier-bench-lookup-%d", (int)getpid());
	seg_dir = "/dev/shm";
	seg_guard_install();
	t = open_bench(&o, seg_name, total_chunks + 64, &table, &max_chunks);
	tokens = malloc((size_t)max_tokens * sizeof(*tokens));
	keys = malloc((size_t)max_chunks * sizeof(*keys));
	if (!t || !tokens || !keys)
		return 1;
	/* what tier/hash.c picks (kvt__hash_chain is not exported) */
	kernel = "generic";
#ifdef KVTIER_HASH_AVX2
	__builtin_cpu_init();
	if (__builtin_cpu_supports("avx2"))
		kernel = "avx2";
#endif

	for (uint32_t i = 0; i < o.n_lens; i++) {
		make_tokens(tokens, o.lens[i], 0);
		rows[i].tokens = o.lens[i];
		if (kvt_hash_tokens(t, tokens, o.lens[i], NULL, keys, max_chunks) < 0 ||
		    save_all(t, keys, o.lens[i] / o.chunk_tokens, table))
			return 1;
		if (measure_c(&o, t, tokens, keys, &rows[i], 0))
			return 1;
	}
	if (strcmp(o.python, "none")) {
		n_py = run_python(&o, seg_name, py, (int)(sizeof(py) / sizeof(py[0])));
		if (n_py < 0) {
			n_py = 0;
			rc = 1;
		}
		/* the C figures again, after: each row keeps the faster of the
		 * two (the goal for Python is then the stricter one) */
		for (uint32_t i = 0; i < o.n_lens; i++)
			if (measure_c(&o, t, tokens, keys, &rows[i], 1))
				return 1;
	}
	for (uint32_t i = 0; i < o.n_lens; i++)
		if (rows[i].hits != rows[i].tokens / o.chunk_tokens) {
			fprintf(stderr, "lookup: %u of %u chunks of the saved prompt hit\n",
				rows[i].hits, rows[i].tokens / o.chunk_tokens);
			rc = 1;
		}
	printf("kvtier-bench lookup: chunk_tokens %u, hash kernel %s, medians of %u batches\n\n",
	       o.chunk_tokens, kernel, o.batches);
	printf("Hashing (one thread): kvt_hash_tokens against XXH3-128 over the same buffer\n");
	printf("%8s %9s %10s %9s %10s %9s %10s %9s %7s\n", "tokens", "bytes", "kvt_hash", "GB/s",
	       "XXH3", "GB/s", "XXH3_disp", "GB/s", "ratio");
	for (uint32_t i = 0; i < o.n_lens; i++) {
		const struct crow *c = &rows[i];
		double bytes = (double)c->tokens * 4, ceil = c->xxh_us;
		if (c->xxh_disp_us > 0 && c->xxh_disp_us < ceil)
			ceil = c->xxh_disp_us;
		printf("%8u %9.0f %8.2fus %9.1f %8.2fus %9.1f %8.2fus %9.1f %7.2f\n", c->tokens,
		       bytes, c->hash_us, bytes / c->hash_us / 1e3, c->xxh_us,
		       bytes / c->xxh_us / 1e3, c->xxh_disp_us,
		       c->xxh_disp_us > 0 ? bytes / c->xxh_disp_us / 1e3 : 0.0, c->hash_us / ceil);
	}
	printf("(ratio: kvt_hash_tokens time / the faster XXH3 time; goal <= 2)\n\n");

	printf("hash + lookup + release of a new request, microseconds "
	       "(hit: every chunk stored and pinned; miss: none stored)\n");
	printf("%8s %6s %5s %9s %9s %9s %8s %9s %9s %9s %8s\n", "tokens", "chunks", "kind", "C",
	       "py keys", "goal", "py/goal", "py list", "py Key", "zmq ref", "zmq/py");
	for (uint32_t i = 0; i < o.n_lens; i++) {
		for (int miss = 0; miss < 2; miss++) {
			const struct crow *c = &rows[i];
			double cus = miss ? c->miss_us : c->hit_us, goal = 1.5 * cus + 10;
			const struct pyrow *k = find(py, n_py, "keys", c->tokens, miss),
					   *l = find(py, n_py, "list", c->tokens, miss),
					   *ob = find(py, n_py, "objects", c->tokens, miss),
					   *z = find(py, n_py, "zmq", c->tokens, miss);
			printf("%8u %6u %5s %9.2f", c->tokens, c->tokens / o.chunk_tokens,
			       miss ? "miss" : "hit", cus);
			if (k)
				printf(" %9.2f %9.2f %8.2f", k->us, goal, k->us / goal);
			else
				printf(" %9s %9.2f %8s", "-", goal, "-");
			print_us(l);
			print_us(ob);
			if (z && k)
				printf(" %9.1f %8.1f\n", z->us, z->us / k->us);
			else
				printf(" %9s %8s\n", "-", "-");
			if (k && k->hits != (miss ? 0 : c->tokens / o.chunk_tokens)) {
				fprintf(stderr, "lookup: Python saw %u hits for %u tokens (%s)\n",
					k->hits, c->tokens, miss ? "miss" : "hit");
				rc = 1;
			}
			if (z && z->hits != (miss ? 0 : c->tokens / o.chunk_tokens)) {
				fprintf(stderr, "lookup: the zmq reference saw %u hits for %u tokens\n",
					z->hits, c->tokens);
				rc = 1;
			}
		}
	}
	printf("(goal: py keys <= 1.5 x C + 10 us; py list: tokens as a Python list; py Key: "
	       "hash_tokens' Key objects; zmq ref: LMCache-style msgpack over ZeroMQ, "
	       "Python hashing, bench/lookup.py)\n");
	kvt_close(t);
	free(kv);
	free(table);
	free(tokens);
	free(keys);
	return rc;
}
