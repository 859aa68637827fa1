/* disk_off.c - kvt_disk.h in a build without liburing (KVTIER_WITH_URING
 * off, or liburing-dev missing): every way into the disk tier says so, and
 * nothing half works.  scripts/deps.sh installs liburing-dev. */
#include <errno.h>
#include <stdio.h>

#include "kvt_disk.h"

static int off(char *err, size_t len)
{
	if (err && len)
		snprintf(err, len, "the disk tier needs io_uring: this kvtier was built without "
			 "liburing (install liburing-dev and rebuild)");
	return -ENOSYS;
}

int kvt_disk_plan(const char *path, uint64_t bytes, uint64_t shard_bytes, uint32_t n_shards,
		  uint64_t *chunks, char *err, size_t len)
{
	(void)path; (void)bytes; (void)shard_bytes; (void)n_shards;
	*chunks = 0;
	return off(err, len);
}

int kvt_disk_open(kvt_seg *s, const struct kvt_disk_opts *o, kvt_disk **out,
		  char *err, size_t len)
{
	(void)s; (void)o; (void)out;
	return off(err, len);
}

int kvt_disk_poll(kvt_disk *d) { (void)d; return -ENOSYS; }
int kvt_disk_mac_rate(uint64_t b, double s, double *r) { (void)b; (void)s; *r = 0; return -ENOSYS; }
int kvt_disk_event_fd(const kvt_disk *d) { (void)d; return -1; }
int kvt_disk_drain(kvt_disk *d, int all, int64_t t) { (void)d; (void)all; (void)t; return -ENOSYS; }
void kvt_disk_close(kvt_disk *d) { (void)d; }
void kvt_disk_info(const kvt_disk *d, struct kvt_disk_info *o)
{
	(void)d;
	*o = (struct kvt_disk_info){ 0 };
}
