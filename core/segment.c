/* segment.c - create, attach, validate, detach and unlink the segment.
 *
 * Publication: the creator sizes the object, writes the header with the
 * magic zero, and stores the magic last with release (R0).  An attacher
 * reads the magic first with acquire (A0, pairs with R0), so every header
 * field it then reads is the creator's.  The other regions are all-zero at
 * creation, and zero is the initial state of every word in them (FREE
 * slots, FREE leases, EMPTY entries and index entries, zero counters), so
 * creation never touches them and the arena can be NUMA-bound before its
 * first touch.
 *
 * Validation: the segment is untrusted input.  Attach recomputes the whole
 * layout from the stored geometry (after range-checking it) and compares
 * every stored field with the recomputed one; the first difference is an
 * error that names the field.  The checksum over the immutable header then
 * catches what no range check can (a flipped creator pid, say).  After
 * attach, indices read from the segment (slot numbers in index entries and
 * lease refs, entry numbers in writer fields) are still bounds-checked at
 * each use, because other processes keep writing it.
 *
 * Creation (kvt_seg_create) checks the size against the filesystem and
 * the host, reserves the tables and then -- after the caller's `prepare`
 * step, which binds the arena to its NUMA nodes -- the arena (fallocate on
 * tmpfs; the creator's shared mapping reserves huge pages on hugetlbfs),
 * claims the creator's own table entry, and only then stores the magic.
 * So a segment that does not fit fails with -ENOSPC/-EFBIG and a message
 * with both sizes, and no attacher can ever fault on an unbacked page
 * (layout 1 sized the object with ftruncate alone, which always succeeds
 * on tmpfs: the pre-fault, or a later touch, died with SIGBUS, and so did
 * every later attacher of the file left behind).  Every failure path
 * unlinks the name before it unmaps and walks nothing in the mapping.
 * A process that dies while creating leaves a segment without magic:
 * attach reports it (-EPROTO "magic") and KVT_SEG_F_REPLACE removes it.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysinfo.h>
#include <time.h>
#include <unistd.h>

#include "kvt_format.h"

static _Thread_local char kvt_errbuf[1024];

int kvt__err(int code, const char *fmt, ...)
{
	char tmp[sizeof(kvt_errbuf)];
	va_list ap;

	/* Through a copy: an argument may be this very buffer (a message
	 * that wraps the previous one); vsnprintf onto itself garbles it. */
	va_start(ap, fmt);
	vsnprintf(tmp, sizeof(tmp), fmt, ap);
	va_end(ap);
	memcpy(kvt_errbuf, tmp, sizeof(tmp));
	return code;
}

const char *kvt_core_last_error(void)
{
	return kvt_errbuf[0] ? kvt_errbuf : "no error";
}

/* Copies this thread's message before a call that may overwrite it. */
static void save_err(char *dst, size_t n)
{
	size_t l = strnlen(kvt_errbuf, n - 1);

	memcpy(dst, kvt_errbuf, l);
	dst[l] = 0;
}

uint64_t kvt__hash64(const void *p, size_t n, uint64_t seed)
{
	const uint8_t *b = p;
	uint64_t h = 0xcbf29ce484222325ULL ^ kvt__mix64(seed + n);

	for (size_t i = 0; i < n; i++)
		h = (h ^ b[i]) * 0x100000001b3ULL;
	return kvt__mix64(h);
}

static uint64_t round_up(uint64_t x, uint64_t a)
{
	return (x + a - 1) / a * a;
}

int kvt_seg_name_valid(const char *name)
{
	size_t n;

	if (!name)
		return kvt__err(-EINVAL, "segment name is NULL");
	n = strlen(name);
	if (n == 0 || n > KVT_NAME_MAX)
		return kvt__err(-EINVAL, "segment name must be 1..%d characters",
				KVT_NAME_MAX);
	if (!strcmp(name, ".") || !strcmp(name, ".."))
		return kvt__err(-EINVAL, "segment name '%s' is not a name", name);
	for (size_t i = 0; i < n; i++) {
		char c = name[i];
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
		      (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'))
			return kvt__err(-EINVAL,
				"segment name '%s': character %zu ('%c') is not one of "
				"[A-Za-z0-9._-] (a name is not a path)", name, i + 1,
				c >= 32 && c < 127 ? c : '?');
	}
	return 0;
}

int kvt__geometry_check(const struct kvt_geometry *g)
{
#define GCHK(cond, field, ...) \
	do { if (!(cond)) return kvt__err(-EINVAL, "geometry." field ": " __VA_ARGS__); } while (0)
	GCHK(g->chunk_tokens >= 1 && g->chunk_tokens <= KVT_MAX_CHUNK_TOKENS,
	     "chunk_tokens", "%u not in 1..%u", g->chunk_tokens, KVT_MAX_CHUNK_TOKENS);
	GCHK(g->world >= 1 && g->world <= KVT_MAX_WORLD, "world",
	     "%u not in 1..%u", g->world, KVT_MAX_WORLD);
	GCHK(g->n_instances >= 1 && g->n_instances <= KVT_MAX_INSTANCES,
	     "n_instances", "%u not in 1..%u", g->n_instances, KVT_MAX_INSTANCES);
	GCHK(g->mode == KVT_MODE_SHARDED || g->mode == KVT_MODE_REPLICATED,
	     "mode", "%u is neither sharded (0) nor replicated (1)", g->mode);
	GCHK(g->n_groups >= 1 && g->n_groups <= KVT_MAX_GROUPS, "n_groups",
	     "%u not in 1..%u", g->n_groups, KVT_MAX_GROUPS);
	for (uint32_t i = 0; i < KVT_MAX_GROUPS; i++) {
		const struct kvt_layer_group *lg = &g->groups[i];
		if (i >= g->n_groups) {
			GCHK(lg->layers == 0 && lg->bytes_per_token == 0, "groups",
			     "unused group %u is not zero", i);
			continue;
		}
		GCHK(lg->layers >= 1 && lg->layers <= KVT_MAX_LAYERS, "groups.layers",
		     "group %u: %u layers not in 1..%u", i, lg->layers, KVT_MAX_LAYERS);
		GCHK(lg->bytes_per_token >= 1 && lg->bytes_per_token <= KVT_MAX_BPT,
		     "groups.bytes_per_token", "group %u: %u not in 1..%u", i,
		     lg->bytes_per_token, KVT_MAX_BPT);
	}
	GCHK(g->n_slots >= 1 && g->n_slots <= KVT_MAX_SLOTS, "n_slots",
	     "%u not in 1..%u", g->n_slots, KVT_MAX_SLOTS);
	GCHK(g->n_leases <= KVT_MAX_LEASES, "n_leases", "%u above %u",
	     g->n_leases, KVT_MAX_LEASES);
	GCHK(g->lease_max_chunks <= KVT_MAX_LEASE_CHUNKS, "lease_max_chunks",
	     "%u above %u", g->lease_max_chunks, KVT_MAX_LEASE_CHUNKS);
	GCHK(g->disk_chunks <= KVT_MAX_SLOTS, "disk_chunks", "%u above %u",
	     g->disk_chunks, KVT_MAX_SLOTS);
	GCHK(g->reserved0 == 0, "reserved0", "%u, must be 0", g->reserved0);
#undef GCHK
	return 0;
}

static uint64_t chunk_payload(const struct kvt_geometry *g)
{
	uint64_t per_token = 0;

	for (uint32_t i = 0; i < g->n_groups && i < KVT_MAX_GROUPS; i++)
		per_token += (uint64_t)g->groups[i].layers * g->groups[i].bytes_per_token;
	return per_token * g->chunk_tokens; /* <= 2^20 * 8 * 2^12 * 2^20: no overflow */
}

uint64_t kvt_geometry_shard_bytes(const struct kvt_geometry *g)
{
	uint64_t b = chunk_payload(g);

	return b < KVT_PAGE ? round_up(b, KVT_CACHELINE) : round_up(b, KVT_PAGE);
}

/* Fills in defaults; the geometry must have passed kvt__geometry_check. */
static void geometry_defaults(struct kvt_geometry *g)
{
	if (!g->n_leases)
		g->n_leases = KVT_DEFAULT_LEASES;
	if (!g->lease_max_chunks)
		g->lease_max_chunks = KVT_DEFAULT_LEASE_CHUNKS;
	if (!g->fill_timeout_ms)
		g->fill_timeout_ms = KVT_DEFAULT_FILL_MS;
}

int kvt__layout_compute(const struct kvt_geometry *g, struct kvt_derived *d,
			struct kvt_region r[KVT_R__COUNT], uint64_t *total)
{
	uint64_t off = KVT_PAGE, part, arena;
	uint64_t want_buckets;

	memset(d, 0, sizeof(*d));
	d->n_shards = g->mode == KVT_MODE_SHARDED ? g->world : 1;
	d->shard_bytes = kvt_geometry_shard_bytes(g);
	d->slot_meta_bytes = round_up(sizeof(struct kvt_slot) +
				      (uint64_t)d->n_shards * sizeof(kvt_a64), KVT_CACHELINE);
	/* head, loaded[world], refs[lease_max_chunks] */
	d->lease_bytes = sizeof(struct kvt_lease) + (uint64_t)g->world * 8 +
			 (uint64_t)g->lease_max_chunks * 8;
	d->n_entries = g->n_instances * (g->world + 1) + KVT_MAX_CLIENTS;
	d->counter_block = round_up(KVT_CTR_WORDS * 8, KVT_CACHELINE);
	/* Load factor <= 1/4 over 7-way buckets (see index.c). */
	want_buckets = ((uint64_t)g->n_slots * 4 + KVT_BUCKET_WAYS - 1) / KVT_BUCKET_WAYS;
	d->n_buckets = 2;
	while (d->n_buckets < want_buckets)
		d->n_buckets <<= 1;
	/* The disk index: load factor <= 1/2 over 8-way buckets, two
	 * choices (diskidx.c); one request ring per table entry. */
	uint64_t disk_bytes = 0;
	if (g->disk_chunks) {
		uint64_t want = ((uint64_t)g->disk_chunks * 2 + KVT_DISK_WAYS - 1) / KVT_DISK_WAYS;
		d->disk_buckets = 2;
		while (d->disk_buckets < want)
			d->disk_buckets <<= 1;
		d->disk_rings = d->n_entries;
		disk_bytes = sizeof(struct kvt_disk_shm) +
			     round_up((uint64_t)d->disk_rings * sizeof(struct kvt_dring), KVT_PAGE) +
			     (uint64_t)d->disk_buckets * KVT_DISK_WAYS * sizeof(struct kvt_dent);
	}

	if (__builtin_mul_overflow((uint64_t)g->n_slots, d->shard_bytes, &part))
		return kvt__err(-EOVERFLOW, "geometry: arena size overflows");
	d->shard_part = round_up(part, KVT_ARENA_ALIGN);
	if (__builtin_mul_overflow(d->shard_part, (uint64_t)d->n_shards, &arena))
		return kvt__err(-EOVERFLOW, "geometry: arena size overflows");

	const uint64_t sizes[KVT_R__COUNT] = {
		[KVT_R_RANKS] = (uint64_t)d->n_entries * sizeof(struct kvt_ent),
		[KVT_R_COUNTERS] = (uint64_t)(d->n_entries + 1) * d->counter_block,
		[KVT_R_LEASES] = (uint64_t)g->n_leases * d->lease_bytes,
		[KVT_R_INDEX] = (uint64_t)d->n_buckets * sizeof(struct kvt_bucket),
		[KVT_R_SLOTS] = (uint64_t)g->n_slots * d->slot_meta_bytes,
		[KVT_R_DISK] = disk_bytes,
		[KVT_R_ARENA] = arena,
	};
	for (int i = 0; i < KVT_R__COUNT; i++) {
		if (i == KVT_R_ARENA)
			off = round_up(off, KVT_ARENA_ALIGN);
		r[i].off = off;
		r[i].size = sizes[i];
		if (__builtin_add_overflow(off, round_up(sizes[i], KVT_PAGE), &off))
			return kvt__err(-EOVERFLOW, "geometry: segment size overflows");
	}
	*total = round_up(off, KVT_ARENA_ALIGN);
	return 0;
}

void kvt__fingerprint(const struct kvt_geometry *g, kvt_key *out)
{
	/* The layout: what makes the bytes of a chunk mean the same thing,
	 * and how its key is computed from tokens (the key format: two
	 * processes that hash differently would only ever miss each other's
	 * chunks).  Capacity (slots, leases) and instance count are not part
	 * of it. */
	struct {
		uint32_t chunk_tokens, world, mode, n_groups;
		struct kvt_layer_group groups[KVT_MAX_GROUPS];
		kvt_key model_id;
		uint32_t key_format, pad;
	} f;

	memset(&f, 0, sizeof(f));
	f.key_format = KVT_KEY_FORMAT;
	f.chunk_tokens = g->chunk_tokens;
	f.world = g->world;
	f.mode = g->mode;
	f.n_groups = g->n_groups;
	memcpy(f.groups, g->groups, sizeof(f.groups));
	f.model_id = g->model_id;
	out->lo = kvt__hash64(&f, sizeof(f), 0x6b7674696572ULL);
	out->hi = kvt__hash64(&f, sizeof(f), out->lo ^ 0x66696e6765727072ULL);
}

uint64_t kvt_geometry_segment_bytes(const struct kvt_geometry *g)
{
	struct kvt_geometry c = *g;
	struct kvt_derived d;
	struct kvt_region r[KVT_R__COUNT];
	uint64_t total;

	if (kvt__geometry_check(&c))
		return 0;
	geometry_defaults(&c);
	return kvt__layout_compute(&c, &d, r, &total) ? 0 : total;
}

void kvt_geometry_fingerprint(const struct kvt_geometry *g, kvt_key *out)
{
	kvt__fingerprint(g, out);
}

uint64_t kvt__hdr_checksum(const struct kvt_hdr *h)
{
	return kvt__hash64((const uint8_t *)h + 8, offsetof(struct kvt_hdr, checksum) - 8,
			   0x636b73756dULL);
}

uint64_t kvt_proc_start_time(int pid)
{
	char path[64], buf[1024];
	ssize_t n;
	int fd;
	char *p;
	unsigned long long start = 0;

	if (pid <= 0)
		return 0;
	snprintf(path, sizeof(path), "/proc/%d/stat", pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	/* comm may contain spaces and parens: fields restart after the last ')'. */
	p = strrchr(buf, ')');
	if (!p)
		return 0;
	/* p is field 2's end; each space found starts the next field; starttime
	 * is field 22 */
	for (int field = 2; field < 22 && p; field++)
		p = strchr(p + 1, ' ');
	if (!p || sscanf(p, " %llu", &start) != 1)
		return 0;
	/* A zombie still has a stat file; treat it as dead. */
	{
		char *st = strrchr(buf, ')');
		if (st && st[1] == ' ' && (st[2] == 'Z' || st[2] == 'X'))
			return 0;
	}
	return start ? start : 1;
}

static int seg_path(char *out, size_t len, const char *name, const char *dir,
		    int *is_shm)
{
	int r = kvt_seg_name_valid(name);

	if (r)
		return r;
	*is_shm = dir == NULL;
	if (dir)
		r = snprintf(out, len, "%s/kvtier.%s", dir, name);
	else
		r = snprintf(out, len, "/kvtier.%s", name);
	if (r < 0 || (size_t)r >= len)
		return kvt__err(-ENAMETOOLONG, "segment path too long");
	return 0;
}

/* Whether a directory sits where the segment's file would be. */
static int dir_at(const char *path, int is_shm)
{
	char full[PATH_MAX + 16];
	struct stat st;

	snprintf(full, sizeof(full), "%s%s", is_shm ? "/dev/shm" : "", path);
	return !lstat(full, &st) && S_ISDIR(st.st_mode);
}

static int seg_open(const char *path, int is_shm, int flags, mode_t mode)
{
	int fd = is_shm ? shm_open(path, flags | O_CLOEXEC, mode)
			: open(path, flags | O_CLOEXEC, mode);
	return fd < 0 ? -errno : fd;
}

int kvt_seg_unlink(const char *name, const char *dir)
{
	char path[PATH_MAX];
	int is_shm, r = seg_path(path, sizeof(path), name, dir, &is_shm);

	if (r)
		return r;
	r = is_shm ? shm_unlink(path) : unlink(path);
	if (r < 0)
		return kvt__err(-errno, "unlink segment '%s': %s", name, strerror(errno));
	return 0;
}

/* ---- the process's handles, for fork ----
 *
 * A forked child inherits every handle's open file description, and with
 * it the OFD lock that says the parent's entry lives (ranks.c).  So the
 * child handler closes those descriptors in the child and makes the
 * handles inert there: the entry stays the parent's, and dies with it.
 * The mapping is made through another open of the file (map_path), so the
 * mapping a child inherits keeps no locked description alive: until
 * layout 5 the locked descriptor itself was mapped, and an idle child of
 * a dead rank (Python's multiprocessing fork, a worker pool) kept the rank
 * "alive", unreaped, and a dead kvtierd's ownership.  (The child may
 * still read the segment through the mapping, e.g. its counters; it can
 * no longer be taken for its parent.)
 * This list is the one piece of process-wide state in core: fork is a
 * process-wide event. */
static pthread_mutex_t handles_mu = PTHREAD_MUTEX_INITIALIZER;
static kvt_seg *handles;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void atfork_prepare(void) { pthread_mutex_lock(&handles_mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&handles_mu); }

static void atfork_child(void)
{
	for (kvt_seg *s = handles; s; s = s->next) {
		if (s->fd >= 0)
			close(s->fd);
		s->fd = -1;
		kvt__witness_forget(s);
		s->forked = 1;
		s->entry = UINT32_MAX;
		s->reaping = UINT32_MAX;
		s->my_counters = (uint64_t *)kvt__ctr(s, s->d.n_entries);
		s->pid = getpid();
	}
	handles = NULL;
	pthread_mutex_unlock(&handles_mu);
}

static void atfork_init(void)
{
	(void)pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

static void handle_register(kvt_seg *s)
{
	pthread_once(&atfork_once, atfork_init);
	pthread_mutex_lock(&handles_mu);
	s->next = handles;
	handles = s;
	pthread_mutex_unlock(&handles_mu);
}

static void handle_unregister(kvt_seg *s)
{
	pthread_mutex_lock(&handles_mu);
	for (kvt_seg **pp = &handles; *pp; pp = &(*pp)->next)
		if (*pp == s) {
			*pp = s->next;
			break;
		}
	pthread_mutex_unlock(&handles_mu);
}

/* Fills the handle's pointers and private fields from its validated
 * geometry, layout and header (s->base, size, geo, d, r, hdr set). */
static void handle_init_regions(kvt_seg *s)
{
	uint32_t bits = 64 - (uint32_t)__builtin_clzll((unsigned long long)s->geo.n_leases);

	s->ents = (struct kvt_ent *)(s->base + s->r[KVT_R_RANKS].off);
	s->counters = s->base + s->r[KVT_R_COUNTERS].off;
	s->leases = s->base + s->r[KVT_R_LEASES].off;
	s->buckets = (struct kvt_bucket *)(s->base + s->r[KVT_R_INDEX].off);
	s->slots = s->base + s->r[KVT_R_SLOTS].off;
	s->arena = s->base + s->r[KVT_R_ARENA].off;
	s->bucket_mask = s->d.n_buckets - 1;
	if (s->d.disk_buckets) {
		uint8_t *p = s->base + s->r[KVT_R_DISK].off;
		s->disk = (struct kvt_disk_shm *)p;
		s->drings = (struct kvt_dring *)(p + sizeof(struct kvt_disk_shm));
		s->ring_stride = sizeof(struct kvt_dring);
		s->dents = (struct kvt_dent *)(p + sizeof(struct kvt_disk_shm) +
			round_up((uint64_t)s->d.disk_rings * sizeof(struct kvt_dring), KVT_PAGE));
		s->disk_mask = s->d.disk_buckets - 1;
	}
	s->chunk_bytes = chunk_payload(&s->geo);
	s->my_counters = (uint64_t *)kvt__ctr(s, s->d.n_entries);
	s->entry = UINT32_MAX;
	s->reaping = UINT32_MAX;
	s->pid = getpid();
	s->start = kvt_proc_start_time(s->pid);
	s->sweep_peek = (s->hdr->policy & KVT_POLICY_DEPTH_FIRST) ? 8 : 0;
	/* Lease ids: [tag 20][gen][idx + 1 in `bits`]; n_leases <= 2^20
	 * leaves at least 23 bits of generation. */
	s->lid_tag = (uint32_t)(kvt__mix64(s->hdr->seg_id) >> 11) & ((1u << KVT_LID_TAG_BITS) - 1);
	if (!s->lid_tag)
		s->lid_tag = 1;
	s->lid_idx_bits = bits;
	s->lid_gen_mask = (1ULL << (64 - KVT_LID_TAG_BITS - bits)) - 1;
}

/* Validates the header against the mapping; names the first bad field. */
static int hdr_validate(const struct kvt_hdr *h, uint64_t map_size, uid_t file_uid,
			struct kvt_derived *d, struct kvt_region r[KVT_R__COUNT])
{
	uint64_t total;
	kvt_key fp;
	int rc;

#define HCHK(cond, code, ...) do { if (!(cond)) return kvt__err(code, __VA_ARGS__); } while (0)
	HCHK(h->version == KVT_LAYOUT_VERSION, -EPROTO,
	     "header.version: %u, this library reads layout version %u%s",
	     h->version, KVT_LAYOUT_VERSION, h->version < KVT_LAYOUT_VERSION ?
	     " (made by an older kvtier: remove it and create it again)" : "");
	HCHK(h->hdr_size == sizeof(struct kvt_hdr), -EPROTO,
	     "header.hdr_size: %u, expected %zu", h->hdr_size, sizeof(struct kvt_hdr));
	HCHK(h->total_size == map_size, -EPROTO,
	     "header.total_size: %llu but the object is %llu bytes",
	     (unsigned long long)h->total_size, (unsigned long long)map_size);
	HCHK(h->page_size >= KVT_PAGE && (h->page_size & (h->page_size - 1)) == 0 &&
	     h->page_size <= (1ULL << 30), -EPROTO,
	     "header.page_size: %llu is not a power of two in 4 KiB..1 GiB",
	     (unsigned long long)h->page_size);
	HCHK(h->creator_uid == (uint32_t)file_uid, -EPROTO,
	     "header.creator_uid: %u but the object is owned by uid %u",
	     h->creator_uid, (unsigned)file_uid);
	HCHK(h->creator_pid >= 1 && h->creator_pid <= (1u << 22), -EPROTO,
	     "header.creator_pid: %u out of range", h->creator_pid);
	HCHK(h->creator_start != 0, -EPROTO, "header.creator_start: zero");
	HCHK(h->created_ns != 0, -EPROTO, "header.created_ns: zero");
	HCHK(h->seg_id != 0, -EPROTO, "header.seg_id: zero");
	rc = kvt__geometry_check(&h->geo);
	if (rc) {
		char tmp[sizeof(kvt_errbuf)];
		save_err(tmp, sizeof(tmp));
		return kvt__err(-EPROTO, "header.%.200s", tmp);
	}
	HCHK(h->geo.n_leases >= 1, -EPROTO, "header.geometry.n_leases: zero");
	HCHK(h->geo.lease_max_chunks >= 1, -EPROTO, "header.geometry.lease_max_chunks: zero");
	HCHK(h->geo.fill_timeout_ms >= 1, -EPROTO, "header.geometry.fill_timeout_ms: zero");
	rc = kvt__layout_compute(&h->geo, d, r, &total);
	if (rc)
		return kvt__err(-EPROTO, "header.geometry: layout overflows");
#define DCHK(f) HCHK(h->d.f == d->f, -EPROTO, "header.derived." #f \
	": %llu, the geometry gives %llu", (unsigned long long)h->d.f, (unsigned long long)d->f)
	DCHK(shard_bytes); DCHK(slot_meta_bytes); DCHK(lease_bytes); DCHK(shard_part);
	DCHK(n_shards); DCHK(n_entries); DCHK(n_buckets); DCHK(counter_block);
	DCHK(disk_buckets); DCHK(disk_rings);
#undef DCHK
	static const char *const rname[KVT_R__COUNT] = {
		"ranks", "counters", "leases", "index", "slots", "disk", "arena" };
	for (int i = 0; i < KVT_R__COUNT; i++) {
		HCHK(h->regions[i].off == r[i].off, -EPROTO,
		     "header.regions[%s].off: %llu, the geometry gives %llu", rname[i],
		     (unsigned long long)h->regions[i].off, (unsigned long long)r[i].off);
		HCHK(h->regions[i].size == r[i].size, -EPROTO,
		     "header.regions[%s].size: %llu, the geometry gives %llu", rname[i],
		     (unsigned long long)h->regions[i].size, (unsigned long long)r[i].size);
	}
	HCHK(total <= map_size, -EPROTO,
	     "header.total_size: the layout needs %llu bytes, the object has %llu",
	     (unsigned long long)total, (unsigned long long)map_size);
	kvt__fingerprint(&h->geo, &fp);
	HCHK(fp.lo == h->fingerprint.lo && fp.hi == h->fingerprint.hi, -EPROTO,
	     "header.fingerprint: does not match the geometry");
	HCHK((h->policy & ~KVT_POLICY_MASK) == 0, -EPROTO, "header.policy: unknown bits %#llx",
	     (unsigned long long)(h->policy & ~KVT_POLICY_MASK));
	HCHK(h->checksum == kvt__hdr_checksum(h), -EPROTO,
	     "header.checksum: the header was modified after creation");
#undef HCHK
	return 0;
}

static int attach_opts_check(const struct kvt_seg_attach_opts *a)
{
	if (a->size < sizeof(struct kvt_seg_attach_opts))
		return kvt__err(-EINVAL, "attach options: size %zu, expected %zu",
				a->size, sizeof(struct kvt_seg_attach_opts));
	if (a->flags & ~(KVT_SEG_F_ANY_UID | KVT_SEG_F_GROUP))
		return kvt__err(-EINVAL, "attach options: unknown flags 0x%x",
				a->flags & ~(KVT_SEG_F_ANY_UID | KVT_SEG_F_GROUP));
	if (a->role > KVT_ROLE_CLIENT)
		return kvt__err(-EINVAL, "attach options: unknown role %u", a->role);
	if (a->role == KVT_ROLE_RANK && a->world == 0)
		return kvt__err(-EINVAL, "attach options: a rank must state its world size");
	return 0;
}

char *kvt_seg_model(const kvt_seg *s, char *buf, size_t len)
{
	size_t i = 0;

	/* the header is shared memory: bounded, and printable when shown */
	for (; i + 1 < len && i < KVT_MODEL_TEXT && s->hdr->model[i]; i++) {
		unsigned char ch = (unsigned char)s->hdr->model[i];
		buf[i] = ch >= 0x20 && ch < 0x7f ? (char)ch : '?';
	}
	buf[i] = 0;
	return buf;
}

/* The value of field `key` in a model text "NAME;key=value;..." (the
 * name when key is NULL): its start and length, or NULL. */
static const char *model_field(const char *text, const char *key, size_t *vlen)
{
	const char *p = text, *end;
	size_t kl = key ? strlen(key) : 0;

	for (int first = 1; p; first = 0) {
		end = strchr(p, ';');
		size_t n = end ? (size_t)(end - p) : strlen(p);
		if (first && !key) {
			*vlen = n;
			return p;
		}
		if (!first && key && n > kl && !strncmp(p, key, kl) && p[kl] == '=') {
			*vlen = n - kl - 1;
			return p + kl + 1;
		}
		p = end ? end + 1 : NULL;
	}
	return NULL;
}

/* The model texts' fields that differ, "; model kv: the segment's 'a',
 * this process's 'b'" each (a field one side lacks is "(none)"). */
static size_t model_diff(const char *seg, const char *mine, char *buf, size_t len)
{
	const char *texts[2] = { mine, seg };
	size_t n = 0;

	for (int side = 0; side < 2; side++) {
		for (const char *p = strchr(texts[side], ';'); p; p = strchr(p + 1, ';')) {
			char key[32];
			const char *eq = strchr(p + 1, '='), *semi = strchr(p + 1, ';');
			const char *a, *b;
			size_t al = 0, bl = 0;

			if (!eq || (semi && eq > semi) || (size_t)(eq - p - 1) >= sizeof(key))
				continue;
			memcpy(key, p + 1, (size_t)(eq - p - 1));
			key[eq - p - 1] = 0;
			a = model_field(seg, key, &al);
			b = model_field(mine, key, &bl);
			if (side == 1 && b)
				continue;  /* both have it: said on the first pass */
			if (a && b && al == bl && !memcmp(a, b, al))
				continue;
			if (n < len)
				n += (size_t)snprintf(buf + n, len - n,
					"; model %s: the segment's '%.*s', this process's '%.*s'", key,
					a ? (int)al : 6, a ? a : "(none)", b ? (int)bl : 6,
					b ? b : "(none)");
		}
	}
	{
		size_t al, bl;
		const char *a = model_field(seg, NULL, &al), *b = model_field(mine, NULL, &bl);
		if ((al != bl || memcmp(a, b, al)) && n < len)
			n += (size_t)snprintf(buf + n, len - n,
				"; model name: the segment's '%.*s', this process's '%.*s'",
				(int)al, a, (int)bl, b);
	}
	return n;
}

/* The fields behind two fingerprints that differ, for the mismatch's
 * message: "; chunk_tokens: the segment's 32, this process's 16".  The
 * model id is a hash of the model's description (the connector's
 * kvtier_model, kvtierd --model): both descriptions are named, the
 * segment's from its header (seg_model) and this process's (model). */
static void geometry_diff(const struct kvt_geometry *s, const char *seg_model,
			  const struct kvt_geometry *m, const char *model, char *buf, size_t len)
{
	static const char *const modes[] = { "sharded", "replicated" };
	size_t n = 0;

#define DIFF(...) do { \
		if (n < len) \
			n += (size_t)snprintf(buf + n, len - n, __VA_ARGS__); \
	} while (0)
	buf[0] = 0;
	if (s->chunk_tokens != m->chunk_tokens)
		DIFF("; chunk_tokens: the segment's %u, this process's %u", s->chunk_tokens,
		     m->chunk_tokens);
	if (s->world != m->world)
		DIFF("; world: the segment's %u, this process's %u", s->world, m->world);
	if (s->mode != m->mode && s->mode < 2 && m->mode < 2)
		DIFF("; layout: the segment's %s, this process's %s", modes[s->mode],
		     modes[m->mode]);
	if (s->n_groups != m->n_groups)
		DIFF("; layer groups: the segment's %u, this process's %u", s->n_groups,
		     m->n_groups);
	for (uint32_t g = 0; g < s->n_groups && g < m->n_groups && g < KVT_MAX_GROUPS; g++) {
		if (s->groups[g].layers != m->groups[g].layers)
			DIFF("; group %u layers: the segment's %u, this process's %u", g,
			     s->groups[g].layers, m->groups[g].layers);
		if (s->groups[g].bytes_per_token != m->groups[g].bytes_per_token)
			DIFF("; group %u bytes per token: the segment's %u, this process's %u", g,
			     s->groups[g].bytes_per_token, m->groups[g].bytes_per_token);
	}
	if (s->model_id.lo != m->model_id.lo || s->model_id.hi != m->model_id.hi) {
		size_t k = 0;
		if (seg_model[0] && model && n < len)
			n += (k = model_diff(seg_model, model, buf + n, len - n));
		if (seg_model[0] && !k)
			DIFF("; model: the segment's '%.300s', this process's '%.300s'", seg_model,
			     model ? model : "(not given)");
		else if (!seg_model[0])
			DIFF("; model: another model's (the segment's description was not "
			     "recorded: made by an older kvtier), this process's '%.150s'",
			     model ? model : "(not given)");
		DIFF(" (the engines' model identities must be the same; kvtierd's is --model "
		     "with --model-config's file fields: the engine logs its kvtierd line)");
	}
	if (!buf[0])
		DIFF("; every field is the same: another kvtier key format (a different "
		     "kvtier version made the segment)");
#undef DIFF
}

/* Checks the caller's view (world, rank, fingerprint) and claims the entry. */
static int attach_identity(kvt_seg *s, const struct kvt_seg_attach_opts *a)
{
	uint32_t e;
	int r;

	if (a->world && a->world != s->geo.world)
		return kvt__err(-EINVAL,
			"world: this process says world=%u but segment '%s' was created "
			"for world=%u", a->world, s->name, s->geo.world);
	if (a->fingerprint) {
		kvt_key fp;
		kvt__fingerprint(&s->geo, &fp);
		if (fp.lo != a->fingerprint->lo || fp.hi != a->fingerprint->hi) {
			char diff[900] = "", seg_model[KVT_MODEL_TEXT_MAX];
			if (a->geo)
				geometry_diff(&s->geo, kvt_seg_model(s, seg_model, sizeof(seg_model)),
					      a->geo, a->model, diff, sizeof(diff));
			return kvt__err(-ESTALE,
				"fingerprint: the segment '%s' holds another model or KV layout "
				"(%016llx%016llx, expected %016llx%016llx)%s", s->name,
				(unsigned long long)fp.hi, (unsigned long long)fp.lo,
				(unsigned long long)a->fingerprint->hi,
				(unsigned long long)a->fingerprint->lo, diff);
		}
	}
	s->role = a->role;
	s->instance = a->instance;
	s->rank = a->rank;
	if (a->role == KVT_ROLE_OBSERVER)
		return 0;
	if (a->instance >= s->geo.n_instances)
		return kvt__err(-EINVAL, "instance: %u out of range (segment has %u)",
				a->instance, s->geo.n_instances);
	if (a->role == KVT_ROLE_RANK && a->rank >= s->geo.world)
		return kvt__err(-EINVAL, "rank: %u out of range for world=%u",
				a->rank, s->geo.world);
	if (a->role == KVT_ROLE_CLIENT) {
		/* An empty entry first; else one left by a dead client (reaped
		 * on the way). */
		for (uint32_t k = 0; k < 2 * KVT_MAX_CLIENTS; k++) {
			e = s->geo.n_instances * (s->geo.world + 1) + k % KVT_MAX_CLIENTS;
			r = kvt__entry_claim(s, e, k < KVT_MAX_CLIENTS ? KVT_CLAIM_EMPTY_ONLY : 0);
			if (r == 0)
				return 0;
			if (r != -EBUSY)
				return r;
		}
		return kvt__err(-EBUSY, "clients: all %u client entries are in use",
				KVT_MAX_CLIENTS);
	}
	e = kvt__entry_index(s, a->role, a->instance, a->rank);
	r = kvt__entry_claim(s, e, KVT_CLAIM_WAIT);
	if (r == -EBUSY)
		return kvt__err(-EBUSY, "%s (instance %u%s%u) is attached by a live process",
				a->role == KVT_ROLE_RANK ? "rank" : "scheduler", a->instance,
				a->role == KVT_ROLE_RANK ? ", rank " : "", a->rank);
	return r;
}

/* Maps the object at an address aligned to `align` (2 MiB, or the huge page
 * size of a hugetlbfs file), so that the arena, 2 MiB aligned inside the
 * object, is 2 MiB aligned in memory too: NUMA binding, transparent huge
 * pages and GPU registration all work in those units. */
static int map_fd(int fd, uint64_t size, uint64_t align, uint8_t **base)
{
	uint8_t *resv, *p;
	uintptr_t a;

	resv = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
		    -1, 0);
	if (resv == MAP_FAILED)
		return -errno;
	a = ((uintptr_t)resv + align - 1) & ~(uintptr_t)(align - 1);
	p = mmap((void *)a, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
	if (p == MAP_FAILED) {
		int r = -errno;
		munmap(resv, size + align);
		return r;
	}
	if (a > (uintptr_t)resv)
		munmap(resv, a - (uintptr_t)resv);
	if ((uintptr_t)resv + align > a)
		munmap((uint8_t *)a + size, (uintptr_t)resv + align - a);
	*base = p;
	return 0;
}

/* Maps the file open as `fd` through a second open of the same path: the
 * mapping keeps its open file description alive for as long as the
 * mapping lives, in this process and in any child that inherits it, so
 * that description must never carry a lock.  Entry and owner locks live
 * on `fd` alone, which is never mapped (ranks.c, owner.c): a fork child
 * that keeps the mapping keeps no liveness token of the parent's.  The
 * second open must find the same inode (dev, ino) as `fd`, or the name
 * was replaced in between: -ESTALE. */
static int map_path(int fd, const char *path, int is_shm, uint64_t size, uint64_t align,
		    uint8_t **base)
{
	struct stat a, b;
	int mfd, r;

	mfd = seg_open(path, is_shm, O_RDWR | O_NOFOLLOW, 0);
	if (mfd < 0)
		return mfd;
	if (fstat(fd, &a) < 0 || fstat(mfd, &b) < 0)
		r = -errno;
	else if (a.st_dev != b.st_dev || a.st_ino != b.st_ino)
		r = -ESTALE;
	else
		r = map_fd(mfd, size, align, base);
	close(mfd);
	return r;
}

static uint64_t map_align(const struct stat *st)
{
	uint64_t blk = (uint64_t)st->st_blksize;

	return blk > KVT_ARENA_ALIGN && (blk & (blk - 1)) == 0 ? blk : KVT_ARENA_ALIGN;
}

int kvt_seg_attach(const struct kvt_seg_attach_opts *a, kvt_seg **out)
{
	char path[PATH_MAX];
	struct stat st;
	kvt_seg *s;
	int is_shm, fd, r;

	if (!a || !out)
		return kvt__err(-EINVAL, "attach: NULL argument");
	r = attach_opts_check(a);
	if (r)
		return r;
	r = seg_path(path, sizeof(path), a->name, a->dir, &is_shm);
	if (r)
		return r;
	fd = seg_open(path, is_shm, O_RDWR | O_NOFOLLOW, 0);
	if (fd < 0) {
		/* shm_open says EINVAL for a directory: say what is there */
		if (dir_at(path, is_shm))
			return kvt__err(-EISDIR, "attach '%s': %s%s is a directory, not a "
					"segment", a->name, is_shm ? "/dev/shm" : "", path);
		return kvt__err(fd, "attach '%s': %s%s: %s", a->name, is_shm ? "/dev/shm" : "",
				path, strerror(-fd));
	}
	if (fstat(fd, &st) < 0) {
		r = -errno;
		close(fd);
		return kvt__err(r, "attach '%s': fstat: %s", a->name, strerror(-r));
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		return kvt__err(-EINVAL, "attach '%s': %s%s is not a regular file", a->name,
				is_shm ? "/dev/shm" : "", path);
	}
	/* Who may write it: a segment others can write is a segment whose
	 * keys and payloads they can rewrite under every reader (SECURITY.md). */
	if (st.st_mode & S_IWOTH) {
		close(fd);
		return kvt__err(-EACCES, "attach '%s': %s%s is world-writable (mode %04o): any "
				"local user could rewrite its keys or KV; refused (chmod 600, or "
				"660 with group access)", a->name, is_shm ? "/dev/shm" : "", path,
				(unsigned)(st.st_mode & 07777));
	}
	if ((st.st_mode & S_IWGRP) && !(a->flags & KVT_SEG_F_GROUP)) {
		close(fd);
		return kvt__err(-EACCES, "attach '%s': %s%s is group-writable (mode %04o): "
				"accepted only with group access (KVT_F_GROUP, Python "
				"group_access=True)", a->name, is_shm ? "/dev/shm" : "", path,
				(unsigned)(st.st_mode & 07777));
	}
	if (st.st_uid != geteuid() && !(a->flags & KVT_SEG_F_ANY_UID)) {
		close(fd);
		return kvt__err(-EPERM, "attach '%s': owned by uid %u, not by this uid %u "
				"(pass KVT_SEG_F_ANY_UID to accept it)", a->name,
				(unsigned)st.st_uid, (unsigned)geteuid());
	}
	if ((uint64_t)st.st_size < sizeof(struct kvt_hdr)) {
		close(fd);
		return kvt__err(-EPROTO, "attach '%s': header.total_size: the object is "
				"only %lld bytes", a->name, (long long)st.st_size);
	}
	s = calloc(1, sizeof(*s));
	if (!s) {
		close(fd);
		return kvt__err(-ENOMEM, "attach: out of memory");
	}
	snprintf(s->name, sizeof(s->name), "%s", a->name);
	s->size = (uint64_t)st.st_size;
	s->fd = fd;
	r = map_path(fd, path, is_shm, s->size, map_align(&st), &s->base);
	if (r) {
		close(fd);
		free(s);
		return kvt__err(r, "attach '%s': mmap: %s", a->name,
				r == -ESTALE ? "the file was replaced while attaching; try again"
					     : strerror(-r));
	}
	s->hdr = (struct kvt_hdr *)s->base;
	/* A0: pairs with R0 in kvt_seg_create; the header is complete. */
	if (kat_load(&s->hdr->magic, KVT_ACQ) != KVT_MAGIC) {
		r = kvt__err(-EPROTO, "header.magic: '%s' is not a kvtier segment, or its "
			     "creator has not finished (or died before finishing) it", a->name);
		goto out_unmap;
	}
	r = hdr_validate(s->hdr, s->size, st.st_uid, &s->d, s->r);
	if (r)
		goto out_unmap;
	s->geo = s->hdr->geo;
	handle_init_regions(s);
	if (a->role != KVT_ROLE_OBSERVER) {
		r = kvt__drain_check(s);
		if (r)
			goto out_unmap;
	}
	handle_register(s);
	r = attach_identity(s, a);
	if (r) {
		handle_unregister(s);
		goto out_unmap;
	}
	*out = s;
	return 0;
out_unmap:
	munmap(s->base, s->size);
	close(fd);
	free(s);
	return r;
}

/* ---- creation: capacity, reservation ---- */

#define KVT_HUGETLBFS_MAGIC 0x958458f6
/* A size for messages: "1.5 GiB", "24.0 MiB", "512 KiB". */
struct hsz { char s[24]; };
static struct hsz hsize(uint64_t b)
{
	struct hsz h;

	if (b >= (1ULL << 30))
		snprintf(h.s, sizeof(h.s), "%.1f GiB", (double)b / (double)(1ULL << 30));
	else if (b >= (1ULL << 20))
		snprintf(h.s, sizeof(h.s), "%.1f MiB", (double)b / (double)(1ULL << 20));
	else
		snprintf(h.s, sizeof(h.s), "%llu KiB", (unsigned long long)(b >> 10));
	return h;
}
#define GIB(x) hsize(x).s

/* Free huge pages of size `page` in the pool (free minus reserved), or -1
 * when the pool does not say. */
static int64_t hugepages_free(uint64_t page)
{
	char path[128];
	long long v[2];
	static const char *const f[2] = { "free_hugepages", "resv_hugepages" };

	for (int i = 0; i < 2; i++) {
		snprintf(path, sizeof(path), "/sys/kernel/mm/hugepages/hugepages-%llukB/%s",
			 (unsigned long long)(page >> 10), f[i]);
		FILE *fp = fopen(path, "re");
		if (!fp)
			return -1;
		int ok = fscanf(fp, "%lld", &v[i]) == 1;
		fclose(fp);
		if (!ok)
			return -1;
	}
	return v[0] > v[1] ? v[0] - v[1] : 0;
}

/* Refuses a segment that cannot fit: -EFBIG when it exceeds what the
 * filesystem (or, for memory filesystems, the host's memory and swap)
 * could ever hold, -ENOSPC when it exceeds what is free now.  The real
 * guarantee is the reservation that follows; this gives the message. */
static int capacity_check(int fd, const char *name, uint64_t total, int *is_huge)
{
	struct statfs sf;
	struct sysinfo si;

	*is_huge = 0;
	if (fstatfs(fd, &sf) != 0)
		return 0; /* cannot tell: the reservation decides */
	*is_huge = (uint64_t)sf.f_type == KVT_HUGETLBFS_MAGIC;
	uint64_t bs = (uint64_t)sf.f_bsize;
	int memfs = *is_huge || (uint64_t)sf.f_type == 0x01021994 /* TMPFS_MAGIC */;
	if (memfs && sysinfo(&si) == 0) {
		uint64_t host = ((uint64_t)si.totalram + si.totalswap) * si.mem_unit;
		if (total > host)
			return kvt__err(-EFBIG, "create '%s': the segment needs %llu bytes "
					"(%s), more than this host's memory and swap "
					"(%llu bytes, %s)", name, (unsigned long long)total,
					GIB(total), (unsigned long long)host, GIB(host));
	}
	if (sf.f_blocks > 0 && sf.f_blocks != (fsblkcnt_t)-1) {
		uint64_t cap = (uint64_t)sf.f_blocks * bs, avail = (uint64_t)sf.f_bavail * bs;
		if (total > cap)
			return kvt__err(-EFBIG, "create '%s': the segment needs %llu bytes "
					"(%s), more than its filesystem holds at all "
					"(%llu bytes, %s)", name, (unsigned long long)total,
					GIB(total), (unsigned long long)cap, GIB(cap));
		if (total > avail)
			return kvt__err(-ENOSPC, "create '%s': the segment needs %llu bytes "
					"(%s), its filesystem has %llu bytes free (%s)",
					name, (unsigned long long)total, GIB(total),
					(unsigned long long)avail, GIB(avail));
	} else if (*is_huge) {
		int64_t fr = hugepages_free(bs);
		if (fr >= 0 && total > (uint64_t)fr * bs)
			return kvt__err(-ENOSPC, "create '%s': the segment needs %llu huge pages "
					"of %llu KiB (%s), the pool has %lld free (%s)",
					name, (unsigned long long)((total + bs - 1) / bs),
					(unsigned long long)(bs >> 10), GIB(total), (long long)fr,
					GIB((uint64_t)fr * bs));
	}
	return 0;
}

/* Backs [off, off + len) of the file with memory now (tmpfs and the like:
 * fallocate allocates and zeroes the pages, under the file's NUMA policy,
 * and fails with ENOSPC instead of a later SIGBUS).  Hugetlbfs needs
 * nothing here: the creator's shared mapping reserved the huge pages. */
static int reserve(int fd, const char *name, uint64_t off, uint64_t len, int is_huge)
{
	if (is_huge || !len)
		return 0;
	if (fallocate(fd, 0, (off_t)off, (off_t)len) == 0)
		return 0;
	if (errno == EOPNOTSUPP || errno == ENOSYS)
		return 0; /* the capacity check is all this filesystem allows */
	if (errno == ENOSPC)
		return kvt__err(-ENOSPC, "create '%s': reserving %llu bytes (%s) of "
				"memory failed: its filesystem is full", name,
				(unsigned long long)len, GIB(len));
	return kvt__err(-errno, "create '%s': fallocate of %llu bytes: %s", name,
			(unsigned long long)len, strerror(errno));
}

static int prefault(const char *name, uint8_t *p, uint64_t len, int is_huge)
{
#ifdef MADV_POPULATE_WRITE
	if (madvise(p, len, MADV_POPULATE_WRITE) == 0)
		return 0;
	if (errno != EINVAL)
		return kvt__err(errno == EFAULT || errno == ENOMEM ? -ENOSPC : -errno,
				"create '%s': pre-faulting the arena (%s): %s", name,
				GIB(len), strerror(errno));
#endif
	/* A kernel without MADV_POPULATE_WRITE: touching is safe because the
	 * pages are reserved (fallocate, or the hugetlb reservation). */
	(void)is_huge;
	for (uint64_t o = 0; o < len; o += KVT_PAGE)
		p[o] = 0;
	return 0;
}

static uint64_t random_id(void)
{
	uint64_t id = 0;

	if (getrandom(&id, sizeof(id), GRND_NONBLOCK) != (ssize_t)sizeof(id))
		id = kvt__mix64(kvt__now_ns() ^ ((uint64_t)getpid() << 32) ^ (uintptr_t)&id);
	return id ? id : 1;
}

int kvt_seg_create(const struct kvt_seg_create_opts *c,
		   const struct kvt_seg_attach_opts *a, kvt_seg **out)
{
	struct kvt_seg_attach_opts client = {
		.size = sizeof(client), .role = KVT_ROLE_CLIENT };
	struct kvt_derived d;
	struct kvt_region reg[KVT_R__COUNT];
	struct kvt_geometry g;
	struct kvt_hdr *h;
	struct stat st;
	char path[PATH_MAX];
	uint64_t total;
	uint8_t *base = NULL;
	kvt_seg *s = NULL;
	int is_shm, is_huge = 0, fd, r;

	if (!c || !out || !c->geo)
		return kvt__err(-EINVAL, "create: NULL argument");
	if (c->size < sizeof(*c))
		return kvt__err(-EINVAL, "create options: size %zu, expected %zu",
				c->size, sizeof(*c));
	if (c->flags & ~(KVT_SEG_F_GROUP | KVT_SEG_F_REPLACE | KVT_SEG_F_PREFAULT |
			 KVT_SEG_F_DEPTH_FIRST))
		return kvt__err(-EINVAL, "create options: unknown flags 0x%x", c->flags);
	if (c->reserved)
		return kvt__err(-EINVAL, "create options: reserved field is not zero");
	if (a) {
		r = attach_opts_check(a);
		if (r)
			return r;
		if (a->world && a->world != c->geo->world)
			return kvt__err(-EINVAL, "world: attach says %u, geometry says %u",
					a->world, c->geo->world);
	}
	g = *c->geo;
	r = kvt__geometry_check(&g);
	if (r)
		return r;
	geometry_defaults(&g);
	r = kvt__layout_compute(&g, &d, reg, &total);
	if (r)
		return r;
	if (total > (uint64_t)LLONG_MAX)
		return kvt__err(-EFBIG, "geometry: segment of %llu bytes is too large",
				(unsigned long long)total);
	r = seg_path(path, sizeof(path), c->name, c->dir, &is_shm);
	if (r)
		return r;
	if ((c->flags & KVT_SEG_F_REPLACE) &&
	    (is_shm ? shm_unlink(path) : unlink(path)) < 0 && errno != ENOENT)
		return kvt__err(-errno, "create '%s': cannot remove the existing %s%s: %s",
				c->name, is_shm ? "/dev/shm" : "", path, strerror(errno));
	fd = seg_open(path, is_shm, O_RDWR | O_CREAT | O_EXCL,
		      (c->flags & KVT_SEG_F_GROUP) ? 0660 : 0600);
	if (fd < 0 && dir_at(path, is_shm))
		return kvt__err(-EISDIR, "create '%s': %s%s is a directory, not a segment "
				"(remove it)", c->name, is_shm ? "/dev/shm" : "", path);
	if (fd < 0)
		return kvt__err(fd, "create '%s': %s%s", c->name, strerror(-fd),
				fd == -EEXIST ? " (remove it, or pass KVT_SEG_F_REPLACE)" : "");
	/* The mode argument is filtered by the umask: set it exactly. */
	(void)fchmod(fd, (c->flags & KVT_SEG_F_GROUP) ? 0660 : 0600);
	r = capacity_check(fd, c->name, total, &is_huge);
	if (r)
		goto out_close;
	if (ftruncate(fd, (off_t)total) < 0) {
		r = kvt__err(-errno, "create '%s': ftruncate to %llu bytes: %s", c->name,
			     (unsigned long long)total, strerror(errno));
		goto out_close;
	}
	/* The tables first: every attacher walks them. */
	r = reserve(fd, c->name, 0, reg[KVT_R_ARENA].off, is_huge);
	if (r)
		goto out_close;
	r = fstat(fd, &st) < 0 ? -errno : map_path(fd, path, is_shm, total, map_align(&st), &base);
	if (r) {
		if (is_huge && r == -ENOMEM)
			r = kvt__err(-ENOSPC, "create '%s': reserving %s of huge pages "
				     "failed: the pool has too few free", c->name, GIB(total));
		else
			kvt__err(r, "create '%s': mmap of %llu bytes: %s", c->name,
				 (unsigned long long)total, strerror(-r));
		goto out_close;
	}

	/* The header, all but the magic (nobody can attach yet). */
	h = (struct kvt_hdr *)base;
	h->version = KVT_LAYOUT_VERSION;
	h->hdr_size = sizeof(struct kvt_hdr);
	h->total_size = total;
	h->page_size = is_huge ? (uint64_t)st.st_blksize : (uint64_t)sysconf(_SC_PAGESIZE);
	h->creator_uid = (uint32_t)geteuid();
	h->creator_pid = (uint32_t)getpid();
	h->creator_start = kvt_proc_start_time(getpid());
	if (!h->creator_start)
		h->creator_start = 1; /* no /proc here: diagnostics only */
	{
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		h->created_ns = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
	}
	h->policy = (c->flags & KVT_SEG_F_DEPTH_FIRST) ? KVT_POLICY_DEPTH_FIRST : 0;
	h->geo = g;
	memset(h->model, 0, sizeof(h->model));
	if (a && a->model)
		memcpy(h->model, a->model, strnlen(a->model, KVT_MODEL_TEXT - 1));
	h->seg_id = random_id();
	h->d = d;
	kvt__fingerprint(&g, &h->fingerprint);
	memcpy(h->regions, reg, sizeof(reg));
	h->checksum = kvt__hdr_checksum(h);

	s = calloc(1, sizeof(*s));
	if (!s) {
		r = kvt__err(-ENOMEM, "create: out of memory");
		goto out_unmap;
	}
	snprintf(s->name, sizeof(s->name), "%s", c->name);
	s->base = base;
	s->size = total;
	s->fd = fd;
	s->hdr = h;
	s->geo = g;
	s->d = d;
	memcpy(s->r, reg, sizeof(reg));
	handle_init_regions(s);

	if (c->prepare) {
		r = c->prepare(s, c->prepare_arg);
		if (r) {
			if (r > 0)
				r = -EIO;
			kvt__err(r, "create '%s': the prepare step failed: %s", c->name,
				 strerror(-r));
			goto out_unmap;
		}
	}
	r = reserve(fd, c->name, reg[KVT_R_ARENA].off, reg[KVT_R_ARENA].size, is_huge);
	if (r)
		goto out_unmap;
	if (c->flags & KVT_SEG_F_PREFAULT) {
		r = prefault(c->name, base + reg[KVT_R_ARENA].off, reg[KVT_R_ARENA].size, is_huge);
		if (r)
			goto out_unmap;
	}
	/* Our own entry, before anyone else can see the segment. */
	handle_register(s);
	r = attach_identity(s, a ? a : &client);
	if (r) {
		handle_unregister(s);
		goto out_unmap;
	}
	/* R0: publishes the header; pairs with A0 in kvt_seg_attach. */
	kat_store(&h->magic, KVT_MAGIC, KVT_REL);
	*out = s;
	return 0;
out_unmap:
	/* Unlink first: no process may find a half-made segment.  Nothing in
	 * the mapping is walked on this path. */
	(void)(is_shm ? shm_unlink(path) : unlink(path));
	munmap(base, total);
	close(fd);
	free(s);
	return r;
out_close:
	(void)(is_shm ? shm_unlink(path) : unlink(path));
	close(fd);
	return r;
}

int kvt_seg_lock_fd(const kvt_seg *s) { return s ? s->fd : -1; }

void kvt_seg_leave_to_reaper(kvt_seg *s)
{
	if (s)
		s->leave_to_reaper = 1;
}

int kvt_seg_detach(kvt_seg *s)
{
	if (!s)
		return kvt__err(-EINVAL, "detach: NULL handle");
	handle_unregister(s);
	/* Left to the reaper: no F_UNLCK, no EMPTY; closing our descriptor
	 * below drops the lock only if nothing else holds the description. */
	if (s->entry != UINT32_MAX && !s->leave_to_reaper)
		kvt__entry_release(s);
	/* after the release: W4 in witness.c */
	kvt__witness_stop(s);
	munmap(s->base, s->size);
	if (s->fd >= 0)
		close(s->fd);
	free(s);
	return 0;
}

const struct kvt_geometry *kvt_seg_geometry(const kvt_seg *s) { return &s->geo; }
void kvt_seg_fingerprint(const kvt_seg *s, kvt_key *out) { kvt__fingerprint(&s->geo, out); }
uint64_t kvt_seg_shard_bytes(const kvt_seg *s) { return s->d.shard_bytes; }
uint64_t kvt_seg_chunk_bytes(const kvt_seg *s) { return s->chunk_bytes; }
uint32_t kvt_seg_n_shards(const kvt_seg *s) { return s->d.n_shards; }
uint32_t kvt_seg_entry(const kvt_seg *s) { return s->entry; }
void *kvt_seg_base(const kvt_seg *s) { return s->base; }
uint64_t kvt_seg_size(const kvt_seg *s) { return s->size; }

int kvt_seg_arena(const kvt_seg *s, uint32_t shard, void **ptr, uint64_t *len)
{
	if (shard == UINT32_MAX) {
		*ptr = s->arena;
		*len = s->r[KVT_R_ARENA].size;
		return 0;
	}
	if (shard >= s->d.n_shards)
		return kvt__err(-EINVAL, "arena: shard %u out of range (%u shards)",
				shard, s->d.n_shards);
	*ptr = s->arena + (uint64_t)shard * s->d.shard_part;
	*len = s->d.shard_part;
	return 0;
}

void *kvt_slot_shard_ptr(const kvt_seg *s, uint32_t slot, uint32_t shard)
{
	if (slot >= s->geo.n_slots || shard >= s->d.n_shards)
		return NULL;
	return s->arena + (uint64_t)shard * s->d.shard_part +
	       (uint64_t)slot * s->d.shard_bytes;
}

static const char *const counter_names[KVT_C__COUNT] = {
	[KVT_C_LOOKUPS] = "lookups", [KVT_C_LOOKUP_CHUNKS] = "lookup_chunks",
	[KVT_C_HIT_CHUNKS] = "hit_chunks", [KVT_C_HIT_TOKENS] = "hit_tokens",
	[KVT_C_SAVED_CHUNKS] = "saved_chunks", [KVT_C_SAVE_SKIPS] = "save_skips",
	[KVT_C_SAVE_NOSPC] = "save_nospc", [KVT_C_LOADED_CHUNKS] = "loaded_chunks",
	[KVT_C_BYTES_SAVED] = "bytes_saved", [KVT_C_BYTES_LOADED] = "bytes_loaded",
	[KVT_C_EVICTIONS] = "evictions", [KVT_C_STALE_UNPINS] = "stale_unpins",
	[KVT_C_DOUBLE_UNPINS] = "double_unpins", [KVT_C_REAPED_RANKS] = "reaped_ranks",
	[KVT_C_FILL_ABORTS] = "fill_aborts", [KVT_C_FILL_TIMEOUTS] = "fill_timeouts",
	[KVT_C_LEASES_FULL] = "leases_full", [KVT_C_INDEX_FULL] = "index_full",
	[KVT_C_DISK_WRITES] = "disk_writes", [KVT_C_DISK_READS] = "disk_reads",
	[KVT_C_DMA_ERRORS] = "dma_errors", [KVT_C_LOST_CLAIMS] = "lost_claims",
	[KVT_C_PIN_REPAIRS] = "pin_repairs", [KVT_C_ADOPTED] = "adopted",
	[KVT_C_DISK_BYTES_WRITTEN] = "disk_bytes_written",
	[KVT_C_DISK_BYTES_READ] = "disk_bytes_read",
	[KVT_C_DISK_ADMIT_REJECTS] = "disk_admit_rejects",
	[KVT_C_DISK_CSUM_ERRORS] = "disk_checksum_errors",
	[KVT_C_DISK_EVICTIONS] = "disk_evictions",
	[KVT_C_DISK_WRITE_DROPS] = "disk_write_drops",
	[KVT_C_PROMOTE_REQUESTS] = "promote_requests",
	[KVT_C_PROMOTE_DROPS] = "promote_drops",
	[KVT_C_SHARED_HITS] = "shared_hits",
};

const char *kvt_counter_name(enum kvt_counter c)
{
	return (unsigned)c < KVT_C__COUNT ? counter_names[c] : "unknown";
}

void kvt_counter_add(kvt_seg *s, enum kvt_counter c, uint64_t v)
{
	if ((unsigned)c < KVT_C__COUNT)
		kvt__count(s, c, v);
}

void kvt_counters_read(const kvt_seg *s, uint64_t out[KVT_C__COUNT])
{
	memset(out, 0, sizeof(uint64_t) * KVT_C__COUNT);
	for (uint32_t b = 0; b <= s->d.n_entries; b++) {
		_Atomic uint64_t *blk = kvt__ctr(s, b);
		for (int c = 0; c < KVT_C__COUNT; c++)
			out[c] += kat_load(&blk[c], KVT_RLX); /* statistics */
	}
}

void kvt_occupancy_read(const kvt_seg *s, struct kvt_occupancy *o)
{
	memset(o, 0, sizeof(*o));
	for (uint32_t i = 0; i < s->geo.n_slots; i++) {
		uint64_t w = kat_load(&kvt__slot(s, i)->state, KVT_RLX); /* snapshot */
		switch (KVT_ST(w)) {
		case KVT_S_FREE: o->free++; break;
		case KVT_S_FILLING: case KVT_S_DOOMED: o->filling++; break;
		case KVT_S_READY: o->ready++; if (KVT_PINS(w)) o->pinned++; break;
		default: o->evicting++; break;
		}
	}
	for (uint32_t i = 0; i < s->geo.n_leases; i++)
		if (KVT_LST(kat_load(&kvt__lease(s, i)->state, KVT_RLX)) != KVT_L_FREE)
			o->leases_live++;
	for (uint32_t e = 0; e < s->d.n_entries; e++)
		if (KVT_OWNER_ST(kat_load(&s->ents[e].owner, KVT_RLX)) == KVT_ENT_ATTACHED &&
		    kvt__entry_alive(s, e))
			o->ranks_live++;
}
