/* choose.c - where the arena goes, and why.
 *
 * The order (DESIGN.md § NUMA): explicit nodes, else the creating process's
 * own memory policy (so `numactl --membind=1 kvtierd ...` just works), else
 * the nodes local to the ranks' GPUs, else the local node.  The chooser is a
 * function of the topology and the request; the two inputs that come from
 * the process (the environment and get_mempolicy) can be supplied in the
 * request, which is how the tests drive every branch on a one-node VM.
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KVTIER_HAVE_NUMA
#include <numaif.h>
#endif

#include "numa_internal.h"

const char *kvt_numa_mode_name(uint32_t mode)
{
	switch (mode) {
	case KVT_NUMA_NONE:       return "none";
	case KVT_NUMA_BIND:       return "bind";
	case KVT_NUMA_PREFERRED:  return "preferred";
	case KVT_NUMA_INTERLEAVE: return "interleave";
	case KVT_NUMA_LOCAL:      return "local";
	}
	return "?";
}

const char *kvt_numa_source_name(uint32_t src)
{
	switch (src) {
	case KVT_NUMA_SRC_EXPLICIT: return "explicit";
	case KVT_NUMA_SRC_POLICY:   return "policy";
	case KVT_NUMA_SRC_GPU:      return "gpu-local";
	case KVT_NUMA_SRC_LOCAL:    return "local";
	}
	return "?";
}

int kvt_numa_policy_read(struct kvt_numa_policy *out)
{
#ifdef KVTIER_HAVE_NUMA
	struct kvt_nodemask m;
	int mode = 0;

	if (!out)
		return kvt__numa_err(-EINVAL, "kvt_numa_policy_read: out is NULL");
	kvt_nodemask_zero(&m);
	/* maxnode must cover the kernel's nr_node_ids; 1024 bits always do. */
	if (get_mempolicy(&mode, (unsigned long *)m.bits, KVT_NUMA_MAX_NODES, NULL, 0)) {
		int e = errno;

		return kvt__numa_err(-e, "get_mempolicy: %s", strerror(e));
	}
	/* Mode flags (static/relative nodes, balancing) do not change where
	 * pages go for our purpose. */
	mode &= ~KVT__MPOL_MODE_FLAGS;
	memset(out, 0, sizeof(*out));
	out->nodes = m;
	switch (mode) {
	case MPOL_DEFAULT:
		out->mode = KVT_NUMA_NONE;
		kvt_nodemask_zero(&out->nodes);
		break;
	case MPOL_BIND:
		out->mode = KVT_NUMA_BIND;
		break;
	case MPOL_PREFERRED:
		/* An empty preferred set is the old spelling of "local". */
		out->mode = kvt_nodemask_count(&m) ? KVT_NUMA_PREFERRED : KVT_NUMA_LOCAL;
		break;
	case 5: /* MPOL_PREFERRED_MANY (Linux 5.15) */
		out->mode = KVT_NUMA_PREFERRED;
		break;
	case MPOL_INTERLEAVE:
	case 6: /* MPOL_WEIGHTED_INTERLEAVE (Linux 6.9): the weights are the
		 * kernel's business; the nodes are what we follow. */
		out->mode = KVT_NUMA_INTERLEAVE;
		break;
	case 4: /* MPOL_LOCAL */
		out->mode = KVT_NUMA_LOCAL;
		kvt_nodemask_zero(&out->nodes);
		break;
	default:
		return kvt__numa_err(-EPROTO, "get_mempolicy: unknown mode %d", mode);
	}
	return 0;
#else
	(void)out;
	return kvt__numa_err(-ENOTSUP, "NUMA support not built (libnuma-dev was missing)");
#endif
}

static int has_memory(const struct kvt_numa_topo *t, int id)
{
	const struct kvt_numa_node *nd = kvt_numa_topo_node(t, id);

	return nd && nd->mem_total > 0;
}

static void mask_str(const struct kvt_nodemask *m, char *buf, size_t len)
{
	if (kvt_nodemask_format(m, buf, len) == 0)
		snprintf(buf, len, "(none)");
}

/* Nodes of the topology that have memory, as a list, for messages. */
static void mem_nodes_str(const struct kvt_numa_topo *t, char *buf, size_t len)
{
	struct kvt_nodemask m;

	kvt_nodemask_zero(&m);
	for (uint32_t i = 0; i < t->n_nodes; i++)
		if (t->nodes[i].mem_total > 0)
			kvt_nodemask_set(&m, t->nodes[i].id);
	mask_str(&m, buf, len);
}

/* Every node of m exists with memory; else the first that does not. */
static int first_unusable(const struct kvt_numa_topo *t, const struct kvt_nodemask *m)
{
	for (int n = kvt_nodemask_first(m); n >= 0; n = kvt_nodemask_next(m, n))
		if (!has_memory(t, n))
			return n;
	return -1;
}

static int local_node(const struct kvt_numa_topo *t, const struct kvt_numa_request *r,
		      const char **why)
{
	int cpu, n;

	if (r->local_node) {
		*why = "given";
		if (has_memory(t, *r->local_node))
			return *r->local_node;
	} else {
		cpu = sched_getcpu();
		n = kvt_numa_topo_cpu_node(t, cpu);
		*why = "this process runs there";
		if (n >= 0 && has_memory(t, n))
			return n;
	}
	/* A CPU on a memory-less node, or a CPU the tree does not list: the
	 * first node with memory is as good a guess as any, and we say so. */
	*why = "the first node with memory (this CPU's node has none or is unknown)";
	for (uint32_t i = 0; i < t->n_nodes; i++)
		if (t->nodes[i].mem_total > 0)
			return t->nodes[i].id;
	return -ENOENT;
}

/* The GPU node of a rank, or -1. */
static int rank_gpu_node(const struct kvt_numa_topo *t, const struct kvt_numa_request *r,
			 uint32_t rank)
{
	int g = r->rank_gpu ? r->rank_gpu[rank] : (int)rank;

	if (g < 0 || (uint32_t)g >= t->n_gpus)
		return -1;
	return has_memory(t, t->gpus[g].node) ? t->gpus[g].node : -1;
}

/* Places every shard given the chosen set and mode (see kvt_numa_choose). */
static void place_shards(const struct kvt_numa_topo *t, const struct kvt_numa_request *r,
			 uint32_t n_ranks, uint32_t set_mode, struct kvt_numa_plan *p)
{
	const struct kvt_nodemask *set = &p->nodes;
	int many = kvt_nodemask_count(set) > 1;

	for (uint32_t s = 0; s < p->n_shards; s++) {
		struct kvt_numa_shard_place *sp = &p->shard[s];
		struct kvt_nodemask g;
		int any = 0;

		kvt_nodemask_zero(&g);
		if (p->n_shards > 1 && set_mode != KVT_NUMA_INTERLEAVE) {
			for (uint32_t rk = s; rk < n_ranks; rk += p->n_shards) {
				int n = rank_gpu_node(t, r, rk);

				if (n >= 0 && kvt_nodemask_test(set, n))
					kvt_nodemask_set(&g, n), any = 1;
			}
		}
		if (any) {
			sp->nodes = g;
			/* A shard written by ranks on two sockets (two
			 * instances) is interleaved between them. */
			sp->mode = kvt_nodemask_count(&g) > 1 ? KVT_NUMA_INTERLEAVE : set_mode;
		} else {
			sp->nodes = *set;
			sp->mode = set_mode;
			/* Bound to several nodes, a shard would fill the first
			 * one reached from the creator's CPU; readers are on
			 * every socket, so spread it. */
			if (many && set_mode == KVT_NUMA_BIND)
				sp->mode = KVT_NUMA_INTERLEAVE;
		}
	}
}

/* Writes "; shards 0-3 on node 0, 4-7 on node 1" for plans whose shards go
 * to different nodes, else "". */
static void describe_shards(const struct kvt_numa_plan *p, char *buf, size_t len)
{
	size_t used = 0;
	uint32_t s = 0;

	buf[0] = '\0';
	if (p->n_shards <= 1)
		return;
	for (uint32_t i = 1; i < p->n_shards; i++)
		if (!kvt_nodemask_equal(&p->shard[i].nodes, &p->shard[0].nodes))
			goto differ;
	return;
differ:
	used += (size_t)snprintf(buf, len, "; shards");
	while (s < p->n_shards && used < len) {
		uint32_t e = s;
		char nodes[64];

		while (e + 1 < p->n_shards &&
		       kvt_nodemask_equal(&p->shard[e + 1].nodes, &p->shard[s].nodes) &&
		       p->shard[e + 1].mode == p->shard[s].mode)
			e++;
		mask_str(&p->shard[s].nodes, nodes, sizeof(nodes));
		if (e == s)
			used += (size_t)snprintf(buf + used, len - used, "%s %u on node %s",
						 s ? "," : "", s, nodes);
		else
			used += (size_t)snprintf(buf + used, len - used, "%s %u-%u on node %s",
						 s ? "," : "", s, e, nodes);
		if (used < len && p->shard[s].mode == KVT_NUMA_INTERLEAVE &&
		    kvt_nodemask_count(&p->shard[s].nodes) > 1)
			used += (size_t)snprintf(buf + used, len - used, " (interleaved)");
		s = e + 1;
	}
}

int kvt_numa_choose(const struct kvt_numa_topo *t, const struct kvt_numa_request *r,
		    struct kvt_numa_plan *out)
{
	struct kvt_numa_policy pol_buf;
	const struct kvt_numa_policy *pol = NULL;
	struct kvt_numa_plan p;
	char why[800] = "", nodes[128], avail[128], shards[256];
	const char *explicit_src = NULL, *explicit = NULL;
	uint32_t n_ranks, set_mode = KVT_NUMA_BIND;
	int rc;

	if (!t || !r || !out)
		return kvt__numa_err(-EINVAL, "kvt_numa_choose: NULL argument");
	if (r->size < sizeof(*r) || r->reserved)
		return kvt__numa_err(-EINVAL, "kvt_numa_choose: request size/reserved wrong");
	if (r->flags & ~KVT_NUMA_F_MASK)
		return kvt__numa_err(-EINVAL, "kvt_numa_choose: unknown flags 0x%x",
				     r->flags & ~KVT_NUMA_F_MASK);
	if (r->n_shards < 1 || r->n_shards > KVT_NUMA_MAX_SHARDS)
		return kvt__numa_err(-EINVAL, "kvt_numa_choose: n_shards %u not in 1..%d",
				     r->n_shards, KVT_NUMA_MAX_SHARDS);
	n_ranks = r->n_ranks ? r->n_ranks : r->n_shards;
	if (n_ranks < r->n_shards || n_ranks > KVT_NUMA_MAX_INSTANCES * KVT_NUMA_MAX_SHARDS)
		return kvt__numa_err(-EINVAL, "kvt_numa_choose: n_ranks %u not in n_shards "
				     "(%u)..%d", n_ranks, r->n_shards,
				     KVT_NUMA_MAX_INSTANCES * KVT_NUMA_MAX_SHARDS);

	memset(&p, 0, sizeof(p));
	p.flags = r->flags;
	p.n_shards = r->n_shards;
	mem_nodes_str(t, avail, sizeof(avail));

	/* 1. Explicit nodes. */
	if (r->nodes) {
		explicit = r->nodes;
		explicit_src = "--numa-nodes";
	} else if (!(r->flags & KVT_NUMA_F_NO_ENV)) {
		explicit = getenv("KVTIER_NUMA_NODES");
		explicit_src = "KVTIER_NUMA_NODES";
		if (explicit && !*explicit)
			explicit = NULL; /* set but empty: as if unset */
	}
	if (explicit) {
		struct kvt_nodemask m;
		int bad;

		/* A list that does not parse is always an error: a typo must
		 * not silently put the arena somewhere else. */
		rc = kvt_nodemask_parse(explicit, explicit_src, &m);
		if (rc)
			return rc;
		bad = first_unusable(t, &m);
		if (bad < 0) {
			p.source = KVT_NUMA_SRC_EXPLICIT;
			p.nodes = m;
			mask_str(&m, nodes, sizeof(nodes));
			snprintf(why, sizeof(why), "%s=%s", explicit_src, explicit);
			goto chosen;
		}
		if (!(r->flags & KVT_NUMA_F_FALLBACK))
			return kvt__numa_err(-EINVAL,
				"%s=%s: node %d %s (nodes with memory: %s)", explicit_src,
				explicit, bad, kvt_numa_topo_node(t, bad) ?
				"has no memory" : "does not exist", avail);
		kvt__numa_log(r->log, r->log_arg, KVT_NUMA_LOG_WARN,
			"%s=%s: node %d %s (nodes with memory: %s); "
			"--numa-fallback: choosing as if no nodes were given",
			explicit_src, explicit, bad,
			kvt_numa_topo_node(t, bad) ? "has no memory" : "does not exist", avail);
	}

	/* 2. The process's own memory policy. */
	if (!(r->flags & KVT_NUMA_F_NO_POLICY)) {
		if (r->policy) {
			pol = r->policy;
		} else if (kvt_numa_policy_read(&pol_buf) == 0) {
			pol = &pol_buf;
		} else {
			kvt__numa_log(r->log, r->log_arg, KVT_NUMA_LOG_INFO,
				      "memory policy not read: %s", kvt_numa_last_error());
		}
	}
	if (pol && (pol->mode == KVT_NUMA_BIND || pol->mode == KVT_NUMA_PREFERRED ||
		    pol->mode == KVT_NUMA_INTERLEAVE)) {
		struct kvt_nodemask m = pol->nodes;

		/* The kernel accepted the policy, so its nodes exist; keep only
		 * those with memory, which is all the kernel would use. */
		for (int n = kvt_nodemask_first(&pol->nodes); n >= 0;
		     n = kvt_nodemask_next(&pol->nodes, n))
			if (!has_memory(t, n))
				m.bits[n / 64] &= ~(1ull << (n % 64));
		if (kvt_nodemask_count(&m) > 0) {
			p.source = KVT_NUMA_SRC_POLICY;
			p.nodes = m;
			set_mode = pol->mode;
			mask_str(&m, nodes, sizeof(nodes));
			snprintf(why, sizeof(why),
				 "this process's memory policy is %s %s (numactl --%s=%s); "
				 "the arena follows it", kvt_numa_mode_name(pol->mode), nodes,
				 pol->mode == KVT_NUMA_BIND ? "membind" : kvt_numa_mode_name(pol->mode),
				 nodes);
			goto chosen;
		}
	}

	/* 3. The nodes local to the ranks' GPUs. */
	{
		struct kvt_nodemask m;
		uint32_t known = 0;

		kvt_nodemask_zero(&m);
		for (uint32_t rk = 0; rk < n_ranks; rk++) {
			int n = rank_gpu_node(t, r, rk);

			if (n >= 0)
				kvt_nodemask_set(&m, n), known++;
		}
		if (known) {
			p.source = KVT_NUMA_SRC_GPU;
			p.nodes = m;
			mask_str(&m, nodes, sizeof(nodes));
			snprintf(why, sizeof(why),
				 "no explicit nodes and no memory policy; %u of %u ranks have a "
				 "GPU with a known NUMA node (%s)", known, n_ranks, nodes);
			goto chosen;
		}
	}

	/* 4. The local node. */
	{
		const char *lw;
		int n = local_node(t, r, &lw);

		if (n < 0)
			return kvt__numa_err(-ENOENT, "no node with memory under %s", t->root);
		p.source = KVT_NUMA_SRC_LOCAL;
		kvt_nodemask_set(&p.nodes, n);
		mask_str(&p.nodes, nodes, sizeof(nodes));
		snprintf(why, sizeof(why),
			 "no explicit nodes, no memory policy, no GPU with a known NUMA node; "
			 "local node %d (%s)", n, lw);
	}

chosen:
	place_shards(t, r, n_ranks, set_mode, &p);
	describe_shards(&p, shards, sizeof(shards));
	/* a reason too long for p.reason is cut: it is a log text */
	(void)!snprintf(p.reason, sizeof(p.reason), "arena on node %s, %u shard%s, %s (%s: %s)%s",
		 nodes, p.n_shards, p.n_shards > 1 ? "s" : "",
		 kvt_numa_mode_name(p.shard[0].mode), kvt_numa_source_name(p.source), why,
		 shards);
	kvt__numa_log(r->log, r->log_arg, KVT_NUMA_LOG_INFO, "%s", p.reason);
	*out = p;
	return 0;
}
