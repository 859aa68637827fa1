/* kvt_l3_srv.h - kvtierd's side of the L3 channel (kvt_l3_chan.h): the
 * socket beside the segment on which lookups ask for chunks in the L3 and
 * hear back.  One per engine, in the segment's owner; one thread drives
 * it, the engine's (kvt_l3e_poll calls its answers). */
#ifndef KVT_L3_SRV_H
#define KVT_L3_SRV_H

#include <stddef.h>
#include <stdint.h>

#include "kvt_l3e.h"

typedef struct kvt_l3srv kvt_l3srv;

struct kvt_l3srv_info {
	uint32_t conns;            /* askers connected now */
	uint64_t asks, answers, answers_dropped, routes_full, bad, refused;
	uint64_t over_share;       /* asks answered missing: the asker held its share */
};

/* Listens beside s's file (kvtier-l3.<segment>) and takes e's answers. */
int kvt_l3srv_open(kvt_seg *s, kvt_l3e *e, kvt_l3srv **out, char *err, size_t len);
/* Readable when an asker connected or sent. */
int kvt_l3srv_fd(const kvt_l3srv *v);
const char *kvt_l3srv_path(const kvt_l3srv *v);
/* Serves what arrived; never blocks.  The number of events served. */
int kvt_l3srv_service(kvt_l3srv *v);
/* Sends the answers gathered (after kvt_l3srv_service and kvt_l3e_poll). */
void kvt_l3srv_flush(kvt_l3srv *v);
void kvt_l3srv_info(const kvt_l3srv *v, struct kvt_l3srv_info *out);
/* The L3's figures: the engine's and (v may be NULL) the channel's. */
struct kvt_l3c_status;
void kvt_l3_figures(kvt_l3e *e, const kvt_l3srv *v, struct kvt_l3c_status *out);
/* Closes every connection and removes the socket; NULL is ignored. */
void kvt_l3srv_close(kvt_l3srv *v);

#endif
