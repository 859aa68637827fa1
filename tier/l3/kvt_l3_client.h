/* kvt_l3_client.h - a lookup's side of the L3 channel (l3_client.c;
 * kvt_l3_chan.h has the protocol).  Internal to libkvtier. */
#ifndef KVT_L3_CLIENT_H
#define KVT_L3_CLIENT_H

#include <stdint.h>

#include "kvt_core.h"

typedef struct kvt_l3c kvt_l3c;

/* What this handle knows of a key (kvt__l3c_state). */
enum { KVT_L3C_NOT_ASKED = 0, KVT_L3C_PENDING = 1, KVT_L3C_NOT_THERE = 2 };

kvt_l3c *kvt__l3c_new(void);
void kvt__l3c_free(kvt_l3c *c);
/* A lookup's start: connects when none (at most once a second), reads the
 * answers that came.  1 when kvtierd's L3 listens, 0 when not. */
int kvt__l3c_begin(kvt_l3c *c, kvt_seg *s, uint64_t now);
int kvt__l3c_state(kvt_l3c *c, const kvt_key *k, uint64_t now);
/* Queues an ask (marked pending); -ENOBUFS when the message is full
 * (send it, then queue again), -ENOTCONN when no connection. */
int kvt__l3c_queue(kvt_l3c *c, const kvt_key *k, uint32_t depth, uint64_t now);
/* Sends what was queued: 0, or -errno (the asks then are not pending). */
int kvt__l3c_send(kvt_l3c *c, uint64_t now);

/* The L3's figures from the segment's kvtierd (kvtier-stat): 0, or -errno
 * (no kvtierd with an L3 for this segment, no answer in timeout_ms). */
struct kvt_l3c_status;
int kvt__l3c_status(kvt_seg *s, struct kvt_l3c_status *out, int timeout_ms);

#endif
