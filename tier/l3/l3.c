/* l3.c - the L3 tier's common part (kvt_l3.h): the backend chosen by the
 * URL's scheme, store keys, and the objects' seal (header and tag). */
#include "kvt_l3_int.h"
#include "kvt_disk_trust.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

_Static_assert(sizeof(struct kvt_l3_hdr) == KVT_L3_HDR_SIZE, "the header is 64 bytes");

struct kvt_l3 {
	const struct kvt_l3_ops *ops;
	void *be;
};

static const struct kvt_l3_ops *const backends[] = {
#ifdef KVTIER_HAVE_HIREDIS
	&kvt__l3_redis_ops,
#endif
	&kvt__l3_mooncake_ops,
	NULL,
};

int kvt_l3_open(const struct kvt_l3_conf *c, kvt_l3 **out, char *err, size_t len)
{
	kvt_l3 *l;
	int rc;

	err[0] = 0;
	*out = NULL;
	if (!c || c->size < sizeof(*c) || !c->url)
		return snprintf(err, len, "l3: no configuration or URL"), -EINVAL;
	for (size_t i = 0; backends[i]; i++) {
		if (strncmp(c->url, backends[i]->scheme, strlen(backends[i]->scheme)))
			continue;
		l = calloc(1, sizeof(*l));
		if (!l)
			return snprintf(err, len, "out of memory"), -ENOMEM;
		l->ops = backends[i];
		rc = l->ops->open(c, &l->be, err, len);
		if (rc) {
			free(l);
			return rc;
		}
		*out = l;
		return 0;
	}
	if (!strncmp(c->url, "redis://", 8))
		return snprintf(err, len, "l3 %s: kvtier was built without hiredis "
				"(libhiredis-dev)", c->url), -ENOSYS;
	return snprintf(err, len, "l3 %s: unknown scheme (redis://HOST:PORT[,HOST:PORT...] or "
			"mooncake://MASTER[:PORT][?...])", c->url), -EINVAL;
}

int kvt_l3_submit(kvt_l3 *l, struct kvt_l3_req *const *reqs, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		const struct kvt_l3_req *q = reqs[i];

		if (!q || q->op < KVT_L3_PUT || q->op > KVT_L3_EXISTS || q->iovcnt > 8 ||
		    (q->op != KVT_L3_EXISTS && (!q->key[0] || !q->iovcnt || !q->iov)) ||
		    (q->op == KVT_L3_EXISTS && (!q->keys || !q->n_keys || q->n_keys > 64)))
			return -EINVAL;
	}
	return l->ops->submit(l->be, reqs, n);
}

int kvt_l3_reap(kvt_l3 *l, struct kvt_l3_req **done, uint32_t max)
{
	return l->ops->reap(l->be, done, max);
}

int kvt_l3_event_fd(const kvt_l3 *l)
{
	return l->ops->event_fd(l->be);
}

void kvt_l3_status(kvt_l3 *l, struct kvt_l3_status *out)
{
	memset(out, 0, sizeof(*out));
	l->ops->status(l->be, out);
}

void kvt_l3_close(kvt_l3 *l)
{
	if (!l)
		return;
	l->ops->close(l->be);
	free(l);
}

/* ---- the backends' lists ---- */

void kvt__l3_list_add(struct kvt_l3_list *l, struct kvt_l3_req *q)
{
	q->next = NULL;
	if (l->tail)
		l->tail->next = q;
	else
		l->head = q;
	l->tail = q;
	l->n++;
}

struct kvt_l3_req *kvt__l3_list_pop(struct kvt_l3_list *l)
{
	struct kvt_l3_req *q = l->head;

	if (!q)
		return NULL;
	l->head = q->next;
	if (!l->head)
		l->tail = NULL;
	l->n--;
	q->next = NULL;
	return q;
}

uint32_t kvt__l3_enqueue(struct kvt_l3_list *l, struct kvt_l3_req *const *reqs, uint32_t n,
			 uint32_t room, uint64_t now_ns)
{
	uint32_t i;

	for (i = 0; i < n && l->n < room; i++) {
		struct kvt_l3_req *q = reqs[i];
		q->ask = -1;
		q->hops = 0;
		q->got = 0;
		q->status = -EINPROGRESS;
		q->t0 = now_ns;
		kvt__l3_list_add(l, q);
	}
	return i;
}

uint32_t kvt__l3_take_done(struct kvt_l3_list *l, struct kvt_l3_req **done, uint32_t max,
			   int efd)
{
	uint32_t n = 0;

	while (n < max && l->head)
		done[n++] = kvt__l3_list_pop(l);
	if (l->head)
		(void)!write(efd, &(uint64_t){ 1 }, sizeof(uint64_t)); /* more to take */
	return n;
}

/* ---- keys and objects ---- */

void kvt_l3_key(char out[KVT_L3_KEY_MAX], uint64_t fingerprint, const kvt_key *k,
		uint32_t shard)
{
	/* the hash tag {...}: every shard of a chunk on one master */
	snprintf(out, KVT_L3_KEY_MAX, "kvt:{%016" PRIx64 "%016" PRIx64 "%016" PRIx64 "}:%u",
		 fingerprint, k->hi, k->lo, shard);
}

struct kvt_l3_sealer {
	kvt_mac *mac;
};

int kvt_l3_seal_open(const char *key_path, int create, kvt_l3_sealer **out, int *created,
		     char *err, size_t len)
{
	uint8_t key[KVT_MAC_KEY_BYTES];
	kvt_l3_sealer *s;
	int made = 0, rc;

	*out = NULL;
	rc = kvt_disk_key_load(key_path, create, key, &made, err, len);
	if (created)
		*created = made;
	if (rc)
		return rc;
	s = calloc(1, sizeof(*s));
	if (!s || !(s->mac = kvt_mac_new(key))) {
		free(s);
		kvt_mac_wipe(key, sizeof(key));
		return snprintf(err, len, "l3: the MAC could not be set up"), -ENOMEM;
	}
	kvt_mac_wipe(key, sizeof(key));
	*out = s;
	return 0;
}

void kvt_l3_seal_close(kvt_l3_sealer *s)
{
	if (!s)
		return;
	kvt_mac_free(s->mac);
	free(s);
}

static int tag_of(kvt_l3_sealer *s, const struct kvt_l3_hdr *h, const void *payload,
		  uint8_t tag[KVT_L3_TAG_SIZE])
{
	if (kvt_mac_begin(s->mac, h->nonce) || kvt_mac_update(s->mac, h, sizeof(*h)) ||
	    kvt_mac_update(s->mac, payload, h->payload) || kvt_mac_final(s->mac, tag))
		return -EIO;
	return 0;
}

static int hdr_make(struct kvt_l3_hdr *h, uint32_t version, uint64_t fingerprint,
		    const kvt_key *k, uint32_t shard, uint32_t n_shards, uint32_t depth,
		    uint64_t len)
{
	if (len > UINT32_MAX)
		return -EMSGSIZE;
	memset(h, 0, sizeof(*h));
	h->magic = KVT_L3_MAGIC;
	h->fingerprint = fingerprint;
	h->key_lo = k->lo;
	h->key_hi = k->hi;
	h->shard = shard;
	h->n_shards = n_shards;
	h->depth = depth;
	h->version = version;
	h->payload = (uint32_t)len;
	return kvt_mac_nonce(h->nonce) ? -EIO : 0;
}

int kvt_l3_seal_pieces(kvt_l3_sealer *s, uint8_t hdr[KVT_L3_HDR_SIZE], const void *payload,
		       uint8_t tag[KVT_L3_TAG_SIZE], uint64_t fingerprint, const kvt_key *k,
		       uint32_t shard, uint32_t n_shards, uint32_t depth, uint64_t len)
{
	struct kvt_l3_hdr h;
	int r = hdr_make(&h, KVT_L3_CLEAR, fingerprint, k, shard, n_shards, depth, len);

	if (r)
		return r;
	memcpy(hdr, &h, sizeof(h));
	return tag_of(s, &h, payload, tag);
}

/* An encrypted object's key: HMAC-SHA-256 under the fleet key of what the
 * object is (layout, chunk key, shard) -- so a nonce drawn twice repeats a
 * keystream only between two objects of the same chunk and shard, which
 * hold the same bytes (the same prefix), never between two prompts. */
static int sub_key(kvt_l3_sealer *s, const struct kvt_l3_hdr *h, uint8_t sub[32])
{
	struct { char what[16]; uint64_t fp, lo, hi; uint32_t shard, n_shards; } info;

	memset(&info, 0, sizeof(info));
	memcpy(info.what, "kvtier l3 v2", 12);
	info.fp = h->fingerprint;
	info.lo = h->key_lo;
	info.hi = h->key_hi;
	info.shard = h->shard;
	info.n_shards = h->n_shards;
	return kvt_mac_derive(s->mac, &info, sizeof(info), sub);
}

int kvt_l3_encrypt_pieces(kvt_l3_sealer *s, uint8_t hdr[KVT_L3_HDR_SIZE], const void *payload,
			  void *ct, uint8_t tag[KVT_L3_TAG_SIZE], uint64_t fingerprint,
			  const kvt_key *k, uint32_t shard, uint32_t n_shards, uint32_t depth,
			  uint64_t len)
{
	struct kvt_l3_hdr h;
	int r = hdr_make(&h, KVT_L3_ENCRYPTED, fingerprint, k, shard, n_shards, depth, len);

	if (r)
		return r;
	memcpy(hdr, &h, sizeof(h));
	uint8_t sub[KVT_MAC_KEY_BYTES];
	r = sub_key(s, &h, sub) || kvt_mac_begin_sub(s->mac, sub, h.nonce) ||
	    kvt_mac_update(s->mac, &h, sizeof(h)) || kvt_mac_encrypt(s->mac, ct, payload, len) ||
	    kvt_mac_final(s->mac, tag) ? -EIO : 0;
	kvt_mac_wipe(sub, sizeof(sub));
	return r;
}

int kvt_l3_check_pieces(kvt_l3_sealer *s, const uint8_t hdr[KVT_L3_HDR_SIZE], void *payload,
			const uint8_t tag[KVT_L3_TAG_SIZE], uint64_t fingerprint,
			const kvt_key *k, uint32_t shard, uint32_t n_shards, uint32_t depth,
			uint64_t len)
{
	struct kvt_l3_hdr h;
	uint8_t want[KVT_L3_TAG_SIZE];

	memcpy(&h, hdr, sizeof(h));
	if (h.magic != KVT_L3_MAGIC ||
	    (h.version != KVT_L3_CLEAR && h.version != KVT_L3_ENCRYPTED) ||
	    h.fingerprint != fingerprint || h.key_lo != k->lo || h.key_hi != k->hi ||
	    h.shard != shard || h.n_shards != n_shards || h.payload != len ||
	    (depth != KVT_L3_ANY_DEPTH && h.depth != depth))
		return -EBADMSG;
	if (h.version == KVT_L3_ENCRYPTED) { /* decrypted in place, then the tag */
		uint8_t sub[KVT_MAC_KEY_BYTES];
		int r = sub_key(s, &h, sub) || kvt_mac_open_begin(s->mac, sub, h.nonce) ||
			kvt_mac_open_aad(s->mac, &h, sizeof(h)) ||
			kvt_mac_decrypt(s->mac, payload, payload, len) ||
			kvt_mac_open_final(s->mac, tag) ? -EBADMSG : 0;
		kvt_mac_wipe(sub, sizeof(sub));
		return r;
	}
	if (tag_of(s, &h, payload, want) || !kvt_mac_equal(want, tag))
		return -EBADMSG;
	return 0;
}

int kvt_l3_seal(kvt_l3_sealer *s, uint8_t *obj, uint64_t fingerprint, const kvt_key *k,
		uint32_t shard, uint32_t n_shards, uint32_t depth, uint64_t payload)
{
	return kvt_l3_seal_pieces(s, obj, obj + KVT_L3_HDR_SIZE, obj + KVT_L3_HDR_SIZE + payload,
				  fingerprint, k, shard, n_shards, depth, payload);
}

int kvt_l3_open_obj(kvt_l3_sealer *s, uint8_t *obj, uint64_t len, uint64_t fingerprint,
		    const kvt_key *k, uint32_t shard, uint32_t n_shards, uint64_t payload)
{
	if (len != KVT_L3_HDR_SIZE + payload + KVT_L3_TAG_SIZE)
		return -EBADMSG;
	return kvt_l3_check_pieces(s, obj, obj + KVT_L3_HDR_SIZE, obj + KVT_L3_HDR_SIZE + payload,
				   fingerprint, k, shard, n_shards, KVT_L3_ANY_DEPTH, payload);
}
