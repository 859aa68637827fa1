/* A program an engine team would write against the installed kvtier:
 * built by tests/install/check.sh with `pkg-config --cflags --libs kvtier`
 * only.  Creates a small segment, hashes a prompt, looks it up (a miss),
 * reads the stats, removes the segment. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <kvtier.h>

int main(void)
{
	struct kvt_group_desc g = { .n_layers = 2, .bytes_per_token = 64, .tokens_per_block = 16 };
	struct kvt_config c;
	struct kvt_stats st;
	char name[64];
	kvt_tier *t;
	uint32_t tokens[512];
	kvt_key keys[8];
	kvt_lease_id lease;

	snprintf(name, sizeof(name), "install-hello-%d", (int)getpid());
	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.flags = KVT_F_CREATE | KVT_F_NO_ENV;
	c.role = KVT_TIER_CLIENT;
	c.instance = -1;
	c.rank = -1;
	c.world = 1;
	c.chunk_tokens = 64;
	c.segment = name;
	c.n_groups = 1;
	c.groups = &g;
	c.n_slots = 16;
	if (kvt_open(&c, &t)) {
		fprintf(stderr, "kvt_open: %s\n", kvt_last_error());
		return 1;
	}
	for (int i = 0; i < 512; i++)
		tokens[i] = (uint32_t)i * 7u;
	int n = kvt_hash_tokens(t, tokens, 512, NULL, keys, 8);
	int hits = kvt_lookup(t, keys, (uint32_t)n, &lease);
	st.size = sizeof(st);
	kvt_stats(t, &st);
	printf("keys %d hits %d lookups %llu slots %llu\n", n, hits,
	       (unsigned long long)st.lookups, (unsigned long long)st.slots);
	kvt_close(t);
	kvt_unlink(name, NULL);
	return n == 8 && hits == 0 && st.lookups == 1 && st.slots == 16 ? 0 : 1;
}
