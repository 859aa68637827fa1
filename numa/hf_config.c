/* hf_config.c - a Hugging Face config.json, as far as sizing needs it.
 *
 * A config is untrusted input: every field is type-checked and
 * range-checked, and a config we cannot size (no attention fields, hybrid
 * linear attention, an indexer whose layers we cannot count) is an error
 * that says which field, never a guess.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/stat.h>
#include <unistd.h>
#include <json-c/json.h>

#include "kvt_size.h"
#include "numa_internal.h"

#define MAX_CONFIG_BYTES (16u << 20)

/* json_tokener_get_parse_end() arrived in json-c 0.15; older ones keep the
 * offset in the (then public) tokener struct. */
#if JSON_C_VERSION_NUM >= ((0 << 16) | (15 << 8))
#define parse_end(tok) json_tokener_get_parse_end(tok)
#else
#define parse_end(tok) ((size_t)(tok)->char_offset)
#endif

/* A positive integer field.  Absent or null: -ENOENT (the caller decides
 * whether that is an error).  Present but not an integer in 1..max: -EINVAL. */
static int get_u32(json_object *o, const char *what, const char *key, uint32_t max,
		   uint32_t *out)
{
	json_object *v;
	int64_t x;

	if (!json_object_object_get_ex(o, key, &v) || v == NULL)
		return -ENOENT;
	if (!json_object_is_type(v, json_type_int))
		return kvt__numa_err(-EINVAL, "%s: field %s must be an integer, not %s", what,
				     key, json_object_to_json_string(v));
	errno = 0;
	x = json_object_get_int64(v);
	if (x < 1 || (uint64_t)x > max)
		return kvt__numa_err(-EINVAL, "%s: field %s = %lld is out of range 1..%u",
				     what, key, (long long)x, max);
	*out = (uint32_t)x;
	return 0;
}

static int need_u32(json_object *o, const char *what, const char *key, uint32_t max,
		    uint32_t *out)
{
	int r = get_u32(o, what, key, max, out);

	if (r == -ENOENT)
		return kvt__numa_err(-EINVAL, "%s: missing field %s", what, key);
	return r;
}

static const char *get_str(json_object *o, const char *key)
{
	json_object *v;

	if (!json_object_object_get_ex(o, key, &v) || !json_object_is_type(v, json_type_string))
		return NULL;
	return json_object_get_string(v);
}

static int has(json_object *o, const char *key)
{
	json_object *v;

	return json_object_object_get_ex(o, key, &v) && v != NULL;
}

/* The "full" entries of indexer_types (GLM-5.2: the other layers reuse the
 * top-k of the previous full layer and keep no indexer cache). */
static int count_indexer_types(json_object *a, const char *what, uint32_t layers,
			       uint32_t *out)
{
	size_t n;
	uint32_t full = 0;

	if (!json_object_is_type(a, json_type_array))
		return kvt__numa_err(-EINVAL, "%s: indexer_types must be an array", what);
	n = json_object_array_length(a);
	if (n != layers)
		return kvt__numa_err(-EINVAL, "%s: indexer_types has %zu entries for %u layers",
				     what, n, layers);
	for (size_t i = 0; i < n; i++) {
		json_object *e = json_object_array_get_idx(a, i);
		const char *s = json_object_is_type(e, json_type_string) ?
				json_object_get_string(e) : NULL;

		if (s && !strcmp(s, "full"))
			full++;
		else if (!s || strcmp(s, "shared"))
			return kvt__numa_err(-EINVAL, "%s: indexer_types[%zu] is %s, expected "
					     "\"full\" or \"shared\"", what, i,
					     json_object_to_json_string(e));
	}
	if (!full)
		return kvt__numa_err(-EINVAL, "%s: indexer_types has no \"full\" layer", what);
	*out = full;
	return 0;
}

/* DeepSeek V4 (vLLM's vllm/models/deepseek_v4): which layers compress, from
 * compress_ratios (DeepSeek's config.json: one entry per layer, then the
 * MTP layer's) or transformers' layer_types. */
static int parse_dsv4(json_object *o, const char *what, struct kvt_model *m)
{
	json_object *v;
	uint32_t rope = 64;
	int r;

	m->attn = KVT_ATTN_MLA;
	m->dsv4 = 1;
	if ((r = need_u32(o, what, "head_dim", 65536, &m->head_dim)) ||
	    (r = need_u32(o, what, "sliding_window", 1u << 20, &m->window)) ||
	    (r = need_u32(o, what, "index_head_dim", 65536, &m->index_head_dim)))
		return r;
	r = get_u32(o, what, "qk_rope_head_dim", 65536, &rope);
	if (r && r != -ENOENT)
		return r;
	if (rope >= m->head_dim || !m->window)
		return kvt__numa_err(-EINVAL, "%s: head_dim %u, qk_rope_head_dim %u, "
				     "sliding_window %u", what, m->head_dim, rope, m->window);
	m->kv_lora_rank = m->head_dim - rope;
	m->qk_rope_head_dim = rope;
	if (json_object_object_get_ex(o, "compress_ratios", &v) &&
	    json_object_is_type(v, json_type_array)) {
		if (json_object_array_length(v) < m->layers)
			return kvt__numa_err(-EINVAL, "%s: compress_ratios has %zu entries for %u "
					     "layers", what, json_object_array_length(v), m->layers);
		for (uint32_t i = 0; i < m->layers; i++) {
			json_object *e = json_object_array_get_idx(v, i);
			int64_t x = json_object_is_type(e, json_type_int) ?
				    json_object_get_int64(e) : -1;

			if (x == 4)
				m->c4_layers++;
			else if (x == 128)
				m->c128_layers++;
			else if (x != 0 && x != 1)
				return kvt__numa_err(-ENOTSUP, "%s: compress_ratios[%u] is %lld: "
						     "vLLM's DeepSeek V4 compresses by 4 or 128",
						     what, i, (long long)x);
		}
	} else if (json_object_object_get_ex(o, "layer_types", &v) &&
		   json_object_is_type(v, json_type_array) &&
		   json_object_array_length(v) >= m->layers) {
		for (uint32_t i = 0; i < m->layers; i++) {
			const char *t = json_object_get_string(json_object_array_get_idx(v, i));

			if (t && !strcmp(t, "compressed_sparse_attention"))
				m->c4_layers++;
			else if (t && !strcmp(t, "heavily_compressed_attention"))
				m->c128_layers++;
			else if (!t || strcmp(t, "sliding_attention"))
				return kvt__numa_err(-ENOTSUP, "%s: layer_types[%u] is %s", what,
						     i, t ? t : "not a string");
		}
	} else {
		return kvt__numa_err(-EINVAL, "%s: DeepSeek V4 without compress_ratios or "
				     "layer_types: which layers compress is not in the config",
				     what);
	}
	m->indexer_layers = m->c4_layers; /* the indexer is the 4-token layers' */
	if (!m->indexer_layers)
		m->index_head_dim = 0;
	return kvt_model_check(m);
}

static int parse_obj(json_object *root, const char *what, struct kvt_model *m)
{
	json_object *o = root, *v;
	const char *s;
	uint32_t hidden = 0;
	int r;

	memset(m, 0, sizeof(*m));
	if (!json_object_is_type(root, json_type_object))
		return kvt__numa_err(-EINVAL, "%s: not a JSON object", what);
	/* Multimodal configs keep the language model in text_config. */
	if (!has(root, "num_hidden_layers") &&
	    json_object_object_get_ex(root, "text_config", &v) &&
	    json_object_is_type(v, json_type_object))
		o = v;

	s = get_str(o, "model_type");
	if (!s)
		s = get_str(root, "model_type");
	snprintf(m->model_type, sizeof(m->model_type), "%s", s ? s : "unknown");
	if (json_object_object_get_ex(root, "architectures", &v) &&
	    json_object_is_type(v, json_type_array) && json_object_array_length(v) > 0 &&
	    json_object_is_type(json_object_array_get_idx(v, 0), json_type_string))
		snprintf(m->arch, sizeof(m->arch), "%s",
			 json_object_get_string(json_object_array_get_idx(v, 0)));
	else
		snprintf(m->arch, sizeof(m->arch), "%s", m->model_type);

	if (!has(o, "num_hidden_layers") && !has(o, "num_attention_heads"))
		return kvt__numa_err(-ENOTSUP, "%s: no num_hidden_layers or "
				     "num_attention_heads: not a transformer config kvtier-size "
				     "knows (model_type %s)", what, m->model_type);
	if ((r = need_u32(o, what, "num_hidden_layers", 4096, &m->layers)))
		return r;
	if (!strcmp(m->model_type, "deepseek_v4")) {
		s = get_str(o, "torch_dtype");
		if (s && kvt_dtype_parse(s, &m->dtype))
			m->dtype = KVT_DTYPE_AUTO;
		return parse_dsv4(o, what, m);
	}

	/* Hybrid models whose other layers keep a recurrent state, not KV. */
	if (json_object_object_get_ex(o, "layer_types", &v) &&
	    json_object_is_type(v, json_type_array)) {
		for (size_t i = 0; i < json_object_array_length(v); i++) {
			const char *t = json_object_get_string(json_object_array_get_idx(v, i));

			if (t && strcmp(t, "full_attention") && strcmp(t, "sliding_attention"))
				return kvt__numa_err(-ENOTSUP, "%s: layer_types[%zu] is \"%s\": "
						     "hybrid models with non-attention layers "
						     "are not sized", what, i, t);
		}
	}

	s = get_str(o, "torch_dtype");
	if (!s)
		s = get_str(o, "dtype");
	if (!s && o != root)
		s = get_str(root, "torch_dtype");
	if (s && kvt_dtype_parse(s, &m->dtype))
		m->dtype = KVT_DTYPE_AUTO; /* e.g. "float64": the user picks --kv-dtype */

	if (has(o, "kv_lora_rank")) {
		m->attn = KVT_ATTN_MLA;
		if ((r = need_u32(o, what, "kv_lora_rank", 65536, &m->kv_lora_rank)) ||
		    (r = need_u32(o, what, "qk_rope_head_dim", 65536, &m->qk_rope_head_dim)))
			return r;
	} else {
		m->attn = KVT_ATTN_GQA;
		if (!has(o, "num_attention_heads"))
			return kvt__numa_err(-ENOTSUP, "%s: neither num_attention_heads (MHA/GQA) "
					     "nor kv_lora_rank (MLA): cannot size model_type %s",
					     what, m->model_type);
		if ((r = need_u32(o, what, "num_attention_heads", 65536, &m->n_heads)))
			return r;
		r = get_u32(o, what, "num_key_value_heads", 65536, &m->n_kv_heads);
		if (r == -ENOENT)
			m->n_kv_heads = m->n_heads; /* MHA configs omit it */
		else if (r)
			return r;
		if (m->n_kv_heads > m->n_heads || m->n_heads % m->n_kv_heads)
			return kvt__numa_err(-EINVAL, "%s: num_key_value_heads %u does not divide "
					     "num_attention_heads %u", what, m->n_kv_heads,
					     m->n_heads);
		r = get_u32(o, what, "head_dim", 65536, &m->head_dim);
		if (r == -ENOENT) {
			if ((r = need_u32(o, what, "hidden_size", 1u << 24, &hidden)))
				return kvt__numa_err(r, "%s: no head_dim, and %s", what,
						     kvt_numa_last_error());
			if (hidden % m->n_heads)
				return kvt__numa_err(-EINVAL, "%s: no head_dim, and hidden_size "
						     "%u is not a multiple of num_attention_heads "
						     "%u", what, hidden, m->n_heads);
			m->head_dim = hidden / m->n_heads;
		} else if (r) {
			return r;
		}
	}

	r = get_u32(o, what, "index_head_dim", 65536, &m->index_head_dim);
	if (r == 0) {
		if (json_object_object_get_ex(o, "indexer_types", &v) && v) {
			if ((r = count_indexer_types(v, what, m->layers, &m->indexer_layers)))
				return r;
		} else {
			uint32_t freq = 1;

			r = get_u32(o, what, "index_topk_freq", 4096, &freq);
			if (r && r != -ENOENT)
				return r;
			if (freq != 1)
				return kvt__numa_err(-ENOTSUP, "%s: index_topk_freq %u without "
						     "indexer_types: which layers own an indexer "
						     "cache is not in the config (pass "
						     "--indexer-layers N)", what, freq);
			m->indexer_layers = m->layers;
		}
	} else if (r != -ENOENT) {
		return r;
	}
	return kvt_model_check(m);
}

int kvt_model_parse(const char *json, const char *what, struct kvt_model *out)
{
	struct json_tokener *tok;
	json_object *root;
	enum json_tokener_error err;
	struct kvt_model m;
	size_t len, end;
	int r;

	if (!json || !out)
		return kvt__numa_err(-EINVAL, "kvt_model_parse: NULL argument");
	if (!what)
		what = "config";
	len = strlen(json);
	if (len > INT_MAX)
		return kvt__numa_err(-EINVAL, "%s: too large", what);
	tok = json_tokener_new();
	if (!tok)
		return kvt__numa_err(-ENOMEM, "out of memory");
	/* Strict: no trailing commas or single quotes; a config engines would
	 * reject (Python's json) must not be sized here. */
	json_tokener_set_flags(tok, JSON_TOKENER_STRICT);
	root = json_tokener_parse_ex(tok, json, (int)len);
	err = json_tokener_get_error(tok);
	if (!root || err != json_tokener_success) {
		/* A truncated file ends "continue": say so plainly. */
		r = kvt__numa_err(-EINVAL, "%s: not valid JSON (%s at byte %zu)", what,
				  err == json_tokener_continue ? "unexpected end of input" :
				  json_tokener_error_desc(err), parse_end(tok));
		json_object_put(root);
		json_tokener_free(tok);
		return r;
	}
	/* Trailing garbage after the object is malformed too. */
	end = parse_end(tok);
	if (end < len && json[end + strspn(json + end, " \t\r\n")] != '\0') {
		r = kvt__numa_err(-EINVAL, "%s: not valid JSON (text after the object at byte "
				  "%zu)", what, end);
		json_object_put(root);
		json_tokener_free(tok);
		return r;
	}
	json_tokener_free(tok);
	r = parse_obj(root, what, &m);
	json_object_put(root);
	if (r)
		return r;
	*out = m;
	return 0;
}

int kvt_model_load(const char *path, struct kvt_model *out)
{
	struct stat st;
	int fd;
	FILE *f;
	char *buf;
	size_t n;
	int r;

	if (!path || !out)
		return kvt__numa_err(-EINVAL, "kvt_model_load: NULL argument");
	/* Non-blocking open, then a regular file only: a FIFO or a device
	 * would block the tool forever (or feed it endless bytes). */
	fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
	if (fd < 0) {
		r = -errno;
		return kvt__numa_err(r, "%s: %s", path, strerror(-r));
	}
	if (fstat(fd, &st)) {
		r = -errno;
		close(fd);
		return kvt__numa_err(r, "%s: fstat: %s", path, strerror(-r));
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		return kvt__numa_err(-EINVAL, "%s: not a regular file (a config.json is one)",
				     path);
	}
	if (fcntl(fd, F_SETFL, 0) || !(f = fdopen(fd, "r"))) {
		r = -errno;
		close(fd);
		return kvt__numa_err(r, "%s: %s", path, strerror(-r));
	}
	buf = malloc(MAX_CONFIG_BYTES + 1);
	if (!buf) {
		fclose(f);
		return kvt__numa_err(-ENOMEM, "out of memory");
	}
	n = fread(buf, 1, MAX_CONFIG_BYTES + 1, f);
	r = ferror(f) ? -EIO : 0;
	fclose(f);
	if (!r && n > MAX_CONFIG_BYTES)
		r = kvt__numa_err(-EINVAL, "%s: larger than %u MiB: not a config.json", path,
				  MAX_CONFIG_BYTES >> 20);
	else if (r)
		r = kvt__numa_err(r, "%s: read error", path);
	else if (memchr(buf, '\0', n))
		r = kvt__numa_err(-EINVAL, "%s: binary data, not a config.json", path);
	if (!r) {
		buf[n] = '\0';
		r = kvt_model_parse(buf, path, out);
	}
	free(buf);
	return r;
}
