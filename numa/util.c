/* util.c - error messages, logging and small parsers shared by numa/. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "numa_internal.h"

/* One message per thread, like errno: the library keeps no other state. */
static _Thread_local char last_error[512];

int kvt__numa_err(int code, const char *fmt, ...)
{
	char tmp[sizeof(last_error)];
	va_list ap;

	/* Through a copy: an argument may be this very buffer (a message
	 * that wraps the previous one); vsnprintf onto itself garbles it. */
	va_start(ap, fmt);
	vsnprintf(tmp, sizeof(tmp), fmt, ap);
	va_end(ap);
	memcpy(last_error, tmp, sizeof(tmp));
	return code;
}

const char *kvt_numa_last_error(void)
{
	return last_error;
}

void kvt__numa_log(kvt_numa_log_fn fn, void *arg, int level, const char *fmt, ...)
{
	char msg[1024];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (fn) {
		fn(arg, level, msg);
		return;
	}
	fprintf(stderr, "kvtier: numa: %s%s\n",
		level == KVT_NUMA_LOG_WARN ? "warning: " : "", msg);
}

int kvt__read_text(const char *path, char *buf, size_t len)
{
	size_t got = 0;
	int fd, saved;

	if (len == 0)
		return -EINVAL;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	while (got + 1 < len) {
		ssize_t n = read(fd, buf + got, len - 1 - got);

		if (n < 0) {
			if (errno == EINTR)
				continue;
			saved = errno;
			close(fd);
			return -saved;
		}
		if (n == 0)
			break;
		got += (size_t)n;
	}
	close(fd);
	buf[got] = '\0';
	return (int)got;
}

int kvt__parse_u64(const char *s, int base, uint64_t *out)
{
	unsigned long long v;
	char *end;

	if (!s)
		return -EINVAL;
	while (*s == ' ' || *s == '\t')
		s++;
	/* strtoull accepts a sign and wraps "-1" around: refuse both. */
	if (!isxdigit((unsigned char)*s))
		return -EINVAL;
	if (base == 16 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X'))
		s += 2;
	if (!isxdigit((unsigned char)*s))
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, base);
	if (errno || end == s)
		return -EINVAL;
	while (*end == ' ' || *end == '\t' || *end == '\n')
		end++;
	if (*end)
		return -EINVAL;
	*out = v;
	return 0;
}

/* Reads one decimal number at *p, advancing it. */
static int take_num(const char **p, long *out)
{
	long v = 0;

	if (!isdigit((unsigned char)**p))
		return -EINVAL;
	while (isdigit((unsigned char)**p)) {
		v = v * 10 + (**p - '0');
		if (v > (1l << 30))
			return -EINVAL;
		(*p)++;
	}
	*out = v;
	return 0;
}

int kvt__cpulist_has(const char *list, int cpu, uint32_t *count)
{
	const char *p = list;
	uint32_t n = 0;
	int has = 0;

	while (*p == ' ')
		p++;
	if (*p == '\n' || *p == '\0') {   /* a memory-only node: no CPUs */
		if (count)
			*count = 0;
		return 0;
	}
	for (;;) {
		long a, b;

		if (take_num(&p, &a))
			return -EINVAL;
		b = a;
		if (*p == '-') {
			p++;
			if (take_num(&p, &b) || b < a)
				return -EINVAL;
		}
		if (cpu >= a && cpu <= b)
			has = 1;
		n += (uint32_t)(b - a + 1);
		if (*p == ',') {
			p++;
			continue;
		}
		if (*p == '\n' || *p == '\0')
			break;
		return -EINVAL;
	}
	if (count)
		*count = n;
	return has;
}

const char *kvt__sysfs_root(const char *root)
{
	const char *env;

	if (root && *root)
		return root;
	env = getenv("KVTIER_SYSFS_ROOT");
	if (env)
		return env;  /* empty: refused by the caller, never the default */
	return KVT__SYSFS_DEFAULT;
}
