/* options.h - kvtierd's settings: flags, the config file, their checks.
 *
 * Precedence: flags, then the config file (--config, wherever it stands
 * on the command line), then KVTIER_* variables (read by kvt_open for what
 * no flag set), then defaults.  Every value is checked as strictly as
 * kvt_open checks the variables: a bad one stops the start with its name.
 */
#ifndef KVTD_OPTIONS_H
#define KVTD_OPTIONS_H

#include <stddef.h>
#include <stdint.h>

#include "kvtier.h"

#define DEFAULT_PORT 9477

struct kvtd_str {
	struct kvtd_str *next;
	char s[];
};

struct opts {
	const char *segment, *segment_dir, *model, *model_config, *kv_dtype;
	const char *numa_nodes, *hugepages, *log_path, *config;
	uint32_t world, instances, chunk_tokens, tp, pp, slots;
	uint32_t vllm_block;      /* --vllm-block-size: kvtier.vllm's layout */
	uint64_t tier_bytes, tokens;
	uint32_t n_groups;
	struct kvt_group_desc groups[8];
	int replicated;
	int expect_instances;     /* -1: all */
	int expect_schedulers;
	char http_addr[64];
	uint16_t http_port;
	int no_http, recreate, unlink_at_exit, no_lock, group, prefault_off;
	double drain_timeout_s, reap_interval_s, write_only_window_s;
	/* the disk tier */
	const char *disk_path;
	uint64_t disk_bytes;      /* --disk-gib; 0: the existing file's size */
	uint32_t disk_direct, disk_admit, disk_depth;
	int disk_reset;
	const char *disk_key;     /* --disk-key: the chunk MAC's key file */
	uint64_t disk_chunks;     /* planned from the file: the segment's index */
	/* the L3 tier */
	const char *l3_url, *l3_auth, *l3_key, *l3_python;
	uint32_t l3_admit, l3_timeout_ms, l3_negative_ms;
	int l3_encrypt;           /* --l3-encrypt */
	/* the LMCache front end */
	uint16_t lmcache_port;    /* --lmcache-port; 0: off */
	char lmcache_host[64];    /* --lmcache-host; "": 127.0.0.1 */
	struct kvtd_str *strings; /* the config file's values, owned */
};

/* Fills o from argv (and the config file it names).  0, or -EINVAL after a
 * message on stderr that names the option (and the file and line).
 * --help and --version print and exit(0). */
int kvtd_opts_parse(struct opts *o, int argc, char **argv);

/* The config file's text (n bytes, not NUL-terminated) applied to o; name
 * for the messages.  0 or -EINVAL (message on stderr).  The strings o
 * keeps are copies that live for the run.  (The fuzz target's entry.) */
int kvtd_config_parse(struct opts *o, const char *name, const char *text, size_t n);

/* Frees the config file's copies (the strings o points at). */
void kvtd_opts_free(struct opts *o);

#endif
