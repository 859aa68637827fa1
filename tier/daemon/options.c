/* options.c - kvtierd's flags and config file (options.h). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <sys/stat.h>

#include <ini.h>

#include "kvt_disk.h"
#include "options.h"

#ifndef KVTIER_VERSION
#define KVTIER_VERSION "0"
#endif

/* ---- options ---- */

enum {
	O_SEGMENT = 256, O_SEGMENT_DIR, O_MODEL, O_MODEL_CONFIG, O_KV_DTYPE, O_TP, O_PP,
	O_WORLD, O_INSTANCES, O_CHUNK_TOKENS, O_TIER_GIB, O_SLOTS, O_TOKENS,
	O_GROUP, O_REPLICATED, O_NUMA_NODES, O_HUGEPAGES, O_EXPECT_INSTANCES,
	O_EXPECT_SCHEDULERS, O_HTTP, O_NO_HTTP, O_RECREATE, O_UNLINK, O_DRAIN_TIMEOUT,
	O_REAP_INTERVAL, O_WRITE_ONLY_WINDOW, O_LOG, O_CONFIG, O_NO_LOCK, O_GROUP_ACCESS,
	O_VERSION, O_VLLM_BLOCK, O_DISK, O_DISK_GIB, O_DISK_DIRECT, O_DISK_ADMIT,
	O_DISK_DEPTH, O_DISK_RESET, O_DISK_KEY, O_L3, O_L3_ADMIT, O_L3_AUTH_FILE, O_L3_KEY,
	O_L3_TIMEOUT, O_L3_NEGATIVE, O_L3_PYTHON, O_L3_ENCRYPT, O_LMCACHE_PORT, O_LMCACHE_HOST,
};

static const struct option LONGOPTS[] = {
	{ "segment", required_argument, NULL, O_SEGMENT },
	{ "segment-dir", required_argument, NULL, O_SEGMENT_DIR },
	{ "model", required_argument, NULL, O_MODEL },
	{ "model-config", required_argument, NULL, O_MODEL_CONFIG },
	{ "kv-dtype", required_argument, NULL, O_KV_DTYPE },
	{ "tp", required_argument, NULL, O_TP },
	{ "pp", required_argument, NULL, O_PP },
	{ "world", required_argument, NULL, O_WORLD },
	{ "instances", required_argument, NULL, O_INSTANCES },
	{ "chunk-tokens", required_argument, NULL, O_CHUNK_TOKENS },
	{ "tier-gib", required_argument, NULL, O_TIER_GIB },
	{ "slots", required_argument, NULL, O_SLOTS },
	{ "tokens", required_argument, NULL, O_TOKENS },
	{ "group", required_argument, NULL, O_GROUP },
	{ "replicated", no_argument, NULL, O_REPLICATED },
	{ "numa-nodes", required_argument, NULL, O_NUMA_NODES },
	{ "hugepages", required_argument, NULL, O_HUGEPAGES },
	{ "expect-instances", required_argument, NULL, O_EXPECT_INSTANCES },
	{ "expect-schedulers", no_argument, NULL, O_EXPECT_SCHEDULERS },
	{ "http", required_argument, NULL, O_HTTP },
	{ "no-http", no_argument, NULL, O_NO_HTTP },
	{ "recreate", no_argument, NULL, O_RECREATE },
	{ "unlink", no_argument, NULL, O_UNLINK },
	{ "drain-timeout", required_argument, NULL, O_DRAIN_TIMEOUT },
	{ "reap-interval", required_argument, NULL, O_REAP_INTERVAL },
	{ "write-only-window", required_argument, NULL, O_WRITE_ONLY_WINDOW },
	{ "log", required_argument, NULL, O_LOG },
	{ "config", required_argument, NULL, O_CONFIG },
	{ "no-lock", no_argument, NULL, O_NO_LOCK },
	{ "group-access", no_argument, NULL, O_GROUP_ACCESS },
	{ "vllm-block-size", required_argument, NULL, O_VLLM_BLOCK },
	{ "disk", required_argument, NULL, O_DISK },
	{ "disk-gib", required_argument, NULL, O_DISK_GIB },
	{ "disk-direct", required_argument, NULL, O_DISK_DIRECT },
	{ "disk-admit", required_argument, NULL, O_DISK_ADMIT },
	{ "disk-depth", required_argument, NULL, O_DISK_DEPTH },
	{ "disk-reset", no_argument, NULL, O_DISK_RESET },
	{ "disk-key", required_argument, NULL, O_DISK_KEY },
	{ "l3", required_argument, NULL, O_L3 },
	{ "l3-admit", required_argument, NULL, O_L3_ADMIT },
	{ "l3-auth-file", required_argument, NULL, O_L3_AUTH_FILE },
	{ "l3-key", required_argument, NULL, O_L3_KEY },
	{ "l3-timeout-ms", required_argument, NULL, O_L3_TIMEOUT },
	{ "l3-negative-ms", required_argument, NULL, O_L3_NEGATIVE },
	{ "l3-python", required_argument, NULL, O_L3_PYTHON },
	{ "l3-encrypt", no_argument, NULL, O_L3_ENCRYPT },
	{ "lmcache-port", required_argument, NULL, O_LMCACHE_PORT },
	{ "lmcache-host", required_argument, NULL, O_LMCACHE_HOST },
	{ "version", no_argument, NULL, O_VERSION },
	{ "help", no_argument, NULL, 'h' },
	{ NULL, 0, NULL, 0 },
};

static void usage(FILE *f)
{
	fprintf(f,
"usage: kvtierd [options]\n"
"Creates (or warm-attaches) and owns the node's kvtier segment, reaps dead\n"
"processes, serves GET /healthcheck, /healthcheck/segment, /metrics, /status.\n"
"\n"
"segment\n"
"  --segment NAME          segment name (KVTIER_SEGMENT, default kvtier)\n"
"  --segment-dir DIR       directory (hugetlbfs mount); default POSIX shm, or\n"
"                          a hugetlbfs mount when huge pages are free\n"
"  --hugepages auto|on|off (KVTIER_HUGEPAGES)\n"
"  --numa-nodes LIST       nodes the arena is bound to (KVTIER_NUMA_NODES)\n"
"  --group-access          mode 0660 (ranks of other users in the group)\n"
"  --recreate              replace a segment of another layout (never a live owner's)\n"
"layout: either a model's config.json ...\n"
"  --model-config PATH     Hugging Face config.json (sizing as kvtier-size; with\n"
"                          --group, the model identity's file fields only)\n"
"  --kv-dtype NAME         KV cache dtype (default: the model's)\n"
"  --tp N, --pp N          parallel sizes: world = tp x pp\n"
"  --vllm-block-size N     the layout kvtier.vllm (vLLM's connector) opens: each\n"
"                          layer's block as two halves, chunks of one vLLM block\n"
"                          of N tokens unless --chunk-tokens; --model as the\n"
"                          engine logs it (its kvtierd line)\n"
"... or the layer groups of one rank\n"
"  --group LAYERS:BYTES    layers and bytes per token per layer, one rank (repeat\n"
"                          for several groups)\n"
"  --replicated            MLA-style: every rank holds the same bytes\n"
"  --world N               ranks per instance (KVTIER_WORLD)\n"
"common\n"
"  --model ID              model identity, as the engines give it (KVTIER_MODEL);\n"
"                          --model-config appends its files' fields (config\n"
"                          digest, snapshot commit or weight files)\n"
"  --instances N           engine instances sharing the segment (KVTIER_INSTANCES)\n"
"  --chunk-tokens N        tokens per chunk (KVTIER_CHUNK_TOKENS, default 256)\n"
"  --tier-gib G | --slots N | --tokens N   capacity: one rank's GiB, chunks,\n"
"                          or tokens (KVTIER_TIER_GIB, default 1)\n"
"service\n"
"  --expect-instances N    instances whose ranks /healthcheck requires (default all)\n"
"  --expect-schedulers     /healthcheck also requires each instance's scheduler\n"
"  --http ADDR:PORT        listen address (default 127.0.0.1:%d)\n"
"  --no-http               no HTTP server\n"
"  --drain-timeout S       SIGTERM: wait up to S seconds for live leases (default 30)\n"
"  --reap-interval S       reaper period (default 0.2)\n"
"  --write-only-window S   window of the write-only check (default 60)\n"
"  --unlink                remove the segment at exit (default: it stays)\n"
"  --no-lock               do not mlock the arena\n"
"  --log FILE              log to FILE instead of stderr (the library's lines\n"
"                          too); reopened on SIGHUP\n"
"  --config FILE           `key = value` lines with the long option names;\n"
"                          flags override it, it overrides KVTIER_* variables\n"
"disk tier (NVMe, below DRAM; driven by this daemon through io_uring)\n"
"  --disk PATH             file (created) or block device for evicted chunks\n"
"  --disk-gib G            its size (default: the existing file's)\n"
"  --disk-admit POLICY     all | second-hit | none (default all)\n"
"  --disk-direct MODE      auto | on | off: O_DIRECT (default auto: buffered\n"
"                          with a warning where the file system has none)\n"
"  --disk-depth N          I/Os in flight (default 64)\n"
"  --disk-reset            format a disk file of another layout or size, or made\n"
"                          with another key (its chunks are lost)\n"
"  --disk-key PATH         the chunk MAC's key file (default: PATH.key beside the\n"
"                          disk file; a block device needs one); made, mode 0600,\n"
"                          when the disk is formatted\n"
"L3 tier (a distributed store shared by the nodes: Redis Cluster, one Redis, or\n"
"Mooncake Store)\n"
"  --l3 URL                redis://HOST:PORT[,HOST:PORT...] (any of the cluster's\n"
"                          masters; the rest are found), or\n"
"                          mooncake://MASTER[:PORT][?metadata=URL|P2PHANDSHAKE\n"
"                          &protocol=tcp|rdma&device=NIC&host=ADDR&segment=SIZE]\n"
"  --l3-key PATH           the fleet's object key: the same file on every node\n"
"                          (made, mode 0600, when missing: copy it to the others)\n"
"  --l3-admit POLICY       all | second-hit | none (default all)\n"
"  --l3-encrypt            encrypt the objects, not only authenticate them (the\n"
"                          store then holds no prompt's KV in the clear); the\n"
"                          seal then runs at a third of its rate (README, L3)\n"
"  --l3-auth-file PATH     \"password\" or \"user password\" (an ACL user), mode 0600\n"
"  --l3-timeout-ms N       connect and command timeout (default 1000)\n"
"  --l3-negative-ms N      how long a chunk the store lacked is not asked for\n"
"                          again (default 2000)\n"
"  --l3-python PATH        mooncake: the Python that has Mooncake's wheel\n"
"                          (scripts/mooncake.sh; default $KVTIER_MOONCAKE_PYTHON,\n"
"                          else python3)\n"
"LMCache front end (engines whose LMCache client speaks `lmcache server`'s\n"
"multiprocess protocol, 0.5.6, use this segment unchanged)\n"
"  --lmcache-port PORT     serve it on this TCP port (LMCache's default 5555);\n"
"                          off by default\n"
"  --lmcache-host ADDR     its IPv4 address (default 127.0.0.1: the node's own\n"
"                          engines; the protocol has no authentication)\n",
		DEFAULT_PORT);
}

static int bad(const char *opt, const char *val, const char *why)
{
	fprintf(stderr, "kvtierd: --%s '%s': %s\n", opt, val ? val : "", why);
	return -EINVAL;
}

static int parse_u64(const char *opt, const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
	char *end;
	unsigned long long v;

	if (!s || !*s || *s == '-' || *s == '+' || *s == ' ')
		return bad(opt, s, "expected a whole number");
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end)
		return bad(opt, s, "expected a whole number");
	if (v < min || v > max) {
		char why[96];
		snprintf(why, sizeof(why), "out of range %llu..%llu", (unsigned long long)min,
			 (unsigned long long)max);
		return bad(opt, s, why);
	}
	*out = v;
	return 0;
}

static int parse_u32(const char *opt, const char *s, uint32_t min, uint32_t max, uint32_t *out)
{
	uint64_t v;
	int r = parse_u64(opt, s, min, max, &v);

	if (!r)
		*out = (uint32_t)v;
	return r;
}

/* A finite number from min to max (of `unit`, for the message). */
static int parse_real(const char *opt, const char *s, double min, double max, const char *unit,
		      double *out)
{
	char *end;
	double v;
	char why[128];

	snprintf(why, sizeof(why), "expected %s from %.10g to %.10g", unit, min, max);
	if (!s || !*s || *s == ' ' || *s == '\t')
		return bad(opt, s, why);
	errno = 0;
	v = strtod(s, &end);
	if (errno || *end || !(v >= min && v <= max)) /* !(...) refuses nan */
		return bad(opt, s, why);
	*out = v;
	return 0;
}

static int parse_secs(const char *opt, const char *s, double min, double max, double *out)
{
	return parse_real(opt, s, min, max, "seconds", out);
}

static int parse_http(struct opts *o, const char *s)
{
	const char *colon = strrchr(s, ':');
	uint32_t port;
	struct in_addr a;

	if (!colon || colon == s || (size_t)(colon - s) >= sizeof(o->http_addr))
		return bad("http", s, "expected ADDR:PORT (an IPv4 address)");
	memcpy(o->http_addr, s, (size_t)(colon - s));
	o->http_addr[colon - s] = 0;
	if (inet_pton(AF_INET, o->http_addr, &a) != 1)
		return bad("http", s, "the address is not an IPv4 address");
	if (parse_u32("http", colon + 1, 1, 65535, &port))
		return -EINVAL;
	o->http_port = (uint16_t)port;
	return 0;
}

static int parse_group(struct opts *o, const char *s)
{
	char buf[64], *colon;
	uint32_t layers, bpt;

	if (o->n_groups >= 8)
		return bad("group", s, "at most 8 groups");
	snprintf(buf, sizeof(buf), "%s", s);
	colon = strchr(buf, ':');
	if (!colon)
		return bad("group", s, "expected LAYERS:BYTES_PER_TOKEN");
	*colon = 0;
	if (parse_u32("group", buf, 1, 4096, &layers) ||
	    parse_u32("group", colon + 1, 1, 1u << 20, &bpt))
		return -EINVAL;
	o->groups[o->n_groups].n_layers = layers;
	o->groups[o->n_groups].bytes_per_token = bpt;
	o->n_groups++;
	return 0;
}

/* Strings from options live for the whole run: argv, or the config file's
 * copy (never freed). */
static int apply(struct opts *o, int c, const char *arg)
{
	double gib;

	switch (c) {
	case O_SEGMENT:
		if (kvt_seg_name_valid(arg))
			return bad("segment", arg, "a name is 1-64 of [A-Za-z0-9._-], not . or .. "
				   "(no '/')");
		o->segment = arg;
		return 0;
	case O_SEGMENT_DIR: o->segment_dir = arg; return 0;
	case O_MODEL: o->model = arg; return 0;
	case O_MODEL_CONFIG: o->model_config = arg; return 0;
	case O_KV_DTYPE: o->kv_dtype = arg; return 0;
	case O_TP: return parse_u32("tp", arg, 1, 64, &o->tp);
	case O_PP: return parse_u32("pp", arg, 1, 64, &o->pp);
	case O_WORLD: return parse_u32("world", arg, 1, KVT_MAX_WORLD, &o->world);
	case O_INSTANCES: return parse_u32("instances", arg, 1, KVT_MAX_INSTANCES, &o->instances);
	case O_CHUNK_TOKENS: return parse_u32("chunk-tokens", arg, 1, 1u << 20, &o->chunk_tokens);
	case O_TIER_GIB:
		if (parse_real("tier-gib", arg, 1.0 / 1024, 1 << 20, "GiB", &gib))
			return -EINVAL;
		o->tier_bytes = (uint64_t)(gib * (double)(1ULL << 30));
		return 0;
	case O_SLOTS: return parse_u32("slots", arg, 1, 1u << 30, &o->slots);
	case O_TOKENS: return parse_u64("tokens", arg, 1, 1ULL << 50, &o->tokens);
	case O_GROUP: return parse_group(o, arg);
	case O_REPLICATED: o->replicated = 1; return 0;
	case O_NUMA_NODES: o->numa_nodes = arg; return 0;
	case O_HUGEPAGES:
		if (strcmp(arg, "auto") && strcmp(arg, "on") && strcmp(arg, "off"))
			return bad("hugepages", arg, "expected auto, on or off");
		o->hugepages = arg;
		return 0;
	case O_EXPECT_INSTANCES: {
		uint32_t v;
		if (parse_u32("expect-instances", arg, 0, KVT_MAX_INSTANCES, &v))
			return -EINVAL;
		o->expect_instances = (int)v;
		return 0;
	}
	case O_EXPECT_SCHEDULERS: o->expect_schedulers = 1; return 0;
	case O_HTTP: return parse_http(o, arg);
	case O_NO_HTTP: o->no_http = 1; return 0;
	case O_RECREATE: o->recreate = 1; return 0;
	case O_UNLINK: o->unlink_at_exit = 1; return 0;
	case O_DRAIN_TIMEOUT: return parse_secs("drain-timeout", arg, 0, 86400, &o->drain_timeout_s);
	case O_REAP_INTERVAL: return parse_secs("reap-interval", arg, 0.01, 60, &o->reap_interval_s);
	case O_WRITE_ONLY_WINDOW:
		return parse_secs("write-only-window", arg, 1, 86400, &o->write_only_window_s);
	case O_LOG: o->log_path = arg; return 0;
	case O_NO_LOCK: o->no_lock = 1; return 0;
	case O_GROUP_ACCESS: o->group = 1; return 0;
	case O_VLLM_BLOCK: return parse_u32("vllm-block-size", arg, 1, 1u << 16, &o->vllm_block);
	case O_DISK:
		if (!*arg)
			return bad("disk", arg, "a file or block device path");
		o->disk_path = arg;
		return 0;
	case O_DISK_GIB:
		if (parse_real("disk-gib", arg, 1.0 / 1024, 1 << 24, "GiB", &gib))
			return -EINVAL;
		o->disk_bytes = (uint64_t)(gib * (double)(1ULL << 30));
		return 0;
	case O_DISK_DIRECT:
		return kvt_disk_direct_parse(arg, &o->disk_direct) ?
		       bad("disk-direct", arg, "expected auto, on or off") : 0;
	case O_DISK_ADMIT:
		return kvt_disk_admit_parse(arg, &o->disk_admit) ?
		       bad("disk-admit", arg, "expected all, second-hit or none") : 0;
	case O_DISK_DEPTH: return parse_u32("disk-depth", arg, 1, 4096, &o->disk_depth);
	case O_DISK_RESET: o->disk_reset = 1; return 0;
	case O_DISK_KEY:
		if (!*arg)
			return bad("disk-key", arg, "a file path");
		o->disk_key = arg;
		return 0;
	case O_L3:
		if ((strncmp(arg, "redis://", 8) || !arg[8]) &&
		    (strncmp(arg, "mooncake://", 11) || !arg[11]))
			return bad("l3", arg, "redis://HOST:PORT[,HOST:PORT...] or "
				   "mooncake://MASTER[:PORT][?...]");
		o->l3_url = arg;
		return 0;
	case O_L3_ADMIT:
		return kvt_disk_admit_parse(arg, &o->l3_admit) ?
		       bad("l3-admit", arg, "expected all, second-hit or none") : 0;
	case O_L3_AUTH_FILE:
		if (!*arg)
			return bad("l3-auth-file", arg, "a file path");
		o->l3_auth = arg;
		return 0;
	case O_L3_KEY:
		if (!*arg)
			return bad("l3-key", arg, "a file path");
		o->l3_key = arg;
		return 0;
	case O_L3_TIMEOUT: return parse_u32("l3-timeout-ms", arg, 10, 600000, &o->l3_timeout_ms);
	case O_L3_PYTHON:
		if (!*arg)
			return bad("l3-python", arg, "a Python interpreter's path");
		o->l3_python = arg;
		return 0;
	case O_L3_NEGATIVE:
		return parse_u32("l3-negative-ms", arg, 1, 3600000, &o->l3_negative_ms);
	case O_L3_ENCRYPT: o->l3_encrypt = 1; return 0;
	case O_LMCACHE_PORT: {
		uint32_t port;
		if (parse_u32("lmcache-port", arg, 1, 65535, &port))
			return -EINVAL;
		o->lmcache_port = (uint16_t)port;
		return 0;
	}
	case O_LMCACHE_HOST: {
		struct in_addr a;
		if (strlen(arg) >= sizeof(o->lmcache_host) || inet_pton(AF_INET, arg, &a) != 1)
			return bad("lmcache-host", arg, "not an IPv4 address");
		snprintf(o->lmcache_host, sizeof(o->lmcache_host), "%s", arg);
		return 0;
	}
	default: return -EINVAL;
	}
}

static int find_opt(const char *key)
{
	for (const struct option *p = LONGOPTS; p->name; p++)
		if (!strcmp(p->name, key))
			return p->val;
	return 0;
}

/* ---- the config file ----
 *
 * `key = value` lines with the long options' names, read by libinih
 * (Debian libinih-dev) -- not by a parser of our own.  Around it, what
 * inih leaves to its caller:
 *  * The file: a regular file (a directory, a FIFO, a device such as
 *    /dev/zero are refused before a byte is read: opened O_NONBLOCK, then
 *    fstat), at most CONFIG_MAX_BYTES, no NUL byte.
 *  * The lines, through our reader (ini_parse_stream): inih cuts a line
 *    longer than its buffer (200 bytes as Debian builds it) and reads the
 *    rest as a line of its own -- a setting smuggled in the tail of a
 *    comment.  The reader hands inih whole lines only: a comment line
 *    (`#` or `;` first) of any length becomes an empty line, and a
 *    setting longer than the buffer is refused with its line number.
 *    Indentation is dropped (inih would read an indented line as the
 *    continuation of the previous value).
 *  * Switches take a value: `recreate = yes` (yes/no, true/false, on/off,
 *    1/0); a bare `recreate` is refused with that said.  No [sections].
 */
#define CONFIG_MAX_BYTES (1u << 20)

struct cfg {
	struct opts *o;
	const char *name;
	const char *text;
	size_t n, pos;
	int lineno;
	int failed;
};

static char *cfg_reader(char *str, int num, void *stream)
{
	struct cfg *c = stream;

	if (c->failed || c->pos >= c->n || num < 4)
		return NULL;
	const char *p = c->text + c->pos;
	const char *nl = memchr(p, '\n', c->n - c->pos);
	size_t len = nl ? (size_t)(nl - p) : c->n - c->pos;
	c->pos += len + (nl ? 1 : 0);
	c->lineno++;
	while (len && (*p == ' ' || *p == '\t')) {
		p++;
		len--;
	}
	while (len && (p[len - 1] == '\r' || p[len - 1] == ' ' || p[len - 1] == '\t'))
		len--;
	if (!len || *p == '#' || *p == ';') {
		str[0] = '\n';
		str[1] = 0;
		return str;
	}
	if (len > (size_t)num - 2) {
		fprintf(stderr, "kvtierd: %s:%d: a setting of %zu bytes: at most %d fit a line "
			"(comments may be longer)\n", c->name, c->lineno, len, num - 2);
		c->failed = 1;
		return NULL;
	}
	if (*p == '[') {
		fprintf(stderr, "kvtierd: %s:%d: the config file has no [sections]\n", c->name,
			c->lineno);
		c->failed = 1;
		return NULL;
	}
	if (!memchr(p, '=', len) && !memchr(p, ':', len)) {
		int k = (int)(len > 64 ? 64 : len);
		fprintf(stderr, "kvtierd: %s:%d: '%.*s' is not `key = value`%s\n", c->name,
			c->lineno, k, p, " (a switch takes a value too: `recreate = yes`)");
		c->failed = 1;
		return NULL;
	}
	memcpy(str, p, len);
	str[len] = '\n';
	str[len + 1] = 0;
	return str;
}

static int parse_switch(const char *v, int *on)
{
	static const char *const yes[] = { "yes", "true", "on", "1" };
	static const char *const no[] = { "no", "false", "off", "0" };

	for (size_t i = 0; i < 4; i++) {
		if (!strcmp(v, yes[i]))
			return *on = 1, 0;
		if (!strcmp(v, no[i]))
			return *on = 0, 0;
	}
	return -EINVAL;
}

static int cfg_handler(void *user, const char *section, const char *name, const char *value)
{
	struct cfg *c = user;
	const struct option *def = NULL;
	int k, on = 1;

	if (c->failed)
		return 0;
	c->failed = 1; /* until it succeeds */
	(void)section; /* none: the reader refuses them */
	k = find_opt(name);
	for (const struct option *p = LONGOPTS; k && p->name; p++)
		if (p->val == k)
			def = p;
	if (!def || k == O_CONFIG || k == O_VERSION || k == 'h') {
		fprintf(stderr, "kvtierd: %s:%d: unknown key '%s'\n", c->name, c->lineno, name);
		return 0;
	}
	if (def->has_arg != required_argument) {
		if (parse_switch(value, &on)) {
			fprintf(stderr, "kvtierd: %s:%d: '%s' is a switch: yes or no, not '%s'\n",
				c->name, c->lineno, name, value);
			return 0;
		}
		if (!on) {
			c->failed = 0;
			return 1;
		}
		value = NULL;
	} else if (!*value) {
		fprintf(stderr, "kvtierd: %s:%d: '%s' needs a value\n", c->name, c->lineno, name);
		return 0;
	}
	/* the copy lives as long as o (kvtd_opts_free) */
	struct kvtd_str *copy = NULL;
	if (value) {
		size_t n = strlen(value);
		copy = malloc(sizeof(*copy) + n + 1);
		if (!copy) {
			fprintf(stderr, "kvtierd: out of memory\n");
			return 0;
		}
		memcpy(copy->s, value, n + 1);
		copy->next = c->o->strings;
		c->o->strings = copy;
	}
	if (apply(c->o, k, copy ? copy->s : NULL)) {
		fprintf(stderr, "kvtierd: (in %s:%d)\n", c->name, c->lineno);
		return 0;
	}
	c->failed = 0;
	return 1;
}

int kvtd_config_parse(struct opts *o, const char *name, const char *text, size_t n)
{
	struct cfg c = { .o = o, .name = name, .text = text, .n = n };

	if (memchr(text, 0, n)) {
		fprintf(stderr, "kvtierd: %s: a NUL byte: not a text file\n", name);
		return -EINVAL;
	}
	int r = ini_parse_stream(cfg_reader, &c, cfg_handler, &c);
	if (c.failed)
		return -EINVAL;
	if (r) {
		/* inih's own refusal: a line it cannot read as `key = value` */
		fprintf(stderr, "kvtierd: %s:%d: not `key = value`\n", name, r > 0 ? r : c.lineno);
		return -EINVAL;
	}
	return 0;
}

void kvtd_opts_free(struct opts *o)
{
	while (o->strings) {
		struct kvtd_str *n = o->strings->next;
		free(o->strings);
		o->strings = n;
	}
}

static int config_load(struct opts *o, const char *path)
{
	struct stat st;
	char *text = NULL;
	int fd, r = -EINVAL;

	fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
	if (fd < 0) {
		r = -errno;
		fprintf(stderr, "kvtierd: --config %s: %s\n", path, strerror(errno));
		return r;
	}
	if (fstat(fd, &st)) {
		r = -errno;
		fprintf(stderr, "kvtierd: --config %s: %s\n", path, strerror(errno));
	} else if (!S_ISREG(st.st_mode)) {
		fprintf(stderr, "kvtierd: --config %s: not a regular file (%s)\n", path,
			S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" :
			S_ISCHR(st.st_mode) ? "a character device" : "not a file of text");
	} else if (st.st_size > CONFIG_MAX_BYTES) {
		fprintf(stderr, "kvtierd: --config %s: %lld bytes; a config file is at most %u\n",
			path, (long long)st.st_size, CONFIG_MAX_BYTES);
	} else if (!(text = malloc((size_t)st.st_size + 1))) {
		fprintf(stderr, "kvtierd: out of memory\n");
	} else {
		ssize_t got = pread(fd, text, (size_t)st.st_size, 0);
		if (got != (ssize_t)st.st_size)
			fprintf(stderr, "kvtierd: --config %s: %s\n", path,
				got < 0 ? strerror(errno) : "changed while read");
		else
			r = kvtd_config_parse(o, path, text, (size_t)got);
	}
	free(text);
	close(fd);
	return r;
}

int kvtd_opts_parse(struct opts *o, int argc, char **argv)
{
	int c;

	memset(o, 0, sizeof(*o));
	o->expect_instances = -1;
	snprintf(o->http_addr, sizeof(o->http_addr), "127.0.0.1");
	o->http_port = DEFAULT_PORT;
	o->drain_timeout_s = 30;
	o->reap_interval_s = 0.2;
	o->write_only_window_s = 60;
	/* the config file first, whatever its place: flags override it */
	for (int i = 1; i < argc; i++) {
		const char *path = NULL;
		if (!strncmp(argv[i], "--config=", 9))
			path = argv[i] + 9;
		else if (!strcmp(argv[i], "--config") && i + 1 < argc)
			path = argv[i + 1];
		if (path && config_load(o, path))
			return -EINVAL;
	}
	opterr = 1;
	while ((c = getopt_long(argc, argv, "h", LONGOPTS, NULL)) != -1) {
		if (c == 'h') {
			usage(stdout);
			exit(0);
		}
		if (c == O_VERSION) {
			printf("kvtierd %s\n", KVTIER_VERSION);
			exit(0);
		}
		if (c == O_CONFIG)
			continue;
		if (c == '?' || apply(o, c, optarg))
			return -EINVAL;
	}
	if (optind < argc) {
		fprintf(stderr, "kvtierd: unexpected argument '%s'\n", argv[optind]);
		return -EINVAL;
	}
	/* --model-config with --group: the layout is the groups', the
	 * config.json gives the model identity's file fields only */
	if ((!o->model_config || o->n_groups) && (o->tp || o->pp || o->kv_dtype || o->vllm_block)) {
		fprintf(stderr, "kvtierd: --tp, --pp, --kv-dtype and --vllm-block-size size from "
			"--model-config (without --group)\n");
		return -EINVAL;
	}
	if (!!o->tier_bytes + !!o->slots + !!o->tokens > 1) {
		fprintf(stderr, "kvtierd: give one of --tier-gib, --slots, --tokens\n");
		return -EINVAL;
	}
	if (o->l3_url && !o->l3_key) {
		fprintf(stderr, "kvtierd: --l3 needs --l3-key PATH: the fleet's object key, the "
			"same file on every node\n");
		return -EINVAL;
	}
	if (!o->l3_url && (o->l3_key || o->l3_auth || o->l3_timeout_ms || o->l3_negative_ms ||
			   o->l3_python || o->l3_encrypt)) {
		fprintf(stderr, "kvtierd: --l3-key, --l3-auth-file, --l3-timeout-ms, "
			"--l3-negative-ms, --l3-python and --l3-encrypt go with --l3 URL\n");
		return -EINVAL;
	}
	if (o->lmcache_host[0] && !o->lmcache_port) {
		fprintf(stderr, "kvtierd: --lmcache-host goes with --lmcache-port PORT\n");
		return -EINVAL;
	}
#ifndef KVTIERD_LMC
	if (o->lmcache_port) {
		fprintf(stderr, "kvtierd: --lmcache-port: this kvtierd was built without the LMCache "
			"front end (libzmq3-dev and libmsgpack-dev were missing)\n");
		return -EINVAL;
	}
#endif
	if (!o->model_config && !o->n_groups) {
		fprintf(stderr, "kvtierd: the KV layout is needed: --model-config PATH (with --tp), "
			"or --group LAYERS:BYTES_PER_TOKEN with --world\n");
		return -EINVAL;
	}
	return 0;
}

