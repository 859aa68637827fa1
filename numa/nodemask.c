/* nodemask.c - node sets and the strict node-list parser. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "numa_internal.h"

#define WORDS (KVT_NUMA_MAX_NODES / 64)

void kvt_nodemask_zero(struct kvt_nodemask *m)
{
	memset(m, 0, sizeof(*m));
}

int kvt_nodemask_set(struct kvt_nodemask *m, int n)
{
	if (n < 0 || n >= KVT_NUMA_MAX_NODES)
		return -EINVAL;
	m->bits[n / 64] |= 1ull << (n % 64);
	return 0;
}

int kvt_nodemask_test(const struct kvt_nodemask *m, int n)
{
	if (n < 0 || n >= KVT_NUMA_MAX_NODES)
		return 0;
	return (m->bits[n / 64] >> (n % 64)) & 1;
}

int kvt_nodemask_count(const struct kvt_nodemask *m)
{
	int c = 0;

	for (int i = 0; i < WORDS; i++)
		c += __builtin_popcountll(m->bits[i]);
	return c;
}

int kvt_nodemask_next(const struct kvt_nodemask *m, int n)
{
	for (int i = n + 1; i < KVT_NUMA_MAX_NODES; i++) {
		uint64_t w = m->bits[i / 64] >> (i % 64);

		if (w)
			return i + __builtin_ctzll(w);
		i |= 63; /* the rest of this word is empty */
	}
	return -1;
}

int kvt_nodemask_first(const struct kvt_nodemask *m)
{
	return kvt_nodemask_next(m, -1);
}

int kvt_nodemask_equal(const struct kvt_nodemask *a, const struct kvt_nodemask *b)
{
	return memcmp(a->bits, b->bits, sizeof(a->bits)) == 0;
}

/* One node number: digits only, no leading sign or space, below the max. */
static int parse_node(const char **p, const char *s, const char *what, long *out)
{
	long v = 0;
	const char *start = *p;

	if (!isdigit((unsigned char)**p))
		return kvt__numa_err(-EINVAL,
			"%s='%s': expected a node number at position %d "
			"(format: 0,1 or 0-3 or 0-1,4)", what, s, (int)(start - s) + 1);
	while (isdigit((unsigned char)**p)) {
		v = v * 10 + (**p - '0');
		if (v >= KVT_NUMA_MAX_NODES)
			return kvt__numa_err(-EINVAL, "%s='%s': node numbers go up to %d",
					     what, s, KVT_NUMA_MAX_NODES - 1);
		(*p)++;
	}
	*out = v;
	return 0;
}

int kvt_nodemask_parse(const char *s, const char *what, struct kvt_nodemask *out)
{
	struct kvt_nodemask m;
	const char *p = s;
	int r;

	if (!what)
		what = "node list";
	if (!s || !*s)
		return kvt__numa_err(-EINVAL, "%s is empty: give nodes as 0,1 or 0-3", what);
	kvt_nodemask_zero(&m);
	for (;;) {
		long a, b;

		r = parse_node(&p, s, what, &a);
		if (r)
			return r;
		b = a;
		if (*p == '-') {
			p++;
			r = parse_node(&p, s, what, &b);
			if (r)
				return r;
			if (b < a)
				return kvt__numa_err(-EINVAL,
					"%s='%s': range %ld-%ld goes backwards", what, s, a, b);
		}
		for (long n = a; n <= b; n++)
			kvt_nodemask_set(&m, (int)n);
		if (*p == ',') {
			p++;
			continue;
		}
		if (*p == '\0')
			break;
		return kvt__numa_err(-EINVAL,
			"%s='%s': unexpected '%c' at position %d (format: 0,1 or 0-3 or 0-1,4)",
			what, s, *p, (int)(p - s) + 1);
	}
	*out = m;
	return 0;
}

int kvt_nodemask_format(const struct kvt_nodemask *m, char *buf, size_t len)
{
	size_t used = 0;
	int n = kvt_nodemask_first(m);

	if (len)
		buf[0] = '\0';
	while (n >= 0) {
		int end = n, next;
		char tmp[32];
		int w;

		while ((next = kvt_nodemask_next(m, end)) == end + 1)
			end = next;
		if (end == n)
			w = snprintf(tmp, sizeof(tmp), "%s%d", used ? "," : "", n);
		else
			w = snprintf(tmp, sizeof(tmp), "%s%d-%d", used ? "," : "", n, end);
		if (used + (size_t)w < len)
			memcpy(buf + used, tmp, (size_t)w + 1);
		else if (len)
			buf[len - 1] = '\0', len = 0; /* truncated: stop writing */
		used += (size_t)w;
		n = next;
	}
	return (int)used;
}
