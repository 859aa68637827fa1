/* disk_names.c - the disk tier's option names (kvt_disk.h), shared by the
 * engine and by builds without io_uring. */
#include <errno.h>
#include <string.h>

#include "kvt_disk.h"

const char *kvt_disk_admit_name(uint32_t a)
{
	switch (a) {
	case KVT_ADMIT_ALL: return "all";
	case KVT_ADMIT_SECOND_HIT: return "second-hit";
	case KVT_ADMIT_NONE: return "none";
	default: return "?";
	}
}

int kvt_disk_admit_parse(const char *s, uint32_t *out)
{
	for (uint32_t a = 0; a <= KVT_ADMIT_NONE; a++)
		if (s && !strcmp(s, kvt_disk_admit_name(a))) {
			*out = a;
			return 0;
		}
	return -EINVAL;
}

int kvt_disk_direct_parse(const char *s, uint32_t *out)
{
	static const char *const names[] = { "auto", "on", "off" };

	for (uint32_t i = 0; i < 3; i++)
		if (s && !strcmp(s, names[i])) {
			*out = i;
			return 0;
		}
	return -EINVAL;
}

