/* lmc_wire.c - LMCache's multiprocess protocol on the wire (lmc_wire.h).
 *
 * Decoding is msgpack-c's (Debian libmsgpack-dev), behind a pre-scan of
 * our own: msgpack-c allocates an array or map of the size its header
 * declares before it reads an element, so a 5-byte frame declaring 2^32
 * elements asks for 64 GiB.  scan() walks the bytes first and refuses a
 * container that declares more elements than bytes remain (every element
 * takes at least one), nesting deeper than LMC_DEPTH, and trailing bytes.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "lmc_wire.h"

#define LMC_DEPTH 12

static const char *const op_names[LMC_OP_MAX] = {
	[LMC_OP_REGISTER_KV_CACHE] = "register_kv_cache",
	[LMC_OP_UNREGISTER_KV_CACHE] = "unregister_kv_cache",
	[3] = "register_q_cache",
	[4] = "unregister_q_cache",
	[5] = "store_q",
	[LMC_OP_STORE] = "store",
	[LMC_OP_RETRIEVE] = "retrieve",
	[LMC_OP_LOOKUP] = "lookup",
	[LMC_OP_QUERY_PREFETCH_STATUS] = "query_prefetch_status",
	[LMC_OP_WAIT_PREFETCH_STATUS] = "wait_prefetch_status",
	[LMC_OP_FREE_LOOKUP_LOCKS] = "free_lookup_locks",
	[LMC_OP_END_SESSION] = "end_session",
	[LMC_OP_REGISTER_ENGINE_DRIVEN] = "register_kv_cache_engine_driven_context",
	[LMC_OP_UNREGISTER_ENGINE_DRIVEN] = "unregister_kv_cache_engine_driven_context",
	[LMC_OP_PREPARE_STORE] = "prepare_store",
	[LMC_OP_COMMIT_STORE] = "commit_store",
	[LMC_OP_PREPARE_RETRIEVE] = "prepare_retrieve",
	[LMC_OP_COMMIT_RETRIEVE] = "commit_retrieve",
	[LMC_OP_CLEAR] = "clear",
	[LMC_OP_GET_CHUNK_SIZE] = "get_chunk_size",
	[LMC_OP_PING] = "ping",
	[LMC_OP_REPORT_BLOCK_ALLOCATION] = "report_block_allocation",
	[LMC_OP_NOOP] = "noop",
	[25] = "cb_register_rope",
	[26] = "cb_unregister_rope",
	[27] = "cb_retrieve_pre_computed",
	[28] = "cb_unified_lookup",
	[29] = "p2p_lookup_and_lock",
	[30] = "p2p_query_lookup_results",
	[31] = "p2p_unlock_objects",
	[LMC_OP_GET_EXPERIMENTAL] = "get_experimental",
	[33] = "cb_protocol_handshake",
};

/* LMCache 0.5.0 numbered its RequestType in enum order (protocols/
 * base.py), before register_q_cache and store_q came in; 0.5.5 and 0.5.6
 * number as the table above (frozen since).  For a refusal's words. */
static const char *const old_names[] = {
	NULL, "register_kv_cache", "unregister_kv_cache", "store", "retrieve", "lookup",
	"query_prefetch_status", "wait_prefetch_status", "query_prefetch_lookup_hits",
	"free_lookup_locks", "end_session", "register_kv_cache_engine_driven_context",
	"unregister_kv_cache_engine_driven_context", "prepare_store", "commit_store",
	"prepare_retrieve", "commit_retrieve", "clear", "get_chunk_size", "ping",
	"report_block_allocation", "noop",
};

const char *lmc_old_op_name(int op)
{
	static _Thread_local char buf[96];
	if (op <= 0 || op >= (int)(sizeof(old_names) / sizeof(old_names[0])))
		return NULL;
	snprintf(buf, sizeof(buf), " (in LMCache 0.5.0's numbering, #%d was %s)", op,
		 old_names[op]);
	return buf;
}

const char *lmc_op_name(int op)
{
	return op > 0 && op < LMC_OP_MAX ? op_names[op] : NULL;
}

int lmc_arity(int op)
{
	switch (op) {
	case LMC_OP_REGISTER_KV_CACHE: return 7;
	case LMC_OP_UNREGISTER_KV_CACHE: return 1;
	case LMC_OP_STORE: return 4;
	case LMC_OP_RETRIEVE: return 5;
	case LMC_OP_LOOKUP: return 2;
	case LMC_OP_QUERY_PREFETCH_STATUS: return 1;
	case LMC_OP_WAIT_PREFETCH_STATUS: return 2;
	case LMC_OP_FREE_LOOKUP_LOCKS: return 2;
	case LMC_OP_END_SESSION: return 1;
	case LMC_OP_CLEAR: return 1;
	case LMC_OP_GET_CHUNK_SIZE: return 0;
	case LMC_OP_PING: return 1;
	case LMC_OP_REPORT_BLOCK_ALLOCATION: return 3;
	case LMC_OP_NOOP: return 0;
	case LMC_OP_GET_EXPERIMENTAL: return 0;
	default: return -1;
	}
}

int lmc_wire_arity(int op)
{
	static const signed char n[LMC_OP_MAX] = {
		[3] = 7, [4] = 1, [5] = 4,
		[LMC_OP_REGISTER_ENGINE_DRIVEN] = 1, [LMC_OP_UNREGISTER_ENGINE_DRIVEN] = 1,
		[LMC_OP_PREPARE_STORE] = 2, [LMC_OP_COMMIT_STORE] = 3,
		[LMC_OP_PREPARE_RETRIEVE] = 2, [LMC_OP_COMMIT_RETRIEVE] = 2,
		[25] = 8, [26] = 1, [27] = 5, [28] = 2, [29] = 2, [30] = 1, [31] = 1, [33] = 1,
	};
	if (lmc_arity(op) >= 0)
		return lmc_arity(op);
	return op > 0 && op < LMC_OP_MAX && op_names[op] ? n[op] : -1;
}

static const struct { const char *name; uint32_t size; } dtypes[] = {
	{ "float16", 2 }, { "bfloat16", 2 }, { "float32", 4 }, { "float64", 8 },
	{ "uint8", 1 }, { "int8", 1 }, { "float8_e4m3fn", 1 }, { "float8_e5m2", 1 },
	{ "float8_e4m3fnuz", 1 }, { "float8_e5m2fnuz", 1 }, { "int16", 2 },
	{ "int32", 4 }, { "int64", 8 },
};

uint32_t lmc_dtype_size(const char *dtype)
{
	for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
		if (!strcmp(dtype, dtypes[i].name))
			return dtypes[i].size;
	return 0;
}

/* ---- the pre-scan ---- */

static uint64_t be(const unsigned char *p, int n)
{
	uint64_t v = 0;
	for (int i = 0; i < n; i++)
		v = v << 8 | p[i];
	return v;
}

/* Skips one object; -1 when it is malformed, truncated or out of bounds. */
static int scan(const unsigned char **pp, const unsigned char *end, int depth)
{
	const unsigned char *p = *pp;
	uint64_t n = 0, elems = 0;
	unsigned c;

	if (depth > LMC_DEPTH || p >= end)
		return -1;
	c = *p++;
	if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) {
		/* fixint, nil, bool */
	} else if ((c & 0xf0) == 0x80) {
		elems = 2ull * (c & 0x0f);
	} else if ((c & 0xf0) == 0x90) {
		elems = c & 0x0f;
	} else if ((c & 0xe0) == 0xa0) {
		n = c & 0x1f;
	} else {
		switch (c) {
		case 0xcc: case 0xd0: n = 1; break;
		case 0xcd: case 0xd1: n = 2; break;
		case 0xca: case 0xce: case 0xd2: n = 4; break;
		case 0xcb: case 0xcf: case 0xd3: n = 8; break;
		case 0xc4: case 0xd9: case 0xc7:
			if (end - p < 1) return -1;
			n = be(p, 1) + (c == 0xc7); p += 1; break;
		case 0xc5: case 0xda: case 0xc8:
			if (end - p < 2) return -1;
			n = be(p, 2) + (c == 0xc8); p += 2; break;
		case 0xc6: case 0xdb: case 0xc9:
			if (end - p < 4) return -1;
			n = be(p, 4) + (c == 0xc9); p += 4; break;
		case 0xd4: n = 2; break;
		case 0xd5: n = 3; break;
		case 0xd6: n = 5; break;
		case 0xd7: n = 9; break;
		case 0xd8: n = 17; break;
		case 0xdc:
			if (end - p < 2) return -1;
			elems = be(p, 2); p += 2; break;
		case 0xdd:
			if (end - p < 4) return -1;
			elems = be(p, 4); p += 4; break;
		case 0xde:
			if (end - p < 2) return -1;
			elems = 2 * be(p, 2); p += 2; break;
		case 0xdf:
			if (end - p < 4) return -1;
			elems = 2 * be(p, 4); p += 4; break;
		default:
			return -1; /* 0xc1: never used */
		}
	}
	if (n > (uint64_t)(end - p) || elems > (uint64_t)(end - p))
		return -1;
	p += n;
	for (uint64_t i = 0; i < elems; i++)
		if (scan(&p, end, depth + 1))
			return -1;
	*pp = p;
	return 0;
}

/* ---- decoding ---- */

struct dec {
	char *why;
	size_t why_len;
};

static int fail(struct dec *d, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(struct dec *d, int err, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(d->why, d->why_len, fmt, ap);
	va_end(ap);
	return err;
}

/* One frame, exactly one object: 0 with *u holding it. */
static int unpack(struct dec *d, const void *p, size_t n, msgpack_unpacked *u, const char *what)
{
	const unsigned char *q = p, *end = q + n;
	size_t off = 0;

	if (n > LMC_MAX_FRAME)
		return fail(d, -E2BIG, "%s: a %zu-byte frame (at most %u)", what, n, LMC_MAX_FRAME);
	if (scan(&q, end, 0) || q != end)
		return fail(d, -EPROTO, "%s: not one well-formed msgpack object", what);
	msgpack_unpacked_init(u);
	if (msgpack_unpack_next(u, p, n, &off) != MSGPACK_UNPACK_SUCCESS || off != n) {
		msgpack_unpacked_destroy(u);
		return fail(d, -EPROTO, "%s: not one msgpack object", what);
	}
	return 0;
}

static int get_u64(struct dec *d, const msgpack_object *o, const char *what, uint64_t max,
		   uint64_t *out)
{
	if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
		return fail(d, -EPROTO, "%s: not a non-negative integer", what);
	if (o->via.u64 > max)
		return fail(d, -E2BIG, "%s: %llu is above %llu", what,
			    (unsigned long long)o->via.u64, (unsigned long long)max);
	*out = o->via.u64;
	return 0;
}

static int get_u32(struct dec *d, const msgpack_object *o, const char *what, uint32_t max,
		   uint32_t *out)
{
	uint64_t v = 0;
	int r = get_u64(d, o, what, max, &v);
	if (!r)
		*out = (uint32_t)v;
	return r;
}

static int get_i64(struct dec *d, const msgpack_object *o, const char *what, int64_t *out)
{
	if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
		*out = o->via.i64;
		return 0;
	}
	if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX) {
		*out = (int64_t)o->via.u64;
		return 0;
	}
	return fail(d, -EPROTO, "%s: not an integer", what);
}

static int get_str(struct dec *d, const msgpack_object *o, const char *what, char *out,
		   size_t cap)
{
	if (o->type != MSGPACK_OBJECT_STR)
		return fail(d, -EPROTO, "%s: not a string", what);
	if (o->via.str.size >= cap)
		return fail(d, -E2BIG, "%s: %u bytes (at most %zu)", what, o->via.str.size, cap - 1);
	if (o->via.str.size && memchr(o->via.str.ptr, 0, o->via.str.size))
		return fail(d, -EPROTO, "%s: holds a NUL byte", what);
	if (o->via.str.size) /* (an empty one's ptr may be NULL) */
		memcpy(out, o->via.str.ptr, o->via.str.size);
	out[o->via.str.size] = 0;
	return 0;
}

static int key_is(const msgpack_object_kv *kv, const char *name)
{
	size_t n = strlen(name);
	return kv->key.type == MSGPACK_OBJECT_STR && kv->key.via.str.size == n &&
	       !memcmp(kv->key.via.str.ptr, name, n);
}

static const msgpack_object *field(const msgpack_object *map, const char *name)
{
	for (uint32_t i = 0; i < map->via.map.size; i++)
		if (key_is(&map->via.map.ptr[i], name))
			return &map->via.map.ptr[i].val;
	return NULL;
}

static int need_map(struct dec *d, const msgpack_object *o, const char *what)
{
	if (o->type != MSGPACK_OBJECT_MAP)
		return fail(d, -EPROTO, "%s: not a map", what);
	return 0;
}

static const msgpack_object *required(struct dec *d, const msgpack_object *map,
				      const char *what, const char *name, int *err)
{
	const msgpack_object *v = field(map, name);
	if (!v)
		*err = fail(d, -EPROTO, "%s: no field '%s'", what, name);
	return v;
}

/* IPCCacheServerKey. */
static int dec_key(struct dec *d, const msgpack_object *o, struct lmc_key *k)
{
	const msgpack_object *v = NULL;
	int r = 0;

	memset(k, 0, sizeof(*k));
	if ((r = need_map(d, o, "key")))
		return r;
	if (!(v = required(d, o, "key", "model_name", &r)) ||
	    (r = get_str(d, v, "key.model_name", k->model, sizeof(k->model))))
		return r;
	if (!(v = required(d, o, "key", "world_size", &r)) ||
	    (r = get_u32(d, v, "key.world_size", 1u << 16, &k->world)))
		return r;
	if (!(v = required(d, o, "key", "worker_id", &r)))
		return r;
	if (v->type == MSGPACK_OBJECT_NIL) {
		k->worker = -1;
	} else {
		uint32_t w;
		if ((r = get_u32(d, v, "key.worker_id", 1u << 16, &w)))
			return r;
		k->worker = (int32_t)w;
	}
	if (!(v = required(d, o, "key", "start", &r)) ||
	    (r = get_u64(d, v, "key.start", LMC_MAX_TOKENS, &k->start)))
		return r;
	if (!(v = required(d, o, "key", "end", &r)) ||
	    (r = get_u64(d, v, "key.end", LMC_MAX_TOKENS, &k->end)))
		return r;
	if (!(v = required(d, o, "key", "request_id", &r)) ||
	    (r = get_str(d, v, "key.request_id", k->request_id, sizeof(k->request_id))))
		return r;
	if ((v = field(o, "cache_salt")) &&
	    (r = get_str(d, v, "key.cache_salt", k->salt, 129)))
		return r;
	if ((v = field(o, "num_kv_readers")) &&
	    (r = get_u32(d, v, "key.num_kv_readers", 1u << 16, &k->readers)))
		return r;
	if (!(v = required(d, o, "key", "token_ids", &r)))
		return r;
	if (v->type != MSGPACK_OBJECT_ARRAY)
		return fail(d, -EPROTO, "key.token_ids: not an array");
	if (v->via.array.size > LMC_MAX_TOKENS)
		return fail(d, -E2BIG, "key.token_ids: %u tokens (at most %u)",
			    v->via.array.size, LMC_MAX_TOKENS);
	k->n_tokens = v->via.array.size;
	k->tokens = malloc((k->n_tokens ? k->n_tokens : 1) * sizeof(uint32_t));
	if (!k->tokens)
		return fail(d, -ENOMEM, "key.token_ids: out of memory");
	for (uint32_t i = 0; i < k->n_tokens; i++) {
		const msgpack_object *t = &v->via.array.ptr[i];
		if (t->type != MSGPACK_OBJECT_POSITIVE_INTEGER || t->via.u64 > UINT32_MAX) {
			free(k->tokens);
			k->tokens = NULL;
			return fail(d, -EPROTO, "key.token_ids[%u]: not a token id (0..2^32-1)", i);
		}
		k->tokens[i] = (uint32_t)t->via.u64;
	}
	return 0;
}

static int dec_u64_list(struct dec *d, const msgpack_object *o, const char *what,
			uint32_t max_n, uint64_t max_v, uint64_t *out, uint32_t *n)
{
	int r;
	if (o->type != MSGPACK_OBJECT_ARRAY)
		return fail(d, -EPROTO, "%s: not an array", what);
	if (o->via.array.size > max_n)
		return fail(d, -E2BIG, "%s: %u entries (at most %u)", what, o->via.array.size, max_n);
	for (uint32_t i = 0; i < o->via.array.size; i++)
		if ((r = get_u64(d, &o->via.array.ptr[i], what, max_v, &out[i])))
			return r;
	*n = o->via.array.size;
	return 0;
}

static int get_bin(struct dec *d, const msgpack_object *o, const char *what, uint8_t *out,
		   uint32_t *len)
{
	if (o->type != MSGPACK_OBJECT_BIN)
		return fail(d, -EPROTO, "%s: not bytes", what);
	if (o->via.bin.size > LMC_MAX_HANDLE)
		return fail(d, -E2BIG, "%s: %u bytes (at most %u)", what, o->via.bin.size,
			    LMC_MAX_HANDLE);
	if (o->via.bin.size)
		memcpy(out, o->via.bin.ptr, o->via.bin.size);
	*len = o->via.bin.size;
	return 0;
}

/* torch's _share_cuda_() tuple (ipc_wire.py's CudaIPCData.handle):
 * (device, handle, size_bytes, offset_bytes, ref_counter_handle,
 * ref_counter_offset, event_handle, event_sync_required). */
static int dec_cuda_handle(struct dec *d, const msgpack_object *h, struct lmc_tensor *t)
{
	const msgpack_object *a;
	int r;

	if (h->type != MSGPACK_OBJECT_ARRAY || h->via.array.size != 8)
		return fail(d, -EPROTO, "kv_cache[].handle: not torch's 8-tuple");
	a = h->via.array.ptr;
	if (a[1].type != MSGPACK_OBJECT_NIL &&
	    (r = get_bin(d, &a[1], "kv_cache[].handle[1]", t->ipc, &t->ipc_len)))
		return r;
	if ((r = get_u64(d, &a[2], "kv_cache[].handle[2]", UINT64_MAX / 4, &t->ipc_bytes)) ||
	    (r = get_u64(d, &a[3], "kv_cache[].handle[3]", UINT64_MAX / 4, &t->ipc_offset)))
		return r;
	if (a[7].type != MSGPACK_OBJECT_BOOLEAN)
		return fail(d, -EPROTO, "kv_cache[].handle[7]: not a bool");
	if (a[7].via.boolean && a[6].type != MSGPACK_OBJECT_NIL)
		return get_bin(d, &a[6], "kv_cache[].handle[6]", t->ipc_event, &t->ipc_event_len);
	return 0;
}

/* One DeviceIPCWrapper: ext type 1 holding a tagged map. */
static int dec_tensor(struct dec *d, const msgpack_object *o, uint32_t i, struct lmc_tensor *t)
{
	msgpack_unpacked u;
	const msgpack_object *m, *v = NULL, *md = NULL;
	char what[48];
	uint32_t ns = 0;
	int r = 0;

	snprintf(what, sizeof(what), "kv_cache[%u]", i);
	if (o->type != MSGPACK_OBJECT_EXT || o->via.ext.type != 1)
		return fail(d, -EPROTO, "%s: not a DeviceIPCWrapper (msgpack ext type 1)", what);
	if ((r = unpack(d, o->via.ext.ptr, o->via.ext.size, &u, what)))
		return r;
	m = &u.data;
	memset(t, 0, sizeof(*t));
	if ((r = need_map(d, m, what)))
		goto out;
	if (!(v = required(d, m, what, "type", &r)) ||
	    (r = get_str(d, v, "kv_cache[].type", t->type, sizeof(t->type))))
		goto out;
	if (!(v = required(d, m, what, "version", &r)))
		goto out;
	if (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER || v->via.u64 != 1) {
		r = fail(d, -EPROTO, "%s: descriptor version is not 1", what);
		goto out;
	}
	if ((v = field(m, "shm_name")) &&
	    (r = get_str(d, v, "kv_cache[].shm_name", t->shm_name, sizeof(t->shm_name))))
		goto out;
	if ((v = field(m, "nbytes")) &&
	    (r = get_u64(d, v, "kv_cache[].nbytes", UINT64_MAX / 2, &t->nbytes)))
		goto out;
	if (!strcmp(t->type, "cuda") && (v = field(m, "handle")) &&
	    (r = dec_cuda_handle(d, v, t)))
		goto out;
	if (!strcmp(t->type, "cuda_raw")) {
		if ((v = field(m, "ipc_handle")) &&
		    (r = get_bin(d, v, "kv_cache[].ipc_handle", t->ipc, &t->ipc_len)))
			goto out;
		if ((v = field(m, "alloc_offset")) &&
		    (r = get_u64(d, v, "kv_cache[].alloc_offset", UINT64_MAX / 4, &t->ipc_offset)))
			goto out;
		t->ipc_bytes = t->nbytes;
	}
	if (!(md = required(d, m, what, "metadata", &r)) || (r = need_map(d, md, what)))
		goto out;
	if (!(v = required(d, md, what, "dtype", &r)) ||
	    (r = get_str(d, v, "kv_cache[].metadata.dtype", t->dtype, sizeof(t->dtype))))
		goto out;
	if (!(v = required(d, md, what, "shape", &r)) ||
	    (r = dec_u64_list(d, v, "kv_cache[].metadata.shape", LMC_MAX_DIMS, 1ull << 40,
			      t->shape, &t->ndim)))
		goto out;
	if (!(v = required(d, md, what, "stride", &r)) ||
	    (r = dec_u64_list(d, v, "kv_cache[].metadata.stride", LMC_MAX_DIMS, 1ull << 40,
			      t->stride, &ns)))
		goto out;
	if (ns != t->ndim) {
		r = fail(d, -EPROTO, "%s: %u strides for %u dimensions", what, ns, t->ndim);
		goto out;
	}
	if (!(v = required(d, md, what, "storage_offset", &r)) ||
	    (r = get_u64(d, v, "kv_cache[].metadata.storage_offset", 1ull << 40,
			 &t->storage_offset)))
		goto out;
	if ((v = field(md, "device_uuid")) &&
	    (r = get_str(d, v, "kv_cache[].metadata.device_uuid", t->device_uuid,
			 sizeof(t->device_uuid))))
		goto out;
out:
	msgpack_unpacked_destroy(&u);
	return r;
}

static int dec_register(struct dec *d, const msgpack_object *const *p, struct lmc_register *g)
{
	const msgpack_object *o, *v = NULL;
	int r;

	memset(g, 0, sizeof(*g));
	if ((r = get_u64(d, p[0], "instance_id", UINT64_MAX, &g->instance_id)))
		return r;
	o = p[1];
	if (o->type != MSGPACK_OBJECT_ARRAY)
		return fail(d, -EPROTO, "kv_cache: not an array");
	if (!o->via.array.size || o->via.array.size > LMC_MAX_LAYERS)
		return fail(d, -E2BIG, "kv_cache: %u tensors (1..%u)", o->via.array.size,
			    LMC_MAX_LAYERS);
	g->tensors = calloc(o->via.array.size, sizeof(*g->tensors));
	if (!g->tensors)
		return fail(d, -ENOMEM, "kv_cache: out of memory");
	g->n_tensors = o->via.array.size;
	for (uint32_t i = 0; i < g->n_tensors; i++)
		if ((r = dec_tensor(d, &o->via.array.ptr[i], i, &g->tensors[i])))
			return r;
	if ((r = get_str(d, p[2], "model_name", g->model, sizeof(g->model))) ||
	    (r = get_u32(d, p[3], "world_size", 1u << 16, &g->world)) ||
	    (r = get_str(d, p[4], "engine_type", g->engine, sizeof(g->engine))))
		return r;
	o = p[5];
	if ((r = need_map(d, o, "layout_hints")))
		return r;
	if ((v = field(o, "kv_layout")) &&
	    (r = get_str(d, v, "layout_hints.kv_layout", g->kv_layout, sizeof(g->kv_layout))))
		return r;
	if ((v = field(o, "kv_list_layout")) &&
	    (r = get_str(d, v, "layout_hints.kv_list_layout", g->kv_list_layout,
			 sizeof(g->kv_list_layout))))
		return r;
	if ((v = field(o, "tokens_per_block")) &&
	    (r = get_u32(d, v, "layout_hints.tokens_per_block", 1u << 20,
			 &g->hint_tokens_per_block)))
		return r;
	o = p[6];
	if (o->type != MSGPACK_OBJECT_ARRAY)
		return fail(d, -EPROTO, "engine_group_infos: not an array");
	if (o->via.array.size > LMC_MAX_GROUPS)
		return fail(d, -E2BIG, "engine_group_infos: %u groups (at most %u)",
			    o->via.array.size, LMC_MAX_GROUPS);
	g->n_groups = o->via.array.size;
	for (uint32_t i = 0; i < g->n_groups; i++) {
		const msgpack_object *e = &o->via.array.ptr[i];
		struct lmc_group_info *gi = &g->groups[i];
		if ((r = need_map(d, e, "engine_group_infos[]")))
			return r;
		gi->sw_size_tokens = -1;
		if ((v = field(e, "tokens_per_block")) &&
		    (r = get_u32(d, v, "engine_group_infos[].tokens_per_block", 1u << 20,
				 &gi->tokens_per_block)))
			return r;
		if ((v = field(e, "sw_size_tokens")) &&
		    (r = get_i64(d, v, "engine_group_infos[].sw_size_tokens", &gi->sw_size_tokens)))
			return r;
		if ((v = field(e, "layer_indices"))) {
			if (v->type != MSGPACK_OBJECT_ARRAY)
				return fail(d, -EPROTO, "engine_group_infos[].layer_indices: "
					    "not an array");
			gi->n_layers = v->via.array.size;
		}
		if ((v = field(e, "recurrent_state")))
			gi->recurrent = v->type == MSGPACK_OBJECT_BOOLEAN && v->via.boolean;
	}
	return 0;
}

static int dec_blocks(struct dec *d, const msgpack_object *o, struct lmc_blocks *b)
{
	if (o->type != MSGPACK_OBJECT_ARRAY)
		return fail(d, -EPROTO, "block_ids: not an array");
	if (!o->via.array.size || o->via.array.size > LMC_MAX_GROUPS)
		return fail(d, -E2BIG, "block_ids: %u lists (1..%u)", o->via.array.size,
			    LMC_MAX_GROUPS);
	b->n_groups = o->via.array.size;
	for (uint32_t g = 0; g < b->n_groups; g++) {
		const msgpack_object *l = &o->via.array.ptr[g];
		if (l->type != MSGPACK_OBJECT_ARRAY)
			return fail(d, -EPROTO, "block_ids[%u]: not an array", g);
		if (l->via.array.size > LMC_MAX_BLOCKS)
			return fail(d, -E2BIG, "block_ids[%u]: %u ids (at most %u)", g,
				    l->via.array.size, LMC_MAX_BLOCKS);
		b->n[g] = l->via.array.size;
		b->ids[g] = malloc((b->n[g] ? b->n[g] : 1) * sizeof(uint32_t));
		if (!b->ids[g])
			return fail(d, -ENOMEM, "block_ids: out of memory");
		for (uint32_t i = 0; i < b->n[g]; i++) {
			const msgpack_object *t = &l->via.array.ptr[i];
			if (t->type != MSGPACK_OBJECT_POSITIVE_INTEGER || t->via.u64 >= UINT32_MAX)
				return fail(d, -EPROTO, "block_ids[%u][%u]: not a block id", g, i);
			b->ids[g][i] = (uint32_t)t->via.u64;
		}
	}
	return 0;
}

int lmc_decode_op(const void *p, size_t n, struct lmc_opname *op)
{
	msgpack_unpacked u;
	struct dec d;
	char why[8];
	int r = -EINVAL;

	d.why = why;
	d.why_len = sizeof(why);
	memset(op, 0, sizeof(*op));
	if (unpack(&d, p, n, &u, "op"))
		return -EINVAL;
	if (u.data.type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
		uint64_t v = u.data.via.u64;
		const char *name = v < LMC_OP_MAX ? op_names[v] : NULL;
		op->id = name ? (int)v : LMC_OP_UNKNOWN;
		if (name)
			snprintf(op->name, sizeof(op->name), "%s", name);
		else
			snprintf(op->name, sizeof(op->name), "#%llu", (unsigned long long)v);
		r = 0;
	} else if (u.data.type == MSGPACK_OBJECT_STR && u.data.via.str.size &&
		   u.data.via.str.size < sizeof(op->name) &&
		   !memchr(u.data.via.str.ptr, 0, u.data.via.str.size)) {
		memcpy(op->name, u.data.via.str.ptr, u.data.via.str.size);
		op->name[u.data.via.str.size] = 0;
		op->id = LMC_OP_UNKNOWN;
		for (int i = 1; i < LMC_OP_MAX; i++)
			if (op_names[i] && !strcmp(op_names[i], op->name))
				op->id = i;
		r = 0;
	}
	msgpack_unpacked_destroy(&u);
	return r;
}

void lmc_req_free(struct lmc_req *req)
{
	free(req->key.tokens);
	free(req->reg.tensors);
	for (uint32_t g = 0; g < LMC_MAX_GROUPS; g++)
		free(req->blocks.ids[g]);
	memset(req, 0, sizeof(*req));
}

int lmc_decode(const struct lmc_opname *op, const void *const *frames, const size_t *lens,
	       size_t n, struct lmc_req *req, char *why, size_t why_len)
{
	msgpack_unpacked u[8];
	const msgpack_object *p[8] = { 0 };
	struct dec d = { why, why_len };
	int arity = lmc_arity(op->id), r = 0;
	size_t done = 0;

	memset(req, 0, sizeof(*req));
	req->op = *op;
	if (why_len)
		why[0] = 0;
	if (arity < 0)
		return fail(&d, -EPROTO, "operation '%s' is not served", op->name);
	if (n != (size_t)arity)
		return fail(&d, -EPROTO, "'%s' takes %d payload frames in this protocol, the "
			    "client sent %zu", op->name, arity, n);
	for (; done < n; done++) {
		char what[96];
		snprintf(what, sizeof(what), "%s payload %zu", op->name, done);
		if ((r = unpack(&d, frames[done], lens[done], &u[done], what)))
			goto out;
		p[done] = &u[done].data;
	}
	switch (op->id) {
	case LMC_OP_REGISTER_KV_CACHE:
		r = dec_register(&d, p, &req->reg);
		break;
	case LMC_OP_UNREGISTER_KV_CACHE:
		r = get_u64(&d, p[0], "instance_id", UINT64_MAX, &req->instance_id);
		break;
	case LMC_OP_STORE:
	case LMC_OP_RETRIEVE:
		if ((r = dec_key(&d, p[0], &req->key)) ||
		    (r = get_u64(&d, p[1], "instance_id", UINT64_MAX, &req->instance_id)) ||
		    (r = dec_blocks(&d, p[2], &req->blocks)))
			break;
		if ((r = get_bin(&d, p[3], "event_ipc_handle", req->event, &req->event_len)))
			break;
		if (op->id == LMC_OP_RETRIEVE)
			r = get_u64(&d, p[4], "skip_first_n_tokens", LMC_MAX_TOKENS,
				    &req->skip_tokens);
		break;
	case LMC_OP_LOOKUP:
	case LMC_OP_FREE_LOOKUP_LOCKS:
		r = dec_key(&d, p[0], &req->key);
		break;
	case LMC_OP_QUERY_PREFETCH_STATUS:
	case LMC_OP_END_SESSION:
		r = get_str(&d, p[0], "request_id", req->request_id, sizeof(req->request_id));
		break;
	case LMC_OP_WAIT_PREFETCH_STATUS:
		if ((r = get_str(&d, p[0], "request_id", req->request_id,
				 sizeof(req->request_id))))
			break;
		if (p[1]->type == MSGPACK_OBJECT_FLOAT64 || p[1]->type == MSGPACK_OBJECT_FLOAT32)
			req->timeout_s = p[1]->via.f64;
		else if (p[1]->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
			req->timeout_s = (double)p[1]->via.u64;
		else
			r = fail(&d, -EPROTO, "timeout: not a number");
		if (!r && !(req->timeout_s >= 0 && req->timeout_s < 1e6))
			r = fail(&d, -EPROTO, "timeout: not 0..1e6 seconds");
		break;
	case LMC_OP_CLEAR:
		req->force = p[0]->type == MSGPACK_OBJECT_BOOLEAN ? p[0]->via.boolean :
			     (p[0]->type == MSGPACK_OBJECT_POSITIVE_INTEGER && p[0]->via.u64);
		break;
	case LMC_OP_PING:
		if (p[0]->type == MSGPACK_OBJECT_NIL)
			req->instance_nil = 1;
		else
			r = get_u64(&d, p[0], "instance_id", UINT64_MAX, &req->instance_id);
		break;
	case LMC_OP_REPORT_BLOCK_ALLOCATION:
		r = get_u64(&d, p[0], "instance_id", UINT64_MAX, &req->instance_id);
		break;
	default:
		break;
	}
out:
	for (size_t i = 0; i < done; i++)
		msgpack_unpacked_destroy(&u[i]);
	if (r)
		lmc_req_free(req);
	return r;
}

/* ---- encoding ---- */

struct out {
	char *p;
	size_t cap, len;
	int err;
};

static int out_write(void *data, const char *buf, size_t len)
{
	struct out *o = data;
	if (o->len + len > o->cap) {
		o->err = 1;
		return -1;
	}
	memcpy(o->p + o->len, buf, len);
	o->len += len;
	return 0;
}

static void enc_init(struct out *o, msgpack_packer *pk, void *buf, size_t cap)
{
	o->p = buf;
	o->cap = cap;
	o->len = 0;
	o->err = 0;
	msgpack_packer_init(pk, o, out_write);
}

static int enc_done(const struct out *o)
{
	return o->err ? -ENOSPC : (int)o->len;
}

int lmc_enc_uint(void *buf, size_t cap, uint64_t v)
{
	struct out o;
	msgpack_packer pk;
	enc_init(&o, &pk, buf, cap);
	msgpack_pack_uint64(&pk, v);
	return enc_done(&o);
}

int lmc_enc_bool(void *buf, size_t cap, int v)
{
	struct out o;
	msgpack_packer pk;
	enc_init(&o, &pk, buf, cap);
	if (v)
		msgpack_pack_true(&pk);
	else
		msgpack_pack_false(&pk);
	return enc_done(&o);
}

int lmc_enc_nil(void *buf, size_t cap)
{
	struct out o;
	msgpack_packer pk;
	enc_init(&o, &pk, buf, cap);
	msgpack_pack_nil(&pk);
	return enc_done(&o);
}

static void pack_str(msgpack_packer *pk, const char *s)
{
	size_t n = strlen(s);
	msgpack_pack_str(pk, n);
	msgpack_pack_str_body(pk, s, n);
}

int lmc_enc_str(void *buf, size_t cap, const char *s)
{
	struct out o;
	msgpack_packer pk;
	enc_init(&o, &pk, buf, cap);
	pack_str(&pk, s);
	return enc_done(&o);
}

int lmc_enc_str_array(void *buf, size_t cap, const char *const *s, size_t n)
{
	struct out o;
	msgpack_packer pk;
	enc_init(&o, &pk, buf, cap);
	msgpack_pack_array(&pk, n);
	for (size_t i = 0; i < n; i++)
		pack_str(&pk, s[i]);
	return enc_done(&o);
}

int lmc_enc_handle_ok(void *buf, size_t cap, const void *handle, size_t hlen, int ok)
{
	struct out o;
	msgpack_packer pk;
	enc_init(&o, &pk, buf, cap);
	msgpack_pack_array(&pk, 2);
	msgpack_pack_bin(&pk, hlen);
	msgpack_pack_bin_body(&pk, handle, hlen);
	if (ok)
		msgpack_pack_true(&pk);
	else
		msgpack_pack_false(&pk);
	return enc_done(&o);
}
