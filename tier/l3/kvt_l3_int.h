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

/* What the backends share (l3.c): a list of requests -- the queue submit
 * fills and the backend's thread takes from, and the done list reap takes
 * from -- always under the backend's own lock. */
struct kvt_l3_list {
	struct kvt_l3_req *head, *tail;
	uint32_t n;
};

void kvt__l3_list_add(struct kvt_l3_list *l, struct kvt_l3_req *q);
/* Takes the first request off, or NULL. */
struct kvt_l3_req *kvt__l3_list_pop(struct kvt_l3_list *l);
/* submit's part: queues reqs while the list holds fewer than room, each
 * marked in progress from now_ns; how many it took. */
uint32_t kvt__l3_enqueue(struct kvt_l3_list *l, struct kvt_l3_req *const *reqs, uint32_t n,
			 uint32_t room, uint64_t now_ns);
/* reap's part: up to max done requests; the event descriptor efd is
 * written again while some are left (reap read it first). */
uint32_t kvt__l3_take_done(struct kvt_l3_list *l, struct kvt_l3_req **done, uint32_t max,
			   int efd);

extern const struct kvt_l3_ops kvt__l3_redis_ops;
extern const struct kvt_l3_ops kvt__l3_mooncake_ops;

#endif
