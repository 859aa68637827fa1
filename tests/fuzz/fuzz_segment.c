/* fuzz_segment.c - attach to a segment file holding arbitrary bytes.  The
 * input is the file's head (header, tables); the file is extended with
 * zeros to the size its header claims (up to 64 MiB) so that inputs get
 * past the size check into the tables, and when the input's last byte is
 * even the header checksum is recomputed over the mutated header, so that
 * mutations of the geometry and the tables are judged on their own
 * merits rather than all stopped by the checksum.  Attach must fail with an error or
 * succeed on a segment every later call is safe on: kvt_check, a lookup,
 * stats, detach.  Never a crash, an out-of-bounds read or a hang. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <stddef.h>

#include "kvt_core.h"
#include "kvt_format.h" /* the header, to re-checksum it */

#define CLAIMED_MAX (64ull << 20)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static char name[64], path[96];
	struct kvt_seg_attach_opts a;
	kvt_seg *s = NULL;
	uint64_t claimed = 0;
	int fd;

	if (!name[0]) {
		snprintf(name, sizeof(name), "fuzz-seg-%d", (int)getpid());
		snprintf(path, sizeof(path), "/kvtier.%s", name);
	}
	fd = shm_open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
	if (fd < 0)
		return 0;
	if (size && write(fd, data, size) != (ssize_t)size) {
		close(fd);
		return 0;
	}
	if (size >= sizeof(struct kvt_hdr) && !(data[size - 1] & 1)) {
		struct kvt_hdr h;
		memcpy(&h, data, sizeof(h));
		h.checksum = kvt__hdr_checksum(&h);
		(void)!pwrite(fd, &h.checksum, sizeof(h.checksum),
			      offsetof(struct kvt_hdr, checksum));
	}
	/* header.total_size is the 8 bytes at offset 16 (struct kvt_hdr) */
	if (size >= 24)
		memcpy(&claimed, data + 16, 8);
	if (claimed > size && claimed <= CLAIMED_MAX)
		(void)!ftruncate(fd, (off_t)claimed);
	close(fd);

	memset(&a, 0, sizeof(a));
	a.size = sizeof(a);
	a.name = name;
	a.role = KVT_ROLE_OBSERVER;
	if (kvt_seg_attach(&a, &s) == 0) {
		char msg[256];
		kvt_key k = { 1, 2 };
		uint64_t lease = 0;
		(void)kvt_check(s, msg, sizeof(msg));
		(void)kvt_seg_live_ranks(s);
		(void)kvt_seg_lookup(s, &k, 1, &lease);
		kvt_seg_detach(s);
	}
	shm_unlink(path);
	return 0;
}
