/* kvt_l3_int.h - what an L3 backend implements (kvt_l3.h's design). */
#ifndef KVT_L3_INT_H
#define KVT_L3_INT_H

#include "kvt_l3.h"

struct kvt_l3_ops {
	const char *scheme;        /* the URL prefix it takes: "redis://" */
	int (*open)(const struct kvt_l3_conf *c, void **be, char *err, size_t len);
	int (*submit)(void *be, struct kvt_l3_req *const *reqs, uint32_t n);
	int (*reap)(void *be, struct kvt_l3_req **done, uint32_t max);
	int (*event_fd)(const void *be);
	void (*status)(void *be, struct kvt_l3_status *out);
	void (*close)(void *be);   /* drains */
};

extern const struct kvt_l3_ops kvt__l3_redis_ops;
extern const struct kvt_l3_ops kvt__l3_mooncake_ops;

#endif
