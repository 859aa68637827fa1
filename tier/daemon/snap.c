/* snap.c - reading a live segment into a snapshot, and its renderings:
 * Prometheus text format 0.0.4, JSON, the kvtier-stat screen (snap.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "snap.h"

void kvtd_printf(struct kvtd_buf *b, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (b->oom)
		return;
	for (;;) {
		size_t room = b->cap - b->len;
		va_start(ap, fmt);
		n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? room : 0, fmt, ap);
		va_end(ap);
		if (n < 0) {
			b->oom = 1;
			return;
		}
		if (b->p && (size_t)n < room) {
			b->len += (size_t)n;
			return;
		}
		size_t cap = b->cap ? b->cap * 2 : 8192;
		while (cap < b->len + (size_t)n + 1)
			cap *= 2;
		char *p = realloc(b->p, cap);
		if (!p) {
			b->oom = 1;
			return;
		}
		b->p = p;
		b->cap = cap;
	}
}

static char *buf_done(struct kvtd_buf *b)
{
	if (b->oom || !b->p) {
		free(b->p);
		return NULL;
	}
	return b->p;
}

static uint64_t clock_ns(clockid_t c)
{
	struct timespec ts;

	clock_gettime(c, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* Reads a small /proc or /sys file into buf; its length, or -1. */
static ssize_t read_small(const char *path, char *buf, size_t len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n = fd < 0 ? -1 : read(fd, buf, len - 1);

	if (fd >= 0)
		close(fd);
	if (n >= 0)
		buf[n] = 0;
	return n;
}

/* Whether a live holder is stopped: SIGSTOP or ptrace (state T or t in
 * /proc/PID/stat), or in a frozen cgroup (v2 cgroup.events "frozen 1", v1
 * freezer.state FROZEN -- docker pause).  A report only, never liveness
 * (the lock decides that): the pid is the holder's in its own namespace,
 * so the answer counts only when /proc/PID here is the same process (its
 * start time, field 22, equals the one the holder wrote).  A holder in
 * another PID namespace is not looked at.  While stopped, a holder blocks
 * whoever waits for its next step (README: troubleshooting). */
static int proc_stopped(int pid, uint64_t start)
{
	char path[600], buf[1024], cg[4096];
	ssize_t n;

	if (pid <= 0 || !start || kvt_proc_start_time(pid) != start)
		return 0;
	snprintf(path, sizeof(path), "/proc/%d/stat", pid);
	n = read_small(path, buf, sizeof(buf));
	char *p = n > 0 ? strrchr(buf, ')') : NULL;
	if (p && p[1] == ' ' && (p[2] == 'T' || p[2] == 't'))
		return 1;
	snprintf(path, sizeof(path), "/proc/%d/cgroup", pid);
	if (read_small(path, cg, sizeof(cg)) <= 0)
		return 0;
	for (char *line = strtok(cg, "\n"); line; line = strtok(NULL, "\n")) {
		/* "0::/path" (v2) or "N:freezer:/path" (v1) */
		char *rel = strchr(line, ':');
		rel = rel ? strchr(rel + 1, ':') : NULL;
		if (!rel || rel[1] != '/' || strstr(rel, ".."))
			continue;
		if (!strncmp(line, "0::", 3)) {
			/* unified, or hybrid (v2 mounted at unified/) */
			for (int h = 0; h < 2; h++) {
				snprintf(path, sizeof(path), "/sys/fs/cgroup%s%.500s/cgroup.events",
					 h ? "/unified" : "", rel + 1);
				if (read_small(path, buf, sizeof(buf)) > 0 && strstr(buf, "frozen 1"))
					return 1;
			}
		} else if (strstr(line, ":freezer:")) {
			snprintf(path, sizeof(path), "/sys/fs/cgroup/freezer%.500s/freezer.state",
				 rel + 1);
			if (read_small(path, buf, sizeof(buf)) > 0 && !strncmp(buf, "FROZEN", 6))
				return 1;
		}
	}
	return 0;
}

int kvtd_snap_read(kvt_seg *s, struct kvtd_snap *o)
{
	const struct kvt_geometry *g = kvt_seg_geometry(s);

	memset(o, 0, sizeof(*o));
	snprintf(o->name, sizeof(o->name), "%s", kvt_seg_name(s));
	o->draining = kvt_seg_draining(s);
	o->mono_ns = clock_ns(CLOCK_MONOTONIC);
	o->wall_ns = clock_ns(CLOCK_REALTIME);
	o->geo = *g;
	o->n_shards = kvt_seg_n_shards(s);
	o->n_entries = kvt_seg_n_entries(s);
	o->shard_bytes = kvt_seg_shard_bytes(s);
	o->chunk_bytes = kvt_seg_chunk_bytes(s);
	o->segment_bytes = kvt_seg_size(s);
	kvt_occupancy_read(s, &o->occ);
	kvt_counters_read(s, o->ctr);
	for (int h = 0; h < KVT_H__COUNT; h++)
		kvt_hist_read(s, UINT32_MAX, (enum kvt_hist)h, &o->hist[h]);
	o->owner_pid = kvt_seg_owner(s);
	o->has_disk = kvt_disk_capacity(s) > 0 && kvt_disk_status_read(s, &o->disk) == 0;
	o->ents = calloc(o->n_entries ? o->n_entries : 1, sizeof(*o->ents));
	if (!o->ents)
		return -ENOMEM;
	for (uint32_t e = 0; e < o->n_entries; e++) {
		struct kvtd_entry *x = &o->ents[e];
		if (kvt_seg_entry_info(s, e, &x->info))
			x->bad = 1;
		else if (x->info.state == KVT_ENTRY_ATTACHED)
			x->stopped = proc_stopped(x->info.pid, x->info.start);
		kvt_seg_entry_counters(s, e, x->ctr);
		if (x->bad || x->info.instance >= g->n_instances)
			continue;
		struct kvtd_inst *in = &o->inst[x->info.instance];
		in->lookups += x->ctr[KVT_C_LOOKUPS];
		in->lookup_chunks += x->ctr[KVT_C_LOOKUP_CHUNKS];
		in->hit_chunks += x->ctr[KVT_C_HIT_CHUNKS];
		in->hit_tokens += x->ctr[KVT_C_HIT_TOKENS];
		in->saved_chunks += x->ctr[KVT_C_SAVED_CHUNKS];
		in->shared_hits += x->ctr[KVT_C_SHARED_HITS];
		in->loaded_chunks += x->ctr[KVT_C_LOADED_CHUNKS];
		if (x->info.state == KVT_ENTRY_ATTACHED) {
			if (x->info.role == KVT_ROLE_SCHEDULER)
				in->scheduler_up = 1;
			else
				in->ranks_up++;
		}
	}
	{
		uint32_t wo[KVT_MAX_INSTANCES];
		kvtd_write_only(o, NULL, wo);
		for (uint32_t i = 0; i < KVT_MAX_INSTANCES; i++)
			o->inst[i].write_only = wo[i];
		kvtd_unshared(o, NULL, wo);
		for (uint32_t i = 0; i < KVT_MAX_INSTANCES; i++)
			o->inst[i].unshared = wo[i];
	}
	return 0;
}

void kvtd_snap_free(struct kvtd_snap *s)
{
	free(s->ents);
	s->ents = NULL;
}

void kvtd_write_only(struct kvtd_snap *now, const struct kvtd_snap *old,
		     uint32_t out[KVT_MAX_INSTANCES])
{
	for (uint32_t i = 0; i < KVT_MAX_INSTANCES; i++) {
		const struct kvtd_inst *a = &now->inst[i];
		out[i] = 0;
		if (i >= now->geo.n_instances)
			continue;
		if (a->saved_chunks && !a->lookups)
			out[i] = 1;
		if (old && old->geo.n_instances == now->geo.n_instances) {
			const struct kvtd_inst *b = &old->inst[i];
			if (a->saved_chunks > b->saved_chunks && a->lookups == b->lookups)
				out[i] = 1;
		}
	}
}

void kvtd_isample(const struct kvtd_snap *s, struct kvtd_isample out[KVT_MAX_INSTANCES])
{
	for (uint32_t i = 0; i < KVT_MAX_INSTANCES; i++)
		out[i] = (struct kvtd_isample){ .saved = s->inst[i].saved_chunks,
			.lookups = s->inst[i].lookups, .lookup_chunks = s->inst[i].lookup_chunks,
			.shared_hits = s->inst[i].shared_hits };
}

void kvtd_unshared(const struct kvtd_snap *now, const struct kvtd_isample *old,
		   uint32_t out[KVT_MAX_INSTANCES])
{
	struct kvtd_isample cur[KVT_MAX_INSTANCES];
	uint32_t n = now->geo.n_instances < KVT_MAX_INSTANCES ? now->geo.n_instances :
		     KVT_MAX_INSTANCES;
	uint64_t saved_all = 0, d_saved[KVT_MAX_INSTANCES];

	kvtd_isample(now, cur);
	for (uint32_t i = 0; i < n; i++) {
		/* counters only grow; a reset (a segment made again) reads as 0 */
		d_saved[i] = old && cur[i].saved >= old[i].saved ? cur[i].saved - old[i].saved :
			     old ? 0 : cur[i].saved;
		saved_all += d_saved[i];
	}
	for (uint32_t i = 0; i < KVT_MAX_INSTANCES; i++) {
		uint64_t lc, sh;

		out[i] = 0;
		if (i >= n || n < 2)
			continue;
		lc = cur[i].lookup_chunks - (old ? old[i].lookup_chunks : 0);
		sh = cur[i].shared_hits - (old ? old[i].shared_hits : 0);
		if (old && (cur[i].lookup_chunks < old[i].lookup_chunks ||
			    cur[i].shared_hits < old[i].shared_hits))
			continue;
		out[i] = lc >= KVTD_UNSHARED_MIN && saved_all - d_saved[i] >= KVTD_UNSHARED_MIN &&
			 sh == 0;
	}
}

/* ---- names ---- */

static const struct {
	const char *metric, *help;
} counter_meta[KVT_C__COUNT] = {
	[KVT_C_LOOKUPS] = { "lookups", "Prompt lookups (kvt_lookup calls)" },
	[KVT_C_LOOKUP_CHUNKS] = { "lookup_chunks", "Chunk keys looked up" },
	[KVT_C_HIT_CHUNKS] = { "hit_chunks", "Chunks found READY and pinned by lookups" },
	[KVT_C_HIT_TOKENS] = { "hit_tokens", "Tokens of the chunks lookups hit" },
	[KVT_C_SAVED_CHUNKS] = { "saved_chunks", "Chunk shards written and published by ranks" },
	[KVT_C_SAVE_SKIPS] = { "save_skips", "Chunk shard saves skipped: saved or being saved already" },
	[KVT_C_SAVE_NOSPC] = { "save_nospc", "Chunk shard saves dropped: no slot could be evicted" },
	[KVT_C_LOADED_CHUNKS] = { "loaded_chunks", "Chunk shards loaded back by ranks" },
	[KVT_C_BYTES_SAVED] = { "saved_bytes", "Bytes copied into the arena by saves" },
	[KVT_C_BYTES_LOADED] = { "loaded_bytes", "Bytes copied out of the arena by loads" },
	[KVT_C_EVICTIONS] = { "evictions", "READY chunks evicted to make room" },
	[KVT_C_STALE_UNPINS] = { "stale_unpins", "Leases released by the two-step stale sweep" },
	[KVT_C_DOUBLE_UNPINS] = { "double_unpins", "Releases of leases released already" },
	[KVT_C_REAPED_RANKS] = { "reaped_entries", "Table entries of dead processes reaped" },
	[KVT_C_FILL_ABORTS] = { "fill_aborts", "Chunk fills abandoned (a shard never completed)" },
	[KVT_C_FILL_TIMEOUTS] = { "fill_timeouts", "FILLING slots reclaimed after the fill timeout" },
	[KVT_C_LEASES_FULL] = { "lease_table_full", "Lookups refused: the lease table was full" },
	[KVT_C_INDEX_FULL] = { "index_full", "Inserts refused: both index buckets full" },
	[KVT_C_DISK_WRITES] = { "disk_writes", "Chunks written to the disk tier" },
	[KVT_C_DISK_READS] = { "disk_reads", "Chunks read from the disk tier" },
	[KVT_C_DMA_ERRORS] = { "dma_errors", "Copies that failed (their chunks not published or not valid)" },
	[KVT_C_LOST_CLAIMS] = { "lost_claims", "Shard claims found gone at write end (must stay 0)" },
	[KVT_C_PIN_REPAIRS] = { "pin_repairs", "Pin counts recounted after a death" },
	[KVT_C_ADOPTED] = { "adopted_steps", "Half-done steps of dead processes finished by a waiter" },
	[KVT_C_DISK_BYTES_WRITTEN] = { "disk_written_bytes", "Payload bytes the disk tier wrote (demotions)" },
	[KVT_C_DISK_BYTES_READ] = { "disk_read_bytes", "Payload bytes the disk tier read back (promotions)" },
	[KVT_C_DISK_ADMIT_REJECTS] = { "disk_admission_rejects", "READY chunks the admission policy kept off the disk" },
	[KVT_C_DISK_CSUM_ERRORS] = { "disk_checksum_errors", "Disk reads whose checksum did not match: misses, never served" },
	[KVT_C_DISK_EVICTIONS] = { "disk_evictions", "Chunks dropped from a full disk tier" },
	[KVT_C_DISK_WRITE_DROPS] = { "disk_write_drops", "Demotions abandoned (the slot was evicted during the write, or an I/O error)" },
	[KVT_C_PROMOTE_REQUESTS] = { "promote_requests", "Disk chunks lookups asked back into DRAM" },
	[KVT_C_PROMOTE_DROPS] = { "promote_drops", "Promotions not done (stale request, no free slot, ring full, bad checksum)" },
	[KVT_C_SHARED_HITS] = { "shared_hits", "Chunks lookups hit that a rank of another instance saved" },
};

static const char *const hist_help[KVT_H__COUNT] = {
	[KVT_H_LOOKUP] = "Latency of kvt_lookup (pinning included)",
	[KVT_H_SAVE] = "Latency of a save op, submission to its last chunk's completion",
	[KVT_H_LOAD] = "Latency of a load op, submission to its last chunk's completion",
	[KVT_H_DISK_READ] = "Latency of a disk tier read",
	[KVT_H_DISK_WRITE] = "Latency of a disk tier write",
};

static const char *entry_state_name(const struct kvtd_entry *e)
{
	if (e->bad)
		return "corrupt";
	if (e->stopped)
		return "stopped";
	switch (e->info.state) {
	case KVT_ENTRY_EMPTY: return "empty";
	case KVT_ENTRY_ATTACHED: return "attached";
	case KVT_ENTRY_DEAD: return "dead";
	default: return "busy";
	}
}

static uint32_t entry_index(const struct kvtd_snap *s, uint32_t inst, uint32_t rank)
{
	/* rank == world: the scheduler */
	return inst * (s->geo.world + 1) + rank;
}

static double age_s(const struct kvtd_snap *s, const struct kvtd_entry *e)
{
	if (!e->info.heartbeat_ns || e->info.heartbeat_ns > s->mono_ns)
		return 0.0;
	return (double)(s->mono_ns - e->info.heartbeat_ns) / 1e9;
}

static void json_str(struct kvtd_buf *b, const char *v)
{
	kvtd_printf(b, "\"");
	for (const unsigned char *p = (const unsigned char *)(v ? v : ""); *p; p++) {
		if (*p == '"' || *p == '\\')
			kvtd_printf(b, "\\%c", *p);
		else if (*p < 0x20 || *p == 0x7f)
			kvtd_printf(b, "\\u%04x", *p);
		else
			kvtd_printf(b, "%c", *p);
	}
	kvtd_printf(b, "\"");
}

/* A Prometheus label value: backslash, quote and newline escaped. */
static void prom_label(struct kvtd_buf *b, const char *v)
{
	for (const char *p = v ? v : ""; *p; p++) {
		if (*p == '\\' || *p == '"')
			kvtd_printf(b, "\\%c", *p);
		else if (*p == '\n')
			kvtd_printf(b, "\\n");
		else
			kvtd_printf(b, "%c", *p);
	}
}

/* ---- health ---- */

int kvtd_health(const struct kvtd_snap *s, const struct kvtd_ctx *c, char **json)
{
	struct kvtd_buf b = { 0 };
	uint32_t n_inst = c->expect_instances < s->geo.n_instances ? c->expect_instances
								   : s->geo.n_instances;
	int ok = !c->draining && !s->draining, first = 1;

	if (c->lmcache_form) {
		/* `lmcache server`'s own answer (http_apis/info_api.py): engines'
		 * launchers wait for it before they start the workers */
		ok = ok && c->lmcache_up;
		if (ok)
			kvtd_printf(&b, "{\"status\":\"healthy\"}");
		else
			kvtd_printf(&b, "{\"status\":\"unhealthy\",\"reason\":\"%s\"}",
				    c->lmcache_up ? "draining" : "the LMCache endpoint is not served");
		*json = buf_done(&b);
		return ok;
	}
	kvtd_printf(&b, "{\"segment\":");
	json_str(&b, s->name);
	kvtd_printf(&b, ",\"draining\":%s,\"expected_instances\":%u,\"world\":%u,\"problems\":[",
		    (c->draining || s->draining) ? "true" : "false", n_inst, s->geo.world);
	for (uint32_t i = 0; i < n_inst; i++) {
		uint32_t last = c->expect_schedulers ? s->geo.world : s->geo.world - 1;
		for (uint32_t r = 0; r <= last; r++) {
			const struct kvtd_entry *e = &s->ents[entry_index(s, i, r)];
			if (!e->bad && e->info.state == KVT_ENTRY_ATTACHED && !e->stopped)
				continue;
			ok = 0;
			kvtd_printf(&b, "%s{\"instance\":%u,", first ? "" : ",", i);
			if (r == s->geo.world)
				kvtd_printf(&b, "\"role\":\"scheduler\"");
			else
				kvtd_printf(&b, "\"role\":\"rank\",\"rank\":%u", r);
			kvtd_printf(&b, ",\"state\":\"%s\"", e->info.state == KVT_ENTRY_EMPTY && !e->bad
				    ? "missing" : entry_state_name(e));
			if (e->info.pid && e->info.state != KVT_ENTRY_EMPTY)
				kvtd_printf(&b, ",\"pid\":%d", e->info.pid);
			kvtd_printf(&b, "}");
			first = 0;
		}
	}
	/* A disk taken offline for I/O errors leaves the node serving from
	 * DRAM: degraded, not unhealthy (a router should keep using it). */
	int disk_failed = s->has_disk && s->disk.failed;
	if (s->has_disk)
		kvtd_printf(&b, "],\"disk\":\"%s\"", disk_failed ? "failed" :
			    s->disk.online ? "online" : "offline");
	else
		kvtd_printf(&b, "]");
	/* so is an L3 store that does not answer: lookups still answer from
	 * DRAM and disk, the store comes back by itself */
	int l3_down = c && c->l3_on && !c->l3.up;
	if (c && c->l3_on)
		kvtd_printf(&b, ",\"l3\":\"%s\"", l3_down ? "down" : "up");
	kvtd_printf(&b, ",\"status\":\"%s\"}\n", !ok ? "unhealthy" :
		    disk_failed || l3_down ? "degraded" : "ok");
	*json = buf_done(&b);
	return ok;
}

/* ---- Prometheus ---- */

static void prom_head(struct kvtd_buf *b, const char *name, const char *type, const char *help)
{
	kvtd_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void prom_hist(struct kvtd_buf *b, const char *name, const char *help,
		      const struct kvt_hist_snap *h)
{
	uint64_t cum = 0;

	prom_head(b, name, "histogram", help);
	for (uint32_t i = 0; i < KVT_HIST_BUCKETS; i++) {
		cum += h->bucket[i];
		if (i + 1 < KVT_HIST_BUCKETS)
			kvtd_printf(b, "%s_bucket{le=\"%.9g\"} %llu\n", name,
				    (double)kvt_hist_bound_ns(i) / 1e9, (unsigned long long)cum);
		else
			kvtd_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
	}
	kvtd_printf(b, "%s_sum %.9f\n%s_count %llu\n", name, (double)h->sum_ns / 1e9, name,
		    (unsigned long long)cum);
}

/* Per-rank and per-instance series carry engine="<kvtier instance>" (and
 * rank="<r>"): Prometheus itself sets `instance` (the scrape target) on
 * every series, and would rename ours to exported_instance. */
char *kvtd_prometheus(const struct kvtd_snap *s, const struct kvtd_ctx *c)
{
	struct kvtd_buf b = { 0 };
	const struct kvt_geometry *g = &s->geo;
	char name[96];
	uint32_t n_inst = g->n_instances;

	prom_head(&b, "kvtier_info", "gauge", "The segment and the daemon (labels); always 1");
	kvtd_printf(&b, "kvtier_info{version=\"");
	prom_label(&b, c->version);
	kvtd_printf(&b, "\",segment=\"");
	prom_label(&b, s->name);
	kvtd_printf(&b, "\",model=\"");
	prom_label(&b, c->model);
	kvtd_printf(&b, "\",model_id=\"%016llx%016llx\",world=\"%u\",instances=\"%u\","
		    "chunk_tokens=\"%u\",layout=\"%s\"} 1\n",
		    (unsigned long long)g->model_id.hi, (unsigned long long)g->model_id.lo,
		    g->world, g->n_instances, g->chunk_tokens,
		    g->mode == KVT_MODE_REPLICATED ? "replicated" : "sharded");

	for (int i = 0; i < KVT_C__COUNT; i++) {
		snprintf(name, sizeof(name), "kvtier_%s_total", counter_meta[i].metric);
		prom_head(&b, name, "counter", counter_meta[i].help);
		kvtd_printf(&b, "%s %llu\n", name, (unsigned long long)s->ctr[i]);
	}

	prom_head(&b, "kvtier_slots", "gauge", "Arena slots by state");
	kvtd_printf(&b, "kvtier_slots{state=\"free\"} %llu\n", (unsigned long long)s->occ.free);
	kvtd_printf(&b, "kvtier_slots{state=\"filling\"} %llu\n", (unsigned long long)s->occ.filling);
	kvtd_printf(&b, "kvtier_slots{state=\"ready\"} %llu\n", (unsigned long long)s->occ.ready);
	kvtd_printf(&b, "kvtier_slots{state=\"evicting\"} %llu\n",
		    (unsigned long long)s->occ.evicting);
	prom_head(&b, "kvtier_slots_pinned", "gauge", "READY slots pinned by live leases");
	kvtd_printf(&b, "kvtier_slots_pinned %llu\n", (unsigned long long)s->occ.pinned);
	prom_head(&b, "kvtier_slots_capacity", "gauge", "Arena slots (chunks the tier holds)");
	kvtd_printf(&b, "kvtier_slots_capacity %u\n", g->n_slots);
	prom_head(&b, "kvtier_leases_live", "gauge", "Leases held by lookups not yet loaded or released");
	kvtd_printf(&b, "kvtier_leases_live %llu\n", (unsigned long long)s->occ.leases_live);
	prom_head(&b, "kvtier_leases_capacity", "gauge", "Lease table size");
	kvtd_printf(&b, "kvtier_leases_capacity %u\n", g->n_leases);
	prom_head(&b, "kvtier_resident_bytes", "gauge", "KV bytes held by READY chunks, every shard");
	kvtd_printf(&b, "kvtier_resident_bytes %llu\n",
		    (unsigned long long)(s->occ.ready * s->shard_bytes * s->n_shards));
	prom_head(&b, "kvtier_segment_bytes", "gauge", "Size of the shared segment");
	kvtd_printf(&b, "kvtier_segment_bytes %llu\n", (unsigned long long)s->segment_bytes);
	prom_head(&b, "kvtier_chunk_shard_bytes", "gauge", "Bytes of one rank's shard of one chunk");
	kvtd_printf(&b, "kvtier_chunk_shard_bytes %llu\n", (unsigned long long)s->chunk_bytes);
	prom_head(&b, "kvtier_owner_up", "gauge", "1 when a live kvtierd owns the segment");
	kvtd_printf(&b, "kvtier_owner_up %d\n", s->owner_pid ? 1 : 0);
	prom_head(&b, "kvtier_draining", "gauge", "1 while the owner drains (new attaches refused)");
	kvtd_printf(&b, "kvtier_draining %d\n", (c->draining || s->draining) ? 1 : 0);
	if (s->has_disk) {
		prom_head(&b, "kvtier_disk_up", "gauge", "1 while the disk tier's engine runs");
		kvtd_printf(&b, "kvtier_disk_up %llu\n", (unsigned long long)s->disk.online);
		prom_head(&b, "kvtier_disk_chunks_capacity", "gauge", "Chunks the disk tier's file holds");
		kvtd_printf(&b, "kvtier_disk_chunks_capacity %llu\n", (unsigned long long)s->disk.chunks);
		prom_head(&b, "kvtier_disk_chunks", "gauge", "Chunks on the disk tier");
		kvtd_printf(&b, "kvtier_disk_chunks %llu\n", (unsigned long long)s->disk.used);
		prom_head(&b, "kvtier_disk_queue_depth", "gauge", "Disk tier I/Os in flight");
		kvtd_printf(&b, "kvtier_disk_queue_depth %llu\n", (unsigned long long)s->disk.inflight);
		prom_head(&b, "kvtier_disk_direct", "gauge", "1: O_DIRECT, 0: buffered through the page cache");
		kvtd_printf(&b, "kvtier_disk_direct %llu\n", (unsigned long long)s->disk.direct);
		prom_head(&b, "kvtier_disk_failed", "gauge",
			  "1 when the engine took the disk offline after I/O errors (DRAM only)");
		kvtd_printf(&b, "kvtier_disk_failed %llu\n", (unsigned long long)s->disk.failed);
		prom_head(&b, "kvtier_disk_io_errors_total", "counter",
			  "Disk tier reads and writes the device failed, since the engine started");
		kvtd_printf(&b, "kvtier_disk_io_errors_total %llu\n",
			    (unsigned long long)s->disk.io_errors);
	}
	if (c && c->l3_on) {
		prom_head(&b, "kvtier_l3_up", "gauge", "1 while the L3 store answers");
		kvtd_printf(&b, "kvtier_l3_up %d\n", c->l3.up);
		prom_head(&b, "kvtier_l3_nodes", "gauge", "The L3 store's masters, known and reachable");
		kvtd_printf(&b, "kvtier_l3_nodes{state=\"known\"} %u\n", c->l3.nodes);
		kvtd_printf(&b, "kvtier_l3_nodes{state=\"up\"} %u\n", c->l3.nodes_up);
		prom_head(&b, "kvtier_l3_inflight", "gauge", "Chunks being put or got");
		kvtd_printf(&b, "kvtier_l3_inflight %u\n", c->l3.inflight);
		prom_head(&b, "kvtier_l3_askers", "gauge",
			  "Lookups' connections to the L3 channel (schedulers, ranks)");
		kvtd_printf(&b, "kvtier_l3_askers %u\n", c->l3.askers);
		static const struct { const char *name, *help; size_t off; } l3c[] = {
#define L3C(n, f, h) { "kvtier_l3_" n "_total", h, offsetof(struct kvtd_ctx, l3.f) }
			L3C("puts", puts, "Chunks put into the L3 store"),
			L3C("put_bytes", put_bytes, "Payload bytes put"),
			L3C("put_drops", put_drops,
			    "Puts voided: a store error, or the slot's life ended during the put"),
			L3C("gets", gets, "Chunks got from the L3 store and published"),
			L3C("get_bytes", get_bytes, "Payload bytes got"),
			L3C("misses", misses, "Chunks the store did not have"),
			L3C("refused", refused, "Objects whose check failed (torn, forged, another "
			    "layout's): misses, never served"),
			L3C("get_drops", get_drops, "Gets abandoned: a store error, or no slot to land in"),
			L3C("errors", errors, "Store errors (connections, timeouts, refusals)"),
			L3C("redirects", redirects, "MOVED and ASK redirects followed"),
			L3C("round_trips", round_trips, "Store replies read"),
			L3C("asks", asks, "Chunks lookups asked of the L3 (over the channel)"),
			L3C("fetches", fetches, "Chunks asked of the store (EXISTS sent)"),
			L3C("negative_hits", negative_hits,
			    "Asks answered missing from the negative cache, without a round trip"),
#undef L3C
		};
		for (size_t k = 0; k < sizeof(l3c) / sizeof(l3c[0]); k++) {
			uint64_t v;
			memcpy(&v, (const char *)c + l3c[k].off, sizeof(v));
			prom_head(&b, l3c[k].name, "counter", l3c[k].help);
			kvtd_printf(&b, "%s %llu\n", l3c[k].name, (unsigned long long)v);
		}
		struct kvt_hist_snap hp = { .sum_ns = c->l3.put_ns_sum },
				     hg = { .sum_ns = c->l3.get_ns_sum };
		memcpy(hp.bucket, c->l3.put_ns, sizeof(hp.bucket));
		memcpy(hg.bucket, c->l3.get_ns, sizeof(hg.bucket));
		prom_hist(&b, "kvtier_l3_put_duration_seconds",
			  "An L3 put, sealed to stored (every shard)", &hp);
		prom_hist(&b, "kvtier_l3_get_duration_seconds",
			  "An L3 get, asked (EXISTS) to published (every shard checked)", &hg);
	}
	if (c->start_wall_ns) {
		prom_head(&b, "kvtier_daemon_witness_up", "gauge",
			  "1 when kvtierd holds ranks' lock descriptions until they wholly "
			  "exit (its witness socket listens)");
		kvtd_printf(&b, "kvtier_daemon_witness_up %d\n", c->witness_up);
		prom_head(&b, "kvtier_daemon_witness_ranks", "gauge",
			  "Ranks whose lock description kvtierd holds now (a killed one until "
			  "it wholly exited)");
		kvtd_printf(&b, "kvtier_daemon_witness_ranks %u\n", c->witness_ranks);
		prom_head(&b, "kvtier_daemon_witness_released_total", "counter",
			  "Holds ended: by the rank's exit, or by its clean detach");
		kvtd_printf(&b, "kvtier_daemon_witness_released_total{by=\"exit\"} %llu\n",
			    (unsigned long long)c->witness_exited);
		kvtd_printf(&b, "kvtier_daemon_witness_released_total{by=\"detach\"} %llu\n",
			    (unsigned long long)c->witness_byes);
		prom_head(&b, "kvtier_daemon_witness_refused_total", "counter",
			  "Hold requests refused (not this segment's file, not the sender's "
			  "pidfd, past the segment's entries)");
		kvtd_printf(&b, "kvtier_daemon_witness_refused_total %llu\n",
			    (unsigned long long)c->witness_refused);
		prom_head(&b, "kvtier_daemon_start_time_seconds", "gauge",
			  "When this kvtierd started (Unix time)");
		kvtd_printf(&b, "kvtier_daemon_start_time_seconds %.3f\n",
			    (double)c->start_wall_ns / 1e9);
	}
	{
		char *hj = NULL;
		int ok = kvtd_health(s, c, &hj);
		free(hj);
		prom_head(&b, "kvtier_healthy", "gauge",
			  "1 when every expected rank is attached and alive (GET /healthcheck is 200)");
		kvtd_printf(&b, "kvtier_healthy %d\n", ok);
		prom_head(&b, "kvtier_expected_instances", "gauge",
			  "Instances whose ranks the health check requires");
		kvtd_printf(&b, "kvtier_expected_instances %u\n",
			    c->expect_instances < n_inst ? c->expect_instances : n_inst);
	}

	if (c && c->lmcache_form) {
		static const struct { const char *name, *help; size_t off; } lc[] = {
#define LC(n, h) { "kvtier_lmcache_" #n "_total", h, offsetof(struct kvtd_lmc, n) }
			LC(requests, "LMCache protocol requests (--lmcache-port)"),
			LC(refused, "Requests refused, with the reason as the reply's operation"),
			LC(registrations, "KV caches registered (register_kv_cache)"),
			LC(lookups, "Lookups (lookup)"),
			LC(hit_chunks, "Chunks the lookups found and locked"),
			LC(stored, "Chunks stores wrote"),
			LC(retrieved, "Chunks retrieves loaded"),
			LC(misses, "Retrieves answered ok=false: the engine recomputes, or fails the request "
			   "(vLLM's kv_load_failure_policy)"),
			LC(disconnects, "Clients whose connection went (their locks released)"),
#undef LC
		};
		for (size_t i = 0; i < sizeof(lc) / sizeof(lc[0]); i++) {
			prom_head(&b, lc[i].name, "counter", lc[i].help);
			kvtd_printf(&b, "%s %llu\n", lc[i].name, (unsigned long long)
				    *(const uint64_t *)((const char *)&c->lmc + lc[i].off));
		}
		prom_head(&b, "kvtier_lmcache_clients", "gauge", "KV caches registered now");
		kvtd_printf(&b, "kvtier_lmcache_clients %u\n", c->lmc.clients);
	}

	/* per rank */
	prom_head(&b, "kvtier_rank_up", "gauge", "1 when the rank's process is attached and alive");
	for (uint32_t i = 0; i < n_inst; i++)
		for (uint32_t r = 0; r < g->world; r++) {
			const struct kvtd_entry *e = &s->ents[entry_index(s, i, r)];
			kvtd_printf(&b, "kvtier_rank_up{engine=\"%u\",rank=\"%u\"} %d\n", i, r,
				    !e->bad && e->info.state == KVT_ENTRY_ATTACHED);
		}
	prom_head(&b, "kvtier_rank_dead", "gauge",
		  "1 when the rank's process died and the reaper has not freed its entry yet");
	for (uint32_t i = 0; i < n_inst; i++)
		for (uint32_t r = 0; r < g->world; r++) {
			const struct kvtd_entry *e = &s->ents[entry_index(s, i, r)];
			kvtd_printf(&b, "kvtier_rank_dead{engine=\"%u\",rank=\"%u\"} %d\n", i, r,
				    e->bad || e->info.state == KVT_ENTRY_DEAD);
		}
	prom_head(&b, "kvtier_rank_stopped", "gauge",
		  "1 when the rank's live process is stopped (SIGSTOP, ptrace) or frozen (cgroup "
		  "freezer): it blocks whoever waits for its next step");
	for (uint32_t i = 0; i < n_inst; i++)
		for (uint32_t r = 0; r < g->world; r++) {
			const struct kvtd_entry *e = &s->ents[entry_index(s, i, r)];
			kvtd_printf(&b, "kvtier_rank_stopped{engine=\"%u\",rank=\"%u\"} %d\n", i, r,
				    e->stopped);
		}
	prom_head(&b, "kvtier_rank_heartbeat_age_seconds", "gauge",
		  "Seconds since the rank's last save/load completion or attach (attached ranks)");
	for (uint32_t i = 0; i < n_inst; i++)
		for (uint32_t r = 0; r < g->world; r++) {
			const struct kvtd_entry *e = &s->ents[entry_index(s, i, r)];
			if (e->info.state == KVT_ENTRY_ATTACHED)
				kvtd_printf(&b, "kvtier_rank_heartbeat_age_seconds{engine=\"%u\","
					    "rank=\"%u\"} %.3f\n", i, r, age_s(s, e));
		}
	prom_head(&b, "kvtier_rank_attaches_total", "counter", "Attaches of the rank's table entry");
	for (uint32_t i = 0; i < n_inst; i++)
		for (uint32_t r = 0; r < g->world; r++)
			kvtd_printf(&b, "kvtier_rank_attaches_total{engine=\"%u\",rank=\"%u\"} %llu\n",
				    i, r, (unsigned long long)s->ents[entry_index(s, i, r)].info.attach_gen);
	{
		static const struct { int c; const char *n, *h; } rc[] = {
			{ KVT_C_BYTES_SAVED, "kvtier_rank_saved_bytes_total", "Bytes the rank copied into the arena" },
			{ KVT_C_BYTES_LOADED, "kvtier_rank_loaded_bytes_total", "Bytes the rank copied out of the arena" },
			{ KVT_C_DMA_ERRORS, "kvtier_rank_dma_errors_total", "The rank's failed copies" },
			{ KVT_C_SAVED_CHUNKS, "kvtier_rank_saved_chunks_total", "Chunk shards the rank saved" },
			{ KVT_C_LOADED_CHUNKS, "kvtier_rank_loaded_chunks_total", "Chunk shards the rank loaded" },
		};
		for (size_t k = 0; k < sizeof(rc) / sizeof(rc[0]); k++) {
			prom_head(&b, rc[k].n, "counter", rc[k].h);
			for (uint32_t i = 0; i < n_inst; i++)
				for (uint32_t r = 0; r < g->world; r++)
					kvtd_printf(&b, "%s{engine=\"%u\",rank=\"%u\"} %llu\n", rc[k].n, i, r,
						    (unsigned long long)s->ents[entry_index(s, i, r)].ctr[rc[k].c]);
		}
	}
	prom_head(&b, "kvtier_scheduler_up", "gauge", "1 when the instance's scheduler is attached and alive");
	for (uint32_t i = 0; i < n_inst; i++)
		kvtd_printf(&b, "kvtier_scheduler_up{engine=\"%u\"} %u\n", i, s->inst[i].scheduler_up);

	/* per instance */
	{
		static const struct { size_t off; const char *n, *h; } ic[] = {
			{ offsetof(struct kvtd_inst, lookups), "kvtier_instance_lookups_total", "The instance's lookups" },
			{ offsetof(struct kvtd_inst, lookup_chunks), "kvtier_instance_lookup_chunks_total", "Chunk keys the instance looked up" },
			{ offsetof(struct kvtd_inst, hit_chunks), "kvtier_instance_hit_chunks_total", "Chunks the instance's lookups hit" },
			{ offsetof(struct kvtd_inst, hit_tokens), "kvtier_instance_hit_tokens_total", "Tokens the instance's lookups hit" },
			{ offsetof(struct kvtd_inst, saved_chunks), "kvtier_instance_saved_chunks_total", "Chunk shards the instance's ranks saved" },
			{ offsetof(struct kvtd_inst, loaded_chunks), "kvtier_instance_loaded_chunks_total", "Chunk shards the instance's ranks loaded" },
			{ offsetof(struct kvtd_inst, shared_hits), "kvtier_instance_shared_hit_chunks_total", "Chunks the instance's lookups hit that another instance's ranks saved" },
		};
		for (size_t k = 0; k < sizeof(ic) / sizeof(ic[0]); k++) {
			prom_head(&b, ic[k].n, "counter", ic[k].h);
			for (uint32_t i = 0; i < n_inst; i++)
				kvtd_printf(&b, "%s{engine=\"%u\"} %llu\n", ic[k].n, i,
					    (unsigned long long)*(const uint64_t *)((const char *)&s->inst[i] + ic[k].off));
		}
	}
	prom_head(&b, "kvtier_instance_write_only", "gauge",
		  "1 when the instance's ranks save chunks and its scheduler makes no lookups "
		  "(the tier is written and never read: check the scheduler's kvtier config)");
	for (uint32_t i = 0; i < n_inst; i++) {
		uint32_t wo = s->inst[i].write_only;
		if (c->write_only_window)
			wo |= !!(c->write_only_window[i] & KVTD_V_WRITE_ONLY);
		kvtd_printf(&b, "kvtier_instance_write_only{engine=\"%u\"} %u\n", i, wo);
	}
	prom_head(&b, "kvtier_instance_unshared", "gauge",
		  "1 when the instance looked up chunks while other instances saved, and hit "
		  "none of theirs (engines that should share a prefix cache do not: another "
		  "hash seed or salt, or prompts that do not overlap)");
	for (uint32_t i = 0; i < n_inst; i++) {
		uint32_t us = s->inst[i].unshared;
		if (c->write_only_window)
			us |= !!(c->write_only_window[i] & KVTD_V_UNSHARED);
		kvtd_printf(&b, "kvtier_instance_unshared{engine=\"%u\"} %u\n", i, us);
	}

	for (int h = 0; h < KVT_H__COUNT; h++) {
		snprintf(name, sizeof(name), "kvtier_%s_duration_seconds", kvt_hist_name((enum kvt_hist)h));
		prom_hist(&b, name, hist_help[h], &s->hist[h]);
	}
	return buf_done(&b);
}

/* ---- quantiles ---- */

double kvtd_hist_quantile(const struct kvt_hist_snap *h, double q)
{
	uint64_t total = 0, cum = 0;

	for (uint32_t i = 0; i < KVT_HIST_BUCKETS; i++)
		total += h->bucket[i];
	if (!total)
		return 0.0;
	double want = q * (double)total;
	for (uint32_t i = 0; i < KVT_HIST_BUCKETS; i++) {
		if (!h->bucket[i])
			continue;
		if ((double)(cum + h->bucket[i]) >= want) {
			double lo = i ? (double)kvt_hist_bound_ns(i - 1) : 0.0;
			if (i + 1 == KVT_HIST_BUCKETS)
				return lo;
			double hi = (double)kvt_hist_bound_ns(i);
			double f = (want - (double)cum) / (double)h->bucket[i];
			return lo + (hi - lo) * (f < 0 ? 0 : f > 1 ? 1 : f);
		}
		cum += h->bucket[i];
	}
	return (double)kvt_hist_bound_ns(KVT_HIST_BUCKETS - 2);
}

/* ---- JSON ---- */

static double rate(const struct kvtd_snap *s, const struct kvtd_snap *p, uint64_t now, uint64_t then)
{
	if (!p || s->mono_ns <= p->mono_ns || now < then)
		return 0.0;
	return (double)(now - then) * 1e9 / (double)(s->mono_ns - p->mono_ns);
}

char *kvtd_json(const struct kvtd_snap *s, const struct kvtd_ctx *c, const struct kvtd_snap *prev)
{
	struct kvtd_buf b = { 0 };
	const struct kvt_geometry *g = &s->geo;
	char *health = NULL;
	int ok = kvtd_health(s, c, &health);

	if (health && *health && health[strlen(health) - 1] == '\n')
		health[strlen(health) - 1] = 0;

	kvtd_printf(&b, "{\"version\":");
	json_str(&b, c->version);
	kvtd_printf(&b, ",\"segment\":");
	json_str(&b, s->name);
	kvtd_printf(&b, ",\"model\":");
	json_str(&b, c->model);
	kvtd_printf(&b, ",\"time\":%.3f,\"healthy\":%s,\"health\":%s", (double)s->wall_ns / 1e9,
		    ok ? "true" : "false", health ? health : "null");
	free(health);
	kvtd_printf(&b, ",\"owner_pid\":%d,\"draining\":%s", s->owner_pid,
		    (c->draining || s->draining) ? "true" : "false");
	kvtd_printf(&b, ",\"geometry\":{\"world\":%u,\"instances\":%u,\"layout\":\"%s\","
		    "\"chunk_tokens\":%u,\"slots\":%u,\"leases\":%u,\"lease_max_chunks\":%u,"
		    "\"shards\":%u,\"shard_bytes\":%llu,\"chunk_shard_bytes\":%llu,"
		    "\"segment_bytes\":%llu,\"groups\":[",
		    g->world, g->n_instances, g->mode == KVT_MODE_REPLICATED ? "replicated" : "sharded",
		    g->chunk_tokens, g->n_slots, g->n_leases, g->lease_max_chunks, s->n_shards,
		    (unsigned long long)s->shard_bytes, (unsigned long long)s->chunk_bytes,
		    (unsigned long long)s->segment_bytes);
	for (uint32_t i = 0; i < g->n_groups && i < KVT_MAX_GROUPS; i++)
		kvtd_printf(&b, "%s{\"layers\":%u,\"bytes_per_token\":%u}", i ? "," : "",
			    g->groups[i].layers, g->groups[i].bytes_per_token);
	kvtd_printf(&b, "]},\"occupancy\":{\"free\":%llu,\"filling\":%llu,\"ready\":%llu,"
		    "\"evicting\":%llu,\"pinned\":%llu,\"leases_live\":%llu,\"resident_bytes\":%llu}",
		    (unsigned long long)s->occ.free, (unsigned long long)s->occ.filling,
		    (unsigned long long)s->occ.ready, (unsigned long long)s->occ.evicting,
		    (unsigned long long)s->occ.pinned, (unsigned long long)s->occ.leases_live,
		    (unsigned long long)(s->occ.ready * s->shard_bytes * s->n_shards));
	if (s->has_disk) {
		kvtd_printf(&b, ",\"disk\":{\"online\":%s,\"path\":",
			    s->disk.online ? "true" : "false");
		json_str(&b, s->disk.path);
		kvtd_printf(&b, ",\"chunks\":%llu,\"used\":%llu,\"inflight\":%llu,\"direct\":%s,"
			    "\"index_capacity\":%u,\"io_errors\":%llu,\"failed\":%s}",
			    (unsigned long long)s->disk.chunks,
			    (unsigned long long)s->disk.used, (unsigned long long)s->disk.inflight,
			    s->disk.direct ? "true" : "false", s->geo.disk_chunks,
			    (unsigned long long)s->disk.io_errors, s->disk.failed ? "true" : "false");
	}
	if (c && c->l3_on) {
		kvtd_printf(&b, ",\"l3\":{\"up\":%s,\"store\":", c->l3.up ? "true" : "false");
		json_str(&b, c->l3.describe);
		kvtd_printf(&b, ",\"nodes\":%u,\"nodes_up\":%u,\"inflight\":%u,\"puts\":%llu,"
			    "\"gets\":%llu,\"misses\":%llu,\"refused\":%llu,\"errors\":%llu}",
			    c->l3.nodes, c->l3.nodes_up, c->l3.inflight,
			    (unsigned long long)c->l3.puts, (unsigned long long)c->l3.gets,
			    (unsigned long long)c->l3.misses, (unsigned long long)c->l3.refused,
			    (unsigned long long)c->l3.errors);
	}
	kvtd_printf(&b, ",\"counters\":{");
	for (int i = 0; i < KVT_C__COUNT; i++)
		kvtd_printf(&b, "%s\"%s\":%llu", i ? "," : "", kvt_counter_name((enum kvt_counter)i),
			    (unsigned long long)s->ctr[i]);
	kvtd_printf(&b, "}");
	if (prev) {
		kvtd_printf(&b, ",\"rates\":{\"interval_s\":%.3f",
			    (double)(s->mono_ns - prev->mono_ns) / 1e9);
		for (int i = 0; i < KVT_C__COUNT; i++)
			kvtd_printf(&b, ",\"%s\":%.3f", kvt_counter_name((enum kvt_counter)i),
				    rate(s, prev, s->ctr[i], prev->ctr[i]));
		kvtd_printf(&b, "}");
	}
	kvtd_printf(&b, ",\"latency\":{");
	for (int h = 0; h < KVT_H__COUNT; h++) {
		const struct kvt_hist_snap *hs = &s->hist[h];
		kvtd_printf(&b, "%s\"%s\":{\"count\":%llu,\"sum_s\":%.9f,\"p50_s\":%.9f,"
			    "\"p90_s\":%.9f,\"p99_s\":%.9f}", h ? "," : "",
			    kvt_hist_name((enum kvt_hist)h), (unsigned long long)hs->count,
			    (double)hs->sum_ns / 1e9, kvtd_hist_quantile(hs, 0.5) / 1e9,
			    kvtd_hist_quantile(hs, 0.9) / 1e9, kvtd_hist_quantile(hs, 0.99) / 1e9);
	}
	kvtd_printf(&b, "},\"instances\":[");
	for (uint32_t i = 0; i < g->n_instances; i++) {
		const struct kvtd_inst *in = &s->inst[i];
		uint32_t wo = in->write_only | (c->write_only_window ?
				!!(c->write_only_window[i] & KVTD_V_WRITE_ONLY) : 0);
		uint32_t us = in->unshared | (c->write_only_window ?
				!!(c->write_only_window[i] & KVTD_V_UNSHARED) : 0);
		kvtd_printf(&b, "%s{\"instance\":%u,\"lookups\":%llu,\"lookup_chunks\":%llu,"
			    "\"hit_chunks\":%llu,\"hit_tokens\":%llu,\"saved_chunks\":%llu,"
			    "\"loaded_chunks\":%llu,\"ranks_up\":%u,\"scheduler_up\":%s,"
			    "\"shared_hit_chunks\":%llu,\"write_only\":%s,\"unshared\":%s,"
			    "\"warnings\":[", i ? "," : "", i,
			    (unsigned long long)in->lookups, (unsigned long long)in->lookup_chunks,
			    (unsigned long long)in->hit_chunks, (unsigned long long)in->hit_tokens,
			    (unsigned long long)in->saved_chunks, (unsigned long long)in->loaded_chunks,
			    in->ranks_up, in->scheduler_up ? "true" : "false",
			    (unsigned long long)in->shared_hits, wo ? "true" : "false",
			    us ? "true" : "false");
		if (wo)
			kvtd_printf(&b, "\"write-only tier: instance %u's ranks save chunks but its "
				    "scheduler makes no lookups, so nothing saved is ever read "
				    "(is the scheduler opened on this segment, with this instance?)\"", i);
		if (us)
			kvtd_printf(&b, "%s\"unshared: instance %u looks chunks up while other "
				    "instances save, and finds none of theirs: do the engines compute "
				    "the same keys (PYTHONHASHSEED, cache salt, LoRA) for the same "
				    "prompts?\"", wo ? "," : "", i);
		kvtd_printf(&b, "]}");
	}
	kvtd_printf(&b, "],\"entries\":[");
	int first = 1;
	for (uint32_t e = 0; e < s->n_entries; e++) {
		const struct kvtd_entry *x = &s->ents[e];
		if (!x->bad && x->info.state == KVT_ENTRY_EMPTY && x->info.role == KVT_ROLE_CLIENT)
			continue; /* unused client entries */
		kvtd_printf(&b, "%s{\"entry\":%u,\"role\":\"%s\"", first ? "" : ",", e,
			    x->info.role == KVT_ROLE_RANK ? "rank" :
			    x->info.role == KVT_ROLE_SCHEDULER ? "scheduler" : "client");
		if (x->info.instance != UINT32_MAX)
			kvtd_printf(&b, ",\"instance\":%u", x->info.instance);
		if (x->info.rank != UINT32_MAX)
			kvtd_printf(&b, ",\"rank\":%u", x->info.rank);
		kvtd_printf(&b, ",\"state\":\"%s\",\"pid\":%d,\"attaches\":%llu", entry_state_name(x),
			    x->info.state == KVT_ENTRY_EMPTY ? 0 : x->info.pid,
			    (unsigned long long)x->info.attach_gen);
		if (x->info.state == KVT_ENTRY_ATTACHED)
			kvtd_printf(&b, ",\"heartbeat_age_s\":%.3f", age_s(s, x));
		kvtd_printf(&b, ",\"saved_bytes\":%llu,\"loaded_bytes\":%llu,\"dma_errors\":%llu}",
			    (unsigned long long)x->ctr[KVT_C_BYTES_SAVED],
			    (unsigned long long)x->ctr[KVT_C_BYTES_LOADED],
			    (unsigned long long)x->ctr[KVT_C_DMA_ERRORS]);
		first = 0;
	}
	kvtd_printf(&b, "]}\n");
	return buf_done(&b);
}

/* ---- the screen ---- */

static const char *hbytes(char *out, size_t n, double v)
{
	static const char *const u[] = { "B", "KiB", "MiB", "GiB", "TiB" };
	int i = 0;

	while (v >= 1024.0 && i < 4) {
		v /= 1024.0;
		i++;
	}
	snprintf(out, n, i ? "%.1f %s" : "%.0f %s", v, u[i]);
	return out;
}

static const char *hdur(char *out, size_t n, double ns)
{
	if (ns <= 0)
		snprintf(out, n, "-");
	else if (ns < 1e3)
		snprintf(out, n, "%.0f ns", ns);
	else if (ns < 1e6)
		snprintf(out, n, "%.1f us", ns / 1e3);
	else if (ns < 1e9)
		snprintf(out, n, "%.1f ms", ns / 1e6);
	else
		snprintf(out, n, "%.2f s", ns / 1e9);
	return out;
}

char *kvtd_screen(const struct kvtd_snap *s, const struct kvtd_ctx *c,
		  const struct kvtd_snap *prev, int width)
{
	struct kvtd_buf b = { 0 };
	const struct kvt_geometry *g = &s->geo;
	char t1[32], t2[32], t3[32], ts[64];
	time_t now = (time_t)(s->wall_ns / 1000000000ULL);
	struct tm tm;
	(void)width;

	localtime_r(&now, &tm);
	strftime(ts, sizeof(ts), "%Y-%m-%d %H:%M:%S", &tm);
	kvtd_printf(&b, "kvtier-stat  segment '%s'  %s  %s\n", s->name, ts,
		    s->owner_pid ? "" : "(no kvtierd owns it)");
	if (s->owner_pid)
		kvtd_printf(&b, "owner      kvtierd pid %d%s\n", s->owner_pid,
			    s->draining ? "  DRAINING" : "");
	if (c && c->model && c->model[0])
		kvtd_printf(&b, "model      %s\n", c->model);
	kvtd_printf(&b, "geometry   world %u x %u instance%s, %s, %u tokens/chunk, %u slots, "
		    "shard %s, segment %s\n", g->world, g->n_instances, g->n_instances == 1 ? "" : "s",
		    g->mode == KVT_MODE_REPLICATED ? "replicated" : "sharded", g->chunk_tokens,
		    g->n_slots, hbytes(t1, sizeof(t1), (double)s->shard_bytes),
		    hbytes(t2, sizeof(t2), (double)s->segment_bytes));
	kvtd_printf(&b, "occupancy  ready %llu (%.1f%%)  pinned %llu  filling %llu  free %llu  "
		    "leases %llu/%u  resident %s\n", (unsigned long long)s->occ.ready,
		    g->n_slots ? 100.0 * (double)s->occ.ready / g->n_slots : 0.0,
		    (unsigned long long)s->occ.pinned, (unsigned long long)s->occ.filling,
		    (unsigned long long)s->occ.free, (unsigned long long)s->occ.leases_live, g->n_leases,
		    hbytes(t3, sizeof(t3), (double)(s->occ.ready * s->shard_bytes * s->n_shards)));
	uint64_t lc = s->ctr[KVT_C_LOOKUP_CHUNKS], hc = s->ctr[KVT_C_HIT_CHUNKS];
	kvtd_printf(&b, "hit rate   %.1f%% of chunks looked up (%llu of %llu), %llu tokens hit\n",
		    lc ? 100.0 * (double)hc / (double)lc : 0.0, (unsigned long long)hc,
		    (unsigned long long)lc, (unsigned long long)s->ctr[KVT_C_HIT_TOKENS]);
	if (s->has_disk)
		kvtd_printf(&b, "disk       %s  %llu of %llu chunks (%s)  %s  %llu in flight  "
			    "%llu written  %llu read back  %llu checksum errors  %llu I/O errors\n",
			    s->disk.failed ? "FAILED" : s->disk.online ? "up" : "DOWN",
			    (unsigned long long)s->disk.used,
			    (unsigned long long)s->disk.chunks,
			    hbytes(t3, sizeof(t3), (double)(s->disk.used * s->shard_bytes * s->n_shards)),
			    s->disk.direct ? "direct" : "buffered", (unsigned long long)s->disk.inflight,
			    (unsigned long long)s->ctr[KVT_C_DISK_WRITES],
			    (unsigned long long)s->ctr[KVT_C_DISK_READS],
			    (unsigned long long)s->ctr[KVT_C_DISK_CSUM_ERRORS],
			    (unsigned long long)s->disk.io_errors);
	if (c && c->l3_on)
		kvtd_printf(&b, "l3         %s  %s  %u/%u up  %u in flight  %llu put  %llu got  "
			    "%llu missing  %llu refused  %llu errors  %u askers\n",
			    c->l3.up ? "up" : "DOWN", c->l3.describe, c->l3.nodes_up, c->l3.nodes,
			    c->l3.inflight, (unsigned long long)c->l3.puts,
			    (unsigned long long)c->l3.gets, (unsigned long long)c->l3.misses,
			    (unsigned long long)c->l3.refused, (unsigned long long)c->l3.errors,
			    c->l3.askers);
	kvtd_printf(&b, "\nranks\n");
	for (uint32_t i = 0; i < g->n_instances; i++) {
		const struct kvtd_inst *in = &s->inst[i];
		uint32_t wo = in->write_only | (c && c->write_only_window ?
				!!(c->write_only_window[i] & KVTD_V_WRITE_ONLY) : 0);
		uint32_t us = in->unshared | (c && c->write_only_window ?
				!!(c->write_only_window[i] & KVTD_V_UNSHARED) : 0);
		kvtd_printf(&b, "  instance %u: %u/%u ranks up, scheduler %s%s\n   ", i, in->ranks_up,
			    g->world, in->scheduler_up ? "up" : "absent",
			    wo ? "   WARNING: write-only (saves, no lookups)" :
			    us ? "   WARNING: unshared (finds none of the other instances' chunks)" : "");
		for (uint32_t r = 0; r <= g->world; r++) {
			const struct kvtd_entry *e = &s->ents[entry_index(s, i, r)];
			char who[16];
			if (r == g->world)
				snprintf(who, sizeof(who), "sched");
			else
				snprintf(who, sizeof(who), "r%u", r);
			if (e->info.state == KVT_ENTRY_ATTACHED)
				kvtd_printf(&b, " %s:up(pid %d, hb %.1fs)", who, e->info.pid, age_s(s, e));
			else
				kvtd_printf(&b, " %s:%s", who, entry_state_name(e));
			if (r % 4 == 3 && r != g->world)
				kvtd_printf(&b, "\n   ");
		}
		kvtd_printf(&b, "\n");
	}
	kvtd_printf(&b, "\n%-16s %16s %14s\n", "counter", "total", prev ? "per second" : "");
	for (int i = 0; i < KVT_C__COUNT; i++) {
		if (!s->ctr[i] && i >= KVT_C_DISK_WRITES)
			continue; /* the rare ones only when nonzero */
		kvtd_printf(&b, "%-16s %16llu", kvt_counter_name((enum kvt_counter)i),
			    (unsigned long long)s->ctr[i]);
		if (prev)
			kvtd_printf(&b, " %14.1f", rate(s, prev, s->ctr[i], prev->ctr[i]));
		kvtd_printf(&b, "\n");
	}
	kvtd_printf(&b, "\n%-11s %10s %10s %10s %10s %12s\n", "latency", "p50", "p90", "p99",
		    "mean", "count");
	for (int h = 0; h < KVT_H__COUNT; h++) {
		const struct kvt_hist_snap *hs = &s->hist[h];
		char a[24], bb[24], cc[24], d[24];
		if (!hs->count && h >= KVT_H_DISK_READ)
			continue;
		kvtd_printf(&b, "%-11s %10s %10s %10s %10s %12llu\n", kvt_hist_name((enum kvt_hist)h),
			    hdur(a, sizeof(a), kvtd_hist_quantile(hs, 0.5)),
			    hdur(bb, sizeof(bb), kvtd_hist_quantile(hs, 0.9)),
			    hdur(cc, sizeof(cc), kvtd_hist_quantile(hs, 0.99)),
			    hdur(d, sizeof(d), hs->count ? (double)hs->sum_ns / (double)hs->count : 0),
			    (unsigned long long)hs->count);
	}
	return buf_done(&b);
}
