/* dma.c - the DMA handle: backend selection, KV registration, host range
 * registration in pieces, tickets and the in-flight bound.
 *
 * Tickets.  A handle owns max_inflight ticket slots.  Submit takes a free
 * slot under the lock, pins the registration it uses (mr->inflight), and
 * hands the slot to the backend outside the lock; poll/wait ask the
 * backend about the slot outside the lock and, on a final status, take the
 * lock again to free the slot and unpin the registration.  A ticket is
 * (generation << 32 | slot + 1), so a consumed ticket reads as -ESTALE even
 * after its slot was reused.  One consumer per ticket: two threads waiting
 * on the same ticket is a caller bug (the second gets -ESTALE, or worse,
 * waits on the slot's next owner).
 *
 * Registrations.  A host range is registered in pieces of at most
 * piece_max bytes, each a multiple of `align` (the sub-slot size), because
 * recent NVIDIA drivers refuse one huge registration and a copy may not
 * straddle two.  Submit finds the piece holding the whole sub-slot span
 * and passes the backend that piece's device-visible address.
 *
 * Copies that outlive their process (DESIGN.md, "What outlives a
 * process").  A rank's claim on a sub-slot lives as long as its entry lock
 * (core/ranks.c): the kernel drops it in exit_files, when the last
 * reference to the lock's open file goes.  Which of the rank's DMA can
 * still write into the arena after that:
 *   - loads (arena -> GPU) write GPU memory only: nothing lands in the
 *     arena, whatever the timing;
 *   - host copies (host.c) run on the rank's own threads: they die with
 *     it, before exit_files;
 *   - a GPU save (D2H) in flight at the kill.  NVIDIA: the pinned pages
 *     stay pinned until the driver tears the context down, in the release
 *     of the process's /dev/nvidia* descriptors -- also in exit_files, in
 *     descriptor order, so the entry lock may go first.  AMD: the
 *     process's queues, SDMA engines included, are quiesced when its
 *     address space goes, in exit_mm (the userptr HMM notifier on the
 *     locked range runs with MMU_NOTIFY_RELEASE and evicts the KFD
 *     queues, kfd_process_evict_queues, before the KFD notifier's own
 *     release), and destroyed later by a deferred work item
 *     (kfd_process_wq_release); read from the amdgpu sources, not seen on
 *     hardware.  That comes before exit_files, but only the first
 *     eviction quiesces (one already pending, or a CRIU restore, skips
 *     it).  So a save's copy can land after the reaper freed the slot:
 *     on NVIDIA for the time the driver takes to stop the queue, on AMD
 *     where the eviction did not quiesce it.
 * Held by the exit witness (core/witness.c): a rank on a GPU backend
 * spawns kvtier-witness at kvt_register_kv, a second holder of its lock
 * description that lets go only once the rank has wholly exited (its
 * pidfd polls readable after exit_files and exit_task_work, so after the
 * driver's files were released and its context torn down), so the claims
 * outlive every copy the driver still runs; kvtierd holds it too
 * (core/witness_srv.c), for a kill of the rank's whole cgroup.  What is
 * still open: docs/FAULTS.md.  Not run on a GPU.  The dead rank's own chunk is never published READY.
 * The disk engine's reads are held the same way by their own mechanism:
 * its ring keeps the lock descriptor (kvt_seg_lock_fd, tier/disk/disk.c).
 */
#include "dma_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static _Thread_local char last_error[512];

const char *kvt_dma_last_error(void)
{
	return last_error;
}

int kvt__fmt(int rc, char *msg, size_t len, const char *fmt, ...)
{
	va_list ap;

	if (msg && len) {
		va_start(ap, fmt);
		vsnprintf(msg, len, fmt, ap);
		va_end(ap);
	}
	return rc;
}

int kvt__dma_err(int rc, const char *fmt, ...)
{
	char tmp[sizeof(last_error)];
	va_list ap;

	/* Through a copy: an argument may be this very buffer (a message
	 * that wraps the previous one); vsnprintf onto itself garbles it. */
	va_start(ap, fmt);
	vsnprintf(tmp, sizeof(tmp), fmt, ap);
	va_end(ap);
	memcpy(last_error, tmp, sizeof(tmp));
	return rc;
}

static void log_default(const struct kvt_dma_config *c, int level, const char *msg)
{
	if (c->log) {
		c->log(c->log_arg, level, msg);
		return;
	}
	if (level > KVT_DMA_LOG_INFO ||
	    ((c->flags & KVT_DMA_F_QUIET) && level > KVT_DMA_LOG_ERR))
		return;
	fprintf(stderr, "kvtier dma: %s\n", msg);
}

void kvt__dma_log(const struct kvt_dma *d, int level, const char *fmt, ...)
{
	char buf[1024];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	log_default(&d->cfg, level, buf);
}

/* ---- selection ------------------------------------------------------------ */

static const struct kvt_dma_ops *const backends[] = {
#ifdef KVTIER_HAVE_HSA
	&kvt__dma_hsa_ops,
#endif
#ifdef KVTIER_HAVE_CUDA
	&kvt__dma_cuda_ops,
#endif
	&kvt__dma_host_ops,
};
#define N_BACKENDS (sizeof(backends) / sizeof(backends[0]))

static int backend_known(const char *name)
{
	return !strcmp(name, "hsa") || !strcmp(name, "cuda") || !strcmp(name, "host");
}

static int config_fill(struct kvt_dma_config *c, const struct kvt_dma_config *in)
{
	memset(c, 0, sizeof(*c));
	c->device = -1;
	if (in) {
		if (in->size < offsetof(struct kvt_dma_config, log) ||
		    in->size > sizeof(*c))
			return kvt__dma_err(-EINVAL, "config.size %zu is not a size this "
					    "library knows", in->size);
		memcpy(c, in, in->size);
		c->size = sizeof(*c);
	}
	if (c->flags & ~KVT_DMA_F_MASK)
		return kvt__dma_err(-EINVAL, "config.flags 0x%x has unknown bits", c->flags);
	/* A runtime library variable set but empty is a mistake, refused
	 * for the backends that would read it (auto would otherwise skip the
	 * backend in silence). */
	{
		static const char *const libs[][2] = { { "hsa", "KVTIER_HSA_LIBRARY" },
						       { "cuda", "KVTIER_CUDA_LIBRARY" } };
		const char *b = c->backend ? c->backend : getenv("KVTIER_DMA");
		for (size_t i = 0; i < sizeof(libs) / sizeof(libs[0]); i++) {
			const char *v = getenv(libs[i][1]);
			if (v && !*v && (!b || !*b || !strcmp(b, "auto") || !strcmp(b, libs[i][0])))
				return kvt__dma_err(-EINVAL, "%s is set but empty: unset it, or "
						    "name the runtime library", libs[i][1]);
		}
	}
	if (c->node_ranks > 4096)
		return kvt__dma_err(-EINVAL, "config.node_ranks %u > 4096", c->node_ranks);
	if (c->device < -1)
		return kvt__dma_err(-EINVAL, "config.device %d", (int)c->device);
	if (c->max_inflight == 0)
		c->max_inflight = KVT_DMA_INFLIGHT_DEFAULT;
	if (c->max_inflight > KVT_DMA_INFLIGHT_MAX)
		return kvt__dma_err(-EINVAL, "config.max_inflight %u > %u",
				    c->max_inflight, KVT_DMA_INFLIGHT_MAX);
	if (c->piece_max == 0)
		c->piece_max = KVT_DMA_PIECE_MAX;
	if (!c->backend)
		c->backend = getenv("KVTIER_DMA");
	if (!c->backend || !*c->backend)
		c->backend = "auto";
	if (strcmp(c->backend, "auto") && !backend_known(c->backend))
		return kvt__dma_err(-EINVAL, "KVTIER_DMA=%s: not one of auto, hsa, cuda, host",
				    c->backend);
	return 0;
}

static void describe_update(kvt_dma *d)
{
	snprintf(d->describe, sizeof(d->describe), "%s%s%s%s%s", d->ops->name,
		 d->feature[0] ? ": " : "", d->feature,
		 d->skipped[0] ? "; skipped " : "", d->skipped);
}

static void dma_free(kvt_dma *d)
{
	if (!d)
		return;
	pthread_mutex_destroy(&d->lock);
	pthread_cond_destroy(&d->reg_cv);
	free(d->slots);
	free(d->bases);
	free(d->ranges);
	free(d);
}

int kvt__dma_add_range(struct kvt_dma *d, uint64_t start, uint64_t end)
{
	uint32_t i = 0;

	if (end <= start)
		return 0;
	while (i < d->n_ranges && d->ranges[i].end <= start)
		i++;
	if (i < d->n_ranges && d->ranges[i].start < end)
		return 0; /* known (or overlapping what is known: keep the first) */
	if (d->n_ranges == d->cap_ranges) {
		uint32_t cap = d->cap_ranges ? 2 * d->cap_ranges : 16;
		struct kvt_range *r = realloc(d->ranges, cap * sizeof(*r));

		if (!r)
			return kvt__dma_err(-ENOMEM, "out of memory");
		d->ranges = r;
		d->cap_ranges = cap;
	}
	memmove(&d->ranges[i + 1], &d->ranges[i], (d->n_ranges - i) * sizeof(*d->ranges));
	d->ranges[i] = (struct kvt_range){ .start = start, .end = end };
	d->n_ranges++;
	return 0;
}

int kvt_dma_open(const struct kvt_dma_config *cin, kvt_dma **out)
{
	char skipped[512] = "";
	char why[256];
	kvt_dma *d;
	int rc = -ENOENT, any = 0;

	if (!out)
		return kvt__dma_err(-EINVAL, "out is NULL");
	d = calloc(1, sizeof(*d));
	if (!d)
		return kvt__dma_err(-ENOMEM, "out of memory");
	rc = config_fill(&d->cfg, cin);
	if (rc) {
		free(d);
		return rc;
	}
	d->device = d->cfg.device;
	pthread_mutex_init(&d->lock, NULL);
	pthread_cond_init(&d->reg_cv, NULL);
	d->slots = calloc(d->cfg.max_inflight, sizeof(*d->slots));
	if (!d->slots) {
		dma_free(d);
		return kvt__dma_err(-ENOMEM, "out of memory");
	}

	for (size_t i = 0; i < N_BACKENDS; i++) {
		const struct kvt_dma_ops *o = backends[i];
		size_t n;

		if (strcmp(d->cfg.backend, "auto") && strcmp(d->cfg.backend, o->name))
			continue;
		any = 1;
		why[0] = 0;
		d->ops = o;
		d->feature[0] = 0;
		rc = o->init(d, why, sizeof(why));
		if (rc == 0) {
			/* auto: name the ones after it too, so the log accounts for
			 * every backend */
			for (size_t k = i + 1; k < N_BACKENDS && !strcmp(d->cfg.backend, "auto"); k++) {
				n = strlen(skipped);
				snprintf(skipped + n, sizeof(skipped) - n, "%s%s: not tried",
					 n ? "; " : "", backends[k]->name);
			}
			break;
		}
		d->ops = NULL;
		n = strlen(skipped);
		snprintf(skipped + n, sizeof(skipped) - n, "%s%s: %s", n ? "; " : "",
			 o->name, why[0] ? why : strerror(-rc));
		if (strcmp(d->cfg.backend, "auto"))
			break;
	}
	if (!d->ops) {
		if (!any)
			rc = kvt__dma_err(-ENOENT, "KVTIER_DMA=%s: backend not built in",
					  d->cfg.backend);
		else
			kvt__dma_err(rc, "no DMA backend: %s", skipped);
		kvt__dma_log(d, KVT_DMA_LOG_ERR, "%s", last_error);
		dma_free(d);
		return rc;
	}
	snprintf(d->skipped, sizeof(d->skipped), "%s", skipped);
	describe_update(d);
	kvt__dma_log(d, KVT_DMA_LOG_INFO, "%s%s", !strcmp(d->cfg.backend, "auto") ?
		     "auto: took " : "", d->describe);
	/* no pointer into the caller's memory or the environment outlives open */
	d->cfg.backend = d->ops->name;
	*out = d;
	return 0;
}

/* Handles whose copies outlived their close's deadline: kept, never freed
 * or unregistered, so that a copy the device still runs finds its memory
 * registered and its streams alive; reachable from here until the process
 * exits (and not reported as leaks). */
static void mr_release(kvt_dma *d, kvt_dma_mr *mr);

static pthread_mutex_t kept_mu = PTHREAD_MUTEX_INITIALIZER;
static kvt_dma *kept[64];
static unsigned n_kept;

int kvt_dma_close_within(kvt_dma *d, int64_t timeout_ns)
{
	uint64_t deadline = kvt__deadline(timeout_ns), t0 = kvt__now_ns();
	uint32_t left = 0;

	if (!d)
		return 0;
	/* Drain: the arena may be unmapped right after close. */
	for (uint32_t s = 0; s < d->cfg.max_inflight; s++) {
		if (d->slots[s].state != KVT__JOB_BUSY)
			continue;
		if (d->ops->wait(d, s, deadline) == -ETIMEDOUT) {
			left++;
			continue;
		}
		d->slots[s].state = KVT__JOB_FREE;
		if (d->slots[s].mr)
			d->slots[s].mr->inflight--;
		d->inflight--;
	}
	if (left) {
		kvt__dma_log(d, KVT_DMA_LOG_ERR, "close: %u copies still running after %.1f s: "
			     "abandoned -- the handle, its registrations and streams are kept "
			     "until the process exits (the device may still read or write them)",
			     left, (kvt__now_ns() - t0) * 1e-9);
		pthread_mutex_lock(&kept_mu);
		if (n_kept < sizeof(kept) / sizeof(kept[0]))
			kept[n_kept++] = d;
		pthread_mutex_unlock(&kept_mu);
		return (int)left;
	}
	while (d->mrs) {
		kvt_dma_mr *mr = d->mrs;

		d->mrs = mr->next;
		mr_release(d, mr);
	}
	d->ops->fini(d);
	dma_free(d);
	return 0;
}

void kvt_dma_close(kvt_dma *d)
{
	kvt_dma_close_within(d, -1);
}

const char *kvt_dma_backend(const kvt_dma *d)
{
	return d ? d->ops->name : "";
}

const char *kvt_dma_describe(const kvt_dma *d)
{
	return d ? d->describe : "";
}

/* ---- the KV layout ------------------------------------------------------ */

int kvt_dma_kv_register(kvt_dma *d, const struct kvt_kv_layout *l)
{
	char msg[200];
	size_t n = 0, k = 0;
	int rc;

	if (!d)
		return kvt__dma_err(-EINVAL, "handle is NULL");
	if (d->have_layout)
		return kvt__dma_err(-EALREADY, "a KV layout is registered already");
	rc = kvt_kv_layout_check(l, msg, sizeof(msg));
	if (rc)
		return kvt__dma_err(rc, "KV layout: %s", msg);
	for (uint32_t g = 0; g < l->n_groups; g++)
		n += l->groups[g].n_layers;
	d->bases = calloc(n, sizeof(*d->bases));
	if (!d->bases)
		return kvt__dma_err(-ENOMEM, "out of memory");
	d->layout = *l;
	for (uint32_t g = 0; g < l->n_groups; g++) {
		memcpy(d->bases + k, l->groups[g].layer_base,
		       l->groups[g].n_layers * sizeof(*d->bases));
		d->layout.groups[g].layer_base = d->bases + k;
		k += l->groups[g].n_layers;
	}
	for (uint32_t g = l->n_groups; g < KVT_DMA_MAX_GROUPS; g++)
		memset(&d->layout.groups[g], 0, sizeof(d->layout.groups[g]));
	rc = d->ops->bind(d, &d->layout);
	if (rc) {
		free(d->bases);
		d->bases = NULL;
		d->n_ranges = 0;
		return rc;
	}
	d->have_layout = 1;
	describe_update(d);
	kvt__dma_log(d, KVT_DMA_LOG_INFO, "KV layout: %u groups, %u tokens/chunk, "
		     "%llu bytes/sub-slot; %s", l->n_groups, l->chunk_tokens,
		     (unsigned long long)kvt_kv_layout_shard_bytes(l), d->describe);
	return 0;
}

const struct kvt_kv_layout *kvt_dma_kv_layout(const kvt_dma *d)
{
	return d && d->have_layout ? &d->layout : NULL;
}

void kvt_dma_plan_caps(const kvt_dma *d, struct kvt_plan_caps *c)
{
	memset(c, 0, sizeof(*c));
	c->max_rows = 1;
	c->pitch_align = 1;
	if (!d)
		return;
	d->ops->caps(d, c);
	if (d->cfg.flags & KVT_DMA_F_NO_2D)
		c->max_rows = 1;
	c->ranges = d->ranges;
	c->n_ranges = d->n_ranges;
}

int kvt_dma_plan_build(const kvt_dma *d, struct kvt_plan *p,
		       const uint32_t *const *blocks, uint32_t n_tokens)
{
	struct kvt_plan_caps caps;

	if (!d || !d->have_layout)
		return kvt__dma_err(-EINVAL, "no KV layout registered");
	kvt_dma_plan_caps(d, &caps);
	int r = kvt_plan_build(p, &d->layout, &caps, blocks, n_tokens);
	if (r == -ERANGE) {
		/* say which id: the planner only returns the code */
		for (uint32_t g = 0; g < d->layout.n_groups; g++) {
			const struct kvt_kv_group *gr = &d->layout.groups[g];
			uint32_t nb = (n_tokens + gr->tokens_per_block - 1) / gr->tokens_per_block;
			for (uint32_t i = 0; blocks[g] && i < nb; i++)
				if (blocks[g][i] != KVT_DMA_BLOCK_SKIP && blocks[g][i] >= gr->n_blocks)
					return kvt__dma_err(r, "group %u: block id %u (entry %u of the "
							    "chunk's table) is beyond the %llu blocks "
							    "registered", g, blocks[g][i], i,
							    (unsigned long long)gr->n_blocks);
		}
	}
	return r < 0 && r != -ERANGE ? kvt__dma_err(r, "plan: %s", strerror(-r)) : r;
}

/* ---- host ranges -------------------------------------------------------- */

/* The rest of a registration, in address order, on its own thread: each
 * piece published (ready, release under the lock) as soon as it is locked,
 * so that submits into it go ahead while the later ones are still being
 * registered. */
static void *reg_thread(void *arg)
{
	kvt_dma_mr *mr = arg;
	kvt_dma *d = mr->d;
	uint64_t t0 = kvt__now_ns();
	uint32_t first;
	int rc = 0;

	pthread_mutex_lock(&d->lock);
	first = mr->ready;
	pthread_mutex_unlock(&d->lock);
	for (uint32_t i = first; i < mr->n_pieces; i++) {
		pthread_mutex_lock(&d->lock);
		int stop = mr->bg_stop;
		pthread_mutex_unlock(&d->lock);
		if (stop)
			break;
		rc = d->ops->mem_reg(d, &mr->pieces[i]);
		pthread_mutex_lock(&d->lock);
		if (rc) {
			mr->bg_err = rc;
			snprintf(mr->bg_why, sizeof(mr->bg_why), "piece %u of %u: %s", i,
				 mr->n_pieces, kvt_dma_last_error());
		} else {
			mr->ready = i + 1;
		}
		pthread_cond_broadcast(&d->reg_cv);
		pthread_mutex_unlock(&d->lock);
		if (rc)
			break;
	}
	if (rc)
		kvt__dma_log(d, KVT_DMA_LOG_ERR, "background registration failed at %s: copies "
			     "into the rest of the arena fail", mr->bg_why);
	else if (mr->ready == mr->n_pieces)
		kvt__dma_log(d, KVT_DMA_LOG_INFO, "registered %.2f GiB in %u pieces in the "
			     "background in %.3f s (%.2f GB/s)", (double)mr->len / (1u << 30),
			     mr->n_pieces, (kvt__now_ns() - t0) * 1e-9,
			     (double)mr->len / (double)(kvt__now_ns() - t0 + 1));
	return NULL;
}

/* Stops a registration's thread (after the piece it is on) and
 * unregisters what it registered; then frees it.  Not in d->mrs any more. */
static void mr_release(kvt_dma *d, kvt_dma_mr *mr)
{
	if (mr->bg_live) {
		pthread_mutex_lock(&d->lock);
		mr->bg_stop = 1;
		pthread_mutex_unlock(&d->lock);
		pthread_join(mr->bg, NULL);
		mr->bg_live = 0;
	}
	for (uint32_t i = 0; i < mr->ready; i++)
		d->ops->mem_unreg(d, &mr->pieces[i]);
	free(mr);
}

static int mem_register(kvt_dma *d, void *base, uint64_t len, uint64_t align,
			kvt_dma_mr **out, int background)
{
	uint64_t piece, n, end, t0;
	kvt_dma_mr *mr;
	int rc = 0;

	if (!d || !base || !len || !out)
		return kvt__dma_err(-EINVAL, "mem_register: NULL or empty range");
	if (align <= 1)
		align = 1;
	if (align > d->cfg.piece_max)
		return kvt__dma_err(-EINVAL, "mem_register: align %llu > piece_max %llu",
				    (unsigned long long)align,
				    (unsigned long long)d->cfg.piece_max);
	if (kvt__add_overflow((uintptr_t)base, len, &end))
		return kvt__dma_err(-EINVAL, "mem_register: range wraps");
	if (d->device < 0 && strcmp(d->ops->name, "host"))
		return kvt__dma_err(-EINVAL, "mem_register: no device bound yet "
				    "(register the KV layout or set config.device)");
	piece = d->cfg.piece_max / align * align;
	if (piece > len)
		piece = len;
	n = (len + piece - 1) / piece;
	if (n > UINT32_MAX)
		return kvt__dma_err(-EINVAL, "mem_register: too many pieces");

	pthread_mutex_lock(&d->lock);
	for (kvt_dma_mr *m = d->mrs; m; m = m->next)
		if ((char *)base < m->base + m->len && m->base < (char *)base + len)
			rc = -EINVAL;
	pthread_mutex_unlock(&d->lock);
	if (rc)
		return kvt__dma_err(rc, "mem_register: overlaps a registered range");

	mr = calloc(1, sizeof(*mr) + n * sizeof(mr->pieces[0]));
	if (!mr)
		return kvt__dma_err(-ENOMEM, "out of memory");
	mr->d = d;
	mr->base = base;
	mr->len = len;
	mr->piece_bytes = piece;
	mr->n_pieces = (uint32_t)n;
	for (uint64_t i = 0; i < n; i++) {
		mr->pieces[i].host = (char *)base + i * piece;
		mr->pieces[i].len = i + 1 < n ? piece : len - i * piece;
	}
	t0 = kvt__now_ns();
	/* the first piece at once (a memory the runtime refuses is said
	 * here), the rest now or in the background */
	for (uint64_t i = 0; i < (background ? 1 : n); i++) {
		rc = d->ops->mem_reg(d, &mr->pieces[i]);
		if (rc) {
			while (i--)
				d->ops->mem_unreg(d, &mr->pieces[i]);
			free(mr);
			return rc; /* the backend set the message */
		}
		mr->ready++;
	}
	mr->register_ns = kvt__now_ns() - t0;
	if (mr->ready == n)
		kvt__dma_log(d, KVT_DMA_LOG_INFO, "registered %.2f GiB in %u piece%s in %.3f s "
			     "(%.2f GB/s)", (double)len / (1u << 30), mr->n_pieces,
			     mr->n_pieces == 1 ? "" : "s", mr->register_ns * 1e-9,
			     mr->register_ns ? (double)len / mr->register_ns : 0.0);
	else
		kvt__dma_log(d, KVT_DMA_LOG_INFO, "registered the first %.2f of %.2f GiB in "
			     "%.3f s; the other %u pieces in the background",
			     (double)piece / (1u << 30), (double)len / (1u << 30),
			     mr->register_ns * 1e-9, mr->n_pieces - 1);
	pthread_mutex_lock(&d->lock);
	mr->next = d->mrs;
	d->mrs = mr;
	if (mr->ready < n) {
		rc = pthread_create(&mr->bg, NULL, reg_thread, mr);
		if (rc) {
			mr->bg_err = -rc;
			snprintf(mr->bg_why, sizeof(mr->bg_why), "no thread for it (%s)",
				 strerror(rc));
		} else {
			mr->bg_live = 1;
		}
	}
	pthread_mutex_unlock(&d->lock);
	*out = mr;
	return 0;
}

int kvt_dma_mem_register(kvt_dma *d, void *base, uint64_t len, uint64_t align,
			 kvt_dma_mr **out)
{
	return mem_register(d, base, len, align, out, 0);
}

int kvt_dma_mem_register_bg(kvt_dma *d, void *base, uint64_t len, uint64_t align,
			    kvt_dma_mr **out)
{
	return mem_register(d, base, len, align, out, 1);
}

uint64_t kvt_dma_mem_ready(const kvt_dma_mr *mr)
{
	uint64_t bytes;

	if (!mr)
		return 0;
	pthread_mutex_lock(&mr->d->lock);
	bytes = mr->ready == mr->n_pieces ? mr->len : (uint64_t)mr->ready * mr->piece_bytes;
	pthread_mutex_unlock(&mr->d->lock);
	return bytes;
}

int kvt_dma_mem_unregister(kvt_dma *d, kvt_dma_mr *mr)
{
	kvt_dma_mr **pp;

	if (!d || !mr)
		return kvt__dma_err(-EINVAL, "mem_unregister: NULL");
	pthread_mutex_lock(&d->lock);
	for (pp = &d->mrs; *pp && *pp != mr; pp = &(*pp)->next)
		;
	if (!*pp) {
		pthread_mutex_unlock(&d->lock);
		return kvt__dma_err(-EINVAL, "mem_unregister: not a registration of this handle");
	}
	if (mr->inflight) {
		pthread_mutex_unlock(&d->lock);
		return kvt__dma_err(-EBUSY, "mem_unregister: %u tickets in flight",
				    mr->inflight);
	}
	*pp = mr->next;
	pthread_mutex_unlock(&d->lock);
	mr_release(d, mr);
	return 0;
}

void kvt_dma_mr_info(const kvt_dma_mr *mr, struct kvt_dma_mr_info *info)
{
	memset(info, 0, sizeof(*info));
	if (!mr)
		return;
	info->base = mr->base;
	info->len = mr->len;
	info->piece_bytes = mr->piece_bytes;
	info->n_pieces = mr->n_pieces;
	pthread_mutex_lock(&mr->d->lock);
	info->ready_pieces = mr->ready;
	pthread_mutex_unlock(&mr->d->lock);
	info->inflight = __atomic_load_n(&mr->inflight, __ATOMIC_RELAXED);
	info->register_ns = mr->register_ns;
}

/* ---- tickets ------------------------------------------------------------ */

static kvt_dma_ticket ticket_of(uint32_t slot, uint32_t gen)
{
	return (uint64_t)gen << 32 | (slot + 1);
}

/* Slot of a live ticket, or -1 (under the lock). */
static int64_t ticket_slot(const kvt_dma *d, kvt_dma_ticket t)
{
	uint32_t s = (uint32_t)t - 1;

	if ((uint32_t)t == 0 || s >= d->cfg.max_inflight ||
	    d->slots[s].state != KVT__JOB_BUSY || d->slots[s].gen != (uint32_t)(t >> 32))
		return -1;
	return s;
}

int kvt_dma_submit(kvt_dma *d, const struct kvt_plan *p, void *subslot,
		   enum kvt_dma_dir dir, kvt_dma_ticket *t)
{
	struct kvt_dma_job job = { .plan = p, .host = subslot, .dir = dir };
	struct kvt_plan_caps caps;
	kvt_dma_mr *mr = NULL;
	const struct kvt_dma_piece *pc = NULL;
	uint32_t slot = 0;
	int rc;

	if (!d || !p || !subslot || !t || (dir != KVT_DMA_D2H && dir != KVT_DMA_H2D))
		return kvt__dma_err(-EINVAL, "submit: bad arguments");
	if (p->n > p->cap || (p->n && !p->copies))
		return kvt__dma_err(-EINVAL, "submit: bad plan");
	kvt_dma_plan_caps(d, &caps);
	for (uint32_t i = 0; i < p->n; i++) {
		const struct kvt_copy *c = &p->copies[i];

		if (!c->rows || !c->len || c->off + (uint64_t)(c->rows - 1) * c->host_pitch +
		    c->len > p->span || (c->rows > 1 && (c->rows > caps.max_rows ||
		    c->host_pitch < c->len || c->dev_pitch < c->len)))
			return kvt__dma_err(-EINVAL, "submit: copy %u of the plan is "
					    "malformed or beyond the backend's caps", i);
		if (c->rows > 1 && ((uintptr_t)subslot & (caps.pitch_align - 1)))
			return kvt__dma_err(-EINVAL, "submit: sub-slot %p not aligned to %u "
					    "for 2-D copies", subslot, caps.pitch_align);
	}

	pthread_mutex_lock(&d->lock);
	for (mr = d->mrs; mr; mr = mr->next)
		if ((char *)subslot >= mr->base && (char *)subslot < mr->base + mr->len)
			break;
	if (mr) {
		uint64_t off = (uint64_t)((char *)subslot - mr->base);

		pc = &mr->pieces[off / mr->piece_bytes];
		if (p->span > pc->len - (uint64_t)((char *)subslot - pc->host))
			pc = NULL;
	}
	if (!pc) {
		pthread_mutex_unlock(&d->lock);
		return kvt__dma_err(-EFAULT, "submit: sub-slot %p + %llu bytes is not inside "
				    "one registered piece", subslot, (unsigned long long)p->span);
	}
	/* a piece the background registration has not reached: wait for it
	 * (it moves at GB/s; only a rank's first seconds see this) */
	while ((uint32_t)(pc - mr->pieces) >= mr->ready && !mr->bg_err && !mr->bg_stop)
		pthread_cond_wait(&d->reg_cv, &d->lock);
	if ((uint32_t)(pc - mr->pieces) >= mr->ready) {
		char why[200];

		snprintf(why, sizeof(why), "%s", mr->bg_err ? mr->bg_why : "registration stopped");
		pthread_mutex_unlock(&d->lock);
		return kvt__dma_err(-EIO, "submit: the sub-slot's piece of the arena is not "
				    "registered: the background registration failed at %s", why);
	}
	if (d->inflight >= d->cfg.max_inflight) {
		pthread_mutex_unlock(&d->lock);
		return -EAGAIN; /* normal back-pressure: no message */
	}
	for (uint32_t i = 0; i < d->cfg.max_inflight; i++) {
		slot = (d->next_slot + i) % d->cfg.max_inflight;
		if (d->slots[slot].state == KVT__JOB_FREE)
			break;
	}
	d->next_slot = (slot + 1) % d->cfg.max_inflight;
	d->slots[slot].state = KVT__JOB_BUSY;
	d->slots[slot].gen++;
	d->slots[slot].mr = mr;
	mr->inflight++;
	d->inflight++;
	d->submits++;
	job.fault = d->cfg.fault_nth && d->submits == d->cfg.fault_nth;
	job.host_dev = pc->dev + (uint64_t)((char *)subslot - pc->host);
	pthread_mutex_unlock(&d->lock);

	rc = d->ops->submit(d, slot, &job);
	pthread_mutex_lock(&d->lock);
	if (rc) {
		d->slots[slot].state = KVT__JOB_FREE;
		mr->inflight--;
		d->inflight--;
	} else {
		*t = ticket_of(slot, d->slots[slot].gen);
	}
	pthread_mutex_unlock(&d->lock);
	return rc;
}

int kvt_dma_order_after(kvt_dma *d, uint64_t stream)
{
	if (!d)
		return kvt__dma_err(-EINVAL, "order_after: NULL handle");
	if (d->ops->order_after)
		return d->ops->order_after(d, stream);
	if (!strcmp(d->ops->name, "host"))
		return 0;
	return kvt__dma_err(-ENOTSUP, "%s: no ordering after the engine's stream; "
			    "synchronize it on the host before saving", d->ops->name);
}

/* ---- another process's memory and events ---- */

static int no_ipc(const kvt_dma *d)
{
	return kvt__dma_err(-ENOTSUP, "%s: no GPU IPC (the cuda backend: CUDA's IPC handles; "
			    "hsa: HIP's)", d ? d->ops->name : "(NULL handle)");
}

int kvt_dma_device_of_uuid(kvt_dma *d, const uint8_t uuid[16])
{
	if (!d || !d->ops->uuid || !uuid)
		return d && !uuid ? kvt__dma_err(-EINVAL, "device_of_uuid: NULL uuid") : no_ipc(d);
	return d->ops->uuid(d, uuid);
}

int kvt_dma_ipc_mem_open(kvt_dma *d, const void *handle, uint64_t *base, uint64_t *len)
{
	if (!d || !d->ops->ipc_open)
		return no_ipc(d);
	if (!handle || !base || !len)
		return kvt__dma_err(-EINVAL, "ipc_mem_open: NULL argument");
	return d->ops->ipc_open(d, handle, base, len);
}

int kvt_dma_ipc_mem_close(kvt_dma *d, uint64_t base)
{
	if (!d || !d->ops->ipc_close)
		return no_ipc(d);
	return d->ops->ipc_close(d, base);
}

int kvt_dma_fence_open(kvt_dma *d, kvt_dma_fence **out)
{
	if (!d || !d->ops->fence_open)
		return no_ipc(d);
	if (!out)
		return kvt__dma_err(-EINVAL, "fence_open: NULL out");
	return d->ops->fence_open(d, out);
}

int kvt_dma_fence_wait(kvt_dma_fence *f, const void *event_handle)
{
	if (!f || !event_handle)
		return kvt__dma_err(-EINVAL, "fence_wait: NULL argument");
	return f->d->ops->fence_wait(f, event_handle);
}

uint64_t kvt_dma_fence_stream(const kvt_dma_fence *f)
{
	return f ? f->d->ops->fence_stream(f) : 0;
}

int kvt_dma_fence_signal(kvt_dma_fence *f, void *event_handle)
{
	if (!f || !event_handle)
		return kvt__dma_err(-EINVAL, "fence_signal: NULL argument");
	return f->d->ops->fence_signal(f, event_handle);
}

int kvt_dma_fence_wait_value(kvt_dma_fence *f, const void *mem_handle, uint64_t offset,
			     uint64_t value)
{
	if (!f || !mem_handle)
		return kvt__dma_err(-EINVAL, "fence_wait_value: NULL argument");
	return f->d->ops->fence_wait_value(f, mem_handle, offset, value);
}

int kvt_dma_fence_signal_value(kvt_dma_fence *f, void *mem_handle, uint64_t *offset,
			       uint64_t *value)
{
	if (!f || !mem_handle || !offset || !value)
		return kvt__dma_err(-EINVAL, "fence_signal_value: NULL argument");
	return f->d->ops->fence_signal_value(f, mem_handle, offset, value);
}

void kvt_dma_fence_close(kvt_dma_fence *f)
{
	if (f)
		f->d->ops->fence_close(f);
}

static int finish(kvt_dma *d, kvt_dma_ticket t, uint32_t slot, int rc)
{
	if (rc == -EINPROGRESS || rc == -ETIMEDOUT)
		return rc;
	pthread_mutex_lock(&d->lock);
	if (ticket_slot(d, t) != slot) {
		pthread_mutex_unlock(&d->lock);
		return kvt__dma_err(-ESTALE, "ticket consumed by another thread");
	}
	d->slots[slot].state = KVT__JOB_FREE;
	d->slots[slot].mr->inflight--;
	d->slots[slot].mr = NULL;
	d->inflight--;
	pthread_mutex_unlock(&d->lock);
	/* the backend's reason, when it gave one (a fault, a lost context) */
	if (rc && last_error[0])
		kvt__dma_err(rc, "%s: a copy of the chunk failed: %s", d->ops->name, last_error);
	else if (rc)
		kvt__dma_err(rc, "%s: a copy of the chunk failed", d->ops->name);
	return rc;
}

int kvt_dma_poll(kvt_dma *d, kvt_dma_ticket t)
{
	int64_t slot;

	if (!d)
		return -EINVAL;
	pthread_mutex_lock(&d->lock);
	slot = ticket_slot(d, t);
	pthread_mutex_unlock(&d->lock);
	if (slot < 0)
		return kvt__dma_err(-ESTALE, "ticket %#llx is not live", (unsigned long long)t);
	last_error[0] = 0; /* what the backend says now, not an older error */
	return finish(d, t, (uint32_t)slot, d->ops->poll(d, (uint32_t)slot));
}

int kvt_dma_wait(kvt_dma *d, kvt_dma_ticket t, int64_t timeout_ns)
{
	int64_t slot;

	if (!d)
		return -EINVAL;
	pthread_mutex_lock(&d->lock);
	slot = ticket_slot(d, t);
	pthread_mutex_unlock(&d->lock);
	if (slot < 0)
		return kvt__dma_err(-ESTALE, "ticket %#llx is not live", (unsigned long long)t);
	last_error[0] = 0;
	return finish(d, t, (uint32_t)slot,
		      d->ops->wait(d, (uint32_t)slot, kvt__deadline(timeout_ns)));
}

uint32_t kvt_dma_inflight(const kvt_dma *d)
{
	return d ? __atomic_load_n(&d->inflight, __ATOMIC_RELAXED) : 0;
}

uint32_t kvt_dma_max_inflight(const kvt_dma *d)
{
	return d ? d->cfg.max_inflight : 0;
}

/* ---- device memory helpers ---------------------------------------------- */

static int need_device(const kvt_dma *d)
{
	if (!d)
		return -EINVAL;
	if (d->device < 0 && strcmp(d->ops->name, "host"))
		return kvt__dma_err(-EINVAL, "no device bound (set config.device or "
				    "register the KV layout)");
	return 0;
}

int kvt_dma_dev_alloc(kvt_dma *d, uint64_t bytes, uint64_t *dev)
{
	int rc = need_device(d);

	if (rc)
		return rc;
	if (!bytes || !dev)
		return kvt__dma_err(-EINVAL, "dev_alloc: bad arguments");
	return d->ops->dev_alloc(d, bytes, dev);
}

int kvt_dma_dev_free(kvt_dma *d, uint64_t dev)
{
	int rc = need_device(d);

	return rc ? rc : d->ops->dev_free(d, dev);
}

int kvt_dma_dev_write(kvt_dma *d, uint64_t dev, const void *src, uint64_t len)
{
	int rc = need_device(d);

	return rc ? rc : d->ops->dev_write(d, dev, src, len);
}

int kvt_dma_dev_read(kvt_dma *d, void *dst, uint64_t dev, uint64_t len)
{
	int rc = need_device(d);

	return rc ? rc : d->ops->dev_read(d, dst, dev, len);
}

int kvt_dma_ceiling(kvt_dma *d, enum kvt_dma_dir dir, uint64_t dev,
		    uint64_t bytes, uint64_t copy_bytes, uint32_t iters,
		    double *seconds)
{
	int rc = need_device(d);

	if (rc)
		return rc;
	if (!bytes || !copy_bytes || copy_bytes > bytes || !iters || !seconds)
		return kvt__dma_err(-EINVAL, "ceiling: bad arguments");
	return d->ops->ceiling(d, dir, dev, bytes, copy_bytes, iters, seconds);
}
