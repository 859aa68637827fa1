/* kvt_disk.h - the disk tier's engine: chunks of the arena demoted to a
 * file (or a block device) through io_uring, and read back on request.
 * Internal to kvtier: kvtierd drives it, kvtier-bench measures it, tests
 * exercise it.  One engine per segment, in the segment's owner
 * (kvt_seg_own): it is the single writer of the segment's disk index
 * (core/diskidx.c).  Not thread-safe: one thread polls it.
 *
 * tier/disk/ owns the engine (disk.c), the trust rules of the disk file,
 * its key file and the chunk MAC (kvt_disk_trust.h, disk_trust.c; the L3
 * seals its objects with that MAC too), the options' names (disk_names.c)
 * and the stand-in of a build without liburing (disk_off.c).  It may call
 * core/ (kvt_core.h), liburing and libcrypto: nothing of the library
 * above it (kvtier.c, config.c, hash.c), of dma/, numa/ or tier/l3/.
 */
#ifndef KVT_DISK_H
#define KVT_DISK_H

#include <stddef.h>
#include <stdint.h>

#include "kvt_core.h"

typedef struct kvt_disk kvt_disk;

enum kvt_disk_admit {
	KVT_ADMIT_ALL = 0,        /* every READY chunk is written once */
	KVT_ADMIT_SECOND_HIT = 1, /* only chunks hit in DRAM, or seen before */
	KVT_ADMIT_NONE = 2,       /* nothing is written; what is on disk is served */
};
enum kvt_disk_direct {
	KVT_DIRECT_AUTO = 0, /* O_DIRECT where the file system has it, else buffered */
	KVT_DIRECT_ON = 1,   /* O_DIRECT or refuse */
	KVT_DIRECT_OFF = 2,  /* buffered (the page cache) */
};

struct kvt_disk_opts {
	size_t size;          /* sizeof(struct kvt_disk_opts) */
	const char *path;     /* file (created if missing) or block device */
	uint64_t bytes;       /* size to create or format; 0: the existing file's */
	uint32_t direct;      /* enum kvt_disk_direct */
	uint32_t admit;       /* enum kvt_disk_admit */
	uint32_t depth;       /* I/Os in flight, 1..4096; 0: 64 */
	uint32_t reset;       /* format a file that holds another layout or size */
	uint32_t scan;        /* slots the demotion scan looks at per poll; 0: 4096 */
	uint32_t close_wait_ms; /* how long close waits for I/O in flight; 0: 30000 */
	/* Messages (warnings, the plan); NULL: stderr. level 0 info, 1 warn. */
	void (*log)(int level, const char *msg, void *arg);
	void *log_arg;
	/* The chunk MAC's key file (disk_trust.c): NULL: `<path>.key` (a block
	 * device needs one given).  Made, mode 0600, when the disk is
	 * formatted; the disk file and the key file must be this euid's,
	 * with no access for others. */
	const char *key_path;
};

/* What a file of `bytes` holds for chunks of n_shards x shard_bytes (its
 * header and record table included): the disk_chunks a segment needs.
 * With bytes == 0, the existing file's size (or its header's, when it is
 * a kvtier disk file).  0 and *chunks, or -errno with a message in err. */
int kvt_disk_plan(const char *path, uint64_t bytes, uint64_t shard_bytes, uint32_t n_shards,
		  uint64_t *chunks, char *err, size_t len);

/* Opens the file, checks or formats it, replays its records into the
 * segment's disk index, sets up io_uring (the arena registered as fixed
 * buffers in pieces of at most 1 GiB, the file registered) and publishes
 * the engine online.  s must be owned by the caller and made with
 * disk_chunks >= the file's chunks.  -EINVAL (an option, or a file that
 * is not a kvtier disk file), -ESTALE (the file holds another layout;
 * opts.reset formats it), -ENOSPC (too small, or no room to allocate it),
 * -EACCES/-EROFS (read-only), -ENOSYS/-EPERM (io_uring refused: seccomp
 * or an old kernel), -ENODEV (no disk tier in the segment), -EOPNOTSUPP
 * (direct forced where the file system has no O_DIRECT); the message
 * -EPERM/-ELOOP/-EISDIR/-EMLINK (the disk file or its key file breaks the
 * file rules: another owner, access for others, a link, not a file or a
 * block device), -ENOKEY (the disk's MAC key file is missing) and
 * -EKEYREJECTED (it holds another key; opts.reset formats the disk);
 * the message names the path and the cause.  Blocks (reads the record
 * table). */
int kvt_disk_open(kvt_seg *s, const struct kvt_disk_opts *o, kvt_disk **out,
		  char *err, size_t len);

/* One round: completions, promotion requests, the demotion scan, record
 * writes, one batched submission, the status page.  Never waits for the
 * disk.  Returns the number of things done (0: idle), or -errno. */
int kvt_disk_poll(kvt_disk *d);

/* A descriptor that becomes readable when I/O completes (an eventfd). */
int kvt_disk_event_fd(const kvt_disk *d);

/* Polls until no I/O is in flight and every record is written (and the
 * demotion scan found nothing to do, with `demote_all`), up to timeout_ns
 * (< 0: no limit).  0 or -ETIMEDOUT. */
int kvt_disk_drain(kvt_disk *d, int demote_all, int64_t timeout_ns);

/* Waits for the I/O in flight (up to opts.close_wait_ms), writes the
 * records, syncs, publishes the tier offline and closes.  I/O still in
 * flight after the wait keeps its shard claims: the kernel may still write
 * into those sub-slots, so the handle s is marked to leave its entry to
 * the reaper (kvt_seg_leave_to_reaper; detach it as usual), and the entry
 * dies -- and is reaped -- only once the device finished.  NULL is
 * ignored. */
void kvt_disk_close(kvt_disk *d);

struct kvt_disk_info {
	uint64_t chunks, used, inflight;
	uint64_t extent_bytes;    /* one chunk of every shard on disk */
	uint64_t file_bytes;
	uint32_t direct, fixed_buffers, admit, depth;
	uint64_t replayed;        /* chunks found in the record table at open */
	uint64_t data_off;        /* extent e at data_off + e x extent_bytes */
	uint64_t shard_bytes;     /* shard s of an extent at + s x shard_bytes */
};
void kvt_disk_info(const kvt_disk *d, struct kvt_disk_info *out);

/* The chunk MAC's speed on this core (bytes/s over `bytes`-byte chunks,
 * about `secs` of work): what the engine's one thread spends per byte
 * written or verified.  0, or -ENOSYS without the disk tier. */
int kvt_disk_mac_rate(uint64_t bytes, double secs, double *bytes_per_s);

const char *kvt_disk_admit_name(uint32_t admit);
/* "all", "second-hit", "none": 0 and *out, -EINVAL. */
int kvt_disk_admit_parse(const char *s, uint32_t *out);
/* "auto", "on", "off". */
int kvt_disk_direct_parse(const char *s, uint32_t *out);

#endif
