/* preempt.c - kvtier-bench preempt: the long preemption stress of core's
 * protocols (tests/preempt_engine.h; tests/core_preempt.c is its bounded
 * run in the test suite).
 *
 * Writers (half of them slow: they sleep up to --slow-us between claiming
 * a chunk and copying it), readers that pin and check every chunk byte by
 * byte, many keys over few slots, in processes or threads, sharded and
 * replicated.  In a build configured with -DKVTIER_SCHEDULE_POINTS=ON,
 * every protocol step is also a point where a random delay is injected
 * (--delay-permille of the hits, up to --delay-us).  What it reports: the
 * operations done, the chunks checked, and the verdict -- 0 wrong bytes,
 * 0 lost claims of live writers, kvt_check clean.  Exit 1 on any breach.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "preempt_engine.h"
#ifdef KVT_SCHEDULE_POINTS
#include "sp_ctl.h"
#endif
#include "bench_util.h"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kvtier-bench preempt [options]\n"
		"  --seconds S         per layout and worker kind (default 60)\n"
		"  --layout L          sharded | replicated | both (default both)\n"
		"  --kind K            processes | threads | both (default both)\n"
		"  --world N           ranks of the layout (default 2)\n"
		"  --workers N         writers/readers, 1..16 (default 8)\n"
		"  --slots N --keys N  arena slots and distinct keys (default 4, 16)\n"
		"  --slow-us US        a slow writer's longest pause before its copy (2000)\n"
		"  --delay-permille P  schedule-point hits delayed (default 30)\n"
		"  --delay-us US       longest such delay (default 300)\n"
		"  --fill-ms MS        the segment's fill timeout (default 2: a chunk\n"
		"                      nobody writes is abandoned soon)\n"
		"  --seed X\n");
}

int kvt_bench_preempt(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "seconds", 1, NULL, 's' }, { "layout", 1, NULL, 'l' }, { "kind", 1, NULL, 'k' },
		{ "world", 1, NULL, 'W' }, { "workers", 1, NULL, 'w' }, { "slots", 1, NULL, 'S' },
		{ "keys", 1, NULL, 'K' }, { "slow-us", 1, NULL, 'u' },
		{ "delay-permille", 1, NULL, 'p' }, { "delay-us", 1, NULL, 'd' },
		{ "seed", 1, NULL, 'x' }, { "fill-ms", 1, NULL, 'f' },
		{ "help", 0, NULL, 'h' }, { NULL, 0, NULL, 0 } };
	double seconds = 60;
	const char *layout = "both", *kind = "both";
	unsigned world = 2, workers = 8, slots = 4, keys = 16, slow_us = 2000;
	unsigned permille = 30, delay_us = 300, fill_ms = 2;
	uint64_t seed = kvt__now_ns() ^ (uint64_t)getpid();
	char name[64];
	int c, bad = 0;

	optind = 1;
	while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		switch (c) {
		case 's': seconds = atof(optarg); break;
		case 'l': layout = optarg; break;
		case 'k': kind = optarg; break;
		case 'W': world = (unsigned)atoi(optarg); break;
		case 'w': workers = (unsigned)atoi(optarg); break;
		case 'S': slots = (unsigned)atoi(optarg); break;
		case 'K': keys = (unsigned)atoi(optarg); break;
		case 'u': slow_us = (unsigned)atoi(optarg); break;
		case 'p': permille = (unsigned)atoi(optarg); break;
		case 'd': delay_us = (unsigned)atoi(optarg); break;
		case 'x': seed = strtoull(optarg, NULL, 0); break;
		case 'f': fill_ms = (unsigned)atoi(optarg); break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (seconds <= 0 || world < 1 || world > 6 || workers < 1 || workers > PE_MAX_WORKERS ||
	    slots < 1 || keys < 1 || permille > 1000 || fill_ms < 1 ||
	    (strcmp(layout, "both") && strcmp(layout, "sharded") && strcmp(layout, "replicated")) ||
	    (strcmp(kind, "both") && strcmp(kind, "processes") && strcmp(kind, "threads"))) {
		usage(stderr);
		return 2;
	}
	snprintf(name, sizeof(name), "bench-preempt-%d", (int)getpid());
	snprintf(seg_name, sizeof(seg_name), "%s", name);
	seg_guard_install();
#ifdef KVT_SCHEDULE_POINTS
	if (!sp_init()) {
		perror("preempt: mmap");
		return 1;
	}
	atomic_store(&sp_ctl->delay_permille, permille);
	atomic_store(&sp_ctl->delay_max_us, delay_us);
	printf("schedule points: live, %u/1000 of %d points' hits delayed up to %u us\n",
	       permille, KVT_SP__COUNT, delay_us);
#else
	(void)delay_us;
	printf("schedule points: not in this build (configure with -DKVTIER_SCHEDULE_POINTS=ON"
	       " for delays at every protocol step); slow writers and the scheduler only\n");
#endif
	printf("seed %#llx, %u workers (%u slow, %u us +-50%%), %u slots, %u keys, world %u, "
	       "fill timeout %u ms, %.0f s per run\n", (unsigned long long)seed, workers,
	       workers / 2, slow_us, slots, keys, world, fill_ms, seconds);
	for (int rep = 0; rep < 2; rep++) {
		if (strcmp(layout, "both") && strcmp(layout, rep ? "replicated" : "sharded"))
			continue;
		for (int th = 0; th < 2; th++) {
			if (strcmp(kind, "both") && strcmp(kind, th ? "threads" : "processes"))
				continue;
			struct pe_cfg cfg = {
				.name = name, .world = world, .replicated = rep, .slots = slots,
				.keys = keys, .workers = workers, .slow = workers / 2,
				.slow_us = slow_us, .seconds = seconds, .fill_ms = fill_ms,
				.threads = th, .seed = seed + (uint64_t)(2 * rep + th) };
			struct pe_result res;
			char what[96];
#ifdef KVT_SCHEDULE_POINTS
			uint64_t d0 = atomic_load(&sp_ctl->delays);
#endif
			snprintf(what, sizeof(what), "%s, %s", rep ? "replicated" : "sharded",
				 th ? "threads" : "processes");
			int r = pe_run(&cfg, &res);
			if (r) {
				fprintf(stderr, "preempt: %s: %s\n", what, res.msg);
				return 1;
			}
			pe_print(stdout, what, &res);
#ifdef KVT_SCHEDULE_POINTS
			printf(" delays injected: %llu\n",
			       (unsigned long long)(atomic_load(&sp_ctl->delays) - d0));
#endif
			printf(" %.0f ops/s, %.0f chunks checked/s: %s\n",
			       (double)res.tot[PE_OPS] / res.seconds,
			       (double)res.tot[PE_VERIFIED] / res.seconds,
			       pe_ok(&res) ? "every invariant held" : "AN INVARIANT BROKE");
			bad |= !pe_ok(&res);
		}
	}
	return bad;
}
