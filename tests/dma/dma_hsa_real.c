/* dma_hsa_real.c - the hsa backend against the real ROCr runtime
 * (Debian's libhsa-runtime64-1) on a machine without an AMD GPU: it must
 * report "unavailable" with hsa_init's status, and auto must fall back to
 * the host backend, without crashing.  Exit 77 (skipped) when the runtime
 * is not installed, or when /dev/kfd exists (a GPU machine: not this test's
 * case). */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvt_dma.h"

#define CHECK(cond) do { if (!(cond)) { \
	fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
	return 1; } } while (0)

static char logged[2048];

static void capture(void *arg, int level, const char *msg)
{
	(void)arg;
	(void)level;
	snprintf(logged, sizeof(logged), "%s", msg);
}

int main(void)
{
	struct kvt_dma_config c = { .size = sizeof(c), .device = -1, .log = capture };
	const char *err;
	kvt_dma *d = NULL;
	void *h;
	int rc;

	unsetenv("KVTIER_HSA_LIBRARY");
	unsetenv("KVTIER_DMA");
	h = dlopen("libhsa-runtime64.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		printf("SKIP: libhsa-runtime64.so.1 not installed (%s)\n", dlerror());
		return 77;
	}
	dlclose(h);
	if (access("/dev/kfd", F_OK) == 0) {
		printf("SKIP: /dev/kfd exists: this machine may have an AMD GPU\n");
		return 77;
	}

	c.backend = "hsa";
	rc = kvt_dma_open(&c, &d);
	err = kvt_dma_last_error();
	printf("open(hsa) = %d: %s\n", rc, err);
	CHECK(rc == -ENODEV);
	CHECK(d == NULL);
	/* the reason an operator can act on, then ROCr's own */
	CHECK(strstr(err, "no AMD GPU found: /dev/kfd does not exist") != NULL);
	CHECK(strstr(err, "hsa_init: status 0x") != NULL);
	/* no /dev/kfd: HSA_STATUS_ERROR_OUT_OF_RESOURCES (RUNTIMES.md) */
	CHECK(strstr(err, "0x1008") != NULL);

	/* twice: a failed hsa_init leaves nothing behind that breaks the next */
	CHECK(kvt_dma_open(&c, &d) == -ENODEV);

	c.backend = "auto";
	rc = kvt_dma_open(&c, &d);
	CHECK(rc == 0);
	printf("auto: %s\n", kvt_dma_describe(d));
	CHECK(strcmp(kvt_dma_backend(d), "host") == 0);
	CHECK(strstr(kvt_dma_describe(d), "hsa: no AMD GPU found") != NULL);
	CHECK(strstr(kvt_dma_describe(d), "status 0x1008") != NULL);
	CHECK(strstr(logged, "auto: took host") != NULL);
	kvt_dma_close(d);
	return 0;
}
