/* disk_trust.c - what the disk tier trusts: the disk file, its MAC key
 * file, and the chunk MAC (kvt_disk_trust.h).
 *
 * The threat: another local user (another uid on the node).  The segment
 * keeps them out by owner and mode (SECURITY.md); the disk file holds the
 * same bytes -- every demoted chunk, everyone's prompts' KV -- and outlives
 * the segment, so it gets the same rules and one more: what is read back
 * must be provably the tier's own writing.
 *
 * The file.  Opened with O_NOFOLLOW (a planted symbolic link is refused:
 * it could point root's daemon at any file, and --disk-reset would format
 * it) and O_NONBLOCK (a FIFO at the path is refused by its type instead of
 * blocking the open), then checked on the descriptor, never on the path
 * again: a regular file owned by the caller's euid, with no access for
 * group or others (mode & 077 == 0: reading it is reading every chunk),
 * with one name (a hard link is another path to the same bytes); or a
 * block device owned by root or the euid with no access for others (a
 * group, such as `disk`, may share it).  A file this code creates is made
 * with O_EXCL and set to 0600 whatever the umask.  Nothing is fixed
 * silently: a file that breaks a rule is refused with the rule and the
 * fix in the message, because a file readable by others until now may
 * already have leaked, and one writable by others may hold forgeries.
 *
 * The MAC.  Checksums (XXH3) find torn writes; they cannot stop a forger,
 * who recomputes them.  Every chunk on disk carries a tag:
 * ChaCha20-Poly1305 (RFC 8439) with an empty plaintext, the header below
 * and the payload as associated data -- an authenticator with a 256-bit
 * secret key and a 96-bit nonce drawn at random per write (the record
 * stores it; random, not a counter, because a counter restarted from the
 * record table after a crash would repeat a nonce for other bytes, and a
 * repeated Poly1305 key lets a forger who saw both tags make new ones).
 * The associated data binds the tag to the layout fingerprint, the chunk
 * key, its depth and the geometry, so neither a chunk of another key, nor
 * of another model, nor an extent moved under another record verifies.
 * Why this one: a cryptographic MAC from a well-kept library (OpenSSL's
 * libcrypto, Debian's libssl-dev) that keeps up with an NVMe on one core:
 * measured here (AMD EPYC, AVX-512) on 1 MiB, ChaCha20-Poly1305 as a MAC
 * 12.1 GB/s, AES-256-GCM as GMAC 6.8, HMAC-SHA-256 1.8, BLAKE2b-MAC 0.8,
 * KMAC-128 0.4 GB/s (libsodium 1.0.18's Poly1305 has no AVX-512 path).
 * The disk engine checks on its one thread; HMAC would halve a drive.
 *
 * The key.  32 random bytes (getrandom) in a key file beside the disk
 * file (`<disk>.key`, or `disk-key`; a block device needs it named):
 * the same rules as the file (owner, mode 0600 or stricter, one name, no
 * link), exactly 32 bytes.  It is made only when the disk is formatted;
 * the superblock carries a check tag of the key, so a disk opened with
 * another key, or without its key, is refused with that said (its chunks
 * could not be verified), never read as a disk of misses.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "kvt_disk.h"
#include "kvt_disk_trust.h"

int kvt_disk_eset(char *err, size_t len, int code, const char *fmt, ...)
{
	va_list ap;

	if (err && len) {
		va_start(ap, fmt);
		vsnprintf(err, len, fmt, ap);
		va_end(ap);
	}
	return code;
}

/* ---- the files ---- */

int kvt_disk_stat_check(const char *what, const char *path, const struct stat *st,
			char *err, size_t len)
{
	unsigned mode = (unsigned)st->st_mode & 07777;
	uid_t me = geteuid();

	if (S_ISDIR(st->st_mode))
		return kvt_disk_eset(err, len, -EISDIR, "%s %s is a directory: give a file or a block "
			    "device", what, path);
	if (S_ISBLK(st->st_mode)) {
		if (st->st_uid != 0 && st->st_uid != me)
			return kvt_disk_eset(err, len, -EPERM, "%s %s: the block device is owned by uid "
				    "%u, neither root nor this process's (%u): refused", what, path,
				    (unsigned)st->st_uid, (unsigned)me);
		if (mode & 007)
			return kvt_disk_eset(err, len, -EPERM, "%s %s: the block device has mode %04o: "
				    "other users can read or write it (every chunk demoted to it, "
				    "or forged ones): chmod o-rwx it (a udev rule)", what, path, mode);
		return 0;
	}
	if (!S_ISREG(st->st_mode))
		return kvt_disk_eset(err, len, -EINVAL, "%s %s is neither a regular file nor a block "
			    "device (a FIFO, a socket or a character device such as /dev/null "
			    "cannot hold chunks)", what, path);
	if (st->st_uid != me)
		return kvt_disk_eset(err, len, -EPERM, "%s %s is owned by uid %u, not by this process's "
			    "uid %u: another user could read the chunks in it or plant forged "
			    "ones; remove it (or chown it, if it is yours)", what, path,
			    (unsigned)st->st_uid, (unsigned)me);
	if (mode & 077)
		return kvt_disk_eset(err, len, -EPERM, "%s %s has mode %04o: other users can %s it; "
			    "chmod 600 it (if others could write it, format it: --disk-reset)",
			    what, path, mode, mode & 022 ? "write" : "read");
	if (st->st_nlink != 1)
		return kvt_disk_eset(err, len, -EMLINK, "%s %s has %lu names (hard links): another path "
			    "reaches its bytes; give it one name", what, path,
			    (unsigned long)st->st_nlink);
	return 0;
}

int kvt_disk_file_open(const char *what, const char *path, int rw, int create, int *created,
		       struct stat *st, char *err, size_t len)
{
	int base = (rw ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, fd, r;

	if (created)
		*created = 0;
	for (int tries = 0;; tries++) {
		fd = open(path, base);
		if (fd >= 0 || errno != ENOENT || !create || tries > 2)
			break;
		fd = open(path, base | O_CREAT | O_EXCL, 0600);
		if (fd >= 0) {
			if (created)
				*created = 1;
			/* the umask may have narrowed it; nothing may widen it */
			if (fchmod(fd, 0600)) {
				r = -errno;
				close(fd);
				unlink(path);
				return kvt_disk_eset(err, len, r, "%s %s: %s", what, path, strerror(-r));
			}
			break;
		}
		if (errno != EEXIST)
			break;
		/* made by someone else meanwhile: open that one and check it */
	}
	if (fd < 0) {
		r = -errno;
		if (r == -ELOOP)
			return kvt_disk_eset(err, len, -ELOOP, "%s %s is a symbolic link: refused (a link "
				    "could point the tier at another file; give the real path)",
				    what, path);
		if (r == -ENOENT)
			return kvt_disk_eset(err, len, r, "%s %s: no such file", what, path);
		return kvt_disk_eset(err, len, r, "%s %s: %s%s", what, path, strerror(-r),
			    rw && (r == -EACCES || r == -EROFS || r == -EPERM) ?
			    " (the disk tier needs to write it: a read-only file or file system "
			    "cannot hold it)" : "");
	}
	if (fstat(fd, st)) {
		r = -errno;
		close(fd);
		return kvt_disk_eset(err, len, r, "%s %s: %s", what, path, strerror(-r));
	}
	if ((r = kvt_disk_stat_check(what, path, st, err, len))) {
		close(fd);
		return r;
	}
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK)) {
		r = -errno;
		close(fd);
		return kvt_disk_eset(err, len, r, "%s %s: fcntl: %s", what, path, strerror(-r));
	}
	return fd;
}

int kvt_disk_key_path(const char *disk_path, const struct stat *disk_st, const char *given,
		      char *out, size_t out_len, char *err, size_t len)
{
	int n;

	if (given && *given)
		n = snprintf(out, out_len, "%s", given);
	else if (S_ISBLK(disk_st->st_mode))
		return kvt_disk_eset(err, len, -EINVAL, "disk %s is a block device: name the file of its "
			    "MAC key (disk-key = PATH, e.g. in the service's state directory; "
			    "it is made when the disk is formatted)", disk_path);
	else
		n = snprintf(out, out_len, "%s.key", disk_path);
	if (n < 0 || (size_t)n >= out_len)
		return kvt_disk_eset(err, len, -ENAMETOOLONG, "disk key path longer than %zu bytes",
			    out_len - 1);
	return 0;
}

int kvt_disk_key_load(const char *path, int create, uint8_t key[KVT_MAC_KEY_BYTES],
		      int *created, char *err, size_t len)
{
	struct stat st;
	int made = 0, fd, r;

	*created = 0;
	fd = kvt_disk_file_open("disk key", path, create, create, &made, &st, err, len);
	if (fd < 0)
		return fd == -ENOENT ? -ENOKEY : fd;
	if (made) {
		uint8_t k[KVT_MAC_KEY_BYTES];
		if (getrandom(k, sizeof(k), 0) != (ssize_t)sizeof(k) ||
		    write(fd, k, sizeof(k)) != (ssize_t)sizeof(k) || fsync(fd)) {
			r = errno ? -errno : -EIO;
			close(fd);
			unlink(path);
			OPENSSL_cleanse(k, sizeof(k));
			return kvt_disk_eset(err, len, r, "disk key %s: writing a new key: %s", path,
				    strerror(-r));
		}
		memcpy(key, k, sizeof(k));
		OPENSSL_cleanse(k, sizeof(k));
		close(fd);
		*created = 1;
		return 0;
	}
	if (st.st_size != KVT_MAC_KEY_BYTES) {
		close(fd);
		return kvt_disk_eset(err, len, -EINVAL, "disk key %s holds %lld bytes, a key is %d: not a "
			    "kvtier disk key", path, (long long)st.st_size, KVT_MAC_KEY_BYTES);
	}
	ssize_t got = pread(fd, key, KVT_MAC_KEY_BYTES, 0);
	r = got < 0 ? -errno : 0;
	close(fd);
	if (got != KVT_MAC_KEY_BYTES)
		return kvt_disk_eset(err, len, r ? r : -EIO, "disk key %s: %s", path,
			    r ? strerror(-r) : "short read");
	return 0;
}

/* ---- the MAC ---- */

struct kvt_mac {
	EVP_CIPHER_CTX *c;         /* sealing: a MAC, or encrypting (the L3's) */
	EVP_CIPHER_CTX *d;         /* opening an encrypted object (the L3's) */
	uint8_t key[KVT_MAC_KEY_BYTES];
};

kvt_mac *kvt_mac_new(const uint8_t key[KVT_MAC_KEY_BYTES])
{
	kvt_mac *m = OPENSSL_zalloc(sizeof(*m));

	if (!m)
		return NULL;
	m->c = EVP_CIPHER_CTX_new();
	m->d = EVP_CIPHER_CTX_new();
	if (!m->c || !m->d ||
	    EVP_EncryptInit_ex(m->c, EVP_chacha20_poly1305(), NULL, NULL, NULL) != 1 ||
	    EVP_DecryptInit_ex(m->d, EVP_chacha20_poly1305(), NULL, NULL, NULL) != 1) {
		kvt_mac_free(m);
		return NULL;
	}
	memcpy(m->key, key, KVT_MAC_KEY_BYTES);
	return m;
}

void kvt_mac_free(kvt_mac *m)
{
	if (!m)
		return;
	EVP_CIPHER_CTX_free(m->c);
	EVP_CIPHER_CTX_free(m->d);
	OPENSSL_clear_free(m, sizeof(*m));
}

int kvt_mac_nonce(uint8_t nonce[KVT_MAC_NONCE_BYTES])
{
	/* getrandom of a few bytes never blocks once the pool is up (it is,
	 * long before a daemon starts) and is a syscall per chunk: noise
	 * beside a chunk's I/O. */
	return getrandom(nonce, KVT_MAC_NONCE_BYTES, 0) == KVT_MAC_NONCE_BYTES ? 0 : -EIO;
}

int kvt_mac_begin(kvt_mac *m, const uint8_t nonce[KVT_MAC_NONCE_BYTES])
{
	return EVP_EncryptInit_ex(m->c, NULL, NULL, m->key, nonce) == 1 ? 0 : -EIO;
}

int kvt_mac_derive(kvt_mac *m, const void *info, size_t n, uint8_t sub[KVT_MAC_KEY_BYTES])
{
	unsigned int len = 0;

	return HMAC(EVP_sha256(), m->key, KVT_MAC_KEY_BYTES, info, n, sub, &len) &&
	       len == KVT_MAC_KEY_BYTES ? 0 : -EIO;
}

int kvt_mac_begin_sub(kvt_mac *m, const uint8_t sub[KVT_MAC_KEY_BYTES],
		      const uint8_t nonce[KVT_MAC_NONCE_BYTES])
{
	return EVP_EncryptInit_ex(m->c, NULL, NULL, sub, nonce) == 1 ? 0 : -EIO;
}

/* EVP's lengths are ints: pieces of at most 1 GiB.  dec: the opening
 * context; out NULL: associated data. */
static int crypt_update(EVP_CIPHER_CTX *c, int dec, void *out, const void *in, size_t n)
{
	const uint8_t *b = in;
	uint8_t *o = out;
	int got;

	while (n) {
		int step = n > (1u << 30) ? 1 << 30 : (int)n;
		if ((dec ? EVP_DecryptUpdate(c, o, &got, b, step)
			 : EVP_EncryptUpdate(c, o, &got, b, step)) != 1)
			return -EIO;
		b += step;
		if (o)
			o += step;
		n -= (size_t)step;
	}
	return 0;
}

int kvt_mac_update(kvt_mac *m, const void *p, size_t n)
{
	return crypt_update(m->c, 0, NULL, p, n);
}

int kvt_mac_encrypt(kvt_mac *m, void *out, const void *in, size_t n)
{
	return crypt_update(m->c, 0, out, in, n);
}

int kvt_mac_open_begin(kvt_mac *m, const uint8_t sub[KVT_MAC_KEY_BYTES],
		       const uint8_t nonce[KVT_MAC_NONCE_BYTES])
{
	return EVP_DecryptInit_ex(m->d, NULL, NULL, sub, nonce) == 1 ? 0 : -EIO;
}

int kvt_mac_open_aad(kvt_mac *m, const void *p, size_t n)
{
	return crypt_update(m->d, 1, NULL, p, n);
}

int kvt_mac_decrypt(kvt_mac *m, void *out, const void *in, size_t n)
{
	return crypt_update(m->d, 1, out, in, n);
}

int kvt_mac_open_final(kvt_mac *m, const uint8_t tag[KVT_MAC_TAG_BYTES])
{
	uint8_t none[16];
	int out = 0;

	if (EVP_CIPHER_CTX_ctrl(m->d, EVP_CTRL_AEAD_SET_TAG, KVT_MAC_TAG_BYTES,
				(void *)tag) != 1)
		return -EIO;
	return EVP_DecryptFinal_ex(m->d, none, &out) == 1 ? 0 : -EBADMSG;
}

int kvt_mac_final(kvt_mac *m, uint8_t tag[KVT_MAC_TAG_BYTES])
{
	uint8_t none[16];
	int out = 0;

	if (EVP_EncryptFinal_ex(m->c, none, &out) != 1 ||
	    EVP_CIPHER_CTX_ctrl(m->c, EVP_CTRL_AEAD_GET_TAG, KVT_MAC_TAG_BYTES, tag) != 1)
		return -EIO;
	return 0;
}

int kvt_disk_mac_rate(uint64_t bytes, double secs, double *bytes_per_s)
{
	uint8_t key[KVT_MAC_KEY_BYTES] = { 1 }, nonce[KVT_MAC_NONCE_BYTES] = { 2 };
	uint8_t tag[KVT_MAC_TAG_BYTES];
	uint8_t *buf = malloc(bytes ? bytes : 1);
	kvt_mac *m = kvt_mac_new(key);
	struct timespec a, b;
	double t = 0, done = 0;
	int r = buf && m ? 0 : -ENOMEM;

	if (!r)
		memset(buf, 0x6b, bytes);
	clock_gettime(CLOCK_MONOTONIC, &a);
	while (!r && t < secs) {
		r = kvt_mac_begin(m, nonce);
		if (!r)
			r = kvt_mac_update(m, buf, bytes);
		if (!r)
			r = kvt_mac_final(m, tag);
		done += (double)bytes;
		clock_gettime(CLOCK_MONOTONIC, &b);
		t = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
	}
	*bytes_per_s = !r && t > 0 ? done / t : 0;
	kvt_mac_free(m);
	free(buf);
	return r;
}

void kvt_mac_wipe(void *p, size_t n)
{
	OPENSSL_cleanse(p, n);
}

int kvt_mac_equal(const uint8_t a[KVT_MAC_TAG_BYTES], const uint8_t b[KVT_MAC_TAG_BYTES])
{
	return CRYPTO_memcmp(a, b, KVT_MAC_TAG_BYTES) == 0;
}
