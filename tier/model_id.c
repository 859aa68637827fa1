/* kvt_model_files_id: what a model's files say about the KV an engine
 * computes from them, as identity fields for the model text that enters
 * the layout fingerprint (kvtier.h).
 *
 * Both sides that make a segment's model text call this one function with
 * the same input -- the vLLM connector with the config.json vLLM read, and
 * kvtierd with its --model-config -- so the two texts agree by construction
 * instead of by two implementations kept in step.
 *
 *   config=HEX   XXH3-128 of config.json's bytes: architecture, heads,
 *                rope, quantization_config, the KV scales' scheme...
 *   rev=COMMIT   when the file is in a Hugging Face snapshot
 *                (.../snapshots/<40 hex>/config.json): the commit names
 *                every file of the model, weights included;
 *   weights=HEX  otherwise: XXH3-128 of "name size mtime\n" of every weight
 *                file beside config.json (*.safetensors, *.bin, *.pt,
 *                *.pth, *.gguf), sorted by name.  A checkpoint rewritten in
 *                place changes its mtime, so chunks of the old weights are
 *                never served for the new ones.  A copy that does not keep
 *                mtimes (cp without -p) is another identity: a miss on that
 *                node, never a wrong chunk.  Content hashing would be exact
 *                but reads every byte of a 700 GB checkpoint at each start.
 *
 * Out: "rev=...;config=..." or "weights=...;config=...", NUL-terminated.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "kvt_tier_int.h"

#define CONFIG_MAX (16u << 20) /* a config.json is kilobytes */

static void hex128(XXH128_hash_t h, char out[33])
{
	snprintf(out, 33, "%016llx%016llx", (unsigned long long)h.high64,
		 (unsigned long long)h.low64);
}

static int file_digest(const char *path, char out[33])
{
	struct stat st;
	char *buf;
	size_t got = 0;
	int fd = open(path, O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return kvt__tier_err(-errno, "model config %s: %s", path, strerror(errno));
	if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (uint64_t)st.st_size > CONFIG_MAX) {
		close(fd);
		return kvt__tier_err(-EINVAL, "model config %s: not a regular file of at most "
				     "%u bytes", path, CONFIG_MAX);
	}
	buf = malloc((size_t)st.st_size + 1);
	if (!buf) {
		close(fd);
		return kvt__tier_err(-ENOMEM, "out of memory");
	}
	while (got < (size_t)st.st_size) {
		ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	close(fd);
	if (got != (size_t)st.st_size) {
		free(buf);
		return kvt__tier_err(-EIO, "model config %s: short read", path);
	}
	hex128(XXH3_128bits(buf, got), out);
	free(buf);
	return 0;
}

static int is_weight_file(const char *n)
{
	static const char *const ext[] = { ".safetensors", ".bin", ".pt", ".pth", ".gguf" };
	size_t l = strlen(n);

	for (size_t i = 0; i < sizeof(ext) / sizeof(ext[0]); i++) {
		size_t e = strlen(ext[i]);
		if (l > e && !strcmp(n + l - e, ext[i]))
			return 1;
	}
	return 0;
}

static int cmp_names(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The snapshot commit when dir is .../snapshots/<40 hex>; else 0. */
static int hub_commit(const char *dir, char out[41])
{
	const char *base = strrchr(dir, '/');
	size_t plen;

	if (!base)
		return 0;
	plen = (size_t)(base - dir);
	if (strlen(base + 1) != 40 || plen < 10 || strncmp(dir + plen - 10, "/snapshots", 10))
		return 0;
	for (int i = 1; i <= 40; i++)
		if (!strchr("0123456789abcdef", base[i]))
			return 0;
	memcpy(out, base + 1, 41);
	return 1;
}

static int weights_digest(const char *dir, char out[33])
{
	XXH3_state_t *x;
	struct dirent *e;
	char **names = NULL;
	size_t n = 0, cap = 0;
	int r = 0;
	DIR *d = opendir(dir);

	if (!d)
		return kvt__tier_err(-errno, "model directory %s: %s", dir, strerror(errno));
	while ((e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.' || !is_weight_file(e->d_name))
			continue;
		if (n == cap) {
			char **p = realloc(names, (cap = cap ? 2 * cap : 16) * sizeof(*names));
			if (!p) {
				r = -ENOMEM;
				break;
			}
			names = p;
		}
		if (!(names[n] = strdup(e->d_name))) {
			r = -ENOMEM;
			break;
		}
		n++;
	}
	closedir(d);
	x = r ? NULL : XXH3_createState();
	if (!r && !x)
		r = -ENOMEM;
	if (!r) {
		qsort(names, n, sizeof(*names), cmp_names);
		XXH3_128bits_reset(x);
		for (size_t i = 0; i < n && !r; i++) {
			char path[4096], line[512];
			struct stat st;
			int len;

			if ((size_t)snprintf(path, sizeof(path), "%s/%s", dir, names[i]) >=
			    sizeof(path)) {
				r = kvt__tier_err(-ENAMETOOLONG, "model file %s: path too long",
						  names[i]);
				break;
			}
			if (stat(path, &st)) {
				r = kvt__tier_err(-errno, "model file %s: %s", path, strerror(errno));
				break;
			}
			if (!S_ISREG(st.st_mode))
				continue;
			len = snprintf(line, sizeof(line), "%s %llu %lld\n", names[i],
				       (unsigned long long)st.st_size, (long long)st.st_mtime);
			XXH3_128bits_update(x, line, (size_t)len < sizeof(line) ?
					    (size_t)len : sizeof(line) - 1);
		}
		if (!r)
			hex128(XXH3_128bits_digest(x), out);
	}
	if (r == -ENOMEM)
		kvt__tier_err(r, "out of memory");
	XXH3_freeState(x);
	for (size_t i = 0; i < n; i++)
		free(names[i]);
	free(names);
	return r;
}

int kvt_model_files_id(const char *config_path, char *out, size_t len)
{
	char dir[4096], cfg[33], w[41];
	const char *slash;
	int r;

	if (!config_path || !out || !len)
		return kvt__tier_err(-EINVAL, "model files: no config path or output");
	if ((r = file_digest(config_path, cfg)))
		return r;
	slash = strrchr(config_path, '/');
	if (!slash)
		snprintf(dir, sizeof(dir), ".");
	else if ((size_t)(slash - config_path) >= sizeof(dir))
		return kvt__tier_err(-ENAMETOOLONG, "model config %s: path too long", config_path);
	else
		snprintf(dir, sizeof(dir), "%.*s", (int)(slash - config_path), config_path);
	if (!dir[0])
		snprintf(dir, sizeof(dir), "/");
	if (hub_commit(dir, w))
		r = snprintf(out, len, "rev=%s;config=%s", w, cfg);
	else if ((r = weights_digest(dir, w)))
		return r;
	else
		r = snprintf(out, len, "weights=%s;config=%s", w, cfg);
	if (r < 0 || (size_t)r >= len)
		return kvt__tier_err(-ENOSPC, "model files: %zu bytes are too few", len);
	return r;
}
