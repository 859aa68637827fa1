/* kvt_disk_trust.h - the disk tier's trust rules: how the disk file and
 * its MAC key file are opened and checked, and the chunk MAC
 * (ChaCha20-Poly1305 over associated data only).  The design is at the top
 * of disk_trust.c.  Internal to the disk engine and its tests.
 */
#ifndef KVT_DISK_TRUST_H
#define KVT_DISK_TRUST_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#define KVT_MAC_KEY_BYTES   32
#define KVT_MAC_NONCE_BYTES 12
#define KVT_MAC_TAG_BYTES   16

/* The rules on an open file's stat (what: "disk", "disk key" for the
 * message): a regular file of this euid, mode & 077 == 0, one link; or a
 * block device of root or this euid, no access for others.  0 or -errno
 * (-EPERM, -EISDIR, -EINVAL, -EMLINK) with the rule broken in err. */
int kvt_disk_stat_check(const char *what, const char *path, const struct stat *st,
			char *err, size_t len);

/* Opens path without following a link and without blocking on a FIFO,
 * creating it (O_EXCL, mode 0600) when create and it is missing (*created
 * then 1), and checks it (kvt_disk_stat_check, on the descriptor).
 * Returns the descriptor (O_CLOEXEC, blocking) and its stat, or -errno:
 * -ENOENT (missing, !create), -ELOOP (a symbolic link), the rules'. */
int kvt_disk_file_open(const char *what, const char *path, int rw, int create, int *created,
		       struct stat *st, char *err, size_t len);

/* The key file's path: given, else `<disk>.key`; a block device needs it
 * given (-EINVAL). */
int kvt_disk_key_path(const char *disk_path, const struct stat *disk_st, const char *given,
		      char *out, size_t out_len, char *err, size_t len);

/* Reads the 32-byte key at path (the file rules), or with create makes it
 * (getrandom) when missing (*created 1).  0, -ENOKEY (missing, !create),
 * or -errno with the message in err. */
int kvt_disk_key_load(const char *path, int create, uint8_t key[KVT_MAC_KEY_BYTES],
		      int *created, char *err, size_t len);

typedef struct kvt_mac kvt_mac;
kvt_mac *kvt_mac_new(const uint8_t key[KVT_MAC_KEY_BYTES]);
void kvt_mac_free(kvt_mac *m);
/* A fresh random nonce: 0 or -EIO. */
int kvt_mac_nonce(uint8_t nonce[KVT_MAC_NONCE_BYTES]);
/* begin, update (any number of pieces), final: the tag of the pieces'
 * concatenation under the key and nonce.  0 or -EIO. */
int kvt_mac_begin(kvt_mac *m, const uint8_t nonce[KVT_MAC_NONCE_BYTES]);
int kvt_mac_update(kvt_mac *m, const void *p, size_t n);
int kvt_mac_final(kvt_mac *m, uint8_t tag[KVT_MAC_TAG_BYTES]);
/* The same with a plaintext (the L3's encrypted objects; the disk's
 * chunks are MAC-only), under a subkey: kvt_mac_derive makes it from the
 * key and info (HMAC-SHA-256), kvt_mac_begin_sub starts with it; after the
 * associated data (kvt_mac_update), kvt_mac_encrypt writes n bytes of
 * ciphertext (out may be in), then kvt_mac_final.  Opening: open_begin
 * with the subkey, the associated data, kvt_mac_decrypt (out may be in),
 * and final with the tag: 0, -EBADMSG (the tag does not match: what was
 * decrypted is garbage, to be thrown away), -EIO. */
int kvt_mac_derive(kvt_mac *m, const void *info, size_t n, uint8_t sub[KVT_MAC_KEY_BYTES]);
int kvt_mac_begin_sub(kvt_mac *m, const uint8_t sub[KVT_MAC_KEY_BYTES],
		      const uint8_t nonce[KVT_MAC_NONCE_BYTES]);
int kvt_mac_encrypt(kvt_mac *m, void *out, const void *in, size_t n);
int kvt_mac_open_begin(kvt_mac *m, const uint8_t sub[KVT_MAC_KEY_BYTES],
		       const uint8_t nonce[KVT_MAC_NONCE_BYTES]);
int kvt_mac_open_aad(kvt_mac *m, const void *p, size_t n);
int kvt_mac_decrypt(kvt_mac *m, void *out, const void *in, size_t n);
int kvt_mac_open_final(kvt_mac *m, const uint8_t tag[KVT_MAC_TAG_BYTES]);
/* Zeroes a key's copy (not optimised away). */
void kvt_mac_wipe(void *p, size_t n);
/* Constant-time comparison: 1 equal. */
int kvt_mac_equal(const uint8_t a[KVT_MAC_TAG_BYTES], const uint8_t b[KVT_MAC_TAG_BYTES]);

/* Formats an error message into err (when given) and returns code: the
 * disk engine's and the trust rules' one way of reporting. */
int kvt_disk_eset(char *err, size_t len, int code, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

#endif
