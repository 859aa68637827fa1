/* seg_bind.c - bind a freshly created segment's arena as a plan says.
 *
 * The arena is rank-major: shard s's sub-slots are one 2 MiB aligned part
 * (kvt_seg_arena(seg, s)), so each part can get its own node.  The header
 * and metadata regions are left to first touch: they are small, and the
 * creator has already touched them on its own node.
 */
#include <errno.h>
#include <string.h>

#include "kvt_core.h"
#include "numa_internal.h"

int kvt_numa_bind_segment(struct kvt_seg *seg, const struct kvt_numa_plan *plan,
			  const struct kvt_numa_bind_opts *o,
			  struct kvt_numa_bind_report *rep_out)
{
	struct kvt_numa_bind_report sum;
	struct kvt_numa_bind_opts opts;
	uint32_t n;

	if (!seg || !plan)
		return kvt__numa_err(-EINVAL, "kvt_numa_bind_segment: NULL argument");
	n = kvt_seg_n_shards(seg);
	if (plan->n_shards != n)
		return kvt__numa_err(-EINVAL, "kvt_numa_bind_segment: the plan has %u shards, "
				     "the segment %u", plan->n_shards, n);
	/* The plan carries --numa-fallback from the request that made it. */
	memset(&opts, 0, sizeof(opts));
	if (o) {
		if (o->size < sizeof(opts))
			return kvt__numa_err(-EINVAL, "kvt_numa_bind_segment: options size wrong");
		opts = *o;
	}
	opts.size = sizeof(opts);
	opts.flags |= plan->flags & KVT_NUMA_F_FALLBACK;
	memset(&sum, 0, sizeof(sum));
	sum.first_bad_node = -1;
	for (uint32_t s = 0; s < n; s++) {
		struct kvt_numa_bind_report rep;
		void *ptr;
		uint64_t len;
		int r = kvt_seg_arena(seg, s, &ptr, &len);

		if (r)
			return kvt__numa_err(r, "kvt_seg_arena(shard %u): %s", s,
					     kvt_core_last_error());
		r = kvt_numa_bind_region(ptr, (size_t)len, plan->shard[s].mode,
					 &plan->shard[s].nodes, &opts, &rep);
		if (r)
			return kvt__numa_err(r, "shard %u: %s", s, kvt_numa_last_error());
		sum.bytes += rep.bytes;
		sum.page_bytes = rep.page_bytes;
		sum.pages += rep.pages;
		sum.on_target += rep.on_target;
		sum.misplaced += rep.misplaced;
		sum.absent += rep.absent;
		if (sum.first_bad_node < 0)
			sum.first_bad_node = rep.first_bad_node;
		sum.bound += rep.bound;
		sum.prefault = rep.prefault;
	}
	if (rep_out)
		*rep_out = sum;
	return 0;
}
