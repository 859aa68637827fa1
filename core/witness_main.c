/* witness_main.c - kvtier-witness, the exit witness of one rank
 * (witness.c has the design).  Started by libkvtier, never by hand:
 *
 *   fd 3  the rank's lock description (an open of the segment file)
 *   fd 4  a pidfd of the rank
 *   fd 5  the handshake pipe: one byte 'w' once 3 and 4 checked out
 *
 * It closes everything else, then waits for the pidfd to poll readable
 * (the rank wholly exited) and exits, dropping its reference to the lock.
 * Every signal is blocked by the spawner; SIGKILL alone ends it early.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

static int usage(const char *why)
{
	fprintf(stderr, "kvtier-witness: %s: this helper is started by libkvtier for a "
		"rank with a GPU backend (fd 3: the segment, fd 4: the rank's pidfd, "
		"fd 5: the handshake); it is not a command\n", why);
	return 2;
}

int main(void)
{
	struct stat st;
	struct pollfd p;
	char buf[64];
	ssize_t n;
	const char w = 'w';

	if (syscall(SYS_close_range, 6, ~0U, 0) < 0)
		for (long fd = 6, max = sysconf(_SC_OPEN_MAX); fd < max; fd++)
			(void)close((int)fd);
	if (fstat(3, &st) < 0 || !S_ISREG(st.st_mode))
		return usage("fd 3 is not the segment file");
	n = readlink("/proc/self/fd/4", buf, sizeof(buf) - 1);
	if (n >= 0) {
		buf[n] = 0;
		if (strcmp(buf, "anon_inode:[pidfd]"))
			return usage("fd 4 is not a pidfd");
	} else if (fcntl(4, F_GETFD) < 0) {
		return usage("fd 4 is not open");
	}
	if (write(5, &w, 1) != 1)
		return usage("fd 5 is not the handshake pipe");
	close(5);
	p.fd = 4;
	p.events = POLLIN;
	for (;;) {
		p.revents = 0;
		if (poll(&p, 1, -1) == 1)
			return 0;
		if (errno != EINTR && errno != EAGAIN)
			return 1;
	}
}
