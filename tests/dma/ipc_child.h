/* ipc_child.h - the exporter child of the IPC tests (dma_ipc.c: CUDA,
 * dma_ipc_hip.c: HIP): forked at setup, it exports its device memory and
 * events, sends what it exported up a pipe, and stays -- its memory and
 * events alive -- until teardown tells it to go; it exits 0 if all went
 * well.  Static: each test includes it once.  And the handles they open. */
#ifndef KVT_TEST_IPC_CHILD_H
#define KVT_TEST_IPC_CHILD_H
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static int to_child[2], from_child[2];
static pid_t child;

/* In the child: sends the n bytes at ex, then waits for teardown's word. */
static void child_publish_and_wait(const void *ex, size_t n)
{
	char c;

	if (write(from_child[1], ex, n) != (ssize_t)n)
		_exit(5);
	if (read(to_child[0], &c, 1) < 0)
		_exit(6);
}

/* Forks exporter (which calls child_publish_and_wait) and reads what it
 * exported into ex; 0 or -1. */
static int child_start(void (*exporter)(void), void *ex, size_t n)
{
	if (pipe(to_child) || pipe(from_child))
		return -1;
	child = fork();
	if (child == 0)
		exporter();
	return child < 0 || read(from_child[0], ex, n) != (ssize_t)n ? -1 : 0;
}

/* Lets the child go; 0 if it exited 0. */
static int child_stop(void)
{
	int st = 0;

	if (write(to_child[1], "x", 1) != 1)
		kill(child, SIGKILL);
	waitpid(child, &st, 0);
	return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* A DMA handle of that backend, bound to device (-1: unbound), quiet.
 * (kvt_dma.h and cmocka.h included first.) */
static kvt_dma *open_dma(const char *backend, int device)
{
	struct kvt_dma_config c;
	kvt_dma *d = NULL;

	memset(&c, 0, sizeof(c));
	c.size = sizeof(c);
	c.backend = backend;
	c.device = device;
	c.flags = KVT_DMA_F_QUIET;
	assert_int_equal(kvt_dma_open(&c, &d), 0);
	return d;
}
#endif
