/* fuzz_config.c - kvtierd's config file (tier/daemon/options.c: libinih
 * behind our line reader).  Any bytes: the parse returns 0 with every
 * value in its range, or -EINVAL; never a crash, a hang, a read past the
 * input or a leak (kvtd_opts_free takes every copy). */
#include <assert.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "kvt_core.h"
#include "options.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct opts o;

	memset(&o, 0, sizeof(o));
	int r = kvtd_config_parse(&o, "fuzz.conf", (const char *)data, size);
	assert(r == 0 || r == -EINVAL);
	if (!r) {
		assert(o.world <= KVT_MAX_WORLD && o.instances <= KVT_MAX_INSTANCES);
		assert(o.n_groups <= 8);
		assert(!o.segment || !kvt_seg_name_valid(o.segment));
		assert(!o.disk_path || *o.disk_path);
		assert(o.disk_depth <= 4096);
		assert(o.http_port || !o.http_addr[0]);
	}
	kvtd_opts_free(&o);
	return 0;
}
