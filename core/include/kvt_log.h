/* kvt_log.h - how kvtier's engines (the disk tier's, the L3's and its
 * backends) say something: one line, formatted here, handed to the
 * caller's logger (kvtierd's: its log file, the journal) or, without one,
 * written to stderr as "kvtier WHO: warning|info: ...". */
#ifndef KVT_LOG_H
#define KVT_LOG_H

#include <stdarg.h>
#include <stdio.h>

static inline void kvt__vlog(void (*fn)(int level, const char *msg, void *arg), void *arg,
			     const char *who, int level, const char *fmt, va_list ap)
{
	char msg[512];

	vsnprintf(msg, sizeof(msg), fmt, ap);
	if (fn)
		fn(level, msg, arg);
	else
		fprintf(stderr, "kvtier %s: %s: %s\n", who, level ? "warning" : "info", msg);
}

#endif
