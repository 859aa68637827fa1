/* lmc_wire.h - LMCache's multiprocess protocol on the wire (LMCache
 * 0.5.6's `lmcache.v1.multiprocess`, ZeroMQ transport): the frames a
 * client's DEALER sends, decoded into bounded C structs, and the reply
 * payloads kvtierd's front end (lmc.c) sends back.
 *
 * A request at the ROUTER is [identity, uid, op, payload...]: uid a
 * msgpack unsigned int (echoed back as sent), op a msgpack int (the
 * frozen legacy table of transport/zmq_impl/wire.py) or str (the
 * operation's name), one msgpack object per parameter of the RPC in
 * declaration order, every default filled in: the frame count is fixed
 * per RPC, and is how a client of another protocol version shows itself
 * (lmc_check_arity).  A reply is [identity, uid, op] plus one payload
 * frame when the result is not None.
 *
 * Everything here is pure (no sockets, no segment): the fuzz target
 * (tests/fuzz/fuzz_lmc.c) drives lmc_decode with arbitrary frames.  Every
 * length, count and integer is checked against the bounds below before it
 * is stored; a value out of bounds is refused with a message naming the
 * field, never truncated.
 */
#ifndef KVTD_LMC_WIRE_H
#define KVTD_LMC_WIRE_H

#include <stddef.h>
#include <stdint.h>

/* The protocol this front end speaks: LMCache 0.5.6's.  Named in every
 * refusal. */
#define LMC_PROTOCOL "LMCache 0.5.6 multiprocess (ZeroMQ)"

enum lmc_op {
	LMC_OP_UNKNOWN = 0,
	LMC_OP_REGISTER_KV_CACHE = 1,
	LMC_OP_UNREGISTER_KV_CACHE = 2,
	LMC_OP_STORE = 6,
	LMC_OP_RETRIEVE = 7,
	LMC_OP_LOOKUP = 8,
	LMC_OP_QUERY_PREFETCH_STATUS = 9,
	LMC_OP_WAIT_PREFETCH_STATUS = 10,
	LMC_OP_FREE_LOOKUP_LOCKS = 12,
	LMC_OP_END_SESSION = 13,
	LMC_OP_REGISTER_ENGINE_DRIVEN = 14,
	LMC_OP_UNREGISTER_ENGINE_DRIVEN = 15,
	LMC_OP_PREPARE_STORE = 16,
	LMC_OP_COMMIT_STORE = 17,
	LMC_OP_PREPARE_RETRIEVE = 18,
	LMC_OP_COMMIT_RETRIEVE = 19,
	LMC_OP_CLEAR = 20,
	LMC_OP_GET_CHUNK_SIZE = 21,
	LMC_OP_PING = 22,
	LMC_OP_REPORT_BLOCK_ALLOCATION = 23,
	LMC_OP_NOOP = 24,
	LMC_OP_GET_EXPERIMENTAL = 32,
	LMC_OP_MAX = 34,
};

#define LMC_MAX_NAME     256      /* model names, request ids, shm names */
#define LMC_MAX_TOKENS   (1u << 21) /* a prompt's token ids */
#define LMC_MAX_LAYERS   1024     /* KV tensors one registration gives */
#define LMC_MAX_DIMS     8
#define LMC_MAX_GROUPS   8        /* engine groups (block_ids' lists) */
#define LMC_MAX_BLOCKS   (1u << 21) /* block ids in one list */
#define LMC_MAX_FRAME    (64u << 20)
#define LMC_MAX_HANDLE   128      /* a GPU IPC handle's bytes (torch's: 66) */

/* The operation frame: its id (LMC_OP_UNKNOWN for one this front end does
 * not know) and its name (the table's, or the string sent). */
struct lmc_opname {
	int id;
	char name[64];
};

/* IPCCacheServerKey (custom_types.py): a map keyed by field name. */
struct lmc_key {
	char model[LMC_MAX_NAME];
	char request_id[LMC_MAX_NAME];
	char salt[LMC_MAX_NAME];
	uint32_t world;
	int32_t worker;          /* -1: nil (a scheduler's key) */
	uint32_t readers;        /* num_kv_readers; 0: not sent (an older client) */
	uint64_t start, end;
	uint32_t n_tokens;
	uint32_t *tokens;        /* owned */
};

/* One KV tensor of register_kv_cache: msgpack ext type 1 around a tagged
 * map (platform/base/ipc_wire.py). */
struct lmc_tensor {
	char type[16];           /* "cpu_shm", "cuda", "cuda_raw", ... */
	char shm_name[LMC_MAX_NAME];
	char dtype[24];
	uint64_t nbytes;
	uint32_t ndim;
	uint64_t shape[LMC_MAX_DIMS], stride[LMC_MAX_DIMS];
	uint64_t storage_offset;
	char device_uuid[64];    /* metadata.device_uuid */
	/* GPU descriptors, as sent (lmc.c reads them):
	 *  cuda:     torch's _share_cuda_() tuple -- handle[1] the storage's
	 *            allocation handle, handle[2] the storage's bytes,
	 *            handle[3] its offset in the allocation, handle[6] an
	 *            event to wait for when handle[7] says so;
	 *  cuda_raw: ipc_handle, alloc_offset, nbytes. */
	uint8_t ipc[LMC_MAX_HANDLE];
	uint32_t ipc_len;        /* 0: none */
	uint64_t ipc_offset;     /* the bytes' offset in the allocation */
	uint64_t ipc_bytes;      /* their length */
	uint8_t ipc_event[LMC_MAX_HANDLE];
	uint32_t ipc_event_len;  /* 0: none, or not required (handle[7] false) */
};

struct lmc_group_info {
	uint32_t tokens_per_block;  /* 0: not given */
	int64_t sw_size_tokens;     /* -1: not a sliding window */
	uint32_t n_layers;
	int recurrent;
};

struct lmc_register {
	uint64_t instance_id;
	uint32_t n_tensors;
	struct lmc_tensor *tensors; /* owned */
	char model[LMC_MAX_NAME];
	uint32_t world;
	char engine[32];
	char kv_layout[16];         /* layout_hints.kv_layout, "" when absent */
	char kv_list_layout[16];    /* layout_hints.kv_list_layout */
	uint32_t hint_tokens_per_block;
	uint32_t n_groups;
	struct lmc_group_info groups[LMC_MAX_GROUPS];
};

/* block_ids: list[list[int]], one list per engine group. */
struct lmc_blocks {
	uint32_t n_groups;
	uint32_t n[LMC_MAX_GROUPS];
	uint32_t *ids[LMC_MAX_GROUPS]; /* owned */
};

/* A decoded request.  Which fields are set depends on op.id. */
struct lmc_req {
	struct lmc_opname op;
	struct lmc_key key;           /* store, retrieve, lookup, free_lookup_locks */
	struct lmc_register reg;      /* register_kv_cache */
	struct lmc_blocks blocks;     /* store, retrieve */
	uint64_t instance_id;         /* unregister, store, retrieve, ping */
	int instance_nil;             /* ping(None) */
	uint64_t skip_tokens;         /* retrieve */
	uint8_t event[LMC_MAX_HANDLE];/* store, retrieve: the engine's event_ipc_handle */
	uint32_t event_len;
	double timeout_s;             /* wait_prefetch_status */
	char request_id[LMC_MAX_NAME];/* query/wait_prefetch_status, end_session */
	int force;                    /* clear */
};

/* The operation frame.  0, or -EINVAL (not an int or str; a name too long). */
int lmc_decode_op(const void *p, size_t n, struct lmc_opname *op);

/* The payload count op.id takes in this protocol version, or -1 for an
 * operation this front end does not serve. */
int lmc_arity(int op);

/* The payload count op takes in 0.5.6's protocol, served here or not
 * (register_q_cache: 7), or -1 for an operation number 0.5.6 does not have. */
int lmc_wire_arity(int op);

/* Decodes the n payload frames of a request whose op frame gave op.
 * 0, or a negative errno with a message (the field named) in why:
 * -EPROTO (a frame that is not what the protocol says), -E2BIG (a count
 * or length above the bounds).  On success *req owns allocations:
 * lmc_req_free.  On failure nothing is left allocated. */
int lmc_decode(const struct lmc_opname *op, const void *const *frames, const size_t *lens,
	       size_t n, struct lmc_req *req, char *why, size_t why_len);
void lmc_req_free(struct lmc_req *req);

/* Reply payloads, as msgpack into buf (cap bytes).  The length, or -ENOSPC. */
int lmc_enc_uint(void *buf, size_t cap, uint64_t v);
int lmc_enc_bool(void *buf, size_t cap, int v);
int lmc_enc_nil(void *buf, size_t cap);
int lmc_enc_str(void *buf, size_t cap, const char *s);
int lmc_enc_str_array(void *buf, size_t cap, const char *const *s, size_t n);
int lmc_enc_handle_ok(void *buf, size_t cap, const void *handle, size_t hlen, int ok);

/* " (in LMCache 0.5.0's numbering, #N was NAME)" for an operation number
 * that release used, or NULL: the words a refusal of an older client adds.
 * The text lives until the thread's next call. */
const char *lmc_old_op_name(int op);

/* The name of a known operation ("lookup"), or NULL. */
const char *lmc_op_name(int op);

/* Element size of a torch dtype name ("bfloat16": 2), or 0. */
uint32_t lmc_dtype_size(const char *dtype);

#endif
