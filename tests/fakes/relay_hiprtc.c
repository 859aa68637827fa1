/* relay_hiprtc.c - libhiprtc.so.6 for the tests: HIP's run-time compiler
 * API (the entry points kvtier's dma/src/hiprtc.c uses), each compile
 * relayed to the real hiprtc in a process of its own (hiprtc_run.c).
 *
 * Why a relay.  The tests run kvtier on the fake HSA and HIP runtimes, which
 * are named like the real ones (libhsa-runtime64.so.1, libamdhip64.so.5).
 * Debian's hiprtc lives inside its real libamdhip64.so.5, which needs the
 * real libhsa-runtime64.so.1: loaded into a process that has the fake, the
 * loader binds it to the fake by soname and refuses it ("version ROCR_1
 * not found").  In a process of its own it compiles, without a GPU.  So the
 * code object the fake HIP loads is the real compiler's, from the real
 * source: a syntax error, an unknown target or a changed parameter list
 * fails the tests as it would fail on a node.
 *
 * The helper is $KVT_HIPRTC_RUN, or the one built beside this library
 * (HIPRTC_RUN, its path at build time).  Protocol: the options as
 * arguments, the source on stdin, the code object on stdout, the log on
 * stderr; exit 0 compiled, 1 not compiled, 2 no real hiprtc.
 */
#include <errno.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>

#define EXPORT __attribute__((visibility("default")))

extern char **environ;

enum {
	HIPRTC_SUCCESS = 0,
	HIPRTC_ERROR_OUT_OF_MEMORY = 1,
	HIPRTC_ERROR_INVALID_INPUT = 3,
	HIPRTC_ERROR_INVALID_PROGRAM = 4,
	HIPRTC_ERROR_COMPILATION = 6,
	HIPRTC_ERROR_INTERNAL_ERROR = 11,
};

#define PROG_MAGIC 0x4b56545254437072ull

struct prog {
	uint64_t magic;
	char *src;
	char *code, *log;
	size_t code_len, log_len;
};

EXPORT const char *hiprtcGetErrorString(int r)
{
	switch (r) {
	case HIPRTC_SUCCESS:
		return "HIPRTC_SUCCESS";
	case HIPRTC_ERROR_OUT_OF_MEMORY:
		return "HIPRTC_ERROR_OUT_OF_MEMORY";
	case HIPRTC_ERROR_INVALID_INPUT:
		return "HIPRTC_ERROR_INVALID_INPUT";
	case HIPRTC_ERROR_INVALID_PROGRAM:
		return "HIPRTC_ERROR_INVALID_PROGRAM";
	case HIPRTC_ERROR_COMPILATION:
		return "HIPRTC_ERROR_COMPILATION";
	default:
		return "HIPRTC_ERROR_INTERNAL_ERROR";
	}
}

EXPORT int hiprtcVersion(int *major, int *minor)
{
	if (!major || !minor)
		return HIPRTC_ERROR_INVALID_INPUT;
	*major = 6; /* as the library's name says */
	*minor = 0;
	return HIPRTC_SUCCESS;
}

static struct prog *prog_of(void *p)
{
	struct prog *g = p;

	return g && g->magic == PROG_MAGIC ? g : NULL;
}

EXPORT int hiprtcCreateProgram(void **out, const char *src, const char *name, int n_headers,
			       const char **headers, const char **include_names)
{
	struct prog *g;

	(void)name;
	(void)headers;
	(void)include_names;
	if (!out || !src || n_headers)
		return HIPRTC_ERROR_INVALID_INPUT;
	g = calloc(1, sizeof(*g));
	if (!g || !(g->src = strdup(src))) {
		free(g);
		return HIPRTC_ERROR_OUT_OF_MEMORY;
	}
	g->magic = PROG_MAGIC;
	*out = g;
	return HIPRTC_SUCCESS;
}

EXPORT int hiprtcDestroyProgram(void **p)
{
	struct prog *g = p ? prog_of(*p) : NULL;

	if (!g)
		return HIPRTC_ERROR_INVALID_PROGRAM;
	g->magic = 0;
	free(g->src);
	free(g->code);
	free(g->log);
	free(g);
	*p = NULL;
	return HIPRTC_SUCCESS;
}

/* the whole of a memfd, malloc'ed */
static char *slurp(int fd, size_t *len)
{
	struct stat st;
	char *b;

	if (fstat(fd, &st) || !(b = malloc((size_t)st.st_size + 1)))
		return NULL;
	if (pread(fd, b, (size_t)st.st_size, 0) != st.st_size) {
		free(b);
		return NULL;
	}
	b[st.st_size] = 0;
	*len = (size_t)st.st_size;
	return b;
}

EXPORT int hiprtcCompileProgram(void *p, int n_opts, const char **opts)
{
	struct prog *g = prog_of(p);
	const char *run = getenv("KVT_HIPRTC_RUN");
	int in, out, err, status = 0, rc = HIPRTC_ERROR_INTERNAL_ERROR;
	posix_spawn_file_actions_t fa;
	char **argv;
	pid_t pid;

	if (!g || n_opts < 0 || (n_opts && !opts))
		return HIPRTC_ERROR_INVALID_INPUT;
	if (!run || !*run)
		run = HIPRTC_RUN;
	in = memfd_create("hiprtc-src", MFD_CLOEXEC);
	out = memfd_create("hiprtc-code", MFD_CLOEXEC);
	err = memfd_create("hiprtc-log", MFD_CLOEXEC);
	argv = calloc((size_t)n_opts + 2, sizeof(*argv));
	if (in < 0 || out < 0 || err < 0 || !argv ||
	    write(in, g->src, strlen(g->src)) != (ssize_t)strlen(g->src))
		goto done;
	argv[0] = (char *)run;
	for (int i = 0; i < n_opts; i++)
		argv[i + 1] = (char *)opts[i];
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, in, 0);
	posix_spawn_file_actions_adddup2(&fa, out, 1);
	posix_spawn_file_actions_adddup2(&fa, err, 2);
	lseek(in, 0, SEEK_SET);
	if (posix_spawn(&pid, run, &fa, NULL, argv, environ)) {
		posix_spawn_file_actions_destroy(&fa);
		goto done;
	}
	posix_spawn_file_actions_destroy(&fa);
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	free(g->code);
	free(g->log);
	g->code = slurp(out, &g->code_len);
	g->log = slurp(err, &g->log_len);
	if (!WIFEXITED(status)) {
		fprintf(stderr, "relay hiprtc: %s died (status %#x)\n", run, status);
	} else if (WEXITSTATUS(status) == 0 && g->code && g->code_len) {
		rc = HIPRTC_SUCCESS;
	} else {
		rc = WEXITSTATUS(status) == 1 ? HIPRTC_ERROR_COMPILATION
					      : HIPRTC_ERROR_INTERNAL_ERROR;
		free(g->code);
		g->code = NULL;
		g->code_len = 0;
	}
done:
	free(argv);
	if (in >= 0)
		close(in);
	if (out >= 0)
		close(out);
	if (err >= 0)
		close(err);
	return rc;
}

EXPORT int hiprtcGetCodeSize(void *p, size_t *n)
{
	struct prog *g = prog_of(p);

	if (!g || !n)
		return HIPRTC_ERROR_INVALID_INPUT;
	if (!g->code)
		return HIPRTC_ERROR_INVALID_PROGRAM;
	*n = g->code_len;
	return HIPRTC_SUCCESS;
}

EXPORT int hiprtcGetCode(void *p, char *code)
{
	struct prog *g = prog_of(p);

	if (!g || !code)
		return HIPRTC_ERROR_INVALID_INPUT;
	if (!g->code)
		return HIPRTC_ERROR_INVALID_PROGRAM;
	memcpy(code, g->code, g->code_len);
	return HIPRTC_SUCCESS;
}

EXPORT int hiprtcGetProgramLogSize(void *p, size_t *n)
{
	struct prog *g = prog_of(p);

	if (!g || !n)
		return HIPRTC_ERROR_INVALID_INPUT;
	*n = (g->log ? g->log_len : 0) + 1;
	return HIPRTC_SUCCESS;
}

EXPORT int hiprtcGetProgramLog(void *p, char *log)
{
	struct prog *g = prog_of(p);

	if (!g || !log)
		return HIPRTC_ERROR_INVALID_INPUT;
	if (g->log)
		memcpy(log, g->log, g->log_len);
	log[g->log ? g->log_len : 0] = 0;
	return HIPRTC_SUCCESS;
}
