/* chaos.c - kvtier-bench chaos: kill -9 trials by the thousand over a
 * running multi-process workload (tests/chaos_engine.h: rank writers and a
 * scheduler on one segment, one or two of them SIGKILLed at a random point
 * of each trial, the dead reaped as kvtierd would, then kvt_check, no
 * leaked pin or lease, and every READY chunk read back against its stamp).
 * The CTest test_core_crash runs 200 of the same trials.
 *
 * Exit 0 only when every trial held: 0 corrupted chunks served, 0 errors,
 * 0 leaked pins, slots or leases.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chaos_engine.h"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kvtier-bench chaos [options]\n"
		"  --trials N    kill -9 trials (default 1000)\n"
		"  --world N     rank processes, plus one scheduler (default 3, at most %u)\n"
		"  --slots N     chunks the arena holds (default 96)\n"
		"  --prompts N   prompts of 8 chunks the workers cycle through (default 48)\n"
		"  --seed S      the run's seed (default: from the clock; printed)\n"
		"  --json        one JSON object instead of the summary\n", CH_MAX_WORLD);
}

static int num(const char *what, const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
	char *end;
	unsigned long long v = strtoull(s, &end, 0);

	if (!*s || *end || v < min || v > max) {
		fprintf(stderr, "chaos: --%s '%s': expected %" PRIu64 "..%" PRIu64 "\n", what, s,
			min, max);
		return -1;
	}
	*out = v;
	return 0;
}

int kvt_bench_chaos(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "trials", required_argument, NULL, 't' }, { "world", required_argument, NULL, 'w' },
		{ "slots", required_argument, NULL, 's' }, { "prompts", required_argument, NULL, 'p' },
		{ "seed", required_argument, NULL, 'S' }, { "json", no_argument, NULL, 'j' },
		{ "help", no_argument, NULL, 'h' }, { NULL, 0, NULL, 0 },
	};
	char name[KVT_NAME_MAX + 1];
	struct chaos_result res;
	struct chaos_opts o = { .name = name, .world = 3, .slots = 96, .prompts = 48,
				.fill_ms = 10, .expire = 24, .trials = 1000,
				.seed = kvt__now_ns() ^ (uint64_t)getpid() };
	uint64_t v;
	int c, json = 0;

	optind = 1;
	while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		switch (c) {
		case 't': if (num("trials", optarg, 1, 10000000, &v)) return 2; o.trials = (uint32_t)v; break;
		case 'w': if (num("world", optarg, 1, CH_MAX_WORLD, &v)) return 2; o.world = (uint32_t)v; break;
		case 's': if (num("slots", optarg, 8, 1u << 20, &v)) return 2; o.slots = (uint32_t)v; break;
		case 'p': if (num("prompts", optarg, 1, 1u << 16, &v)) return 2; o.prompts = (uint32_t)v; break;
		case 'S': if (num("seed", optarg, 0, UINT64_MAX, &v)) return 2; o.seed = v; break;
		case 'j': json = 1; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "chaos: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	snprintf(name, sizeof(name), "kvtier-bench-chaos-%d", (int)getpid());
	o.quiet = json;
	fprintf(stderr, "chaos: %u trials, %u ranks + a scheduler, %u slots, seed %#" PRIx64
		" (--seed to repeat)\n", o.trials, o.world, o.slots, o.seed);
	int rc = chaos_run(&o, &res);
	if (json) {
		printf("{\"trials\": %" PRIu64 ", \"world\": %u, \"slots\": %u, \"seed\": %" PRIu64
		       ", \"seconds\": %.2f, \"kills\": %" PRIu64 ", \"reaped_by_parent\": %" PRIu64
		       ", \"reaped_by_scheduler\": %" PRIu64 ", \"deferred\": %" PRIu64
		       ", \"saved\": %" PRIu64 ", \"verified\": %" PRIu64 ", \"corrupted\": %" PRIu64
		       ", \"errors\": %" PRIu64 ", \"ok\": %s}\n", res.trials_done, o.world, o.slots,
		       o.seed, (double)res.ns / 1e9, res.kills, res.reaped, res.tot[SE_REAPED],
		       res.deferred, res.tot[SE_SAVED], res.tot[SE_VERIFIED], res.tot[SE_BAD],
		       res.tot[SE_ERRORS], rc ? "false" : "true");
	} else {
		se_print_stats("chaos totals", res.tot);
		printf("kvtier-bench chaos: %" PRIu64 " of %u trials in %.1f s, seed %#" PRIx64 "\n"
		       "  %" PRIu64 " processes killed (-9), %" PRIu64 " entries reaped by the parent, "
		       "%" PRIu64 " by the scheduler; %" PRIu64 " trials left the dead to the next "
		       "trial's attaches\n"
		       "  %" PRIu64 " chunks saved, %" PRIu64 " chunk reads verified against their "
		       "stamps (pinned reads and every READY chunk after each trial)\n"
		       "  corrupted chunks served: %" PRIu64 ", errors: %" PRIu64 ", leaked pins, slots "
		       "or leases: %s\n",
		       res.trials_done, o.trials, (double)res.ns / 1e9, o.seed, res.kills, res.reaped,
		       res.tot[SE_REAPED], res.deferred, res.tot[SE_SAVED], res.tot[SE_VERIFIED],
		       res.tot[SE_BAD], res.tot[SE_ERRORS], rc ? "see below" : "0 (kvt_check clean)");
	}
	if (rc) {
		fprintf(stderr, "chaos: FAILED: %s\n", res.msg);
		return 1;
	}
	return 0;
}
