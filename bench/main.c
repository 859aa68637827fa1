/* main.c - kvtier-bench: the benchmark programs, one subcommand each.
 *
 *   kvtier-bench ops [options]        metadata operations (bench/ops.c)
 *   kvtier-bench bandwidth [options]  save/load GB/s (bench/bandwidth.c)
 *   kvtier-bench replay [options]     a trace through the real API (bench/replay.c)
 *   kvtier-bench preempt [options]    the long preemption stress (bench/preempt.c)
 *   kvtier-bench lookup [options]     hashing and lookups, C and Python (bench/lookup.c)
 *   kvtier-bench chaos [options]      kill -9 trials over a running workload (bench/chaos.c)
 *   kvtier-bench disk [options]       the disk tier against fio (bench/disk.c)
 *   kvtier-bench pin [options]        N processes locking one arena (bench/pin.c)
 *   kvtier-bench l3 [options]         the L3 store's put/get GB/s, Redis or Mooncake (bench/l3.c)
 *   kvtier-bench replay-l3 [options]  the trace over N nodes and one L3 (bench/replay_l3.c)
 */
#include <stdio.h>
#include <string.h>

int kvt_bench_ops(int argc, char **argv);
int kvt_bench_bandwidth(int argc, char **argv);
int kvt_bench_replay(int argc, char **argv);
int kvt_bench_preempt(int argc, char **argv);
int kvt_bench_lookup(int argc, char **argv);
int kvt_bench_chaos(int argc, char **argv);
int kvt_bench_disk(int argc, char **argv);
int kvt_bench_diskkill(int argc, char **argv);
int kvt_bench_pin(int argc, char **argv);
int kvt_bench_l3(int argc, char **argv);
int kvt_bench_replay_l3(int argc, char **argv);

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kvtier-bench <command> [options]\n"
		"\n"
		"commands:\n"
		"  ops        lookup+pin+release and save cost per chunk, 1 and 2 processes\n"
		"  bandwidth  save/load bandwidth against the platform's copy ceiling\n"
		"  replay     eviction policy hit rates on a trace\n"
		"  preempt    core's protocols under preemption: delays, slow writers, checks\n"
		"  lookup     hash + lookup per request, C and Python, against XXH3 and a ZMQ lookup\n"
		"  chaos      kill -9 trials over a running workload: 0 corrupted, 0 leaked\n"
		"  disk       the disk tier's demotion and promotion GB/s against fio\n"
		"  diskkill   the disk tier under kill -9 of its engine and clients: 0 wrong\n"
		"  pin        N processes locking one arena: AMD's pinning budget against kvtier-size\n"
		"  l3         the L3 store (Redis, Mooncake): put/get GB/s against the store's own client\n"
		"  replay-l3  the trace over N nodes sharing one L3 store: hit rates\n"
		"\n"
		"kvtier-bench <command> --help describes a command's options.\n");
}

int main(int argc, char **argv)
{
	if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
		usage(argc < 2 ? stderr : stdout);
		return argc < 2 ? 2 : 0;
	}
	if (!strcmp(argv[1], "ops"))
		return kvt_bench_ops(argc - 1, argv + 1);
	if (!strcmp(argv[1], "bandwidth"))
		return kvt_bench_bandwidth(argc - 1, argv + 1);
#ifdef KVTIER_BENCH_MINIMAL
	/* the GPU check's build (KVTIER_MINIMAL): ops and bandwidth only */
	fprintf(stderr, "kvtier-bench %s: not in this build (KVTIER_MINIMAL: ops, bandwidth)\n",
		argv[1]);
	return 2;
#else
	if (!strcmp(argv[1], "replay"))
		return kvt_bench_replay(argc - 1, argv + 1);
	if (!strcmp(argv[1], "preempt"))
		return kvt_bench_preempt(argc - 1, argv + 1);
	if (!strcmp(argv[1], "lookup"))
		return kvt_bench_lookup(argc - 1, argv + 1);
	if (!strcmp(argv[1], "chaos"))
		return kvt_bench_chaos(argc - 1, argv + 1);
	if (!strcmp(argv[1], "disk"))
		return kvt_bench_disk(argc - 1, argv + 1);
	if (!strcmp(argv[1], "diskkill"))
		return kvt_bench_diskkill(argc - 1, argv + 1);
	if (!strcmp(argv[1], "pin"))
		return kvt_bench_pin(argc - 1, argv + 1);
	if (!strcmp(argv[1], "l3") || !strcmp(argv[1], "replay-l3")) {
#ifdef KVTIER_BENCH_L3
		if (!strcmp(argv[1], "replay-l3"))
			return kvt_bench_replay_l3(argc - 1, argv + 1);
		return kvt_bench_l3(argc - 1, argv + 1);
#else
		fprintf(stderr, "kvtier-bench l3: built without the L3 tier (libhiredis-dev)\n");
		return 2;
#endif
	}
	fprintf(stderr, "kvtier-bench: unknown command '%s'\n\n", argv[1]);
	usage(stderr);
	return 2;
#endif
}
