/* kvtier-stat - one screen of a live segment, read with no daemon: an
 * observer handle (no table entry; nothing in the segment changes).
 *
 *   kvtier-stat [NAME] [--dir DIR] [--watch SECONDS] [--json] [--count N]
 *   kvtier-stat NAME --remove [--force] [--dir DIR]
 *
 * --watch redraws in place like top (rates from the previous frame); q or
 * Ctrl-C ends it.  --json prints the same as kvtierd's /status.
 *
 * --remove removes the segment, refusing while a process has it attached
 * (kvtierd, a rank, a scheduler, a client: each named with its pid) or
 * when it cannot be read to tell, unless --force.  Attached processes keep
 * their mapping until they exit (the kernel frees it then); new attaches
 * no longer find it.  Dead processes' entries are no users.
 */
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <unistd.h>

#include "kvt_core.h"
#include "kvtier.h"
#include "kvt_l3_chan.h"
#include "kvt_l3_client.h"
#include "snap.h"
#ifdef KVTIER_HAVE_NUMA
#include "kvt_numa.h"
#endif

#ifndef KVTIER_VERSION
#define KVTIER_VERSION "0"
#endif

static volatile sig_atomic_t stop;
static void on_signal(int sig) { (void)sig; stop = 1; }

static int attach(const char *name, const char *dir, int any_uid, kvt_seg **out)
{
	struct kvt_seg_attach_opts a = {
		.size = sizeof(a), .name = name, .dir = dir, .role = KVT_ROLE_OBSERVER,
		.flags = KVT_SEG_F_GROUP | (any_uid ? KVT_SEG_F_ANY_UID : 0) };
	int r = kvt_seg_attach(&a, out);

#ifdef KVTIER_HAVE_NUMA
	/* where a creator that found huge pages put it (as kvt_open looks) */
	static const uint64_t sizes[2] = { 2ULL << 20, 1ULL << 30 };
	for (int i = 0; r == -ENOENT && !dir && i < 2; i++) {
		struct kvt_hugetlbfs h;
		if (kvt_hugetlbfs_find(NULL, sizes[i], 0, &h) == 0) {
			struct kvt_seg_attach_opts b = a;
			b.dir = h.dir;
			int q = kvt_seg_attach(&b, out);
			if (q != -ENOENT)
				return q;
		}
	}
	if (r == -ENOENT)
		r = kvt_seg_attach(&a, out); /* the /dev/shm message */
#endif
	return r;
}

/* The L3's figures, when the segment's kvtierd has one: asked over its L3
 * channel (the segment holds none of them); no line when none answers. */
static void l3_figures(kvt_seg *s, struct kvtd_ctx *c)
{
	c->l3_on = kvt__l3c_status(s, &c->l3, 200) == 0;
}

/* --remove: 0 removed, 1 refused or failed. */
static int remove_segment(const char *name, const char *dir, int any_uid, int force)
{
	char who[1024] = "";
	size_t n = 0;
	uint32_t users = 0;
	kvt_seg *s;
	int r = attach(name, dir, any_uid, &s);

#define WHO(...) do { \
		if (n < sizeof(who)) \
			n += (size_t)snprintf(who + n, sizeof(who) - n, __VA_ARGS__); \
	} while (0)
	if (r == -ENOENT) {
		fprintf(stderr, "kvtier-stat: --remove: no segment '%s'%s%s\n", name,
			dir ? " in " : "", dir ? dir : "");
		return 1;
	}
	if (r && !force) {
		fprintf(stderr, "kvtier-stat: --remove: segment '%s' cannot be read (%s), so "
			"whether processes use it is unknown; --force removes it anyway\n", name,
			kvt_core_last_error());
		return 1;
	}
	if (!r) {
		int owner = kvt_seg_owner(s);
		if (owner) {
			users++;
			WHO("kvtierd (pid %d, its owner)", owner);
		}
		for (uint32_t e = 0; e < kvt_seg_n_entries(s); e++) {
			struct kvt_entry_info in;
			if (kvt_seg_entry_info(s, e, &in) || in.state != KVT_ENTRY_ATTACHED ||
			    (owner && in.pid == owner && in.role == KVT_ROLE_CLIENT))
				continue; /* (the owner's own client entry: named once) */
			users++;
			if (in.role == KVT_ROLE_RANK)
				WHO("%srank %u of instance %u (pid %d)", n ? ", " : "", in.rank,
				    in.instance, in.pid);
			else if (in.role == KVT_ROLE_SCHEDULER)
				WHO("%sthe scheduler of instance %u (pid %d)", n ? ", " : "",
				    in.instance, in.pid);
			else
				WHO("%sa client (pid %d)", n ? ", " : "", in.pid);
		}
		kvt_seg_detach(s);
	}
#undef WHO
	if (users && !force) {
		fprintf(stderr, "kvtier-stat: --remove: segment '%s' is in use by %u process%s: "
			"%s; stop them first (kvtierd: systemctl stop kvtierd), or --force: they "
			"keep their mapping until they exit, and new attaches do not find it\n",
			name, users, users > 1 ? "es" : "", who);
		return 1;
	}
	r = kvt_unlink(name, dir);
	if (r) {
		fprintf(stderr, "kvtier-stat: --remove: %s\n", kvt_last_error());
		return 1;
	}
	printf("removed segment '%s'%s%s\n", name, users ? " (still mapped by: " : "",
	       users ? who : "");
	if (users)
		printf(")\n");
	return 0;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: kvtier-stat [NAME] [--dir DIR] [--watch SECONDS] [--json] [--count N]\n"
		"  NAME            segment (default $KVTIER_SEGMENT, else kvtier)\n"
		"  --dir DIR       its directory (default /dev/shm, then hugetlbfs mounts)\n"
		"  --watch S       redraw every S seconds (q or Ctrl-C quits)\n"
		"  --count N       with --watch: stop after N frames\n"
		"  --json          JSON (kvtierd's /status) instead of the screen\n"
		"  --any-uid       read a segment of another user\n"
		"  --remove        remove the segment (refused while processes have it\n"
		"                  attached, or when it cannot be read, unless --force)\n");
}

int main(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "dir", required_argument, NULL, 'd' }, { "watch", required_argument, NULL, 'w' },
		{ "json", no_argument, NULL, 'j' }, { "count", required_argument, NULL, 'n' },
		{ "any-uid", no_argument, NULL, 'u' }, { "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' }, { "remove", no_argument, NULL, 'r' },
		{ "force", no_argument, NULL, 'f' }, { NULL, 0, NULL, 0 } };
	const char *dir = NULL, *name;
	double watch = 0;
	long count = 0;
	int json = 0, any_uid = 0, rm = 0, force = 0, c;
	char *end;

	while ((c = getopt_long(argc, argv, "d:w:jn:h", lo, NULL)) != -1) {
		switch (c) {
		case 'd': dir = optarg; break;
		case 'w':
			watch = strtod(optarg, &end);
			if (*end || !(watch >= 0.1 && watch <= 3600)) {
				fprintf(stderr, "kvtier-stat: --watch '%s': seconds, 0.1..3600\n", optarg);
				return 2;
			}
			break;
		case 'n':
			count = strtol(optarg, &end, 10);
			if (*end || count < 1) {
				fprintf(stderr, "kvtier-stat: --count '%s': a positive number\n", optarg);
				return 2;
			}
			break;
		case 'j': json = 1; break;
		case 'u': any_uid = 1; break;
		case 'r': rm = 1; break;
		case 'f': force = 1; break;
		case 'V': printf("kvtier-stat %s\n", KVTIER_VERSION); return 0;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (argc - optind > 1) {
		usage(stderr);
		return 2;
	}
	name = optind < argc ? argv[optind] : getenv("KVTIER_SEGMENT");
	if (!name || !*name)
		name = "kvtier";
	if (kvt_seg_name_valid(name)) {
		fprintf(stderr, "kvtier-stat: '%s': a segment name is 1-64 of [A-Za-z0-9._-] (no '/')\n",
			name);
		return 2;
	}
	if (force && !rm) {
		fprintf(stderr, "kvtier-stat: --force goes with --remove\n");
		return 2;
	}
	if (rm && (watch || json || count)) {
		fprintf(stderr, "kvtier-stat: --remove takes no --watch, --json or --count\n");
		return 2;
	}
	if (rm)
		return remove_segment(name, dir, any_uid, force);
	kvt_seg *s;
	int r = attach(name, dir, any_uid, &s);
	if (r) {
		fprintf(stderr, "kvtier-stat: %s\n", kvt_core_last_error());
		return 1;
	}
	char model[KVT_MODEL_TEXT_MAX];
	struct kvtd_ctx ctx = { .version = KVTIER_VERSION,
				.model = kvt_seg_model(s, model, sizeof(model)), /* its creator's */
				.expect_instances = kvt_seg_geometry(s)->n_instances };
	struct kvtd_snap prev, cur;
	int have_prev = 0, tty = isatty(STDOUT_FILENO) && isatty(STDIN_FILENO);
	struct termios saved;

	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	if (watch && tty && tcgetattr(STDIN_FILENO, &saved) == 0) {
		struct termios raw = saved;
		raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
		tcsetattr(STDIN_FILENO, TCSANOW, &raw);
	} else {
		tty = 0;
	}
	for (long frame = 0; !stop; frame++) {
		l3_figures(s, &ctx);
		if (kvtd_snap_read(s, &cur)) {
			fprintf(stderr, "kvtier-stat: out of memory\n");
			r = 1;
			break;
		}
		char *out = json ? kvtd_json(&cur, &ctx, have_prev ? &prev : NULL)
				 : kvtd_screen(&cur, &ctx, have_prev ? &prev : NULL, 100);
		if (watch && !json)
			fputs("\033[H\033[2J", stdout);
		fputs(out ? out : "out of memory\n", stdout);
		if (watch && !json)
			printf("\n(every %.1f s; q quits)\n", watch);
		fflush(stdout);
		free(out);
		if (have_prev)
			kvtd_snap_free(&prev);
		prev = cur;
		have_prev = 1;
		if (!watch || (count && frame + 1 >= count))
			break;
		struct pollfd p = { .fd = STDIN_FILENO, .events = POLLIN };
		if (poll(&p, tty ? 1 : 0, (int)(watch * 1000)) > 0) {
			char ch;
			if (read(STDIN_FILENO, &ch, 1) == 1 && (ch == 'q' || ch == 'Q'))
				break;
		}
	}
	if (tty)
		tcsetattr(STDIN_FILENO, TCSANOW, &saved);
	if (have_prev)
		kvtd_snap_free(&prev);
	kvt_seg_detach(s);
	return r;
}
