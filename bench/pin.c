/* pin.c - kvtier-bench pin: N processes locking one shared arena, each
 * its own registration, as N ranks of the replicated (MLA) layout do, or
 * N instances sharing a segment.  On AMD every lock is charged in full to
 * the amdgpu driver's one node-wide budget (about RAM - RAM/64 - 1 GiB),
 * however many processes lock the same pages: the check of what
 * `kvtier-size --gpu amd` predicts.  On NVIDIA (cuMemHostRegister) and the
 * host backend there is no such budget; the figures are then the
 * registration times alone.
 *
 *   kvtier-bench pin [--procs N] [--bytes SIZE | --fraction F] [--budget SIZE]
 *                    [--backend B] [--device D]
 *
 * The processes lock one after another, each holding its lock until all
 * have tried, so the k-th sees the k-1 before it charged.  Prints one
 * line per process and a verdict line:
 *   pin: budget B, N x S: predicted K of N, locked M of N: MATCH|DIFFERS
 * (DIFFERS: other locks on the node -- an engine's, another instance's --
 * or a driver whose limit differs; the line says which way).  Exit status
 * 0 unless the set-up failed; 3 when a refusal's message does not name the
 * pinning budget (the operator would not know why). */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "bench_util.h"
#include "kvt_dma.h"
#include "kvt_size.h"

#define MAX_PROCS 64

struct pin_res {
	int rc;
	double seconds;
	char backend[16];
	char msg[480];
};

static void usage(FILE *f)
{
	fprintf(f,
"usage: kvtier-bench pin [options]\n"
"  --procs N       processes, each locking the whole arena (default 2)\n"
"  --bytes SIZE    the arena (default: --fraction of the budget)\n"
"  --fraction F    the arena as a fraction of the budget (default 0.55:\n"
"                  the first process fits, the second does not)\n"
"  --budget SIZE   the budget to predict against (default RAM - RAM/64 -\n"
"                  1 GiB, the amdgpu driver's limit)\n"
"  --backend B     auto (default), hsa, cuda, host\n"
"  --device D      GPU ordinal (default 0)\n");
}

/* One process: open, lock the arena, report, hold until released. */
static void child(const char *backend, int device, char *base, uint64_t len, int res_fd,
		  int hold_fd)
{
	struct kvt_dma_config dc = { .size = sizeof(dc), .backend = backend,
				     .device = device, .flags = KVT_DMA_F_QUIET };
	struct pin_res r;
	kvt_dma_mr *mr = NULL;
	kvt_dma *d = NULL;
	char c;

	memset(&r, 0, sizeof(r));
	r.rc = kvt_dma_open(&dc, &d);
	if (r.rc) {
		snprintf(r.msg, sizeof(r.msg), "open: %s", kvt_dma_last_error());
	} else {
		uint64_t t0 = kvt__now_ns();

		snprintf(r.backend, sizeof(r.backend), "%s", kvt_dma_backend(d));
		r.rc = kvt_dma_mem_register(d, base, len, 2u << 20, &mr);
		r.seconds = (kvt__now_ns() - t0) * 1e-9;
		if (r.rc)
			snprintf(r.msg, sizeof(r.msg), "%s", kvt_dma_last_error());
	}
	if (write(res_fd, &r, sizeof(r)) != (ssize_t)sizeof(r))
		_exit(1);
	while (read(hold_fd, &c, 1) < 0 && errno == EINTR)
		; /* EOF: the parent let go */
	if (mr)
		kvt_dma_mem_unregister(d, mr);
	kvt_dma_close(d);
	_exit(0);
}

int kvt_bench_pin(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "procs", required_argument, NULL, 'n' },
		{ "bytes", required_argument, NULL, 'b' },
		{ "fraction", required_argument, NULL, 'f' },
		{ "budget", required_argument, NULL, 'B' },
		{ "backend", required_argument, NULL, 'k' },
		{ "device", required_argument, NULL, 'd' },
		{ "help", no_argument, NULL, 'h' },
		{ 0, 0, 0, 0 },
	};
	const char *backend = "auto";
	uint64_t bytes = 0, budget = 0, ram;
	double fraction = 0.55;
	int procs = 2, device = 0, opt, hold[2], locked = 0, unnamed = 0, predicted;
	pid_t pids[MAX_PROCS];
	char a[32], b[32], c[32];
	char *end, *base;
	int fd;

	while ((opt = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		int bad = 0;

		switch (opt) {
		case 'n':
			procs = (int)strtol(optarg, &end, 10);
			bad = *end || procs < 1 || procs > MAX_PROCS;
			break;
		case 'b': bad = parse_size(optarg, &bytes); break;
		case 'B': bad = parse_size(optarg, &budget); break;
		case 'f':
			fraction = strtod(optarg, &end);
			bad = *end || fraction <= 0 || fraction > 1;
			break;
		case 'k': backend = optarg; break;
		case 'd':
			device = (int)strtol(optarg, &end, 10);
			bad = *end || device < 0;
			break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
		if (bad) {
			fprintf(stderr, "kvtier-bench pin: bad value '%s'\n", optarg);
			usage(stderr);
			return 2;
		}
	}
	ram = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
	if (!budget)
		budget = kvt_size_kfd_limit(ram);
	if (!bytes)
		bytes = (uint64_t)((double)budget * fraction);
	if (bytes < (2u << 20) || bytes > ram) {
		fprintf(stderr, "kvtier-bench pin: an arena of %llu bytes: from 2 MiB to the RAM\n",
			(unsigned long long)bytes);
		return 2;
	}
	bytes = (bytes + (2u << 20) - 1) & ~((uint64_t)(2u << 20) - 1);
	predicted = (int)(budget / bytes) < procs ? (int)(budget / bytes) : procs;
	if (bytes > ram / 10 * 9) {
		fprintf(stderr, "kvtier-bench pin: an arena of %s does not fit this machine's "
			"%s of RAM\n", human(bytes, a, sizeof(a)), human(ram, b, sizeof(b)));
		return 1;
	}
	/* one arena for all, as the segment is: shared pages, faulted in */
	fd = memfd_create("kvtier-bench-pin", 0);
	if (fd < 0 || ftruncate(fd, (off_t)bytes)) {
		perror("kvtier-bench pin: memfd");
		return 1;
	}
	base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
	close(fd);
	if (base == MAP_FAILED) {
		perror("kvtier-bench pin: mmap");
		return 1;
	}
	if (pipe(hold)) {
		perror("kvtier-bench pin: pipe");
		return 1;
	}
	printf("kvtier-bench pin: %d processes, each locking the same %s arena; budget %s "
	       "(RAM %s)\n", procs, human(bytes, a, sizeof(a)), human(budget, b, sizeof(b)),
	       human(ram, c, sizeof(c)));
	for (int i = 0; i < procs; i++) {
		struct pin_res r;
		int res[2];

		if (pipe(res)) {
			perror("kvtier-bench pin: pipe");
			return 1;
		}
		pids[i] = fork();
		if (pids[i] < 0) {
			perror("kvtier-bench pin: fork");
			return 1;
		}
		if (pids[i] == 0) {
			close(res[0]);
			close(hold[1]);
			child(backend, device, base, bytes, res[1], hold[0]);
		}
		close(res[1]);
		if (read(res[0], &r, sizeof(r)) != (ssize_t)sizeof(r)) {
			memset(&r, 0, sizeof(r));
			r.rc = -EPIPE;
			snprintf(r.msg, sizeof(r.msg), "the process died before it reported");
		}
		close(res[0]);
		if (r.rc == 0) {
			locked++;
			printf("  process %d (%s): locked in %.3f s (%.2f GB/s)\n", i + 1, r.backend,
			       r.seconds, r.seconds > 0 ? bytes / r.seconds / 1e9 : 0.0);
		} else {
			printf("  process %d (%s): refused (%s): %s\n", i + 1,
			       r.backend[0] ? r.backend : "?", strerror(-r.rc), r.msg);
			if (r.rc == -ENOMEM && !strstr(r.msg, "pinning budget"))
				unnamed++;
		}
	}
	close(hold[1]); /* every child lets go */
	for (int i = 0; i < procs; i++)
		waitpid(pids[i], NULL, 0);
	munmap(base, bytes);
	printf("pin: budget %s, %d x %s: predicted %d of %d, locked %d of %d: %s\n",
	       human(budget, a, sizeof(a)), procs, human(bytes, b, sizeof(b)), predicted, procs,
	       locked, procs, locked == predicted ? "MATCH" :
	       locked < predicted ? "DIFFERS (fewer: other locks on the node, or a lower limit)" :
	       "DIFFERS (more: no such budget here, or a higher limit)");
	if (unnamed) {
		printf("pin: %d refusal(s) with -ENOMEM did not name the pinning budget\n", unnamed);
		return 3;
	}
	return 0;
}
