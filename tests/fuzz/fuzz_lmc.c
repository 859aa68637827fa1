/* fuzz_lmc.c - kvtierd's LMCache front end's parser (tier/daemon/
 * lmc_wire.c): the frames of one request as a client's DEALER sends them,
 * decoded as the front end decodes them.  An input is frames, each a
 * 2-byte little-endian length and that many bytes: the first the
 * operation, the rest its payloads (tests/fuzz/corpus/lmc holds the
 * frames LMCache 0.5.6's own client sent for every RPC the engines use,
 * recorded by tests/lmcache/record_corpus.py).  On success every decoded
 * field is within the bounds lmc_wire.h promises. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lmc_wire.h"

#define CHECK(c) \
	do { \
		if (!(c)) { \
			fprintf(stderr, "fuzz_lmc.c:%d: %s\n", __LINE__, #c); \
			abort(); \
		} \
	} while (0)

static void check_str(const char *s, size_t cap)
{
	CHECK(memchr(s, 0, cap) != NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const void *fr[17];
	size_t len[17], n = 0, off = 0;
	struct lmc_opname op;
	struct lmc_req q;
	char why[256];

	while (n < 17 && off + 2 <= size) {
		size_t l = (size_t)data[off] | (size_t)data[off + 1] << 8;
		off += 2;
		if (l > size - off)
			l = size - off;
		fr[n] = data + off;
		len[n++] = l;
		off += l;
	}
	if (!n || lmc_decode_op(fr[0], len[0], &op))
		return 0;
	check_str(op.name, sizeof(op.name));
	CHECK(op.id >= 0 && op.id < LMC_OP_MAX);
	if (lmc_decode(&op, fr + 1, len + 1, n - 1, &q, why, sizeof(why))) {
		check_str(why, sizeof(why));
		CHECK(why[0]); /* a refusal always says why */
		return 0;
	}
	CHECK((int)(n - 1) == lmc_arity(op.id));
	check_str(q.key.model, sizeof(q.key.model));
	check_str(q.key.request_id, sizeof(q.key.request_id));
	check_str(q.key.salt, sizeof(q.key.salt));
	CHECK(q.key.n_tokens <= LMC_MAX_TOKENS);
	if (q.key.n_tokens)
		CHECK(q.key.tokens != NULL);
	for (uint32_t i = 0; i < q.key.n_tokens; i++)
		(void)q.key.tokens[i]; /* every one readable (ASan) */
	CHECK(q.reg.n_tensors <= LMC_MAX_LAYERS);
	for (uint32_t i = 0; i < q.reg.n_tensors; i++) {
		CHECK(q.reg.tensors[i].ndim <= LMC_MAX_DIMS);
		check_str(q.reg.tensors[i].shm_name, sizeof(q.reg.tensors[i].shm_name));
		check_str(q.reg.tensors[i].dtype, sizeof(q.reg.tensors[i].dtype));
		check_str(q.reg.tensors[i].device_uuid, sizeof(q.reg.tensors[i].device_uuid));
		CHECK(q.reg.tensors[i].ipc_len <= LMC_MAX_HANDLE);
		CHECK(q.reg.tensors[i].ipc_event_len <= LMC_MAX_HANDLE);
	}
	CHECK(q.event_len <= LMC_MAX_HANDLE);
	CHECK(q.reg.n_groups <= LMC_MAX_GROUPS);
	CHECK(q.blocks.n_groups <= LMC_MAX_GROUPS);
	for (uint32_t g = 0; g < q.blocks.n_groups; g++) {
		CHECK(q.blocks.n[g] <= LMC_MAX_BLOCKS);
		for (uint32_t i = 0; i < q.blocks.n[g]; i++)
			CHECK(q.blocks.ids[g][i] != UINT32_MAX);
	}
	lmc_req_free(&q);
	return 0;
}
