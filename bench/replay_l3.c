/* replay_l3.c - kvtier-bench replay-l3: the production trace over N nodes
 * that share one L3 store, through the real segment and the real L3
 * engine on a real redis-server (the bench's own, or --url).
 *
 *   kvtier-bench replay-l3 [TRACE] [--nodes 2,4] [--capacity C] [--limit N]
 *
 * Each node is a segment of C chunks (world 1) with its L3 engine
 * (admission all).  Request q goes to node q mod N ("round robin") or to
 * the node its conversation's first chunk hashes to ("by session": the
 * trace has no session ids; a conversation's requests share their first
 * chunk).  Per request, on its node:
 *   1. the DRAM hits: the longest READY prefix (kvt_seg_lookup, released);
 *   2. with the L3: the chunks after them are fetched (kvt_l3e_fetch, in
 *      windows of the engine's jobs, each drained) and the prefix looked
 *      up again: what the L3 gave is the difference -- the fetch a
 *      scheduler's pending lookup would wait for;
 *   3. the misses are saved (kvt_write_begin / kvt_write_end, a small
 *      payload: a hit rate does not depend on the bytes) and, with the
 *      L3, put (kvt_l3e_drain with puts: before the next request).
 * Reported per configuration: the prefix hit rate (hit chunks / chunks),
 * of it from the L3, against the same N nodes without the L3, one node
 * holding N x C, and one node that never evicts -- the one node of the
 * same total capacity, since the store has no memory limit unless
 * --store-mb gives it one (maxmemory, allkeys-lru: the store then evicts
 * as an operator's would, and the objects it holds at the end are
 * printed).  The store is emptied (a fresh redis-server) for every
 * configuration.  The
 * goal (issue 26): N nodes with the L3 within 0.9 x of that one node.
 *
 * Time.  A fleet's hit rate with the L3 depends on the tier's timers --
 * the engine's negative cache above all: a chunk missed is not asked for
 * again for negative_ms, while other nodes may save it -- and so on how
 * many requests arrive while a timer runs.  Unpaced, the hour of the
 * production trace replays in seconds and the default 2 s negative cache
 * spans thousands of requests (a third of the hit rate lost, issue 38).
 * So the runs with the L3 keep the trace's time, scaled: request q starts
 * at its timestamp / --speed (default 60: the hour in a minute), and every
 * timer of the tier is divided by the same factor (the negative cache;
 * the bench drives the engine directly, so no other timer is on its
 * path).  How late the replay fell behind its schedule is printed: when
 * it is late, requests came closer together than the trace's.  --speed 0
 * replays as fast as it can, with the timers unscaled (the old figures).
 * Runs without the L3 have no timer and are not paced. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>

#include "bench_util.h"
#include "kvt_disk.h"
#include "kvt_l3e.h"
#include "trace.h"

const char *kvt_bench_default_trace(char *buf, size_t len);
pid_t kvt_bench_redis_start(int *port);
pid_t kvt_bench_mooncake_start(const char *python, int *port, int *admin);

#define MAX_NODES 16

struct run {
	uint64_t chunks, hits, l3_hits, saved, store_keys;
	double seconds;
	uint64_t late_ns;          /* behind the schedule at most (paced runs) */
};

static kvt_key key_of(uint32_t id)
{
	return (kvt_key){ (uint64_t)id + 1, 0x7e91a3 };
}

static kvt_seg *node_open(const char *name, uint32_t slots, uint32_t max_len)
{
	struct kvt_geometry g;
	struct kvt_seg_create_opts c = { .size = sizeof(c), .name = name, .geo = &g,
					 .flags = KVT_SEG_F_REPLACE };
	struct kvt_seg_attach_opts a = { .size = sizeof(a), .name = name,
					 .role = KVT_ROLE_CLIENT };
	kvt_seg *s = NULL;

	memset(&g, 0, sizeof(g));
	g.chunk_tokens = 16;
	g.world = 1;
	g.n_instances = 1;
	g.mode = KVT_MODE_SHARDED;
	g.n_groups = 1;
	g.groups[0].layers = 1;
	g.groups[0].bytes_per_token = 16; /* 256-byte chunks: rates, not bytes */
	g.model_id.lo = 0x4e0de;
	g.n_slots = slots;
	g.n_leases = 64;
	g.lease_max_chunks = max_len > 64 ? max_len : 64;
	if (kvt_seg_create(&c, &a, &s) || kvt_seg_own(s)) {
		fprintf(stderr, "kvtier-bench replay-l3: segment %s: %s\n", name,
			kvt_core_last_error());
		if (s)
			kvt_seg_detach(s);
		return NULL;
	}
	return s;
}

static uint32_t neg_ms;   /* --negative-ms, in the trace's time (0: the engine's 2000) */
static double speed = 60; /* --speed: trace time over real time (0: unpaced) */
static uint32_t store_mb; /* --store-mb: the store's maxmemory (0: none) */
static const char *mc_python; /* --store mooncake: the Python with the wheel */

/* redis-cli against the bench's server: 0, or -1. */
static int cli(int port, const char *args, char *out, size_t len)
{
	char cmd[256];
	FILE *f;
	size_t n = 0;

	snprintf(cmd, sizeof(cmd), "redis-cli -p %d %s 2>&1", port, args);
	f = popen(cmd, "r");
	if (!f)
		return -1;
	if (out && len) {
		n = fread(out, 1, len - 1, f);
		out[n] = 0;
	} else {
		char sink[256];
		while (fread(sink, 1, sizeof(sink), f) > 0)
			;
	}
	return pclose(f) == 0 ? 0 : -1;
}

/* A timer of the tier in the trace's time (ms; 0: the engine's default),
 * as the engine runs it in the replay's: divided by --speed. */
static uint32_t real_ms(uint32_t trace_ms)
{
	double ms = trace_ms ? trace_ms : 2000;

	if (speed <= 0)
		return trace_ms;
	ms /= speed;
	return ms < 1 ? 1 : (uint32_t)(ms + 0.5);
}

static int one_run(const struct trace *t, uint32_t nodes, uint32_t cap, int l3, int by_session,
		   const char *key_path, struct run *out)
{
	kvt_seg *seg[MAX_NODES] = { 0 };
	kvt_l3e *eng[MAX_NODES] = { 0 };
	char names[MAX_NODES][64], url[160], err[256];
	kvt_key *keys = malloc((size_t)t->max_len * sizeof(*keys));
	uint32_t *depths = malloc((size_t)t->max_len * sizeof(*depths));
	pid_t server = -1;
	int port = 0, admin = 0, rc = -1;
	uint64_t t0;

	memset(out, 0, sizeof(*out));
	if (!keys || !depths)
		goto out;
	if (l3 && mc_python) {
		/* each node's companion contributes its part of the store: the
		 * store's size split evenly (--store-mb), else 1 GiB each */
		server = kvt_bench_mooncake_start(mc_python, &port, &admin);
		if (server < 0)
			goto out;
		snprintf(url, sizeof(url), "mooncake://127.0.0.1:%d?segment=%lluM", port,
			 store_mb ? (unsigned long long)(store_mb + nodes - 1) / nodes : 1024ull);
	} else if (l3) {
		server = kvt_bench_redis_start(&port);
		if (server < 0)
			goto out;
		snprintf(url, sizeof(url), "redis://127.0.0.1:%d", port);
	}
	for (uint32_t n = 0; n < nodes; n++) {
		snprintf(names[n], sizeof(names[n]), "kvtier-bench-l3r-%d-%u", (int)getpid(), n);
		seg[n] = node_open(names[n], cap, t->max_len);
		if (!seg[n])
			goto out;
		if (!l3)
			continue;
		struct kvt_l3e_opts o = { .size = sizeof(o), .key_path = key_path, .create_key = 1,
					  .admit = KVT_ADMIT_ALL, .negative_ms = real_ms(neg_ms) };
		o.store = (struct kvt_l3_conf){ .size = sizeof(o.store), .url = url,
						.timeout_ms = 2000, .python = mc_python };
		for (int tries = 0; tries < 250; tries++) { /* the server starting */
			if (!kvt_l3e_open(seg[n], &o, &eng[n], err, sizeof(err))) {
				struct kvt_l3e_info in;
				kvt_l3e_info(eng[n], &in);
				if (in.store.up)
					break;
				kvt_l3e_close(eng[n]);
				eng[n] = NULL;
			}
			usleep(20000);
		}
		if (!eng[n]) {
			fprintf(stderr, "kvtier-bench replay-l3: l3: %s\n", err);
			goto out;
		}
	}
	if (l3 && store_mb && !mc_python) {
		char a[96], r[64];
		snprintf(a, sizeof(a), "CONFIG SET maxmemory %umb", store_mb);
		if (cli(port, a, r, sizeof(r)) || strncmp(r, "OK", 2) ||
		    cli(port, "CONFIG SET maxmemory-policy allkeys-lru", r, sizeof(r)) ||
		    strncmp(r, "OK", 2)) {
			fprintf(stderr, "kvtier-bench replay-l3: redis-cli CONFIG SET failed (%s)\n", r);
			goto out;
		}
	}
	t0 = kvt__now_ns();
	for (uint32_t q = 0; q < t->n_req; q++) {
		const uint32_t *c = t->ids + t->off[q];
		uint32_t len = t->off[q + 1] - t->off[q];
		/* a conversation: its second chunk (the first is the trace's
		 * shared system prompt, chunk 0 of nearly every request) */
		uint32_t sid = len > 1 ? c[1] : c[0];
		uint32_t n = by_session ? (uint32_t)(((uint64_t)sid * 0x9e3779b97f4a7c15ull) >> 40) % nodes
					: q % nodes;
		uint64_t lease;
		int h, h2;

		if (!len)
			continue;
		if (l3 && speed > 0) { /* the trace's time, scaled */
			uint64_t due = t0 + (uint64_t)((double)(t->ms[q] > t->ms[0] ? t->ms[q] - t->ms[0]
									       : 0) * 1e6 / speed);
			uint64_t now = kvt__now_ns();

			if (now < due) {
				struct timespec ts = { .tv_sec = (time_t)((due - now) / 1000000000ull),
						       .tv_nsec = (long)((due - now) % 1000000000ull) };
				nanosleep(&ts, NULL);
			} else if (now - due > out->late_ns) {
				out->late_ns = now - due;
			}
		}
		for (uint32_t i = 0; i < len; i++) {
			keys[i] = key_of(c[i]);
			depths[i] = i;
		}
		h = kvt_seg_lookup(seg[n], keys, len, &lease);
		if (h < 0)
			h = 0;
		if (lease)
			kvt_lease_release(seg[n], lease);
		h2 = h;
		if (l3 && (uint32_t)h < len) {
			for (uint32_t i = (uint32_t)h; i < len; i += 32) {
				uint32_t w = len - i < 32 ? len - i : 32;
				kvt_l3e_fetch(eng[n], keys + i, depths + i, w);
				kvt_l3e_drain(eng[n], 0, -1);
			}
			h2 = kvt_seg_lookup(seg[n], keys, len, &lease);
			if (h2 < 0)
				h2 = h;
			if (lease)
				kvt_lease_release(seg[n], lease);
		}
		out->chunks += len;
		out->hits += (uint64_t)h2;
		out->l3_hits += (uint64_t)(h2 - h);
		for (uint32_t i = (uint32_t)h2; i < len; i++) {
			struct kvt_wref w;
			int r = kvt_write_begin(seg[n], &keys[i], i, 0, &w);
			if (r == KVT_SKIP)
				continue;
			if (r)
				break;
			memset(kvt_slot_shard_ptr(seg[n], w.slot, 0), (int)(c[i] & 0xff),
			       (size_t)kvt_seg_chunk_bytes(seg[n]));
			kvt_write_end(seg[n], &w, 1);
			out->saved++;
		}
		if (l3)
			kvt_l3e_drain(eng[n], 1, -1);
	}
	out->seconds = (kvt__now_ns() - t0) * 1e-9;
	if (l3 && !mc_python) {
		char r[64];
		if (!cli(port, "DBSIZE", r, sizeof(r)))
			out->store_keys = strtoull(r, NULL, 10);
	} else if (l3) {
		char cmd[128], line[256];
		snprintf(cmd, sizeof(cmd), "curl -s http://127.0.0.1:%d/get_all_keys", admin);
		FILE *f = popen(cmd, "r");
		while (f && fgets(line, sizeof(line), f))
			out->store_keys += !strncmp(line, "kvt:", 4);
		if (f)
			pclose(f);
	}
	rc = 0;
out:
	for (uint32_t n = 0; n < nodes; n++) {
		kvt_l3e_close(eng[n]);
		if (seg[n]) {
			kvt_seg_detach(seg[n]);
			kvt_seg_unlink(names[n], NULL);
		}
	}
	if (server > 0) {
		kill(server, SIGTERM);
		waitpid(server, NULL, 0);
	}
	free(keys);
	free(depths);
	return rc;
}

int kvt_bench_replay_l3(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "nodes", required_argument, NULL, 'n' },
		{ "capacity", required_argument, NULL, 'c' },
		{ "limit", required_argument, NULL, 'l' },
		{ "negative-ms", required_argument, NULL, 'g' },
		{ "store-mb", required_argument, NULL, 's' },
		{ "speed", required_argument, NULL, 'v' },
		{ "store", required_argument, NULL, 'S' },
		{ "python", required_argument, NULL, 'P' },
		{ "help", no_argument, NULL, 'h' },
		{ 0, 0, 0, 0 },
	};
	uint32_t node_list[8] = { 2, 4 }, n_nodes = 2, cap = 1024, limit = 0;
	char buf[4096], keyf[128];
	const char *path = NULL;
	struct trace t;
	int opt, mooncake = 0;

	while ((opt = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		char *end = NULL, *tok, *save = NULL;
		switch (opt) {
		case 'n':
			n_nodes = 0;
			for (tok = strtok_r(optarg, ",", &save); tok && n_nodes < 8;
			     tok = strtok_r(NULL, ",", &save)) {
				node_list[n_nodes] = (uint32_t)strtoul(tok, &end, 10);
				if (*end || node_list[n_nodes] < 1 || node_list[n_nodes] > MAX_NODES)
					goto usage;
				n_nodes++;
			}
			if (!n_nodes)
				goto usage;
			break;
		case 'c':
			cap = (uint32_t)strtoul(optarg, &end, 10);
			if (*end || cap < 16)
				goto usage;
			break;
		case 'l':
			limit = (uint32_t)strtoul(optarg, &end, 10);
			if (*end)
				goto usage;
			break;
		case 'g':
			neg_ms = (uint32_t)strtoul(optarg, &end, 10);
			if (*end || !neg_ms)
				goto usage;
			break;
		case 's':
			store_mb = (uint32_t)strtoul(optarg, &end, 10);
			if (*end || !store_mb || store_mb > 1u << 20)
				goto usage;
			break;
		case 'S':
			if (!strcmp(optarg, "mooncake"))
				mooncake = 1;
			else if (strcmp(optarg, "redis"))
				goto usage;
			break;
		case 'v':
			speed = strtod(optarg, &end);
			if (*end || !(speed >= 0) || speed > 1e6)
				goto usage;
			break;
		case 'P': mc_python = optarg; break;
		case 'h':
		default:
		usage:
			fprintf(opt == 'h' ? stdout : stderr,
				"usage: kvtier-bench replay-l3 [TRACE] [--nodes 2,4] [--capacity C "
				"(1024 chunks per node)] [--limit N requests]\n"
				"                          [--negative-ms MS (the engine's, 2000)] "
				"[--store-mb M (maxmemory, allkeys-lru)]\n"
				"                          [--store redis|mooncake] [--python PATH "
				"(mooncake: the wheel's; $KVTIER_MOONCAKE_PYTHON)]\n"
				"                          [--speed S (the trace's time / S, its "
				"timers too; default 60; 0: unpaced)]\n"
				"  mooncake: each node's companion contributes --store-mb / nodes "
				"(default 1 GiB) to the store\n");
			return opt == 'h' ? 0 : 2;
		}
	}
	if (mooncake) {
		if (!mc_python)
			mc_python = getenv("KVTIER_MOONCAKE_PYTHON");
		if (!mc_python || !*mc_python)
			mc_python = "python3";
	} else {
		mc_python = NULL;
	}
	path = optind < argc ? argv[optind] : kvt_bench_default_trace(buf, sizeof(buf));
	if (!path) {
		fprintf(stderr, "kvtier-bench replay-l3: no trace (give its path)\n");
		return 2;
	}
	if (trace_load(path, limit, &t))
		return 1;
	snprintf(keyf, sizeof(keyf), "/tmp/kvtier-bench-l3-%d.key", (int)getpid());
	printf("kvtier-bench replay-l3: %s, %u requests, %u chunks per node; prefix hit "
	       "rate (of it from the L3)\n", path, t.n_req, cap);
	/* the L3 holds everything without --store-mb: the one node of the
	 * same total capacity is then one that never evicts */
	if (mc_python)
		printf("  the store: Mooncake Store, %s MiB per node's companion\n",
		       store_mb ? "--store-mb / nodes" : "1024");
	else if (store_mb)
		printf("  the store: maxmemory %u MB, allkeys-lru\n", store_mb);
	uint32_t span = 0; /* ms from the first request to the last */
	for (uint32_t q = 0; q < t.n_req; q++)
		if (t.ms[q] > t.ms[0] && t.ms[q] - t.ms[0] > span)
			span = t.ms[q] - t.ms[0];
	if (speed > 0)
		printf("  time: the trace's, %g x faster (%.0f s of trace in %.1f s); negative "
		       "cache %u ms of trace time = %u ms\n", speed, span / 1e3,
		       span / 1e3 / speed, neg_ms ? neg_ms : 2000, real_ms(neg_ms));
	else
		printf("  time: unpaced, as fast as it runs; negative cache %u ms\n",
		       neg_ms ? neg_ms : 2000);
	struct run inf;
	if (one_run(&t, 1, (uint32_t)(t.n_ids + 16), 0, 0, keyf, &inf))
		goto fail;
	double rinf = (double)inf.hits / (double)inf.chunks;
	printf("  one node that never evicts (%u chunks): %.1f%%\n", t.n_ids + 16, 100 * rinf);
	printf("  %-5s %-13s %12s %18s %16s %18s\n", "nodes", "routing", "no L3", "with L3",
	       "one node N x C", "L3 / never-evicts");
	for (uint32_t i = 0; i < n_nodes; i++) {
		uint32_t N = node_list[i];
		struct run one, none, with;

		if (one_run(&t, 1, cap * N, 0, 0, keyf, &one))
			goto fail;
		for (int by = 0; by < 2; by++) {
			if (one_run(&t, N, cap, 0, by, keyf, &none) ||
			    one_run(&t, N, cap, 1, by, keyf, &with))
				goto fail;
			double r1 = (double)one.hits / (double)one.chunks;
			double r0 = (double)none.hits / (double)none.chunks;
			double rl = (double)with.hits / (double)with.chunks;
			printf("  %-5u %-13s %11.1f%% %10.1f%% (%4.1f%%) %15.1f%% %17.2fx   (%.0f s, "
			       "late %.2f s at most, %llu objects left in the store)\n",
			       N, by ? "by session" : "round robin", 100 * r0, 100 * rl,
			       100.0 * (double)with.l3_hits / (double)with.chunks, 100 * r1,
			       rinf > 0 ? rl / rinf : 0, with.seconds, with.late_ns * 1e-9,
			       (unsigned long long)with.store_keys);
			fflush(stdout);
		}
	}
	unlink(keyf);
	trace_free(&t);
	return 0;
fail:
	unlink(keyf);
	trace_free(&t);
	return 1;
}
